"""Triton backend: launches the kernels and wires them into autograd."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import os
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
from ..mask.primitives import Causal
from ..kernels.merge import _merge_residue
from ..kernels import config as _config
from ..kernels.config import (TileConfig, atomic_bwd_config, band_backward_rows, bwd_configs, check_layout_block,
                             fwd_config, head_dim_pad, short_rows, short_partial_rows, PARTIAL_HEAVY)
from ..kernels.predicate import Payload, build_payload
from ..kernels.schedule import WorkList, build_worklist, hw_slots, worklists_enabled
from .dropout import dropout_threshold, seed_words
from ..mask.score import (ALIBI, BIAS, BIAS_KEYS_BROADCAST, BIAS_ROWS_BROADCAST, DBIAS, DSLOPES, SOFTCAP,
                          device_copy)
from .launcher import Launch
from .validate import Shapes

__all__ = ["triton_forward", "triton_backward", "set_fused_backward", "set_lut_policy",
           "set_forward_options", "GluonConfig", "set_backward_options", "GluonBwdConfig", "set_kernel_options", "merge_residue", "backward_delta"]

_LOG2E = 1.4426950408889634


def _source(layout):
    """The layout a shard was cut from (``compiler/shard.py``), else the layout itself."""
    return getattr(layout, "source", None) or layout


def _payload(layout: BlockLayout, device) -> Payload:
    """Predicate payload of a layout: a shard's comes from its source layout (global lengths, read
    with global positions) and is shared by every shard of it."""
    src = _source(layout)
    key = ("payload", device)
    pay = src.cache.get(key)
    if pay is None:
        pay = src.cache[key] = build_payload(src, device)
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


def _device_state(layout: BlockLayout, device: torch.device, row_list: int | None = None,
                  col_list: int | None = None):
    """``(rows, cols, payload, modes, positions)``: kernel tables, predicate payload and block
    position tables (shards only, else None) on ``device`` and the LUT modes of the kernel loops,
    built once and kept in the layout's cache. ``row_list``/``col_list``: the tables' list blocks
    (keys per row entry, queries per column entry; default the layout block, see
    :func:`_list_block`)."""
    key = ("triton", device, _LUT_POLICY["row_arith"], _LUT_POLICY["col_arith"], _LUT_POLICY["fwd_other"],
           row_list, col_list)
    st = layout.cache.get(key)
    if st is None:
        rows, cols = layout.kernel_tables(row_runs=_LUT_POLICY["row_arith"], col_runs=_LUT_POLICY["col_arith"],
                                          row_list=row_list, col_list=col_list)

        def prep(a):
            t = torch.from_numpy(a).to(device)
            return t if t.numel() else torch.zeros(1, dtype=torch.int32, device=device)

        other = _LUT_POLICY["fwd_other"]
        modes = dict(FULL_LUT="arith" if rows.runs else other, PART_LUT="step" if rows.part_step else other,
                     ROW_LUT="arith" if rows.runs else "load", COL_LUT="arith" if cols.runs else "load",
                     ROW_PART_LUT="step" if rows.part_step else "load", COL_PART_LUT="step" if cols.part_step else "load")
        st = (tuple(prep(a) for a in (rows.full_ptr, rows.full_idx, rows.part_ptr, rows.part_idx)),
              tuple(prep(a) for a in (cols.full_ptr, cols.full_idx, cols.part_ptr, cols.part_idx)),
              _payload(layout, device), modes, _positions(layout, device))
        layout.cache[key] = st
    return st


# How each kernel loop finds the block index of a LUT entry (``kernels/common.lut_first``).
# Chosen from an A/B on the H100 (benchmarks/experiments/ab_variants.py, NOTES.md v7): index arithmetic on
# lists that are runs of consecutive blocks speeds up the forward (sliding 0.456 -> 0.429 ms, causal
# 2.54 -> 2.44) and dQ; prefetching the other lists one entry ahead speeds up BigBird's forward
# (0.629 -> 0.594). dK/dV reads listed indices unless the listed column tables would be large
# (``COL_LIST_LIMIT``): the extra live registers of index arithmetic add spills there.
_LUT_POLICY = {"row_arith": True, "col_arith": None, "fwd_other": "prefetch"}


def set_lut_policy(**kw) -> None:
    """Change how the kernels read LUT indices (benchmarks compare the modes): ``row_arith`` (bool:
    rows whose unmasked blocks are one run are stored as runs, forward and dQ compute indices),
    ``col_arith`` (True, False, or None: only when listing would be large; the same for dK/dV's
    columns) and ``fwd_other`` (``"load"`` or ``"prefetch"``: the forward's listed indices)."""
    for k, v in kw.items():
        if k not in _LUT_POLICY:
            raise ValueError(f"unknown LUT policy {k!r}; expected one of {sorted(_LUT_POLICY)}")
        _LUT_POLICY[k] = v
    _bump()


# Forward loop options on Hopper (benchmarks/experiments/ab_variants.py compares them): K/V tiles through
# tensor descriptors (TMA) instead of pointer loads, and warp specialisation of the unmasked loop.
_FWD_OPTS = {"kv_desc": False, "warp_specialize": False, "masked_stages": None, "dense": "auto", "gluon": None,
             "interval": True}
_GLUON_OK: dict = {}  # device index -> whether the Gluon forward can run there (checked once)


def set_forward_options(**kw) -> None:
    """``kv_desc`` (bool: load K/V through tensor descriptors where the device and strides allow),
    ``warp_specialize`` (bool, needs ``kv_desc``) and ``masked_stages`` (int or None: pipelining
    depth of the masked loop). All off by default: none was faster on the H100 (NOTES.md v9).
    ``dense``: layouts whose every block is full run ``kernels/forward_ws.py`` instead: ``"ws"``
    warp-specialised (4 warps; wrong results on the H100 with triton 3.6, so refused unless
    ``BSFA_EXPERIMENTAL_WS=1``), ``"plain"`` the same loop with 8 warps, None (default) the
    block-sparse kernel. Triton specialises warps only in that kernel (NOTES.md, "Lever 4").
    ``dense="gluon"``: dense layouts (and causal ones: ``causal()`` with ``Lq == Lk``) run the
    Gluon producer/consumer kernel of ``kernels/forward_gluon.py`` on a Hopper GPU; refused where
    Triton has no Gluon, under the interpreter, or without a CUDA device of compute capability 9.
    ``dense="auto"`` (the default): ``"gluon"`` where it can run (on the H100: dense 1.41x and
    causal 1.38x our block-sparse forward, 1.07x / 1.09x cuDNN; NOTES.md "Gluon forward"), else None.
    ``gluon``: that kernel's tiles, a :class:`GluonConfig` (None: the default one).
    ``interval`` (bool, default True): where the Gluon forward is on, it also runs layouts whose mask
    keeps one key interval per query row (``compiler/intervals.row_interval``: windows, documents,
    their combinations with ``causal()``), masking each partial block with the rows' bounds."""
    for k, v in kw.items():
        if k not in _FWD_OPTS:
            raise ValueError(f"unknown forward option {k!r}; expected one of {sorted(_FWD_OPTS)}")
        if k == "dense" and v not in (None, "auto", "ws", "plain", "gluon"):
            raise ValueError(f"set_forward_options(dense={v!r}): expected None, 'auto', 'plain', 'ws' or 'gluon'")
        if k == "dense" and v == "ws" and os.environ.get("BSFA_EXPERIMENTAL_WS") != "1":
            raise ValueError("set_forward_options(dense='ws'): the warp-specialised dense forward fails the "
                             "float64 check on the H100 with triton 3.6 (error 11x that of eager bf16; NOTES.md, "
                             "'Lever 4'); set BSFA_EXPERIMENTAL_WS=1 to run it anyway for experiments, or use "
                             "dense='plain'")
        if k == "dense" and v == "gluon":
            why = _gluon_unavailable()
            if why:
                raise ValueError(f"set_forward_options(dense='gluon'): {why}")
        if k == "gluon" and v is not None and not isinstance(v, GluonConfig):
            raise ValueError(f"set_forward_options(gluon=...): expected a GluonConfig or None, got {v!r}")
        if k == "interval" and not isinstance(v, bool):
            raise ValueError(f"set_forward_options(interval=...): expected a bool, got {v!r}")
        _FWD_OPTS[k] = v
    _bump()


@dataclass(frozen=True)
class GluonConfig:
    """Tiles of the Gluon forward (``kernels/forward_gluon.py``): ``block_m`` query rows per consumer
    warp group (a program covers two), ``block_n`` keys per step, ``stages`` K/V slots in shared
    memory, ``pingpong`` (the two groups take turns issuing their products), ``overlap`` (each
    group issues S_j = Q·K_jᵀ together with the previous block's P·V), register budgets of the
    producer and the consumers (``setmaxnreg``). Causal layouts need ``block_n == 2·block_m``."""

    block_m: int = 64
    block_n: int = 128
    stages: int = 2
    pingpong: bool = True
    overlap: bool = True
    producer_regs: int = 24
    consumer_regs: int = 240


def _gluon_here(dev: torch.device) -> bool:
    """Whether the Gluon forward runs on CUDA device ``dev`` (checked once per device)."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    ok = _GLUON_OK.get(idx)
    if ok is None:
        with torch.cuda.device(idx):
            ok = _GLUON_OK[idx] = _gluon_unavailable() == ""
    return ok


def _gluon_unavailable() -> str:
    """Why the Gluon forward cannot run here ('' when it can)."""
    if not _fg.gluon_available():
        return f"this Triton ({triton.__version__}) has no usable Gluon Hopper API ({_fg.GLUON_IMPORT_ERROR})"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "Gluon kernels do not run in Triton's interpreter (TRITON_INTERPRET=1)"
    if not torch.cuda.is_available():
        return "it needs a CUDA GPU of compute capability 9.x (Hopper); none is available"
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        return f"it needs a GPU of compute capability 9.x (Hopper, wgmma); this one is {cap[0]}.{cap[1]}"
    return ""


# Backward on Hopper for dense and causal layouts: the Gluon kernels of kernels/backward_gluon.py.
_BWD_OPTS = {"dense": "auto", "gluon": None}


def set_backward_options(**kw) -> None:
    """``dense="gluon"``: layouts whose every block is full (and ``causal()`` with ``Lq == Lk``)
    run the Gluon backward of ``kernels/backward_gluon.py`` on a Hopper GPU (lengths multiples of
    its tiles, head dim 64 or 128, 16-bit inputs, no dropout, score modifier, ``accumulate``,
    ``dlse``, other gradient dtype or shard; anything else takes the block-sparse kernels).
    Deterministic calls (:func:`triton_backward`'s ``deterministic``) run its dK/dV and dQ kernels;
    non-deterministic ones the dK/dV kernel with atomic dQ. Refused where Triton has no Gluon,
    under the interpreter, or without a CUDA device of compute capability 9. ``"auto"`` (the
    default): the Gluon backward with its deterministic dQ kernel wherever it runs (on the H100 at
    16K: dense 1.14x, causal 1.15x our block-sparse backward; the atomic dQ is 2x slower, NOTES.md
    "Gluon backward"), else the block-sparse kernels. None: off.
    ``gluon``: its tiles, a :class:`GluonBwdConfig` (None: the default one)."""
    for k, v in kw.items():
        if k not in _BWD_OPTS:
            raise ValueError(f"unknown backward option {k!r}; expected one of {sorted(_BWD_OPTS)}")
        if k == "dense" and v not in (None, "auto", "gluon"):
            raise ValueError(f"set_backward_options(dense={v!r}): expected None, 'auto' or 'gluon'")
        if k == "dense" and v == "gluon":
            why = _gluon_unavailable()
            if why:
                raise ValueError(f"set_backward_options(dense='gluon'): {why}")
        if k == "gluon" and v is not None and not isinstance(v, GluonBwdConfig):
            raise ValueError(f"set_backward_options(gluon=...): expected a GluonBwdConfig or None, got {v!r}")
        _BWD_OPTS[k] = v
    _bump()


@dataclass(frozen=True)
class GluonBwdConfig:
    """Tiles of the Gluon backward (``kernels/backward_gluon.py``). dK/dV kernel: ``block_n`` keys
    per consumer warp group (a program covers two), ``block_m`` query rows per step, ``stages``
    Q/dO slots. dQ kernel: ``dq_block_m`` query rows per consumer group (a program covers two),
    ``dq_block_n`` keys per step, ``dq_stages`` K/V slots. Register budgets of the producer and
    the consumers (``setmaxnreg``). Causal layouts need ``block_m | 2·block_n`` and
    ``dq_block_n | 2·dq_block_m``.

    Schedules (each kernel): ``pingpong`` / ``dq_pingpong``: the two consumer groups take turns
    issuing a step's first products (a pair of mbarriers passes the turn). ``overlap`` /
    ``dq_overlap``: a step's last product (``dK += dSᵀ·Q``, ``dQ += dS·K``) is issued with the next
    step's first two, so that the elementwise work of a step runs while the tensor cores finish
    the previous one; the slot of step ``t`` is released in step ``t + 1`` (3 stages keep the
    loads ahead). 0: off; 1: dS carried in registers; 2: dS through a shared-memory tile per
    group (fewer live registers; sm_90 compile: no spills inside the step loops, where 1 spills).
    ``overlap`` applies to the deterministic dK/dV kernel only (the atomic-dQ one ignores it)."""

    block_m: int = 64
    block_n: int = 64
    stages: int = 2
    dq_block_m: int = 64
    dq_block_n: int = 128  # H100, 16K: dense backward 12.06 -> 11.42 ms against 64 (causal within 1 %)
    dq_stages: int = 2
    producer_regs: int = 24
    consumer_regs: int = 240
    pingpong: bool = False
    overlap: int = 0
    dq_pingpong: bool = False
    dq_overlap: int = 0

    def __post_init__(self):
        for name in ("overlap", "dq_overlap"):
            if getattr(self, name) not in (0, 1, 2):
                raise ValueError(f"GluonBwdConfig({name}={getattr(self, name)!r}): expected 0, 1 or 2")
        for name in ("stages", "dq_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"GluonBwdConfig({name}={getattr(self, name)!r}): expected at least 1")
        if self.overlap and self.stages < 2:
            raise ValueError(f"GluonBwdConfig: overlap={self.overlap} needs stages >= 2, got {self.stages}")
        if self.dq_overlap and self.dq_stages < 2:
            raise ValueError(f"GluonBwdConfig: dq_overlap={self.dq_overlap} needs dq_stages >= 2, got "
                             f"{self.dq_stages}")


def _gluon_bwd_case(layout: BlockLayout, s: Shapes, *ts) -> str | None:
    """``"dense"`` or ``"causal"`` when ``kernels/backward_gluon.py`` computes this call exactly with
    the configured tiles, else None: every block full (or ``causal()``, top-left, ``Lq == Lk``),
    both lengths multiples of every tile of both kernels, head dim 64 or 128, 16-bit CUDA tensors
    that tensor descriptors can address."""
    cfg = _BWD_OPTS["gluon"] or GluonBwdConfig()
    if layout.batch_shape or getattr(layout, "positions", None) is not None:
        return None
    if s.D not in (64, 128) or not ts[0].is_cuda or ts[0].dtype not in (torch.float16, torch.bfloat16):
        return None
    if s.Lq == 0 or s.Lk == 0 or s.Lq % max(cfg.block_m, 2 * cfg.dq_block_m) or s.Lq % cfg.block_m:
        return None
    if s.Lk % max(2 * cfg.block_n, cfg.dq_block_n) or s.Lk % cfg.dq_block_n or not _tma_ok(*ts):
        return None
    if layout.n_partial == 0 and layout.n_full == layout.n_blocks:
        return "dense"
    if (isinstance(layout.mask, Causal) and layout.q_offset == 0 and s.Lq == s.Lk
            and (2 * cfg.block_n) % cfg.block_m == 0 and (2 * cfg.dq_block_m) % cfg.dq_block_n == 0):
        return "causal"
    return None


def _gluon_bwd_launch(q, k, v, dout, grads, lse, delta, s: Shapes, scale: float, causal: bool, atomic: bool,
                      cfg: GluonBwdConfig | None = None) -> None:
    """The Gluon backward into ``grads``: the dK/dV kernel (grid ``(Lk / (2·block_n), B·H // G)``),
    then the dQ kernel (grid ``(Lq / (2·dq_block_m), B·H)``) or, with ``atomic``, ``_dq_finish``
    on the fp32 buffer the dK/dV kernel added dQ to."""
    _ensure_tma_allocator(q.device)
    cfg = cfg or _BWD_OPTS["gluon"] or GluonBwdConfig()
    dq, dk, dv = grads
    qk = scale * _LOG2E
    # the dK/dV kernel reads Q and dO of a GQA group through one descriptor over its heads
    qg, dog = q, dout
    if s.G > 1:
        qg, dog = (t if t.stride(1) == s.Lq * t.stride(2) else t.contiguous() for t in (q, dout))
    dqa = (torch.zeros((s.B * s.H, s.Lq, s.D), dtype=torch.float32, device=q.device) if atomic
           else _placeholder(torch.float32, q.device))
    _bg._attn_bwd_dkdv_gluon[(s.Lk // (2 * cfg.block_n), s.B * s.Hkv)](
        qg, k, v, dog, dk, dv, dqa, lse, delta,
        qg.stride(0), qg.stride(1), qg.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dog.stride(0), dog.stride(1), dog.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        s.H, s.G, s.Lq, s.Lk, qk, scale, HEAD_DIM=s.D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        STAGES=cfg.stages, CAUSAL=causal, ATOMIC_DQ=atomic, PINGPONG=cfg.pingpong,
        OVERLAP=0 if atomic else cfg.overlap, PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs,
        num_warps=4)
    if atomic:
        _dq_finish[(_cdiv(s.Lq, 64), s.B * s.H)](dq, dqa, lse, dq.stride(0), dq.stride(1), dq.stride(2), s.H, s.Lq,
                                                 scale, HEAD_DIM=s.D, HEAD_DIM_PAD=s.D, BLOCK=64, ACCUMULATE=False,
                                                 num_warps=4)
        return
    _bg._attn_bwd_dq_gluon[(s.Lq // (2 * cfg.dq_block_m), s.B * s.H)](
        q, k, v, dout, dq, lse, delta,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        s.H, s.G, s.Lq, s.Lk, qk, scale, HEAD_DIM=s.D, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n,
        STAGES=cfg.dq_stages, CAUSAL=causal, PINGPONG=cfg.dq_pingpong, OVERLAP=cfg.dq_overlap,
        PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs, num_warps=4)


# Kernel variants chosen per launch plan (benchmarks/experiments/kernel_ab.py compares them):
# ``even``: when the lengths are multiples of the layout blocks, the masked loops drop their bounds
# terms and row checks (sm_90 SASS, NOTES.md "Partial blocks": forward masked loop 1389 -> 1257
# instructions, dK/dV 1994 -> 1488, dQ 1233 -> 1104). A length that is not a multiple then compiles
# one more variant. On by default: on the H100 it gains 3-6 % fwd+bwd on Longformer, BigBird,
# windows and documents at 16K and changes nothing elsewhere (NOTES.md, "Lever 2: GPU result").
# ``deterministic``: the default of ``triton_backward(deterministic=None)``: True runs the dK/dV and
# dQ programs (seven GEMMs per visited block, bit-reproducible); False the five-GEMM backward whose
# dK/dV programs add dQ with fp32 atomics (kernels/backward_atomic.py). ``dq_desc``: those adds as
# TMA reduce-adds of whole tiles through a tensor descriptor (Hopper).
# ``lists``: how finely the kernels' lists are classified (compiler/finer.py): ``"coarse"`` lists
# layout blocks; ``"fine"`` the blocks of a classification at the kernel tile's step along the loop
# (forward/dQ: (bm, BLOCK_N) rows, dK/dV: (BLOCK_M, bn) columns), so every loop iteration is one
# tile and empty tiles inside partial layout blocks are skipped; ``"half"`` the blocks of half the
# layout block (at least the step); ``"auto"`` lets a cost model choose between the layout block and
# its half per layout and side (compiler/finer.pick_list_block). Partial area at 16K (NOTES.md "Lever 5"):
# Longformer -25 %, BigBird -50 %, documents -16 %, sliding windows and causal unchanged.
# ``list_stages``: with finer lists, ``"same"`` keeps each kernel's stage count (fewer tiles in
# flight, less shared memory: forward 128x64 at 3 stages 224 -> 128 KB on sm_90), ``"tiles"``
# multiplies it by the tiles per layout block (the same tiles in flight and shared memory).
_KERNEL_OPTS = {"even": True, "deterministic": True, "dq_desc": False, "lists": "coarse", "list_stages": "same"}
_LIST_MODES = ("coarse", "half", "fine", "auto")


def set_kernel_options(**kw) -> None:
    """``even`` (bool, default True): let the forward and backward drop the masked loops' bounds
    checks where the lengths are multiples of the layout blocks (one more compiled variant per
    kernel when lengths of both kinds occur).
    ``deterministic`` (bool): the backward's default (see :func:`triton_backward`). ``dq_desc``
    (bool): the five-GEMM backward adds dQ tiles through a tensor descriptor (TMA) where the device
    allows. ``lists`` (``"coarse"``, ``"half"``, ``"fine"`` or ``"auto"``): the granularity of the
    kernels' lists: layout blocks, half layout blocks, blocks of the kernel tile's step along each
    loop (empty tiles skipped, full ones unmasked), or layout or half blocks chosen per layout and
    side by a cost model (``compiler/finer.py``).
    ``list_stages`` (``"same"`` or ``"tiles"``): with finer lists, keep each loop's stage count, or
    multiply it by the tiles per layout block (as many tiles in flight as over layout blocks)."""
    for k, v in kw.items():
        if k not in _KERNEL_OPTS:
            raise ValueError(f"unknown kernel option {k!r}; expected one of {sorted(_KERNEL_OPTS)}")
        if k == "lists" and v not in _LIST_MODES:
            raise ValueError(f"set_kernel_options(lists={v!r}): expected one of {_LIST_MODES}")
        if k == "list_stages" and v not in ("same", "tiles"):
            raise ValueError(f"set_kernel_options(list_stages={v!r}): expected 'same' or 'tiles'")
        _KERNEL_OPTS[k] = v
    _bump()


def _tma_ok(*ts: torch.Tensor) -> bool:
    """Tensor descriptors need a Hopper-class GPU, 16-byte aligned bases and 16-byte row strides."""
    if not all(t.is_cuda for t in ts) or torch.cuda.get_device_capability(ts[0].device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(-2) * t.element_size()) % 16 == 0
               and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1]) for t in ts)


_ALLOCATOR_SET = threading.local()  # .done: this thread set an allocator (where Triton's hook is not readable)
try:  # triton 3.6 / 3.9: the hook is a ContextVar holding a NullAllocator until one is set
    from triton.runtime import _allocation as _triton_alloc
except ImportError:  # pragma: no cover - depends on the installed Triton
    _triton_alloc = None


def _ensure_tma_allocator(device: torch.device) -> None:
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


def _tile_class(layout: BlockLayout) -> tuple[bool, bool, bool, bool]:
    """``(band, short_partial, partial_heavy, band_bwd)`` of a layout's shape (``kernels/config.py``),
    cached on the layout: the launchers ask on every call."""
    cls = layout.cache.get("tile_class")
    if cls is None:  # a shard takes its source's class: the same kernels as the unsharded run
        src = _source(layout)
        mean_row = src.n_nonempty / max(1, src.n_rows)
        pf = src.partial_fraction
        cls = (short_rows(mean_row, pf), short_partial_rows(mean_row, pf),
               src.n_nonempty > 0 and pf >= PARTIAL_HEAVY, band_backward_rows(mean_row, pf))
        layout.cache["tile_class"] = cls
    return cls


def _list_block(layout: BlockLayout, side: str, step: int, flat: bool = False) -> int | None:
    """List block of one side under the ``lists`` kernel option: keys per row entry (``side="row"``,
    forward and dQ) or queries per column entry (``"col"``, dK/dV) for kernel tiles that step
    ``step`` along the loop; None for the layout block. A shard follows its source layout's choice
    (the same kernels on every rank)."""
    mode = _KERNEL_OPTS["lists"]
    if mode == "coarse":
        return None
    u = pick_list_block(_source(layout), side, step, flat, force=None if mode == "auto" else mode)
    lbm, lbn = layout.block_size
    return None if u == (lbn if side == "row" else lbm) else u


def _deepen(layout: BlockLayout, side: str, cfg: TileConfig) -> TileConfig:
    """``cfg`` with its stages multiplied by the layout blocks' tiles per list entry when that side
    runs finer lists and the ``list_stages`` option is ``"tiles"``: the loop then keeps as many
    kernel tiles in flight (and as much shared memory) as it does over layout blocks, where every
    unrolled tile of an entry has its own stage buffers. With ``"same"`` the stage count stays."""
    if _KERNEL_OPTS["list_stages"] != "tiles" or cfg.flat:
        return cfg
    step = cfg.block_n if side == "row" else cfg.block_m
    unit = _list_block(layout, side, step)
    if unit is None:
        return cfg
    lbm, lbn = layout.block_size
    ratio = (lbn if side == "row" else lbm) // unit
    return TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages * ratio, cfg.flat)


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
    _bump()


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


def _worklist(layout: BlockLayout, side: str, tile: int, n_heads: int, device, unit: int | None = None
              ) -> WorkList | None:
    """Cached work list for the row side (forward, dQ) or column side (dK/dV) at this tile size, over
    the tables of list block ``unit`` (default the layout block)."""
    if not worklists_enabled(layout):
        return None
    force = _SPLIT_OVERRIDE.get("chunk")
    key = (side, tile, n_heads, device, force, unit)
    key = ("worklist", *key)
    wl = layout.cache.get(key)
    if wl is None:
        row_list, col_list = (unit, None) if side == "row" else (None, unit)
        rows, cols = layout.kernel_tables(row_runs=_LUT_POLICY["row_arith"], col_runs=_LUT_POLICY["col_arith"],
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


_VERSION = [0]  # bumped by every setter of a module-level option: plans built before are not reused


def _bump() -> None:
    _VERSION[0] += 1


def _plan_key(kind: str, layout, s: Shapes, dtype, device, has_dropout: bool, extra=()):
    return (kind, device, dtype, s.B, s.H, s.Hkv, s.D, has_dropout, _VERSION[0], _config.OVERRIDE_VERSION[0], *extra)


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


def _fwd_plan(layout, s: Shapes, dtype, device, has_dropout: bool, cfg=None, out_dtype=None,
              smod_kind: int = 0, bias_dtype=None) -> _Plan:
    key = _plan_key("fwd", layout, s, dtype, device, has_dropout, (out_dtype, smod_kind, bias_dtype))
    plan = layout.cache.get(key) if cfg is None else None
    if plan is not None:
        return plan
    lbm, lbn = layout.block_size
    check_layout_block(lbm, lbn)
    d_pad = head_dim_pad(s.D)
    wanted = _deepen(layout, "row", fwd_config(d_pad, dtype, lbm, lbn, _is_band(layout), _is_short_partial(layout)))
    fkey = ("fwd", wanted, d_pad, dtype, lbm, lbn, _payload(layout, device).gathers)  # the config that fits
    if cfg is None:
        cfg = _FALLBACK.get(fkey, wanted)
    else:
        _FALLBACK[fkey] = cfg
    unit = _list_block(layout, "row", cfg.block_n)
    rows, _, pay, modes, pos = _device_state(layout, device, row_list=unit)
    wl = _worklist(layout, "row", cfg.block_m, s.B * s.H, device, unit)
    nslot = wl.n_slots if wl is not None else 0
    grid = (wl.n_items if wl is not None else _cdiv(s.Lq, cfg.block_m), s.B * s.H)
    work = wl.work if wl is not None else _placeholder(torch.int32, device)
    lzb, lzh = _layout_strides(layout)
    n_part = s.B * s.H * nslot * cfg.block_m
    consts = dict(PREDICATE=pay.fn, HAS_DROPOUT=has_dropout, USE_WORK=wl is not None, HEAD_DIM=s.D,
                  HEAD_DIM_PAD=d_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LAYOUT_BM=lbm, LAYOUT_BN=lbn,
                  DOT_PRECISION=_dot_precision(dtype, device), STAGES=cfg.num_stages,
                  MASKED_STAGES=_FWD_OPTS["masked_stages"] or _masked_stages(pay, cfg), num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, FULL_LUT=modes["FULL_LUT"], PART_LUT=modes["PART_LUT"],
                  KV_DESC=False, WARP_SPEC=False)
    if _KERNEL_OPTS["even"] and layout.kv_len % lbn == 0:
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


def _dense_ok(layout: BlockLayout, s: Shapes, dropout_p: float, *ts) -> bool:
    """Whether ``kernels/forward_ws.py`` computes this call exactly: every block full, no ragged key
    edge, no dropout, a power-of-two head dim, 16-bit inputs on a Hopper GPU (or the interpreter)."""
    if _FWD_OPTS["dense"] is None or dropout_p > 0.0 or layout.batch_shape or layout.kv_len % _DENSE_BLOCK:
        return False
    if layout.n_partial or layout.n_full != layout.n_blocks or head_dim_pad(s.D) != s.D or s.D > 128:
        return False
    if ts[0].device.type == "cpu":  # the interpreter: descriptors need no alignment there
        return True
    return ts[0].dtype in (torch.float16, torch.bfloat16) and _tma_ok(*ts)


def _dense_launch(q, k, v, out, lse, s: Shapes, scale: float) -> None:
    _ensure_tma_allocator(q.device)
    ws = _FWD_OPTS["dense"] == "ws"
    _attn_fwd_ws[(_cdiv(s.Lq, _DENSE_BLOCK), s.B * s.H)](
        q, k, v, out, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        s.H, s.G, s.Lq, s.Lk, scale * _LOG2E, HEAD_DIM=s.D, BLOCK_M=_DENSE_BLOCK, BLOCK_N=_DENSE_BLOCK,
        WARP_SPEC=ws, num_warps=4 if ws else 8, num_stages=2)


def _gluon_case(layout: BlockLayout, s: Shapes, dropout_p: float, *ts) -> str | None:
    """``"dense"``, ``"causal"`` or ``"interval"`` when ``kernels/forward_gluon.py`` computes this
    call exactly with the configured tiles, else None: every block full (or the ``causal()`` mask,
    top-left aligned, ``Lq == Lk``; or, with ``set_forward_options(interval=True)``, a mask with one
    key interval per query row, batch/head-dependent ones included), key length a multiple of
    ``block_n``, no dropout, head dim 64 or 128, 16-bit CUDA tensors that tensor descriptors can
    address."""
    cfg = _FWD_OPTS["gluon"] or GluonConfig()
    if dropout_p > 0.0 or getattr(layout, "positions", None) is not None:
        return None
    if s.D not in (64, 128) or not ts[0].is_cuda or ts[0].dtype not in (torch.float16, torch.bfloat16):
        return None
    if layout.kv_len % cfg.block_n or layout.kv_len == 0 or not _tma_ok(*ts):
        return None
    if not layout.batch_shape:
        if layout.n_partial == 0 and layout.n_full == layout.n_blocks:
            return "dense"
        if (isinstance(layout.mask, Causal) and layout.q_offset == 0 and s.Lq == s.Lk
                and cfg.block_n == 2 * cfg.block_m):
            return "causal"
    if _FWD_OPTS["interval"] and row_interval(layout) is not None:
        return "interval"
    return None


def _gluon_interval_tables(layout: BlockLayout, cfg: "GluonConfig", device):
    """``(LO, HI, TILES)`` int32 device tensors of the Gluon forward's interval mode, built once per
    layout, tiles and device: the rows' key intervals ``(Z, P·rows)`` (padded to whole programs with
    the last row's interval), and per program ``(tile, kb0, e1, e2, n_blocks)`` ``(Z, P, 5)``, the
    heaviest programs first (``kernels/forward_gluon._attn_fwd_gluon``)."""
    key = ("gluon_interval", device, cfg.block_m, cfg.block_n)
    hit = layout.cache.get(key)
    if hit is not None:
        return hit
    lo, hi = row_interval(layout)
    rows = 2 * cfg.block_m
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


def _gluon_launch(q, k, v, out, lse, s: Shapes, scale: float, case: str, cfg: GluonConfig | None = None,
                  layout: BlockLayout | None = None) -> None:
    """The Gluon forward (``kernels/forward_gluon.py``): grid ``(cdiv(Lq, 2·block_m), B·H)``;
    ``case`` from :func:`_gluon_case` (``"interval"`` needs ``layout``)."""
    _ensure_tma_allocator(q.device)
    cfg = cfg or _FWD_OPTS["gluon"] or GluonConfig()
    if case == "interval":
        lo, hi, tiles = _gluon_interval_tables(layout, cfg, q.device)
        lzb, lzh = _layout_strides(layout)
    else:
        lo = hi = tiles = _placeholder(torch.int32, q.device)
        lzb = lzh = 0
    _fg._attn_fwd_gluon[(_cdiv(s.Lq, 2 * cfg.block_m), s.B * s.H)](
        q, k, v, out, lse, lo, hi, tiles, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        s.H, s.G, lzb, lzh, s.Lq, s.Lk, scale * _LOG2E, HEAD_DIM=s.D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        STAGES=cfg.stages, CAUSAL=case == "causal", INTERVAL=case == "interval", PINGPONG=cfg.pingpong,
        OVERLAP=cfg.overlap, PRODUCER_REGS=cfg.producer_regs, CONSUMER_REGS=cfg.consumer_regs, num_warps=4)


def triton_forward(q, k, v, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int,
                   out_dtype=None, score_mod=None):
    """Forward kernel; returns ``out (B, H, Lq, D)`` (q's dtype, or ``out_dtype``: float32 keeps a
    partial result exact for a later merge) and ``lse (B, H, Lq)`` float32. ``score_mod``: a
    :class:`~blocksparse_fa.mask.score.ScoreMod` or None."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    dev = q.device
    odt = None if out_dtype in (None, q.dtype) else out_dtype
    out = torch.empty(q.shape, dtype=odt or q.dtype, device=dev)
    lse = torch.empty((s.B, s.H, s.Lq), dtype=torch.float32, device=dev)
    dense = _FWD_OPTS["dense"]
    if dense == "auto":
        dense = "gluon" if q.is_cuda and _gluon_here(dev) else None
    if dense == "gluon" and odt is None and score_mod is None:
        case = _gluon_case(layout, s, dropout_p, q, k, v, out)
        if case is not None:
            _gluon_launch(q, k, v, out, lse, s, scale, case, layout=layout)
            return out, lse
    elif (dense is not None and dense != "gluon" and odt is None and score_mod is None
            and _dense_ok(layout, s, dropout_p, q, k, v, out)):
        _dense_launch(q, k, v, out, lse, s, scale)
        return out, lse
    kind = _kind(score_mod)
    sargs = _score_args(score_mod, s.H, dev)
    bdt = _bias_dtype(score_mod)
    plan = _fwd_plan(layout, s, q.dtype, dev, dropout_p > 0.0, out_dtype=odt, smod_kind=kind, bias_dtype=bdt)
    while True:
        try:
            _fwd_launch(q, k, v, out, lse, plan, scale, dropout_p, seed, sargs)
            return out, lse
        except OutOfResources:
            smaller = _shrink(plan.cfg[0])
            if smaller is None:
                raise
            plan = _fwd_plan(layout, s, q.dtype, dev, dropout_p > 0.0, cfg=smaller, out_dtype=odt, smod_kind=kind,
                             bias_dtype=bdt)


def _fwd_launch(q, k, v, out, lse, plan: _Plan, scale, dropout_p, seed, sargs):
    (bufs, ints), consts = plan.args, plan.consts
    parts = [torch.empty(sh, dtype=torch.float32, device=q.device) for sh in plan.part_shapes]
    if not parts:
        parts = [_placeholder(torch.float32, q.device)] * 2
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2))
    tail = (*bufs, *parts, *ints, scale * _LOG2E, *_dropout_args(dropout_p, seed), *sargs)
    if _FWD_OPTS["kv_desc"] and _tma_ok(k, v):
        _ensure_tma_allocator(q.device)
        consts = dict(consts, KV_DESC=True, WARP_SPEC=_FWD_OPTS["warp_specialize"])
        _attn_fwd[plan.grid](q, k, v, out, lse, *strides, *tail, **consts)
    else:
        plan.launch(plan.grid, q, k, v, out, lse, *strides, *tail)
    for (wl, nbh, block), launch in zip(plan.combine, plan.launch_combine):
        nslot, H, Lq = ints[0], ints[1], ints[6]
        launch((wl.n_combine, nbh), out, lse, parts[0], parts[1], wl.combine, nslot, out.stride(0), out.stride(1),
               out.stride(2), H, Lq)


_PRE: dict = {}  # head dim -> launcher of the backward's preprocess


def backward_delta(out, dout, lse, s: Shapes, dlse=None) -> torch.Tensor:
    """``delta = rowsum(dO ∘ O) − dlse`` ``(B, H, Lq)`` float32: the backward's per-row term
    (``dlse``, the gradient of the returned logsumexp, enters because ``∂lse/∂s = p``)."""
    out, dout = _last_dim_contiguous(out), _last_dim_contiguous(dout)
    delta = torch.empty((s.B, s.H, s.Lq), dtype=torch.float32, device=out.device)
    pre_m = 64
    launch = _PRE.get((s.D, out.device))  # the launcher keys on the tensors' dtypes itself
    if launch is None:
        launch = _PRE[(s.D, out.device)] = Launch(
            _attn_bwd_preprocess, dict(HEAD_DIM=s.D, HEAD_DIM_PAD=head_dim_pad(s.D), BLOCK_M=pre_m), 11, out.device)
    launch((_cdiv(s.Lq, pre_m), s.B * s.H), out, dout, delta, out.stride(0), out.stride(1), out.stride(2),
           dout.stride(0), dout.stride(1), dout.stride(2), s.H, s.Lq)
    if dlse is not None:
        delta.sub_(torch.where(torch.isinf(lse), torch.zeros_like(lse), dlse.float()))
    return delta


def _bwd_plan(layout, s: Shapes, dtype, device, has_dropout: bool, accumulate: bool, run=(True, True),
              cfgs=None, grad_dtype=None, smod_kind: int = 0, bias_dtype=None) -> _Plan:
    key = _plan_key("bwd", layout, s, dtype, device, has_dropout, (accumulate, run, grad_dtype, smod_kind, bias_dtype))
    plan = layout.cache.get(key) if cfgs is None else None
    if plan is not None:
        return plan
    lbm, lbn = layout.block_size
    check_layout_block(lbm, lbn)
    d_pad = head_dim_pad(s.D)
    kv_want, q_want = bwd_configs(d_pad, dtype, lbm, lbn, _is_band(layout), _is_partial_heavy(layout),
                                  _tile_class(layout)[3])
    wanted = (_deepen(layout, "col", kv_want), _deepen(layout, "row", q_want))
    fkey = ("bwd", run, wanted, d_pad, dtype, lbm, lbn, _payload(layout, device).gathers)  # the configs that fit
    if cfgs is None:
        cfgs = _FALLBACK.get(fkey, wanted)
    else:
        _FALLBACK[fkey] = cfgs
    cfg_kv, cfg_q = cfgs
    run_kv, run_q = run
    kv_unit = _list_block(layout, "col", cfg_kv.block_m, cfg_kv.flat) if run_kv else None
    q_unit = _list_block(layout, "row", cfg_q.block_n, cfg_q.flat) if run_q else None
    rows, cols, pay, modes, pos = _device_state(layout, device, row_list=q_unit, col_list=kv_unit)
    wl_kv = _worklist(layout, "col", cfg_kv.block_n, s.B * s.Hkv, device, kv_unit)
    wl_q = _worklist(layout, "row", cfg_q.block_m, s.B * s.H, device, q_unit)
    ph = _placeholder(torch.int32, device)
    n_kv_items = wl_kv.n_items if wl_kv is not None else _cdiv(s.Lk, cfg_kv.block_n)
    n_q_items = wl_q.n_items if wl_q is not None else _cdiv(s.Lq, cfg_q.block_m)
    n_kv_progs = n_kv_items * s.B * s.Hkv if run_kv else 0
    n_progs = n_kv_progs + (n_q_items * s.B * s.H if run_q else 0)
    kv_nslot = wl_kv.n_slots if wl_kv is not None and run_kv else 0
    q_nslot = wl_q.n_slots if wl_q is not None and run_q else 0
    head_major = _FUSED_BWD["head_major"]
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
    if _even(layout):
        consts["EVEN"] = True
    if cfg_kv.flat or cfg_q.flat:
        consts.update(KV_FLAT=cfg_kv.flat, Q_FLAT=cfg_q.flat)
    if pos is not None:
        consts["HAS_POS"] = True
    if smod_kind:
        consts["SCORE_MOD"] = smod_kind
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


def _even(layout: BlockLayout) -> bool:
    """Both lengths are multiples of the layout blocks and the ``even`` option is on."""
    lbm, lbn = layout.block_size
    return bool(_KERNEL_OPTS["even"]) and layout.q_len % lbm == 0 and layout.kv_len % lbn == 0


def triton_backward(q, k, v, out, lse, dout, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int,
                    dlse=None, delta=None, accumulate=None, deterministic: bool | None = None, grad_dtype=None,
                    score_mod=None, score_grads=None):
    """Backward kernels; returns ``(dq, dk, dv)`` in the inputs' dtype. ``dlse`` (gradient of the
    returned logsumexp, optional) enters as ``delta - dlse``: ``∂lse/∂s = p``.

    ``delta``: precomputed :func:`backward_delta` (then ``out`` and ``dlse`` are not read).
    ``accumulate``: ``(dq, dk, dv)`` tensors (any strides) to add this layout's gradients to; they
    are returned.
    ``deterministic``: True runs separate dK/dV and dQ programs, every output tile owned by one
    program (bit-reproducible); False the five-GEMM backward, whose dK/dV programs add dQ in fp32
    with atomics (dQ may differ in the last bits between runs; dK and dV do not). None: the
    ``deterministic`` kernel option (:func:`set_kernel_options`, default True). Shards of a layout
    (``compiler/shard.py``) always run the deterministic kernels, which read block position tables.
    ``grad_dtype``: dtype of new gradients (default the inputs'; float32 keeps partial gradients
    exact for a later sum).
    ``score_mod``: the forward's :class:`~blocksparse_fa.mask.score.ScoreMod` or None (it runs the
    deterministic kernels). ``score_grads``: ``(dslopes (H,), dbias)`` float32 buffers (or None
    each; dbias shaped like the bound 4-D bias) that the dK/dV programs add the gradients of the
    slopes and of the bias to, with atomic adds (see ``kernels/backward._attn_bwd``)."""
    q, k, v, dout = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, dout))
    lse = lse.contiguous()  # the kernels index it as (B·H, Lq)
    dev = q.device
    if delta is None:
        delta = backward_delta(out, dout, lse, s, dlse)
    gdt = None if grad_dtype in (None, q.dtype) or accumulate is not None else grad_dtype
    if accumulate is None:
        dq, dk, dv = (torch.empty(t.shape, dtype=gdt or t.dtype, device=dev) for t in (q, k, v))
    else:
        dq, dk, dv = accumulate
        for name, g, t in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            if g.shape != t.shape or g.dtype != t.dtype or g.stride(-1) != 1:
                raise ValueError(f"accumulate: {name} must have shape {tuple(t.shape)}, dtype {t.dtype} and a "
                                 f"contiguous last dim, got {tuple(g.shape)}, {g.dtype}, strides {g.stride()}")
    grads = (dq, dk, dv)
    has_drop, acc = dropout_p > 0.0, accumulate is not None
    if deterministic is None:
        deterministic = _KERNEL_OPTS["deterministic"]
    gmode = _BWD_OPTS["dense"]
    if gmode == "auto":
        gmode = "auto" if q.is_cuda and _gluon_here(dev) else None
    if (gmode is not None and not has_drop and not acc and gdt is None and score_mod is None
            and dlse is None):
        case = _gluon_bwd_case(layout, s, q, k, v, dout, dq, dk, dv)
        if case is not None:  # "auto" keeps the deterministic dQ kernel (the atomic one is slower)
            _gluon_bwd_launch(q, k, v, dout, grads, lse, delta, s, scale, case == "causal",
                              gmode == "gluon" and not deterministic)
            return grads
    kind = _kind(score_mod, score_grads)
    dslopes = None if score_grads is None else score_grads[0]
    if dslopes is not None:  # the dQ programs write per-row sums (kernels/backward._attn_bwd): _slopes_grad
        _grad_args(score_grads, dev)  # checks the buffers
        score_grads = (torch.zeros((s.B * s.H * s.Lq, 3), dtype=torch.float32, device=dev), score_grads[1])
    sargs = (*_score_args(score_mod, s.H, dev), *_grad_args(score_grads, dev))
    bdt = _bias_dtype(score_mod)
    if not deterministic and getattr(layout, "positions", None) is None and gdt is None and not kind:
        _atomic_backward(q, k, v, dout, grads, lse, delta, layout, s, scale, dropout_p, seed, acc)
        return grads
    if _FUSED_BWD["on"]:
        plan = _bwd_plan(layout, s, q.dtype, dev, has_drop, acc, grad_dtype=gdt, smod_kind=kind, bias_dtype=bdt)
        cfg_kv, cfg_q = plan.cfg
        if cfg_kv.num_warps == cfg_q.num_warps and _FALLBACK.get(("bwd_fused_fits", *plan.cfg), True):
            try:
                _bwd_launch(q, k, v, dout, grads, lse, delta, plan, scale, dropout_p, seed, sargs)
                if dslopes is not None:
                    _slopes_grad(dslopes, score_grads[0], lse, dlse, s, layout)
                return grads
            except OutOfResources:
                _FALLBACK[("bwd_fused_fits", *plan.cfg)] = False  # the two programs do not fit one kernel
    for run in ((True, False), (False, True)):
        plan = _bwd_plan(layout, s, q.dtype, dev, has_drop, acc, run, grad_dtype=gdt, smod_kind=kind, bias_dtype=bdt)
        while True:
            try:
                _bwd_launch(q, k, v, dout, grads, lse, delta, plan, scale, dropout_p, seed, sargs)
                break
            except OutOfResources:
                i = 0 if run[0] else 1
                smaller = _shrink(plan.cfg[i])
                if smaller is None:
                    raise
                cfgs = (smaller, plan.cfg[1]) if i == 0 else (plan.cfg[0], smaller)
                plan = _bwd_plan(layout, s, q.dtype, dev, has_drop, acc, run, cfgs=cfgs, grad_dtype=gdt,
                                 smod_kind=kind, bias_dtype=bdt)
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


