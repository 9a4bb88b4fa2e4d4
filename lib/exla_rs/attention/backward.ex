defmodule ExlaRs.Attention.Backward do
  @moduledoc """
  The `Nx.block/4` tag of the fused attention backward pass.

  Its inputs are `q, k, v, kv_len, q_start, o, lse, do` (`o` and `lse` exactly as
  the forward block returned them, `do` the cotangent of `o`, typed like `o`) and
  its output is `{dq, dk, dv}`, or `{dq, dk, dv, workspace}` when `workspace > 0`.
  With EXLA it lowers to the `exla_rs_flash_attn_bwd` custom call; everywhere else
  its default function, `ExlaRs.Attention.Fallback.backward/9`, computes the same
  gradients in plain Nx.

  The fields mean what they mean in `ExlaRs.Attention.Forward`.
  """

  @enforce_keys [:scale, :softcap, :window_left, :window_right]
  defstruct [:scale, :softcap, :window_left, :window_right, workspace: 0]

  @type t :: %__MODULE__{
          scale: float,
          softcap: float,
          window_left: integer,
          window_right: integer,
          workspace: non_neg_integer
        }
end
