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


def test_core_learnable_score_mod_and_dv():
    """A score modifier with learnable ALiBi slopes and bias (nn.Parameters) registered on the
    module: outputs and every gradient (q, k, v, slopes, bias) match the float64 reference; a
    per-call modifier adds to it; v has its own head dim; CP refuses modifiers."""
    g = torch.Generator().manual_seed(0)
    H, L = 4, 45
    q = torch.randn(2, H, L, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, L, 11, generator=g, dtype=torch.float64, requires_grad=True)
    slopes = torch.nn.Parameter(bsfa.alibi_slopes(H).double())
    rel = torch.nn.Parameter(torch.randn(H, L, L, generator=g, dtype=torch.float64))
    attn = BlockSparseAttention(PATTERN, block_size=16, score_mod=bsfa.alibi(slopes) + bsfa.bias(rel))
    assert dict(attn.named_parameters()) == {"score_slopes": slopes, "score_bias": rel}
    assert "score_mod='alibi(" in repr(attn)
    out = attn(q, k, v, score_mod=bsfa.softcap(3.0))
    mod = bsfa.alibi(slopes) + bsfa.bias(rel) + bsfa.softcap(3.0)
    ref = bsfa.reference_attention(q, k, v, PATTERN, score_mod=mod)
    assert out.shape == (2, H, L, 11) and rel_err(out, ref) < 1e-12
    params = (q, k, v, slopes, rel)
    for a, b in zip(_grads(out, params), _grads(ref, params)):
        assert rel_err(a, b) < 1e-12
    with pytest.raises(ValueError, match="two bias"):  # one bias per call: add the tensors
        attn(q, k, v, score_mod=bsfa.bias(torch.zeros(L, dtype=torch.float64)))
    with pytest.raises(ValueError, match="score_fn"):
        BlockSparseAttention(PATTERN, score_mod=bsfa.score_fn(lambda s, b, h, i, j: s))
    with pytest.raises(NotImplementedError, match="context parallelism"):
        BlockSparseAttention(PATTERN, score_mod=bsfa.softcap(2.0), context_parallel=object())


def test_mha_learnable_alibi_trains_under_compile():
    """``BlockSparseMultiheadAttention(score_mod=alibi(nn.Parameter))``: the slopes are a parameter of
    the layer, get gradients under ``torch.compile(fullgraph=True)`` equal to eager ones, and new
    values after an optimizer step reuse the compiled graph."""
    torch._dynamo.reset()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm

    torch.manual_seed(0)
    slopes = torch.nn.Parameter(bsfa.alibi_slopes(4).double())
    m = BlockSparseMultiheadAttention(32, 4, PATTERN, num_kv_heads=2, block_size=16, dtype=torch.float64,
                                      score_mod=bsfa.alibi(slopes) + bsfa.softcap(5.0))
    assert any(p is slopes for p in m.parameters())
    cm = torch.compile(m, fullgraph=True, backend=backend)
    x = torch.randn(2, 45, 32, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(2):
        out, ref = cm(x), m(x)
        assert rel_err(out, ref) < 1e-13
        got, want = _grads(out, (x, slopes)), _grads(ref, (x, slopes))
        assert all(rel_err(a, b) < 1e-12 for a, b in zip(got, want)) and got[1].abs().sum() > 0
        opt.zero_grad()
        cm(x).sum().backward()
        opt.step()
    assert len(frames) == 1


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


# ------------------------------------------------------------------------------------------------
# drop-in for torch.nn.MultiheadAttention
# ------------------------------------------------------------------------------------------------
def _torch_mha(E=32, H=4, batch_first=False, kdim=None, vdim=None, seed=0):
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=kdim, vdim=vdim, dtype=torch.float64)
    with torch.no_grad():  # non-zero biases, so that every parameter is checked
        for p in mha.parameters():
            if p.dim() == 1:
                p.normal_()
    return mha


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("masks", ["none", "padding", "padding+attn_mask", "per-head attn_mask", "float masks",
                                   "is_causal", "float bias", "per-head float bias"])
