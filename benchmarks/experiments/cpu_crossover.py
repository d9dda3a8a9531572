"""Block walking against dense SDPA on the CPU: where ``backend="auto"`` should switch.

    PYTHONPATH=. python benchmarks/experiments/cpu_crossover.py --out cpu_crossover.json [--md cpu_crossover.md]
        [--heads 8] [--head-dim 64] [--lens 512,1024,2048,4096] [--reps 5] [--threads 0]

For each pattern and length it times, forward and forward+backward, the exact block-walking
backend (``backend="torch"``) and the dense path (PyTorch's SDPA over the materialised mask, what
``backend="auto"`` may choose, ``ops/dense.py``). The two are run alternately, ``--reps`` times
each, and the medians kept: on a shared machine both see the same load. Each row also says what
:func:`~blocksparse_fa.ops.dense.prefer_dense` picks and how much slower that pick is than the
faster of the two. The script ends with a least-squares fit of the cost model's weights
(``COST``) to the forward+backward medians. Results go to ``--out`` (JSON) and a markdown table
(``--md``, and stdout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.ops.dense import COST, dense_forward, prefer_dense
from blocksparse_fa.ops.dispatch import apply
from blocksparse_fa.ops.validate import Shapes

PATTERNS = {
    "full": "full()",
    "causal": "causal()",
    "sliding_window(256)": "causal() & sliding_window(256)",
    "longformer": "longformer",
    "bigbird": "bigbird",
    "strided": "sparse_transformer_strided",
}


def _medians(fns: dict, reps: int) -> dict:
    """Median wall time (ms) of each callable, run alternately ``reps`` times after one warm-up."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _mask(text: str):
    return bsfa.parse(text) if "(" in text else bsfa.load_pattern(text)


def measure(pattern: str, L: int, H: int, D: int, reps: int) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, requires_grad=True) for _ in range(3))
    do = torch.randn(1, H, L, D)
    s = Shapes(1, H, H, L, L, D)
    scale = D ** -0.5
    lay = bsfa.compile_mask(_mask(PATTERNS[pattern]), L, L)
    walk = lambda: apply(q, k, v, lay, s, scale, 0.0, 0, "torch")[0]  # noqa: E731
    dense = lambda: dense_forward(q, k, v, lay, s, scale)  # noqa: E731
    with torch.no_grad():
        fwd = _medians({"walk": walk, "dense": dense}, reps)
    fb = _medians({"walk": lambda: torch.autograd.grad(walk(), (q, k, v), do),
                   "dense": lambda: torch.autograd.grad(dense(), (q, k, v), do)}, reps)
    bm, bn = lay.block_size
    auto = "dense" if prefer_dense(lay, s, 0.0) else "walk"
    return dict(pattern=pattern, L=L, H=H, D=D, density=lay.density, visited=lay.n_nonempty * bm * bn * H,
                row_blocks=lay.shape[-2], dense_elems=H * L * L, walk_fwd_ms=fwd["walk"], dense_fwd_ms=fwd["dense"],
                walk_fwdbwd_ms=fb["walk"], dense_fwdbwd_ms=fb["dense"], auto=auto,
                auto_over_best_fwdbwd=fb[auto] / min(fb.values()), auto_over_dense_fwdbwd=fb[auto] / fb["dense"],
                auto_over_best_fwd=fwd[auto] / min(fwd.values()))


def fit(rows: list) -> dict:
    """Weights of ``walk = visited + step · row blocks`` against ``dense · elements`` (forward+backward),
    in units of one walked element (as ``ops/dense.COST``)."""
    X = np.array([[r["visited"], r["row_blocks"]] for r in rows], dtype=float)
    y = np.array([r["walk_fwdbwd_ms"] for r in rows])
    (per_visited, per_step), *_ = np.linalg.lstsq(X, y, rcond=None)
    per_dense = float(np.median([r["dense_fwdbwd_ms"] / r["dense_elems"] for r in rows]))
    return dict(ms_per_visited=float(per_visited), ms_per_row_block=float(per_step), ms_per_dense=per_dense,
                cost=dict(dense=per_dense / per_visited, walk=1.0, step=per_step / per_visited))


def table(rows: list) -> str:
    head = ("| pattern | L | density | walk fwd | dense fwd | walk fwd+bwd | dense fwd+bwd | auto picks | "
            "auto / faster |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['pattern']} | {r['L']} | {r['density']:.2f} | {r['walk_fwd_ms']:.1f} | {r['dense_fwd_ms']:.1f} | "
             f"{r['walk_fwdbwd_ms']:.1f} | {r['dense_fwdbwd_ms']:.1f} | {r['auto']} | "
             f"{r['auto_over_best_fwdbwd']:.2f} |" for r in rows]
    return head + "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--md", default=None, help="also write the markdown table here")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lens", default="512,1024,2048,4096")
    p.add_argument("--patterns", default=",".join(PATTERNS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    for L in (int(x) for x in a.lens.split(",")):
        for name in a.patterns.split(","):
            r = measure(name, L, a.heads, a.head_dim, a.reps)
            rows.append(r)
            print(f"{name:20s} L={L:5d} density={r['density']:.2f}  fwd walk {r['walk_fwd_ms']:9.1f} dense "
                  f"{r['dense_fwd_ms']:9.1f}  fwd+bwd walk {r['walk_fwdbwd_ms']:9.1f} dense "
                  f"{r['dense_fwdbwd_ms']:9.1f} ms  auto: {r['auto']}", flush=True)
    result = dict(threads=torch.get_num_threads(), torch=torch.__version__, cost_model=dict(COST), rows=rows,
                  fit=fit(rows) if len(rows) >= 2 else None)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    md = table(rows)
    if result["fit"]:
        c = result["fit"]["cost"]
        md += f"\nFitted weights: dense {c['dense']:.3f}, walk 1, step {c['step']:.0f} (threads={result['threads']}).\n"
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)
    print(md)


if __name__ == "__main__":
    main()
