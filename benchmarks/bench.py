"""GPU benchmark: ours beside FlashAttention-4, FlexAttention (Triton and FLASH backends) and cuDNN.

For every mask and shape, on the same random inputs in one run (``harness.run_case``): ours eager
(``bsfa.attention``), ours under ``torch.compile(fullgraph=True)`` (the mask built outside the
compiled function), FA4 where it can express the mask (dense, causal, sliding window through
``window_size``, documents through ``flash_attn_varlen_func``), FlexAttention compiled with its
Triton kernel and with ``kernel_options={"BACKEND": "FLASH"}`` (``BlockMask`` built once per mask,
outside the timed region; Dynamo's recompile limits lifted and a fallback to eager an error), and
cuDNN SDPA (dense, causal). Forward and forward+backward times (``triton.testing.do_bench``,
median), TFLOP/s on kept elements, and every implementation's ``O, dQ, dK, dV`` against a float64
reference as a multiple of eager bf16's error. A peer that is missing or cannot express a mask is
reported with the reason and the run goes on.

Results go to ``--out`` (``bench.json`` after every case, ``bench.md`` and a plot at the end);
``docs/`` is written only with ``--update-docs`` (``docs/data/bench.json``, the generated part of
``docs/benchmarks.md``, the plots).

    PYTHONPATH=. python benchmarks/bench.py --out DIR --deadline 330        # default grid, meant for ~6 min
    PYTHONPATH=. python benchmarks/bench.py --out DIR --full                # 16K/64K x d 64/128 x MHA/GQA
    PYTHONPATH=. python benchmarks/bench.py --out DIR --masks causal document_causal --sizes 65536
    PYTHONPATH=. python benchmarks/bench.py --dry-run --out DIR             # CPU, tiny: the code paths
    PYTHONPATH=. python benchmarks/bench.py --report-only DIR/bench.json --update-docs
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import harness  # noqa: E402
import peers  # noqa: E402

# in run order: the masks every peer can express first
MASKS = ["causal", "document_causal", "sliding_window_1024", "dense", "longformer", "bigbird", "strided_256",
         "sinks_window_1024"]
PATTERNS = MASKS  # the name the experiments use
# text after this marker in docs/benchmarks.md is written by hand and kept when the page is regenerated
HAND_MARKER = "<!-- hand-written below: kept by bench.py -->"
DOCS = os.path.join(HERE, "..", "docs")
DEFAULT = dict(sizes=[16384], dims=[128], heads=16, kv_heads=[16, 4])
FULL = dict(sizes=[16384, 65536], dims=[64, 128], heads=16, kv_heads=[16, 4])
DRY = dict(sizes=[256], dims=[32], heads=4, kv_heads=[4, 2])


def default_out(name: str) -> str:
    """``$OUT`` when set, else a folder under the system's temporary directory."""
    return os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "bsfa_bench", name)


