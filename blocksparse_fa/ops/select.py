"""The kernel choice: one pure function per phase that every entry point's launches go through.

:func:`blocksparse_fa.attention`, ``scaled_dot_product_attention``, the custom op's forward and
backward (``attention_op`` and compiled graphs), the ``nn`` modules, the transformers hook and
context parallelism's local launches all end in ``ops/dispatch.py`` and, on the Triton backend, in
``triton_forward`` / ``triton_backward`` (``ops/triton_backend.py``). Those ask
:func:`choose_forward` and :func:`choose_backward` which kernels run, from plain values only:

* the layout's class (:class:`LayoutClass`: dense, ``causal()``, one key interval per row, or
  block-sparse; per-batch/head; a context-parallel shard; its tile class),
* the shapes, the dtype, the device's capabilities (:class:`Hardware`), whether the tensors can be
  addressed by tensor descriptors,
* dropout, a score modifier, the output/gradient dtypes the caller asks for,
* the per-call :class:`~blocksparse_fa.ops.options.KernelOptions`.

Nothing else enters: whether the call is eager or compiled, whether the mask arrived as an
expression or a compiled layout, whether the logsumexp is returned (its gradient only shifts the
backward's ``delta``), none of it changes the kernels. :func:`blocksparse_fa.explain` reports the
choice for a call without running it; :func:`record` collects the choices that calls actually made
(every thread, the autograd engine's included), which is how the tests check that eager and
compiled calls run the same kernels.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

from . import call_memo
from .options import _DEFAULT_GLUON, _DEFAULT_GLUON_BWD, GluonBwdConfig, GluonConfig, KernelOptions
from .validate import Shapes

__all__ = ["Hardware", "LayoutClass", "Choice", "hardware", "layout_class", "choose_forward", "choose_backward",
           "choose_global_split", "choose_run_split", "choose_set_split", "tma_ok", "tile_major_deal", "record", "note"]

_16BIT = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Hardware:
    """What a device can run: its type (``"cuda"``, ``"cpu"``, ``"meta"``), compute capability
    (CUDA), ``gluon``, the reason the Gluon Hopper kernels cannot run there (``""``: they can), and
    ``sm_count``, its streaming multiprocessors (CUDA; the persistent kernels' grid)."""

    type: str
    capability: tuple | None = None
    gluon: str = "not a CUDA device"
    sm_count: int = 0

    @property
    def hopper(self) -> bool:
        return self.type == "cuda" and self.capability is not None and self.capability[0] == 9


_HW: dict = {}


def _gluon_unavailable(device: torch.device) -> str:
    """Why the Gluon kernels cannot run on ``device`` (``""`` when they can)."""
    if device.type != "cuda":
        return f"the Gluon kernels need a CUDA GPU of compute capability 9.x (Hopper); the tensors are on {device}"
    from ..kernels import forward_gluon as _fg

    if not _fg.gluon_available():
        import triton

        return f"this Triton ({triton.__version__}) has no usable Gluon Hopper API ({_fg.GLUON_IMPORT_ERROR})"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "Gluon kernels do not run in Triton's interpreter (TRITON_INTERPRET=1)"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] != 9:
        return f"it needs a GPU of compute capability 9.x (Hopper, wgmma); this one is {cap[0]}.{cap[1]}"
    return ""


def hardware(device: torch.device) -> Hardware:
    """The :class:`Hardware` of ``device`` (checked once per device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    hw = _HW.get(device)
    if hw is None:
        cap, sms = None, 0
        if device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            sms = torch.cuda.get_device_properties(device).multi_processor_count
        hw = _HW[device] = Hardware(device.type, cap, _gluon_unavailable(device), sms)
    return hw


@dataclass(frozen=True)
class LayoutClass:
    """What the kernel choice needs to know of a compiled layout.

    ``kind``: ``"dense"`` (every block full), ``"causal"`` (the ``causal()`` mask with top-left
    query positions and ``Lq == Lk``), ``"interval"`` (every query row keeps one key interval:
    windows, contiguous documents, their combinations with ``causal()``; a context-parallel shard
    where its rows' intervals in its own key coordinates were given), ``"blocks"`` (anything else),
    or ``"device_interval"``: no compiled layout, the rows' key intervals built on the device from a
    mask holding this call's ``document(ids)`` (``compiler/device_intervals.py``; ``ids``: the
    kernels also compare document ids, for ids not known to be contiguous runs).
    ``batched``: the layout differs per batch row or head (``per_head``: the rows' intervals differ
    between heads; set for the ``"interval"`` and ``"device_interval"`` classes, whose Gluon
    backward needs one interval per row for every query head of a GQA group; ``head_runs``: the
    heads keep the same intervals within aligned runs of that many heads, so a group size that
    divides it qualifies: 1 where unknown, as on device intervals). ``shard``: a
    context-parallel shard of a larger layout (its rows and keys sit at listed positions).
    ``band``/``short_partial``/``partial_rows``/``partial_heavy``/``band_bwd``: the tile class of
    ``kernels/config.py`` (which Triton tile tables apply). ``lists``: a ``"blocks"`` layout that the
    Gluon kernels' list mode can run (:func:`block_lists_of`); ``partial_fraction``: of its visited
    blocks, the partial ones; ``row_blocks``: visited blocks per row of layout blocks, on average
    (0 where unknown, as on device intervals); ``list_columns``: in the list mode, the dK/dV
    kernel's work per key tile in full-step units (:func:`list_column_work`), ``(longest, mean)``."""

    kind: str
    q_len: int
    kv_len: int
    block: tuple
    batched: bool = False
    shard: bool = False
    band: bool = False
    short_partial: bool = False
    partial_heavy: bool = False
    band_bwd: bool = False
    partial_rows: bool = False
    ids: bool = False
    per_head: bool = False
    head_runs: int = 1
    lists: bool = False
    partial_fraction: float = 0.0
    row_blocks: float = 0.0
    list_columns: tuple = (0.0, 0.0)


def device_interval_class(q_len: int, kv_len: int, batched: bool, ids: bool, per_head: bool = False) -> LayoutClass:
    """The class of a call on the device-interval path (no compiled layout)."""
    return LayoutClass("device_interval", q_len, kv_len, (0, 0), batched=batched, ids=ids, per_head=per_head)


