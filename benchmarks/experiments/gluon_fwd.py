"""The Gluon forward (``kernels/forward_gluon.py``) on the H100: checked, then timed beside our
default forward, FlexAttention and cuDNN.

1. Checks, each tile configuration on its own: O and LSE against float64 on small shapes (GQA, head
   dims 64/128, fp16/bf16, a ragged query length, strided inputs) and on heads 0-1 of the timed 16K
   inputs. Outputs start as NaN (every element must be written). Pass: O's relative error at most
   2x that of eager attention in the same dtype, LSE's max error at most max(2x eager, 1e-3).
2. Timings (``triton.testing.do_bench``, median) at N = 16K, d = 128, bf16, B = 1, H = 16, dense
   and causal: every configuration that passed its check, through ``blocksparse_fa.attention``
   (kernel options ``forward="gluon", gluon_fwd=cfg``), beside our block-sparse Triton forward
   (``forward="triton"``, reported as ``ours_default``), cuDNN (SDPA) and FlexAttention
   (compiled). TFLOP/s count 4·B·H·N²·d (causal: half).

A barrier mistake in a Gluon kernel hangs the GPU rather than raising, so the Gluon cases run in a
child process that the parent kills when it makes no progress for ``--stall`` seconds (the case is
reported as hung, the rest run in a new child). Results: ``$OUT/gluon_fwd.json`` (rewritten after
every stage) and a table on stdout.

    PYTHONPATH=. python benchmarks/experiments/gluon_fwd.py [--budget 280] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

N, H, D = 16384, 16, 128
# name -> GluonConfig fields; "default" is GluonConfig() (the one the kernel options default to)
CONFIGS = {
    "default": {},
    "stages3": dict(stages=3),
    "no_overlap": dict(overlap=False),
    "no_pingpong": dict(pingpong=False),
    "no_pp_no_ov": dict(pingpong=False, overlap=False),
    "bm128_bn64": dict(block_m=128, block_n=64, overlap=False),  # dense only (causal needs bn == 2 bm)
    "bm128_bn64_s3": dict(block_m=128, block_n=64, overlap=False, stages=3),
}
# small checks: (pattern, B, H, Hkv, Lq, Lk, d, dtype, strided)
SMALL = [
    ("dense", 2, 4, 2, 512, 512, 128, "bf16", False),
    ("dense", 1, 2, 2, 200, 384, 64, "fp16", False),
    ("dense", 1, 3, 1, 384, 256, 128, "bf16", True),
    ("causal", 1, 3, 3, 640, 640, 128, "bf16", False),
    ("causal", 2, 2, 1, 256, 256, 64, "fp16", True),
]


def child_cases() -> list[str]:
    cases = []
    for i in range(len(SMALL)):
        cases.append(f"small:{i}:default")
    for cfg in CONFIGS:
        for pat in ("dense", "causal"):
            if pat == "causal" and "bn64" in cfg:
                continue
            if cfg != "default":
                cases.append(f"small:{0 if pat == 'dense' else 3}:{cfg}")
            cases.append(f"big:{pat}:{cfg}")
    return cases


def gluon_options(fields: dict):
    """Kernel options that run the Gluon forward (refused where it cannot run) with the tiles
    ``fields`` (:class:`~blocksparse_fa.ops.options.GluonConfig` fields; interval layouts included,
    the ``interval`` option's default)."""
    from blocksparse_fa.ops.options import GluonConfig, KernelOptions

    return KernelOptions(forward="gluon", gluon_fwd=GluonConfig(**fields))


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def tflops(pattern: str, ms: float, b=1, h=H, n=N, d=D) -> float:
    f = 4.0 * b * h * n * n * d * (0.5 if pattern == "causal" else 1.0)
    return f / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------- child: Gluon cases

class _Child:
    def __init__(self):
        import torch

        import blocksparse_fa as bsfa
        from blocksparse_fa.ops import triton_backend as tb

        self.torch, self.bsfa, self.tb = torch, bsfa, tb
        self.calls = 0
        launch = tb._gluon_launch

        def counted(*a, **kw):
            self.calls += 1
            return launch(*a, **kw)

        tb._gluon_launch = counted
        self.big = {}
        self.opts = None  # the kernel options of the current configuration (set_cfg)

    def set_cfg(self, name):
        self.opts = gluon_options(CONFIGS[name])

    def mask(self, pattern):
        return self.bsfa.full() if pattern == "dense" else self.bsfa.causal()

    def run_check(self, pattern, q, k, v, heads=None) -> dict:
        """Our output through the dispatcher (O poisoned with NaN), vs float64 and eager on ``heads``."""
        torch, bsfa, tb = self.torch, self.bsfa, self.tb
        from blocksparse_fa.ops.validate import check_qkv

        s = check_qkv(q, k, v)
        scale = q.shape[-1] ** -0.5
        lay = bsfa.compile_mask(self.mask(pattern), s.Lq, s.Lk, 128, device=q.device)
        before = self.calls
        real_empty = torch.empty

        def poisoned(*a, **kw):  # O and LSE start as NaN: every element must be written
            t = real_empty(*a, **kw)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        torch.empty = poisoned
        try:
            out, lse = tb.triton_forward(q, k, v, lay, s, scale, 0.0, 0, opts=self.opts)
        finally:
            torch.empty = real_empty
        torch.cuda.synchronize()
        rec = dict(gluon_ran=self.calls > before, nan_out=bool(out.isnan().any()), nan_lse=bool(lse.isnan().any()))
        sl = slice(None) if heads is None else slice(0, heads)
        kv_sl = sl if heads is None else slice(0, -(-heads // s.G))
        qs, ks, vs = q[:, sl], k[:, kv_sl], v[:, kv_sl]
        m = self.mask(pattern)
        refs = self.big.get(("ref", pattern)) if heads is not None else None
        if refs is None:
            refs = (*bsfa.reference_attention(qs.double(), ks.double(), vs.double(), m, scale=scale,
                                              return_lse=True, align="top_left"),
                    *bsfa.reference_attention(qs, ks, vs, m, scale=scale, return_lse=True, upcast=False,
                                              align="top_left"))
            if heads is not None:  # the 16K inputs are shared by every configuration
                self.big[("ref", pattern)] = refs
        ref, ref_lse, eag, eag_lse = refs
        o_err, o_eag = rel(out[:, sl], ref), rel(eag, ref)
        l_err = (lse[:, sl].double() - ref_lse).abs().max().item()
        l_eag = (eag_lse.double() - ref_lse).abs().max().item()
        rec.update(o_err=o_err, o_eager=o_eag, o_ratio=o_err / max(o_eag, 1e-12), lse_err=l_err, lse_eager=l_eag)
        rec["ok"] = (rec["gluon_ran"] and not rec["nan_out"] and not rec["nan_lse"] and o_err <= 2 * o_eag
                     and l_err <= max(2 * l_eag, 1e-3))
        return rec

    def case(self, name: str) -> dict:
        torch = self.torch
        kind, a, cfg = name.split(":")
        self.set_cfg(cfg)
        dev = "cuda"
        if kind == "small":
            pattern, b, h, hkv, lq, lk, d, dt, strided = SMALL[int(a)]
            dtype = torch.bfloat16 if dt == "bf16" else torch.float16
            g = torch.Generator(device=dev).manual_seed(int(a))

            def mk(hh, ll):
                if strided:  # (B, L, H, D) memory viewed as (B, H, L, D), as after a projection
                    return torch.randn(b, ll, hh, d, device=dev, dtype=dtype, generator=g).transpose(1, 2)
                return torch.randn(b, hh, ll, d, device=dev, dtype=dtype, generator=g)

            q, k, v = mk(h, lq), mk(hkv, lk), mk(hkv, lk)
            rec = self.run_check(pattern, q, k, v)
            rec.update(shape=dict(pattern=pattern, B=b, H=h, Hkv=hkv, Lq=lq, Lk=lk, d=d, dtype=dt, strided=strided))
            return rec
        pattern = a
        if "qkv" not in self.big:
            g = torch.Generator(device=dev).manual_seed(0)
            self.big["qkv"] = [torch.randn(1, H, N, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3)]
        q, k, v = self.big["qkv"]
        rec = self.run_check(pattern, q, k, v, heads=2)
        if rec["ok"]:
            m = self.mask(pattern)
            fn = lambda: self.bsfa.attention(q, k, v, mask=m, kernel_options=self.opts)  # noqa: E731
            with torch.no_grad():
                before = self.calls
                fn()
                rec["timed_gluon"] = self.calls > before  # the timed call went through the Gluon kernel
                rec["fwd_ms"] = bench_ms(fn)
            rec["tflops"] = tflops(pattern, rec["fwd_ms"])
        return rec


def child_loop(make_child, cases: list[str], progress: str, tag: str, fmt) -> None:
    """Run ``cases`` in this (child) process, one ``make_child().case(name)`` each, appending
    start/done events to the ``progress`` file the parent watches (a silent child is killed);
    a failing case is recorded as a result. Shared by the Gluon scripts."""
    try:
        ch = make_child()
    except Exception:  # noqa: BLE001
        with open(progress, "a") as f:
            f.write(json.dumps(dict(event="fatal", error=traceback.format_exc())) + "\n")
        return
    for name in cases:
        with open(progress, "a") as f:
            f.write(json.dumps(dict(event="start", case=name)) + "\n")
        t0 = time.time()
        try:
            rec = ch.case(name)
        except Exception as e:  # noqa: BLE001 - a failing case is a result
            tb = traceback.format_exc()
            print(tb, flush=True)
            rec = dict(error=f"{type(e).__name__}: {str(e)[:500]}", traceback=tb[-3000:])
        rec["seconds"] = round(time.time() - t0, 1)
        with open(progress, "a") as f:
            f.write(json.dumps(dict(event="done", case=name, result=rec)) + "\n")
        print(f"{tag} {name}: {fmt(rec)}", flush=True)


def child_main(cases: list[str], progress: str) -> None:
    child_loop(_Child, cases, progress, "[gluon]", _fmt)


def _fmt(rec: dict) -> str:
    if "error" in rec:
        return "ERROR " + rec["error"][:200]
    if "hung" in rec:
        return "HUNG (killed)"
    s = (f"{'ok' if rec.get('ok') else 'FAIL'}  O err {rec['o_err']:.2e} (eager {rec['o_eager']:.2e}, "
         f"x{rec['o_ratio']:.2f})  LSE err {rec['lse_err']:.2e} (eager {rec['lse_eager']:.2e})"
         f"  ran={rec['gluon_ran']} nan={rec['nan_out'] or rec['nan_lse']}")
    if "fwd_ms" in rec:
        s += f"  fwd {rec['fwd_ms']:.3f} ms = {rec['tflops']:.0f} TFLOP/s"
    return s


# ---------------------------------------------------------------- parent

def run_children(cases, deadline, stall, results, save, script=None):
    """Run ``cases`` in child processes (``script --child``, default this one); a child that makes
    no progress for ``stall`` s is killed."""
    todo = list(cases)
    hangs = 0
    while todo and time.time() < deadline and hangs < 2:
        progress = os.path.join(results["out_dir"], f"gluon_progress_{int(time.time() * 1000)}.jsonl")
        open(progress, "w").close()
        cmd = [sys.executable, os.path.abspath(script or __file__), "--child", "--progress", progress, "--cases", *todo]
        proc = subprocess.Popen(cmd, env=dict(os.environ))
        seen, current, last = 0, None, time.time()
        while True:
            time.sleep(0.5)
            with open(progress) as f:
                lines = f.read().splitlines()
            for ln in lines[seen:]:
                ev = json.loads(ln)
                last = time.time()
                if ev["event"] == "start":
                    current = ev["case"]
                elif ev["event"] == "done":
                    results["gluon"][ev["case"]] = ev["result"]
                    todo.remove(ev["case"])
                    current = None
                    save()
                elif ev["event"] == "fatal":
                    print(ev["error"], flush=True)
                    results["gluon_fatal"] = ev["error"]
                    todo = []
            seen = len(lines)
            if proc.poll() is not None:
                if current is not None:  # died inside a case (a crash, not an exception)
                    results["gluon"][current] = dict(error=f"child died (exit {proc.returncode})")
                    print(f"[gluon] {current}: child died (exit {proc.returncode})", flush=True)
                    todo.remove(current)
                    save()
                break
            if time.time() - last > stall or time.time() > deadline:
                proc.kill()
                proc.wait()
                if current is not None and time.time() - last > stall:
                    results["gluon"][current] = dict(hung=True, error=f"no progress for {stall:.0f} s: killed")
                    print(f"[gluon] {current}: HUNG, killed", flush=True)
                    todo.remove(current)
                    hangs += 1
                    save()
                break
    for c in todo:
        results["gluon"].setdefault(c, dict(skipped="time budget or repeated hangs"))


def baselines(results, deadline, save):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import blocksparse_fa as bsfa

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    base = results["baselines"]
    triton_fwd = bsfa.KernelOptions(forward="triton")  # "ours_default": our block-sparse Triton forward
    for pattern in ("dense", "causal"):
        rec = base.setdefault(pattern, {})
        m = bsfa.full() if pattern == "dense" else bsfa.causal()
        try:
            fn = lambda: bsfa.attention(q, k, v, mask=m, kernel_options=triton_fwd)  # noqa: E731
            with torch.no_grad():
                fn()
                rec["ours_default_ms"] = bench_ms(fn)
        except Exception:  # noqa: BLE001
            rec["ours_default_error"] = traceback.format_exc()[-2000:]
            print(rec["ours_default_error"], flush=True)
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                sd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=pattern == "causal")  # noqa: E731
                sd()
                rec["cudnn_ms"] = bench_ms(sd)
        except Exception:  # noqa: BLE001
            rec["cudnn_error"] = traceback.format_exc()[-2000:]
            print(rec["cudnn_error"], flush=True)
        save()
    for pattern in ("dense", "causal"):
        rec = base[pattern]
        if time.time() > deadline:
            rec["flex_skipped"] = "time budget"
            continue
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
            bm = None
            if pattern == "causal":
                bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, N, N, device="cuda")
            fl = lambda: flex(q, k, v, block_mask=bm)  # noqa: E731
            with torch.no_grad():
                fl()
                rec["flex_ms"] = bench_ms(fl)
        except Exception:  # noqa: BLE001
            rec["flex_error"] = traceback.format_exc()[-2000:]
            print(rec["flex_error"], flush=True)
        save()


def table(results) -> str:
    lines = ["| pattern | config | check (O err / eager) | fwd ms | TFLOP/s | vs ours default | vs cuDNN | vs Flex |",
             "|---|---|---|---|---|---|---|---|"]
    for pattern in ("dense", "causal"):
        b = results["baselines"].get(pattern, {})
        for name in ("ours_default", "cudnn", "flex"):
            if f"{name}_ms" in b:
                ms = b[f"{name}_ms"]
                lines.append(f"| {pattern} | {name} | | {ms:.3f} | {tflops(pattern, ms):.0f} | | | |")
        for cfg in CONFIGS:
            rec = results["gluon"].get(f"big:{pattern}:{cfg}")
            if rec is None:
                continue
            if "o_err" not in rec:
                lines.append(f"| {pattern} | gluon {cfg} | {rec.get('error') or rec.get('skipped')} | | | | | |")
                continue
            chk = f"{'ok' if rec['ok'] else 'FAIL'} {rec['o_ratio']:.2f}x"
            if "fwd_ms" not in rec:
                lines.append(f"| {pattern} | gluon {cfg} | {chk} | | | | | |")
                continue
            ms = rec["fwd_ms"]
            r = lambda key: f"{b[key] / ms:.3f}x" if key in b else ""  # noqa: E731
            lines.append(f"| {pattern} | gluon {cfg} | {chk} | {ms:.3f} | {rec['tflops']:.0f} | "
                         f"{r('ours_default_ms')} | "
                         f"{r('cudnn_ms')} | {r('flex_ms')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=280.0, help="seconds for the whole run")
    ap.add_argument("--stall", type=float, default=60.0, help="kill a Gluon child silent this long (s)")
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

    results = dict(out_dir=args.out, gluon={}, baselines={}, configs=CONFIGS, N=N, H=H, d=D,
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                   torch=torch.__version__, triton=triton.__version__)
    path = os.path.join(args.out, "gluon_fwd.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    save()
    # the Gluon cases get the budget less ~100 s kept for the baselines (Flex compiles)
    run_children(args.cases or child_cases(), deadline - 100, args.stall, results, save)
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
