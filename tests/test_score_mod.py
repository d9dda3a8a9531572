"""Score modifiers (ALiBi, soft-cap): API and errors, the PyTorch backend and the Triton kernels
(interpreter) against the float64 reference, outputs and all three gradients; no recompilation
when only the modifier's values change."""

import math

import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.ops import triton_backend as tb
from conftest import rel_err

H, HKV = 4, 2
SLOPES = torch.tensor([0.5, 0.25, 0.125, 1.0])

MODS = {
    "alibi": bsfa.alibi(SLOPES),
    "softcap": bsfa.softcap(1.5),
    "both": bsfa.alibi(SLOPES) + bsfa.softcap(2.0),
}
MASKS = {
    "partial_heavy": "window(5) | global_tokens(3)",  # narrow window: mostly partial blocks
    "dense": None,
    "causal_empty_rows": "causal",  # with Lq > Lk bottom-right: the first Lq - Lk rows attend nothing
}


def _qkv(Lq, Lk, D=16, dtype=torch.float32, B=1):
    mk = lambda *s: (torch.randn(*s, dtype=dtype) * 1.5).requires_grad_()  # noqa: E731  (scores past the cap)
    return mk(B, H, Lq, D), mk(B, HKV, Lk, D), mk(B, HKV, Lk, D)


def _run(backend, mod, mask, Lq, Lk, dtype, block=16, opts=None):
    q, k, v = _qkv(Lq, Lk, dtype=dtype)
    out = bsfa.attention(q, k, v, mask=mask, score_mod=mod, backend=backend, block_size=block, kernel_options=opts)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = bsfa.reference_attention(qd, kd, vd, mask, score_mod=mod)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    return out, grads, ref, ref_grads


# ------------------------------------------------------------------------------------------------
# API
# ------------------------------------------------------------------------------------------------
def test_combination_hash_and_serialisation():
    a = bsfa.alibi(SLOPES.tolist()) + bsfa.softcap(30.0)
    b = bsfa.softcap(30) + bsfa.alibi(tuple(SLOPES.tolist()))
    assert a == b and hash(a) == hash(b) and a.kind == 3
    assert bsfa.alibi(0.5).kind == 1 and bsfa.softcap(5.0).kind == 2 and bsfa.bias(torch.ones(3)).kind == 8
    assert bsfa.ScoreMod.from_dict(a.to_dict()) == a
    assert str(a) == "alibi([0.5, 0.25, 0.125, 1.0]) + softcap(30.0)"
    assert a != bsfa.alibi((SLOPES * 2).tolist()) + bsfa.softcap(30.0)
    # tensors are held by reference: equal (and hashed) by identity, values read at each call
    t = bsfa.alibi(SLOPES) + bsfa.softcap(30.0)
    assert t == bsfa.softcap(30.0) + bsfa.alibi(SLOPES) and hash(t) == hash(bsfa.softcap(30.0) + bsfa.alibi(SLOPES))
    assert t != a and t != bsfa.alibi(SLOPES.clone()) + bsfa.softcap(30.0) and t.slopes is SLOPES
    assert str(t) == str(a) and bsfa.ScoreMod.from_dict(t.to_dict()) == a
    bt = torch.zeros(4, 1, 7)
    m = bsfa.bias(bt) + bsfa.alibi(0.5)
    assert m.bias is bt and m.kind == 9 and m == bsfa.alibi(0.5) + bsfa.bias(bt) and m != bsfa.bias(bt.clone())
    assert str(m) == "alibi(0.5) + bias(tensor(shape=(4, 1, 7)))"
    s = bsfa.alibi_slopes(8)
    assert s.shape == (8,) and torch.allclose(s, 2.0 ** (-torch.arange(1, 9, dtype=torch.float32)))
    assert bsfa.alibi_slopes(6).shape == (6,)


@pytest.mark.parametrize("make, err, words", [
    (lambda: bsfa.softcap(0.0), ValueError, "cap must be a positive"),
    (lambda: bsfa.softcap(-1), ValueError, "cap must be a positive"),
    (lambda: bsfa.softcap(float("inf")), ValueError, "cap must be a positive"),
    (lambda: bsfa.softcap("3"), TypeError, "cap must be a real"),
    (lambda: bsfa.alibi(torch.tensor([1, 2])), TypeError, "floating-point"),
    (lambda: bsfa.alibi(torch.ones(2, 2)), ValueError, "1-D tensor of length H"),
    (lambda: bsfa.bias([1.0]), TypeError, "must be a torch.Tensor"),
    (lambda: bsfa.bias(torch.ones(3, dtype=torch.int32)), TypeError, "floating-point"),
    (lambda: bsfa.bias(torch.ones(3)) + bsfa.bias(torch.ones(3)), ValueError, "two bias"),
    (lambda: bsfa.score_fn(lambda s, b, h, i, j: s) + bsfa.bias(torch.ones(3)), ValueError, "does not combine"),
    (lambda: bsfa.alibi(float("nan")), ValueError, "finite"),
    (lambda: bsfa.alibi([]), ValueError, "empty"),
    (lambda: bsfa.alibi(0.5) + bsfa.alibi(0.25), ValueError, "two alibi"),
    (lambda: bsfa.softcap(1.0) + bsfa.softcap(2.0), ValueError, "two softcap"),
])
def test_bad_modifiers(make, err, words):
    with pytest.raises(err, match=words):
        make()


