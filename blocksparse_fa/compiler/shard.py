"""Shards of a layout: chosen query blocks against chosen key blocks, in local order.

A context-parallel rank computes attention for some query blocks of a long sequence against the
key blocks those queries visit, held in a local buffer. :func:`shard_layout` cuts that piece out
of the global :class:`~blocksparse_fa.compiler.layout.BlockLayout`: rows are the chosen query
blocks in the order given, columns the chosen key blocks in the order given (blocks outside them
are dropped), and optionally some rows are limited to a subset of the columns (a row split
between ranks, each computing its own keys' share). The result is a :class:`ShardLayout`, which
every backend runs like a layout: its lookup tables index local blocks, and
:attr:`ShardLayout.positions` gives the global index of each local block's first row and key, so
the element predicate, document ids and the dropout counters see the positions of the unsharded
run (the kernels' ``HAS_POS`` tables). Local results are therefore the rows of the global result.

The cut works on the global layout's run-length segments, never on the expanded grid: with
columns in ascending global order a run of blocks stays a run, so band and causal shards keep the
kernels' run-form tables. Lengths: every local block but the last must be a whole block (the
global layout's ragged last block, if chosen, must come last).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .classify import Grid
from .finer import limit_to, list_states
from .layout import BlockLayout
from .segments import EMPTY, Segments

__all__ = ["BlockPositions", "ShardLayout", "shard_layout"]


@dataclass(frozen=True)
class BlockPositions:
    """Global indices of a shard's local blocks.

    Attributes:
        q_start: ``(Tr_local,)`` int64, global index of each local row block's first query row.
        k_start: ``(Tc_local,)`` int64, global index of each local key block's first key.
        q_len, kv_len: the global lengths (what the mask's payloads were built for).
        q_offset: the global layout's query offset (query row ``i`` sits at ``i + q_offset``).
    """

    q_start: np.ndarray
    k_start: np.ndarray
    q_len: int
    kv_len: int
    q_offset: int

    def rows(self, local: np.ndarray, bm: int) -> np.ndarray:
        """Global query row of each local row index."""
        local = np.asarray(local, dtype=np.int64)
        return self.q_start[local // bm] + local % bm

    def keys(self, local: np.ndarray, bn: int) -> np.ndarray:
        """Global key index of each local key index."""
        local = np.asarray(local, dtype=np.int64)
        return self.k_start[local // bn] + local % bn


class ShardLayout(BlockLayout):
    """A piece of a global layout (see the module docstring); runs wherever a layout runs.

    Attributes (besides :class:`BlockLayout`'s, which describe the local piece):
        source: the global layout.
        rows, cols: global row/column block of each local one.
        positions: :class:`BlockPositions`.
    """

    def __init__(self, source: BlockLayout, grid: Grid, segs: Segments, rows: np.ndarray, cols: np.ndarray, device):
        super().__init__(source.mask, grid, segs, device)
        self.source = source
        self.rows = rows
        self.cols = cols
        bm, bn = source.block_size
        self.positions = BlockPositions(rows * bm, cols * bn, source.q_len, source.kv_len, source.q_offset)

    @property
    def q_offset(self) -> int:
        """The global offset: the kernels add it to global row indices."""
        return self.source.q_offset

    def to(self, device) -> "ShardLayout":
        import torch

        device = torch.device(device)
        if device == self.device:
            return self
        return ShardLayout(self.source, self._grid, self._segs, self.rows, self.cols, device)

    def to_dense(self):
        """``bool (Lq_local, Lk_local)`` (or with ``(B, H)`` dims): the global mask's rows and keys
        of this shard, restricted to the blocks the shard keeps."""
        import torch

        g, bm, bn = self._grid, *self.block_size
        gi = self.positions.rows(np.arange(g.q_len), bm)
        gj = self.positions.keys(np.arange(g.kv_len), bn)
        full = self.source.to_dense().cpu()
        sub = full[..., torch.from_numpy(gi), :][..., torch.from_numpy(gj)]
        st = torch.from_numpy(self._segs.to_dense()).reshape(*self.batch_shape, g.tr, g.tc) != EMPTY
        keep = st.repeat_interleave(bm, -2)[..., : g.q_len, :].repeat_interleave(bn, -1)[..., : g.kv_len]
        return (sub & keep).to(self.device)

    def _finer_states(self, grid: Grid, coarse_up: Segments) -> Segments:
        """The source's finer states at this shard's local finer rows and columns, limited to the
        shard's own states ``coarse_up``."""
        src, sg = self.source, self.source._grid
        lbm, lbn = src.block_size
        fine_grid = Grid(sg.q_len, sg.kv_len, grid.bm, grid.bn, sg.align, sg.shift)
        fine_src = BlockLayout(src.mask, fine_grid, (list_states(src, grid.bm, grid.bn), 0), src.device)
        rows = _split_blocks(self.rows, lbm // grid.bm, fine_grid.tr)
        cols = _split_blocks(self.cols, lbn // grid.bn, fine_grid.tc)
        return limit_to(coarse_up, shard_layout(fine_src, rows, cols)._segs)

    def element_density(self, device="cpu") -> float:
        raise NotImplementedError("element_density of a shard: ask its source layout")

    def _block_values(self, rows, cols, device="cpu"):
        raise NotImplementedError("a shard's blocks are evaluated through its source layout")

    def summary(self) -> str:
        return (f"Shard of {self.source.summary().splitlines()[0]}\n  local rows={len(self.rows)} "
                f"cols={len(self.cols)} q_len={self.q_len} kv_len={self.kv_len} full={self.n_full} "
                f"partial={self.n_partial}")


def _split_blocks(blocks: np.ndarray, f: int, n_fine: int) -> np.ndarray:
    """Finer block indices of ``blocks`` in order, ``f`` per block (fewer for the ragged last one)."""
    fine = (np.asarray(blocks, np.int64)[:, None] * f + np.arange(f)[None, :]).reshape(-1)
    return fine[fine < n_fine]


def _block_lengths(blocks: np.ndarray, b: int, length: int) -> np.ndarray:
    return np.minimum((blocks + 1) * b, length) - blocks * b


def _check_blocks(name: str, blocks, n: int, b: int, length: int) -> np.ndarray:
    blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)
    if len(blocks) and (blocks.min() < 0 or blocks.max() >= n):
        raise ValueError(f"{name}: block indices must lie in [0, {n}), got range [{blocks.min()}, {blocks.max()}]")
    if len(np.unique(blocks)) != len(blocks):
        raise ValueError(f"{name}: block indices must be distinct")
    lens = _block_lengths(blocks, b, length)
    if len(blocks) > 1 and (lens[:-1] != b).any():
        raise ValueError(f"{name}: the global layout's ragged last block ({n - 1}, {length % b} of {b}) must be the "
                         f"last local block")
    return blocks


def _intersect(rows, s, e, st, allowed_s, allowed_e):
    """Pieces of the intervals ``[s, e)`` inside the sorted disjoint intervals ``[allowed_s, allowed_e)``."""
    lo = np.searchsorted(allowed_e, s, side="right")  # first allowed interval ending after s
    hi = np.searchsorted(allowed_s, e, side="left")  # allowed intervals starting before e
    n = np.maximum(hi - lo, 0)
    idx = np.repeat(lo, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    rep = lambda a: np.repeat(a, n)  # noqa: E731
    ps = np.maximum(rep(s), allowed_s[idx])
    pe = np.minimum(rep(e), allowed_e[idx])
    ok = pe > ps
    return rep(rows)[ok], ps[ok], pe[ok], rep(st)[ok]


def _runs(sorted_blocks: np.ndarray):
    """Sorted block indices as disjoint intervals ``(starts, ends)``."""
    if len(sorted_blocks) == 0:
        z = np.zeros(0, np.int64)
        return z, z
    brk = np.nonzero(np.diff(sorted_blocks) != 1)[0]
    starts = np.concatenate([[sorted_blocks[0]], sorted_blocks[brk + 1]])
    ends = np.concatenate([sorted_blocks[brk] + 1, [sorted_blocks[-1] + 1]])
    return starts.astype(np.int64), ends.astype(np.int64)


def _from_intervals(batch_shape, tr: int, tc: int, rows, s, e, st) -> Segments:
    """Segments from non-empty, per-row disjoint intervals; everything else EMPTY."""
    n_rows = batch_shape[0] * batch_shape[1] * tr
    tc1 = tc + 1
    tail = e < tc
    keys = np.concatenate([np.arange(n_rows, dtype=np.int64) * tc1, rows * tc1 + s, rows[tail] * tc1 + e[tail]])
    vals = np.concatenate([np.full(n_rows, EMPTY, np.int8), st.astype(np.int8), np.full(int(tail.sum()), EMPTY, np.int8)])
    prio = np.concatenate([np.zeros(n_rows, np.int8), np.full(len(s), 2, np.int8), np.ones(int(tail.sum()), np.int8)])
    order = np.lexsort((-prio, keys))  # per key: an interval's start first, then an end marker, then the row's start
    keys, vals = keys[order], vals[order]
    first = np.ones(len(keys), dtype=bool)
    first[1:] = keys[1:] != keys[:-1]
    return Segments._compress(tuple(batch_shape), tr, tc, keys[first], vals[first])


def shard_layout(layout: BlockLayout, rows, cols, limit_rows=None, limit_cols=None, device=None) -> ShardLayout:
    """The piece of ``layout`` with query blocks ``rows`` and key blocks ``cols``, in that order.

    Args:
        layout: the global layout (a plain :class:`BlockLayout`; rewrites do not apply to shards).
        rows: global query-block indices of the local row blocks, in local order.
        cols: global key-block indices of the local key blocks, in local order. Non-empty blocks
            of the chosen rows outside ``cols`` are dropped.
        limit_rows: optional bool ``(len(rows),)``: these rows keep only the blocks in
            ``limit_cols`` (a row split between ranks).
        limit_cols: global key blocks the limited rows keep (any order).
        device: device of the tables (default the layout's).

    Returns:
        A :class:`ShardLayout` of ``q_len = Σ`` row-block lengths and ``kv_len = Σ`` key-block lengths.
    """
    if isinstance(layout, ShardLayout):
        raise TypeError("shard_layout() cuts a global layout, not a shard")
    g, segs = layout._grid, layout._segs
    bm, bn = g.bm, g.bn
    rows = _check_blocks("rows", rows, g.tr, bm, g.q_len)
    cols = _check_blocks("cols", cols, g.tc, bn, g.kv_len)
    tr_l, tc_l = len(rows), len(cols)
    q_len = int(_block_lengths(rows, bm, g.q_len).sum())
    kv_len = int(_block_lengths(cols, bn, g.kv_len).sum())
    if q_len == 0 or kv_len == 0:
        raise ValueError("shard_layout(): a shard needs at least one row block and one key block")
    # global row -> local row (per instance); -1 where not chosen
    row_map = np.full(g.tr, -1, np.int64)
    row_map[rows] = np.arange(tr_l)
    limited = np.zeros(tr_l, bool) if limit_rows is None else np.asarray(limit_rows, bool).reshape(-1)
    if len(limited) != tr_l:
        raise ValueError(f"limit_rows must have one flag per row block ({tr_l}), got {len(limited)}")
    grow = segs.rows
    z, r = grow // g.tr, grow % g.tr
    sel = (row_map[r] >= 0) & (segs.state != EMPTY)
    lrow = z[sel] * tr_l + row_map[r[sel]]
    s, e, st = segs.starts[sel], segs.ends[sel], segs.state[sel]
    lim = limited[lrow % tr_l]
    if lim.any():
        a_s, a_e = _runs(np.unique(np.asarray(limit_cols, dtype=np.int64)))
        pr, ps, pe, pst = _intersect(lrow[lim], s[lim], e[lim], st[lim], a_s, a_e)
        lrow = np.concatenate([lrow[~lim], pr])
        s, e, st = np.concatenate([s[~lim], ps]), np.concatenate([e[~lim], pe]), np.concatenate([st[~lim], pst])
    # map global column intervals to local ones: runs of the column order that ascend by one
    order = np.argsort(cols, kind="stable")
    sc = cols[order]
    c_s, c_e = _runs(sc)
    # the chosen columns inside [s, e), as runs of sorted columns, then their local indices
    pr, ps, pe, pst = _intersect(lrow, s, e, st, c_s, c_e)
    a = np.searchsorted(sc, ps)
    b = np.searchsorted(sc, pe)
    if np.array_equal(order, np.arange(tc_l)):  # ascending local order: one local interval per piece
        lr, ls, le, lst = pr, a, b, pst
    else:  # general order: piece by piece through the local index of each column
        n = b - a
        k = np.repeat(a, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
        loc = order[k]
        lr, lst = np.repeat(pr, n), np.repeat(pst, n)
        ls, le = loc, loc + 1
    o = np.lexsort((ls, lr))
    lr, ls, le, lst = lr[o], ls[o], le[o], lst[o]
    bs = segs.batch_shape
    local = _from_intervals(bs, tr_l, tc_l, lr, ls, le, lst)
    grid = Grid(q_len, kv_len, bm, bn)
    return ShardLayout(layout, grid, local, rows, cols, layout.device if device is None else device)
