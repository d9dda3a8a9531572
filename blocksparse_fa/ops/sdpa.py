"""``scaled_dot_product_attention``: :func:`torch.nn.functional.scaled_dot_product_attention`'s
signature and semantics on block-sparse attention, plus ``mask=`` for mask expressions.

Switching is one line::

    from blocksparse_fa import scaled_dot_product_attention as sdpa
    out = sdpa(q, k, v, attn_mask=keep, is_causal=False, mask="longformer")
"""

from __future__ import annotations

import torch

from ..compiler.layout import BlockLayout
from ..mask.expr import Mask
from ..mask.primitives import causal, sliding_window, window
from ..mask.score import bias
from .api import as_mask, attention, check_align
from .validate import _check_tensor, bool_mask_to_mask, like_sdpa_under_autocast

__all__ = ["scaled_dot_product_attention", "top_left_causal"]


def top_left_causal(q_len: int, kv_len: int, align: str = "bottom_right") -> Mask:
    """SDPA's ``is_causal`` mask as an expression for queries aligned by ``align``: query row ``i``
    keeps keys ``j <= i``. That is ``causal()`` when queries align top-left (or ``q_len == kv_len``).
    Aligned bottom-right (row ``i`` at ``qp = i + kv_len - q_len``), with ``d = kv_len - q_len`` it
    is ``j <= qp - d``: ``causal() & ~sliding_window(d)`` for ``d > 0`` and ``causal() | window(-d)``
    for ``d < 0``."""
    d = kv_len - q_len
    if d == 0 or align == "top_left":
        return causal()
    if d > 0:
        return causal() & ~sliding_window(d)
    return causal() | window(-d)


def _holds_bias(attn_mask) -> bool:
    """A float mask with values other than ``0``/``-inf`` (SDPA adds it to the scores)."""
    if not isinstance(attn_mask, torch.Tensor) or not attn_mask.dtype.is_floating_point \
            or attn_mask.device.type == "meta":
        return False
    return not bool(((attn_mask == 0) | torch.isneginf(attn_mask)).all())


def _broadcast_heads(q, k, v, enable_gqa: bool):
    """q, k, v with SDPA's broadcasting applied: leading dims broadcast; heads (dim -3) broadcast,
    except grouped-query heads (``enable_gqa``, or k/v with one head), which stay as they are."""
    Hq, Hk, Hv = q.shape[-3], k.shape[-3], v.shape[-3]
    try:
        lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except RuntimeError:
        raise ValueError(f"the leading (batch) dims of query {tuple(q.shape)}, key {tuple(k.shape)} and value "
                         f"{tuple(v.shape)} do not broadcast") from None
    if enable_gqa and Hk != Hq:
        if Hk != Hv:
            raise ValueError(f"enable_gqa: key and value must have the same number of heads, got {Hk} and {Hv}")
        if Hq % Hk:
            raise ValueError(f"enable_gqa: the query heads ({Hq}) must be a multiple of the key/value heads ({Hk})")
        H, Hkv = Hq, Hk
    else:
        try:
            H = torch.broadcast_shapes((Hq,), (Hk,), (Hv,))[0]
        except RuntimeError:
            raise ValueError(f"query has {Hq} heads and key/value {Hk}/{Hv}: they must be equal (or 1), or pass "
                             f"enable_gqa=True for grouped-query attention") from None
        Hkv = 1 if Hk == Hv == 1 else H  # MQA by broadcasting: one k/v head serves every query head
    q = q.expand(*lead, H, *q.shape[-2:])
    k = k.expand(*lead, Hkv, *k.shape[-2:])
    v = v.expand(*lead, Hkv, *v.shape[-2:])
    return q, k, v, tuple(lead), H


