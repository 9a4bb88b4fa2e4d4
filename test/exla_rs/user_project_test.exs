defmodule ExlaRs.UserProjectTest do
  # exla_rs as a user meets it: a throwaway Mix project outside the repository that depends on
  # exla_rs (path) and on Nx, EXLA and Axon as Mix dependencies (hex packages, or the offline
  # toolchain's source trees through EXLA_RS_<APP>_PATH, as scripts/elixir.sh sets them). Each
  # flow compiles that project with the `mix` running these tests, then runs
  # test/user_project/check.exs in it: the Nx layer, the EXLA.CustomCall implementation and
  # the Axon layer must be there exactly when their libraries are, in every compile order.
  #
  # Not async: a checkout of exla_rs builds its NIF from source (no checksum file), and each of
  # these projects compiling it runs Rustler, which copies the library into the checkout's
  # priv/native (remove, then copy: not atomic); a project loading it during another's copy
  # would read a partial file.
  use ExUnit.Case, async: false

  @moduletag :user_project
  @moduletag :pjrt_plugin
  @moduletag timeout: 900_000

  @repo Path.expand("../..", __DIR__)
  alias ExlaRs.UserProject
  @check Path.join(@repo, "test/user_project/check.exs")

  # The libraries a project may have, with the hex requirement a user would write; each one
  # with EXLA_RS_<APP>_PATH set is a path dependency instead (Nx's and Axon's own deps too).
  @libraries [
    # Every project: RustlerPrecompiled, and Rustler for the source build a checkout does
    # (a user of a git checkout adds {:rustler, "~> 0.38"} too).
    rustler_precompiled: nil,
    castore: nil,
    rustler: "~> 0.38",
    jason: nil,
    nx: "~> 0.13",
    exla: "~> 0.13",
    axon: "~> 0.8",
    complex: nil,
    telemetry: nil,
    polaris: nil
  ]

  setup do
    dir = Path.join(System.tmp_dir!(), "exla_rs_user_#{System.unique_integer([:positive])}")
    on_exit(fn -> File.rm_rf!(dir) end)
    %{dir: dir}
  end

  test "a fresh full compile", %{dir: dir} do
    write_project(dir, exla_rs: true, libs: [:nx, :exla, :axon])
    mix!(dir, ["compile"])
    check!(dir, [:nx, :exla, :axon])
  end

  test "exla_rs added to a project whose deps are compiled, then mix deps.compile exla_rs --force",
       %{dir: dir} do
    write_project(dir, exla_rs: false, libs: [:nx, :exla, :axon])
    mix!(dir, ["compile"])

    write_project(dir, exla_rs: true, libs: [:nx, :exla, :axon])
    mix!(dir, ["compile"])
    check!(dir, [:nx, :exla, :axon])

    mix!(dir, ["deps.compile", "exla_rs", "--force"])
    check!(dir, [:nx, :exla, :axon])
  end

  test "exla_rs compiled first, Nx and EXLA added later, then Axon", %{dir: dir} do
    # The order that defeats a top-level `if Code.ensure_loaded?(Nx)` in a file defining no module.
    write_project(dir, exla_rs: true, libs: [])
    mix!(dir, ["compile"])
    check!(dir, [])

    # Without Axon: the rest compiles and works.
    write_project(dir, exla_rs: true, libs: [:nx, :exla])
    mix!(dir, ["compile"])
    check!(dir, [:nx, :exla])

    write_project(dir, exla_rs: true, libs: [:nx, :exla, :axon])
    mix!(dir, ["compile"])
    check!(dir, [:nx, :exla, :axon])
  end

  # The project's mix.exs, as a user writes it. Nx's own deps (complex, telemetry) and Axon's
  # (polaris) appear only as local overrides, never as the user's direct requirements.
  defp write_project(dir, exla_rs: exla_rs?, libs: libs) do
    wanted = [:rustler_precompiled, :castore, :rustler, :jason] ++ libs ++ if(:nx in libs, do: [:complex, :telemetry], else: []) ++ if(:axon in libs, do: [:polaris], else: [])

    deps =
      for {app, requirement} <- @libraries, app in wanted, dep = UserProject.dep(app, requirement), do: dep

    UserProject.write!(dir, if(exla_rs?, do: [{:exla_rs, path: @repo} | deps], else: deps))
  end

  defp check!(dir, have) do
    out = mix!(dir, ["run", @check, Enum.join(have, ",")])
    assert out =~ "CHECK OK"
  end

  # Runs mix in the user project with this VM's Elixir, Mix and Hex; returns the output.
  defp mix!(dir, args) do
    env = [
      {"MIX_ENV", "dev"},
      {"EXLA_RS_REPO", @repo},
      # The parent is a test run: keep its build settings, not its Mix project.
      {"MIX_EXS", nil},
      {"MIX_BUILD_PATH", nil},
      {"MIX_DEPS_PATH", nil}
    ]

    if hex_deps?(), do: run_mix(dir, ["deps.get"], env)
    run_mix(dir, args, env)
  end

  defp run_mix(dir, args, env) do
    {out, status} = System.cmd(UserProject.mix_executable(), args, cd: dir, env: env, stderr_to_stdout: true)
    assert status == 0, "mix #{Enum.join(args, " ")} in #{dir} exited #{status}:\n#{out}"
    out
  end

  defp hex_deps?, do: Enum.any?([:nx, :exla, :axon], &(ExlaRs.MixProject.local_path(&1) == nil))
end
