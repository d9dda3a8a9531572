"""Host and GPU time of two-run masks split into one-run parts (``compiler/runs.py``) against the
whole mask, per kernel.

For the cases of ``benchmarks/flex_equivalents.py`` whose name contains one of ``--only`` (16K,
H 8, d 128, bf16), three variants: ``kernel_options={"run_split": True}`` (*split*), the same with
the second part on its box (``ops/runs.BOX_SECOND``; *box*) and ``{"run_split": False}`` (*whole*).
``--variants`` replaces them by ``kernel_options`` given as ``name=JSON`` (the library's defaults
otherwise). For each, the peak memory of a forward+backward above its inputs, then for the forward and the
forward+backward through ``bsfa.attention``: the host time to issue one call
(``host_path.host_us``: mean of 20, no synchronisation between them), the wall time per call
(``do_bench`` median) and the GPU time by kernel (``host_new_primitives.gpu_kernels``, mean of 10
calls). The recorded ``docs/data/run_split_profile_h200.json`` came from the first form of this
script (wall time as the mean of the same 20 calls, kernels by ``key_averages``).

    PYTHONPATH=. python benchmarks/experiments/run_split_profile.py [--only SUBSTR ...] [--out DIR]
        [--variants auto=null triton_bwd='{"backward": "triton"}']

Results: ``run_split_profile.json`` in ``--out`` (default ``$OUT`` or the current folder).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import blocksparse_fa as bsfa  # noqa: E402
from blocksparse_fa.ops import runs as ops_runs  # noqa: E402
from flex_equivalents import cases  # noqa: E402
from host_new_primitives import gpu_kernels  # noqa: E402
from host_path import host_us  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", default=["key_range", "rectangle", "block diffusion", "shared prefix"])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--variants", nargs="+", default=None, metavar="NAME=JSON",
                    help="kernel_options variants instead of split / box / whole (null: no options)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    variants = [("split", {"run_split": True}, False), ("box", {"run_split": True}, True),
                ("whole", {"run_split": False}, False)]
    if a.variants:
        variants = [(n, json.loads(t), True) for n, _, t in (v.partition("=") for v in a.variants)]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": {}}
    for name, mask, _, (B, _) in cases(a.n, H=a.heads, device="cuda"):
        if not any(s in name for s in a.only):
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, a.heads, a.n, a.dim, device="cuda", dtype=torch.bfloat16, generator=g)
                       for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        for var, ko, box in variants:
            ops_runs.BOX_SECOND = box
            def fwd(ko=ko):
                with torch.no_grad():
                    return bsfa.attention(q, k, v, mask, kernel_options=ko)

            def fb(ko=ko):
                o = bsfa.attention(q, k, v, mask, kernel_options=ko)
                return torch.autograd.grad(o, (q, k, v), do)

            fb()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fb()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            for fn, mode in ((fwd, "fwd"), (fb, "fb")):
                host = host_us(fn)
                wall = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
                ks = {name: ms * 1e3 for name, ms in sorted(gpu_kernels(fn, 10).items(), key=lambda kv: -kv[1])}
                gpu = sum(ks.values())
                out["runs"][f"{name}|{var}|{mode}"] = {"host_us": host, "wall_us": wall, "gpu_us": gpu, "kernels": ks,
                                                       "fb_peak_mib": peak}
                print(f"{name:22s} {var:5s} {mode:3s} host {host:7.0f} wall {wall:7.0f} gpu {gpu:7.0f} us "
                      f"peak {peak:6.1f} MiB :: "
                      + ", ".join(f"{kk} {vv:.0f}" for kk, vv in list(ks.items())[:7]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "run_split_profile.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
