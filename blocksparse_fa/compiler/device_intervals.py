"""Key intervals per query row, computed on the device from a step's tensors (no host reads).

:mod:`blocksparse_fa.compiler.intervals` computes the rows' key intervals on the host, from the
mask's numbers; that reads document ids back from the GPU and runs per call when the ids change
every step. Here the same intervals come from torch operations on the device, with static shapes
(``Lq``, ``Lk``, the batch and head counts): no ``.item()``, no ``.cpu()``, nothing that depends on
the values. A step's packing then costs a few small kernels, is captured by CUDA graphs, and under
``torch.compile`` the ids are ordinary graph inputs (new ids never recompile).

It applies to the masks that keep one interval of keys per query row *by construction*: an ``&``
of ``causal()``, ``window``, ``sliding_window``, ``chunked``, ``chunk_band``, ``prefix_lm``,
``key_range``, ``query_range``, ``full()`` (integer or per-head / per-batch parameters), ``shift``
of them, and at most one ``document(ids)``. :func:`interval_spec` recognises them (structure
only; the mask's values are never read) and :meth:`IntervalSpec.bounds` computes:

* ``lo, hi`` ``(Zb, Zh, Lq)``: the keys each row may keep, ``[lo, hi)`` (the *outer* interval);
* ``ilo, ihi``: keys every one of which the row keeps (the *inner* interval, inside the outer);
* ``qid, kid``: document ids to compare inside ``[lo, hi)`` (dense ranks, int32), or None.

Documents: row ``qp`` keeps the keys of its document. When each document is one contiguous run
of ids (``document_from_cu_seqlens`` / ``document_from_positions`` build them so), the run is the
interval and ``qid``/``kid`` are None. For ids given by the caller this is not known without reading
them, so the outer interval is the span from the first to the last occurrence of the row's id
(a stable sort and two ``searchsorted``), the inner one its run, and the kernels compare ids in
the tiles between them. The result is exact for any ids; ids whose documents are runs (the usual
packing) cost a sort of ``L`` ints and one id compare per boundary tile.

:func:`row_tables` and :func:`col_tables` turn the intervals into the kernels' per-tile ranges
(forward and dQ: the key tiles of each row tile; dK/dV: the row tiles of each key tile), and
:func:`gluon_interval_tables` into those of the Gluon forward (``kernels/forward_gluon.py``),
all on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..mask import primitives as P
from ..mask.base import BIG, ParamTensor
from ..mask.expr import And, Mask, query_offset
from ..mask.shift import Shift

__all__ = ["IntervalSpec", "DeviceIntervals", "interval_spec", "interval_terms", "term_bounds", "document_runs",
           "row_tables", "col_tables", "gluon_interval_tables"]

_FAR = 1 << 40  # "no bound" inside the table computations (int64)


class DeviceIntervals(NamedTuple):
    """The rows' intervals on the device (int32, contiguous): ``lo, hi`` ``(Zb, Zh, Lq)`` the outer
    interval ``[lo, hi)`` (empty rows ``lo = hi = 0``); ``ilo, ihi`` the inner one (None: equal to
    the outer); ``qid`` ``(Zb, Zh, Lq)`` and ``kid`` ``(Zk, Lk)`` (``Zk`` 1 or ``Zb``) document ids
    to compare inside the outer interval (None: no compare)."""

    lo: torch.Tensor
    hi: torch.Tensor
    ilo: torch.Tensor | None
    ihi: torch.Tensor | None
    qid: torch.Tensor | None
    kid: torch.Tensor | None


class IntervalSpec(NamedTuple):
    """A mask that keeps one key interval per query row, as :func:`interval_spec` found it:
    ``terms`` ``((primitive, shifts), ...)`` (``shifts``: the offsets of enclosing ``shift`` nodes),
    the document term's index in ``terms`` (or -1), the lengths, the query offset and the mask's
    ``(Zb, Zh)`` instance counts."""

    terms: tuple
    doc: int
    q_len: int
    kv_len: int
    q_offset: int
    zb: int
    zh: int

    @property
    def contiguous(self) -> bool:
        """Whether the intervals are exact without an id compare (no document, or one whose ids are
        known to be contiguous runs)."""
        return self.doc < 0 or bool(getattr(self.terms[self.doc][0], "contiguous", False))

    def bounds(self, device) -> DeviceIntervals:
        """The rows' intervals on ``device``: :class:`DeviceIntervals` (torch operations only)."""
        qp = torch.arange(self.q_len, device=device, dtype=torch.int64) + self.q_offset
        lo, hi, ilo, ihi, qid, kid = _combine(self.terms, self.doc, qp.view(1, 1, -1), self.kv_len, device)
        shape = (self.zb, self.zh, self.q_len)
        lo, hi = _normalise(lo, hi, shape)
        if ilo is not None:
            ilo, ihi = _normalise(ilo, ihi, shape)
        if qid is not None:
            qid = qid.expand(shape).to(torch.int32).contiguous()
        return DeviceIntervals(lo, hi, ilo, ihi, qid, kid)


