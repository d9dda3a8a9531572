"""Where a context-parallel fwd+bwd spends its time, and what it moves besides attention.

Two modes:

``gpu`` (torchrun, NCCL): torch.profiler on every rank, one table per rank (kernels, NCCL, copies),
so that the part of ``TP - T1 / P`` that is glue can be told apart from communication and waiting::

    torchrun --nproc-per-node 4 benchmarks/experiments/cp_profile.py gpu --patterns longformer --n 262144

``glue`` (CPU, gloo, no GPU): every rank's operators other than the attention kernels (which are
replaced by stubs returning empty outputs of the right shapes), counted per call with a
``TorchDispatchMode``: copies, gathers, concatenations, conversions, adds and the bytes each writes,
plus the messages (collectives, point-to-point) and their bytes. Shapes are the real ones (bf16, 8
query / 2 key-value heads, head dim 128); the counts do not depend on the kernels' speed::

    PYTHONPATH=. python benchmarks/experiments/cp_profile.py glue --world 4 --n 65536 --json /tmp/glue.json

Run it with ``PYTHONPATH`` pointing at another checkout to count that version's glue (the script
uses the public API and ``ops.dispatch`` only).

``train`` (torchrun, NCCL): the ``cp`` training mode of ``benchmarks/train/cp.py`` with each listed
backward choice (``kernel_options=dict(backward=...)``): every step's time and plan time, rank 0's
host profile (cProfile, top functions) and every rank's device time by kernel over the run::

    torchrun --nproc-per-node 4 benchmarks/experiments/cp_profile.py train --family documents --backward auto gluon

``timeline`` (torchrun, NCCL): every rank's kernels over back-to-back fwd+bwd calls, eager and
replayed from a CUDA graph, aligned across ranks by the end of an all-reduce before them; rank 0
prints one call per rank (merged runs of kernels, idle gaps) to tell who waits for whom::

    torchrun --nproc-per-node 4 benchmarks/experiments/cp_profile.py timeline --patterns longformer --json t.json

``gpu --cprofile N`` adds rank 0's cProfile of the context-parallel calls (top ``N`` functions),
``gpu --ops N`` rank 0's host operators and launches (torch.profiler, top ``N`` by own time) for
one GPU and for ``P``, ``gpu --trace DIR`` a CPU + CUDA timeline per rank; ``glue --cprofile N``
rank 0's cProfile with the kernels stubbed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from context_parallel import HEAD_DIM, HEADS, KV_HEADS, _qkv, lead_masks, make_mask  # noqa: E402

from blocksparse_fa.distributed import context_parallel_attention, plan_context_parallel  # noqa: E402

# operators that move no data (views, metadata) or only allocate
_FREE = {"view", "_unsafe_view", "permute", "slice", "select", "unsqueeze", "squeeze", "transpose", "t", "expand",
         "as_strided", "alias", "detach", "empty", "empty_like", "new_empty", "empty_strided", "movedim", "reshape",
         "split", "split_with_sizes", "unbind", "narrow", "lift_fresh", "_to_copy_noop", "is_nonzero", "item",
         "_local_scalar_dense", "resolve_conj", "resolve_neg", "set_", "result_type", "size", "stride",
         "sym_size", "sym_stride", "sym_numel", "dim", "equal"}
# in-place operators whose written bytes are their source operand's (argument index), not the whole target
_SRC_ARG = {"copy_": 1, "index_add_": 3, "index_copy_": 3, "index_put_": 2}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class GlueCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts operators and the bytes they write (outputs, or the source of an in-place copy/add)."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.ops = defaultdict(lambda: [0, 0])
        self.paused = False
        self.sites = defaultdict(lambda: [0, 0]) if sites else None  # (op, library line) -> count, bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        name = func.__name__.split(".")[0]
        if name in _FREE:
            return out
        if name in _SRC_ARG and len(args) > _SRC_ARG[name]:
            b = _nbytes(args[_SRC_ARG[name]])
        else:
            b = _nbytes(out)
        rec = self.ops[name]
        rec[0] += 1
        rec[1] += b
        if self.sites is not None:  # the innermost library frame that issued it
            import traceback

            frames = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}blocksparse_fa{os.sep}" in f.filename]
            where = (f"{frames[-1].filename.split(os.sep + 'blocksparse_fa' + os.sep)[-1]}:{frames[-1].lineno}"
                     if frames else "?")
            site = self.sites[(name, where)]
            site[0] += 1
            site[1] += b
        return out


class Messages:
    """Wraps the collectives and point-to-point calls: count and bytes sent per call."""

    NAMES = ("all_to_all_single", "all_gather", "all_reduce", "batch_isend_irecv", "all_gather_into_tensor",
             "broadcast")

    def __init__(self):
        self.calls = defaultdict(lambda: [0, 0])
        self.saved = {}

    def __enter__(self):
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrap(*a, _fn=fn, _name=name, **kw):
                if _name == "batch_isend_irecv":
                    sent = sum(_nbytes(op.tensor) for op in a[0] if op.op in (dist.isend,))
                elif _name == "all_to_all_single":
                    sent = _nbytes(a[1])
                else:
                    sent = _nbytes(a[1] if _name in ("all_gather",) else a[0])
                rec = self.calls[_name]
                rec[0] += 1
                rec[1] += sent
                return _fn(*a, **kw)
            setattr(dist, name, wrap)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _stub_kernels(counter: GlueCounter):
    """Replace the attention launches by empty outputs of the right shapes and dtypes (not counted)."""
    from blocksparse_fa.ops import dispatch

    def fwd(q, k, v, layout, s, *a, out_dtype=None, **kw):
        counter.paused = True
        try:
            out = torch.empty((*q.shape[:3], v.shape[-1]), dtype=out_dtype or q.dtype)
            lse = torch.zeros(q.shape[:3], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
            return out, lse
        finally:
            counter.paused = False

    def bwd(q, k, v, out, lse, dout, layout, s, *a, grad_dtype=None, **kw):
        counter.paused = True
        try:
            gd = tuple(grad_dtype) if isinstance(grad_dtype, (tuple, list)) else (grad_dtype,) * 3
            return tuple(torch.zeros(t.shape, dtype=d or t.dtype) for t, d in zip((q, k, v), gd))
        finally:
            counter.paused = False

    dispatch.forward, dispatch.backward = fwd, bwd
    try:  # the fused merge of the GPU path counts as one pass (read both parts, write one)
        from blocksparse_fa.distributed import attention as att

        if hasattr(att, "_merge"):
            def merge(o1, l1, o2, l2, backend, rows=None):
                rec = counter.ops["fused_merge(gpu)"]
                rec[0] += 1
                rec[1] += _nbytes(o1) + _nbytes(l1)
                return o1, l1
            att._merge = merge
    except ImportError:
        pass


def _glue_worker(rank, world, args, store_path, q):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    counter = GlueCounter(sites=args.sites)
    _stub_kernels(counter)
    rows = []
    masks = lead_masks(args.n)
    for name in args.patterns:
        plan = plan_context_parallel(masks[name], args.n, world, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM,
                                     strategy=args.strategy.get(name, "auto"))
        idx = plan.indices(rank)
        L = len(idx)
        g = torch.Generator().manual_seed(rank)
        mk = lambda h: torch.randn(1, h, L, HEAD_DIM, generator=g).to(torch.bfloat16)  # noqa: E731
        ql, kl, vl, dl = mk(HEADS), mk(KV_HEADS), mk(KV_HEADS), mk(HEADS)
        for phase in ("fwd", "fwd+bwd"):
            qg, kg, vg = (t.clone().requires_grad_(phase != "fwd") for t in (ql, kl, vl))

            def call():
                if phase == "fwd":
                    with torch.no_grad():
                        context_parallel_attention(qg, kg, vg, plan=plan, check=False)
                else:
                    context_parallel_attention(qg, kg, vg, plan=plan, check=False).backward(dl)
            call()  # the first call builds the plan's tables
            for t in (qg, kg, vg):
                t.grad = None
            counter.ops.clear()
            if counter.sites is not None:
                counter.sites.clear()
            msgs = Messages()
            dist.barrier()
            t0 = time.perf_counter()
            with msgs, counter:
                call()
            host = time.perf_counter() - t0
            if args.cprofile and phase == "fwd+bwd":  # every rank calls (collectives), rank 0 prints
                text = _host_profile(call, 10, args.cprofile)
                if rank == 0:
                    print(f"--- cProfile {name} {phase}, 10 calls (kernels stubbed)\n{text}", flush=True)
            ops = {k: tuple(v) for k, v in sorted(counter.ops.items())}
            extra = {}
            if counter.sites is not None:
                extra["sites"] = {f"{op} {where}": tuple(v) for (op, where), v in
                                  sorted(counter.sites.items(), key=lambda kv: -kv[1][1])}
            rows.append(dict(extra, rank=rank, pattern=name, phase=phase, strategy=plan.strategy, tokens=L,
                             n_ops=sum(v[0] for v in ops.values()), bytes=sum(v[1] for v in ops.values()),
                             ops=ops, messages={k: tuple(v) for k, v in msgs.calls.items()},
                             n_messages_calls=sum(v[0] for v in msgs.calls.values()),
                             message_bytes=sum(v[1] for v in msgs.calls.values()), host_s=host))
    q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def cmd_glue(args):
    import multiprocessing
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    procs = [ctx.Process(target=_glue_worker, args=(r, args.world, args, store, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = []
    for _ in procs:
        rows += q.get(timeout=args.timeout)
    for p in procs:
        p.join(timeout=30)
    print(f"| pattern | phase | strategy | ops (max rank) | MB written by glue (max rank) | message calls | MB sent "
          f"(max rank) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.patterns:
        for phase in ("fwd", "fwd+bwd"):
            rs = [r for r in rows if r["pattern"] == name and r["phase"] == phase]
            top = max(rs, key=lambda r: r["bytes"])
            print(f"| {name} | {phase} | {top['strategy']} | {max(r['n_ops'] for r in rs)} | "
                  f"{max(r['bytes'] for r in rs) / 1e6:.1f} | {max(r['n_messages_calls'] for r in rs)} | "
                  f"{max(r['message_bytes'] for r in rs) / 1e6:.1f} |")
    if args.verbose:
        for r in sorted(rows, key=lambda r: (r["pattern"], r["phase"], r["rank"])):
            print(r["pattern"], r["phase"], "rank", r["rank"], {k: (v[0], round(v[1] / 1e6, 2)) for k, v in
                                                               r["ops"].items()}, r["messages"])
            for site, (n_calls, b) in r.get("sites", {}).items():
                print(f"    {site}: {n_calls} calls, {b / 1e6:.2f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(world=args.world, n=args.n, rows=rows), f, indent=1)


def _classify(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if "attn" in n or "gluon" in n or "interval" in n or "merge_residue" in n:
        return "attention"
    if "memcpy" in n or "memset" in n:
        return "memcpy"
    return "other"


def _device_times(prof, steps: int) -> dict:
    """Per step: ms of device time by class (attention kernels, NCCL, copies, other), and the top
    kernels by name."""
    tot = defaultdict(float)
    names = defaultdict(float)
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if not t:
            continue
        tot[_classify(ev.key)] += t / 1e3 / steps
        names[ev.key[:70]] += t / 1e3 / steps
    top = sorted(names.items(), key=lambda x: -x[1])[:12]
    return dict(by_class={k: round(v, 3) for k, v in tot.items()}, top=[(k, round(v, 3)) for k, v in top])


def _init():
    """``(cuda, rank, world, device)`` of a ``torchrun`` process (NCCL on GPUs; without a GPU, gloo:
    a check of the script at small sizes)."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    if cuda:
        torch.cuda.set_device(local)
    return cuda, rank, world, torch.device("cuda", local) if cuda else torch.device("cpu")


