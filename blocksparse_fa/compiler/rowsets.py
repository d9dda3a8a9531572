"""Per-row interval sets: exact states for the blocks the state algebra leaves uncertain.

Every query row of an ``&``/``|``/``~`` tree of interval-shaped masks keeps a union of a few key
intervals: interval primitives and run-structured documents give one interval per row, row filters
(``query_range``, ``query_set``) all keys or none, ``|`` unions them, ``&`` intersects them
pairwise, ``~`` takes the gaps. Key sets ``|``-ed in at the top are the same positions on every
row and are kept apart, as a sorted array of positions.

The state tables combine two partial blocks into an ``UNSURE`` one (e.g. the diagonal block of
``causal | key_range(...)``). For those blocks only, the kept elements are counted from the
interval sets of the block's rows, ``O(bm · k)`` per block for ``k`` intervals per row, and the
block's exact state follows; nothing is evaluated element by element, so refinement has nothing
left to do for these trees.
"""

from __future__ import annotations

import numpy as np

from ..mask import primitives as P
from ..mask.expr import And, Mask, Not, Or
from .segments import EMPTY, FULL, PARTIAL, REPLACE_UNSURE, UNSURE, Segments

__all__ = ["applies", "settle"]


def _is_leaf(m: Mask) -> bool:
    if isinstance(m, P.Document):
        return m.runs() is not None
    return isinstance(m, (P.IntervalPrimitive, P.RowPrimitive, P.QuerySet))


def _is_tree(m: Mask) -> bool:
    if isinstance(m, (And, Or, Not)):
        return all(_is_tree(c) for c in m.children)
    return _is_leaf(m)


def _split_top(m: Mask):
    """``(interval tree or None, key sets)``: a top-level ``|`` may hold key sets beside the tree."""
    if isinstance(m, Or):
        keys = [c for c in m.children if isinstance(c, P.KeySet)]
        rest = [c for c in m.children if not isinstance(c, P.KeySet)]
        if keys and rest and all(_is_tree(c) for c in rest):
            return (rest[0] if len(rest) == 1 else Or(rest)), keys
    return (m if _is_tree(m) else None), []


def applies(m: Mask) -> bool:
    """Whether :func:`settle` handles ``m``: an ``&``/``|``/``~`` node over interval
    primitives, row filters and run-structured documents (key sets allowed beside them under a
    top-level ``|``), with no per-(batch, head) parameters."""
    if not isinstance(m, (And, Or, Not)) or m.batch_shape:
        return False
    tree, _ = _split_top(m)
    return tree is not None


# --------------------------------------------------------------------------------------------
# per-row interval sets: (lo, hi) int64 (L, k), one interval per slot, empty where lo > hi
# --------------------------------------------------------------------------------------------
def _drop_unused(lo: np.ndarray, hi: np.ndarray):
    used = (lo <= hi).any(axis=0)
    if used.all():
        return lo, hi
    used[:1] = True
    return lo[:, used], hi[:, used]


def _normalize(lo: np.ndarray, hi: np.ndarray, kv: int):
    """Disjoint, non-touching intervals per row, the non-empty slots in increasing order (empty
    slots anywhere)."""
    empty = lo > hi
    lo = np.where(empty, kv, lo)
    hi = np.where(empty, -1, hi)
    k = lo.shape[1]
    if k == 1:
        return lo, hi
    if k == 2:
        swap = lo[:, 1] < lo[:, 0]
        lo = np.where(swap[:, None], lo[:, ::-1], lo)
        hi = np.where(swap[:, None], hi[:, ::-1], hi)
    else:
        order = np.argsort(lo, axis=1, kind="stable")
        lo = np.take_along_axis(lo, order, 1)
        hi = np.take_along_axis(hi, order, 1)
    # merge: a slot starts a new interval unless it overlaps or touches those before it (an empty
    # slot, sorted last, at worst ends the interval before it); each merged interval is written
    # to its last slot, the others are emptied
    run = np.maximum.accumulate(hi, axis=1)
    new = np.ones(lo.shape, dtype=bool)
    new[:, 1:] = lo[:, 1:] > run[:, :-1] + 1
    last = np.ones(lo.shape, dtype=bool)
    last[:, :-1] = new[:, 1:]
    start = np.maximum.accumulate(np.where(new, lo, 0), axis=1)  # lo is sorted
    return _drop_unused(np.where(last, start, kv), np.where(last, run, -1))


def _leaf(m: Mask, qp: np.ndarray, kv: int):
    if isinstance(m, (P.IntervalPrimitive, P.Document)):
        lo, hi = m._bounds(qp)
        lo = np.clip(np.broadcast_to(lo, qp.shape), 0, kv)
        hi = np.clip(np.broadcast_to(hi, qp.shape), -1, kv - 1)
    else:
        keep = m._rows(qp)
        lo = np.where(keep, 0, kv)
        hi = np.full(qp.shape, kv - 1, np.int64)
    return _normalize(lo.astype(np.int64)[:, None], hi.astype(np.int64)[:, None], kv)