def test_bad_score_mod_argument():
    q, k, v = _qkv(8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"3 slopes but q has H=4"):
        bsfa.attention(q, k, v, score_mod=bsfa.alibi([0.1, 0.2, 0.3]), backend="torch")
    with pytest.raises(TypeError, match="score_mod must be a ScoreMod"):
        bsfa.attention(q, k, v, score_mod=lambda s, b, h, i, j: s, backend="torch")
    with pytest.raises(ValueError, match=r"bias\(\) tensor of shape \(3, 8, 8\) does not broadcast to .* \(1, 4, 8, 8\)"):
        bsfa.attention(q, k, v, score_mod=bsfa.bias(torch.zeros(3, 8, 8, dtype=torch.float64)), backend="torch")
    with pytest.raises(ValueError, match="does not broadcast"):  # a bias may not enlarge the output
        bsfa.attention(q, k, v, score_mod=bsfa.bias(torch.zeros(2, 4, 8, 8, dtype=torch.float64)), backend="torch")
    with pytest.raises(ValueError, match=r"the bias\(\) tensor is on meta but q is on cpu"):
        bsfa.attention(q, k, v, score_mod=bsfa.bias(torch.zeros(8, device="meta")), backend="torch")
    with pytest.raises(ValueError, match="slopes are a meta tensor"):
        bsfa.attention(q, k, v, score_mod=bsfa.alibi(torch.ones(4, device="meta")), backend="torch")


