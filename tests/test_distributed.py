"""Context parallelism (blocksparse_fa.distributed).

Single process: shard layouts are exactly rows of the global computation (CPU backend, float64),
plans (balance, split rows, bytes), sharding helpers, the float32 merge. Several processes (gloo on
CPU, 2 and 4 ranks; ``tests/distributed_cases.py``): forward, logsumexp and all three gradients
equal to the single-process run for every pattern, and inconsistent calls raise the same error on
every rank instead of hanging. Every process and collective runs under a timeout.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.compiler.shard import shard_layout
from blocksparse_fa.distributed import plan_context_parallel
from blocksparse_fa.ops import dispatch
from blocksparse_fa.ops.merge import merge_attention
from blocksparse_fa.ops.validate import Shapes

import distributed_cases
from spawn_ranks import run_ranks

torch_dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(not torch_dist.is_available(), reason="torch.distributed is not available")

PROCESS_TIMEOUT = 150  # seconds for a whole multi-process run


# ------------------------------------------------------------------------------------------------
# shard layouts (single process)
# ------------------------------------------------------------------------------------------------
def _ids(n, lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:n]


SHARD_MASKS = {
    "causal": bsfa.causal(),
    "window": bsfa.parse("causal & window(9)"),
    "longformer": bsfa.load_pattern("longformer", window=10, n_global=5),
    "documents": bsfa.causal() & bsfa.document(_ids(70, [13, 30, 2, 25])),
    "unsorted ids": bsfa.document(torch.tensor(np.random.default_rng(0).integers(0, 3, 70))),
    "random": bsfa.random_blocks(2, block_size=16, seed=3) | bsfa.window(3),
    "dense_mask": bsfa.dense_mask(torch.from_numpy(np.random.default_rng(1).random((70, 70)) > 0.6)),
    "block_mask": bsfa.block_mask(torch.from_numpy(np.random.default_rng(2).random((5, 5)) > 0.5), block_size=16)
    | bsfa.window(3),
}


def _shard_vs_full(layout, rows, cols, limit=None, dropout_p=0.0, backend="torch", dtype=torch.float64, H=2, Hkv=2,
                   opts=None):
    """Max errors of a shard's forward / dq / dk / dv against the rows of the full computation."""
    L, D = layout.q_len, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, L, D, generator=g, dtype=dtype)
    k, v = (torch.randn(1, Hkv, L, D, generator=g, dtype=dtype) for _ in range(2))
    sh = shard_layout(layout, rows, cols, limit_rows=None if limit is None else limit[0],
                      limit_cols=None if limit is None else limit[1])
    bm, bn = layout.block_size
    gi = torch.from_numpy(sh.positions.rows(np.arange(sh.q_len), bm))
    gj = torch.from_numpy(sh.positions.keys(np.arange(sh.kv_len), bn))
    # the full computation over the shard's blocks: a dense mask of exactly the kept pairs
    keep = torch.zeros(L, L, dtype=torch.bool)
    keep[gi[:, None], gj[None, :]] = sh.to_dense()
    full = bsfa.compile_mask(bsfa.dense_mask(keep), L, L, block_size=(bm, bn))
    s = Shapes(1, H, Hkv, L, L, D)
    kw = {} if opts is None else {"opts": opts}
    out, lse = dispatch.forward(q, k, v, full, s, 0.3, dropout_p, 11, backend, **kw)
    do = torch.randn(out.shape, generator=g, dtype=dtype)
    do_rows = torch.zeros_like(do)
    do_rows[:, :, gi] = do[:, :, gi]
    dq, dk, dv = dispatch.backward(q, k, v, out, lse, do_rows, full, s, 0.3, dropout_p, 11, backend, **kw)
    ss = Shapes(1, H, Hkv, sh.q_len, sh.kv_len, D)
    ql, kl, vl = q[:, :, gi], k[:, :, gj], v[:, :, gj]
    o2, l2 = dispatch.forward(ql, kl, vl, sh, ss, 0.3, dropout_p, 11, backend, **kw)
    g2 = dispatch.backward(ql, kl, vl, o2, l2, do[:, :, gi], sh, ss, 0.3, dropout_p, 11, backend, **kw)
    fin = torch.isfinite(lse[:, :, gi])
    assert torch.equal(torch.isfinite(l2), fin)
    return [(a - b).abs().max().item() for a, b in
            ((o2, out[:, :, gi]), (l2[fin], lse[:, :, gi][fin]), (g2[0], dq[:, :, gi]), (g2[1], dk[:, :, gj]),
             (g2[2], dv[:, :, gj]))]


