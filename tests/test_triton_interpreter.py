"""The Triton kernels under TRITON_INTERPRET=1 (set in conftest): outputs and all three gradients
against the float64 reference, at small shapes."""

import warnings

import numpy as np
import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.kernels.predicate import build_payload, generate_source, predicate_function, structure_key
from blocksparse_fa.kernels.schedule import build_worklist
from blocksparse_fa.ops import triton_backend as tb
from conftest import rel_err

pytestmark = pytest.mark.interpreter
warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy overflow in the interpreter's Philox

TOL = 5e-6  # fp32 kernels vs the float64 reference


def _qkv(B, H, Hkv, Lq, Lk, D, dtype=torch.float32):
    mk = lambda *s: torch.randn(*s, dtype=dtype, requires_grad=True)
    return mk(B, H, Lq, D), mk(B, Hkv, Lk, D), mk(B, Hkv, Lk, D)


def _check(mask, B=1, H=2, Hkv=2, Lq=70, Lk=70, D=16, block=16, dropout_p=0.0, seed=7, tol=TOL, opts=None):
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D)
    # a compiled layout: the block kernels (document masks given as expressions take the interval kernels)
    layout = bsfa.compile_mask(mask, Lq, Lk, block) if isinstance(mask, bsfa.Mask) else mask
    out, lse = bsfa.attention(q, k, v, mask=layout, backend="triton", dropout_p=dropout_p,
                              dropout_seed=seed, return_lse=True, kernel_options=opts)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    keep = bsfa.dropout_keep_mask(B, H, Lq, Lk, dropout_p, seed) if dropout_p else None
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = bsfa.reference_attention(qd, kd, vd, mask, dropout_p=dropout_p, dropout_mask=keep, return_lse=True)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    for g, r, name in zip(grads, ref_grads, "qkv"):
        assert rel_err(g, r) < tol, (name, rel_err(g, r))
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-5)
    return out, lse, grads


PRIMITIVES = [
    "full", "causal", "window(9)", "sliding_window(13)", "global_tokens(6)", "strided(7)", "strided(8)",
    "chunked(21)", "chunked(16)", "prefix_lm(17)", "summary(12, 3)", "random_blocks(2, block_size=16, seed=3)",
    "random_blocks(1, block_size=24)",
]


@pytest.mark.parametrize("text", PRIMITIVES)
def test_every_primitive(text):
    _check(bsfa.parse(text), Lq=70, Lk=83)


def test_document_block_and_dense_masks():
    ids = torch.randint(0, 4, (70,)).sort().values
    _check(bsfa.causal() & bsfa.document(ids))
    _check(bsfa.document(torch.randint(0, 3, (70,))))  # unsorted ids
    bm = torch.rand(5, 5) > 0.5
    _check(bsfa.block_mask(bm, block_size=16) | bsfa.window(3))
    _check(bsfa.dense_mask(torch.rand(70, 70) > 0.7))


@pytest.mark.parametrize("text", [
    "causal & (window(20) | global_tokens(8))", "~causal", "~(window(5) | strided(11))",
    "prefix_lm(10) & ~chunked(16) | summary(8, 2)",
])
def test_compositions(text):
    _check(bsfa.parse(text))


@pytest.mark.parametrize("H,Hkv", [(4, 2), (4, 1)])
def test_gqa_and_mqa(H, Hkv):
    _check(bsfa.load_pattern("longformer", window=10, n_global=5), H=H, Hkv=Hkv)


@pytest.mark.parametrize("Lq,Lk", [(37, 101), (101, 37), (1, 77), (97, 97)])
def test_lengths(Lq, Lk):
    _check(bsfa.causal() & bsfa.window(30), Lq=Lq, Lk=Lk)


@pytest.mark.parametrize("D", [8, 24, 32, 64])
def test_head_dims(D):
    _check(bsfa.sliding_window(20), D=D, Lq=50, Lk=50)


def test_block_sizes():
    _check(bsfa.causal(), block=(16, 32), Lq=90, Lk=90)
    _check(bsfa.causal(), block=32, Lq=90, Lk=90)


