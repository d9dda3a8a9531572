"""Where do the band layouts' extra L2 -> SM bytes come from? Sliding windows at N=16K (d=128,
H=16, bf16) with the band tile tables (64-key forward / dQ steps) against the wide tables
(128-key steps): time, registers and spills of every compiled kernel variant, and (under ncu, mode
``worker``) one forward + backward per variant.

    PYTHONPATH=. python benchmarks/band_tiles_check.py bench [--window 512]
    ncu ... --profile-from-start off python benchmarks/band_tiles_check.py worker --variant wide
"""

from __future__ import annotations

import argparse

import torch
import triton

import blocksparse_fa as bsfa
from blocksparse_fa.kernels import _attn_bwd, _attn_fwd
from blocksparse_fa.kernels.config import TileConfig, set_override
from blocksparse_fa.ops import triton_backend as tb
from blocksparse_fa.ops.validate import check_qkv

VARIANTS = {"band": {}, "wide": {"fwd": TileConfig(128, 128, 8, 2), "dq": TileConfig(128, 128, 8, 2)}}


def _setup(window: int, variant: str, n: int = 16384, h: int = 16, d: int = 128):
    for k in ("fwd", "dkdv", "dq"):
        set_override(k, VARIANTS[variant].get(k))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    lay = bsfa.compile_mask(bsfa.sliding_window(window), n, n, 128, device="cuda")
    s = check_qkv(q, k, v)
    scale = d ** -0.5
    fwd = lambda: tb.triton_forward(q, k, v, lay, s, scale, 0.0, 0)
    out, lse = fwd()
    bwd = lambda: tb.triton_backward(q, k, v, out, lse, do, lay, s, scale, 0.0, 0)
    return fwd, bwd


def _resources(fn) -> list:
    res = []
    for cache in getattr(fn, "device_caches", {}).values():
        for ck in cache[0].values():
            ck._init_handles()
            res.append(dict(regs=ck.n_regs, spills=ck.n_spills, shared=ck.metadata.shared,
                            warps=ck.metadata.num_warps))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["bench", "worker"])
    ap.add_argument("--variant", default="band", choices=list(VARIANTS))
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    if args.mode == "worker":
        fwd, bwd = _setup(args.window, args.variant)
        bwd()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fwd()
        bwd()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    for variant in VARIANTS:
        fwd, bwd = _setup(args.window, variant)
        g = [t.clone() for t in bwd()]
        tf = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
        tbw = triton.testing.do_bench(bwd, warmup=25, rep=100, return_mode="median")
        print(f"window {args.window} {variant}: fwd {tf:.3f} ms bwd {tbw:.3f} ms grad norm {g[0].float().norm():.4f}",
              flush=True)
    print("forward variants (regs, spills, shared):", _resources(_attn_fwd))
    print("backward variants:", _resources(_attn_bwd))
    for k in ("fwd", "dkdv", "dq"):
        set_override(k, None)


if __name__ == "__main__":
    main()
