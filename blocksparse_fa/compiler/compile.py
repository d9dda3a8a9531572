"""``compile_mask``: mask expression -> :class:`BlockLayout` (the one compiled object), cached."""

from __future__ import annotations

import functools
import time

import torch

from ..mask.dsl import parse
from ..mask.expr import Mask, query_offset
from .cache import LRUCache
from .classify import Grid, classify, refine
from .layout import BlockLayout
from .rewrite import build_rewrite
from .toeplitz import diagonal_states

__all__ = ["compile_mask", "clear_cache", "cache_info", "block_pair", "generation"]

DEFAULT_BLOCK = 128
DEFAULT_REFINE_BUDGET = 1 << 24  # elements evaluated to settle UNSURE blocks
_cache = LRUCache(64)
_generation = [0]  # bumped by clear_cache: caches of layouts elsewhere (ops) compare it


def block_pair(block_size) -> tuple[int, int]:
    """``(bm, bn)`` from ``None`` (the default 128), an int or a pair; rejects anything else."""
    if block_size is None:
        return (DEFAULT_BLOCK, DEFAULT_BLOCK)
    if isinstance(block_size, int) and not isinstance(block_size, bool):
        pair = (block_size, block_size)
    elif isinstance(block_size, (tuple, list)) and len(block_size) == 2:
        pair = (block_size[0], block_size[1])
    else:
        raise ValueError(f"block_size must be an int or a pair (bm, bn), got {block_size!r}")
    for b in pair:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"block_size entries must be positive ints, got {block_size!r}")
    return pair  # type: ignore[return-value]


def _device(device) -> torch.device:
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def compile_mask(mask, q_len: int, kv_len: int | None = None, block_size=128, *, device=None,
                 refine_budget: int = DEFAULT_REFINE_BUDGET, cache: bool = True,
                 rewrite: bool = True, align: str = "bottom_right") -> BlockLayout:
    """Compile a mask into a block layout without materialising the ``q_len × kv_len`` mask.

    The result is everything the kernels need for these lengths: block states, lookup tables
    (built on first use, in a size that follows the layout's structure), and any exact rewrite
    (e.g. the Sparse Transformer strided pattern as a band plus residue classes). Pass it as
    ``mask=`` to :func:`blocksparse_fa.attention` to reuse it: it runs exactly like the expression.

    Args:
        mask: a :class:`Mask` or DSL text.
        q_len: query length.
        kv_len: key length (default ``q_len``).
        block_size: ``bm`` or ``(bm, bn)``.
        device: where the lookup tables live (default CPU).
        refine_budget: mask elements the compiler may evaluate to settle blocks that the state
            algebra leaves uncertain (``&``/``|`` of two partial blocks); 0 disables refinement.
        cache: reuse a layout compiled for the same (mask, lengths, block size, device, budget, align).
        rewrite: let the compiler plan exact rewrites (used by the Triton backend without dropout).
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
    bm, bn = block_pair(block_size)
    dev = _device(device)
    query_offset(q_len, kv_len, align)  # validates align
    key = (mask, q_len, kv_len, bm, bn, str(dev), refine_budget, bool(rewrite), align)
    if cache:
        hit = _cache.get(key)
        if hit is not None:
            return hit
    t0 = time.perf_counter()
    grid = Grid(q_len, kv_len, bm, bn, align)
    diag = diagonal_states(mask, grid)  # strided masks on square blocks: exact, O(q_len + kv_len)

    def states():
        if diag is not None:
            return diag.segments(), 0
        segs = classify(mask, grid).broadcast_to(mask.batch_shape or (1, 1))
        return refine(segs, mask, grid, refine_budget)

    rw = build_rewrite(mask, q_len, kv_len, (bm, bn), dev, functools.partial(compile_mask, cache=cache)) if rewrite else None
    # A rewritten mask runs as its parts: its own block states are classified only when asked for
    # (statistics, pictures, the CPU backend), since the rewrite exists because they are costly.
    layout = BlockLayout(mask, grid, states if rw is not None or diag is not None else states(), dev, rewrite=rw,
                         diagonals=diag)
    layout.compile_seconds = time.perf_counter() - t0
    if cache:
        _cache.put(key, layout)
    return layout


def clear_cache() -> None:
    """Forget every cached layout (also those remembered by ``attention`` per mask object)."""
    _cache.clear()
    _generation[0] += 1


def generation() -> int:
    """Counter of :func:`clear_cache` calls (layouts cached elsewhere are valid for one generation)."""
    return _generation[0]


def cache_info() -> dict:
    """``{"hits", "misses", "size"}`` of the layout cache."""
    return _cache.info()