def test_fully_masked_rows_are_zero_with_zero_grads():
    # causal with Lq > Lk: the first Lq - Lk rows see nothing
    out, lse, grads = _check(bsfa.causal(), Lq=60, Lk=25)
    assert (out[:, :, :35] == 0).all() and (grads[0][:, :, :35] == 0).all()
    assert torch.isinf(lse[:, :, :35]).all() and (lse[:, :, :35] < 0).all()
    dm = torch.rand(40, 40) > 0.5
    dm[3] = False
    dm[:, 7] = False
    out, lse, grads = _check(bsfa.dense_mask(dm), Lq=40, Lk=40)
    assert (out[:, :, 3] == 0).all() and (grads[0][:, :, 3] == 0).all()
    assert (grads[1][:, :, 7] == 0).all() and (grads[2][:, :, 7] == 0).all()


def test_batch_and_head_dependent_layouts():
    ids = torch.stack([torch.randint(0, 3, (64,)).sort().values, torch.randint(0, 5, (64,)).sort().values])
    _check(bsfa.causal() & bsfa.document(ids), B=2, H=2, Hkv=1, Lq=64, Lk=64)
    dm = torch.rand(1, 2, 40, 40) > 0.6
    _check(bsfa.dense_mask(dm), B=1, H=2, Hkv=2, Lq=40, Lk=40)


def test_dropout_matches_materialised_keep_mask():
    _check(bsfa.causal() & bsfa.window(12), dropout_p=0.3, seed=1234)
    _check(bsfa.full(), dropout_p=0.5, seed=99, H=4, Hkv=2, Lq=50, Lk=50)


def test_dropout_rng_matches_numpy_twin():
    """The in-kernel Philox keep decision equals ops.dropout's numpy implementation exactly: with
    v = identity, out * (1 - p) * l equals keep ∘ exp-weights, so zero entries mark dropped keys."""
    B, H, L = 1, 2, 48
    q = torch.randn(B, H, L, 16) * 0.1
    k = torch.randn(B, H, L, 16) * 0.1
    v = torch.eye(L).expand(B, H, L, L).contiguous()[..., :16]  # head dim 16: first 16 keys
    out = bsfa.attention(q, k, v, mask=bsfa.full(), backend="triton", dropout_p=0.4, dropout_seed=2**40 + 5, block_size=16)
    keep = bsfa.dropout_keep_mask(B, H, L, L, 0.4, 2**40 + 5)[..., :16]
    assert torch.equal(out != 0, keep)


