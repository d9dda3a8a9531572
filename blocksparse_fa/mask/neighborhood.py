"""Neighbourhoods on image and video token grids: NATTEN neighbourhood attention and sliding tile
attention (STA).

Tokens ``start .. start + prod(grid) - 1`` form a grid of shape ``grid`` (1, 2 or 3 dims), in
raster order (last dim fastest) or, with ``tile``, in tile order: tiles of shape ``tile`` one after
the other (tiles in raster order), the tokens of a tile in raster order. Positions outside the grid
are kept by neither primitive (combine with ``|`` for text tokens).

**NATTEN** (Hassani et al. 2023; dilation: Hassani & Shi 2022). Along each dim of extent ``G``, with
odd kernel ``K`` and dilation ``D``: coordinate ``x`` belongs to group ``g = x % D`` of
``n_g = ceil((G - g) / D)`` members; its window is the ``K`` consecutive group members starting at
``s = clamp(x // D - K // 2, 0, n_g - K)``, i.e. centred on ``x`` and shifted inwards at the
borders so that it always holds ``K`` members (NATTEN's border clamping). A key is kept when, in
every dim, it lies in the query's window (same group, ``s <= y // D < s + K``). Needs
``G >= K · D``.

**STA** (Zhang et al. 2025, "Fast Video Generation with Sliding Tile Attention"): the same clamped
window in *tile* units with dilation 1: a query's tile attends to the ``K`` tiles per dim around it
(clamped at the borders), all tokens of those tiles.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import INT32_MAX, Primitive, check_int

__all__ = ["Neighborhood", "SlidingTiles", "Geometry"]


def _tuple(prim: str, arg: str, value, ndim: int | None, minimum: int = 1) -> tuple:
    if isinstance(value, (list, tuple)):
        vals = tuple(check_int(prim, arg, v, minimum) for v in value)
    else:
        vals = (check_int(prim, arg, value, minimum),) * (ndim or 1)
    if ndim is not None and len(vals) != ndim:
        raise ValueError(f"{prim}(): argument '{arg}' must have {ndim} entries (one per grid dim), got {len(vals)}")
    if not 1 <= len(vals) <= 3:
        raise ValueError(f"{prim}(): argument '{arg}' must have 1 to 3 entries, got {len(vals)}")
    return vals


class Geometry:
    """Digit system of a grid primitive: positions ``x = p - start`` in ``[0, V)`` are mixed-radix
    numbers (``radices``, most significant first); digit ``k`` adds ``digit * mult[k]`` to the
    coordinate of dim ``dim[k]``. Each dim has extent ``G``, kernel ``K``, dilation ``D``."""

    def __init__(self, grid, kernel, dilation, tile, sta: bool):
        n = len(grid)
        self.ndim = n
        if tile:
            ntiles = tuple(g // t for g, t in zip(grid, tile))
            radices = list(ntiles) + list(tile)
            dims = list(range(n)) * 2
            mults = [1 if sta else t for t in tile] + [0 if sta else 1] * n
            self.G = ntiles if sta else tuple(grid)
        else:
            radices, dims, mults = list(grid), list(range(n)), [1] * n
            self.G = tuple(grid)
        keep = [k for k, r in enumerate(radices) if r > 1]  # radix-1 digits carry nothing
        if not keep:
            keep = [0]
        self.radices = np.array([radices[k] for k in keep], dtype=np.int64)
        self.dims = np.array([dims[k] for k in keep], dtype=np.int64)
        self.mults = np.array([mults[k] for k in keep], dtype=np.int64)
        self.weights = np.array([int(np.prod(self.radices[k + 1:])) for k in range(len(keep))], dtype=np.int64)
        self.V = int(np.prod(grid))
        self.K = tuple(kernel)
        self.D = tuple(dilation)

    # -- positions -> coordinates -------------------------------------------------------------------
    def coords(self, x):
        """Per-dim coordinates of in-grid offsets ``x`` (numpy or torch int64)."""
        out = [x * 0 for _ in range(self.ndim)]
        for r, d, m, w in zip(self.radices.tolist(), self.dims.tolist(), self.mults.tolist(), self.weights.tolist()):
            if m:
                out[d] = out[d] + ((x // w) % r) * m
        return out

    def position(self, coords) -> np.ndarray:
        """Smallest offset whose coordinates are ``coords`` (list of numpy arrays per dim); with
        ``mult 0`` digits (STA's within-tile digits) at 0."""
        x = 0
        rem = [np.asarray(c, dtype=np.int64).copy() for c in coords]
        # digits of a dim in order of decreasing multiplier: tile digit first, then within digit
        for r, d, m, w in zip(self.radices.tolist(), self.dims.tolist(), self.mults.tolist(), self.weights.tolist()):
            if m == 0:
                continue
            dig = rem[d] // m
            rem[d] = rem[d] - dig * m
            x = x + dig * w
        return x

    def last_position(self, coords) -> np.ndarray:
        """Largest offset whose coordinates are ``coords`` (mult-0 digits at their maximum)."""
        x = self.position(coords)
        for r, m, w in zip(self.radices.tolist(), self.mults.tolist(), self.weights.tolist()):
            if m == 0:
                x = x + (r - 1) * w
        return x

    # -- the 1-D rule -------------------------------------------------------------------------------
    @staticmethod
    def window_start(c, G: int, K: int, D: int):
        """``(group, start)`` of coordinate(s) ``c`` (numpy or torch)."""
        g = c % D
        t = c // D
        n = (G - g + D - 1) // D
        lo = t - K // 2
        lo = lo * (lo > 0)
        hi = n - K
        s = lo + (hi - lo) * (lo > hi)
        return g, s

    def keep(self, cq, ck):
        """Element rule on per-dim coordinates (numpy or torch, broadcastable)."""
        out = None
        for d in range(self.ndim):
            G, K, D = self.G[d], self.K[d], self.D[d]
            g, s = self.window_start(cq[d], G, K, D)
            u = ck[d] // D
            ok = (ck[d] % D == g) & (u >= s) & (u < s + K)
            out = ok if out is None else out & ok
        return out

    # -- boxes ---------------------------------------------------------------------------------------
    def boxes(self, lo: np.ndarray, hi: np.ndarray):
        """Split the offset ranges ``[lo[k], hi[k]]`` (inclusive, inside ``[0, V)``) into boxes of
        digits. Returns ``owner`` (range index), ``clo``/``chi`` ``(n_boxes, ndim)`` coordinate
        intervals (every box is a product of coordinate intervals), sorted by owner."""
        lo = np.asarray(lo, np.int64)
        hi = np.asarray(hi, np.int64)
        m = len(self.radices)
        R, W = self.radices, self.weights
        dl = (lo[:, None] // W[None, :]) % R[None, :]  # (n, m) digits
        dh = (hi[:, None] // W[None, :]) % R[None, :]
        diff = dl != dh
        L = np.where(diff.any(1), diff.argmax(1), m)  # first differing digit (m: lo == hi)
        owners, dlo_l, dhi_l = [], [], []
        n = len(lo)
        idx = np.arange(n)
        levels = np.arange(m)
        # a box: digits < i fixed to `pref`, digit i in [a, b], digits > i full
        def add(sel, i, pref, a, b):
            sel = sel & (a <= b)
            if not sel.any():
                return
            k = np.nonzero(sel)[0]
            lo_d = np.where(levels[None, :] < i, pref[k], 0)
            hi_d = np.where(levels[None, :] < i, pref[k], R[None, :] - 1)
            lo_d[:, i] = a[k] if np.ndim(a) else a
            hi_d[:, i] = b[k] if np.ndim(b) else b
            owners.append(idx[k])
            dlo_l.append(lo_d)
            dhi_l.append(hi_d)

        # aligned ends merge boxes: lo's digits at levels >= zl are all 0, hi's at levels >= zh all max
        def trailing(mask):
            rev = mask[:, ::-1]
            return np.where(rev.all(1), m, rev.argmin(1))

        zl = m - trailing(dl == 0)
        zh = m - trailing(dh == R[None, :] - 1)
        same = L == m
        if same.any():  # a single offset
            k = np.nonzero(same)[0]
            owners.append(k)
            dlo_l.append(dl[k])
            dhi_l.append(dl[k])
        ns = ~same
        for i in range(m):
            deep_l = i < zl - 1  # a digit on lo's path with a non-zero digit below it
            deep_h = i < zh - 1
            # left boxes: prefix of lo, digit i after lo's own (or from it when lo is aligned below)
            add(ns & (i > L) & (i < zl), i, dl, dl[:, i] + deep_l, np.full(n, R[i] - 1))
            # the middle box at level L
            add(ns & (i == L), i, dl, dl[:, i] + deep_l, dh[:, i] - deep_h)
            # right boxes: prefix of hi, digit i before hi's own (or up to it when hi is aligned)
            add(ns & (i > L) & (i < zh), i, dh, np.zeros(n, np.int64), dh[:, i] - deep_h)
        owner = np.concatenate(owners) if owners else np.zeros(0, np.int64)
        dlo = np.concatenate(dlo_l) if dlo_l else np.zeros((0, m), np.int64)
        dhi = np.concatenate(dhi_l) if dhi_l else np.zeros((0, m), np.int64)
        clo = np.zeros((len(owner), self.ndim), np.int64)
        chi = np.zeros((len(owner), self.ndim), np.int64)
        for k in range(m):
            d, mu = self.dims[k], self.mults[k]
            clo[:, d] += dlo[:, k] * mu
            chi[:, d] += dhi[:, k] * mu
        order = np.argsort(owner, kind="stable")
        return owner[order], clo[order], chi[order]


    def key_runs(self, lo_c: np.ndarray, hi_c: np.ndarray):
        """Offsets covered by coordinate boxes ``[lo_c, hi_c]`` ``(n, ndim)``, as runs of consecutive
        offsets: ``(owner, run_lo, run_hi)`` (inclusive). Each dim's interval becomes up to three
        pieces of digit ranges (first partial tile, whole tiles, last partial tile); every product
        of pieces is a digit box, whose offsets are runs along its most significant partial digit."""
        import itertools

        n, m = len(lo_c), len(self.radices)
        R, W = self.radices, self.weights
        per_dim = []
        for d in range(self.ndim):
            ks = [k for k in range(m) if self.dims[k] == d and self.mults[k] > 0]
            a, b = lo_c[:, d], hi_c[:, d]
            if len(ks) == 1:
                per_dim.append([({ks[0]: (a, b)}, np.ones(n, bool))])
                continue
            if not ks:  # a dim without digits (extent 1)
                per_dim.append([({}, np.ones(n, bool))])
                continue
            kT, kw = ks  # tile digit (mult = tile size), within digit (mult 1)
            t = int(self.mults[kT])
            aT, aw = np.divmod(a, t)
            bT, bw = np.divmod(b, t)
            one = aT == bT
            per_dim.append([
                ({kT: (aT, aT), kw: (aw, np.where(one, bw, t - 1))}, np.ones(n, bool)),
                ({kT: (aT + 1, bT - 1), kw: (np.zeros(n, np.int64), np.full(n, t - 1))}, aT + 1 <= bT - 1),
                ({kT: (bT, bT), kw: (np.zeros(n, np.int64), bw)}, ~one),
            ])
        owners, los, his = [], [], []
        for combo in itertools.product(*per_dim):
            valid = np.ones(n, bool)
            dlo = np.zeros((n, m), np.int64)
            dhi = np.broadcast_to(R - 1, (n, m)).copy()
            for ranges, ok in combo:
                valid &= ok
                for k, (x, y) in ranges.items():
                    dlo[:, k], dhi[:, k] = x, y
            idx = np.nonzero(valid)[0]
            if not len(idx):
                continue
            dlo, dhi = dlo[idx], dhi[idx]
            full = (dlo == 0) & (dhi == R[None, :] - 1)
            rev = full[:, ::-1]
            f = m - np.where(rev.all(1), m, rev.argmin(1))  # digits >= f are full
            js = np.maximum(f - 1, 0)  # the run digit
            cnt = np.where(np.arange(m)[None, :] < js[:, None], dhi - dlo + 1, 1)
            total = cnt.prod(1)
            own = np.repeat(np.arange(len(idx)), total)
            r = np.arange(int(total.sum())) - np.repeat(np.cumsum(total) - total, total)
            base = np.zeros(len(own), np.int64)
            for k in range(m - 1, -1, -1):  # decode the run index over the digits before js
                c = cnt[own, k]
                base += (dlo[own, k] + r % c) * W[k] * (k < js[own])
                r //= c
            j = js[own]
            los.append(base + dlo[own, j] * W[j])
            his.append(base + dhi[own, j] * W[j] + W[j] - 1)
            owners.append(idx[own])
        if not owners:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(owners), np.concatenate(los), np.concatenate(his)


class _GridPrimitive(Primitive):
    """Shared parameter handling: ``_params = (grid, kernel, dilation, tile, start)`` (tuples; tile
    ``()`` for raster order)."""

    __slots__ = ("_geo",)
    STA = False

    def _finish(self, grid, kernel, dilation, tile, start):
        prim = self.name
        grid = _tuple(prim, "grid", grid, None)
        n = len(grid)
        kernel = _tuple(prim, "kernel", kernel, n)
        dilation = _tuple(prim, "dilation", dilation, n)
        tile = () if tile is None or tile == () else _tuple(prim, "tile", tile, n)
        start = check_int(prim, "start", start, 0)
        if math.prod(grid) + start > INT32_MAX:
            raise ValueError(f"{prim}(): the grid {grid} at start {start} does not fit int32 positions")
        for d in range(n):
            if kernel[d] % 2 == 0:
                raise ValueError(f"{prim}(): kernel sizes must be odd (a window centred on the query), got {kernel}")
            if tile and grid[d] % tile[d]:
                raise ValueError(f"{prim}(): tile {tile} must divide the grid {grid} in every dim")
            extent = grid[d] // tile[d] if self.STA else grid[d]
            if kernel[d] * dilation[d] > extent:
                what = "number of tiles" if self.STA else "grid extent"
                raise ValueError(f"{prim}(): kernel {kernel[d]} x dilation {dilation[d]} exceeds the {what} "
                                 f"{extent} along dim {d}")
        self._params = (grid, kernel, dilation, tile, start)
        self._fp = None
        self._geo = None

    def _with_params(self, params):  # grid primitives take no tensor parameters
        return self

    @property
    def geometry(self) -> Geometry:
        if self._geo is None:
            grid, kernel, dilation, tile, _ = self._params
            self._geo = Geometry(grid, kernel, dilation, tile, self.STA)
        return self._geo

    @property
    def n_tokens(self) -> int:
        return math.prod(self._params[0])

    def _eval(self, ctx):
        geo = self.geometry
        start = self._params[4]
        xq, xk = ctx.qp - start, ctx.j - start
        inq = (xq >= 0) & (xq < geo.V)
        ink = (xk >= 0) & (xk < geo.V)
        cq = geo.coords(xq.clamp(0, geo.V - 1))
        ck = geo.coords(xk.clamp(0, geo.V - 1))
        return inq & ink & geo.keep(cq, ck)

    @staticmethod
    def _fmt_tuple(t) -> str:
        return "(" + ", ".join(str(v) for v in t) + ")"

    def _fmt_maybe_int(self, t) -> str:
        return str(t[0]) if len(set(t)) == 1 else self._fmt_tuple(t)


class Neighborhood(_GridPrimitive):
    """NATTEN neighbourhood attention on a token grid (module docstring).

    Args:
        grid: grid shape, 1 to 3 ints (e.g. ``(H, W)`` or ``(T, H, W)``).
        kernel: odd window size per dim (an int for all dims).
        dilation: dilation per dim (default 1).
        tile: tokens in tile order with tiles of this shape (default: raster order).
        start: position of the grid's first token (default 0).
    """

    __slots__ = ()
    name = "neighborhood"
    PARAMS = (("grid", None, 1), ("kernel", None, 1), ("dilation", 1, 1), ("tile", None, 1), ("start", 0, 0))

    def __init__(self, grid, kernel, dilation=1, tile=None, start=0):
        self._finish(grid, kernel, dilation, tile, start)

    def _text(self, names):
        grid, kernel, dilation, tile, start = self._params
        parts = [f"grid={self._fmt_tuple(grid)}", f"kernel={self._fmt_maybe_int(kernel)}"]
        if any(d != 1 for d in dilation):
            parts.append(f"dilation={self._fmt_maybe_int(dilation)}")
        if tile:
            parts.append(f"tile={self._fmt_tuple(tile)}")
        if start:
            parts.append(f"start={start}")
        return f"{self.name}({', '.join(parts)})"


class SlidingTiles(_GridPrimitive):
    """Sliding tile attention (STA) on a token grid in tile order (module docstring).

    Args:
        grid: grid shape, 1 to 3 ints; ``tile`` must divide it.
        tile: tile shape; tokens are in tile order.
        kernel: odd window size per dim, in tiles.
        start: position of the grid's first token (default 0).
    """

    __slots__ = ()
    name = "sliding_tiles"
    PARAMS = (("grid", None, 1), ("tile", None, 1), ("kernel", None, 1), ("start", 0, 0))
    STA = True

    def __init__(self, grid, tile, kernel, start=0):
        if tile is None:
            raise ValueError("sliding_tiles(): argument 'tile' is required")
        self._finish(grid, kernel, 1, tile, start)

    def __getattr__(self, item):
        names = {"grid": 0, "kernel": 1, "tile": 3, "start": 4}
        if item in names:
            return self._params[names[item]]
        raise AttributeError(item)

    @property
    def params(self) -> dict:
        grid, kernel, _, tile, start = self._params
        return {"grid": grid, "tile": tile, "kernel": kernel, "start": start}

    def _text(self, names):
        grid, kernel, _, tile, start = self._params
        parts = [f"grid={self._fmt_tuple(grid)}", f"tile={self._fmt_tuple(tile)}",
                 f"kernel={self._fmt_maybe_int(kernel)}"]
        if start:
            parts.append(f"start={start}")
        return f"{self.name}({', '.join(parts)})"
