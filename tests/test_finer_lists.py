"""Finer list blocks (``compiler/finer.py``): the kernels' lists classified at the kernel tile's step.

The states themselves (exact against the dense mask, never outside the layout's own states, the
partial area they save on the benchmark masks, no N x N anywhere), the cost model's choices, and
the kernels in the interpreter against the float64 reference with the lists finer than the layout
block: ragged lengths, GQA, Lq != Lk, rows with nothing to attend, dropout, split work items,
shards with position tables, the strided rewrite and per-head masks.
"""

import numpy as np
import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.compiler.finer import COST, list_states, pick_list_block, side_costs, upsample
from blocksparse_fa.compiler.segments import EMPTY, FULL, PARTIAL
from blocksparse_fa.ops.options import KernelOptions, TileConfig
from blocksparse_fa.ops import triton_backend as tb
from conftest import rel_err
from test_triton_interpreter import _check

LONGFORMER = bsfa.load_pattern("longformer", window=20, n_global=10)
BIGBIRD = bsfa.load_pattern("bigbird", window=12, n_global=16, n_random=2, block=16, seed=1)


def _states_vs_dense(mask, q_len, kv_len, block, fine):
    """Fine states of ``compile_mask(mask, .., block)`` and the dense mask cut into fine blocks."""
    lay = bsfa.compile_mask(mask, q_len, kv_len, block)
    st = list_states(lay, *fine).to_dense()  # (instances, Tr, Tc)
    dense = mask.to_dense(q_len, kv_len).reshape(-1, q_len, kv_len)
    bm, bn = fine
    z, tr, tc = st.shape
    pad = torch.zeros(dense.shape[0], tr * bm, tc * bn, dtype=torch.int8) - 1  # -1: past the ragged edge
    pad[:, :q_len, :kv_len] = dense.to(torch.int8)
    cells = pad.view(-1, tr, bm, tc, bn).permute(0, 1, 3, 2, 4).reshape(-1, tr, tc, bm * bn)
    valid = cells >= 0
    any_kept = ((cells == 1) & valid).any(-1).numpy()
    all_kept = ((cells == 1) | ~valid).all(-1).numpy()
    coarse = lay._segs.to_dense()
    return lay, st, any_kept, all_kept, coarse


DOCS = bsfa.causal() & bsfa.document(torch.tensor([0] * 40 + [1] * 57))
MASK_MOD = bsfa.mask_mod(lambda b, h, i, j: ((i - j).abs() <= 20) | (j < 10)) & bsfa.causal()
PER_HEAD = bsfa.window(bsfa.per_head([3, 20, 40])) | bsfa.global_tokens(6)


@pytest.mark.parametrize("mask,q_len,kv_len", [(LONGFORMER, 200, 200), (BIGBIRD, 257, 257),
                                               (bsfa.parse("causal & sliding_window(30)"), 97, 130),
                                               (DOCS, 97, 97), (MASK_MOD, 97, 97), (PER_HEAD, 97, 150)])
@pytest.mark.parametrize("fine", [(32, 16), (16, 32)])
def test_finer_states_are_exact_and_inside_the_layout(mask, q_len, kv_len, fine):
    """Finer blocks are FULL exactly where every pair is kept and EMPTY where none is (these masks
    classify exactly), and never outside the layout's own states: inside a full (empty) layout block
    every finer block is full (empty)."""
    lay, st, any_kept, all_kept, coarse = _states_vs_dense(mask, q_len, kv_len, 32, fine)
    assert np.array_equal(st == FULL, all_kept & any_kept)
    assert np.array_equal(st == EMPTY, ~any_kept)
    fr, fc = 32 // fine[0], 32 // fine[1]
    up = np.repeat(np.repeat(coarse, fr, 1), fc, 2)[:, : st.shape[1], : st.shape[2]]
    assert np.all(st[up == EMPTY] == EMPTY) and np.all(st[up == FULL] == FULL)
    assert np.array_equal(upsample(lay._segs, fr, fc, *st.shape[1:]).to_dense(), up)


