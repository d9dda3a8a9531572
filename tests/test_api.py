"""The PyTorch-shaped API: ``scaled_dot_product_attention`` against torch's SDPA (outputs and three
gradients), argument forms of ``attention`` (leading dims, bool masks, scalars), meta tensors,
the CPU ``auto`` choice between block walking and dense SDPA, and importing without Triton."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

import blocksparse_fa as bsfa
from blocksparse_fa.ops import dense as dense_mod
from blocksparse_fa.ops.validate import Shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _grads(fn, tensors, seed=1):
    ts = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*ts)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad(out, ts, do)
    return out.detach(), grads


def _assert_same(got, ref, tol):
    (o, g), (o_ref, g_ref) = got, ref
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    for a, b in zip((o, *g), (o_ref, *g_ref)):
        assert a.shape == b.shape
        assert torch.isfinite(a).all()
        assert rel_err(a, b) < tol, rel_err(a, b)


def _rand(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


# ------------------------------------------------------------------------------------------------
# scaled_dot_product_attention == torch's, outputs and gradients
# ------------------------------------------------------------------------------------------------
SDPA_CASES = {
    # name: (q shape, k shape, v shape, kwargs builder)
    "3-D": ((4, 37, 16), (4, 37, 16), {}),
    "5-D": ((2, 3, 2, 29, 8), (2, 3, 2, 29, 8), {}),
    "gqa": ((2, 4, 33, 16), (2, 2, 33, 16), {"enable_gqa": True}),
    "mqa broadcast": ((2, 4, 33, 16), (2, 1, 33, 16), {}),
    "batch broadcast": ((3, 2, 21, 8), (1, 2, 40, 8), {}),
    "2-D": ((23, 8), (31, 8), {}),
    "bool mask": ((2, 2, 45, 16), (2, 2, 61, 16), {"attn_mask": lambda: torch.rand(2, 1, 45, 61) < 0.6}),
    "bool mask per head, empty rows": ((1, 2, 40, 8), (1, 2, 40, 8),
                                       {"attn_mask": lambda: _empty_rows(torch.rand(2, 40, 40) < 0.5)}),
    "float 0/-inf mask": ((1, 2, 30, 8), (1, 2, 30, 8), {"attn_mask": lambda: _neg_inf(torch.rand(30, 30) < 0.5)}),
    "is_causal": ((2, 2, 97, 16), (2, 2, 97, 16), {"is_causal": True}),
    "is_causal Lq < Lk": ((1, 2, 37, 16), (1, 2, 90, 16), {"is_causal": True}),
    "is_causal Lq > Lk": ((1, 2, 90, 16), (1, 2, 37, 16), {"is_causal": True}),
    "is_causal gqa 3-D scale": ((4, 50, 8), (2, 70, 8), {"is_causal": True, "enable_gqa": True, "scale": 0.3}),
    "is_causal and mask": ((1, 2, 40, 8), (1, 2, 60, 8), {"is_causal": True,
                                                          "attn_mask": lambda: torch.rand(40, 60) < 0.5}),
    # v with its own head dim (zero-padded inside), and float masks holding biases (score_mod=bias)
    "Dv > D gqa": ((2, 4, 33, 8), (2, 2, 33, 8), {"enable_gqa": True, "v_dim": 13}),
    "Dv < D is_causal Lq > Lk": ((1, 2, 45, 16), (1, 2, 29, 16), {"is_causal": True, "v_dim": 5}),
    "float bias": ((2, 2, 37, 8), (2, 2, 41, 8), {"attn_mask": lambda: torch.randn(2, 1, 37, 41, dtype=torch.float64)}),
    "float bias with -inf, is_causal": ((1, 2, 40, 8), (1, 2, 40, 8), {"is_causal": True, "attn_mask": lambda: (
        torch.randn(40, 40, dtype=torch.float64).masked_fill(torch.rand(40, 40) < 0.3, float("-inf")))}),
}


def _empty_rows(m):
    m[:, [0, 7, 39]] = False
    return m


def _neg_inf(keep):
    return torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))


def _sdpa_inputs(name):
    qs, ks, kw = SDPA_CASES[name]
    kw = dict(kw)
    dv = kw.pop("v_dim", ks[-1])
    q, k, v = _rand(*qs, seed=1), _rand(*ks, seed=2), _rand(*ks[:-1], dv, seed=3)
    torch.manual_seed(4)
    kw = {a: (b() if callable(b) else b) for a, b in kw.items()}
    return (q, k, v), kw


@pytest.mark.parametrize("path", ["walk", "dense"])
@pytest.mark.parametrize("name", list(SDPA_CASES))
def test_sdpa_matches_torch(name, path, cpu_path):
    cpu_path(path)
    (q, k, v), kw = _sdpa_inputs(name)
    ref = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v))
    got = _grads(lambda q, k, v: bsfa.scaled_dot_product_attention(q, k, v, block_size=16, **kw), (q, k, v))
    # a bias (score modifier) runs the block walk: the dense path has no modifiers
    assert bsfa.last_backend() == ("dense" if path == "dense" and "bias" not in name else "torch")
    _assert_same(got, ref, 1e-10)


def test_sdpa_float32_error_like_torchs():
    """In float32 our error against the float64 result is within 2x of SDPA's own float32 error."""
    (q, k, v), kw = _sdpa_inputs("is_causal Lq < Lk")
    ref = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v))
    f32 = [t.float() for t in (q, k, v)]
    eager = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw), f32)
    ours = _grads(lambda q, k, v: bsfa.scaled_dot_product_attention(q, k, v, backend="torch", **kw), f32)
    for a, e, r in zip((ours[0], *ours[1]), (eager[0], *eager[1]), (ref[0], *ref[1])):
        assert rel_err(a, r) <= 2 * rel_err(e, r) + 1e-7


