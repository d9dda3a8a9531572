"""CUDA-only checks of the host path: no device-to-host synchronisation in a warm forward or
backward, CUDA-graph capture of a training step's attention, and ``torch.compile(fullgraph=True)``
on the GPU. Skipped without a GPU (CI is CPU-only; ``benchmarks/experiments/host_path.py`` runs them on the
H100 and records the result)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import blocksparse_fa as bsfa

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="compiled kernels: run with TRITON_INTERPRET=0")]

N = 2048


def _masks():
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([300, 700, 548, 500]))
    return {
        "dense": bsfa.full(),
        "causal": bsfa.causal(),
        "longformer": bsfa.causal() & bsfa.load_pattern("longformer", window=128, n_global=32),
        # bidirectional: on Hopper its forward runs as parts (global keys folded, first rows merged)
        "longformer_split": bsfa.load_pattern("longformer", window=128, n_global=32),
        "bigbird": bsfa.causal() & bsfa.load_pattern("bigbird", window=128, n_global=64),
        "documents": bsfa.causal() & bsfa.document(ids),
        "strided": bsfa.parse("causal & (sliding_window(16) | strided(16))"),
        "sinks": bsfa.parse("causal & (sliding_window(256) | global_tokens(4))"),
    }


def _qkv(H=4, Hkv=2, D=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(1, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    return q, k, v


def _against_float64(mask, variants, D=128):
    """``(results, want)``: per variant ``(label, kernel_options, blhd)`` the output, logsumexp and
    gradients (``results[label]``) and the kernels that ran (``results[label + "_ran"]``), on
    :func:`_qkv`'s inputs (``blhd``: in (B, L, H, D) memory, as the Hugging Face hook passes them);
    ``want``: the float64 reference's."""
    q, k, v = _qkv(D=D)
    do = torch.randn_like(q)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = bsfa.attention(*ref, mask=mask, backend="torch", return_lse=True)
    want = [out.detach(), lse.detach()] + list(torch.autograd.grad(out, ref, do.double()))
    res = {}
    for label, kw, blhd in variants:
        qi, ki, vi = q, k, v
        if blhd:
            qi, ki, vi = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
        with bsfa.ops.select.record() as ran:
            out, lse = bsfa.attention(qi, ki, vi, mask=mask, kernel_options=kw, return_lse=True)
            res[label] = [out.detach(), lse.detach()] + list(torch.autograd.grad(out, (qi, ki, vi), do))
        res[label + "_ran"] = ran
    return res, want


def _within_twice_whole(got, whole, want):
    """Every tensor of ``got`` free of NaN and within twice ``whole``'s error against ``want``."""
    for a, b, r in zip(got, whole, want):
        assert not a.isnan().any()
        err = (a.double() - r).norm() / r.norm()
        err_whole = (b.double() - r).norm() / r.norm()
        assert err < 2 * max(err_whole, 1e-3), (err, err_whole)


def _output_and_grads_near_float64(mask, q, k, v, do, out, grads, tol=1e-2):
    """``out`` and ``grads`` (dQ, dK, dV) free of NaN and within ``tol`` (relative norm) of float64."""
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = bsfa.reference_attention(*ins, mask)
    want = torch.autograd.grad(ref, ins, do.double())
    for what, a, b in zip("o q k v".split(), (out, *grads), (ref, *want)):
        err = ((a.double() - b).norm() / b.norm()).item()
        assert not a.isnan().any() and err < tol, f"d{what}: relative error {err:.2e}"


@pytest.mark.parametrize("name", list(_masks()))
@pytest.mark.parametrize("entry", ["attention", "layout", "module"])
def test_warm_step_never_syncs(name, entry):
    mask = _masks()[name]
    q, k, v = _qkv()
    do = torch.randn_like(q)
    mod = bsfa.nn.BlockSparseAttention(mask)
    lay = bsfa.compile_mask(mask, N, N, device="cuda")
    call = {"attention": lambda: bsfa.attention(q, k, v, mask=mask), "layout": lambda: bsfa.attention(q, k, v, mask=lay),
            "module": lambda: mod(q, k, v)}[entry]
    torch.autograd.grad(call(), (q, k, v), do)  # first call builds tables on the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            torch.autograd.grad(call(), (q, k, v), do)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", list(_masks()))
def test_cuda_graph_capture_matches_eager(name):
    mask = _masks()[name]
    q, k, v = _qkv(seed=1)
    do = torch.randn_like(q)

    def step():
        out = bsfa.attention(q, k, v, mask=mask)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            ref = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    with bsfa.ops.select.record() as ran:
        step()
    atomic_dq = any(c.endswith("+atomic_dq") for _, c in ran)  # dense, causal, documents of few key tiles
    for seed in (2, 3):  # new inputs copied into the captured buffers
        g = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for t in (q, k, v, do):
                t.copy_(torch.randn(t.shape, device="cuda", generator=g, dtype=t.dtype))
        graph.replay()
        eager = step()
        for i, (a, b) in enumerate(zip(static, eager)):
            if atomic_dq and i == 1:  # the five-GEMM backward's dQ: fp32 adds in varying order
                assert ((a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()).item()
            else:
                assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["expr_inside", "text", "layout", "module", "op"])
def test_compile_fullgraph_on_gpu(kind):
    torch._dynamo.reset()
    mask = bsfa.causal() & bsfa.window(100)
    lay = bsfa.compile_mask(mask, N, N, device="cuda")
    mod = bsfa.nn.BlockSparseAttention(mask)
    fn = {"expr_inside": lambda q, k, v: bsfa.attention(q, k, v, mask=bsfa.causal() & bsfa.window(100)),
          "text": lambda q, k, v: bsfa.attention(q, k, v, mask="causal & window(100)"),
          "layout": lambda q, k, v: bsfa.attention(q, k, v, mask=lay),
          "module": lambda q, k, v: mod(q, k, v),
          "op": lambda q, k, v: bsfa.attention_op(q, k, v, mask)}[kind]
    q, k, v = _qkv(seed=4)
    do = torch.randn_like(q)
    out = torch.compile(fn, fullgraph=True)(q, k, v)
    g = torch.autograd.grad(out, (q, k, v), do)
    ref = bsfa.attention(q, k, v, mask=mask)
    gr = torch.autograd.grad(ref, (q, k, v), do)
    assert torch.equal(out, ref)
    for a, b in zip(g, gr):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ids_on", ["cuda", "cpu"])