def test_reference_semantics_by_hand():
    """ALiBi adds ``slope * (key_pos - query_pos)`` (bottom-right: query i at i + Lk - Lq; top-left
    at i), then the soft-cap; written out here independently of the library's helper."""
    Lq, Lk, D = 5, 9, 8
    q, k, v = (t.detach().double() for t in _qkv(Lq, Lk, D))
    mod = bsfa.alibi(SLOPES) + bsfa.softcap(2.0)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for align, off in (("bottom_right", Lk - Lq), ("top_left", 0)):
        s = q @ kk.transpose(-1, -2) / math.sqrt(D)
        i = torch.arange(Lq).view(-1, 1) + off
        j = torch.arange(Lk).view(1, -1)
        s = s + SLOPES.double().view(1, H, 1, 1) * (j - i)
        s = 2.0 * torch.tanh(s / 2.0)
        want = torch.softmax(s, -1) @ vv
        got = bsfa.reference_attention(q, k, v, None, score_mod=mod, align=align)
        assert torch.allclose(got, want, atol=1e-12)
        got_be = bsfa.attention(q, k, v, "full", score_mod=mod, backend="torch", align=align)
        assert torch.allclose(got_be, want, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# the PyTorch backend (float64)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", MASKS.values(), ids=list(MASKS))
@pytest.mark.parametrize("mod", MODS.values(), ids=list(MODS))
def test_torch_backend(mod, mask):
    out, grads, ref, ref_grads = _run("torch", mod, mask, 45, 29, torch.float64)
    assert rel_err(out, ref) < 1e-12
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-12


def test_auto_on_cpu_walks_blocks_and_strided_rewrite_is_exact(cpu_path):
    """``backend="auto"`` on CPU keeps the block walk (the dense SDPA path has no modifiers), and a
    mask the compiler rewrites (strided: residue classes) stays exact with position-dependent ALiBi."""
    cpu_path("dense")
    mod = MODS["both"]
    q, k, v = (t.detach().double() for t in _qkv(64, 64))
    out = bsfa.attention(q, k, v, "strided(8)", score_mod=mod, block_size=16)
    assert bsfa.last_backend() == "torch"
    ref = bsfa.reference_attention(q, k, v, "strided(8)", score_mod=mod)
    assert rel_err(out, ref) < 1e-12


# ------------------------------------------------------------------------------------------------
# the Triton kernels (interpreter, float32)
# ------------------------------------------------------------------------------------------------
TOL = 5e-6


@pytest.mark.interpreter
@pytest.mark.parametrize("mask", MASKS.values(), ids=list(MASKS))
@pytest.mark.parametrize("mod", MODS.values(), ids=list(MODS))
def test_triton_kernels(mod, mask):
    Lq, Lk = (45, 29) if mask == "causal" else (37, 53)
    out, grads, ref, ref_grads = _run("triton", mod, mask, Lq, Lk, torch.float32)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert rel_err(out, ref) < TOL, rel_err(out, ref)
    for g, r, name in zip(grads, ref_grads, "qkv"):
        assert rel_err(g, r) < TOL, (name, rel_err(g, r))
    if mask == "causal":  # rows before the first key: zeros and zero gradients, no NaN
        empty = Lq - Lk
        assert torch.equal(out[:, :, :empty], torch.zeros_like(out[:, :, :empty]))
        assert torch.equal(grads[0][:, :, :empty], torch.zeros_like(grads[0][:, :, :empty]))


@pytest.mark.interpreter
def test_triton_top_left_and_shapes():
    """Top-left alignment, a block of 32 with 16-row kernel tiles, head dim 24 (padded)."""
    mod = MODS["both"]
    q, k, v = _qkv(21, 40, D=24)
    out = bsfa.attention(q, k, v, "causal & window(11)", score_mod=mod, backend="triton", block_size=32,
                         align="top_left")
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = bsfa.reference_attention(qd, kd, vd, "causal & window(11)", score_mod=mod, align="top_left")
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    assert rel_err(out, ref) < TOL
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < TOL


@pytest.mark.interpreter
def test_values_do_not_select_kernel_variants():
    """Plans (and so the kernels' constexprs) key on which modifiers are present, not on their
    values: new slopes or a new cap reuse the same plan; the constexpr SCORE_MOD is absent without
    a modifier (the kernels' code is then what it was before modifiers existed)."""
    q, k, v = (t.detach() for t in _qkv(32, 32))
    lay = bsfa.compile_mask(bsfa.causal(), 32, 32, 16)
    outs = []
    for mod in (bsfa.alibi(SLOPES) + bsfa.softcap(2.0), bsfa.alibi(SLOPES * 3) + bsfa.softcap(7.0)):
        outs.append(bsfa.attention(q, k, v, lay, score_mod=mod, backend="triton"))
        keys = sorted(str(key) for key in lay.cache if isinstance(key, tuple) and key[:1] == ("fwd",))
        if len(outs) == 1:
            first = keys
    assert keys == first and len(keys) == 1
    assert not torch.allclose(outs[0], outs[1])  # the new values did reach the kernel
    plans = [p for key, p in lay.cache.items() if isinstance(key, tuple) and key[:1] == ("fwd",)]
    assert plans[0].consts["SCORE_MOD"] == 3
    bsfa.attention(q, k, v, lay, backend="triton")
    plain = [p for key, p in lay.cache.items() if isinstance(key, tuple) and key[:1] == ("fwd",) and p is not plans[0]]
    assert len(plain) == 1 and "SCORE_MOD" not in plain[0].consts


@pytest.mark.interpreter
def test_triton_nan_free_with_huge_scores():
    """Scores far past the cap and strong slopes: finite outputs and gradients."""
    q, k, v = _qkv(24, 24)
    with torch.no_grad():
        q.mul_(40.0)
    out = bsfa.attention(q, k, v, "causal", score_mod=bsfa.alibi(8.0) + bsfa.softcap(5.0), backend="triton",
                         block_size=16)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


# ------------------------------------------------------------------------------------------------
# context-parallel shards: the modifier sees global positions (block position tables)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_shard_sees_global_positions(backend):
    import numpy as np

    from blocksparse_fa.compiler.shard import shard_layout
    from blocksparse_fa.ops import dispatch
    from blocksparse_fa.ops.validate import Shapes

    dtype = torch.float64 if backend == "torch" else torch.float32
    tol = 1e-12 if backend == "torch" else 2e-5
    mod = MODS["both"]
    L, D, bm = 70, 8, 16
    layout = bsfa.compile_mask(bsfa.parse("causal & window(20)"), L, L, block_size=bm, rewrite=False)
    rows = np.array([3, 0, 2])  # unsorted, with the ragged last block
    st = layout.block_states().numpy().reshape(-1, 5, 5)
    cols = np.nonzero(st[:, rows].any(axis=(0, 1)))[0]
    sh = shard_layout(layout, rows, cols)
    gi = torch.from_numpy(sh.positions.rows(np.arange(sh.q_len), bm))
    gj = torch.from_numpy(sh.positions.keys(np.arange(sh.kv_len), bm))
    q = torch.randn(1, H, L, D, dtype=dtype)
    k, v = (torch.randn(1, HKV, L, D, dtype=dtype) for _ in range(2))
    s = Shapes(1, H, HKV, L, L, D)
    keep = torch.zeros(L, L, dtype=torch.bool)
    keep[gi[:, None], gj[None, :]] = sh.to_dense()
    full = bsfa.compile_mask(bsfa.dense_mask(keep), L, L, block_size=bm)
    out, lse = dispatch.forward(q, k, v, full, s, 0.3, 0.0, 0, backend, score_mod=mod)
    do = torch.randn_like(out)
    do_rows = torch.zeros_like(do)
    do_rows[:, :, gi] = do[:, :, gi]
    dq, dk, dv = dispatch.backward(q, k, v, out, lse, do_rows, full, s, 0.3, 0.0, 0, backend, score_mod=mod)
    ss = Shapes(1, H, HKV, sh.q_len, sh.kv_len, D)
    ql, kl, vl = q[:, :, gi], k[:, :, gj], v[:, :, gj]
    o2, l2 = dispatch.forward(ql, kl, vl, sh, ss, 0.3, 0.0, 0, backend, score_mod=mod)
    g2 = dispatch.backward(ql, kl, vl, o2, l2, do[:, :, gi], sh, ss, 0.3, 0.0, 0, backend, score_mod=mod)
    ref = bsfa.reference_attention(q.double(), k.double(), v.double(), keep, scale=0.3, score_mod=mod)
    assert (out.double() - ref).abs().max() < tol * 10
    for a, b in ((o2, out[:, :, gi]), (g2[0], dq[:, :, gi]), (g2[1], dk[:, :, gj]), (g2[2], dv[:, :, gj])):
        assert (a - b).abs().max() < tol


@pytest.mark.interpreter
def test_triton_bfloat16_within_eager_error():
    """bfloat16 kernels: error (vs float64) at most 2x that of eager attention in bfloat16 plus a floor."""
    mod = MODS["both"]
    mask = MASKS["partial_heavy"]
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in _qkv(37, 53))
    out = bsfa.attention(q, k, v, mask, score_mod=mod, backend="triton", block_size=16)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = bsfa.reference_attention(qd, kd, vd, mask, score_mod=mod)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    eager = bsfa.reference_attention(q, k, v, mask, score_mod=mod, upcast=False)
    eager_grads = torch.autograd.grad(eager, (q, k, v), do)
    for ours, e, r in zip((out, *grads), (eager, *eager_grads), (ref, *ref_grads)):
        assert rel_err(ours, r) <= 2 * rel_err(e, r) + 1e-3, (rel_err(ours, r), rel_err(e, r))


