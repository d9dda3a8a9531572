"""BlockLayout: a compiled mask — block states, lookup tables and ways to look at them."""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..mask.expr import Mask
from .classify import Grid, block_context
from .luts import LUT, build_luts
from .segments import EMPTY, FULL, PARTIAL, Segments

__all__ = ["BlockLayout"]


class BlockLayout:
    """A mask compiled for ``(q_len, kv_len)`` at a block size.

    Attributes:
        mask: the source expression.
        q_len, kv_len: lengths it was compiled for.
        block_size: ``(bm, bn)``.
        batch_shape: ``()`` or ``(B, H)`` when the mask depends on batch/head.
        device: device of the lookup tables.
        n_refined: blocks whose state was settled by evaluating the mask on them.
        compile_seconds: wall time of the compile.
    """

    def __init__(self, mask: Mask, grid: Grid, segs: Segments, device, n_refined: int = 0, compile_seconds: float = 0.0):
        self.mask = mask
        self._grid = grid
        self._segs = segs
        self.q_len, self.kv_len = grid.q_len, grid.kv_len
        self.block_size = (grid.bm, grid.bn)
        self.batch_shape = mask.batch_shape
        self.device = torch.device(device)
        self.n_refined = n_refined
        self.compile_seconds = compile_seconds
        rows, cols = build_luts(segs)
        self.row_lut: LUT = rows.to(self.device)
        """Per layout row: full (unmasked) and partial (masked) column blocks; int32 CSR."""
        self.col_lut: LUT = cols.to(self.device)
        """Per layout column: full and partial row blocks (transpose, for dK/dV); int32 CSR."""

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        """``(Tr, Tc)``, with leading ``(B, H)`` when the layout has batch dims."""
        return (*self.batch_shape, self._grid.tr, self._grid.tc)

    @property
    def q_offset(self) -> int:
        """Absolute position of query row 0: query row ``i`` sits at ``i + q_offset``."""
        return self._grid.off

    @property
    def align(self) -> str:
        """``"bottom_right"`` (``q_offset = kv_len - q_len``) or ``"top_left"`` (``q_offset = 0``)."""
        return self._grid.align

    @property
    def n_blocks(self) -> int:
        return self._segs.n_rows * self._grid.tc

    @functools.cached_property
    def _counts(self):
        return {s: self._segs.count(s) for s in (EMPTY, PARTIAL, FULL)}

    @property
    def n_full(self) -> int:
        return self._counts[FULL]

    @property
    def n_partial(self) -> int:
        """Blocks left partial (the kernels evaluate the element predicate only on these)."""
        return self._counts[PARTIAL]

    @property
    def n_nonempty(self) -> int:
        return self.n_full + self.n_partial

    @property
    def density(self) -> float:
        """Fraction of blocks that are non-empty (the work the kernels do relative to dense)."""
        return self.n_nonempty / self.n_blocks

    @property
    def partial_fraction(self) -> float:
        """Fraction of the non-empty blocks that are partial (0 when none are non-empty)."""
        return self.n_partial / self.n_nonempty if self.n_nonempty else 0.0

    @property
    def lut_bytes(self) -> int:
        """Bytes of the row and column lookup tables."""
        return self.row_lut.nbytes + self.col_lut.nbytes

    # -- views -----------------------------------------------------------------------------------
    def block_states(self) -> torch.Tensor:
        """``torch.int8`` ``(Tr, Tc)`` (or ``(B, H, Tr, Tc)``): 0 empty, 1 partial, 2 full."""
        st = torch.from_numpy(self._segs.to_dense())
        return st.reshape(self.shape).to(self.device)

    def nonempty_blocks(self):
        """``(rows, cols, states)`` numpy arrays of the non-empty blocks (row = z * Tr + r)."""
        return self._segs.blocks(nonempty=True)

    def _block_values(self, rows, cols, device="cpu"):
        """Exact kept-mask ``(K, bm, bn)`` of the given blocks and their validity (ragged edges)."""
        ctx, valid = block_context(self.mask, self._grid, rows, cols, device)
        return self.mask._eval(ctx).expand(valid.shape) & valid, valid

    def to_dense(self) -> torch.Tensor:
        """Expand to ``bool (q_len, kv_len)`` (or ``(B, H, q_len, kv_len)``): full blocks all true,
        partial blocks through the mask's predicate. Equals ``mask.to_dense(q_len, kv_len)``."""
        g = self._grid
        z = self._segs.n_instances
        out = torch.zeros(z, g.tr * g.bm, g.tc * g.bn, dtype=torch.bool)
        view = out.view(z, g.tr, g.bm, g.tc, g.bn)
        rows, cols, st = self.nonempty_blocks()
        zi, ri = rows // g.tr, rows % g.tr
        full = st == FULL
        view[zi[full], ri[full], :, cols[full], :] = True
        part = np.nonzero(~full)[0]
        for k0 in range(0, len(part), 4096):
            sel = part[k0:k0 + 4096]
            vals, _ = self._block_values(rows[sel], cols[sel])
            view[zi[sel], ri[sel], :, cols[sel], :] = vals
        out = out[:, : g.q_len, : g.kv_len]
        return out.reshape(*self.batch_shape, g.q_len, g.kv_len).contiguous().to(self.device)

    def element_density(self, device="cpu") -> float:
        """Exact fraction of kept (query, key) pairs, evaluated block-wise (on ``device``)."""
        g = self._grid
        rows, cols, st = self.nonempty_blocks()
        r = rows % g.tr
        h = np.minimum((r + 1) * g.bm, g.q_len) - r * g.bm
        w = np.minimum((cols + 1) * g.bn, g.kv_len) - cols * g.bn
        full = st == FULL
        kept = float((h[full] * w[full]).sum())
        part = np.nonzero(~full)[0]
        for k0 in range(0, len(part), 4096):
            sel = part[k0:k0 + 4096]
            vals, _ = self._block_values(rows[sel], cols[sel], device)
            kept += float(vals.sum())
        return kept / (self._segs.n_instances * g.q_len * g.kv_len)

    def kernel_luts(self) -> tuple[LUT, LUT]:
        """Row/column LUTs for the kernels: full blocks on ragged edges moved to the masked lists."""
        cached = getattr(self, "_kernel_luts", None)
        if cached is None:
            g = self._grid
            edge_c, edge_r = g.kv_len % g.bn != 0, g.q_len % g.bm != 0
            if edge_c or edge_r:
                rows, cols = build_luts(self._segs, edge_c, edge_r)
                cached = (rows.to(self.device), cols.to(self.device))
            else:
                cached = (self.row_lut, self.col_lut)
            self._kernel_luts = cached
        return cached

    # -- pictures -------------------------------------------------------------------------------
    def _char_grid(self, width: int, instance: int = 0) -> list[str]:
        g = self._grid
        fr = max(1, -(-g.tr // width))
        fc = max(1, -(-g.tc // width))
        nr, nc = -(-g.tr // fr), -(-g.tc // fc)
        rows, cols, st = self.nonempty_blocks()
        sel = rows // g.tr == instance
        r, c, s = rows[sel] % g.tr, cols[sel], st[sel]
        cell = (r // fr) * nc + c // fc
        nonempty = np.bincount(cell, minlength=nr * nc)
        full = np.bincount(cell[s == FULL], minlength=nr * nc)
        rr, cc = np.divmod(np.arange(nr * nc), nc)
        size = (np.minimum((rr + 1) * fr, g.tr) - rr * fr) * (np.minimum((cc + 1) * fc, g.tc) - cc * fc)
        ch = np.where(nonempty == 0, ".", np.where(full == size, "#", "+")).reshape(nr, nc)
        return ["".join(row) for row in ch]

    def summary(self) -> str:
        bm, bn = self.block_size
        tr, tc = self._grid.tr, self._grid.tc
        bs = f", batch_shape={self.batch_shape}" if self.batch_shape else ""
        return (f"BlockLayout({self.mask}) q_len={self.q_len} kv_len={self.kv_len} block=({bm}, {bn}) "
                f"grid={tr}x{tc}{bs}\n  density={self.density:.4f} partial_fraction={self.partial_fraction:.4f} "
                f"full={self.n_full} partial={self.n_partial} refined={self.n_refined} lut_bytes={self.lut_bytes}")

    def ascii(self, width: int = 64, instance: int = 0) -> str:
        """ASCII picture: ``#`` all full, ``+`` some kept, ``.`` empty (a character may stand for
        several blocks when the grid is wider than ``width``)."""
        g = self._grid
        fr, fc = max(1, -(-g.tr // width)), max(1, -(-g.tc // width))
        scale = f" (1 char = {fr}x{fc} blocks)" if fr > 1 or fc > 1 else ""
        return "\n".join([self.summary() + scale, *self._char_grid(width, instance)])

    def __str__(self) -> str:
        return self.ascii()

    def __repr__(self) -> str:
        return self.summary()

    def plot(self, path=None, instance: int = 0, ax=None):
        """Plot block states with matplotlib (white empty, orange partial, blue full); save a PNG
        to ``path`` if given. Returns the matplotlib figure."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap

        st = self._segs.to_dense()[instance] if self._segs.n_rows * self._grid.tc <= 1 << 24 else None
        if st is None:  # very large grids: draw the character-grid summary instead
            chars = self._char_grid(1024, instance)
            st = np.array([[{".": 0, "+": 1, "#": 2}[c] for c in row] for row in chars], dtype=np.int8)
        if ax is None:
            fig, ax = plt.subplots(figsize=(6, 6 * st.shape[0] / max(1, st.shape[1]) + 0.6))
        else:
            fig = ax.figure
        ax.imshow(st, cmap=ListedColormap(["#ffffff", "#f5a623", "#1f5fbf"]), vmin=0, vmax=2, interpolation="nearest")
        ax.set_title(f"{self.mask}\nq={self.q_len} kv={self.kv_len} block={self.block_size} density={self.density:.3f}",
                     fontsize=8)
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
        if path is not None:
            fig.savefig(path, dpi=120, bbox_inches="tight")
        return fig