@pytest.mark.parametrize("name", list(SHARD_MASKS))
def test_shard_is_rows_of_full_computation(name):
    layout = bsfa.compile_mask(SHARD_MASKS[name], 70, 70, block_size=16, rewrite=False)
    st = layout.block_states().numpy().reshape(-1, 5, 5)
    for rows in ([1, 2], [0, 4], [3, 0, 2]):  # ragged last block, unsorted rows
        rows = np.array(rows)
        cols = np.nonzero(st[:, rows].any(axis=(0, 1)))[0]
        errs = _shard_vs_full(layout, rows, cols)
        assert max(errs) < 1e-12, (rows, errs)
    # fewer columns than the rows visit: the shard computes exactly the kept blocks
    assert max(_shard_vs_full(layout, rows, cols[1:] if len(cols) > 1 else cols)) < 1e-12


def test_shard_limits_rows_and_keeps_dropout():
    layout = bsfa.compile_mask(bsfa.load_pattern("longformer", window=10, n_global=5), 70, 70, block_size=16)
    rows, cols = np.array([0, 1, 3]), np.arange(5)
    limit = (np.array([True, False, False]), np.array([3, 4]))
    assert max(_shard_vs_full(layout, rows, cols, limit)) < 1e-12
    assert max(_shard_vs_full(layout, rows, cols, limit, dropout_p=0.3, H=4, Hkv=2)) < 1e-12


def test_shard_keeps_runs_and_checks_blocks():
    layout = bsfa.compile_mask(bsfa.causal() & bsfa.sliding_window(40), 200, 200, block_size=16)
    sh = shard_layout(layout, np.arange(6, 13), np.arange(3, 13))
    rows, _ = sh.kernel_tables()
    assert rows.runs and sh.q_offset == 0 and sh.q_len == 7 * 16 - 8  # 200 = 12.5 blocks
    assert sh.positions.q_start[0] == 96 and sh.positions.k_start[-1] == 192
    with pytest.raises(ValueError, match="ragged last block"):
        shard_layout(layout, [12, 3], [0])
    with pytest.raises(ValueError, match="distinct"):
        shard_layout(layout, [1, 1], [0])
    with pytest.raises(ValueError, match=r"\[0, 13\)"):
        shard_layout(layout, [13], [0])


def test_dropout_keep_mask_of_a_shard_is_a_slice():
    full = bsfa.dropout_keep_mask(2, 3, 40, 50, 0.4, 77)
    rows, keys = np.array([5, 17, 39]), np.array([0, 49, 20, 21])
    part = bsfa.dropout_keep_mask(2, 3, 3, 4, 0.4, 77, rows=rows, keys=keys)
    assert torch.equal(part, full[:, :, rows][:, :, :, keys])


def test_merge_accumulates_in_float32():
    g = torch.Generator().manual_seed(0)
    n = 8
    outs = [torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64) for _ in range(n)]
    lses = [torch.randn(1, 2, 64, generator=g, dtype=torch.float64) for _ in range(n)]
    ref, _ = merge_attention(list(zip(outs, lses)))
    got, lse = merge_attention([(o.bfloat16(), l.float()) for o, l in zip(outs, lses)])
    assert got.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # one rounding of the result: the error of rounding the exact merge of the rounded parts
    exact, _ = merge_attention([(o.bfloat16().double(), l.float().double()) for o, l in zip(outs, lses)])
    assert torch.equal(got, exact.bfloat16())
    assert (got.double() - ref).abs().max() < 0.02


@pytest.mark.interpreter
@pytest.mark.parametrize("name,limit,dropout_p", [("longformer", True, 0.3), ("documents", False, 0.0),
                                                   ("dense_mask", False, 0.0)])
def test_kernels_position_tables(name, limit, dropout_p):
    """The Triton kernels (interpreter) on a shard: ``QPOS``/``KPOS`` give the predicate, the
    document ids and the dropout counters global positions; bounds stay local (ragged last block)."""
    layout = bsfa.compile_mask(SHARD_MASKS[name], 70, 70, block_size=16, rewrite=False)
    rows, cols = np.array([0, 2, 4]), np.array([0, 1, 2, 3, 4])
    lim = (np.array([True, False, False]), np.array([0, 3, 4])) if limit else None
    errs = _shard_vs_full(layout, rows, cols, lim, dropout_p=dropout_p, backend="triton", dtype=torch.float32,
                          H=2, Hkv=1)
    assert max(errs) < 1e-5, errs


