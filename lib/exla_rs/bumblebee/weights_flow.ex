defmodule ExlaRs.Bumblebee.WeightsFlow do
  # Bumblebee is optional: the guard sits inside the module, as in ExlaRs.Attention.
  if Code.ensure_loaded?(Bumblebee) do
    @moduledoc false
    # Where an attention's weights go besides its output, in an Axon graph: a fused
    # chain no longer computes them, so nothing may compute with them, and what
    # only passes them on to the model's outputs is reported.
    #
    # Bumblebee routes the weights to its `attentions` outputs through `append`,
    # `if_present`/`optional` (cross-attention exists only with an encoder state)
    # and output containers, most behind a `global_opt_in(:output_attentions)`.
    # Past that gate the weights exist only when the model is built with
    # `output_attentions: true`, and then the fused layer runs unfused on those
    # very weights, so whatever reads them there reads what made the output. A
    # composite model (BLIP, CLIP) reads its parts' output containers with
    # `Axon.nx` selectors (`& &1.logits`): such a selector carries the weights on
    # only if it selects them, which running it on placeholders tells.

    @plumbing [:append, :optional, :if_present, :container]

    @doc """
    Follows the weights from node `id` (not through the nodes `excluded`) up to
    the `global_opt_in` gates. Returns `{:ok, exposed?}`, where `exposed?` says
    they reach a model output with no gate (the model returns them whatever
    `output_attentions` says), or `{:error, node}` for the first node that
    computes with them.
    """
    def follow(id, excluded, nodes, children) do
      walk([id], %{id => :carries}, [], excluded, nodes, children)
    end

    # `flow`: node id => :carries (its value holds the weights) or :selector (an
    # `Axon.nx` that only picks them out of a container); `reached`: the nodes met
    # before a gate, in order.
    defp walk([], flow, reached, _excluded, nodes, _children) do
      reached = Enum.reverse(reached)

      case Enum.find(reached, &(nodes[&1].op_name not in @plumbing and flow[&1] != :selector)) do
        nil -> {:ok, Enum.any?(reached, &(nodes[&1].op_name == :container))}
        other -> {:error, nodes[other]}
      end
    end

    defp walk([id | rest], flow, reached, excluded, nodes, children) do
      next =
        for child <- Map.get(children, id, []) -- excluded,
            not Map.has_key?(flow, child),
            (how = carries(nodes[child], flow, nodes)) != :no,
            do: {child, how}

      flow = Map.merge(flow, Map.new(next))
      open = for {child, _how} <- next, nodes[child].op_name != :global_opt_in, do: child
      walk(rest ++ open, flow, Enum.reverse(open, reached), excluded, nodes, children)
    end

    # An `Axon.nx` reading one container is a :selector of the weights when, run on
    # the container's structure with a placeholder per input, its result holds the
    # placeholder of an input carrying them, and :no when it selects other inputs.
    # One that does more than select (it fails on placeholders) :carries them: it
    # computes with them. Any other node reading the weights :carries them.
    defp carries(%Axon.Node{op_name: :nx, op: select, parent: [container_id]}, flow, nodes) do
      case nodes[container_id] do
        %Axon.Node{op_name: :container, op: build, parent: parents} ->
          placeholders = Enum.map(Enum.with_index(parents), fn {_parent, i} -> {__MODULE__, i} end)
          wanted = for {parent, i} <- Enum.with_index(parents), Map.has_key?(flow, parent), do: {__MODULE__, i}

          case select_placeholders(build, select, placeholders) do
            {:ok, selected} -> if Enum.any?(wanted, &holds?(selected, &1)), do: :selector, else: :no
            :error -> :carries
          end

        _ ->
          :carries
      end
    end

    defp carries(_node, _flow, _nodes), do: :carries

    defp select_placeholders(build, select, placeholders) do
      structure = apply(build, placeholders ++ [[]])
      {:ok, select.(structure, [])}
    rescue
      _ -> :error
    end

    defp holds?(term, term), do: true
    defp holds?(%_{}, _wanted), do: false
    defp holds?(%{} = map, wanted), do: Enum.any?(map, fn {_k, v} -> holds?(v, wanted) end)
    defp holds?(tuple, wanted) when is_tuple(tuple), do: tuple |> Tuple.to_list() |> holds?(wanted)
    defp holds?(list, wanted) when is_list(list), do: Enum.any?(list, &holds?(&1, wanted))
    defp holds?(_other, _wanted), do: false
  else
    @moduledoc false
  end
end
