"""Triton backend: launches the kernels that :mod:`blocksparse_fa.ops.select` chooses.

Every option comes with the call (:class:`~blocksparse_fa.ops.options.KernelOptions`); launch plans
are cached per layout, device, dtype, head counts and options value."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import threading

import torch
import triton
from triton.runtime.errors import OutOfResources

from ..compiler.cache import LRUCache
from ..compiler.finer import pick_list_block
from ..compiler.intervals import row_interval, tile_ranges
from ..compiler.layout import BlockLayout
from ..kernels import _attn_bwd, _attn_bwd_preprocess, _attn_fwd, _attn_fwd_combine, _sum_partials
from ..kernels.backward_atomic import _attn_bwd_atomic, _dq_finish
from ..kernels.forward_ws import _attn_fwd_ws
from ..kernels import forward_gluon as _fg
from ..kernels import backward_gluon as _bg
from ..kernels import heads as _heads
from ..kernels.merge import _merge_residue
from ..kernels.config import atomic_bwd_config, bwd_configs, check_layout_block, fwd_config, head_dim_pad
from ..kernels.predicate import Payload, build_payload
from ..kernels.schedule import WorkList, build_worklist, hw_slots, worklists_enabled
from .dropout import dropout_threshold, seed_words
from ..mask.score import (ALIBI, BIAS, BIAS_KEYS_BROADCAST, BIAS_ROWS_BROADCAST, DBIAS, DSLOPES, SOFTCAP,
                          device_copy)
from . import call_memo, select
from .launcher import Launch
from .options import (DEFAULT_OPTIONS, GluonBwdConfig, GluonConfig, KernelOptions,
                      TileConfig)
from .validate import Shapes

__all__ = ["triton_forward", "triton_backward", "GluonConfig", "GluonBwdConfig", "merge_residue", "backward_delta"]

_LOG2E = 1.4426950408889634


def _source(layout):
    """The layout a shard was cut from (``compiler/shard.py``), else the layout itself."""
    return getattr(layout, "source", None) or layout


def _payload(layout: BlockLayout, device, opts: KernelOptions = DEFAULT_OPTIONS) -> Payload:
    """Predicate payload of a layout: a shard's comes from its source layout (global lengths, read
    with global positions) and is shared by every shard of it."""
    src = _source(layout)
    key = ("payload", device, opts.document_runs)
    pay = src.cache.get(key)
    if pay is None:
        pay = src.cache[key] = build_payload(src, device, opts.document_runs)
    return pay


def _positions(layout: BlockLayout, device):
    """``(QPOS, KPOS)`` int32 device tensors of a shard (global index of each local block's first
    row / key), or None for a layout that is not a shard."""
    pos = getattr(layout, "positions", None)
    if pos is None:
        return None
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device) if len(a) else \
        torch.zeros(1, dtype=torch.int32, device=device)  # noqa: E731
    return to(pos.q_start), to(pos.k_start)


def _device_state(layout: BlockLayout, device: torch.device, opts: KernelOptions, row_list: int | None = None,
                  col_list: int | None = None):
    """``(rows, cols, payload, modes, positions)``: kernel tables, predicate payload and block
    position tables (shards only, else None) on ``device`` and the LUT modes of the kernel loops,
    built once and kept in the layout's cache. ``row_list``/``col_list``: the tables' list blocks
    (keys per row entry, queries per column entry; default the layout block, see
    :func:`_list_block`)."""
    key = ("triton", device, opts.row_arith, opts.col_arith, opts.fwd_other, opts.document_runs, row_list, col_list)
    st = layout.cache.get(key)
    if st is None:
        rows, cols = layout.kernel_tables(row_runs=opts.row_arith, col_runs=opts.col_arith,
                                          row_list=row_list, col_list=col_list)

        def prep(a):
            t = torch.from_numpy(a).to(device)
            return t if t.numel() else torch.zeros(1, dtype=torch.int32, device=device)

        other = opts.fwd_other
        modes = dict(FULL_LUT="arith" if rows.runs else other, PART_LUT="step" if rows.part_step else other,
                     ROW_LUT="arith" if rows.runs else "load", COL_LUT="arith" if cols.runs else "load",
                     ROW_PART_LUT="step" if rows.part_step else "load", COL_PART_LUT="step" if cols.part_step else "load")
        st = (tuple(prep(a) for a in (rows.full_ptr, rows.full_idx, rows.part_ptr, rows.part_idx)),
              tuple(prep(a) for a in (cols.full_ptr, cols.full_idx, cols.part_ptr, cols.part_idx)),
              _payload(layout, device, opts), modes, _positions(layout, device))
        layout.cache[key] = st
    return st


# How each kernel loop finds the block index of a LUT entry (``kernels/common.lut_first``), the
# ``row_arith``/``col_arith``/``fwd_other`` kernel options. Chosen from an A/B on the H100
# (benchmarks/experiments/ab_variants.py, NOTES.md v7): index arithmetic on lists that are runs of
# consecutive blocks speeds up the forward (sliding 0.456 -> 0.429 ms, causal 2.54 -> 2.44) and dQ;
# prefetching the other lists one entry ahead speeds up BigBird's forward (0.629 -> 0.594). dK/dV
# reads listed indices unless the listed column tables would be large (``COL_LIST_LIMIT``): the
# extra live registers of index arithmetic add spills there.


_LAUNCHERS: dict = {}
# persistent Gluon kernels on interval layouts run one tile of every head at a time, heaviest
# first (H100: documents 0.49 vs 0.58 ms forward at 16K, windows within 2 %), except where every
# head's key window no longer fits in L2 (select.tile_major_deal). None: that rule;
# True / False: tile-major / head by head everywhere (experiments)
_M_MAJOR = None


def _launch(fn, grid, args: tuple, n_key: int, device, **consts) -> None:
    """``fn[grid](*args, **consts)`` through a cached :class:`~blocksparse_fa.ops.launcher.Launch`
    (Triton's Python launch path only on a new specialisation); ``n_key``: the leading arguments
    that select a compiled variant (tensors, strides, ints)."""
    key = (fn, tuple(consts.items()), device)
    launch = _LAUNCHERS.get(key)
    if launch is None:
        launch = _LAUNCHERS[key] = Launch(fn, consts, n_key, device)
    launch(grid, *args)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()`` for a ``t`` that is not: a per-call copy, which a replay of the call makes
    again from its own tensor (the replay's signature holds the strides that asked for it)."""
    return call_memo.run(torch.Tensor.contiguous, t)


def _gluon_bwd_launch(q, k, v, dout, grads, lse, delta, s: Shapes, scale: float, causal: bool, atomic: bool,
                      cfg: GluonBwdConfig, layout: BlockLayout | None = None, intervals: tuple | None = None,
                      window_bytes: float | None = None, lists: bool = False, kv_work=None, q_work=None,
                      per_head_dkdv: bool = False) -> None:
    """The Gluon backward into ``grads``: the dK/dV kernel (one program per ``2·block_n`` keys and
    batch·kv head, or persistent: ``GluonBwdConfig.dkdv_persistent``), then the dQ kernel (one
    program per row tile and head, or persistent: ``GluonBwdConfig.persistent``) or, with
    ``atomic``, ``_dq_finish``
    on the fp32 buffer (zeroed, contiguous) the dK/dV kernel TMA-reduce-added dQ to. Gradients in
    the inputs' dtype go out through TMA; float32 ones (partial sums, ``grad_dtype``) are written
    from the registers (``DIRECT_STORE``; for any dtype with ``cfg.direct_store``).

    ``intervals``: the kernels' interval mode, ``(lo, hi, kv_tab, q_tab, lzb, lzh, kv_ord)``: the
    rows' intervals int32 ``(Z, Lq)``, the dK/dV and dQ tables (``compiler/device_intervals.gluon_backward_tables``:
    device intervals, or a layout's through :func:`_gluon_bwd_interval_tables`), the instance
    strides (``lzh`` 1: intervals that differ per head, which must agree within each GQA group:
    the dK/dV program of kv head ``hk`` walks its group's query heads with head ``hk·G``'s table)
    and the key tiles
    heaviest first (``device_intervals.key_tile_order``; read by the persistent dK/dV kernel).
    ``window_bytes``: K/V bytes of every head's key window, from which persistent interval items go
    head by head (:func:`~blocksparse_fa.ops.select.tile_major_deal`; None: tile-major). ``lists``:
    ``intervals`` holds the list mode's tables (``compiler/block_lists.py``: the tiles' blocks are
    listed, not ranges). ``kv_work``: the host's ``(work per key tile (Z, n_prog), the key tiles
    heaviest first (Z, n_prog))`` (numpy; ``kv_ord``'s host copy), from which a persistent
    tile-major dK/dV launch deals its items to the programs by :func:`_deal_table` (None: every
    grid-th item); ``q_work``: the same for the dQ kernel's row tiles (in tile order).
    ``per_head_dkdv``: with GQA, one dK/dV item per query head (``KV_REP``: it reads its group's
    K and V), into ``dk``/``dv`` of shape ``(B, H, Lk, D)``, which the caller sums per group."""
    _ensure_tma_allocator(q.device)
    ph = _placeholder(torch.int32, q.device)
    lo, hi, kv_tab, q_tab, lzb, lzh, kv_ord = intervals if intervals is not None else (ph, ph, ph, ph, 0, 0, ph)
    dq, dk, dv = grads
    qk = scale * _LOG2E
    dqa = (call_memo.zeros((s.B * s.H, s.Lq, s.D), torch.float32, q.device) if atomic
           else _placeholder(torch.float32, q.device))
    if dk.dtype != dv.dtype:
        raise ValueError(f"Gluon backward: dK and dV must share a dtype, got {dk.dtype}, {dv.dtype}")
    direct = cfg.direct_store or dk.dtype == torch.float32
    n_prog = s.Lk // (2 * cfg.block_n)
    kv_rep = s.G if per_head_dkdv else 1
    sk = Shapes(s.B, s.H, s.H, s.Lq, s.Lk, s.D) if per_head_dkdv else s  # the dK/dV kernel's items
    n_items = n_prog * sk.B * sk.Hkv
    # as the forward's: causal keeps one program per tile; the dQ buffer's rows are int32 too
    # GluonBwdConfig: persistent kernels by default on interval layouts only, and not for the
    # five-GEMM kernel (documents at 16K: 1.632 ms per tile against 1.842 persistent, NOTES.md section 5)
    auto = intervals is not None
    persistent, geo, grid = _persistent_grid((q, dout, k, v, None if direct else dk, None if direct else dv), n_items,
                                             _on(cfg.dkdv_persistent, auto and not atomic) and not causal
                                             and s.B * s.H * s.Lq < 2**31, cfg.sm_margin)
    qg, dog = q, dout
    if sk.G > 1 and not persistent:  # one descriptor over a GQA group's heads: they must be adjacent
        qg, dog = (t if t.stride(1) == s.Lq * t.stride(2) else _copy(t) for t in (q, dout))
    deal = _tile_major(persistent and intervals is not None, n_items, grid, window_bytes)
    dealt = (_deal_table(layout, *kv_work, sk.B, sk.Hkv, lzb, lzh * sk.G, grid, q.device)
             if deal and cfg.deal and kv_work is not None else None)
    rows_smem = cfg.rows_smem and not cfg.overlap
    _launch(_bg._attn_bwd_dkdv_gluon, (grid, ), (
        qg, k, v, dog, dk, dv, dqa, lse, delta, lo, hi, kv_tab, kv_ord, ph if dealt is None else dealt,
        *qg.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *dog.stride()[:3],
        *dk.stride()[:3], *dv.stride()[:3],
        sk.H, sk.G, s.Lq, s.Lk, lzb, lzh * sk.G, qk, scale, n_prog, n_items, *geo), 38, q.device, HEAD_DIM=s.D,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages, CAUSAL=causal, ATOMIC_DQ=atomic,
        PINGPONG=cfg.pingpong, OVERLAP=0 if atomic else cfg.overlap, PRODUCER_REGS=cfg.producer_regs,
        CONSUMER_REGS=cfg.consumer_regs, INTERVAL=intervals is not None, DIRECT_STORE=direct,
        PERSISTENT=persistent, M_MAJOR=deal, ROWS_SMEM=rows_smem, LIST=lists,
        BOUNDS_SMEM=rows_smem and intervals is not None and _on(cfg.bounds_smem, lo.dtype == torch.int64),
        DEALT=dealt is not None, KV_REP=kv_rep, DQ_LAG=atomic and _on(cfg.dq_lag, s.D == 64),
        ROWS_ACC=cfg.rows_acc if qk > 0 else min(cfg.rows_acc, 1), LATE_DV=_on(cfg.late_dv, cfg.block_m >= 128),
        DK_DS_SMEM=atomic and cfg.dk_ds_smem, num_warps=4)
    if atomic:
        _launch(_dq_finish, (_cdiv(s.Lq, 64), s.B * s.H), (dq, dqa, lse, *dq.stride()[:3], s.H, s.Lq, scale), 8,
                q.device, HEAD_DIM=s.D, HEAD_DIM_PAD=s.D, BLOCK=64, ACCUMULATE=False, num_warps=4)
        call_memo.vouch()  # the Gluon backward's GPU work: recorded allocations and launches
        return
    n_prog = s.Lq // (2 * cfg.dq_block_m)
    n_items = n_prog * s.B * s.H
    direct = cfg.direct_store or dq.dtype == torch.float32
    # as the forward's: causal keeps one program per tile; dQ written directly needs no view
    persistent, geo, grid = _persistent_grid((q, dout, k, v, None if direct else dq), n_items,
                                             _on(cfg.persistent, auto) and not causal, cfg.sm_margin)
    deal = _tile_major(persistent and intervals is not None, n_items, grid, window_bytes)
    dealt = (_deal_table(layout, *q_work, s.B, s.H, lzb, lzh, grid, q.device)
             if deal and cfg.deal and q_work is not None else None)
    _launch(_bg._attn_bwd_dq_gluon, (grid, ), (
        q, k, v, dout, dq, lse, delta, lo, hi, q_tab, ph if dealt is None else dealt,
        *q.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *dout.stride()[:3],
        *dq.stride()[:3],
        s.H, s.G, s.Lq, s.Lk, lzb, lzh, qk, scale, n_prog, n_items, *geo), 32, q.device, HEAD_DIM=s.D,
        BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, STAGES=cfg.dq_stages, CAUSAL=causal,
        PINGPONG=cfg.dq_pingpong, OVERLAP=cfg.dq_overlap, PRODUCER_REGS=cfg.producer_regs,
        CONSUMER_REGS=cfg.consumer_regs, INTERVAL=intervals is not None, DIRECT_STORE=direct,
        PERSISTENT=persistent, M_MAJOR=deal, LIST=lists, DEALT=dealt is not None, num_warps=4)
    call_memo.vouch()


# Kernel variants chosen per launch plan (benchmarks/experiments/kernel_ab.py compares them), all
# kernel options (ops/options.py):
# ``even``: when the lengths are multiples of the layout blocks, the masked loops drop their bounds
# terms and row checks (sm_90 SASS, NOTES.md "Partial blocks": forward masked loop 1389 -> 1257
# instructions, dK/dV 1994 -> 1488, dQ 1233 -> 1104). A length that is not a multiple then compiles
# one more variant. On by default: on the H100 it gains 3-6 % fwd+bwd on Longformer, BigBird,
# windows and documents at 16K and changes nothing elsewhere (NOTES.md, "Lever 2: GPU result").
# ``deterministic``: True runs the dK/dV and dQ programs (seven GEMMs per visited block,
# bit-reproducible); False the five-GEMM backward whose dK/dV programs add dQ with fp32 atomics
# (kernels/backward_atomic.py). ``dq_desc``: those adds as TMA reduce-adds of whole tiles.
# ``lists``: how finely the kernels' lists are classified (compiler/finer.py): ``"coarse"`` lists
# layout blocks; ``"fine"`` the blocks of a classification at the kernel tile's step along the loop
# (forward/dQ: (bm, BLOCK_N) rows, dK/dV: (BLOCK_M, bn) columns), so every loop iteration is one
# tile and empty tiles inside partial layout blocks are skipped; ``"half"`` the blocks of half the
# layout block (at least the step); ``"auto"`` lets a cost model choose between the layout block and
# its half per layout and side (compiler/finer.pick_list_block; the default). Partial area at 16K
# (NOTES.md "Lever 5"): Longformer -25 %, BigBird -50 %, documents -16 %, sliding windows and causal
# unchanged; on the H100 "auto" ran Longformer and BigBird 1.10-1.18x faster forward and
# 1.03-1.10x fwd+bwd at 16K and 64K.
# ``list_stages``: with finer lists, ``"same"`` keeps each kernel's stage count (fewer tiles in
# flight, less shared memory: forward 128x64 at 3 stages 224 -> 128 KB on sm_90), ``"tiles"``
# multiplies it by the tiles per layout block (the same tiles in flight and shared memory).


_ALLOCATOR_SET = threading.local()  # .done: this thread set an allocator (where Triton's hook is not readable)
try:  # triton 3.6 / 3.9: the hook is a ContextVar holding a NullAllocator until one is set
    from triton.runtime import _allocation as _triton_alloc
except ImportError:  # pragma: no cover - depends on the installed Triton
    _triton_alloc = None


def _set_tma_allocator(device: torch.device) -> None:
    """Descriptors built inside a kernel need global scratch from Triton's allocator hook. The hook
    is a context variable, so it is checked on every call: autograd runs CUDA backward passes on
    its own threads, where an allocator set by the forward's thread is absent. An allocator the
    caller set is kept."""
    hook = getattr(_triton_alloc, "_allocator", None)
    if hook is not None and hasattr(hook, "get"):
        if not isinstance(hook.get(), _triton_alloc.NullAllocator):
            return
    elif getattr(_ALLOCATOR_SET, "done", False):
        return
    # the device type only: "cuda" is the current device when the kernel launches
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device.type))
    _ALLOCATOR_SET.done = True


