"""Masks that keep two runs of keys per row as two one-run parts (``compiler/runs.py``,
``ops/runs.py``): which masks split and into what, the kernel choice, and outputs, logsumexp and all
gradients against the float64 reference through the Triton interpreter."""

import numpy as np
import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.compiler.intervals import mask_row_interval
from blocksparse_fa.compiler.runs import run_split, split_runs
from blocksparse_fa.ops import runs as ops_runs
from blocksparse_fa.ops import select
from blocksparse_fa.ops.options import KernelOptions
from conftest import check_route_against_float64

pytestmark = pytest.mark.interpreter

IDS = torch.repeat_interleave(torch.arange(4), torch.tensor([30, 50, 20, 28]))


def _keep(mask, n):
    """Bool ``(n, n)`` of an instance-free mask, from its row intervals' sets (small ``n``)."""
    from blocksparse_fa.compiler.intervals import _sets

    lo, hi = _sets(mask, np.arange(n, dtype=np.int64), n, 0, 0)
    keys = np.arange(n)
    return ((lo[:, :, None] <= keys) & (keys <= hi[:, :, None])).any(1)


@pytest.mark.parametrize("mask", [bsfa.key_range(40, 72) | bsfa.causal(),
                                  bsfa.load_pattern("shared_prefix", prefix=24, document=IDS),
                                  bsfa.load_pattern("block_diffusion", n=64, block=16),
                                  bsfa.query_range(60, 90) & bsfa.key_range(8, 24) | bsfa.sliding_window(16)])
def test_parts_are_disjoint_one_run_and_cover_the_mask(mask):
    n = 128
    assert mask_row_interval(mask, n, n, 0) is None  # two runs on some row
    (a, ia), (b, ib) = split_runs(mask, n, n, 0)
    whole, ka, kb = _keep(mask, n), _keep(a, n), _keep(b, n)
    assert not (ka & kb).any() and np.array_equal(ka | kb, whole)
    for part, iv in ((ka, ia), (kb, ib)):  # one run per row, as the intervals say
        lo, hi = iv[0][0], iv[1][0]
        keys = np.arange(n)
        assert np.array_equal(part, (keys >= lo[:, None]) & (keys < hi[:, None]))
    assert ia[1].astype(np.int64).sum() - ia[0].sum() >= ib[1].astype(np.int64).sum() - ib[0].sum()


def test_which_masks_split():
    n = 128
    for mask in (bsfa.causal(), bsfa.sliding_window(16), bsfa.causal() & bsfa.document(IDS),  # one run
                 bsfa.key_range(0, 16) | bsfa.causal(),  # prefix-LM: one run
                 bsfa.load_pattern("bigbird"), bsfa.parse("causal & (sliding_window(8) | strided(16))"),
                 bsfa.key_range(10, 20) | bsfa.key_range(40, 50) | bsfa.causal()):  # three runs on early rows
        assert split_runs(mask, n, n, 0) is None, mask
    # key_range | causal: causal() is the larger part, the key range past the diagonal the second
    (a, _), (b, _) = split_runs(bsfa.key_range(40, 72) | bsfa.causal(), n, n, 0)
    assert str(a) == "causal"
    lay = bsfa.compile_mask(bsfa.key_range(40, 72) | bsfa.causal(), n, n, 32)
    rs = run_split(lay, bsfa.compile_mask)
    assert rs is run_split(lay, bsfa.compile_mask)  # cached on the layout
    assert rs.rows == (0, 71) and rs.keys == (40, 72)  # rows 0..70 keep keys past the diagonal
    assert rs.mean_keys == pytest.approx(float(_keep(lay.mask, n).sum()) / n)


def test_choice_is_a_pure_function():
    gl = select.Choice("gluon", "interval", ())
    ca = select.Choice("gluon", "causal", ())
    tr = select.Choice("triton", "blocks", ())
    auto, on, off = KernelOptions(), KernelOptions(run_split=True), KernelOptions(run_split=False)
    bf = torch.bfloat16
    long, short = select.RUN_SPLIT_MIN_KEYS, select.RUN_SPLIT_MIN_KEYS - 1
    assert select.choose_run_split(ca, gl, bf, auto, mean_keys=long)
    assert not select.choose_run_split(ca, gl, bf, auto, mean_keys=short)  # short rows: the whole mask
    assert not select.choose_run_split(ca, tr, bf, auto, mean_keys=long)
    assert select.choose_run_split(tr, tr, bf, on, mean_keys=short)
    assert not select.choose_run_split(ca, gl, bf, off, mean_keys=long)
    for kw in (dict(dropout=True), dict(score_mod=True), dict(partial_dtypes=True)):
        assert not select.choose_run_split(ca, gl, bf, on, mean_keys=long, **kw)
    assert not select.choose_run_split(ca, gl, torch.float64, on)
    with pytest.raises(ValueError, match="run_split"):
        KernelOptions(run_split="yes")


def _check(mask, H=2, Hkv=1, D=16, n=128, seed=0, n_k=None):
    return check_route_against_float64(mask, "run_split", dict(run_split=True), H, Hkv, D, n, n_k, seed)


@pytest.mark.parametrize("name", ["key_range_causal", "shared_prefix", "block_diffusion"])
def test_split_matches_float64(name):
    mask = {"key_range_causal": bsfa.key_range(40, 72) | bsfa.causal(),
            "shared_prefix": bsfa.load_pattern("shared_prefix", prefix=24, document=IDS),
            "block_diffusion": bsfa.load_pattern("block_diffusion", n=64, block=16)}[name]
    _check(mask)


