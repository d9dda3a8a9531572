"""CPU attention backend against the dense float64 reference: outputs, gradients, GQA, Lq != Lk,
fully masked rows, dropout, input validation and memory."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import rel_err
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import blocksparse_fa as bsfa


@pytest.fixture(autouse=True)
def _walk(cpu_path):
    """These tests are about the block-walking backend: ``backend="auto"`` runs it here (the dense
    path ``auto`` may pick for small problems is tested in test_api.py)."""
    cpu_path("walk")


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def make_qkv(B, H, Hkv, Lq, Lk, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, do)]


def run(fn, q, k, v, do):
    """Output and (dq, dk, dv) of ``fn(q, k, v)`` with upstream gradient ``do``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), do.to(out.dtype))
    return out.detach(), grads


def kernel_and_reference(mask, B=1, H=2, Hkv=2, Lq=97, Lk=130, D=16, dtype=torch.float64, seed=0, **kw):
    q, k, v, do = make_qkv(B, H, Hkv, Lq, Lk, D, dtype, seed)
    got = run(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, **kw), q, k, v, do)
    ref_kw = {x: kw[x] for x in ("scale",) if x in kw}
    ref = run(lambda q, k, v: bsfa.reference_attention(q, k, v, mask=mask, **ref_kw),
              *(t.double() for t in (q, k, v, do)))
    return got, ref


def assert_close(got, ref, tol, what=""):
    (o, g), (o_ref, g_ref) = got, ref
    assert o.shape == o_ref.shape
    assert not torch.isnan(o).any() and all(not torch.isnan(x).any() for x in g)
    errs = [rel_err(o, o_ref)] + [rel_err(a, b) for a, b in zip(g, g_ref)]
    assert max(errs) < tol, (what, errs)


# masks built for given lengths (tensor-backed primitives need them)
def _g(lq, lk):
    return torch.Generator().manual_seed(lq * 31 + lk)


