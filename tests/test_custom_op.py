"""The torch.library custom op: eager vs the float64 reference, GQA, dropout, opcheck, the layout
registry, and torch.compile(fullgraph=True) of a module calling it (forward and backward)."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

import blocksparse_fa as bsfa
from blocksparse_fa.ops.custom_op import LayoutRegistry, attention_fwd, attention_op, register_mask, registry

MASK = bsfa.causal() & (bsfa.window(20) | bsfa.global_tokens(5))


def qkv(B=2, H=4, Hkv=2, Lq=70, Lk=70, D=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64),
          torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64),
          torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64),
          torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)]
    return [t.to(dtype) for t in ts]


def out_and_grads(fn, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do.to(out.dtype)))


@pytest.mark.parametrize("mask", [MASK, "causal & longformer(window=9, n_global=3)", None], ids=str)
@pytest.mark.parametrize("Lq,Lk", [(70, 70), (37, 70)])
def test_eager_matches_float64_reference(mask, Lq, Lk):
    q, k, v, do = qkv(Lq=Lq, Lk=Lk)
    got = out_and_grads(lambda q, k, v: attention_op(q, k, v, mask, block_size=16), q, k, v, do)
    ref = out_and_grads(lambda q, k, v: bsfa.reference_attention(q, k, v, mask), q, k, v, do)
    for a, b in zip(got, ref):
        assert a.dtype == torch.float64
        assert rel_err(a, b) < 1e-12


def test_float32_gqa_matches_reference_and_attention():
    q, k, v, do = qkv(H=6, Hkv=2, dtype=torch.float32)
    got = out_and_grads(lambda q, k, v: attention_op(q, k, v, MASK, block_size=16), q, k, v, do)
    ref = out_and_grads(lambda q, k, v: bsfa.reference_attention(q.double(), k.double(), v.double(), MASK), q, k, v, do)
    api = out_and_grads(lambda q, k, v: bsfa.attention(q, k, v, mask=MASK, block_size=16), q, k, v, do)
    for a, b, c in zip(got, ref, api):
        assert a.dtype == torch.float32
        assert rel_err(a, b) < 1e-5
        assert rel_err(a, c) < 1e-6
    assert got[2].shape == k.shape  # dk summed over the GQA group


def test_lse_and_dropout_match_the_public_api():
    q, k, v, _ = qkv()
    out, lse = attention_op(q, k, v, MASK, block_size=16, dropout_p=0.3, dropout_seed=123, return_lse=True)
    ref, ref_lse = bsfa.attention(q, k, v, mask=MASK, block_size=16, dropout_p=0.3, dropout_seed=123,
                                  return_lse=True)
    assert lse.dtype == torch.float32 and not lse.requires_grad
    assert rel_err(out, ref) < 1e-12
    assert rel_err(lse, ref_lse) < 1e-6
    keep = bsfa.dropout_keep_mask(2, 4, 70, 70, 0.3, 123)
    dense = bsfa.reference_attention(q, k, v, MASK, dropout_p=0.3, dropout_mask=keep)
    assert rel_err(out, dense) < 1e-12
    other = attention_op(q, k, v, MASK, block_size=16, dropout_p=0.3, dropout_seed=124)
    assert rel_err(other, out) > 1e-3


def test_opcheck():
    q, k, v, _ = qkv(B=1, H=4, Hkv=2, Lq=40, Lk=40, D=8, dtype=torch.float32)
    h = register_mask(MASK, 16)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), h, 0.3, 0.0,
            None, "auto", True, "bottom_right", [], None, None, None, '{"lists":"fine"}')
    res = torch.library.opcheck(attention_fwd.default, args)
    assert all(v == "SUCCESS" for v in res.values()), res
    # a template handle: the mask's tensors are op inputs
    from blocksparse_fa.ops.custom_op import registry

    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([10, 20, 10]))[None]
    ht = registry.register_template("causal & document", ("document",), 16)
    res = torch.library.opcheck(attention_fwd.default, args[:3] + (ht,) + args[4:-5] + ([ids], None, None, None, ""))
    assert all(v == "SUCCESS" for v in res.values()), res
    # score modifiers: slopes, cap and a broadcast bias as op arguments, with gradients
    slopes = torch.tensor([0.5, 0.25, 0.125, 1.0], requires_grad=True)
    bias = torch.randn(1, 4, 1, 40, requires_grad=True)
    res = torch.library.opcheck(attention_fwd.default, args[:-4] + (slopes, torch.tensor([2.5]), bias, ""))
    assert all(v == "SUCCESS" for v in res.values()), res


def test_registry_handles_are_stable_and_cached():
    reg = LayoutRegistry(capacity=2)
    h1 = reg.register(bsfa.causal() & bsfa.window(8), 16)
    assert reg.register(bsfa.causal() & bsfa.window(8), 16) == h1  # equal masks share a handle
    assert reg.register(bsfa.causal() & bsfa.window(8), 32) != h1  # block size is part of the key
    lay = reg.layout(h1, 64, 64, "cpu")
    assert reg.layout(h1, 64, 64, "cpu") is lay
    assert (lay.q_len, lay.kv_len, lay.block_size) == (64, 64, (16, 16))
    assert reg.layout(h1, 32, 64).q_len == 32
    reg.pin(h1)
    for w in range(1, 6):
        reg.register(bsfa.window(w), 16)
    assert h1 in reg and len(reg) == 3  # capacity 2 unpinned + the pinned one
    reg.unpin(h1)
    reg.register(bsfa.window(99), 16)
    assert h1 not in reg
    with pytest.raises(KeyError, match="evicted"):
        reg.layout(h1, 64)


def test_registry_bounds_the_bytes_of_mask_tensors():
    reg = LayoutRegistry(capacity=100, max_bytes=3000)
    g = torch.Generator().manual_seed(0)
    # dense masks hold one bit per element: 64 x 128 is 1 KiB, 128 x 256 is 4 KiB
    hs = [reg.register(bsfa.dense_mask(torch.rand(64, 128, generator=g) > 0.5), 16) for _ in range(5)]
    assert [h in reg for h in hs] == [False, False, False, True, True]
    big = reg.register(bsfa.dense_mask(torch.rand(128, 256, generator=g) > 0.5), 16)  # 4 KiB alone: kept
    assert big in reg and len(reg) == 1


def test_template_layouts_kept_for_the_same_tensors(monkeypatch):
    """A template handle (a tensor-holding mask under torch.compile) compiles once for the same
    tensors or aliases of them, again after an in-place change, and per set of tensors."""
    from blocksparse_fa.ops import custom_op

    reg = LayoutRegistry()
    h = reg.register_template("causal & document", ("document",), 16)
    parsed = []
    real = custom_op.parse
    monkeypatch.setattr(custom_op, "parse", lambda *a, **kw: parsed.append(a) or real(*a, **kw))
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([10, 20, 34]))[None]
    lay = reg.layout(h, 64, 64, "cpu", tensors=[ids])
    assert reg.layout(h, 64, 64, "cpu", tensors=[ids]) is lay
    assert reg.layout(h, 64, 64, "cpu", tensors=[ids.detach()]) is lay  # an alias, as the backward gets
    assert len(parsed) == 1
    other = torch.repeat_interleave(torch.arange(2), torch.tensor([32, 32]))[None]
    lay2 = reg.layout(h, 64, 64, "cpu", tensors=[other])  # another mask of the same structure
    assert lay2 is not lay and reg.layout(h, 64, 64, "cpu", tensors=[ids]) is lay and len(parsed) == 2
    ids[0, 40:] = 3  # written in place: compiled again, with the new ids
    lay3 = reg.layout(h, 64, 64, "cpu", tensors=[ids])
    assert len(parsed) == 3 and lay3 is not lay
    want = bsfa.compile_mask(bsfa.causal() & bsfa.document(ids.clone()), 64, 64, 16)
    assert torch.equal(lay3.block_states(), want.block_states())
    with pytest.raises(ValueError, match="needs the tensors"):
        reg.layout(h, 64, 64, "cpu")


def test_compiled_layout_argument_and_errors():
    q, k, v, _ = qkv(Lq=64, Lk=64)
    lay = bsfa.compile_mask(MASK, 64, 64, 16)
    assert rel_err(attention_op(q, k, v, lay), bsfa.reference_attention(q, k, v, MASK)) < 1e-12
    with pytest.raises(ValueError, match="compiled for"):
        attention_op(q[:, :, :32], k, v, lay)
    with pytest.raises(ValueError, match="dropout_p"):
        attention_op(q, k, v, MASK, dropout_p=1.0)
    with pytest.raises(TypeError, match="mask must be"):
        attention_op(q, k, v, 3.5)


class _Net(torch.nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16, dtype=torch.float64)
        self.mask = mask

    def forward(self, q, k, v):
        o = attention_op(self.lin(q), k, v, self.mask, block_size=16)
        return torch.tanh(o) * 2.0


def _recording_backend(graphs):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm.code)
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=record("fw"), bw_compiler=record("bw"))


def test_torch_compile_fullgraph_forward_backward():
    torch._dynamo.reset()
    net = _Net(MASK)
    q, k, v, do = qkv()
    graphs = {"fw": [], "bw": []}
    cnet = torch.compile(net, fullgraph=True, backend=_recording_backend(graphs))
    got = out_and_grads(cnet, q, k, v, do)
    eager = out_and_grads(net, q, k, v, do)

    def ref_fn(q, k, v):
        return torch.tanh(bsfa.reference_attention(net.lin(q), k, v, MASK)) * 2.0

    ref = out_and_grads(ref_fn, q, k, v, do)
    for a, b, c in zip(got, eager, ref):
        assert rel_err(a, b) < 1e-13
        assert rel_err(a, c) < 1e-12
    assert len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1
    assert "blocksparse_fa.attention_fwd" in graphs["fw"][0]
    assert "blocksparse_fa.attention_bwd" in graphs["bw"][0]
    assert "attention_fwd" not in graphs["bw"][0]  # the backward does not re-run the forward


def test_torch_compile_inductor_with_dynamic_lengths_and_dropout():
    torch._dynamo.reset()
    net = _Net(MASK).float()
    net.lin = net.lin.float()

    def fn(q, k, v):
        return attention_op(net.lin(q), k, v, net.mask, block_size=16, dropout_p=0.2, dropout_seed=7)

    cfn = torch.compile(fn, fullgraph=True, dynamic=True)
    for L in (48, 70):
        q, k, v, do = qkv(Lq=L, Lk=L, dtype=torch.float32)
        got = out_and_grads(cfn, q, k, v, do)
        eager = out_and_grads(fn, q, k, v, do)
        for a, b in zip(got, eager):
            assert rel_err(a, b) < 1e-5


def test_dropout_seed_drawn_inside_compiled_graph():
    torch._dynamo.reset()
    q, k, v, _ = qkv(dtype=torch.float32)

    def fn(q, k, v):
        return attention_op(q, k, v, MASK, block_size=16, dropout_p=0.5)

    cfn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    a, b = cfn(q, k, v), cfn(q, k, v)
    assert torch.isfinite(a).all() and rel_err(a, b) > 1e-3  # a fresh seed per call


@pytest.mark.interpreter
def test_triton_backend_through_the_op():
    pytest.importorskip("blocksparse_fa.ops.triton_backend")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    q, k, v, do = qkv(B=1, H=4, Hkv=2, Lq=40, Lk=40, dtype=torch.float32)
    mask = bsfa.causal() & bsfa.window(20)
    got = out_and_grads(lambda q, k, v: attention_op(q, k, v, mask, block_size=16, backend="triton"), q, k, v, do)
    ref = out_and_grads(lambda q, k, v: bsfa.reference_attention(q, k, v, mask), q, k, v, do)
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-5


def test_registry_module_pin_released():
    import gc

    from blocksparse_fa.nn import BlockSparseAttention

    m = BlockSparseAttention(bsfa.sliding_window(13), block_size=16)
    h = m.handle
    assert registry._entries[h].pins >= 1
    pins = registry._entries[h].pins
    del m
    gc.collect()
    assert h not in registry or registry._entries[h].pins == pins - 1


def test_op_call_layouts_answered_from_a_memo_until_the_registry_drops(monkeypatch):
    """A repeated op call (same handle, alignment, shapes, dtypes, device) takes its checked shapes
    and layout from a memo instead of checking and looking up again; new shapes are checked (bad
    ones still raise, naming the argument), and anything the registry drops invalidates the memo."""
    from blocksparse_fa.ops import custom_op as co

    monkeypatch.setattr(co, "_CALLS", {})
    h = register_mask(bsfa.causal() & bsfa.sliding_window(24), pin=True)  # kept through clear()
    q, k = torch.randn(1, 2, 64, 16), torch.randn(1, 1, 64, 16)
    s1, lay1 = co._layout(q, k, k, h, "bottom_right")
    calls = []
    real = co.registry.layout
    monkeypatch.setattr(co.registry, "layout", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    s2, lay2 = co._layout(q, k, k, h, "bottom_right")
    assert (s2, lay2) == (s1, lay1) and lay2 is lay1 and not calls
    co._layout(q[:, :, :32], k[:, :, :32], k[:, :, :32], h, "bottom_right")  # new lengths: looked up
    assert len(calls) == 1
    with pytest.raises(ValueError, match="GQA: the number of query heads H=3"):
        co._layout(torch.randn(1, 3, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16), h,
                   "bottom_right")
    gen = co.registry.generation
    co.registry.clear()  # drops other entries: the memo no longer answers, even for this handle
    assert co.registry.generation > gen
    calls.clear()
    assert co._layout(q, k, k, h, "bottom_right")[1] is lay1 and len(calls) == 1
    co._layout(q, k, k, h, "bottom_right")
    assert len(calls) == 1
    co.registry.unpin(h)


def test_operators_are_library_kernels_without_custom_op_wrappers():
    """The package's operators are defined on a ``torch.library.Library`` fragment with their bodies
    as kernels (``_oplib``), not through ``torch.library.custom_op``: no per-call wrapper between
    the graph and the body, and the same schema, fake and autograd behaviour (``test_opcheck``)."""
    from torch._library.custom_ops import CustomOpDef

    from blocksparse_fa import _oplib
    from blocksparse_fa.compiler import device_intervals
    from blocksparse_fa.distributed import custom_op as cp_op
    from blocksparse_fa.ops import custom_op as co, interval_backend

    ops = (co.attention_fwd, co.attention_bwd, interval_backend.interval_fwd, interval_backend.interval_bwd,
           cp_op.cp_attention_fwd, cp_op.cp_attention_bwd, device_intervals._document_bounds_op)
    for op in ops:
        assert isinstance(op, _oplib.Operator) and not isinstance(op, CustomOpDef), op
        assert op.default is getattr(torch.ops.blocksparse_fa, op.name).default
    schema = str(co.attention_fwd.default._schema)
    assert "Tensor[] mask_tensors" in schema and schema.endswith("-> (Tensor, Tensor)"), schema
    # calling the object calls the operator: a float64 CPU call equals the eager path
    q, k, v, _ = qkv(B=1, H=2, Hkv=1, Lq=24, Lk=24, D=8, dtype=torch.float64)
    h = register_mask(MASK, 16)
    out, lse = co.attention_fwd(q, k, v, h, 0.35, 0.0, None, "torch", True, "bottom_right", [], None, None, None, "")
    assert rel_err(out, attention_op(q, k, v, h, scale=0.35, backend="torch")) < 1e-12
    with pytest.raises(ValueError, match="qualname must be 'namespace::name'"):
        _oplib.Operator("no_namespace", lambda x: x)
