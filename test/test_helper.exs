# Nx, EXLA's Elixir side, Axon and telemetry are dependencies of this project (optional for
# its users), so every test runs: nothing is excluded for a missing library.
{:ok, _} = Application.ensure_all_started(:nx)

# The tests that load a real PJRT CPU plugin (PyPI lammps-jax-pjrt-cpu) need its path, and
# so does the user-project test; scripts/env.sh exports it. CI must run them: there a
# missing plugin is an error, not a skip.
exclude =
  case System.get_env("EXLA_RS_PJRT_PLUGIN") do
    nil ->
      if System.get_env("CI"),
        do: raise("EXLA_RS_PJRT_PLUGIN is unset in CI: run the tests through scripts/test.sh")

      IO.puts("Skipping :pjrt_plugin tests: EXLA_RS_PJRT_PLUGIN is unset (source scripts/env.sh).")
      [:pjrt_plugin]

    _ ->
      []
  end

# The precompiled-NIF test installs the release scripts/release.sh built (scripts/test.sh builds
# it first and sets EXLA_RS_RELEASE_DIR); under CI a missing release is an error, not a skip.
exclude =
  case System.get_env("EXLA_RS_RELEASE_DIR") do
    nil ->
      if System.get_env("CI"),
        do: raise("EXLA_RS_RELEASE_DIR is unset in CI: run the tests through scripts/test.sh")

      IO.puts("Skipping :precompiled tests: EXLA_RS_RELEASE_DIR is unset (run scripts/release.sh).")
      [:precompiled | exclude]

    _ ->
      exclude
  end

ExUnit.start(exclude: exclude)