MASKS = {
    "full": lambda lq, lk: bsfa.full(),
    "causal": lambda lq, lk: bsfa.causal(),
    "window": lambda lq, lk: bsfa.window(13),
    "sliding_window": lambda lq, lk: bsfa.sliding_window(40),
    "global_tokens": lambda lq, lk: bsfa.global_tokens(5),
    "strided": lambda lq, lk: bsfa.strided(7),
    "chunked": lambda lq, lk: bsfa.chunked(45),
    "prefix_lm": lambda lq, lk: bsfa.prefix_lm(50),
    "summary": lambda lq, lk: bsfa.summary(16, 3),
    "random_blocks": lambda lq, lk: bsfa.random_blocks(2, block_size=32, seed=3),
    "document": lambda lq, lk: bsfa.document(torch.sort(torch.randint(0, 4, (lk,), generator=_g(lq, lk))).values),
    "document_unsorted": lambda lq, lk: bsfa.document(torch.randint(0, 3, (lk,), generator=_g(lq, lk))),
    "block_mask": lambda lq, lk: bsfa.block_mask(torch.rand(-(-lq // 16), -(-lk // 16), generator=_g(lq, lk)) < 0.5,
                                                 block_size=16),
    "dense_mask": lambda lq, lk: bsfa.dense_mask(torch.rand(lq, lk, generator=_g(lq, lk)) < 0.5),
    # compositions, ~ included
    "causal&~window": lambda lq, lk: bsfa.causal() & ~bsfa.window(4),
    "longformer": lambda lq, lk: bsfa.load_pattern("longformer", window=20, n_global=6),
    "bigbird": lambda lq, lk: bsfa.load_pattern("bigbird", window=10, n_global=4, n_random=2, block=16),
    "strided_st": lambda lq, lk: bsfa.load_pattern("sparse_transformer_strided", stride=16),
    "fixed_st": lambda lq, lk: bsfa.load_pattern("sparse_transformer_fixed", stride=32, c=4),
    "~(a|b)&c": lambda lq, lk: ~(bsfa.window(3) | bsfa.strided(5)) & bsfa.causal() | bsfa.global_tokens(2),
}


def _nonempty_rows(mask, lq, lk):
    return bool(mask.to_dense(lq, lk).any(-1).all())


# ------------------------------------------------------------------------------------------------
# correctness in float64 and float32
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("lq,lk", [(97, 130), (130, 97)])
def test_every_mask_float64(name, lq, lk):
    mask = MASKS[name](lq, lk)
    got, ref = kernel_and_reference(mask, Lq=lq, Lk=lk, block_size=32)
    assert got[0].dtype == torch.float64
    assert_close(got, ref, 1e-10, name)


@pytest.mark.parametrize("name", ["causal", "bigbird", "document", "dense_mask", "~(a|b)&c", "strided"])
def test_float32_default_block(name):
    lq, lk = 200, 257
    mask = MASKS[name](lq, lk)
    got, ref = kernel_and_reference(mask, B=2, H=2, Hkv=1, Lq=lq, Lk=lk, D=32, dtype=torch.float32)
    assert got[0].dtype == torch.float32 and all(g.dtype == torch.float32 for g in got[1])
    assert_close(got, ref, 2e-5, name)


@pytest.mark.parametrize("H,Hkv", [(4, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("lq,lk", [(64, 64), (33, 100), (100, 33)])
def test_gqa_mqa(H, Hkv, lq, lk):
    mask = bsfa.causal() & bsfa.window(20) | bsfa.global_tokens(3)
    got, ref = kernel_and_reference(mask, B=2, H=H, Hkv=Hkv, Lq=lq, Lk=lk, D=8, block_size=(16, 32))
    assert got[1][1].shape == (2, Hkv, lk, 8)  # dk has the k/v head count
    assert_close(got, ref, 1e-10, (H, Hkv))


@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 97), (97, 1), (257, 97), (97, 257), (129, 129)])
@pytest.mark.parametrize("bs", [32, (64, 16), 128])
def test_ragged_lengths(lq, lk, bs):
    mask = bsfa.window(10) | bsfa.global_tokens(2)
    got, ref = kernel_and_reference(mask, Lq=lq, Lk=lk, D=8, block_size=bs)
    assert_close(got, ref, 1e-10)


def test_batch_dependent_masks_with_gqa():
    B, H, Hkv, L = 2, 4, 2, 90
    ids = torch.sort(torch.randint(0, 3, (B, L)), 1).values
    head_mask = bsfa.dense_mask(torch.rand(1, H, L, L) < 0.7)
    mask = bsfa.document(ids) & (head_mask | bsfa.causal())
    assert mask.batch_shape == (B, H)
    got, ref = kernel_and_reference(mask, B=B, H=H, Hkv=Hkv, Lq=L, Lk=L, D=8, block_size=32)
    assert_close(got, ref, 1e-10)


def test_scale_mask_forms_and_lse():
    q, k, v, do = make_qkv(2, 2, 2, 70, 90, 16)
    m = bsfa.causal() & bsfa.window(25)
    ref, ref_lse = bsfa.reference_attention(q, k, v, mask=m, scale=0.3, return_lse=True)
    out, lse = bsfa.attention(q, k, v, mask=m, scale=0.3, return_lse=True)
    assert rel_err(out, ref) < 1e-12
    assert lse.shape == (2, 2, 70)
    assert torch.allclose(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    # the default scale is 1/sqrt(D)
    assert rel_err(bsfa.attention(q, k, v, mask=m), bsfa.reference_attention(q, k, v, mask=m, scale=0.25)) < 1e-12
    assert rel_err(bsfa.attention(q, k, v, mask=m), ref) > 1e-3  # the scale matters
    # DSL text, a compiled layout, a non-square block size, mask=None (dense), explicit backend
    assert rel_err(bsfa.attention(q, k, v, mask="causal & window(25)", scale=0.3), ref) < 1e-12
    lay = bsfa.compile_mask(m, 70, 90, (16, 64))
    assert rel_err(bsfa.attention(q, k, v, mask=lay, scale=0.3), ref) < 1e-12
    assert rel_err(bsfa.attention(q, k, v, mask=m, scale=0.3, block_size=(32, 16), backend="torch"), ref) < 1e-12
    assert rel_err(bsfa.attention(q, k, v), bsfa.reference_attention(q, k, v)) < 1e-12
    assert rel_err(bsfa.attention(q, k, v, mask=None), bsfa.attention(q, k, v, mask=bsfa.full())) == 0


def test_gradcheck_small():
    q, k, v, _ = make_qkv(1, 2, 1, 12, 20, 4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    m = bsfa.causal() & ~bsfa.strided(3) | bsfa.global_tokens(1)
    assert torch.autograd.gradcheck(lambda q, k, v: bsfa.attention(q, k, v, mask=m, block_size=8), (q, k, v),
                                    fast_mode=True)


# ------------------------------------------------------------------------------------------------
# bfloat16: error no worse than eager attention in the same precision
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["causal", "longformer", "document", "~(a|b)&c", "random_blocks"])
@pytest.mark.parametrize("H,Hkv", [(2, 2), (4, 1)])
def test_bfloat16_vs_eager(name, H, Hkv):
    lq, lk = 150, 200
    mask = MASKS[name](lq, lk)
    q, k, v, do = make_qkv(2, H, Hkv, lq, lk, 32, torch.bfloat16)
    got = run(lambda q, k, v: bsfa.attention(q, k, v, mask=mask), q, k, v, do)
    assert got[0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got[1])
    ref = run(lambda q, k, v: bsfa.reference_attention(q, k, v, mask=mask), *(t.double() for t in (q, k, v, do)))
    eager = run(lambda q, k, v: bsfa.reference_attention(q, k, v, mask=mask, upcast=False), q, k, v, do)
    assert eager[0].dtype == torch.bfloat16
    pairs = [(got[0], eager[0], ref[0])] + list(zip(got[1], eager[1], ref[1]))
    for which, (a, e, r) in zip(("out", "dq", "dk", "dv"), pairs):
        assert not torch.isnan(a).any()
        err_k, err_e = rel_err(a, r), rel_err(e, r)
        assert err_k <= 2.0 * err_e + 1e-3, (which, err_k, err_e)
        assert err_k < 2e-2, (which, err_k)


# ------------------------------------------------------------------------------------------------
# fully masked rows
# ------------------------------------------------------------------------------------------------
def _check_empty_rows(mask, lq, lk, dtype=torch.float64, B=1, H=2, Hkv=2, **kw):
    dense = mask.to_dense(lq, lk).expand(B, H, lq, lk)
    empty = ~dense.any(-1)  # (B, H, Lq)
    assert bool(empty.any()), "test needs fully masked rows"
    q, k, v, do = make_qkv(B, H, Hkv, lq, lk, 16, dtype)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = bsfa.attention(qg, kg, vg, mask=mask, return_lse=True, **kw)
    dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), do)
    for t in (out, dq, dk, dv, lse):
        assert not torch.isnan(t).any()
    assert bool((out[empty] == 0).all())
    assert bool((dq[empty] == 0).all())
    assert bool(torch.isneginf(lse[empty]).all())
    assert bool(torch.isfinite(lse[~empty]).all())
    # keys attended by no query row get exactly zero dk/dv
    G = H // Hkv
    unused = ~dense.reshape(B, Hkv, G, lq, lk).any(2).any(2)  # (B, Hkv, Lk)
    assert bool((dk[unused] == 0).all()) and bool((dv[unused] == 0).all())
    ref, ref_lse = bsfa.reference_attention(q.double(), k.double(), v.double(), mask=mask, return_lse=True)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    assert rel_err(out, ref) < tol
    assert bool(torch.isneginf(ref_lse[empty]).all())
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_all_rows_masked(dtype):
    q, k, v, do = make_qkv(2, 2, 1, 50, 70, 16, dtype)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = bsfa.attention(qg, kg, vg, mask=~bsfa.full(), return_lse=True)
    grads = torch.autograd.grad(out, (qg, kg, vg), do)
    assert out.dtype == dtype
    assert bool((out == 0).all()) and all(bool((g == 0).all()) for g in grads)
    assert bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bs", [16, 32, (32, 16)])
def test_causal_with_more_queries_than_keys(dtype, bs):
    out = _check_empty_rows(bsfa.causal(), 100, 60, dtype, block_size=bs)
    assert bool((out[:, :, :40] == 0).all()) and bool((out[:, :, 40:] != 0).any(-1).all())


def test_document_and_dense_mask_with_empty_rows():
    L = 120
    ids = torch.sort(torch.randint(0, 4, (L,))).values
    t = torch.rand(L, L) < 0.5
    t[[3, 50, 77, 119]] = False
    _check_empty_rows(bsfa.document(ids) & bsfa.dense_mask(t), L, L, block_size=32)
    _check_empty_rows(bsfa.document(ids) & bsfa.dense_mask(t), L, L, H=4, Hkv=2, block_size=(16, 64))


def test_sliding_window_rows_before_first_key():
    _check_empty_rows(bsfa.sliding_window(8) | bsfa.strided(1000), 90, 40, block_size=32)


# ------------------------------------------------------------------------------------------------
# dropout
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask_name", ["full", "longformer", "~(a|b)&c", "document"])
def test_dropout_matches_reference_with_keep_mask(mask_name):
    B, H, Hkv, lq, lk, p, seed = 2, 4, 2, 97, 130, 0.3, 1234
    mask = MASKS[mask_name](lq, lk)
    q, k, v, do = make_qkv(B, H, Hkv, lq, lk, 16)
    keep = bsfa.dropout_keep_mask(B, H, lq, lk, p, seed)
    assert keep.dtype == torch.bool and keep.shape == (B, H, lq, lk)
    got = run(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, dropout_p=p, dropout_seed=seed, block_size=32),
              q, k, v, do)
    ref = run(lambda q, k, v: bsfa.reference_attention(q, k, v, mask=mask, dropout_p=p, dropout_mask=keep),
              q, k, v, do)
    assert_close(got, ref, 1e-12, mask_name)
    # and it really is dropout: without it the result differs
    nodrop = run(lambda q, k, v: bsfa.reference_attention(q, k, v, mask=mask), q, k, v, do)
    assert rel_err(got[0], nodrop[0]) > 0.05


