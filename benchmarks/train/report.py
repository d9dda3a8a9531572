"""Results: the JSON file format, merging runs, the target comparisons, the plots and ``training.md``.

JSON (``schema`` ``train_long_context/2``)::

    {"schema": ..., "runs": {run_id: {"argv", "env", "config", "patterns", "data", "started"}},
     "results": [{"run_id", "variant", "impl", "family", "seq_len", "mode", "status", ...}, ...]}

Merging keeps every run and, per ``(mode, seq_len, variant)``, the result of the file given last.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re

import numpy as np

SCHEMA = "train_long_context/2"
TARGET = {"seq_len": 65536, "layers": 8, "d_model": 1024, "heads": 8, "kv_heads": 2, "head_dim": 128}
IMPL_LABEL = {"sdpa": "SDPA", "fa4": "FA4", "flex": "Flex-Triton", "flexflash": "Flex-FLASH", "bsfa": "blocksparse_fa"}
FAMILY_ORDER = ("causal", "sliding", "longformer", "bigbird", "documents")
IMPL_ORDER = ("sdpa", "fa4", "flex", "flexflash", "bsfa")


def length_label(L: int) -> str:
    """``65536`` -> ``64K``; lengths that are not whole multiples of 1024 stay as they are."""
    return f"{L // 1024}K" if L >= 1024 and L % 1024 == 0 else str(L)


def new_payload() -> dict:
    return {"schema": SCHEMA, "runs": {}, "results": []}


def key(r: dict) -> tuple:
    return (r.get("mode"), r.get("seq_len"), r.get("variant"))


def merge(payloads: list[dict]) -> dict:
    out = new_payload()
    by_key: dict = {}
    for p in payloads:
        if p.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} results file (schema {p.get('schema')!r})")
        out["runs"].update(p.get("runs", {}))
        for r in p.get("results", []):
            by_key[key(r)] = r
    out["results"] = sorted(by_key.values(), key=_order)
    return out


def _order(r: dict):
    fam = FAMILY_ORDER.index(r["family"]) if r.get("family") in FAMILY_ORDER else 99
    imp = IMPL_ORDER.index(r["impl"]) if r.get("impl") in IMPL_ORDER else 99
    return (0 if r.get("mode") == "train" else 1, r.get("seq_len", 0), fam, imp)


def load(paths: list[str]) -> dict:
    payloads = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            payloads.append(json.load(f))
    return merge(payloads)


def save(payload: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


# ------------------------------------------------------------------------------------------------
# comparisons
# ------------------------------------------------------------------------------------------------
def _ok(r) -> bool:
    return r is not None and r.get("status") == "ok"


def _find(results, mode, L, variant):
    for r in results:
        if r.get("mode") == mode and r.get("seq_len") == L and r.get("variant") == variant:
            return r
    return None


def _speed(results, L, variant, prefer="train", device=None, runs=None):
    """The result with a throughput measurement for (L, variant): train runs first; with ``device``
    (and the payload's ``runs``) only results measured on that GPU."""
    for mode in (prefer, "throughput" if prefer == "train" else "train"):
        for r in results:
            if (r.get("mode") == mode and r.get("seq_len") == L and r.get("variant") == variant and _ok(r)
                    and (device is None or _device(runs, r) == device)):
                return r
    return None


def _device(runs, r) -> str:
    """The GPU a result was measured on (its run's environment)."""
    return (runs or {}).get(r.get("run_id"), {}).get("env", {}).get("device", "")


def bpb_at(r: dict, step: int):
    for ev in r.get("evals") or []:
        if ev["step"] == step:
            return ev.get("bpb")
    return None


def common_step(a: dict, b: dict):
    """Largest step at which both results were evaluated."""
    sa = {ev["step"] for ev in a.get("evals") or []}
    sb = {ev["step"] for ev in b.get("evals") or []}
    both = sa & sb
    return max(both) if both else None


def gap_vs_dense(results, L, r):
    """``(step, bpb, dense bpb, relative gap)`` at the last common evaluation with sdpa_causal."""
    d = _find(results, "train", L, "sdpa_causal")
    if not (_ok(d) and _ok(r)):
        return None
    s = common_step(d, r)
    if s is None:
        return None
    bd, bv = bpb_at(d, s), bpb_at(r, s)
    if bd is None or bv is None:
        return None
    return s, bv, bd, (bv - bd) / bd


def _cfg(payload, r):
    return payload["runs"].get(r.get("run_id"), {}).get("config", {})


def targets(payload: dict) -> list[dict]:
    """The comparisons with the targets at 64K (8 layers, d_model 1024, 8/2 heads of dim 128)."""
    res = payload["results"]
    L = TARGET["seq_len"]
    out = []

    def cfg_note(*rs):
        notes = []
        for r in rs:
            if r is None:
                continue
            c = _cfg(payload, r)
            bad = [f"{k}={c.get(k)}" for k in ("layers", "d_model", "heads", "kv_heads", "head_dim")
                   if c.get(k) != TARGET[k]]
            if bad:
                notes.append(f"{r['variant']} ran with {', '.join(bad)}")
            dev = payload["runs"].get(r.get("run_id"), {}).get("env", {}).get("device", "")
            if "H100" not in dev:
                notes.append(f"{r['variant']} ran on {dev or 'an unknown device'}, not an H100")
        return "; ".join(sorted(set(notes)))

    lf, sd, fl = (_speed(res, L, v) for v in ("bsfa_longformer", "sdpa_causal", "flex_longformer"))
    checks = ((sd, "sdpa_causal", 3.0, "blocksparse_fa Longformer vs SDPA dense causal, tokens/s"),
              (fl, "flex_longformer", 1.3, "blocksparse_fa Longformer vs Flex Longformer, tokens/s"))
    for other, oname, goal, label in checks:
        if lf is None or other is None:
            missing = [v for v, x in (("bsfa_longformer", lf), (oname, other)) if x is None]
            out.append({"target": f"{label} >= {goal}x", "measured": None, "met": None,
                        "detail": f"not measured at 64K ({', '.join(missing)} missing)"})
            continue
        ratio = lf["tokens_per_s"] / other["tokens_per_s"]
        met = ratio >= goal
        detail = f"{lf['tokens_per_s']:,.0f} vs {other['tokens_per_s']:,.0f} tokens/s"
        if not met:
            detail += f"; missed by {(goal - ratio) / goal:.0%} ({ratio:.2f}x of {goal}x)"
            detail += _amdahl(lf, other)
        note = cfg_note(lf, other)
        out.append({"target": f"{label} >= {goal}x", "measured": f"{ratio:.2f}x", "met": met,
                    "detail": detail + (f" ({note})" if note else "")})
    for fam in FAMILY_ORDER:
        r = _speed(res, L, f"bsfa_{fam}")
        if r is None:
            continue
        g = r.get("gpu")
        if not g:
            out.append({"target": f"GPU busy >= 90 %: bsfa_{fam}", "measured": None, "met": None,
                        "detail": "not profiled"})
            continue
        b = g["busy_fraction"]
        met = b >= 0.9
        detail = f"{g['device_ms_per_step']:.1f} ms of device activity per {g['wall_ms_per_step']:.1f} ms step"
        if not met:
            detail += f"; missed by {0.9 - b:.1%} points"
        out.append({"target": f"GPU busy >= 90 %: bsfa_{fam}", "measured": f"{b:.1%}", "met": met, "detail": detail})
    dense = _find(res, "train", L, "sdpa_causal")
    data = _data_info(payload)
    if _ok(dense) and dense.get("final") and data:
        ub = data["unigram_heldout_bpb"]
        b = dense["final"]["bpb"]
        met = b <= 0.75 * ub
        detail = (f"{b:.3f} bits/byte after {dense['final']['step']} steps vs {ub:.3f} for the unigram model "
                  f"(criterion: at least 25 % below it); {1 - b / ub:.0%} below")
        out.append({"target": "dense model learns: held-out bits/byte far below the unigram entropy",
                    "measured": f"{b:.3f}", "met": met, "detail": detail})
    else:
        out.append({"target": "dense model learns: held-out bits/byte far below the unigram entropy",
                    "measured": None, "met": None, "detail": "no finished sdpa_causal training run at 64K"})
    for fam in ("sliding", "longformer", "bigbird", "documents"):
        r = _find(res, "train", L, f"bsfa_{fam}")
        if r is None:
            continue
        g = gap_vs_dense(res, L, r)
        if g is None:
            out.append({"target": f"held-out bits/byte at most 3 % above dense: bsfa_{fam}", "measured": None,
                        "met": None, "detail": "no common evaluation step with sdpa_causal"})
            continue
        s, bv, bd, gap = g
        met = gap <= 0.03
        detail = f"{bv:.4f} vs {bd:.4f} at step {s}"
        if not met:
            detail += f"; missed by {gap - 0.03:.1%} points"
        out.append({"target": f"held-out bits/byte at most 3 % above dense: bsfa_{fam}", "measured": f"{gap:+.2%}",
                    "met": met, "detail": detail})
    return out


def _amdahl(ours: dict, other: dict) -> str:
    """Where the step time goes (profiled attention kernels vs the rest), and the speedup ours would
    reach with attention for free."""
    go, gt = ours.get("gpu") or {}, other.get("gpu") or {}
    need = (go.get("attention_kernel_ms_per_step"), gt.get("attention_kernel_ms_per_step"),
            ours.get("median_step_ms"), other.get("median_step_ms"))
    if any(x is None for x in need):
        return ""
    step_o, step_t = ours["median_step_ms"], other["median_step_ms"]
    att_o, att_t = go["attention_kernel_ms_per_step"], gt["attention_kernel_ms_per_step"]
    rest = max(1e-9, step_o - att_o)
    return (f". Attention kernels: {att_o:.1f} ms of our {step_o:.1f} ms step, {att_t:.1f} ms of the other's "
            f"{step_t:.1f} ms; the rest of our step alone allows at most {step_t / rest:.2f}x")


def _data_info(payload):
    for run in payload["runs"].values():
        if run.get("data"):
            return run["data"]
    return None


# ------------------------------------------------------------------------------------------------
# plots
# ------------------------------------------------------------------------------------------------
_STYLE = {"sdpa": "-", "fa4": "-.", "flex": "--", "flexflash": ":", "bsfa": "-"}
_COLOR = {"causal": "k", "sliding": "tab:orange", "longformer": "tab:blue", "bigbird": "tab:green",
          "documents": "tab:purple"}


def _label(r):
    return f"{IMPL_LABEL.get(r['impl'], r['impl'])} {r['family']}"


def plot_curves(payload: dict, L: int, path: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in payload["results"] if r.get("mode") == "train" and r.get("seq_len") == L and _ok(r)
          and r.get("evals")]
    if not rs:
        return False
    fig, ax = plt.subplots(2, 2, figsize=(13, 8.5))
    data = _data_info(payload)
    from .data import N_VALS

    for r in rs:
        st = [ev["step"] for ev in r["evals"]]
        t = [ev["train_s"] for ev in r["evals"]]
        b = [ev["bpb"] for ev in r["evals"]]
        pa = [np.nan if ev.get("probe_acc") is None else ev["probe_acc"] for ev in r["evals"]]
        kw = dict(ls=_STYLE.get(r["impl"], "-"), color=_COLOR.get(r["family"], None), marker="o", ms=3,
                  alpha=0.6 if r["impl"] == "flex" else 1.0, label=_label(r))
        ax[0, 0].plot(st, b, **kw)
        ax[0, 1].plot(t, b, **kw)
        ax[1, 0].plot(st, pa, **kw)
        ax[1, 1].plot(t, pa, **kw)
    for a in ax[0]:
        if data:
            a.axhline(data["unigram_heldout_bpb"], color="grey", lw=0.8, ls=":", label="unigram model")
        a.set_ylabel("held-out bits per byte")
    for a in ax[1]:
        a.axhline(1.0 / N_VALS, color="grey", lw=0.8, ls=":", label="chance")
        a.set_ylabel("probe accuracy (held-out)")
        a.set_ylim(-0.02, 1.02)
    for a in ax[:, 0]:
        a.set_xlabel("training step")
    for a in ax[:, 1]:
        a.set_xlabel("training time (s, compilation and evaluation excluded)")
        a.set_xscale("log")
    for a in ax.flat:
        a.grid(alpha=0.3)
    ax[0, 0].legend(fontsize=7, ncol=2)
    run = payload["runs"].get(rs[0].get("run_id"), {})
    c = run.get("config", {})
    fig.suptitle(f"byte-level LM on the Python standard library, {length_label(L)} tokens, {c.get('layers')} layers, "
                 f"d_model {c.get('d_model')} ({run.get('env', {}).get('device', '?')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_throughput(payload: dict, path: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = payload["results"]
    lengths = sorted({r["seq_len"] for r in res})
    variants = sorted({r["variant"] for r in res}, key=lambda v: _order({"variant": v, "impl": v.split("_")[0],
                                                                          "family": v.split("_", 1)[1]}))
    vals = {(L, v): _speed(res, L, v) for L in lengths for v in variants}
    if not any(vals.values()):
        return False
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(lengths) * max(1, len(variants)) / 4), 4.4))
    w = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        impl, fam = v.split("_", 1)
        xs, ys = [], []
        for j, L in enumerate(lengths):
            r = vals[(L, v)]
            if r is not None:
                xs.append(j + (i - (len(variants) - 1) / 2) * w)
                ys.append(r["tokens_per_s"])
        ax.bar(xs, ys, width=w, color=_COLOR.get(fam), alpha={"sdpa": 1.0, "bsfa": 0.9}.get(impl, 0.45),
               hatch={"flex": "//", "flexflash": "..", "fa4": "xx"}.get(impl), edgecolor="k", lw=0.3,
               label=f"{IMPL_LABEL.get(impl, impl)} {fam}")
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([length_label(L) for L in lengths])
    ax.set_yscale("log")
    ax.set_ylabel("training tokens/s")
    ax.set_xlabel("sequence length")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------