# The Gluon forward on device-built interval tables (``ops/interval_backend.gluon_interval_forward``)
# where no id compare is needed: on the H100 its tables equal the host ones and its output matches
# float64 like the Triton interval kernel's (benchmarks/experiments/documents_gpu.py); the layout
# path's same kernel ran the 16K document forward in 0.84 ms against the Triton interval kernel's
# 1.57 ms (compiled; NOTES.md "Packed documents").
GLUON_DEVICE_INTERVALS = True

# The Gluon five-GEMM backward (dK/dV kernel with dQ TMA-reduce-added into fp32, ``+atomic_dq``)
# runs on dense and causal layouts under ``deterministic=False``, and under the default
# ``deterministic=None`` on the layout kinds below (not on context-parallel shards), where it
# times faster than the deterministic pair (dK/dV kernel + dQ kernel). H100, one run of
# benchmarks/experiments/gluon_bwd_tma.py (implementations taking turns, median of 3 passes; the
# dQ columns split between the consumer groups), fwd+bwd ms five-GEMM vs pair: dense 16K H16 d128
# 14.44 vs 15.35, d64 9.30 vs 9.96, 64K GQA 8/2 113.2 vs 123.8; causal 16K d128 7.43 vs 7.78,
# d64 4.77 vs 5.13, 64K GQA 58.8 vs 60.0.
GLUON_FIVE_GEMM_DEFAULT = frozenset({"dense", "causal"})

# The same five-GEMM kernel on compiled interval layouts (one program per key tile, dQ added in
# fp32) under ``deterministic=None`` where the rows visit at least this many layout blocks on
# average (long rows: padded batches, wide windows, causal prefixes); shorter rows keep the
# deterministic pair, persistent. ``deterministic=False`` runs it on any compiled interval layout.
GLUON_FIVE_GEMM_INTERVAL_ROW_BLOCKS = float("inf")

# The same kernel on device intervals (packed documents from per-step ids, the same intervals for
# every head) under ``deterministic=None`` where the dK/dV kernel has few items: at most this many
# per SM (``B · Hkv · Lk / (2 · block_n)`` over the SM count). There the pair's dK/dV kernel runs
# few waves and its dQ kernel comes on top: an 8-layer compiled training step (H200, GQA 8/2 x
# 128) ran +4.8 % tokens/s at 16K (256 items, 1.9 waves) and +3.0 % at 64K (7.8 waves) with it,
# while documents of 1-4K lost 1 % at 7.8 waves (64K, GQA 8/2) and 5 % at 15.5 (16K, H 16)
# (benchmarks/NOTES.md sections 5, 28 and 29): 8 takes the first three. As the default it ran the
# same step +5.5 % / +4.5 % (16K / 64K). ``deterministic=True`` keeps the pair, 0 turns the rule
# off, and ``deterministic=False`` runs the kernel on any device intervals.
GLUON_FIVE_GEMM_DEVICE_INTERVAL_WAVES = 8.0

# The Gluon backward's interval mode (``kernels/backward_gluon.py``, ``INTERVAL``) on device-built
# tables for the device-interval path (``ops/interval_backend.gluon_interval_backward``), where the
# intervals need no id compare and are the same for every head. Set False to keep the Triton
# ``_interval_bwd`` under ``backward="auto"`` (``benchmarks/experiments/gluon_bwd_interval.py``
# checks and times both).
GLUON_DEVICE_INTERVAL_BACKWARD = True

# The same interval mode on compiled layouts of the ``"interval"`` class (windows, prefix-LM,
# documents with ids known on the host, their combinations with ``causal()``), with tables built
# once per layout from its host intervals (``ops/triton_backend._gluon_bwd_interval_tables``), where
# the intervals agree within each GQA group (the same for every head, or per head where the heads
# of a group share them), context-parallel shards included. Under ``backward="auto"`` at head dims
# 128 and 64 (d 64 shards excepted: not measured): on an H100
# (``benchmarks/experiments/gluon_bwd_host_interval.py``, 16K and 64K, H 16, MHA and GQA 16/4) the
# backward ran 1.04-1.22x the Triton block backward at d 128. At d 64 a lone eager call on short
# rows is host-bound (H200, ``options_ab.py``, 16K, H 16, fwd+bwd: windows of 256 0.72x / 0.87x
# MHA / GQA 16/4, though the pair's GPU time is 10-16 % lower), but an 8-layer compiled training
# step, where the host runs ahead, gains: windows of 1024 +1-3 % (16K) and +4.4 % (64K), of 256
# +1.5 % tokens/s (H200, GQA 16/4 x 64, ``train_long_context.py throughput``; NOTES section 28).
# On 4 x H100 shards (256K, GQA 8/2 x 128, ``cp_profile.py gpu``) it took the
# fwd+bwd of a sliding window from 10.30 to 9.35 ms and of packed documents from 27.00 to 25.10 ms
# (benchmarks/NOTES.md, "Context parallelism"). ``backward="gluon"`` runs it on d 64 shards too. Set
# False to keep the Triton block backward.
GLUON_HOST_INTERVAL_BACKWARD = True

