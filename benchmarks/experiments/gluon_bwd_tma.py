"""The Gluon five-GEMM backward (``kernels/backward_gluon.py`` with ``ATOMIC_DQ``: the dK/dV kernel
adds ``dQ_partial = dS·K`` to an fp32 buffer with TMA reduce-adds, ``_dq_finish`` converts it) on
the H100: checked, then timed beside our default and deterministic backwards, cuDNN and
FlashAttention-4 (where ``flash_attn.cute`` imports; ``../shared/peers``).

1. Checks (``check:*``): O, dQ, dK and dV of ``attention(..., kernel_options=dict(backward="gluon",
   deterministic=False))`` against float64 (``reference_attention`` per query head; dK and dV summed
   over each GQA group), beside eager attention in bf16 on the same heads. Dense and causal; MHA
   16/16, GQA 16/4 and 8/2; d 64 and 128; 4K (every head) and 16K (the first two heads, or the
   first group). PASS: every relative error at most 2x eager's, and the kernels that ran are the
   five-GEMM Gluon ones. The ``deterministic=True`` path's errors are printed beside.
2. Timings (``time:*``, ``triton.testing.do_bench`` medians, bf16, B = 1): the backward alone
   (``autograd.grad`` of a kept output) and forward + backward, for the five-GEMM variant
   (``five_gemm``; ``--other``: also ``five_other``, the same with other ``GluonBwdConfig`` fields;
   ``--pingpong``: also the first with the consumer groups taking turns), our default,
   ``deterministic=True``, FA4 and cuDNN (SDPA, ``SDPBackend.CUDNN_ATTENTION``; GQA through
   ``enable_gqa``, else K and V expanded), at 16K H16 d128 and d64 MHA and 64K H8/Hkv2 d128, dense
   and causal. Every implementation is set up first, then timed in ``--passes`` passes taking turns
   (the median over passes: the clock drifts within a run); ``--profile`` adds the device time per
   fwd+bwd by kernel. TFLOP/s count 10·B·H·N²·d for the backward and 14·B·H·N²·d for fwd+bwd
   (causal: half).

Every case runs in a child process killed after ``--stall`` s without progress (a barrier mistake
in a Gluon kernel hangs the GPU rather than raising; ``gluon_fwd.run_children``); a case that raises
prints its traceback (a Gluon compile error names the kernel line) and the rest go on. Results:
``$OUT/gluon_bwd_tma.json`` (rewritten after every case), a PASS/FAIL line per check and a table.

    PYTHONPATH=. python benchmarks/experiments/gluon_bwd_tma.py [--out DIR] [--quick] [--budget 225]
        [--passes 3] [--profile] [--five '{"rows_smem": true}'] [--other '{"stages": 3}'] [--pingpong]
        [--cases check:dense:16:4:4096:128 time:causal:16:16:16384:128 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/peers.py
from gluon_fwd import bench_ms, child_loop, rel, run_children  # noqa: E402

HEADS = [(16, 16), (16, 4), (8, 2)]
TIMED = [(16, 16, 16384, 128), (8, 2, 65536, 128), (16, 16, 16384, 64)]
PATTERNS = ("dense", "causal")


def all_cases(quick: bool) -> list[str]:
    """Case names ``check:{pattern}:{H}:{Hkv}:{L}:{d}`` and ``time:...``, most wanted first (a run
    out of budget skips the last ones)."""
    if quick:
        checks = [f"check:{p}:{h}:{hk}:4096:{d}" for p in PATTERNS for h, hk, d in ((16, 16, 128), (16, 4, 64))]
        return checks + [f"time:{p}:16:16:16384:128" for p in PATTERNS]
    small = [f"check:{p}:{h}:{hk}:4096:{d}" for d in (128, 64) for p in PATTERNS for h, hk in HEADS]
    big = [f"check:{p}:{h}:{hk}:16384:{d}" for d in (128, 64) for p in PATTERNS for h, hk in HEADS]
    h, hk, n, d = TIMED[0]
    t16 = [f"time:{p}:{h}:{hk}:{n}:{d}" for p in PATTERNS]
    t64 = [f"time:{p}:{h}:{hk}:{n}:{d}" for h, hk, n, d in TIMED[1:] for p in PATTERNS]
    return small + t16 + big + t64


def tflops(pattern: str, ms: float, gemms: int, h: int, n: int, d: int) -> float:
    f = 2.0 * gemms * h * n * n * d * (0.5 if pattern == "causal" else 1.0)
    return f / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------- child

class _Child:
    def __init__(self):
        import torch

        import blocksparse_fa as bsfa
        from blocksparse_fa.ops import select
        from blocksparse_fa.ops.options import GluonBwdConfig

        self.torch, self.bsfa, self.select = torch, bsfa, select
        five = json.loads(os.environ.get("BSFA_FIVE", "") or "null")  # --five: the checked variant's fields
        self.five = dict(backward="gluon", deterministic=False,
                         **({} if five is None else dict(gluon_bwd=GluonBwdConfig(**five))))
        other = json.loads(os.environ.get("BSFA_OTHER", "") or "null")  # --other: five_other's tiles
        self.five_other = (dict(backward="gluon", deterministic=False, gluon_bwd=GluonBwdConfig(**other))
                           if other is not None else None)
        # timings only: the checked variant with the consumer groups taking turns (pingpong)
        self.five_pp = (dict(backward="gluon", deterministic=False, gluon_bwd=GluonBwdConfig(pingpong=True))
                        if os.environ.get("BSFA_PINGPONG") == "1" else None)
        self.det = dict(deterministic=True)  # the deterministic pair, whatever the default
        self.default = None  # the library's defaults
        self.with_default = os.environ.get("BSFA_CHECK_DEFAULT", "1") == "1"  # checks: errors of the default too

    def inputs(self, h, hk, n, d, seed=0):
        torch = self.torch
        g = torch.Generator(device="cuda").manual_seed(seed)
        mk = lambda hh: torch.randn(1, hh, n, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        return mk(h), mk(hk), mk(hk), mk(h)

    def mask(self, pattern):
        return self.bsfa.full() if pattern == "dense" else self.bsfa.causal()

    def ours(self, pattern, q, k, v, do, opts):
        """O, dQ, dK, dV through ``attention`` with ``opts``, and the kernels that ran."""
        torch = self.torch
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with self.select.record() as ran:
            o = self.bsfa.attention(qg, kg, vg, mask=self.mask(pattern), kernel_options=opts)
            grads = torch.autograd.grad(o, (qg, kg, vg), do)
        torch.cuda.synchronize()
        return (o.detach(), *grads), [c for _, c in ran]

    def references(self, pattern, q, k, v, do, n_heads):
        """float64 and eager bf16 (O, dQ, dK, dV) on query heads ``0 .. n_heads-1`` (whole GQA
        groups), one head at a time (a 16K float64 score matrix is 2 GB)."""
        torch, bsfa = self.torch, self.bsfa
        G = q.shape[1] // k.shape[1]
        scale = q.shape[-1] ** -0.5
        out = []
        for up in (True, False):
            os_, dqs, dks, dvs = [], [], [], []
            for h in range(n_heads):
                hk = h // G
                ins = [t[:, i:i + 1].detach().clone() for t, i in ((q, h), (k, hk), (v, hk))]
                ins = [(t.double() if up else t).requires_grad_() for t in ins]
                o = bsfa.reference_attention(*ins, self.mask(pattern), scale=scale, upcast=up, align="top_left")
                gq, gk, gv = torch.autograd.grad(o, ins, do[:, h:h + 1].to(o.dtype))
                os_.append(o.detach())
                dqs.append(gq)
                if h % G == 0:
                    dks.append(gk.double())
                    dvs.append(gv.double())
                else:
                    dks[-1] += gk.double()
                    dvs[-1] += gv.double()
                del o, gq, gk, gv, ins
            cast = (lambda t: t) if up else (lambda t: t.to(q.dtype))
            out.append((torch.cat(os_, 1), torch.cat(dqs, 1), cast(torch.cat(dks, 1)), cast(torch.cat(dvs, 1))))
            del os_, dqs, dks, dvs
            torch.cuda.empty_cache()
        return out

    def check(self, pattern, h, hk, n, d) -> dict:
        q, k, v, do = self.inputs(h, hk, n, d, seed=n + d + h + hk)
        G = h // hk
        n_heads = h if n <= 4096 else max(2, G)
        got, ran = self.ours(pattern, q, k, v, do, self.five)
        det, ran_det = self.ours(pattern, q, k, v, do, self.det) if self.with_default else (None, [])
        (r64, eager) = self.references(pattern, q, k, v, do, n_heads)
        rec = dict(ran=ran, ran_deterministic=ran_det, heads_checked=n_heads)
        want = f"gluon:{pattern}+atomic_dq"
        ok = ran[-1:] == [want]
        if not ok:
            rec["why"] = f"expected backward {want}, ran {ran}"
        for i, name in enumerate(("o", "dq", "dk", "dv")):
            sl = slice(0, n_heads) if name in ("o", "dq") else slice(0, n_heads // G)
            err, eer = rel(got[i][:, sl], r64[i]), rel(eager[i], r64[i])
            derr = rel(det[i][:, sl], r64[i]) if det is not None else float("nan")
            nan = bool(got[i].isnan().any())
            rec[name] = dict(err=err, eager=eer, deterministic=derr, nan=nan)
            ok = ok and not nan and err <= 2 * eer
        rec["ok"] = bool(ok)
        return rec

    def timing(self, pattern, h, hk, n, d) -> dict:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        torch, bsfa = self.torch, self.bsfa
        q, k, v, do = self.inputs(h, hk, n, d)
        m = self.mask(pattern)
        rec = {}

        def cudnn(a, b, c):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                if rec.get("cudnn_kv_expanded"):
                    b, c = (t.repeat_interleave(h // hk, dim=1) for t in (b, c))
                    return F.scaled_dot_product_attention(a, b, c, is_causal=pattern == "causal")
                return F.scaled_dot_product_attention(a, b, c, is_causal=pattern == "causal", enable_gqa=h != hk)

        def fa4(a, b, c):  # (B, L, H, D) views; GQA native
            from peers import fa4_dense

            return fa4_dense(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2),
                             causal=pattern == "causal").transpose(1, 2)

        runs = (("five_gemm", lambda a, b, c: bsfa.attention(a, b, c, mask=m, kernel_options=self.five)),
                ("default", lambda a, b, c: bsfa.attention(a, b, c, mask=m, kernel_options=self.default)),
                ("deterministic", lambda a, b, c: bsfa.attention(a, b, c, mask=m, kernel_options=self.det)),
                ("cudnn", cudnn), ("fa4", fa4))
        if self.five_other is not None:
            runs += (("five_other", lambda a, b, c: bsfa.attention(a, b, c, mask=m, kernel_options=self.five_other)),)
        if self.five_pp is not None:
            runs += (("five_pingpong", lambda a, b, c: bsfa.attention(a, b, c, mask=m, kernel_options=self.five_pp)),)
        timed = {}  # name -> (backward of a kept graph, forward + backward)
        for name, fwd in runs:
            try:
                qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                if name == "cudnn":
                    try:
                        fwd(qg, kg, vg)
                    except RuntimeError:  # no GQA in this cuDNN path: K and V expanded
                        rec["cudnn_kv_expanded"] = True
                with self.select.record() as ran:
                    o = fwd(qg, kg, vg)
                    torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
                if name not in ("cudnn", "fa4"):
                    rec[f"{name}_ran"] = [c for _, c in ran]
                timed[name] = (lambda o=o, a=(qg, kg, vg): torch.autograd.grad(o, a, do, retain_graph=True),
                               lambda f=fwd, a=(qg, kg, vg): torch.autograd.grad(f(*a), a, do))
            except Exception as e:  # noqa: BLE001 - one failure is a result; the others still run
                import traceback

                rec[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
                print(traceback.format_exc(), flush=True)
        # passes over every implementation in turn: the GPU's clock drifts within a run (the same
        # kernels measured 10-20 % apart minutes apart), so each one's median is over passes
        passes = int(os.environ.get("BSFA_PASSES", "3"))
        got = {name: ([], []) for name in timed}
        for _ in range(passes):
            for name, (bwd, fb) in timed.items():
                got[name][0].append(bench_ms(bwd))
                got[name][1].append(bench_ms(fb))
        for name, (bwd, fb) in timed.items():
            rec[f"{name}_bwd_ms"] = sorted(got[name][0])[passes // 2]
            rec[f"{name}_fwdbwd_ms"] = sorted(got[name][1])[passes // 2]
            rec[f"{name}_passes_ms"] = {"bwd": [round(x, 4) for x in got[name][0]],
                                        "fwdbwd": [round(x, 4) for x in got[name][1]]}  # the spread
            if os.environ.get("BSFA_PROFILE") == "1":
                rec[f"{name}_kernels_ms"] = kernel_ms(torch, fb)
        timed.clear()
        torch.cuda.empty_cache()
        return rec

    def case(self, name: str) -> dict:
        kind, pattern, h, hk, n, d = name.split(":")
        h, hk, n, d = int(h), int(hk), int(n), int(d)
        return self.check(pattern, h, hk, n, d) if kind == "check" else self.timing(pattern, h, hk, n, d)


def kernel_ms(torch, fn, reps: int = 5) -> dict:
    """Device time per call of ``fn`` by kernel (torch.profiler, ``reps`` calls after one warm-up),
    the largest first, with ``"total"``: what the GPU spent, free of host gaps and timer noise."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if t > 0 and ev.device_type is not None and "cuda" in str(ev.device_type).lower():
            per[ev.key[:60]] = per.get(ev.key[:60], 0.0) + t / 1e3 / reps
    out = dict(sorted(per.items(), key=lambda kv: -kv[1])[:8])
    out["total"] = sum(per.values())
    return {k: round(v, 4) for k, v in out.items()}


