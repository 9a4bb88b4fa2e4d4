defmodule ExlaRs.RegisterTest do
  use ExUnit.Case, async: false

  # Other tests in this VM may load a PJRT plugin for good, so "no runtime" is checked in a
  # fresh VM with only our app: exactly what a user without EXLA gets.
  test "register answers {:error, _} cleanly when no XLA runtime is loaded" do
    elixir = System.find_executable("elixir")

    script = """
    {:ok, _} = Application.ensure_all_started(:exla_rs)
    first = ExlaRs.register()
    second = ExlaRs.register()
    IO.write(Base.encode64(:erlang.term_to_binary({first, second, ExlaRs.status()})))
    """

    {out, 0} = System.cmd(elixir, code_path() ++ ["-e", script], stderr_to_stdout: false)
    {first, second, status} = out |> String.trim() |> Base.decode64!() |> :erlang.binary_to_term()

    assert {:error, %ExlaRs.RegistrationError{reason: :no_runtime, message: message}} = first
    assert message =~ "start :exla first"
    assert second == first
    assert status.runtimes == []
    assert status.registrations.passes == 2
  end

  test "register! raises the error" do
    elixir = System.find_executable("elixir")

    script =
      "try do ExlaRs.register!() rescue e in ExlaRs.RegistrationError -> IO.write(e.message) end"

    {out, 0} = System.cmd(elixir, code_path() ++ ["-e", script])
    assert out =~ "no XLA runtime is loaded in this VM"
  end

  test "an explicit runtime path that is not loaded comes back as a failed runtime" do
    # {:error, :failed} alone; {:ok, _} when another test loaded a plugin into this VM.
    runtimes =
      case ExlaRs.register(paths: ["/nonexistent/xla_extension/lib/libxla_extension.so"]) do
        {:error, %ExlaRs.RegistrationError{reason: :failed, runtimes: runtimes}} -> runtimes
        {:ok, runtimes} -> runtimes
      end

    assert %{kind: :xla_extension, state: :failed, error: error} =
             Enum.find(runtimes, &(&1.path =~ "nonexistent"))

    assert error =~ "is not loaded in this process"
  end

  def forward_event(event, measurements, metadata, pid), do: send(pid, {:event, event, measurements, metadata})

  # :telemetry is an (optional) dependency of the project, so it is always there in its tests.
  test "each registration pass emits [:exla_rs, :register] while :telemetry runs" do
    {:ok, _} = Application.ensure_all_started(:telemetry)
    parent = self()
    id = {__MODULE__, make_ref()}

    :ok =
      apply(:telemetry, :attach, [
        id,
        [:exla_rs, :register],
        &__MODULE__.forward_event/4,
        parent
      ])

    try do
      result = ExlaRs.register(paths: ["/nonexistent/xla_extension/lib/libxla_extension.so"])
      assert_receive {:event, [:exla_rs, :register], measurements, %{runtimes: runtimes}}

      assert %{runtimes: n, registered: ok, failed: failed} = measurements
      assert n == length(runtimes) and n >= 1
      assert Enum.any?(runtimes, &(&1.path =~ "nonexistent" and &1.state == :failed))
      assert is_integer(ok) and is_integer(failed)
      assert match?({:error, _}, result) or match?({:ok, _}, result)
    after
      apply(:telemetry, :detach, [id])
    end
  end

  test "a plugin that cannot be loaded is an error, not a crash" do
    assert {:error, %ExlaRs.RegistrationError{reason: :plugin, message: m}} =
             ExlaRs.register(plugin: "/nonexistent/pjrt_plugin.so")

    assert m =~ "cannot load"
  end

  # `-pa` for our app and the applications it requires (RustlerPrecompiled, castore), found in
  # this build: none of the optional ones (Nx, EXLA, ...), as for a user without them.
  defp code_path(app \\ :exla_rs, seen \\ MapSet.new()) do
    lib = :code.lib_dir(app)

    if MapSet.member?(seen, app) or not is_list(lib) or
         not String.starts_with?(to_string(lib), Mix.Project.build_path()) do
      []
    else
      seen = MapSet.put(seen, app)

      ["-pa", Path.join(to_string(lib), "ebin")] ++
        Enum.flat_map(Application.spec(app, :applications), &code_path(&1, seen))
    end
  end
end