def interval_terms(mask: Mask):
    """``((primitive, shifts), ...)`` of an ``&`` of interval-shaped leaves (``shift`` nodes
    pass their offsets down), or None for any other node (``|``, ``~``, other primitives)."""
    terms: list = []
    return tuple(terms) if _collect(mask, (), terms) else None


_LEAVES = (P.IntervalPrimitive, P.RowPrimitive, P.Document)


def _collect(m, shifts: tuple, out: list) -> bool:
    if isinstance(m, And):
        for c in m.children:
            if not _collect(c, shifts, out):
                return False
        return True
    if isinstance(m, Shift):
        return _collect(m.children[0], shifts + (m._offset,), out)
    if isinstance(m, _LEAVES):
        out.append((m, shifts))
        return True
    return False


def interval_spec(mask, q_len: int, kv_len: int, align: str = "bottom_right", device=None,
                  require_tensor: bool = True) -> IntervalSpec | None:
    """The device-interval form of ``mask`` for these lengths, or None where it does not apply.

    Args:
        mask: a :class:`~blocksparse_fa.Mask` (anything else gives None).
        q_len, kv_len: lengths.
        align: ``"bottom_right"`` or ``"top_left"`` (query row ``i`` at ``i + kv_len - q_len`` or ``i``).
        device: unused (the intervals are built on the device of the call's tensors); accepted so
            that kernel-choice code can pass what it has.
        require_tensor: only masks that hold a ``document(ids)`` (whose host form would read the
            ids every step) qualify; False accepts ``causal() & sliding_window(w)`` and the like too
            (their host layouts are cached and run the tuned block-sparse kernels).

    Returns:
        An :class:`IntervalSpec`, or None: not a Mask, a node that is not an ``&`` of interval
        leaves, more than one ``document``, or (``require_tensor``) no document. Lengths that do
        not fit the document's ids raise ``ValueError`` (as compiling would). Reads only the
        expression's structure and tensor shapes, so it runs under ``torch.compile`` without
        guards on values.
    """
    if not isinstance(mask, Mask):
        return None
    terms = interval_terms(mask)
    if terms is None:
        return None
    docs = [i for i, (t, _) in enumerate(terms) if isinstance(t, P.Document)]
    if len(docs) > 1 or (require_tensor and not docs):
        return None
    if isinstance(q_len, int) and isinstance(kv_len, int):
        mask.check_lengths(q_len, kv_len)
    else:  # symbolic lengths (torch.compile with dynamic shapes): the leaves' own checks
        for prim, _ in terms:
            prim._check_lengths(q_len, kv_len)
    zb, zh = mask.batch_shape or (1, 1)
    return IntervalSpec(terms, docs[0] if docs else -1, q_len, kv_len, query_offset(q_len, kv_len, align), zb, zh)


# ------------------------------------------------------------------------------------------------
# bounds of the terms
# ------------------------------------------------------------------------------------------------
def _param(v, device):
    """A primitive's parameter for ``_bounds``: an int, or a ``(Bp, Hp, 1)`` int64 device tensor."""
    if isinstance(v, ParamTensor):
        return v.t.to(device=device, dtype=torch.int64).unsqueeze(-1)
    return v


def _shifted(qp, shifts, device):
    for d in shifts:
        qp = qp + _param(d, device)
    return qp


def _clip(x, kv_len):
    x = x.clamp(min=0)
    return torch.minimum(x, kv_len) if isinstance(kv_len, torch.Tensor) else x.clamp(max=kv_len)