@pytest.mark.interpreter
def test_kernels_float32_outputs_for_merges():
    """``out_dtype``/``grad_dtype`` float32 from bfloat16 inputs: the unrounded results."""
    layout = bsfa.compile_mask("causal & window(20)", 48, 48, block_size=16)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 48, 16, generator=g).bfloat16() for _ in range(4))
    s = Shapes(1, 2, 2, 48, 48, 16)
    o32, lse = dispatch.forward(q, k, v, layout, s, 0.25, 0.0, 0, "triton", out_dtype=torch.float32)
    o16, _ = dispatch.forward(q, k, v, layout, s, 0.25, 0.0, 0, "triton")
    grads = dispatch.backward(q, k, v, o16, lse, do, layout, s, 0.25, 0.0, 0, "triton", grad_dtype=torch.float32)
    ref = dispatch.backward(q, k, v, o16, lse, do, layout, s, 0.25, 0.0, 0, "triton")
    for a, b in ((o32, o16), *zip(grads, ref)):  # the same values, before rounding to bfloat16
        assert a.dtype == torch.float32 and b.dtype == torch.bfloat16
        assert torch.allclose(a, b.float(), rtol=2 ** -7, atol=1e-5)
        assert not torch.equal(a, a.bfloat16().float())
    # per tensor: dQ in the inputs' dtype, dK/dV in float32 (the sums over ranks)
    mixed = dispatch.backward(q, k, v, o16, lse, do, layout, s, 0.25, 0.0, 0, "triton",
                              grad_dtype=(None, torch.float32, torch.float32))
    assert [t.dtype for t in mixed] == [torch.bfloat16, torch.float32, torch.float32]
    assert torch.equal(mixed[0], ref[0]) and torch.equal(mixed[1], grads[1]) and torch.equal(mixed[2], grads[2])


# ------------------------------------------------------------------------------------------------
# plans (single process)
# ------------------------------------------------------------------------------------------------
def test_plan_causal_is_zigzag_and_balanced():
    plan = plan_context_parallel("causal", 1 << 14, 4, heads=(8, 4))
    assert plan.strategy == "zigzag"
    est = plan.candidates["zigzag"]
    assert est["imbalance"] < 1.01 and est["tokens_max"] == est["tokens_min"] == 1 << 12
    assert "zigzag" in plan.describe() and "ulysses" in plan.describe()


@pytest.mark.parametrize("pattern", ["sliding_window", "longformer", "document_causal"])
def test_plan_sparse_patterns_move_little(pattern):
    n = 1 << 17
    docs = np.random.default_rng(0).integers(500, 12000, 40)  # packed documents of 0.5K-12K tokens
    kw = {"document": _ids(n, list(docs))} if pattern == "document_causal" else {}
    plan = plan_context_parallel(bsfa.load_pattern(pattern, **kw), n, 2, heads=(8, 2), strategy="auto")
    per = plan.bytes_per_rank()
    sent = max(p["fwd"] + p["bwd"] for p in per)
    assert sent <= 0.05 * max(p["ring_fwd"] + p["ring_bwd"] for p in per), plan.describe()
    assert plan.estimate()["imbalance"] < 1.05, plan.describe()
    if pattern == "longformer":  # the global rows are split, so no rank fetches every key block
        assert len(plan.split) == 1 and all(p["kv_blocks_fetched"] < 8 for p in per)


def test_plan_indices_shard_unshard_and_errors():
    plan = plan_context_parallel("causal & window(50)", 1000, 3, block_size=16, strategy="zigzag", heads=(3, 3))
    perm = plan.permutation()
    assert torch.equal(perm.sort().values, torch.arange(1000))
    x = torch.randn(2, 1000, 3)
    shards = [plan.shard(x, 1, r) for r in range(3)]
    assert [s.shape[1] for s in shards] == [plan.local_len(r) for r in range(3)]
    assert torch.equal(plan.unshard(shards, 1), x)
    assert torch.equal(torch.cat(shards, 1)[:, plan.restore_indices()], x)
    with pytest.raises(ValueError, match="plan is for 1000"):
        plan.shard(x[:, :999], 1, 0)
    given = plan_context_parallel("causal", 100, 2, block_size=16, shard_lengths=[48, 52])
    assert given.strategy == "given" and given.local_len(0) == 48
    with pytest.raises(ValueError, match="multiple of 16"):
        plan_context_parallel("causal", 100, 2, block_size=16, shard_lengths=[50, 50])
    with pytest.raises(ValueError, match="self-attention"):
        plan_context_parallel(bsfa.compile_mask("causal", 64, 80, block_size=16), 64, 2)
    with pytest.raises(ValueError, match="ulysses"):
        plan_context_parallel("causal", 1024, 4, strategy="ulysses", heads=(6, 2))


def test_plan_ulysses_for_strided():
    # strided keeps few elements of almost every causal block; the rewrite makes it cheap under Ulysses
    plan = plan_context_parallel(bsfa.load_pattern("sparse_transformer_strided"), 1 << 17, 2, heads=(8, 2))
    assert plan.strategy == "ulysses"
    assert plan.candidates["ulysses"]["time"] < 0.2 * plan.candidates["zigzag"]["time"]