def child_main(cases: list[str], progress: str) -> None:
    child_loop(_Child, cases, progress, "[gluon-bwd-tma]", _fmt)


def _fmt(rec: dict) -> str:
    """One line per finished case (shared with ``gluon_bwd_interval.py``): a check's errors against
    float64 beside eager's (and the deterministic pair's where recorded), else its fields."""
    if "error" in rec:
        return "ERROR " + rec["error"][:300]
    if "hung" in rec:
        return "HUNG (killed)"
    if "o" in rec:
        s = "PASS " if rec["ok"] else "FAIL "
        s += "  ".join(f"{n} {rec[n]['err']:.2e} (eager {rec[n]['eager']:.2e}"
                       + (f", deterministic {rec[n]['deterministic']:.2e}" if "deterministic" in rec[n] else "") + ")"
                       for n in ("o", "dq", "dk", "dv"))
        return s + f"  ran={rec['ran']}" + (f"  {rec['why']}" if "why" in rec else "")
    return "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items() if k != "seconds")


# ---------------------------------------------------------------- parent

def table(results) -> str:
    lines = ["| case | kernels | bwd ms | bwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | five-GEMM speed-up (bwd, f+b) |",
             "|---|---|---|---|---|---|---|"]
    for name, rec in results["cases"].items():
        if not name.startswith("time:"):
            continue
        _, pattern, h, hk, n, d = name.split(":")
        h, n, d = int(h), int(n), int(d)
        for who in ("five_gemm", "five_other", "five_pingpong", "default", "deterministic", "cudnn", "fa4"):
            if who in ("five_other", "five_pingpong") and not any(k.startswith(who) for k in rec):
                continue
            if f"{who}_bwd_ms" not in rec:
                why = rec.get(f"{who}_error") or rec.get("error") or rec.get("skipped") or "not run"
                lines.append(f"| {name} | {who} | {str(why)[:100]} | | | | |")
                continue
            b, fb = rec[f"{who}_bwd_ms"], rec.get(f"{who}_fwdbwd_ms", float("nan"))
            sp = ""
            if who != "five_gemm" and "five_gemm_bwd_ms" in rec:
                sp = f"{b / rec['five_gemm_bwd_ms']:.3f}x, {fb / rec.get('five_gemm_fwdbwd_ms', float('nan')):.3f}x"
            ran = rec.get(f"{who}_ran", [who + (" (K/V expanded)" if who == "cudnn" and rec.get("cudnn_kv_expanded")
                                                 else "")])
            lines.append(f"| {name} | {who}: {', '.join(ran)} | {b:.3f} | {tflops(pattern, b, 5, h, n, d):.0f} | "
                         f"{fb:.3f} | {tflops(pattern, fb, 7, h, n, d):.0f} | {sp} |")
    return "\n".join(lines)