# ------------------------------------------------------------------------------------------------
# masks (also imported by the experiments: make_case, doc_ids)
# ------------------------------------------------------------------------------------------------
def doc_ids(n: int, seed: int = 0, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
    """Document id of every position: documents of 1024-4096 tokens (n/16-n/4 below 8K), in order."""
    lo = lo if lo is not None else (1024 if n >= 8192 else max(1, n // 16))
    hi = hi if hi is not None else (4096 if n >= 8192 else max(lo, n // 4))
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < n:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[:n]


def make_case(name: str, n: int, device="cuda"):
    """``(our mask, Flex mask_mod or None for dense)`` of the mask ``name`` at length ``n``."""
    import numpy as np

    import blocksparse_fa as bsfa

    if name == "dense":
        return bsfa.full(), None
    if name == "causal":
        return bsfa.causal(), lambda b, h, q, k: q >= k
    if name.startswith("sliding_window_"):  # sliding_window_W
        w = int(name.rsplit("_", 1)[1])
        return bsfa.sliding_window(w), lambda b, h, q, k: (q >= k) & (q - k < w)
    if name == "longformer":
        return bsfa.load_pattern("longformer"), lambda b, h, q, k: ((q - k).abs() <= 256) | (q < 64) | (k < 64)
    if name == "causal_longformer":  # the README's mask: 64 sinks and a causal window of 256
        return bsfa.parse("causal & (window(256) | global_tokens(64))"), \
            lambda b, h, q, k: (q >= k) & (((q - k) <= 256) | (k < 64))
    if name.startswith("sinks_window_"):  # 4 attention-sink tokens and a causal window of W (StreamingLLM)
        w = int(name.rsplit("_", 1)[1])
        return bsfa.load_pattern("streaming_llm", window=w), \
            lambda b, h, q, k: (q >= k) & ((q - k < w) | (k < 4))
    if name == "bigbird":
        m = bsfa.load_pattern("bigbird")
        rb = [leaf for leaf in m.leaves() if leaf.name == "random_blocks"][0]
        nb = -(-n // 128)
        grid = np.zeros((nb, nb), dtype=bool)
        np.put_along_axis(grid, rb.chosen(np.arange(nb), nb), True, axis=1)
        g = torch.from_numpy(grid).to(device)
        return m, lambda b, h, q, k: ((q - k).abs() <= 192) | (q < 128) | (k < 128) | g[q // 128, k // 128]
    if name.startswith("strided_"):
        s = int(name.rsplit("_", 1)[1])
        return bsfa.parse(f"causal & (sliding_window({s}) | strided({s}))"), \
            lambda b, h, q, k: (q >= k) & (((q - k) < s) | ((q - k) % s == 0))
    if name == "document_causal":
        ids = doc_ids(n)
        idg = ids.to(device)
        return bsfa.load_pattern("document_causal", document=ids), lambda b, h, q, k: (q >= k) & (idg[q] == idg[k])
    raise ValueError(f"unknown mask {name!r}; choose from {MASKS} (sliding_window_W, strided_S for any W, S)")


def fa4_form(name: str, n: int):
    """What FA4 runs for the mask (see ``harness.Case.fa4``), or why it cannot."""
    if name == "dense":
        return {"causal": False}
    if name == "causal":
        return {"causal": True}
    if name.startswith("sliding_window_"):
        return {"causal": True, "window": int(name.rsplit("_", 1)[1])}
    if name == "document_causal":
        return {"varlen": doc_ids(n)}
    if name == "longformer":
        return "n/a (no global tokens)"
    if name.startswith("sinks_window_") or name == "causal_longformer":
        return "n/a (no sink tokens)"
    if name == "bigbird":
        return "n/a (no global tokens, random blocks)"
    return "n/a (no strided mask)"


def build_case(name: str, n: int, d: int, h: int, hkv: int, device) -> harness.Case:
    mask, mod = make_case(name, n, device)
    cudnn = {"causal": name == "causal"} if name in ("dense", "causal") else "n/a (dense and causal only)"
    return harness.Case(name, mask, mod, 1, h, hkv, n, d, fa4=fa4_form(name, n), cudnn=cudnn)


# ------------------------------------------------------------------------------------------------
# kept for the experiments (benchmarks/experiments/*.py import them)
# ------------------------------------------------------------------------------------------------
def heads_for(n: int) -> int:
    return 8 if n >= 65536 else 16


def bench_ms(fn):
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def fwd_bwd(fn, do):
    def run():
        o = fn()
        o.backward(do)
    return run


class Runner:
    """Our attention and compiled FlexAttention on one set of inputs per (mask, N, d, H)."""

    def __init__(self):
        from torch.nn.attention.flex_attention import create_block_mask

        peers.strict_compile()
        self.flex = peers.flex_compiled()
        self.create_block_mask = create_block_mask

    def inputs(self, n, d, h, seed=0, grad=True):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        return q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad), do

    def fns(self, name, n, d, h):
        import blocksparse_fa as bsfa

        mask, mm = make_case(name, n)
        q, k, v, do = self.inputs(n, d, h)
        lay = bsfa.compile_mask(mask, n, n, 128, device="cuda")
        bm = None if mm is None else self.create_block_mask(mm, None, None, n, n, device="cuda", _compile=True)
        return dict(q=q, k=k, v=v, do=do, lay=lay, mask=mask, ours=lambda: bsfa.attention(q, k, v, mask=mask),
                    flex=lambda: self.flex(q, k, v, block_mask=bm))


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
def grid(args) -> list[tuple]:
    """``(mask, N, D, H, Hkv)`` in run order: shape by shape, every mask per shape."""
    return [(m, n, d, args.heads, hkv) for n in args.sizes for d in args.dims for hkv in args.kv_heads
            for m in args.masks]


def warm(spec):
    """Worker: run the compiled implementations of one case once (fills the on-disk compile caches)."""
    (name, n, d, h, hkv), opts = spec
    try:
        peers.strict_compile()
        case = build_case(name, n, d, h, hkv, opts.device)
        q, k, v, do = harness.inputs(case, opts)
        b = harness.Builder(case, q, k, v, do, opts)
        for impl in ("ours", "ours_compiled", "flex_triton", "flex_flash"):
            r = b.build(impl) if impl in opts.impls else "skip"
            if isinstance(r, str):
                continue
            try:
                o = r.fn()
                torch.autograd.grad(o, r.leaves, r.do)
            except Exception:  # noqa: BLE001  (the timing run records it)
                pass
        torch.cuda.synchronize()
        return spec[0], "ok"
    except Exception as e:  # noqa: BLE001
        return spec[0], f"{type(e).__name__}: {e}"


def density_sweep(opts: harness.Options, n: int = 32768, d: int = 128, h: int = 8, log=print) -> list[dict]:
    """Time against block density: sliding windows of growing width and random block masks, ours
    and Flex-Triton, no correctness check (the main run has it)."""
    import numpy as np

    import blocksparse_fa as bsfa

    tc = n // 128
    rng = np.random.default_rng(0)
    rows = []
    o = harness.Options(**{**opts.__dict__, "impls": ("ours", "flex_triton"), "check": False})
    cases = [("sliding", w) for w in (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)]
    cases += [("random", r) for r in (2, 3, 5, 10, 26, 64, 128, 256)]
    for kind, p in cases:
        if kind == "sliding":
            mask, mod = bsfa.sliding_window(p), (lambda b, hh, qi, ki, p=p: (qi >= ki) & (qi - ki < p))
        else:
            g = np.zeros((tc, tc), dtype=bool)
            for r in range(tc):
                g[r, rng.choice(tc, size=p, replace=False)] = True
            t = torch.from_numpy(g)
            gt = t.to(opts.device)
            mask, mod = bsfa.block_mask(t, block_size=128), (lambda b, hh, qi, ki, gt=gt: gt[qi // 128, ki // 128])
        res = harness.run_case(harness.Case(f"{kind} {p}", mask, mod, 1, h, h, n, d), o, log=log)
        res.update(kind=kind, param=p)
        rows.append(res)
    return rows


def env_info(device: str) -> dict:
    from importlib import metadata

    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = None
    fa = None
    for dist in ("flash-attn-4", "flash_attn_4", "flash-attn-cute", "flash-attn"):
        try:
            fa = f"{dist} {metadata.version(dist)}"
            break
        except metadata.PackageNotFoundError:
            continue
    cuda = torch.device(device).type == "cuda"
    return {"device": torch.cuda.get_device_name() if cuda else "CPU", "torch": torch.__version__, "triton": tv,
            "cuda": torch.version.cuda, "flash_attn": fa, "peers": peers.status(device),
            "date": time.strftime("%Y-%m-%d %H:%M"), "command": "python " + " ".join(sys.argv)}


def save(data: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "bench.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)
    return path


def run(args) -> dict:
    opts = harness.Options(device=args.device, impls=tuple(args.impls), check=not args.no_check,
                           check_heads=args.check_heads, warmup_ms=args.warmup, rep_ms=args.rep,
                           compile_backend=args.compile_backend, block_size=args.block_size)
    peers.strict_compile()
    t0 = time.time()
    opts.deadline = t0 + args.deadline if args.deadline else 0.0
    specs = grid(args)
    data = {"env": env_info(args.device), "options": {k: v for k, v in opts.__dict__.items()}, "cases": [],
            "sweep": [], "tolerance": harness.TOLERANCE}
    cuda = torch.device(args.device).type == "cuda"
    if cuda and args.warm_workers > 0 and specs:
        with mp.get_context("spawn").Pool(args.warm_workers) as pool:
            for spec, st in pool.imap_unordered(warm, [(s, opts) for s in specs]):
                if st != "ok":
                    print("warm:", spec, st, flush=True)
        print(f"warm-up compile of {len(specs)} cases in {args.warm_workers} processes: {time.time() - t0:.0f} s",
              flush=True)
    longest = 0.0
    for spec in specs:
        name, n, d, h, hkv = spec
        left = args.deadline - (time.time() - t0) if args.deadline else None
        if left is not None and left < max(longest, 1.0):
            data["cases"].append({"mask": name, "B": 1, "H": h, "Hkv": hkv, "N": n, "D": d,
                                  "skipped": f"deadline: {left:.0f} s left, a case took up to {longest:.0f} s"})
            print(f"skip {spec}: deadline", flush=True)
            continue
        print(f"== {name} N={n} d={d} H={h} Hkv={hkv}", flush=True)
        try:
            res = harness.run_case(build_case(name, n, d, h, hkv, args.device), opts)
            longest = max(longest, res["wall_s"])
        except Exception as e:  # noqa: BLE001  (recorded, the next case runs)
            res = {"mask": name, "B": 1, "H": h, "Hkv": hkv, "N": n, "D": d, "error": harness._short(e)}
            print(res["error"], flush=True)
        data["cases"].append(res)
        save(data, args.out)
        if cuda:
            torch.cuda.empty_cache()
    if args.density_sweep:
        data["sweep"] = density_sweep(opts, n=args.sweep_len, h=args.heads // 2)
    data["wall_s"] = time.time() - t0
    save(data, args.out)
    return data


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def report_lines(data: dict) -> list[str]:
    env = data["env"]
    lines = ["# Benchmarks: ours beside FlashAttention-4, FlexAttention and cuDNN", "",
             f"One run of `benchmarks/bench.py` on **{env['device']}**, torch {env['torch']}, triton {env['triton']}"
             + (f", {env['flash_attn']}" if env.get("flash_attn") else "")
             + f", {env['date']}: `{env['command']}`.", "",
             "bf16, B = 1, the same random inputs for every implementation. Times are medians of "
             "`triton.testing.do_bench` (warm-up first); TFLOP/s = 4·B·H·N²·d·(kept fraction) / time "
             "(×3.5 for forward+backward). *ours (compiled)*: `torch.compile(fullgraph=True)` of a function "
             "calling `bsfa.attention` with the mask built outside. *FA4*: `flash_attn.cute.flash_attn_func` "
             "(`causal`, `window_size` for the sliding window), `flash_attn_varlen_func` for the documents. "
             "*Flex-Triton* / *Flex-FLASH*: compiled `flex_attention` without and with "
             "`kernel_options={\"BACKEND\": \"FLASH\"}`, one `BlockMask` per mask built outside the timed "
             "region. *cuDNN*: SDPA under `sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`.", "",
             f"Errors: max |x − float64 reference| of O (forward) and of O, dQ, dK, dV (forward+backward), "
             f"divided by the same error of eager attention in bf16, on the first and last KV head group; "
             f"`!` marks a value above {data.get('tolerance', harness.TOLERANCE):g} or NaN. "
             "*n/a* says why an implementation has no number: not installed, or it cannot express the mask."]
    lines += harness.markdown_tables([c for c in data["cases"] if "error" not in c])
    bad = [c for c in data["cases"] if "error" in c]
    if bad:
        lines += ["", "Cases that failed before any implementation ran:", ""]
        lines += [f"- {c['mask']} N={c['N']} d={c['D']} Hkv={c['Hkv']}: {c['error']}" for c in bad]
    if data.get("sweep"):
        lines += ["", "## Time against block density (ours and Flex-Triton)", "",
                  "| mask | block density | ours fwd / fwd+bwd ms | Flex-Triton fwd / fwd+bwd ms |",
                  "|---|---|---|---|"]
        for r in data["sweep"]:
            lines.append(f"| {r['mask']} | {r['block_density']:.4f} | {harness.cell_time(r['impls']['ours'])} | "
                         f"{harness.cell_time(r['impls']['flex_triton'])} |")
    return lines


def plot(data: dict, out: str) -> list[str]:
    """One PNG per shape: forward+backward TFLOP/s per mask and implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    cases = [c for c in data["cases"] if "impls" in c]
    shapes = sorted({(c["N"], c["D"], c["H"], c["Hkv"]) for c in cases})
    for N, D, H, Hkv in shapes:
        sel = [c for c in cases if (c["N"], c["D"], c["H"], c["Hkv"]) == (N, D, H, Hkv)]
        impls = [i for i in harness.IMPLS if any("fb_tflops" in c["impls"].get(i, {}) for c in sel)]
        if not impls:
            continue
        fig, ax = plt.subplots(figsize=(11, 4))
        w = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            ax.bar([i + (j - (len(impls) - 1) / 2) * w for i in range(len(sel))],
                   [c["impls"].get(impl, {}).get("fb_tflops", 0.0) for c in sel], w, label=harness.LABELS[impl])
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels([c["mask"] for c in sel], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("TFLOP/s, forward+backward (kept elements)")
        ax.set_title(f"N={N}, d={D}, H={H}, KV heads {Hkv}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = os.path.join(out, f"bench_tflops_N{N}_d{D}_kv{Hkv}.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def write_report(data: dict, out: str, update_docs: bool = False) -> None:
    os.makedirs(out, exist_ok=True)
    try:
        pngs = plot(data, out)
    except ImportError as e:  # no matplotlib: the tables still get written
        print(f"no plots ({e})")
        pngs = []
    lines = report_lines(data)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {os.path.join(out, 'bench.md')}, {len(pngs)} plot(s)")
    if not update_docs:
        return
    os.makedirs(os.path.join(DOCS, "data"), exist_ok=True)
    with open(os.path.join(DOCS, "data", "bench.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    for p in pngs:
        shutil.copy(p, os.path.join(DOCS, os.path.basename(p)))
    if pngs:
        lines += ["", "Plots: " + ", ".join(f"`{os.path.basename(p)}`" for p in pngs)]
    md = os.path.join(DOCS, "benchmarks.md")
    kept = ""
    if os.path.exists(md):
        with open(md) as f:
            old = f.read()
        kept = old[old.index(HAND_MARKER):] if HAND_MARKER in old else ""
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n" + ("\n" + kept if kept else ""))
    print(f"updated {md} and {os.path.join(DOCS, 'data', 'bench.json')}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--out", default=None, help="results folder (default $OUT or <tmp>/bsfa_bench/bench)")
    ap.add_argument("--update-docs", action="store_true",
                    help="also write docs/data/bench.json, docs/benchmarks.md (generated part) and the plots")
    ap.add_argument("--masks", nargs="+", default=None, help=f"masks (default all: {' '.join(MASKS)})")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="sequence lengths (default 16384)")
    ap.add_argument("--dims", type=int, nargs="+", default=None, help="head dims (default 128)")
    ap.add_argument("--heads", type=int, default=None, help="query heads (default 16)")
    ap.add_argument("--kv-heads", type=int, nargs="+", default=None,
                    help="key/value heads per run, H for MHA, fewer for GQA (default 16 4)")
    ap.add_argument("--full", action="store_true",
                    help="16K and 64K, d 64 and 128, MHA and GQA (several times the default grid)")
    ap.add_argument("--impls", nargs="+", default=list(harness.IMPLS), choices=harness.IMPLS)
    ap.add_argument("--no-check", action="store_true", help="skip the float64 reference")
    ap.add_argument("--check-heads", choices=("ends", "all"), default="ends",
                    help="KV head groups checked against float64: the first and last (default) or all")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds for the run: later cases are skipped (and recorded) when the longest case so "
                         "far no longer fits (0 = none)")
    ap.add_argument("--warm-workers", type=int, default=6,
                    help="processes that compile the cases first, filling the compile caches (0 = none)")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend for ours (default inductor)")
    ap.add_argument("--density-sweep", action="store_true", help="also time ours and Flex-Triton against density")
    ap.add_argument("--sweep-len", type=int, default=32768)
    ap.add_argument("--device", default=None, help="cuda (default) or cpu")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny shapes, ours (eager and aot_eager-compiled) and Flex-Triton (forward): "
                         "exercises the tables and the JSON")
    ap.add_argument("--report-only", default=None, metavar="JSON", help="only write the report of this bench.json")
    return ap


def _resolve(args) -> None:
    base = DRY if args.dry_run else FULL if args.full else DEFAULT
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.masks = args.masks or MASKS
    args.device = args.device or ("cpu" if args.dry_run else "cuda")
    args.compile_backend = args.compile_backend or ("aot_eager" if args.device == "cpu" else "inductor")
    args.out = args.out or default_out("bench")
    if args.dry_run:
        args.warm_workers, args.rep, args.warmup = 0, 1, 1
    for m in args.masks:
        make_case(m, 256, "cpu")  # an unknown mask fails here, before anything runs
    if any(hkv < 1 or args.heads % hkv for hkv in args.kv_heads):
        raise SystemExit(f"--kv-heads {args.kv_heads}: each must divide --heads {args.heads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run (CPU, tiny shapes)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.report_only:
        with open(args.report_only) as f:
            data = json.load(f)
        write_report(data, args.out or os.path.dirname(os.path.abspath(args.report_only)), args.update_docs)
        return 0
    _resolve(args)
    data = run(args)
    write_report(data, args.out, args.update_docs)
    print(f"total {data['wall_s']:.0f} s; results in {args.out}")
    ours = [c["impls"][i] for c in data["cases"] for i in ("ours", "ours_compiled") if i in c.get("impls", {})]
    failed = [r for r in ours if r.get("ok") is False or "fwd_error" in r or "fb_error" in r]
    if failed or any("error" in c for c in data["cases"]):
        print(f"{len(failed)} of our results failed the float64 check or raised", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
