"""GPU time by kernel of the persistent Gluon kernels with and without their deal tables
(``GluonConfig.deal``, ``GluonBwdConfig.deal``; ``ops/triton_backend._deal_table``), through
``bsfa.attention``: forward+backward of ``bench.py``'s BigBird, Longformer, causal Longformer,
sliding window, dense and causal masks (H 16) and of ``flex_equivalents.py``'s shared prefix,
rectangle | sliding, sliding tiles and padded batch (H 8), 16K, d 128, bf16. Per variant the
kernels chosen (``bsfa.explain``), the GPU time by kernel (torch.profiler, mean of 10 calls) and
whether the gradients equal the first variant's bit for bit.

    PYTHONPATH=. python benchmarks/experiments/deal_gpu_time.py [lists]   # ONLY=bigbird,longformer

``lists`` adds the list mode forced in both phases (``block_lists=True``, ``global_split=False``),
with and without the deal. Results: ``$OUT/deal_gpu.json`` and a line per case on stdout.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import blocksparse_fa as bsfa  # noqa: E402
from bench import make_case  # noqa: E402
from flex_equivalents import cases  # noqa: E402
from host_new_primitives import gpu_kernels  # noqa: E402
n = 16384
BENCH = ("bigbird", "longformer", "causal_longformer", "sliding_window_1024", "dense", "causal")
todo = [(nm, make_case(nm, n, "cuda")[0], 1, 16) for nm in BENCH]
for nm, m, _, (B, _) in cases(n, H=8, device="cuda"):
    if any(s in nm for s in ("shared prefix", "rectangle", "tiles", "padded")):
        todo.append((nm, m, B, 8))
if os.environ.get("ONLY"):
    todo = [x for x in todo if any(o in x[0] for o in os.environ["ONLY"].split(","))]
variants = {"deal": {}, "nodeal": {"gluon_fwd": {"deal": False}, "gluon_bwd": {"deal": False}}}
if len(sys.argv) > 1:
    variants["lists"] = {"block_lists": True, "global_split": False}
    variants["lists_nodeal"] = {"block_lists": True, "global_split": False, "gluon_fwd": {"deal": False},
                                "gluon_bwd": {"deal": False}}
res = {}
for nm, m, B, H in todo:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, n, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    out_ref = None
    for vn, ko in variants.items():
        def step():
            out = bsfa.attention(q, k, v, mask=m, kernel_options=ko or None)
            return torch.autograd.grad(out, (q, k, v), do)
        try:
            for _ in range(3):
                gr = step()
            ex = bsfa.explain(q, k, v, m, kernel_options=ko or None)
            ker = gpu_kernels(step, calls=10)
        except Exception as e:
            print(nm, vn, "ERROR", str(e)[:200], flush=True); continue
        same = None
        if out_ref is None:
            out_ref = gr
        else:
            same = all(torch.equal(a, b) for a, b in zip(gr, out_ref))
        bwd = sum(v_ for k_, v_ in ker.items() if "bwd" in k_ or "dq_finish" in k_ or "sum_partials" in k_)
        fwd = sum(ker.values()) - bwd
        res[f"{nm}|{vn}"] = dict(kernels=ker, bwd_ms=bwd, fwd_ms=fwd, fwd=ex.forward, bwd=ex.backward,
                                 same_as_first=same)
        top = ", ".join(f"{k_[:22]} {v_*1000:.0f}" for k_, v_ in sorted(ker.items(), key=lambda kv: -kv[1])[:4])
        print(f"{nm[:20]:20s} {vn:12s} {ex.forward:14s} {ex.backward:15s} fwd {fwd*1000:5.0f} bwd {bwd*1000:5.0f} us "
              f"same={same} :: {top}", flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "deal_gpu.json"), "w"), indent=1)
