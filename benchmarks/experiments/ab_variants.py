"""A/B of kernel variants on the same inputs (N=16K, d=128, bf16, H=16): how the loops find LUT
block indices (loaded, prefetched, computed for contiguous lists; the ``row_arith``/``fwd_other``/
``col_arith`` kernel options) and the one-launch backward's grid order (head by head vs all dK/dV
programs first), and backward tile sizes (register spills). Each variant is a
:class:`~blocksparse_fa.KernelOptions` value passed to the timed Triton forward and backward (the
Gluon kernels, the default for dense and causal on Hopper, are off). Every variant is checked
against the first one (bit-identical results expected; the tile variants are too on the H100, as
the MMAs walk the reduction in the same order).

    PYTHONPATH=. python benchmarks/experiments/ab_variants.py [--patterns ...] [--out DIR]
    PYTHONPATH=. python benchmarks/experiments/ab_variants.py worker --pattern P --variant V   # one fwd+bwd, for ncu
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tune_sparse (here)
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.py

from tune_sparse import parallel_warm, rel  # noqa: E402

from blocksparse_fa.ops.options import KernelOptions, TileConfig  # noqa: E402

PATTERNS = ["dense", "causal", "sliding_window_1024", "document_causal", "longformer", "bigbird"]
BASE = dict(forward="triton", backward="triton")  # the Triton kernels on every pattern
# name -> kernel options (fields of KernelOptions beyond BASE); the first is the reference
VARIANTS = {
    "default": {},
    "load": dict(row_arith=False, fwd_other="load"),
    "no_prefetch": dict(fwd_other="load"),
    "no_row_arith": dict(row_arith=False),
    "col_arith": dict(col_arith=True),
    "doc_ids": dict(document_runs=False),
    "phase": dict(head_major=False),
    "headmajor": dict(head_major=True),
    # backward tiles (bit-identical to "default" on the H100, NOTES.md "Backward kernels").
    # Local sm_90 compile (sass_probe.py --kernel bwd, documents): default 64x128 / dQ 128x128 has
    # 208 B of stack and 167 spill ops; dQ 128x64: 160 B / 121; dK/dV 32x128 with dQ 128x64: none.
    "dq64": dict(dq_tiles=TileConfig(128, 64, 8, 2)),
    "dkdv32": dict(dkdv_tiles=TileConfig(32, 128, 8, 2)),
    "dkdv32_dq64": dict(dkdv_tiles=TileConfig(32, 128, 8, 2), dq_tiles=TileConfig(128, 64, 8, 2)),
    "fwd64": dict(fwd_tiles=TileConfig(128, 64, 8, 2)),
    "fwd64_s3": dict(fwd_tiles=TileConfig(128, 64, 8, 3)),
    "old_tiles": dict(dkdv_tiles=TileConfig(64, 128, 8, 2), dq_tiles=TileConfig(128, 128, 8, 2)),  # before v9
    "dkdv32_dq64_s3": dict(dkdv_tiles=TileConfig(32, 128, 8, 3), dq_tiles=TileConfig(128, 64, 8, 3)),
    # forward loop: K/V through tensor descriptors (TMA), warp specialisation, masked-loop depth
    "kv_desc": dict(kv_desc=True),
    "kv_desc_ws": dict(kv_desc=True, warp_specialize=True),
    "mstages1": dict(masked_stages=1),
    "mstages3": dict(masked_stages=3),
    "default_again": {},  # run-to-run noise
    # diagnostic, wrong results: partial tiles keep every element (the predicate's cost)
    "trivial_pred": {},
}


@triton.jit
def _keep_all(qp, kj, i, b, h, PARAMS, AUX, KEY_SIDE: tl.constexpr):
    return (qp + kj) >= -1


def options(variant: str) -> KernelOptions:
    """The kernel options of ``variant``."""
    return KernelOptions(**BASE, **VARIANTS[variant])


def _fns(p, n, variant, h=16, d=128):
    from tune_sparse import _setup

    from blocksparse_fa.ops import triton_backend as tb

    opts = options(variant)
    lay, q, k, v, do, s = _setup(p, n, d, h)
    lay.cache.clear()  # compile_mask caches layouts: rebuild LUTs, predicate and launch plans
    if variant == "trivial_pred":
        pay = tb._device_state(lay, q.device, opts)[2]
        pay.fn = _keep_all
    scale = d ** -0.5
    fwd = lambda: tb.triton_forward(q, k, v, lay, s, scale, 0.0, 0, opts=opts)
    out, lse = fwd()
    bwd = lambda: tb.triton_backward(q, k, v, out, lse, do, lay, s, scale, 0.0, 0, opts=opts)
    return fwd, bwd, out, bwd()


def warm(job):
    p, variant = job
    try:
        _fns(p, 2048, variant)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - report and go on
        return f"{job}: {type(e).__name__}: {str(e)[:300]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="bench", choices=["bench", "worker"])
    ap.add_argument("--patterns", nargs="+", default=PATTERNS)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--pattern", default="sliding_window_1024")
    ap.add_argument("--variant", default="default")
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.mode == "worker":  # one forward + backward for a profiler, after a warm-up call
        _fns(args.pattern, args.n, args.variant)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fwd, bwd, _, _ = _fns(args.pattern, args.n, args.variant)
        fwd()
        bwd()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    parallel_warm(warm, [(p, v) for p in args.patterns for v in args.variants], args.workers, "variants")
    res = {}
    for p in args.patterns:
        ref = None
        for v in args.variants:
            try:
                fwd, bwd, out, g = _fns(p, args.n, v)
            except Exception as exc:  # a variant that does not compile on this GPU/triton
                print(f"{p:20s} {v:10s} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                res[f"{p}/{v}"] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
                continue
            if ref is None:
                ref = (out[0].clone(), [t.clone() for t in g])
            err = max([rel(out[0], ref[0])] + [rel(a, b) for a, b in zip(g, ref[1])])
            tf = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
            tb_ = triton.testing.do_bench(bwd, warmup=25, rep=100, return_mode="median")
            res[f"{p}/{v}"] = dict(fwd_ms=tf, bwd_ms=tb_, max_rel_diff_vs_first=err)
            print(f"{p:20s} {v:10s} fwd {tf:.3f} ms  bwd {tb_:.3f} ms  diff vs {args.variants[0]} {err:.1e}", flush=True)
    with open(os.path.join(args.out, "ab_variants.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       n=args.n, d=128, h=16, variants={k: options(k).encode() for k in VARIANTS},
                       results=res), f, indent=1)


if __name__ == "__main__":
    main()
