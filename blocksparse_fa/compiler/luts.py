"""Lookup tables (CSR, int32) that drive the kernels.

Row tables (forward, dQ): for each layout row ``z * Tr + r`` the column blocks to visit, split into
a *masked* list (the element predicate and bounds are evaluated) and an *unmasked* list (full blocks,
no masking at all). Column tables (dK/dV): the transpose, per ``z * Tc + c``.

In the *exact* tables the masked lists hold exactly the partial blocks. The *kernel* tables also put
full blocks on a ragged edge (the last column block when ``kv_len % bn != 0`` for rows, the last row
block when ``q_len % bm != 0`` for columns) in the masked list, so that unmasked tiles never need a
bounds check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .segments import FULL, Segments


@dataclass
class LUT:
    """One side's tables. ``*_ptr`` has ``n + 1`` offsets into ``*_idx``."""

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


def _csr(owner: np.ndarray, values: np.ndarray, n: int):
    """owner sorted ascending; returns (ptr (n+1,), idx) int32 tensors."""
    counts = np.bincount(owner, minlength=n)
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return torch.from_numpy(ptr.astype(np.int32)), torch.from_numpy(values.astype(np.int32))


def build_luts(segs: Segments, masked_edge_col: bool = False, masked_edge_row: bool = False):
    """Row and column LUTs from block states.

    Args:
        segs: the layout's block states (no UNSURE left).
        masked_edge_col: put full blocks of the last column into the rows' masked lists.
        masked_edge_row: put full blocks of the last row block into the columns' masked lists.

    Returns:
        ``(row_lut, col_lut)``.
    """
    tr, tc, z = segs.n_rowblocks, segs.n_cols, segs.n_instances
    rows, cols, st = segs.blocks(nonempty=True)  # sorted by (row, col)
    full = st == FULL
    row_masked = ~full
    if masked_edge_col:
        row_masked = row_masked | (cols == tc - 1)
    col_masked = ~full
    if masked_edge_row:
        col_masked = col_masked | (rows % tr == tr - 1)
    n_rows = z * tr
    fp, fi = _csr(rows[~row_masked], cols[~row_masked], n_rows)
    pp, pi = _csr(rows[row_masked], cols[row_masked], n_rows)
    row_lut = LUT(fp, fi, pp, pi)
    # transpose: owner = z * Tc + c, value = r
    zz, rr = rows // tr, rows % tr
    ckey = zz * tc + cols
    order = np.lexsort((rr, ckey))
    ckey, rr, cm = ckey[order], rr[order], col_masked[order]
    n_cols = z * tc
    fp, fi = _csr(ckey[~cm], rr[~cm], n_cols)
    pp, pi = _csr(ckey[cm], rr[cm], n_cols)
    return row_lut, LUT(fp, fi, pp, pi)
