"""Run-length encoded block states: the compiler's working representation.

A block grid of ``R = Z * Tr`` rows (``Z`` layout instances, one per (batch, head) the mask depends
on) and ``Tc`` columns is stored as sorted segments ``[start, next_start)`` of equal state per row.
Every row starts with a segment at column 0, so the grid is covered exactly. Band-shaped masks need
a handful of segments per row, which is what makes compiling million-token layouts cheap: nothing of
size ``Tr × Tc`` (let alone ``N × N``) is built unless the mask itself is dense-shaped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EMPTY, PARTIAL, FULL, UNSURE = 0, 1, 2, 3
"""Block states. ``UNSURE`` is a partial block from combining two partial ones: it may really be
empty or full, and the refinement step may evaluate it exactly."""

# state tables for combination: TABLE[a, b]
AND_TABLE = np.array([
    [EMPTY, EMPTY, EMPTY, EMPTY],
    [EMPTY, UNSURE, PARTIAL, UNSURE],
    [EMPTY, PARTIAL, FULL, UNSURE],
    [EMPTY, UNSURE, UNSURE, UNSURE],
], dtype=np.int8)
OR_TABLE = np.array([
    [EMPTY, PARTIAL, FULL, UNSURE],
    [PARTIAL, UNSURE, FULL, UNSURE],
    [FULL, FULL, FULL, FULL],
    [UNSURE, UNSURE, FULL, UNSURE],
], dtype=np.int8)
NOT_TABLE = np.array([FULL, PARTIAL, EMPTY, UNSURE], dtype=np.int8)
REPLACE_UNSURE = np.array([[a if a != UNSURE else b for b in range(4)] for a in range(4)], dtype=np.int8)
"""``a.combine(patch, REPLACE_UNSURE)``: the patch's state where ``a`` is ``UNSURE``, ``a``'s elsewhere."""


@dataclass
class Segments:
    """Block states of ``batch_shape = (Bm, Hm)`` instances of a ``(Tr, Tc)`` grid, run-length encoded.

    Attributes:
        batch_shape: ``(Bm, Hm)``; ``(1, 1)`` for a mask shared by all batches and heads.
        n_rowblocks: ``Tr``.
        n_cols: ``Tc``.
        key: int64, sorted, ``row * (Tc + 1) + start`` with ``row = z * Tr + r``.
        state: int8, the state of each segment.
    """

    batch_shape: tuple
    n_rowblocks: int
    n_cols: int
    key: np.ndarray
    state: np.ndarray

    # -- derived ------------------------------------------------------------------------------
    @property
    def n_instances(self) -> int:
        return self.batch_shape[0] * self.batch_shape[1]

    @property
    def n_rows(self) -> int:
        return self.n_instances * self.n_rowblocks

    @property
    def rows(self) -> np.ndarray:
        return self.key // (self.n_cols + 1)

    @property
    def starts(self) -> np.ndarray:
        return self.key % (self.n_cols + 1)

    @property
    def ends(self) -> np.ndarray:
        rows = self.rows
        ends = np.empty_like(self.key)
        ends[:-1] = np.where(rows[1:] == rows[:-1], self.starts[1:], self.n_cols)
        ends[-1:] = self.n_cols
        return ends

    def count(self, state: int) -> int:
        """Number of blocks in ``state``."""
        sel = self.state == state
        return int((self.ends[sel] - self.starts[sel]).sum())

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def _compress(cls, batch_shape, tr, tc, key, state) -> "Segments":
        """Drop segments that repeat the previous state of the same row."""
        if len(key) > 1:
            rows = key // (tc + 1)
            keep = np.ones(len(key), dtype=bool)
            keep[1:] = (state[1:] != state[:-1]) | (rows[1:] != rows[:-1])
            key, state = key[keep], state[keep]
        return cls(tuple(batch_shape), tr, tc, np.ascontiguousarray(key, dtype=np.int64),
                   np.ascontiguousarray(state, dtype=np.int8))

    @classmethod
    def from_boundaries(cls, tr: int, tc: int, bounds: np.ndarray, states, batch_shape=(1, 1)) -> "Segments":
        """Rows with ``K`` segments each: ``bounds`` ``(R, K+1)`` non-decreasing from 0 to ``tc``,
        ``states`` ``(K,)`` or ``(R, K)``. Zero-length segments are dropped."""
        bounds = np.asarray(bounds, dtype=np.int64)
        n_rows, k1 = bounds.shape
        states = np.broadcast_to(np.asarray(states, dtype=np.int8), (n_rows, k1 - 1))
        starts, ends = bounds[:, :-1], bounds[:, 1:]
        nonzero = ends > starts
        rows = np.broadcast_to(np.arange(n_rows, dtype=np.int64)[:, None], starts.shape)
        key = rows[nonzero] * (tc + 1) + starts[nonzero]
        return cls._compress(batch_shape, tr, tc, key, states[nonzero])

    @classmethod
    def uniform(cls, tr: int, tc: int, state: int, batch_shape=(1, 1)) -> "Segments":
        n = batch_shape[0] * batch_shape[1] * tr
        return cls(tuple(batch_shape), tr, tc, np.arange(n, dtype=np.int64) * (tc + 1), np.full(n, state, np.int8))

    @classmethod
    def from_dense(cls, states: np.ndarray, batch_shape=(1, 1)) -> "Segments":
        """From a dense ``(Z, Tr, Tc)`` or ``(R, Tc)`` int8 state grid."""
        z = batch_shape[0] * batch_shape[1]
        st = np.asarray(states, dtype=np.int8).reshape(-1, states.shape[-1])
        n_rows, tc = st.shape
        change = np.ones_like(st, dtype=bool)
        change[:, 1:] = st[:, 1:] != st[:, :-1]
        r, c = np.nonzero(change)
        return cls(tuple(batch_shape), n_rows // z, tc, r.astype(np.int64) * (tc + 1) + c, st[r, c])

    @classmethod
    def from_blocks(cls, tr: int, tc: int, rows, cols, states, batch_shape=(1, 1)) -> "Segments":
        """From a sparse list of non-empty blocks (row = z * Tr + r, col, state); others are empty."""
        n_rows = batch_shape[0] * batch_shape[1] * tr
        rows = np.asarray(rows, dtype=np.int64)
        cols = np.asarray(cols, dtype=np.int64)
        states = np.asarray(states, dtype=np.int8)
        fill = np.arange(n_rows, dtype=np.int64) * (tc + 1)
        nxt = cols + 1
        tail = nxt < tc
        key = np.concatenate([fill, rows * (tc + 1) + cols, rows[tail] * (tc + 1) + nxt[tail]])
        st = np.concatenate([np.zeros(n_rows, np.int8), states, np.zeros(int(tail.sum()), np.int8)])
        order = np.argsort(key, kind="stable")
        key, st = key[order], st[order]
        uniq, first = np.unique(key, return_index=True)
        st = np.maximum.reduceat(st, first) if len(st) else st
        return cls._compress(batch_shape, tr, tc, uniq, st)

    # -- views --------------------------------------------------------------------------------
    def to_dense(self) -> np.ndarray:
        """``(Z, Tr, Tc)`` int8 grid (O(Z·Tr·Tc) memory)."""
        lengths = self.ends - self.starts
        return np.repeat(self.state, lengths).reshape(self.n_instances, self.n_rowblocks, self.n_cols)

    def blocks(self, nonempty: bool = True):
        """Expanded ``(rows, cols, states)`` of every block (non-empty ones only by default)."""
        sel = self.state != EMPTY if nonempty else slice(None)
        rows, cols, seg = self._expand(sel)
        return rows, cols, self.state[sel][seg]

    def blocks_in(self, state: int):
        """Expanded ``(rows, cols)`` of every block in ``state``."""
        rows, cols, _ = self._expand(self.state == state)
        return rows, cols

    def _expand(self, sel):
        """``(rows, cols, segment)`` of every block of the selected segments (``segment`` indexes
        the selection)."""
        starts, ends, rows = self.starts[sel], self.ends[sel], self.rows[sel]
        lengths = ends - starts
        seg = np.repeat(np.arange(len(starts)), lengths)
        offs = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return rows[seg], starts[seg] + offs, seg

    # -- algebra ------------------------------------------------------------------------------
    def broadcast_to(self, batch_shape) -> "Segments":
        batch_shape = tuple(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        (bo, ho), (bn, hn) = self.batch_shape, batch_shape
        tr = self.n_rowblocks
        zb = np.arange(bn)[:, None] % bo if bo > 1 else np.zeros((bn, 1), np.int64)
        zh = np.arange(hn)[None, :] % ho if ho > 1 else np.zeros((1, hn), np.int64)
        src = (zb * ho + zh).reshape(-1)  # old instance for each new instance
        inst = self.rows // tr
        ptr = np.searchsorted(inst, np.arange(self.n_instances + 1), side="left")
        lens = ptr[src + 1] - ptr[src]
        idx = np.repeat(ptr[src], lens) + (np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens))
        new_inst = np.repeat(np.arange(len(src)), lens)
        shift = (new_inst - inst[idx]) * tr * (self.n_cols + 1)
        return Segments(batch_shape, tr, self.n_cols, self.key[idx] + shift, self.state[idx].copy())

    def combine(self, other: "Segments", table: np.ndarray) -> "Segments":
        """Pointwise combination of two grids through a 4×4 state table (broadcasting instances)."""
        bs = tuple(max(a, b) for a, b in zip(self.batch_shape, other.batch_shape))
        a, b = self.broadcast_to(bs), other.broadcast_to(bs)
        keys = _sorted_union(a.key, b.key)
        sa = a.state[np.searchsorted(a.key, keys, side="right") - 1]
        sb = b.state[np.searchsorted(b.key, keys, side="right") - 1]
        return Segments._compress(bs, a.n_rowblocks, a.n_cols, keys, table[sa, sb])

    def map_states(self, table: np.ndarray) -> "Segments":
        return Segments._compress(self.batch_shape, self.n_rowblocks, self.n_cols, self.key.copy(), table[self.state])

    def with_blocks(self, rows: np.ndarray, cols: np.ndarray, states: np.ndarray) -> "Segments":
        """A copy with single blocks ``(row, col)`` set to ``states``; cost O(segments + blocks),
        never O(grid)."""
        if len(rows) == 0:
            return self
        tc1 = self.n_cols + 1
        rows = np.asarray(rows, np.int64)
        cols = np.asarray(cols, np.int64)
        at = rows * tc1 + cols
        nxt = cols + 1
        tail = nxt < self.n_cols
        after = rows[tail] * tc1 + nxt[tail]
        # the state that resumes after each block is the one covering it before the change
        resume = self.state[np.searchsorted(self.key, after, side="right") - 1]
        keys = np.concatenate([self.key, at, after])
        vals = np.concatenate([self.state, np.asarray(states, np.int8), resume])
        prio = np.concatenate([np.zeros(len(self.key), np.int8), np.full(len(at), 2, np.int8),
                               np.ones(len(after), np.int8)])
        order = np.lexsort((-prio, keys))  # per key: the block's own state first, then resumes, then old
        keys, vals = keys[order], vals[order]
        first = np.ones(len(keys), dtype=bool)
        first[1:] = keys[1:] != keys[:-1]
        return Segments._compress(self.batch_shape, self.n_rowblocks, self.n_cols, keys[first], vals[first])

    def intervals(self, state: int):
        """``(rows, starts, ends)`` of the segments in ``state`` (row = z * Tr + r)."""
        sel = self.state == state
        return self.rows[sel], self.starts[sel], self.ends[sel]

    def demote_full(self, last_col: bool = False, last_rowblock: bool = False) -> "Segments":
        """FULL blocks of the last column (``last_col``) or of each instance's last row block
        (``last_rowblock``) made PARTIAL: the kernels' tables mask ragged edges."""
        out = self
        if last_rowblock:
            rows = out.rows
            sel = (rows % out.n_rowblocks == out.n_rowblocks - 1) & (out.state == FULL)
            if sel.any():
                st = out.state.copy()
                st[sel] = PARTIAL
                out = Segments._compress(out.batch_shape, out.n_rowblocks, out.n_cols, out.key.copy(), st)
        if last_col:
            r, s, e = out.intervals(FULL)
            hit = e == out.n_cols
            if hit.any():
                out = out.with_blocks(r[hit], np.full(int(hit.sum()), out.n_cols - 1), np.full(int(hit.sum()), PARTIAL))
        return out


def _sorted_union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted unique union of two sorted int arrays (a sort, not numpy's hash-based unique)."""
    keys = np.concatenate([a, b])
    keys.sort(kind="stable")
    if len(keys) > 1:
        keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]
    return keys