# The Gluon kernels' list mode on block layouts (``compiler/block_lists.py``: per tile a list of
# blocks, partial ones masked against at most two key intervals per row) under
# ``block_lists=None``: per phase, the largest fraction of partial blocks it runs. H200, 16K, d 128,
# GPU time by kernel against the Triton block kernels (torch.profiler; benchmarks/NOTES.md sections
# 20 and 21), forward / backward, with the persistent kernels' items dealt by work
# (``triton_backend._deal_table``; ``benchmarks/experiments/deal_gpu_time.py``, raw
# ``docs/data/deal_gpu_time_h200.json``): sliding tiles 3-D (partial fraction 0) 162 / 462 against
# 231 / 626 us, shared prefix (0.19) 243 / 700 against 341 / 942, rectangle | sliding (0.47)
# 127 / 305 against 155 / 430, BigBird (0.39, H 16) 345 / 1037 against 485 / 1344, Longformer whole
# (0.57) 345 / 866 against 451 (its split forward: 258) / 1201, causal Longformer (0.75) 223 / 732
# against 189 (split) / 772. The forward keeps the Triton kernels (or the split) on mostly partial
# layouts; the backward's limit is the longest key column below. Longformer's forward runs its
# lists rather than its split (one launch for three): GPU time 339-343 against 327-331 us, and
# eager fwd+bwd 1.086-1.305 against 1.187-1.520 ms on host-bound H200s (NOTES.md section 22).
BLOCK_LISTS = {"forward": 0.6, "backward": 1.0}
# The list-mode dK/dV kernel runs one program per key tile over all its query blocks, so a long
# key column (a global or prefix key tile that every row visits) is one item: the backward runs it
# where its longest column's work is at most this multiple of the work per SM (every key tile of
# every batch row and kv head, over the GPU's SMs) or ``LIST_LONG_COLUMN`` times the mean key
# tile's (small problems, where every tile has an SM of its own), a masked step counting
# ``LIST_MASKED_STEP_COST`` full ones (kernel times in section 20 of benchmarks/NOTES.md: ~2x
# after the bounds staging, most of it the deal's imbalance; PC sampling in section 21: 1.31x).
# H200, 16K, d 128, (longest / per SM) and list against Triton block backward GPU time,
# items dealt by work: rectangle | sliding (0.56, H 8) 305 against 430 us, shared prefix (0.97,
# H 8) 700 against 942, BigBird (0.61, H 16) 1037 against 1344, Longformer (1.51, H 16) 866 against
# 1201; causal Longformer (2.38) 732 against 772 stays on the Triton kernels (5 % on GPU time,
# less than the eager call's host time moved between machines).
LIST_COLUMN_SHARE = 2.0
LIST_LONG_COLUMN = 4.0
LIST_MASKED_STEP_COST = 2.0
# a backward step where one consumer keeps nothing and passes (``block_lists.SKIP_BIT``): the
# other runs its masked half alone
LIST_HALF_STEP_COST = 1.0
# Partial blocks that building the lists may evaluate on the host, per row of layout blocks on
# average and in all (a layout with more keeps the Triton block kernels without the cost: strided,
# periodic and grid-neighbourhood masks, whose rows hold many partial blocks; Longformer and BigBird
# hold about 4).
BLOCK_LISTS_MAX_PARTIAL_PER_ROW = 6
BLOCK_LISTS_MAX_ELEMENTS = 1 << 26
# Blocks of the layout's grid (every instance) the builder holds as a dense array: 2^24 is 512K
# tokens squared in 128-token blocks; longer layouts keep the Triton block kernels.
BLOCK_LISTS_MAX_BLOCKS = 1 << 24
_LIST_TILES = (128, 128, 64, 128)  # forward/dQ rows and keys per step, dK/dV query rows per step and keys
_LIST_DEVICES = ("cuda",)  # where the lists are built: the Gluon kernels run on CUDA devices only


def block_lists_of(layout, any_device: bool = False):
    """The Gluon list mode's tables of a ``"blocks"`` layout on a CUDA device (``any_device``: on
    any device, as the traffic model asks for the kernels a GPU would run)
    (:func:`~blocksparse_fa.compiler.block_lists.block_lists` for the default Gluon tiles; cached on
    the layout), or None where it does not qualify."""
    if not any_device and torch.device(layout.device).type not in _LIST_DEVICES:
        return None
    if "block_lists" in layout.cache:
        return layout.cache["block_lists"]
    from ..compiler.block_lists import block_lists

    out = None
    if (tuple(layout.block_size) == (128, 128) and layout.n_blocks <= BLOCK_LISTS_MAX_BLOCKS
            and layout.n_partial <= BLOCK_LISTS_MAX_PARTIAL_PER_ROW * layout.n_rows
            and layout.n_partial * 128 * 128 <= BLOCK_LISTS_MAX_ELEMENTS):
        out = block_lists(layout, *_LIST_TILES)
    layout.cache["block_lists"] = out
    return out


def list_work(bl, kernel: str) -> np.ndarray:
    """Work per tile of a list-mode kernel in full-step units, a masked step counting
    ``LIST_MASKED_STEP_COST`` (``LIST_HALF_STEP_COST`` where a backward consumer passes) (pure): ``kernel`` ``"dkdv"`` per key tile, ``"dq"`` per row tile,
    ``"forward"`` per row of its table (row tiles heaviest first); ``(Z, tiles)`` float64."""
    z = bl.lo.shape[0]
    tr = bl.lo.shape[1] // _LIST_TILES[0]
    if kernel == "forward":
        tab = bl.fwd[:z * tr * 5].reshape(z, tr, 5).astype(np.float64)
        steps = tab[..., 4]
        masked = steps - (tab[..., 3] - tab[..., 2])
    else:
        n = bl.dkdv_order.shape[1] if kernel == "dkdv" else tr
        tab = (bl.dkdv if kernel == "dkdv" else bl.dq)[:z * n * 4].reshape(z, n, 4).astype(np.int64)
        steps = (tab[..., 2 if kernel == "dkdv" else 3] - tab[..., 0]).astype(np.float64)
        masked = (tab[..., 1] - tab[..., 0]).astype(np.float64)
        from ..compiler.block_lists import SKIP_BIT

        # masked steps where a consumer passes cost LIST_HALF_STEP_COST
        passes = ((bl.dkdv if kernel == "dkdv" else bl.dq) >> SKIP_BIT) != 0
        cum = np.concatenate([[0], np.cumsum(passes)])
        half = (cum[tab[..., 1]] - cum[tab[..., 0]]).astype(np.float64)
        return steps + (LIST_MASKED_STEP_COST - 1.0) * (masked - half) + (LIST_HALF_STEP_COST - 1.0) * half
    return steps + (LIST_MASKED_STEP_COST - 1.0) * masked


def list_column_work(bl) -> tuple:
    """``(longest, mean)`` of the dK/dV kernel's :func:`list_work` (pure)."""
    work = list_work(bl, "dkdv")
    return float(work.max(initial=0.0)), float(work.mean()) if work.size else 0.0


