"""A mask with global tokens as exact parts (``compiler/globals.py``), on the Triton backend.

Forward: on Hopper, where the first ``g`` rows need no block-kernel part of their own, the band's
Gluon interval forward visits the global keys first in every work item (one pass,
``_fold_global_keys``): for attention sinks that is all; where the first rows keep every later key
(Longformer) a split-K kernel pair then merges those keys into the corner the band wrote. Otherwise
the band (one key interval per row) writes every row's output and logsumexp (the first ``g`` rows
keep nothing there); the first ``g`` rows are overwritten by their own part (the split-K pair where
they keep every later key, else a ``g × Lk`` layout on the block kernels, whose work lists split
its long rows); ``kernels/globals._global_keys_fwd`` merges the global keys into every row in
place.

Backward, with the merged output and logsumexp (``delta`` computed once): the band's kernels give
the band's share of dQ and dK/dV (exact for disjoint key sets, as in ``ops/residue.py``); the first
``g`` rows' part adds to them; ``_global_keys_bwd`` adds the global keys' dQ in place and their
dK/dV through float32 buffers.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import call_memo, select
from .options import KernelOptions
from .validate import Shapes

__all__ = ["split_forward", "split_backward"]

_BLOCK_M = 64
_BLOCK_N = 64
_NUM_WARPS = None  # None: 4 up to head dim 128 (H200, d 128: 64 x 4 beat 64 x 8, 32 x 4/8 and 128 x 8), else 8
_ROWS_OPTS: dict = {}


def _rows_opts(opts: KernelOptions) -> KernelOptions:
    """The first rows' call: the block kernels (their work lists split rows as long as ``Lk``)."""
    hit = _ROWS_OPTS.get(opts)
    if hit is None:
        hit = _ROWS_OPTS[opts] = opts.replace(forward="triton", backward="triton")
    return hit


def _consts(s: Shapes, g: int, dtype, device) -> dict:
    from ..kernels.config import head_dim_pad
    from .triton_backend import _dot_precision

    return dict(HEAD_DIM=s.D, HEAD_DIM_PAD=head_dim_pad(s.D), BLOCK_M=_BLOCK_M, BLOCK_G=max(16, 1 << (g - 1).bit_length()),
                DOT_PRECISION=_dot_precision(dtype, device), num_warps=_NUM_WARPS or (8 if s.D > 128 else 4), num_stages=2)


def _runs(n: int, heads: int, step: int, device, per_sm: int) -> tuple[int, int]:
    """``(per, n_prog)``: ``n`` rows or keys cut into runs of ``per`` (a multiple of ``step``), about
    ``per_sm`` programs per SM over ``heads`` heads, every run non-empty."""
    sms = select.hardware(device).sm_count or 4
    want = max(1, min(_cdiv(n, step), _cdiv(per_sm * sms, heads)))
    per = _cdiv(_cdiv(n, want), step) * step
    return per, _cdiv(n, per)


