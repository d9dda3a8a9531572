"""Measure the kernels' memory traffic with Nsight Compute and compare it with the traffic model.

Run on a machine with an NVIDIA GPU (H100) and ``ncu`` on PATH, from the repository root:

    PYTHONPATH=. python benchmarks/traffic_gpu.py run --out /tmp/bsfa_traffic

Modes:

* ``run`` (driver): for every configuration of the two regimes and every implementation (ours,
  FlexAttention) it launches *this script* in ``worker`` mode under
  ``ncu --clock-control none --cache-control all --profile-from-start off --metrics
  dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,
  l1tex__m_xbar2l1tex_read_bytes.sum,gpu__time_duration.sum``
  (ours filtered with ``-k regex:_attn``), exports the report to CSV, parses it, and writes the raw
  results to ``docs/data/traffic_<regime>.json`` (after every configuration, so an interrupted run
  keeps what it measured). ncu reports, CSVs and logs go under ``--out``. Then it runs ``report``.
* ``worker``: one configuration, one implementation. Warms up (compiles), then inside a
  ``cudaProfilerStart/Stop`` window runs one forward, a marker kernel (``torch.cuda._sleep``) and one
  backward — so ncu profiles exactly one launch of each kernel — and finally times forward and
  forward+backward with CUDA events outside the window. Writes a small JSON (``--result``).
* ``report``: reads ``docs/data/traffic_*.json``, evaluates the traffic model
  (``blocksparse_fa.analysis.traffic``) for every configuration, and writes ``docs/traffic_<regime>.png``
  (L2→SM bytes, DRAM bytes and time vs block density s, model lines and linear fits) and the results
  section of ``docs/traffic.md`` (between the ``GPU-RESULTS`` markers). Runs on CPU.
* ``synth``: writes *synthetic* JSON (model × noise, flagged ``"synthetic": true``) to test ``report``
  without a GPU. Never commit its output as a measurement.
* ``list``: prints the configurations with their block density and model predictions (CPU).

Regimes (block density s from ~1 % to 100 %; 20 configurations x 2 implementations):

* ``inl2``: N = 16K, B = 1, H = 16, d = 128, bf16 — one head's K/V (8 MB) fits in the 50 MB L2;
  sliding windows of growing width, causal, dense.
* ``beyondl2``: N = 128K, B = 1, H = 4, d = 128, bf16 — one head's K/V is 64 MB, beyond L2; random
  block masks (``random_blocks(r)``) with r from 1 to 1024 of the 1024 key blocks (s = 0.1 % … 100 %;
  the model puts the departure from compulsory traffic between r = 1 and r = 4).

Everything written goes under ``--out`` (``data/traffic_<regime>.json``, ``traffic_<regime>.png``,
``traffic.md``); ``docs/`` (``docs/data/``, ``docs/traffic_*.png``, ``docs/traffic.md``) only with
``--update-docs`` or an explicit ``--docs DIR``. ``report`` reads ``docs/data/`` unless ``--docs``
names another tree. ncu needs access to the GPU performance counters (run as root or with
``NVreg_RestrictProfilingToAdminUsers=0``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors_srcunit_tex_op_read.sum",
           "l1tex__m_xbar2l1tex_read_bytes.sum", "gpu__time_duration.sum",
           "l1tex__t_sectors_pipe_lsu_mem_local_op_ld_lookup_miss.sum")
# asked for where the GPU's ncu knows them (``ncu --query-metrics``): what the SMs write into L2, and
# the reductions (the five-GEMM backward's TMA reduce-add of dQ)
OPTIONAL_METRICS = ("lts__t_sectors_srcunit_tex_op_write.sum", "lts__t_sectors_srcunit_tex_op_red.sum")
# the last one: register-spill reloads that miss L1 (sectors), part of the crossbar's bytes
# L2 -> SM bytes: the crossbar's delivered bytes (l1tex__m_xbar2l1tex_read_bytes). The L2-slice
# counter (lts__t_sectors_srcunit_tex_op_read x 32) under-counts when many programs read one block
# at once (dense: -38 %, docs/traffic.md); it is kept as l2_read_slice, and used for l2_read only
# in results measured before the crossbar counter was added.
SECTOR_BYTES = 32
MARKER_RE = re.compile(r"spin_kernel")
OURS_RE = re.compile(r"_attn_(fwd|bwd_preprocess|bwd_dkdv|bwd_dq)\b")  # not the *_combine kernels
BEGIN, END = "<!-- GPU-RESULTS:BEGIN -->", "<!-- GPU-RESULTS:END -->"
REGIMES = ("inl2", "beyondl2", "inl2_default", "h32_default")
# inl2 / beyondl2: the Triton block-sparse kernels everywhere (kernel options forward/backward
# "triton"); the *_default regimes: what attention() runs by default (the Gluon kernels on dense,
# causal and one-interval-per-row layouts on Hopper), which the model follows (kernels="auto")
IMPLS = ("ours", "flex")


# ================================================================================================
# configurations
# ================================================================================================
def regime_configs(regime: str, quick: bool = False) -> list[dict]:
    """The configurations of a regime (``quick``: small sizes for a smoke test)."""
    kernels = "auto" if regime.endswith("_default") else "triton"
    if regime in ("inl2", "inl2_default"):
        n, h = (4096, 4) if quick else (16384, 16)
        widths = (128, 512, 2048) if quick else (128, 512, 2048, 8192)
        masks = [(f"sw{w}", f"sliding_window({w})", f"sliding_window:{w}") for w in widths]
        masks += [("causal", "causal", "causal"), ("dense", "full", "full")]
    elif regime == "beyondl2":
        n, h = (16384, 2) if quick else (131072, 4)
        tc = n // 128
        rs = (1, 4, 32, tc) if quick else (1, 4, 16, 64, 256, 1024)
        masks = [(f"rb{r}", f"random_blocks({r}, 128, 1)", "blocks") for r in rs]
    elif regime == "h32_default":  # where the Triton backward's DRAM bytes left the model (docs/traffic.md)
        n, h = (8192, 4) if quick else (65536, 32)
        masks = [("cw2048", "causal & sliding_window(2048)", "sliding_window:2048"),
                 ("sw256", "sliding_window(256)", "sliding_window:256"), ("causal", "causal", "causal")]
    else:
        raise ValueError(f"unknown regime {regime!r} (choose from {REGIMES})")
    return [dict(regime=regime, name=name, mask=m, flex_mod=fm, q_len=n, kv_len=n, batch=1, heads=h, kv_heads=h,
                 head_dim=128, dtype="bf16", block=128, kernels=kernels) for name, m, fm in masks]


def _layout(cfg: dict, device=None):
    from blocksparse_fa.compiler.compile import compile_mask

    return compile_mask(cfg["mask"], cfg["q_len"], cfg["kv_len"], cfg["block"], device=device)


# ================================================================================================
# worker (runs under ncu)
# ================================================================================================
def _flex_block_mask(layout, cfg: dict):
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    lq, lk = cfg["q_len"], cfg["kv_len"]
    off = lk - lq
    kind, _, arg = cfg["flex_mod"].partition(":")
    if kind == "sliding_window":
        w = int(arg)

        def mask_mod(b, h, q_idx, kv_idx):
            qp = q_idx + off
            return (kv_idx <= qp) & (qp - kv_idx < w)
    elif kind == "causal":
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + off
    else:  # "full" / "blocks": only full blocks exist, the predicate is never evaluated
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= 0

    st = layout.block_states().to("cuda")
    if st.dim() != 2:
        raise ValueError("the flex comparison supports layouts without batch dims only")

    def lists(sel):
        counts = sel.sum(-1).to(torch.int32)
        idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[None, None].contiguous(), idx[None, None].contiguous()

    kv_num, kv_idx = lists(st == 1)
    full_num, full_idx = lists(st == 2)
    kw = dict(BLOCK_SIZE=cfg["block"], mask_mod=mask_mod)
    try:
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, seq_lengths=(lq, lk), **kw)
    except TypeError:  # older signature without seq_lengths
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, **kw)


def _kernel_tiles(cfg: dict) -> dict | None:
    """Tile sizes our kernels pick for this problem, if the kernel config module says so."""
    try:
        import torch

        from blocksparse_fa.kernels import config as kc

        from blocksparse_fa.ops.select import layout_class

        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg["dtype"]]
        dp = kc.head_dim_pad(cfg["head_dim"])
        lc = layout_class(_layout(cfg, device="cpu"))  # band-like and partial-heavy layouts: own tile tables
        f = kc.fwd_config(dp, dt, cfg["block"], cfg["block"], lc.band, lc.partial_rows)
        a, b = kc.bwd_configs(dp, dt, cfg["block"], cfg["block"], lc.band, lc.partial_heavy)
        return dict(fwd_block_m=f.block_m, fwd_block_n=f.block_n, dkdv_block_m=a.block_m, dkdv_block_n=a.block_n,
                    dq_block_m=b.block_m, dq_block_n=b.block_n)
    except Exception:  # noqa: BLE001 - best effort
        return None


# Backward variants for experiments (``run --bwd-variant``): the spill-free tiles of partial-heavy
# layouts on any layout, and/or dK/dV and dQ in two launches (ncu then reports each part).
BWD_VARIANTS = ("default", "spill_free", "two_launch", "spill_free_two_launch")


def _bwd_variant_options(variant: str) -> dict:
    """The kernel options of a backward variant."""
    if variant not in BWD_VARIANTS:
        raise ValueError(f"unknown backward variant {variant!r}; expected one of {BWD_VARIANTS}")
    from blocksparse_fa.kernels import config as kc

    opts = {}
    if variant.startswith("spill_free"):
        opts["dkdv_tiles"], opts["dq_tiles"] = kc._BWD_PARTIAL[128]
    if variant.endswith("two_launch"):
        opts["fused_backward"] = False
    return opts


def worker(args) -> int:
    import torch

    import blocksparse_fa as bsfa

    cfg = json.loads(args.config)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg["dtype"]]
    B, H, Hkv, D = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    torch.manual_seed(0)
    q = torch.randn(B, H, cfg["q_len"], D, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(B, Hkv, cfg["kv_len"], D, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(B, Hkv, cfg["kv_len"], D, device="cuda", dtype=dt, requires_grad=True)
    dout = torch.randn_like(q)
    layout = _layout(cfg, device="cuda")
    opts = _bwd_variant_options(cfg.get("bwd_variant", "default"))
    if cfg.get("kernels", "triton") == "triton":
        opts.update(forward="triton", backward="triton")
    choices = []
    if args.impl == "ours":
        from blocksparse_fa.ops import select

        def fwd():
            return bsfa.attention(q, k, v, mask=layout, kernel_options=opts)
    elif args.impl == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        bm = _flex_block_mask(layout, cfg)
        flex = torch.compile(flex_attention, dynamic=False)
        gqa = {"enable_gqa": True} if H != Hkv else {}

        def fwd():
            return flex(q, k, v, block_mask=bm, **gqa)
    else:
        raise ValueError(f"unknown impl {args.impl!r}")

    def step():
        out = fwd()
        return torch.autograd.grad(out, (q, k, v), dout)

    if args.impl == "ours":  # the kernels both phases choose (the backward's are noted in autograd's thread)
        with select.record() as rec:
            step()
        choices[:] = rec
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    # ---- profiled window: one forward, marker, one backward ----
    torch.cuda.cudart().cudaProfilerStart()
    out = fwd()
    torch.cuda.synchronize()
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    del out

    # ---- timing outside the window (CUDA events, median) ----
    def timed(fn, reps):
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        ts.sort()
        return ts[len(ts) // 2]

    reps = args.reps
    t_fwd = timed(fwd, reps)
    t_step = timed(step, reps)
    res = dict(config=cfg, impl=args.impl, density=float(layout.density), time_fwd_ms=t_fwd,
               time_bwd_ms=max(0.0, t_step - t_fwd), time_fwd_bwd_ms=t_step, reps=reps,
               kernel_tiles=_kernel_tiles(cfg) if args.impl == "ours" else None,
               torch=torch.__version__, gpu=torch.cuda.get_device_name(), marker=hasattr(torch.cuda, "_sleep"),
               l2_bytes=int(torch.cuda.get_device_properties(0).L2_cache_size),
               sms=int(torch.cuda.get_device_properties(0).multi_processor_count))
    if args.impl == "ours":
        res["choices"] = [list(c) for c in dict.fromkeys(tuple(c) for c in choices)]
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        pass
    if args.impl == "ours":
        res["kernel_resources"] = _kernel_resources()
    with open(args.result, "w") as f:
        json.dump(res, f, indent=1)
    return 0


def _kernel_resources() -> dict:
    """Registers, local memory (register spills) per thread, warps and shared memory of every
    compiled variant of our kernels in this process (one configuration per worker process, so these
    are the variants it ran). Register spills go to local memory, whose traffic the model does not count."""
    from blocksparse_fa import kernels

    out = {}
    for name in ("_attn_fwd", "_attn_bwd", "_attn_bwd_preprocess"):
        fn = getattr(kernels, name)
        rows = []
        try:
            for cache in getattr(fn, "device_caches", {}).values():
                for ck in cache[0].values():
                    ck._init_handles()
                    # n_spills is CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES / 4 (Triton's driver)
                    rows.append(dict(regs=int(ck.n_regs), local_bytes_per_thread=4 * int(ck.n_spills),
                                     warps=int(ck.metadata.num_warps), shared=int(ck.metadata.shared)))
        except Exception as e:  # the compiled-kernel API moves between Triton versions
            rows.append({"error": f"{type(e).__name__}: {e}"})
        out[name] = rows
    return out


# ================================================================================================
# ncu CSV
# ================================================================================================
_UNITS = {
    "byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30,
    "sector": 1, "ksector": 1e3, "msector": 1e6, "gsector": 1e9,
    "nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9,
    "cycle": 1, "": 1,
}


def _number(text: str, unit: str = "") -> float:
    t = (text or "").strip().replace("\u202f", "").replace(" ", "")
    if t in ("", "n/a", "N/A"):
        return float("nan")
    try:
        x = float(t)
    except ValueError:
        x = float(t.replace(",", ""))
    u = (unit or "").strip().lower()
    if u not in _UNITS:
        raise ValueError(f"unknown ncu unit {unit!r}")
    return x * _UNITS[u]


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels of an ncu CSV export (``--page raw`` with a units row, or ``--page details``),
    in launch order: ``{id, name, grid, block, dram_read, dram_write, l2_read, time_ns}`` with bytes
    and nanoseconds (``l2_read`` = L2 sectors read by the SMs × 32)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header (a line starting with \"ID\") found")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = rows[0]
    col = {h: i for i, h in enumerate(header)}
    per_id: dict = {}

    def entry(row):
        kid = int(row[col["ID"]])
        e = per_id.setdefault(kid, {"id": kid, "name": row[col["Kernel Name"]],
                                    "grid": row[col["Grid Size"]] if "Grid Size" in col else "",
                                    "block": row[col["Block Size"]] if "Block Size" in col else "", "metrics": {}})
        return e

    if "Metric Name" in col:  # details page: one row per (kernel, metric)
        for row in rows[1:]:
            if len(row) < len(header) or not row[col["ID"]].strip().isdigit():
                continue
            e = entry(row)
            e["metrics"][row[col["Metric Name"]]] = _number(row[col["Metric Value"]], row[col["Metric Unit"]])
    else:  # raw page: one row per kernel, a units row first
        units = [""] * len(header)
        for row in rows[1:]:
            if len(row) < len(header):
                continue
            if not row[col["ID"]].strip().isdigit():
                units = row
                continue
            e = entry(row)
            for m in METRICS + OPTIONAL_METRICS:
                if m in col:
                    e["metrics"][m] = _number(row[col[m]], units[col[m]])
    out = []
    for kid in sorted(per_id):
        e = per_id[kid]
        m = e.pop("metrics")
        slice_bytes = m.get("lts__t_sectors_srcunit_tex_op_read.sum", float("nan")) * SECTOR_BYTES
        xbar = m.get("l1tex__m_xbar2l1tex_read_bytes.sum", float("nan"))
        e.update(local_ld_miss=m.get("l1tex__t_sectors_pipe_lsu_mem_local_op_ld_lookup_miss.sum",
                                     float("nan")) * SECTOR_BYTES,
                 dram_read=m.get("dram__bytes_read.sum", float("nan")),
                 dram_write=m.get("dram__bytes_write.sum", float("nan")),
                 l2_read=xbar if not math.isnan(xbar) else slice_bytes, l2_read_slice=slice_bytes,
                 l2_counter="xbar" if not math.isnan(xbar) else "slice",
                 time_ns=m.get("gpu__time_duration.sum", float("nan")))
        for key, name in (("sm_write", "lts__t_sectors_srcunit_tex_op_write.sum"),
                          ("sm_red", "lts__t_sectors_srcunit_tex_op_red.sum")):
            if name in m:
                e[key] = m[name] * SECTOR_BYTES
        out.append(e)
    return out


def split_phases(kernels: list[dict], impl: str, by_name: bool = True) -> dict:
    """``{"fwd": [...], "bwd": [...]}``: ours by kernel name (``by_name``, a run filtered to the
    Triton kernels); otherwise by the marker kernel between the forward and the backward
    (everything before it is forward)."""
    if impl == "ours" and by_name:
        fwd = [k for k in kernels if re.search(r"_attn_fwd", k["name"])]
        bwd = [k for k in kernels if re.search(r"_attn_bwd", k["name"])]
        return {"fwd": fwd, "bwd": bwd}
    idx = next((i for i, k in enumerate(kernels) if MARKER_RE.search(k["name"])), None)
    if idx is None:
        return {"fwd": [], "bwd": [], "unsplit": [k for k in kernels]}
    return {"fwd": kernels[:idx], "bwd": [k for k in kernels[idx + 1:] if not MARKER_RE.search(k["name"])]}


def _sum(kernels: list[dict]) -> dict:
    keys = ("dram_read", "dram_write", "l2_read", "time_ns")
    out = {k: float(sum(x[k] for x in kernels)) for k in keys} | {"n_kernels": len(kernels)}
    if kernels and all("l2_read_slice" in x for x in kernels):
        out["l2_read_slice"] = float(sum(x["l2_read_slice"] for x in kernels))
        out["l2_counter"] = "xbar" if all(x.get("l2_counter") == "xbar" for x in kernels) else "slice"
    if kernels and all("local_ld_miss" in x for x in kernels):
        out["local_ld_miss"] = float(sum(x["local_ld_miss"] for x in kernels))
    for key in ("sm_write", "sm_red"):
        if kernels and all(key in x for x in kernels):
            out[key] = float(sum(x[key] for x in kernels))
    return out


def _available_metrics(ncu: str) -> tuple:
    """METRICS and those of OPTIONAL_METRICS this GPU's ncu knows (``--query-metrics``)."""
    q = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True)
    known = set(re.findall(r"^(\w+)", q.stdout, flags=re.M)) if q.returncode == 0 else set()
    return METRICS + tuple(m for m in OPTIONAL_METRICS if m.rsplit(".", 1)[0] in known)


