"""Analytic block classification: every (row block, column block) pair -> empty / partial / full.

Each primitive is classified exactly from the blocks' index ranges (interval reasoning), never
from a materialised ``N × N`` mask:

* interval primitives (``lo(qp) <= j <= hi(qp)`` with monotone bounds) and row filters
  (``query_range``, ``query_set``) under ``&`` form one group, classified together from per-row
  bounds (exact: rectangles and windows clipped to ranges stay exact);
* periodic primitives (``strided``, ``periodic_window``) by residue arithmetic, in time
  proportional to their output;
* documents from their runs, grid neighbourhoods from boxes of grid coordinates, user grids
  from their bits;
* primitives with per-(batch, head) parameters once per distinct parameter value.

``&``/``|``/``~`` combine the states through tables; a partial block produced from two partial
operands is marked ``UNSURE`` (unless one operand depends only on the query and the other only on
the key, which is exact) and, within a budget, refined by evaluating the mask on that block alone.
A ``mask_mod`` callable is evaluated on the blocks the rest of the expression leaves undecided.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..mask import primitives as P
from ..mask.base import BIG, Primitive, pack_bits
from ..mask.expr import And, EvalContext, Mask, Not, Or, broadcast_batch_shapes, query_offset
from ..mask.neighborhood import Geometry
from ..mask.shift import Shift
from . import rowsets
from .segments import AND_TABLE, EMPTY, FULL, NOT_TABLE, OR_TABLE, PARTIAL, REPLACE_UNSURE, UNSURE, Segments

__all__ = ["Grid", "classify", "refine", "block_context"]


@dataclass(frozen=True)
class Grid:
    """The block grid of a compile request.

    Rows cover query rows ``[r*bm, min((r+1)*bm, q_len))`` at absolute positions
    ``qlo..qhi = row + off``; columns cover keys ``[c*bn, min((c+1)*bn, kv_len))``. ``off`` is
    ``kv_len - q_len`` for ``align="bottom_right"`` and 0 for ``"top_left"``.
    """

    q_len: int
    kv_len: int
    bm: int
    bn: int
    align: str = "bottom_right"
    shift: int = 0  # extra query offset inside a ``shift(...)``

    @property
    def off(self) -> int:
        return query_offset(self.q_len, self.kv_len, self.align) + self.shift

    @property
    def tr(self) -> int:
        return -(-self.q_len // self.bm)

    @property
    def tc(self) -> int:
        return -(-self.kv_len // self.bn)

    @property
    def ilo(self) -> np.ndarray:
        return np.arange(self.tr, dtype=np.int64) * self.bm

    @property
    def ihi(self) -> np.ndarray:
        return np.minimum(self.ilo + self.bm, self.q_len) - 1

    @property
    def qlo(self) -> np.ndarray:
        return self.ilo + self.off

    @property
    def qhi(self) -> np.ndarray:
        return self.ihi + self.off

    @property
    def clo(self) -> np.ndarray:
        return np.arange(self.tc, dtype=np.int64) * self.bn

    @property
    def chi(self) -> np.ndarray:
        return np.minimum(self.clo + self.bn, self.kv_len) - 1


# --------------------------------------------------------------------------------------------
# state tables beyond segments.py's
# --------------------------------------------------------------------------------------------
def _exact_partials(table: np.ndarray) -> np.ndarray:
    """The table with partial∘partial = PARTIAL: exact when one operand depends only on the query
    row and the other only on the key (a product of a row set and a column set)."""
    t = table.copy()
    t[PARTIAL, PARTIAL] = PARTIAL
    return t


AND_RC, OR_RC = _exact_partials(AND_TABLE), _exact_partials(OR_TABLE)
_CARE_AND = np.array([[EMPTY] * 4] + [[EMPTY, PARTIAL, PARTIAL, PARTIAL]] * 3, dtype=np.int8)
_NOT_FULL = np.array([PARTIAL, PARTIAL, EMPTY, PARTIAL], dtype=np.int8)  # care where an OR is not yet full
_ONLY_FULL = np.array([EMPTY, EMPTY, FULL, EMPTY], dtype=np.int8)
_OVERRIDE_FULL = np.array([[a if b != FULL else FULL for b in range(4)] for a in range(4)], dtype=np.int8)


# --------------------------------------------------------------------------------------------
# expressions
# --------------------------------------------------------------------------------------------
def _is_groupable(m: Mask) -> bool:
    """Interval primitives and row filters, classified together under ``&`` (documents that are
    each one run of positions are intervals too)."""
    if isinstance(m, P.Document):
        return m.runs() is not None
    return isinstance(m, (P.IntervalPrimitive, P.RowPrimitive, P.QuerySet))


class _Group(Mask):
    """Classification-only node: the AND of interval primitives and row filters, one interval per
    row (``lo = max lo_k``, ``hi = min hi_k``, empty on filtered rows)."""

    __slots__ = ("parts",)

    def __init__(self, parts):
        self.parts = tuple(parts)

    @property
    def children(self):
        return ()

    def _key(self):
        return ("_group", tuple(p._ckey() for p in self.parts))

    def _own_batch_shape(self):
        return broadcast_batch_shapes(p.batch_shape for p in self.parts)

    def at(self, b: int, h: int) -> "_Group":
        return _Group([p.at(b, h) for p in self.parts])

    @property
    def kind(self) -> str:
        kinds = {p.KIND for p in self.parts}
        return kinds.pop() if len(kinds) == 1 else "general"

    def _eval(self, ctx):
        out = self.parts[0]._eval(ctx)
        for p in self.parts[1:]:
            out = out & p._eval(ctx)
        return out


def _has_mask_mod(m: Mask) -> bool:
    return any(isinstance(leaf, P.MaskMod) for leaf in m.leaves())


def classify(mask: Mask, grid: Grid, care: Segments | None = None) -> Segments:
    """Block states of ``mask`` on ``grid`` (may contain ``UNSURE`` blocks; see :func:`refine`).

    ``care``: blocks where the result matters (non-empty states); others may get any state. Only
    ``mask_mod`` uses it, to evaluate its callable where needed."""
    return _classify(mask, grid, care)[0]


def _union_sorted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted distinct values of two arrays by sorting (``np.union1d`` hashes on numpy >= 2.3,
    about 100x slower on the compiler's int64 keys)."""
    c = np.concatenate([a, b])
    c.sort(kind="stable")
    keep = np.ones(len(c), dtype=bool)
    keep[1:] = c[1:] != c[:-1]
    return c[keep]


def combine(a: Segments, b: Segments, table: np.ndarray) -> Segments:
    """``a.combine(b, table)``: pointwise combination through a 4×4 state table (broadcasting
    instances), with a sort-based union of the segment starts."""
    bs = tuple(max(x, y) for x, y in zip(a.batch_shape, b.batch_shape))
    a, b = a.broadcast_to(bs), b.broadcast_to(bs)
    keys = _union_sorted(a.key, b.key)
    sa = a.state[np.searchsorted(a.key, keys, side="right") - 1]
    sb = b.state[np.searchsorted(b.key, keys, side="right") - 1]
    return Segments._compress(bs, a.n_rowblocks, a.n_cols, keys, table[sa, sb])


