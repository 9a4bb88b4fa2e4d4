defmodule Mix.Tasks.Compile.ExlaRsNative do
  @moduledoc """
  Builds the exla_rs NIF (`native/exla_rs`, crate `exla-rs-nif`) with cargo and copies it to
  `priv/native/libexla_rs_nif.so`, where `ExlaRs.NIF` loads it.

  Listed before `Mix.compilers()` in `mix.exs`; loaded by `mix.exs` itself (a compiler cannot
  live in the `lib/` it helps compile). Skips cargo when the library is newer than every
  native source and was built with the same profile.

  Environment:

    * `EXLA_RS_CARGO_PROFILE` - cargo profile, `release` (default), `dev`, or any custom one
    * `EXLA_RS_CARGO_ARGS` - extra cargo arguments, split on spaces (e.g. `--offline`)
    * `EXLA_RS_SKIP_CARGO=1` - never run cargo; use the library already in `priv/native`
    * `CARGO` - the cargo executable (default: `cargo` on the `PATH`, then `~/.cargo/bin`)
  """
  use Mix.Task.Compiler

  @crate "exla-rs-nif"
  @lib_name "libexla_rs_nif"
  @manifest "compile.exla_rs_native"

  @impl true
  def run(_args) do
    root = Path.dirname(Mix.Project.project_file())
    native = Path.join(root, "native/exla_rs")
    dest = Path.join(root, "priv/native/#{@lib_name}.so")
    profile = System.get_env("EXLA_RS_CARGO_PROFILE", "release")

    cond do
      System.get_env("EXLA_RS_SKIP_CARGO") in ~w(1 true) ->
        if File.exists?(dest),
          do: {:noop, []},
          else: error("EXLA_RS_SKIP_CARGO is set but #{dest} does not exist")

      up_to_date?(native, dest, profile) ->
        {:noop, []}

      cargo = find_cargo() ->
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
          File.write!(manifest_path(), profile)
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

  defp up_to_date?(native, dest, profile) do
    with {:ok, %{mtime: built}} <- File.stat(dest, time: :posix),
         {:ok, ^profile} <- File.read(manifest_path()) do
      native
      |> sources()
      |> Enum.all?(fn file ->
        match?({:ok, %{mtime: m}} when m <= built, File.stat(file, time: :posix))
      end)
    else
      _ -> false
    end
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
