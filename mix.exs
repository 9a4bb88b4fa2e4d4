defmodule ExlaRs.MixProject do
  use Mix.Project

  @version "0.1.0"
  # Where the project is published: its GitHub releases hold the precompiled NIFs
  # (scripts/release.sh builds them), the default base URL of `ExlaRs.NIF`.
  @source_url "https://github.com/exla-rs/exla_rs"

  def project do
    [
      app: :exla_rs,
      version: @version,
      # What Nx and EXLA need; the Nx layer is the library's reason to exist.
      elixir: "~> 1.17",
      start_permanent: Mix.env() == :prod,
      deps: deps(),
      description:
        "Fused flash-attention kernels (CPU and CUDA) for Nx programs compiled by EXLA, " <>
          "as XLA custom calls; precompiled NIFs with every CUDA kernel inside.",
      source_url: @source_url,
      package: package(),
      docs: docs()
    ]
  end

  def application do
    [
      mod: {ExlaRs.Application, []},
      extra_applications: [:logger]
    ]
  end

  # Bumblebee's own runtime dependencies, each added (as a local override) only when its
  # EXLA_RS_<APP>_PATH is set: offline, hex cannot resolve them, as with complex and polaris
  # (rustler, rustler_precompiled, castore and jason are exla_rs's own dependencies, below).
  @bumblebee_tree [
    :tokenizers,
    :nx_image,
    :unpickler,
    :safetensors,
    :unzip,
    :progress_bar,
    :decimal,
    :nx_signal
  ]

  # Exactly what a user's build needs: the Elixir sources, the checksum file of the precompiled
  # NIFs, and the native sources a source build (EXLA_RS_BUILD=1) compiles: the crates'
  # manifests, sources and build script, and the CUDA kernels. No tests, benchmarks, examples
  # or kernel tooling. scripts/release.sh writes the checksum file into the staging copy it
  # builds the package from.
  defp package do
    [
      licenses: ["Apache-2.0"],
      links: %{"GitHub" => @source_url, "Docs" => "https://hexdocs.pm/exla_rs"},
      files: ~w(
        lib mix.exs README.md LICENSE checksum-Elixir.ExlaRs.NIF.exs
        native/exla_rs/Cargo.toml native/exla_rs/Cargo.lock
        native/exla_rs/crates/*/Cargo.toml native/exla_rs/crates/*/src
        native/exla_rs/crates/exla-rs-cuda/build.rs
        native/exla_rs/kernels/*.cuh native/exla_rs/kernels/inst
        native/exla_rs/kernels/sm90/*.cuh native/exla_rs/kernels/sm90/inst
      )
    ]
  end

  defp docs do
    [
      main: "readme",
      source_ref: "v#{@version}",
      extras:
        [
          "README.md",
          "docs/getting-started.md",
          "docs/flash-attention-contract.md",
          "docs/bumblebee.md",
          "docs/performance.md",
          # Their own page names: the guides already have bumblebee.html and performance.html.
          {"notebooks/getting_started.livemd", filename: "notebook-getting-started", title: "Getting started (notebook)"},
          {"notebooks/bumblebee.livemd", filename: "notebook-bumblebee", title: "Bumblebee (notebook)"},
          {"notebooks/performance.livemd", filename: "notebook-performance", title: "Performance (notebook)"}
        ]
        |> Enum.filter(fn extra -> File.exists?(if is_tuple(extra), do: elem(extra, 0), else: extra) end),
      groups_for_extras: [
        Guides: ~r"docs/(getting-started|bumblebee|performance)",
        # Livebook notebooks (test/notebooks runs every cell of each in CI).
        Notebooks: ~r"notebooks/",
        Reference: ~r"docs/flash-attention-contract"
      ],
      groups_for_modules: [
        "Nx and Axon": [~r/^ExlaRs\.Attention/, ExlaRs.Axon, ExlaRs.CustomCall],
        Runtime: [
          ExlaRs.Application,
          ExlaRs.Registration,
          ExlaRs.RegistrationError,
          ExlaRs.Status,
          ExlaRs.Status.Formatter,
          ExlaRs.NIF
        ]
      ],
      assets: %{"docs/assets" => "assets"},
      # Bumblebee documents neither: shown as code, not links (no hidden-reference warnings).
      skip_code_autolink_to: ["Bumblebee.Layers.attention/8", "Bumblebee.Layers.Transformer"]
    ]
  end

  # Nx, EXLA and Axon are optional: exla_rs compiles its Nx layer, its `EXLA.CustomCall`
  # implementation and its Axon layer only when the user's project has them. Declaring them
  # (rather than probing whatever the VM holds) makes Mix compile them before exla_rs and put
  # them on its code path, in every compile order. The ranges are the versions we test
  # (Nx/EXLA 0.13: the `EXLA.CustomCall` protocol exists since EXLA 0.12; Axon 0.8).
  #
  # Offline (our CI, or a local checkout of Nx), `EXLA_RS_<APP>_PATH` turns a dependency into
  # a path dependency with `override: true`, as Axon's and Bumblebee's mix.exs take local Nx
  # and EXLA: one mix.exs serves hex users and machines with no hex.pm. Nx's and Axon's own
  # dependencies (complex, telemetry, polaris), RustlerPrecompiled's and Rustler's (castore,
  # jason) and ExDoc's are added the same way only when their variable is set, since hex
  # cannot resolve them either on such a machine.
  #
  # RustlerPrecompiled downloads and checks the NIF; Rustler only builds it from source
  # (EXLA_RS_BUILD=1), so it stays optional and users who build add it themselves.
  defp deps do
    [
      dep(:rustler_precompiled, "~> 0.8", []),
      dep(:rustler, "~> 0.38", optional: true, runtime: false),
      dep(:nx, "~> 0.13", optional: true),
      dep(:exla, "~> 0.13", optional: true),
      dep(:axon, "~> 0.8", optional: true),
      # Registration emits [:exla_rs, :register] while the :telemetry application runs.
      dep(:telemetry, "~> 0.4 or ~> 1.0", optional: true),
      # ExlaRs.Bumblebee.swap_attention/2. Bumblebee 0.7.0 asks Nx ~> 0.12.0: a project with
      # both (ours in its tests, or a user's) overrides Nx to 0.13 (its attention runs on it).
      dep(:bumblebee, "~> 0.7", optional: true),
      dep(:ex_doc, "~> 0.40", only: [:dev, :test], runtime: false)
    ] ++
      for(
        app <- [:complex, :polaris, :castore, :jason | @bumblebee_tree],
        path = local_path(app),
        do: {app, path: path, override: true, optional: true}
      ) ++
      for(
        app <- [:earmark_parser, :makeup, :makeup_elixir, :makeup_erlang, :nimble_parsec],
        path = local_path(app),
        do: {app, path: path, override: true, only: [:dev, :test], runtime: false}
      )
  end

  defp dep(app, requirement, opts) do
    case local_path(app) do
      nil -> {app, requirement, opts}
      path -> {app, [path: path, override: true] ++ opts}
    end
  end

  @doc false
  # EXLA_RS_NX_PATH, EXLA_RS_EXLA_PATH, ...: a local source tree of that dependency.
  def local_path(app) do
    case System.get_env("EXLA_RS_#{app |> Atom.to_string() |> String.upcase()}_PATH") do
      nil -> nil
      "" -> nil
      path -> Path.expand(path)
    end
  end
end
