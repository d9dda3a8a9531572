"""One key interval per query row: the exact form of band-like masks, and the block ranges it gives.

Many masks keep, on every query row, one contiguous run of keys ``lo[q] <= k < hi[q]``:
``causal()``, ``sliding_window(w)``, ``window(w)``, ``chunked(c)``, ``prefix_lm(p)``,
``document(ids)`` with each document one contiguous run, ``key_range``/``query_range`` filters,
and the ``&``/``|``/``~`` combinations of them that stay one run per row (``causal() &
document(ids)``, ``key_range(0, g) | causal()``, ...). For those, a kernel needs no block tables
and no element predicate: two integer arrays of length ``Lq`` say everything, and a tile of
consecutive rows visits one contiguous range of key blocks.

:func:`row_interval` computes the arrays exactly from the expression (``O(Lq · k)`` for ``k``
intervals per row while combining, never ``Lq × Lk``) or returns None when some row keeps two or
more separate runs (Longformer's ``window(w) | global_tokens(g)``) or the expression has a leaf
that is not one run per row (``strided``, ``random_blocks``, ``block_mask``, ...).
:func:`tile_ranges` turns the arrays into per-tile key-block ranges: the blocks a tile of rows
must visit, and the sub-range where every row of the tile keeps the whole block.
"""

from __future__ import annotations

import numpy as np

from ..mask import primitives as P
from ..mask.expr import And, Mask, Not, Or, query_offset
from ..mask.shift import Shift
from .rowsets import _complement, _normalize

__all__ = ["row_interval", "mask_row_interval", "tile_ranges"]

_MAX_KEY_RUNS = 64  # key sets with more runs than this are not worth expanding per row


def _runs(pos: np.ndarray, kv: int):
    """Maximal runs ``[lo, hi]`` (inclusive) of sorted distinct positions, clipped to ``[0, kv)``."""
    pos = pos[(pos >= 0) & (pos < kv)]
    if len(pos) == 0:
        return np.array([kv], np.int64), np.array([-1], np.int64)
    brk = np.nonzero(np.diff(pos) != 1)[0]
    lo = np.concatenate([pos[:1], pos[brk + 1]])
    hi = np.concatenate([pos[brk], pos[-1:]])
    return lo.astype(np.int64), hi.astype(np.int64)


def _leaf(m: Mask, qp: np.ndarray, kv: int, b: int, h: int):
    """Inclusive interval sets ``(lo, hi)`` ``(len(qp), k)`` of a leaf at instance ``(b, h)``, or
    None when the leaf is not a union of key runs per row."""
    if isinstance(m, P.Primitive):
        m = m.at(b, h)
    if isinstance(m, P.Document):
        if m.runs() is None:
            return None
        start, end = m.runs()
        n = start.shape[1]
        row = min(b, start.shape[0] - 1)
        ok = (qp >= 0) & (qp < n)
        qc = np.clip(qp, 0, n - 1)
        lo, hi = np.where(ok, start[row, qc], kv), np.where(ok, end[row, qc] - 1, -1)
    elif isinstance(m, P.IntervalPrimitive):
        lo, hi = m._bounds(qp)
    elif isinstance(m, (P.RowPrimitive, P.QuerySet)):
        keep = m._rows(qp) if not isinstance(m, P.QuerySet) else np.isin(qp, m.positions(b))
        lo = np.where(keep, 0, kv)
        hi = np.full(qp.shape, kv - 1, np.int64)
    elif isinstance(m, P.GlobalTokens):  # qp < g: every key; else the keys before g
        (g,) = m._params
        lo = np.zeros(qp.shape, np.int64)
        hi = np.where(qp < g, kv - 1, g - 1)
    elif isinstance(m, P.KeySet):
        klo, khi = _runs(m.positions(b), kv)
        if len(klo) > _MAX_KEY_RUNS:
            return None
        n = len(qp)
        return _normalize(np.broadcast_to(klo, (n, len(klo))).copy(), np.broadcast_to(khi, (n, len(khi))).copy(), kv)
    else:
        return None
    lo = np.clip(np.broadcast_to(np.asarray(lo, np.int64), qp.shape), 0, kv)
    hi = np.clip(np.broadcast_to(np.asarray(hi, np.int64), qp.shape), -1, kv - 1)
    return _normalize(lo[:, None].copy(), hi[:, None].copy(), kv)


