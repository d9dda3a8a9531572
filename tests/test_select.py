"""The kernel choice (``ops/select.py``): one pure function per phase, the same answer for every
entry point, eager or compiled, expression or precompiled layout.

The CPU has no Hopper GPU, so the Gluon kernels are made "available" here by replacing the
device's :class:`Hardware` and the descriptor check, and their launchers by the exact PyTorch
backend: what is tested is which kernels each path asks for, and that the answers are right."""

import dataclasses

import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.ops import select
from blocksparse_fa.ops import triton_backend as tb
from blocksparse_fa.ops.merge import merge_attention
from blocksparse_fa.ops.options import GluonBwdConfig, GluonConfig, KernelOptions
from blocksparse_fa.ops.select import Hardware, LayoutClass, choose_backward, choose_forward
from blocksparse_fa.ops.torch_backend import torch_backward, torch_forward
from blocksparse_fa.ops.validate import Shapes
from conftest import rel_err

HOPPER = Hardware("cuda", (9, 0), "")
NO_GLUON = Hardware("cuda", (8, 0), "it needs a GPU of compute capability 9.x (Hopper, wgmma); this one is 8.0")
S = Shapes(1, 16, 4, 16384, 16384, 128)
DEFAULT = KernelOptions()


def _lc(kind, **kw):
    return LayoutClass(kind, S.Lq, S.Lk, (128, 128), **kw)


# ------------------------------------------------------------------------------------------------
# the pure function
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dense", "causal", "interval"])
def test_forward_gluon_where_it_applies(kind):
    c = choose_forward(_lc(kind), S, torch.bfloat16, HOPPER, DEFAULT)
    assert (c.family, c.mode, c.kernels) == ("gluon", kind, ("_attn_fwd_gluon",))
    assert str(c) == f"gluon:{kind}"


@pytest.mark.parametrize("why", ["blocks", "dropout", "score_mod", "out_dtype", "fp32", "no_tma", "d96", "ragged",
                                 "no_gluon", "option", "interval_off"])
def test_forward_falls_back_to_triton(why):
    lc, s, dtype, hw, opts, kw = _lc("causal"), S, torch.bfloat16, HOPPER, DEFAULT, {}
    if why == "blocks":
        lc = _lc("blocks")
    elif why in ("dropout", "score_mod", "out_dtype"):
        kw[why] = True
    elif why == "fp32":
        dtype = torch.float32
    elif why == "no_tma":
        kw["tma"] = False
    elif why == "d96":
        s = Shapes(1, 16, 4, 16384, 16384, 96)
    elif why == "ragged":
        lc = LayoutClass("dense", 16384, 16100, (128, 128))
    elif why == "no_gluon":
        hw = NO_GLUON
    elif why == "option":
        opts = KernelOptions(forward="triton")
    elif why == "interval_off":
        lc, opts = _lc("interval"), KernelOptions(interval=False)
    c = choose_forward(lc, s, dtype, hw, opts, **kw)
    assert (c.family, c.mode, c.kernels) == ("triton", "blocks", ("_attn_fwd",))


def test_forward_three_consumer_groups_where_the_host_builds_the_tables():
    """``GluonConfig(groups=3)`` (192-row programs) runs the Gluon forward on dense, causal and host
    interval layouts (causal needs no ``block_n == 2·block_m`` then); list layouts, whose tables
    are built for 128-row programs, go to the Triton kernels with it, and so do device-interval
    layouts without the segment tiles (their aligned tables are built for 128 rows). Without
    a ``gluon_fwd`` option the default is per layout kind and head dim (:func:`select.gluon_fwd_config`)."""
    three = KernelOptions(gluon_fwd=GluonConfig(groups=3))
    for kind in ("dense", "causal"):
        assert str(choose_forward(_lc(kind), S, torch.bfloat16, HOPPER, three)) == f"gluon:{kind}"
    odd = KernelOptions(gluon_fwd=GluonConfig(groups=3, block_m=64, block_n=64))
    assert str(choose_forward(_lc("causal"), S, torch.bfloat16, HOPPER, odd)) == "gluon:causal"
    assert choose_forward(_lc("causal"), S, torch.bfloat16, HOPPER,
                          KernelOptions(gluon_fwd=GluonConfig(block_n=64))).family == "triton"
    assert str(choose_forward(_lc("interval"), S, torch.bfloat16, HOPPER, DEFAULT)) == "gluon:interval"
    assert str(choose_forward(_lc("interval"), S, torch.bfloat16, HOPPER, three)) == "gluon:interval"
    lists = LayoutClass("blocks", S.Lq, S.Lk, (128, 128), lists=True, row_blocks=4.0, partial_fraction=0.2)
    assert str(choose_forward(lists, S, torch.bfloat16, HOPPER, KernelOptions(block_lists=True))) == "gluon:list"
    assert choose_forward(lists, S, torch.bfloat16, HOPPER, three.replace(block_lists=True)).family == "triton"
    dev = LayoutClass("device_interval", S.Lq, S.Lk, (128, 128))
    assert str(choose_forward(dev, S, torch.bfloat16, HOPPER, DEFAULT)) == "gluon:interval"
    assert str(choose_forward(dev, S, torch.bfloat16, HOPPER, three)) == "gluon:interval"
    aligned3 = KernelOptions(gluon_fwd=GluonConfig(groups=3, segments=False))
    assert str(choose_forward(dev, S, torch.bfloat16, HOPPER, aligned3)) == "triton:interval"
    # the defaults: an explicit config always wins; otherwise by kind and head dim
    assert select.gluon_fwd_config(three, "interval", 128) is three.gluon_fwd
    for kind in ("dense", "causal", "interval", "list"):
        for d in (64, 128):
            want = 3 if (kind, d) in (("dense", 64), ("causal", 64)) else 2
            assert select.gluon_fwd_config(DEFAULT, kind, d).groups == want
    assert select.gluon_fwd_config(DEFAULT, "causal", 64).overlap is False
    assert select.gluon_fwd_config(DEFAULT, "dense", 128) == GluonConfig()
    s64 = Shapes(1, 16, 4, 16384, 16384, 64)
    for kind in ("dense", "causal"):  # the default at d 64 runs on the Gluon kernel
        assert str(choose_forward(_lc(kind), s64, torch.bfloat16, HOPPER, DEFAULT)) == f"gluon:{kind}"


def test_forward_gluon_option_refused_without_gluon():
    with pytest.raises(ValueError, match="forward='gluon': it needs a GPU of compute capability 9.x"):
        choose_forward(_lc("dense"), S, torch.bfloat16, NO_GLUON, KernelOptions(forward="gluon"))
    assert choose_forward(_lc("dense"), S, torch.bfloat16, HOPPER, KernelOptions(forward="gluon")).family == "gluon"


@pytest.mark.parametrize("kind", ["dense", "causal"])
def test_backward_gluon_where_it_applies(kind):
    """By default the five-GEMM Gluon backward on dense and causal layouts (faster there) but not on
    context-parallel shards; ``deterministic=True`` the pair, ``False`` the five-GEMM."""
    pair = ("_attn_bwd_preprocess", "_attn_bwd_dkdv_gluon", "_attn_bwd_dq_gluon")
    five = ("_attn_bwd_preprocess", "_attn_bwd_dkdv_gluon", "_dq_finish")
    c = choose_backward(_lc(kind), S, torch.float16, HOPPER, DEFAULT)
    assert c.family == "gluon"
    assert (c.mode, c.kernels) == (kind + "+atomic_dq", five)
    c = choose_backward(_lc(kind, shard=True), S, torch.float16, HOPPER, DEFAULT)
    assert (c.mode, c.kernels) == (kind, pair)
    c = choose_backward(_lc(kind), S, torch.float16, HOPPER, KernelOptions(deterministic=True))
    assert (c.mode, c.kernels) == (kind, pair)
    for opts in (KernelOptions(deterministic=False), KernelOptions(backward="gluon", deterministic=False)):
        c = choose_backward(_lc(kind), S, torch.float16, HOPPER, opts)
        assert (c.mode, c.kernels) == (kind + "+atomic_dq", five)


