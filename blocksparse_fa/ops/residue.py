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
``ops/dispatch`` permutes copies of each part. GQA/MQA inputs need the class-major layout (see
:func:`class_view`; H100-validated, on by default; the ``residue_gqa`` kernel option turns it off).
"""

from __future__ import annotations

import torch

from ..compiler.rewrite import Rewrite
from .validate import Shapes

__all__ = ["residue_applies", "class_view", "residue_forward", "residue_backward"]


def residue_applies(rw: Rewrite, shapes: Shapes, dtype: torch.dtype, gqa: bool = True) -> bool:
    """Whether :func:`residue_forward` computes this rewrite for these shapes and dtype. ``gqa``
    (the ``residue_gqa`` kernel option): GQA/MQA inputs run through the class views too
    (class-major layout, below); off, they take permuted copies (``ops/dispatch``). On the H100
    (16K, H = 16, Hkv = 4) the views ran 3.14x / 3.46x faster than FlexAttention (fwd / fwd+bwd),
    the copies 1.74x / 1.69x (``benchmarks/NOTES.md``, v9, "Strided with GQA")."""
    return (rw.cls is not None and (shapes.G == 1 or gqa) and shapes.Lq == shapes.Lk
            and shapes.Lq % rw.stride == 0 and dtype != torch.float64)


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


def _class_shapes(rw: Rewrite, s: Shapes) -> tuple[Shapes, bool]:
    """Shapes of the class part on the views; GQA/MQA take the class-major layout, which keeps the
    head grouping."""
    m = s.Lq // rw.stride
    if s.G > 1:
        return Shapes(rw.stride, s.B * s.H, s.B * s.Hkv, m, m, s.D), True
    return Shapes(s.B * s.H, rw.stride, rw.stride, m, m, s.D), False


def residue_forward(q, k, v, rw: Rewrite, s: Shapes, scale: float, opts=None):
    """``(out (B, H, N, D), lse (B, H, N) float32)``: band, class part, merge."""
    from .triton_backend import merge_residue, triton_forward

    q, k, v = (t.contiguous() for t in (q, k, v))
    st = rw.stride
    cs, cm = _class_shapes(rw, s)
    kw = {} if opts is None else {"opts": opts}
    out, lse = triton_forward(q, k, v, rw.band, s, scale, 0.0, 0, **kw)
    o2, l2 = triton_forward(class_view(q, st, cm), class_view(k, st, cm), class_view(v, st, cm), rw.cls,
                            cs, scale, 0.0, 0, **kw)
    if cm:  # the merge kernel reads the (B·H, S, N/S) order
        o2, l2 = o2.transpose(0, 1).contiguous(), l2.transpose(0, 1).contiguous()
    merge_residue(out, lse, o2, l2, st)
    return out, lse


def residue_backward(q, k, v, out, lse, dout, rw: Rewrite, s: Shapes, scale: float, dlse=None, opts=None):
    """``(dq, dk, dv)`` of :func:`residue_forward`: ``delta`` once, the band's backward, then the
    class part's, which adds its gradients through the views."""
    from .triton_backend import backward_delta, triton_backward

    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    lse = lse.float()
    st = rw.stride
    cs, cm = _class_shapes(rw, s)
    kw = {} if opts is None else {"opts": opts}
    delta = backward_delta(out, dout, lse, s, dlse)
    dq, dk, dv = triton_backward(q, k, v, out, lse, dout, rw.band, s, scale, 0.0, 0, delta=delta, **kw)
    cq, ck, cv, cdout = (class_view(t, st, cm) for t in (q, k, v, dout))
    triton_backward(cq, ck, cv, None, _class_rows(lse, st, cm), cdout, rw.cls, cs, scale, 0.0, 0,
                    delta=_class_rows(delta, st, cm), accumulate=tuple(class_view(g, st, cm) for g in (dq, dk, dv)),
                    **kw)
    return dq, dk, dv
