"""Masks with global tokens as a band, the global rows and the global keys.

``window(w) | global_tokens(g)`` (Longformer) and ``causal & (sliding_window(w) | global_tokens(s))``
(attention sinks) keep two runs of keys on most rows: the first ``g`` keys and a band. As one
layout they need the block kernels' element predicate on every tile that holds a global key or a
global row. Split by ``global_tokens(g)`` they are three exact, disjoint parts:

* the **band** ``mask & ~global_tokens(g)``: one key interval per row, with bounds that grow with
  the row (so that every key tile sees one run of rows): the interval kernels, Gluon on Hopper;
* the **global keys** ``k < g``: every row ``>= g`` keeps all ``g`` of them (checked), the first
  ``g`` rows those of a ``g × g`` corner: on Hopper the band's Gluon forward visits them first in
  every work item, elsewhere one small fused kernel (``kernels/globals.py``) merges them into the
  other parts' output; their backward adds their dQ in place and sums their dK/dV;
* the **global rows** ``q < g`` over the keys ``>= g``, where they keep any (Longformer's, not the
  sinks' under ``causal``): where they keep all of them, a split-K kernel pair
  (``kernels/globals.py``), else a ``g × Lk`` layout on the block kernels, whose work lists split
  its long rows.

:func:`global_split` finds ``g`` and checks the three conditions on the expression (``O(L·k)``, never
``Lq × Lk``); ``ops/globals.py`` runs the parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..mask import primitives as P
from ..mask.expr import Mask
from .intervals import _sets, _supported, mask_row_interval, split_per_layout

__all__ = ["GlobalSplit", "global_split", "MAX_GLOBAL"]

MAX_GLOBAL = 128
"""Largest ``g`` split off: the global keys' kernel holds them in one tile."""


@dataclass
class GlobalSplit:
    """The parts of a mask with ``g`` global tokens (see the module docstring).

    Attributes:
        g: the number of global tokens (rows ``< g`` and keys ``< g``).
        band: the compiled layout of ``mask & ~global_tokens(g)`` at the mask's lengths.
        corner: bool ``(g, g)`` numpy array: which of the first ``g`` keys the first ``g`` rows keep
            (every later row keeps all of them).
        rows: the compiled layout of the first ``g`` rows over the keys ``>= g`` (``g × Lk``,
            top-left) where they keep some but not all of them, else None.
        rows_full: the first ``g`` rows keep every key ``>= g`` (Longformer's global rows): they
            run as a split-K part of their own (``kernels/globals._global_rows_fwd``).
    """

    g: int
    band: object
    corner: np.ndarray
    rows: object = None
    rows_full: bool = False


def _global_count(mask: Mask) -> int | None:
    """The ``g`` of the expression's ``global_tokens`` leaves when they all have the same scalar one."""
    leaves = [leaf for leaf in mask.leaves() if isinstance(leaf, P.GlobalTokens)]
    if not leaves or any(leaf.has_tensor_params for leaf in leaves):
        return None
    gs = {int(leaf._params[0]) for leaf in leaves}
    return gs.pop() if len(gs) == 1 else None


def split_parts(mask: Mask, q_len: int, kv_len: int, q_offset: int):
    """``(g, band mask, corner, rows)`` when ``mask`` splits as the module docstring says at these
    lengths, else None; ``rows``: None (the first rows keep no later key), ``"full"`` (they keep
    every later key) or the mask of their part."""
    if mask.batch_shape or q_offset != 0 or not _supported(mask):
        return None
    g = _global_count(mask)
    if g is None or not 1 <= g <= MAX_GLOBAL or g >= min(q_len, kv_len):
        return None
    band = mask & ~P.GlobalTokens(g)
    iv = mask_row_interval(band, q_len, kv_len, q_offset=0)
    if iv is None:
        return None
    lo, hi = iv[0][0, g:].astype(np.int64), iv[1][0, g:].astype(np.int64)
    kept = lo < hi
    if kept.sum() < 2 or (np.diff(lo[kept]) < 0).any() or (np.diff(hi[kept]) < 0).any():
        return None  # the band's key tiles would not see one run of rows each
    # every row >= g keeps all of the first g keys
    s = _sets(mask, np.arange(g, q_len, dtype=np.int64), kv_len, 0, 0)
    if s is None or not ((s[0] <= 0) & (s[1] >= g - 1) & (s[0] <= s[1])).any(1).all():
        return None
    # the first g rows: which global keys they keep, and whether they keep later keys
    s0 = _sets(mask, np.arange(g, dtype=np.int64), kv_len, 0, 0)
    if s0 is None or not (s0[0] <= s0[1]).any(1).all():
        return None  # a row that keeps nothing
    lo0, hi0 = s0
    keys = np.arange(g)
    corner = ((lo0[:, :, None] <= keys) & (keys <= hi0[:, :, None])).any(1)
    if ((lo0 <= g) & (hi0 >= kv_len - 1) & (lo0 <= hi0)).any(1).all():
        rows = "full"
    elif ((hi0 >= g) & (lo0 <= hi0)).any():
        rows = mask & P.KeyRange(g, kv_len)
    else:
        rows = None
    return g, band, corner, rows


def global_split(layout, compile_fn) -> GlobalSplit | None:
    """The :class:`GlobalSplit` of a compiled layout (its mask, lengths, query offset and block
    size), built once and cached on the layout; None where the mask does not split (and for shards
    of a larger layout). ``compile_fn``: :func:`~blocksparse_fa.compiler.compile.compile_mask`."""

    def make(hit):
        g, band, corner, rows = hit
        dev, blk = layout.device, layout.block_size
        part = None if rows is None or isinstance(rows, str) else \
            compile_fn(rows, g, layout.kv_len, blk, device=dev, rewrite=False, align="top_left")
        return GlobalSplit(g, compile_fn(band, layout.q_len, layout.kv_len, blk, device=dev, rewrite=False),
                           corner, part, rows == "full")

    return split_per_layout(layout, "global_split", split_parts, make)
