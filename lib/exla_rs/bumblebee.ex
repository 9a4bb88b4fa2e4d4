defmodule ExlaRs.Bumblebee do
  # Bumblebee is optional: the guard sits inside the module, which always exists, so Mix
  # recompiles this file when Bumblebee joins a project later (see DEVELOPERS.md).
  if Code.ensure_loaded?(Bumblebee) do
    @moduledoc """
    Bumblebee models on `ExlaRs.attention/4`, in one call.

        {:ok, model_info} = Bumblebee.load_model({:hf, "google-bert/bert-base-uncased"})
        {model_info, report} = ExlaRs.Bumblebee.swap_attention(model_info)

    `swap_attention/2` rewrites every attention that `Bumblebee.Layers.attention/8`
    built (Bumblebee's weights, dropout, output chain) into one fused
    `ExlaRs.attention/4` layer computing the same function: the scale, causal and
    sliding-window masks (Bumblebee's window: `left >= i + offset - j >= -right`),
    the KV-cache offset, the key mask (`{batch, kv_seq}`, or rank 4), the additive
    bias (T5's relative position bias included), the head mask, and attention
    dropout in training mode (the contract's Philox mask instead of Axon's).
    Grouped-query models (Llama, Mistral, ...) pass their key/value heads without
    Bumblebee's repeat, except through the KV cache, which Bumblebee stores
    repeated. The parameters and every other layer stay as they are, so the
    loaded `model_info.params` serve the swapped model.

    See the guide `docs/bumblebee.md` for serving, fine-tuning and the semantics
    notes (a query that sees no key gets 0 here, Bumblebee's mean of V there).
    """

    alias ExlaRs.Bumblebee.{Graph, Report, Rewrite}

    @typedoc "What `swap_attention/2` did."
    @type report :: %{
            swapped: non_neg_integer(),
            kinds: %{atom() => non_neg_integer()},
            features: %{atom() => non_neg_integer()},
            blocks: [%{name: String.t() | nil, kind: atom(), features: [atom()]}],
            weights_output: [String.t() | nil],
            skipped: [%{name: String.t() | nil, reason: String.t()}]
          }

    @doc """
    Rewrites the attentions of a Bumblebee model (the `model_info` map that
    `Bumblebee.load_model/2` returns, or its `%Axon{}` model) into `ExlaRs.attention/4`
    calls. Returns `{swapped, report}`: `swapped` is of the kind given (the map
    with its `:model` replaced), and `report` says what was swapped:

      * `:swapped` - the number of attentions fused;
      * `:kinds` - how many of each kind: `:bidirectional`, `:causal`,
        `:sliding_window`, `:causal_sliding_window`;
      * `:features` - how many take each input or option: `:key_mask`, `:bias`,
        `:head_mask`, `:offset` (KV cache), `:dropout` (rate > 0), `:gqa` (key and
        value passed with their own, fewer heads);
      * `:blocks` - per fused attention, its block name (from Bumblebee's layer
        names, e.g. `"decoder.blocks.0.self_attention"`), kind and features;
      * `:weights_output` - the swapped attentions whose weights the model returns
        whatever `output_attentions` says (Bumblebee's encoder-decoders return
        `encoder_attentions`, `decoder_attentions` and `cross_attentions`
        ungated): Bumblebee's layers still compute those weights for that output,
        next to the fused attention (in training mode with dropout, their dropout
        mask is Axon's, not the one the fused output used);
      * `:skipped` - the attentions left as they were, with the reason.

    An attention is left alone (and listed in `:skipped`) when its weights feed
    anything besides its output and the model's `attentions` output, or when its
    options are not Bumblebee's. The model's outputs never change silently.

    When the swapped model is built with `global_layer_options: [output_attentions:
    true]`, each block computes its attention as Bumblebee does (the weights are
    materialised for the output anyway, and the output must come from those very
    weights, dropout mask included).

    ## Options

      * `:gqa` - pass grouped key/value heads to the kernel without Bumblebee's
        `repeat_interleave` where the graph allows (default `true`).
      * `:seed` - integer seed of the dropout keys (each swapped attention with a
        dropout rate keeps one, as `Axon.dropout/2` does; the `i`-th gets
        `Nx.Random.key(seed + i)`). Defaults to `:erlang.system_time/0`.
      * `:strict` - raise `ArgumentError` if any attention is left alone
        (default `false`).
    """
    @spec swap_attention(map() | Axon.t(), keyword()) :: {map() | Axon.t(), report()}
    def swap_attention(model_info_or_axon, opts \\ [])

    def swap_attention(%Axon{} = model, opts) do
      opts = options!(opts)
      chains = Graph.attentions(model)
      {fusable, skipped} = Enum.split_with(chains, &is_nil(&1.problem))

      report = Report.build(fusable, skipped, model.nodes, opts[:gqa])

      if opts[:strict] and skipped != [] do
        raise ArgumentError,
              "ExlaRs.Bumblebee.swap_attention/2 (strict: true): #{length(skipped)} attention(s) left unfused: " <>
                Enum.map_join(report.skipped, "; ", &"#{&1.name || "unnamed"}: #{&1.reason}")
      end

      plans =
        fusable
        |> Enum.with_index()
        |> Map.new(fn {chain, i} -> {chain.id, Map.put(chain, :seed, opts[:seed] + i)} end)

      swapped =
        Axon.rewrite_nodes(model, fn %Axon.Node{id: id} ->
          case plans do
            # Built on the graph as rewritten so far (rewrite_nodes takes the map we return).
            %{^id => plan} -> fn [dropped, _value], _output -> Rewrite.fused(plan, dropped.nodes, opts[:gqa]) end
            _ -> :skip
          end
        end)

      {swapped, report}
    end

    def swap_attention(%{model: %Axon{} = model} = model_info, opts) do
      {swapped, report} = swap_attention(model, opts)
      {%{model_info | model: swapped}, report}
    end

    def swap_attention(other, _opts) do
      raise ArgumentError,
            "ExlaRs.Bumblebee.swap_attention/2: expected a Bumblebee model_info (a map with :model, " <>
              "as Bumblebee.load_model/2 returns) or an %Axon{} model, got: #{inspect(other, limit: 5)}"
    end

    defp options!(opts) do
      fun = "ExlaRs.Bumblebee.swap_attention/2"

      unless Keyword.keyword?(opts) do
        raise ArgumentError, "#{fun}: expected opts to be a keyword list, got: #{inspect(opts)}"
      end

      case Keyword.keys(opts) -- [:gqa, :seed, :strict] do
        [] -> :ok
        unknown -> raise ArgumentError, "#{fun}: unknown options #{inspect(unknown)}, expected :gqa, :seed or :strict"
      end

      opts = Keyword.merge([gqa: true, strict: false], opts)
      opts = Keyword.put_new_lazy(opts, :seed, fn -> :erlang.system_time() end)

      for key <- [:gqa, :strict], not is_boolean(opts[key]) do
        raise ArgumentError, "#{fun}: expected #{inspect(key)} to be a boolean, got: #{inspect(opts[key])}"
      end

      unless is_integer(opts[:seed]) do
        raise ArgumentError, "#{fun}: expected :seed to be an integer, got: #{inspect(opts[:seed])}"
      end

      opts
    end

  else
    @moduledoc false
  end
end
