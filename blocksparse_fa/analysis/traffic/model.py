"""``traffic_model``: the model's entry point (all kernels, dense FlashAttention, the trace policy)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import gluon as _gluon
from . import params as _params
from .geometry import _DenseLayout, _Geometry
from .kernels import _check_tiles, _dkdv_kernel, _preprocess_kernel, _row_kernel
from .params import TraceTooLargeError, TrafficParams
from .report import StandardTraffic, TrafficReport
from .trace import _trace_backward, _trace_forward, _with_trace

__all__ = ["traffic_model"]


def traffic_model(layout, params: TrafficParams | None = None, *, compare: bool = True, progress: bool = False,
                  **overrides) -> TrafficReport:
    """Predict the bytes each kernel moves for ``layout`` (a :class:`BlockLayout`).

    Args:
        layout: the compiled mask.
        params: problem and machine (:class:`TrafficParams`); keyword ``overrides`` replace fields
            (``heads=8, kv_heads=2, head_dim=64, dtype="fp16", l2_bytes=..., tiles=TileSizes(...)``).
        compare: also model dense FlashAttention (the all-full layout of the same shape) for the
            ratios (costs a second model evaluation).
        progress: show progress bars (tqdm, on stderr, only where it is a terminal) while
            ``policy="trace"`` simulates the loads (seconds to a minute at long lengths).

    Returns:
        A :class:`TrafficReport`.
    """
    p = replace(params or TrafficParams(), **overrides)
    p.check()
    rep = _model(layout, p, progress, "")
    if compare:
        dense = _DenseLayout(rep.q_len, rep.kv_len, *rep.block_size)
        try:
            rep.dense = _model(dense, p, progress, "dense FA ")
        except TraceTooLargeError:  # dense FA at this size: the wave model (its rows say so)
            rep.dense = _model(dense, replace(p, policy="lru"), progress, "dense FA ")
    return rep


def _model(layout, p: TrafficParams, progress: bool, label: str) -> TrafficReport:
    """The report of one layout (``label`` names its progress bars)."""
    geo = _Geometry(layout)
    geo.check_batch(p.batch, p.heads)
    fc, bc = _gluon.choices(layout, p) if p.kernels == "auto" else (None, None)
    gl_fwd = fc is not None and fc.family == "gluon"
    gl_bwd = bc is not None and bc.family == "gluon"
    if not (gl_fwd and gl_bwd):  # the Triton kernels' tiles (the Gluon kernels bring their own)
        _check_tiles(geo, p.tiles)
    D, e = p.head_dim, p.elem
    row_lut_bytes = int(layout.row_lut.nbytes)
    col_lut_bytes = int(layout.col_lut.nbytes)
    G = p.heads // p.hkv
    mult = np.zeros(geo.n_inst, dtype=np.int64)
    for b in range(p.batch):
        for h in range(p.heads):
            mult[geo.instance(b, h)] += 1
    visited = int((mult * geo.row_cnt.sum(axis=1)).sum())
    if p.policy == "trace":
        refs = _trace_references(geo, p, visited)
        limit = _params.TRACE_MAX_REFERENCES
        if refs > limit:
            raise TraceTooLargeError(
                f"policy='trace' would simulate about {refs:.2e} loads (limit TRACE_MAX_REFERENCES = "
                f"{limit:.1e}, about a minute); use policy='lru' (the wave model) for this size")
    extra: list = []
    if gl_fwd:
        fwd = _gluon.forward(layout, p, fc.mode, progress, label)
    else:
        fwd = _row_kernel("fwd", geo, p, p.tiles.fwd_block_m, q_side_loads={"Q": D * e},
                          q_side_stores={"O": D * e, "LSE": 4}, lut_bytes=row_lut_bytes)
        if p.policy == "trace":
            fwd = _with_trace(fwd, _trace_forward(geo, p, progress, f"trace {label}")["fwd"], row_lut_bytes)
    if gl_bwd:
        pre, dkdv, dq, *extra = _gluon.backward(layout, p, bc.mode, progress, label)
    else:
        pre = _preprocess_kernel(geo, p, lse2=True)  # the block backward's base-2 logsumexp
        dkdv = _dkdv_kernel(geo, p, col_lut_bytes)
        dq = _row_kernel("bwd_dq", geo, p, p.tiles.dq_block_m,
                         q_side_loads={"Q": D * e, "dO": D * e, "LSE+delta": 8},
                         q_side_stores={"dQ": D * e}, lut_bytes=row_lut_bytes)
        group_bytes = G * geo.q_len * (2 * D * e + 8) + 2 * geo.kv_len * D * e
        if p.policy == "trace":
            tr = _trace_backward(geo, p, progress, f"trace {label}")
            dkdv = _with_trace(dkdv, tr["bwd_dkdv"], col_lut_bytes)
            dq = _with_trace(dq, tr["bwd_dq"], row_lut_bytes)
        elif p.bwd_fused and p.bwd_order == "head_major" and group_bytes <= p.l2_bytes:
            # the dQ programs of a head follow its dK/dV programs: their inputs are still in L2
            served = dq.compulsory_read_bytes - row_lut_bytes
            dq = replace(dq, dram_read_bytes=dq.dram_read_bytes - served, compulsory_read_bytes=row_lut_bytes)
    choice = (str(fc) if fc is not None else "triton:blocks", str(bc) if bc is not None else "triton:blocks")
    return TrafficReport(
        mask=str(layout.mask), q_len=geo.q_len, kv_len=geo.kv_len, block_size=(geo.bm, geo.bn),
        density=float(layout.density), visited_blocks=visited, params=p, forward=fwd, bwd_preprocess=pre,
        bwd_dkdv=dkdv, bwd_dq=dq, standard=StandardTraffic.compute(geo.q_len, geo.kv_len, p),
        choice=choice, extra=tuple(extra))


def _trace_references(geo: _Geometry, p: TrafficParams, visited: int) -> int:
    """About how many object loads ``policy="trace"`` simulates: per visited block one K+V load in
    the forward and the sub-tiles dK/dV and dQ load in the backward."""
    per = 1 + max(1, geo.bm // p.tiles.dq_block_m) + max(1, geo.bn // p.tiles.dkdv_block_n)
    return int(visited) * per
