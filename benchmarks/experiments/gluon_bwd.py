"""The Gluon backward (``kernels/backward_gluon.py``) on the H100: checked, then timed beside our
default backward, cuDNN and FlexAttention.

1. Checks, each variant on its own: O (our default forward), dQ, dK and dV against float64 on small
   shapes (GQA, head dims 64/128, fp16/bf16, strided inputs, dense and causal) and on heads 0-1 of
   the timed 16K inputs. Gradients start as NaN (every element must be written). Pass: each
   relative error at most 2x that of eager attention in the same dtype (both printed).
2. Timings (``triton.testing.do_bench``, median) at N = 16K, d = 128, bf16, B = 1, H = 16, dense and
   causal: the backward alone (``triton_backward`` from saved O/LSE, Delta preprocess included) and
   forward + backward through ``blocksparse_fa.attention`` with the default forward (the Gluon one
   where it runs) and the variant's backward, for every variant that passed its check, beside our
   default (Gluon forward + Gluon backward, ``ours_default``), the block-sparse backward
   (``ours_blocksparse``), cuDNN (SDPA) and compiled FlexAttention. TFLOP/s of the backward count
   10·B·H·N²·d (causal: half), of fwd+bwd 14·B·H·N²·d.

Variants (``VARIANTS``: :class:`GluonBwdConfig` fields and deterministic or not, run as the kernel
options ``backward="gluon", gluon_bwd=..., deterministic=...``): ``det`` (the
default: dK/dV kernel + dQ kernel with 128-key steps), ``atomic`` (dQ added with fp32 atomics by the
dK/dV kernel), and the schedules: ``pp`` (both kernels'
consumer groups take turns issuing), ``ov*`` (dK/dV kernel: ``dK += dSᵀ·Q`` of step t issued with
step t+1's first products; 1: dS in registers, 2: through shared memory; ``_s3``: 3 stages),
``dqov*`` (the same in the dQ kernel), and combinations.

A barrier mistake in a Gluon kernel hangs the GPU rather than raising, so the Gluon cases run in a
child process killed when it makes no progress for ``--stall`` seconds (``gluon_fwd.run_children``).
Results: ``$OUT/gluon_bwd.json`` (rewritten after every case) and a table on stdout.

    PYTHONPATH=. python benchmarks/experiments/gluon_bwd.py [--budget 280] [--out DIR] [--no-flex]
        [--variants det ov2_s3 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_fwd import bench_ms, child_loop, rel, run_children  # noqa: E402

N, H, D = 16384, 16, 128
# name -> (GluonBwdConfig fields, deterministic)
# (ordered by expected value: when the budget runs out the last ones are skipped)
VARIANTS = {
    "det": ({}, True),
    "ov2_s3": (dict(overlap=2, stages=3), True),
    "ov2_s3+dqov2": (dict(overlap=2, stages=3, dq_overlap=2), True),
    "ov2_s3_pp+dqov2_pp": (dict(overlap=2, stages=3, pingpong=True, dq_overlap=2, dq_pingpong=True), True),
    "pp": (dict(pingpong=True, dq_pingpong=True), True),
    "ov2_s2": (dict(overlap=2, stages=2), True),
    "ov1_s3": (dict(overlap=1, stages=3), True),
    "dqov1_bn64_s3": (dict(dq_overlap=1, dq_block_n=64, dq_stages=3), True),
    "atomic": ({}, False),
}
# small checks: (pattern, B, H, Hkv, L, d, dtype, strided)
SMALL = [
    ("dense", 2, 4, 2, 512, 128, "bf16", False),
    ("dense", 1, 2, 2, 256, 64, "fp16", False),
    ("dense", 1, 4, 2, 384, 128, "bf16", True),
    ("causal", 1, 3, 3, 640, 128, "bf16", False),
    ("causal", 2, 4, 1, 256, 64, "fp16", True),
]


def child_cases(variants=None) -> list[str]:
    """Every small check of the default variant, then per variant (in ``VARIANTS`` order) two small
    checks (dense GQA d 128 bf16; causal GQA 4 d 64 fp16 strided; all five for the atomic one) and
    the two timed cases (which check heads 0-1 at 16K first)."""
    variants = [v for v in VARIANTS if variants is None or v in variants]
    cases = [f"small:{i}:det" for i in range(len(SMALL)) if "det" in variants]
    for v in variants:
        if v == "atomic":
            cases += [f"small:{i}:{v}" for i in range(len(SMALL))]
        elif v != "det":
            cases += [f"small:0:{v}", f"small:4:{v}"]
        cases += [f"big:dense:{v}", f"big:causal:{v}"]
    return cases


def tflops(pattern: str, ms: float, gemms: int) -> float:
    f = 2.0 * gemms * H * N * N * D * (0.5 if pattern == "causal" else 1.0)
    return f / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------- child: Gluon cases

class _Child:
    def __init__(self):
        import torch

        import blocksparse_fa as bsfa
        from blocksparse_fa.ops import triton_backend as tb

        self.torch, self.bsfa, self.tb = torch, bsfa, tb
        self.calls = 0
        launch = tb._gluon_bwd_launch

        def counted(*a, **kw):
            self.calls += 1
            return launch(*a, **kw)

        tb._gluon_bwd_launch = counted
        self.big = {}
        self.opts = None  # the kernel options of the current variant (set_variant)

    def set_variant(self, name):
        from blocksparse_fa.ops.options import GluonBwdConfig, KernelOptions

        fields, det = VARIANTS[name]
        self.opts = KernelOptions(backward="gluon", gluon_bwd=GluonBwdConfig(**fields), deterministic=det)
        return det

    def mask(self, pattern):
        return self.bsfa.full() if pattern == "dense" else self.bsfa.causal()

    def references(self, pattern, q, k, v, do, heads):
        """float64 and eager (same dtype) O, dQ, dK, dV on query heads ``heads`` (all if None)."""
        torch, bsfa = self.torch, self.bsfa
        from blocksparse_fa.ops.validate import check_qkv

        s = check_qkv(q, k, v)
        sl = slice(None) if heads is None else slice(0, heads)
        kv_sl = sl if heads is None else slice(0, -(-heads // s.G))
        m, scale = self.mask(pattern), q.shape[-1] ** -0.5
        res = []
        for up in (True, False):
            ins = [t[:, sl2].detach().clone() for t, sl2 in ((q, sl), (k, kv_sl), (v, kv_sl))]
            ins = [(t.double() if up else t).requires_grad_() for t in ins]
            o = bsfa.reference_attention(*ins, m, scale=scale, upcast=up, align="top_left")
            g = torch.autograd.grad(o, ins, do[:, sl].to(o.dtype))
            res.append((o.detach(), *g))
            del o, g, ins
        return res

    def run_check(self, pattern, q, k, v, do, det, heads=None) -> dict:
        torch, bsfa, tb = self.torch, self.bsfa, self.tb
        from blocksparse_fa.ops.validate import check_qkv

        s = check_qkv(q, k, v)
        scale = q.shape[-1] ** -0.5
        lay = bsfa.compile_mask(self.mask(pattern), s.Lq, s.Lk, 128, device=q.device)
        out, lse = tb.triton_forward(q, k, v, lay, s, scale, 0.0, 0, opts=self.opts)
        before = self.calls
        real_empty = torch.empty

        def poisoned(*a, **kw):  # gradients start as NaN: every element must be written
            t = real_empty(*a, **kw)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        torch.empty = poisoned
        try:
            dq, dk, dv = tb.triton_backward(q, k, v, out, lse, do, lay, s, scale, 0.0, 0, deterministic=det,
                                            opts=self.opts)
        finally:
            torch.empty = real_empty
        torch.cuda.synchronize()
        rec = dict(gluon_ran=self.calls > before, nan=any(bool(t.isnan().any()) for t in (dq, dk, dv)))
        key = ("ref", pattern)
        refs = self.big.get(key) if heads is not None else None
        if refs is None:
            refs = self.references(pattern, q, k, v, do, heads)
            if heads is not None:
                self.big[key] = refs
        (r_o, r_dq, r_dk, r_dv), (e_o, e_dq, e_dk, e_dv) = refs
        sl = slice(None) if heads is None else slice(0, heads)
        kv_sl = sl if heads is None else slice(0, -(-heads // s.G))
        ok = rec["gluon_ran"] and not rec["nan"]
        for name, got, ref, eag in (("o", out[:, sl], r_o, e_o), ("dq", dq[:, sl], r_dq, e_dq),
                                    ("dk", dk[:, kv_sl], r_dk, e_dk), ("dv", dv[:, kv_sl], r_dv, e_dv)):
            err, eer = rel(got, ref), rel(eag, ref)
            rec[name] = [err, eer]
            ok = ok and err <= 2 * eer
        rec["ok"] = bool(ok)
        return rec

    def case(self, name: str) -> dict:
        torch, bsfa, tb = self.torch, self.bsfa, self.tb
        kind, a, var = name.split(":")
        det = self.set_variant(var)
        dev = "cuda"
        if kind == "small":
            pattern, b, h, hkv, L, d, dt, strided = SMALL[int(a)]
            dtype = torch.bfloat16 if dt == "bf16" else torch.float16
            g = torch.Generator(device=dev).manual_seed(int(a))

            def mk(hh):
                if strided:  # (B, L, H, D) memory viewed as (B, H, L, D), as after a projection
                    return torch.randn(b, L, hh, d, device=dev, dtype=dtype, generator=g).transpose(1, 2)
                return torch.randn(b, hh, L, d, device=dev, dtype=dtype, generator=g)

            q, k, v, do = mk(h), mk(hkv), mk(hkv), mk(h)
            rec = self.run_check(pattern, q, k, v, do, det)
            rec.update(shape=dict(pattern=pattern, B=b, H=h, Hkv=hkv, L=L, d=d, dtype=dt, strided=strided))
            return rec
        pattern = a
        if "qkv" not in self.big:
            g = torch.Generator(device=dev).manual_seed(0)
            self.big["qkv"] = [torch.randn(1, H, N, D, device=dev, dtype=torch.bfloat16, generator=g)
                               for _ in range(4)]
        q, k, v, do = self.big["qkv"]
        rec = self.run_check(pattern, q, k, v, do, det, heads=2)
        if rec["ok"]:
            from blocksparse_fa.ops.validate import check_qkv

            s = check_qkv(q, k, v)
            m = self.mask(pattern)
            scale = D ** -0.5
            lay = bsfa.compile_mask(m, N, N, 128, device=q.device)
            opts = self.opts
            out, lse = tb.triton_forward(q, k, v, lay, s, scale, 0.0, 0, opts=opts)
            bwd = lambda: tb.triton_backward(q, k, v, out, lse, do, lay, s, scale, 0.0, 0, opts=opts)  # noqa: E731
            before = self.calls
            bwd()
            rec["timed_gluon"] = self.calls > before
            rec["bwd_ms"] = bench_ms(bwd)
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

            def fb():  # the default forward (the Gluon forward on Hopper); the variant's backward
                grads = torch.autograd.grad(bsfa.attention(qg, kg, vg, mask=m, kernel_options=opts), (qg, kg, vg),
                                            do)
                del grads

            try:
                before = self.calls
                fb()
                torch.cuda.synchronize()
                # autograd runs the backward on its own thread: check the Gluon backward ran there
                rec["fwdbwd_gluon"] = self.calls > before
                rec["fwdbwd_ms"] = bench_ms(fb)
            except Exception as e:  # noqa: BLE001
                rec["fwdbwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(traceback.format_exc(), flush=True)
        return rec


def child_main(cases: list[str], progress: str) -> None:
    child_loop(_Child, cases, progress, "[gluon-bwd]", _fmt)


def _fmt(rec: dict) -> str:
    if "error" in rec:
        return "ERROR " + rec["error"][:200]
    if "hung" in rec:
        return "HUNG (killed)"
    if "o" not in rec:
        return str(rec)
    s = f"{'ok' if rec.get('ok') else 'FAIL'} "
    s += "  ".join(f"{n} {rec[n][0]:.2e} (eager {rec[n][1]:.2e})" for n in ("o", "dq", "dk", "dv"))
    s += f"  ran={rec['gluon_ran']} nan={rec['nan']}"
    if "bwd_ms" in rec:
        s += f"  bwd {rec['bwd_ms']:.3f} ms"
    if "fwdbwd_ms" in rec:
        s += f"  fwd+bwd {rec['fwdbwd_ms']:.3f} ms (Gluon backward ran: {rec.get('fwdbwd_gluon')})"
    if "fwdbwd_error" in rec:
        s += f"  fwd+bwd ERROR {rec['fwdbwd_error'][:200]}"
    return s


# ---------------------------------------------------------------- parent

def baselines(results, deadline, save, no_flex=False):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import blocksparse_fa as bsfa
    from blocksparse_fa.ops import triton_backend as tb
    from blocksparse_fa.ops.validate import check_qkv

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    s = check_qkv(q, k, v)
    scale = D ** -0.5
    base = results["baselines"]

    def fwd_bwd_pair(fwd):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = fwd(qg, kg, vg)
        bwd = lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)  # noqa: E731

        def fb():
            torch.autograd.grad(fwd(qg, kg, vg), (qg, kg, vg), do)

        return bwd, fb

    for pattern in ("dense", "causal"):
        rec = base.setdefault(pattern, {})
        m = bsfa.full() if pattern == "dense" else bsfa.causal()
        # ours_default: the library's defaults (Gluon forward and backward on Hopper), run in this
        # process only when the default variant passed its checks in a child (a hang would stop
        # the run here); ours_blocksparse: the block-sparse backward (Gluon forward)
        det_ok = results["gluon"].get(f"big:{pattern}:det", {}).get("ok", False)
        for name, opts in (("ours_default", bsfa.KernelOptions()),
                           ("ours_blocksparse", bsfa.KernelOptions(backward="triton"))):
            if name == "ours_default" and not det_ok:
                rec[f"{name}_skipped"] = "the default Gluon variant did not pass its check in a child"
                continue
            try:
                lay = bsfa.compile_mask(m, N, N, 128, device=q.device)
                out, lse = tb.triton_forward(q, k, v, lay, s, scale, 0.0, 0, opts=opts)
                bwd = lambda: tb.triton_backward(q, k, v, out, lse, do, lay, s, scale, 0.0, 0, opts=opts)  # noqa: E731
                bwd()
                rec[f"{name}_bwd_ms"] = bench_ms(bwd)
                _, fb = fwd_bwd_pair(lambda a, b_, c: bsfa.attention(a, b_, c, mask=m, kernel_options=opts))
                fb()
                rec[f"{name}_fwdbwd_ms"] = bench_ms(fb)
            except Exception:  # noqa: BLE001
                rec[f"{name}_error"] = traceback.format_exc()[-2000:]
                print(rec[f"{name}_error"], flush=True)
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                bwd, fb = fwd_bwd_pair(lambda a, b_, c: F.scaled_dot_product_attention(a, b_, c,
                                                                                      is_causal=pattern == "causal"))
                bwd()
                rec["cudnn_bwd_ms"] = bench_ms(bwd)
                fb()
                rec["cudnn_fwdbwd_ms"] = bench_ms(fb)
        except Exception:  # noqa: BLE001
            rec["cudnn_error"] = traceback.format_exc()[-2000:]
            print(rec["cudnn_error"], flush=True)
        save()
    for pattern in ("dense", "causal"):
        rec = base[pattern]
        if no_flex or time.time() > deadline:
            rec["flex_skipped"] = "--no-flex" if no_flex else "time budget"
            continue
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
            bm = None
            if pattern == "causal":
                bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, N, N, device="cuda")
            bwd, fb = fwd_bwd_pair(lambda a, b_, c: flex(a, b_, c, block_mask=bm))
            bwd()
            rec["flex_bwd_ms"] = bench_ms(bwd)
            fb()
            rec["flex_fwdbwd_ms"] = bench_ms(fb)
        except Exception:  # noqa: BLE001
            rec["flex_error"] = traceback.format_exc()[-2000:]
            print(rec["flex_error"], flush=True)
        save()


def table(results) -> str:
    lines = ["| pattern | kernel | check (max err / eager) | bwd ms | bwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
             "vs ours default (bwd, f+b) | vs cuDNN (bwd, f+b) | vs Flex (bwd, f+b) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for pattern in ("dense", "causal"):
        b = results["baselines"].get(pattern, {})
        for name in ("ours_default", "ours_blocksparse", "cudnn", "flex"):
            if f"{name}_bwd_ms" in b:
                ms, fb = b[f"{name}_bwd_ms"], b.get(f"{name}_fwdbwd_ms", float("nan"))
                lines.append(f"| {pattern} | {name} | | {ms:.3f} | {tflops(pattern, ms, 5):.0f} | {fb:.3f} | "
                             f"{tflops(pattern, fb, 7):.0f} | | | |")
        for var in VARIANTS:
            rec = results["gluon"].get(f"big:{pattern}:{var}")
            if rec is None:
                continue
            if "o" not in rec:
                why = str(rec.get("error") or rec.get("skipped"))[:120]
                lines.append(f"| {pattern} | gluon {var} | {why} | | | | | | | |")
                continue
            worst = max(rec[n][0] / max(rec[n][1], 1e-30) for n in ("o", "dq", "dk", "dv"))
            chk = f"{'ok' if rec['ok'] else 'FAIL'} {worst:.2f}x"
            if "bwd_ms" not in rec:
                lines.append(f"| {pattern} | gluon {var} | {chk} | | | | | | | |")
                continue
            ms, fb = rec["bwd_ms"], rec.get("fwdbwd_ms", float("nan"))

            def r(key):
                bb, ff = b.get(f"{key}_bwd_ms"), b.get(f"{key}_fwdbwd_ms", float("nan"))
                return f"{bb / ms:.3f}x, {ff / fb:.3f}x" if bb else ""

            fbs = f"{fb:.3f}" if "fwdbwd_ms" in rec else f"error: {str(rec.get('fwdbwd_error'))[:80]}"
            if "fwdbwd_ms" in rec and not rec.get("fwdbwd_gluon"):
                fbs += " (Gluon backward did not run)"
            lines.append(f"| {pattern} | gluon {var} | {chk} | {ms:.3f} | {tflops(pattern, ms, 5):.0f} | {fbs} | "
                         f"{tflops(pattern, fb, 7):.0f} | {r('ours_default')} | {r('cudnn')} | {r('flex')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=280.0, help="seconds for the whole run")
    ap.add_argument("--stall", type=float, default=60.0, help="kill a Gluon child silent this long (s)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--progress", help=argparse.SUPPRESS)
    ap.add_argument("--cases", nargs="*", default=None, help="Gluon cases (default: all)")
    ap.add_argument("--variants", nargs="*", default=None, help=f"only these variants (of {', '.join(VARIANTS)})")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes ~60 s)")
    args = ap.parse_args()
    if args.child:
        child_main(args.cases, args.progress)
        return
    t0 = time.time()
    deadline = t0 + args.budget
    os.makedirs(args.out, exist_ok=True)
    import torch
    import triton

    results = dict(out_dir=args.out, gluon={}, baselines={}, variants={k: v[0] | {"deterministic": v[1]}
                                                                     for k, v in VARIANTS.items()},
                   N=N, H=H, d=D, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                   torch=torch.__version__, triton=triton.__version__)
    path = os.path.join(args.out, "gluon_bwd.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    save()
    # the Gluon cases get the budget less the time kept for the baselines (Flex compiles fwd and bwd)
    cases = args.cases or child_cases(args.variants)
    run_children(cases, deadline - (60 if args.no_flex else 110), args.stall, results, save, script=__file__)
    try:
        baselines(results, deadline, save, args.no_flex)
    except Exception:  # noqa: BLE001
        results["baseline_error"] = traceback.format_exc()[-2000:]
        print(results["baseline_error"], flush=True)
    results["seconds"] = round(time.time() - t0, 1)
    save()
    print("\nsmall checks:")
    for name, rec in results["gluon"].items():
        if name.startswith("small"):
            print(f"  {name:22s} {_fmt(rec)}")
    print("\n" + table(results))
    print(f"\n{results['seconds']} s; {path}")


if __name__ == "__main__":
    main()