def infer_tiles(kernels: list[dict], cfg: dict) -> dict:
    """Program-granularity tile sizes from our kernels' grid x dimension (grid = (tiles, batch·heads))."""
    out = {}
    for k in kernels:
        m = OURS_RE.search(k["name"])
        g = re.findall(r"\d+", k.get("grid", ""))
        if not m or not g:
            continue
        gx = int(g[0])
        length = cfg["kv_len"] if m.group(1) == "bwd_dkdv" else cfg["q_len"]
        tile = 1 << max(0, math.ceil(math.log2(max(1, length / gx))))
        if -(-length // tile) == gx and cfg["block"] % tile == 0:
            key = {"fwd": "fwd_block_m", "bwd_dkdv": "dkdv_block_n", "bwd_dq": "dq_block_m",
                   "bwd_preprocess": "preprocess_block_m"}[m.group(1)]
            out[key] = tile
    return out


# ================================================================================================
# driver
# ================================================================================================
def _data_path(docs: str, regime: str) -> str:
    return os.path.join(docs, "data", f"traffic_{regime}.json")


REPO_DOCS = os.path.join(REPO, "docs")


def _write_root(args) -> str:
    """Where results are written: ``--docs`` if given, ``docs/`` with ``--update-docs``, else ``--out``."""
    return args.docs or (REPO_DOCS if getattr(args, "update_docs", False) else args.out)


def run_driver(args) -> int:
    ncu = shutil.which(args.ncu) or (args.ncu if os.path.exists(args.ncu) else None)
    if ncu is None:
        print(f"error: ncu not found ({args.ncu!r}); pass --ncu /path/to/ncu", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    root = _write_root(args)
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    ver = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    metrics = _available_metrics(ncu)
    for regime in args.regimes.split(","):
        path = _data_path(root, regime)
        data = {"regime": regime, "synthetic": False, "ncu": ver[-1] if ver else "", "metrics": list(metrics),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": []}
        if args.append and os.path.exists(path):  # a second pass (other implementations) adds its runs
            with open(path) as f:
                data = json.load(f)
        names = set(args.names.split(",")) if args.names else None
        for cfg in regime_configs(regime, args.quick):
            if names is not None and cfg["name"] not in names:
                continue
            if args.bwd_variant != "default":
                cfg = dict(cfg, bwd_variant=args.bwd_variant)
            for impl in args.impls.split(","):
                tag = f"{regime}_{cfg['name']}_{impl}" + ("" if args.bwd_variant == "default" else f"_{args.bwd_variant}")
                rep = os.path.join(out, tag)
                wres = os.path.join(out, tag + ".worker.json")
                cmd = [ncu, "--clock-control", "none", "--cache-control", "all", "--profile-from-start", "off",
                       "--target-processes", "all", "-c", str(args.max_kernels), "--metrics", ",".join(metrics),
                       "-f", "-o", rep]
                by_name = impl == "ours" and cfg["kernels"] == "triton"  # else every kernel, split at the marker
                if by_name:
                    cmd += ["-k", args.kernel_regex]
                cmd += [sys.executable, os.path.abspath(__file__), "worker", "--config", json.dumps(cfg),
                        "--impl", impl, "--result", wres, "--reps", str(args.reps)]
                t0 = time.time()
                print(f"[{tag}] profiling ...", flush=True)
                with open(os.path.join(out, tag + ".log"), "w") as log:
                    log.write(" ".join(cmd) + "\n")
                    log.flush()
                    try:
                        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            timeout=args.timeout).returncode
                    except subprocess.TimeoutExpired:
                        rc = "timeout"
                run = {"config": cfg, "impl": impl, "rc": rc, "wall_s": round(time.time() - t0, 1), "tag": tag}
                if rc == 0 and os.path.exists(rep + ".ncu-rep"):
                    exp = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--csv", "--page", "raw",
                                          "--print-units", "base"], capture_output=True, text=True)
                    with open(os.path.join(out, tag + ".csv"), "w") as f:
                        f.write(exp.stdout)
                    try:
                        kernels = parse_ncu_csv(exp.stdout)
                        phases = split_phases(kernels, impl, by_name)
                        run.update(kernels=kernels, fwd=_sum(phases["fwd"]), bwd=_sum(phases["bwd"]),
                                   total=_sum(kernels if by_name else
                                              [k for k in kernels if not MARKER_RE.search(k["name"])]),
                                   split_ok="unsplit" not in phases)
                        if impl == "ours":
                            run["tiles_from_grid"] = infer_tiles(kernels, cfg)
                    except ValueError as e:
                        run["error"] = f"CSV parse: {e}"
                if os.path.exists(wres):
                    with open(wres) as f:
                        run["worker"] = json.load(f)
                status = "ok" if "kernels" in run else f"FAILED (rc={rc}, see {os.path.join(out, tag + '.log')})"
                print(f"[{tag}] {status} in {run['wall_s']} s", flush=True)
                data["runs"].append(run)
                with open(path, "w") as f:
                    json.dump(data, f, indent=1)
        print(f"wrote {path}")
    if not args.no_report:
        return report(argparse.Namespace(docs=root, out=root, l2_mb=args.l2_mb, sms=args.sms, occupancy=args.occupancy,
                                         policy=args.policy, order=args.order, l2_partitions=args.l2_partitions))
    return 0


