"""The Gluon backward's interval mode (``kernels/backward_gluon.py`` with ``INTERVAL``: one key
interval per query row, per-tile ranges built on the device) on the H100: checked, then timed
beside the Triton interval backward (``_interval_bwd``).

1. Checks (``check:*``): O, dQ, dK and dV against float64 (``reference_attention`` per query head;
   dK and dV summed over each GQA group), beside eager attention in bf16 on the same heads.
   Patterns: ``docs`` (``causal() & document(ids)``, contiguous documents of 1-8K tokens with tiny
   ones of 1-100 mixed in), ``docs_window`` (``& sliding_window(512)``), ``window``
   (``sliding_window(1024)``), ``docs_rows`` (``docs & query_range(L/4, 3L/4)``: rows that keep
   nothing). Masks with a document run through ``attention``; ``window`` (no document: the
   attention path takes the compiled layout) through ``ops.interval_backend.interval_attention``
   on its device intervals. MHA 16/16 and GQA 16/4, d 64 and 128, 4K (every head) and 16K (the
   first group). PASS: every relative error at most 2x eager's, no NaN, and the backward that ran
   (``ops.select.record()``) is ``gluon:interval``.
2. Timings (``time:*``, ``triton.testing.do_bench`` medians, bf16, B = 1): backward alone
   (``autograd.grad`` of a kept output) and forward + backward, default (``gluon:interval``) against
   ``kernel_options=dict(backward="triton")``, at 16K H16 d128 and 64K H8/Hkv2 d128, for ``docs``
   (documents of 1-4K) and ``window``.

Every case runs in a child process killed after ``--stall`` s without progress (a barrier mistake
in a Gluon kernel hangs rather than raising: ``gluon_fwd.run_children``). Results:
``$OUT/gluon_bwd_interval.json`` (rewritten after every case), a PASS/FAIL line per check, a table.

    PYTHONPATH=. python benchmarks/experiments/gluon_bwd_interval.py --out DIR [--quick] [--budget 225]
        [--cases check:docs:16:4:4096:128 time:window:16:16:16384:128 ...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_bwd_tma import _Child as _TmaChild, _fmt, arg_parser, drive  # noqa: E402
from gluon_fwd import bench_ms, child_loop, rel  # noqa: E402

PATTERNS = ("docs", "docs_window", "window", "docs_rows")
TIMED = [(16, 16, 16384, 128), (8, 2, 65536, 128)]


def all_cases(quick: bool) -> list[str]:
    """Case names ``check:{pattern}:{H}:{Hkv}:{L}:{d}`` and ``time:...``, most wanted first."""
    if quick:
        checks = [f"check:{p}:{h}:{hk}:4096:{d}" for p in PATTERNS for h, hk, d in ((16, 16, 128), (16, 4, 64))]
        return checks + [f"time:{p}:16:16:16384:128" for p in ("docs", "window")]
    small = [f"check:{p}:{h}:{hk}:4096:{d}" for d in (128, 64) for p in PATTERNS for h, hk in ((16, 16), (16, 4))]
    big = [f"check:{p}:16:4:16384:128" for p in PATTERNS]
    times = [f"time:{p}:{h}:{hk}:{n}:{d}" for h, hk, n, d in TIMED for p in ("docs", "window")]
    return small + times[:2] + big + times[2:]


def doc_lengths(n: int, lo: int, hi: int, seed: int, tiny: bool) -> list[int]:
    """Document lengths summing to ``n``: uniform in ``[lo, hi]``, with (``tiny``) every third one
    1-100 tokens."""
    import random

    rng = random.Random(seed)
    out, left = [], n
    while left > 0:
        x = rng.randint(1, 100) if tiny and len(out) % 3 == 1 else rng.randint(lo, hi)
        out.append(min(x, left))
        left -= out[-1]
    return out


# ---------------------------------------------------------------- child

class _Child(_TmaChild):
    """``gluon_bwd_tma``'s child (its inputs and per-head references), on interval masks."""

    def __init__(self):
        super().__init__()
        from blocksparse_fa.compiler.device_intervals import interval_spec
        from blocksparse_fa.ops.interval_backend import interval_attention

        self.interval_spec, self.interval_attention = interval_spec, interval_attention
        self.triton_bwd = dict(backward="triton")

    def mask(self, m):  # the references take the mask itself
        return m

    def build_mask(self, pattern, n, timing=False):
        bsfa, torch = self.bsfa, self.torch
        if pattern == "window":
            return bsfa.sliding_window(1024)
        lens = doc_lengths(n, 1024, 4096, n, False) if timing else doc_lengths(n, 1, 8192, n + 1, True)
        cu = torch.tensor([0] + lens).cumsum(0)
        m = bsfa.causal() & bsfa.document_from_cu_seqlens(cu, n)
        if pattern == "docs_window":
            m = m & bsfa.sliding_window(512)
        elif pattern == "docs_rows":
            m = m & bsfa.query_range(n // 4, 3 * n // 4)
        return m

    def fwd(self, pattern, mask, opts):
        """``(q, k, v) -> out`` on the device-interval path."""
        if pattern == "window":  # no document: attention() would take the compiled layout
            n_cache = {}

            def run(q, k, v):
                key = (q.shape[2], k.shape[2])
                if key not in n_cache:
                    n_cache[key] = self.interval_spec(mask, *key, require_tensor=False).bounds(q.device)
                return self.interval_attention(q, k, v, n_cache[key], q.shape[-1] ** -0.5, backend="triton",
                                               kernel_options=opts)
            return run
        return lambda q, k, v: self.bsfa.attention(q, k, v, mask=mask, kernel_options=opts)

    def ours(self, fwd, q, k, v, do):
        torch = self.torch
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with self.select.record() as ran:
            o = fwd(qg, kg, vg)
            grads = torch.autograd.grad(o, (qg, kg, vg), do)
        torch.cuda.synchronize()
        return (o.detach(), *grads), [c for _, c in ran]

    def check(self, pattern, h, hk, n, d) -> dict:
        q, k, v, do = self.inputs(h, hk, n, d, seed=n + d + h + hk)
        G = h // hk
        n_heads = h if n <= 4096 else G
        mask = self.build_mask(pattern, n)
        got, ran = self.ours(self.fwd(pattern, mask, None), q, k, v, do)
        r64, eager = self.references(mask, q, k, v, do, n_heads)
        rec = dict(ran=ran, heads_checked=n_heads)
        ok = ran[-1:] == ["gluon:interval"]
        if not ok:
            rec["why"] = f"expected backward gluon:interval, ran {ran}"
        for i, name in enumerate(("o", "dq", "dk", "dv")):
            sl = slice(0, n_heads) if name in ("o", "dq") else slice(0, n_heads // G)
            err, eer = rel(got[i][:, sl], r64[i]), rel(eager[i], r64[i])
            nan = bool(got[i].isnan().any())
            rec[name] = dict(err=err, eager=eer, nan=nan)
            ok = ok and not nan and err <= 2 * eer
        rec["ok"] = bool(ok)
        return rec

    def timing(self, pattern, h, hk, n, d) -> dict:
        torch = self.torch
        q, k, v, do = self.inputs(h, hk, n, d)
        mask = self.build_mask(pattern, n, timing=True)
        spec = self.interval_spec(mask, n, n, require_tensor=False)
        iv = spec.bounds(q.device)
        rec = dict(kept_pairs=int((iv.hi.long() - iv.lo.long()).clamp_min(0).sum().item()))
        for name, opts in (("gluon", None), ("triton", self.triton_bwd)):
            fwd = self.fwd(pattern, mask, opts)
            try:
                qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                with self.select.record() as ran:
                    o = fwd(qg, kg, vg)
                    torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
                rec[f"{name}_ran"] = [c for _, c in ran]
                rec[f"{name}_bwd_ms"] = bench_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
                o = None
                rec[f"{name}_fwdbwd_ms"] = bench_ms(lambda: torch.autograd.grad(fwd(qg, kg, vg), (qg, kg, vg), do))
            except Exception as e:  # noqa: BLE001 - one failure is a result; the other still runs
                import traceback

                rec[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
                print(traceback.format_exc(), flush=True)
            torch.cuda.empty_cache()
        return rec


def child_main(cases: list[str], progress: str) -> None:
    child_loop(_Child, cases, progress, "[gluon-bwd-interval]", _fmt)


# ---------------------------------------------------------------- parent

def table(results) -> str:
    """Per timed case and backward: ms and TFLOP/s (kept pairs: 10 flops·d per pair for the
    backward's five products, 14 for fwd+bwd) and the Triton/Gluon ratio."""
    lines = ["| case | backward ran | bwd ms | bwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | speed-up vs triton (bwd, f+b) |",
             "|---|---|---|---|---|---|---|"]
    for name, rec in results["cases"].items():
        if not name.startswith("time:"):
            continue
        _, pattern, h, hk, n, d = name.split(":")
        h, d = int(h), int(d)
        kept = rec.get("kept_pairs", 0)
        for who in ("gluon", "triton"):
            if f"{who}_bwd_ms" not in rec:
                why = rec.get(f"{who}_error") or rec.get("error") or rec.get("skipped") or rec.get("hung") or "not run"
                lines.append(f"| {name} | {who}: {str(why)[:100]} | | | | | |")
                continue
            b, fb = rec[f"{who}_bwd_ms"], rec.get(f"{who}_fwdbwd_ms", float("nan"))
            sp = ""
            if who == "gluon" and "triton_bwd_ms" in rec:
                sp = f"{rec['triton_bwd_ms'] / b:.2f}x, {rec.get('triton_fwdbwd_ms', float('nan')) / fb:.2f}x"
            tf = lambda ms, g: 2.0 * g * h * kept * d / (ms * 1e-3) / 1e12  # noqa: E731
            lines.append(f"| {name} | {', '.join(rec.get(f'{who}_ran', []))} | {b:.3f} | {tf(b, 5):.0f} | "
                         f"{fb:.3f} | {tf(fb, 7):.0f} | {sp} |")
    return "\n".join(lines)


def main():
    args = arg_parser(__doc__, 225.0, "4K checks of d128 MHA and d64 GQA 4, 16K timings").parse_args()
    if args.child:
        child_main(args.cases, args.progress)
        return
    drive(args, args.cases or all_cases(args.quick), "gluon_bwd_interval.json", _fmt, table, 34, __file__)

if __name__ == "__main__":
    main()