def _lists_on(lc: LayoutClass, opts: KernelOptions, phase: str, s: Shapes, sms: int = 0,
              kv_heads: int | None = None) -> bool:
    """Whether the list mode runs this layout in ``phase`` under ``opts.block_lists`` (by default
    the backward, at head dim 64 and 128, only where no key column outweighs ``LIST_COLUMN_SHARE``
    times the work per SM of ``sms`` (unknown: 132) and ``LIST_LONG_COLUMN`` times the mean key
    tile's). ``kv_heads``: the dK/dV kernel's heads
    (default ``s.Hkv``; ``s.H`` where it runs one item per query head over the group's K and V,
    so that a key column is one head's work, not a group's)."""
    if opts.block_lists is None:
        if not (lc.lists and lc.partial_fraction <= BLOCK_LISTS[phase]):
            return False
        if phase == "forward":
            return True
        longest, mean = lc.list_columns
        per_sm = mean * (lc.kv_len // _LIST_TILES[3]) * s.B * (kv_heads or s.Hkv) / max(1, sms or 132)
        return longest <= max(LIST_COLUMN_SHARE * per_sm, LIST_LONG_COLUMN * mean)
    return lc.lists and opts.block_lists


def layout_class(layout) -> LayoutClass:
    """The :class:`LayoutClass` of a :class:`~blocksparse_fa.BlockLayout` (cached on it)."""
    cls = layout.cache.get("layout_class")
    if cls is not None:
        return cls
    from ..compiler.intervals import row_interval
    from ..kernels.config import PARTIAL_HEAVY, band_backward_rows, partial_rows, short_partial_rows, short_rows
    from ..mask.primitives import Causal

    shard = getattr(layout, "positions", None) is not None
    batched = bool(layout.batch_shape)
    per_head, head_runs = False, 1
    if not batched and not shard and layout.n_partial == 0 and layout.n_full == layout.n_blocks:
        kind = "dense"
    elif (not batched and not shard and isinstance(layout.mask, Causal) and layout.q_offset == 0
          and layout.q_len == layout.kv_len):
        kind = "causal"
    elif row_interval(layout) is not None:  # a shard only where its intervals were given (distributed)
        kind = "interval"
        runs = _head_runs(layout, *row_interval(layout))
        per_head = runs < (layout.batch_shape or (1, 1))[1]
        head_runs = runs if per_head else 1
    else:
        kind = "blocks"
    src = getattr(layout, "source", None) or layout  # a shard takes its source's tile class
    mean_row, pf = src.n_nonempty / max(1, src.n_rows), src.partial_fraction
    band, short_partial = short_rows(mean_row, pf), short_partial_rows(mean_row, pf)
    partial_heavy, band_bwd = src.n_nonempty > 0 and pf >= PARTIAL_HEAVY, band_backward_rows(mean_row, pf)
    bl = block_lists_of(layout) if kind == "blocks" and not shard else None
    lists, list_columns = bl is not None, list_column_work(bl) if bl is not None else (0.0, 0.0)
    cls = LayoutClass(kind, layout.q_len, layout.kv_len, tuple(layout.block_size), batched, shard, band,
                      short_partial, partial_heavy, band_bwd, partial_rows=partial_rows(mean_row, pf),
                      per_head=per_head, head_runs=head_runs, lists=lists, partial_fraction=float(pf),
                      row_blocks=float(mean_row), list_columns=list_columns)
    layout.cache["layout_class"] = cls
    return cls


def _head_runs(layout, lo, hi) -> int:
    """The largest ``r`` dividing the layout's head count such that the rows' intervals ``(Z, Lq)``
    are the same within every aligned run of ``r`` heads of a batch row (1: they differ between
    neighbours)."""
    bm, hm = layout.batch_shape or (1, 1)
    lo, hi = lo.reshape(bm, hm, -1), hi.reshape(bm, hm, -1)
    for r in range(hm, 1, -1):
        if hm % r == 0:
            a, b = lo.reshape(bm, hm // r, r, -1), hi.reshape(bm, hm // r, r, -1)
            if (a == a[:, :, :1]).all() and (b == b[:, :, :1]).all():
                return r
    return 1


def _heads_differ(layout, lo, hi) -> bool:
    """Whether the rows' intervals ``(Z, Lq)`` (:func:`~blocksparse_fa.compiler.intervals.row_interval`,
    ``Z`` the layout's batch·head instances) differ between the heads of a batch row."""
    return _head_runs(layout, lo, hi) < (layout.batch_shape or (1, 1))[1]


@dataclass(frozen=True)
class Choice:
    """One phase's kernels: ``family`` (``"gluon"``, ``"triton"``, ``"triton_dense"``), ``mode``
    (forward: ``"dense"``, ``"causal"``, ``"interval"``, ``"blocks"``, ``"plain"``, ``"ws"``;
    backward: ``"dense"``/``"causal"``/``"interval"`` (Gluon, deterministic dQ kernel), the first two with
    ``"+atomic_dq"``, ``"blocks"`` (Triton dK/dV and dQ programs) or ``"five_gemm"`` (Triton,
    atomic dQ)) and ``kernels``, the GPU kernels it launches, as a profiler names them."""

    family: str
    mode: str
    kernels: tuple

    def __str__(self) -> str:
        return f"{self.family}:{self.mode}"


_SPLIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
AUTO_GLOBAL_SPLIT_MAX = 16
"""Largest number of global tokens split off in both phases whatever the size under
``global_split=None`` (attention sinks are a few tokens; 64 sinks before a causal window of 1024 ran
slower split than whole on the H100 before the global keys folded into the band's forward). Splits
whose global keys fold follow ``SPLIT_BACKWARD_MIN_ROWS`` instead."""


SPLIT_BACKWARD_MIN_ROWS = 2**19
"""Query rows times heads (``B·H·Lq``) from which a split whose forward folds also splits its
backward (the band's Gluon backward and the global parts' kernels: more launches). H200,
d 128, fwd+bwd ms (``global_split_probe.py --split-backward-min-rows``, ``do_bench``), both phases
split against the forward alone: 64K, H 8 (2^19): Longformer 2.57 / 3.05, 64 sinks + causal window
256 1.56 / 1.89, 64 sinks + causal window 1024 2.88 / 3.46; 16K, H 16: 1.64 / 1.58, 1.48 / 1.14,
1.48 / 1.74. GPU time alone favours the split backward at 16K too (``--profile``: 1.49 / 1.56,
0.85 / 0.96, 1.41 / 1.70), but there the eager call is bound by its host path."""


def _split_rules(fn: str, phase: str, option, dtype: torch.dtype, dropout: bool, score_mod: bool,
                 partial_dtypes: bool) -> bool | None:
    """The rules every split shares: never with dropout, a score modifier, float32 partial results
    or another dtype, nor with the option False; always with it True; None where the split's own
    rule decides (``fn``: the caller, named in the error for a wrong ``phase``)."""
    if phase not in ("forward", "backward"):
        raise ValueError(f"{fn}: phase must be 'forward' or 'backward', got {phase!r}")
    if dropout or score_mod or partial_dtypes or option is False or dtype not in _SPLIT_DTYPES:
        return False
    return True if option is True else None


def choose_global_split(band: Choice, s: Shapes, dtype: torch.dtype, opts: KernelOptions, *, n_global: int,
                        long_rows: bool, dropout: bool = False, score_mod: bool = False,
                        partial_dtypes: bool = False, phase: str = "forward", folds: bool = False,
                        whole: Choice | None = None) -> bool:
    """Whether a mask that splits into a band, its first rows and its global keys
    (``compiler/globals.py``) runs as those parts in ``phase`` (``"forward"`` or ``"backward"``;
    either phase reads the other's logsumexp and output, which are exact either way) (pure).

    Args:
        band: :func:`choose_forward`'s choice for the band's layout.
        s: shapes; dtype: q's dtype; opts: the call's kernel options.
        n_global: ``g``, the number of global tokens.
        long_rows: the first ``g`` rows keep keys past the global ones (Longformer; not attention
            sinks under ``causal``), so that they run as a part of their own.
        dropout, score_mod: attention dropout / a score modifier (the parts would see other
            positions: never split).
        partial_dtypes: the caller asked for float32 outputs or gradients (context parallelism's
            partial results: never split).
        folds: the global keys fold into the band's Gluon forward (``ops/globals._fold_global_keys``):
            the forward is that one pass (plus, where the first rows keep every later key, a
            split-K pair for them merged into the corner the band wrote); asked in either phase.
        whole: :func:`choose_forward`'s (forward) or :func:`choose_backward`'s (backward) choice
            for the whole layout. Where the forward's is the Gluon list mode and the first rows
            would need a part of their own (``long_rows``), the forward stays whole (one launch
            where the split takes three, at equal GPU time); likewise the backward where its
            choice is a list mode (H200, 64K, H 16, d 128, fwd+bwd ms whole against split:
            Longformer 4.25 / 5.34 MHA, 4.17 / 4.93 GQA 16 / 4; the first rows' part alone took
            1.24 ms of GPU time). Without long rows the split's backward stays (causal Longformer,
            64 sinks: 2.87 / 2.98 MHA, 2.91 / 2.82 GQA).

    ``global_split=None`` splits where the band runs the Gluon interval forward and either the
    first rows need no part of their own and ``g <= AUTO_GLOBAL_SPLIT_MAX``, or the forward folds
    the global keys (``folds``): then the forward splits, and the backward from
    ``SPLIT_BACKWARD_MIN_ROWS`` query rows times heads. H100 (16K, H 16, d 128, fwd / fwd+bwd
    ms, split against whole; ``benchmarks/NOTES.md``, "Global tokens"): 4 sinks and a causal window
    of 1024 0.322 / 1.559 against 0.492 / 1.885, of 4096 0.903 / 3.999 against 1.165 / 5.006 (the
    global keys folded into the band's Gluon forward); in an earlier run 64 sinks 0.602 / 1.912
    against 0.464 / 1.848 and Longformer (64 global rows over 16K keys) 0.636 / 2.054 against 0.453
    / 1.698, both with a second pass for the global keys. H200, Longformer with ``folds`` (the
    forward split, the backward whole): 0.345 / 1.581 against 0.457 / 1.671 whole; both phases split
    0.342 / 1.544 (within this run's noise of the whole backward, which is kept)."""
    forced = _split_rules("choose_global_split", phase, opts.global_split, dtype, dropout, score_mod, partial_dtypes)
    if forced is not None:
        return forced
    if band.family != "gluon" or band.mode != "interval":
        return False
    if phase == "forward" and long_rows and whole is not None and whole.family == "gluon" and whole.mode == "list":
        return False
    if (phase == "backward" and long_rows and whole is not None and whole.family == "gluon"
            and whole.mode.startswith("list")):
        return False
    if not long_rows and n_global <= AUTO_GLOBAL_SPLIT_MAX:
        return True
    if not folds:
        return False
    return phase == "forward" or s.B * s.H * s.Lq >= SPLIT_BACKWARD_MIN_ROWS


RUN_SPLIT_MIN_KEYS = 2048
"""Keys kept per query row (on average) from which ``run_split=None`` splits a two-run mask: each
part then pays a Gluon kernel's per-tile costs, its own output and logsumexp, the merge, the
gradients' additions and a second host call per phase, which short rows do not repay."""


def choose_run_split(first: Choice, second: Choice, dtype: torch.dtype, opts: KernelOptions, *,
                     mean_keys: float = float("inf"), dropout: bool = False, score_mod: bool = False,
                     partial_dtypes: bool = False) -> bool:
    """Whether a mask that keeps two runs of keys per row and splits into two one-run parts
    (``compiler/runs.py``) runs as those parts in a phase (pure); either phase reads the other's
    logsumexp and output, which are exact either way.

    Args:
        first, second: the parts' choices in that phase (:func:`choose_forward` /
            :func:`choose_backward` of each part's layout).
        dtype: q's dtype; opts: the call's kernel options.
        mean_keys: keys the whole mask keeps per query row, on average.
        dropout, score_mod: attention dropout / a score modifier (never split).
        partial_dtypes: float32 outputs or gradients were asked for (never split).

    ``run_split=None`` splits where both parts run Gluon kernels in the phase (Hopper) and rows keep
    ``RUN_SPLIT_MIN_KEYS`` keys or more on average: the whole mask then runs the block kernels,
    with the element predicate on every partial tile. H200, 16K, H 8, d 128, fwd / fwd+bwd ms,
    split against whole (``benchmarks/NOTES.md``, "Two key runs per row"): ``key_range | causal``
    (~8K keys per row) 1.163 / 4.005 against 1.326 / 4.917, block diffusion (~4K) 0.735 / 2.883
    against 0.772 / 3.117; a shared prefix of 1024 before documents of 1-4K (~1.7K) 0.519 / 1.700
    against 0.334 / 1.322, a rectangle or a sliding window of 256 (~430) 0.482 / 2.108 against
    0.160 / 0.983."""
    forced = _split_rules("choose_run_split", "forward", opts.run_split, dtype, dropout, score_mod, partial_dtypes)
    if forced is not None:
        return forced
    return first.family == "gluon" and second.family == "gluon" and mean_keys >= RUN_SPLIT_MIN_KEYS


SET_SPLIT_BACKWARD = False
"""Whether ``set_split=None`` splits the backward too (where the band's backward runs Gluon). Off:
on an H200 (16K, H 8, d 128, 16 global positions and a window of 512) the split backward's GPU
time is about 1.0 ms against about 2.2 for the whole mask's, but its eager fwd+bwd reads the same
(2.78 against 2.77 ms): its ~25 launches and gathers make the call host-bound
(``benchmarks/NOTES.md``, "Global positions anywhere")."""


def choose_set_split(band: Choice, dtype: torch.dtype, opts: KernelOptions, *, phase: str = "forward",
                     dropout: bool = False, score_mod: bool = False, partial_dtypes: bool = False) -> bool:
    """Whether a mask with global positions anywhere (``key_set(K) | query_set(R) | band``,
    ``compiler/sets.py``) runs as the band, the gathered global keys and the gathered global rows in
    ``phase`` (``"forward"`` or ``"backward"``; either phase reads the other's output and
    logsumexp, which are exact either way) (pure).

    Args:
        band: :func:`choose_forward`'s (forward) or :func:`choose_backward`'s (backward) choice for
            the band's layout.
        dtype: q's dtype; opts: the call's kernel options.
        dropout, score_mod: attention dropout / a score modifier (never split).
        partial_dtypes: a float32 output or gradients were asked for (never split).

    ``set_split=None`` splits where the band runs the Gluon interval kernels in the phase (the
    backward only with ``SET_SPLIT_BACKWARD``): as one layout every row tile with a global row walks
    every key tile, and every row walks the global keys' tiles, all through the element predicate
    (16 global positions and a window of 512 at 16K: 26 % of the blocks for 3.3 % of the pairs;
    ``benchmarks/NOTES.md``, "Global positions anywhere")."""
    forced = _split_rules("choose_set_split", phase, opts.set_split, dtype, dropout, score_mod, partial_dtypes)
    if forced is not None:
        return forced
    if phase == "backward" and not SET_SPLIT_BACKWARD:
        return False
    return band.family == "gluon" and band.mode == "interval"


TILE_MAJOR_WINDOW_BYTES = 16 * 2**20
"""K/V bytes of every head's key window (batch × kv heads × mean keys per row × 2·D × element
size) from which the persistent interval kernels deal their items head by head (with enough items
per program): below it, all heads' windows and the row tiles in flight share the L2 (H200: ~24 MiB
of data that every SM reads stays in L2)."""
TILE_MAJOR_MIN_ITEMS = 24
"""Items per persistent program below which the interval kernels stay tile-major whatever the
window: with few items each, the tile-major snake deal balances the programs' work."""


def tile_major_deal(n_items: int, n_programs: int, window_bytes: float | None) -> bool:
    """Whether a persistent Gluon kernel on an interval layout (the forward, the backward's dK/dV
    and dQ kernels) deals its items tile-major (one tile of every head before the next, heaviest
    first) rather than head by head (pure).

    Tile-major balances programs whose tiles differ in length; it also makes every head's key
    window share the L2 at once, which costs DRAM re-reads once they no longer fit. H200 sweep
    (``benchmarks/experiments/gluon_fwd_persistent.py --sweep --bwd-order``, ``benchmarks/NOTES.md``,
    section 10; causal windows of 1024-8192 keys, 8-32 heads, d 128, bf16), time head by head /
    tile-major where this picks head by head: forward 0.90-0.99 at 64K tokens (32 heads, window
    4096: 7.54 against 8.28 ms), 0.93-0.97 at 16K with 32 heads from 32 MiB and 1.02 at 16 MiB;
    backward 0.94-1.00 (64K, 32 heads, window 8192: 48.1 against 51.0 ms). Where it keeps
    tile-major because the programs have 8-16 items (16K with 8 or 16 heads), head by head measured
    1.04-1.18 (forward) and 1.02-1.22 (backward). ``window_bytes`` None (unknown, e.g. intervals
    built on the device): tile-major."""
    if window_bytes is None or n_programs <= 0:
        return True
    return not (n_items >= TILE_MAJOR_MIN_ITEMS * n_programs and window_bytes >= TILE_MAJOR_WINDOW_BYTES)


def tma_ok(*ts: torch.Tensor) -> bool:
    """Whether tensor descriptors can address every tensor: CUDA on a Hopper-class GPU, 16-byte
    aligned bases and 16-byte aligned strides (but the last)."""
    if not all(t.is_cuda for t in ts) or hardware(ts[0].device).capability[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1])
               for t in ts)


