"""nn modules: BlockSparseAttention (q, k, v core) and BlockSparseMultiheadAttention (projections,
GQA, rotary) against float64 references; layout caching; torch.compile; copies."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import rel_err

import blocksparse_fa as bsfa
from blocksparse_fa.nn import BlockSparseAttention, BlockSparseMultiheadAttention, apply_rotary

PATTERN = "causal & longformer(window=9, n_global=3)"


def _grads(out, params, seed=1):
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad(out, params, do)


def test_core_matches_reference_gqa():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 45, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 45, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 45, 8, generator=g, dtype=torch.float64, requires_grad=True)
    attn = BlockSparseAttention(PATTERN, block_size=16)
    out = attn(q, k, v)
    ref = bsfa.reference_attention(q, k, v, PATTERN)
    assert rel_err(out, ref) < 1e-12
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        assert rel_err(a, b) < 1e-12
    assert attn.block_size == (16, 16)
    assert "window(9)" in repr(attn)


def test_core_caches_layouts_per_length_and_device():
    attn = BlockSparseAttention(bsfa.causal() & bsfa.window(5), block_size=8)
    a = attn.layout(40)
    assert attn.layout(40) is a
    assert attn.layout(40, 40, "cpu") is a
    b = attn.layout(24, 40)
    assert b is not a and (b.q_len, b.kv_len) == (24, 40)
    q = torch.randn(1, 2, 24, 4)
    k = torch.randn(1, 2, 40, 4)
    out = attn(q, k, k)  # uses the cached (24, 40) layout; bottom-right aligned
    ref = bsfa.reference_attention(q.double(), k.double(), k.double(), bsfa.causal() & bsfa.window(5))
    assert rel_err(out, ref) < 1e-5


def _mha_reference(m: BlockSparseMultiheadAttention, x: torch.Tensor, mask) -> torch.Tensor:
    """Float64 re-implementation: explicit projections, repeat_interleave for GQA, dense mask."""
    x = x.double()
    B, L, _ = x.shape
    H, Hkv, Dh = m.num_heads, m.num_kv_heads, m.head_dim
    W = {n: p.detach().double() for n, p in m.named_parameters()}
    q = (x @ W["q_proj.weight"].T).view(B, L, H, Dh).transpose(1, 2)
    k = (x @ W["k_proj.weight"].T).view(B, L, Hkv, Dh).transpose(1, 2)
    v = (x @ W["v_proj.weight"].T).view(B, L, Hkv, Dh).transpose(1, 2)
    if m.rotary:
        pos = torch.arange(L)
        q, k = apply_rotary(q, pos), apply_rotary(k, pos)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(Dh)
    s = s.masked_fill(~mask.to_dense(L, L), float("-inf"))
    o = torch.softmax(s, -1) @ v
    return o.transpose(1, 2).reshape(B, L, H * Dh) @ W["out_proj.weight"].T


@pytest.mark.parametrize("rotary", [False, True])
def test_mha_gqa_matches_float64_reference(rotary):
    torch.manual_seed(0)
    m = BlockSparseMultiheadAttention(32, 4, PATTERN, num_kv_heads=2, rotary=rotary, block_size=16)
    x = torch.randn(2, 45, 32, requires_grad=True)
    out = m(x)
    ref = _mha_reference(m, x, bsfa.parse(PATTERN))
    assert out.shape == (2, 45, 32) and out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5
    # gradients w.r.t. input and weights vs the float64 model
    m64 = copy.deepcopy(m).double()
    x64 = x.detach().double().requires_grad_()
    out64 = m64(x64)
    assert rel_err(out64, ref) < 1e-12
    g32 = _grads(out, (x, *m.parameters()))
    g64 = _grads(out64, (x64, *m64.parameters()))
    for a, b in zip(g32, g64):
        assert rel_err(a, b) < 1e-4


def test_mha_mask_matters():
    """A different pattern gives a different result (the mask is actually applied)."""
    torch.manual_seed(0)
    a = BlockSparseMultiheadAttention(32, 4, "causal", num_kv_heads=1, block_size=16, dtype=torch.float64)
    b = BlockSparseMultiheadAttention(32, 4, "causal & sliding_window(4)", num_kv_heads=1, block_size=16,
                                      dtype=torch.float64)
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 40, 32, dtype=torch.float64)
    assert rel_err(a(x), b(x)) > 1e-2
    assert rel_err(b(x), _mha_reference(b, x, bsfa.parse("causal & sliding_window(4)"))) < 1e-12


def test_mha_cross_attention_and_dropout():
    torch.manual_seed(0)
    m = BlockSparseMultiheadAttention(16, 2, None, bias=True, dropout=0.5, block_size=8, dtype=torch.float64)
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    ctx = torch.randn(2, 30, 16, dtype=torch.float64)
    m.eval()
    out = m(x, ctx)
    q = m.q_proj(x).view(2, 10, 2, 8).transpose(1, 2)
    k = m.k_proj(ctx).view(2, 30, 2, 8).transpose(1, 2)
    v = m.v_proj(ctx).view(2, 30, 2, 8).transpose(1, 2)
    ref = m.out_proj(bsfa.reference_attention(q, k, v).transpose(1, 2).reshape(2, 10, 16))
    assert rel_err(out, ref) < 1e-12
    m.train()
    a, b = m(x, ctx), m(x, ctx)
    assert torch.isfinite(a).all() and rel_err(a, b) > 1e-3  # dropout active in training, fresh seeds


def test_mha_validation():
    with pytest.raises(ValueError, match="multiple"):
        BlockSparseMultiheadAttention(32, 4, None, num_kv_heads=3)
    with pytest.raises(ValueError, match="divisible"):
        BlockSparseMultiheadAttention(30, 4, None)
    m = BlockSparseMultiheadAttention(32, 4, None)
    with pytest.raises(ValueError, match="shape"):
        m(torch.randn(2, 5, 16))


def test_mha_torch_compile_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = BlockSparseMultiheadAttention(32, 4, PATTERN, num_kv_heads=2, rotary=True, block_size=16,
                                      dtype=torch.float64)
    cm = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 45, 32, dtype=torch.float64, requires_grad=True)
    out, ref = cm(x), m(x)
    assert rel_err(out, ref) < 1e-13
    for a, b in zip(_grads(out, (x, *m.parameters())), _grads(ref, (x, *m.parameters()))):
        assert rel_err(a, b) < 1e-12


def test_deepcopy_registers_its_own_handle():
    from blocksparse_fa.ops.custom_op import registry

    m = BlockSparseAttention(bsfa.causal() & bsfa.window(3), block_size=8)
    c = copy.deepcopy(m)
    assert c.handle == m.handle  # equal masks share the entry...
    assert registry._entries[m.handle].pins >= 2  # ...pinned by both modules
