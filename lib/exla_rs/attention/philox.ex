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
    `draw(b, h, i, j) >= floor(rate * 2^32)`. With `x` and `y` Philox4x32-10 of the
    counters `(j div 8, i, h, b)` and `(2^31 + j div 8, i, h, b)` under the key
    `(key[0], key[1])`, and `half(w, j) = (w[(j mod 8) div 2] >> (16 * (j mod 2))) & 0xFFFF`
    (the four words of one call, read as eight little-endian `u16`, are the halves of
    keys `8q .. 8q + 7`), the draw is the `u32` `half(x, j) * 2^16 + half(y, j)`.
    The kernels compute `y` only where an upper half ties with the threshold's; this
    module computes both everywhere (two calls per eight keys), which gives the same bits.

    The `u32` arithmetic runs on `u64` tensors: a product of two `u32` values is
    exact in `u64`, so its high and low words are a shift and a mask, and nothing
    relies on how a backend wraps or converts out-of-range integers (the halves are
    joined in `u32` with masks before shifts, so nothing leaves 32 bits there either).
    Every constant is an explicit `u64` or `u32` tensor: a bare integer scalar in an Nx
    op is narrowed to `s32` first, which wraps the Philox constants above 2^31.
    """

    import Bitwise

    @m0 0xD2511F53
    @m1 0xCD9E8D57
    @w0 0x9E3779B9
    @w1 0xBB67AE85
    @lo32 0xFFFFFFFF
    @u64 {:u, 64}
    # Counter word 0's top bit: the second (lower-half) stream.
    @y_stream 0x80000000

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
      q = Nx.right_shift(j, u64(3))
      key = key_words(key)
      x = philox4x32_10({q, i, h, b}, key)
      y = philox4x32_10({Nx.bitwise_or(q, u64(@y_stream)), i, h, b}, key)
      # half(w, j): word (j mod 8) div 2, shifted right by 16 * (j mod 2).
      word = j |> Nx.right_shift(u64(1)) |> Nx.bitwise_and(u64(3))
      shift = j |> Nx.bitwise_and(u64(1)) |> Nx.multiply(u64(16))

      half = fn {w0, w1, w2, w3} ->
        w = Nx.select(Nx.equal(word, 0), w0, Nx.select(Nx.equal(word, 1), w1, Nx.select(Nx.equal(word, 2), w2, w3)))
        w |> u64() |> Nx.right_shift(shift) |> Nx.bitwise_and(u64(0xFFFF))
      end

      half.(x) |> Nx.left_shift(u64(16)) |> Nx.bitwise_or(half.(y)) |> Nx.as_type({:u, 32})
    end

    @doc """
    The draws of the whole mask `{batch, heads, seq_q, seq_k}`: `u32` of that shape.
    The counters `{batch, heads, seq_q, ceil(seq_k / 8)}` are built once; one Philox
    call gives the upper halves (`x`) and one the lower halves (`y`) of eight
    consecutive keys each.
    """
    def draws(key, {b, h, sq, sk}) do
      octs = div(sk + 7, 8)
      shape = {b, h, sq, octs}
      [c0, c1, c2, c3] = for axis <- [3, 2, 1, 0], do: Nx.iota(shape, axis: axis, type: @u64)
      key = key_words(key)
      # {b, h, sq, octs, 4}: word w of each call holds the halves of keys 8q + 2w (low)
      # and 8q + 2w + 1 (high).
      x = {c0, c1, c2, c3} |> philox4x32_10(key) |> Tuple.to_list() |> Nx.stack(axis: 4)
      y = {Nx.bitwise_or(c0, u64(@y_stream)), c1, c2, c3} |> philox4x32_10(key) |> Tuple.to_list() |> Nx.stack(axis: 4)
      low16 = u32(0xFFFF)
      high16 = u32(0xFFFF0000)
      # Key 8q + 2w: low halves of x and y; key 8q + 2w + 1: high halves. Masks before
      # shifts, so no value leaves u32.
      even = x |> Nx.bitwise_and(low16) |> Nx.left_shift(u32(16)) |> Nx.bitwise_or(Nx.bitwise_and(y, low16))
      odd = x |> Nx.bitwise_and(high16) |> Nx.bitwise_or(Nx.right_shift(y, u32(16)))

      [even, odd]
      |> Nx.stack(axis: 5)
      |> Nx.reshape({b, h, sq, octs * 8})
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

    defp u32(x) when is_integer(x), do: Nx.tensor(x, type: {:u, 32})
  else
    @moduledoc false
  end
end
