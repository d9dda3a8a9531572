"""Context parallelism on several GPUs: correctness, strong scaling, bytes moved, torch's CP beside ours.

``run`` (under torchrun, one process per GPU) measures, within a time budget (the most important
first; sections that would not fit are skipped and say so; results are written after every step):

1. ``nvidia-smi topo -m`` and the bandwidth of all-gather and all-to-all;
2. correctness: our context-parallel bf16 outputs and gradients against the single-GPU bf16 run on
   the same inputs and both against a float64 reference (8K tokens, every pattern; dropout last);
3. strong scaling at 128K and 256K tokens: single-GPU time ``T1`` and context-parallel time ``TP``
   (slowest rank), efficiency ``T1 / (P * TP)``, forward and forward+backward, per pattern, for the
   planner's choice and for Ulysses around our kernel; bytes sent per rank against a dense ring;
   exposed communication (``TP`` minus the same rank's kernels alone on prefetched buffers);
4. torch's own ``context_parallel`` (SDPA, causal) with the allgather and alltoall rotate methods,
   and SDPA on one GPU;
5. one layer's forward+backward at 1M tokens (8 query / 2 KV heads, d 128) per pattern: time and
   peak memory per GPU.

``report`` prints the Markdown tables of ``docs/distributed.md`` from the JSON; ``plans`` prints
bytes per rank from the plans alone (CPU, any length and world size).

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py run --out $OUT [--budget 330]
    python benchmarks/context_parallel.py report $OUT/context_parallel.json \
        --docs docs/distributed.md --data docs/data/context_parallel.json
    python benchmarks/context_parallel.py plans --lengths 131072 262144 1048576 --world 2 4 8
    torchrun --nproc-per-node 2 benchmarks/context_parallel.py run --device cpu --smoke   # CPU check (gloo)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import blocksparse_fa as bsfa  # noqa: E402
from blocksparse_fa.distributed import context_parallel_attention, plan_context_parallel  # noqa: E402

PATTERNS = ["causal", "sliding_window", "longformer", "bigbird", "documents", "strided"]
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128


def doc_ids(n: int, seed: int = 0, lo: int = 1024, hi: int = 16384) -> torch.Tensor:
    """Packed documents of ``lo``..``hi`` tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < n:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[:n]


def make_mask(name: str, n: int, small: bool = False):
    if name == "causal":
        return bsfa.causal()
    if name == "sliding_window":
        return bsfa.load_pattern("sliding_window", window=256 if small else 4096)
    if name == "longformer":
        return bsfa.load_pattern("longformer", window=64 if small else 256, n_global=16 if small else 64)
    if name == "bigbird":
        return bsfa.load_pattern("bigbird", window=64 if small else 192, n_global=32 if small else 128,
                                 block=64 if small else 128)
    if name == "documents":
        return bsfa.load_pattern("document_causal", document=doc_ids(n, lo=64 if small else 1024,
                                                                     hi=512 if small else 16384))
    if name == "strided":
        return bsfa.load_pattern("sparse_transformer_strided", stride=32 if small else 256)
    raise ValueError(name)


LEAD = ("causal", "sliding_window", "longformer", "bigbird", "documents")


