defmodule ExlaRs.Attention.Backward do
  @moduledoc """
  The `Nx.block/4` tag of the fused attention backward pass.

  Its inputs are `q, k, v, kv_len, q_start, o, lse, do` (`o` and `lse` exactly as
  the forward block returned them, `do` the cotangent of `o`, typed like `o`),
  then the forward's optional operands, in the same order. Its output is
  `{dq, dk, dv}`, then `dbias` (shaped and typed like the bias) when `bias_grad`
  is true, then the `u8` workspace when `workspace > 0`
  (`ExlaRs.CustomCall.block_results/3` is that layout). With EXLA it lowers to the
  `exla_rs_flash_attn_bwd` custom call; everywhere else its default function,
  `ExlaRs.Attention.Fallback.backward/9` (to `/13`), computes the same gradients
  in plain Nx.

  The fields mean what they mean in `ExlaRs.Attention.Forward` (with dropout the
  backward regenerates the forward's mask from the same key), plus:

    * `:bias_grad` - whether the block returns `dbias` (requires `has_bias`)
  """

  @enforce_keys [:scale, :softcap, :window_left, :window_right]
  defstruct [
    :scale,
    :softcap,
    :window_left,
    :window_right,
    has_key_mask: false,
    has_bias: false,
    has_alibi: false,
    has_dropout: false,
    dropout_rate: 0.0,
    bias_grad: false,
    workspace: 0
  ]

  @type t :: %__MODULE__{
          scale: float,
          softcap: float,
          window_left: integer,
          window_right: integer,
          has_key_mask: boolean,
          has_bias: boolean,
          has_alibi: boolean,
          has_dropout: boolean,
          dropout_rate: float,
          bias_grad: boolean,
          workspace: non_neg_integer
        }
end