def _ensure_tma_allocator(device: torch.device) -> None:
    """:func:`_set_tma_allocator`, repeated by a replay of the call (``ops/call_memo.py``)."""
    _set_tma_allocator(device)
    call_memo.also(_set_tma_allocator, device)


def _list_block(layout: BlockLayout, side: str, step: int, opts: KernelOptions, flat: bool = False) -> int | None:
    """List block of one side under the ``lists`` kernel option: keys per row entry (``side="row"``,
    forward and dQ) or queries per column entry (``"col"``, dK/dV) for kernel tiles that step
    ``step`` along the loop; None for the layout block. A shard follows its source layout's choice
    (the same kernels on every rank)."""
    mode = opts.lists
    if mode == "coarse":
        return None
    u = pick_list_block(_source(layout), side, step, flat, force=None if mode == "auto" else mode)
    lbm, lbn = layout.block_size
    return None if u == (lbn if side == "row" else lbm) else u


def _deepen(layout: BlockLayout, side: str, cfg: TileConfig, opts: KernelOptions) -> TileConfig:
    """``cfg`` with its stages multiplied by the layout blocks' tiles per list entry when that side
    runs finer lists and the ``list_stages`` option is ``"tiles"``: the loop then keeps as many
    kernel tiles in flight (and as much shared memory) as it does over layout blocks, where every
    unrolled tile of an entry has its own stage buffers. With ``"same"`` the stage count stays."""
    if opts.list_stages != "tiles" or cfg.flat:
        return cfg
    step = cfg.block_n if side == "row" else cfg.block_m
    unit = _list_block(layout, side, step, opts)
    if unit is None:
        return cfg
    lbm, lbn = layout.block_size
    ratio = (lbn if side == "row" else lbm) // unit
    return TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages * ratio, cfg.flat)


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


_FALLBACK: dict = {}


