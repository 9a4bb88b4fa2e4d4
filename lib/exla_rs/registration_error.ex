defmodule ExlaRs.RegistrationError do
  @moduledoc """
  Why `ExlaRs.register/1` registered nothing.

    * `:no_runtime` - no XLA runtime is loaded in this VM (start `:exla` first)
    * `:failed` - runtimes were found but none took our handlers (see `:runtimes`)
    * `:nif` - the NIF is not loaded or failed internally
  """
  defexception [:reason, :message, runtimes: []]
end
