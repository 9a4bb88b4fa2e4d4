#!/usr/bin/env python3
"""Cross-checks the C++ instruction models (kernels/cpu/sm90_models.cpp) against the Python model
in kernels/sm90/emulate_wgmma.py on the latter's self-check scenario: a 128 x 128 tile holding the
values 0..16383, TMA-loaded (SWIZZLE_128B) as two 64-column boxes at shared address 8192; then
the K-major operands of the 8 k-steps (the kernel's Q/K descriptors) and the MN-major operands of
8 k-steps of V (the kernel's v_desc). Input: the file `sm90_models_test --dump FILE` writes."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "sm90"))
import emulate_wgmma as em  # noqa: E402


def main(path):
    raw = np.fromfile(path, dtype=np.uint16)
    n, base = 128, 8192
    smem_words = (base + 2 * n * 128) // 2
    ours = raw[:smem_words].astype(np.float32)
    kmaj = raw[smem_words:smem_words + 8 * n * 16].reshape(8, n, 16)
    mnmaj = raw[smem_words + 8 * n * 16:].reshape(8, 16, n)

    theirs = np.zeros(smem_words, np.float32)
    tile = np.arange(n * n, dtype=np.float32).reshape(n, n)
    for c in range(2):
        em.tma_box(theirs, base + c * n * em.ROW_BYTES, tile, c * 64, 0, n)
    ok = True
    if not np.array_equal(ours[base // 2:], theirs[base // 2:]):
        print("FAIL TMA SWIZZLE_128B layout differs from emulate_wgmma.tma_box")
        ok = False
    t = em.traits(128)
    for kk in range(8):
        d = em.smem_desc(base + em.kmajor_kstep_offset(kk, n), 16, em.ATOM_BYTES)
        if not np.array_equal(kmaj[kk].astype(np.float32), em.read_kmajor(theirs, d, n)):
            print(f"FAIL K-major operand of k-step {kk} differs from emulate_wgmma.read_kmajor")
            ok = False
        if not np.array_equal(kmaj[kk].astype(np.float32), tile[:, 16 * kk:16 * kk + 16]):
            print(f"FAIL K-major operand of k-step {kk} is not the tile's columns")
            ok = False
        dv = em.v_desc(t, base, kk)
        if not np.array_equal(mnmaj[kk].astype(np.float32), em.read_mnmajor(theirs, dv, n)):
            print(f"FAIL MN-major operand of k-step {kk} differs from emulate_wgmma.read_mnmajor")
            ok = False
        if not np.array_equal(mnmaj[kk].astype(np.float32), tile[16 * kk:16 * kk + 16, :]):
            print(f"FAIL MN-major operand of k-step {kk} is not the tile's rows")
            ok = False
    print(("ok  " if ok else "FAIL") + " cross-check with emulate_wgmma.py: TMA layout, K-major and MN-major operands")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
