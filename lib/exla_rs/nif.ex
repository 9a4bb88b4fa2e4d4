defmodule ExlaRs.NIF do
  @moduledoc """
  The Rust NIF (`native/exla_rs/crates/exla-rs-nif`, every CUDA kernel embedded).

  Where the library comes from is settled when this module compiles:

    * **precompiled** (the default for the Hex package): `RustlerPrecompiled` downloads
      `libexla_rs_nif-v<version>-nif-<2.15|2.16|2.17>-<target>.so.tar.gz` for this machine's
      NIF version and target, checks its sha256 against `checksum-Elixir.ExlaRs.NIF.exs` (in the
      package) and unpacks it into `priv/native`. No Rust is needed. The base URL is, first
      found: the `EXLA_RS_PRECOMPILED_BASE_URL` environment variable, then

          config :exla_rs, :precompiled_base_url, "https://mirror.example/exla_rs/v0.1.0"

      then the project's GitHub release. A mirror or an air-gapped site serves the release's
      files from any HTTP(S) directory (`HTTP_PROXY`/`HTTPS_PROXY` apply; downloads are
      cached under `RUSTLER_PRECOMPILED_GLOBAL_CACHE_PATH` or the user cache directory).
    * **built from source** with `EXLA_RS_BUILD=1` (or `config :rustler_precompiled,
      :force_build, exla_rs: true`), and in a checkout with no checksum file: Rustler runs
      `cargo rustc` on the crate. Needs Rust >= 1.80 and `{:rustler, "~> 0.38", runtime: false}`
      in the project's deps; nvcc (`CUDA_HOME`) is used for the kernels when found.
      Rustler's own options go in `config :exla_rs, ExlaRs.NIF, mode: :debug, ...`.

  After changing either setting, `mix deps.compile exla_rs --force` applies it.

  Loading only registers the functions: it initialises no CUDA and opens no XLA, so it is
  safe while modules load at compile time. If the library does not load, the module still
  loads; every function then raises an `ErlangError` saying why, and `load_error/0` returns
  the reason (shown by `ExlaRs.status/0`).

  Blocking functions (`register/2`, `runtimes/1`, `load_pjrt_plugin/1`, `cuda_status/0`)
  run on dirty schedulers. A panic in Rust comes back as `{:error, reason}` or an
  `ErlangError`, never a crash.
  """

  alias ExlaRs.NIF.Source

  @root Path.expand("../..", __DIR__)
  @load_error_key {__MODULE__, :load_error}

  # A source build is redone when a native file or a build setting changes.
  @external_resource Source.checksum_file(@root)
  for file <- Source.external_resources(@root), do: @external_resource(file)
  @build_env Source.build_env()

  @source_options Source.options(
                    @root,
                    Mix.Project.config()[:version],
                    Mix.Project.config()[:source_url],
                    Application.compile_env(:exla_rs, :precompiled_base_url)
                  )

  try do
    use RustlerPrecompiled, @source_options
  rescue
    e -> reraise Source.failure(e, __MODULE__, @root, @source_options), __STACKTRACE__
  end

  @before_compile Source

  @doc false
  def __mix_recompile__?, do: Source.build_env() != @build_env

  @doc false
  def __loaded__(:ok) do
    :persistent_term.erase(@load_error_key)
    :ok
  end

  def __loaded__({:error, {reason, text}}) do
    message =
      "could not load the exla_rs NIF from #{nif_path()}.so (#{reason}: #{text}); " <>
        "reinstall it with `mix deps.compile exla_rs --force` (EXLA_RS_BUILD=1 builds it from source)"

    :persistent_term.put(@load_error_key, message)
    IO.warn(message, [])
    # Load the module anyway: calls raise with this message instead of an UndefinedFunctionError.
    :ok
  end

  @doc "Why the NIF did not load, or `nil` when it did."
  def load_error, do: :persistent_term.get(@load_error_key, nil)

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
