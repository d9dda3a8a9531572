"""Compile the interval kernels (``kernels/interval.py``) for sm_90 without a GPU and report
registers, spills and shared memory (``sass_probe.report``), at the tiles the launcher picks and
at the default block-sparse tiles. Indicative only: the local triton may differ from the GPU's.

    PYTHONPATH=. python benchmarks/experiments/interval_probe.py [--d 128] [--ids] [--dropout]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sass_probe as sp  # noqa: E402  (drops TRITON_INTERPRET before triton is imported)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from blocksparse_fa.kernels.config import bwd_configs, fwd_config  # noqa: E402
from blocksparse_fa.kernels.interval import _interval_bwd, _interval_fwd  # noqa: E402


def compile_interval(fn, consts: dict, warps: int, stages: int):
    types = {n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}
    types.update({n: "*fp32" for n in ("LSE", "DELTA")})
    types.update({n: "*i32" for n in ("LO", "HI", "QID", "KID", "TAB", "ROW_TAB", "COL_TAB")})
    types.update({n: "fp32" for n in ("qk_scale", "sm_scale", "drop_scale")})
    consts = dict(consts, G=1)  # an int equal to 1 is specialised (MHA)
    div16 = [i for i, n in enumerate(fn.arg_names) if n not in consts and
             (types.get(n, "").startswith("*") or n.startswith("stride_") or n == "H")]
    src = ASTSource(fn=fn, signature=sp._sig(fn, types, consts), constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in div16})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--ids", action="store_true", help="the id compare of documents whose ids may recur")
    ap.add_argument("--dropout", action="store_true", help="with attention dropout")
    args = ap.parse_args(argv)
    d, dt = args.d, torch.bfloat16
    for label, f in (("launcher", fwd_config(d, dt, 128, 128, band=True)), ("default", fwd_config(d, dt, 128, 128))):
        ck = compile_interval(_interval_fwd, dict(HAS_IDS=args.ids, HEAD_DIM=d, HEAD_DIM_PAD=d, BLOCK_M=f.block_m,
                                                  BLOCK_N=f.block_n, DOT_PRECISION="tf32", STAGES=f.num_stages,
                                                  KV_EVEN=True, HAS_DROPOUT=args.dropout), f.num_warps,
                              f.num_stages)
        r = sp.report(ck)
        r.pop("top", None)
        print(f"fwd {label:8s} {f}: {r}", flush=True)
    for label, (kv, q) in (("launcher", bwd_configs(d, dt, 128, 128, partial_heavy=True)),
                           ("default", bwd_configs(d, dt, 128, 128))):
        runs = [(True, True)] if kv.num_warps == q.num_warps else [(True, False), (False, True)]
        for run_kv, run_q in runs:
            ck = compile_interval(_interval_bwd, dict(
                HAS_IDS=args.ids, HEAD_DIM=d, HEAD_DIM_PAD=d, KV_BLOCK_M=kv.block_m, KV_BLOCK_N=kv.block_n,
                Q_BLOCK_M=q.block_m, Q_BLOCK_N=q.block_n, DOT_PRECISION="tf32", KV_STAGES=kv.num_stages,
                Q_STAGES=q.num_stages, RUN_KV=run_kv, RUN_Q=run_q, Q_EVEN=True, KV_EVEN=True,
                HAS_DROPOUT=args.dropout),
                kv.num_warps if run_kv else q.num_warps, max(kv.num_stages, q.num_stages))
            r = sp.report(ck)
            r.pop("top", None)
            print(f"bwd {label:8s} dK/dV {kv} dQ {q} run {(run_kv, run_q)}: {r}", flush=True)


if __name__ == "__main__":
    main()
