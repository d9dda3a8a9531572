"""Every entry point runs the same kernels, at the same speed (GPU).

For each mask and shape, on the same bf16 inputs:

* the kernels each path launches (``torch.profiler``, forward+backward): ``attention`` eager,
  ``torch.compile(fullgraph=True)`` of it, a precompiled layout (on the GPU and on the CPU), a
  compiled ``nn.BlockSparseAttention``; they must equal ``bsfa.explain(...).kernels``;
* forward and forward+backward times of the same paths (``triton.testing.do_bench``, median) and
  their ratio to eager, beside cuDNN SDPA where it applies;
* no device-to-host synchronisation in any path (``torch.cuda.set_sync_debug_mode("error")``);
* the host time of one forward+backward call ((1, 8, 16K, 64), 2 KV heads): the wall time of
  issuing calls while the GPU is still busy, ours eager, the ``nn`` module, compiled, and SDPA.

    PYTHONPATH=. python benchmarks/experiments/entry_points_gpu.py --out DIR [--sizes 16384 65536]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import blocksparse_fa as bsfa


def doc_ids(n: int, lo: int = 1024, hi: int = 4096, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    while total < n:
        ln = int(torch.randint(lo, hi + 1, (1,), generator=g))
        lens.append(min(ln, n - total))
        total += lens[-1]
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))


def masks(n: int) -> dict:
    return {
        "dense": None,
        "causal": bsfa.causal(),
        "sliding_window(1024)": bsfa.sliding_window(1024),
        "documents": bsfa.causal() & bsfa.document(doc_ids(n).cuda()),
        "documents(cpu ids)": bsfa.causal() & bsfa.document(doc_ids(n)),
        "longformer": bsfa.load_pattern("longformer"),
        "strided(256)": bsfa.parse("causal & (sliding_window(256) | strided(256))"),
    }


def kernels_run(fn) -> list:
    """Names of the attention kernels one call of ``fn`` launches (forward and backward)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return sorted({n for n in names if n.startswith("_attn") or n.startswith("_dq_finish")})


def kernel_times(fn, top: int = 10) -> dict:
    """GPU time (us) per kernel name of one call of ``fn`` (``torch.profiler``), the longest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    acc: dict = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            acc[e.name[:60]] = acc.get(e.name[:60], 0.0) + e.device_time
    return dict(sorted(acc.items(), key=lambda kv: -kv[1])[:top])


def no_sync(fn) -> str:
    """"ok" when two calls of ``fn`` make no device-to-host synchronisation, else the error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        fn()
        return "ok"
    except RuntimeError as e:
        return f"sync: {str(e).splitlines()[0][:200]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def run_case(name, mask, N, H, Hkv, D, rows, log):
    torch.manual_seed(0)
    q = torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, Hkv, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, Hkv, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn_like(q)
    m = bsfa.full() if mask is None else mask
    lay_gpu = bsfa.compile_mask(m, N, N, 128, device="cuda")
    lay_cpu = bsfa.compile_mask(m, N, N, 128)
    module = bsfa.nn.BlockSparseAttention(m).cuda()
    paths = {
        "eager": lambda q, k, v: bsfa.attention(q, k, v, mask=mask),
        "compiled": torch.compile(lambda q, k, v: bsfa.attention(q, k, v, mask=mask), fullgraph=True),
        "layout(gpu)": lambda q, k, v: bsfa.attention(q, k, v, mask=lay_gpu),
        "layout(cpu)": lambda q, k, v: bsfa.attention(q, k, v, mask=lay_cpu),
        "module(compiled)": torch.compile(module, fullgraph=True),
    }
    if name in ("dense", "causal"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=name == "causal",
                                                                        enable_gqa=Hkv != H)
        paths["cudnn"] = cudnn
    ex = bsfa.explain(q, k, v, mask=mask)
    want = sorted(set(ex.kernels))
    ref = None
    for path, f in paths.items():
        row = dict(mask=name, N=N, H=H, Hkv=Hkv, D=D, path=path)
        try:
            fwd = lambda f=f: f(q, k, v)  # noqa: E731
            fb = lambda f=f: torch.autograd.grad(f(q, k, v), (q, k, v), do)  # noqa: E731
            out = fwd()
            grads = fb()  # compiles / warms up
            if ref is None:
                ref = (out.float(), *(g.float() for g in grads))
            else:
                row["max_diff_vs_eager"] = max((a.float() - b).abs().max().item()
                                               for a, b in zip((out, *grads), ref))
            if path != "cudnn":
                row["kernels"] = kernels_run(fb)
                row["kernels_match_explain"] = row["kernels"] == want
                row["sync"] = no_sync(fb)
                if path in ("eager", "compiled"):
                    row["kernel_us"] = kernel_times(fb)
            row["fwd_ms"] = bench(fwd)
            row["fwdbwd_ms"] = bench(fb)
        except Exception as e:  # recorded, the run goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    mine = [r for r in rows if r.get("mask") == name and r.get("N") == N and r.get("Hkv") == Hkv]
    eager = next(r for r in mine if r["path"] == "eager")
    for r in mine:
        if "fwd_ms" in r and "fwd_ms" in eager:
            r["fwd_vs_eager"] = eager["fwd_ms"] / r["fwd_ms"]
            r["fwdbwd_vs_eager"] = eager["fwdbwd_ms"] / r["fwdbwd_ms"]
    for r in rows[-len(paths):]:
        log(f"{name:22s} N={N:6d} H={H}/{Hkv} {r['path']:17s} " + (
            f"fwd {r['fwd_ms']:.3f} ms ({r.get('fwd_vs_eager', 1):.3f}x eager)  fwd+bwd {r['fwdbwd_ms']:.3f} ms "
            f"({r.get('fwdbwd_vs_eager', 1):.3f}x)  kernels {r.get('kernels')} match={r.get('kernels_match_explain')} "
            f"sync={r.get('sync')} diff={r.get('max_diff_vs_eager', 0):.2e}" if "fwd_ms" in r else r.get("error", "")))
    for r in rows[-len(paths):]:
        if "kernel_us" in r:
            log(f"  {r['path']:9s} GPU us per kernel: " + ", ".join(f"{k} {v:.0f}" for k, v in r["kernel_us"].items()))
    log(f"  explain: {ex.forward} / {ex.backward}")


