defmodule ExlaRs.Status.Formatter do
  @moduledoc "`ExlaRs.status/0` as a readable report (what `mix exla_rs.status` prints)."

  def format(status) do
    [
      "exla_rs #{status.version}\n",
      section("NIF", nif(status)),
      section("Handlers", handlers(status)),
      section("CUDA", cuda(status.cuda)),
      section("Kernels", kernels(status.kernels)),
      section("XLA runtimes", runtimes(status.runtimes)),
      section("Registration", registration(status))
    ]
    |> IO.iodata_to_binary()
  end

  defp section(title, lines), do: ["\n", title, "\n", Enum.map(lines, &["  ", &1, "\n"])]

  defp nif(%{nif: :loaded, native_version: v} = s), do: ["loaded (native #{v})" | origin(s)]
  defp nif(%{nif: {:error, reason}} = s), do: ["NOT LOADED: #{reason}" | origin(s)]

  defp origin(%{nif_source: :precompiled, nif_path: path}), do: ["precompiled: #{path}.so"]
  defp origin(%{nif_source: :source_build, nif_path: path}), do: ["built from source: #{path}.so"]
  defp origin(_), do: []

  defp handlers(status) do
    ["XLA FFI API version reported: #{version(status.ffi_api_version)}"] ++
      Enum.map(status.targets, fn t -> "#{t.name} on #{t.platform} (#{t.symbol})" end)
  end

  defp cuda(%{available: false} = c), do: ["not available: #{c.reason}"] ++ forward_path(c)

  defp cuda(c) do
    ["available, driver #{driver(c.driver_version)}, #{length(c.devices)} device(s)"] ++
      Enum.map(c.devices, fn d ->
        {maj, min} = d.compute_capability

        "[#{d.ordinal}] #{d.name}, compute capability #{maj}.#{min}, #{gib(d.total_memory_bytes)} GiB"
      end) ++ forward_path(c)
  end

  defp forward_path(%{forward_path: path}) when is_binary(path), do: ["forward path: #{path}"]
  defp forward_path(_), do: []

  defp kernels(k) do
    [
      "embedded archs: #{list(k.embedded_archs)}",
      "PTX: #{k.ptx_arch || "none"}",
      "nvcc: #{k.nvcc_version || "not used"}",
      "NVRTC fallback: #{if k.nvrtc_fallback, do: "yes", else: "no"}" <>
        if(Map.get(k, :nvrtc_available),
          do: " (libnvrtc loadable now)",
          else: " (libnvrtc not loadable now)"
        ),
      "kernel files: #{Map.get(k, :kernel_files, 0)}"
    ] ++
      if(Map.get(k, :head_dims), do: ["head dims: #{k.head_dims}"], else: []) ++
      if(Map.get(k, :note), do: ["note: #{k.note}"], else: [])
  end

  defp runtimes([]), do: ["none loaded in this VM (start :exla, or ExlaRs.load_pjrt_plugin/1)"]

  defp runtimes(rs) do
    Enum.flat_map(rs, fn r ->
      [
        "#{r.kind}: #{r.path}",
        "    state: #{r.state}#{if r.verified, do: " (XLA's own answers)", else: ""}",
        "    XLA FFI API: #{version(r.ffi_api_version)}" <>
          if(r.pjrt_api_version, do: ", PJRT C API: #{version(r.pjrt_api_version)}", else: "")
      ] ++
        if(r.route, do: ["    route: #{r.route}"], else: []) ++
        if(r.error, do: ["    error: #{r.error}"], else: []) ++
        Enum.map(r.registrations, fn reg ->
          "    #{reg.target} @ #{reg.platform}: " <>
            case reg.result do
              :ok -> "registered"
              {:error, why} -> "FAILED: #{why}"
            end
        end)
    end)
  end

  defp registration(status) do
    c = status.registrations

    [
      "passes #{c.passes}, targets attempted #{c.attempted}, succeeded #{c.succeeded}, failed #{c.failed}, " <>
        "runtimes failed #{c.runtime_failures}",
      "at application start: #{at_start(status.at_start)}"
    ]
  end

  defp at_start(nil), do: "not run"
  defp at_start({:ok, rs}), do: "registered into #{length(rs)} runtime(s)"
  defp at_start({:skipped, why}), do: "skipped: #{why}"
  defp at_start({:error, %{message: m}}), do: "failed: #{m}"
  defp at_start({:error, m}), do: "failed: #{m}"

  defp version(nil), do: "unknown"
  defp version({maj, min}), do: "#{maj}.#{min}"

  defp driver(nil), do: "unknown"
  defp driver(v) when is_integer(v), do: "#{div(v, 1000)}.#{div(rem(v, 1000), 10)}"

  defp gib(bytes), do: Float.round(bytes / 1_073_741_824, 1)

  defp list([]), do: "none"
  defp list(xs), do: Enum.join(xs, ", ")
end