def split_forward(q, k, v, gs, s: Shapes, scale: float, opts: KernelOptions, fwd_one):
    """``(out, lse (B, H, Lq) float32)`` of the split mask ``gs`` (a
    :class:`~blocksparse_fa.compiler.globals.GlobalSplit`); ``fwd_one``: the one-layout forward
    of ``ops/dispatch``."""
    from ..kernels.globals import _global_keys_fwd
    from .triton_backend import _launch

    g, qk_scale = gs.g, scale * math.log2(math.e)
    folded = _fold_global_keys(q, k, v, gs, s, opts)
    if folded is not None:  # the band's Gluon forward visits the global keys first: one pass
        from .triton_backend import triton_forward

        out, lse = triton_forward(q, k, v, gs.band, s, scale, 0.0, 0, opts=opts, global_keys=folded)
        if lse.shape != (s.B, s.H, s.Lq):
            lse = lse.reshape(s.B, s.H, s.Lq)
        if gs.rows_full:  # the first g rows hold the corner: merge their later keys in
            call_memo.unfit()  # (temporaries of the split-K pair; only the folded pass alone is replayed)
            _rows_forward(q, k, v, out, lse, g, s, qk_scale, _consts(s, g, q.dtype, q.device), merge=True)
        return out, lse
    call_memo.unfit()  # in-place merges of the parts: not replayed
    consts = _consts(s, g, q.dtype, q.device)
    out, lse = fwd_one(q, k, v, gs.band, s, scale, 0.0, 0, "triton", opts=opts)
    lse = lse.reshape(s.B, s.H, s.Lq)
    if gs.rows_full:  # the first g rows over every later key: a split-K kernel
        _rows_forward(q, k, v, out, lse, g, s, qk_scale, consts)
    elif gs.rows is not None:  # the band leaves the first g rows empty
        rs = Shapes(s.B, s.H, s.Hkv, g, s.Lk, s.D)
        o_r, l_r = fwd_one(q[:, :, :g], k, v, gs.rows, rs, scale, 0.0, 0, "triton", opts=_rows_opts(opts))
        out[:, :, :g] = o_r
        lse[:, :, :g] = l_r.reshape(s.B, s.H, g)
    if lse.stride(-1) != 1:
        lse = lse.contiguous()
    per, n_prog = _BLOCK_M, _cdiv(s.Lq, _BLOCK_M)  # one row tile per program (runs of 512 rows: 12 % slower)
    args = (q, k, v, out, lse, _corner(gs, q.device), *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *out.stride()[:3], lse.stride(0), lse.stride(1), s.H, s.H // s.Hkv, s.Lq, g, per, qk_scale)
    _launch(_global_keys_fwd, (n_prog, s.B * s.H), args, 22, q.device, **consts)
    return out, lse


FOLD_GLOBAL_KEYS = True
"""Fold the global keys into the band's Gluon interval forward (``GLOBAL_KEYS``) where the first rows
need no block-kernel part of their own (none, or every later key: the split-K pair merges those
into the corner the band wrote) and the corner is all kept or causal; else a second pass merges
them."""


def _fold_global_keys(q, k, v, gs, s: Shapes, opts: KernelOptions):
    """``(g, causal)`` for the Gluon forward's ``GLOBAL_KEYS`` mode, or None (cached on the split)."""
    if not FOLD_GLOBAL_KEYS or gs.rows is not None:
        return None
    from .triton_backend import forward_choice

    key = ("fold", s, q.dtype, q.device, opts, select.tma_ok(q, k, v))
    cache = gs.__dict__.setdefault("_fold", {})
    if key not in cache:
        cfg = select.gluon_fwd_config(opts, "interval", s.D)
        band = forward_choice(q, k, v, gs.band, s, 0.0, opts)
        corner = gs.corner
        causal = bool(np.array_equal(corner, np.tril(np.ones_like(corner))))
        ok = (band.family, band.mode) == ("gluon", "interval") and gs.g <= cfg.block_n and (corner.all() or causal)
        cache[key] = (gs.g, causal and not corner.all()) if ok else None
    return cache[key]


def _rows_forward(q, k, v, out, lse, g: int, s: Shapes, qk_scale: float, consts: dict, merge: bool = False) -> None:
    """The first ``g`` rows over keys ``g ..`` into ``out``/``lse``: per chunk of keys a partial
    output (``kernels/globals._global_rows_fwd``), merged here in float32 (``merge``: with the
    rows' ``out``/``lse`` as one more part, else over them)."""
    from ..kernels.globals import _global_rows_fwd, _global_rows_merge
    from .triton_backend import _launch

    bg, dp = consts["BLOCK_G"], consts["HEAD_DIM_PAD"]
    per, n_chunks = _runs(s.Lk - g, s.B * s.H, _BLOCK_N, q.device, 2)
    po = torch.empty((n_chunks, s.B * s.H, bg, dp), dtype=torch.float32, device=q.device)
    pl = torch.empty((n_chunks, s.B * s.H, bg), dtype=torch.float32, device=q.device)
    args = (q, k, v, po, pl, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], s.H, s.H // s.Hkv, s.Lk, g, per,
            qk_scale)
    _launch(_global_rows_fwd, (n_chunks, s.B * s.H), args, 16, q.device, **_rows_consts(consts, 2))
    args = (po, pl, out, lse, *out.stride()[:3], *lse.stride(), s.H, g, n_chunks)
    _launch(_global_rows_merge, (s.B * s.H, ), args, 11, q.device, HEAD_DIM=s.D, HEAD_DIM_PAD=dp, BLOCK_G=bg,
            MERGE=merge, num_warps=4)