# ------------------------------------------------------------------------------------------------
# Flex-style callables (PyTorch backend only)
# ------------------------------------------------------------------------------------------------
def test_score_fn_matches_fused_modifiers():
    """A callable that writes ALiBi + soft-cap by hand gives the fused modifiers' results (Lq = Lk:
    the row index is then the position)."""
    sl = SLOPES.double()
    fn = lambda s, b, h, qi, kj: 2.0 * torch.tanh((s + sl[h] * (kj - qi)) / 2.0)  # noqa: E731
    q, k, v = _qkv(40, 40, dtype=torch.float64)
    do = torch.randn(1, H, 40, 16, dtype=torch.float64)
    res = []
    for mod in (bsfa.score_fn(fn), MODS["both"]):
        out = bsfa.attention(q, k, v, "causal & window(9)", score_mod=mod, backend="torch", block_size=16)
        res.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    for a, b in zip(*res):
        assert rel_err(a, b) < 1e-12


def test_score_fn_against_reference():
    """A nonlinear callable using every index (B = 2, GQA, Lq != Lk, partial and empty rows)."""
    fn = lambda s, b, h, qi, kj: s + torch.sin(s) * 0.5 + 0.3 * b - 0.1 * h + 0.01 * (qi % 3) * kj  # noqa: E731
    mod = bsfa.score_fn(fn)
    q, k, v = _qkv(45, 29, dtype=torch.float64, B=2)
    for mask in ("causal", "window(5) | global_tokens(3)"):
        out = bsfa.attention(q, k, v, mask, score_mod=mod, backend="torch", block_size=16)
        do = torch.randn_like(out)
        got = (out, *torch.autograd.grad(out, (q, k, v), do))
        ref = bsfa.reference_attention(q, k, v, mask, score_mod=mod)
        want = (ref, *torch.autograd.grad(ref, (q, k, v), do))
        for a, b in zip(got, want):
            assert torch.isfinite(a).all() and rel_err(a, b) < 1e-12


