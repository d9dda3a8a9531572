"""Attention over one key interval per query row, with the intervals built on the device.

The path for masks such as ``causal() & document(ids)`` whose tensors change every step
(``compiler/device_intervals.py`` says which masks qualify and how the intervals are found). Nothing
is compiled or read on the host: the rows' intervals and the kernels' per-tile ranges are built on
the call's device (a few Triton launches on CUDA, torch operations elsewhere; kept between calls
that pass the same mask), and two ``torch.library`` custom ops take them as tensor inputs::

    blocksparse_fa::interval_fwd(Tensor q, Tensor k, Tensor v, Tensor lo, Tensor hi, Tensor? ilo,
                                 Tensor? ihi, Tensor? qid, Tensor? kid, float scale, float dropout_p,
                                 Tensor? seed, str backend, str kernel_options) -> (Tensor out, Tensor lse)
    blocksparse_fa::interval_bwd(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout,
                                 Tensor? dlse, Tensor lo, Tensor hi, Tensor? ilo, Tensor? ihi,
                                 Tensor? qid, Tensor? kid, float scale, float dropout_p, Tensor? seed,
                                 str backend, str kernel_options) -> (Tensor dq, Tensor dk, Tensor dv)

(``interval_fwd`` has registered autograd whose backward is ``interval_bwd``.) The kernels are those
:mod:`blocksparse_fa.ops.select` chooses for the ``"device_interval"`` class, with the call's kernel
options (their canonical string, a constant of a compiled graph). Under
``torch.compile`` a mask built inside the compiled function from that step's ids becomes those
torch operations plus the two opaque calls: the ids are graph inputs, never guarded on, so new ids
never recompile, and a captured CUDA graph replays any packing of the same shapes.

Backends: the Triton kernels of ``kernels/interval.py`` (CUDA, or the interpreter with
``backend="triton"``), or an exact PyTorch implementation (CPU, float64) that walks row chunks and
reads their key ranges on the host (free on the CPU; on a GPU, with ``backend="torch"``, one read
per call). Dropout draws the same Philox stream as the block kernels. Not on this path (the callers
take the block-layout path instead): score modifiers, meta tensors.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .._oplib import custom_op
from ..compiler.device_intervals import (DeviceIntervals, cached_table, col_tables, gluon_backward_tables,
                                         interval_spec, key_tile_order, row_tables)
from . import select
from .options import DEFAULT_OPTIONS, as_options, decode_options
from .prepare import draw_seed, encoded_options, resolve_backend, seed_tensor
from .validate import Shapes, check_differentiable_backward, check_qkv, lse_dtype, without_autocast

__all__ = ["interval_attention", "try_interval_attention", "interval_fwd", "interval_bwd", "gluon_interval_forward",
           "gluon_interval_backward"]

_LOG2E = 1.4426950408889634


def _strides(iv: DeviceIntervals, kv_len: int):
    """``(ZB, ZH, KIDB)``: the kernels' instance strides (0 on dims the mask shares) and the
    key-id row stride (0 for ids shared by the batch)."""
    zb, zh = iv.lo.shape[0], iv.lo.shape[1]
    kidb = kv_len if iv.kid is not None and iv.kid.shape[0] > 1 else 0
    return (zh if zb > 1 else 0), (1 if zh > 1 else 0), kidb


# ------------------------------------------------------------------------------------------------
# Triton
# ------------------------------------------------------------------------------------------------
_LAUNCHES: dict = {}


def _new_like(like: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """An uninitialised kernel output: shaped and strided like ``like``, or contiguous ``shape``
    (tests fill it with NaN to prove that the kernels write every element)."""
    if shape is None:
        if like.is_contiguous():  # one allocation, without empty_like's stride inference
            return torch.empty(like.shape, dtype=dtype or like.dtype, device=like.device)
        return torch.empty_like(like, dtype=dtype)
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def _launch(fn, consts: dict, n_key: int, device):
    from .launcher import Launch

    key = (fn, tuple(sorted(consts.items())), n_key, device)
    ln = _LAUNCHES.get(key)
    if ln is None:
        ln = _LAUNCHES[key] = Launch(fn, consts, n_key, device)
    return ln


def _ids_or_placeholder(iv: DeviceIntervals, device):
    ph = iv.lo  # never read without HAS_IDS
    return (iv.qid if iv.qid is not None else ph), (iv.kid if iv.kid is not None else ph)


def _shrunk(fit, cfgs):
    """Run ``fit(cfgs)``, shrinking the tiles (``triton_backend._shrink``) while they do not fit."""
    from triton.runtime.errors import OutOfResources

    from .triton_backend import _shrink

    while True:
        try:
            return fit(cfgs)
        except OutOfResources:
            for i, c in enumerate(cfgs):
                smaller = _shrink(c)
                if smaller is not None:
                    cfgs = cfgs[:i] + (smaller,) + cfgs[i + 1:]
                    break
            else:
                raise


def _last_dim_contiguous(*ts):
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)


def _dropout_args(dropout_p: float, seed: int) -> tuple:
    """``(seed_lo, seed_hi, threshold, scale)`` of the kernels' Philox dropout (zeros without it)."""
    from .dropout import dropout_threshold, seed_words

    if dropout_p == 0.0:
        return 0, 0, 0, 1.0
    return (*seed_words(seed), dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p))