def arg_parser(doc: str, budget: float, quick: str, out: str = "") -> argparse.ArgumentParser:
    """The command line of the Gluon backward scripts (``--child`` and ``--progress``: how
    :func:`drive` starts a child). Shared with ``gluon_bwd_interval.py`` and
    ``gluon_bwd_host_interval.py``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=budget, help="seconds for the whole run (cases past it skip)")
    ap.add_argument("--stall", type=float, default=60.0, help="kill a child silent this long (s)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help=out or None)
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--cases", nargs="*", default=None, help="only these cases (names as printed)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--progress", help=argparse.SUPPRESS)
    return ap


def main():
    ap = arg_parser(__doc__, 225.0,
                    "4K checks of d128 MHA and d64 GQA 4 (without the default path's errors), 16K timings")
    ap.add_argument("--other", default="", help="timings: five_other = the checked variant with these "
                    "GluonBwdConfig fields (JSON, e.g. '{\"stages\": 3}')")
    ap.add_argument("--five", default="", help="checks and timings: five_gemm with these GluonBwdConfig fields "
                    "(JSON, e.g. '{\"rows_smem\": true}'; the default five-GEMM kernel is still timed as default)")
    ap.add_argument("--passes", type=int, default=3, help="timings: passes over all implementations, each taking its turn (median)")
    ap.add_argument("--pingpong", action="store_true", help="timings: also the checked variant with pingpong")
    ap.add_argument("--profile", action="store_true",
                    help="timings: also the device time per fwd+bwd by kernel (torch.profiler)")
    args = ap.parse_args()
    if args.child:
        child_main(args.cases, args.progress)
        return
    # read by the children
    os.environ["BSFA_PROFILE"] = "1" if args.profile else "0"
    os.environ["BSFA_PINGPONG"] = "1" if args.pingpong else "0"
    os.environ["BSFA_PASSES"] = str(args.passes)
    os.environ["BSFA_OTHER"] = args.other
    os.environ["BSFA_FIVE"] = args.five
    os.environ["BSFA_CHECK_DEFAULT"] = "0" if args.quick else "1"
    drive(args, args.cases or all_cases(args.quick), "gluon_bwd_tma.json", _fmt, table, 30, __file__,
          other=args.other, five=args.five)


def drive(args, cases: list[str], name: str, fmt, tabulate, width: int, script: str, **extra) -> None:
    """Run ``cases`` in child processes of ``script`` (``args.budget``, ``args.stall``), write
    ``args.out/name`` after every case, then print the checks (``fmt``) and the table
    (``tabulate``). Shared with ``gluon_bwd_interval.py``."""
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    import torch
    import triton

    results = dict(out_dir=args.out, gluon={}, **extra, cases=cases,
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                   torch=torch.__version__, triton=triton.__version__)
    path = os.path.join(args.out, name)

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    save()
    run_children(cases, t0 + args.budget, args.stall, results, save, script=script)
    results["cases"] = {c: results["gluon"].get(c, dict(skipped="not reached")) for c in cases}
    del results["gluon"]
    results["seconds"] = round(time.time() - t0, 1)
    save()
    print("\nchecks:")
    n_pass = 0
    for case, rec in results["cases"].items():
        if case.startswith("check:"):
            n_pass += bool(rec.get("ok"))
            print(f"  {case:{width}s} {'' if 'o' in rec else 'FAIL '}{fmt(rec)}")
    n_checks = sum(c.startswith("check:") for c in cases)
    print(f"{n_pass}/{n_checks} checks PASS")
    print("\n" + tabulate(results))
    print(f"\n{results['seconds']} s; {path}")

if __name__ == "__main__":
    main()
