"""Worker side of tests/test_distributed.py: runs context-parallel cases in ``world`` processes
(gloo on CPU) and reports per case whether every rank's result equals the single-process run.

Every rank executes the same collectives whatever the outcome of a comparison (comparisons are
recorded, never raised), so one failing case cannot make the others hang; the process group's
timeout turns a desynchronised run into an error.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

GLOO_TIMEOUT = 30


def _inputs(case, N, dtype):
    g = torch.Generator().manual_seed(case.get("seed", 0))
    B, H, Hkv, D = case.get("B", 1), case.get("H", 2), case.get("Hkv", 2), case.get("D", 8)
    Dv = case.get("Dv", D)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(B, H, N, D), mk(B, Hkv, N, D), mk(B, Hkv, N, Dv), mk(B, H, N, Dv)


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def run_case(case, rank, world):
    """``(name, ok, detail)`` on rank 0; every rank runs the same collectives. ``fine_lists``: the
    kernels' lists at a finer block than the layout's (kernel tiles of 16 along every loop, the
    ``lists="fine"`` option; ``compiler/finer.py``), restored afterwards. ``return_dtype``: the
    dtype fetched keys' gradients travel back in (``distributed/attention._RETURN_DTYPE``), restored."""
    if case.get("return_dtype"):
        from blocksparse_fa.distributed import attention as att

        was, att._RETURN_DTYPE = att._RETURN_DTYPE, case["return_dtype"]
        try:
            return _run_case(case, rank, world)
        finally:
            att._RETURN_DTYPE = was
    if not case.get("fine_lists"):
        return _run_case(case, rank, world)
    from blocksparse_fa.ops.options import KernelOptions, TileConfig

    opts = KernelOptions(lists="fine", fwd_tiles=TileConfig(32, 16, 4, 2), dkdv_tiles=TileConfig(16, 32, 4, 2),
                         dq_tiles=TileConfig(32, 16, 4, 2))
    return _run_case(case, rank, world, opts)


def _run_case(case, rank, world, opts=None):
    import blocksparse_fa as bsfa
    from blocksparse_fa.distributed import context_parallel_attention, plan_context_parallel

    N = case["N"]
    dtype = case.get("dtype", torch.float64)
    backend = case.get("backend", "torch")
    q, k, v, do = _inputs(case, N, dtype)
    p = case.get("p", 0.0)
    plan = None
    if case.get("plan", True):
        plan = plan_context_parallel(case["mask"], N, world, block_size=case.get("block", 16),
                                     strategy=case.get("strategy", "auto"), heads=(q.shape[1], k.shape[1]),
                                     head_dim=q.shape[3], dropout=p > 0, split_factor=case.get("split", 4.0))
        idx = plan.indices(rank)
    else:  # contiguous shards of the given lengths
        lengths = case["lengths"]
        start = sum(lengths[:rank])
        idx = torch.arange(start, start + lengths[rank])
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    steps = []  # message steps of the forward, then of the backward
    with _launch_order(case.get("first_event")) as order, _message_steps(steps):
        out, lse = context_parallel_attention(ql, kl, vl, None if plan else case["mask"], plan=plan, dropout_p=p,
                                              dropout_seed=case.get("dropout_seed", 5), return_lse=True,
                                              overlap=case.get("overlap", False), backend=backend,
                                              block_size=None if plan else case.get("block", 16),
                                              kernel_options=opts)
        steps.append("|")
        loss = (out * do[:, :, idx]).sum()
        if case.get("lse_grad"):
            loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * 0.37).sum()
        loss.backward()
    n_steps = (steps.index("|"), len(steps) - steps.index("|") - 1)
    if plan is None:
        lengths = case["lengths"]
        plan = plan_context_parallel(case["mask"], N, world, block_size=case.get("block", 16), shard_lengths=lengths)
    got = [plan.gather(t, 2) for t in (out.detach(), lse.detach().unsqueeze(-1), ql.grad, kl.grad, vl.grad)]
    if rank != 0:
        return None
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    ref, rlse = bsfa.attention(qa, ka, va, mask=plan.layout, dropout_p=p, dropout_seed=case.get("dropout_seed", 5),
                               return_lse=True, backend=backend, rewrite=False)
    rloss = (ref * do).sum()
    if case.get("lse_grad"):
        rloss = rloss + (torch.where(torch.isinf(rlse), 0.0, rlse) * 0.37).sum()
    rloss.backward()
    want = [ref.detach(), rlse.detach().unsqueeze(-1), qa.grad, ka.grad, va.grad]
    tol = case.get("tol", 1e-12)
    errs = []
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        fin = torch.isfinite(b)
        if not torch.equal(torch.isfinite(a), fin):
            errs.append(f"{name}: non-finite entries differ")
            continue
        e = _max_err(a[fin], b[fin]) / max(1.0, b[fin].abs().max().item() if fin.any() else 1.0)
        if e > tol:
            errs.append(f"{name}: {e:.2e} > {tol:.0e}")
    if case.get("steps") and n_steps != case["steps"]:
        errs.append(f"rank 0's message steps (forward, backward) {n_steps}: expected {case['steps']}")
    if case.get("first_event") and order[:1] != [case["first_event"]]:
        errs.append(f"rank 0's forward events {order}: expected {case['first_event']!r} first")
    if case.get("exact_forward") and not torch.equal(got[0], want[0]):
        errs.append("out not bit-identical")
    if case.get("float64_reference"):
        qd, kd, vd = (t.double().clone().requires_grad_() for t in (q, k, v))
        r64 = bsfa.reference_attention(qd, kd, vd, plan.layout.mask)
        e = _max_err(got[0], r64.detach())
        if e > 1e-10:
            errs.append(f"out vs float64 reference: {e:.2e}")
        g64 = torch.autograd.grad((r64 * do.double()).sum(), (qd, kd, vd))
        for name, a, b in zip(("dq", "dk", "dv"), got[2:], g64):
            if _max_err(a, b) > 1e-10:
                errs.append(f"{name} vs float64 reference: {_max_err(a, b):.2e}")
    detail = f"{plan.strategy}, split rows {len(plan.split)}" + ("; " + "; ".join(errs) if errs else "")
    return case["name"], not errs, detail


