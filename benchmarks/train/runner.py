"""Training loop of one variant at one length: timing, evaluation, profiling, failure handling,
and the time planning of an invocation with a deadline.

Timing. Setup (model, optimiser, the variant's block masks or layouts, evaluation data) is timed
as ``setup_s`` (with ``setup_detail``). The first ``sync_steps`` steps (compilation, autotuning,
first-touch allocation) are timed on the host with a synchronisation after each; their excess over
the steady median is reported as ``compile_s``. Later steps are timed with CUDA events and never
synchronise (the loss is read only every ``log_every`` steps and at evaluations), so the host runs
ahead as a real training loop does. A step's time runs from its start event to the next step's
start event, so host work between steps (batch copy, per-batch masks: ``prep_ms``) counts.
Tokens/s = tokens per step / median step time. The wall-clock axis of the curves is the cumulative
step time with the compile steps counted at the median. Neither setup, compilation, evaluation
nor profiling counts as training time.

Steps. ``steps`` is the planned number of steps: it fixes the learning-rate schedule and the
evaluation cadence of every variant. ``max_steps`` (and a planner, see :func:`plan_steps`) can end a
variant earlier; the schedule is not rescaled, so variants that run the same number of steps have
had exactly the same learning rates and batches, and are compared at equal steps.

Deadline. A variant stops early when the next step, its final evaluation, the profile and a reserve
would not fit before the deadline. The check uses the measured time of a step *after* compilation
(the compile step is never taken for the step time), so a long first compile does not stop a
variant after one step.

Evaluation runs the training forward (grad enabled, same compiled graphs: no recompilation) on
fixed held-out batches and discards the graph; its time is not training time.

GPU busy: ``torch.profiler`` over ``profile_steps`` extra steps after training; the union of the
device activity intervals (kernels, copies, memsets) divided by the wall time of those steps.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import peers
import torch

from .data import ANSWER, TEXT, VOCAB, Prefetcher, ProbeSpec, TrainStream, eval_batches, probe_spec
from .model import Decoder, rope_tables
from .variants import Patterns, Variant, block_density

LN2 = math.log(2.0)


@dataclass
class RunConfig:
    device: str = "cuda"
    seq_len: int = 65536
    batch: int = 1
    layers: int = 8
    d_model: int = 1024
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    rope_base: float = 500000.0
    steps: int = 120  # planned steps: learning-rate schedule and evaluation cadence
    max_steps: int = 0  # run at most this many (0 = steps); the schedule still spans ``steps``
    lr: float = 1e-3
    warmup: int = 12
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    time_budget: float = 0.0  # seconds of training per variant, 0 = none
    eval_every: int = 20  # 0 = evaluate at the end only; <0 = never (throughput runs)
    eval_windows: int = 2
    eval_probes: int = 2
    probe_rate: float = 0.25
    probe_pairs: int = 16
    probe_rounds: int = 8
    probe_reach: int = 0  # 0 = layers x the widest window hop
    probe_weight: float = 1.0
    held_out_permille: int = 30
    compile: bool = True
    compile_scope: str = "block"  # block (regional) or model
    compile_mode: str = "default"
    compile_backend: str = "inductor"
    bsfa_mode: str = "auto"  # auto, op, island
    bsfa_api: str = "module"
    bsfa_kernel_options: str = ""  # JSON: blocksparse_fa's per-call kernel_options (empty: the defaults)
    sync_steps: int = 2
    profile_steps: int = 3
    log_every: int = 10
    seed: int = 0
    mode: str = "train"  # train or throughput
    flex_block_mask: str = "layout"  # layout (block states -> BlockMask.from_kv_blocks) or create
    deadline_reserve: float = 10.0  # seconds kept free before the deadline (cleanup, writing results)

    @property
    def run_steps(self) -> int:
        """Steps this variant runs (``min(steps, max_steps)``)."""
        return min(self.steps, self.max_steps) if self.max_steps > 0 else self.steps

    def reach(self, pats: Patterns) -> int:
        return self.probe_reach or self.layers * pats.max_hop()

    def as_dict(self) -> dict:
        return asdict(self)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def lr_at(step: int, cfg: RunConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:400] if msg else ''}"


# ------------------------------------------------------------------------------------------------
# profiling
# ------------------------------------------------------------------------------------------------
_ATTN_KERNELS = {"sdpa": r"sdpa|fmha|flash|attention|cudnn",
                 "fa4": r"flash|fmha|attention|cute",
                 "flex": r"triton_tem|flex",
                 "flexflash": r"flash|fmha|attention|cute|triton_tem|flex",
                 "bsfa": r"_attn_|_merge_residue|_sum_partials|_dkdv|_dq_"}


def gpu_busy(step_fn, n: int, dev: torch.device, impl: str) -> dict | None:
    """Device-busy fraction over ``n`` calls of ``step_fn`` (CUDA only; None elsewhere)."""
    if dev.type != "cuda" or n <= 0:
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step_fn()
        _sync(dev)
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            events = json.load(f).get("traceEvents", [])
    iv, by_name = [], {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            iv.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
            by_name[e["name"]] = by_name.get(e["name"], 0.0) + float(e["dur"])
    if not iv:
        return None  # no device activity recorded (no CUPTI?)
    iv.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    pat = re.compile(_ATTN_KERNELS.get(impl, r"$^"), re.I)
    attn = sum(v for k, v in by_name.items() if pat.search(k))
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {"busy_fraction": min(1.0, busy / (wall * 1e6)), "device_ms_per_step": busy / 1e3 / n,
            "wall_ms_per_step": wall * 1e3 / n, "attention_kernel_ms_per_step": attn / 1e3 / n,
            "kernels_per_step": len(iv) / n, "steps": n,
            "top_kernels": [{"name": k[:120], "ms_per_step": v / 1e3 / n} for k, v in top]}


# ------------------------------------------------------------------------------------------------
# one variant
# ------------------------------------------------------------------------------------------------
class _Setup:
    """Model, optimiser, variant and data of one attempt (rebuilt from the seed on a retry).
    ``detail`` holds the seconds each part of the setup took."""

    def __init__(self, name: str, cfg: RunConfig, pats: Patterns, corpus, spec: ProbeSpec, bsfa_mode: str):
        dev = torch.device(cfg.device)
        self.dev = dev
        self.detail = {}
        t = time.perf_counter()
        torch._dynamo.reset()
        compiled = cfg.compile
        self.variant = Variant(name, cfg.seq_len, pats, dev, compiled=compiled, bsfa_mode=bsfa_mode,
                               bsfa_api=cfg.bsfa_api, bsfa_kernel_options=cfg.bsfa_kernel_options,
                               heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                               flex_block_mask=cfg.flex_block_mask)
        self.detail["variant_s"] = time.perf_counter() - t  # attention core, static block masks / layouts
        t = time.perf_counter()
        torch.manual_seed(cfg.seed)  # identical initial weights for every variant
        model = Decoder(VOCAB, cfg.d_model, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim, self.variant.core)
        self.model = model.to(dev)
        self.n_params = model.n_params()
        self.init_checksum = float(sum(p.detach().double().abs().sum() for p in model.parameters()))
        kw = {"backend": cfg.compile_backend}
        if cfg.compile_mode != "default":
            kw["mode"] = cfg.compile_mode
        if compiled and cfg.compile_scope == "block":
            model.compile_regions(fullgraph=self.variant.fullgraph, **kw)
            self.fwd = model
        elif compiled:
            self.fwd = torch.compile(model, fullgraph=self.variant.fullgraph, dynamic=False, **kw)
        else:
            self.fwd = model
        decay = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("emb")]
        other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith("emb"))]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
        self.params = list(model.parameters())
        self.cos, self.sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_base, dev)
        self.amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" \
            else torch.autocast("cpu", enabled=False)
        self.detail["model_s"] = time.perf_counter() - t
        t = time.perf_counter()
        self.stream = Prefetcher(TrainStream(corpus, cfg.seq_len, cfg.batch, spec, cfg.probe_rate, cfg.probe_weight,
                                             seed=cfg.seed + 1), pin=dev.type == "cuda")
        self.detail["data_s"] = time.perf_counter() - t
        self.cfg = cfg
        self.prep_s: list = []  # host seconds of the per-batch argument (block mask, layout) per step

    def step(self, step_index: int):
        cfg = self.cfg
        b_cpu = self.stream.next()
        b = b_cpu.to(self.dev, non_blocking=True)
        t = time.perf_counter()
        arg = self.variant.arg(b_cpu, b)
        self.prep_s.append(time.perf_counter() - t)
        lr = lr_at(step_index, cfg)
        for g in self.opt.param_groups:
            g["lr"] = lr
        with self.amp:
            loss, _, _ = self.fwd(b.tokens, b.targets, b.weights, self.cos, self.sin, arg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach(), b_cpu.n_probe

    def forward_eval(self, b_cpu, b):
        arg = self.variant.arg(b_cpu, b)
        with self.amp:
            _, ce, correct = self.fwd(b.tokens, b.targets, b.weights, self.cos, self.sin, arg)
        return ce, correct

    def close(self):
        self.stream.close()


def _evaluate(setup: _Setup, text_evals, probe_evals) -> dict:
    """Held-out bits per byte (text windows) and probe accuracy (probe sequences)."""
    dev = setup.dev
    ce_sum = torch.zeros((), dtype=torch.float64, device=dev)
    n_text = 0
    for bc, bd in text_evals:
        ce, _ = setup.forward_eval(bc, bd)
        m = bd.kind == TEXT
        ce_sum += (ce.double() * m).sum()
        n_text += int((bc.kind == TEXT).sum())
    hit = torch.zeros((), dtype=torch.int64, device=dev)
    n_ans = 0
    probe_ce = torch.zeros((), dtype=torch.float64, device=dev)
    for bc, bd in probe_evals:
        ce, correct = setup.forward_eval(bc, bd)
        m = bd.kind == ANSWER
        hit += (correct & m).sum()
        probe_ce += (ce.double() * m).sum()
        n_ans += int((bc.kind == ANSWER).sum())
    out = {"bpb": float(ce_sum) / max(1, n_text) / LN2 if n_text else None,
           "probe_acc": float(hit) / n_ans if n_ans else None,
           "probe_ce": float(probe_ce) / n_ans if n_ans else None, "text_tokens": n_text, "probe_answers": n_ans}
    return out


def unavailable(impl: str, dev: torch.device) -> str | None:
    """Why an implementation cannot train here (``None``: it can)."""
    if impl in ("flex", "flexflash") and dev.type != "cuda":
        return "FlexAttention has no backward on CPU"
    if impl in ("fa4", "flexflash"):
        return peers.status(dev)["fa4" if impl == "fa4" else "flex_flash"]
    return None


def variant_density(name: str, cfg: RunConfig, pats: Patterns, corpus) -> tuple:
    """``(block density, note)`` of a variant's pattern at ``cfg.seq_len`` (documents: of the first
    held-out window); ``(None, error)`` when it cannot be computed."""
    fam = name.split("_", 1)[1]
    try:
        if fam == "documents":
            spec = probe_spec(cfg.seq_len, cfg.probe_pairs, cfg.reach(pats), cfg.probe_rounds)
            doc0 = eval_batches(corpus, cfg.seq_len, cfg.batch, spec, 1, 0)[0].doc
            return block_density(pats, fam, cfg.seq_len, doc0), "of the first held-out window"
        return block_density(pats, fam, cfg.seq_len), None
    except Exception as e:  # noqa: BLE001
        return None, _short(e)


# ------------------------------------------------------------------------------------------------
# planning under a deadline
# ------------------------------------------------------------------------------------------------
def eval_cost_s(cfg: RunConfig, step_s: float) -> float:
    """Estimated seconds of one evaluation: a forward (about a third of a training step) per
    held-out batch."""
    if cfg.eval_every < 0:
        return 0.0
    n = -(-cfg.eval_windows // cfg.batch) + (-(-cfg.eval_probes // cfg.batch) if cfg.eval_probes else 0)
    return n * step_s / 3 + 0.2


def tail_s(cfg: RunConfig, step_s: float, eval_s: float = 0.0, reserve: bool = True) -> float:
    """Seconds a variant needs after its last step: final evaluation (the larger of ``eval_s``, a
    measured one, and the estimate), profile and (``reserve``) the deadline reserve."""
    prof = (cfg.profile_steps * step_s + 3.0) if cfg.device.startswith("cuda") and cfg.profile_steps > 0 else 0.0
    ev = max(eval_s, eval_cost_s(cfg, step_s)) if cfg.eval_every >= 0 else 0.0
    return ev + prof + (cfg.deadline_reserve if reserve else 0.0)


def plan_steps(step_s: float, now: float, deadline: float, cfg: RunConfig, later: list, done: int = 0) -> int:
    """Most steps the running variant can take so that it, and the ``later`` variants that must
    run the same number of steps, finish before ``deadline``.

    Args:
        step_s: measured seconds per training step of the running variant (after compilation).
        now, deadline: ``time.perf_counter()`` values.
        cfg: the running variant's configuration (evaluation cadence, profile steps, reserve).
        later: ``(overhead_s, step_ratio)`` of each later variant: its setup + compilation +
            profile seconds and its step time relative to ``step_s``.
        done: steps the running variant has already taken.

    Returns:
        A step count ``>= done`` (``done`` when nothing more fits).
    """
    every = cfg.eval_every if cfg.eval_every > 0 else 0
    per_step_eval = eval_cost_s(cfg, step_s) / every if every else 0.0
    budget = deadline - now - tail_s(cfg, step_s)
    per_step = step_s + per_step_eval  # the running variant, from now on
    fixed = 0.0
    shared = 0.0  # seconds per step of the whole run that the later variants add
    for overhead, ratio in later:
        t = step_s * ratio
        fixed += overhead + tail_s(cfg, t, reserve=False)
        shared += t + (eval_cost_s(cfg, t) / every if every else 0.0)
    # the running variant takes (n - done) more steps, every later one takes n steps
    n = (budget - fixed + done * per_step) / (per_step + shared) if per_step + shared > 0 else float("inf")
    if not math.isfinite(n):
        return cfg.run_steps
    return max(done, min(cfg.run_steps, int(n)))


def estimate_step_s(density: float | None, impl: str, L: int, results: list) -> float | None:
    """Seconds per step of a variant not yet run, from finished ones: the same implementation
    (else any) at the nearest length, then the nearest block density, scaled by the larger of the
    length ratio (the rest of the model) and the ratio of attended pairs (density x length^2).
    ``None`` when nothing was measured."""
    ok = [r for r in results if r.get("status") == "ok" and r.get("median_step_ms") and r.get("seq_len")]
    if not ok:
        return None
    same = [r for r in ok if r.get("impl") == impl] or ok
    d = density if density is not None else 0.5

    def dist(r):
        rd = r.get("block_density")
        return (abs(math.log(L / r["seq_len"])),
                abs(math.log((0.05 + d) / (0.05 + rd))) if rd is not None else 1e9)

    ref = min(same, key=dist)
    rd = ref.get("block_density") or d
    lr = L / ref["seq_len"]
    scale = max(lr, (0.05 + d) / (0.05 + rd) * lr * lr)
    return ref["median_step_ms"] / 1e3 * min(64.0, max(0.4, scale))


DEFAULT_OVERHEAD_S = 45.0  # setup + compilation + profile of a variant before one was measured (H100)


def estimate_overhead_s(impl: str, results: list, default: float = DEFAULT_OVERHEAD_S) -> float:
    """Setup + compilation + profile seconds of a variant not yet run: the largest measured for the
    same implementation (else for any), else ``default``."""
    ok = [r for r in results if r.get("status") == "ok" and r.get("overhead_s") is not None]
    same = [r for r in ok if r.get("impl") == impl] or ok
    return max((r["overhead_s"] for r in same), default=default)


# ------------------------------------------------------------------------------------------------
# one variant
# ------------------------------------------------------------------------------------------------
def train_variant(name: str, cfg: RunConfig, pats: Patterns, corpus, log, deadline: float | None = None,
                  plan: Callable | None = None, density: tuple | None = None) -> dict:
    """Train (or time) one variant at ``cfg.seq_len``; never raises for OOM or compile failures:
    the result's ``status`` says what happened.

    Args:
        deadline: ``time.perf_counter()`` value by which the variant must have finished.
        plan: ``plan(step_s, now, done, overhead_s) -> steps``, asked once the step time after
            compilation is measured (``overhead_s``: this variant's setup and compilation seconds;
            see :func:`plan_steps`); the variant then runs at most that many steps.
        density: ``(block density, note)`` if already computed (:func:`variant_density`).
    """
    dev = torch.device(cfg.device)
    spec = probe_spec(cfg.seq_len, cfg.probe_pairs, cfg.reach(pats), cfg.probe_rounds)
    base = {"variant": name, "impl": name.split("_")[0], "family": name.split("_", 1)[1], "seq_len": cfg.seq_len,
            "mode": cfg.mode, "batch": cfg.batch, "tokens_per_step": cfg.batch * cfg.seq_len,
            "steps_planned": cfg.steps}
    dens, note = density if density is not None else variant_density(name, cfg, pats, corpus)
    base["block_density"] = dens
    if note:
        base["block_density_note"] = note
    why = unavailable(base["impl"], dev)
    if why:
        return {**base, "status": "skipped", "reason": why}
    modes = ["op", "island"] if cfg.bsfa_mode == "auto" else [cfg.bsfa_mode]
    if base["impl"] != "bsfa" or not cfg.compile:
        modes = modes[:1]
    notes = []
    for i, bmode in enumerate(modes):
        last = i == len(modes) - 1
        res = _attempt(name, cfg, pats, corpus, spec, bmode, log, deadline, plan, retry_ok=not last)
        if res.get("status") == "retry":
            notes.append(f"bsfa_mode={bmode} failed at the first step: {res['error']}")
            log(f"  {name}: {notes[-1]}; retrying with bsfa_mode={modes[i + 1]}")
            continue
        if notes:
            res["compile_notes"] = notes
        return {**base, **res}
    raise AssertionError("unreachable")


def _cleanup(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


PLAN_AFTER = 3  # timed steps after compilation before the planner is asked


def _dynamo_delta(dyn: list) -> dict:
    """Graphs compiled by the first step and after it (recompiles: a per-batch mask that changes
    the graph shows up here), graph breaks, from counts taken before, after the first step and now."""
    end = peers.dynamo_counts()
    first = dyn[1] if len(dyn) > 1 else end
    return {"graphs_first_step": first["graphs"] - dyn[0]["graphs"], "recompiles": end["graphs"] - first["graphs"],
            "graph_breaks": end["graph_breaks"] - dyn[0]["graph_breaks"]}


def _attempt(name, cfg: RunConfig, pats, corpus, spec, bsfa_mode, log, deadline, plan, retry_ok) -> dict:
    dev = torch.device(cfg.device)
    cuda = dev.type == "cuda"
    _cleanup(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t_setup = time.perf_counter()
    setup = None
    step = -1
    n_done = 0
    out: dict = {}
    dyn = [peers.dynamo_counts()]  # Dynamo's counts before the first step, after it, at the end
    try:
        setup = _Setup(name, cfg, pats, corpus, spec, bsfa_mode)
        out.update({"info": setup.variant.info, "fullgraph": setup.variant.fullgraph, "n_params": setup.n_params,
                    "init_checksum": setup.init_checksum, "probe": {"rounds": list(spec.rounds), "reach": spec.reach,
                                                                    "pairs": spec.n_pairs,
                                                                    "window_reachable": spec.window_reachable}})
        evaluate = cfg.eval_every >= 0
        t = time.perf_counter()
        if evaluate:
            te = eval_batches(corpus, cfg.seq_len, cfg.batch, spec, cfg.eval_windows, 0)
            pe = eval_batches(corpus, cfg.seq_len, cfg.batch, spec, 0, cfg.eval_probes) if cfg.eval_probes else []
            text_evals = [(b, b.to(dev)) for b in te]
            probe_evals = [(b, b.to(dev)) for b in pe]
        setup.detail["eval_data_s"] = time.perf_counter() - t
        setup_s = time.perf_counter() - t_setup
        target = cfg.run_steps
        cap_reason = "max_steps" if target < cfg.steps else None

        losses = torch.zeros(target, dtype=torch.float32, device=dev)
        host_s = []  # synchronised timings of the first steps
        starts, ends = [], []  # CUDA events (or host times on CPU) of the later steps
        evals, probe_steps = [], 0
        stopped = "steps"
        t_train0 = time.perf_counter()
        eval_s = 0.0
        last_eval_s = 0.0
        mark = None  # (time, steps done, eval seconds) right after the synchronised steps
        step_est = None  # seconds per step after compilation (host wall clock, running estimate)
        planned = False

        def timed_steps_s() -> list:
            """Seconds of every step so far (synchronises)."""
            _sync(dev)
            ts = list(host_s)
            for i, (s, e) in enumerate(zip(starts, ends)):
                if cuda:
                    nxt = starts[i + 1] if i + 1 < len(starts) and e[1] else None
                    ts.append((s.elapsed_time(nxt) if nxt is not None else s.elapsed_time(e[0])) / 1e3)
                else:
                    ts.append(e[0] - s)
            return ts

        step = 0
        while step < target:
            if step < cfg.sync_steps:
                _sync(dev)
                t0 = time.perf_counter()
                loss, npb = setup.step(step)
                _sync(dev)
                host_s.append(time.perf_counter() - t0)
                if step == 0:
                    dyn.append(peers.dynamo_counts())
                    log(f"  {name}: first step {host_s[0]:.1f} s (compilation)")
                if step >= 1:
                    step_est = min(host_s[1:])  # a synchronised step after the compile step
            else:
                if cuda:
                    ev0 = torch.cuda.Event(enable_timing=True)
                    ev0.record()
                    loss, npb = setup.step(step)
                    ev1 = torch.cuda.Event(enable_timing=True)
                    ev1.record()
                    starts.append(ev0)
                    ends.append([ev1, True])  # True: the next step follows directly (no eval between)
                else:
                    t0 = time.perf_counter()
                    loss, npb = setup.step(step)
                    starts.append(t0)
                    ends.append([time.perf_counter(), True])
            losses[step] = loss
            probe_steps += npb > 0
            n_done = step + 1
            step += 1
            now = time.perf_counter()
            if n_done == min(cfg.sync_steps, target):
                mark = (now, n_done, eval_s)
            elif mark is not None and n_done > mark[1]:
                # host wall clock per step since the synchronised steps: the host runs at most a
                # couple of steps ahead of the device, so this tracks the device step time
                step_est = (now - mark[0] - (eval_s - mark[2])) / (n_done - mark[1])
            if plan is not None and not planned and mark is not None and n_done >= mark[1] + PLAN_AFTER:
                _sync(dev)
                now = time.perf_counter()
                step_est = (now - mark[0] - (eval_s - mark[2])) / (n_done - mark[1])
                planned = True
                own = setup_s + max(0.0, sum(host_s) - step_est * len(host_s))  # setup + compilation
                n_plan = plan(step_est, now, n_done, own)
                out["plan"] = {"step_s": step_est, "steps": n_plan, "at_step": n_done}
                if n_plan < target:
                    log(f"  {name}: {step_est * 1e3:.0f} ms/step; the deadline allows {n_plan} steps for this and "
                        f"the variants after it (planned {cfg.steps})")
                    target, cap_reason = max(n_done, n_plan), "plan"
            if cfg.log_every and n_done % cfg.log_every == 0:
                log(f"  {name:<16} step {n_done:>5}  loss {float(loss):.4f}")
            train_s = time.perf_counter() - t_train0 - eval_s - sum(host_s)
            over_budget = bool(cfg.time_budget) and train_s > cfg.time_budget and n_done < target
            over_deadline = False
            if deadline is not None and n_done < target:
                # the next step, the final evaluation and the profile must still fit (the compile
                # step never counts as the step time: without a post-compile measurement, only the
                # reserve is checked)
                need = cfg.deadline_reserve if step_est is None else \
                    step_est + tail_s(cfg, step_est, last_eval_s)
                over_deadline = now + need > deadline
            if over_budget or over_deadline:
                stopped = "time_budget" if over_budget else "deadline"
            periodic = cfg.eval_every > 0 and n_done % cfg.eval_every == 0
            if evaluate and (periodic or n_done == target or stopped != "steps"):
                if ends:
                    ends[-1][1] = False  # this step's time ends at its own end event (excludes the evaluation)
                t0 = time.perf_counter()
                ev = _evaluate(setup, text_evals, probe_evals)
                last_eval_s = time.perf_counter() - t0
                eval_s += last_eval_s
                ev["step"] = n_done
                evals.append(ev)
                log(f"  {name:<16} step {n_done:>5}  held-out {ev['bpb']:.4f} bits/byte"
                    + (f", probe accuracy {ev['probe_acc']:.3f}" if ev["probe_acc"] is not None else "")
                    + f"  ({last_eval_s:.1f} s)")
            if stopped != "steps":
                log(f"  {name}: stopped after {n_done} steps ({stopped.replace('_', ' ')})")
                break
        if stopped == "steps" and n_done < cfg.steps:
            stopped = cap_reason or "steps"
        ts = timed_steps_s()
        timed = ts[cfg.sync_steps:]
        if timed:
            med = float(np.median(timed))
        else:  # too few steps for a timed one: the synchronised steps after the compile step
            med = float(np.median(host_s[1:] if len(host_s) > 1 else host_s))
        compile_s = max(0.0, sum(host_s) - med * len(host_s)) if (timed or len(host_s) > 1) else None
        wall_steps = [med] * len(host_s) + ts[len(host_s):]  # compile excluded from the time axis
        cum = np.cumsum(wall_steps)
        for ev in evals:
            ev["train_s"] = float(cum[ev["step"] - 1])
        loss_list = losses[:n_done].float().cpu().tolist()
        prof = None
        t_prof = time.perf_counter()
        prof_fits = deadline is None or time.perf_counter() + cfg.profile_steps * med + 3.0 < deadline - 2.0
        if cuda and cfg.profile_steps > 0 and prof_fits:
            k = [n_done]

            def one():
                setup.step(min(k[0], cfg.steps - 1))
                k[0] += 1

            try:
                prof = gpu_busy(one, cfg.profile_steps, dev, name.split("_")[0])
                if prof is None:
                    out["gpu_error"] = "the profiler recorded no device activity"
            except Exception as e:  # noqa: BLE001  (OOM is handled below, like a training failure)
                if _is_oom(e):
                    raise
                out["gpu_error"] = _short(e)
        elif cuda and cfg.profile_steps > 0:
            out["gpu_error"] = "not profiled: the deadline was too close"
        profile_s = time.perf_counter() - t_prof
        prep = setup.prep_s[cfg.sync_steps:n_done] or setup.prep_s[:n_done]
        out.update({
            "status": "ok", "stopped": stopped, "steps": n_done, "probe_sequences": int(probe_steps),
            "step_ms": [t * 1e3 for t in ts], "median_step_ms": med * 1e3,
            "tokens_per_s": cfg.batch * cfg.seq_len / med, "compile_s": compile_s, "setup_s": setup_s,
            "setup_detail": setup.detail, "first_steps_s": host_s,
            "prep_ms": float(np.median(prep)) * 1e3 if prep else None,
            "train_loss": loss_list, "evals": evals,
            "final": evals[-1] if evals else None, "gpu": prof,
            "peak_mem_gb": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None,
            "eval_s": eval_s, "profile_s": profile_s,
            "overhead_s": setup_s + (compile_s or 0.0) + profile_s,
            "wall_s": time.perf_counter() - t_setup,
            "dynamo": _dynamo_delta(dyn),
        })
        return out
    except Exception as e:  # noqa: BLE001  (OOM, compile errors: recorded as results)
        out["dynamo"] = _dynamo_delta(dyn)
        if _is_oom(e):
            out.update({"status": "oom", "error": _short(e), "failed_at_step": step if step >= 0 else None,
                        "peak_mem_gb": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None})
            log(f"  {name}: out of memory ({_short(e)})")
            return out
        if retry_ok and n_done == 0:
            return {"status": "retry", "error": _short(e)}
        out.update({"status": "error", "error": _short(e), "traceback": traceback.format_exc()[-3000:]})
        log(f"  {name}: error {_short(e)}")
        return out
    finally:
        if setup is not None:
            setup.close()
        del setup
        torch._dynamo.reset()
        _cleanup(dev)