# The Gluon forward's default tiles by (layout kind, head dim) where they are not ``GluonConfig()``:
# at d 64 three consumer warp groups (192-row programs, as FlashAttention-3 and -4 tile head dim
# 64, where a step's products are short beside its softmax). H200, 16K, H 16 (benchmarks/NOTES.md,
# "Three consumer groups at head dim 64"): dense 2.455 -> 2.300 ms, causal 1.351 -> 1.255 ms
# without the overlap of S_j with P_{j-1}·V (1.296 with it); at d 128 three groups spill and
# take 1.8x as long.
GLUON_FWD_DEFAULTS: dict = {("dense", 64): GluonConfig(groups=3),
                             ("causal", 64): GluonConfig(groups=3, overlap=False)}


def gluon_fwd_config(opts: KernelOptions, kind: str, d: int) -> GluonConfig:
    """The Gluon forward's tiles for a call: its ``gluon_fwd`` option, else the default for the layout
    kind (``"dense"``, ``"causal"``, ...) and head dim ``d`` (pure; the launcher asks it too)."""
    if opts.gluon_fwd is not None:
        return opts.gluon_fwd
    return GLUON_FWD_DEFAULTS.get((kind, d), _DEFAULT_GLUON)


# The Gluon backward's default tiles by (mode, head dim) where they are not ``GluonBwdConfig()``. The
# five-GEMM kernel at d 64 takes 128-row query steps, as FlashAttention-3 and -4 tile head dim 64,
# with the accumulators started at -LSE/scale and -Δ and dV's product after dSᵀ, which cut its
# step loops' spill reloads from ~100 to 6-14 per step; dense d 128 takes the accumulator starts
# alone. H200, backward alone (benchmarks/NOTES.md section 30): d 64 causal 16K 3.26 -> 2.92 ms,
# dense 16K 6.40 -> 5.63, causal 64K GQA 8/2 25.44 -> 21.96; dense d 128 10.22 -> 9.65 (causal
# d 128: within 1 %, unchanged).
GLUON_BWD_DEFAULTS: dict = {("dense+atomic_dq", 64): GluonBwdConfig(block_m=128, rows_acc=2),
                            ("causal+atomic_dq", 64): GluonBwdConfig(block_m=128, rows_acc=2),
                            ("dense+atomic_dq", 128): GluonBwdConfig(rows_acc=2)}


