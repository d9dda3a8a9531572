"""Kernel variants under the interpreter against the float64 reference: the masked loops without
bounds checks on even lengths, the five-GEMM backward (dQ through fp32 atomics, optionally TMA
reduce-adds), the FlexAttention-like backward tiles of band layouts and the warp-specialised
forward option."""

import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.ops import select
from blocksparse_fa.ops import triton_backend as tb
from blocksparse_fa.ops.options import GluonBwdConfig, GluonConfig, KernelOptions, TileConfig
from conftest import rel_err
from test_triton_interpreter import _check, _qkv

pytestmark = pytest.mark.interpreter

ATOMIC = {"deterministic": False}


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("Lq,Lk", [(96, 96), (70, 83)])
def test_even_lengths_drop_bounds_checks(Lq, Lk, even):
    """``even`` (the default): lengths that are multiples of the layout block compile masked loops
    without bounds terms (``KV_EVEN``/``EVEN``); other lengths, or ``even=False``, keep them. All
    match the reference."""
    opts = KernelOptions(even=even)
    lay = bsfa.compile_mask(bsfa.load_pattern("longformer", window=9, n_global=5), Lq, Lk, 16)
    assert tb._even(lay, opts) == (even and Lq % 16 == 0 and Lk % 16 == 0)
    _check(bsfa.load_pattern("longformer", window=9, n_global=5), H=4, Hkv=2, Lq=Lq, Lk=Lk, opts=opts)
    _check(bsfa.causal() & bsfa.sliding_window(20), Lq=Lq, Lk=Lk, opts=opts)


@pytest.mark.parametrize("text,H,Hkv,Lq,Lk", [
    ("longformer", 4, 2, 70, 83),            # GQA, ragged lengths, Lq != Lk
    ("causal", 2, 1, 60, 25),                # rows with nothing to attend (zero gradients)
    ("bigbird", 2, 2, 96, 96),
    ("causal & sliding_window(24)", 2, 2, 97, 97),
])
def test_atomic_backward_matches_reference(monkeypatch, text, H, Hkv, Lq, Lk):
    calls = []
    launch = tb._bwd_atomic_launch
    monkeypatch.setattr(tb, "_bwd_atomic_launch", lambda *a: calls.append(1) or launch(*a))
    mask = (bsfa.load_pattern(text, window=9, n_global=5) if text == "longformer" else
            bsfa.load_pattern(text, window=10, n_global=16, block=16) if text == "bigbird" else bsfa.parse(text))
    out, lse, grads = _check(mask, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, opts=ATOMIC)
    assert calls  # the five-GEMM kernel ran
    if text == "causal":
        assert (grads[0][:, :, :Lq - Lk] == 0).all()


def test_atomic_backward_with_split_tiles_dropout_and_even():
    """Split column work items (global tokens) write partial dK/dV; dQ adds from every piece."""
    mask = bsfa.load_pattern("longformer", window=8, n_global=5)
    for chunk in (1.5, None):
        opts = dict(ATOMIC, even=True, split_chunk=chunk)
        _check(mask, H=2, Hkv=1, Lq=96, Lk=96, opts=opts)
        _check(bsfa.causal() & bsfa.window(12), Lq=64, Lk=64, dropout_p=0.3, seed=5, opts=opts)


def test_atomic_backward_bf16_within_twice_eager_error():
    q, k, v = _qkv(1, 2, 2, 64, 64, 32, torch.bfloat16)
    mask = bsfa.causal() & bsfa.window(20)
    out = bsfa.attention(q, k, v, mask=mask, backend="triton", block_size=16, kernel_options=ATOMIC)
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    gr = torch.autograd.grad(bsfa.reference_attention(qd, kd, vd, mask), (qd, kd, vd), do.double())
    ge = torch.autograd.grad(bsfa.reference_attention(q, k, v, mask, upcast=False), (q, k, v), do)
    for ours, e, r in zip(g, ge, gr):
        assert ours.dtype == torch.bfloat16
        assert rel_err(ours, r) <= 2 * rel_err(e, r) + 1e-3


def test_atomic_backward_accumulates_and_keeps_empty_rows_zero():
    """``accumulate=`` adds dQ (through ``_dq_finish``) and dK/dV to the given tensors; rows with
    nothing to attend get dQ = 0 even when V holds NaN."""
    from blocksparse_fa.ops.validate import check_qkv

    q, k, v = (t.detach() for t in _qkv(1, 2, 1, 80, 48, 16))
    lay = bsfa.compile_mask(bsfa.causal(), 80, 48, 16)
    s = check_qkv(q, k, v)
    out, lse = tb.triton_forward(q, k, v, lay, s, 0.25, 0.0, 0)
    do = torch.randn_like(out)
    ref = tb.triton_backward(q, k, v, out, lse, do, lay, s, 0.25, 0.0, 0)
    base = [torch.randn_like(t) for t in (q, k, v)]
    got = tb.triton_backward(q, k, v, out, lse, do, lay, s, 0.25, 0.0, 0, accumulate=tuple(b.clone() for b in base),
                             deterministic=False)
    for g, b, r in zip(got, base, ref):
        assert torch.allclose(g, b + r, atol=1e-5, rtol=1e-5)
    v_nan = v.clone()
    v_nan[0, :, 3] = float("nan")
    out, lse = tb.triton_forward(q, k, v_nan, lay, s, 0.25, 0.0, 0)
    dq, _, _ = tb.triton_backward(q, k, v_nan, out, lse, do, lay, s, 0.25, 0.0, 0, deterministic=False)
    assert torch.equal(dq[:, :, :32], torch.zeros_like(dq[:, :, :32]))


