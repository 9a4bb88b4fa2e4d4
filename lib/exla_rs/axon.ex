defmodule ExlaRs.Axon do
  # Nx is optional: the guard sits inside the module, as in ExlaRs.Attention.
  if Code.ensure_loaded?(Nx) do
    @moduledoc """
    `ExlaRs.attention/4` for Axon models, Bumblebee-style.

    `layer/4` to `layer/10` are layer functions in Axon's calling convention (the
    input tensors, then a keyword list that Axon extends with `:mode` and the like;
    unknown keys are ignored), so they need no Axon at compile time. When Axon is
    loaded, `attention/4` builds the layer for you.

    ## Swapping it into a Bumblebee-style attention

    Bumblebee's `Bumblebee.Layers.Transformer` splits heads into
    `{batch, seq, heads, head_dim}` and then materialises the weights:

        attention_weights =
          Layers.attention_weights(query, key, attention_bias, scale: scale)
          |> Axon.dropout(rate: attention_dropout_rate)

        attention_output = Layers.attention_output(attention_weights, value)

    With exla_rs (no attention weights output; the dropout is applied inside the
    attention), the same block is:

        attention_output =
          ExlaRs.Axon.attention(query, key, value,
            # {batch, kv_seq}, nonzero for real tokens, any padding pattern
            key_mask: key_mask,
            # optional, e.g. T5's learned {1, heads, q_seq, kv_seq} position bias
            bias: attention_bias,
            causal: causal,
            scale: scale,
            # dropout on the attention probabilities, in training mode only
            dropout_rate: attention_dropout_rate,
            name: join(name, "flash_attention")
          )

    A right-padded mask can also be given as `kv_len: Axon.nx(key_mask,
    &ExlaRs.Axon.kv_len_from_mask/1)`, which lets the kernels skip the padding
    tiles by length alone; `:key_mask` takes any pattern (left padding too).

    `attention_output` is `{batch, seq, heads, head_dim}`, as from
    `Layers.attention_output/2`; flatten the heads and apply the output
    projection as before. Grouped-query models pass `key`/`value` with fewer
    heads directly (no `repeat_interleave`). Under EXLA the forward and the
    backward run as the fused kernels; elsewhere the Nx fallback computes the
    same values.
    """

    @attention_keys [:scale, :causal, :window_size, :softcap]
    # The layer's tensor inputs after q, k, v: the tensor options, then the dropout key.
    @layer_tensor_keys ExlaRs.Attention.tensor_option_keys() ++ [:dropout_key]

    if Code.ensure_loaded?(Axon) do
      @doc """
      An Axon layer computing `ExlaRs.attention/4` of the `query`, `key` and
      `value` nodes (`{batch, seq, heads, head_dim}`).

      Options: those of `ExlaRs.Attention.attention/4`, where the tensor
      options (`:kv_len`, `:q_start`, `:key_mask`, `:bias`, `:alibi_slopes`) are
      Axon nodes (for instance `kv_len_from_mask/1` of an input, an `Axon.input/2`
      key mask, or a learned bias), plus `:name`. The bias gets its gradient like
      any other node's output.

      ## Dropout

      `:dropout_rate` (a number in `[0, 1)`, default 0) applies attention dropout
      in training mode only (`Axon.build(model, mode: :train)`); in inference mode
      the rate is ignored. The key follows `Axon.dropout/2`: the layer keeps a
      `"key"` state parameter (`u32 {2}`), initialised with `Nx.Random.key(seed)`
      (`:seed`, default `:erlang.system_time/0` when the model is built); each
      training step splits it with `Nx.Random.split/1`, draws the mask with one
      half and returns the other as the layer's new state. A `:dropout_key` node
      may be given instead (then no state is kept and the mask is that key's).
      """
      def attention(%Axon{} = query, %Axon{} = key, %Axon{} = value, opts \\ []) do
        opts = check_options!(opts)
        {name, opts} = Keyword.pop(opts, :name)
        {seed, opts} = Keyword.pop_lazy(opts, :seed, fn -> :erlang.system_time() end)
        {tensors, opts} = Keyword.split(opts, @layer_tensor_keys)
        tensors = Enum.reject(tensors, fn {_key, node} -> is_nil(node) end)
        rate = opts[:dropout_rate] || 0.0

        # With a rate and no key node, the key is the layer's state, as in Axon.dropout/2.
        {tensors, state?} =
          if rate > 0 and not Keyword.has_key?(tensors, :dropout_key) do
            key_state =
              Axon.param("key", {2},
                type: {:u, 32},
                initializer: fn _, _ -> Nx.Random.key(seed) end,
                kind: :state
              )

            {tensors ++ [dropout_key: key_state], true}
          else
            {tensors, false}
          end

        op = Function.capture(__MODULE__, :layer, 4 + length(tensors))

        Axon.layer(
          op,
          [query, key, value | Keyword.values(tensors)],
          # opts holds only attention options now (checked, :name and the nodes taken out).
          [name: name, op_name: :exla_rs_attention, tensor_keys: Keyword.keys(tensors), dropout_state: state?] ++
            opts
        )
      end

      # The layer functions ignore unknown keys (Axon adds its own, like :mode),
      # so a misspelt option must be caught here, when the model is built.
      defp check_options!(opts) do
        fun = "ExlaRs.Axon.attention/4"
        ExlaRs.Attention.check_option_keys!(opts, fun, [:name, :seed])
        ExlaRs.Attention.dropout_rate!(opts[:dropout_rate], fun)

        unless is_nil(opts[:seed]) or is_integer(opts[:seed]) do
          raise ArgumentError, "#{fun}: expected :seed to be an integer, got: #{inspect(opts[:seed])}"
        end

        for key <- @layer_tensor_keys do
          case opts[key] do
            nil ->
              :ok

            %Axon{} ->
              :ok

            other ->
              raise ArgumentError,
                    "ExlaRs.Axon.attention/4: #{inspect(key)} must be an Axon node " <>
                      "(an Axon.input/2, a layer's output, Axon.constant/2, or for :kv_len " <>
                      "Axon.nx(mask, &ExlaRs.Axon.kv_len_from_mask/1)), got: #{inspect(other)}"
          end
        end

        opts
      end
    end

    # One layer function per number of tensor inputs after v (0 to 6).
    for n <- 0..length(@layer_tensor_keys) do
      tensors = Macro.generate_arguments(n, __MODULE__)

      if n == 0 do
        @doc """
        Axon layer function: `ExlaRs.attention(q, k, v, opts)`. `layer/5` to
        `layer/10` take tensor options after `v`, named in order by
        `opts[:tensor_keys]` (default: the first of `:kv_len`, `:q_start`,
        `:key_mask`, `:bias`, `:alibi_slopes`, `:dropout_key`).

        `:dropout_rate` applies only when `opts[:mode]` is `:train` (Axon passes
        the mode); with `dropout_state: true` the `:dropout_key` input is the
        layer's `"key"` state, split once per call, and the result is an
        `Axon.StatefulOutput` carrying the next key.
        """
      else
        @doc false
      end

      def layer(q, k, v, unquote_splicing(tensors), opts), do: apply_layer(q, k, v, unquote(tensors), opts)
    end

    defp apply_layer(q, k, v, tensors, opts) do
      keys = Keyword.get(opts, :tensor_keys, Enum.take(@layer_tensor_keys, length(tensors)))
      {dropout_key, tensor_opts} = keys |> Enum.zip(tensors) |> Keyword.pop(:dropout_key)
      rate = opts[:dropout_rate] || 0.0
      attention_opts = Keyword.take(opts, @attention_keys) ++ tensor_opts

      cond do
        # Inference (Axon's default mode): no dropout, the key is not read.
        opts[:mode] != :train or rate == 0 or dropout_key == nil ->
          ExlaRs.Attention.attention(q, k, v, attention_opts)

        # Axon.Layers.dropout's convention: split, draw with one half, keep the other.
        opts[:dropout_state] ->
          keys = Nx.Random.split(dropout_key)
          dropout = [dropout_rate: rate, dropout_key: keys[1]]
          out = ExlaRs.Attention.attention(q, k, v, attention_opts ++ dropout)
          stateful(out, keys[0])

        true ->
          ExlaRs.Attention.attention(q, k, v, attention_opts ++ [dropout_rate: rate, dropout_key: dropout_key])
      end
    end

    if Code.ensure_loaded?(Axon.StatefulOutput) do
      defp stateful(out, key), do: %Axon.StatefulOutput{output: out, state: %{"key" => key}}
    else
      # The layer functions need no Axon; without it there is no state to return.
      defp stateful(out, _key), do: out
    end

    @doc """
    `kv_len` from a Bumblebee-style key mask `{batch, kv_seq}` (1 for a real
    token): the number of real tokens per row. Exact only for right-padded
    masks (the real tokens first), which is what `kv_len` can express.
    """
    def kv_len_from_mask(mask) do
      mask |> Nx.not_equal(0) |> Nx.as_type({:s, 32}) |> Nx.sum(axes: [1]) |> Nx.as_type({:s, 32})
    end
  else
    @moduledoc false
  end
end