@pytest.mark.parametrize("entry", ["attention", "attention_op", "module"])
def test_compile_fullgraph_document_mask_built_inside(entry, ids_on):
    """``causal() & document(ids)`` built inside the compiled function from the step's ids (the
    training loop's form) traces on this GPU's torch (2.11 could not take the ``id()`` of the
    mask's own copy of the ids) and gives the eager gradients."""
    torch._dynamo.reset()
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([300, 700, 548, 500])).to(ids_on)

    mod = bsfa.nn.BlockSparseAttention(bsfa.causal())

    def fn(q, k, v, ids):
        if entry == "module":  # the module's causal mask and this step's documents
            return mod(q, k, v, mask=bsfa.document(ids, contiguous=True))
        return getattr(bsfa, entry)(q, k, v, mask=bsfa.causal() & bsfa.document(ids, contiguous=True))

    q, k, v = _qkv(seed=5)
    do = torch.randn_like(q)
    out = torch.compile(fn, fullgraph=True)(q, k, v, ids)
    g = torch.autograd.grad(out, (q, k, v), do)
    ref = fn(q, k, v, ids)
    gr = torch.autograd.grad(ref, (q, k, v), do)
    for a, b in zip((out, *g), (ref, *gr)):
        assert torch.isfinite(a).all()
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2


def test_direct_launches_match_tritons_path(monkeypatch):
    """Repeat launches go straight to the compiled kernel's launcher (``ops/launcher.py``) and give
    bit-identical results to Triton's own launch path."""
    from blocksparse_fa.ops import launcher

    mask = _masks()["longformer"]
    q, k, v = _qkv(seed=5)
    do = torch.randn_like(q)
    runs = []
    for enabled in (True, False):
        monkeypatch.setattr(launcher.Launch, "__call__", launcher.Launch.__call__)
        if not enabled:
            monkeypatch.setattr(launcher.Launch, "__call__",
                                lambda self, grid, *a: self.fn[grid](*a, **self.consts))
        for _ in range(3):
            out = bsfa.attention(q, k, v, mask=mask)
            runs.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    lay = bsfa.compile_mask(mask, N, N, device="cuda")
    plans = [p for key, p in lay.cache.items() if isinstance(key, tuple) and key[0] in ("fwd", "bwd")]
    assert sum(bool(p.launch.records) for p in plans) >= 2  # forward and backward took the direct path
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b)


def test_reduce_overhead_captures_the_step():
    """``torch.compile(mode="reduce-overhead")`` puts our forward and backward into CUDA graphs (no
    CPU tensor or sync in the op without dropout), matching eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer = bsfa.nn.BlockSparseMultiheadAttention(256, 4, _masks()["longformer"], num_kv_heads=2, rotary=True,
                                                  device="cuda", dtype=torch.bfloat16)
    step = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(1, N, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(4):
        out = step(x)
        g, = torch.autograd.grad(out.float().square().sum(), x)
    ref = layer(x)
    gr, = torch.autograd.grad(ref.float().square().sum(), x)
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(out, ref) < 2e-2 and rel(g, gr) < 2e-2


def test_dtype_switch_same_head_dim():
    """bf16, float32 and float16 calls at one head dim share launch plans' launchers: each must run
    its own compiled variant (a launcher keyed without dtypes read float32 as bfloat16)."""
    mask = bsfa.load_pattern("longformer", window=128, n_global=32)
    for dt in (torch.bfloat16, torch.float32, torch.float16, torch.bfloat16):
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v, do = (torch.randn(1, 2, 1000, 64, device="cuda", dtype=dt, generator=g) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        out = bsfa.attention(q, k, v, mask=mask)
        got = torch.autograd.grad(out, (q, k, v), do)
        ref = bsfa.reference_attention(q, k, v, mask)
        want = torch.autograd.grad(ref, (q, k, v), do.double())
        tol = 1e-4 if dt == torch.float32 else 2e-2
        for name, a, b in zip("o q k v".split(), (out, *got), (ref, *want)):
            err = ((a.double() - b).norm() / b.norm()).item()
            assert err < tol, f"{dt} d{name}: relative error {err:.2e}"


def _kernels_run(fn) -> list:
    """The attention kernels one call of ``fn`` launches, as ``torch.profiler`` names them."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    return sorted(n for n in names if n.startswith(("_attn", "_interval", "_dq_finish", "_global")))


@pytest.mark.parametrize("name", ["dense", "causal", "longformer", "longformer_split", "documents"])
def test_eager_and_compiled_run_the_kernels_explain_names(name):
    """The kernels that really run, eagerly and under ``torch.compile(fullgraph=True)`` (forward and
    backward), are the same, and are those ``bsfa.explain`` names."""
    mask = _masks()[name]
    q, k, v = _qkv(H=4, Hkv=2, D=128)
    do = torch.randn_like(q)
    eager = lambda: torch.autograd.grad(bsfa.attention(q, k, v, mask=mask), (q, k, v), do)  # noqa: E731
    f = torch.compile(lambda q, k, v: bsfa.attention(q, k, v, mask=mask), fullgraph=True)
    compiled = lambda: torch.autograd.grad(f(q, k, v), (q, k, v), do)  # noqa: E731
    eager(), compiled()  # warm up, compile
    ran_eager, ran_compiled = _kernels_run(eager), _kernels_run(compiled)
    assert ran_eager == ran_compiled
    assert ran_eager == sorted(set(bsfa.explain(q, k, v, mask=mask).kernels))


