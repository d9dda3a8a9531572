"""A mask of two key runs per row as two one-run parts (``compiler/runs.py``), on the Triton backend.

Forward: each part's forward (the interval kernels: Gluon on Hopper, ``causal()`` on its own
kernel), then one merge kernel (``kernels/merge.py``) over the first part's output and logsumexp, on
the rows where the second part keeps keys.

Backward, with the merged output and logsumexp (``delta`` computed once): the first part's
backward gives its share of dQ and dK/dV (exact for disjoint key sets, as in ``ops/residue.py``);
the second part's gradients are added to them, inside the rows and keys that part keeps. The
Gluon backward writes its gradients rather than adding to them, so where the second part runs it,
its gradients land in new tensors first; elsewhere the Triton kernels add them in their epilogue.
"""

from __future__ import annotations

import torch

from .options import KernelOptions
from .validate import Shapes

__all__ = ["split_forward", "split_backward"]


def split_forward(q, k, v, rs, s: Shapes, scale: float, opts: KernelOptions, fwd_one):
    """``(out, lse (B, H, Lq) float32)`` of the split mask ``rs`` (a
    :class:`~blocksparse_fa.compiler.runs.RunSplit`); ``fwd_one``: the one-layout forward of
    ``ops/dispatch``."""
    from .triton_backend import merge_residue

    out, lse = fwd_one(q, k, v, rs.first, s, scale, 0.0, 0, "triton", opts=opts)
    o2, l2 = fwd_one(q, k, v, rs.second, s, scale, 0.0, 0, "triton", opts=opts)
    r0, r1 = rs.rows  # the second part's other rows keep nothing: the first part's stand
    lse = lse.reshape(s.B, s.H, s.Lq).contiguous()
    l2 = l2.reshape(s.B, s.H, s.Lq)[:, :, r0:r1].contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    if o2.stride(-1) != 1:
        o2 = o2.contiguous()
    merge_residue(out, lse, o2[:, :, r0:r1], l2, 1, r0)
    return out, lse


def _adds_in_place(choice) -> bool:
    """Whether the second part's backward (``choice``, chosen as if it wrote new gradients) adds
    into the first part's gradients itself: every backward but the Gluon one."""
    return choice.family != "gluon"


def split_backward(q, k, v, out, lse, dout, rs, s: Shapes, scale: float, dlse, opts: KernelOptions):
    """``(dq, dk, dv)`` in the inputs' dtypes for the split mask ``rs``, from the merged ``out`` and
    ``lse`` (``dlse``: the logsumexp's gradient or None)."""
    from .triton_backend import backward_choice, backward_delta, triton_backward

    lse = lse.reshape(s.B, s.H, s.Lq).contiguous()
    delta = backward_delta(out, dout, lse, s, dlse)
    dq, dk, dv = triton_backward(q, k, v, out, lse, dout, rs.first, s, scale, 0.0, 0, delta=delta, opts=opts)
    if _adds_in_place(backward_choice(q, k, v, dout, rs.second, s, 0.0, opts)):
        triton_backward(q, k, v, out, lse, dout, rs.second, s, scale, 0.0, 0, delta=delta, accumulate=(dq, dk, dv),
                        opts=opts)
        return dq, dk, dv
    g2 = triton_backward(q, k, v, out, lse, dout, rs.second, s, scale, 0.0, 0, delta=delta, opts=opts)
    (r0, r1), (c0, c1) = rs.rows, rs.keys
    with torch.no_grad():
        dq[:, :, r0:r1].add_(g2[0][:, :, r0:r1])
        dk[:, :, c0:c1].add_(g2[1][:, :, c0:c1])
        dv[:, :, c0:c1].add_(g2[2][:, :, c0:c1])
    return dq, dk, dv
