"""Assigning query blocks to ranks from the layout's cost (host side, numpy).

The sequence is cut into *units* of whole layout blocks; a rank owns the queries and the keys of
its units. What a rank computes is what its units' query rows visit, so the cost of a unit is the
work of its rows: ``full blocks + kappa * partial blocks`` (``kappa``: a partial tile's cost over a
full one's, about 2.6 for the forward kernels on the H100, ``benchmarks/NOTES.md``). Rows that
visit far more blocks than the others (global tokens) are *split*: every rank computes their
blocks whose keys it owns, and the parts are merged exactly through their logsumexps. Their
cost therefore counts on the units of their keys.

Three ways to assign units, each keeping the locality that saves traffic for some patterns:

* ``contiguous``: ``P`` contiguous pieces of equal cost (bands, documents: a rank fetches only the
  halo at its two boundaries);
* ``zigzag`` (head-tail): ``2P`` equal pieces, rank ``r`` gets pieces ``r`` and ``2P - 1 - r``
  (causal: equal cost and equal tokens);
* ``greedy``: groups of units assigned largest first to the least loaded rank (irregular
  patterns, where locality buys little).
"""

from __future__ import annotations

import numpy as np

from ..compiler.layout import BlockLayout
from ..compiler.segments import FULL, PARTIAL

__all__ = ["STRATEGIES", "row_costs", "row_counts", "split_rows", "unit_costs", "assign", "halo_counter"]

STRATEGIES = ("contiguous", "zigzag", "greedy")


def _counts(layout: BlockLayout):
    """``(full, partial)`` blocks per row block (summed over instances), cached on the layout."""
    hit = layout.cache.get("cp_row_counts")
    if hit is None:
        segs = layout._segs
        tr = segs.n_rowblocks
        rows, n = segs.rows % tr, segs.ends - segs.starts
        hit = layout.cache["cp_row_counts"] = tuple(
            np.bincount(rows, weights=n * (segs.state == st), minlength=tr) for st in (FULL, PARTIAL))
    return hit


def row_costs(layout: BlockLayout, kappa: float) -> np.ndarray:
    """``(Tr,)`` float: ``full + kappa * partial`` blocks of each row block, summed over the
    layout's batch/head instances."""
    full, part = _counts(layout)
    return full + kappa * part


def split_rows(costs: np.ndarray, counts: np.ndarray, factor: float, n_ranks: int, window: int = 8) -> np.ndarray:
    """Row blocks to split between ranks (global query tokens), sorted: rows costing more than
    ``factor`` times the mean row that also visit more than ``factor`` times as many blocks as any
    of their ``window`` neighbours on each side. A row that is heavy like its neighbours (a long
    document, the bottom of a causal mask) shares its key blocks with them, and fetching those
    pays off; a global row's keys serve it alone. None for one rank or ``factor <= 0``."""
    n = len(costs)
    if n_ranks < 2 or factor <= 0 or n < 2:
        return np.zeros(0, np.int64)
    cand = np.nonzero((costs > factor * costs.mean()) & (counts >= 2 * n_ranks))[0]
    keep = [r for r in cand
            if counts[r] > factor * np.concatenate([counts[max(0, r - window):r], counts[r + 1:r + 1 + window],
                                                    [0]]).max()]
    return np.asarray(keep, dtype=np.int64)


def row_counts(layout: BlockLayout) -> np.ndarray:
    """``(Tr,)``: non-empty blocks of each row block, summed over the layout's instances."""
    full, part = _counts(layout)
    return full + part


def _col_costs(layout: BlockLayout, rows: np.ndarray, kappa: float) -> np.ndarray:
    """``(Tc,)``: the cost of the given rows' blocks, per key block (where split rows are paid)."""
    segs = layout._segs
    tr, tc = segs.n_rowblocks, segs.n_cols
    out = np.zeros(tc + 1)
    if len(rows) == 0:
        return out[:tc]
    sel = np.nonzero(np.isin(segs.rows % tr, rows) & (segs.state != 0))[0]
    st = segs.state[sel]
    starts = segs.key[sel] % (tc + 1)
    ends = segs.ends[sel]
    w = np.where(st == FULL, 1.0, kappa)
    np.add.at(out, starts, w)
    np.add.at(out, ends, -w)
    return np.cumsum(out)[:tc]


