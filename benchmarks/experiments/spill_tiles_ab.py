"""Backward tiles against register spills: time the backward and read the compiled kernel's
registers and local memory with the dK/dV and dQ tiles changed (16K, H = 16, d = 128, bf16, H100).

    PYTHONPATH=. python benchmarks/experiments/spill_tiles_ab.py [--out docs/data/spill_tiles_ab.json]
    PYTHONPATH=. python benchmarks/experiments/spill_tiles_ab.py --cases longformer,document_causal --variants partial

``--cases`` takes ``bench.py``'s case names (``sliding_window_W`` for any W); ``--variants`` one of
the sets below (``default`` is always the layout's own tiles).

Each variant is checked against the default variant's gradients (max abs difference) in the same
run, so a faster variant that computes something else is caught.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

import blocksparse_fa as bsfa
from blocksparse_fa.kernels import _attn_bwd
from blocksparse_fa.kernels.config import TileConfig, set_override

T = TileConfig
VARIANT_SETS = {
    # layouts on the default tables: the two tiles changed one at a time
    "wide": {"dq_128x64": {"dq": T(128, 64, 8, 2)}, "dkdv_32x128": {"dkdv": T(32, 128, 8, 2)},
             "spill_free": {"dkdv": T(32, 128, 8, 2), "dq": T(128, 64, 8, 2)},
             "dkdv_64x128_s1": {"dkdv": T(64, 128, 8, 1)}, "dq_128x128_s1": {"dq": T(128, 128, 8, 1)}},
    # partial-heavy layouts (their own tiles: dK/dV 32x128, dQ 128x64)
    "partial": {"dkdv_64x128": {"dkdv": T(64, 128, 8, 2), "dq": T(128, 64, 8, 2)},
                "dq_128x64_s3": {"dkdv": T(32, 128, 8, 2), "dq": T(128, 64, 8, 3)},
                "dkdv_32x128_w4": {"dkdv": T(32, 128, 4, 2), "dq": T(128, 64, 8, 2)},
                "dq_128x64_w4": {"dkdv": T(32, 128, 8, 2), "dq": T(128, 64, 4, 2)}},
}


def _resources() -> dict:
    """(registers, local bytes per thread) of every compiled ``_attn_bwd`` variant, by cache key."""
    out = {}
    for dev, cache in getattr(_attn_bwd, "device_caches", {}).items():
        for key, ck in cache[0].items():
            try:
                ck._init_handles()
            except Exception:  # a variant that could not be loaded (out of resources)
                continue
            out[(dev, key)] = (int(ck.n_regs), 4 * int(ck.n_spills))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--cases", default="sliding_window_8192,causal,dense")
    ap.add_argument("--variants", default="wide", choices=list(VARIANT_SETS))
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for bench.py
    from bench import make_case

    variants = {"default": {}, **VARIANT_SETS[args.variants]}
    n, h, d = args.len, 16, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    res = {}
    for pat in args.cases.split(","):
        mask, _ = make_case(pat, n)
        lay = bsfa.compile_mask(mask, n, n, 128, device="cuda")
        ref = None
        for name, ov in variants.items():
            for kk in ("dkdv", "dq"):
                set_override(kk, ov.get(kk))
            before = _resources()
            try:
                out = bsfa.attention(q, k, v, mask=lay, backend="triton")
                g = torch.autograd.grad(out, (q, k, v), do)
                torch.cuda.synchronize()
            except Exception as e:  # e.g. a tile config over the shared-memory limit
                res[f"{pat}|{name}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(f"{pat:22s} {name:16s} failed: {type(e).__name__}", flush=True)
                continue
            new = [r for key, r in _resources().items() if key not in before]
            if ref is None:
                ref = [t.float() for t in g]
            diff = max((a.float() - b).abs().max().item() for a, b in zip(g, ref))
            out = bsfa.attention(q, k, v, mask=lay, backend="triton")

            def bwd():
                torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

            ms = triton.testing.do_bench(bwd, warmup=25, rep=200, return_mode="median")
            res[f"{pat}|{name}"] = {"bwd_ms": ms, "max_abs_diff_vs_default": diff, "new_variants_regs_local": new}
            print(f"{pat:22s} {name:16s} bwd {ms:7.3f} ms  diff {diff:.2e}  (regs, local B/thread) {new}", flush=True)
        for kk in ("dkdv", "dq"):
            set_override(kk, None)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"note": "benchmarks/experiments/spill_tiles_ab.py on the H100; bwd_ms = do_bench median of "
                               "autograd.grad (preprocess + _attn_bwd)", "n": n, "heads": h, "head_dim": d,
                       "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
