"""Where the host time of one forward+backward goes, per mask and entry point, on the GPU.

For each mask of ``bench.py`` named (default: packed documents with CPU ids and a sliding window of
1024, 16K, H 16, d 128, bf16) and each entry point (``bsfa.attention`` eager, and inside
``torch.compile(fullgraph=True)``): the host time to launch one fwd+bwd while the GPU is busy
(``host_path.host_us``), the GPU time (``do_bench`` median), the CUDA kernels one step launches
(``torch.profiler``: names and counts) with the number of aten operations, and a cProfile of 50
steps (top functions by own and by cumulative time).

    PYTHONPATH=. python benchmarks/experiments/host_profile.py [--out DIR] [--masks ...] [--n 16384]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import blocksparse_fa as bsfa  # noqa: E402


def launches(fn):
    """``({kernel name: count}, number of aten ops)`` of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels, aten = collections.Counter(), 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:90]] += 1
        elif e.name.startswith("aten::"):
            aten += 1
    return dict(kernels), aten


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--masks", nargs="+", default=["document_causal", "sliding_window_1024"])
    ap.add_argument("--paths", nargs="+", default=["eager", "compiled"])
    ap.add_argument("--top", type=int, default=35)
    a = ap.parse_args()
    from triton.testing import do_bench

    from bench import make_case
    from host_path import host_us

    n, H, D = a.n, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "n": n, "rows": []}
    text = io.StringIO()
    for mname in a.masks:
        mask = make_case(mname, n)[0]
        cf = torch.compile(lambda q, k, v, mask=mask: bsfa.attention(q, k, v, mask=mask), fullgraph=True,
                           dynamic=False)
        fns = {"eager": lambda mask=mask: torch.autograd.grad(bsfa.attention(q, k, v, mask=mask), leaves, do),
               "compiled": lambda cf=cf: torch.autograd.grad(cf(q, k, v), leaves, do)}
        for path in a.paths:
            fn = fns[path]
            fn()
            torch.cuda.synchronize()
            kern, aten = launches(fn)
            row = {"mask": mname, "path": path, "host_us": host_us(fn),
                   "gpu_ms": do_bench(fn, warmup=25, rep=100), "kernels": kern, "aten_ops": aten}
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            for key in ("tottime", "cumulative"):
                pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(a.top)
            row["cprofile"] = buf.getvalue()
            res["rows"].append(row)
            head = (f"== {mname} {path}: host {row['host_us']:.0f} us, gpu {row['gpu_ms']:.3f} ms, "
                    f"{sum(kern.values())} kernels, {aten} aten ops")
            print(head, flush=True)
            for kname, c in sorted(kern.items(), key=lambda x: -x[1]):
                print(f"   {c:3d} x {kname}")
            text.write(head + "\n" + row["cprofile"] + "\n")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "host_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "host_profile.txt"), "w") as f:
        f.write(text.getvalue())


if __name__ == "__main__":
    main()
