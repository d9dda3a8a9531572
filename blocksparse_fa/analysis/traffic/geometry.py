"""Layout geometry the model reads: non-empty blocks per row and column, tiles and launch order."""

from __future__ import annotations

import numpy as np

from .params import TrafficParams

class _Geometry:
    """Per-row / per-column sums of a layout's non-empty blocks, from its run-length segments."""

    def __init__(self, layout):
        self.q_len, self.kv_len = layout.q_len, layout.kv_len
        self.bm, self.bn = layout.block_size
        self.tr, self.tc = layout.shape[-2], layout.shape[-1]
        bs = tuple(layout.batch_shape) or (1, 1)
        self.zb, self.zh = bs
        self.n_inst = self.zb * self.zh
        segs = getattr(layout, "_segs", None)
        if segs is not None:
            sel = segs.state != 0
            rows, starts, ends = segs.rows[sel], segs.starts[sel], segs.ends[sel]
            partial = segs.state[sel] == 1
        else:  # fall back on the public view: one unit segment per block
            rows, cols, _ = layout.nonempty_blocks()
            partial = np.asarray(_) == 1
            rows, starts, ends = np.asarray(rows), np.asarray(cols), np.asarray(cols) + 1
        order = np.argsort(rows * (self.tc + 1) + starts, kind="stable")
        self.seg_row = np.asarray(rows, dtype=np.int64)[order]
        self.seg_start = np.asarray(starts, dtype=np.int64)[order]
        self.seg_end = np.asarray(ends, dtype=np.int64)[order]
        self.seg_partial = np.asarray(partial, dtype=bool)[order]
        # valid rows per layout row, valid keys per layout column (ragged edges)
        r = np.arange(self.tr)
        self.row_h = np.minimum((r + 1) * self.bm, self.q_len) - r * self.bm
        c = np.arange(self.tc)
        self.col_w = np.minimum((c + 1) * self.bn, self.kv_len) - c * self.bn
        wpref = np.concatenate([[0], np.cumsum(self.col_w)])
        nz = self.n_inst * self.tr
        lens = self.seg_end - self.seg_start
        self.row_cnt = np.bincount(self.seg_row, weights=lens, minlength=nz).reshape(self.n_inst, self.tr)
        self.row_part = np.bincount(self.seg_row, weights=lens * self.seg_partial,
                                    minlength=nz).reshape(self.n_inst, self.tr)
        self.row_keys = np.bincount(self.seg_row, weights=wpref[self.seg_end] - wpref[self.seg_start],
                                    minlength=nz).reshape(self.n_inst, self.tr)
        z = self.seg_row // self.tr
        hseg = self.row_h[self.seg_row % self.tr].astype(np.float64)
        n1 = self.n_inst * (self.tc + 1)
        diff_c = (np.bincount(z * (self.tc + 1) + self.seg_start, minlength=n1)
                  - np.bincount(z * (self.tc + 1) + self.seg_end, minlength=n1)).reshape(self.n_inst, -1)
        diff_q = (np.bincount(z * (self.tc + 1) + self.seg_start, weights=hseg, minlength=n1)
                  - np.bincount(z * (self.tc + 1) + self.seg_end, weights=hseg, minlength=n1)).reshape(self.n_inst, -1)
        self.col_cnt = np.cumsum(diff_c, axis=1)[:, : self.tc]
        pz = z[self.seg_partial] * (self.tc + 1)
        diff_p = (np.bincount(pz + self.seg_start[self.seg_partial], minlength=n1)
                  - np.bincount(pz + self.seg_end[self.seg_partial], minlength=n1)).reshape(self.n_inst, -1)
        self.col_part = np.cumsum(diff_p, axis=1)[:, : self.tc]
        self.row_ptr = np.searchsorted(self.seg_row, np.arange(nz + 1))
        self.col_rows = np.cumsum(diff_q, axis=1)[:, : self.tc]
        self.visited = int(lens.sum())
        self.inst_ptr = np.searchsorted(self.seg_row, np.arange(self.n_inst + 1) * self.tr)
        self._row_cache: dict = {}
        self._col_cache: dict = {}

    def instance(self, b: int, h: int) -> int:
        return (b if self.zb > 1 else 0) * self.zh + (h if self.zh > 1 else 0)

    def check_batch(self, B: int, H: int) -> None:
        if self.zb not in (1, B) or self.zh not in (1, H):
            raise ValueError(f"layout batch_shape {(self.zb, self.zh)} does not broadcast to (B, H) = {(B, H)}")

    def cols_of_rows(self, z: int, r0: int, r1: int) -> np.ndarray:
        """Columns with a non-empty block in layout rows ``r0..r1`` (inclusive) of instance z."""
        key = (z, r0, r1)
        hit = self._row_cache.get(key)
        if hit is None:
            lo = np.searchsorted(self.seg_row, z * self.tr + r0, side="left")
            hi = np.searchsorted(self.seg_row, z * self.tr + r1, side="right")
            cover = (np.bincount(self.seg_start[lo:hi], minlength=self.tc + 1)
                     - np.bincount(self.seg_end[lo:hi], minlength=self.tc + 1))
            hit = np.flatnonzero(np.cumsum(cover)[: self.tc] > 0)
            if len(self._row_cache) < 4096:
                self._row_cache[key] = hit
        return hit

    def cols_of_row_set(self, z: int, rows: np.ndarray) -> np.ndarray:
        """Columns with a non-empty block in any of ``rows`` (layout rows of instance z)."""
        g = z * self.tr + np.unique(rows)
        lo, hi = self.row_ptr[g], self.row_ptr[g + 1]
        n = hi - lo
        idx = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
        cover = (np.bincount(self.seg_start[idx], minlength=self.tc + 1)
                 - np.bincount(self.seg_end[idx], minlength=self.tc + 1))
        return np.flatnonzero(np.cumsum(cover)[: self.tc] > 0)

    def rows_of_col_set(self, z: int, cols: np.ndarray) -> np.ndarray:
        """Layout rows with a non-empty block in any of ``cols`` (instance z)."""
        mark = np.zeros(self.tc + 1, dtype=np.int64)
        mark[np.unique(cols) + 1] = 1
        pref = np.cumsum(mark)
        lo, hi = self.inst_ptr[z], self.inst_ptr[z + 1]
        sel = pref[self.seg_end[lo:hi]] - pref[self.seg_start[lo:hi]] > 0
        r = self.seg_row[lo:hi][sel] - z * self.tr
        return r[np.concatenate([[True], r[1:] != r[:-1]])] if len(r) else r

    def rows_of_cols(self, z: int, c0: int, c1: int) -> np.ndarray:
        """Layout rows with a non-empty block in columns ``c0..c1`` (inclusive) of instance z."""
        key = (z, c0, c1)
        hit = self._col_cache.get(key)
        if hit is None:
            lo, hi = self.inst_ptr[z], self.inst_ptr[z + 1]
            s, e = self.seg_start[lo:hi], self.seg_end[lo:hi]
            sel = (s <= c1) & (e > c0)
            r = self.seg_row[lo:hi][sel] - z * self.tr  # sorted
            hit = r[np.concatenate([[True], r[1:] != r[:-1]])] if len(r) else r
            if len(self._col_cache) < 4096:
                self._col_cache[key] = hit
        return hit