_LEAVES = (P.IntervalPrimitive, P.RowPrimitive, P.QuerySet, P.KeySet, P.GlobalTokens, P.Document)


def _supported(m: Mask) -> bool:
    """Whether every node is one :func:`_sets` evaluates (checked before any per-row work)."""
    if isinstance(m, (And, Or, Not, Shift)):
        return all(_supported(c) for c in m.children)
    if isinstance(m, P.Document):
        return m.runs() is not None
    return isinstance(m, _LEAVES)


def _sets(m: Mask, qp: np.ndarray, kv: int, b: int, h: int):
    """Per-row interval sets of ``m`` (normalized), or None where a leaf is not interval-shaped."""
    if isinstance(m, Shift):
        return _sets(m.children[0], qp + m.offset_at(b, h), kv, b, h)
    if isinstance(m, Not):
        s = _sets(m.children[0], qp, kv, b, h)
        return None if s is None else _complement(*s, kv)
    if isinstance(m, (And, Or)):
        acc = _sets(m.children[0], qp, kv, b, h)
        for c in m.children[1:]:
            if acc is None:
                return None
            s = _sets(c, qp, kv, b, h)
            if s is None:
                return None
            (lo, hi), (lo2, hi2) = acc, s
            n = len(qp)
            if isinstance(m, Or):
                lo, hi = np.concatenate([lo, lo2], 1), np.concatenate([hi, hi2], 1)
            else:
                lo = np.maximum(lo[:, :, None], lo2[:, None, :]).reshape(n, -1)
                hi = np.minimum(hi[:, :, None], hi2[:, None, :]).reshape(n, -1)
            acc = _normalize(lo, hi, kv)
        return acc
    return _leaf(m, qp, kv, b, h)


def _one(lo: np.ndarray, hi: np.ndarray):
    """Half-open ``(lo, hi)`` int32 ``(L,)`` from normalized inclusive sets with at most one
    interval per row (empty rows ``(0, 0)``); None when a row has two or more."""
    valid = lo <= hi
    if (valid.sum(1) > 1).any():
        return None
    slot = np.argmax(valid, axis=1)
    r = np.arange(len(lo))
    has = valid[r, slot]
    a = np.where(has, lo[r, slot], 0)
    e = np.where(has, hi[r, slot] + 1, 0)
    return a.astype(np.int32), e.astype(np.int32)


def mask_row_interval(mask: Mask, q_len: int, kv_len: int, q_offset: int | None = None, align: str = "bottom_right"):
    """The key interval of every query row of ``mask``, or None when some row keeps two or more
    separate runs of keys or a leaf is not interval-shaped.

    Args:
        mask: the expression.
        q_len, kv_len: lengths.
        q_offset: absolute position of query row 0 (default: from ``align``).
        align: ``"bottom_right"`` or ``"top_left"``, used when ``q_offset`` is None.

    Returns:
        ``(lo, hi)``, int32 ``(Z, q_len)`` with ``Z`` the mask's instances (``B·H`` of its
        ``batch_shape``, 1 when it has none; instance ``z = b·H + h``): row ``i`` of instance ``z``
        keeps exactly the keys ``lo[z, i] <= k < hi[z, i]``; rows that keep nothing have
        ``lo = hi = 0``.
    """
    if kv_len < 1 or q_len < 1 or not _supported(mask):
        return None
    off = query_offset(q_len, kv_len, align) if q_offset is None else q_offset
    qp = np.arange(q_len, dtype=np.int64) + off
    bs = mask.batch_shape or (1, 1)
    los, his = [], []
    for b in range(bs[0]):
        for h in range(bs[1]):
            s = _sets(mask, qp, kv_len, b, h)
            if s is None:
                return None
            one = _one(*s)
            if one is None:
                return None
            los.append(one[0])
            his.append(one[1])
    return np.stack(los), np.stack(his)


