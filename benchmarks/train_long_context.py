"""Train a small decoder from scratch on a synthetic long-range retrieval task, with dense SDPA,
FlexAttention and block-sparse (ours) attention; report tokens/s, peak memory and loss curves.

    python benchmarks/train_long_context.py                     # GPU defaults: 16K tokens, 6 x 512
    python benchmarks/train_long_context.py --device cpu        # tiny CPU run (seq 256, 2 x 64)
    python benchmarks/train_long_context.py --variants sdpa,bsfa_longformer --steps 100 --out /tmp/run

The task (associative recall across the whole sequence). Each training sequence is a stream of
``(key, value)`` token pairs. A sequence draws its own set of ``S`` distinct keys (``S`` log-uniform
in ``[s_min, s_max]``) and a random value for each; every pair repeats one of those keys with its
value. The loss is the cross-entropy of predicting the *value* after a key that already occurred
earlier in the sequence (first occurrences are unpredictable and not scored); keys are not scored.
The distance back to the previous occurrence is about ``2·S`` tokens, so small-``S`` sequences are
solvable by local attention and large-``S`` sequences need attention across thousands of tokens.
At the end each variant is evaluated (retrieval accuracy) on held-out sequences, split by that
distance.

Variants (``--variants``, comma separated):
  ``sdpa``             dense causal ``F.scaled_dot_product_attention`` (FlashAttention on CUDA)
  ``flex_longformer``  ``torch.nn.attention.flex_attention`` (compiled) with a ``mask_mod`` equal to
                       ``causal & longformer`` (CUDA only)
  ``flex_bigbird``     same with ``causal & bigbird`` (CUDA only)
  ``bsfa_longformer``  ours, ``causal & longformer`` (window 256 + 64 global tokens by default)
  ``bsfa_bigbird``     ours, ``causal & bigbird`` (window 192 + 128 global + 3 random blocks)
  ``bsfa_causal``      ours with the dense ``causal`` pattern (kernel-vs-kernel reference)

All variants share the architecture (pre-norm, RoPE, GQA, GELU MLP), the initial weights, the data
and the optimiser; only the attention core differs. Outputs in ``--out`` (default ``docs/``):
``training_results.json``, ``training_loss.png`` and ``training.md``.

GPU defaults (H100, bf16 autocast): seq 16384, 6 layers, d_model 512, 8 heads, 2 KV heads, batch 1,
up to 1000 steps (AdamW, lr 2e-3, 50 warm-up steps, cosine) with a per-variant wall-clock cap
``--time-budget 80`` s: training stops early when the cap is hit (compilation and autotuning count
against it), tokens/s is measured on the steps run, and the loss-versus-time panel of the plot is
the fair comparison between variants that ran different numbers of steps. Four variants take at most
about 6-7 minutes including model setup and evaluation. Induction-style retrieval is learned after a
plateau at ln(value_vocab); if the loss has not left it, train longer (``--steps``, ``--time-budget``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import blocksparse_fa as bsfa
from blocksparse_fa.mask import primitives as P
from blocksparse_fa.mask.expr import And, Mask, Not, Or
from blocksparse_fa.nn import BlockSparseAttention, apply_rotary

ALL_VARIANTS = ("sdpa", "flex_longformer", "flex_bigbird", "bsfa_longformer", "bsfa_bigbird", "bsfa_causal")
GPU_DEFAULT_VARIANTS = ("sdpa", "flex_longformer", "bsfa_longformer", "bsfa_bigbird")
CPU_DEFAULT_VARIANTS = ("sdpa", "bsfa_longformer", "bsfa_bigbird")


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (GPU 16384, CPU 256)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (GPU 6, CPU 2)")
    ap.add_argument("--d-model", type=int, default=None, help="model width (GPU 512, CPU 64)")
    ap.add_argument("--heads", type=int, default=None, help="query heads (GPU 8, CPU 4)")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads, GQA (GPU 2, CPU 2)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (GPU 1, CPU 2)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per variant (GPU 1000, CPU 20)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="wall-clock cap per variant in seconds, 0 = none (GPU 80, CPU 0)")
    ap.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate (GPU 2e-3, CPU 3e-3)")
    ap.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default min(50, steps // 10))")
    ap.add_argument("--variants", default=None, help=f"comma-separated subset of {', '.join(ALL_VARIANTS)}")
    ap.add_argument("--block-size", type=int, default=None, help="layout block size of ours and flex (GPU 128, CPU 32)")
    ap.add_argument("--window", type=int, default=None, help="longformer window (default: pattern file, 256; CPU seq/8)")
    ap.add_argument("--n-global", type=int, default=None, help="global tokens (default: pattern files; CPU seq/16)")
    ap.add_argument("--bigbird-window", type=int, default=None, help="bigbird window (default 192; CPU seq/8)")
    ap.add_argument("--n-random", type=int, default=None, help="bigbird random key blocks per query block (default 3; CPU 1)")
    ap.add_argument("--key-vocab", type=int, default=None, help="key tokens (GPU 8192, CPU 64)")
    ap.add_argument("--value-vocab", type=int, default=None, help="value tokens (GPU 256, CPU 32)")
    ap.add_argument("--s-min", type=int, default=None, help="fewest distinct keys per sequence (GPU 16, CPU 4)")
    ap.add_argument("--s-max", type=int, default=None, help="most distinct keys per sequence (GPU 2048, CPU 32)")
    ap.add_argument("--eval-batches", type=int, default=None, help="held-out batches for accuracy (GPU 4, CPU 2)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the whole model (all variants)")
    ap.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs"),
                    help="output folder (default docs/)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    gpu = args.device.startswith("cuda")
    defaults = dict(seq_len=16384, layers=6, d_model=512, heads=8, kv_heads=2, batch=1, steps=1000, time_budget=80.0,
                    lr=2e-3, block_size=128, key_vocab=8192, value_vocab=256, s_min=16, s_max=2048, eval_batches=4) if gpu \
        else dict(seq_len=256, layers=2, d_model=64, heads=4, kv_heads=2, batch=2, steps=20, time_budget=0.0,
                  lr=3e-3, block_size=32, key_vocab=64, value_vocab=32, s_min=4, s_max=32, eval_batches=2)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.warmup is None:
        args.warmup = max(1, min(50, args.steps // 10))
    small = args.seq_len < 4096
    if args.window is None:
        args.window = max(8, args.seq_len // 8) if small else 256
    if args.n_global is None:
        args.n_global = max(4, args.seq_len // 16) if small else 64
    if args.bigbird_window is None:
        args.bigbird_window = max(8, args.seq_len // 8) if small else 192
    if args.n_random is None:
        args.n_random = 1 if small else 3
    args.bigbird_global = max(4, args.seq_len // 16) if small else 128
    if args.variants is None:
        args.variants = ",".join(GPU_DEFAULT_VARIANTS if gpu else CPU_DEFAULT_VARIANTS)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in ALL_VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; choose from {', '.join(ALL_VARIANTS)}")
    if args.d_model % args.heads or args.heads % args.kv_heads:
        ap.error("--d-model must be divisible by --heads, and --heads by --kv-heads")
    if args.s_max * 2 > args.seq_len or args.s_min < 1 or args.s_min > args.s_max or args.s_max > args.key_vocab:
        ap.error("need 1 <= s_min <= s_max <= key_vocab and 2 * s_max <= seq_len")
    return args


def patterns(args) -> dict:
    """The masks (ours) of each pattern family, at the configured sizes."""
    longformer = bsfa.load_pattern("longformer", window=args.window, n_global=args.n_global)
    bigbird = bsfa.load_pattern("bigbird", window=args.bigbird_window, n_global=args.bigbird_global,
                                n_random=args.n_random, block=args.block_size, seed=args.seed)
    return {"longformer": bsfa.causal() & longformer, "bigbird": bsfa.causal() & bigbird, "causal": bsfa.causal()}


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def make_batch(args, gen: torch.Generator):
    """``tokens (B, L)``, ``labels (B, L)`` (-100 where not scored) and ``gaps (B, L)`` (tokens back to
    the previous occurrence of the key, for the scored positions)."""
    B, L = args.batch, args.seq_len
    K, V = args.key_vocab, args.value_vocab
    npairs = L // 2
    tokens = torch.zeros(B, L, dtype=torch.long)
    labels = torch.full((B, L), -100, dtype=torch.long)
    gaps = torch.zeros(B, L, dtype=torch.long)
    lo, hi = math.log(args.s_min), math.log(args.s_max)
    for b in range(B):
        s = int(round(math.exp(lo + (hi - lo) * torch.rand((), generator=gen).item())))
        s = min(max(s, args.s_min), args.s_max)
        keyset = torch.randperm(K, generator=gen)[:s] + 1
        values = torch.randint(0, V, (s,), generator=gen) + 1 + K
        idx = torch.randint(0, s, (npairs,), generator=gen)
        pos = torch.arange(npairs)
        tokens[b, 0:2 * npairs:2] = keyset[idx]
        tokens[b, 1:2 * npairs:2] = values[idx]
        order = torch.argsort(idx * npairs + pos)
        sidx, spos = idx[order], pos[order]
        prev = torch.full((npairs,), -1, dtype=torch.long)
        same = sidx[1:] == sidx[:-1]
        prev[spos[1:][same]] = spos[:-1][same]
        seen = prev >= 0
        kpos = 2 * pos[seen]
        labels[b, kpos] = values[idx[seen]]
        gaps[b, kpos] = 2 * (pos[seen] - prev[seen])
    return tokens, labels, gaps


# ------------------------------------------------------------------------------------------------
# FlexAttention mask_mod from a blocksparse_fa Mask (self-attention: query position == row index)
# ------------------------------------------------------------------------------------------------
def mask_mod_from(mask: Mask, n: int, device):
    """A ``mask_mod(b, h, q_idx, kv_idx)`` equal to ``mask`` for self-attention over ``n`` positions."""

    def build(m):
        if isinstance(m, And):
            fs = [build(c) for c in m.children]

            def f(b, h, q, kv, fs=fs):
                out = fs[0](b, h, q, kv)
                for g in fs[1:]:
                    out = out & g(b, h, q, kv)
                return out
            return f
        if isinstance(m, Or):
            fs = [build(c) for c in m.children]

            def f(b, h, q, kv, fs=fs):
                out = fs[0](b, h, q, kv)
                for g in fs[1:]:
                    out = out | g(b, h, q, kv)
                return out
            return f
        if isinstance(m, Not):
            g = build(m.children[0])
            return lambda b, h, q, kv: ~g(b, h, q, kv)
        if isinstance(m, P.Full):
            return lambda b, h, q, kv: q >= 0
        if isinstance(m, P.Causal):
            return lambda b, h, q, kv: kv <= q
        if isinstance(m, P.Window):
            w = m.w
            return lambda b, h, q, kv: (q - kv <= w) & (kv - q <= w)
        if isinstance(m, P.SlidingWindow):
            w = m.w
            return lambda b, h, q, kv: (q - kv >= 0) & (q - kv < w)
        if isinstance(m, P.GlobalTokens):
            g_ = m.g
            return lambda b, h, q, kv: (q < g_) | (kv < g_)
        if isinstance(m, P.Chunked):
            c = m.c
            return lambda b, h, q, kv: (q // c) == (kv // c)
        if isinstance(m, P.RandomBlocks):
            bs = m.block_size
            nb = -(-n // bs)
            table = np.zeros((nb, nb), dtype=bool)
            if m.r:
                np.put_along_axis(table, m.chosen(np.arange(nb), nb), True, axis=1)
            t = torch.from_numpy(table).to(device)
            return lambda b, h, q, kv: t[q // bs, kv // bs]
        dense = m.to_dense(n, n).to(device)  # any other primitive: exact table lookup
        if dense.dim() == 4:
            return lambda b, h, q, kv: dense[b % dense.shape[0], h % dense.shape[1], q, kv]
        return lambda b, h, q, kv: dense[q, kv]

    return build(mask)


# ------------------------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------------------------
class SDPACore(nn.Module):
    def forward(self, q, k, v):
        g = q.shape[1] // k.shape[1]
        if g > 1:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class FlexCore(nn.Module):
    def __init__(self, mask: Mask, n: int, block_size: int, device):
        super().__init__()
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.block_mask = create_block_mask(mask_mod_from(mask, n, device), B=None, H=None, Q_LEN=n, KV_LEN=n,
                                            device=device, BLOCK_SIZE=block_size)
        self.flex = torch.compile(flex_attention, dynamic=False)

    def forward(self, q, k, v):
        return self.flex(q, k, v, block_mask=self.block_mask, enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    def __init__(self, d, heads, kv_heads, core):
        super().__init__()
        self.h, self.hkv, self.dh = heads, kv_heads, d // heads
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * self.dh, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.core = core

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.dh, self.hkv * self.dh, self.hkv * self.dh], dim=-1)
        q = q.view(B, L, self.h, self.dh).transpose(1, 2)
        k = k.view(B, L, self.hkv, self.dh).transpose(1, 2)
        v = v.view(B, L, self.hkv, self.dh).transpose(1, 2)
        pos = torch.arange(L, device=x.device)
        q, k = apply_rotary(q, pos), apply_rotary(k, pos)
        o = self.core(q, k, v)
        return self.o(o.transpose(1, 2).reshape(B, L, self.h * self.dh))


class Block(nn.Module):
    def __init__(self, d, heads, kv_heads, core):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, kv_heads, core)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class Decoder(nn.Module):
    def __init__(self, vocab, d, layers, heads, kv_heads, make_core):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, heads, kv_heads, make_core()) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, labels):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        sel = labels >= 0  # unembed only the scored positions
        logits = self.head(self.norm(x[sel])).float()
        return F.cross_entropy(logits, labels[sel]), logits


def make_core_factory(variant: str, args, pats: dict):
    family = variant.split("_", 1)[1] if "_" in variant else None
    if variant == "sdpa":
        return SDPACore, "causal (dense)", 0.5
    mask = pats[family]
    density = bsfa.compile_mask(mask, args.seq_len, args.seq_len, args.block_size).density
    if variant.startswith("flex"):
        return (lambda: FlexCore(mask, args.seq_len, args.block_size, args.device)), str(mask), density
    return (lambda: BlockSparseAttention(mask, block_size=args.block_size)), str(mask), density


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------
def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def train_variant(variant: str, args, pats: dict, log) -> dict:
    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    if variant.startswith("flex") and not gpu:
        return {"skipped": "FlexAttention variants run on CUDA only"}
    make_core, pattern, density = make_core_factory(variant, args, pats)
    vocab = 1 + args.key_vocab + args.value_vocab
    torch.manual_seed(args.seed)  # identical initial weights for every variant
    model = Decoder(vocab, args.d_model, args.layers, args.heads, args.kv_heads, make_core).to(dev)
    fwd = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=gpu)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if gpu else torch.autocast("cpu", enabled=False)
    gen = torch.Generator().manual_seed(args.seed + 1)  # identical data for every variant
    if gpu:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    losses, times = [], []
    t_start = time.perf_counter()
    model.train()
    for step in range(args.steps):
        tokens, labels, _ = make_batch(args, gen)
        tokens, labels = tokens.to(dev, non_blocking=True), labels.to(dev, non_blocking=True)
        for gp in opt.param_groups:
            gp["lr"] = lr_at(step, args)
        _sync(dev)
        t0 = time.perf_counter()
        with amp:
            loss, _ = fwd(tokens, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            log(f"  {variant}: non-finite loss at step {step}; stopping")
            break
        if not args.quiet and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            log(f"  {variant:<16} step {step:>4}  loss {losses[-1]:.4f}  {times[-1] * 1e3:8.1f} ms")
        if args.time_budget and time.perf_counter() - t_start > args.time_budget and step >= 10:
            log(f"  {variant}: time budget of {args.time_budget:.0f} s reached after {step + 1} steps")
            break
    wall = time.perf_counter() - t_start
    peak = torch.cuda.max_memory_allocated(dev) / 2**20 if gpu else None
    skip = min(5, len(times) // 2)  # warm-up / compilation steps are not timed
    steady = times[skip:] or times
    tok_s = args.batch * args.seq_len * len(steady) / sum(steady)
    acc = evaluate(model, args, dev, amp)
    del model, fwd, opt
    if gpu:
        gc.collect()
        torch.cuda.empty_cache()
    return {"pattern": pattern, "block_density": density, "steps": len(losses), "losses": losses,
            "step_ms": [t * 1e3 for t in times], "tokens_per_s": tok_s, "peak_mem_mib": peak, "wall_s": wall,
            "final_loss": float(np.mean(losses[-max(1, len(losses) // 10):])), "eval_accuracy": acc}


@torch.no_grad()
def evaluate(model, args, dev, amp) -> dict:
    """Retrieval accuracy on held-out sequences, overall and by distance to the previous occurrence."""
    model.eval()
    gen = torch.Generator().manual_seed(10_000 + args.seed)
    L = args.seq_len
    edges = [0, max(2, L // 64), max(4, L // 8), L + 1]
    names = [f"gap<{edges[1]}", f"{edges[1]}<=gap<{edges[2]}", f"gap>={edges[2]}"]
    hit = np.zeros(3)
    cnt = np.zeros(3)
    for _ in range(args.eval_batches):
        tokens, labels, gaps = make_batch(args, gen)
        tokens, labels = tokens.to(dev), labels.to(dev)
        with amp:
            _, logits = model(tokens, labels)
        sel = labels >= 0
        ok = (logits.argmax(-1) == labels[sel]).cpu().numpy()
        g = gaps.to(dev)[sel].cpu().numpy()
        bucket = np.digitize(g, edges[1:-1])
        for i in range(3):
            hit[i] += ok[bucket == i].sum()
            cnt[i] += (bucket == i).sum()
    model.train()
    out = {n: (float(h / c) if c else None) for n, h, c in zip(names, hit, cnt)}
    out["all"] = float(hit.sum() / max(1, cnt.sum()))
    return out


# ------------------------------------------------------------------------------------------------
# reporting
# ------------------------------------------------------------------------------------------------
def _ema(xs, a=0.9):
    out, m = [], None
    for x in xs:
        m = x if m is None else a * m + (1 - a) * x
        out.append(m)
    return out


def plot(results: dict, path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        if "losses" not in r:
            continue
        steps = np.arange(1, len(r["losses"]) + 1)
        t = np.cumsum(r["step_ms"]) / 1e3
        axes[0].plot(steps, _ema(r["losses"]), label=name)
        axes[1].plot(t, _ema(r["losses"]), label=name)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training time (s)")
    for ax in axes:
        ax.set_ylabel("value cross-entropy (EMA 0.9)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"associative recall, seq {args.seq_len}, {args.layers} layers x d{args.d_model} ({args.device})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _env(args) -> dict:
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = None
    return {"device": name, "torch": torch.__version__, "triton": tv, "python": platform.python_version()}


def write_markdown(results: dict, path: str, args, env: dict) -> None:
    def fmt(x, f="{:.0f}"):
        return "n/a" if x is None else f.format(x)

    lines = [
        "# Long-context training: dense vs FlexAttention vs block-sparse",
        "",
        f"Run on **{env['device']}** (torch {env['torch']}, triton {env['triton']}), generated by "
        f"`python benchmarks/train_long_context.py {' '.join(args.argv_used)}`.".replace("  ", " "),
        "",
        f"Model: decoder, {args.layers} layers, d_model {args.d_model}, {args.heads} heads / {args.kv_heads} KV heads "
        f"(GQA), RoPE, trained from scratch, batch {args.batch} x {args.seq_len} tokens, AdamW lr {args.lr:g} "
        f"(warm-up {args.warmup}, cosine), {'bf16 autocast' if args.device.startswith('cuda') else 'float32'}, "
        f"up to {args.steps} steps{f' or {args.time_budget:.0f} s' if args.time_budget else ''} per variant.",
        "",
        f"Task: associative recall. Each sequence is a stream of (key, value) pairs over {args.key_vocab} key and "
        f"{args.value_vocab} value tokens; a sequence uses S distinct keys (S log-uniform in "
        f"[{args.s_min}, {args.s_max}]), each bound to a random value. Scored: the value after every key seen "
        f"before (distance to its previous occurrence about 2·S tokens). Chance accuracy {1 / args.value_vocab:.3f}, "
        f"chance loss ln({args.value_vocab}) = {math.log(args.value_vocab):.2f}.",
        "",
        "| variant | pattern | block density | tokens/s | peak memory (MiB) | steps | final loss | "
        "eval acc (all) | acc by distance to previous occurrence |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | | | | | |")
            continue
        acc = r["eval_accuracy"]
        by = ", ".join(f"{k}: {fmt(v, '{:.3f}')}" for k, v in acc.items() if k != "all")
        pat = r["pattern"].replace("|", "\\|")
        lines.append(f"| {name} | `{pat}` | {r['block_density']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {fmt(r['peak_mem_mib'])} | {r['steps']} | {r['final_loss']:.3f} | "
                     f"{acc['all']:.3f} | {by} |")
    lines += [
        "",
        "![training loss](training_loss.png)",
        "",
        "Tokens/s are measured on the training steps after the first five (compilation, autotuning); peak "
        "memory is `torch.cuda.max_memory_allocated` over the variant's training (n/a on CPU). The final loss "
        "is the mean of the last 10% of steps. Raw numbers, including per-step losses and times, are in "
        "`training_results.json`.",
        "",
    ]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv_used = []
    skip = False
    for a in argv:  # the command line for the report, without the output folder
        if skip or a.startswith("--out"):
            skip = a == "--out"
            continue
        args.argv_used.append(a)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, log)
    finally:
        torch.set_num_threads(threads)


def _run(args, log) -> dict:
    os.makedirs(args.out, exist_ok=True)
    pats = patterns(args)
    env = _env(args)
    log(f"device {env['device']}; seq {args.seq_len}, {args.layers} layers x d{args.d_model}; variants {args.variants}")
    results = {}
    for v in args.variants:
        log(f"== {v}")
        results[v] = train_variant(v, args, pats, log)
        r = results[v]
        if "skipped" in r:
            log(f"  skipped: {r['skipped']}")
        else:
            peak = "n/a" if r["peak_mem_mib"] is None else f"{r['peak_mem_mib']:.0f} MiB"
            log(f"  {v}: {r['tokens_per_s']:,.0f} tokens/s, peak memory {peak}, "
                f"final loss {r['final_loss']:.3f}, eval acc {r['eval_accuracy']['all']:.3f}")
    cfg = {k: v for k, v in vars(args).items() if k not in ("argv_used",)}
    payload = {"config": cfg, "env": env, "results": results}
    with open(os.path.join(args.out, "training_results.json"), "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
    plot(results, os.path.join(args.out, "training_loss.png"), args)
    write_markdown(results, os.path.join(args.out, "training.md"), args, env)
    log(f"wrote {os.path.join(args.out, 'training.md')}")
    return payload


if __name__ == "__main__":
    main()