# markdown
# ------------------------------------------------------------------------------------------------
def _f(x, fmt="{:.2f}", na="n/a"):
    return na if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


_STOPPED = {"plan": "steps planned to fit `--deadline`", "max_steps": "capped: equal steps with the variants before",
            "deadline": "stopped by `--deadline`", "time_budget": "stopped by the time budget"}


def _reason(r) -> str:
    """Why a variant did not run, in the reader's terms (a deadline skip keeps only its estimate)."""
    reason = r.get("reason", "")
    m = re.match(r"(?:invocation deadline|--deadline): (\d+) s left, about (\d+) s needed", reason)
    if m:
        return f"`--deadline` left {m.group(1)} s, it needed about {m.group(2)} s"
    return reason


def _status_cell(r):
    st = r.get("status")
    if st == "ok":
        stopped = r.get("stopped")
        if stopped in (None, "steps"):
            return "ok"
        planned = f" of {r['steps_planned']}" if r.get("steps_planned") else ""
        return f"ok ({r.get('steps')}{planned} steps: {_STOPPED.get(stopped, stopped.replace('_', ' '))})"
    if st == "oom":
        return "**out of memory**"
    if st == "error":
        return f"**error**: {r.get('error', '')[:120]}"
    return f"not run: {_reason(r)}" if st == "skipped" else f"{st}: {_reason(r)}"