def gluon_bwd_config(opts: KernelOptions, mode: str, d: int) -> GluonBwdConfig:
    """The Gluon backward's tiles for a call: its ``gluon_bwd`` option, else the default for the
    chosen mode (``Choice.mode``, e.g. ``"causal+atomic_dq"``) and head dim ``d`` (pure; the
    launcher asks it too)."""
    if opts.gluon_bwd is not None:
        return opts.gluon_bwd
    return GLUON_BWD_DEFAULTS.get((mode, d), _DEFAULT_GLUON_BWD)


def _gluon_fwd_mode(lc: LayoutClass, s: Shapes, cfg: GluonConfig, opts: KernelOptions) -> str | None:
    """The Gluon forward's mode for this layout and shapes, or None where it does not compute it."""
    if s.D not in (64, 128) or lc.kv_len % cfg.block_n or lc.kv_len == 0:
        return None
    if lc.kind in ("dense", "causal"):
        if lc.kind == "causal" and cfg.groups == 2 and cfg.block_n != 2 * cfg.block_m:
            return None
        return lc.kind
    if lc.kind == "interval" and opts.interval:
        return "interval"
    if cfg.groups != 2:  # the list tables are built for two groups
        return None
    if (lc.kind == "blocks" and _lists_on(lc, opts, "forward", s)
            and (2 * cfg.block_m, cfg.block_n) == _LIST_TILES[:2]):
        return "list"
    return None


