# Run with `mix run` inside the user project of test/exla_rs/precompiled_test.exs, whose exla_rs
# came from the Hex package with a precompiled NIF. Prints "PRECOMPILED OK" and exits 0, or
# raises with the reason.
check = fn ok?, what -> unless ok?, do: raise("CHECK FAILED: " <> what) end
build = Mix.Project.build_path()

# The library RustlerPrecompiled downloaded and unpacked, not one built here.
check.(ExlaRs.NIF.source() == :precompiled, "ExlaRs.NIF.source() is #{inspect(ExlaRs.NIF.source())}")
check.(ExlaRs.NIF.load_error() == nil, "the NIF did not load: #{ExlaRs.NIF.load_error()}")
nif = ExlaRs.NIF.nif_path() <> ".so"
check.(String.starts_with?(nif, build) and File.exists?(nif), "the NIF is not under #{build}: #{nif}")

check.(
  Path.basename(nif) ==
    "libexla_rs_nif-v0.1.0-nif-#{:erlang.system_info(:nif_version)}-x86_64-unknown-linux-gnu.so",
  "unexpected library #{nif}"
)

# status/0 and what the artifact holds: every kernel image, whatever GPU this machine has.
status = ExlaRs.status()
check.(status.nif == :loaded, "status.nif: #{inspect(status.nif)}")
check.(status.nif_source == :precompiled and status.nif_path <> ".so" == nif, "status: #{inspect(status)}")
archs = status.kernels.embedded_archs
check.(Enum.all?(~w(sm_80 sm_90), &(&1 in archs)), "embedded archs: #{inspect(archs)}")
check.(status.kernels.nvcc_version != nil, "kernels not built by nvcc: #{inspect(status.kernels)}")
IO.puts(ExlaRs.Status.Formatter.format(status))
IO.puts("kernels: #{inspect(archs)} + PTX #{status.kernels.ptx_arch}, nvcc #{status.kernels.nvcc_version}")

# The handlers register into a real XLA: the PJRT CPU plugin, as XLA itself answers.
plugin = System.fetch_env!("EXLA_RS_PJRT_PLUGIN")
{:ok, info} = ExlaRs.load_pjrt_plugin(plugin)
{:ok, runtimes} = ExlaRs.register()
# (info.path is the path the plugin is mapped at, symbolic links resolved.)
rt = Enum.find(runtimes, &(&1.path == info.path))
check.(match?(%{state: :registered, verified: true}, rt), "plugin registration: #{inspect(rt)}")

for t <- ["exla_rs_flash_attn_fwd", "exla_rs_flash_attn_bwd"], p <- ["Host", "CUDA"] do
  check.(Enum.any?(rt.registrations, &(&1.target == t and &1.platform == p and &1.result == :ok)), "#{t} @ #{p}")
end

IO.puts("registered into #{rt.path} (XLA FFI #{inspect(rt.ffi_api_version)})")

# Attention runs (jitted, with its gradient) and EXLA's :host client gets our custom calls:
# the user-project check, unchanged.
System.argv(["nx,exla"])
Code.eval_file(Path.join(System.fetch_env!("EXLA_RS_REPO"), "test/user_project/check.exs"))
IO.puts("PRECOMPILED OK")