def _speed_cols(payload, r):
    """Tokens/s and its ratios: against SDPA, and (ours) against the faster of Flex's Triton and
    FLASH backends on the same pattern, both measured on the same GPU."""
    res, runs, L = payload["results"], payload["runs"], r["seq_len"]
    if not _ok(r):
        return ["", "", "", "", "", "", ""]
    dev = _device(runs, r)
    sd = _speed(res, L, "sdpa_causal", prefer=r["mode"], device=dev, runs=runs)
    flex = [_speed(res, L, f"{impl}_{r['family']}", prefer=r["mode"], device=dev, runs=runs)
            for impl in ("flex", "flexflash")] if r["impl"] == "bsfa" else []
    fl = max((f["tokens_per_s"] for f in flex if f), default=None)
    x_sdpa = r["tokens_per_s"] / sd["tokens_per_s"] if sd else None
    x_flex = r["tokens_per_s"] / fl if fl else None
    g = r.get("gpu")
    return [f"{r['tokens_per_s']:,.0f}", _f(x_sdpa, "{:.2f}x"), _f(x_flex, "{:.2f}x"),
            _f(g["busy_fraction"] * 100 if g else None, "{:.0f} %"), _f(r.get("peak_mem_gb"), "{:.1f}"),
            _f(r.get("setup_s"), "{:.1f}"), _f(r.get("compile_s"), "{:.0f}")]


