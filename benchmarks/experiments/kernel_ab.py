"""Kernel variants side by side on the H100, checked against float64, beside FlexAttention and cuDNN.

The variants are kernel options (:class:`~blocksparse_fa.KernelOptions`, passed per call as
``kernel_options=``), all off by default in the package; ``benchmarks/NOTES.md`` says what each
is and what the sm_90 compile showed: "Lever 1" to "Lever 4". Every variant, ``default`` included,
runs the Triton kernels (``forward="triton"``, ``backward="triton"``: the Gluon kernels, the
default for dense and causal on Hopper, are off):

- ``no_even``: masked loops keep their bounds checks even when the lengths are multiples of the
  layout block (``even=False``; the default drops them);
- ``band_flex``: FlexAttention's backward tiles (dK/dV 64x128, dQ 128x64, 3 stages, 8 warps) in
  flat loops for band-like layouts (``band_backward="flex"``);
- ``atomic``: the five-GEMM backward, dQ through fp32 atomic adds (``deterministic=False``);
  ``atomic_tma``: those adds as TMA reduce-adds (``dq_desc=True``);
- ``dense_ws`` / ``dense_plain``: dense layouts through the descriptor-only forward, warp-specialised
  (4 warps) or not (8 warps) (``forward="ws"`` / ``"plain"``);
- ``lists_*`` ("Lever 5"): the kernels' lists from a finer classification than the layout block
  (``lists=...``, ``compiler/finer.py``): ``lists_auto`` the cost model's choice
  per side between the layout block and its half, ``lists_half`` half layout blocks on every side
  (forward/dQ 64 keys, dK/dV 64 queries per entry), ``lists_fine`` blocks of the kernel step
  (dK/dV 32 queries with the partial-heavy tiles), ``*_tiles`` with the stages multiplied by the
  tiles per layout block (``list_stages="tiles"``: the same tiles in flight and shared memory).

Two suites of cases: ``--suite levers`` (the default: Levers 1 to 4) and ``--suite lists`` (Lever
5: coarse against finer lists on Longformer, BigBird, the 1024 window and documents at 16K and
64K; each case records the list blocks its launches used, ``list_blocks``).

Every (pattern, variant) is first checked on heads 0 and 1 of the timed inputs (N = 16K) against
a float64 reference: O, dQ, dK, dV, passing when our relative error is at most twice that of eager
attention in bf16 on the same inputs. Then forward and forward+backward are timed with
``triton.testing.do_bench`` (median) through ``blocksparse_fa.attention`` and autograd, as
``benchmarks/bench.py`` does, beside FlexAttention (compiled) and, for dense and causal, SDPA's
cuDNN backend. Kernels and Flex are compiled first by parallel worker processes (Triton's and
Inductor's disk caches). Results go to ``$OUT/kernel_ab.json`` after every case, and a table is
printed at the end. The whole run keeps to ``--budget`` seconds (default 450): cases left when it
is spent are reported as skipped.

    PYTHONPATH=. python benchmarks/experiments/kernel_ab.py [--suite levers|lists] [--cases ...] [--budget 450]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.py

BASE = dict(forward="triton", backward="triton")  # every variant: the Triton kernels
# name -> kernel options (fields of KernelOptions beyond BASE)
VARIANTS = {
    "default": {},
    "no_even": dict(even=False),
    "band_flex": dict(band_backward="flex"),
    "band_flex_no_even": dict(band_backward="flex", even=False),
    "atomic": dict(deterministic=False),
    "atomic_no_even": dict(deterministic=False, even=False),
    "atomic_tma": dict(deterministic=False, dq_desc=True),
    "dense_plain": dict(forward="plain"),
    "dense_ws": dict(forward="ws"),
    "lists_auto": dict(lists="auto"),
    "lists_half": dict(lists="half"),
    "lists_half_tiles": dict(lists="half", list_stages="tiles"),
    "lists_fine": dict(lists="fine"),
    "lists_fine_tiles": dict(lists="fine", list_stages="tiles"),
}
# (pattern, N) -> variants; "default" (the package's defaults: ``even`` on) first, the reference of
# every ratio. cuDNN is timed for dense and causal.
CASES = {
    ("longformer", 16384): ["default", "no_even", "atomic", "atomic_no_even", "atomic_tma"],
    ("bigbird", 16384): ["default", "no_even", "atomic", "atomic_no_even"],
    ("sliding_window_1024", 16384): ["default", "band_flex", "band_flex_no_even", "no_even", "atomic"],
    ("document_causal", 16384): ["default", "band_flex", "band_flex_no_even", "no_even", "atomic"],
    ("dense", 16384): ["default", "dense_plain", "dense_ws", "atomic"],
    ("causal", 16384): ["default", "no_even", "atomic"],
    ("sliding_window_1024", 65536): ["default", "band_flex", "atomic"],
    ("document_causal", 65536): ["default", "band_flex", "atomic"],
}
_LISTS = ["default", "lists_auto", "lists_half", "lists_half_tiles", "lists_fine", "lists_fine_tiles"]
LIST_CASES = {
    ("longformer", 16384): _LISTS,
    ("bigbird", 16384): _LISTS,
    ("sliding_window_1024", 16384): ["default", "lists_half", "lists_fine"],
    ("document_causal", 16384): ["default", "lists_half", "lists_fine"],
    ("longformer", 65536): ["default", "lists_auto", "lists_half", "lists_fine"],
    ("bigbird", 65536): ["default", "lists_auto", "lists_half", "lists_fine"],
    ("sliding_window_1024", 65536): ["default", "lists_half"],
    ("document_causal", 65536): ["default", "lists_half"],
}
SUITES = {"levers": CASES, "lists": LIST_CASES}
D = 128
N_CHECK_HEADS = 2
VALIDATE_MAX_N = 16384


def heads(n: int) -> int:
    return 8 if n >= 65536 else 16


os.environ.setdefault("BSFA_EXPERIMENTAL_WS", "1")  # dense_ws is refused by default (wrong on the H100)


def options(variant: str):
    """The kernel options of ``variant`` (every other option at its default)."""
    from blocksparse_fa import KernelOptions

    return KernelOptions(**{**BASE, **VARIANTS[variant]})


def inputs(n: int, h: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda: torch.randn(1, h, n, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, do = mk(), mk(), mk(), mk()
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def ours_fn(mask, q, k, v, opts):
    import blocksparse_fa as bsfa

    return lambda: bsfa.attention(q, k, v, mask=mask, kernel_options=opts)


def fwd_bwd(fn, do):
    def run():
        fn().backward(do)
    return run


def warm(job):
    """Worker: compile one case (ours with a variant, or Flex) at the timed shape."""
    kind, pattern, n, variant = job
    try:
        import bench

        if kind == "flex":
            r = bench.Runner()
            f = r.fns(pattern, n, D, heads(n))
            f["flex"]().backward(f["do"])
        else:
            mask, _ = bench.make_case(pattern, n)
            q, k, v, do = inputs(n, heads(n))
            fwd_bwd(ours_fn(mask, q, k, v, options(variant)), do)()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - the timing run reports it too
        return f"{job}: {type(e).__name__}: {str(e)[:300]}"


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class Reference:
    """float64 and eager-bf16 results on heads ``0 .. N_CHECK_HEADS - 1`` of one case's inputs."""

    def __init__(self, mask, q, k, v, do):
        import blocksparse_fa as bsfa

        n = q.shape[2]
        dense = mask.to_dense(n, n).to("cuda")
        sl = slice(0, N_CHECK_HEADS)
        qs, ks, vs, dos = (t.detach()[:, sl].contiguous() for t in (q, k, v, do))
        self.ref, self.eager = [], []
        for upcast, dst in ((True, self.ref), (False, self.eager)):
            a = [t.double() if upcast else t for t in (qs, ks, vs)]
            a = [t.clone().requires_grad_() for t in a]
            o = bsfa.reference_attention(*a, dense, upcast=upcast)
            g = torch.autograd.grad(o, a, dos.to(o.dtype))
            dst.extend([o.detach(), *(x.detach() for x in g)])
            del o, g, a
            torch.cuda.empty_cache()

    def check(self, out, grads) -> dict:
        sl = slice(0, N_CHECK_HEADS)
        res = {}
        for name, ours, r, e in zip(("out", "dq", "dk", "dv"), (out, *grads), self.ref, self.eager):
            ours_err, eager_err = rel(ours[:, sl], r), rel(e, r)
            res[name] = dict(ours=ours_err, eager=eager_err, ratio=ours_err / max(eager_err, 1e-12))
        res["ok"] = all(v["ratio"] <= 2.0 or v["ours"] <= 1e-4 for v in res.values() if isinstance(v, dict))
        return res


