"""Packed documents on the device path: intervals built on the device (exact against the dense
mask, tables that cover it), the interval kernels in the interpreter and the PyTorch backend
against float64 (outputs, dQ, dK, dV, every element written), ``torch.compile(fullgraph=True)``
with a new packing every step and no recompile, ``varlen_attention``, the document helpers, the nn
modules' per-call masks, the transformers hook on packed ``position_ids``, and bad inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

import blocksparse_fa as bsfa
from blocksparse_fa.compiler.device_intervals import col_tables, gluon_interval_tables, interval_spec, row_tables
from blocksparse_fa.compiler import device_intervals
from blocksparse_fa.ops import interval_backend, prepare


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one thread (a busy machine makes two threads spin for milliseconds per product)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _ids(lengths) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _packing(total: int, g: torch.Generator, longest: int = 40) -> list:
    """Random document lengths summing to ``total`` (lengths of 1 included)."""
    out = []
    while sum(out) < total:
        out.append(min(int(torch.randint(1, longest, (1,), generator=g)), total - sum(out)))
    return out


RECURRING = torch.tensor([0] * 20 + [1] * 15 + [0] * 25 + [2] * 30)  # id 0 in two separate runs
MASKS = {
    "causal_doc": lambda: (bsfa.causal() & bsfa.document(_ids([30, 1, 25, 34])), 90, 90, "bottom_right"),
    "window_doc_lq": lambda: (bsfa.sliding_window(9) & bsfa.causal() & bsfa.document(_ids([50, 40])), 60, 90,
                              "bottom_right"),
    "top_left_empty_rows": lambda: (bsfa.causal() & bsfa.document(_ids([45, 45])), 110, 90, "top_left"),
    "recurring_ids": lambda: (bsfa.causal() & bsfa.document(RECURRING), 90, 90, "top_left"),
    "batch_ids": lambda: (bsfa.document(torch.stack([_ids([10, 80]), RECURRING])) & bsfa.prefix_lm(7)
                          & bsfa.query_range(3, 85), 90, 90, "top_left"),
    "per_head": lambda: (bsfa.document(_ids([60, 30])) & bsfa.window(bsfa.per_head([2, 40])), 90, 90, "top_left"),
    "shift_chunk": lambda: (bsfa.shift(bsfa.causal() & bsfa.document(_ids([33, 57])), 4) & bsfa.chunked(16)
                            & bsfa.key_range(2, 88), 80, 90, "bottom_right"),
    # long documents against the kernels' tiles: full tiles between masked ones on both sides
    "long_causal": lambda: (bsfa.causal() & bsfa.document(_ids([200, 56])), 256, 256, "bottom_right"),
    "long_window": lambda: (bsfa.sliding_window(150) & bsfa.document(_ids([180, 76])), 256, 256, "bottom_right"),
    "long_recurring": lambda: (bsfa.causal() & bsfa.document(torch.tensor([0] * 100 + [1] * 40 + [0] * 52)), 192,
                               192, "bottom_right"),
    "long_bf16": lambda: (bsfa.causal() & bsfa.document(_ids([300, 84])), 384, 384, "bottom_right"),
    "runs_helper": lambda: (bsfa.causal() & bsfa.document_from_cu_seqlens(torch.tensor([0, 1, 41, 90]), 90), 90,
                            90, "bottom_right"),
}


def _dense(mask, lq, lk, align):
    d = mask.to_dense(lq, lk, align=align)
    return d.reshape(-1, lq, lk) if d.dim() == 4 else d[None]


@pytest.mark.parametrize("case", list(MASKS))
def test_device_intervals_are_exact_and_tables_cover(case):
    mask, lq, lk, align = MASKS[case]()
    spec = interval_spec(mask, lq, lk, align)
    iv = spec.bounds("cpu")
    # ids on the CPU are checked for runs when the mask is built: only recurring ids need the compare
    runs = "recurring" not in case and case != "batch_ids"
    assert spec.contiguous == runs and (iv.qid is None) == spec.contiguous
    dense = _dense(mask, lq, lk, align)
    z = iv.lo.shape[0] * iv.lo.shape[1]
    dense = dense.expand(z, lq, lk)
    j = torch.arange(lk)
    lo, hi = iv.lo.reshape(z, lq, 1).long(), iv.hi.reshape(z, lq, 1).long()
    keep = (j >= lo) & (j < hi)
    if iv.qid is not None:
        kid = iv.kid.expand(iv.lo.shape[0], lk)[:, None].expand(*iv.lo.shape[:2], lk).reshape(z, 1, lk)
        keep &= kid == iv.qid.reshape(z, lq, 1)
        inner = (j >= iv.ilo.reshape(z, lq, 1).long()) & (j < iv.ihi.reshape(z, lq, 1).long())
        assert not (inner & ~dense).any()  # the inner interval is kept whole
    assert torch.equal(keep, dense)
    nonempty = dense.any(-1)
    for bm, bn in ((16, 32), (32, 16)):
        rt = row_tables(iv, bm, bn).reshape(z, -1, 4).long()
        ct = col_tables(iv, lk, bm, bn).reshape(z, -1, 4).long()
        for zi in range(z):
            for t, (first, f0, f1, end) in enumerate(rt[zi].tolist()):
                assert first <= f0 <= f1 <= end
                rows = dense[zi, t * bm:(t + 1) * bm]
                assert not rows[:, :first * bn].any() and not rows[:, end * bn:].any()
                assert rows[nonempty[zi, t * bm:(t + 1) * bm]][:, f0 * bn:f1 * bn].all()
            for c, (first, f0, f1, end) in enumerate(ct[zi].tolist()):
                assert first <= f0 <= f1 <= end
                cols = dense[zi, :, c * bn:(c + 1) * bn]
                assert not cols[:first * bm].any() and not cols[end * bm:].any()
                full = nonempty[zi].clone()
                full[:f0 * bm] = False
                full[f1 * bm:] = False
                assert cols[full].all() and (f0 == f1 or (c + 1) * bn <= lk)


def test_gluon_tables_built_on_the_device_equal_the_host_ones():
    from blocksparse_fa.ops.triton_backend import GluonConfig, _gluon_interval_tables

    for mask, lq, align in [(bsfa.causal() & bsfa.document(_ids([130, 1, 500, 393, 1])), 1025, "bottom_right"),
                            (bsfa.document(_ids([300, 725])) & bsfa.query_range(100, 700), 900, "bottom_right"),
                            (bsfa.causal() & bsfa.sliding_window(300), 1025, "top_left")]:
        layout = bsfa.compile_mask(mask, lq, 1025, 128, align=align)
        spec = interval_spec(mask, lq, 1025, align, require_tensor=False)
        if spec.doc >= 0:  # these ids are runs: the Gluon forward needs no id compare
            spec.terms[spec.doc][0]._contiguous = True
        iv = spec.bounds("cpu")
        for cfg in (GluonConfig(), GluonConfig(block_m=32, block_n=64), GluonConfig(groups=3)):
            want = _gluon_interval_tables(layout, cfg, "cpu")
            # the device tables take programs of 2·block_m rows: three groups' 192 rows as 2 · 96
            rows = cfg.groups * cfg.block_m
            got = gluon_interval_tables(iv.lo.reshape(-1, lq), iv.hi.reshape(-1, lq), rows // 2, cfg.block_n)
            assert all(torch.equal(a, b) for a, b in zip(want, got))
            assert want[2].shape[1] == -(-lq // rows) and want[0].shape[1] == want[2].shape[1] * rows


def _gluon_schedule_backward(q, k, v, out, lse, dout, iv, scale, bm, bn, dq_bm, dq_bn):
    """The Gluon backward's interval mode (``kernels/backward_gluon.py``) step by step in float64:
    dK/dV programs of ``2·bn`` keys walk the query blocks of their table row, dQ programs of
    ``2·dq_bm`` rows the key blocks of theirs; blocks outside ``[f0, f1)`` compare each key with the
    rows' bounds, the others do not; rows that keep nothing read a logsumexp of +inf."""
    B, H, lq, D = q.shape
    G, lk = H // k.shape[1], k.shape[2]
    kv_tab = device_intervals._visit_one(col_tables(iv, lk, bm, 2 * bn))[0, 0].tolist()
    q_tab = device_intervals._visit_one(row_tables(iv, 2 * dq_bm, dq_bn))[0, 0].tolist()
    lo, hi = iv.lo[0, 0].long(), iv.hi[0, 0].long()
    lse = torch.where(torch.isinf(lse), float("inf"), lse.double())
    delta = (dout.double() * out.double()).sum(-1)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))

    def probs(h, rows, keys, masked):
        hk = h // G
        p = torch.exp(q[0, h, rows].double() @ k[0, hk, keys].double().T * scale - lse[0, h, rows, None])
        if masked:
            p = torch.where((keys >= lo[rows, None]) & (keys < hi[rows, None]), p, 0.0)
        ds = p * (dout[0, h, rows].double() @ v[0, hk, keys].double().T - delta[0, h, rows, None])
        return p, ds

    for c, (first, f0, f1, end) in enumerate(kv_tab):
        keys = torch.arange(c * 2 * bn, (c + 1) * 2 * bn)
        for h in range(H):
            for i in range(first, end):
                rows = torch.arange(i * bm, (i + 1) * bm)
                p, ds = probs(h, rows, keys, not f0 <= i < f1)
                dv[0, h // G, keys] += p.T @ dout[0, h, rows].double()
                dk[0, h // G, keys] += ds.T @ q[0, h, rows].double() * scale
    for t, (first, f0, f1, end) in enumerate(q_tab):
        rows = torch.arange(t * 2 * dq_bm, (t + 1) * 2 * dq_bm)
        for h in range(H):
            for j in range(first, end):
                keys = torch.arange(j * dq_bn, (j + 1) * dq_bn)
                dq[0, h, rows] += probs(h, rows, keys, not f0 <= j < f1)[1] @ k[0, h // G, keys].double() * scale
    return dq, dk, dv


@pytest.mark.parametrize("mask", [bsfa.causal() & bsfa.document(_ids([200, 1, 55])),
                                  bsfa.sliding_window(70) & bsfa.document(_ids([180, 76])),
                                  bsfa.causal() & bsfa.document(_ids([90, 166])) & bsfa.query_range(40, 200)],
                         ids=["causal_doc", "window_doc", "empty_rows"])
def test_gluon_interval_schedule_matches_float64(mask):
    """The tables and steps of the Gluon interval backward (which needs a Hopper GPU; the GPU check
    is ``benchmarks/experiments/gluon_bwd_interval.py``), replayed in float64 on the CPU: the same
    gradients as the exact backward, GQA included, empty rows and key tiles no row sees included."""
    from blocksparse_fa.ops.validate import Shapes

    n = 256
    iv = interval_spec(mask, n, n).bounds("cpu")
    assert iv.qid is None and iv.lo.shape == (1, 1, n)
    q, k, v = (t.detach().double() for t in _qkv(1, 4, 2, n, n, 16, torch.float64, seed=3))
    dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    s = Shapes(1, 4, 2, n, n, 16)
    out, lse = interval_backend.torch_interval_forward(q, k, v, iv, s, 0.25)
    want = interval_backend.torch_interval_backward(q, k, v, out, lse, dout, iv, s, 0.25)
    for tiles in ((16, 16, 16, 32), (32, 32, 32, 64)):
        got = _gluon_schedule_backward(q, k, v, out, lse, dout, iv, 0.25, *tiles)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-10, rtol=1e-9)


def _qkv(B, H, Hkv, lq, lk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g).to(dtype).requires_grad_() for h, n in ((H, lq), (Hkv, lk), (Hkv, lk))]


def _fwd_bwd(fn, q, k, v, seed=1):
    out = fn(q, k, v)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), do)), do


