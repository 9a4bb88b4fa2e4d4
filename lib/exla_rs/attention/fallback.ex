defmodule ExlaRs.Attention.Fallback do
  # Nx is optional: the guard sits inside the module, as in ExlaRs.Attention.
  if Code.ensure_loaded?(Nx) do
    @moduledoc """
    The pure-Nx implementation of the flash-attention contract: the default
    functions of the `ExlaRs.Attention.Forward` and `ExlaRs.Attention.Backward`
    blocks, used wherever no native kernel runs (other Nx backends and compilers,
    EXLA clients or configurations our kernels do not cover).

    It materialises the `[B, H, Sq, Sk]` logits, so it takes O(Sq·Sk) memory; the
    fused kernels do not. Numerics follow the kernels: `f16`/`bf16` inputs are
    widened to `f32` before every product and sum (`f64` stays `f64`), the
    softmax subtracts the row maximum of the visible scores, and a row with no
    visible key (or whose visible scores are all `-inf`, from a `-inf` bias)
    yields `lse = -inf` and `o = 0`, never NaN, and no gradient.

    The block's optional operands (`key_mask`, `bias`, `alibi_slopes`,
    `dropout_key`, those the tag says are present, in that order) come after the
    required ones, so the default functions have one arity per number of optional
    operands: `forward/6` to `forward/10`, `backward/9` to `backward/13`.

    With dropout (`has_dropout`), the keep mask `M` is drawn by
    `ExlaRs.Attention.Philox` from the `dropout_key` operand, the contract's
    Philox4x32-10 function of the key and `(b, h, i, j)`; the forward computes
    `(P ⊙ M / (1 - rate)) · v` with `P` and `lse` unchanged, and the backward
    regenerates `M` and returns the gradients of that function.

    Every function here takes already validated arguments (see `ExlaRs.Attention`).
    """

    alias ExlaRs.Attention.{Backward, Forward, Philox}

    # The default functions, one arity per number of optional operands.
    for n <- 0..4 do
      optional = Macro.generate_arguments(n, __MODULE__)

      if n == 0 do
        @doc """
        The forward pass: `{o, lse}` (plus a zero `u8` workspace when the tag has one).

        `q` is `[B, Sq, H, D]`, `k` and `v` are `[B, Sk, Hkv, D]`, `kv_len` and
        `q_start` are `s32[B]`, then the optional operands the tag announces
        (`forward/7` to `forward/10`). `o` is `[B, Sq, H, D]` in the type of `q`,
        `lse` is `f32[B, H, Sq]` (`f64` for `f64` inputs).
        """
      else
        @doc false
      end

      def forward(%Forward{} = tag, q, k, v, kv_len, q_start, unquote_splicing(optional)) do
        forward_pass(tag, q, k, v, kv_len, q_start, ExlaRs.CustomCall.optional_map(tag, unquote(optional)))
      end

      if n == 0 do
        @doc """
        The backward pass: `{dq, dk, dv}`, then `dbias` when the tag's `bias_grad`
        is set (plus a zero `u8` workspace when the tag has one): the gradients of
        `sum(o * do)` with respect to `q`, `k`, `v` and the bias, given the
        forward's own `o` and `lse`, and the forward's optional operands after `do`
        (`backward/10` to `backward/13`).
        """
      else
        @doc false
      end

      def backward(%Backward{} = tag, q, k, v, kv_len, q_start, o, lse, d_o, unquote_splicing(optional)) do
        optional = ExlaRs.CustomCall.optional_map(tag, unquote(optional))
        backward_pass(tag, q, k, v, kv_len, q_start, o, lse, d_o, optional)
      end
    end

    defp forward_pass(tag, q, k, v, kv_len, q_start, optional) do
      {b, sq, h, d} = Nx.shape(q)
      acc = acc_type(Nx.type(q))

      %{z: z, mask: mask} = logits(tag, q, k, kv_len, q_start, optional, acc)

      # Hidden scores become -inf before exp (exp(-inf) = 0): exp never sees a
      # hidden score above the row maximum, so it cannot overflow (and a bias's
      # value at a hidden entry, NaN included, is never read).
      masked = Nx.select(mask, z, Nx.Constants.neg_infinity(acc))
      row_max = Nx.reduce_max(masked, axes: [4], keep_axes: true)
      # A row with no visible key (or only -inf scores) has max -inf; shift it by 0
      # instead (its p is all 0).
      row_max = Nx.select(Nx.is_infinity(row_max), Nx.tensor(0, type: acc), row_max)
      p = Nx.exp(Nx.subtract(masked, row_max))
      l = Nx.sum(p, axes: [4], keep_axes: true)
      # log(0) = -inf: exactly the contract's lse for an empty row.
      lse = Nx.add(Nx.log(l), row_max)

      vf = heads_first(v, acc)
      # Dropout after the normaliser: l (and lse) are the softmax's, only o sees M.
      p_out = tag |> dropout(optional[:dropout_key], Nx.shape(p), acc) |> apply_dropout(p)
      # p [B, Hkv, G, Sq, Sk] . v [B, Hkv, Sk, D] -> [B, Hkv, G, Sq, D]
      o = Nx.dot(p_out, [4], [0, 1], vf, [2], [0, 1])
      o = Nx.divide(o, Nx.select(Nx.greater(l, 0), l, Nx.tensor(1, type: acc)))

      o =
        o
        |> Nx.transpose(axes: [0, 3, 1, 2, 4])
        |> Nx.reshape({b, sq, h, d})
        |> Nx.as_type(Nx.type(q))

      lse = lse |> Nx.reshape({b, h, sq}) |> Nx.as_type(lse_type(Nx.type(q)))

      with_workspace(tag, [o, lse])
    end

    defp backward_pass(tag, q, k, v, kv_len, q_start, o, lse, d_o, optional) do
      {b, sq, h, d} = Nx.shape(q)
      {_, _sk, hkv, _} = Nx.shape(k)
      g = div(h, hkv)
      acc = acc_type(Nx.type(q))
      zero = Nx.tensor(0, type: acc)

      %{s: s, z: z, mask: mask, qf: qf, kf: kf} = logits(tag, q, k, kv_len, q_start, optional, acc)

      lse = lse |> Nx.as_type(acc) |> Nx.reshape({b, hkv, g, sq, 1})
      empty = Nx.is_infinity(lse)
      lse_safe = Nx.select(empty, zero, lse)
      visible = Nx.logical_and(mask, Nx.broadcast(Nx.logical_not(empty), Nx.shape(mask)))
      p = Nx.exp(Nx.subtract(Nx.select(visible, z, Nx.Constants.neg_infinity(acc)), lse_safe))

      dof = groups_first(d_o, hkv, acc)
      of = groups_first(o, hkv, acc)
      vf = heads_first(v, acc)

      # With dropout, o = (p * M * scale) . v: the same mask (regenerated from the
      # key) weighs dv and the do . v term; delta = rowsum(do * o) already holds it.
      # The mask is drawn once and serves both.
      drop = dropout(tag, optional[:dropout_key], Nx.shape(p), acc)
      # p [B, Hkv, G, Sq, Sk] x do [B, Hkv, G, Sq, D] over (G, Sq) -> [B, Hkv, Sk, D]
      dv = Nx.dot(apply_dropout(drop, p), [2, 3], [0, 1], dof, [2, 3], [0, 1]) |> Nx.transpose(axes: [0, 2, 1, 3])
      # do [B, Hkv, G, Sq, D] . v [B, Hkv, Sk, D] -> [B, Hkv, G, Sq, Sk]
      dp = apply_dropout(drop, Nx.dot(dof, [4], [0, 1], vf, [3], [0, 1]))
      # delta = rowsum(do * o): [B, Hkv, G, Sq, 1]
      delta = Nx.multiply(dof, of) |> Nx.sum(axes: [4], keep_axes: true)
      # ds = p * (dp - delta), the gradient with respect to the final score z (the
      # soft-capped logit plus bias and ALiBi): dbias is ds summed over its broadcast.
      ds = Nx.multiply(p, Nx.subtract(dp, delta))

      # Through the soft cap: d(c * tanh(x / c))/dx = 1 - tanh^2 = 1 - (s / c)^2.
      dx =
        if tag.softcap > 0 do
          t = Nx.divide(s, tag.softcap)
          Nx.multiply(ds, Nx.subtract(1, Nx.multiply(t, t)))
        else
          ds
        end

      dx = Nx.multiply(dx, tag.scale)

      # dx [B, Hkv, G, Sq, Sk] . k [B, Hkv, Sk, D] -> [B, Hkv, G, Sq, D]
      dq =
        Nx.dot(dx, [4], [0, 1], kf, [2], [0, 1])
        |> Nx.transpose(axes: [0, 3, 1, 2, 4])
        |> Nx.reshape({b, sq, h, d})

      # dx [B, Hkv, G, Sq, Sk] x q [B, Hkv, G, Sq, D] over (G, Sq) -> [B, Hkv, Sk, D]
      dk = Nx.dot(dx, [2, 3], [0, 1], qf, [2, 3], [0, 1]) |> Nx.transpose(axes: [0, 2, 1, 3])

      dbias = if tag.bias_grad, do: bias_grad(ds, optional.bias)

      with_workspace(tag, [Nx.as_type(dq, Nx.type(q)), Nx.as_type(dk, Nx.type(k)), Nx.as_type(dv, Nx.type(v)), dbias])
    end

    # {keep, 1 / (1 - rate)} for scores of `shape` [B, Hkv, G, Sq, Sk]: keep is the
    # contract's mask of the query heads h = hkv * G + g. nil without dropout: no
    # generator is traced at all.
    defp dropout(%{has_dropout: false}, nil, _shape, _acc), do: nil

    defp dropout(%{has_dropout: true, dropout_rate: rate}, key, {b, hkv, g, sq, sk} = shape, acc) do
      keep = key |> Philox.keep(rate, {b, hkv * g, sq, sk}) |> Nx.reshape(shape)
      {keep, Nx.tensor(Philox.keep_scale(rate, acc), type: acc)}
    end

    # t * M / (1 - rate); a dropped entry is 0 whatever t holds.
    defp apply_dropout(nil, t), do: t
    defp apply_dropout({keep, scale}, t), do: Nx.select(keep, Nx.multiply(t, scale), Nx.tensor(0, type: Nx.type(t)))

    # dbias[bb, hb, ib, jb] = the sum of ds over every (b, h, i, j) reading that
    # entry: ds summed over the bias's broadcast (size-1) dimensions, rounded once
    # to the bias's type. ds is [B, Hkv, G, Sq, Sk] with h = hkv * G + g, so a full
    # head dimension is axes 1 and 2 merged.
    defp bias_grad(ds, bias) do
      {bb, hb, sqb, skb} = Nx.shape(bias)
      axes = for {1, axes} <- [{bb, [0]}, {hb, [1, 2]}, {sqb, [3]}, {skb, [4]}], axis <- axes, do: axis

      ds
      |> Nx.sum(axes: axes, keep_axes: true)
      |> Nx.reshape(Nx.shape(bias))
      |> Nx.as_type(Nx.type(bias))
    end

    @doc false
    # The (scaled, soft-capped) logits s, the final scores z = s + bias + ALiBi
    # and the visibility mask, all [B, Hkv, G, Sq, Sk]; query head h = hkv * G + g
    # reads kv head hkv. `optional` holds the present optional operands by name.
    def logits(tag, q, k, kv_len, q_start, optional, acc) do
      {b, sq, _h, _d} = Nx.shape(q)
      {_, sk, hkv, _} = Nx.shape(k)

      qf = groups_first(q, hkv, acc)
      kf = heads_first(k, acc)

      # q [B, Hkv, G, Sq, D] . k [B, Hkv, Sk, D] -> [B, Hkv, G, Sq, Sk]
      x = Nx.dot(qf, [4], [0, 1], kf, [3], [0, 1]) |> Nx.multiply(tag.scale)

      s =
        if tag.softcap > 0 do
          Nx.multiply(Nx.tanh(Nx.divide(x, tag.softcap)), tag.softcap)
        else
          x
        end

      # The bias and ALiBi come after scale and softcap: the cap never touches them.
      z =
        s
        |> add_bias(optional[:bias], hkv, acc)
        |> add_alibi(optional[:alibi_slopes], q_start, hkv, acc)

      # Nx.select takes its shape from the predicate: give the mask the scores' shape.
      mask =
        tag
        |> mask(kv_len, q_start, b, sq, sk)
        |> and_key_mask(optional[:key_mask])
        |> Nx.broadcast(Nx.shape(x))

      %{s: s, z: z, qf: qf, kf: kf, mask: mask}
    end

    # bias [Bb, Hb, Sqb, Skb], each dimension 1 or full, read in the accumulation
    # type; a full head dimension splits as (Hkv, G) like the scores' heads.
    defp add_bias(s, nil, _hkv, _acc), do: s

    defp add_bias(s, bias, hkv, acc) do
      {bb, hb, sqb, skb} = Nx.shape(bias)
      heads = if hb == 1, do: [1, 1], else: [hkv, div(hb, hkv)]
      bias = bias |> Nx.as_type(acc) |> Nx.reshape(List.to_tuple([bb | heads] ++ [sqb, skb]))
      Nx.add(s, bias)
    end

    # -slope[h] * |q_start[b] + i - j|: the distance in s64, the product in the
    # accumulation type (f32 for the kernels' types, as the contract says).
    defp add_alibi(s, nil, _q_start, _hkv, _acc), do: s

    defp add_alibi(s, slopes, q_start, hkv, acc) do
      {b, _hkv, g, sq, sk} = Nx.shape(s)
      i = Nx.iota({1, sq, 1}, axis: 1, type: {:s, 64})
      j = Nx.iota({1, 1, sk}, axis: 2, type: {:s, 64})
      pos = q_start |> Nx.as_type({:s, 64}) |> Nx.reshape({b, 1, 1}) |> Nx.add(i)
      distance = pos |> Nx.subtract(j) |> Nx.abs() |> Nx.as_type(acc) |> Nx.reshape({b, 1, 1, sq, sk})
      slopes = slopes |> Nx.as_type(acc) |> Nx.reshape({1, hkv, g, 1, 1})
      Nx.subtract(s, Nx.multiply(slopes, distance))
    end

    # key_mask [B, Sk]: nonzero = visible to every query of that batch row.
    defp and_key_mask(visible, nil), do: visible

    defp and_key_mask(visible, key_mask) do
      {b, sk} = Nx.shape(key_mask)
      Nx.logical_and(visible, key_mask |> Nx.not_equal(0) |> Nx.reshape({b, 1, 1, 1, sk}))
    end

    @doc false
    # visible(i, j) <=> j < kv_len[b] and (wl < 0 or j >= q_start[b] + i - wl)
    #                                  and (wr < 0 or j <= q_start[b] + i + wr)
    # In s64 so that no window or position can overflow.
    def mask(tag, kv_len, q_start, b, sq, sk) do
      i = Nx.iota({1, sq, 1}, axis: 1, type: {:s, 64})
      j = Nx.iota({1, 1, sk}, axis: 2, type: {:s, 64})
      kv_len = kv_len |> Nx.as_type({:s, 64}) |> Nx.reshape({b, 1, 1})
      pos = q_start |> Nx.as_type({:s, 64}) |> Nx.reshape({b, 1, 1}) |> Nx.add(i)

      visible = Nx.broadcast(Nx.less(j, kv_len), {b, sq, sk})

      visible =
        if tag.window_left >= 0,
          do: Nx.logical_and(visible, Nx.greater_equal(j, Nx.subtract(pos, tag.window_left))),
          else: visible

      visible =
        if tag.window_right >= 0,
          do: Nx.logical_and(visible, Nx.less_equal(j, Nx.add(pos, tag.window_right))),
          else: visible

      Nx.reshape(visible, {b, 1, 1, sq, sk})
    end

    # [B, S, Hkv, D] -> [B, Hkv, S, D] (Nx.dot wants the batch axes leading)
    defp heads_first(t, acc), do: t |> Nx.as_type(acc) |> Nx.transpose(axes: [0, 2, 1, 3])

    # [B, S, H, D] -> [B, Hkv, G, S, D] with h = hkv * G + g
    defp groups_first(t, hkv, acc) do
      {b, s, h, d} = Nx.shape(t)

      t
      |> Nx.as_type(acc)
      |> Nx.reshape({b, s, hkv, div(h, hkv), d})
      |> Nx.transpose(axes: [0, 2, 3, 1, 4])
    end

    # Accumulation in f32 (f64 for f64 inputs); lse is returned in that type too.
    defp acc_type({:f, 64}), do: {:f, 64}
    defp acc_type(_), do: {:f, 32}

    @doc false
    def lse_type(type), do: acc_type(type)

    # The block's results with its workspace (zero bytes: XLA drops what nothing reads).
    defp with_workspace(tag, results) do
      ExlaRs.CustomCall.block_results(tag, results, &Nx.broadcast(Nx.tensor(0, type: {:u, 8}), {&1}))
    end
  else
    @moduledoc false
  end
end
