"""Mask primitives: the leaves of a mask expression and their exact element semantics.

| primitive                                   | keeps (qp, j) when                                       |
|---------------------------------------------|----------------------------------------------------------|
| ``full()``                                  | always                                                   |
| ``causal()``                                | ``j <= qp``                                              |
| ``window(w)``                               | ``abs(qp - j) <= w``                                     |
| ``sliding_window(w)``                       | ``0 <= qp - j < w`` (w keys including itself)           |
| ``global_tokens(g)``                        | ``qp < g or j < g``                                      |
| ``strided(s)``                              | ``(qp - j) % s == 0``                                    |
| ``chunked(c)``                              | ``qp // c == j // c`` (floor division)                   |
| ``prefix_lm(p)``                            | ``j <= qp or j < p``                                     |
| ``summary(stride, c)``                      | ``j % stride >= stride - c`` (last c keys of each stride)|
| ``document(ids)``                           | ``ids[qp] == ids[j]`` (never for qp < 0)                 |
| ``random_blocks(r, block_size=128, seed=0)``| key block ``j // bs`` is one of the r chosen for ``qp // bs`` |
| ``block_mask(t, block_size=128)``           | ``t[i // bs, j // bs]``                                   |
| ``dense_mask(t)``                           | ``t[i, j]``                                              |
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

import numpy as np
import torch

from .expr import EvalContext, Mask

__all__ = [
    "Primitive", "IntervalPrimitive", "Full", "Causal", "Window", "SlidingWindow", "GlobalTokens",
    "Strided", "Chunked", "PrefixLM", "Summary", "Document", "RandomBlocks", "BlockMask", "DenseMask",
    "PRIMITIVES", "full", "causal", "window", "sliding_window", "global_tokens", "strided",
    "chunked", "prefix_lm", "summary", "document", "random_blocks", "block_mask", "dense_mask",
]

INT32_MAX = 2**31 - 1
_BIG = 2**40  # "unbounded" interval end, safely inside int64


def check_int(prim: str, arg: str, value, minimum: int) -> int:
    """Validate an integer parameter; ``ValueError`` naming the primitive and the argument."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{prim}(): argument '{arg}' must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum or value > INT32_MAX:
        raise ValueError(f"{prim}(): argument '{arg}' must be an int in [{minimum}, {INT32_MAX}], got {value}")
    return value


def tensor_fingerprint(t: torch.Tensor) -> tuple:
    """Content hash of a (small or large) tensor, used for equality and layout caching."""
    data = t.detach().to("cpu").contiguous()
    if data.dtype == torch.bool:
        data = data.to(torch.uint8)
    digest = hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()
    return (str(t.dtype), tuple(t.shape), digest)


class Primitive(Mask):
    """A leaf of the mask algebra.

    Subclasses declare ``name`` (the DSL name), ``PARAMS`` (ordered ``(name, default, minimum)``;
    default ``None`` means required) and, for tensor-backed primitives, ``TENSOR`` (the keyword that
    supplies the tensor in DSL text).
    """

    __slots__ = ("_params", "_fp")
    name: ClassVar[str] = ""
    PARAMS: ClassVar[tuple] = ()
    TENSOR: ClassVar[str | None] = None

    def __init__(self, *args, **kwargs):
        spec = self.PARAMS
        if len(args) > len(spec):
            raise ValueError(f"{self.name}() takes at most {len(spec)} positional argument(s), got {len(args)}")
        values = {}
        for (pname, _, _), a in zip(spec, args):
            values[pname] = a
        for k, a in kwargs.items():
            if k not in {p[0] for p in spec}:
                known = ", ".join(p[0] for p in spec) or "none"
                raise ValueError(f"{self.name}(): unknown argument '{k}' (arguments: {known})")
            if k in values:
                raise ValueError(f"{self.name}(): argument '{k}' given twice")
            values[k] = a
        params = []
        for pname, default, minimum in spec:
            if pname not in values:
                if default is None:
                    raise ValueError(f"{self.name}(): missing required argument '{pname}'")
                values[pname] = default
            params.append(check_int(self.name, pname, values[pname], minimum))
        self._params = tuple(params)
        self._fp = None

    # parameters by name
    def __getattr__(self, item):
        spec = type(self).PARAMS
        for k, (pname, _, _) in enumerate(spec):
            if pname == item:
                return self._params[k]
        raise AttributeError(item)

    @property
    def params(self) -> dict:
        return {p[0]: v for p, v in zip(self.PARAMS, self._params)}

    def _tensor_key(self):
        return ()

    def _key(self):
        return (self.name, self._params, self._tensor_key())

    def _text(self) -> str:
        parts, kw_only = [], False
        for (pname, default, _), v in zip(self.PARAMS, self._params):
            if default is None and not kw_only:
                parts.append(str(v))
            elif v != default:
                parts.append(f"{pname}={v}")
                kw_only = True
            else:
                kw_only = True
        return f"{self.name}({', '.join(parts)})" if parts else self.name


