"""Input checks shared by every backend: clear errors before any work is launched."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..compiler.layout import BlockLayout

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


def check_qkv(q, k, v) -> Shapes:
    """Validate q/k/v; raise ``TypeError``/``ValueError`` naming the argument and the expectation."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H, L, D), got {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, H, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
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


def check_layout(layout: BlockLayout, s: Shapes) -> None:
    if layout.q_len != s.Lq or layout.kv_len != s.Lk:
        raise ValueError(f"mask layout was compiled for (q_len, kv_len) = ({layout.q_len}, {layout.kv_len}), "
                         f"but q/k have lengths ({s.Lq}, {s.Lk})")
    if layout.batch_shape:
        bm, hm = layout.batch_shape
        if bm not in (1, s.B) or hm not in (1, s.H):
            raise ValueError(f"mask batch shape {layout.batch_shape} does not fit (B, H) = ({s.B}, {s.H})")


def check_scalars(scale, dropout_p) -> None:
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
