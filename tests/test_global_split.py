"""Masks with global tokens as a band, the first rows and the global keys (``compiler/globals.py``,
``ops/globals.py``, ``kernels/globals.py``): which masks split, the kernel choice, and outputs and
all gradients against the float64 reference through the Triton interpreter."""

import numpy as np
import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.compiler.globals import split_parts
from blocksparse_fa.ops import select
from blocksparse_fa.ops.options import KernelOptions
from blocksparse_fa.ops.validate import Shapes
from conftest import check_route_against_float64, rel_err

pytestmark = pytest.mark.interpreter

LONGFORMER = "window(20) | global_tokens(8)"
SINKS = "causal & (sliding_window(24) | global_tokens(3))"
PARTIAL_ROWS = "(window(20) | global_tokens(8)) & ~(query_range(0, 8) & key_range(80, 128))"


def test_which_masks_split():
    g, band, corner, rows = split_parts(bsfa.parse(LONGFORMER), 128, 128, 0)
    assert g == 8 and rows == "full" and corner.all()  # global rows keep every key
    g, band, corner, rows = split_parts(bsfa.parse(PARTIAL_ROWS), 128, 128, 0)
    assert g == 8 and isinstance(rows, bsfa.Mask)  # global rows keep some later keys: a layout of their own
    g, band, corner, rows = split_parts(bsfa.parse(SINKS), 128, 128, 0)
    assert g == 3 and rows is None  # causal sinks keep no later key
    assert np.array_equal(corner, np.tril(np.ones((3, 3), bool)))
    for text in ("sliding_window(16)", "causal & (window(8) | strided(16))", "window(4) | global_tokens(200)",
                 "window(20) | (global_tokens(8) & sliding_window(60))",  # later rows drop global keys
                 "(window(8) | global_tokens(4)) | global_tokens(6)", bsfa.load_pattern("bigbird")):
        mask = bsfa.parse(text) if isinstance(text, str) else text
        assert split_parts(mask, 128, 128, 0) is None, text
    # bottom-right queries (a decode step) and per-head counts do not split
    assert split_parts(bsfa.parse(SINKS), 64, 128, 64) is None
    assert split_parts(bsfa.window(4) | bsfa.global_tokens(torch.tensor([[2, 3]])), 64, 64, 0) is None


def test_choice_is_a_pure_function():
    s = Shapes(1, 2, 2, 4096, 4096, 128)
    gl = select.Choice("gluon", "interval", ())
    tr = select.Choice("triton", "blocks", ())
    auto, on, off = KernelOptions(), KernelOptions(global_split=True), KernelOptions(global_split=False)
    bf = torch.bfloat16
    assert select.choose_global_split(gl, s, bf, auto, n_global=4, long_rows=False)
    assert not select.choose_global_split(gl, s, bf, auto, n_global=64, long_rows=False)
    assert not select.choose_global_split(gl, s, bf, auto, n_global=4, long_rows=True)
    assert not select.choose_global_split(tr, s, bf, auto, n_global=4, long_rows=False)
    assert select.choose_global_split(tr, s, bf, on, n_global=64, long_rows=True)
    assert not select.choose_global_split(gl, s, bf, off, n_global=4, long_rows=False)
    for kw in (dict(dropout=True), dict(score_mod=True), dict(partial_dtypes=True)):
        assert not select.choose_global_split(gl, s, bf, on, n_global=4, long_rows=False, **kw)
    assert not select.choose_global_split(gl, s, torch.float64, on, n_global=4, long_rows=False)
    # Longformer-like first rows (every later key) whose global keys fold into the band's Gluon
    # forward: the forward splits, the backward runs the whole mask
    assert select.choose_global_split(gl, s, bf, auto, n_global=64, long_rows=True, folds=True)
    assert not select.choose_global_split(gl, s, bf, auto, n_global=64, long_rows=True, folds=True,
                                          phase="backward")
    assert not select.choose_global_split(tr, s, bf, auto, n_global=64, long_rows=True, folds=True)
    # ... unless the whole layout's forward runs the Gluon list mode (one launch, not three); sinks,
    # whose split is one folded pass, still split, and an explicit global_split=True still does
    lists = select.Choice("gluon", "list", ())
    assert not select.choose_global_split(gl, s, bf, auto, n_global=64, long_rows=True, folds=True, whole=lists)
    assert select.choose_global_split(gl, s, bf, auto, n_global=64, long_rows=True, folds=True, whole=tr)
    assert select.choose_global_split(gl, s, bf, auto, n_global=64, long_rows=False, folds=True, whole=lists)
    assert select.choose_global_split(gl, s, bf, on, n_global=64, long_rows=True, folds=True, whole=lists)
    # 64 attention sinks (no first rows of their own) folded into the band's forward: the forward
    # splits whatever g, the backward keeps the whole mask above AUTO_GLOBAL_SPLIT_MAX
    assert select.choose_global_split(gl, s, bf, auto, n_global=64, long_rows=False, folds=True)
    assert not select.choose_global_split(gl, s, bf, auto, n_global=64, long_rows=False, folds=True,
                                          phase="backward")
    # ... and from SPLIT_BACKWARD_MIN_ROWS query rows times heads the backward splits too
    big = Shapes(1, 8, 2, 65536, 65536, 128)
    assert big.B * big.H * big.Lq >= select.SPLIT_BACKWARD_MIN_ROWS
    for long_rows in (False, True):
        assert select.choose_global_split(gl, big, bf, auto, n_global=64, long_rows=long_rows, folds=True,
                                          phase="backward")
        assert not select.choose_global_split(gl, big, bf, auto, n_global=64, long_rows=long_rows,
                                              phase="backward")
    # ... unless the whole layout's backward runs a list mode and the first rows need a part of
    # their own (Longformer at 64K: that part cost as much as the band's kernels); sinks still split
    for mode in ("list", "list+per_head_dkdv"):
        whole_bwd = select.Choice("gluon", mode, ())
        assert not select.choose_global_split(gl, big, bf, auto, n_global=64, long_rows=True, folds=True,
                                              phase="backward", whole=whole_bwd)
        assert select.choose_global_split(gl, big, bf, auto, n_global=64, long_rows=False, folds=True,
                                          phase="backward", whole=whole_bwd)
        assert select.choose_global_split(gl, big, bf, on, n_global=64, long_rows=True, folds=True,
                                          phase="backward", whole=whole_bwd)
    assert select.choose_global_split(gl, big, bf, auto, n_global=64, long_rows=True, folds=True,
                                      phase="backward", whole=tr)
    assert select.choose_global_split(gl, s, bf, auto, n_global=4, long_rows=False, phase="backward")
    with pytest.raises(ValueError, match="phase must be 'forward' or 'backward'"):
        select.choose_global_split(gl, s, bf, auto, n_global=4, long_rows=False, phase="both")
    with pytest.raises(ValueError, match="global_split"):
        KernelOptions(global_split=1)


