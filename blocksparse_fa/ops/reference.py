"""Dense reference attention (materialises the mask): the ground truth for tests."""

from __future__ import annotations

import math

import torch

from ..compiler.layout import BlockLayout
from ..mask.expr import Mask

__all__ = ["reference_attention"]


def reference_attention(q, k, v, mask=None, *, scale=None, dropout_p: float = 0.0, dropout_mask=None,
                        upcast: bool = True, return_lse: bool = False, score_mod=None,
                        align: str = "bottom_right"):
    """Plain softmax attention with a dense mask, differentiable.

    Args:
        q: ``(B, H, Lq, D)``; k, v: ``(B, Hkv, Lk, D)`` with ``H % Hkv == 0``.
        mask: ``Mask``, ``BlockLayout``, DSL text, a bool tensor broadcastable to
            ``(B, H, Lq, Lk)``, or ``None`` (dense).
        scale: softmax scale (default ``1/sqrt(D)``).
        dropout_p, dropout_mask: apply ``P * keep / (1 - p)`` with a given keep-mask.
        upcast: compute in float64 and return float64 (the reference); ``False`` computes in the
            inputs' dtype ("eager attention in the same low precision").
        return_lse: also return the natural-log logsumexp ``(B, H, Lq)``.
        score_mod: a :class:`~blocksparse_fa.ScoreMod` (:func:`~blocksparse_fa.alibi`,
            :func:`~blocksparse_fa.bias`, :func:`~blocksparse_fa.softcap`, a
            :func:`~blocksparse_fa.score_fn`) applied to the scaled scores, differentiable (also
            with respect to a slopes or bias tensor that requires grad).
        align: query alignment of a ``Mask``/DSL mask and of the score modifier's positions
            (a ``BlockLayout`` keeps its own).

    Returns:
        Output ``(B, H, Lq, D)``; fully masked rows are 0 (their LSE is ``-inf``).
    """
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = H // Hkv
    dt = torch.float64 if upcast else q.dtype
    qf, kf, vf = (t.to(dt) for t in (q, k, v))
    if G > 1:
        kf, vf = kf.repeat_interleave(G, dim=1), vf.repeat_interleave(G, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.matmul(qf, kf.transpose(-1, -2))
    if s.dtype in (torch.float16, torch.bfloat16):  # eager practice: softmax in float32
        s = s.float()
    s = s * scale
    if score_mod is not None:
        from ..mask.expr import query_offset
        from ..mask.score import check_score_mod

        score_mod = check_score_mod(score_mod, H)
        off = mask.q_offset if isinstance(mask, BlockLayout) else query_offset(Lq, Lk, align)
    if score_mod is not None:
        qpos = torch.arange(Lq, device=q.device).view(-1, 1) + off
        kpos = torch.arange(Lk, device=q.device).view(1, -1)
        slopes = score_mod.slopes_tensor(H, q.device, s.dtype).view(1, H, 1, 1)
        bias = None if score_mod.bias is None else score_mod.bias.to(s.dtype)
        if score_mod.fn is not None:
            from ..mask.score import call_fn

            idx = lambda n, shape: torch.arange(n, device=q.device).view(shape)  # noqa: E731
            s = call_fn(score_mod.fn, s, idx(B, (-1, 1, 1, 1)), idx(H, (1, -1, 1, 1)), idx(Lq, (-1, 1)),
                        idx(Lk, (1, -1)))
        else:
            s, _ = score_mod.apply(s, qpos, kpos, slopes, bias)
    if isinstance(mask, str):
        from ..mask.dsl import parse

        mask = parse(mask)
    if isinstance(mask, (Mask, BlockLayout)):
        dense = mask.to_dense() if isinstance(mask, BlockLayout) else mask.to_dense(Lq, Lk, align=align)
        mask = dense.to(q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    lse = (m + torch.log(l)).squeeze(-1)
    p = p / torch.where(l == 0, torch.ones_like(l), l)
    if dropout_p > 0.0 or dropout_mask is not None:
        if dropout_mask is None:
            raise ValueError("reference_attention: dropout_p > 0 needs dropout_mask")
        p = p * dropout_mask.to(p.dtype) / (1.0 - dropout_p)
    out = torch.matmul(p.to(dt), vf)
    return (out, lse.float() if not upcast else lse) if return_lse else out
