Code.require_file("support.exs", __DIR__)

defmodule ExlaRs.AttentionTest do
  use ExUnit.Case, async: true
  import ExlaRs.NxTest.Assertions, only: [raises: 2]
  @moduletag :nx

  alias ExlaRs.NxTest.Reference, as: Ref
  alias ExlaRs.Attention.{Backward, Forward}

  @cases 0..119

  # A `defn` body may call only defn functions and transforms: ExlaRs.attention/4 and
  # attention_with_lse/4 were plain delegates, which `defn` refuses ("cannot invoke ...").
  defmodule InDefn do
    import Nx.Defn

    defn causal(q, k, v), do: ExlaRs.attention(q, k, v, causal: true)
    defn with_lse(q, k, v), do: ExlaRs.attention_with_lse(q, k, v, window_size: {3, 0})
  end

  describe "the Nx fallback against the float64 reference" do
    test "random cases over every option, type and shape" do
      for seed <- @cases do
        {q, k, v, opts} = Ref.random_case(seed)
        {o, lse} = ExlaRs.Attention.attention_with_lse(q, k, v, opts)
        {ro, rlse} = Ref.forward(q, k, v, opts)
        {atol, rtol} = Ref.tol(Nx.type(q))
        label = "seed #{seed} #{inspect(Nx.type(q))} #{inspect(Nx.shape(q))}/#{inspect(Nx.shape(k))} #{inspect(opts)}"

        assert Nx.type(o) == Nx.type(q)
        assert Nx.shape(o) == Nx.shape(q)
        {b, sq, h, _} = Nx.shape(q)
        assert Nx.shape(lse) == {b, h, sq}
        assert Nx.type(lse) == if(Nx.type(q) == {:f, 64}, do: {:f, 64}, else: {:f, 32})

        Ref.assert_close(o, ro, atol, rtol, "o, " <> label)
        # lse is accumulated in f32 whatever the input type.
        lse_tol = if Nx.type(q) == {:f, 64}, do: 1.0e-10, else: 2.0e-5
        Ref.assert_close(lse, rlse, lse_tol, lse_tol, "lse, " <> label)
      end
    end

    test "the same answer eagerly and inside defn" do
      for seed <- 0..9 do
        {q, k, v, opts} = Ref.random_case(seed, [{:f, 32}])
        {kv_len, opts} = Keyword.pop(opts, :kv_len)
        {q_start, opts} = Keyword.pop(opts, :q_start)
        kv_len = kv_len || Nx.broadcast(Nx.s32(Nx.axis_size(k, 1)), {Nx.axis_size(q, 0)})
        q_start = q_start || Nx.s32(Nx.axis_size(k, 1) - Nx.axis_size(q, 1)) |> Nx.broadcast({Nx.axis_size(q, 0)})
        opts = opts ++ [kv_len: kv_len, q_start: q_start]

        eager = ExlaRs.attention(q, k, v, opts)

        jitted =
          Nx.Defn.jit(fn q, k, v, kv_len, q_start ->
            ExlaRs.attention(q, k, v, Keyword.merge(opts, kv_len: kv_len, q_start: q_start))
          end).(q, k, v, kv_len, q_start)

        assert eager == jitted
      end
    end

    test "attention/4 and attention_with_lse/4 inside a defn module" do
      {q, k, v, _} = Ref.random_case(3, [{:f, 32}])
      assert InDefn.causal(q, k, v) == ExlaRs.attention(q, k, v, causal: true)
      assert InDefn.with_lse(q, k, v) == ExlaRs.attention_with_lse(q, k, v, window_size: {3, 0})
    end

    test "a query that sees no key gives o = 0 and lse = -inf, never NaN" do
      for type <- [{:f, 32}, {:f, 16}, {:bf, 16}] do
        q = Nx.iota({2, 3, 2, 4}, type: type) |> Nx.divide(10) |> Nx.as_type(type)
        k = Nx.iota({2, 5, 1, 4}, type: type) |> Nx.divide(7) |> Nx.as_type(type)
        # batch 1 has no keys; in batch 0, causal with q_start = -1 hides every key from query 0.
        opts = [causal: true, kv_len: Nx.tensor([5, 0]), q_start: Nx.tensor([-1, 0])]
        {o, lse} = ExlaRs.attention_with_lse(q, k, k, opts)

        assert Nx.to_flat_list(o[1]) |> Enum.all?(&(&1 == 0))
        assert Nx.to_flat_list(lse[1]) |> Enum.all?(&(&1 == :neg_infinity))
        assert Nx.to_flat_list(o[0][0]) |> Enum.all?(&(&1 == 0))
        assert Nx.to_flat_list(lse[0][[.., 0]]) |> Enum.all?(&(&1 == :neg_infinity))
        assert Nx.to_flat_list(lse[0][[.., 1..2]]) |> Enum.all?(&is_float/1)
        refute Nx.any(Nx.is_nan(o)) |> Nx.to_number() == 1

        # ... and the gradient there is 0, not NaN.
        grads =
          Nx.Defn.jit(fn q, k, v ->
            Nx.Defn.grad({q, k, v}, fn {q, k, v} -> Nx.sum(ExlaRs.attention(q, k, v, opts)) end)
          end).(q, k, k)

        for grad <- Tuple.to_list(grads) do
          refute Nx.any(Nx.is_nan(grad)) |> Nx.to_number() == 1
        end
      end
    end

    test "large logits in f16 do not overflow (f32 accumulation)" do
      q = Nx.broadcast(Nx.f16(30.0), {1, 2, 1, 64})
      k = Nx.broadcast(Nx.f16(30.0), {1, 3, 1, 64})
      v = Nx.iota({1, 3, 1, 64}, type: :f16) |> Nx.divide(64) |> Nx.as_type(:f16)
      {o, lse} = ExlaRs.attention_with_lse(q, k, v, scale: 1.0)
      # 64 * 900 = 57600 per logit: beyond f16's range, fine in f32.
      Ref.assert_close(lse, Nx.broadcast(57_600 + :math.log(3), {1, 1, 2}), 1.0e-2, 1.0e-6, "lse")
      Ref.assert_close(o[0][0][0], Nx.mean(v, axes: [0, 1, 2]), 4.0e-3, 2.0e-3, "o")
    end
  end

  describe "gradients" do
    test "Nx.Defn.grad through attention/4 matches the reference gradient" do
      for seed <- 0..39 do
        {q, k, v, opts} = Ref.random_case(1000 + seed, [{:f, 32}, {:f, 64}])
        Ref.check_grads(seed, q, k, v, opts, false)
      end
    end

    test "gradients through both outputs of attention_with_lse/4" do
      for seed <- 0..19 do
        {q, k, v, opts} = Ref.random_case(2000 + seed, [{:f, 32}, {:f, 64}])
        Ref.check_grads(seed, q, k, v, opts, true)
      end
    end

    test "f16 and bf16 gradients are close to the reference on the rounded inputs" do
      for seed <- 0..9, type <- [{:f, 16}, {:bf, 16}], with_lse? <- [false, true] do
        {q, k, v, opts} = Ref.random_case(3000 + seed, [type])
        Ref.check_grads(seed, q, k, v, opts, with_lse?)
      end
    end

    test "the gradient through lse alone" do
      for seed <- 0..19 do
        {q, k, v, opts} = Ref.random_case(4000 + seed)
        Ref.check_grads(seed, q, k, v, opts, :lse_only)
      end
    end

  end

  describe "the traced program" do
    setup do
      q = Nx.iota({2, 8, 4, 16}, type: :f32) |> Nx.divide(500)
      k = Nx.iota({2, 10, 2, 16}, type: :f32) |> Nx.divide(300)
      %{q: q, k: k, v: Nx.cos(k)}
    end

    test "the forward is one block whose default returns what the custom call returns", %{q: q, k: k, v: v} do
      expr = Nx.Defn.debug_expr(fn q, k, v -> ExlaRs.attention_with_lse(q, k, v, causal: true) end).(q, k, v)
      walked = Ref.walk(expr)
      assert [{%Forward{} = tag, in_args, out}] = walked.blocks
      # No O(S²) work outside the block.
      refute Map.has_key?(walked.ops, :dot)

      # D = 16 runs on CUDA as D = 32 through zero-padded copies of q, k, v and o in the workspace
      # (f32: 4 bytes each), so the tag carries them: the most any platform asks for.
      padded = 4 * 32 * (2 * 8 * 4 + 2 * (2 * 10 * 2) + 2 * 8 * 4)
      assert tag == %Forward{scale: 0.25, softcap: 0.0, window_left: -1, window_right: 0, workspace: padded}
      assert Enum.map(in_args, &{&1.type, &1.shape}) ==
               [{{:f, 32}, {2, 8, 4, 16}}, {{:f, 32}, {2, 10, 2, 16}}, {{:f, 32}, {2, 10, 2, 16}}, {{:s, 32}, {2}}, {{:s, 32}, {2}}]

      # The traced default (what EXLA hands to EXLA.CustomCall as `out`) is the declared template.
      template = ExlaRs.Attention.forward_template(tag, q)
      assert tuple_size(out) == 3
      assert Enum.map(Tuple.to_list(out), &{&1.type, &1.shape}) ==
               Enum.map(Tuple.to_list(template), &{&1.type, &1.shape})

      assert Enum.map(Tuple.to_list(out), &{&1.type, &1.shape}) ==
               [{{:f, 32}, {2, 8, 4, 16}}, {{:f, 32}, {2, 4, 8}}, {{:u, 8}, {padded}}]
    end

    test "grad contains exactly one forward and one backward block, fed by the forward's o and lse",
         %{q: q, k: k, v: v} do
      fun = fn q, k, v ->
        Nx.Defn.value_and_grad({q, k, v}, fn {q, k, v} ->
          o = ExlaRs.attention(q, k, v, window_size: {3, 1}, softcap: 4.0)
          Nx.sum(Nx.multiply(o, o))
        end)
      end

      expr = Nx.Defn.debug_expr(fun).(q, k, v)
      walked = Ref.walk(expr)

      assert [{%Forward{} = fwd, fwd_args, _}, {%Backward{} = bwd, bwd_args, bwd_out}] =
               Enum.sort_by(walked.blocks, fn {s, _, _} -> if is_struct(s, Forward), do: 0, else: 1 end)

      assert Map.take(Map.from_struct(fwd), [:scale, :softcap, :window_left, :window_right]) ==
               Map.take(Map.from_struct(bwd), [:scale, :softcap, :window_left, :window_right])

      # The forward's default function was never differentiated or inlined: no dot,
      # exp or reduce outside the two blocks.
      for op <- [:dot, :exp, :reduce_max, :tanh] do
        refute Map.has_key?(walked.ops, op), "#{op} outside the blocks: #{inspect(walked.ops)}"
      end

      assert length(bwd_args) == 8
      [bq, bk, bv, bkv, bqs, bo, blse, bdo] = bwd_args
      [fq, fk, fv, fkv, fqs] = fwd_args
      assert Enum.map([bq, bk, bv, bkv, bqs], & &1.data.id) == Enum.map([fq, fk, fv, fkv, fqs], & &1.data.id)
      # o and lse are elements 0 and 1 of the forward block's own result.
      assert %{op: :elem, args: [fwd_tuple, 0]} = bo.data
      assert %{op: :elem, args: [^fwd_tuple, 1]} = blse.data
      assert %{op: :block} = fwd_tuple.data
      assert {bdo.type, bdo.shape} == {{:f, 32}, {2, 8, 4, 16}}

      # dq, dk, dv, then the workspace (D = 16 is padded on CUDA: see the forward's test).
      # At least the padded copies of q, o, do, dq and of k, v, dk, dv.
      assert bwd.workspace >= 4 * 32 * (4 * (2 * 8 * 4) + 4 * (2 * 10 * 2))

      assert Enum.map(Tuple.to_list(bwd_out), &{&1.type, &1.shape}) ==
               [{{:f, 32}, {2, 8, 4, 16}}, {{:f, 32}, {2, 10, 2, 16}}, {{:f, 32}, {2, 10, 2, 16}}, {{:u, 8}, {bwd.workspace}}]
    end

    test "the gradient through lse is a second backward block on widened operands, also fed by the forward",
         %{q: q, k: k, v: v} do
      expr =
        Nx.Defn.debug_expr(fn q, k, v ->
          Nx.Defn.grad({q, k, v}, fn {q, k, v} ->
            {o, lse} = ExlaRs.attention_with_lse(q, k, v, causal: true)
            Nx.add(Nx.sum(o), Nx.sum(Nx.multiply(lse, lse)))
          end)
        end).(q, k, v)

      walked = Ref.walk(expr)
      assert [{%Forward{}, _, fwd_out}] = for({%Forward{}, _, _} = blk <- walked.blocks, do: blk)
      backwards = for {%Backward{} = tag, args, out} <- walked.blocks, do: {tag, args, out}
      assert length(backwards) == 2

      # head dim 16 -> 32 for the lse pass; both read the forward's own lse.
      dims = backwards |> Enum.map(fn {_, [bq | _], _} -> elem(bq.shape, 3) end) |> Enum.sort()
      assert dims == [16, ExlaRs.Attention.lse_grad_head_dim(16)]
      assert ExlaRs.Attention.lse_grad_head_dim(16) == 32

      for {_, args, _} <- backwards do
        assert %{op: :elem, args: [fwd_tuple, 1]} = Enum.at(args, 6).data
        assert %{op: :block} = fwd_tuple.data
      end

      _ = fwd_out

      for op <- [:dot, :exp, :reduce_max, :tanh] do
        refute Map.has_key?(walked.ops, op), "#{op} outside the blocks: #{inspect(walked.ops)}"
      end
    end

    test "lse_grad_head_dim rounds d + 1 up to a kernel head dim" do
      assert Enum.map([1, 31, 32, 63, 64, 100, 128, 191, 192, 255, 256, 300], &ExlaRs.Attention.lse_grad_head_dim/1) ==
               [32, 32, 64, 64, 96, 128, 192, 192, 256, 256, 257, 301]
    end

    test "a tag with a workspace ends the block's result with that many zero bytes", %{q: q} do
      tag = %Forward{scale: 0.25, softcap: 0.0, window_left: -1, window_right: -1, workspace: 96}
      k = Nx.iota({2, 10, 2, 16}, type: :f32)

      out =
        Nx.Defn.jit(fn q, k ->
          kv = Nx.broadcast(Nx.s32(10), {2})
          ExlaRs.Attention.Fallback.forward(tag, q, k, k, kv, kv)
        end).(q, k)

      assert {_o, _lse, ws} = out
      assert {Nx.type(ws), Nx.shape(ws)} == {{:u, 8}, {96}}
      assert Nx.to_flat_list(ws) |> Enum.all?(&(&1 == 0))
    end
  end

  describe "validation" do
    setup do
      %{q: Nx.iota({2, 4, 6, 8}, type: :f32), k: Nx.iota({2, 5, 3, 8}, type: :f32)}
    end

    test "tensors", %{q: q, k: k} do
      raises(~r/expected q to be a rank-4 tensor \{batch, seq_q, heads, head_dim\}, got shape \{4, 6, 8\}/, fn ->
        ExlaRs.attention(q[0], k, k)
      end)

      raises(~r/expected k to be a rank-4 tensor/, fn -> ExlaRs.attention(q, k[0], k) end)
      raises(~r/expected v to have the shape of k, \{2, 5, 3, 8\}, got \{2, 5, 1, 8\}/, fn -> ExlaRs.attention(q, k, k[[.., .., 0..0]]) end)
      raises(~r/expected k to have the batch size of q, 2/, fn -> ExlaRs.attention(q, k[0..0], k[0..0]) end)
      raises(~r/expected k to have the head dim of q, 8/, fn -> ExlaRs.attention(q, k[[.., .., .., 0..3]], k[[.., .., .., 0..3]]) end)
      raises(~r/heads of q \(6\) to be a multiple of the heads of k and v \(4\)/, fn ->
        k4 = Nx.iota({2, 5, 4, 8}, type: :f32)
        ExlaRs.attention(q, k4, k4)
      end)

      raises(~r/expected q to have a float type/, fn -> ExlaRs.attention(Nx.iota({2, 4, 6, 8}), k, k) end)
      raises(~r/expected k to have the type of q, \{:f, 32\}, got \{:f, 16\}/, fn -> ExlaRs.attention(q, Nx.as_type(k, :f16), k) end)
      raises(~r/expected v to have the type of q/, fn -> ExlaRs.attention(q, k, Nx.as_type(k, :bf16)) end)
      raises(~r/expected q to be an Nx.Tensor, got: \[1, 2\]/, fn -> ExlaRs.attention([1, 2], k, k) end)
      raises(~r/expected q to be a non-vectorized tensor/, fn -> ExlaRs.attention(Nx.vectorize(q, :x), k, k) end)
      raises(~r/ExlaRs.attention_with_lse\/4: expected q/, fn -> ExlaRs.attention_with_lse(q[0], k, k) end)
    end

    test "options", %{q: q, k: k} do
      raises(~r/unknown options \[:mask\]/, fn -> ExlaRs.attention(q, k, k, mask: 1) end)
      raises(~r/expected opts to be a keyword list/, fn -> ExlaRs.attention(q, k, k, [1]) end)
      raises(~r/expected :scale to be a number, got: "1"/, fn -> ExlaRs.attention(q, k, k, scale: "1") end)
      raises(~r/expected :scale to be a finite f32 number/, fn -> ExlaRs.attention(q, k, k, scale: 1.0e300) end)
      raises(~r/expected :softcap to be >= 0/, fn -> ExlaRs.attention(q, k, k, softcap: -1) end)
      raises(~r/expected :causal to be a boolean, got: 1/, fn -> ExlaRs.attention(q, k, k, causal: 1) end)
      raises(~r/expected :window_size to be a tuple \{left, right\}/, fn -> ExlaRs.attention(q, k, k, window_size: 3) end)
      raises(~r/expected :window_size to be \{left, right\} with each >= 0 or -1/, fn -> ExlaRs.attention(q, k, k, window_size: {-2, 0}) end)
      raises(~r/causal: true needs the right window to be 0 or -1/, fn -> ExlaRs.attention(q, k, k, causal: true, window_size: {2, 2}) end)
      raises(~r/expected :kv_len to be an integer tensor of shape \{2\}.*got \{:s, 32\} of shape \{3\}/, fn ->
        ExlaRs.attention(q, k, k, kv_len: Nx.tensor([1, 2, 3], type: :s32))
      end)

      raises(~r/expected :q_start to be an integer tensor of shape \{2\}.*got \{:f, 32\}/, fn ->
        ExlaRs.attention(q, k, k, q_start: Nx.tensor([1.0, 2.0]))
      end)

      raises(~r/expected :kv_len to be an integer tensor of shape \{2\}, got: \[1, 2\]/, fn -> ExlaRs.attention(q, k, k, kv_len: [1, 2]) end)
      raises(~r/unknown options \[:platform\], expected one of/, fn -> ExlaRs.attention(q, k, k, platform: :cuda) end)
    end

    test "valid edge values are accepted", %{q: q, k: k} do
      assert %Nx.Tensor{} = ExlaRs.attention(q, k, k, causal: true, window_size: {0, -1})
      assert %Nx.Tensor{} = ExlaRs.attention(q, k, k, softcap: 0, scale: 1, kv_len: Nx.tensor([0, 5], type: :u8))
    end

    test "inside defn, errors raise at trace time", %{q: q} do
      raises(~r/heads of q \(6\)/, fn ->
        Nx.Defn.jit(fn q, k -> ExlaRs.attention(q, k, k) end).(q, Nx.iota({2, 5, 4, 8}, type: :f32))
      end)
    end
  end
end

defmodule ExlaRs.AxonLayerTest do
  use ExUnit.Case, async: true
  @moduletag :nx

  test "the Axon layer functions are attention/4 with Axon's extra options ignored" do
    q = Nx.iota({2, 3, 2, 4}, type: :f32) |> Nx.divide(20)
    k = Nx.iota({2, 5, 1, 4}, type: :f32) |> Nx.divide(30)
    mask = Nx.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    kv_len = ExlaRs.Axon.kv_len_from_mask(mask)
    assert kv_len == Nx.tensor([3, 5], type: :s32)

    assert ExlaRs.Axon.layer(q, k, k, causal: true, mode: :inference) == ExlaRs.attention(q, k, k, causal: true)

    assert ExlaRs.Axon.layer(q, k, k, kv_len, tensor_keys: [:kv_len], mode: :train) ==
             ExlaRs.attention(q, k, k, kv_len: kv_len)

    q_start = Nx.tensor([0, 2])

    assert ExlaRs.Axon.layer(q, k, k, q_start, kv_len, tensor_keys: [:q_start, :kv_len], causal: true) ==
             ExlaRs.attention(q, k, k, kv_len: kv_len, q_start: q_start, causal: true)
  end
end
