# Nx, EXLA's Elixir side, Axon and telemetry are dependencies of this project (optional for
# its users), so every test runs: nothing is excluded for a missing library.
{:ok, _} = Application.ensure_all_started(:nx)

# The throwaway user projects of test/exla_rs/{user_project,precompiled}_test.exs.
Code.require_file("user_project/project.exs", __DIR__)

# Tests that need something from scripts/env.sh or scripts/test.sh: run when their variable is
# set, skipped (saying why) when it is not, and an error under CI, which must run them all.
needs = fn var, tag, how ->
  cond do
    System.get_env(var) ->
      []

    System.get_env("CI") ->
      raise("#{var} is unset in CI: run the tests through scripts/test.sh")

    true ->
      IO.puts("Skipping #{inspect(tag)} tests: #{var} is unset (#{how}).")
      [tag]
  end
end

# A real PJRT CPU plugin (PyPI lammps-jax-pjrt-cpu): the registration and user-project tests.
# The release scripts/release.sh built, which the precompiled-NIF test installs.
exclude =
  needs.("EXLA_RS_PJRT_PLUGIN", :pjrt_plugin, "source scripts/env.sh") ++
    needs.("EXLA_RS_RELEASE_DIR", :precompiled, "run scripts/release.sh --out DIR, set it to DIR")

ExUnit.start(exclude: exclude)