def test_score_fn_errors():
    fn = lambda s, b, h, qi, kj: s  # noqa: E731
    q, k, v = _qkv(8, 8)
    with pytest.raises(NotImplementedError, match="PyTorch backend only"):
        bsfa.attention(q, k, v, score_mod=bsfa.score_fn(fn), backend="triton")
    with pytest.raises(ValueError, match="does not combine"):
        bsfa.score_fn(fn) + bsfa.softcap(2.0)
    with pytest.raises(TypeError, match="cannot be serialised"):
        bsfa.score_fn(fn).to_dict()
    with pytest.raises(TypeError, match="must be a callable"):
        bsfa.score_fn(3)
    with pytest.raises(ValueError, match="returned shape"):
        bad = bsfa.score_fn(lambda s, b, h, qi, kj: s[..., :1, :1, :2])
        bsfa.attention(q.double(), k.double(), v.double(), score_mod=bad, backend="torch")
    assert bsfa.score_fn(fn) == bsfa.score_fn(fn) and hash(bsfa.score_fn(fn)) == hash(bsfa.score_fn(fn))


def test_score_fn_auto_backend_takes_pytorch_path(monkeypatch):
    """Where ``backend="auto"`` would pick the Triton kernels (a GPU), a ``score_fn`` callable runs
    on the PyTorch backend instead of raising; ``backend="triton"`` still refuses it."""
    from blocksparse_fa.ops import api

    monkeypatch.setattr(api, "resolve_backend", lambda backend, device, dtype: "triton")
    fn = lambda s, b, h, qi, kj: s + 0.1 * (qi - kj)  # noqa: E731
    q, k, v = (t.detach().double() for t in _qkv(9, 9))
    out = bsfa.attention(q, k, v, mask=bsfa.causal(), score_mod=bsfa.score_fn(fn))
    ref = bsfa.reference_attention(q, k, v, bsfa.causal(), score_mod=bsfa.score_fn(fn))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    with pytest.raises(NotImplementedError, match="PyTorch backend only"):
        bsfa.attention(q, k, v, score_mod=bsfa.score_fn(fn), backend="triton")


@pytest.mark.interpreter
def test_triton_split_tiles():
    """Work lists that split heavy tiles (global tokens) into pieces merged through their LSEs, in
    the forward and the backward: the modifier is applied to every piece alike."""
    mod = MODS["both"]
    mask = "global_tokens(16) | window(3)"
    out, grads, ref, ref_grads = _run("triton", mod, mask, 96, 96, torch.float32, opts={"split_chunk": 1.5})
    assert rel_err(out, ref) < TOL
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < TOL


# ------------------------------------------------------------------------------------------------
# bias(tensor): an additive bias broadcast to (B, H, Lq, Lk), learnable (dBias), with learnable slopes
# ------------------------------------------------------------------------------------------------
BIAS_SHAPES = {  # (shape given Lq, Lk, B): per head and key, relative-position (H, Lq, Lk), padding-like, full
    "head_key": lambda Lq, Lk, B: (1, H, 1, Lk),
    "rel_pos": lambda Lq, Lk, B: (H, Lq, Lk),
    "padding": lambda Lq, Lk, B: (B, 1, 1, Lk),
    "full": lambda Lq, Lk, B: (B, H, Lq, Lk),
    "per_row": lambda Lq, Lk, B: (H, Lq, 1),  # broadcast over the keys: matters only through a soft-cap
}


@pytest.fixture
def poisoned(monkeypatch):
    """Every floating ``torch.empty`` comes back filled with NaN: an output element the kernels do
    not write shows up (as the GPU validation's poisoned allocator does)."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t

    monkeypatch.setattr(torch, "empty", empty)


def _bias_case(shape, Lq, Lk, dtype, B=2, learn_slopes=False, cap=None, D=16):
    """Inputs, a bias (and slopes) requiring grad, the modifier and the float64 reference results."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in _qkv(Lq, Lk, D=D, B=B))
    b = (torch.randn(*BIAS_SHAPES[shape](Lq, Lk, B), dtype=torch.float64) * 2).to(dtype).requires_grad_()
    mod = bsfa.bias(b)
    extra = [b]
    if learn_slopes:
        sl = SLOPES.clone().to(dtype).requires_grad_()
        mod, extra = mod + bsfa.alibi(sl), extra + [sl]
    if cap is not None:
        mod = mod + bsfa.softcap(cap)
    return (q, k, v), extra, mod