@pytest.mark.parametrize("why", ["blocks", "dropout", "score_mod", "accumulate", "grad_dtype", "no_tma", "short",
                                 "option", "causal_tiles"])
def test_backward_falls_back_to_triton(why):
    lc, s, opts, kw = _lc("causal"), S, DEFAULT, {}
    if why == "blocks":
        lc = _lc("blocks")
    elif why in ("dropout", "score_mod", "accumulate", "grad_dtype"):
        kw[why] = True
    elif why == "no_tma":
        kw["tma"] = False
    elif why == "short":  # lengths must be multiples of both kernels' program rows
        s = Shapes(1, 16, 4, 192, 192, 128)
    elif why == "option":
        opts = KernelOptions(backward="triton")
    elif why == "causal_tiles":
        opts = KernelOptions(gluon_bwd=GluonBwdConfig(block_m=256))
    c = choose_backward(lc, s, torch.bfloat16, HOPPER, opts, **kw)
    assert (c.family, c.mode) == ("triton", "blocks")
    c = choose_backward(lc, s, torch.bfloat16, HOPPER, opts.replace(deterministic=False), **kw)
    assert c.mode == ("blocks" if why in ("score_mod", "grad_dtype") else "five_gemm")


def _dev_lc(**kw):
    return select.device_interval_class(S.Lq, S.Lk, batched=kw.pop("batched", False), ids=kw.pop("ids", False),
                                        **kw)


GLUON_BWD_KERNELS = ("_attn_bwd_preprocess", "_attn_bwd_dkdv_gluon", "_attn_bwd_dq_gluon")


def test_backward_gluon_on_device_intervals():
    """Intervals built on the device, without an id compare and the same for every head (batched
    per batch row is fine): the Gluon pair in its interval mode by default; ``deterministic=False``
    the five-GEMM kernel (dQ added in fp32, then ``_dq_finish``)."""
    five = ("_attn_bwd_preprocess", "_attn_bwd_dkdv_gluon", "_dq_finish")
    for lc in (_dev_lc(), _dev_lc(batched=True)):
        for opts in (DEFAULT, KernelOptions(backward="gluon"), KernelOptions(deterministic=True)):
            c = choose_backward(lc, S, torch.bfloat16, HOPPER, opts)
            assert (c.family, c.mode, c.kernels) == ("gluon", "interval", GLUON_BWD_KERNELS), opts
        for opts in (KernelOptions(deterministic=False), KernelOptions(backward="gluon", deterministic=False)):
            c = choose_backward(lc, S, torch.bfloat16, HOPPER, opts)
            assert (c.family, c.mode, c.kernels) == ("gluon", "interval+atomic_dq", five), opts
    s64 = Shapes(2, 8, 2, 4096, 4096, 64)
    lc = select.device_interval_class(4096, 4096, False, False)
    assert str(choose_backward(lc, s64, torch.float16, HOPPER, DEFAULT)) == "gluon:interval"


def test_five_gemm_on_device_intervals_with_few_items(monkeypatch):
    """``GLUON_FIVE_GEMM_DEVICE_INTERVAL_WAVES`` (8): under ``deterministic=None`` the five-GEMM
    kernel on device intervals whose dK/dV items (``B · Hkv · Lk / 128`` with the default 64-key
    consumer tiles) fit that many waves of the GPU's SMs; not for intervals per head, an unknown SM
    count or ``deterministic=True``; 0 turns it off."""
    h200 = Hardware("cuda", (9, 0), "", sm_count=132)
    gqa = Shapes(1, 8, 2, 65536, 65536, 128)  # 1,024 items: 7.8 waves
    mha = Shapes(1, 16, 16, 16384, 16384, 128)  # 2,048 items: 15.5 waves
    lc = _dev_lc()
    assert select.GLUON_FIVE_GEMM_DEVICE_INTERVAL_WAVES == 8.0
    monkeypatch.setattr(select, "GLUON_FIVE_GEMM_DEVICE_INTERVAL_WAVES", 0.0)
    assert str(choose_backward(lc, gqa, torch.bfloat16, h200, DEFAULT)) == "gluon:interval"  # off
    monkeypatch.setattr(select, "GLUON_FIVE_GEMM_DEVICE_INTERVAL_WAVES", 8.0)
    assert str(choose_backward(lc, gqa, torch.bfloat16, h200, DEFAULT)) == "gluon:interval+atomic_dq"
    assert str(choose_backward(_dev_lc(batched=True), gqa, torch.bfloat16, h200, DEFAULT)) \
        == "gluon:interval+atomic_dq"
    assert str(choose_backward(lc, mha, torch.bfloat16, h200, DEFAULT)) == "gluon:interval"
    assert str(choose_backward(lc, gqa, torch.bfloat16, HOPPER, DEFAULT)) == "gluon:interval"  # no SM count
    assert str(choose_backward(lc, gqa, torch.bfloat16, h200, KernelOptions(deterministic=True))) \
        == "gluon:interval"
    per_head = _dev_lc(per_head=True)
    s = Shapes(1, 2, 2, 16384, 16384, 128)
    assert str(choose_backward(per_head, s, torch.bfloat16, h200, DEFAULT)) == "gluon:interval"
    assert str(choose_backward(_lc("interval"), gqa, torch.bfloat16, h200, DEFAULT)) == "gluon:interval"


def test_backward_gluon_on_per_head_intervals():
    """Intervals that differ per head (per-head windows): the Gluon interval pair where they agree
    within every GQA group (each dK/dV program reads its group's table; ``head_runs``: the heads
    agree within aligned runs of that many), else the Triton backward of the class."""
    mha = Shapes(1, 16, 16, 16384, 16384, 128)
    for kind, (make, fallback, _) in _INTERVAL_CLASSES.items():
        lc = make(per_head=True)
        assert str(choose_backward(lc, mha, torch.bfloat16, HOPPER, DEFAULT)) == "gluon:interval", kind
        c = choose_backward(lc, S, torch.bfloat16, HOPPER, DEFAULT)  # G = 4, heads differ within groups
        assert (c.family, c.mode, c.kernels) == fallback, kind
    for runs, want in ((4, "gluon:interval"), (8, "gluon:interval"), (2, "triton:blocks")):
        lc = _lc("interval", batched=True, per_head=True, head_runs=runs)
        assert str(choose_backward(lc, S, torch.bfloat16, HOPPER, DEFAULT)) == want, runs
    for wins, runs in (([64, 64, 200, 200], 2), ([64, 200, 64, 200], 1), ([9] * 4, 1), ([5, 5, 5, 5, 7, 7, 7, 7], 4)):
        lc = select.layout_class(bsfa.compile_mask(bsfa.causal() & bsfa.sliding_window(bsfa.per_head(wins)), 512,
                                                   512, 64))
        assert (lc.per_head, lc.head_runs) == (runs > 1 or len(set(wins)) > 1, runs), wins