def _timed(fn, iters: int, warmup: int, sync) -> tuple:
    """``(wall s per call, median host s to issue one call)`` of ``iters`` calls after ``warmup``
    and a barrier (every rank calls: collectives inside)."""
    for _ in range(warmup):
        fn()
    sync()
    dist.barrier()
    host = []
    w0 = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    sync()
    return (time.perf_counter() - w0) / iters, sorted(host)[len(host) // 2]


def cmd_gpu(args):
    """Per pattern and phase (fwd, fwd+bwd): one GPU against P (CUDA events), the host's time to
    issue a call, each rank's device time by class (profiler) and the kernels the launches chose."""
    import blocksparse_fa as bsfa
    from blocksparse_fa.ops import select

    cuda, rank, world, dev = _init()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    results = []
    kopts = None if args.backward == "auto" else dict(backward=args.backward)
    for pattern in args.patterns:
        mask = lead_masks(args.n)[pattern]
        plan = plan_context_parallel(mask, args.n, world, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM,
                                     block_size=128)
        q, k, v, do = _qkv(args.n, dev, dtype)
        lay = plan.device_layout(dev)
        idx = plan.indices(rank, dev)
        ql, kl, vl, dl = (t[:, :, idx].contiguous() for t in (q, k, v, do))
        qg, kg, vg = (t.clone().requires_grad_() for t in (ql, kl, vl))
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))

        def calls(phase):
            def cp():
                if phase == "fwd":
                    with torch.no_grad():
                        context_parallel_attention(ql, kl, vl, plan=plan, check=False, overlap=args.overlap,
                                                   kernel_options=kopts)
                else:
                    for t in (qg, kg, vg):
                        t.grad = None
                    context_parallel_attention(qg, kg, vg, plan=plan, check=False, overlap=args.overlap,
                                               kernel_options=kopts).backward(dl)

            def one():
                if phase == "fwd":
                    with torch.no_grad():
                        bsfa.attention(q, k, v, mask=lay)
                else:
                    for t in (qa, ka, va):
                        t.grad = None
                    bsfa.attention(qa, ka, va, mask=lay).backward(do)
            return cp, one

        for phase in ("fwd", "fwd+bwd"):
            cp, one = calls(phase)
            row = dict(rank=rank, pattern=pattern, phase=phase, strategy=plan.strategy,
                       overlap=plan.overlap_auto if args.overlap == "auto" else args.overlap)
            for label, fn, collective in (("T1", one, False), ("TP", cp, True)):
                with select.record() as ran:
                    fn()
                row[f"{label}_kernels"] = sorted(set(f"{a}:{b}" for a, b in ran))
                wall, host = _timed(fn, args.iters, 2, sync)
                row[f"{label}_ms"] = wall * 1e3
                row[f"{label}_host_ms"] = host * 1e3
                dist.barrier()
                if cuda:
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(3):
                            fn()
                        sync()
                    row[f"{label}_device"] = _device_times(prof, 3)
                if args.trace and collective and cuda and phase == "fwd+bwd":  # a timeline per rank
                    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                    with torch.profiler.profile(activities=acts) as prof:
                        for _ in range(3):
                            fn()
                        sync()
                    os.makedirs(args.trace, exist_ok=True)
                    prof.export_chrome_trace(os.path.join(args.trace, f"{pattern}_rank{rank}.json"))
                if args.ops and cuda and phase == "fwd+bwd":  # host operators and launches
                    acts = [torch.profiler.ProfilerActivity.CPU]
                    with torch.profiler.profile(activities=acts) as prof:
                        for _ in range(args.iters):
                            fn()
                        sync()
                    if rank == 0:
                        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops)
                        print(f"--- host operators {pattern} {phase} {label}, {args.iters} calls\n{table}", flush=True)
                if args.cprofile and collective:  # every rank calls (collectives), rank 0 prints
                    text = _host_profile(fn, args.iters, args.cprofile)
                    sync()
                    if rank == 0:
                        print(f"--- cProfile {pattern} {phase} TP, {args.iters} calls\n{text}", flush=True)
                dist.barrier()
            t = torch.tensor([row["TP_ms"]], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            row["TP_max_ms"] = t.item()
            row["eff"] = row["T1_ms"] / (world * row["TP_max_ms"])
            results.append(row)
            if rank == 0:
                print(f"{pattern} {phase}: T1 {row['T1_ms']:.2f} ms, TP {row['TP_max_ms']:.2f} ms, eff "
                      f"{row['eff']:.2f}", flush=True)
        del q, k, v, do, qa, ka, va, qg, kg, vg
        if cuda:
            torch.cuda.empty_cache()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        rows = [r for g in gathered for r in g]
        for r in sorted(rows, key=lambda r: (args.patterns.index(r["pattern"]), r["phase"], r["rank"])):
            print(json.dumps(r, default=str))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(world=world, n=args.n, rows=rows), f, indent=1, default=str)
    dist.destroy_process_group()


