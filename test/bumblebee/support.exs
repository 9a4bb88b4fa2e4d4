# Shared by the test/bumblebee tests (loaded with Code.require_file/2; not a test file itself):
# every Bumblebee 0.7.0 architecture that computes attention, as a tiny random model with
# padded random inputs, and the comparisons the tests make.
unless Code.ensure_loaded?(ExlaRs.BumblebeeTest.Models) do
  defmodule ExlaRs.BumblebeeTest.Models do
    @moduledoc false

    # Text models: 2 blocks, hidden 16, 4 heads of 4, small vocabularies. Masks: a
    # bidirectional encoder's row 0 is right-padded (2 padding tokens), a causal
    # decoder's row 0 left-padded, as Bumblebee's generation pads it.
    @vocab 40
    @text [vocab_size: @vocab, hidden_size: 16, intermediate_size: 32, num_blocks: 2, num_attention_heads: 4, max_positions: 32]
    @seq2seq [
      vocab_size: @vocab,
      hidden_size: 16,
      encoder_num_blocks: 2,
      decoder_num_blocks: 2,
      encoder_num_attention_heads: 4,
      decoder_num_attention_heads: 4,
      encoder_intermediate_size: 32,
      decoder_intermediate_size: 32,
      max_positions: 32
    ]
    @vision [image_size: 8, patch_size: 4, num_channels: 3, hidden_size: 16, intermediate_size: 32, num_blocks: 2, num_attention_heads: 4]

    @doc """
    The architectures: `name`, the spec (`module`, `architecture`, options),
    the inputs (`:encoder`, `:decoder`, `:seq2seq`, or an atom naming a builder
    below), how many attentions the model computes (`attentions`), and whether
    greedy generation applies (`generate`).
    """
    def all do
      [
        text("BERT", Bumblebee.Text.Bert, :for_masked_language_modeling, :encoder, 2, attention_dropout_rate: 0.1),
        text("BERT (causal LM)", Bumblebee.Text.Bert, :for_causal_language_modeling, :decoder, 2, generate: true),
        text("RoBERTa", Bumblebee.Text.Roberta, :for_masked_language_modeling, :encoder, 2),
        text("ALBERT", Bumblebee.Text.Albert, :for_masked_language_modeling, :encoder, 2, embedding_size: 8),
        text("DistilBERT", Bumblebee.Text.Distilbert, :for_masked_language_modeling, :encoder, 2),
        text("MPNet", Bumblebee.Text.MpNet, :for_masked_language_modeling, :encoder, 2, relative_attention_num_buckets: 8),
        text("NomicBERT", Bumblebee.Text.NomicBert, :base, :encoder, 2),
        text("ModernBERT", Bumblebee.Text.ModernBert, :for_masked_language_modeling, :encoder, 2,
          local_attention_window: 2,
          layer_types: [:sliding_attention, :full_attention]
        ),
        text("LayoutLM", Bumblebee.Multimodal.LayoutLm, :for_masked_language_modeling, :layout, 2, max_spatial_positions: 16),
        text("CLIP text", Bumblebee.Text.ClipText, :base, :encoder, 2, projection_size: 8),
        text("GPT-2", Bumblebee.Text.Gpt2, :for_causal_language_modeling, :decoder, 2, generate: true, pad_token_id: 0),
        text("GPT-BigCode", Bumblebee.Text.GptBigCode, :for_causal_language_modeling, :decoder, 2,
          generate: true,
          num_key_value_heads: 1,
          pad_token_id: 0
        ),
        text("GPT-NeoX", Bumblebee.Text.GptNeoX, :for_causal_language_modeling, :decoder, 2,
          generate: true,
          max_positions: nil,
          rotary_embedding_percentage: 0.5
        ),
        text("Llama", Bumblebee.Text.Llama, :for_causal_language_modeling, :decoder, 2, generate: true, num_key_value_heads: 2),
        text("Mistral", Bumblebee.Text.Mistral, :for_causal_language_modeling, :decoder, 2,
          generate: true,
          num_key_value_heads: 2,
          attention_window_size: 2
        ),
        text("Phi", Bumblebee.Text.Phi, :for_causal_language_modeling, :decoder, 2, generate: true),
        # Axon 0.8.1 lacks :gelu_approx_tanh (Bumblebee 0.7's default for these): :gelu.
        text("Phi-3", Bumblebee.Text.Phi3, :for_causal_language_modeling, :decoder, 2,
          generate: true,
          attention_window_size: 3,
          activation: :gelu
        ),
        text("Gemma", Bumblebee.Text.Gemma, :for_causal_language_modeling, :decoder, 2,
          generate: true,
          activation: :gelu,
          attention_head_size: 4,
          num_key_value_heads: 2
        ),
        text("Gemma 3", Bumblebee.Text.Gemma3Text, :for_causal_language_modeling, :decoder, 2,
          generate: true,
          attention_head_size: 4,
          num_key_value_heads: 2,
          attention_window_size: 2,
          layer_types: [:sliding_attention, :full_attention]
        ),
        text("Qwen3 (Qwen2's successor in Bumblebee)", Bumblebee.Text.Qwen3, :for_causal_language_modeling, :decoder, 2,
          generate: true,
          attention_head_size: 4,
          num_key_value_heads: 2
        ),
        text("SmolLM3", Bumblebee.Text.SmolLm3, :for_causal_language_modeling, :decoder, 2, generate: true, num_key_value_heads: 2),
        text("ModernBERT decoder", Bumblebee.Text.ModernBertDecoder, :for_causal_language_modeling, :decoder, 2,
          generate: true,
          local_attention_window: 2,
          layer_types: [:sliding_attention, :full_attention]
        ),
        seq2seq("BART", Bumblebee.Text.Bart, [attention_dropout_rate: 0.1]),
        seq2seq("mBART", Bumblebee.Text.Mbart, []),
        seq2seq("Blenderbot", Bumblebee.Text.Blenderbot, []),
        seq2seq("M2M100", Bumblebee.Text.M2m100, []),
        %{
          name: "T5",
          spec: {Bumblebee.Text.T5, :for_conditional_generation,
           Keyword.drop(@seq2seq, [:max_positions, :encoder_intermediate_size, :decoder_intermediate_size]) ++
             [intermediate_size: 32, attention_head_size: 4, relative_attention_num_buckets: 8, relative_attention_max_distance: 16]},
          inputs: :seq2seq,
          attentions: 6,
          generate: true
        },
        %{
          name: "Whisper",
          spec: {Bumblebee.Audio.Whisper, :for_conditional_generation,
           Keyword.drop(@seq2seq, [:max_positions]) ++ [feature_size: 4, encoder_max_positions: 4, decoder_max_positions: 16]},
          inputs: :audio,
          attentions: 6,
          generate: true
        },
        %{
          name: "BLIP text",
          spec: {Bumblebee.Text.BlipText, :for_causal_language_modeling, @text ++ [encoder_hidden_size: 8]},
          inputs: :blip_text,
          attentions: 4,
          generate: false
        },
        vision("ViT", Bumblebee.Vision.Vit, :for_image_classification, []),
        vision("DeiT", Bumblebee.Vision.Deit, :for_image_classification, []),
        vision("DINOv2", Bumblebee.Vision.DinoV2, :for_image_classification, intermediate_size: nil, intermediate_size_ratio: 2),
        vision("CLIP vision", Bumblebee.Vision.ClipVision, :base, []),
        vision("BLIP vision", Bumblebee.Vision.BlipVision, :base, []),
        %{
          name: "Swin",
          spec:
            {Bumblebee.Vision.Swin, :for_image_classification,
             [image_size: 16, patch_size: 2, num_channels: 3, embedding_size: 8, num_blocks: [2, 1], num_attention_heads: [2, 4], window_size: 4]},
          inputs: :pixels,
          attentions: 3,
          generate: false
        },
        %{name: "CLIP", spec: {Bumblebee.Multimodal.Clip, :base, clip()}, inputs: :clip, attentions: 4, generate: false},
        %{name: "BLIP", spec: {Bumblebee.Multimodal.Blip, :for_conditional_generation, blip()}, inputs: :blip, attentions: 6, generate: false},
        %{
          name: "Stable Diffusion safety checker",
          spec: {Bumblebee.Diffusion.StableDiffusion.SafetyChecker, :base, [clip_spec: clip_spec()]},
          inputs: :safety_checker,
          attentions: 2,
          generate: false,
          # Its outputs are booleans (compared exactly), nothing to differentiate; its
          # CLIP vision attentions get their gradient checked under "CLIP vision".
          grad: false
        },
        %{name: "UNet 2D conditional", spec: {Bumblebee.Diffusion.UNet2DConditional, :base, unet()}, inputs: :unet, attentions: 8, generate: false},
        %{
          name: "ControlNet",
          spec: {Bumblebee.Diffusion.ControlNet, :base, unet() ++ [conditioning_embedding_hidden_sizes: [4, 8]]},
          inputs: :controlnet,
          attentions: 4,
          generate: false
        },
        %{
          name: "VAE KL",
          spec:
            {Bumblebee.Diffusion.VaeKl, :base,
             [sample_size: 4, hidden_sizes: [32, 32], down_block_types: [:down_block, :down_block], up_block_types: [:up_block, :up_block], latent_channels: 2]},
          inputs: :vae,
          attentions: 2,
          generate: false
        }
      ]
    end

    defp text(name, module, architecture, inputs, attentions, opts \\ []) do
      {generate, opts} = Keyword.pop(opts, :generate, false)
      %{name: name, spec: {module, architecture, merge(@text, opts)}, inputs: inputs, attentions: attentions, generate: generate}
    end

    # Encoder self-attention, decoder self- and cross-attention: 2 blocks each.
    defp seq2seq(name, module, opts) do
      %{name: name, spec: {module, :for_conditional_generation, @seq2seq ++ opts}, inputs: :seq2seq, attentions: 6, generate: true}
    end

    defp vision(name, module, architecture, opts) do
      %{name: name, spec: {module, architecture, merge(@vision, opts)}, inputs: :pixels, attentions: 2, generate: false}
    end

    # Common options with the architecture's own; nil drops a common option it does not have.
    defp merge(common, opts), do: common |> Keyword.merge(opts) |> Enum.reject(fn {_key, value} -> is_nil(value) end)

    defp clip_text, do: Bumblebee.configure(Bumblebee.Text.ClipText, @text)
    defp clip_vision, do: Bumblebee.configure(Bumblebee.Vision.ClipVision, @vision)
    defp clip, do: [text_spec: clip_text(), vision_spec: clip_vision(), projection_size: 8]
    defp clip_spec, do: Bumblebee.configure(Bumblebee.Multimodal.Clip, clip())

    defp blip do
      text = Bumblebee.configure(Bumblebee.Text.BlipText, [architecture: :for_causal_language_modeling, encoder_hidden_size: 16] ++ @text)
      vision = Bumblebee.configure(Bumblebee.Vision.BlipVision, @vision)
      [text_spec: text, vision_spec: vision, projection_size: 8]
    end

    defp unet do
      [
        # Bumblebee's transformer blocks in the UNet group-normalise 32 groups.
        sample_size: 4,
        in_channels: 2,
        out_channels: 2,
        hidden_sizes: [32, 32],
        down_block_types: [:cross_attention_down_block, :down_block],
        up_block_types: [:up_block, :cross_attention_up_block],
        depth: 1,
        num_attention_heads: 2,
        cross_attention_size: 8,
        group_norm_num_groups: 8
      ]
    end
  end

  defmodule ExlaRs.BumblebeeTest.Harness do
    @moduledoc false
    import ExUnit.Assertions

    alias ExlaRs.BumblebeeTest.Models

    @batch 2
    @seq 6
    @dec_seq 5

    # The f32 tolerances, per tensor: |a - b| <= atol + rtol * max|b|, on visible
    # entries. Both models compute in f32 and differ only in the order of their sums.
    #
    # Outputs: atol 1e-5, rtol 1e-4.
    #
    # Gradients: the fused backward takes the softmax's row term from the output
    # (dS = P (dP - rowsum(dO o O))) where autodiff sums P dP, so the two round
    # differently, and some parameter gradients are sums of terms that cancel: a
    # key projection's, since a query's key gradients sum to zero; a bias that a
    # normalisation cancels, analytically zero. Their errors scale with the model's
    # gradients, not with their own small values: atol = 1e-5 times the largest
    # gradient entry of the model (f32 sums of tens of terms of that size), rtol
    # 2e-3. A wrong mask, scale or bias shows in the outputs (checked 10x tighter)
    # and is off by O(1) in the large gradients. Measured: docs/bumblebee.md.
    @output_tolerance {1.0e-5, 1.0e-4}
    def output_tolerance, do: @output_tolerance

    @doc "The gradient tolerance for a model whose largest gradient entry is `scale`."
    def gradient_tolerance(scale), do: {1.0e-5 * scale, 2.0e-3}

    @doc "The entry's tiny model: %{model:, params:, spec:} with random params, plus {inputs, masks}."
    def build(%{spec: {module, architecture, opts}, inputs: kind}) do
      spec = Bumblebee.configure(module, [architecture: architecture] ++ opts)
      model = Bumblebee.build_model(spec)
      {inputs, masks} = inputs(kind, spec)
      # The same params on every run: Axon's initializers draw from this seed.
      {init_fn, _predict} = Axon.build(model, seed: 42)
      params = init_fn.(inputs, Axon.ModelState.empty())
      {%{model: model, params: params, spec: spec}, inputs, masks}
    end

    @doc """
    Random inputs for an input kind, and the masks of their sequences: a list of
    `{seq_len, mask {batch, seq_len}}`, used to compare outputs on visible positions.
    """
    def inputs(kind, spec) do
      key = Nx.Random.key(7)

      case kind do
        :encoder ->
          mask = Nx.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
          {%{"input_ids" => ids(key, spec, @seq), "attention_mask" => mask}, [{@seq, mask}]}

        :decoder ->
          mask = Nx.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
          {%{"input_ids" => ids(key, spec, @seq), "attention_mask" => mask}, [{@seq, mask}]}

        :layout ->
          {inputs, masks} = inputs(:encoder, spec)
          # Boxes {x0, y0, x1, y1} with x0 <= x1 and y0 <= y1 (LayoutLM embeds the sizes).
          {corners, _} = Nx.Random.randint(key, 0, spec.max_spatial_positions, shape: {@batch, @seq, 2, 2})
          box = Nx.concatenate([Nx.reduce_min(corners, axes: [2]), Nx.reduce_max(corners, axes: [2])], axis: 2)
          {Map.put(inputs, "bounding_box", box), masks}

        :seq2seq ->
          {inputs, masks} = inputs(:encoder, spec)
          dec = ids(Nx.Random.split(key)[1], spec, @dec_seq)
          {Map.put(inputs, "decoder_input_ids", dec), masks}

        :audio ->
          features = normal(key, {@batch, 8, spec.feature_size})
          {%{"input_features" => features, "decoder_input_ids" => ids(key, spec, @dec_seq)}, []}

        :blip_text ->
          {inputs, masks} = inputs(:decoder, spec)
          {Map.put(inputs, "encoder_hidden_state", normal(key, {@batch, 3, spec.encoder_hidden_size})), masks}

        :pixels ->
          {%{"pixel_values" => pixels(key, spec)}, []}

        :safety_checker ->
          {%{"pixel_values" => pixels(key, spec.clip_spec.vision_spec)}, []}

        :clip ->
          {inputs, masks} = inputs(:encoder, spec.text_spec)
          {Map.put(inputs, "pixel_values", pixels(key, spec.vision_spec)), masks}

        :blip ->
          {text, masks} = inputs(:decoder, spec.text_spec)
          inputs = %{"pixel_values" => pixels(key, spec.vision_spec), "decoder_input_ids" => text["input_ids"], "decoder_attention_mask" => text["attention_mask"]}
          {inputs, masks}

        :unet ->
          {%{"sample" => normal(key, {@batch, spec.sample_size, spec.sample_size, spec.in_channels}), "timestep" => Nx.tensor(10, type: :u32), "encoder_hidden_state" => normal(key, {@batch, 3, spec.cross_attention_size})}, []}

        :controlnet ->
          {inputs, []} = inputs(:unet, spec)
          size = spec.sample_size * 2 ** (length(spec.conditioning_embedding_hidden_sizes) - 1)
          {Map.merge(inputs, %{"conditioning" => normal(key, {@batch, size, size, 3}), "conditioning_scale" => Nx.tensor(1.0)}), []}

        :vae ->
          {%{"sample" => normal(key, {@batch, spec.sample_size, spec.sample_size, spec.in_channels})}, []}
      end
    end

    defp ids(key, spec, len), do: key |> Nx.Random.randint(2, spec.vocab_size, shape: {@batch, len}) |> elem(0)
    defp normal(key, shape), do: key |> Nx.Random.normal(shape: shape) |> elem(0)
    defp pixels(key, spec), do: normal(key, {@batch, spec.image_size, spec.image_size, spec.num_channels})

    @doc "The tensors of a model output, as {path, tensor}."
    def leaves(%Nx.Tensor{} = t, path), do: [{path, t}]
    def leaves(%Axon.None{}, _path), do: []
    def leaves(%{} = map, path), do: Enum.flat_map(Enum.sort(Map.to_list(map)), fn {k, v} -> leaves(v, path ++ [k]) end)
    def leaves(tuple, path) when is_tuple(tuple), do: tuple |> Tuple.to_list() |> Enum.with_index() |> Enum.flat_map(fn {v, i} -> leaves(v, path ++ [i]) end)
    def leaves(_other, _path), do: []

    @doc """
    1 where a leaf's entry belongs to a visible position (its leading dims are
    {batch, seq} of a masked sequence and the mask says so), else every entry.
    """
    def visible(%Nx.Tensor{} = t, masks) do
      shape = Nx.shape(t)

      case Enum.find(masks, fn {len, _} -> tuple_size(shape) >= 2 and elem(shape, 0) == @batch and elem(shape, 1) == len end) do
        nil ->
          Nx.broadcast(1, shape)

        {_len, mask} ->
          extra = Nx.rank(t) - 2
          mask |> Nx.reshape(Tuple.to_list(Nx.shape(mask)) ++ List.duplicate(1, extra) |> List.to_tuple()) |> Nx.broadcast(shape)
      end
    end

    @doc "Asserts each leaf of `got` is within tolerance of `want` on visible entries; returns the max abs diff."
    def assert_close!(got, want, masks, what, {atol, rtol} \\ @output_tolerance) do
      got_leaves = Map.new(leaves(got, []))
      want_leaves = leaves(want, [])
      assert want_leaves != [], "#{what}: no outputs to compare"
      assert Map.keys(got_leaves) |> Enum.sort() == want_leaves |> Enum.map(&elem(&1, 0)) |> Enum.sort()

      Enum.reduce(want_leaves, 0.0, fn {path, w}, worst ->
        g = got_leaves[path]
        assert Nx.shape(g) == Nx.shape(w), "#{what} #{inspect(path)}: shape #{inspect(Nx.shape(g))} != #{inspect(Nx.shape(w))}"
        vis = visible(w, masks)
        diff = Nx.subtract(g, w) |> Nx.abs() |> Nx.multiply(vis)
        bound = w |> Nx.abs() |> Nx.reduce_max() |> Nx.multiply(rtol) |> Nx.add(atol)
        bad = Nx.greater(diff, bound) |> Nx.sum() |> Nx.to_number()
        max = diff |> Nx.reduce_max() |> Nx.to_number()
        assert bad == 0, "#{what} #{inspect(path)}: #{bad} visible entries off by more than #{atol} + #{rtol} * max|ref| (max #{max})"
        max(worst, max)
      end)
    end

    @doc "Outputs of model_info's model (inference mode)."
    def predict(%{model: model, params: params}, inputs, build_opts \\ []) do
      {_init, predict} = Axon.build(model, build_opts)
      predict.(params, inputs)
    end

    @doc """
    Gradients of a loss over the visible outputs with respect to every float
    parameter: sum(leaf * w * visible) over the output leaves, with fixed weights w.
    """
    def grads(%{model: model, params: params}, inputs, masks) do
      {_init, predict} = Axon.build(model)
      # Inputs and masks enter the trace as arguments (a captured tensor cannot).
      visible = Map.new(masks)

      loss = fn data, inputs, visible ->
        out = predict.(%{params | data: data}, inputs)

        out
        |> leaves([])
        |> Enum.filter(fn {_path, t} -> Nx.Type.float?(Nx.type(t)) end)
        |> Enum.map(fn {_path, t} ->
          w = t |> Nx.shape() |> Nx.iota(type: :f32) |> Nx.multiply(0.37) |> Nx.sin()
          t |> Nx.multiply(w) |> Nx.multiply(visible(t, Enum.to_list(visible))) |> Nx.sum()
        end)
        |> Enum.reduce(&Nx.add/2)
      end

      Nx.Defn.jit(fn data, inputs, visible -> Nx.Defn.grad(data, &loss.(&1, inputs, visible)) end).(params.data, inputs, visible)
    end

    @doc "Greedy generation with the KV cache: the token ids."
    def generate(%{model: model, params: params, spec: spec}, inputs) do
      config =
        Bumblebee.configure(Bumblebee.Text.GenerationConfig,
          max_new_tokens: 4,
          pad_token_id: 0,
          bos_token_id: 1,
          eos_token_id: 1,
          decoder_start_token_id: 1,
          forced_token_ids: [],
          strategy: %{type: :greedy_search}
        )

      generate = Bumblebee.Text.Generation.build_generate(model, spec, config)
      generate.(params, Map.put(inputs, "seed", Nx.broadcast(Nx.tensor(0, type: :s64), {@batch})))
    end

    @doc "Flat {path, tensor} pairs of a nested params map."
    def flat_params(%{} = map, prefix \\ []) do
      Enum.flat_map(Enum.sort(Map.to_list(map)), fn
        {k, %Nx.Tensor{} = t} -> [{prefix ++ [k], t}]
        {k, %{} = inner} -> flat_params(inner, prefix ++ [k])
      end)
    end

    def all, do: Models.all()
  end
end