_COMMON = ["per_head", "dropout", "score_mod", "accumulate", "grad_dtype", "no_tma", "fp32", "d96", "ragged",
           "no_gluon", "option", "switched_off"]
# per class: its LayoutClass, its Triton fallback and the switch of its Gluon default
_INTERVAL_CLASSES = {
    "device_interval": (lambda **kw: _dev_lc(batched=True, **kw) if kw else _dev_lc(),
                        ("triton", "interval", ("_attn_bwd_preprocess", "_interval_bwd")),
                        "GLUON_DEVICE_INTERVAL_BACKWARD"),
    "interval": (lambda **kw: _lc("interval", batched="per_head" in kw, **kw),
                 ("triton", "blocks", ("_attn_bwd_preprocess", "_attn_bwd")), "GLUON_HOST_INTERVAL_BACKWARD"),
}


@pytest.mark.parametrize("kind, why", [("device_interval", w) for w in ["ids", *_COMMON]]
                         + [("interval", w) for w in _COMMON])
def test_backward_on_intervals_falls_back_to_triton(kind, why, monkeypatch):
    """Intervals built on the device, or a compiled layout's: the Triton backward of the class
    where the Gluon interval mode does not apply or is not wanted."""
    make, fallback, switch = _INTERVAL_CLASSES[kind]
    lc, s, dtype, hw, opts, kw = make(), S, torch.bfloat16, HOPPER, DEFAULT, {}
    if why in ("ids", "per_head"):
        lc = make(**{why: True})
    elif why in ("dropout", "score_mod", "accumulate", "grad_dtype"):
        kw[why] = True
    elif why == "no_tma":
        kw["tma"] = False
    elif why == "fp32":
        dtype = torch.float32
    elif why == "d96":
        s = Shapes(1, 16, 4, 16384, 16384, 96)
    elif why == "ragged":  # lengths must be multiples of both kernels' program rows and keys
        s = Shapes(1, 16, 4, 16384 - 64, 16384 - 64, 128)
        lc = dataclasses.replace(lc, q_len=s.Lq, kv_len=s.Lk)
    elif why == "no_gluon":
        hw = NO_GLUON
    elif why == "option":
        opts = KernelOptions(backward="triton")
    elif why == "switched_off":
        monkeypatch.setattr(select, switch, False)
    c = choose_backward(lc, s, dtype, hw, opts, **kw)
    assert (c.family, c.mode, c.kernels) == fallback
    if why == "switched_off":  # an explicit request still gets it
        assert str(choose_backward(lc, s, dtype, hw, KernelOptions(backward="gluon"))) == "gluon:interval"
    if kind == "interval" and why in ("per_head", "option", "d96"):  # the block fallback keeps its options
        assert choose_backward(lc, s, dtype, hw, opts.replace(deterministic=False), **kw).mode == "five_gemm"


@pytest.mark.interpreter
@pytest.mark.parametrize("hkv", [1, 2])
def test_device_interval_backward_reaches_the_gluon_launcher(hopper, monkeypatch, hkv):
    """Contiguous documents with a window (GQA and not): the backward goes to the Gluon interval
    launcher with the call's intervals, per-head-shared (``(Zb, 1, Lq)``) and without ids, and the
    gradients are those of the exact backend; ``backward="triton"`` keeps the Triton kernel."""
    from blocksparse_fa.ops import interval_backend as ib

    seen = []
    launch = ib.gluon_interval_backward

    def spy(q, k, v, out, lse, dout, iv, s, scale, dlse=None, cfg=None, atomic=False):
        seen.append((tuple(iv.lo.shape), iv.qid is None, cfg, atomic))
        return launch(q, k, v, out, lse, dout, iv, s, scale, dlse, cfg, atomic=atomic)

    monkeypatch.setattr(ib, "gluon_interval_backward", spy)
    mask = bsfa.causal() & bsfa.document(IDS) & bsfa.sliding_window(48)
    q, k, v = _inputs(Hkv=hkv)
    ref = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, backend="torch"), q, k, v)[2]
    for opts, want in ((None, "gluon:interval"), (dict(backward="triton"), "triton:interval"),
                       (dict(deterministic=False), "gluon:interval+atomic_dq")):
        seen.clear()
        ran, _, grads = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, backend="triton",
                                                            kernel_options=opts), q, k, v)
        assert ran == [("forward", "gluon:interval"), ("backward", want)]
        atomic = want.endswith("+atomic_dq")
        assert seen == ([((1, 1, L), True, None, atomic)] if want.startswith("gluon") else [])
        for a, b in zip(grads, ref):
            assert rel_err(a, b) < 1e-2
    ex = bsfa.explain(q, k, v, mask=mask, backend="triton")
    assert ex.backward == "gluon:interval"


def test_backward_gluon_on_host_intervals(monkeypatch):
    """Compiled layouts whose rows keep one key interval, the same for every head (per batch row is
    fine): the Gluon pair in its interval mode, as on device intervals; ``deterministic=False`` the
    five-GEMM kernel (not on context-parallel shards), by default only on rows of at least
    ``GLUON_FIVE_GEMM_INTERVAL_ROW_BLOCKS`` blocks."""
    five = ("_attn_bwd_preprocess", "_attn_bwd_dkdv_gluon", "_dq_finish")
    for lc in (_lc("interval", row_blocks=40.0), _lc("interval", batched=True, row_blocks=40.0)):
        for opts in (DEFAULT, KernelOptions(backward="gluon"), KernelOptions(deterministic=True)):
            c = choose_backward(lc, S, torch.bfloat16, HOPPER, opts)
            assert (c.family, c.mode, c.kernels) == ("gluon", "interval", GLUON_BWD_KERNELS), opts
            assert str(c) == "gluon:interval"
        for opts in (KernelOptions(deterministic=False), KernelOptions(backward="gluon", deterministic=False)):
            c = choose_backward(lc, S, torch.bfloat16, HOPPER, opts)
            assert (c.family, c.mode, c.kernels) == ("gluon", "interval+atomic_dq", five), opts
        shard = dataclasses.replace(lc, shard=True)
        assert str(choose_backward(shard, S, torch.bfloat16, HOPPER, KernelOptions(deterministic=False))) \
            == "gluon:interval"
    monkeypatch.setattr(select, "GLUON_FIVE_GEMM_INTERVAL_ROW_BLOCKS", 32.0)
    for rows, want in ((40.0, "gluon:interval+atomic_dq"), (8.0, "gluon:interval")):
        assert str(choose_backward(_lc("interval", row_blocks=rows), S, torch.bfloat16, HOPPER, DEFAULT)) == want
    assert str(choose_backward(_lc("interval", row_blocks=40.0), S, torch.bfloat16, HOPPER,
                               KernelOptions(deterministic=True))) == "gluon:interval"
    # Lq != Lk (bottom-right windows); d 64: short and long rows alike, but not on shards (asked for)
    s64 = Shapes(2, 8, 2, 4096, 2048, 64)
    for short in (dict(band_bwd=True), dict(short_partial=True), {}):
        lc = LayoutClass("interval", 4096, 2048, (128, 128), **short)
        for opts in (DEFAULT, KernelOptions(backward="gluon")):
            assert str(choose_backward(lc, s64, torch.float16, HOPPER, opts)) == "gluon:interval"
        shard = dataclasses.replace(lc, shard=True)
        assert str(choose_backward(shard, s64, torch.float16, HOPPER, DEFAULT)) == "triton:blocks"
        assert str(choose_backward(shard, s64, torch.float16, HOPPER, KernelOptions(backward="gluon"))) \
            == "gluon:interval"
        assert str(choose_backward(lc, s64, torch.float16, HOPPER, KernelOptions(backward="triton"))) \
            == "triton:blocks"
    for w in (256, 1024, 4096):
        lc = select.layout_class(bsfa.compile_mask(bsfa.causal() & bsfa.sliding_window(w), 16384, 16384))
        assert str(choose_backward(lc, Shapes(1, 16, 4, 16384, 16384, 64), torch.bfloat16, HOPPER, DEFAULT)) \
            == "gluon:interval", w
    with pytest.raises(ValueError, match="backward='gluon': it needs a GPU of compute capability 9.x"):
        choose_backward(_lc("interval"), S, torch.bfloat16, NO_GLUON, KernelOptions(backward="gluon"))


