"""Kernel options side by side through ``bsfa.attention`` (the entry point users call), beside the
peers, on ``bench.py``'s masks and inputs, in one run.

Every variant is a ``kernel_options`` dict given as ``name=JSON`` (``base={}`` is the library's
defaults; the configs of :class:`~blocksparse_fa.GluonConfig` / :class:`~blocksparse_fa.GluonBwdConfig`
as dicts of their fields, e.g. ``fwd_s3='{"gluon_fwd": {"stages": 3}}'``). Per case (mask, head
dim; 16K tokens, H 16, MHA, bf16 unless told):

1. every variant and every peer of ``--peers`` is checked once against float64 on the first and
   last KV head groups (``harness.reference``; O, dQ, dK, dV, as a multiple of eager bf16's
   error, as ``bench.py`` does; ``ok`` at most ``harness.TOLERANCE``);
2. forward and forward+backward are timed (``do_bench`` medians) in ``--passes`` passes, every
   implementation taking its turn in each pass (the GPU's clock drifts within a run); the median
   over passes is reported, with each variant's ratio to ``base``.

    PYTHONPATH=. python benchmarks/experiments/options_ab.py --masks dense causal --dims 64 \\
        --variants base='{}' fwd_s3='{"gluon_fwd": {"stages": 3}}' [--peers fa4 cudnn] [--passes 3]
    PYTHONPATH=. python benchmarks/experiments/options_ab.py --primitives "key_range" "shared prefix" \
        --heads 8 --variants base='{}' whole='{"run_split": false}' --peers flex_triton flex_flash

``--primitives SUBSTR ...`` takes the cases of ``new_primitives_gpu.py`` (``flex_equivalents.py``) whose
name contains one of the strings, instead of ``bench.py``'s ``--masks``.

Results: ``$OUT/options_ab.json`` and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import blocksparse_fa as bsfa  # noqa: E402
import harness  # noqa: E402
from bench import build_case  # noqa: E402


def parse_variants(items: list[str]) -> dict[str, dict]:
    """``name=JSON`` strings as ``{name: kernel_options}``; names must be unique."""
    out = {}
    for it in items:
        name, sep, text = it.partition("=")
        if not sep or not name:
            raise ValueError(f"--variants: expected name=JSON, got {it!r}")
        if name in out:
            raise ValueError(f"--variants: {name!r} given twice")
        opts = json.loads(text or "{}")
        if not isinstance(opts, dict):
            raise ValueError(f"--variants: {name!r} must be a JSON object, got {text!r}")
        out[name] = opts
    return out


def run_case(case: harness.Case, variants: dict, peers: list[str], opts: harness.Options, passes: int,
             kernels: bool = False) -> dict:
    q, k, v, do = harness.inputs(case, opts)
    lay = bsfa.compile_mask(case.mask, case.N, case.N, opts.block_size)
    flops = 4.0 * case.B * case.H * case.N * case.N * case.D * float(lay.element_density(device=opts.device))
    groups = harness.checked_groups(case.Hkv, opts.check_heads)
    ref = harness.reference(case, q, k, v, do, groups, upcast=True, chunk_bytes=opts.chunk_bytes)
    eager = harness.reference(case, q, k, v, do, groups, upcast=False, chunk_bytes=opts.chunk_bytes)
    G = case.H // case.Hkv
    runs = {name: harness.Runnable(lambda ko=ko: bsfa.attention(q, k, v, mask=case.mask, kernel_options=ko or None),
                                   (q, k, v), do) for name, ko in variants.items()}
    b = harness.Builder(case, q, k, v, do, opts)
    res = {"mask": case.name, **case.shape(), "impls": {}}
    for p in peers:
        r = b.build(p)
        if isinstance(r, str):
            res["impls"][p] = {"na": r}
        else:
            runs[p] = r
    no_time = harness.Options(**{**opts.__dict__, "timing": False})
    for name, r in runs.items():  # checks (and first calls: compilation) before any timing
        res["impls"][name] = harness.run_impl(r, flops, no_time, ref, eager, groups, G)
    timed = {n: r for n, r in runs.items() if res["impls"][n].get("ok")}
    got = {n: {"fwd": [], "fb": []} for n in timed}
    for _ in range(passes):
        for n, r in timed.items():
            def fwd(r=r):
                with torch.no_grad():
                    r.fn()
            got[n]["fwd"].append(harness.time_ms(fwd, opts))
            got[n]["fb"].append(harness.time_ms(lambda r=r: harness._grads(r), opts))
    for n, t in got.items():
        rec = res["impls"][n]
        rec["fwd_ms"] = sorted(t["fwd"])[passes // 2]
        rec["fb_ms"] = sorted(t["fb"])[passes // 2]
        rec["fwd_passes"], rec["fb_passes"] = t["fwd"], t["fb"]
        rec["fwd_tflops"] = flops / rec["fwd_ms"] / 1e9
        rec["fb_tflops"] = 3.5 * flops / rec["fb_ms"] / 1e9
    if kernels:  # GPU time per kernel of one forward+backward, every implementation (torch.profiler)
        from host_new_primitives import gpu_kernels

        for n, r in timed.items():
            res["impls"][n]["fb_kernels_ms"] = gpu_kernels(lambda r=r: harness._grads(r))
    return res


def table(cases: list[dict], base: str) -> str:
    lines = ["| mask | d | impl | fwd ms | fwd+bwd ms | fwd TFLOP/s | f+b TFLOP/s | vs base (fwd, f+b) | max err ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        b = c["impls"].get(base, {})
        for n, r in c["impls"].items():
            if "fwd_ms" not in r:
                why = r.get("na") or r.get("fwd_error") or r.get("fb_error") or f"check failed ({r.get('max_ratio')})"
                lines.append(f"| {c['mask']} | {c['D']} | {n} | {str(why)[:80]} | | | | | |")
                continue
            vs = (f"{b['fwd_ms'] / r['fwd_ms']:.3f}x, {b['fb_ms'] / r['fb_ms']:.3f}x" if "fwd_ms" in b else "")
            lines.append(f"| {c['mask']} | {c['D']} | {n} | {r['fwd_ms']:.3f} | {r['fb_ms']:.3f} | "
                         f"{r['fwd_tflops']:.0f} | {r['fb_tflops']:.0f} | {vs} | {r.get('max_ratio', float('nan')):.2f} |")
    return "\n".join(lines)


def kernel_table(case: dict) -> str:
    """One case's GPU time per kernel of a forward+backward (``--kernels``), each implementation."""
    lines = []
    for n, r in case["impls"].items():
        ks = r.get("fb_kernels_ms")
        if ks:
            top = sorted(ks.items(), key=lambda kv: -kv[1])
            lines.append(f"{case['mask']} d{case['D']} {n}: GPU {sum(ks.values()):.3f} ms = "
                         + ", ".join(f"{k[:40]} {v:.3f}" for k, v in top[:8]))
    return "\n".join(lines)


