Code.require_file("support.exs", __DIR__)

defmodule ExlaRs.CustomCallTest do
  # The protocol is asked exactly what EXLA.Defn asks it: the block's tag, the traced
  # default's result (`out`) and the input templates, taken from a real trace.
  use ExUnit.Case, async: false
  @moduletag :nx
  @moduletag :exla

  alias ExlaRs.NxTest.Reference, as: Ref
  alias ExlaRs.Attention.{Backward, Forward}

  @registered {ExlaRs.CustomCall, :registered}

  setup do
    # Registration needs an XLA runtime in the VM (EXLA's NIF); here we only have its
    # Elixir modules, so mark both platforms served, as ensure_registered/1 does on success.
    previous = :persistent_term.get(@registered, [])
    :persistent_term.put(@registered, [:host, :cuda])
    on_exit(fn -> :persistent_term.put(@registered, previous) end)
    :ok
  end

  defp client(platform) do
    %EXLA.Client{
      ref: nil,
      platform: platform,
      name: platform,
      device_count: 1,
      default_device_id: 0,
      automatic_transfers: false
    }
  end

  # {forward block, backward block} as {tag, out, in_args} from the grad of a real trace.
  # A :bias in opts is a parameter of the trace, differentiated with q, k and v.
  defp blocks(type, shape_q, shape_k, opts) do
    q = Nx.iota(shape_q, type: type)
    k = Nx.iota(shape_k, type: type)
    {bias, opts} = Keyword.pop(opts, :bias)
    inputs = if bias, do: {q, k, k, bias}, else: {q, k, k}

    expr =
      Nx.Defn.debug_expr(fn inputs ->
        Nx.Defn.value_and_grad(inputs, fn inputs ->
          [q, k, v | bias] = Tuple.to_list(inputs)
          Nx.sum(ExlaRs.attention(q, k, v, opts ++ Enum.map(bias, &{:bias, &1})))
        end)
      end).(inputs)

    %{blocks: blocks} = Ref.walk(expr)
    {fwd, fargs, fout} = Enum.find(blocks, &is_struct(elem(&1, 0), Forward))
    {bwd, bargs, bout} = Enum.find(blocks, &is_struct(elem(&1, 0), Backward))
    {{fwd, fout, fargs}, {bwd, bout, bargs}}
  end

  defp native_ws(pass, platform, type, {b, sq, h, d}, {_, sk, hkv, _}) do
    {:ok, code} = ExlaRs.CustomCall.ffi_dtype(type)
    ExlaRs.NIF.workspace_bytes(pass, if(platform == :cuda, do: 1, else: 0), code, b, sq, sk, h, hkv, d)
  rescue
    ErlangError -> -1
  end

  test "Host and CUDA get our targets with typed MLIR attributes" do
    {{fwd, fout, fargs}, {bwd, bout, bargs}} =
      blocks({:f, 32}, {2, 8, 4, 64}, {2, 8, 2, 64}, causal: true, softcap: 30.0, window_size: {16, -1})

    attributes = [
      {"scale", "0.125 : f32"},
      {"softcap", "30.0 : f32"},
      {"window_left", "16 : i64"},
      {"window_right", "0 : i64"}
    ]

    for platform <- [:host, :cuda] do
      expect_fwd = native_ws(0, platform, {:f, 32}, {2, 8, 4, 64}, {2, 8, 2, 64})
      expect_bwd = native_ws(1, platform, {:f, 32}, {2, 8, 4, 64}, {2, 8, 2, 64})

      # One traced program carries the largest workspace any platform needs, so the
      # call is ours on every client whose kernels support the configuration.
      if expect_fwd >= 0 do
        assert {:ok, %EXLA.CustomCall.Spec{} = spec} = EXLA.CustomCall.call(fwd, fout, fargs, client(platform))
        assert spec.call_target_name == "exla_rs_flash_attn_fwd"
        assert spec.attributes == attributes
        assert spec.operand_element_types == :default
      else
        assert :skip == EXLA.CustomCall.call(fwd, fout, fargs, client(platform))
      end

      if expect_bwd >= 0 do
        assert {:ok, %EXLA.CustomCall.Spec{} = spec} = EXLA.CustomCall.call(bwd, bout, bargs, client(platform))
        assert spec.call_target_name == "exla_rs_flash_attn_bwd"
        assert spec.attributes == attributes
      else
        assert :skip == EXLA.CustomCall.call(bwd, bout, bargs, client(platform))
      end
    end
  end

  test "the NIF reports the f32 Host configuration as supported without a workspace" do
    # So that the test above exercises the {:ok, spec} path at least on :host.
    assert native_ws(0, :host, {:f, 32}, {2, 8, 4, 64}, {2, 8, 2, 64}) == 0
    assert native_ws(1, :host, {:f, 32}, {2, 8, 4, 64}, {2, 8, 2, 64}) == 0
  end

  test "f16 and bf16 lower too; defaults give scale 1/sqrt(d) and unbounded windows" do
    for type <- [{:f, 16}, {:bf, 16}] do
      {{fwd, fout, fargs}, _} = blocks(type, {1, 4, 2, 32}, {1, 6, 2, 32}, [])

      assert {:ok, spec} = EXLA.CustomCall.call(fwd, fout, fargs, client(:host))

      assert spec.attributes == [
               {"scale", "#{Ref.f32(1 / :math.sqrt(32))} : f32"},
               {"softcap", "0.0 : f32"},
               {"window_left", "-1 : i64"},
               {"window_right", "-1 : i64"}
             ]
    end
  end

  test "other platforms skip" do
    {{fwd, fout, fargs}, {bwd, bout, bargs}} = blocks({:f, 32}, {1, 4, 2, 16}, {1, 4, 2, 16}, [])

    for platform <- [:rocm, :tpu, :other] do
      assert :skip == EXLA.CustomCall.call(fwd, fout, fargs, client(platform))
      assert :skip == EXLA.CustomCall.call(bwd, bout, bargs, client(platform))
    end
  end

  test "unsupported configurations skip" do
    # f64 has no kernel.
    {{fwd, fout, fargs}, {bwd, bout, bargs}} = blocks({:f, 64}, {1, 4, 2, 16}, {1, 4, 2, 16}, [])
    assert :skip == EXLA.CustomCall.call(fwd, fout, fargs, client(:host))
    assert :skip == EXLA.CustomCall.call(bwd, bout, bargs, client(:cuda))

    # A head dim beyond every kernel (the NIF says -1).
    {{fwd, fout, fargs}, _} = blocks({:f, 32}, {1, 2, 1, 320}, {1, 2, 1, 320}, [])
    assert native_ws(0, :host, {:f, 32}, {1, 2, 1, 320}, {1, 2, 1, 320}) == -1
    assert :skip == EXLA.CustomCall.call(fwd, fout, fargs, client(:host))
  end

  test "a result template that is not the contract's skips" do
    # A native CUDA head dim: no platform needs a forward workspace (a padded one, e.g. 16, would).
    {{fwd, fout, fargs}, _} = blocks({:f, 32}, {1, 4, 2, 32}, {1, 4, 2, 32}, [])
    {o, lse} = fout
    assert {:ok, _} = EXLA.CustomCall.call(fwd, fout, fargs, client(:host))
    assert :skip == EXLA.CustomCall.call(fwd, {o}, fargs, client(:host))
    assert :skip == EXLA.CustomCall.call(fwd, {o, Nx.as_type(lse, :f16)}, fargs, client(:host))
    # A workspace larger than the platform needs is fine (the handlers take the first bytes).
    ws = Nx.template({64}, {:u, 8})
    assert {:ok, _} = EXLA.CustomCall.call(%{fwd | workspace: 64}, {o, lse, ws}, fargs, client(:host))
    # A workspace that does not match the tag is not our call.
    assert :skip == EXLA.CustomCall.call(%{fwd | workspace: 32}, {o, lse, ws}, fargs, client(:host))
    # Wrong operands.
    assert :skip == EXLA.CustomCall.call(fwd, fout, Enum.take(fargs, 3), client(:host))
  end

  test "one traced program carries the largest workspace and runs on both clients" do
    for pass <- [0, 1] do
      need = Enum.map([:host, :cuda], &native_ws(pass, &1, {:bf, 16}, {1, 4, 2, 64}, {1, 4, 2, 64}))
      {{fwd, fout, fargs}, {bwd, bout, bargs}} = blocks({:bf, 16}, {1, 4, 2, 64}, {1, 4, 2, 64}, [])
      {tag, out, args, base} = if pass == 0, do: {fwd, fout, fargs, 2}, else: {bwd, bout, bargs, 3}
      assert tag.workspace == max(Enum.max(need), 0)
      assert tuple_size(out) == if(tag.workspace > 0, do: base + 1, else: base)

      for {platform, n} <- Enum.zip([:host, :cuda], need), n >= 0 do
        assert {:ok, _} = EXLA.CustomCall.call(tag, out, args, client(platform))
      end
    end
  end

  test "head dims without a native CUDA kernel (D = 80 and others) go to the custom call on CUDA, padded" do
    # Issue 33, part 4: CUDA runs any D in 1..=256, the ones without a kernel on the next kernel
    # head dim through zero-padded copies in the workspace, which the traced program carries.
    for d <- [80, 40, 160, 72, 8], type <- [{:bf, 16}, {:f, 32}] do
      {q, k} = {{1, 4, 2, d}, {1, 6, 2, d}}
      {{fwd, fout, fargs}, {bwd, bout, bargs}} = blocks(type, q, k, causal: true, bias: Nx.iota({1, 2, 4, 6}, type: :f32))
      [fwd_cuda, bwd_cuda] = for pass <- [0, 1], do: native_ws(pass, :cuda, type, q, k)
      # The forward of a padded head dim takes a workspace (the q, k, v, o copies); the backward's
      # holds the kernels' scratch and eight copies.
      assert fwd_cuda > 0 and bwd_cuda > fwd_cuda, "D=#{d} #{inspect(type)}: #{fwd_cuda}, #{bwd_cuda}"
      assert fwd.workspace == fwd_cuda

      dbias = ExlaRs.NIF.dbias_workspace_bytes(1, 1, 2, 4, 6)
      assert bwd.bias_grad and bwd.workspace == bwd_cuda + dbias

      for platform <- [:cuda, :host] do
        assert {:ok, %EXLA.CustomCall.Spec{call_target_name: "exla_rs_flash_attn_fwd"}} =
                 EXLA.CustomCall.call(fwd, fout, fargs, client(platform)),
               "D=#{d} forward on #{platform}"

        assert {:ok, %EXLA.CustomCall.Spec{call_target_name: "exla_rs_flash_attn_bwd"}} =
                 EXLA.CustomCall.call(bwd, bout, bargs, client(platform)),
               "D=#{d} backward on #{platform}"
      end
    end

    # Native head dims keep their old workspace (none in the forward); past 256 nothing runs.
    assert native_ws(0, :cuda, {:bf, 16}, {1, 4, 2, 96}, {1, 6, 2, 96}) == 0
    assert native_ws(0, :cuda, {:bf, 16}, {1, 4, 2, 320}, {1, 6, 2, 320}) == -1
  end

  test "the widened backward block of the lse gradient is ours too" do
    q = Nx.iota({1, 6, 4, 64}, type: :bf16)
    k = Nx.iota({1, 6, 2, 64}, type: :bf16)

    expr =
      Nx.Defn.debug_expr(fn q, k, v ->
        Nx.Defn.grad({q, k, v}, fn {q, k, v} ->
          {_o, lse} = ExlaRs.attention_with_lse(q, k, v, causal: true)
          Nx.sum(lse)
        end)
      end).(q, k, k)

    # Only lse carries a gradient: one backward block, on head dim 96.
    assert [{%Backward{} = bwd, [bq, bk | _] = bargs, bout}] =
             for({%Backward{}, _, _} = blk <- Ref.walk(expr).blocks, do: blk)

    assert bq.shape == {1, 6, 4, 96} and bk.shape == {1, 6, 2, 96}

    for platform <- [:host, :cuda] do
      if native_ws(1, platform, {:bf, 16}, bq.shape, bk.shape) >= 0 do
        assert {:ok, %EXLA.CustomCall.Spec{call_target_name: "exla_rs_flash_attn_bwd"}} =
                 EXLA.CustomCall.call(bwd, bout, bargs, client(platform))
      end
    end

    assert native_ws(1, :host, {:bf, 16}, bq.shape, bk.shape) >= 0
  end

  describe "key_mask, bias and alibi_slopes" do
    @base_attributes [{"scale", "0.125 : f32"}, {"softcap", "0.0 : f32"}, {"window_left", "-1 : i64"}, {"window_right", "0 : i64"}]
    @q {2, 8, 4, 64}
    @k {2, 8, 2, 64}

    # The options for a set of optional operands (any bias is {1, H, Sq, Sk} f32).
    defp optional_opts(present) do
      all = [
        key_mask: Nx.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 1, 0]], type: :u8),
        bias: Nx.iota({1, 4, 8, 8}, type: :f32),
        alibi_slopes: Nx.tensor([0.5, 0.25, 0.125, 0.0625], type: :f32)
      ]

      Keyword.take(all, present)
    end

    # What the native library says the platform runs, from its own bits.
    defp runs?(platform, features) do
      bits = ExlaRs.NIF.feature_bits()
      have = ExlaRs.NIF.flash_attn_features(if platform == :cuda, do: 1, else: 0)
      Enum.all?(features, &(Bitwise.band(have, Map.fetch!(bits, &1)) != 0))
    end

    test "Host gets our calls with the presence attributes; a platform without the features skips" do
      for present <- [[:key_mask], [:bias], [:alibi_slopes], [:key_mask, :alibi_slopes], [:key_mask, :bias, :alibi_slopes]] do
        {{fwd, fout, fargs}, {bwd, bout, bargs}} = blocks({:f, 32}, @q, @k, [causal: true] ++ optional_opts(present))

        presence =
          for {name, attr} <- [key_mask: "has_key_mask", bias: "has_bias", alibi_slopes: "has_alibi"], name in present,
              do: {attr, "true"}

        # A bias that is a parameter of the trace is differentiated: bias_grad.
        bias_grad = if :bias in present, do: [{"bias_grad", "true"}], else: []
        fwd_features = present
        bwd_features = present ++ if(:bias in present, do: [:bias_grad], else: [])
        assert ExlaRs.CustomCall.required_features(fwd) == fwd_features
        assert ExlaRs.CustomCall.required_features(bwd) == bwd_features

        for platform <- [:host, :cuda] do
          {fwd_ws, bwd_ws} = {native_ws(0, platform, {:f, 32}, @q, @k), native_ws(1, platform, {:f, 32}, @q, @k)}

          if runs?(platform, fwd_features) and fwd_ws >= 0 do
            assert {:ok, spec} = EXLA.CustomCall.call(fwd, fout, fargs, client(platform))
            assert spec.call_target_name == "exla_rs_flash_attn_fwd"
            assert spec.attributes == @base_attributes ++ presence
          else
            assert :skip == EXLA.CustomCall.call(fwd, fout, fargs, client(platform))
          end

          if runs?(platform, bwd_features) and bwd_ws >= 0 do
            assert {:ok, spec} = EXLA.CustomCall.call(bwd, bout, bargs, client(platform))
            assert spec.call_target_name == "exla_rs_flash_attn_bwd"
            assert spec.attributes == @base_attributes ++ presence ++ bias_grad
          else
            assert :skip == EXLA.CustomCall.call(bwd, bout, bargs, client(platform))
          end
        end
      end
    end

    test "the traced workspace counts only the platforms that run the call's features" do
      for present <- [[], [:key_mask], [:bias]] do
        {{fwd, fout, _}, {bwd, bout, _}} = blocks({:bf, 16}, @q, @k, optional_opts(present))

        for {tag, out, pass} <- [{fwd, fout, 0}, {bwd, bout, 1}] do
          features = ExlaRs.CustomCall.required_features(tag)
          # A backward with bias_grad adds the dbias accumulator (the bias is {1, 4, 8, 8}).
          dbias = fn p -> if Map.get(tag, :bias_grad, false), do: ExlaRs.NIF.dbias_workspace_bytes(if(p == :cuda, do: 1, else: 0), 1, 4, 8, 8), else: 0 end
          need = for p <- [:host, :cuda], runs?(p, features), do: native_ws(pass, p, {:bf, 16}, @q, @k) + dbias.(p)
          assert tag.workspace == need |> Enum.max(fn -> 0 end) |> max(0)
          assert tuple_size(out) - if(tag.workspace > 0, do: 1, else: 0) in [2, 3, 4]
        end
      end
    end

    test "the Host runs every feature, so the test above emits calls there" do
      assert runs?(:host, Map.keys(ExlaRs.NIF.feature_bits()))
      assert Enum.sort(ExlaRs.CustomCall.features(:host)) == Enum.sort(Map.keys(ExlaRs.NIF.feature_bits()))
    end

    test "the CUDA client skips a feature its handlers lack (all of them today)" do
      missing = Map.keys(ExlaRs.NIF.feature_bits()) -- ExlaRs.CustomCall.features(:cuda)
      {{fwd, fout, fargs}, {bwd, bout, bargs}} = blocks({:f, 32}, @q, @k, optional_opts([:key_mask, :bias, :alibi_slopes]))

      if missing != [] do
        assert :skip == EXLA.CustomCall.call(bwd, bout, bargs, client(:cuda))
      end

      if Enum.any?([:key_mask, :bias, :alibi_slopes], &(&1 in missing)) do
        assert :skip == EXLA.CustomCall.call(fwd, fout, fargs, client(:cuda))
      end
    end

    test "a constant bias is not differentiated: the backward has no bias_grad and no dbias" do
      bias = Nx.iota({1, 4, 8, 8}, type: :f32)
      q = Nx.iota(@q, type: :f32)
      k = Nx.iota(@k, type: :f32)

      expr =
        Nx.Defn.debug_expr(fn q, k ->
          Nx.Defn.grad({q, k}, fn {q, k} -> Nx.sum(ExlaRs.attention(q, k, k, bias: bias, causal: true)) end)
        end).(q, k)

      assert [{%Backward{bias_grad: false} = bwd, bargs, bout}] = for({%Backward{}, _, _} = b <- Ref.walk(expr).blocks, do: b)
      assert {:ok, spec} = EXLA.CustomCall.call(bwd, bout, bargs, client(:host))
      assert spec.attributes == @base_attributes ++ [{"has_bias", "true"}]
    end

    test "the widened backward of the lse gradient passes the optional operands and bias_grad too" do
      q = Nx.iota({1, 6, 4, 64}, type: :bf16)
      k = Nx.iota({1, 6, 2, 64}, type: :bf16)
      mask = Nx.tensor([[0, 1, 1, 1, 1, 1]], type: :u8)

      expr =
        Nx.Defn.debug_expr(fn q, k, bias ->
          Nx.Defn.grad({q, k, bias}, fn {q, k, bias} ->
            {_o, lse} = ExlaRs.attention_with_lse(q, k, k, key_mask: mask, bias: bias, causal: true)
            Nx.sum(lse)
          end)
        end).(q, k, Nx.iota({1, 1, 6, 6}, type: :bf16))

      assert [{%Backward{} = bwd, [bq | _] = bargs, bout}] = for({%Backward{}, _, _} = b <- Ref.walk(expr).blocks, do: b)
      assert elem(bq.shape, 3) == ExlaRs.Attention.lse_grad_head_dim(64)
      assert {:ok, spec} = EXLA.CustomCall.call(bwd, bout, bargs, client(:host))
      assert {"has_key_mask", "true"} in spec.attributes and {"bias_grad", "true"} in spec.attributes
    end

    test "optional operands that are not the contract's skip" do
      {{fwd, fout, fargs}, {bwd, bout, bargs}} = blocks({:f, 32}, @q, @k, optional_opts([:key_mask, :bias]))
      assert {:ok, _} = EXLA.CustomCall.call(fwd, fout, fargs, client(:host))
      [q, k, v, kv_len, q_start, mask, bias] = fargs
      base = [q, k, v, kv_len, q_start]
      skip = fn tag, out, args -> assert :skip == EXLA.CustomCall.call(tag, out, args, client(:host)) end

      # An f64 bias (the Nx fallback takes it), a float mask, a mask of the wrong shape.
      skip.(fwd, fout, base ++ [mask, Nx.as_type(bias, :f64)])
      skip.(fwd, fout, base ++ [Nx.as_type(mask, :f32), bias])
      skip.(fwd, fout, base ++ [Nx.iota({2, 7}, type: :u8), bias])
      # A bias dimension neither 1 nor full; operands the tag does not announce, or missing.
      skip.(fwd, fout, base ++ [mask, Nx.iota({1, 2, 8, 8}, type: :f32)])
      skip.(fwd, fout, base ++ [mask, bias, Nx.iota({4}, type: :f32)])
      skip.(fwd, fout, base ++ [mask])
      skip.(%{fwd | has_bias: false}, fout, fargs)
      # Slopes of the wrong type or length.
      skip.(%{fwd | has_alibi: true}, fout, fargs ++ [Nx.iota({4}, type: :f16)])
      skip.(%{fwd | has_alibi: true}, fout, fargs ++ [Nx.iota({3}, type: :f32)])
      assert {:ok, _} = EXLA.CustomCall.call(%{fwd | has_alibi: true}, fout, fargs ++ [Nx.iota({4}, type: :f32)], client(:host))

      # The backward: dbias must be shaped and typed like the bias, and only with bias_grad.
      assert {:ok, _} = EXLA.CustomCall.call(bwd, bout, bargs, client(:host))
      [dq, dk, dv, dbias | ws] = Tuple.to_list(bout)
      skip.(bwd, List.to_tuple([dq, dk, dv, Nx.as_type(dbias, :f16) | ws]), bargs)
      skip.(bwd, List.to_tuple([dq, dk, dv | ws]), bargs)
      skip.(%{bwd | bias_grad: false}, bout, bargs)
      assert {:ok, _} = EXLA.CustomCall.call(%{bwd | bias_grad: false}, List.to_tuple([dq, dk, dv | ws]), bargs, client(:host))
      # bias_grad without a bias is not a call.
      no_bias = %{bwd | has_bias: false}
      skip.(no_bias, bout, Enum.take(bargs, 9))
    end
  end

  test "a tag whose workspace is smaller than the platform needs skips" do
    {{fwd, fout, fargs}, _} = blocks({:f, 32}, {1, 4, 2, 16}, {1, 4, 2, 16}, [])
    {o, lse} = {elem(fout, 0), elem(fout, 1)}
    cuda_need = native_ws(0, :cuda, {:f, 32}, {1, 4, 2, 16}, {1, 4, 2, 16})

    if cuda_need > 0 do
      ws = Nx.template({cuda_need - 1}, {:u, 8})
      assert :skip == EXLA.CustomCall.call(%{fwd | workspace: cuda_need - 1}, {o, lse, ws}, fargs, client(:cuda))
    end

    assert {:ok, _} = EXLA.CustomCall.call(%{fwd | workspace: 0}, {o, lse}, fargs, client(:host))
  end

  test "when registration fails, the block skips (and falls back to Nx)" do
    :persistent_term.put(@registered, [])

    {{fwd, fout, fargs}, _} = blocks({:f, 32}, {1, 4, 2, 16}, {1, 4, 2, 16}, [])

    # With only EXLA's Elixir modules there is no EXLA libxla_extension: :cuda always skips.
    # :host has a runtime only when another test loaded the PJRT CPU plugin into this VM.
    ExUnit.CaptureLog.capture_log(fn ->
      assert :skip == EXLA.CustomCall.call(fwd, fout, fargs, client(:cuda))

      case ExlaRs.register() do
        {:ok, _} -> assert {:ok, _} = EXLA.CustomCall.call(fwd, fout, fargs, client(:host))
        {:error, _} -> assert :skip == EXLA.CustomCall.call(fwd, fout, fargs, client(:host))
      end
    end)
  end
end
