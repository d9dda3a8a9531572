"""Analytic block classification: every (row block, column block) pair -> empty / partial / full.

Each primitive is classified exactly from the blocks' index ranges (interval reasoning), never
from a materialised ``N × N`` mask. ``&``/``|``/``~`` combine the states through tables; a partial
block produced from two partial operands is marked ``UNSURE`` and, within a budget, refined by
evaluating the mask on that block alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..mask.expr import And, EvalContext, Mask, Not, Or
from ..mask import primitives as P
from .segments import AND_TABLE, EMPTY, FULL, NOT_TABLE, OR_TABLE, PARTIAL, UNSURE, Segments


@dataclass(frozen=True)
class Grid:
    """The block grid of a compile request.

    Rows cover query rows ``[r*bm, min((r+1)*bm, q_len))`` at absolute positions
    ``qlo..qhi = row + off``; columns cover keys ``[c*bn, min((c+1)*bn, kv_len))``.
    """

    q_len: int
    kv_len: int
    bm: int
    bn: int

    @property
    def off(self) -> int:
        return self.kv_len - self.q_len

    @property
    def tr(self) -> int:
        return -(-self.q_len // self.bm)

    @property
    def tc(self) -> int:
        return -(-self.kv_len // self.bn)

    @property
    def ilo(self) -> np.ndarray:
        return np.arange(self.tr, dtype=np.int64) * self.bm

    @property
    def ihi(self) -> np.ndarray:
        return np.minimum(self.ilo + self.bm, self.q_len) - 1

    @property
    def qlo(self) -> np.ndarray:
        return self.ilo + self.off

    @property
    def qhi(self) -> np.ndarray:
        return self.ihi + self.off

    @property
    def clo(self) -> np.ndarray:
        return np.arange(self.tc, dtype=np.int64) * self.bn

    @property
    def chi(self) -> np.ndarray:
        return np.minimum(self.clo + self.bn, self.kv_len) - 1


# --------------------------------------------------------------------------------------------
# expressions
# --------------------------------------------------------------------------------------------
class _IntervalAnd(P.IntervalPrimitive):
    """Classification-only node: the AND of interval primitives is one interval primitive
    (``lo = max lo_k``, ``hi = min hi_k``), which keeps e.g. ``causal & sliding_window(w)`` exact."""

    __slots__ = ("_parts",)
    name = "_interval_and"

    def __init__(self, parts):
        super().__init__()
        self._parts = tuple(parts)

    def _bounds(self, qp):
        lo, hi = self._parts[0]._bounds(qp)
        for p in self._parts[1:]:
            l2, h2 = p._bounds(qp)
            lo, hi = np.maximum(lo, l2), np.minimum(hi, h2)
        return lo, hi


def classify(mask: Mask, grid: Grid) -> Segments:
    """Block states of ``mask`` on ``grid`` (may contain ``UNSURE`` blocks; see :func:`refine`)."""
    if isinstance(mask, And):
        intervals = [c for c in mask.children if isinstance(c, P.IntervalPrimitive)]
        others = [c for c in mask.children if not isinstance(c, P.IntervalPrimitive)]
        parts = ([_IntervalAnd(intervals)] if len(intervals) > 1 else intervals) + others
        out = classify(parts[0], grid)
        for c in parts[1:]:
            out = out.combine(classify(c, grid), AND_TABLE)
        return out
    if isinstance(mask, Or):
        out = classify(mask.children[0], grid)
        for c in mask.children[1:]:
            out = out.combine(classify(c, grid), OR_TABLE)
        return out
    if isinstance(mask, Not):
        return classify(mask.children[0], grid).map_states(NOT_TABLE)
    fn = _CLASSIFIERS.get(type(mask)) or (_interval if isinstance(mask, P.IntervalPrimitive) else None)
    if fn is None:
        raise TypeError(f"no block classifier for {type(mask).__name__}")
    return fn(mask, grid)


# --------------------------------------------------------------------------------------------
# primitives
# --------------------------------------------------------------------------------------------
def _interval(m: P.IntervalPrimitive, g: Grid) -> Segments:
    """``lo(qp) <= j <= hi(qp)`` with monotone bounds: full iff ``lo(qhi) <= clo`` and
    ``chi <= hi(qlo)``; non-empty iff ``lo(qlo) <= chi`` and ``clo <= hi(qhi)``, which is exact
    when the rows' intervals form one contiguous run (checked; row blocks where it fails are
    marked UNSURE)."""
    tc = g.tc
    lo_a, hi_a = m._bounds(g.qlo)
    lo_b, hi_b = m._bounds(g.qhi)
    n_lo = np.searchsorted(g.chi, lo_a, side="left")
    n_hi = np.searchsorted(g.clo, hi_b, side="right")
    f_lo = np.searchsorted(g.clo, lo_b, side="left")
    f_hi = np.searchsorted(g.chi, hi_a, side="right")
    nonempty = n_lo < n_hi
    n_lo = np.where(nonempty, n_lo, tc)
    n_hi = np.where(nonempty, n_hi, tc)
    f_lo = np.clip(f_lo, n_lo, n_hi)
    f_hi = np.clip(f_hi, f_lo, n_hi)
    nofull = f_lo >= f_hi
    f_lo = np.where(nofull, n_hi, f_lo)
    f_hi = np.where(nofull, n_hi, f_hi)
    zeros = np.zeros(g.tr, np.int64)
    bounds = np.stack([zeros, n_lo, f_lo, f_hi, n_hi, zeros + tc], axis=1)
    # contiguity of the union of row intervals inside each row block
    qp = np.arange(g.q_len, dtype=np.int64) + g.off
    lo, hi = m._bounds(qp)
    bad = lo > hi
    bad[:-1] |= lo[1:] > hi[:-1] + 1
    bad_block = np.zeros(g.tr, dtype=bool)
    if bad.any():
        np.logical_or.at(bad_block, np.nonzero(bad)[0] // g.bm, True)
    part = np.where(bad_block, UNSURE, PARTIAL).astype(np.int8)
    states = np.stack([np.full(g.tr, EMPTY, np.int8), part, np.full(g.tr, FULL, np.int8), part,
                       np.full(g.tr, EMPTY, np.int8)], axis=1)
    return Segments.from_boundaries(g.tr, tc, bounds, states)


def _global_tokens(m: P.GlobalTokens, g: Grid) -> Segments:
    gt = m.g
    tc = g.tc
    k1 = np.searchsorted(g.chi, gt - 1, side="right")  # columns entirely global
    k2 = np.searchsorted(g.clo, gt - 1, side="right")  # columns touching a global key
    all_global = g.qhi < gt
    mixed = (g.qlo < gt) & ~all_global
    b1 = np.where(all_global, tc, k1)
    b2 = np.where(all_global | mixed, tc, k2)
    zeros = np.zeros(g.tr, np.int64)
    bounds = np.stack([zeros, zeros + b1, np.maximum(b2, b1), zeros + tc], axis=1)
    return Segments.from_boundaries(g.tr, tc, bounds, [FULL, PARTIAL, EMPTY])


def _row_chunks(g: Grid, budget: int = 1 << 22):
    step = max(1, budget // max(1, g.tc))
    for r0 in range(0, g.tr, step):
        yield r0, min(g.tr, r0 + step)


def _strided(m: P.Strided, g: Grid) -> Segments:
    s = m.s
    parts = []
    for r0, r1 in _row_chunks(g):
        dmin = g.qlo[r0:r1, None] - g.chi[None, :]
        dmax = g.qhi[r0:r1, None] - g.clo[None, :]
        nonempty = (dmax // s) * s >= dmin
        full = (s == 1) | ((dmin == dmax) & (dmin % s == 0))
        parts.append(np.where(full, FULL, np.where(nonempty, PARTIAL, EMPTY)).astype(np.int8))
    return Segments.from_dense(np.concatenate(parts, axis=0))


def _summary(m: P.Summary, g: Grid) -> Segments:
    stride, c = m.stride, m.c

    def count(x):  # kept keys in [0, x)
        return (x // stride) * c + np.maximum(0, x % stride - (stride - c))

    kept = count(g.chi + 1) - count(g.clo)
    col_state = np.where(kept == g.chi - g.clo + 1, FULL, np.where(kept > 0, PARTIAL, EMPTY)).astype(np.int8)
    return Segments.from_dense(np.broadcast_to(col_state, (g.tr, g.tc)))


def _document(m: P.Document, g: Grid) -> Segments:
    ids = m.ids.detach().to("cpu").long().numpy()  # (Bd, L)
    bd = ids.shape[0]
    parts = [_document_one(ids[z], g) for z in range(bd)]
    out = Segments(
        (bd, 1), g.tr, g.tc,
        np.concatenate([p.key + z * g.tr * (g.tc + 1) for z, p in enumerate(parts)]),
        np.concatenate([p.state for p in parts]),
    )
    return out


def _document_one(ids: np.ndarray, g: Grid) -> Segments:
    tc = g.tc
    valid_lo = np.maximum(g.qlo, 0)
    rows_valid = g.qhi >= 0
    if np.all(ids[1:] >= ids[:-1]):  # sorted ids: documents are contiguous runs -> intervals in id space
        idmin = ids[np.minimum(valid_lo, len(ids) - 1)]
        idmax = ids[np.clip(g.qhi, 0, len(ids) - 1)]
        cmin, cmax = ids[g.clo], ids[g.chi]
        n_lo = np.searchsorted(cmax, idmin, side="left")
        n_hi = np.searchsorted(cmin, idmax, side="right")
        ok = rows_valid & (n_lo < n_hi)
        n_lo = np.where(ok, n_lo, tc)
        n_hi = np.where(ok, n_hi, tc)
        single = (idmin == idmax) & (g.qlo >= 0) & ok
        f_lo = np.clip(np.searchsorted(cmin, idmin, side="left"), n_lo, n_hi)
        f_hi = np.clip(np.searchsorted(cmax, idmax, side="right"), f_lo, n_hi)
        f_lo = np.where(single & (f_lo < f_hi), f_lo, n_hi)
        f_hi = np.where(single & (f_lo < f_hi), f_hi, n_hi)
        zeros = np.zeros(g.tr, np.int64)
        bounds = np.stack([zeros, n_lo, f_lo, f_hi, n_hi, zeros + tc], axis=1)
        return Segments.from_boundaries(g.tr, tc, bounds, [EMPTY, PARTIAL, FULL, PARTIAL, EMPTY])
    # general ids: block-by-id incidence, intersected with a matrix product
    uniq, lab = np.unique(ids, return_inverse=True)
    k = len(uniq)
    rowsets = np.zeros((g.tr, k), dtype=np.float32)
    for r in range(g.tr):  # per row block: the ids its valid rows hold
        lo, hi = valid_lo[r], g.qhi[r]
        if hi >= lo:
            rowsets[r, lab[lo:hi + 1]] = 1
    colsets = np.zeros((tc, k), dtype=np.float32)
    col_of = np.arange(len(ids)) // g.bn
    colsets[col_of, lab] = 1
    inter = torch.from_numpy(rowsets) @ torch.from_numpy(colsets).T
    nonempty = (inter > 0).numpy()
    single_r = (rowsets.sum(1) == 1) & (g.qlo >= 0)
    single_c = colsets.sum(1) == 1
    full = nonempty & single_r[:, None] & single_c[None, :]
    return Segments.from_dense(np.where(full, FULL, np.where(nonempty, PARTIAL, EMPTY)).astype(np.int8))


def _cells(g: Grid, i0, i1, j0, j1, batch_shape=(1, 1), z=None) -> Segments:
    """Classify from disjoint kept rectangles ``[i0, i1) × [j0, j1)`` (row-index space) by
    comparing each block's covered area with its size."""
    z = np.zeros(len(i0), np.int64) if z is None else np.asarray(z, np.int64)
    i0, i1 = np.clip(i0, 0, g.q_len), np.clip(i1, 0, g.q_len)
    j0, j1 = np.clip(j0, 0, g.kv_len), np.clip(j1, 0, g.kv_len)
    ok = (i1 > i0) & (j1 > j0)
    i0, i1, j0, j1, z = i0[ok], i1[ok], j0[ok], j1[ok], z[ok]
    r0, r1 = i0 // g.bm, (i1 - 1) // g.bm + 1
    c0, c1 = j0 // g.bn, (j1 - 1) // g.bn + 1
    nr, nc = r1 - r0, c1 - c0
    cnt = nr * nc
    cell = np.repeat(np.arange(len(i0)), cnt)
    k = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    r = r0[cell] + k // nc[cell]
    c = c0[cell] + k % nc[cell]
    ri0 = np.maximum(i0[cell], r * g.bm)
    ri1 = np.minimum(i1[cell], np.minimum((r + 1) * g.bm, g.q_len))
    cj0 = np.maximum(j0[cell], c * g.bn)
    cj1 = np.minimum(j1[cell], np.minimum((c + 1) * g.bn, g.kv_len))
    area = (ri1 - ri0) * (cj1 - cj0)
    row = z[cell] * g.tr + r
    blk = row * g.tc + c
    ub, inv = np.unique(blk, return_inverse=True)
    covered = np.bincount(inv, weights=area).astype(np.int64)
    urow, ucol = ub // g.tc, ub % g.tc
    rr = urow % g.tr
    size = (np.minimum((rr + 1) * g.bm, g.q_len) - rr * g.bm) * (np.minimum((ucol + 1) * g.bn, g.kv_len) - ucol * g.bn)
    st = np.where(covered >= size, FULL, PARTIAL).astype(np.int8)
    return Segments.from_blocks(g.tr, g.tc, urow, ucol, st, batch_shape)


