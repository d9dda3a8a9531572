"""Tile-config sweep for the three kernels on the GPU (dense and causal, bf16, N=16K, H=16).

Each candidate is checked against an fp32 SDPA reference before it is timed; failing or
out-of-resource candidates are skipped. Prints the best config per (kernel, head dim). Candidates
are the ``fwd_tiles``/``dkdv_tiles``/``dq_tiles`` kernel options of the Triton kernels (the Gluon
kernels, the default for dense and causal on Hopper, are turned off: ``forward="triton"``,
``backward="triton"``).

    PYTHONPATH=. python benchmarks/experiments/tune.py [--dims 128 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

import blocksparse_fa as bsfa
from blocksparse_fa.ops.options import KernelOptions, TileConfig
from blocksparse_fa.ops.triton_backend import triton_backward, triton_forward
from blocksparse_fa.ops.validate import check_qkv

FWD = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 4),
       (64, 128, 4, 3), (128, 32, 4, 3)]
DKDV = [(32, 64, 4, 2), (64, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2), (64, 128, 8, 3), (64, 64, 8, 3),
        (32, 128, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2)]
# kernel -> its tiles' kernel option
FIELD = {"fwd": "fwd_tiles", "dkdv": "dkdv_tiles", "dq": "dq_tiles"}
TRITON = dict(forward="triton", backward="triton")  # the Triton kernels whose tiles are swept

DQ = [(64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 3), (64, 64, 8, 3),
      (128, 128, 8, 2), (64, 32, 4, 3)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--masks", nargs="+", default=["causal", "dense"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    N, H = args.n, 16
    results = {}
    for D in args.dims:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        shapes = check_qkv(q, k, v)
        scale = D ** -0.5
        for mname, mask, causal in (("causal", bsfa.causal(), True), ("dense", bsfa.full(), False)):
            if mname not in args.masks:
                continue
            lay = bsfa.compile_mask(mask, N, N, 128, device="cuda")
            qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
            gref = torch.autograd.grad(ref, (qr, kr, vr), do.float())
            ref = ref.detach()
            flops = 4 * H * N * N * D * (0.5 if causal else 1.0)
            best_tiles = {}  # kernel option -> the best tiles so far (dq is tuned with the best dkdv)
            for kernel, cands in (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ)):
                best = None
                for c in cands:
                    opts = KernelOptions(**TRITON, **{**best_tiles, FIELD[kernel]: TileConfig(*c)})
                    try:
                        out, lse = triton_forward(q, k, v, lay, shapes, scale, 0.0, 0, opts=opts)
                        if kernel == "fwd":
                            err = rel(out, ref)
                            fn = lambda: triton_forward(q, k, v, lay, shapes, scale, 0.0, 0, opts=opts)
                        else:
                            g = triton_backward(q, k, v, out, lse, do, lay, shapes, scale, 0.0, 0, opts=opts)
                            err = max(rel(a, b) for a, b in zip(g, gref))
                            fn = lambda: triton_backward(q, k, v, out, lse, do, lay, shapes, scale, 0.0, 0, opts=opts)
                        if not err < 3e-2:
                            print(f"  {kernel} {c}: WRONG err={err:.2e}", flush=True)
                            continue
                        ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                    except Exception as e:  # out of resources etc.
                        print(f"  {kernel} {c}: {type(e).__name__}", flush=True)
                        continue
                    tf = flops * (2.5 if kernel != "fwd" else 1.0) / ms / 1e9
                    print(f"  D={D} {mname:6s} {kernel:4s} {c}: {ms:.3f} ms  ({tf:.0f} TFLOP/s {'bwd-total' if kernel != 'fwd' else ''}) err {err:.1e}", flush=True)
                    if best is None or ms < best[1]:
                        best = (c, ms)
                # keep the best for the following kernels (dq is tuned with the best dkdv)
                if best:
                    best_tiles[FIELD[kernel]] = TileConfig(*best[0])
                    results[f"{D}/{mname}/{kernel}"] = best
                    print(f"BEST D={D} {mname} {kernel}: {best[0]} {best[1]:.3f} ms", flush=True)
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
