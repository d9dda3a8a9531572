"""Mask primitives: the leaves of a mask expression and their exact element semantics.

``qp`` is the query's absolute position (``i + q_offset``, see :mod:`blocksparse_fa.mask.expr`),
``j`` the key's, ``i`` the query row index.

| primitive                                     | keeps (qp, j) when                                         |
|-----------------------------------------------|------------------------------------------------------------|
| ``full()``                                    | always                                                     |
| ``causal()``                                  | ``j <= qp``                                                |
| ``window(w)``                                 | ``abs(qp - j) <= w``                                       |
| ``sliding_window(w)``                         | ``0 <= qp - j < w`` (w keys including itself)             |
| ``global_tokens(g)``                          | ``qp < g or j < g``                                        |
| ``strided(s)``                                | ``(qp - j) % s == 0``                                      |
| ``chunked(c)``                                | ``qp // c == j // c`` (floor division)                     |
| ``chunk_band(qc, kc, lo=0, hi=0)``            | ``lo <= j // kc - qp // qc <= hi``                         |
| ``prefix_lm(p)``                              | ``j <= qp or j < p``                                       |
| ``summary(stride, c)``                        | ``j % stride >= stride - c`` (last c keys of each stride)  |
| ``key_range(a, b)``                           | ``a <= j < b``                                             |
| ``query_range(a, b)``                         | ``a <= qp < b``                                            |
| ``key_set(t)``                                | ``j`` is one of the positions in ``t``                     |
| ``query_set(t)``                              | ``qp`` is one of the positions in ``t``                    |
| ``periodic_window(period, w)``                | ``abs(qp % period - j % period) <= w``                     |
| ``document(ids)``                             | ``ids[qp] == ids[j]`` (never for qp outside the ids)       |
| ``random_blocks(r, block_size=128, seed=0)``  | key block ``j // bs`` is one of the r chosen for ``qp // bs`` |
| ``neighborhood(grid, kernel, ...)``           | NATTEN neighbourhood on a token grid (``mask/neighborhood.py``) |
| ``sliding_tiles(grid, tile, kernel)``         | sliding tile attention (STA) on a token grid              |
| ``block_mask(t, block_size=128)``             | ``t[i // bs, j // bs]``                                    |
| ``dense_mask(t)``                             | ``t[i, j]``                                                |
| ``mask_mod(fn, B=None, H=None)``              | ``fn(b, h, i, j)`` (FlexAttention's convention)            |
| ``shift(m, d)`` (``mask/shift.py``)           | ``m`` keeps ``(qp + d, j)``                                |

Integer parameters of ``window``, ``sliding_window``, ``global_tokens``, ``strided``, ``chunked``,
``chunk_band``, ``prefix_lm``, ``key_range``, ``query_range`` and ``periodic_window`` may be
``(B, H)`` tensors (``per_head(...)``, ``per_batch(...)``): e.g. per-batch valid lengths
``key_range(0, per_batch(lens)) & query_range(0, per_batch(lens))``.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import (
    BIG, INT32_MAX, IntervalPrimitive, ParamTensor, Primitive, RowPrimitive, TensorPrimitive, check_int, pack_bits,
    per_batch, per_head, tensor_fingerprint,
)
from .custom import BlockMask, DenseMask, MaskMod
from .expr import Mask
from .neighborhood import Neighborhood, SlidingTiles

__all__ = [
    "Primitive", "IntervalPrimitive", "RowPrimitive", "Full", "Causal", "Window", "SlidingWindow", "GlobalTokens",
    "Strided", "Chunked", "ChunkBand", "PrefixLM", "Summary", "KeyRange", "QueryRange", "KeySet", "QuerySet",
    "PeriodicWindow", "Document", "RandomBlocks", "BlockMask", "DenseMask", "MaskMod", "Neighborhood",
    "SlidingTiles", "PRIMITIVES", "full", "causal", "window", "sliding_window", "global_tokens", "strided",
    "chunked", "chunk_band", "prefix_lm", "summary", "key_range", "query_range", "key_set", "query_set",
    "periodic_window", "document", "random_blocks", "block_mask", "dense_mask", "mask_mod", "neighborhood",
    "sliding_tiles", "per_head", "per_batch", "check_int", "tensor_fingerprint", "INT32_MAX",
]

_BIG = BIG


def _maximum(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a = a if isinstance(a, torch.Tensor) else torch.as_tensor(a)
        return torch.maximum(a, torch.as_tensor(b, device=a.device))
    return np.maximum(a, b)


class Full(IntervalPrimitive):
    """Keeps every pair (dense attention)."""

    __slots__ = ()
    name = "full"

    def _bounds(self, qp, p=None):
        return qp * 0 - _BIG, qp * 0 + _BIG

    def _affine(self):
        return None, None, None, None


class Causal(IntervalPrimitive):
    """Keeps ``j <= qp``."""

    __slots__ = ()
    name = "causal"

    def _bounds(self, qp, p=None):
        return qp * 0, qp

    def _affine(self):
        return 0, None, None, 0


class Window(IntervalPrimitive):
    """Symmetric local window: keeps ``|qp - j| <= w``."""

    __slots__ = ()
    name = "window"
    PARAMS = (("w", None, 0),)
    TENSOR_PARAMS = True

    def _bounds(self, qp, p=None):
        (w,) = self._params if p is None else p
        return qp - w, qp + w

    def _affine(self):
        (w,) = self._params
        return None, -w, None, w


class SlidingWindow(IntervalPrimitive):
    """Causal sliding window of ``w`` keys including the query's own: ``0 <= qp - j < w``."""

    __slots__ = ()
    name = "sliding_window"
    PARAMS = (("w", None, 1),)
    TENSOR_PARAMS = True

    def _bounds(self, qp, p=None):
        (w,) = self._params if p is None else p
        return qp - (w - 1), qp

    def _affine(self):
        (w,) = self._params
        return None, -(w - 1), None, 0


