"""Context-parallel training: the benchmark's decoder with every sequence sharded across the ranks
of a process group (``torchrun``), attention through blocksparse_fa's context parallelism.

    torchrun --nproc-per-node 2 benchmarks/train_long_context.py cp --device cuda --pattern longformer \\
        --seq-len 131072 --steps 20 --json /tmp/cp.json

Each rank holds its shard of every sequence: one permutation from the plan
(:meth:`~blocksparse_fa.distributed.ContextParallelPlan.indices`) is applied to the tokens, the
targets, the loss weights and the rotary positions, so every token keeps its global position.
Attention runs through ``nn.BlockSparseAttention(context_parallel=group)`` with the plan; the rest of
the model is per token and needs no communication. The loss weights are normalised over the whole
batch, so the ranks' partial losses add up to the single-process loss (all-reduced for the log) and
their parameter gradients add up to its gradient (all-reduced, one flat buffer, before clipping and
the optimiser step). The parameters are replicated (the same seed on every rank, broadcast from rank
0 to be sure).

Reports tokens/s (all ranks' tokens per step over the median step time after ``sync_steps``), per
rank its tokens, tokens/s and peak memory (CUDA: ``max_memory_allocated``; CPU: peak resident set),
and the loss curve. Eager mode (no ``torch.compile``); static patterns only (causal, sliding,
longformer, bigbird).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from blocksparse_fa.distributed import plan_context_parallel
from blocksparse_fa.nn import BlockSparseAttention

from .data import VOCAB
from .model import Decoder, rope_tables
from .runner import RunConfig, lr_at
from .variants import Patterns

CP_FAMILIES = ("causal", "sliding", "longformer", "bigbird")


class CPCore(nn.Module):
    """Attention core: ``nn.BlockSparseAttention`` over this rank's shard (``arg`` is the plan), or
    over the whole sequence when ``group`` is None (the single-process reference)."""

    def __init__(self, mask, block_size: int, group=None):
        super().__init__()
        self.attn = BlockSparseAttention(mask, block_size=block_size, context_parallel=group)

    def forward(self, q, k, v, plan):
        if self.attn.context_parallel is None:
            return self.attn(q, k, v)
        return self.attn(q, k, v, cp_plan=plan)


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
             dtype: torch.dtype = torch.float32, capture: tuple = (), log=None) -> CPResult:
    """Train ``cfg.run_steps`` steps of the decoder on ``pattern`` with the sequence sharded across
    ``group`` (None: one process, no sharding: the reference).

    Args:
        cfg: model, optimiser and schedule (``seq_len``, ``batch``, ``layers``, ``lr``, ...).
        pats: pattern sizes; ``family`` one of :data:`CP_FAMILIES`.
        stream: ``next() -> Batch`` with full-length ``(B, L)`` tensors, the same batches on every rank.
        group: a process group (or None).
        strategy: the plan's strategy (``plan_context_parallel``).
        dtype: parameter dtype (the GPU runs bf16 autocast over float32 parameters).
        capture: parameter names whose all-reduced gradient of the first step is returned.
        log: ``log(str)`` on rank 0 (None: quiet).
    """
    if family not in CP_FAMILIES:
        raise ValueError(f"context-parallel training supports the static patterns {CP_FAMILIES}, got {family!r}")
    dev = torch.device(cfg.device)
    L = cfg.seq_len
    if L % pats.block_size:
        raise ValueError(f"--seq-len {L} must be a multiple of --block-size {pats.block_size}")
    mask = pats.mask(family)
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    plan = None
    if group is not None:
        plan = plan_context_parallel(mask, L, world, block_size=pats.block_size, strategy=strategy,
                                     heads=(cfg.heads, cfg.kv_heads), head_dim=cfg.head_dim, batch=cfg.batch,
                                     dtype=torch.bfloat16 if dev.type == "cuda" else dtype)
    torch.manual_seed(cfg.seed)
    model = Decoder(VOCAB, cfg.d_model, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim,
                    CPCore(mask, pats.block_size, group)).to(device=dev, dtype=dtype)
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
    cos, sin = rope_tables(L, cfg.head_dim, cfg.rope_base, dev)
    idx = plan.indices(rank, dev) if plan is not None else None
    if idx is not None:
        cos, sin = cos[idx], sin[idx]  # rotary positions follow the permutation
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    res = CPResult(tokens_per_step=cfg.batch * L, local_tokens=cfg.batch * (len(idx) if idx is not None else L),
                   plan=plan.describe() if plan is not None else "single process")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for step in range(cfg.run_steps):
        b = stream.next().to(dev)
        tokens, targets, weights = b.tokens, b.targets, b.weights.to(dtype)
        if idx is not None:
            tokens, targets, weights = tokens[:, idx], targets[:, idx], weights[:, idx]
        _sync(dev)
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with amp:
            loss, _, _ = model(tokens, targets, weights, cos, sin, plan)
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
            "step_ms": [s * 1e3 for s in res.step_s], "per_rank": per_rank, "plan": res.plan}


def cp_main(args, cfg: RunConfig, pats: Patterns, log) -> dict | None:
    """The ``cp`` command: set up torch.distributed from the ``torchrun`` environment, train, report."""
    from .data import TrainStream, load_corpus, probe_spec

    dev = torch.device(cfg.device)
    own = not dist.is_initialized()
    if own:
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        else:  # a plain python run: one rank
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
            torch.cuda.set_device(dev)
            cfg = type(cfg)(**{**asdict(cfg), "device": str(dev)})
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
