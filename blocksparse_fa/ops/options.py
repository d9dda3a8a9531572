"""Per-call kernel options: one immutable :class:`KernelOptions` instead of module-level setters.

Every entry point takes ``kernel_options=`` (a :class:`KernelOptions`, a ``dict`` of its fields, the
string of :meth:`KernelOptions.encode`, or ``None`` for the defaults), as FlexAttention does. Inside
a ``torch.compile``d function pass a dict or the encoded string: Dynamo cannot hand every dataclass
instance to the constant function that encodes the options. The options are validated where they enter, are
hashable (launch plans are cached per options value), and cross the ``torch.library`` custom op as
a constant string (:meth:`KernelOptions.encode` / :func:`decode_options`), so they are the same in
eager and compiled calls, and per call rather than per process: two threads, or two modules of one
model, can run different options at once.

The defaults are what the kernel choice (:mod:`blocksparse_fa.ops.select`) runs when nothing is
asked for; most fields exist to compare kernels in benchmarks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, fields

__all__ = ["KernelOptions", "GluonConfig", "GluonBwdConfig", "TileConfig", "as_options", "decode_options",
           "DEFAULT_OPTIONS"]


@dataclass(frozen=True)
class TileConfig:
    """Tiles of a Triton kernel: ``block_m`` queries, ``block_n`` keys, warps and pipeline stages.
    ``flat`` (backward): one loop iteration per kernel tile rather than per layout block."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    flat: bool = False


def _check_margin(owner: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner}(sm_margin={value!r}): expected an int >= 0 (SMs a persistent grid leaves free)")