def _order(p: TrafficParams, geo: _Geometry, cnt: np.ndarray, part: np.ndarray, blk: np.ndarray):
    """Launch order of the tiles of one head under ``p.program_order`` (None: index order)."""
    return _perm(p.program_order, geo, cnt, part, blk)


def _perm(how: str, geo: _Geometry, cnt: np.ndarray, part: np.ndarray, blk: np.ndarray):
    """Launch order of the tiles of one head (None: index order): ``"grid"`` (index order),
    ``"heavy_first"`` (decreasing LUT cost: unmasked entries + 1.5 x masked + 1, the Triton work
    lists), ``"steps"`` (most entries first, ties in index order: the Gluon kernels' tables).
    Layouts with batch dims keep index order."""
    if how == "grid" or geo.n_inst != 1:
        return None
    if how == "steps":
        return np.argsort(-cnt[0][blk], kind="stable")
    cost = (cnt[0] - part[0])[blk] + 1.5 * part[0][blk] + 1.0
    return np.argsort(-cost, kind="stable")


def _tiles(n: int, tile: int, block: int):
    """Tiles of ``tile`` items over ``n``: their layout block index and valid length."""
    t = np.arange(-(-n // tile))
    return (t * tile) // block, np.minimum((t + 1) * tile, n) - t * tile


def _instances(geo: _Geometry, b: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Vectorised :meth:`_Geometry.instance`."""
    return (b if geo.zb > 1 else 0 * b) * geo.zh + (h if geo.zh > 1 else 0 * h)


class _DenseLayout:
    """The all-full layout, with just what the model reads (no LUT is built: dense FlashAttention
    at a million tokens would need 8192² entries)."""

    class _Nbytes:
        def __init__(self, n: int):
            self.nbytes = n

    def __init__(self, q_len: int, kv_len: int, bm: int, bn: int):
        from ...compiler.segments import FULL, Segments

        self.mask = "full"
        self.q_len, self.kv_len, self.block_size, self.batch_shape = q_len, kv_len, (bm, bn), ()
        tr, tc = -(-q_len // bm), -(-kv_len // bn)
        self.shape = (tr, tc)
        self.density = 1.0
        self._segs = Segments.uniform(tr, tc, FULL)
        self.row_lut = self._Nbytes(8 * (tr + 1) + 4 * tr * tc)  # full/part ptr + full idx, int32
        self.col_lut = self._Nbytes(8 * (tc + 1) + 4 * tr * tc)