# ------------------------------------------------------------------------------------------------
# a rank's launches and messages (single process)
# ------------------------------------------------------------------------------------------------
def _exchanges(mask, n, world, **kw):
    from blocksparse_fa.distributed.exchange import Exchange

    plan = plan_context_parallel(mask, n, world, block_size=16, heads=(4, 2), head_dim=8, **kw)
    return plan, [Exchange(plan, r, "cpu") for r in range(world)]


def _interval_dense(shard):
    from blocksparse_fa.compiler.intervals import row_interval

    lo, hi = row_interval(shard)
    j = torch.arange(shard.kv_len)
    return (j >= torch.from_numpy(lo).long()[..., None]) & (j < torch.from_numpy(hi).long()[..., None])


@pytest.mark.parametrize("name,mask,strategy", [
    ("causal", "causal", "zigzag"), ("window", "causal & sliding_window(40)", "contiguous"),
    ("documents", bsfa.causal() & bsfa.document(_ids(300, [37, 90, 3, 61, 109])), "greedy"),
    ("documents per batch", bsfa.causal() & bsfa.document(torch.stack([_ids(300, [100, 200]), _ids(300, [30, 270])])),
     "zigzag")])
def test_interval_tables_of_shards_are_their_masks(name, mask, strategy):
    """Every part of a one-interval-per-row mask gets its rows' key intervals in its own key
    coordinates (the interval kernels' tables): exactly the shard's kept elements."""
    from blocksparse_fa.ops.select import layout_class

    plan, exs = _exchanges(mask, 300, 3, strategy=strategy)
    for ex in exs:
        for shard in (ex.main, ex.local, ex.remote):
            if shard is None:
                continue
            assert layout_class(shard).kind == "interval"
            dense = shard.to_dense().reshape(-1, shard.q_len, shard.kv_len)
            got = _interval_dense(shard)
            assert torch.equal(got.expand_as(dense), dense), (name, ex.rank)


@pytest.mark.parametrize("mask,strategy,world", [("causal", "zigzag", 4), ("causal", "greedy", 3),
                                                 ("causal", "contiguous", 2), ("full", "zigzag", 3)])
def test_rectangles_tile_the_shard(mask, strategy, world):
    """The dense and causal rectangles of ``causal()`` and the dense mask cover every kept element of
    the rank's rows exactly once, over the one buffer and over own plus fetched keys."""
    m = bsfa.causal() if mask == "causal" else bsfa.full()
    plan, exs = _exchanges(m, 200, world, strategy=strategy)
    for ex in exs:
        assert ex.rectangles
        dense = ex.main.to_dense().int()  # (L, Lbuf)
        own_tok = plan.indices(ex.rank).numpy()
        buf = np.union1d(own_tok, np.concatenate([np.arange(c * 16, min(c * 16 + 16, 200))
                                                  for c in plan._ranks[ex.rank].remote_cols] or [np.zeros(0, int)]))
        rem = np.setdiff1d(buf, own_tok)
        to_buf = {"buf": np.arange(len(buf)), "own": np.searchsorted(buf, own_tok), "rem": np.searchsorted(buf, rem)}
        for key in ("main", "overlap"):
            cover = torch.zeros_like(dense)
            for part in ex.bwd_parts[key]:
                r0, r1 = part.rows or (0, ex.length)
                a, b = part.span or (0, {"buf": len(buf), "own": len(own_tok), "rem": len(rem)}[part.keys])
                cols = torch.from_numpy(to_buf[part.keys][a:b])
                cover[r0:r1, cols] += part.layout.to_dense().int()
            assert torch.equal(cover, dense), (mask, strategy, ex.rank, key)
        if mask == "causal":
            assert {p.layout.mask.__class__.__name__ for p in ex.bwd_parts["main"]} <= {"Causal", "Full"}