def test_atomic_backward_dq_descriptor_falls_back_off_hopper():
    """``dq_desc`` (TMA reduce-adds of dQ tiles) needs tensor descriptors on a Hopper GPU; elsewhere
    (here: CPU tensors; Triton's interpreter has no descriptor reduce) the element-wise atomics
    run. The descriptor path itself is checked against float64 on the GPU by
    ``benchmarks/experiments/kernel_ab.py``."""
    _check(bsfa.load_pattern("longformer", window=9, n_global=5), H=2, Hkv=1, Lq=70, Lk=83,
           opts=dict(ATOMIC, dq_desc=True))


def test_flat_backward_loops_match_reference():
    """FlexAttention's backward tiles in flat loops (one iteration per 64-token kernel tile of a
    128-token layout block) give the reference's gradients, with ragged lengths and GQA."""
    _check(bsfa.load_pattern("longformer", window=100, n_global=20), H=2, Hkv=1, Lq=300, Lk=270, block=128,
           opts=dict(dkdv_tiles=TileConfig(64, 128, 8, 3, flat=True), dq_tiles=TileConfig(128, 64, 8, 3, flat=True)))


def test_band_backward_table_is_selectable():
    """The ``band_backward="flex"`` option gives band-like partial-heavy layouts (windows,
    documents) FlexAttention's tiles; Longformer (mostly partial) and causal keep theirs."""
    from blocksparse_fa.kernels.config import bwd_configs

    def tiles(mask, table="partial", n=16384):
        lc = select.layout_class(bsfa.compile_mask(mask, n, n, 128))
        return bwd_configs(128, torch.bfloat16, 128, 128, lc.band, lc.partial_heavy, lc.band_bwd, table)

    window, longformer, causal = bsfa.sliding_window(1024), bsfa.load_pattern("longformer"), bsfa.causal()
    before = [tiles(m) for m in (window, longformer, causal)]
    kv, q = tiles(window, "flex")
    assert kv == TileConfig(64, 128, 8, 3, flat=True) and q == TileConfig(128, 64, 8, 3, flat=True)
    assert [tiles(m, "flex") for m in (longformer, causal)] == before[1:]
    assert before[0][0] == TileConfig(32, 128, 8, 2)
    with pytest.raises(ValueError, match="band_backward must be one of"):
        KernelOptions(band_backward="fa3")


def test_dense_descriptor_forward_matches_reference(monkeypatch):
    """Kernel option ``forward="ws"`` (or ``"plain"``): layouts whose blocks are all full run the
    descriptor-only kernel (``kernels/forward_ws.py``; warp-specialised on Hopper), here with a
    ragged query length (clipped descriptor stores) and GQA; layouts with partial blocks, or a
    ragged key length, do not."""
    from blocksparse_fa.ops.validate import check_qkv

    calls = []
    launch = tb._dense_launch
    monkeypatch.setattr(tb, "_dense_launch", lambda *a: calls.append(1) or launch(*a))
    q, k, v = (t.detach() for t in _qkv(1, 4, 2, 200, 256, 16))
    s = check_qkv(q, k, v)
    with pytest.raises(ValueError, match="BSFA_EXPERIMENTAL_WS"):  # wrong on the H100: refused by default
        KernelOptions(forward="ws")
    monkeypatch.setenv("BSFA_EXPERIMENTAL_WS", "1")
    opts = KernelOptions(forward="ws")
    out, lse = tb.triton_forward(q, k, v, bsfa.compile_mask(bsfa.full(), 200, 256, 128), s, 0.25, 0.0, 0, opts=opts)
    assert calls
    for mask, lk in ((bsfa.causal(), 256), (bsfa.full(), 250)):
        lay = bsfa.compile_mask(mask, 200, lk, 128)
        assert tb.forward_choice(q, k[:, :, :lk], v[:, :, :lk], lay, s, 0.0, opts).family == "triton"
    ref, ref_lse = bsfa.reference_attention(q.double(), k.double(), v.double(), bsfa.full(), scale=0.25,
                                            return_lse=True)
    assert rel_err(out, ref) < 5e-6 and torch.allclose(lse.double(), ref_lse, atol=1e-5)


def test_gluon_refused_where_it_cannot_run(monkeypatch):
    """``forward="gluon"`` / ``backward="gluon"`` name why the Gluon kernels cannot run here (the
    interpreter, no Hopper GPU, no Gluon in this Triton); with ``"auto"`` CPU calls take the
    Triton kernels and match the float64 reference; the kernel modules import without a GPU."""
    from blocksparse_fa.kernels import backward_gluon as bg
    from blocksparse_fa.kernels import forward_gluon as fg

    assert fg.gluon_available() == (fg.GLUON_IMPORT_ERROR is None)
    assert bg.gluon_available() == (bg.GLUON_IMPORT_ERROR is None)
    q, k, v = _qkv(1, 2, 1, 128, 128, 16)
    for field in ("forward", "backward"):
        with pytest.raises(ValueError, match=f"{field}='gluon': the Gluon kernels need a CUDA GPU"):
            bsfa.attention(q, k, v, backend="triton", kernel_options={field: "gluon"}).sum().backward()
    monkeypatch.setattr(select, "_HW", {})
    monkeypatch.setattr(fg, "gluon_available", lambda: False)
    assert "has no usable Gluon Hopper API" in select._gluon_unavailable(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="gluon_fwd must be a GluonConfig"):
        KernelOptions(gluon_fwd={"stages": 3})
    with pytest.raises(ValueError, match="gluon_bwd must be a GluonBwdConfig"):
        KernelOptions(gluon_bwd=GluonConfig())
    with pytest.raises(ValueError, match="forward must be one of"):
        KernelOptions(forward="fa3")
    with pytest.raises(ValueError, match="interval must be True or False"):
        KernelOptions(interval="yes")

    calls = []
    monkeypatch.setattr(tb, "_gluon_launch", lambda *a, **kw: calls.append(1))
    monkeypatch.setattr(tb, "_gluon_bwd_launch", lambda *a, **kw: calls.append(1))
    ids = torch.tensor([0] * 40 + [1] * 60 + [2] * 28)
    for mask in (bsfa.full(), bsfa.causal(), bsfa.sliding_window(50), bsfa.causal() & bsfa.document(ids)):
        _check(mask, H=2, Hkv=1, Lq=128, Lk=128, block=64)
    assert not calls


