"""Side-by-side measurement of attention implementations on one mask and shape.

Used by ``bench.py`` and ``new_primitives_gpu.py``. For a :class:`Case` (our mask, the equivalent
FlexAttention ``mask_mod``, what FA4 and cuDNN can express of it, and the shape) :func:`run_case`

1. draws one set of bf16 inputs ``q, k, v, dO`` (seeded) that every implementation gets (FA4 a
   ``(B, L, H, D)`` copy made outside the timed region);
2. computes a float64 reference of ``O, dQ, dK, dV`` and the same in eager bf16 (the error a plain
   low-precision implementation makes) on the checked heads (:func:`reference`: query rows in
   chunks, the mask from the ``mask_mod``, so that nothing of size ``L x L`` is held at once);
3. per implementation: a forward and a forward+backward pass checked against the reference (max
   abs error per tensor, as a multiple of the eager-bf16 error), then forward and forward+backward
   times (``triton.testing.do_bench``, median after warm-up; a plain timer on CPU), TFLOP/s on the
   kept elements and the peak memory of one forward+backward.

An implementation that cannot express the mask, or is not installed, is recorded with the reason
(``"n/a (...)"``); one that fails is recorded with its error; the run goes on either way.
"""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

import blocksparse_fa as bsfa
import peers

IMPLS = ("ours", "ours_compiled", "fa4", "flex_triton", "flex_flash", "cudnn")
LABELS = {"ours": "ours", "ours_compiled": "ours (compiled)", "fa4": "FA4", "flex_triton": "Flex-Triton",
          "flex_flash": "Flex-FLASH", "cudnn": "cuDNN"}
TENSORS = ("o", "dq", "dk", "dv")
TOLERANCE = 3.0  # an implementation passes when each error is at most this multiple of eager bf16's
FLOOR = 1e-6  # absolute floor under the eager error (exactly representable outputs)


@dataclass
class Case:
    """One mask at one shape.

    Attributes:
        name: the mask's name in tables.
        mask: our mask expression.
        mask_mod: FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` keeping the same pairs (``None``:
            dense); also the reference's mask.
        B, H, Hkv, N, D: batch, query heads, key/value heads, sequence length, head dim.
        fa4: FA4's form of the mask: ``{"causal": bool, "window": int | None}``, ``{"varlen": ids}``
            (packed documents: runs of equal ids, one sequence each) or the reason it has none.
        cudnn: ``{"causal": bool}`` or the reason cuDNN has no form of the mask.
    """

    name: str
    mask: bsfa.Mask
    mask_mod: Callable | None
    B: int
    H: int
    Hkv: int
    N: int
    D: int
    fa4: dict | str = "n/a (cannot express this mask)"
    cudnn: dict | str = "n/a (dense and causal only)"
    info: dict = field(default_factory=dict)

    def shape(self) -> dict:
        return {"B": self.B, "H": self.H, "Hkv": self.Hkv, "N": self.N, "D": self.D}