@pytest.mark.parametrize("mask", ["causal & sliding_window(20)", "documents"])
def test_halo_launches_cover_the_rows_that_reach_fetched_keys(mask):
    """Overlapped, a halo mask's fetched keys run in launches over the runs of rows that reach them
    (not over every row): together with the own-key launch they cover every kept element of the
    rank's rows exactly once, and the planner counts the same rows."""
    n = 640 if mask == "documents" else 320
    m = _doc_mask(n, [60] * 10 + [40]) if mask == "documents" else mask
    plan, exs = _exchanges(m, n, 4, strategy="contiguous")
    cut = 0
    for ex in exs:
        rk = plan._ranks[ex.rank]
        dense = ex.main.to_dense().int()  # (L, Lbuf)
        own_tok = plan.indices(ex.rank).numpy()
        buf = np.union1d(own_tok, np.concatenate([np.arange(c * 16, min(c * 16 + 16, n)) for c in rk.remote_cols]
                                                 or [np.zeros(0, int)]))
        to_buf = {"own": np.searchsorted(buf, own_tok), "rem": np.searchsorted(buf, np.setdiff1d(buf, own_tok))}
        cover = torch.zeros_like(dense)
        remote = [p for p in ex.fwd_parts["overlap"] if p.remote]
        for part in ex.fwd_parts["overlap"]:
            r0, r1 = part.rows or (0, ex.length)
            cover[r0:r1, torch.from_numpy(to_buf[part.keys])] += part.layout.to_dense().int()
        assert torch.equal(cover, dense), ex.rank
        assert [p.rows for p in ex.bwd_parts["overlap"] if p.remote] == [p.rows for p in remote]
        if len(rk.remote_cols):
            assert all(p.rows is not None for p in remote)
            assert ex.remote_rows == rk.remote_rows < ex.length and len(remote) == rk.remote_runs
            cut += 1
    assert cut >= 2


def test_messages_pair_up_and_pack_many_runs():
    """Both sides of every pair list the same messages (sizes and tags, in order); pairs with more
    than MAX_RUNS runs travel packed; the gradients' return mirrors the fetch."""
    from blocksparse_fa.distributed.exchange import MAX_RUNS

    mask = bsfa.causal() & (bsfa.window(12) | bsfa.random_blocks(3, block_size=16, seed=1))
    plan, exs = _exchanges(mask, 600, 4, strategy="greedy")
    packed = 0
    for ex in exs:
        f = ex.fetch
        packed += len(f.send_packed)
        for p, other in enumerate(exs):
            if p == ex.rank:
                continue
            sent = [(b - a, tag) for q, a, b, tag in f.send_all_own if q == p]
            got = [(b - a, tag) for q, a, b, tag in other.fetch.recv_buf + other.fetch.recv_packed if q == ex.rank]
            assert sent == got, (ex.rank, p)
            assert len(sent) <= MAX_RUNS
        assert ex.ret_send_n == [len(np.concatenate(
            [np.arange(c * 16, c * 16 + 16) for c in plan._ranks[ex.rank].kv_from[p]] or [np.zeros(0)]))
            for p in range(4)]
        assert [e.ret_recv_n[ex.rank] for e in exs] == ex.ret_send_n
    assert packed > 0


def test_returned_gradients_land_on_own_rows_of_the_buffer():
    """The positions where returned dK/dV parts are added in buffer coordinates (zigzag: own tokens
    in two runs of the buffer) are the buffer rows of the same own tokens, and the own rows copied
    run by run give back the own-coordinate tensor."""
    from blocksparse_fa.distributed.attention import _MAX_RUN_COPIES, _own_rows

    mask = bsfa.causal() & (bsfa.window(24) | bsfa.global_tokens(16) | bsfa.random_blocks(2, block_size=16, seed=3))
    plan, exs = _exchanges(mask, 512, 4, strategy="zigzag")
    seen = 0
    for ex in exs:
        own_to_buf = torch.empty(ex.length, dtype=torch.int64)
        for b0, l0, n in ex.own_runs:
            own_to_buf[l0:l0 + n] = torch.arange(b0, b0 + n)
        assert torch.equal(ex.ret_recv_buf, own_to_buf[ex.ret_recv_pos])
        g = torch.randn(1, 2, ex.buf_len, 8, dtype=torch.float64)
        got = _own_rows(ex, g, torch.float32)
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert torch.equal(got, g[:, :, own_to_buf].float())
        seen += 1 < len(ex.own_runs) <= _MAX_RUN_COPIES and sum(ex.ret_recv_n) > 0
    assert seen  # the run-by-run path is reached by this plan


def test_plan_targets_balance_and_overlap():
    """The planner at 256K tokens on 4 and 8 ranks: zigzag balances causal exactly; sliding window,
    Longformer and documents stay contiguous and move little; the fetch is overlapped for causal
    (rectangles) only: not where the fetched keys reach every row (Longformer's and BigBird's
    global tokens: measured slower on 4 x H100), nor where they reach a halo of rows (sliding
    window, documents: the plain call measured 6-7 % faster on 4 x H200, medians)."""
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import context_parallel as cpb

    n = 262144
    masks = cpb.lead_masks(n)
    for world in (4, 8):
        plans = {k: plan_context_parallel(masks[k], n, world, heads=(8, 2), head_dim=128) for k in cpb.LEAD}
        assert plans["causal"].candidates["zigzag"]["imbalance"] < 1.0001
        for k in ("sliding_window", "longformer", "documents"):
            assert plans[k].strategy == "contiguous", (k, world)
            assert plans[k].candidates["contiguous"]["imbalance"] < 1.02
        for k in ("sliding_window", "longformer", "bigbird", "documents"):
            assert not plans[k].overlap_auto, (k, world)
        if world == 4:
            assert plans["causal"].strategy == "zigzag" and plans["causal"].overlap_auto


