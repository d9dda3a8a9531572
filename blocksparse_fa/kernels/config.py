"""Tile sizes and launch parameters per (head dim, dtype, kernel).

Kernel tiles must divide the layout block (checked here and by ``tl.static_assert`` in the kernels);
the layout block must be a power of two >= 16 for the Triton backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# (head_dim_pad upper bound) -> config; chosen on an H100 (see benchmarks/NOTES.md)
# fwd: (BLOCK_M queries, BLOCK_N keys); dkdv: (BLOCK_M queries per step, BLOCK_N keys per program);
# dq: (BLOCK_M queries per program, BLOCK_N keys per step). Measured: benchmarks/NOTES.md (v2 sweep).
_FWD = {64: TileConfig(64, 128, 4, 3), 128: TileConfig(128, 128, 8, 3), 256: TileConfig(64, 32, 4, 2)}
_BWD_DKDV = {64: TileConfig(64, 64, 4, 2), 128: TileConfig(64, 128, 8, 2), 256: TileConfig(32, 32, 4, 1)}
_BWD_DQ = {64: TileConfig(128, 32, 8, 2), 128: TileConfig(128, 128, 8, 2), 256: TileConfig(32, 32, 4, 1)}
_OVERRIDES: dict[str, TileConfig] = {}


def head_dim_pad(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def check_layout_block(bm: int, bn: int) -> None:
    for name, b in (("bm", bm), ("bn", bn)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"the Triton backend needs layout block sizes that are powers of two >= 16; "
                             f"got {name}={b} (compile the mask with block_size=64 or 128)")


def _pick(table, d_pad: int, layout_bm: int, layout_bn: int) -> TileConfig:
    cfg = table[min(k for k in table if k >= d_pad)]
    return TileConfig(min(cfg.block_m, layout_bm), min(cfg.block_n, layout_bn), cfg.num_warps, cfg.num_stages)


def fwd_config(d_pad: int, dtype: torch.dtype, layout_bm: int, layout_bn: int) -> TileConfig:
    if "fwd" in _OVERRIDES:
        c = _OVERRIDES["fwd"]
        return TileConfig(min(c.block_m, layout_bm), min(c.block_n, layout_bn), c.num_warps, c.num_stages)
    cfg = _pick(_FWD, d_pad, layout_bm, layout_bn)
    if dtype == torch.float32:  # fp32 tiles take twice the shared memory
        cfg = TileConfig(min(cfg.block_m, 64), min(cfg.block_n, 32), cfg.num_warps, 2)
    return cfg


def bwd_configs(d_pad: int, dtype: torch.dtype, layout_bm: int, layout_bn: int) -> tuple[TileConfig, TileConfig]:
    out = []
    for name, table in (("dkdv", _BWD_DKDV), ("dq", _BWD_DQ)):
        if name in _OVERRIDES:
            c = _OVERRIDES[name]
            cfg = TileConfig(min(c.block_m, layout_bm), min(c.block_n, layout_bn), c.num_warps, c.num_stages)
        else:
            cfg = _pick(table, d_pad, layout_bm, layout_bn)
            if dtype == torch.float32:
                cfg = TileConfig(min(cfg.block_m, 32), min(cfg.block_n, 32), cfg.num_warps, 1)
        out.append(cfg)
    return out[0], out[1]


def set_override(kernel: str, cfg: TileConfig | None) -> None:
    """Force a tile config for ``"fwd"``, ``"dkdv"`` or ``"dq"`` (benchmarks/tuning); None resets."""
    if cfg is None:
        _OVERRIDES.pop(kernel, None)
    else:
        _OVERRIDES[kernel] = cfg