def test_dropout_keep_pattern_is_exact():
    """With v = I the output is P * keep / (1 - p): its non-zeros are exactly keep & mask."""
    B, H, lq, lk, p, seed = 1, 2, 40, 48, 0.4, 77
    mask = bsfa.window(10) | bsfa.global_tokens(2)
    q = torch.randn(B, H, lq, lk, dtype=torch.float64)
    k = torch.randn(B, 1, lk, lk, dtype=torch.float64)
    v = torch.eye(lk, dtype=torch.float64).expand(B, 1, lk, lk).contiguous()
    out = bsfa.attention(q, k, v, mask=mask, dropout_p=p, dropout_seed=seed, block_size=16)
    keep = bsfa.dropout_keep_mask(B, H, lq, lk, p, seed)
    assert torch.equal(out != 0, keep & mask.to_dense(lq, lk))
    probs = bsfa.reference_attention(q, k, v, mask=mask)
    assert torch.allclose(out, probs * keep / (1 - p), rtol=1e-12, atol=1e-15)


def test_dropout_seeds():
    B, H, lq, lk, p = 1, 2, 64, 64, 0.3
    masks = [bsfa.dropout_keep_mask(B, H, lq, lk, p, s) for s in (0, 1, 2**40 + 1)]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not torch.equal(masks[a], masks[b])
    assert torch.equal(bsfa.dropout_keep_mask(B, H, lq, lk, p, 1), masks[1])
    frac = bsfa.dropout_keep_mask(2, 4, 128, 128, p, 5).double().mean().item()
    assert abs(frac - (1 - p)) < 0.01
    q, k, v, _ = make_qkv(B, H, H, lq, lk, 16)
    o1 = bsfa.attention(q, k, v, mask=bsfa.causal(), dropout_p=p, dropout_seed=1)
    o1b = bsfa.attention(q, k, v, mask=bsfa.causal(), dropout_p=p, dropout_seed=1, block_size=16)
    o2 = bsfa.attention(q, k, v, mask=bsfa.causal(), dropout_p=p, dropout_seed=2)
    assert rel_err(o1, o1b) < 1e-12  # independent of the block size
    assert rel_err(o1, o2) > 0.05
    # no seed: drawn from torch's RNG, so two calls differ
    assert rel_err(bsfa.attention(q, k, v, dropout_p=p), bsfa.attention(q, k, v, dropout_p=p)) > 0.05
    # dropout_p = 0 ignores the seed
    assert torch.equal(bsfa.attention(q, k, v, dropout_p=0.0, dropout_seed=3), bsfa.attention(q, k, v))


