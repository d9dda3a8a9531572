"""Global-token masks at 64K: the backward split into the band and the global parts against the
whole mask's list backward (``select.choose_global_split``'s ``whole`` in the backward phase), on
the GPU.

Per mask (``bench.py``'s Longformer and causal Longformer) and kv heads (16, 4), 64K tokens, H 16,
d 128, bf16: both rules take turns in two passes (the split-choice cache and the replays cleared
between them); each prints its kernels (``torch.profiler``, GPU ms by kernel over 5 calls) and the
``do_bench`` fwd+bwd wall time, and the gradients of the two rules are compared (max |difference|
over max |value|; both are bf16 results of exact algorithms).

    PYTHONPATH=. python benchmarks/experiments/split_backward_gpu.py [--n 65536] [--masks ...]

Results: ``$OUT/split_backward_64k.json``.
"""

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import blocksparse_fa as bsfa  # noqa: E402
from bench import make_case  # noqa: E402
from blocksparse_fa.ops import call_memo, select  # noqa: E402
from host_new_primitives import gpu_kernels  # noqa: E402

orig = select.choose_global_split


def old_rule(*a, **kw):
    """The rule before: the backward's split ignores the whole mask's backward choice."""
    if kw.get("phase") == "backward":
        kw["whole"] = None
    return orig(*a, **kw)


ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--n", type=int, default=65536)
ap.add_argument("--masks", nargs="+", default=["longformer", "causal_longformer"])
a = ap.parse_args()
out = []
for name in a.masks:
    for hkv in (16, 4):
        n, H, D = a.n, 16, 128
        mask = make_case(name, n, "cuda")[0]
        lay = bsfa.compile_mask(mask, n, n, 128, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        k, v = (torch.randn(1, hkv, n, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(2))
        do = torch.randn_like(q)
        res = {}
        for p in range(2):
            for label in ("old", "new"):
                for key in [x for x in lay.cache if isinstance(x, tuple) and x and x[0] == "global_split_choice"]:
                    del lay.cache[key]
                call_memo.clear(lay)
                select.choose_global_split = old_rule if label == "old" else orig
                try:
                    def step():
                        return torch.autograd.grad(bsfa.attention(q, k, v, mask=lay), (q, k, v), do)
                    with select.record() as ran:
                        gr = step()
                    kern = gpu_kernels(step, calls=5)
                    wall = do_bench(step, warmup=25, rep=150, return_mode="median")
                finally:
                    select.choose_global_split = orig
                res.setdefault(label, []).append(dict(ran=[c for _, c in ran], gpu_ms=sum(kern.values()), wall_ms=wall, kernels=kern))
                if p == 0:
                    res[label + "_grads"] = [t.float() for t in gr]
                print(name, hkv, p, label, [c for _, c in ran], round(sum(kern.values()), 3), round(wall, 3), {a[:22]: round(b, 3) for a, b in kern.items() if b > 0.02}, flush=True)
        diff = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(res.pop("new_grads"), res.pop("old_grads"))]
        print(name, hkv, "max rel diff new vs old grads", diff, flush=True)
        out.append(dict(mask=name, hkv=hkv, res=res, grad_diff=diff))
json.dump(out, open(os.path.join(os.environ["OUT"], "split_backward_64k.json"), "w"), indent=1)