class Chunked(IntervalPrimitive):
    """Block-diagonal chunks of ``c`` positions: ``qp // c == j // c``."""

    __slots__ = ()
    name = "chunked"
    PARAMS = (("c", None, 1),)
    TENSOR_PARAMS = True

    def _bounds(self, qp, p=None):
        (c,) = self._params if p is None else p
        lo = (qp // c) * c
        return lo, lo + (c - 1)


class ChunkBand(IntervalPrimitive):
    """Chunk-level band: keeps ``lo <= j // k_chunk - qp // q_chunk <= hi``.

    ``chunk_band(c, c)`` is ``chunked(c)``; ``chunk_band(c, c, lo=-2**31 + 1)`` is block-causal
    attention over chunks of c; ``chunk_band(t, v)`` maps query chunks of t onto key chunks of v
    (text spans onto their image's visual tokens)."""

    __slots__ = ()
    name = "chunk_band"
    PARAMS = (("q_chunk", None, 1), ("k_chunk", None, 1), ("lo", 0, -INT32_MAX), ("hi", 0, -INT32_MAX))
    TENSOR_PARAMS = True

    def _bounds(self, qp, p=None):
        qc, kc, lo, hi = self._params if p is None else p
        base = qp // qc
        return (base + lo) * kc, (base + hi + 1) * kc - 1


class PrefixLM(IntervalPrimitive):
    """Bidirectional prefix of ``p`` keys, causal after it: ``j <= qp or j < p``."""

    __slots__ = ()
    name = "prefix_lm"
    PARAMS = (("p", None, 0),)
    TENSOR_PARAMS = True

    def _bounds(self, qp, p=None):
        (pp,) = self._params if p is None else p
        return qp * 0, _maximum(qp, pp - 1)


class KeyRange(IntervalPrimitive):
    """Keys in a range of positions: keeps ``start <= j < end`` (every query)."""

    __slots__ = ()
    name = "key_range"
    PARAMS = (("start", None, 0), ("end", None, 0))
    TENSOR_PARAMS = True
    KIND = "col"

    def _bounds(self, qp, p=None):
        a, b = self._params if p is None else p
        return qp * 0 + a, qp * 0 + (b - 1)

    def _affine(self):
        a, b = self._params
        return a, None, b - 1, None


class QueryRange(RowPrimitive):
    """Queries in a range of positions: keeps ``start <= qp < end`` (every key)."""

    __slots__ = ()
    name = "query_range"
    PARAMS = (("start", None, -INT32_MAX), ("end", None, -INT32_MAX))
    TENSOR_PARAMS = True

    def _rows(self, qp, p=None):
        a, b = self._params if p is None else p
        return (qp >= a) & (qp < b)

    def _row_range(self):
        return self._params


class GlobalTokens(Primitive):
    """The first ``g`` positions attend everywhere and are attended by all: ``qp < g or j < g``."""

    __slots__ = ()
    name = "global_tokens"
    PARAMS = (("g", None, 0),)
    TENSOR_PARAMS = True

    def _eval(self, ctx):
        (g,) = self._pv(ctx)
        return (ctx.qp < g) | (ctx.j < g)


class Strided(Primitive):
    """Keeps pairs whose distance is a multiple of ``s``: ``(qp - j) % s == 0``."""

    __slots__ = ()
    name = "strided"
    PARAMS = (("s", None, 1),)
    TENSOR_PARAMS = True

    def _eval(self, ctx):
        (s,) = self._pv(ctx)
        return torch.remainder(ctx.qp - ctx.j, s) == 0


class Summary(Primitive):
    """Summary keys of Sparse Transformer's fixed pattern: the last ``c`` of every ``stride`` keys."""

    __slots__ = ()
    name = "summary"
    PARAMS = (("stride", None, 1), ("c", 1, 0))
    KIND = "col"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self._params[1] > self._params[0]:
            raise ValueError(f"summary(): argument 'c' must be <= stride ({self._params[0]}), got {self._params[1]}")

    def _eval(self, ctx):
        stride, c = self._params
        return torch.remainder(ctx.j, stride) >= stride - c


class PeriodicWindow(Primitive):
    """A band on positions modulo a period: keeps ``|qp % period - j % period| <= w`` (floor
    modulo). With ``period`` = a frame's token count it relates the same place of every frame
    (``w`` around it); with ``period`` = a grid row's width, the same columns of every row."""

    __slots__ = ()
    name = "periodic_window"
    PARAMS = (("period", None, 1), ("w", None, 0))
    TENSOR_PARAMS = True

    def _eval(self, ctx):
        period, w = self._pv(ctx)
        return torch.abs(torch.remainder(ctx.qp, period) - torch.remainder(ctx.j, period)) <= w


# ------------------------------------------------------------------------------------------------
# primitives that hold a tensor (on base.TensorPrimitive; block, dense and mask_mod ones in custom.py)
# ------------------------------------------------------------------------------------------------
def _one_run_each(ids2d: torch.Tensor) -> bool:
    """Whether every id of every row of ``ids2d`` ``(B, L)`` (CPU) forms one contiguous run."""
    for row in ids2d:
        runs = 1 + int((row[1:] != row[:-1]).sum())
        if runs != int(torch.unique(row).numel()):
            return False
    return True


class Document(TensorPrimitive):
    """Document packing: keeps ``ids[qp] == ids[j]``; ids is an int tensor ``(L,)`` or ``(B, L)``
    with ``L == kv_len``. Query rows whose position lies outside ``[0, L)`` keep nothing."""

    __slots__ = ("_runs_cache", "_contiguous", "_device_cache", "_ids_on")
    name = "document"
    TENSOR = "document"

    def __init__(self, ids: torch.Tensor, contiguous: bool | None = None):
        super().__init__()
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"document(): ids must be a torch.Tensor, got {type(ids).__name__}")
        if contiguous is not None and not isinstance(contiguous, bool):
            raise TypeError(f"document(): contiguous must be True, False or None, got {contiguous!r}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"document(): ids must be an integer tensor, got {ids.dtype}")
        if ids.dim() not in (1, 2) or ids.shape[-1] < 1:
            raise ValueError(f"document(): ids must have shape (L,) or (B, L), got {tuple(ids.shape)}")
        # the int32 range is checked here for CPU ids (free); ids on a GPU are checked where the block
        # path reads them to the host (host_ids), never here: building the mask reads no device memory
        # (the device path compares ids of any range exactly)
        if ids.numel() and ids.device.type == "cpu" and not torch.compiler.is_compiling():
            _check_int32(ids)
        ids = ids.detach().clone()  # masks are immutable: later in-place edits of the caller's tensor don't leak in
        self.tensor = ids if ids.dim() == 2 else ids.unsqueeze(0)
        self._runs_cache = None
        self._device_cache = None  # the device path's intervals (compiler/device_intervals.py)
        self._ids_on = None  # the ids' copies on other devices (compiler/device_intervals.ids_on)
        readable = ids.device.type == "cpu" and not torch.compiler.is_compiling()
        runs = _one_run_each(self.tensor) if readable and contiguous is not False else None
        if contiguous and runs is False:
            raise ValueError("document(): contiguous=True, but some document's ids form more than one run")
        self._contiguous = bool(contiguous) if runs is None else runs

    @property
    def contiguous(self) -> bool:
        """Whether each document is known to be one contiguous run of ids: found when the ids are on
        the CPU (outside ``torch.compile``), promised with ``document(ids, contiguous=True)``, or
        set by :func:`~blocksparse_fa.mask.documents.document_from_cu_seqlens` and
        :func:`~blocksparse_fa.mask.documents.document_from_positions`, which build such ids. The
        device path then needs no id compare (and the Gluon forward applies on Hopper). False says
        nothing about the ids."""
        return getattr(self, "_contiguous", False)

    def host_ids(self) -> np.ndarray:
        """The ids on the host: int64 numpy ``(B, L)``, checked to fit int32 (the block path's
        tables hold them as int32)."""
        ids = self.tensor.detach().to("cpu")
        _check_int32(ids)
        return ids.long().numpy()

    def runs(self):
        """``(start, end)`` int64 ``(B, L)``: position x's document is the run ``[start, end)`` —
        when every document (of every batch row) is one contiguous run; else None. Cached."""
        if self._runs_cache is None:
            ids = self.host_ids()
            bsz, n = ids.shape
            change = np.ones((bsz, n), dtype=bool)
            change[:, 1:] = ids[:, 1:] != ids[:, :-1]
            one_run = all(len(np.unique(row[ch])) == int(ch.sum()) for row, ch in zip(ids, change))
            if not one_run:
                self._runs_cache = (None,)
            else:
                pos = np.broadcast_to(np.arange(n), (bsz, n))
                start = np.maximum.accumulate(np.where(change, pos, 0), axis=1)
                last = np.ones((bsz, n), dtype=bool)
                last[:, :-1] = change[:, 1:]
                end = np.ascontiguousarray(np.minimum.accumulate(np.where(last, pos + 1, n)[:, ::-1], axis=1)[:, ::-1])
                self._runs_cache = (start, end)
        return None if self._runs_cache[0] is None else self._runs_cache

    def at(self, b: int, h: int) -> "Document":
        """The ids of batch row ``b``."""
        if self.tensor.shape[0] == 1:
            return self
        return Document(self.tensor[b], contiguous=True if self._contiguous else None)

    def _bounds(self, qp, p=None):
        """Run-structured ids as an interval per row (numpy; the compiler's form): ``[start, end)``
        of the query's document, empty outside ``[0, L)``."""
        start, end = self.runs()
        n = start.shape[1]
        ok = (qp >= 0) & (qp < n)
        qc = np.clip(qp, 0, n - 1)
        return np.where(ok, start[0, qc], BIG), np.where(ok, end[0, qc] - 1, -BIG)

    @property
    def ids(self) -> torch.Tensor:
        """``(B, L)`` document ids (``B`` is 1 for shared ids)."""
        return self.tensor

    def _own_batch_shape(self):
        return (self.tensor.shape[0], 1) if self.tensor.shape[0] > 1 else ()

    def _check_lengths(self, q_len, kv_len):
        if self.tensor.shape[-1] != kv_len:
            raise ValueError(f"document(): ids have length {self.tensor.shape[-1]}, expected kv_len = {kv_len}")

    def _eval(self, ctx):
        ids = self.tensor.to(ctx.j.device).long()
        b = self._bh_index(ctx, ids.shape[0])
        L = ids.shape[1]
        qp = ctx.qp.clamp(0, L - 1)
        return (ids[b, qp] == ids[b, ctx.j]) & (ctx.qp >= 0) & (ctx.qp < L)


def _check_int32(ids: torch.Tensor) -> None:
    if ids.numel() and (int(ids.min()) < -INT32_MAX or int(ids.max()) > INT32_MAX):
        raise ValueError("document(): ids must fit in int32")


def _tracing(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values would break a trace: ``torch.compile`` tracing, or a CUDA
    graph capturing on the current stream (a read is a device-to-host copy, not allowed there)."""
    if torch.compiler.is_compiling():
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class _PositionSet(TensorPrimitive):
    """A set of positions: int tensor ``(n,)`` or ``(B, n)`` (one set per batch row); negative
    entries are padding and ignored, duplicates and order do not matter."""

    __slots__ = ("_bits",)

    def __init__(self, positions: torch.Tensor):
        super().__init__()
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"{self.name}(): positions must be a torch.Tensor, got {type(positions).__name__}")
        if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
            raise ValueError(f"{self.name}(): positions must be an integer tensor, got {positions.dtype}")
        if positions.dim() not in (1, 2):
            raise ValueError(f"{self.name}(): positions must have shape (n,) or (B, n), got {tuple(positions.shape)}")
        p = positions.detach().to("cpu", torch.int64).reshape(-1, positions.shape[-1]) if positions.numel() else \
            torch.zeros(1 if positions.dim() == 1 else positions.shape[0], 0, dtype=torch.int64)
        if p.numel() and int(p.max()) > INT32_MAX - 1:
            raise ValueError(f"{self.name}(): positions must be < {INT32_MAX}")
        rows = [torch.unique(r[r >= 0]) for r in p]  # sorted, distinct
        n = max([len(r) for r in rows] + [0])
        canon = torch.full((len(rows), n), -1, dtype=torch.int64)
        for k, r in enumerate(rows):
            canon[k, :len(r)] = r
        self.tensor = canon
        self._bits = None

    def positions(self, b: int = 0) -> np.ndarray:
        """Sorted distinct positions of batch row ``b`` (numpy int64)."""
        r = self.tensor[b if self.tensor.shape[0] > 1 else 0].numpy()
        return r[r >= 0]

    def bits(self) -> torch.Tensor:
        """int32 bitset words ``(B, W)``: bit ``x % 32`` of word ``x // 32`` set for position x."""
        if self._bits is None:
            n_bits = int(self.tensor.max()) + 1 if self.tensor.numel() else 0
            w = max(1, -(-n_bits // 32))
            grid = torch.zeros(self.tensor.shape[0], w * 32, dtype=torch.bool)
            rows, cols = torch.nonzero(self.tensor >= 0, as_tuple=True)
            grid[rows, self.tensor[rows, cols]] = True
            self._bits = pack_bits(grid)
        return self._bits

    def _own_batch_shape(self):
        return (self.tensor.shape[0], 1) if self.tensor.shape[0] > 1 else ()

    def at(self, b: int, h: int):
        """The set of batch row ``b``."""
        if self.tensor.shape[0] == 1:
            return self
        return type(self)(self.tensor[b:b + 1])

    def _member(self, x, ctx):
        words = self.bits().to(x.device)
        b = self._bh_index(ctx, words.shape[0])
        n = words.shape[1] * 32
        xc = x.clamp(0, n - 1)
        w = words[b, torch.div(xc, 32, rounding_mode="floor")]
        return (((w >> torch.remainder(xc, 32)) & 1) != 0) & (x >= 0) & (x < n)


class KeySet(_PositionSet):
    """Keys at a set of positions (globals anywhere, as keys): keeps ``j in positions``."""

    __slots__ = ()
    name = "key_set"
    TENSOR = "key_set"
    KIND = "col"

    def _eval(self, ctx):
        return self._member(ctx.j, ctx)


class QuerySet(_PositionSet):
    """Queries at a set of positions (globals anywhere, as queries): keeps ``qp in positions``."""

    __slots__ = ()
    name = "query_set"
    TENSOR = "query_set"
    KIND = "row"

    def _rows(self, qp, p=None):
        """Membership of positions ``qp`` (numpy) in the (single) set: the compiler's row filter."""
        return np.isin(qp, self.positions(0))

    def _eval(self, ctx):
        return self._member(ctx.qp, ctx)


class RandomBlocks(Primitive):
    """BigBird's random attention: ``r`` distinct key blocks (of ``block_size`` keys) chosen for
    each query block (of ``block_size`` absolute positions), deterministic in ``seed``."""

    __slots__ = ()
    name = "random_blocks"
    PARAMS = (("r", None, 0), ("block_size", 128, 1), ("seed", 0, 0))

    def chosen(self, qblocks: np.ndarray, n_kblocks: int) -> np.ndarray:
        """``(len(qblocks), min(r, n_kblocks))`` int64 key-block indices chosen for those query blocks."""
        return random_block_choice(self.seed, np.asarray(qblocks, dtype=np.int64), n_kblocks, self.r)

    def _eval(self, ctx):
        bs = self.block_size
        n_kb = -(-ctx.kv_len // bs)
        qb = torch.div(ctx.qp, bs, rounding_mode="floor").clamp(0, n_kb - 1)
        uq = torch.unique(qb).cpu().numpy()
        grid = np.zeros((len(uq), n_kb), dtype=bool)
        if self.r and len(uq):
            ch = self.chosen(uq, n_kb)
            np.put_along_axis(grid, ch, True, axis=1)
        row = torch.from_numpy(np.searchsorted(uq, qb.cpu().numpy())).to(ctx.j.device)
        g = torch.from_numpy(grid).to(ctx.j.device)
        kb = torch.div(ctx.j, bs, rounding_mode="floor")
        return g[row, kb] & (ctx.qp >= 0) & (ctx.qp < n_kb * bs)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def random_block_choice(seed: int, qblocks: np.ndarray, n_cols: int, r: int) -> np.ndarray:
    """Deterministic choice of ``min(r, n_cols)`` distinct columns per row, keyed on (seed, row).

    O(len(qblocks) · r) in the common case: hashed candidates, first r distinct kept; rows that
    need it (r close to n_cols) fall back to ranking all columns by hash.
    """
    qb = np.asarray(qblocks, dtype=np.uint64)
    n = len(qb)
    r = min(r, n_cols)
    if r == 0 or n == 0:
        return np.zeros((n, r), dtype=np.int64)
    with np.errstate(over="ignore"):
        base = _mix64(np.uint64(seed) * np.uint64(0xD1B54A32D192ED03) + qb)
    if r == n_cols:
        return np.broadcast_to(np.arange(n_cols, dtype=np.int64), (n, r)).copy()
    out = np.empty((n, r), dtype=np.int64)
    need_full = np.ones(n, dtype=bool)
    if 2 * r <= n_cols:
        t = 2 * r + 16
        with np.errstate(over="ignore"):
            cand = (_mix64(base[:, None] + np.arange(1, t + 1, dtype=np.uint64)[None, :]) % np.uint64(n_cols)).astype(np.int64)
        order = np.argsort(cand, axis=1, kind="stable")
        sv = np.take_along_axis(cand, order, axis=1)
        dup_sorted = np.zeros_like(sv, dtype=bool)
        dup_sorted[:, 1:] = sv[:, 1:] == sv[:, :-1]
        dup = np.empty_like(dup_sorted)
        np.put_along_axis(dup, order, dup_sorted, axis=1)
        keep = ~dup
        rank = np.cumsum(keep, axis=1)
        ok = rank[:, -1] >= r
        sel = keep & (rank <= r)
        rows_ok = np.nonzero(ok)[0]
        if len(rows_ok):
            vals = cand[rows_ok][sel[rows_ok]].reshape(len(rows_ok), r)
            out[rows_ok] = vals
        need_full = ~ok
    idx = np.nonzero(need_full)[0]
    if len(idx):
        with np.errstate(over="ignore"):
            scores = _mix64(base[idx][:, None] ^ (np.arange(n_cols, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15)))
        out[idx] = np.argsort(scores, axis=1, kind="stable")[:, :r]
    return out


PRIMITIVES: dict[str, type[Primitive]] = {
    cls.name: cls
    for cls in (Full, Causal, Window, SlidingWindow, GlobalTokens, Strided, Chunked, ChunkBand, PrefixLM, Summary,
                KeyRange, QueryRange, KeySet, QuerySet, PeriodicWindow, Document, RandomBlocks, Neighborhood,
                SlidingTiles, BlockMask, DenseMask, MaskMod)
}


# ------------------------------------------------------------------------------------------------
# constructors (the public spelling)
# ------------------------------------------------------------------------------------------------
def full() -> Mask:
    """Dense attention: every pair kept."""
    return Full()


def causal() -> Mask:
    """Causal attention: ``j <= qp``."""
    return Causal()


def window(w) -> Mask:
    """Symmetric local window ``|qp - j| <= w`` (w >= 0; an int or a ``(B, H)`` tensor)."""
    return Window(w)


def sliding_window(w) -> Mask:
    """Causal sliding window of w keys including the query's own (w >= 1): ``0 <= qp - j < w``.
    A FlexAttention-style "look back w" window ``0 <= qp - j <= w`` is ``sliding_window(w + 1)``."""
    return SlidingWindow(w)


def global_tokens(g) -> Mask:
    """The first g positions attend to and are attended by every position."""
    return GlobalTokens(g)


def strided(s) -> Mask:
    """Keep pairs whose distance is a multiple of s (s >= 1)."""
    return Strided(s)


def chunked(c) -> Mask:
    """Block-diagonal attention within chunks of c positions (c >= 1)."""
    return Chunked(c)


def chunk_band(q_chunk, k_chunk, lo=0, hi=0) -> Mask:
    """Keep ``lo <= j // k_chunk - qp // q_chunk <= hi`` (chunk-level bands; see :class:`ChunkBand`)."""
    return ChunkBand(q_chunk, k_chunk, lo=lo, hi=hi)


def prefix_lm(p) -> Mask:
    """Bidirectional over the first p keys, causal elsewhere."""
    return PrefixLM(p)


def summary(stride: int, c: int = 1) -> Mask:
    """The last c keys of every stride-long span (Sparse Transformer 'fixed' summary columns)."""
    return Summary(stride, c)


def key_range(start, end) -> Mask:
    """Keys ``start <= j < end`` for every query (an image span, a shared prefix, valid keys)."""
    return KeyRange(start, end)


def query_range(start, end) -> Mask:
    """Queries ``start <= qp < end``, every key (rectangles: ``query_range(..) & key_range(..)``)."""
    return QueryRange(start, end)


def key_set(positions: torch.Tensor) -> Mask:
    """Keys at the given positions (``(n,)`` or per batch ``(B, n)``; negative entries ignored)."""
    return KeySet(positions)


def query_set(positions: torch.Tensor) -> Mask:
    """Queries at the given positions (``(n,)`` or per batch ``(B, n)``; negative entries ignored).
    Global tokens anywhere: ``key_set(t) | query_set(t)``."""
    return QuerySet(positions)


def periodic_window(period, w) -> Mask:
    """Band on positions modulo ``period``: ``|qp % period - j % period| <= w``."""
    return PeriodicWindow(period, w)


def document(ids: torch.Tensor, contiguous: bool | None = None) -> Mask:
    """Packed documents: keep pairs in the same document; ids ``(L,)`` or ``(B, L)``, L = kv_len.

    ``contiguous=True`` promises that every document is one contiguous run of tokens (the usual
    packing, as in FlashAttention's varlen form): the kernels then compare positions, not ids
    (faster; ids on the CPU are checked, ids on a GPU are trusted). None: found from ids on the CPU,
    else not assumed; False: never assumed.

    Calls with the same ids tensor, unmodified since (its version counter), and the same
    ``contiguous`` return the same mask object, so that layers which each build
    ``causal() & document(ids)`` from one step's ids share its intervals, kernel tables and device
    copies (kept on the document) as if they had been passed one mask. Not while tracing
    (``torch.compile``, whose graph shares them itself) or for inference tensors."""
    kept = _kept_documents(ids)
    key = None if kept is None else (ids._version, contiguous)
    doc = None if kept is None else kept.get(key)
    if doc is None:
        doc = Document(ids, contiguous)
        if kept is not None:
            if len(kept) >= 2:  # the ids' latest versions only
                kept.pop(next(iter(kept)))
            kept[key] = doc
    return doc


def _kept_documents(ids) -> dict | None:
    """The documents kept on ``ids`` (a dict in the tensor's ``__dict__``: the tensor owns them,
    they do not reference it), or None where none are kept."""
    if not isinstance(ids, torch.Tensor) or torch.compiler.is_compiling() or ids.is_inference():
        return None
    return ids.__dict__.setdefault("_bsfa_documents", {})


def random_blocks(r: int, block_size: int = 128, seed: int = 0) -> Mask:
    """r distinct random key blocks per query block, deterministic in seed (BigBird)."""
    return RandomBlocks(r, block_size=block_size, seed=seed)


def block_mask(t: torch.Tensor, block_size: int = 128) -> Mask:
    """A user bool block grid ``(Tr, Tc)`` or ``(B, H, Tr, Tc)`` at block_size (one bit per block)."""
    return BlockMask(t, block_size=block_size)


def dense_mask(t: torch.Tensor) -> Mask:
    """A user bool element mask ``(Lq, Lk)`` or ``(B, H, Lq, Lk)``, stored as one bit per element."""
    return DenseMask(t)


def mask_mod(fn, B: int | None = None, H: int | None = None) -> Mask:
    """A FlexAttention-style callable ``fn(b, h, q_idx, kv_idx) -> bool tensor`` (see :class:`MaskMod`)."""
    return MaskMod(fn, B=B, H=H)


def neighborhood(grid, kernel, dilation=1, tile=None, start: int = 0) -> Mask:
    """NATTEN neighbourhood attention on a 1-D/2-D/3-D token grid (see :class:`Neighborhood`)."""
    return Neighborhood(grid, kernel, dilation=dilation, tile=tile, start=start)


def sliding_tiles(grid, tile, kernel, start: int = 0) -> Mask:
    """Sliding tile attention (STA) on a token grid in tile order (see :class:`SlidingTiles`)."""
    return SlidingTiles(grid, tile, kernel, start=start)
