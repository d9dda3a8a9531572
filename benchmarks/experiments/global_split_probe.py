"""Masks with global tokens (Longformer, attention sinks) as a band, the first rows and the global keys.

``window(w) | global_tokens(g)`` and ``causal & (sliding_window(w) | global_tokens(s))`` keep two
key runs on most rows. ``compiler/globals.py`` splits them into the band ``mask & ~global_tokens(g)``
(the Gluon interval kernels), the first ``g`` rows and the global keys (``ops/globals.py``). Per
mask this script times, fwd / fwd+bwd ms (``triton.testing.do_bench`` medians, 16K, H 16, d 128,
bf16): the whole mask (``global_split=False``), the default choice, the split forced, the band
alone and FlexAttention's Triton backend on the same inputs, and checks the whole and split
results against float64 (4K, GQA 4/2, the PyTorch backend in float64).

    PYTHONPATH=. python benchmarks/experiments/global_split_probe.py --out OUT [--cases NAME ...]
    ... --profile   # GPU time per fwd+bwd (torch.profiler) of the default, both phases split, whole
    ... --tune      # the global keys' and rows' kernels at other row tiles / warps: fwd, fwd+bwd,
                    # each kernel's GPU time (torch.profiler) and the errors against float64
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--out", default=".")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of the split fwd+bwd only")
    ap.add_argument("--cases", nargs="*", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="time only these (whole split split_forced band_only "
                    "flex_triton)")
    ap.add_argument("--split-backward-min-rows", type=int, default=None,
                    help="select.SPLIT_BACKWARD_MIN_ROWS for this process (0: every folded split splits its backward)")
    ap.add_argument("--tune", action="store_true", help="time the global keys' kernels at other tiles / warps")
    a = ap.parse_args()

    import triton
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import blocksparse_fa as bsfa
    from blocksparse_fa.ops import select

    if a.split_backward_min_rows is not None:
        select.SPLIT_BACKWARD_MIN_ROWS = a.split_backward_min_rows
    dev = "cuda"
    n, H, D = a.n, a.heads, a.d
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, H, n, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
    flex = torch.compile(flex_attention)

    cases = {
        "longformer": (bsfa.load_pattern("longformer"), 64,
                       lambda b, h, qi, ki: ((qi - ki).abs() <= 256) | (qi < 64) | (ki < 64)),
        # the README's mask: 64 sinks before a causal window of 256 (split only when forced)
        "causal_longformer": (bsfa.parse("causal & (window(256) | global_tokens(64))"), 64,
                              lambda b, h, qi, ki: (qi >= ki) & (((qi - ki) <= 256) | (ki < 64))),
        # context parallelism's causal Longformer: 256 global keys, more than compiler.globals.MAX_GLOBAL
        # (the whole mask runs)
        "causal_longformer_g256": (bsfa.parse("causal & (window(512) | global_tokens(256))"), 256,
                                   lambda b, h, qi, ki: (qi >= ki) & (((qi - ki) <= 512) | (ki < 256))),
        "sinks4_window1024": (bsfa.parse("causal & (sliding_window(1024) | global_tokens(4))"), 4,
                              lambda b, h, qi, ki: (qi >= ki) & ((qi - ki < 1024) | (ki < 4))),
        "sinks64_window1024": (bsfa.parse("causal & (sliding_window(1024) | global_tokens(64))"), 64,
                               lambda b, h, qi, ki: (qi >= ki) & ((qi - ki < 1024) | (ki < 64))),
        "sinks4_window4096": (bsfa.parse("causal & (sliding_window(4096) | global_tokens(4))"), 4,
                              lambda b, h, qi, ki: (qi >= ki) & ((qi - ki < 4096) | (ki < 4))),
    }

    def ms(fn):
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100)

    def leaf():
        return [t.detach().requires_grad_() for t in (q, k, v)]

    res = {"n": n, "H": H, "D": D, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "cases": {}}
    whole_opts = dict(global_split=False)
    for name, (m, g, mod) in cases.items():
        if a.cases and name not in a.cases:
            continue
        if a.profile:  # GPU time per fwd+bwd of the default, both phases split and the whole mask
            from torch.profiler import ProfilerActivity, profile

            for label, kw in (("default", None), ("split_forced", dict(global_split=True)),
                              ("whole", whole_opts)):
                def step():
                    xs = leaf()
                    bsfa.attention(*xs, m, kernel_options=kw).backward(do)

                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        step()
                    torch.cuda.synchronize()
                evs = [(e.key, e.self_device_time_total / 5 / 1000) for e in prof.key_averages()
                       if e.self_device_time_total > 0]
                tot = sum(t for _, t in evs)
                print(f"{name} {label}: GPU ms per fwd+bwd {tot:.4f}; "
                      + ", ".join(f"{key[:40]} {t:.4f}" for key, t in sorted(evs, key=lambda x: -x[1])[:8]),
                      flush=True)
                res["cases"].setdefault(name, {})[f"profile_{label}"] = dict(gpu_ms=round(tot, 4), kernels={
                    key[:70]: round(t, 4) for key, t in evs})
            continue
        if a.tune:
            import blocksparse_fa.ops.globals as og
            from torch.profiler import ProfilerActivity, profile

            # float64 reference at 4K, GQA 4/2: every tile's split result is checked against it
            torch.manual_seed(1)
            chk = [torch.randn(1, h_, 4096, D, device=dev, dtype=torch.bfloat16) for h_ in (4, 2, 2, 4)]

            def grads(dt, **kw):
                xs = [t.detach().to(dt).requires_grad_() for t in chk[:3]]
                o = bsfa.attention(*xs, m, **kw)
                o.backward(chk[3].to(dt))
                return [o.detach().double()] + [t.grad.double() for t in xs]

            ref = grads(torch.float64, backend="torch")
            tune, saved = {}, (og._BLOCK_M, og._NUM_WARPS)
            for bm_, nw in ((64, 8), (64, 4), (32, 8), (32, 4), (128, 8)):
                og._BLOCK_M, og._NUM_WARPS = bm_, nw

                def step():
                    xs = leaf()
                    bsfa.attention(*xs, m, kernel_options=dict(global_split=True)).backward(do)

                try:
                    err = [float((x - y).abs().max()) for x, y in zip(grads(torch.bfloat16,
                                                                            kernel_options=dict(global_split=True)),
                                                                      ref)]
                    f = ms(lambda: bsfa.attention(q, k, v, m, kernel_options=dict(global_split=True)))
                    fb = ms(step)
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(5):
                            step()
                        torch.cuda.synchronize()
                    kern = {e.key: round(e.device_time_total / 5 / 1000, 4) for e in prof.key_averages()
                            if "_global" in e.key}  # ms per fwd+bwd, the global keys' and rows' kernels
                    tune[f"{bm_}x{nw}"] = dict(fwd_ms=round(f, 4), fwd_bwd_ms=round(fb, 4), kernels_ms=kern,
                                               max_err=err)
                except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result
                    tune[f"{bm_}x{nw}"] = f"{type(e).__name__}: {str(e)[:80]}"
                print(name, "tiles", bm_, "warps", nw, tune[f"{bm_}x{nw}"], flush=True)
            og._BLOCK_M, og._NUM_WARPS = saved
            res["cases"].setdefault(name, {})["tune"] = tune
            continue
        gt = bsfa.global_tokens(g)
        A = m & ~gt
        r = {}
        bm = create_block_mask(mod, 1, 1, n, n, device=dev)
        impls = {"whole": lambda x, y, z: bsfa.attention(x, y, z, m, kernel_options=whole_opts),
                 "split": lambda x, y, z: bsfa.attention(x, y, z, m),
                 "split_forced": lambda x, y, z: bsfa.attention(x, y, z, m, kernel_options=dict(global_split=True)),
                 "band_only": lambda x, y, z: bsfa.attention(x, y, z, A),
                 "flex_triton": lambda x, y, z: flex(x, y, z, block_mask=bm)}
        for label, fn in impls.items():
            if a.only and label not in a.only:
                continue
            try:
                with select.record() as rec:
                    xs = leaf()
                    fn(*xs).backward(do)
                kern = sorted({f"{ph}:{c}" for ph, c in rec})
                f = ms(lambda: fn(q, k, v))

                def step():
                    xs = leaf()
                    fn(*xs).backward(do)

                fb = ms(step)
                r[label] = {"fwd_ms": round(f, 4), "fwd_bwd_ms": round(fb, 4), "kernels": kern}
            except Exception as e:  # noqa: BLE001 - recorded, the other implementations still run
                r[label] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(name, label, r[label], flush=True)
        # float64 check at 4K, 4 heads (GQA 4/2): split and whole against the PyTorch backend in float64
        nc, hc = 4096, 4
        torch.manual_seed(1)
        qc = torch.randn(1, hc, nc, D, device=dev, dtype=torch.bfloat16)
        kc, vc = (torch.randn(1, 2, nc, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        doc = torch.randn(1, hc, nc, D, device=dev, dtype=torch.bfloat16)
        got = {}
        for label, kw in (("ref", dict(backend="torch")), ("whole", dict(kernel_options=whole_opts)), ("split", {})):
            dt = torch.float64 if label == "ref" else torch.bfloat16
            xs = [t.detach().to(dt).requires_grad_() for t in (qc, kc, vc)]
            o = bsfa.attention(*xs, m, **kw)
            o.backward(doc.to(dt))
            got[label] = [o.detach().double()] + [t.grad.double() for t in xs]
        for label in ("whole", "split"):
            r[f"max_err_{label}"] = [float((x - y).abs().max()) for x, y in zip(got[label], got["ref"])]
        print(name, "errors (out, dq, dk, dv) whole", r["max_err_whole"], "split", r["max_err_split"], flush=True)
        res["cases"].setdefault(name, {}).update(r)
    if a.profile:
        a.out = os.path.join(a.out, "profile")
    if a.tune:
        a.out = os.path.join(a.out, "tune")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "global_split_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
