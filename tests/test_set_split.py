"""Global positions anywhere (``key_set | query_set | band``) as three forward parts: the split's
exactness on the expression, where it applies, and the parts' forward (with the whole mask's
backward) against float64 in the Triton interpreter."""

import numpy as np
import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.compiler import compile_mask
from blocksparse_fa.compiler.sets import MAX_SET, split_parts

T = torch.tensor


def _dense_parts(mask, lq, lk):
    band, keys, rows, keep_keys, keep_rows = split_parts(mask, lq, lk, 0)
    a = band.to_dense(lq, lk, align="top_left").numpy()
    b = np.zeros((lq, lk), bool)
    b[:, keys] = keep_keys
    c = np.zeros((lq, lk), bool)
    c[rows] = keep_rows
    return a, b, c


@pytest.mark.parametrize("mask,lq,lk", [
    (bsfa.key_set(T([3, 40, 41, 90, 300])) | bsfa.query_set(T([0, 40, 77])) | bsfa.sliding_window(9), 97, 97),
    (bsfa.key_set(T([5, 60])) | bsfa.causal() & bsfa.window(7), 80, 80),
    (bsfa.query_set(T([2, 50])) | bsfa.sliding_window(4) & bsfa.query_range(40, 150), 70, 90),
    (bsfa.key_set(T([1, 2, 3])) | (bsfa.query_set(T([10])) | bsfa.causal() & bsfa.document(T([0] * 30 + [1] * 34))),
     64, 64),
    (bsfa.causal() & (bsfa.key_set(T([3, 40])) | bsfa.query_set(T([50, 61])) | bsfa.sliding_window(9)), 90, 90),
    ((bsfa.key_set(T([7, 33])) & bsfa.key_range(0, 30) | bsfa.window(5)) & bsfa.query_range(2, 80), 85, 85),
    # parts that depend on one side only (broadcast evaluations)
    (bsfa.key_set(T([4, 50])) & bsfa.key_range(0, 40) | bsfa.query_set(T([9])) & bsfa.query_range(0, 20)
     | bsfa.sliding_window(3), 70, 70),
])
def test_parts_are_disjoint_and_cover_the_mask(mask, lq, lk):
    a, b, c = _dense_parts(mask, lq, lk)
    assert not (a & b).any() and not (a & c).any() and not (b & c).any()
    assert np.array_equal(a | b | c, mask.to_dense(lq, lk, align="top_left").numpy())


@pytest.mark.parametrize("mask", [
    ~bsfa.key_set(T([3, 40])) & bsfa.sliding_window(9),  # a set that removes pairs
    bsfa.shift(bsfa.query_set(T([3, 40])), 5) | bsfa.sliding_window(9),  # a set at shifted positions
    bsfa.key_set(T([[3, 40], [5, 6]])) | bsfa.sliding_window(9),  # a set per batch row
    bsfa.key_set(T([3, 40])) & bsfa.sliding_window(9),  # nothing left without the set
    bsfa.key_set(T([3, 40])) | bsfa.sliding_window(9) | bsfa.strided(16),  # the rest keeps two runs
    bsfa.key_set(T([3, 40])) | bsfa.query_set(T([7])),  # no band
    bsfa.key_set(torch.arange(0, 2 * (MAX_SET + 1), 2)) | bsfa.sliding_window(9),  # too many keys
    bsfa.sliding_window(9) | bsfa.global_tokens(4),  # no set
])
def test_masks_that_do_not_split(mask):
    assert split_parts(mask, 300, 300, 0) is None


@pytest.mark.interpreter
@pytest.mark.parametrize("mask,kw", [
    (bsfa.key_set(T([3, 40, 41, 90, 300])) | bsfa.query_set(T([0, 40, 77])) | bsfa.sliding_window(9),
     dict(Lq=97, Lk=97)),
    (bsfa.key_set(T([5, 60])) | bsfa.causal() & bsfa.window(7), dict(H=4, Hkv=2, Lq=80, Lk=80)),
    (bsfa.query_set(T([2, 50])) | bsfa.sliding_window(4) & bsfa.query_range(40, 150), dict(B=2, Lq=70, Lk=70)),
    (bsfa.causal() & (bsfa.key_set(T([3, 40])) | bsfa.query_set(T([50, 61])) | bsfa.sliding_window(9)),
     dict(H=4, Hkv=1, Lq=90, Lk=90)),
])
@pytest.mark.parametrize("phases", ["both", "forward"])
def test_split_matches_float64(mask, kw, phases, monkeypatch):
    """The three parts in both phases, or their forward and the whole mask's backward: outputs,
    logsumexps (rows that keep nothing: zeros and -inf) and all gradients against the float64
    reference."""
    from test_triton_interpreter import _check

    from blocksparse_fa.ops import select

    bsfa.compiler.clear_cache()  # the layouts keep their split decisions
    if phases == "forward":
        monkeypatch.setattr(select, "choose_set_split", lambda band, dtype, opts, *, phase="forward", **kw: phase
                            == "forward")
    with select.record() as rec:
        _check(mask, block=16, opts=dict(set_split=True), **kw)
    assert ("forward", "set_split") in rec
    assert (("backward", "set_split") in rec) == (phases == "both"), rec
    q = torch.randn(kw.get("B", 1), kw.get("H", 2), kw["Lq"], 16)
    k = torch.randn(kw.get("B", 1), kw.get("Hkv", 2), kw["Lk"], 16)
    lay = compile_mask(mask, kw["Lq"], kw["Lk"], 16)
    ex = bsfa.explain(q, k, k, lay, backend="triton", kernel_options=dict(set_split=True), needs_grad=True)
    assert ex.rewrite == "set_split" and ex.forward.count(" + ") >= 1, ex
    assert (" + " in ex.backward) == (phases == "both"), ex
    assert "_merge_residue" in ex.kernels
    # no Gluon band in the interpreter: the whole mask by default
    assert bsfa.explain(q, k, k, lay, backend="triton", needs_grad=True).rewrite is None