def _reference(mask, q, k, v, do, align):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = bsfa.reference_attention(q64, k64, v64, mask=mask, align=align)
    return (ref, *torch.autograd.grad(ref, (q64, k64, v64), do.double()))


@pytest.fixture
def poisoned(monkeypatch):
    """Kernel outputs start as NaN: a result without NaN proves every element was written."""
    def nan_like(like, shape=None, dtype=None):
        t = interval_backend.torch.empty_like(like, dtype=dtype) if shape is None else \
            interval_backend.torch.empty(shape, dtype=dtype or like.dtype, device=like.device)
        return t.fill_(float("nan"))

    monkeypatch.setattr(interval_backend, "_new_like", nan_like)


class _RefuseHostLayouts:
    """A reusable context: any host compile of a layout inside it fails the test (the device path
    compiles none)."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.ctx = monkeypatch, None

    @staticmethod
    def refuse(*args, **kwargs):
        raise AssertionError("a layout was compiled on the host")

    def __enter__(self):
        from blocksparse_fa.ops import custom_op

        self.ctx = self.monkeypatch.context()
        m = self.ctx.__enter__()
        m.setattr(prepare, "compile_mask", self.refuse)  # layout_for, on the attention() path
        m.setattr(custom_op, "compile_mask", self.refuse)

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


@pytest.fixture
def no_host_layout(monkeypatch):
    return _RefuseHostLayouts(monkeypatch)


KERNEL_CASES = {  # (mask case, B, H, Hkv, D, dtype, tol)
    "causal_doc_gqa_fp32": ("causal_doc", 1, 2, 1, 16, torch.float32, 1e-5),
    "long_causal_fp32": ("long_causal", 1, 2, 1, 16, torch.float32, 1e-5),
    "long_window_fp32": ("long_window", 1, 1, 1, 16, torch.float32, 1e-5),
    "long_recurring_fp32": ("long_recurring", 1, 1, 1, 16, torch.float32, 1e-5),
    "long_bf16_d64": ("long_bf16", 1, 2, 1, 64, torch.bfloat16, 2e-2),
    "window_lq_lt_lk_bf16": ("window_doc_lq", 1, 2, 2, 24, torch.bfloat16, 2e-2),
    "top_left_empty_rows": ("top_left_empty_rows", 1, 2, 1, 16, torch.float32, 1e-5),
    "recurring_ids_batch": ("batch_ids", 2, 2, 1, 16, torch.float32, 1e-5),
    "per_head_fp16": ("per_head", 1, 2, 1, 32, torch.float16, 5e-3),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_interval_kernels_match_float64(case, poisoned, no_host_layout):
    name, B, H, Hkv, D, dtype, tol = KERNEL_CASES[case]
    mask, lq, lk, align = MASKS[name]()
    q, k, v = _qkv(B, H, Hkv, lq, lk, D, dtype)
    with no_host_layout:
        got, do = _fwd_bwd(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, align=align, backend="triton"), q, k, v)
    want = _reference(mask, q, k, v, do, align)
    for a, b in zip(got, want):
        assert not a.isnan().any() and rel_err(a, b) < tol
    empty = ~_dense(mask, lq, lk, align).any(-1)  # rows with nothing to attend: exactly zero
    if empty.shape[0] == 1 and empty.any():
        assert (got[0][:, :, empty[0]] == 0).all() and (got[1][:, :, empty[0]] == 0).all()


def test_interval_kernels_lse_and_its_gradient(poisoned):
    mask, lq, lk, align = MASKS["top_left_empty_rows"]()
    q, k, v = _qkv(1, 2, 1, lq, lk, 16, torch.float32, seed=3)
    out, lse = bsfa.attention(q, k, v, mask=mask, align=align, backend="triton", return_lse=True)
    ref, rlse = bsfa.reference_attention(*(t.detach().double() for t in (q, k, v)), mask=mask, align=align,
                                         return_lse=True)
    finite = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), finite) and rel_err(lse[finite], rlse[finite]) < 1e-6
    g = torch.autograd.grad((out.sum() + lse.where(finite, 0).sum()), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64, l64 = bsfa.reference_attention(q64, k64, v64, mask=mask, align=align, return_lse=True)
    g64 = torch.autograd.grad(o64.sum() + l64.where(finite, 0).sum(), (q64, k64, v64))
    for a, b in zip(g, g64):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_eager_calls_skip_the_custom_op_dispatch(backend, monkeypatch, no_host_layout):
    """Eager calls run the op bodies through an autograd function (no ``torch.library`` dispatch,
    about 0.2 ms of host time per fwd+bwd on the GPU machines) with the custom ops' results bit for
    bit; neither path hands the backward a logsumexp gradient that nobody asked for."""
    mask, lq, lk, align = MASKS["causal_doc"]()
    q, k, v = _qkv(1, 2, 1, lq, lk, 16, torch.float32)
    seen = []
    body = interval_backend._backward_grads
    monkeypatch.setattr(interval_backend, "_backward_grads", lambda *a: seen.append(a[6]) or body(*a))
    with no_host_layout:
        out = bsfa.attention(q, k, v, mask=mask, align=align, backend=backend)
        assert type(out.grad_fn).__name__ == "_IntervalAttentionBackward"
        do = torch.randn_like(out)
        eager = (out, *torch.autograd.grad(out, (q, k, v), do))
        iv = interval_spec(mask, lq, lk, align).bounds(q.device)
        o2, _ = interval_backend.interval_fwd(q, k, v, *iv, 16 ** -0.5, 0.0, None, backend, "")
        op = (o2, *torch.autograd.grad(o2, (q, k, v), do))
    assert seen == [None, None]
    for a, b in zip(eager, op):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["causal_doc", "recurring_ids", "batch_ids", "shift_chunk"])
def test_pytorch_backend_matches_float64_and_the_layout_path(case, no_host_layout):
    mask, lq, lk, align = MASKS[case]()
    B = 2 if case == "batch_ids" else 1
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        q, k, v = _qkv(B, 2, 1, lq, lk, 16, dtype)
        with no_host_layout:
            got, do = _fwd_bwd(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, align=align), q, k, v)
        want = _reference(mask, q, k, v, do, align)
        for a, b in zip(got, want):
            assert a.dtype == dtype and rel_err(a, b) < tol


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dropout_drops_what_the_layout_path_drops(backend, poisoned, no_host_layout):
    """Dropout on the device path draws the block kernels' Philox stream: the layout path's results
    with the same seed, forward and backward."""
    mask, lq, lk, align = MASKS["causal_doc"]()
    layout = bsfa.compile_mask(mask, lq, lk, 16, align=align)
    q, k, v = _qkv(1, 2, 1, lq, lk, 16, torch.float32)
    run = lambda m: lambda q, k, v: bsfa.attention(q, k, v, mask=m, dropout_p=0.25, dropout_seed=77,  # noqa: E731
                                                   backend=backend)
    with no_host_layout:
        got, _ = _fwd_bwd(run(mask), q, k, v)
    want, _ = _fwd_bwd(run(layout), q, k, v)
    for a, b in zip(got, want):
        assert not a.isnan().any() and rel_err(a, b) < 1e-6
    plain, _ = _fwd_bwd(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, backend=backend), q, k, v)
    assert rel_err(got[0], plain[0]) > 0.05  # something was dropped


def test_pytorch_backend_gives_the_layout_paths_results():
    """The same numbers as the block-walking backend over a compiled layout (float64)."""
    mask, lq, lk, align = MASKS["recurring_ids"]()
    layout = bsfa.compile_mask(mask, lq, lk, 16, align=align)
    q, k, v = _qkv(1, 2, 2, lq, lk, 16, torch.float64)
    a, _ = _fwd_bwd(lambda q, k, v: bsfa.attention(q, k, v, mask=mask, align=align), q, k, v)
    b, _ = _fwd_bwd(lambda q, k, v: bsfa.attention(q, k, v, mask=layout, backend="torch"), q, k, v)
    for x, y in zip(a, b):
        assert rel_err(x, y) < 1e-13


def test_compiled_step_with_new_packings_never_recompiles(no_host_layout):
    """20 steps, each with a new packing of 96 tokens (one document, documents of length 1, many
    documents, recurring ids), the mask built inside the compiled function: one graph, no
    recompile, no layout compiled, the eager results and float64 accuracy (forward and backward);
    attention_op the same way, with dropout."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    L = 96
    packings = [[L], [1] * L, [1, L - 2, 1], [48, 48]] + [_packing(L, g) for _ in range(15)]
    steps = [_ids(p) for p in packings] + [torch.tensor([0, 1] * (L // 2))]  # recurring ids too
    assert len(steps) == 20

    def step(q, k, v, ids):
        return bsfa.attention(q, k, v, mask=bsfa.causal() & bsfa.document(ids))

    def op_step(q, k, v, ids):
        return bsfa.attention_op(q, k, v, bsfa.sliding_window(9) & bsfa.document(ids), dropout_p=0.1,
                                 dropout_seed=5)

    q, k, v = _qkv(1, 2, 1, L, L, 16, torch.float32)
    for fn, n in ((step, len(steps)), (op_step, 3)):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        with torch._dynamo.config.patch(error_on_recompile=True), no_host_layout:
            for i, ids in enumerate(steps[:n]):
                got, do = _fwd_bwd(lambda q, k, v: compiled(q, k, v, ids), q, k, v)
                want, _ = _fwd_bwd(lambda q, k, v: fn(q, k, v, ids), q, k, v)
                for a, b in zip(got, want):
                    assert rel_err(a, b) < 1e-6
                if i % 6 == 0 and fn is step:
                    for a, b in zip(got, _reference(bsfa.causal() & bsfa.document(ids), q, k, v, do, "bottom_right")):
                        assert rel_err(a, b) < 1e-5


@pytest.mark.interpreter
def test_layers_build_one_masks_tables_once(monkeypatch):
    """Three layers, each building ``causal() & document(ids)`` from the step's ids: compiled, the
    graph computes the intervals once (common subexpressions) and the kernels' tables are built
    once per step for the three layers (forward and backward); eager, the layers get one mask
    (:func:`~blocksparse_fa.document` of one unmodified tensor), so the same. Results agree."""
    from blocksparse_fa.ops import interval_backend as ib

    built = []
    for name in ("row_tables", "col_tables"):
        monkeypatch.setattr(ib, name, lambda *a, _f=getattr(ib, name), _n=name, **k: built.append(_n) or _f(*a, **k))
    ws = [torch.randn(16, 16, generator=torch.Generator().manual_seed(i)) * 0.3 for i in range(3)]

    def step(x, ids):
        h = x
        for w in ws:
            q = h @ w
            h = h + bsfa.attention(q, q, q, mask=bsfa.causal() & bsfa.document(ids), backend="triton")
        return h.square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.randn(1, 2, 64, 16, requires_grad=True)
    once = ["col_tables", "row_tables", "row_tables"]  # forward rows; backward rows, columns
    for lens in ([20, 30, 14], [64]):
        ids = _ids(lens)
        for fn in (compiled, step):  # eager: document(ids) of one unmodified tensor is one mask
            built.clear()
            g, = torch.autograd.grad(fn(x, ids), x)
            assert sorted(built) == once, (fn, built)
            if fn is compiled:
                want = g
        assert rel_err(g, want) < 1e-5
    ids[5:] += 1  # modified in place: a new document, new tables
    built.clear()
    torch.autograd.grad(step(x, ids), x)
    assert sorted(built) == once, built


def test_document_of_one_unmodified_tensor_is_one_mask():
    """``document(ids)`` returns the mask made for the same tensor before, unless the tensor was
    modified in place since or ``contiguous`` differs; inference tensors get a new mask each time."""
    ids = _ids([3, 5])
    a = bsfa.document(ids)
    assert bsfa.document(ids) is a and bsfa.document(ids, contiguous=False) is not a
    ids[0] = 1  # document 1 now has two runs
    b = bsfa.document(ids)
    assert b is not a and not b.contiguous and a.contiguous and a.tensor[0, 0] == 0
    assert bsfa.document(ids.clone()) is not b  # another tensor
    with torch.inference_mode():
        frozen = _ids([4, 4])
        assert bsfa.document(frozen) is not bsfa.document(frozen)


def test_new_lengths_recompile_at_most_once():
    """Dynamo marks the length dynamic after one recompile; the interval path then reuses the graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]

    def f(q, k, v, ids):
        return bsfa.attention(q, k, v, mask=bsfa.causal() & bsfa.document(ids))

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    for L in (64, 96, 128, 200):
        q, k, v = (t.detach() for t in _qkv(1, 2, 1, L, L, 16, torch.float32))
        assert rel_err(compiled(q, k, v, torch.arange(L) // 37), f(q, k, v, torch.arange(L) // 37)) < 1e-6
    assert counters["stats"]["unique_graphs"] - graphs <= 2


def test_varlen_matches_each_sequence_alone():
    lq, lk = [5, 0, 40, 17, 30], [9, 3, 40, 17, 50]
    cq = torch.tensor([0, *torch.cumsum(torch.tensor(lq), 0).tolist()])
    ck = torch.tensor([0, *torch.cumsum(torch.tensor(lk), 0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lq), 4, 16, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(sum(lk), 2, 16, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(sum(lk), 2, 24, generator=g, dtype=torch.float64).requires_grad_()
    for mask, align in ((None, "bottom_right"), ("causal", "bottom_right"), ("causal & sliding_window(4)", "top_left"),
                        (bsfa.window(bsfa.per_head([1, 2, 3, 9])) & bsfa.key_range(2, 30), "bottom_right")):
        out, lse = bsfa.varlen_attention(q, k, v, cq, ck, 40, 50, mask, align=align, return_lse=True)
        assert out.shape == (sum(lq), 4, 24) and out.is_contiguous() and lse.shape == (4, sum(lq))
        refs = []
        for i in range(len(lq)):
            qs, ks, vs = (t[c[i]:c[i + 1]].transpose(0, 1)[None] for t, c in ((q, cq), (k, ck), (v, ck)))
            if lq[i] and not lk[i]:
                refs.append(torch.zeros(lq[i], 4, 24, dtype=q.dtype))
            elif lq[i]:
                refs.append(bsfa.reference_attention(qs, ks, vs, mask=mask, align=align)[0].transpose(0, 1))
        ref = torch.cat(refs)
        assert rel_err(out, ref) < 1e-12
        for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
            assert rel_err(a, b) < 1e-12


def test_varlen_compiled_with_padded_cu_seqlens_never_recompiles():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)
    L, n_max = 64, 12

    def f(q, k, v, cu):
        return bsfa.varlen_attention(q, k, v, cu, cu, L, L, "causal")

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    q, k, v = (torch.randn(L, h, 16, generator=g) for h in (2, 1, 1))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(5):
            lens = torch.tensor(_packing(L, g, 30))
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])
            cu = torch.cat([cu, cu[-1:].expand(n_max + 1 - len(cu))])  # a fixed length: empty sequences
            want = bsfa.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                  mask=bsfa.causal() & bsfa.document_from_cu_seqlens(cu, L))[0].transpose(0, 1)
            assert rel_err(cf(q, k, v, cu), want) < 1e-6


def test_document_helpers():
    cu = torch.tensor([0, 3, 3, 4, 8], dtype=torch.int32)
    d = bsfa.document_from_cu_seqlens(cu, 8)
    assert d.contiguous and d.ids.tolist() == [[0, 0, 0, 2, 3, 3, 3, 3]]
    p = bsfa.document_from_positions(torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6], [3, 4, 5, 6, 7, 8, 9, 10]]))
    assert p.contiguous and p.ids.tolist() == [[0, 0, 0, 1, 2, 2, 3, 3], [0] * 8]
    assert bsfa.document(torch.zeros(8, dtype=torch.long)).contiguous  # CPU ids: found to be runs
    assert not bsfa.document(torch.tensor([0, 1, 0])).contiguous
    assert not bsfa.document(torch.zeros(8, dtype=torch.long), contiguous=False).contiguous
    with pytest.raises(ValueError, match="contiguous=True, but some document's ids form more than one run"):
        bsfa.document(torch.tensor([0, 1, 0]), contiguous=True)
    with pytest.raises(TypeError, match="contiguous must be True, False or None"):
        bsfa.document(torch.tensor([0, 1]), contiguous=1)
    assert (bsfa.causal() & d) == (bsfa.causal() & bsfa.document(torch.tensor([0, 0, 0, 2, 3, 3, 3, 3])))


@pytest.mark.parametrize("call,match", [
    (lambda: bsfa.document(torch.zeros(8)), "ids must be an integer tensor"),
    (lambda: bsfa.document(torch.tensor([2**40, 0])), "ids must fit in int32"),
    (lambda: bsfa.attention(*_qkv(1, 2, 1, 8, 8, 16, torch.float32), mask=bsfa.document(torch.zeros(9, dtype=int))),
     "ids have length 9, expected kv_len = 8"),
    (lambda: bsfa.document_from_cu_seqlens(torch.tensor([0.0, 8.0]), 8), "cu_seqlens must be an integer tensor"),
    (lambda: bsfa.document_from_cu_seqlens(torch.tensor([0, 5, 3, 8]), 8), "cu_seqlens must be non-decreasing"),
    (lambda: bsfa.document_from_cu_seqlens(torch.tensor([0, 5, 7]), 8), "cu_seqlens must end at the total length 8"),
    (lambda: bsfa.document_from_cu_seqlens(torch.tensor([1, 8]), 8), "cu_seqlens must start at 0"),
    (lambda: bsfa.document_from_cu_seqlens(torch.tensor([[0, 8]]), 8), r"cu_seqlens must have shape \(n,\)"),
    (lambda: bsfa.document_from_cu_seqlens(torch.tensor([0, 8]), 0), "length must be a positive int"),
    (lambda: bsfa.document_from_positions(torch.zeros(2, 3, 4, dtype=int)), "position_ids must have shape"),
    (lambda: bsfa.document_from_positions(torch.zeros(4)), "position_ids must be an integer tensor"),
    (lambda: bsfa.varlen_attention(torch.randn(8, 2, 16), torch.randn(8, 1, 16), torch.randn(8, 1, 16),
                                   torch.tensor([0, 8]), torch.tensor([0, 3, 8]), 8, 8), "same number of sequences"),
    (lambda: bsfa.varlen_attention(torch.randn(8, 2, 16), torch.randn(8, 1, 16), torch.randn(8, 1, 16),
                                   torch.tensor([0, 8]), torch.tensor([0, 8]), 4, 8), "max_seqlen_q=4 is less"),
    (lambda: bsfa.varlen_attention(torch.randn(1, 8, 2, 16), torch.randn(8, 1, 16), torch.randn(8, 1, 16),
                                   torch.tensor([0, 8]), torch.tensor([0, 8]), 8, 8), "q must be packed"),
    (lambda: bsfa.varlen_attention(torch.randn(8, 2, 16), torch.randn(8, 1, 16), torch.randn(8, 1, 16),
                                   torch.tensor([0, 8]), torch.tensor([0, 8]), 8, 8, "causal | window(2)"),
     "mask causal | window"),
])
def test_bad_inputs_get_clear_errors(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_nn_modules_take_a_per_call_document_mask(no_host_layout):
    torch._dynamo.reset()
    layer = bsfa.nn.BlockSparseMultiheadAttention(32, 4, "causal", num_kv_heads=2, rotary=True, block_size=16)
    compiled = torch.compile(lambda x, pos: layer(x, mask=bsfa.document_from_positions(pos)), fullgraph=True,
                             backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            lens = _packing(48, g, 20)
            pos = torch.cat([torch.arange(n) for n in lens])[None].expand(2, 48)
            x = torch.randn(2, 48, 32, generator=g)
            with no_host_layout:
                got = compiled(x, pos)
            starts = [0, *torch.cumsum(torch.tensor(lens), 0).tolist()]
            alone = torch.cat([layer(x[:, a:b]) for a, b in zip(starts, starts[1:])], 1)  # RoPE: relative
            assert rel_err(got, alone) < 1e-5


def test_transformers_packed_position_ids_run_as_documents(no_host_layout):
    transformers = pytest.importorskip("transformers")
    from blocksparse_fa.integrations.transformers import register, unregister

    register("causal", name="bsfa_docs", block_size=16)
    try:
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                       max_position_embeddings=256, initializer_range=0.2)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="bsfa_docs")
        lens = [7, 1, 20, 12]
        docs = [torch.randint(0, 128, (1, n)) for n in lens]
        ids, pos = torch.cat(docs, 1), torch.cat([torch.arange(n) for n in lens])[None]
        alone = torch.cat([model(input_ids=d, use_cache=False).logits for d in docs], 1)
        assert alone.abs().max() > 1
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        with no_host_layout:
            packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            assert rel_err(packed, alone) < 1e-5
            assert rel_err(compiled(input_ids=ids, position_ids=pos, use_cache=False).logits, alone) < 1e-5
    finally:
        unregister("bsfa_docs")


def test_ids_copied_to_a_device_once():
    """The device copy of CPU ids is kept on the document (a CUDA graph cannot capture the copy from
    host memory), not while tracing or in inference mode."""
    from blocksparse_fa.compiler.device_intervals import ids_on

    doc = bsfa.document(torch.tensor([0, 0, 1, 1, 1]))
    first = ids_on(doc, "meta")
    assert first.device.type == "meta" and ids_on(doc, "meta") is first
    assert ids_on(doc, "cpu") is doc.tensor
    with torch.inference_mode():
        assert ids_on(bsfa.document(torch.tensor([0, 1])), "meta") is not None