def test_sdpa_with_mask_expression():
    (q, k, v), _ = _sdpa_inputs("is_causal")
    keep = torch.rand(97, 97) < 0.7
    m = bsfa.window(9) | bsfa.global_tokens(3)
    dense = m.to_dense(97, 97) & keep & torch.ones(97, 97, dtype=torch.bool).tril()
    ref = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), (q, k, v))
    for mask in (m, "window(9) | global_tokens(3)", bsfa.compile_mask(m, 97, 97, 16)):
        got = _grads(lambda q, k, v: bsfa.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=True,
                                                                       mask=mask), (q, k, v))
        _assert_same(got, ref, 1e-10)


def test_sdpa_dropout_is_exact_for_its_seed():
    """Dropout draws our counter-based pattern from torch's RNG: same manual seed, same result."""
    q, k, v = _rand(1, 2, 40, 8), _rand(1, 2, 40, 8, seed=2), _rand(1, 2, 40, 8, seed=3)
    torch.manual_seed(5)
    a = bsfa.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    torch.manual_seed(5)
    b = bsfa.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    c = bsfa.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(a, b) and rel_err(a, c) > 0.05 and torch.isfinite(a).all()


@pytest.mark.parametrize("case, exc, words", [
    ("gqa without enable_gqa", ValueError, "enable_gqa=True"),
    ("gqa not a multiple", ValueError, "multiple"),
    ("dv too large", ValueError, "Dv=300"),
    ("float bias shape", ValueError, "does not broadcast"),
    ("mask shape", ValueError, "broadcast"),
    ("batch dims", ValueError, "do not broadcast"),
    ("1-D", ValueError, "at least 2"),
    ("tensor as mask=", TypeError, "attn_mask"),
])
def test_sdpa_errors(case, exc, words):
    q, k = _rand(2, 4, 16, 8), _rand(2, 2, 16, 8)
    S = bsfa.scaled_dot_product_attention
    call = {
        "gqa without enable_gqa": lambda: S(q, k, k),
        "gqa not a multiple": lambda: S(q, _rand(2, 3, 16, 8), _rand(2, 3, 16, 8), enable_gqa=True),
        "dv too large": lambda: S(q, q, torch.zeros(2, 4, 16, 300, dtype=q.dtype)),
        "float bias shape": lambda: S(q, q, q, attn_mask=torch.randn(3, 16, 16, dtype=torch.float64)),
        "mask shape": lambda: S(q, q, q, attn_mask=torch.ones(3, 16, 16, dtype=torch.bool)),
        "batch dims": lambda: S(q, _rand(3, 4, 16, 8), _rand(3, 4, 16, 8)),
        "1-D": lambda: S(q[0, 0, 0], q, q),
        "tensor as mask=": lambda: S(q, q, q, mask=torch.ones(16, 16, dtype=torch.bool)),
    }[case]
    with pytest.raises(exc, match=words):
        call()


