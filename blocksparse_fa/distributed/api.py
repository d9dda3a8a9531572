"""``context_parallel_attention``: attention over a sequence sharded across ranks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..compiler.cache import LRUCache
from ..compiler.layout import BlockLayout
from ..mask.dsl import parse
from ..ops.prepare import draw_seed, resolve_backend, seed_tensor
from ..ops.dispatch import pad_head_dims, slice_head_dim
from ..ops.options import as_options
from ..ops.validate import MAX_HEAD_DIM, check_qkv, check_scalars, like_sdpa_under_autocast, without_autocast
from .attention import cp_backward, cp_forward
from .comm import check_call, check_mode, checked, init_group, needs_check, resolve_group
from .exchange import exchange_for
from .plan import ContextParallelPlan, plan_context_parallel
from .ulysses import UlyssesExchange, ulysses_check, ulysses_forward

__all__ = ["context_parallel_attention"]


class _CPAttention(torch.autograd.Function):
    """Eager autograd around :func:`.attention.cp_forward` / :func:`.attention.cp_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, ex, scale, dropout_p, seed, backend, group, overlap, opts):
        ctx.set_materialize_grads(False)
        out, lse, saved = cp_forward(ex, q, k, v, scale, dropout_p, seed, backend, group, overlap, opts)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.extra = (ex, saved, scale, dropout_p, seed, backend, group, overlap, opts)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if torch.is_grad_enabled():  # create_graph=True: the messages and kernels record no graph
            raise RuntimeError("context_parallel_attention: a backward with create_graph=True (second derivatives) "
                               "is not supported")
        q, k, v, out, lse = ctx.saved_tensors
        ex, saved, scale, dropout_p, seed, backend, group, overlap, opts = ctx.extra
        if dout is None:
            dout = torch.zeros_like(out)
        with without_autocast(q.device):
            dq, dk, dv = cp_backward(ex, q, k, v, out, lse, dout, dlse, saved, scale, dropout_p, seed, backend,
                                     group, overlap, opts)
        return dq, dk, dv, None, None, None, None, None, None, None, None


_DEFAULT_PLANS = LRUCache(32)


def _length(q) -> int:
    return q.shape[2] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0


_LOCAL_PLANS = LRUCache(64)  # "first" checks: (group, mask, block, world, rank, length) -> the plan gathered once


def _default_plan(mask, block_size, group, world: int, length: int, device, rank: int = 0,
                  first: bool = False) -> ContextParallelPlan:
    """A plan for inputs already split into contiguous shards in rank order (lengths gathered;
    ``first``: once per group, mask and local length in this process)."""
    local = None
    if first:
        name = getattr(group, "group_name", None) or id(group)
        local = (name, mask if not isinstance(mask, str) else parse(mask), block_size, world, rank, length, str(device))
        plan = _LOCAL_PLANS.get(local)
        if plan is not None:
            return plan
    plan = _gathered_plan(mask, block_size, group, world, length, device)
    if local is not None:
        _LOCAL_PLANS.put(local, plan)
    return plan


def _gathered_plan(mask, block_size, group, world: int, length: int, device) -> ContextParallelPlan:
    t = torch.tensor([length], dtype=torch.int64, device=device)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=group)
    lengths = tuple(int(p.item()) for p in parts)
    key = (mask if not isinstance(mask, str) else parse(mask), lengths, block_size, world)
    plan = _DEFAULT_PLANS.get(key)
    if plan is None:
        plan = plan_context_parallel(mask, sum(lengths), world, block_size=block_size, shard_lengths=lengths)
        _DEFAULT_PLANS.put(key, plan)
    return plan


@like_sdpa_under_autocast
def context_parallel_attention(q, k, v, mask=None, *, plan: ContextParallelPlan | None = None, group=None,
                               scale=None, dropout_p: float = 0.0, dropout_seed=None, return_lse: bool = False,
                               backend: str = "auto", block_size=None, overlap="auto", check="first",
                               kernel_options=None):
    """Block-sparse self-attention over a sequence sharded across the ranks of ``group``.

    Every rank calls it with the q, k, v of its own tokens (and every rank must run the backward
    when one does). With a ``plan`` (:func:`plan_context_parallel`), rank ``r`` holds the tokens
    ``plan.indices(r)``; without one, the ranks hold contiguous pieces of the sequence in rank
    order (each a whole number of layout blocks, the last one excepted).

    Args:
        q: ``(B, H, L_r, D)``, this rank's queries.
        k, v: ``(B, Hkv, L_r, D)`` and ``(B, Hkv, L_r, Dv)`` of the same tokens (self-attention;
            ``H % Hkv == 0``; ``Dv != D`` is zero-padded as in :func:`blocksparse_fa.attention`).
        mask: the mask (a :class:`~blocksparse_fa.Mask`, DSL text or None = dense) when no plan
            is given; with a plan it must be the plan's mask or None.
        plan: a :class:`ContextParallelPlan` made for this group's size.
        group: a process group, a 1-D DeviceMesh or None (the default group).
        scale, dropout_p, dropout_seed, return_lse, backend, block_size: as in
            :func:`blocksparse_fa.attention`. Dropout drops exactly the elements the
            single-process run drops (the seed is rank 0's when drawn).
        overlap: compute the blocks whose keys are local while the remote ones arrive (two kernel
            launches merged in float32; in the backward the remote keys' gradients travel during
            the local launch) instead of one launch after the fetch. ``"auto"`` (default): where
            the plan's estimate says it pays (:attr:`ContextParallelPlan.overlap_auto`).
        check: exchange a description of the call first, so that inconsistent calls (different
            plans, shard lengths, shapes) raise the same error on every rank instead of hanging.
            ``"first"`` (default): the first call of each configuration (group, plan, this rank's
            shapes, dtypes and device, scale, dropout) in this process exchanges it, later calls
            skip the exchange (an all-gather and a device-to-host read: about 1 ms per call on
            4 × H200) and the gather of shard lengths when no plan is given; with dropout and no
            ``dropout_seed`` every call exchanges (rank 0's seed). True: every call (an
            inconsistency that appears after the first call then raises instead of hanging);
            False: never (local checks only; dropout then needs a ``dropout_seed``).
        kernel_options: as in :func:`blocksparse_fa.attention`, for every local launch.

    Returns:
        ``out`` ``(B, H, L_r, D)`` (and ``lse`` ``(B, H, L_r)`` float32 if asked), this rank's rows
        of the unsharded attention.
    """
    if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == v.dim() == 4 \
            and v.shape[-1] != q.shape[-1] and 1 <= v.shape[-1] <= MAX_HEAD_DIM:
        # Dv != D: the exchanges move k and v as one buffer, so the smaller side is zero-padded here
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        qp, kp, vp, dv = pad_head_dims(q, k, v)
        res = context_parallel_attention(qp, kp, vp, mask, plan=plan, group=group, scale=scale, dropout_p=dropout_p,
                                         dropout_seed=dropout_seed, return_lse=return_lse, backend=backend,
                                         block_size=block_size, overlap=overlap, check=check,
                                         kernel_options=kernel_options)
        return (slice_head_dim(res[0], dv), res[1]) if return_lse else slice_head_dim(res, dv)
    if overlap != "auto" and not isinstance(overlap, bool):
        raise ValueError(f"overlap must be True, False or 'auto', got {overlap!r}")
    mode = check_mode(check)
    if torch.compiler.is_compiling():
        return _compiled(q, k, v, mask, plan, group, scale, dropout_p, dropout_seed, return_lse, backend, overlap,
                         mode, kernel_options)
    opts = as_options(kernel_options)
    scale_arg, dropout_arg = scale, dropout_p  # as given: what a "first" check is keyed on
    pg = resolve_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    local_error = None
    be, seed = "torch", 0
    try:
        s = check_qkv(q, k, v, dv_ok=True)  # a valid Dv != D was padded above
        check_scalars(scale, dropout_p)
        if s.Lq != s.Lk:
            raise ValueError(f"context parallelism is for self-attention: q has {s.Lq} tokens, k/v {s.Lk} (shard "
                             f"q, k, v with the same plan)")
        be = resolve_backend(backend, q.device, q.dtype)
        if plan is not None and mask is not None:
            m = parse(mask) if isinstance(mask, str) else (mask.mask if isinstance(mask, BlockLayout) else mask)
            if m != plan.layout.mask:
                raise ValueError(f"mask {m} differs from the plan's mask {plan.layout.mask}")
        if plan is not None and plan.world_size == world and plan.strategy == "ulysses":
            why = ulysses_check(plan, s.H, s.Hkv, float(dropout_p))
            if why:
                raise ValueError(why)
        if mode == "never" and float(dropout_p) > 0 and dropout_seed is None:
            raise ValueError("dropout with check=False needs an explicit dropout_seed (the same on every rank)")
        scale = 1.0 / math.sqrt(s.D) if scale is None else float(scale)
        dropout_p = float(dropout_p)
        seed = draw_seed(dropout_p, dropout_seed)
    except (TypeError, ValueError, RuntimeError) as e:
        if mode == "never":
            raise
        local_error = e
        scale, dropout_p = 1.0, 0.0  # placeholders: the check below raises on every rank
    dev = q.device if isinstance(q, torch.Tensor) else "cpu"
    if plan is None:
        plan = _default_plan(mask, block_size, pg, world, _length(q), dev, rank, mode == "first")
    if needs_check(mode, pg, plan, q, k, v, scale_arg, dropout_arg, dropout_seed is not None):
        seed = check_call(pg, plan, rank, world, q, k, v, scale, dropout_p, seed,
                          None if local_error is None else str(local_error), dev)
        if mode == "first":
            checked(pg, plan, q, k, v, scale_arg, dropout_arg)
    elif local_error is not None:  # this configuration passed its check before: the error is this rank's
        raise local_error
    else:
        if plan.world_size != world or plan.local_len(rank) != q.shape[2]:
            raise ValueError(f"rank {rank}: the plan is for {plan.world_size} ranks and gives this rank "
                             f"{plan.local_len(rank) if plan.world_size == world else '?'} tokens; got a group of "
                             f"{world} and {q.shape[2]} tokens")
        init_group(pg, q.device)
    if plan.strategy == "ulysses":
        key = ("ulysses", rank, str(q.device))
        ex = plan._exchanges.get(key)
        if ex is None:
            ex = plan._exchanges[key] = UlyssesExchange(plan, rank, q.device)
        out, lse = ulysses_forward(q, k, v, ex, scale, be, pg, q.device, opts)
    else:
        ex = exchange_for(plan, rank, q.device)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            out, lse = _CPAttention.apply(q, k, v, ex, scale, dropout_p, seed, be, pg, overlap, opts)
        else:
            out, lse, _ = cp_forward(ex, q, k, v, scale, dropout_p, seed, be, pg, overlap, opts)
    return (out, lse) if return_lse else out


def _compiled(q, k, v, mask, plan, group, scale, dropout_p, dropout_seed, return_lse, backend, overlap, mode, opts):
    """The ``torch.compile`` path: the custom ops of :mod:`.custom_op` (a plan is required)."""
    from .custom_op import cp_attention_op

    if plan is None:
        raise ValueError("context_parallel_attention under torch.compile needs a plan (plan_context_parallel), made "
                         "outside the compiled function")
    if plan.strategy == "ulysses":
        raise ValueError("the Ulysses strategy is not traceable (its all-to-alls are autograd functions); compile "
                         "with a sparse strategy or call it outside torch.compile")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    dropout_p = float(dropout_p)
    overlap = plan.overlap_auto if overlap == "auto" else bool(overlap)
    if mode == "first" and dropout_p > 0 and dropout_seed is None:
        mode = "always"  # each call's seed is rank 0's
    out, lse = cp_attention_op(q, k, v, plan, group, scale, dropout_p, seed_tensor(dropout_p, dropout_seed),
                               backend, overlap, mode, opts)
    return (out, lse) if return_lse else out
