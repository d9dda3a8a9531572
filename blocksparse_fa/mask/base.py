"""Leaves of the mask algebra: parameter handling and the primitive base classes.

A primitive's integer parameters are plain ints, or, where the primitive allows it
(``TENSOR_PARAMS``), int tensors of shape ``(B, H)`` with 1 where a value is shared: a different
window per head is ``window(per_head(torch.tensor([64, 128, 256, 512])))``. Such a mask has batch
dims; the compiler classifies each distinct parameter value once and the kernels read the value of
their (batch, head) at run time, so no ``(B, H, Tr, Tc)`` grid is built and no new value recompiles.
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

import numpy as np
import torch

from .expr import EvalContext, Mask, broadcast_batch_shapes, check_param_batch

__all__ = [
    "INT32_MAX", "BIG", "check_int", "tensor_fingerprint", "ParamTensor", "per_head", "per_batch", "Primitive",
    "IntervalPrimitive", "RowPrimitive", "TensorPrimitive", "pack_bits", "bit_at", "declared_shape",
    "check_param_batch",
]

INT32_MAX = 2**31 - 1
BIG = 2**40  # "unbounded" interval end, safely inside int64
_BIG = BIG


def check_int(prim: str, arg: str, value, minimum: int, maximum: int = INT32_MAX) -> int:
    """Validate an integer parameter; ``ValueError`` naming the primitive and the argument."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_floating_point \
            and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{prim}(): argument '{arg}' must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum or value > maximum:
        raise ValueError(f"{prim}(): argument '{arg}' must be an int in [{minimum}, {maximum}], got {value}")
    return value


def tensor_fingerprint(t: torch.Tensor) -> tuple:
    """Content hash of a (small or large) tensor, used for equality and layout caching."""
    data = t.detach().to("cpu").contiguous().numpy().reshape(-1)
    if data.dtype == np.bool_:
        data = data.view(np.uint8)
    # hashed in place (a bytes copy would double the memory of a large bit-packed mask)
    digest = hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest()
    return (str(t.dtype), tuple(t.shape), digest)


class ParamTensor:
    """A per-(batch, head) integer parameter: int64 CPU tensor ``(Bp, Hp)``, compared by content."""

    __slots__ = ("t", "fp")

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.fp = tensor_fingerprint(t)

    def __eq__(self, other):
        return isinstance(other, ParamTensor) and self.fp == other.fp

    def __hash__(self):
        return hash(self.fp)

    def __repr__(self):
        return f"ParamTensor(shape={tuple(self.t.shape)})"

    def value(self, b, h, device):
        """Values at batch/head index tensors (broadcastable), or at index 0 of size-1 dims."""
        t = self.t.to(device)
        zero = torch.zeros((), dtype=torch.long, device=device)
        bi = b.to(device) if (b is not None and t.shape[0] > 1) else zero
        hi = h.to(device) if (h is not None and t.shape[1] > 1) else zero
        return t[bi, hi]