@pytest.mark.interpreter
def test_host_interval_backward_reaches_the_gluon_launcher(hopper, monkeypatch):
    """A compiled one-interval-per-row layout (rows 0-63 and 200-255 keep nothing): the backward
    goes to the Gluon launcher in its interval mode with the layout's cached tables, and the
    gradients are those of the exact backend; ``backward="triton"`` keeps the Triton kernels. A
    logsumexp that is finite on the layout's empty rows (a rewrite's part gets the whole mask's)
    reaches the kernels as -inf there."""
    seen = []
    launch = tb._gluon_bwd_launch

    def spy(q, k, v, dout, grads, lse, delta, s, scale, causal, atomic, cfg, layout=None, intervals=None,
            window_bytes=None, lists=False, kv_work=None, q_work=None, per_head_dkdv=False):
        seen.append((causal, atomic, intervals, lse.clone()))
        launch(q, k, v, dout, grads, lse, delta, s, scale, causal, atomic, cfg, layout, intervals)

    monkeypatch.setattr(tb, "_gluon_bwd_launch", spy)
    mask = bsfa.causal() & bsfa.sliding_window(100) & bsfa.query_range(64, 200)
    layout = bsfa.compile_mask(mask, L, L, 128)
    q, k, v = _inputs(Hkv=1)
    ref = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, backend="torch"), q, k, v)[2]
    tables = tb._gluon_bwd_interval_tables(layout, GluonBwdConfig(), torch.device("cpu"))
    assert tables[6] is not None and tables[6].shape == (1, 1, L)
    gluon = dict(backward="gluon")
    five = dict(backward="gluon", deterministic=False)
    for opts, want in ((gluon, "gluon:interval"), (None, "gluon:interval"), (dict(backward="triton"), "triton:blocks"),
                       (five, "gluon:interval+atomic_dq")):
        seen.clear()
        ran, _, grads = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=layout, backend="triton",
                                                            kernel_options=opts), q, k, v)
        assert ran == [("forward", "gluon:interval"), ("backward", want)]
        assert len(seen) == (1 if want.startswith("gluon") else 0)
        if seen:
            causal, atomic, intervals, _ = seen[0]
            assert not causal and atomic == (opts is five) and intervals[4:6] == (0, 0)
            # built once, kept on the layout
            assert all(a is b for a, b in zip(intervals[:4] + intervals[6:], tables[:4] + tables[7:]))
        for a, b in zip(grads, ref):
            assert rel_err(a, b) < 1e-2
    assert bsfa.explain(q, k, v, mask=layout, backend="triton", kernel_options=gluon).backward == "gluon:interval"
    seen.clear()
    s = Shapes(1, 2, 1, L, L, 64)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    tb.triton_backward(q.detach(), k.detach(), v.detach(), out, torch.zeros(1, 2, L), dout, layout, s, 0.125, 0.0, 0,
                       opts=KernelOptions(backward="gluon"))
    lse = seen[0][3]
    assert torch.isinf(lse[..., :64]).all() and torch.isinf(lse[..., 200:]).all() and (lse[..., 64:200] == 0).all()


def test_host_interval_tables_per_head():
    """A layout whose heads keep different intervals (per-head windows) gets one table per head
    (instance strides 0 / 1), each equal to that head's own layout's; heads that keep the same
    intervals share head 0's (strides 0 / 0)."""
    cfg, cpu = GluonBwdConfig(), torch.device("cpu")
    wins = [32, 96]
    lay = bsfa.compile_mask(bsfa.causal() & bsfa.sliding_window(bsfa.per_head(wins)), L, L, 128)
    lo, hi, kv_tab, q_tab, lzb, lzh, empty, kv_ord = tb._gluon_bwd_interval_tables(lay, cfg, cpu)
    assert (lo.shape, lzb, lzh, empty) == ((2, L), 0, 1, None)
    for h, w in enumerate(wins):
        one = tb._gluon_bwd_interval_tables(bsfa.compile_mask(bsfa.causal() & bsfa.sliding_window(w), L, L, 128),
                                            cfg, cpu)
        assert torch.equal(lo[h], one[0][0]) and torch.equal(hi[h], one[1][0])
        assert torch.equal(kv_tab[:, h], one[2][:, 0]) and torch.equal(q_tab[:, h], one[3][:, 0])
        assert torch.equal(kv_ord[h], one[7][0])  # one permutation per instance
    same = bsfa.compile_mask(bsfa.causal() & bsfa.sliding_window(bsfa.per_head([600, 700])), L, L, 128)
    assert tb._gluon_bwd_interval_tables(same, cfg, cpu)[4:6] == (0, 0)


def test_backward_of_an_interval_shard_runs_gluon_at_d128():
    """A context-parallel shard with one key interval per row (windows, documents) runs the Gluon
    interval mode under "auto" at d 128 (its rows without keys get a -inf logsumexp) and at d 64
    only with backward="gluon" (not measured there), where layouts that are not shards take it by
    default, short rows included; backward="triton" keeps Triton."""
    lc = _lc("interval", shard=True)
    c = choose_backward(lc, S, torch.bfloat16, HOPPER, DEFAULT)
    assert (c.family, c.mode) == ("gluon", "interval")
    assert choose_backward(lc, S, torch.bfloat16, HOPPER, KernelOptions(backward="triton")).family == "triton"
    s64 = Shapes(1, 16, 4, 16384, 16384, 64)
    assert choose_backward(lc, s64, torch.bfloat16, HOPPER, DEFAULT).family == "triton"  # shards at d 64
    assert str(choose_backward(_lc("interval", band_bwd=True), s64, torch.bfloat16, HOPPER, DEFAULT)) \
        == "gluon:interval"
    for cls in (lc, _lc("interval", band_bwd=True)):
        assert str(choose_backward(cls, s64, torch.bfloat16, HOPPER, KernelOptions(backward="gluon"))) \
            == "gluon:interval"
    # gradients asked for in float32 (partial sums) come from the Gluon kernels too, other dtypes not
    assert str(choose_backward(lc, S, torch.bfloat16, HOPPER, DEFAULT, grad_dtype="float32")) == "gluon:interval"
    assert choose_backward(lc, S, torch.bfloat16, HOPPER, DEFAULT, grad_dtype=True).family == "triton"
    for kind in ("dense", "causal"):
        assert str(choose_backward(_lc(kind), S, torch.bfloat16, HOPPER, DEFAULT, grad_dtype="float32")) \
            == f"gluon:{kind}+atomic_dq"


