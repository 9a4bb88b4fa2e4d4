defmodule ExlaRs.StatusTest do
  use ExUnit.Case, async: true

  @keys [
    :version,
    :nif,
    :nif_source,
    :nif_path,
    :ffi_api_version,
    :targets,
    :cuda,
    :kernels,
    :runtimes,
    :registrations,
    :at_start
  ]

  test "status has every key" do
    status = ExlaRs.status()
    for key <- @keys, do: assert(Map.has_key?(status, key), "missing #{key}")
    assert status.version == Mix.Project.config()[:version]
    assert status.nif == :loaded
    # A checkout has no checksum file: its NIF is built from source, by Rustler.
    assert status.nif_source == :source_build
    assert File.exists?(status.nif_path <> ".so")
    assert status.ffi_api_version == {0, 1}
  end

  test "targets are forward and backward on Host and CUDA" do
    pairs = for t <- ExlaRs.status().targets, do: {t.name, t.platform}

    assert Enum.sort(pairs) ==
             Enum.sort([
               {"exla_rs_flash_attn_fwd", "Host"},
               {"exla_rs_flash_attn_bwd", "Host"},
               {"exla_rs_flash_attn_fwd", "CUDA"},
               {"exla_rs_flash_attn_bwd", "CUDA"}
             ])
  end

  test "cuda says whether it is available, and why not" do
    cuda = ExlaRs.status().cuda

    case cuda do
      %{available: false, reason: reason, devices: []} ->
        assert is_binary(reason) and reason != ""

      %{available: true, driver_version: v, devices: [_ | _] = devices} ->
        assert is_integer(v)

        for d <- devices do
          assert %{ordinal: o, name: n, compute_capability: {maj, _}, total_memory_bytes: m} = d
          assert is_integer(o) and is_binary(n) and maj >= 1 and m > 0
        end
    end

    # Which forward kernel set runs for what, and why: auto takes the sm90 forward only on
    # compute capability 9.0, for the pairs verified there (sm90.rs AUTO_SM90_VERIFIED).
    assert is_binary(cuda.forward_path)

    if System.get_env("EXLA_RS_CUDA_PATH") in [nil, "", "auto"] do
      hopper = Enum.any?(cuda.devices, &(&1.compute_capability == {9, 0}))
      assert cuda.forward_path =~ if(hopper, do: "sm90 (wgmma/TMA)", else: "mma.sync (auto)")
      assert cuda.forward_path =~ "bf16 D=128/256 and f16 D=128/256"
      assert cuda.forward_path =~ "EXLA_RS_CUDA_PATH=sm90"
    end

    # Whether the backward's sums are deterministic (exla-rs-cuda's determinism.rs), on or off.
    assert cuda.forward_path =~ "EXLA_RS_DETERMINISTIC"

    # CI has no GPU.
    if System.get_env("CI_HAS_GPU") != "1" and not File.exists?("/dev/nvidia0") do
      assert cuda.available == false
    end
  end

  test "kernels say how they were built" do
    k = ExlaRs.status().kernels
    assert is_list(k.embedded_archs) and is_boolean(k.nvrtc_fallback)
    assert k.ptx_arch == nil or is_binary(k.ptx_arch)
    # Which head dims the CUDA kernels run natively and which padded (issue 33, part 4).
    assert k.head_dims =~ "native: D = 32, 64, 96, 128, 192, 256"
    assert k.head_dims =~ "padded: every other D in 1..=256"
    assert ExlaRs.Status.Formatter.format(ExlaRs.status()) =~ "head dims: native: D = 32"
  end

  test "runtimes and counters are well-formed" do
    status = ExlaRs.status()

    for r <- status.runtimes do
      assert r.kind in [:xla_extension, :pjrt_plugin]
      assert r.state in [:registered, :partial, :failed, :found]
      assert is_binary(r.path)
    end

    assert %{passes: _, attempted: _, succeeded: _, failed: _, runtime_failures: _} =
             status.registrations
  end

  test "the application start was recorded and did not fail without EXLA" do
    unless Code.ensure_loaded?(EXLA) do
      assert {:skipped, why} = ExlaRs.status().at_start
      assert why =~ "EXLA is not loaded"
    end
  end

  test "the formatter renders every section" do
    text = ExlaRs.Status.Formatter.format(ExlaRs.status())

    for section <- ["NIF", "Handlers", "CUDA", "Kernels", "XLA runtimes", "Registration"],
        do: assert(text =~ section)

    assert text =~ "exla_rs_flash_attn_fwd on Host"
  end
end
