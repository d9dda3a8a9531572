"""Masks with global positions anywhere as a band, the positions' keys and the positions' rows.

``key_set(S) | query_set(S) | sliding_window(w)`` (global tokens at any positions, e.g. question or
memory tokens) keeps, on most rows, a band and a few scattered keys; on the rows in ``S``, every
key. As one layout every row tile that holds a global row walks all key tiles and every row walks
the global keys' tiles, all through the element predicate (16 positions at 16K: 26 % of the blocks
for 3 % of the pairs). Where the ``key_set(K)`` and ``query_set(R)`` leaves only ever add pairs
(none under ``~`` or a ``shift``: ``key_set(K) | query_set(R) | band``, ``causal & (key_set(K) |
sliding_window(w))``, ...) and the mask without them, the **band**, keeps one key interval per row,
three exact, disjoint parts cover it (on the rows outside ``R`` and the keys outside ``K`` the mask
is its band):

* the **band** on every row: the interval kernels, Gluon on Hopper;
* the **global keys** ``K`` that each row keeps outside its band, gathered into a ``len(K)``-key
  tensor that every row attends (one key tile; a dense bit mask, the mask evaluated on those
  columns, says which key each row keeps);
* the **global rows** ``R`` over the keys they keep outside their band and outside ``K``, gathered
  into a ``len(R)``-row tensor (one row tile; its long rows are split by the block kernels' work
  lists).

Their outputs merge through their logsumexps (``ops/sets.py``). By default only the forward runs as
parts: the backward of the whole mask reads the merged output and logsumexp, which are exact (the
parts' backward, which adds their gradients, is there with ``set_split=True``).

:func:`set_split` finds the split on the expression (``O(L·|K|)``, never ``Lq × Lk`` but for the
global rows' ``|R| × Lk`` bits).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import numpy as np

import torch

from ..mask import primitives as P
from ..mask.custom import DenseMask
from ..mask.expr import And, EvalContext, Mask, Not, Or
from ..mask.shift import Shift
from .intervals import mask_row_interval, split_per_layout

__all__ = ["SetSplit", "set_split", "split_parts", "MAX_SET"]

MAX_SET = 128
"""Most global keys or global rows split off: each part's gathered side fits one tile."""


@dataclass
class SetSplit:
    """The parts of a mask with global positions anywhere (see the module docstring).

    Attributes:
        band: the compiled layout of the band at the mask's lengths.
        keys: int64 ``(nk,)`` sorted global key positions (``< kv_len``); may be empty.
        rows: int64 ``(nr,)`` sorted global query rows (``< q_len``); may be empty.
        keys_part: compiled ``(q_len, nk)`` layout of the gathered global keys (a dense mask), or
            None without global keys.
        rows_part: compiled ``(nr, kv_len)`` layout of the gathered global rows, or None without them.
    """

    band: object
    keys: np.ndarray
    rows: np.ndarray
    keys_part: object = None
    rows_part: object = None


MAX_PART_BITS = 2**24
"""Largest ``q_len · |K|`` or ``|R| · kv_len`` at which the mask is evaluated for the gathered parts' bit
masks (once per layout, in int64 tensors of that many elements)."""

_SETS = (P.KeySet, P.QuerySet)


def _without_sets(mask: Mask):
    """``mask`` with every ``key_set``/``query_set`` leaf replaced by "keeps nothing" (None: the
    whole expression keeps nothing), or ``False`` where a set sits under ``~``, a ``shift`` or per
    batch row (then the mask is not split)."""
    if isinstance(mask, _SETS):
        return None if mask.tensor.shape[0] == 1 else False
    if isinstance(mask, (Not, Shift)):
        return False if any(isinstance(leaf, _SETS) for leaf in mask.leaves()) else mask
    if isinstance(mask, (And, Or)):
        kids = [_without_sets(c) for c in mask.children]
        if any(c is False for c in kids):
            return False
        if isinstance(mask, And):
            return None if any(c is None for c in kids) else functools.reduce(operator.and_, kids)
        kids = [c for c in kids if c is not None]
        return functools.reduce(operator.or_, kids) if kids else None
    return mask