def _shrink(cfg: TileConfig) -> TileConfig | None:
    """Next smaller config: fewer stages first, then the larger tile side halved (>= 16)."""
    if cfg.num_stages > 1:
        return TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages - 1, cfg.flat)
    if max(cfg.block_m, cfg.block_n) <= 16:
        return None
    if cfg.block_n >= cfg.block_m:
        return TileConfig(cfg.block_m, cfg.block_n // 2, cfg.num_warps, 2, cfg.flat)
    return TileConfig(cfg.block_m // 2, cfg.block_n, cfg.num_warps, 2, cfg.flat)


def _worklist(layout: BlockLayout, side: str, tile: int, n_heads: int, device, opts: KernelOptions,
              unit: int | None = None) -> WorkList | None:
    """Cached work list for the row side (forward, dQ) or column side (dK/dV) at this tile size, over
    the tables of list block ``unit`` (default the layout block)."""
    if not worklists_enabled(layout):
        return None
    force = opts.split_chunk
    key = ("worklist", side, tile, n_heads, device, force, unit, opts.row_arith, opts.col_arith)
    wl = layout.cache.get(key)
    if wl is None:
        row_list, col_list = (unit, None) if side == "row" else (None, unit)
        rows, cols = layout.kernel_tables(row_runs=opts.row_arith, col_runs=opts.col_arith,
                                          row_list=row_list, col_list=col_list)
        lut = rows if side == "row" else cols
        lb = layout.block_size[0] if side == "row" else layout.block_size[1]
        along = layout.block_size[1] if side == "row" else layout.block_size[0]
        length = layout.q_len if side == "row" else layout.kv_len
        wl = build_worklist(lut.full_ptr, lut.part_ptr, lb // tile, -(-length // tile),
                            n_heads, hw_slots(device), device=device, force_chunk=force,
                            entry_size=(unit or along) / along)
        layout.cache[key] = wl
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Plan:
    """Everything a launch needs that does not change between calls on the same layout, device,
    dtype and head counts: tiles, grid, work lists, LUT/payload buffers and the constexprs. Built
    once (``layout.cache``); a call then only allocates its outputs and passes strides."""

    cfg: tuple  # (TileConfig,) forward; (dK/dV, dQ) backward
    grid: tuple
    args: tuple  # device buffers and int scalars, in the kernel's order after the strides
    consts: dict
    part_shapes: tuple  # float32 shapes of split-tile partial buffers (empty: none)
    combine: tuple  # (work list, n_heads, block) per combine launch
    launch: Launch = None  # the main kernel with these constexprs
    launch_combine: tuple = ()  # the combine kernels' launchers


def _plan_key(kind: str, layout, s: Shapes, dtype, device, has_dropout: bool, opts: KernelOptions, extra=()):
    return (kind, device, dtype, s.B, s.H, s.Hkv, s.D, has_dropout, opts, *extra)


_SLOPES = LRUCache(64)  # (ScoreMod, H, device) -> float32 (H,) slopes on the device (constant slopes)
_CAPS = LRUCache(64)  # (cap, device) -> float32 (1,) soft-cap on the device (a constant cap)
_FWD_SCORE_BITS = ALIBI | SOFTCAP | BIAS


def _strides4(t: torch.Tensor) -> tuple:
    """Strides of a 4-D tensor with 0 on its size-1 (broadcast) dims."""
    return tuple(0 if n == 1 else st for n, st in zip(t.shape, t.stride()))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` at a 16-byte aligned address (a copy if needed): the compiled variants, which the
    direct launcher reuses, assume it of every tensor argument (``ops/launcher.py``)."""
    return t.clone() if t.data_ptr() % 16 else t


def _bias_tensor(bias: torch.Tensor) -> torch.Tensor:
    """The bias as the kernels read it: float64 as float32, 16-byte aligned."""
    bias = bias.detach()
    return _aligned(bias.float() if bias.dtype == torch.float64 else bias)


def _cap_tensor(cap, device) -> torch.Tensor:
    """The soft-cap as the float32 one-element device tensor the kernels read."""
    if isinstance(cap, torch.Tensor):
        return _aligned(device_copy(cap, device).detach().to(torch.float32).reshape(1))
    key = (float(cap), device)
    t = _CAPS.get(key)
    if t is None:
        t = torch.full((1,), float(cap), dtype=torch.float32, device=device)
        _CAPS.put(key, t)
    return t


def _score_args(score_mod, H: int, device) -> tuple:
    """``(SLOPES, SOFTCAP, BIAS, 4 bias strides)``: run-time arguments of the kernels for
    ``score_mod`` (placeholders without one). Their values never select a compiled variant: only
    which modifiers are present (and the bias' dtype) do."""
    ph = _placeholder(torch.float32, device)
    if score_mod is None:
        return ph, ph, ph, 0, 0, 0, 0
    slopes = ph
    if isinstance(score_mod.slopes, torch.Tensor):  # a bound (H,) tensor: values change between calls
        slopes = _aligned(score_mod.slopes.detach().to(device=device, dtype=torch.float32).expand(H).contiguous())
    elif score_mod.slopes is not None:
        key = (score_mod, H, device)
        slopes = _SLOPES.get(key)
        if slopes is None:
            slopes = score_mod.slopes_tensor(H, device)
            _SLOPES.put(key, slopes)
    bias, bstr = ph, (0, 0, 0, 0)
    if score_mod.bias is not None:
        bias = _bias_tensor(score_mod.bias)
        bstr = _strides4(bias)
    return (slopes, (_cap_tensor(score_mod.cap, device) if score_mod.cap is not None else ph), bias, *bstr)


def _grad_args(score_grads, device) -> tuple:
    """``(DBIAS, 4 strides, DSLOPES)`` of the backward: float32 buffers the dK/dV programs add the
    bias' and the slopes' gradients to (placeholders where none is wanted)."""
    ph = _placeholder(torch.float32, device)
    dslopes, dbias = score_grads if score_grads is not None else (None, None)
    for name, g in (("dslopes", dslopes), ("dbias", dbias)):
        if g is not None and (g.dtype != torch.float32 or g.device != torch.device(device)):
            raise ValueError(f"score_grads: {name} must be a float32 buffer on {device}, got {g.dtype} on {g.device}")
    return (ph, 0, 0, 0, 0, ph) if dslopes is None and dbias is None else (
        dbias if dbias is not None else ph, *(_strides4(dbias) if dbias is not None else (0, 0, 0, 0)),
        dslopes if dslopes is not None else ph)


def _kind(score_mod, score_grads=None) -> int:
    """The kernels' ``SCORE_MOD`` constexpr (see ``kernels/common.py``): which modifiers are present,
    and in the backward which gradients are accumulated and over which dims the bias broadcasts."""
    if score_mod is None:
        return 0
    if score_mod.fn is not None:
        raise NotImplementedError("score_mod: score_fn() callables run on the PyTorch backend only; the Triton "
                                  "kernels fuse alibi(), bias() and softcap()")
    kind = score_mod.kind & _FWD_SCORE_BITS
    dslopes, dbias = score_grads if score_grads is not None else (None, None)
    if dslopes is not None:
        kind |= DSLOPES
    if dbias is not None:
        kind |= DBIAS | (BIAS_ROWS_BROADCAST if dbias.shape[2] == 1 else 0) | (
            BIAS_KEYS_BROADCAST if dbias.shape[3] == 1 else 0)
    return kind


def _bias_dtype(score_mod):
    return None if score_mod is None or score_mod.bias is None else _bias_tensor(score_mod.bias).dtype


def _fwd_plan(layout, s: Shapes, dtype, device, has_dropout: bool, opts: KernelOptions, cfg=None, out_dtype=None,
              smod_kind: int = 0, bias_dtype=None) -> _Plan:
    key = _plan_key("fwd", layout, s, dtype, device, has_dropout, opts, (out_dtype, smod_kind, bias_dtype))
    plan = layout.cache.get(key) if cfg is None else None
    if plan is not None:
        return plan
    lbm, lbn = layout.block_size
    check_layout_block(lbm, lbn)
    d_pad = head_dim_pad(s.D)
    lc = select.layout_class(layout)
    wanted = _deepen(layout, "row", fwd_config(d_pad, dtype, lbm, lbn, lc.band, lc.partial_rows, opts.fwd_tiles),
                     opts)
    fkey = ("fwd", wanted, d_pad, dtype, lbm, lbn, _payload(layout, device, opts).gathers)  # the config that fits
    if cfg is None:
        cfg = _FALLBACK.get(fkey, wanted)
    else:
        _FALLBACK[fkey] = cfg
    unit = _list_block(layout, "row", cfg.block_n, opts)
    rows, _, pay, modes, pos = _device_state(layout, device, opts, row_list=unit)
    wl = _worklist(layout, "row", cfg.block_m, s.B * s.H, device, opts, unit)
    nslot = wl.n_slots if wl is not None else 0
    grid = (wl.n_items if wl is not None else _cdiv(s.Lq, cfg.block_m), s.B * s.H)
    work = wl.work if wl is not None else _placeholder(torch.int32, device)
    lzb, lzh = _layout_strides(layout)
    n_part = s.B * s.H * nslot * cfg.block_m
    consts = dict(PREDICATE=pay.fn, HAS_DROPOUT=has_dropout, USE_WORK=wl is not None, HEAD_DIM=s.D,
                  HEAD_DIM_PAD=d_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LAYOUT_BM=lbm, LAYOUT_BN=lbn,
                  DOT_PRECISION=_dot_precision(dtype, device), STAGES=cfg.num_stages,
                  MASKED_STAGES=opts.masked_stages or _masked_stages(pay, cfg), num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, FULL_LUT=modes["FULL_LUT"], PART_LUT=modes["PART_LUT"],
                  KV_DESC=False, WARP_SPEC=False)
    if opts.even and layout.kv_len % lbn == 0:
        consts["KV_EVEN"] = True
    if unit is not None:
        consts["LIST_BN"] = unit
    if pos is not None:
        consts["HAS_POS"] = True
    if smod_kind:
        consts["SCORE_MOD"] = smod_kind
    ph = _placeholder(torch.int32, device)
    args = (*rows, pay.params, pay.aux, *(pos or (ph, ph)), work)
    ints = (nslot, s.H, s.G, lzb, lzh, _cdiv(s.Lq, lbm), s.Lq, s.Lk, layout.q_offset)
    plan = _Plan((cfg,), grid, (args, ints), consts, ((n_part, d_pad), (n_part,)) if nslot else (),
                 ((wl, s.B * s.H, cfg.block_m),) if nslot else (), Launch(_attn_fwd, consts, 17, device),
                 (Launch(_attn_fwd_combine, dict(HEAD_DIM=s.D, HEAD_DIM_PAD=d_pad, BLOCK_M=cfg.block_m, num_warps=4),
                         9, device),))
    layout.cache[key] = plan
    return plan


_DENSE_BLOCK = 128


def _dense_launch(q, k, v, out, lse, s: Shapes, scale: float, ws: bool) -> None:
    """The dense forward of ``kernels/forward_ws.py`` (``ws``: warp-specialised)."""
    _ensure_tma_allocator(q.device)
    _attn_fwd_ws[(_cdiv(s.Lq, _DENSE_BLOCK), s.B * s.H)](
        q, k, v, out, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        s.H, s.G, s.Lq, s.Lk, scale * _LOG2E, HEAD_DIM=s.D, BLOCK_M=_DENSE_BLOCK, BLOCK_N=_DENSE_BLOCK,
        WARP_SPEC=ws, num_warps=4 if ws else 8, num_stages=2)


def _gluon_interval_tables(layout: BlockLayout, cfg: "GluonConfig", device):
    """``(LO, HI, TILES)`` int32 device tensors of the Gluon forward's interval mode, built once per
    layout, tiles and device: the rows' key intervals ``(Z, P·rows)`` (padded to whole programs with
    the last row's interval), and per program ``(tile, kb0, e1, e2, n_blocks)`` ``(Z, P, 5)``, the
    heaviest programs first (``kernels/forward_gluon._attn_fwd_gluon``)."""
    key = ("gluon_interval", device, cfg.block_m, cfg.block_n, cfg.groups)
    hit = layout.cache.get(key)
    if hit is not None:
        return hit
    lo, hi = row_interval(layout)
    rows = cfg.groups * cfg.block_m
    z, lq = lo.shape
    n_prog = _cdiv(lq, rows)
    pad = n_prog * rows - lq
    lo_p = np.pad(lo, ((0, 0), (0, pad)), mode="edge")
    hi_p = np.pad(hi, ((0, 0), (0, pad)), mode="edge")
    tiles = np.empty((z, n_prog, 5), np.int64)
    for i in range(z):
        first, f0, f1, end = tile_ranges(lo[i], hi[i], rows, cfg.block_n).T
        # a program with nothing to attend still runs one (fully masked) block: O = 0, LSE = -inf
        end = np.maximum(end, first + 1)
        n = end - first
        e1 = np.maximum(np.minimum(f0, end) - first, 1)
        e2 = np.maximum(np.minimum(f1, end) - first, e1)
        order = np.lexsort((-(n - (e2 - e1)), -n))  # most blocks first, then most masked blocks
        tiles[i] = np.stack([np.arange(n_prog), first, e1, e2, n], axis=1)[order]
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)  # noqa: E731
    out = layout.cache[key] = (to(lo_p), to(hi_p), to(tiles))
    return out


def _gluon_segment_tables(layout: BlockLayout, cfg: "GluonConfig", s: Shapes, lzb: int, lzh: int, device):
    """The Gluon forward's segment tables (``compiler/device_intervals.gluon_segment_tables``) from a
    layout's host intervals, built once per layout, tiles, heads and device."""
    key = ("gluon_segments", device, cfg.block_m, cfg.block_n, cfg.groups, s.B, s.H, lzb, lzh)
    hit = layout.cache.get(key)
    if hit is None:
        from ..compiler.device_intervals import gluon_segment_tables

        lo, hi = (torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device) for a in row_interval(layout))
        zs = ((torch.arange(s.B, device=device) * lzb).view(-1, 1) + torch.arange(s.H, device=device) * lzh).view(-1)
        hit = layout.cache[key] = gluon_segment_tables(lo, hi, cfg.groups * cfg.block_m, cfg.block_n, zs)
    return hit


def _gluon_bwd_interval_tables(layout: BlockLayout, cfg: GluonBwdConfig, device):
    """``(LO, HI, KV_TAB, Q_TAB, LZB, LZH, EMPTY, KV_ORD)``: the Gluon backward's interval mode on a
    layout whose rows keep one key interval (``ops/select.layout_class``), built once per layout,
    tiles and device from its host intervals with the device-interval path's table code
    (``compiler/device_intervals.gluon_backward_tables``). ``LO/HI`` int32 ``(Z, Lq)``: one row per
    batch row of the layout where every head keeps the same intervals, else one per batch row and
    head (``Z = Zb·Zh``; the heads of a GQA group must agree: ``select.LayoutClass.head_runs``);
    ``LZB``, ``LZH`` the instance strides (the launcher scales ``LZH`` by ``G`` for the dK/dV
    kernel, which reads each group's first head); ``EMPTY``:
    bool ``(Zb, Zh or 1, Lq)`` of the rows that keep nothing, or None where every row keeps a key;
    ``KV_ORD``: the key tiles heaviest first (``compiler/device_intervals.key_tile_order``)."""
    key = ("gluon_bwd_interval", device, cfg.block_m, cfg.block_n, cfg.dq_block_m, cfg.dq_block_n)
    hit = layout.cache.get(key)
    if hit is not None:
        return hit
    from ..compiler.device_intervals import DeviceIntervals
    from ..compiler.device_intervals import gluon_backward_tables, key_tile_order

    bm, hm = layout.batch_shape or (1, 1)
    # instance z = b·hm + h (row_interval); heads that keep the same intervals share head 0's
    lo, hi = (a.reshape(bm, hm, -1) for a in row_interval(layout))
    if hm > 1 and not select._heads_differ(layout, lo, hi):
        lo, hi, hm = lo[:, :1], hi[:, :1], 1
    lo, hi = (np.ascontiguousarray(a, dtype=np.int32) for a in (lo, hi))
    iv = DeviceIntervals(torch.from_numpy(lo).to(device), torch.from_numpy(hi).to(device), None, None, None, None)
    kv_tab, q_tab = gluon_backward_tables(iv, layout.kv_len, cfg)
    empty = lo >= hi
    out = layout.cache[key] = (iv.lo.view(bm * hm, -1), iv.hi.view(bm * hm, -1), kv_tab, q_tab,
                               hm if bm > 1 else 0, 1 if hm > 1 else 0,
                               torch.from_numpy(empty).to(device) if empty.any() else None, key_tile_order(kv_tab))
    return out


def _gluon_list_tables(layout: BlockLayout, device):
    """``(LO, HI, FWD, DQ, DKDV, DKDV_ORD, mean_keys)``: the Gluon kernels' list-mode tables of a block
    layout (``compiler/block_lists.py``, via ``select.block_lists_of``) on ``device``, built once
    per layout and device; ``mean_keys``: keys visited per row on average."""
    key = ("gluon_lists", device)
    hit = layout.cache.get(key)
    if hit is None:
        t = select.block_lists_of(layout)
        if t is None:
            raise ValueError("the Gluon list mode: this layout does not qualify (compiler/block_lists.py)")
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        hit = layout.cache[key] = (to(t.lo), to(t.hi), to(t.fwd), to(t.dq), to(t.dkdv), to(t.dkdv_order), t.mean_keys)
    return hit


# A deal table replaces the every-grid-th deal of a persistent launch where it shortens the most
# loaded program's work by at least this fraction (layouts whose key tiles differ in work: global or
# prefix key tiles that every row visits).
DEAL_MIN_GAIN = 0.05


def _deal_table(layout, work, order, n_b: int, n_h: int, lzb: int, lzh: int, grid: int, device):
    """The deal table (``forward_gluon._dealt``) of a persistent tile-major launch over ``n_b × n_h``
    (batch, head) pairs: its items ``t = m·(n_b·n_h) + bh`` (the ``m``-th of ``order``'s tiles of
    instance ``z = b·lzb + h·lzh``, ``work[z, tile]`` each) dealt longest first to the least loaded of
    ``grid`` programs (LPT list scheduling), each program's in canonical order, written in the
    kernels' snake encoding (``forward_gluon._item_tile`` undoes it); None where ``work`` is None or
    the deal gains less than ``DEAL_MIN_GAIN`` on the every-grid-th one. Cached on the layout."""
    if work is None or layout is None:
        return None
    key = ("gluon_deal", id(work), n_b, n_h, lzb, lzh, grid, device)
    hit = layout.cache.get(key)
    if hit is not None and hit[0] is work:  # the work array the table was dealt from
        return hit[1]
    import heapq

    order = np.asarray(order)
    z = (np.arange(n_b)[:, None] * lzb + np.arange(n_h)[None, :] * lzh).reshape(-1)
    w = np.take_along_axis(np.asarray(work, np.float64), order.astype(np.int64), 1)[z]  # (BH, n_prog)
    wt = w.T.reshape(-1)  # canonical item t = m·BH + bh
    n = wt.size
    t = np.arange(n)
    sweep = t // grid
    snake = np.where((sweep % 2 == 1) & ((sweep + 1) * grid <= n), sweep * grid + grid - 1 - t % grid, t)
    before = np.bincount(t % grid, weights=wt[snake], minlength=grid).max()  # slot j runs item snake(j)
    loads = [(0.0, p) for p in range(grid)]
    owner = np.empty(n, np.int64)
    for i in np.argsort(-wt, kind="stable"):
        load, p = heapq.heappop(loads)
        owner[i] = p
        heapq.heappush(loads, (load + wt[i], p))
    after = max(load for load, _ in loads)
    table = None
    if after < (1.0 - DEAL_MIN_GAIN) * before:
        counts = np.bincount(owner, minlength=grid)
        width = int(counts.max())
        items = np.zeros((grid, width), np.int64)
        by = np.argsort(owner, kind="stable")  # grouped by program, canonical order within
        items[owner[by], np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)] = snake[by]
        flat = np.concatenate([[width], counts, items.reshape(-1)]).astype(np.int32)
        table = torch.from_numpy(flat).to(device)
    layout.cache[key] = (work, table)
    return table


def _list_work(layout: BlockLayout):
    """The list mode's work on the host, once per layout: ``(dK/dV, dQ, forward)``, each ``(work
    per tile, the kernel's tile order)`` (``select.list_work``; the dK/dV kernel's order
    ``BlockLists.dkdv_order``, the others' the tiles' or table rows' own)."""
    work = layout.cache.get("list_work")
    if work is None:
        bl = select.block_lists_of(layout)
        rows, fwd = select.list_work(bl, "dq"), select.list_work(bl, "forward")
        ident = np.broadcast_to(np.arange(rows.shape[1], dtype=np.int32), rows.shape)
        work = layout.cache["list_work"] = ((select.list_work(bl, "dkdv"), bl.dkdv_order), (rows, ident),
                                            (fwd, ident))
    return work


def _on(flag: bool | None, auto: bool) -> bool:
    """A kernel option that is True, False or None (then ``auto``)."""
    return auto if flag is None else flag


_GRIDS = LRUCache(256)  # _persistent_grid's answers by the tensors' shapes and strides


def _persistent_grid(tensors, n_items: int, allowed: bool, margin: int = 0):
    """``(persistent, geometry, grid)`` of a Gluon kernel with ``n_items`` work items: persistent
    (a grid of at most one program per SM, ``margin`` SMs left free; at least one program) where
    ``allowed`` and every tensor is a 2-D row view
    (:func:`_row_view`; a None entry needs none and gets zeros) small enough for int32 rows;
    ``geometry``: the views' ``(rows per batch, rows per head, columns per head)`` flattened (zeros
    when not persistent), ``grid``: the programs. A function of the shapes and strides only, so
    kept per those (a call's host time: ``benchmarks/NOTES.md``, "Host path")."""
    sms = select.hardware(next(t.device for t in tensors if t is not None)).sm_count if allowed else 0
    key = (n_items, sms, margin, *((None,) if t is None else (t.shape, t.stride()) for t in tensors))
    hit = _GRIDS.get(key)
    if hit is None:
        hit = _persistent_grid_of(tensors, n_items, sms, margin)
        _GRIDS.put(key, hit)
    return hit


def _persistent_grid_of(tensors, n_items: int, sms: int, margin: int):
    views = [(0, 0, 0) if t is None else _row_view(t) for t in tensors] if sms > 0 else [None]
    # the kernels index the views' rows in int32
    persistent = all(vw is not None for vw in views) and all(
        (t.shape[0] - 1) * vw[0] + (t.shape[1] - 1) * vw[1] + t.shape[2] < 2**31
        for t, vw in zip(tensors, views) if t is not None)
    if not persistent or sms <= 0:  # not persistent, or the SM count is unknown
        return False, (0,) * (3 * len(tensors)), n_items
    return True, tuple(x for vw in views for x in vw), min(n_items, max(1, sms - margin))


def _row_view(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``t (B, H, L, D)`` (unit last stride) as a 2-D ``(rows, D)`` view with row stride
    ``t.stride(2)``: ``(rows per batch, rows per head, columns per head)``, heads stacked along
    the rows (``(B, H, L, D)`` memory) or side by side in a row (``(B, L, H, D)`` memory, viewed
    transposed); None where neither holds."""
    n_b, n_h, _, d = t.shape
    sb, sh, sm, _ = t.stride()
    if sm <= 0:
        return None
    rb = 0
    if n_b > 1 and sb:
        if sb % sm:
            return None
        rb = sb // sm
    if n_h == 1 or sh == 0:
        return rb, 0, 0
    if sh % sm == 0:
        return rb, sh // sm, 0
    if sh * (n_h - 1) + d <= sm:
        return rb, 0, sh
    return None


def _gluon_fwd_run(q, k, v, out, lse, lo, hi, tiles, lzb: int, lzh: int, s: Shapes, scale: float, case: str,
                   cfg: GluonConfig, global_keys: tuple = (0, False), window_bytes: float | None = None,
                   layout: BlockLayout | None = None, work=None, segments: int = 0) -> None:
    """Launch ``kernels/forward_gluon._attn_fwd_gluon`` in mode ``case`` (``"dense"``, ``"causal"``,
    ``"interval"`` with its ``lo``/``hi``/``tiles`` tables, ``"list"`` with the list mode's):
    persistent (one program per SM) for
    dense and interval layouts where ``cfg.persistent`` and the tensors allow it
    (:class:`~blocksparse_fa.ops.options.GluonConfig`), else one program per query tile and head.
    Persistent interval items run one query tile of every head at a time, heaviest first, or head
    by head where ``window_bytes`` (K/V bytes of every head's key window) says they would not
    share the L2 (:func:`~blocksparse_fa.ops.select.tile_major_deal`).
    ``global_keys``: ``(g, causal)``, interval mode only: every row also keeps the keys ``< g``
    (``<=`` the row with ``causal``), visited first in every item (``compiler/globals.py``).
    ``work``: the host's ``(work per table row, order)`` of ``layout``'s row tiles, from which a
    persistent tile-major launch deals its items by :func:`_deal_table` (``cfg.deal``). ``segments``:
    the interval tables are the segment tables of ``compiler/device_intervals.gluon_segment_tables``,
    whose ``n_prog`` this is (persistent; 0: aligned tiles)."""
    _ensure_tma_allocator(q.device)
    rows = cfg.groups * cfg.block_m
    n_prog = segments or _cdiv(s.Lq, rows)
    n_items = n_prog * s.B * s.H
    # causal stays one program per tile: persistent it measured 0.98-1.00x (16K / 64K, H100)
    persistent, geo, grid = _persistent_grid((q, k, v, out), n_items, cfg.persistent and case != "causal"
                                             and (s.Lq % rows == 0 or segments > 0), cfg.sm_margin)
    if segments and not persistent:
        raise ValueError("segment tables need a persistent grid (2-D row views of q, k, v and the output)")
    m_major = _tile_major(persistent and case in ("interval", "list") and not segments, n_items, grid,
                          window_bytes)
    dealt = (_deal_table(layout, *work, s.B, s.H, lzb, lzh, grid, q.device)
             if m_major and cfg.deal and work is not None else None)
    _launch(_fg._attn_fwd_gluon, (grid, ), (
        q, k, v, out, lse, lo, hi, tiles, _placeholder(torch.int32, q.device) if dealt is None else dealt,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        s.H, s.G, lzb, lzh, s.Lq, s.Lk, n_prog, n_items, scale * _LOG2E, *geo), 27, q.device, HEAD_DIM=s.D,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages, CAUSAL=case == "causal",
        INTERVAL=case in ("interval", "list"), PINGPONG=cfg.pingpong, OVERLAP=cfg.overlap, PERSISTENT=persistent,
        M_MAJOR=m_major, PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.regs, GROUPS=cfg.groups,
        GLOBAL_KEYS=global_keys[0], GLOBAL_CAUSAL=global_keys[1], LIST=case == "list", DEALT=dealt is not None,
        SEGMENTS=segments > 0, Q_BUFS=cfg.q_buffers if persistent else 1, num_warps=4)
    call_memo.vouch()  # the Gluon forward's GPU work: recorded allocations and launches (ops/call_memo.py)


def _gluon_launch(q, k, v, out, lse, s: Shapes, scale: float, case: str, cfg: GluonConfig,
                  layout: BlockLayout | None = None, global_keys: tuple = (0, False)) -> None:
    """The Gluon forward (``kernels/forward_gluon.py``, :func:`_gluon_fwd_run`); ``case``: the chosen
    mode (``"dense"``, ``"causal"``, ``"interval"``, ``"list"``; the last two need ``layout``)."""
    window_bytes, work = None, None
    if case == "interval" and cfg.segments and not global_keys[0] and _persistent_grid(
            (q, k, v, out), s.B * s.H, cfg.persistent, cfg.sm_margin)[0]:
        lzb, lzh = _layout_strides(layout)
        lo, hi, tiles, n_prog = _gluon_segment_tables(layout, cfg, s, lzb, lzh, q.device)
        _gluon_fwd_run(q, k, v, out, lse, lo, hi, tiles, lzb, lzh, s, scale, case, cfg, segments=n_prog)
        return
    if case == "interval":
        lo, hi, tiles = _gluon_interval_tables(layout, cfg, q.device)
        lzb, lzh = _layout_strides(layout)
        window_bytes = _window_bytes(layout, s, q.element_size())
    elif case == "list":
        lo, hi, tiles, _, _, _, keys = _gluon_list_tables(layout, q.device)
        lzb, lzh = _layout_strides(layout)
        window_bytes = _window_bytes(layout, s, q.element_size(), keys)
        work = _list_work(layout)[2]
    else:
        lo = hi = tiles = _placeholder(torch.int32, q.device)
        lzb = lzh = 0
    _gluon_fwd_run(q, k, v, out, lse, lo, hi, tiles, lzb, lzh, s, scale, case, cfg, global_keys, window_bytes,
                   layout, work)


def _tile_major(on: bool, n_items: int, grid: int, window_bytes: float | None) -> bool:
    """The ``M_MAJOR`` constexpr of a persistent interval launch (``on``): the rule of
    :func:`~blocksparse_fa.ops.select.tile_major_deal`, or ``_M_MAJOR`` where an experiment forces one order."""
    if not on:
        return False
    return select.tile_major_deal(n_items, grid, window_bytes) if _M_MAJOR is None else _M_MAJOR


def _window_bytes(layout: BlockLayout, s: Shapes, elem: int, keys: float | None = None) -> float:
    """K/V bytes of every head's key window of a host-interval layout (batch × kv heads × mean keys
    per row × 2·D × ``elem``; ``keys``: the mean keys per row where known, else from the host
    intervals): what a tile-major deal keeps in L2 at once."""
    return s.B * s.Hkv * (_mean_keys(layout) if keys is None else keys) * 2 * s.D * elem


def _mean_keys(layout: BlockLayout) -> float:
    """Mean keys per row of a layout whose rows keep one key interval (host intervals, cached)."""
    hit = layout.cache.get("mean_keys")
    if hit is None:
        lo, hi = row_interval(layout)
        hit = layout.cache["mean_keys"] = float(np.clip(hi - lo, 0, None).mean())
    return hit


def forward_choice(q, k, v, layout: BlockLayout, s: Shapes, dropout_p: float, opts: KernelOptions,
                   out_dtype=None, score_mod=None) -> select.Choice:
    """:func:`~blocksparse_fa.ops.select.choose_forward` for these tensors (what :func:`triton_forward`
    runs; the output is addressable by descriptors when q is, since it is allocated like q)."""
    odt = out_dtype not in (None, q.dtype)
    return select.choose_forward(select.layout_class(layout), s, q.dtype, select.hardware(q.device), opts,
                                 dropout=dropout_p > 0.0, score_mod=score_mod is not None, out_dtype=odt,
                                 tma=select.tma_ok(q, k, v))


def triton_forward(q, k, v, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int,
                   out_dtype=None, score_mod=None, opts: KernelOptions = DEFAULT_OPTIONS, global_keys=None):
    """Forward kernel; returns ``out (B, H, Lq, D)`` (q's dtype, or ``out_dtype``: float32 keeps a
    partial result exact for a later merge) and ``lse (B, H, Lq)`` float32. ``score_mod``: a
    :class:`~blocksparse_fa.mask.score.ScoreMod` or None; ``opts``: the call's kernel options. The
    kernel is :func:`~blocksparse_fa.ops.select.choose_forward`'s. ``global_keys``: ``(g, causal)``
    folded into the Gluon interval forward (``ops/globals.py``; the choice must be that kernel)."""
    q, k, v = (t if t.stride(-1) == 1 else _copy(t) for t in (q, k, v))
    dev = q.device
    odt = None if out_dtype in (None, q.dtype) else out_dtype
    out = call_memo.empty(q.shape, odt or q.dtype, dev)
    lse = call_memo.empty((s.B, s.H, s.Lq), torch.float32, dev)
    choice = forward_choice(q, k, v, layout, s, dropout_p, opts, out_dtype, score_mod)
    select.note("forward", choice)
    if global_keys is not None and (choice.family, choice.mode) != ("gluon", "interval"):
        raise ValueError(f"triton_forward: global_keys need the Gluon interval forward, the choice is {choice}")
    if choice.family == "gluon":
        cfg = select.gluon_fwd_config(opts, choice.mode, s.D)
        _gluon_launch(q, k, v, out, lse, s, scale, choice.mode, cfg, layout, global_keys or (0, False))
        return out, lse
    if choice.family == "triton_dense":
        _dense_launch(q, k, v, out, lse, s, scale, choice.mode == "ws")
        return out, lse
    kind = _kind(score_mod)
    sargs = _score_args(score_mod, s.H, dev)
    bdt = _bias_dtype(score_mod)
    plan = _fwd_plan(layout, s, q.dtype, dev, dropout_p > 0.0, opts, out_dtype=odt, smod_kind=kind, bias_dtype=bdt)
    while True:
        try:
            _fwd_launch(q, k, v, out, lse, plan, scale, dropout_p, seed, sargs, opts)
            return out, lse
        except OutOfResources:
            smaller = _shrink(plan.cfg[0])
            if smaller is None:
                raise
            plan = _fwd_plan(layout, s, q.dtype, dev, dropout_p > 0.0, opts, cfg=smaller, out_dtype=odt,
                             smod_kind=kind, bias_dtype=bdt)


def _fwd_launch(q, k, v, out, lse, plan: _Plan, scale, dropout_p, seed, sargs, opts: KernelOptions):
    (bufs, ints), consts = plan.args, plan.consts
    parts = [torch.empty(sh, dtype=torch.float32, device=q.device) for sh in plan.part_shapes]
    if not parts:
        parts = [_placeholder(torch.float32, q.device)] * 2
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2))
    tail = (*bufs, *parts, *ints, scale * _LOG2E, *_dropout_args(dropout_p, seed), *sargs)
    if opts.kv_desc and select.tma_ok(k, v):
        _ensure_tma_allocator(q.device)
        consts = dict(consts, KV_DESC=True, WARP_SPEC=opts.warp_specialize)
        _attn_fwd[plan.grid](q, k, v, out, lse, *strides, *tail, **consts)
    else:
        plan.launch(plan.grid, q, k, v, out, lse, *strides, *tail)
    for (wl, nbh, block), launch in zip(plan.combine, plan.launch_combine):
        nslot, H, Lq = ints[0], ints[1], ints[6]
        launch((wl.n_combine, nbh), out, lse, parts[0], parts[1], wl.combine, nslot, out.stride(0), out.stride(1),
               out.stride(2), H, Lq)


_PRE: dict = {}  # (head dim, device, writes the base-2 logsumexp) -> launcher of the backward's preprocess


def backward_delta(out, dout, lse, s: Shapes, dlse=None, lse2=None) -> torch.Tensor:
    """``delta = rowsum(dO ∘ O) − dlse`` ``(B, H, Lq)`` float32: the backward's per-row term
    (``dlse``, the gradient of the returned logsumexp, enters because ``∂lse/∂s = p``).
    ``lse2``: a float32 buffer like ``lse`` (contiguous) that the same launch fills with the base-2
    logsumexp, -inf as +inf (what ``_attn_bwd`` reads with ``LSE_BASE2``)."""
    out, dout = _last_dim_contiguous(out), _last_dim_contiguous(dout)
    delta = call_memo.empty((s.B, s.H, s.Lq), torch.float32, out.device)
    pre_m = 64
    write = lse2 is not None
    launch = _PRE.get((s.D, out.device, write))  # the launcher keys on the tensors' dtypes itself
    if launch is None:
        launch = _PRE[(s.D, out.device, write)] = Launch(
            _attn_bwd_preprocess, dict(HEAD_DIM=s.D, HEAD_DIM_PAD=head_dim_pad(s.D), BLOCK_M=pre_m, WRITE_LSE2=write),
            13, out.device)
    launch((_cdiv(s.Lq, pre_m), s.B * s.H), out, dout, delta, lse, lse2 if write else delta, out.stride(0),
           out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2), s.H, s.Lq)
    if dlse is not None:
        call_memo.unfit()
        delta.sub_(torch.where(torch.isinf(lse), torch.zeros_like(lse), dlse.float()))
    return delta


def _bwd_plan(layout, s: Shapes, dtype, device, has_dropout: bool, accumulate: bool, opts: KernelOptions,
              run=(True, True), cfgs=None, grad_dtype=None, smod_kind: int = 0, bias_dtype=None,
              lse_base2: bool = False) -> _Plan:
    key = _plan_key("bwd", layout, s, dtype, device, has_dropout, opts,
                    (accumulate, run, grad_dtype, smod_kind, bias_dtype, lse_base2))
    plan = layout.cache.get(key) if cfgs is None else None
    if plan is not None:
        return plan
    lbm, lbn = layout.block_size
    check_layout_block(lbm, lbn)
    d_pad = head_dim_pad(s.D)
    lc = select.layout_class(layout)
    kv_want, q_want = bwd_configs(d_pad, dtype, lbm, lbn, lc.band, lc.partial_heavy, lc.band_bwd, opts.band_backward,
                                  (opts.dkdv_tiles, opts.dq_tiles))
    wanted = (_deepen(layout, "col", kv_want, opts), _deepen(layout, "row", q_want, opts))
    fkey = ("bwd", run, wanted, d_pad, dtype, lbm, lbn, _payload(layout, device, opts).gathers)  # configs that fit
    if cfgs is None:
        cfgs = _FALLBACK.get(fkey, wanted)
    else:
        _FALLBACK[fkey] = cfgs
    cfg_kv, cfg_q = cfgs
    run_kv, run_q = run
    kv_unit = _list_block(layout, "col", cfg_kv.block_m, opts, cfg_kv.flat) if run_kv else None
    q_unit = _list_block(layout, "row", cfg_q.block_n, opts, cfg_q.flat) if run_q else None
    rows, cols, pay, modes, pos = _device_state(layout, device, opts, row_list=q_unit, col_list=kv_unit)
    wl_kv = _worklist(layout, "col", cfg_kv.block_n, s.B * s.Hkv, device, opts, kv_unit)
    wl_q = _worklist(layout, "row", cfg_q.block_m, s.B * s.H, device, opts, q_unit)
    ph = _placeholder(torch.int32, device)
    n_kv_items = wl_kv.n_items if wl_kv is not None else _cdiv(s.Lk, cfg_kv.block_n)
    n_q_items = wl_q.n_items if wl_q is not None else _cdiv(s.Lq, cfg_q.block_m)
    n_kv_progs = n_kv_items * s.B * s.Hkv if run_kv else 0
    n_progs = n_kv_progs + (n_q_items * s.B * s.H if run_q else 0)
    kv_nslot = wl_kv.n_slots if wl_kv is not None and run_kv else 0
    q_nslot = wl_q.n_slots if wl_q is not None and run_q else 0
    head_major = opts.head_major
    if head_major is None:
        head_major = not (kv_nslot or q_nslot)
    lzb, lzh = _layout_strides(layout)
    consts = dict(PREDICATE=pay.fn, HAS_DROPOUT=has_dropout, HEAD_DIM=s.D, HEAD_DIM_PAD=d_pad,
                  LAYOUT_BM=lbm, LAYOUT_BN=lbn, DOT_PRECISION=_dot_precision(dtype, device),
                  ROW_LUT=modes["ROW_LUT"], COL_LUT=modes["COL_LUT"], ACCUMULATE=accumulate,
                  USE_WORK=wl_kv is not None, KV_BLOCK_M=cfg_kv.block_m, KV_BLOCK_N=cfg_kv.block_n,
                  Q_BLOCK_M=cfg_q.block_m, Q_BLOCK_N=cfg_q.block_n,
                  KV_STAGES=cfg_kv.num_stages, KV_MASKED_STAGES=_masked_stages(pay, cfg_kv),
                  Q_STAGES=cfg_q.num_stages, Q_MASKED_STAGES=_masked_stages(pay, cfg_q), RUN_KV=run_kv, RUN_Q=run_q,
                  num_warps=cfg_kv.num_warps if run_kv else cfg_q.num_warps,
                  num_stages=max(cfg_kv.num_stages if run_kv else 1, cfg_q.num_stages if run_q else 1))
    if _even(layout, opts):
        consts["EVEN"] = True
    if cfg_kv.flat or cfg_q.flat:
        consts.update(KV_FLAT=cfg_kv.flat, Q_FLAT=cfg_q.flat)
    if pos is not None:
        consts["HAS_POS"] = True
    if smod_kind:
        consts["SCORE_MOD"] = smod_kind
    if lse_base2:
        consts["LSE_BASE2"] = True
    for side in ("ROW_PART_LUT", "COL_PART_LUT"):  # masked lists as arithmetic progressions (strided masks)
        if modes[side] != "load":
            consts[side] = modes[side]
    if kv_unit is not None:
        consts["KV_LIST_BM"] = kv_unit
    if q_unit is not None:
        consts["Q_LIST_BN"] = q_unit
    bufs = (*rows, *cols, pay.params, pay.aux, *(pos or (ph, ph)), wl_kv.work if wl_kv is not None else ph,
            wl_q.work if wl_q is not None else ph)
    ints = (kv_nslot, q_nslot, n_kv_items, n_kv_progs, n_q_items, int(head_major),
            s.H, s.G, lzb, lzh, _cdiv(s.Lq, lbm), _cdiv(s.Lk, lbn), s.Lq, s.Lk, layout.q_offset)
    n_kv, n_q = s.B * s.Hkv * kv_nslot * cfg_kv.block_n, s.B * s.H * q_nslot * cfg_q.block_m
    part_shapes = ((n_kv, d_pad) if kv_nslot else None, (n_kv, d_pad) if kv_nslot else None,
                   (n_q, d_pad) if q_nslot else None)
    combine = (((wl_kv, s.B * s.Hkv, cfg_kv.block_n) if kv_nslot else None),
               ((wl_q, s.B * s.H, cfg_q.block_m) if q_nslot else None))
    sums = dict(HEAD_DIM=s.D, HEAD_DIM_PAD=d_pad, ACCUMULATE=accumulate, num_warps=4)
    plan = _Plan((cfg_kv, cfg_q), (n_progs,), (bufs, ints), consts, part_shapes, combine,
                 Launch(_attn_bwd, consts, 36, device),
                 (Launch(_sum_partials, dict(sums, BLOCK=cfg_kv.block_n), 7, device),
                  Launch(_sum_partials, dict(sums, BLOCK=cfg_q.block_m), 7, device)))
    layout.cache[key] = plan
    return plan


def _grad_dtypes(grad_dtype) -> tuple:
    """``(dq, dk, dv)`` dtypes of a ``grad_dtype`` argument (one dtype, None, or a tuple of three)."""
    return tuple(grad_dtype) if isinstance(grad_dtype, (tuple, list)) else (grad_dtype,) * 3


def _even(layout: BlockLayout, opts: KernelOptions) -> bool:
    """Both lengths are multiples of the layout blocks and the ``even`` option is on."""
    lbm, lbn = layout.block_size
    return opts.even and layout.q_len % lbm == 0 and layout.kv_len % lbn == 0


_HEADS_BLOCK = 2048  # elements per program of kernels/heads.py (16 per thread at 4 warps)


def _summed_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``t (B, H, L, D)`` (contiguous) summed over each group of ``groups`` adjacent heads:
    ``(B, H / groups, L, D)`` in ``t``'s dtype, accumulated in float32 (``kernels/heads._group_sum``)."""
    B, H, L, D = t.shape
    out = call_memo.empty((B, H // groups, L, D), t.dtype, t.device)
    _launch(_heads._group_sum, (_cdiv(L * D, _HEADS_BLOCK), B * (H // groups)), (t, out, L * D), 3, t.device,
            GROUPS=groups, BLOCK=_HEADS_BLOCK, num_warps=4)
    return out


def backward_choice(q, k, v, dout, layout: BlockLayout, s: Shapes, dropout_p: float, opts: KernelOptions,
                    accumulate: bool = False, deterministic: bool | None = None, grad_dtype=None,
                    score_mod=None) -> select.Choice:
    """:func:`~blocksparse_fa.ops.select.choose_backward` for these tensors (what
    :func:`triton_backward` runs; new gradients are allocated like their inputs, or in ``grad_dtype``)."""
    other = [] if accumulate else [d for d in _grad_dtypes(grad_dtype) if d not in (None, q.dtype)]
    gdt = bool(other) and ("float32" if all(d == torch.float32 for d in other) else True)
    return select.choose_backward(select.layout_class(layout), s, q.dtype, select.hardware(q.device), opts,
                                  dropout=dropout_p > 0.0, score_mod=score_mod is not None, accumulate=accumulate,
                                  grad_dtype=gdt, deterministic=deterministic, tma=select.tma_ok(q, k, v, dout))


def triton_backward(q, k, v, out, lse, dout, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int,
                    dlse=None, delta=None, accumulate=None, deterministic: bool | None = None, grad_dtype=None,
                    score_mod=None, score_grads=None, opts: KernelOptions = DEFAULT_OPTIONS):
    """Backward kernels; returns ``(dq, dk, dv)`` in the inputs' dtype. ``dlse`` (gradient of the
    returned logsumexp, optional) enters as ``delta - dlse``: ``∂lse/∂s = p``. The kernels are
    :func:`~blocksparse_fa.ops.select.choose_backward`'s.

    ``delta``: precomputed :func:`backward_delta` (then ``out`` and ``dlse`` are not read).
    ``accumulate``: ``(dq, dk, dv)`` tensors (any strides) to add this layout's gradients to; they
    are returned.
    ``deterministic``: True runs separate dK/dV and dQ programs, every output tile owned by one
    program (bit-reproducible); False the five-GEMM backward, whose dK/dV programs add dQ in fp32
    with atomics (dQ may differ in the last bits between runs; dK and dV do not). None: the
    ``deterministic`` kernel option (default None: the faster of the two per layout,
    ``select.choose_backward``). Shards of a layout (``compiler/shard.py``)
    always run the deterministic kernels, which read block position tables.
    ``grad_dtype``: dtype of new gradients (default the inputs'; float32 keeps partial gradients
    exact for a later sum), or a ``(dq, dk, dv)`` tuple of them (None: the input's).
    ``score_mod``: the forward's :class:`~blocksparse_fa.mask.score.ScoreMod` or None (it runs the
    deterministic kernels). ``score_grads``: ``(dslopes (H,), dbias)`` float32 buffers (or None
    each; dbias shaped like the bound 4-D bias) that the dK/dV programs add the gradients of the
    slopes and of the bias to, with atomic adds (see ``kernels/backward._attn_bwd``).
    ``opts``: the call's kernel options."""
    q, k, v, dout = (t if t.stride(-1) == 1 else _copy(t) for t in (q, k, v, dout))
    if not lse.is_contiguous():
        lse = _copy(lse)  # the kernels index it as (B·H, Lq)
    if q.is_cuda and not select.tma_ok(dout) and select.tma_ok(q):
        dout = _copy(dout)  # an upstream layout of dO must not change the kernel choice
    dev = q.device
    choice = backward_choice(q, k, v, dout, layout, s, dropout_p, opts, accumulate is not None, deterministic,
                             grad_dtype, score_mod)
    select.note("backward", choice)
    lse2 = None  # the block kernels' base-2 logsumexp, made by the preprocess where it runs here
    if delta is None:
        if choice.family == "triton" and choice.mode == "blocks":
            lse2 = torch.empty(lse.shape, dtype=torch.float32, device=dev)
        delta = backward_delta(out, dout, lse, s, dlse, lse2)
    gdts = tuple(None if d in (None, t.dtype) or accumulate is not None else d
                 for d, t in zip(_grad_dtypes(grad_dtype), (q, k, v)))
    gdt = gdts if any(gdts) else None
    per_head = choice.mode == "list+per_head_dkdv"  # dK/dV per query head, summed per group after
    if accumulate is None:
        # per_head: dK/dV per query head, (B, H, Lk, D)
        dq, dk, dv = (call_memo.empty((*t.shape[:1], s.H, *t.shape[2:]) if per_head else t.shape, d or t.dtype, dev)
                      for d, t in zip(gdts, (q, k, v)))
    else:
        call_memo.unfit()
        dq, dk, dv = accumulate
        for name, g, t in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            if g.shape != t.shape or g.dtype != t.dtype or g.stride(-1) != 1:
                raise ValueError(f"accumulate: {name} must have shape {tuple(t.shape)}, dtype {t.dtype} and a "
                                 f"contiguous last dim, got {tuple(g.shape)}, {g.dtype}, strides {g.stride()}")
    grads = (dq, dk, dv)
    has_drop, acc = dropout_p > 0.0, accumulate is not None
    if choice.family == "gluon":
        cfg, intervals, window = select.gluon_bwd_config(opts, choice.mode, s.D), None, None
        if choice.mode.startswith("interval"):
            window = _window_bytes(layout, s, q.element_size())
            lo, hi, kv_tab, q_tab, lzb, lzh, empty, kv_ord = _gluon_bwd_interval_tables(layout, cfg, dev)
            if empty is not None:  # the kernels skip rows by a -inf logsumexp; a rewrite's part
                call_memo.unfit()
                lse = lse.masked_fill(empty, float("-inf"))  # gets the whole mask's
            intervals = (lo, hi, kv_tab, q_tab, lzb, lzh, kv_ord)
        lists, groups = choice.mode.startswith("list"), s.G
        if lists:  # rows that keep nothing are masked in every step: no -inf fill
            lo, hi, _, q_tab, kv_tab, kv_ord, keys = _gluon_list_tables(layout, dev)
            window = _window_bytes(layout, s, q.element_size(), keys)
            intervals = (lo, hi, kv_tab, q_tab, *_layout_strides(layout), kv_ord)
        work = _list_work(layout) if lists else (None, None, None)
        _gluon_bwd_launch(q, k, v, dout, grads, lse, delta, s, scale, choice.mode.startswith("causal"),
                          choice.mode.endswith("+atomic_dq"), cfg, layout, intervals=intervals, window_bytes=window,
                          lists=lists, kv_work=work[0], q_work=work[1], per_head_dkdv=per_head)
        if per_head:
            grads = (dq, *(_summed_groups(g, groups) for g in (dk, dv)))
        return grads
    if choice.mode == "five_gemm":
        _atomic_backward(q, k, v, dout, grads, lse, delta, layout, s, scale, dropout_p, seed, acc, opts)
        return grads
    kind = _kind(score_mod, score_grads)
    dslopes = None if score_grads is None else score_grads[0]
    if dslopes is not None:  # the dQ programs write per-row sums (kernels/backward._attn_bwd): _slopes_grad
        _grad_args(score_grads, dev)  # checks the buffers
        score_grads = (torch.zeros((s.B * s.H * s.Lq, 3), dtype=torch.float32, device=dev), score_grads[1])
    sargs = (*_score_args(score_mod, s.H, dev), *_grad_args(score_grads, dev))
    bdt = _bias_dtype(score_mod)
    base2 = lse2 is not None
    lse_k = lse2 if base2 else lse  # what the kernel reads
    if opts.fused_backward:
        plan = _bwd_plan(layout, s, q.dtype, dev, has_drop, acc, opts, grad_dtype=gdt, smod_kind=kind, bias_dtype=bdt,
                         lse_base2=base2)
        cfg_kv, cfg_q = plan.cfg
        if cfg_kv.num_warps == cfg_q.num_warps and _FALLBACK.get(("bwd_fused_fits", *plan.cfg), True):
            try:
                _bwd_launch(q, k, v, dout, grads, lse_k, delta, plan, scale, dropout_p, seed, sargs)
                if dslopes is not None:
                    _slopes_grad(dslopes, score_grads[0], lse, dlse, s, layout)
                return grads
            except OutOfResources:
                _FALLBACK[("bwd_fused_fits", *plan.cfg)] = False  # the two programs do not fit one kernel
    for run in ((True, False), (False, True)):
        plan = _bwd_plan(layout, s, q.dtype, dev, has_drop, acc, opts, run, grad_dtype=gdt, smod_kind=kind,
                         bias_dtype=bdt, lse_base2=base2)
        while True:
            try:
                _bwd_launch(q, k, v, dout, grads, lse_k, delta, plan, scale, dropout_p, seed, sargs)
                break
            except OutOfResources:
                i = 0 if run[0] else 1
                smaller = _shrink(plan.cfg[i])
                if smaller is None:
                    raise
                cfgs = (smaller, plan.cfg[1]) if i == 0 else (plan.cfg[0], smaller)
                plan = _bwd_plan(layout, s, q.dtype, dev, has_drop, acc, opts, run, cfgs=cfgs, grad_dtype=gdt,
                                 smod_kind=kind, bias_dtype=bdt, lse_base2=base2)
    if dslopes is not None:
        _slopes_grad(dslopes, score_grads[0], lse, dlse, s, layout)
    return grads


def _slopes_grad(dslopes, rows, lse, dlse, s: Shapes, layout) -> None:
    """Add the slopes' gradient ``Σ_{b,i} Σ_j dS_ij·(j - qp_i)`` per head to ``dslopes`` from the dQ
    programs' per-row sums ``rows`` ``(B·H·Lq, 3)``: ``X = Σ dS·(j - qp)``, ``M = Σ P·g·(j - qp)``,
    ``E = Σ P·(dP - delta)``. ``dS`` used ``delta = rowsum(dO ∘ O) - dlse`` from the stored output;
    the row's exact delta ``Σ P·dP - dlse`` exceeds it by ``E - dlse``, which moves the sum by
    ``-(E - dlse)·M``. In bfloat16 the output's rounding is ~2⁻⁹ of delta while ``M`` grows with
    the distances (up to the row length), so the correction matters; it is exact only for whole
    rows, so a shard (rows may be split between ranks) keeps ``X``."""
    x, m, e = rows.view(s.B, s.H, s.Lq, 3).unbind(-1)
    if getattr(layout, "positions", None) is None:
        if dlse is not None:
            e = e - torch.where(torch.isinf(lse), torch.zeros_like(lse), dlse.float())
        x = x - e * m
    dslopes += x.sum((0, 2))


def _bwd_launch(q, k, v, dout, grads, lse, delta, plan: _Plan, scale, dropout_p, seed, sargs=None):
    """``_attn_bwd``: the dK/dV programs, then the dQ programs, on one 1-D grid (or only one of the
    two, ``RUN_KV``/``RUN_Q``); then the sums of split tiles."""
    dq, dk, dv = grads
    (bufs, ints), consts = plan.args, plan.consts
    parts = [_placeholder(torch.float32, q.device) if sh is None else
             torch.empty(sh, dtype=torch.float32, device=q.device) for sh in plan.part_shapes]
    plan.launch(plan.grid, q, k, v, dout, dq, dk, dv, lse, delta,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
                dv.stride(0), dv.stride(1), dv.stride(2),
                *bufs, *parts, *ints, scale * _LOG2E, scale, *_dropout_args(dropout_p, seed),
                *(sargs or (*_score_args(None, 1, q.device), *_grad_args(None, q.device))))
    kv_c, q_c = plan.combine
    kv_nslot, q_nslot = ints[0], ints[1]
    H, G, Lq, Lk = ints[6], ints[7], ints[12], ints[13]
    if kv_c is not None:
        wl, nbh, _ = kv_c
        for t, part in ((dk, parts[0]), (dv, parts[1])):
            plan.launch_combine[0]((wl.n_combine, nbh), t, part, wl.combine, kv_nslot, t.stride(0), t.stride(1),
                                   t.stride(2), H // G, Lk)
    if q_c is not None:
        wl, nbh, _ = q_c
        plan.launch_combine[1]((wl.n_combine, nbh), dq, parts[2], wl.combine, q_nslot, dq.stride(0), dq.stride(1),
                               dq.stride(2), H, Lq)


def _bwd_atomic_plan(layout, s: Shapes, dtype, device, has_dropout: bool, accumulate: bool, opts: KernelOptions,
                     cfg=None) -> _Plan:
    """Launch plan of the five-GEMM backward (``kernels/backward_atomic.py``): one program per key
    tile (or column-side work item) and batch·kv-head, then ``_dq_finish``."""
    key = _plan_key("bwd_atomic", layout, s, dtype, device, has_dropout, opts, (accumulate,))
    plan = layout.cache.get(key) if cfg is None else None
    if plan is not None:
        return plan
    lbm, lbn = layout.block_size
    check_layout_block(lbm, lbn)
    _, cols, pay, modes, _ = _device_state(layout, device, opts)
    d_pad = head_dim_pad(s.D)
    wanted = atomic_bwd_config(d_pad, dtype, lbm, lbn, opts.atomic_tiles)
    fkey = ("bwd_atomic", wanted, d_pad, dtype, lbm, lbn, pay.gathers)
    if cfg is None:
        cfg = _FALLBACK.get(fkey, wanted)
    else:
        _FALLBACK[fkey] = cfg
    wl = _worklist(layout, "col", cfg.block_n, s.B * s.Hkv, device, opts)
    n_items = wl.n_items if wl is not None else _cdiv(s.Lk, cfg.block_n)
    nslot = wl.n_slots if wl is not None else 0
    lzb, lzh = _layout_strides(layout)
    consts = dict(PREDICATE=pay.fn, HAS_DROPOUT=has_dropout, USE_WORK=wl is not None, HEAD_DIM=s.D,
                  HEAD_DIM_PAD=d_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LAYOUT_BM=lbm, LAYOUT_BN=lbn,
                  DOT_PRECISION=_dot_precision(dtype, device), STAGES=cfg.num_stages,
                  MASKED_STAGES=_masked_stages(pay, cfg), COL_LUT=modes["COL_LUT"], ACCUMULATE=accumulate,
                  EVEN=_even(layout, opts), DQ_DESC=opts.dq_desc,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if modes["COL_PART_LUT"] != "load":
        consts["COL_PART_LUT"] = modes["COL_PART_LUT"]
    bufs = (*cols, pay.params, pay.aux, wl.work if wl is not None else _placeholder(torch.int32, device))
    ints = (nslot, n_items, s.B * s.H, s.H, s.G, lzb, lzh, _cdiv(s.Lk, lbn), s.Lq, s.Lk, layout.q_offset)
    n_kv = s.B * s.Hkv * nslot * cfg.block_n
    part_shapes = ((n_kv, d_pad), (n_kv, d_pad)) if nslot else ()
    combine = ((wl, s.B * s.Hkv, cfg.block_n),) if nslot else ()
    sums = dict(HEAD_DIM=s.D, HEAD_DIM_PAD=d_pad, ACCUMULATE=accumulate, num_warps=4)
    plan = _Plan((cfg,), (n_items * s.B * s.Hkv,), (bufs, ints), consts, part_shapes, combine,
                 Launch(_attn_bwd_atomic, consts, 27, device),
                 (Launch(_sum_partials, dict(sums, BLOCK=cfg.block_n), 7, device),
                  Launch(_dq_finish, dict(sums, BLOCK=64), 6, device)))
    layout.cache[key] = plan
    return plan


def _atomic_backward(q, k, v, dout, grads, lse, delta, layout, s: Shapes, scale, dropout_p, seed, acc: bool,
                     opts: KernelOptions):
    """The five-GEMM backward into ``grads`` (see :func:`triton_backward`), shrinking its tiles
    when they do not fit the device."""
    dev = q.device
    plan = _bwd_atomic_plan(layout, s, q.dtype, dev, dropout_p > 0.0, acc, opts)
    while True:
        try:
            _bwd_atomic_launch(q, k, v, dout, grads, lse, delta, plan, scale, dropout_p, seed)
            return
        except OutOfResources:
            smaller = _shrink(plan.cfg[0])
            if smaller is None:
                raise
            plan = _bwd_atomic_plan(layout, s, q.dtype, dev, dropout_p > 0.0, acc, opts, cfg=smaller)


def _bwd_atomic_launch(q, k, v, dout, grads, lse, delta, plan: _Plan, scale, dropout_p, seed):
    dq, dk, dv = grads
    (bufs, ints), consts = plan.args, plan.consts
    d_pad = consts["HEAD_DIM_PAD"]
    n_bh, H, Lq, Lk = ints[2], ints[3], ints[8], ints[9]
    dqa = torch.zeros((n_bh, Lq, d_pad), dtype=torch.float32, device=q.device)
    launch = plan.launch
    if consts["DQ_DESC"]:
        if not select.tma_ok(dqa):
            launch = Launch(_attn_bwd_atomic, dict(consts, DQ_DESC=False), 27, q.device)
        else:
            _ensure_tma_allocator(q.device)
    parts = [torch.empty(sh, dtype=torch.float32, device=q.device) for sh in plan.part_shapes]
    if not parts:
        parts = [_placeholder(torch.float32, q.device)] * 2
    launch(plan.grid, q, k, v, dout, dqa, dk, dv, lse, delta,
           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
           dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
           *bufs, *parts, *ints, scale * _LOG2E, scale, *_dropout_args(dropout_p, seed))
    if plan.combine:
        wl, nbh, _ = plan.combine[0]
        for t, part in ((dk, parts[0]), (dv, parts[1])):
            plan.launch_combine[0]((wl.n_combine, nbh), t, part, wl.combine, ints[0], t.stride(0), t.stride(1),
                                   t.stride(2), H // ints[4], Lk)
    plan.launch_combine[1]((_cdiv(Lq, 64), n_bh), dq, dqa, lse, dq.stride(0), dq.stride(1), dq.stride(2), H, Lq,
                           scale)


def merge_residue(out, lse, o2, l2, stride: int, row0: int = 0) -> None:
    """Merge a part computed on residue-class views (``o2 (B·H, S, M, D)``, ``l2 (B·H, S, M)``) into
    ``out (B, H, N, D)`` / ``lse (B, H, N)`` in place (``kernels/merge.py``); with ``stride = 1``,
    ``o2`` ``(B, H, R, D)`` may cover only the rows ``row0 .. row0 + R`` of ``out``. ``out`` and,
    with ``stride = 1``, ``o2`` may have any strides with a contiguous head dim; the other
    tensors are contiguous."""
    B, H, N1, D = out.shape
    assert out.stride(-1) == 1 and lse.is_contiguous() and l2.is_contiguous()
    N = l2.numel() // (B * H)
    if stride == 1 and o2.dim() == 4 and o2.shape[:2] == (B, H):
        assert o2.stride(-1) == 1 and o2.shape[2] == N
        s2 = o2.stride()[:3]
    else:
        assert o2.is_contiguous()
        s2 = (H * N * D, N * D, D)
    assert (stride == 1 or N == N1) and 0 <= row0 and row0 + N <= N1
    block = 64
    _merge_residue[(_cdiv(N, block), B * H)](out, lse, o2, l2, N, stride, N // stride, row0, N1, H, *out.stride()[:3],
                                             *s2, HEAD_DIM=D, HEAD_DIM_PAD=head_dim_pad(D), BLOCK=block, num_warps=4)
