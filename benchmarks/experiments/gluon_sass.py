"""Compile the Gluon forward (``kernels/forward_gluon.py``) or backward (``kernels/backward_gluon.py``)
for sm_90 without a GPU and report registers, spills (stack bytes, local loads/stores), shared
memory and the SASS opcode mix (``sass_probe.report``). Run it with the Triton of the GPU machine
first on the path:

    PYTHONPATH=.:/path/to/triton-3.6 python benchmarks/experiments/gluon_sass.py [--d 128 --bm 64 --bn 128
        --stages 2 --causal --interval --no-pingpong --no-overlap --persistent --dtype bf16 --groups 3]
        [--ptx FILE]
    PYTHONPATH=.:/path/to/triton-3.6 python benchmarks/experiments/gluon_sass.py --bwd dkdv [--atomic]
        [--d 128 --bm 64 --bn 64 --stages 2 --causal --bwd-pingpong --bwd-overlap 0|1|2 --loops
        --interval --out-f32 --list --two]
    PYTHONPATH=.:/path/to/triton-3.6 python benchmarks/experiments/gluon_sass.py --bwd dq [--bm 64 --bn 64
        --interval --out-f32 ...]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_probe import report  # noqa: E402


def compile_gluon(d=128, bm=64, bn=128, stages=2, causal=False, pingpong=True, overlap=True, producer_regs=24,
                  consumer_regs=240, dtype="bf16", interval=False, persistent=False, global_keys=0,
                  global_causal=False, lists=False, two=False, dealt=False, groups=2, segments=False,
                  q_bufs=1):
    from triton.experimental.gluon._runtime import GluonASTSource

    from blocksparse_fa.kernels.forward_gluon import _attn_fwd_gluon as fn

    consts = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, CAUSAL=causal, INTERVAL=interval,
                  PINGPONG=pingpong, OVERLAP=overlap, PERSISTENT=persistent,
                  M_MAJOR=persistent and interval and not segments, SEGMENTS=segments, Q_BUFS=q_bufs,
                  PRODUCER_REGS=producer_regs,
                  CONSUMER_REGS=consumer_regs, GLOBAL_KEYS=global_keys, GLOBAL_CAUSAL=global_causal,
                  LIST=lists, DEALT=dealt, GROUPS=groups)
    types = {n: "*" + dtype for n in "QKVO"}
    iv = "*i64" if two else "*i32"
    types.update(LSE="*fp32", LO=iv, HI=iv, TILES="*i32", DEAL="*i32", qk_scale="fp32")
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    div16 = [i for i, n in enumerate(fn.arg_names)
             if n not in consts and (types.get(n, "").startswith("*") or n.startswith("stride_"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in div16}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def compile_gluon_bwd(kernel="dkdv", d=128, bm=64, bn=64, stages=2, causal=False, atomic=False, producer_regs=24,
                      consumer_regs=240, dtype="bf16", pingpong=False, overlap=False, interval=False,
                      out_f32=False, direct=False, persistent=False, rows_smem=False, lists=False,
                      two=False, bounds_smem=False, dealt=False, dq_lag=False, rows_acc=0, late_dv=False,
                      dk_ds_smem=False):
    """Compile ``_attn_bwd_dkdv_gluon`` (``kernel="dkdv"``) or ``_attn_bwd_dq_gluon`` (``"dq"``);
    ``interval``: their one-interval-per-row mode; ``out_f32``: float32 gradients; ``direct``: stored
    from the registers (``DIRECT_STORE``); ``lists``: the interval mode over block lists (``LIST``),
    ``two``: two intervals per row (int64 bounds)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from blocksparse_fa.kernels import backward_gluon as bg

    if kernel == "dkdv":
        fn = bg._attn_bwd_dkdv_gluon
        consts = dict(ATOMIC_DQ=atomic, PERSISTENT=persistent, M_MAJOR=persistent and interval, ROWS_SMEM=rows_smem,
                      BOUNDS_SMEM=bounds_smem, DEALT=dealt, DQ_LAG=dq_lag, ROWS_ACC=rows_acc, LATE_DV=late_dv,
                      DK_DS_SMEM=dk_ds_smem and atomic)
        g = "fp32" if out_f32 else dtype
        ptrs = dict(Q=dtype, K=dtype, V=dtype, DO=dtype, DK=g, DV=g, DQA="fp32", LSE="fp32", DELTA="fp32")
    else:
        fn = bg._attn_bwd_dq_gluon
        consts = dict(PERSISTENT=persistent, M_MAJOR=persistent and interval, DEALT=dealt)
        ptrs = dict(Q=dtype, K=dtype, V=dtype, DO=dtype, DQ="fp32" if out_f32 else dtype, LSE="fp32", DELTA="fp32")
    consts.update(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, CAUSAL=causal, PINGPONG=pingpong,
                  OVERLAP=overlap, PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs, INTERVAL=interval,
                  DIRECT_STORE=out_f32 or direct, LIST=lists)
    ptrs.update(LO="i64" if two else "i32", HI="i64" if two else "i32", TAB="i32", ORD="i32", DEAL="i32")
    types = {n: "*" + t for n, t in ptrs.items()}
    types.update(qk_scale="fp32", sm_scale="fp32")
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    div16 = [i for i, n in enumerate(fn.arg_names)
             if n not in consts and (types.get(n, "").startswith("*") or n.startswith("stride_"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in div16}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--bm", type=int, default=64)
    ap.add_argument("--bn", type=int, default=128)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--interval", action="store_true", help="one key interval per row (LO/HI tables)")
    ap.add_argument("--no-pingpong", action="store_true")
    ap.add_argument("--persistent", action="store_true", help="one program per SM looping over work items")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--global-keys", type=int, default=0, help="forward, interval: g global keys (GLOBAL_KEYS)")
    ap.add_argument("--global-causal", action="store_true", help="forward: the global keys only up to the row")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--ptx", help="write the PTX here (setmaxnreg, barriers, wgmma waits)")
    ap.add_argument("--bwd", choices=["dkdv", "dq"], help="a backward kernel instead of the forward")
    ap.add_argument("--atomic", action="store_true",
                    help="dK/dV kernel: the five-GEMM dQ (TMA reduce-adds, half the columns per consumer group)")
    ap.add_argument("--consumer-regs", type=int, default=None, help="default 240 (160 with --groups 3)")
    ap.add_argument("--groups", type=int, default=2, choices=[2, 3], help="forward: consumer warp groups")
    ap.add_argument("--bwd-pingpong", action="store_true", help="backward: the consumer groups take turns")
    ap.add_argument("--bwd-overlap", type=int, default=0, choices=[0, 1, 2],
                    help="backward: step t's last product issued in t + 1 (1: dS in registers, 2: in shared memory)")
    ap.add_argument("--out-f32", action="store_true", help="backward: float32 gradients (DIRECT_STORE)")
    ap.add_argument("--direct", action="store_true", help="backward: gradients stored from the registers")
    ap.add_argument("--rows-smem", action="store_true", help="dK/dV kernel: LSE/Δ staged with Q/dO (ROWS_SMEM)")
    ap.add_argument("--loops", action="store_true", help="per loop of the SASS: size, wgmma, local loads/stores")
    ap.add_argument("--list", action="store_true", help="interval mode over block lists (LIST)")
    ap.add_argument("--two", action="store_true", help="two intervals per row (int64 LO/HI)")
    ap.add_argument("--bounds-smem", action="store_true", help="dK/dV kernel: interval bounds staged (BOUNDS_SMEM)")
    ap.add_argument("--dq-lag", action="store_true", help="dK/dV kernel, --atomic: dQ issued a step late (DQ_LAG)")
    ap.add_argument("--dealt", action="store_true", help="persistent: items from a deal table (DEALT)")
    ap.add_argument("--rows-acc", type=int, default=0, choices=[0, 1, 2],
                    help="dK/dV kernel: Δ (1), and -LSE/scale (2), as the accumulators' start (ROWS_ACC)")
    ap.add_argument("--late-dv", action="store_true", help="dK/dV kernel: dV's product after dSᵀ (LATE_DV)")
    ap.add_argument("--dk-ds-smem", action="store_true",
                    help="dK/dV kernel, --atomic: dK's product reads dSᵀ from shared memory (DK_DS_SMEM)")
    ap.add_argument("--segments", action="store_true", help="forward, persistent interval: segment tiles (SEGMENTS)")
    ap.add_argument("--q-bufs", type=int, default=1, choices=[1, 2], help="forward, persistent: sets of Q tiles")
    a = ap.parse_args()
    if a.consumer_regs is None:
        a.consumer_regs = 160 if a.groups == 3 else 240
    if a.bwd:
        ck = compile_gluon_bwd(a.bwd, a.d, a.bm, a.bn, a.stages, a.causal, a.atomic, consumer_regs=a.consumer_regs,
                               dtype=a.dtype, pingpong=a.bwd_pingpong, overlap=a.bwd_overlap,
                               interval=a.interval, out_f32=a.out_f32, direct=a.direct,
                               persistent=a.persistent, rows_smem=a.rows_smem, lists=a.list, two=a.two,
                               bounds_smem=a.bounds_smem, dealt=a.dealt, dq_lag=a.dq_lag, rows_acc=a.rows_acc,
                               late_dv=a.late_dv, dk_ds_smem=a.dk_ds_smem)
    else:
        ck = compile_gluon(a.d, a.bm, a.bn, a.stages, a.causal, not a.no_pingpong, not a.no_overlap,
                           consumer_regs=a.consumer_regs, dtype=a.dtype, interval=a.interval,
                           persistent=a.persistent, global_keys=a.global_keys, global_causal=a.global_causal,
                           lists=a.list, two=a.two, dealt=a.dealt, groups=a.groups, segments=a.segments,
                           q_bufs=a.q_bufs)
    print(f"triton {triton.__version__}: {report(ck)}")
    ptx = ck.asm["ptx"]
    print("setmaxnreg:", [ln.split()[-1].rstrip(";") for ln in ptx.splitlines() if "setmaxnreg" in ln],
          "threads:", [ln.split()[-1] for ln in ptx.splitlines() if ".reqntid" in ln])
    if a.loops:  # spills inside a loop are local loads/stores (LDL/STL) between its label and back branch
        from sass_probe import sass_loops, sass_text

        for k, lp in enumerate(sass_loops(sass_text(ck, lineinfo=False))):
            print(f"loop {k}: n={lp['n']} depth={lp['depth']} HGMMA={lp['ops'].get('HGMMA', 0)} "
                  f"LDL={lp['ops'].get('LDL', 0)} STL={lp['ops'].get('STL', 0)}")
    if a.ptx:
        with open(a.ptx, "w") as f:
            f.write(ptx)


if __name__ == "__main__":
    main()