@dataclass(frozen=True)
class GluonConfig:
    """Tiles of the Gluon forward (``kernels/forward_gluon.py``): ``block_m`` query rows per consumer
    warp group (a program covers ``groups`` of them, below), ``block_n`` keys per step, ``stages``
    K/V slots in shared memory, ``pingpong`` (the groups take turns issuing their products),
    ``overlap`` (each group issues S_j = Q·K_jᵀ together with the previous block's P·V), register
    budgets of the producer and the consumers (``setmaxnreg``). Causal layouts need
    ``block_n == 2·block_m`` with two groups.

    ``persistent``: one program per SM walks the query tiles of every head (the next tile's Q and
    first K/V load while the last one finishes; descriptors built once per program, over whole
    tensors). Taken for dense and one-interval-per-row layouts (not causal: no gain there) where
    ``Lq`` is a multiple of ``groups·block_m`` and each of Q, K, V and O is a 2-D row view (heads
    stacked along rows, as ``(B, H, L, D)``, or side by side, as ``(B, L, H, D)`` transposed);
    otherwise one program per query tile and head.

    ``sm_margin``: SMs a persistent grid leaves free (its programs are the SM count minus this),
    so that kernels running beside it on another stream (communication: NCCL's send/receive
    kernels under context parallelism) get SMs at once instead of after the whole launch, as
    FlashAttention-3's ``sm_margin`` does. 0 (default): every SM.

    ``deal`` (default True; the list mode's persistent forward, tile-major): the host deals the row
    tiles to the programs by their work, longest first to the least loaded program, where that
    shortens the most loaded program's work by 5 % or more (global rows that visit every key);
    False: every grid-th item, as :class:`GluonBwdConfig`'s ``deal``.

    ``groups``: consumer warp groups per program, 2 (default) or 3 (a program then covers
    ``3·block_m`` rows, as FlashAttention-3's 192-row tiles at head dim 64, where a step's products
    are short beside its softmax): dense, causal and one-interval-per-row layouts whose intervals
    the host knows (windows, documents of known ids). Block lists and device intervals need 2: with
    3 the Gluon forward is not chosen for them. ``consumer_regs`` None (default): 240 registers per consumer
    thread with 2 groups, 160 with 3 (3 × 128 threads at 160 and the producer fill the 64K
    register file; more is refused).

    ``segments`` (device intervals: documents found on the GPU, with ``groups`` 2 and a persistent
    grid): the row tiles start where a run of rows whose keys begin at or after the previous row's
    end starts (a document), as FlashAttention's variable-length tiles do, instead of at multiples
    of ``groups·block_m``, and their key blocks start at the tile's first key; a tile's last rows
    that belong to the next run are computed but not written. Fewer masked steps and no tile that
    spans two documents' keys. None (default): on device-interval layouts in eager calls, whose
    masks keep the tables (a compiled call rebuilds them per call, and the segment tables take ~40
    small launches against one); True: on every device-interval and host-interval layout (windows,
    documents of a compiled layout; without global keys); False: the aligned tiles.

    ``q_buffers`` (persistent grids): 1 (default) or 2 sets of Q tiles in shared memory. With 2
    the producer loads the next item's Q while the current one runs, and O is staged in the item's
    own Q tiles, so shared memory is the same; with 1 the next Q waits for the current item's last
    product."""

    block_m: int = 64
    block_n: int = 128
    stages: int = 2
    pingpong: bool = True
    overlap: bool = True
    producer_regs: int = 24
    consumer_regs: int | None = None
    persistent: bool = True
    sm_margin: int = 0
    deal: bool = True
    groups: int = 2
    segments: bool | None = None
    q_buffers: int = 1

    def __post_init__(self):
        _check_margin(type(self).__name__, self.sm_margin)
        if not isinstance(self.deal, bool):
            raise ValueError(f"GluonConfig(deal={self.deal!r}): expected True or False")
        if isinstance(self.q_buffers, bool) or self.q_buffers not in (1, 2):
            raise ValueError(f"GluonConfig(q_buffers={self.q_buffers!r}): expected 1 or 2 sets of Q tiles")
        if self.segments is not None and not isinstance(self.segments, bool):
            raise ValueError(f"GluonConfig(segments={self.segments!r}): expected True, False or None")
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups not in (2, 3):
            raise ValueError(f"GluonConfig(groups={self.groups!r}): expected 2 or 3 consumer warp groups")
        top = 160 if self.groups == 3 else 240
        if self.consumer_regs is not None and (isinstance(self.consumer_regs, bool)
                                               or not isinstance(self.consumer_regs, int)
                                               or not 24 <= self.consumer_regs <= top or self.consumer_regs % 8):
            raise ValueError(f"GluonConfig(consumer_regs={self.consumer_regs!r}): expected a multiple of 8 from 24 "
                             f"to {top} with groups={self.groups} (3 x 128 threads at 160 and the producer fill "
                             "the register file), or None")

    @property
    def regs(self) -> int:
        """Registers per consumer thread the kernel requests (``consumer_regs``, or by ``groups``)."""
        return self.consumer_regs if self.consumer_regs is not None else (160 if self.groups == 3 else 240)


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
    group (fewer live registers). ``overlap`` applies to the deterministic dK/dV kernel only.

    The five-GEMM variant (``deterministic`` not True) shares both groups' dSᵀ tiles through
    shared memory, and each group computes half of dQ's columns over the program's ``2·block_n``
    keys (``dQ_partial = dS·K``, one TMA reduce-add of ``block_m × D/2`` per group and query block,
    as FlashAttention-3 splits it).

    ``direct_store``: dK/dV and dQ are written from the registers instead of being staged in shared
    memory for a TMA store (always so for float32 gradients, which the staging tiles cannot hold);
    fewer values stay live across the loops, so the kernels spill less.

    ``persistent``: the dQ kernel runs one program per SM over every head's row tiles, as
    :class:`GluonConfig`'s (dense and one-interval-per-row layouts, tensors that are 2-D row views;
    otherwise one program per row tile and head). ``dkdv_persistent``: the same for the dK/dV
    kernel over every kv head's key tiles, heaviest first on interval layouts; its producer loads a
    tile's first Q/dO steps while the consumers store the previous tile's dK and dV. None (the
    default): on one-interval-per-row layouts only (windows, documents, prefix-LM), where their
    tiles are short, and not for the five-GEMM kernel (``deterministic=False``); on dense layouts
    the persistent loops keep more values live across the steps
    (more spilling) and ran slower (``benchmarks/NOTES.md``, "Persistent backward").

    ``sm_margin``: SMs the persistent kernels leave free, as :class:`GluonConfig`'s.

    ``rows_smem`` (default True): the dK/dV kernel's producer copies each query block's logsumexp
    and Δ into shared memory with its Q and dO (TMA, one barrier phase), and the consumer groups
    read them in the score tile's row layout where they are used; False loads them from global
    memory before the slot's wait and converts their layout (more registers live across the
    wait: more spills). Same gradients; on an H200 the backward took 2–9 % less time with it
    (``benchmarks/NOTES.md``, section 5). Not read with ``overlap``.

    ``bounds_smem`` (interval and list modes, with ``rows_smem``): the producer also copies the query
    block's interval bounds into the slot, which masked dK/dV steps then read in the score tile's
    row layout instead of loading them from global memory and converting them. None (default):
    where the rows keep two intervals (int64 bounds): H200, 16K, the dK/dV kernel of Longformer's
    list mode 1018 -> 814 us, causal Longformer 889 -> 680, rectangle | sliding 216 -> 195, but
    one interval (int32) 3-10 % slower (BigBird, shared prefix, window 1024, documents;
    ``benchmarks/NOTES.md`` section 20). Same gradients bit for bit.

    ``deal`` (default True; the list mode's persistent dK/dV kernel, tile-major): the host deals the
    key tiles to the programs by their work, longest first to the least loaded program, where that
    shortens the most loaded program's work by 5 % or more (a global or prefix key tile that
    every row visits is one item: dealt every grid-th, the programs that draw one finish last);
    False: every grid-th item. Same gradients bit for bit.

    ``dq_lag`` (the five-GEMM kernel): each step's dQ product is issued in the next step, so that
    the two consumer groups wait for each other's dSᵀ one step apart rather than in every step
    (three dSᵀ buffers; at d 128 one dQ staging tile per group instead of two). The same dK and
    dV bit for bit, dQ's sums added in another order. None (default): at head dim 64, where the
    dK/dV kernel took 7-11 % less GPU time on dense and causal layouts and 4.5 % on packed
    documents (H200, 16K); at d 128 the differences stayed within the runs' noise
    (``benchmarks/NOTES.md`` section 29).

    ``rows_acc`` (the dK/dV kernel's step): 0 subtracts each row's logsumexp and Δ element by element;
    1 starts ``dPᵀ``'s accumulator at ``-Δ`` (the product then ends as ``dPᵀ - Δ``); 2 also starts
    ``Sᵀ``'s at ``-LSE / scale``, so ``Pᵀ = exp2(qk_scale · Sᵀ)``. The row vectors then live only
    until the products are issued, not through the softmax work (at 128-row steps they hold 32
    registers each). ``late_dv``: dV's product is issued after ``dSᵀ`` is computed, so that ``Pᵀ``'s
    16-bit operand is not held through it (None: with ``block_m`` 128). ``dk_ds_smem`` (five-GEMM):
    dK's product reads ``dSᵀ`` from the shared tile the dQ exchange writes instead of registers.
    Same products; the sums differ from the defaults' by rounding. ``rows_acc=2`` with ``late_dv``
    makes 128-row steps at head dim 64 pay (spill reloads per step ~100 -> 6-14): the default
    there, and ``rows_acc=2`` alone is dense d 128's (``ops/select.GLUON_BWD_DEFAULTS``); ``dk_ds_smem`` spills
    less but took 3-6 % more time on an H200 everywhere (``benchmarks/NOTES.md`` section 30)."""

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
    direct_store: bool = False
    persistent: bool | None = None
    dkdv_persistent: bool | None = None
    sm_margin: int = 0
    rows_smem: bool = True
    bounds_smem: bool | None = None
    deal: bool = True
    dq_lag: bool | None = None
    rows_acc: int = 0
    late_dv: bool | None = None
    dk_ds_smem: bool = False

    def __post_init__(self):
        _check_margin(type(self).__name__, self.sm_margin)
        for name in ("overlap", "dq_overlap"):
            if getattr(self, name) not in (0, 1, 2):
                raise ValueError(f"GluonBwdConfig({name}={getattr(self, name)!r}): expected 0, 1 or 2")
        if self.rows_acc not in (0, 1, 2):
            raise ValueError(f"GluonBwdConfig(rows_acc={self.rows_acc!r}): expected 0, 1 or 2")
        for name in ("persistent", "dkdv_persistent", "dq_lag", "late_dv"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"GluonBwdConfig({name}={value!r}): expected True, False or None")
        for name in ("rows_smem", "deal", "dk_ds_smem"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GluonBwdConfig({name}={getattr(self, name)!r}): expected True or False")
        if self.bounds_smem is not None and not isinstance(self.bounds_smem, bool):
            raise ValueError(f"GluonBwdConfig(bounds_smem={self.bounds_smem!r}): expected True, False or None")
        for name in ("stages", "dq_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"GluonBwdConfig({name}={getattr(self, name)!r}): expected at least 1")
        if self.overlap and self.stages < 2:
            raise ValueError(f"GluonBwdConfig: overlap={self.overlap} needs stages >= 2, got {self.stages}")
        if self.dq_overlap and self.dq_stages < 2:
            raise ValueError(f"GluonBwdConfig: dq_overlap={self.dq_overlap} needs dq_stages >= 2, got "
                             f"{self.dq_stages}")


_CHOICES = {
    "forward": ("auto", "gluon", "triton", "plain", "ws"),
    "backward": ("auto", "gluon", "triton"),
    "lists": ("coarse", "half", "fine", "auto"),
    "list_stages": ("same", "tiles"),
    "fwd_other": ("load", "prefetch"),
    "band_backward": ("partial", "flex"),
}
_OPTIONAL_BOOL = ("col_arith", "head_major", "deterministic", "global_split", "run_split", "set_split",
                  "block_lists")
_CONFIGS = {"gluon_fwd": GluonConfig, "gluon_bwd": GluonBwdConfig, "fwd_tiles": TileConfig,
            "dkdv_tiles": TileConfig, "dq_tiles": TileConfig, "atomic_tiles": TileConfig}


# the configs a call without ``gluon_fwd`` / ``gluon_bwd`` options runs (one instance each: a
# config is validated when made, which a call need not repeat)
_DEFAULT_GLUON = GluonConfig()
_DEFAULT_GLUON_BWD = GluonBwdConfig()


@dataclass(frozen=True)
class KernelOptions:
    """Which kernels run and how, for one call (``kernel_options=`` of every entry point).

    Kernel families (the choice itself is :func:`blocksparse_fa.ops.select.choose_forward` /
    ``choose_backward``; :func:`blocksparse_fa.explain` shows it for a call):

    Attributes:
        forward: ``"auto"`` (default): the Gluon producer/consumer forward on Hopper for dense,
            ``causal()`` and one-interval-per-row layouts where it applies, else the block-sparse
            Triton forward. ``"gluon"``: the same, but refused (``ValueError``) where Gluon cannot
            run. ``"triton"``: always the block-sparse Triton forward. ``"plain"`` / ``"ws"``: for
            all-full layouts, the dense Triton forward of ``kernels/forward_ws.py`` (8 warps /
            warp-specialised; ``"ws"`` fails the float64 check with triton 3.6 and needs
            ``BSFA_EXPERIMENTAL_WS=1``).
        interval: let the Gluon forward run layouts whose rows keep one key interval (windows,
            documents, their combinations with ``causal()``).
        block_lists: let the Gluon kernels run block layouts (no one interval per row) through
            per-tile block lists, masking the partial blocks against at most two key intervals per
            row (``compiler/block_lists.py``: sliding tiles, block masks, Longformer, BigBird,
            ``key_range | causal``, ...; 128 × 128 layout blocks, every head keeping the same
            blocks). None (default): the forward where at most 60 % of the visited blocks are
            partial (``select.BLOCK_LISTS``); the backward (head dim 64 or 128) unless one key
            column (global or prefix keys) outweighs twice the work per SM
            (``select.LIST_COLUMN_SHARE``: the list backward runs a key tile as one item); True: in
            both phases where a layout qualifies; False: never.
        gluon_fwd: tiles of the Gluon forward (:class:`GluonConfig`; None: the default of the layout
            kind and head dim, ``ops/select.gluon_fwd_config``: three consumer groups for dense and causal
            layouts at d 64, else ``GluonConfig()``).
        backward: ``"auto"`` (default): the Gluon backward on Hopper for dense, ``causal()`` and
            one-interval-per-row layouts whose intervals are the same for every head (windows,
            documents, prefix-LM, ...) where it applies, else the block-sparse Triton backward;
            ``"gluon"``: the same, refused where Gluon cannot run; ``"triton"``: always the Triton
            backward.
        gluon_bwd: tiles of the Gluon backward (:class:`GluonBwdConfig`; None: the default).
        deterministic: None (default): the faster backward of each layout, which on Hopper for
            dense and ``causal()`` layouts, and for packed documents from ids with at most 8 key
            tiles per SM (``ops/select.GLUON_FIVE_GEMM_DEVICE_INTERVAL_WAVES``), is the Gluon
            five-GEMM backward (dQ added to an fp32 buffer with TMA reduce-adds: the order of the
            adds varies, so dQ is not bit-reproducible between runs; dK and dV are), and elsewhere
            a deterministic one. True: separate dK/dV and dQ programs
            everywhere, every gradient bit-reproducible. False: the five-GEMM backward wherever one
            exists (the Gluon one for dense, causal and one-interval-per-row layouts such as padded
            batches, windows and packed documents, else the Triton one whose dK/dV programs add dQ
            with fp32 atomics).
        fused_backward: the Triton backward's dK/dV and dQ programs in one launch (default) or two.
        head_major: order that one launch's grid head by head (None: when no tile is split).
        dq_desc: the five-GEMM backward adds dQ tiles through a tensor descriptor (Hopper).
        even: drop the masked loops' bounds checks where lengths are multiples of the layout block.
        lists: granularity of the Triton kernels' block lists: ``"auto"`` (default: a cost model
            per layout and side picks the layout block or its half), ``"coarse"`` (layout blocks),
            ``"half"`` or ``"fine"`` (the kernel tile's step).
        list_stages: with finer lists, keep each loop's stage count (``"same"``) or multiply it by
            the tiles per layout block (``"tiles"``).
        row_arith: rows whose unmasked blocks form one run are stored as runs (indices computed).
        col_arith: the same for dK/dV's columns: True, False, or None (only where listing would be
            large).
        fwd_other: the forward's listed indices: ``"load"`` or ``"prefetch"`` (one entry ahead).
        kv_desc: the Triton forward loads K/V through tensor descriptors (TMA) where possible.
        warp_specialize: warp-specialise the Triton forward's unmasked loop (needs ``kv_desc``).
        masked_stages: pipelining depth of the Triton forward's masked loop (None: the tile's).
        split_chunk: force the work-list chunk that splits long rows/columns (None: the default).
        residue_gqa: grouped-query inputs of a rewritten strided mask run on class views (True) or
            on permuted copies (False).
        global_split: masks with ``g`` global tokens whose other keys form one band per row
            (Longformer's ``window(w) | global_tokens(g)``, attention sinks ``causal &
            (sliding_window(w) | global_tokens(s))``) run as the band on the interval kernels,
            the first ``g`` rows and the global keys (``compiler/globals.py``). None (default):
            where the band runs the Gluon interval forward (Hopper) — both phases for a few sinks
            (``g <= 16``); where the global keys (``g <= 128``) fold into the band's forward
            (more sinks, Longformer), the forward, and the backward too from 2^19 query rows
            times heads (``select.SPLIT_BACKWARD_MIN_ROWS``; below it the backward runs the whole
            mask); True: both phases wherever the Triton backend runs; False: never (the whole
            mask on the block kernels).
        run_split: masks that keep two runs of keys per row and split into two one-run parts
            (``key_range(a, b) | causal()``, a shared prefix ``causal & (key_range(0, p) |
            document(ids))``, block diffusion; ``compiler/runs.py``) run as those parts, merged
            through their logsumexps. None (default): in each phase where both parts run Gluon
            kernels (Hopper) and rows keep 2048 keys or more on average; True: wherever the Triton
            backend runs; False: never (the whole mask on the block kernels). The split backward
            holds the second part's gradients (the size of its rows' and keys' q, k, v) while it
            adds them.
        set_split: masks with global tokens at any positions beside a band (``key_set(K) |
            query_set(R) | band``, also under ``causal &``; at most 128 of each; the mask without
            the sets keeps one key interval per row; ``compiler/sets.py``)
            run as the band on the interval kernels, the global keys gathered into one key tile
            and the global rows gathered into one row tile, merged through their logsumexps (the
            backward adds the parts' gradients). None (default): the forward where the band runs
            the Gluon interval forward (Hopper), the backward whole (``select.SET_SPLIT_BACKWARD``);
            True: both phases wherever the Triton backend runs; False: never.
        document_runs: ``document`` masks whose documents are contiguous runs are evaluated from
            run bounds (True) rather than by comparing ids.
        fwd_tiles, dkdv_tiles, dq_tiles, atomic_tiles: force the Triton kernels' tiles
            (:class:`TileConfig`; None: the tuned tables of ``kernels/config.py``).
        band_backward: backward tiles of band-like partial-heavy layouts: ``"partial"`` or
            ``"flex"`` (FlexAttention's tile shapes in flat loops).
        replay: True (default): a call whose signature (layout, shapes, strides, dtypes,
            alignment, options) was seen twice with the same launches replays them, skipping the
            host's decisions (``ops/call_memo.py``; the Gluon paths, without dropout, score
            modifier, ``out_dtype``, ``grad_dtype`` or a logsumexp gradient). False: every call
            decides anew.
    """

    forward: str = "auto"
    interval: bool = True
    block_lists: bool | None = None
    gluon_fwd: GluonConfig | None = None
    backward: str = "auto"
    gluon_bwd: GluonBwdConfig | None = None
    deterministic: bool | None = None
    fused_backward: bool = True
    head_major: bool | None = None
    dq_desc: bool = False
    even: bool = True
    lists: str = "auto"
    list_stages: str = "same"
    row_arith: bool = True
    col_arith: bool | None = None
    fwd_other: str = "prefetch"
    kv_desc: bool = False
    warp_specialize: bool = False
    masked_stages: int | None = None
    split_chunk: float | None = None
    residue_gqa: bool = True
    global_split: bool | None = None
    run_split: bool | None = None
    set_split: bool | None = None
    document_runs: bool = True
    fwd_tiles: TileConfig | None = None
    dkdv_tiles: TileConfig | None = None
    dq_tiles: TileConfig | None = None
    atomic_tiles: TileConfig | None = None
    band_backward: str = "partial"
    replay: bool = True

    def __post_init__(self):
        for f in fields(self):
            name, value = f.name, getattr(self, f.name)
            if name in _CHOICES:
                if value not in _CHOICES[name]:
                    raise ValueError(f"kernel_options: {name} must be one of {_CHOICES[name]}, got {value!r}")
            elif name in _CONFIGS:
                if value is not None and not isinstance(value, _CONFIGS[name]):
                    raise ValueError(f"kernel_options: {name} must be a {_CONFIGS[name].__name__} or None, "
                                     f"got {value!r}")
            elif name in _OPTIONAL_BOOL:
                if value is not None and not isinstance(value, bool):
                    raise ValueError(f"kernel_options: {name} must be True, False or None, got {value!r}")
            elif name == "masked_stages":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(f"kernel_options: masked_stages must be a positive int or None, got {value!r}")
            elif name == "split_chunk":
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                          or not value > 0):
                    raise ValueError(f"kernel_options: split_chunk must be a positive number or None, got {value!r}")
            elif not isinstance(value, bool):
                raise ValueError(f"kernel_options: {name} must be True or False, got {value!r}")
        if self.warp_specialize and not self.kv_desc:
            raise ValueError("kernel_options: warp_specialize=True needs kv_desc=True")
        if self.forward == "ws" and os.environ.get("BSFA_EXPERIMENTAL_WS") != "1":
            raise ValueError("kernel_options forward='ws': the warp-specialised dense forward fails the float64 "
                             "check on the H100 with triton 3.6 (error 11x that of eager bf16; benchmarks/NOTES.md); "
                             "set BSFA_EXPERIMENTAL_WS=1 to run it anyway for experiments, or use forward='plain'")

    def replace(self, **changes) -> "KernelOptions":
        """A copy with ``changes`` (validated)."""
        return dataclasses.replace(self, **changes)

    def encode(self) -> str:
        """The options as a canonical string (only fields that differ from the defaults; ``""`` for
        the defaults): how they cross the custom op, a constant of a compiled graph."""
        return _encode(self)


DEFAULT_OPTIONS = KernelOptions()
_FIELDS = {f.name for f in fields(KernelOptions)}


@functools.lru_cache(maxsize=256)
def _encode(opts: KernelOptions) -> str:
    out = {}
    for f in fields(opts):
        value = getattr(opts, f.name)
        if value == f.default:
            continue
        if dataclasses.is_dataclass(value):
            value = {g.name: getattr(value, g.name) for g in fields(value)}
        out[f.name] = value
    return json.dumps(out, sort_keys=True, separators=(",", ":")) if out else ""


@functools.lru_cache(maxsize=256)
def decode_options(text: str) -> KernelOptions:
    """The :class:`KernelOptions` of :meth:`KernelOptions.encode`'s string (cached)."""
    if not text:
        return DEFAULT_OPTIONS
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"kernel_options: not an encoded KernelOptions: {text!r}")
    return as_options(data)


