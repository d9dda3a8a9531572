"""Tile-config sweep for the sparse patterns of bench.py's suite (N=16K, d=128, bf16, H=16).

Kernels are compiled first by parallel workers (Triton's disk cache), then each config is timed
with ``do_bench`` and checked against the default config's result in the same run. A config is the
``fwd_tiles``/``dkdv_tiles``/``dq_tiles`` kernel option of the Triton kernels (``forward="triton"``,
``backward="triton"``: the Gluon kernels are off for dense and causal).

    PYTHONPATH=. python benchmarks/experiments/tune_sparse.py [--patterns ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.py

FWD = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4),
       (64, 128, 4, 2), (128, 128, 8, 2)]
DKDV = [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 2),
        (128, 128, 8, 1)]
DQ = [(128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 8, 3), (64, 64, 4, 2)]
PATTERNS = ["sliding_window_1024", "longformer", "bigbird", "document_causal", "causal", "dense"]


def _setup(name, n, d, h):
    import bench

    import blocksparse_fa as bsfa
    from blocksparse_fa.ops.validate import check_qkv

    mask, _ = bench.make_case(name, n)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    lay = bsfa.compile_mask(mask, n, n, 128, device="cuda")
    return lay, q, k, v, do, check_qkv(q, k, v)


def options(kernel, cfg):
    """Kernel options with ``cfg`` (a tuple of :class:`TileConfig` fields) as the tiles of
    ``kernel`` (``"fwd"``, ``"dkdv"`` or ``"dq"``), on the Triton kernels."""
    from blocksparse_fa.ops.options import KernelOptions, TileConfig

    return KernelOptions(forward="triton", backward="triton", **{f"{kernel}_tiles": TileConfig(*cfg)})


def _run(kernel, cfg, lay, q, k, v, do, s):
    from blocksparse_fa.ops import triton_backend
    from blocksparse_fa.ops.triton_backend import triton_backward, triton_forward

    triton_backend._FALLBACK.clear()  # a config that does not fit must fail here, not be replaced
    opts = options(kernel, cfg)
    scale = q.shape[-1] ** -0.5
    if kernel == "fwd":
        fn = lambda: triton_forward(q, k, v, lay, s, scale, 0.0, 0, opts=opts)
        return fn, fn()
    out, lse = triton_forward(q, k, v, lay, s, scale, 0.0, 0, opts=opts)
    fn = lambda: triton_backward(q, k, v, out, lse, do, lay, s, scale, 0.0, 0, opts=opts)
    return fn, fn()


def warm(job):
    name, kernel, cfg, d, h = job
    try:
        lay, q, k, v, do, s = _setup(name, 2048, d, h)
        _run(kernel, cfg, lay, q, k, v, do, s)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - report and go on
        return f"{job}: {type(e).__name__}: {str(e)[:200]}"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def parallel_warm(warm_fn, jobs, workers: int, what: str = "kernels") -> None:
    """Compile ahead in ``workers`` spawned processes (Triton's disk cache keeps the binaries);
    ``warm_fn(job)`` returns None or an error line, which is printed."""
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        for r in pool.imap_unordered(warm_fn, jobs):
            if r:
                print("warm:", r, flush=True)
    print(f"warm-up of {len(jobs)} {what}: {time.time() - t0:.0f} s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--patterns", nargs="+", default=PATTERNS)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    h = 16
    jobs = [(p, kn, c, args.d, h) for p in args.patterns for kn, cs in (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ))
            for c in cs]
    parallel_warm(warm, jobs, args.workers)
    results = {}
    for p in args.patterns:
        lay, q, k, v, do, s = _setup(p, args.n, args.d, h)
        for kn, cs in (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ)):
            ref = None
            rows = []
            for c in cs:
                try:
                    fn, out = _run(kn, c, lay, q, k, v, do, s)
                    from blocksparse_fa.ops import triton_backend
                    if triton_backend._FALLBACK:
                        rows.append((c, None, "out of shared memory"))
                        continue
                    out = out[0] if kn == "fwd" else (out[1] if kn == "dkdv" else out[0])
                    if ref is None:
                        ref = out.clone()
                    err = rel(out, ref)
                    ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                    rows.append((c, ms, err))
                except Exception as e:  # noqa: BLE001
                    rows.append((c, None, f"{type(e).__name__}"))
            best = min((r for r in rows if r[1] is not None and isinstance(r[2], float) and r[2] < 2e-2),
                       key=lambda r: r[1])
            line = "  ".join(f"{c}:{ms:.3f}" if ms else f"{c}:{err}" for c, ms, err in rows)
            print(f"{p:20s} {kn:5s} best {best[0]} {best[1]:.3f} ms | {line}", flush=True)
            results[f"{p}/{kn}"] = [dict(cfg=c, ms=ms, err=err if isinstance(err, float) else str(err)) for c, ms, err in rows]
    with open(os.path.join(args.out, "tune_sparse.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       n=args.n, d=args.d, results=results), f, indent=1)


if __name__ == "__main__":
    main()