def lead_masks(n: int, small: bool = False, names_only: bool = False):
    """The scaling targets' masks at ``n`` tokens: causal, sliding window 4096, causal Longformer
    (window 512, 256 global tokens), causal BigBird (window 384, 128 global tokens, 3 random blocks
    of 128) and packed documents of 2K-32K tokens (``small``: the same shapes scaled down for CPU
    checks)."""
    if names_only:
        return LEAD
    c = bsfa.causal()
    s = (lambda x: max(16, x // 64)) if small else (lambda x: x)  # noqa: E731
    return {"causal": c,
            "sliding_window": bsfa.sliding_window(s(4096)),
            "longformer": c & (bsfa.window(s(512)) | bsfa.global_tokens(s(256))),
            "bigbird": c & (bsfa.window(s(384)) | bsfa.global_tokens(s(128))
                            | bsfa.random_blocks(3, block_size=64 if small else 128, seed=0)),
            "documents": c & bsfa.document(doc_ids(n, lo=s(2048), hi=s(32768)))}


# ------------------------------------------------------------------------------------------------
# run
# ------------------------------------------------------------------------------------------------
class Run:
    """Distributed state, the time budget and the incremental JSON."""

    def __init__(self, args):
        import torch.distributed as dist

        self.dist = dist
        self.args = args
        self.cpu = args.device == "cpu"
        backend = "gloo" if self.cpu else "nccl"
        if not self.cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dev = torch.device("cpu") if self.cpu else torch.device("cuda", torch.cuda.current_device())
        self.t0 = time.monotonic()
        self.out = os.path.join(args.out, "context_parallel.json")
        self.res = dict(world_size=self.world, torch=torch.__version__, device=self._device_name(), sections={},
                        skipped=[], errors=[], args=vars(args))
        try:
            import triton

            self.res["triton"] = triton.__version__
        except ImportError:
            pass
        self.res["env"] = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}

    def _device_name(self):
        return "cpu" if self.cpu else torch.cuda.get_device_name(self.dev)

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t0)

    def agree(self, flag: bool) -> bool:
        """Rank 0's decision, on every rank (sections must run on all ranks or none)."""
        t = torch.tensor([1 if flag else 0], device=self.dev)
        self.dist.broadcast(t, 0)
        return bool(t.item())

    def fits(self, name: str, seconds: float) -> bool:
        ok = self.agree(self.left() > seconds)
        if not ok and self.rank == 0:
            self.res["skipped"].append(f"{name} (needed ~{seconds:.0f} s, {self.left():.0f} s left)")
            self.save()
        return ok

    def record(self, section: str, row: dict) -> None:
        if self.rank == 0:
            self.res["sections"].setdefault(section, []).append(row)
            self.save()
            print(f"[{time.monotonic() - self.t0:6.1f}s] {section}: {json.dumps(row, default=str)[:300]}", flush=True)

    def error(self, what: str, e: BaseException) -> None:
        if self.rank == 0:
            self.res["errors"].append(f"{what}: {type(e).__name__}: {e}"[:2000])
            self.save()
            print(f"ERROR {what}: {e}", flush=True)

    def save(self) -> None:
        os.makedirs(self.args.out, exist_ok=True)
        self.res["elapsed_s"] = time.monotonic() - self.t0
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.res, f, indent=1, default=str)
        os.replace(tmp, self.out)

    def sync(self):
        if not self.cpu:
            torch.cuda.synchronize()
        self.dist.barrier()

    def max(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.dev)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.item()

    def time(self, fn, iters: int, warmup: int = 1) -> float:
        """Seconds per call on this rank (after a barrier), the slowest rank's."""
        for _ in range(warmup):
            fn()
        self.sync()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        if not self.cpu:
            torch.cuda.synchronize()
        return self.max((time.perf_counter() - t) / iters)


def _qkv(n, dev, dtype, seed=0, heads=HEADS, kv_heads=KV_HEADS, d=HEAD_DIM):
    g = torch.Generator(device=dev).manual_seed(seed)
    mk = lambda h: torch.randn(1, h, n, d, device=dev, dtype=dtype, generator=g)  # noqa: E731
    return mk(heads), mk(kv_heads), mk(kv_heads), mk(heads)


