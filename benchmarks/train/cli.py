"""Command line of ``benchmarks/train_long_context.py``.

    run         train every variant at the given length(s), evaluate, profile (the default command)
    throughput  a few steps per variant and length: tokens/s, GPU busy, memory, recompiles (no evaluation)
    report      merge result files and write training.md and the figures
    cp          context-parallel training under torchrun (each rank holds a shard of every sequence)

Variants run in the order given (priority). With ``--deadline`` the first ``--core`` variants run
the same number of steps (planned from the first one's measured step time), later variants run at
most as many and stop before the deadline, and a variant that cannot reach its first evaluation is
skipped with the reason. ``throughput`` runs the ``--protect`` variants (ours: causal and documents)
first at every length and never skips them: when time is short they run fewer steps. Results are
written after every variant, so a killed run keeps what finished.

Output: ``--out`` (``training_results.json``, and ``training.md`` with the figures at the end);
``docs/`` only with ``--update-docs`` (the results merged into ``docs/data/training_results.json``,
``docs/training.md`` and the figures regenerated).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace

import peers
import torch

from . import report as rep
from .data import N_KEYS, load_corpus
from .runner import (DEFAULT_OVERHEAD_S, RunConfig, estimate_overhead_s, estimate_step_s, plan_steps, tail_s,
                     train_variant, variant_density)
from .cp import CP_FAMILIES
from .variants import DEFAULT_VARIANTS, FLEX_BLOCK_MASKS, VARIANTS, Patterns

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_JSON = os.path.join(ROOT, "docs", "data", "training_results.json")
DEFAULT_DOCS = os.path.join(ROOT, "docs")

# defaults that depend on the device. GPU: the target configuration at 64K, sized so that one
# invocation with --deadline 540 on an H100 trains the first three variants (dense, ours and Flex
# Longformer) for the same 250 steps in about six minutes including compilation (dense ~0.55 s per
# step), then as many of the others as time allows. CPU: seconds.
GPU = dict(seq_len="65536", batch=1, layers=8, d_model=1024, heads=8, kv_heads=2, steps=250, lr=1e-3, warmup=25,
           block_size=128, sliding_window=1024, longformer_window=512, longformer_global=256, bigbird_window=384,
           bigbird_global=128, bigbird_random=3, probe_pairs=16, probe_rounds=8, eval_every=25, eval_windows=4,
           eval_probes=2, profile_steps=3, log_every=25, compile=True)
CPU = dict(seq_len="512", batch=2, layers=2, d_model=64, heads=4, kv_heads=2, steps=30, lr=3e-3, warmup=3,
           block_size=32, sliding_window=64, longformer_window=32, longformer_global=32, bigbird_window=32,
           bigbird_global=32, bigbird_random=1, probe_pairs=8, probe_rounds=3, eval_every=10, eval_windows=2,
           eval_probes=2, profile_steps=0, log_every=10, compile=False)
# throughput: a few steps per variant and length, no evaluation (GPU: about four minutes in all)
THROUGHPUT = dict(gpu=dict(seq_len="16384,32768,65536,131072", steps=8, profile_steps=2, log_every=0),
                  cpu=dict(seq_len="512", steps=6))
# context parallelism (cp): a longer sequence than one GPU's comparison, a few steps, no evaluation
CP_GPU = dict(seq_len=131072, steps=20, log_every=5)
CP_CPU = dict(seq_len=512, steps=6, log_every=1)
THROUGHPUT_VARIANTS = ("bsfa_causal", "bsfa_documents", "sdpa_causal", "fa4_causal", "fa4_documents", "flex_causal",
                       "flex_documents", "flexflash_causal", "flexflash_documents")
PROTECTED = ("bsfa_causal", "bsfa_documents")  # throughput: run first, never skipped


def default_out() -> str:
    """``$OUT`` when set, else a folder under the system's temporary directory."""
    return os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "bsfa_bench", "train")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to run")
    g.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    g.add_argument("--seq-len", help="comma-separated sequence lengths (GPU run 65536; throughput 16384,32768,"
                                     "131072; CPU 512)")
    g.add_argument("--variants", default=None,
                   help=f"comma-separated, in priority order, from {', '.join(VARIANTS)}; 'all' for every one "
                        f"(default: run {', '.join(DEFAULT_VARIANTS)}; throughput {', '.join(THROUGHPUT_VARIANTS)})")
    g.add_argument("--steps", type=int,
                   help="planned training steps per variant: learning-rate schedule and evaluation cadence "
                        "(GPU run 250, throughput 8; CPU 30 / 6)")
    g.add_argument("--max-steps", type=int, default=0,
                   help="run at most this many steps per variant; the schedule still spans --steps (0 = --steps)")
    g.add_argument("--core", type=int, default=3,
                   help="with --deadline: the first N variants run the same number of steps; the first one "
                        "plans it from its measured step time so that all N finish, and every later variant "
                        "runs at most that many")
    g.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds of training per variant, compilation and evaluation not counted (0 = none)")
    g.add_argument("--deadline", type=float, default=0.0,
                   help="seconds for the whole invocation: variants stop early and later ones are skipped "
                        "so that results are written before it (0 = none)")
    g.add_argument("--min-variant-s", type=float, default=30.0,
                   help="with --deadline: a variant is skipped when its estimated setup, compilation and steps "
                        "up to its first evaluation do not fit (estimated from the variants measured before it); "
                        "before anything was measured, when less than this many seconds are left")
    g.add_argument("--deadline-reserve", type=float, default=10.0,
                   help="seconds kept free before the deadline (cleanup, writing the results)")
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
    c.add_argument("--bsfa-mode", choices=("auto", "op", "island"), default="op",
                   help="blocksparse_fa inside the compiled block (op, default: a failure to compile is a "
                        "result), in a torch.compiler.disable region (island), or op with a fallback to island "
                        "(auto)")
    c.add_argument("--bsfa-api", choices=("module", "attention", "attention_op"), default="module",
                   help="static patterns through nn.BlockSparseAttention, bsfa.attention or bsfa.attention_op")
    c.add_argument("--bsfa-kernel-options", default="",
                   help='blocksparse_fa\'s kernel_options for every bsfa variant, as JSON (e.g. \'{"backward": '
                        '"gluon"}\'); default: the library\'s own choice')
    c.add_argument("--flex-block-mask", choices=FLEX_BLOCK_MASKS, default="layout",
                   help="how the Flex BlockMask is built: from block states without evaluating the L x L mask "
                        "(layout, default) or with torch.compile(create_block_mask) (create: minutes of "
                        "compilation on torch 2.11)")
    c.add_argument("--profile-steps", type=int, help="profiled steps for GPU busy (GPU 3, throughput 2, 0 = none)")
    c.add_argument("--sync-steps", type=int, default=2, help="first steps timed with synchronisation "
                                                             "(compilation); excluded from tokens/s")
    c.add_argument("--log-every", type=int)
    c.add_argument("--threads", type=int, help="CPU threads (default 1 with --device cpu)")
    g.add_argument("--protect", default=",".join(PROTECTED),
                   help="throughput: variants run first at every length and never skipped under --deadline "
                        "(fewer steps instead)")
    o = p.add_argument_group("output")
    _add_out_args(o)
    o.add_argument("--json", default=None, help="results file (default <out>/training_results.json)")
    o.add_argument("--merge", action="store_true", help="merge into the existing --json file instead of replacing it")
    o.add_argument("--docs", default=None,
                   help="write training.md and the figures into this folder (default: --out when --json is "
                        "not given; docs/ with --update-docs)")
    o.add_argument("--quiet", action="store_true")


