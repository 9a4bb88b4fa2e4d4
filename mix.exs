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
      elixir: "~> 1.14",
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

  # Kept small and separate: the Nx layer adds Nx/EXLA here as optional deps.
  defp deps do
    []
  end
end