def term_bounds(prim, qp, kv_len, device):
    """``(lo, hi)`` int64, half-open, clipped to ``[0, kv_len]``, of an interval or row primitive at
    query positions ``qp`` (``(.., Lq)`` int64; broadcast against per-head/batch parameters).
    ``kv_len``: an int, or an int64 tensor broadcastable to ``qp`` (one length per row)."""
    p = tuple(_param(v, device) for v in prim._params)
    if isinstance(prim, P.RowPrimitive):
        keep = prim._rows(qp, p)
        lo = torch.where(keep, 0, kv_len)
        hi = torch.where(keep, kv_len, 0)
    else:
        lo, h = prim._bounds(qp, p)
        lo, hi = torch.as_tensor(lo, device=device), torch.as_tensor(h, device=device) + 1
    return _clip(lo, kv_len), _clip(hi, kv_len)


def document_runs(ids: torch.Tensor):
    """``(start, end)`` int64 ``(B, L)`` of ``ids`` ``(B, L)``: position ``x`` lies in the run of
    equal consecutive ids ``[start[x], end[x])`` (torch operations, any device)."""
    n = ids.shape[-1]
    pos = torch.arange(n, device=ids.device, dtype=torch.int64).expand(ids.shape)
    first = torch.ones_like(ids[:, :1], dtype=torch.bool)
    change = torch.cat([first, ids[:, 1:] != ids[:, :-1]], dim=1)  # a run starts at x
    last = torch.cat([change[:, 1:], first], dim=1)  # a run ends at x
    start = torch.cummax(torch.where(change, pos, 0), dim=1).values
    end = torch.cummin(torch.where(last, pos + 1, n).flip(1), dim=1).values.flip(1)
    return start, end


def _document(doc, qp, kv_len: int, device):
    """Outer and inner intervals, and the ids to compare, of ``document(ids)`` at ``qp``."""
    ids = doc.tensor.to(device)
    n = ids.shape[-1]
    start, end = document_runs(ids)
    ok = (qp >= 0) & (qp < n)
    qc = qp.clamp(0, n - 1)
    bi = torch.arange(ids.shape[0], device=device).view(-1, 1, 1)  # (Bd, 1, 1) against qp (.., .., Lq)
    ilo = torch.where(ok, start[bi, qc], 0)
    ihi = torch.where(ok, end[bi, qc], 0)
    if getattr(doc, "contiguous", False):
        return ilo, ihi, None, None, None, None
    # the span from the first to the last occurrence of each id; ids as dense ranks (their first
    # index in sorted order), so that int64 ids compare exactly in int32
    srt, perm = torch.sort(ids, dim=1, stable=True)
    left = torch.searchsorted(srt, ids.contiguous(), side="left")
    right = torch.searchsorted(srt, ids.contiguous(), side="right")
    span_lo, span_hi = perm.gather(1, left), perm.gather(1, right - 1) + 1
    lo = torch.where(ok, span_lo[bi, qc], 0)
    hi = torch.where(ok, span_hi[bi, qc], 0)
    qid = torch.where(ok, left[bi, qc], -1)
    return lo, hi, ilo, ihi, qid, left.to(torch.int32).contiguous()


def _combine(terms, doc: int, qp, kv_len: int, device):
    lo = hi = ilo = ihi = qid = kid = None
    for i, (prim, shifts) in enumerate(terms):
        q = _shifted(qp, shifts, device)
        if i == doc:
            dlo, dhi, dilo, dihi, qid, kid = _document(prim, q, kv_len, device)
            if dilo is not None:
                ilo, ihi = dilo, dihi
        else:
            dlo, dhi = term_bounds(prim, q, kv_len, device)
        lo = dlo if lo is None else torch.maximum(lo, dlo)
        hi = dhi if hi is None else torch.minimum(hi, dhi)
    if ilo is not None:  # the inner interval: the run, cut by the other terms like the outer one
        for i, (prim, shifts) in enumerate(terms):
            if i != doc:
                dlo, dhi = term_bounds(prim, _shifted(qp, shifts, device), kv_len, device)
                ilo, ihi = torch.maximum(ilo, dlo), torch.minimum(ihi, dhi)
    return lo, hi, ilo, ihi, qid, kid


def _normalise(lo, hi, shape):
    """int32 ``shape`` intervals with empty ones as ``(0, 0)``."""
    lo, hi = lo.expand(shape), hi.expand(shape)
    empty = lo >= hi
    return (torch.where(empty, 0, lo).to(torch.int32).contiguous(),
            torch.where(empty, 0, hi).to(torch.int32).contiguous())


