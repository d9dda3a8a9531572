"""Block compiler: exact/sound block classification, lookup tables, layout views and the cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blocksparse_fa as bsfa
from blocksparse_fa.compiler import cache_info, clear_cache, compile_mask

LEN_PAIRS = [(1, 1), (97, 97), (257, 257), (1000, 1000), (1025, 1025), (97, 1025), (1025, 97), (1, 257), (257, 1),
             (1000, 257)]
BLOCKS = [16, 128, (32, 64), (128, 16), (48, 80), 64]


def pair(bs):
    return (bs, bs) if isinstance(bs, int) else tuple(bs)


def exact_states(dense: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """Ground-truth block states from a dense mask (..., Lq, Lk): 0 empty, 1 mixed, 2 all kept."""
    lq, lk = dense.shape[-2:]
    tr, tc = -(-lq // bm), -(-lk // bn)
    lead = dense.shape[:-2]
    kept = torch.zeros(*lead, tr * bm, tc * bn, dtype=torch.int32)
    valid = torch.zeros(tr * bm, tc * bn, dtype=torch.int32)
    kept[..., :lq, :lk] = dense.int()
    valid[:lq, :lk] = 1
    n = kept.view(*lead, tr, bm, tc, bn).sum((-3, -1))
    size = valid.view(tr, bm, tc, bn).sum((1, 3))
    return torch.where(n == 0, 0, torch.where(n == size, 2, 1)).to(torch.int8)


def check_layout(mask, q_len, kv_len, bs, exact: bool, **kw):
    lay = compile_mask(mask, q_len, kv_len, bs, cache=False, **kw)
    bm, bn = pair(bs)
    dense = mask.to_dense(q_len, kv_len)
    ctx = f"{mask} q={q_len} kv={kv_len} block={(bm, bn)}"
    assert lay.block_size == (bm, bn)
    assert torch.equal(lay.to_dense(), dense), ctx
    states = lay.block_states()
    assert states.dtype == torch.int8
    assert tuple(states.shape) == (*mask.batch_shape, -(-q_len // bm), -(-kv_len // bn)), ctx
    assert tuple(states.shape) == lay.shape
    truth = exact_states(dense, bm, bn)
    truth = truth.expand(states.shape)
    assert set(torch.unique(states).tolist()) <= {0, 1, 2}, ctx
    # soundness: a block called full is all kept, one called empty is all dropped
    assert not bool(((states == 2) & (truth != 2)).any()), f"block called full is not: {ctx}"
    assert not bool(((states == 0) & (truth != 0)).any()), f"block called empty is not: {ctx}"
    if exact:  # single primitives: partial blocks are truly mixed
        assert torch.equal(states, truth), f"inexact classification: {ctx}"
    return lay


# ------------------------------------------------------------------------------------------------
# every primitive, exact
# ------------------------------------------------------------------------------------------------
def _gen(lq, lk):
    return torch.Generator().manual_seed(lq * 7919 + lk)


PRIMITIVE_FACTORIES = {
    "full": lambda lq, lk: bsfa.full(),
    "causal": lambda lq, lk: bsfa.causal(),
    "window0": lambda lq, lk: bsfa.window(0),
    "window37": lambda lq, lk: bsfa.window(37),
    "window300": lambda lq, lk: bsfa.window(300),
    "sliding_window1": lambda lq, lk: bsfa.sliding_window(1),
    "sliding_window100": lambda lq, lk: bsfa.sliding_window(100),
    "global_tokens0": lambda lq, lk: bsfa.global_tokens(0),
    "global_tokens20": lambda lq, lk: bsfa.global_tokens(20),
    "global_tokens130": lambda lq, lk: bsfa.global_tokens(130),
    "strided1": lambda lq, lk: bsfa.strided(1),
    "strided3": lambda lq, lk: bsfa.strided(3),
    "strided64": lambda lq, lk: bsfa.strided(64),
    "strided200": lambda lq, lk: bsfa.strided(200),
    "chunked1": lambda lq, lk: bsfa.chunked(1),
    "chunked50": lambda lq, lk: bsfa.chunked(50),
    "chunked128": lambda lq, lk: bsfa.chunked(128),
    "prefix_lm0": lambda lq, lk: bsfa.prefix_lm(0),
    "prefix_lm70": lambda lq, lk: bsfa.prefix_lm(70),
    "summary": lambda lq, lk: bsfa.summary(40, 5),
    "summary_all": lambda lq, lk: bsfa.summary(7, 7),
    "random_blocks": lambda lq, lk: bsfa.random_blocks(2, block_size=32, seed=4),
    "random_blocks128": lambda lq, lk: bsfa.random_blocks(3, block_size=128, seed=1),
    "random_blocks_many": lambda lq, lk: bsfa.random_blocks(40, block_size=16),
    "document_sorted": lambda lq, lk: bsfa.document(torch.sort(torch.randint(0, 6, (lk,), generator=_gen(lq, lk))).values),
    "document_unsorted": lambda lq, lk: bsfa.document(torch.randint(0, 3, (lk,), generator=_gen(lq, lk))),
    "document_batch": lambda lq, lk: bsfa.document(torch.sort(torch.randint(0, 4, (2, lk), generator=_gen(lq, lk)), 1).values),
    "block_mask": lambda lq, lk: bsfa.block_mask(torch.rand(-(-lq // 32), -(-lk // 32), generator=_gen(lq, lk)) < 0.4,
                                                 block_size=32),
    "block_mask_batch": lambda lq, lk: bsfa.block_mask(
        torch.rand(2, 1, -(-lq // 64), -(-lk // 64), generator=_gen(lq, lk)) < 0.4, block_size=64),
    "dense_mask": lambda lq, lk: bsfa.dense_mask(torch.rand(lq, lk, generator=_gen(lq, lk)) < 0.3),
    "dense_mask_sparse_batch": lambda lq, lk: bsfa.dense_mask(torch.rand(1, 2, lq, lk, generator=_gen(lq, lk)) < 0.001),
    "dense_mask_ones": lambda lq, lk: bsfa.dense_mask(torch.ones(lq, lk, dtype=torch.bool)),
}


@pytest.mark.parametrize("name", list(PRIMITIVE_FACTORIES))
def test_every_primitive_compiles_exactly(name):
    make = PRIMITIVE_FACTORIES[name]
    shift = list(PRIMITIVE_FACTORIES).index(name)  # each primitive meets other (lengths, block) pairs
    for k, (lq, lk) in enumerate(LEN_PAIRS):
        blocks = [BLOCKS[(k + shift) % len(BLOCKS)]]
        if k % 2 == 0:
            blocks.append(BLOCKS[(k + shift + 3) % len(BLOCKS)])
        for bs in blocks:
            check_layout(make(lq, lk), lq, lk, bs, exact=True)


def test_interval_intersections_stay_exact():
    """Combinations of interval primitives under & are classified exactly (one interval)."""
    for m in [bsfa.causal() & bsfa.sliding_window(300), bsfa.causal() & bsfa.window(64),
              bsfa.sliding_window(4096) & bsfa.causal(), bsfa.chunked(100) & bsfa.causal()]:
        for lq, lk in [(1000, 1000), (257, 1025), (1025, 257)]:
            check_layout(m, lq, lk, (64, 32), exact=True)


# ------------------------------------------------------------------------------------------------
# random compositions (hypothesis): to_dense equality and soundness
# ------------------------------------------------------------------------------------------------
def leaves(lq, lk, seed):
    g = torch.Generator().manual_seed(seed)
    ints = st.integers
    return st.one_of(
        st.just(bsfa.full()), st.just(bsfa.causal()),
        ints(0, 400).map(bsfa.window), ints(1, 400).map(bsfa.sliding_window), ints(0, 300).map(bsfa.global_tokens),
        ints(1, 80).map(bsfa.strided), ints(1, 400).map(bsfa.chunked), ints(0, 400).map(bsfa.prefix_lm),
        st.tuples(ints(1, 50), ints(0, 50)).filter(lambda t: t[1] <= t[0]).map(lambda t: bsfa.summary(*t)),
        st.tuples(ints(0, 4), st.sampled_from([16, 32, 64, 128]), ints(0, 9)).map(
            lambda t: bsfa.random_blocks(t[0], block_size=t[1], seed=t[2])),
        st.just(bsfa.document(torch.sort(torch.randint(0, 5, (lk,), generator=g)).values)),
        st.just(bsfa.dense_mask(torch.rand(lq, lk, generator=g) < 0.5)),
    )


@st.composite
def problems(draw):
    lq = draw(st.sampled_from([1, 97, 257, 1000, 1025]))
    lk = draw(st.sampled_from([1, 97, 257, 1000, 1025]))
    bm = draw(st.sampled_from([16, 32, 48, 64, 128]))
    bn = draw(st.sampled_from([16, 32, 64, 80, 128]))
    leaf = leaves(lq, lk, draw(st.integers(0, 3)))
    expr = draw(st.recursive(leaf, lambda sub: st.one_of(
        st.tuples(sub, sub).map(lambda t: t[0] & t[1]),
        st.tuples(sub, sub).map(lambda t: t[0] | t[1]),
        sub.map(lambda x: ~x)), max_leaves=6))
    return expr, lq, lk, (bm, bn)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(problems())
def test_random_compositions_sound(problem):
    mask, lq, lk, bs = problem
    check_layout(mask, lq, lk, bs, exact=False)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(problems())
def test_random_compositions_sound_without_refinement(problem):
    mask, lq, lk, bs = problem
    lay = check_layout(mask, lq, lk, bs, exact=False, refine_budget=0)
    assert lay.n_refined == 0


def test_refinement_settles_combined_blocks():
    # partial | partial: the state algebra alone leaves every block uncertain (non-square blocks:
    # not the block-Toeplitz path, which settles distance masks exactly without refinement)
    m = bsfa.strided(3) | ~bsfa.strided(3)  # == full
    lay = compile_mask(m, 256, 256, (32, 16), cache=False)
    assert lay.n_partial == 0 and lay.n_full == 128 and lay.n_refined > 0
    lay0 = compile_mask(m, 256, 256, (32, 16), cache=False, refine_budget=0)
    assert lay0.n_partial > 0 and lay0.n_refined == 0  # conservative, still sound
    assert torch.equal(lay0.to_dense(), lay.to_dense())
    toeplitz = compile_mask(m, 256, 256, 32, cache=False, refine_budget=0)
    assert toeplitz.diagonals is not None and toeplitz.n_partial == 0 and toeplitz.n_full == 64


# ------------------------------------------------------------------------------------------------
# trees of interval-shaped masks: uncertain blocks settled from the rows' interval sets
# ------------------------------------------------------------------------------------------------
def test_interval_trees_settle_without_refinement():
    m = bsfa.causal() | ~bsfa.causal()  # == full; partial | partial on the diagonal
    lay = compile_mask(m, 256, 256, 32, cache=False, refine_budget=0)
    assert lay.n_partial == 0 and lay.n_full == 64 and lay.n_refined == 0


def interval_leaves(lq, lk, seed):
    g = torch.Generator().manual_seed(seed)
    ints = st.integers
    n = max(lq, lk)
    runs = torch.sort(torch.randint(0, 6, (lk,), generator=g)).values
    return st.one_of(
        st.just(bsfa.full()), st.just(bsfa.causal()), ints(0, 300).map(bsfa.window),
        ints(1, 300).map(bsfa.sliding_window), ints(1, 300).map(bsfa.chunked), ints(0, 300).map(bsfa.prefix_lm),
        st.tuples(ints(0, n), ints(0, n)).map(lambda t: bsfa.key_range(min(t), max(t))),
        st.tuples(ints(0, n), ints(0, n)).map(lambda t: bsfa.query_range(min(t), max(t))),
        ints(0, 6).map(lambda k: bsfa.query_set(torch.randint(0, n, (k,), generator=g))),
        st.just(bsfa.document(runs)),
        st.just(bsfa.document(torch.randperm(6, generator=g)[runs])),  # one run each, labels unsorted
    )


@st.composite
def interval_problems(draw):
    lq = draw(st.sampled_from([1, 97, 257, 1025]))
    lk = draw(st.sampled_from([1, 97, 257, 1025]))
    bs = draw(st.sampled_from([16, 64, 128, (32, 64), (48, 80), (128, 16)]))
    leaf = interval_leaves(lq, lk, draw(st.integers(0, 3)))
    expr = draw(st.recursive(leaf, lambda sub: st.one_of(
        st.tuples(sub, sub).map(lambda t: t[0] & t[1]),
        st.tuples(sub, sub).map(lambda t: t[0] | t[1]),
        sub.map(lambda x: ~x)), max_leaves=6))
    n_keys = draw(st.integers(0, 40))
    if n_keys:  # key sets beside the tree under a top-level |
        keys = torch.randint(0, lk, (n_keys,), generator=torch.Generator().manual_seed(draw(st.integers(0, 9))))
        expr = bsfa.key_set(keys) | expr
    return expr, lq, lk, bs


def _algebra_and_refinement(mask, q_len, kv_len, bs):
    """Block states the compiler gave before interval sets: the state algebra, every uncertain
    block then evaluated element by element."""
    from blocksparse_fa.compiler.classify import Grid, _classify, refine

    bm, bn = pair(bs)
    grid = Grid(q_len, kv_len, bm, bn)
    segs, _ = _classify(mask, grid, None, sets=False)
    segs, _ = refine(segs.broadcast_to(mask.batch_shape or (1, 1)), mask, grid, 1 << 40)
    return torch.from_numpy(segs.to_dense()).reshape(-1, grid.tr, grid.tc)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(interval_problems())
def test_interval_trees_exact(problem):
    mask, lq, lk, bs = problem
    lay = check_layout(mask, lq, lk, bs, exact=True, refine_budget=0)
    assert lay.n_refined == 0
    assert torch.equal(lay.block_states().reshape(-1, *lay.shape[-2:]), _algebra_and_refinement(mask, lq, lk, bs))


@pytest.mark.parametrize("lq,lk", [(97, 97), (257, 257), (1025, 1025), (257, 1025), (1025, 97)])
@pytest.mark.parametrize("bs", [16, 64, 128, (32, 64), (48, 80)])
def test_shared_prefix_and_global_sets_exact(lq, lk, bs):
    g = torch.Generator().manual_seed(lq + lk)
    lens = torch.randint(20, 200, (lk,), generator=g)
    ids = torch.repeat_interleave(torch.arange(lk), lens)[:lk]
    pos = torch.randint(0, max(lq, lk), (16,), generator=g)
    masks = [bsfa.load_pattern("shared_prefix", prefix=min(60, lk), document=ids),
             bsfa.key_set(pos) | bsfa.query_set(pos) | bsfa.sliding_window(50)]
    for m in masks:
        lay = check_layout(m, lq, lk, bs, exact=True, refine_budget=0)
        assert lay.n_refined == 0
        assert torch.equal(lay.block_states().reshape(-1, *lay.shape[-2:]), _algebra_and_refinement(m, lq, lk, bs))


def test_batch_compositions():
    L = 300
    g = torch.Generator().manual_seed(0)
    ids = torch.sort(torch.randint(0, 4, (2, L), generator=g), 1).values
    dm = bsfa.dense_mask(torch.rand(1, 3, L, L, generator=g) < 0.6)
    for m in [bsfa.document(ids) & dm, bsfa.document(ids) | ~dm & bsfa.causal(), ~bsfa.document(ids) & bsfa.window(40)]:
        lay = check_layout(m, L, L, (64, 32), exact=False)
        assert lay.batch_shape == m.batch_shape
    assert (bsfa.document(ids) & dm).batch_shape == (2, 3)


# ------------------------------------------------------------------------------------------------
# lookup tables
# ------------------------------------------------------------------------------------------------
def csr_lists(ptr: torch.Tensor, idx: torch.Tensor):
    assert ptr.dtype == torch.int32 and idx.dtype == torch.int32
    p = ptr.tolist()
    assert p[0] == 0 and p[-1] == idx.numel()
    assert all(a <= b for a, b in zip(p, p[1:])), "CSR ptr must be monotone"
    out = [idx[p[k]:p[k + 1]].tolist() for k in range(len(p) - 1)]
    assert all(len(set(x)) == len(x) for x in out), "duplicate entries"
    return out


def lut_cells(lut, n_owner):
    full = csr_lists(lut.full_ptr, lut.full_idx)
    part = csr_lists(lut.part_ptr, lut.part_idx)
    assert len(full) == len(part) == n_owner
    f = {(o, x) for o, xs in enumerate(full) for x in xs}
    p = {(o, x) for o, xs in enumerate(part) for x in xs}
    assert not f & p, "a block is listed both full and partial"
    return f, p


def kernel_lut(t):
    """The kernels' view of :class:`SideTables` as an exact LUT: runs expanded to listed indices."""
    from blocksparse_fa.compiler.luts import LUT

    fp = torch.from_numpy(t.full_ptr).long()
    if t.runs:
        lens = fp[1:] - fp[:-1]
        line = torch.repeat_interleave(torch.arange(len(lens)), lens)
        idx = torch.from_numpy(t.full_idx).long()[line] + torch.arange(int(fp[-1]))
    else:
        idx = torch.from_numpy(t.full_idx).long()
    return LUT(fp.int(), idx.int(), torch.from_numpy(t.part_ptr), torch.from_numpy(t.part_idx))


