defmodule ExlaRs.PjrtPluginTest do
  # Loads a real XLA CPU PJRT plugin (PyPI lammps-jax-pjrt-cpu, PJRT 0.115, XLA FFI 0.4) into
  # this VM through the NIF and registers our handlers through its FFI extension.
  use ExUnit.Case, async: false

  @moduletag :pjrt_plugin

  setup_all do
    path = System.fetch_env!("EXLA_RS_PJRT_PLUGIN")
    {:ok, info} = ExlaRs.load_pjrt_plugin(path)
    %{path: Path.expand(path), info: info}
  end

  test "the plugin loads and has the FFI extension", %{info: info} do
    assert {0, minor} = info.pjrt_api_version
    assert minor >= 45
    assert 5 in info.extension_types
    # A second load neither reloads nor re-initialises it.
    assert {:ok, %{newly_loaded: false}} = ExlaRs.load_pjrt_plugin(info.path)
  end

  test "register puts our Host and CUDA targets into its XLA, as XLA itself answers", %{
    info: info
  } do
    assert {:ok, runtimes} = ExlaRs.register()
    plugin = Enum.find(runtimes, &(&1.path == info.path))
    assert %{kind: :pjrt_plugin, state: :registered, verified: true, error: nil} = plugin
    # The FFI API version is the plugin's XLA's own, read from the table XLA's probe gave us.
    assert {0, ffi_minor} = plugin.ffi_api_version
    assert ffi_minor >= 2
    assert plugin.route =~ "XLA_FFI_Handler_Register"

    for t <- ["exla_rs_flash_attn_fwd", "exla_rs_flash_attn_bwd"], p <- ["Host", "CUDA"] do
      assert %{result: :ok} =
               Enum.find(plugin.registrations, &(&1.target == t and &1.platform == p))
    end
  end

  test "registration is idempotent and safe from many processes at once", %{info: info} do
    {:ok, _} = ExlaRs.register()
    before = ExlaRs.status().registrations

    results =
      1..16
      |> Task.async_stream(fn _ -> ExlaRs.register() end, max_concurrency: 16)
      |> Enum.map(fn {:ok, r} -> r end)

    for {:ok, runtimes} <- results do
      assert %{state: :registered} = Enum.find(runtimes, &(&1.path == info.path))
    end

    assert length(results) == 16
    after_ = ExlaRs.status().registrations
    assert after_.attempted == before.attempted, "nothing was sent to XLA twice"
    assert after_.passes == before.passes + 16
  end

  test "status and the mix task show the plugin", %{info: info} do
    {:ok, _} = ExlaRs.register()
    assert %{state: :registered} = Enum.find(ExlaRs.status().runtimes, &(&1.path == info.path))
    output = ExUnit.CaptureIO.capture_io(fn -> Mix.Tasks.ExlaRs.Status.run([]) end)
    assert output =~ "pjrt_plugin: #{info.path}"
    assert output =~ "exla_rs_flash_attn_fwd @ Host: registered"
  end

  test "a CPU plugin serves EXLA's :host client, never its :cuda one" do
    # The plugin takes our CUDA targets too (XLA's registry accepts any platform name), but
    # EXLA's :cuda client runs in EXLA's own libxla_extension, which is not loaded here.
    previous = :persistent_term.get({ExlaRs.CustomCall, :registered}, [])
    :persistent_term.put({ExlaRs.CustomCall, :registered}, [])
    on_exit(fn -> :persistent_term.put({ExlaRs.CustomCall, :registered}, previous) end)
    :persistent_term.erase({ExlaRs.CustomCall, :warned, :cuda})

    assert ExlaRs.CustomCall.ensure_registered(:host) == :ok

    log =
      ExUnit.CaptureLog.capture_log(fn ->
        assert {:error, reason} = ExlaRs.CustomCall.ensure_registered(:cuda)
        assert reason =~ "no EXLA libxla_extension"
        assert reason =~ "pjrt_plugin"
        # Logged once per platform, not on every lowering.
        assert {:error, _} = ExlaRs.CustomCall.ensure_registered(:cuda)
      end)

    assert length(String.split(log, "not available to EXLA's :cuda client")) == 2
  end
end
