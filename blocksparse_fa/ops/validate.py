"""Input checks shared by every backend: clear errors before any work is launched.

Also the argument forms PyTorch users bring: inputs with any number of leading batch dims
(:func:`flatten_batch`), real scalars of any kind for ``scale``/``dropout_p`` (:func:`check_scalars`)
and boolean masks in SDPA's broadcasting convention (:func:`bool_mask_to_mask`).
"""

from __future__ import annotations

import functools
import math
import numbers
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ..compiler.layout import BlockLayout
from ..mask.base import check_param_batch
from ..mask.expr import Mask

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Shapes:
    """Problem shape: q ``(B, H, Lq, D)``, k/v ``(B, Hkv, Lk, D)``; ``G = H // Hkv``."""

    B: int
    H: int
    Hkv: int
    Lq: int
    Lk: int
    D: int

    @property
    def G(self) -> int:
        return self.H // self.Hkv


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32, float64")


def like_sdpa_under_autocast(fn):
    """Entry-point decorator for ``fn(q, k, v, ...)``: inside an autocast region enabled for the
    inputs' device type, q, k and v are cast as autocast casts the inputs of PyTorch's SDPA
    (floating tensors other than float64 go to the region's dtype; a differentiable cast, so
    gradients return in the inputs' dtypes), and the call runs with autocast off: the kernels and
    the PyTorch backend keep their own accumulation precision. Outside such a region, ``fn``
    as is."""

    @functools.wraps(fn)
    def call(q, k, v, *args, **kwargs):
        dev = q.device.type if isinstance(q, torch.Tensor) else None
        if dev is None or dev == "meta" or not torch.is_autocast_enabled(dev):
            return fn(q, k, v, *args, **kwargs)
        dt = torch.get_autocast_dtype(dev)
        q, k, v = (t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point()
                   and t.dtype not in (dt, torch.float64) else t for t in (q, k, v))
        with torch.autocast(dev, enabled=False):
            return fn(q, k, v, *args, **kwargs)

    return call


def without_autocast(device: torch.device):
    """A context with autocast off for ``device``'s type (the backward of our autograd functions:
    on CPU it runs on the caller's thread, possibly inside an autocast region)."""
    return torch.autocast(device.type, enabled=False)


def check_qkv(q, k, v, dv_ok: bool = False) -> Shapes:
    """Validate 4-D q/k/v; raise ``TypeError``/``ValueError`` naming the argument and the expectation.

    ``dv_ok``: v may have its own head dim ``Dv`` (the entry points zero-pad the smaller of v and
    q/k, :func:`blocksparse_fa.ops.dispatch.pad_head_dims`); ``Shapes.D`` is q's and k's."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H, L, D), got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, H, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
            raise ValueError(f"v must have the shape of k {tuple(k.shape)} (its head dim may differ), got "
                             f"{tuple(v.shape)}")
        if not dv_ok:
            raise ValueError(f"v has head dim Dv={v.shape[-1]} but q/k have D={Dk}: this low-level entry point "
                             f"takes one head dim (blocksparse_fa.attention, attention_op, the nn modules and "
                             f"context_parallel_attention accept Dv != D)")
        if not 1 <= v.shape[-1] <= MAX_HEAD_DIM:
            raise ValueError(f"v's head dim Dv={v.shape[-1]} is not supported (1 <= Dv <= {MAX_HEAD_DIM})")
    if Bk != B:
        raise ValueError(f"k/v batch size {Bk} does not match q batch size {B}")
    if Dk != D:
        raise ValueError(f"k/v head dim {Dk} does not match q head dim {D}")
    if min(B, H, Hkv) < 1 or Lq < 1 or Lk < 1:
        raise ValueError(f"empty dimension: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if H % Hkv != 0:
        raise ValueError(f"GQA: the number of query heads H={H} must be a multiple of the k/v heads Hkv={Hkv}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} is not supported (1 <= D <= {MAX_HEAD_DIM})")
    return Shapes(B, H, Hkv, Lq, Lk, D)


def flatten_batch(q, k, v):
    """``(q4, k4, v4, lead)``: q ``(*lead, H, Lq, D)`` and k/v ``(*lead, Hkv, Lk, D)`` as 4-D tensors
    ``(B, H, L, D)`` with ``B = prod(lead)`` (``lead = ()`` for 3-D ``(H, L, D)`` inputs). 4-D inputs
    are returned as they are; the caller reshapes the output back with :func:`unflatten_batch`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
        if t.dim() < 3:
            raise ValueError(f"{name} must have shape (..., H, L, D) (at least 3 dims), got {tuple(t.shape)}")
    if q.dim() == 4 and k.dim() == 4 and v.dim() == 4:
        return q, k, v, None
    lead = tuple(q.shape[:-3])
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape[:-3]) != lead:
            raise ValueError(f"{name} must have the leading (batch) dims of q {lead}, got shape {tuple(t.shape)} "
                             f"(q: {tuple(q.shape)}); the SDPA-compatible entry point "
                             f"blocksparse_fa.scaled_dot_product_attention broadcasts them")
    return tuple(t.reshape(-1, *t.shape[-3:]) for t in (q, k, v)) + (lead,)


