"""Profile ours vs FlexAttention and FlashAttention-4 (forward + backward, same inputs) under Nsight
Compute and print a side-by-side table per kernel: time, registers, spills, occupancy, issue-slot
use and stall reasons.

    PYTHONPATH=. python benchmarks/experiments/ncu_compare.py --patterns document_causal sliding_window_1024 [--out DIR]
        [--impls ours flex flex_flash fa4 'ours:{"deterministic": true}' 'ours:{"gluon_bwd": {"stages": 3}}']

``flex``: Flex-Triton; ``flex_flash``: Flex with ``kernel_options={"BACKEND": "FLASH"}``; ``fa4``:
``flash_attn.cute`` (``flash_attn_func`` with ``causal`` / ``window_size``, ``flash_attn_varlen_func``
for documents: ``bench.fa4_form``), which needs the peers installed (``../shared/peers/README.md``;
source ``.peers/install_fa4.sh`` first).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SECTIONS = ["SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis"]
KEEP = {
    "gpu__time_duration.sum": "us",  # ncu reports it in ns: the key is historical
    "launch__registers_per_thread": "regs",
    "launch__grid_size": "grid",
    "launch__shared_mem_per_block_dynamic": "dyn_smem",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "mem%",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue%",
    "smsp__inst_executed.sum": "inst",
    "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum": "local_ld",
    "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum": "local_st",
    "l1tex__t_sectors_pipe_lsu_mem_local_op_ld_lookup_miss.sum": "local_ld_miss_sect",
    "l1tex__m_xbar2l1tex_read_bytes.sum": "l2_to_sm",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor%",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "gmma%",
    "sm__inst_executed_pipe_lsu.sum": "lsu_inst",
}
# Collected with --metrics next to the sections; names this ncu does not know are dropped first.
EXTRA = [m for m in KEEP if m.startswith(("l1tex__", "sm__pipe", "sm__inst"))]


def known_metrics(ncu: str, names: list[str]) -> list[str]:
    """The subset of ``names`` that this ncu/GPU knows (``ncu --query-metrics``), by base name."""
    r = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, timeout=120)
    have = {line.split()[0] for line in r.stdout.splitlines() if line.strip() and "__" in line.split()[0]}
    return [m for m in names if m.split(".")[0] in have]


def worker(pattern: str, impl: str, n: int, d: int) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/, for bench.py
    import bench

    import blocksparse_fa as bsfa

    mask, mm = bench.make_case(pattern, n)
    h = 16
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    if impl.startswith("ours"):  # "ours" or "ours:{json kernel_options}" (a variant of our kernels)
        lay = bsfa.compile_mask(mask, n, n, 128, device="cuda")
        opts = None
        if ":" in impl:
            from blocksparse_fa.ops.options import GluonBwdConfig

            opts = json.loads(impl.split(":", 1)[1])
            if "gluon_bwd" in opts:
                opts["gluon_bwd"] = GluonBwdConfig(**opts["gluon_bwd"])
        fwd = lambda: bsfa.attention(q, k, v, mask=lay, kernel_options=opts)
    elif impl == "fa4":  # (B, L, H, D) leaves, or (total, H, D) for varlen
        import peers

        form = bench.fa4_form(pattern, n)
        if isinstance(form, str):
            raise SystemExit(f"fa4: {form}")
        q, k, v, do = (t.detach().transpose(1, 2).contiguous() for t in (q, k, v, do))
        if "varlen" in form:
            q, k, v, do = (t[0].clone() for t in (q, k, v, do))
            cu, longest = peers.cu_seqlens_from_ids(form["varlen"].to("cuda"))
            fwd = lambda: peers.fa4_varlen(q, k, v, cu, longest)
        else:
            fwd = lambda: peers.fa4_dense(q, k, v, form.get("causal", False), form.get("window"))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    else:  # "flex" (Triton backend) or "flex_flash"
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        bm = None if mm is None else create_block_mask(mm, None, None, n, n, device="cuda", _compile=True)
        ko = {"BACKEND": "FLASH"} if impl == "flex_flash" else None
        fwd = lambda: flex(q, k, v, block_mask=bm, kernel_options=ko)
    for _ in range(3):
        torch.autograd.grad(fwd(), (q, k, v), do)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    torch.autograd.grad(fwd(), (q, k, v), do)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def parse(text: str) -> list[dict]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    head, body = rows[0], rows[2:]  # row 1 holds units
    out = []
    for r in body:
        rec = dict(zip(head, r))
        k = {"name": rec.get("Kernel Name", "")[:60]}
        for m, short in KEEP.items():
            if m in rec:
                k[short] = rec[m]
        stalls = {c.split("issue_stalled_")[1].split("_per_issue")[0]: rec[c] for c in head
                  if "average_warps_issue_stalled_" in c and c.endswith("per_issue_active.ratio")}
        top = sorted(((float(v.replace(",", "")), s) for s, v in stalls.items() if v not in ("", "n/a")), reverse=True)[:5]
        k["stalls"] = ", ".join(f"{s} {v:.2f}" for v, s in top)
        out.append(k)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", nargs="?", default="run")
    ap.add_argument("--patterns", nargs="+", default=["document_causal", "sliding_window_1024"])
    ap.add_argument("--impls", nargs="+", default=["ours", "flex"])
    ap.add_argument("--pattern")
    ap.add_argument("--impl")
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.cmd == "worker":
        return worker(args.pattern, args.impl, args.n, args.d)
    results = {}
    extra = known_metrics(args.ncu, EXTRA)
    print("extra metrics:", extra, "dropped:", sorted(set(EXTRA) - set(extra)), flush=True)
    for p in args.patterns:
        for impl in args.impls:
            cmd = [args.ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all",
                   "--csv", "--page", "raw"]
            for s in SECTIONS:
                cmd += ["--section", s]
            if extra:
                cmd += ["--metrics", ",".join(extra)]
            cmd += [sys.executable, __file__, "worker", "--pattern", p, "--impl", impl, "--n", str(args.n), "--d", str(args.d)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
            tag = "".join(c if c.isalnum() else "_" for c in impl)[:40]
            with open(os.path.join(args.out, f"ncu_{p}_{tag}.csv"), "w") as f:
                f.write(r.stdout)
            try:
                ks = parse(r.stdout)
            except StopIteration:
                print(p, impl, "no ncu output:", r.stderr[-800:], flush=True)
                continue
            results[f"{p}/{impl}"] = ks
            print(f"== {p} {impl}", flush=True)
            for k in ks:
                print("  " + " ".join(f"{a}={b}" for a, b in k.items()), flush=True)
    with open(os.path.join(args.out, "ncu_compare.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