def _train_table(payload, L) -> list[str]:
    res = payload["results"]
    rows = [r for r in res if r.get("mode") == "train" and r.get("seq_len") == L]
    dense = _find(res, "train", L, "sdpa_causal")
    lines = ["| variant | status | steps | tokens/s | vs SDPA | vs Flex | GPU busy | peak GB | setup s | compile s | "
             "attention ms/step | held-out bpb (step) | gap vs dense | probe acc | block density |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        sp = _speed_cols(payload, r)
        if _ok(r):
            fin = r.get("final") or {}
            g = gap_vs_dense(res, L, r) if r is not dense else None
            gap = "—" if r is dense else (f"{g[3]:+.1%} (step {g[0]})" if g else "n/a")
            bpb = f"{fin['bpb']:.3f} ({fin['step']})" if fin.get("bpb") is not None else "n/a"
            pa = _f(fin.get("probe_acc"), "{:.2f}")
            steps = str(r["steps"])
        else:
            bpb = gap = pa = steps = ""
        att = _f((r.get("gpu") or {}).get("attention_kernel_ms_per_step"), "{:.1f}")
        lines.append(f"| {_label(r)} | {_status_cell(r)} | {steps} | {' | '.join(sp)} | {att} | {bpb} | {gap} | {pa} | "
                     f"{_f(r.get('block_density'), '{:.3f}')} |")
    return lines


def _speed_table(payload, L) -> list[str]:
    res = payload["results"]
    rows = [r for r in res if r.get("mode") == "throughput" and r.get("seq_len") == L]
    lines = ["| variant | status | tokens/s | vs SDPA | vs Flex | GPU busy | peak GB | setup s | compile s | "
             "attention kernels ms/step | graphs (first step / later) | block density |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g = r.get("gpu") or {}
        att = _f(g.get("attention_kernel_ms_per_step"), "{:.1f}")
        dyn = r.get("dynamo")
        graphs = f"{dyn['graphs_first_step']} / {dyn['recompiles']}" if dyn else "n/a"
        lines.append(f"| {_label(r)} | {_status_cell(r)} | {' | '.join(_speed_cols(payload, r))} | {att} | {graphs} | "
                     f"{_f(r.get('block_density'), '{:.3f}')} |")
    return lines


def _profiles(payload, L) -> list[str]:
    """Top kernels of our variants that miss the GPU-busy target (the evidence for the why)."""
    lines = []
    for r in payload["results"]:
        g = r.get("gpu")
        if r.get("seq_len") != L or r.get("impl") != "bsfa" or not g or g["busy_fraction"] >= 0.9:
            continue
        lines += [f"`{r['variant']}` ({r['mode']} run): {g['busy_fraction']:.1%} busy, "
                  f"{g['device_ms_per_step']:.1f} ms device / {g['wall_ms_per_step']:.1f} ms wall per step, "
                  f"{g['kernels_per_step']:.0f} device activities per step. Top kernels (ms per step): "
                  + "; ".join(f"`{k['name'][:60]}` {k['ms_per_step']:.2f}" for k in g["top_kernels"][:5]) + ".", ""]
    return lines


def markdown(payload: dict, figures: dict) -> str:
    res = payload["results"]
    runs = payload["runs"]
    data = _data_info(payload) or {}
    # the setup describes the latest run that trained (else the latest run)
    ordered = sorted(runs.items())
    train_runs = [run for rid, run in ordered if any(r.get("run_id") == rid and r.get("mode") == "train" for r in res)]
    any_run = (train_runs or [run for _, run in ordered] or [{}])[-1]
    c = any_run.get("config", {})
    pats = any_run.get("patterns", {})
    envs = sorted({f"{r.get('env', {}).get('device', '?')} (torch {r.get('env', {}).get('torch', '?')}, "
                   f"triton {r.get('env', {}).get('triton', '?')})" for r in runs.values()})
    L_train = sorted({r["seq_len"] for r in res if r.get("mode") == "train"})
    L_speed = sorted({r["seq_len"] for r in res if r.get("mode") == "throughput"})
    from .data import N_VALS

    scope = "per block (regional: one compiled graph serves every layer)" if c.get("compile_scope") == "block" \
        else "of the whole model"
    api = {"module": "nn.BlockSparseAttention", "attention": "bsfa.attention",
           "attention_op": "bsfa.attention_op"}.get(c.get("bsfa_api", "module"), "nn.BlockSparseAttention")
    out = [
        "# Long-context training: blocksparse_fa beside SDPA, FlashAttention-4 and FlexAttention",
        "",
        "A byte-level language model trained from scratch on the source code of the Python standard "
        "library, with dense causal attention (PyTorch SDPA, cuDNN where it runs), FlashAttention-4, "
        "FlexAttention (Triton and FLASH backends) and blocksparse_fa, all under "
        "`torch.compile`, on the same data in the same order from the same initial weights. It measures "
        "what a sparse pattern costs in quality (held-out bits per byte, a long-range recall probe) and "
        "what it saves in time (tokens/s, GPU busy, memory, recompiles). Generated by "
        "`python benchmarks/train_long_context.py report --update-docs` from "
        "`docs/data/training_results.json`.",
        "",
        f"Measured on {'; '.join(envs)}.",
        "",
        "## Setup",
        "",
        f"- **Data**: the `.py` files of the Python {data.get('python', '?')} standard library "
        f"(`sysconfig` stdlib, `site-packages` excluded), sorted by path; a file is held out when a hash of "
        f"its path falls in {data.get('held_out_permille', '?') / 10 if data else '?'} % "
        f"({data.get('files_train', '?')} training files, {data.get('bytes_train', 0) / 1e6:.1f} MB; "
        f"{data.get('files_heldout', '?')} held-out files, {data.get('bytes_heldout', 0) / 1e6:.2f} MB; "
        f"corpus digest `{data.get('sha256', '?')}`). Each split is one stream of bytes with a `BOS` "
        "token opening every file; training sequences are windows at uniformly random offsets. "
        f"Unigram entropy of the training bytes: **{_f(data.get('unigram_entropy_bpb'), '{:.3f}')} bits/byte**; "
        f"the unigram model scores {_f(data.get('unigram_heldout_bpb'), '{:.3f}')} bits/byte on the held-out "
        "files: the level a model that learned nothing but byte frequencies reaches.",
        f"- **Probe** (multi-query associative recall): {c.get('probe_pairs', '?')} key-value pairs written "
        "at the start of the sequence (inside the global-token prefix of Longformer and BigBird), then "
        "passes near the end that repeat every key in a random order, each followed by its value; the "
        "scored prediction is the value. Every query key is more than `layers x window` tokens after any "
        "earlier occurrence of its key, so a sliding window, even stacked over all layers, sees only text "
        f"and unrelated pairs: it is at chance ({1 / N_VALS:.3f}). Global tokens and dense attention see the "
        f"prefix. {c.get('probe_rate', 0):.0%} of the training sequences are probes; their loss is the mean "
        f"text loss plus {c.get('probe_weight', 1)} x the mean answer loss. Held-out probes use held-out text.",
        f"- **Model**: decoder, {c.get('layers')} layers, d_model {c.get('d_model')}, {c.get('heads')} query / "
        f"{c.get('kv_heads')} KV heads of dim {c.get('head_dim')} (GQA), RoPE (base {c.get('rope_base', 0):g}), "
        "pre-norm RMSNorm, SwiGLU MLP, vocabulary 512 (bytes, `BOS`, probe tokens), batch "
        f"{c.get('batch')} sequence(s). bf16 autocast on the GPU, fp32 weights, fused AdamW (lr "
        f"{c.get('lr')}, {c.get('warmup')} warm-up steps, cosine to {c.get('min_lr_frac', 0.1):g} x, weight "
        f"decay {c.get('weight_decay')}), gradient clipping {c.get('grad_clip')}. {_same_init(payload)}",
        f"- **Compilation**: `torch.compile` {scope}{'' if c.get('compile', True) else ' (off for these runs)'}, "
        f"mode `{c.get('compile_mode', 'default')}`. blocksparse_fa static patterns run through `{api}` (traced "
        "with `fullgraph=True` where it compiles). Packed documents need a mask per batch: "
        "`bsfa.attention(q, k, v, mask=causal() & document(ids))` inside the compiled block (`op`, the "
        "default: a failure to compile is reported as the result), or, with `--bsfa-mode island`, in a "
        "`torch.compiler.disable` region with the layout compiled once per batch outside the model. "
        "The mode each run used is listed below; *graphs* counts the graphs Dynamo compiled in the "
        "first step and after it (a per-batch mask that recompiles shows up there). FlashAttention-4 "
        "runs through two custom ops (no graph break): causal, and packed documents through its varlen "
        "form (one sequence per document). FlexAttention gets the same patterns as "
        "`mask_mod` functions; its `BlockMask` (visited and full blocks) is built from block states "
        "with `BlockMask.from_kv_blocks` (static patterns: from the pattern's block layout, once per "
        "length; documents: from the first and last document id of every block, on the GPU, once per "
        "batch), identical to what `create_block_mask` returns and built in milliseconds. "
        "(`torch.compile(create_block_mask)` on torch 2.11 spends minutes compiling the block-mask sort "
        "on its first call, and the eager `create_block_mask` evaluates all L x L pairs; "
        "`--flex-block-mask create` selects it.) Flex-FLASH is the same call with "
        "`kernel_options={\"BACKEND\": \"FLASH\"}`.",
        "",
        f"Patterns (layout block size {pats.get('block_size', '?')}):",
        "",
        "| pattern | expression |",
        "|---|---|",
    ]
    desc = {"causal": "causal()",
            "sliding": f"sliding_window({pats.get('sliding_window')})",
            "longformer": f"causal & (window({pats.get('longformer_window')}) | "
                          f"global_tokens({pats.get('longformer_global')}))",
            "bigbird": f"causal & (window({pats.get('bigbird_window')}) | "
                       f"global_tokens({pats.get('bigbird_global')}) | random_blocks({pats.get('bigbird_random')}))",
            "documents": "causal & document(file ids of the window)"}
    for fam in FAMILY_ORDER:
        out.append(f"| {fam} | `{desc[fam].replace('|', chr(92) + '|')}` |")
    out += [
        "",
        "Measurements: tokens/s from the median step time after the first "
        f"{c.get('sync_steps', 2)} steps (their excess over the median is the compile time, reported "
        "separately, as is the setup: model, optimiser, block masks or layouts, evaluation data); a step "
        "runs from one step's start to the next (CUDA events, no synchronisation in the loop), so "
        "per-batch host work such as building a document mask counts. Every variant follows the same "
        f"learning-rate schedule over {c.get('steps')} planned steps; under a time limit the first "
        "variants run an equal number of steps, planned from the measured step time, and later ones run "
        "at most as many (the schedule is not rescaled, so equal steps mean identical learning rates and "
        "batches). GPU busy: `torch.profiler` over a few extra steps, the union of device activity "
        "intervals over their wall time. Peak memory: `torch.cuda.max_memory_allocated`. Held-out bits "
        f"per byte on {c.get('eval_windows')} fixed held-out windows, probe accuracy on "
        f"{c.get('eval_probes')} fixed held-out probe sequences, both evaluated every "
        f"{c.get('eval_every')} steps (not counted as training time). The gap vs dense compares held-out "
        "bits per byte at the last step both runs evaluated. \"vs SDPA\" and \"vs Flex\" compare with "
        "results measured on the same GPU; \"vs Flex\" with the faster of Flex's Triton and FLASH "
        "backends on the same pattern.",
        "",
    ]
    for L in L_train:
        out += [f"## Training at {length_label(L)} tokens", ""] + _coverage(payload, L, "train") \
            + _probe_line(payload, L) + _train_table(payload, L) + [""]
        if figures.get(L):
            out += [f"![training curves at {length_label(L)}]({figures[L]})", ""]
        out += _modes(payload, L, "train")
    if not L_speed:
        out += ["## Throughput at 16K to 128K", "",
                "Not measured in the runs above (`throughput` below measures them; the GPU time available "
                "went to the 64K comparison).", ""]
    if L_speed:
        out += ["## Throughput (a few steps, no evaluation)", ""]
        for L in L_speed:
            out += [f"### {length_label(L)} tokens", ""] + _coverage(payload, L, "throughput") \
                + _speed_table(payload, L) + [""]
        if figures.get("throughput"):
            out += [f"![tokens/s]({figures['throughput']})", ""]
    tg = targets(payload)
    out += ["## Targets", "",
            "At 64K tokens, 8 layers, d_model 1024, 8 query / 2 KV heads of dim 128, on an H100.", "",
            "| target | measured | met | detail |", "|---|---:|---|---|"]
    for t in tg:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
        out.append(f"| {t['target']} | {t['measured'] or 'n/a'} | {met} | {t['detail']} |")
    prof = _profiles(payload, TARGET["seq_len"])
    if prof:
        out += ["", "Profiles of the variants below the GPU-busy target:", ""] + prof
    out += ["", "## Reproduce", "", "```",
            "# GPU: the 64K comparison (priority order: dense, ours and Flex Longformer for equal steps, then the",
            "# other patterns as time allows; whatever the deadline leaves out is listed above as not run)",
            "python benchmarks/train_long_context.py run --deadline 540 --out /tmp/train",
            "# GPU: tokens/s, GPU busy, memory and recompiles at 16K-128K (a few steps, no evaluation; ours",
            "# causal and documents first and never skipped, then SDPA, FA4, Flex-Triton, Flex-FLASH)",
            "python benchmarks/train_long_context.py throughput --deadline 540 --out /tmp/speed",
            "# this page and the figures from the result files",
            "python benchmarks/train_long_context.py report /tmp/train/training_results.json "
            "/tmp/speed/training_results.json --update-docs",
            "# a tiny run on the CPU (seconds; FlexAttention has no CPU backward and is skipped)",
            "python benchmarks/train_long_context.py --device cpu", "```"]
    out += [""] + CP_SECTION
    out += ["", "## Runs", ""]
    for _, run in sorted(runs.items()):
        rc, env = run.get("config", {}), run.get("env", {})
        summary = (f"lengths {rc.get('seq_len')}, {rc.get('layers')} layers x d_model {rc.get('d_model')}, "
                   f"{rc.get('steps')} steps, compile {'on' if rc.get('compile') else 'off'}")
        versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "triton", "python") if env.get(k))
        argv = " ".join(os.path.basename(a) if os.path.isabs(a) else a for a in run.get("argv", []))
        out.append(f"- `python benchmarks/train_long_context.py {argv}` on {env.get('device', '?')}"
                   f"{f' ({versions})' if versions else ''}: {summary}")
    out += ["", "Raw data, including per-step times and losses, evaluation histories and profiles: "
            "`docs/data/training_results.json`.", ""]
    return "\n".join(out)