def test_gluon_backward_config_schedules_validated():
    """Schedule options of the Gluon backward: overlap modes 0-2, and overlap needs two stages
    (its slots are released a step late; one slot would deadlock)."""
    cfg = GluonBwdConfig(pingpong=True, overlap=2, stages=3, dq_pingpong=True, dq_overlap=1)
    assert (cfg.overlap, cfg.dq_overlap, cfg.pingpong) == (2, 1, True)
    with pytest.raises(ValueError, match=r"overlap=3\): expected 0, 1 or 2"):
        GluonBwdConfig(overlap=3)
    with pytest.raises(ValueError, match="overlap=1 needs stages >= 2"):
        GluonBwdConfig(overlap=1, stages=1)
    with pytest.raises(ValueError, match="dq_overlap=2 needs dq_stages >= 2"):
        GluonBwdConfig(dq_overlap=2, dq_stages=1)
    # the persistent kernels: on, off, or None (on for one-interval layouts); nothing else
    assert GluonBwdConfig().persistent is None and GluonBwdConfig().dkdv_persistent is None
    for name in ("persistent", "dkdv_persistent"):
        with pytest.raises(ValueError, match=rf"{name}=1\): expected True, False or None"):
            GluonBwdConfig(**{name: 1})
    # SMs a persistent grid leaves free: an int >= 0 in both configs, also through kernel_options dicts
    for cls in (GluonConfig, GluonBwdConfig):
        assert cls(sm_margin=8).sm_margin == 8
        for bad in (-1, 2.0, True, "8"):
            with pytest.raises(ValueError, match=rf"{cls.__name__}\(sm_margin={bad!r}\): expected an int >= 0"):
                cls(sm_margin=bad)
    from blocksparse_fa.ops.options import as_options
    assert as_options(dict(gluon_fwd=dict(sm_margin=4))).gluon_fwd.sm_margin == 4


def test_gluon_config_groups():
    """Two or three consumer warp groups; their register budget (None: 240 with two, 160 with
    three, which is the most three groups and the producer can hold)."""
    assert (GluonConfig().groups, GluonConfig().regs, GluonConfig(groups=3).regs) == (2, 240, 160)
    assert GluonConfig(groups=3, consumer_regs=152).regs == 152
    for bad in (1, 4, True, 3.0, "3"):
        with pytest.raises(ValueError, match=rf"GluonConfig\(groups={bad!r}\): expected 2 or 3"):
            GluonConfig(groups=bad)
    for groups, bad in ((3, 168), (3, 240), (2, 248), (2, 20), (2, 100), (2, True)):
        with pytest.raises(ValueError, match=rf"consumer_regs={bad!r}\): expected a multiple of 8 from 24"):
            GluonConfig(groups=groups, consumer_regs=bad)
    from blocksparse_fa.ops.options import as_options
    assert as_options(dict(gluon_fwd=dict(groups=3))).gluon_fwd.regs == 160