def section_links(run: Run):
    if run.rank == 0 and not run.cpu:
        try:
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
        except Exception as e:  # noqa: BLE001
            topo = f"nvidia-smi failed: {e}"
        run.res["topology"] = topo
        print(topo, flush=True)
    dist = run.dist
    mb = 8 if run.cpu else 256
    n = mb * (1 << 20) // 2
    x = torch.randn(n // run.world, device=run.dev, dtype=torch.bfloat16)
    y = torch.empty(n, device=run.dev, dtype=torch.bfloat16)
    t = run.time(lambda: dist.all_gather_into_tensor(y, x), iters=5 if not run.cpu else 2)
    run.record("links", dict(op="all_gather", MB_total=mb, seconds=t,
                             bus_GBps=mb * 1e6 * (run.world - 1) / run.world / t / 1e9))
    a = torch.randn(n // run.world, device=run.dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = run.time(lambda: dist.all_to_all_single(b, a), iters=5 if not run.cpu else 2)
    sent = a.numel() * 2 * (run.world - 1) / run.world
    run.record("links", dict(op="all_to_all", MB_per_rank=a.numel() * 2 / 1e6, seconds=t, send_GBps=sent / t / 1e9))
    run.res["link_GBps"] = sent / t / 1e9


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def section_correctness(run: Run, n: int, patterns, small: bool, dropouts=(0.0,)):
    dtype = torch.float32 if run.cpu else torch.bfloat16
    backend = "torch" if run.cpu else "auto"
    for name in patterns:
        for dropout in dropouts:
            if not run.fits(f"correctness {name}", 20):
                return
            try:
                mask = make_mask(name, n, small)
                plan = plan_context_parallel(mask, n, run.world, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM,
                                             dropout=dropout > 0, block_size=64 if small else 128)
                q, k, v, do = _qkv(n, run.dev, dtype)
                idx = plan.indices(run.rank, run.dev)
                # single GPU, same inputs
                qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
                ref = bsfa.attention(qa, ka, va, mask=plan.device_layout(run.dev), dropout_p=dropout,
                                     dropout_seed=3, backend=backend)
                ref.backward(do)
                ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
                out = context_parallel_attention(ql, kl, vl, plan=plan, dropout_p=dropout, dropout_seed=3,
                                                 backend=backend)
                out.backward(do[:, :, idx])
                row = dict(pattern=name, N=n, strategy=plan.strategy, dropout=dropout)
                pairs = dict(out=(out, ref[:, :, idx]), dq=(ql.grad, qa.grad[:, :, idx]),
                             dk=(kl.grad, ka.grad[:, :, idx]), dv=(vl.grad, va.grad[:, :, idx]))
                for key, (a, b) in pairs.items():
                    row[f"{key}_vs_single"] = run.max(_rel(a, b))
                row["out_bit_identical"] = run.max(0.0 if torch.equal(out, ref[:, :, idx]) else 1.0) == 0.0
                if dropout == 0.0:  # float64 reference on every GPU (dense)
                    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
                    r64 = bsfa.reference_attention(qd, kd, vd, mask)
                    g64 = torch.autograd.grad(r64, (qd, kd, vd), do.double())
                    full = dict(out=(out, ref, r64), dq=(ql.grad, qa.grad, g64[0]), dk=(kl.grad, ka.grad, g64[1]),
                                dv=(vl.grad, va.grad, g64[2]))
                    for key, (mine, single, exact) in full.items():
                        row[f"{key}_err_cp"] = run.max(_rel(mine, exact[:, :, idx]))
                        row[f"{key}_err_single"] = run.max(_rel(single[:, :, idx], exact[:, :, idx]))
                    del qd, kd, vd, r64, g64
                run.record("correctness", row)
            except Exception as e:  # noqa: BLE001
                run.error(f"correctness {name}", e)
            if not run.cpu:
                torch.cuda.empty_cache()


def _local_only(plan, run, q, k, v, do, fwd_only, backend):
    """This rank's kernel launches alone, on buffers prefetched once (what ``TP`` adds to is
    communication and glue)."""
    from blocksparse_fa.distributed.attention import _bwd, _fwd, fetch
    from blocksparse_fa.distributed.exchange import exchange_for

    from blocksparse_fa.ops.api import resolve_backend

    backend = resolve_backend(backend, q.device, q.dtype)  # as context_parallel_attention does
    ex = exchange_for(plan, run.rank, q.device)
    saved = fetch(ex, q, k, v, run.dist.group.WORLD)
    kb, vb = (saved.kvbuf[0], saved.kvbuf[1]) if saved.kvbuf is not None else (k, v)
    scale = 1.0 / math.sqrt(q.shape[-1])
    acc = torch.float32

    def go():
        out, lse = _fwd(q, kb, vb, ex.main, scale, 0.0, 0, backend, acc if ex.n_split else None)
        if ex.guest is not None:
            og, lg = _fwd(saved.gq, k, v, ex.guest, scale, 0.0, 0, backend, acc)
        if not fwd_only:
            _bwd(q, kb, vb, out.to(q.dtype), lse, do, ex.main, scale, 0.0, 0, backend, None, acc)
            if ex.guest is not None:
                _bwd(saved.gq, k, v, og.to(q.dtype), lg, torch.zeros_like(og, dtype=q.dtype), ex.guest, scale, 0.0,
                     0, backend, None, acc)
    return go


def section_scaling(run: Run, lengths, patterns, small: bool):
    dtype = torch.float32 if run.cpu else torch.bfloat16
    backend = "torch" if run.cpu else "auto"
    iters = 1 if run.cpu else 3
    for n in lengths:
        for name in patterns:
            est = 10 + (40 if name in ("causal",) else 8) * (n / 262144) ** 2 * (0 if run.cpu else 1)
            if not run.fits(f"scaling {name} {n}", est):
                continue
            try:
                mask = make_mask(name, n, small)
                plan = plan_context_parallel(mask, n, run.world, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM,
                                             block_size=64 if small else 128,
                                             cost_model=_cost_model(run))
                q, k, v, do = _qkv(n, run.dev, dtype)
                lay = plan.device_layout(run.dev)
                row = dict(pattern=name, N=n, density=plan.layout.density, strategy=plan.strategy,
                           candidates={kk: dict(time_ms=vv["time"] * 1e3, bytes=vv["bytes"])
                                       for kk, vv in plan.candidates.items()})
                qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))

                def single_fwd():
                    with torch.no_grad():
                        bsfa.attention(q, k, v, mask=lay, backend=backend)

                def single_fb():
                    o = bsfa.attention(qa, ka, va, mask=lay, backend=backend)
                    o.backward(do)

                row["T1_fwd_ms"] = run.time(single_fwd, iters) * 1e3
                row["T1_fb_ms"] = run.time(single_fb, iters) * 1e3
                del qa, ka, va
                strategies = [plan.strategy] + (["ulysses"] if plan.strategy != "ulysses" and
                                                "ulysses" in plan.candidates else [])
                for strat in strategies:
                    p = plan if strat == plan.strategy else plan_context_parallel(
                        mask, n, run.world, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM, strategy=strat,
                        block_size=64 if small else 128, cost_model=_cost_model(run))
                    idx = p.indices(run.rank, run.dev)
                    ql, kl, vl, dl = (t[:, :, idx].contiguous() for t in (q, k, v, do))
                    qg, kg, vg = (t.clone().requires_grad_() for t in (ql, kl, vl))

                    def cp_fwd():
                        with torch.no_grad():
                            context_parallel_attention(ql, kl, vl, plan=p, backend=backend, check=False)

                    def cp_fb():
                        o = context_parallel_attention(qg, kg, vg, plan=p, backend=backend, check=False)
                        o.backward(dl)

                    tag = "" if strat == plan.strategy else f"_{strat}"
                    t_f = run.time(cp_fwd, iters)
                    t_fb = run.time(cp_fb, iters)
                    row[f"TP_fwd_ms{tag}"] = t_f * 1e3
                    row[f"TP_fb_ms{tag}"] = t_fb * 1e3
                    row[f"eff_fwd{tag}"] = row["T1_fwd_ms"] / (run.world * t_f * 1e3)
                    row[f"eff_fb{tag}"] = row["T1_fb_ms"] / (run.world * t_fb * 1e3)
                    if strat != "ulysses":
                        per = p.bytes_per_rank()
                        row["bytes_fwd_max"] = max(x["fwd"] for x in per)
                        row["bytes_fb_max"] = max(x["fwd"] + x["bwd"] for x in per)
                        row["ring_fwd"] = max(x["ring_fwd"] for x in per)
                        row["ring_fb"] = max(x["ring_fwd"] + x["ring_bwd"] for x in per)
                        row["split_rows"] = len(p.split)
                        row["tokens"] = [p.local_len(r) for r in range(run.world)]
                        with torch.no_grad():
                            lf = _local_only(p, run, ql, kl, vl, dl, True, backend)
                            t_lf = run.time(lf, iters)
                        lfb = _local_only(p, run, ql, kl, vl, dl, False, backend)
                        t_lfb = run.time(lfb, iters)
                        row["local_fwd_ms"], row["local_fb_ms"] = t_lf * 1e3, t_lfb * 1e3
                        row["exposed_comm_fwd_ms"] = (t_f - t_lf) * 1e3
                        row["exposed_comm_fb_ms"] = (t_fb - t_lfb) * 1e3
                        if name == "causal" and not run.cpu:  # the two-launch overlap variant
                            def cp_fb_overlap():
                                o = context_parallel_attention(qg, kg, vg, plan=p, backend=backend, check=False,
                                                               overlap=True)
                                o.backward(dl)
                            row["TP_fb_ms_overlap"] = run.time(cp_fb_overlap, iters) * 1e3
                    del qg, kg, vg
                run.record("scaling", row)
            except Exception as e:  # noqa: BLE001
                run.error(f"scaling {name} {n}", e)
            if not run.cpu:
                torch.cuda.empty_cache()


