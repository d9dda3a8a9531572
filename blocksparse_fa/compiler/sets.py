"""Masks with global positions anywhere as a band, the positions' keys and the positions' rows.

``key_set(S) | query_set(S) | sliding_window(w)`` (global tokens at any positions, e.g. question or
memory tokens) keeps, on most rows, a band and a few scattered keys; on the rows in ``S``, every
key. As one layout every row tile that holds a global row walks all key tiles and every row walks
the global keys' tiles, all through the element predicate (16 positions at 16K: 26 % of the blocks
for 3 % of the pairs). For a union ``key_set(K) | query_set(R) | band`` whose ``band`` keeps one
key interval per row, three exact, disjoint parts cover it:

* the **band** on every row: the interval kernels, Gluon on Hopper;
* the **global keys** ``K`` outside each row's band, gathered into a ``len(K)``-key tensor that
  every row attends (one key tile; a dense bit mask says which key each row keeps);
* the **global rows** ``R`` over the keys outside their band and outside ``K``, gathered into a
  ``len(R)``-row tensor (one row tile; its long rows are split by the block kernels' work lists).

Their outputs merge through their logsumexps (``ops/sets.py``). By default only the forward runs as
parts: the backward of the whole mask reads the merged output and logsumexp, which are exact (the
parts' backward, which adds their gradients, is there with ``set_split=True``).

:func:`set_split` finds the split on the expression (``O(L·|K|)``, never ``Lq × Lk`` but for the
global rows' ``|R| × Lk`` bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..mask import primitives as P
from ..mask.custom import DenseMask
from ..mask.expr import Mask, Or
from .intervals import mask_row_interval, split_per_layout

__all__ = ["SetSplit", "set_split", "split_parts", "MAX_SET"]

MAX_SET = 128
"""Most global keys or global rows split off: each part's gathered side fits one tile."""


@dataclass
class SetSplit:
    """The parts of ``key_set(K) | query_set(R) | band`` (see the module docstring).

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


def _flat_or(mask: Mask) -> list:
    if isinstance(mask, Or):
        return [leaf for c in mask.children for leaf in _flat_or(c)]
    return [mask]


def split_parts(mask: Mask, q_len: int, kv_len: int, q_offset: int):
    """``(band mask, keys, rows, keep_keys (q_len, nk) bool, keep_rows (nr, kv_len) bool)`` when
    ``mask`` is a union of unbatched ``key_set``/``query_set`` terms and a band of one key interval
    per row, else None. ``keep_keys[i, t]``: row ``i`` keeps global key ``keys[t]`` outside its
    band; ``keep_rows[r, j]``: global row ``rows[r]`` keeps key ``j``, outside its band and ``keys``."""
    if mask.batch_shape or q_offset != 0:
        return None
    terms = _flat_or(mask)
    sets = [t for t in terms if isinstance(t, (P.KeySet, P.QuerySet))]
    others = [t for t in terms if not isinstance(t, (P.KeySet, P.QuerySet))]
    if not sets or not others or any(t.tensor.shape[0] != 1 for t in sets):
        return None
    if any(isinstance(leaf, (P.KeySet, P.QuerySet)) for t in others for leaf in t.leaves()):
        return None
    keys = np.unique(np.concatenate([[]] + [t.positions(0) for t in sets if isinstance(t, P.KeySet)]))
    rows = np.unique(np.concatenate([[]] + [t.positions(0) for t in sets if isinstance(t, P.QuerySet)]))
    keys, rows = keys[keys < kv_len].astype(np.int64), rows[rows < q_len].astype(np.int64)
    if not (len(keys) or len(rows)) or len(keys) > MAX_SET or len(rows) > MAX_SET:
        return None
    band = others[0]
    for t in others[1:]:
        band = band | t
    iv = mask_row_interval(band, q_len, kv_len, q_offset=0)
    if iv is None:
        return None
    lo, hi = iv[0][0].astype(np.int64), iv[1][0].astype(np.int64)
    keep_keys = ~((lo[:, None] <= keys[None, :]) & (keys[None, :] < hi[:, None]))
    j = np.arange(kv_len, dtype=np.int64)
    keep_rows = ~((lo[rows, None] <= j[None, :]) & (j[None, :] < hi[rows, None]))
    keep_rows[:, keys] = False
    return band, keys, rows, keep_keys, keep_rows


def set_split(layout, compile_fn) -> SetSplit | None:
    """The :class:`SetSplit` of a compiled layout (its mask, lengths, query offset and block size),
    built once and cached on the layout; None where the mask does not split (and for shards of a
    larger layout). ``compile_fn``: :func:`~blocksparse_fa.compiler.compile.compile_mask`."""
    import torch

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