def host_time(rows, log, n_calls: int = 20, profile_dir=None):
    """Wall time of issuing one forward+backward call while the GPU is busy (the host's share)."""
    torch.manual_seed(0)
    q = torch.randn(1, 8, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn_like(q)
    mask = bsfa.causal()
    module = bsfa.nn.BlockSparseAttention(mask).cuda()
    comp = torch.compile(lambda q, k, v: bsfa.attention(q, k, v, mask=mask), fullgraph=True)
    kq, vq = k.repeat_interleave(4, 1).detach().requires_grad_(), v.repeat_interleave(4, 1).detach().requires_grad_()
    paths = {
        "ours eager": lambda: bsfa.attention(q, k, v, mask=mask).backward(do),
        "ours eager, new causal() per call": lambda: bsfa.attention(q, k, v, mask=bsfa.causal()).backward(do),
        "nn module": lambda: module(q, k, v).backward(do),
        "ours compiled": lambda: comp(q, k, v).backward(do),
        "sdpa (default backend)": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, kq, vq, is_causal=True).backward(do),
    }
    for name, fn in paths.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        busy = torch.empty(1, device="cuda")
        torch.cuda._sleep(int(2e9 * 0.05))  # ~50 ms of GPU work ahead: the calls below only queue
        t0 = time.perf_counter()
        for _ in range(n_calls):
            fn()
        host_us = (time.perf_counter() - t0) / n_calls * 1e6
        torch.cuda.synchronize()
        del busy
        rows.append(dict(host=name, us_per_call=host_us))
        log(f"host {name:34s} {host_us:8.1f} us per fwd+bwd call")
    if profile_dir:
        import cProfile
        import pstats

        for name in ("ours eager", "ours compiled", "nn module"):
            fn = paths[name]
            pr = cProfile.Profile()
            torch.cuda._sleep(int(2e9 * 0.2))
            pr.enable()
            for _ in range(50):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            with open(os.path.join(profile_dir, "host_profile.txt"), "a") as f:
                f.write(f"==== {name}: 50 fwd+bwd calls\n")
                pstats.Stats(pr, stream=f).sort_stats("tottime").print_stats(30)
                pstats.Stats(pr, stream=f).sort_stats("cumtime").print_stats(30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--heads", default="8/8,8/2", help="H/Hkv pairs")
    ap.add_argument("--masks", nargs="+", default=None)
    ap.add_argument("--no-host", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile of the host path into OUT/host_profile.txt")
    ap.add_argument("--deadline", type=float, default=1e9, help="stop starting cases after this many seconds")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    logf = open(os.path.join(args.out, "entry_points.log"), "a")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    import triton

    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    torch._dynamo.config.cache_size_limit = 64
    rows = []
    if not args.no_host:
        host_time(rows, log, profile_dir=args.out if args.profile else None)
    for N in args.sizes:
        for hh in args.heads.split(","):
            H, Hkv = map(int, hh.split("/"))
            for name, m in masks(N).items():
                if args.masks and name not in args.masks:
                    continue
                if time.time() - t_start > args.deadline:
                    log(f"deadline: skipped {name} N={N} H={H}/{Hkv}")
                    continue
                run_case(name, m, N, H, Hkv, 128, rows, log)
                with open(os.path.join(args.out, "entry_points.json"), "w") as f:
                    json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "entry_points.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
