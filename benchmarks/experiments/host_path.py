"""Host cost of one attention call (forward + backward), ours vs SDPA and FlexAttention, on the GPU.

    PYTHONPATH=. python benchmarks/experiments/host_path.py [--out docs/data/host_path.json] [--profile]

For each shape it measures, side by side on the same inputs:

* **host time per call**: the CPU time to *issue* forward + backward (``torch.autograd.grad``), over
  a run of calls short enough that the GPU's launch queue never fills, so the host never waits;
* **GPU time per call**: ``triton.testing.do_bench`` (median) of the same call;

for SDPA (``is_causal``, cuDNN or flash as torch picks), FlexAttention (compiled, block mask
built once) and ours through every entry point: ``attention(mask=expression)``,
``attention(mask=compile_mask(...))``, ``nn.BlockSparseAttention``, ``attention_op`` and
``attention`` inside ``torch.compile(fullgraph=True)``; plus our call replayed from a CUDA graph.
``--profile`` adds a cProfile of our eager and compiled calls (top functions by own time, then
by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch
import torch.nn.functional as F
import triton

import blocksparse_fa as bsfa

SHAPES = [(1, 8, 2, 16384, 64), (1, 16, 16, 16384, 128)]  # B, H, Hkv, N, D


def host_us(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def host_runs_us(fn, runs: int = 5, calls: int = 20) -> list:
    """Host µs per call of ``fn`` in each of ``runs`` runs of ``calls`` calls, each run made while
    the GPU sleeps 50 ms (so the launch queue never waits); ``fn`` warmed up first."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    hosts = []
    for _ in range(runs):
        torch.cuda._sleep(50_000_000)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        hosts.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return hosts


def graph_of(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def flex_fn(q, k, v, n, Hkv, H):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b, h, qi, ki):
        return (ki <= qi) & (((qi - ki) <= 256) | (ki < 64) | (qi < 64))

    bm = create_block_mask(mask_mod, None, None, n, n, device="cuda")
    fa = torch.compile(flex_attention)
    return lambda: fa(q, k, v, block_mask=bm, enable_gqa=Hkv != H)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "host_path.json"))
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    mask = bsfa.causal() & (bsfa.window(256) | bsfa.global_tokens(64))
    for B, H, Hkv, N, D in SHAPES:
        q = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn_like(q)
        lay = bsfa.compile_mask(mask, N, N, device="cuda")
        mod = bsfa.nn.BlockSparseAttention(mask)
        compiled = torch.compile(lambda q, k, v: bsfa.attention(q, k, v, mask=mask), fullgraph=True)
        calls = {
            "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H),
            "flex_longformer": flex_fn(q, k, v, N, Hkv, H),
            "ours_expr": lambda: bsfa.attention(q, k, v, mask=mask),
            "ours_layout": lambda: bsfa.attention(q, k, v, mask=lay),
            "ours_module": lambda: mod(q, k, v),
            "ours_op": lambda: bsfa.attention_op(q, k, v, mask),
            "ours_compiled": lambda: compiled(q, k, v),
        }
        ref = None
        for name, f in calls.items():
            def step(f=f):
                return torch.autograd.grad(f(), (q, k, v), do)

            with torch.no_grad():  # no autograd graph kept alive (it would pin streams for the capture below)
                out = f()
            if name.startswith("ours"):
                ref = out if ref is None else ref
                assert torch.equal(out, ref), name
            del out
            row = {"shape": [B, H, Hkv, N, D], "call": name, "host_us": host_us(step),
                   "gpu_us": triton.testing.do_bench(step, warmup=50, rep=200, return_mode="median") * 1e3}
            rows.append(row)
            print(f"{str((B, H, Hkv, N, D)):28s} {name:16s} host {row['host_us']:8.1f} us  gpu {row['gpu_us']:8.1f} us",
                  flush=True)
        if args.profile:
            for label, f in (("eager", lambda: bsfa.attention(q, k, v, mask=mask)), ("compiled", calls["ours_compiled"])):
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(50):
                    torch.autograd.grad(f(), (q, k, v), do)
                pr.disable()
                torch.cuda.synchronize()
                buf = io.StringIO()
                for key in ("tottime", "cumulative"):
                    pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(30)
                print(f"--- cProfile {label}, 50 fwd+bwd calls\n{buf.getvalue()}")
                rows.append({"shape": [B, H, Hkv, N, D], "profile": label, "text": buf.getvalue()})
        try:
            replay = graph_of(lambda: torch.autograd.grad(bsfa.attention(q, k, v, mask=mask), (q, k, v), do))
            row = {"shape": [B, H, Hkv, N, D], "call": "ours_graph_replay", "host_us": host_us(replay),
                   "gpu_us": triton.testing.do_bench(replay, warmup=50, rep=200, return_mode="median") * 1e3}
            rows.append(row)
            print(f"{str((B, H, Hkv, N, D)):28s} {'ours_graph':16s} host {row['host_us']:8.1f} us  gpu {row['gpu_us']:8.1f} us")
        except Exception as e:  # noqa: BLE001 - recorded, not hidden
            rows.append({"shape": [B, H, Hkv, N, D], "call": "ours_graph_replay", "error": repr(e)[:300]})
            print("graph capture failed:", repr(e)[:300])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
