"""Work lists: load balancing for skewed layouts (host side, numpy).

A layout like Longformer has a few rows (global queries) and columns (global keys) that visit every
block while all others visit a handful. One program per row then leaves the GPU idle while a few
programs walk their long lists. The work list fixes both problems:

* **splitting**: a tile whose LUT list costs more than ``chunk`` is cut into contiguous pieces
  (over its full-then-partial list); each piece writes a partial result (forward: normalised output
  and logsumexp; backward: fp32 gradient sums) that a small combine kernel merges exactly;
* **heavy first**: work items are ordered by decreasing cost, so long items start early and short
  ones fill the tail.

``chunk`` is half the average work per hardware slot (``total cost / slots / 2``), at least
``min_chunk``; a tile costing more is cut into pieces of at most ``chunk``. A tile longer than the
average slot's work is the kernel's critical path, so it must be cut below that average; dense and
causal layouts (every tile far below the average) keep one program per tile.

Each work item is ``(tile, f0, f1, p0, p1, slot)``: the tile index (query tile for forward/dQ,
key tile for dK/dV), entry ranges into the full and partial index lists, and the partial-result
slot (-1: write the final result directly). Combine items are ``(tile, first_slot, n_slots)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MASKED_COST = 1.5  # a masked (partial) block costs ~1.5 unmasked ones (predicate + where)


@dataclass
class WorkList:
    work: torch.Tensor  # int32 (W, 6)
    combine: torch.Tensor  # int32 (C, 3)
    n_slots: int
    n_items: int
    n_combine: int
    chunk: float


def build_worklist(full_ptr: np.ndarray, part_ptr: np.ndarray, tiles_per_block: int, n_tiles: int,
                   n_heads: int, hw_slots: int, min_chunk: float = 8.0, device="cpu",
                   force_chunk: float | None = None, entry_size: float = 1.0) -> WorkList:
    """Work list over ``n_tiles`` tiles of one layout instance (LUT rows ``tile // tiles_per_block``).

    Args:
        full_ptr, part_ptr: CSR pointers (``n_blocks + 1``) of the unmasked and masked lists.
        tiles_per_block: kernel tiles per layout block along this side.
        n_tiles: tiles along this side (``ceil(length / tile)``).
        n_heads: programs per tile along the grid's second axis (batch · heads).
        hw_slots: programs the GPU runs at once (SMs × resident programs per SM).
        min_chunk: never split below this many (unmasked-equivalent) entries.
        force_chunk: use this chunk (tests).
        entry_size: work of one list entry in layout blocks (finer lists, ``compiler/finer.py``:
            an entry of half a block costs half as much), so that costs and chunks stay in layout
            blocks whatever the lists' granularity.
    """
    full_ptr = np.asarray(full_ptr, dtype=np.int64)
    part_ptr = np.asarray(part_ptr, dtype=np.int64)
    blk = np.arange(n_tiles) // tiles_per_block
    f_start, f_len = full_ptr[blk], full_ptr[blk + 1] - full_ptr[blk]
    p_start, p_len = part_ptr[blk], part_ptr[blk + 1] - part_ptr[blk]
    cost = entry_size * (f_len + MASKED_COST * p_len) + 1.0
    if force_chunk is not None:
        chunk = float(force_chunk)
    else:
        chunk = max(min_chunk, 0.5 * float(cost.sum()) * n_heads / max(1, hw_slots))
    n_split = np.where(cost > chunk, np.ceil(cost / chunk), 1).astype(np.int64)
    n_entries = f_len + p_len
    n_split = np.minimum(n_split, np.maximum(n_entries, 1))
    # expand items
    tile = np.repeat(np.arange(n_tiles), n_split)
    k = np.arange(int(n_split.sum())) - np.repeat(np.cumsum(n_split) - n_split, n_split)
    s = n_split[tile]
    tot = n_entries[tile]
    lo = (k * tot) // s
    hi = ((k + 1) * tot) // s
    fl = f_len[tile]
    f0 = f_start[tile] + np.minimum(lo, fl)
    f1 = f_start[tile] + np.minimum(hi, fl)
    p0 = p_start[tile] + np.maximum(lo - fl, 0)
    p1 = p_start[tile] + np.maximum(hi - fl, 0)
    split = s > 1
    slot = np.full(len(tile), -1, dtype=np.int64)
    slot[split] = np.arange(int(split.sum()))
    item_cost = entry_size * ((f1 - f0) + MASKED_COST * (p1 - p0))
    order = np.argsort(-item_cost, kind="stable")
    work = np.stack([tile, f0, f1, p0, p1, slot], axis=1)[order]
    split_tiles = np.nonzero(n_split > 1)[0]
    first = np.cumsum(n_split[split_tiles]) - n_split[split_tiles]
    combine = np.stack([split_tiles, first, n_split[split_tiles]], axis=1) if len(split_tiles) else np.zeros((0, 3), np.int64)
    n_slots = int(split.sum())
    to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32).reshape(-1) if a.size else np.zeros(1, np.int32)).to(device)
    return WorkList(to_t(work), to_t(combine), n_slots, len(work), len(combine), chunk)


_SLOTS: dict = {}


def hw_slots(device: torch.device, programs_per_sm: int = 1) -> int:
    """Programs the device runs at once (SM count × programs per SM); 8 on the CPU interpreter."""
    if device.type != "cuda":
        return 8 * programs_per_sm
    key = (str(device), programs_per_sm)
    if key not in _SLOTS:
        _SLOTS[key] = torch.cuda.get_device_properties(device).multi_processor_count * programs_per_sm
    return _SLOTS[key]


def worklists_enabled(layout) -> bool:
    """Work lists need one layout instance (the same LUT for every batch and head)."""
    return not layout.batch_shape
