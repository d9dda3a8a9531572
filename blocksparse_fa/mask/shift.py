"""``shift``: move the query positions an expression sees, by a number or per batch/head.

``shift(m, d)`` keeps ``(qp, j)`` when ``m`` keeps ``(qp + d, j)``. With ``d`` per sequence this
places each sequence's queries where they really are: batched decode over a cache padded to
``kv_len`` puts sequence b's last query at ``kv_len - 1`` (bottom-right), while it sits at
``lens[b] - 1``; ``shift(causal() & sliding_window(w), per_batch(lens - kv_len))`` measures its
window from there (combine with ``key_range(0, per_batch(lens))`` for the valid keys). Only
positions move: primitives indexed by the query row (``block_mask``, ``dense_mask``,
``mask_mod``) are unchanged.
"""

from __future__ import annotations

import torch

from .base import ParamTensor, _check_param, declared_shape
from .expr import EvalContext, Mask, _as_mask, _check_depth, broadcast_batch_shapes

__all__ = ["Shift", "shift"]


class Shift(Mask):
    """Its operand with every query position moved by ``offset`` (an int or a ``(B, H)`` tensor)."""

    __slots__ = ("_child", "_offset", "_depth", "_shape")
    _PREC = 3

    def __init__(self, child: Mask, offset):
        self._child = _as_mask(child, "shift")
        self._offset = _check_param("shift", "offset", offset, -2**31 + 1, True)
        self._shape = declared_shape(offset, self._offset)  # equal values given per batch/head
        self._depth = _check_depth((self._child,))

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def children(self):
        return (self._child,)

    @property
    def offset(self):
        """The offset: an int, or a ``(B, H)`` int64 tensor."""
        return self._offset.t if isinstance(self._offset, ParamTensor) else self._offset

    def offset_at(self, b: int, h: int) -> int:
        d = self._offset
        if not isinstance(d, ParamTensor):
            return d
        return int(d.t[b if d.t.shape[0] > 1 else 0, h if d.t.shape[1] > 1 else 0])

    def _own_batch_shape(self):
        return broadcast_batch_shapes([tuple(self._offset.t.shape)]) if isinstance(self._offset, ParamTensor) else ()

    def _key(self):
        return ("Shift", self._offset, self._child._ckey()) + ((self._shape,) if self._shape else ())

    def _batch_params(self) -> list:
        d = self._offset
        shape = tuple(d.t.shape) if isinstance(d, ParamTensor) else self._shape
        return [] if shape is None else [("shift", "offset", shape)]

    def _tensor_items(self):
        d = self._offset
        if self._shape is not None:
            return [("shift_offset", ("uniform", d, self._shape), torch.full(self._shape, d, dtype=torch.int64))]
        return [("shift_offset", ("param", d.fp), d.t)] if isinstance(d, ParamTensor) else []

    def _text(self, names) -> str:
        d = self._offset
        dt = names[("param", d.fp)] if isinstance(d, ParamTensor) else (
            names[("uniform", d, self._shape)] if self._shape is not None else str(d))
        return f"shift({self._child._text(names)}, {dt})"

    def _eval(self, ctx: EvalContext):
        d = self._offset
        if isinstance(d, ParamTensor):
            d = d.value(ctx.b, ctx.h, ctx.j.device)
        inner = EvalContext(ctx.q_len, ctx.kv_len, ctx.i, ctx.qp + d, ctx.j, ctx.b, ctx.h)
        return self._child._eval(inner)


def shift(mask: Mask, offset) -> Mask:
    """Keep ``(qp, j)`` when ``mask`` keeps ``(qp + offset, j)``; ``offset`` an int or a ``(B, H)``
    tensor (``per_batch(...)``: per-sequence decode positions)."""
    return Shift(mask, offset)
