"""The Gluon kernels' list mode (``compiler/block_lists.py``): the tables, replayed as the kernels
walk them (full steps keep every key, masked steps compare each key with its row's intervals),
must give exactly the mask, for the forward, the dQ and the dK/dV kernel."""

import numpy as np
import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.compiler.block_lists import BLOCK_MASK, HALVES, SKIP_BIT, block_lists

BM = 128


def _intervals(lo, hi, n_iv):
    """``(Z, Lq, 2)`` int64 starts and ends from the tables' int32 / packed int64 form."""
    if n_iv == 1:
        z = np.zeros_like(lo)
        return np.stack([lo, z], -1).astype(np.int64), np.stack([hi, z], -1).astype(np.int64)
    lo, hi = lo.astype(np.int64), hi.astype(np.int64)
    return np.stack([lo & 0xFFFFFFFF, lo >> 32], -1), np.stack([hi & 0xFFFFFFFF, hi >> 32], -1)


def _keep(lo2, hi2, rows, keys):
    """Kept ``(len(rows), len(keys))`` by the rows' intervals."""
    k = keys[None, :, None]
    return ((k >= lo2[rows][:, None, :]) & (k < hi2[rows][:, None, :])).any(-1)


def _replay(t, layout, q_step=64):
    z = t.lo.shape[0]
    lq, lk = layout.q_len, layout.kv_len
    tr, tc = lq // BM, lk // BM
    lo2, hi2 = _intervals(t.lo, t.hi, t.n_intervals)
    fwd = np.zeros((z, lq, lk), bool)
    dq = np.zeros((z, lq, lk), bool)
    dkdv = np.zeros((z, lq, lk), bool)
    seen_f = np.zeros((z, tr), int)
    for a in range(z):
        for p in range(tr):  # forward: (tile, first, e1, e2, n), step 0 always masked
            tile, first, e1, e2, n = t.fwd[(a * tr + p) * 5:(a * tr + p) * 5 + 5]
            assert n >= 1 and 1 <= e1 <= e2 <= n
            seen_f[a, tile] += 1
            rows = np.arange(tile * BM, tile * BM + BM)
            for j in range(n):
                kb = t.fwd[first + j]
                keys = np.arange(kb * BM, kb * BM + BM)
                blk = np.ones((BM, BM), bool) if e1 <= j < e2 else _keep(lo2[a], hi2[a], rows, keys)
                assert not (fwd[a][np.ix_(rows, keys)] & blk).any(), "a block visited twice"
                fwd[a][np.ix_(rows, keys)] |= blk
            first, f0, f1, end = t.dq[(a * tr + p) * 4:(a * tr + p) * 4 + 4]  # dQ, tile order
            rows = np.arange(p * BM, p * BM + BM)
            assert end > first and first <= f0 <= f1 <= end
            for pos in range(first, end):
                kb, bits = t.dq[pos] & BLOCK_MASK, t.dq[pos] >> SKIP_BIT
                assert bits == 0 or not f0 <= pos < f1, "a full block's entry skips a half"
                keys = np.arange(kb * BM, kb * BM + BM)
                blk = np.ones((BM, BM), bool) if f0 <= pos < f1 else _keep(lo2[a], hi2[a], rows, keys)
                for h in range(HALVES):  # a skipped half of the rows keeps nothing here
                    if bits >> h & 1:
                        assert not blk[h * BM // HALVES:(h + 1) * BM // HALVES].any()
                dq[a][np.ix_(rows, keys)] |= blk
        for c in range(tc):  # dK/dV: query blocks of q_step rows
            first, f0, f1, end = t.dkdv[(a * tc + c) * 4:(a * tc + c) * 4 + 4]
            assert end > first
            keys = np.arange(c * BM, c * BM + BM)
            for pos in range(first, end):
                qb, bits = t.dkdv[pos] & BLOCK_MASK, t.dkdv[pos] >> SKIP_BIT
                assert bits == 0 or not f0 <= pos < f1, "a full part's entry skips a half"
                rows = np.arange(qb * q_step, qb * q_step + q_step)
                blk = np.ones((q_step, BM), bool) if f0 <= pos < f1 else _keep(lo2[a], hi2[a], rows, keys)
                for h in range(HALVES):  # a skipped half keeps nothing here: its consumer passes
                    if bits >> h & 1:
                        assert not blk[:, h * BM // HALVES:(h + 1) * BM // HALVES].any()
                assert not (dkdv[a][np.ix_(rows, keys)] & blk).any(), "a part visited twice"
                assert blk.any() or end - first == 1, "a part that keeps nothing visited"
                dkdv[a][np.ix_(rows, keys)] |= blk
        assert sorted(t.dkdv_order[a]) == list(range(tc))
    assert (seen_f == 1).all(), "every row tile once"
    return fwd, dq, dkdv


def test_skip_bits_name_the_halves_that_keep_nothing():
    """Longformer's global keys (0..63) are the first half of key tile 0: every row keeps them and
    no row beyond the window keeps the second half, so that tile's masked parts let the second
    consumer skip; BigBird's window edges give both halves such parts, in the dK/dV table (halves of
    the key tile) and in the dQ table (halves of the row tile)."""
    lay = bsfa.compile_mask(bsfa.load_pattern("longformer"), 4096, 4096, block_size=BM)
    t = block_lists(lay, BM, BM, 64, BM)
    first, f0, f1, end = t.dkdv[:4]
    bits = t.dkdv[first:f0] >> SKIP_BIT
    assert f0 - first > 40 and (bits == 2).mean() > 0.9
    lay = bsfa.compile_mask(bsfa.load_pattern("bigbird"), 4096, 4096, block_size=BM)
    t = block_lists(lay, BM, BM, 64, BM)
    tc = 4096 // BM
    tab = t.dkdv[:tc * 4].reshape(tc, 4)
    masked = np.concatenate([t.dkdv[a:b] for a, b in tab[:, :2]]) >> SKIP_BIT
    assert set(np.unique(masked)) == {0, 1, 2}
    tab = t.dq[:tc * 4].reshape(tc, 4)  # dQ: the rows' halves, at the same window edges
    masked = np.concatenate([t.dq[a:b] for a, b in tab[:, :2]]) >> SKIP_BIT
    assert set(np.unique(masked)) == {0, 1, 2}


def _dense(layout):
    d = layout.to_dense().cpu().numpy().astype(bool)
    return d.reshape(-1, layout.q_len, layout.kv_len)


N = 1024
CASES = {
    "sliding tiles 3-D (full blocks only)": (lambda: bsfa.sliding_tiles((1, 32, 64), (1, 8, 16), (1, 3, 3)), 1),
    "Longformer": (lambda: bsfa.load_pattern("longformer", window=200, n_global=64), 2),
    "causal Longformer": (lambda: bsfa.causal() & (bsfa.sliding_window(300) | bsfa.global_tokens(40)), 2),
    "key_range | causal": (lambda: bsfa.key_range(300, 460) | bsfa.causal(), 2),
    "BigBird": (lambda: bsfa.load_pattern("bigbird", window=150, n_global=128, n_random=2), 1),
    "empty rows and columns": (lambda: bsfa.query_range(200, 700) & bsfa.key_range(128, 600) & bsfa.causal(), 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_lists_replay_the_mask(name):
    make, n_iv = CASES[name]
    n = 2048 if name.startswith("sliding tiles") else N
    layout = bsfa.compile_mask(make(), n, n, block_size=BM)
    t = block_lists(layout, BM, BM, 64, BM)
    assert t is not None and t.n_intervals == n_iv
    assert t.lo.dtype == (np.int32 if n_iv == 1 else np.int64)
    want = _dense(layout)
    assert t.mean_keys == (layout.block_states() > 0).sum().item() / layout.n_rows * BM
    fwd, dq, dkdv = _replay(t, layout)
    np.testing.assert_array_equal(fwd, want)
    np.testing.assert_array_equal(dq, want)
    np.testing.assert_array_equal(dkdv, want)


@pytest.mark.parametrize("name", ["Longformer", "causal Longformer", "BigBird"])
def test_column_work_counts_each_key_tiles_steps(name):
    """``select.list_column_work`` (``list_work``): per key tile its 64-row steps, masked ones at
    ``LIST_MASKED_STEP_COST``, counted again from the mask's 64 × 128 parts (a part that keeps
    every key is a full step, one that keeps none no step, a masked one where a 64-key half keeps
    nothing ``LIST_HALF_STEP_COST``); Longformer's global key tile is the longest."""
    from blocksparse_fa.ops import select

    layout = bsfa.compile_mask(CASES[name][0](), N, N, block_size=BM)
    longest, mean = select.list_column_work(block_lists(layout, BM, BM, 64, BM))
    st = layout.block_states().cpu().numpy().reshape(N // BM, N // BM)
    halves = _dense(layout)[0].reshape(N // 64, 64, N // BM, 2, BM // 2).sum((1, 4))
    kept = halves.sum(2)
    full, masked = kept == 64 * BM, (kept > 0) & (kept < 64 * BM)
    passing = masked & (halves == 0).any(2)  # one consumer keeps nothing of the part
    work = (full.sum(0) + select.LIST_MASKED_STEP_COST * (masked & ~passing).sum(0)
            + select.LIST_HALF_STEP_COST * passing.sum(0))
    work = np.where(work == 0, select.LIST_MASKED_STEP_COST, work)  # an empty column walks one part
    per_block = 2 * ((st == 2).sum(0) + select.LIST_MASKED_STEP_COST * (st == 1).sum(0))
    assert work.sum() < per_block.sum()  # the window's edge blocks hold full or empty parts
    assert longest == work.max() and mean == pytest.approx(work.mean())
    if name == "Longformer":  # the global keys' tile
        assert work.argmax() == 0
    if name == "BigBird":  # its default window (192 keys each side): a quarter of the masked steps go
        default = bsfa.compile_mask(bsfa.load_pattern("bigbird"), 4096, 4096, block_size=BM)
        d = select.list_work(block_lists(default, BM, BM, 64, BM), "dkdv").sum()
        st4 = default.block_states().cpu().numpy().reshape(4096 // BM, 4096 // BM)
        assert d < 0.85 * 2 * ((st4 == 2).sum() + select.LIST_MASKED_STEP_COST * (st4 == 1).sum())
    # the dQ kernel's row tiles (one 128-key step per block) and the forward's table rows, the
    # same tiles heaviest first; a tile with no block still runs one masked step, and the forward
    # masks the first step of a tile of full blocks only
    bl = block_lists(layout, BM, BM, 64, BM)
    cost = select.LIST_MASKED_STEP_COST
    full, part = (st == 2).sum(1), (st == 1).sum(1)
    row_halves = _dense(layout)[0].reshape(N // BM, 2, BM // 2, N // BM, BM).sum((2, 4))  # (tile, half, block)
    passing = ((st == 1) & (row_halves == 0).any(1)).sum(1)  # a half of the rows keeps nothing of the block
    rows = np.where(full + part == 0, cost, full + cost * (part - passing) + select.LIST_HALF_STEP_COST * passing)
    np.testing.assert_allclose(select.list_work(bl, "dq")[0], rows)
    fwd = np.where(full + part == 0, cost, full + part + (cost - 1) * np.maximum(part, 1))
    np.testing.assert_allclose(np.sort(select.list_work(bl, "forward")[0]), np.sort(fwd))


def test_fewer_queries_than_keys():
    """``Lq < Lk`` (bottom-right aligned: the queries are the last ``Lq`` positions)."""
    layout = bsfa.compile_mask(bsfa.causal() & (bsfa.sliding_window(300) | bsfa.global_tokens(40)), 1024, 2048,
                               block_size=BM)
    t = block_lists(layout, BM, BM, 64, BM)
    assert t is not None and t.lo.shape == (1, 1024)
    for got in _replay(t, layout):
        np.testing.assert_array_equal(got, _dense(layout))


def test_per_batch_layouts_and_refusals():
    lens = torch.tensor([700, 1024, 384])
    layout = bsfa.compile_mask(bsfa.load_pattern("padded_batch", length=bsfa.per_batch(lens)), N, N, block_size=BM)
    t = block_lists(layout, BM, BM, 64, BM)
    assert t is not None and t.lo.shape == (3, N)
    for got in _replay(t, layout):
        np.testing.assert_array_equal(got, _dense(layout))
    # three runs per row inside partial blocks; blocks that do not match the tiles; heads that differ
    strided = bsfa.compile_mask(bsfa.strided(100) & bsfa.causal(), N, N, block_size=BM)
    assert block_lists(strided, BM, BM, 64, BM) is None
    small = bsfa.compile_mask(bsfa.causal(), N, N, block_size=64)
    assert block_lists(small, BM, BM, 64, BM) is None
    per_head = bsfa.causal() & bsfa.sliding_window(bsfa.per_head(torch.tensor([100, 300])))
    assert block_lists(bsfa.compile_mask(per_head, N, N, block_size=BM), BM, BM, 64, BM) is None


def test_a_wrong_interval_fails_the_replay():
    layout = bsfa.compile_mask(bsfa.causal() & (bsfa.sliding_window(300) | bsfa.global_tokens(40)), N, N,
                               block_size=BM)
    t = block_lists(layout, BM, BM, 64, BM)
    lo = t.lo.copy()
    lo[0, 700] += 1 << 32  # the row's second interval starts one key later
    bad = type(t)(lo, t.hi, t.fwd, t.dq, t.dkdv, t.dkdv_order, t.n_intervals, t.mean_keys)
    fwd, _, _ = _replay(bad, layout)
    assert (fwd != _dense(layout)).sum() == 1


def test_the_lists_budget(monkeypatch):
    """``select.block_lists_of`` builds the lists on CUDA layouts (or when asked for any device),
    within its budgets of grid blocks and partial blocks, and caches them on the layout."""
    from blocksparse_fa.ops import select

    layout = bsfa.compile_mask(bsfa.causal() & (bsfa.sliding_window(300) | bsfa.global_tokens(40)), N, N,
                               block_size=BM)
    assert select.block_lists_of(layout) is None  # a CPU layout
    monkeypatch.setattr(select, "BLOCK_LISTS_MAX_BLOCKS", layout.n_blocks - 1)
    assert select.block_lists_of(layout, any_device=True) is None
    layout.cache.pop("block_lists")
    monkeypatch.setattr(select, "BLOCK_LISTS_MAX_BLOCKS", layout.n_blocks)
    t = select.block_lists_of(layout, any_device=True)
    assert t is not None and select.block_lists_of(layout, any_device=True) is t
    layout.cache.pop("block_lists")
    monkeypatch.setattr(select, "BLOCK_LISTS_MAX_PARTIAL_PER_ROW", 0)
    assert select.block_lists_of(layout, any_device=True) is None


def _snake(t, grid, n):
    """``forward_gluon._item_tile``'s snake over ``n`` items on ``grid`` programs (an involution)."""
    sweep = t // grid
    return np.where((sweep % 2 == 1) & ((sweep + 1) * grid <= n), sweep * grid + grid - 1 - t % grid, t)


@pytest.mark.parametrize("grid", [8, 13])
def test_the_deal_table_balances_heavy_key_tiles(grid):
    """``triton_backend._deal_table``: Longformer's global key tile is one dK/dV item per head;
    dealing every grid-th item leaves the programs that draw one far behind. The table, read as the
    kernel reads it (``forward_gluon._dealt``, then the snake of ``_item_tile``), runs every item
    exactly once and shortens the most loaded program's work; equal tiles get no table."""
    from blocksparse_fa.ops import select
    from blocksparse_fa.ops import triton_backend as tb

    n, heads = 2048, 4  # 100 global keys: both halves of their tile keep some of every row (no pass)
    layout = bsfa.compile_mask(bsfa.load_pattern("longformer", window=200, n_global=100), n, n, block_size=BM)
    bl = block_lists(layout, BM, BM, 64, BM)
    work = select.list_work(bl, "dkdv")
    table = tb._deal_table(layout, work, bl.dkdv_order, 1, heads, 0, 0, grid, torch.device("cpu"))
    assert table is not None and tb._deal_table(layout, work, bl.dkdv_order, 1, heads, 0, 0, grid,
                                                torch.device("cpu")) is table  # cached
    table = table.numpy()
    width, counts = table[0], table[1:1 + grid]
    items = table[1 + grid:].reshape(grid, width)
    n_items = heads * (n // BM)
    got = np.concatenate([_snake(items[p, :counts[p]], grid, n_items) for p in range(grid)])
    assert sorted(got.tolist()) == list(range(n_items))
    wt = work[0][bl.dkdv_order[0]][np.arange(n_items) // heads]  # item t: the (t // BH)-th heaviest tile
    dealt = max(wt[_snake(items[p, :counts[p]], grid, n_items)].sum() for p in range(grid))
    every = max(wt[_snake(np.arange(p, n_items, grid), grid, n_items)].sum() for p in range(grid))
    assert dealt <= (1 - tb.DEAL_MIN_GAIN) * every
    for p in range(grid):  # each program's items in canonical order: heaviest first
        t = _snake(items[p, :counts[p]], grid, n_items)
        assert (np.diff(t) > 0).all()
    flat = np.ones_like(work)
    assert tb._deal_table(layout, flat, bl.dkdv_order, 1, heads, 0, 0, grid, torch.device("cpu")) is None
    assert tb._deal_table(layout, None, bl.dkdv_order, 1, heads, 0, 0, grid, torch.device("cpu")) is None
