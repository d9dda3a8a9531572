"""FlexAttention bridge: BlockMask -> BlockLayout -> BlockMask round trips, mask_mods against
Flex's dense masks, and BlockLayout's Flex-style names (indexing, to_string, sparsity, to)."""

from __future__ import annotations

import warnings

import pytest
import torch

import blocksparse_fa as bsfa

fa = pytest.importorskip("torch.nn.attention.flex_attention")
from blocksparse_fa.integrations.flex import as_mask_mod, from_block_mask, to_block_mask  # noqa: E402


def sliding(b, h, q, kv):
    return (q >= kv) & (q - kv < 40)


IDS = torch.tensor([[0] * 70 + [1] * 100 + [2] * 130, [0] * 150 + [1] * 150])


def packed_docs(b, h, q, kv):
    return (IDS[b, q] == IDS[b, kv]) & (q >= kv)


def per_head(b, h, q, kv):
    return (q - kv).abs() <= 16 * (h + 1)


CASES = {  # name: (mask_mod, B, H, Lq, Lk, BLOCK_SIZE)
    "sliding, ragged, non-square blocks": (sliding, None, None, 300, 200, (32, 64)),
    "causal, square": (lambda b, h, q, kv: q >= kv, None, None, 256, 256, 64),
    "documents per batch": (packed_docs, 2, None, 300, 300, 32),
    "per head": (per_head, 1, 3, 129, 257, (64, 32)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_block_mask_round_trip_and_dense_mask(name):
    mm, B, H, Lq, Lk, bs = CASES[name]
    bm = fa.create_block_mask(mm, B, H, Lq, Lk, device="cpu", BLOCK_SIZE=bs)
    lay = from_block_mask(bm)
    assert lay.block_size == tuple(bm.BLOCK_SIZE) and (lay.q_len, lay.kv_len) == (Lq, Lk)
    want = fa.create_mask(mm, B or 1, H or 1, Lq, Lk, device="cpu")
    got = lay.to_dense()
    assert torch.equal(got.expand(want.shape) if got.dim() == 4 else got.expand(want.shape), want)
    back = to_block_mask(lay)
    for a in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        x, y = getattr(bm, a), getattr(back, a)
        assert torch.equal(x.expand(y.shape) if x.shape != y.shape else x, y), a
    # the mask_mod made for the layout computes the same dense mask
    assert torch.equal(fa.create_mask(back.mask_mod, B or 1, H or 1, Lq, Lk, device="cpu"), want)


def test_block_mask_without_mask_mod_keeps_partial_blocks_whole():
    full = torch.tensor([[[2]]], dtype=torch.int32), torch.tensor([[[[1, 0, 2]]]], dtype=torch.int32)
    part = torch.tensor([[[1]]], dtype=torch.int32), torch.tensor([[[[2, 0, 1]]]], dtype=torch.int32)
    bm = fa.BlockMask.from_kv_blocks(*part, *full, BLOCK_SIZE=32, seq_lengths=(32, 96))
    lay = from_block_mask(bm)
    assert lay.block_states().tolist() == [[2, 2, 2]]  # partial block with noop_mask: every pair kept
    assert bool(lay.to_dense().all())


@pytest.mark.parametrize("pattern, kind", [("longformer", "blocksparse_mask_mod"), ("bigbird", "dense_mask_mod")])
def test_layout_to_block_mask_mask_mod(pattern, kind):
    lay = bsfa.compile_mask(bsfa.load_pattern(pattern, window=40) if pattern == "bigbird"
                            else bsfa.load_pattern(pattern), 200, 260, 64)
    bm = to_block_mask(lay)
    assert bm.mask_mod.__name__ == kind  # random blocks do not run under vmap: the dense fallback
    assert torch.equal(fa.create_mask(bm.mask_mod, 1, 1, 200, 260, device="cpu")[0, 0], lay.to_dense())
    assert torch.equal(from_block_mask(bm).to_dense(), lay.to_dense())


def test_flex_attention_runs_our_layout():
    """flex_attention with to_block_mask(layout) computes our attention (eager Flex, forward)."""
    torch.manual_seed(0)
    lay = bsfa.compile_mask("causal & (window(20) | global_tokens(5))", 96, 96, 32)
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = fa.flex_attention(q, k, v, block_mask=to_block_mask(lay))
    out = bsfa.attention(q, k, v, mask=lay)
    assert (out - ref).abs().max() < 1e-5


def test_layout_flex_names():
    ids = torch.tensor([[0] * 40 + [1] * 60, [0] * 70 + [1] * 30])
    lay = bsfa.compile_mask(bsfa.causal() & bsfa.document(ids), 100, 100, 16)
    dense, states = lay.to_dense(), lay.block_states()
    for b in range(2):
        inst = lay[b, 3]  # heads broadcast: any head index serves
        assert torch.equal(inst.to_dense(), dense[b, 0])
        assert torch.equal(inst.block_states(), states[b, 0])
        assert inst.n_nonempty == int((states[b, 0] > 0).sum())
        assert inst.sparsity() == pytest.approx(1 - inst.n_nonempty / 49)
        assert f"[b={b}, h=0]" in inst.to_string()
    assert torch.equal(lay[-1, 0].to_dense(), dense[1, 0])
    with pytest.raises(IndexError, match="out of range"):
        lay[2, 0]
    with pytest.raises(TypeError, match=r"\[b, h\]"):
        lay[0]
    shared = bsfa.compile_mask("causal", 64, 64, 16)
    assert torch.equal(shared[5, 7].to_dense(), shared.to_dense())
    assert shared.to_string() == shared.ascii()
    assert shared.sparsity() == pytest.approx(1 - 10 / 16)
    assert shared.to("cpu") is shared
    assert as_mask_mod(shared)(torch.tensor(0), torch.tensor(0), torch.tensor(3), torch.tensor(2))