# ------------------------------------------------------------------------------------------------
# per-tile ranges for the kernels
# ------------------------------------------------------------------------------------------------
def _tiles(x, rows: int, fill: int):
    """``x`` ``(.., L)`` padded with ``fill`` to whole tiles: ``(.., T, rows)``."""
    n = x.shape[-1]
    t = -(-n // rows)
    if t * rows != n:
        x = torch.nn.functional.pad(x, (0, t * rows - n), value=fill)
    return x.view(*x.shape[:-1], t, rows)


def _cdiv(a, b: int):
    return torch.div(a + (b - 1), b, rounding_mode="floor")


def _inner_or_far(lo, hi, ilo, ihi):
    """Inner bounds for the full-tile tests: rows that keep nothing at all (outer empty) take no
    part (``(-far, far)``: the kernels zero their results); rows that keep something but no run of
    the inner form (ids that recur) forbid full tiles (``(far, -far)``)."""
    ilo, ihi = (lo, hi) if ilo is None else (ilo, ihi)
    ilo, ihi = ilo.long(), ihi.long()
    out_empty = lo >= hi
    in_empty = ilo >= ihi
    a = torch.where(out_empty, -_FAR, torch.where(in_empty, _FAR, ilo))
    e = torch.where(out_empty, _FAR, torch.where(in_empty, -_FAR, ihi))
    return a, e


def _visited(lo, hi, rows: int, block_n: int):
    """``(first, end)`` int64 ``(.., T)``: the key tiles of ``block_n`` holding a key that some row of
    each tile of ``rows`` rows may keep (``0, 0`` where none does)."""
    lo, hi = lo.long(), hi.long()
    empty = lo >= hi
    a = _tiles(torch.where(empty, _FAR, lo), rows, _FAR).amin(-1)
    e = _tiles(torch.where(empty, -_FAR, hi), rows, -_FAR).amax(-1)
    none = a >= e
    return (torch.where(none, 0, torch.div(a, block_n, rounding_mode="floor")),
            torch.where(none, 0, _cdiv(e, block_n)))


def _full(a, e, rows: int, block_n: int, first, end):
    """``(f0, f1)``: the key tiles inside every row's ``[a, e)`` (padding rows take no part),
    clamped into ``[first, end]`` with ``f0 <= f1``."""
    f0 = _cdiv(_tiles(a, rows, -_FAR).amax(-1), block_n)
    f1 = torch.div(_tiles(e, rows, _FAR).amin(-1), block_n, rounding_mode="floor")
    f0 = torch.minimum(torch.maximum(f0, first), end)
    return f0, torch.maximum(torch.minimum(f1, end), f0)


def row_tables(iv: DeviceIntervals, block_m: int, block_n: int) -> torch.Tensor:
    """Per row tile of ``block_m`` rows, in key tiles of ``block_n``: ``(first, f0, f1, end)`` int32
    ``(Zb, Zh, T, 4)``. The tile visits key tiles ``[first, end)`` (those holding a key some row
    may keep); every row of it keeps all of tiles ``[f0, f1)`` (inside, possibly empty: ``f0 = f1``),
    the others need the element test. Rows that keep nothing take no part (the kernels output
    zeros for them); padding rows past ``Lq`` neither."""
    first, end = _visited(iv.lo, iv.hi, block_m, block_n)
    f0, f1 = _full(*_inner_or_far(iv.lo, iv.hi, iv.ilo, iv.ihi), block_m, block_n, first, end)
    return torch.stack([first, f0, f1, end], dim=-1).to(torch.int32).contiguous()


def col_tables(iv: DeviceIntervals, kv_len: int, block_m: int, block_n: int) -> torch.Tensor:
    """Per key tile of ``block_n`` keys, in row tiles of ``block_m``: ``(first, f0, f1, end)`` int32
    ``(Zb, Zh, C, 4)``: the tile's dK/dV visit row tiles ``[first, end)`` (a superset of the rows
    that keep one of its keys: exact where the bounds grow with the row, as for every mask of
    :func:`interval_spec` with contiguous documents), and ``[f0, f1)`` are kept whole by every row
    that keeps anything. Found by ``searchsorted`` on monotone envelopes of the bounds."""
    lo, hi = iv.lo.long(), iv.hi.long()
    empty = lo >= hi
    hi_env = torch.cummax(torch.where(empty, 0, hi), dim=-1).values  # non-decreasing, >= hi
    lo_env = torch.cummin(torch.where(empty, kv_len, lo).flip(-1), dim=-1).values.flip(-1)  # <= lo
    c = -(-kv_len // block_n)
    n0 = (torch.arange(c, device=lo.device, dtype=torch.int64) * block_n).expand(*lo.shape[:-1], c).contiguous()
    q0 = torch.searchsorted(hi_env.contiguous(), n0, side="right")  # first row with hi > n0
    q1 = torch.searchsorted(lo_env.contiguous(), n0 + block_n, side="left")  # rows with lo < n0 + block_n
    none = q0 >= q1
    first = torch.where(none, 0, torch.div(q0, block_m, rounding_mode="floor"))
    end = torch.where(none, 0, _cdiv(q1, block_m))
    ia, ie = _inner_or_far(iv.lo, iv.hi, iv.ilo, iv.ihi)
    f_lo = _tiles(ia, block_m, -_FAR).amax(-1)  # padding rows take no part: the kernel checks them
    f_hi = _tiles(ie, block_m, _FAR).amin(-1)
    f_lo = torch.cummax(f_lo, dim=-1).values  # monotone, and never more full tiles than exact
    f_hi = torch.cummin(f_hi.flip(-1), dim=-1).values.flip(-1)
    r0 = torch.searchsorted(f_hi.contiguous(), n0 + block_n, side="left")  # first tile with f_hi >= n1
    r1 = torch.searchsorted(f_lo.contiguous(), n0, side="right")  # tiles with f_lo <= n0
    if kv_len % block_n:  # the ragged last key tile is never full
        r1 = torch.where(n0 + block_n > kv_len, r0, r1)
    f0 = torch.minimum(torch.maximum(r0, first), end)
    f1 = torch.maximum(torch.minimum(r1, end), f0)
    return torch.stack([first, f0, f1, end], dim=-1).to(torch.int32).contiguous()


def gluon_interval_tables(lo: torch.Tensor, hi: torch.Tensor, block_m: int, block_n: int):
    """The Gluon forward's interval tables (``ops/triton_backend._gluon_interval_tables``) from
    device intervals ``lo, hi`` ``(Z, Lq)`` (int32, outer = inner: no id compare), on their device:
    ``(LO, HI, TILES)`` int32, the intervals padded to whole programs of ``2 * block_m`` rows with
    the last row's interval, and per program ``(tile, kb0, e1, e2, n_blocks)`` ``(Z, P, 5)``,
    heaviest programs first (most blocks, then most masked blocks; ties in tile order)."""
    z, lq = lo.shape
    rows = 2 * block_m
    n_prog = -(-lq // rows)
    pad = n_prog * rows - lq
    lo_p = torch.cat([lo, lo[:, -1:].expand(z, pad)], 1) if pad else lo
    hi_p = torch.cat([hi, hi[:, -1:].expand(z, pad)], 1) if pad else hi
    first, end = _visited(lo.view(z, lq), hi.view(z, lq), rows, block_n)
    # as the host tables: a row that keeps nothing forbids full blocks (the Gluon kernel masks
    # partial blocks only), and a program with nothing to attend still runs one masked block
    empty = lo >= hi
    a = torch.where(empty, _FAR, lo.long())
    e = torch.where(empty, -_FAR, hi.long())
    f0, f1 = _full(a, e, rows, block_n, first, end)
    none_full = f1 <= f0
    f0, f1 = torch.where(none_full, end, f0), torch.where(none_full, end, f1)
    end = torch.maximum(end, first + 1)
    n = end - first
    e1 = torch.clamp(torch.minimum(f0, end) - first, min=1)
    e2 = torch.maximum(torch.minimum(f1, end) - first, e1)
    key = n * (1 << 24) + (n - (e2 - e1))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    tile = torch.arange(n_prog, device=lo.device, dtype=torch.int64).expand(z, n_prog)
    tiles = torch.stack([tile, first, e1, e2, n], dim=-1).gather(1, order.unsqueeze(-1).expand(z, n_prog, 5))
    return lo_p.contiguous(), hi_p.contiguous(), tiles.to(torch.int32).contiguous()
