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
      program carries, and that the platform's handlers run every optional
      feature the call uses (`features/1`), it makes sure our FFI targets are
      registered with XLA (`ensure_registered/1`, before each lowering) and
      returns the custom call: our target name and the attributes `scale`,
      `softcap` (`f32`), `window_left`, `window_right` (`i64`) as typed MLIR
      attribute text, plus `has_key_mask`, `has_bias`, `has_alibi`, `has_dropout`
      and (backward) `bias_grad` as `"true"` for each one that is set (an absent
      one is false, so a call without optional operands is the contract's
      original call), and `dropout_rate` (`f32`) with `has_dropout`;
    * otherwise (another platform, `f64`, a head dim past 256, an
      optional feature the platform's native library does not report (both
      report all of them today), a workspace mismatch, registration
      failing) it returns `:skip`, and EXLA
      compiles the block's default function, the Nx fallback, which computes the
      same function.

  ## Optional operands

  The optional operands follow the required ones in the contract's fixed order,
  each present exactly when its presence field of the tag is true:
  `key_mask` (`has_key_mask`), `bias` (`has_bias`), `alibi_slopes`
  (`has_alibi`), `dropout_key` (`has_dropout`, with the `dropout_rate`
  attribute). `optional_operands/1` is that order.

  A call with a `dropout_key` needs the contract's `dropout` feature: the Host
  reports it (so such a call runs our Host kernel, which draws the contract's
  Philox mask bit for bit as the Nx fallback does); a platform without it
  `:skip`s the call to the Nx fallback.

  ## The workspace

  EXLA gives a custom call exactly the results of the block's traced default
  function (its `out`), and that trace is built before EXLA knows the client. So
  the tags carry `workspace: N`, the most that any platform running that
  configuration, optional features included, asks for (`workspace_bytes/3`, 0
  when none does), and the default function
  returns that many zero bytes, which XLA drops when nothing reads them. The
  handlers accept a workspace at least as large as they need (or one when they
  need none), so one traced program runs our kernel on every client: `spec/4`
  emits the call when the platform supports the configuration and needs no more
  than the tag carries.
  """

  alias ExlaRs.Attention.{Backward, Forward}

  @fwd_target "exla_rs_flash_attn_fwd"
  # The contract's optional operands in their fixed order, with the tag field saying each is present.
  @optional_operands [key_mask: :has_key_mask, bias: :has_bias, alibi_slopes: :has_alibi, dropout_key: :has_dropout]
  # The presence attributes as the contract names them, with the tag fields they reflect.
  @presence_attributes [
    {"has_key_mask", :has_key_mask},
    {"has_bias", :has_bias},
    {"has_alibi", :has_alibi},
    {"has_dropout", :has_dropout},
    {"bias_grad", :bias_grad}
  ]
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
         true <- supports?(platform, required_features(tag)),
         need when need >= 0 <- call_workspace(tag, pass, platform, dtype, dims, bias_shape(tag, args)),
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
  def attributes(%{scale: scale, softcap: softcap, window_left: left, window_right: right} = tag) do
    [
      {"scale", f32(scale)},
      {"softcap", f32(softcap)},
      {"window_left", "#{left} : i64"},
      {"window_right", "#{right} : i64"}
    ] ++
      for({name, field} <- @presence_attributes, Map.get(tag, field, false), do: {name, "true"}) ++
      if(Map.get(tag, :has_dropout, false), do: [{"dropout_rate", f32(tag.dropout_rate)}], else: [])
  end

  @doc """
  The optional operands `tag` says are present, in the contract's fixed order:
  a sublist of `[:key_mask, :bias, :alibi_slopes, :dropout_key]`.
  """
  def optional_operands(tag), do: for({name, field} <- @optional_operands, Map.fetch!(tag, field), do: name)

  @doc """
  The tag fields that say which optional operands are present, for the given
  operand names: `[has_key_mask: boolean, has_bias: boolean, has_alibi: boolean,
  has_dropout: boolean]`.
  """
  def presence_fields(names), do: for({name, field} <- @optional_operands, do: {field, name in names})

  @doc """
  The optional operands of a block's input list (everything after its required
  operands), by name: `%{key_mask: t, bias: t, alibi_slopes: t, dropout_key: t}`
  with only the present ones.
  """
  def optional_map(tag, optional), do: tag |> optional_operands() |> Enum.zip(optional) |> Map.new()

  @doc """
  The optional features a call of `tag` uses, named as `ExlaRs.NIF.feature_bits/0`
  names them: its optional operands (`:dropout` for the `dropout_key`, the name the
  contract reserves for its bit), and `:bias_grad` when it returns `dbias`.
  """
  def required_features(tag) do
    features = Enum.map(optional_operands(tag), fn name -> if name == :dropout_key, do: :dropout, else: name end)
    features ++ if(Map.get(tag, :bias_grad, false), do: [:bias_grad], else: [])
  end

  @doc """
  The optional features the handlers of `platform` (`:host` or `:cuda`) run, as the
  native library reports them (`exla_rs_flash_attn_features`): a sublist of
  `[:key_mask, :bias, :alibi_slopes, :bias_grad, :dropout]`, empty when the library is not loaded.
  """
  def features(platform) when platform in [:host, :cuda] do
    case ExlaRs.NIF.flash_attn_features(platform_code(platform)) do
      bits when bits >= 0 -> for {name, bit} <- ExlaRs.NIF.feature_bits(), Bitwise.band(bits, bit) != 0, do: name
      _unknown -> []
    end
  rescue
    _ in [ErlangError, UndefinedFunctionError] -> []
  end

  # A call without optional features asks nothing (the base contract runs everywhere).
  defp supports?(_platform, []), do: true
  defp supports?(platform, needed), do: needed -- features(platform) == []

  defp target(%Forward{}), do: @fwd_target
  defp target(%Backward{}), do: @bwd_target

  # Float.to_string/1 always writes a dot and a digit on each side ("0.125",
  # "1.0e-5"), which is MLIR float literal syntax. The value is already an f32.
  defp f32(x) when is_float(x), do: Float.to_string(x) <> " : f32"

  @doc """
  The workspace bytes a traced program carries for the block of `tag` (its
  workspace field aside): the most that the native library asks for on any
  platform that supports the configuration and runs every optional feature the
  tag uses, 0 when none asks for any, none supports it, or the library is not
  loaded. `dims` is `[b, sq, sk, h, hkv, head_dim]`.
  """
  def workspace_bytes(tag, dtype, dims, bias_shape \\ nil) do
    pass = if is_struct(tag, Forward), do: :forward, else: :backward
    features = required_features(tag)

    # A platform that would :skip the call never sees the workspace.
    [:host, :cuda]
    |> Enum.filter(&supports?(&1, features))
    |> Enum.map(&call_workspace(tag, pass, &1, dtype, dims, bias_shape))
    |> Enum.max(fn -> 0 end)
    |> max(0)
  end

  # The whole workspace of one call on `platform`: the base rule, plus (backward
  # with bias_grad) the dbias accumulator that exla_rs_flash_attn_dbias_workspace_bytes
  # appends for a bias of `bias_shape`; -1 when either says unsupported.
  defp call_workspace(tag, pass, platform, dtype, dims, bias_shape) do
    with base when base >= 0 <- native_workspace(pass, platform, dtype, dims),
         extra when extra >= 0 <- dbias_workspace(tag, platform, bias_shape) do
      base + extra
    else
      _ -> -1
    end
  end

  defp dbias_workspace(%Backward{bias_grad: true}, platform, {bb, hb, sqb, skb}) do
    ExlaRs.NIF.dbias_workspace_bytes(platform_code(platform), bb, hb, sqb, skb)
  rescue
    _ in [ErlangError, UndefinedFunctionError] -> -1
  end

  defp dbias_workspace(%Backward{bias_grad: true}, _platform, nil), do: -1
  defp dbias_workspace(_tag, _platform, _bias_shape), do: 0

  # The bias operand's shape of a backward block with bias_grad (its optional
  # operands follow q, k, v, kv_len, q_start, o, lse, do), else nil.
  defp bias_shape(%Backward{bias_grad: true} = tag, args) do
    case optional_map(tag, Enum.drop(args, 8))[:bias] do
      nil -> nil
      bias -> Nx.shape(bias)
    end
  end

  defp bias_shape(_tag, _args), do: nil

  # ExlaRs.NIF.workspace_bytes/9: N > 0 bytes, 0 none, -1 unsupported there. A
  # type without a native code (f64) or a NIF that failed to load: -1.
  defp native_workspace(pass, platform, dtype, [b, sq, sk, h, hkv, d]) do
    with {:ok, dtype_code} <- ffi_dtype(dtype) do
      pass_code = if pass == :forward, do: 0, else: 1
      ExlaRs.NIF.workspace_bytes(pass_code, platform_code(platform), dtype_code, b, sq, sk, h, hkv, d)
    else
      _ -> -1
    end
  rescue
    _ in [ErlangError, UndefinedFunctionError] -> -1
  end

  # The contract's platform codes.
  defp platform_code(:host), do: 0
  defp platform_code(:cuda), do: 1

  @doc """
  The one layout of a block's results, shared by the output templates, the Nx
  fallback and the custom-call check. `results` are the pass's candidates:
  `[o, lse]` for the forward, `[dq, dk, dv, dbias]` for the backward (`dbias`
  may be `nil` when the tag has no bias). The block returns `o, lse`, or
  `dq, dk, dv` followed by `dbias` only when the tag's `bias_grad` is set, then
  the `u8` workspace, made by `workspace.(bytes)`, when the tag carries one.
  Returns a tuple.
  """
  def block_results(%Forward{} = tag, [_o, _lse] = results, workspace), do: with_workspace(tag, results, workspace)

  def block_results(%Backward{bias_grad: grad?} = tag, [dq, dk, dv, dbias], workspace),
    do: with_workspace(tag, [dq, dk, dv] ++ if(grad?, do: [dbias], else: []), workspace)

  defp with_workspace(%{workspace: bytes}, results, workspace) when bytes > 0,
    do: List.to_tuple(results ++ [workspace.(bytes)])

  defp with_workspace(_tag, results, _workspace), do: List.to_tuple(results)

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
  defp match_call(%Forward{} = tag, out, [q, k, v, kv_len, q_start | optional]) do
    with {:ok, dtype, [b, sq, _sk, h, _hkv, _d] = dims} <- match_qkv(q, k, v, kv_len, q_start),
         {:ok, _optional} <- match_optional(tag, optional, dims),
         true <- results(out) == expected(tag, [like(q), {{:f, 32}, {b, h, sq}}]) do
      {:ok, :forward, dtype, dims}
    end
  end

  defp match_call(%Backward{} = tag, out, [q, k, v, kv_len, q_start, o, lse, d_o | optional]) do
    with {:ok, dtype, [b, sq, _sk, h, _hkv, _d] = dims} <- match_qkv(q, k, v, kv_len, q_start),
         true <- like(o) == like(q) and like(d_o) == like(q),
         true <- like(lse) == {{:f, 32}, {b, h, sq}},
         true <- tag.has_bias or not tag.bias_grad,
         {:ok, optional} <- match_optional(tag, optional, dims),
         true <- results(out) == expected(tag, [like(q), like(k), like(v), like(optional[:bias])]) do
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

  # The optional operands the tag announces, each of the contract's shape and type.
  defp match_optional(tag, optional, dims) do
    names = optional_operands(tag)

    if length(optional) == length(names) and
         Enum.all?(Enum.zip(names, optional), fn {name, t} -> optional_ok?(name, like(t), dims) end),
       do: {:ok, Map.new(Enum.zip(names, optional))},
       else: :error
  end

  @mask_types for kind <- [:s, :u], bits <- [8, 16, 32, 64], do: {kind, bits}

  defp optional_ok?(:key_mask, {type, shape}, [b, _sq, sk | _]), do: type in @mask_types and shape == {b, sk}
  defp optional_ok?(:alibi_slopes, {type, shape}, [_b, _sq, _sk, h | _]), do: type == {:f, 32} and shape == {h}
  defp optional_ok?(:dropout_key, {type, shape}, _dims), do: type == {:u, 32} and shape == {2}

  defp optional_ok?(:bias, {type, {_, _, _, _} = shape}, [b, sq, sk, h | _]) do
    type in [{:f, 32}, {:f, 16}, {:bf, 16}] and
      Enum.all?(Enum.zip(Tuple.to_list(shape), [b, h, sq, sk]), fn {n, full} -> n in [1, full] end)
  end

  defp optional_ok?(_name, _like, _dims), do: false

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