def as_options(kernel_options) -> KernelOptions:
    """``kernel_options`` (a :class:`KernelOptions`, a ``dict`` of its fields, the string of
    :meth:`KernelOptions.encode`, or None) validated. In a dict, a config option (``gluon_fwd``,
    ``gluon_bwd``, ``*_tiles``) may be its class's instance or a dict of its fields.

    Raises:
        ValueError: an unknown field (the message lists the known ones) or a bad value.
        TypeError: anything else than these forms.
    """
    if kernel_options is None:
        return DEFAULT_OPTIONS
    if isinstance(kernel_options, KernelOptions):
        return kernel_options
    if isinstance(kernel_options, str):
        try:
            return decode_options(kernel_options)
        except json.JSONDecodeError:
            raise ValueError(f"kernel_options: a string must come from KernelOptions.encode(), got "
                             f"{kernel_options!r}") from None
    if isinstance(kernel_options, dict):
        unknown = sorted(set(kernel_options) - _FIELDS)
        if unknown:
            raise ValueError(f"kernel_options: unknown option(s) {unknown}; expected some of {sorted(_FIELDS)}")
        data = dict(kernel_options)
        for name, cls in _CONFIGS.items():  # a config given as a dict of its fields
            if isinstance(data.get(name), dict):
                known = {f.name for f in fields(cls)}
                bad = sorted(set(data[name]) - known)
                if bad:
                    raise ValueError(f"kernel_options: {name} has no field(s) {bad}; expected some of {sorted(known)}")
                data[name] = cls(**data[name])
        return KernelOptions(**data)
    raise TypeError(f"kernel_options must be a KernelOptions, a dict of its fields, an encoded string or None, "
                    f"got {type(kernel_options).__name__}")
