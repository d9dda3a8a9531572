"""The GQA list backward with dK/dV per query head (``select._gluon_bwd_mode``'s
``"list+per_head_dkdv"``: one dK/dV item per query head over its group's K and V, the group's
dK/dV summed after) against the Triton block backward it replaces, and against the same pair run
on copies of K and V per query head (the earlier version), on the GPU.

1. Correctness at 2K (H 8, 2 kv heads, d 128), the mode forced (the column rule's constants
   set so that only one head's column passes): O, dQ, dK, dV against float64, beside the Triton
   backward's errors on the same inputs (``kernel_options={"backward": "triton"}``) and the
   copies' (``--copies``).
2. At 16K (H 16, 4 kv heads, d 128; ``bench.py``'s masks), the default choice: the backward's GPU
   time by kernel (``torch.profiler``, mean of 10 calls) and the ``do_bench`` fwd+bwd wall time,
   default against ``backward="triton"`` (and the copies), interleaved ``--passes`` times.

    PYTHONPATH=. python benchmarks/experiments/gqa_lists_gpu.py [--masks ...] [--copies] [--out DIR]

Results: ``$OUT/gqa_lists_gpu.json``.
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import blocksparse_fa as bsfa  # noqa: E402
from bench import make_case  # noqa: E402
from blocksparse_fa.ops import select  # noqa: E402
from blocksparse_fa.ops import triton_backend as tb  # noqa: E402
from blocksparse_fa.ops.validate import Shapes  # noqa: E402
from host_new_primitives import gpu_kernels  # noqa: E402

TRITON = dict(backward="triton")
_LAUNCH = tb._gluon_bwd_launch


def _on_copies(q, k, v, dout, grads, lse, delta, s, *args, per_head_dkdv=False, **kw):
    """``_gluon_bwd_launch`` as the earlier version ran it: K and V copied per query head
    (``repeat_interleave``) and the pair launched as MHA."""
    if per_head_dkdv:
        k, v = (t.repeat_interleave(s.G, 1) for t in (k, v))
        s = Shapes(s.B, s.H, s.H, s.Lq, s.Lk, s.D)
    _LAUNCH(q, k, v, dout, grads, lse, delta, s, *args, **kw)


class copies:
    """Within: the per-head dK/dV mode runs on copies of K and V."""

    def __enter__(self):
        tb._gluon_bwd_launch = _on_copies

    def __exit__(self, *exc):
        tb._gluon_bwd_launch = _LAUNCH


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


def _inputs(H, Hkv, n, D=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, Hkv, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return [t.requires_grad_() for t in (q, k, v)], do


def _step(mask, qkv, do, opts=None):
    with select.record() as ran:
        out = bsfa.attention(*qkv, mask=mask, kernel_options=opts)
        grads = torch.autograd.grad(out, qkv, do)
    return (out, *grads), ran


def check(name, n=2048, H=8, Hkv=2):
    mask = make_case(name, n, "cuda")[0]
    lay = bsfa.compile_mask(mask, n, n, 128, device="cuda")
    longest, mean = select.layout_class(lay).list_columns
    per_head = mean * (n // 128) / select.hardware(torch.device("cuda")).sm_count
    saved = select.LIST_LONG_COLUMN, select.LIST_COLUMN_SHARE
    select.LIST_LONG_COLUMN, select.LIST_COLUMN_SHARE = 0.0, longest / (0.5 * (Hkv + H) * per_head)
    try:
        qkv, do = _inputs(H, Hkv, n)
        got, ran = _step(lay, qkv, do, dict(replay=False))
        with copies():
            cop, _ = _step(lay, qkv, do, dict(replay=False))
    finally:
        select.LIST_LONG_COLUMN, select.LIST_COLUMN_SHARE = saved
    tri, ran_t = _step(lay, qkv, do, TRITON)
    qd = [t.detach().double().requires_grad_() for t in qkv]
    ref = bsfa.reference_attention(*qd, mask)
    ref_all = (ref, *torch.autograd.grad(ref, qd, do.double()))
    return dict(ran=ran, ran_triton=ran_t, vs_float64=[_rel(a, b) for a, b in zip(got, ref_all)],
                copies_vs_float64=[_rel(a, b) for a, b in zip(cop, ref_all)],
                max_abs_vs_copies=[(a - b).abs().max().item() for a, b in zip(got, cop)],
                triton_vs_float64=[_rel(a, b) for a, b in zip(tri, ref_all)])


def timing(name, n=16384, H=16, Hkv=4, passes=2, with_copies=False):
    from contextlib import nullcontext

    from triton.testing import do_bench

    mask = make_case(name, n, "cuda")[0]
    qkv, do = _inputs(H, Hkv, n)
    rows = []
    paths = [("triton", TRITON, nullcontext), ("default", None, nullcontext)]
    if with_copies:  # replays off: a replay keeps the launches recorded on the copies' path
        paths.append(("copies", dict(replay=False), copies))
    for p in range(passes):
        for label, opts, ctx in paths:
            def step():
                return torch.autograd.grad(bsfa.attention(*qkv, mask=mask, kernel_options=opts), qkv, do)

            with ctx():
                _, ran = _step(mask, qkv, do, opts)
                kernels = gpu_kernels(step, calls=10)
                wall = do_bench(step, warmup=25, rep=200, return_mode="median")
            rows.append(dict(pass_=p, path=label, backward=ran[-1][1], gpu_ms=sum(kernels.values()), kernels=kernels,
                             fwd_bwd_ms=wall))
            print(f"{name:18s} pass {p} {label:8s} {ran[-1][1]:24s} gpu {sum(kernels.values()):.3f} ms  "
                  f"wall {wall:.3f} ms", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--masks", nargs="+", default=["bigbird", "longformer", "causal_longformer"])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--copies", action="store_true", help="also time the pair on copies of K and V")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, masks={})
    for name in a.masks:
        c = check(name)
        c1 = check(name, Hkv=1)  # one kv head: eight bf16 partial gradients summed per key
        print(name, json.dumps(c), json.dumps(c1["vs_float64"]), flush=True)
        rows = timing(name, passes=a.passes, with_copies=a.copies)
        res["masks"][name] = dict(check=c, check_one_kv_head=c1, timing=rows)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gqa_lists_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
