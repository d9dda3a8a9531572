"""Quick GPU correctness smoke test: outputs and all three gradients of the Triton kernels against a
float64 reference for a few patterns, head dims 64 and 128 (the two backward launch modes), with
GQA and a ragged length.

    PYTHONPATH=. python benchmarks/smoke_gpu.py
"""

from __future__ import annotations

import torch

import blocksparse_fa as bsfa


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def main() -> int:
    bad = 0
    for d in (64, 128):
        for name in ("causal", "longformer", "bigbird", "sliding_window"):
            n, h, hkv = 2000, 8, 2
            torch.manual_seed(0)
            q = torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            do = torch.randn_like(q)
            mask = bsfa.load_pattern(name)
            out = bsfa.attention(q, k, v, mask)
            g = torch.autograd.grad(out, (q, k, v), do)
            qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
            ref = bsfa.reference_attention(qd, kd, vd, mask)
            gr = torch.autograd.grad(ref, (qd, kd, vd), do.double())
            errs = [rel(out, ref)] + [rel(a, b) for a, b in zip(g, gr)]
            ok = all(e < 1e-2 for e in errs) and torch.isfinite(out).all()
            bad += not ok
            print(f"{'PASS' if ok else 'FAIL'} d={d} {name:15s} O/dQ/dK/dV " + "/".join(f"{e:.1e}" for e in errs), flush=True)
    print("all passed" if not bad else f"{bad} failed")
    return int(bad > 0)


if __name__ == "__main__":
    raise SystemExit(main())
