"""Command line of ``benchmarks/train_long_context.py``.

    run         train every variant at the given length(s), evaluate, profile (the default command)
    throughput  a few steps per variant and length: tokens/s, GPU busy, memory (no evaluation)
    report      merge result files and regenerate docs/training.md and the figures

Results are written after every variant, so a killed run keeps what finished.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

from . import report as rep
from .data import N_KEYS, load_corpus
from .runner import RunConfig, train_variant
from .variants import DEFAULT_VARIANTS, VARIANTS, Patterns

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_JSON = os.path.join(ROOT, "docs", "data", "training_results.json")
DEFAULT_DOCS = os.path.join(ROOT, "docs")

# defaults that depend on the device (GPU: the configuration; CPU: seconds)
GPU = dict(seq_len="65536", batch=1, layers=8, d_model=1024, heads=8, kv_heads=2, steps=120, lr=1e-3, warmup=12,
           block_size=128, sliding_window=1024, longformer_window=512, longformer_global=256, bigbird_window=384,
           bigbird_global=128, bigbird_random=3, probe_pairs=16, probe_rounds=8, eval_every=20, eval_windows=2,
           eval_probes=2, profile_steps=3, log_every=20, compile=True)
CPU = dict(seq_len="512", batch=2, layers=2, d_model=64, heads=4, kv_heads=2, steps=30, lr=3e-3, warmup=3,
           block_size=32, sliding_window=64, longformer_window=32, longformer_global=32, bigbird_window=32,
           bigbird_global=32, bigbird_random=1, probe_pairs=8, probe_rounds=3, eval_every=10, eval_windows=2,
           eval_probes=2, profile_steps=0, log_every=10, compile=False)
THROUGHPUT = dict(gpu=dict(seq_len="16384,32768,131072", steps=10), cpu=dict(seq_len="512", steps=6))


def _add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to run")
    g.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    g.add_argument("--seq-len", help="comma-separated sequence lengths (GPU run 65536; throughput 16384,32768,"
                                     "131072; CPU 512)")
    g.add_argument("--variants", default=None,
                   help=f"comma-separated, from {', '.join(VARIANTS)} (default: all but flex_causal)")
    g.add_argument("--steps", type=int, help="training steps per variant (GPU run 120, throughput 10; CPU 30 / 6)")
    g.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds of training per variant, compilation and evaluation not counted (0 = none)")
    g.add_argument("--deadline", type=float, default=0.0,
                   help="seconds for the whole invocation: variants stop early and later ones are skipped "
                        "so that results are written before it (0 = none)")
    g.add_argument("--min-variant-s", type=float, default=90.0,
                   help="with --deadline: do not start a variant with less than this many seconds left "
                        "(compilation alone takes about a minute on the GPU)")
    g.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("model and optimiser")
    for name, typ, hlp in (("batch", int, "sequences per step"), ("layers", int, "decoder layers"),
                           ("d-model", int, "model width"), ("heads", int, "query heads"),
                           ("kv-heads", int, "key/value heads (GQA)"),
                           ("head-dim", int, "head dimension (default d_model / heads)"),
                           ("lr", float, "peak AdamW learning rate"), ("warmup", int, "linear warm-up steps")):
        m.add_argument(f"--{name}", type=typ, help=hlp)
    m.add_argument("--rope-base", type=float, default=500000.0)
    m.add_argument("--min-lr-frac", type=float, default=0.1, help="final learning rate / peak (cosine)")
    m.add_argument("--weight-decay", type=float, default=0.1)
    m.add_argument("--grad-clip", type=float, default=1.0)
    pa = p.add_argument_group("patterns (tokens)")
    for name in ("block-size", "sliding-window", "longformer-window", "longformer-global", "bigbird-window",
                 "bigbird-global", "bigbird-random"):
        pa.add_argument(f"--{name}", type=int)
    e = p.add_argument_group("evaluation and probe")
    e.add_argument("--eval-every", type=int, help="evaluate every N steps and at the end (0: at the end only)")
    e.add_argument("--eval-windows", type=int, help="held-out text windows per evaluation")
    e.add_argument("--eval-probes", type=int, help="held-out probe sequences per evaluation")
    e.add_argument("--probe-rate", type=float, default=0.25, help="fraction of training sequences that are probes")
    e.add_argument("--probe-pairs", type=int, help=f"key-value pairs per probe (<= {N_KEYS}; the prefix "
                                                   "1 + 2 x pairs must fit in the global tokens)")
    e.add_argument("--probe-rounds", type=int, help="most query rounds per probe")
    e.add_argument("--probe-reach", type=int, default=0,
                   help="distance every query keeps from earlier occurrences of its key (0: layers x widest window)")
    e.add_argument("--probe-weight", type=float, default=1.0, help="weight of the answer loss")
    e.add_argument("--held-out-permille", type=int, default=30, help="held-out files, per mille (by path hash)")
    c = p.add_argument_group("compilation and measurement")
    c.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile (default: on for CUDA, off on CPU)")
    c.add_argument("--compile-scope", choices=("block", "model"), default="block",
                   help="compile each block (regional, default) or the whole model")
    c.add_argument("--compile-mode", default="default",
                   help="torch.compile mode (default, max-autotune-no-cudagraphs, ...)")
    c.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend (aot_eager traces without generating code: a quick CPU check)")
    c.add_argument("--bsfa-mode", choices=("auto", "op", "island"), default="auto",
                   help="blocksparse_fa inside the compiled block (op), in a torch.compiler.disable region "
                        "(island), or op with a fallback to island when it does not compile (auto)")
    c.add_argument("--bsfa-api", choices=("module", "attention", "attention_op"), default="module",
                   help="static patterns through nn.BlockSparseAttention, bsfa.attention or bsfa.attention_op")
    c.add_argument("--profile-steps", type=int, help="profiled steps for GPU busy (GPU 3, 0 = none)")
    c.add_argument("--sync-steps", type=int, default=2, help="first steps timed with synchronisation "
                                                             "(compilation); excluded from tokens/s")
    c.add_argument("--log-every", type=int)
    c.add_argument("--threads", type=int, help="CPU threads (default 1 with --device cpu)")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=DEFAULT_JSON, help="results file (default docs/data/training_results.json)")
    o.add_argument("--merge", action="store_true", help="merge into the existing --json file instead of replacing it")
    o.add_argument("--docs", default=None,
                   help="regenerate training.md and figures in this folder (default: docs/ when --json is the "
                        "default file, else none)")
    o.add_argument("--quiet", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="train_long_context.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    _add_run_args(sub.add_parser("run", help="train, evaluate and profile every variant"))
    _add_run_args(sub.add_parser("throughput", help="tokens/s, GPU busy and memory at several lengths"))
    r = sub.add_parser("report", help="merge result files and regenerate the docs")
    r.add_argument("files", nargs="+", help="results JSON files (later files win on the same variant and length)")
    r.add_argument("--json", default=DEFAULT_JSON, help="merged results file to write")
    r.add_argument("--docs", default=DEFAULT_DOCS, help="folder for training.md and the figures")
    return ap


def _resolve(args, ap) -> tuple[list[RunConfig], Patterns, list[str]]:
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    gpu = args.device.startswith("cuda")
    d = dict(GPU if gpu else CPU)
    if args.cmd == "throughput":
        d.update(THROUGHPUT["gpu" if gpu else "cpu"])
        d["eval_every"] = -1
    for k, v in d.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.head_dim is None:
        if args.d_model % args.heads:
            ap.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}; give --head-dim")
        args.head_dim = args.d_model // args.heads
    if args.heads % args.kv_heads:
        ap.error("--heads must be a multiple of --kv-heads")
    variants = list(DEFAULT_VARIANTS) if args.variants in (None, "default") else \
        list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    lengths = [int(x) for x in str(args.seq_len).split(",") if x.strip()]
    pats = Patterns(block_size=args.block_size, sliding_window=args.sliding_window,
                    longformer_window=args.longformer_window, longformer_global=args.longformer_global,
                    bigbird_window=args.bigbird_window, bigbird_global=args.bigbird_global,
                    bigbird_random=args.bigbird_random, seed=args.seed)
    if 1 + 2 * args.probe_pairs > pats.min_global():
        ap.error(f"the probe prefix (1 + 2 x {args.probe_pairs} tokens) must fit in the smallest global-token "
                 f"prefix ({pats.min_global()}); lower --probe-pairs")
    cfgs = []
    for L in lengths:
        if L % pats.block_size:
            ap.error(f"--seq-len {L} must be a multiple of --block-size {pats.block_size}")
        cfgs.append(RunConfig(
            device=args.device, seq_len=L, batch=args.batch, layers=args.layers, d_model=args.d_model,
            heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, rope_base=args.rope_base,
            steps=args.steps, lr=args.lr, warmup=min(args.warmup, max(1, args.steps // 2)),
            min_lr_frac=args.min_lr_frac, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
            time_budget=args.time_budget, eval_every=args.eval_every, eval_windows=args.eval_windows,
            eval_probes=args.eval_probes, probe_rate=args.probe_rate, probe_pairs=args.probe_pairs,
            probe_rounds=args.probe_rounds, probe_reach=args.probe_reach, probe_weight=args.probe_weight,
            held_out_permille=args.held_out_permille, compile=gpu if args.compile is None else args.compile,
            compile_scope=args.compile_scope, compile_mode=args.compile_mode,
            compile_backend=args.compile_backend, bsfa_mode=args.bsfa_mode,
            bsfa_api=args.bsfa_api, sync_steps=min(args.sync_steps, max(1, args.steps - 1)),
            profile_steps=args.profile_steps, log_every=args.log_every, seed=args.seed,
            mode="throughput" if args.cmd == "throughput" else "train"))
    return cfgs, pats, variants


def env_info(device: str) -> dict:
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s))"
    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = None
    return {"device": name, "torch": torch.__version__, "triton": tv, "python": platform.python_version(),
            "cuda": torch.version.cuda}


def _run(args, ap, argv) -> dict:
    cfgs, pats, variants = _resolve(args, ap)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    t0 = time.perf_counter()
    deadline = t0 + args.deadline if args.deadline else None
    threads = torch.get_num_threads()
    if args.threads or args.device == "cpu":  # the tiny CPU model runs fastest on one thread
        torch.set_num_threads(args.threads or 1)
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    try:
        corpus = load_corpus(None, cfgs[0].held_out_permille)
        run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        base = rep.load([args.json]) if args.merge and os.path.exists(args.json) else rep.new_payload()
        cfg_dict = cfgs[0].as_dict()
        cfg_dict["seq_len"] = [c.seq_len for c in cfgs]
        base["runs"][run_id] = {"argv": argv, "env": env_info(args.device), "config": cfg_dict,
                                "patterns": pats.as_dict(), "data": corpus.info, "variants": variants,
                                "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        log(f"{base['runs'][run_id]['env']['device']}: {len(corpus.train.files)} training files "
            f"({corpus.info['bytes_train'] / 1e6:.1f} MB), unigram entropy {corpus.info['unigram_entropy_bpb']:.3f} "
            f"bits/byte; lengths {[c.seq_len for c in cfgs]}; variants {variants}")
        payload = base
        for cfg in cfgs:
            for v in variants:
                if deadline is not None and time.perf_counter() > deadline - args.min_variant_s:
                    r = {"variant": v, "impl": v.split("_")[0], "family": v.split("_", 1)[1], "seq_len": cfg.seq_len,
                         "mode": cfg.mode, "status": "skipped", "reason": "invocation deadline reached"}
                    log(f"== {v} @ {cfg.seq_len}: skipped (deadline)")
                else:
                    log(f"== {v} @ {cfg.seq_len} tokens")
                    r = train_variant(v, cfg, pats, corpus, log, deadline=deadline)
                    if r["status"] == "skipped":
                        log(f"  {v}: skipped ({r['reason']})")
                    if r["status"] == "ok":
                        fin = r.get("final") or {}
                        log(f"  {v}: {r['tokens_per_s']:,.0f} tokens/s, compile {r['compile_s']:.1f} s"
                            + (f", peak {r['peak_mem_gb']:.1f} GB" if r.get("peak_mem_gb") is not None else "")
                            + (f", busy {r['gpu']['busy_fraction']:.0%}" if r.get("gpu") else "")
                            + (f", held-out {fin['bpb']:.4f} bits/byte" if fin.get("bpb") is not None else ""))
                r["run_id"] = run_id
                payload = rep.merge([payload, {"schema": rep.SCHEMA, "runs": {}, "results": [r]}])
                rep.save(payload, args.json)  # after every variant
        docs = args.docs if args.docs is not None else (DEFAULT_DOCS if os.path.abspath(args.json) ==
                                                        os.path.abspath(DEFAULT_JSON) else None)
        if docs:
            rep.write_docs(payload, docs)
            log(f"wrote {os.path.join(docs, 'training.md')}")
        log(f"wrote {args.json} ({time.perf_counter() - t0:.0f} s)")
        return payload
    finally:
        torch.set_num_threads(threads)


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "throughput", "report", "-h", "--help"):
        argv = ["run"] + argv
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd == "report":
        payload = rep.load(args.files)
        rep.save(payload, args.json)
        rep.write_docs(payload, args.docs)
        print(f"merged {len(args.files)} file(s), {len(payload['results'])} results -> {args.json}; "
              f"docs in {args.docs}")
        return payload
    return _run(args, ap, argv)
