"""How much data does the H100's L2 keep for re-reads? A sweep microbenchmark under Nsight Compute.

The traffic model's DRAM level (``blocksparse_fa/analysis/traffic``) needs the capacity the L2
offers to data that is read again. The H100's 50 MB L2 is built from two partitions; whether a line
read by SMs attached to both is held once or twice decides whether that capacity is 50 MB or about
25 MB. This script measures it without any attention kernel, so the number it gives is an input to
the model, not a fit to the attention measurements.

One Triton kernel, one program per SM, reads a bf16 buffer of X MiB twice (two passes, every
program in the same order, a 8 KiB chunk per step). Modes:

* ``shared``: every program reads the whole buffer. Each line is read by SMs on both partitions.
* ``private``: program i reads its own slice of X / #programs. Each line is read by one SM.
* ``smid_half`` / ``smid_parity``: the programs on SMs with ``%smid < #SMs / 2`` (or even
  ``%smid``) read the first half of the buffer, the others the second half. If one of them splits
  the SMs along the partitions, its lines are read from one partition only.

Under an LRU of C bytes the second pass hits while X ≤ C, so DRAM reads are X (one pass) below C and
approach 2X above it. ``dram__bytes_read`` per launch, as a function of X and the mode, gives C for
shared and for private data.

Run on the H100, from the repository root:

    PYTHONPATH=. python benchmarks/experiments/l2_calibration.py run --out /tmp/l2cal

``run`` launches this script's ``worker`` under ``ncu --cache-control all --clock-control none
--profile-from-start off`` and writes ``data/l2_calibration.json`` in ``--out`` (in ``docs/`` with
``--update-docs``); ``report`` (CPU) prints the table from ``docs/data/l2_calibration.json`` (or
``--docs DIR``).
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
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("shared", "private", "smid_half", "smid_parity")
SIZES_MIB = (8, 16, 20, 24, 28, 32, 40, 48, 56, 64, 96)
BASE_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors_srcunit_tex_op_read.sum",
                "gpu__time_duration.sum")
BLOCK = 4096  # bf16 elements per step: 8 KiB
PASSES = 2


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _l2_sweep(X, OUT, SMID, n_steps, slice_elems, n_sm, MODE: tl.constexpr, PASSES: tl.constexpr,
                  BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        if MODE == 0:  # shared
            base = pid * 0
        elif MODE == 1:  # private
            base = pid.to(tl.int64) * slice_elems
        elif MODE == 2:  # smid_half
            base = (sm >= n_sm // 2).to(tl.int64) * slice_elems
        else:  # smid_parity
            base = (sm % 2).to(tl.int64) * slice_elems
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in range(PASSES):
            for i in range(n_steps):
                acc += tl.load(X + base + i * BLOCK + offs).to(tl.float32)
        tl.store(OUT + pid.to(tl.int64) * BLOCK + offs, acc)
        tl.store(SMID + pid, sm)

    return _l2_sweep


def _launch(kern, buf, out, smid, mode: str, mib: int, n_sm: int):
    elems = mib * 2**20 // 2
    if mode == "shared":
        steps, slice_elems = elems // BLOCK, 0
    elif mode == "private":
        slice_elems = (elems // n_sm) // BLOCK * BLOCK
        steps = slice_elems // BLOCK
    else:
        slice_elems = (elems // 2) // BLOCK * BLOCK
        steps = slice_elems // BLOCK
    kern[(n_sm,)](buf, out, smid, steps, slice_elems, n_sm, MODE=MODES.index(mode), PASSES=PASSES,
                  BLOCK=BLOCK, num_warps=4)
    return steps


def worker(args) -> int:
    import torch

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    kern = _kernel()
    buf = torch.randn(max(SIZES_MIB) * 2**20 // 2, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n_sm * BLOCK, device="cuda", dtype=torch.float32)
    smid = torch.full((n_sm,), -1, device="cuda", dtype=torch.int32)
    info = {"n_sm": n_sm, "gpu": torch.cuda.get_device_name(), "launches": [], "smid": {}}
    for mode in MODES:  # compile, check the sum, record where the programs ran
        steps = _launch(kern, buf, out, smid, mode, 8, n_sm)
        torch.cuda.synchronize()
        s = smid.cpu().tolist()
        info["smid"][mode] = s
        if mode == "shared":
            ref = buf[: steps * BLOCK].float().view(steps, BLOCK).sum(0) * PASSES
            err = (out[:BLOCK] - ref).abs().max().item()
            info["sum_check_max_abs_err"] = err
    torch.cuda.profiler.start()
    for mode in MODES:
        for mib in SIZES_MIB:
            _launch(kern, buf, out, smid, mode, mib, n_sm)
            info["launches"].append({"mode": mode, "mib": mib})
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    with open(args.result, "w") as f:
        json.dump(info, f)
    return 0


def _csv_rows(text: str, keep: set) -> list[dict]:
    """The ``keep`` metrics of every kernel in an ncu ``--page raw --print-units base`` CSV (the
    units row, whose ID is empty, is skipped: base units are bytes, sectors and nanoseconds)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith('"ID"'))
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, out = rows[0], []
    for row in rows[1:]:
        if len(row) < len(header) or not row[0].strip().isdigit():
            continue
        d = {"id": int(row[0])}
        for i, h in enumerate(header):
            if h in keep:
                try:
                    d[h] = float(row[i].replace(",", ""))
                except ValueError:
                    d[h] = None
        out.append(d)
    return sorted(out, key=lambda d: d["id"])


