"""``Dv != D``: v with its own head dim. The entry points zero-pad the smaller of v and q/k (the
scale stays ``1/sqrt(D)``), run the kernels at one head dim and slice the output; the gradients come
back in the inputs' shapes. Against the float64 reference: output and dq, dk, dv, with GQA, odd
lengths, Lq != Lk, empty rows, both backends and every entry point."""

import math

import pytest
import torch
from conftest import rel_err

import blocksparse_fa as bsfa

MASK = "causal & (window(7) | global_tokens(3))"


def _qkv(Lq, Lk, D, Dv, dtype, H=4, Hkv=2, B=2, lead=None):
    g = torch.Generator().manual_seed(0)
    lead = (B,) if lead is None else lead
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    return mk(*lead, H, Lq, D), mk(*lead, Hkv, Lk, D), mk(*lead, Hkv, Lk, Dv)


def _compare(fn, q, k, v, tol, mask=MASK, scale=None):
    out = fn(q, k, v)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    flat = lambda t: t.reshape(-1, *t.shape[-3:])  # noqa: E731
    ref = bsfa.reference_attention(flat(q64), flat(k64), flat(v64), mask, scale=scale).reshape(out.shape)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    for g, r, x in zip(grads, ref_grads, (q, k, v)):
        assert g.shape == x.shape and rel_err(g, r) < tol, rel_err(g, r)
    return out


@pytest.mark.parametrize("D, Dv", [(8, 13), (16, 5)], ids=["Dv>D", "Dv<D"])
@pytest.mark.parametrize("Lq, Lk", [(45, 29), (37, 53)], ids=["Lq>Lk", "Lq<Lk"])
def test_torch_backend(D, Dv, Lq, Lk):
    q, k, v = _qkv(Lq, Lk, D, Dv, torch.float64)
    out = _compare(lambda q, k, v: bsfa.attention(q, k, v, MASK, backend="torch", block_size=16), q, k, v, 1e-12)
    if Lq > Lk:  # bottom-right: rows before the first key attend nothing
        assert torch.equal(out[:, :, :Lq - Lk], torch.zeros_like(out[:, :, :Lq - Lk]))


@pytest.mark.interpreter
@pytest.mark.parametrize("D, Dv", [(8, 13), (24, 16)], ids=["Dv>D", "Dv<D"])
def test_triton_kernels(D, Dv):
    q, k, v = _qkv(21, 35, D, Dv, torch.float32, B=1)
    _compare(lambda q, k, v: bsfa.attention(q, k, v, MASK, backend="triton", block_size=16), q, k, v, 5e-6)


def test_entry_points():
    """The scale defaults to 1/sqrt(D) (q's), not the padded dim; 3-D and 5-D inputs, a given scale,
    return_lse, the custom op eagerly and on meta tensors, SDPA against torch's own, and the errors."""
    q, k, v = _qkv(21, 30, 6, 10, torch.float64, lead=(2, 1))
    _compare(lambda q, k, v: bsfa.attention(q, k, v, None), q, k, v, 1e-12, mask=None)
    _compare(lambda q, k, v: bsfa.attention(q, k, v, None, scale=0.7), q, k, v, 1e-12, mask=None, scale=0.7)
    q3, k3, v3 = (t.detach()[0, 0] for t in (q, k, v))
    out, lse = bsfa.attention(q3, k3, v3, "causal", return_lse=True)
    ref, rlse = bsfa.reference_attention(q3[None], k3[None], v3[None], "causal", return_lse=True)
    assert out.shape == (4, 21, 10) and rel_err(out, ref[0]) < 1e-12 and rel_err(lse, rlse[0]) < 1e-12
    q4, k4, v4 = (t.detach()[0].requires_grad_() for t in (q, k, v))
    _compare(lambda q, k, v: bsfa.attention_op(q, k, v, "causal", block_size=16), q4, k4, v4, 1e-12, mask="causal")
    qm, km, vm = (t.detach().to("meta").requires_grad_() for t in (q4, k4, v4))
    om = bsfa.attention_op(qm, km, vm, "causal")
    assert om.shape == (1, 4, 21, 10) and om.device.type == "meta"
    assert [g.shape for g in torch.autograd.grad(om.sum(), (qm, km, vm))] == [qm.shape, km.shape, vm.shape]
    sd = torch.nn.functional.scaled_dot_product_attention
    ref = sd(q4, k4.repeat_interleave(2, 1), v4.repeat_interleave(2, 1), is_causal=True)
    got = bsfa.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    assert rel_err(got, ref) < 1e-12 and math.isclose(1 / math.sqrt(6), 1 / math.sqrt(q4.shape[-1]))
    with pytest.raises(ValueError, match="v must have the shape of k"):
        bsfa.attention(q4, k4, v4[:, :, :5])
    with pytest.raises(ValueError, match="Dv=300"):
        bsfa.attention(q4, k4, torch.zeros(1, 2, 30, 300, dtype=torch.float64))
    from blocksparse_fa.ops import dispatch
    from blocksparse_fa.ops.validate import check_qkv

    with pytest.raises(ValueError, match="low-level entry point takes one head dim"):
        check_qkv(q4, k4, v4)
    lay = bsfa.compile_mask(bsfa.causal(), 21, 30, 16)
    with pytest.raises(ValueError, match="one head dim"):
        torch.ops.blocksparse_fa.attention_fwd(q4, k4, v4, bsfa.register_mask(lay), 0.5, 0.0, None, "auto", True,
                                               "bottom_right", [], None, None, None, "")
    assert dispatch.pad_head_dims(q4, k4, k4)[3] is None


def test_compile_and_module():
    """Under torch.compile(fullgraph=True) (forward and backward) and through the nn module."""
    torch._dynamo.reset()
    q, k, v = _qkv(40, 40, 8, 12, torch.float32)
    fn = lambda q, k, v: bsfa.attention(q, k, v, MASK, block_size=16)  # noqa: E731
    _compare(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v, 1e-5)
    attn = bsfa.nn.BlockSparseAttention(MASK, block_size=16)
    _compare(attn, q, k, v, 1e-5)