def unflatten_batch(t, lead):
    """Inverse of :func:`flatten_batch` for an output ``(B, H, L, ...)``."""
    return t if lead is None else t.reshape(*lead, *t.shape[1:])


def check_layout(layout: BlockLayout, s: Shapes) -> None:
    if layout.q_len != s.Lq or layout.kv_len != s.Lk:
        raise ValueError(f"mask layout was compiled for (q_len, kv_len) = ({layout.q_len}, {layout.kv_len}), "
                         f"but q/k have lengths ({s.Lq}, {s.Lk})")
    decl = layout.cache.get("batch_params")
    if decl is None:  # per-batch/per-head parameters, named (also those of equal values)
        mask = getattr(layout, "mask", None)
        decl = layout.cache["batch_params"] = mask.batch_params() if isinstance(mask, Mask) else ()
    for prim, arg, shape in decl:
        check_param_batch(prim, arg, shape, s.B, s.H)
    if layout.batch_shape:
        bm, hm = layout.batch_shape
        if bm not in (1, s.B) or hm not in (1, s.H):
            raise ValueError(f"mask batch shape {layout.batch_shape} does not fit (B, H) = ({s.B}, {s.H})")


def _real(name: str, value) -> float:
    """``value`` as a float: Python and numpy real scalars, 0-d real CPU tensors."""
    if type(value) in (float, int):  # the common case, also the one torch.compile traces
        return float(value)
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.device.type not in ("cpu", "meta") or value.dtype == torch.bool \
                or value.dtype.is_complex:
            raise ValueError(f"{name} must be a real number (a Python or numpy scalar, or a 0-d real CPU tensor), "
                             f"got a tensor of shape {tuple(value.shape)}, dtype {value.dtype} on {value.device}")
        if value.device.type == "meta":
            raise ValueError(f"{name} must be a real number, got a meta tensor (it has no value)")
        return float(value.item())
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_scale(scale):
    """``None`` or the scale as a positive finite float (any real scalar is accepted)."""
    if scale is None:
        return None
    s = _real("scale", scale)
    if not 0.0 < s < math.inf:
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    return s