# ================================================================================================
# model + report
# ================================================================================================
def _model(cfg: dict, tiles: dict, l2_mb: float, sms: int, occupancy, policy: str, order: str = "heavy_first",
           partitions: int = 2):
    from blocksparse_fa.analysis.traffic import TileSizes, TrafficParams, traffic_model
    from blocksparse_fa.cli.traffic import _occupancy

    if isinstance(occupancy, str):
        occupancy = _occupancy(occupancy)
    t = TileSizes(**{k: v for k, v in tiles.items() if k in TileSizes.__dataclass_fields__})
    p = TrafficParams(batch=cfg["batch"], heads=cfg["heads"], kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
                      dtype=cfg["dtype"], tiles=t, l2_bytes=int(l2_mb * 2**20), n_sm=sms, occupancy=occupancy,
                      policy=policy, program_order=order,
                      bwd_fused=not cfg.get("bwd_variant", "default").endswith("two_launch"),
                      l2_partitions=partitions, kernels=cfg.get("kernels", "triton"))
    return traffic_model(_layout(cfg), p, compare=False)


def _tiles_for(run: dict) -> dict:
    tiles = {}
    wt = (run.get("worker") or {}).get("kernel_tiles")
    if wt:
        tiles.update(wt)
    tiles.update(run.get("tiles_from_grid") or {})
    return tiles


