defmodule ExlaRs.BumblebeeServingTest do
  # End to end as a Bumblebee user runs it: a real tokenizer.json (byte-level BPE made
  # offline with Hugging Face's tokenizers, scripts/make_test_tokenizer.py), a GPT-2 model,
  # Bumblebee.Text.generation/4 as an Nx.Serving: text in, text out, identical with and
  # without the swap.
  use ExUnit.Case, async: true
  @moduletag :bumblebee
  @moduletag timeout: 300_000

  @tokenizer_dir Path.expand("../data/bumblebee_tokenizer", __DIR__)

  setup_all do
    Nx.default_backend(Nx.BinaryBackend)
    :ok
  end

  test "Nx.Serving text generation gives the same text with the swapped model" do
    {:ok, tokenizer} = Bumblebee.load_tokenizer({:local, @tokenizer_dir}, type: :gpt2)
    vocab = Tokenizers.Tokenizer.get_vocab_size(tokenizer.native_tokenizer)
    assert vocab == 300

    spec =
      Bumblebee.configure(Bumblebee.Text.Gpt2,
        architecture: :for_causal_language_modeling,
        vocab_size: vocab,
        hidden_size: 16,
        num_blocks: 2,
        num_attention_heads: 4,
        max_positions: 64,
        pad_token_id: 0
      )

    model = Bumblebee.build_model(spec)
    {init_fn, _predict} = Axon.build(model, seed: 3)
    template = %{"input_ids" => Nx.template({1, 8}, :u32)}
    params = init_fn.(template, Axon.ModelState.empty())
    model_info = %{model: model, params: params, spec: spec}
    {swapped, report} = ExlaRs.Bumblebee.swap_attention(model_info)
    assert report.swapped == 2

    # "<|endoftext|>" (id 0) ends, pads and starts, as in GPT-2.
    config =
      Bumblebee.configure(Bumblebee.Text.GenerationConfig,
        bos_token_id: 0,
        eos_token_id: 0,
        pad_token_id: 0,
        max_new_tokens: 6,
        strategy: %{type: :greedy_search}
      )

    # A batch of two prompts of different lengths: the shorter one is padded.
    prompts = ["The quick brown fox", "Flash attention computes softmax in tiles"]
    serve = fn info -> info |> Bumblebee.Text.generation(tokenizer, config) |> Nx.Serving.run(prompts) end

    want = serve.(model_info)
    got = serve.(swapped)
    assert [%{results: [%{text: text0}]}, %{results: [%{text: text1}]}] = want
    assert text0 != "" and text1 != ""
    assert got == want
  end
end
