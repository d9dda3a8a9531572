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
:func:`class_view`; H100-validated, on by default, :func:`set_residue_gqa` turns it off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from ..compiler.compile import compile_mask
from ..compiler.layout import BlockLayout
from ..compiler.rewrite import Part
from .validate import Shapes

__all__ = ["residue_applies", "residue_attention", "class_view", "set_residue_gqa", "ResiduePlan", "residue_plan",
           "residue_forward", "residue_backward"]


_GQA = {"on": True}


def set_residue_gqa(on: bool) -> None:
    """Run GQA/MQA inputs through the class views too (class-major layout, below); on by default.
    Off, they take permuted copies (``ops/api._attention_parts``). On the H100 (16K, H = 16,
    Hkv = 4) the views ran 3.14x / 3.46x faster than FlexAttention (fwd / fwd+bwd), the copies
    1.74x / 1.69x (``benchmarks/strided_check.py --kv-heads-ratio 4``)."""
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


@dataclass(frozen=True)
class ResiduePlan:
    """What both passes need: the band's and the class part's layouts and shapes."""

    band: BlockLayout
    cls: BlockLayout
    shapes: Shapes
    cshapes: Shapes
    stride: int
    scale: float
    class_major: bool


def residue_plan(parts, shapes: Shapes, device, scale: float, block_size=None) -> ResiduePlan:
    """Layouts (cached by ``compile_mask``) for ``parts`` at these shapes. GQA/MQA take the
    class-major layout, which keeps the head grouping."""
    s = parts[1].residue_stride
    m = shapes.Lq // s
    cm = shapes.G > 1
    band = compile_mask(parts[0].mask, shapes.Lq, shapes.Lk, block_size or 128, device=device)
    cls = compile_mask(parts[1].class_mask, m, m, _class_block(m, block_size), device=device)
    if cm:
        cshapes = Shapes(s, shapes.B * shapes.H, shapes.B * shapes.Hkv, m, m, shapes.D)
    else:
        cshapes = Shapes(shapes.B * shapes.H, s, s, m, m, shapes.D)
    return ResiduePlan(band, cls, shapes, cshapes, s, scale, cm)


def residue_forward(q, k, v, rp: ResiduePlan):
    """``(out (B, H, N, D), lse (B, H, N) float32)``: band, class part, merge. q/k/v contiguous."""
    from .triton_backend import merge_residue, triton_forward

    st, cm = rp.stride, rp.class_major
    out, lse = triton_forward(q, k, v, rp.band, rp.shapes, rp.scale, 0.0, 0)
    o2, l2 = triton_forward(class_view(q, st, cm), class_view(k, st, cm), class_view(v, st, cm), rp.cls,
                            rp.cshapes, rp.scale, 0.0, 0)
    if cm:  # the merge kernel reads the (B·H, S, N/S) order
        o2, l2 = o2.transpose(0, 1).contiguous(), l2.transpose(0, 1).contiguous()
    merge_residue(out, lse, o2, l2, st)
    return out, lse


def residue_backward(q, k, v, out, lse, dout, rp: ResiduePlan, dlse=None):
    """``(dq, dk, dv)`` of :func:`residue_forward` (q/k/v/out/dout contiguous): ``delta`` once,
    the band's backward, then the class part's, which adds its gradients through the views."""
    from .triton_backend import backward_delta, triton_backward

    st, cm = rp.stride, rp.class_major
    delta = backward_delta(out, dout, lse, rp.shapes, dlse)
    dq, dk, dv = triton_backward(q, k, v, out, lse, dout, rp.band, rp.shapes, rp.scale, 0.0, 0, delta=delta)
    cq, ck, cv, cdout = (class_view(t, st, cm) for t in (q, k, v, dout))
    triton_backward(cq, ck, cv, None, _class_rows(lse, st, cm), cdout, rp.cls, rp.cshapes, rp.scale, 0.0, 0,
                    delta=_class_rows(delta, st, cm), accumulate=tuple(class_view(g, st, cm) for g in (dq, dk, dv)))
    return dq, dk, dv


class _ResidueAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rp):
        ctx.set_materialize_grads(False)
        q, k, v = (t.contiguous() for t in (q, k, v))
        out, lse = residue_forward(q, k, v, rp)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rp = rp
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = residue_backward(q, k, v, out, lse, dout, ctx.rp, dlse)
        return dq, dk, dv, None


def residue_attention(q, k, v, parts: tuple[Part, Part], shapes: Shapes, scale: float | None, block_size=None):
    """Attention over ``parts`` (band, strided part) with the strided part on class views.

    Args:
        q: ``(B, H, N, D)``; k, v: ``(B, Hkv, N, D)``; ``N`` a multiple of the stride.
        parts: from :func:`blocksparse_fa.compiler.rewrite.plan`.

    Returns:
        ``(out (B, H, N, D), lse (B, H, N) float32)``; differentiable in q, k, v (and through lse).
    """
    scale = 1.0 / math.sqrt(shapes.D) if scale is None else float(scale)
    return _ResidueAttention.apply(q, k, v, residue_plan(parts, shapes, q.device, scale, block_size))
