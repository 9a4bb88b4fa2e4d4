# Shared by the test/nx tests (loaded with Code.require_file/2; not a test file itself).
unless Code.ensure_loaded?(ExlaRs.NxTest.Reference) do
  defmodule ExlaRs.NxTest.Reference do
    @moduledoc false
    # The contract's function in float64, written independently of the library:
    # the forward straight from its definition on Elixir lists, and a naive Nx
    # formulation (materialised softmax) that Nx.Defn.grad can differentiate.

    @doc "The f32 value the library and the kernels use for a float option."
    def f32(x) do
      <<y::float-32>> = <<x / 1::float-32>>
      y
    end

    @doc """
    Resolved options: the same defaults the contract gives, as plain values. The
    key mask is a list of rows (or nil), the bias a nested list of its own shape
    (entries are floats or :neg_infinity) with `bias_shape`, the ALiBi slopes a
    list of the f32 values the kernels read (or nil).
    """
    def config(q, k, opts) do
      {b, sq, _h, d} = Nx.shape(q)
      {_, sk, _hkv, _} = Nx.shape(k)
      opts = Keyword.put(opts, :dropout_sk, sk)
      causal = Keyword.get(opts, :causal, false)
      {left, right} = Keyword.get(opts, :window_size, {-1, -1})
      right = if causal, do: 0, else: right

      %{
        scale: f32(Keyword.get(opts, :scale, 1 / :math.sqrt(d))),
        softcap: f32(Keyword.get(opts, :softcap, 0.0)),
        left: left,
        right: right,
        kv_len: rows(opts[:kv_len], b, sk),
        q_start: rows(opts[:q_start], b, sk - sq),
        key_mask: opts[:key_mask] && Nx.to_list(opts[:key_mask]),
        bias: opts[:bias] && opts[:bias] |> Nx.as_type(:f64) |> Nx.to_list(),
        bias_shape: opts[:bias] && Nx.shape(opts[:bias]),
        slopes: opts[:alibi_slopes] && opts[:alibi_slopes] |> Nx.as_type(:f32) |> Nx.to_flat_list(),
        dropout: dropout(q, opts)
      }
    end

    @doc """
    The dropout mask as the library applies it, observed through the library itself
    (not computed by it): with queries all zero and `v` the identity over keys
    (head dim = Sk), every visible key gets weight 1/Sk, so
    `o[b, i, h, j] = M[b, h, i, j] / ((1 - rate) * Sk)`. Returns the f64 keep mask
    `{B, H, Sq, Sk}` (1.0 kept, 0.0 dropped), asserting each observed value is
    within 0.03 of 0 or 1 (bf16's rounding). `kv_heads` only changes how v is laid out: the mask
    is per query head.
    """
    def observe_mask(key, rate, {b, h, sq, sk}, kv_heads \\ nil, type \\ {:f, 32}) do
      hkv = kv_heads || h
      q = Nx.broadcast(Nx.tensor(0, type: type), {b, sq, h, sk})
      eye = Nx.eye(sk, type: type) |> Nx.reshape({1, sk, 1, sk})
      v = Nx.broadcast(eye, {b, sk, hkv, sk})
      o = ExlaRs.attention(q, v, v, dropout_rate: rate, dropout_key: key)
      <<r::float-32>> = <<rate / 1::float-32>>
      m = o |> Nx.as_type(:f64) |> Nx.multiply((1 - r) * sk) |> Nx.transpose(axes: [0, 2, 1, 3])
      rounded = Nx.round(m)
      worst = m |> Nx.subtract(rounded) |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number()
      # bf16 rounds 1/((1 - rate) * Sk) to 8 bits: allow a few percent, far from 0.5.
      if worst >= 0.03, do: ExUnit.Assertions.flunk("observed mask entries off 0/1 by #{worst}")
      not_01 = rounded |> Nx.multiply(Nx.subtract(rounded, 1)) |> Nx.any() |> Nx.to_number()
      if not_01 == 1, do: ExUnit.Assertions.flunk("observed mask entries other than 0 and 1: #{inspect(rounded)}")
      rounded
    end

    # {observed f64 mask {B, H, Sq, Sk}, 1 / (1 - rate)} when opts ask for dropout.
    defp dropout(q, opts) do
      case {opts[:dropout_rate], opts[:dropout_key]} do
        {rate, key} when is_number(rate) and rate > 0 ->
          {b, sq, h, _d} = Nx.shape(q)
          sk = opts[:dropout_sk] || raise "config/3 with dropout needs :dropout_sk (the key length)"
          <<r::float-32>> = <<rate / 1::float-32>>
          {observe_mask(key, rate, {b, h, sq, sk}), 1 / (1 - r)}

        _ ->
          nil
      end
    end

    defp rows(nil, b, default), do: List.duplicate(default, b)
    defp rows(t, _b, _default), do: Nx.to_flat_list(t)

    def visible?(c, b, i, j) do
      qs = Enum.at(c.q_start, b)

      j < Enum.at(c.kv_len, b) and (c.left < 0 or j >= qs + i - c.left) and
        (c.right < 0 or j <= qs + i + c.right) and
        (c.key_mask == nil or c.key_mask |> Enum.at(b) |> Enum.at(j) != 0)
    end

    @doc "The bias term of score (b, h, i, j): 0.0 without a bias; size-1 dimensions broadcast."
    def bias_at(%{bias: nil}, _b, _h, _i, _j), do: 0.0

    def bias_at(%{bias: bias, bias_shape: shape}, b, h, i, j) do
      [b, h, i, j]
      |> Enum.zip(Tuple.to_list(shape))
      |> Enum.reduce(bias, fn {index, n}, acc -> Enum.at(acc, if(n == 1, do: 0, else: index)) end)
    end

    @doc "The ALiBi term of score (b, h, i, j): -slope[h] * |q_start[b] + i - j|, or 0.0."
    def alibi_at(%{slopes: nil}, _b, _h, _i, _j), do: 0.0
    def alibi_at(c, b, h, i, j), do: -Enum.at(c.slopes, h) * abs(Enum.at(c.q_start, b) + i - j)

    @doc "{o, lse} in f64, from the contract's definition, element by element."
    def forward(q, k, v, opts) do
      c = config(q, k, opts)
      {b, sq, h, _d} = Nx.shape(q)
      {_, sk, hkv, _} = Nx.shape(k)
      g = div(h, hkv)
      ql = q |> Nx.as_type(:f64) |> Nx.to_list()
      kl = k |> Nx.as_type(:f64) |> Nx.to_list()
      vl = v |> Nx.as_type(:f64) |> Nx.to_list()

      rows =
        for bi <- 0..(b - 1), hi <- 0..(h - 1), i <- 0..(sq - 1) do
          qv = ql |> Enum.at(bi) |> Enum.at(i) |> Enum.at(hi)
          kh = div(hi, g)

          # A bias of -inf hides its key like the mask (it gets weight 0).
          scores =
            for j <- 0..(sk - 1), visible?(c, bi, i, j), beta = bias_at(c, bi, hi, i, j), beta != :neg_infinity do
              kv = kl |> Enum.at(bi) |> Enum.at(j) |> Enum.at(kh)
              x = c.scale * dot(qv, kv)
              s = if c.softcap > 0, do: c.softcap * :math.tanh(x / c.softcap), else: x
              {j, s + beta + alibi_at(c, bi, hi, i, j)}
            end

          d = length(qv)

          case scores do
            [] ->
              {{bi, hi, i}, List.duplicate(0.0, d), :neg_infinity}

            _ ->
              m = scores |> Enum.map(&elem(&1, 1)) |> Enum.max()
              ws = Enum.map(scores, fn {j, s} -> {j, :math.exp(s - m)} end)
              l = ws |> Enum.map(&elem(&1, 1)) |> Enum.sum()

              o =
                Enum.reduce(ws, List.duplicate(0.0, d), fn {j, w}, acc ->
                  vv = vl |> Enum.at(bi) |> Enum.at(j) |> Enum.at(kh)
                  Enum.zip_with(acc, vv, &(&1 + w / l * &2))
                end)

              {{bi, hi, i}, o, :math.log(l) + m}
          end
        end

      by_key = Map.new(rows, fn {key, o, lse} -> {key, {o, lse}} end)

      o =
        for bi <- 0..(b - 1) do
          for i <- 0..(sq - 1), do: for(hi <- 0..(h - 1), do: elem(by_key[{bi, hi, i}], 0))
        end

      lse =
        for bi <- 0..(b - 1) do
          for hi <- 0..(h - 1), do: for(i <- 0..(sq - 1), do: elem(by_key[{bi, hi, i}], 1))
        end

      {Nx.tensor(o, type: :f64), Nx.tensor(lse, type: :f64)}
    end

    defp dot(a, b), do: Enum.zip_with(a, b, &(&1 * &2)) |> Enum.sum()

    @doc "The visibility mask as u8 {B, 1, Sq, Sk}."
    def mask(q, k, opts) do
      c = config(q, k, opts)
      {b, sq, _, _} = Nx.shape(q)
      {_, sk, _, _} = Nx.shape(k)

      for(bi <- 0..(b - 1), do: [for(i <- 0..(sq - 1), do: for(j <- 0..(sk - 1), do: if(visible?(c, bi, i, j), do: 1, else: 0)))])
      |> Nx.tensor(type: :u8)
    end

    @doc """
    {o, lse} as a naive, differentiable f64 Nx program (lse is 0 for a row that
    sees nothing, o is 0 there). `mask` from mask/3, `c` from config/3 (for the
    ALiBi slopes), `bias` the (differentiable) bias tensor or nil: a -inf bias
    entry hides its key.
    """
    def naive(q, k, v, mask, c, bias \\ nil) do
      {_b, _sq, h, _d} = Nx.shape(q)
      {_, _sk, hkv, _} = Nx.shape(k)
      g = div(h, hkv)
      heads = Nx.tensor(for(hi <- 0..(h - 1), do: div(hi, g)))
      q = q |> Nx.as_type(:f64) |> Nx.transpose(axes: [0, 2, 1, 3])
      k = k |> Nx.as_type(:f64) |> Nx.take(heads, axis: 2) |> Nx.transpose(axes: [0, 2, 1, 3])
      v = v |> Nx.as_type(:f64) |> Nx.take(heads, axis: 2) |> Nx.transpose(axes: [0, 2, 1, 3])

      x = Nx.dot(q, [3], [0, 1], k, [3], [0, 1]) |> Nx.multiply(c.scale)
      s = if c.softcap > 0, do: Nx.multiply(Nx.tanh(Nx.divide(x, c.softcap)), c.softcap), else: x
      s = if bias, do: Nx.add(s, Nx.as_type(bias, :f64)), else: s
      s = if c.slopes, do: Nx.add(s, alibi(c, Nx.shape(s))), else: s
      mask = Nx.logical_and(Nx.broadcast(mask, Nx.shape(s)), Nx.not_equal(s, Nx.Constants.neg_infinity(:f64)))
      s = Nx.select(mask, s, -1.0e30)
      m = s |> Nx.reduce_max(axes: [3], keep_axes: true) |> Nx.Defn.Kernel.stop_grad()
      e = Nx.multiply(Nx.exp(Nx.subtract(s, m)), mask)
      l = Nx.sum(e, axes: [3], keep_axes: true)
      any = Nx.greater(l, 0)
      l1 = Nx.select(any, l, 1.0)
      p = Nx.divide(e, l1)
      # Dropout (c.dropout = {mask, 1 / (1 - rate)}): only o sees the mask, lse does not.
      p = if c[:dropout], do: p |> Nx.multiply(elem(c.dropout, 0)) |> Nx.multiply(elem(c.dropout, 1)), else: p
      o = Nx.dot(p, [3], [0, 1], v, [2], [0, 1]) |> Nx.transpose(axes: [0, 2, 1, 3])
      lse = Nx.select(any, Nx.add(Nx.log(l1), m), 0.0) |> Nx.squeeze(axes: [3])
      {o, lse}
    end

    # The ALiBi term as an f64 {B, H, Sq, Sk} constant.
    defp alibi(c, {b, h, sq, sk}) do
      for(bi <- 0..(b - 1), hi <- 0..(h - 1), i <- 0..(sq - 1), j <- 0..(sk - 1), do: alibi_at(c, bi, hi, i, j) / 1)
      |> Nx.tensor(type: :f64)
      |> Nx.reshape({b, h, sq, sk})
    end

    ## Random cases

    @types [{:f, 32}, {:f, 16}, {:bf, 16}, {:f, 64}]

    @doc """
    A random case: {q, k, v, opts}. Every option appears in some cases; `extras`
    (a sublist of [:key_mask, :bias, :alibi_slopes]) are drawn after the others,
    so a seed gives the same base case with or without them.
    """
    def random_case(seed, types \\ @types, extras \\ []) do
      :rand.seed(:exsss, {seed, 17, 42})
      b = pick([1, 2])
      hkv = pick([1, 2])
      h = hkv * pick([1, 2, 3])
      d = pick([1, 3, 4, 8])
      sq = pick(1..6)
      sk = pick(1..7)
      type = pick(types)

      q = normal({b, sq, h, d}, type)
      k = normal({b, sk, hkv, d}, type)
      v = normal({b, sk, hkv, d}, type)
      causal = pick([true, false])

      opts =
        [causal: causal]
        |> maybe(:scale, fn -> pick([0.05, 0.3, 1.0, 2.5]) end)
        |> maybe(:softcap, fn -> pick([0.0, 0.7, 2.0, 5.0]) end)
        |> maybe(:window_size, fn ->
          {pick([-1, 0, 1, 3]), if(causal, do: pick([-1, 0]), else: pick([-1, 0, 1, 2]))}
        end)
        |> maybe(:kv_len, fn -> Nx.tensor(for(_ <- 1..b, do: pick(0..sk)), type: :s32) end)
        |> maybe(:q_start, fn -> Nx.tensor(for(_ <- 1..b, do: pick(-2..sk)), type: :s32) end)

      dims = %{b: b, h: h, sq: sq, sk: sk, type: type}
      opts = Enum.reduce(extras, opts, fn name, opts -> maybe(opts, name, fn -> extra(name, dims) end) end)
      {q, k, v, opts}
    end

    @doc "A random key mask {b, sk}: random holes, left or right padding, or a hidden row."
    def key_mask(b, sk, pattern \\ nil) do
      rows =
        for _ <- 1..b do
          case pattern || pick([:holes, :left_pad, :right_pad, :none_visible]) do
            :holes -> for _ <- 1..sk, do: pick([0, 1, 1, 2])
            :left_pad -> padded(:left, sk, pick(0..sk))
            :right_pad -> padded(:right, sk, pick(0..sk))
            :none_visible -> List.duplicate(0, sk)
          end
        end

      Nx.tensor(rows, type: pick([:u8, :s32, :s64, :u32]))
    end

    # n visible keys, the padding on the left or the right.
    defp padded(:left, sk, n), do: List.duplicate(0, sk - n) ++ List.duplicate(1, n)
    defp padded(:right, sk, n), do: List.duplicate(1, n) ++ List.duplicate(0, sk - n)

    @doc "A random bias: each dimension of {b, h, sq, sk} 1 or full, normal values."
    def bias(dims, shape \\ nil, type \\ nil) do
      shape = shape || List.to_tuple(for n <- [dims.b, dims.h, dims.sq, dims.sk], do: pick([1, n]))
      type = type || if(dims.type == {:f, 64}, do: {:f, 64}, else: pick([{:f, 32}, {:f, 16}, {:bf, 16}]))
      normal(shape, type)
    end

    @doc "Random ALiBi slopes {h}: ALiBi's geometric ones or uniform in [0, 1)."
    def alibi_slopes(h) do
      slopes =
        if pick([true, false]),
          do: for(i <- 1..h, do: :math.pow(2, -8 * i / h)),
          else: for(_ <- 1..h, do: :rand.uniform())

      Nx.tensor(slopes, type: :f32)
    end

    defp extra(:key_mask, dims), do: key_mask(dims.b, dims.sk)
    defp extra(:bias, dims), do: bias(dims)
    defp extra(:alibi_slopes, dims), do: alibi_slopes(dims.h)

    defp maybe(opts, key, fun), do: if(pick([true, false]), do: Keyword.put(opts, key, fun.()), else: opts)

    defp pick(enum), do: Enum.random(enum)

    @doc "A normal(0, 1.5) tensor of `shape`, rounded to `type`."
    def normal(shape, type) do
      n = Tuple.product(shape)
      Nx.tensor(for(_ <- 1..n, do: :rand.normal() * 1.5), type: :f64) |> Nx.reshape(shape) |> Nx.as_type(type)
    end

    def random_like(t) do
      n = Nx.size(t)
      Nx.tensor(for(_ <- 1..n, do: :rand.normal()), type: :f64) |> Nx.reshape(Nx.shape(t))
    end

    ## Comparison

    @doc "Asserts `actual` is within atol + rtol·|expected| of `expected` (equal infinities match)."
    def assert_close(actual, expected, atol, rtol, label) do
      a = Nx.as_type(actual, :f64)
      e = Nx.as_type(expected, :f64)
      same = Nx.equal(a, e)
      diff = Nx.abs(Nx.subtract(a, e))
      close = Nx.less_equal(diff, Nx.add(atol, Nx.multiply(rtol, Nx.abs(e))))
      ok = Nx.logical_or(same, close) |> Nx.all() |> Nx.to_number()

      if ok != 1 do
        worst = Nx.select(same, 0.0, diff) |> Nx.reduce_max() |> Nx.to_number()

        ExUnit.Assertions.flunk(
          "#{label}: not close (atol #{atol}, rtol #{rtol}); max |diff| #{inspect(worst)}\n" <>
            "actual: #{inspect(a, limit: 20)}\nexpected: #{inspect(e, limit: 20)}"
        )
      end

      if Nx.any(Nx.is_nan(a)) |> Nx.to_number() == 1, do: ExUnit.Assertions.flunk("#{label}: NaN")
      :ok
    end

    @doc "Tolerances {atol, rtol} for o in a type (the reference sees the same rounded inputs)."
    def tol({:f, 64}), do: {1.0e-10, 1.0e-10}
    def tol({:f, 32}), do: {2.0e-5, 2.0e-5}
    def tol({:f, 16}), do: {4.0e-3, 2.0e-3}
    def tol({:bf, 16}), do: {3.0e-2, 1.0e-2}

    ## Gradients

    @doc """
    Asserts that the gradients of a random linear loss through `ExlaRs.attention/4`
    (`with_lse?` false), through both outputs of `attention_with_lse/4` (true) or
    through its lse alone (:lse_only) match autodiff of the naive float64
    reference: with respect to q, k, v and, when opts has a `:bias`, the bias.
    """
    def check_grads(seed, q, k, v, opts, with_lse?) do
      :rand.seed(:exsss, {seed, 5, 9})
      {b, sq, h, _} = Nx.shape(q)
      w = random_like(q)
      w2 = random_like(Nx.iota({b, h, sq}))
      c = config(q, k, opts)
      mask = mask(q, k, opts)
      {bias, opts} = Keyword.pop(opts, :bias)
      inputs = if bias, do: {q, k, v, bias}, else: {q, k, v}

      # with_lse?: false (loss on o), true (on o and lse), :lse_only.
      loss = fn inputs, w, w2 ->
        [q, k, v | bias] = Tuple.to_list(inputs)
        opts = if bias == [], do: opts, else: [bias: hd(bias)] ++ opts

        if with_lse? do
          {o, lse} = ExlaRs.attention_with_lse(q, k, v, opts)
          lse = Nx.select(Nx.is_infinity(lse), 0, lse)
          lse_part = Nx.sum(Nx.multiply(lse, w2))
          if with_lse? == :lse_only, do: lse_part, else: Nx.add(Nx.sum(Nx.multiply(o, w)), lse_part)
        else
          Nx.sum(Nx.multiply(ExlaRs.attention(q, k, v, opts), w))
        end
      end

      ref_loss = fn inputs, w, w2, mask ->
        [q, k, v | bias] = Tuple.to_list(inputs)
        {o, lse} = naive(q, k, v, mask, c, List.first(bias))
        o_part = Nx.sum(Nx.multiply(o, w))
        lse_part = Nx.sum(Nx.multiply(lse, w2))

        case with_lse? do
          false -> o_part
          true -> Nx.add(o_part, lse_part)
          :lse_only -> lse_part
        end
      end

      # kv_len/q_start tensors inside opts are captured, so grad eagerly
      # through the evaluator (Nx.Defn.grad/2 outside jit traces the function).
      got = Nx.Defn.grad(inputs, fn inputs -> loss.(inputs, w, w2) end)

      want =
        Nx.Defn.jit(fn inputs, w, w2, mask -> Nx.Defn.grad(inputs, fn inputs -> ref_loss.(inputs, w, w2, mask) end) end).(
          Nx.Defn.Composite.traverse(inputs, &Nx.as_type(&1, :f64)),
          w,
          w2,
          mask
        )

      # atol is relative to the largest gradient entry: f16/bf16 round the o that
      # the backward reads (as the kernels do) and the results.
      {atol, rtol} =
        case Nx.type(q) do
          {:f, 64} -> {1.0e-9, 1.0e-9}
          {:f, 32} -> {2.0e-5, 1.0e-4}
          {:f, 16} -> {5.0e-3, 1.0e-2}
          {:bf, 16} -> {5.0e-2, 5.0e-2}
        end

      names = [:dq, :dk, :dv, :dbias]

      for {name, g, r, x} <- Enum.zip([names, Tuple.to_list(got), Tuple.to_list(want), Tuple.to_list(inputs)]) do
        atol = atol * max(1.0, r |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number())
        # dbias is rounded once to the bias's type.
        {atol, rtol} = if name == :dbias, do: widen_tol(Nx.type(x), atol, rtol), else: {atol, rtol}
        if {Nx.type(g), Nx.shape(g)} != {Nx.type(x), Nx.shape(x)},
          do: ExUnit.Assertions.flunk("#{name}: got #{inspect(g)} for an input of #{inspect(x)}")

        assert_close(g, r, atol, rtol, "#{name}, seed #{seed} #{inspect(Nx.type(q))} #{inspect(opts)}")
      end

      got
    end

    defp widen_tol({:f, 16}, atol, rtol), do: {max(atol, 1.0e-3), max(rtol, 2.0e-3)}
    defp widen_tol({:bf, 16}, atol, rtol), do: {max(atol, 1.0e-2), max(rtol, 1.0e-2)}
    defp widen_tol(_type, atol, rtol), do: {atol, rtol}

    ## Expressions
    ## Expressions

    @doc """
    The nodes of an Nx.Defn.Expr outside any block's default function:
    %{blocks: [{struct, in_args, out}], ops: %{op => count}}.
    """
    def walk(expr) do
      {_seen, acc} =
        [expr]
        |> Nx.Defn.Composite.flatten_list()
        |> Enum.reduce({MapSet.new(), %{blocks: [], ops: %{}}}, &walk_node/2)

      %{acc | blocks: Enum.reverse(acc.blocks)}
    end

    defp walk_node(%Nx.Tensor{data: %Nx.Defn.Expr{id: id, op: op, args: args}}, {seen, acc}) do
      if MapSet.member?(seen, id) do
        {seen, acc}
      else
        seen = MapSet.put(seen, id)
        acc = update_in(acc.ops[op], &((&1 || 0) + 1))

        case {op, args} do
          {:block, [struct, in_args, out, _fun]} ->
            acc = %{acc | blocks: [{struct, in_args, out} | acc.blocks]}
            Enum.reduce(in_args, {seen, acc}, &walk_node/2)

          _ ->
            Enum.reduce(args, {seen, acc}, &walk_node/2)
        end
      end
    end

    defp walk_node(list, state) when is_list(list), do: Enum.reduce(list, state, &walk_node/2)

    defp walk_node(tuple, state) when is_tuple(tuple),
      do: tuple |> Tuple.to_list() |> Enum.reduce(state, &walk_node/2)

    defp walk_node(_other, state), do: state
  end

  defmodule ExlaRs.NxTest.Assertions do
    @moduledoc false
    import ExUnit.Assertions

    @doc "Asserts `fun` raises an ArgumentError whose message matches `message`."
    def raises(message, fun) do
      error = assert_raise ArgumentError, fun
      assert error.message =~ message
    end
  end
end