def _add_out_args(p) -> None:
    p.add_argument("--out", default=None, help="results folder (default $OUT or <tmp>/bsfa_bench/train)")
    p.add_argument("--update-docs", action="store_true",
                   help="merge the results into docs/data/training_results.json and regenerate docs/training.md "
                        "and the figures")


def _add_cp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    p.add_argument("--pattern", default="longformer", choices=CP_FAMILIES, help="attention pattern")
    p.add_argument("--strategy", default="auto",
                   choices=("auto", "contiguous", "zigzag", "greedy", "ulysses"),
                   help="how the plan assigns tokens to ranks (plan_context_parallel; auto: least estimated time)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (GPU 131072, CPU 512)")
    p.add_argument("--steps", type=int, help="training steps (GPU 20, CPU 6)")
    for name, typ, hlp in (("batch", int, "sequences per step"), ("layers", int, "decoder layers"),
                           ("d-model", int, "model width"), ("heads", int, "query heads"),
                           ("kv-heads", int, "key/value heads (GQA)"),
                           ("head-dim", int, "head dimension (default d_model / heads)"),
                           ("lr", float, "peak AdamW learning rate"), ("warmup", int, "linear warm-up steps"),
                           ("log-every", int, "print the loss every N steps"), ("threads", int, "CPU threads per rank"),
                           ("sync-steps", int, "first steps left out of tokens/s (default 2)")):
        p.add_argument(f"--{name}", type=typ, help=hlp)
    for name in ("block-size", "sliding-window", "longformer-window", "longformer-global", "bigbird-window",
                 "bigbird-global", "bigbird-random"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="results file (rank 0 writes it)")
    p.add_argument("--quiet", action="store_true")


