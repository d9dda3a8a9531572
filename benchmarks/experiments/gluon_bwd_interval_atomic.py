"""The Gluon backward's variants on one-key-interval-per-row layouts (and one dense layout),
launched directly (``triton_backend._gluon_bwd_launch`` with the layout's interval tables): the
deterministic dK/dV + dQ pair with one program per tile, with the dQ kernel persistent, with both
kernels persistent (the default on intervals, ``GluonBwdConfig``), and the five-GEMM kernel (dQ
TMA-reduce-added in fp32 from the dK/dV programs, no dQ kernel; ``select`` runs it on dense and
causal layouts only) with one program per tile and persistent. FlashAttention-4's SM90 backward
runs windows the five-GEMM way (one kernel per 128 keys, atomic dQ).

1. Checks against float64 (dQ, dK, dV; relative max error as a multiple of eager bf16's) on small
   shapes: a window, documents with a one-token document, GQA, two batch rows, d 64 and 128, every
   variant; gradients start poisoned (NaN).
2. Backward times (``do_bench`` medians, passes taking turns) of every variant (``VARIANTS``) at 16K (H 16) and
   64K (H 8 / Hkv 2): windows of 256, 1024 and 4096 keys and packed documents.

Results: ``$OUT/gluon_bwd_interval_atomic.json`` and a table on stdout.

    PYTHONPATH=. python benchmarks/experiments/gluon_bwd_interval_atomic.py [--passes 3] [--out DIR]
        [--variants pair_p pair_p_gload ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import blocksparse_fa as bsfa  # noqa: E402
from blocksparse_fa.ops import select, triton_backend as tb  # noqa: E402
from blocksparse_fa.ops.options import GluonBwdConfig  # noqa: E402
from blocksparse_fa.ops.validate import Shapes  # noqa: E402


# label -> (atomic, config): the deterministic pair (one program per tile; the dQ kernel persistent;
# both kernels persistent) and the five-GEMM kernel (one program per tile; persistent)
VARIANTS = {"pair": (False, GluonBwdConfig(persistent=False, dkdv_persistent=False)),
            "pair_pdq": (False, GluonBwdConfig(persistent=True, dkdv_persistent=False)),
            "pair_p": (False, GluonBwdConfig(persistent=True, dkdv_persistent=True)),
            "five_gemm": (True, GluonBwdConfig(dkdv_persistent=False)),
            "five_gemm_p": (True, GluonBwdConfig(dkdv_persistent=True)),
            # the dK/dV kernel's logsumexp and Δ loaded from global memory before the slot's wait
            # (GluonBwdConfig.rows_smem=False; the default stages them with Q and dO)
            "pair_p_gload": (False, GluonBwdConfig(persistent=True, dkdv_persistent=True, rows_smem=False)),
            "five_gemm_gload": (True, GluonBwdConfig(dkdv_persistent=False, rows_smem=False)),
            # the pair's cross-step overlap (a step's last product issued with the next step's first):
            # dK/dV (dSᵀ through shared memory, 3 stages) and dQ, each alone; run each in its own
            # process under a timeout (`--variants pair_p pair_p_ov2`): one earlier try of both hung
            "pair_p_ov2": (False, GluonBwdConfig(persistent=True, dkdv_persistent=True, overlap=2, stages=3)),
            "pair_p_dqov2": (False, GluonBwdConfig(persistent=True, dkdv_persistent=True, dq_overlap=2))}


def gluon_interval_backward(q, k, v, out, lse, do, layout, s: Shapes, scale: float, atomic: bool,
                            cfg: GluonBwdConfig | None = None):
    """``(dq, dk, dv)`` from the Gluon interval backward: the deterministic pair or, with
    ``atomic``, the five-GEMM dK/dV kernel (what ``triton_backward`` runs for its
    ``gluon:interval`` choice, with the atomic flag free)."""
    cfg = cfg or GluonBwdConfig()
    intervals = None  # a dense layout: the kernels' dense mode
    if select.layout_class(layout).kind != "dense":
        lo, hi, kv_tab, q_tab, lzb, lzh, empty, kv_ord = tb._gluon_bwd_interval_tables(layout, cfg, q.device)
        if empty is not None:
            lse = lse.masked_fill(empty, float("-inf"))
        intervals = (lo, hi, kv_tab, q_tab, lzb, lzh, kv_ord)
    delta = tb.backward_delta(out, do, lse, s)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    tb._gluon_bwd_launch(q, k, v, do, grads, lse.contiguous(), delta, s, scale, False, atomic, cfg, layout,
                         intervals=intervals)
    return grads


def rel(a, b) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def check(name, mask, B, H, Hkv, L, D) -> dict:
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, do = (torch.randn(B, h, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h in (H, Hkv, Hkv, H))
    layout = bsfa.compile_mask(mask, L, L, 128, device="cuda")
    s = Shapes(B, H, Hkv, L, L, D)
    scale = D ** -0.5
    out, lse = tb.triton_forward(q, k, v, layout, s, scale, 0.0, 0)
    up = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out = bsfa.reference_attention(*up, mask)
    ref = torch.autograd.grad(ref_out, up, do.double())
    ub = [t.clone().requires_grad_() for t in (q, k, v)]  # eager bf16 attention: the error scale
    eager = torch.autograd.grad(bsfa.reference_attention(*ub, mask, upcast=False), ub, do)
    rec = {"shape": [B, H, Hkv, L, D]}
    for label, (atomic, cfg) in VARIANTS.items():
        got = gluon_interval_backward(q, k, v, out, lse, do, layout, s, scale, atomic, cfg)
        torch.cuda.synchronize()
        rec[label] = {n: {"nan": bool(a.isnan().any()), "err_vs_eager": rel(a, r) / max(rel(e, r), 1e-12)}
                      for n, a, e, r in zip(("dq", "dk", "dv"), got, eager, ref)}
    rec["pass"] = all(not x["nan"] and x["err_vs_eager"] <= 2.0 for lab in VARIANTS
                      for x in rec[lab].values())
    print(f"check {name}: {'PASS' if rec['pass'] else 'FAIL'} "
          + " ".join(f"{lab}:{n}={x['err_vs_eager']:.2f}" for lab in VARIANTS
                     for n, x in rec[lab].items()), flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", nargs="*", choices=list(VARIANTS), help="only these (default: all)")
    a = ap.parse_args()
    if a.variants:
        for lab in [lab for lab in VARIANTS if lab not in a.variants]:
            del VARIANTS[lab]
    from triton.testing import do_bench

    from bench import doc_ids

    res = {"device": torch.cuda.get_device_name(), "checks": {}, "times": {}}
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([128, 1, 383, 256, 256]))
    for name, mask, shape in (
            ("window300_d128", bsfa.sliding_window(300), (2, 4, 2, 1024, 128)),
            ("window300_d64", bsfa.sliding_window(300), (1, 4, 4, 1024, 64)),
            ("documents_d128", bsfa.causal() & bsfa.document(ids), (1, 4, 1, 1024, 128)),
            ("causal_window_d128", bsfa.causal() & bsfa.sliding_window(200), (1, 2, 2, 2048, 128)),
            ("dense_gqa_d128", bsfa.full(), (2, 4, 2, 1024, 128))):
        res["checks"][name] = check(name, mask, *shape)
    cases = [(f"window_{w}", bsfa.sliding_window(w), 16384, 16, 16) for w in (256, 1024, 4096)]
    cases += [("documents", bsfa.causal() & bsfa.document(doc_ids(16384)), 16384, 16, 16),
              ("window_1024_64k", bsfa.sliding_window(1024), 65536, 8, 2),
              ("documents_64k", bsfa.causal() & bsfa.document(doc_ids(65536)), 65536, 8, 2),
              ("dense", bsfa.full(), 16384, 16, 16)]
    setups = {}
    for name, mask, n, h, hkv in cases:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(1, x, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                       for x in (h, hkv, hkv, h))
        layout = bsfa.compile_mask(mask, n, n, 128, device="cuda")
        s = Shapes(1, h, hkv, n, n, 128)
        out, lse = tb.triton_forward(q, k, v, layout, s, 128 ** -0.5, 0.0, 0)
        setups[name] = {lab: (lambda at=at, c=c, q=q, k=k, v=v, out=out, lse=lse, do=do, layout=layout, s=s:
                              gluon_interval_backward(q, k, v, out, lse, do, layout, s, 128 ** -0.5, at, c))
                        for lab, (at, c) in VARIANTS.items()}
    for _ in range(a.passes):
        for name, fns in setups.items():
            for lab, fn in fns.items():
                res["times"].setdefault(name, {}).setdefault(lab, []).append(do_bench(fn, warmup=25, rep=100))
    print(f"{'case':18s} " + " ".join(f"{lab:>12s}" for lab in VARIANTS) + "   (backward ms, median of passes)")
    for name, t in res["times"].items():
        med = {lab: sorted(x)[len(x) // 2] for lab, x in t.items()}
        t["median"] = med
        print(f"{name:18s} " + " ".join(f"{med[lab]:12.3f}" for lab in VARIANTS))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gluon_bwd_interval_atomic.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
