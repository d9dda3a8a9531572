"""``torch.compile(fullgraph=True)`` on every public entry point (forward and backward, masks built
inside or outside the compiled function, text, compiled layouts, the nn modules), recompiles when
the sequence length changes, and the caches under threads."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import rel_err

import blocksparse_fa as bsfa

MASK = bsfa.causal() & (bsfa.window(20) | bsfa.global_tokens(5))


def _qkv(L=96, H=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(1, h, L, D, generator=g) for h in (H, Hkv, Hkv)]
    return [t.requires_grad_() for t in ts]


def _run(fn, q, k, v):
    out = fn(q, k, v)
    do = torch.ones_like(out) * 0.5 + torch.linspace(0, 1, out.shape[-1])
    return (out, *torch.autograd.grad(out, (q, k, v), do))


LAYOUT = bsfa.compile_mask(MASK, 96, 96, 16)
MODULE = bsfa.nn.BlockSparseAttention(MASK, block_size=16)
ENTRIES = {
    "expr_inside": lambda q, k, v: bsfa.attention(q, k, v, mask=bsfa.causal() & (bsfa.window(20) | bsfa.global_tokens(5)),
                                                  block_size=16),
    "expr_outside": lambda q, k, v: bsfa.attention(q, k, v, mask=MASK, block_size=16),
    "text": lambda q, k, v: bsfa.attention(q, k, v, mask="causal & (window(20) | global_tokens(5))", block_size=16),
    "layout": lambda q, k, v: bsfa.attention(q, k, v, mask=LAYOUT),
    "op_inside": lambda q, k, v: bsfa.attention_op(q, k, v, bsfa.causal() & (bsfa.window(20) | bsfa.global_tokens(5)),
                                                   block_size=16),
    "module": lambda q, k, v: MODULE(q, k, v),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_fullgraph_forward_backward_matches_eager(entry):
    torch._dynamo.reset()
    fn = ENTRIES[entry]
    q, k, v = _qkv()
    got = _run(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v)
    want = _run(fn, q, k, v)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-6


def test_multihead_module_compiles_fullgraph():
    torch._dynamo.reset()
    layer = bsfa.nn.BlockSparseMultiheadAttention(64, 4, MASK, num_kv_heads=2, rotary=True, block_size=16)
    x = torch.randn(2, 96, 64, requires_grad=True)
    out = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    g, = torch.autograd.grad(out.sum(), x)
    ref = layer(x)
    gr, = torch.autograd.grad(ref.sum(), x)
    assert rel_err(out, ref) < 1e-6 and rel_err(g, gr) < 1e-6


def test_length_changes_recompile_at_most_once():
    """The op's fake implementation needs shapes only: after one recompile (Dynamo marks the length
    dynamic) new lengths reuse the graph."""
    torch._dynamo.reset()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm

    cfn = torch.compile(lambda q, k, v: MODULE(q, k, v), fullgraph=True, backend=backend)
    for L in (64, 96, 128, 160, 208):
        q, k, v = _qkv(L=L)
        out = cfn(q, k, v)
        assert rel_err(out, MODULE(q, k, v)) < 1e-6
    assert len(frames) <= 2


def test_caches_under_threads():
    """Layouts compiled from several threads at once (no lock in the caches) give the results of a
    sequential run."""
    masks = [bsfa.causal() & bsfa.window(w) for w in (8, 16, 24, 32)] * 3
    q, k, v = (t.detach() for t in _qkv())
    want = [bsfa.attention(q, k, v, mask=m, block_size=16) for m in masks]
    bsfa.compiler.clear_cache()
    got = [None] * len(masks)

    def work(i):
        got[i] = bsfa.attention(q, k, v, mask=masks[i], block_size=16)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(masks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_document_mask_built_inside_from_step_tensors():
    """A tensor-holding mask built inside the compiled function (per-step document ids) becomes a
    template handle plus op inputs: new ids reuse the graph and give the eager results."""
    torch._dynamo.reset()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm

    def f(q, k, v, doc):
        return bsfa.attention(q, k, v, mask=bsfa.causal() & bsfa.document(doc), block_size=16)

    cf = torch.compile(f, fullgraph=True, backend=backend)
    q, k, v = _qkv()
    for cuts in ([32, 32, 32], [50, 46], [7, 89]):
        doc = torch.repeat_interleave(torch.arange(len(cuts), dtype=torch.int32), torch.tensor(cuts))[None]
        got = _run(lambda q, k, v: cf(q, k, v, doc), q, k, v)
        want = _run(lambda q, k, v: f(q, k, v, doc), q, k, v)
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-6
    assert len(frames) == 1


@pytest.mark.parametrize("contiguous", [None, True])
def test_masks_built_inside_take_no_id_of_traced_tensors(monkeypatch, contiguous):
    """torch 2.11's Dynamo cannot take ``id()`` of a tensor made inside the compiled function, and a
    mask's ids are its own copy: masks built inside (``causal() & document(ids)``, two documents of
    one tensor, two of different tensors) must name their tensors without it. Newer Dynamo traces
    such an ``id()``, so it is refused here as 2.11 refuses it."""
    builtin = pytest.importorskip("torch._dynamo.variables.builtin")
    tensor_var = pytest.importorskip("torch._dynamo.variables.tensor").TensorVariable
    real = builtin.BuiltinVariable.call_id

    def call_id(self, tx, *args):
        if args and isinstance(args[0], tensor_var) and args[0].source is None:
            raise RuntimeError("id() of a tensor made inside the compiled function")
        return real(self, tx, *args)

    monkeypatch.setattr(builtin.BuiltinVariable, "call_id", call_id)
    torch._dynamo.reset()

    texts = []

    def f(q, k, v, doc, other):
        one = bsfa.causal() & bsfa.document(doc, contiguous=contiguous)
        same = bsfa.document(doc)
        texts.append((str(same | same), str(bsfa.document(doc) | bsfa.document(other))))
        return bsfa.attention(q, k, v, mask=one, block_size=16)

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    q, k, v = _qkv()
    doc = torch.repeat_interleave(torch.arange(2, dtype=torch.int32), torch.tensor([40, 56]))[None]
    got = _run(lambda q, k, v: cf(q, k, v, doc, doc.flip(-1)), q, k, v)
    want = _run(lambda q, k, v: f(q, k, v, doc, doc.flip(-1)), q, k, v)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-6
    # one variable per tensor object while traced (each document holds its own copy of the ids)
    assert texts[0] == ("document | document", "document | document(document_2)")


def test_mask_with_tensors_made_outside_compiles_its_layout_once(monkeypatch):
    """Tensor-holding masks made outside the compiled function (document ids, per-head windows):
    each op call used to parse and compile the layout again; now the first call does, forward and
    backward then reuse it, and a second mask of the same structure (the same template handle)
    keeps its own layout. Results equal eager."""
    from blocksparse_fa.ops import custom_op

    torch._dynamo.reset()

    def make(cuts, wins):  # not an & of intervals: a host layout, not the device-interval route
        ids = torch.repeat_interleave(torch.arange(len(cuts), dtype=torch.int32), torch.tensor(cuts))
        return bsfa.load_pattern("shared_prefix", prefix=8, document=ids) & bsfa.sliding_window(
            bsfa.per_head(torch.tensor(wins)))

    masks = [make([30, 40, 26], [8, 64, 20, 96]), make([60, 36], [96, 8, 64, 20])]
    fns = [lambda q, k, v, m=m: bsfa.attention(q, k, v, mask=m, block_size=16) for m in masks]
    cfs = [torch.compile(f, fullgraph=True, backend="aot_eager") for f in fns]
    q, k, v = _qkv()
    first = [_run(cf, q, k, v) for cf in cfs]
    parsed = []
    real = custom_op.parse
    monkeypatch.setattr(custom_op, "parse", lambda *a, **kw: parsed.append(a) or real(*a, **kw))
    for _ in range(2):
        for cf, f, got0 in zip(cfs, fns, first):
            got, want = _run(cf, q, k, v), _run(f, q, k, v)
            for a, b, c in zip(got, want, got0):
                assert rel_err(a, b) < 1e-6 and torch.equal(a, c)
    assert parsed == []
    assert rel_err(first[0][0], first[1][0]) > 1e-2  # the two masks kept their own layouts


def test_score_mod_fullgraph_values_do_not_recompile():
    """ALiBi slopes, a bias and a soft-cap built inside the compiled function (forward and backward,
    gradients to q, k, v, the slopes and the bias, v with its own head dim) match eager; new slope
    and bias tensors never recompile, a new float cap at most once (Dynamo then traces it as
    dynamic) and a cap given as a tensor never."""
    torch._dynamo.reset()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm

    def f(q, k, v, slopes, b, cap):
        mod = bsfa.alibi(slopes) + bsfa.bias(b) + bsfa.softcap(cap)
        return bsfa.attention(q, k, v, MASK, block_size=16, score_mod=mod)

    cf = torch.compile(f, fullgraph=True, backend=backend)
    q, k, _ = _qkv(L=64)
    v = torch.randn(1, 2, 64, 24, requires_grad=True)
    counts = []
    for i, cap in enumerate((2.0, 3.0, 4.0, torch.tensor(5.0), torch.tensor(6.0))):
        slopes = (torch.rand(4) * (i + 1)).requires_grad_()
        b = torch.randn(4, 1, 64).requires_grad_()
        ins = (q, k, v, slopes, b)
        got, want = _run_mod(cf, ins, cap), _run_mod(f, ins, cap)
        for a, c in zip(got, want):
            assert rel_err(a, c) < 1e-6
        counts.append(len(frames))
    assert counts[0] == 1 and counts[2] - counts[0] <= 1  # floats: one recompile when the value first changes
    assert counts[4] - counts[3] == 0 and counts[-1] <= 3  # tensors: none


def _run_mod(fn, ins, cap):
    out = fn(*ins, cap)
    do = torch.ones_like(out) * 0.5 + torch.linspace(0, 1, out.shape[-1])
    return (out, *torch.autograd.grad(out, ins, do))


def test_compiled_backward_gets_no_logsumexp_gradient_it_does_not_need():
    """Under AOT autograd the op's unused logsumexp output must reach the backward as None (not a
    materialised zeros tensor folded into delta); asked for, its gradient arrives."""
    from blocksparse_fa.ops import dispatch

    seen = []
    orig = dispatch.backward

    def spy(*a, **kw):
        seen.append(kw.get("dlse"))
        return orig(*a, **kw)

    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
    dispatch.backward = spy
    try:
        f = torch.compile(lambda q, k, v: bsfa.attention(q, k, v, mask=bsfa.causal()), fullgraph=True,
                          backend="aot_eager")
        f(q, k, v).sum().backward()
        g = torch.compile(lambda q, k, v: bsfa.attention(q, k, v, mask=bsfa.causal(), return_lse=True),
                          fullgraph=True, backend="aot_eager")
        o, lse = g(q, k, v)
        (o.sum() + lse.sum()).backward()
    finally:
        dispatch.backward = orig
    assert len(seen) == 2
    assert seen[0] is None
    assert seen[1] is not None and seen[1].shape == (1, 2, 64)


@pytest.mark.parametrize("form", ["instance", "fields"])
def test_kernel_options_dict_with_a_config_compiles_fullgraph(form):
    """``kernel_options={"gluon_bwd": GluonBwdConfig(...)}`` (or the config as a dict of its fields)
    held outside a compiled function runs under ``fullgraph=True`` (Dynamo cannot pass a frozen
    dataclass instance to a constant-result function: it crosses as its fields), with eager's
    results; a misspelt field of the config is refused by name."""
    from blocksparse_fa.ops.options import GluonBwdConfig

    torch._dynamo.reset()
    cfg = GluonBwdConfig(persistent=False)
    opts = {"gluon_bwd": cfg if form == "instance" else {"persistent": False}, "deterministic": True}

    def fn(q, k, v):
        return bsfa.attention(q, k, v, mask=MASK, block_size=16, kernel_options=opts)

    q, k, v = _qkv()
    got = _run(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v)
    for a, b in zip(got, _run(fn, q, k, v)):
        assert rel_err(a, b) < 1e-6
    with pytest.raises(ValueError, match=r"gluon_bwd has no field\(s\) \['persistant'\]"):
        bsfa.attention(q, k, v, mask=MASK, block_size=16, kernel_options={"gluon_bwd": {"persistant": False}})


def test_one_compiled_function_with_masks_differing_in_integers():
    """Masks that differ only in integers (a window per layer) through one compiled function: each
    is read as its text, a constant, so none is traced as a symbol (fullgraph holds) and every call
    gives that mask's result."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 96, 16)
    fn = torch.compile(lambda q, m: bsfa.attention(q, q, q, mask=m, backend="torch"), backend="aot_eager",
                       fullgraph=True)
    for mask in (bsfa.causal() & bsfa.sliding_window(40), bsfa.causal() & bsfa.sliding_window(24),
                 bsfa.causal() & bsfa.sliding_window(8), bsfa.sliding_window(40), bsfa.sliding_window(24),
                 bsfa.parse("causal & (sliding_window(16) | global_tokens(3))")):
        assert torch.equal(fn(q, mask), bsfa.attention(q, q, q, mask=mask, backend="torch")), str(mask)
