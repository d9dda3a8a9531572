"""One key interval per query row (``compiler/intervals.py``): exact against ``to_dense``, None
exactly where a row keeps two runs, and the per-tile block ranges (and the Gluon forward's tables
built from them) cover the mask exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blocksparse_fa as bsfa
from blocksparse_fa.compiler.intervals import mask_row_interval, row_interval, tile_ranges
from blocksparse_fa.mask.shift import shift


def _kept(lo, hi, lk):
    """bool ``(Z, Lq, Lk)`` of half-open per-row intervals."""
    k = np.arange(lk)
    return (k >= lo[..., None]) & (k < hi[..., None])


def _max_runs(dense: np.ndarray) -> int:
    """Most separate runs of kept keys on one row."""
    d = dense.reshape(-1, dense.shape[-1]).astype(np.int8)
    starts = (np.diff(d, axis=1, prepend=0) == 1).sum(1)
    return int(starts.max()) if len(starts) else 0


def _check(mask, lq, lk, align="bottom_right"):
    """``mask_row_interval`` against the dense mask; returns it."""
    r = mask_row_interval(mask, lq, lk, align=align)
    dense = mask.to_dense(lq, lk, align=align).numpy().reshape(-1, lq, lk)
    if r is None:
        return None, dense
    lo, hi = r
    assert lo.dtype == np.int32 and hi.dtype == np.int32 and lo.shape == (dense.shape[0], lq)
    assert np.array_equal(_kept(lo, hi, lk), dense)
    empty = lo >= hi
    assert (lo[empty] == 0).all() and (hi[empty] == 0).all()  # empty rows are (0, 0)
    assert ((lo >= 0) & (hi <= lk)).all()
    return r, dense


def _interval_leaves(lq, lk, seed):
    g = torch.Generator().manual_seed(seed)
    ints = st.integers
    n = max(lq, lk)
    runs = torch.sort(torch.randint(0, 6, (lk,), generator=g)).values
    return st.one_of(
        st.just(bsfa.full()), st.just(bsfa.causal()), ints(0, 200).map(bsfa.window),
        ints(1, 200).map(bsfa.sliding_window), ints(1, 200).map(bsfa.chunked), ints(0, 200).map(bsfa.prefix_lm),
        ints(0, 100).map(bsfa.global_tokens),
        st.tuples(ints(1, 64), ints(1, 64), ints(-3, 3), ints(0, 3)).map(
            lambda t: bsfa.chunk_band(t[0], t[1], lo=t[2], hi=t[2] + t[3])),
        st.tuples(ints(0, n), ints(0, n)).map(lambda t: bsfa.key_range(min(t), max(t))),
        st.tuples(ints(0, n), ints(0, n)).map(lambda t: bsfa.query_range(min(t), max(t))),
        ints(0, 6).map(lambda k: bsfa.query_set(torch.randint(0, n, (k,), generator=g))),
        ints(0, 6).map(lambda k: bsfa.key_set(torch.randint(0, n, (k,), generator=g))),
        st.just(bsfa.document(runs)),
        st.just(bsfa.document(torch.randperm(6, generator=g)[runs])),  # one run each, labels unsorted
    )


@st.composite
def _problems(draw):
    lq = draw(st.sampled_from([1, 97, 257, 300]))
    lk = draw(st.sampled_from([1, 97, 257, 300]))
    leaf = _interval_leaves(lq, lk, draw(st.integers(0, 3)))
    expr = draw(st.recursive(leaf, lambda sub: st.one_of(
        st.tuples(sub, sub).map(lambda t: t[0] & t[1]),
        st.tuples(sub, sub).map(lambda t: t[0] | t[1]),
        sub.map(lambda x: ~x),
        st.tuples(sub, st.integers(-50, 50)).map(lambda t: shift(t[0], t[1]))), max_leaves=5))
    return expr, lq, lk, draw(st.sampled_from(["bottom_right", "top_left"]))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(_problems())
def test_row_interval_exact_or_none_where_two_runs(problem):
    """Every leaf here is a union of key runs per row: the arrays reproduce the mask exactly,
    and None comes back exactly when some row keeps two or more separate runs."""
    mask, lq, lk, align = problem
    r, dense = _check(mask, lq, lk, align)
    assert (r is None) == (_max_runs(dense) >= 2)


@pytest.mark.parametrize("text", [
    "causal", "sliding_window(1024)", "window(100)", "causal & sliding_window(300)", "key_range(0, 64) | causal",
    "chunked(128)", "prefix_lm(77)", "causal & chunked(200)", "~causal", "global_tokens(16)",
    "causal & query_range(100, 900)", "chunk_band(64, 256, lo=-1, hi=0)", "full",
])
@pytest.mark.parametrize("lq,lk", [(1025, 1025), (257, 1025), (1025, 257)])
def test_band_like_masks_have_one_interval(text, lq, lk):
    r, _ = _check(bsfa.parse(text), lq, lk)
    assert r is not None


@pytest.mark.parametrize("text", [
    "window(64) | global_tokens(16)",  # Longformer: the window and the global keys, apart
    "causal & (sliding_window(64) | strided(64))",
    "strided(7)", "summary(64, 8)", "random_blocks(2, block_size=32)", "periodic_window(100, 5)",
    "~key_range(100, 200)",
])
def test_two_runs_or_other_leaves_give_none(text):
    r, dense = _check(bsfa.parse(text), 513, 513)
    assert r is None


def test_documents_with_causal_and_batches():
    g = torch.Generator().manual_seed(0)
    L = 700
    lens = torch.randint(20, 150, (L,), generator=g)
    ids = torch.repeat_interleave(torch.arange(L), lens)[:L]
    r, _ = _check(bsfa.causal() & bsfa.document(ids), L, L)
    assert r is not None and r[0].shape == (1, L)
    # per-batch documents: one instance per batch row
    ids2 = torch.stack([ids, torch.repeat_interleave(torch.arange(L), torch.randint(5, 60, (L,), generator=g))[:L]])
    r, _ = _check(bsfa.causal() & bsfa.document(ids2), L, L)
    assert r is not None and r[0].shape == (2, L)
    # per-head windows: one instance per head
    w = bsfa.per_head(torch.tensor([16, 100, 333]))
    r, _ = _check(bsfa.sliding_window(w), 300, 300)
    assert r is not None and r[0].shape == (3, 300)
    # a document label used twice (two runs): not one interval per row
    r, _ = _check(bsfa.document(torch.tensor([0] * 10 + [1] * 10 + [0] * 10)), 30, 30)
    assert r is None


def test_row_interval_of_layout_cached_and_refuses_shards():
    lay = bsfa.compile_mask(bsfa.sliding_window(100), 500, 500, 128)
    r = row_interval(lay)
    assert r is not None and row_interval(lay) is r
    lay2 = bsfa.compile_mask(bsfa.window(8) | bsfa.global_tokens(4), 500, 500, 128)
    assert row_interval(lay2) is None

    class _Shard:  # a shard's rows sit at listed positions: refused
        positions = object()
        cache: dict = {}

    assert row_interval(_Shard()) is None


def _emulate_tiles(lo, hi, lk, rows, bn):
    """The kept matrix a kernel computes from :func:`tile_ranges`: blocks ``[first, end)``, those in
    ``[full_start, full_end)`` taken whole, the others masked with the rows' bounds."""
    lq = len(lo)
    got = np.zeros((lq, lk), bool)
    full_got = np.zeros((lq, lk), bool)
    for t, (first, f0, f1, end) in enumerate(tile_ranges(lo, hi, rows, bn)):
        assert first <= f0 <= f1 <= end
        r = slice(t * rows, min((t + 1) * rows, lq))
        for j in range(first, end):
            c = slice(j * bn, min((j + 1) * bn, lk))
            if f0 <= j < f1:
                full_got[r, c] = True
            k = np.arange(c.start, c.stop)
            got[r, c] |= (k >= lo[r, None]) & (k < hi[r, None])
    return got, full_got


