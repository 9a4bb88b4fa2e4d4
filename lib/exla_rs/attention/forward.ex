defmodule ExlaRs.Attention.Forward do
  @moduledoc """
  The `Nx.block/4` tag of the fused attention forward pass.

  Its inputs are `q, k, v, kv_len, q_start` and its output is `{o, lse}`, or
  `{o, lse, workspace}` when `workspace > 0` (see "The workspace" in
  `ExlaRs.CustomCall`). With EXLA it lowers to the `exla_rs_flash_attn_fwd` custom call
  (see `ExlaRs.CustomCall`); everywhere else its default function,
  `ExlaRs.Attention.Fallback.forward/6`, computes the same function in plain Nx.

  All fields are static (they are part of the compiled program):

    * `:scale` - the logit scale, a float exactly representable as f32
    * `:softcap` - logit soft cap, a float exactly representable as f32 (0.0 = off)
    * `:window_left`, `:window_right` - the visible key window around each query's
      position, -1 for unbounded (causal is `window_right: 0`)
    * `:workspace` - bytes of the trailing `u8` workspace result, 0 for none
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