def test_mha_drop_in_matches_torch(batch_first, masks):
    B, Lq, E, H = 3, 21, 32, 4
    mha = _torch_mha(E, H, batch_first)
    ours = BlockSparseMultiheadAttention.from_torch(mha, block_size=16)
    g = torch.Generator().manual_seed(1)
    shape = (B, Lq, E) if batch_first else (Lq, B, E)
    x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(B, Lq, dtype=torch.bool)
    kpm[1, 15:] = True
    kpm[2, :4] = True
    am = torch.rand(Lq, Lq, generator=g) < 0.3  # True = not allowed (torch's MHA convention)
    kw = {
        "none": {},
        "padding": {"key_padding_mask": kpm},
        "padding+attn_mask": {"key_padding_mask": kpm, "attn_mask": am},
        "per-head attn_mask": {"attn_mask": torch.rand(B * H, Lq, Lq, generator=g) < 0.3},
        "float masks": {"key_padding_mask": torch.zeros(B, Lq, dtype=torch.float64).masked_fill(kpm, -math.inf),
                        "attn_mask": torch.zeros(Lq, Lq, dtype=torch.float64).masked_fill(am, -math.inf)},
        "is_causal": {"attn_mask": torch.ones(Lq, Lq, dtype=torch.bool).triu(1), "is_causal": True},
        # float masks holding biases add to the scores (score_mod=bias), with padding
        "float bias": {"key_padding_mask": torch.zeros(B, Lq, dtype=torch.float64).masked_fill(kpm, -math.inf),
                       "attn_mask": torch.randn(Lq, Lq, generator=g, dtype=torch.float64)},
        "per-head float bias": {"attn_mask": torch.randn(B * H, Lq, Lq, generator=g, dtype=torch.float64)},
    }[masks]
    ref, _ = mha(x, x, x, need_weights=False, **kw)
    out, weights = ours(x, x, x, **kw)
    assert weights is None and out.shape == ref.shape
    assert rel_err(out, ref) < 1e-12
    g_ours = _grads(out, [x, ours.out_proj.weight, ours.out_proj.bias, ours.q_proj.weight, ours.k_proj.weight,
                          ours.v_proj.weight, ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias])
    g_ref = _grads(ref, [x, mha.out_proj.weight, mha.out_proj.bias, mha.in_proj_weight, mha.in_proj_bias])
    ours_packed = [*g_ours[:3], torch.cat(g_ours[3:6]), torch.cat(g_ours[6:])]
    for a, b in zip(ours_packed, g_ref):
        assert rel_err(a, b) < 1e-12


def test_mha_drop_in_cross_attention_kdim_vdim_and_unbatched():
    mha = _torch_mha(32, 2, batch_first=True, kdim=12, vdim=20)
    ours = BlockSparseMultiheadAttention.from_torch(mha, block_size=16)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 17, 32, generator=g, dtype=torch.float64)
    k = torch.randn(2, 40, 12, generator=g, dtype=torch.float64)
    v = torch.randn(2, 40, 20, generator=g, dtype=torch.float64)
    kpm = torch.rand(2, 40, generator=g) < 0.3
    ref, _ = mha(q, k, v, key_padding_mask=kpm, need_weights=False)
    assert rel_err(ours(q, k, v, key_padding_mask=kpm)[0], ref) < 1e-12
    ref1, _ = mha(q[0], k[0], v[0], key_padding_mask=kpm[0], need_weights=False)
    out1, _ = ours(q[0], k[0], v[0], key_padding_mask=kpm[0])
    assert out1.shape == (17, 32) and rel_err(out1, ref1) < 1e-12


def test_mha_padding_with_pattern_and_fully_padded_rows():
    """key_padding_mask intersects the module's pattern exactly; a sequence whose keys are all
    padding gives zero attention (only the output projection's bias), never NaN."""
    torch.manual_seed(0)
    m = BlockSparseMultiheadAttention(16, 2, "causal & window(5)", bias=True, block_size=8, dtype=torch.float64)
    with torch.no_grad():
        m.out_proj.bias.normal_()
    x = torch.randn(3, 30, 16, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(3, 30, dtype=torch.bool)
    kpm[0, 10:20] = True
    kpm[2] = True
    out, _ = m(x, x, x, key_padding_mask=kpm)
    q = m.q_proj(x).view(3, 30, 2, 8).transpose(1, 2)
    k = m.k_proj(x).view(3, 30, 2, 8).transpose(1, 2)
    v = m.v_proj(x).view(3, 30, 2, 8).transpose(1, 2)
    keep = bsfa.parse("causal & window(5)").to_dense(30, 30) & ~kpm[:, None, None, :]
    ref = m.out_proj(bsfa.reference_attention(q, k, v, mask=keep).transpose(1, 2).reshape(3, 30, 16))
    assert rel_err(out, ref) < 1e-12
    assert torch.equal(out[2], m.out_proj.bias.expand(30, 16))
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert torch.isfinite(gx).all()
    assert torch.equal(out, m(x, x, x, key_padding_mask=kpm)[0])  # the cached mask, same result
    kpm2 = kpm.clone()
    kpm2[1, :5] = True
    assert rel_err(m(x, x, x, key_padding_mask=kpm2)[0][1], out[1]) > 1e-3  # a new mask is a new mask


def test_mha_call_forms_and_errors():
    m = BlockSparseMultiheadAttention(16, 2, "causal", block_size=8, dtype=torch.float64)
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    assert isinstance(m(x), torch.Tensor) and isinstance(m(x, x), torch.Tensor)  # (x, context): a tensor
    out, w = m(x, x, x)  # nn.MultiheadAttention's form: (output, None)
    assert w is None and torch.equal(out, m(x))
    with pytest.raises(NotImplementedError, match="need_weights"):
        m(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, x, x, attn_mask=torch.zeros(3, 12, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must have shape"):  # a float bias of the wrong shape
        m(x, x, x, attn_mask=torch.randn(3, 12, 12, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="additive"):  # padding masks only mask
        m(x, x, x, key_padding_mask=torch.randn(2, 12, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="add_bias_kv"):
        BlockSparseMultiheadAttention.from_torch(torch.nn.MultiheadAttention(16, 2, add_bias_kv=True))
    lf = BlockSparseMultiheadAttention(16, 2, batch_first=False)
    assert lf(torch.randn(12, 2, 16)).shape == (12, 2, 16)
    assert "batch_first=False" in repr(lf)