def _combine(a, b, op: str):
    (sa, ka), (sb, kb) = a, b
    if {ka, kb} == {"row", "col"}:
        table = AND_RC if op == "and" else OR_RC
    else:
        table = AND_TABLE if op == "and" else OR_TABLE
    kind = ka if ka == kb else "general"
    return combine(sa, sb, table), kind


def _classify(mask: Mask, grid: Grid, care, sets: bool = True):
    """``(segments, kind)``; kind is ``"row"``, ``"col"`` or ``"general"``.

    ``sets``: where the state algebra leaves blocks ``UNSURE`` in a tree of interval-shaped
    operands, settle them exactly from the rows' interval sets (no refinement needed)."""
    if sets and rowsets.applies(mask):
        segs, kind = _classify(mask, grid, care, sets=False)
        return rowsets.settle(mask, grid, segs), kind
    if isinstance(mask, (And, Or)):
        is_and = isinstance(mask, And)
        if is_and:
            group = [c for c in mask.children if _is_groupable(c)]
            others = [c for c in mask.children if not _is_groupable(c)]
            parts = ([_Group(group)] if group else []) + others
        else:
            parts = list(mask.children)
        deferred = [c for c in parts if not isinstance(c, _Group) and _has_mask_mod(c)]
        eager = [c for c in parts if not any(c is d for d in deferred)]
        acc = None
        for c in eager:
            r = _classify(c, grid, care, sets)
            acc = r if acc is None else _combine(acc, r, "and" if is_and else "or")
        if not deferred:
            return acc
        # a mask_mod inside: evaluate this whole node, exactly, on the blocks the eager operands
        # leave undecided (not empty under &, not full under |) and the caller cares about
        if acc is None:
            return _evaluated(mask, grid, care), "general"
        undecided = acc[0] if is_and else acc[0].map_states(_NOT_FULL)
        settled = None if is_and else acc[0].map_states(_ONLY_FULL)
        return _evaluated(mask, grid, _care_and(care, undecided), settled), "general"
    if isinstance(mask, Not):
        s, k = _classify(mask.children[0], grid, care, sets)
        return s.map_states(NOT_TABLE), k
    if isinstance(mask, Shift):
        return _shift(mask, grid, care)
    if isinstance(mask, _Group) or _is_groupable(mask):
        grp = mask if isinstance(mask, _Group) else _Group([mask])
        return _per_instance(grp, grid, _group), grp.kind
    if isinstance(mask, P.MaskMod):
        return _mask_mod(mask, grid, care), "general"
    fn = _CLASSIFIERS.get(type(mask))
    if fn is None:
        raise TypeError(f"no block classifier for {type(mask).__name__}")
    if isinstance(mask, Primitive) and mask.has_tensor_params:
        return _per_instance(mask, grid, fn), mask.KIND
    return fn(mask, grid), mask.KIND


def _shift(m: Shift, g: Grid, care):
    """The operand on a grid whose query positions are moved by the offset; per-(batch, head)
    offsets: once per distinct value, each instance taking its rows from its value's result."""
    child = m.children[0]
    if not m._own_batch_shape():
        return _classify(child, replace(g, shift=g.shift + m.offset), care)
    bs = m.batch_shape
    step = g.tr * (g.tc + 1)
    done: dict = {}
    keys, states = [], []
    kind = "general"
    for b in range(bs[0]):
        for h in range(bs[1]):
            d = m.offset_at(b, h)
            if d not in done:
                seg, kind = _classify(child, replace(g, shift=g.shift + d), care)
                done[d] = seg.broadcast_to(bs)
            seg = done[d]
            z = b * bs[1] + h
            lo, hi = np.searchsorted(seg.key, [z * step, (z + 1) * step])
            keys.append(seg.key[lo:hi])
            states.append(seg.state[lo:hi])
    return Segments(tuple(bs), g.tr, g.tc, np.concatenate(keys), np.concatenate(states)), kind


def _care_and(care: Segments | None, other: Segments) -> Segments:
    return other if care is None else combine(care, other, _CARE_AND)


def _stack(parts: list, batch_shape, g: Grid) -> Segments:
    """Segments of instances ``z = 0..Z-1`` (each a one-instance Segments) as one."""
    step = g.tr * (g.tc + 1)
    return Segments(tuple(batch_shape), g.tr, g.tc,
                    np.concatenate([p.key + z * step for z, p in enumerate(parts)]),
                    np.concatenate([p.state for p in parts]))


def _per_instance(node, g: Grid, fn) -> Segments:
    """Classify ``node`` once per distinct value of its per-(batch, head) parameters."""
    bs = node.batch_shape
    if not bs:
        return fn(node, g)
    done: dict = {}
    parts = []
    for b in range(bs[0]):
        for h in range(bs[1]):
            inst = node.at(b, h)
            seg = done.get(inst)
            if seg is None:
                seg = done[inst] = fn(inst, g)
            parts.append(seg)
    return _stack(parts, bs, g)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _col_uniform(col_state: np.ndarray, g: Grid, n_rows: int | None = None) -> Segments:
    """Every row has the column states ``col_state`` (Tc,)."""
    n_rows = g.tr if n_rows is None else n_rows
    st = np.asarray(col_state, dtype=np.int8)
    change = np.ones(len(st), dtype=bool)
    change[1:] = st[1:] != st[:-1]
    starts = np.nonzero(change)[0].astype(np.int64)
    key = (np.arange(n_rows, dtype=np.int64)[:, None] * (g.tc + 1) + starts[None, :]).reshape(-1)
    return Segments((1, 1), g.tr, g.tc, key, np.tile(st[starts], n_rows))


def _row_uniform(row_state: np.ndarray, g: Grid) -> Segments:
    """Row ``r`` is ``row_state[r]`` in every column."""
    return Segments((1, 1), g.tr, g.tc, np.arange(g.tr, dtype=np.int64) * (g.tc + 1),
                    np.asarray(row_state, dtype=np.int8).copy())


def _from_intervals(g: Grid, rows, lo, hi, state=PARTIAL) -> Segments:
    """Rows whose non-empty blocks are the column intervals ``[lo, hi]`` (inclusive; may overlap,
    any order) with one state; every other block empty."""
    rows, lo, hi = _merge_intervals(rows, lo, hi, g.tc)
    n_rows = g.tr
    base = np.arange(n_rows, dtype=np.int64) * (g.tc + 1)
    k_start = rows * (g.tc + 1) + lo
    end = hi + 1
    tail = end < g.tc
    k_end = rows[tail] * (g.tc + 1) + end[tail]
    key = np.concatenate([base, k_start, k_end])
    st = np.concatenate([np.full(n_rows, EMPTY, np.int8), np.full(len(k_start), state, np.int8),
                         np.full(len(k_end), EMPTY, np.int8)])
    # at equal keys the interval start wins over the row's leading EMPTY (stable sort: later wins)
    order = np.argsort(key, kind="stable")
    key, st = key[order], st[order]
    last = np.ones(len(key), dtype=bool)
    last[:-1] = key[1:] != key[:-1]
    return Segments._compress((1, 1), g.tr, g.tc, key[last], st[last])


