defmodule ExlaRs.Bumblebee.Rewrite do
  # Bumblebee is optional: the guard sits inside the module, as in ExlaRs.Attention.
  if Code.ensure_loaded?(Bumblebee) do
    @moduledoc false
    # Builds the Axon layers that take the place of one Bumblebee attention chain:
    # the fused layer (ExlaRs.Bumblebee.Layer.attention/11), its training-mode
    # dropout key, and for grouped-query heads the key/value before the repeat.

    alias ExlaRs.Bumblebee.Layer

    @doc """
    The fused layer for one chain of `ExlaRs.Bumblebee.Graph.attentions/1`
    (plus its dropout `:seed`), built on the graph `nodes`. Its policy and hooks
    are the original output layer's, so mixed precision applied before the swap
    still holds.
    """
    def fused(plan, nodes, gqa?) do
      at = fn id -> %Axon{output: id, nodes: nodes} end
      query = at.(plan.query)

      {key, value} =
        case gqa? && plan.gqa do
          {k, v} -> {ungrouped(k, nodes), ungrouped(v, nodes)}
          _ -> {at.(plan.key), at.(plan.value)}
        end

      dropout_key =
        if plan.dropout_rate > 0 do
          state =
            Axon.param("key", {2},
              type: {:u, 32},
              initializer: fn _, _ -> Nx.Random.key(plan.seed) end,
              kind: :state
            )

          Axon.layer(&Layer.dropout_key/3, [query, state],
            name: plan.name && plan.name <> ".fused_attention_dropout",
            op_name: :exla_rs_attention_dropout_key,
            mode: :train
          )
        else
          query
        end

      original = nodes[plan.id]

      # The dropout key comes last: Axon 0.8 threads the training state through a
      # layer's inputs in order, and an input it has already computed elsewhere (all
      # the others here) hands back the state of that earlier computation, dropping
      # what the inputs before it added. Last, the key's new state survives this layer.
      inputs =
        [query, key, value] ++
          Enum.map([plan.key_mask, plan.head_mask, plan.bias, plan.offset], at) ++
          [at.(plan.dropped), at.(plan.value), dropout_key]

      %Axon{output: id} =
        layer =
        Axon.layer(&Layer.attention/11, inputs,
          name: plan.name && plan.name <> ".fused_attention",
          op_name: :exla_rs_attention,
          global_options: [:output_attentions],
          causal: plan.causal,
          window_size: plan.window_size,
          scale: plan.scale,
          dropout_rate: plan.dropout_rate,
          unfused: original.op
        )

      update_in(layer.nodes[id], &%{&1 | policy: original.policy, hooks: original.hooks})
    end

    # The key or value before Bumblebee's repeat: the repeat's input, or (behind a KV
    # cache) an `if_present` that takes the cache when there is one and the unrepeated
    # heads otherwise, with Bumblebee's own if_present function.
    defp ungrouped({:direct, source}, nodes), do: %Axon{output: source, nodes: nodes}

    defp ungrouped({:if_present, id, source}, nodes) do
      %Axon.Node{op: op, parent: [condition, on_true, _on_false]} = nodes[id]
      at = fn id -> %Axon{output: id, nodes: nodes} end
      Axon.layer(op, [at.(condition), at.(on_true), Axon.optional(at.(source))], op_name: :if_present)
    end
  else
    @moduledoc false
  end
end