def check_dropout(dropout_p) -> float:
    """The dropout probability as a float in ``[0, 1)``."""
    p = _real("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    return p


def check_scalars(scale, dropout_p):
    """``(scale or None, dropout_p)`` as floats, validated."""
    return check_scale(scale), check_dropout(dropout_p)


# ------------------------------------------------------------------------------------------------
# tensor masks in SDPA's convention
# ------------------------------------------------------------------------------------------------
class _OneEntry:
    """Remembers the mask built from the last tensor (by identity, version and target shape), so a
    model that passes the same mask tensor to every layer builds (and hashes) it once."""

    def __init__(self):
        self.ref = None
        self.key = None
        self.value = None

    def get(self, t, key):
        if self.ref is not None and self.ref() is t and self.key == key:
            return self.value
        return None

    def put(self, t, key, value):
        self.ref, self.key, self.value = weakref.ref(t), key, value


_LAST_TENSOR_MASK = _OneEntry()


def keep_from_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """The boolean keep-mask of an SDPA ``attn_mask``: bool is used as it is (True = attend); a float
    mask is accepted when it only *masks* (every entry 0 or ``-inf``), and refused when it holds
    additive biases."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a bool torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.bool:
        return t
    if t.dtype.is_floating_point:
        if t.device.type != "meta" and not bool(((t == 0) | torch.isneginf(t)).all()):
            raise NotImplementedError(
                f"{name}: a float mask holding additive biases (values other than 0 and -inf) is not supported: "
                f"block-sparse attention applies masks here, not additive biases. Biases are fused score "
                f"modifiers: blocksparse_fa.attention(..., score_mod=bsfa.bias(tensor)) (also bsfa.alibi(slopes), "
                f"bsfa.softcap(cap)). Pass a bool mask (True = attend)")
        return t == 0
    raise TypeError(f"{name} must be a bool tensor (True = attend) or a float 0/-inf mask, got {t.dtype}")


def bool_mask_to_mask(t: torch.Tensor, lead: tuple, H: int, Lq: int, Lk: int, name: str = "attn_mask",
                      device=None):
    """A ``dense_mask`` from a boolean mask (``True`` = attend) broadcastable, as in SDPA, to
    ``(*lead, H, Lq, Lk)``; its batch dims are flattened like the inputs' (:func:`flatten_batch`).
    Size-1 batch and head dims stay size 1 (the mask broadcasts, nothing is copied per head).
    For meta inputs (``device``) only the shape is checked and ``full()`` returned."""
    from ..mask.primitives import dense_mask, full

    full_shape = (*lead, H, Lq, Lk)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a bool torch.Tensor, got {type(t).__name__}")
    meta_inputs = device is not None and torch.device(device).type == "meta"
    if t.device.type == "meta" or meta_inputs:
        if not meta_inputs:
            raise ValueError(f"{name} is a meta tensor (it holds no values) but the inputs are on {device}")
        if t.dtype != torch.bool and not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a bool tensor (True = attend) or a float 0/-inf mask, got {t.dtype}")
        try:
            torch.broadcast_shapes(tuple(t.shape), full_shape)
        except RuntimeError:
            raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to (..., H, Lq, Lk) = "
                             f"{full_shape}") from None
        return full()
    key = (full_shape, str(t.dtype), t._version if not t.is_inference() else None)
    hit = _LAST_TENSOR_MASK.get(t, key) if key[2] is not None else None
    if hit is not None:
        return hit
    keep = keep_from_tensor(name, t)
    try:
        torch.broadcast_shapes(tuple(keep.shape), full_shape)
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(keep.shape)} does not broadcast to (..., H, Lq, Lk) = "
                         f"{full_shape}") from None
    if keep.dim() > len(full_shape):
        raise ValueError(f"{name} has more dims than the inputs: {tuple(keep.shape)} vs {full_shape}")
    keep = keep.reshape((1,) * (len(full_shape) - keep.dim()) + tuple(keep.shape))
    nb = len(lead)
    batch_one = all(s == 1 for s in keep.shape[:nb])
    h = keep.shape[nb]
    keep = keep.expand(*(keep.shape[:nb] if batch_one else lead), h, Lq, Lk)
    keep = keep.reshape(1 if batch_one else -1, h, Lq, Lk)
    if keep.shape[0] == 1 and h == 1:
        keep = keep[0, 0]
    m = dense_mask(keep)
    if key[2] is not None:
        _LAST_TENSOR_MASK.put(t, key, m)
    return m


def check_differentiable_backward(backend: str) -> None:
    """Refuse a backward that records a graph (``create_graph=True``, for second derivatives) on
    the Triton kernels: their gradients come out of kernels autograd cannot see through, so the
    second derivative would silently miss attention's part. The PyTorch backend's backward is
    made of differentiable operations and supports it."""
    if backend == "triton" and torch.is_grad_enabled():
        raise RuntimeError("attention: a backward with create_graph=True (second derivatives) is not supported by "
                           "the Triton kernels; call with backend='torch' (exact, differentiable twice)")


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The logsumexp's dtype: float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32