def _row_table(iv: DeviceIntervals, block_m: int, block_n: int):
    """The row tiles' table (``kernels/interval_tables.py``), kept for calls with the same intervals."""
    return cached_table(iv, ("row", block_m, block_n), lambda: row_tables(iv, block_m, block_n, fast=True))


def triton_interval_forward(q, k, v, iv: DeviceIntervals, s: Shapes, scale: float, dropout_p: float = 0.0,
                            seed: int = 0):
    """``(out, lse)``: out like q (its strides), lse ``(B, H, Lq)`` float32."""
    from ..kernels.config import fwd_config, head_dim_pad
    from ..kernels.interval import _interval_fwd
    from .triton_backend import _dot_precision

    q, k, v = _last_dim_contiguous(q, k, v)
    out = _new_like(q)
    lse = _new_like(q, shape=(s.B, s.H, s.Lq), dtype=torch.float32)
    d_pad = head_dim_pad(s.D)
    zb, zh, kidb = _strides(iv, s.Lk)
    qid, kid = _ids_or_placeholder(iv, q.device)

    def fit(cfgs):
        (cfg,) = cfgs
        tab = _row_table(iv, cfg.block_m, cfg.block_n)
        n_tiles = tab.shape[-2]
        consts = dict(HAS_IDS=iv.qid is not None, HEAD_DIM=s.D, HEAD_DIM_PAD=d_pad, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n, DOT_PRECISION=_dot_precision(q.dtype, q.device), STAGES=cfg.num_stages,
                      KV_EVEN=s.Lk % cfg.block_n == 0, HAS_DROPOUT=dropout_p > 0.0, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
        _launch(_interval_fwd, consts, 24, q.device)(
            (n_tiles, s.B * s.H), q, k, v, out, lse, iv.lo, iv.hi, qid, kid, tab,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            s.H, s.G, zb, zh, kidb, n_tiles, s.Lq, s.Lk, scale * _LOG2E, *_dropout_args(dropout_p, seed))

    # the band tiles (128 x 64 at d = 128): no spills on sm_90 with or without the id compare
    # (triton 3.9 compile probe; the 128 x 128 tile spills with it)
    _shrunk(fit, (fwd_config(d_pad, q.dtype, 128, 128, band=True),))
    return out, lse



def triton_interval_backward(q, k, v, out, lse, dout, iv: DeviceIntervals, s: Shapes, scale: float, dlse=None,
                             dropout_p: float = 0.0, seed: int = 0):
    """``(dq, dk, dv)`` like q, k, v (k/v gradients summed over the GQA group): dK/dV and dQ
    programs in one launch when their tiles take the same warp count, else two."""
    from ..kernels.config import bwd_configs, head_dim_pad
    from ..kernels.interval import _interval_bwd
    from .triton_backend import _dot_precision, backward_delta

    q, k, v, dout = _last_dim_contiguous(q, k, v, dout)
    lse = lse.contiguous()
    delta = backward_delta(out, dout, lse, s, dlse)
    dq, dk, dv = _new_like(q), _new_like(k), _new_like(v)
    d_pad = head_dim_pad(s.D)
    zb, zh, kidb = _strides(iv, s.Lk)
    qid, kid = _ids_or_placeholder(iv, q.device)
    prec = _dot_precision(q.dtype, q.device)

    def fit(cfgs):
        cfg_kv, cfg_q = cfgs
        row_tab = _row_table(iv, cfg_q.block_m, cfg_q.block_n)
        col_tab = cached_table(iv, ("col", s.Lk, cfg_kv.block_m, cfg_kv.block_n),
                               lambda: col_tables(iv, s.Lk, cfg_kv.block_m, cfg_kv.block_n, fast=True))
        kv_tiles, q_tiles = col_tab.shape[-2], row_tab.shape[-2]
        runs = [(True, True)] if cfg_kv.num_warps == cfg_q.num_warps else [(True, False), (False, True)]
        for run_kv, run_q in runs:
            warps = cfg_kv.num_warps if run_kv else cfg_q.num_warps
            consts = dict(HAS_IDS=iv.qid is not None, HEAD_DIM=s.D, HEAD_DIM_PAD=d_pad, KV_BLOCK_M=cfg_kv.block_m,
                          KV_BLOCK_N=cfg_kv.block_n, Q_BLOCK_M=cfg_q.block_m, Q_BLOCK_N=cfg_q.block_n,
                          DOT_PRECISION=prec, KV_STAGES=cfg_kv.num_stages, Q_STAGES=cfg_q.num_stages,
                          RUN_KV=run_kv, RUN_Q=run_q, Q_EVEN=s.Lq % cfg_kv.block_m == 0,
                          KV_EVEN=s.Lk % cfg_q.block_n == 0, HAS_DROPOUT=dropout_p > 0.0, num_warps=warps,
                          num_stages=max(cfg_kv.num_stages if run_kv else 1, cfg_q.num_stages if run_q else 1))
            n_kv = kv_tiles * s.B * s.Hkv if run_kv else 0
            grid = (n_kv + (q_tiles * s.B * s.H if run_q else 0),)
            _launch(_interval_bwd, consts, 38, q.device)(
                grid, q, k, v, dout, dq, dk, dv, lse, delta, iv.lo, iv.hi, qid, kid, row_tab, col_tab,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
                dv.stride(0), dv.stride(1), dv.stride(2), s.H, s.G,
                zb, zh, kidb, n_kv, kv_tiles, q_tiles, s.Lq, s.Lk, scale * _LOG2E, scale,
                *_dropout_args(dropout_p, seed))

    # the partial-heavy pair (dK/dV 32 x 128, dQ 128 x 64 at d = 128): 2-4 spill instructions on
    # sm_90 against 90-142 with the default pair (triton 3.9 compile probe), one launch (8 warps each)
    _shrunk(fit, bwd_configs(d_pad, q.dtype, 128, 128, partial_heavy=True))
    return dq, dk, dv


def gluon_interval_forward(q, k, v, iv: DeviceIntervals, s: Shapes, scale: float, cfg=None, kept: bool = True):
    """``(out, lse)`` through the Gluon forward's interval mode (``kernels/forward_gluon.py``, Hopper)
    with tables built on the device (:func:`~blocksparse_fa.compiler.device_intervals.gluon_interval_tables`)
    instead of the host ones of a compiled layout. Needs intervals without an id compare (no
    document, or ``contiguous`` documents), a Hopper GPU with Gluon, 16-bit inputs, head dim 64 or
    128, ``Lk`` a multiple of the tiles' ``block_n`` and tensors that tensor descriptors address.
    ``kept``: the tables of ``iv`` are kept for later calls (the eager path, whose masks keep their
    intervals), so that the segment tiles (``GluonConfig.segments`` None) are worth their tables'
    ~40 small launches; a compiled call, which rebuilds its tables every time, takes the aligned
    tiles (one launch)."""
    from ..compiler.device_intervals import gluon_interval_tables, gluon_segment_tables
    from .options import _DEFAULT_GLUON
    from .triton_backend import _gluon_fwd_run

    cfg = cfg or _DEFAULT_GLUON
    why = select.hardware(q.device).gluon
    if iv.qid is not None or iv.ilo is not None:
        why = "the intervals need an id compare (documents not known to be contiguous runs)"
    elif s.D not in (64, 128) or q.dtype not in (torch.float16, torch.bfloat16) or s.Lk % cfg.block_n:
        why = f"needs head dim 64/128, 16-bit inputs and Lk % {cfg.block_n} == 0"
    if why:
        raise ValueError(f"gluon_interval_forward: {why}")
    out = _new_like(q)
    lse = _new_like(q, shape=(s.B, s.H, s.Lq), dtype=torch.float32)
    if not select.tma_ok(q, k, v, out):
        raise ValueError("gluon_interval_forward: tensor descriptors need 16-byte aligned tensors and strides")
    z = iv.lo.shape[0] * iv.lo.shape[1]
    lo, hi = iv.lo.view(z, s.Lq), iv.hi.view(z, s.Lq)
    zb, zh, _ = _strides(iv, s.Lk)
    segments = _segments_on(q, k, v, out, s, cfg, kept)
    if cfg.groups != 2 and not segments:  # the aligned tables are built for two groups
        cfg = replace(cfg, groups=2, consumer_regs=None)
    if segments:
        def seg_tables():
            zs = ((torch.arange(s.B, device=q.device) * zb).view(-1, 1)
                  + torch.arange(s.H, device=q.device) * zh).view(-1)
            return gluon_segment_tables(lo, hi, cfg.groups * cfg.block_m, cfg.block_n, zs)

        lo_s, hi_s, tiles, n_prog = cached_table(iv, ("gluon_segments", cfg.block_m, cfg.block_n, s.B, s.H, zb, zh),
                                                 seg_tables)
        _gluon_fwd_run(q, k, v, out, lse, lo_s, hi_s, tiles, zb, zh, s, scale, "interval", cfg, segments=n_prog)
        return out, lse

    def tables():  # kept on iv.lo: never views of it (no reference cycle)
        lo_p, hi_p, tiles = gluon_interval_tables(lo, hi, cfg.block_m, cfg.block_n)
        return (None, None, tiles) if s.Lq % (2 * cfg.block_m) == 0 else (lo_p, hi_p, tiles)

    lo_p, hi_p, tiles = cached_table(iv, ("gluon", cfg.block_m, cfg.block_n), tables)
    lo, hi = (lo, hi) if lo_p is None else (lo_p, hi_p)
    _gluon_fwd_run(q, k, v, out, lse, lo, hi, tiles, zb, zh, s, scale, "interval", cfg)
    return out, lse


def _segments_on(q, k, v, out, s: Shapes, cfg, kept: bool) -> bool:
    """Whether the device-interval forward runs the segment tiles (``GluonConfig.segments``): asked
    for, or by default where the tables are kept (``kept``), and a persistent grid (2-D row views
    of every tensor)."""
    from .triton_backend import _persistent_grid

    if cfg.segments is False or not cfg.persistent or (cfg.segments is None and not kept):
        return False
    return _persistent_grid((q, k, v, out), s.B * s.H, True, cfg.sm_margin)[0]


def gluon_interval_backward(q, k, v, out, lse, dout, iv: DeviceIntervals, s: Shapes, scale: float, dlse=None,
                            cfg=None, atomic: bool = False):
    """``(dq, dk, dv)`` like q, k, v through the Gluon backward's interval mode
    (``kernels/backward_gluon.py``, Hopper): the dK/dV kernel walks the query blocks of each key
    tile (:func:`~blocksparse_fa.compiler.device_intervals.col_tables` of ``2·block_n`` keys), the
    dQ kernel the key blocks of each row tile (:func:`~blocksparse_fa.compiler.device_intervals.row_tables`
    of ``2·dq_block_m`` rows), both masking partial blocks with the rows' bounds. Needs what
    :func:`~blocksparse_fa.ops.select.choose_backward` checks for its ``gluon:interval`` choice:
    intervals without an id compare, the same for every head (``iv.lo`` ``(Zb, 1, Lq)``) or, without
    GQA, one per head, 16-bit inputs, head dim 64 or 128, lengths multiples of the tiles, tensors
    that descriptors address. ``atomic`` (the ``gluon:interval+atomic_dq`` choice,
    ``deterministic=False``): the five-GEMM kernel, one program per key tile adding dQ in fp32,
    instead of the dQ kernel."""
    from .options import _DEFAULT_GLUON_BWD
    from .triton_backend import _gluon_bwd_launch, backward_delta

    cfg = cfg or _DEFAULT_GLUON_BWD
    lc = _class(iv, s)
    why = select.hardware(q.device).gluon
    if not why and select._gluon_bwd_mode(lc, s, cfg, DEFAULT_OPTIONS) != "interval":
        why = (f"needs intervals without an id compare, the same for every head unless G == 1 (got lo of shape "
               f"{tuple(iv.lo.shape)}, G={s.G}, ids compared: {iv.qid is not None}), head dim 64/128 and lengths that "
               f"are multiples of the tiles (Lq % {max(cfg.block_m, 2 * cfg.dq_block_m)}, "
               f"Lk % {max(2 * cfg.block_n, cfg.dq_block_n)}); got D={s.D}, Lq={s.Lq}, Lk={s.Lk}")
    elif not why and q.dtype not in (torch.float16, torch.bfloat16):
        why = f"needs 16-bit inputs, got {q.dtype}"
    if why:
        raise ValueError(f"gluon_interval_backward: {why}")
    q, k, v, dout = _last_dim_contiguous(q, k, v, dout)
    lse = lse.contiguous()
    delta = backward_delta(out, dout, lse, s, dlse)
    grads = _new_like(q), _new_like(k), _new_like(v)
    if not select.tma_ok(q, k, v, dout, *grads):
        raise ValueError("gluon_interval_backward: tensor descriptors need 16-byte aligned tensors and strides")
    zb, zh = iv.lo.shape[0], iv.lo.shape[1]
    key = ("gluon_bwd", s.Lk, cfg.block_m, cfg.block_n, cfg.dq_block_m, cfg.dq_block_n)
    kv_tab, q_tab = cached_table(iv, key, lambda: gluon_backward_tables(iv, s.Lk, cfg))
    kv_ord = cached_table(iv, key + ("order", ), lambda: key_tile_order(kv_tab))
    lo, hi = iv.lo.view(zb * zh, s.Lq), iv.hi.view(zb * zh, s.Lq)
    _gluon_bwd_launch(q, k, v, dout, grads, lse, delta, s, scale, False, atomic, cfg,
                      intervals=(lo, hi, kv_tab, q_tab, zh if zb > 1 else 0, 1 if zh > 1 else 0, kv_ord))
    return grads


# ------------------------------------------------------------------------------------------------
# PyTorch (exact; CPU and float64)
# ------------------------------------------------------------------------------------------------
_ROWS = 128  # query rows per chunk


def _chunks(iv: DeviceIntervals, q_len: int):
    """``(i0, i1, k0, k1)`` per chunk of rows that keeps anything: its keys lie in ``[k0, k1)``."""
    lo, hi = iv.lo.reshape(-1, q_len).cpu(), iv.hi.reshape(-1, q_len).cpu()
    empty = lo >= hi
    big = torch.iinfo(torch.int32).max
    for i0 in range(0, q_len, _ROWS):
        i1 = min(q_len, i0 + _ROWS)
        e = empty[:, i0:i1]
        if bool(e.all()):
            continue
        yield i0, i1, int(torch.where(e, big, lo[:, i0:i1]).min()), int(torch.where(e, 0, hi[:, i0:i1]).max())


def _keep(iv: DeviceIntervals, i0, i1, k0, k1, device):
    """bool ``(Zb, Zh, i1 - i0, k1 - k0)`` of rows ``i0..i1`` against keys ``k0..k1``."""
    j = torch.arange(k0, k1, device=device)
    lo, hi = iv.lo[..., i0:i1, None], iv.hi[..., i0:i1, None]
    keep = (j >= lo) & (j < hi)
    if iv.qid is not None:
        kid = iv.kid[:, None, None, k0:k1]  # (Zk, 1, 1, K)
        keep = keep & (kid == iv.qid[..., i0:i1, None])
    return keep


def _compute(q, k, v, s: Shapes):
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    exp = (lambda t: t.to(cdt).repeat_interleave(s.G, dim=1)) if s.G > 1 else (lambda t: t.to(cdt))
    return q.to(cdt), exp(k), exp(v)


def _dropped(s: Shapes, i0, i1, k0, k1, dropout_p: float, seed: int, dtype, device):
    """``keep / (1 - p)`` ``(B, H, i1 - i0, k1 - k0)`` of the rows' and keys' Philox draws, or None."""
    if dropout_p == 0.0:
        return None
    import numpy as np

    from .dropout import keep_from_counters

    bh = (np.arange(s.B)[:, None] * s.H + np.arange(s.H)[None, :])[:, :, None, None]
    keep = keep_from_counters(np.arange(i0, i1)[None, None, :, None], np.arange(k0, k1)[None, None, None, :], bh,
                              dropout_p, seed)
    return torch.from_numpy(keep).to(device=device, dtype=dtype) / (1.0 - dropout_p)


def torch_interval_forward(q, k, v, iv: DeviceIntervals, s: Shapes, scale: float, dropout_p: float = 0.0,
                           seed: int = 0):
    """``(out, lse)`` in the compute dtype (float32, float64 for float64), exact."""
    qc, kc, vc = _compute(q, k, v, s)
    out = torch.zeros_like(qc)
    lse = torch.full((s.B, s.H, s.Lq), float("-inf"), dtype=qc.dtype, device=q.device)
    for i0, i1, k0, k1 in _chunks(iv, s.Lq):
        keep = _keep(iv, i0, i1, k0, k1, q.device)
        sc = torch.matmul(qc[:, :, i0:i1], kc[:, :, k0:k1].transpose(-1, -2)) * scale
        sc = sc.masked_fill(~keep, float("-inf"))
        m = sc.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(sc - m)
        l = p.sum(-1, keepdim=True)
        drop = _dropped(s, i0, i1, k0, k1, dropout_p, seed, p.dtype, q.device)
        o = torch.matmul(p if drop is None else p * drop, vc[:, :, k0:k1]) / torch.where(l == 0, torch.ones_like(l), l)
        out[:, :, i0:i1] = torch.where(l == 0, torch.zeros_like(o), o)
        lse[:, :, i0:i1] = (m + torch.log(l)).squeeze(-1)
    return out, lse


def torch_interval_backward(q, k, v, out, lse, dout, iv: DeviceIntervals, s: Shapes, scale: float, dlse=None,
                            dropout_p: float = 0.0, seed: int = 0):
    """``(dq, dk, dv)`` in the compute dtype (k/v gradients summed over the GQA group), exact."""
    qc, kc, vc = _compute(q, k, v, s)
    cdt = qc.dtype
    dout, out, lse = dout.to(cdt), out.to(cdt), lse.to(cdt)
    delta = (dout * out).sum(-1)
    if dlse is not None:
        delta = delta - torch.where(torch.isinf(lse), torch.zeros_like(lse), dlse.to(cdt))
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)  # empty rows: p = 0
    dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
    for i0, i1, k0, k1 in _chunks(iv, s.Lq):
        keep = _keep(iv, i0, i1, k0, k1, q.device)
        qs, ks, vs, do = qc[:, :, i0:i1], kc[:, :, k0:k1], vc[:, :, k0:k1], dout[:, :, i0:i1]
        sc = torch.matmul(qs, ks.transpose(-1, -2)) * scale
        p = torch.exp(sc - lse[:, :, i0:i1, None]).masked_fill(~keep, 0.0)
        dp = torch.matmul(do, vs.transpose(-1, -2))
        drop = _dropped(s, i0, i1, k0, k1, dropout_p, seed, p.dtype, q.device)
        pd = p if drop is None else p * drop
        dp = dp if drop is None else dp * drop
        ds = p * (dp - delta[:, :, i0:i1, None])
        empty = torch.isinf(lse[:, :, i0:i1, None])  # 0 whatever q, k, v hold (0 * NaN)
        ds = torch.where(empty, torch.zeros_like(ds), ds)
        dq[:, :, i0:i1] = torch.where(empty, 0.0, torch.matmul(ds, ks) * scale)
        dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), torch.where(empty, 0.0, qs)) * scale
        dv[:, :, k0:k1] += torch.matmul(pd.transpose(-1, -2), do)
    if s.G > 1:
        dk = dk.view(s.B, s.Hkv, s.G, s.Lk, s.D).sum(2)
        dv = dv.view(s.B, s.Hkv, s.G, s.Lk, s.D).sum(2)
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------
# the custom ops
# ------------------------------------------------------------------------------------------------
def _intervals(lo, hi, ilo, ihi, qid, kid) -> DeviceIntervals:
    return DeviceIntervals(lo, hi, ilo, ihi, qid, kid)