def test_finer_lists_drop_partial_area_on_the_benchmark_masks():
    """At 16K with 128-blocks: (128, 64) row lists and (64, 128) column lists cut the partial area
    by a quarter (Longformer) and a half (BigBird); empty halves of partial blocks are not listed.
    Classified from segments: nothing of size N x N is built."""
    n = 16384
    for name, low, high in (("longformer", 0.2, 0.3), ("bigbird", 0.45, 0.55)):
        lay = bsfa.compile_mask(bsfa.load_pattern(name), n, n, 128)
        f0, p0 = lay._segs.count(FULL), lay._segs.count(PARTIAL)
        for fine in ((128, 64), (64, 128)):
            segs = list_states(lay, *fine)
            assert segs.n_cols * segs.n_rows <= 2 * (n // 128) ** 2  # block grids, run-length encoded
            f, p = segs.count(FULL) / 2, segs.count(PARTIAL) / 2  # in layout blocks
            assert low <= 1 - p / p0 <= high, (name, fine, p, p0)
            assert f > f0 and f + p < f0 + p0  # some halves become full, some are skipped
    causal = bsfa.compile_mask(bsfa.causal(), n, n, 128)  # the diagonal stays partial at any step
    assert list_states(causal, 128, 64).count(PARTIAL) == 2 * causal.n_partial


def test_cost_model_picks_finer_lists_where_they_pay():
    """Longformer and BigBird (partial-heavy with empty and full halves) get lists of half the layout
    block at the partial-heavy tiles' steps (forward/dQ 64 keys, dK/dV 32 queries: two tiles per
    entry) where the model says they pay; causal, sliding windows and documents keep the layout block. A layout whose masked area
    cannot pay is not reclassified."""
    n = 16384
    for name in ("longformer", "bigbird"):
        lay = bsfa.compile_mask(bsfa.load_pattern(name), n, n, 128)
        for side, step in (("row", 64), ("col", 32)):
            coarse, fine = side_costs(lay, side, step, 64)
            pays = fine.cost <= (1 - COST["min_gain"]) * coarse.cost
            assert pick_list_block(lay, side, step) == (64 if pays else 128)
            assert pays or (name, side) == ("longformer", "col")  # dK/dV: 2.6 % modelled, below min_gain
    docs = bsfa.load_pattern("document_causal", document=torch.repeat_interleave(torch.arange(8), 2048))
    for mask in (docs, bsfa.sliding_window(1024), bsfa.causal()):
        lay = bsfa.compile_mask(mask, n, n, 128, cache=False)
        assert pick_list_block(lay, "row", 64) == 128 and pick_list_block(lay, "col", 32) == 128
    lay = bsfa.compile_mask(bsfa.window(300), n, n, 128)  # window edges inside the blocks' halves
    assert pick_list_block(lay, "row", 64) == 64
    big = bsfa.compile_mask(bsfa.document(torch.repeat_interleave(torch.arange(64), 1 << 14)) & bsfa.causal(),
                            1 << 20, 1 << 20, 128)
    assert pick_list_block(big, "row", 64) == 128
    assert not any(isinstance(k, tuple) and k[0] == "list_states" for k in big.cache)  # cannot pay: not classified
    assert pick_list_block(big, "row", 64, force="fine") == 64
    assert pick_list_block(big, "row", 128) == 128  # the tile already spans the layout block


def test_work_list_costs_stay_in_layout_blocks():
    from blocksparse_fa.kernels.schedule import build_worklist

    ptr = np.array([0, 8, 8], np.int64)
    coarse = build_worklist(ptr, np.zeros(3, np.int64), 1, 2, 1, 4, min_chunk=1.0)
    fine = build_worklist(ptr * 2, np.zeros(3, np.int64), 1, 2, 1, 4, min_chunk=1.0, entry_size=0.5)
    assert coarse.chunk == fine.chunk and coarse.n_items == fine.n_items


# ------------------------------------------------------------------------------------------------
# kernels (interpreter): layout block 32, kernel tiles stepping 16 along every loop
# ------------------------------------------------------------------------------------------------
HALF_TILES = dict(fwd_tiles=TileConfig(32, 16, 4, 2), dkdv_tiles=TileConfig(16, 32, 4, 2),
                  dq_tiles=TileConfig(32, 16, 4, 2))


def fine_tiles(**kw) -> KernelOptions:
    """Kernel tiles of half the layout block along each loop, and finer lists ("fine": every side
    that can; "auto": the cost model)."""
    return KernelOptions(**HALF_TILES, **kw)


def _plans_use_fine_lists(layout, opts):
    """Every launch plan of ``layout`` under ``opts`` ran with list blocks of 16 (forward: LIST_BN,
    backward: KV_LIST_BM and Q_LIST_BN)."""
    plans = [v for k, v in layout.cache.items() if isinstance(k, tuple) and k[0] in ("fwd", "bwd") and opts in k]
    assert plans
    for p in plans:
        c = p.consts
        assert c.get("LIST_BN", c.get("KV_LIST_BM")) == 16
        assert c.get("Q_LIST_BN", 16) == 16


@pytest.mark.interpreter
@pytest.mark.parametrize("mask,H,Hkv,Lq,Lk", [
    (LONGFORMER, 4, 2, 97, 97),             # GQA, odd length
    (BIGBIRD, 2, 1, 129, 129),              # random blocks at the list block, odd length
    (LONGFORMER, 2, 2, 70, 130),            # Lq != Lk
    (bsfa.parse("causal & (window(12) | global_tokens(5))"), 2, 1, 100, 60),  # rows with nothing to attend
])
def test_fine_lists_match_reference(mask, H, Hkv, Lq, Lk):
    opts = fine_tiles(lists="fine")
    lay = bsfa.compile_mask(mask, Lq, Lk, 32)
    for side in ("row", "col"):  # the finer lists differ: some partial halves are full or empty
        coarse, fine = side_costs(lay, side, 16)
        assert fine.n_partial < 2 * coarse.n_partial, (side, coarse, fine)
    out, lse, grads = _check(mask, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, block=32, opts=opts)
    _plans_use_fine_lists(bsfa.compile_mask(mask, Lq, Lk, 32), opts)
    if Lq > Lk:  # bottom-right: the first Lq - Lk rows see no key
        assert torch.equal(out[:, :, :Lq - Lk], torch.zeros_like(out[:, :, :Lq - Lk]))
        assert torch.equal(grads[0][:, :, :Lq - Lk], torch.zeros_like(grads[0][:, :, :Lq - Lk]))


@pytest.mark.interpreter
def test_fine_lists_with_deeper_stages_split_items_and_dropout():
    """``list_stages="tiles"`` (stages x tiles per layout block), split work items (global rows and
    columns cut into pieces over the finer lists) and dropout (the same elements dropped as the
    reference's keep mask, which the coarse lists drop too)."""
    opts = fine_tiles(lists="fine", list_stages="tiles", split_chunk=2.0)
    _check(LONGFORMER, H=2, Hkv=1, Lq=128, Lk=128, block=32, opts=opts)
    _check(LONGFORMER, H=2, Hkv=1, Lq=96, Lk=96, block=32, dropout_p=0.3, seed=5, opts=opts)
    plan = [v for k, v in bsfa.compile_mask(LONGFORMER, 128, 128, 32).cache.items()
            if isinstance(k, tuple) and k[0] == "fwd" and opts in k][0]
    assert plan.consts["STAGES"] == 4 and plan.part_shapes  # 2 stages x 2 tiles; split tiles


@pytest.mark.interpreter
def test_fine_and_coarse_lists_drop_the_same_elements():
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    outs = []
    for lists in ("coarse", "fine"):
        outs.append(bsfa.attention(q, k, v, mask=LONGFORMER, block_size=32, backend="triton", dropout_p=0.4,
                                   dropout_seed=3, kernel_options=fine_tiles(lists=lists)))
    assert rel_err(outs[1], outs[0]) < 1e-6


@pytest.mark.interpreter
def test_fine_lists_auto_rewrite_per_head_and_atomic(monkeypatch):
    """``lists="auto"`` on layouts where the model takes the finer lists on both sides, on one; the
    strided rewrite's parts;
    a per-head window; the five-GEMM backward (which keeps layout-block lists)."""
    from blocksparse_fa.compiler import rewrite

    opts = fine_tiles(lists="auto")
    lay = bsfa.compile_mask(BIGBIRD, 128, 128, 32)
    assert tb._list_block(lay, "row", 16, opts) == 16 and tb._list_block(lay, "col", 16, opts) == 16
    _check(BIGBIRD, H=2, Hkv=1, Lq=128, Lk=128, block=32, opts=opts)
    lay = bsfa.compile_mask(LONGFORMER, 128, 128, 32)  # the model: finer rows pay, finer columns do not
    assert tb._list_block(lay, "row", 16, opts) == 16 and tb._list_block(lay, "col", 16, opts) is None
    opts = fine_tiles(lists="fine")
    monkeypatch.setattr(rewrite, "MIN_PERIODS", 4)
    rewrite.plan.cache_clear()
    try:
        _check(bsfa.parse("causal & (sliding_window(20) | strided(16))"), Lq=160, Lk=160, H=2, Hkv=1, block=32,
               opts=opts)
    finally:
        rewrite.plan.cache_clear()
    _check(bsfa.window(bsfa.per_head([3, 20])) | bsfa.global_tokens(6), H=2, Hkv=1, Lq=97, Lk=97, block=32,
           opts=opts)
    _check(LONGFORMER, H=2, Hkv=1, Lq=97, Lk=97, block=32, opts=fine_tiles(lists="fine", deterministic=False))


@pytest.mark.interpreter
def test_fine_lists_on_shards_with_position_tables():
    """A shard (context parallelism) lists its source's finer blocks at its local rows and columns,
    limited rows included; the kernels map finer entries to their layout block's global position."""
    from test_distributed import _shard_vs_full

    opts = fine_tiles(lists="fine")
    layout = bsfa.compile_mask(bsfa.load_pattern("longformer", window=10, n_global=5), 150, 150, block_size=32,
                               rewrite=False)
    rows, cols = np.array([0, 2, 4]), np.array([0, 1, 3, 2, 4])  # the ragged last block comes last
    lim = (np.array([True, False, False]), np.array([0, 3, 4]))
    errs = _shard_vs_full(layout, rows, cols, lim, dropout_p=0.3, backend="triton", dtype=torch.float32, H=2, Hkv=1,
                          opts=opts)
    assert max(errs) < 1e-5, errs
    from blocksparse_fa.compiler.shard import shard_layout

    sh = shard_layout(layout, rows, cols, limit_rows=lim[0], limit_cols=lim[1])
    fine = list_states(sh, 32, 16).to_dense()[0]
    coarse = sh._segs.to_dense()[0]
    assert np.all(fine[np.repeat(coarse, 2, 1)[:, : fine.shape[1]] == EMPTY] == EMPTY)


def test_list_options_are_checked():
    with pytest.raises(ValueError, match="lists must be one of .* got 'finest'"):
        KernelOptions(lists="finest")
    with pytest.raises(ValueError, match="list_stages must be one of .* got 'all'"):
        KernelOptions(list_stages="all")
    lay = bsfa.compile_mask(bsfa.causal(), 64, 64, 32)
    with pytest.raises(ValueError, match="must divide the layout block"):
        list_states(lay, 32, 24)