CP_SECTION = [
    "## Several GPUs (context parallelism)", "",
    "The `cp` command trains the same decoder with every sequence sharded across the ranks of a `torchrun` job:",
    "",
    "```",
    "torchrun --nproc-per-node 2 benchmarks/train_long_context.py cp --device cuda --pattern longformer \\",
    "    --seq-len 131072 --steps 20 --json /tmp/cp.json",
    "torchrun --nproc-per-node 2 benchmarks/train_long_context.py cp --device cpu --seq-len 512 --steps 6  # seconds",
    "```",
    "",
    "The plan of blocksparse_fa's context parallelism (`plan_context_parallel`, `--strategy auto` by default) "
    "gives each rank its tokens; one permutation shards the tokens, the targets, the loss weights and the rotary "
    "positions, so every token keeps its global position. Attention runs through "
    "`nn.BlockSparseAttention(context_parallel=group)` with the plan (each rank fetches only the key/value blocks "
    "its queries visit); the rest of the model is per token. The loss weights are normalised over the whole batch, "
    "so the ranks' losses add up to the single-process loss, and the gradients of the replicated parameters are "
    "all-reduced before clipping and the AdamW step: the run computes what one process computes on the same "
    "batches (tested on two CPU processes against a single-process run, step by step). It prints tokens/s, per "
    "rank the tokens held, tokens/s and peak memory, the loss of every step and the plan; `--json` writes them. "
    "Static patterns only (causal, sliding, longformer, bigbird), eager mode, no evaluation. No multi-GPU "
    "training results are recorded on this page yet; `docs/distributed.md` has the attention-level GPU "
    "measurements.",
]


