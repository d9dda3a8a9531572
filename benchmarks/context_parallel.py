"""Context parallelism on several GPUs: strong scaling, errors, memory, torch's CP beside ours, training.

``run`` (under torchrun, one process per GPU; ``--device cpu`` runs the same on CPU processes with
gloo) measures, most important first, within ``--deadline`` seconds (what would not fit is
skipped and recorded; results are written after every row):

1. the links: all-gather and all-to-all bandwidth;
2. per mask (default the five targets at 256K: causal, sliding window 4096, causal Longformer,
   causal BigBird, packed documents), on one GPU and on ``P`` GPUs with the planner's plan: forward
   and forward+backward time (``T1``, ``TP``, slowest rank; back-to-back calls, at least 3 and on
   GPUs as many as fill 0.25 s), efficiency ``T1 / (P · TP)``, the
   error of the context-parallel output and gradients against the one-GPU run (relative L2 over
   the whole sequence), both runs' error against float64 on a slice (the last key block's queries
   and keys), per-rank peak memory, bytes sent, the strategy and whether the fetch is overlapped;
3. torch's ``context_parallel`` (SDPA, causal, cuDNN or flash, K/V expanded to the query heads) on
   the same shapes, beside our causal row;
4. training (``benchmarks/train/cp.py``): tokens/s of the decoder on one GPU and on ``P`` GPUs for
   causal, documents and Longformer at ``--train-len`` (strong) and ``--train-len / P`` per GPU
   (weak), per-rank memory, losses against one GPU.

Writes ``context_parallel.json`` and ``context_parallel.md`` to ``--out``; ``--update-docs``
regenerates the results section of ``docs/distributed.md`` (and ``docs/data/context_parallel.json``)
from them. ``report`` does the same from a saved JSON, ``summary`` prints the short table, ``plans``
prints the plans' balance and bytes (CPU, any length and world size).

    export NCCL_NVLS_ENABLE=0 PYTHONPATH=.
    torchrun --nproc-per-node 4 benchmarks/context_parallel.py run --out $OUT --deadline 480
    torchrun --nproc-per-node 2 benchmarks/context_parallel.py run --device cpu --smoke --out /tmp/cp
    python benchmarks/context_parallel.py plans --lengths 262144 --world 4 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.join(_HERE, "..")):  # benchmarks/ (train/), then the repository root
    if _p not in sys.path:
        sys.path.insert(0, _p)

import blocksparse_fa as bsfa  # noqa: E402
from blocksparse_fa.distributed import context_parallel_attention, plan_context_parallel  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
ROOT = os.path.abspath(os.path.join(_HERE, ".."))
DOCS = os.path.join(ROOT, "docs", "distributed.md")
DOCS_DATA = os.path.join(ROOT, "docs", "data", "context_parallel.json")
RESULTS_MARK, RESULTS_END = "<!-- results -->", "## Testing"


def doc_ids(n: int, seed: int = 0, lo: int = 1024, hi: int = 16384) -> torch.Tensor:
    """Packed documents of ``lo``..``hi`` tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < n:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[:n]


LEAD = ("causal", "sliding_window", "longformer", "bigbird", "documents")
PATTERNS = LEAD + ("strided",)


