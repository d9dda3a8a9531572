"""Host-side cost of one call vs its GPU time (does launch overhead show in do_bench at small N?).

    PYTHONPATH=. python benchmarks/host_overhead.py
"""

from __future__ import annotations

import time

import torch
import triton

import blocksparse_fa as bsfa


def host_us(fn, n=50):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def main():
    H, D = 16, 128
    for N in (4096, 16384):
        for name in ("causal", "longformer"):
            mask = bsfa.load_pattern(name)
            q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            do = torch.randn_like(q)
            lay = bsfa.compile_mask(mask, N, N, 128, device="cuda")
            fwd_m = lambda: bsfa.attention(q, k, v, mask)
            fwd_l = lambda: bsfa.attention(q, k, v, lay)

            def fb():
                o = bsfa.attention(q, k, v, mask)
                torch.autograd.grad(o, (q, k, v), do)

            with torch.no_grad():
                r = dict(fwd_mask=(triton.testing.do_bench(fwd_m) * 1e3, host_us(fwd_m)),
                         fwd_layout=(triton.testing.do_bench(fwd_l) * 1e3, host_us(fwd_l)))
            r["fwd_bwd"] = (triton.testing.do_bench(fb) * 1e3, host_us(fb))
            print(f"N={N} {name}: " + ", ".join(f"{k} do_bench {a:.1f} us host {b:.1f} us" for k, (a, b) in r.items()),
                  flush=True)


if __name__ == "__main__":
    main()