@pytest.mark.parametrize("text,H,Hkv,D,n", [(LONGFORMER, 2, 1, 32, 96), (SINKS, 2, 2, 16, 100),
                                            (PARTIAL_ROWS, 2, 2, 16, 96)])
def test_split_matches_float64(text, H, Hkv, D, n):
    check_route_against_float64(bsfa.parse(text), "global_split", dict(global_split=True), H, Hkv, D, n)


@pytest.mark.parametrize("H,Hkv", [(2, 1), (2, 2)])
def test_first_rows_merge_into_the_corner(H, Hkv):
    """The folded forward's first rows: the band wrote the corner (the global keys) into ``out`` /
    ``lse``; the split-K pair over the later keys merges into them (``merge=True``): the whole
    mask's rows against float64."""
    from blocksparse_fa.ops import globals as og

    mask, n, D, g = bsfa.parse(LONGFORMER), 96, 32, 8
    torch.manual_seed(3)
    q = torch.randn(1, H, n, D)
    k, v = (torch.randn(1, Hkv, n, D) for _ in range(2))
    s = Shapes(1, H, Hkv, n, n, D)
    corner = bsfa.key_range(0, g)
    qd, kd, vd = (t.double() for t in (q, k, v))
    o_c, l_c = bsfa.reference_attention(qd, kd, vd, corner, return_lse=True)
    out = torch.full((1, H, n, D), float("nan"))
    lse = torch.full((1, H, n), float("nan"))
    out[:, :, :g], lse[:, :, :g] = o_c[:, :, :g].float(), l_c[:, :, :g].float()
    scale = D ** -0.5
    og._rows_forward(q, k, v, out, lse, g, s, scale * np.log2(np.e), og._consts(s, g, q.dtype, q.device), merge=True)
    ref, ref_lse = bsfa.reference_attention(qd, kd, vd, mask, return_lse=True)
    assert rel_err(out[:, :, :g], ref[:, :, :g]) < 5e-6
    assert torch.allclose(lse[:, :, :g].double(), ref_lse[:, :, :g], atol=1e-5)
    assert out[:, :, g:].isnan().all()  # rows past the first g are the band's


def test_split_and_whole_agree_in_bfloat16_and_compiled():
    mask = bsfa.parse(SINKS)
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 96, 16, dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)

    def run(fn, opts):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*xs, opts)
        out.backward(do)
        return [out.float()] + [t.grad.float() for t in xs]

    def eager(a, b, c, opts):
        return bsfa.attention(a, b, c, mask, backend="triton", block_size=32, kernel_options=opts)

    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = bsfa.reference_attention(qd, kd, vd, mask)
    ref.backward(do.double())
    want = [ref.detach()] + [t.grad for t in (qd, kd, vd)]
    whole = run(eager, dict(global_split=False))
    split = run(eager, dict(global_split=True))
    for a, b, r in zip(split, whole, want):
        assert rel_err(a, r) < 2 * max(rel_err(b, r), 4e-3)  # within twice the whole mask's bf16 error
    compiled = run(torch.compile(eager, backend="aot_eager", fullgraph=True), dict(global_split=True))
    for a, b in zip(compiled, split):
        assert torch.equal(a, b)


def test_explain_reports_the_split():
    q = torch.randn(1, 2, 96, 16, requires_grad=True)
    e = bsfa.explain(q, q, q, mask=LONGFORMER, backend="triton", block_size=32, kernel_options=dict(global_split=True))
    assert e.rewrite == "global_split" and {"_global_keys_bwd", "_global_rows_fwd", "_global_rows_merge"} <= set(e.kernels)
    e = bsfa.explain(q, q, q, mask=PARTIAL_ROWS, backend="triton", block_size=32, kernel_options=dict(global_split=True))
    assert " + " in e.forward and "_global_rows_fwd" not in e.kernels  # the band, then the rows' own layout
    e = bsfa.explain(q, q, q, mask=LONGFORMER, backend="triton", block_size=32)
    assert e.rewrite is None  # on the CPU the band runs no Gluon kernel: the whole mask