@contextlib.contextmanager
def _launch_order(active):
    """The forward's events in order (``"wait"``: the fetch completes, ``"launch"``: an attention
    launch), recorded while ``active``."""
    order = []
    if not active:
        yield order
        return
    from blocksparse_fa.distributed import attention as att

    wait0, fwd0 = att._Fetch.wait, att._fwd

    def wait(self):
        if self.pending is not None:
            order.append("wait")
        return wait0(self)

    def fwd(*a, **kw):
        order.append("launch")
        return fwd0(*a, **kw)

    att._Fetch.wait, att._fwd = wait, fwd
    try:
        yield order
    finally:
        att._Fetch.wait, att._fwd = wait0, fwd0


@contextlib.contextmanager
def _message_steps(steps):
    """Each message step of the context-parallel calls (one batch of messages) appended to ``steps``."""
    from blocksparse_fa.distributed import attention as att

    exchange0 = att.exchange

    def exchange(*a, **kw):
        steps.append("step")
        return exchange0(*a, **kw)

    att.exchange = exchange
    try:
        yield steps
    finally:
        att.exchange = exchange0


def run_error(case, rank, world):
    """An inconsistent call: ``(name, ok, detail)`` on every rank (ok: it raised ValueError with the
    expected words)."""
    from blocksparse_fa.distributed import context_parallel_attention, plan_context_parallel

    N = case["N"]
    q, k, v, _ = _inputs(case, N, torch.float64)
    if "lengths" in case:  # contiguous shards without a plan
        lengths = case["lengths"]
        start = sum(lengths[:rank])
        idx = torch.arange(start, start + lengths[rank])
        try:
            context_parallel_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], case["mask"], block_size=16,
                                       check=case.get("check", True))
        except ValueError as e:
            return case["name"], all(w in str(e) for w in case["expect"]), str(e)
        return case["name"], False, "no error raised"
    plan_world = case.get("plan_world", world)
    mask = case["mask"] if rank == 0 or "mask1" not in case else case["mask1"]
    plan = plan_context_parallel(mask, N, plan_world, block_size=16, strategy=case.get("strategy", "auto"))
    idx = plan.indices(min(rank, plan_world - 1))
    cut = case.get("cut", {}).get(rank, 0)
    idx = idx[: len(idx) - cut]
    kidx = idx[: len(idx) - case.get("k_cut", {}).get(rank, 0)]
    try:
        context_parallel_attention(q[:, :, idx], k[:, :, kidx], v[:, :, kidx], plan=plan, check=case.get("check", True))
    except ValueError as e:
        ok = all(w in str(e) for w in case["expect"])
        return case["name"], ok, str(e)
    return case["name"], False, "no error raised"