def _merge_intervals(rows, lo, hi, tc: int):
    """Sorted, disjoint, non-touching column intervals ``[lo, hi]`` per row (union of the input)."""
    rows, lo, hi = (np.asarray(x, np.int64) for x in (rows, lo, hi))
    ok = hi >= lo
    rows, lo, hi = rows[ok], lo[ok], hi[ok]
    if not len(rows):
        return rows, lo, hi
    order = np.lexsort((lo, rows))
    rows, lo, hi = rows[order], lo[order], hi[order]
    key = rows * (tc + 2)  # running max of hi within each row (rows never mix)
    run_hi = np.maximum.accumulate(hi + key) - key
    new = np.ones(len(rows), dtype=bool)
    new[1:] = (rows[1:] != rows[:-1]) | (lo[1:] > run_hi[:-1] + 1)
    starts = np.nonzero(new)[0]
    ends = np.append(starts[1:], len(rows)) - 1  # last interval of each merged group: its running max
    return rows[new], lo[new], run_hi[ends]


def _override_full(segs: Segments, g: Grid, rows, cols) -> Segments:
    """Set the given blocks to FULL."""
    if len(rows) == 0:
        return segs
    patch = Segments.from_blocks(g.tr, g.tc, rows, cols, np.full(len(rows), FULL, np.int8), segs.batch_shape)
    return combine(segs, patch, _OVERRIDE_FULL)


