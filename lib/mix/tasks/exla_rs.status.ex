defmodule Mix.Tasks.ExlaRs.Status do
  @shortdoc "Prints what exla_rs found: NIF, CUDA, kernels, XLA runtimes, registrations"
  @moduledoc """
  Starts the application (and so EXLA, when it is a dependency), then prints `ExlaRs.status/0`
  as a report.

      mix exla_rs.status            # the report
      mix exla_rs.status --register # register first (ExlaRs.register/1), then report
      mix exla_rs.status --plugin PATH  # load a PJRT plugin and register into it first
  """
  use Mix.Task

  @requirements ["app.start"]

  @impl true
  def run(args) do
    {opts, _, _} = OptionParser.parse(args, strict: [register: :boolean, plugin: :keep])
    plugins = Keyword.get_values(opts, :plugin)

    if opts[:register] || plugins != [] do
      case ExlaRs.register(plugin: plugins) do
        {:ok, _} -> :ok
        {:error, e} -> Mix.shell().error("registration: " <> Exception.message(e))
      end
    end

    Mix.shell().info(ExlaRs.Status.Formatter.format(ExlaRs.status()))
  end
end
