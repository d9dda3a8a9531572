"""Plots of the FlashAttention IO simulator (blocksparse_fa.analysis.iosim) against the paper's results.

    PYTHONPATH=. python benchmarks/experiments/iosim_plots.py [--out DIR] [--update-docs]

Writes ``iosim_vs_M.png`` (HBM accesses vs SRAM size M: Theorem 2's Θ(N²d²/M) between the
boundary cases M = d² and M = Nd) and ``iosim_vs_s.png`` (block-sparse accesses vs block density s:
Proposition 4's linear law) into ``--out`` (default ``$OUT`` or ``<tmp>/bsfa_bench/iosim``; ``docs/``
with ``--update-docs``), and prints the fitted lines (slope, intercept, R²). CPU only, seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from blocksparse_fa.analysis.iosim import (  # noqa: E402
    block_sparse_flash_attention, flash_attention, flash_attention2, linear_fit, standard_attention,
    theorem2_leading_term,
)

N_M = 8192            # sequence length for the M sweep
DS = (64, 128)        # head dims for the M sweep
N_S, D_S, M_S = 16384, 64, 1 << 16   # block-sparse sweep: SRAM of 64K elements (Bc = 256, Br = 64)
S_VALUES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def sweep_m(N: int, d: int):
    Ms = [1 << k for k in range(int(np.log2(d * d)), int(np.log2(4 * N * d)) + 1)]
    fa1 = [flash_attention(N, d, M).total for M in Ms]
    fa2 = [flash_attention2(N, d, M).total for M in Ms]
    return np.array(Ms), np.array(fa1, dtype=float), np.array(fa2, dtype=float)


def sweep_s(seed: int = 0):
    fa1 = [block_sparse_flash_attention(N_S, D_S, M_S, density=s, seed=seed, order="fa1").total for s in S_VALUES]
    fa2 = [block_sparse_flash_attention(N_S, D_S, M_S, density=s, seed=seed, order="fa2").total for s in S_VALUES]
    return np.array(S_VALUES), np.array(fa1, dtype=float), np.array(fa2, dtype=float)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output directory for the PNGs (default $OUT or <tmp>/bsfa_bench/iosim)")
    ap.add_argument("--update-docs", action="store_true", help="write the PNGs into docs/")
    args = ap.parse_args(argv)
    if args.update_docs:
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs")
    elif args.out is None:
        args.out = os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "bsfa_bench", "iosim")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    print("== HBM accesses vs SRAM size M (Theorem 2) ==")
    fig, axes = plt.subplots(1, len(DS), figsize=(6.2 * len(DS), 4.8))
    for ax, d in zip(axes, DS):
        N = N_M
        Ms, fa1, fa2 = sweep_m(N, d)
        std = standard_attention(N, d).total
        x = N * N * d * d / Ms
        mid = (Ms >= d * d) & (Ms <= N * d)
        for name, y in (("FlashAttention (Alg. 1)", fa1), ("FA2 order (Q outer)", fa2)):
            slope, icpt, r2 = linear_fit(x[mid], y[mid])
            lslope = np.polyfit(np.log(Ms[mid]), np.log(y[mid] - icpt), 1)[0]
            print(f"  N={N} d={d} {name:<24} count = {slope:.3f}·N²d²/M + {icpt:.4g}  (R²={r2:.6f}); "
                  f"intercept/Nd = {icpt / (N * d):.2f}; log-log slope of (count-intercept) vs M = {lslope:.3f}")
        lead = np.array([theorem2_leading_term(N, d, M) for M in Ms])
        ax.loglog(Ms, fa1, "o-", label="FlashAttention Alg. 1 (simulated)")
        ax.loglog(Ms, fa2, "s-", label="FA2 loop order (simulated)")
        ax.loglog(Ms, lead, "k--", lw=1, label="12N²d²/M (Theorem 2 leading term)")
        ax.axhline(std, color="r", lw=1.2, label="standard attention 4Nd+4N²")
        ax.axhline(5 * N * d, color="g", lw=1, ls=":", label="5Nd (Q, K, V, O each once)")
        for m, lab in ((d * d, "M=d²"), (N * d, "M=Nd")):
            ax.axvline(m, color="gray", lw=0.8, ls=":")
            ax.text(m, ax.get_ylim()[0] * 1.5 if ax.get_ylim()[0] > 0 else std, f" {lab}", rotation=90,
                    fontsize=8, color="gray", va="bottom")
        ax.set_xlabel("SRAM size M (elements)")
        ax.set_ylabel("HBM accesses (elements, one head)")
        ax.set_title(f"N={N}, d={d}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fa1_db = flash_attention(N, d, d * d).total
        fa1_nd = flash_attention(N, d, N * d).total
        print(f"  N={N} d={d} boundary M=d²: FA1 = {fa1_db / N**2:.2f}·N² (standard attention "
              f"{std / N**2:.2f}·N²); M=Nd: FA1 = {fa1_nd / (N * d):.2f}·Nd, FA2 = "
              f"{flash_attention2(N, d, N * d).total / (N * d):.2f}·Nd")
    fig.suptitle("IO simulator: HBM accesses vs SRAM size (FlashAttention, Theorem 2)")
    fig.tight_layout()
    p1 = os.path.join(args.out, "iosim_vs_M.png")
    fig.savefig(p1, dpi=120)
    plt.close(fig)

    print(f"== Block-sparse HBM accesses vs block density s (Proposition 4), N={N_S} d={D_S} M={M_S} ==")
    s, fa1, fa2 = sweep_s()
    dense1 = flash_attention(N_S, D_S, M_S).total
    dense2 = flash_attention2(N_S, D_S, M_S).total
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for name, y, dense, mk in (("block-sparse FA (Alg. 5, K/V outer)", fa1, dense1, "o"),
                               ("block-sparse FA2 order (Q outer)", fa2, dense2, "s")):
        slope, icpt, r2 = linear_fit(s, y)
        print(f"  {name:<36} count = {slope:.4g}·s + {icpt:.4g}  (R²={r2:.6f}); slope/(N²d²/M) = "
              f"{slope / (N_S**2 * D_S**2 / M_S):.3f}; intercept/Nd = {icpt / (N_S * D_S):.2f}; "
              f"s=1 vs dense: {y[-1] / dense:.4f}")
        line = ax.plot(s, y / 1e6, mk, label=f"{name}")[0]
        xs = np.linspace(0, 1, 50)
        ax.plot(xs, (slope * xs + icpt) / 1e6, "-", color=line.get_color(), lw=1,
                label=f"fit {slope / 1e6:.1f}M·s + {icpt / 1e6:.2f}M, R²={r2:.5f}")
    tc = -(-N_S // -(-M_S // (4 * D_S)))
    xs = np.linspace(0, 1, 50)
    ax.plot(xs, (2 * N_S * D_S + xs * tc * (3 * N_S * D_S + 4 * N_S)) / 1e6, "k--", lw=1,
            label="Prop. 4 for Alg. 5: 2Nd + s·Tc·(3Nd+4N)")
    ax.text(0.02, 0.97, f"standard attention (4Nd+4N²): {standard_attention(N_S, D_S).total / 1e6:.0f}M elements",
            transform=ax.transAxes, fontsize=8, va="top")
    ax.set_xlabel("block density s (fraction of non-zero blocks)")
    ax.set_ylabel("HBM accesses (million elements, one head)")
    ax.set_title(f"IO simulator: block-sparse FlashAttention vs s (N={N_S}, d={D_S}, M={M_S})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p2 = os.path.join(args.out, "iosim_vs_s.png")
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    print(f"wrote {p1} and {p2}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