def _check_against_reference(backend, ins, extra, mod, mask, tol, align="bottom_right", block=16):
    q, k, v = ins
    out = bsfa.attention(q, k, v, mask, score_mod=mod, backend=backend, block_size=block, align=align)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, *extra), do)
    d64 = lambda t: t.detach().double().requires_grad_()  # noqa: E731
    q64, k64, v64, *x64 = (d64(t) for t in (q, k, v, *extra))
    mod64 = bsfa.bias(x64[0]) + (bsfa.alibi(x64[1]) if len(x64) > 1 else bsfa.ScoreMod())
    if mod.cap is not None:
        mod64 = mod64 + bsfa.softcap(mod.cap)
    ref = bsfa.reference_attention(q64, k64, v64, mask, score_mod=mod64, align=align)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64, *x64), do.double())
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    for g, r, x, name in zip(grads, ref_grads, (q, k, v, *extra), ("dq", "dk", "dv", "dbias", "dslopes")):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert rel_err(g, r) < tol, (name, rel_err(g, r))
    return out, grads


@pytest.mark.parametrize("shape, learn_slopes, cap", [
    *((s, False, None) for s in BIAS_SHAPES if s != "per_row"),  # per row, its true gradient is 0 without a cap
    *((s, True, 2.0) for s in BIAS_SHAPES)])
def test_bias_torch_backend(shape, learn_slopes, cap):
    """float64 PyTorch backend against the reference: output, dq, dk, dv, dBias (and dSlopes), with
    GQA, Lq > Lk (bottom-right: empty rows) and a partial-heavy mask."""
    ins, extra, mod = _bias_case(shape, 45, 29, torch.float64, learn_slopes=learn_slopes, cap=cap)
    out, _ = _check_against_reference("torch", ins, extra, mod, "causal & (window(5) | global_tokens(3))", 1e-12)
    assert torch.equal(out[:, :, :16], torch.zeros_like(out[:, :, :16]))  # rows before the first key


def test_bias_applies_after_alibi_and_before_softcap():
    """The order, written out by hand: softcap(scale·q·k + slope·(j - qp) + bias)."""
    Lq, Lk, D = 6, 9, 8
    q, k, v = (t.detach().double() for t in _qkv(Lq, Lk, D))
    b = torch.randn(H, Lq, Lk, dtype=torch.float64)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(D)
    s = s + SLOPES.double().view(1, H, 1, 1) * (torch.arange(Lk).view(1, -1) - (torch.arange(Lq).view(-1, 1) + 3)) + b
    want = torch.softmax(1.5 * torch.tanh(s / 1.5), -1) @ vv
    mod = bsfa.softcap(1.5) + bsfa.bias(b) + bsfa.alibi(SLOPES)
    assert torch.allclose(bsfa.reference_attention(q, k, v, None, score_mod=mod), want, atol=1e-12)
    assert torch.allclose(bsfa.attention(q, k, v, "full", score_mod=mod, backend="torch"), want, atol=1e-12)


TRITON_BIAS_CASES = {  # name: (bias shape, Lq, Lk, mask, learn slopes, cap, align)
    "head_key, partial-heavy, alibi+softcap": ("head_key", 29, 43, "window(5) | global_tokens(3)", True, 2.0,
                                               "bottom_right"),
    "rel_pos, causal empty rows, softcap": ("rel_pos", 45, 29, "causal", False, 1.5, "bottom_right"),
    "padding, dense, top-left": ("padding", 21, 40, None, False, None, "top_left"),
    "full, window": ("full", 40, 40, "causal & window(11)", True, None, "bottom_right"),
    "per_row, dense ragged keys, alibi+softcap": ("per_row", 21, 45, None, True, 1.0, "bottom_right"),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(TRITON_BIAS_CASES))
def test_bias_triton(case, poisoned):
    """The kernels (interpreter, float32) against float64: output and every gradient, including the
    bias' (atomic adds in the dK/dV programs, summed over its broadcast dims) and the slopes'."""
    shape, Lq, Lk, mask, learn, cap, align = TRITON_BIAS_CASES[case]
    ins, extra, mod = _bias_case(shape, Lq, Lk, torch.float32, learn_slopes=learn, cap=cap)
    _check_against_reference("triton", ins, extra, mod, mask, TOL, align=align)


