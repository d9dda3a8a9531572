"""User-defined masks: a block grid, an element mask (both stored as one bit per entry) and a
FlexAttention-style callable.

These index by the query *row* ``i`` (not its position), as FlexAttention's ``mask_mod`` does.
"""

from __future__ import annotations

import torch

from .base import TensorPrimitive, _unpack_bits, check_int, pack_bits, tensor_fingerprint
from .expr import EvalContext

__all__ = ["BlockMask", "DenseMask", "MaskMod"]


def _bool_grid(prim: str, t) -> torch.Tensor:
    """Validate a bool ``(R, C)`` / ``(B, H, R, C)`` tensor; returns a 4-D *view* (no copy)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{prim}(): expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in (2, 4):
        raise ValueError(f"{prim}(): expected shape (Lq, Lk) or (B, H, Lq, Lk), got {tuple(t.shape)}")
    if t.dtype != torch.bool:
        raise ValueError(f"{prim}(): expected a torch.bool tensor, got {t.dtype}")
    if min(t.shape) < 1:
        raise ValueError(f"{prim}(): empty mask of shape {tuple(t.shape)}")
    t = t.detach()
    return t if t.dim() == 4 else t.unsqueeze(0).unsqueeze(0)


class _BitGrid(TensorPrimitive):
    """A bool grid stored bit-packed: ``tensor`` is int32 ``(B, H, R, ceil(C / 32))``."""

    __slots__ = ("n_cols", "_dev")

    def _pack(self, t: torch.Tensor) -> None:
        g = _bool_grid(self.name, t)
        self.n_cols = int(g.shape[-1])
        self._dev = g.device
        self.tensor = pack_bits(g)  # never an int64 (or even a bool) copy of the whole grid

    @property
    def grid_shape(self) -> tuple:
        """``(B, H, R, C)`` of the user's grid."""
        return (*self.tensor.shape[:3], self.n_cols)

    def _tensor_key(self):
        if self._fp is None:
            self._fp = (*tensor_fingerprint(self.tensor), self.n_cols)
        return self._fp

    def _user_tensor(self):
        return self.to_bool()

    def to_bool(self) -> torch.Tensor:
        """The grid as a bool tensor ``(B, H, R, C)`` (materialises it)."""
        return _unpack_bits(self.tensor, self.n_cols)

    def _device(self):
        return self._dev

    def _own_batch_shape(self):
        s = tuple(self.tensor.shape[:2])
        return s if s != (1, 1) else ()

    def _bit(self, ctx: EvalContext, r, c):
        words = self.tensor.to(ctx.j.device)
        b, h = self._bh_index(ctx, words.shape[0], words.shape[1])
        w = words[b, h, r, torch.div(c, 32, rounding_mode="floor")]
        return ((w >> torch.remainder(c, 32)) & 1) != 0


class BlockMask(_BitGrid):
    """A user block grid: keeps ``t[i // bs, j // bs]``; t bool ``(Tr, Tc)`` or ``(B, H, Tr, Tc)``
    with ``Tr = ceil(q_len / bs)``, ``Tc = ceil(kv_len / bs)`` (rows index the query tensor).
    Stored as one bit per block."""

    __slots__ = ()
    name = "block_mask"
    PARAMS = (("block_size", 128, 1),)
    TENSOR = "block_mask"

    def __init__(self, t: torch.Tensor, block_size: int = 128):
        super().__init__(block_size=block_size)
        self._pack(t)

    def _check_lengths(self, q_len, kv_len):
        bs = self.block_size
        want = (-(-q_len // bs), -(-kv_len // bs))
        got = self.grid_shape[-2:]
        if tuple(got) != want:
            raise ValueError(f"block_mask(): grid has shape {tuple(got)}, expected "
                             f"(ceil(q_len/{bs}), ceil(kv_len/{bs})) = {want}")

    def _eval(self, ctx):
        bs = self.block_size
        return self._bit(ctx, torch.div(ctx.i, bs, rounding_mode="floor"), torch.div(ctx.j, bs, rounding_mode="floor"))


class DenseMask(_BitGrid):
    """Escape hatch: a user bool mask ``(Lq, Lk)`` or ``(B, H, Lq, Lk)``; keeps ``t[i, j]``.
    Stored as one bit per element (``Lq · Lk / 8`` bytes per (batch, head) it has)."""

    __slots__ = ()
    name = "dense_mask"
    TENSOR = "dense_mask"

    def __init__(self, t: torch.Tensor):
        super().__init__()
        self._pack(t)

    def _check_lengths(self, q_len, kv_len):
        got = self.grid_shape[-2:]
        if tuple(got) != (q_len, kv_len):
            raise ValueError(f"dense_mask(): mask has shape {tuple(got)}, expected (q_len, kv_len) = {(q_len, kv_len)}")

    def _eval(self, ctx):
        return self._bit(ctx, ctx.i, ctx.j)


class MaskMod(TensorPrimitive):
    """A FlexAttention-style callable ``fn(b, h, q_idx, kv_idx) -> bool tensor``.

    ``q_idx`` is the query *row* index and ``kv_idx`` the key index, as in FlexAttention (so
    ``align`` does not change what the callable sees); ``b``, ``h`` are batch and head indices. The
    callable is called on broadcastable int64 tensors (not under ``vmap``): write it with tensor
    operations (``q_idx >= kv_idx``, ``ids[q_idx] == ids[kv_idx]``, ``torch.where``), not Python
    ``if`` on the indices. ``B``/``H``: declare them when the callable depends on ``b``/``h``
    (otherwise it is called with 0 for both). ``device``: where the index tensors are built (that
    of tensors the callable captures).

    It is evaluated on the host only where needed: the compiler calls it block by block on the
    blocks the rest of the expression leaves undecided, and the kernels read one bit per element
    of the blocks that stay partial.
    """

    __slots__ = ("fn", "eval_device")
    name = "mask_mod"
    PARAMS = (("B", 0, 0), ("H", 0, 0))
    TENSOR = "mask_mod"

    def __init__(self, fn, B: int | None = None, H: int | None = None, device=None):
        super().__init__(B=check_int("mask_mod", "B", 0 if B is None else B, 0),
                         H=check_int("mask_mod", "H", 0 if H is None else H, 0))
        if not callable(fn):
            raise TypeError(f"mask_mod(): fn must be callable (b, h, q_idx, kv_idx) -> bool tensor, got "
                            f"{type(fn).__name__}")
        self.fn = fn
        self.tensor = None
        self.eval_device = torch.device("cpu" if device is None else device)

    def _tensor_key(self):
        return ("callable", id(self.fn))

    def _user_tensor(self):
        return self.fn

    def _device(self):
        return None

    def _own_batch_shape(self):
        b, h = max(1, self._params[0]), max(1, self._params[1])
        return (b, h) if (b, h) != (1, 1) else ()

    def _eval(self, ctx):
        dev = self.eval_device
        zero = torch.zeros((), dtype=torch.long, device=dev)
        b = ctx.b.to(dev) if (ctx.b is not None and self._params[0] > 1) else zero
        h = ctx.h.to(dev) if (ctx.h is not None and self._params[1] > 1) else zero
        out = self.fn(b, h, ctx.i.to(dev), ctx.j.to(dev))
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            got = f"a tensor of {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(f"mask_mod(): the callable must return a torch.bool tensor, got {got}")
        return out.to(ctx.j.device)
