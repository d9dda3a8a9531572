"""Finer list blocks: the kernels' lists at the granularity of their loop step.

A layout is classified at its block size ``(bm, bn)`` (128 by default), and the kernels' lookup
tables list those blocks. The kernels' tiles are often smaller along the loop: the forward and dQ
programs of partial-heavy layouts step through a row's keys 64 at a time, the dK/dV programs
through a column's queries 32 or 64 at a time. A partial layout block may then hold kernel tiles
that are full (no predicate needed) or empty (nothing to do). Listing the blocks of a finer
classification, ``(bm, step)`` for the row side and ``(step, bn)`` for the column side, lets the
kernels skip those empty tiles and run the full ones unmasked, while the kernel tiles stay the same.

The finer states come from classifying the mask again at the finer grid, by the same interval
reasoning (never an ``N × N`` mask), and are then limited to the layout's own states: a finer block
inside a full (empty) layout block is full (empty); only inside a partial layout block does the
finer classification decide. So finer lists visit a subset of the layout's masked area and the
predicate (simplified against the layout's masked blocks) stays valid on every block it sees.

Whether the finer lists pay is a per-layout decision (:func:`pick_list_block`): they cost more
loop iterations (a layout block becomes several list entries), and save masked work and skipped
tiles. A small cost model in kernel-tile units weighs both. It considers half the layout block
(two 64-key entries per 128-key block; the finer classification at the kernel step itself costs
about twice as much again to compile and, on the benchmark masks, saves no more area except for
documents, where neither pays).
"""

from __future__ import annotations

import numpy as np

from ..mask.primitives import MaskMod
from .classify import Grid, classify, refine
from .segments import EMPTY, FULL, PARTIAL, UNSURE, Segments

__all__ = ["list_states", "upsample", "limit_to", "classified_states", "ListCost", "list_cost", "pick_list_block",
           "side_costs", "COST"]

# REFINE[coarse, fine]: the finer state decides only inside a partial (or uncertain) layout block
_REFINE = np.array([[EMPTY] * 4, [EMPTY, PARTIAL, FULL, UNSURE], [FULL] * 4, [EMPTY, PARTIAL, FULL, UNSURE]],
                   dtype=np.int8)
_REFINE_BUDGET = 1 << 24  # elements evaluated to settle uncertain finer blocks (compile_mask's default)


def upsample(segs: Segments, fr: int, fc: int, tr: int, tc: int) -> Segments:
    """``segs`` on a grid ``fr`` times finer along rows and ``fc`` times along columns, ``(tr, tc)``
    blocks per instance (the ragged last block of a side may split into fewer than ``fr``/``fc``).
    Every finer block takes the state of the block it lies in; O(segments · fr), no sort."""
    if fr == 1 and fc == 1:
        return segs
    tr0 = segs.n_rowblocks
    rows = segs.rows
    z, r = rows // tr0, rows % tr0
    n_rows = segs.n_rows
    first = np.searchsorted(rows, np.arange(n_rows + 1))  # segments of coarse row k: first[k] .. first[k + 1]
    count = np.diff(first)
    copies = np.minimum(fr, tr - (np.arange(n_rows) % tr0) * fr)  # finer rows of each coarse row
    out_first = np.zeros(n_rows + 1, np.int64)
    np.cumsum(count * copies, out=out_first[1:])
    total = int(out_first[-1])
    key = np.empty(total, np.int64)
    state = np.empty(total, np.int8)
    starts = segs.starts * fc  # < tc: the last coarse block starts inside the finer grid
    seg_in_row = np.arange(len(rows)) - first[rows]
    for j in range(fr):
        ok = j < copies[rows]
        pos = out_first[rows[ok]] + j * count[rows[ok]] + seg_in_row[ok]
        key[pos] = (z[ok] * tr + r[ok] * fr + j) * (tc + 1) + starts[ok]
        state[pos] = segs.state[ok]
    return Segments(segs.batch_shape, tr, tc, key, state)


