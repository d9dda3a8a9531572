"""The Gluon kernels' list mode (``compiler/block_lists.py``) on the GPU: correctness first.

For block masks whose partial blocks hold at most two key runs per row (and full-block ones), at
small sizes and in several shapes (GQA, head dim 64, per-batch layouts, empty rows), every output
and gradient of ``bsfa.attention`` with the list mode (``block_lists=True``) and without it
(``block_lists=False``: the Triton block kernels) is compared with float64; the list mode must be
within ``TOL`` times the Triton kernels' error and must have run (``select.record``).

    PYTHONPATH=. python benchmarks/experiments/block_lists_gpu.py [--n 2048] [--out $OUT]

Results: ``$OUT/block_lists_gpu.json`` and one line per case on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import blocksparse_fa as bsfa
from blocksparse_fa.ops import select

TOL = 1.5  # the list mode's error at most this multiple of the Triton block kernels' (+ an absolute floor)


def _ids(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(128, 700, (n // 128,), generator=g)
    return torch.repeat_interleave(torch.arange(len(lens)), lens)[:n]


def cases(n: int):
    starts = torch.tensor([n // 2, n * 5 // 16, n * 3 // 4])
    return [
        ("sliding tiles (full blocks)", bsfa.sliding_tiles((1, 32, n // 32), (1, 8, 16), (1, 3, 3)), 1, 8, 8, 128),
        ("Longformer", bsfa.load_pattern("longformer", window=200, n_global=64), 1, 8, 8, 128),
        ("Longformer GQA d64", bsfa.load_pattern("longformer", window=256, n_global=64), 1, 8, 2, 64),
        ("causal Longformer", bsfa.causal() & (bsfa.sliding_window(300) | bsfa.global_tokens(40)), 1, 4, 4, 128),
        ("key_range | causal", bsfa.key_range(n // 8, n // 8 + n // 16) | bsfa.causal(), 1, 4, 2, 128),
        ("BigBird", bsfa.load_pattern("bigbird", window=150, n_global=128, n_random=2), 1, 8, 8, 128),
        ("empty rows, two runs", bsfa.query_range(200, n - 300) & (bsfa.key_range(n // 2, n // 2 + 200)
                                                                   | bsfa.causal()), 1, 4, 4, 128),
        ("per batch key ranges, two runs", bsfa.key_range(bsfa.per_batch(starts), bsfa.per_batch(starts + 200))
         | bsfa.causal(), 3, 4, 4, 128),
        ("shared prefix", bsfa.load_pattern("shared_prefix", prefix=200, document=_ids(n)), 1, 4, 4, 128),
    ]


def run(fn, q, k, v, do):
    with select.record() as ran:
        out = fn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), do)
    return [c for _, c in ran], (out, *grads)


def err(a, ref):
    return float((a.detach().double() - ref.detach()).abs().max() / ref.detach().abs().max().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows, bad = [], 0
    for name, mask, B, H, Hkv, D in cases(a.n):
        torch.manual_seed(0)
        q = torch.randn(B, H, a.n, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, Hkv, a.n, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)
        layout = bsfa.compile_mask(mask, a.n, a.n, block_size=128, device=dev)
        ref = run(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, backend="torch"),
                  *(t.detach().double().requires_grad_() for t in (q, k, v)), do.double())[1]
        res = {"case": name, "lists": select.layout_class(layout).lists}
        for tag, opts in (("list", {"block_lists": True}), ("triton", {"block_lists": False})):
            t0 = time.perf_counter()
            ran, got = run(lambda q, k, v: bsfa.attention(q, k, v, mask=layout, kernel_options=opts), q, k, v, do)
            torch.cuda.synchronize()
            res[tag] = {"ran": ran, "err": [err(g, r) for g, r in zip(got, ref)],
                        "finite": all(bool(torch.isfinite(g).all()) for g in got),
                        "first_call_s": round(time.perf_counter() - t0, 2)}
        # Longformer's forward splits by default (global_split): the list mode runs its backward
        ok = (res["list"]["finite"] and res["list"]["ran"][-1] == "gluon:list"
              and all(e <= TOL * t + 2e-3 for e, t in zip(res["list"]["err"], res["triton"]["err"])))
        res["ok"] = ok
        bad += not ok
        rows.append(res)
        print(f"{'PASS' if ok else 'FAIL'} {name}: list {res['list']['ran']} err "
              f"{['%.2e' % e for e in res['list']['err']]} | triton {res['triton']['ran']} err "
              f"{['%.2e' % e for e in res['triton']['err']]}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "block_lists_gpu.json"), "w") as f:
        json.dump({"n": a.n, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": __import__("triton").__version__, "cases": rows}, f, indent=1)
    print(f"{len(rows) - bad}/{len(rows)} PASS")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