def _cases(a, d: int):
    """The run's cases at head dim ``d``: ``bench.py``'s ``--masks`` or ``flex_equivalents``' ``--primitives``."""
    if a.primitives is None:
        for m in a.masks:
            yield build_case(m, a.n, d, a.heads, a.kv_heads or a.heads, "cuda")
        return
    from flex_equivalents import cases

    for name, mask, mod, (B, _) in cases(a.n, H=a.heads, device="cuda"):
        if any(p in name for p in a.primitives):
            yield harness.Case(name, mask, mod, B, a.heads, a.kv_heads or a.heads, a.n, d)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--masks", nargs="+", default=["dense", "causal"])
    ap.add_argument("--primitives", nargs="+", default=None, metavar="SUBSTR",
                    help="new_primitives_gpu.py's cases whose name contains one (instead of --masks)")
    ap.add_argument("--dims", type=int, nargs="+", default=[128])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    ap.add_argument("--variants", nargs="+", default=["base={}"], help="name=JSON kernel options; the first is the base")
    ap.add_argument("--peers", nargs="*", default=["fa4", "cudnn"], choices=[i for i in harness.IMPLS if "ours" not in i])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--kernels", action="store_true",
                    help="also record each implementation's GPU time per kernel of a forward+backward")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    variants = parse_variants(a.variants)
    base = next(iter(variants))
    opts = harness.Options(device="cuda")
    import peers

    peers.strict_compile()  # many masks: every one compiles Flex's graphs (no silent eager fallback)
    out = {"variants": variants, "peers": a.peers, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cases": []}
    os.makedirs(a.out, exist_ok=True)
    for d in a.dims:
        for case in _cases(a, d):
            out["cases"].append(run_case(case, variants, a.peers, opts, a.passes, a.kernels))
            with open(os.path.join(a.out, "options_ab.json"), "w") as f:
                json.dump(out, f, indent=1, default=str)
            print(table(out["cases"][-1:], base), flush=True)
            if a.kernels:
                print(kernel_table(out["cases"][-1]), flush=True)
    print(table(out["cases"], base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