# ------------------------------------------------------------------------------------------------
# attention(): argument forms
# ------------------------------------------------------------------------------------------------
def test_attention_leading_dims_and_bool_mask():
    q, k, v = _rand(2, 3, 4, 41, 8), _rand(2, 3, 2, 41, 8, seed=2), _rand(2, 3, 2, 41, 8, seed=3)
    keep = torch.rand(3, 1, 41, 41) < 0.6  # broadcasts over the first batch dim and the heads
    m = bsfa.causal() & bsfa.window(7)
    full_keep = keep & m.to_dense(41, 41)
    flat = lambda t: t.reshape(6, *t.shape[2:])  # noqa: E731
    ref_mask = full_keep.expand(2, 3, 4, 41, 41).reshape(6, 4, 41, 41)
    ref = _grads(lambda q, k, v: bsfa.reference_attention(flat(q), flat(k), flat(v), mask=ref_mask).view(q.shape),
                 (q, k, v))
    got = _grads(lambda q, k, v: bsfa.attention(q, k, v, mask=full_keep, block_size=16), (q, k, v))
    _assert_same(got, ref, 1e-10)
    got3 = _grads(lambda q, k, v: bsfa.attention(q[0, 0], k[0, 0], v[0, 0], mask=m, block_size=16), (q, k, v))
    ref3 = _grads(lambda q, k, v: bsfa.reference_attention(q[0, :1], k[0, :1], v[0, :1], mask=m)[0], (q, k, v))
    _assert_same(got3, ref3, 1e-10)


@pytest.mark.parametrize("scale", [0.25, 1, np.float32(0.25), np.float64(0.25), np.int64(1),
                                   torch.tensor(0.25), torch.tensor(1)])
def test_scale_accepts_real_scalars(scale):
    q, k, v = _rand(1, 2, 20, 8), _rand(1, 2, 20, 8, seed=2), _rand(1, 2, 20, 8, seed=3)
    out = bsfa.attention(q, k, v, mask="causal", scale=scale)
    ref = bsfa.reference_attention(q, k, v, mask="causal", scale=float(scale))
    assert rel_err(out, ref) < 1e-12