def list_blocks(mask, n: int, device, opts) -> dict:
    """List blocks and tiles of the launches of kernel options ``opts`` (their plans, cached on the
    layout ``attention`` compiled and keyed on the options): per kernel ``[keys or queries per list
    entry, (tile), stages]``."""
    import blocksparse_fa as bsfa

    lay = bsfa.compile_mask(mask, n, n, 128, device=device)
    lays = [lay] if lay.rewrite is None else [lay.rewrite.band]
    out = {}
    for part in lays:
        for key, plan in list(part.cache.items()):
            if not (isinstance(key, tuple) and key and key[0] in ("fwd", "bwd") and key[8] == opts):
                continue
            c = plan.consts
            if key[0] == "fwd":
                cfg = plan.cfg[0]
                out["fwd"] = [c.get("LIST_BN", c["LAYOUT_BN"]), (cfg.block_m, cfg.block_n), cfg.num_stages]
            else:
                kv, q = plan.cfg
                if c.get("RUN_KV"):
                    out["dkdv"] = [c.get("KV_LIST_BM", c["LAYOUT_BM"]), (kv.block_m, kv.block_n), kv.num_stages]
                if c.get("RUN_Q"):
                    out["dq"] = [c.get("Q_LIST_BN", c["LAYOUT_BN"]), (q.block_m, q.block_n), q.num_stages]
    return out


