"""Simplify the element predicate against the blocks where the kernels evaluate it.

The kernels evaluate the mask element by element only on *masked* blocks (partial blocks, plus full
blocks on a ragged edge). A primitive that is constant on every one of those blocks — all empty or
all full there — can be replaced by that constant in the predicate. BigBird is the common case:
its random key blocks are aligned to the layout blocks, so on the partial blocks (the window's
edges) the random term is always empty, and the predicate loses its per-element bit-grid gather.

The result is exact on the masked blocks by construction; it is used only to generate the
predicate, never to classify blocks.
"""

from __future__ import annotations

import numpy as np

from ..mask.expr import And, Mask, Not, Or
from ..mask.primitives import MaskMod, full
from ..mask.shift import Shift
from .classify import Grid, classify
from .segments import EMPTY, FULL, Segments

__all__ = ["masked_blocks", "predicate_mask"]


def masked_blocks(segs: Segments, grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ``(r, c)`` layout blocks (over all instances) on which some kernel evaluates the
    predicate: partial blocks and, on ragged edges, full ones."""
    rows, cols, st = segs.blocks(nonempty=True)
    masked = st != FULL
    if grid.kv_len % grid.bn:
        masked |= cols == grid.tc - 1
    if grid.q_len % grid.bm:
        masked |= rows % grid.tr == grid.tr - 1
    r = rows[masked] % grid.tr
    c = cols[masked]
    key = np.unique(r * grid.tc + c)
    return key // grid.tc, key % grid.tc


def _leaf_constant(leaf: Mask, grid: Grid, r: np.ndarray, c: np.ndarray):
    """``True``/``False`` when ``leaf`` is full/empty on every block ``(r, c)``, else ``None``."""
    if leaf.batch_shape or len(r) == 0 or isinstance(leaf, MaskMod):
        return None  # batch-dependent primitives keep their predicate; callables are not re-evaluated
    segs = classify(leaf, grid)
    keys = segs.key
    pos = np.searchsorted(keys, r * (grid.tc + 1) + c, side="right") - 1
    st = segs.state[pos]
    if np.all(st == FULL):
        return True
    if np.all(st == EMPTY):
        return False
    return None


def _fold(mask: Mask, const: dict):
    """Replace constant leaves and fold: returns a Mask, True or False."""
    if isinstance(mask, (And, Or)):
        absorbing, neutral = (False, True) if isinstance(mask, And) else (True, False)
        kept = []
        for ch in mask.children:
            v = _fold(ch, const)
            if v is absorbing:
                return absorbing
            if v is not neutral:
                kept.append(v)
        if not kept:
            return neutral
        return kept[0] if len(kept) == 1 else type(mask)(kept)
    if isinstance(mask, Not):
        v = _fold(mask.children[0], const)
        return (not v) if isinstance(v, bool) else Not(v)
    if isinstance(mask, Shift):
        return mask  # its operand sees other positions: kept whole
    return const.get(id(mask), mask)


def predicate_mask(mask: Mask, segs: Segments, grid: Grid) -> Mask:
    """``mask`` with primitives that are constant on every masked block replaced by constants.

    Returns ``full()`` when the predicate is true on every masked block, and ``mask`` unchanged when
    nothing simplifies (or when it would fold to false, which a consistent layout never gives).
    """
    r, c = masked_blocks(segs, grid)
    const = {}
    shifted = {id(leaf) for node in mask.nodes() if isinstance(node, Shift) for leaf in node.leaves()}
    for leaf in mask.leaves():
        if id(leaf) in shifted:
            continue
        v = _leaf_constant(leaf, grid, r, c)
        if v is not None:
            const[id(leaf)] = v
    if not const:
        return mask
    out = _fold(mask, const)
    if out is True:
        return full()
    if out is False:
        return mask
    return out