def synth(args) -> int:
    """Synthetic measurements: model × (1 + noise); flex = ours × 1.1. For testing ``report`` only."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    root = _write_root(args)
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    for regime in args.regimes.split(","):
        data = {"regime": regime, "synthetic": True, "ncu": "synthetic", "metrics": list(METRICS), "runs": []}
        for cfg in regime_configs(regime, args.quick):
            rep = _model(cfg, _kernel_tiles(cfg) or {}, 50, 132, 1, "fraction")
            for impl in IMPLS:
                f = 1.0 if impl == "ours" else 1.1

                def meas(kernels, time_ms):
                    noise = 1 + 0.03 * rng.standard_normal()
                    return {"dram_read": sum(k.dram_read_bytes for k in kernels) * f * noise,
                            "dram_write": sum(k.dram_write_bytes for k in kernels) * f,
                            "l2_read": sum(k.l2_to_sm_bytes for k in kernels) * f * (1 + 0.02 * rng.standard_normal()),
                            "time_ns": time_ms * 1e6, "n_kernels": len(kernels)}

                tf = 0.02 + 6.0 * rep.density * f
                tb = 0.05 + 15.0 * rep.density * f
                fwd, bwd = meas([rep.forward], tf), meas([rep.bwd_preprocess, rep.bwd_dkdv, rep.bwd_dq], tb)
                data["runs"].append({"config": cfg, "impl": impl, "rc": 0, "fwd": fwd, "bwd": bwd,
                                     "tiles_from_grid": _kernel_tiles(cfg) or {},
                                     "total": {k: fwd[k] + bwd[k] for k in fwd}, "split_ok": True,
                                     "worker": {"density": rep.density, "time_fwd_ms": tf, "time_bwd_ms": tb},
                                     "kernels": []})
        path = _data_path(root, regime)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {path} (SYNTHETIC)")
    return 0


def _fit(x, y):
    from blocksparse_fa.analysis.iosim import linear_fit

    import numpy as np

    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3:
        return None
    return linear_fit(x[ok], y[ok])


def _fmt_fit(f, scale=1e9, unit="GB"):
    if f is None:
        return "n/a"
    return f"{f[0] / scale:.4g} {unit}·s + {f[1] / scale:.4g} {unit} (R² = {f[2]:.4f})"


def _gb(x):
    return "n/a" if x is None or x != x else f"{x / 1e9:.4g}"


def _sm_l2(phase: dict):
    """Bytes the SMs wrote into L2 (stores and reductions), where the run measured them."""
    if "sm_write" not in phase:
        return None
    return phase["sm_write"] + phase.get("sm_red", 0.0)


def _pct(a, b):
    return "n/a" if a is None or b in (None, 0) or a != a or b != b else f"{100 * (a / b - 1):+.1f}%"


def report(args) -> int:
    import numpy as np

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = args.docs or REPO_DOCS  # the measurements are read from here
    docs = _write_root(args)  # traffic.md and the plots are written here
    os.makedirs(docs, exist_ok=True)
    sections = []
    any_data = False
    for regime in REGIMES:
        path = _data_path(src, regime)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            data = json.load(f)
        any_data = True
        synthetic = bool(data.get("synthetic"))
        runs = [r for r in data["runs"] if "fwd" in r]
        names = list(dict.fromkeys(r["config"]["name"] for r in runs))
        rows = []
        for name in names:
            by = {r["impl"]: r for r in runs if r["config"]["name"] == name}
            ref = by.get("ours") or next(iter(by.values()))
            cfg = ref["config"]
            tiles = _tiles_for(ref)
            w0 = ref.get("worker") or {}
            l2_mb = w0["l2_bytes"] / 2**20 if w0.get("l2_bytes") else args.l2_mb  # the measured GPU's L2
            mdl = _model(cfg, tiles, l2_mb, w0.get("sms") or args.sms, args.occupancy, args.policy, args.order,
                         args.l2_partitions)
            row = {"name": name, "mask": cfg["mask"], "s": mdl.density, "tiles": tiles, "choice": mdl.choice,
                   "gpu": w0.get("gpu", ""), "l2_mb": l2_mb, "ran": w0.get("choices"),
                   "model": {"fwd_l2": mdl.fwd.l2_to_sm_bytes, "bwd_l2": mdl.bwd.l2_to_sm_bytes,
                             "fwd_dram": mdl.fwd.dram_read_bytes, "bwd_dram": mdl.bwd.dram_read_bytes,
                             "fwd_wr": mdl.fwd.dram_write_bytes, "bwd_wr": mdl.bwd.dram_write_bytes,
                             "fwd_sm_l2": mdl.fwd.sm_to_l2_bytes, "bwd_sm_l2": mdl.bwd.sm_to_l2_bytes,
                             "fwd_comp": mdl.fwd.compulsory_read_bytes, "bwd_comp": mdl.bwd.compulsory_read_bytes,
                             "fwd_fits": mdl.forward.fits_l2,
                             "bwd_fits": mdl.bwd_dkdv.fits_l2 and mdl.bwd_dq.fits_l2}}
            for impl in IMPLS:
                r = by.get(impl)
                if r is None:
                    continue
                w = r.get("worker") or {}
                row[impl] = {"fwd_l2": r["fwd"]["l2_read"], "bwd_l2": r["bwd"]["l2_read"],
                             "fwd_dram": r["fwd"]["dram_read"], "bwd_dram": r["bwd"]["dram_read"],
                             "fwd_wr": r["fwd"]["dram_write"], "bwd_wr": r["bwd"]["dram_write"],
                             "fwd_sm_l2": _sm_l2(r["fwd"]), "bwd_sm_l2": _sm_l2(r["bwd"]),
                             "fwd_ms": w.get("time_fwd_ms", r["fwd"]["time_ns"] / 1e6),
                             "bwd_ms": w.get("time_bwd_ms", r["bwd"]["time_ns"] / 1e6),
                             "fwd_ncu_ms": r["fwd"]["time_ns"] / 1e6, "bwd_ncu_ms": r["bwd"]["time_ns"] / 1e6,
                             "fwd_spill": r["fwd"].get("local_ld_miss"), "bwd_spill": r["bwd"].get("local_ld_miss")}
            rows.append(row)
        rows.sort(key=lambda r: r["s"])
        if not rows:
            sections.append(f"### Regime `{regime}`\n\nNo successful runs in `{path}` (see the logs of the run).\n")
            continue
        s = np.array([r["s"] for r in rows])

        def col(impl, key):
            return np.array([r[impl][key] if impl in r else np.nan for r in rows], dtype=float)

        # ---- plot ----
        fig, axes = plt.subplots(1, 3, figsize=(18, 5))
        tag = " [SYNTHETIC DATA]" if synthetic else ""
        cfg0 = runs[0]["config"]
        title = (f"{regime}: N={cfg0['q_len']} B={cfg0['batch']} H={cfg0['heads']} d={cfg0['head_dim']} "
                 f"{cfg0['dtype']}{tag}")
        fits = {}
        for phase, mk, colr in (("fwd", "o", "tab:blue"), ("bwd", "s", "tab:red")):
            ax = axes[0]
            ml = np.array([r["model"][f"{phase}_l2"] for r in rows])
            ax.plot(s, ml / 1e9, "-", lw=1.2, color=colr, label=f"model {phase}")
            for impl, fill in (("ours", "full"), ("flex", "none")):
                y = col(impl, f"{phase}_l2")
                if np.isfinite(y).any():
                    f = fits[(impl, phase, "l2")] = _fit(s, y)
                    ax.plot(s, y / 1e9, mk, color=colr, fillstyle=fill, ls="none",
                            label=f"{impl} {phase}" + (f" (fit R²={f[2]:.4f})" if f else ""))
            ax = axes[1]
            md = np.array([r["model"][f"{phase}_dram"] for r in rows])
            mc = np.array([r["model"][f"{phase}_comp"] for r in rows])
            ax.plot(s, md / 1e9, "-", lw=1.2, color=colr, label=f"model {phase}")
            ax.plot(s, mc / 1e9, ":", lw=1, color=colr, label=f"compulsory {phase}")
            for impl, fill in (("ours", "full"), ("flex", "none")):
                y = col(impl, f"{phase}_dram")
                if np.isfinite(y).any():
                    fits[(impl, phase, "dram")] = _fit(s, y)
                    ax.plot(s, y / 1e9, mk, color=colr, fillstyle=fill, ls="none", label=f"{impl} {phase}")
            ax = axes[2]
            for impl, fill, ls in (("ours", "full", "-"), ("flex", "none", "--")):
                y = col(impl, f"{phase}_ms")
                if np.isfinite(y).any():
                    sel = s >= 0.02
                    f = fits[(impl, phase, "time")] = _fit(s[sel], y[sel])
                    ax.plot(s, y, mk, color=colr, fillstyle=fill, ls="none",
                            label=f"{impl} {phase}" + (f" (fit s≥0.02, R²={f[2]:.4f})" if f else ""))
                    if f:
                        xs = np.linspace(0, 1, 20)
                        ax.plot(xs, f[0] * xs + f[1], ls, lw=0.8, color=colr)
        if s.min() < 0.01:
            axes[1].set_xscale("log")
        for ax, lab in zip(axes, ("L2 → SM bytes (GB)", "DRAM read bytes (GB)", "time (ms, CUDA events)")):
            ax.set_xlabel("block density s")
            ax.set_ylabel(lab)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        xbar = all(r[ph].get("l2_counter") == "xbar" for r in runs for ph in ("fwd", "bwd"))
        axes[0].set_title("L2 → SM (l1tex__m_xbar2l1tex_read_bytes)" if xbar
                          else "L2 → SM (lts__t_sectors_srcunit_tex_op_read × 32)")
        axes[1].set_title(f"DRAM read (dram__bytes_read); model: {args.policy}, L2 = {args.l2_mb:g} MiB"
                          + (f" in {args.l2_partitions} partitions" if args.policy == "trace" else ""))
        axes[2].set_title("time")
        fig.suptitle(title)
        fig.tight_layout()
        png = os.path.join(docs, f"traffic_{regime}.png")
        fig.savefig(png, dpi=110)
        plt.close(fig)

        # ---- markdown ----
        L = [f"### Regime `{regime}`{tag}", "",
             f"{title.split(': ', 1)[1]}; {rows[0]['gpu'] or 'GPU not recorded (the H100)'}; raw data "
             f"`docs/data/traffic_{regime}.json`; ncu {data.get('ncu', '')}.", "",
             f"![{regime}](traffic_{regime}.png)", "",
             "| pattern | s | phase | model L2→SM GB | ours L2→SM GB | err | flex L2→SM GB | model DRAM rd GB | "
             "ours DRAM rd GB | err | flex DRAM rd GB | model DRAM wr GB | ours DRAM wr GB | err | model in L2 | "
             "ours ms | flex ms | ours spill reloads GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        checks = {"l2_within_10pct": True, "dram_within_15pct": True, "ours_le_flex_l2": True,
                  "ours_le_flex_dram": True}
        dram_fail, dram_err, nospill_err, nospill_vs_flex = [], [], [], []
        for r in rows:
            for phase in ("fwd", "bwd"):
                m = r["model"]
                o = r.get("ours", {})
                fl = r.get("flex", {})
                ol, od = o.get(f"{phase}_l2"), o.get(f"{phase}_dram")
                if ol is not None and abs(ol / m[f"{phase}_l2"] - 1) > 0.10:
                    checks["l2_within_10pct"] = False
                if od is not None:
                    dram_err.append((od / m[f"{phase}_dram"] - 1, r["mask"], phase))
                if od is not None and abs(od / m[f"{phase}_dram"] - 1) > 0.15:
                    checks["dram_within_15pct"] = False
                    dram_fail.append(f"`{r['mask']}` {phase} {_pct(od, m[f'{phase}_dram'])}")
                sp = o.get(f"{phase}_spill")
                if ol is not None and sp is not None and sp == sp:
                    nospill_err.append((ol - sp) / m[f"{phase}_l2"] - 1)
                    if fl.get(f"{phase}_l2") is not None:
                        nospill_vs_flex.append(ol - sp - fl[f"{phase}_l2"])
                if ol is not None and fl.get(f"{phase}_l2") is not None and ol > fl[f"{phase}_l2"]:
                    checks["ours_le_flex_l2"] = False
                if od is not None and fl.get(f"{phase}_dram") is not None and od > fl[f"{phase}_dram"]:
                    checks["ours_le_flex_dram"] = False
                fms = fl.get(f"{phase}_ms")
                L.append(f"| `{r['mask']}` | {r['s']:.4f} | {phase} | {_gb(m[f'{phase}_l2'])} | {_gb(ol)} | "
                         f"{_pct(ol, m[f'{phase}_l2'])} | {_gb(fl.get(f'{phase}_l2'))} | {_gb(m[f'{phase}_dram'])} | "
                         f"{_gb(od)} | {_pct(od, m[f'{phase}_dram'])} | {_gb(fl.get(f'{phase}_dram'))} | "
                         f"{_gb(m[f'{phase}_wr'])} | {_gb(o.get(f'{phase}_wr'))} | {_pct(o.get(f'{phase}_wr'), m[f'{phase}_wr'])} | "
                         f"{'yes' if m[f'{phase}_fits'] else 'no'} | "
                         f"{o.get(f'{phase}_ms', float('nan')):.3f} | {'n/a' if fms is None else f'{fms:.3f}'} | "
                         f"{_gb(o.get(f'{phase}_spill'))} |")
        L += ["", "Linear fits vs s (slope, intercept, R²):", ""]
        for (impl, phase, what), f in sorted(fits.items()):
            unit = ("ms", 1.0) if what == "time" else ("GB", 1e9)
            rng_note = " (s ≥ 0.02)" if what == "time" else ""
            L.append(f"- {impl} {phase} {what}{rng_note}: {_fmt_fit(f, unit[1], unit[0])}")
        r2_l2 = [fits.get(("ours", ph, "l2")) for ph in ("fwd", "bwd")]
        r2_t = [fits.get(("ours", ph, "time")) for ph in ("fwd", "bwd")]
        # crossover: first s where DRAM exceeds compulsory by > 15 %, model vs measurement
        cross = []
        for phase in ("fwd", "bwd"):
            ms = next((r["s"] for r in rows if r["model"][f"{phase}_dram"] > 1.15 * r["model"][f"{phase}_comp"]), None)
            me = next((r["s"] for r in rows if "ours" in r and
                       r["ours"][f"{phase}_dram"] > 1.15 * r["model"][f"{phase}_comp"]), None)
            cross.append(f"{phase}: model {'none' if ms is None else f's = {ms:.4f}'}, measured "
                         f"{'none' if me is None else f's = {me:.4f}'}")
        worst = max(dram_err, key=lambda e: abs(e[0]), default=None)

        def largest(key):
            errs = [(r["ours"][f"{ph}_{key}"] / r["model"][f"{ph}_{key}"] - 1, r["mask"], ph) for r in rows
                    for ph in ("fwd", "bwd") if r.get("ours", {}).get(f"{ph}_{key}") is not None
                    and r["model"][f"{ph}_{key}"]]
            e = max(errs, key=lambda x: abs(x[0]), default=None)
            return "n/a" if e is None else f"{e[0] * 100:+.1f} % (`{e[1]}` {e[2]})"
        L += ["", "How the model and the measurement agree (computed from the data above):", "",
              f"- L2→SM within ±10 % of the model at every point: {'PASS' if checks['l2_within_10pct'] else 'FAIL'}",
              "- L2→SM linear in s with R² ≥ 0.99 (ours fwd, bwd): "
              + ", ".join("n/a" if f is None else f"{f[2]:.4f} {'PASS' if f[2] >= 0.99 else 'FAIL'}" for f in r2_l2),
              f"- DRAM within ±15 % of the model: {'PASS' if checks['dram_within_15pct'] else 'FAIL'}"
              + (f" (outside: {', '.join(dram_fail)})" if dram_fail else ""),
              "- DRAM reads, largest deviation from the model: "
              + ("n/a" if worst is None else f"{worst[0] * 100:+.1f} % (`{worst[1]}` {worst[2]})"),
              f"- DRAM writes, largest deviation from the model: {largest('wr')}",
              f"- SM → L2 (stores and reductions), largest deviation from the model: {largest('sm_l2')}",
              f"- DRAM crossover (first s with DRAM > 1.15 × compulsory): {'; '.join(cross)}",
              "- time linear in s, R² ≥ 0.98 for s ≥ 0.02 (ours fwd, bwd): "
              + ", ".join("n/a" if f is None else f"{f[2]:.4f} {'PASS' if f[2] >= 0.98 else 'FAIL'}" for f in r2_t),
              f"- ours ≤ FlexAttention bytes at every s: L2→SM {'PASS' if checks['ours_le_flex_l2'] else 'FAIL'}, "
              f"DRAM {'PASS' if checks['ours_le_flex_dram'] else 'FAIL'}"]
        if nospill_err:
            L += ["- ours' L2→SM bytes without its spill reloads (local-memory loads that miss L1, "
                  "`l1tex__t_sectors_pipe_lsu_mem_local_op_ld_lookup_miss` × 32): within "
                  f"{max(abs(x) for x in nospill_err) * 100:.2f} % of the model at every point"
                  + (f"; at most {max(nospill_vs_flex) / 1e6:+.1f} MB vs FlexAttention's" if nospill_vs_flex else "")]
        kinds = sorted({" / ".join(r["choice"]) for r in rows})
        ran = sorted({" / ".join(c[1] for c in r["ran"]) for r in rows if r.get("ran")})
        L += [f"- kernels (forward / backward) the model follows: {', '.join(kinds)}"
              + (f"; the runs recorded: {', '.join(ran)}" if ran else ""),
              f"- model: tiles {rows[0]['tiles'] or 'defaults (TileSizes())'}; L2 {rows[0]['l2_mb']:g} MiB, {args.sms} SMs, "
              f"occupancy {args.occupancy}, policy {args.policy}"
              + (f" ({args.l2_partitions} L2 partition{'s' if args.l2_partitions > 1 else ''}, step time "
                 "dK/dV 1.6 × dQ)" if args.policy == "trace" else "")
              + f", program order {args.order}", ""]
        sections.append("\n".join(L))
    if not any_data:
        print(f"no data in {os.path.join(src, 'data')} (run the 'run' mode on a GPU first)", file=sys.stderr)
        return 1
    body = "\n".join(sections)
    md = os.path.join(docs, "traffic.md")
    base = md if os.path.exists(md) else os.path.join(REPO_DOCS, "traffic.md")
    if os.path.exists(base):
        with open(base) as f:
            text = f.read()
    else:
        text = f"# Memory traffic\n\n## GPU measurements\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip() + f"\n\n## GPU measurements\n\n{BEGIN}\n{END}\n"
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    text = text[:a] + "\n" + body + "\n" + text[b:]
    with open(md, "w") as f:
        f.write(text)
    print(f"wrote {md} and docs/traffic_<regime>.png under {docs}")
    return 0


def list_configs(args) -> int:
    print(f"model tiles (the kernels' config): {_kernel_tiles(regime_configs('inl2')[0]) or 'defaults'}; "
          f"order {args.order}, policy {args.policy}, L2 {args.l2_mb:g} MiB")
    for regime in args.regimes.split(","):
        print(f"== {regime} ==")
        for cfg in regime_configs(regime, args.quick):
            rep = _model(cfg, _kernel_tiles(cfg) or {}, args.l2_mb, args.sms, args.occupancy, args.policy, args.order,
                         args.l2_partitions)
            f, b = rep.fwd, rep.bwd
            print(f"  {cfg['name']:<8} {cfg['mask']:<28} s={rep.density:.4f}  model fwd L2->SM "
                  f"{f.l2_to_sm_bytes / 1e9:7.3f} GB DRAM rd {f.dram_read_bytes / 1e9:6.3f} GB | bwd L2->SM "
                  f"{b.l2_to_sm_bytes / 1e9:7.3f} GB DRAM rd {b.dram_read_bytes / 1e9:6.3f} GB")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)

    def model_args(p, out=True):
        p.add_argument("--docs", default=None,
                       help="docs tree to read data/ from and write into (default: read <repo>/docs/data, "
                            "write --out)")
        p.add_argument("--update-docs", action="store_true", help="write into <repo>/docs")
        if out:
            p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "bsfa_bench",
                                                                                   "traffic"),
                           help="folder for the results (default $OUT or <tmp>/bsfa_bench/traffic)")
        p.add_argument("--l2-mb", type=float, default=50.0, help="L2 capacity for the model (MiB)")
        p.add_argument("--sms", type=int, default=132)
        p.add_argument("--occupancy", default="1",
                       help="programs per SM for the model: N or fwd=1,bwd_dkdv=2,bwd_dq=2 (default 1)")
        p.add_argument("--policy", default="trace", choices=["fraction", "lru", "trace"],
                       help="DRAM model: trace-driven simulation of the L2 (trace, the default; the backward as "
                            "one launch, as _attn_bwd runs it) or the wave model (lru, fraction)")
        p.add_argument("--l2-partitions", type=int, default=2, choices=[1, 2],
                       help="trace: the H100's two L2 partitions with near copies (2, default) or one LRU (1)")
        p.add_argument("--order", default="heavy_first", choices=["grid", "heavy_first"],
                       help="program order for the model (default heavy_first: the kernels' work lists)")

    p = sub.add_parser("run", help="profile every configuration under ncu, then report")
    p.add_argument("--out", required=True, help="directory for ncu reports, CSVs and logs")
    p.add_argument("--ncu", default="ncu")
    p.add_argument("--regimes", default=",".join(REGIMES))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--kernel-regex", default="regex:_attn", help="ncu -k filter for our kernels")
    p.add_argument("--max-kernels", type=int, default=16, help="ncu -c: at most this many kernels per run")
    p.add_argument("--reps", type=int, default=10, help="timing repetitions (outside the profiled window)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per ncu run")
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--no-report", action="store_true")
    p.add_argument("--names", default=None, help="only these configurations (comma-separated, e.g. dense,causal)")
    p.add_argument("--bwd-variant", default="default", choices=BWD_VARIANTS,
                   help="backward experiment: spill-free tiles and/or two launches (ours only)")
    p.add_argument("--append", action="store_true",
                   help="add to the regime's existing JSON instead of starting it again (a second pass)")
    model_args(p, out=False)
    p.set_defaults(func=run_driver)

    p = sub.add_parser("worker", help="(internal) one configuration under ncu")
    p.add_argument("--config", required=True)
    p.add_argument("--impl", required=True, choices=IMPLS)
    p.add_argument("--result", required=True)
    p.add_argument("--reps", type=int, default=10)
    p.set_defaults(func=worker)

    p = sub.add_parser("report", help="plots and traffic.md from docs/data/traffic_*.json")
    model_args(p)
    p.set_defaults(func=report)

    p = sub.add_parser("synth", help="synthetic data for testing the report (never a measurement)")
    p.add_argument("--regimes", default=",".join(REGIMES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    model_args(p)
    p.set_defaults(func=synth)

    p = sub.add_parser("list", help="configurations and model predictions")
    p.add_argument("--regimes", default=",".join(REGIMES))
    p.add_argument("--quick", action="store_true")
    model_args(p)
    p.set_defaults(func=list_configs)

    args = ap.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