def choose_forward(lc: LayoutClass, s: Shapes, dtype: torch.dtype, hw: Hardware, opts: KernelOptions, *,
                   dropout: bool = False, score_mod: bool = False, out_dtype: bool = False,
                   tma: bool = True) -> Choice:
    """The forward kernel for one launch (pure: the same arguments give the same answer).

    Args:
        lc: the layout's class.
        s: shapes (``s.D`` the head dim the kernels see).
        dtype: q's dtype.
        hw: the device's capabilities.
        opts: the call's kernel options.
        dropout: attention dropout is on.
        score_mod: a score modifier is fused.
        out_dtype: the output is asked for in another dtype than q's (float32 partial results).
        tma: q, k, v and the output can be addressed by tensor descriptors.

    Raises:
        ValueError: ``forward="gluon"`` where the Gluon kernels cannot run on this device.
    """
    if opts.forward == "gluon" and hw.gluon:
        raise ValueError(f"kernel_options forward='gluon': {hw.gluon}")
    simple = not dropout and not score_mod and not out_dtype
    if lc.kind == "device_interval":
        cfg = gluon_fwd_config(opts, lc.kind, s.D)
        want = opts.forward == "gluon" or (opts.forward == "auto" and GLUON_DEVICE_INTERVALS)
        if (want and not hw.gluon and simple and dtype in _16BIT and tma and not lc.ids and s.D in (64, 128)
                and lc.kv_len % cfg.block_n == 0 and (cfg.groups == 2 or cfg.segments is not False)):
            return Choice("gluon", "interval", ("_attn_fwd_gluon",))
        return Choice("triton", "interval", ("_interval_fwd",))
    if opts.forward in ("auto", "gluon") and not hw.gluon and simple and dtype in _16BIT and tma:
        mode = _gluon_fwd_mode(lc, s, gluon_fwd_config(opts, lc.kind, s.D), opts)
        if mode is not None:
            return Choice("gluon", mode, ("_attn_fwd_gluon",))
    # the dense Triton forward; in the interpreter (CPU) descriptors need no alignment
    if (opts.forward in ("plain", "ws") and lc.kind == "dense" and simple and lc.kv_len % 128 == 0
            and s.D in (16, 32, 64, 128) and (hw.type == "cpu" or (dtype in _16BIT and tma))):
        return Choice("triton_dense", opts.forward, ("_attn_fwd_ws",))
    return Choice("triton", "blocks", ("_attn_fwd",))


def _gluon_bwd_mode(lc: LayoutClass, s: Shapes, cfg: GluonBwdConfig, opts: KernelOptions, sms: int = 0) -> str | None:
    """The Gluon backward's mode for this layout and shapes (``"dense"``, ``"causal"``,
    ``"interval"`` for the interval and device-interval classes, ``"list"`` for block layouts in
    the list mode) on a GPU of ``sms`` SMs, or None where it does not compute it."""
    interval = lc.kind in ("interval", "device_interval")
    if lc.kind == "blocks":
        tiles = (2 * cfg.dq_block_m, cfg.dq_block_n, cfg.block_m, 2 * cfg.block_n)
        if tiles != _LIST_TILES or s.D not in (64, 128):
            return None
        if _lists_on(lc, opts, "backward", s, sms):
            return "list"
        # GQA: a group's key column is G heads' work; with one dK/dV item per query head (reading
        # its group's K and V; the group's dK/dV summed afterwards) it is one head's, as with MHA
        if s.G > 1 and opts.block_lists is None and _lists_on(lc, opts, "backward", s, sms, kv_heads=s.H):
            return "list+per_head_dkdv"
        return None
    if interval:
        # no id compare; the dK/dV program walks every head of a group with one table, so
        # intervals that differ per head must agree within each group. A context-parallel shard
        # runs it too: rows its keys do not reach get a -inf logsumexp (triton_backend)
        if lc.ids or (lc.per_head and lc.head_runs % s.G):
            return None
    elif lc.kind not in ("dense", "causal"):
        return None
    if s.D not in (64, 128):
        return None
    if s.Lq % max(cfg.block_m, 2 * cfg.dq_block_m) or s.Lq % cfg.block_m:
        return None
    if s.Lk % max(2 * cfg.block_n, cfg.dq_block_n) or s.Lk % cfg.dq_block_n:
        return None
    if lc.kind == "causal" and ((2 * cfg.block_n) % cfg.block_m or (2 * cfg.dq_block_m) % cfg.dq_block_n):
        return None
    return "interval" if interval else lc.kind


