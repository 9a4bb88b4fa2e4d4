defmodule ExlaRs.BumblebeeSwapTest do
  # swap_attention/2 on Bumblebee.Layers.attention itself: each of its inputs and options
  # against Bumblebee's own computation, the rows where the two differ by design, what is
  # left alone and why, and bad arguments.
  use ExUnit.Case, async: true
  @moduletag :bumblebee

  alias Bumblebee.Layers

  @b 2
  @sq 3
  @sk 6
  @h 4
  @d 4

  setup_all do
    Nx.default_backend(Nx.BinaryBackend)
    :ok
  end

  # One attention: q {b, sq, h, d}, k/v {b, sk, kv_heads, d} (repeated to h heads as
  # Bumblebee does when kv_heads < h), and each optional input an Axon input.
  defp attention_model(opts, kv_heads \\ @h) do
    q = Axon.input("q")
    k = Axon.input("k")
    v = Axon.input("v")
    {k, v} = if kv_heads < @h, do: {repeat(k, kv_heads), repeat(v, kv_heads)}, else: {k, v}
    optional = for name <- ~w(key_mask head_mask bias offset), do: Axon.input(name, optional: true)
    [key_mask, head_mask, bias, offset] = optional
    {out, _weights} = Layers.attention(q, k, v, key_mask, head_mask, bias, offset, opts)
    out
  end

  defp repeat(node, kv_heads), do: Layers.repeat_interleave(node, div(@h, kv_heads), axis: 2)

  defp random(shape, seed), do: Nx.Random.key(seed) |> Nx.Random.normal(shape: shape) |> elem(0)

  defp qkv(kv_heads \\ @h) do
    %{"q" => random({@b, @sq, @h, @d}, 1), "k" => random({@b, @sk, kv_heads, @d}, 2), "v" => random({@b, @sk, kv_heads, @d}, 3)}
  end

  defp run(model, inputs, build_opts \\ []) do
    {init, predict} = Axon.build(model, build_opts)
    predict.(init.(inputs, Axon.ModelState.empty()), inputs)
  end

  # Which keys Bumblebee lets query i see, from its definitions: the key mask, then
  # causal (j <= i + offset) and window (left >= i + offset - j >= -right).
  defp visible(opts, offset, key_mask4) do
    for b <- 0..(@b - 1) do
      for h <- 0..(@h - 1) do
        for i <- 0..(@sq - 1) do
          for j <- 0..(@sk - 1) do
            diff = i + offset - j
            {left, right} = opts[:window_size] || {nil, nil}
            # Causal is the window's right side at 0.
            right = if opts[:causal], do: 0, else: right
            key_mask4 |> Enum.at(b) |> Enum.at(h) |> Enum.at(i) |> Enum.at(j) != 0 and
              (left == nil or diff <= left) and (right == nil or diff >= -right)
          end
        end
      end
    end
  end

  # Rows (b, i, h) that see at least one key must match; the others are where
  # Bumblebee's min_finite masking gives the mean of V and the contract 0.
  defp assert_rows(got, want, visible) do
    for b <- 0..(@b - 1), h <- 0..(@h - 1), i <- 0..(@sq - 1) do
      g = got[b][i][h]
      w = want[b][i][h]

      if Enum.any?(visible |> Enum.at(b) |> Enum.at(h) |> Enum.at(i)) do
        diff = g |> Nx.subtract(w) |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number()
        assert diff < 1.0e-6, "row b=#{b} h=#{h} i=#{i} differs by #{diff}"
      else
        assert Nx.to_flat_list(g) == List.duplicate(0.0, @d), "a row that sees no key must be 0, got #{inspect(g)}"
      end
    end
  end

  @cases [
    {"causal with a KV-cache offset", [causal: true], 3, :rank2},
    {"sliding window {1, 2} (Bumblebee's |i - j| <= w)", [window_size: {1, 2}], 2, :rank2},
    {"causal sliding window {2, _}", [causal: true, window_size: {2, 5}], 3, :rank2},
    {"bidirectional, rank-4 key mask {b, h, sq, sk}", [], 0, :rank4},
    {"causal, rank-4 key mask {b, 1, 1, sk}", [causal: true], 3, :rank4_keys},
    {"explicit scale", [scale: 0.7], 0, :rank2}
  ]

  for {name, opts, offset, mask_kind} <- @cases do
    @opts opts
    @offset offset
    @mask_kind mask_kind

    test "#{name}, with a bias and a head mask: Bumblebee's output on every row that sees a key" do
      {swapped, report} = ExlaRs.Bumblebee.swap_attention(attention_model(@opts))
      assert report.swapped == 1

      {mask, mask4} = key_mask(@mask_kind)

      inputs =
        Map.merge(qkv(), %{
          "key_mask" => mask,
          "bias" => random({1, @h, @sq, @sk}, 4),
          "head_mask" => Nx.tensor([1.0, 0.0, 0.5, 2.0]),
          "offset" => Nx.tensor(@offset)
        })

      want = run(attention_model(@opts), inputs)
      got = run(swapped, inputs)
      visible = visible(@opts, @offset, mask4)
      assert_rows(got, want, visible)
    end
  end

  # {the mask input, the same as {b, h, sq, sk} lists}. Row 0 hides keys 0, 1 and 4; with
  # the window/causal cases some rows of it see nothing.
  defp key_mask(:rank2) do
    mask = Nx.tensor([[0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1]])
    {mask, mask |> Nx.reshape({@b, 1, 1, @sk}) |> Nx.broadcast({@b, @h, @sq, @sk}) |> Nx.to_list()}
  end

  defp key_mask(:rank4_keys) do
    {mask, lists} = key_mask(:rank2)
    {Nx.reshape(mask, {@b, 1, 1, @sk}), lists}
  end

  defp key_mask(:rank4) do
    mask = Nx.Random.key(9) |> Nx.Random.uniform(shape: {@b, @h, @sq, @sk}) |> elem(0) |> Nx.greater(0.4)
    # One row with no visible key at all.
    mask = Nx.put_slice(mask, [0, 1, 2, 0], Nx.broadcast(Nx.tensor(0, type: :u8), {1, 1, 1, @sk}))
    {mask, Nx.to_list(mask)}
  end

  test "a query row that sees no key: Bumblebee gives the mean of V, the contract 0" do
    {swapped, _report} = ExlaRs.Bumblebee.swap_attention(attention_model(causal: true))
    inputs = Map.put(qkv(), "key_mask", Nx.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]]))
    want = run(attention_model(causal: true), inputs)
    got = run(swapped, inputs)
    # Row 0, query 0 sees only key 0 (causal), which is masked.
    mean_v = inputs["v"][0] |> Nx.mean(axes: [0])
    assert_in_delta Nx.to_number(Nx.reduce_max(Nx.abs(Nx.subtract(want[0][0], mean_v)))), 0.0, 1.0e-6
    assert Nx.to_flat_list(got[0][0]) == List.duplicate(0.0, @h * @d)
    # Query 2 of row 0 sees nothing either (keys 0..2); the last sees key 3 on.
    assert Nx.to_flat_list(got[0][2]) == List.duplicate(0.0, @h * @d)
  end

  test "grouped-query heads reach the kernel without Bumblebee's repeat" do
    model = attention_model([causal: true], 2)
    {swapped, report} = ExlaRs.Bumblebee.swap_attention(model)
    assert report.features[:gqa] == 1
    assert [%{features: features}] = report.blocks
    assert :gqa in features

    # The fused layer's key and value are the model's inputs themselves, 2 heads.
    fused = swapped.nodes |> Map.values() |> Enum.find(&(&1.op_name == :exla_rs_attention))
    [_q, k, v | _] = fused.parent
    assert swapped.nodes[k].op == :input and swapped.nodes[v].op == :input

    inputs = Map.put(qkv(2), "key_mask", Nx.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]))
    want = run(model, inputs)
    got = run(swapped, inputs)
    assert Nx.all_close(got, want, atol: 1.0e-6) |> Nx.to_number() == 1

    {no_gqa, report} = ExlaRs.Bumblebee.swap_attention(model, gqa: false)
    refute report.features[:gqa]
    assert Nx.all_close(run(no_gqa, inputs), want, atol: 1.0e-6) |> Nx.to_number() == 1
  end

  describe "a Bumblebee model" do
    setup do
      spec =
        Bumblebee.configure(Bumblebee.Text.Bert,
          architecture: :base,
          vocab_size: 30,
          hidden_size: 16,
          intermediate_size: 32,
          num_blocks: 2,
          num_attention_heads: 4,
          max_positions: 16
        )

      inputs = %{"input_ids" => Nx.tensor([[5, 6, 7, 8, 0], [9, 10, 11, 12, 13]]), "attention_mask" => Nx.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])}
      %{model: Bumblebee.build_model(spec), inputs: inputs}
    end

    test "built with output_attentions: true returns Bumblebee's attentions and the outputs they make", %{model: model, inputs: inputs} do
      {swapped, report} = ExlaRs.Bumblebee.swap_attention(model)
      assert report.swapped == 2
      {init, predict} = Axon.build(model, global_layer_options: [output_attentions: true])
      {_init, predict_swapped} = Axon.build(swapped, global_layer_options: [output_attentions: true])
      params = init.(inputs, Axon.ModelState.empty())
      want = predict.(params, inputs)
      got = predict_swapped.(params, inputs)
      assert tuple_size(got.attentions) == 2
      # The same computation (unfused), so the same bits.
      assert got.attentions == want.attentions
      assert got.hidden_state == want.hidden_state
    end

    test "an attention whose weights another layer computes with is left alone and reported", %{model: model, inputs: inputs} do
      # A (made-up) extra output that sums the first block's attention weights.
      weights = model.nodes |> Map.values() |> Enum.filter(&ExlaRs.Bumblebee.Graph.bumblebee_fun?(&1.op, :attention_weights_impl)) |> Enum.min_by(& &1.id)
      spy = Axon.nx(%Axon{output: weights.id, nodes: model.nodes}, &Nx.sum(&1, axes: [1, 2, 3]), name: "weights_spy")
      model = Axon.container(%{out: model, spy: spy})

      {swapped, report} = ExlaRs.Bumblebee.swap_attention(model)
      assert report.swapped == 1
      assert [%{name: "encoder.blocks.0.self_attention", reason: reason}] = report.skipped
      assert reason =~ "weights_spy"

      {init, predict} = Axon.build(model)
      {_init, predict_swapped} = Axon.build(swapped)
      params = init.(inputs, Axon.ModelState.empty())
      want = predict.(params, inputs)
      got = predict_swapped.(params, inputs)
      assert got.spy == want.spy
      assert Nx.all_close(got.out.hidden_state, want.out.hidden_state, atol: 1.0e-6) |> Nx.to_number() == 1

      assert_raise ArgumentError, ~r/strict: true.*encoder\.blocks\.0\.self_attention: its attention weights are used by another layer \(weights_spy\)/, fn ->
        ExlaRs.Bumblebee.swap_attention(model, strict: true)
      end
    end

    test "a model_info keeps its params and spec", %{model: model, inputs: inputs} do
      {init, _predict} = Axon.build(model)
      info = %{model: model, params: init.(inputs, Axon.ModelState.empty()), spec: :spec}
      {swapped, report} = ExlaRs.Bumblebee.swap_attention(info)
      assert %{params: params, spec: :spec, model: %Axon{}} = swapped
      assert params == info.params
      assert report.kinds == %{bidirectional: 2}
      # BERT can run as a decoder with a cache: its attentions take an offset input.
      assert report.features == %{key_mask: 2, head_mask: 2, offset: 2, dropout: 2}
      assert Enum.map(report.blocks, & &1.name) |> Enum.sort() == ["encoder.blocks.0.self_attention", "encoder.blocks.1.self_attention"]
    end
  end

  test "a chain that is not Bumblebee's (no Axon.dropout between weights and output) is left alone" do
    model =
      Axon.map_nodes(attention_model([]), fn
        %Axon.Node{op: :dropout} = node -> %{node | op: fn x, _key, _opts -> x end, op_name: :custom}
        node -> node
      end)

    {swapped, report} = ExlaRs.Bumblebee.swap_attention(model)
    assert report.swapped == 0
    assert [%{name: nil, reason: "its attention weights do not reach the output through Axon.dropout"}] = report.skipped
    assert swapped == model
  end

  test "a model without Bumblebee attention is returned as it is" do
    model = Axon.input("x") |> Axon.dense(4)
    assert {^model, %{swapped: 0, skipped: [], blocks: []}} = ExlaRs.Bumblebee.swap_attention(model)
  end

  test "bad arguments raise, naming what was expected" do
    model = attention_model([])

    assert_raise ArgumentError, ~r/expected a Bumblebee model_info .* or an %Axon\{\} model, got: :bert/, fn ->
      ExlaRs.Bumblebee.swap_attention(:bert)
    end

    assert_raise ArgumentError, ~r/unknown options \[:causal\], expected :gqa, :seed or :strict/, fn ->
      ExlaRs.Bumblebee.swap_attention(model, causal: true)
    end

    assert_raise ArgumentError, ~r/expected :gqa to be a boolean, got: 1/, fn -> ExlaRs.Bumblebee.swap_attention(model, gqa: 1) end
    assert_raise ArgumentError, ~r/expected :seed to be an integer, got: 1.5/, fn -> ExlaRs.Bumblebee.swap_attention(model, seed: 1.5) end
    assert_raise ArgumentError, ~r/expected opts to be a keyword list/, fn -> ExlaRs.Bumblebee.swap_attention(model, [:strict]) end
  end
end
