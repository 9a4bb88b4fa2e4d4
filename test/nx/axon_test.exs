Code.require_file("support.exs", __DIR__)

defmodule ExlaRs.AxonModelTest do
  use ExUnit.Case, async: true
  @moduletag :axon

  alias ExlaRs.NxTest.Reference, as: Ref

  @hidden 16
  @heads 4
  @kv_heads 2
  @head_dim 4

  @seq 7
  @slopes [0.5, 0.25, 0.125, 0.0625]

  # A Bumblebee-style self-attention block with grouped-query heads and a padding mask:
  # projections, heads split to {batch, seq, heads, head_dim}, ExlaRs.Axon.attention,
  # heads merged, output projection. `masking`: :kv_len (a right-padded mask as
  # lengths) or :key_mask_bias (the mask as :key_mask, any padding, plus a learned
  # T5-style {1, heads, seq, seq} bias and ALiBi slopes).
  defp model(attention_opts, masking \\ :kv_len) do
    x = Axon.input("x", shape: {nil, nil, @hidden})
    mask = Axon.input("mask", shape: {nil, nil})

    q = x |> Axon.dense(@heads * @head_dim, name: "q") |> split_heads(@heads)
    k = x |> Axon.dense(@kv_heads * @head_dim, name: "k") |> split_heads(@kv_heads)
    v = x |> Axon.dense(@kv_heads * @head_dim, name: "v") |> split_heads(@kv_heads)

    masking_opts =
      case masking do
        :kv_len ->
          [kv_len: Axon.nx(mask, &ExlaRs.Axon.kv_len_from_mask/1)]

        :key_mask_bias ->
          bias_param = Axon.param("bias", {1, @heads, @seq, @seq}, initializer: :normal)
          bias = Axon.layer(fn bias, _opts -> bias end, [bias_param], name: "rel_bias")
          [key_mask: mask, bias: bias, alibi_slopes: Axon.constant(Nx.tensor(@slopes, type: :f32))]
      end

    ExlaRs.Axon.attention(q, k, v, masking_opts ++ [name: "flash"] ++ attention_opts)
    |> Axon.nx(fn t ->
      {b, s, _, _} = Nx.shape(t)
      Nx.reshape(t, {b, s, @hidden})
    end)
    |> Axon.dense(@hidden, name: "out")
  end

  defp split_heads(node, heads) do
    Axon.nx(node, fn t ->
      {b, s, _} = Nx.shape(t)
      Nx.reshape(t, {b, s, heads, @head_dim})
    end)
  end

  # The same block by hand in float64, with the reference's naive attention. The
  # visibility mask and options are resolved eagerly, outside any grad trace.
  defp reference(%{"x" => x, "mask" => mask}, attention_opts, masking \\ :kv_len) do
    {b, s, _} = Nx.shape(x)
    q = Nx.broadcast(0.0, {b, s, @heads, @head_dim})
    k = Nx.broadcast(0.0, {b, s, @kv_heads, @head_dim})

    masking_opts =
      case masking do
        :kv_len -> [kv_len: ExlaRs.Axon.kv_len_from_mask(mask)]
        :key_mask_bias -> [key_mask: mask, alibi_slopes: Nx.tensor(@slopes, type: :f32)]
      end

    opts = masking_opts ++ attention_opts
    visible = Ref.mask(q, k, opts)
    c = Ref.config(q, k, opts)
    x = Nx.as_type(x, :f64)

    fn params ->
      dense = fn x, name -> Nx.add(Nx.dot(x, params[name]["kernel"]), params[name]["bias"]) end
      q = x |> dense.("q") |> Nx.reshape({b, s, @heads, @head_dim})
      k = x |> dense.("k") |> Nx.reshape({b, s, @kv_heads, @head_dim})
      v = x |> dense.("v") |> Nx.reshape({b, s, @kv_heads, @head_dim})
      bias = if masking == :key_mask_bias, do: params["rel_bias"]["bias"]
      {o, _lse} = Ref.naive(q, k, v, visible, c, bias)
      o |> Nx.reshape({b, s, @hidden}) |> dense.("out")
    end
  end

  defp inputs(seed) do
    :rand.seed(:exsss, {seed, 3, 5})
    x = Ref.random_like(Nx.iota({2, 7, @hidden})) |> Nx.as_type(:f32)
    # Right padding: 7 real tokens in row 0, 4 in row 1.
    mask = Nx.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]])
    %{"x" => x, "mask" => mask}
  end

  # Axon.build's functions are meant for defn: init under jit, predict traced by the caller.
  defp init(model, inputs, opts \\ []) do
    {init_fn, predict_fn} = Axon.build(model, opts)
    template = Map.new(inputs, fn {name, t} -> {name, Nx.template(Nx.shape(t), Nx.type(t))} end)
    {Nx.Defn.jit(init_fn).(template, Axon.ModelState.empty()), predict_fn}
  end

  @option_sets [
    [causal: true],
    [window_size: {2, 1}, softcap: 3.0],
    [causal: true, scale: 0.7, window_size: {3, -1}]
  ]

  test "a model with the attention layer predicts what the float64 reference computes" do
    for {opts, seed} <- Enum.with_index(@option_sets) do
      inputs = inputs(seed)
      {state, predict_fn} = init(model(opts), inputs)
      got = Nx.Defn.jit(predict_fn).(state, inputs)
      assert Nx.shape(got) == {2, 7, @hidden}
      # Axon.predict/4 is the eager entry point users call.
      assert Axon.predict(model(opts), state, inputs) == got
      want = Nx.Defn.jit(reference(inputs, opts)).(Nx.Defn.Composite.traverse(state.data, &Nx.as_type(&1, :f64)))
      Ref.assert_close(got, want, 2.0e-5, 2.0e-5, inspect(opts))
    end
  end

  test "parameter gradients through the model match the reference's, via the custom backward" do
    for {opts, seed} <- Enum.with_index(@option_sets) do
      inputs = inputs(seed)
      {state, predict_fn} = init(model(opts), inputs)
      r = Ref.random_like(Nx.iota({2, 7, @hidden}))
      loss = fn out -> out |> Nx.multiply(r) |> Nx.sum() end

      got = Nx.Defn.grad(state.data, fn data -> loss.(predict_fn.(%{state | data: data}, inputs)) end)

      data64 = Nx.Defn.Composite.traverse(state.data, &Nx.as_type(&1, :f64))
      ref_fun = reference(inputs, opts)
      want = Nx.Defn.grad(data64, fn data -> loss.(ref_fun.(data)) end)

      for layer <- ~w(q k v out), param <- ~w(kernel bias) do
        expected = want[layer][param]
        atol = 2.0e-5 * max(Nx.to_number(Nx.reduce_max(Nx.abs(expected))), 1.0)
        Ref.assert_close(got[layer][param], expected, atol, 2.0e-4, "d#{layer}.#{param} #{inspect(opts)}")
      end
    end
  end

  # Left padding, which :kv_len cannot express: row 1 has 2 padding tokens first.
  defp left_padded(seed) do
    %{inputs(seed) | "mask" => Nx.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])}
  end

  test "with a left-padded key mask, a learned bias and ALiBi: predictions and every parameter's gradient" do
    for {opts, seed} <- Enum.with_index(@option_sets) do
      inputs = left_padded(seed)
      model = model(opts, :key_mask_bias)
      {state, predict_fn} = init(model, inputs)
      data64 = Nx.Defn.Composite.traverse(state.data, &Nx.as_type(&1, :f64))
      ref_fun = reference(inputs, opts, :key_mask_bias)

      got = Nx.Defn.jit(predict_fn).(state, inputs)
      Ref.assert_close(got, Nx.Defn.jit(ref_fun).(data64), 2.0e-5, 2.0e-5, inspect(opts))

      r = Ref.random_like(Nx.iota({2, 7, @hidden}))
      loss = fn out -> out |> Nx.multiply(r) |> Nx.sum() end
      got = Nx.Defn.grad(state.data, fn data -> loss.(predict_fn.(%{state | data: data}, inputs)) end)
      want = Nx.Defn.grad(data64, fn data -> loss.(ref_fun.(data)) end)

      for {layer, param} <- [{"rel_bias", "bias"} | for(l <- ~w(q k v out), p <- ~w(kernel bias), do: {l, p})] do
        expected = want[layer][param]
        atol = 2.0e-5 * max(Nx.to_number(Nx.reduce_max(Nx.abs(expected))), 1.0)
        Ref.assert_close(got[layer][param], expected, atol, 2.0e-4, "d#{layer}.#{param} #{inspect(opts)}")
      end
    end
  end

  test "the traced training step holds one forward and one backward block" do
    for masking <- [:kv_len, :key_mask_bias] do
      inputs = inputs(0)
      {state, predict_fn} = init(model([causal: true], masking), inputs)

      expr =
        Nx.Defn.debug_expr(fn data, x, mask ->
          Nx.Defn.value_and_grad(data, fn data ->
            predict_fn.(%{state | data: data}, %{"x" => x, "mask" => mask}) |> Nx.sum()
          end)
        end).(state.data, inputs["x"], inputs["mask"])

      blocks = expr |> Ref.walk() |> Map.fetch!(:blocks) |> Enum.map(fn {struct, _, _} -> struct end)
      assert Enum.sort(Enum.map(blocks, & &1.__struct__)) == Enum.sort([ExlaRs.Attention.Forward, ExlaRs.Attention.Backward])
      # The learned bias is differentiated inside the backward block.
      assert Enum.all?(blocks, &(&1.has_bias == (masking == :key_mask_bias)))
      assert Enum.any?(blocks, &match?(%ExlaRs.Attention.Backward{bias_grad: true}, &1)) == (masking == :key_mask_bias)
    end
  end

  test "the layer is named and runs in training mode" do
    inputs = inputs(1)
    model = model(causal: true)
    {state, predict_fn} = init(model, inputs, mode: :train)
    %{prediction: out} = Nx.Defn.jit(predict_fn).(state, inputs)
    assert Nx.shape(out) == {2, 7, @hidden}

    names = Axon.reduce_nodes(model, [], fn %Axon.Node{name: name, op_name: op}, acc -> [{op, name.(op, %{})} | acc] end)
    assert {:exla_rs_attention, "flash"} in names
  end

  test "unknown or misspelt options raise when the layer is built" do
    x = Axon.input("x", shape: {nil, 3, 2, 4})

    assert_raise ArgumentError, ~r/unknown options \[:casual\]/, fn ->
      ExlaRs.Axon.attention(x, x, x, casual: true)
    end

    assert_raise ArgumentError, ~r/:kv_len must be an Axon node/, fn ->
      ExlaRs.Axon.attention(x, x, x, kv_len: Nx.tensor([3]))
    end

    assert_raise ArgumentError, ~r/:bias must be an Axon node/, fn ->
      ExlaRs.Axon.attention(x, x, x, bias: Nx.iota({1, 2, 3, 3}, type: :f32))
    end
  end
end
