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

from . import select
from .options import KernelOptions
from .validate import Shapes

__all__ = ["split_forward", "split_backward"]

BOX_SECOND = True
"""Run the second part on its box (``RunSplit.box``: its rows and keys, widened to whole tiles) as
views of q, k, v, through the device-interval kernels (``ops/interval_backend``: Gluon on Hopper)
with the box's intervals: its output, logsumexp and gradients then take the box's memory, and its
kernels skip the tiles outside it (H200, 16K, H 8: fwd+bwd peak 225.6 → 194.1 MiB for
``key_range | causal``, 225.6 → 177.6 for block diffusion, at equal time). False runs the second
part on the whole sequence, as the first."""


def _second_box(rs, device, s: Shapes):
    """``(iv, empty, shapes, (r0, r1, c0, c1))`` of the second part on its box for ``device``
    (the interval tensors cached on the split per device); ``empty``: bool ``(Zb, Zh, r1 - r0)``
    of the box rows that keep nothing, or None."""
    from ..compiler.device_intervals import DeviceIntervals

    cache = rs.__dict__.setdefault("_box_iv", {})
    key = str(device)
    hit = cache.get(key)
    if hit is None:
        lo, hi = (torch.from_numpy(x).to(device) for x in rs.box_bounds)
        empty = lo >= hi
        hit = cache[key] = (DeviceIntervals(lo, hi, None, None, None, None), empty if bool(empty.any()) else None)
    r0, r1, c0, c1 = rs.box
    return hit[0], hit[1], Shapes(s.B, s.H, s.Hkv, r1 - r0, c1 - c0, s.D), rs.box


def split_forward(q, k, v, rs, s: Shapes, scale: float, opts: KernelOptions, fwd_one):
    """``(out, lse (B, H, Lq) float32)`` of the split mask ``rs`` (a
    :class:`~blocksparse_fa.compiler.runs.RunSplit`); ``fwd_one``: the one-layout forward of
    ``ops/dispatch``."""
    from .triton_backend import merge_residue

    out, lse = fwd_one(q, k, v, rs.first, s, scale, 0.0, 0, "triton", opts=opts)
    lse = lse.reshape(s.B, s.H, s.Lq).contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    if BOX_SECOND and rs.box is not None:
        from .interval_backend import _forward

        iv, _, sb, (r0, r1, c0, c1) = _second_box(rs, q.device, s)
        o2, l2 = _forward(q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], iv, scale, 0.0, 0, "triton", opts, sb)
        l2 = l2.contiguous()
    else:
        o2, l2 = fwd_one(q, k, v, rs.second, s, scale, 0.0, 0, "triton", opts=opts)
        r0, r1 = rs.rows  # the second part's other rows keep nothing: the first part's stand
        o2, l2 = o2[:, :, r0:r1], l2.reshape(s.B, s.H, s.Lq)[:, :, r0:r1].contiguous()
    if o2.stride(-1) != 1:
        o2 = o2.contiguous()
    merge_residue(out, lse, o2, l2, 1, r0)
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
    if BOX_SECOND and rs.box is not None:
        from .interval_backend import _backward_grads

        iv, empty, sb, (r0, r1, c0, c1) = _second_box(rs, q.device, s)
        lb = lse[:, :, r0:r1]
        if empty is not None:  # rows the box part leaves empty: skipped by a -inf logsumexp, as the kernels
            lb = lb.masked_fill(empty, float("-inf"))  # of a whole-mask part are (ops/triton_backend)
        g2 = _backward_grads(q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], out[:, :, r0:r1], lb.contiguous(),
                             dout[:, :, r0:r1], None if dlse is None else dlse[:, :, r0:r1], iv, scale, 0.0, 0,
                             "triton", opts, sb)
        with torch.no_grad():
            dq[:, :, r0:r1].add_(g2[0])
            dk[:, :, c0:c1].add_(g2[1])
            dv[:, :, c0:c1].add_(g2[2])
        return dq, dk, dv
    key = (s, q.dtype, q.device, opts, select.tma_ok(q, k, v, dout))
    adds = rs.__dict__.setdefault("_adds", {})
    if key not in adds:  # chosen once per shapes and options, not per call
        adds[key] = _adds_in_place(backward_choice(q, k, v, dout, rs.second, s, 0.0, opts))
    if adds[key]:
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
