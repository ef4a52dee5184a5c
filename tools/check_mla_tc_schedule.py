#!/usr/bin/env python3
"""Row-level emulation of the GPU tensor-core MLA prefill's schedule (src/ops/cuda/mla_tc.cu).

The kernel's control flow in numpy, row by row: the host's loop over key chunks, blocks of 64 query
rows that return when every row ended before the chunk, key tiles of 64 up to the block's last
needed key, the causal / chunk-end masks, the online softmax with its running (o, m, l) carried to
the next chunk through the output and the workspace, and the normalisation in the chunk that holds
the row's own position. Compared with a direct softmax per query (fp64); exits 1 on a mismatch.
It checks the indexing and carrying, not the MMA fragments or bf16 rounding (the device tests do).

Usage: python3 tools/check_mla_tc_schedule.py   (numpy; the tools venv has it)
"""
import sys

import numpy as np

BM = BN = 64


def emulate(q, k, v, pos0, kc):
    T, S = q.shape[0], k.shape[0]
    dv = v.shape[1]
    out = np.full((T, dv), np.nan)
    ml = np.full((T, 2), np.nan)
    for k0 in range(0, S, kc):  # host: one gather + expansion + attention launch per chunk
        kn = min(kc, S - k0)
        for r0 in range(0, T, BM):  # blocks
            p_first, p_last = pos0 + r0, pos0 + min(r0 + BM - 1, T - 1)
            if p_last < k0:
                continue
            key_end = min(kn, p_last - k0 + 1)
            for row in range(r0, r0 + BM):
                pos = pos0 + row if row < T else -1
                if k0 > 0 and pos >= k0:
                    m, l, o = ml[row, 0], ml[row, 1], out[row].copy()
                else:
                    m, l, o = -np.inf, 0.0, np.zeros(dv)
                qq = q[row] if row < T else np.zeros(q.shape[1])
                for kb in range(0, key_end, BN):  # tiles
                    keys = np.arange(kb, kb + BN)
                    live = keys < key_end
                    s = np.where(live, k[np.minimum(k0 + keys, S - 1)] @ qq, 0.0)
                    if kb + BN > key_end or k0 + kb + BN - 1 > p_first:
                        s[(keys >= key_end) | (k0 + keys > pos)] = -np.inf
                    mn = max(m, s.max())
                    ref = 0.0 if mn == -np.inf else mn
                    alpha = np.exp(m - ref)
                    m = mn
                    p = np.exp(s - ref)
                    l = l * alpha + p.sum()
                    vv = np.where(live[:, None], v[np.minimum(k0 + keys, S - 1)], 0.0)
                    o = o * alpha + p @ vv
                if pos < k0:
                    continue
                if pos < k0 + kn:
                    out[row] = o / l
                else:
                    out[row], ml[row] = o, (m, l)
    return out


def main():
    rng = np.random.default_rng(1)
    worst = 0.0
    for T, pos0, kc in [(1, 0, 64), (16, 0, 64), (70, 0, 64), (300, 200, 64), (129, 1000, 192), (513, 1500, 5440),
                        (48, 0, 128), (200, 100, 128), (64, 63, 64), (65, 64, 128), (100, 3, 64)]:
        S = pos0 + T
        q, k, v = rng.standard_normal((T, 8)), rng.standard_normal((S, 8)), rng.standard_normal((S, 6))
        got = emulate(q, k, v, pos0, kc)
        want = np.empty_like(got)
        for t in range(T):
            sc = k[:pos0 + t + 1] @ q[t]
            w = np.exp(sc - sc.max())
            want[t] = (w / w.sum()) @ v[:pos0 + t + 1]
        err = float(np.abs(got - want).max())
        worst = max(worst, err)
        print(f"T={T:4d} pos0={pos0:5d} chunk={kc:5d}: max |error| {err:.2e}")
    ok = worst < 1e-12
    print("schedule OK" if ok else "schedule MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
