"""Context-parallel training: the benchmark's decoder with every sequence sharded across the ranks
of a process group (``torchrun``), attention through blocksparse_fa's context parallelism.

    torchrun --nproc-per-node 4 benchmarks/train_long_context.py cp --device cuda --pattern documents \\
        --seq-len 262144 --steps 8 --json /tmp/cp.json

Each rank holds its shard of every sequence: one permutation from the plan
(:meth:`~blocksparse_fa.distributed.ContextParallelPlan.indices`) is applied to the tokens, the
targets, the loss weights and the rotary positions, so every token keeps its global position.
Attention runs through ``context_parallel_attention`` with the plan and its default check (the
first call of each plan and shape); the rest of the model is per token and needs no communication. Packed documents
(``documents``) change their mask with every batch: the step's plan (or, in one process, its
layout) is made before the step's timer starts, like the batch itself, and its time is reported
apart (``plan_ms``). The loss weights are normalised over the whole batch, so the ranks' partial
losses add up to the single-process loss (all-reduced for the log) and their parameter gradients
add up to its gradient (all-reduced, one flat buffer, before clipping and the optimiser step).
The parameters are replicated (the same seed on every rank, broadcast from rank 0 to be sure).

On CUDA each process takes the GPU of its ``LOCAL_RANK`` before the NCCL group is made (NCCL binds
a communicator to the current device), and every tensor a collective touches lives on that GPU.

Reports tokens/s (all ranks' tokens per step over the median step time after ``sync_steps``), per
rank its tokens, tokens/s and peak memory (CUDA: ``max_memory_allocated``; CPU: peak resident set),
and the loss curve. Eager mode (no ``torch.compile``). :func:`cp_suite` measures strong and weak
scaling against one GPU for several patterns in one process group (``benchmarks/context_parallel.py``).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

import blocksparse_fa as bsfa
from blocksparse_fa.distributed import context_parallel_attention, plan_context_parallel
from blocksparse_fa.distributed.exchange import exchange_for

from .data import VOCAB
from .model import Decoder, mlp_hidden, rope_tables
from .runner import RunConfig, lr_at
from .variants import Patterns

CP_FAMILIES = ("causal", "sliding", "longformer", "bigbird", "documents")


class CPCore(nn.Module):
    """Attention core. ``arg``: a :class:`~blocksparse_fa.distributed.ContextParallelPlan` (this
    rank's shard of ``group``), a compiled layout (one process, per-batch masks) or None (one
    process, the static ``mask``). Calls check across ranks as the library's default does (``check="first"``:
    the first call of each plan and shape)."""

    def __init__(self, mask, block_size: int, group=None, cp_kw: dict | None = None):
        super().__init__()
        self.mask, self.block_size, self.group = mask, block_size, group
        self.cp_kw = dict(cp_kw or {})  # further arguments of context_parallel_attention (overlap, kernel_options)

    def forward(self, q, k, v, arg):
        if isinstance(arg, bsfa.BlockLayout) or arg is None:
            return bsfa.attention(q, k, v, mask=self.mask if arg is None else arg, block_size=self.block_size)
        return context_parallel_attention(q, k, v, plan=arg, group=self.group, **self.cp_kw)


@dataclass
class CPResult:
    """What :func:`train_cp` returns (every rank returns the same losses)."""

    losses: list = field(default_factory=list)  # global loss per step
    step_s: list = field(default_factory=list)
    tokens_per_step: int = 0
    local_tokens: int = 0
    grads: dict = field(default_factory=dict)  # captured parameter gradients of the first step (all-reduced)
    plan: str = ""
    peak_mem_gb: float | None = None
    peak_rss_gb: float | None = None
    plan_s: list = field(default_factory=list)  # per step: making the step's plan or layout (not timed)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _all_reduce_grads(params, group) -> None:
    """Sum the ranks' gradients of the replicated parameters (one flat buffer)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    off = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[off:off + n].view_as(p).clone() if p.grad is None else p.grad.copy_(flat[off:off + n].view_as(p))
        off += n


