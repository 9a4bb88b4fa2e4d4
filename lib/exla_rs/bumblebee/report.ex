defmodule ExlaRs.Bumblebee.Report do
  # Bumblebee is optional: the guard sits inside the module, as in ExlaRs.Attention.
  if Code.ensure_loaded?(Bumblebee) do
    @moduledoc false
    # What ExlaRs.Bumblebee.swap_attention/2 swapped, per kind and feature, and
    # what it left alone.

    @doc """
    The report of `ExlaRs.Bumblebee.swap_attention/2` (see its documentation)
    for the fusable and skipped chains of `ExlaRs.Bumblebee.Graph.attentions/1`.
    """
    def build(fusable, skipped, nodes, gqa?) do
      blocks =
        for chain <- fusable do
          features =
            for {feature, id} <- [key_mask: chain.key_mask, bias: chain.bias, head_mask: chain.head_mask, offset: chain.offset],
                present?(nodes, id),
                do: feature

          features =
            features ++
              if(chain.dropout_rate > 0, do: [:dropout], else: []) ++ if(gqa? and chain.gqa, do: [:gqa], else: [])

          %{name: chain.name, kind: kind(chain), features: features}
        end

      %{
        swapped: length(fusable),
        kinds: Enum.frequencies_by(blocks, & &1.kind),
        features: blocks |> Enum.flat_map(& &1.features) |> Enum.frequencies(),
        blocks: blocks,
        weights_output: for(chain <- fusable, chain.weights_output, do: chain.name),
        skipped: Enum.map(skipped, &%{name: &1.name, reason: &1.problem})
      }
    end

    defp kind(%{causal: true, window_size: nil}), do: :causal
    defp kind(%{causal: true}), do: :causal_sliding_window
    defp kind(%{window_size: nil}), do: :bidirectional
    defp kind(_), do: :sliding_window

    # An optional input is there unless Bumblebee passed `Layers.none()` for it.
    defp present?(nodes, id) do
      case nodes[id] do
        %Axon.Node{op: :optional, parent: [inner]} -> nodes[inner].op_name != :none
        _ -> true
      end
    end
  else
    @moduledoc false
  end
end