def _check_intervals(iv: DeviceIntervals, s: Shapes, device) -> None:
    """Shapes and dtypes of the interval tensors against q/k (no values read)."""
    zb, zh, lq = iv.lo.shape if iv.lo.dim() == 3 else (None, None, None)
    if lq != s.Lq or zb not in (1, s.B) or zh not in (1, s.H):
        raise ValueError(f"interval bounds must have shape (Zb, Zh, Lq) with Zb in (1, {s.B}), Zh in (1, {s.H}), "
                         f"Lq = {s.Lq}; got {tuple(iv.lo.shape)}")
    rows = iv.lo.shape
    for name, t, shape in (("lo", iv.lo, rows), ("hi", iv.hi, rows), ("ilo", iv.ilo, rows), ("ihi", iv.ihi, rows),
                           ("qid", iv.qid, rows), ("kid", iv.kid, None)):
        if t is None:
            continue
        if t.dtype != torch.int32 or t.device != device or not t.is_contiguous():
            raise ValueError(f"interval tensor {name} must be contiguous int32 on {device}, got {t.dtype} on "
                             f"{t.device}")
        if shape is not None and t.shape != shape:
            raise ValueError(f"interval tensor {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if (iv.qid is None) != (iv.kid is None) or (iv.ilo is None) != (iv.ihi is None):
        raise ValueError("interval tensors: qid and kid, and ilo and ihi, come together")
    if iv.kid is not None and (iv.kid.dim() != 2 or iv.kid.shape[0] not in (1, zb) or iv.kid.shape[1] != s.Lk):
        raise ValueError(f"interval tensor kid must have shape (1 or {zb}, {s.Lk}), got {tuple(iv.kid.shape)}")


def _forward(q, k, v, iv: DeviceIntervals, scale: float, dropout_p: float, seed: int, backend: str,
             opts=DEFAULT_OPTIONS, s: Shapes | None = None):
    """``(out, lse)`` of the kernels :mod:`~blocksparse_fa.ops.select` chooses (the body of
    ``interval_fwd`` and of the eager autograd function). ``s``: the inputs' shapes where the
    caller has checked the inputs and built ``iv`` for them (the eager path), else None (checked
    here); ``backend`` is then resolved too."""
    eager = s is not None
    if s is None:
        s = check_qkv(q, k, v)
        _check_intervals(iv, s, q.device)
        backend = resolve_backend(backend, q.device, q.dtype)
    if backend == "triton":
        choice = forward_choice(q, k, v, iv, s, dropout_p, opts)
        select.note("forward", choice)
        if choice.family == "gluon":
            return gluon_interval_forward(q, k, v, iv, s, scale, select.gluon_fwd_config(opts, "device_interval", s.D),
                                          kept=eager)
        return triton_interval_forward(q, k, v, iv, s, scale, dropout_p, seed)
    select.note("forward", "torch:interval")
    o, lse = torch_interval_forward(q, k, v, iv, s, scale, dropout_p, seed)
    return torch.empty_like(q).copy_(o), lse.to(lse_dtype(q.dtype))


def _backward_grads(q, k, v, out, lse, dout, dlse, iv: DeviceIntervals, scale: float, dropout_p: float, seed: int,
                    backend: str, opts=DEFAULT_OPTIONS, s: Shapes | None = None):
    """``(dq, dk, dv)`` (the body of ``interval_bwd`` and of the eager autograd function); ``s`` as
    in :func:`_forward`."""
    if s is None:
        s = check_qkv(q, k, v)
        backend = resolve_backend(backend, q.device, q.dtype)
    if backend == "triton":
        if q.is_cuda and not select.tma_ok(dout) and select.tma_ok(q):
            dout = dout.contiguous()  # an upstream layout of dO must not change the kernel choice
        choice = backward_choice(q, k, v, dout, iv, s, dropout_p, opts)
        select.note("backward", choice)
        if choice.family == "gluon":
            return gluon_interval_backward(q, k, v, out, lse, dout, iv, s, scale, dlse, opts.gluon_bwd,
                                           atomic=choice.mode.endswith("+atomic_dq"))
        return triton_interval_backward(q, k, v, out, lse, dout, iv, s, scale, dlse, dropout_p, seed)
    select.note("backward", "torch:interval")
    g = torch_interval_backward(q, k, v, out, lse, dout, iv, s, scale, dlse, dropout_p, seed)
    return tuple(torch.empty_like(t).copy_(d) for t, d in zip((q, k, v), g))


@custom_op("blocksparse_fa::interval_fwd", mutates_args=())
def interval_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 ilo: torch.Tensor | None, ihi: torch.Tensor | None, qid: torch.Tensor | None,
                 kid: torch.Tensor | None, scale: float, dropout_p: float, seed: torch.Tensor | None,
                 backend: str, kernel_options: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out, lse)``: out shaped and strided like q, in q's dtype; lse ``(B, H, Lq)``
    float32 (float64 for float64 inputs). ``seed``: an int64 CPU scalar tensor with dropout, else
    None. ``kernel_options``: the encoded :class:`~blocksparse_fa.KernelOptions`."""
    return _forward(q, k, v, _intervals(lo, hi, ilo, ihi, qid, kid), scale, dropout_p, _seed(seed), backend,
                    decode_options(kernel_options))


@interval_fwd.register_fake
def _interval_fwd_fake(q, k, v, lo, hi, ilo, ihi, qid, kid, scale, dropout_p, seed, backend, kernel_options):
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=lse_dtype(q.dtype))


@custom_op("blocksparse_fa::interval_bwd", mutates_args=())
def interval_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 dout: torch.Tensor, dlse: torch.Tensor | None, lo: torch.Tensor, hi: torch.Tensor,
                 ilo: torch.Tensor | None, ihi: torch.Tensor | None, qid: torch.Tensor | None,
                 kid: torch.Tensor | None, scale: float, dropout_p: float, seed: torch.Tensor | None, backend: str,
                 kernel_options: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: ``(dq, dk, dv)`` shaped, strided and typed like q, k, v. ``dlse``: the gradient of
    the returned logsumexp (None: none)."""
    return _backward_grads(q, k, v, out, lse, dout, dlse, _intervals(lo, hi, ilo, ihi, qid, kid), scale, dropout_p,
                           _seed(seed), backend, decode_options(kernel_options))


