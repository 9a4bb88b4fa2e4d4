defmodule ExlaRs.Status do
  @moduledoc """
  What exla_rs found and did in this VM, as one map (`ExlaRs.status/0`):

    * `:version` - the exla_rs version
    * `:nif` - `:loaded` or `{:error, reason}`
    * `:nif_source` - `:precompiled` (downloaded and checked against the package's checksum
      file) or `:source_build` (built with cargo); `:nif_path` - the library, without `.so`
    * `:ffi_api_version` - the XLA FFI API version our handlers report (`{0, 1}`)
    * `:targets` - `[%{name:, platform:, symbol:}]`
    * `:cuda` - `%{available: false, reason:}` without a driver or GPU, otherwise
      `%{available: true, driver_version:, devices: [%{ordinal:, name:, compute_capability:,
      total_memory_bytes:}]}`; both with `forward_path`: which kernel set runs which forward calls
      (mma.sync or the Hopper sm90 forward) under `EXLA_RS_CUDA_PATH`, and why, then which calls
      take the split-KV decode kernels (under `EXLA_RS_CUDA_SPLITS`), which backward, and whether
      its sums are deterministic (`EXLA_RS_DETERMINISTIC`)
    * `:kernels` - how the CUDA kernels were built: `embedded_archs`, `ptx_arch`,
      `nvcc_version`, `nvrtc_fallback`, `nvrtc_available`, `kernel_files`, `note`, and
      `head_dims`: which head dims run natively (32, 64, 96, 128, 192, 256) and which padded
      (every other one up to 256, on the next native head dim with zero-padded columns)
    * `:runtimes` - each XLA runtime in the VM: `kind` (`:xla_extension` | `:pjrt_plugin`),
      `path`, `state` (`:registered` | `:partial` | `:failed` | `:found`), `ffi_api_version`,
      `pjrt_api_version`, `route`, `verified` (results are XLA's own answers),
      `registrations` (`[%{target:, platform:, result: :ok | {:error, why}}]`), `error`
    * `:registrations` - counters since the NIF loaded: `passes`, `attempted`, `succeeded`,
      `failed`, `runtime_failures`
    * `:at_start` - what registration at application start did

  Collecting the status queries the CUDA driver (on a dirty scheduler) but registers nothing.
  """

  alias ExlaRs.{NIF, Registration}

  def collect do
    case NIF.load_error() do
      nil -> loaded()
      reason -> not_loaded(reason)
    end
  end

  defp loaded do
    info = NIF.native_info()
    {runtimes, counters} = NIF.runtimes(Registration.exla_paths())

    %{
      version: version() || info.version,
      native_version: info.version,
      nif: :loaded,
      nif_source: NIF.source(),
      nif_path: NIF.nif_path(),
      ffi_api_version: info.ffi_api_version,
      targets: info.targets,
      cuda: NIF.cuda_status(),
      kernels: NIF.kernel_build(),
      runtimes: runtimes,
      registrations: counters,
      at_start: Registration.start_result()
    }
  end

  defp version do
    case Application.spec(:exla_rs, :vsn) do
      nil -> nil
      vsn -> to_string(vsn)
    end
  end

  defp not_loaded(reason) do
    %{
      version: version(),
      native_version: nil,
      nif: {:error, reason},
      nif_source: NIF.source(),
      nif_path: NIF.nif_path(),
      ffi_api_version: nil,
      targets: [],
      cuda: %{
        available: false,
        reason: "unknown: the NIF is not loaded",
        driver_version: nil,
        devices: [],
        forward_path: nil
      },
      kernels: %{
        embedded_archs: [],
        ptx_arch: nil,
        nvcc_version: nil,
        nvrtc_fallback: false,
        nvrtc_available: false,
        kernel_files: 0,
        note: nil,
        head_dims: nil
      },
      runtimes: [],
      registrations: %{passes: 0, attempted: 0, succeeded: 0, failed: 0, runtime_failures: 0},
      at_start: Registration.start_result()
    }
  end
end
