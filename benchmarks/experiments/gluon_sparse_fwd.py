"""The Gluon forward on one-key-interval-per-row layouts (``kernels/forward_gluon.py``, ``INTERVAL``)
on the H100: checked, then timed beside our Triton block-sparse forward and FlexAttention.

1. Checks (each in a hang-safe child, as ``gluon_fwd.py``): O and LSE against float64 on small
   shapes (GQA, head dims 64/128, fp16/bf16, ``Lq != Lk`` bottom-right, a ragged ``Lq``, strided
   inputs, per-batch documents, per-head windows, rows with an empty interval, whole programs with
   nothing to attend; the no-overlap / no-ping-pong / 3-stage tiles), and on heads 0-1 of the timed
   16K inputs. Outputs start as NaN (every element must be written). Pass: the Gluon kernel ran, no
   NaN, O's relative error at most 2x eager attention's in the same dtype, LSE's max error (finite
   entries) at most max(2x eager, 1e-3), and rows that keep nothing give exactly O = 0, LSE = -inf.
2. Timings (``triton.testing.do_bench``, median), bf16, d 128, B 1: 16K with H 16 and 64K with H 8,
   for ``sliding_window(1024)``, ``causal & document`` (``bench.py``'s document_causal ids),
   ``causal & sliding_window(4096)`` and ``key_range(0, 512) | causal``: forward through
   ``blocksparse_fa.attention`` with the Gluon forward (kernel options ``forward="gluon"``; the
   default picks it too), with our Triton block-sparse forward (``interval=False``), and compiled
   FlexAttention; forward+backward
   at 16K for all three (our backward is the same block-sparse kernel either way). Dense and
   causal at 16K with the Gluon forward too (the paths this change must not slow). TFLOP/s count
   4·H·d·(kept pairs).

Results: ``$OUT/gluon_sparse_fwd.json`` (rewritten after every stage) and a table on stdout.

    PYTHONPATH=. python benchmarks/experiments/gluon_sparse_fwd.py [--budget 290] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from gluon_fwd import bench_ms, child_loop, gluon_options, rel, run_children  # noqa: E402

D = 128
SIZES = {16384: 16, 65536: 8}  # N -> heads (bench.heads_for)
PATTERNS = ["sliding_window_1024", "document_causal", "causal_sliding_4096", "keyrange_causal"]
CONFIGS = {"default": {}, "stages3": dict(stages=3), "no_overlap": dict(overlap=False),
           "no_pingpong": dict(pingpong=False)}
# small checks: (mask name, B, H, Hkv, Lq, Lk, d, dtype, strided)
SMALL = [
    ("sw100", 2, 4, 2, 512, 512, 128, "bf16", False),
    ("doc_causal", 1, 4, 1, 640, 640, 64, "fp16", False),
    ("causal_sw200", 1, 2, 2, 384, 512, 128, "bf16", False),  # Lq != Lk: bottom-right
    ("keyrange_causal", 1, 3, 1, 200, 384, 128, "bf16", True),  # ragged Lq, strided inputs
    ("empty_rows", 1, 2, 1, 512, 512, 128, "bf16", False),  # rows < 256 keep nothing: whole programs
    ("qrange_causal", 1, 2, 2, 512, 512, 64, "bf16", False),  # rows outside [100, 300) keep nothing
    ("doc_batch", 2, 2, 2, 512, 512, 128, "bf16", False),  # per-batch documents
    ("window_heads", 1, 4, 2, 768, 768, 128, "fp16", False),  # per-head windows, GQA
    ("chunk_band", 1, 2, 1, 512, 1024, 128, "bf16", False),
]


def small_mask(name: str, L: int, B: int = 1):
    import torch

    import blocksparse_fa as bsfa

    g = torch.Generator().manual_seed(L)

    def ids_for():
        lens = torch.randint(17, 150, (L,), generator=g)
        return torch.repeat_interleave(torch.arange(L), lens)[:L]

    if name == "sw100":
        return bsfa.sliding_window(100)
    if name == "doc_causal":
        return bsfa.causal() & bsfa.document(ids_for())
    if name == "causal_sw200":
        return bsfa.causal() & bsfa.sliding_window(200)
    if name == "keyrange_causal":
        return bsfa.key_range(0, 64) | bsfa.causal()
    if name == "empty_rows":
        return bsfa.key_range(256, 512) & bsfa.causal()
    if name == "qrange_causal":
        return bsfa.query_range(100, 300) & bsfa.causal()
    if name == "doc_batch":
        return bsfa.causal() & bsfa.document(torch.stack([ids_for() for _ in range(B)]))
    if name == "window_heads":
        return bsfa.window(bsfa.per_head(torch.tensor([8, 100, 300, 1000])))
    if name == "chunk_band":
        return bsfa.chunk_band(64, 256, lo=-1, hi=0)
    raise ValueError(name)


def big_mask(pattern: str, n: int):
    """(our mask, Flex mask_mod) on the GPU."""
    import torch

    import blocksparse_fa as bsfa
    from bench import doc_ids

    if pattern == "sliding_window_1024":
        return bsfa.sliding_window(1024), lambda b, h, q, k: (q >= k) & (q - k < 1024)
    if pattern == "document_causal":
        ids = doc_ids(n)
        idg = ids.to("cuda")
        return bsfa.load_pattern("document_causal", document=ids), lambda b, h, q, k: (q >= k) & (idg[q] == idg[k])
    if pattern == "causal_sliding_4096":
        return bsfa.causal() & bsfa.sliding_window(4096), lambda b, h, q, k: (q >= k) & (q - k < 4096)
    if pattern == "keyrange_causal":
        return bsfa.key_range(0, 512) | bsfa.causal(), lambda b, h, q, k: (k < 512) | (q >= k)
    if pattern == "dense":
        return bsfa.full(), None
    if pattern == "causal":
        return bsfa.causal(), lambda b, h, q, k: q >= k
    raise ValueError(pattern)


def kept_pairs(mask, n: int) -> int:
    from blocksparse_fa.compiler.intervals import mask_row_interval

    r = mask_row_interval(mask, n, n)
    if r is None:
        return n * n
    lo, hi = r
    return int((hi.astype("int64") - lo).clip(min=0).sum())


def child_cases() -> list[str]:
    cases = [f"small:{i}:default" for i in range(len(SMALL))]
    for n in SIZES:
        for pat in PATTERNS:
            cases.append(f"big:{n}:{pat}")
    cases += ["big:16384:dense", "big:16384:causal"]
    cases += [f"small:{i}:{cfg}" for cfg in CONFIGS if cfg != "default" for i in (1, 4)]  # last: time allowing
    return cases


def fwd_bwd(fn, do):
    def run():
        o = fn()
        o.backward(do)
    return run


# ---------------------------------------------------------------- child: Gluon cases

class _Child:
    def __init__(self):
        import torch

        import blocksparse_fa as bsfa
        from blocksparse_fa.ops import triton_backend as tb

        self.torch, self.bsfa, self.tb = torch, bsfa, tb
        self.calls = []
        launch = tb._gluon_launch

        def counted(*a, **kw):
            self.calls.append(a[7] if len(a) > 7 else kw.get("case"))
            return launch(*a, **kw)

        tb._gluon_launch = counted
        self.big = {}
        self.opts = None  # the kernel options of the current case

    def set_cfg(self, cfg: str) -> None:
        self.opts = gluon_options(CONFIGS[cfg])  # interval layouts on (the default)

    def run_check(self, mask, q, k, v, heads=None) -> dict:
        """Our output through triton_forward (O and LSE poisoned with NaN) vs float64 and eager."""
        torch, bsfa, tb = self.torch, self.bsfa, self.tb
        from blocksparse_fa.ops.validate import check_qkv

        s = check_qkv(q, k, v)
        scale = q.shape[-1] ** -0.5
        lay = bsfa.compile_mask(mask, s.Lq, s.Lk, 128, device=q.device)
        before = len(self.calls)
        real_empty = torch.empty

        def poisoned(*a, **kw):
            t = real_empty(*a, **kw)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        torch.empty = poisoned
        try:
            out, lse = tb.triton_forward(q, k, v, lay, s, scale, 0.0, 0, opts=self.opts)
        finally:
            torch.empty = real_empty
        torch.cuda.synchronize()
        cases = self.calls[before:]
        rec = dict(gluon_case=cases[0] if cases else None, nan_out=bool(out.isnan().any()),
                   nan_lse=bool(lse.isnan().any()))
        sl = slice(None) if heads is None else slice(0, heads)
        kv_sl = sl if heads is None else slice(0, -(-heads // s.G))
        qs, ks, vs = q[:, sl], k[:, kv_sl], v[:, kv_sl]
        ref, ref_lse = bsfa.reference_attention(qs.double(), ks.double(), vs.double(), mask, scale=scale,
                                                return_lse=True)
        eag, eag_lse = bsfa.reference_attention(qs, ks, vs, mask, scale=scale, return_lse=True, upcast=False)
        o, l = out[:, sl], lse[:, sl].double()
        empty = torch.isinf(ref_lse)
        fin = ~empty
        rec["empty_rows"] = int(empty.sum())
        rec["empty_ok"] = bool((o[empty] == 0).all() and torch.isneginf(l[empty]).all())
        o_err, o_eag = rel(o, ref), rel(eag, ref)
        l_err = (l[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
        l_eag = (eag_lse.double()[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
        rec.update(o_err=o_err, o_eager=o_eag, o_ratio=o_err / max(o_eag, 1e-12), lse_err=l_err, lse_eager=l_eag)
        rec["ok"] = bool(rec["gluon_case"] == "interval" and not rec["nan_out"] and not rec["nan_lse"]
                         and rec["empty_ok"] and o_err <= 2 * o_eag and l_err <= max(2 * l_eag, 1e-3))
        return rec

    def case(self, name: str) -> dict:
        torch, bsfa = self.torch, self.bsfa
        parts = name.split(":")
        dev = "cuda"
        if parts[0] == "small":
            i, cfg = int(parts[1]), parts[2]
            self.set_cfg(cfg)
            mname, b, h, hkv, lq, lk, d, dt, strided = SMALL[i]
            dtype = torch.bfloat16 if dt == "bf16" else torch.float16
            g = torch.Generator(device=dev).manual_seed(i)

            def mk(hh, ll):
                if strided:  # (B, L, H, D) memory viewed as (B, H, L, D), as after a projection
                    return torch.randn(b, ll, hh, d, device=dev, dtype=dtype, generator=g).transpose(1, 2)
                return torch.randn(b, hh, ll, d, device=dev, dtype=dtype, generator=g)

            q, k, v = mk(h, lq), mk(hkv, lk), mk(hkv, lk)
            rec = self.run_check(small_mask(mname, lk, b), q, k, v)
            rec.update(shape=dict(mask=mname, B=b, H=h, Hkv=hkv, Lq=lq, Lk=lk, d=d, dtype=dt, strided=strided))
            return rec
        n, pattern = int(parts[1]), parts[2]
        h = SIZES[n]
        self.set_cfg("default")
        key = ("qkv", n)
        if key not in self.big:
            self.big.clear()
            torch.cuda.empty_cache()
            g = torch.Generator(device=dev).manual_seed(0)
            self.big[key] = [torch.randn(1, h, n, D, device=dev, dtype=torch.bfloat16, generator=g)
                             for _ in range(4)]
        q, k, v, do = self.big[key]
        mask, _ = big_mask(pattern, n)
        if n <= 16384 and pattern not in ("dense", "causal"):
            rec = self.run_check(mask, q, k, v, heads=2)
        else:
            rec = dict(ok=True, unchecked="timing only")
        if rec["ok"]:
            opts = self.opts
            fn = lambda: bsfa.attention(q, k, v, mask=mask, kernel_options=opts)  # noqa: E731
            with torch.no_grad():
                before = len(self.calls)
                fn()
                rec["timed_case"] = self.calls[before] if len(self.calls) > before else None
                rec["fwd_ms"] = bench_ms(fn)
            flops = 4.0 * h * D * kept_pairs(mask, n)
            rec["flops"] = flops
            rec["tflops"] = flops / (rec["fwd_ms"] * 1e-3) / 1e12
            if n <= 16384 and pattern not in ("dense", "causal"):
                qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
                fb = fwd_bwd(lambda: bsfa.attention(qg, kg, vg, mask=mask, kernel_options=opts), do)
                fb()
                rec["fb_ms"] = bench_ms(fb)
                del qg, kg, vg
        return rec


def child_main(cases: list[str], progress: str) -> None:
    child_loop(_Child, cases, progress, "[gluon]", _fmt)


def _fmt(rec: dict) -> str:
    if "error" in rec:
        return "ERROR " + rec["error"][:200]
    if "hung" in rec:
        return "HUNG (killed)"
    s = "ok" if rec.get("ok") else "FAIL"
    if "o_err" in rec:
        s += (f"  O err {rec['o_err']:.2e} (eager {rec['o_eager']:.2e}, x{rec['o_ratio']:.2f})  LSE err "
              f"{rec['lse_err']:.2e} (eager {rec['lse_eager']:.2e})  case={rec['gluon_case']} "
              f"nan={rec['nan_out'] or rec['nan_lse']} empty rows {rec['empty_rows']} ok={rec['empty_ok']}")
    if "fwd_ms" in rec:
        s += f"  fwd {rec['fwd_ms']:.3f} ms = {rec['tflops']:.0f} TFLOP/s ({rec.get('timed_case')})"
    if "fb_ms" in rec:
        s += f"  fwd+bwd {rec['fb_ms']:.3f} ms"
    return s


# ---------------------------------------------------------------- parent: Triton forward and Flex

def baselines(results, deadline, save):
    import torch

    import blocksparse_fa as bsfa
    from bench import Runner

    base = results["baselines"]
    triton_fwd = bsfa.KernelOptions(interval=False)  # the block-sparse Triton forward for interval layouts
    runner = None
    inputs = {}

    def qkv(n):
        if n not in inputs:
            inputs.clear()
            torch.cuda.empty_cache()
            g = torch.Generator(device="cuda").manual_seed(0)
            inputs[n] = [torch.randn(1, SIZES[n], n, D, device="cuda", dtype=torch.bfloat16, generator=g)
                         for _ in range(4)]
        return inputs[n]

    for stage in ("triton", "flex_fwd", "flex_fb"):
        for n in SIZES:
            for pattern in PATTERNS:
                if stage == "flex_fb" and n > 16384:
                    continue
                rec = base.setdefault(f"{n}:{pattern}", {})
                if time.time() > deadline:
                    rec[f"{stage}_skipped"] = "time budget"
                    continue
                q, k, v, do = qkv(n)
                mask, mm = big_mask(pattern, n)
                try:
                    if stage == "triton":
                        fn = lambda: bsfa.attention(q, k, v, mask=mask, kernel_options=triton_fwd)  # noqa: E731
                        with torch.no_grad():
                            fn()
                            rec["triton_fwd_ms"] = bench_ms(fn)
                        if n <= 16384:
                            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
                            fb = fwd_bwd(lambda: bsfa.attention(qg, kg, vg, mask=mask, kernel_options=triton_fwd),
                                         do)
                            fb()
                            rec["triton_fb_ms"] = bench_ms(fb)
                    else:
                        if runner is None:
                            runner = Runner()
                        bm = runner.create_block_mask(mm, None, None, n, n, device="cuda", _compile=True)
                        if stage == "flex_fwd":
                            fl = lambda: runner.flex(q, k, v, block_mask=bm)  # noqa: E731
                            with torch.no_grad():
                                fl()
                                rec["flex_fwd_ms"] = bench_ms(fl)
                        else:
                            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
                            fb = fwd_bwd(lambda: runner.flex(qg, kg, vg, block_mask=bm), do)
                            fb()
                            rec["flex_fb_ms"] = bench_ms(fb)
                except Exception:  # noqa: BLE001
                    rec[f"{stage}_error"] = traceback.format_exc()[-2000:]
                    print(rec[f"{stage}_error"], flush=True)
                save()


def table(results) -> str:
    lines = ["| N | pattern | check | Gluon fwd ms | TFLOP/s | Triton fwd ms | Flex fwd ms | Gluon vs Triton | "
             "Gluon vs Flex | fwd+bwd ms (Gluon fwd / Triton fwd / Flex) | fwd+bwd vs Flex |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in SIZES:
        for pattern in PATTERNS + ["dense", "causal"]:
            rec = results["gluon"].get(f"big:{n}:{pattern}")
            if rec is None:
                continue
            b = results["baselines"].get(f"{n}:{pattern}", {})
            chk = "" if "o_err" not in rec else f"{'ok' if rec['ok'] else 'FAIL'} {rec['o_ratio']:.2f}x"
            if "error" in rec or "hung" in rec or "fwd_ms" not in rec:
                lines.append(f"| {n} | {pattern} | {chk or rec.get('error', rec.get('skipped', ''))[:80]} "
                             f"| | | | | | | | |")
                continue
            ms = rec["fwd_ms"]
            r = lambda x: f"{x / ms:.3f}x" if x else ""  # noqa: E731
            fb = rec.get("fb_ms")
            fbs = " / ".join(f"{x:.3f}" if x else "-" for x in (fb, b.get("triton_fb_ms"), b.get("flex_fb_ms")))
            fbr = f"{b['flex_fb_ms'] / fb:.3f}x" if fb and b.get("flex_fb_ms") else ""
            lines.append(f"| {n} | {pattern} | {chk} | {ms:.3f} | {rec['tflops']:.0f} | "
                         f"{b.get('triton_fwd_ms', 0):.3f} | {b.get('flex_fwd_ms', 0):.3f} | "
                         f"{r(b.get('triton_fwd_ms'))} | {r(b.get('flex_fwd_ms'))} | {fbs} | {fbr} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=290.0, help="seconds for the whole run")
    ap.add_argument("--stall", type=float, default=60.0, help="kill a Gluon child silent this long (s)")
    ap.add_argument("--baseline-seconds", type=float, default=150.0, help="kept for Triton and Flex")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--progress", help=argparse.SUPPRESS)
    ap.add_argument("--cases", nargs="*", default=None, help="Gluon cases (default: all)")
    args = ap.parse_args()
    if args.child:
        child_main(args.cases, args.progress)
        return
    t0 = time.time()
    deadline = t0 + args.budget
    os.makedirs(args.out, exist_ok=True)
    import torch
    import triton

    results = dict(out_dir=args.out, gluon={}, baselines={}, configs=CONFIGS, sizes=SIZES, d=D,
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                   torch=torch.__version__, triton=triton.__version__)
    path = os.path.join(args.out, "gluon_sparse_fwd.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    save()
    run_children(args.cases or child_cases(), deadline - args.baseline_seconds, args.stall, results, save,
                 script=__file__)
    try:
        baselines(results, deadline, save)
    except Exception:  # noqa: BLE001
        results["baseline_error"] = traceback.format_exc()[-2000:]
        print(results["baseline_error"], flush=True)
    results["seconds"] = round(time.time() - t0, 1)
    save()
    print("\nsmall checks:")
    for name, rec in results["gluon"].items():
        if name.startswith("small"):
            print(f"  {name:24s} {_fmt(rec)}")
    print("\n" + table(results))
    print(f"\n{results['seconds']} s; {path}")


if __name__ == "__main__":
    main()
