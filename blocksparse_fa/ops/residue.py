"""Strided-mask rewrite on the Triton backend without copies: residue classes as heads.

For ``q`` ``(B, H, N, D)`` contiguous with ``N = S·M``, the view ``q.view(B·H, M, S, D).transpose(1, 2)``
is ``(B·H, S, M, D)``: "head" ``r`` of "batch" ``bh`` holds positions ``r, r + S, r + 2S, ...`` in
order. The strided part of ``causal & (sliding_window(w) | strided(S))`` keeps pairs in one residue
class, so on that view it is an ordinary mask on sequences of ``M`` tokens (``Part.class_mask``),
and the kernels read and write it through strides: no permuted copies of Q, K, V, O or dO.

Forward: the band in token order, the strided part on the view, then one merge kernel
(``kernels/merge.py``). Backward: each part's recompute backward with the *merged* output and
logsumexp. For disjoint key sets this is exact: ``dS = P ∘ (dP − delta)`` with ``P`` from the merged
logsumexp and ``delta = rowsum(dO ∘ O)`` of the merged output, so each part's kernels produce that
part's share of dQ and all of dK/dV for its keys. ``delta`` is computed once; the strided part's
backward adds its gradients to the band's in its epilogue (``ACCUMULATE``), through the same views.

Applies when the backend is Triton, ``N % S == 0`` and there is no dropout. Otherwise
``ops/api._attention_parts`` permutes copies. GQA/MQA inputs need the class-major layout (see
:func:`class_view`); it is off until it has run on the GPU (:func:`set_residue_gqa`).
"""

from __future__ import annotations

import math

import torch
import triton

from ..compiler.compile import compile_mask
from ..compiler.rewrite import Part
from .validate import Shapes

__all__ = ["residue_applies", "residue_attention", "class_view", "set_residue_gqa"]


_GQA = {"on": False}


def set_residue_gqa(on: bool) -> None:
    """Run GQA/MQA inputs through the class views too (class-major layout, below). Off by default
    until it has run on the GPU; the interpreter tests cover it."""
    _GQA["on"] = bool(on)


def residue_applies(parts, shapes: Shapes, dtype: torch.dtype) -> bool:
    """Whether :func:`residue_attention` computes ``parts`` (a band and a strided part)."""
    if len(parts) != 2 or parts[0].residue_stride or not parts[1].residue_stride or parts[1].class_mask is None:
        return False
    s = parts[1].residue_stride
    return ((shapes.G == 1 or _GQA["on"]) and shapes.Lq == shapes.Lk and shapes.Lq % s == 0
            and dtype != torch.float64)


def class_view(x: torch.Tensor, stride: int, class_major: bool = False) -> torch.Tensor:
    """``(B, H, N, D)`` contiguous -> ``(B·H, S, N/S, D)`` view: residue class ``r`` as head ``r``.

    ``class_major``: ``(S, B·H, N/S, D)`` instead, class ``r`` as batch ``r`` and ``(b, h)`` as head
    ``b·H + h``. The kernels map query head ``i`` to kv head ``i // G``, which for ``H = G·Hkv`` is
    ``b·Hkv + h // G``: the GQA grouping survives, so k/v with fewer heads fit this layout."""
    B, H, N, D = x.shape
    v = x.view(B * H, N // stride, stride, D)
    return v.permute(2, 0, 1, 3) if class_major else v.transpose(1, 2)


def _class_rows(x: torch.Tensor, stride: int, class_major: bool = False) -> torch.Tensor:
    """``(B, H, N)`` -> ``(B·H, S, N/S)`` (or ``(S, B·H, N/S)``) contiguous copy (LSE-sized tensors)."""
    B, H, N = x.shape
    v = x.reshape(B * H, N // stride, stride)
    return (v.permute(2, 0, 1) if class_major else v.transpose(1, 2)).contiguous()


def _class_block(m: int, block_size) -> tuple[int, int]:
    """Layout block of the class part: the user's (or 128), shrunk to the class length."""
    b = block_size if isinstance(block_size, int) else (block_size[0] if block_size else 128)
    b = max(16, min(b, triton.next_power_of_2(m)))
    return (b, b)


def _layouts(parts, shapes: Shapes, device, block_size, class_major: bool):
    s = parts[1].residue_stride
    m = shapes.Lq // s
    band = compile_mask(parts[0].mask, shapes.Lq, shapes.Lk, block_size or 128, device=device)
    cls = compile_mask(parts[1].class_mask, m, m, _class_block(m, block_size), device=device)
    if class_major:
        cshapes = Shapes(s, shapes.B * shapes.H, shapes.B * shapes.Hkv, m, m, shapes.D)
    else:
        cshapes = Shapes(shapes.B * shapes.H, s, s, m, m, shapes.D)
    return band, cls, cshapes


class _ResidueAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, band, cls, shapes, cshapes, stride, scale, cm):
        from .triton_backend import merge_residue, triton_forward

        ctx.set_materialize_grads(False)
        q, k, v = (t.contiguous() for t in (q, k, v))
        out, lse = triton_forward(q, k, v, band, shapes, scale, 0.0, 0)
        o2, l2 = triton_forward(class_view(q, stride, cm), class_view(k, stride, cm), class_view(v, stride, cm), cls,
                                cshapes, scale, 0.0, 0)
        if cm:  # the merge kernel reads the (B·H, S, N/S) order
            o2, l2 = o2.transpose(0, 1).contiguous(), l2.transpose(0, 1).contiguous()
        merge_residue(out, lse, o2, l2, stride)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (band, cls, shapes, cshapes, stride, scale, cm)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from .triton_backend import backward_delta, triton_backward

        q, k, v, out, lse = ctx.saved_tensors
        band, cls, shapes, cshapes, stride, scale, cm = ctx.args
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        delta = backward_delta(out, dout, lse, shapes, dlse)  # once, for both parts
        dq, dk, dv = triton_backward(q, k, v, out, lse, dout, band, shapes, scale, 0.0, 0, delta=delta)
        cq, ck, cv, cdout = (class_view(t, stride, cm) for t in (q, k, v, dout))
        # the class part adds its gradients to the band's in place, through the same views
        triton_backward(cq, ck, cv, None, _class_rows(lse, stride, cm), cdout, cls, cshapes, scale, 0.0, 0,
                        delta=_class_rows(delta, stride, cm),
                        accumulate=tuple(class_view(g, stride, cm) for g in (dq, dk, dv)))
        return dq, dk, dv, None, None, None, None, None, None, None


def residue_attention(q, k, v, parts: tuple[Part, Part], shapes: Shapes, scale: float | None, block_size=None):
    """Attention over ``parts`` (band, strided part) with the strided part on class views.

    Args:
        q: ``(B, H, N, D)``; k, v: ``(B, Hkv, N, D)``; ``N`` a multiple of the stride.
        parts: from :func:`blocksparse_fa.compiler.rewrite.plan`.

    Returns:
        ``(out (B, H, N, D), lse (B, H, N) float32)``; differentiable in q, k, v (and through lse).
    """
    scale = 1.0 / math.sqrt(shapes.D) if scale is None else float(scale)
    cm = shapes.G > 1  # GQA/MQA: the class-major layout keeps the head grouping
    band, cls, cshapes = _layouts(parts, shapes, q.device, block_size, cm)
    return _ResidueAttention.apply(q, k, v, band, cls, shapes, cshapes, parts[1].residue_stride, scale, cm)