@pytest.mark.parametrize("text", ["causal", "sliding_window(300)", "causal & chunked(200)", "window(40)",
                                  "causal & query_range(300, 700)", "key_range(0, 64) | causal", "prefix_lm(500)"])
@pytest.mark.parametrize("rows,bn", [(128, 128), (64, 32), (96, 80)])
def test_tile_ranges_cover_exactly(text, rows, bn):
    lq = lk = 1000
    m = bsfa.parse(text)
    lo, hi = (a[0] for a in mask_row_interval(m, lq, lk))
    dense = m.to_dense(lq, lk).numpy()
    got, full_got = _emulate_tiles(lo, hi, lk, rows, bn)
    assert np.array_equal(got, dense)  # every kept key lies in a visited block
    assert not (full_got & ~dense).any()  # blocks called full are kept by every row
    # and the full range is maximal: a visited whole block outside it has a dropped key on some row
    # (a ragged last block stays masked: a kernel reads zeros past the keys there)
    for t, (first, f0, f1, end) in enumerate(tile_ranges(lo, hi, rows, bn)):
        r = slice(t * rows, min((t + 1) * rows, lq))
        for j in list(range(first, f0)) + list(range(f1, end)):
            if (j + 1) * bn <= lk:
                assert not dense[r, j * bn:(j + 1) * bn].all()


@pytest.mark.parametrize("text,lq,lk", [
    ("sliding_window(300)", 1000, 1024), ("causal & query_range(300, 600)", 1024, 1024),
    ("key_range(0, 64) | causal", 700, 1024), ("causal & chunked(200)", 1024, 1024), ("causal", 384, 1024)])
def test_gluon_interval_tables_cover_exactly(text, lq, lk):
    """The Gluon forward's tables (``ops/triton_backend._gluon_interval_tables``) walked as the
    kernel walks them give the dense mask; programs with nothing to attend run one masked block;
    every tile appears once, heaviest first."""
    from blocksparse_fa.ops import triton_backend as tb

    m = bsfa.parse(text)
    lay = bsfa.compile_mask(m, lq, lk, 128)
    cfg = tb.GluonConfig()
    lo, hi, tiles = (t.numpy() for t in tb._gluon_interval_tables(lay, cfg, torch.device("cpu")))
    rows = 2 * cfg.block_m
    n_prog = -(-lq // rows)
    assert lo.shape == (1, n_prog * rows) and tiles.shape == (1, n_prog, 5)
    assert sorted(tiles[0, :, 0]) == list(range(n_prog))
    n = tiles[0, :, 4]
    assert (np.diff(n) <= 0).all()  # heaviest first
    got = np.zeros((n_prog * rows, lk), bool)
    for tile, kb0, e1, e2, nb in tiles[0]:
        assert 1 <= e1 <= e2 <= nb
        r = slice(tile * rows, (tile + 1) * rows)
        for j in range(nb):
            c = slice((kb0 + j) * cfg.block_n, (kb0 + j + 1) * cfg.block_n)
            k = np.arange(c.start, c.stop)
            keep = (k >= lo[0, r, None]) & (k < hi[0, r, None])
            if e1 <= j < e2:
                assert keep.all()  # the kernel skips the mask here: it must keep the whole block
            got[r, c] |= keep
    assert np.array_equal(got[:lq], m.to_dense(lq, lk).numpy())
