"""``compile_mask``: mask expression -> :class:`BlockLayout`, cached."""

from __future__ import annotations

import collections
import threading
import time

import torch

from ..mask.dsl import parse
from ..mask.expr import Mask, query_offset
from .classify import Grid, classify, refine
from .layout import BlockLayout

__all__ = ["compile_mask", "clear_cache", "cache_info"]

DEFAULT_REFINE_BUDGET = 1 << 24  # elements evaluated to settle UNSURE blocks
_CACHE_SIZE = 64
_cache: "collections.OrderedDict[tuple, BlockLayout]" = collections.OrderedDict()
_lock = threading.Lock()
_stats = {"hits": 0, "misses": 0}


def _block_pair(block_size) -> tuple[int, int]:
    if isinstance(block_size, int) and not isinstance(block_size, bool):
        pair = (block_size, block_size)
    elif isinstance(block_size, (tuple, list)) and len(block_size) == 2:
        pair = tuple(block_size)
    else:
        raise ValueError(f"block_size must be an int or a pair (bm, bn), got {block_size!r}")
    for b in pair:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"block_size entries must be positive ints, got {block_size!r}")
    return pair  # type: ignore[return-value]


def compile_mask(mask, q_len: int, kv_len: int | None = None, block_size=128, *, device=None,
                 refine_budget: int = DEFAULT_REFINE_BUDGET, cache: bool = True,
                 align: str = "bottom_right") -> BlockLayout:
    """Compile a mask into a block layout without materialising the ``q_len × kv_len`` mask.

    Args:
        mask: a :class:`Mask` or DSL text.
        q_len: query length.
        kv_len: key length (default ``q_len``).
        block_size: ``bm`` or ``(bm, bn)``.
        device: where the lookup tables live (default CPU).
        refine_budget: mask elements the compiler may evaluate to settle blocks that the state
            algebra leaves uncertain (``&``/``|`` of two partial blocks); 0 disables refinement.
        cache: reuse a layout compiled for the same (mask, lengths, block size, device, budget, align).
        align: where query row ``i`` sits: ``"bottom_right"`` (position ``i + kv_len - q_len``,
            decode sees the whole cache) or ``"top_left"`` (position ``i``, as FlexAttention and
            SDPA's ``is_causal``).

    Returns:
        A :class:`BlockLayout`.
    """
    if isinstance(mask, str):
        mask = parse(mask)
    if not isinstance(mask, Mask):
        raise TypeError(f"compile_mask(): mask must be a Mask or DSL text, got {type(mask).__name__}")
    kv_len = q_len if kv_len is None else kv_len
    mask.check_lengths(q_len, kv_len)
    bm, bn = _block_pair(block_size)
    dev = torch.device("cpu" if device is None else device)
    query_offset(q_len, kv_len, align)  # validates align
    key = (mask, q_len, kv_len, bm, bn, str(dev), refine_budget, align)
    if cache:
        with _lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
                _stats["hits"] += 1
                return hit
    t0 = time.perf_counter()
    grid = Grid(q_len, kv_len, bm, bn, align)
    segs = classify(mask, grid)
    bs = mask.batch_shape or (1, 1)
    segs = segs.broadcast_to(bs)
    segs, n_refined = refine(segs, mask, grid, refine_budget)
    layout = BlockLayout(mask, grid, segs, dev, n_refined, 0.0)
    layout.compile_seconds = time.perf_counter() - t0
    if cache:
        with _lock:
            _stats["misses"] += 1
            _cache[key] = layout
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return layout


def clear_cache() -> None:
    """Forget every cached layout."""
    with _lock:
        _cache.clear()


def cache_info() -> dict:
    """``{"hits", "misses", "size"}`` of the layout cache."""
    with _lock:
        return {**_stats, "size": len(_cache)}
