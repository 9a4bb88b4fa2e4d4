defmodule ExlaRs.NIF do
  @moduledoc """
  The Rust NIF (`native/exla_rs/crates/exla-rs-nif`), loaded from
  `priv/native/libexla_rs_nif.so`.

  Loading only registers the functions: it initialises no CUDA and opens no XLA, so it is
  safe while modules load at compile time. If the library is missing or does not load, the
  module still loads; every function then raises an `ErlangError` saying why, and
  `load_error/0` returns the reason (shown by `ExlaRs.status/0`).

  Blocking functions (`register/2`, `runtimes/1`, `load_pjrt_plugin/1`, `cuda_status/0`)
  run on dirty schedulers. A panic in Rust comes back as `{:error, reason}` or an
  `ErlangError`, never a crash.
  """

  @on_load :__load_nif__
  @load_error_key {__MODULE__, :load_error}

  @doc false
  def __load_nif__ do
    path = nif_path()

    case :erlang.load_nif(String.to_charlist(path), 0) do
      :ok ->
        :persistent_term.erase(@load_error_key)
        :ok

      {:error, {reason, text}} ->
        message =
          "could not load the exla_rs NIF from #{path}.so (#{reason}: #{text}); run `mix compile`"

        :persistent_term.put(@load_error_key, message)
        IO.warn(message, [])

        # Load the module anyway: calls raise with this message instead of an UndefinedFunctionError.
        :ok
    end
  end

  @doc "Why the NIF did not load, or `nil` when it did."
  def load_error, do: :persistent_term.get(@load_error_key, nil)

  @doc "The library path, without the `.so` extension `:erlang.load_nif/2` adds."
  def nif_path do
    priv =
      case :code.priv_dir(:exla_rs) do
        {:error, _} -> Path.expand("../priv", Path.dirname(to_string(:code.which(__MODULE__))))
        dir -> to_string(dir)
      end

    Path.join([priv, "native", "libexla_rs_nif"])
  end

  @doc "`%{version:, ffi_api_version:, targets:, counters:}`."
  def native_info, do: not_loaded()

  @doc "`{runtimes, counters}`: runtimes found now (and registered into before), registering nothing."
  def runtimes(_extra_paths), do: not_loaded()

  @doc "One registration pass: `{:ok, runtimes}` or `{:error, reason}`."
  def register(_extra_paths, _retry_failed), do: not_loaded()

  @doc "Loads a PJRT plugin into this VM for good: `{:ok, info}` or `{:error, reason}`."
  def load_pjrt_plugin(_path), do: not_loaded()

  @doc "CUDA driver and devices (initialises the driver when present)."
  def cuda_status, do: not_loaded()

  @doc "How the CUDA kernels were built."
  def kernel_build, do: not_loaded()

  @doc """
  Bytes of workspace a call takes: N > 0, 0 for none, -1 when the configuration is not
  supported on that platform. `pass`: 0 forward, 1 backward; `platform`: 0 Host, 1 CUDA;
  `dtype`: XLA FFI data type code (F16 10, F32 11, BF16 16).
  """
  def workspace_bytes(_pass, _platform, _dtype, _b, _sq, _sk, _h, _hkv, _d), do: not_loaded()

  @doc """
  Bytes a backward with `bias_grad` appends to `workspace_bytes/9` for a bias of
  dims `{bb, hb, sqb, skb}` (the dbias accumulator): 0 on the Host, -1 for an
  unknown platform or dims that are not a bias.
  """
  def dbias_workspace_bytes(_platform, _bb, _hb, _sqb, _skb), do: not_loaded()

  @doc """
  The optional features (a bit set) the handlers of `platform` (0 Host, 1 CUDA) run, as
  `exla_rs_flash_attn_features` answers; -1 for an unknown platform code. The bits are
  `feature_bits/0`.
  """
  def flash_attn_features(_platform), do: not_loaded()

  @doc "The contract's feature bits by name: `%{key_mask:, bias:, alibi_slopes:, bias_grad:, dropout:}`."
  def feature_bits, do: not_loaded()

  @doc false
  def panic_for_test, do: not_loaded()

  defp not_loaded do
    :erlang.nif_error({:exla_rs_nif_not_loaded, load_error() || "the exla_rs NIF is not loaded"})
  end
end
