defmodule ExlaRs do
  @moduledoc """
  Fused flash-attention kernels for EXLA-compiled Nx programs, as XLA FFI custom calls.

  The native side registers the custom-call targets `exla_rs_flash_attn_fwd` and
  `exla_rs_flash_attn_bwd` (for `Host` and `CUDA`) into the XLA runtimes in this VM: EXLA's
  `libxla_extension.so` and PJRT plugins. That happens at application start when EXLA is
  present, and lazily before our first lowering; `register/1` does it on demand.

  `status/0` tells what was found and done; `mix exla_rs.status` prints it.

  ## Example

      # in a defn, Bumblebee's layout {batch, seq, heads, head_dim}
      defn self_attention(q, k, v, kv_len) do
        ExlaRs.attention(q, k, v, causal: true, kv_len: kv_len)
      end

      ExlaRs.status().nif
      #=> :loaded

      {:ok, runtimes} = ExlaRs.register()   # after EXLA started: its libxla_extension
      Enum.map(runtimes, & &1.state)
      #=> [:registered]

  The guides: [Getting started](getting-started.md) (install, `mix exla_rs.status`, a first
  call), the [custom-call contract](flash-attention-contract.md) and
  [Performance](performance.md).
  """

  # -- Runtime registration and status ------------------------------------------------------

  @doc """
  Finds the XLA runtimes in this VM and registers our handlers there (idempotent; safe from
  many processes at once). Returns `{:ok, runtimes}` or `{:error, %ExlaRs.RegistrationError{}}`.
  See `ExlaRs.Registration.register/1` for the options (`:plugin`, `:paths`, `:retry`).
  """
  defdelegate register(opts \\ []), to: ExlaRs.Registration

  @doc "Like `register/1`, raising `ExlaRs.RegistrationError` on failure."
  def register!(opts \\ []) do
    case register(opts) do
      {:ok, runtimes} -> runtimes
      {:error, error} -> raise error
    end
  end

  @doc "Loads a PJRT plugin (a shared object exporting `GetPjrtApi`) into this VM."
  defdelegate load_pjrt_plugin(path), to: ExlaRs.Registration

  @doc "What exla_rs found and did in this VM; the keys are documented in `ExlaRs.Status`."
  defdelegate status(), to: ExlaRs.Status, as: :collect

  # -- Attention API (owned by the Nx layer: ExlaRs.Attention, ExlaRs.CustomCall) -----------
  # Only with Nx (an optional dependency; Nx needs Elixir >= 1.17).
  if Code.ensure_loaded?(Nx) do
    # Transforms, not plain functions: `defn` only calls functions defined with defn or
    # deftransform (a `defdelegate` raises "cannot invoke ... inside defn"). Quoted and evaluated
    # here rather than written inline: an `import Nx.Defn` in this branch would be expanded even
    # where Nx is absent, and exla_rs must compile without it (user_project_test.exs).
    Code.eval_quoted(
      quote do
        import Nx.Defn, only: [deftransform: 2]

        @doc """
        Fused scaled-dot-product attention, `{batch, seq, heads, head_dim}` layout: returns `o`.
        Works eagerly and in `defn`; see `ExlaRs.Attention` for the options.
        """
        deftransform attention(q, k, v, opts \\ []), do: ExlaRs.Attention.attention(q, k, v, opts)

        @doc "Like `attention/4`, also returning `lse`: `{o, lse}`. See `ExlaRs.Attention`."
        deftransform attention_with_lse(q, k, v, opts \\ []), do: ExlaRs.Attention.attention_with_lse(q, k, v, opts)
      end,
      [],
      __ENV__
    )
  end
end