@pytest.mark.interpreter
def test_bias_triton_bfloat16_within_eager_error():
    """bfloat16 inputs and bias: kernel error (vs float64) at most 2x that of eager bfloat16 attention
    plus a floor, for the output and dq, dk, dv, dBias."""
    ins, (b,), mod = _bias_case("rel_pos", 29, 43, torch.bfloat16, cap=2.0, B=1)
    mod = mod + bsfa.alibi(SLOPES)
    mask = "window(5) | global_tokens(3)"
    q, k, v = ins
    out = bsfa.attention(q, k, v, mask, score_mod=mod, backend="triton", block_size=16)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, b), do)
    q64, k64, v64, b64 = (t.detach().double().requires_grad_() for t in (q, k, v, b))
    mod64 = bsfa.bias(b64) + bsfa.alibi(SLOPES) + bsfa.softcap(2.0)
    ref = bsfa.reference_attention(q64, k64, v64, mask, score_mod=mod64)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64, b64), do.double())
    eager = bsfa.reference_attention(q, k, v, mask, score_mod=mod, upcast=False)
    eager_grads = torch.autograd.grad(eager, (q, k, v, b), do)
    assert grads[3].dtype == torch.bfloat16
    for ours, e, r in zip((out, *grads), (eager, *eager_grads), (ref, *ref_grads)):
        assert rel_err(ours, r) <= 2 * rel_err(e, r) + 1e-3, (rel_err(ours, r), rel_err(e, r))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("cap", [None, 2.0], ids=["plain", "softcap"])
def test_bias_nan_and_inf_at_masked_elements_never_leak(backend, cap):
    """NaN and -inf in the bias where the mask removes the element (inside partial blocks, and in
    rows with nothing to attend) change nothing: the output and every gradient equal those of a
    clean bias, all finite, and the bias gradient is 0 there."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    Lq, Lk = 45, 29
    mask = bsfa.causal() & bsfa.window(6)
    keep = mask.to_dense(Lq, Lk)
    q, k, v = (t.detach().to(dtype) for t in _qkv(Lq, Lk))
    clean = torch.randn(1, H, Lq, Lk, dtype=dtype)
    poison = clean.clone()
    poison[:, :, ~keep] = float("nan")
    poison[:, :, :20][:, :, ~keep[:20]] = float("-inf")  # rows 0..15 attend nothing
    res = []
    for b in (clean, poison):
        qq, kk, vv, bb = (t.clone().requires_grad_() for t in (q, k, v, b))
        mod = bsfa.bias(bb) + (bsfa.softcap(cap) if cap else bsfa.ScoreMod())
        out = bsfa.attention(qq, kk, vv, mask, score_mod=mod, backend=backend, block_size=16)
        res.append((out, *torch.autograd.grad(out, (qq, kk, vv, bb), torch.ones_like(out))))
    for a, c in zip(*res):
        assert torch.isfinite(c).all() and torch.equal(a, c)
    assert torch.equal(res[1][4][:, :, ~keep], torch.zeros_like(res[1][4][:, :, ~keep]))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_bias_minus_inf_padding_on_kept_keys(backend):
    """A padding-like bias ``(B, 1, 1, Lk)`` of -inf on kept keys: a sequence whose first keys are all
    -inf (a whole block: the unmasked loop must not take -inf - -inf) matches the reference; a
    sequence with every key at -inf outputs zeros with zero gradients, never NaN."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in _qkv(40, 40, B=2))
    b = torch.zeros(2, 1, 1, 40, dtype=dtype)
    b[0, ..., :20] = float("-inf")
    b[1] = float("-inf")
    b.requires_grad_()
    out = bsfa.attention(q, k, v, None, score_mod=bsfa.bias(b), backend=backend, block_size=16)
    grads = torch.autograd.grad(out, (q, k, v, b), torch.randn_like(out))
    ref = bsfa.reference_attention(q, k, v, None, score_mod=bsfa.bias(b))
    assert all(torch.isfinite(t).all() for t in (out, *grads))
    assert rel_err(out[0], ref[0]) < (1e-12 if backend == "torch" else TOL)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(grads[0][1], torch.zeros_like(grads[0][1]))