@interval_bwd.register_fake
def _interval_bwd_fake(q, k, v, out, lse, dout, dlse, lo, hi, ilo, ihi, qid, kid, scale, dropout_p, seed, backend,
                       kernel_options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _seed(seed) -> int:
    return 0 if seed is None else int(seed.item())  # a CPU scalar: no device read


def _setup_context(ctx, inputs, output):
    q, k, v, lo, hi, ilo, ihi, qid, kid, scale, dropout_p, seed, backend, kernel_options = inputs
    # an unused logsumexp (or output) gets None, not zeros: no zeros tensor folded into delta
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, output[0], output[1], lo, hi, ilo, ihi, qid, kid, seed)
    ctx.scale, ctx.dropout_p, ctx.backend, ctx.kernel_options = scale, dropout_p, backend, kernel_options


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, lo, hi, ilo, ihi, qid, kid, seed = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.blocksparse_fa.interval_bwd(q, k, v, out, lse, dout, dlse, lo, hi, ilo, ihi, qid, kid,
                                                       ctx.scale, ctx.dropout_p, seed, ctx.backend,
                                                       ctx.kernel_options)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


interval_fwd.register_autograd(_backward, setup_context=_setup_context)


class _IntervalAttention(torch.autograd.Function):
    """Eager autograd around the same bodies as the custom ops, without their dispatch (the two
    ``torch.library`` custom ops cost about 0.2 ms of host time per forward+backward on the GPU
    machines, ``benchmarks/experiments/custom_op_cost.py``); compiled graphs keep the custom ops."""

    @staticmethod
    def forward(ctx, q, k, v, iv, scale, dropout_p, seed, backend, opts, s):
        ctx.set_materialize_grads(False)  # an unused logsumexp brings no gradient work
        out, lse = _forward(q, k, v, iv, scale, dropout_p, seed, backend, opts, s)
        ctx.save_for_backward(q, k, v, out, lse, *iv)
        ctx.args = (scale, dropout_p, seed, backend, opts, s)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *ivt = ctx.saved_tensors
        check_differentiable_backward(ctx.args[3])
        if dout is None:
            dout = torch.zeros_like(out)
        with without_autocast(q.device):
            dq, dk, dv = _backward_grads(q, k, v, out, lse, dout, dlse, DeviceIntervals(*ivt), *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# entry points
# ------------------------------------------------------------------------------------------------
def _class(iv: DeviceIntervals, s: Shapes) -> select.LayoutClass:
    return select.device_interval_class(s.Lq, s.Lk, iv.lo.shape[0] * iv.lo.shape[1] > 1, iv.qid is not None,
                                        per_head=iv.lo.shape[1] > 1)


def backward_choice(q, k, v, dout, iv: DeviceIntervals, s: Shapes, dropout_p: float,
                    opts=DEFAULT_OPTIONS) -> select.Choice:
    """:func:`~blocksparse_fa.ops.select.choose_backward` for a call on the device-interval path
    (``dout`` None: not known yet, as for :func:`blocksparse_fa.explain`)."""
    ts = (q, k, v) if dout is None else (q, k, v, dout)
    return select.choose_backward(_class(iv, s), s, q.dtype, select.hardware(q.device), opts,
                                  dropout=dropout_p > 0.0, tma=select.tma_ok(*ts))


def forward_choice(q, k, v, iv: DeviceIntervals, s: Shapes, dropout_p: float, opts=DEFAULT_OPTIONS) -> select.Choice:
    """:func:`~blocksparse_fa.ops.select.choose_forward` for a call on the device-interval path."""
    return select.choose_forward(_class(iv, s), s, q.dtype, select.hardware(q.device), opts,
                                 dropout=dropout_p > 0.0, tma=select.tma_ok(q, k, v))


def interval_attention(q, k, v, iv: DeviceIntervals, scale: float, backend: str = "auto", return_lse: bool = False,
                       dropout_p: float = 0.0, dropout_seed=None, kernel_options=None):
    """Attention of ``q (B, H, Lq, D)``, ``k, v (B, Hkv, Lk, D)`` (any strides with a contiguous
    last dim; one head dim) over device intervals ``iv``; ``(out, lse)`` when ``return_lse``
    (lse float32 and differentiable), else ``out``, shaped and strided like q. ``dropout_seed``:
    an int, an int64 scalar tensor or None (drawn from torch's RNG, inside a compiled graph too).
    ``kernel_options``: as in :func:`blocksparse_fa.attention`."""
    if torch.compiler.is_compiling():  # the custom ops: opaque calls of the graph
        seed = seed_tensor(dropout_p, dropout_seed)
        out, lse = interval_fwd(q, k, v, *iv, float(scale), float(dropout_p), seed, backend,
                                encoded_options(kernel_options))
    else:
        if isinstance(dropout_seed, torch.Tensor):
            dropout_seed = int(dropout_seed.to(device="cpu", dtype=torch.int64).reshape(()))
        seed, opts = draw_seed(dropout_p, dropout_seed), as_options(kernel_options)
        s = check_qkv(q, k, v)  # once for the forward and the backward
        _check_intervals(iv, s, q.device)
        backend = resolve_backend(backend, q.device, q.dtype)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            out, lse = _IntervalAttention.apply(q, k, v, iv, float(scale), float(dropout_p), seed, backend, opts, s)
        else:
            out, lse = _forward(q, k, v, iv, float(scale), float(dropout_p), seed, backend, opts, s)
    return (out, lse.float()) if return_lse else out


def try_interval_attention(q, k, v, mask, s: Shapes, scale: float, dropout_p: float, dropout_seed, score_mod,
                           backend: str, align, return_lse: bool, kernel_options=None):
    """The result of the device path, or None where it does not apply (the caller then takes the
    block-layout path): ``mask`` a Mask with one ``document(ids)`` in an ``&`` of interval leaves
    (:func:`~blocksparse_fa.compiler.device_intervals.interval_spec`), no score modifier, real
    tensors (not meta). Inputs as :func:`interval_attention`'s (validated, one head dim); ``align``
    None is ``"bottom_right"``."""
    if score_mod is not None or q.device.type == "meta":
        return None
    spec = interval_spec(mask, s.Lq, s.Lk, "bottom_right" if align is None else align)
    if spec is None:
        return None
    if spec.zb not in (1, s.B) or spec.zh not in (1, s.H):
        raise ValueError(f"mask batch shape {(spec.zb, spec.zh)} does not fit (B, H) = ({s.B}, {s.H})")
    return interval_attention(q, k, v, spec.bounds(q.device), scale, backend, return_lse, dropout_p, dropout_seed,
                              kernel_options)
