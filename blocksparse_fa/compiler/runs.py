"""Masks whose rows keep two runs of keys, as two disjoint one-run parts.

``key_range(a, b) | causal()`` keeps, on the rows before ``a``, the causal run ``[0, q]`` and the
run ``[a, b)``; ``causal & (key_range(0, p) | document(ids))`` (a shared prefix) keeps the prefix
and the row's document; block diffusion keeps a noisy block and the clean blocks before it. As one
layout they run the block kernels with the element predicate on every partial tile. Written as a
union of terms ``T_1 | ... | T_k`` (``&`` distributed over ``|``), many of them split into two
groups whose unions ``A`` and ``B`` keep one run per row each; the parts ``A`` and ``B & ~A`` are
then disjoint, cover the mask exactly, and each runs the interval kernels (Gluon on Hopper). Their
outputs merge through the logsumexps, and their backwards, run with the merged output and
logsumexp, add up to the mask's gradients (the argument of ``ops/residue.py``); the part whose
rows and keys span less is the one merged and added second.

:func:`split_runs` finds the split on the expression (``O(L·k)`` per candidate, never
``Lq × Lk``): of the groupings whose parts' bounds grow with the row, the one whose larger part
keeps the most pairs, so that most of the work runs on the best kernel of its class
(``key_range | causal``: ``causal()`` and a small interval part). Growing bounds make every key's
rows one run as well, and the dK/dV kernels visit each key tile's rows from the first to the last
that keeps one of its keys: block diffusion's noisy-to-clean and clean-to-clean blocks together
give each clean key two runs of rows, 1.5x the rows that keep it at 16K (so they are two parts, the
noisy blocks' diagonal with the clean ones); Longformer's global tokens as one part would visit
every row for every key (it splits by ``compiler/globals.py`` instead). ``ops/runs.py`` runs the
parts; ``ops/select.choose_run_split`` says when.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..mask.expr import And, Mask, Or
from .intervals import _sets, _supported, mask_row_interval, split_per_layout

__all__ = ["RunSplit", "split_runs", "run_split", "MAX_TERMS"]

MAX_TERMS = 4
"""Most terms of the union tried (``2^(k-1) - 1`` groupings of ``k`` terms, each evaluated in
``O(L·k)``: about 1 s for four terms at 128K tokens on one CPU core, once per layout)."""


@dataclass
class RunSplit:
    """The two parts of a mask that keeps at most two runs of keys per row.

    Attributes:
        first: the compiled layout of the part whose output and gradients are written first.
        second: the compiled layout of the other part, merged into the first's output and added
            to its gradients: of the two, the one whose kept rows and keys span less.
        rows: ``(r0, r1)``: the second part's rows that keep a key lie in ``[r0, r1)``.
        keys: ``(c0, c1)``: the keys the second part keeps lie in ``[c0, c1)``.
        mean_keys: keys kept per query row, on average over the rows and instances.
        box: ``(r0, r1, c0, c1)``: ``rows`` and ``keys`` widened to multiples of ``BOX_ALIGN``
            (within the lengths).
        box_bounds: ``(lo, hi)``, int32 ``(Zb, Zh, r1 - r0)``: the second part's intervals on the
            box's rows, in the box's key coordinates (empty rows ``0, 0``).
    """

    first: object
    second: object
    rows: tuple
    keys: tuple
    mean_keys: float
    box: tuple = None
    box_bounds: tuple = None


BOX_ALIGN = 256
"""The second part's box starts and ends on multiples of this many rows and keys (the Gluon
kernels' tiles), or at the lengths' ends."""


def _terms(m: Mask, cap: int) -> list:
    """``m`` as a list of terms whose union it is (``&`` distributed over ``|``), at most ``cap``
    of them (``[m]`` when distributing would give more)."""
    if isinstance(m, Or):
        out = []
        for c in m.children:
            out += _terms(c, cap)
        return out if len(out) <= cap else [m]
    if isinstance(m, And):
        acc = [None]
        for c in m.children:
            tc = _terms(c, cap)
            acc = [t if a is None else a & t for a in acc for t in tc]
            if len(acc) > cap:
                return [m]
        return acc
    return [m]


def _union(ts: list) -> Mask:
    out = ts[0]
    for t in ts[1:]:
        out = out | t
    return out


def _pairs(iv) -> int:
    return int(np.clip(iv[1].astype(np.int64) - iv[0], 0, None).sum())


def split_runs(mask: Mask, q_len: int, kv_len: int, q_offset: int):
    """``((P, (lo, hi)), (Q, (lo, hi)))``, the larger part first (``A`` and ``B & ~A`` in some
    order), when ``mask`` is not one run per row but splits into two one-run parts as the module
    docstring says, else None. ``lo``/``hi``: each part's int32 ``(Z, q_len)`` intervals, as
    :func:`~blocksparse_fa.compiler.intervals.mask_row_interval` gives them."""
    if not _supported(mask) or _max_runs(mask, q_len, kv_len, q_offset) != 2:
        return None  # one run per row already, more than two somewhere, or a leaf of no runs
    terms = _terms(mask, MAX_TERMS)
    k = len(terms)
    if not 2 <= k <= MAX_TERMS:
        return None
    best = None
    for sel in range(1, 2 ** (k - 1)):  # term k-1 always in the second group: each grouping once
        first = _union([t for i, t in enumerate(terms) if sel >> i & 1])
        rest = _union([t for i, t in enumerate(terms) if not sel >> i & 1])
        for a, b in ((first, rest), (rest, first)):
            ia = mask_row_interval(a, q_len, kv_len, q_offset)
            if ia is None:
                continue
            second = b & ~a
            ib = mask_row_interval(second, q_len, kv_len, q_offset)
            if ib is None:
                continue
            na, nb = _pairs(ia), _pairs(ib)
            if nb == 0 or not (_monotone(ia) and _monotone(ib)):
                continue
            if best is None or max(na, nb) > best[0]:  # the grouping whose larger part keeps the most
                best = (max(na, nb), (a, ia), (second, ib)) if na >= nb else (nb, (second, ib), (a, ia))
    return None if best is None else best[1:]


def _monotone(iv) -> bool:
    """Whether both bounds never decrease from one kept row to the next, in every instance: then
    every key's rows are one run too, and the dK/dV kernels, which visit each key tile's rows from
    the first to the last that keeps one of its keys, visit no row that keeps none."""
    for lo, hi in zip(*iv):
        kept = lo < hi
        if (np.diff(lo[kept]) < 0).any() or (np.diff(hi[kept]) < 0).any():
            return False
    return True


def _max_runs(mask: Mask, q_len: int, kv_len: int, q_offset: int) -> int | None:
    """The most runs of keys any row keeps, over the mask's instances (None where a leaf is not
    runs of keys): one evaluation of the whole mask, ``O(L·k)``, before any grouping is tried."""
    qp = np.arange(q_len, dtype=np.int64) + q_offset
    bs = mask.batch_shape or (1, 1)
    most = 0
    for b in range(bs[0]):
        for h in range(bs[1]):
            sets = _sets(mask, qp, kv_len, b, h)
            if sets is None:
                return None
            most = max(most, int((sets[0] <= sets[1]).sum(1).max(initial=0)))
    return most


def _box(iv):
    """``((r0, r1), (c0, c1), cost)``: the rows that keep a key and the keys kept, of one part, and
    the gradient rows its addition reads (dQ over its rows, dK and dV over its keys)."""
    lo, hi = iv
    kept = lo < hi
    rows = np.nonzero(kept.any(0))[0]
    r, c = (int(rows[0]), int(rows[-1]) + 1), (int(lo[kept].min()), int(hi[kept].max()))
    return r, c, (r[1] - r[0]) + 2 * (c[1] - c[0])


def _aligned_box(iv, rows, keys, q_len: int, kv_len: int, batch_shape):
    """``((r0, r1, c0, c1), (lo, hi))``: the box of :class:`RunSplit` and the part's bounds in it."""
    a = BOX_ALIGN
    r0, r1 = rows[0] // a * a, min(q_len, -(-rows[1] // a) * a)
    c0, c1 = keys[0] // a * a, min(kv_len, -(-keys[1] // a) * a)
    lo, hi = (x[:, r0:r1].astype(np.int64) - c0 for x in iv)
    kept = lo < hi
    lo, hi = np.where(kept, lo, 0), np.where(kept, hi, 0)
    bm, hm = batch_shape or (1, 1)
    return (r0, r1, c0, c1), tuple(x.astype(np.int32).reshape(bm, hm, r1 - r0) for x in (lo, hi))


def run_split(layout, compile_fn) -> RunSplit | None:
    """The :class:`RunSplit` of a compiled layout (its mask, lengths, query offset and block size),
    built once and cached on the layout; None where the mask does not split (and for shards of a
    larger layout). ``compile_fn``: :func:`~blocksparse_fa.compiler.compile.compile_mask`."""

    def make(hit):
        (a, ia), (b, ib) = hit
        if _box(ib)[2] > _box(ia)[2]:  # the part added second spans less
            (a, ia), (b, ib) = (b, ib), (a, ia)
        rows, keys, _ = _box(ib)
        mean = (_pairs(ia) + _pairs(ib)) / ia[0].size
        box, bounds = _aligned_box(ib, rows, keys, layout.q_len, layout.kv_len, b.batch_shape)
        dev, blk, al = layout.device, layout.block_size, layout.align
        return RunSplit(compile_fn(a, layout.q_len, layout.kv_len, blk, device=dev, rewrite=False, align=al),
                        compile_fn(b, layout.q_len, layout.kv_len, blk, device=dev, rewrite=False, align=al),
                        rows, keys, mean, box, bounds)

    return split_per_layout(layout, "run_split", split_runs, make)
