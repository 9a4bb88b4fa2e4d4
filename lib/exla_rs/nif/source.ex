defmodule ExlaRs.NIF.Source do
  @moduledoc false
  # Where `ExlaRs.NIF`'s library comes from, decided when `ExlaRs.NIF` compiles:
  #
  #   * a precompiled artifact (RustlerPrecompiled): downloaded from the base URL, checked
  #     against the sha256 in `checksum-Elixir.ExlaRs.NIF.exs` (shipped in the Hex package),
  #     unpacked into `priv/native`. No Rust needed.
  #   * a source build (Rustler's own `cargo rustc` step): with `EXLA_RS_BUILD=1`, or when
  #     there is no checksum file (a git checkout is not a release: its artifacts do not exist).
  #
  # It also turns RustlerPrecompiled's failures into messages that say how to recover, and
  # removes a download that failed its checksum (RustlerPrecompiled 0.8 leaves it in its cache,
  # where it would fail every retry).

  @checksum_file "checksum-Elixir.ExlaRs.NIF.exs"
  @crate "exla_rs_nif"
  @crate_path "native/exla_rs/crates/exla-rs-nif"
  # The artifacts scripts/release.sh builds and publishes. Elixir >= 1.17 needs OTP >= 25:
  # NIF 2.16 serves OTP 25, 2.17 OTP 26 and later; 2.15 is there for embedders of older ERTS.
  @targets ~w(x86_64-unknown-linux-gnu)
  @nif_versions ~w(2.15 2.16 2.17)
  @build_var "EXLA_RS_BUILD"
  @url_var "EXLA_RS_PRECOMPILED_BASE_URL"
  # What a source build reads from the environment (cargo's target dir and what
  # crates/exla-rs-cuda/build.rs declares with `rerun-if-env-changed`): a change rebuilds.
  @build_env ~w(EXLA_RS_BUILD EXLA_RS_PRECOMPILED_BASE_URL CARGO_TARGET_DIR EXLA_RS_CUDA_ARCHS
                EXLA_RS_CUDA_NVCC NVCC CUDA_HOME CUDA_PATH)

  def checksum_file(root), do: Path.join(root, @checksum_file)
  def targets, do: @targets
  def nif_versions, do: @nif_versions

  @doc "The environment a build depends on; `ExlaRs.NIF` recompiles when it changes."
  def build_env, do: Map.new(@build_env, &{&1, System.get_env(&1)})

  @doc "Native files outside the crates' own folders that a source build reads (the kernels)."
  def external_resources(root) do
    Path.wildcard(Path.join(root, "native/exla_rs/{Cargo.toml,Cargo.lock}")) ++
      Path.wildcard(Path.join(root, "native/exla_rs/kernels/**/*.{cu,cuh}"))
  end

  @doc """
  The options for `use RustlerPrecompiled` (those RustlerPrecompiled does not know go to
  `use Rustler` on a source build). `base_url` is the application's `:precompiled_base_url`.
  """
  def options(root, version, source_url, base_url) do
    url = base_url(System.get_env(@url_var) || base_url || default_base_url(source_url, version))

    opts = [
      otp_app: :exla_rs,
      crate: @crate,
      path: Path.join(root, @crate_path),
      mode: :release,
      version: version,
      base_url: url,
      targets: @targets,
      nif_versions: @nif_versions
    ]

    case build_reason(root) do
      nil ->
        # Leave :force_build unset: RustlerPrecompiled's own
        # `config :rustler_precompiled, :force_build, exla_rs: true` still applies.
        opts

      reason ->
        Mix.shell().info("exla_rs: building the NIF from source with cargo (#{reason})")
        Keyword.put(opts, :force_build, true)
    end
  end

  defp build_reason(root) do
    cond do
      System.get_env(@build_var) in ~w(1 true) ->
        "#{@build_var}=#{System.get_env(@build_var)}"

      not File.exists?(checksum_file(root)) ->
        "no #{@checksum_file}: a source checkout, not a release"

      true ->
        nil
    end
  end

  defp default_base_url(source_url, version), do: "#{source_url}/releases/download/v#{version}"

  # RustlerPrecompiled appends the file name to the URL's path and cannot do so when there is
  # none (`http://host:port` raises in URI.to_string/1): give it "/".
  defp base_url(url) do
    case URI.parse(url) do
      %URI{path: path} = uri when path in [nil, ""] -> URI.to_string(%{uri | path: "/"})
      _ -> url
    end
  end

  @doc """
  The exception to raise when `use RustlerPrecompiled` failed with `exception`: what went
  wrong, what was left behind (nothing), and how to recover.
  """
  def failure(exception, module, root, opts) do
    text = Exception.message(exception)

    message =
      cond do
        text =~ "integrity check failed" -> checksum_failure(module, root, opts)
        text =~ "couldn't fetch NIF from" -> download_failure(text, module, opts)
        text =~ "precompiled NIF is not available for this" -> no_artifact(text)
        opts[:force_build] -> build_failure(text)
        true -> "#{text}\n\n#{how_to_build()}"
      end

    RuntimeError.exception("exla_rs: " <> message)
  end

  defp checksum_failure(module, root, opts) do
    {file, url} = current_artifact(module)
    cached = Path.join(cache_dir(), file)
    got = if File.exists?(cached), do: "sha256:" <> sha256(cached), else: "(unreadable)"
    # The bad tarball would otherwise be found in the cache and fail every retry.
    File.rm(cached)
    {expected, _} = Code.eval_file(checksum_file(root))

    """
    the precompiled NIF #{file} downloaded from #{url} does not match its checksum.
      expected #{Map.get(expected, file, "(none)")} (#{@checksum_file} in the exla_rs #{opts[:version]} package)
      got      #{got}
    The download was deleted from #{cache_dir()}; nothing was installed.
    To recover: if you use a mirror (#{@url_var} or `config :exla_rs, :precompiled_base_url`),
    make sure it serves the exla_rs #{opts[:version]} release files unchanged, then run
    `mix deps.compile exla_rs` again. #{how_to_build()}
    """
  end

  defp download_failure(text, module, opts) do
    {_file, url} = current_artifact(module)
    # RustlerPrecompiled's text: "...couldn't fetch NIF from URL: REASON.\n\nYou can force...".
    reason =
      case Regex.run(~r/couldn't fetch NIF from \S+: (.*?)\.?\n/s, text <> "\n") do
        [_, reason] -> reason
        nil -> String.trim(text)
      end

    """
    could not download the precompiled NIF from #{url}
    (#{reason}). Nothing was installed.
    The base URL is #{opts[:base_url]}; point it at a reachable copy of the exla_rs
    #{opts[:version]} release files with #{@url_var}=URL or `config :exla_rs,
    :precompiled_base_url, URL` (a mirror, or a local directory served over HTTP), then run
    `mix deps.compile exla_rs`. #{how_to_build()}
    """
  end

  defp no_artifact(text) do
    """
    #{String.trim(text)}
    exla_rs publishes precompiled NIFs for #{Enum.join(@targets, ", ")} (NIF #{Enum.join(@nif_versions, ", ")}).
    #{how_to_build()}
    """
  end

  defp build_failure(text) do
    """
    building the NIF from source failed: #{String.trim(text)}
    A source build needs Rust >= 1.80 (cargo on PATH, https://rustup.rs) and
    `{:rustler, "~> 0.38", runtime: false}` in your project's deps; CUDA kernels are compiled
    when nvcc is found (CUDA_HOME, NVCC), else at first use with NVRTC.
    """
  end

  defp how_to_build do
    "Or build it from source: `#{@build_var}=1 mix deps.compile exla_rs --force` (needs Rust >= 1.80 " <>
      "and `{:rustler, \"~> 0.38\", runtime: false}` in your deps)."
  end

  # The artifact RustlerPrecompiled chose for this machine: it records it before downloading.
  defp current_artifact(module) do
    [{file, {url, _headers}} | _] = RustlerPrecompiled.current_target_nifs(module)
    {file, url}
  end

  # Where RustlerPrecompiled 0.8 keeps downloads (its private cache_dir/1).
  defp cache_dir do
    System.get_env("RUSTLER_PRECOMPILED_GLOBAL_CACHE_PATH") ||
      :filename.basedir(
        :user_cache,
        Path.join("rustler_precompiled", "precompiled_nifs"),
        if(System.get_env("MIX_XDG"), do: %{os: :linux}, else: %{})
      )
  end

  defp sha256(path), do: :crypto.hash(:sha256, File.read!(path)) |> Base.encode16(case: :lower)

  @doc false
  # Runs after Rustler's or RustlerPrecompiled's own `__before_compile__` has defined the
  # @on_load function: wraps it so that a library that does not load leaves the module loaded
  # (each NIF then raises saying why, and `ExlaRs.status/0` reports it) instead of unloadable.
  defmacro __before_compile__(env) do
    {loader, {app, path}, source} =
      if Module.defines?(env.module, {:rustler_init, 0}),
        do: {:rustler_init, Module.get_attribute(env.module, :load_from), :source_build},
        else:
          {:load_rustler_precompiled,
           Module.get_attribute(env.module, :rustler_precompiled_load_from), :precompiled}

    quote do
      defoverridable [{unquote(loader), 0}]

      @doc false
      def unquote(loader)(), do: __loaded__(super())

      @doc "The library path, without the `.so` extension `:erlang.load_nif/2` adds."
      def nif_path, do: Application.app_dir(unquote(app), unquote(path))

      @doc "Where the library came from: `:precompiled` (downloaded) or `:source_build` (cargo)."
      def source, do: unquote(source)
    end
  end
end