def _int_values(fn: str, values) -> torch.Tensor:
    t = torch.as_tensor(values)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{fn}(): values must be integers (the parameters they feed are ints), got {t.dtype} "
                         f"values {t.reshape(-1)[:8].tolist()}")
    if t.dim() != 1:
        raise ValueError(f"{fn}(): expected a 1-D sequence of {'H' if fn == 'per_head' else 'B'} values, "
                         f"got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def per_head(values) -> torch.Tensor:
    """A per-head parameter: integer ``values`` ``(H,)`` as a ``(1, H)`` int64 tensor (e.g. a window
    per head). Non-integer values (floats, bools) raise ``ValueError``: nothing is rounded."""
    return _int_values("per_head", values).reshape(1, -1)


def per_batch(values) -> torch.Tensor:
    """A per-batch parameter: integer ``values`` ``(B,)`` as a ``(B, 1)`` int64 tensor (e.g. valid
    lengths). Non-integer values (floats, bools) raise ``ValueError``: nothing is rounded."""
    return _int_values("per_batch", values).reshape(-1, 1)


def declared_shape(value, checked) -> tuple | None:
    """The ``(Bp, Hp)`` shape of a tensor parameter that :func:`_check_param` turned into an int
    (equal values), else None: it still says how many batches and heads the mask was written for."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and not isinstance(checked, ParamTensor):
        return tuple(value.shape)
    return None


def _check_param(prim: str, arg: str, value, minimum: int, tensor_ok: bool):
    """An int, or (``tensor_ok``) a ParamTensor of shape ``(Bp, Hp)``; uniform tensors become ints
    (:func:`declared_shape` keeps their shape for the batch check)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if not tensor_ok:
            raise ValueError(f"{prim}(): argument '{arg}' must be an int (this primitive takes no per-head or "
                             f"per-batch values), got a tensor of shape {tuple(value.shape)}")
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{prim}(): argument '{arg}' must be an integer tensor, got {value.dtype}")
        if value.dim() != 2 or value.numel() == 0:
            raise ValueError(f"{prim}(): a tensor argument '{arg}' must have shape (B, H) with 1 where a value is "
                             f"shared: per_head(values) gives (1, H), per_batch(values) gives (B, 1); "
                             f"got shape {tuple(value.shape)}")
        t = value.detach().to("cpu", torch.int64).contiguous().clone()
        lo, hi = int(t.min()), int(t.max())
        if lo < minimum or hi > INT32_MAX:
            raise ValueError(f"{prim}(): argument '{arg}' must hold ints in [{minimum}, {INT32_MAX}], "
                             f"got values in [{lo}, {hi}]")
        if lo == hi:
            return lo
        return ParamTensor(t)
    return check_int(prim, arg, value, minimum)


def pack_bits(t: torch.Tensor, chunk_elems: int = 1 << 24) -> torch.Tensor:
    """bool ``(..., R, C)`` (any strides, any device) -> int32 ``(..., R, ceil(C / 32))`` on the CPU:
    bit ``c % 32`` of word ``c // 32``. Works on row chunks of views, so the temporaries stay small
    and an expanded (stride-0) input is never materialised."""
    *lead, r, c = t.shape
    w = -(-c // 32)
    out = np.zeros((*lead, r, w * 4), dtype=np.uint8)
    step = max(1, chunk_elems // max(1, c))
    cpu = t.device.type == "cpu"
    shifts = None if cpu else torch.arange(8, dtype=torch.uint8, device=t.device)
    nbytes = -(-c // 8)
    for idx in np.ndindex(*lead):
        src = t[idx]
        dst = out[idx]
        for r0 in range(0, r, step):
            x = src[r0:r0 + step]
            n = x.shape[0]
            if cpu:  # numpy packs bits straight from the (strided) view
                dst[r0:r0 + n, :nbytes] = np.packbits(x.numpy(), axis=-1, bitorder="little")
            else:  # on the GPU: bytes from 8 bits each, then to the host
                pad = nbytes * 8 - c
                xb = torch.nn.functional.pad(x.to(torch.uint8), (0, pad)) if pad else x.to(torch.uint8)
                dst[r0:r0 + n, :nbytes] = (xb.view(n, nbytes, 8) << shifts).sum(-1).to(torch.uint8).cpu().numpy()
    return torch.from_numpy(out.view(np.int32).reshape(*lead, r, w))


def bit_at(words: torch.Tensor, *index) -> torch.Tensor:
    """Bit ``index[-1]`` of the rows ``words[index[:-1]]`` (int32 words of :func:`pack_bits`)."""
    *lead, col = index
    w = words[(*lead, torch.div(col, 32, rounding_mode="floor"))]
    return ((w >> torch.remainder(col, 32)) & 1) != 0


def _unpack_bits(words: torch.Tensor, c: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: int32 ``(..., R, W)`` -> bool ``(..., R, c)``."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :c].bool()


class Primitive(Mask):
    """A leaf of the mask algebra.

    Subclasses declare ``name`` (the DSL name), ``PARAMS`` (ordered ``(name, default, minimum)``;
    default ``None`` means required), ``TENSOR_PARAMS`` (whether parameters may be ``(B, H)``
    tensors) and, for primitives that hold a tensor (or a callable), ``TENSOR`` (the keyword that
    supplies it in DSL text).

    ``KIND`` tells the compiler what the primitive depends on: ``"row"`` (only the query position),
    ``"col"`` (only the key position) or ``"general"``.
    """

    __slots__ = ("_params", "_fp", "_shapes")
    name: ClassVar[str] = ""
    PARAMS: ClassVar[tuple] = ()
    TENSOR: ClassVar[str | None] = None
    TENSOR_PARAMS: ClassVar[bool] = False
    KIND: ClassVar[str] = "general"

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
        params, shapes = [], []
        for pname, default, minimum in spec:
            if pname not in values:
                if default is None:
                    raise ValueError(f"{self.name}(): missing required argument '{pname}'")
                values[pname] = default
            params.append(_check_param(self.name, pname, values[pname], minimum, self.TENSOR_PARAMS))
            shapes.append(declared_shape(values[pname], params[-1]))
        self._params = tuple(params)
        self._shapes = tuple(shapes) if any(shapes) else None
        self._fp = None
        if type(self).__init__ is Primitive.__init__:  # complete now: its text (Mask.__str__) once
            str(self)

    # parameters by name
    def __getattr__(self, item):
        spec = type(self).PARAMS
        for k, (pname, _, _) in enumerate(spec):
            if pname == item:
                v = self._params[k]
                return v.t if isinstance(v, ParamTensor) else v
        raise AttributeError(item)

    @property
    def params(self) -> dict:
        return {p[0]: (v.t if isinstance(v, ParamTensor) else v) for p, v in zip(self.PARAMS, self._params)}

    @property
    def has_tensor_params(self) -> bool:
        """Whether a parameter differs between batches or heads."""
        return any(isinstance(v, ParamTensor) for v in self._params)

    def _own_batch_shape(self):
        shapes = [tuple(v.t.shape) for v in self._params if isinstance(v, ParamTensor)]
        if not shapes:
            return ()
        return broadcast_batch_shapes(shapes)

    def _pv(self, ctx: EvalContext) -> tuple:
        """Parameter values for an evaluation context: ints, or tensors broadcastable against it."""
        if not self.has_tensor_params:
            return self._params
        dev = ctx.j.device
        return tuple(v.value(ctx.b, ctx.h, dev) if isinstance(v, ParamTensor) else v for v in self._params)

    def at(self, b: int, h: int) -> "Primitive":
        """This primitive with every tensor parameter replaced by its value at ``(b, h)``."""
        if not self.has_tensor_params:
            return self
        vals = []
        for v in self._params:
            if isinstance(v, ParamTensor):
                t = v.t
                vals.append(int(t[b if t.shape[0] > 1 else 0, h if t.shape[1] > 1 else 0]))
            else:
                vals.append(v)
        new = self._with_params(tuple(vals))
        object.__setattr__(new, "_shapes", None)
        return new

    def _param_shapes(self) -> tuple:
        """Per parameter: the ``(Bp, Hp)`` shape it was given with (a tensor), else None."""
        shapes = getattr(self, "_shapes", None) or (None,) * len(self._params)
        return tuple(tuple(v.t.shape) if isinstance(v, ParamTensor) else sh for v, sh in zip(self._params, shapes))

    def _batch_params(self) -> list:
        if getattr(self, "_shapes", None) is None and not self.has_tensor_params:
            return []
        return [(self.name, pname, shape) for (pname, _, _), shape in zip(self.PARAMS, self._param_shapes())
                if shape is not None]

    def _with_params(self, params: tuple) -> "Primitive":
        new = object.__new__(type(self))
        for cls in type(self).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if slot in ("_cached_key", "_cached_hash", "_cached_text") or not hasattr(self, slot):
                    continue
                object.__setattr__(new, slot, getattr(self, slot))
        new._params = params
        return new

    def _tensor_key(self):
        return ()

    def _key(self):
        shapes = getattr(self, "_shapes", None)  # equal values given per head/batch: not a plain int
        return (self.name, self._params, self._tensor_key()) + ((shapes,) if shapes else ())

    def _tensor_items(self) -> list:
        shapes = getattr(self, "_shapes", None) or (None,) * len(self._params)
        items = []
        for p, v, sh in zip(self.PARAMS, self._params, shapes):
            if isinstance(v, ParamTensor):
                items.append((f"{self.name}_{p[0]}", ("param", v.fp), v.t))
            elif sh is not None:
                items.append((f"{self.name}_{p[0]}", ("uniform", v, sh), torch.full(sh, v, dtype=torch.int64)))
        return items

    def _fmt(self, v, names, shape=None) -> str:
        if isinstance(v, ParamTensor):
            return names[("param", v.fp)]
        if shape is not None:
            return names[("uniform", v, shape)]
        return str(v)

    def _text(self, names) -> str:
        parts, kw_only = [], False
        shapes = getattr(self, "_shapes", None) or (None,) * len(self._params)
        for (pname, default, _), v, sh in zip(self.PARAMS, self._params, shapes):
            if default is None and not kw_only:
                parts.append(self._fmt(v, names, sh))
            elif v != default or sh is not None:
                parts.append(f"{pname}={self._fmt(v, names, sh)}")
                kw_only = True
            else:
                kw_only = True
        return f"{self.name}({', '.join(parts)})" if parts else self.name


class IntervalPrimitive(Primitive):
    """A primitive that keeps ``lo(qp) <= j <= hi(qp)`` with ``lo``, ``hi`` non-decreasing in qp.

    ``_bounds(qp, p)`` works on numpy and torch int64 arrays alike (``p``: the parameter values,
    default the primitive's own ints); the compiler uses it for exact block classification,
    ``_eval`` for element semantics. Primitives whose bounds are ``lo = max(c, qp + a)`` and
    ``hi = min(c', qp + b)`` also give ``_affine() -> (c, a, c', b)`` (``None`` where absent), which
    lets the compiler skip the per-row pass.
    """

    _affine = None

    __slots__ = ()

    def _bounds(self, qp, p=None):
        raise NotImplementedError

    def _eval(self, ctx: EvalContext):
        lo, hi = self._bounds(ctx.qp, self._pv(ctx))
        return (ctx.j >= lo) & (ctx.j <= hi)


class RowPrimitive(Primitive):
    """A primitive that depends on the query position only: keeps every key of the rows where
    ``_rows(qp, p)`` holds. Inside ``&`` with interval primitives it filters their rows exactly."""

    __slots__ = ()
    KIND = "row"

    def _rows(self, qp, p=None):
        raise NotImplementedError

    def _eval(self, ctx: EvalContext):
        return self._rows(ctx.qp, self._pv(ctx))


class TensorPrimitive(Primitive):
    """A primitive that holds a tensor (``TENSOR`` names its constructor keyword): identity by the
    tensor's content hash, traced as one variable per tensor object under ``torch.compile``."""

    __slots__ = ("tensor",)

    def _tensor_key(self):
        if self._fp is None:
            self._fp = tensor_fingerprint(self.tensor)
        return self._fp

    def _ident(self):
        if torch.compiler.is_compiling():
            # traced: no data to hash; one variable per tensor object, matched with ``is`` (an
            # ``id()`` of a tensor made inside the compiled function does not trace on torch 2.11)
            return ("object", self.name, self.tensor)
        return (self.name, self._tensor_key())

    def _user_tensor(self):
        """The tensor to hand back to the constructor (``tensors()``, text round trip)."""
        return self.tensor

    def _tensor_items(self):
        return [(self.TENSOR, self._ident(), self._user_tensor())] + super()._tensor_items()

    def _text(self, names):
        base = super()._text(names)
        var = names[self._ident()]
        if var == self.TENSOR:
            return base
        if base == self.name:
            return f"{self.name}({var})"
        return f"{self.name}({var}, {base[len(self.name) + 1:]}"

    def _device(self):
        return self.tensor.device

    def _bh_index(self, ctx: EvalContext, nb: int, nh: int | None = None):
        """Index tensors into the tensor's own batch (and head) dims, broadcasting size-1 dims."""
        zero = torch.zeros((), dtype=torch.long, device=ctx.j.device)
        b = ctx.b.to(ctx.j.device) if (nb > 1 and ctx.b is not None) else zero
        if nh is None:
            return b
        h = ctx.h.to(ctx.j.device) if (nh > 1 and ctx.h is not None) else zero
        return b, h