def _positions(mask: Mask, kind, limit: int) -> np.ndarray:
    sets = [leaf.positions(0) for leaf in mask.leaves() if isinstance(leaf, kind)]
    pos = np.unique(np.concatenate([np.zeros(0, np.int64)] + sets)).astype(np.int64)
    return pos[pos < limit]


def _keeps(mask: Mask, q_len: int, kv_len: int, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``mask`` at the pairs ``rows × keys`` (top-left rows), a writable bool numpy array
    ``(len(rows), len(keys))`` (evaluated where the mask's tensors live, as ``Mask.to_dense``)."""
    dev = next((leaf._device() for leaf in mask.leaves() if leaf._device() is not None), None)
    i = torch.from_numpy(rows).view(-1, 1).to(dev or "cpu")
    ctx = EvalContext(q_len, kv_len, i, i, torch.from_numpy(keys).view(1, -1).to(i.device))
    return mask._eval(ctx).expand(len(rows), len(keys)).cpu().numpy().copy()


def split_parts(mask: Mask, q_len: int, kv_len: int, q_offset: int):
    """``(band mask, keys, rows, keep_keys (q_len, nk) bool, keep_rows (nr, kv_len) bool)`` when
    ``mask`` keeps, besides a band of one key interval per row, what its unbatched
    ``key_set``/``query_set`` leaves add (leaves that only ever add pairs: none under ``~`` or a
    ``shift``), else None. The band is the mask without those leaves. ``keep_keys[i, t]``: row
    ``i`` keeps global key ``keys[t]`` outside its band; ``keep_rows[r, j]``: global row
    ``rows[r]`` keeps key ``j`` outside its band and ``keys``."""
    if mask.batch_shape or q_offset != 0 or not any(isinstance(leaf, _SETS) for leaf in mask.leaves()):
        return None
    band = _without_sets(mask)
    if band is None or band is False:
        return None
    keys, rows = _positions(mask, P.KeySet, kv_len), _positions(mask, P.QuerySet, q_len)
    if not (len(keys) or len(rows)) or len(keys) > MAX_SET or len(rows) > MAX_SET:
        return None
    if q_len * len(keys) > MAX_PART_BITS or len(rows) * kv_len > MAX_PART_BITS:
        return None
    iv = mask_row_interval(band, q_len, kv_len, q_offset=0)
    if iv is None:
        return None
    lo, hi = iv[0][0].astype(np.int64), iv[1][0].astype(np.int64)
    all_rows = np.arange(q_len, dtype=np.int64)
    keep_keys = _keeps(mask, q_len, kv_len, all_rows, keys)
    keep_keys &= ~((lo[:, None] <= keys[None, :]) & (keys[None, :] < hi[:, None]))
    j = np.arange(kv_len, dtype=np.int64)
    keep_rows = _keeps(mask, q_len, kv_len, rows, j)
    keep_rows &= ~((lo[rows, None] <= j[None, :]) & (j[None, :] < hi[rows, None]))
    keep_rows[:, keys] = False
    return band, keys, rows, keep_keys, keep_rows


def set_split(layout, compile_fn) -> SetSplit | None:
    """The :class:`SetSplit` of a compiled layout (its mask, lengths, query offset and block size),
    built once and cached on the layout; None where the mask does not split (and for shards of a
    larger layout). ``compile_fn``: :func:`~blocksparse_fa.compiler.compile.compile_mask`."""
    dev, blk = layout.device, layout.block_size

    def part(keep: np.ndarray, q_len: int, kv_len: int):
        if not keep.size or not keep.any():
            return None
        return compile_fn(DenseMask(torch.from_numpy(keep)), q_len, kv_len, blk, device=dev, rewrite=False,
                          align="top_left")

    def make(hit):
        band, keys, rows, keep_keys, keep_rows = hit
        return SetSplit(compile_fn(band, layout.q_len, layout.kv_len, blk, device=dev, rewrite=False), keys, rows,
                        part(keep_keys, layout.q_len, len(keys)), part(keep_rows, len(rows), layout.kv_len))

    return split_per_layout(layout, "set_split", split_parts, make)
