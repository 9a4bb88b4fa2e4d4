defmodule ExlaRs.PrecompiledTest do
  # exla_rs as a Hex user installs it: the Hex package scripts/release.sh built (unpacked) is
  # the dependency of a fresh Mix project whose PATH has no cargo or rustc; its NIF comes from
  # an HTTP server on 127.0.0.1 that this test starts and stops, checked against the checksum
  # file in the package. `EXLA_RS_RELEASE_DIR` names the release (scripts/test.sh builds it).
  use ExUnit.Case, async: false

  @moduletag :precompiled
  @moduletag :pjrt_plugin
  @moduletag timeout: 900_000

  @repo Path.expand("../..", __DIR__)
  alias ExlaRs.UserProject
  @version Mix.Project.config()[:version]
  @target "x86_64-unknown-linux-gnu"

  setup_all do
    release = System.fetch_env!("EXLA_RS_RELEASE_DIR")

    tmp =
      Path.join(System.tmp_dir!(), "exla_rs_precompiled_#{System.unique_integer([:positive])}")

    File.mkdir_p!(tmp)
    on_exit(fn -> File.rm_rf!(tmp) end)

    package =
      unpack_package!(Path.join(release, "exla_rs-#{@version}.tar"), Path.join(tmp, "exla_rs"))

    %{release: release, tmp: tmp, package: package}
  end

  test "the Hex package holds exactly what users need", %{package: package} do
    files =
      package |> Path.join("**") |> Path.wildcard(match_dot: true) |> Enum.reject(&File.dir?/1)

    files = Enum.map(files, &Path.relative_to(&1, package))

    for f <- ~w(mix.exs README.md LICENSE checksum-Elixir.ExlaRs.NIF.exs lib/exla_rs/nif.ex
                native/exla_rs/Cargo.toml native/exla_rs/Cargo.lock
                native/exla_rs/crates/exla-rs-cuda/build.rs native/exla_rs/kernels/inst/aux.cu) do
      assert f in files, "#{f} is missing from the package"
    end

    # Nothing for developers only: no tests, benchmarks, scripts, build output or tooling.
    extra =
      Enum.filter(
        files,
        &String.match?(&1, ~r"^(test|bench|scripts|_build|deps|priv)/|/tests/|/target/|\.py$")
      )

    assert extra == []

    assert Enum.all?(files, &String.match?(&1, ~r"^(lib/|native/exla_rs/|[^/]+$)")),
           inspect(files)

    # Its checksum file names one artifact per NIF version users run.
    {checksums, _} = Code.eval_file(Path.join(package, "checksum-Elixir.ExlaRs.NIF.exs"))

    assert Enum.sort(Map.keys(checksums)) ==
             for(
               n <- ~w(2.15 2.16 2.17),
               do: "libexla_rs_nif-v#{@version}-nif-#{n}-#{@target}.so.tar.gz"
             )

    assert Enum.all?(Map.values(checksums), &String.match?(&1, ~r/^sha256:[0-9a-f]{64}$/))
  end

  test "each artifact is built for the NIF version its name says", %{release: release, tmp: tmp} do
    # On this VM (OTP 25, NIF 2.16) a 2.15 or 2.16 library loads and a 2.17 one is refused.
    ours = :erlang.system_info(:nif_version) |> to_string()

    for n <- ~w(2.15 2.16 2.17) do
      name = "libexla_rs_nif-v#{@version}-nif-#{n}-#{@target}.so"
      dir = Path.join(tmp, "load-#{n}")

      :ok =
        :erl_tar.extract(Path.join(release, name <> ".tar.gz"), [
          :compressed,
          cwd: String.to_charlist(dir)
        ])

      lib = Path.join(dir, Path.rootname(name, ".so"))

      # load_nif/2 wants a module of the library's name with every NIF defined.
      script = """
      defmodule ExlaRs.NIF do
        for {name, arity} <- #{inspect(ExlaRs.NIF.__info__(:functions))} do
          def unquote(name)(unquote_splicing(Macro.generate_arguments(arity, __MODULE__))), do: :stub
        end

        def load_for_test(path), do: :erlang.load_nif(String.to_charlist(path), 0)
      end

      IO.inspect(ExlaRs.NIF.load_for_test(#{inspect(lib)}))
      """

      {out, 0} = System.cmd(elixir(), ["-e", script], stderr_to_stdout: true)

      if Version.compare("#{n}.0", "#{ours}.0") == :gt do
        assert out =~ "load_failed" and out =~ "#{n}", "NIF #{n} on #{ours}: #{out}"
      else
        assert out =~ ":ok", "NIF #{n} on #{ours}: #{out}"
      end
    end
  end

  test "a user project with no Rust downloads, verifies and loads the NIF; bad downloads leave nothing",
       %{release: release, tmp: tmp, package: package} do
    project = Path.join(tmp, "user")
    cache = Path.join(tmp, "cache")
    docroot = Path.join(tmp, "www")
    served = Path.join([docroot, "v#{@version}"])
    File.mkdir_p!(served)
    write_project!(project, package)

    {:ok, server} = start_server(docroot)
    on_exit(fn -> :inets.stop(:httpd, server) end)
    port = :httpd.info(server)[:port]
    base = "http://127.0.0.1:#{port}/v#{@version}"
    env = user_env(cache, base)

    file =
      "libexla_rs_nif-v#{@version}-nif-#{:erlang.system_info(:nif_version)}-#{@target}.so.tar.gz"

    url = "#{base}/#{file}"
    artifact = File.read!(Path.join(release, file))

    # The user's PATH has neither cargo nor rustc.
    assert {"none\n", 0} =
             System.cmd("sh", ["-c", "command -v cargo rustc || echo none"], env: env)

    # 0. A target with no artifact (RustlerPrecompiled reads the target from TARGET_ARCH, as
    #    on Nerves): says which targets exist and how to build, downloads nothing.
    {out, status} = mix(project, ["compile"], List.keystore(env, "TARGET_ARCH", 0, {"TARGET_ARCH", "aarch64"}))
    assert status != 0
    assert out =~ "aarch64-unknown-linux-gnu"
    assert out =~ "exla_rs publishes precompiled NIFs for x86_64-unknown-linux-gnu"
    assert out =~ "EXLA_RS_BUILD=1"
    assert_nothing_installed(project, cache, file)

    # 1. The server is down: the URL and EXLA_RS_BUILD=1 in the message, nothing installed.
    :ok = :inets.stop(:httpd, server)
    {out, status} = mix(project, ["compile"], env)
    assert status != 0
    assert out =~ "could not download the precompiled NIF from #{url}"
    assert out =~ "EXLA_RS_BUILD=1"
    assert_nothing_installed(project, cache, file)
    show("unreachable server", out)

    # 2. A tampered artifact: the checksum named, how to recover, nothing installed or cached.
    {:ok, server} = start_server(docroot, port)
    on_exit(fn -> :inets.stop(:httpd, server) end)
    <<head::binary-size(1000), byte, rest::binary>> = artifact
    File.write!(Path.join(served, file), [head, Bitwise.bxor(byte, 1), rest])
    {out, status} = mix(project, ["compile"], env)
    assert status != 0
    assert out =~ "does not match its checksum"
    assert out =~ "expected sha256:" <> sha256(artifact)
    assert out =~ "checksum-Elixir.ExlaRs.NIF.exs"
    assert out =~ "mix deps.compile exla_rs"
    assert out =~ "EXLA_RS_BUILD=1"
    assert_nothing_installed(project, cache, file)
    show("tampered artifact", out)

    # 3. The real artifact: downloaded once, verified, loaded; status, PJRT registration and
    #    attention work (test/user_project/precompiled_check.exs).
    File.write!(Path.join(served, file), artifact)
    {fetch_us, :ok} = :timer.tc(fn -> fetch_and_verify(url, file, package) end)
    {compile_us, {out, status}} = :timer.tc(fn -> mix(project, ["compile"], env) end)
    assert status == 0, out
    assert File.exists?(Path.join(cache, file)), "the verified download is cached"

    {out, status} =
      mix(project, ["run", Path.join(@repo, "test/user_project/precompiled_check.exs")], env)

    assert status == 0, out
    assert out =~ "PRECOMPILED OK"
    # What `mix exla_rs.status` shows such a user, for the test log.
    IO.puts(
      "\n[precompiled] status:\n" <>
        (out
         |> String.split("exla_rs #{@version}\n", parts: 2)
         |> List.last()
         |> String.split("kernels: [")
         |> hd())
    )

    IO.puts(
      "\n[precompiled] #{file}: #{byte_size(artifact)} bytes; download + sha256 " <>
        "#{div(fetch_us, 1000)} ms; the project's compile with the download #{div(compile_us, 1000)} ms"
    )

    :ok = :inets.stop(:httpd, server)
  end

  # The Hex tarball: an outer tar holding contents.tar.gz (the package's files).
  defp unpack_package!(tar, dir) do
    {:ok, files} = :erl_tar.extract(String.to_charlist(tar), [:memory])
    {_, contents} = List.keyfind(files, ~c"contents.tar.gz", 0)
    :ok = :erl_tar.extract({:binary, contents}, [:compressed, cwd: String.to_charlist(dir)])
    dir
  end

  # As a user writes it (with the offline toolchain's trees standing in for hex.pm).
  defp write_project!(dir, package) do
    deps =
      for app <- [:rustler_precompiled, :castore, :nx, :complex, :telemetry, :exla],
          dep = UserProject.dep(app, if(app in [:nx, :exla], do: "~> 0.13")),
          do: dep

    UserProject.write!(dir, [{:exla_rs, path: package} | deps])

    if ExlaRs.MixProject.local_path(:nx) == nil do
      {_, 0} =
        System.cmd(UserProject.mix_executable(), ["deps.get"], cd: dir, stderr_to_stdout: true)
    end
  end

  # The user's environment: no Rust on PATH, its own download cache, our server as base URL.
  defp user_env(cache, base) do
    path =
      System.get_env("PATH")
      |> String.split(":")
      |> Enum.reject(fn d ->
        File.exists?(Path.join(d, "cargo")) or File.exists?(Path.join(d, "rustc"))
      end)
      |> Enum.join(":")

    [
      {"PATH", path},
      {"MIX_ENV", "dev"},
      {"EXLA_RS_REPO", @repo},
      {"EXLA_RS_PRECOMPILED_BASE_URL", base},
      {"RUSTLER_PRECOMPILED_GLOBAL_CACHE_PATH", cache},
      {"EXLA_RS_BUILD", nil},
      {"RUSTLER_PRECOMPILED_FORCE_BUILD_ALL", nil},
      # httpc would send even 127.0.0.1 through a proxy.
      {"HTTP_PROXY", nil},
      {"http_proxy", nil},
      {"HTTPS_PROXY", nil},
      {"https_proxy", nil},
      {"CARGO", nil},
      # RustlerPrecompiled's cross-compile overrides (Nerves): this machine's own target.
      {"TARGET_ARCH", nil},
      {"TARGET_VENDOR", nil},
      {"TARGET_OS", nil},
      {"TARGET_ABI", nil},
      {"MIX_EXS", nil},
      {"MIX_BUILD_PATH", nil},
      {"MIX_DEPS_PATH", nil}
    ]
  end

  # What the user reads: the compile error, for the test log.
  defp show(what, out) do
    [_, error] = String.split(out, "** (RuntimeError) ", parts: 2)
    IO.puts("\n[precompiled] #{what}:\n" <> (error |> String.split("\n    lib/") |> hd()))
  end

  defp mix(dir, args, env) do
    System.cmd(UserProject.mix_executable(), args, cd: dir, env: env, stderr_to_stdout: true)
  end

  defp assert_nothing_installed(project, cache, file) do
    priv = Path.join(project, "_build/dev/lib/exla_rs/priv/native")
    assert Path.wildcard(Path.join(priv, "*")) == [], "left in #{priv}"
    refute File.exists?(Path.join(project, "_build/dev/lib/exla_rs/ebin/Elixir.ExlaRs.NIF.beam"))
    refute File.exists?(Path.join(cache, file)), "a bad download stayed in the cache"
  end

  # What RustlerPrecompiled does for the artifact, timed on its own: GET and sha256 against the
  # package's checksum file.
  defp fetch_and_verify(url, file, package) do
    {:ok, {{_, 200, _}, _, body}} =
      :httpc.request(:get, {String.to_charlist(url), []}, [], body_format: :binary)

    {checksums, _} = Code.eval_file(Path.join(package, "checksum-Elixir.ExlaRs.NIF.exs"))
    assert checksums[file] == "sha256:" <> sha256(body)
    :ok
  end

  defp start_server(docroot, port \\ 0) do
    {:ok, _} = Application.ensure_all_started(:inets)

    :inets.start(:httpd,
      port: port,
      bind_address: {127, 0, 0, 1},
      server_name: ~c"exla_rs_test",
      server_root: String.to_charlist(docroot),
      document_root: String.to_charlist(docroot)
    )
  end

  defp sha256(data), do: :crypto.hash(:sha256, data) |> Base.encode16(case: :lower)

  defp elixir, do: System.find_executable("elixir") || flunk("no elixir on PATH")
end