def _cost_model(run: Run):
    from blocksparse_fa.distributed import CostModel

    bw = run.res.get("link_GBps")
    return CostModel(bandwidth=bw * 1e9) if bw else CostModel()


def section_torch_cp(run: Run, lengths):
    """torch.distributed.tensor.experimental.context_parallel around SDPA (causal)."""
    import torch.nn.functional as F

    if run.cpu:
        run.record("torch_cp", dict(note="skipped on CPU (flash SDPA needs CUDA)"))
        return
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        try:
            from torch.distributed.tensor.experimental._attention import set_rotate_method
        except ImportError:
            set_rotate_method = None
    except ImportError as e:
        run.record("torch_cp", dict(note=f"not available in torch {torch.__version__}: {e}"))
        return
    mesh = init_device_mesh("cuda", (run.world,))
    iters = 3
    for n in lengths:
        if not run.fits(f"torch cp {n}", 30 * (n / 262144) ** 2 + 5):
            continue
        q, k, v, do = _qkv(n, run.dev, torch.bfloat16)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, 1) for t in (k, v))  # SDPA flash: equal heads
        row = dict(N=n, heads=HEADS, kv_heads_expanded=HEADS)
        try:
            qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))

            def single_fb():
                F.scaled_dot_product_attention(qa, ka, va, is_causal=True).backward(do)

            def single_fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
            row["T1_fwd_ms"] = run.time(single_fwd, iters) * 1e3
            row["T1_fb_ms"] = run.time(single_fb, iters) * 1e3
            del qa, ka, va
        except Exception as e:  # noqa: BLE001
            run.error(f"sdpa single {n}", e)
        for method in ("allgather", "alltoall"):
            try:
                if set_rotate_method is not None:
                    set_rotate_method(method)
                elif method != "allgather":
                    continue
                bufs = [t.clone() for t in (q, k, v, do)]
                with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
                    ql, kl, vl, dl = bufs
                    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (ql, kl, vl))

                    def cp_fwd():
                        with torch.no_grad():
                            F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)

                    def cp_fb():
                        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(dl)
                    row[f"TP_fwd_ms_{method}"] = run.time(cp_fwd, iters) * 1e3
                    row[f"TP_fb_ms_{method}"] = run.time(cp_fb, iters) * 1e3
                if "T1_fwd_ms" in row:
                    row[f"eff_fwd_{method}"] = row["T1_fwd_ms"] / (run.world * row[f"TP_fwd_ms_{method}"])
                    row[f"eff_fb_{method}"] = row["T1_fb_ms"] / (run.world * row[f"TP_fb_ms_{method}"])
            except Exception as e:  # noqa: BLE001
                run.error(f"torch cp {method} {n}", e)
        run.record("torch_cp", row)
        torch.cuda.empty_cache()