@dataclass
class Options:
    device: str = "cuda"
    impls: tuple = IMPLS
    check: bool = True
    check_heads: str = "ends"  # "ends": the first and last KV group; "all"
    timing: bool = True
    warmup_ms: int = 25
    rep_ms: int = 100
    cpu_reps: int = 3
    compile_backend: str = "inductor"
    block_size: int = 128
    seed: int = 0
    chunk_bytes: float = 2e9  # float64 scores per reference chunk (bytes)
    deadline: float = 0.0  # time.time() after which no further implementation starts (0 = none)


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
def time_ms(fn, opts: Options) -> float:
    """Median milliseconds of ``fn()``: ``triton.testing.do_bench`` on CUDA, a timer on CPU."""
    if torch.device(opts.device).type == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, warmup=opts.warmup_ms, rep=opts.rep_ms, return_mode="median"))
    fn()
    ts = []
    for _ in range(opts.cpu_reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(ts))


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def peak_mib(fn, device) -> float | None:
    """Extra device memory (MiB) one call of ``fn`` needs at its peak (CUDA only)."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# ------------------------------------------------------------------------------------------------
# reference
# ------------------------------------------------------------------------------------------------
def checked_groups(Hkv: int, how: str) -> list[int]:
    return list(range(Hkv)) if how == "all" else sorted({0, Hkv - 1})


def _mask_rows(mask_mod, b: int, heads: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor | None:
    """``bool (len(heads) or 1, len(rows), n)``: the pairs ``mask_mod`` keeps (``None``: all)."""
    if mask_mod is None:
        return None
    dev = rows.device
    bt = torch.full((1, 1, 1), b, dtype=torch.long, device=dev)
    kv = torch.arange(n, device=dev).view(1, 1, n)
    keep = mask_mod(bt, heads.view(-1, 1, 1), rows.view(1, -1, 1), kv)
    return keep.expand(len(heads), len(rows), n)


def reference(case: Case, q, k, v, do, groups: list[int], upcast: bool, chunk_bytes: float = 2e9) -> dict:
    """``O, dQ, dK, dV`` of the query heads of the KV ``groups`` (in order), exactly as
    ``bsfa.reference_attention`` computes them (``upcast``: float64; else eager in the inputs' dtype),
    over chunks of query rows with the mask from ``case.mask_mod``. Returns float32/64 tensors
    ``o, dq`` ``(B, G * len(groups), N, D)`` and ``dk, dv`` ``(B, len(groups), N, D)``."""
    B, H, N, D = q.shape
    G = H // k.shape[1]
    dt = torch.float64 if upcast else q.dtype
    acc = torch.float64 if upcast else torch.float32
    rows_per = max(1, min(N, int(chunk_bytes // (8 * N * G * 6))))
    outs = {t: [] for t in TENSORS}
    for b in range(B):
        po, pq, pk, pv = [], [], [], []
        for g in groups:
            hs = torch.arange(g * G, (g + 1) * G, device=q.device)
            kk = k[b:b + 1, g:g + 1].detach().to(dt).requires_grad_()
            vv = v[b:b + 1, g:g + 1].detach().to(dt).requires_grad_()
            dk = torch.zeros(N, D, dtype=acc, device=q.device)
            dv = torch.zeros(N, v.shape[-1], dtype=acc, device=q.device)
            o_parts, dq_parts = [], []
            for r0 in range(0, N, rows_per):
                rows = torch.arange(r0, min(N, r0 + rows_per), device=q.device)
                qq = q[b:b + 1, g * G:(g + 1) * G, r0:r0 + len(rows)].detach().to(dt).requires_grad_()
                keep = _mask_rows(case.mask_mod, b, hs, rows, N)
                out = bsfa.reference_attention(qq, kk, vv, None if keep is None else keep.unsqueeze(0),
                                               upcast=upcast)
                gq, gk, gv = torch.autograd.grad(out, (qq, kk, vv), do[b:b + 1, g * G:(g + 1) * G,
                                                                       r0:r0 + len(rows)].to(out.dtype))
                o_parts.append(out.detach().to(acc))
                dq_parts.append(gq.to(acc))
                dk += gk[0, 0].to(acc)
                dv += gv[0, 0].to(acc)
            po.append(torch.cat(o_parts, 2))
            pq.append(torch.cat(dq_parts, 2))
            pk.append(dk[None, None])
            pv.append(dv[None, None])
        for t, parts in zip(TENSORS, (po, pq, pk, pv)):
            outs[t].append(torch.cat(parts, 1))
    return {t: torch.cat(outs[t], 0) for t in TENSORS}


def _select(t: torch.Tensor, groups: list[int], per_group: int) -> torch.Tensor:
    return torch.cat([t[:, g * per_group:(g + 1) * per_group] for g in groups], 1)


def errors(got: dict, ref: dict, eager: dict) -> dict:
    """Per tensor: max abs error vs float64, the eager-bf16 error, their ratio."""
    out = {}
    for t, x in got.items():
        x = x.to(ref[t].dtype)
        e = (x - ref[t]).abs().max().item()
        e0 = (eager[t].to(ref[t].dtype) - ref[t]).abs().max().item()
        out[t] = {"err": e, "eager_err": e0, "ratio": e / max(e0, FLOOR), "nan": bool(torch.isnan(x).any())}
    return out


# ------------------------------------------------------------------------------------------------
# implementations
# ------------------------------------------------------------------------------------------------
@dataclass
class Runnable:
    """``fn()`` runs the forward; ``leaves`` are the tensors it differentiates with respect to,
    ``do`` the output gradient in ``fn``'s layout; ``layout`` is ``bhld``, ``blhd`` or ``thd``."""

    fn: Callable
    leaves: tuple
    do: torch.Tensor
    layout: str = "bhld"
    note: str = ""
    fb_na: str = ""  # why there is no backward (the forward still runs)


def to_bhld(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "blhd":
        return x.transpose(1, 2)
    if layout == "thd":
        return x.unsqueeze(0).transpose(1, 2)
    return x


def _from_bhld(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "blhd":
        return x.transpose(1, 2).contiguous()
    if layout == "thd":
        return x[0].transpose(0, 1).contiguous()
    return x


def _leaf(x, layout):
    return _from_bhld(x.detach(), layout).requires_grad_()


class Builder:
    """Makes a :class:`Runnable` per implementation for one case (or the reason it cannot run)."""

    def __init__(self, case: Case, q, k, v, do, opts: Options, block_mask_fn: Callable | None = None):
        self.case, self.q, self.k, self.v, self.do, self.opts = case, q, k, v, do, opts
        self.cuda = torch.device(opts.device).type == "cuda"
        self._block_mask = None
        self._block_mask_fn = block_mask_fn
        self.status = peers.status(opts.device)

    def block_mask(self):
        if self._block_mask is None and self.case.mask_mod is not None:
            self._block_mask = (self._block_mask_fn or default_block_mask)(self.case, self.opts)
        return self._block_mask

    def build(self, impl: str) -> Runnable | str:
        c, q, k, v, do = self.case, self.q, self.k, self.v, self.do
        if impl == "ours":
            return Runnable(lambda: bsfa.attention(q, k, v, mask=c.mask, block_size=self.opts.block_size),
                            (q, k, v), do)
        if impl == "ours_compiled":
            mask, bs = c.mask, self.opts.block_size

            def f(q, k, v):
                return bsfa.attention(q, k, v, mask=mask, block_size=bs)

            cf = torch.compile(f, fullgraph=True, dynamic=False, backend=self.opts.compile_backend)
            return Runnable(lambda: cf(q, k, v), (q, k, v), do, note=f"torch.compile({self.opts.compile_backend})")
        if impl in ("flex_triton", "flex_flash"):
            if self.status[impl]:
                return self.status[impl]
            bm = self.block_mask()
            if self.cuda:
                return Runnable(lambda: peers.flex_call(q, k, v, bm, impl), (q, k, v), do)
            qd, kd, vd = (t.detach() for t in (q, k, v))  # FlexAttention has no CPU backward
            return Runnable(lambda: peers.flex_call(qd, kd, vd, bm, impl), (q, k, v), do,
                            fb_na="n/a (no CPU backward)")
        if impl == "cudnn":
            if self.status["cudnn"]:
                return self.status["cudnn"]
            if isinstance(c.cudnn, str):
                return c.cudnn
            causal = c.cudnn["causal"]
            return Runnable(lambda: peers.cudnn_sdpa(q, k, v, causal), (q, k, v), do)
        if impl == "fa4":
            if self.status["fa4"]:
                return self.status["fa4"]
            if isinstance(c.fa4, str):
                return c.fa4
            if "varlen" in c.fa4:
                if c.B != 1:
                    return "n/a (varlen benchmark needs B = 1)"
                cu, longest = peers.cu_seqlens_from_ids(c.fa4["varlen"].to(q.device))
                qt, kt, vt = (_leaf(t, "thd") for t in (q, k, v))
                return Runnable(lambda: peers.fa4_varlen(qt, kt, vt, cu, longest), (qt, kt, vt),
                                _from_bhld(do, "thd"), "thd", note="flash_attn_varlen_func")
            qb, kb, vb = (_leaf(t, "blhd") for t in (q, k, v))
            causal, window = c.fa4.get("causal", False), c.fa4.get("window")
            return Runnable(lambda: peers.fa4_dense(qb, kb, vb, causal, window), (qb, kb, vb),
                            _from_bhld(do, "blhd"), "blhd",
                            note=f"causal={causal}" + (f", window_size={peers.fa4_window(window)}" if window else ""))
        raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def default_block_mask(case: Case, opts: Options):
    """FlexAttention ``BlockMask`` of the case, built once outside the timed region from the block
    states of our layout (no ``L x L`` evaluation; equal to ``create_block_mask``'s, which
    ``tests/test_train_smoke.py`` checks) with the case's ``mask_mod``."""
    from train.variants import block_mask_from_states

    lay = bsfa.compile_mask(case.mask, case.N, case.N, opts.block_size)
    return block_mask_from_states(lay.block_states().to(opts.device), opts.block_size, case.mask_mod)


# ------------------------------------------------------------------------------------------------
# one case
# ------------------------------------------------------------------------------------------------
def inputs(case: Case, opts: Options, dtype=torch.bfloat16):
    g = torch.Generator(device=opts.device).manual_seed(opts.seed)
    shapes = [(case.B, case.H, case.N, case.D), (case.B, case.Hkv, case.N, case.D),
              (case.B, case.Hkv, case.N, case.D), (case.B, case.H, case.N, case.D)]
    q, k, v, do = (torch.randn(s, device=opts.device, dtype=dtype, generator=g) for s in shapes)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"error: {type(e).__name__}: {msg[0][:240] if msg else ''}"


def _grads(r: Runnable):
    o = r.fn()
    return o, torch.autograd.grad(o, r.leaves, r.do)


def run_impl(r: Runnable, flops: float, opts: Options, ref=None, eager=None, groups=None, G=1) -> dict:
    """Check and time one implementation; every failure is recorded, nothing raised."""
    res: dict = {"note": r.note} if r.note else {}
    dev = opts.device
    for mode in ("fwd", "fb"):
        if mode == "fb" and r.fb_na:
            res["fb_na"] = r.fb_na
            continue
        try:
            t0 = time.perf_counter()
            if mode == "fwd":
                with torch.no_grad():
                    o = r.fn()
                got = {"o": to_bhld(o, r.layout)}
            else:
                o, gr = _grads(r)
                got = {"o": to_bhld(o, r.layout)}
                got.update({t: to_bhld(x, r.layout) for t, x in zip(("dq", "dk", "dv"), gr)})
            _sync(dev)
            res[f"{mode}_first_s"] = time.perf_counter() - t0
            if ref is not None:
                sel = {t: _select(x.detach(), groups, G if t in ("o", "dq") else 1) for t, x in got.items()}
                res[f"{mode}_check"] = errors(sel, ref, eager)
            del got, o
            if opts.timing:
                if mode == "fwd":
                    def fwd():
                        with torch.no_grad():
                            r.fn()
                    res["fwd_ms"] = time_ms(fwd, opts)
                    res["fwd_tflops"] = flops / res["fwd_ms"] / 1e9
                else:
                    res["fb_ms"] = time_ms(lambda: _grads(r), opts)
                    res["fb_tflops"] = 3.5 * flops / res["fb_ms"] / 1e9
                    res["fb_peak_mib"] = peak_mib(lambda: _grads(r), dev)
        except Exception as e:  # noqa: BLE001  (a failing peer is a result)
            res[f"{mode}_error"] = _short(e)
            res[f"{mode}_traceback"] = traceback.format_exc()[-1500:]
    checks = [v for m in ("fwd", "fb") for v in res.get(f"{m}_check", {}).values()]
    if checks:
        res["max_ratio"] = max(c["ratio"] for c in checks)
        res["ok"] = all(c["ratio"] <= TOLERANCE and not c["nan"] for c in checks)
    return res


def run_case(case: Case, opts: Options, block_mask_fn: Callable | None = None, log=print) -> dict:
    """Every implementation of ``opts.impls`` on ``case`` (see the module docstring)."""
    t_case = time.perf_counter()
    q, k, v, do = inputs(case, opts)
    lay = bsfa.compile_mask(case.mask, case.N, case.N, opts.block_size)
    dens = float(lay.element_density(device=opts.device))
    flops = 4.0 * case.B * case.H * case.N * case.N * case.D * dens
    res = {"mask": case.name, **case.shape(), "block_density": float(lay.density), "element_density": dens,
           "impls": {}, **case.info}
    ref = eager = groups = None
    G = case.H // case.Hkv
    if opts.check:
        groups = checked_groups(case.Hkv, opts.check_heads)
        t0 = time.perf_counter()
        ref = reference(case, q, k, v, do, groups, upcast=True, chunk_bytes=opts.chunk_bytes)
        eager = reference(case, q, k, v, do, groups, upcast=False, chunk_bytes=opts.chunk_bytes)
        res["check"] = {"kv_groups": groups, "query_heads": [g * G + i for g in groups for i in range(G)],
                        "reference_s": time.perf_counter() - t0}
    b = Builder(case, q, k, v, do, opts, block_mask_fn)
    for impl in opts.impls:
        if opts.deadline and time.time() > opts.deadline:
            res["impls"][impl] = {"na": "skipped (deadline)"}
            continue
        try:
            r = b.build(impl)
        except Exception as e:  # noqa: BLE001  (e.g. a block mask that cannot be built)
            r = _short(e)
        if isinstance(r, str):
            res["impls"][impl] = {"na": r}
        else:
            res["impls"][impl] = run_impl(r, flops, opts, ref, eager, groups, G)
        log(f"  {case.name:24s} {LABELS[impl]:16s} {cell_time(res['impls'][impl])}  "
            f"{cell_check(res['impls'][impl])}")
        for t in (q, k, v):
            t.grad = None
    res["wall_s"] = time.perf_counter() - t_case
    return res


# ------------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------------
def _na(r: dict, mode: str) -> str | None:
    if "na" in r:
        return r["na"]
    if f"{mode}_na" in r:
        return r[f"{mode}_na"]
    if f"{mode}_error" in r:
        return r[f"{mode}_error"][:80]
    return None


def cell_time(r: dict) -> str:
    """``fwd ms / fwd+bwd ms`` or the reason there is none."""
    if "na" in r:
        return r["na"]
    parts = []
    for m in ("fwd", "fb"):
        parts.append(f"{r[f'{m}_ms']:.3f}" if f"{m}_ms" in r else (_na(r, m) or "–"))
    return " / ".join(parts)


def cell_tflops(r: dict) -> str:
    if "na" in r:
        return r["na"]
    return " / ".join((f"{x:.0f}" if x >= 10 else f"{x:.2g}") if (x := r.get(f"{m}_tflops")) is not None else "–"
                      for m in ("fwd", "fb"))


def cell_check(r: dict) -> str:
    """Largest error as a multiple of eager bf16's (forward / forward+backward), ``!`` above the
    tolerance or with NaN."""
    if "na" in r:
        return r["na"]
    parts = []
    for m in ("fwd", "fb"):
        c = r.get(f"{m}_check")
        if not c:
            parts.append(_na(r, m) or "–")
            continue
        worst = max(v["ratio"] for v in c.values())
        bad = any(v["nan"] for v in c.values()) or worst > TOLERANCE
        parts.append(("NaN" if any(v["nan"] for v in c.values()) else f"{worst:.2f}") + (" !" if bad else ""))
    return " / ".join(parts)


def _cell_text(text: str) -> str:
    """``text`` for a Markdown table cell: pipes escaped (mask names such as ``key_range | causal``)."""
    return str(text).replace("|", "\\|")


def markdown_tables(cases: list[dict], impls=IMPLS) -> list[str]:
    """Per shape: times, TFLOP/s and errors, one row per mask, one column per implementation."""
    lines = []
    shapes = []
    for c in cases:
        key = (c["B"], c["H"], c["Hkv"], c["N"], c["D"])
        if key not in shapes:
            shapes.append(key)
    used = [i for i in impls if any(i in c.get("impls", {}) for c in cases)]
    head = "| mask | kept | " + " | ".join(LABELS[i] for i in used) + " |"
    sep = "|---|---|" + "---|" * len(used)
    for B, H, Hkv, N, D in shapes:
        sel = [c for c in cases if (c["B"], c["H"], c["Hkv"], c["N"], c["D"]) == (B, H, Hkv, N, D)]
        title = f"N = {N}, d = {D}, H = {H}" + (f", {Hkv} KV heads (GQA)" if Hkv != H else " (MHA)") + \
            (f", B = {B}" if B != 1 else "")
        for what, cell in (("time, ms: forward / forward+backward", cell_time),
                           ("TFLOP/s on kept elements: forward / forward+backward", cell_tflops),
                           ("error vs float64, multiple of eager bf16's (max over O, dQ, dK, dV): forward / "
                            "forward+backward", cell_check)):
            lines += ["", f"**{title}; {what}**", "", head, sep]
            for c in sel:
                if "skipped" in c:
                    lines.append(f"| {_cell_text(c['mask'])} | – | " + " | ".join("skipped" for _ in used) + " |")
                    continue
                cells = [_cell_text(cell(c["impls"][i])) if i in c["impls"] else "–" for i in used]
                lines.append(f"| {_cell_text(c['mask'])} | {c.get('element_density', float('nan')):.3f} | "
                             + " | ".join(cells) + " |")
    return lines
