"""The numpy Philox4x32-10 / dropout-mask reference (philox_ref.py) against Random123's published
known-answer vectors and the committed cross-implementation table (test/data/dropout_vectors.txt,
which the Rust and Elixir implementations are checked against too)."""

import numpy as np
import pytest

import philox_ref as ref

# Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter[4] key[2] -> output[4].
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_known_answers(ctr, key, expected):
    assert [int(x) for x in ref.philox4x32_10(ctr, key)] == list(expected)


def test_known_answers_vectorised():
    # The same vectors as one batched call (how the masks are computed).
    ctr = [np.array([c[w] for c, _, _ in KAT], dtype=np.uint32) for w in range(4)]
    key = [np.array([k[w] for _, k, _ in KAT], dtype=np.uint32) for w in range(2)]
    out = ref.philox4x32_10(ctr, key)
    assert [[int(out[w][n]) for w in range(4)] for n in range(3)] == [list(e) for _, _, e in KAT]


def test_draw_is_the_contract_counter_mapping():
    # Entry (b, h, i, j): the upper 16 bits are half (j mod 2) of word (j mod 8) div 2 of
    # Philox4x32-10((j div 8, i, h, b), key), the lower 16 the same half of the call with
    # counter word 0 + 2^31.
    key = (0x243F6A88, 0x85A308D3)
    x = [int(w) for w in ref.philox4x32_10((5, 9, 2, 1), key)]
    y = [int(w) for w in ref.philox4x32_10((5 + 2**31, 9, 2, 1), key)]
    for lane in range(8):
        half = lambda w: (w[lane // 2] >> (16 * (lane % 2))) & 0xFFFF  # noqa: E731
        assert int(ref.dropout_draw(key, 1, 2, 9, 40 + lane)) == half(x) << 16 | half(y)
    # The top of the j range: j div 8 = 2^31 - 1, so y's counter word 0 is 2^32 - 1.
    top = 2**34 - 1
    x = [int(w) for w in ref.philox4x32_10((2**31 - 1, 0, 0, 0), key)]
    y = [int(w) for w in ref.philox4x32_10((2**32 - 1, 0, 0, 0), key)]
    assert int(ref.dropout_draw(key, 0, 0, 0, top)) == (x[3] >> 16) << 16 | (y[3] >> 16)


def test_committed_table_is_current():
    assert ref.VECTORS.read_text().splitlines() == ref.table_lines()


def test_threshold_rule():
    assert ref.threshold(0.5) == 2**31
    assert ref.threshold(0.25) == 2**30
    assert ref.threshold(np.float32(0.99999994)) == 2**32 - 2**8
    assert ref.threshold(0.1) == int(np.float64(np.float32(0.1)) * 2**32)
    # Below 2^-32 the threshold is 0: everything is kept.
    assert ref.threshold(2**-33) == 0


def test_keep_scale_is_f32_arithmetic():
    assert ref.keep_scale(0.5) == np.float32(2.0)
    assert ref.keep_scale(0.1).dtype == np.float32
    assert ref.keep_scale(0.1) == np.float32(1) / np.float32(np.float32(1) - np.float32(0.1))


def test_mask_statistics():
    # Kept fraction within 4 sigma of 1 - rate; head h differs from head h + 1; keys differ.
    rate = 0.1
    m = ref.mask((0, 42), rate, (2, 4, 64, 64))
    n = m.size
    p = 1 - ref.f32(rate)
    assert abs(m.mean() - p) < 4 * np.sqrt(p * (1 - p) / n)
    assert (m[:, 0] != m[:, 1]).any()
    assert (m != ref.mask((0, 43), rate, (2, 4, 64, 64))).any()
    assert (m == ref.mask((0, 42), rate, (2, 4, 64, 64))).all()