def test_block_size_zero_rejected_everywhere():
    q = _rand(1, 2, 20, 8)
    with pytest.raises(ValueError, match="block_size"):
        bsfa.attention(q, q, q, mask="causal", block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        bsfa.attention_op(q, q, q, "causal", block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        bsfa.compile_mask("causal", 20, 20, 0)
    with pytest.raises(ValueError, match="block_size"):
        bsfa.register_mask("causal", 0)
    with pytest.raises(ValueError, match="block_size"):
        bsfa.nn.BlockSparseAttention("causal", block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        bsfa.scaled_dot_product_attention(q, q, q, mask="causal", block_size=0)


# ------------------------------------------------------------------------------------------------
# meta tensors
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_meta_shapes_and_gradients(dtype):
    q = torch.empty(2, 3, 8, 100, 32, device="meta", dtype=dtype, requires_grad=True)
    k = torch.empty(2, 3, 2, 130, 32, device="meta", dtype=dtype, requires_grad=True)
    v = torch.empty(2, 3, 2, 130, 32, device="meta", dtype=dtype, requires_grad=True)
    out, lse = bsfa.attention(q, k, v, mask="causal & window(16)", return_lse=True)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 3, 8, 100) and lse.dtype == torch.float32
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.device.type == "meta" and t.grad.shape == t.shape and t.grad.dtype == dtype
    o = bsfa.scaled_dot_product_attention(q[0, 0], k[0, 0], v[0, 0], is_causal=True, enable_gqa=True)
    assert o.shape == (8, 100, 32) and o.device.type == "meta"
    assert bsfa.attention_op(q[0], k[0], v[0], "causal").shape == (3, 8, 100, 32)
    keep = torch.empty(100, 130, dtype=torch.bool, device="meta")  # masks as tensors: shapes checked
    assert bsfa.attention(q, k, v, mask=keep).shape == q.shape
    assert bsfa.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True).shape == q.shape
    with pytest.raises(ValueError, match="broadcast"):
        bsfa.attention(q, k, v, mask=torch.empty(99, 130, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="meta tensor"):
        bsfa.attention(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8),
                       mask=torch.empty(10, 10, dtype=torch.bool, device="meta"))


def test_meta_module_and_errors():
    m = bsfa.nn.BlockSparseMultiheadAttention(64, 4, "causal & window(32)", num_kv_heads=2, device="meta")
    x = torch.empty(2, 50, 64, device="meta")
    assert m(x).shape == (2, 50, 64) and m(x).device.type == "meta"
    kpm = torch.zeros(2, 50, dtype=torch.bool, device="meta")
    out, w = m(x, x, x, key_padding_mask=kpm)
    assert out.shape == (2, 50, 64) and w is None
    q = torch.empty(1, 2, 50, 16, device="meta")
    with pytest.raises(ValueError, match="dense_mask"):  # the mask is checked against the lengths
        bsfa.attention(q, q, q, mask=bsfa.dense_mask(torch.ones(50, 49, dtype=torch.bool)))
    with pytest.raises(ValueError, match="compiled for"):
        bsfa.attention(q, q, q, mask=bsfa.compile_mask("causal", 40, 40))
    with pytest.raises(ValueError, match="batch shape"):
        bsfa.attention(q, q, q, mask=bsfa.document(torch.zeros(3, 50, dtype=torch.long)))


# ------------------------------------------------------------------------------------------------
# backend="auto" on CPU: block walking or dense SDPA
# ------------------------------------------------------------------------------------------------
def test_cost_model_choices(monkeypatch):
    """The measured crossovers (``benchmarks/experiments/cpu_crossover.py``, ``ops/dense.COST``): on one thread
    the walk wins from about half the blocks down; the fused SDPA uses every thread and the walk
    does not, so on two threads dense wins also Longformer at 2048 (measured 0.3x with the walk)
    and a sliding window at 8192 tokens (0.05 of the blocks)."""
    def choice(mask, L, threads=1, H=8, D=64, B=1, dropout=0.0):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        lay = bsfa.compile_mask(mask, L, L)
        return "dense" if dense_mod.prefer_dense(lay, Shapes(B, H, H, L, L, D), dropout) else "walk"

    longformer = "window(256) | global_tokens(64)"
    assert choice("full()", 256) == "dense"
    assert choice("full()", 2048) == "dense"
    assert choice("causal()", 2048) == "walk" and choice("causal()", 2048, threads=2) == "dense"
    assert choice(longformer, 1024) == "dense"
    assert choice(longformer, 2048) == "walk" and choice(longformer, 2048, threads=2) == "dense"
    assert choice(longformer, 4096) == "walk"
    assert choice("causal() & sliding_window(256)", 8192, threads=2, H=4) == "dense"
    assert choice("causal() & sliding_window(256)", 16384, threads=2) == "walk"  # past MAX_DENSE_ELEMENTS
    assert choice("causal() & sliding_window(256)", 4096) == "walk"
    assert choice("full()", 256, dropout=0.1) == "walk"  # our dropout pattern needs our backends
    assert choice("full()", 8192) == "dense"
    assert choice("full()", 16384) == "walk"  # the mask would exceed MAX_DENSE_ELEMENTS


def test_auto_reports_and_keeps_guarantees(cpu_path):
    cpu_path("model")
    B, H, Hkv, L, D = 2, 4, 2, 60, 16
    q, k, v = _rand(B, H, L, D), _rand(B, Hkv, L, D, seed=2), _rand(B, Hkv, L, D, seed=3)
    ids = torch.tensor([[0] * 20 + [1] * 40, [0] * 50 + [1] * 10])
    keep = torch.rand(B, 1, L, L) < 0.5
    keep[:, :, [0, 33, 59]] = False  # fully masked rows
    mask = bsfa.document(ids) & bsfa.dense_mask(keep)
    ref = _grads(lambda q, k, v: bsfa.reference_attention(q, k, v, mask=mask), (q, k, v))
    got = _grads(lambda q, k, v: bsfa.attention(q, k, v, mask=mask), (q, k, v))
    assert bsfa.last_backend() == "dense"
    _assert_same(got, ref, 1e-10)
    rows = ~(keep[:, 0] & bsfa.document(ids).to_dense(L, L)[:, 0]).any(-1)  # (B, L)
    assert bool((got[0].transpose(1, 2)[rows] == 0).all()) and bool((got[1][0].transpose(1, 2)[rows] == 0).all())
    # what auto does not send to the dense path
    bsfa.attention(q, k, v, mask=mask, return_lse=True)
    assert bsfa.last_backend() == "torch"
    bsfa.attention(q, k, v, mask=mask, dropout_p=0.1)
    assert bsfa.last_backend() == "torch"
    bsfa.attention(q, k, v, mask=mask, backend="torch")
    assert bsfa.last_backend() == "torch"


def test_nan_in_v_never_reaches_fully_masked_rows(cpu_path):
    """A NaN in an input makes auto take the walk (SDPA would spread ``0 * nan`` to every row);
    fully masked rows stay zero with zero gradients."""
    cpu_path("dense")
    L = 64
    keep = torch.ones(L, L, dtype=torch.bool).tril()
    keep[[5, 40]] = False
    q, k, v = _rand(1, 2, L, 8), _rand(1, 2, L, 8, seed=2), _rand(1, 2, L, 8, seed=3)
    v[0, :, 41] = float("nan")  # a key in the blocks row 40 visits
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    out = bsfa.attention(*ts, mask=keep, block_size=32)
    assert bsfa.last_backend() == "torch"
    out.backward(torch.ones_like(out))
    assert bool((out[:, :, [5, 40]] == 0).all())
    assert bool((ts[0].grad[:, :, [5, 40]] == 0).all())


def test_inputs_finite_from_one_sum():
    """The dense path's guard: any NaN or infinity (also +inf beside -inf) is caught; finite inputs
    whose float32 sum overflows only send the call to the walk."""
    x = torch.randn(2, 3, 40, 8)
    assert dense_mod.inputs_finite(x, x.bfloat16(), x.half())
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            y = x.to(dt)
            y[1, 2, 7, 3] = bad
            assert not dense_mod.inputs_finite(x, y)
    y = x.clone()
    y[0, 0, 0, 0], y[1, 1, 1, 1] = float("inf"), float("-inf")
    assert not dense_mod.inputs_finite(y)
    assert not dense_mod.inputs_finite(torch.full((4,), 3e38))  # finite, but the sum overflows: walk


# ------------------------------------------------------------------------------------------------
# import without Triton, lazily
# ------------------------------------------------------------------------------------------------
def test_import_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as on a machine without a triton wheel
        import blocksparse_fa as bsfa
        import torch
        assert "torch._dynamo" not in sys.modules, "import blocksparse_fa loaded Dynamo"
        assert "blocksparse_fa.ops.custom_op" not in sys.modules
        q, k, v = (torch.randn(1, 2, 70, 16, requires_grad=True) for _ in range(3))
        out = bsfa.attention(q, k, v, mask="causal & window(20)", backend="torch", block_size=32)
        out.sum().backward()
        ref = bsfa.reference_attention(q, k, v, mask="causal & window(20)")
        assert (out - ref).abs().max() < 1e-5 and q.grad is not None and torch.isfinite(k.grad).all()
        layer = bsfa.nn.BlockSparseMultiheadAttention(32, 2, "causal")
        layer(torch.randn(1, 10, 32)).sum().backward()
        try:
            bsfa.attention(q, k, v, backend="triton")
        except RuntimeError as e:
            assert "triton" in str(e) and "pip install triton" in str(e), e
        else:
            raise AssertionError("backend='triton' without triton did not raise")
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr


def test_lazy_names_resolve():
    assert set(bsfa._LAZY) <= set(dir(bsfa))
    assert callable(bsfa.attention_op) and callable(bsfa.register_mask)
    assert bsfa.nn.BlockSparseMultiheadAttention.__name__ == "BlockSparseMultiheadAttention"
    with pytest.raises(AttributeError):
        bsfa.no_such_name  # noqa: B018


def test_dynamo_marker_still_what_assume_constant_result_sets():
    """``ops/custom_op.py`` marks its trace-time constants without importing Dynamo by setting the
    attribute ``torch.compiler.assume_constant_result`` sets; fail loudly if torch changes that."""
    fn = torch.compiler.assume_constant_result(lambda: 0)
    assert getattr(fn, "_dynamo_marked_constant", False) is True
    from blocksparse_fa.ops.custom_op import _handle_for, _handle_for_text

    assert _handle_for._dynamo_marked_constant and _handle_for_text._dynamo_marked_constant


# ------------------------------------------------------------------------------------------------
# align, and mask_mod callables as masks
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lq, lk", [(37, 90), (90, 37)])
def test_align_through_every_entry_point(lq, lk):
    m = bsfa.sliding_window(12) | bsfa.global_tokens(3)
    q, k, v = _rand(2, 4, lq, 8), _rand(2, 2, lk, 8, seed=2), _rand(2, 2, lk, 8, seed=3)
    for align in ("top_left", "bottom_right"):
        keep = m.to_dense(lq, lk, align=align)
        ref = _grads(lambda q, k, v: bsfa.reference_attention(q, k, v, mask=keep), (q, k, v))
        got = _grads(lambda q, k, v: bsfa.attention(q, k, v, mask=m, align=align, block_size=16), (q, k, v))
        _assert_same(got, ref, 1e-10)
        got_op = _grads(lambda q, k, v: bsfa.attention_op(q, k, v, m, align=align, block_size=16), (q, k, v))
        _assert_same(got_op, ref, 1e-10)
        core = bsfa.nn.BlockSparseAttention(m, block_size=16, align=align)
        _assert_same(_grads(core, (q, k, v)), ref, 1e-10)
        assert core.layout(lq, lk).align == align
        lay = bsfa.compile_mask(m, lq, lk, 16, align=align)
        _assert_same(_grads(lambda q, k, v: bsfa.attention(q, k, v, mask=lay), (q, k, v)), ref, 1e-10)
        sd = _grads(lambda q, k, v: bsfa.scaled_dot_product_attention(q, k, v, mask=m, align=align, enable_gqa=True,
                                                                      block_size=16), (q, k, v))
        _assert_same(sd, ref, 1e-10)
    # the SDPA entry point aligns top-left by default; attention() bottom-right
    a = bsfa.scaled_dot_product_attention(q, k, v, mask=m, enable_gqa=True)
    assert rel_err(a, bsfa.attention(q, k, v, mask=m, align="top_left")) < 1e-12
    with pytest.raises(ValueError, match="conflicts"):
        bsfa.attention(q, k, v, mask=bsfa.compile_mask(m, lq, lk, align="top_left"), align="bottom_right")
    with pytest.raises(ValueError, match="align"):
        bsfa.attention(q, k, v, mask=m, align="center")


def test_align_under_torch_compile():
    torch._dynamo.reset()
    m = bsfa.causal() & bsfa.sliding_window(8)
    q, k, v = (_rand(1, 2, 24, 8, dtype=torch.float32, seed=s).requires_grad_() for s in (1, 2, 3))
    k2, v2 = (torch.cat([t, t], 2).detach().requires_grad_() for t in (k, v))  # Lk = 48 != Lq

    def f(q, k, v):
        return bsfa.attention_op(q, k, v, m, align="top_left", block_size=16)

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k2, v2)
    ref = bsfa.reference_attention(q, k2, v2, mask=m.to_dense(24, 48, align="top_left"))
    assert rel_err(out, ref) < 1e-5
    (g,) = torch.autograd.grad(out.sum(), q)
    (g_ref,) = torch.autograd.grad(ref.sum(), q)
    assert rel_err(g, g_ref) < 1e-5


