"""Tile sizes and launch parameters per (head dim, dtype, kernel).

Kernel tiles must divide the layout block (checked here and by ``tl.static_assert`` in the kernels);
the layout block must be a power of two >= 16 for the Triton backend.
"""

from __future__ import annotations

import torch

from ..ops.options import TileConfig


# (head_dim_pad upper bound) -> config; chosen on an H100 (see benchmarks/NOTES.md)
# fwd: (BLOCK_M queries, BLOCK_N keys); dkdv: (BLOCK_M queries per step, BLOCK_N keys per program);
# dq: (BLOCK_M queries per program, BLOCK_N keys per step). Measured: benchmarks/NOTES.md, "Tile configurations".
_FWD = {64: TileConfig(64, 128, 4, 3), 128: TileConfig(128, 128, 8, 2), 256: TileConfig(64, 32, 4, 2)}
_BWD_DKDV = {64: TileConfig(64, 64, 4, 2), 128: TileConfig(64, 128, 8, 2), 256: TileConfig(32, 32, 4, 1)}
_BWD_DQ = {64: TileConfig(128, 32, 8, 2), 128: TileConfig(128, 128, 8, 2), 256: TileConfig(32, 32, 4, 1)}
# Band-like layouts ("short rows": few blocks per row, mostly full) run faster with 64-key steps
# in the forward and dQ (benchmarks/NOTES.md, "Tile configurations": sliding_window(1024) fwd 0.472 -> 0.436 ms,
# backward 1.338 -> 1.268 ms); dense/causal and partial-heavy patterns keep the tables above.
_FWD_SHORT = {128: TileConfig(128, 64, 8, 2)}
# Short rows with many partial blocks (narrow windows, Longformer, BigBird): 64-key steps with three
# stages; the 128x128 tiles spill there (sliding_window(128): 88 MB of local loads per forward).
# A/B (benchmarks/NOTES.md, "Forward kernel"), fwd ms: window 128 0.213 -> 0.202, 256 0.247 -> 0.235, 512 0.313 -> 0.298,
# Longformer 0.546 -> 0.525, BigBird 0.600 -> 0.579.
_FWD_SHORT_PARTIAL = {128: TileConfig(128, 64, 8, 3)}
_BWD_DQ_SHORT = {128: TileConfig(128, 64, 8, 2)}
SHORT_ROW_BLOCKS = 12.0
SHORT_ROW_PARTIAL = 0.3
# Sparse layouts with many partial blocks (sliding windows, documents, Longformer, BigBird) run
# their backward with 32-query dK/dV steps and 64-key dQ steps: no register spills (ncu, 16K:
# local loads 602 -> 8 MB on documents; Longformer 389 MB -> 2 MB of spill fills), L2->SM bytes at
# the traffic model, Longformer 1.447 -> 1.332 ms, BigBird 1.673 -> 1.605 ms, documents and the
# 1024 window unchanged within 1 %. Dense and causal lose 3-6 % with them and keep the tables above
# (A/B, benchmarks/NOTES.md, "Backward kernels").
_BWD_PARTIAL = {128: (TileConfig(32, 128, 8, 2), TileConfig(128, 64, 8, 2))}
PARTIAL_HEAVY = 0.1
# FlexAttention's backward tiles at d = 128 on Hopper (dK/dV 64 queries x 128 keys, dQ 128 x 64,
# 8 warps, 3 tiles in flight), in flat loops (one iteration per kernel tile: unrolled over a 128-token
# layout block, three stages of 64-token tiles would need 264 KB of shared memory, flat 165 KB; sm_90
# compile, triton 3.6, sliding_window(1024): 96 B of stack against 168 B for today's 64x128 pair).
# A candidate for band-like backward layouts (partial-heavy but with short, mostly full rows: sliding
# windows, packed documents), chosen with kernel_options band_backward="flex"; not yet timed on the GPU.
_BWD_BAND_TABLES = {
    "partial": _BWD_PARTIAL,
    "flex": {128: (TileConfig(64, 128, 8, 3, flat=True), TileConfig(128, 64, 8, 3, flat=True))},
}
BAND_BWD_ROW_BLOCKS = 16.0
# The five-GEMM backward (kernels/backward_atomic.py): one tile, dK/dV programs that also add dQ.
# sm_90, triton 3.6 (benchmarks/experiments/sass_probe.py --kernel atomic, Longformer): 32x128 with
# two stages fits shared memory (214 KB; 230 KB with TMA reduce-adds); 64x128 spills 400 B per
# thread at one stage, and two stages do not fit. Not yet timed on the GPU (kernel_ab.py).
_BWD_ATOMIC = {64: TileConfig(32, 64, 4, 2), 128: TileConfig(32, 128, 8, 2), 256: TileConfig(16, 32, 4, 1)}


def short_rows(mean_row_blocks: float, partial_fraction: float) -> bool:
    """Whether a layout counts as band-like: at most ``SHORT_ROW_BLOCKS`` visited blocks per row
    on average, at most ``SHORT_ROW_PARTIAL`` of them partial."""
    return 0 < mean_row_blocks <= SHORT_ROW_BLOCKS and partial_fraction <= SHORT_ROW_PARTIAL


def short_partial_rows(mean_row_blocks: float, partial_fraction: float) -> bool:
    """Short rows (as in :func:`short_rows`) of which more than ``SHORT_ROW_PARTIAL`` are partial."""
    return 0 < mean_row_blocks <= SHORT_ROW_BLOCKS and partial_fraction > SHORT_ROW_PARTIAL