@like_sdpa_under_autocast
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale=None, enable_gqa: bool = False, *, mask=None, backend: str = "auto",
                                 block_size=None, align: str | None = None, kernel_options=None):
    """:func:`torch.nn.functional.scaled_dot_product_attention` on block-sparse attention.

    For the inputs SDPA accepts it computes what SDPA computes, with these exceptions: rows with
    nothing to attend give zeros (and zero gradients; some SDPA backends give NaN), dropout draws
    a different random pattern from the same distribution. A float ``attn_mask`` of ``0``/``-inf``
    is a mask (its empty blocks are skipped); one holding other values is an additive bias
    (:func:`~blocksparse_fa.bias`: every block of the other masks is visited). ``Dv != D`` works as
    in SDPA (the smaller head dim is zero-padded, see :func:`blocksparse_fa.attention`).

    Args:
        query: ``(..., H, Lq, D)`` (at least 2 dims: ``(Lq, D)`` is one head).
        key, value: ``(..., Hkv, Lk, D)`` and ``(..., Hkv, Lk, Dv)``; leading dims broadcast
            against query's, as in SDPA.
        attn_mask: bool (``True`` = attend) or float tensor broadcastable to ``(..., H, Lq, Lk)``,
            added to the scores (``0``/``-inf`` only: a mask).
        dropout_p: dropout probability, always applied (pass 0 in evaluation, as with SDPA).
        is_causal: causal mask aligned top-left as SDPA's (row ``i`` keeps keys ``j <= i``, also when
            ``Lq != Lk``); combined with ``attn_mask`` and ``mask`` when they are given.
        scale: softmax scale (default ``1/sqrt(D)``); a positive finite real.
        enable_gqa: allow ``Hkv < H`` with ``H % Hkv == 0`` (grouped-query attention, no copies of
            k/v); without it heads must match or broadcast (one k/v head), as in SDPA.
        mask: a block-sparse mask (:class:`~blocksparse_fa.Mask`, DSL text / pattern name, a
            FlexAttention ``mask_mod`` callable or a compiled :class:`~blocksparse_fa.BlockLayout`),
            intersected with the others.
        backend, block_size: as in :func:`blocksparse_fa.attention`.
        align: where query row ``i`` sits for ``mask``: ``"top_left"`` (default here, position
            ``i``: SDPA's and FlexAttention's convention) or ``"bottom_right"`` (position
            ``i + Lk - Lq``, the default of :func:`blocksparse_fa.attention`). A compiled layout
            keeps its own. ``is_causal`` is top-left whatever the alignment.
        kernel_options: as in :func:`blocksparse_fa.attention`.

    Returns:
        ``(..., H, Lq, Dv)``, the broadcast leading dims and query's dtype.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t)
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., L, D), got shape {tuple(t.shape)}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    unbatched = query.dim() == 2
    q, k, v = (t if t.dim() > 2 else t.unsqueeze(0) for t in (query, key, value))
    nd = max(q.dim(), k.dim(), v.dim())
    q, k, v = (t.reshape((1,) * (nd - t.dim()) + tuple(t.shape)) for t in (q, k, v))
    q, k, v, lead, H = _broadcast_heads(q, k, v, bool(enable_gqa))
    Lq, Lk = q.shape[-2], k.shape[-2]
    parts, bs = [], block_size
    align = check_align(align, mask) if isinstance(mask, BlockLayout) else check_align(align or "top_left")
    if mask is not None:
        if isinstance(mask, BlockLayout):
            parts.append(mask)
        elif isinstance(mask, torch.Tensor):
            raise TypeError("mask= takes a block-sparse mask (Mask, DSL text, BlockLayout); pass tensors as attn_mask")
        else:
            parts.append(as_mask(mask))
    score_mod = None
    if attn_mask is not None and _holds_bias(attn_mask):
        score_mod = bias(attn_mask)
    elif attn_mask is not None:
        parts.append(bool_mask_to_mask(attn_mask, lead, H, Lq, Lk, device=q.device))
    if is_causal:
        parts.append(top_left_causal(Lq, Lk, align))
    if len(parts) > 1 and isinstance(parts[0], BlockLayout):
        bs = parts[0].block_size if bs is None else bs
        parts[0] = parts[0].mask
    m = None
    for p in parts:
        m = p if m is None else m & p
    if isinstance(m, BlockLayout):
        align = None  # the layout's own
    out = attention(q, k, v, mask=m, scale=scale, dropout_p=dropout_p, backend=backend, block_size=bs, align=align,
                    score_mod=score_mod, kernel_options=kernel_options)
    return out[0] if unbatched else out
