"""The persistent Gluon forward (``GluonConfig.persistent``) against one program per query tile,
on the H100: the same kernels' outputs compared bit for bit, then both timed in passes that take
turns (``triton.testing.do_bench`` medians), with FA4 beside them where it is installed.

Cases (bf16, d 128, B 1): at 16K with H 16 (MHA), dense, causal, sliding windows of 256 to 4096
keys and ``bench.py``'s packed causal documents (ids on the CPU: the device-interval path); at 64K
with H 8 / Hkv 2, causal, the 1024 window and the documents; at 64K with H 32, the 256 and 2048
windows (all heads' windows in L2 at once). Interval cases also time the persistent kernels with
their items dealt head by head and tile-major whatever the default rule picks (bit-compared too;
"persist" is the default rule, ``select.tile_major_deal``). A window's forward time against its
width separates the per-tile cost (the intercept) from the per-key-block cost (the slope).

Results: ``$OUT/gluon_fwd_persistent.json`` and a table on stdout.

    PYTHONPATH=. python benchmarks/experiments/gluon_fwd_persistent.py [--passes 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import blocksparse_fa as bsfa  # noqa: E402
from blocksparse_fa.ops.options import GluonBwdConfig, GluonConfig  # noqa: E402

WINDOWS = (256, 512, 1024, 2048, 4096)


def cases():
    from bench import doc_ids

    out = [("dense", 16384, 16, 16, None), ("causal", 16384, 16, 16, "causal")]
    out += [(f"window_{w}", 16384, 16, 16, ("window", w)) for w in WINDOWS]
    out += [("documents", 16384, 16, 16, ("documents", doc_ids(16384)))]
    out += [("causal_64k", 65536, 8, 2, "causal"), ("window_1024_64k", 65536, 8, 2, ("window", 1024)),
            ("documents_64k", 65536, 8, 2, ("documents", doc_ids(65536)))]
    # 32 heads: every head's window shares the L2 in the tile-major order (docs/traffic.md)
    out += [(f"window_{w}_64k_h32", 65536, 32, 32, ("window", w)) for w in (256, 2048)]
    return out


def sweep_cases():
    """Windows at 16K and 64K tokens with 8, 16 and 32 heads (MHA): where all heads' windows stop
    fitting in L2 together, the tile-major deal re-reads K/V from DRAM (docs/traffic.md)."""
    return [(f"w{w}_h{h}_{n // 1024}k", n, h, h, ("window", w))
            for n in (16384, 65536) for h in (8, 16, 32) for w in (1024, 2048, 4096, 8192)]


def mask_of(spec):
    if spec is None:
        return None, None
    if spec == "causal":
        return bsfa.causal(), {"causal": True}
    kind, arg = spec
    if kind == "window":
        return bsfa.sliding_window(arg), {"causal": True, "window": arg}
    return bsfa.causal() & bsfa.document(arg), {"varlen": arg}


def kept_pairs(spec, n: int) -> float:
    if spec is None:
        return float(n) * n
    if spec == "causal":
        return n * (n + 1) / 2
    kind, arg = spec
    if kind == "window":
        return float(sum(min(i + 1, arg) for i in range(n)))
    _, counts = torch.unique_consecutive(arg, return_counts=True)
    return float(sum(c * (c + 1) / 2 for c in counts.tolist()))


def fa4_runner(form, q, k, v, grad: bool = False):
    """FA4 on the same inputs (copied to its ``(B, L, H, D)`` layout; leaves that take gradients
    with ``grad``), or None where it is not installed."""
    try:
        from flash_attn.cute import interface as fa
    except Exception:
        return None
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_(grad) for t in (q, k, v))
    if form is None or "varlen" not in form:
        causal = bool(form and form.get("causal"))
        window = (form.get("window") - 1, 0) if form and form.get("window") else (None, None)
        return lambda: fa.flash_attn_func(qt, kt, vt, causal=causal, window_size=window)
    ids = form["varlen"]
    _, counts = torch.unique_consecutive(ids, return_counts=True)
    cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32).cuda()
    longest = int(counts.max())
    q1, k1, v1 = (t[0] for t in (qt, kt, vt))
    return lambda: fa.flash_attn_varlen_func(q1, k1, v1, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                             max_seqlen_k=longest, causal=True)


def _fa4_fwd_bwd(fwd, do):
    """FA4 forward then backward (``do`` in FA4's layout)."""
    out = fwd()
    out = out[0] if isinstance(out, tuple) else out
    out.backward(do.view(out.shape))


def _dealt(f, tile_major: bool):
    """``f`` with the persistent interval kernels' items dealt tile-major (True) or head by head
    (False) whatever ``select.tile_major_deal`` would pick."""
    from blocksparse_fa.ops import triton_backend as tb

    def run():
        before, tb._M_MAJOR = tb._M_MAJOR, tile_major
        try:
            return f()
        finally:
            tb._M_MAJOR = before
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", nargs="*", default=None, help="case names")
    ap.add_argument("--sweep", action="store_true",
                    help="the window x heads sweep (sweep_cases) instead of the cases above; forward only")
    ap.add_argument("--bwd-order", action="store_true",
                    help="interval cases: the backward alone (one forward kept) with its persistent kernels' items "
                         "dealt tile-major and head by head")
    ap.add_argument("--bwd", action="store_true",
                    help="also forward+backward: both persistent kernels (forward, dQ) against neither")
    a = ap.parse_args()
    from triton.testing import do_bench

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    import triton

    res["triton"] = triton.__version__
    setups = {}
    for name, n, h, hkv, spec in (sweep_cases() if a.sweep else cases()):
        if a.only and name not in a.only:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, h, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, hkv, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, hkv, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        mask, form = mask_of(spec)
        lay = bsfa.compile_mask(mask, n, n, device="cuda") if spec is not None and spec[0] != "documents" else mask
        fns = {}
        for label, persistent in (("per_tile", False), ("persistent", True)):
            opts = dict(gluon_fwd=GluonConfig(persistent=persistent))
            fns[label] = (lambda lay=lay, opts=opts, q=q, k=k, v=v:
                          bsfa.attention(q, k, v, mask=lay, kernel_options=opts))
        with torch.no_grad():
            o1, o2 = fns["per_tile"](), fns["persistent"]()
        torch.cuda.synchronize()
        rec = {"n": n, "h": h, "hkv": hkv, "kept_pairs": kept_pairs(spec, n),
               "kernels": bsfa.explain(q, k, v, mask=lay).kernels,
               "bit_equal": bool(torch.equal(o1, o2)), "nan": bool(o2.isnan().any()), "ms": {}}
        if spec is not None and spec != "causal":  # interval items head by head instead of tile-major
            head_major = _dealt(fns["persistent"], False)
            fns["persistent_head"] = head_major
            fns["persistent_tile"] = _dealt(fns["persistent"], True)
            with torch.no_grad():
                rec["head_bit_equal"] = bool(torch.equal(head_major(), o1))
        head_variants = spec is not None and spec != "causal"
        fa4 = fa4_runner(form, q, k, v)
        if fa4 is not None:
            fns["fa4"] = fa4
        if a.bwd:
            do = torch.randn_like(q)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            for label, persistent in (("bwd_per_tile", False), ("bwd_persistent", True)):
                opts = dict(gluon_fwd=GluonConfig(persistent=persistent),
                            gluon_bwd=GluonBwdConfig(persistent=persistent))
                fns[label] = (lambda lay=lay, opts=opts, qg=qg, kg=kg, vg=vg, do=do:
                              torch.autograd.grad(bsfa.attention(qg, kg, vg, mask=lay, kernel_options=opts),
                                                  (qg, kg, vg), do))
            if head_variants:
                fns["bwd_persistent_head"] = _dealt(fns["bwd_persistent"], False)
            ga = fns["bwd_per_tile"]()
            gb = fns["bwd_persistent"]()
            rec["bwd_bit_equal"] = all(bool(torch.equal(x, y)) for x, y in zip(ga, gb))
            print(f"  {name}: gradients bit_equal={rec['bwd_bit_equal']}", flush=True)
            if fa4 is not None:
                fa_fwd = fa4_runner(form, q, k, v, grad=True)
                do_t = do.transpose(1, 2).contiguous()
                fns["bwd_fa4"] = lambda f=fa_fwd, d=do_t: _fa4_fwd_bwd(f, d)
        if a.bwd_order and head_variants:
            do = torch.randn_like(q)
            qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
            out = bsfa.attention(qb, kb, vb, mask=lay)

            def grad_only(out=out, qb=qb, kb=kb, vb=vb, do=do):
                return torch.autograd.grad(out, (qb, kb, vb), do, retain_graph=True)
            fns["bwd_only_tile"] = _dealt(grad_only, True)
            fns["bwd_only_head"] = _dealt(grad_only, False)
            ga, gb = fns["bwd_only_tile"](), fns["bwd_only_head"]()
            rec["bwd_order_bit_equal"] = all(bool(torch.equal(x, y)) for x, y in zip(ga, gb))
            del ga, gb
        res["cases"][name] = rec
        setups[name] = fns
        print(f"{name}: bit_equal={rec['bit_equal']} head_bit_equal={rec.get('head_bit_equal')} "
              f"bwd_order_bit_equal={rec.get('bwd_order_bit_equal')} nan={rec['nan']} "
              f"kernels={rec['kernels']}", flush=True)
    for p in range(a.passes):
        for name, fns in setups.items():
            for label, fn in fns.items():
                with torch.set_grad_enabled(label.startswith("bwd")):
                    ms = do_bench(fn, warmup=25, rep=100)
                res["cases"][name]["ms"].setdefault(label, []).append(ms)
        print(f"pass {p} done {time.strftime('%X')}", flush=True)
    lines = [f"{res['device']}, torch {res['torch']}, triton {res['triton']}; forward ms (median of passes), "
             f"TFLOP/s on kept pairs",
             f"{'case':18s} {'per-tile':>9s} {'persist':>9s} {'speed-up':>8s} {'FA4':>8s} {'TF/s pers':>9s} "
             f"{'TF/s FA4':>9s}"]
    for name, rec in res["cases"].items():
        med = {k: sorted(v)[len(v) // 2] for k, v in rec["ms"].items()}
        rec["median_ms"] = med
        flops = 4 * rec["h"] * 128 * rec["kept_pairs"]
        tf = lambda ms: flops / ms / 1e9  # noqa: E731
        fa = med.get("fa4")
        if "bwd_persistent" in med:
            fb = med.get("bwd_fa4")
            lines.append(f"{'  fwd+bwd':18s} {med['bwd_per_tile']:9.3f} {med['bwd_persistent']:9.3f} "
                         f"{med['bwd_per_tile'] / med['bwd_persistent']:8.3f} {fb if fb else float('nan'):8.3f}")
            if "bwd_persistent_head" in med:
                lines.append(f"{'  fwd+bwd head':18s} {'':9s} {med['bwd_persistent_head']:9.3f} "
                             f"{med['bwd_per_tile'] / med['bwd_persistent_head']:8.3f}")
        for key, label in (("persistent_head", "  head-major"), ("persistent_tile", "  tile-major"),
                           ("bwd_only_head", "  bwd head-major"), ("bwd_only_tile", "  bwd tile-major")):
            if key in med:
                lines.append(f"{label:18s} {'':9s} {med[key]:9.3f}")
        lines.append(f"{name:18s} {med['per_tile']:9.3f} {med['persistent']:9.3f} "
                     f"{med['per_tile'] / med['persistent']:8.3f} {fa if fa else float('nan'):8.3f} "
                     f"{tf(med['persistent']):9.0f} {tf(fa) if fa else float('nan'):9.0f}")
    print("\n".join(lines))
    res["table"] = lines
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gluon_fwd_persistent.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