def partial_rows(mean_row_blocks: float, partial_fraction: float) -> bool:
    """Rows of any length of which more than ``SHORT_ROW_PARTIAL`` of the visited blocks are partial:
    the forward's masked loop dominates, and it runs faster in 128 x 64 steps with three stages
    (H200, 16K: periodic window 0.703 -> 0.456 ms; ``benchmarks/NOTES.md``, "Mostly partial rows")."""
    return mean_row_blocks > 0 and partial_fraction > SHORT_ROW_PARTIAL


def head_dim_pad(d: int) -> int:
    """The head dim rounded up to a power of two (>= 16): the kernels' tile width."""
    return max(16, 1 << (d - 1).bit_length())


def check_layout_block(bm: int, bn: int) -> None:
    for name, b in (("bm", bm), ("bn", bn)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"the Triton backend needs layout block sizes that are powers of two >= 16; "
                             f"got {name}={b} (compile the mask with block_size=64 or 128)")


def _pick(table, d_pad: int, layout_bm: int, layout_bn: int) -> TileConfig:
    cfg = table[min(k for k in table if k >= d_pad)]
    return TileConfig(min(cfg.block_m, layout_bm), min(cfg.block_n, layout_bn), cfg.num_warps, cfg.num_stages,
                      cfg.flat)


def _fit(c: TileConfig, layout_bm: int, layout_bn: int) -> TileConfig:
    """A forced config clipped to the layout block."""
    return TileConfig(min(c.block_m, layout_bm), min(c.block_n, layout_bn), c.num_warps, c.num_stages, c.flat)


def fwd_config(d_pad: int, dtype: torch.dtype, layout_bm: int, layout_bn: int, band: bool = False,
               partial: bool = False, force: TileConfig | None = None) -> TileConfig:
    """Forward tiles; ``band`` (see :func:`short_rows`) and ``partial`` (see :func:`partial_rows`)
    pick their tables where they have one; ``force`` (the
    ``fwd_tiles`` kernel option) replaces the tables."""
    if force is not None:
        return _fit(force, layout_bm, layout_bn)
    table = _FWD
    if band and d_pad in _FWD_SHORT:
        table = _FWD_SHORT
    elif partial and d_pad in _FWD_SHORT_PARTIAL and min(layout_bm, layout_bn) >= 128:
        table = _FWD_SHORT_PARTIAL  # measured on 128-blocks only; smaller layout blocks keep _FWD
    cfg = _pick(table, d_pad, layout_bm, layout_bn)
    if dtype == torch.float32:  # fp32 tiles take twice the shared memory
        cfg = TileConfig(min(cfg.block_m, 64), min(cfg.block_n, 32), cfg.num_warps, 2)
    return cfg


def band_backward_rows(mean_row_blocks: float, partial_fraction: float) -> bool:
    """Band-like for the backward: at most ``BAND_BWD_ROW_BLOCKS`` visited blocks per row, at most
    ``SHORT_ROW_PARTIAL`` of them partial (sliding windows, packed documents)."""
    return 0 < mean_row_blocks <= BAND_BWD_ROW_BLOCKS and partial_fraction <= SHORT_ROW_PARTIAL


def bwd_configs(d_pad: int, dtype: torch.dtype, layout_bm: int, layout_bn: int,
                band: bool = False, partial_heavy: bool = False, band_bwd: bool = False,
                band_table: str = "partial", force: tuple = (None, None)) -> tuple[TileConfig, TileConfig]:
    """(dK/dV, dQ) tiles; ``band`` as in :func:`fwd_config`; ``partial_heavy``: at least
    ``PARTIAL_HEAVY`` of the visited blocks are partial; ``band_bwd`` (see
    :func:`band_backward_rows`) takes the table ``band_table`` (``"partial"`` or ``"flex"``, the
    ``band_backward`` kernel option) for partial-heavy layouts. ``force``: ``(dK/dV, dQ)``
    configs replacing the tables (the ``dkdv_tiles``/``dq_tiles`` kernel options), None each."""
    if band_table not in _BWD_BAND_TABLES:
        raise ValueError(f"unknown band backward table {band_table!r}; expected one of {sorted(_BWD_BAND_TABLES)}")
    out = []
    dq_table = _BWD_DQ_SHORT if band and d_pad in _BWD_DQ_SHORT else _BWD_DQ
    kv_table = _BWD_DKDV
    partial = _BWD_BAND_TABLES[band_table] if band_bwd else _BWD_PARTIAL
    if partial_heavy and d_pad in partial:
        kv_table = {d_pad: partial[d_pad][0]}
        dq_table = {d_pad: partial[d_pad][1]}
    for forced, table in zip(force, (kv_table, dq_table)):
        if forced is not None:
            cfg = _fit(forced, layout_bm, layout_bn)
        else:
            cfg = _pick(table, d_pad, layout_bm, layout_bn)
            if dtype == torch.float32:
                cfg = TileConfig(min(cfg.block_m, 32), min(cfg.block_n, 32), cfg.num_warps, 1, cfg.flat)
        out.append(cfg)
    return out[0], out[1]


def atomic_bwd_config(d_pad: int, dtype: torch.dtype, layout_bm: int, layout_bn: int,
                      force: TileConfig | None = None) -> TileConfig:
    """Tiles of the five-GEMM backward: ``(queries per step, keys per program)``; ``force``: the
    ``atomic_tiles`` kernel option."""
    if force is not None:
        return _fit(force, layout_bm, layout_bn)
    cfg = _pick(_BWD_ATOMIC, d_pad, layout_bm, layout_bn)
    if dtype == torch.float32:
        cfg = TileConfig(min(cfg.block_m, 16), min(cfg.block_n, 32), cfg.num_warps, 1)
    return cfg