def lead_masks(n: int, small: bool = False, names_only: bool = False):
    """The scaling targets' masks at ``n`` tokens: causal, sliding window 4096, causal Longformer
    (window 512, 256 global tokens), causal BigBird (window 384, 128 global tokens, 3 random blocks
    of 128) and packed documents of 2K-32K tokens (``small``: the same shapes scaled down for CPU
    checks), and the Sparse Transformer's strided pattern (stride 256)."""
    if names_only:
        return PATTERNS
    c = bsfa.causal()
    s = (lambda x: max(16, x // 64)) if small else (lambda x: x)  # noqa: E731
    return {"causal": c,
            "sliding_window": bsfa.sliding_window(s(4096)),
            "longformer": c & (bsfa.window(s(512)) | bsfa.global_tokens(s(256))),
            "bigbird": c & (bsfa.window(s(384)) | bsfa.global_tokens(s(128))
                            | bsfa.random_blocks(3, block_size=64 if small else 128, seed=0)),
            "documents": c & bsfa.document(doc_ids(n, lo=s(2048), hi=s(32768))),
            "strided": bsfa.load_pattern("sparse_transformer_strided", stride=32 if small else 256)}


def make_mask(name: str, n: int, small: bool = False):
    return lead_masks(n, small)[name]


# ------------------------------------------------------------------------------------------------
# run
# ------------------------------------------------------------------------------------------------
class Run:
    """Distributed state, the deadline and the incremental results."""

    def __init__(self, args):
        import torch.distributed as dist

        self.dist, self.args = dist, args
        self.cpu = args.device == "cpu"
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline
        if not self.cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # before NCCL: it binds the device
        self.dev = torch.device("cpu") if self.cpu else torch.device("cuda", torch.cuda.current_device())
        kw = {} if self.cpu else {"device_id": self.dev}
        dist.init_process_group("gloo" if self.cpu else "nccl", timeout=timedelta(seconds=args.timeout), **kw)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.out = os.path.join(args.out, "context_parallel.json")
        self.res = dict(world_size=self.world, torch=torch.__version__, device=self._device_name(), sections={},
                        skipped=[], errors=[], args={k: v for k, v in vars(args).items() if k != "fn"},
                        command=" ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                        timing=_timing(args.fill))
        try:
            import triton

            self.res["triton"] = triton.__version__
        except ImportError:
            pass
        self.res["env"] = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}
        from blocksparse_fa.distributed import comm

        self.res["messages"] = comm.MESSAGES

    def _device_name(self):
        return "cpu" if self.cpu else torch.cuda.get_device_name(self.dev)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def agree(self, flag: bool) -> bool:
        """True on every rank only if it is true on every rank (sections run on all ranks or none)."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.dev)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return bool(t.item())

    def fits(self, name: str, seconds: float) -> bool:
        ok = self.agree(self.left() > seconds)
        if not ok and self.rank == 0:
            self.res["skipped"].append(f"{name} (needs ~{seconds:.0f} s, {max(0.0, self.left()):.0f} s left)")
            self.save()
        return ok

    def record(self, section: str, row: dict) -> None:
        if self.rank == 0:
            self.res["sections"].setdefault(section, []).append(row)
            self.save()
            brief = {k: v for k, v in row.items() if not isinstance(v, (list, dict))}
            print(f"[{time.monotonic() - self.t0:6.1f}s] {section}: {json.dumps(brief, default=str)[:400]}",
                  flush=True)

    def error(self, what: str, e: BaseException) -> None:
        if self.rank == 0:
            self.res["errors"].append(f"{what}: {type(e).__name__}: {e}"[:2000])
            self.save()
            print(f"ERROR {what}: {type(e).__name__}: {e}", flush=True)

    def save(self) -> None:
        os.makedirs(self.args.out, exist_ok=True)
        self.res["elapsed_s"] = time.monotonic() - self.t0
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.res, f, indent=1, default=str)
        os.replace(tmp, self.out)
        with open(os.path.join(self.args.out, "context_parallel.md"), "w") as f:
            f.write(report(self.res) + "\n")

    def sync(self):
        if not self.cpu:
            torch.cuda.synchronize()
        self.dist.barrier()

    def max(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.dev)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.item()

    def sum(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.dev)
        self.dist.all_reduce(t)
        return t.item()

    def time(self, fn, iters: int, warmup: int = 1, most: int = 100) -> float:
        """Seconds per call of back-to-back calls after a barrier, the slowest rank's: at least
        ``iters`` calls, on GPUs as many more (up to ``most``) as fill ``--fill`` seconds, so that a
        1-ms call is timed as in a loop of layers (the host launching ahead of the GPU) and not
        dominated by the first call's launch latency on an idle GPU."""
        for _ in range(warmup):
            fn()
        n, budget = iters, self.args.fill
        if not self.cpu and budget > 0:
            self.sync()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            n = max(iters, min(most, math.ceil(budget / max(self.max(time.perf_counter() - t), 1e-6))))
        self.sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if not self.cpu:
            torch.cuda.synchronize()
        return self.max((time.perf_counter() - t) / n)

    def peak(self) -> float | None:
        return None if self.cpu else torch.cuda.max_memory_allocated(self.dev) / 2**30

    def reset_peak(self):
        if not self.cpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.dev)


def _timing(fill: float) -> str:
    """How the scaling rows were timed (``--fill``), for the report."""
    return ("back-to-back calls after a barrier, at least 3" +
            (f", on GPUs as many as fill {fill:g} s" if fill > 0 else ""))


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
    dist = run.dist
    mb = 8 if run.cpu else 256
    n = mb * (1 << 20) // 2
    x = torch.randn(n // run.world, device=run.dev, dtype=torch.bfloat16)
    y = torch.empty(n // run.world * run.world, device=run.dev, dtype=torch.bfloat16)
    t = run.time(lambda: dist.all_gather_into_tensor(y, x), iters=2 if run.cpu else 5)
    run.record("links", dict(op="all_gather", MB_total=mb, seconds=t,
                             bus_GBps=mb * 1e6 * (run.world - 1) / run.world / t / 1e9))
    a = torch.randn(n // run.world // run.world * run.world, device=run.dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = run.time(lambda: dist.all_to_all_single(b, a), iters=2 if run.cpu else 5)
    sent = a.numel() * 2 * (run.world - 1) / run.world
    run.record("links", dict(op="all_to_all", MB_per_rank=a.numel() * 2 / 1e6, seconds=t, send_GBps=sent / t / 1e9))
    run.res["link_GBps"] = sent / t / 1e9


def _cost_model(run: Run):
    from blocksparse_fa.distributed import CostModel

    bw = run.res.get("link_GBps")
    return CostModel(bandwidth=bw * 1e9) if bw and not run.cpu else CostModel()


def _sq(a, b=None) -> float:
    """``Σ a²`` or ``Σ (a − b)²`` in float64."""
    a = a.double()
    return float(((a - b.double()) if b is not None else a).square().sum())


def _exact_slice(layout, q, k, v, do, max_rows: int):
    """Float64 output and dQ of the query rows that attend the last key block, and dK/dV of that
    block, from the full inputs (None when more than ``max_rows`` rows attend it)."""
    from blocksparse_fa.mask.expr import EvalContext

    n, (bm, bn) = layout.q_len, layout.block_size
    keys = torch.arange((layout.shape[-1] - 1) * bn, n)
    st = layout.block_states().cpu()
    st = st.reshape(-1, *st.shape[-2:]).amax(0)
    row_blocks = torch.nonzero(st[:, -1] != 0).flatten().tolist()
    if not row_blocks or len(row_blocks) * bm > max_rows:
        return None
    rows = torch.cat([torch.arange(r * bm, min((r + 1) * bm, n)) for r in row_blocks])
    mask = layout.mask
    G = q.shape[1] // k.shape[1]
    dev = q.device
    scale = 1.0 / math.sqrt(q.shape[-1])
    kd, vd = (t[0].double().repeat_interleave(G, 0) for t in (k, v))  # (H, n, D)
    outs, dqs = [], []
    dks = torch.zeros((q.shape[1], len(keys), q.shape[-1]), dtype=torch.float64, device=dev)
    dvs = torch.zeros_like(dks)
    kk = keys.to(dev)
    allk = torch.arange(n).view(1, -1)
    for c in range(0, len(rows), 256):
        r = rows[c:c + 256]
        keep = mask._eval(EvalContext(n, n, r.view(-1, 1), r.view(-1, 1), allk, None, None))
        keep = keep.expand(len(r), n).to(dev)
        qd, dod = q[0, :, r.to(dev)].double(), do[0, :, r.to(dev)].double()  # (H, r, D)
        s = (torch.einsum("hrd,hnd->hrn", qd, kd) * scale).masked_fill(~keep, float("-inf"))
        m = s.amax(-1, keepdim=True).clamp_min(-1e300)
        p = torch.exp(s - m)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
        o = torch.einsum("hrn,hnd->hrd", p, vd)
        ds = p * (torch.einsum("hrd,hnd->hrn", dod, vd) - (dod * o).sum(-1, keepdim=True))
        outs.append(o)
        dqs.append(torch.einsum("hrn,hnd->hrd", ds, kd) * scale)
        dks += torch.einsum("hrn,hrd->hnd", ds[:, :, kk], qd) * scale
        dvs += torch.einsum("hrn,hrd->hnd", p[:, :, kk], dod)
    Hkv = k.shape[1]  # GQA: a key/value head's gradient sums its query heads'
    return (rows, keys, torch.cat(outs, 1), torch.cat(dqs, 1), dks.view(Hkv, G, len(keys), -1).sum(1),
            dvs.view(Hkv, G, len(keys), -1).sum(1))


def _rel_slice(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def section_scaling(run: Run, n: int, names, small: bool, reserve: float = 0.0):
    """One GPU against P GPUs per mask: times, errors, memory, bytes (see the module docstring); a
    mask starts only if its estimate and ``reserve`` seconds (the later sections) fit."""
    dtype = torch.float32 if run.cpu else torch.bfloat16
    backend = "torch" if run.cpu else "auto"
    iters = 1 if run.cpu else 3
    block = 64 if small else 128
    masks = lead_masks(n, small)
    strategies = _strategies(run.args.strategy)
    for name, strategy in ((nm, st) for nm in names for st in strategies.get(nm, ["auto"])):
        est = 6 if run.cpu else 15 + (45 if name == "causal" else 5) * (n / 262144) ** 2
        if not run.fits(f"scaling {name} {_tokens(n)}", est + reserve):
            continue
        first = dict(backward=run.args.cp_backward) if run.args.cp_backward != "auto" else None
        for opts in (first, dict(forward="triton", backward="triton")):  # then without the Gluon kernels
            try:
                _scaling_row(run, n, name, masks[name], dtype, backend, iters, block, small, opts, strategy)
                break
            except Exception as e:  # noqa: BLE001
                run.error(f"scaling {name} {_tokens(n)}" + (f" kernel_options={opts}" if opts else ""), e)
            finally:
                if not run.cpu:
                    torch.cuda.empty_cache()
            if run.cpu or not run.fits(f"scaling {name} {_tokens(n)} on the Triton kernels", est):
                break


def _strategies(pairs) -> dict:
    """``{pattern: [strategy, ...]}`` from ``--strategy`` items ``pattern=s1,s2`` (others: the planner's)."""
    out = {}
    for item in pairs or ():
        name, sep, strategies = item.partition("=")
        if not sep or not strategies:
            raise ValueError(f"--strategy takes pattern=strategy[,strategy...], got {item!r}")
        out[name] = strategies.split(",")
    return out


def _scaling_row(run: Run, n, name, mask, dtype, backend, iters, block, small, opts=None, strategy="auto"):
    plan = plan_context_parallel(mask, n, run.world, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM, block_size=block,
                                 cost_model=_cost_model(run), strategy=strategy)
    est = plan.candidates[plan.strategy]
    row = dict(pattern=name, N=n, mask=str(mask), strategy=plan.strategy, overlap=bool(est.get("overlap", False)),
               kernel_options=opts,
               density=plan.layout.density, imbalance=est["imbalance"],
               candidates={k: dict(time_ms=v["time"] * 1e3, bytes=v["bytes"], imbalance=v["imbalance"])
                           for k, v in plan.candidates.items()})
    q, k, v, do = _qkv(n, run.dev, dtype)
    lay = plan.device_layout(run.dev)
    # one GPU (every rank alone on its own device)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))

    def single_fwd():
        with torch.no_grad():
            bsfa.attention(q, k, v, mask=lay, backend=backend)

    def single_fb():
        for t in (qa, ka, va):
            t.grad = None
        bsfa.attention(qa, ka, va, mask=lay, backend=backend).backward(do)

    row["T1_fwd_ms"] = run.time(single_fwd, iters) * 1e3
    run.reset_peak()
    row["T1_fb_ms"] = run.time(single_fb, iters) * 1e3
    row["peak_GiB_single"] = run.peak()
    ref = bsfa.attention(q, k, v, mask=lay, backend=backend).detach()
    # P GPUs
    idx = plan.indices(run.rank, run.dev)
    ql, kl, vl, dl = (t[:, :, idx].contiguous() for t in (q, k, v, do))
    qg, kg, vg = (t.clone().requires_grad_() for t in (ql, kl, vl))

    def cp_fwd():
        with torch.no_grad():
            context_parallel_attention(ql, kl, vl, plan=plan, backend=backend, kernel_options=opts)

    def cp_fb():
        for t in (qg, kg, vg):
            t.grad = None
        context_parallel_attention(qg, kg, vg, plan=plan, backend=backend, kernel_options=opts).backward(dl)

    # the default check="first": this first call checks the configuration, the timed ones skip it
    context_parallel_attention(ql, kl, vl, plan=plan, backend=backend, kernel_options=opts)
    t_f = run.time(cp_fwd, iters)
    run.reset_peak()
    t_fb = run.time(cp_fb, iters)
    peak = run.peak()
    row.update(TP_fwd_ms=t_f * 1e3, TP_fb_ms=t_fb * 1e3, eff_fwd=row["T1_fwd_ms"] / (run.world * t_f * 1e3),
               eff_fb=row["T1_fb_ms"] / (run.world * t_fb * 1e3))
    if any(len(r.remote_cols) for r in plan._ranks) and run.agree(run.left() > 60 + 8 * t_fb):
        other = not row["overlap"]  # the choice the plan did not make, to check it

        def cp_fwd_other():
            with torch.no_grad():
                context_parallel_attention(ql, kl, vl, plan=plan, backend=backend, check=False, overlap=other,
                                           kernel_options=opts)

        def cp_fb_other():
            for t in (qg, kg, vg):
                t.grad = None
            context_parallel_attention(qg, kg, vg, plan=plan, backend=backend, check=False, overlap=other,
                                       kernel_options=opts).backward(dl)
        row["TP_fwd_ms_other_overlap"] = run.time(cp_fwd_other, iters) * 1e3
        row["TP_fb_ms_other_overlap"] = run.time(cp_fb_other, iters) * 1e3
    if peak is not None:
        t = torch.tensor([peak], device=run.dev)
        parts = [torch.empty_like(t) for _ in range(run.world)]
        run.dist.all_gather(parts, t)
        row["peak_GiB_per_rank"] = [float(p) for p in parts]
    per = plan.bytes_per_rank() if plan.strategy != "ulysses" else None
    if per is not None:
        row.update(bytes_fb_max=max(x["fwd"] + x["bwd"] for x in per), ring_fb=max(x["ring_fwd"] + x["ring_bwd"]
                                                                                   for x in per),
                   tokens=[plan.local_len(r) for r in range(run.world)])
    # errors: context parallel against one GPU (relative L2 over the whole sequence)
    out = context_parallel_attention(qg, kg, vg, plan=plan, backend=backend, check=False, kernel_options=opts)
    for t in (qg, kg, vg):
        t.grad = None
    out.backward(dl)
    for t in (qa, ka, va):
        t.grad = None
    bsfa.attention(qa, ka, va, mask=lay, backend=backend).backward(do)
    mine = dict(out=out.detach(), dq=qg.grad, dk=kg.grad, dv=vg.grad)
    single = dict(out=ref, dq=qa.grad, dk=ka.grad, dv=va.grad)
    for key in mine:
        d2 = run.sum(_sq(mine[key], single[key][:, :, idx]))
        r2 = run.sum(_sq(single[key][:, :, idx]))
        row[f"{key}_vs_single"] = math.sqrt(d2 / max(r2, 1e-300))
    # both against float64 on a slice: the queries of the last key block, and that block's keys
    ex = _exact_slice(plan.layout, q, k, v, do, 4096 if not run.cpu else 512)
    if ex is not None:
        rows, keys, o64, dq64, dk64, dv64 = ex
        full = {key: plan.gather(t, 2) for key, t in mine.items()}
        rd, kd = rows.to(run.dev), keys.to(run.dev)
        for key, ref64, sel in (("out", o64, rd), ("dq", dq64, rd), ("dk", dk64, kd), ("dv", dv64, kd)):
            row[f"{key}_err_cp"] = _rel_slice(full[key][0][:, sel], ref64)
            row[f"{key}_err_single"] = _rel_slice(single[key][0][:, sel], ref64)
        row["slice_rows"] = len(rows)
        row["within_2x"] = all(row[f"{key}_err_cp"] <= 2 * row[f"{key}_err_single"] for key in mine)
    run.record("scaling", row)


def section_torch_cp(run: Run, n: int):
    """torch.distributed.tensor.experimental.context_parallel around SDPA (causal), beside ours."""
    import torch.nn.functional as F

    if run.cpu:
        run.record("torch_cp", dict(N=n, note="skipped on CPU (SDPA's flash and cuDNN kernels need CUDA)"))
        return
    if not run.fits(f"torch cp {_tokens(n)}", 30 * (n / 262144) ** 2 + 5 + (120 if "train" in run.args.sections
                                                                                  else 0)):
        return
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        run.record("torch_cp", dict(N=n, note=f"not available in torch {torch.__version__}: {e}"))
        return
    mesh = init_device_mesh("cuda", (run.world,))
    q, k, v, do = _qkv(n, run.dev, torch.bfloat16)
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, 1) for t in (k, v))  # SDPA's fused kernels: equal heads
    row = dict(N=n, heads=HEADS, kv_heads_expanded=HEADS)
    for label, backends in (("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("flash", [SDPBackend.FLASH_ATTENTION])):
        try:
            with sdpa_kernel(backends):
                qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))

                def single_fb():
                    F.scaled_dot_product_attention(qa, ka, va, is_causal=True).backward(do)

                def single_fwd():
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)
                row["T1_fwd_ms"] = run.time(single_fwd, 3) * 1e3
                row["T1_fb_ms"] = run.time(single_fb, 3) * 1e3
                del qa, ka, va
                bufs = [t.clone() for t in (q, k, v, do)]
                with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
                    ql, kl, vl, dl = bufs
                    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (ql, kl, vl))

                    def cp_fwd():
                        with torch.no_grad():
                            F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)

                    def cp_fb():
                        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(dl)
                    row["TP_fwd_ms"] = run.time(cp_fwd, 3) * 1e3
                    run.reset_peak()
                    row["TP_fb_ms"] = run.time(cp_fb, 3) * 1e3
                    row["peak_GiB"] = run.max(run.peak() or 0.0)
            row["backend"] = label
            row["eff_fwd"] = row["T1_fwd_ms"] / (run.world * row["TP_fwd_ms"])
            row["eff_fb"] = row["T1_fb_ms"] / (run.world * row["TP_fb_ms"])
            break
        except Exception as e:  # noqa: BLE001 - try the next SDPA backend
            row[f"{label}_error"] = f"{type(e).__name__}: {e}"[:300]
    ours = [r for r in run.res["sections"].get("scaling", []) if r["pattern"] == "causal" and r["N"] == n]
    if run.rank == 0 and ours and "TP_fb_ms" in row:
        row["ours_TP_fb_ms"] = ours[0]["TP_fb_ms"]
        row["ours_speedup_fb"] = row["TP_fb_ms"] / ours[0]["TP_fb_ms"]
        row["ours_speedup_fwd"] = row["TP_fwd_ms"] / ours[0]["TP_fwd_ms"]
    run.record("torch_cp", row)
    torch.cuda.empty_cache()


