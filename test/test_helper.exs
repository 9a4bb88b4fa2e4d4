# The Nx layer's tests (test/nx, tag :nx; EXLA.CustomCall ones also :exla, Axon models :axon) need real Nx,
# which needs Elixir >= 1.17: DEVELOPERS.md says how to run them. Without Nx they are
# neither compiled (their modules sit behind Code.ensure_loaded?/1) nor run.
exclude = if Code.ensure_loaded?(Nx), do: [], else: [:nx]
exclude = if Code.ensure_loaded?(EXLA.CustomCall), do: exclude, else: [:exla | exclude]
exclude = if Code.ensure_loaded?(Axon), do: exclude, else: [:axon | exclude]
exclude = if Code.ensure_loaded?(:telemetry), do: exclude, else: [:telemetry | exclude]
if Code.ensure_loaded?(Nx), do: {:ok, _} = Application.ensure_all_started(:nx)

# The registration test against a real PJRT CPU plugin (PyPI lammps-jax-pjrt-cpu) needs its
# path; scripts/env.sh exports it in CI.
exclude =
  case System.get_env("EXLA_RS_PJRT_PLUGIN") do
    nil ->
      IO.puts(
        "Skipping :pjrt_plugin tests: EXLA_RS_PJRT_PLUGIN is unset (source scripts/env.sh)."
      )

      [:pjrt_plugin | exclude]

    _ ->
      exclude
  end

ExUnit.start(exclude: exclude)
