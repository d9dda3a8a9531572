"""cProfile of the host side of fwd+bwd calls (where do the microseconds go?).

    PYTHONPATH=. python benchmarks/experiments/host_profile.py [--n 4096]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import blocksparse_fa as bsfa


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--mask", default="causal")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    N, H, D = args.n, 16, 128
    q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    mask = bsfa.load_pattern(args.mask)

    def fb():
        o = bsfa.attention(q, k, v, mask)
        torch.autograd.grad(o, (q, k, v), do)

    for _ in range(3):
        fb()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    for _ in range(args.iters):
        fb()
    pr.disable()
    print(f"host per fwd+bwd: {(time.perf_counter() - t) / args.iters * 1e6:.1f} us (profiled)")
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