_FUSED_BWD = {"on": True, "head_major": None}


def set_fused_backward(on: bool, head_major: bool | None = None) -> None:
    """Run dK/dV and dQ in one launch (default) or in two (benchmarks and tests compare both).

    ``head_major`` orders the one-launch grid head by head (see ``_attn_bwd``): a head's Q, K, V
    and dO are then read from DRAM once instead of twice. ``None`` (default) picks it when no tile
    is split by the work lists; layouts with split tiles (global tokens) keep every dK/dV program
    first, so the heavy ones of all heads start early (measured, benchmarks/NOTES.md v7)."""
    _FUSED_BWD["on"] = bool(on)
    _FUSED_BWD["head_major"] = head_major
    _bump()


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


def _bwd_atomic_plan(layout, s: Shapes, dtype, device, has_dropout: bool, accumulate: bool, cfg=None) -> _Plan:
    """Launch plan of the five-GEMM backward (``kernels/backward_atomic.py``): one program per key
    tile (or column-side work item) and batch·kv-head, then ``_dq_finish``."""
    key = _plan_key("bwd_atomic", layout, s, dtype, device, has_dropout, (accumulate,))
    plan = layout.cache.get(key) if cfg is None else None
    if plan is not None:
        return plan
    lbm, lbn = layout.block_size
    check_layout_block(lbm, lbn)
    _, cols, pay, modes, _ = _device_state(layout, device)
    d_pad = head_dim_pad(s.D)
    wanted = atomic_bwd_config(d_pad, dtype, lbm, lbn)
    fkey = ("bwd_atomic", wanted, d_pad, dtype, lbm, lbn, pay.gathers)
    if cfg is None:
        cfg = _FALLBACK.get(fkey, wanted)
    else:
        _FALLBACK[fkey] = cfg
    wl = _worklist(layout, "col", cfg.block_n, s.B * s.Hkv, device)
    n_items = wl.n_items if wl is not None else _cdiv(s.Lk, cfg.block_n)
    nslot = wl.n_slots if wl is not None else 0
    lzb, lzh = _layout_strides(layout)
    consts = dict(PREDICATE=pay.fn, HAS_DROPOUT=has_dropout, USE_WORK=wl is not None, HEAD_DIM=s.D,
                  HEAD_DIM_PAD=d_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LAYOUT_BM=lbm, LAYOUT_BN=lbn,
                  DOT_PRECISION=_dot_precision(dtype, device), STAGES=cfg.num_stages,
                  MASKED_STAGES=_masked_stages(pay, cfg), COL_LUT=modes["COL_LUT"], ACCUMULATE=accumulate,
                  EVEN=_even(layout), DQ_DESC=bool(_KERNEL_OPTS["dq_desc"]),
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


def _atomic_backward(q, k, v, dout, grads, lse, delta, layout, s: Shapes, scale, dropout_p, seed, acc: bool):
    """The five-GEMM backward into ``grads`` (see :func:`triton_backward`), shrinking its tiles
    when they do not fit the device."""
    dev = q.device
    plan = _bwd_atomic_plan(layout, s, q.dtype, dev, dropout_p > 0.0, acc)
    while True:
        try:
            _bwd_atomic_launch(q, k, v, dout, grads, lse, delta, plan, scale, dropout_p, seed)
            return
        except OutOfResources:
            smaller = _shrink(plan.cfg[0])
            if smaller is None:
                raise
            plan = _bwd_atomic_plan(layout, s, q.dtype, dev, dropout_p > 0.0, acc, cfg=smaller)


def _bwd_atomic_launch(q, k, v, dout, grads, lse, delta, plan: _Plan, scale, dropout_p, seed):
    dq, dk, dv = grads
    (bufs, ints), consts = plan.args, plan.consts
    d_pad = consts["HEAD_DIM_PAD"]
    n_bh, H, Lq, Lk = ints[2], ints[3], ints[8], ints[9]
    dqa = torch.zeros((n_bh, Lq, d_pad), dtype=torch.float32, device=q.device)
    launch = plan.launch
    if consts["DQ_DESC"]:
        if not _tma_ok(dqa):
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


def merge_residue(out, lse, o2, l2, stride: int) -> None:
    """Merge a part computed on residue-class views (``o2 (B·H, S, M, D)``, ``l2 (B·H, S, M)``) into
    ``out (B, H, N, D)`` / ``lse (B, H, N)`` in place (``kernels/merge.py``)."""
    B, H, N, D = out.shape
    assert out.is_contiguous() and o2.is_contiguous() and lse.is_contiguous() and l2.is_contiguous()
    block = 64
    _merge_residue[(_cdiv(N, block), B * H)](out, lse, o2, l2, N, stride, N // stride, HEAD_DIM=D,
                                                   HEAD_DIM_PAD=head_dim_pad(D), BLOCK=block, num_warps=4)
