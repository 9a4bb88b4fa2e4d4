defmodule ExlaRs.Registration do
  @moduledoc """
  Registers our FFI targets (`exla_rs_flash_attn_fwd` / `_bwd` for `Host` and `CUDA`) into
  every XLA runtime loaded in this VM.

  Runtimes are found by the NIF: EXLA's `libxla_extension*.so` and any shared object that
  exports `GetPjrtApi` (PJRT plugins), read from `/proc/self/maps`, plus EXLA's own library
  under its priv dir when EXLA's NIF is loaded. Registration is idempotent and serialized in
  the NIF, so any number of processes may call it at once; a target a runtime accepted is never
  sent there again.

  Emits `[:exla_rs, :register]` telemetry (measurements: counts; metadata: runtimes) when the
  `:telemetry` application is running.
  """

  alias ExlaRs.{NIF, RegistrationError}

  @start_key {__MODULE__, :at_start}
  @exla_paths_key {__MODULE__, :exla_paths}

  @doc """
  One registration pass. Options:

    * `:plugin` - a PJRT plugin path (or list) to load into the VM first
    * `:paths` - more runtime library paths to consider
    * `:retry` - retry runtimes whose earlier registration failed (default `false`)

  Returns `{:ok, runtimes}` when at least one runtime holds every target, else
  `{:error, %ExlaRs.RegistrationError{}}`.
  """
  def register(opts \\ []) do
    with :ok <- load_plugins(List.wrap(opts[:plugin])),
         {:ok, runtimes} <-
           native_register(
             exla_paths() ++ List.wrap(opts[:paths]),
             Keyword.get(opts, :retry, false)
           ) do
      emit(runtimes)
      interpret(runtimes)
    end
  end

  @doc "Loads a PJRT plugin into this VM (and initialises it) without registering."
  def load_pjrt_plugin(path) do
    case call(fn -> NIF.load_pjrt_plugin(to_string(path)) end) do
      {:ok, info} -> {:ok, info}
      {:error, %RegistrationError{}} = e -> e
      {:error, reason} -> {:error, %RegistrationError{reason: :plugin, message: reason}}
    end
  end

  @doc "Registration at application start: only when EXLA is present; never raises."
  def at_start do
    result =
      if Application.get_env(:exla_rs, :register_on_start, true) and Code.ensure_loaded?(EXLA) do
        # EXLA's NIF links libxla_extension: loading it (no client, no CUDA) makes XLA findable.
        Code.ensure_loaded(EXLA.NIF)
        register()
      else
        {:skipped, "EXLA is not loaded; register with ExlaRs.register/1 once it is"}
      end

    :persistent_term.put(@start_key, result)
    result
  rescue
    e -> :persistent_term.put(@start_key, {:error, Exception.message(e)})
  catch
    kind, value -> :persistent_term.put(@start_key, {:error, "#{kind}: #{inspect(value)}"})
  end

  @doc "What `at_start/0` did, or `nil` if it has not run."
  def start_result, do: :persistent_term.get(@start_key, nil)

  @doc """
  Paths of EXLA's `libxla_extension*.so` when EXLA's NIF is loaded in this VM (otherwise
  XLA is not loaded either, and we never load it ourselves).
  """
  def exla_paths do
    # Found once: registration runs before every lowering, and EXLA's priv dir does not
    # change while its NIF is loaded, so the recursive search is not repeated.
    case :persistent_term.get(@exla_paths_key, []) do
      [] ->
        with true <- :erlang.module_loaded(EXLA.NIF),
             dir when is_list(dir) <- :code.priv_dir(:exla),
             [_ | _] = paths <- Path.wildcard(Path.join(to_string(dir), "**/libxla_extension*.so")) do
          :persistent_term.put(@exla_paths_key, paths)
          paths
        else
          _ -> []
        end

      paths ->
        paths
    end
  end

  defp load_plugins([]), do: :ok

  defp load_plugins([path | rest]) do
    case load_pjrt_plugin(path) do
      {:ok, _} -> load_plugins(rest)
      error -> error
    end
  end

  defp native_register(paths, retry) do
    case call(fn -> NIF.register(Enum.map(paths, &to_string/1), retry) end) do
      {:ok, runtimes} -> {:ok, runtimes}
      {:error, %RegistrationError{}} = e -> e
      {:error, reason} -> {:error, %RegistrationError{reason: :nif, message: reason}}
    end
  end

  defp call(fun) do
    fun.()
  rescue
    e in ErlangError ->
      {:error, %RegistrationError{reason: :nif, message: "exla_rs NIF: " <> Exception.message(e)}}
  end

  defp interpret([]) do
    {:error,
     %RegistrationError{
       reason: :no_runtime,
       message:
         "no XLA runtime is loaded in this VM: start :exla first (Application.ensure_all_started(:exla)) " <>
           "or load a PJRT plugin with ExlaRs.load_pjrt_plugin/1"
     }}
  end

  defp interpret(runtimes) do
    if Enum.any?(runtimes, &(&1.state == :registered)) do
      {:ok, runtimes}
    else
      reasons =
        Enum.map_join(runtimes, "; ", fn r ->
          "#{r.kind} #{r.path}: " <> (r.error || failed_targets(r))
        end)

      {:error,
       %RegistrationError{
         reason: :failed,
         runtimes: runtimes,
         message: "no XLA runtime took our handlers: " <> reasons
       }}
    end
  end

  defp failed_targets(runtime) do
    Enum.map_join(
      for(%{result: {:error, why}} = r <- runtime.registrations, do: {r, why}),
      ", ",
      fn {r, why} ->
        "#{r.target}@#{r.platform}: #{why}"
      end
    )
  end

  # Only when :telemetry is running: on the code path but not started (a user who
  # has it as a transitive dependency of something not started yet), execute/3 would
  # log a warning on every registration pass.
  defp emit(runtimes) do
    if List.keymember?(Application.started_applications(), :telemetry, 0) do
      regs = Enum.flat_map(runtimes, & &1.registrations)
      ok = Enum.count(regs, &(&1.result == :ok))

      apply(:telemetry, :execute, [
        [:exla_rs, :register],
        %{runtimes: length(runtimes), registered: ok, failed: length(regs) - ok},
        %{runtimes: runtimes}
      ])
    end
  end
end