def _cp_kw(args) -> dict:
    """The context-parallel calls' overlap and backward kernels as the command line sets them."""
    kw = {} if args.cp_overlap == "auto" else dict(overlap=args.cp_overlap == "true")
    if args.cp_backward != "auto":
        kw["kernel_options"] = dict(backward=args.cp_backward)
    return kw


def section_train(run: Run, args):
    """Training throughput against one GPU (``benchmarks/train/cp.py``, :func:`cp_suite`)."""
    from train.cp import cp_suite
    from train.variants import Patterns

    factory = None
    if args.smoke or run.cpu:
        from train.cp import synthetic_stream

        pats = Patterns(block_size=32, sliding_window=64, longformer_window=32, longformer_global=32,
                        bigbird_window=32, bigbird_global=32, bigbird_random=1)
        config = dict(layers=1, d_model=32, heads=4, kv_heads=2, head_dim=8, probe_pairs=4)
        strong, weak, steps = 256 * run.world, 256, 3
        factory = synthetic_stream
    else:
        pats, config = Patterns(), {}
        strong, weak, steps = args.train_len, args.train_len // run.world, args.train_steps
    if not run.fits("training", 20 if run.cpu else 60):
        return
    rows = cp_suite(run.dist.group.WORLD, run.dev, args.train_patterns, strong_len=strong, weak_len=weak,
                    steps=steps, deadline=run.deadline - (5 if run.cpu else 30), config=config, pats=pats,
                    stream_factory=factory, log=lambda s: print(s, flush=True), cp_kw=_cp_kw(args))
    for r in rows:
        run.record("train", r)