def section_million(run: Run, n: int, patterns, small: bool):
    dtype = torch.float32 if run.cpu else torch.bfloat16
    backend = "torch" if run.cpu else "auto"
    for name in patterns:
        est = 60 if name == "causal" else 15
        if not run.fits(f"1M layer {name}", est):
            continue
        try:
            mask = make_mask(name, n, small)
            plan = plan_context_parallel(mask, n, run.world, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM,
                                         block_size=64 if small else 128, cost_model=_cost_model(run))
            idx = plan.indices(run.rank, run.dev)
            L = len(idx)
            g = torch.Generator(device=run.dev).manual_seed(run.rank)
            mk = lambda h: torch.randn(1, h, L, HEAD_DIM, device=run.dev, dtype=dtype, generator=g)  # noqa: E731
            ql, kl, vl, dl = mk(HEADS).requires_grad_(), mk(KV_HEADS).requires_grad_(), mk(KV_HEADS).requires_grad_(), mk(HEADS)
            if not run.cpu:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()

            def fb():
                o = context_parallel_attention(ql, kl, vl, plan=plan, backend=backend, check=False)
                o.backward(dl)
            t = run.time(fb, iters=1, warmup=1)
            row = dict(pattern=name, N=n, strategy=plan.strategy, fb_ms=t * 1e3, tokens_per_rank=L)
            if not run.cpu:
                row["peak_GiB"] = run.max(torch.cuda.max_memory_allocated() / 2**30)
                row["peak_extra_GiB"] = run.max((torch.cuda.max_memory_allocated() - base) / 2**30)
            run.record("million", row)
            del ql, kl, vl, dl
        except Exception as e:  # noqa: BLE001
            run.error(f"1M {name}", e)
        if not run.cpu:
            torch.cuda.empty_cache()