# --------------------------------------------------------------------------------------------
# interval primitives and row filters
# --------------------------------------------------------------------------------------------
def _affine_group(grp: _Group, g: Grid):
    """The group in closed form when every part is ``lo = max(c, qp + a)``, ``hi = min(c', qp + b)``
    or a range of query positions: then the non-empty rows are one run and consecutive rows'
    intervals overlap or touch (``lo`` grows by at most 1 per row), so every row block is settled
    from its first and last non-empty row, O(Tr). None when some part is of another form."""
    lo_c, lo_a, hi_c, hi_b = 0, None, g.kv_len - 1, None
    ra, rb = -BIG, BIG  # query positions [ra, rb)
    for p in grp.parts:
        rr = getattr(p, "_row_range", None)
        if rr is not None:
            a, b = rr()
            ra, rb = max(ra, a), min(rb, b)
            continue
        aff = getattr(p, "_affine", None)
        if aff is None:
            return None
        c, a, c2, b = aff()
        if c is not None:
            lo_c = max(lo_c, c)
        if a is not None:
            lo_a = a if lo_a is None else max(lo_a, a)
        if c2 is not None:
            hi_c = min(hi_c, c2)
        if b is not None:
            hi_b = b if hi_b is None else min(hi_b, b)
    qa, qb = ra, rb - 1  # non-empty query positions [qa, qb]
    if hi_b is not None:
        qa = max(qa, lo_c - hi_b)
    if lo_a is not None:
        qb = min(qb, hi_c - lo_a)
    if lo_c > hi_c or (lo_a is not None and hi_b is not None and lo_a > hi_b):
        qa, qb = 1, 0

    def lo(q):
        return np.maximum(lo_c, q + lo_a) if lo_a is not None else np.full_like(q, lo_c)

    def hi(q):
        return np.minimum(hi_c, q + hi_b) if hi_b is not None else np.full_like(q, hi_c)

    tc = g.tc
    first = np.maximum(g.qlo, qa)
    last = np.minimum(g.qhi, qb)
    any_row = first <= last
    all_rows = (first == g.qlo) & (last == g.qhi)
    n_lo = np.where(any_row, lo(first) // g.bn, tc)
    n_hi = np.where(any_row, hi(last) // g.bn + 1, tc)
    f_lo = np.clip(np.searchsorted(g.clo, lo(g.qhi), side="left"), n_lo, n_hi)
    f_hi = np.clip(np.searchsorted(g.chi, hi(g.qlo), side="right"), f_lo, n_hi)
    nofull = (f_lo >= f_hi) | ~all_rows | ~any_row
    f_lo = np.where(nofull, n_hi, f_lo)
    f_hi = np.where(nofull, n_hi, f_hi)
    zeros = np.zeros(g.tr, np.int64)
    bounds = np.stack([zeros, n_lo, f_lo, f_hi, n_hi, zeros + tc], axis=1)
    return Segments.from_boundaries(g.tr, tc, bounds, [EMPTY, PARTIAL, FULL, PARTIAL, EMPTY])


def _group(grp: _Group, g: Grid) -> Segments:
    """Per row: ``lo <= j <= hi`` (intersection of the intervals, empty on filtered rows). Per row
    block: non-empty columns span the union of its rows' intervals (exact when the union is one run
    of keys, checked; blocks where it is not are UNSURE), full columns lie inside every row's
    interval."""
    fast = _affine_group(grp, g)
    if fast is not None:
        return fast
    tc = g.tc
    qp = np.arange(g.q_len, dtype=np.int64) + g.off
    lo = np.zeros(g.q_len, np.int64)
    hi = np.full(g.q_len, g.kv_len - 1, np.int64)
    for p in grp.parts:
        if isinstance(p, (P.IntervalPrimitive, P.Document)):
            l, h = p._bounds(qp)
            lo = np.maximum(lo, l)
            hi = np.minimum(hi, h)
        else:
            keep = p._rows(qp)
            lo = np.where(keep, lo, BIG)
    ne = lo <= hi
    starts = g.ilo
    idx = np.arange(g.q_len, dtype=np.int64)
    first = np.minimum.reduceat(np.where(ne, idx, BIG), starts)
    last = np.maximum.reduceat(np.where(ne, idx, -1), starts)
    any_row = last >= 0
    all_rows = np.minimum.reduceat(ne.astype(np.int8), starts).astype(bool)
    max_lo = np.maximum.reduceat(np.where(ne, lo, BIG), starts)
    min_hi = np.minimum.reduceat(np.where(ne, hi, -BIG), starts)
    f0 = np.clip(first, 0, g.q_len - 1)
    l0 = np.clip(last, 0, g.q_len - 1)
    n_lo = np.where(any_row, lo[f0] // g.bn, tc)
    n_hi = np.where(any_row, hi[l0] // g.bn + 1, tc)
    f_lo = np.clip(np.searchsorted(g.clo, max_lo, side="left"), n_lo, n_hi)
    f_hi = np.clip(np.searchsorted(g.chi, min_hi, side="right"), f_lo, n_hi)
    nofull = (f_lo >= f_hi) | ~all_rows
    f_lo = np.where(nofull, n_hi, f_lo)
    f_hi = np.where(nofull, n_hi, f_hi)
    zeros = np.zeros(g.tr, np.int64)
    bounds = np.stack([zeros, n_lo, f_lo, f_hi, n_hi, zeros + tc], axis=1)
    # contiguity of the union of the non-empty rows' intervals inside each row block
    nz = np.nonzero(ne)[0]
    bad_block = np.zeros(g.tr, dtype=bool)
    if len(nz) > 1:
        a, b = nz[:-1], nz[1:]
        gap = (lo[b] > hi[a] + 1) & (a // g.bm == b // g.bm)
        if gap.any():
            bad_block[a[gap] // g.bm] = True
    part = np.where(bad_block, UNSURE, PARTIAL).astype(np.int8)
    states = np.stack([np.full(g.tr, EMPTY, np.int8), part, np.full(g.tr, FULL, np.int8), part,
                       np.full(g.tr, EMPTY, np.int8)], axis=1)
    return Segments.from_boundaries(g.tr, tc, bounds, states)


# --------------------------------------------------------------------------------------------
# other primitives
# --------------------------------------------------------------------------------------------
def _global_tokens(m: P.GlobalTokens, g: Grid) -> Segments:
    gt = m.g
    tc = g.tc
    k1 = np.searchsorted(g.chi, gt - 1, side="right")  # columns entirely global
    k2 = np.searchsorted(g.clo, gt - 1, side="right")  # columns touching a global key
    all_global = g.qhi < gt
    mixed = (g.qlo < gt) & ~all_global
    b1 = np.where(all_global, tc, k1)
    b2 = np.where(all_global | mixed, tc, k2)
    zeros = np.zeros(g.tr, np.int64)
    bounds = np.stack([zeros, zeros + b1, np.maximum(b2, b1), zeros + tc], axis=1)
    return Segments.from_boundaries(g.tr, tc, bounds, [FULL, PARTIAL, EMPTY])


def _one_by_one(g: Grid):
    """Rows and columns of blocks that are a single element."""
    nr = np.minimum(g.ilo + g.bm, g.q_len) - g.ilo
    nc = g.chi - g.clo + 1
    return np.nonzero(nr == 1)[0], np.nonzero(nc == 1)[0]


def _strided(m: P.Strided, g: Grid) -> Segments:
    """``(qp - j) % s == 0``: a block is non-empty iff its difference range ``[qlo - chi, qhi - clo]``
    holds a multiple of s, full only when it is a single element. When full-size blocks span at
    least ``s - 1`` differences they are all non-empty (uniform rows; the ragged last row and column
    are checked); otherwise the diagonals are enumerated, in time proportional to the output."""
    s = m.s
    if s == 1:
        return Segments.uniform(g.tr, g.tc, FULL)
    nr = np.minimum(g.ilo + g.bm, g.q_len) - g.ilo
    nc = g.chi - g.clo + 1

    def nonempty(rr, cc):
        dmin = g.qlo[rr] - g.chi[cc]
        dmax = g.qhi[rr] - g.clo[cc]
        return (dmax // s) * s >= dmin

    if g.bm + g.bn - 2 >= s - 1:
        last_r, last_c = g.tr - 1, g.tc - 1
        ragged_r = nr[last_r] != g.bm
        ragged_c = nc[last_c] != g.bn
        base = np.arange(g.tr, dtype=np.int64) * (g.tc + 1)
        keys = [base]
        sts = [np.full(g.tr, PARTIAL, np.int8)]
        if ragged_c:  # the last column, row by row
            st_c = np.where(nonempty(np.arange(g.tr), np.full(g.tr, last_c)), PARTIAL, EMPTY).astype(np.int8)
            keys.append(base + last_c)
            sts.append(st_c)
        key = np.concatenate(keys)
        st = np.concatenate(sts)
        if ragged_r:  # the last row, column by column: replaces what was set above
            row = np.where(nonempty(np.full(g.tc, last_r), np.arange(g.tc)), PARTIAL, EMPTY).astype(np.int8)
            other = key // (g.tc + 1) != last_r
            key, st = key[other], st[other]
            key = np.concatenate([key, base[last_r] + np.arange(g.tc)])
            st = np.concatenate([st, row])
        order = np.argsort(key, kind="stable")
        key, st = key[order], st[order]
        last = np.ones(len(key), dtype=bool)
        last[:-1] = key[1:] != key[:-1]
        out = Segments._compress((1, 1), g.tr, g.tc, key[last], st[last])
    else:
        # sparse diagonals: for each row block the multiples k·s of the distance give key ranges
        qlo, qhi = g.qlo, g.qhi
        kmin = -((-(qlo - (g.kv_len - 1))) // s)  # ceil
        kmax = np.floor_divide(qhi, s)
        cnt = np.maximum(kmax - kmin + 1, 0)
        rows = np.repeat(np.arange(g.tr, dtype=np.int64), cnt)
        k = np.repeat(kmin, cnt) + (np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt))
        a = np.maximum(qlo[rows] - k * s, 0)
        b = np.minimum(qhi[rows] - k * s, g.kv_len - 1)
        out = _from_intervals(g, rows, a // g.bn, b // g.bn)
    # blocks of one element are full where kept
    r1, c1 = _one_by_one(g)
    if len(r1) and len(c1):
        rr = np.repeat(r1, len(c1))
        cc = np.tile(c1, len(r1))
        keep = nonempty(rr, cc)
        out = _override_full(out, g, rr[keep], cc[keep])
    return out


def _summary(m: P.Summary, g: Grid) -> Segments:
    stride, c = m.stride, m.c

    def count(x):  # kept keys in [0, x)
        return (x // stride) * c + np.maximum(0, x % stride - (stride - c))

    kept = count(g.chi + 1) - count(g.clo)
    col_state = np.where(kept == g.chi - g.clo + 1, FULL, np.where(kept > 0, PARTIAL, EMPTY)).astype(np.int8)
    return _col_uniform(col_state, g)


def _count_state(count, size) -> np.ndarray:
    return np.where(count >= size, FULL, np.where(count > 0, PARTIAL, EMPTY)).astype(np.int8)


def _key_set(m: P.KeySet, g: Grid) -> Segments:
    pos = m.positions(0)
    pos = pos[pos < g.kv_len]
    cnt = np.bincount(pos // g.bn, minlength=g.tc)[: g.tc]
    return _col_uniform(_count_state(cnt, g.chi - g.clo + 1), g)


def _query_set_rows(m, qp: np.ndarray) -> np.ndarray:
    return np.isin(qp, m.positions(0))


def _periodic_window(m: P.PeriodicWindow, g: Grid) -> Segments:
    """``|qp % P - j % P| <= w``: a block's state depends on the residues its rows and columns
    cover (arcs of the circle ``Z_P``); rows (columns) with equal arcs share states."""
    period, w = m.period, m.w
    if w >= period - 1:
        return Segments.uniform(g.tr, g.tc, FULL)

    def arcs(x0, n):
        """Residues of ``[x0, x0 + n)`` mod P: a first interval, and a second one (``[0, e]``) for
        the classes that wrap around, with their indices."""
        a = np.mod(x0, period)
        e = a + n - 1
        whole = n >= period
        wrap = (e >= period) & ~whole
        lo1 = np.where(whole, 0, a)
        hi1 = np.where(whole | wrap, period - 1, e)
        idx = np.nonzero(wrap)[0]
        return lo1, hi1, idx, np.zeros(len(idx), np.int64), (e - period)[idx]

    nr = np.minimum(g.ilo + g.bm, g.q_len) - g.ilo
    nc = g.chi - g.clo + 1
    rkey = np.stack([np.mod(g.qlo, period), nr], 1)
    ckey = np.stack([np.mod(g.clo, period), nc], 1)
    ru, rinv = np.unique(rkey, axis=0, return_inverse=True)
    cu, cinv = np.unique(ckey, axis=0, return_inverse=True)
    rinv, cinv = rinv.reshape(-1), cinv.reshape(-1)
    a_lo, a_hi, ra, a2_lo, a2_hi = arcs(ru[:, 0], ru[:, 1])
    b_lo, b_hi, ca, b2_lo, b2_hi = arcs(cu[:, 0], cu[:, 1])

    def some(al, ah, bl, bh):  # some pair within w
        return np.maximum(al[:, None] - bh[None, :], bl[None, :] - ah[:, None]) <= w

    def every(al, ah, bl, bh):  # every pair within w
        return np.maximum(ah[:, None] - bl[None, :], bh[None, :] - al[:, None]) <= w

    anyk = some(a_lo, a_hi, b_lo, b_hi)
    allk = every(a_lo, a_hi, b_lo, b_hi)
    if len(ra):
        anyk[ra] |= some(a2_lo, a2_hi, b_lo, b_hi)
        allk[ra] &= every(a2_lo, a2_hi, b_lo, b_hi)
    if len(ca):
        anyk[:, ca] |= some(a_lo, a_hi, b2_lo, b2_hi)
        allk[:, ca] &= every(a_lo, a_hi, b2_lo, b2_hi)
    if len(ra) and len(ca):
        anyk[np.ix_(ra, ca)] |= some(a2_lo, a2_hi, b2_lo, b2_hi)
        allk[np.ix_(ra, ca)] &= every(a2_lo, a2_hi, b2_lo, b2_hi)
    table = np.where(allk, FULL, np.where(anyk, PARTIAL, EMPTY)).astype(np.int8)  # (R, C)
    # per row class: its states over all columns, segments once, then one copy per row
    cls_states = table[:, cinv]  # (R, Tc)
    seg = Segments.from_dense(cls_states)
    per_cls = np.searchsorted(seg.rows, np.arange(len(ru) + 1))
    lens = per_cls[rinv + 1] - per_cls[rinv]
    src = np.repeat(per_cls[rinv], lens) + (np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens))
    rows = np.repeat(np.arange(g.tr, dtype=np.int64), lens)
    key = rows * (g.tc + 1) + seg.starts[src]
    return Segments((1, 1), g.tr, g.tc, key, seg.state[src].copy())


def _document(m: P.Document, g: Grid) -> Segments:
    ids = m.ids.detach().to("cpu").long().numpy()  # (Bd, L)
    parts = [_document_one(ids[z], g) for z in range(ids.shape[0])]
    return _stack(parts, (ids.shape[0], 1), g)


def _document_one(ids: np.ndarray, g: Grid) -> Segments:
    """Documents from their runs of equal ids: O(L) to find the runs, then O(Tr log Tc) when each
    document is one run (relabelled by run, sorted or not), else a join of row and column blocks on
    the ids they hold (proportional to the non-empty blocks)."""
    L = len(ids)
    change = np.ones(L, dtype=bool)
    change[1:] = ids[1:] != ids[:-1]
    run_start = np.nonzero(change)[0]
    labels = ids[run_start]
    vlo = np.maximum(g.qlo, 0)  # valid query positions of each row block: [vlo, vhi]
    vhi = np.minimum(g.qhi, L - 1)
    rows_valid = vlo <= vhi
    rows_all = (g.qlo >= 0) & (g.qhi <= L - 1)
    if len(np.unique(labels)) == len(labels):  # every document is one run: relabel by run (monotone)
        run = np.cumsum(change) - 1
        return _sorted_ids(run, g, vlo, vhi, rows_valid, rows_all)
    return _document_join(ids, run_start, labels, g, vlo, vhi, rows_valid, rows_all)


def _sorted_ids(ids: np.ndarray, g: Grid, vlo, vhi, rows_valid, rows_all) -> Segments:
    tc = g.tc
    L = len(ids)
    idmin = ids[np.clip(vlo, 0, L - 1)]
    idmax = ids[np.clip(vhi, 0, L - 1)]
    cmin, cmax = ids[g.clo], ids[g.chi]
    n_lo = np.searchsorted(cmax, idmin, side="left")
    n_hi = np.searchsorted(cmin, idmax, side="right")
    ok = rows_valid & (n_lo < n_hi)
    n_lo = np.where(ok, n_lo, tc)
    n_hi = np.where(ok, n_hi, tc)
    single = (idmin == idmax) & rows_all & ok
    f_lo = np.clip(np.searchsorted(cmin, idmin, side="left"), n_lo, n_hi)
    f_hi = np.clip(np.searchsorted(cmax, idmax, side="right"), f_lo, n_hi)
    f_lo = np.where(single & (f_lo < f_hi), f_lo, n_hi)
    f_hi = np.where(single & (f_lo < f_hi), f_hi, n_hi)
    zeros = np.zeros(g.tr, np.int64)
    bounds = np.stack([zeros, n_lo, f_lo, f_hi, n_hi, zeros + tc], axis=1)
    return Segments.from_boundaries(g.tr, tc, bounds, [EMPTY, PARTIAL, FULL, PARTIAL, EMPTY])


def _blocks_ids(lo, hi, run_start, labels, L):
    """``(owner, label)`` pairs: the labels of the runs meeting each position range ``[lo, hi]``."""
    run_end = np.append(run_start[1:], L) - 1
    ok = lo <= hi
    first = np.searchsorted(run_end, lo, side="left")
    last = np.searchsorted(run_start, hi, side="right") - 1
    cnt = np.where(ok, last - first + 1, 0)
    owner = np.repeat(np.arange(len(lo), dtype=np.int64), cnt)
    run = np.repeat(first, cnt) + (np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    pairs = np.unique(np.stack([owner, labels[run]], 1), axis=0) if len(owner) else np.zeros((0, 2), np.int64)
    return pairs[:, 0], pairs[:, 1]


def _document_join(ids, run_start, labels, g: Grid, vlo, vhi, rows_valid, rows_all) -> Segments:
    L = len(ids)
    _, lab = np.unique(labels, return_inverse=True)
    lab = lab.reshape(-1).astype(np.int64)
    r_own, r_lab = _blocks_ids(np.where(rows_valid, vlo, 1), np.where(rows_valid, vhi, 0), run_start, lab, L)
    c_own, c_lab = _blocks_ids(g.clo, g.chi, run_start, lab, L)
    n_r = np.bincount(r_own, minlength=g.tr)
    n_c = np.bincount(c_own, minlength=g.tc)
    # join on the label: rows of label x times columns of label x
    order_c = np.argsort(c_lab, kind="stable")
    c_own_s, c_lab_s = c_own[order_c], c_lab[order_c]
    c_first = np.searchsorted(c_lab_s, r_lab, side="left")
    c_cnt = np.searchsorted(c_lab_s, r_lab, side="right") - c_first
    rows = np.repeat(r_own, c_cnt)
    pos = np.repeat(c_first, c_cnt) + (np.arange(int(c_cnt.sum())) - np.repeat(np.cumsum(c_cnt) - c_cnt, c_cnt))
    cols = c_own_s[pos]
    blk = np.unique(rows * g.tc + cols)
    rows, cols = blk // g.tc, blk % g.tc
    full = (n_r[rows] == 1) & (n_c[cols] == 1) & rows_all[rows]
    return Segments.from_blocks(g.tr, g.tc, rows, cols, np.where(full, FULL, PARTIAL).astype(np.int8))


def _cells(g: Grid, i0, i1, j0, j1, batch_shape=(1, 1), z=None) -> Segments:
    """Classify from disjoint kept rectangles ``[i0, i1) × [j0, j1)`` (row-index space) by
    comparing each block's covered area with its size."""
    z = np.zeros(len(i0), np.int64) if z is None else np.asarray(z, np.int64)
    i0, i1 = np.clip(i0, 0, g.q_len), np.clip(i1, 0, g.q_len)
    j0, j1 = np.clip(j0, 0, g.kv_len), np.clip(j1, 0, g.kv_len)
    ok = (i1 > i0) & (j1 > j0)
    i0, i1, j0, j1, z = i0[ok], i1[ok], j0[ok], j1[ok], z[ok]
    r0, r1 = i0 // g.bm, (i1 - 1) // g.bm + 1
    c0, c1 = j0 // g.bn, (j1 - 1) // g.bn + 1
    nr, nc = r1 - r0, c1 - c0
    cnt = nr * nc
    cell = np.repeat(np.arange(len(i0)), cnt)
    k = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    r = r0[cell] + k // nc[cell]
    c = c0[cell] + k % nc[cell]
    ri0 = np.maximum(i0[cell], r * g.bm)
    ri1 = np.minimum(i1[cell], np.minimum((r + 1) * g.bm, g.q_len))
    cj0 = np.maximum(j0[cell], c * g.bn)
    cj1 = np.minimum(j1[cell], np.minimum((c + 1) * g.bn, g.kv_len))
    area = (ri1 - ri0) * (cj1 - cj0)
    row = z[cell] * g.tr + r
    blk = row * g.tc + c
    ub, inv = np.unique(blk, return_inverse=True)
    covered = np.bincount(inv, weights=area).astype(np.int64)
    urow, ucol = ub // g.tc, ub % g.tc
    rr = urow % g.tr
    size = (np.minimum((rr + 1) * g.bm, g.q_len) - rr * g.bm) * (np.minimum((ucol + 1) * g.bn, g.kv_len) - ucol * g.bn)
    st = np.where(covered >= size, FULL, PARTIAL).astype(np.int8)
    return Segments.from_blocks(g.tr, g.tc, urow, ucol, st, batch_shape)


def _random_blocks(m: P.RandomBlocks, g: Grid) -> Segments:
    bs = m.block_size
    n_kb = -(-g.kv_len // bs)
    qb_lo = max(0, g.off) // bs
    qb = np.arange(qb_lo, n_kb, dtype=np.int64)
    ch = m.chosen(qb, n_kb)  # (nq, r)
    rr = ch.shape[1]
    qb_rep = np.repeat(qb, rr)
    kb = ch.reshape(-1)
    pos0 = np.maximum(qb_rep * bs, 0)  # qp >= 0 only
    return _cells(g, pos0 - g.off, (qb_rep + 1) * bs - g.off, kb * bs, (kb + 1) * bs)


# --------------------------------------------------------------------------------------------
# user grids (bit-packed)
# --------------------------------------------------------------------------------------------
_POPCOUNT = np.array([bin(x).count("1") for x in range(256)], dtype=np.uint8)


def _unpack_rows(words: np.ndarray, n_cols: int) -> np.ndarray:
    """int32 words ``(R, W)`` -> bool ``(R, n_cols)``."""
    b = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    return b[:, :n_cols].astype(bool)


def _block_mask(m: P.BlockMask, g: Grid) -> Segments:
    """One bit per mask block. Layout blocks equal to the mask's blocks take the bit directly
    (FULL or EMPTY); other block sizes compare each layout block with the mask blocks it covers
    (2-D prefix counts). One instance at a time, never an int64 copy of the grid."""
    words = m.tensor.numpy()  # (B, H, R, W) int32
    B, H, R, _ = words.shape
    C = m.n_cols
    bs = m.block_size
    parts = []
    rlo = g.ilo // bs
    rhi = g.ihi // bs
    clo = g.clo // bs
    chi = g.chi // bs
    for z in range(B * H):
        grid = _unpack_rows(words[z // H, z % H], C)
        if bs == g.bm == g.bn:
            parts.append(Segments.from_dense((grid.astype(np.int8) * FULL)[: g.tr, : g.tc]))
            continue
        cs = np.zeros((R + 1, C + 1), np.int64)
        np.cumsum(np.cumsum(grid, 0), 1, out=cs[1:, 1:])
        a = cs[rhi + 1][:, chi + 1] - cs[rlo][:, chi + 1] - cs[rhi + 1][:, clo] + cs[rlo][:, clo]
        size = (rhi - rlo + 1)[:, None] * (chi - clo + 1)[None, :]
        parts.append(Segments.from_dense(_count_state(a, size)))
    return _stack(parts, (B, H), g)


def _dense_mask(m: P.DenseMask, g: Grid) -> Segments:
    """Counts of kept elements per block straight from the bits (a byte popcount table when the
    column blocks are whole bytes), a band of row blocks at a time."""
    words = m.tensor.numpy()  # (B, H, Lq, W)
    B, H = words.shape[:2]
    W = words.shape[-1]
    nr = (np.minimum(g.ilo + g.bm, g.q_len) - g.ilo)[:, None]
    nc = (g.chi - g.clo + 1)[None, :]
    step = max(1, (1 << 22) // max(1, g.bm * W * 32))
    parts = []
    for z in range(B * H):
        wz = words[z // H, z % H]
        rows_st = []
        for r0 in range(0, g.tr, step):
            r1 = min(g.tr, r0 + step)
            i0, i1 = r0 * g.bm, min(r1 * g.bm, g.q_len)
            chunk = np.zeros(((r1 - r0) * g.bm, W), np.int32)
            chunk[: i1 - i0] = wz[i0:i1]
            if g.bn % 8 == 0:
                cnt8 = _POPCOUNT[chunk.view(np.uint8)]  # (rows, 4W) per-byte counts
                nb = g.bn // 8
                pad = g.tc * nb - cnt8.shape[1]
                if pad > 0:
                    cnt8 = np.pad(cnt8, ((0, 0), (0, pad)))
                cnt = cnt8[:, : g.tc * nb].reshape(r1 - r0, g.bm, g.tc, nb).sum((1, 3), dtype=np.int64)
            else:
                bits = _unpack_rows(chunk, g.tc * g.bn if g.tc * g.bn <= W * 32 else W * 32)
                if bits.shape[1] < g.tc * g.bn:
                    bits = np.pad(bits, ((0, 0), (0, g.tc * g.bn - bits.shape[1])))
                cnt = bits.reshape(r1 - r0, g.bm, g.tc, g.bn).sum((1, 3), dtype=np.int64)
            rows_st.append(_count_state(cnt, nr[r0:r1] * nc))
        parts.append(Segments.from_dense(np.concatenate(rows_st, 0)))
    return _stack(parts, (B, H), g)


# --------------------------------------------------------------------------------------------
# mask_mod: evaluated on the blocks that matter
# --------------------------------------------------------------------------------------------
def _evaluated(node: Mask, g: Grid, care: Segments | None, settled: Segments | None = None) -> Segments:
    """Exact states of ``node`` on the blocks of ``care`` (all blocks when None) by evaluating it
    there; other blocks take ``settled`` (FULL/EMPTY) or EMPTY."""
    own = node.batch_shape or (1, 1)
    shapes = [own] + [s.batch_shape for s in (care, settled) if s is not None]
    bs = tuple(broadcast_batch_shapes(shapes) or (1, 1))
    segs = Segments.uniform(g.tr, g.tc, PARTIAL, bs) if care is None else care.broadcast_to(bs)
    rows, cols, _ = segs.blocks(nonempty=True)
    st = evaluate_blocks(node, g, rows, cols, bs)
    out = Segments.from_blocks(g.tr, g.tc, rows, cols, st, bs)
    return out if settled is None else combine(settled.broadcast_to(bs), out, OR_TABLE)


def _mask_mod(m: P.MaskMod, g: Grid, care: Segments | None) -> Segments:
    return _evaluated(m, g, care)


def evaluate_blocks(mask: Mask, g: Grid, rows: np.ndarray, cols: np.ndarray, batch_shape, bits: bool = False):
    """Exact states of blocks ``(rows = z * Tr + r, cols)`` by evaluating ``mask`` on them, a few
    million elements at a time. With ``bits``, also the kept elements, one bit each: int32
    ``(K, bm, ceil(bn / 32))`` (:func:`blocksparse_fa.mask.base.pack_bits`)."""
    st = np.zeros(len(rows), np.int8)
    kept_all = [] if bits else None
    per_block = g.bm * g.bn
    chunk = max(1, (1 << 22) // per_block)
    for k0 in range(0, len(rows), chunk):
        sel = slice(k0, min(len(rows), k0 + chunk))
        ctx, valid = block_context(mask, g, rows[sel], cols[sel], batch_shape=batch_shape)
        kept = mask._eval(ctx).expand(valid.shape) & valid
        n_kept = kept.sum((1, 2))
        n_valid = valid.sum((1, 2))
        st[sel] = torch.where(n_kept == 0, EMPTY, torch.where(n_kept == n_valid, FULL, PARTIAL)).numpy()
        if bits:
            kept_all.append(pack_bits(kept))
    if bits:
        return st, (torch.cat(kept_all) if kept_all else torch.zeros(0, g.bm, -(-g.bn // 32), dtype=torch.int32))
    return st


# --------------------------------------------------------------------------------------------
# grid neighbourhoods (NATTEN, STA)
# --------------------------------------------------------------------------------------------
def _window_bounds(x0, x1, G: int, K: int, D: int):
    """Per query coordinate interval ``[x0, x1]``: the window starts ``s(x0)``, ``s(x1)`` (D == 1;
    the windows of the interval's coordinates cover ``[s(x0), s(x1) + K - 1]``), or None (D > 1)."""
    if D != 1:
        return None
    return Geometry.window_start(x0, G, K, 1)[1], Geometry.window_start(x1, G, K, 1)[1]


def _any_all_1d(x0, x1, y0, y1, G: int, K: int, D: int, s01=None):
    """For coordinate intervals ``X = [x0, x1]`` (queries) and ``Y = [y0, y1]`` (keys) along one dim:
    whether some pair is kept, and whether every pair is (``s01``: :func:`_window_bounds`)."""
    if D == 1:
        s0, s1 = s01 if s01 is not None else _window_bounds(x0, x1, G, K, 1)
        anyk = (s0 <= y1) & (s1 + K - 1 >= y0)
        allk = (s1 <= y0) & (y1 <= s0 + K - 1)
        return anyk, allk
    anyk = np.zeros(np.shape(x0), bool)
    for grp in range(D):
        t0 = -((-(x0 - grp)) // D)
        t1 = (x1 - grp) // D
        u0 = -((-(y0 - grp)) // D)
        u1 = (y1 - grp) // D
        n = (G - grp + D - 1) // D
        s0 = np.minimum(np.maximum(t0 - K // 2, 0), n - K)
        s1 = np.minimum(np.maximum(t1 - K // 2, 0), n - K)
        anyk |= (t0 <= t1) & (u0 <= u1) & (s0 <= u1) & (s1 + K - 1 >= u0)
    allk = anyk & (x0 == x1) & (y0 == y1)
    return anyk, allk


def _grid_neighborhood(m, g: Grid) -> Segments:
    """Boxes: a row block's positions, as offsets into the grid's digit system, split into at most
    ``2·digits - 1`` boxes, each a product of coordinate intervals (likewise for column blocks);
    a pair of boxes keeps something iff every dim does (1-D window reasoning), keeps everything iff
    every dim does. Only column blocks between the smallest and largest key position a row block's
    windows can reach are examined."""
    geo = m.geometry
    start = m._params[4]
    V = geo.V
    # row blocks -> offsets inside the grid
    a = np.maximum(g.qlo - start, 0)
    b = np.minimum(g.qhi - start, V - 1)
    rvalid = a <= b
    r_full = (g.qlo - start >= 0) & (g.qhi - start <= V - 1)
    rr = np.nonzero(rvalid)[0]
    q_own, q_lo, q_hi = geo.boxes(a[rr], b[rr])
    q_own = rr[q_own]
    ca = np.maximum(g.clo - start, 0)
    cb = np.minimum(g.chi - start, V - 1)
    cvalid = ca <= cb
    c_full = (g.clo - start >= 0) & (g.chi - start <= V - 1)
    cc = np.nonzero(cvalid)[0]
    k_own, k_lo, k_hi = geo.boxes(ca[cc], cb[cc])
    k_own = cc[k_own]
    if len(q_own) == 0 or len(k_own) == 0:
        return Segments.uniform(g.tr, g.tc, EMPTY)
    # reachable key coordinates of each query box, then positions -> candidate column blocks
    lo_c, hi_c = [], []
    for d in range(geo.ndim):
        G, K, D = geo.G[d], geo.K[d], geo.D[d]
        if D == 1:
            lo_c.append(Geometry.window_start(q_lo[:, d], G, K, 1)[1])
            hi_c.append(Geometry.window_start(q_hi[:, d], G, K, 1)[1] + K - 1)
        else:
            lo_c.append(np.maximum(q_lo[:, d] - (K - 1) * D, 0))
            hi_c.append(np.minimum(q_hi[:, d] + (K - 1) * D, G - 1))
    # candidate column blocks: those the runs of each query box's reachable key box touch
    run_own, run_lo, run_hi = geo.key_runs(np.stack(lo_c, 1), np.stack(hi_c, 1))
    c0 = np.clip(run_lo + start, 0, g.kv_len - 1) // g.bn
    c1 = np.clip(run_hi + start, 0, g.kv_len - 1) // g.bn
    ok = (run_hi + start >= 0) & (run_lo + start <= g.kv_len - 1)
    ir, c0, c1 = _merge_intervals(q_own[run_own][ok], c0[ok], c1[ok], g.tc)
    cnt = c1 - c0 + 1
    pr = np.repeat(ir, cnt)
    pc = np.repeat(c0, cnt) + (np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    # prefilter: the column block's coordinate bounding box must meet the row block's reachable box
    q_first = np.searchsorted(q_own, np.arange(g.tr + 1))
    k_first = np.searchsorted(k_own, np.arange(g.tc + 1))
    lo_c, hi_c = np.stack(lo_c, 1), np.stack(hi_c, 1)
    rq = np.nonzero(q_first[1:] > q_first[:-1])[0]
    reach_lo = np.zeros((g.tr, geo.ndim), np.int64)
    reach_hi = np.zeros((g.tr, geo.ndim), np.int64)
    reach_lo[rq] = np.minimum.reduceat(lo_c, q_first[rq], axis=0)
    reach_hi[rq] = np.maximum.reduceat(hi_c, q_first[rq], axis=0)
    kc = np.nonzero(k_first[1:] > k_first[:-1])[0]
    box_lo = np.zeros((g.tc, geo.ndim), np.int64)
    box_hi = np.full((g.tc, geo.ndim), -1, np.int64)
    box_lo[kc] = np.minimum.reduceat(k_lo, k_first[kc], axis=0)
    box_hi[kc] = np.maximum.reduceat(k_hi, k_first[kc], axis=0)
    keepc = cvalid[pc]
    for d in range(geo.ndim):
        keepc &= (box_lo[pc, d] <= reach_hi[pr, d]) & (box_hi[pc, d] >= reach_lo[pr, d])
    pr, pc = pr[keepc], pc[keepc]
    if len(pr) == 0:
        return Segments.uniform(g.tr, g.tc, EMPTY)
    # box pairs of each candidate (row block, column block)
    nq = (q_first[pr + 1] - q_first[pr])
    nk = (k_first[pc + 1] - k_first[pc])
    n = nq * nk
    pair = np.repeat(np.arange(len(pr)), n)
    off = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    qi = q_first[pr][pair] + off // nk[pair]
    ki = k_first[pc][pair] + off % nk[pair]
    anyk = np.ones(len(pair), bool)
    allk = np.ones(len(pair), bool)
    for d in range(geo.ndim):
        G, K, D = geo.G[d], geo.K[d], geo.D[d]
        if G == 1:
            continue
        sb = _window_bounds(q_lo[:, d], q_hi[:, d], G, K, D)  # per query box, gathered per pair
        s01 = None if sb is None else (sb[0][qi], sb[1][qi])
        a1, l1 = _any_all_1d(q_lo[qi, d], q_hi[qi, d], k_lo[ki, d], k_hi[ki, d], G, K, D, s01)
        anyk &= a1
        allk &= l1
    first_pair = np.cumsum(n) - n  # pairs of candidate k are pair[first_pair[k]:...] (n > 0 for all)
    nonempty = np.logical_or.reduceat(anyk, first_pair)
    full = np.logical_and.reduceat(allk, first_pair) & r_full[pr] & c_full[pc] & nonempty
    sel = nonempty
    st = np.where(full, FULL, PARTIAL).astype(np.int8)
    return Segments.from_blocks(g.tr, g.tc, pr[sel], pc[sel], st[sel])


_CLASSIFIERS = {
    P.GlobalTokens: _global_tokens,
    P.Strided: _strided,
    P.Summary: _summary,
    P.KeySet: lambda m, g: _per_instance_sets(m, g, _key_set),
    P.PeriodicWindow: _periodic_window,
    P.Document: _document,
    P.RandomBlocks: _random_blocks,
    P.BlockMask: _block_mask,
    P.DenseMask: _dense_mask,
    P.Neighborhood: _grid_neighborhood,
    P.SlidingTiles: _grid_neighborhood,
}


def _per_instance_sets(m, g: Grid, fn) -> Segments:
    """Position sets with one set per batch row."""
    B = m.tensor.shape[0]
    if B == 1:
        return fn(m, g)
    parts = [fn(type(m)(m.tensor[b:b + 1]), g) for b in range(B)]
    return _stack(parts, (B, 1), g)


# --------------------------------------------------------------------------------------------
# refinement
# --------------------------------------------------------------------------------------------
def block_context(mask: Mask, g: Grid, rows: np.ndarray, cols: np.ndarray, device="cpu", batch_shape=None):
    """Evaluation context for a batch of blocks: index tensors ``(K, bm, 1)``/``(K, 1, bn)`` and a
    validity mask for ragged edges. ``rows = z * Tr + r`` with instances ``z`` of ``batch_shape``
    (default the mask's)."""
    rows_t = torch.as_tensor(rows, dtype=torch.long, device=device)
    cols_t = torch.as_tensor(cols, dtype=torch.long, device=device)
    r = rows_t % g.tr
    zi = rows_t // g.tr
    i = (r * g.bm).view(-1, 1, 1) + torch.arange(g.bm, device=device).view(1, -1, 1)
    j = (cols_t * g.bn).view(-1, 1, 1) + torch.arange(g.bn, device=device).view(1, 1, -1)
    valid = (i < g.q_len) & (j < g.kv_len)
    bs = batch_shape or mask.batch_shape or (1, 1)
    b = (zi // bs[1]).view(-1, 1, 1)
    h = (zi % bs[1]).view(-1, 1, 1)
    ic = i.clamp(max=g.q_len - 1)
    jc = j.clamp(max=g.kv_len - 1)
    return EvalContext(g.q_len, g.kv_len, ic, ic + g.off, jc, b, h), valid


def refine(segs: Segments, mask: Mask, g: Grid, budget: int) -> tuple[Segments, int]:
    """Evaluate ``UNSURE`` blocks exactly while the element budget lasts; the rest become partial.
    Touches only the uncertain blocks (not every non-empty one).

    Returns the new segments and the number of blocks refined.
    """
    if not (segs.state == UNSURE).any():
        return segs, 0
    rows, cols = segs.blocks_in(UNSURE)
    n_eval = min(len(rows), budget // (g.bm * g.bn))
    st = np.full(len(rows), PARTIAL, np.int8)
    if n_eval:
        st[:n_eval] = evaluate_blocks(mask, g, rows[:n_eval], cols[:n_eval], segs.batch_shape)
    # a patch holding the settled states (EMPTY where nothing else is), applied where UNSURE
    patch = Segments.from_blocks(g.tr, g.tc, rows, cols, st, segs.batch_shape)
    return combine(segs, patch, REPLACE_UNSURE), int(n_eval)
