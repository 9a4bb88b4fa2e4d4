Code.require_file("support.exs", __DIR__)

defmodule ExlaRs.DropoutTest do
  # Attention dropout (issue 11) on the Nx fallback: the mask is the contract's
  # Philox4x32-10 function ("Dropout" in docs/flash-attention-contract.md), checked
  # against Random123's known answers, the table the Rust and numpy implementations
  # are checked against, and a plain-integer Philox written here from the contract;
  # the forward and the gradients against a float64 reference that applies the mask
  # observed through the library.
  use ExUnit.Case, async: true
  @moduletag :nx

  import Bitwise

  alias ExlaRs.Attention.{Backward, Forward, Philox}
  alias ExlaRs.NxTest.Reference, as: Ref

  @types [{:f, 32}, {:f, 16}, {:bf, 16}, {:f, 64}]
  @vectors Path.expand("../data/dropout_vectors.txt", __DIR__)

  # Philox4x32-10 on Elixir integers, from the contract's text (not the library's code).
  defp philox({c0, c1, c2, c3}, {k0, k1}) do
    Enum.reduce(0..9, {c0, c1, c2, c3}, fn r, {c0, c1, c2, c3} ->
      k0r = k0 + 0x9E3779B9 * r &&& 0xFFFFFFFF
      k1r = k1 + 0xBB67AE85 * r &&& 0xFFFFFFFF
      p0 = 0xD2511F53 * c0
      p1 = 0xCD9E8D57 * c2
      {bxor(bxor(p1 >>> 32, c1), k0r), p1 &&& 0xFFFFFFFF, bxor(bxor(p0 >>> 32, c3), k1r), p0 &&& 0xFFFFFFFF}
    end)
  end

  # The contract's draw: the upper half from x (counter (j div 8, i, h, b)), the lower
  # half from y (counter word 0 + 2^31), each half(w, j) = 16-bit half j mod 2 of word
  # (j mod 8) div 2.
  defp draw(key, b, h, i, j) do
    half = fn w -> elem(w, j >>> 1 &&& 3) >>> (16 * (j &&& 1)) &&& 0xFFFF end
    x = philox({j >>> 3, i, h, b}, key)
    y = philox({(j >>> 3) + 0x80000000, i, h, b}, key)
    half.(x) <<< 16 ||| half.(y)
  end

  # The table's lines, each split into words; draw lines as integers.
  defp vector_lines do
    @vectors |> File.read!() |> String.split("\n", trim: true) |> Enum.reject(&String.starts_with?(&1, "#"))
  end

  defp vector_draws do
    for "draw " <> rest <- vector_lines(), do: rest |> String.split() |> Enum.map(&String.to_integer(&1, 16))
  end

  # The table's entries inside the small mask {2, 8, 4, 14} (b <= 1, h <= 7, i <= 3, j <= 13).
  @small {2, 8, 4, 14}
  defp small?([_k0, _k1, b, h, i, j, _v]), do: b < 2 and h < 8 and i < 4 and j < 14

  # The contract's mask {B, H, Sq, Sk} as f64 0/1, element by element.
  defp contract_mask(key, rate, {b, h, sq, sk}) do
    [k0, k1] = Nx.to_flat_list(key)
    <<r::float-32>> = <<rate / 1::float-32>>
    t = trunc(Float.floor(r * 4_294_967_296.0))

    for(bi <- 0..(b - 1), hi <- 0..(h - 1), i <- 0..(sq - 1), j <- 0..(sk - 1), do: if(draw({k0, k1}, bi, hi, i, j) >= t, do: 1.0, else: 0.0))
    |> Nx.tensor(type: :f64)
    |> Nx.reshape({b, h, sq, sk})
  end

  describe "the generator" do
    test "Philox4x32-10 gives Random123's known answers (Nx and the plain reference)" do
      kat = [
        {{0, 0, 0, 0}, {0, 0}, [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]},
        {{0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF}, {0xFFFFFFFF, 0xFFFFFFFF},
         [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]},
        {{0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344}, {0xA4093822, 0x299F31D0},
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]}
      ]

      for {ctr, key, want} <- kat do
        assert ctr |> Philox.philox4x32_10(key) |> Tuple.to_list() |> Enum.map(&Nx.to_number/1) == want
        assert ctr |> philox(key) |> Tuple.to_list() == want
      end

      # Vectorised: the three counters and keys as tensors in one call.
      ctr = for w <- 0..3, do: Nx.tensor(for({c, _, _} <- kat, do: elem(c, w)), type: :u32)
      key = for w <- 0..1, do: Nx.tensor(for({_, k, _} <- kat, do: elem(k, w)), type: :u32)
      out = Philox.philox4x32_10(List.to_tuple(ctr), List.to_tuple(key)) |> Tuple.to_list() |> Nx.stack(axis: 1)
      assert Nx.to_list(out) == Enum.map(kat, &elem(&1, 2))
    end

    test "draws, thresholds and keep scales match the table shared with Rust and numpy" do
      lines = vector_lines()
      hex = &String.to_integer(&1, 16)
      draws = vector_draws()
      # Every draw line of the table is checked (4 keys x 3 b x 4 h x 4 i x 13 j).
      assert length(draws) == length(for "draw " <> _ <- lines, do: 1)
      assert length(draws) == 2496

      for {{k0, k1}, rows} <- Enum.group_by(draws, fn [k0, k1 | _] -> {k0, k1} end) do
        key = Nx.tensor([k0, k1], type: :u32)
        col = fn n, type -> Nx.tensor(Enum.map(rows, &Enum.at(&1, n)), type: type) end
        got = Philox.draws_at(key, col.(2, :u64), col.(3, :u64), col.(4, :u64), col.(5, :u64))
        assert Nx.to_flat_list(got) == Enum.map(rows, &Enum.at(&1, 6)), "key #{inspect({k0, k1})}"

        # The whole-mask path (the one the fallback uses) on the entries inside a small mask.
        whole = Philox.draws(key, @small)
        small = Enum.filter(rows, &small?/1)
        assert length(small) == 120

        for [_, _, b, h, i, j, v] <- small do
          assert Nx.to_number(whole[b][h][i][j]) == v, "key #{inspect({k0, k1})} entry #{inspect({b, h, i, j})}"
        end
      end

      thresholds = for "threshold " <> rest <- lines, do: rest |> String.split() |> Enum.map(hex)
      assert length(thresholds) >= 10

      for [bits, t] <- thresholds do
        <<rate::float-32>> = <<bits::32>>
        assert Philox.threshold(rate) == t, "rate #{rate}"
      end

      # 1 / (1 - rate) as f32 arithmetic gives it (numpy float32 wrote the table).
      scales = for "scale " <> rest <- lines, do: rest |> String.split() |> Enum.map(hex)
      assert length(scales) >= 10

      for [bits, scale_bits] <- scales do
        <<rate::float-32>> = <<bits::32>>
        assert <<Philox.keep_scale(rate, {:f, 32})::float-32>> == <<scale_bits::32>>, "rate #{rate}"
      end
    end

    test "the whole-mask draws (two Philox calls per eight keys) are the per-entry draws" do
      key = Nx.Random.key(7)
      # Sk not a multiple of 8, over more than one counter: the halves interleave in key order.
      shape = {2, 3, 5, 19}
      got = Philox.draws(key, shape)
      [k0, k1] = Nx.to_flat_list(key)
      {b, h, sq, sk} = shape
      want = for(bi <- 0..(b - 1), hi <- 0..(h - 1), i <- 0..(sq - 1), j <- 0..(sk - 1), do: draw({k0, k1}, bi, hi, i, j))
      assert Nx.to_flat_list(got) == want
      assert Nx.type(got) == {:u, 32}
    end
  end

  describe "thresholds that tie with a draw's upper half" do
    # T = floor(rate * 2^32) of an f32 rate is a multiple of the rate's ulp times 2^32:
    # 2^(e - 23) for a draw d with 2^e <= d < 2^(e + 1), at least 1. Rounding d down and up
    # to such a multiple gives two exact f32 rates whose thresholds keep d's upper 16 bits
    # (the kernels' tie, where only y's lower half decides): d >= T_down is kept, d < T_up
    # dropped.
    defp tie_thresholds(d) do
      e = length(Integer.digits(d, 2)) - 1
      g = 1 <<< max(e - 23, 0)
      down = d - rem(d, g)
      {down, down + g}
    end

    defp rate_of(t) do
      rate = t / 4_294_967_296
      # Exactly an f32 (at most 24 significant bits) with that threshold.
      <<r32::float-32>> = <<rate::float-32>>
      assert r32 == rate
      assert Philox.threshold(rate) == t
      rate
    end

    test "the lower half decides: kept iff draw >= T, on the mask and through attention" do
      # Per key, the first table entry of the small mask whose draw is not itself a threshold
      # (T_down < d < T_up) and where rounding up does not carry into the upper half.
      cases =
        vector_draws()
        |> Enum.filter(&small?/1)
        |> Enum.filter(fn [_, _, _, _, _, _, d] ->
          {down, up} = tie_thresholds(d)
          down < d and up <= 0xFFFFFF00 and up >>> 16 == d >>> 16 and down >>> 16 == d >>> 16
        end)
        |> Enum.uniq_by(fn [k0, k1 | _] -> {k0, k1} end)

      assert length(cases) == 4

      for [k0, k1, b, h, i, j, d] <- cases do
        key = Nx.tensor([k0, k1], type: :u32)
        {down, up} = tie_thresholds(d)

        for {t, kept} <- [{down, 1}, {up, 0}] do
          rate = rate_of(t)
          assert kept == if(d >= t, do: 1, else: 0)
          label = "key #{inspect({k0, k1})} entry #{inspect({b, h, i, j})} draw #{Integer.to_string(d, 16)} T #{Integer.to_string(t, 16)}"
          assert Nx.to_number(Philox.keep(key, rate, @small)[b][h][i][j]) == kept, label
          assert Nx.to_number(Philox.draws_at(key, b, h, i, j)) == d
        end
      end

      # End to end through the fallback (ExlaRs.attention), for the first case: the tied
      # entry is kept at T_down and dropped at T_up, and every other entry follows draw >= T.
      [k0, k1, b, h, i, j, d] = hd(cases)
      key = Nx.tensor([k0, k1], type: :u32)
      {down, up} = tie_thresholds(d)

      for {t, kept} <- [{down, 1.0}, {up, 0.0}] do
        observed = Ref.observe_mask(key, rate_of(t), @small)
        assert Nx.to_number(observed[b][h][i][j]) == kept
        assert observed == contract_mask(key, rate_of(t), @small)
      end
    end
  end

  describe "the observed mask" do
    test "queries all zero and v the identity show the contract's mask, in every type, GQA included" do
      key = Nx.Random.key(1234)

      for type <- @types, {rate, hkv} <- [{0.3, 4}, {0.1, 2}, {0.75, 1}] do
        shape = {2, 4, 5, 8}
        observed = Ref.observe_mask(key, rate, shape, hkv, type)
        assert observed == contract_mask(key, rate, shape), "#{inspect(type)} rate #{rate} kv heads #{hkv}"
      end
    end

    test "the mask does not depend on the head dim, the sequence lengths around it, or jit" do
      key = Nx.Random.key(99)
      rate = 0.4
      small = Ref.observe_mask(key, rate, {1, 2, 3, 8})
      # More queries and keys: the first 3 x 8 entries are the same mask.
      large = Ref.observe_mask(key, rate, {1, 2, 6, 16})
      assert Nx.slice(large, [0, 0, 0, 0], [1, 2, 3, 8]) == small
      assert small == contract_mask(key, rate, {1, 2, 3, 8})

      # Under jit (the key a traced argument) as eagerly.
      q = Nx.broadcast(0.0, {1, 3, 2, 8})
      v = Nx.broadcast(Nx.eye(8, type: :f32) |> Nx.reshape({1, 8, 1, 8}), {1, 8, 2, 8})
      jitted = Nx.Defn.jit(fn q, v, key -> ExlaRs.attention(q, v, v, dropout_rate: rate, dropout_key: key) end).(q, v, key)
      assert jitted == ExlaRs.attention(q, v, v, dropout_rate: rate, dropout_key: key)
    end
  end

  describe "statistics" do
    test "the kept fraction is within 4 sigma of 1 - rate over a large mask" do
      for rate <- [0.1, 0.5] do
        m = Philox.keep(Nx.Random.key(2024), rate, {2, 8, 64, 128})
        n = Nx.size(m)
        p = 1 - rate
        kept = m |> Nx.sum() |> Nx.to_number()
        assert abs(kept / n - p) < 4 * :math.sqrt(p * (1 - p) / n), "rate #{rate}: kept #{kept} of #{n}"
      end
    end

    test "same key, same mask; another key, another mask; heads do not repeat" do
      shape = {2, 4, 6, 8}
      m1 = Ref.observe_mask(Nx.Random.key(5), 0.5, shape)
      assert Ref.observe_mask(Nx.Random.key(5), 0.5, shape) == m1
      assert Ref.observe_mask(Nx.Random.key(6), 0.5, shape) != m1
      # A key differing in the low word only.
      assert Ref.observe_mask(Nx.tensor([0, 6], type: :u32), 0.5, shape) != Ref.observe_mask(Nx.tensor([1, 6], type: :u32), 0.5, shape)

      for b <- 0..1, h <- 0..2 do
        assert m1[b][h] != m1[b][h + 1], "batch #{b}: head #{h} repeats head #{h + 1}"
      end

      assert m1[0] != m1[1]
    end
  end

  describe "forward and backward" do
    @b 2
    @sq 5
    @sk 7
    @h 4
    @d 3

    defp opts_for(:none), do: []
    defp opts_for(:causal), do: [causal: true]
    defp opts_for(:window), do: [window_size: {2, 1}, softcap: 1.5]
    defp opts_for(:kv_len), do: [kv_len: Nx.tensor([4, 7]), q_start: Nx.tensor([1, 2])]
    defp opts_for(:key_mask), do: [key_mask: Nx.tensor([[1, 0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0]], type: :u8)]

    defp opts_for(:all),
      do: [causal: true, window_size: {3, -1}, scale: 0.8, kv_len: Nx.tensor([6, 5]), key_mask: Nx.tensor([[1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 1]])]

    defp dropout_case(type, hkv, seed) do
      :rand.seed(:exsss, {seed, 3, 7})
      q = Ref.normal({@b, @sq, @h, @d}, type)
      k = Ref.normal({@b, @sk, hkv, @d}, type)
      v = Ref.normal({@b, @sk, hkv, @d}, type)
      {q, k, v}
    end

    test "o and lse match the float64 reference with the observed mask" do
      for {type, t} <- Enum.with_index(@types), {name, n} <- Enum.with_index([:none, :causal, :window, :kv_len, :key_mask, :all]) do
        hkv = Enum.at([2, 1, 4], rem(n + t, 3))
        {q, k, v} = dropout_case(type, hkv, 10 * t + n)
        opts = opts_for(name) ++ [dropout_rate: 0.25, dropout_key: Nx.Random.key(n + 10 * t)]
        c = Ref.config(q, k, opts)
        assert c.dropout, "the reference applies the observed mask"
        mask = Ref.mask(q, k, opts)
        {want_o, want_lse} = Nx.Defn.jit(&Ref.naive(&1, &2, &3, &4, c)).(q, k, v, mask)
        {o, lse} = ExlaRs.attention_with_lse(q, k, v, opts)
        {atol, rtol} = Ref.tol(type)
        label = "#{inspect(type)} #{name} kv heads #{hkv}"
        Ref.assert_close(o, want_o, atol, rtol, "o, " <> label)
        # lse is the softmax's: dropout leaves it as it is (-inf rows compared as 0).
        lse = Nx.select(Nx.is_infinity(lse), 0, lse)
        Ref.assert_close(lse, want_lse, 1.0e-5, 1.0e-5, "lse, " <> label)
        {_o, no_dropout_lse} = ExlaRs.attention_with_lse(q, k, v, opts_for(name))
        assert Nx.select(Nx.is_infinity(no_dropout_lse), 0, no_dropout_lse) == lse
      end
    end

    test "the gradients are those of the masked function (o alone, and o with lse)" do
      for {type, t} <- Enum.with_index(@types), {name, n} <- Enum.with_index([:none, :causal, :window, :kv_len, :key_mask, :all]) do
        hkv = Enum.at([2, 4, 1], rem(n + t, 3))
        {q, k, v} = dropout_case(type, hkv, 100 + 10 * t + n)
        opts = opts_for(name) ++ [dropout_rate: 0.3, dropout_key: Nx.Random.key(77 + n)]
        Ref.check_grads(200 + n, q, k, v, opts, rem(n, 2) == 1)
      end
    end

    test "with a bias: its gradient sees the mask too" do
      {q, k, v} = dropout_case({:f, 32}, 2, 3)
      bias = Ref.normal({1, @h, @sq, @sk}, {:f, 32})
      opts = [bias: bias, causal: true, dropout_rate: 0.5, dropout_key: Nx.Random.key(3)]
      Ref.check_grads(3, q, k, v, opts, true)
    end
  end

  describe "rate 0" do
    test "costs nothing: no dropout operand or generator, the same result with or without a key" do
      {q, k, v} = {Nx.iota({1, 3, 2, 4}, type: :f32) |> Nx.divide(10), Nx.iota({1, 5, 2, 4}, type: :f32) |> Nx.divide(7), Nx.iota({1, 5, 2, 4}, type: :f32)}
      key = Nx.Random.key(1)

      expr = Nx.Defn.debug_expr(fn q, k, v -> ExlaRs.attention(q, k, v, dropout_rate: 0, dropout_key: key) end).(q, k, v)
      %{blocks: [{tag, args, _out}]} = Ref.walk(expr)
      assert %Forward{has_dropout: false, dropout_rate: +0.0} = tag
      assert length(args) == 5
      assert ExlaRs.CustomCall.attributes(tag) == ExlaRs.CustomCall.attributes(%{tag | dropout_rate: 0.0})
      refute Enum.any?(ExlaRs.CustomCall.attributes(tag), fn {name, _} -> name =~ "dropout" end)

      # Nothing of Philox in the whole forward (default function included): no u64 op.
      full = Nx.Defn.debug_expr(fn q, k, v -> ExlaRs.Attention.Fallback.forward(tag, q, k, v, Nx.tensor([5]), Nx.tensor([2])) end).(q, k, v)
      refute inspect(full, limit: :infinity) =~ "u64"

      assert ExlaRs.attention(q, k, v, dropout_rate: 0.0, dropout_key: key) == ExlaRs.attention(q, k, v)
      assert ExlaRs.attention(q, k, v, dropout_key: key) == ExlaRs.attention(q, k, v)
      assert ExlaRs.attention(q, k, v, dropout_rate: -0.0) == ExlaRs.attention(q, k, v)
    end
  end

  describe "the custom call" do
    test "a dropout call carries the key last and its attributes, and needs the dropout feature" do
      q = Nx.iota({1, 3, 2, 4}, type: :f32)
      k = Nx.iota({1, 5, 1, 4}, type: :f32)
      key = Nx.Random.key(3)
      mask = Nx.tensor([[1, 1, 0, 1, 1]], type: :u8)

      expr =
        Nx.Defn.debug_expr(fn q, k ->
          Nx.Defn.grad(q, fn q -> Nx.sum(ExlaRs.attention(q, k, k, key_mask: mask, dropout_rate: 0.125, dropout_key: key)) end)
        end).(q, k)

      %{blocks: blocks} = Ref.walk(expr)
      {fwd, fargs, fout} = Enum.find(blocks, &is_struct(elem(&1, 0), Forward))
      {bwd, bargs, bout} = Enum.find(blocks, &is_struct(elem(&1, 0), Backward))

      for {tag, args} <- [{fwd, fargs}, {bwd, bargs}] do
        assert %{has_dropout: true, dropout_rate: 0.125, has_key_mask: true} = tag
        assert ExlaRs.CustomCall.optional_operands(tag) == [:key_mask, :dropout_key]
        assert %{type: {:u, 32}, shape: {2}} = List.last(args)
        assert :dropout in ExlaRs.CustomCall.required_features(tag)
        attrs = ExlaRs.CustomCall.attributes(tag)
        assert {"has_dropout", "true"} in attrs
        assert {"dropout_rate", "0.125 : f32"} in attrs
      end

      # Both platforms' kernels run dropout (and key_mask): every feature the call needs is
      # reported, so the layer does not :skip it for lack of one (what decides then is only the
      # platform's registration, as for any call).
      for platform <- [:host, :cuda], {tag, out, args} <- [{fwd, fout, fargs}, {bwd, bout, bargs}] do
        assert :dropout in ExlaRs.CustomCall.features(platform)
        assert Enum.all?(ExlaRs.CustomCall.required_features(tag), &(&1 in ExlaRs.CustomCall.features(platform)))

        case ExlaRs.CustomCall.spec(tag, out, args, platform) do
          {:ok, target, attrs} ->
            assert target in ["exla_rs_flash_attn_fwd", "exla_rs_flash_attn_bwd"]
            assert {"has_dropout", "true"} in attrs

          :skip ->
            # Only where the platform's runtime is absent from this BEAM (no registration).
            assert {:error, _} = ExlaRs.CustomCall.ensure_registered(platform)
        end
      end
    end
  end

  describe "errors" do
    setup do
      {:ok, q: Nx.iota({1, 3, 2, 4}, type: :f32), k: Nx.iota({1, 5, 2, 4}, type: :f32)}
    end

    test "a rate outside [0, 1), a bad key or a rate without a key raise naming the option", %{q: q, k: k} do
      key = Nx.Random.key(1)

      for rate <- [-0.1, 1, 1.0, 1.5, 0.999999999, "0.1", :half] do
        assert_raise ArgumentError, ~r/:dropout_rate/, fn -> ExlaRs.attention(q, k, k, dropout_rate: rate, dropout_key: key) end
      end

      for bad <- [Nx.tensor([1, 2], type: :s32), Nx.tensor([1, 2, 3], type: :u32), Nx.tensor(1, type: :u32), [0, 1], 42] do
        assert_raise ArgumentError, ~r/:dropout_key/, fn -> ExlaRs.attention(q, k, k, dropout_rate: 0.1, dropout_key: bad) end
      end

      assert_raise ArgumentError, ~r/:dropout_rate 0.10000000149011612 needs a :dropout_key/, fn ->
        ExlaRs.attention_with_lse(q, k, k, dropout_rate: 0.1)
      end

      vectorized = Nx.vectorize(Nx.stack([key, key]), :x)
      assert_raise ArgumentError, ~r/:dropout_key/, fn -> ExlaRs.attention(q, k, k, dropout_rate: 0.1, dropout_key: vectorized) end
    end
  end

  describe "the Axon layer" do
    @hidden 8
    @heads 2
    @head_dim 4

    defp axon_model(opts) do
      x = Axon.input("x", shape: {nil, nil, @hidden})
      split = fn node -> Axon.nx(node, fn t -> Nx.reshape(t, {elem(Nx.shape(t), 0), elem(Nx.shape(t), 1), @heads, @head_dim}) end) end
      q = x |> Axon.dense(@hidden, name: "q") |> split.()
      k = x |> Axon.dense(@hidden, name: "k") |> split.()
      v = x |> Axon.dense(@hidden, name: "v") |> split.()
      ExlaRs.Axon.attention(q, k, v, [name: "flash", causal: true] ++ opts)
    end

    defp build(model, mode, x) do
      {init_fn, predict_fn} = Axon.build(model, mode: mode)
      state = Nx.Defn.jit(init_fn).(%{"x" => Nx.template(Nx.shape(x), Nx.type(x))}, Axon.ModelState.empty())
      {state, predict_fn}
    end

    # The state keys the model keeps ("key" of the layer): the Axon.dropout convention.
    defp layer_key(state), do: state.data["flash"]["key"]

    test "dropout in training mode only, with its key kept and split as Axon.dropout does" do
      :rand.seed(:exsss, {1, 2, 3})
      x = Ref.normal({2, 6, @hidden}, {:f, 32})
      model = axon_model(dropout_rate: 0.5, seed: 42)

      {state, train} = build(model, :train, x)
      assert layer_key(state) == Nx.Random.key(42)
      %{prediction: out, state: new_state} = Nx.Defn.jit(train).(state, %{"x" => x})

      # The mask is drawn with the second half of the split key; the first half is the new state.
      keys = Nx.Random.split(Nx.Random.key(42))
      assert new_state["flash"]["key"] == keys[0]

      {_state, infer} = build(model, :inference, x)
      plain = Nx.Defn.jit(infer).(state, %{"x" => x})
      {_state, no_dropout} = build(axon_model([]), :inference, x)
      assert plain == Nx.Defn.jit(no_dropout).(state, %{"x" => x})
      assert out != plain

      # Exactly ExlaRs.attention with that key on the layer's q, k, v.
      dense = fn name -> Nx.add(Nx.dot(x, state.data[name]["kernel"]), state.data[name]["bias"]) |> Nx.reshape({2, 6, @heads, @head_dim}) end
      want = ExlaRs.attention(dense.("q"), dense.("k"), dense.("v"), causal: true, dropout_rate: 0.5, dropout_key: keys[1])
      Ref.assert_close(out, want, 1.0e-6, 1.0e-6, "train-mode output")
    end

    test "a rate outside [0, 1) or a bad seed raises when the layer is built" do
      x = Axon.input("x", shape: {nil, 3, 2, 4})

      assert_raise ArgumentError, ~r/:dropout_rate/, fn -> ExlaRs.Axon.attention(x, x, x, dropout_rate: 1.0) end
      assert_raise ArgumentError, ~r/:seed/, fn -> ExlaRs.Axon.attention(x, x, x, dropout_rate: 0.1, seed: "s") end
      assert_raise ArgumentError, ~r/:dropout_key must be an Axon node/, fn ->
        ExlaRs.Axon.attention(x, x, x, dropout_rate: 0.1, dropout_key: Nx.Random.key(1))
      end
    end
  end
end