def test_split_work_lists_give_identical_results():
    mask = bsfa.load_pattern("longformer", window=8, n_global=5)
    q, k, v = _qkv(1, 2, 1, 96, 96, 16)
    do = torch.randn(1, 2, 96, 16)
    results = []
    for chunk in (None, 1.5, 3.0):
        out, lse = bsfa.attention(q, k, v, mask=mask, backend="triton", block_size=16, return_lse=True,
                                  kernel_options={"split_chunk": chunk})
        results.append((out, lse, *torch.autograd.grad(out, (q, k, v), do)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.allclose(a, b, atol=2e-6, rtol=1e-5)


def test_worklist_splits_heavy_tiles_and_covers_every_entry():
    full_ptr = np.array([0, 40, 42, 44])  # tile 0 is heavy
    part_ptr = np.array([0, 10, 11, 12])
    wl = build_worklist(full_ptr, part_ptr, 1, 3, n_heads=1, hw_slots=4, min_chunk=4)
    work = wl.work.view(-1, 6).numpy()
    assert wl.n_slots > 1 and (work[:, 5] >= 0).sum() == wl.n_slots
    # entries of tile 0 are covered exactly once by its pieces
    t0 = work[work[:, 0] == 0]
    covered_f = sorted(e for row in t0 for e in range(row[1], row[2]))
    covered_p = sorted(e for row in t0 for e in range(row[3], row[4]))
    assert covered_f == list(range(0, 40)) and covered_p == list(range(0, 10))
    # heavy first
    cost = (work[:, 2] - work[:, 1]) + 1.5 * (work[:, 4] - work[:, 3])
    assert list(cost) == sorted(cost, reverse=True)


def test_bf16_and_fp16_within_twice_eager_error():
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = _qkv(1, 2, 2, 64, 64, 32, dtype)
        mask = bsfa.causal() & bsfa.window(20)
        out = bsfa.attention(q, k, v, mask=mask, backend="triton", block_size=16)
        do = torch.randn_like(out)
        g = torch.autograd.grad(out, (q, k, v), do)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = bsfa.reference_attention(qd, kd, vd, mask)
        gr = torch.autograd.grad(ref, (qd, kd, vd), do.double())
        eager = bsfa.reference_attention(q, k, v, mask, upcast=False)
        ge = torch.autograd.grad(eager, (q, k, v), do)
        assert out.dtype == dtype
        for ours, e, r in zip((out, *g), (eager, *ge), (ref, *gr)):
            assert rel_err(ours, r) <= 2 * rel_err(e, r) + 1e-3


def test_lse_is_differentiable():
    q, k, v = _qkv(1, 2, 2, 50, 50, 16)
    mask = bsfa.causal() & bsfa.window(10)
    out, lse = bsfa.attention(q, k, v, mask=mask, backend="triton", block_size=16, return_lse=True)
    w = torch.randn_like(lse)
    g = torch.autograd.grad((lse * w).sum() + out.sum(), (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    r, rl = bsfa.reference_attention(qd, kd, vd, mask, return_lse=True)
    gr = torch.autograd.grad((rl * w.double()).sum() + r.sum(), (qd, kd, vd))
    for a, b in zip(g, gr):
        assert rel_err(a, b) < TOL


def test_strided_rewrite_matches_reference(monkeypatch):
    from blocksparse_fa.compiler import rewrite

    mask = bsfa.parse("causal & (sliding_window(20) | strided(16))")
    assert rewrite.plan(mask, 150, 150) is None  # 150 tokens hold too few strides by default
    monkeypatch.setattr(rewrite, "MIN_PERIODS", 4)
    rewrite.plan.cache_clear()
    try:
        assert rewrite.plan(mask, 150, 150) is not None
        _check(mask, Lq=150, Lk=150, H=2, Hkv=1)
    finally:
        rewrite.plan.cache_clear()


def test_predicate_depends_only_on_structure():
    a = bsfa.causal() & bsfa.window(256)
    b = bsfa.causal() & bsfa.window(100)
    assert structure_key(a) == structure_key(b)
    assert generate_source(a) == generate_source(b)
    assert predicate_function(a) is predicate_function(b)
    assert predicate_function(a) is not predicate_function(bsfa.causal() & bsfa.sliding_window(3))
    la = bsfa.compile_mask(a, 300, 300, 16)
    lb = bsfa.compile_mask(b, 500, 500, 16)
    pa, pb = build_payload(la, "cpu"), build_payload(lb, "cpu")
    assert pa.fn is pb.fn and pa.params.tolist() == [256] and pb.params.tolist() == [100]


def test_triton_backend_errors(monkeypatch):
    q, k, v = _qkv(1, 2, 2, 40, 40, 16)
    with pytest.raises(ValueError, match="power"):
        bsfa.attention(q, k, v, mask=bsfa.causal(), backend="triton", block_size=24)
    with pytest.raises(TypeError, match="float64"):
        bsfa.attention(q.double(), k.double(), v.double(), backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        bsfa.attention(q, k, v, backend="triton")


@pytest.mark.parametrize("text,split", [("window(8) | global_tokens(5)", 2.0), ("causal & document", None),
                                        ("full", None)])
def test_fused_backward_matches_separate_launches(text, split):
    """dK/dV and dQ in one launch (``_attn_bwd``) give the gradients of the two separate kernels and
    of the float64 reference, with and without split work items, with GQA and ragged lengths."""
    from blocksparse_fa.ops import triton_backend as tb
    from blocksparse_fa.ops.options import TileConfig

    ids = torch.randint(0, 3, (90,)).sort().values
    mask = bsfa.causal() & bsfa.document(ids) if "document" in text else bsfa.parse(text)
    # equal warps: the fused launch applies
    base = dict(dkdv_tiles=TileConfig(16, 16, 4, 2), dq_tiles=TileConfig(16, 16, 4, 2), split_chunk=split)
    calls = {"fused": 0, "parts": 0}
    real = tb._bwd_launch

    def spy(*a, **kw):
        consts = a[7].consts  # the launch plan
        calls["fused" if consts["RUN_KV"] and consts["RUN_Q"] else "parts"] += 1
        return real(*a, **kw)

    try:
        grads = []
        for fused, head_major in ((True, True), (True, False), (False, True)):
            tb._bwd_launch = spy
            torch.manual_seed(11)
            q, k, v = _qkv(1, 4, 2, 90, 90, 16)
            do = torch.randn(1, 4, 90, 16)
            out = bsfa.attention(q, k, v, mask=bsfa.compile_mask(mask, 90, 90, 16), backend="triton",
                                 kernel_options=dict(base, fused_backward=fused, head_major=head_major))
            grads.append(torch.autograd.grad(out, (q, k, v), do))
        assert calls == {"fused": 2, "parts": 2}  # one launch (two grid orders), then dK/dV and dQ separately
        for other in grads[1:]:
            for a, b in zip(grads[0], other):
                assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    finally:
        tb._bwd_launch = real
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))  # the last run's inputs (seed 11)
    ref = bsfa.reference_attention(qd, kd, vd, mask)
    assert rel_err(out, ref) < TOL
    for g, r, name in zip(grads[0], torch.autograd.grad(ref, (qd, kd, vd), do.double()), "qkv"):
        assert rel_err(g, r) < TOL, (name, rel_err(g, r))


def test_run_tables_detection():
    """Lines whose unmasked blocks are one run of consecutive blocks are stored as runs (one int per
    line); a layout with a second run anywhere (a full global column beside the window) lists them."""
    def flags(mask, n=256):
        rows, cols = bsfa.compile_mask(mask, n, n, 16).kernel_tables(col_runs=True)
        return rows.runs, cols.runs

    assert flags(bsfa.full()) == (True, True)
    assert flags(bsfa.causal()) == (True, True)
    assert flags(bsfa.sliding_window(64)) == (True, True)
    assert flags(bsfa.global_tokens(16) | bsfa.window(40)) == (False, False)
    rows, cols = bsfa.compile_mask(bsfa.causal(), 256, 256, 16).kernel_tables()
    assert rows.runs and not cols.runs  # small column tables stay listed (the dK/dV loop's default)
    assert rows.full_idx.nbytes == 16 * 4  # one int per row


@pytest.mark.parametrize("text", ["causal", "document", "longformer"])
def test_lut_modes_match(text):
    """Every way of finding LUT block indices (loaded, prefetched one entry ahead, computed for
    contiguous lists) gives bit-identical outputs and gradients, with split work items."""
    from blocksparse_fa.ops import triton_backend as tb

    ids = torch.randint(0, 3, (80,)).sort().values
    mask = {"document": bsfa.causal() & bsfa.document(ids), "causal": bsfa.causal(),
            "longformer": bsfa.global_tokens(16) | bsfa.window(20)}[text]
    policies = [dict(row_arith=False, fwd_other="load", col_arith=False),
                dict(row_arith=True, fwd_other="prefetch", col_arith=True)]
    res = []
    for pol in policies:
        opts = bsfa.KernelOptions(split_chunk=2, **pol)
        if True:
            lay = bsfa.compile_mask(mask, 80, 80, 16)
            modes = tb._device_state(lay, torch.device("cpu"), opts)[3]
            rows, cols = lay.kernel_tables(True, True)
            if pol["row_arith"]:
                assert modes["FULL_LUT"] == ("arith" if rows.runs else "prefetch")
                assert modes["PART_LUT"] == "prefetch"
                assert modes["COL_LUT"] == ("arith" if cols.runs else "load")
            else:
                assert modes["FULL_LUT"] == "load" and modes["COL_LUT"] == "load"
            torch.manual_seed(5)
            q, k, v = _qkv(1, 2, 2, 80, 80, 16)
            do = torch.randn(1, 2, 80, 16)
            out = bsfa.attention(q, k, v, mask=lay, backend="triton", kernel_options=opts)
            res.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    for a, b in zip(*res):
        assert torch.equal(a, b)


def test_document_runs_form_matches_ids():
    """Documents that are contiguous runs use the run-bounds predicate (no key-side gather); it gives
    the same outputs and gradients as comparing ids, and split documents fall back to ids."""
    from blocksparse_fa.kernels import predicate as pr

    ids = torch.tensor([0] * 23 + [1] * 30 + [2] * 5 + [3] * 22)
    mask = bsfa.causal() & bsfa.document(ids)
    res = []
    for on in (True, False):
        lay = bsfa.compile_mask(mask, 80, 80, 16)
        fn = pr.build_payload(lay, "cpu", document_runs=on).fn
        assert (fn is pr._functions["and(causal,document_runs)"]) == on
        torch.manual_seed(3)
        q, k, v = _qkv(1, 2, 1, 80, 80, 16)
        do = torch.randn(1, 2, 80, 16)
        out = bsfa.attention(q, k, v, mask=lay, backend="triton", kernel_options={"document_runs": on})
        res.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    for a, b in zip(*res):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    _check(mask, H=2, Hkv=1, Lq=80, Lk=80)
    assert pr._document_runs(np.array([[0, 0, 1, 0]])) is None
    start, end = pr._document_runs(np.array([[4, 4, 9, 9, 9], [1, 2, 2, 2, 3]]))
    assert start.tolist() == [[0, 0, 2, 2, 2], [0, 1, 1, 1, 4]] and end.tolist() == [[2, 2, 5, 5, 5], [1, 4, 4, 4, 5]]


# (2, 2, 1, ..., True, True): in the class-major views the kernels see B·H = 4 query heads over B·Hkv = 2
# kv heads, the second batch row's at kv head b·Hkv + h // G = 1
@pytest.mark.parametrize("B,H,Hkv,N,D,gqa,residue", [(2, 2, 2, 160, 24, False, True), (1, 2, 1, 160, 16, False, False),
                                                    (2, 2, 1, 160, 16, True, True), (1, 3, 1, 160, 16, True, True),
                                                    (1, 2, 2, 150, 16, True, False)])
def test_strided_rewrite_class_views(monkeypatch, B, H, Hkv, N, D, gqa, residue):
    """The strided part runs on residue-class views (no copies) when N % stride == 0 (GQA/MQA only
    with the ``residue_gqa`` kernel option, class-major views), else on permuted copies; both match
    the float64 reference in out, lse and all gradients."""
    from blocksparse_fa.compiler import rewrite
    from blocksparse_fa.ops import residue as res

    monkeypatch.setattr(rewrite, "MIN_PERIODS", 4)
    rewrite.plan.cache_clear()
    bsfa.compiler.clear_cache()
    calls = []
    real = res.residue_forward
    monkeypatch.setattr(res, "residue_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    try:
        mask = bsfa.parse("causal & (sliding_window(20) | strided(16))")
        q, k, v = _qkv(B, H, Hkv, N, N, D)
        out, lse = bsfa.attention(q, k, v, mask=mask, block_size=16, backend="triton", return_lse=True,
                                  kernel_options={"residue_gqa": gqa})
        assert bool(calls) == residue
        do, w = torch.randn_like(out), torch.randn_like(lse)
        g = torch.autograd.grad((out * do).sum() + (lse * w).sum(), (q, k, v))
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        r, rl = bsfa.reference_attention(qd, kd, vd, mask, return_lse=True)
        gr = torch.autograd.grad((r * do.double()).sum() + (rl * w.double()).sum(), (qd, kd, vd))
        assert rel_err(out, r) < TOL and rel_err(lse, rl) < TOL
        for a, b, name in zip(g, gr, "qkv"):
            assert rel_err(a, b) < TOL, (name, rel_err(a, b))
    finally:
        rewrite.plan.cache_clear()
        bsfa.compiler.clear_cache()


def test_merge_residue_masked_rows():
    """The merge kernel: rows masked in both parts give 0 and -inf; one-sided rows copy that part."""
    from blocksparse_fa.ops.residue import class_view
    from blocksparse_fa.ops.triton_backend import merge_residue

    B, H, N, D, S = 1, 2, 12, 8, 4
    o1, o2 = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    l1, l2 = torch.randn(B, H, N), torch.randn(B, H, N)
    l1[0, 0, :3] = float("-inf")
    l2[0, 0, 1:5] = float("-inf")  # rows 1, 2: both parts empty
    o2c = class_view(o2, S).contiguous()
    l2c = l2.reshape(B * H, N // S, S).transpose(1, 2).contiguous()
    out, lse = o1.clone(), l1.clone()
    merge_residue(out, lse, o2c, l2c, S)
    ref_lse = torch.logaddexp(l1, l2)
    w1 = torch.nan_to_num(torch.exp(l1 - ref_lse), nan=0.0)
    w2 = torch.nan_to_num(torch.exp(l2 - ref_lse), nan=0.0)
    ref = w1[..., None] * o1 + w2[..., None] * o2
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert torch.equal(out[0, 0, 1:3], torch.zeros(2, D))
    assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(lse[torch.isfinite(lse)], ref_lse[torch.isfinite(ref_lse)])


def test_merge_rows_of_part_one():
    """With stride 1 the second part may cover rows ``row0 .. row0 + R`` only: those rows are merged,
    the others stay exactly as they were."""
    from blocksparse_fa.ops.merge import merge_attention
    from blocksparse_fa.ops.triton_backend import merge_residue

    torch.manual_seed(0)
    B, H, N, D, R, row0 = 2, 3, 40, 16, 9, 20
    o1, l1 = torch.randn(B, H, N, D), torch.randn(B, H, N)
    o2, l2 = torch.randn(B, H, R, D), torch.randn(B, H, R)
    l2[0, 1, :2] = float("-inf")
    l1[0, 1, row0] = float("-inf")  # row 20 of head 1: both parts empty
    out, lse = o1.clone(), l1.clone()
    merge_residue(out, lse, o2, l2, 1, row0)
    ref, ref_lse = merge_attention([(o1[:, :, row0:row0 + R], l1[:, :, row0:row0 + R]), (o2, l2)])
    assert torch.allclose(out[:, :, row0:row0 + R], ref, atol=1e-5)
    assert torch.equal(torch.isinf(lse[:, :, row0:row0 + R]), torch.isinf(ref_lse))
    assert torch.equal(out[0, 1, row0], torch.zeros(D))
    keep = torch.ones(N, dtype=torch.bool)
    keep[row0:row0 + R] = False
    assert torch.equal(out[:, :, keep], o1[:, :, keep]) and torch.equal(lse[:, :, keep], l1[:, :, keep])


@pytest.mark.parametrize("split", [None, 4])
def test_backward_accumulate_adds_to_given_gradients(split):
    """``triton_backward(accumulate=...)`` adds its gradients to the given tensors (non-contiguous
    views too), also for split tiles summed by ``_sum_partials``; ``delta`` may be passed in."""
    from blocksparse_fa.ops import triton_backend as tb
    from blocksparse_fa.ops.validate import check_qkv

    torch.manual_seed(3)
    q, k, v = (t.detach() for t in _qkv(1, 2, 1, 96, 96, 16))
    mask = bsfa.global_tokens(8) | bsfa.window(6)
    lay = bsfa.compile_mask(mask, 96, 96, 16)
    s = check_qkv(q, k, v)
    opts = bsfa.KernelOptions(split_chunk=split)
    out, lse = tb.triton_forward(q, k, v, lay, s, 0.25, 0.0, 0, opts=opts)
    do = torch.randn_like(out)
    ref = tb.triton_backward(q, k, v, out, lse, do, lay, s, 0.25, 0.0, 0, opts=opts)
    base = [torch.randn(t.shape[0], t.shape[1], 2 * t.shape[2], t.shape[3])[:, :, ::2] for t in (q, k, v)]
    acc = tuple(torch.empty(b.shape[0], b.shape[1], 2 * b.shape[2], b.shape[3])[:, :, ::2].copy_(b) for b in base)
    delta = tb.backward_delta(out, do, lse, s)
    got = tb.triton_backward(q, k, v, None, lse, do, lay, s, 0.25, 0.0, 0, delta=delta, accumulate=acc, opts=opts)
    for g, b, r in zip(got, base, ref):
        assert not g.is_contiguous()
        assert torch.allclose(g, b + r, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="accumulate: dq"):
        tb.triton_backward(q, k, v, out, lse, do, lay, s, 0.25, 0.0, 0, accumulate=(base[0].transpose(2, 3), *base[1:]))


@pytest.mark.parametrize("dkdv,dq", [((32, 128), (128, 64)), ((64, 128), (128, 64))])
def test_backward_tile_candidates_match_reference(dkdv, dq):
    """The backward tile shapes queued for the H100 A/B (``ab_variants.py``: fewer register spills)
    give the float64 reference's gradients on a 128-block layout."""
    from blocksparse_fa.ops.options import TileConfig

    _check(bsfa.load_pattern("longformer", window=100, n_global=20), H=2, Hkv=1, Lq=300, Lk=300, block=128,
           opts=dict(dkdv_tiles=TileConfig(*dkdv, 8, 2), dq_tiles=TileConfig(*dq, 8, 2)))


def test_custom_op_and_module_use_the_strided_rewrite(monkeypatch):
    """``attention_op`` (and so ``nn`` modules and the transformers hook) computes strided masks
    through the residue-class rewrite on the Triton backend, forward and backward, exactly."""
    from blocksparse_fa.compiler import rewrite
    from blocksparse_fa.ops import custom_op
    from blocksparse_fa.ops import residue as res

    monkeypatch.setattr(rewrite, "MIN_PERIODS", 4)
    rewrite.plan.cache_clear()
    bsfa.compiler.clear_cache()
    custom_op.registry.clear()
    calls = {"fwd": 0, "bwd": 0}
    real_f, real_b = res.residue_forward, res.residue_backward
    monkeypatch.setattr(res, "residue_forward", lambda *a: calls.__setitem__("fwd", calls["fwd"] + 1) or real_f(*a))
    monkeypatch.setattr(res, "residue_backward", lambda *a: calls.__setitem__("bwd", calls["bwd"] + 1) or real_b(*a))
    try:
        mask = bsfa.parse("causal & (sliding_window(20) | strided(16))")
        q, k, v = _qkv(1, 2, 2, 160, 160, 16)
        out = bsfa.attention_op(q, k, v, mask, backend="triton", block_size=16)
        do = torch.randn_like(out)
        g = torch.autograd.grad(out, (q, k, v), do)
        assert calls == {"fwd": 1, "bwd": 1}
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        r = bsfa.reference_attention(qd, kd, vd, mask)
        gr = torch.autograd.grad(r, (qd, kd, vd), do.double())
        assert rel_err(out, r) < TOL
        for a, b in zip(g, gr):
            assert rel_err(a, b) < TOL
        # a compiled layout carries the rewrite: the same path as the expression
        lay = bsfa.compile_mask(mask, 160, 160, 16)
        assert lay.rewrite is not None
        o2 = bsfa.attention_op(q, k, v, lay, backend="triton")
        o3 = bsfa.attention(q, k, v, mask=lay, backend="triton")
        assert calls["fwd"] == 3 and torch.equal(o2, out) and torch.equal(o3, out)
    finally:
        rewrite.plan.cache_clear()
        bsfa.compiler.clear_cache()


@pytest.mark.parametrize("D", [16, 24])
def test_forward_through_tensor_descriptors_matches_reference(monkeypatch, D):
    """The forward's tensor-descriptor K/V loads (kernel option ``kv_desc=True``, TMA on Hopper)
    give the reference's outputs, with ragged last blocks (zero-filled rows) and a head dim that is
    not a power of two (zero-filled columns)."""
    from blocksparse_fa.ops import select

    monkeypatch.setattr(select, "tma_ok", lambda *ts: True)
    _check(bsfa.parse("causal & (sliding_window(20) | global_tokens(5))"), H=2, Hkv=1, Lq=61, Lk=75, D=D,
           opts={"kv_desc": True})


def test_kernel_options_reject_unknown_names_and_values():
    """``kernel_options`` is validated where it enters: unknown names and bad values name the field."""
    q, k, v = _qkv(1, 2, 2, 32, 32, 16)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['tma'\]"):
        bsfa.attention(q, k, v, kernel_options={"tma": True})
    with pytest.raises(ValueError, match="lists must be one of"):
        bsfa.attention(q, k, v, kernel_options={"lists": "finest"})
    with pytest.raises(ValueError, match="warp_specialize=True needs kv_desc=True"):
        bsfa.KernelOptions(warp_specialize=True)
    with pytest.raises(ValueError, match="a string must come from KernelOptions.encode"):
        bsfa.attention(q, k, v, kernel_options="fast")
    with pytest.raises(TypeError, match="kernel_options must be a KernelOptions"):
        bsfa.attention(q, k, v, kernel_options=3)
    enc = bsfa.KernelOptions(lists="fine").encode()
    assert torch.equal(bsfa.attention(q, k, v, kernel_options=enc, backend="torch"),
                       bsfa.attention(q, k, v, kernel_options={"lists": "fine"}, backend="torch"))


def test_tile_classes_follow_the_layout_shape():
    """Forward and backward tiles per layout class (H100 and H200 A/B, benchmarks/NOTES.md "Forward kernel" and "Backward kernels"): rows mostly
    partial get 128x64 forward steps with three stages; >= 10 % partial blocks get the spill-free
    backward pair; dense and causal keep the default tables."""
    from blocksparse_fa.kernels.config import TileConfig, bwd_configs, fwd_config

    from blocksparse_fa.ops.select import layout_class

    def tiles(mask, n=16384):
        lc = layout_class(bsfa.compile_mask(mask, n, n, 128))
        return (fwd_config(128, torch.bfloat16, 128, 128, lc.band, lc.partial_rows),
                bwd_configs(128, torch.bfloat16, 128, 128, lc.band, lc.partial_heavy))

    f, (kv, q) = tiles(bsfa.load_pattern("longformer"))
    assert f == TileConfig(128, 64, 8, 3) and kv == TileConfig(32, 128, 8, 2) and q == TileConfig(128, 64, 8, 2)
    f, (kv, q) = tiles(bsfa.sliding_window(1024))
    assert f == TileConfig(128, 64, 8, 2) and kv.block_m == 32
    f, (kv, q) = tiles(bsfa.causal())
    assert f == TileConfig(128, 128, 8, 2) and kv == TileConfig(64, 128, 8, 2) and q == TileConfig(128, 128, 8, 2)
    # long rows, every visited block partial: the forward takes the partial rows' steps too
    f, _ = tiles(bsfa.periodic_window(1024, 16) & bsfa.causal())
    assert f == TileConfig(128, 64, 8, 3)
    # long rows, few partial blocks: the default forward
    f, _ = tiles(bsfa.key_range(2048, 3072) | bsfa.causal())
    assert f == TileConfig(128, 128, 8, 2)


def test_short_partial_forward_tiles_need_128_blocks():
    """The short-partial forward table was measured on 128-token layout blocks only."""
    from blocksparse_fa.kernels.config import TileConfig, fwd_config

    assert fwd_config(128, torch.bfloat16, 128, 128, False, True) == TileConfig(128, 64, 8, 3)
    assert fwd_config(128, torch.bfloat16, 64, 64, False, True) == TileConfig(64, 64, 8, 2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_rows_stay_zero_whatever_v_holds(backend):
    """Rows with nothing to attend output 0 and get dQ = 0 even when V holds NaN in a block their
    tile visits (0 * NaN must not leak through P @ V or dP)."""
    torch.manual_seed(2)
    Lq, Lk = 80, 48  # bottom-right alignment: rows 0..31 sit before key 0 and keep nothing under causal
    q, k, v = (torch.randn(1, 2, L, 16) for L in (Lq, Lk, Lk))
    v[0, :, 3] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = bsfa.attention(q, k, v, mask=bsfa.causal(), backend=backend, block_size=16)
    dq, = torch.autograd.grad(out, (q,), torch.randn_like(out))
    empty = slice(0, Lq - Lk)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert torch.equal(dq[:, :, empty], torch.zeros_like(dq[:, :, empty]))
    assert torch.isnan(out[:, :, Lq - Lk + 3:]).all()  # rows that do attend key 3 see its NaN


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_group_sum_kernel(dtype):
    """``kernels/heads._group_sum``: per-query-head tensors summed per group in float32, with
    lengths that are not a multiple of the programs' blocks."""
    torch.manual_seed(0)
    B, Hkv, G, L, D = 2, 3, 4, 37, 24
    t = torch.randn(B, Hkv * G, L, D, dtype=dtype)
    want = t.double().view(B, Hkv, G, L, D).sum(2)
    got = tb._summed_groups(t, G)
    assert got.shape == (B, Hkv, L, D) and got.dtype == dtype
    assert rel_err(got, want) < (4e-3 if dtype == torch.bfloat16 else 1e-6)
