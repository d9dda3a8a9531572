"""Triton backend: launches the kernels and wires them into autograd."""

from __future__ import annotations


import torch
import triton
from triton.runtime.errors import OutOfResources

from ..compiler.layout import BlockLayout
from ..kernels import _attn_bwd, _attn_bwd_preprocess, _attn_fwd, _attn_fwd_combine, _sum_partials
from ..kernels.merge import _merge_residue
from ..kernels.config import (TileConfig, bwd_configs, check_layout_block, fwd_config, head_dim_pad, short_rows,
                             short_partial_rows, PARTIAL_HEAVY)
from ..kernels.predicate import Payload, build_payload
from ..kernels.schedule import WorkList, build_worklist, hw_slots, worklists_enabled
from .dropout import dropout_threshold, seed_words
from .validate import Shapes

__all__ = ["triton_forward", "triton_backward", "triton_attention", "set_fused_backward", "set_lut_policy",
           "set_forward_options", "merge_residue", "backward_delta"]

_LOG2E = 1.4426950408889634


def _device_state(layout: BlockLayout, device: torch.device):
    """Kernel LUTs and predicate payload for ``device``, cached on the layout."""
    cache = layout.__dict__.setdefault("_triton_state", {})
    key = device
    st = cache.get(key)
    if st is None:
        rows, cols = layout.kernel_luts()

        def prep(t):
            t = t.to(device)
            return t if t.numel() else torch.zeros(1, dtype=torch.int32, device=device)

        contig = (_contiguous_lists(rows.full_ptr, rows.full_idx), _contiguous_lists(cols.full_ptr, cols.full_idx))
        rows = tuple(prep(t) for t in (rows.full_ptr, rows.full_idx, rows.part_ptr, rows.part_idx))
        cols = tuple(prep(t) for t in (cols.full_ptr, cols.full_idx, cols.part_ptr, cols.part_idx))
        st = (rows, cols, build_payload(layout, device), contig)
        cache[key] = st
    return st


def _contiguous_lists(ptr: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether every CSR list ``idx[ptr[r]:ptr[r+1]]`` holds consecutive block indices (dense,
    causal, sliding windows, documents: the unmasked blocks of a row or column form one run)."""
    ptr, idx = ptr.cpu().long(), idx.cpu().long()
    if idx.numel() < 2:
        return True
    step_ok = (idx[1:] - idx[:-1]) == 1
    starts = torch.zeros(idx.numel(), dtype=torch.bool)
    inner = ptr[(ptr > 0) & (ptr < idx.numel())]
    starts[inner] = True  # entry j starts a new list: no step from j - 1 to j is required
    return bool((step_ok | starts[1:]).all())


# How each kernel loop finds the block index of a LUT entry (``kernels/common.lut_first``).
# Chosen from an A/B on the H100 (benchmarks/ab_variants.py, NOTES.md v7): index arithmetic on
# contiguous unmasked lists speeds up the forward (sliding 0.456 -> 0.429 ms, causal 2.54 -> 2.44)
# and dQ; prefetching the other lists one entry ahead speeds up BigBird's forward (0.629 -> 0.594).
# dK/dV keeps the LUT load: the extra live registers of the other modes add spills there.
_LUT_POLICY = {"fwd_arith": True, "fwd_other": "prefetch", "dq_arith": True, "dkdv_arith": False}


def set_lut_policy(**kw) -> None:
    """Change how the kernels read LUT indices (benchmarks compare the modes): ``fwd_arith``,
    ``dq_arith``, ``dkdv_arith`` (bool: index arithmetic on contiguous unmasked lists) and
    ``fwd_other`` (``"load"`` or ``"prefetch"``: the forward's other lists)."""
    for k, v in kw.items():
        if k not in _LUT_POLICY:
            raise ValueError(f"unknown LUT policy {k!r}; expected one of {sorted(_LUT_POLICY)}")
        _LUT_POLICY[k] = v


def _lut_modes(contig: tuple[bool, bool]) -> dict:
    """Constexpr LUT modes of the forward (``FULL_LUT``/``PART_LUT``) and backward (``ROW_LUT``
    for dQ, ``COL_LUT`` for dK/dV) for a layout whose (row, column) unmasked lists are contiguous."""
    other = _LUT_POLICY["fwd_other"]
    return dict(FULL_LUT="arith" if contig[0] and _LUT_POLICY["fwd_arith"] else other, PART_LUT=other,
                ROW_LUT="arith" if contig[0] and _LUT_POLICY["dq_arith"] else "load",
                COL_LUT="arith" if contig[1] and _LUT_POLICY["dkdv_arith"] else "load")


# Forward loop options on Hopper (benchmarks/ab_variants.py compares them): K/V tiles through
# tensor descriptors (TMA) instead of pointer loads, and warp specialisation of the unmasked loop.
_FWD_OPTS = {"kv_desc": False, "warp_specialize": False, "masked_stages": None}


def set_forward_options(**kw) -> None:
    """``kv_desc`` (bool: load K/V through tensor descriptors where the device and strides allow),
    ``warp_specialize`` (bool, needs ``kv_desc``) and ``masked_stages`` (int or None: pipelining
    depth of the masked loop). All off by default: none was faster on the H100 (NOTES.md v9)."""
    for k, v in kw.items():
        if k not in _FWD_OPTS:
            raise ValueError(f"unknown forward option {k!r}; expected one of {sorted(_FWD_OPTS)}")
        _FWD_OPTS[k] = v


def _tma_ok(*ts: torch.Tensor) -> bool:
    """Tensor descriptors need a Hopper-class GPU, 16-byte aligned bases and 16-byte row strides."""
    if not all(t.is_cuda for t in ts) or torch.cuda.get_device_capability(ts[0].device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(-2) * t.element_size()) % 16 == 0
               and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1]) for t in ts)


