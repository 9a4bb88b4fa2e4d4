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
      (`ExlaRs.register/0`, before each lowering) and returns the custom call: our target name
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
         :ok <- ensure_registered() do
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
    with {:ok, dtype_code} <- dtype_code(dtype) do
      pass_code = if pass == :forward, do: 0, else: 1
      platform_code = if platform == :cuda, do: 1, else: 0
      ExlaRs.NIF.workspace_bytes(pass_code, platform_code, dtype_code, b, sq, sk, h, hkv, d)
    else
      _ -> -1
    end
  rescue
    _ in [ErlangError, UndefinedFunctionError] -> -1
  end

  defp dtype_code({:f, 16}), do: {:ok, 10}
  defp dtype_code({:f, 32}), do: {:ok, 11}
  defp dtype_code({:bf, 16}), do: {:ok, 16}
  defp dtype_code(_), do: :error

  @doc """
  Makes sure the XLA runtimes of this VM hold our FFI targets
  (`ExlaRs.register/0`, before each lowering). Returns `:ok` once any runtime
  holds them, or `{:error, reason}`; a failure is logged once.
  """
  def ensure_registered do
    # register/0 runs on every lowering, not once per VM: it is idempotent and only does
    # work for runtimes that do not hold our targets yet, so a PJRT plugin EXLA loads after
    # our first lowering still gets them. A pass that fails after an earlier success (say,
    # a runtime that refuses) keeps the targets the earlier runtimes already hold.
    case ExlaRs.register() do
      {:ok, _report} ->
        :persistent_term.put(@registered_key, true)
        :ok

      {:error, reason} = error ->
        if :persistent_term.get(@registered_key, false) do
          :ok
        else
          warn_once(reason)
          error
        end
    end
  rescue
    e in [ErlangError, UndefinedFunctionError] ->
      warn_once(e)
      {:error, e}
  end

  defp warn_once(reason) do
    key = {__MODULE__, :warned}

    unless :persistent_term.get(key, false) do
      :persistent_term.put(key, true)

      require Logger

      Logger.warning(
        "exla_rs: could not register the flash-attention custom calls with XLA " <>
          "(#{inspect(reason)}); attention runs on the Nx fallback"
      )
    end
  end

  # The operands and results the contract specifies, checked on the templates.
  defp match_call(%Forward{workspace: ws}, out, [q, k, v, kv_len, q_start]) do
    with {:ok, dtype, [b, sq, _sk, h, _hkv, _d] = dims} <- match_qkv(q, k, v, kv_len, q_start),
         true <- results(out, ws) == [like(q), {{:f, 32}, {b, h, sq}}] do
      {:ok, :forward, dtype, dims}
    end
  end

  defp match_call(%Backward{workspace: ws}, out, [q, k, v, kv_len, q_start, o, lse, d_o]) do
    with {:ok, dtype, [b, sq, _sk, h, _hkv, _d] = dims} <- match_qkv(q, k, v, kv_len, q_start),
         true <- like(o) == like(q) and like(d_o) == like(q),
         true <- like(lse) == {{:f, 32}, {b, h, sq}},
         true <- results(out, ws) == [like(q), like(k), like(v)] do
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

  # The block's results, less the trailing u8[ws] workspace it must end with when ws > 0.
  defp results(out, ws) when is_tuple(out) do
    list = Enum.map(Tuple.to_list(out), &like/1)

    cond do
      ws == 0 -> list
      List.last(list) == {{:u, 8}, {ws}} -> Enum.drop(list, -1)
      true -> :mismatch
    end
  end

  defp results(_out, _ws), do: :mismatch

  defp like(%{type: type, shape: shape}), do: {type, shape}
  defp like(_), do: nil
end

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
