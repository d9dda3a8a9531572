"""Replayed calls (``ops/call_memo.py``): a signature seen twice with the same launches replays them.

The CPU pretends to be a Hopper GPU and the kernel launches are logged instead of run, so what a
replay launches can be set beside what the host path launches for the same call: the same kernels,
grids and arguments, with the new call's tensors in the per-call places and the same cached tables
everywhere else."""

import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.ops import call_memo, select
from blocksparse_fa.ops import triton_backend as tb
from blocksparse_fa.ops.launcher import Launch
from blocksparse_fa.ops.select import Hardware

L = 512


@pytest.fixture
def logged(monkeypatch):
    """Hopper with 132 SMs, the lists built on the CPU, launches logged as ``(kernel, grid, args)``."""
    monkeypatch.setattr(select, "hardware", lambda device: Hardware("cuda", (9, 0), "", 132))
    monkeypatch.setattr(select, "tma_ok", lambda *ts: True)
    monkeypatch.setattr(select, "_LIST_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(tb, "_set_tma_allocator", lambda device: None)
    log = []
    monkeypatch.setattr(Launch, "_go", lambda self, grid, args: log.append((self.fn, tuple(grid), args)))
    return log


def _call(mask, log, D=128, Hkv=2, opts=None, lse_grad=False, do_columns=False):
    """One fwd+bwd with fresh inputs: ``(launches, {tensor id: role}, choices)``."""
    q = torch.randn(1, 4, L, D, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, Hkv, L, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    del log[:]
    with select.record() as ran:
        out, lse = bsfa.attention(q, k, v, mask=mask, backend="triton", kernel_options=opts, return_lse=True)
        do = torch.randn(1, 4, D, L, dtype=out.dtype).transpose(2, 3) if do_columns else torch.randn_like(out)
        dlse = torch.randn_like(lse) if lse_grad else None
        grads = torch.autograd.grad((out, lse) if lse_grad else out, (q, k, v), (do, dlse) if lse_grad else do)
    named = dict(q=q, k=k, v=v, out=out, lse=lse, do=do, dq=grads[0], dk=grads[1], dv=grads[2])
    return list(log), {id(t): name for name, t in named.items()}, ran, named


def _same_launches(ref, ref2, got) -> None:
    """``got`` (a replay) launches what ``ref`` and ``ref2`` (two calls of the host path) did:
    per argument the same role (an input, output or gradient of its call), the same fixed tensor
    (one both host calls passed), a fresh buffer of the same shape (one they allocated per call)
    or the same value."""
    (a, roles_a), (b, _), (c, roles_c) = ref, ref2, got
    assert [(fn, grid) for fn, grid, _ in c] == [(fn, grid) for fn, grid, _ in a]
    assert len(c) > 0
    for (fn, _, xa), (_, _, xb), (_, _, xc) in zip(a, b, c):
        assert len(xa) == len(xc), fn
        for i, (u, w, r) in enumerate(zip(xa, xb, xc)):
            where = f"{getattr(fn, '__name__', fn)} argument {i}"
            if not isinstance(u, torch.Tensor):
                assert type(r) is type(u) and r == u, where
            elif id(u) in roles_a:
                assert roles_c.get(id(r)) == roles_a[id(u)], where
            elif u is w:  # a table both host calls passed
                assert r is u, where
            else:  # a buffer of the call
                assert id(r) not in roles_c and r is not u and r is not w, where
                assert (r.shape, r.dtype, r.stride()) == (u.shape, u.dtype, u.stride()), where


CASES = {
    # mask, head dim, (forward, backward) choices
    "causal": (lambda: bsfa.causal(), 128, ("gluon:causal", "gluon:causal+atomic_dq")),
    "dense": (lambda: None, 64, ("gluon:dense", "gluon:dense+atomic_dq")),
    "window": (lambda: bsfa.sliding_window(200), 128, ("gluon:interval", "gluon:interval")),
    "bigbird": (lambda: bsfa.parse("sliding_window(64) | global_tokens(128) | random_blocks(1, seed=3)"), 128,
                ("gluon:list", "gluon:list")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_replay_launches_what_the_host_path_does(logged, name):
    make, D, want = CASES[name]
    mask = make()
    off = dict(replay=False)
    ref, ref2 = _call(mask, logged, D, opts=off), _call(mask, logged, D, opts=off)
    assert [c for _, c in ref[2]] == list(want), ref[2]
    first, second, third = (_call(mask, logged, D) for _ in range(3))
    for got in (first, second):  # recorded while the host path ran
        _same_launches(ref[:2], ref2[:2], got[:2])
    _same_launches(ref[:2], ref2[:2], third[:2])  # replayed
    assert third[2] == ref[2]  # the choices are still noted
    layout = bsfa.compile_mask(mask if mask is not None else bsfa.full(), L, L, 128)
    memo = layout.cache.get("call_memo", {})
    assert sum(isinstance(e, call_memo.Replay) for e in memo.values()) == 2, memo
    call_memo.clear(layout)


def test_a_replay_of_the_per_head_dkdv_backward(logged, monkeypatch):
    """The GQA list backward with dK/dV per query head launches the pair on the call's K and V and a
    group sum of dK/dV after it: a replay passes the new call's K and V to the dK/dV launch, sums
    into the gradients it returns, and never copies K or V."""
    mask = bsfa.parse("sliding_window(64) | global_tokens(128)")
    longest, mean = select.layout_class(bsfa.compile_mask(mask, L, L, 128)).list_columns
    monkeypatch.setattr(select, "LIST_LONG_COLUMN", 0.0)
    # a column of the 2 kv heads' groups is too long, one of the 4 query heads' is not
    monkeypatch.setattr(select, "LIST_COLUMN_SHARE", longest / (3 * mean * (L // 128) / 132))
    off = dict(replay=False)
    ref, ref2 = _call(mask, logged, opts=off), _call(mask, logged, opts=off)
    assert [c for _, c in ref[2]][1] == "gluon:list+per_head_dkdv"
    for _ in range(2):
        _call(mask, logged)
    got = _call(mask, logged)
    _same_launches(ref[:2], ref2[:2], got[:2])
    launches, named = got[0], got[3]
    by_name = {}
    for fn, _, args in launches:
        by_name.setdefault(fn.__name__, []).append(args)
    assert "_expand_heads" not in by_name
    (dkdv,), (dq,), (sk, sv) = by_name["_attn_bwd_dkdv_gluon"], by_name["_attn_bwd_dq_gluon"], by_name["_group_sum"]
    assert dkdv[1] is named["k"] and dkdv[2] is named["v"] and dq[1] is named["k"] and dq[2] is named["v"]
    assert sk[0] is dkdv[4] and sv[0] is dkdv[5] and sk[1] is named["dk"] and sv[1] is named["dv"]
    assert tuple(dkdv[4].shape) == (1, 4, L, 128) and tuple(named["dk"].shape) == (1, 2, L, 128)
    layout = bsfa.compile_mask(mask, L, L, 128)
    assert sum(isinstance(e, call_memo.Replay) for e in layout.cache["call_memo"].values()) == 2
    call_memo.clear(layout)


def test_a_replay_repeats_tensor_operations():
    """``call_memo.run``: an operation whose result is a new tensor runs again in a replay, on the
    replayed call's tensors, and later launches get its new result."""
    layout = bsfa.compile_mask(bsfa.causal(), 256, 256, 128)
    seen = []

    class FakeLaunch:
        fn = None

        def __call__(self, grid, *args):
            seen.append(args)

    launch = FakeLaunch()
    for _ in range(2):
        q = torch.zeros(3)
        with call_memo.recording((q,)) as rec:
            doubled = call_memo.run(torch.mul, q, 2)
            call_memo.note_launch(launch, (1,), (doubled,))
            call_memo.vouch()
        call_memo.settle(layout, ("forward", "ops"), rec, (doubled,))
    hit = call_memo.lookup(layout, ("forward", "ops"))
    q = torch.arange(3.0)
    out, = hit((q,))
    assert torch.equal(out, 2 * q) and seen[-1][0] is out
    call_memo.clear(layout)


def test_replays_are_kept_per_signature(logged):
    """Other strides (the (B, L, H, D) memory layout) are another signature: the host path runs
    and passes their strides; the replay of the first signature keeps its own."""
    mask = bsfa.causal()
    layout = bsfa.compile_mask(mask, L, L, 128)
    for _ in range(3):
        _call(mask, logged)
    q = torch.randn(1, L, 4, 128, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(1, L, 2, 128, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    del logged[:]
    bsfa.attention(q, k, v, mask=mask, backend="triton")
    (fn, _, args), = logged
    assert args[0] is q and args[9:12] == q.stride()[:3]
    fwd = [k for k in layout.cache["call_memo"] if k[0] == "forward"]
    assert len(fwd) == 2
    assert sum(isinstance(layout.cache["call_memo"][k], call_memo.Replay) for k in fwd) == 1
    call_memo.clear(layout)


def test_one_tensor_passed_as_q_k_and_v_is_its_own_signature(logged):
    """``attention(x, x, x)`` records one object in three places; a later call with three tensors of
    the same shapes must not replay it (each launch would read one of them three times)."""
    mask = bsfa.causal()
    layout = bsfa.compile_mask(mask, L, L, 128)
    x = torch.randn(1, 4, L, 128, dtype=torch.bfloat16)
    for _ in range(3):
        bsfa.attention(x, x, x, mask=mask, backend="triton")
    q, k, v = (torch.randn(1, 4, L, 128, dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        del logged[:]
        bsfa.attention(q, k, v, mask=mask, backend="triton")
        (fn, _, args), = logged
        assert args[0] is q and args[1] is k and args[2] is v
    memo = layout.cache["call_memo"]
    assert sum(isinstance(e, call_memo.Replay) for key, e in memo.items() if key[0] == "forward") == 2
    call_memo.clear(layout)


def test_calls_a_replay_would_not_repeat_are_not_replayed(logged):
    """A logsumexp gradient (an in-place change of the backward's row term) takes the host path
    every time; so does ``replay=False``."""
    mask = bsfa.causal()
    layout = bsfa.compile_mask(mask, L, L, 128)
    for _ in range(3):
        _call(mask, logged, lse_grad=True)
    memo = layout.cache["call_memo"]
    assert not [k for k in memo if k[0] == "backward"]  # not tried
    assert any(isinstance(v, call_memo.Replay) for k, v in memo.items() if k[0] == "forward")
    call_memo.clear(layout)
    for _ in range(3):
        _call(mask, logged, opts=dict(replay=False))
    assert "call_memo" not in layout.cache


def test_a_replay_copies_a_strided_do_again(logged):
    """A ``dO`` whose last dim is not contiguous (columns memory, or the broadcast gradient of
    ``out.sum()``) is copied once per call: the copy is recorded, and a replay copies the new call's
    ``dO`` and launches the kernels on that copy."""
    mask = bsfa.causal()
    layout = bsfa.compile_mask(mask, L, L, 128)
    off = dict(replay=False)
    ref, ref2 = _call(mask, logged, opts=off, do_columns=True), _call(mask, logged, opts=off, do_columns=True)
    for _ in range(2):
        _call(mask, logged, do_columns=True)
    got = _call(mask, logged, do_columns=True)
    memo = layout.cache["call_memo"]
    assert all(isinstance(v, call_memo.Replay) for v in memo.values()) and len(memo) == 2
    launches, named = got[0], got[3]
    do = named["do"]
    read_do = [a for _, _, args in launches for a in args
               if isinstance(a, torch.Tensor) and a.shape == do.shape and a.is_contiguous() and torch.equal(a, do)]
    assert read_do and all(a is not do for a in read_do)  # a fresh copy of this call's dO
    _same_launches(ref[:2], ref2[:2], got[:2])
    call_memo.clear(layout)
    # the forward's copies of q, k, v in columns memory likewise
    for _ in range(4):
        q, k, v = (torch.randn(1, h, 128, L, dtype=torch.bfloat16).transpose(2, 3) for h in (4, 2, 2))
        del logged[:]
        out = bsfa.attention(q, k, v, mask=layout, backend="triton")
    assert [type(v) for v in layout.cache["call_memo"].values()] == [call_memo.Replay]
    read_q = [a for _, _, args in logged for a in args if isinstance(a, torch.Tensor) and a.shape == q.shape
              and a.is_contiguous() and torch.equal(a, q)]
    assert read_q and out.shape == q.shape
    call_memo.clear(layout)


def test_a_recording_without_launches_is_not_replayed(monkeypatch):
    """A kernel path that vouched but launched nothing through a recorded launcher (a test double,
    a path that computes elsewhere) is never replayed: a replay would only allocate."""
    layout = bsfa.compile_mask(bsfa.causal(), 256, 256, 128)
    q = torch.zeros(1, 1, 256, 64)
    for _ in range(2):
        with call_memo.recording((q,)) as rec:
            out = call_memo.empty(q.shape, q.dtype, q.device)
            call_memo.vouch()
        call_memo.settle(layout, ("forward", 0), rec, (out,))
    assert call_memo.lookup(layout, ("forward", 0)).reason == "no recorded launch"


def test_two_recordings_that_differ_are_not_replayed():
    """A tensor argument that is neither an input nor an allocation must be the same object in two
    consecutive recordings (a table cached on the layout); one made per call makes the signature
    refused after ``_MAX_RECORDINGS`` recordings, naming the launch."""
    layout = bsfa.compile_mask(bsfa.causal(), 256, 256, 128)

    def kernel():
        pass

    class FakeLaunch:
        fn = kernel

    table, launch = torch.zeros(4), FakeLaunch()
    for per_call in (False, True):
        key = ("forward", "per call" if per_call else "cached")
        for i in range(call_memo._MAX_RECORDINGS if per_call else 2):
            assert call_memo.lookup(layout, key) is None, i  # still recording
            q = torch.zeros(1, 1, 256, 64)
            with call_memo.recording((q,)) as rec:
                out = call_memo.empty(q.shape, q.dtype, q.device)
                call_memo.note_launch(launch, (2,), (q, out, torch.zeros(4) if per_call else table, 7))
                call_memo.vouch()
            call_memo.settle(layout, key, rec, (out,))
        hit = call_memo.lookup(layout, key)
        if per_call:
            assert hit.reason == "consecutive recordings differ: event 1 (kernel), field 3", hit
        else:
            assert isinstance(hit, call_memo.Replay)
            q = torch.ones(1, 1, 256, 64)
            seen = []
            FakeLaunch.__call__ = lambda self, grid, *args: seen.append((grid, args))
            out, = hit((q,))
            (grid, args), = seen
            assert grid == (2,) and args[0] is q and args[1] is out and args[2] is table and args[3] == 7
            assert out.shape == q.shape and out is not q
    call_memo.clear(layout)
