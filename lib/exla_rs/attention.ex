defmodule ExlaRs.Attention do
  # The module always exists, and the guard sits inside it: Mix then records the
  # compile-time check against Nx and recompiles this file when Nx joins the project
  # later (a file whose top-level `if` defines no module is never marked stale).
  if Code.ensure_loaded?(Nx) do
    @moduledoc """
    Fused (flash) scaled-dot-product attention for Nx, in Bumblebee's layout.

        o = ExlaRs.Attention.attention(q, k, v, causal: true)
        {o, lse} = ExlaRs.Attention.attention_with_lse(q, k, v, causal: true)

    (`ExlaRs.attention/4` and `ExlaRs.attention_with_lse/4` delegate here.)

    Both work eagerly and inside `defn`/`Nx.Defn.jit`, with any backend and
    compiler. Compiled with EXLA on a `:host` or `:cuda` client, the forward and
    backward passes become the `exla_rs_flash_attn_fwd`/`_bwd` custom calls
    (see `ExlaRs.CustomCall`), which never materialise the `Sq × Sk` logits;
    everywhere else, and for configurations the kernels do not cover, the same
    function is computed in plain Nx by `ExlaRs.Attention.Fallback`. Either way
    the answer is the one the contract defines (`flash-attention-contract.md`):

      * `q` is `{batch, seq_q, heads, head_dim}`, `k` and `v` are
        `{batch, seq_k, kv_heads, head_dim}`, all of one float type (`:f16`,
        `:bf16`, `:f32`; `:f64` runs on the Nx fallback only). `heads` must be a
        multiple of `kv_heads` (grouped-query attention: query head `h` reads
        key/value head `div(h, div(heads, kv_heads))`).
      * `x = scale * (q[b, i, h] · k[b, j, h'])`, soft-capped to
        `s = softcap * tanh(x / softcap)` when `softcap > 0` (else `s = x`).
      * the score is `z = s + bias[b, h, i, j] - alibi_slopes[h] * |q_start[b] + i - j|`
        (each term only with its option; a bias dimension of size 1 is
        broadcast). The bias and ALiBi come after the soft cap.
      * key `j` is visible from query `i` when `j < kv_len[b]`, and
        `j >= q_start[b] + i - left` (unless `left = -1`), and
        `j <= q_start[b] + i + right` (unless `right = -1`), and
        `key_mask[b, j] != 0` (with a key mask).
      * `o[b, i, h] = Σ_j softmax(z)_j · v[b, j, h']` over the visible keys, in the
        type of `q`; `lse[b, h, i] = log Σ_j exp(z)` over them, `f32`
        `{batch, heads, seq_q}`. A `-inf` bias entry hides its key like the mask
        does. A query that sees no key (or only `-inf` scores) gets `o = 0` and
        `lse = -inf`, never NaN, and passes no gradient.

    ## Options

      * `:scale` - the logit scale, a number. Defaults to `1 / sqrt(head_dim)`.
        It is rounded to `f32` (the kernels' attribute type) on every path.
      * `:causal` - `true` for causal attention (`right = 0`: a query sees no key
        after its own position). Defaults to `false`.
      * `:window_size` - `{left, right}`, non-negative integers or `-1` for
        unbounded. Defaults to `{-1, -1}`, or `{-1, 0}` when causal; with
        `causal: true`, `right` must be `0` or `-1`.
      * `:softcap` - a non-negative number, `0` for none (the default).
      * `:kv_len` - an integer tensor of shape `{batch}`: keys at positions
        `>= kv_len[b]` are padding. Defaults to `seq_k` for every row.
      * `:q_start` - an integer tensor of shape `{batch}`: the key position of
        query 0. Defaults to `seq_k - seq_q` (so the queries are the last `seq_q`
        positions of the key sequence; with equal lengths, self-attention).
      * `:key_mask` - an integer tensor of shape `{batch, seq_k}` (Bumblebee's
        attention mask): nonzero for a key every query of that row may see, zero
        for a hidden one, in any pattern (left padding, holes, all zero). It is
        combined (AND) with `:kv_len`, the window and causal. A mask of a type
        other than `:u8` is turned into `:u8` (`mask != 0`) first.
      * `:bias` - a float tensor (`:f16`, `:bf16`, `:f32`, or `:f64`, which runs
        on the Nx fallback only) of rank 4, broadcastable to
        `{batch, heads, seq_q, seq_k}`: each dimension is 1 or full (a T5
        relative-position bias is `{1, heads, seq_q, seq_k}`). Added to the scores
        after scale and soft cap; its type need not be the type of `q`. `heads`
        counts the query heads.
      * `:alibi_slopes` - a float tensor of shape `{heads}` (one slope per query
        head, rounded to `f32`): the score gets `-slope[h] * |q_start[b] + i - j|`,
        computed in the kernel (no `seq_q × seq_k` tensor).
      * `:dropout_rate` - attention dropout for training: a number in `[0, 1)`
        (rounded to f32), the probability of dropping each entry of the softmax
        `P`. Defaults to `0` (no dropout, nothing of it in the graph). The output
        is `(P ⊙ M / (1 - rate)) · v`; `lse` is unchanged.
      * `:dropout_key` - the key of the dropout mask, a `u32` tensor of shape `{2}`
        as `Nx.Random.key/1` returns (required with a rate above 0). The mask
        `M[b, h, i, j]` is the contract's Philox4x32-10 function of the key and
        the indices (`ExlaRs.Attention.Philox`), the same bits on every backend:
        the same key gives the same mask, so split the key between steps.

    Any combination of the options works. Under EXLA, the `:host` and `:cuda`
    clients run every option in their native kernels (on Hopper the sm_90a forward
    takes the f16/bf16 D = 128/256 calls without optional operands, verified
    there, and with `EXLA_RS_CUDA_PATH=sm90` the D = 64 ones too, where the
    mma.sync forward measured faster, and the calls with key mask, bias, ALiBi
    or dropout (but dropout at D = 256); other calls run the mma.sync forward;
    `ExlaRs.status/0` says which runs). Every head dim from 1 to 256 runs in the
    native kernels on both: CUDA runs 32, 64, 96, 128, 192 and 256 natively and
    any other (Stable Diffusion's 40/80/160, Phi-2's 80, ...) on the next of them
    with zero-padded columns and your `:scale` (copies through the workspace; see
    the contract's "Head dims on CUDA"). `ExlaRs.CustomCall` asks the native library what each platform runs
    (`ExlaRs.CustomCall.features/1`); a call a platform cannot run (`:f64`, a head
    dim past 256) runs on the Nx fallback, which computes the same function.

    ## Example

        defmodule MyModel do
          import Nx.Defn

          defn attend(q, k, v, kv_len) do
            ExlaRs.attention(q, k, v, causal: true, kv_len: kv_len)
          end
        end

        key = Nx.Random.key(0)
        {q, key} = Nx.Random.normal(key, shape: {1, 128, 8, 64}, type: :f32)
        {k, key} = Nx.Random.normal(key, shape: {1, 128, 2, 64}, type: :f32)
        {v, _key} = Nx.Random.normal(key, shape: {1, 128, 2, 64}, type: :f32)
        o = Nx.Defn.jit(&MyModel.attend/4, compiler: EXLA).(q, k, v, Nx.tensor([100]))
        Nx.shape(o)
        #=> {1, 128, 8, 64}

    ## Gradients

    The output `o` carries a custom gradient: `Nx.Defn.grad/2` through it is one
    backward block, `ExlaRs.Attention.Backward`, fed with the forward's own `o`
    and `lse` (the fused backward kernel under EXLA, the Nx fallback elsewhere).
    Nothing is recomputed through the forward's default function. The gradient
    through `lse` of `attention_with_lse/4` is a second backward block on operands
    widened by a few head-dim columns (see `lse_grad_head_dim/1`), so it also runs
    in the fused kernel, in linear memory; past head dim 255 there is no kernel for
    the widened operands and that block runs its Nx default.

    A `:bias` gets its gradient too, summed over its broadcast dimensions (the
    backward block returns it as `dbias`; through `attention_with_lse/4` the lse
    part is added to it). The backward asks for `dbias` whenever the bias is
    computed in the traced program (a parameter or anything derived from one), and
    not when it is a constant captured from outside, which can have no gradient.
    With dropout, the backward regenerates the forward's mask from the key: the
    gradients are those of the masked function (the key gets none).
    `:key_mask`, `:kv_len`, `:q_start` and `:alibi_slopes` get none: they are
    not differentiable inputs of the contract (ALiBi slopes are fixed constants in
    the models that use them), so a gradient taken with respect to them is zero.

    ## Errors

    Wrong ranks, mismatched shapes or types, `heads` not a multiple of
    `kv_heads`, unknown options and bad option values (a key mask not
    `{batch, seq_k}` or not of an integer type, a bias of another rank, a bias
    dimension neither 1 nor full, a non-float bias, slopes not `{heads}` or not
    of a float type, a `:dropout_rate` outside `[0, 1)`, a `:dropout_key` not
    `u32 {2}`, a rate without a key) raise `ArgumentError` naming the argument
    and what was expected, before anything reaches native code.
    """

    alias ExlaRs.Attention.{Backward, Fallback, Forward}

    @float_types [{:f, 16}, {:bf, 16}, {:f, 32}, {:f, 64}]
    @option_keys [
      :scale,
      :causal,
      :window_size,
      :softcap,
      :kv_len,
      :q_start,
      :key_mask,
      :bias,
      :alibi_slopes,
      :dropout_rate,
      :dropout_key
    ]

    @doc false
    # The options that are tensors (the Axon layer takes them as nodes).
    def tensor_option_keys, do: [:kv_len, :q_start, :key_mask, :bias, :alibi_slopes]

    @doc """
    Scaled-dot-product attention: returns `o`, shaped and typed like `q`.

    See the module documentation for the layout, the options and the exact
    function computed.

    ## Examples

        q = Nx.iota({1, 4, 2, 8}, type: :f32) |> Nx.divide(64)
        k = Nx.iota({1, 4, 1, 8}, type: :f32) |> Nx.divide(32)
        ExlaRs.Attention.attention(q, k, k, causal: true)
        #=> f32[1][4][2][8]
    """
    def attention(q, k, v, opts \\ []) do
      {o, _lse} = run(q, k, v, opts, "attention/4", false)
      o
    end

    @doc """
    Like `attention/4`, also returning the row log-sum-exp of the visible logits:
    `{o, lse}` with `lse` of type `f32` (`f64` for `f64` inputs) and shape
    `{batch, heads, seq_q}`, `-inf` for a query that sees no key.
    """
    def attention_with_lse(q, k, v, opts \\ []) do
      run(q, k, v, opts, "attention_with_lse/4", true)
    end

    # Validates the arguments of attention/4 and returns the forward block's tag and
    # inputs: {forward_tag, [q, k, v, kv_len, q_start | optional operands]}. Raises
    # ArgumentError for anything invalid.
    defp prepare(q, k, v, opts, fun) do
      {b, sq, h, d} = check_tensor!(fun, "q", q, nil)
      dtype = Nx.type(q)

      unless dtype in @float_types do
        raise ArgumentError,
              "#{fun}: expected q to have a float type (:f16, :bf16, :f32 or :f64), " <>
                "got #{inspect(dtype)}"
      end

      {kb, sk, hkv, kd} = check_tensor!(fun, "k", k, dtype)
      check_tensor!(fun, "v", v, dtype)

      cond do
        kb != b ->
          raise ArgumentError,
                "#{fun}: expected k to have the batch size of q, #{b}, got k of shape #{inspect(Nx.shape(k))}"

        kd != d ->
          raise ArgumentError,
                "#{fun}: expected k to have the head dim of q, #{d}, got k of shape #{inspect(Nx.shape(k))}"

        Nx.shape(v) != Nx.shape(k) ->
          raise ArgumentError,
                "#{fun}: expected v to have the shape of k, #{inspect(Nx.shape(k))}, " <>
                  "got #{inspect(Nx.shape(v))}"

        rem(h, hkv) != 0 ->
          raise ArgumentError,
                "#{fun}: expected the heads of q (#{h}) to be a multiple of the heads of k and v (#{hkv})"

        true ->
          :ok
      end

      check_option_keys!(opts, fun)

      scale = opts |> Keyword.get(:scale, 1 / :math.sqrt(d)) |> check_f32!(fun, :scale)
      softcap = opts |> Keyword.get(:softcap, 0) |> check_f32!(fun, :softcap)

      if softcap < 0 do
        raise ArgumentError, "#{fun}: expected :softcap to be >= 0 (0 for none), got: #{softcap}"
      end

      causal = Keyword.get(opts, :causal, false)

      unless is_boolean(causal) do
        raise ArgumentError, "#{fun}: expected :causal to be a boolean, got: #{inspect(causal)}"
      end

      {left, right} = window!(fun, Keyword.get(opts, :window_size), causal)

      kv_len = row_tensor!(fun, :kv_len, Keyword.get(opts, :kv_len), b, sk)
      q_start = row_tensor!(fun, :q_start, Keyword.get(opts, :q_start), b, sk - sq)
      {dropout_rate, dropout_key} = dropout!(fun, opts[:dropout_rate], opts[:dropout_key])

      optional =
        [
          key_mask: key_mask!(fun, opts[:key_mask], b, sk),
          bias: bias!(fun, opts[:bias], {b, h, sq, sk}),
          alibi_slopes: slopes!(fun, opts[:alibi_slopes], h),
          dropout_key: dropout_key
        ]
        |> Enum.reject(fn {_name, t} -> is_nil(t) end)

      dims = [b, sq, sk, h, hkv, d]

      fwd =
        struct!(
          Forward,
          [scale: scale, softcap: softcap, window_left: left, window_right: right, dropout_rate: dropout_rate] ++
            ExlaRs.CustomCall.presence_fields(Keyword.keys(optional))
        )

      fwd = %{fwd | workspace: ExlaRs.CustomCall.workspace_bytes(fwd, dtype, dims)}

      # The contract's fixed order of the optional operands.
      optional = for name <- ExlaRs.CustomCall.optional_operands(fwd), do: optional[name]
      {fwd, [q, k, v, kv_len, q_start | optional]}
    end

    @doc false
    # Raises unless opts is a keyword list of attention/4's options (plus `extra`
    # keys the caller takes for itself). `fun` names the caller in the message.
    def check_option_keys!(opts, fun, extra \\ []) do
      unless Keyword.keyword?(opts) do
        raise ArgumentError, "#{fun}: expected opts to be a keyword list, got: #{inspect(opts)}"
      end

      allowed = @option_keys ++ extra

      case Keyword.keys(opts) -- allowed do
        [] ->
          :ok

        unknown ->
          raise ArgumentError,
                "#{fun}: unknown options #{inspect(Enum.uniq(unknown))}, expected one of #{inspect(allowed)}"
      end
    end

    # The backward block's tag for the forward's options and the given dims (the
    # workspace depends on them), built only when a gradient is taken.
    # bias: the bias operand (its shape sizes CUDA's dbias accumulator) or nil.
    defp backward_tag(%Forward{} = fwd, bias_grad?, dtype, dims, bias) do
      bwd = struct!(Backward, fwd |> Map.from_struct() |> Map.merge(%{bias_grad: bias_grad?, workspace: 0}))
      %{bwd | workspace: ExlaRs.CustomCall.workspace_bytes(bwd, dtype, dims, bias && Nx.shape(bias))}
    end

    defp run(q, k, v, opts, fun, with_lse?) do
      {fwd, args} = prepare(q, k, v, opts, "ExlaRs.#{fun}")

      # Inside defn every block input must be an expression: lift concrete tensors
      # (say a kv_len captured from outside) into the trace.
      [q, k, v, kv_len, q_start | optional] =
        args =
        if Enum.any?(args, &expr?/1), do: Enum.map(args, &Nx.Defn.Expr.tensor/1), else: args

      out = Nx.block(fwd, args, forward_template(fwd, q), default(:forward, args))
      o = elem(out, 0)
      lse = elem(out, 1)

      if expr?(o) do
        bias = ExlaRs.CustomCall.optional_map(fwd, optional)[:bias]
        # custom_grad takes one gradient per input it lists: q, k, v, and the bias
        # when it can have a gradient (the mask, kv_len, q_start and slopes get none).
        bias_grad? = bias != nil and not constant?(bias)
        wrt = [q, k, v] ++ if(bias_grad?, do: [bias], else: [])
        base = [q, k, v, kv_len, q_start]

        grad_o =
          Nx.Defn.Kernel.custom_grad(o, wrt, fn g ->
            # do is shaped and typed like o (the cotangent may come widened or as a scalar).
            d_o = g |> Nx.as_type(Nx.type(o)) |> Nx.broadcast(Nx.shape(o))
            bwd = backward_tag(fwd, bias_grad?, Nx.type(q), dims(q, k, Nx.axis_size(q, 3)), bias)
            bwd_args = base ++ [o, lse, d_o | optional]
            bout = Nx.block(bwd, bwd_args, backward_template(bwd, q, k, v, bias), default(:backward, bwd_args))
            # dq, dk, dv[, dbias] lead the block's results (block_results/3).
            bout |> Tuple.to_list() |> Enum.take(length(wrt))
          end)

        grad_lse =
          if with_lse? do
            Nx.Defn.Kernel.custom_grad(lse, wrt, fn g ->
              lse_grads(fwd, bias_grad?, base, optional, lse, Nx.broadcast(g, Nx.shape(lse)))
            end)
          else
            lse
          end

        {grad_o, grad_lse}
      else
        {o, lse}
      end
    end

    # The block's default function: Fallback.forward/6..10 or backward/9..13, one
    # argument per block input after the tag.
    defp default(pass, args), do: Function.capture(Fallback, pass, length(args) + 1)

    # A tensor captured from outside the trace (or a literal) has no gradient.
    defp constant?(%Nx.Tensor{data: %Nx.Defn.Expr{op: op}}), do: op in [:tensor, :constant]
    defp constant?(_), do: true

    # The head dims the CUDA kernels run natively (every other one up to 256 runs
    # padded to the next of these, through copies in the workspace).
    @kernel_head_dims [32, 64, 96, 128, 192, 256]

    @doc """
    The head dim of the backward block that differentiates `lse`: `d + 1` rounded
    up to a head dim the CUDA kernels run natively (32, 64, 96, 128, 192, 256), so
    the widened operands, zero-padded here anyway, need no second padded copy in
    the kernel's workspace; or `d + 1` past 256.
    """
    def lse_grad_head_dim(d), do: Enum.find(@kernel_head_dims, d + 1, &(&1 > d))

    # The gradient of sum(lse * dlse) as the backward block on widened operands:
    # q and k padded with zero columns (the logits do not change), v given a column
    # of ones at index d, o = 0, and do = dlse in that column only. The backward
    # computes ds = p * (do . v_j - rowsum(do * o)), here p * dlse: exactly the
    # lse part of the gradient. dq and dk are the first d columns; dv gets nothing.
    # The optional operands do not depend on the head dim and pass through as they
    # are; dbias, when asked for, is the lse part of the bias gradient (Nx adds it
    # to the o part).
    defp lse_grads(fwd, bias_grad?, [q, k, v, kv_len, q_start], optional, lse, dlse) do
      # lse is the softmax's, before dropout: its gradient is p * dlse whatever the mask.
      by_name = ExlaRs.CustomCall.optional_map(fwd, optional)
      fwd = %{fwd | has_dropout: false, dropout_rate: 0.0}
      optional = for name <- ExlaRs.CustomCall.optional_operands(fwd), do: by_name[name]
      {b, sq, h, d} = Nx.shape(q)
      {_, sk, hkv, _} = Nx.shape(k)
      type = Nx.type(q)
      wide = lse_grad_head_dim(d)
      # Zero columns: `before` ahead of t's head dim, the rest after, up to `wide`.
      widen = fn t, before ->
        after_ = wide - before - elem(Nx.shape(t), 3)
        Nx.pad(t, Nx.tensor(0, type: type), [{0, 0, 0}, {0, 0, 0}, {0, 0, 0}, {before, after_, 0}])
      end

      ones = Nx.broadcast(Nx.tensor(1, type: type), {b, sk, hkv, 1})
      dlse_col = dlse |> Nx.transpose(axes: [0, 2, 1]) |> Nx.reshape({b, sq, h, 1}) |> Nx.as_type(type)

      q_wide = widen.(q, 0)
      k_wide = widen.(k, 0)
      v_wide = widen.(Nx.concatenate([v, ones], axis: 3), 0)
      o_wide = Nx.broadcast(Nx.tensor(0, type: type), {b, sq, h, wide})
      do_wide = widen.(dlse_col, d)

      tag = backward_tag(fwd, bias_grad?, type, dims(q, k, wide), ExlaRs.CustomCall.optional_map(fwd, optional)[:bias])
      args = [q_wide, k_wide, v_wide, kv_len, q_start, o_wide, lse, do_wide | optional]
      bias = ExlaRs.CustomCall.optional_map(tag, optional)[:bias]
      out = Nx.block(tag, args, backward_template(tag, q_wide, k_wide, v_wide, bias), default(:backward, args))

      [
        out |> elem(0) |> Nx.slice_along_axis(0, d, axis: 3),
        out |> elem(1) |> Nx.slice_along_axis(0, d, axis: 3),
        Nx.broadcast(Nx.tensor(0, type: Nx.type(v)), Nx.shape(v))
      ] ++ if(bias_grad?, do: [elem(out, 3)], else: [])
    end

    # [b, sq, sk, h, hkv, head_dim] as the NIF's workspace query takes them.
    defp dims(q, k, head_dim) do
      {b, sq, h, _} = Nx.shape(q)
      {_, sk, hkv, _} = Nx.shape(k)
      [b, sq, sk, h, hkv, head_dim]
    end

    @doc false
    # What the forward block returns (and so what its custom call must return).
    def forward_template(%Forward{} = tag, q) do
      {b, sq, h, _d} = Nx.shape(q)
      o = Nx.template(Nx.shape(q), Nx.type(q))
      lse = Nx.template({b, h, sq}, Fallback.lse_type(Nx.type(q)))
      ExlaRs.CustomCall.block_results(tag, [o, lse], &Nx.template({&1}, {:u, 8}))
    end

    @doc false
    # `bias` is the forward's bias operand, or nil: dbias is shaped and typed like it.
    def backward_template(%Backward{} = tag, q, k, v, bias) do
      grads = for t <- [q, k, v, bias], do: t && Nx.template(Nx.shape(t), Nx.type(t))
      ExlaRs.CustomCall.block_results(tag, grads, &Nx.template({&1}, {:u, 8}))
    end

    defp expr?(%Nx.Tensor{data: %Nx.Defn.Expr{}}), do: true
    defp expr?(_), do: false

    defp check_tensor!(fun, name, %Nx.Tensor{} = t, dtype) do
      if t.vectorized_axes != [] do
        raise ArgumentError,
              "#{fun}: expected #{name} to be a non-vectorized tensor, got vectorized axes " <>
                inspect(t.vectorized_axes)
      end

      case Nx.shape(t) do
        {_, _, _, _} = shape ->
          if dtype && Nx.type(t) != dtype do
            raise ArgumentError,
                  "#{fun}: expected #{name} to have the type of q, #{inspect(dtype)}, got #{inspect(Nx.type(t))}"
          end

          shape

        shape ->
          layout = if name == "q", do: "{batch, seq_q, heads, head_dim}", else: "{batch, seq_k, kv_heads, head_dim}"

          raise ArgumentError,
                "#{fun}: expected #{name} to be a rank-4 tensor #{layout}, got shape #{inspect(shape)}"
      end
    end

    defp check_tensor!(fun, name, other, _dtype) do
      raise ArgumentError, "#{fun}: expected #{name} to be an Nx.Tensor, got: #{inspect(other)}"
    end

    # A finite number, rounded to the nearest f32 (the attribute type on the wire).
    defp check_f32!(x, fun, name) when is_number(x) do
      x = x / 1

      case <<x::float-32>> do
        <<y::float-32>> -> y
        _ -> raise ArgumentError, "#{fun}: expected #{inspect(name)} to be a finite f32 number, got: #{x}"
      end
    rescue
      ArgumentError ->
        reraise ArgumentError,
                "#{fun}: expected #{inspect(name)} to be a finite f32 number, got: #{inspect(x)}",
                __STACKTRACE__
    end

    defp check_f32!(x, fun, name) do
      raise ArgumentError, "#{fun}: expected #{inspect(name)} to be a number, got: #{inspect(x)}"
    end

    defp window!(_fun, nil, causal), do: {-1, if(causal, do: 0, else: -1)}

    defp window!(fun, {left, right} = w, causal) when is_integer(left) and is_integer(right) do
      if left < -1 or right < -1 do
        raise ArgumentError,
              "#{fun}: expected :window_size to be {left, right} with each >= 0 or -1 (unbounded), got: #{inspect(w)}"
      end

      cond do
        causal and right > 0 ->
          raise ArgumentError,
                "#{fun}: causal: true needs the right window to be 0 or -1, got :window_size #{inspect(w)}"

        causal ->
          {left, 0}

        true ->
          {left, right}
      end
    end

    defp window!(fun, other, _causal) do
      raise ArgumentError,
            "#{fun}: expected :window_size to be a tuple {left, right} of integers (-1 for unbounded), got: #{inspect(other)}"
    end

    defp row_tensor!(_fun, _name, nil, b, default) do
      Nx.broadcast(Nx.tensor(default, type: {:s, 32}), {b})
    end

    defp row_tensor!(fun, name, %Nx.Tensor{} = t, b, _default) do
      case {Nx.type(t), Nx.shape(t), t.vectorized_axes} do
        {{kind, _}, {^b}, []} when kind in [:s, :u] ->
          Nx.as_type(t, {:s, 32})

        {type, shape, _} ->
          raise ArgumentError,
                "#{fun}: expected #{inspect(name)} to be an integer tensor of shape {#{b}} (one per batch row), " <>
                  "got #{inspect(type)} of shape #{inspect(shape)}" <>
                  if(t.vectorized_axes != [], do: " (vectorized)", else: "")
      end
    end

    defp row_tensor!(fun, name, other, b, _default) do
      raise ArgumentError,
            "#{fun}: expected #{inspect(name)} to be an integer tensor of shape {#{b}}, got: #{inspect(other)}"
    end

    @doc false
    # The dropout rate as the f32 the contract carries, raising unless it is a
    # number in [0, 1) (also after rounding: 0.99999999 rounds to 1.0 in f32).
    def dropout_rate!(nil, _fun), do: 0.0

    def dropout_rate!(rate, fun) do
      rate = if is_number(rate), do: check_f32!(rate, fun, :dropout_rate), else: rate

      unless is_float(rate) and rate >= 0 and rate < 1 do
        raise ArgumentError,
              "#{fun}: expected :dropout_rate to be a number in [0, 1) (0 for no dropout), got: #{inspect(rate)}"
      end

      # -0.0 is no dropout too, and must give the same tag as 0.0.
      if rate == 0, do: 0.0, else: rate
    end

    # {rate, key operand or nil}: the key only when the rate is > 0 (rate 0 puts
    # nothing of dropout in the graph), but always checked when given.
    defp dropout!(fun, rate, key) do
      rate = dropout_rate!(rate, fun)
      expected = "a u32 tensor of shape {2} (as Nx.Random.key/1 returns)"

      case key && option_tensor!(fun, :dropout_key, key, expected) do
        nil when rate > 0 ->
          raise ArgumentError, "#{fun}: :dropout_rate #{rate} needs a :dropout_key, #{expected}"

        nil ->
          {rate, nil}

        {{:u, 32}, {2}} ->
          {rate, if(rate > 0, do: key)}

        {type, shape} ->
          raise ArgumentError,
                "#{fun}: expected :dropout_key to be #{expected}, got #{inspect(type)} of shape #{inspect(shape)}"
      end
    end

    # key_mask: integer {b, sk}, passed on as u8 (nonzero = visible).
    defp key_mask!(_fun, nil, _b, _sk), do: nil

    defp key_mask!(fun, t, b, sk) do
      expected = "an integer tensor of shape {#{b}, #{sk}} ({batch, seq_k}, nonzero = visible)"

      case option_tensor!(fun, :key_mask, t, expected) do
        {{kind, _}, {^b, ^sk}} when kind in [:s, :u] ->
          if Nx.type(t) == {:u, 8}, do: t, else: Nx.not_equal(t, 0)

        {type, shape} ->
          raise ArgumentError, "#{fun}: expected :key_mask to be #{expected}, got #{inspect(type)} of shape #{inspect(shape)}"
      end
    end

    # bias: float, rank 4, each dimension 1 or that of {b, h, sq, sk}; kept as it is.
    defp bias!(_fun, nil, _full), do: nil

    defp bias!(fun, t, full) do
      expected = "a float tensor of rank 4 broadcastable to {batch, heads, seq_q, seq_k} = #{inspect(full)}"

      case option_tensor!(fun, :bias, t, expected) do
        {type, _shape} when type not in @float_types ->
          raise ArgumentError,
                "#{fun}: expected :bias to have a float type (:f16, :bf16, :f32 or :f64), got #{inspect(type)}"

        {_type, {_, _, _, _} = shape} ->
          for {{n, f}, axis} <- Enum.with_index(Enum.zip(Tuple.to_list(shape), Tuple.to_list(full))), n not in [1, f] do
            raise ArgumentError,
                  "#{fun}: expected each dimension of :bias to be 1 or the full size of " <>
                    "{batch, heads, seq_q, seq_k} = #{inspect(full)}, got shape #{inspect(shape)} " <>
                    "(dimension #{axis} is #{n}, expected 1 or #{f})"
          end

          t

        {_type, shape} ->
          raise ArgumentError, "#{fun}: expected :bias to be #{expected}, got shape #{inspect(shape)}"
      end
    end

    # alibi_slopes: float {h}, passed on as f32 (the contract's type).
    defp slopes!(_fun, nil, _h), do: nil

    defp slopes!(fun, t, h) do
      expected = "a float tensor of shape {#{h}} (one slope per query head)"

      case option_tensor!(fun, :alibi_slopes, t, expected) do
        {type, {^h}} when type in @float_types ->
          Nx.as_type(t, {:f, 32})

        {type, shape} ->
          raise ArgumentError,
                "#{fun}: expected :alibi_slopes to be #{expected}, got #{inspect(type)} of shape #{inspect(shape)}"
      end
    end

    # {type, shape} of a tensor option; raises for anything else or a vectorized tensor.
    defp option_tensor!(_fun, _name, %Nx.Tensor{vectorized_axes: []} = t, _expected), do: {Nx.type(t), Nx.shape(t)}

    defp option_tensor!(fun, name, %Nx.Tensor{} = t, expected) do
      raise ArgumentError,
            "#{fun}: expected #{inspect(name)} to be #{expected}, got a vectorized tensor (axes #{inspect(t.vectorized_axes)})"
    end

    defp option_tensor!(fun, name, other, expected) do
      raise ArgumentError, "#{fun}: expected #{inspect(name)} to be #{expected}, got: #{inspect(other)}"
    end
  else
    @moduledoc false
  end
end