SECTIONS = ("links", "correctness", "scaling", "torch_cp", "million", "dropout")


def cmd_run(args):
    run = Run(args)
    small = args.smoke
    if small:
        lengths, corr_n, million = [1024, 2048], 1024, 4096
    else:
        lengths, corr_n, million = args.lengths, args.correctness_len, args.million
    patterns = args.patterns
    want = set(args.sections)
    if "links" in want:
        try:
            section_links(run)
        except Exception as e:  # noqa: BLE001
            run.error("links", e)
    # most important first: what does not fit the budget is skipped from the end
    if "dropout" in want and "causal" in patterns and "correctness" not in want:
        section_correctness(run, corr_n, ["causal"], small, dropouts=(0.1,))
    if "correctness" in want:
        section_correctness(run, corr_n, patterns, small)
    longest, rest = lengths[-1:], lengths[:-1]
    if "scaling" in want:
        section_scaling(run, longest, patterns, small)
    if "torch_cp" in want:
        section_torch_cp(run, longest)
    if "million" in want:
        section_million(run, million, [p for p in ("sliding_window", "longformer", "documents", "bigbird", "causal")
                                       if p in patterns], small)
    if "scaling" in want:
        section_scaling(run, rest, patterns, small)
    if "torch_cp" in want:
        section_torch_cp(run, rest)
    if "dropout" in want and "causal" in patterns and "correctness" in want:
        section_correctness(run, corr_n, ["causal"], small, dropouts=(0.1,))
    run.sync()
    if run.rank == 0:
        run.save()
        print(report(run.res), flush=True)
        print(f"results: {run.out}  ({time.monotonic() - run.t0:.0f} s)", flush=True)
    run.dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def _f(x, fmt="{:.2f}"):
    return "" if x is None else fmt.format(x)