def _rows_consts(consts: dict, stages: int) -> dict:
    """The global rows' kernels' constexprs; ``stages``: their loops' pipelining depth (the
    backward's loop body loads four tiles and a float32 slot: one stage fits shared memory)."""
    c = {key: consts[key] for key in ("HEAD_DIM", "HEAD_DIM_PAD", "BLOCK_G", "DOT_PRECISION", "num_warps")}
    c.update(BLOCK_N=_BLOCK_N, num_stages=stages)
    return c


def split_backward(q, k, v, out, lse, dout, gs, s: Shapes, scale: float, dlse, opts: KernelOptions):
    """``(dq, dk, dv)`` in the inputs' dtypes for the split mask ``gs``, from the merged ``out`` and
    ``lse`` (``dlse``: the logsumexp's gradient or None)."""
    from ..kernels.globals import _global_keys_bwd, _global_rows_bwd
    from .triton_backend import _launch, backward_delta, triton_backward

    g, qk_scale = gs.g, scale * math.log2(math.e)
    consts = _consts(s, g, q.dtype, q.device)
    lse = lse.reshape(s.B, s.H, s.Lq).contiguous()
    delta = backward_delta(out, dout, lse, s, dlse)
    dq, dk, dv = triton_backward(q, k, v, out, lse, dout, gs.band, s, scale, 0.0, 0, delta=delta, opts=opts)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    if gs.rows_full:
        bg, dp = consts["BLOCK_G"], consts["HEAD_DIM_PAD"]
        per, n_chunks = _runs(s.Lk - g, s.B * s.Hkv, _BLOCK_N, q.device, 2)
        dqp = torch.zeros((n_chunks, s.B * s.H, bg, dp), dtype=torch.float32, device=q.device)
        args = (q, k, v, dout, lse, delta, dk, dv, dqp, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                *dout.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], s.H, s.H // s.Hkv, s.Lq, s.Lk, g, per,
                scale, qk_scale)
        _launch(_global_rows_bwd, (n_chunks, s.B * s.Hkv), args, 29, q.device, **_rows_consts(consts, 1))
        dq[:, :, :g].add_(dqp.sum(0)[:, :g, :s.D].view(s.B, s.H, g, s.D), alpha=scale)
    elif gs.rows is not None:
        rs = Shapes(s.B, s.H, s.Hkv, g, s.Lk, s.D)
        triton_backward(q[:, :, :g], k, v, out[:, :, :g], lse[:, :, :g].contiguous(), dout[:, :, :g], gs.rows, rs,
                        scale, 0.0, 0, delta=delta[:, :, :g].contiguous(), accumulate=(dq[:, :, :g], dk, dv),
                        opts=_rows_opts(opts))
    dkg, dvg = torch.zeros((2, s.B * s.Hkv, g, s.D), dtype=torch.float32, device=q.device).unbind(0)
    per, n_prog = _runs(s.Lq, s.B * s.H, _BLOCK_M, q.device, 4)
    args = (q, k, v, dout, dq, lse, delta, dkg, dvg, _corner(gs, q.device), *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], *dout.stride()[:3], *dq.stride()[:3], s.H, s.H // s.Hkv, s.Lq, g, per, scale, qk_scale)
    _launch(_global_keys_bwd, (n_prog, s.B * s.H), args, 27, q.device, **consts)
    for grad, part in ((dk, dkg), (dv, dvg)):
        grad[:, :, :g].add_(part.view(s.B, s.Hkv, g, s.D))  # in float32, rounded once
    return dq, dk, dv


def _corner(gs, device) -> torch.Tensor:
    """The split's ``(g, g)`` corner as int8 on ``device`` (cached on the split)."""
    cache = gs.__dict__.setdefault("_corner", {})
    hit = cache.get(device)
    if hit is None:
        hit = cache[device] = torch.from_numpy(gs.corner.astype("int8")).to(device)
    return hit


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
