"""Head-sharded all-to-all (Ulysses) around the single-GPU attention.

Each rank holds all heads of its tokens. One all-to-all per input turns that into all tokens of
``H / P`` heads (every rank's shard, put back in global order), the whole-sequence attention runs
as on one GPU (with the compiler's exact rewrites, e.g. the strided pattern as band plus residue
classes), and one all-to-all returns the output to the token owners. It is exact and balanced by
construction; its traffic is independent of the mask (``(H + 2 Hkv) / P`` heads of every token
each way), and it needs ``H`` divisible by the world size ``P``, ``Hkv`` divisible by ``P`` or
dividing it (then each key/value head goes to the ``P / Hkv`` ranks of its query heads, and their
gradients are summed on the way back), a mask that does not depend on the head, and no dropout
(the dropout counters number heads globally).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..ops import dispatch
from ..ops.options import as_options
from ..ops.validate import Shapes
from .comm import all_to_all
from .plan import ContextParallelPlan

__all__ = ["UlyssesExchange", "ulysses_forward", "ulysses_check"]


class UlyssesExchange:
    """Token orders of one rank for the head all-to-all."""

    def __init__(self, plan: ContextParallelPlan, rank: int, device):
        self.plan, self.rank, self.P = plan, rank, plan.world_size
        self.lengths = [plan.local_len(r) for r in range(self.P)]
        self.restore = plan.restore_indices(device)  # rank-major -> global
        self.perm = plan.permutation(device)  # global -> rank-major


def _seq_to_head(x: torch.Tensor, ex: UlyssesExchange, group) -> torch.Tensor:
    """``(B, Hx, L_r, D)`` shard -> ``(B, Hx / P, N, D)`` of this rank's head group, global order."""
    B, Hx, L, D = x.shape
    P = ex.P
    hx = Hx // P
    send = x.reshape(B, P, hx, L, D).movedim(1, 0).reshape(P * B * hx * L, D)
    recv = all_to_all(send, [B * hx * L] * P, [B * hx * n for n in ex.lengths], group).wait()
    parts = torch.split(recv, [B * hx * n for n in ex.lengths])
    full = torch.cat([p.reshape(B, hx, n, D) for p, n in zip(parts, ex.lengths)], dim=2)
    return full.index_select(2, ex.restore)


def _head_to_seq(x: torch.Tensor, ex: UlyssesExchange, group) -> torch.Tensor:
    """Inverse of :func:`_seq_to_head`: ``(B, hx, N, D)`` -> ``(B, hx * P, L_r, D)``."""
    B, hx, N, D = x.shape
    P = ex.P
    xr = x.index_select(2, ex.perm)
    pieces = torch.split(xr, ex.lengths, dim=2)
    send = torch.cat([p.reshape(B * hx * p.shape[2], D) for p in pieces])
    L = ex.lengths[ex.rank]
    recv = all_to_all(send, [B * hx * n for n in ex.lengths], [B * hx * L] * P, group).wait()
    return recv.reshape(P, B, hx, L, D).movedim(0, 1).reshape(B, P * hx, L, D)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ex, group):
        ctx.ex, ctx.group = ex, group
        return _seq_to_head(x, ex, group)

    @staticmethod
    @once_differentiable  # a message: differentiating the backward again is refused, not skipped
    def backward(ctx, g):
        return _head_to_seq(g.contiguous(), ctx.ex, ctx.group), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ex, group):
        ctx.ex, ctx.group = ex, group
        return _head_to_seq(x, ex, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return _seq_to_head(g.contiguous(), ctx.ex, ctx.group), None, None


def ulysses_check(plan: ContextParallelPlan, H: int, Hkv: int, dropout_p: float) -> str | None:
    """Why Ulysses cannot run this call, or None."""
    P = plan.world_size
    if H % P or (Hkv % P and P % Hkv):
        return (f"Ulysses needs the query heads ({H}) divisible by the world size ({P}) and the key/value heads "
                f"({Hkv}) divisible by it or dividing it")
    if plan.layout.batch_shape and plan.layout.batch_shape[1] > 1:
        return "Ulysses needs a mask that does not depend on the head"
    if dropout_p > 0.0:
        return "Ulysses does not support dropout (use a sparse strategy: zigzag, contiguous or greedy)"
    return None


def ulysses_forward(q, k, v, ex: UlyssesExchange, scale: float, backend: str, group, layout_device, opts=None):
    """Differentiable ``(out (B, H, L_r, D), lse (B, H, L_r))`` of the rank's tokens."""
    P = ex.P
    if k.shape[1] % P:  # fewer key/value heads than ranks: each goes to the ranks of its query heads
        k, v = (t.repeat_interleave(P // t.shape[1], dim=1) for t in (k, v))
    qh, kh, vh = (_SeqToHead.apply(t, ex, group) for t in (q, k, v))
    B, hq, N, D = qh.shape
    s = Shapes(B, hq, kh.shape[1], N, N, D)
    layout = ex.plan.device_layout(layout_device)
    out_h, lse_h = dispatch.apply(qh, kh, vh, layout, s, scale, 0.0, 0, backend, opts=as_options(opts))
    out = _HeadToSeq.apply(out_h, ex, group)
    lse = _HeadToSeq.apply(lse_h.unsqueeze(-1), ex, group).squeeze(-1)
    return out, lse