def _coverage(payload, L, mode) -> list[str]:
    """Which variants were measured at this length and which were not (and why)."""
    rs = [r for r in payload["results"] if r.get("seq_len") == L and r.get("mode") == mode]
    ok = [r["variant"] for r in rs if _ok(r)]
    short = [f"{r['variant']} ({r['steps']} of {r['steps_planned']})" for r in rs
             if _ok(r) and r.get("steps_planned") and r.get("steps", 0) < r["steps_planned"]]
    skipped = [f"{r['variant']} ({_reason(r)})" for r in rs if r.get("status") == "skipped"]
    failed = [f"{r['variant']} ({r.get('status')})" for r in rs if r.get("status") in ("oom", "error")]
    out = [f"Measured: {', '.join(f'`{v}`' for v in ok) or 'none'}."]
    devices = sorted({_device(payload["runs"], r) for r in rs if _ok(r)} - {""})
    if devices:
        out.append(f"GPU: {', '.join(devices)}.")
    if short:
        out.append(f"Fewer steps than planned: {', '.join(short)}.")
    if skipped:
        out.append(f"Not run: {'; '.join(skipped)}.")
    if failed:
        out.append(f"Failed: {', '.join(failed)}.")
    return [" ".join(out), ""]


def _probe_line(payload, L) -> list[str]:
    from .data import N_VALS

    for r in payload["results"]:
        p = r.get("probe")
        if r.get("seq_len") == L and r.get("mode") == "train" and p:
            line = (f"Probe at this length: {p['pairs']} pairs, {len(p['rounds'])} query pass(es) "
                    f"({p['pairs'] * len(p['rounds'])} scored answers per probe sequence), every query more "
                    f"than {p['reach']:,} tokens after the earlier occurrences of its key; chance accuracy "
                    f"{1 / N_VALS:.3f}.")
            if p.get("window_reachable"):
                line += (" **At this length the windowed models can reach the key-value prefix** (the "
                         "sequence is too short to keep the queries out of their reach).")
            best = {}
            for q in payload["results"]:
                if q.get("seq_len") == L and q.get("mode") == "train" and _ok(q):
                    accs = [e.get("probe_acc") or 0.0 for e in (q.get("evals") or []) if isinstance(e, dict)]
                    best[q["variant"]] = max(accs, default=0.0)
            if best and max(best.values()) <= 3.0 / N_VALS:
                steps = max((q.get("steps") or 0) for q in payload["results"] if q.get("seq_len") == L)
                line += (f" **No variant, dense included, learned the probe within {steps} steps** (best held-out "
                         f"accuracy {max(best.values()):.3f}, chance {1 / N_VALS:.3f}): this run does not show the "
                         "difference between a window alone and a window with global tokens; that needs a longer "
                         "run.")
            return [line, ""]
    return []