def test_mask_mod_callable_as_mask():
    ids = torch.tensor([0] * 30 + [1] * 50)

    def doc_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    q, k, v = _rand(1, 2, 80, 8), _rand(1, 2, 80, 8, seed=2), _rand(1, 2, 80, 8, seed=3)
    keep = (ids[:, None] == ids[None, :]) & torch.ones(80, 80, dtype=torch.bool).tril()
    ref = _grads(lambda q, k, v: bsfa.reference_attention(q, k, v, mask=keep), (q, k, v))
    for fn in (lambda q, k, v: bsfa.attention(q, k, v, mask=doc_causal, block_size=16),
               lambda q, k, v: bsfa.scaled_dot_product_attention(q, k, v, mask=doc_causal, block_size=16),
               lambda q, k, v: bsfa.nn.BlockSparseAttention(doc_causal, block_size=16)(q, k, v)):
        _assert_same(_grads(fn, (q, k, v)), ref, 1e-10)


@pytest.mark.parametrize("which", ["layout", "documents"])
def test_second_derivatives_exact_on_torch_refused_on_triton(which):
    """A backward with ``create_graph=True``: the PyTorch backend's gradients are differentiable
    and give float64's second derivatives; the Triton kernels' are not, and such a call is refused
    by name instead of silently dropping attention's part of the second derivative."""
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([20, 30, 14]))
    mask = (bsfa.causal() & (bsfa.window(16) | bsfa.global_tokens(4)) if which == "layout"
            else bsfa.causal() & bsfa.document(ids))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))

    def second(fn):
        out = fn(q, k, v)
        dq = torch.autograd.grad((out * out).sum(), q, create_graph=True)[0]
        return torch.autograd.grad((dq * dq).sum(), (k, v))

    got = second(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, backend="torch", block_size=16))
    want = second(lambda q, k, v: bsfa.reference_attention(q, k, v, mask=mask))
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-10
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = bsfa.attention(q32, k32, v32, mask=mask, backend="triton", block_size=16)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(out.sum(), q32, create_graph=True)
    assert torch.autograd.grad(out.sum(), q32)[0].isfinite().all()  # a plain backward still runs