# ------------------------------------------------------------------------------------------------
# several processes (gloo)
# ------------------------------------------------------------------------------------------------
def _run(world, cases, tmp_path):
    return run_ranks(distributed_cases.worker, world, cases, str(tmp_path / f"store{world}"), PROCESS_TIMEOUT)


def _doc_mask(n, lengths):
    return bsfa.causal() & bsfa.document(_ids(n, lengths))


LONGFORMER = "window(12) | global_tokens(10)"
BIGBIRD = bsfa.load_pattern("bigbird", window=12, n_global=16, n_random=2, block=16)
STRIDED = "causal & (sliding_window(16) | strided(16))"

RANDOM = bsfa.causal() & (bsfa.window(12) | bsfa.random_blocks(3, block_size=16, seed=1))

CASES_2 = [
    dict(name="causal", mask="causal", N=200, exact_forward=True, float64_reference=True),
    dict(name="causal overlap", mask="causal", N=200, overlap=True),
    dict(name="causal greedy (many rectangles), overlap", mask="causal", N=232, strategy="greedy", overlap=True),
    dict(name="dense mask (rectangles)", mask=bsfa.full(), N=200, float64_reference=True),
    dict(name="dense mask overlap", mask=bsfa.full(), N=200, overlap=True, H=4, Hkv=1),
    dict(name="sliding window", mask="causal & sliding_window(20)", N=200, exact_forward=True),
    dict(name="longformer split rows", mask=LONGFORMER, N=200, split=1.5, H=4, Hkv=2, float64_reference=True),
    dict(name="longformer split overlap", mask=LONGFORMER, N=200, split=1.5, overlap=True, lse_grad=True),
    dict(name="bigbird split rows", mask=BIGBIRD, N=200, split=1.2),
    dict(name="documents (200 tokens, 5 docs)", mask=_doc_mask(200, [37, 50, 3, 61, 49]), N=200),
    dict(name="strided", mask=STRIDED, N=200, strategy="zigzag"),
    dict(name="strided ulysses", mask=STRIDED, N=256, strategy="ulysses", H=4, Hkv=2),
    dict(name="gqa greedy", mask="window(30)", N=200, strategy="greedy", H=4, Hkv=1),
    dict(name="empty rows", mask="causal & ~sliding_window(20)", N=200, lse_grad=True),
    dict(name="dropout", mask="causal & window(30)", N=200, p=0.3, exact_forward=True),
    dict(name="dropout split overlap", mask=LONGFORMER, N=200, p=0.25, split=1.5, overlap=True),
    dict(name="batch-dependent documents", mask=bsfa.causal() & bsfa.document(torch.stack(
        [_ids(150, [40, 110]), _ids(150, [70, 30, 50])])), N=150, B=2),
    # rank 0 owns the global keys and fetches nothing: without overlap it completes its sends before
    # its launch (NCCL's kernel would get no SM beside the attention kernel); with overlap it launches first
    dict(name="send-only rank waits before launching", mask="causal & (window(12) | global_tokens(16))", N=200,
         strategy="contiguous", first_event="wait"),
    # without overlap the split rows' queries travel with the K/V fetch, their dQ parts with the
    # returned dK/dV: forward = that step + the split rows' parts back, backward = their dO/O/LSE
    # out + the returns; overlapped, each is a step of its own
    dict(name="split rows: two message steps each way", mask=LONGFORMER, N=200, strategy="contiguous", split=1.5,
         steps=(2, 2)),
    dict(name="split rows overlapped: three message steps each way", mask=LONGFORMER, N=200, strategy="contiguous",
         split=1.5, overlap=True, steps=(3, 3)),
    dict(name="send-only rank of an overlapped plan launches first", mask="causal & (window(12) | global_tokens(16))",
         N=200, strategy="contiguous", overlap=True, first_event="launch"),
    dict(name="contiguous shards without a plan", mask="causal & window(40)", N=150, plan=False,
         lengths=[64, 86]),
    dict(name="float32", mask=LONGFORMER, N=200, split=1.5, dtype=torch.float32, tol=1e-5),
    # fetched keys' dK/dV parts returned in 16 bits (rounded once, added in float32 by the owner)
    dict(name="bfloat16, gradients returned in bfloat16", mask=BIGBIRD, N=200, split=1.2, dtype=torch.bfloat16,
         tol=2e-2, H=4, Hkv=2, return_dtype="input"),
    dict(name="bfloat16, gradients returned in float32", mask=BIGBIRD, N=200, split=1.2, dtype=torch.bfloat16,
         tol=2e-2, H=4, Hkv=2, return_dtype="float32"),
    dict(name="Dv > D (v zero-padded q/k)", mask=LONGFORMER, N=200, split=1.5, H=4, Hkv=2, Dv=12,
         float64_reference=True),
    dict(name="Dv < D, overlap", mask="causal & window(30)", N=200, overlap=True, D=12, Dv=5),
    dict(name="mismatched shard", error=True, mask="causal", N=200, cut={1: 1},
         expect=["rank 1 passed", "tokens"]),
    dict(name="k/v shorter than q on one rank", error=True, mask="causal", N=200, k_cut={1: 2},
         expect=["rank 1 failed its own checks"]),
    dict(name="plan for another world size", error=True, mask="causal", N=200, plan_world=4,
         expect=["made for 4 ranks"]),
    dict(name="different plans", error=True, mask="causal", mask1="causal & window(20)", N=200,
         expect=["different plan"]),
    dict(name="unaligned contiguous shards", error=True, mask="causal", N=200, lengths=[100, 100],
         expect=["multiple of 16"]),
    # the default check="first": a configuration's first call exchanges its description, so an
    # inconsistent first call still raises on every rank
    dict(name="different plans, checked once", error=True, mask="causal", mask1="causal & window(24)", N=208,
         check="first", expect=["different plan"]),
    dict(name="check modes: one exchange per configuration", check_modes=True, mask="causal & window(40)", N=192,
         strategy="contiguous"),
]