def _host_profile(fn, calls: int, top: int) -> str:
    """cProfile of ``calls`` calls of ``fn``: the ``top`` functions by own time, then by cumulative time."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(pr, stream=out).sort_stats(key).print_stats(top)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def cmd_train(args):
    """The ``cp`` training mode with each backward choice: per-step times, rank 0's host profile and
    every rank's device time by kernel."""
    import statistics

    from train.cp import SUITE_CONFIG, train_cp
    from train.data import TrainStream, load_corpus, probe_spec
    from train.runner import RunConfig
    from train.variants import Patterns

    cuda, rank, world, dev = _init()
    pats = Patterns()
    rows = []
    for backward in args.backward:
        cfg = RunConfig(**dict(SUITE_CONFIG, device=str(dev), seq_len=args.n, steps=args.steps))
        corpus = load_corpus(None, cfg.held_out_permille)
        stream = TrainStream(corpus, cfg.seq_len, cfg.batch, probe_spec(cfg.seq_len, cfg.probe_pairs, cfg.reach(pats),
                                                                       cfg.probe_rounds),
                             cfg.probe_rate, cfg.probe_weight, seed=cfg.seed + 1)
        kw = dict(kernel_options=dict(backward=backward))
        dist.barrier()
        acts = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts) as prof:
            if rank == 0:
                import cProfile
                import io
                import pstats

                pr = cProfile.Profile()
                pr.enable()
            res = train_cp(cfg, pats, args.family, stream, dist.group.WORLD, cp_kw=kw)
            if rank == 0:
                pr.disable()
        row = dict(rank=rank, backward=backward, step_ms=[round(t * 1e3, 1) for t in res.step_s],
                   plan_ms=[round(t * 1e3, 1) for t in res.plan_s], device=_device_times(prof, cfg.run_steps))
        row["median_ms"] = statistics.median(res.step_s[cfg.sync_steps:] or res.step_s) * 1e3
        rows.append(row)
        if rank == 0:
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(args.top)
            print(f"--- {args.family} backward={backward}: steps ms {row['step_ms']}, plan ms {row['plan_ms']}\n"
                  + "\n".join(line for line in out.getvalue().splitlines() if line.strip()), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        for r in sorted((r for g in gathered for r in g), key=lambda r: (r["backward"], r["rank"])):
            print(json.dumps(r, default=str), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(world=world, n=args.n, family=args.family, rows=[r for g in gathered for r in g]),
                          f, indent=1, default=str)
    dist.destroy_process_group()


def cmd_p2p(args):
    """Host and wall time of one message step between ring neighbours (``comm.exchange``: NCCL
    grouped sends and receives) against ``all_to_all_single`` moving the same bytes, per size."""
    from blocksparse_fa.distributed.comm import all_to_all, exchange

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    ranks = list(range(world))
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for mb in args.sizes:
        n = int(mb * 2**20) // 2
        a, b = torch.randn(n, device=dev).to(torch.bfloat16), torch.randn(n, device=dev).to(torch.bfloat16)
        ra, rb = torch.empty_like(a), torch.empty_like(b)
        splits = [n if p in (nxt, prv) else 0 for p in range(world)]
        if nxt == prv:
            splits[nxt] = 2 * n
        x = torch.randn(sum(splits), device=dev).to(torch.bfloat16)

        def p2p():
            exchange([(nxt, a, 1), (prv, b, 2)], [(prv, ra, 1), (nxt, rb, 2)], dist.group.WORLD, ranks,
                     async_op=True).wait()

        def a2a():
            all_to_all(x, splits, splits, dist.group.WORLD, async_op=True).wait()

        for name, fn in (("p2p", p2p), ("a2a", a2a)):
            wall, host = _timed(fn, args.iters, 5, torch.cuda.synchronize)
            if rank == 0:
                print(f"{name} {mb:g} MB per neighbour: host {1e6 * host:.0f} us per step, wall {1e6 * wall:.0f} us",
                      flush=True)
    dist.destroy_process_group()


def _short(name: str) -> str:
    """A kernel's name without templates and arguments."""
    n = name.split("(")[0] if not name.startswith("void ") else name[5:].split("(")[0]
    n = re.sub(r"<.*", "", n)
    return n.split("::")[-1][:48]


def _kernel_list(prof, path: str) -> list:
    """``[(name, start us, duration us, stream)]`` of a profile's device activities, from its chrome
    trace (``path`` is overwritten), starts relative to the end of the first NCCL kernel (the anchor
    all-reduce: it ends on every rank at about the same moment)."""
    prof.export_chrome_trace(path)
    with open(path) as f:
        evs = json.load(f)["traceEvents"]
    ks = sorted(((e["name"], float(e["ts"]), float(e.get("dur", 0)), e.get("args", {}).get("stream"))
                 for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda x: x[1])
    anchor = next(i for i, k in enumerate(ks) if "nccl" in k[0].lower())
    t0 = ks[anchor][1] + ks[anchor][2]
    return [(_short(n), round(ts - t0, 2), round(d, 2), st) for n, ts, d, st in ks[anchor + 1:]]


def _timeline_text(per_rank: list, calls: int, which: int) -> str:
    """Call ``which`` of ``calls`` on every rank: merged runs of kernels (same name, gaps < 3 us),
    idle gaps >= 15 us, and per rank the call's span, busy time and NCCL time (us)."""
    lines = []
    spans = []
    for r, ks in enumerate(per_rank):
        if len(ks) % calls:
            lines.append(f"rank {r}: {len(ks)} activities, not {calls} equal calls")
            spans.append(None)
            continue
        m = len(ks) // calls
        spans.append(ks[which * m:(which + 1) * m])
    base = min(c[0][1] for c in spans if c)
    for r, c in enumerate(spans):
        if not c:
            continue
        end = max(s + d for _, s, d, _ in c)
        busy, cur_s, cur_e = 0.0, None, None
        for _, s, d, _ in c:  # union of intervals
            if cur_e is None or s > cur_e:
                busy += 0 if cur_e is None else cur_e - cur_s
                cur_s, cur_e = s, s + d
            else:
                cur_e = max(cur_e, s + d)
        busy += cur_e - cur_s
        nccl = sum(d for n, _, d, _ in c if "nccl" in n.lower())
        lines.append(f"rank {r}: start {c[0][1] - base:8.1f}  span {end - c[0][1]:8.1f}  busy {busy:8.1f}  "
                     f"nccl {nccl:7.1f}")
        runs = []
        for n, s, d, st in c:
            if runs and runs[-1][0] == n and s - runs[-1][2] < 3:
                runs[-1][2] = max(runs[-1][2], s + d)
                runs[-1][3] += 1
            else:
                runs.append([n, s, s + d, 1, st])
        prev = None
        for n, s, e, cnt, st in runs:
            if prev is not None and s - prev >= 15:
                lines.append(f"      {'':>8} idle {s - prev:7.1f}")
            lines.append(f"      {s - base:8.1f} {e - s:7.1f}  {n}{' x%d' % cnt if cnt > 1 else ''}  [s{st}]")
            prev = e if prev is None else max(prev, e)
    return "\n".join(lines)


def cmd_timeline(args):
    """Every rank's device activities over ``--calls`` back-to-back fwd+bwd calls (eager, then the
    call replayed as a CUDA graph), aligned across ranks by an all-reduce that precedes them: who
    waits for whom, and where the GPUs idle."""
    import tempfile

    from cp_graphs import _graph

    cuda, rank, world, dev = _init()
    assert cuda, "timeline needs GPUs"
    out = dict(world=world, n=args.n, patterns={})
    for pattern in args.patterns:
        mask = lead_masks(args.n)[pattern]
        plan = plan_context_parallel(mask, args.n, world, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM,
                                     block_size=128)
        q, k, v, do = _qkv(args.n, dev, torch.bfloat16)
        idx = plan.indices(rank, dev)
        ql, kl, vl, dl = (t[:, :, idx].contiguous() for t in (q, k, v, do))
        qg, kg, vg = (t.clone().requires_grad_() for t in (ql, kl, vl))
        del q, k, v, do

        def fb():
            for t in (qg, kg, vg):
                t.grad = None
            o = context_parallel_attention(qg, kg, vg, plan=plan, check=False)
            o.backward(dl)
            return o

        modes = [("eager", fb)]
        if not args.no_graph:
            modes.append(("graph", _graph(fb, []).replay))
        anchor = torch.zeros(1, device=dev)
        res = {}
        for mode, fn in modes:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                dist.all_reduce(anchor)
                for _ in range(args.calls):
                    fn()
                torch.cuda.synchronize()
            with tempfile.TemporaryDirectory() as d:
                ks = _kernel_list(prof, os.path.join(d, "t.json"))
            gathered = [None] * world
            dist.all_gather_object(gathered, ks)
            res[mode] = gathered
            if rank == 0:
                print(f"=== {pattern} {mode} ({plan.strategy}), call {args.calls // 2} of {args.calls}, us\n"
                      + _timeline_text(gathered, args.calls, args.calls // 2), flush=True)
        out["patterns"][pattern] = res
        del modes, fn  # the captured graph holds NCCL work: freed before the next pattern and the exit
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def cmd_check(args):
    """Context parallel against one GPU (bf16, relative L2 of out, dq, dk, dv) with the default
    kernels and with ``kernel_options=dict(backward="triton")``: the default passes where its
    distance to one GPU is at most twice the Triton backward's (plus 1e-3). Prints one line per
    pattern and, on rank 0, writes ``PASS``/``FAIL`` to ``--flag``."""
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    import blocksparse_fa as bsfa

    ok = True
    for pattern in args.patterns:
        mask = lead_masks(args.n)[pattern]
        plan = plan_context_parallel(mask, args.n, world, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM, block_size=128)
        q, k, v, do = _qkv(args.n, dev, torch.bfloat16)
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
        ref = bsfa.attention(qa, ka, va, mask=plan.device_layout(dev))
        ref.backward(do)
        idx = plan.indices(rank, dev)
        single = [ref.detach()[:, :, idx], qa.grad[:, :, idx], ka.grad[:, :, idx], va.grad[:, :, idx]]
        errs = {}
        for label, opts in (("default", None), ("triton", dict(backward="triton"))):
            for o in (False, True):
                ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
                out = context_parallel_attention(ql, kl, vl, plan=plan, overlap=o, kernel_options=opts)
                out.backward(do[:, :, idx])
                row = []
                for a, b in zip((out.detach(), ql.grad, kl.grad, vl.grad), single):
                    t = torch.tensor([(a.double() - b.double()).pow(2).sum().item(), b.double().pow(2).sum().item()],
                                     device=dev, dtype=torch.float64)
                    dist.all_reduce(t)
                    row.append((t[0] / t[1].clamp_min(1e-300)).sqrt().item())
                errs[(label, o)] = row
        for o in (False, True):
            good = all(d <= 2 * t + 1e-3 for d, t in zip(errs[("default", o)], errs[("triton", o)]))
            ok &= good
            if rank == 0:
                print(f"check {pattern} overlap={o}: default {['%.2e' % x for x in errs[('default', o)]]} "
                      f"triton-bwd {['%.2e' % x for x in errs[('triton', o)]]} {'PASS' if good else 'FAIL'}",
                      flush=True)
        del q, k, v, do, qa, ka, va, ref, single
        torch.cuda.empty_cache()
    if rank == 0 and args.flag:
        with open(args.flag, "w") as f:
            f.write("PASS\n" if ok else "FAIL\n")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gpu", help="torch.profiler tables per rank (torchrun, NCCL)")
    g.add_argument("--patterns", nargs="+", default=["sliding_window", "longformer", "bigbird", "documents"])
    g.add_argument("--tokens", "--n", dest="n", type=int, default=262144)
    g.add_argument("--iters", type=int, default=5)
    g.add_argument("--overlap", default="auto", type=lambda x: x if x == "auto" else x == "true",
                   help="auto (the plan's choice), true or false")
    g.add_argument("--json", default=None)
    g.add_argument("--backward", default="auto", help="kernel_options backward= of the context-parallel calls")
    g.add_argument("--trace", default=None, help="folder for each rank's chrome trace (CPU + CUDA) of 3 fwd+bwd calls")
    g.add_argument("--cprofile", type=int, default=0, help="rank 0's cProfile of the CP calls: top N functions")
    g.add_argument("--ops", type=int, default=0, help="rank 0's host operators and launches (torch.profiler, CPU) "
                                                      "of the fwd+bwd CP calls: top N by own time")
    g.set_defaults(fn=cmd_gpu)
    t = sub.add_parser("train", help="the cp training mode per backward choice: step times, host and device profile")
    t.add_argument("--family", default="documents")
    t.add_argument("--backward", nargs="+", default=["auto", "gluon"])
    t.add_argument("--tokens", "--n", dest="n", type=int, default=262144)
    t.add_argument("--steps", type=int, default=5)
    t.add_argument("--top", type=int, default=30)
    t.add_argument("--json", default=None)
    t.set_defaults(fn=cmd_train)
    m = sub.add_parser("p2p", help="host and wall time of a neighbour message step: grouped P2P vs all_to_all")
    m.add_argument("--sizes", type=float, nargs="+", default=[0.0625, 1, 8])
    m.add_argument("--iters", type=int, default=50)
    m.set_defaults(fn=cmd_p2p)
    tl = sub.add_parser("timeline", help="every rank's kernels over back-to-back fwd+bwd calls, aligned across ranks")
    tl.add_argument("--patterns", nargs="+", default=["longformer", "bigbird"])
    tl.add_argument("--tokens", "--n", dest="n", type=int, default=262144)
    tl.add_argument("--calls", type=int, default=4)
    tl.add_argument("--no-graph", action="store_true")
    tl.add_argument("--json", default=None)
    tl.set_defaults(fn=cmd_timeline)
    k = sub.add_parser("check", help="context parallel against one GPU, default kernels and the Triton backward")
    k.add_argument("--patterns", nargs="+", default=["sliding_window", "documents"])
    k.add_argument("--tokens", "--n", dest="n", type=int, default=65536)
    k.add_argument("--flag", default=None)
    k.set_defaults(fn=cmd_check)
    c = sub.add_parser("glue", help="operators and bytes besides the kernels, per rank (CPU, gloo)")
    c.add_argument("--world", type=int, default=4)
    c.add_argument("--n", type=int, default=65536)
    c.add_argument("--patterns", nargs="+", default=["causal", "sliding_window", "longformer", "bigbird",
                                                     "documents"])
    c.add_argument("--strategy", nargs="*", default=["causal=zigzag", "sliding_window=contiguous",
                                                     "longformer=contiguous", "bigbird=zigzag", "documents=contiguous"],
                   help="pattern=strategy pairs (default: the planner's choices at 256K on 4 ranks, so that two "
                        "versions of the code are counted on the same plans); others 'auto'")
    c.add_argument("--json", default=None)
    c.add_argument("--verbose", action="store_true")
    c.add_argument("--sites", action="store_true",
                   help="with --verbose: every operator by the library line that issued it (count, MB)")
    c.add_argument("--cprofile", type=int, default=0, help="rank 0's cProfile of 10 fwd+bwd calls: top N functions")
    c.add_argument("--timeout", type=float, default=900)
    c.set_defaults(fn=cmd_glue)
    args = ap.parse_args()
    if args.cmd == "glue":
        args.strategy = dict(x.split("=", 1) for x in args.strategy)
    args.fn(args)


if __name__ == "__main__":
    main()