def unit_costs(layout: BlockLayout, unit: int, kappa: float, split: np.ndarray) -> np.ndarray:
    """``(n_units,)``: the cost each unit of ``unit`` tokens brings to its owner: its rows' blocks
    (split rows excepted) plus the split rows' blocks in its key columns."""
    bm, bn = layout.block_size
    rc = row_costs(layout, kappa)
    rc[split] = 0.0
    cc = _col_costs(layout, split, kappa)
    n_units = -(-layout.q_len // unit)
    cost = np.zeros(n_units)
    np.add.at(cost, (np.arange(len(rc)) * bm) // unit, rc)
    np.add.at(cost, (np.arange(len(cc)) * bn) // unit, cc)
    return cost


def halo_counter(layout: BlockLayout, unit: int, max_segments: int = 1 << 20):
    """``halo(u)``: distinct key blocks a cut before unit ``u`` makes cross it (keys left of the cut
    that rows right of it visit, and the reverse), or None for layouts with too many segments to
    count cheaply. Split rows are left out by the caller's cost; here every row counts."""
    segs = layout._segs
    if len(segs.key) > max_segments:
        return None
    bm, bn = layout.block_size
    tc = segs.n_cols
    ne = segs.state != 0
    rows = (segs.rows % segs.n_rowblocks)[ne]
    starts, ends = segs.starts[ne], segs.ends[ne]

    def halo(u: int) -> int:
        ru, cu = (u * unit) // bm, (u * unit) // bn
        out = 0
        for sel, lo, hi in ((rows >= ru, starts, np.minimum(ends, cu)), (rows < ru, np.maximum(starts, cu), ends)):
            a, b = lo[sel], hi[sel]
            keep = b > a
            if keep.any():
                d = np.zeros(tc + 1, np.int64)
                np.add.at(d, a[keep], 1)
                np.add.at(d, b[keep], -1)
                out += int((np.cumsum(d)[:tc] > 0).sum())
        return out
    return halo


def _contiguous(cost: np.ndarray, n_ranks: int, cap: float = np.inf, halo=None, halo_weight: float = 0.0,
                search: float = 0.03) -> np.ndarray:
    """Cut into pieces of equal cost, left to right, none longer than ``cap`` times the mean
    number of units (the rest of a model's work follows the tokens) nor empty. With ``halo``
    (:func:`halo_counter`), each cut moves within ``search`` of a piece's cost to where
    ``imbalance + halo_weight * halo`` is least: documents are cut at their boundaries."""
    n = len(cost)
    c = np.concatenate([[0.0], np.cumsum(cost) + 1e-9 * np.arange(1, n + 1)])  # zero-cost units advance too
    most = max(1, int(np.floor(cap * n / n_ranks))) if np.isfinite(cap) else n
    owner = np.zeros(n, np.int64)
    start = 0
    for r in range(n_ranks - 1):
        left = n_ranks - r
        target = c[start] + (c[-1] - c[start]) / left
        cut = int(np.searchsorted(c, target, side="left"))
        lo = max(start + 1, n - most * (left - 1))  # the others must fit under the cap
        hi = min(start + most, n - (left - 1))  # and each must get a unit
        cut = min(max(cut, lo), hi)
        if halo is not None and halo_weight > 0:
            width = search * (c[-1] - c[start]) / left  # a fraction of one piece's cost
            a = max(lo, int(np.searchsorted(c, target - width, side="left")))
            b = min(hi, int(np.searchsorted(c, target + width, side="right")))
            cands = np.unique(np.linspace(a, b, num=min(b - a + 1, 33)).astype(np.int64)) if b > a else [cut]

            def score(u):
                over = c[u] - target  # > 0: this piece is heavier; < 0: the remaining ones are
                return max(over, -over / max(1, left - 1)) + halo_weight * halo(u)
            cut = int(min(cands, key=lambda u: (score(u), abs(u - cut))))
        owner[cut:] = r + 1
        start = cut
    return owner


def _zigzag(n: int, n_ranks: int) -> np.ndarray:
    piece = (np.arange(n) * 2 * n_ranks) // n
    return np.where(piece < n_ranks, piece, 2 * n_ranks - 1 - piece).astype(np.int64)


def _greedy(cost: np.ndarray, n_ranks: int, group: int) -> np.ndarray:
    n = len(cost)
    g = np.arange(n) // group
    gc = np.bincount(g, weights=cost)
    load = np.zeros(n_ranks)
    owner_g = np.zeros(len(gc), np.int64)
    for k, i in enumerate(np.argsort(-gc, kind="stable")):
        r = k if k < n_ranks else int(np.argmin(load))  # every rank gets a group first
        owner_g[i] = r
        load[r] += gc[i]
    return owner_g[g]


def assign(cost: np.ndarray, n_ranks: int, strategy: str, cap: float = np.inf, halo=None,
           halo_weight: float = 0.0) -> np.ndarray:
    """Owner rank of each unit under ``strategy`` (one of :data:`STRATEGIES`); ``contiguous``
    pieces hold at most ``cap`` times the mean number of units, cut where ``halo`` is small (see
    :func:`_contiguous`)."""
    n = len(cost)
    if n < n_ranks:
        raise ValueError(f"the sequence has {n} units of work for {n_ranks} ranks; use a smaller block size or "
                         f"fewer ranks")
    if strategy == "contiguous":
        return _contiguous(cost, n_ranks, cap, halo, halo_weight)
    if strategy == "zigzag":
        if n < 2 * n_ranks:
            return _contiguous(np.ones(n), n_ranks)
        return _zigzag(n, n_ranks)
    if strategy == "greedy":
        return _greedy(cost, n_ranks, max(1, n // (8 * n_ranks)))
    raise ValueError(f"strategy must be one of {STRATEGIES + ('auto', 'ulysses')}, got {strategy!r}")