LUT_CASES = [
    (bsfa.causal(), 257, 257, 64),
    (bsfa.load_pattern("bigbird", window=40, n_global=20, block=32), 300, 300, (32, 64)),
    (bsfa.sliding_window(100) & bsfa.causal(), 200, 500, (64, 32)),
    (bsfa.document(torch.tensor([0] * 100 + [1] * 60 + [2] * 97)) & bsfa.causal(), 257, 257, 32),
    (bsfa.document(torch.sort(torch.randint(0, 3, (2, 130)), 1).values) | bsfa.strided(9), 100, 130, (16, 32)),
    (~bsfa.full(), 100, 100, 32),
    (bsfa.full(), 128, 256, 64),
]


@pytest.mark.parametrize("case", range(len(LUT_CASES)))
def test_luts_match_block_states(case):
    mask, lq, lk, bs = LUT_CASES[case]
    lay = compile_mask(mask, lq, lk, bs)
    states = lay.block_states()
    tr, tc = states.shape[-2:]
    st3 = states.reshape(-1, tr, tc)
    z = st3.shape[0]
    rf, rp = lut_cells(lay.row_lut, z * tr)
    want_full = {(zz * tr + r, c) for zz, r, c in torch.nonzero(st3 == 2).tolist()}
    want_part = {(zz * tr + r, c) for zz, r, c in torch.nonzero(st3 == 1).tolist()}
    assert rf == want_full
    assert rp == want_part
    # column tables are the exact transpose
    cf, cp = lut_cells(lay.col_lut, z * tc)
    assert cf == {((o // tr) * tc + c, o % tr) for o, c in want_full}
    assert cp == {((o // tr) * tc + c, o % tr) for o, c in want_part}
    for t in (lay.row_lut.full_ptr, lay.row_lut.part_idx, lay.col_lut.full_idx, lay.col_lut.part_ptr):
        assert t.device.type == "cpu"
    assert lay.lut_bytes == sum(a.nbytes for t in lay.kernel_tables() for a in (t.full_ptr, t.full_idx, t.part_ptr, t.part_idx))
    # the kernels' tables (runs where lines are runs, ragged edges moved) list the same blocks
    g = lay._grid
    krow, kcol = (kernel_lut(t) for t in lay.kernel_tables(col_runs=True))
    assert set().union(*lut_cells(krow, z * tr)) == rf | rp
    assert set().union(*lut_cells(kcol, z * tc)) == cf | cp
    if lq % g.bm == 0 and lk % g.bn == 0:
        assert lut_cells(krow, z * tr) == (rf, rp) and lut_cells(kcol, z * tc) == (cf, cp)
    assert lay.row_lut.max_len() == int((st3 > 0).sum(-1).max()) if st3.numel() else True


@pytest.mark.parametrize("lq,lk,bs", [(257, 300, 64), (256, 300, 64), (257, 256, 64), (256, 256, 64), (100, 70, (32, 16))])
def test_kernel_luts_move_ragged_full_blocks(lq, lk, bs):
    lay = compile_mask(bsfa.full(), lq, lk, bs)
    bm, bn = pair(bs)
    tr, tc = -(-lq // bm), -(-lk // bn)
    krow, kcol = (kernel_lut(t) for t in lay.kernel_tables())
    assert lay.kernel_tables()[0].runs  # one run per row: stored as runs
    rf, rp = lut_cells(krow, tr)
    cf, cp = lut_cells(kcol, tc)
    ef, ep = lut_cells(lay.row_lut, tr)
    assert ep == set() and len(ef) == tr * tc  # the exact tables: everything full
    assert rf | rp == ef  # same blocks, only moved between lists
    assert cf | cp == lut_cells(lay.col_lut, tc)[0]
    if lk % bn:
        assert rp == {(r, tc - 1) for r in range(tr)}
        assert all(c != tc - 1 for _, c in rf)
    else:
        assert rp == set()
    if lq % bm:
        assert cp == {(c, tr - 1) for c in range(tc)}
        assert all(r != tr - 1 for _, r in cf)
    else:
        assert cp == set()
    if not lk % bn and not lq % bm:
        assert (rf, rp) == (ef, ep)


def test_kernel_luts_keep_partial_blocks():
    lay = compile_mask(bsfa.causal(), 100, 100, 32)
    krow, kcol = (kernel_lut(t) for t in lay.kernel_tables(col_runs=True))
    rf, rp = lut_cells(krow, 4)
    ef, ep = lut_cells(lay.row_lut, 4)
    assert ep <= rp and rf <= ef and rf | rp == ef | ep
    assert all(c != 3 for _, c in rf)


# ------------------------------------------------------------------------------------------------
# statistics and views
# ------------------------------------------------------------------------------------------------
STAT_MASKS = [
    bsfa.causal(), bsfa.load_pattern("longformer", window=50, n_global=10), ~bsfa.full(), bsfa.full(),
    bsfa.strided(5) & bsfa.causal(), bsfa.document(torch.sort(torch.randint(0, 5, (2, 333)), 1).values) & bsfa.causal(),
]


@pytest.mark.parametrize("k", range(len(STAT_MASKS)))
def test_statistics_consistent_with_block_states(k):
    m = STAT_MASKS[k]
    lay = compile_mask(m, 333, 333, (64, 32))
    st_ = lay.block_states()
    n_full, n_part = int((st_ == 2).sum()), int((st_ == 1).sum())
    assert lay.n_full == n_full and lay.n_partial == n_part
    assert lay.n_nonempty == n_full + n_part
    assert lay.n_blocks == st_.numel()
    assert lay.density == pytest.approx((n_full + n_part) / st_.numel())
    assert lay.partial_fraction == pytest.approx(n_part / (n_full + n_part) if n_full + n_part else 0.0)
    dense = m.to_dense(333, 333)
    assert lay.element_density() == pytest.approx(dense.double().mean().item(), abs=1e-12)
    assert 0.0 <= lay.partial_fraction <= 1.0 and 0.0 <= lay.density <= 1.0


def test_empty_and_full_layouts():
    lay = compile_mask(~bsfa.full(), 300, 200, 64)
    assert lay.density == 0.0 and lay.partial_fraction == 0.0 and lay.n_nonempty == 0
    assert lay.element_density() == 0.0
    lay = compile_mask(bsfa.full(), 300, 200, 64)
    assert lay.density == 1.0 and lay.n_partial == 0 and lay.element_density() == 1.0


def test_mask_density_shorthand():
    m = bsfa.sliding_window(10) & bsfa.causal()
    assert m.density(200) == pytest.approx(m.to_dense(200).double().mean().item())


def test_cache_hits_and_misses():
    clear_cache()
    m = bsfa.causal() & bsfa.window(64)
    a = compile_mask(m, 500, 500, 64)
    h0 = cache_info()["hits"]
    b = compile_mask(bsfa.parse("causal & window(64)"), 500, 500, 64)
    assert a is b
    assert cache_info()["hits"] == h0 + 1
    assert compile_mask(bsfa.causal() & bsfa.window(65), 500, 500, 64) is not a
    assert compile_mask(m, 500, 501, 64) is not a
    assert compile_mask(m, 500, 500, 32) is not a
    assert compile_mask(m, 500, 500, (64, 32)) is not a
    assert compile_mask(m, 500, 500, (64, 64)) is a  # same block size spelled as a pair
    assert compile_mask(m, 500, 500, 64, cache=False) is not a
    assert compile_mask("causal & window(64)", 500, 500, 64) is a  # DSL text
    ids = torch.tensor([0] * 250 + [1] * 250)
    d1 = compile_mask(bsfa.document(ids), 500, 500, 64)
    assert compile_mask(bsfa.document(ids.clone()), 500, 500, 64) is d1  # by content
    ids2 = ids.clone()
    ids2[0] = 1
    assert compile_mask(bsfa.document(ids2), 500, 500, 64) is not d1
    assert cache_info()["size"] >= 1


def test_mask_tensors_mutated_in_place_do_not_give_stale_layouts():
    L = 128
    ids = torch.tensor([0] * 64 + [1] * 64)
    m = bsfa.document(ids)
    compile_mask(m, L, L, 32)  # cached (and fingerprinted) with the old content
    ids[:] = torch.arange(L) % 2
    assert torch.equal(compile_mask(m, L, L, 32).to_dense(), m.to_dense(L))


def test_compile_validation():
    with pytest.raises(ValueError, match="block_size"):
        compile_mask(bsfa.causal(), 10, 10, 0)
    with pytest.raises(ValueError, match="block_size"):
        compile_mask(bsfa.causal(), 10, 10, (16, 16, 16))
    with pytest.raises(ValueError):
        compile_mask(bsfa.causal(), 0, 10)
    with pytest.raises(ValueError, match="kv_len"):
        compile_mask(bsfa.document(torch.zeros(9, dtype=torch.long)), 10, 10)
    with pytest.raises(TypeError):
        compile_mask(42, 10, 10)
    with pytest.raises(bsfa.MaskSyntaxError):
        compile_mask("causal &", 10, 10)


def test_batch_dependent_layout():
    B, L, bs = 3, 300, 64
    ids = torch.sort(torch.randint(0, 4, (B, L)), 1).values
    m = bsfa.document(ids) & bsfa.causal()
    lay = compile_mask(m, L, L, bs)
    assert lay.batch_shape == (B, 1)
    states = lay.block_states()
    assert states.shape == (B, 1, 5, 5)
    for b in range(B):
        single = compile_mask(bsfa.document(ids[b]) & bsfa.causal(), L, L, bs)
        assert single.block_states().shape == (5, 5)
        assert torch.equal(states[b, 0], single.block_states())
    assert torch.equal(lay.to_dense(), m.to_dense(L))
    # the row LUT holds B * Tr rows
    assert lay.row_lut.full_ptr.numel() == B * 5 + 1 and lay.col_lut.part_ptr.numel() == B * 5 + 1


def test_ascii_picture_of_tiny_causal_layout():
    lay = compile_mask(bsfa.causal(), 64, 64, 16)
    text = str(lay)
    lines = text.splitlines()
    assert lines[-4:] == ["+...", "#+..", "##+.", "###+"]
    assert "density=0.6250" in text and "partial_fraction=0.4000" in text
    assert "full=6" in text and "partial=4" in text
    assert "causal" in lines[0]
    # a big grid is summarised at the requested width
    big = compile_mask(bsfa.causal(), 4096, 4096, 16).ascii(width=16)
    grid = big.splitlines()[-16:]
    assert all(len(r) == 16 for r in grid)
    assert grid[0] == ":" + "." * 15 and grid[-1] == "#" * 15 + ":"  # diagonal cells mix empty and kept blocks
    assert "1 char = 16x16 blocks" in big


def test_plot_writes_png(tmp_path):
    lay = compile_mask(bsfa.load_pattern("bigbird", window=64, n_global=32, block=32), 512, 512, 32)
    path = tmp_path / "layout.png"
    fig = lay.plot(path)
    assert path.exists() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_compile_memory_stays_small_at_one_million_tokens():
    """Compiling a band-shaped mask at 2**20 tokens allocates far less than N×N (numpy tracked)."""
    import tracemalloc

    n = 1 << 20
    tracemalloc.start()
    try:
        lay = compile_mask(bsfa.load_pattern("longformer"), n, n, 128, cache=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lay.density < 0.01
    assert peak < 512 * 2**20, peak


# ------------------------------------------------------------------------------------------------
# strided masks on square blocks: block-Toeplitz layouts, tables from the block diagonals
# ------------------------------------------------------------------------------------------------
def _entries(t, n_lines):
    """Every line's ``(unmasked, masked)`` block lists of kernel tables, whatever their form."""
    out = []
    for line in range(n_lines):
        f0, f1, p0, p1 = t.full_ptr[line], t.full_ptr[line + 1], t.part_ptr[line], t.part_ptr[line + 1]
        full = [t.full_idx[line] + e for e in range(f0, f1)] if t.runs else list(t.full_idx[f0:f1])
        part = ([t.part_idx[1 + line] + e * t.part_step for e in range(p0, p1)] if t.part_step
                else list(t.part_idx[p0:p1]))
        out.append((full, part))
    return out


TOEPLITZ_CASES = [  # mask, lengths, block, align, whether the masked lists are arithmetic progressions
    ("causal & (sliding_window(64) | strided(64))", 512, 512, 16, "bottom_right", True),
    ("causal & (window(40) | strided(64))", 384, 640, 32, "bottom_right", False),  # band blocks off the step
    ("strided(48) & ~causal", 640, 384, 16, "top_left", True),
    ("~strided(32) | window(5)", 256, 512, 16, "top_left", False),
]


@pytest.mark.parametrize("text,lq,lk,b,align,progressions", TOEPLITZ_CASES)
@pytest.mark.parametrize("limit", [0, None], ids=["progressions", "listed"])
def test_strided_layouts_follow_their_block_diagonals(monkeypatch, text, lq, lk, b, align, progressions, limit):
    """A strided mask on square blocks keeps block (r, c) by r - c alone: its exact states and the
    kernels' tables come from one vector of diagonals. The tables equal those built from the
    general classification, entry for entry, with the masked lists stored as arithmetic
    progressions (limit 0) or listed."""
    import blocksparse_fa.compiler.layout as layout_mod
    from blocksparse_fa.compiler.classify import Grid, classify, refine
    from blocksparse_fa.compiler.luts import build_side

    if limit is not None:
        monkeypatch.setattr(layout_mod, "PART_LIST_LIMIT", limit)
    m = bsfa.parse(text)
    lay = compile_mask(m, lq, lk, b, cache=False, align=align)
    assert lay.diagonals is not None
    assert torch.equal(lay.block_states(), exact_states(m.to_dense(lq, lk, align=align), b, b))
    g = Grid(lq, lk, b, b, align)
    segs, _ = refine(classify(m, g), m, g, 1 << 40)
    rows, cols = lay.kernel_tables()
    assert (rows.part_step > 0) == (cols.part_step > 0) == (limit == 0 and progressions)
    want_rows, want_cols = build_side(segs, False), build_side(segs, True, max_listed=layout_mod.COL_LIST_LIMIT)
    assert _entries(rows, lq // b) == _entries(want_rows, lq // b)
    assert _entries(cols, lk // b) == _entries(want_cols, lk // b)
    assert (lay.n_full, lay.n_partial) == (int((segs.to_dense() == 2).sum()), int((segs.to_dense() == 1).sum()))


def test_strided_tables_grow_linearly_with_the_length():
    """Sparse Transformer's strided pattern: its ~N²/(2·s·b) partial blocks made the tables
    quadratic (134 MB and 32 s of CPU at 1M tokens); from the diagonals they grow with the number
    of lines, and take well under a second at 1M tokens."""
    import time

    m = bsfa.load_pattern("sparse_transformer_strided")
    size = {}
    for n in (2**18, 2**20):
        lay = compile_mask(m, n, cache=False)
        t0 = time.process_time()
        size[n] = lay.lut_bytes
        cpu = time.process_time() - t0
    assert lay.n_partial > 16 * 10**6 and lay.kernel_tables()[0].part_step == 2
    assert size[2**20] <= 4.5 * size[2**18] and size[2**20] < 1 << 20, size
    assert cpu < 1.0, cpu
