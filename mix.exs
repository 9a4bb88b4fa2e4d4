# The native build step (cargo -> priv/native) is a Mix compiler that must exist before this
# project compiles, so it lives in an .exs file loaded here rather than in lib/.
Code.require_file("lib/mix/tasks/compile.exla_rs_native.exs", __DIR__)

defmodule ExlaRs.MixProject do
  use Mix.Project

  @version "0.1.0"

  def project do
    [
      app: :exla_rs,
      version: @version,
      # What Nx and EXLA need; the Nx layer is the library's reason to exist.
      elixir: "~> 1.17",
      start_permanent: Mix.env() == :prod,
      compilers: [:exla_rs_native] ++ Mix.compilers(),
      deps: deps(),
      package: [
        files:
          ~w(lib native/exla_rs/Cargo.toml native/exla_rs/Cargo.lock native/exla_rs/crates native/exla_rs/kernels mix.exs)
      ]
    ]
  end

  def application do
    [
      mod: {ExlaRs.Application, []},
      extra_applications: [:logger]
    ]
  end

  # Bumblebee's own runtime dependencies, each added (as a local override) only when its
  # EXLA_RS_<APP>_PATH is set: offline, hex cannot resolve them, as with complex and polaris.
  @bumblebee_tree [
    :tokenizers,
    :rustler_precompiled,
    :rustler,
    :castore,
    :nx_image,
    :unpickler,
    :safetensors,
    :jason,
    :unzip,
    :progress_bar,
    :decimal,
    :nx_signal
  ]

  # Nx, EXLA and Axon are optional: exla_rs compiles its Nx layer, its `EXLA.CustomCall`
  # implementation and its Axon layer only when the user's project has them. Declaring them
  # (rather than probing whatever the VM holds) makes Mix compile them before exla_rs and put
  # them on its code path, in every compile order. The ranges are the versions we test
  # (Nx/EXLA 0.13: the `EXLA.CustomCall` protocol exists since EXLA 0.12; Axon 0.8).
  #
  # Offline (our CI, or a local checkout of Nx), `EXLA_RS_<APP>_PATH` turns a dependency into
  # a path dependency with `override: true`, as Axon's and Bumblebee's mix.exs take local Nx
  # and EXLA: one mix.exs serves hex users and machines with no hex.pm. Nx's and Axon's own
  # dependencies (complex, telemetry, polaris) are added the same way only when their
  # variable is set, since hex cannot resolve them either on such a machine.
  defp deps do
    [
      dep(:nx, "~> 0.13", optional: true),
      dep(:exla, "~> 0.13", optional: true),
      dep(:axon, "~> 0.8", optional: true),
      # Registration emits [:exla_rs, :register] while the :telemetry application runs.
      dep(:telemetry, "~> 0.4 or ~> 1.0", optional: true),
      # ExlaRs.Bumblebee.swap_attention/2. Bumblebee 0.7.0 asks Nx ~> 0.12.0: a project with
      # both (ours in its tests, or a user's) overrides Nx to 0.13 (its attention runs on it).
      dep(:bumblebee, "~> 0.7", optional: true)
    ] ++
      for(
        app <- [:complex, :polaris | @bumblebee_tree],
        path = local_path(app),
        do: {app, path: path, override: true, optional: true}
      )
  end

  defp dep(app, requirement, opts) do
    case local_path(app) do
      nil -> {app, requirement, opts}
      path -> {app, [path: path, override: true] ++ opts}
    end
  end

  @doc false
  # EXLA_RS_NX_PATH, EXLA_RS_EXLA_PATH, ...: a local source tree of that dependency.
  def local_path(app) do
    case System.get_env("EXLA_RS_#{app |> Atom.to_string() |> String.upcase()}_PATH") do
      nil -> nil
      "" -> nil
      path -> Path.expand(path)
    end
  end
end