def report(res: dict) -> str:
    """Markdown tables of a run."""
    P = res.get("world_size", 2)
    dt = "float32" if res.get("device") == "cpu" else "bf16"
    lines = [f"Device: {P}x {res.get('device')}, torch {res.get('torch')}, triton {res.get('triton')}; "
             f"{dt}, 1 sequence, {HEADS} query / {KV_HEADS} key-value heads, head dim {HEAD_DIM}.", ""]
    links = res.get("sections", {}).get("links", [])
    for r in links:
        if r["op"] == "all_gather":
            lines.append(f"- all-gather of {r['MB_total']} MB: {r['bus_GBps']:.0f} GB/s bus bandwidth")
        else:
            lines.append(f"- all-to-all of {r['MB_per_rank']:.0f} MB per rank: {r['send_GBps']:.0f} GB/s sent per rank")
    corr = res.get("sections", {}).get("correctness", [])
    if corr:
        lines += ["", "**Correctness** (relative L2 error; `cp` = context parallel, `single` = one GPU, against a "
                  "float64 reference; `vs single` = cp against one GPU on the same inputs):", "",
                  "| pattern | strategy | dropout | out cp / single | dq cp / single | dk cp / single | dv cp / single "
                  "| out vs single | dk vs single | out bit-identical |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in corr:
            pair = lambda k: (f"{r[f'{k}_err_cp']:.2e} / {r[f'{k}_err_single']:.2e}"  # noqa: E731
                              if f"{k}_err_cp" in r else "")
            lines.append(f"| {r['pattern']} | {r['strategy']} | {r['dropout']} | {pair('out')} | {pair('dq')} | "
                         f"{pair('dk')} | {pair('dv')} | {r['out_vs_single']:.1e} | {r['dk_vs_single']:.1e} | "
                         f"{'yes' if r['out_bit_identical'] else 'no'} |")
    sc = res.get("sections", {}).get("scaling", [])
    if sc:
        lines += ["", f"**Strong scaling** (`eff` = T1 / ({P} · T{P}); times in ms, slowest rank; bytes = most any "
                  "rank sends per step, fwd+bwd, vs a dense ring):", "",
                  f"| pattern | N | strategy | T1 fwd | T{P} fwd | eff fwd | T1 fwd+bwd | T{P} fwd+bwd | eff fwd+bwd "
                  "| exposed comm fwd / fb | MB sent (ring) | % of ring | Ulysses eff fwd / fb |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sc:
            mb = r.get("bytes_fb_max")
            ring = r.get("ring_fb")
            uly = (f"{r['eff_fwd_ulysses']:.2f} / {r['eff_fb_ulysses']:.2f}" if "eff_fwd_ulysses" in r else "")
            lines.append(
                f"| {r['pattern']} | {r['N'] // 1024}K | {r['strategy']} | {_f(r.get('T1_fwd_ms'))} | "
                f"{_f(r.get('TP_fwd_ms'))} | {_f(r.get('eff_fwd'))} | {_f(r.get('T1_fb_ms'))} | {_f(r.get('TP_fb_ms'))} | "
                f"{_f(r.get('eff_fb'))} | {_f(r.get('exposed_comm_fwd_ms'))} / {_f(r.get('exposed_comm_fb_ms'))} | "
                f"{_f(mb / 1e6 if mb else None, '{:.1f}')} ({_f(ring / 1e6 if ring else None, '{:.0f}')}) | "
                f"{_f(100 * mb / ring if mb and ring else None, '{:.1f}')} | {uly} |")
    tcp = res.get("sections", {}).get("torch_cp", [])
    rows = [r for r in tcp if "N" in r]
    if rows:
        lines += ["", "**torch `context_parallel` (SDPA flash, causal, k/v expanded to 8 heads)** beside ours "
                  "(causal, GQA 8/2), ms:", "",
                  "| N | SDPA 1 GPU fwd / fb | allgather fwd / fb | alltoall fwd / fb | torch eff fb (allgather) "
                  "| ours fwd / fb | ours eff fb |", "|---|---|---|---|---|---|---|"]
        ours = {r["N"]: r for r in sc if r["pattern"] == "causal"}
        for r in rows:
            o = ours.get(r["N"], {})
            lines.append(f"| {r['N'] // 1024}K | {_f(r.get('T1_fwd_ms'))} / {_f(r.get('T1_fb_ms'))} | "
                         f"{_f(r.get('TP_fwd_ms_allgather'))} / {_f(r.get('TP_fb_ms_allgather'))} | "
                         f"{_f(r.get('TP_fwd_ms_alltoall'))} / {_f(r.get('TP_fb_ms_alltoall'))} | "
                         f"{_f(r.get('eff_fb_allgather'))} | {_f(o.get('TP_fwd_ms'))} / {_f(o.get('TP_fb_ms'))} | "
                         f"{_f(o.get('eff_fb'))} |")
    mil = res.get("sections", {}).get("million", [])
    if mil:
        lines += ["", f"**One layer at {mil[0]['N'] // 1024}K tokens on {P} GPUs** (fwd+bwd):", "",
                  "| pattern | strategy | fwd+bwd ms | tokens per GPU | peak GiB per GPU |", "|---|---|---|---|---|"]
        for r in mil:
            lines.append(f"| {r['pattern']} | {r['strategy']} | {r['fb_ms']:.1f} | {r['tokens_per_rank']} | "
                         f"{_f(r.get('peak_GiB'))} |")
    if res.get("skipped"):
        lines += ["", "Skipped (time budget): " + "; ".join(res["skipped"])]
    if res.get("errors"):
        lines += ["", "Errors: " + "; ".join(res["errors"])]
    return "\n".join(lines)


RESULTS_MARK, RESULTS_END = "<!-- results -->", "## Testing"


def cmd_report(args):
    with open(args.json) as f:
        res = json.load(f)
    text = report(res)
    print(text)
    if args.docs:  # replace the results section of docs/distributed.md
        with open(args.docs) as f:
            doc = f.read()
        a, b = doc.index(RESULTS_MARK) + len(RESULTS_MARK), doc.index(RESULTS_END)
        with open(args.docs, "w") as f:
            f.write(doc[:a] + "\n" + text + "\n\n" + doc[b:])
    if args.data:
        with open(args.data, "w") as f:
            json.dump(res, f, indent=1, default=str)
    if args.plot:
        plot(res, args.plot)


def plot(res: dict, path: str) -> None:
    """Strong-scaling efficiency (fwd+bwd) per pattern and length, and the bytes each rank sends
    as a share of a dense ring, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res.get("sections", {}).get("scaling", [])
    P = res.get("world_size", 2)
    lengths = sorted({r["N"] for r in rows})
    names = list(dict.fromkeys(r["pattern"] for r in rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.8 / max(1, len(lengths))
    for j, n in enumerate(lengths):
        by = {r["pattern"]: r for r in rows if r["N"] == n}
        xs = [i + j * w for i in range(len(names))]
        a1.bar(xs, [by[m].get("eff_fb", 0) if m in by else 0 for m in names], w, label=f"{n // 1024}K")
        pc = [100 * by[m]["bytes_fb_max"] / by[m]["ring_fb"] if m in by and by[m].get("ring_fb") else 0
              for m in names]
        a2.bar(xs, pc, w, label=f"{n // 1024}K")
    for ax in (a1, a2):
        ax.set_xticks([i + w * (len(lengths) - 1) / 2 for i in range(len(names))], names, rotation=20)
        ax.legend()
    a1.axhline(0.9, color="k", lw=0.8, ls="--")
    a1.set_ylabel(f"efficiency T1 / ({P} T{P}), fwd+bwd")
    a2.set_ylabel("bytes sent, % of a dense ring (fwd+bwd)")
    a2.set_yscale("log")
    fig.suptitle(f"Context parallelism on {P}x {res.get('device')} (strided: Ulysses, no block bytes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# plans (CPU)
# ------------------------------------------------------------------------------------------------
def cmd_plans(args):
    rows = []
    print("| pattern | N | ranks | strategy | split rows | MB sent fwd / fwd+bwd (max rank) | dense ring fwd / fwd+bwd "
          "| % of ring fwd / fwd+bwd | est. imbalance |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.lengths:
        for name in args.patterns:
            mask = make_mask(name, n)
            for P in args.world:
                t = time.perf_counter()
                plan = plan_context_parallel(mask, n, P, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM)
                per = plan.bytes_per_rank()
                fwd = max(x["fwd"] for x in per)
                fb = max(x["fwd"] + x["bwd"] for x in per)
                rf = max(x["ring_fwd"] for x in per)
                rfb = max(x["ring_fwd"] + x["ring_bwd"] for x in per)
                if plan.strategy == "ulysses":  # the all-to-alls' bytes (fwd+bwd) from the estimate
                    fb = plan.candidates["ulysses"]["bytes"]
                    fwd = None
                est = plan.candidates[plan.strategy]
                rows.append(dict(pattern=name, N=n, world=P, strategy=plan.strategy, split=len(plan.split), fwd=fwd,
                                 fb=fb, ring_fwd=rf, ring_fb=rfb, imbalance=est["imbalance"],
                                 plan_s=time.perf_counter() - t))
                fwd_mb = "" if fwd is None else f"{fwd / 1e6:.1f}"
                fwd_pc = "" if fwd is None else f"{100 * fwd / rf:.2f}"
                print(f"| {name} | {n // 1024}K | {P} | {plan.strategy} | {len(plan.split)} | {fwd_mb} / "
                      f"{fb / 1e6:.1f} | {rf / 1e6:.0f} / {rfb / 1e6:.0f} | {fwd_pc} / {100 * fb / rfb:.2f} "
                      f"| {est['imbalance']:.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure (under torchrun)")
    r.add_argument("--out", default=os.environ.get("OUT", "."))
    r.add_argument("--budget", type=float, default=330.0, help="seconds; sections that would not fit are skipped")
    r.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144])
    r.add_argument("--correctness-len", type=int, default=8192)
    r.add_argument("--million", type=int, default=1 << 20)
    r.add_argument("--patterns", nargs="+", default=PATTERNS, choices=PATTERNS)
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                   help="which measurements (default: all, most important first)")
    r.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check of the script)")
    r.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    r.set_defaults(fn=cmd_run)
    p = sub.add_parser("report", help="Markdown tables from a run's JSON")
    p.add_argument("json")
    p.add_argument("--docs", default=None, help="write the tables into this page's results section")
    p.add_argument("--data", default=None, help="copy the raw results here (docs/data/context_parallel.json)")
    p.add_argument("--plot", default=None, help="write a PNG of efficiency and bytes (docs/context_parallel.png)")
    p.set_defaults(fn=cmd_report)
    q = sub.add_parser("plans", help="bytes per rank from the plans (CPU)")
    q.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144, 1048576])
    q.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    q.add_argument("--patterns", nargs="+", default=PATTERNS, choices=PATTERNS)
    q.add_argument("--json", default=None)
    q.set_defaults(fn=cmd_plans)
    args = ap.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
