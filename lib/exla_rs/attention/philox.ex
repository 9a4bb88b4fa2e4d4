defmodule ExlaRs.Attention.Philox do
  # Nx is optional: the guard sits inside the module, as in ExlaRs.Attention.
  if Code.ensure_loaded?(Nx) do
    @moduledoc """
    Philox4x32-10 and the attention-dropout mask of the flash-attention contract
    (`docs/flash-attention-contract.md`, "Dropout"), in Nx integer ops.

    The Nx fallback draws its dropout mask here; the Host and CUDA kernels draw the
    same bits (`exla_rs_attn::philox` in Rust), and `test/data/dropout_vectors.txt`
    is the table all implementations are checked against.

    Mask entry `(b, h, i, j)` (query head `h`, query row `i`, key `j`) is kept iff
    `draw(b, h, i, j) >= floor(rate * 2^32)`, where the draw is word `j mod 4` of
    Philox4x32-10 with counter `(j div 4, i, h, b)` and key `(key[0], key[1])`.

    The `u32` arithmetic runs on `u64` tensors: a product of two `u32` values is
    exact in `u64`, so its high and low words are a shift and a mask, and nothing
    relies on how a backend wraps or converts out-of-range integers. Every constant
    is an explicit `u64` tensor: a bare integer scalar in an Nx op is narrowed to
    `s32` first, which wraps the Philox constants above 2^31.
    """

    import Bitwise

    @m0 0xD2511F53
    @m1 0xCD9E8D57
    @w0 0x9E3779B9
    @w1 0xBB67AE85
    @lo32 0xFFFFFFFF
    @u64 {:u, 64}

    @doc """
    Philox4x32-10 of a counter `{c0, c1, c2, c3}` and a key `{k0, k1}` (integer
    tensors holding `u32` values, or integers, all broadcastable together). Returns
    the four output words `{x0, x1, x2, x3}` as `u32` tensors.
    """
    def philox4x32_10({c0, c1, c2, c3}, {k0, k1}) do
      c = Enum.map([c0, c1, c2, c3], &u64/1)
      {k0, k1} = {u64(k0), u64(k1)}

      [x0, x1, x2, x3] =
        Enum.reduce(0..9, c, fn r, [c0, c1, c2, c3] ->
          # Round r uses the key bumped r times by the Weyl increments (mod 2^32).
          rk0 = k0 |> Nx.add(u64(rem(@w0 * r, 1 <<< 32))) |> Nx.bitwise_and(u64(@lo32))
          rk1 = k1 |> Nx.add(u64(rem(@w1 * r, 1 <<< 32))) |> Nx.bitwise_and(u64(@lo32))
          p0 = Nx.multiply(c0, u64(@m0))
          p1 = Nx.multiply(c2, u64(@m1))
          hi0 = Nx.right_shift(p0, u64(32))
          hi1 = Nx.right_shift(p1, u64(32))

          [
            hi1 |> Nx.bitwise_xor(c1) |> Nx.bitwise_xor(rk0),
            Nx.bitwise_and(p1, u64(@lo32)),
            hi0 |> Nx.bitwise_xor(c3) |> Nx.bitwise_xor(rk1),
            Nx.bitwise_and(p0, u64(@lo32))
          ]
        end)

      {Nx.as_type(x0, {:u, 32}), Nx.as_type(x1, {:u, 32}), Nx.as_type(x2, {:u, 32}), Nx.as_type(x3, {:u, 32})}
    end

    @doc """
    The `u32` draws of the entries `(b, h, i, j)` given as integer tensors
    (broadcastable; `b, h, i < 2^32`, `j < 2^34`), for the `u32 {2}` `key`.
    """
    def draws_at(key, b, h, i, j) do
      j = u64(j)
      lane = Nx.bitwise_and(j, u64(3))
      {x0, x1, x2, x3} = philox4x32_10({Nx.right_shift(j, u64(2)), i, h, b}, key_words(key))
      Nx.select(Nx.equal(lane, 0), x0, Nx.select(Nx.equal(lane, 1), x1, Nx.select(Nx.equal(lane, 2), x2, x3)))
    end

    @doc """
    The draws of the whole mask `{batch, heads, seq_q, seq_k}`: `u32` of that shape.
    One Philox call per four consecutive keys, as the kernels draw them.
    """
    def draws(key, {b, h, sq, sk}) do
      quads = div(sk + 3, 4)
      shape = {b, h, sq, quads}
      counter = for axis <- [3, 2, 1, 0], do: Nx.iota(shape, axis: axis, type: @u64)
      {x0, x1, x2, x3} = philox4x32_10(List.to_tuple(counter), key_words(key))

      [x0, x1, x2, x3]
      |> Nx.stack(axis: 4)
      |> Nx.reshape({b, h, sq, quads * 4})
      |> Nx.slice_along_axis(0, sk, axis: 3)
    end

    @doc """
    The keep mask (`u8`, 1 = kept) of shape `{batch, heads, seq_q, seq_k}` for
    `rate` (an f32 value in `(0, 1)`) and `key`.
    """
    def keep(key, rate, shape) do
      key |> draws(shape) |> Nx.greater_equal(Nx.tensor(threshold(rate), type: {:u, 32}))
    end

    @doc """
    The keep threshold of a rate: `floor(rate * 2^32)` of its f32 value, exact (an
    f32 times a power of two is exact in a float64).
    """
    def threshold(rate) when is_number(rate) do
      <<r::float-32>> = <<rate / 1::float-32>>
      trunc(Float.floor(r * 4_294_967_296.0))
    end

    @doc """
    The factor kept entries are multiplied by, `1 / (1 - rate)`, rounded as it is
    computed in f32 (`{:f, 32}`) or f64 (`{:f, 64}`) from the f32 rate. In f32 it is
    computed in f64 and rounded once per operation, which gives the f32 results
    (double rounding from 53 to 24 bits is harmless for `-` and `/`).
    """
    def keep_scale(rate, {:f, 64}), do: 1 / (1 - rate)
    def keep_scale(rate, _f32), do: f32(1 / f32(1 - rate))

    defp f32(x) do
      <<y::float-32>> = <<x::float-32>>
      y
    end

    # (k0, k1) = (key[0], key[1]) as u64 scalars.
    defp key_words(key) do
      key = u64(key)
      {key |> Nx.slice([0], [1]) |> Nx.reshape({}), key |> Nx.slice([1], [1]) |> Nx.reshape({})}
    end

    defp u64(x) when is_integer(x), do: Nx.tensor(x, type: @u64)
    defp u64(x), do: Nx.as_type(x, @u64)
  else
    @moduledoc false
  end
end
