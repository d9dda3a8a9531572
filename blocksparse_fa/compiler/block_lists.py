"""Block lists with row intervals: block layouts in the Gluon kernels' list mode.

The Gluon kernels (``kernels/forward_gluon.py``, ``kernels/backward_gluon.py``) run a block at a
time with no element predicate: a full block unmasked, any other block masked by comparing each key
with its row's interval(s). On a one-interval layout the blocks of a tile are one contiguous range;
here they are any list (sliding tiles, block masks, Longformer's band with its global keys,
``key_range | causal``, BigBird's window beside its random and global blocks, ...), and the rows'
intervals only have to be exact where a kernel masks:

* a kernel masks the partial blocks of a row tile, never its full ones, and visits no empty one
  (but see below). So the intervals of a row are the runs of keys it keeps *inside its tile's
  partial blocks*; two runs that only full blocks separate merge into one (the full blocks between
  are visited unmasked, whatever the interval says there).
* the forward's first step is always a masked one: a row tile with full blocks only gets its first
  full block as every row's interval.
* a tile with nothing to visit still runs one masked step (the kernels' pipelines need one): a row
  tile visits key block 0 with empty intervals; a key tile that no row keeps visits query block 0,
  whose rows' intervals cover only blocks their tile keeps, never that key tile.

A layout qualifies when those intervals number at most two per row (int32 ``LO``/``HI`` for one,
int64 with the second interval in the high 32 bits for two), its blocks match the kernels' tiles
and every head of the layout keeps the same blocks. Built on the host once per layout (the partial
blocks are evaluated element by element: ``O(partial blocks · bm · bn)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["BlockLists", "block_lists"]

MAX_INTERVALS = 2
HALVES = 2  # the backward kernels' consumers: each takes half of a key tile (dK/dV) or of a row tile (dQ)
SKIP_BIT = 24  # dK/dV and dQ entries: bit SKIP_BIT + h set where consumer h has nothing to compute
BLOCK_MASK = (1 << SKIP_BIT) - 1
_SAMPLE_BLOCKS, _SAMPLE_LINES = 256, 8  # more partial blocks: 8 lines are checked first
_EMPTY, _PARTIAL, _FULL = 0, 1, 2


@dataclass(frozen=True)
class BlockLists:
    """Tables of the list mode (numpy; ``Z`` layout instances, batch rows only).

    Attributes:
        lo, hi: ``(Z, Lq)`` the rows' intervals, int32 (one) or int64 (two, packed ``a | b << 32``).
        fwd: int32 ``(Z·P·5 + entries,)``: per row tile ``(tile, first, e1, e2, n)`` heaviest first,
            ``first`` a position in this array where the tile's ``n`` key blocks are listed, steps
            ``[e1, e2)`` full (the forward's table).
        dq: int32 ``(Z·P·4 + entries,)``: per row tile in tile order ``(first, f0, f1, end)``, positions
            in this array: ``[first, f0)`` masked, ``[f0, f1)`` full (the dQ kernel's table); a masked
            entry carries bit ``SKIP_BIT + h`` where half ``h`` of the tile's rows keeps nothing of it.
        dkdv: int32 ``(Z·Pk·4 + entries,)``: per key tile ``(first, f0, f1, end)``, positions of its
            query blocks of ``q_step`` rows (the dK/dV kernel's table); a partial block's parts
            are listed by their own state (a full part unmasked, an empty one not at all), and a
            masked entry carries bit ``SKIP_BIT + h`` where half ``h`` of the key tile keeps
            nothing of it (the block is ``entry & BLOCK_MASK``).
        dkdv_order: int32 ``(Z, Pk)``: the key tiles heaviest first.
        n_intervals: 1 or 2.
        mean_keys: keys per row visited on average (listed blocks times the column block).
    """

    lo: np.ndarray
    hi: np.ndarray
    fwd: np.ndarray
    dq: np.ndarray
    dkdv: np.ndarray
    dkdv_order: np.ndarray
    n_intervals: int
    mean_keys: float


def _lists(states: np.ndarray, axis_rows: bool):
    """Per line (``(Z, lines)``) its masked-first block list: ``(counts (Z, L), n_masked (Z, L),
    flat blocks)`` with lines in order; lines of rows (``axis_rows``) or of columns."""
    st = states if axis_rows else states.transpose(0, 2, 1)
    z, n_lines, n_cols = st.shape
    part = st == _PARTIAL
    full = st == _FULL
    # masked first, then full, each ascending: sort keys per line
    key = np.where(part, 0, np.where(full, 1, 2)) * n_cols + np.arange(n_cols)
    order = np.argsort(key, axis=2, kind="stable")
    n_part = part.sum(2)
    counts = n_part + full.sum(2)
    keep = np.arange(n_cols)[None, None, :] < counts[:, :, None]
    return counts, n_part, order[keep]


def block_lists(layout, fwd_rows: int, fwd_step: int, q_step: int, key_tile: int) -> BlockLists | None:
    """The list-mode tables of ``layout`` for the kernels' tiles, or None where it does not qualify.

    Args:
        layout: a :class:`~blocksparse_fa.BlockLayout`.
        fwd_rows: rows per forward / dQ program (must equal the layout's row block).
        fwd_step: keys per forward / dQ step (must equal the layout's column block).
        q_step: query rows per dK/dV step (must divide the row block).
        key_tile: keys per dK/dV program (must equal the column block).
    """
    bm, bn = layout.block_size
    if (fwd_rows, fwd_step, key_tile) != (bm, bm, bn) or bm != bn or bm % q_step:
        return None
    if layout.q_len % bm or layout.kv_len % bn or getattr(layout, "positions", None) is not None:
        return None
    bshape = tuple(layout.batch_shape or ())
    if bshape and bshape[1] != 1:  # heads that differ: the dK/dV program walks a group with one table
        return None
    states = layout.block_states().cpu().numpy().astype(np.int8)
    tr, tc = states.shape[-2:]
    states = states.reshape(-1, tr, tc)
    z = states.shape[0]
    lq = layout.q_len

    # ---- the rows' intervals: runs of kept keys inside each row tile's partial blocks
    zz, rr, cc = np.nonzero(states == _PARTIAL)  # sorted by (z, r, c)
    lo = np.zeros((z, lq, MAX_INTERVALS), np.int64)
    hi = np.zeros((z, lq, MAX_INTERVALS), np.int64)
    n_iv = 1
    if len(zz) > _SAMPLE_BLOCKS:  # a few whole lines first: most masks that fail, fail on every line
        line = zz * tr + rr
        pick = np.isin(line, np.unique(line)[np.linspace(0, len(np.unique(line)) - 1, _SAMPLE_LINES).astype(int)])
        if _row_runs(layout, states, zz[pick], rr[pick], cc[pick]) is None:
            return None
    row_kept = np.zeros((0, bm, HALVES), np.int64)
    if len(zz):
        runs = _row_runs(layout, states, zz, rr, cc)
        if runs is None:
            return None
        srow, skey, ekey, n_runs, row_kept = runs
        n_iv = max(1, int(n_runs.max(initial=0)))
        rank = np.arange(len(srow)) - np.repeat(np.cumsum(n_runs) - n_runs, n_runs)
        lo.reshape(z * lq, MAX_INTERVALS)[srow, rank] = skey
        hi.reshape(z * lq, MAX_INTERVALS)[srow, rank] = ekey
    # row tiles of full blocks only: their first full block (the forward's first step is masked)
    has_part = (states == _PARTIAL).any(2)
    full_any = (states == _FULL).any(2)
    first_full = np.argmax(states == _FULL, axis=2)
    only_full = ~has_part & full_any
    tz, trr = np.nonzero(only_full)
    for a, r in zip(tz, trr):  # one slice per such tile
        lo[a, r * bm:(r + 1) * bm, 0] = first_full[a, r] * bn
        hi[a, r * bm:(r + 1) * bm, 0] = first_full[a, r] * bn + bn
    if n_iv == 1:
        lo_t, hi_t = lo[..., 0].astype(np.int32), hi[..., 0].astype(np.int32)
    else:
        lo_t = lo[..., 0] | (lo[..., 1] << 32)
        hi_t = hi[..., 0] | (hi[..., 1] << 32)

    # ---- forward and dQ: per row tile its key blocks, masked first
    counts, n_part, flat = _lists(states, True)
    n = np.where(counts == 0, 1, counts)
    n_mask = np.where(counts == 0, 1, n_part)
    base = z * tr * 5
    start = base + np.concatenate([[0], np.cumsum(n.ravel())[:-1]]).reshape(z, tr)
    blocks = _fill(counts, flat, n)
    fwd_tab = np.empty((z, tr, 5), np.int64)
    for a in range(z):
        e1 = np.maximum(n_mask[a], 1)
        rows = np.stack([np.arange(tr), start[a], e1, n[a], n[a]], 1)
        order = np.lexsort((-n_mask[a], -n[a]))  # most blocks first, then most masked blocks
        fwd_tab[a] = rows[order]
    fwd = np.concatenate([fwd_tab.ravel(), blocks]).astype(np.int32)
    qbase = z * tr * 4
    qstart = start - base + qbase
    dq_tab = np.stack([qstart, qstart + n_mask, qstart + n, qstart + n], 2)
    # the dQ kernel's consumers take the row tile's halves: a masked entry's bit SKIP_BIT + h says
    # that half h of the rows keeps nothing of the block
    row_skip = np.zeros((z, tr, tc), np.int64)
    if len(zz):
        rows_half = row_kept.sum(2).reshape(len(zz), HALVES, bm // HALVES).sum(2)
        row_skip[zz, rr, cc] = ((rows_half == 0) << np.arange(HALVES)).sum(1)
    rline = np.repeat(np.arange(z * tr), counts.ravel())
    dq_blocks = _fill(counts, flat | (row_skip[rline // tr, rline % tr, flat] << SKIP_BIT), n)
    dq = np.concatenate([dq_tab.ravel(), dq_blocks]).astype(np.int32)

    # ---- dK/dV: per key tile its query blocks of q_step rows, masked first. A partial block's
    # q_step-row parts are classified again: a part whose rows keep every key of the block runs
    # unmasked, a part that keeps none is not visited.
    # A masked part also says which halves of the key tile (the kernel's two consumers) keep
    # nothing there: bit ``SKIP_BIT + h`` of its entry; such a consumer only passes the step on.
    per = bm // q_step
    sub = np.repeat(states, per, axis=1)
    skip = np.zeros_like(sub)
    if len(zz):
        half_kept = row_kept.reshape(len(zz), per, q_step, HALVES).sum(2)  # (parts, per, HALVES)
        part_kept = half_kept.sum(2)
        part_state = np.where(part_kept == q_step * bn, _FULL, np.where(part_kept == 0, _EMPTY, _PARTIAL))
        part_rows = rr[:, None] * per + np.arange(per)[None, :]
        sub[zz[:, None], part_rows, cc[:, None]] = part_state
        bits = ((half_kept == 0) << np.arange(HALVES)).sum(2) * (part_state == _PARTIAL)
        skip[zz[:, None], part_rows, cc[:, None]] = bits
    ccounts, cpart, cflat = _lists(sub, False)
    line = np.repeat(np.arange(z * tc), ccounts.ravel())
    cflat = cflat | (skip[line // tc, cflat, line % tc].astype(np.int64) << SKIP_BIT)
    cempty = ccounts == 0  # a key tile no row keeps walks one masked step of query block 0
    cn = np.where(cempty, 1, ccounts)
    cmask = np.where(cempty, 1, cpart)
    cblocks = _fill(ccounts, cflat, cn)
    kbase = z * tc * 4
    cstart = kbase + np.concatenate([[0], np.cumsum(cn.ravel())[:-1]]).reshape(z, tc)
    kv_tab = np.stack([cstart, cstart + cmask, cstart + cn, cstart + cn], 2)
    dkdv = np.concatenate([kv_tab.ravel(), cblocks]).astype(np.int32)
    order = np.argsort(-cn, axis=1, kind="stable").astype(np.int32)
    return BlockLists(np.ascontiguousarray(lo_t), np.ascontiguousarray(hi_t), fwd, dq, dkdv,
                      np.ascontiguousarray(order), n_iv, float(counts.mean()) * bn)


def _row_runs(layout, states: np.ndarray, zz: np.ndarray, rr: np.ndarray, cc: np.ndarray):
    """Runs of kept keys per row inside the partial blocks ``(zz, rr, cc)`` (whole lines, sorted by
    line then column), two runs that only full blocks separate merged: ``(rows, starts, ends,
    runs per row, kept keys per block, row and half block)`` with rows ``z·Lq + q`` (sorted; starts
    and ends in key order within a row) and the last ``(len(zz), bm, HALVES)``, or None where a row
    has more than ``MAX_INTERVALS``."""
    z, tr, _ = states.shape
    bm, bn = layout.block_size
    lq = layout.q_len
    step = max(1, (1 << 21) // (bm * bn))  # blocks evaluated at a time
    kept = np.concatenate([layout._block_values(zz[i:i + step] * tr + rr[i:i + step], cc[i:i + step])[0].cpu().numpy()
                           for i in range(0, len(zz), step)])
    full_cum = np.concatenate([np.zeros((z, tr, 1), np.int64), np.cumsum(states == _FULL, 2)], 2)
    same = (zz[1:] == zz[:-1]) & (rr[1:] == rr[:-1])
    # consecutive partial blocks of a line with only full blocks between them
    bridge = same & (full_cum[zz[1:], rr[1:], cc[1:]] - full_cum[zz[:-1], rr[:-1], cc[:-1] + 1]
                     == cc[1:] - cc[:-1] - 1)
    k = len(zz)
    carry_in = np.zeros((k, bm), bool)
    carry_out = np.zeros((k, bm), bool)
    carry_in[1:] = bridge[:, None] & kept[:-1, :, -1]
    carry_out[:-1] = bridge[:, None] & kept[1:, :, 0]
    left = np.concatenate([carry_in[:, :, None], kept[:, :, :-1]], 2)
    right = np.concatenate([kept[:, :, 1:], carry_out[:, :, None]], 2)
    sk, si, sj = np.nonzero(kept & ~left)
    ek, ei, ej = np.nonzero(kept & ~right)
    srow = zz[sk] * lq + rr[sk] * bm + si
    erow = zz[ek] * lq + rr[ek] * bm + ei
    so = np.argsort(srow, kind="stable")  # within a row: ascending keys (blocks, then offsets)
    eo = np.argsort(erow, kind="stable")
    n_runs = np.bincount(srow, minlength=z * lq)
    if n_runs.max(initial=0) > MAX_INTERVALS:
        return None
    halves = kept.reshape(k, bm, HALVES, bn // HALVES).sum(3)
    return srow[so], (cc[sk] * bn + sj)[so], (cc[ek] * bn + ej + 1)[eo], n_runs, halves


def _fill(counts: np.ndarray, flat: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The lines' lists one after another, a line with no block listing block 0 (``n`` entries each)."""
    out = np.zeros(int(n.sum()), np.int64)
    pos = np.concatenate([[0], np.cumsum(n.ravel())[:-1]])
    has = counts.ravel() > 0
    # positions of the listed blocks: each non-empty line's entries from its start
    idx = np.repeat(pos[has], counts.ravel()[has]) + (
        np.arange(len(flat)) - np.repeat(np.cumsum(counts.ravel()[has]) - counts.ravel()[has], counts.ravel()[has]))
    out[idx] = flat
    return out