_ALLOCATOR_SET = [False]


def _ensure_tma_allocator(device: torch.device) -> None:
    """Descriptors built inside a kernel need global scratch from Triton's allocator hook."""
    if not _ALLOCATOR_SET[0]:
        # the device type only: "cuda" is the current device when the kernel launches
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device.type))
        _ALLOCATOR_SET[0] = True


def _tile_class(layout: BlockLayout) -> tuple[bool, bool, bool]:
    """``(band, short_partial, partial_heavy)`` of a layout's shape (``kernels/config.py``), cached
    on the layout: the launchers ask on every call."""
    cls = layout.__dict__.get("_tile_class")
    if cls is None:
        mean_row = layout.n_nonempty / max(1, layout._segs.n_rows)
        pf = layout.partial_fraction
        cls = (short_rows(mean_row, pf), short_partial_rows(mean_row, pf),
               layout.n_nonempty > 0 and pf >= PARTIAL_HEAVY)
        layout.__dict__["_tile_class"] = cls
    return cls


def _is_band(layout: BlockLayout) -> bool:
    """Band-like layout (few, mostly full blocks per row): picks the band tile tables."""
    return _tile_class(layout)[0]


def _is_short_partial(layout: BlockLayout) -> bool:
    """Short rows, mostly partial (narrow windows, Longformer, BigBird): their own forward tiles."""
    return _tile_class(layout)[1]


def _is_partial_heavy(layout: BlockLayout) -> bool:
    """At least ``PARTIAL_HEAVY`` of the visited blocks are partial: picks the spill-free backward tiles."""
    return _tile_class(layout)[2]


def _layout_strides(layout: BlockLayout):
    bm, hm = layout.batch_shape or (1, 1)
    return (hm if bm > 1 else 0), (1 if hm > 1 else 0)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _dot_precision(dtype, device) -> str:
    if device.type == "cpu" and dtype == torch.bfloat16:
        return "upcast"  # the interpreter's bf16 tl.dot is wrong; multiply in fp32 there
    return "ieee" if dtype == torch.float32 else "tf32"


def _masked_stages(pay: Payload, cfg) -> int:
    """Pipelining depth of the masked loop: a predicate that gathers a whole tile of words would
    multiply shared memory by the stage count, so such loops are not pipelined."""
    return 1 if pay.gathers else cfg.num_stages


_NO_DROPOUT = (0, 0, 0, 1.0)


def _dropout_args(dropout_p: float, seed: int):
    if dropout_p == 0.0:
        return _NO_DROPOUT
    s0, s1 = seed_words(seed)
    return s0, s1, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p)


_SPLIT_OVERRIDE: dict = {}