def limit_to(coarse_up: Segments, fine: Segments) -> Segments:
    """``fine`` limited to a layout's states ``coarse_up`` (upsampled to the same grid): the finer
    state decides only inside the layout's partial (or uncertain) blocks."""
    return coarse_up.combine(fine, _REFINE)


def classified_states(mask, grid: Grid, coarse_up: Segments) -> Segments:
    """Finer states of ``mask`` on ``grid`` inside the partial blocks of ``coarse_up`` (the
    layout's states on the same grid); the layout's state elsewhere."""
    care = None  # where the result matters: only a mask_mod's evaluation asks
    if any(isinstance(leaf, MaskMod) for leaf in mask.leaves()):
        care = coarse_up.map_states(np.array([EMPTY, PARTIAL, EMPTY, PARTIAL], np.int8))
    fine = classify(mask, grid, care).broadcast_to(mask.batch_shape or (1, 1))
    segs, _ = refine(limit_to(coarse_up, fine), mask, grid, _REFINE_BUDGET)
    return segs


def list_states(layout, bm: int, bn: int) -> Segments:
    """Block states of ``layout`` at the finer block ``(bm, bn)`` (each dividing the layout's block on
    its side), limited to the layout's states (see the module docstring); cached on the layout.

    The layout says how its finer states are found (``layout._finer_states(grid, coarse_up)``):
    a :class:`~blocksparse_fa.compiler.layout.BlockLayout` classifies its mask again
    (:func:`classified_states`); a shard (``compiler/shard.py``) takes its source layout's finer
    states at its own local rows and columns, limited to the shard's own states (so dropped blocks
    and split rows stay as cut)."""
    lbm, lbn = layout.block_size
    if (bm, bn) == (lbm, lbn):
        return layout._segs
    if lbm % bm or lbn % bn:
        raise ValueError(f"list block ({bm}, {bn}) must divide the layout block ({lbm}, {lbn})")
    key = ("list_states", bm, bn)
    hit = layout.cache.get(key)
    if hit is not None:
        return hit
    g = layout._grid
    fine_grid = Grid(g.q_len, g.kv_len, bm, bn, g.align, g.shift)
    coarse_up = upsample(layout._segs, lbm // bm, lbn // bn, fine_grid.tr, fine_grid.tc)
    segs = layout.cache[key] = layout._finer_states(fine_grid, coarse_up)
    return segs


# ------------------------------------------------------------------------------------------------
# cost model
# ------------------------------------------------------------------------------------------------
COST = {
    # a masked kernel tile costs this many unmasked ones (sm_90 SASS instructions per iteration with
    # ``even``, benchmarks/NOTES.md, "Where a partial tile's cost comes from": forward 1.90, dQ 1.91, dK/dV 1.42-1.47)
    "partial_row": 1.9,
    "partial_col": 1.45,
    # what one more loop iteration adds beyond its tiles' work (LUT read, loop control, the pipeline's
    # wait and barrier, set-up the unrolled tiles of one entry share), in unmasked tiles: sm_90 SASS of
    # the unmasked loops over 128-blocks and over 64-blocks, Longformer (benchmarks/NOTES.md, "Finer lists"):
    # forward 128x64 675 vs 2 x 359 instructions (43 = 0.13 tile), dQ 128x64 565 vs 2 x 295 (0.09),
    # dK/dV 32x128 1086 vs 2 x 606 (126 = 0.46 tile)
    "iteration_row": 0.12,
    "iteration_col": 0.46,
    # finer lists are taken only when the model says they save at least this fraction
    "min_gain": 0.03,
}


class ListCost:
    """Blocks and modelled cost of one side's lists at one list block.

    Attributes:
        unit: list block along the loop (keys for the row side, queries for the column side).
        n_full, n_partial: listed blocks (of ``unit`` along the loop).
        tiles: kernel tiles per listed block (``unit // step``).
        cost: modelled cost in unmasked kernel tiles.
    """

    def __init__(self, unit: int, n_full: int, n_partial: int, tiles: int, cost: float):
        self.unit, self.n_full, self.n_partial, self.tiles, self.cost = unit, n_full, n_partial, tiles, cost

    def __repr__(self) -> str:
        return (f"ListCost(unit={self.unit}, full={self.n_full}, partial={self.n_partial}, tiles={self.tiles}, "
                f"cost={self.cost:.1f})")


def list_cost(n_full: int, n_partial: int, tiles: int, partial_cost: float, iteration_cost: float,
              flat: bool = False) -> float:
    """Modelled cost of walking ``n_full`` unmasked and ``n_partial`` masked list entries of
    ``tiles`` kernel tiles each: tiles at 1 (unmasked) or ``partial_cost`` (masked), plus
    ``iteration_cost`` per loop iteration (one per entry, or one per tile when ``flat``)."""
    iters = (n_full + n_partial) * (tiles if flat else 1)
    return tiles * (n_full + partial_cost * n_partial) + iteration_cost * iters


def _side_cost(segs: Segments, side: str, unit: int, step: int, flat: bool) -> ListCost:
    nf, npart = segs.count(FULL), segs.count(PARTIAL) + segs.count(UNSURE)
    tiles = unit // step
    return ListCost(unit, nf, npart, tiles,
                    list_cost(nf, npart, tiles, COST[f"partial_{side}"], COST[f"iteration_{side}"], flat))


def pick_list_block(layout, side: str, step: int, flat: bool = False, force: str | None = None) -> int:
    """The list block along the loop for one side (``side``: ``"row"``, forward and dQ, keys per
    entry; ``"col"``, dK/dV, queries per entry) of kernel tiles stepping ``step`` along the loop.

    ``force="fine"``: ``step``; ``"half"``: half the layout block (at least ``step``); ``"coarse"``:
    the layout block. Otherwise (the cost model, cached per layout): half the layout block when its
    lists save at least
    ``COST["min_gain"]`` of the modelled cost, else the layout block. The finer classification runs
    only when it can pay: not when even dropping every masked tile would save less than
    ``min_gain``. (Windows and strides whose boundaries meet the blocks at a multiple of the list
    block, like the benchmarks' ``sliding_window(1024)``, gain nothing; others do: ``window(300)``
    at 16K loses 25 % of its partial area at (128, 64), ``sliding_window(960)`` 33 %.)"""
    lbm, lbn = layout.block_size
    coarse = lbn if side == "row" else lbm
    if step >= coarse or coarse % step or force == "coarse":
        return coarse
    if force == "fine":
        return step
    unit = max(step, coarse // 2)
    if force == "half":
        return unit
    key = ("list_block", side, step, bool(flat))
    hit = layout.cache.get(key)
    if hit is not None:
        return hit
    base = _side_cost(layout._segs, side, coarse, step, flat)
    best = coarse
    if base.tiles * COST[f"partial_{side}"] * base.n_partial >= COST["min_gain"] * base.cost:
        fine = list_states(layout, lbm, unit) if side == "row" else list_states(layout, unit, lbn)
        if _side_cost(fine, side, unit, step, flat).cost <= (1.0 - COST["min_gain"]) * base.cost:
            best = unit
    layout.cache[key] = best
    return best


def side_costs(layout, side: str, step: int, unit: int | None = None, flat: bool = False
               ) -> tuple[ListCost, ListCost]:
    """``(layout block, finer list block unit)`` :class:`ListCost` of one side for kernel tiles
    stepping ``step`` (``unit`` defaults to ``step``; reports and tests)."""
    lbm, lbn = layout.block_size
    coarse = lbn if side == "row" else lbm
    unit = unit or step
    fine = list_states(layout, lbm, unit) if side == "row" else list_states(layout, unit, lbn)
    return _side_cost(layout._segs, side, coarse, step, flat), _side_cost(fine, side, unit, step, flat)