def test_backward_of_a_shard_stays_deterministic():
    c = choose_backward(_lc("blocks", shard=True), S, torch.bfloat16, HOPPER, KernelOptions(deterministic=False))
    assert c.mode == "blocks"


def test_layout_class_of_compiled_layouts():
    n = 512
    cls = lambda m, **kw: select.layout_class(bsfa.compile_mask(m, n, n, 128, **kw))  # noqa: E731
    assert cls(bsfa.full()).kind == "dense"
    assert cls(bsfa.causal()).kind == "causal"
    assert cls(bsfa.causal(), align="top_left").kind == "causal"
    assert select.layout_class(bsfa.compile_mask(bsfa.causal(), 256, 512, 128)).kind == "interval"  # q offset
    assert cls(bsfa.sliding_window(100)).kind == "interval"
    ids = torch.tensor([0] * 100 + [1] * 300 + [2] * 112)
    assert cls(bsfa.causal() & bsfa.document(ids)).kind == "interval"
    assert cls(bsfa.load_pattern("longformer", window=64, n_global=16)).kind == "blocks"
    lc = cls(bsfa.window(bsfa.per_head([10, 40])))
    assert lc.kind == "interval" and lc.batched and lc.per_head
    lc = cls(bsfa.sliding_window(bsfa.per_head([600, 700])))  # per-head windows, the same intervals at 512
    assert lc.kind == "interval" and lc.batched and not lc.per_head
    lc = cls(bsfa.causal() & bsfa.document(torch.stack([ids, ids.flip(0)])))  # per batch row
    assert lc.kind == "interval" and lc.batched and not lc.per_head


# ------------------------------------------------------------------------------------------------
# every path asks the same question: eager and compiled, expression and precompiled layout
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def hopper(monkeypatch):
    """Pretend the CPU is a Hopper GPU with Gluon: the Gluon launchers compute with the exact
    PyTorch backend, so results stay checkable."""
    monkeypatch.setattr(select, "hardware", lambda device: HOPPER)
    monkeypatch.setattr(select, "tma_ok", lambda *ts: True)

    def fwd(q, k, v, out, lse, s, scale, case, cfg, layout=None, global_keys=(0, False)):
        o, l = torch_forward(q, k, v, layout, s, scale, 0.0, 0)
        g, causal = global_keys
        if g:  # the global keys folded into the interval forward: merged here as the kernel does
            kg, vg = (t[:, :, :g].repeat_interleave(s.H // s.Hkv, 1).float() for t in (k, v))
            sc = q.float() @ kg.transpose(-1, -2) * scale
            if causal:
                sc = sc.masked_fill(torch.arange(g) > torch.arange(q.shape[2])[:, None], float("-inf"))
            lg = torch.logsumexp(sc, -1)
            o, l = merge_attention([(o, l), ((torch.softmax(sc, -1) @ vg).to(o.dtype), lg)])
        out.copy_(o)
        lse.copy_(l)

    def bwd(q, k, v, dout, grads, lse, delta, s, scale, causal, atomic, cfg, layout=None, intervals=None,
            window_bytes=None, lists=False, kv_work=None, q_work=None, per_head_dkdv=False):
        if per_head_dkdv:  # dK/dV per query head: each head's share of its group's gradient
            k, v = (t.repeat_interleave(s.G, 1) for t in (k, v))
            s = Shapes(s.B, s.H, s.H, s.Lq, s.Lk, s.D)
        # with the given logsumexp and delta (a part of a split mask gets the whole mask's), which
        # the exact backward takes as a zero output and a logsumexp gradient of -delta
        lse, delta = (t.reshape(s.B, s.H, s.Lq) for t in (lse, delta))
        for g, r in zip(grads, torch_backward(q, k, v, torch.zeros_like(dout), lse, dout, layout, s, scale, 0.0, 0,
                                              dlse=-delta)):
            g.copy_(r)

    monkeypatch.setattr(tb, "_gluon_launch", fwd)
    monkeypatch.setattr(tb, "_gluon_bwd_launch", bwd)

    from blocksparse_fa.ops import interval_backend as ib

    def gluon_intervals(q, k, v, iv, s, scale, cfg=None, kept=True):
        o, l = ib.torch_interval_forward(q, k, v, iv, s, scale)
        return o.to(q.dtype), l

    monkeypatch.setattr(ib, "gluon_interval_forward", gluon_intervals)

    def gluon_intervals_bwd(q, k, v, out, lse, dout, iv, s, scale, dlse=None, cfg=None, atomic=False):
        return tuple(g.to(t.dtype) for g, t in zip(ib.torch_interval_backward(q, k, v, out, lse, dout, iv, s, scale,
                                                                              dlse), (q, k, v)))

    monkeypatch.setattr(ib, "gluon_interval_backward", gluon_intervals_bwd)


L = 256
IDS = torch.tensor([0] * 70 + [1] * 130 + [2] * 56)
MASKS = {
    "dense": (lambda: None, "gluon:dense", "gluon:dense+atomic_dq"),
    "causal": (bsfa.causal, "gluon:causal", "gluon:causal+atomic_dq"),
    # the compiled layouts' interval backward: the Gluon pair at head dim 64 too (ops/select)
    "sliding_window": (lambda: bsfa.sliding_window(96), "gluon:interval", "gluon:interval"),
    # the expression holds this call's ids: intervals built on the device, no layout (contiguous
    # documents: the Gluon kernels on device tables); a precompiled layout takes the layout's kernels
    "documents": (lambda: bsfa.causal() & bsfa.document(IDS), "gluon:interval", "gluon:interval"),
    "documents, ids compared": (lambda: bsfa.causal() & bsfa.document(IDS, contiguous=False), "triton:interval",
                                "triton:interval"),
    # Longformer: the forward splits (global keys folded into the band's forward, the first rows'
    # split-K pair merged in), the backward runs the whole mask on the block kernels
    "longformer": (lambda: bsfa.window(16) | bsfa.global_tokens(8), "gluon:interval", "triton:blocks",
                   "global_split", ("forward",)),
    "strided": (lambda: bsfa.parse("causal & (sliding_window(16) | strided(16))"), "triton:blocks", "triton:blocks"),
    # attention sinks: the band on the interval kernels with the global keys folded into its forward
    "sinks": (lambda: bsfa.parse("causal & (sliding_window(48) | global_tokens(4))"), "gluon:interval",
              "gluon:interval", "global_split"),
    # more sinks than AUTO_GLOBAL_SPLIT_MAX: still folded into the band's forward, which splits;
    # the backward runs the whole mask
    "sinks, many": (lambda: bsfa.parse("causal & (sliding_window(48) | global_tokens(32))"), "gluon:interval",
                    "triton:blocks", "global_split", ("forward",)),
}


def _inputs(Hkv=1):
    torch.manual_seed(0)
    q = torch.randn(1, 2, L, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, Hkv, L, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, v


def _run(fn, q, k, v):
    with select.record() as ran:
        out = fn(q, k, v)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    return ran, out, grads


@pytest.mark.interpreter
@pytest.mark.parametrize("name", list(MASKS))
def test_eager_and_compiled_choose_the_same_kernels(hopper, name):
    """Eager ``attention``, ``torch.compile(fullgraph=True)`` of it (the custom op under AOT
    autograd: its backward receives a materialised logsumexp gradient), a precompiled layout, and a
    compiled ``nn.BlockSparseAttention`` all run the kernels the choice names, and agree."""
    torch._dynamo.reset()  # every mask compiles its own graphs (one code object: the recompile limit)
    make, fwd, bwd, *rewrite = MASKS[name]
    mask = make()
    q, k, v = _inputs()
    kw = dict(backend="triton", block_size=128)
    paths = {
        "eager": lambda q, k, v: bsfa.attention(q, k, v, mask=mask, **kw),
        "compiled": torch.compile(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, **kw), backend="aot_eager",
                                  fullgraph=True),
        "layout": lambda q, k, v: bsfa.attention(q, k, v, mask=bsfa.compile_mask(bsfa.full() if mask is None else mask, L, L, 128),
                                                 backend="triton"),
        "module": torch.compile(bsfa.nn.BlockSparseAttention(mask, block_size=128, backend="triton"),
                                backend="aot_eager", fullgraph=True),
    }
    want = [("forward", fwd), ("backward", bwd)]
    if rewrite:  # the split notes itself before its parts' kernels, in the phases that split
        phases = rewrite[1] if len(rewrite) > 1 else ("forward", "backward")
        want = [x for ph, c in want for x in ([(ph, rewrite[0])] if ph in phases else []) + [(ph, c)]]
    results = {}
    for path, fn in paths.items():
        ran, out, grads = _run(fn, q, k, v)
        expect = [("forward", "gluon:interval"), ("backward", "gluon:interval")] if (
            name.startswith("documents") and path == "layout") else want
        assert ran == expect, (path, ran)
        results[path] = (out, *grads)
    for path in ("compiled", "layout", "module"):
        for a, b in zip(results[path], results["eager"]):
            assert rel_err(a, b) < 1e-2, path
    ex = bsfa.explain(q, k, v, mask=mask, **kw)
    assert (ex.backend, ex.forward, ex.backward, ex.rewrite) == ("triton", fwd, bwd, (rewrite or [None])[0])


@pytest.mark.interpreter
def test_kernel_options_reach_compiled_graphs(hopper):
    """``kernel_options`` travel through the custom op as a constant: the compiled call runs the
    kernels the options ask for, the same as the eager call, and a new options value gives a new
    graph rather than a stale one."""
    q, k, v = _inputs()
    mask = bsfa.causal()
    f = torch.compile(lambda q, k, v, o: bsfa.attention(q, k, v, mask=mask, backend="triton", kernel_options=o),
                      backend="aot_eager", fullgraph=True)
    for opts, want in (({"forward": "triton", "backward": "triton"}, ["triton:blocks", "triton:blocks"]),
                       ({"backward": "triton"}, ["gluon:causal", "triton:blocks"]),
                       (None, ["gluon:causal", "gluon:causal+atomic_dq"]),
                       ({"deterministic": True}, ["gluon:causal", "gluon:causal"])):
        ran, _, _ = _run(lambda q, k, v: f(q, k, v, opts), q, k, v)
        assert [c for _, c in ran] == want, opts
        ran_eager, _, _ = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, backend="triton",
                                                               kernel_options=opts), q, k, v)
        assert ran_eager == ran


