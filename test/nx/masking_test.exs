Code.require_file("support.exs", __DIR__)

defmodule ExlaRs.MaskingTest do
  # key_mask, bias and alibi_slopes (issue 10) on the Nx fallback, against the
  # float64 reference in support.exs (which reads the contract, not the library).
  use ExUnit.Case, async: true
  import ExlaRs.NxTest.Assertions, only: [raises: 2]
  @moduletag :nx

  alias ExlaRs.NxTest.Reference, as: Ref
  alias ExlaRs.Attention.{Backward, Forward}

  @types [{:f, 32}, {:f, 16}, {:bf, 16}, {:f, 64}]
  # Odd sizes, Sq != Sk, grouped-query heads (4 query heads on 2 kv heads).
  @b 2
  @sq 5
  @sk 7
  @h 4
  @d 3

  # Each existing option alone (:mha: one kv head per query head), and all of them.
  @old [
    :none,
    :causal,
    :window,
    :softcap,
    :scale,
    :kv_len,
    :q_start,
    :mha,
    :all_old
  ]
  @new [:key_mask, :bias, :alibi_slopes, :all_new]

  defp old_opts(:none), do: []
  defp old_opts(:causal), do: [causal: true]
  defp old_opts(:window), do: [window_size: {2, 1}]
  defp old_opts(:softcap), do: [softcap: 1.5]
  defp old_opts(:scale), do: [scale: 0.7]
  defp old_opts(:kv_len), do: [kv_len: Nx.tensor([4, 7], type: :s32)]
  defp old_opts(:q_start), do: [q_start: Nx.tensor([-1, 3], type: :s32)]
  defp old_opts(:mha), do: []

  defp old_opts(:all_old) do
    [causal: true, window_size: {3, -1}, softcap: 2.0, scale: 0.8, kv_len: Nx.tensor([6, 5]), q_start: Nx.tensor([1, 2])]
  end

  # A fresh random case: {q, k, v, opts} with the new option(s) on top of the old one.
  defp case_for(new, old, type, seed) do
    :rand.seed(:exsss, {seed, 11, 13})
    hkv = if old == :mha, do: @h, else: 2
    q = Ref.normal({@b, @sq, @h, @d}, type)
    k = Ref.normal({@b, @sk, hkv, @d}, type)
    v = Ref.normal({@b, @sk, hkv, @d}, type)
    dims = %{b: @b, h: @h, sq: @sq, sk: @sk, type: type}
    pattern = Enum.at([:left_pad, :holes, :right_pad], rem(seed, 3))

    extra =
      case new do
        :key_mask -> [key_mask: Ref.key_mask(@b, @sk, pattern)]
        :bias -> [bias: Ref.bias(dims)]
        :alibi_slopes -> [alibi_slopes: Ref.alibi_slopes(@h)]
        :all_new -> [key_mask: Ref.key_mask(@b, @sk, pattern), bias: Ref.bias(dims), alibi_slopes: Ref.alibi_slopes(@h)]
      end

    {q, k, v, old_opts(old) ++ extra}
  end

  defp label(q, k, opts), do: "#{inspect(Nx.type(q))} #{inspect(Nx.shape(q))}/#{inspect(Nx.shape(k))} #{inspect(opts)}"

  # {o, lse} of attention_with_lse/4 against Ref.forward/4.
  defp check_forward(q, k, v, opts) do
    {o, lse} = ExlaRs.attention_with_lse(q, k, v, opts)
    {ro, rlse} = Ref.forward(q, k, v, opts)
    {atol, rtol} = Ref.tol(Nx.type(q))
    assert {Nx.type(o), Nx.shape(o)} == {Nx.type(q), Nx.shape(q)}
    Ref.assert_close(o, ro, atol, rtol, "o, " <> label(q, k, opts))
    lse_tol = if Nx.type(q) == {:f, 64}, do: 1.0e-10, else: 2.0e-5
    Ref.assert_close(lse, rlse, lse_tol, lse_tol, "lse, " <> label(q, k, opts))
    {o, lse}
  end

  describe "forward against the float64 reference" do
    test "each new option alone and with every existing one, in every type" do
      for {new, i} <- Enum.with_index(@new), {old, j} <- Enum.with_index(@old), type <- @types do
        {q, k, v, opts} = case_for(new, old, type, 100 * i + j)
        check_forward(q, k, v, opts)
      end
    end

    test "random cases with the new options over every option, type and shape" do
      for seed <- 0..59 do
        {q, k, v, opts} = Ref.random_case(5000 + seed, @types, [:key_mask, :bias, :alibi_slopes])
        check_forward(q, k, v, opts)
      end
    end

    test "the same answer eagerly and inside defn, the options as parameters" do
      for type <- [{:f, 32}, {:bf, 16}] do
        {q, k, v, opts} = case_for(:all_new, :all_old, type, 7)
        eager = ExlaRs.attention(q, k, v, opts)
        names = [:key_mask, :bias, :alibi_slopes]
        {tensors, rest} = Keyword.split(opts, names)

        jitted =
          Nx.Defn.jit(fn q, k, v, m, b, s ->
            ExlaRs.attention(q, k, v, rest ++ [key_mask: m, bias: b, alibi_slopes: s])
          end).(q, k, v, tensors[:key_mask], tensors[:bias], tensors[:alibi_slopes])

        assert eager == jitted
      end
    end

    test "a key mask is its nonzero entries, whatever its integer type" do
      {q, k, v, _} = case_for(:key_mask, :none, {:f, 32}, 3)
      mask = Nx.tensor([[0, 3, -1, 0, 1, 1, 0], [1, 0, 0, 255, 1, 0, 1]])
      want = ExlaRs.attention(q, k, v, key_mask: Nx.not_equal(mask, 0))

      for type <- [:s8, :s16, :s32, :s64, :u16, :u64] do
        typed = mask |> Nx.abs() |> Nx.as_type(type)
        assert ExlaRs.attention(q, k, v, key_mask: typed) == want
      end
    end
  end

  describe "gradients against autodiff of the float64 reference" do
    test "each new option alone and with every existing one (f32, f64), through o, o and lse, lse" do
      grads = [false, true, :lse_only]

      for {new, i} <- Enum.with_index(@new), {old, j} <- Enum.with_index(@old), type <- [{:f, 32}, {:f, 64}] do
        {q, k, v, opts} = case_for(new, old, type, 1000 + 100 * i + j)
        Ref.check_grads(j, q, k, v, opts, Enum.at(grads, rem(i + j, 3)))
      end
    end

    test "f16 and bf16" do
      for new <- @new, old <- [:none, :causal, :all_old], type <- [{:f, 16}, {:bf, 16}], with_lse? <- [false, true] do
        {q, k, v, opts} = case_for(new, old, type, 7)
        Ref.check_grads(3, q, k, v, opts, with_lse?)
      end
    end

    test "random cases with the new options" do
      for seed <- 0..29 do
        {q, k, v, opts} = Ref.random_case(6000 + seed, [{:f, 32}, {:f, 64}], [:key_mask, :bias, :alibi_slopes])
        Ref.check_grads(seed, q, k, v, opts, Enum.at([false, true, :lse_only], rem(seed, 3)))
      end
    end

    test "the bias gradient for every broadcast pattern" do
      patterns = [
        {1, @h, @sq, @sk},
        {@b, 1, @sq, @sk},
        {1, 1, @sq, @sk},
        {@b, @h, @sq, @sk},
        {@b, @h, 1, @sk},
        {1, 1, 1, @sk},
        {@b, 1, @sq, 1},
        {1, 1, 1, 1}
      ]

      for {shape, i} <- Enum.with_index(patterns), {type, bias_type} <- [{{:f, 32}, {:f, 32}}, {{:f, 64}, {:f, 64}}, {{:bf, 16}, {:f, 32}}, {{:f, 16}, {:f, 16}}] do
        {q, k, v, opts} = case_for(:key_mask, :causal, type, 40 + i)
        bias = Ref.bias(%{type: type}, shape, bias_type)

        for with_lse? <- [false, true, :lse_only] do
          got = Ref.check_grads(i, q, k, v, [bias: bias] ++ opts, with_lse?)
          assert {Nx.type(elem(got, 3)), Nx.shape(elem(got, 3))} == {bias_type, shape}
        end
      end
    end
  end

  describe "fully masked rows" do
    test "by the key mask alone: lse = -inf, o = 0, no NaN, no gradient" do
      for type <- @types do
        {q, k, v, _} = case_for(:bias, :none, type, 21)
        # Row 0 sees nothing; row 1 is left-padded.
        key_mask = Nx.tensor([[0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1]], type: :u8)
        bias = Ref.bias(%{type: type}, {1, @h, @sq, @sk}, if(type == {:f, 64}, do: {:f, 64}, else: {:f, 32}))
        opts = [key_mask: key_mask, bias: bias, alibi_slopes: Ref.alibi_slopes(@h)]
        {o, lse} = check_forward(q, k, v, opts)

        assert Nx.to_flat_list(o[0]) |> Enum.all?(&(&1 == 0))
        assert Nx.to_flat_list(lse[0]) |> Enum.all?(&(&1 == :neg_infinity))

        {dq, _dk, _dv, dbias} = Ref.check_grads(5, q, k, v, opts, true)
        assert Nx.to_flat_list(dq[0]) |> Enum.all?(&(&1 == 0))
        refute Nx.any(Nx.is_nan(dbias)) |> Nx.to_number() == 1
      end
    end

    test "by a bias of -inf: lse = -inf, o = 0, no NaN, no gradient there" do
      for type <- @types do
        {q, k, v, _} = case_for(:bias, :none, type, 22)
        bias_type = if type == {:f, 64}, do: {:f, 64}, else: {:f, 32}
        ninf = Nx.Constants.neg_infinity(bias_type)
        bias = Ref.bias(%{type: type}, {@b, @h, @sq, @sk}, bias_type)
        # Query 2 of batch 1, head 3 sees only -inf; a few single entries are -inf too.
        bias = Nx.put_slice(bias, [1, 3, 2, 0], Nx.broadcast(ninf, {1, 1, 1, @sk}))
        bias = Nx.indexed_put(bias, Nx.tensor([[0, 0, 0, 1], [1, 2, 4, 6], [0, 1, 3, 0]]), Nx.broadcast(ninf, {3}))
        opts = [bias: bias, window_size: {4, 4}]
        {o, lse} = check_forward(q, k, v, opts)

        assert Nx.to_flat_list(o[[1, 2, 3]]) |> Enum.all?(&(&1 == 0))
        assert Nx.to_number(lse[[1, 3, 2]]) == :neg_infinity

        for with_lse? <- [false, true] do
          {dq, _dk, _dv, dbias} = Ref.check_grads(6, q, k, v, opts, with_lse?)
          assert Nx.to_flat_list(dq[[1, 2, 3]]) |> Enum.all?(&(&1 == 0))
          # A -inf entry has weight 0: its gradient is exactly 0.
          hidden = Nx.is_infinity(bias)
          assert Nx.select(hidden, dbias, 0) |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number() == 0
        end
      end
    end

    test "a bias entry the mask hides is never read, not even a NaN" do
      {q, k, v, _} = case_for(:bias, :none, {:f, 32}, 23)
      key_mask = Ref.key_mask(@b, @sk, :holes)
      bias = Ref.bias(%{type: {:f, 32}}, {@b, 1, @sq, @sk}, {:f, 32})
      hidden = key_mask |> Nx.equal(0) |> Nx.reshape({@b, 1, 1, @sk}) |> Nx.broadcast(Nx.shape(bias))
      nan_bias = Nx.select(hidden, Nx.Constants.nan(:f32), bias)
      opts = [key_mask: key_mask, causal: true]

      assert ExlaRs.attention_with_lse(q, k, v, [bias: nan_bias] ++ opts) ==
               ExlaRs.attention_with_lse(q, k, v, [bias: bias] ++ opts)

      # ... nor in the backward: the same gradients, and 0 (not NaN) at the hidden entries.
      grads = fn bias ->
        Nx.Defn.grad({q, k, v, bias}, fn {q, k, v, bias} ->
          {o, lse} = ExlaRs.attention_with_lse(q, k, v, [bias: bias] ++ opts)
          Nx.add(Nx.sum(Nx.multiply(o, o)), Nx.sum(Nx.select(Nx.is_infinity(lse), 0, lse)))
        end)
      end

      {dq, dk, dv, dbias} = grads.(nan_bias)
      assert {dq, dk, dv, Nx.select(hidden, 0, dbias)} == grads.(bias)
      assert Nx.select(hidden, dbias, 0) |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number() == 0
    end
  end

  describe "the traced program" do
    setup do
      :rand.seed(:exsss, {1, 2, 3})
      q = Ref.normal({2, 8, 4, 16}, {:f, 32})
      k = Ref.normal({2, 10, 2, 16}, {:f, 32})

      %{
        q: q,
        k: k,
        v: Ref.normal({2, 10, 2, 16}, {:f, 32}),
        key_mask: Ref.key_mask(2, 10, :left_pad),
        bias: Ref.bias(%{type: {:f, 32}}, {1, 4, 8, 10}, {:bf, 16}),
        slopes: Ref.alibi_slopes(4)
      }
    end

    defp blocks(expr) do
      walked = Ref.walk(expr)
      {for({%Forward{}, _, _} = blk <- walked.blocks, do: blk), for({%Backward{}, _, _} = blk <- walked.blocks, do: blk)}
    end

    defp likes(list), do: Enum.map(list, &{&1.type, &1.shape})

    test "the forward's inputs end with the present optional operands in the contract's order", c do
      for present <- [[:key_mask], [:bias], [:alibi_slopes], [:key_mask, :alibi_slopes], [:key_mask, :bias, :alibi_slopes]] do
        all = [key_mask: c.key_mask, bias: c.bias, alibi_slopes: c.slopes]
        # Given in reverse: the block still takes them in the contract's order.
        opts = all |> Keyword.take(present) |> Enum.reverse()
        expr = Nx.Defn.debug_expr(fn q, k, v -> ExlaRs.attention_with_lse(q, k, v, opts) end).(c.q, c.k, c.v)
        assert {[{%Forward{} = tag, args, _out}], []} = blocks(expr)

        assert {tag.has_key_mask, tag.has_bias, tag.has_alibi} ==
                 {:key_mask in present, :bias in present, :alibi_slopes in present}

        assert ExlaRs.CustomCall.optional_operands(tag) == present
        want = for name <- present, do: %{key_mask: {{:u, 8}, {2, 10}}, bias: {{:bf, 16}, {1, 4, 8, 10}}, alibi_slopes: {{:f, 32}, {4}}}[name]
        assert args |> Enum.drop(5) |> likes() == want
      end
    end

    test "a differentiated bias: both backward blocks take the optional operands and return dbias", c do
      expr =
        Nx.Defn.debug_expr(fn q, k, v, bias ->
          Nx.Defn.grad({q, k, v, bias}, fn {q, k, v, bias} ->
            opts = [key_mask: c.key_mask, bias: bias, alibi_slopes: c.slopes, causal: true]
            {o, lse} = ExlaRs.attention_with_lse(q, k, v, opts)
            Nx.add(Nx.sum(o), Nx.sum(Nx.multiply(lse, lse)))
          end)
        end).(c.q, c.k, c.v, c.bias)

      assert {[{%Forward{}, fargs, _}], [_, _] = backwards} = blocks(expr)
      [_, _, _, _, _, fmask, fbias, fslopes] = fargs

      for {%Backward{} = tag, args, out} <- backwards do
        assert tag.bias_grad and tag.has_bias and tag.has_key_mask and tag.has_alibi
        assert length(args) == 11
        # The very tensors the forward saw.
        assert Enum.map(Enum.drop(args, 8), & &1.data.id) == Enum.map([fmask, fbias, fslopes], & &1.data.id)
        # (then the workspace, when the tag carries one)
        [dq, dk, dv, dbias | _] = Tuple.to_list(out)
        assert tuple_size(out) == if(tag.workspace > 0, do: 5, else: 4)
        [bq, bk, bv | _] = args
        assert likes([dq, dk, dv]) == likes([bq, bk, bv])
        assert {dbias.type, dbias.shape} == {{:bf, 16}, {1, 4, 8, 10}}
      end

      # No O(S²) work outside the blocks.
      walked = Ref.walk(expr)

      for op <- [:dot, :exp, :reduce_max, :tanh] do
        refute Map.has_key?(walked.ops, op), "#{op} outside the blocks: #{inspect(walked.ops)}"
      end
    end

    test "a captured constant bias is not differentiated: no dbias", c do
      expr =
        Nx.Defn.debug_expr(fn q, k, v ->
          Nx.Defn.grad({q, k, v}, fn {q, k, v} -> Nx.sum(ExlaRs.attention(q, k, v, bias: c.bias)) end)
        end).(c.q, c.k, c.v)

      assert {[_], [{%Backward{bias_grad: false, has_bias: true} = tag, args, out}]} = blocks(expr)
      assert length(args) == 9
      # dq, dk, dv and no dbias (then the workspace, when the tag carries one).
      [bq, bk, bv | _] = args
      assert likes(Enum.take(Tuple.to_list(out), 3)) == likes([bq, bk, bv])
      assert tuple_size(out) == if(tag.workspace > 0, do: 4, else: 3)
      if tag.workspace > 0, do: assert(likes([elem(out, 3)]) == [{{:u, 8}, {tag.workspace}}])
    end
  end

  describe "the Axon layer functions" do
    test "take every tensor option, named by :tensor_keys" do
      {q, k, v, opts} = case_for(:all_new, :kv_len, {:f, 32}, 9)
      keys = [:bias, :kv_len, :alibi_slopes, :key_mask]
      tensors = Enum.map(keys, &opts[&1])
      got = apply(ExlaRs.Axon, :layer, [q, k, v] ++ tensors ++ [[tensor_keys: keys, causal: true, mode: :train]])
      assert got == ExlaRs.attention(q, k, v, [causal: true] ++ opts)
    end
  end

  describe "validation" do
    setup do
      %{q: Nx.iota({2, 4, 6, 8}, type: :f32), k: Nx.iota({2, 5, 3, 8}, type: :f32)}
    end

    test "key_mask", %{q: q, k: k} do
      raises(~r/expected :key_mask to be an integer tensor of shape \{2, 5\} .*got \{:s, 32\} of shape \{2, 4\}/, fn ->
        ExlaRs.attention(q, k, k, key_mask: Nx.iota({2, 4}, type: :s32))
      end)

      raises(~r/expected :key_mask to be an integer tensor of shape \{2, 5\}.*got \{:f, 32\} of shape \{2, 5\}/, fn ->
        ExlaRs.attention(q, k, k, key_mask: Nx.iota({2, 5}, type: :f32))
      end)

      raises(~r/expected :key_mask .*got \{:s, 32\} of shape \{2, 1, 5\}/, fn ->
        ExlaRs.attention(q, k, k, key_mask: Nx.iota({2, 1, 5}, type: :s32))
      end)

      raises(~r/expected :key_mask to be .*, got: \[1, 0\]/, fn -> ExlaRs.attention(q, k, k, key_mask: [1, 0]) end)
      raises(~r/expected :key_mask .*vectorized/, fn -> ExlaRs.attention(q, k, k, key_mask: Nx.vectorize(Nx.iota({2, 5}), :x)) end)
    end

    test "bias", %{q: q, k: k} do
      raises(~r/expected :bias to be a float tensor of rank 4 broadcastable to \{batch, heads, seq_q, seq_k\} = \{2, 6, 4, 5\}, got shape \{6, 4, 5\}/, fn ->
        ExlaRs.attention(q, k, k, bias: Nx.iota({6, 4, 5}, type: :f32))
      end)

      raises(~r/expected each dimension of :bias to be 1 or the full size of .*\{2, 6, 4, 5\}, got shape \{1, 3, 4, 5\} \(dimension 1 is 3, expected 1 or 6\)/, fn ->
        ExlaRs.attention(q, k, k, bias: Nx.iota({1, 3, 4, 5}, type: :f32))
      end)

      raises(~r/dimension 3 is 6, expected 1 or 5/, fn -> ExlaRs.attention(q, k, k, bias: Nx.iota({1, 1, 1, 6}, type: :f32)) end)
      raises(~r/expected :bias to have a float type .*got \{:s, 32\}/, fn -> ExlaRs.attention(q, k, k, bias: Nx.iota({1, 1, 4, 5})) end)
      raises(~r/expected :bias to have a float type .*got \{:c, 64\}/, fn -> ExlaRs.attention(q, k, k, bias: Nx.iota({1, 1, 4, 5}, type: :c64)) end)
      raises(~r/expected :bias to be a float tensor .*got: 1.0/, fn -> ExlaRs.attention(q, k, k, bias: 1.0) end)
    end

    test "alibi_slopes", %{q: q, k: k} do
      raises(~r/expected :alibi_slopes to be a float tensor of shape \{6\} \(one slope per query head\), got \{:f, 32\} of shape \{3\}/, fn ->
        ExlaRs.attention(q, k, k, alibi_slopes: Nx.iota({3}, type: :f32))
      end)

      raises(~r/expected :alibi_slopes .*got \{:s, 32\} of shape \{6\}/, fn -> ExlaRs.attention(q, k, k, alibi_slopes: Nx.iota({6})) end)
      raises(~r/expected :alibi_slopes .*got \{:f, 32\} of shape \{1, 6\}/, fn -> ExlaRs.attention(q, k, k, alibi_slopes: Nx.iota({1, 6}, type: :f32)) end)
    end

    test "valid values are accepted, also inside defn", %{q: q, k: k} do
      bias = Nx.iota({2, 1, 1, 5}, type: :bf16)
      opts = [key_mask: Nx.tensor([[1, 1, 0, 1, 1], [0, 0, 1, 1, 1]], type: :s64), bias: bias, alibi_slopes: Nx.iota({6}, type: :f64)]
      assert %Nx.Tensor{} = ExlaRs.attention(q, k, k, opts)
      assert %Nx.Tensor{} = Nx.Defn.jit(fn q, k -> ExlaRs.attention(q, k, k, opts) end).(q, k)
    end
  end
end