SECTIONS = ("links", "scaling", "torch_cp", "train")


def cmd_run(args):
    run = Run(args)
    small = args.smoke
    n = args.n if not small else 512 * run.world
    want = set(args.sections)
    try:
        if "links" in want:
            try:
                section_links(run)
            except Exception as e:  # noqa: BLE001
                run.error("links", e)
        if "scaling" in want:
            reserve = 0.0 if run.cpu else (150.0 if "train" in want else 0.0) + (40.0 if "torch_cp" in want else 0.0)
            section_scaling(run, n, args.patterns, small, reserve)
        if "torch_cp" in want:
            section_torch_cp(run, n)
        if "train" in want:
            try:
                section_train(run, args)
            except Exception as e:  # noqa: BLE001
                run.error("train", e)
        run.sync()
    finally:
        if run.rank == 0:
            run.save()
            print(report(run.res), flush=True)
            print(summary(run.res), flush=True)
            print(f"results: {run.out}  ({time.monotonic() - run.t0:.0f} s)", flush=True)
            if args.update_docs:
                update_docs(run.res, args.docs, args.docs_data, args.mark)
    run.dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def _f(x, fmt="{:.2f}"):
    return "" if x is None else fmt.format(x)


def report(res: dict) -> str:
    """Markdown tables of a run: what the run measured, which machine and versions, the command."""
    P = res.get("world_size", 2)
    cpu = res.get("device") == "cpu"
    dt = "float32 (CPU, PyTorch backend)" if cpu else "bf16"
    lines = [f"Device: {P}x {res.get('device')}, torch {res.get('torch')}, triton {res.get('triton')}; {dt}, one "
             f"sequence, {HEADS} query / {KV_HEADS} key-value heads, head dim {HEAD_DIM}. NCCL_NVLS_ENABLE="
             f"{res.get('env', {}).get('NCCL_NVLS_ENABLE')}; message steps: {res.get('messages', 'p2p')}.", "",
             f"Command: `torchrun --nproc-per-node {P} {res.get('command', '')}`", ""]
    for r in res.get("sections", {}).get("links", []):
        if r["op"] == "all_gather":
            lines.append(f"- all-gather of {r['MB_total']} MB: {r['bus_GBps']:.0f} GB/s bus bandwidth")
        else:
            lines.append(f"- all-to-all of {r['MB_per_rank']:.0f} MB per rank: {r['send_GBps']:.0f} GB/s sent per rank")
    sc = res.get("sections", {}).get("scaling", [])
    if sc:
        timing = f"; {res['timing']}" if res.get("timing") else ""
        lines += ["", f"**Strong scaling** (times in ms, slowest rank{timing}; `eff` = T1 / ({P} · T{P}); `ovl`: fetch "
                  "overlapped with the own-key launch; MB = most any rank sends per fwd+bwd):", "",
                  f"| pattern | N | strategy | ovl | imbalance | T1 fwd | T{P} fwd | eff fwd | T1 fwd+bwd | "
                  f"T{P} fwd+bwd | eff fwd+bwd | T{P} fwd / fwd+bwd, other ovl | MB sent | "
                  "peak GiB 1 GPU / per rank (max) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sc:
            peaks = r.get("peak_GiB_per_rank")
            lines.append(
                f"| {r['pattern']} | {_tokens(r['N'])} | {r['strategy']}{' (Triton)' if r.get('kernel_options') else ''} | "
                f"{'yes' if r.get('overlap') else 'no'} | "
                f"{r.get('imbalance', 0):.3f} | {_f(r.get('T1_fwd_ms'))} | {_f(r.get('TP_fwd_ms'))} | "
                f"{_f(r.get('eff_fwd'))} | {_f(r.get('T1_fb_ms'))} | {_f(r.get('TP_fb_ms'))} | {_f(r.get('eff_fb'))} | "
                f"{_f(r.get('TP_fwd_ms_other_overlap'))} / {_f(r.get('TP_fb_ms_other_overlap'))} | "
                f"{_f(r['bytes_fb_max'] / 1e6 if r.get('bytes_fb_max') else None, '{:.1f}')} | "
                f"{_f(r.get('peak_GiB_single'))} / {_f(max(peaks) if peaks else None)} |")
        lines += ["", "**Errors** (relative L2; `vs 1 GPU`: context parallel against the one-GPU run on the same "
                  "inputs, whole sequence; `cp / 1 GPU vs fp64`: each against float64 on the queries of the last "
                  "key block and that block's keys):", "",
                  "| pattern | out vs 1 GPU | dq | dk | dv | out cp / 1 GPU vs fp64 | dq | dk | dv | within 2x |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        repeated = {r["pattern"] for r in sc if sum(x["pattern"] == r["pattern"] for x in sc) > 1}
        for r in sc:
            pair = lambda key: (f"{r[key + '_err_cp']:.1e} / {r[key + '_err_single']:.1e}"  # noqa: E731
                                if key + "_err_cp" in r else "")
            label = f"{r['pattern']} ({r['strategy']})" if r["pattern"] in repeated else r["pattern"]
            lines.append(f"| {label} | {_f(r.get('out_vs_single'), '{:.1e}')} | "
                         f"{_f(r.get('dq_vs_single'), '{:.1e}')} | {_f(r.get('dk_vs_single'), '{:.1e}')} | "
                         f"{_f(r.get('dv_vs_single'), '{:.1e}')} | {pair('out')} | {pair('dq')} | {pair('dk')} | "
                         f"{pair('dv')} | {'' if 'within_2x' not in r else 'yes' if r['within_2x'] else 'no'} |")
    tcp = [r for r in res.get("sections", {}).get("torch_cp", []) if "TP_fb_ms" in r or "note" in r]
    if tcp:
        lines += ["", f"**torch `context_parallel`** (SDPA, causal, K/V expanded to {HEADS} heads; all-gather "
                  "rotation) beside ours (causal, GQA 8/2), ms:", "",
                  f"| N | SDPA backend | SDPA 1 GPU fwd / fwd+bwd | torch CP fwd / fwd+bwd | torch eff fwd+bwd | "
                  f"ours T{P} fwd+bwd | ours faster by |", "|---|---|---|---|---|---|---|"]
        for r in tcp:
            if "note" in r:
                lines.append(f"| {_tokens(r['N'])} | {r['note']} | | | | | |")
                continue
            lines.append(f"| {_tokens(r['N'])} | {r.get('backend')} | {_f(r.get('T1_fwd_ms'))} / "
                         f"{_f(r.get('T1_fb_ms'))} | {_f(r.get('TP_fwd_ms'))} / {_f(r.get('TP_fb_ms'))} | "
                         f"{_f(r.get('eff_fb'))} | {_f(r.get('ours_TP_fb_ms'))} | "
                         f"{_f(r.get('ours_speedup_fb'), '{:.2f}x')} |")
    tr = res.get("sections", {}).get("train", [])
    if tr:
        lines += ["", "**Training** (`benchmarks/train/cp.py`: the decoder, eager, bf16 autocast; tokens/s of the "
                  "slowest rank; strong: the same length on one GPU; weak: the length / P on one GPU):", "",
                  "| pattern | length | 1 GPU tok/s | 1 GPU tok/s at length / P | "
                  f"{P} GPUs tok/s | strong eff | weak eff | peak GiB 1 GPU / per rank (max) | "
                  "max rel. loss diff |", "|---|---|---|---|---|---|---|---|---|"]
        for r in tr:
            if "cp" not in r:
                lines.append(f"| {r['pattern']} | {_tokens(r['strong_len'])} | {r.get('skipped') or r.get('error')} "
                             "| | | | | | |")
                continue
            sw = r.get("single_weak") or {}
            lines.append(f"| {r['pattern']} | {_tokens(r['strong_len'])} | {r['single_strong']['tokens_per_s']:,.0f} | "
                         f"{_f(sw.get('tokens_per_s'), '{:,.0f}')} | {r['cp']['tokens_per_s']:,.0f} | "
                         f"{r['strong_efficiency']:.2f} | {_f(r.get('weak_efficiency'))} | "
                         f"{max(r['single_strong']['peak_gb']):.1f} / {max(r['cp']['peak_gb']):.1f} | "
                         f"{r['max_rel_loss_diff']:.1e} |")
    if res.get("skipped"):
        lines += ["", "Skipped (deadline): " + "; ".join(res["skipped"])]
    if res.get("errors"):
        lines += ["", "Errors: " + "; ".join(res["errors"])]
    return "\n".join(lines)


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def summary(res: dict) -> str:
    """One short table: the targets and where the run stands."""
    P = res.get("world_size", 2)
    lines = [f"SUMMARY ({P}x {res.get('device')}, {res.get('elapsed_s', 0):.0f} s)",
             f"{'pattern':15s} {'strategy':10s} {'eff fwd':>8s} {'eff fb':>8s} {'TP fb ms':>10s} {'err vs 1':>9s} "
             f"{'<=2x':>5s}"]
    for r in res.get("sections", {}).get("scaling", []):
        err = max(r.get(f"{k}_vs_single", 0.0) for k in ("out", "dq", "dk", "dv"))
        lines.append(f"{r['pattern']:15s} {r['strategy']:10s} {_f(r.get('eff_fwd')):>8s} {_f(r.get('eff_fb')):>8s} "
                     f"{_f(r.get('TP_fb_ms')):>10s} {err:9.1e} {str(r.get('within_2x', '')):>5s}")
    for r in res.get("sections", {}).get("torch_cp", []):
        if "ours_speedup_fb" in r:
            lines.append(f"torch CP causal fwd+bwd {r['TP_fb_ms']:.1f} ms ({r.get('backend')}); ours "
                         f"{r['ours_TP_fb_ms']:.1f} ms: {r['ours_speedup_fb']:.2f}x")
    for r in res.get("sections", {}).get("train", []):
        if "cp" in r:
            lines.append(f"train {r['pattern']:11s} strong eff {r['strong_efficiency']:.2f}  weak eff "
                         f"{_f(r.get('weak_efficiency'))}  {r['cp']['tokens_per_s']:,.0f} tok/s on {P}  "
                         f"loss diff {r['max_rel_loss_diff']:.1e}")
        else:
            lines.append(f"train {r['pattern']:11s} {r.get('skipped') or r.get('error')}")
    if res.get("skipped"):
        lines.append("skipped: " + "; ".join(res["skipped"]))
    if res.get("errors"):
        lines.append("errors: " + "; ".join(e[:200] for e in res["errors"]))
    return "\n".join(lines)


def update_docs(res: dict, docs: str = DOCS, data: str | None = DOCS_DATA, mark: str = RESULTS_MARK) -> None:
    """Rewrite a results section of ``docs`` from a run (from the line ``mark`` to the next results
    mark, ``###`` heading or the testing section), and keep the run's JSON in ``data``."""
    with open(docs) as f:
        doc = f.read()
    if "\n" + mark + "\n" not in doc or RESULTS_END not in doc:
        raise ValueError(f"{docs}: no results section (a line {mark!r}, then {RESULTS_END!r})")
    a = doc.index("\n" + mark + "\n") + len(mark) + 1
    b = min(i for i in (doc.find("\n<!-- results", a), doc.find("\n### ", a), doc.index(RESULTS_END)) if i >= 0)
    with open(docs, "w") as f:
        f.write(doc[:a] + "\n" + report(res) + "\n\n" + doc[b:].lstrip("\n"))
    if data:
        os.makedirs(os.path.dirname(data), exist_ok=True)
        with open(data, "w") as f:
            json.dump(res, f, indent=1, default=str)


def cmd_report(args):
    with open(args.json) as f:
        res = json.load(f)
    print(report(res))
    if args.update_docs:
        update_docs(res, args.docs, args.docs_data, args.mark)


def cmd_summary(args):
    with open(args.json) as f:
        print(summary(json.load(f)))


# ------------------------------------------------------------------------------------------------
# plans (CPU)
# ------------------------------------------------------------------------------------------------
def cmd_plans(args):
    rows = []
    print("| pattern | N | ranks | strategy | overlap | split rows | imbalance (max / mean cost) | tokens min-max "
          "| MB sent fwd+bwd (max rank) | % of ring | est. ms (compute + comm + glue) | candidates (est. ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.lengths:
        masks = lead_masks(n)
        for name in args.patterns:
            for P in args.world:
                t = time.perf_counter()
                plan = plan_context_parallel(masks[name], n, P, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM)
                est = plan.candidates[plan.strategy]
                fb = est["bytes"]
                cands = ", ".join(f"{k} {v['time'] * 1e3:.1f}" for k, v in plan.candidates.items())
                rows.append(dict(pattern=name, N=n, world=P, strategy=plan.strategy, overlap=est.get("overlap"),
                                 split=len(plan.split), imbalance=est["imbalance"], bytes_fb=fb,
                                 ring_fb=est["ring_bytes"], tokens=(est["tokens_min"], est["tokens_max"]),
                                 time_ms=est["time"] * 1e3, candidates={k: v["time"] * 1e3 for k, v in
                                                                        plan.candidates.items()},
                                 plan_s=time.perf_counter() - t))
                print(f"| {name} | {n // 1024}K | {P} | {plan.strategy} | {'yes' if est.get('overlap') else 'no'} | "
                      f"{len(plan.split)} | {est['imbalance']:.3f} | {est['tokens_min']}-{est['tokens_max']} | "
                      f"{fb / 1e6:.1f} | {100 * fb / est['ring_bytes']:.1f} | {est['time'] * 1e3:.1f} "
                      f"({est['compute'] * 1e3:.1f} + {est['comm'] * 1e3:.2f} + {est.get('glue', 0) * 1e3:.2f}) | "
                      f"{cands} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure (under torchrun; --device cpu for gloo on CPU processes)")
    r.add_argument("--out", default=os.environ.get("OUT", "."))
    r.add_argument("--deadline", type=float, default=480.0,
                   help="seconds for the whole run: what would not fit is skipped (recorded in the results)")
    r.add_argument("--n", type=int, default=262144, help="tokens of the scaling runs")
    r.add_argument("--patterns", nargs="+", default=list(LEAD), choices=PATTERNS)
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                   help="which measurements (default: all, most important first)")
    r.add_argument("--train-len", type=int, default=262144, help="training: tokens per sequence (strong scaling)")
    r.add_argument("--train-steps", type=int, default=5, help="training steps per run (2 untimed)")
    r.add_argument("--train-patterns", nargs="+", default=["causal", "documents", "longformer"])
    r.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check of the whole script)")
    r.add_argument("--cp-backward", default="auto", choices=["auto", "triton", "gluon"],
                   help="kernel_options backward= of the context-parallel calls (scaling and training)")
    r.add_argument("--cp-overlap", default="auto", choices=["auto", "true", "false"],
                   help="overlap= of the context-parallel training calls")
    r.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    r.add_argument("--strategy", nargs="*", default=[],
                   help="pattern=strategy[,strategy...]: scaling rows with these plans (one row each) instead of "
                        "the planner's choice, e.g. bigbird=zigzag,greedy,contiguous")
    r.add_argument("--fill", type=float, default=0.25,
                   help="seconds of back-to-back calls per timing on GPUs (at most 100 calls; 0: 3 calls)")
    r.add_argument("--update-docs", action="store_true",
                   help="rewrite the results section of docs/distributed.md and docs/data/context_parallel.json")
    r.add_argument("--docs", default=DOCS, help=argparse.SUPPRESS)
    r.add_argument("--docs-data", default=DOCS_DATA, help=argparse.SUPPRESS)
    r.add_argument("--mark", default=RESULTS_MARK, help="the results section to rewrite (its HTML comment)")
    r.set_defaults(fn=cmd_run)
    p = sub.add_parser("report", help="Markdown tables from a run's JSON")
    p.add_argument("json")
    p.add_argument("--update-docs", action="store_true", help="rewrite the results section of docs/distributed.md")
    p.add_argument("--docs", default=DOCS, help=argparse.SUPPRESS)
    p.add_argument("--docs-data", default=DOCS_DATA, help=argparse.SUPPRESS)
    p.add_argument("--mark", default=RESULTS_MARK, help="the results section to rewrite (its HTML comment)")
    p.set_defaults(fn=cmd_report)
    s = sub.add_parser("summary", help="the short table of a run's JSON")
    s.add_argument("json")
    s.set_defaults(fn=cmd_summary)
    q = sub.add_parser("plans", help="balance and bytes per rank from the plans (CPU)")
    q.add_argument("--lengths", type=int, nargs="+", default=[262144])
    q.add_argument("--world", type=int, nargs="+", default=[4, 8])
    q.add_argument("--patterns", nargs="+", default=list(LEAD), choices=PATTERNS)
    q.add_argument("--json", default=None)
    q.set_defaults(fn=cmd_plans)
    args = ap.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
