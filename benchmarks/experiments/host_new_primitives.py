"""Host and GPU time of one call per mask of ``benchmarks/flex_equivalents.py``, eager and compiled.

For every case (16K, H 8, d 128, bf16; B 2 where the mask needs a batch): the kernels the choice
names, then for the forward and the forward+backward, eager and through ``torch.compile(fullgraph=True)``:
the host time to launch one call (``host_path.host_us``), the wall time (``do_bench`` median) and the
GPU time by kernel (``torch.profiler``, mean of five calls). A call whose host time exceeds its GPU
time is host-bound: that is what its wall time then measures.

    PYTHONPATH=. python benchmarks/experiments/host_new_primitives.py [--only SUBSTR ...] [--out DIR]

Results: ``host_new_primitives.json`` in ``--out`` (default ``$OUT`` or the current folder).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import blocksparse_fa as bsfa  # noqa: E402
from blocksparse_fa.ops import select  # noqa: E402


def gpu_kernels(fn, calls: int = 5) -> dict:
    """``{kernel name: ms per call}`` over ``calls`` calls of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:60]] += e.device_time_total / calls / 1000
    return dict(out)


def _profile(fn, calls: int, top: int = 40) -> str:
    """cProfile of ``calls`` calls of ``fn`` (GPU synchronised once at the end): the ``top`` functions
    by own time, then by cumulative time."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, metavar="SUBSTR", help="cases whose name contains one")
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cprofile", type=int, default=0, metavar="CALLS",
                    help="also print a cProfile of this many eager fwd+bwd calls per case (top functions)")
    ap.add_argument("--phases", nargs="+", default=["fwd", "fb", "compiled_fwd", "compiled_fb"],
                    help="which calls to time")
    a = ap.parse_args()
    from triton.testing import do_bench

    from flex_equivalents import cases
    from host_path import host_us

    res = []
    for name, mask, _mod, (b_need, _h) in cases(a.n, B=2, H=8, device="cuda"):
        if a.only and not any(o in name for o in a.only):
            continue
        B, H, D = (2 if b_need > 1 else 1), 8, 128
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, a.n, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        cf = torch.compile(lambda q, k, v, m=mask: bsfa.attention(q, k, v, mask=m, block_size=128), fullgraph=True,
                           dynamic=False)
        fns = {"fwd": lambda m=mask: bsfa.attention(q, k, v, mask=m, block_size=128),
               "fb": lambda m=mask: torch.autograd.grad(bsfa.attention(q, k, v, mask=m, block_size=128), leaves, do),
               "compiled_fwd": lambda cf=cf: cf(q, k, v),
               "compiled_fb": lambda cf=cf: torch.autograd.grad(cf(q, k, v), leaves, do)}
        with select.record() as ran:
            fns["fb"]()
        row = {"case": name, "kernels_chosen": sorted(ran)}
        for tag, fn in fns.items():
            if tag not in a.phases:
                continue
            fn()
            torch.cuda.synchronize()
            kern = gpu_kernels(fn)
            row[tag] = {"host_us": host_us(fn), "wall_ms": do_bench(fn, warmup=25, rep=100),
                        "gpu_ms": sum(kern.values()), "kernels": kern}
            print(f"{name:28s} {tag:13s} host {row[tag]['host_us']:7.0f} us  wall {row[tag]['wall_ms']:.3f} ms  "
                  f"gpu {row[tag]['gpu_ms']:.3f} ms", flush=True)
        if a.cprofile:
            print(f"--- cProfile {name}, {a.cprofile} eager fwd+bwd calls\n{_profile(fns['fb'], a.cprofile)}",
                  flush=True)
        res.append(row)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "host_new_primitives.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "n": a.n, "rows": res}, f,
                  indent=1)


if __name__ == "__main__":
    main()
