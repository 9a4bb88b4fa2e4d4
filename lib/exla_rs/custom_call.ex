defmodule ExlaRs.CustomCall do
  @moduledoc """
  How the attention blocks become XLA custom calls under EXLA.

  EXLA (>= 0.12) asks the `EXLA.CustomCall` protocol about every `Nx.block/4` it
  compiles. For `ExlaRs.Attention.Forward` and `ExlaRs.Attention.Backward` the
  implementation (defined only when EXLA is present) answers with `spec/4`:

    * on a `:host` or `:cuda` client, when the operands and the block's output are
      exactly what the contract's `exla_rs_flash_attn_fwd`/`_bwd` take and return,
      and the native library says that configuration runs there
      (`ExlaRs.NIF.workspace_bytes/9` >= 0) within the workspace the traced
      program carries, it makes sure our FFI targets are registered with XLA
      (`ensure_registered/1`, before each lowering) and returns the custom call: our target name
      and the attributes `scale`, `softcap` (`f32`), `window_left`,
      `window_right` (`i64`) as typed MLIR attribute text;
    * otherwise (another platform, `f64`, a head dim the kernels lack, a
      workspace mismatch, registration failing) it returns `:skip`, and EXLA
      compiles the block's default function, the Nx fallback, which computes the
      same function.

  ## The workspace

  EXLA gives a custom call exactly the results of the block's traced default
  function (its `out`), and that trace is built before EXLA knows the client. So
  the tags carry `workspace: N`, the most any platform's kernel asks for that
  configuration (`workspace_bytes/3`, 0 when none does), and the default function
  returns that many zero bytes, which XLA drops when nothing reads them. The
  handlers accept a workspace at least as large as they need (or one when they
  need none), so one traced program runs our kernel on every client: `spec/4`
  emits the call when the platform supports the configuration and needs no more
  than the tag carries.
  """

  alias ExlaRs.Attention.{Backward, Forward}

  @fwd_target "exla_rs_flash_attn_fwd"
  @bwd_target "exla_rs_flash_attn_bwd"
  @registered_key {__MODULE__, :registered}

  @doc "The custom-call target names: `{forward, backward}`."
  def targets, do: {@fwd_target, @bwd_target}

  @doc """
  The custom call for `tag` on `platform`, or `:skip`.

  `out` is the block's output template (a tuple of tensors or templates) and
  `args` its input templates, as EXLA passes them to `EXLA.CustomCall.call/4`.
  Returns `{:ok, call_target_name, attributes}`.
  """
  def spec(tag, out, args, platform) do
    with true <- platform in [:host, :cuda],
         {:ok, pass, dtype, dims} <- match_call(tag, out, args),
         need when need >= 0 <- native_workspace(pass, platform, dtype, dims),
         true <- need <= tag.workspace,
         :ok <- ensure_registered(platform) do
      {:ok, target(tag), attributes(tag)}
    else
      _ -> :skip
    end
  end

  @doc """
  The attributes of the custom call for `tag`, as EXLA's `backend_config`
  entries: `[{name, mlir_attribute_text}]`.
  """
  def attributes(%{scale: scale, softcap: softcap, window_left: left, window_right: right}) do
    [
      {"scale", f32(scale)},
      {"softcap", f32(softcap)},
      {"window_left", "#{left} : i64"},
      {"window_right", "#{right} : i64"}
    ]
  end

  defp target(%Forward{}), do: @fwd_target
  defp target(%Backward{}), do: @bwd_target

  # Float.to_string/1 always writes a dot and a digit on each side ("0.125",
  # "1.0e-5"), which is MLIR float literal syntax. The value is already an f32.
  defp f32(x) when is_float(x), do: Float.to_string(x) <> " : f32"

  @doc """
  The workspace bytes a traced program carries for `pass` (`:forward` or
  `:backward`): the most that the native library asks for on any platform that
  supports the configuration, 0 when none asks for any, none supports it, or the
  library is not loaded.
  """
  def workspace_bytes(pass, dtype, dims) do
    [:host, :cuda]
    |> Enum.map(&native_workspace(pass, &1, dtype, dims))
    |> Enum.max()
    |> max(0)
  end

  # ExlaRs.NIF.workspace_bytes/9: N > 0 bytes, 0 none, -1 unsupported there. A
  # type without a native code (f64) or a NIF that failed to load: -1.
  defp native_workspace(pass, platform, dtype, [b, sq, sk, h, hkv, d]) do
    with {:ok, dtype_code} <- ffi_dtype(dtype) do
      pass_code = if pass == :forward, do: 0, else: 1
      platform_code = if platform == :cuda, do: 1, else: 0
      ExlaRs.NIF.workspace_bytes(pass_code, platform_code, dtype_code, b, sq, sk, h, hkv, d)
    else
      _ -> -1
    end
  rescue
    _ in [ErlangError, UndefinedFunctionError] -> -1
  end

  @doc """
  The one layout of a block's results, shared by the output templates, the Nx
  fallback and the custom-call check: the pass's `results` (`[o, lse]` or
  `[dq, dk, dv]`), then the `u8` workspace, made by `workspace.(bytes)`, when the
  tag carries one. Returns a tuple.
  """
  def block_results(%{workspace: bytes}, results, workspace) when bytes > 0,
    do: List.to_tuple(results ++ [workspace.(bytes)])

  def block_results(_tag, results, _workspace), do: List.to_tuple(results)

  @doc """
  The XLA FFI data type code of an Nx type that the kernels take (`XLA_FFI_DataType`:
  F16 10, F32 11, BF16 16), or `:error`.
  """
  def ffi_dtype({:f, 16}), do: {:ok, 10}
  def ffi_dtype({:f, 32}), do: {:ok, 11}
  def ffi_dtype({:bf, 16}), do: {:ok, 16}
  def ffi_dtype(_), do: :error

  @doc """
  Makes sure our FFI targets are registered in the XLA runtime that an EXLA client
  of `platform` (`:host` or `:cuda`) compiles for (`ExlaRs.register/0`, before each
  lowering). Returns `:ok` or `{:error, reason}`; a failure is logged once per
  platform.

  EXLA's `:cuda` client is XLA's StreamExecutor client inside EXLA's
  `libxla_extension`, so `:cuda` needs our `CUDA` targets there: a PJRT plugin
  holding them (say a CPU plugin, which takes any platform name) does not serve it.
  `:host` needs our `Host` targets in any runtime: EXLA's own, or a PJRT CPU
  plugin.
  """
  def ensure_registered(platform) when platform in [:host, :cuda] do
    # register/0 runs on every lowering, not once per VM: it is idempotent and only does
    # work for runtimes that do not hold our targets yet, so a runtime EXLA loads after
    # our first lowering still gets them. A pass that fails after an earlier success (say,
    # a runtime that refuses) keeps the targets the earlier runtimes already hold.
    result =
      case ExlaRs.register() do
        {:ok, runtimes} ->
          if Enum.any?(runtimes, &serves?(&1, platform)),
            do: :ok,
            else: {:error, unserved(platform, runtimes)}

        {:error, _reason} = error ->
          error
      end

    case result do
      :ok ->
        remember_served(platform)

      {:error, reason} = error ->
        if platform in :persistent_term.get(@registered_key, []) do
          :ok
        else
          warn_once(platform, reason)
          error
        end
    end
  rescue
    e in [ErlangError, UndefinedFunctionError] ->
      warn_once(platform, e)
      {:error, e}
  end

  # The runtime EXLA's client of that platform runs in, holding both our targets for it.
  defp serves?(%{kind: kind, registrations: regs}, platform) do
    {platform_name, kinds} =
      case platform do
        :host -> {"Host", [:xla_extension, :pjrt_plugin]}
        :cuda -> {"CUDA", [:xla_extension]}
      end

    ok = for %{platform: ^platform_name, result: :ok, target: t} <- regs, do: t
    kind in kinds and Enum.all?([@fwd_target, @bwd_target], &(&1 in ok))
  end

  defp unserved(:cuda, runtimes) do
    "no EXLA libxla_extension (where EXLA's :cuda client runs) holds our CUDA targets; " <>
      "runtimes found: #{describe(runtimes)}"
  end

  defp unserved(:host, runtimes) do
    "no XLA runtime holds our Host targets; runtimes found: #{describe(runtimes)}"
  end

  defp describe(runtimes), do: Enum.map_join(runtimes, ", ", &"#{&1.kind} #{&1.path} (#{&1.state})")

  defp remember_served(platform) do
    served = :persistent_term.get(@registered_key, [])
    unless platform in served, do: :persistent_term.put(@registered_key, [platform | served])
    :ok
  end

  defp warn_once(platform, reason) do
    key = {__MODULE__, :warned, platform}

    unless :persistent_term.get(key, false) do
      :persistent_term.put(key, true)

      require Logger

      Logger.warning(
        "exla_rs: the flash-attention custom calls are not available to EXLA's #{inspect(platform)} client " <>
          "(#{reason_text(reason)}); attention runs on the Nx fallback there"
      )
    end
  end

  defp reason_text(text) when is_binary(text), do: text
  defp reason_text(error) when is_exception(error), do: Exception.message(error)
  defp reason_text(other), do: inspect(other)

  # The operands and results the contract specifies, checked on the templates.
  defp match_call(%Forward{} = tag, out, [q, k, v, kv_len, q_start]) do
    with {:ok, dtype, [b, sq, _sk, h, _hkv, _d] = dims} <- match_qkv(q, k, v, kv_len, q_start),
         true <- results(out) == expected(tag, [like(q), {{:f, 32}, {b, h, sq}}]) do
      {:ok, :forward, dtype, dims}
    end
  end

  defp match_call(%Backward{} = tag, out, [q, k, v, kv_len, q_start, o, lse, d_o]) do
    with {:ok, dtype, [b, sq, _sk, h, _hkv, _d] = dims} <- match_qkv(q, k, v, kv_len, q_start),
         true <- like(o) == like(q) and like(d_o) == like(q),
         true <- like(lse) == {{:f, 32}, {b, h, sq}},
         true <- results(out) == expected(tag, [like(q), like(k), like(v)]) do
      {:ok, :backward, dtype, dims}
    end
  end

  defp match_call(_tag, _out, _args), do: :error

  defp match_qkv(
         %{type: dtype, shape: {b, sq, h, d}},
         %{type: dtype, shape: {b, sk, hkv, d}},
         %{type: dtype, shape: {b, sk, hkv, d}},
         %{type: {:s, 32}, shape: {b}},
         %{type: {:s, 32}, shape: {b}}
       )
       when hkv > 0 and rem(h, hkv) == 0 do
    {:ok, dtype, [b, sq, sk, h, hkv, d]}
  end

  defp match_qkv(_q, _k, _v, _kv_len, _q_start), do: :error

  defp results(out) when is_tuple(out), do: out |> Tuple.to_list() |> Enum.map(&like/1)
  defp results(_out), do: :mismatch

  # The {type, shape} list the call must return, laid out by block_results/3.
  defp expected(tag, likes), do: tag |> block_results(likes, &{{:u, 8}, {&1}}) |> Tuple.to_list()

  defp like(%{type: type, shape: shape}), do: {type, shape}
  defp like(_), do: nil

  # EXLA is optional. The implementation is defined inside this always-present module so
  # that Mix records the compile-time check and recompiles this file when EXLA joins the
  # project after exla_rs was compiled (see ExlaRs.Attention).
  if Code.ensure_loaded?(EXLA.CustomCall) and Code.ensure_loaded?(EXLA.CustomCall.Spec) do
    defimpl EXLA.CustomCall, for: [ExlaRs.Attention.Forward, ExlaRs.Attention.Backward] do
      @moduledoc false

      def call(tag, out, args, %{platform: platform}) do
        case ExlaRs.CustomCall.spec(tag, out, args, platform) do
          {:ok, target, attributes} ->
            {:ok, %EXLA.CustomCall.Spec{call_target_name: target, attributes: attributes}}

          :skip ->
            :skip
        end
      end

      def call(_tag, _out, _args, _client), do: :skip
    end
  end
end