def test_second_part_added_from_its_own_gradients(monkeypatch):
    """Where the second part runs a backward that writes its gradients (the Gluon one on Hopper),
    they are added to the first part's over the rows and keys that part keeps: forced here on
    the interpreter's kernels (the second part on the whole sequence, ``BOX_SECOND`` off)."""
    monkeypatch.setattr(ops_runs, "BOX_SECOND", False)
    asked = []
    monkeypatch.setattr(ops_runs, "_adds_in_place", lambda *a: asked.append(a) or False)
    _check(bsfa.key_range(40, 72) | bsfa.causal(), H=2, Hkv=2, seed=1)
    assert len(asked) == 1  # the choice was made here (once), so the addition path ran


def test_explain_names_the_parts():
    q = torch.randn(1, 2, 128, 16)
    e = bsfa.explain(q, q, q, bsfa.key_range(40, 72) | bsfa.causal(), backend="triton", block_size=32,
                     kernel_options=dict(run_split=True), needs_grad=True)
    assert e.rewrite == "run_split" and " + " in e.forward and " + " in e.backward
    assert "_merge_residue" in e.kernels
    e = bsfa.explain(q, q, q, bsfa.key_range(40, 72) | bsfa.causal(), backend="triton", block_size=32,
                     needs_grad=True)  # no Gluon here: the whole mask
    assert e.rewrite is None and " + " not in e.forward


def test_parts_keep_bounds_that_grow_with_the_row():
    """Block diffusion splits into the noisy-to-clean blocks and the rest (each key's rows one run
    in both parts), not into its largest one-run union; Longformer's only one-run grouping (the
    global tokens as a part) has bounds that shrink after the global rows: not split."""
    n, half = 256, 128
    (a, ia), (b, ib) = split_runs(bsfa.load_pattern("block_diffusion", n=half, block=16), n, n, 0)
    ka, kb = _keep(a, n), _keep(b, n)
    for part in (ka, kb):
        for col in part.T:  # every key's rows: one run
            rows = np.nonzero(col)[0]
            assert len(rows) == 0 or rows[-1] - rows[0] + 1 == len(rows)
    assert split_runs(bsfa.parse("window(16) | global_tokens(8)"), n, n, 0) is None


def test_bottom_right_queries_split_too():
    """Fewer queries than keys (the last rows of a sequence, bottom-right aligned): the parts are
    compiled at the same alignment and the result matches float64."""
    mask = bsfa.key_range(90, 110) | bsfa.causal()  # rows at 64 .. 89 keep two runs
    assert split_runs(mask, 64, 128, 64) is not None
    _check(mask, H=2, Hkv=2, n=64, n_k=128, seed=2)


@pytest.mark.parametrize("name", ["key_range_causal", "shared_prefix", "block_diffusion"])
def test_second_part_on_its_box(monkeypatch, name):
    """``ops/runs.BOX_SECOND``: the second part on its box (views of q, k, v; the box's intervals;
    the device-interval kernels), outputs, logsumexp and every gradient against float64. A box of
    whole 64-row tiles so that it is smaller than the lengths here."""
    from blocksparse_fa.compiler import runs as compiler_runs

    monkeypatch.setattr(ops_runs, "BOX_SECOND", True)
    monkeypatch.setattr(compiler_runs, "BOX_ALIGN", 64)
    mask = {"key_range_causal": bsfa.key_range(140, 172) | bsfa.causal(),
            "shared_prefix": bsfa.load_pattern("shared_prefix", prefix=24, document=torch.cat([IDS, IDS + 4])),
            "block_diffusion": bsfa.load_pattern("block_diffusion", n=128, block=16)}[name]
    n = 256
    lay = bsfa.compile_mask(mask, n, n, 32)
    rs = run_split(lay, bsfa.compile_mask)
    r0, r1, c0, c1 = rs.box
    assert (r1 - r0) * (c1 - c0) < n * n and rs.box_bounds[0].shape[-1] == r1 - r0
    ran = _check(mask, n=n, seed=3)
    assert ("forward", "triton:interval") in ran and ("backward", "triton:interval") in ran


@pytest.mark.parametrize("box", [False, True])
def test_per_head_window_inside_a_key_range(monkeypatch, box):
    """Per-head windows (a mask with a head dim) narrower than a key range they can fall inside:
    only the grouping with the key range as the smaller part keeps one run per row (its rows keep
    the range around a window inside it); float64 check, on the full tensors and on the second
    part's box. Windows wider than the range give rows three runs' worth of parts: no split."""
    from blocksparse_fa.compiler import runs as compiler_runs

    monkeypatch.setattr(ops_runs, "BOX_SECOND", box)
    monkeypatch.setattr(compiler_runs, "BOX_ALIGN", 64)
    mask = bsfa.key_range(100, 130) | (bsfa.causal() & bsfa.sliding_window(bsfa.per_head(torch.tensor([8, 24]))))
    (a, _), (b, _) = split_runs(mask, 256, 256, 0)
    assert str(a) == "key_range(100, 130)" and "sliding_window" in str(b)  # the windows minus the range
    _check(mask, H=2, Hkv=2, n=256, seed=4)
    wide = bsfa.key_range(100, 130) | (bsfa.causal() & bsfa.sliding_window(bsfa.per_head(torch.tensor([16, 48]))))
    assert split_runs(wide, 256, 256, 0) is None