@pytest.mark.interpreter
def test_five_gemm_gluon_backward_reaches_the_launcher(hopper, monkeypatch):
    """``deterministic=False`` and the default (``GLUON_FIVE_GEMM_DEFAULT``) run the Gluon launcher's
    atomic-dQ variant (with the call's tiles) on dense and causal layouts, ``deterministic=True``
    the pair. Gradients stay those of the exact backend."""
    seen = []
    bwd = tb._gluon_bwd_launch

    def spy(q, k, v, dout, grads, lse, delta, s, scale, causal, atomic, cfg, layout=None, intervals=None,
            window_bytes=None, lists=False, kv_work=None, q_work=None, per_head_dkdv=False):
        seen.append((causal, atomic, cfg.block_n))
        bwd(q, k, v, dout, grads, lse, delta, s, scale, causal, atomic, cfg, layout, intervals)

    monkeypatch.setattr(tb, "_gluon_bwd_launch", spy)
    q, k, v = _inputs(Hkv=2)
    ref = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=bsfa.causal(), backend="torch"), q, k, v)[2]
    opts = dict(backward="gluon", deterministic=False, gluon_bwd=GluonBwdConfig(block_n=32))
    for kw, want in ((opts, "gluon:causal+atomic_dq"), (dict(deterministic=False), "gluon:causal+atomic_dq"),
                     ({}, "gluon:causal+atomic_dq"), (dict(deterministic=True), "gluon:causal")):
        seen.clear()
        ran, _, grads = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=bsfa.causal(), backend="triton",
                                                            kernel_options=kw), q, k, v)
        assert ran[1] == ("backward", want)
        assert seen == [(True, want.endswith("+atomic_dq"), 32 if "gluon_bwd" in kw else 64)]
        for a, b in zip(grads, ref):
            assert rel_err(a, b) < 1e-2
    ran, _, _ = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=None, backend="triton"), q, k, v)
    assert ran[1] == ("backward", "gluon:dense+atomic_dq")
    assert seen[-1] == (False, True, 64)
    monkeypatch.setattr(select, "GLUON_FIVE_GEMM_DEFAULT", frozenset())
    ran, _, _ = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=None, backend="triton"), q, k, v)
    assert ran[1] == ("backward", "gluon:dense")


def test_options_encode_round_trip():
    from blocksparse_fa.ops.options import TileConfig, decode_options

    assert KernelOptions().encode() == ""
    o = KernelOptions(lists="auto", deterministic=False, gluon_bwd=GluonBwdConfig(overlap=2, stages=3),
                      fwd_tiles=TileConfig(64, 64, 4, 2), split_chunk=1.5)
    assert decode_options(o.encode()) == o
    assert hash(o) == hash(decode_options(o.encode()))


def test_options_are_per_call_and_thread_safe():
    """Two threads building launch plans with different options at once each get plans of their own
    options (no global state): the tiles each thread's options force are the ones its plans hold.
    (Plans only: Triton's interpreter itself runs one kernel at a time.)"""
    import threading

    from blocksparse_fa.ops.options import TileConfig

    mask = bsfa.window(8) | bsfa.global_tokens(4)
    lay = bsfa.compile_mask(mask, 64, 64, 32)
    s = Shapes(1, 2, 2, 64, 64, 16)
    opts = {"a": KernelOptions(fwd_tiles=TileConfig(16, 16, 4, 1), dkdv_tiles=TileConfig(16, 32, 4, 1)),
            "b": KernelOptions(fwd_tiles=TileConfig(32, 16, 4, 1), dkdv_tiles=TileConfig(32, 32, 4, 1))}
    plans, errors = {n: [] for n in opts}, []

    def run(name):
        try:
            for _ in range(20):
                plans[name].append((tb._fwd_plan(lay, s, torch.float32, torch.device("cpu"), False, opts[name]),
                                    tb._bwd_plan(lay, s, torch.float32, torch.device("cpu"), False, False,
                                                 opts[name])))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(n,)) for n in opts]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for name, o in opts.items():
        assert all(f.cfg[0].block_m == o.fwd_tiles.block_m and b.cfg[0].block_m == o.dkdv_tiles.block_m
                   for f, b in plans[name])


