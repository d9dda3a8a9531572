"""The mask algebra's newer primitives on a GPU: ours against FlexAttention on the same inputs.

For every case of ``benchmarks/flex_equivalents.py`` (ranges, globals anywhere, padded batches,
per-head windows, NATTEN 2-D, STA 3-D, periodic windows, block diffusion, shared prefix, unsorted
documents) it checks that our mask and the Flex ``mask_mod`` keep the same pairs (at a small
length), then times forward and forward+backward of both (bf16, head dim 128) with
``triton.testing.do_bench``. Correctness against float64 is in ``benchmarks/validate_gpu.py``.

    PYTHONPATH=. python benchmarks/new_primitives_gpu.py [--len 16384] [--heads 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import blocksparse_fa as bsfa  # noqa: E402
from flex_equivalents import cases  # noqa: E402


def same_pairs(mask, mod, n: int, B: int, H: int) -> bool:
    dense = mask.to_dense(n, n).to("cuda").expand(B, H, n, n) if mask.batch_shape else mask.to_dense(n, n).to("cuda")
    b = torch.arange(B, device="cuda").view(B, 1, 1, 1)
    h = torch.arange(H, device="cuda").view(1, H, 1, 1)
    q = torch.arange(n, device="cuda").view(1, 1, n, 1)
    kv = torch.arange(n, device="cuda").view(1, 1, 1, n)
    ref = mod(b, h, q, kv).expand(B, H, n, n)
    return bool(torch.equal(dense.expand(B, H, n, n), ref))


def main(argv=None) -> int:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--check-len", type=int, default=2048)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    n, D = args.len, args.dim
    # one compiled FlexAttention per case (each mask_mod is its own code object): allow them all,
    # or dynamo falls back to the unfused eager path after 8 and the comparison means nothing
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    flex = torch.compile(flex_attention, dynamic=False)
    small = {name: (m, mod, bh) for name, m, mod, bh in cases(args.check_len, H=args.heads, device="cuda")}
    rows = []
    print(f"device: {torch.cuda.get_device_name()}  N={n} D={D} bf16", flush=True)
    for name, mask, mod, (B, Hm) in cases(n, H=args.heads, device="cuda"):
        m_s, mod_s, (Bs, Hs) = small[name]
        ok = same_pairs(m_s, mod_s, args.check_len, Bs, Hs)
        H = args.heads
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        lay = bsfa.compile_mask(mask, n, n, 128, device="cuda")
        bm = create_block_mask(mod, B if B > 1 else None, H if Hm > 1 else None, n, n, device="cuda")

        def ours_f():
            return bsfa.attention(q, k, v, mask=lay)

        def flex_f():
            return flex(q, k, v, block_mask=bm)

        def fb(f):
            def run():
                o = f()
                torch.autograd.grad(o, (q, k, v), do)
            return run

        t = dict(ours_fwd=do_bench(ours_f), flex_fwd=do_bench(flex_f), ours_fb=do_bench(fb(ours_f)),
                 flex_fb=do_bench(fb(flex_f)))
        r = dict(case=name, same_pairs=ok, density=lay.density, B=B, H=H, **t)
        rows.append(r)
        print(f"{'ok ' if ok else 'DIFF'} {name:28s} dens={lay.density:.4f} fwd ours {t['ours_fwd']:.3f} ms flex "
              f"{t['flex_fwd']:.3f} ms ({t['flex_fwd'] / t['ours_fwd']:.2f}x)  fwd+bwd ours {t['ours_fb']:.3f} "
              f"flex {t['flex_fb']:.3f} ({t['flex_fb'] / t['ours_fb']:.2f}x)", flush=True)
    with open(os.path.join(args.out, "new_primitives_gpu.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if all(r["same_pairs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