def test_gluon_three_groups_launch(monkeypatch):
    """With three consumer groups a program covers 192 query rows: ``cdiv(Lq, 192)`` tiles per head,
    ``GROUPS=3`` and 160 registers per consumer thread; persistent only where ``Lq`` is a multiple of
    192 (rows past ``Lq`` are clipped by the per-head descriptors of a tile launch)."""
    from blocksparse_fa.ops.select import Hardware
    from blocksparse_fa.ops.validate import Shapes

    monkeypatch.setattr(select, "hardware", lambda device: Hardware("cuda", (9, 0), "", 132))
    monkeypatch.setattr(tb, "_ensure_tma_allocator", lambda device: None)
    seen = []
    monkeypatch.setattr(tb, "_launch", lambda fn, grid, args, n_key, device, **c: seen.append((grid, args, c)))
    meta = dict(device="meta", dtype=torch.bfloat16)
    t = torch.empty(1, dtype=torch.int32, device="meta")
    for L, case, want in ((256, "dense", (2 * 4 * 2, False)), (384, "dense", (2 * 4 * 2, True)),
                          (1152, "dense", (2 * 4 * 6, True)), (1024, "causal", (2 * 4 * 6, False))):
        q, k = torch.empty(2, 4, L, 64, **meta), torch.empty(2, 2, L, 64, **meta)
        s = Shapes(2, 4, 2, L, L, 64)
        tb._gluon_fwd_run(q, k, k, torch.empty_like(q), torch.empty(2, 4, L, device="meta"), t, t, t, 0, 0, s, 0.1,
                          case, GluonConfig(groups=3))
        grid, args, c = seen.pop()
        assert (grid[0], c["PERSISTENT"]) == want, (L, case)
        assert (c["GROUPS"], c["CONSUMER_REGS"], c["BLOCK_M"]) == (3, 160, 64)
        assert args[27:29] == (-(-L // 192), 2 * 4 * -(-L // 192))  # n_prog, n_items
    tb._gluon_fwd_run(q, k, k, torch.empty_like(q), torch.empty(2, 4, 1024, device="meta"), t, t, t, 0, 0, s, 0.1,
                      "causal", GluonConfig())
    grid, args, c = seen.pop()
    assert (grid[0], c["GROUPS"], c["CONSUMER_REGS"], args[27]) == (2 * 4 * 8, 2, 240, 8)


def test_gluon_segments_launch(monkeypatch):
    """Segment tiles (``GluonConfig.segments``) launch persistent with ``SEGMENTS``, ``n_prog`` the
    tables' (one program of rows beyond ``Lq``), whatever ``Lq % rows`` (the last rows of a tile
    are masked, not clipped), two or three groups; host-interval layouts take them only when asked,
    and not with global keys."""
    from blocksparse_fa.ops.select import Hardware
    from blocksparse_fa.ops.validate import Shapes

    monkeypatch.setattr(select, "hardware", lambda device: Hardware("cuda", (9, 0), "", 132))
    monkeypatch.setattr(tb, "_ensure_tma_allocator", lambda device: None)
    seen = []
    monkeypatch.setattr(tb, "_launch", lambda fn, grid, args, n_key, device, **c: seen.append((grid, args, c)))
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([300, 1, 339]))
    L = 640
    layout = bsfa.compile_mask(bsfa.causal() & bsfa.document(ids), L, L, 128)
    q, k = torch.randn(2, 4, L, 64, dtype=torch.bfloat16), torch.randn(2, 2, L, 64, dtype=torch.bfloat16)
    s = Shapes(2, 4, 2, L, L, 64)
    for groups, asked in ((2, True), (3, True), (2, None)):
        cfg = GluonConfig(groups=groups, segments=asked)
        tb._gluon_launch(q, k, k, torch.empty_like(q), torch.empty(2, 4, L), s, 0.1, "interval", cfg, layout)
        grid, args, c = seen.pop()
        rows = 64 * groups
        if asked:
            assert c["SEGMENTS"] and c["PERSISTENT"] and not c["M_MAJOR"] and c["GROUPS"] == groups
            n_prog = -(-L // rows) + 1
            assert args[27:29] == (n_prog, 2 * 4 * n_prog) and args[5].shape == (1, n_prog * rows)
            tiles = args[7]
            assert int(tiles[0]) >= 2 * 4 * -(-L // rows) and grid == (min(132, 2 * 4 * n_prog),)
        else:
            assert not c["SEGMENTS"]
    tb._gluon_launch(q, k, k, torch.empty_like(q), torch.empty(2, 4, L), s, 0.1, "interval",
                     GluonConfig(segments=True), layout, global_keys=(4, True))
    assert not seen.pop()[2]["SEGMENTS"]


def test_tma_allocator_set_in_every_thread():
    """Triton's allocator hook is a context variable: autograd's CUDA backward threads do not see
    the one the forward's thread set, so the launchers set it wherever it is missing."""
    import threading

    from triton.runtime import _allocation

    seen = []

    def worker():
        seen.append(isinstance(_allocation._allocator.get(), _allocation.NullAllocator))
        tb._ensure_tma_allocator(torch.device("cpu"))
        alloc = _allocation._allocator.get()
        seen.append(isinstance(alloc, _allocation.NullAllocator))
        seen.append(alloc(64, 16, None).numel())

    for _ in range(2):  # a second thread starts without the first one's allocator
        th = threading.Thread(target=worker)
        th.start()
        th.join()
    assert seen == [True, False, 64, True, False, 64]


@pytest.mark.parametrize("deterministic", [True, False])
def test_masked_lists_as_arithmetic_progressions(monkeypatch, deterministic):
    """Strided masks' masked lists stored as arithmetic progressions (the ``"step"`` LUT mode, used
    beyond ``PART_LIST_LIMIT`` entries; forced here): forward, the fused backward and the five-GEMM
    backward match the reference, with dropout and GQA (and without dropout)."""
    import blocksparse_fa.compiler.layout as layout_mod
    from blocksparse_fa.compiler import clear_cache

    opts = {"deterministic": deterministic}
    monkeypatch.setattr(layout_mod, "PART_LIST_LIMIT", 0)
    clear_cache()
    mask = bsfa.causal() & (bsfa.sliding_window(32) | bsfa.strided(32))
    lay = bsfa.compile_mask(mask, 96, 96, 16)  # up to three masked blocks a line, two apart
    rows, cols = lay.kernel_tables()
    assert rows.part_step == cols.part_step == 2
    _check(mask, H=4, Hkv=2, Lq=96, Lk=96, dropout_p=0.25, seed=3, opts=opts)
    if deterministic:
        _check(mask, Lq=96, Lk=96, opts=opts)
    clear_cache()


def test_persistent_gluon_forward_launch_geometry(monkeypatch):
    """The Gluon forward runs persistent (a grid of at most one program per SM) where ``Lq`` is a
    multiple of its 128-row tiles and every tensor is a 2-D row view; the view puts a head's rows
    at ``b·rows_per_batch + h·rows_per_head`` and its columns at ``h·cols_per_head``. Otherwise one
    program per query tile and head."""
    from blocksparse_fa.ops.select import Hardware
    from blocksparse_fa.ops.validate import Shapes

    monkeypatch.setattr(select, "hardware", lambda device: Hardware("cuda", (9, 0), "", 132))
    monkeypatch.setattr(tb, "_ensure_tma_allocator", lambda device: None)
    seen = []
    monkeypatch.setattr(tb, "_launch", lambda fn, grid, args, n_key, device, **c: seen.append((grid, args, c)))

    def run(q, k, cfg=GluonConfig()):
        B, H, Lq, D = q.shape
        s = Shapes(B, H, k.shape[1], Lq, k.shape[2], D)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, H, Lq, device=q.device)
        t = torch.empty(1, dtype=torch.int32, device=q.device)
        tb._gluon_fwd_run(q, k, k, out, lse, t, t, t, 0, 0, s, 0.1, "dense", cfg)
        grid, args, consts = seen.pop()
        return grid[0], consts["PERSISTENT"], args[-12:]

    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(2, 4, 256, 64, **meta), torch.empty(2, 2, 256, 64, **meta)
    # heads stacked along rows: (rows per batch, rows per head, columns per head) of q, k, v, out
    assert run(q, k) == (16, True, (1024, 256, 0, 512, 256, 0, 512, 256, 0, 1024, 256, 0))
    # (B, L, H, D) memory viewed transposed: heads side by side in a row of H·D columns
    qt, kt = torch.empty(2, 256, 4, 64, **meta).transpose(1, 2), torch.empty(2, 256, 2, 64, **meta).transpose(1, 2)
    assert run(qt, kt) == (16, True, (256, 0, 64, 256, 0, 64, 256, 0, 64, 1024, 256, 0))
    # broadcast kv heads (stride 0) read the same rows
    assert run(q, k[:, :1].expand(2, 2, 256, 64))[1:] == (True, (1024, 256, 0, 512, 0, 0, 512, 0, 0, 1024, 256, 0))
    # more items than SMs: one program per SM, or sm_margin SMs fewer (at least one program)
    big = torch.empty(1, 16, 4096, 64, **meta)
    assert run(big, big)[:2] == (132, True)
    assert run(big, big, GluonConfig(sm_margin=8))[:2] == (124, True)
    assert run(big, big, GluonConfig(sm_margin=500))[:2] == (1, True)
    # a ragged Lq, a batch stride that is no whole number of rows, or persistent=False: one program per tile
    assert run(torch.empty(2, 4, 200, 64, **meta), k)[:2] == (16, False)
    odd = torch.empty_strided((2, 1, 256, 64), (256 * 64 + 8, 0, 64, 1), **meta)
    assert run(odd, torch.empty(2, 1, 256, 64, **meta))[:2] == (4, False)
    assert run(q, k, GluonConfig(persistent=False)) == (16, False, (0,) * 12)
    # rows past int32 in a view (a slice of a much longer buffer): one program per tile
    huge = torch.empty_strided((2, 4, 256, 64), (2**37, 256 * 64, 64, 1), **meta)
    assert run(huge, k)[:2] == (16, False)
    # an unknown SM count: one program per tile
    monkeypatch.setattr(select, "hardware", lambda device: Hardware("cuda", (9, 0), "", 0))
    assert run(q, k) == (16, False, (0,) * 12)
    monkeypatch.setattr(select, "hardware", lambda device: Hardware("cuda", (9, 0), "", 132))
    # causal layouts keep one program per tile
    t = torch.empty(1, dtype=torch.int32, device="meta")
    s = Shapes(2, 4, 2, 256, 256, 64)
    tb._gluon_fwd_run(q, k, k, torch.empty_like(q), torch.empty(2, 4, 256, device="meta"), t, t, t, 0, 0, s, 0.1,
                      "causal", GluonConfig())
    assert seen.pop()[2]["PERSISTENT"] is False


def test_persistent_gluon_dkdv_launch_geometry(monkeypatch):
    """The Gluon dK/dV kernel runs persistent where ``GluonBwdConfig.dkdv_persistent`` asks, the
    layout is not causal and every tensor is a 2-D row view: at most one program per SM over
    ``Lk / (2·block_n)`` key tiles of each batch·kv head, with the views' geometry of Q, dO, K, V,
    dK, dV (dK/dV written from the registers need none); otherwise one program per key tile."""
    from blocksparse_fa.ops.options import GluonBwdConfig
    from blocksparse_fa.ops.select import Hardware
    from blocksparse_fa.ops.validate import Shapes

    monkeypatch.setattr(select, "hardware", lambda device: Hardware("cuda", (9, 0), "", 132))
    monkeypatch.setattr(tb, "_ensure_tma_allocator", lambda device: None)
    seen = []
    monkeypatch.setattr(tb, "_launch", lambda fn, grid, args, n_key, device, **c: seen.append((fn, grid, args, c)))

    def run(q, k, cfg=GluonBwdConfig(dkdv_persistent=True), causal=False, grad_dtype=None, intervals=None):
        B, H, Lq, D = q.shape
        s = Shapes(B, H, k.shape[1], Lq, k.shape[2], D)
        lse = torch.empty(B * H, Lq, device=q.device)
        grads = [torch.empty(t.shape, dtype=grad_dtype or t.dtype, device=t.device) for t in (q, k, k)]
        seen.clear()
        tb._gluon_bwd_launch(q, k, k, q, grads, lse, lse, s, 0.1, causal, False, cfg, intervals=intervals)
        fn, grid, args, consts = seen[0]
        assert fn is tb._bg._attn_bwd_dkdv_gluon and seen[1][0] is tb._bg._attn_bwd_dq_gluon
        return grid[0], consts["PERSISTENT"], args[-18:]

    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(2, 4, 256, 64, **meta), torch.empty(2, 2, 256, 64, **meta)
    # 2 key tiles of 128 (block_n 64) x 2 batch rows x 2 kv heads; heads stacked along rows
    assert run(q, k) == (8, True, (1024, 256, 0) * 2 + (512, 256, 0) * 4)
    # (B, L, H, D) memory viewed transposed: heads side by side in a row; float32 dK/dV from the
    # registers need no view
    qt, kt = torch.empty(2, 256, 4, 64, **meta).transpose(1, 2), torch.empty(2, 256, 2, 64, **meta).transpose(1, 2)
    assert run(qt, kt, grad_dtype=torch.float32) == (8, True, (256, 0, 64) * 4 + (0, 0, 0) * 2)
    # more items than SMs: one program per SM, sm_margin fewer in both kernels
    big = torch.empty(1, 16, 16384, 64, **meta)
    assert run(big, big)[:2] == (132, True)
    assert run(big, big, GluonBwdConfig(dkdv_persistent=True, persistent=True, sm_margin=16))[:2] == (116, True)
    assert seen[1][1][0] == 116 and seen[1][3]["PERSISTENT"]
    # by default on for interval layouts (both kernels; key tiles in the heaviest-first order), off
    # for dense ones, and for causal layouts: one program per key tile
    t = torch.empty(1, dtype=torch.int32, device="meta")
    assert run(q, k, GluonBwdConfig(), intervals=(t, t, t, t, 0, 0, t))[:2] == (8, True)
    assert seen[0][3]["M_MAJOR"] and seen[1][3]["PERSISTENT"]
    assert run(q, k, GluonBwdConfig()) == (8, False, (0,) * 18)
    assert not seen[1][3]["PERSISTENT"]
    assert run(q, k, GluonBwdConfig(dkdv_persistent=True), causal=True) == (8, False, (0,) * 18)


def test_gluon_per_head_dkdv_launch(monkeypatch):
    """``per_head_dkdv``: with GQA the dK/dV kernel runs one item per query head (``H`` heads, group
    size 1, ``KV_REP`` = the group size, so that item head ``h`` reads K/V head ``h // G``) over the
    caller's K and V, never copies of them, into per-query-head dK/dV; the dQ kernel keeps the GQA
    shapes. Persistent, K/V's row views are those of the kv heads."""
    from blocksparse_fa.ops.options import GluonBwdConfig
    from blocksparse_fa.ops.select import Hardware
    from blocksparse_fa.ops.validate import Shapes

    monkeypatch.setattr(select, "hardware", lambda device: Hardware("cuda", (9, 0), "", 132))
    monkeypatch.setattr(tb, "_ensure_tma_allocator", lambda device: None)
    seen = []
    monkeypatch.setattr(tb, "_launch", lambda fn, grid, args, n_key, device, **c: seen.append((fn, grid, args, c)))
    meta = dict(device="meta", dtype=torch.bfloat16)
    B, H, Hkv, L, D = 2, 8, 2, 256, 128
    q, k, v = torch.empty(B, H, L, D, **meta), torch.empty(B, Hkv, L, D, **meta), torch.empty(B, Hkv, L, D, **meta)
    lse = torch.empty(B * H, L, device="meta")
    s = Shapes(B, H, Hkv, L, L, D)
    t = torch.empty(1, dtype=torch.int32, device="meta")
    for per_head in (False, True):
        grads = [torch.empty(B, H if per_head and i else x.shape[1], L, D, **meta) for i, x in enumerate((q, k, v))]
        seen.clear()
        tb._gluon_bwd_launch(q, k, v, q, grads, lse, lse, s, 0.1, False, False, GluonBwdConfig(dkdv_persistent=True),
                             intervals=(t, t, t, t, 0, 0, t), per_head_dkdv=per_head)
        (fn, grid, args, consts), (fq, _, qargs, _) = seen
        assert fn is tb._bg._attn_bwd_dkdv_gluon and fq is tb._bg._attn_bwd_dq_gluon
        assert args[1] is k and args[2] is v and args[4] is grads[1] and args[5] is grads[2]
        n_prog = L // (2 * GluonBwdConfig().block_n)
        heads, group, rep = (H, 1, H // Hkv) if per_head else (H, H // Hkv, 1)
        assert args[32:34] == (heads, group) and consts["KV_REP"] == rep
        assert args[41] == n_prog * B * (H if per_head else Hkv)  # items
        assert args[-12:-6] == (Hkv * L, L, 0) * 2  # K and V: the kv heads' rows
        assert qargs[1] is k and qargs[26:28] == (H, H // Hkv)  # dQ: the GQA shapes


def test_gluon_dkdv_list_and_bounds_constexprs(monkeypatch):
    """The dK/dV and dQ kernels get ``LIST`` for the list mode's tables; the dK/dV kernel stages the
    rows' interval bounds with Q and dO (``BOUNDS_SMEM``) by default where they are two intervals
    (int64), not one (int32), and never without ``rows_smem`` or intervals;
    ``GluonBwdConfig.bounds_smem`` forces it."""
    from blocksparse_fa.ops.options import GluonBwdConfig
    from blocksparse_fa.ops.select import Hardware
    from blocksparse_fa.ops.validate import Shapes

    monkeypatch.setattr(select, "hardware", lambda device: Hardware("cuda", (9, 0), "", 132))
    monkeypatch.setattr(tb, "_ensure_tma_allocator", lambda device: None)
    seen = []
    monkeypatch.setattr(tb, "_launch", lambda fn, grid, args, n_key, device, **c: seen.append(c))
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(1, 2, 256, 128, **meta)
    s = Shapes(1, 2, 2, 256, 256, 128)
    lse = torch.empty(2, 256, device="meta")
    t32, t64 = (torch.empty(1, dtype=d, device="meta") for d in (torch.int32, torch.int64))

    def run(bounds, cfg=GluonBwdConfig(), lists=True):
        seen.clear()
        intervals = None if bounds is None else (bounds, bounds, t32, t32, 0, 0, t32)
        tb._gluon_bwd_launch(q, q, q, q, [torch.empty_like(q)] * 3, lse, lse, s, 0.1, False, False, cfg,
                             intervals=intervals, lists=lists)
        dkdv, dq = seen
        assert dkdv["LIST"] == dq["LIST"] == lists
        return dkdv["BOUNDS_SMEM"]

    assert run(t64) and not run(t32)
    assert run(t64, lists=False)  # by the bounds' dtype, whichever mode
    assert run(t32, GluonBwdConfig(bounds_smem=True)) and not run(t64, GluonBwdConfig(bounds_smem=False))
    assert not run(t64, GluonBwdConfig(rows_smem=False)) and not run(None, lists=False)
    with pytest.raises(ValueError, match="bounds_smem"):
        GluonBwdConfig(bounds_smem=1)


@pytest.fixture
def dkdv_consts(monkeypatch):
    """``dkdv_consts(cfg, atomic=True, scale=0.1, d=64)``: the constexprs a Gluon backward launch
    (``triton_backend._gluon_bwd_launch``, causal, B 1, H 2, 256 tokens, on meta tensors) gives its
    dK/dV kernel, captured instead of launched on a stand-in Hopper."""
    from blocksparse_fa.ops.select import Hardware
    from blocksparse_fa.ops.validate import Shapes

    monkeypatch.setattr(select, "hardware", lambda device: Hardware("cuda", (9, 0), "", 132))
    monkeypatch.setattr(tb, "_ensure_tma_allocator", lambda device: None)
    monkeypatch.setattr(tb.call_memo, "vouch", lambda: None)
    seen = []
    monkeypatch.setattr(tb, "_launch", lambda fn, grid, args, n_key, device, **c: seen.append((fn, c)))
    lse = torch.empty(2, 256, device="meta")

    def consts(cfg, atomic=True, scale=0.1, d=64):
        seen.clear()
        q = torch.empty(1, 2, 256, d, device="meta", dtype=torch.bfloat16)
        tb._gluon_bwd_launch(q, q, q, q, [torch.empty_like(q)] * 3, lse, lse, Shapes(1, 2, 2, 256, 256, d), scale,
                             True, atomic, cfg)
        (fn, c), = [x for x in seen if x[0] is tb._bg._attn_bwd_dkdv_gluon]
        return c

    return consts


def test_gluon_dq_lag_constexpr(dkdv_consts):
    """The five-GEMM dK/dV launch issues each step's dQ product a step late (``DQ_LAG``) by default
    at head dim 64 only; ``GluonBwdConfig.dq_lag`` forces it either way; the deterministic pair
    never gets it, and the config refuses a non-bool."""
    from blocksparse_fa.ops.options import GluonBwdConfig

    def lag(d, atomic=True, cfg=GluonBwdConfig()):
        return dkdv_consts(cfg, atomic, d=d)["DQ_LAG"]

    assert lag(64) and not lag(128)
    assert lag(128, cfg=GluonBwdConfig(dq_lag=True)) and not lag(64, cfg=GluonBwdConfig(dq_lag=False))
    assert not lag(64, atomic=False) and not lag(64, atomic=False, cfg=GluonBwdConfig(dq_lag=True))
    with pytest.raises(ValueError, match="dq_lag"):
        GluonBwdConfig(dq_lag=1)


def test_gluon_bwd_step_constexprs(dkdv_consts):
    """The dK/dV launch passes ``GluonBwdConfig``'s accumulator starts (``ROWS_ACC``; 2 only for a
    positive scale, which it divides by), the late dV product (``LATE_DV``; None: 128-row steps) and
    dK's shared dSᵀ (``DK_DS_SMEM``, five-GEMM only); ``select.gluon_bwd_config`` gives the five-GEMM
    modes at head dim 64 128-row steps with ``rows_acc=2`` and the late dV product, dense d 128
    ``rows_acc=2``, and a call's ``gluon_bwd`` wins; the config refuses values outside its fields'
    sets."""
    from blocksparse_fa.ops.options import GluonBwdConfig, KernelOptions

    def consts(cfg, atomic=True, scale=0.1, d=64):
        c = dkdv_consts(cfg, atomic, scale, d)
        return c["ROWS_ACC"], c["LATE_DV"], c["DK_DS_SMEM"], c["BLOCK_M"]

    assert consts(GluonBwdConfig()) == (0, False, False, 64)
    d64 = select.gluon_bwd_config(KernelOptions(), "causal+atomic_dq", 64)
    assert consts(d64) == (2, True, False, 128)
    assert consts(GluonBwdConfig(block_m=128, rows_acc=2, dk_ds_smem=True)) == (2, True, True, 128)
    assert consts(GluonBwdConfig(dk_ds_smem=True), atomic=False) == (0, False, False, 64)
    assert consts(d64, scale=-0.1) == (1, True, False, 128)  # -LSE/scale needs a positive scale
    assert consts(GluonBwdConfig(block_m=128, late_dv=False)) == (0, False, False, 128)
    assert select.gluon_bwd_config(KernelOptions(), "dense+atomic_dq", 64) == d64
    assert consts(select.gluon_bwd_config(KernelOptions(), "dense+atomic_dq", 128), d=128) == (2, False, False, 64)
    for mode, d in (("causal+atomic_dq", 128), ("causal", 64), ("interval+atomic_dq", 64), ("dense", 128)):
        assert select.gluon_bwd_config(KernelOptions(), mode, d) == GluonBwdConfig()
    mine = GluonBwdConfig(stages=3)
    assert select.gluon_bwd_config(KernelOptions(gluon_bwd=mine), "causal+atomic_dq", 64) is mine
    for bad, match in ((dict(rows_acc=3), "rows_acc"), (dict(late_dv=1), "late_dv"),
                       (dict(dk_ds_smem=None), "dk_ds_smem")):
        with pytest.raises(ValueError, match=match):
            GluonBwdConfig(**bad)


def test_list_dkdv_launch_takes_a_deal_table(monkeypatch):
    """The list mode's persistent dK/dV launch reads a deal table (``DEALT``) where the host knows
    the key tiles' work and they differ (Longformer's global key tile), tile-major, and so do the
    dQ kernel and the forward from their row tiles' work; not with
    ``GluonBwdConfig(deal=False)``, without the work, head by head (forced through
    ``triton_backend._M_MAJOR``) or for tiles of equal work."""
    import numpy as np

    import blocksparse_fa as bsfa
    from blocksparse_fa.compiler.block_lists import block_lists
    from blocksparse_fa.ops.options import GluonBwdConfig, GluonConfig
    from blocksparse_fa.ops.select import Hardware, list_work
    from blocksparse_fa.ops.validate import Shapes

    monkeypatch.setattr(select, "hardware", lambda device: Hardware("cuda", (9, 0), "", 132))
    monkeypatch.setattr(tb, "_ensure_tma_allocator", lambda device: None)
    seen = []
    monkeypatch.setattr(tb, "_launch", lambda fn, grid, args, n_key, device, **c: seen.append((args, c)))
    n, heads = 4096, 32
    lay = bsfa.compile_mask(bsfa.load_pattern("longformer", window=256, n_global=64), n, n, 128)
    bl = block_lists(lay, 128, 128, 64, 128)
    work = (list_work(bl, "dkdv"), bl.dkdv_order)
    q = torch.empty(1, heads, n, 128, device="meta", dtype=torch.bfloat16)
    lse = torch.empty(heads, n, device="meta")
    t = torch.empty(1, dtype=torch.int32, device="meta")
    s = Shapes(1, heads, heads, n, n, 128)

    def run(cfg=GluonBwdConfig(), kv_work=work, m_major=None):
        seen.clear()
        monkeypatch.setattr(tb, "_M_MAJOR", m_major)
        tb._gluon_bwd_launch(q, q, q, q, (q, q, q), lse, lse, s, 0.1, False, False, cfg, lay,
                             intervals=(t, t, t, t, 0, 0, t), lists=True, kv_work=kv_work)
        (args, consts), _ = seen
        return consts["DEALT"], args[13]

    dealt, table = run()
    assert dealt and table.dtype == torch.int32 and int(table.numel()) > 1 + 132
    # the dQ kernel's row tiles (Longformer's global rows) and the forward's, from their own work
    rows = (list_work(bl, "dq"), np.broadcast_to(np.arange(n // 128, dtype=np.int32), (1, n // 128)))
    seen.clear()
    tb._gluon_bwd_launch(q, q, q, q, (q, q, q), lse, lse, s, 0.1, False, False, GluonBwdConfig(), lay,
                         intervals=(t, t, t, t, 0, 0, t), lists=True, kv_work=work, q_work=rows)
    (_, dkdv), (dq_args, dq) = seen
    assert dkdv["DEALT"] and dq["DEALT"] and dq_args[10].dtype == torch.int32
    seen.clear()
    fwd = (list_work(bl, "forward"), rows[1])
    tb._gluon_fwd_run(q, q, q, q, lse, t, t, t, 0, 0, s, 0.1, "list", GluonConfig(), layout=lay, work=fwd)
    assert seen[0][1]["DEALT"]
    seen.clear()
    tb._gluon_fwd_run(q, q, q, q, lse, t, t, t, 0, 0, s, 0.1, "list", GluonConfig(deal=False), layout=lay, work=fwd)
    assert not seen[0][1]["DEALT"]
    assert not run(GluonBwdConfig(deal=False))[0] and not run(kv_work=None)[0]
    assert not run(m_major=False)[0]  # head by head: every grid-th item
    assert not run(kv_work=(np.ones_like(work[0]), work[1]))[0]  # equal tiles: no gain


def test_interval_kernels_deal_head_by_head_where_windows_leave_l2(monkeypatch):
    """The persistent interval kernels (forward, dK/dV, dQ) are tile-major unless every head's key
    window is at least ``TILE_MAJOR_WINDOW_BYTES`` of K/V and each program has
    ``TILE_MAJOR_MIN_ITEMS`` items or more (``select.tile_major_deal``); ``triton_backend._M_MAJOR``
    forces one order (experiments)."""
    import blocksparse_fa as bsfa
    from blocksparse_fa.ops.options import GluonBwdConfig
    from blocksparse_fa.ops.select import Hardware, tile_major_deal
    from blocksparse_fa.ops.validate import Shapes

    assert tile_major_deal(4096, 132, None) and tile_major_deal(4096, 0, 2**30)
    assert tile_major_deal(2048, 132, 64 * 2**20)            # 15.5 items per program: balance first
    assert tile_major_deal(4096, 132, 8 * 2**20)             # the windows share the L2
    assert not tile_major_deal(4096, 132, 16 * 2**20)
    monkeypatch.setattr(select, "hardware", lambda device: Hardware("cuda", (9, 0), "", 132))
    monkeypatch.setattr(tb, "_ensure_tma_allocator", lambda device: None)
    seen = []
    monkeypatch.setattr(tb, "_launch", lambda fn, grid, args, n_key, device, **c: seen.append(c["M_MAJOR"]))

    def m_major(window, heads, n=16384):
        lay = bsfa.compile_mask(bsfa.sliding_window(window), n, n, 128)
        q = torch.empty(1, heads, n, 128, device="meta", dtype=torch.bfloat16)
        out, lse = torch.empty_like(q), torch.empty(1, heads, n, device="meta")
        monkeypatch.setattr(tb, "_gluon_interval_tables", lambda *a: (None, None, None))
        tb._gluon_launch(q, q, q, out, lse, Shapes(1, heads, heads, n, n, 128), 0.1, "interval", GluonConfig(),
                         layout=lay)
        return seen.pop()

    # 32 heads x ~2K keys x 512 B = 32 MiB of windows, 31 items per program: head by head
    assert m_major(2048, 32) is False
    assert m_major(512, 32) is True                          # 8 MiB: they share the L2
    assert m_major(4096, 16) is True                         # 15.5 items per program
    monkeypatch.setattr(tb, "_M_MAJOR", True)
    assert m_major(2048, 32) is True
    monkeypatch.setattr(tb, "_M_MAJOR", False)
    assert m_major(512, 32) is False
    monkeypatch.setattr(tb, "_M_MAJOR", None)

    def bwd_m_major(window, heads, n=16384):
        lay = bsfa.compile_mask(bsfa.sliding_window(window), n, n, 128)
        q = torch.empty(1, heads, n, 128, device="meta", dtype=torch.bfloat16)
        lse = torch.empty(1, heads, n, device="meta")
        t = torch.empty(1, dtype=torch.int32, device="meta")
        wb = tb._window_bytes(lay, Shapes(1, heads, heads, n, n, 128), 2)
        tb._gluon_bwd_launch(q, q, q, q, (q, q, q), lse, lse, Shapes(1, heads, heads, n, n, 128), 0.1, False, False,
                             GluonBwdConfig(), lay, intervals=(t, t, t, t, 0, 0, t), window_bytes=wb)
        return seen.pop(-2), seen.pop()                      # dK/dV, dQ

    assert bwd_m_major(2048, 32) == (False, False)
    assert bwd_m_major(512, 32) == (True, True)
    assert bwd_m_major(4096, 16) == (True, True)