def test_options_built_inside_a_compiled_function_are_refused():
    """Dynamo hands a KernelOptions constructed while tracing over without its fields: a clear error
    instead of silently running the defaults; dicts and objects built outside work."""
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    f = torch.compile(lambda q: bsfa.attention(q, k, v, backend="torch", kernel_options=KernelOptions(lists="fine")),
                      backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="built inside a torch.compile'd function"):
        f(q)
    outside = KernelOptions(lists="fine")
    for opts in (outside, {"lists": "fine"}):
        g = torch.compile(lambda q, o=opts: bsfa.attention(q, k, v, backend="torch", kernel_options=o),
                          backend="eager", fullgraph=True)
        assert torch.allclose(g(q), bsfa.attention(q, k, v, backend="torch"), atol=1e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("min_rows,window,lists", [(None, 40, False), (0, 44, False), (0, 48, True)])
def test_longformer_forward_split_batches_and_memory_orders(hopper, monkeypatch, min_rows, window, lists):
    """Longformer's default on Hopper with two batch rows, GQA and ``(B, L, H, D)`` memory: the
    forward as parts and the backward whole below ``SPLIT_BACKWARD_MIN_ROWS`` query rows times
    heads, both phases as parts from it (lowered to 0 here; another window, so that no cached
    choice of the other case is reused), except where the whole mask's backward runs the list mode
    (``lists``: the lists built on the CPU): output, logsumexp and gradients against float64."""
    if min_rows is not None:
        monkeypatch.setattr(select, "SPLIT_BACKWARD_MIN_ROWS", min_rows)
    if lists:
        monkeypatch.setattr(select, "_LIST_DEVICES", ("cuda", "cpu"))
    B, H, Hkv, n, D = 2, 4, 2, 512, 64
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, n, h, D, dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for h in (H, Hkv, Hkv))
    mask = bsfa.window(window) | bsfa.global_tokens(8)
    with select.record() as ran:
        out, lse = bsfa.attention(q, k, v, mask=mask, backend="triton", block_size=128, return_lse=True)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    assert ("forward", "global_split") in ran, ran
    assert (("backward", "global_split") in ran) == (min_rows == 0 and not lists), ran
    assert any(c.startswith("gluon:list") for p, c in ran if p == "backward") == lists, ran
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = bsfa.reference_attention(qd, kd, vd, mask, return_lse=True)
    want = torch.autograd.grad(ref.square().sum(), (qd, kd, vd))
    assert rel_err(out, ref) < 1e-2 and torch.allclose(lse.double(), ref_lse, atol=2e-2)
    for name, a, r in zip("qkv", grads, want):
        assert rel_err(a, r) < 2e-2, name


@pytest.mark.interpreter
def test_block_lists_reach_the_gluon_launchers(hopper, monkeypatch):
    """A block layout whose partial blocks hold at most two key runs per row (``key_range |
    causal``) runs the Gluon kernels' list mode in both phases with ``block_lists=True``, the tables
    built once on the layout; ``block_lists=False`` keeps the Triton block kernels, and so does the
    default's forward where most blocks are partial (its backward takes the lists at head dim 64 as
    at 128). Gradients are the exact backend's."""
    monkeypatch.setattr(select, "_LIST_DEVICES", ("cuda", "cpu"))
    seen = []
    fwd, bwd = tb._gluon_launch, tb._gluon_bwd_launch

    def fwd_spy(q, k, v, out, lse, s, scale, case, cfg, layout=None, global_keys=(0, False)):
        seen.append(("forward", case, tb._gluon_list_tables(layout, q.device)))
        fwd(q, k, v, out, lse, s, scale, case, cfg, layout, global_keys)

    def bwd_spy(q, k, v, dout, grads, lse, delta, s, scale, causal, atomic, cfg, layout=None, intervals=None,
                window_bytes=None, lists=False, kv_work=None, q_work=None, per_head_dkdv=False):
        seen.append(("backward", lists, intervals))
        bwd(q, k, v, dout, grads, lse, delta, s, scale, causal, atomic, cfg, layout, intervals)

    monkeypatch.setattr(tb, "_gluon_launch", fwd_spy)
    monkeypatch.setattr(tb, "_gluon_bwd_launch", bwd_spy)
    mask = bsfa.key_range(40, 100) | bsfa.causal()
    layout = bsfa.compile_mask(mask, L, L, 128)
    assert select.layout_class(layout).lists and select.layout_class(layout).kind == "blocks"
    q, k, v = _inputs(Hkv=1)
    ref = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, backend="torch"), q, k, v)[2]
    # two of three visited blocks partial: the default (select.BLOCK_LISTS) keeps the Triton kernels
    assert select.layout_class(layout).partial_fraction > select.BLOCK_LISTS["forward"]
    for opts, want in ((dict(block_lists=True), "gluon:list"), (dict(block_lists=False), None), (None, "bwd")):
        seen.clear()
        ran, _, grads = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=layout, backend="triton",
                                                            kernel_options=opts), q, k, v)
        if want is None:
            assert [c for _, c in ran] == ["triton:blocks", "triton:blocks"] and not seen
        elif want == "bwd":  # the default: the backward's lists take any partial fraction (d 64 too)
            assert [c for _, c in ran] == ["triton:blocks", "gluon:list"] and [x[:2] for x in seen] == [
                ("backward", True)]
        else:
            assert ran == [("forward", want), ("backward", want)]
            (_, case, tables), (_, lists, intervals) = seen
            assert case == "list" and lists
            lo, hi, _, q_tab, kv_tab, kv_ord, _ = tables
            assert lo.dtype == torch.int64  # two runs per row: packed
            assert all(a is b for a, b in zip(intervals, (lo, hi, kv_tab, q_tab, 0, 0, kv_ord)))
        for a, b in zip(grads, ref):
            assert rel_err(a, b) < 2e-2  # bf16 gradients against the exact backend's
    on = dict(block_lists=True)
    assert bsfa.explain(q, k, v, mask=layout, backend="triton", kernel_options=on).backward == "gluon:list"


@pytest.mark.interpreter
@pytest.mark.parametrize("Lk, text", [(L, "key_range(40, 100) | causal()"),
                                      (L + 128, "key_range(40, 100) | sliding_window(100)")])
def test_gqa_list_backward_per_query_head(hopper, monkeypatch, Lk, text):
    """With GQA, where a group's heaviest key column is too long for the list backward but one
    head's is not, the Gluon launcher gets the caller's K and V and ``per_head_dkdv`` (gradients
    per query head) and dK/dV are summed over each group: gradients equal the exact backend's,
    shaped like K and V (also with more keys than queries)."""
    monkeypatch.setattr(select, "_LIST_DEVICES", ("cuda", "cpu"))
    mask = bsfa.parse(text)
    layout = bsfa.compile_mask(mask, L, Lk, 128)
    lc = select.layout_class(layout)
    longest, mean = lc.list_columns
    assert lc.kind == "blocks" and longest > 0
    per_sm = mean * (Lk // 128) / 132  # one kv head
    monkeypatch.setattr(select, "LIST_LONG_COLUMN", 0.0)
    # the group's column fails the share test, one query head's passes
    monkeypatch.setattr(select, "LIST_COLUMN_SHARE", longest / (3 * per_sm))  # 2 kv heads fail, 4 pass
    seen = []
    bwd = tb._gluon_bwd_launch

    def bwd_spy(q, k, v, dout, grads, lse, delta, s, *args, **kw):
        seen.append((s, k.shape, tuple(g.shape for g in grads), kw["lists"], kw["per_head_dkdv"]))
        bwd(q, k, v, dout, grads, lse, delta, s, *args, **kw)

    monkeypatch.setattr(tb, "_gluon_bwd_launch", bwd_spy)
    torch.manual_seed(0)
    q = torch.randn(1, 4, L, 128, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, Lk, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))  # d 128: lists
    opts = dict(replay=False)
    ran, _, grads = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=layout, backend="triton", kernel_options=opts),
                         q, k, v)
    assert ran == [("forward", "triton:blocks"), ("backward", "gluon:list+per_head_dkdv")], ran
    (s, kshape, gshapes, lists, per_head), = seen
    assert (s.H, s.Hkv, lists, per_head) == (4, 2, True, True) and kshape == (1, 2, Lk, 128)
    assert gshapes == ((1, 4, L, 128), (1, 4, Lk, 128), (1, 4, Lk, 128))
    ref = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, backend="torch"), q, k, v)[2]
    for a, b, t in zip(grads, ref, (q, k, v)):
        assert a.shape == t.shape and rel_err(a, b) < 2e-2


