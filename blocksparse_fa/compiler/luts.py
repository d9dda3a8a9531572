"""Lookup tables that drive the kernels, built from run-length encoded block states.

Row tables (forward, dQ): for each layout row ``z * Tr + r`` the column blocks to visit, split into
a *masked* list (the element predicate and bounds are evaluated) and an *unmasked* list (full blocks,
no masking at all). Column tables (dK/dV): the transpose, per ``z * Tc + c``.

Two forms:

* :class:`LUT`, the *exact* expanded CSR tables (int32 ``ptr``/``idx`` per list): every visited
  block listed. Used by the CPU backend and the traffic analysis; built on demand.
* :class:`SideTables`, what the kernels read. When every line's unmasked blocks form one run of
  consecutive blocks (dense, causal, sliding windows, documents, Longformer), the unmasked list is
  stored as that run: ``first[line] - ptr[line]`` in one int32 per line, and the kernels compute
  block indices. Its size then scales with the number of lines, not with the visited area: causal
  attention at 1M tokens needs kilobytes instead of 256 MB. Other layouts store the list. The
  masked lists of strided masks (every ``s/b``-th block) are stored as arithmetic progressions
  (``compiler/toeplitz.py``).

Both are built from :class:`~blocksparse_fa.compiler.segments.Segments` in time proportional to
the segments plus the blocks actually listed; the transpose goes through run boundaries, never
through the expanded grid. In the *kernel* tables, full blocks on a ragged edge (the last column
block when ``kv_len % bn != 0`` for rows, the last row block when ``q_len % bm != 0`` for columns)
move to the masked list, so that unmasked tiles never need a bounds check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .segments import FULL, PARTIAL, Segments

__all__ = ["LUT", "SideTables", "build_luts", "build_side", "MAX_INT32"]

MAX_INT32 = 2**31 - 1


@dataclass
class LUT:
    """One side's exact tables. ``*_ptr`` has ``n + 1`` offsets into ``*_idx``."""

    full_ptr: torch.Tensor
    full_idx: torch.Tensor
    part_ptr: torch.Tensor
    part_idx: torch.Tensor

    def to(self, device) -> "LUT":
        return LUT(*(t.to(device) for t in (self.full_ptr, self.full_idx, self.part_ptr, self.part_idx)))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.full_ptr, self.full_idx, self.part_ptr, self.part_idx))

    def max_len(self) -> int:
        """Longest list (masked + unmasked) of any row/column."""
        n = (self.full_ptr[1:] - self.full_ptr[:-1]) + (self.part_ptr[1:] - self.part_ptr[:-1])
        return int(n.max()) if n.numel() else 0


@dataclass
class SideTables:
    """The kernels' tables of one side (numpy, int32; moved to a device by the backend).

    Attributes:
        full_ptr: ``(n + 1,)`` offsets of the unmasked lists (entry ``e`` of line ``l`` lies in
            ``[full_ptr[l], full_ptr[l + 1])``).
        full_idx: with ``runs``: ``(n,)``, ``first_block[l] - full_ptr[l]`` (the block of entry ``e``
            is ``full_idx[l] + e``); otherwise the listed block indices.
        part_ptr, part_idx: the masked lists: listed, or with ``part_step`` arithmetic
            progressions: ``part_idx[0]`` is the step and ``part_idx[1 + l]`` is ``first_block[l] -
            part_ptr[l] · step`` (``compiler/toeplitz.py``, strided masks).
        runs: whether ``full_idx`` holds runs.
        part_step: the masked lists' step, or 0 where they are listed.
    """

    full_ptr: np.ndarray
    full_idx: np.ndarray
    part_ptr: np.ndarray
    part_idx: np.ndarray
    runs: bool
    part_step: int = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.full_ptr, self.full_idx, self.part_ptr, self.part_idx))

    @property
    def n_full(self) -> int:
        return int(self.full_ptr[-1])


def _ptr(owner: np.ndarray, n: int, counts: np.ndarray | None = None) -> np.ndarray:
    """CSR offsets ``(n + 1,)`` int64 from sorted owners (or per-line counts)."""
    if counts is None:
        counts = np.bincount(owner, minlength=n)
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ptr


def _expand(lines: np.ndarray, starts: np.ndarray, ends: np.ndarray):
    """``(line, index)`` of every index in the runs ``[start, end)`` (line-major as given)."""
    lengths = ends - starts
    total = int(lengths.sum())
    seg = np.repeat(np.arange(len(starts)), lengths)
    offs = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return lines[seg], starts[seg] + offs


def _row_runs(segs: Segments, state: int):
    """Runs of ``state`` along rows: ``(line, start col, end col)``, sorted by (line, start)."""
    return segs.intervals(state)


