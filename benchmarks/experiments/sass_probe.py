"""Compile the kernels for sm_90 on a machine without a GPU and report registers, spills and
SASS instruction counts (ptxas/nvdisasm shipped with triton). Indicative only: the local triton
may differ from the GPU machine's.

    python benchmarks/experiments/sass_probe.py --mask longformer --kernel fwd [--bm 128 --bn 128 --warps 8 --stages 3]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import blocksparse_fa as bsfa  # noqa: E402
from blocksparse_fa.kernels import _attn_bwd, _attn_fwd  # noqa: E402
from blocksparse_fa.kernels.predicate import build_payload  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _sig(fn, types: dict, consts: dict):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "i32")
    return sig


def compile_kernel(kernel: str, mask, bm, bn, warps, stages, masked_stages=None, d=128, extra=None, lut="load",
                   dq_tile=(128, 128)):
    lay = bsfa.compile_mask(mask, 4096, 4096, 128)
    pay = build_payload(lay, "cpu")
    fn = _attn_fwd if kernel == "fwd" else _attn_bwd
    ptr = "*bf16"
    types = {n: ptr for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}
    types.update({n: "*fp32" for n in ("LSE", "DELTA", "OPART", "LPART", "DKPART", "DVPART", "DQPART")})
    types.update({n: "*i32" for n in ("FULL_PTR", "FULL_IDX", "PART_PTR", "PART_IDX", "PARAMS", "AUX", "WORK",
                                      "RFULL_PTR", "RFULL_IDX", "RPART_PTR", "RPART_IDX", "CFULL_PTR", "CFULL_IDX",
                                      "CPART_PTR", "CPART_IDX", "KV_WORK", "Q_WORK")})
    types.update({n: "fp32" for n in ("qk_scale", "sm_scale", "drop_scale", "scale")})
    consts = dict(PREDICATE=pay.fn, HAS_DROPOUT=False, USE_WORK=True, HEAD_DIM=d, HEAD_DIM_PAD=d,
                  BLOCK_M=bm, BLOCK_N=bn, LAYOUT_BM=128, LAYOUT_BN=128, DOT_PRECISION="tf32",
                  STAGES=stages, MASKED_STAGES=stages if masked_stages is None else masked_stages,
                  FULL_LUT=lut, PART_LUT=lut, ROW_LUT=lut, COL_LUT=lut, ACCUMULATE=False,
                  KV_DESC=False, WARP_SPEC=False)
    if kernel != "fwd":  # _attn_bwd: "dkdv" / "dq" alone with (bm, bn), "bwd" = both (dQ at dq_tile)
        ms = consts["MASKED_STAGES"]
        kv = (bm, bn) if kernel != "dq" else (64, 128)
        qt = (bm, bn) if kernel == "dq" else dq_tile
        consts.update(KV_BLOCK_M=kv[0], KV_BLOCK_N=kv[1], Q_BLOCK_M=qt[0], Q_BLOCK_N=qt[1], KV_STAGES=stages,
                      KV_MASKED_STAGES=ms, Q_STAGES=stages, Q_MASKED_STAGES=ms,
                      RUN_KV=kernel != "dq", RUN_Q=kernel != "dkdv")
    consts.update(extra or {})
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    consts.update({n: 1 for n in ("G",) if n in fn.arg_names})  # an int equal to 1 is specialised (MHA)
    # mirror the launch-time specialisation: pointers and multiples of 16 are marked 16-divisible
    div16 = [i for i, n in enumerate(fn.arg_names) if n not in consts and
             (types.get(n, "").startswith("*") or n.startswith("stride_") or n in ("H", "LZB", "LZH"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in div16}
    src = ASTSource(fn=fn, signature=_sig(fn, types, consts), constexprs=consts, attrs=attrs)
    if torch.cuda.is_available():
        target = triton.runtime.driver.active.get_current_target()
    else:
        target = GPUTarget("cuda", 90, 32)
    ck = triton.compile(src, target=target, options=dict(num_warps=warps, num_stages=stages))
    return ck


def ir_summary(ck) -> dict:
    """How the loads were lowered: async copies (pipelined), TMA loads, plain loads inside loops."""
    ir = ck.asm["ttgir"]
    return dict(async_copy=ir.count("async_copy_global_to_local"), tma=ir.count("async_tma_copy"),
                loads=ir.count("tt.load"), local_alloc=ir.count("ttg.local_alloc"),
                wgmma=ir.count("warp_group_dot "), loops=ir.count("scf.for"))


def report(ck) -> dict:
    """Registers, stack (spill) bytes, shared memory and SASS opcode counts of a compiled kernel."""
    if torch.cuda.is_available():
        ck._init_handles()
        return dict(regs=ck.n_regs, spills=ck.n_spills, shared=ck.metadata.shared, **ir_summary(ck))
    with tempfile.TemporaryDirectory() as td:
        cubin = os.path.join(td, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(ck.asm["cubin"])
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M)
    count: dict = {}
    for o in ops:
        base = o.split(".")[0]
        count[base] = count.get(base, 0) + 1
    return dict(regs=int(regs.group(1)) if regs else None, stack=int(stack.group(1)) if stack else None,
                n_sass=len(ops), shared=ck.metadata.shared, spill_ops=count.get("STL", 0) + count.get("LDL", 0),
                top=sorted(count.items(), key=lambda kv: -kv[1])[:12])


SWEEP_MASKS = {"causal": "causal", "longformer": "longformer", "bigbird": "bigbird",
               "sliding": "sliding_window(1024)", "document": "document_causal"}


def _mask(name):
    if name == "document_causal":
        ids = torch.repeat_interleave(torch.arange(4), 1024)[None]
        return bsfa.load_pattern(name, document=ids)
    return bsfa.load_pattern(name) if "(" not in name else bsfa.parse(name)


def sweep():
    from blocksparse_fa.kernels.config import bwd_configs, fwd_config
    fc = fwd_config(128, torch.bfloat16, 128, 128)
    kc, qc = bwd_configs(128, torch.bfloat16, 128, 128)
    for kernel, c in (("fwd", fc), ("dkdv", kc), ("dq", qc)):
        for label, expr in SWEEP_MASKS.items():
            ck = compile_kernel(kernel, _mask(expr), c.block_m, c.block_n, c.num_warps, c.num_stages)
            r = report(ck)
            r.pop("top", None)
            print(f"{kernel:5s} {label:11s} {c}: {r}", flush=True)
    print(ir_summary(ck))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mask", default="longformer")
    ap.add_argument("--kernel", default="fwd", choices=["fwd", "dkdv", "dq", "bwd"])
    ap.add_argument("--sweep", action="store_true", help="all kernels x masks at the tuned configs")
    ap.add_argument("--bm", type=int, default=128)
    ap.add_argument("--bn", type=int, default=128)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--masked-stages", type=int, default=None)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--sass-out", default=None)
    ap.add_argument("--lut", default="load", choices=["load", "prefetch", "arith"], help="LUT index mode of the loops")
    ap.add_argument("--dq-tile", type=int, nargs=2, default=[128, 128], metavar=("BM", "BN"),
                    help="with --kernel bwd: the dQ program's tile (the dK/dV tile is --bm/--bn)")
    args = ap.parse_args()
    if args.sweep:
        return sweep()
    mask = _mask(args.mask)
    ck = compile_kernel(args.kernel, mask, args.bm, args.bn, args.warps, args.stages, args.masked_stages, args.d,
                        lut=args.lut, dq_tile=tuple(args.dq_tile))
    print(args.mask, args.kernel, (args.bm, args.bn, args.warps, args.stages), report(ck))
    if args.sass_out:
        with open(args.sass_out, "w") as f:
            f.write(ck.asm["ttgir"])


if __name__ == "__main__":
    main()
