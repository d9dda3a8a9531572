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

__all__ = ["STRATEGIES", "row_costs", "split_rows", "unit_costs", "assign"]

STRATEGIES = ("contiguous", "zigzag", "greedy")


def row_costs(layout: BlockLayout, kappa: float) -> np.ndarray:
    """``(Tr,)`` float: ``full + kappa * partial`` blocks of each row block, summed over the
    layout's batch/head instances."""
    segs = layout._segs
    tr = segs.n_rowblocks
    n = segs.ends - segs.starts
    w = np.where(segs.state == FULL, 1.0, np.where(segs.state == PARTIAL, kappa, 0.0)) * n
    return np.bincount(segs.rows % tr, weights=w, minlength=tr)


def split_rows(costs: np.ndarray, factor: float, n_ranks: int) -> np.ndarray:
    """Row blocks to split between ranks: those costing more than ``factor`` times the mean row
    (global query tokens), sorted. None for one rank or ``factor <= 0``."""
    if n_ranks < 2 or factor <= 0 or len(costs) < 2:
        return np.zeros(0, np.int64)
    mean = costs.mean()
    return np.nonzero((costs > factor * mean) & (costs >= 2 * n_ranks))[0].astype(np.int64)


def _col_costs(layout: BlockLayout, rows: np.ndarray, kappa: float) -> np.ndarray:
    """``(Tc,)``: the cost of the given rows' blocks, per key block (where split rows are paid)."""
    segs = layout._segs
    tr, tc = segs.n_rowblocks, segs.n_cols
    out = np.zeros(tc + 1)
    if len(rows) == 0:
        return out[:tc]
    sel = np.isin(segs.rows % tr, rows) & (segs.state != 0)
    w = np.where(segs.state[sel] == FULL, 1.0, kappa)
    np.add.at(out, segs.starts[sel], w)
    np.add.at(out, segs.ends[sel], -w)
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


def _contiguous(cost: np.ndarray, n_ranks: int) -> np.ndarray:
    """Cut at equal cost (ties broken towards equal unit counts); every rank gets a unit when it can."""
    n = len(cost)
    c = np.cumsum(cost) + 1e-9 * np.arange(1, n + 1)  # zero-cost units still advance the cut
    targets = c[-1] * np.arange(1, n_ranks) / n_ranks
    cuts = np.searchsorted(c, targets, side="left") + 1
    cuts = np.clip(cuts, np.arange(1, n_ranks), n - n_ranks + np.arange(1, n_ranks))
    cuts = np.maximum.accumulate(cuts)
    owner = np.zeros(n, np.int64)
    for r, cut in enumerate(cuts):
        owner[cut:] = r + 1
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


def assign(cost: np.ndarray, n_ranks: int, strategy: str) -> np.ndarray:
    """Owner rank of each unit under ``strategy`` (one of :data:`STRATEGIES`)."""
    n = len(cost)
    if n < n_ranks:
        raise ValueError(f"the sequence has {n} units of work for {n_ranks} ranks; use a smaller block size or "
                         f"fewer ranks")
    if strategy == "contiguous":
        return _contiguous(cost, n_ranks)
    if strategy == "zigzag":
        if n < 2 * n_ranks:
            return _contiguous(np.ones(n), n_ranks)
        return _zigzag(n, n_ranks)
    if strategy == "greedy":
        return _greedy(cost, n_ranks, max(1, n // (8 * n_ranks)))
    raise ValueError(f"strategy must be one of {STRATEGIES + ('auto', 'ulysses')}, got {strategy!r}")