@pytest.mark.interpreter
def test_bias_values_do_not_select_kernel_variants():
    """A new bias tensor (same shape and dtype) and new slopes reuse the forward and backward plans
    and compile no new kernel: their values are run-time arguments. Without broadcast dims each
    bias element gets one atomic add onto 0, so dBias is bit-reproducible."""
    from blocksparse_fa.kernels import _attn_bwd, _attn_fwd

    def n_compiled(fn):
        return sum(len(c) for c in getattr(fn, "cache", {}).values()) if hasattr(fn, "cache") else None

    q, k, v = (t.detach().requires_grad_() for t in _qkv(32, 32))
    lay = bsfa.compile_mask(bsfa.causal(), 32, 32, 16)

    def run(b):
        b = b.clone().requires_grad_()
        out = bsfa.attention(q, k, v, lay, score_mod=bsfa.bias(b) + bsfa.softcap(3.0), backend="triton")
        return out, torch.autograd.grad(out.sum(), b)[0]

    first = run(torch.randn(1, H, 32, 32))
    plans = {key for key in lay.cache if isinstance(key, tuple) and key[:1] in (("fwd",), ("bwd",))}
    compiled = (n_compiled(_attn_fwd), n_compiled(_attn_bwd))
    b2 = torch.randn(1, H, 32, 32) * 3
    second, again = run(b2), run(b2)
    assert {key for key in lay.cache if isinstance(key, tuple) and key[:1] in (("fwd",), ("bwd",))} == plans
    assert (n_compiled(_attn_fwd), n_compiled(_attn_bwd)) == compiled
    assert not torch.allclose(first[0], second[0])  # the new values did reach the kernels
    assert torch.equal(second[1], again[1])  # one atomic add per element: deterministic


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_bias_with_dropout(backend):
    """Dropout enters dS (and so dBias) as it enters dQ and dK: against the reference given the same
    keep-mask."""
    dtype, tol = (torch.float64, 1e-12) if backend == "torch" else (torch.float32, TOL)
    (q, k, v), (b, sl), mod = _bias_case("head_key", 29, 35, dtype, B=1, learn_slopes=True, cap=2.0)
    mask = "causal & window(9)"
    out = bsfa.attention(q, k, v, mask, score_mod=mod, backend=backend, block_size=16, dropout_p=0.3, dropout_seed=7)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, b, sl), do)
    keep = bsfa.dropout_keep_mask(1, H, 29, 35, 0.3, 7)
    ins = [t.detach().double().requires_grad_() for t in (q, k, v, b, sl)]
    mod64 = bsfa.bias(ins[3]) + bsfa.alibi(ins[4]) + bsfa.softcap(2.0)
    ref = bsfa.reference_attention(*ins[:3], mask, score_mod=mod64, dropout_p=0.3, dropout_mask=keep)
    for g, r in zip((out, *grads), (ref, *torch.autograd.grad(ref, ins, do.double()))):
        assert rel_err(g, r) < tol, rel_err(g, r)


SLOPES_BF16_CASES = {  # name: (mask, soft-cap, differentiate the logsumexp too)
    "dense top-left": (None, None, False),
    "partial blocks, soft-cap, lse": ("window(40) | global_tokens(3)", 3.0, True),
}


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("case", list(SLOPES_BF16_CASES))
def test_bfloat16_learned_slopes_gradient_within_eager_error(backend, case):
    """bfloat16 inputs, float32 learned slopes, rows of 130 keys aligned top-left (distances up to
    129): the slopes' gradient is within 2x the error of eager bfloat16 attention (float32
    softmax) against float64. Taking each row's delta from the bfloat16 output multiplied its
    rounding by the row's mean distance (errors of 4-8 on gradients of about 20, signs flipped)."""
    torch.manual_seed(0)
    mask, cap, with_lse = SLOPES_BF16_CASES[case]
    q = torch.randn(1, H, 7, 32).bfloat16()
    k, v = torch.randn(1, HKV, 130, 32).bfloat16(), torch.randn(1, HKV, 130, 32).bfloat16()
    slopes = torch.tensor([0.3, -0.2, 0.05, 0.1])
    do, dl = torch.randn(1, H, 7, 32), torch.randn(1, H, 7)

    def slopes_grad(fn, dtype):
        sl = slopes.to(dtype).requires_grad_()
        mod = bsfa.alibi(sl) + (bsfa.softcap(cap) if cap else bsfa.ScoreMod())
        out, lse = fn(mod)
        loss = (out.double() * do.double()).sum() + (lse.double() * dl.double()).sum() * with_lse
        return torch.autograd.grad(loss, sl)[0].double()

    ours = slopes_grad(lambda m: bsfa.attention(q, k, v, mask, score_mod=m, backend=backend, block_size=16,
                                                align="top_left", return_lse=True), torch.float32)
    ref = slopes_grad(lambda m: bsfa.reference_attention(q.double(), k.double(), v.double(), mask, score_mod=m,
                                                         align="top_left", return_lse=True), torch.float64)
    eager = slopes_grad(lambda m: bsfa.reference_attention(q, k, v, mask, score_mod=m, align="top_left",
                                                           upcast=False, return_lse=True), torch.float32)
    err, eager_err = (ours - ref).abs().max().item(), (eager - ref).abs().max().item()
    assert ref.abs().max() > 5 and err <= 2 * eager_err, (ours.tolist(), ref.tolist(), err, eager_err)
