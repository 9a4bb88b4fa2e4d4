defmodule ExlaRs.Bumblebee.Graph do
  # Bumblebee is optional: the guard sits inside the module, as in ExlaRs.Attention.
  if Code.ensure_loaded?(Bumblebee) do
    @moduledoc false
    # Finds the attentions `Bumblebee.Layers.attention/8` built in an Axon graph and
    # says, for each, whether and how it can be fused. Reads the graph only.
    #
    # Bumblebee 0.7's chain is three unnamed nodes:
    #
    #     weights = attention_weights_impl(query, key, optional(key_mask),
    #                 optional(head_mask), optional(bias), optional(offset))
    #     dropped = dropout(weights)                       # Axon.dropout, :train only
    #     output  = attention_output_impl(dropped, value)
    #
    # and `dropped` is also appended to the model's `attentions` output. Nodes are
    # recognised by their function (module Bumblebee.Layers and its name), which
    # is what identifies them: all three share op_name :custom or :dropout with
    # every other layer of their kind.

    @doc """
    The attention chains of `model`, in graph order: a list of maps with the
    output node's `:id`, the node ids `:query`, `:key`, `:value`, `:key_mask`,
    `:head_mask`, `:bias`, `:offset` (the optional ones as Bumblebee's
    `Axon.optional` wrappers), `:weights` and `:dropped`, the options
    (`:causal`, `:window_size`, `:scale`, `:dropout_rate`), a `:name` (the block
    the attention belongs to, from its output projection, or nil), `:gqa` (the
    key/value node ids before Bumblebee's `repeat_interleave`, or nil),
    `:weights_output` (whether the model returns the weights whatever
    `output_attentions` says) and `:problem` (nil, or why the chain cannot be
    fused).
    """
    def attentions(%Axon{nodes: nodes} = model) do
      children = children(nodes)

      model
      |> Axon.reduce_nodes([], fn node, acc ->
        if bumblebee_fun?(node.op, :attention_output_impl), do: [chain(node, nodes, children) | acc], else: acc
      end)
      |> Enum.reverse()
    end

    defp chain(%Axon.Node{id: id, parent: [dropped_id, value_id], opts: out_opts}, nodes, children) do
      base = %{id: id, value: value_id, dropped: dropped_id, name: block_name(id, nodes, children)}

      with {:ok, weights} <- weights_node(nodes[dropped_id], nodes),
           [query, key, key_mask, head_mask, bias, offset] <- weights.parent,
           {:ok, dropped_out?} <- weights_flow(dropped_id, id, nodes, children),
           {:ok, weights_out?} <- weights_flow(weights.id, dropped_id, nodes, children),
           {:ok, window} <- window(weights.opts[:window_size]),
           {:ok, scale} <- scale(weights.opts[:scale]),
           {:ok, rate} <- rate(out_opts[:dropout_rate]) do
        Map.merge(base, %{
          weights: weights.id,
          query: query,
          key: key,
          key_mask: key_mask,
          head_mask: head_mask,
          bias: bias,
          offset: offset,
          causal: weights.opts[:causal] == true,
          window_size: window,
          scale: scale,
          dropout_rate: rate,
          gqa: unrepeated(key, value_id, nodes),
          weights_output: dropped_out? or weights_out?,
          problem: nil
        })
      else
        {:error, why} -> Map.put(base, :problem, why)
        _parents -> Map.put(base, :problem, "its attention weights node does not have Bumblebee 0.7's six inputs")
      end
    end

    # The dropout between weights and output (rate 0 included: Axon.dropout adds
    # the node whatever the rate), then the weights node behind it.
    defp weights_node(%Axon.Node{op: :dropout, parent: [weights_id]}, nodes) do
      weights = nodes[weights_id]

      if bumblebee_fun?(weights.op, :attention_weights_impl),
        do: {:ok, weights},
        else: {:error, "the node before its dropout is not Bumblebee's attention weights"}
    end

    defp weights_node(_node, _nodes),
      do: {:error, "its attention weights do not reach the output through Axon.dropout"}

    # The attention weights may feed only the fused chain and the model's
    # `attentions` outputs (WeightsFlow says where they go).
    defp weights_flow(from_id, through_id, nodes, children) do
      case ExlaRs.Bumblebee.WeightsFlow.follow(from_id, [through_id], nodes, children) do
        {:ok, exposed?} ->
          {:ok, exposed?}

        {:error, reader} ->
          {:error, "its attention weights are used by another layer (#{describe(reader)}), not only by the attention output"}
      end
    end

    defp window(nil), do: {:ok, nil}
    defp window({l, r}) when is_integer(l) and is_integer(r) and l >= 0 and r >= 0, do: {:ok, {l, r}}
    defp window(other), do: {:error, "window_size #{inspect(other)} is not {left, right} of non-negative integers"}

    defp scale(nil), do: {:ok, nil}
    defp scale(s) when is_number(s), do: {:ok, s}
    defp scale(other), do: {:error, "scale #{inspect(other)} is not a number"}

    defp rate(nil), do: {:ok, 0.0}
    defp rate(r) when is_number(r) and r >= 0 and r < 1, do: {:ok, r / 1}
    defp rate(other), do: {:error, "dropout rate #{inspect(other)} is not a number in [0, 1)"}

    # {key, value} ids before Bumblebee's repeat_interleave (grouped-query heads),
    # or nil when the heads are not repeated here. Bumblebee repeats before its KV
    # cache, so a decoder's key is `if_present(cache, cached_key, repeated_key)`:
    # then only the cache-less branch (prefill, training, encoders) can skip the
    # repeat, and the returned ids are {:if_present, node id, unrepeated id}.
    defp unrepeated(key_id, value_id, nodes) do
      with {:ok, k} <- unrepeat(nodes[key_id], nodes),
           {:ok, v} <- unrepeat(nodes[value_id], nodes) do
        {k, v}
      else
        _ -> nil
      end
    end

    defp unrepeat(%Axon.Node{} = node, nodes) do
      cond do
        bumblebee_fun?(node.op, :repeat_interleave) ->
          {:ok, {:direct, hd(node.parent)}}

        node.op_name == :if_present ->
          with [_condition, _on_true, on_false] <- node.parent,
               %Axon.Node{op: :optional, parent: [inner]} <- nodes[on_false],
               {:ok, {:direct, source}} <- unrepeat(nodes[inner], nodes) do
            {:ok, {:if_present, node.id, source}}
          else
            _ -> :error
          end

        true ->
          :error
      end
    end

    @doc """
    The block an attention belongs to, from the output projection that consumes it
    (Bumblebee names it `<block>.output`, through `flatten_trailing`), or nil.
    """
    def block_name(id, nodes, children) do
      with [flat] <- Map.get(children, id, []),
           [dense] <- Map.get(children, flat, []),
           name when is_binary(name) <- static_name(nodes[dense]),
           true <- String.ends_with?(name, ".output") do
        String.replace_suffix(name, ".output", "")
      else
        _ -> nil
      end
    end

    # A node's name when it was given one (Axon generates the others from counts
    # at build time: calling their name function here would invent a name).
    defp static_name(%Axon.Node{name: name_fn, op_name: op_name}) when is_function(name_fn, 2) do
      a = name_fn.(op_name, %{})
      b = name_fn.(op_name, %{op_name => 7})
      if a == b, do: a
    end

    defp static_name(_), do: nil

    defp describe(%Axon.Node{} = node), do: static_name(node) || "an unnamed #{inspect(node.op_name)} layer"

    @doc "Parent id => child ids, over every node of the map."
    def children(nodes) do
      Enum.reduce(nodes, %{}, fn {id, %Axon.Node{parent: parents}}, acc ->
        Enum.reduce(parents, acc, fn p, acc -> Map.update(acc, p, [id], &[id | &1]) end)
      end)
    end

    @doc "Whether `op` is the Bumblebee.Layers function `name` (a named or anonymous one)."
    def bumblebee_fun?(op, name) when is_function(op) do
      case Function.info(op, :module) do
        {:module, Bumblebee.Layers} ->
          {:name, fun} = Function.info(op, :name)
          fun == name or String.starts_with?(Atom.to_string(fun), "-#{name}/")

        _ ->
          false
      end
    end

    def bumblebee_fun?(_op, _name), do: false
  else
    @moduledoc false
  end
end