def train_cp(cfg: RunConfig, pats: Patterns, family: str, stream, group=None, *, strategy: str = "auto",
             dtype: torch.dtype = torch.float32, capture: tuple = (), log=None, cp_kw: dict | None = None) -> CPResult:
    """Train ``cfg.run_steps`` steps of the decoder on ``pattern`` with the sequence sharded across
    ``group`` (None: one process, no sharding: the reference).

    Args:
        cfg: model, optimiser and schedule (``seq_len``, ``batch``, ``layers``, ``lr``, ...).
        pats: pattern sizes; ``family`` one of :data:`CP_FAMILIES` (``documents``: the batch's
            document ids, a new plan per batch).
        stream: ``next() -> Batch`` with full-length ``(B, L)`` tensors, the same batches on every rank.
        group: a process group (or None).
        strategy: the plan's strategy (``plan_context_parallel``).
        dtype: parameter dtype (the GPU runs bf16 autocast over float32 parameters).
        capture: parameter names whose all-reduced gradient of the first step is returned.
        log: ``log(str)`` on rank 0 (None: quiet).
        cp_kw: further arguments of ``context_parallel_attention`` (``overlap``, ``kernel_options``).
    """
    if family not in CP_FAMILIES:
        raise ValueError(f"context-parallel training supports the patterns {CP_FAMILIES}, got {family!r}")
    dev = torch.device(cfg.device)
    L = cfg.seq_len
    if L % pats.block_size:
        raise ValueError(f"--seq-len {L} must be a multiple of --block-size {pats.block_size}")
    per_batch = family == "documents"
    mask = None if per_batch else pats.mask(family)
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    plan_dtype = torch.bfloat16 if dev.type == "cuda" else dtype

    # the rest of the layer per token (projections and MLP: 6 FLOPs per parameter, fwd+bwd) in units of
    # one full attention block of all heads, fwd+bwd, so that the plan balances the whole model
    per_layer = cfg.d_model * (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim + cfg.heads * cfg.head_dim * cfg.d_model \
        + 3 * cfg.d_model * mlp_hidden(cfg.d_model)
    block = 4 * pats.block_size ** 2 * cfg.head_dim * cfg.heads * 3.5
    token_cost = 6 * per_layer / block

    def make_plan(m):
        return plan_context_parallel(m, L, world, block_size=pats.block_size, strategy=strategy,
                                     heads=(cfg.heads, cfg.kv_heads), head_dim=cfg.head_dim, batch=cfg.batch,
                                     dtype=plan_dtype, token_cost=token_cost)

    plan = make_plan(mask) if group is not None and not per_batch else None
    torch.manual_seed(cfg.seed)
    core = CPCore(mask, pats.block_size, group, cp_kw)
    model = Decoder(VOCAB, cfg.d_model, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim, core).to(device=dev,
                                                                                                    dtype=dtype)
    params = list(model.parameters())
    if group is not None:
        src = dist.get_global_rank(group, 0) if hasattr(dist, "get_global_rank") else 0
        for p in params:
            dist.broadcast(p.data, src=src, group=group)
    named = dict(model.named_parameters())
    missing = [n for n in capture if n not in named]
    if missing:
        raise ValueError(f"capture: no parameter named {missing}")
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("emb")]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith("emb"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=dev.type == "cuda" and dtype == torch.float32)
    cos_all, sin_all = rope_tables(L, cfg.head_dim, cfg.rope_base, dev)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    res = CPResult(tokens_per_step=cfg.batch * L, plan=plan.describe() if plan is not None else "single process")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for step in range(cfg.run_steps):
        b = stream.next().to(dev)
        tokens, targets, weights = b.tokens, b.targets, b.weights.to(dtype)
        t_plan = time.perf_counter()
        arg = plan
        if per_batch:  # this batch's documents: a plan (or one process: a layout) made with the batch
            doc = b.doc.cpu()
            m = pats.mask("documents", doc[0] if doc.shape[0] == 1 else doc)
            arg = make_plan(m) if group is not None else bsfa.compile_mask(m, L, L, pats.block_size, device=dev)
            if group is not None:
                exchange_for(arg, rank, dev)  # the rank's tables, as the one-process layout above
                if step == 0:
                    res.plan = arg.describe()
        res.plan_s.append(time.perf_counter() - t_plan)
        idx = arg.indices(rank, dev) if group is not None else None
        cos, sin = (cos_all[idx], sin_all[idx]) if idx is not None else (cos_all, sin_all)  # global positions
        if idx is not None:
            tokens, targets, weights = tokens[:, idx], targets[:, idx], weights[:, idx]
        res.local_tokens = cfg.batch * (len(idx) if idx is not None else L)
        _sync(dev)
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with amp:
            loss, _, _ = model(tokens, targets, weights, cos, sin, arg)
        loss.backward()
        total = loss.detach().double().clone()
        if group is not None:
            _all_reduce_grads(params, group)
            dist.all_reduce(total, group=group)
        if step == 0:
            res.grads = {n: named[n].grad.detach().clone().cpu() for n in capture}
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=dev.type == "cuda")
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(dev)
        res.step_s.append(time.perf_counter() - t0)
        res.losses.append(float(total))
        if log is not None and rank == 0 and cfg.log_every and (step % cfg.log_every == 0 or step == cfg.run_steps - 1):
            log(f"  step {step:4d}  loss {res.losses[-1]:.4f}  {res.step_s[-1] * 1e3:.0f} ms")
    if dev.type == "cuda":
        res.peak_mem_gb = torch.cuda.max_memory_allocated(dev) / 2 ** 30
    res.peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # Linux: KiB
    return res


