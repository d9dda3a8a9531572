"""BlockLayout: a compiled mask — block states, lookup tables and ways to look at them."""

from __future__ import annotations

import functools
import operator

import numpy as np
import torch

from ..mask.expr import Mask
from .classify import Grid, block_context
from .finer import classified_states, list_states
from .luts import LUT, SideTables, build_luts, build_side
from .segments import EMPTY, FULL, PARTIAL, Segments

__all__ = ["BlockLayout", "LayoutInstance", "COL_LIST_LIMIT", "PART_LIST_LIMIT"]

COL_LIST_LIMIT = 1 << 22
"""Column-side unmasked lists longer than this (in entries) are stored as runs when they are runs.
Below it the dK/dV loop reads listed indices, which measured faster on the H100 (fewer live
registers than index arithmetic there, ``benchmarks/NOTES.md``)."""

PART_LIST_LIMIT = 1 << 20
"""Masked lists longer than this (in entries, per side) are stored as arithmetic progressions
where they are (strided masks, ``compiler/toeplitz.py``): their tables then grow with the number
of lines, not with the square of the length. Below it they stay listed (the kernels' measured
index modes)."""


class _BlockCounts:
    """Block counts from ``self._counts`` (a dict state -> number of blocks)."""

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


class BlockLayout(_BlockCounts):
    """A mask compiled for ``(q_len, kv_len)`` at a block size: everything the kernels need.

    ``compile_mask`` returns one. It holds the block states (run-length encoded), and builds on
    first use and then keeps: the kernels' lookup tables (:meth:`kernel_tables`), any exact rewrite
    the compiler chose (:attr:`rewrite`, e.g. the strided pattern as a band plus residue classes),
    and, per device, what the backends derive from it (tables and predicate payload on the device,
    work lists, tile class) in :attr:`cache`. Passing it as ``mask=`` to :func:`blocksparse_fa.attention`
    therefore runs exactly as passing the expression, with no work repeated.

    Attributes:
        mask: the source expression.
        q_len, kv_len: lengths it was compiled for.
        block_size: ``(bm, bn)``.
        batch_shape: ``()`` or ``(B, H)`` when the mask depends on batch/head.
        device: device of the lookup tables.
        n_refined: blocks whose state was settled by evaluating the mask on them.
        compile_seconds: wall time of the compile.
        rewrite: a :class:`~blocksparse_fa.compiler.rewrite.Rewrite` when the compiler computes this
            mask as exact parts (band + residue classes), else ``None``.
        cache: per-device state the backends build once (tables on the device, payload, work lists).
    """

    def __init__(self, mask: Mask, grid: Grid, segs, device, n_refined: int = 0, compile_seconds: float = 0.0,
                 rewrite=None, diagonals=None):
        """``segs``: the block states, ``(Segments, n_refined)``, or a function returning that pair
        (called on first use). ``diagonals``: the states of a block-Toeplitz layout
        (:class:`~blocksparse_fa.compiler.toeplitz.Diagonals`), from which counts and the kernels'
        tables follow without the segments."""
        self.mask = mask
        self._grid = grid
        if isinstance(segs, tuple):
            segs, n_refined = segs
        self._states = segs
        self.q_len, self.kv_len = grid.q_len, grid.kv_len
        self.block_size = (grid.bm, grid.bn)
        self.batch_shape = mask.batch_shape
        self.device = torch.device(device)
        self._n_refined = n_refined
        self.compile_seconds = compile_seconds
        self.rewrite = rewrite
        self.diagonals = diagonals
        self.cache: dict = {}

    @property
    def _segs(self) -> Segments:
        """The block states, run-length encoded (classified on first use when compiled lazily)."""
        st = self._states
        if not isinstance(st, Segments):
            st, self._n_refined = st()
            self._states = st
        return st

    @property
    def n_refined(self) -> int:
        """Blocks whose state was settled by evaluating the mask on them."""
        self._segs
        return self._n_refined

    def to(self, device) -> "BlockLayout":
        """The same layout with its tables on ``device`` (shares the block states and rewrite)."""
        device = torch.device(device)
        if device == self.device:
            return self
        segs = self._states if not isinstance(self._states, Segments) else (self._states, self._n_refined)
        return BlockLayout(self.mask, self._grid, segs, device, 0, self.compile_seconds, self.rewrite, self.diagonals)

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
    def n_rows(self) -> int:
        """Layout rows: ``Tr`` per (batch, head) instance of the mask."""
        bm, hm = self.batch_shape or (1, 1)
        return bm * hm * self._grid.tr

    @property
    def n_blocks(self) -> int:
        return self.n_rows * self._grid.tc

    @functools.cached_property
    def _counts(self):
        if self.diagonals is not None:
            return self.diagonals.counts()
        return {s: self._segs.count(s) for s in (EMPTY, PARTIAL, FULL)}


    @property
    def density(self) -> float:
        """Fraction of blocks that are non-empty (the work the kernels do relative to dense)."""
        return self.n_nonempty / self.n_blocks

    def sparsity(self) -> float:
        """``1 - density``: the fraction of blocks skipped (FlexAttention's ``BlockMask.sparsity()``
        reports the same quantity in percent)."""
        return 1.0 - self.density

    @property
    def partial_fraction(self) -> float:
        """Fraction of the non-empty blocks that are partial (0 when none are non-empty)."""
        return self.n_partial / self.n_nonempty if self.n_nonempty else 0.0

    @property
    def lut_bytes(self) -> int:
        """Bytes of the kernels' lookup tables (:meth:`kernel_tables`, both sides)."""
        rows, cols = self.kernel_tables()
        return rows.nbytes + cols.nbytes

    # -- tables ---------------------------------------------------------------------------------
    @functools.cached_property
    def row_lut(self) -> LUT:
        """Exact expanded row tables: per layout row, full (unmasked) and partial (masked) column
        blocks, int32 CSR (built on first use; O(visited blocks))."""
        return build_luts(self._segs)[0].to(self.device)

    @functools.cached_property
    def col_lut(self) -> LUT:
        """Exact expanded column tables (the transpose, for dK/dV), int32 CSR (built on first use)."""
        return build_luts(self._segs)[1].to(self.device)

    def kernel_tables(self, row_runs: bool = True, col_runs: bool | None = None, row_list: int | None = None,
                      col_list: int | None = None) -> tuple[SideTables, SideTables]:
        """``(rows, cols)`` tables the kernels read (numpy, cached): full blocks on ragged edges
        moved to the masked lists; unmasked lists stored as runs where every line is one run:
        rows when ``row_runs``, columns when ``col_runs`` (``None``: when listing them would exceed
        ``COL_LIST_LIMIT`` entries). Their size then scales with the layout's structure, not its
        area.

        ``row_list`` (keys per row entry, a divisor of ``bn``) and ``col_list`` (queries per column
        entry, a divisor of ``bm``): list the blocks of a finer classification
        (``compiler/finer.py``); a row line still covers ``bm`` queries and a column line ``bn``
        keys. Default: the layout block."""
        g = self._grid
        row_list, col_list = row_list or g.bn, col_list or g.bm
        rkey, ckey = ("row_table", bool(row_runs), row_list), ("col_table", col_runs, col_list)
        rows, cols = self.cache.get(rkey), self.cache.get(ckey)
        diag = self.diagonals
        if diag is not None and rows is None and row_list == g.bn:
            rows = self.cache[rkey] = diag.side(False, runs=bool(row_runs), part_steps=PART_LIST_LIMIT)
        if diag is not None and cols is None and col_list == g.bm:
            cols = self.cache[ckey] = diag.side(True, runs=col_runs, max_listed=COL_LIST_LIMIT,
                                                part_steps=PART_LIST_LIMIT)
        if rows is None:
            rows = self.cache[rkey] = build_side(list_states(self, g.bm, row_list), False,
                                                 edge=g.kv_len % row_list != 0, runs=bool(row_runs))
        if cols is None:
            cols = self.cache[ckey] = build_side(list_states(self, col_list, g.bn), True,
                                                 edge=g.q_len % col_list != 0, runs=col_runs,
                                                 max_listed=COL_LIST_LIMIT)
        return rows, cols

    def _finer_states(self, grid: Grid, coarse_up: Segments) -> Segments:
        """The mask's states on the finer ``grid``, limited to this layout's states ``coarse_up``
        (upsampled to it): :func:`~blocksparse_fa.compiler.finer.list_states` asks."""
        return classified_states(self.mask, grid, coarse_up)

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

    # -- pictures -------------------------------------------------------------------------------
    _CELL_CHARS = ".+#:"  # by cell class: empty, kept with partial blocks, full, mixed
    _CELL_NAMES = ("empty", "partial (some pairs kept)", "full", "mixed (some blocks empty, some not)")
    _CELL_COLOURS = ("#ffffff", "#f5a623", "#1f5fbf", "#b9b9b9")

    def _cell_scale(self, width: int) -> tuple[int, int]:
        """Blocks per picture cell ``(rows, columns)`` for a picture at most ``width`` cells wide."""
        g = self._grid
        return max(1, -(-g.tr // width)), max(1, -(-g.tc // width))

    def _cells(self, width: int, instance: int = 0) -> np.ndarray:
        """Cell classes ``(rows, cols)``: 0 every block empty, 1 no block empty and some partial,
        2 every block full, 3 some blocks empty and some not (only when a cell holds several blocks)."""
        g = self._grid
        fr, fc = self._cell_scale(width)
        nr, nc = -(-g.tr // fr), -(-g.tc // fc)
        rows, cols, st = self.nonempty_blocks()
        sel = rows // g.tr == instance
        r, c, s = rows[sel] % g.tr, cols[sel], st[sel]
        cell = (r // fr) * nc + c // fc
        nonempty = np.bincount(cell, minlength=nr * nc)
        full = np.bincount(cell[s == FULL], minlength=nr * nc)
        rr, cc = np.divmod(np.arange(nr * nc), nc)
        size = (np.minimum((rr + 1) * fr, g.tr) - rr * fr) * (np.minimum((cc + 1) * fc, g.tc) - cc * fc)
        out = np.where(nonempty == 0, 0, np.where(full == size, 2, np.where(nonempty == size, 1, 3)))
        return out.reshape(nr, nc).astype(np.int8)

    def _char_grid(self, width: int, instance: int = 0) -> list[str]:
        chars = np.array(list(self._CELL_CHARS))[self._cells(width, instance)]
        return ["".join(row) for row in chars]

    def _legend(self, width: int) -> str:
        fr, fc = self._cell_scale(width)
        classes = range(4) if fr > 1 or fc > 1 else range(3)
        return "  " + "  ".join(f"{self._CELL_CHARS[k]} {self._CELL_NAMES[k]}" for k in classes)

    def summary(self) -> str:
        bm, bn = self.block_size
        tr, tc = self._grid.tr, self._grid.tc
        bs = f", batch_shape={self.batch_shape}" if self.batch_shape else ""
        return (f"BlockLayout({self.mask}) q_len={self.q_len} kv_len={self.kv_len} block=({bm}, {bn}) "
                f"grid={tr}x{tc}{bs}\n  density={self.density:.4f} partial_fraction={self.partial_fraction:.4f} "
                f"full={self.n_full} partial={self.n_partial} refined={self.n_refined} lut_bytes={self.lut_bytes}")

    def ascii(self, width: int = 64, instance: int = 0) -> str:
        """ASCII picture with a legend: ``#`` full, ``+`` kept with partial blocks, ``.`` empty. When
        the grid is wider than ``width`` a character stands for several blocks: ``#`` all of them
        full, ``+`` none empty and some partial, ``:`` some empty and some not, ``.`` all empty."""
        fr, fc = self._cell_scale(width)
        scale = f" (1 char = {fr}x{fc} blocks)" if fr > 1 or fc > 1 else ""
        return "\n".join([self.summary() + scale, self._legend(width), *self._char_grid(width, instance)])

    def to_string(self, width: int = 64, instance: int = 0) -> str:
        """The ASCII picture of :meth:`ascii` (the name of FlexAttention's ``BlockMask.to_string``)."""
        return self.ascii(width, instance)

    def __str__(self) -> str:
        return self.ascii()

    def __repr__(self) -> str:
        return self.summary()

    # -- per batch / head ------------------------------------------------------------------------
    def __getitem__(self, index) -> "LayoutInstance":
        """``layout[b, h]``: the blocks batch ``b``, head ``h`` attends with, as a read-only
        :class:`LayoutInstance` (like FlexAttention's ``block_mask[b, h]``). A layout without batch
        dims, or with size 1 in one, serves every index there."""
        if not isinstance(index, tuple) or len(index) != 2:
            raise TypeError(f"index a BlockLayout with [b, h] (two ints), got {index!r}")
        bm, hm = self.batch_shape or (1, 1)
        out = []
        for name, i, n in (("b", index[0], bm), ("h", index[1], hm)):
            try:
                i = operator.index(i)
            except TypeError:
                raise TypeError(f"BlockLayout index {name} must be an int, got {type(i).__name__}") from None
            if n == 1:
                out.append(0)
                continue
            if not -n <= i < n:
                raise IndexError(f"BlockLayout index {name}={i} is out of range for the mask's batch shape "
                                 f"{self.batch_shape}")
            out.append(i % n)
        return LayoutInstance(self, out[0], out[1])

    def plot(self, path=None, instance: int = 0, ax=None):
        """Plot block states with matplotlib (white empty, orange partial, blue full, with a
        legend); save a PNG to ``path`` if given. Draws on ``ax`` if given, else on a new
        :class:`matplotlib.figure.Figure` (no pyplot state: the caller's backend and figures are
        left alone). Very large grids are drawn at 1024 cells a side (grey: cells that mix empty
        and non-empty blocks). Needs matplotlib (``pip install "blocksparse_fa[plot]"``).

        Returns:
            The matplotlib figure.
        """
        try:
            from matplotlib.colors import ListedColormap
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as e:
            raise ImportError("BlockLayout.plot needs matplotlib: pip install 'blocksparse_fa[plot]'") from e

        if self._segs.n_rows * self._grid.tc <= 1 << 24:
            st = self._segs.to_dense()[instance].astype(np.int8)
        else:  # very large grids: the cell summary
            st = self._cells(1024, instance)
        if ax is None:
            fig = Figure(figsize=(6, 6 * st.shape[0] / max(1, st.shape[1]) + 0.6))
            ax = fig.add_subplot()
        else:
            fig = ax.figure
        classes = [k for k in range(4) if k < 3 or (st == 3).any()]
        ax.imshow(st, cmap=ListedColormap(self._CELL_COLOURS), vmin=0, vmax=3, interpolation="nearest")
        ax.set_title(f"{self.mask}\nq={self.q_len} kv={self.kv_len} block={self.block_size} density={self.density:.3f}",
                     fontsize=8)
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
        ax.legend(handles=[Patch(facecolor=self._CELL_COLOURS[k], edgecolor="#555555", label=self._CELL_NAMES[k])
                           for k in classes], loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, frameon=False)
        if path is not None:
            fig.savefig(path, dpi=120, bbox_inches="tight")
        return fig


class LayoutInstance(_BlockCounts):
    """One (batch, head) instance of a :class:`BlockLayout` (``layout[b, h]``): its block states,
    counts, dense mask and pictures. It reads the parent layout's block states; nothing is copied."""

    def __init__(self, layout: BlockLayout, b: int, h: int):
        self.layout = layout
        self.b, self.h = b, h
        hm = (layout.batch_shape or (1, 1))[1]
        self._z = b * hm + h
        self.q_len, self.kv_len = layout.q_len, layout.kv_len
        self.block_size = layout.block_size
        self.mask = layout.mask
        self.device = layout.device

    @property
    def shape(self) -> tuple:
        """``(Tr, Tc)``."""
        return self.layout.shape[-2:]

    def block_states(self) -> torch.Tensor:
        """``torch.int8`` ``(Tr, Tc)``: 0 empty, 1 partial, 2 full."""
        st = self.layout.block_states()
        return st[self.b, self.h] if st.dim() == 4 else st

    def nonempty_blocks(self):
        """``(rows, cols, states)`` numpy arrays of this instance's non-empty blocks."""
        rows, cols, st = self.layout.nonempty_blocks()
        tr = self.layout._grid.tr
        sel = rows // tr == self._z
        return rows[sel] % tr, cols[sel], st[sel]

    @functools.cached_property
    def _counts(self):
        _, _, st = self.nonempty_blocks()
        return {s: int((st == s).sum()) for s in (PARTIAL, FULL)}


    @property
    def density(self) -> float:
        """Fraction of this instance's blocks that are non-empty."""
        tr, tc = self.shape
        return self.n_nonempty / (tr * tc)

    def sparsity(self) -> float:
        """``1 - density``."""
        return 1.0 - self.density

    def to_dense(self) -> torch.Tensor:
        """``bool (q_len, kv_len)``: this instance's mask, exactly."""
        lay = self.layout
        g = lay._grid
        out = torch.zeros(g.tr, g.bm, g.tc, g.bn, dtype=torch.bool)
        rows, cols, st = self.nonempty_blocks()
        full = st == FULL
        out[rows[full], :, cols[full], :] = True
        part = np.nonzero(~full)[0]
        for k0 in range(0, len(part), 4096):
            sel = part[k0:k0 + 4096]
            vals, _ = lay._block_values(rows[sel] + self._z * g.tr, cols[sel])
            out[rows[sel], :, cols[sel], :] = vals
        out = out.view(g.tr * g.bm, g.tc * g.bn)[: g.q_len, : g.kv_len]
        return out.contiguous().to(self.device)

    def ascii(self, width: int = 64) -> str:
        """The ASCII picture of this instance (see :meth:`BlockLayout.ascii`)."""
        lay = self.layout
        fr, fc = lay._cell_scale(width)
        scale = f" (1 char = {fr}x{fc} blocks)" if fr > 1 or fc > 1 else ""
        head = (f"{lay.summary().splitlines()[0]} [b={self.b}, h={self.h}]{scale}\n  density={self.density:.4f} "
                f"full={self.n_full} partial={self.n_partial}")
        return "\n".join([head, lay._legend(width), *lay._char_grid(width, self._z)])

    def to_string(self, width: int = 64) -> str:
        return self.ascii(width)

    def plot(self, path=None, ax=None):
        """Plot this instance's block states (see :meth:`BlockLayout.plot`)."""
        return self.layout.plot(path, instance=self._z, ax=ax)

    def __str__(self) -> str:
        return self.ascii()

    def __repr__(self) -> str:
        return (f"LayoutInstance(b={self.b}, h={self.h}, density={self.density:.4f}) of "
                f"{self.layout.summary().splitlines()[0]}")
