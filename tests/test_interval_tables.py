"""The device-interval path's per-call intervals and tables from the Triton kernels of
``kernels/interval_tables.py`` (the interpreter) against the torch construction of
``compiler/device_intervals.py``, bit for bit: one document, documents of length 1, many
documents, ids that recur, per-batch ids, ``Lq != Lk`` with both aligns, windows, shifts, other
terms, runs that cross the kernels' row blocks; the bounds under ``torch.compile(fullgraph=True)``
as one operation; and what is kept on the mask between calls."""

from __future__ import annotations

import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.compiler import device_intervals as di
from blocksparse_fa.kernels import interval_tables as it


def _ids(lengths) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _random_lengths(total: int, longest: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    while sum(out) < total:
        out.append(min(int(torch.randint(1, longest + 1, (1,), generator=g)), total - sum(out)))
    return out


RECUR = torch.tensor([3] * 20 + [7] * 15 + [3] * 25 + [-5] * 30 + [7] * 10)  # ids 3 and 7 in two runs each
CASES = {
    "one_document": lambda: (bsfa.causal() & bsfa.document(torch.zeros(100, dtype=torch.long)), 100, 100,
                             "bottom_right"),
    "length_one_documents": lambda: (bsfa.causal() & bsfa.document(torch.arange(70)), 70, 70, "bottom_right"),
    "many_documents": lambda: (bsfa.causal() & bsfa.document(_ids(_random_lengths(150, 12, 0))), 150, 150,
                               "bottom_right"),
    "window_causal": lambda: (bsfa.sliding_window(9) & bsfa.causal() & bsfa.document(_ids(_random_lengths(130, 40, 1))),
                              130, 130, "bottom_right"),
    "recurring": lambda: (bsfa.causal() & bsfa.document(RECUR), 100, 100, "top_left"),
    "recurring_int32": lambda: (bsfa.document(RECUR.int()) & bsfa.window(6), 100, 100, "top_left"),
    "batch_ids": lambda: (bsfa.causal() & bsfa.document(torch.stack([_ids([10, 1, 89]), RECUR])), 100, 100,
                          "bottom_right"),
    "batch_runs": lambda: (bsfa.causal() & bsfa.document(torch.stack([_ids([10, 1, 89]), _ids([50, 50])])), 70, 100,
                           "bottom_right"),
    "lq_lt_lk_bottom_right": lambda: (bsfa.causal() & bsfa.document(_ids([30, 45, 25])), 40, 100, "bottom_right"),
    "lq_lt_lk_top_left": lambda: (bsfa.causal() & bsfa.document(_ids([30, 45, 25])), 40, 100, "top_left"),
    "lq_gt_lk_top_left": lambda: (bsfa.document(_ids([60, 40])) & bsfa.causal(), 130, 100, "top_left"),
    "lq_gt_lk_bottom_right": lambda: (bsfa.document(_ids([60, 40])) & bsfa.causal(), 130, 100, "bottom_right"),
    "shifts_ranges": lambda: (bsfa.shift(bsfa.causal() & bsfa.document(_ids([33, 57])), 4) & bsfa.key_range(2, 88)
                              & bsfa.query_range(5, 70) & bsfa.shift(bsfa.window(7), -3), 80, 90, "bottom_right"),
    "other_terms": lambda: (bsfa.document(_ids([60, 30])) & bsfa.chunked(16) & bsfa.prefix_lm(20), 90, 90,
                            "top_left"),
    "per_head_window": lambda: (bsfa.document(_ids([60, 30])) & bsfa.window(bsfa.per_head([2, 40, 0])), 90, 90,
                                "top_left"),
    "per_head_shift": lambda: (bsfa.causal() & bsfa.shift(bsfa.document(_ids([60, 30])), bsfa.per_head([0, 3])), 90,
                               90, "top_left"),
    "promised_runs": lambda: (bsfa.causal() & bsfa.document(_ids([17, 64, 39]), contiguous=True), 120, 120,
                              "bottom_right"),
    "cu_seqlens": lambda: (bsfa.causal() & bsfa.document_from_cu_seqlens(torch.tensor([0, 1, 41, 90]), 90), 90, 90,
                           "bottom_right"),
}


@pytest.fixture(autouse=True)
def _small_programs(monkeypatch):
    """Programs much smaller than the problems: runs cross row blocks, walks take several steps,
    tables span several programs, the loops over summaries and programs several steps."""
    for name, value in (("BLOCK_ROWS", 16), ("WALK", 8), ("TABLE_ROWS", 64), ("COLS", 2), ("CHUNK", 4),
                        ("ORDER", 4)):
        monkeypatch.setattr(it, name, value)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous() and torch.equal(a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_bounds_and_tables_equal_the_torch_construction(case):
    mask, lq, lk, align = CASES[case]()
    spec = di.interval_spec(mask, lq, lk, align)
    want = spec.bounds("cpu", fast=False)
    got = spec.bounds("cpu", fast=True)
    assert got is not want
    assert all(_same(a, b) for a, b in zip(got, want)), case
    if "per_head_shift" not in case:  # a per-head shift of the document: the torch construction
        assert di._folded(spec) is not None
    z = want.lo.shape[0] * want.lo.shape[1]
    for bm, bn in ((16, 32), (32, 16), (64, 64), (16, 128)):
        assert _same(di.row_tables(want, bm, bn, fast=True), di.row_tables(want, bm, bn, fast=False))
        assert _same(di.col_tables(want, lk, bm, bn, fast=True), di.col_tables(want, lk, bm, bn, fast=False))
        if want.ilo is None:
            lo, hi = want.lo.reshape(z, lq), want.hi.reshape(z, lq)
            g1 = di.gluon_interval_tables(lo, hi, bm, bn, fast=True)
            g0 = di.gluon_interval_tables(lo, hi, bm, bn, fast=False)
            assert all(_same(a, b) for a, b in zip(g1, g0))


@pytest.mark.parametrize("case", ["lq_lt_lk_top_left", "many_documents", "batch_runs", "per_head_window"])
def test_backward_tables_and_key_order_in_one_launch_each(case):
    """The Gluon backward's tables with every tile visiting a block (``visit_one``) and the key
    tiles heaviest first, from the Triton kernels, equal the torch construction (ties included)."""
    mask, lq, lk, align = CASES[case]()
    iv = di.interval_spec(mask, lq, lk, align).bounds("cpu", fast=False)
    changed = False
    for bm, bn in ((16, 32), (32, 16), (16, 128)):
        got = di.col_tables(iv, lk, bm, bn, fast=True, visit_one=True)
        want = di.col_tables(iv, lk, bm, bn, fast=False, visit_one=True)
        assert _same(got, want) and _same(want, di._visit_one(di.col_tables(iv, lk, bm, bn, fast=False)))
        changed |= not torch.equal(want, di.col_tables(iv, lk, bm, bn, fast=False))
        assert _same(di.row_tables(iv, bm, bn, fast=True, visit_one=True),
                     di.row_tables(iv, bm, bn, fast=False, visit_one=True))
        order = di.key_tile_order(want, fast=True)  # one permutation per batch row and head
        assert order.shape == (want.shape[0] * want.shape[1], want.shape[2])
        assert _same(order, di.key_tile_order(want, fast=False))
        steps = (want[..., 3] - want[..., 0]).reshape(order.shape).gather(1, order.long())
        assert bool((steps[:, :-1] >= steps[:, 1:]).all())
    if case == "lq_lt_lk_top_left":  # key tiles past the last row's keys: one masked step each
        assert changed


def test_random_packings_and_block_sizes(monkeypatch):
    """Many packings (lengths 1..60, ids that recur or not), row blocks of 16 or 32, walks of 8 or 64."""
    for seed in range(4):
        monkeypatch.setattr(it, "BLOCK_ROWS", (16, 32)[seed % 2])
        monkeypatch.setattr(it, "WALK", (8, 64)[seed % 3 == 0])
        ids = _ids(_random_lengths(200, 60, seed + 10))
        if seed % 2:  # ids that recur: a permutation of the runs' ids, some repeated
            ids = torch.remainder(ids * 7, 5)
        mask = bsfa.sliding_window(23 + seed) & bsfa.causal() & bsfa.document(ids)
        for lq, align in ((200, "bottom_right"), (150, ("top_left", "bottom_right")[seed % 2])):
            spec = di.interval_spec(mask, lq, 200, align)
            want, got = spec.bounds("cpu", fast=False), spec.bounds("cpu", fast=True)
            assert all(_same(a, b) for a, b in zip(got, want))
            assert _same(di.row_tables(want, 32, 16, fast=True), di.row_tables(want, 32, 16, fast=False))
            assert _same(di.col_tables(want, 200, 16, 32, fast=True), di.col_tables(want, 200, 16, 32, fast=False))


def test_gluon_order_keeps_ties_in_tile_order():
    """Programs of equal weight (one long document, causal bands of equal length) keep tile order;
    the programs' order is that of a stable descending sort of the reference."""
    mask = bsfa.sliding_window(64) & bsfa.document(torch.zeros(1024, dtype=torch.long))
    iv = di.interval_spec(mask, 1024, 1024, "bottom_right").bounds("cpu", fast=False)
    lo, hi = iv.lo.view(1, -1), iv.hi.view(1, -1)
    got = di.gluon_interval_tables(lo, hi, 32, 64, fast=True)
    want = di.gluon_interval_tables(lo, hi, 32, 64, fast=False)
    assert all(_same(a, b) for a, b in zip(got, want))
    n = got[2][0, :, 4]
    assert bool((n[:-1] >= n[1:]).all()) and len(set(n.tolist())) < n.numel()  # ties present, heaviest first


def test_bounds_compile_as_one_operation_without_recompiles():
    """``torch.compile(fullgraph=True)``: the bounds are one custom operation; new ids (runs or not)
    of the same shape run the same graph and equal eager."""
    from torch._dynamo.utils import counters

    def build(ids, contiguous):
        mask = bsfa.causal() & bsfa.document(ids, contiguous=contiguous)
        return tuple(t for t in di.interval_spec(mask, 96, 96).bounds(ids.device, fast=True) if t is not None)

    torch._dynamo.reset()
    fn = torch.compile(build, fullgraph=True, backend="aot_eager")
    graphs = None
    for seed in range(2):
        for contiguous in (True, False):
            ids = _ids(_random_lengths(96, 30, seed))
            if not contiguous:
                ids = torch.remainder(ids, 3)
            got = fn(ids, contiguous)
            want = tuple(t for t in di.interval_spec(bsfa.causal() & bsfa.document(ids), 96, 96).bounds(
                "cpu", fast=False) if t is not None)
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
        graphs = counters["stats"]["unique_graphs"] if graphs is None else graphs
    assert counters["stats"]["unique_graphs"] == graphs  # the first packings made the graphs, no more


def test_intervals_and_tables_kept_between_calls():
    mask = bsfa.causal() & bsfa.document(_ids([40, 24]))
    spec = di.interval_spec(mask, 64, 64)
    a = spec.bounds("cpu", fast=True)
    assert spec.bounds("cpu", fast=True) is a  # the same document: kept
    assert di.interval_spec(bsfa.sliding_window(8) & mask, 64, 64).bounds("cpu", fast=True) is not a  # other terms
    c = di.interval_spec(mask, 32, 64).bounds("cpu", fast=True)
    assert c.lo.shape[-1] == 32 and di.interval_spec(mask, 32, 64).bounds("cpu", fast=True) is c  # other lengths
    assert not torch.equal(di.interval_spec(mask, 32, 64, "top_left").bounds("cpu", fast=True).hi, c.hi)  # align
    with torch.inference_mode():
        assert spec.bounds("cpu", fast=True) is not a  # not kept, not reused in inference mode
    t = di.cached_table(a, ("row", 16, 16), lambda: di.row_tables(a, 16, 16))
    assert di.cached_table(a, ("row", 16, 16), lambda: None) is t
    assert di.cached_table(a, ("row", 32, 16), lambda: None) is None  # another key builds
    b = di.DeviceIntervals(a.lo, a.hi.clone(), None, None, None, None)
    assert di.cached_table(b, ("row", 16, 16), lambda: None) is None  # other tensors build
    a.hi.add_(0)  # modified in place: rebuilt
    assert di.cached_table(a, ("row", 16, 16), lambda: None) is None


def test_attention_on_kept_intervals_matches_a_fresh_mask():
    """Two calls through the interval kernels with one mask (intervals and tables kept) equal a call
    with a fresh mask of the same ids, forward and backward."""
    ids = _ids([50, 1, 45])
    mask = bsfa.causal() & bsfa.document(ids)
    q, k, v = (torch.randn(1, 2, 96, 16, requires_grad=True) for _ in range(3))
    outs = []
    for m in (mask, mask, bsfa.causal() & bsfa.document(ids)):
        out = bsfa.attention(q, k, v, mask=m, backend="triton")
        outs.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
    ref = bsfa.reference_attention(q.double(), k.double(), v.double(), mask=mask)
    assert (outs[0][0].double() - ref).abs().max() < 1e-4
