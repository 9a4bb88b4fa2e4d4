defmodule ExlaRs.Bumblebee.Layer do
  # Bumblebee is optional: the guard sits inside the module, as in ExlaRs.Attention.
  if Code.ensure_loaded?(Bumblebee) do
    @moduledoc false
    # The layer functions `ExlaRs.Bumblebee.swap_attention/2` puts in place of
    # Bumblebee's attention chain: what `Bumblebee.Layers.attention/8` computes,
    # as one `ExlaRs.Attention.attention/4` call. Axon calls them inside its trace
    # with `%Axon.None{}` for an absent optional input.

    @doc """
    The fused attention. Inputs, in order: query, key, value (`{b, s, heads,
    head_dim}`; key/value may have fewer heads), Bumblebee's optional key mask,
    head mask, bias and offset, Bumblebee's own dropped attention weights and
    value, which are read only when the model is built with `output_attentions:
    true` (then the returned weights must be the ones that made the output, so the
    block runs unfused: `opts[:unfused]`, Bumblebee's own output function), and the
    dropout key (a `u32 {2}` in training mode with a rate; otherwise any tensor,
    unread).
    """
    def attention(q, k, v, key_mask, head_mask, bias, offset, weights, value, dropout_key, opts) do
      if opts[:output_attentions] do
        opts[:unfused].(weights, value, [])
      else
        fused(q, k, v, key_mask, head_mask, bias, offset, dropout_key, opts)
      end
    end

    defp fused(q, k, v, key_mask, head_mask, bias, offset, dropout_key, opts) do
      {b, sq, h, d} = Nx.shape(q)
      sk = Nx.axis_size(k, 1)
      {mask_opts, mask_bias} = key_mask(key_mask, {b, h, sq, sk})

      attention_opts =
        [scale: opts[:scale] || default_scale(d), q_start: q_start(offset, b)] ++
          window(opts[:causal], opts[:window_size]) ++
          mask_opts ++
          bias(bias, mask_bias) ++
          dropout(opts, dropout_key)

      q
      |> ExlaRs.Attention.attention(k, v, attention_opts)
      |> head_mask(head_mask)
    end

    # Bumblebee's default scale, 1 / sqrt(head_dim) with the square root rounded to
    # f32 first (it computes it in the query's type, f32 for the models we check).
    defp default_scale(d) do
      <<root::float-32>> = <<:math.sqrt(d)::float-32>>
      1 / root
    end

    # Bumblebee's offset (the KV-cache position, a scalar) is the key position of
    # query 0 for causal and window masks, and 0 without one: our :q_start, whose
    # own default (seq_k - seq_q) would be wrong for a query block at the start.
    defp q_start(%Axon.None{}, b), do: Nx.broadcast(Nx.tensor(0, type: {:s, 32}), {b})

    defp q_start(offset, b) do
      unless Nx.rank(offset) == 0 do
        raise ArgumentError, "ExlaRs.Bumblebee: expected the attention offset to be a scalar, got shape #{inspect(Nx.shape(offset))}"
      end

      offset |> Nx.as_type({:s, 32}) |> Nx.broadcast({b})
    end

    # Bumblebee: a key j is visible from query i when left >= (i + offset - j) >= -right;
    # causal takes right = 0. Our window is the same inequality around q_start.
    defp window(true, nil), do: [causal: true]
    defp window(true, {left, _right}), do: [causal: true, window_size: {left, 0}]
    defp window(_false, nil), do: []
    defp window(_false, {left, right}), do: [window_size: {left, right}]

    # {options, additive mask bias or nil}. A rank-2 mask (or a rank-4 one that
    # is the same for every head and query) is our :key_mask; any other rank-4
    # mask becomes a bias of 0 (visible) and -inf (hidden), which the contract
    # treats like the mask.
    defp key_mask(%Axon.None{}, _full), do: {[], nil}

    defp key_mask(mask, {b, _h, _sq, sk} = full) do
      case Nx.shape(mask) do
        {mb, ^sk} when mb in [1, b] ->
          {[key_mask: mask |> Nx.not_equal(0) |> Nx.broadcast({b, sk})], nil}

        {mb, 1, 1, ^sk} when mb in [1, b] ->
          {[key_mask: mask |> Nx.reshape({mb, sk}) |> Nx.not_equal(0) |> Nx.broadcast({b, sk})], nil}

        {_, _, _, _} = shape ->
          check_broadcast!(shape, full, "key mask")
          hidden = Nx.Constants.neg_infinity({:f, 32})
          {[], Nx.select(Nx.not_equal(mask, 0), Nx.tensor(0.0, type: {:f, 32}), hidden)}

        shape ->
          raise ArgumentError,
                "ExlaRs.Bumblebee: expected the attention key mask to be {batch, kv_seq} = #{inspect({b, sk})} " <>
                  "or rank 4 broadcastable to {batch, heads, seq, kv_seq} = #{inspect(full)}, got #{inspect(shape)}"
      end
    end

    defp bias(%Axon.None{}, nil), do: []
    defp bias(%Axon.None{}, mask_bias), do: [bias: mask_bias]
    defp bias(bias, nil), do: [bias: bias]
    # Bumblebee hides masked entries whatever the bias says; -inf added does that.
    defp bias(bias, mask_bias), do: [bias: Nx.add(bias, Nx.as_type(mask_bias, Nx.type(bias)))]

    defp check_broadcast!(shape, full, what) do
      ok =
        Enum.zip(Tuple.to_list(shape), Tuple.to_list(full))
        |> Enum.all?(fn {n, f} -> n in [1, f] end)

      unless ok do
        raise ArgumentError,
              "ExlaRs.Bumblebee: expected the attention #{what} to be broadcastable to " <>
                "{batch, heads, seq, kv_seq} = #{inspect(full)}, got #{inspect(shape)}"
      end
    end

    # Attention dropout in training mode only, as Axon.dropout (a :train node).
    defp dropout(opts, key) do
      rate = opts[:dropout_rate] || 0.0
      if opts[:mode] == :train and rate > 0, do: [dropout_rate: rate, dropout_key: key], else: []
    end

    # Bumblebee multiplies the softmax weights of head h by head_mask[h]: the
    # output of that head scales by the same factor.
    defp head_mask(o, %Axon.None{}), do: o
    defp head_mask(o, mask), do: Nx.multiply(o, Nx.reshape(mask, {1, 1, :auto, 1}))

    @doc """
    The training-mode dropout key node: `Axon.dropout/2`'s convention (split the
    `"key"` state, draw with one half, keep the other). A :train node, so in
    inference Axon skips it (passing its first input through) and never asks for
    its state: a loaded model's parameters serve the swapped model as they are.
    """
    def dropout_key(_anchor, key, _opts) do
      keys = Nx.Random.split(key)
      %Axon.StatefulOutput{output: keys[1], state: %{"key" => keys[0]}}
    end
  else
    @moduledoc false
  end
end
