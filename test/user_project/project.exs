defmodule ExlaRs.UserProject do
  @moduledoc false
  # A throwaway Mix project as a user writes it, for the tests that compile exla_rs as a
  # dependency (test/exla_rs/user_project_test.exs, test/exla_rs/precompiled_test.exs).

  @doc "Writes `dir`/mix.exs with `deps` (and a one-module lib/ when there is none)."
  def write!(dir, deps) do
    File.mkdir_p!(Path.join(dir, "lib"))
    app = Path.join(dir, "lib/user_app.ex")
    unless File.exists?(app), do: File.write!(app, "defmodule UserApp do\nend\n")

    File.write!(Path.join(dir, "mix.exs"), """
    defmodule UserApp.MixProject do
      use Mix.Project

      def project do
        [app: :user_app, version: "0.1.0", elixir: "~> 1.17", deps: #{inspect(deps)}]
      end

      def application, do: [extra_applications: [:logger]]
    end
    """)
  end

  @doc "The dependency on `app` a user writes, or the offline toolchain's tree (EXLA_RS_<APP>_PATH)."
  def dep(app, requirement) do
    case ExlaRs.MixProject.local_path(app) do
      nil when requirement == nil -> nil
      nil -> {app, requirement}
      path -> {app, path: path, override: true}
    end
  end

  def mix_executable, do: System.find_executable("mix") || raise("no mix on PATH")
end