def run_check_modes(case, rank, world):
    """``check="first"``: one exchange per configuration (the first call; again for a new scale),
    none after; every call with ``check=True`` and with dropout drawing its seed; the same
    results as checking every call. ``(name, ok, detail)`` on rank 0."""
    from blocksparse_fa.distributed import comm, context_parallel_attention, plan_context_parallel

    N = case["N"]
    q, k, v, _ = _inputs(case, N, torch.float64)
    from blocksparse_fa.distributed import api

    plan = plan_context_parallel(case["mask"], N, world, block_size=16, strategy="contiguous")
    idx = plan.indices(rank)
    ql, kl, vl = (t[:, :, idx] for t in (q, k, v))
    calls, gathers = [], []
    real, real_gather = api.check_call, api._gathered_plan

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    def spy_gather(*a, **kw):
        gathers.append(1)
        return real_gather(*a, **kw)

    api.check_call, api._gathered_plan = spy, spy_gather
    try:
        comm._CHECKED.clear()
        counts, outs = [], []
        # the scale's second call, check=True twice, dropout drawing its seed twice, then with a
        # seed (its configuration was checked by the calls before)
        for kw in (dict(), dict(), dict(), dict(scale=0.3), dict(scale=0.3), dict(check=True), dict(check=True),
                   dict(dropout_p=0.2), dict(dropout_p=0.2), dict(dropout_p=0.2, dropout_seed=3),
                   dict(dropout_p=0.2, dropout_seed=3)):
            before = len(calls)
            outs.append(context_parallel_attention(ql, kl, vl, plan=plan, **kw))
            counts.append(len(calls) - before)
        no_plan = []
        for _ in range(3):  # contiguous shards without a plan: the lengths are gathered once
            before = len(gathers)
            outs.append(context_parallel_attention(ql, kl, vl, case["mask"], block_size=16))
            no_plan.append(len(gathers) - before)
    finally:
        api.check_call, api._gathered_plan = real, real_gather
    want = [1, 0, 0, 1, 0, 1, 1, 1, 1, 0, 0]
    ok = counts == want and no_plan == [1, 0, 0]
    ok = ok and all(torch.equal(outs[0], outs[i]) for i in (1, 2, 5, 6, 11, 12, 13))
    return (case["name"], ok, f"exchanges per call {counts} (want {want}); gathers without a plan {no_plan}") \
        if rank == 0 else None


def worker(rank, world, store_path, cases, queue):
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=GLOO_TIMEOUT))
        for case in cases:
            fn = (run_error if case.get("error") else run_compiled if case.get("compiled") else
                  run_check_modes if case.get("check_modes") else
                  run_module if case.get("module") else run_case)
            try:
                res = fn(case, rank, world)
            except Exception:  # recorded; the next case may time out if ranks fell out of step
                res = (case["name"], False, traceback.format_exc(limit=4))
            if res is not None:
                queue.put((rank, *res))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, "<worker>", False, traceback.format_exc(limit=6)))
    queue.put((rank, "<done>", True, ""))


def run_compiled(case, rank, world):
    """``torch.compile(fullgraph=True)`` (aot_eager) of a function calling the op: same values and
    gradients as eager."""
    from blocksparse_fa.distributed import context_parallel_attention, plan_context_parallel

    N = case["N"]
    q, k, v, do = _inputs(case, N, torch.float64)
    plan = plan_context_parallel(case["mask"], N, world, block_size=16, split_factor=case.get("split", 4.0),
                                 strategy=case.get("strategy", "auto"))
    idx = plan.indices(rank)

    def f(q, k, v):
        return context_parallel_attention(q, k, v, plan=plan, overlap=case.get("overlap", False))

    res = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
        out = fn(ql, kl, vl)
        (out * do[:, :, idx]).sum().backward()
        res.append((out.detach(), ql.grad, kl.grad, vl.grad))
    errs = [_max_err(a, b) for a, b in zip(*res)]
    return (case["name"], max(errs) < 1e-12, f"errors {errs}") if rank == 0 else None


def run_module(case, rank, world):
    """``BlockSparseMultiheadAttention(context_parallel=group)`` with rotary embeddings on a
    sharded sequence: the gathered output and the all-reduced parameter gradients equal the
    single-process module's."""
    import blocksparse_fa as bsfa
    from blocksparse_fa.distributed import plan_context_parallel

    N, E = case["N"], 16
    torch.manual_seed(0)
    mods = [bsfa.nn.BlockSparseMultiheadAttention(E, 4, case["mask"], num_kv_heads=2, rotary=True, block_size=16,
                                                  dtype=torch.float64, context_parallel=cp)
            for cp in (None, dist.group.WORLD)]
    mods[1].load_state_dict(mods[0].state_dict())
    x = torch.randn(2, N, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    plan = plan_context_parallel(case["mask"], N, world, block_size=16, heads=(4, 2), head_dim=4,
                                 strategy=case.get("strategy", "auto"))
    y = mods[1](plan.shard(x, 1, rank), cp_plan=plan)
    (y * y).sum().backward()
    for p in mods[1].parameters():
        dist.all_reduce(p.grad)
    got = plan.gather(y.detach(), 1)
    if rank != 0:
        return None
    ref = mods[0](x)
    (ref * ref).sum().backward()
    errs = [_max_err(got, ref.detach())] + [_max_err(a.grad, b.grad) for a, b in zip(mods[1].parameters(),
                                                                                    mods[0].parameters())]
    return case["name"], max(errs) < 1e-10, f"errors {errs}"
