"""Compile the kernels for sm_90 on a machine without a GPU and report registers, spills and
SASS instruction counts (ptxas/nvdisasm shipped with triton). Indicative only: the local triton
may differ from the GPU machine's.

    python benchmarks/experiments/sass_probe.py --mask longformer --kernel fwd [--bm 128 --bn 128 --warps 8 --stages 3]
    python benchmarks/experiments/sass_probe.py --mask longformer --kernel fwd --bn 64 --loops [--by-line 12]
    python benchmarks/experiments/sass_probe.py --mask longformer --kernel fwd --bn 64 --even --list 64 --loops

``--loops`` splits the SASS into its loops (backward branches) and prints, per loop, the
instruction mix by class (tensor-core MMAs, async copies, plain global loads, barriers, float,
integer, uniform, predicate logic) and, with ``--by-line N``, the N source lines that issue the
most instructions in the loop (line info from ``nvdisasm -g``).
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
from blocksparse_fa.kernels.backward_atomic import _attn_bwd_atomic  # noqa: E402
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
    fn = {"fwd": _attn_fwd, "atomic": _attn_bwd_atomic}.get(kernel, _attn_bwd)
    ptr = "*bf16"
    types = {n: ptr for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}
    types.update({n: "*fp32" for n in ("LSE", "DELTA", "OPART", "LPART", "DKPART", "DVPART", "DQPART", "DQA")})
    types.update({n: "*i32" for n in ("FULL_PTR", "FULL_IDX", "PART_PTR", "PART_IDX", "PARAMS", "AUX", "WORK",
                                      "RFULL_PTR", "RFULL_IDX", "RPART_PTR", "RPART_IDX", "CFULL_PTR", "CFULL_IDX",
                                      "CPART_PTR", "CPART_IDX", "KV_WORK", "Q_WORK", "QPOS", "KPOS")})
    types.update({n: "fp32" for n in ("qk_scale", "sm_scale", "drop_scale", "scale")})
    types.update({n: "*fp32" for n in ("SLOPES", "SOFTCAP", "DBIAS", "DSLOPES")})
    types["BIAS"] = ptr
    consts = dict(PREDICATE=pay.fn, HAS_DROPOUT=False, USE_WORK=True, HEAD_DIM=d, HEAD_DIM_PAD=d,
                  BLOCK_M=bm, BLOCK_N=bn, LAYOUT_BM=128, LAYOUT_BN=128, DOT_PRECISION="tf32",
                  STAGES=stages, MASKED_STAGES=stages if masked_stages is None else masked_stages,
                  FULL_LUT=lut, PART_LUT=lut, ROW_LUT=lut, COL_LUT=lut, ROW_PART_LUT=lut, COL_PART_LUT=lut,
                  ACCUMULATE=False,
                  KV_DESC=False, WARP_SPEC=False, KV_EVEN=False, EVEN=False, DQ_DESC=False, KV_FLAT=False, Q_FLAT=False, SCORE_MOD=0,
                  HAS_POS=False, LIST_BN=0, KV_LIST_BM=0, Q_LIST_BN=0, LSE_BASE2=True)
    if kernel not in ("fwd", "atomic"):  # _attn_bwd: "dkdv" / "dq" alone with (bm, bn), "bwd" = both (dQ at dq_tile)
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


# SASS opcode classes for the loop profile
_CLASSES = (
    ("mma", ("HGMMA", "WARPGROUP", "HMMA")),
    ("async_copy", ("LDGSTS", "LDGDEPBAR", "DEPBAR", "UTMALDG", "UTMAPF", "SYNCS", "UBLKCP")),
    ("global_ld", ("LDG",)),
    ("global_st", ("STG", "RED", "REDG", "ATOM", "ATOMG", "UTMASTG", "UTMAREDG")),
    ("shared", ("LDS", "LDSM", "STS", "STSM")),
    ("local", ("LDL", "STL")),
    ("barrier", ("BAR", "MEMBAR", "FENCE", "WARPSYNC", "ERRBAR", "CCTL")),
    ("mufu", ("MUFU",)),
    ("float", ("FMUL", "FADD", "FFMA", "FMNMX", "FSEL", "FSETP", "F2FP", "FSWZADD", "F2F", "FCHK")),
    ("shuffle", ("SHFL",)),
    ("int", ("IMAD", "IADD3", "ISETP", "LEA", "LOP3", "SHF", "VIADD", "VIMNMX", "IMNMX", "SEL", "IABS",
             "I2F", "F2I", "PRMT", "SGXT", "IMUL", "MOV", "VIADDMNMX", "IDP", "POPC", "FLO", "BMSK")),
    ("pred", ("PLOP3", "P2R", "R2P", "VOTE", "VOTEU")),
    ("uniform", ("U",)),
    ("branch", ("BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL", "NOP", "YIELD")),
)


def _op_class(op: str) -> str:
    base = op.split(".")[0]
    for name, prefixes in _CLASSES:
        if name == "uniform":
            if base.startswith("U") and base not in ("UTMALDG", "UTMAPF", "UBLKCP", "UTMASTG", "UTMAREDG"):
                return name
            continue
        if base in prefixes:
            return name
    return "other"


def sass_text(ck, lineinfo: bool = True) -> str:
    """The kernel's SASS (``nvdisasm``, with source line annotations when ``lineinfo``)."""
    with tempfile.TemporaryDirectory() as td:
        cubin = os.path.join(td, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(ck.asm["cubin"])
        args = [os.path.join(BIN, "nvdisasm"), "-c"] + (["-g"] if lineinfo else []) + [cubin]
        return subprocess.run(args, capture_output=True, text=True).stdout


def parse_sass(sass: str):
    """``(instrs, labels)``: instructions as ``(opcode, predicate guard, source (file, line), text)``
    in program order, and label name -> index of the instruction that follows it."""
    instrs, labels, src = [], {}, None
    for ln in sass.splitlines():
        m = re.match(r"^(\.L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.match(r'^\s*//## File "([^"]+)", line (\d+)', ln)
        if m:
            src = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*)", ln)
        if m:
            instrs.append((m.group(2), (m.group(1) or "").strip(), src, ln.strip()))
    return instrs, labels


def sass_loops(sass: str, by_line: int = 0) -> list:
    """One record per loop (a backward branch to a label): its instruction range, the instruction
    count per class (:data:`_CLASSES`), the counts of a few telling opcodes and, with ``by_line``,
    the source lines that issue most of its instructions. Nested loops are counted in their parent
    too (``depth`` says how deep a loop sits)."""
    instrs, labels = parse_sass(sass)
    loops = []
    for i, (op, _, _, text) in enumerate(instrs):
        m = re.search(r"`\((\.L_x_\d+)\)", text)
        if op.startswith("BRA") and m and labels.get(m.group(1), i + 1) <= i:
            loops.append((labels[m.group(1)], i))
    out = []
    for a, b in loops:
        body = instrs[a:b + 1]
        cls: dict = {}
        for op, _, _, _ in body:
            c = _op_class(op)
            cls[c] = cls.get(c, 0) + 1
        ops = {}
        for key in ("HGMMA", "LDGSTS", "LDG", "UTMALDG", "REDG", "UTMAREDG", "BAR", "DEPBAR", "MUFU", "FSEL", "FMNMX", "ISETP",
                    "SHFL", "MEMBAR", "LDL", "STL"):
            n = sum(1 for op, _, _, _ in body if op.split(".")[0] == key)
            if n:
                ops[key] = n
        rec = dict(first=a, last=b, n=len(body), depth=sum(1 for c, d in loops if c < a and d > b),
                   classes=dict(sorted(cls.items(), key=lambda kv: -kv[1])), ops=ops)
        if by_line:
            lines: dict = {}
            for _, _, src, _ in body:
                key = (os.path.basename(src[0]), src[1]) if src else ("?", 0)
                lines[key] = lines.get(key, 0) + 1
            top = sorted(lines.items(), key=lambda kv: -kv[1])[:by_line]
            rec["lines"] = [(f"{f}:{ln}", n, _source_line(src_path(f, sass), ln)) for (f, ln), n in top]
        out.append(rec)
    return out


def src_path(base: str, sass: str):
    m = re.search(r'//## File "([^"]*' + re.escape(base) + r')"', sass)
    return m.group(1) if m else None


def _source_line(path, line: int) -> str:
    try:
        with open(path) as f:
            return f.read().splitlines()[line - 1].strip()[:90]
    except (OSError, IndexError, TypeError):
        return ""


def print_loops(loops: list) -> None:
    for k, lp in enumerate(loops):
        print(f"loop {k}: instrs {lp['first']}..{lp['last']} n={lp['n']} depth={lp['depth']}")
        print("   classes:", " ".join(f"{c}={n}" for c, n in lp["classes"].items()))
        print("   ops:    ", " ".join(f"{c}={n}" for c, n in lp["ops"].items()))
        for where, n, text in lp.get("lines", []):
            print(f"   {n:5d}  {where:28s} {text}")


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
    ap.add_argument("--kernel", default="fwd", choices=["fwd", "dkdv", "dq", "bwd", "atomic"],
                    help="atomic: the five-GEMM backward (kernels/backward_atomic.py) at dK/dV tile --bm/--bn")
    ap.add_argument("--sweep", action="store_true", help="all kernels x masks at the tuned configs")
    ap.add_argument("--bm", type=int, default=128)
    ap.add_argument("--bn", type=int, default=128)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--masked-stages", type=int, default=None)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--sass-out", default=None, help="write the TTGIR here (and the SASS to PATH.sass)")
    ap.add_argument("--loops", action="store_true", help="instruction mix of every loop of the SASS")
    ap.add_argument("--by-line", type=int, default=0, help="with --loops: the N source lines issuing most")
    ap.add_argument("--lut", default="load", choices=["load", "prefetch", "arith"], help="LUT index mode of the loops")
    ap.add_argument("--dq-tile", type=int, nargs=2, default=[128, 128], metavar=("BM", "BN"),
                    help="with --kernel bwd: the dQ program's tile (the dK/dV tile is --bm/--bn)")
    ap.add_argument("--even", action="store_true", help="lengths multiples of the layout block (KV_EVEN / EVEN)")
    ap.add_argument("--list", type=int, default=0, metavar="N",
                    help="finer list block along the loops (compiler/finer.py): keys per row entry of the forward "
                         "and dQ (LIST_BN, Q_LIST_BN), queries per column entry of dK/dV (KV_LIST_BM); 0: the "
                         "layout block")
    args = ap.parse_args()
    if args.sweep:
        return sweep()
    mask = _mask(args.mask)
    extra = dict(KV_EVEN=True, EVEN=True) if args.even else {}
    if args.list:
        names = dict(fwd=["LIST_BN"], dkdv=["KV_LIST_BM"], dq=["Q_LIST_BN"], bwd=["KV_LIST_BM", "Q_LIST_BN"])
        extra.update({n: args.list for n in names.get(args.kernel, [])})
    ck = compile_kernel(args.kernel, mask, args.bm, args.bn, args.warps, args.stages, args.masked_stages, args.d,
                        extra=extra, lut=args.lut, dq_tile=tuple(args.dq_tile))
    print(args.mask, args.kernel, (args.bm, args.bn, args.warps, args.stages), report(ck))
    if args.loops:
        print_loops(sass_loops(sass_text(ck), args.by_line))
    if args.sass_out:
        with open(args.sass_out, "w") as f:
            f.write(ck.asm["ttgir"])
        with open(args.sass_out + ".sass", "w") as f:
            f.write(sass_text(ck))


if __name__ == "__main__":
    main()
