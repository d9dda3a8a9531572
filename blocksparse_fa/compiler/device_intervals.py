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

Two constructions give the same tensors bit for bit: the torch operations here (the reference,
used on the CPU and for any mask; some 40-60 small operations per piece), and the Triton kernels
of ``kernels/interval_tables.py`` (CUDA devices, or ``fast=True``): one launch for the intervals of
a document with terms of the forms ``max(c, qp + a) <= j <= min(c', qp + b)`` and query ranges
(others as torch operations), two and a sort with an id compare, one launch per row table, two
per column or Gluon table. Under ``torch.compile`` the intervals' launches are one custom
operation (``blocksparse_fa::document_bounds``). Outside tracing and CUDA-graph capture the
intervals are kept on the ``document`` (masks are immutable and clone their ids) and the tables on
the intervals (:func:`cached_table`): an eager step whose layers pass the same mask builds them once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._oplib import custom_op
from ..mask import primitives as P
from ..mask.base import ParamTensor
from ..mask.expr import And, Mask, query_offset
from ..mask.shift import Shift

__all__ = ["IntervalSpec", "DeviceIntervals", "gluon_backward_tables", "interval_spec", "interval_terms", "term_bounds", "document_runs",
           "row_tables", "col_tables", "gluon_interval_tables", "cached_table"]

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

    def bounds(self, device, fast: bool | None = None) -> DeviceIntervals:
        """The rows' intervals on ``device``: :class:`DeviceIntervals`.

        ``fast``: through the Triton kernels of ``kernels/interval_tables.py`` (a few launches;
        masks with a document whose shifts are integers) or the torch operations below (the
        reference, any mask); None: Triton on CUDA devices. Both give the same tensors."""
        device = torch.device(device)
        fast = device.type == "cuda" if fast is None else fast
        cache = self._cache(device, fast)
        if cache is not None:
            hit = cache[0].get(cache[1])
            if hit is not None:
                return hit
        iv = _fast_bounds(self, device) if fast else None
        iv = self._reference_bounds(device) if iv is None else iv
        if cache is not None:
            store, key = cache
            if len(store) >= _CACHED:
                store.pop(next(iter(store)))
            store[key] = iv
        return iv

    def _cache(self, device: torch.device, fast: bool):
        """``(store, key)``: where the intervals of these lengths and terms are kept, on the
        document (masks are immutable and clone their ids: each layer of an eager step that passes
        the same ``document`` builds them once); None where nothing is kept: no document, tracing
        (``torch.compile``), a CUDA graph capturing, inference mode (its tensors cannot be saved for
        a later backward)."""
        if self.doc < 0 or not _cacheable(device) or torch.is_inference_mode_enabled():
            return None
        doc = self.terms[self.doc][0]
        store = getattr(doc, "_device_cache", None)
        if store is None:
            store = doc._device_cache = {}
        others = tuple((None if i == self.doc else p._ckey(), sh) for i, (p, sh) in enumerate(self.terms))
        return store, (device, _stream(device), fast, self.q_len, self.kv_len, self.q_offset, self.zb, self.zh,
                       others)

    def _reference_bounds(self, device) -> DeviceIntervals:
        qp = torch.arange(self.q_len, device=device, dtype=torch.int64) + self.q_offset
        lo, hi, ilo, ihi, qid, kid = _combine(self.terms, self.doc, qp.view(1, 1, -1), self.kv_len, device)
        shape = (self.zb, self.zh, self.q_len)
        lo, hi = _normalise(lo, hi, shape)
        if ilo is not None:
            ilo, ihi = _normalise(ilo, ihi, shape)
        if qid is not None:
            qid = qid.expand(shape).to(torch.int32).contiguous()
        return DeviceIntervals(lo, hi, ilo, ihi, qid, kid)


_CACHED = 8  # intervals kept per document (lengths, devices, other terms)


def _cacheable(device: torch.device) -> bool:
    """Whether results may be kept for later calls: not while tracing, nor while a CUDA graph
    captures (tensors made then live in the graph's memory, rewritten by each replay)."""
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def ids_on(doc, device: torch.device) -> torch.Tensor:
    """The ids of ``document(ids)`` on ``device``. A copy to another device is kept on the
    (immutable) document for later calls, so that a CUDA graph can capture a step whose ids live
    on the CPU once an eager step has run (a capture cannot copy from pageable host memory), and a
    compiled graph traced after an eager call reads that copy instead of copying the ids per call."""
    ids = doc.tensor
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if ids.device == device:
        return ids
    key = str(device)
    kept = getattr(doc, "_ids_on", None)
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        # a compiled graph reads a copy an eager call kept (no copy from host memory per call)
        return kept[key] if kept is not None and key in kept else ids.to(device)
    if kept is None:
        kept = doc._ids_on = {}
    hit = kept.get(key)
    if hit is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("document(ids): the ids are on the CPU and this is the first call on "
                               f"{device} while a CUDA graph captures, which cannot copy them; run the step "
                               "once before capturing, or pass the ids on the GPU")
        hit = kept[key] = ids.to(device)
    return hit


def _stream(device: torch.device):
    """The current stream's id on CUDA devices (kept results are reused on the stream that made
    them only: another stream would need an event), else None."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)  # the stream's handle, without a Stream object


def cached_table(iv: DeviceIntervals, key: tuple, build):
    """``build()``, kept on ``iv.lo`` under ``key`` for later calls with the same interval tensors
    (the same objects, unmodified: their version counters are part of the check) on the same
    stream, as an eager step's layers make them when they share a mask (:meth:`IntervalSpec.bounds`
    keeps the intervals). Not kept while tracing, capturing a CUDA graph, or for inference tensors."""
    lo = iv.lo
    if not _cacheable(lo.device) or lo.is_inference():
        return build()
    others = tuple(iv[1:])
    stamp = tuple(-1 if t is None else t._version for t in iv)
    key = (_stream(lo.device),) + tuple(key)
    store = lo.__dict__.setdefault("_interval_tables", {})
    hit = store.get(key)
    if hit is not None and hit[1] == stamp and all(a is b for a, b in zip(hit[0], others)):
        return hit[2]
    out = build()
    store[key] = (others, stamp, out)  # never lo itself: no reference cycle
    return out


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
    ids = ids_on(doc, device)
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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _folded(spec: IntervalSpec):
    """The spec's terms for ``kernels/interval_tables.document_bounds``: ``(doc_off, consts,
    generic)``, the terms of the forms ``lo = max(c, qp + a)``, ``hi = min(c', qp + b)`` (integer
    ``_affine``) and integer query ranges folded into ``consts`` (their integer shifts added), the
    others left in ``generic`` ``((primitive, shifts), ...)``; None without a document or where its
    shifts are not integers."""
    if spec.doc < 0 or not all(_is_int(d) for d in spec.terms[spec.doc][1]):
        return None
    lo_c, lo_a, hi_c, hi_b, row_a, row_b = 0, -_FAR, spec.kv_len - 1, _FAR, -_FAR, _FAR
    generic = []
    for i, (prim, shifts) in enumerate(spec.terms):
        if i == spec.doc:
            continue
        ints = all(_is_int(x) for x in shifts) and all(_is_int(v) for v in getattr(prim, "_params", ()))
        d = sum(shifts) if ints else None
        rows = getattr(prim, "_row_range", None)
        rows = rows() if rows is not None and d is not None else None
        aff = getattr(prim, "_affine", None)
        aff = aff() if aff is not None and d is not None else None
        if rows is not None:
            row_a, row_b = max(row_a, rows[0] - d), min(row_b, rows[1] - d)
        elif aff is not None:
            c, a, c2, b = aff
            lo_c = lo_c if c is None else max(lo_c, c)
            lo_a = lo_a if a is None else max(lo_a, a + d)
            hi_c = hi_c if c2 is None else min(hi_c, c2)
            hi_b = hi_b if b is None else min(hi_b, b + d)
        else:
            generic.append((prim, shifts))
    return sum(spec.terms[spec.doc][1]), (lo_c, lo_a, hi_c, hi_b, row_a, row_b), generic


def _fast_bounds(spec: IntervalSpec, device) -> DeviceIntervals | None:
    """:meth:`IntervalSpec.bounds` through ``kernels/interval_tables.document_bounds`` (one launch,
    two with an id compare, plus its sort; terms of other forms as torch operations), or None where
    :func:`_folded` refuses. Under ``torch.compile`` the launches are one opaque operation."""
    folded = _folded(spec)
    if folded is None:
        return None
    doc_off, consts, generic = folded
    ids = ids_on(spec.terms[spec.doc][0], device)
    terms = (None, None)
    if generic:
        qp = (torch.arange(spec.q_len, device=device, dtype=torch.int64) + spec.q_offset).view(1, 1, -1)
        tlo = thi = None
        for prim, shifts in generic:
            a, b = term_bounds(prim, _shifted(qp, shifts, device), spec.kv_len, device)
            tlo = a if tlo is None else torch.maximum(tlo, a)
            thi = b if thi is None else torch.minimum(thi, b)
        shape = (*tlo.shape[:-1], spec.q_len)
        terms = (tlo.expand(shape).contiguous(), thi.expand(shape).contiguous())
    compare = not spec.contiguous
    args = (ids, *terms, spec.q_len, spec.zb, spec.zh, spec.q_offset, doc_off, list(consts), compare)
    if torch.compiler.is_compiling():
        out = torch.ops.blocksparse_fa.document_bounds(*args)
    else:
        out = _document_bounds(*args)
    return DeviceIntervals(*out) if compare else DeviceIntervals(out[0], out[1], None, None, None, None)


@custom_op("blocksparse_fa::document_bounds", mutates_args=())
def _document_bounds_op(ids: torch.Tensor, terms_lo: torch.Tensor | None, terms_hi: torch.Tensor | None, q_len: int,
                        zb: int, zh: int, q_off: int, doc_off: int, consts: list[int],
                        compare: bool) -> list[torch.Tensor]:
    """``kernels/interval_tables.document_bounds`` as one operation of a compiled graph."""
    return list(_document_bounds(ids, terms_lo, terms_hi, q_len, zb, zh, q_off, doc_off, consts, compare))


@_document_bounds_op.register_fake
def _document_bounds_fake(ids, terms_lo, terms_hi, q_len, zb, zh, q_off, doc_off, consts, compare):
    out = [ids.new_empty((zb, zh, q_len), dtype=torch.int32) for _ in range(5 if compare else 2)]
    return out + [ids.new_empty(ids.shape, dtype=torch.int32)] if compare else out


def _document_bounds(ids, terms_lo, terms_hi, q_len, zb, zh, q_off, doc_off, consts, compare):
    from ..kernels.interval_tables import document_bounds

    terms = None if terms_lo is None else (terms_lo, terms_hi)
    return document_bounds(ids, q_len, zb, zh, q_off, doc_off, tuple(consts), terms, compare)


# ------------------------------------------------------------------------------------------------
# per-tile ranges for the kernels
# ------------------------------------------------------------------------------------------------
def _triton_tables(lo: torch.Tensor, fast: bool | None, rows: int) -> bool:
    """Whether the tables come from ``kernels/interval_tables.py``: ``fast`` (None: on CUDA
    devices), for tiles of a power-of-two number of rows."""
    return (lo.is_cuda if fast is None else fast) and rows > 0 and rows & (rows - 1) == 0


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


def row_tables(iv: DeviceIntervals, block_m: int, block_n: int, fast: bool | None = None,
               visit_one: bool = False) -> torch.Tensor:
    """Per row tile of ``block_m`` rows, in key tiles of ``block_n``: ``(first, f0, f1, end)`` int32
    ``(Zb, Zh, T, 4)``. The tile visits key tiles ``[first, end)`` (those holding a key some row
    may keep); every row of it keeps all of tiles ``[f0, f1)`` (inside, possibly empty: ``f0 = f1``),
    the others need the element test. Rows that keep nothing take no part (the kernels output
    zeros for them); padding rows past ``Lq`` neither. ``fast``: as in :func:`col_tables`;
    ``visit_one``: every tile visits at least one key tile (:func:`_visit_one`)."""
    if _triton_tables(iv.lo, fast, block_m):
        from ..kernels.interval_tables import row_tables as triton_row_tables

        return triton_row_tables(iv.lo, iv.hi, iv.ilo, iv.ihi, block_m, block_n, visit_one)
    first, end = _visited(iv.lo, iv.hi, block_m, block_n)
    f0, f1 = _full(*_inner_or_far(iv.lo, iv.hi, iv.ilo, iv.ihi), block_m, block_n, first, end)
    tab = torch.stack([first, f0, f1, end], dim=-1).to(torch.int32).contiguous()
    return _visit_one(tab) if visit_one else tab


def col_tables(iv: DeviceIntervals, kv_len: int, block_m: int, block_n: int, fast: bool | None = None,
               visit_one: bool = False) -> torch.Tensor:
    """Per key tile of ``block_n`` keys, in row tiles of ``block_m``: ``(first, f0, f1, end)`` int32
    ``(Zb, Zh, C, 4)``: the tile's dK/dV visit row tiles ``[first, end)`` (a superset of the rows
    that keep one of its keys: exact where the bounds grow with the row, as for every mask of
    :func:`interval_spec` with contiguous documents), and ``[f0, f1)`` are kept whole by every row
    that keeps anything. Found by ``searchsorted`` on monotone envelopes of the bounds.

    ``fast``: through the Triton kernels of ``kernels/interval_tables.py`` (two launches) or the
    torch operations here (the reference); None: Triton on CUDA devices. Both give the same table
    (a power-of-two ``block_m`` is needed for Triton; others take the torch operations).
    ``visit_one``: as in :func:`row_tables`."""
    if _triton_tables(iv.lo, fast, block_m):
        from ..kernels.interval_tables import col_tables as triton_col_tables

        return triton_col_tables(iv.lo, iv.hi, iv.ilo, iv.ihi, kv_len, block_m, block_n, visit_one)
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
    tab = torch.stack([first, f0, f1, end], dim=-1).to(torch.int32).contiguous()
    return _visit_one(tab) if visit_one else tab


def gluon_interval_tables(lo: torch.Tensor, hi: torch.Tensor, block_m: int, block_n: int, fast: bool | None = None):
    """The Gluon forward's interval tables (``ops/triton_backend._gluon_interval_tables``) from
    device intervals ``lo, hi`` ``(Z, Lq)`` (int32, outer = inner: no id compare), on their device:
    ``(LO, HI, TILES)`` int32, the intervals padded to whole programs of ``2 * block_m`` rows with
    the last row's interval, and per program ``(tile, kb0, e1, e2, n_blocks)`` ``(Z, P, 5)``,
    heaviest programs first (most blocks, then most masked blocks; ties in tile order). ``fast``:
    as in :func:`col_tables` (two launches)."""
    if _triton_tables(lo, fast, block_m):
        from ..kernels.interval_tables import gluon_tables

        return gluon_tables(lo.contiguous(), hi.contiguous(), block_m, block_n)
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


def gluon_segment_tables(lo: torch.Tensor, hi: torch.Tensor, rows: int, block_n: int, zs: torch.Tensor):
    """The Gluon forward's segment tables (``kernels/forward_gluon._attn_fwd_gluon``, ``SEGMENTS``)
    from device intervals ``lo, hi`` ``(Z, Lq)`` (outer = inner), on their device and without a
    synchronisation: row tiles of at most ``rows`` rows that start where a run of rows starts (row
    0, and a row whose keys begin at or after the previous row's end: a document's first row; at most
    one run start per aligned window of ``rows`` rows, which bounds the tiles by ``2·cdiv(Lq, rows)``
    per instance), each visiting key blocks of ``block_n`` keys from its first kept key.

    Args:
        lo, hi: int32 ``(Z, Lq)``, row ``r`` of instance ``z`` keeps keys ``[lo, hi)``.
        rows: rows per tile (``groups·block_m``).
        block_n: keys per step.
        zs: int64 ``(B·H,)``, the instance of each batch·head.

    Returns:
        ``(LO, HI, TILES, n_prog)``: ``LO``/``HI`` int32 ``(Z, n_prog·rows)``, rows past ``Lq``
        keeping nothing; ``TILES`` int32: ``TILES[0]`` the items, then from ``TILES[8]`` 8 ints per
        item ``(pid_bh, row0, key0, e1, e2, n_blocks, row_end, 0)``, heaviest first (most steps,
        then most masked ones; ties by tile, then by head), items that do not exist after them.
        Steps ``[e1, e2)`` are full for every row of ``[row0, row_end)``; a tile whose rows keep
        nothing runs one masked step."""
    z, lq = lo.shape
    dev = lo.device
    p0 = -(-lq // rows)
    cap = 2 * p0  # tiles per instance at most
    n_prog = p0 + 1  # every tile's rows lie below n_prog·rows
    lo_p = torch.zeros((z, n_prog * rows), dtype=torch.int32, device=dev)
    hi_p = torch.zeros((z, n_prog * rows), dtype=torch.int32, device=dev)
    lo_p[:, :lq] = lo
    hi_p[:, :lq] = hi
    lo64, hi64 = lo.long(), hi.long()
    r = torch.arange(lq, device=dev)
    brk = torch.ones((z, lq), dtype=torch.bool, device=dev)
    brk[:, 1:] = lo64[:, 1:] >= hi64[:, :-1]
    win = torch.nn.functional.pad(brk, (0, p0 * rows - lq)).view(z, p0, rows)
    keep = (win & (win.cumsum(-1) == 1)).view(z, p0 * rows)[:, :lq]
    seg0 = torch.where(keep, r, 0).cummax(1).values  # each row's run start
    nxt = torch.where(keep, r, lq).flip(1).cummin(1).values.flip(1)  # the first run start >= r
    seg1 = torch.cat([nxt[:, 1:], torch.full((z, 1), lq, device=dev, dtype=nxt.dtype)], 1)  # ... > r
    starts = torch.where((r - seg0) % rows == 0, r, lq)
    if lq < cap:
        starts = torch.cat([starts, torch.full((z, cap - lq), lq, device=dev, dtype=starts.dtype)], 1)
    pos = torch.sort(starts, dim=1).values[:, :cap]
    valid = pos < lq
    a = torch.where(valid, pos, 0)
    b = torch.minimum(a + rows, seg1.gather(1, a))
    idx = a.unsqueeze(-1) + torch.arange(rows, device=dev)
    inrow = (idx < b.unsqueeze(-1)) & valid.unsqueeze(-1)
    idx = idx.clamp(max=lq - 1).view(z, -1)
    glo = lo64.gather(1, idx).view(z, cap, rows)
    ghi = hi64.gather(1, idx).view(z, cap, rows)
    live = inrow & (glo < ghi)
    any_live = live.any(-1)
    key0 = torch.where(any_live, torch.where(live, glo, _FAR).amin(-1), 0)
    end = torch.where(any_live, torch.where(live, ghi, -_FAR).amax(-1), 0)
    n = torch.where(any_live, torch.clamp(-(-(end - key0) // block_n), min=1), 1)
    # full steps: every written row keeps the step's keys whole; a row that keeps nothing forbids them
    f0 = -(-(torch.where(live, glo, -_FAR).amax(-1) - key0) // block_n)
    f1 = (torch.where(live, ghi, _FAR).amin(-1) - key0) // block_n
    e1 = torch.clamp(f0, min=1)
    e2 = torch.minimum(f1, n)
    none = (inrow & (glo >= ghi)).any(-1) | (e2 <= e1) | ~any_live
    e1 = torch.where(none, n, torch.minimum(e1, n))
    e2 = torch.where(none, n, e2)
    weight = torch.where(valid, n * (1 << 24) + (n - (e2 - e1)), -1)
    bh = torch.arange(zs.shape[0], device=dev)
    fields = torch.stack([a, key0, e1, e2, n, b], -1)[zs]  # (BH, cap, 6)
    recs = torch.cat([bh.view(-1, 1, 1).expand(-1, cap, 1), fields, torch.zeros_like(fields[..., :1])], -1)
    recs = recs.transpose(0, 1).reshape(-1, 8)  # tile-major: one tile of every head, then the next
    w = weight[zs].transpose(0, 1).reshape(-1)
    order = torch.sort(w, descending=True, stable=True).indices
    head = torch.zeros(8, dtype=torch.int64, device=dev)
    head[0] = (w >= 0).sum()
    tiles = torch.cat([head, recs[order].reshape(-1)]).to(torch.int32)
    return lo_p, hi_p, tiles, n_prog


def _visit_one(tab: torch.Tensor) -> torch.Tensor:
    """A ``(first, f0, f1, end)`` table whose tiles visit at least one tile: a tile that no row
    sees gets ``end = first + 1`` (one masked step, which adds zeros), so that the Gluon programs
    run their pipelines and store zeros."""
    return torch.cat([tab[..., :3], torch.maximum(tab[..., 3:], tab[..., :1] + 1)], -1).contiguous()


def key_tile_order(kv_tab: torch.Tensor, fast: bool | None = None) -> torch.Tensor:
    """The key tiles of a dK/dV table ``(Zb, Zh, P, 4)`` (:func:`gluon_backward_tables`) heaviest
    first (most query blocks; ties in tile order): int32 ``(Zb·Zh, P)``, a permutation per instance,
    which the persistent dK/dV kernel deals out so that programs finish together. ``fast``: one
    Triton launch (``kernels/interval_tables._tile_order``) or the torch sort; None: Triton on CUDA."""
    if kv_tab.is_cuda if fast is None else fast:
        from ..kernels.interval_tables import tile_order

        return tile_order(kv_tab)
    steps = (kv_tab[..., 3] - kv_tab[..., 0]).reshape(-1, kv_tab.shape[-2])
    return torch.argsort(-steps, dim=-1, stable=True).to(torch.int32).contiguous()


def gluon_backward_tables(iv: DeviceIntervals, kv_len: int, cfg):
    """``(kv_tab, q_tab)``: the Gluon backward's interval tables for intervals ``iv`` (no id
    compare) and tiles ``cfg`` (:class:`~blocksparse_fa.ops.options.GluonBwdConfig`): per key tile
    of ``2·block_n`` keys its query blocks of ``block_m`` rows
    (:func:`~blocksparse_fa.compiler.device_intervals.col_tables`), per row tile of
    ``2·dq_block_m`` rows its key blocks of ``dq_block_n``
    (:func:`~blocksparse_fa.compiler.device_intervals.row_tables`), int32 ``(Zb, Zh, P, 4)``, every
    tile visiting at least one block. Shared by the device-interval path and compiled layouts
    (``ops/triton_backend._gluon_bwd_interval_tables``)."""
    return (col_tables(iv, kv_len, cfg.block_m, 2 * cfg.block_n, visit_one=True),
            row_tables(iv, 2 * cfg.dq_block_m, cfg.dq_block_n, visit_one=True))