class IntervalPrimitive(Primitive):
    """A primitive that keeps ``lo(qp) <= j <= hi(qp)`` with ``lo``, ``hi`` non-decreasing in qp.

    ``_bounds`` works on numpy and torch int64 arrays alike; the compiler uses it for exact
    block classification, ``_eval`` for element semantics.
    """

    __slots__ = ()

    def _bounds(self, qp):
        raise NotImplementedError

    def _eval(self, ctx: EvalContext):
        lo, hi = self._bounds(ctx.qp)
        return (ctx.j >= lo) & (ctx.j <= hi)


class Full(IntervalPrimitive):
    """Keeps every pair (dense attention)."""

    __slots__ = ()
    name = "full"

    def _bounds(self, qp):
        return qp * 0 - _BIG, qp * 0 + _BIG


class Causal(IntervalPrimitive):
    """Keeps ``j <= qp``."""

    __slots__ = ()
    name = "causal"

    def _bounds(self, qp):
        return qp * 0, qp


class Window(IntervalPrimitive):
    """Symmetric local window: keeps ``|qp - j| <= w``."""

    __slots__ = ()
    name = "window"
    PARAMS = (("w", None, 0),)

    def _bounds(self, qp):
        w = self._params[0]
        return qp - w, qp + w


class SlidingWindow(IntervalPrimitive):
    """Causal sliding window of ``w`` keys including the query's own: ``0 <= qp - j < w``."""

    __slots__ = ()
    name = "sliding_window"
    PARAMS = (("w", None, 1),)

    def _bounds(self, qp):
        return qp - (self._params[0] - 1), qp