def _same_init(payload) -> str:
    """Whether every finished run with the same model shape started from the same weights."""
    groups: dict = {}
    for r in payload["results"]:
        if _ok(r) and r.get("init_checksum") is not None:
            c = _cfg(payload, r)
            shape = tuple(c.get(k) for k in ("layers", "d_model", "heads", "kv_heads", "head_dim", "seed"))
            groups.setdefault(shape, set()).add(r["init_checksum"])
    if not groups:
        return ""
    if all(len(v) == 1 for v in groups.values()):
        return "Every variant starts from the same initial weights (checked by checksum) and sees the same batches."
    return "**Initial weights differ between some variants of the same shape** (checksums in the JSON)."


def _modes(payload, L, mode) -> list[str]:
    lines = []
    for r in payload["results"]:
        if r.get("seq_len") != L or r.get("mode") != mode:
            continue
        info = r.get("info") or {}
        bits = []
        if info.get("sdpa_backend"):
            bits.append(f"SDPA backend: {info['sdpa_backend']}")
        if info.get("bsfa_mode"):
            bits.append(f"{info.get('bsfa_api', '')} mode `{info['bsfa_mode']}`")
        for n in r.get("compile_notes") or []:
            bits.append(n)
        if bits:
            lines.append(f"- {_label(r)}: " + "; ".join(bits))
    return lines + [""] if lines else []


def write_docs(payload: dict, docs_dir: str) -> dict:
    """``training.md`` and the figures in ``docs_dir``; removes figures of lengths no longer present."""
    os.makedirs(docs_dir, exist_ok=True)
    figures, written = {}, set()
    for L in sorted({r["seq_len"] for r in payload["results"] if r.get("mode") == "train"}):
        name = f"training_curves_{length_label(L).lower()}.png"
        if plot_curves(payload, L, os.path.join(docs_dir, name)):
            figures[L] = name
            written.add(name)
    if plot_throughput(payload, os.path.join(docs_dir, "training_throughput.png")):
        figures["throughput"] = "training_throughput.png"
        written.add("training_throughput.png")
    for old in glob.glob(os.path.join(docs_dir, "training_*.png")):
        if os.path.basename(old) not in written:
            os.remove(old)
    with open(os.path.join(docs_dir, "training.md"), "w", encoding="utf-8") as f:
        f.write(markdown(payload, figures))
    return figures