@pytest.mark.parametrize("which", ["layout", "documents"])
def test_autocast_casts_inputs_as_for_sdpa(which):
    """Inside ``torch.autocast`` the entry points cast q, k, v as autocast casts SDPA's inputs (a
    float32 QK-norm beside a bf16 v included) and run with autocast off: the results of the same
    call on bf16 inputs outside the region, bit for bit, eager (backward inside the region too) and
    compiled; float32 gradients reach float32 leaves. Outside a region nothing is cast."""
    ids = torch.repeat_interleave(torch.arange(2), torch.tensor([30, 34]))
    mask = bsfa.causal() if which == "layout" else bsfa.causal() & bsfa.document(ids)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g).requires_grad_() for _ in range(3))
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    want = bsfa.attention(qb, kb, vb, mask=mask, backend="torch")
    want_g = torch.autograd.grad(want.float().sum(), (qb, kb, vb))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = bsfa.attention(q, k, v, mask=mask, backend="torch")
        got_g = torch.autograd.grad(got.float().sum(), (q, k, v))
        op = bsfa.attention_op(q, k, v, mask, backend="torch")
        mixed = bsfa.attention(q, k, vb, mask=mask, backend="torch")
        sdpa = bsfa.scaled_dot_product_attention(q, k, v, mask=mask, backend="torch")
        compiled = torch.compile(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, backend="torch"),
                                 backend="aot_eager", fullgraph=True)(q, k, v)
    for out in (got, op, mixed, sdpa, compiled):
        assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    for a, b in zip(got_g, want_g):
        assert a.dtype == torch.float32 and torch.equal(a, b.float())
    assert bsfa.attention(q, k, v, mask=mask, backend="torch").dtype == torch.float32
    with pytest.raises((TypeError, ValueError)):
        bsfa.attention(q, k, vb, mask=mask, backend="torch")  # mixed dtypes outside a region: refused
