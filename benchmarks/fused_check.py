"""Backward in one launch (dK/dV + dQ programs) vs two launches: time and agreement, same inputs.

    PYTHONPATH=. python benchmarks/fused_check.py [--n 16384] [--d 128]
"""

from __future__ import annotations

import argparse
import os
import sys

import triton

sys.path.insert(0, os.path.dirname(__file__))


def main():
    import bench
    from tune_sparse import _setup

    from blocksparse_fa.ops import triton_backend as tb

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--patterns", nargs="+", default=bench.PATTERNS)
    args = ap.parse_args()
    n, d, h = args.n, args.d, 16
    for p in args.patterns:
        lay, q, k, v, do, s = _setup(p, n, d, h)  # same inputs as the tile sweep
        scale = d ** -0.5
        out, lse = tb.triton_forward(q, k, v, lay, s, scale, 0.0, 0)
        res = {}
        for fused in (False, True):
            tb.set_fused_backward(fused)
            fn = lambda: tb.triton_backward(q, k, v, out, lse, do, lay, s, scale, 0.0, 0)
            g = fn()
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            res[fused] = (ms, g)
        tb.set_fused_backward(True)
        err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(res[True][1], res[False][1]))
        print(f"{p:20s} N={n} d={d} backward two launches {res[False][0]:.3f} ms, one launch {res[True][0]:.3f} ms "
              f"({res[False][0] / res[True][0]:.2f}x), max rel diff {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