def _gluon_interval_against_float64(q, k, v, do, mask, ref_mask, opts, label):
    """Runs ``mask`` (a layout or an expression) with ``opts``: the backward must be the Gluon
    interval pair, and output and gradients within 2e-2 of float64 (``ref_mask``'s)."""
    from blocksparse_fa.ops import select

    with select.record() as ran:
        out = bsfa.attention(q, k, v, mask=mask, kernel_options=opts)
        got = torch.autograd.grad(out, (q, k, v), do)
    assert ("backward", "gluon:interval") in ran, ran
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = bsfa.reference_attention(*ins, ref_mask)
    want = torch.autograd.grad(ref, ins, do.double())
    for what, a, b in zip("o q k v".split(), (out, *got), (ref, *want)):
        err = ((a.double() - b).norm() / b.norm()).item()
        assert not a.isnan().any() and err < 2e-2, f"{label} d{what}: relative error {err:.2e}"


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", ["sliding_window", "documents"])
def test_gluon_interval_backward_on_host_layouts(name, d):
    """Compiled one-interval-per-row layouts (a sliding window; documents whose ids the host
    knows) run the Gluon backward's interval mode (by default at d 128, asked for at d 64): output and
    gradients against float64."""
    n, ids = 1024, torch.repeat_interleave(torch.arange(4), torch.tensor([100, 412, 1, 511]))
    mask = bsfa.sliding_window(256) if name == "sliding_window" else bsfa.causal() & bsfa.document(ids)
    lay = bsfa.compile_mask(mask, n, n, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (4, 2, 2, 4))
    for t in (q, k, v):
        t.requires_grad_()
    _gluon_interval_against_float64(q, k, v, do, lay, mask, None if d == 128 else dict(backward="gluon"),
                                    f"{name} d{d}")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("persistent", [None, False])
@pytest.mark.parametrize("name", ["layout", "device"])
def test_gluon_interval_backward_per_head(name, persistent):
    """Intervals that differ per head without GQA (per-head windows: a compiled layout, or with a
    document on device intervals) run the Gluon interval backward, one table per head (dK/dV
    programs of both kinds: persistent and one per tile); output and gradients against float64.
    With GQA the same mask keeps the Triton backward; windows shared within each GQA group run
    the Gluon pair again (the dK/dV program reads its group's table)."""
    from blocksparse_fa.ops import select
    from blocksparse_fa.ops.options import GluonBwdConfig

    n, H = 1024, 4
    win = bsfa.sliding_window(bsfa.per_head([64, 200, 512, 1024]))
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([300, 212, 512]))
    mask = bsfa.compile_mask(bsfa.causal() & win, n, n, device="cuda") if name == "layout" else \
        bsfa.causal() & bsfa.document(ids.cuda(), contiguous=True) & win
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(1, H, n, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    opts = dict(gluon_bwd=GluonBwdConfig(dkdv_persistent=persistent, persistent=persistent))
    _gluon_interval_against_float64(q, k, v, do, mask, mask if name == "device" else bsfa.causal() & win, opts, name)
    kg, vg = (t.detach()[:, :2].requires_grad_() for t in (k, v))
    with select.record() as ran:
        torch.autograd.grad(bsfa.attention(q, kg, vg, mask=mask), (q, kg, vg), do)
    assert ("backward", "gluon:interval") not in ran, ran
    if name == "layout":  # GQA 4/2 with windows shared by each group's heads: the Gluon pair
        pair = bsfa.causal() & bsfa.sliding_window(bsfa.per_head([64, 64, 512, 512]))
        _gluon_interval_against_float64(q, kg, vg, do, bsfa.compile_mask(pair, n, n, device="cuda"), pair, opts,
                                        "GQA per-group windows")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["dense", "causal"])
def test_default_backward_is_the_five_gemm_one(kind, d):
    """Dense and causal layouts' default backward on Hopper is the Gluon five-GEMM one (dQ
    TMA-reduce-added in fp32); its gradients match float64 as closely as the deterministic pair's,
    which ``deterministic=True`` still runs (and repeats bit for bit)."""
    from blocksparse_fa.ops import select

    q, k, v = _qkv(H=4, Hkv=2, D=d)
    do = torch.randn_like(q)
    mask = None if kind == "dense" else bsfa.causal()

    def grads(opts):
        with select.record() as ran:
            out = bsfa.attention(q, k, v, mask=mask, kernel_options=opts)
            g = torch.autograd.grad(out, (q, k, v), do)
        return [c for _, c in ran], (out, *g)

    ran, got = grads(None)
    assert ran == [f"gluon:{kind}", f"gluon:{kind}+atomic_dq"], ran
    ran_det, det = grads(dict(deterministic=True))
    assert ran_det == [f"gluon:{kind}", f"gluon:{kind}"], ran_det
    assert all(torch.equal(a, b) for a, b in zip(det, grads(dict(deterministic=True))[1]))
    up = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = bsfa.reference_attention(*up, mask)
    ref = (ref_out, *torch.autograd.grad(ref_out, up, do.double()))
    for name, a, b, r in zip(("o", "dq", "dk", "dv"), got, det, ref):
        err = ((a.double() - r).abs().max() / r.abs().max()).item()
        err_det = ((b.double() - r).abs().max() / r.abs().max()).item()
        assert err <= 1.5 * err_det + 1e-4, (name, err, err_det)


def _as_close_as(got, base, q, k, v, do, mask):
    """``got`` (output, dQ, dK, dV) against float64: no NaN, and each within 1.5× the error of
    ``base`` (another kernel's results on the same inputs)."""
    up = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = bsfa.reference_attention(*up, mask)
    ref = (ref_out, *torch.autograd.grad(ref_out, up, do.double()))
    for name, a, b, r in zip(("o", "dq", "dk", "dv"), got, base, ref):
        assert not a.isnan().any(), name
        err = ((a.double() - r).abs().max() / r.abs().max()).item()
        err_base = ((b.double() - r).abs().max() / r.abs().max()).item()
        assert err <= 1.5 * err_base + 1e-4, (name, err, err_base)


