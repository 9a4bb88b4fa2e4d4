defmodule ExlaRs.Application do
  @moduledoc """
  Registers our FFI handlers at start when EXLA is present (it starts after `:exla`, an
  optional dependency). A missing runtime never fails the start: the outcome is recorded
  (`ExlaRs.status/0`, `:at_start`), and registration happens again lazily before our first
  lowering. Set `config :exla_rs, register_on_start: false` to skip it.
  """
  use Application

  @impl true
  def start(_type, _args) do
    ExlaRs.Registration.at_start()
    Supervisor.start_link([], strategy: :one_for_one, name: ExlaRs.Supervisor)
  end
end