def _complement(lo: np.ndarray, hi: np.ndarray, kv: int):
    """The gaps of normalized sets in ``[0, kv)``: before each non-empty slot, and after the last."""
    valid = lo <= hi
    h = np.where(valid, hi, -1)
    end = np.maximum.accumulate(h, axis=1)
    prev = np.concatenate([np.full((len(lo), 1), -1, np.int64), end[:, :-1]], axis=1)
    g_lo = np.concatenate([np.where(valid, prev + 1, kv), end[:, -1:] + 1], axis=1)
    g_hi = np.concatenate([np.where(valid, lo - 1, -1), np.full((len(lo), 1), kv - 1, np.int64)], axis=1)
    return _drop_unused(g_lo, g_hi)


def _sets(m: Mask, qp: np.ndarray, kv: int):
    if isinstance(m, Not):
        return _complement(*_sets(m.children[0], qp, kv), kv)
    if isinstance(m, (And, Or)):
        lo, hi = _sets(m.children[0], qp, kv)
        for c in m.children[1:]:
            lo2, hi2 = _sets(c, qp, kv)
            n = len(qp)
            if isinstance(m, Or):
                lo, hi = np.concatenate([lo, lo2], 1), np.concatenate([hi, hi2], 1)
            else:
                lo = np.maximum(lo[:, :, None], lo2[:, None, :]).reshape(n, -1)
                hi = np.minimum(hi[:, :, None], hi2[:, None, :]).reshape(n, -1)
            lo, hi = _normalize(lo, hi, kv)
        return lo, hi
    return _leaf(m, qp, kv)


# --------------------------------------------------------------------------------------------
# block states
# --------------------------------------------------------------------------------------------
def _overlap(lo, hi, a, b):
    """Length of ``[lo, hi] ∩ [a, b]`` (broadcasting; 0 when disjoint)."""
    return np.maximum(np.minimum(hi, b) - np.maximum(lo, a) + 1, 0)


def settle(m: Mask, g, segs: Segments) -> Segments:
    """``segs`` (the state algebra's result for ``m``, requires :func:`applies`) with every
    ``UNSURE`` block replaced by its exact state, counted from the interval sets of the block's
    rows: O(bm · k) per block, nothing evaluated element by element."""
    if not (segs.state == UNSURE).any():
        return segs
    rows, cols = segs.blocks_in(UNSURE)
    tree, key_sets = _split_top(m)
    kv = g.kv_len
    rb, inv = np.unique(rows, return_inverse=True)
    inv = inv.reshape(-1)
    i = (rb[:, None] * g.bm + np.arange(g.bm)).reshape(-1)  # the rows of those row blocks
    real = i < g.q_len
    lo, hi = _sets(tree, np.minimum(i, g.q_len - 1) + g.off, kv)  # (len(rb) * bm, k)
    lo = np.where(real[:, None], lo, kv).reshape(len(rb), g.bm, -1)
    hi = np.where(real[:, None], hi, kv - 1).reshape(len(rb), g.bm, -1)
    st = np.empty(len(rows), np.int8)
    chunk = max(1, (1 << 22) // (g.bm * lo.shape[2]))
    cpos = None
    if key_sets:
        cpos = np.unique(np.concatenate([k.positions(0) for k in key_sets]))
        cpos = cpos[cpos < kv]
    for k0 in range(0, len(rows), chunk):
        sel = slice(k0, k0 + chunk)
        a = (cols[sel] * g.bn)[:, None, None]
        b = np.minimum((cols[sel] + 1) * g.bn, kv)[:, None, None] - 1
        blo, bhi = lo[inv[sel]], hi[inv[sel]]  # (K, bm, k)
        kept = _overlap(blo, bhi, a, b).sum((1, 2))
        if cpos is not None:  # |X ∪ C| = |X| + |C| - |X ∩ C| on each row
            x0, x1 = np.maximum(blo, a), np.minimum(bhi, b)
            in_x = np.where(x0 <= x1, np.searchsorted(cpos, x1, "right") - np.searchsorted(cpos, x0, "left"), 0)
            in_blk = np.searchsorted(cpos, b[:, 0, 0], "right") - np.searchsorted(cpos, a[:, 0, 0], "left")
            n_rows = real.reshape(len(rb), g.bm)[inv[sel]].sum(1)
            kept = kept + in_blk * n_rows - in_x.sum((1, 2))
        n_rows = np.minimum((rows[sel] + 1) * g.bm, g.q_len) - rows[sel] * g.bm
        size = n_rows * (b[:, 0, 0] - a[:, 0, 0] + 1)
        st[sel] = np.where(kept == 0, EMPTY, np.where(kept == size, FULL, PARTIAL))
    patch = Segments.from_blocks(g.tr, g.tc, rows, cols, st, segs.batch_shape)
    return segs.combine(patch, REPLACE_UNSURE)