def _five_gemm_as_close_as_the_pair(q, k, v, do, mask, ref_mask, opts=None):
    """``(out, dq, dk, dv)`` of ``mask`` with ``deterministic=False`` (extra ``opts``), which must
    run the five-GEMM interval kernel, each within 1.5× the deterministic pair's error against
    float64 (``ref_mask``'s)."""
    from blocksparse_fa.ops import select

    def grads(det):
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        with select.record() as ran:
            out = bsfa.attention(*ts, mask=mask, kernel_options=dict(opts or {}, deterministic=det))
            g = torch.autograd.grad(out, ts, do)
        return [c for _, c in ran], (out, *g)

    ran, got = grads(False)
    assert ran == ["gluon:interval", "gluon:interval+atomic_dq"], ran
    ran_det, det = grads(True)
    assert ran_det == ["gluon:interval", "gluon:interval"], ran_det
    _as_close_as(got, det, q, k, v, do, ref_mask)
    return got


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("hkv", [4, 2])
def test_five_gemm_backward_on_intervals(hkv):
    """``deterministic=False`` on a one-interval-per-row layout (a padded batch: per batch row a
    causal prefix, padded rows empty) runs the Gluon five-GEMM kernel in its interval mode; its
    gradients match float64 as closely as the deterministic pair's and padded rows get zeros."""
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(2, h, N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h in (4, hkv, hkv, 4))
    mask = bsfa.load_pattern("padded_batch", length=bsfa.per_batch(torch.tensor([N - 300, N // 2 + 64])))
    layout = bsfa.compile_mask(mask, N, N, device="cuda")
    got = _five_gemm_as_close_as_the_pair(q, k, v, do, layout, mask, dict(global_split=False))
    assert (got[1][1, :, N // 2 + 64:] == 0).all()  # padded query rows: no gradient


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("hkv,d", [(4, 128), (1, 128), (4, 64)])
def test_five_gemm_backward_on_device_intervals(hkv, d):
    """``deterministic=False`` on packed documents whose intervals are built on the device (ids on
    the GPU, two batch rows with their own documents, one of them a one-token document) runs the
    five-GEMM kernel in its interval mode: output and gradients as close to float64 as the
    deterministic pair's."""
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, do = (torch.randn(2, h, N, d, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h in (4, hkv, hkv, 4))
    ids = torch.stack([torch.repeat_interleave(torch.arange(4), torch.tensor([300, 700, 548, 500])),
                       torch.repeat_interleave(torch.arange(3), torch.tensor([1000, 1, 1047]))]).cuda()
    mask = bsfa.causal() & bsfa.document(ids, contiguous=True)
    _five_gemm_as_close_as_the_pair(q, k, v, do, mask, mask)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("kind", ["dense", "causal", "window"])
def test_gluon_backward_float32_and_direct_stores(kind):
    """The Gluon backward writes float32 gradients (the partial sums of context parallelism) from
    the registers, at least as close to float64 as its bf16 ones; ``direct_store`` writes bf16
    gradients from the registers too, equal to the TMA-staged ones (dK and dV bit for bit)."""
    from blocksparse_fa.ops import select
    from blocksparse_fa.ops import triton_backend as tb
    from blocksparse_fa.ops.options import GluonBwdConfig, KernelOptions
    from blocksparse_fa.ops.validate import Shapes

    q, k, v = (t.detach() for t in _qkv(H=4, Hkv=2, D=128))
    do = torch.randn_like(q)
    L = q.shape[2]
    mask = {"dense": bsfa.full(), "causal": bsfa.causal(), "window": bsfa.sliding_window(300)}[kind]
    layout = bsfa.compile_mask(mask, L, L, 128, device=q.device)
    s = Shapes(1, 4, 2, L, L, 128)
    scale = 128 ** -0.5
    out, lse = tb.triton_forward(q, k, v, layout, s, scale, 0.0, 0)
    up = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = bsfa.reference_attention(*up, mask)
    ref = torch.autograd.grad(ref_out, up, do.double())

    def run(gd=None, **cfg):
        opts = KernelOptions(gluon_bwd=GluonBwdConfig(**cfg)) if cfg else KernelOptions()
        with select.record() as ran:
            g = tb.triton_backward(q, k, v, out, lse, do, layout, s, scale, 0.0, 0, grad_dtype=gd, opts=opts)
        assert all(c.startswith("gluon:") for _, c in ran), ran
        return g, ran[-1][1].split(":", 1)[1]

    (base, mode), (f32, _) = run(), run(torch.float32)
    # the default call's tiles (``select.GLUON_BWD_DEFAULTS`` by mode), stored from the registers
    fields = dataclasses.asdict(select.gluon_bwd_config(KernelOptions(), mode, 128))
    direct, _ = run(**{**fields, "direct_store": True})
    assert all(g.dtype == torch.float32 for g in f32) and all(g.dtype == q.dtype for g in direct)
    for name, a, b, r in zip(("dq", "dk", "dv"), base, f32, ref):
        err = ((a.double() - r).abs().max() / r.abs().max()).item()
        err32 = ((b.double() - r).abs().max() / r.abs().max()).item()
        assert err32 <= err + 1e-4, (name, err32, err)
    assert torch.equal(base[1], direct[1]) and torch.equal(base[2], direct[2])
    assert ((base[0].float() - direct[0].float()).abs().max() / base[0].float().abs().max()).item() < 1e-2


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("kind", ["dense", "causal", "window", "documents"])
@pytest.mark.parametrize("det", [True, False])
@pytest.mark.parametrize("d", [64, 128])
def test_gluon_backward_rows_smem_same_gradients(kind, det, d):
    """The dK/dV kernel reading each step's logsumexp and Δ from shared memory (staged by the
    producer with Q and dO; ``GluonBwdConfig.rows_smem``, the default) gives the gradients of the
    global-memory loads: dK and dV bit for bit, dQ bit for bit from the deterministic pair and
    within rounding from the five-GEMM kernel (its fp32 adds land in any order); GQA, two batch
    rows, heads side by side in memory."""
    from blocksparse_fa.ops import select
    from blocksparse_fa.ops import triton_backend as tb
    from blocksparse_fa.ops.options import GluonBwdConfig, KernelOptions
    from blocksparse_fa.ops.validate import Shapes

    B, H, Hkv, L = 2, 4, 2, 1024
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, do = (_rand_heads(B, h, L, d, "blhd", g) for h in (H, Hkv, Hkv, H))
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([128, 384, 1, 511]))
    mask = {"dense": bsfa.full(), "causal": bsfa.causal(), "window": bsfa.sliding_window(300),
            "documents": bsfa.causal() & bsfa.document(ids)}[kind]
    layout = bsfa.compile_mask(mask, L, L, 128, device="cuda")
    s = Shapes(B, H, Hkv, L, L, d)
    out, lse = tb.triton_forward(q, k, v, layout, s, d ** -0.5, 0.0, 0)

    def grads(rows_smem):
        opts = KernelOptions(backward="gluon", deterministic=det, gluon_bwd=GluonBwdConfig(rows_smem=rows_smem))
        with select.record() as ran:
            got = tb.triton_backward(q, k, v, out, lse, do, layout, s, d ** -0.5, 0.0, 0, opts=opts)
        assert all(c.startswith("gluon:") for _, c in ran), ran
        return got

    (dq1, dk1, dv1), (dq0, dk0, dv0) = grads(True), grads(False)
    assert not any(t.isnan().any() for t in (dq1, dk1, dv1))
    assert torch.equal(dk1, dk0) and torch.equal(dv1, dv0)
    if det:
        assert torch.equal(dq1, dq0)
    else:
        torch.testing.assert_close(dq1, dq0, atol=2e-2, rtol=2e-2)


def _rand_heads(B, h, L, D, memory, g):
    """Random bf16 ``(B, h, L, D)``: heads stacked along rows (``"bhld"`` memory) or a
    ``(B, L, h, D)`` tensor viewed transposed (``"blhd"``)."""
    if memory == "bhld":
        return torch.randn(B, h, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return torch.randn(B, L, h, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("kind", ["dense", "causal", "window", "documents"])
@pytest.mark.parametrize("memory", ["bhld", "blhd"])
@pytest.mark.parametrize("deal,q_buffers", [(None, 1), (False, 1), (None, 2)])
def test_persistent_gluon_forward_equals_per_tile(kind, memory, deal, q_buffers, monkeypatch):
    """The persistent Gluon forward (one program per SM walking every head's query tiles) writes
    the same output and logsumexp as one program per tile, bit for bit, for heads stacked along
    the rows and side by side (``(B, L, H, D)`` inputs viewed transposed), with GQA and two
    batch rows; every element is written (outputs start poisoned). ``deal``: the interval items'
    order by the default rule (None) or head by head (False); ``q_buffers``: sets of Q tiles."""
    from blocksparse_fa.ops import triton_backend as tb

    monkeypatch.setattr(tb, "_M_MAJOR", deal)
    from blocksparse_fa.ops.options import GluonConfig
    from blocksparse_fa.ops.validate import Shapes

    B, H, Hkv, L, D = 2, 4, 2, 1024, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (_rand_heads(B, h, L, D, memory, g) for h in (H, Hkv, Hkv))
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([128, 384, 256, 256]))
    mask = {"dense": bsfa.full(), "causal": bsfa.causal(), "window": bsfa.sliding_window(300),
            "documents": bsfa.causal() & bsfa.document(ids)}[kind]
    layout = bsfa.compile_mask(mask, L, L, 128, device="cuda")
    s = Shapes(B, H, Hkv, L, L, D)
    case = {"dense": "dense", "causal": "causal"}.get(kind, "interval")
    outs = []
    for persistent in (True, False):
        out = torch.full((B, H, L, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((B, H, L), float("nan"), device="cuda")
        cfg = GluonConfig(persistent=persistent, q_buffers=q_buffers if persistent else 1)
        tb._gluon_launch(q, k, v, out, lse, s, D ** -0.5, case, cfg, layout)
        outs.append((out, lse))
    (o1, l1), (o2, l2) = outs
    assert not o1.isnan().any() and not l1.isnan().any()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    ref = bsfa.reference_attention(q.double(), k.double(), v.double(), mask)
    err = ((o1.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("kind", ["dense", "causal", "window", "documents"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [1024, 1152])
def test_gluon_forward_three_groups(kind, d, n):
    """The Gluon forward with three consumer groups (192-row programs; ``n`` 1024 leaves the last
    program 128 rows past the end, 1152 fills whole programs and runs persistent when dense or on
    intervals), GQA, two batch rows: every output element and logsumexp written over NaN-poisoned
    buffers, within 1e-5 of two groups' logsumexp and of their output by bf16 rounding; through
    ``bsfa.attention`` (the route noted) output and gradients against float64."""
    from blocksparse_fa.ops import select
    from blocksparse_fa.ops import triton_backend as tb
    from blocksparse_fa.ops.options import GluonConfig
    from blocksparse_fa.ops.validate import Shapes

    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 412, 1, n - 513]))
    mask = {"dense": bsfa.full(), "causal": bsfa.causal(), "window": bsfa.sliding_window(300),
            "documents": bsfa.causal() & bsfa.document(ids)}[kind]
    case = {"window": "interval", "documents": "interval"}.get(kind, kind)
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, do = (torch.randn(2, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (4, 2, 2, 4))
    layout = bsfa.compile_mask(mask, n, n, 128, device="cuda")
    runs = []
    for groups in (2, 3):
        out = torch.full((2, 4, n, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((2, 4, n), float("nan"), device="cuda")
        tb._gluon_launch(q, k, v, out, lse, Shapes(2, 4, 2, n, n, d), d ** -0.5, case, GluonConfig(groups=groups),
                         layout)
        assert not out.isnan().any() and not lse.isnan().any()
        runs.append((out, lse))
    (o2, l2), (o3, l3) = runs
    assert (l3 - l2).abs().max().item() < 1e-5
    assert (o3.float() - o2.float()).abs().max().item() <= 2 ** -6
    for t in (q, k, v):
        t.requires_grad_()
    with select.record() as ran:
        out = bsfa.attention(q, k, v, mask=layout, kernel_options={"gluon_fwd": {"groups": 3}})
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert ("forward", f"gluon:{case}") in ran, ran
    _output_and_grads_near_float64(mask, q, k, v, do, out, grads)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("kind", ["dense", "window", "documents"])
@pytest.mark.parametrize("memory", ["bhld", "blhd"])
@pytest.mark.parametrize("which", ["dq", "dkdv"])
@pytest.mark.parametrize("deal", [None, False])
def test_persistent_gluon_backward_equals_per_tile(kind, memory, which, deal, monkeypatch):
    """The persistent Gluon dQ (``which="dq"``) or dK/dV kernel writes the same gradients as one
    program per tile, bit for bit (bf16 through TMA and float32 from the registers), with GQA and
    two batch rows. The five-GEMM kernel (dense: ``deterministic=False``) persistent too: dK and dV
    bit for bit, dQ (fp32 adds in another order) within bf16 rounding. ``deal``: interval items by
    the default rule (None) or head by head (False)."""
    from blocksparse_fa.ops import triton_backend as tb
    from blocksparse_fa.ops.options import GluonBwdConfig, KernelOptions
    from blocksparse_fa.ops.validate import Shapes

    monkeypatch.setattr(tb, "_M_MAJOR", deal)

    B, H, Hkv, L, D = 2, 4, 2, 1024, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = (_rand_heads(B, h, L, D, memory, g) for h in (H, Hkv, Hkv, H))
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([128, 384, 256, 256]))
    mask = {"dense": bsfa.full(), "window": bsfa.sliding_window(300),
            "documents": bsfa.causal() & bsfa.document(ids)}[kind]
    layout = bsfa.compile_mask(mask, L, L, 128, device="cuda")
    s = Shapes(B, H, Hkv, L, L, D)
    out, lse = tb.triton_forward(q, k, v, layout, s, D ** -0.5, 0.0, 0)

    def grads(persistent, gd=None, det=True):
        cfg = GluonBwdConfig(persistent=persistent and which == "dq",
                             dkdv_persistent=persistent and which == "dkdv")
        return tb.triton_backward(q, k, v, out, lse, do, layout, s, D ** -0.5, 0.0, 0, grad_dtype=gd,
                                  opts=KernelOptions(backward="gluon", deterministic=det, gluon_bwd=cfg))

    for gd in (None, torch.float32):
        for a, b in zip(grads(True, gd), grads(False, gd)):
            assert not a.isnan().any() and torch.equal(a, b)
    if kind == "dense" and which == "dkdv":
        (dq1, dk1, dv1), (dq0, dk0, dv0) = grads(True, det=False), grads(False, det=False)
        assert torch.equal(dk1, dk0) and torch.equal(dv1, dv0)
        assert not dq1.isnan().any()
        torch.testing.assert_close(dq1, dq0, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("text,opts", [("causal & (sliding_window(256) | global_tokens(4))", None),
                                       ("window(128) | global_tokens(32)", {"global_split": True}),
                                       ("causal & (sliding_window(256) | global_tokens(64))", {"global_split": True})])
def test_global_split_on_gpu(text, opts):
    """Global tokens split into a band (Gluon), the global rows and keys: outputs and gradients
    within twice the whole mask's bfloat16 error against float64 (sinks split by default)."""
    mask = bsfa.parse(text)
    q, k, v = _qkv(D=128)
    do = torch.randn_like(q)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = bsfa.attention(*ref, mask=mask, backend="torch")
    want = [out.detach()] + list(torch.autograd.grad(out, ref, do.double()))
    res = {}
    for label, kw in (("whole", {"global_split": False}), ("split", opts)):
        with bsfa.ops.select.record() as ran:
            out = bsfa.attention(q, k, v, mask=mask, kernel_options=kw)
            res[label] = [out.detach()] + list(torch.autograd.grad(out, (q, k, v), do))
        res[label + "_ran"] = ran
    assert ("forward", "global_split") in res["split_ran"] and ("backward", "global_split") in res["split_ran"]
    assert ("forward", "global_split") not in res["whole_ran"]
    for a, b, r in zip(res["split"], res["whole"], want):
        err_split = (a.double() - r).norm() / r.norm()
        err_whole = (b.double() - r).norm() / r.norm()
        assert err_split < 2 * max(err_whole, 1e-3), (err_split, err_whole)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the folded global keys run in the Gluon forward (Hopper)")
@pytest.mark.parametrize("text", ["window(128) | global_tokens(32)",
                                  "causal & (sliding_window(256) | global_tokens(64))"])
def test_forward_split_backward_whole(text):
    """Longformer (global rows over every key) and many attention sinks by default: the forward
    splits (the global keys folded into the band's Gluon forward;
    Longformer's first rows as a split-K pair merged into the corner), the backward runs the whole
    mask from that output and logsumexp; within twice the whole mask's bfloat16 error against
    float64, logsumexp too."""
    res, want = _against_float64(bsfa.parse(text), (("whole", {"global_split": False}, False),
                                                    ("default", None, False)))
    assert ("forward", "global_split") in res["default_ran"]
    assert ("backward", "global_split") not in res["default_ran"]
    _within_twice_whole(res["default"], res["whole"], want)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the parts run the Gluon kernels (Hopper)")
@pytest.mark.parametrize("box", [False, True])
@pytest.mark.parametrize("name", ["key_range_causal", "block_diffusion", "shared_prefix", "rectangle_window"])
def test_run_split_on_gpu(name, box, monkeypatch):
    """Two key runs per row as two one-run parts on the Gluon kernels (``compiler/runs.py``), the
    second part's gradients added in place and its output merged on its rows only (``box``: the
    second part on its box, ``ops/runs.BOX_SECOND``); GQA; outputs, logsumexp and gradients within
    twice the whole mask's bfloat16 error against float64, and with a non-contiguous (B, L, H, D)
    layout of q, k, v."""
    monkeypatch.setattr("blocksparse_fa.ops.runs.BOX_SECOND", box)
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([300, 700, 548, 500]))
    mask = {"key_range_causal": bsfa.key_range(256, 640) | bsfa.causal(),
            "block_diffusion": bsfa.load_pattern("block_diffusion", n=N // 2, block=64),
            "shared_prefix": bsfa.load_pattern("shared_prefix", prefix=256, document=ids),
            "rectangle_window": bsfa.query_range(700, 1100) & bsfa.key_range(128, 384) | bsfa.sliding_window(256)}[name]
    res, want = _against_float64(mask, (("whole", {"run_split": False}, False), ("split", {"run_split": True}, False),
                                        ("split_blhd", {"run_split": True}, True)))
    for label in ("split", "split_blhd"):
        assert ("forward", "run_split") in res[label + "_ran"] and ("backward", "run_split") in res[label + "_ran"]
        assert ("forward", "gluon:interval") in res[label + "_ran"], res[label + "_ran"]
        if box:  # the second part ran the device-interval kernels on its box
            assert {("backward", "gluon:interval"), ("backward", "gluon:interval+atomic_dq")} & set(res[label + "_ran"]), \
                res[label + "_ran"]  # the pair, or the five-GEMM kernel on a box of few key tiles
        _within_twice_whole(res[label], res["whole"], want)
    assert ("forward", "run_split") not in res["whole_ran"]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the parts run the Gluon kernels (Hopper)")
@pytest.mark.parametrize("box", [False, True])
def test_run_split_warm_step_never_syncs(box, monkeypatch):
    """A warm forward+backward of a split mask (both parts, the merge, the additions; ``box``: the
    second part on its box) makes no device-to-host synchronisation."""
    monkeypatch.setattr("blocksparse_fa.ops.runs.BOX_SECOND", box)
    mask = bsfa.key_range(256, 640) | bsfa.causal()
    q, k, v = _qkv(D=128)
    do = torch.randn_like(q)

    def step():
        out = bsfa.attention(q, k, v, mask=mask, kernel_options={"run_split": True})
        return torch.autograd.grad(out, (q, k, v), do)

    with bsfa.ops.select.record() as ran:
        step()  # the first call builds the parts' tables
    assert ("forward", "run_split") in ran and ("backward", "run_split") in ran, ran
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("name", ["longformer", "bigbird", "sliding_tiles"])
def test_list_mode_against_float64_and_its_deal(name, d, monkeypatch):
    """The Gluon kernels' list mode (``block_lists=True``) on block layouts, 16 heads over 2K tokens
    (more dK/dV items than SMs): output and gradients as close to float64 as the Triton block
    kernels'; the persistent kernels with their items dealt by work (``deal``, forced here) give
    the same output and gradients bit for bit as every grid-th item."""
    from blocksparse_fa.ops import select
    from blocksparse_fa.ops import triton_backend as tb
    from blocksparse_fa.ops.options import GluonBwdConfig, GluonConfig

    masks = {"longformer": bsfa.load_pattern("longformer", window=200, n_global=64),
             "bigbird": bsfa.load_pattern("bigbird", window=150, n_global=128, n_random=2),
             "sliding_tiles": bsfa.sliding_tiles((1, 32, 64), (1, 8, 16), (1, 3, 3))}
    mask = masks[name]
    layout = bsfa.compile_mask(mask, N, N, device="cuda")
    q, k, v = _qkv(H=16, Hkv=16, D=d, seed=5)
    do = torch.randn_like(q)
    monkeypatch.setattr(tb, "DEAL_MIN_GAIN", -1.0)  # deal whenever the work is known
    dealt = []
    deal = tb._deal_table
    monkeypatch.setattr(tb, "_deal_table", lambda *a: dealt.append(deal(*a)) or dealt[-1])

    def run(opts):
        with select.record() as ran:
            out = bsfa.attention(q, k, v, mask=layout, kernel_options=opts)
            g = torch.autograd.grad(out, (q, k, v), do)
        return [c for _, c in ran], (out, *g)

    ran, got = run(dict(block_lists=True, global_split=False))  # the whole mask in both phases
    assert ran == ["gluon:list", "gluon:list"], ran
    assert dealt and dealt[-1] is not None
    ran_off, off = run(dict(block_lists=True, global_split=False, gluon_fwd=GluonConfig(deal=False),
                            gluon_bwd=GluonBwdConfig(deal=False)))
    assert all(torch.equal(a, b) for a, b in zip(got, off))
    _, tri = run(dict(block_lists=False, global_split=False))
    _as_close_as(got, tri, q, k, v, do, mask)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("hkv, d", [(4, 128), (1, 128), (4, 64)])
def test_gqa_list_backward_per_query_head(hkv, d, monkeypatch):
    """GQA (16 query heads over ``hkv``) where one query head's key column passes the list
    backward's rule but a group's does not: one dK/dV item per query head reads its group's K and
    V (``KV_REP``) and the group's dK/dV are summed after. As close to float64 as the Triton block
    kernels, and bit for bit the pair run on copies of K and V per query head."""
    from blocksparse_fa.ops import select
    from blocksparse_fa.ops import triton_backend as tb
    from blocksparse_fa.ops.validate import Shapes

    mask = bsfa.load_pattern("bigbird", window=150, n_global=128, n_random=2)
    layout = bsfa.compile_mask(mask, N, N, device="cuda")
    longest, mean = select.layout_class(layout).list_columns
    per_sm = mean * (N // 128) / select.hardware(torch.device("cuda")).sm_count  # one head's
    monkeypatch.setattr(select, "LIST_LONG_COLUMN", 0.0)
    monkeypatch.setattr(select, "LIST_COLUMN_SHARE", longest / (0.5 * (hkv + 16) * per_sm))
    q, k, v = _qkv(H=16, Hkv=hkv, D=d, seed=7)
    do = torch.randn_like(q)

    def run(opts):
        with select.record() as ran:
            out = bsfa.attention(q, k, v, mask=layout, kernel_options=opts)
            g = torch.autograd.grad(out, (q, k, v), do)
        return [c for _, c in ran], (out, *g)

    ran, got = run(dict(replay=False))
    assert ran[1] == "gluon:list+per_head_dkdv", ran
    launch = tb._gluon_bwd_launch

    def on_copies(q, k, v, dout, grads, lse, delta, s, *args, per_head_dkdv=False, **kw):
        assert per_head_dkdv
        k, v = (t.repeat_interleave(s.G, 1) for t in (k, v))
        launch(q, k, v, dout, grads, lse, delta, Shapes(s.B, s.H, s.H, s.Lq, s.Lk, s.D), *args, **kw)

    monkeypatch.setattr(tb, "_gluon_bwd_launch", on_copies)
    _, copied = run(dict(replay=False))
    monkeypatch.setattr(tb, "_gluon_bwd_launch", launch)
    assert all(torch.equal(a, b) for a, b in zip(got, copied))
    _, tri = run(dict(backward="triton"))
    _as_close_as(got, tri, q, k, v, do, mask)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("kind", ["causal_docs", "docs", "window_docs"])
@pytest.mark.parametrize("d,groups", [(64, 2), (64, 3), (128, 2)])
@pytest.mark.parametrize("memory", ["bhld", "blhd"])
@pytest.mark.parametrize("n", [1024, 1152])
def test_gluon_forward_segments(kind, d, groups, memory, n, monkeypatch):
    """The device-interval Gluon forward on segment tiles (tiles that start at documents; two
    batch rows with their own documents, one-token documents, GQA): every output element and
    logsumexp written over NaN-poisoned buffers, within 1e-4 of the aligned tiles' logsumexp and
    one bf16 step of their output; through ``bsfa.attention`` output and gradients against
    float64."""
    from blocksparse_fa.compiler.device_intervals import interval_spec
    from blocksparse_fa.ops import interval_backend, select
    from blocksparse_fa.ops.options import GluonConfig
    from blocksparse_fa.ops.validate import Shapes

    ids = torch.stack([torch.repeat_interleave(torch.arange(n_doc), torch.tensor(lens)) for n_doc, lens in
                       ((4, [100, 412, 1, n - 513]), (6, [1, 1, 257, 130, 300, n - 689]))])
    mask = {"causal_docs": bsfa.causal() & bsfa.document(ids), "docs": bsfa.document(ids),
            "window_docs": bsfa.sliding_window(200) & bsfa.document(ids)}[kind]
    g = torch.Generator(device="cuda").manual_seed(5)

    def make(h):
        t = torch.randn(2, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        return t.transpose(1, 2) if memory == "blhd" else t.transpose(1, 2).contiguous()

    q, k, v, do = make(4), make(2), make(2), make(4)
    iv = interval_spec(mask, n, n).bounds("cuda")
    assert iv.qid is None
    s = Shapes(2, 4, 2, n, n, d)
    monkeypatch.setattr(interval_backend, "_new_like", lambda like, shape=None, dtype=None: (
        torch.empty_like(like, dtype=dtype) if shape is None else
        torch.empty(shape, dtype=dtype or like.dtype, device=like.device)).fill_(float("nan")))
    o_seg, l_seg = interval_backend.gluon_interval_forward(q, k, v, iv, s, d ** -0.5,
                                                           GluonConfig(segments=True, groups=groups))
    o_al, l_al = interval_backend.gluon_interval_forward(q, k, v, iv, s, d ** -0.5, GluonConfig(segments=False))
    assert not o_seg.isnan().any() and not l_seg.isnan().any()
    assert torch.equal(torch.isinf(l_seg), torch.isinf(l_al))
    fin = torch.isfinite(l_al)
    assert (l_seg[fin] - l_al[fin]).abs().max().item() < 1e-4
    assert (o_seg.float() - o_al.float()).abs().max().item() <= 2 ** -6
    monkeypatch.undo()
    for t in (q, k, v):
        t.requires_grad_()
    with select.record() as ran:
        out = bsfa.attention(q, k, v, mask=mask, kernel_options={"gluon_fwd": {"groups": groups}})
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert ran and ran[0][0] == "forward" and "gluon" in ran[0][1], ran
    _output_and_grads_near_float64(mask, q, k, v, do, out, grads)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("kind", ["window", "documents", "prefix_lm"])
@pytest.mark.parametrize("groups,q_buffers", [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_gluon_forward_segments_on_host_layouts(kind, groups, q_buffers):
    """Host-interval layouts on segment tiles (``GluonConfig(segments=True)``), d 64, GQA, two batch
    rows, 1152 rows: every output element and logsumexp written over NaN-poisoned buffers, within
    1e-4 of the aligned two-group tiles' logsumexp and one bf16 step of their output."""
    from blocksparse_fa.ops import triton_backend as tb
    from blocksparse_fa.ops.options import GluonConfig
    from blocksparse_fa.ops.validate import Shapes

    n, d = 1152, 64
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 412, 1, n - 513]))
    mask = {"window": bsfa.sliding_window(300), "documents": bsfa.causal() & bsfa.document(ids),
            "prefix_lm": bsfa.prefix_lm(200)}[kind]
    g = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = (torch.randn(2, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (4, 2, 2))
    layout = bsfa.compile_mask(mask, n, n, 128, device="cuda")
    runs = []
    for cfg in (GluonConfig(segments=True, groups=groups, q_buffers=q_buffers), GluonConfig()):
        out = torch.full((2, 4, n, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((2, 4, n), float("nan"), device="cuda")
        tb._gluon_launch(q, k, v, out, lse, Shapes(2, 4, 2, n, n, d), d ** -0.5, "interval", cfg, layout)
        assert not out.isnan().any() and not lse.isnan().any()
        runs.append((out, lse))
    (o1, l1), (o2, l2) = runs
    assert torch.equal(torch.isinf(l1), torch.isinf(l2))
    fin = torch.isfinite(l2)
    assert (l1[fin] - l2[fin]).abs().max().item() < 1e-4
    assert (o1.float() - o2.float()).abs().max().item() <= 2 ** -6
