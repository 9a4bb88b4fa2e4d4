defmodule ExlaRs.BumblebeeTrainingTest do
  # Fine-tuning a swapped Bumblebee model: attention dropout in training mode draws the
  # contract's Philox mask (checked against Bumblebee's own model with that mask put in
  # place of Axon.dropout's), and an Axon.Loop.trainer run with dropout > 0 trains.
  use ExUnit.Case, async: true
  @moduletag :bumblebee
  @moduletag timeout: 600_000
  # Axon warns about the state keys one model's params hold and the other's lack.
  @moduletag :capture_log

  alias ExlaRs.Attention.Philox
  alias ExlaRs.Bumblebee.Graph

  @rate 0.5

  setup_all do
    Nx.default_backend(Nx.BinaryBackend)
    :ok
  end

  defp spec(architecture, opts \\ []) do
    Bumblebee.configure(
      Bumblebee.Text.Bert,
      [
        architecture: architecture,
        vocab_size: 30,
        hidden_size: 16,
        intermediate_size: 32,
        num_blocks: 2,
        num_attention_heads: 4,
        max_positions: 16,
        # Only attention dropout: the rest of the model is deterministic.
        dropout_rate: 0.0,
        attention_dropout_rate: @rate
      ] ++ opts
    )
  end

  @inputs %{
    "input_ids" => Nx.tensor([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]]),
    "attention_mask" => Nx.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
  }

  # Bumblebee's model with each attention's Axon.dropout drawing the contract's mask
  # instead, from its own "key" state split the way Axon.dropout splits it.
  defp with_philox_dropout(model) do
    nodes = model.nodes

    Axon.map_nodes(model, fn
      %Axon.Node{op: :dropout, parent: [w]} = node ->
        if Graph.bumblebee_fun?(nodes[w].op, :attention_weights_impl) do
          %{node | op: &philox_dropout/3, op_name: :philox_dropout}
        else
          node
        end

      node ->
        node
    end)
  end

  defp philox_dropout(weights, key, opts) do
    keys = Nx.Random.split(key)
    keep = Philox.keep(keys[1], opts[:rate], Nx.shape(weights))
    out = weights |> Nx.multiply(keep) |> Nx.multiply(Philox.keep_scale(opts[:rate], {:f, 32}))
    %Axon.StatefulOutput{output: out, state: %{"key" => keys[0]}}
  end

  # Every "key" state (both models keep one per attention) set to the same key.
  defp same_keys(%Axon.ModelState{data: data} = state, key) do
    data =
      Map.new(data, fn
        {layer, %{"key" => _} = params} -> {layer, Map.put(params, "key", key)}
        other -> other
      end)

    %{state | data: data}
  end

  test "in training mode the dropout mask is the contract's Philox mask, and the key advances as Axon.dropout's" do
    model = Bumblebee.build_model(spec(:base))
    {swapped, report} = ExlaRs.Bumblebee.swap_attention(model, seed: 5)
    assert report.features[:dropout] == 2
    oracle = with_philox_dropout(model)

    key = Nx.Random.key(1234)
    {init, predict} = Axon.build(oracle, mode: :train, seed: 1)
    {init_swapped, predict_swapped} = Axon.build(swapped, mode: :train, seed: 1)
    params = init.(@inputs, Axon.ModelState.empty())
    # Bumblebee's weights and, per attention, one key state named after its block,
    # seeded from :seed.
    swapped_params = init_swapped.(@inputs, params)

    keys =
      for block <- 0..1,
          do: Nx.to_list(swapped_params.data["encoder.blocks.#{block}.self_attention.fused_attention_dropout"]["key"])

    assert Enum.sort(keys) == Enum.sort([Nx.to_list(Nx.Random.key(5)), Nx.to_list(Nx.Random.key(6))])

    want = predict.(same_keys(params, key), @inputs)
    got = predict_swapped.(same_keys(swapped_params, key), @inputs)

    # Visible positions (row 0's last two are padding).
    visible = @inputs["attention_mask"] |> Nx.new_axis(-1) |> Nx.broadcast(Nx.shape(want.prediction.hidden_state))
    diff = got.prediction.hidden_state |> Nx.subtract(want.prediction.hidden_state) |> Nx.abs() |> Nx.multiply(visible)
    assert Nx.to_number(Nx.reduce_max(diff)) < 1.0e-5

    # Dropout is really on: without it (inference mode) the output differs.
    {_init, infer} = Axon.build(swapped)
    plain = infer.(swapped_params, @inputs).hidden_state
    assert Nx.to_number(Nx.reduce_max(Nx.abs(Nx.subtract(plain, got.prediction.hidden_state)))) > 1.0e-2
  end

  test "the dropout key state advances as Axon.dropout's: split, draw with one half, keep the other" do
    # One attention as the model's output: Axon 0.8.1 returns the training state of a
    # Bumblebee model's inner layers only partly (its own dropout keys included), so
    # this looks at the layer directly.
    none = Bumblebee.Layers.none()
    [q, k, v] = for name <- ~w(q k v), do: Axon.input(name)
    {out, _weights} = Bumblebee.Layers.attention(q, k, v, none, none, none, none, dropout_rate: @rate)
    {swapped, %{features: %{dropout: 1}}} = ExlaRs.Bumblebee.swap_attention(out, seed: 3)

    inputs = for {name, seed} <- [q: 1, k: 2, v: 3], into: %{}, do: {"#{name}", Nx.Random.key(seed) |> Nx.Random.normal(shape: {1, 4, 2, 4}) |> elem(0)}
    {init, predict} = Axon.build(swapped, mode: :train)
    params = init.(inputs, Axon.ModelState.empty())
    # (Bumblebee's own, now unused, attention dropout keeps its key too.)
    assert [{name, %{"key" => key}}] = Enum.filter(params.data, fn {layer, _p} -> layer =~ "exla_rs_attention_dropout_key" end)
    assert key == Nx.Random.key(3)

    %{prediction: o, state: state} = predict.(params, inputs)
    [next, draw] = [Nx.Random.split(key)[0], Nx.Random.split(key)[1]]
    assert state[name]["key"] == next

    # The draw is the contract's mask under the other half.
    want = ExlaRs.attention(inputs["q"], inputs["k"], inputs["v"], dropout_rate: @rate, dropout_key: draw, q_start: Nx.tensor([0]))
    assert Nx.all_close(o, want, atol: 1.0e-6) |> Nx.to_number() == 1
  end

  test "Axon.Loop.trainer fine-tunes a swapped model with attention dropout: the loss falls" do
    spec = spec(:for_sequence_classification, num_labels: 2)
    model = Bumblebee.build_model(spec)
    {swapped, %{swapped: 2}} = ExlaRs.Bumblebee.swap_attention(model, seed: 11)
    logits = Axon.nx(swapped, & &1.logits)

    # Two classes told apart by their tokens.
    inputs = %{
      "input_ids" => Nx.tensor([[5, 6, 7, 0], [5, 7, 6, 5], [20, 21, 22, 0], [21, 20, 22, 21]]),
      "attention_mask" => Nx.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    }

    labels = Nx.tensor([[1, 0], [1, 0], [0, 1], [0, 1]], type: :f32)
    loss = &Axon.Losses.categorical_cross_entropy(&1, &2, from_logits: true, reduction: :mean)

    {init, predict} = Axon.build(logits, seed: 2)
    params = init.(inputs, Axon.ModelState.empty())
    loss_of = fn state -> loss.(labels, predict.(state, inputs)) |> Nx.to_number() end
    before = loss_of.(params)

    trained =
      logits
      |> Axon.Loop.trainer(loss, Polaris.Optimizers.adam(learning_rate: 0.02), log: 0)
      |> Axon.Loop.run(List.duplicate({inputs, labels}, 25), params, epochs: 1)

    after_ = loss_of.(trained)
    assert after_ < 0.5 * before, "loss #{before} -> #{after_}"
    # The trainer initialised the dropout key states the swap added.
    assert %{"key" => _} = trained.data["encoder.blocks.0.self_attention.fused_attention_dropout"]
  end
end
