defmodule Mix.Tasks.ExlaRs.StatusTest do
  use ExUnit.Case, async: false
  import ExUnit.CaptureIO

  test "mix exla_rs.status prints the report" do
    output = capture_io(fn -> Mix.Tasks.ExlaRs.Status.run([]) end)
    assert output =~ "exla_rs 0.1.0"
    assert output =~ "loaded (native 0.1.0)"
    assert output =~ "built from source: #{ExlaRs.NIF.nif_path()}.so"
    assert output =~ "XLA FFI API version reported: 0.1"
    assert output =~ "exla_rs_flash_attn_bwd on CUDA"
    assert output =~ ~r/CUDA\n  (not available: .+|available, driver .+)\n/
    assert output =~ "XLA runtimes"
  end

  test "--register reports a registration failure without raising" do
    output =
      capture_io(:stderr, fn ->
        capture_io(fn -> Mix.Tasks.ExlaRs.Status.run(["--plugin", "/nonexistent/p.so"]) end)
      end)

    assert output =~ "registration: cannot load /nonexistent/p.so"
  end
end