def set_split_chunk(chunk: float | None) -> None:
    """Force the work-list chunk (tests exercise split tiles at tiny sizes); None restores the default."""
    if chunk is None:
        _SPLIT_OVERRIDE.clear()
    else:
        _SPLIT_OVERRIDE["chunk"] = chunk


_FALLBACK: dict = {}


def _shrink(cfg: TileConfig) -> TileConfig | None:
    """Next smaller config: fewer stages first, then the larger tile side halved (>= 16)."""
    if cfg.num_stages > 1:
        return TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages - 1)
    if max(cfg.block_m, cfg.block_n) <= 16:
        return None
    if cfg.block_n >= cfg.block_m:
        return TileConfig(cfg.block_m, cfg.block_n // 2, cfg.num_warps, 2)
    return TileConfig(cfg.block_m // 2, cfg.block_n, cfg.num_warps, 2)


def _with_fallback(kernel: str, cfg: TileConfig, key: tuple, launch) -> None:
    """Launch with ``cfg``; if the compiled kernel needs more shared memory than the GPU has, retry
    with smaller configs and remember the one that fits (per kernel, requested config, head dim, dtype,
    layout block and whether the predicate gathers words)."""
    fkey = (kernel, cfg, *key)
    cfg = _FALLBACK.get(fkey, cfg)
    while True:
        try:
            launch(cfg)
            return
        except OutOfResources:
            smaller = _shrink(cfg)
            if smaller is None:
                raise
            cfg = smaller
            _FALLBACK[fkey] = cfg


def _worklist(layout: BlockLayout, side: str, tile: int, n_heads: int, device) -> WorkList | None:
    """Cached work list for the row side (forward, dQ) or column side (dK/dV) at this tile size."""
    if not worklists_enabled(layout):
        return None
    force = _SPLIT_OVERRIDE.get("chunk")
    key = (side, tile, n_heads, device, force)
    cache = layout.__dict__.setdefault("_worklists", {})
    wl = cache.get(key)
    if wl is None:
        rows, cols = layout.kernel_luts()
        lut = rows if side == "row" else cols
        lb = layout.block_size[0] if side == "row" else layout.block_size[1]
        length = layout.q_len if side == "row" else layout.kv_len
        wl = build_worklist(lut.full_ptr.cpu().numpy(), lut.part_ptr.cpu().numpy(), lb // tile, -(-length // tile),
                            n_heads, hw_slots(device), device=device, force_chunk=force)
        cache[key] = wl
    return wl


_PLACEHOLDERS: dict = {}


def _placeholder(dtype: torch.dtype, device) -> torch.Tensor:
    """A cached one-element tensor for pointer arguments that a launch never touches (the work
    list without work lists, partial buffers without split tiles): no allocation, no memset per call."""
    key = (dtype, device)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(1, dtype=dtype, device=device)
    return t


def _partials(n_rows: int, width: int | None, device) -> torch.Tensor:
    """float32 buffer of split-tile partial results (``n_rows`` rows of ``width``), or the placeholder."""
    if n_rows == 0:
        return _placeholder(torch.float32, device)
    return torch.empty((n_rows, width) if width else (n_rows,), dtype=torch.float32, device=device)


def _grid_and_work(wl: WorkList | None, n_tiles: int, n_bh: int, device):
    if wl is None:
        return (n_tiles, n_bh), _placeholder(torch.int32, device), False
    return (wl.n_items, n_bh), wl.work, True


def triton_forward(q, k, v, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int):
    """Forward kernel; returns ``out (B, H, Lq, D)`` and ``lse (B, H, Lq)`` float32."""
    lbm, lbn = layout.block_size
    check_layout_block(lbm, lbn)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    rows, _, pay, contig = _device_state(layout, q.device)
    d_pad = head_dim_pad(s.D)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((s.B, s.H, s.Lq), dtype=torch.float32, device=q.device)
    lzb, lzh = _layout_strides(layout)

    def launch(cfg):
        _fwd_launch(q, k, v, out, lse, layout, s, scale, dropout_p, seed, rows, pay, d_pad, lzb, lzh, cfg, contig)

    _with_fallback("fwd", fwd_config(d_pad, q.dtype, lbm, lbn, _is_band(layout), _is_short_partial(layout)),
                   (d_pad, q.dtype, lbm, lbn, pay.gathers), launch)
    return out, lse


def _fwd_launch(q, k, v, out, lse, layout, s, scale, dropout_p, seed, rows, pay, d_pad, lzb, lzh, cfg, contig):
    lbm, lbn = layout.block_size
    n_tiles = triton.cdiv(s.Lq, cfg.block_m)
    wl = _worklist(layout, "row", cfg.block_m, s.B * s.H, q.device)
    grid, work, use_work = _grid_and_work(wl, n_tiles, s.B * s.H, q.device)
    nslot = wl.n_slots if wl is not None else 0
    modes = _lut_modes(contig)
    opart = _partials(s.B * s.H * nslot * cfg.block_m, d_pad, q.device)
    lpart = _partials(s.B * s.H * nslot * cfg.block_m, None, q.device)
    kv_desc = _FWD_OPTS["kv_desc"] and _tma_ok(k, v)
    if kv_desc:
        _ensure_tma_allocator(q.device)
    masked_stages = _FWD_OPTS["masked_stages"] or _masked_stages(pay, cfg)
    _attn_fwd[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        *rows, pay.params, pay.aux, work, opart, lpart, nslot,
        s.H, s.G, lzb, lzh, -(-s.Lq // lbm), s.Lq, s.Lk, layout.q_offset, scale * _LOG2E,
        *_dropout_args(dropout_p, seed),
        PREDICATE=pay.fn, HAS_DROPOUT=dropout_p > 0.0, USE_WORK=use_work, HEAD_DIM=s.D, HEAD_DIM_PAD=d_pad,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LAYOUT_BM=lbm, LAYOUT_BN=lbn,
        DOT_PRECISION=_dot_precision(q.dtype, q.device), STAGES=cfg.num_stages,
        MASKED_STAGES=masked_stages, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, FULL_LUT=modes["FULL_LUT"], PART_LUT=modes["PART_LUT"],
        KV_DESC=kv_desc, WARP_SPEC=kv_desc and _FWD_OPTS["warp_specialize"],
    )
    if nslot:
        _attn_fwd_combine[(wl.n_combine, s.B * s.H)](
            out, lse, opart, lpart, wl.combine, nslot, out.stride(0), out.stride(1), out.stride(2), s.H, s.Lq,
            HEAD_DIM=s.D, HEAD_DIM_PAD=d_pad, BLOCK_M=cfg.block_m, num_warps=4,
        )


def backward_delta(out, dout, lse, s: Shapes, dlse=None) -> torch.Tensor:
    """``delta = rowsum(dO ∘ O) − dlse`` ``(B, H, Lq)`` float32: the backward's per-row term
    (``dlse``, the gradient of the returned logsumexp, enters because ``∂lse/∂s = p``)."""
    out, dout = _last_dim_contiguous(out), _last_dim_contiguous(dout)
    delta = torch.empty((s.B, s.H, s.Lq), dtype=torch.float32, device=out.device)
    pre_m = 64
    _attn_bwd_preprocess[(triton.cdiv(s.Lq, pre_m), s.B * s.H)](
        out, dout, delta, out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        s.H, s.Lq, HEAD_DIM=s.D, HEAD_DIM_PAD=head_dim_pad(s.D), BLOCK_M=pre_m,
    )
    if dlse is not None:
        delta.sub_(torch.where(torch.isinf(lse), torch.zeros_like(lse), dlse.float()))
    return delta


def triton_backward(q, k, v, out, lse, dout, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int,
                    dlse=None, delta=None, accumulate=None):
    """Backward kernels; returns ``(dq, dk, dv)`` in the inputs' dtype. ``dlse`` (gradient of the
    returned logsumexp, optional) enters as ``delta - dlse``: ``∂lse/∂s = p``.

    ``delta``: precomputed :func:`backward_delta` (then ``out`` and ``dlse`` are not read).
    ``accumulate``: ``(dq, dk, dv)`` tensors (any strides) to add this layout's gradients to; they
    are returned."""
    lbm, lbn = layout.block_size
    q, k, v, dout = (_last_dim_contiguous(t) for t in (q, k, v, dout))
    rows, cols, pay, contig = _device_state(layout, q.device)
    d_pad = head_dim_pad(s.D)
    cfg_kv, cfg_q = bwd_configs(d_pad, q.dtype, lbm, lbn, _is_band(layout), _is_partial_heavy(layout))
    dev = q.device
    if delta is None:
        delta = backward_delta(out, dout, lse, s, dlse)
    if accumulate is None:
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    else:
        dq, dk, dv = accumulate
        for name, g, t in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            if g.shape != t.shape or g.dtype != t.dtype or g.stride(-1) != 1:
                raise ValueError(f"accumulate: {name} must have shape {tuple(t.shape)}, dtype {t.dtype} and a "
                                 f"contiguous last dim, got {tuple(g.shape)}, {g.dtype}, strides {g.stride()}")
    lzb, lzh = _layout_strides(layout)
    drop = _dropout_args(dropout_p, seed)
    modes = _lut_modes(contig)
    common = dict(PREDICATE=pay.fn, HAS_DROPOUT=dropout_p > 0.0, HEAD_DIM=s.D, HEAD_DIM_PAD=d_pad,
                  LAYOUT_BM=lbm, LAYOUT_BN=lbn, DOT_PRECISION=_dot_precision(q.dtype, dev),
                  ROW_LUT=modes["ROW_LUT"], COL_LUT=modes["COL_LUT"], ACCUMULATE=accumulate is not None)
    qkv_strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2))

    def launch(cfg_kv, cfg_q, run_kv, run_q):
        _bwd_launch(q, k, v, dout, dq, dk, dv, lse, delta, layout, s, scale, rows, cols, pay, d_pad, lzb, lzh,
                    drop, common, qkv_strides, cfg_kv, cfg_q, run_kv, run_q)

    key = (d_pad, q.dtype, lbm, lbn, pay.gathers)
    fkey = ("bwd_fused", cfg_kv, cfg_q, *key)
    if _FUSED_BWD["on"] and cfg_kv.num_warps == cfg_q.num_warps and _FALLBACK.get(fkey, True):
        try:
            launch(cfg_kv, cfg_q, True, True)
            return dq, dk, dv
        except OutOfResources:
            _FALLBACK[fkey] = False  # the two programs do not fit one kernel: launch them separately
    _with_fallback("dkdv", cfg_kv, key, lambda c: launch(c, cfg_q, True, False))
    _with_fallback("dq", cfg_q, key, lambda c: launch(cfg_kv, c, False, True))
    return dq, dk, dv


_FUSED_BWD = {"on": True, "head_major": None}


def set_fused_backward(on: bool, head_major: bool | None = None) -> None:
    """Run dK/dV and dQ in one launch (default) or in two (benchmarks and tests compare both).

    ``head_major`` orders the one-launch grid head by head (see ``_attn_bwd``): a head's Q, K, V
    and dO are then read from DRAM once instead of twice. ``None`` (default) picks it when no tile
    is split by the work lists; layouts with split tiles (global tokens) keep every dK/dV program
    first, so the heavy ones of all heads start early (measured, benchmarks/NOTES.md v7)."""
    _FUSED_BWD["on"] = bool(on)
    _FUSED_BWD["head_major"] = head_major


def _bwd_launch(q, k, v, dout, dq, dk, dv, lse, delta, layout, s, scale, rows, cols, pay, d_pad, lzb, lzh,
                drop, common, qkv_strides, cfg_kv, cfg_q, run_kv=True, run_q=True):
    """``_attn_bwd``: the dK/dV programs (``run_kv``), then the dQ programs (``run_q``), on one 1-D
    grid; then the sums of split tiles. Launch warps: the dK/dV config's, or dQ's when it runs alone."""
    dev = q.device
    lbm, lbn = layout.block_size
    wl_kv = _worklist(layout, "col", cfg_kv.block_n, s.B * s.Hkv, dev)
    wl_q = _worklist(layout, "row", cfg_q.block_m, s.B * s.H, dev)
    _, kv_work, use_work = _grid_and_work(wl_kv, 0, 0, dev)
    _, q_work, _ = _grid_and_work(wl_q, 0, 0, dev)
    n_kv_items = wl_kv.n_items if wl_kv is not None else triton.cdiv(s.Lk, cfg_kv.block_n)
    n_q_items = wl_q.n_items if wl_q is not None else triton.cdiv(s.Lq, cfg_q.block_m)
    n_kv_progs = n_kv_items * s.B * s.Hkv if run_kv else 0
    n_progs = n_kv_progs + (n_q_items * s.B * s.H if run_q else 0)
    kv_nslot = wl_kv.n_slots if wl_kv is not None and run_kv else 0
    q_nslot = wl_q.n_slots if wl_q is not None and run_q else 0
    head_major = _FUSED_BWD["head_major"]
    if head_major is None:
        head_major = not (kv_nslot or q_nslot)
    dkpart = _partials(s.B * s.Hkv * kv_nslot * cfg_kv.block_n, d_pad, dev)
    dvpart = _partials(s.B * s.Hkv * kv_nslot * cfg_kv.block_n, d_pad, dev)
    dqpart = _partials(s.B * s.H * q_nslot * cfg_q.block_m, d_pad, dev)
    _attn_bwd[(n_progs,)](
        q, k, v, dout, dq, dk, dv, lse, delta, *qkv_strides,
        dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        *rows, *cols, pay.params, pay.aux, kv_work, q_work, dkpart, dvpart, dqpart, kv_nslot, q_nslot,
        n_kv_items, n_kv_progs, n_q_items, int(head_major),
        s.H, s.G, lzb, lzh, -(-s.Lq // lbm), -(-s.Lk // lbn), s.Lq, s.Lk, layout.q_offset, scale * _LOG2E, scale, *drop,
        USE_WORK=use_work, KV_BLOCK_M=cfg_kv.block_m, KV_BLOCK_N=cfg_kv.block_n,
        Q_BLOCK_M=cfg_q.block_m, Q_BLOCK_N=cfg_q.block_n,
        KV_STAGES=cfg_kv.num_stages, KV_MASKED_STAGES=_masked_stages(pay, cfg_kv),
        Q_STAGES=cfg_q.num_stages, Q_MASKED_STAGES=_masked_stages(pay, cfg_q), RUN_KV=run_kv, RUN_Q=run_q,
        num_warps=cfg_kv.num_warps if run_kv else cfg_q.num_warps,
        num_stages=max(cfg_kv.num_stages if run_kv else 1, cfg_q.num_stages if run_q else 1), **common,
    )
    if kv_nslot:
        for t, part in ((dk, dkpart), (dv, dvpart)):
            _sum_partials[(wl_kv.n_combine, s.B * s.Hkv)](
                t, part, wl_kv.combine, kv_nslot, t.stride(0), t.stride(1), t.stride(2), s.Hkv, s.Lk,
                HEAD_DIM=s.D, HEAD_DIM_PAD=d_pad, BLOCK=cfg_kv.block_n, ACCUMULATE=common["ACCUMULATE"], num_warps=4)
    if q_nslot:
        _sum_partials[(wl_q.n_combine, s.B * s.H)](
            dq, dqpart, wl_q.combine, q_nslot, dq.stride(0), dq.stride(1), dq.stride(2), s.H, s.Lq,
            HEAD_DIM=s.D, HEAD_DIM_PAD=d_pad, BLOCK=cfg_q.block_m, ACCUMULATE=common["ACCUMULATE"], num_warps=4)


def merge_residue(out, lse, o2, l2, stride: int) -> None:
    """Merge a part computed on residue-class views (``o2 (B·H, S, M, D)``, ``l2 (B·H, S, M)``) into
    ``out (B, H, N, D)`` / ``lse (B, H, N)`` in place (``kernels/merge.py``)."""
    B, H, N, D = out.shape
    assert out.is_contiguous() and o2.is_contiguous() and lse.is_contiguous() and l2.is_contiguous()
    block = 64
    _merge_residue[(triton.cdiv(N, block), B * H)](out, lse, o2, l2, N, stride, N // stride, HEAD_DIM=D,
                                                   HEAD_DIM_PAD=head_dim_pad(D), BLOCK=block, num_warps=4)


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, shapes, scale, dropout_p, seed):
        ctx.set_materialize_grads(False)  # an unused LSE (or output) brings no gradient work
        out, lse = triton_forward(q, k, v, layout, shapes, scale, dropout_p, seed)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, shapes, scale, dropout_p, seed)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = triton_backward(q, k, v, out, lse, dout, *ctx.args, dlse=dlse)
        return dq, dk, dv, None, None, None, None, None


def triton_attention(q, k, v, layout: BlockLayout, shapes: Shapes, scale: float, dropout_p: float, seed: int):
    """Block-sparse attention through the Triton kernels; returns ``(out, lse)``."""
    return _TritonAttention.apply(q, k, v, layout, shapes, scale, dropout_p, seed)