CASES_2_KERNELS = [  # the Triton kernels in the interpreter (the slow part of the suite)
    dict(name="triton kernels (interpreter)", mask=LONGFORMER, N=72, split=1.2, dtype=torch.float32, tol=1e-5,
         backend="triton", H=2, Hkv=1),
    dict(name="triton kernels, finer lists", mask=LONGFORMER, N=96, block=32, split=1.2, dtype=torch.float32,
         tol=1e-5, backend="triton", H=2, Hkv=1, fine_lists=True),
    dict(name="triton kernels, halo launches overlapped", mask="causal & sliding_window(12)", N=96,
         dtype=torch.float32, tol=1e-5, backend="triton", H=2, Hkv=1, overlap=True),
]

CASES_2_COMPILE = [
    dict(name="torch.compile", compiled=True, mask=LONGFORMER, N=200, split=1.2),
    dict(name="nn module with rotary", module=True, mask="causal & window(40)", N=96, strategy="zigzag"),
]

CASES_4 = [
    dict(name="documents", mask=_doc_mask(200, [37, 50, 3, 61, 49]), N=200, strategy="contiguous"),
    dict(name="documents overlap (halo launches)", mask=_doc_mask(640, [60] * 10 + [40]), N=640,
         strategy="contiguous", overlap=True, lse_grad=True),
    dict(name="sliding window overlap (halo launches)", mask="causal & sliding_window(20)", N=320,
         strategy="contiguous", overlap=True, H=4, Hkv=2),
    dict(name="bigbird dropout split overlap", mask=BIGBIRD, N=200, split=1.2, p=0.2, overlap=True, H=4, Hkv=2),
    dict(name="packed messages (many runs per pair)", mask=RANDOM, N=600, strategy="greedy"),
    dict(name="packed messages, overlap", mask=RANDOM, N=600, strategy="greedy", overlap=True, lse_grad=True),
    dict(name="causal zigzag overlap, 4 pieces", mask="causal", N=256, strategy="zigzag", overlap=True),
    dict(name="strided ulysses, 2 kv heads on 4 ranks", mask=STRIDED, N=256, strategy="ulysses", H=4, Hkv=2),
    dict(name="longformer split rows (first steps fused)", mask=LONGFORMER, N=256, split=1.2, strategy="contiguous",
         H=4, Hkv=2, float64_reference=True),
    dict(name="mismatched shard", error=True, mask="causal", N=200, cut={2: 3}, expect=["rank 2 passed"]),
]


def _check_results(results, cases, world):
    names = {c["name"] for c in cases}
    errors = [c["name"] for c in cases if c.get("error")]
    by = {}
    for rank, name, ok, detail in results:
        by.setdefault(name, []).append((rank, ok, detail))
    bad = [f"{n}: {d}" for n, v in by.items() for _, ok, d in v if not ok]
    assert not bad, "\n".join(bad)
    assert "<worker>" not in by
    for n in names:
        want = world if n in errors else 1  # error cases report from every rank
        assert len(by.get(n, [])) == want, (n, by.get(n))


