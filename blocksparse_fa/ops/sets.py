"""A mask with global positions anywhere as three parts (``compiler/sets.py``).

The band's forward (the interval kernels: Gluon on Hopper) writes the output and logsumexp of every
row; the global keys, gathered into a ``(B, Hkv, nk, D)`` tensor, run as one key tile per row tile
on the block kernels and merge into every row in place (``kernels/merge.py``); the global rows,
gathered into a ``(B, H, nr, D)`` tensor, run over all keys on the block kernels (their work lists
split the long rows) and merge into those rows.

Backward, with the merged output and logsumexp (``delta`` computed once): the band's backward
gives its share of dQ, dK and dV (exact for disjoint key sets, as in ``ops/residue.py``); the
global keys' part adds its dQ in place and its dK/dV on the gathered keys, the global rows' part
its dK/dV in place and its dQ on the gathered rows, which are then added at their positions.
"""

from __future__ import annotations

import torch

from .options import KernelOptions
from .validate import Shapes

__all__ = ["split_forward", "split_backward"]


def _indices(ss, device):
    """``(keys, rows)`` int64 index tensors on ``device`` (cached on the split per device)."""
    cache = ss.__dict__.setdefault("_index", {})
    key = str(device)
    if key not in cache:
        cache[key] = tuple(torch.from_numpy(x).to(device) for x in (ss.keys, ss.rows))
    return cache[key]


def split_forward(q, k, v, ss, s: Shapes, scale: float, opts: KernelOptions, fwd_one):
    """``(out, lse (B, H, Lq) float32)`` of the split mask ``ss`` (a
    :class:`~blocksparse_fa.compiler.sets.SetSplit`); ``fwd_one``: the one-layout forward of
    ``ops/dispatch``."""
    from .globals import _rows_opts
    from .triton_backend import merge_residue

    keys, rows = _indices(ss, q.device)
    part_opts = _rows_opts(opts)
    out, lse = fwd_one(q, k, v, ss.band, s, scale, 0.0, 0, "triton", opts=opts)
    lse = lse.reshape(s.B, s.H, s.Lq).contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    if ss.keys_part is not None:
        ks = Shapes(s.B, s.H, s.Hkv, s.Lq, len(ss.keys), s.D)
        o2, l2 = fwd_one(q, k.index_select(2, keys), v.index_select(2, keys), ss.keys_part, ks, scale, 0.0, 0,
                         "triton", opts=part_opts)
        merge_residue(out, lse, o2 if o2.stride(-1) == 1 else o2.contiguous(), l2.reshape(s.B, s.H, s.Lq).contiguous(),
                      1, 0)
    if ss.rows_part is not None:
        n = len(ss.rows)
        rs = Shapes(s.B, s.H, s.Hkv, n, s.Lk, s.D)
        o3, l3 = fwd_one(q.index_select(2, rows), k, v, ss.rows_part, rs, scale, 0.0, 0, "triton", opts=part_opts)
        o_r, l_r = out.index_select(2, rows), lse.index_select(2, rows).contiguous()
        merge_residue(o_r, l_r, o3 if o3.stride(-1) == 1 else o3.contiguous(), l3.reshape(s.B, s.H, n).contiguous(),
                      1, 0)
        out.index_copy_(2, rows, o_r)
        lse.index_copy_(2, rows, l_r)
    return out, lse


def split_backward(q, k, v, out, lse, dout, ss, s: Shapes, scale: float, dlse, opts: KernelOptions):
    """``(dq, dk, dv)`` in the inputs' dtypes for the split mask ``ss``, from the merged ``out`` and
    ``lse`` (``dlse``: the logsumexp's gradient or None)."""
    from .globals import _rows_opts
    from .triton_backend import backward_delta, triton_backward

    keys, rows = _indices(ss, q.device)
    part_opts = _rows_opts(opts)
    lse = lse.reshape(s.B, s.H, s.Lq).contiguous()
    delta = backward_delta(out, dout, lse, s, dlse)
    dq, dk, dv = triton_backward(q, k, v, out, lse, dout, ss.band, s, scale, 0.0, 0, delta=delta, opts=opts)
    if ss.keys_part is not None:
        ks = Shapes(s.B, s.H, s.Hkv, s.Lq, len(ss.keys), s.D)
        kg, vg = k.index_select(2, keys), v.index_select(2, keys)
        dkg, dvg = torch.zeros_like(kg), torch.zeros_like(vg)
        triton_backward(q, kg, vg, out, lse, dout, ss.keys_part, ks, scale, 0.0, 0, delta=delta,
                        accumulate=(dq, dkg, dvg), opts=part_opts)
        with torch.no_grad():
            dk.index_add_(2, keys, dkg)
            dv.index_add_(2, keys, dvg)
    if ss.rows_part is not None:
        n = len(ss.rows)
        rs = Shapes(s.B, s.H, s.Hkv, n, s.Lk, s.D)
        qr = q.index_select(2, rows)
        dqr = torch.zeros_like(qr)
        triton_backward(qr, k, v, out.index_select(2, rows), lse.index_select(2, rows).contiguous(),
                        dout.index_select(2, rows), ss.rows_part, rs, scale, 0.0, 0,
                        delta=delta.index_select(2, rows).contiguous(), accumulate=(dqr, dk, dv), opts=part_opts)
        with torch.no_grad():
            dq.index_add_(2, rows, dqr)
    return dq, dk, dv
