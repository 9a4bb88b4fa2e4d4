defmodule ExlaRs.Attention.Forward do
  @moduledoc """
  The `Nx.block/4` tag of the fused attention forward pass.

  Its inputs are `q, k, v, kv_len, q_start`, then the optional operands that the
  tag says are present, in the contract's fixed order (`key_mask`, `bias`,
  `alibi_slopes`, `dropout_key`; see `ExlaRs.CustomCall.optional_operands/1`). Its output is
  `{o, lse}`, or `{o, lse, workspace}` when `workspace > 0` (see "The workspace"
  in `ExlaRs.CustomCall`). With EXLA it lowers to the `exla_rs_flash_attn_fwd`
  custom call (see `ExlaRs.CustomCall`); everywhere else its default function,
  `ExlaRs.Attention.Fallback.forward/6` (to `/10`, one argument per optional
  operand), computes the same function in plain Nx.

  All fields are static (they are part of the compiled program):

    * `:scale` - the logit scale, a float exactly representable as f32
    * `:softcap` - logit soft cap, a float exactly representable as f32 (0.0 = off)
    * `:window_left`, `:window_right` - the visible key window around each query's
      position, -1 for unbounded (causal is `window_right: 0`)
    * `:has_key_mask`, `:has_bias`, `:has_alibi` - whether the `key_mask`
      (`{B, Sk}` integer), `bias` (rank-4 float, each dimension 1 or full) and
      `alibi_slopes` (`f32 {H}`) operands are present
    * `:has_dropout` - whether the `dropout_key` operand (`u32 {2}`) is present:
      attention dropout at `:dropout_rate`, a float in `(0, 1)` exactly
      representable as f32 (0.0 without dropout; see "Dropout" in the contract)
    * `:workspace` - bytes of the trailing `u8` workspace result, 0 for none
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
          workspace: non_neg_integer
        }
end