def bench_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def run_case(pattern, n, variants, runner, results, deadline):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import bench

    h = heads(n)
    mask, _ = bench.make_case(pattern, n)
    q, k, v, do = inputs(n, h)
    ref = Reference(mask, q, k, v, do) if n <= VALIDATE_MAX_N else None
    row = dict(pattern=pattern, N=n, H=h, d=D, variants={})
    for variant in variants:
        if time.time() > deadline:
            row["variants"][variant] = dict(skipped="time budget")
            continue
        rec = {}
        try:
            opts = options(variant)
            fn = ours_fn(mask, q, k, v, opts)
            out = fn()
            grads = torch.autograd.grad(out, (q, k, v), do)
            if ref is not None:
                rec["check"] = ref.check(out.detach(), grads)
            del out, grads
            with torch.no_grad():
                rec["fwd_ms"] = bench_ms(fn)
            rec["fb_ms"] = bench_ms(fwd_bwd(fn, do))
            if variant == "default" or variant.startswith("lists"):
                rec["list_blocks"] = list_blocks(mask, n, q.device, opts)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        q.grad = k.grad = v.grad = None
        row["variants"][variant] = rec
        print(f"{pattern:20s} {n:6d} {variant:15s} {_fmt(rec)}", flush=True)
    if time.time() < deadline:
        try:
            f = runner.fns(pattern, n, D, h)  # the same inputs as bench.py (seed 0), Flex compiled
            fq, fk, fv, fdo = f["q"], f["k"], f["v"], f["do"]
            with torch.no_grad():
                row["flex_fwd_ms"] = bench_ms(f["flex"])
            row["flex_fb_ms"] = bench_ms(fwd_bwd(f["flex"], fdo))
            if pattern in ("dense", "causal"):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    sd = lambda: F.scaled_dot_product_attention(fq, fk, fv, is_causal=pattern == "causal")  # noqa: E731
                    with torch.no_grad():
                        row["cudnn_fwd_ms"] = bench_ms(sd)
                    row["cudnn_fb_ms"] = bench_ms(fwd_bwd(sd, fdo))
        except Exception as e:  # noqa: BLE001
            row["baseline_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    results.append(row)
    del ref


def _fmt(rec: dict) -> str:
    if "error" in rec:
        return "ERROR " + rec["error"]
    chk = rec.get("check")
    c = "" if chk is None else (" check " + ("ok" if chk["ok"] else "FAIL") + " (err/eager " +
                                " ".join(f"{k} {chk[k]['ratio']:.2f}" for k in ("out", "dq", "dk", "dv")) + ")")
    return f"fwd {rec['fwd_ms']:.3f} ms  fwd+bwd {rec['fb_ms']:.3f} ms{c}"


def table(results) -> str:
    lines = ["| pattern | N | variant | check (max err/eager) | fwd ms | fwd+bwd ms | bwd ms | fwd vs default | "
             "fwd+bwd vs default | Flex fwd / fwd+bwd ratio | cuDNN fwd / fwd+bwd ratio | list blocks fwd/dkdv/dq |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        base = row["variants"].get("default", {})
        for name, rec in row["variants"].items():
            if "fwd_ms" not in rec:
                lines.append(f"| {row['pattern']} | {row['N']} | {name} | {rec.get('error') or rec.get('skipped')} "
                             "| | | | | | | | |")
                continue
            chk = rec.get("check")
            c = "" if chk is None else (("ok " if chk["ok"] else "FAIL ") +
                                        f"{max(chk[k]['ratio'] for k in ('out', 'dq', 'dk', 'dv')):.2f}")
            sp = lambda key: f"{base[key] / rec[key]:.3f}x" if key in base else ""  # noqa: E731
            fl = (f"{row['flex_fwd_ms'] / rec['fwd_ms']:.2f} / {row['flex_fb_ms'] / rec['fb_ms']:.2f}"
                  if "flex_fb_ms" in row else "")
            cu = (f"{row['cudnn_fwd_ms'] / rec['fwd_ms']:.2f} / {row['cudnn_fb_ms'] / rec['fb_ms']:.2f}"
                  if "cudnn_fb_ms" in row else "")
            lb = rec.get("list_blocks", {})
            lb = "/".join(str(lb[k][0]) if k in lb else "-" for k in ("fwd", "dkdv", "dq")) if lb else ""
            lines.append(f"| {row['pattern']} | {row['N']} | {name} | {c} | {rec['fwd_ms']:.3f} | {rec['fb_ms']:.3f} | "
                         f"{rec['fb_ms'] - rec['fwd_ms']:.3f} | {sp('fwd_ms')} | {sp('fb_ms')} | {fl} | {cu} | {lb} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="levers", choices=sorted(SUITES),
                    help="levers: Levers 1-4 (CASES); lists: Lever 5, coarse against finer lists (LIST_CASES)")
    ap.add_argument("--cases", nargs="+", default=None, help="pattern:N entries of the suite (default: all)")
    ap.add_argument("--variants", nargs="+", default=None, help="only these variants (default: each case's)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t0 = time.time()
    deadline = t0 + args.budget
    cases = dict(SUITES[args.suite])
    if args.cases:
        want = {(c.split(":")[0], int(c.split(":")[1])) for c in args.cases}
        cases = {key: vs for key, vs in cases.items() if key in want}
    if args.variants:
        cases = {key: [v for v in vs if v in args.variants or v == "default"] for key, vs in cases.items()}
    jobs = [("ours", p, n, v) for (p, n), vs in cases.items() for v in vs]
    if not args.no_flex:
        jobs += [("flex", p, n, None) for (p, n) in cases]
    # compile ahead in workers; a worker that dies (a compiler abort) breaks the pool, which is reported
    ex = ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        futs = [ex.submit(warm, j) for j in jobs]
        for fut in as_completed(futs, timeout=max(30.0, 0.55 * args.budget)):
            msg = fut.result()
            if msg:
                print("warm:", msg, flush=True)
    except Exception as e:  # noqa: BLE001 - timing compiles what is missing
        print(f"warm-up stopped: {type(e).__name__}: {str(e)[:200]}", flush=True)
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
    print(f"warm-up of {len(jobs)} jobs: {time.time() - t0:.0f} s", flush=True)

    import triton

    runner = None
    if not args.no_flex:
        import bench

        runner = bench.Runner()
    results = []
    path = os.path.join(args.out, "kernel_ab.json" if args.suite == "levers" else f"kernel_ab_{args.suite}.json")
    for (p, n), vs in cases.items():
        if time.time() > deadline:
            results.append(dict(pattern=p, N=n, variants={v: dict(skipped="time budget") for v in vs}))
            continue
        run_case(p, n, vs, runner, results, deadline)
        with open(path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           d=D, suite=args.suite, elapsed_s=time.time() - t0, variants=VARIANTS, results=results),
                      f, indent=1)
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16, d={D}, "
          f"B=1, H=16 (8 at 64K); ratios: default time / variant time, Flex (cuDNN) time / variant time; "
          f"check on heads 0-{N_CHECK_HEADS - 1} vs float64 (pass: err <= 2x eager bf16); {time.time() - t0:.0f} s")
    print(table(results))


if __name__ == "__main__":
    main()