# ------------------------------------------------------------------------------------------------
# input validation
# ------------------------------------------------------------------------------------------------
def _qkv(B=1, H=2, Hkv=2, lq=32, lk=32, D=8, dtype=torch.float32):
    return (torch.randn(B, H, lq, D).to(dtype), torch.randn(B, Hkv, lk, D).to(dtype),
            torch.randn(B, Hkv, lk, D).to(dtype))


def _bad_calls():
    q, k, v = _qkv()
    A = bsfa.attention
    return [
        ("q 3-D, k 4-D", lambda: A(q[0], k, v), ValueError, "leading"),
        ("k 5-D", lambda: A(q, k[None], v), ValueError, "k"),
        ("q 2-D", lambda: A(q[0, 0], k[0, 0], v[0, 0]), ValueError, "at least 3"),
        ("v head dim", lambda: A(q, k, torch.zeros(1, 2, 32, 257)), ValueError, "Dv=257"),
        ("enable_gqa", lambda: A(*_qkv(H=4, Hkv=2), enable_gqa=False), ValueError, "enable_gqa"),
        ("bool mask shape", lambda: A(q, k, v, mask=torch.ones(3, 32, 32, dtype=torch.bool)), ValueError,
         "broadcast"),
        ("float mask bias", lambda: A(q, k, v, mask=torch.randn(32, 32)), NotImplementedError, "score"),
        ("int mask", lambda: A(q, k, v, mask=torch.ones(32, 32, dtype=torch.int64)), TypeError, "bool"),
        ("block_size 0", lambda: A(q, k, v, mask="causal", block_size=0), ValueError, "block_size"),
        ("scale str", lambda: A(q, k, v, scale="0.5"), ValueError, "scale"),
        ("scale tensor 1-D", lambda: A(q, k, v, scale=torch.ones(2)), ValueError, "scale"),
        ("scale bool", lambda: A(q, k, v, scale=True), ValueError, "scale"),
        ("v shape", lambda: A(q, k, v[:, :, :16]), ValueError, "v"),
        ("batch", lambda: A(q, *_qkv(B=2)[1:]), ValueError, "batch"),
        ("head dim", lambda: A(q, *_qkv(D=16)[1:]), ValueError, "head dim"),
        ("H % Hkv", lambda: A(*_qkv(H=3, Hkv=2)), ValueError, "Hkv"),
        ("dtype mismatch", lambda: A(q, k.double(), v.double()), TypeError, "dtype"),
        ("int dtype", lambda: A(*_qkv(dtype=torch.int64)), TypeError, "dtype"),
        ("not a tensor", lambda: A(q.numpy(), k, v), TypeError, "q"),
        ("dropout_p 1", lambda: A(q, k, v, dropout_p=1.0), ValueError, "dropout_p"),
        ("dropout_p <0", lambda: A(q, k, v, dropout_p=-0.1), ValueError, "dropout_p"),
        ("dropout_p str", lambda: A(q, k, v, dropout_p="0.1"), ValueError, "dropout_p"),
        ("dropout_seed", lambda: A(q, k, v, dropout_p=0.1, dropout_seed=-1), ValueError, "dropout_seed"),
        ("dropout_seed float", lambda: A(q, k, v, dropout_p=0.1, dropout_seed=1.5), ValueError, "dropout_seed"),
        ("scale 0", lambda: A(q, k, v, scale=0.0), ValueError, "scale"),
        ("scale <0", lambda: A(q, k, v, scale=-1.0), ValueError, "scale"),
        ("scale nan", lambda: A(q, k, v, scale=math.nan), ValueError, "scale"),
        ("layout lengths", lambda: A(q, k, v, mask=bsfa.compile_mask(bsfa.causal(), 32, 33)), ValueError, "compiled for"),
        ("layout block", lambda: A(q, k, v, mask=bsfa.compile_mask(bsfa.causal(), 32, 32, 16), block_size=32),
         ValueError, "block_size"),
        ("mask batch", lambda: A(q, k, v, mask=bsfa.document(torch.zeros(3, 32, dtype=torch.long))),
         ValueError, "batch shape"),
        ("mask heads", lambda: A(q, k, v, mask=bsfa.dense_mask(torch.ones(1, 3, 32, 32, dtype=torch.bool))),
         ValueError, "batch shape"),
        ("mask lengths", lambda: A(q, k, v, mask=bsfa.dense_mask(torch.ones(32, 31, dtype=torch.bool))),
         ValueError, "dense_mask"),
        ("mask type", lambda: A(q, k, v, mask=42), TypeError, "mask"),
        ("mask text", lambda: A(q, k, v, mask="causal &"), bsfa.MaskSyntaxError, "causal"),
        ("backend", lambda: A(q, k, v, backend="cuda"), ValueError, "backend"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[c[0] for c in _bad_calls()])
def test_input_validation(case):
    _, fn, exc, word = _bad_calls()[case]
    with pytest.raises(exc) as ei:
        fn()
    assert word in str(ei.value), str(ei.value)


def test_infinite_scale_rejected():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale"):
        bsfa.attention(q, k, v, scale=math.inf)


def test_valid_mask_batch_shapes_broadcast():
    q, k, v = _qkv(B=3, H=2, Hkv=1, lq=32, lk=32)
    ids = torch.randint(0, 2, (3, 32))
    for m in [bsfa.document(ids), bsfa.document(ids[:1]), bsfa.dense_mask(torch.rand(1, 2, 32, 32) < 0.5),
              bsfa.dense_mask(torch.rand(3, 1, 32, 32) < 0.5)]:
        out = bsfa.attention(q.double(), k.double(), v.double(), mask=m, block_size=16)
        ref = bsfa.reference_attention(q, k, v, mask=m)
        assert rel_err(out, ref) < 1e-10


# ------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------
class LargestTensor(TorchDispatchMode):
    """Records the largest numel of any tensor produced by an aten op."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest = t.numel()
        return out


def test_memory_is_sub_quadratic():
    L, D = 16384, 16
    q, k, v, do = make_qkv(1, 1, 1, L, L, D, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = bsfa.sliding_window(128)
    bsfa.compile_mask(mask, L, L)  # compile outside the mode (numpy, not torch)
    with LargestTensor() as rec:
        out = bsfa.attention(q, k, v, mask=mask)
        fwd_ops = rec.ops
        out.backward(do)
    assert fwd_ops > 0 and rec.ops > fwd_ops, "backward ran outside the recording mode"
    assert rec.largest >= L * D  # it did see the full-size tensors
    assert rec.largest < L * L // 16, rec.largest
    assert rec.largest <= 4 * L * D, rec.largest  # in fact O(L·D)
    assert q.grad is not None and not torch.isnan(q.grad).any() and q.grad.abs().sum() > 0
    # spot-check a few rows against the dense reference restricted to their window
    rows = torch.tensor([0, 1, 127, 128, 5000, L - 1])
    for i in rows.tolist():
        lo = max(0, i - 127)
        s = (q[0, 0, i].double() @ k[0, 0, lo:i + 1].double().T) / math.sqrt(D)
        ref = torch.softmax(s, -1) @ v[0, 0, lo:i + 1].double()
        assert torch.allclose(out[0, 0, i].double(), ref, rtol=1e-4, atol=1e-5), i
