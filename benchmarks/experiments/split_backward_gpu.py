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


def _inputs(n, H, hkv, D):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, n, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (H, hkv, hkv))
    return q, k, v, torch.randn_like(q)


def _run(lay, q, k, v, do, rule):
    """One rule's choices, gradients, GPU ms by kernel and ``do_bench`` fwd+bwd ms."""
    for key in [x for x in lay.cache if isinstance(x, tuple) and x and x[0] == "global_split_choice"]:
        del lay.cache[key]
    call_memo.clear(lay)
    select.choose_global_split = rule
    try:
        def step():
            return torch.autograd.grad(bsfa.attention(q, k, v, mask=lay), (q, k, v), do)

        with select.record() as ran:
            grads = step()
        kernels = gpu_kernels(step, calls=5)
        wall = do_bench(step, warmup=25, rep=150, return_mode="median")
    finally:
        select.choose_global_split = orig
    return [c for _, c in ran], grads, kernels, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--masks", nargs="+", default=["longformer", "causal_longformer"])
    args = ap.parse_args()
    out = []
    for name in args.masks:
        for hkv in (16, 4):
            lay = bsfa.compile_mask(make_case(name, args.n, "cuda")[0], args.n, args.n, 128, device="cuda")
            q, k, v, do = _inputs(args.n, 16, hkv, 128)
            res, grads = {}, {}
            for p in range(2):
                for label, rule in (("old", old_rule), ("new", orig)):
                    ran, gr, kern, wall = _run(lay, q, k, v, do, rule)
                    res.setdefault(label, []).append(dict(ran=ran, gpu_ms=sum(kern.values()), wall_ms=wall,
                                                          kernels=kern))
                    if p == 0:
                        grads[label] = [t.float() for t in gr]
                    big = {n[:22]: round(t, 3) for n, t in kern.items() if t > 0.02}
                    print(name, hkv, p, label, ran, round(sum(kern.values()), 3), round(wall, 3), big, flush=True)
            diff = [((x - y).abs().max() / y.abs().max()).item() for x, y in zip(grads["new"], grads["old"])]
            print(name, hkv, "max rel diff new vs old grads", diff, flush=True)
            out.append(dict(mask=name, hkv=hkv, res=res, grad_diff=diff))
    with open(os.path.join(os.environ.get("OUT", "."), "split_backward_64k.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