def test_two_ranks(tmp_path):
    _check_results(_run(2, CASES_2, tmp_path), CASES_2, 2)


@pytest.mark.interpreter
def test_two_ranks_triton_kernels(tmp_path):
    _check_results(_run(2, CASES_2_KERNELS, tmp_path), CASES_2_KERNELS, 2)


def test_two_ranks_compile_and_modules(tmp_path):
    _check_results(_run(2, CASES_2_COMPILE, tmp_path), CASES_2_COMPILE, 2)


def test_four_ranks(tmp_path):
    _check_results(_run(4, CASES_4, tmp_path), CASES_4, 4)


def test_four_ranks_all_to_all_messages(tmp_path, monkeypatch):
    """The same four-rank cases with every message step as one ``all_to_all_single``
    (``BSFA_CP_MESSAGES=all_to_all``, read by each spawned rank): the same results, and no rank
    left out of a collective (a missed step would hang and time out)."""
    monkeypatch.setenv("BSFA_CP_MESSAGES", "all_to_all")
    _check_results(_run(4, CASES_4, tmp_path), CASES_4, 4)


def test_second_derivatives_refused_by_name():
    """A backward with ``create_graph=True`` through context parallelism is refused (its messages
    and kernels record no graph), not answered with a second derivative missing attention's part."""
    import torch.distributed as dist

    from blocksparse_fa.distributed import context_parallel_attention, plan_context_parallel

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
        plan = plan_context_parallel("causal", 64, 1, block_size=16)
        out = context_parallel_attention(q, k, v, "causal", plan=plan)
        with pytest.raises(RuntimeError, match="create_graph=True"):
            torch.autograd.grad(out.sum(), q, create_graph=True)
        out = context_parallel_attention(q, k, v, "causal", plan=plan)
        assert torch.autograd.grad(out.sum(), q)[0].isfinite().all()
    finally:
        dist.destroy_process_group()


def test_overlapped_calls_leave_sms_to_messages(monkeypatch):
    """An overlapped call's launches run with persistent Gluon grids ``_SM_MARGIN`` SMs short of
    the device (NCCL's kernels then start beside them); a margin the call set itself is kept, and
    a margin of 0 leaves the options as they are."""
    from blocksparse_fa.distributed import attention as att
    from blocksparse_fa.ops.options import DEFAULT_OPTIONS, GluonConfig, as_options

    monkeypatch.setattr(att, "_SM_MARGIN", 0)
    assert att._beside_messages(DEFAULT_OPTIONS) is DEFAULT_OPTIONS
    monkeypatch.setattr(att, "_SM_MARGIN", 8)
    got = att._beside_messages(DEFAULT_OPTIONS)
    assert (got.gluon_fwd.sm_margin, got.gluon_bwd.sm_margin) == (8, 8)
    assert got.gluon_fwd.block_n == GluonConfig().block_n  # only the margin changes
    own = as_options(dict(gluon_fwd=dict(sm_margin=2)))
    assert att._beside_messages(own) is own


def test_returned_gradients_travel_in_the_inputs_16_bit_dtype(monkeypatch):
    """Fetched keys' dK/dV parts go back in the inputs' dtype when it is 16-bit (``input``), in the
    accumulation dtype otherwise or with ``float32``; the token-major gather converts in its pass."""
    from blocksparse_fa.distributed import attention as att

    monkeypatch.setattr(att, "_RETURN_DTYPE", "input")
    f32 = torch.float32
    assert att._wire_dtype(torch.bfloat16, f32) == torch.bfloat16 and att._wire_dtype(torch.float16, f32) == \
        torch.float16
    assert att._wire_dtype(torch.float32, f32) == f32 and att._wire_dtype(torch.float64, torch.float64) == torch.float64
    monkeypatch.setattr(att, "_RETURN_DTYPE", "float32")
    assert att._wire_dtype(torch.bfloat16, f32) == f32
    dk, dv = torch.randn(2, 3, 10, 4), torch.randn(2, 3, 10, 4)
    idx = torch.tensor([7, 2, 5])
    st = att._tokens_first(dk, dv, idx=idx, dtype=torch.bfloat16)
    assert st.dtype == torch.bfloat16 and st.shape == (3, 2, 2, 3, 4)
    assert torch.equal(st[1, 1], dv[:, :, 2].to(torch.bfloat16)) and torch.equal(st[0, 0], dk[:, :, 7].bfloat16())
    assert torch.equal(att._tokens_first(dk, dv, idx=idx), att._tokens_first(dk, dv, idx=idx, dtype=f32))