def run(args) -> int:
    ncu = shutil.which("ncu")
    if ncu is None:
        print("error: ncu not found", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    q = subprocess.run([ncu, "--query-metrics", "--chip", "gh100"], capture_output=True, text=True).stdout
    fabric = sorted({ln.split()[0] for ln in q.splitlines()
                     if ln.startswith(("lts__t_sectors_srcunit_ltcfabric", "lts__t_sectors_srcnode_ltcfabric"))})
    metrics = list(BASE_METRICS) + [m + ".sum" for m in fabric[:4]]
    rep, wres = os.path.join(args.out, "l2cal"), os.path.join(args.out, "l2cal.worker.json")
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [ncu, "--clock-control", "none", "--cache-control", "all", "--profile-from-start", "off",
           "-k", "regex:_l2_sweep", "--metrics", ",".join(metrics), "-f", "-o", rep,
           sys.executable, os.path.abspath(__file__), "worker", "--result", wres]
    t0 = time.time()
    with open(os.path.join(args.out, "l2cal.log"), "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    print(f"ncu rc={rc} in {time.time() - t0:.0f} s; fabric metrics: {fabric}", flush=True)
    if rc != 0:
        return rc
    exp = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--csv", "--page", "raw", "--print-units", "base"],
                         capture_output=True, text=True).stdout
    with open(os.path.join(args.out, "l2cal.csv"), "w") as f:
        f.write(exp)
    rows = _csv_rows(exp, set(metrics))
    with open(wres) as f:
        info = json.load(f)
    if len(rows) != len(info["launches"]):
        print(f"error: {len(rows)} profiled kernels for {len(info['launches'])} launches", file=sys.stderr)
        return 1
    res = [dict(launch, **{k: v for k, v in r.items() if k != "id"}) for launch, r in zip(info["launches"], rows)]
    data = {"note": "L2 sweep microbenchmark (benchmarks/experiments/l2_calibration.py): one program per SM reads a bf16 "
                    f"buffer of X MiB in {PASSES} passes, {BLOCK * 2} B per step; ncu --cache-control all",
            "gpu": info["gpu"], "n_sm": info["n_sm"], "metrics": metrics, "passes": PASSES,
            "sum_check_max_abs_err": info.get("sum_check_max_abs_err"),
            "smid_distinct": {m: len(set(v)) for m, v in info["smid"].items()}, "results": res}
    args.docs = args.docs or (os.path.join(REPO, "docs") if args.update_docs else args.out)
    os.makedirs(os.path.join(args.docs, "data"), exist_ok=True)
    path = os.path.join(args.docs, "data", "l2_calibration.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}")
    return report(args)


def report(args) -> int:
    with open(os.path.join(args.docs, "data", "l2_calibration.json")) as f:
        data = json.load(f)
    extra = [m for m in data["metrics"] if m == "lts__t_sectors_srcunit_ltcfabric.sum"]  # between the partitions
    print(f"{data['gpu']}, {data['n_sm']} SMs, {data['passes']} passes; sum check err "
          f"{data['sum_check_max_abs_err']}; distinct SMs {data['smid_distinct']}")
    print("| mode | X MiB | bytes per pass (MB) | DRAM read (MB) | DRAM / one pass | L2→SM (GB) | "
          + "".join("L2 fabric, between the partitions | " for _ in extra) + "µs |")
    print("|---" * (7 + len(extra)) + "|")
    for r in data["results"]:
        mib, mode = r["mib"], r["mode"]
        if mode == "private":
            per_pass = (mib * 2**20 // 2 // data["n_sm"]) // BLOCK * BLOCK * 2 * data["n_sm"]
        else:
            per_pass = (mib * 2**20 // 2) // BLOCK * BLOCK * 2
        dr = r.get("dram__bytes_read.sum") or float("nan")
        l2 = (r.get("lts__t_sectors_srcunit_tex_op_read.sum") or float("nan")) * 32
        ex = " | ".join(f"{(r.get(m) or 0) * 32 / 1e6:.1f} MB" for m in extra)
        print(f"| {mode} | {mib} | {per_pass / 1e6:.1f} | {dr / 1e6:.1f} | {dr / per_pass:.2f} | {l2 / 1e9:.2f} | "
              f"{ex} | {(r.get('gpu__time_duration.sum') or 0) / 1e3:.0f} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", default="/tmp/l2cal")
    r.add_argument("--docs", default=None, help="write data/l2_calibration.json into this tree (default --out)")
    r.add_argument("--update-docs", action="store_true", help="write docs/data/l2_calibration.json")
    w = sub.add_parser("worker")
    w.add_argument("--result", required=True)
    p = sub.add_parser("report")
    p.add_argument("--docs", default=os.path.join(REPO, "docs"))
    args = ap.parse_args(argv)
    return {"run": run, "worker": worker, "report": report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