def choose_backward(lc: LayoutClass, s: Shapes, dtype: torch.dtype, hw: Hardware, opts: KernelOptions, *,
                    dropout: bool = False, score_mod: bool = False, accumulate: bool = False,
                    grad_dtype: bool | str = False, deterministic: bool | None = None, tma: bool = True) -> Choice:
    """The backward kernels for one launch (pure). Arguments as in :func:`choose_forward`, and:

    Args:
        accumulate: gradients are added into the caller's tensors.
        grad_dtype: gradients are asked for in another dtype than the inputs' (``"float32"``: all of
            those in float32, which the Gluon kernels write too; ``True``: another).
        deterministic: overrides ``opts.deterministic`` where not None.
        tma: q, k, v, dO and the gradients can be addressed by tensor descriptors.

    The gradient of a returned logsumexp does not enter: it only shifts ``delta``."""
    if opts.backward == "gluon" and hw.gluon:
        raise ValueError(f"kernel_options backward='gluon': {hw.gluon}")
    det = opts.deterministic if deterministic is None else deterministic
    # compiled interval layouts: Gluon at d 128, and at d 64 except on context-parallel shards (not
    # measured there)
    auto = {"device_interval": GLUON_DEVICE_INTERVAL_BACKWARD,
            "interval": GLUON_HOST_INTERVAL_BACKWARD and (s.D == 128 or not lc.shard)}
    want = opts.backward == "gluon" or (opts.backward == "auto" and auto.get(lc.kind, True))
    if (want and not hw.gluon and dtype in _16BIT and not dropout and not score_mod and not accumulate
            and grad_dtype in (False, "float32") and tma):
        mode = _gluon_bwd_mode(lc, s, opts.gluon_bwd or _DEFAULT_GLUON_BWD, opts, hw.sm_count)
        # the five-GEMM kernel on intervals: asked for (deterministic=False; device intervals too),
        # compiled layouts whose rows are long enough (GLUON_FIVE_GEMM_INTERVAL_ROW_BLOCKS), or
        # device intervals with few dK/dV items (GLUON_FIVE_GEMM_DEVICE_INTERVAL_WAVES)
        long_rows = lc.kind == "interval" and lc.row_blocks >= GLUON_FIVE_GEMM_INTERVAL_ROW_BLOCKS
        few_items = lc.kind == "device_interval" and not lc.per_head and 0 < s.B * s.Hkv * (
            s.Lk // (2 * (opts.gluon_bwd or _DEFAULT_GLUON_BWD).block_n)) <= (
            GLUON_FIVE_GEMM_DEVICE_INTERVAL_WAVES * hw.sm_count)
        if mode == "interval" and not lc.shard and (det is False or (det is None and (long_rows or few_items))):
            return Choice("gluon", "interval+atomic_dq", ("_attn_bwd_preprocess", "_attn_bwd_dkdv_gluon",
                                                          "_dq_finish"))
        if mode in ("interval", "list"):  # dK/dV and dQ kernels
            return Choice("gluon", mode, ("_attn_bwd_preprocess", "_attn_bwd_dkdv_gluon", "_attn_bwd_dq_gluon"))
        if mode == "list+per_head_dkdv":  # the same, dK/dV per query head, summed per group
            return Choice("gluon", mode, ("_attn_bwd_preprocess", "_attn_bwd_dkdv_gluon", "_attn_bwd_dq_gluon",
                                          "_group_sum"))
        if mode is not None:
            if det is False or (det is None and mode in GLUON_FIVE_GEMM_DEFAULT and not lc.shard):
                return Choice("gluon", mode + "+atomic_dq", ("_attn_bwd_preprocess", "_attn_bwd_dkdv_gluon",
                                                             "_dq_finish"))
            return Choice("gluon", mode, ("_attn_bwd_preprocess", "_attn_bwd_dkdv_gluon", "_attn_bwd_dq_gluon"))
    if lc.kind == "device_interval":  # deterministic: dK/dV and dQ programs, no atomics
        return Choice("triton", "interval", ("_attn_bwd_preprocess", "_interval_bwd"))
    if det is False and not lc.shard and not grad_dtype and not score_mod:
        return Choice("triton", "five_gemm", ("_attn_bwd_preprocess", "_attn_bwd_atomic", "_dq_finish"))
    return Choice("triton", "blocks", ("_attn_bwd_preprocess", "_attn_bwd"))


# ------------------------------------------------------------------------------------------------
# what ran
# ------------------------------------------------------------------------------------------------
_REC_LOCK = threading.Lock()
_RECORDERS: list = []


def note(phase: str, choice) -> None:
    """Record that a launch of ``phase`` (``"forward"``/``"backward"``) made ``choice`` (a
    :class:`Choice`, or a string for the PyTorch paths), for every active :func:`record`."""
    call_memo.also(note, phase, choice)
    if _RECORDERS:
        with _REC_LOCK:
            for r in _RECORDERS:
                r.append((phase, str(choice)))


@contextlib.contextmanager
def record():
    """Collect ``(phase, choice)`` of every launch made while active, in any thread::

        with record() as ran:
            attention(q, k, v, mask=causal()).sum().backward()
        # ran == [("forward", "gluon:causal"), ("backward", "gluon:causal")]
    """
    log: list = []
    with _REC_LOCK:
        _RECORDERS.append(log)
    try:
        yield log
    finally:
        with _REC_LOCK:
            _RECORDERS.remove(log)
