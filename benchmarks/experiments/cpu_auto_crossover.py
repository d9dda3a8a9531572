"""Where dense SDPA beats block walking on this CPU: the data behind ``ops/dense.py``'s cost model.

    PYTHONPATH=. python benchmarks/experiments/cpu_auto_crossover.py [--heads 4] [--head-dim 64] [--json out.json]

For each pattern and length it times, forward and forward+backward (best of ``--reps``), the
block-walking backend (``backend="torch"``) and the dense path ``backend="auto"`` may choose, and
prints the features of the cost model (visited score elements, row blocks, dense score elements)
beside them, then fits the model's weights by least squares on log-ratios.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.ops.dense import dense_forward
from blocksparse_fa.ops.dispatch import apply
from blocksparse_fa.ops.validate import Shapes

PATTERNS = {
    "dense": "full()",
    "causal": "causal()",
    "sliding_window(256)": "causal() & sliding_window(256)",
    "longformer": "window(256) | global_tokens(64)",
    "bigbird": "bigbird",
    "strided(64)": "causal() & (sliding_window(64) | strided(64))",
}


CLOCK = time.perf_counter


def best(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        ts.append(CLOCK() - t0)
    return min(ts)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lens", default="256,512,1024,2048,4096")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with the process CPU clock (steadier on a loaded machine; use with --threads 1)")
    a = p.parse_args()
    global CLOCK
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.cpu_time:
        CLOCK = time.process_time
    torch.manual_seed(0)
    rows = []
    for L in (int(x) for x in a.lens.split(",")):
        q, k, v = (torch.randn(1, a.heads, L, a.head_dim, requires_grad=True) for _ in range(3))
        do = torch.randn(1, a.heads, L, a.head_dim)
        s = Shapes(1, a.heads, a.heads, L, L, a.head_dim)
        scale = a.head_dim ** -0.5
        for name, text in PATTERNS.items():
            lay = bsfa.compile_mask(bsfa.parse(text) if "(" in text else bsfa.load_pattern(text), L, L)
            walk = lambda: apply(q, k, v, lay, s, scale, 0.0, 0, "torch")[0]  # noqa: E731
            dense = lambda: dense_forward(q, k, v, lay, s, scale)  # noqa: E731
            dense()  # materialise and cache the mask outside the timing
            with torch.no_grad():
                wf, df = best(walk, a.reps), best(dense, a.reps)
            wb = best(lambda: torch.autograd.grad(walk(), (q, k, v), do), a.reps)
            db = best(lambda: torch.autograd.grad(dense(), (q, k, v), do), a.reps)
            bm, bn = lay.block_size
            r = dict(pattern=name, L=L, H=a.heads, D=a.head_dim, density=lay.density,
                     visited=lay.n_nonempty * bm * bn * a.heads, steps=lay.shape[-2], dense_elems=a.heads * L * L,
                     walk_fwd_ms=wf * 1e3, dense_fwd_ms=df * 1e3, walk_fwdbwd_ms=wb * 1e3, dense_fwdbwd_ms=db * 1e3)
            rows.append(r)
            print(f"{name:22s} L={L:5d} density={lay.density:.3f}  fwd walk {wf*1e3:8.1f} ms dense {df*1e3:8.1f} ms"
                  f"  fwd+bwd walk {wb*1e3:8.1f} ms dense {db*1e3:8.1f} ms", flush=True)
    # fit: time_walk = a * visited + c * steps ; time_dense = b * dense_elems (fwd+bwd)
    X = np.array([[r["visited"], r["steps"]] for r in rows], dtype=float)
    y = np.array([r["walk_fwdbwd_ms"] for r in rows])
    (aw, cs), *_ = np.linalg.lstsq(X, y, rcond=None)
    bd = float(np.sum([r["dense_fwdbwd_ms"] for r in rows]) / np.sum([r["dense_elems"] for r in rows]))
    print(f"fit (fwd+bwd, ms): walk {aw:.3e}/visited element + {cs:.3e}/row block; dense {bd:.3e}/element")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, fit=dict(walk=aw, step=cs, dense=bd)), f, indent=1)


if __name__ == "__main__":
    main()