def _run_cp(args, ap) -> dict | None:
    from .cp import cp_main

    gpu = _resolve_device(args, ap)
    _fill_defaults(args, ap, dict(GPU if gpu else CPU, **(CP_GPU if gpu else CP_CPU)))
    if args.seq_len % args.block_size:
        ap.error(f"--seq-len {args.seq_len} must be a multiple of --block-size {args.block_size}")
    pats = Patterns(block_size=args.block_size, sliding_window=args.sliding_window,
                    longformer_window=args.longformer_window, longformer_global=args.longformer_global,
                    bigbird_window=args.bigbird_window, bigbird_global=args.bigbird_global,
                    bigbird_random=args.bigbird_random, seed=args.seed)
    cfg = RunConfig(device=args.device, seq_len=args.seq_len, batch=args.batch, layers=args.layers,
                    d_model=args.d_model, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                    rope_base=500000.0, steps=args.steps, lr=args.lr,
                    warmup=min(args.warmup, max(1, args.steps // 2)), compile=False, eval_every=-1,
                    probe_pairs=min(args.probe_pairs, (pats.min_global() - 1) // 2), profile_steps=0,
                    sync_steps=max(0, min(args.sync_steps if args.sync_steps is not None else 2, args.steps - 1)),
                    log_every=args.log_every, seed=args.seed, mode="cp")
    threads = torch.get_num_threads()
    if args.threads or not gpu:
        torch.set_num_threads(args.threads or 1)
    try:
        return cp_main(args, cfg, pats, (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True)))
    finally:
        torch.set_num_threads(threads)


def _resolve_device(args, ap) -> bool:
    """``--device auto`` -> cuda or cpu; an error if cuda is asked for and absent. True on a GPU."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    return args.device.startswith("cuda")


def _fill_defaults(args, ap, defaults: dict) -> None:
    """Options left unset take ``defaults``; the head dim follows from d_model and heads."""
    for k, v in defaults.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.head_dim is None:
        if args.d_model % args.heads:
            ap.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}; give --head-dim")
        args.head_dim = args.d_model // args.heads
    if args.heads % args.kv_heads:
        ap.error("--heads must be a multiple of --kv-heads")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="train_long_context.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    _add_run_args(sub.add_parser("run", help="train, evaluate and profile every variant"))
    _add_run_args(sub.add_parser("throughput", help="tokens/s, GPU busy and memory at several lengths"))
    _add_cp_args(sub.add_parser("cp", help="context-parallel training (run it under torchrun)"))
    r = sub.add_parser("report", help="merge result files and write training.md and the figures")
    r.add_argument("files", nargs="+", help="results JSON files (later files win on the same variant and length)")
    _add_out_args(r)
    r.add_argument("--json", default=None, help="merged results file to write (default <out>/training_results.json; "
                                                "docs/data/training_results.json with --update-docs)")
    r.add_argument("--docs", default=None, help="folder for training.md and the figures (default --out; docs/ with "
                                                "--update-docs)")
    return ap


def _resolve(args, ap) -> tuple[list[RunConfig], Patterns, list[str]]:
    gpu = _resolve_device(args, ap)
    d = dict(GPU if gpu else CPU)
    if args.cmd == "throughput":
        d.update(THROUGHPUT["gpu" if gpu else "cpu"])
        d["eval_every"] = -1
    _fill_defaults(args, ap, d)
    default_variants = THROUGHPUT_VARIANTS if args.cmd == "throughput" else DEFAULT_VARIANTS
    variants = list(default_variants) if args.variants in (None, "default") else \
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
            steps=args.steps, max_steps=max(0, args.max_steps), lr=args.lr,
            warmup=min(args.warmup, max(1, args.steps // 2)),
            min_lr_frac=args.min_lr_frac, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
            time_budget=args.time_budget, eval_every=args.eval_every, eval_windows=args.eval_windows,
            eval_probes=args.eval_probes, probe_rate=args.probe_rate, probe_pairs=args.probe_pairs,
            probe_rounds=args.probe_rounds, probe_reach=args.probe_reach, probe_weight=args.probe_weight,
            held_out_permille=args.held_out_permille, compile=gpu if args.compile is None else args.compile,
            compile_scope=args.compile_scope, compile_mode=args.compile_mode,
            compile_backend=args.compile_backend, bsfa_mode=args.bsfa_mode,
            bsfa_api=args.bsfa_api, bsfa_kernel_options=args.bsfa_kernel_options,
            sync_steps=max(1, min(args.sync_steps, args.steps - 1)),
            profile_steps=args.profile_steps, log_every=args.log_every, seed=args.seed,
            mode="throughput" if args.cmd == "throughput" else "train", flex_block_mask=args.flex_block_mask,
            deadline_reserve=args.deadline_reserve))
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
            "cuda": torch.version.cuda, "peers": peers.status(dev)}


def _outputs(args) -> tuple[str, str | None]:
    """``(results file, folder for training.md and the figures or None)`` of a run or a report."""
    out = args.out or default_out()
    to_docs = args.cmd == "report" and args.update_docs
    path = args.json or (DEFAULT_JSON if to_docs else os.path.join(out, "training_results.json"))
    docs = args.docs if args.docs is not None else DEFAULT_DOCS if to_docs else out if not args.json else None
    return path, docs


def _publish(payload: dict, args, log) -> None:
    """``--update-docs`` after a run: merge into docs/data/training_results.json, regenerate the page."""
    merged = rep.merge(([rep.load([DEFAULT_JSON])] if os.path.exists(DEFAULT_JSON) else []) + [payload])
    rep.save(merged, DEFAULT_JSON)
    rep.write_docs(merged, DEFAULT_DOCS)
    log(f"merged into {DEFAULT_JSON}; wrote {os.path.join(DEFAULT_DOCS, 'training.md')}")


def _run(args, ap, argv) -> dict:
    cfgs, pats, variants = _resolve(args, ap)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    t0 = time.perf_counter()
    deadline = t0 + args.deadline if args.deadline else None
    json_path, docs = _outputs(args)
    threads = torch.get_num_threads()
    if args.threads or args.device == "cpu":  # the tiny CPU model runs fastest on one thread
        torch.set_num_threads(args.threads or 1)
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    protect = [v for v in args.protect.split(",") if v in variants] if args.cmd == "throughput" else []
    # throughput: the protected variants at every length first, then the others length by length
    schedule = [(cfg, [v]) for v in protect for cfg in cfgs] + \
        [(cfg, [v for v in variants if v not in protect]) for cfg in cfgs]
    try:
        corpus = load_corpus(None, cfgs[0].held_out_permille)
        run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        base = rep.load([json_path]) if args.merge and os.path.exists(json_path) else rep.new_payload()
        cfg_dict = cfgs[0].as_dict()
        cfg_dict["seq_len"] = [c.seq_len for c in cfgs]
        base["runs"][run_id] = {"argv": argv, "env": env_info(args.device), "config": cfg_dict,
                                "patterns": pats.as_dict(), "data": corpus.info, "variants": variants,
                                "protected": protect, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        log(f"{base['runs'][run_id]['env']['device']}: {len(corpus.train.files)} training files "
            f"({corpus.info['bytes_train'] / 1e6:.1f} MB), unigram entropy {corpus.info['unigram_entropy_bpb']:.3f} "
            f"bits/byte; lengths {[c.seq_len for c in cfgs]}; variants {variants}")
        ref = [base]
        rep.save(base, json_path)  # the run's configuration, even if it is killed during the first variant
        for cfg, vs in schedule:
            if vs:
                _run_length(cfg, vs, pats, corpus, args, deadline, run_id, log, ref, json_path, set(protect))
        payload = ref[0]
        if docs:
            rep.write_docs(payload, docs)
            log(f"wrote {os.path.join(docs, 'training.md')}")
        if args.update_docs:
            _publish(payload, args, log)
        log(f"wrote {json_path} ({time.perf_counter() - t0:.0f} s)")
        return payload
    finally:
        torch.set_num_threads(threads)


def _skipped(v: str, cfg: RunConfig, reason: str, density=(None, None)) -> dict:
    r = {"variant": v, "impl": v.split("_")[0], "family": v.split("_", 1)[1], "seq_len": cfg.seq_len,
         "mode": cfg.mode, "steps_planned": cfg.steps, "status": "skipped", "reason": reason,
         "block_density": density[0]}
    if density[1]:
        r["block_density_note"] = density[1]
    return r


def _ratio(d_later, d_now) -> float:
    """Expected step time of a later variant relative to the running one, from block densities
    (attention plus a fixed part for the rest of the model), clipped to [0.4, 8]."""
    if d_later is None or d_now is None:
        return 1.0
    return min(8.0, max(0.4, (0.05 + d_later) / (0.05 + d_now)))


def _run_length(cfg: RunConfig, variants, pats, corpus, args, deadline, run_id, log, payload_ref, json_path,
                protect=frozenset()) -> None:
    """Every variant at one length, in priority order. Under a deadline the first ``--core``
    variants run the same number of steps (planned by the first from its measured step time);
    every later variant runs at most as many (equal steps), stops before the deadline, and is
    skipped when its estimated setup, compilation and steps to its first evaluation do not fit.
    A ``protect``-ed variant is never skipped: when it does not fit it runs ``sync_steps + 2`` steps."""
    dens = {v: variant_density(v, cfg, pats, corpus) for v in variants}
    core = variants[:max(0, args.core)] if cfg.mode == "train" else []
    cap = cfg.max_steps or 0
    for v in variants:
        impl = v.split("_")[0]
        cfg_v = replace(cfg, max_steps=cap)
        plan = None
        if deadline is not None:
            measured = [r for r in payload_ref[0]["results"] if r.get("run_id") == run_id]
            left = deadline - time.perf_counter()
            step_s = estimate_step_s(dens[v][0], impl, cfg.seq_len, measured)
            over = estimate_overhead_s(impl, measured, default=DEFAULT_OVERHEAD_S if cfg.compile else 5.0)
            first = cfg_v.run_steps if cfg.eval_every <= 0 else min(cfg.eval_every, cfg_v.run_steps)
            need = over + first * step_s + tail_s(cfg_v, step_s) if step_s else None
            short = (need if need is not None else args.min_variant_s) > left
            if short and v in protect:
                cfg_v = replace(cfg_v, max_steps=min(cfg_v.run_steps, cfg.sync_steps + 2))
                log(f"== {v} @ {cfg.seq_len}: {max(0.0, left):.0f} s left; {cfg_v.run_steps} steps (never skipped)")
                r = train_variant(v, cfg_v, pats, corpus, log, deadline=None, density=dens[v])
                _record(r, run_id, json_path, payload_ref)
                continue
            if short and not (impl in ("flex", "flexflash") and not cfg.device.startswith("cuda")):
                reason = f"--deadline: {max(0.0, left):.0f} s left, " + (
                    f"about {need:.0f} s needed (setup, compilation, {first} steps, evaluation)" if need is not None
                    else f"less than --min-variant-s {args.min_variant_s:g} s")
                log(f"== {v} @ {cfg.seq_len}: skipped ({reason})")
                _record(_skipped(v, cfg_v, reason, dens[v]), run_id, json_path, payload_ref)
                continue
            if v in core:
                def plan(step_s, now, done, own_overhead, v=v, cfg_v=cfg_v, measured=measured):
                    # later core variants: their measured overhead if any ran, else this one's plus half
                    # (their compilation may take longer), at a step time scaled by block density
                    later = [(estimate_overhead_s(w.split("_")[0], measured, default=1.5 * own_overhead + 5.0),
                              _ratio(dens[w][0], dens[v][0])) for w in core[core.index(v) + 1:]]
                    return plan_steps(step_s, now, deadline, cfg_v, later, done)
        log(f"== {v} @ {cfg.seq_len} tokens" + (f" (at most {cap} steps, equal to the variants before)" if cap
                                                 and cap < cfg.steps else ""))
        r = train_variant(v, cfg_v, pats, corpus, log, deadline=deadline, plan=plan, density=dens[v])
        if r["status"] == "skipped":
            log(f"  {v}: skipped ({r['reason']})")
        if r["status"] == "ok":
            fin = r.get("final") or {}
            log(f"  {v}: {r['steps']} steps, {r['tokens_per_s']:,.0f} tokens/s, setup {r['setup_s']:.1f} s, compile "
                + (f"{r['compile_s']:.1f} s" if r.get("compile_s") is not None else "n/a")
                + (f", peak {r['peak_mem_gb']:.1f} GB" if r.get("peak_mem_gb") is not None else "")
                + (f", busy {r['gpu']['busy_fraction']:.0%}" if r.get("gpu") else "")
                + (f", held-out {fin['bpb']:.4f} bits/byte" if fin.get("bpb") is not None else ""))
            if v in core and cfg.mode == "train" and r["steps"] < cfg_v.run_steps:
                cap = r["steps"]  # equal steps: later variants run no more than this one did
        _record(r, run_id, json_path, payload_ref)


def _record(r: dict, run_id: str, json_path: str, payload_ref) -> None:
    """Add a result and write the results file (after every variant: a killed run keeps what finished)."""
    r["run_id"] = run_id
    payload_ref[0] = rep.merge([payload_ref[0], {"schema": rep.SCHEMA, "runs": {}, "results": [r]}])
    rep.save(payload_ref[0], json_path)


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "throughput", "report", "cp", "-h", "--help"):
        argv = ["run"] + argv
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd == "report":
        path, docs = _outputs(args)
        payload = rep.load(args.files)
        rep.save(payload, path)
        rep.write_docs(payload, docs)
        print(f"merged {len(args.files)} file(s), {len(payload['results'])} results -> {path}; "
              f"training.md and figures in {docs}")
        return payload
    if args.cmd == "cp":
        return _run_cp(args, ap)
    return _run(args, ap, argv)