def _col_runs(segs: Segments, state: int):
    """Runs of ``state`` along columns: ``(line = z * Tc + c, start row, end row)``, sorted.

    A run of column ``c`` starts at row ``r`` where ``c`` is in row ``r``'s intervals and not in row
    ``r - 1``'s, and ends where the reverse holds. Both are found per row from the difference of the
    two rows' interval sets, so the cost is O(segments + runs)."""
    tr, tc = segs.n_rowblocks, segs.n_cols
    rows, s, e = segs.intervals(state)
    z, r = rows // tr, rows % tr
    vrow = z * (tr + 1) + r  # one empty virtual row after each instance closes its open runs
    nxt = vrow + 1
    keys = np.concatenate([vrow * (tc + 1) + s, vrow * (tc + 1) + e, nxt * (tc + 1) + s, nxt * (tc + 1) + e])
    delta = np.concatenate([np.ones(len(s), np.int64), -np.ones(len(s), np.int64),
                            -np.ones(len(s), np.int64), np.ones(len(s), np.int64)])
    order = np.argsort(keys, kind="stable")
    keys, delta = keys[order], delta[order]
    if len(keys) == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    first = np.ones(len(keys), dtype=bool)
    first[1:] = keys[1:] != keys[:-1]
    ukeys = keys[first]
    val = np.cumsum(np.add.reduceat(delta, np.nonzero(first)[0]))  # f_r - f_{r-1} on [key_k, key_k+1)
    # each row's deltas sum to zero, so the running sum restarts at every row
    k = np.nonzero(val != 0)[0]
    kv = ukeys[k] // (tc + 1)
    c0 = ukeys[k] % (tc + 1)
    c1 = ukeys[k + 1] % (tc + 1)  # the next key lies in the same row (the row's sum returns to 0)
    zz, rr = kv // (tr + 1), kv % (tr + 1)
    is_start = val[k] > 0
    sl, sr = _expand(zz[is_start] * tc, c0[is_start], c1[is_start])
    el, er = _expand(zz[~is_start] * tc, c0[~is_start], c1[~is_start])
    s_line, s_row = sl + sr, np.repeat(rr[is_start], c1[is_start] - c0[is_start])
    e_line, e_row = el + er, np.repeat(rr[~is_start], c1[~is_start] - c0[~is_start])
    so = np.lexsort((s_row, s_line))
    eo = np.lexsort((e_row, e_line))
    return s_line[so], s_row[so], e_row[eo]


def _blocks(segs: Segments, state: int, by_col: bool):
    """Every block in ``state`` as ``(line, index)``, sorted by line then index."""
    rows, s, e = segs.intervals(state)
    line, col = _expand(rows, s, e)
    if not by_col:
        return line, col
    tr, tc = segs.n_rowblocks, segs.n_cols
    cl = (line // tr) * tc + col
    r = line % tr
    order = np.lexsort((r, cl))
    return cl[order], r[order]


def build_side(segs: Segments, by_col: bool, edge: bool = False, runs: bool | None = None,
               max_listed: int | None = None) -> SideTables:
    """Kernel tables of one side.

    Args:
        segs: the layout's block states (no UNSURE left).
        by_col: column side (dK/dV) instead of row side (forward, dQ).
        edge: move full blocks of the ragged edge (last column for rows, last row block for
            columns) to the masked lists.
        runs: store single-run unmasked lists as runs: ``True`` whenever possible, ``False`` never,
            ``None`` only when listing them would exceed ``max_listed`` entries.
        max_listed: see ``runs``.
    """
    if edge:
        segs = segs.demote_full(last_col=not by_col, last_rowblock=by_col)
    n = segs.n_instances * (segs.n_cols if by_col else segs.n_rowblocks)
    line, a, b = _col_runs(segs, FULL) if by_col else _row_runs(segs, FULL)
    counts = np.bincount(line, weights=b - a, minlength=n).astype(np.int64) if len(line) else np.zeros(n, np.int64)
    full_ptr = _ptr(None, n, counts)
    total = int(full_ptr[-1])
    single = len(line) == 0 or np.all(line[1:] != line[:-1])
    use_runs = single and (runs if runs is not None else total > (max_listed if max_listed is not None else MAX_INT32))
    if use_runs:
        first = np.zeros(n, np.int64)
        first[line] = a
        full_idx = first - full_ptr[:-1]
    else:
        full_idx = _expand(line, a, b)[1] if total else np.zeros(0, np.int64)
    p_line, p_idx = _blocks(segs, PARTIAL, by_col)
    part_ptr = _ptr(p_line, n)
    if max(total, len(p_idx)) > MAX_INT32:
        raise ValueError(f"layout too large for int32 lookup tables ({total} unmasked, {len(p_idx)} masked blocks "
                         f"on one side); use a larger block_size")
    i32 = lambda x: np.ascontiguousarray(x, dtype=np.int32)  # noqa: E731
    return SideTables(i32(full_ptr), i32(full_idx), i32(part_ptr), i32(p_idx), bool(use_runs))


def build_luts(segs: Segments, masked_edge_col: bool = False, masked_edge_row: bool = False):
    """Exact expanded ``(row_lut, col_lut)`` (every visited block listed).

    Args:
        segs: the layout's block states (no UNSURE left).
        masked_edge_col: put full blocks of the last column into the rows' masked lists.
        masked_edge_row: put full blocks of the last row block into the columns' masked lists.
    """
    out = []
    for by_col, edge in ((False, masked_edge_col), (True, masked_edge_row)):
        t = build_side(segs, by_col, edge, runs=False)
        out.append(LUT(*(torch.from_numpy(a) for a in (t.full_ptr, t.full_idx, t.part_ptr, t.part_idx))))
    return out[0], out[1]