class Chunked(IntervalPrimitive):
    """Block-diagonal chunks of ``c`` positions: ``qp // c == j // c``."""

    __slots__ = ()
    name = "chunked"
    PARAMS = (("c", None, 1),)

    def _bounds(self, qp):
        c = self._params[0]
        lo = (qp // c) * c
        return lo, lo + (c - 1)


class PrefixLM(IntervalPrimitive):
    """Bidirectional prefix of ``p`` keys, causal after it: ``j <= qp or j < p``."""

    __slots__ = ()
    name = "prefix_lm"
    PARAMS = (("p", None, 0),)

    def _bounds(self, qp):
        return qp * 0, qp.clip(min=self._params[0] - 1)


class GlobalTokens(Primitive):
    """The first ``g`` positions attend everywhere and are attended by all: ``qp < g or j < g``."""

    __slots__ = ()
    name = "global_tokens"
    PARAMS = (("g", None, 0),)

    def _eval(self, ctx):
        g = self._params[0]
        return (ctx.qp < g) | (ctx.j < g)


class Strided(Primitive):
    """Keeps pairs whose distance is a multiple of ``s``: ``(qp - j) % s == 0``."""

    __slots__ = ()
    name = "strided"
    PARAMS = (("s", None, 1),)

    def _eval(self, ctx):
        return torch.remainder(ctx.qp - ctx.j, self._params[0]) == 0


class Summary(Primitive):
    """Summary keys of Sparse Transformer's fixed pattern: the last ``c`` of every ``stride`` keys."""

    __slots__ = ()
    name = "summary"
    PARAMS = (("stride", None, 1), ("c", 1, 0))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self._params[1] > self._params[0]:
            raise ValueError(f"summary(): argument 'c' must be <= stride ({self._params[0]}), got {self._params[1]}")

    def _eval(self, ctx):
        stride, c = self._params
        return torch.remainder(ctx.j, stride) >= stride - c


# ------------------------------------------------------------------------------------------------
# tensor-backed primitives
# ------------------------------------------------------------------------------------------------
class _TensorPrimitive(Primitive):
    __slots__ = ("tensor",)

    def _tensor_key(self):
        if self._fp is None:
            self._fp = tensor_fingerprint(self.tensor)
        return self._fp

    def _device(self):
        return self.tensor.device

    def _bh_index(self, ctx: EvalContext, nb: int, nh: int | None = None):
        """Index tensors into the tensor's own batch (and head) dims, broadcasting size-1 dims."""
        zero = torch.zeros((), dtype=torch.long, device=self.tensor.device)
        b = ctx.b if (nb > 1 and ctx.b is not None) else zero
        if nh is None:
            return b
        h = ctx.h if (nh > 1 and ctx.h is not None) else zero
        return b, h


class Document(_TensorPrimitive):
    """Document packing: keeps ``ids[qp] == ids[j]``; ids is an int tensor ``(L,)`` or ``(B, L)``
    with ``L == kv_len``. Query rows with ``qp < 0`` (``q_len > kv_len``) keep nothing."""

    __slots__ = ()
    name = "document"
    TENSOR = "document"

    def __init__(self, ids: torch.Tensor):
        super().__init__()
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"document(): ids must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"document(): ids must be an integer tensor, got {ids.dtype}")
        if ids.dim() not in (1, 2) or ids.shape[-1] < 1:
            raise ValueError(f"document(): ids must have shape (L,) or (B, L), got {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < -INT32_MAX or int(ids.max()) > INT32_MAX):
            raise ValueError("document(): ids must fit in int32")
        ids = ids.detach().clone()  # masks are immutable: later in-place edits of the caller's tensor don't leak in
        self.tensor = ids if ids.dim() == 2 else ids.unsqueeze(0)

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
        b = self._bh_index(ctx, ids.shape[0]).to(ctx.j.device)
        L = ids.shape[1]
        qp = ctx.qp.clamp(0, L - 1)
        return (ids[b, qp] == ids[b, ctx.j]) & (ctx.qp >= 0)


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
        qb = torch.div(ctx.qp, bs, rounding_mode="floor")
        uq = torch.unique(qb.clamp(min=0)).cpu().numpy()
        grid = np.zeros((len(uq), n_kb), dtype=bool)
        if self.r and len(uq):
            ch = self.chosen(uq, n_kb)
            np.put_along_axis(grid, ch, True, axis=1)
        row = torch.from_numpy(np.searchsorted(uq, qb.clamp(min=0).cpu().numpy())).to(ctx.j.device)
        g = torch.from_numpy(grid).to(ctx.j.device)
        kb = torch.div(ctx.j, bs, rounding_mode="floor")
        return g[row, kb] & (ctx.qp >= 0)


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


class BlockMask(_TensorPrimitive):
    """A user block grid: keeps ``t[i // bs, j // bs]``; t bool ``(Tr, Tc)`` or ``(B, H, Tr, Tc)``
    with ``Tr = ceil(q_len / bs)``, ``Tc = ceil(kv_len / bs)`` (rows index the query tensor)."""

    __slots__ = ()
    name = "block_mask"
    PARAMS = (("block_size", 128, 1),)
    TENSOR = "block_mask"

    def __init__(self, t: torch.Tensor, block_size: int = 128):
        super().__init__(block_size=block_size)
        self.tensor = _bool_grid("block_mask", t)

    def _own_batch_shape(self):
        s = tuple(self.tensor.shape[:2])
        return s if s != (1, 1) else ()

    def _check_lengths(self, q_len, kv_len):
        bs = self.block_size
        want = (-(-q_len // bs), -(-kv_len // bs))
        if tuple(self.tensor.shape[-2:]) != want:
            raise ValueError(f"block_mask(): grid has shape {tuple(self.tensor.shape[-2:])}, expected "
                             f"(ceil(q_len/{bs}), ceil(kv_len/{bs})) = {want}")

    def _eval(self, ctx):
        t = self.tensor.to(ctx.j.device)
        b, h = self._bh_index(ctx, t.shape[0], t.shape[1])
        bs = self.block_size
        return t[b, h, torch.div(ctx.i, bs, rounding_mode="floor"), torch.div(ctx.j, bs, rounding_mode="floor")]


class DenseMask(_TensorPrimitive):
    """Escape hatch: a user bool mask ``(Lq, Lk)`` or ``(B, H, Lq, Lk)``; keeps ``t[i, j]``."""

    __slots__ = ()
    name = "dense_mask"
    TENSOR = "dense_mask"

    def __init__(self, t: torch.Tensor):
        super().__init__()
        self.tensor = _bool_grid("dense_mask", t)

    def _own_batch_shape(self):
        s = tuple(self.tensor.shape[:2])
        return s if s != (1, 1) else ()

    def _check_lengths(self, q_len, kv_len):
        if tuple(self.tensor.shape[-2:]) != (q_len, kv_len):
            raise ValueError(f"dense_mask(): mask has shape {tuple(self.tensor.shape[-2:])}, "
                             f"expected (q_len, kv_len) = {(q_len, kv_len)}")

    def _eval(self, ctx):
        t = self.tensor.to(ctx.j.device)
        b, h = self._bh_index(ctx, t.shape[0], t.shape[1])
        return t[b, h, ctx.i, ctx.j]


def _bool_grid(prim: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{prim}(): expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in (2, 4):
        raise ValueError(f"{prim}(): expected shape (Lq, Lk) or (B, H, Lq, Lk), got {tuple(t.shape)}")
    if t.dtype != torch.bool:
        raise ValueError(f"{prim}(): expected a torch.bool tensor, got {t.dtype}")
    t = t.detach().clone()  # masks are immutable: later in-place edits of the caller's tensor don't leak in
    return t if t.dim() == 4 else t.view(1, 1, *t.shape)


PRIMITIVES: dict[str, type[Primitive]] = {
    cls.name: cls
    for cls in (Full, Causal, Window, SlidingWindow, GlobalTokens, Strided, Chunked, PrefixLM, Summary,
                Document, RandomBlocks, BlockMask, DenseMask)
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


def window(w: int) -> Mask:
    """Symmetric local window ``|qp - j| <= w`` (w >= 0)."""
    return Window(w)


def sliding_window(w: int) -> Mask:
    """Causal sliding window of w keys including the query's own (w >= 1)."""
    return SlidingWindow(w)


def global_tokens(g: int) -> Mask:
    """The first g positions attend to and are attended by every position."""
    return GlobalTokens(g)


def strided(s: int) -> Mask:
    """Keep pairs whose distance is a multiple of s (s >= 1)."""
    return Strided(s)


def chunked(c: int) -> Mask:
    """Block-diagonal attention within chunks of c positions (c >= 1)."""
    return Chunked(c)


def prefix_lm(p: int) -> Mask:
    """Bidirectional over the first p keys, causal elsewhere."""
    return PrefixLM(p)


def summary(stride: int, c: int = 1) -> Mask:
    """The last c keys of every stride-long span (Sparse Transformer 'fixed' summary columns)."""
    return Summary(stride, c)


def document(ids: torch.Tensor) -> Mask:
    """Packed documents: keep pairs in the same document; ids ``(L,)`` or ``(B, L)``, L = kv_len."""
    return Document(ids)


def random_blocks(r: int, block_size: int = 128, seed: int = 0) -> Mask:
    """r distinct random key blocks per query block, deterministic in seed (BigBird)."""
    return RandomBlocks(r, block_size=block_size, seed=seed)


def block_mask(t: torch.Tensor, block_size: int = 128) -> Mask:
    """A user bool block grid ``(Tr, Tc)`` or ``(B, H, Tr, Tc)`` at block_size."""
    return BlockMask(t, block_size=block_size)


def dense_mask(t: torch.Tensor) -> Mask:
    """A user bool element mask ``(Lq, Lk)`` or ``(B, H, Lq, Lk)`` (escape hatch: O(Lq·Lk) memory)."""
    return DenseMask(t)