def test_block_lists_in_the_choice():
    # by default the forward where up to 60 % of the blocks are partial, the backward whatever the
    # fraction but not where one key column outweighs the work per SM (LIST_COLUMN_SHARE): S has
    # 128 key tiles x 4 kv heads, 20 steps each on average, so ~78 steps per SM of 132
    hw = Hardware("cuda", (9, 0), "", 132)
    lc = _lc("blocks", lists=True, partial_fraction=0.4, list_columns=(60.0, 20.0))
    assert str(choose_forward(lc, S, torch.bfloat16, hw, DEFAULT)) == "gluon:list"
    assert str(choose_backward(lc, S, torch.bfloat16, hw, DEFAULT)) == "gluon:list"
    long = dataclasses.replace(lc, list_columns=(200.0, 20.0))
    assert str(choose_forward(long, S, torch.bfloat16, hw, DEFAULT)) == "gluon:list"
    # with GQA a group's column is G heads' work: as items of the 16 query heads (~310 steps per
    # SM) the column is one head's, and the lists run with dK/dV per query head, summed per group
    c = choose_backward(long, S, torch.bfloat16, hw, DEFAULT)
    assert str(c) == "gluon:list+per_head_dkdv" and c.kernels[-1] == "_group_sum"
    mha = Shapes(1, 4, 4, 16384, 16384, 128)
    assert str(choose_backward(long, mha, torch.bfloat16, hw, DEFAULT)) == "triton:blocks"
    too_long = dataclasses.replace(lc, list_columns=(700.0, 20.0))
    assert str(choose_backward(too_long, S, torch.bfloat16, hw, DEFAULT)) == "triton:blocks"
    on = KernelOptions(block_lists=True)
    assert str(choose_backward(long, S, torch.bfloat16, hw, on)) == "gluon:list"
    assert str(choose_backward(dataclasses.replace(lc, list_columns=(150.0, 20.0)), S, torch.bfloat16, hw,
                               DEFAULT)) == "gluon:list"
    # more SMs than work: the longest column against the mean one (LIST_LONG_COLUMN)
    small = Shapes(1, 2, 1, 16384, 16384, 128)
    for longest, want in ((70.0, "gluon:list"), (90.0, "triton:blocks")):
        lc_small = dataclasses.replace(lc, list_columns=(longest, 20.0))
        assert str(choose_backward(lc_small, small, torch.bfloat16, hw, DEFAULT)) == want
    heavy = _lc("blocks", lists=True, partial_fraction=0.8)  # mostly partial: the backward only
    assert str(choose_forward(heavy, S, torch.bfloat16, hw, DEFAULT)) == "triton:blocks"
    assert str(choose_backward(heavy, S, torch.bfloat16, hw, DEFAULT)) == "gluon:list"
    assert str(choose_forward(_lc("blocks", lists=True, partial_fraction=0.65), S, torch.bfloat16, HOPPER,
                              DEFAULT)) == "triton:blocks"
    # Longformer's fraction (0.57) takes the list forward
    assert str(choose_forward(_lc("blocks", lists=True, partial_fraction=0.57), S, torch.bfloat16, HOPPER,
                              DEFAULT)) == "gluon:list"
    lc = _lc("blocks", lists=True, partial_fraction=0.2)
    c = choose_forward(lc, S, torch.bfloat16, HOPPER, DEFAULT)
    assert (c.family, c.mode, c.kernels) == ("gluon", "list", ("_attn_fwd_gluon",))
    c = choose_backward(lc, S, torch.bfloat16, HOPPER, DEFAULT)
    assert (c.family, c.mode) == ("gluon", "list") and c.kernels[1:] == ("_attn_bwd_dkdv_gluon", "_attn_bwd_dq_gluon")
    off = KernelOptions(block_lists=False)
    assert str(choose_forward(lc, S, torch.bfloat16, HOPPER, off)) == "triton:blocks"
    assert str(choose_backward(lc, S, torch.bfloat16, HOPPER, off)) == "triton:blocks"
    # other tiles than the lists', another head dim, no Gluon, a layout that does not qualify
    other = KernelOptions(gluon_fwd=GluonConfig(block_n=64), gluon_bwd=GluonBwdConfig(block_m=32))
    assert str(choose_forward(lc, S, torch.bfloat16, HOPPER, other)) == "triton:blocks"
    assert str(choose_backward(lc, S, torch.bfloat16, HOPPER, other)) == "triton:blocks"
    d64 = Shapes(1, 16, 4, 16384, 16384, 64)  # d 64 as d 128
    assert str(choose_forward(lc, d64, torch.bfloat16, HOPPER, DEFAULT)) == "gluon:list"
    assert str(choose_backward(lc, d64, torch.bfloat16, HOPPER, DEFAULT)) == "gluon:list"
    assert str(choose_backward(long, d64, torch.bfloat16, hw, DEFAULT)) == "gluon:list+per_head_dkdv"
    assert str(choose_backward(lc, d64, torch.bfloat16, HOPPER, off)) == "triton:blocks"
    d96 = Shapes(1, 16, 4, 16384, 16384, 96)
    assert str(choose_forward(lc, d96, torch.bfloat16, HOPPER, DEFAULT)) == "triton:blocks"
    assert str(choose_forward(lc, S, torch.bfloat16, NO_GLUON, DEFAULT)) == "triton:blocks"
    assert str(choose_forward(_lc("blocks"), S, torch.bfloat16, HOPPER, DEFAULT)) == "triton:blocks"
    with pytest.raises(ValueError, match="block_lists must be True, False or None"):
        KernelOptions(block_lists="yes")


@pytest.mark.interpreter
def test_block_lists_under_compile(hopper, monkeypatch):
    """A compiled call (``fullgraph``, the custom op under AOT autograd) runs the list mode in both
    phases as the eager call does, and agrees with it."""
    monkeypatch.setattr(select, "_LIST_DEVICES", ("cuda", "cpu"))
    torch._dynamo.reset()
    q, k, v = _inputs()
    mask = bsfa.key_range(40, 100) | bsfa.causal()
    opts = {"block_lists": True}
    f = torch.compile(lambda q, k, v, o: bsfa.attention(q, k, v, mask=mask, backend="triton", block_size=128,
                                                        kernel_options=o), backend="aot_eager", fullgraph=True)
    ran, out, grads = _run(lambda q, k, v: f(q, k, v, opts), q, k, v)
    ran_eager, out_e, grads_e = _run(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, backend="triton",
                                                                     block_size=128, kernel_options=opts), q, k, v)
    assert ran == ran_eager == [("forward", "gluon:list"), ("backward", "gluon:list")]
    for a, b in zip((out, *grads), (out_e, *grads_e)):
        assert rel_err(a, b) < 1e-2