def summarise(res: CPResult, cfg: RunConfig, group=None) -> dict:
    """Tokens/s and per-rank figures (gathered on every rank) of a finished :func:`train_cp`."""
    timed = res.step_s[cfg.sync_steps:] or res.step_s
    med = statistics.median(timed)
    mine = {"rank": dist.get_rank(group) if group is not None else 0, "tokens": res.local_tokens,
            "tokens_per_s": res.local_tokens / med, "median_step_ms": med * 1e3, "peak_mem_gb": res.peak_mem_gb,
            "peak_rss_gb": res.peak_rss_gb}
    per_rank = [mine]
    if group is not None:
        per_rank = [None] * dist.get_world_size(group)
        dist.all_gather_object(per_rank, mine, group=group)
    slowest = max(r["median_step_ms"] for r in per_rank) / 1e3
    return {"tokens_per_step": res.tokens_per_step, "tokens_per_s": res.tokens_per_step / slowest,
            "median_step_ms": slowest * 1e3, "timed_steps": len(timed), "losses": res.losses,
            "step_ms": [s * 1e3 for s in res.step_s], "plan_ms": [s * 1e3 for s in res.plan_s],
            "per_rank": per_rank, "plan": res.plan}


class _SyntheticStream:
    """Random tokens in packed documents of random lengths (a data-free stream for CPU checks)."""

    def __init__(self, L: int, batch: int, seed: int = 0, lo: int = 16, hi: int = 200):
        import numpy as np

        self.np, self.L, self.B, self.lo, self.hi = np, L, batch, lo, hi
        self.rng = np.random.default_rng(seed)

    def next(self):
        from . import data

        np, seqs = self.np, []
        for _ in range(self.B):
            tok = self.rng.integers(0, VOCAB, self.L + 1)
            lens = self.rng.integers(self.lo, self.hi, self.L // self.lo + 1)
            doc = np.repeat(np.arange(len(lens)), lens)[:self.L].astype(np.int32)
            kind = np.full(self.L, data.TEXT, np.int8)
            seqs.append((tok[:-1], tok[1:], doc, kind))
        return data.collate(seqs, 1.0)


def synthetic_stream(L: int, cfg: RunConfig) -> _SyntheticStream:
    """:class:`_SyntheticStream` of ``cfg.batch`` sequences of ``L`` tokens (``cfg.seed``)."""
    return _SyntheticStream(L, cfg.batch, cfg.seed + 1)


SUITE_CONFIG = dict(batch=1, layers=4, d_model=1024, heads=8, kv_heads=2, head_dim=128, lr=1e-3, warmup=2,
                    compile=False, eval_every=-1, probe_rate=0.0, probe_pairs=8, probe_rounds=2, profile_steps=0,
                    log_every=0, sync_steps=2, mode="cp")


def cp_suite(group, device, patterns=("causal", "documents", "longformer"), strong_len: int = 262144,
             weak_len: int = 65536, steps: int = 5, deadline: float | None = None, config: dict | None = None,
             pats: Patterns | None = None, stream_factory=None, log=None, cp_kw: dict | None = None) -> list:
    """Strong and weak scaling of training against one GPU, per pattern, in one process group.

    Every rank first trains alone on its own device (the one-GPU baselines: ``weak_len`` tokens, and
    ``strong_len``), then all ranks together on ``strong_len`` tokens per sequence (``weak_len x P``
    is the weak-scaling length; pass ``strong_len = weak_len x P`` to measure both at once, the
    default at 4 ranks). The same seed gives every run the same batches and initial parameters, so
    the context-parallel losses are compared step by step with the one-GPU losses at ``strong_len``.

    Args:
        group: the process group; device: this rank's device.
        patterns: families of :data:`CP_FAMILIES`.
        steps: steps per run (``sync_steps`` of them untimed).
        deadline: ``time.monotonic()`` after which no run starts (agreed across ranks).
        config: :class:`RunConfig` fields over :data:`SUITE_CONFIG`; pats: pattern sizes.
        stream_factory: ``(L, cfg) -> stream`` (default: the standard-library corpus).
        log: ``log(str)`` on rank 0.
        cp_kw: further arguments of the context-parallel calls (``overlap``, ``kernel_options``).

    Returns:
        One row per pattern: tokens/s of each run, strong and weak efficiency, peak memory per rank,
        per-step losses and the largest relative loss difference to one GPU; ``skipped`` where the
        deadline left no time.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    pats = pats or Patterns()
    conf = dict(SUITE_CONFIG, **(config or {}))
    say = log if (log is not None and rank == 0) else (lambda *a: None)

    def stream_for(L, cfg):
        if stream_factory is not None:
            return stream_factory(L, cfg)
        from .data import TrainStream, load_corpus, probe_spec

        corpus = load_corpus(None, cfg.held_out_permille)
        spec = probe_spec(L, cfg.probe_pairs, cfg.reach(pats), cfg.probe_rounds)
        return TrainStream(corpus, L, cfg.batch, spec, cfg.probe_rate, cfg.probe_weight, seed=cfg.seed + 1)

    def agree(ok: bool) -> bool:
        t = torch.tensor([1.0 if ok else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return bool(t.item())

    def run_local(family, L, grp):
        cfg = RunConfig(device=str(device), seq_len=L, steps=steps, **conf)
        res = train_cp(cfg, pats, family, stream_for(L, cfg), grp, cp_kw=cp_kw)
        timed = res.step_s[cfg.sync_steps:] or res.step_s
        return dict(tokens=L, batch=cfg.batch, step_s=statistics.median(timed),
                    peak=res.peak_mem_gb or res.peak_rss_gb or 0.0, losses=res.losses,
                    plan_ms=statistics.median(res.plan_s) * 1e3 if res.plan_s else 0.0)

    def gather(r):
        """The slowest rank's step and every rank's peak memory."""
        t = torch.tensor([r["step_s"], r["peak"]], device=device, dtype=torch.float64)
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t, group=group)
        step = max(float(p[0]) for p in parts)
        return dict(tokens=r["tokens"], step_ms=step * 1e3, tokens_per_s=r["batch"] * r["tokens"] / step,
                    peak_gb=[float(p[1]) for p in parts], losses=r["losses"], plan_ms=r["plan_ms"])

    rows = []
    for family in patterns:
        row = dict(pattern=family, world=world, strong_len=strong_len, weak_len=weak_len,
                   expression=pats.describe()[family])
        rows.append(row)
        if deadline is not None and not agree(time.monotonic() < deadline):
            row["skipped"] = "deadline"
            continue
        failed = False
        for key, L, grp in (("single_weak", weak_len, None), ("single_strong", strong_len, None),
                            ("cp", strong_len, group)):
            if key == "single_weak" and weak_len == strong_len:
                row[key] = None
                continue
            err = None
            try:
                row[key] = run_local(family, L, grp)
            except Exception as e:  # noqa: BLE001 - recorded; every rank learns of it before the next collective
                err = f"{key}: {type(e).__name__}: {e}"[:500]
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if not agree(err is None):
                row["error"] = err or "failed on another rank"
                say(f"train {family}: {row['error']}")
                failed = True
                break
            row[key] = gather(row[key])
        if failed:
            break
        cp_tps, one = row["cp"]["tokens_per_s"], row["single_strong"]["tokens_per_s"]
        row["strong_efficiency"] = cp_tps / (world * one)
        if row["single_weak"] is not None:
            row["weak_efficiency"] = cp_tps / (world * row["single_weak"]["tokens_per_s"])
        ref, got = row["single_strong"]["losses"], row["cp"]["losses"]
        row["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
        say(f"train {family}: 1 GPU {one:,.0f} tok/s at {strong_len}, {world} GPUs {cp_tps:,.0f} tok/s: strong "
            f"efficiency {row['strong_efficiency']:.2f}" + (f", weak {row['weak_efficiency']:.2f}"
                                                           if "weak_efficiency" in row else "")
            + f"; losses within {row['max_rel_loss_diff']:.1e}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def cp_main(args, cfg: RunConfig, pats: Patterns, log) -> dict | None:
    """The ``cp`` command: set up torch.distributed from the ``torchrun`` environment, train, report."""
    from .data import TrainStream, load_corpus, probe_spec

    dev = torch.device(cfg.device)
    own = not dist.is_initialized()
    if dev.type == "cuda":  # the GPU first: NCCL binds the communicator to the current device
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        cfg = replace(cfg, device=str(dev))
    if own:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group(backend, **kw)
        else:  # a plain python run: one rank
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        say = log if rank == 0 else (lambda *a: None)
        corpus = load_corpus(None, cfg.held_out_permille)
        spec = probe_spec(cfg.seq_len, cfg.probe_pairs, cfg.reach(pats), cfg.probe_rounds)
        stream = TrainStream(corpus, cfg.seq_len, cfg.batch, spec, cfg.probe_rate, cfg.probe_weight,
                             seed=cfg.seed + 1)
        say(f"context parallel: {world} rank(s), {args.pattern} ({pats.describe()[args.pattern]}), "
            f"{cfg.seq_len} tokens x batch {cfg.batch}, {cfg.run_steps} steps on {dev.type}")
        res = train_cp(cfg, pats, args.pattern, stream, dist.group.WORLD, strategy=args.strategy, log=say)
        out = summarise(res, cfg, dist.group.WORLD)
        say(res.plan)
        say(f"{out['tokens_per_s']:,.0f} tokens/s ({world} ranks, median step {out['median_step_ms']:.0f} ms); "
            f"final loss {res.losses[-1]:.4f}")
        for r in out["per_rank"]:
            mem = (f"peak {r['peak_mem_gb']:.2f} GB" if r["peak_mem_gb"] is not None
                   else f"peak RSS {r['peak_rss_gb']:.2f} GB")
            say(f"  rank {r['rank']}: {r['tokens']} tokens/step, {r['tokens_per_s']:,.0f} tokens/s, {mem}")
        if rank != 0:
            return None
        payload = {"mode": "context_parallel", "world_size": world, "pattern": args.pattern,
                   "expression": pats.describe()[args.pattern], "strategy": args.strategy,
                   "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                   "torch": torch.__version__, "config": asdict(cfg), "patterns": pats.as_dict(), **out}
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(payload, f, indent=1)
            say(f"wrote {args.json}")
        return payload
    finally:
        if own:
            dist.destroy_process_group()
