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

    @doc "Resolved options: the same defaults the contract gives, as plain values."
    def config(q, k, opts) do
      {b, sq, _h, d} = Nx.shape(q)
      {_, sk, _hkv, _} = Nx.shape(k)
      causal = Keyword.get(opts, :causal, false)
      {left, right} = Keyword.get(opts, :window_size, {-1, -1})
      right = if causal, do: 0, else: right

      %{
        scale: f32(Keyword.get(opts, :scale, 1 / :math.sqrt(d))),
        softcap: f32(Keyword.get(opts, :softcap, 0.0)),
        left: left,
        right: right,
        kv_len: rows(opts[:kv_len], b, sk),
        q_start: rows(opts[:q_start], b, sk - sq)
      }
    end

    defp rows(nil, b, default), do: List.duplicate(default, b)
    defp rows(t, _b, _default), do: Nx.to_flat_list(t)

    def visible?(c, b, i, j) do
      qs = Enum.at(c.q_start, b)

      j < Enum.at(c.kv_len, b) and (c.left < 0 or j >= qs + i - c.left) and
        (c.right < 0 or j <= qs + i + c.right)
    end

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

          scores =
            for j <- 0..(sk - 1), visible?(c, bi, i, j) do
              kv = kl |> Enum.at(bi) |> Enum.at(j) |> Enum.at(kh)
              x = c.scale * dot(qv, kv)
              s = if c.softcap > 0, do: c.softcap * :math.tanh(x / c.softcap), else: x
              {j, s}
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
    sees nothing, o is 0 there). `mask` from mask/3, `c` from config/3.
    """
    def naive(q, k, v, mask, c) do
      {_b, _sq, h, _d} = Nx.shape(q)
      {_, _sk, hkv, _} = Nx.shape(k)
      g = div(h, hkv)
      heads = Nx.tensor(for(hi <- 0..(h - 1), do: div(hi, g)))
      q = q |> Nx.as_type(:f64) |> Nx.transpose(axes: [0, 2, 1, 3])
      k = k |> Nx.as_type(:f64) |> Nx.take(heads, axis: 2) |> Nx.transpose(axes: [0, 2, 1, 3])
      v = v |> Nx.as_type(:f64) |> Nx.take(heads, axis: 2) |> Nx.transpose(axes: [0, 2, 1, 3])

      x = Nx.dot(q, [3], [0, 1], k, [3], [0, 1]) |> Nx.multiply(c.scale)
      s = if c.softcap > 0, do: Nx.multiply(Nx.tanh(Nx.divide(x, c.softcap)), c.softcap), else: x
      mask = Nx.broadcast(mask, Nx.shape(s))
      s = Nx.select(mask, s, -1.0e30)
      m = s |> Nx.reduce_max(axes: [3], keep_axes: true) |> Nx.Defn.Kernel.stop_grad()
      e = Nx.multiply(Nx.exp(Nx.subtract(s, m)), mask)
      l = Nx.sum(e, axes: [3], keep_axes: true)
      any = Nx.greater(l, 0)
      l1 = Nx.select(any, l, 1.0)
      o = Nx.dot(Nx.divide(e, l1), [3], [0, 1], v, [2], [0, 1]) |> Nx.transpose(axes: [0, 2, 1, 3])
      lse = Nx.select(any, Nx.add(Nx.log(l1), m), 0.0) |> Nx.squeeze(axes: [3])
      {o, lse}
    end

    ## Random cases

    @types [{:f, 32}, {:f, 16}, {:bf, 16}, {:f, 64}]

    @doc "A random case: {q, k, v, opts}. Every option appears in some cases."
    def random_case(seed, types \\ @types) do
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

      {q, k, v, opts}
    end

    defp maybe(opts, key, fun), do: if(pick([true, false]), do: Keyword.put(opts, key, fun.()), else: opts)

    defp pick(enum), do: Enum.random(enum)

    defp normal(shape, type) do
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
end
