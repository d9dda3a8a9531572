"""Block-Toeplitz layouts: masks of the distance ``qp - j`` alone, on square blocks.

When every leaf of a mask keeps ``(qp, j)`` by a rule on ``d = qp - j`` only (``full``, ``causal``,
``window``, ``sliding_window``, ``strided``, combined with ``&``, ``|``, ``~``), the blocks are
square (``bm = bn = b``) and both lengths are multiples of ``b``, block ``(r, c)`` holds exactly
the distances ``d = (r - c)·b + off + δ``, ``|δ| < b``. Its state is then a function of the block
diagonal ``m = r - c`` alone: one vector ``f`` of ``Tr + Tc - 1`` states describes the layout, and
it is exact (the mask is evaluated once per distance, ``O(q_len + kv_len)``).

Strided masks need this: their partial blocks (every ``s/b``-th block of each row below the band)
number ``~Tr·Tc·b/s``, so run-length encoded rows and listed tables grow with the square of the
length (134 MB and 32 s at 1M tokens for Sparse Transformer's pattern). From ``f`` the kernels'
tables are built per line in ``O(Tr + Tc)``: the unmasked lists as runs and the masked lists as
arithmetic progressions (``kernels/common.lut_first``, mode ``"step"``), when every line's list
has that form; otherwise they are listed, in time proportional to their size.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..mask import primitives as P
from ..mask.expr import And, EvalContext, Mask, Not, Or
from .luts import MAX_INT32, SideTables, _expand
from .segments import EMPTY, FULL, PARTIAL, Segments

__all__ = ["Diagonals", "diagonal_states"]

_DISTANCE_LEAVES = (P.Full, P.Causal, P.Window, P.SlidingWindow, P.Strided)


def _distance_only(mask: Mask) -> bool:
    """Whether ``mask`` is built from leaves that depend on ``qp - j`` alone and holds a
    ``strided`` leaf (the other distance masks have few partial blocks: no need for this form)."""
    has_strided = False
    for node in mask.nodes():
        if isinstance(node, (And, Or, Not)):
            continue
        if type(node) not in _DISTANCE_LEAVES or node.has_tensor_params:
            return False
        has_strided |= isinstance(node, P.Strided)
    return has_strided


class Diagonals:
    """States of a block-Toeplitz layout: block ``(r, c)`` has state ``f[r - c + Tc - 1]``.

    Attributes:
        tr, tc: the block grid.
        f: int8 ``(Tr + Tc - 1,)``, the states of the diagonals ``m = -(Tc - 1) .. Tr - 1``,
            computed on first use (the mask evaluated once per distance).
    """

    def __init__(self, mask: Mask, grid):
        self._mask, self._grid = mask, grid
        self.tr, self.tc = grid.tr, grid.tc

    @functools.cached_property
    def f(self) -> np.ndarray:
        g, b = self._grid, self._grid.bm
        off = g.off
        d = torch.arange(off - g.kv_len + 1, off + g.q_len, dtype=torch.int64)  # every distance
        kept = self._mask._eval(EvalContext(g.q_len, g.kv_len, d, d, torch.zeros_like(d))).expand(d.shape).numpy()
        csum = np.zeros(len(kept) + 1, dtype=np.int64)
        np.cumsum(kept, out=csum[1:])
        m = np.arange(-(self.tc - 1), self.tr, dtype=np.int64)
        lo = m * b + off - (b - 1) - int(d[0])  # the diagonal's distances, as indices into ``kept``
        n_kept = csum[lo + 2 * b - 1] - csum[lo]
        return np.where(n_kept == 2 * b - 1, FULL, np.where(n_kept == 0, EMPTY, PARTIAL)).astype(np.int8)

    # -- whole-layout views ---------------------------------------------------------------------
    def _lines_per_diagonal(self) -> np.ndarray:
        m = np.arange(-(self.tc - 1), self.tr, dtype=np.int64)
        return np.minimum(self.tr, self.tc + m) - np.maximum(0, m)

    def counts(self) -> dict:
        """Blocks per state (``EMPTY``, ``PARTIAL``, ``FULL``)."""
        n = self._lines_per_diagonal()
        return {s: int(n[self.f == s].sum()) for s in (EMPTY, PARTIAL, FULL)}

    def segments(self) -> Segments:
        """The run-length encoded rows (their size is the layout's: quadratic for strided masks)."""
        tr, tc, f = self.tr, self.tc, self.f
        # row r reads f[r + tc - 1 - c] for c = 0 .. tc - 1; a segment starts at column c > 0 where
        # f[x] differs from f[x + 1], x = r + tc - 1 - c
        x = np.nonzero(f[:-1] != f[1:])[0].astype(np.int64)
        r_lo = np.maximum(x - tc + 2, 0)
        r_hi = np.minimum(x, tr - 1)
        cnt = np.maximum(r_hi - r_lo + 1, 0)
        xs = np.repeat(x, cnt)
        rows = np.repeat(r_lo, cnt) + (np.arange(int(cnt.sum()), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt))
        cols = rows + tc - 1 - xs
        base = np.arange(tr, dtype=np.int64)
        key = np.concatenate([base * (tc + 1), rows * (tc + 1) + cols])
        st = np.concatenate([f[base + tc - 1], f[xs]])
        order = np.argsort(key, kind="stable")
        return Segments._compress((1, 1), tr, tc, key[order], st[order])

    # -- the kernels' tables --------------------------------------------------------------------
    def _windows(self, by_col: bool):
        """Per line: ``(a, sign, w0, w1)``: block of diagonal ``m`` is ``a + sign·m`` for ``m`` in
        ``[w0, w1]`` (rows: ``c = r - m``; columns: ``r = c + m``)."""
        if by_col:
            a = np.arange(self.tc, dtype=np.int64)
            return a, 1, -a, self.tr - 1 - a
        a = np.arange(self.tr, dtype=np.int64)
        return a, -1, a - (self.tc - 1), a

    def _runs(self, state: int):
        """Maximal runs ``[lo, hi]`` of consecutive diagonals in ``state`` (as ``m`` values)."""
        sel = np.concatenate([[False], self.f == state, [False]])
        edges = np.nonzero(sel[1:] != sel[:-1])[0]
        off = self.tc - 1
        return edges[0::2].astype(np.int64) - off, edges[1::2].astype(np.int64) - 1 - off

    def _listed(self, state: int, by_col: bool):
        """``(ptr, idx)`` of every line's blocks in ``state``, ascending, in time of their number."""
        a, sign, w0, w1 = self._windows(by_col)
        lo, hi = self._runs(state)
        i0 = np.searchsorted(hi, w0, side="left")  # runs that meet the line's window
        i1 = np.searchsorted(lo, w1, side="right")
        cnt = np.maximum(i1 - i0, 0)
        line = np.repeat(np.arange(len(a), dtype=np.int64), cnt)
        k = np.arange(int(cnt.sum()), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        # ascending blocks: rows take the runs from high m down, columns from low m up
        run = np.repeat(i1 - 1, cnt) - k if sign < 0 else np.repeat(i0, cnt) + k
        m0 = np.maximum(lo[run], w0[line])
        m1 = np.minimum(hi[run], w1[line])
        first = a[line] + (sign * m1 if sign < 0 else m0)
        last = a[line] + (sign * m0 if sign < 0 else m1)
        lines, idx = _expand(line, first, last + 1)
        return np.bincount(lines, minlength=len(a)).astype(np.int64), idx

    def _progressions(self, state: int, by_col: bool):
        """``(counts, first, step)`` per line when the diagonals in ``state`` form one arithmetic
        progression (then so does every line's list), else None."""
        m = np.nonzero(self.f == state)[0].astype(np.int64) - (self.tc - 1)
        a, sign, w0, w1 = self._windows(by_col)
        if len(m) == 0:
            return np.zeros(len(a), np.int64), np.zeros(len(a), np.int64), 1
        step = int(m[1] - m[0]) if len(m) > 1 else 1
        if len(m) > 2 and not np.all(np.diff(m) == step):
            return None
        t_lo = np.maximum(-((m[0] - w0) // step), 0)  # ceil((w0 - m0) / step)
        t_hi = np.minimum((w1 - m[0]) // step, len(m) - 1)
        counts = np.maximum(t_hi - t_lo + 1, 0)
        first = a + (sign * (m[0] + t_hi * step) if sign < 0 else m[0] + t_lo * step)
        return counts, np.where(counts > 0, first, 0), step

    def side(self, by_col: bool, runs: bool | None = None, max_listed: int | None = None,
             part_steps: int | None = None) -> SideTables:
        """Kernel tables of one side, as :func:`blocksparse_fa.compiler.luts.build_side` builds them
        from the segments (no ragged edges here). ``runs``/``max_listed``: the unmasked lists as
        runs (``True``: whenever every line is one run; ``None``: only when listing them would
        exceed ``max_listed`` entries). ``part_steps``: the masked lists as arithmetic progressions
        (mode ``"step"``) when they are and listing them would exceed this many entries (None:
        never)."""
        n = self.tc if by_col else self.tr
        counts = self.counts()
        full = self._progressions(FULL, by_col)
        use_runs = (full is not None and full[2] == 1 and runs is not False
                    and (runs or counts[FULL] > (max_listed if max_listed is not None else MAX_INT32)))
        if use_runs:
            cnt, first, _ = full
            full_ptr = _ptr(cnt)
            full_idx = first - full_ptr[:-1]
        else:
            cnt, full_idx = self._listed(FULL, by_col)
            full_ptr = _ptr(cnt)
        part = None
        if part_steps is not None and counts[PARTIAL] > part_steps:
            part = self._progressions(PARTIAL, by_col)
        step = 0
        if part is not None:
            cnt, first, step = part
            part_ptr = _ptr(cnt)
            base = first - part_ptr[:-1] * step
            if len(base) and max(abs(int(base.min())), abs(int(base.max()))) > MAX_INT32:
                part = None
        if part is not None:
            part_idx = np.concatenate([[step], base])
        else:
            step = 0
            cnt, part_idx = self._listed(PARTIAL, by_col)
            part_ptr = _ptr(cnt)
        if max(int(full_ptr[-1]), int(part_ptr[-1])) > MAX_INT32:
            raise ValueError(f"layout too large for int32 lookup tables ({int(full_ptr[-1])} unmasked, "
                             f"{int(part_ptr[-1])} masked blocks on one side); use a larger block_size")
        i32 = lambda x: np.ascontiguousarray(x, dtype=np.int32)  # noqa: E731
        return SideTables(i32(full_ptr), i32(full_idx), i32(part_ptr), i32(part_idx), bool(use_runs), int(step))


def _ptr(counts: np.ndarray) -> np.ndarray:
    ptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ptr


def diagonal_states(mask: Mask, grid) -> Diagonals | None:
    """The :class:`Diagonals` of ``mask`` on ``grid`` when the layout is block-Toeplitz (see the
    module docstring) and the mask holds a ``strided`` leaf, else None. Cheap: the states are
    computed on first use."""
    b = grid.bm
    if (grid.bn != b or grid.shift or grid.q_len % b or grid.kv_len % b or b < 2
            or not _distance_only(mask)):
        return None
    return Diagonals(mask, grid)
