defmodule Mix.Tasks.Compile.ExlaRsNative do
  @moduledoc """
  Builds the exla_rs NIF (`native/exla_rs`, crate `exla-rs-nif`) with cargo and copies it to
  `priv/native/libexla_rs_nif.so`, where `ExlaRs.NIF` loads it.

  Listed before `Mix.compilers()` in `mix.exs`; loaded by `mix.exs` itself (a compiler cannot
  live in the `lib/` it helps compile). Skips cargo when the library is newer than every
  native source and was built with the same build settings: the profile, the cargo
  executable and every variable below or read by the crates' build scripts (its manifest
  records them, so changing any of them rebuilds).

  Environment:

    * `EXLA_RS_CARGO_PROFILE` - cargo profile, `release` (default), `dev`, or any custom one
    * `EXLA_RS_CARGO_ARGS` - extra cargo arguments, split on spaces (e.g. `--offline`)
    * `EXLA_RS_SKIP_CARGO=1` - never run cargo; use the library already in `priv/native`
    * `CARGO` - the cargo executable (default: `cargo` on the `PATH`, then `~/.cargo/bin`)
    * `CARGO_TARGET_DIR`, and what `exla-rs-cuda`'s build script reads: `EXLA_RS_CUDA_ARCHS`,
      `EXLA_RS_CUDA_NVCC`, `NVCC`, `CUDA_HOME`, `CUDA_PATH`
  """
  use Mix.Task.Compiler

  @crate "exla-rs-nif"
  @lib_name "libexla_rs_nif"
  @manifest "compile.exla_rs_native"
  # Environment that changes what cargo builds: ours, cargo's, and what
  # crates/exla-rs-cuda/build.rs declares with `rerun-if-env-changed`.
  @build_env ~w(EXLA_RS_CARGO_PROFILE EXLA_RS_CARGO_ARGS CARGO_TARGET_DIR EXLA_RS_CUDA_ARCHS
                EXLA_RS_CUDA_NVCC NVCC CUDA_HOME CUDA_PATH)

  @impl true
  def run(_args) do
    root = Path.dirname(Mix.Project.project_file())
    native = Path.join(root, "native/exla_rs")
    dest = Path.join(root, "priv/native/#{@lib_name}.so")
    profile = System.get_env("EXLA_RS_CARGO_PROFILE", "release")
    cargo = find_cargo()

    cond do
      System.get_env("EXLA_RS_SKIP_CARGO") in ~w(1 true) ->
        if File.exists?(dest),
          do: {:noop, []},
          else: error("EXLA_RS_SKIP_CARGO is set but #{dest} does not exist")

      up_to_date?(native, dest, build_settings(cargo)) ->
        {:noop, []}

      cargo ->
        build(cargo, native, dest, profile)

      File.exists?(dest) ->
        Mix.shell().info(
          "exla_rs: cargo not found; using the existing #{dest} (sources changed since)"
        )

        {:noop, []}

      true ->
        error(
          "cargo (Rust) is needed to build the exla_rs NIF: install it (https://rustup.rs) or set CARGO"
        )
    end
  end

  @impl true
  def manifests, do: [manifest_path()]

  @impl true
  def clean do
    root = Path.dirname(Mix.Project.project_file())
    File.rm(Path.join(root, "priv/native/#{@lib_name}.so"))
    File.rm(manifest_path())
    :ok
  end

  defp manifest_path, do: Path.join(Mix.Project.manifest_path(), @manifest)

  defp build(cargo, native, dest, profile) do
    args =
      ["build", "--manifest-path", Path.join(native, "Cargo.toml"), "-p", @crate] ++
        profile_args(profile) ++
        String.split(System.get_env("EXLA_RS_CARGO_ARGS", ""), " ", trim: true)

    Mix.shell().info("exla_rs: #{Enum.join([cargo | args], " ")}")

    case System.cmd(cargo, args,
           cd: native,
           into: IO.stream(:stdio, :line),
           stderr_to_stdout: true
         ) do
      {_, 0} ->
        src = Path.join([target_dir(native), profile_dir(profile), built_name()])

        if File.exists?(src) do
          install(src, dest)
          # Mix links _build/.../priv to priv/ only if priv/ existed when it set up the build
          # structure; on a fresh clone it did not.
          Mix.Project.build_structure()
          File.mkdir_p!(Path.dirname(manifest_path()))
          File.write!(manifest_path(), :erlang.term_to_binary(build_settings(cargo)))
          {:ok, []}
        else
          error("cargo succeeded but #{src} is missing")
        end

      {_, status} ->
        error("cargo build -p #{@crate} failed (exit #{status}); see the output above")
    end
  end

  # Copy next to the destination, then rename: a running VM that has the old library mapped
  # keeps its copy intact.
  defp install(src, dest) do
    File.mkdir_p!(Path.dirname(dest))
    tmp = dest <> ".tmp#{System.unique_integer([:positive])}"
    File.cp!(src, tmp)
    File.rename!(tmp, dest)
  end

  # What the manifest records: a library built under other settings is out of date.
  defp build_settings(cargo) do
    %{cargo: cargo, env: Map.new(@build_env, &{&1, System.get_env(&1)})}
  end

  defp up_to_date?(native, dest, settings) do
    with {:ok, %{mtime: built}} <- File.stat(dest, time: :posix),
         {:ok, recorded} <- File.read(manifest_path()),
         ^settings <- binary_to_term(recorded) do
      native
      |> sources()
      |> Enum.all?(fn file ->
        match?({:ok, %{mtime: m}} when m <= built, File.stat(file, time: :posix))
      end)
    else
      _ -> false
    end
  end

  # A manifest from an older version of this compiler (plain text) reads as no settings.
  defp binary_to_term(binary) do
    :erlang.binary_to_term(binary, [:safe])
  rescue
    ArgumentError -> nil
  end

  defp sources(native) do
    Path.wildcard(Path.join(native, "{Cargo.toml,Cargo.lock}")) ++
      Path.wildcard(Path.join(native, "crates/**/*.{rs,toml,c,h,cu,cuh}")) ++
      Path.wildcard(Path.join(native, "kernels/**/*"))
  end

  defp find_cargo do
    System.get_env("CARGO") || System.find_executable("cargo") ||
      Enum.find([Path.expand("~/.cargo/bin/cargo")], &File.exists?/1)
  end

  defp target_dir(native), do: System.get_env("CARGO_TARGET_DIR") || Path.join(native, "target")

  defp profile_args("release"), do: ["--release"]
  defp profile_args(dev) when dev in ["dev", "debug"], do: []
  defp profile_args(other), do: ["--profile", other]

  defp profile_dir(dev) when dev in ["dev", "debug"], do: "debug"
  defp profile_dir(other), do: other

  defp built_name do
    case :os.type() do
      {:unix, :darwin} -> "#{@lib_name}.dylib"
      _ -> "#{@lib_name}.so"
    end
  end

  defp error(message) do
    Mix.shell().error("exla_rs: " <> message)

    {:error,
     [
       %Mix.Task.Compiler.Diagnostic{
         compiler_name: "exla_rs_native",
         file: Path.dirname(Mix.Project.project_file()),
         message: message,
         position: nil,
         severity: :error
       }
     ]}
  end
end