def _random_blocks(m: P.RandomBlocks, g: Grid) -> Segments:
    bs = m.block_size
    n_kb = -(-g.kv_len // bs)
    qb_lo = max(0, g.off) // bs
    qb = np.arange(qb_lo, n_kb, dtype=np.int64)
    ch = m.chosen(qb, n_kb)  # (nq, r)
    rr = ch.shape[1]
    qb_rep = np.repeat(qb, rr)
    kb = ch.reshape(-1)
    pos0 = np.maximum(qb_rep * bs, 0)  # qp >= 0 only
    return _cells(g, pos0 - g.off, (qb_rep + 1) * bs - g.off, kb * bs, (kb + 1) * bs)


def _block_mask(m: P.BlockMask, g: Grid) -> Segments:
    t = m.tensor.detach().to("cpu").numpy()  # (B, H, Tr', Tc')
    bs = m.block_size
    b, h, qb, kb = np.nonzero(t)
    bsh = (t.shape[0], t.shape[1])
    return _cells(g, qb * bs, (qb + 1) * bs, kb * bs, (kb + 1) * bs, bsh, b * t.shape[1] + h)


def _dense_mask(m: P.DenseMask, g: Grid) -> Segments:
    t = m.tensor.detach().to("cpu")  # (B, H, Lq, Lk) bool
    bsh = (t.shape[0], t.shape[1])
    pad = torch.zeros(t.shape[0], t.shape[1], g.tr * g.bm, g.tc * g.bn, dtype=torch.int8)
    valid = torch.zeros_like(pad)
    pad[..., : g.q_len, : g.kv_len] = t.to(torch.int8)
    valid[..., : g.q_len, : g.kv_len] = 1
    blocks = pad.view(*bsh, g.tr, g.bm, g.tc, g.bn).sum((3, 5))
    size = valid.view(*bsh, g.tr, g.bm, g.tc, g.bn)[:1, :1].sum((3, 5))
    st = torch.where(blocks == size, FULL, torch.where(blocks > 0, PARTIAL, EMPTY)).to(torch.int8)
    return Segments.from_dense(st.numpy().reshape(-1, g.tc), bsh)


_CLASSIFIERS = {
    P.GlobalTokens: _global_tokens,
    P.Strided: _strided,
    P.Summary: _summary,
    P.Document: _document,
    P.RandomBlocks: _random_blocks,
    P.BlockMask: _block_mask,
    P.DenseMask: _dense_mask,
}


# --------------------------------------------------------------------------------------------
# refinement
# --------------------------------------------------------------------------------------------
def block_context(mask: Mask, g: Grid, rows: np.ndarray, cols: np.ndarray, device="cpu"):
    """Evaluation context for a batch of blocks: index tensors ``(K, bm, 1)``/``(K, 1, bn)`` and a
    validity mask for ragged edges."""
    rows_t = torch.as_tensor(rows, dtype=torch.long, device=device)
    cols_t = torch.as_tensor(cols, dtype=torch.long, device=device)
    r = rows_t % g.tr
    zi = rows_t // g.tr
    i = (r * g.bm).view(-1, 1, 1) + torch.arange(g.bm, device=device).view(1, -1, 1)
    j = (cols_t * g.bn).view(-1, 1, 1) + torch.arange(g.bn, device=device).view(1, 1, -1)
    valid = (i < g.q_len) & (j < g.kv_len)
    bs = mask.batch_shape or (1, 1)
    b = (zi // bs[1]).view(-1, 1, 1)
    h = (zi % bs[1]).view(-1, 1, 1)
    ic = i.clamp(max=g.q_len - 1)
    jc = j.clamp(max=g.kv_len - 1)
    return EvalContext(g.q_len, g.kv_len, ic, ic + g.off, jc, b, h), valid


def refine(segs: Segments, mask: Mask, g: Grid, budget: int) -> tuple[Segments, int]:
    """Evaluate ``UNSURE`` blocks exactly while the element budget lasts; the rest become partial.

    Returns the new segments and the number of blocks refined.
    """
    if not (segs.state == UNSURE).any():
        return segs, 0
    rows, cols, st = segs.blocks(nonempty=True)
    unsure = np.nonzero(st == UNSURE)[0]
    per_block = g.bm * g.bn
    n_eval = min(len(unsure), budget // per_block)
    st = st.copy()
    chunk = max(1, (1 << 22) // per_block)
    for k0 in range(0, n_eval, chunk):
        sel = unsure[k0:min(n_eval, k0 + chunk)]
        ctx, valid = block_context(mask, g, rows[sel], cols[sel])
        kept = mask._eval(ctx).expand(valid.shape) & valid
        n_kept = kept.sum((1, 2))
        n_valid = valid.sum((1, 2))
        st[sel] = torch.where(n_kept == 0, EMPTY, torch.where(n_kept == n_valid, FULL, PARTIAL)).numpy()
    st[st == UNSURE] = PARTIAL
    keep = st != EMPTY
    out = Segments.from_blocks(g.tr, g.tc, rows[keep], cols[keep], st[keep], segs.batch_shape)
    return out, int(n_eval)