def row_interval(layout):
    """:func:`mask_row_interval` of a compiled :class:`~blocksparse_fa.compiler.layout.BlockLayout`
    (its mask, lengths and query offset), cached on the layout; None where the mask is not one
    interval per row, and for shards of a larger layout (their rows sit at listed positions) unless
    their intervals in local key coordinates were put in the cache (``distributed/exchange.py``)."""
    key = "row_interval"
    if key not in layout.cache:
        res = None
        if getattr(layout, "positions", None) is None:
            res = mask_row_interval(layout.mask, layout.q_len, layout.kv_len, q_offset=layout.q_offset)
        layout.cache[key] = res
    return layout.cache[key]


def per_layout(layout, key: str, build):
    """``build()`` for a compiled layout whose mask is an expression and whose rows sit at their
    own positions (not a shard of a larger layout), else None; kept in ``layout.cache[key]``."""
    if key not in layout.cache:
        ok = getattr(layout, "positions", None) is None and isinstance(layout.mask, Mask)
        layout.cache[key] = build() if ok else None
    return layout.cache[key]


def split_per_layout(layout, key: str, find, make):
    """A mask split cached on a compiled layout (:func:`per_layout`): ``make(hit)`` of
    ``hit = find(mask, q_len, kv_len, q_offset)``, or None where ``find`` returns None."""

    def build():
        hit = find(layout.mask, layout.q_len, layout.kv_len, layout.q_offset)
        return None if hit is None else make(hit)

    return per_layout(layout, key, build)


def tile_ranges(lo: np.ndarray, hi: np.ndarray, rows: int, block_n: int):
    """Key-block ranges of tiles of ``rows`` consecutive query rows, from :func:`mask_row_interval`'s
    arrays of one instance.

    Args:
        lo, hi: int ``(L,)``, half-open intervals (empty where ``lo >= hi``).
        rows: query rows per tile (the last tile may be short).
        block_n: keys per block.

    Returns:
        int64 ``(T, 4)`` with ``T = cdiv(L, rows)``: ``(first, full_start, full_end, end)``. The tile
        visits key blocks ``[first, end)`` (the blocks that hold a kept key of one of its rows;
        ``first = end = 0`` when none does); blocks ``[full_start, full_end)`` (inside
        ``[first, end]``, empty as ``full_start = full_end = end``) are kept whole by every row of
        the tile, the others need the element mask. A block is full only when every row keeps all
        ``block_n`` of its keys, so a ragged last block (past the last key) is never full.
    """
    lo = np.asarray(lo, np.int64)
    hi = np.asarray(hi, np.int64)
    n = len(lo)
    t = -(-n // rows)
    pad = t * rows - n
    empty = lo >= hi
    big = np.iinfo(np.int64).max // 4
    # visited range: empty rows take no part
    a = np.where(empty, big, lo)
    e = np.where(empty, -big, hi)
    a = np.pad(a, (0, pad), constant_values=big).reshape(t, rows).min(1)
    e = np.pad(e, (0, pad), constant_values=-big).reshape(t, rows).max(1)
    none = a >= e
    first = np.where(none, 0, a // block_n)
    end = np.where(none, 0, -(-e // block_n))
    # full range: every row (an empty one included) must keep the whole block; padding rows don't count
    lo_t = np.pad(np.where(empty, big, lo), (0, pad), constant_values=-big).reshape(t, rows).max(1)
    hi_t = np.pad(np.where(empty, -big, hi), (0, pad), constant_values=big).reshape(t, rows).min(1)
    f0 = -(-lo_t // block_n)
    f1 = hi_t // block_n
    has_full = (f1 > f0) & ~none
    f0 = np.where(has_full, f0, end)
    f1 = np.where(has_full, f1, end)
    return np.stack([first, f0, f1, end], axis=1)
