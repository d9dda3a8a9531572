"""GPU validation of the Triton kernels against a float64 reference (run on the H100).

For every pattern in ``masks/`` and a few extra expressions, at realistic sizes, it checks the output
and dQ, dK, dV: our error (vs float64) must be at most 2x the error of eager attention computed in
the same low precision (``reference_attention(upcast=False)``) plus a tiny floor. Outputs are
checked for NaN after poisoning the allocator's memory (an unwritten element shows up as NaN).

Score modifiers are checked the same way, a learned bias' gradient (dBias) included, and ``Dv != D``.

It also records first-call compile times and checks that changing a window size or a sequence
length does not recompile, except where the new layout falls into another tile class
(``kernels/config.py``: band, short partial-heavy, partial-heavy) or switches between lengths that
are and are not multiples of the block (the ``even`` variant): each new tile config of the forward
or the backward may add one compiled variant, no more.

``--lists MODE`` runs everything with ``kernel_options={"lists": MODE}`` (the kernels' lists from a
finer classification, ``compiler/finer.py``); the recompile check then also allows a new variant
where a layout's list blocks change.

    PYTHONPATH=. python benchmarks/validate_gpu.py [--quick] [--lists auto] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

import blocksparse_fa as bsfa
from blocksparse_fa.kernels import _attn_bwd, _attn_fwd

FLOOR = 1e-6
OPTIONS: dict = {}  # kernel_options of every checked call (--lists)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def poison():
    """Fill freed allocator memory with NaN so unwritten outputs show up."""
    x = torch.full((512 * 1024 * 1024 // 4,), float("nan"), device="cuda")
    del x


def n_compiled(fn) -> int:
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        return sum(len(v[0]) for v in caches.values())
    return sum(len(v) for v in getattr(fn, "cache", {}).values())


def doc_ids(n: int, seed: int = 0, lo: int = 1024, hi: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < n:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[:n]
    return ids


def patterns(n: int):
    out = []
    for name in bsfa.list_patterns():
        kw = {"document": doc_ids(n)} if name in ("document_causal", "shared_prefix") else {}
        if name == "padded_batch":  # per-batch valid lengths; the special cases run B=1 or 2
            kw["length"] = n - n // 5
        if name == "sliding_window":
            kw["window"] = min(4096, n // 2)
        out.append((name, bsfa.load_pattern(name, **kw)))
    out += [
        ("window(100)&~causal", bsfa.window(100) & ~bsfa.causal()),
        ("global|strided", bsfa.global_tokens(64) | bsfa.strided(97)),
        ("chunked(700)", bsfa.chunked(700)),
    ]
    return out


def check_one(mask, B, H, Hkv, Lq, Lk, D, dtype, dropout_p=0.0, seed=0, block=128, op=False, score_mod=None,
              bias_shape=None, bias_pad=0, Dv=None, opts=None, learn_slopes=False, align=None):
    """Output and dQ, dK, dV (and dBias with ``bias_shape``: a learned bias of that shape in the
    inputs' dtype, added to ``score_mod``; ``bias_pad`` keys at the end of sequence 0 get -inf) vs
    float64; ``Dv``: v's head dim when it differs from ``D``; ``learn_slopes``: float32 ALiBi slopes
    that require grad, added to ``score_mod`` (dSlopes checked last); ``align``: the query alignment."""
    torch.manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = torch.randn(B, H, Lq, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, Dv, device="cuda", dtype=dtype, requires_grad=True)
    do = torch.randn(B, H, Lq, Dv, device="cuda", dtype=dtype)
    ins = [q, k, v]
    if bias_shape is not None:
        b = torch.randn(bias_shape, device="cuda") * 2
        if bias_pad:
            b[0, ..., Lk - bias_pad:] = float("-inf")
        b = b.to(dtype).requires_grad_()
        ins.append(b)
        score_mod = bsfa.bias(b) if score_mod is None else score_mod + bsfa.bias(b)
    if learn_slopes:  # mixed signs: rows' key distances up to Lk weigh the slopes' gradient
        sl = (torch.linspace(-0.3, 0.3, H, device="cuda") * 0.1).requires_grad_()
        ins.append(sl)
        score_mod = bsfa.alibi(sl) if score_mod is None else score_mod + bsfa.alibi(sl)
    al = {} if align is None else dict(align=align)
    lay = bsfa.compile_mask(mask, Lq, Lk, block, device="cuda", **al)
    poison()
    t0 = time.perf_counter()
    fn = bsfa.attention_op if op else bsfa.attention  # the custom op (nn modules, transformers hook)
    sm = {} if score_mod is None else dict(score_mod=score_mod)
    out = fn(q, k, v, mask, dropout_p=dropout_p, dropout_seed=1234, kernel_options=dict(OPTIONS, **(opts or {})),
             **sm, **al)  # rewrites apply
    g = torch.autograd.grad(out, ins, do)
    torch.cuda.synchronize()
    t_first = time.perf_counter() - t0
    nan = bool(torch.isnan(out).any() or any(torch.isnan(x).any() for x in g))
    keep = bsfa.dropout_keep_mask(B, H, Lq, Lk, dropout_p, 1234, device="cuda") if dropout_p else None
    mask_dense = lay.to_dense().to("cuda") if Lq * Lk <= 1 << 28 else None
    mk = mask_dense if mask_dense is not None else mask
    ref = bsfa.reference_attention(q, k, v, mk, dropout_p=dropout_p, dropout_mask=keep, **sm, **al)
    gr = torch.autograd.grad(ref, ins, do.double())
    ref_out = ref.detach()
    del ref
    eager = bsfa.reference_attention(q, k, v, mk, dropout_p=dropout_p, dropout_mask=keep, upcast=False, **sm, **al)
    ge = torch.autograd.grad(eager, ins, do)
    ours = [rel(out, ref_out)] + [rel(a, b) for a, b in zip(g, gr)]
    eag = [rel(eager, ref_out)] + [rel(a, b) for a, b in zip(ge, gr)]
    ok = (not nan) and all(o <= 2 * e + FLOOR for o, e in zip(ours, eag))
    return dict(ours=ours, eager=eag, ok=ok, nan=nan, first_call_s=t_first, density=lay.density)


def _set_lists(mode):
    """Worker initializer: the ``lists`` kernel option (None: the package's default)."""
    if mode is not None:
        OPTIONS["lists"] = mode


def _warm(args):
    """Worker: run one (pattern, D, dtype) once at a small size so its kernels land in Triton's cache."""
    name, D, dt = args
    try:
        m = dict(patterns(1000))[name]
        check_one(m, 1, 2, 2, 1000, 1000, D, getattr(torch, dt))
        return "ok"
    except Exception as e:
        return f"{name} {D} {dt}: {type(e).__name__}: {e}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm-workers", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="small grid (smoke test)")
    ap.add_argument("--special-only", action="store_true", help="only the special cases and the recompile check")
    ap.add_argument("--only", nargs="+", default=None, metavar="SUBSTR",
                    help="with --special-only: run only the special cases whose name contains one of these")
    ap.add_argument("--lists", default=None, choices=["coarse", "half", "fine", "auto"],
                    help="the kernels' list granularity (kernel option lists)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "bsfa_bench", "validate"),
                    help="results folder (default $OUT or <tmp>/bsfa_bench/validate)")
    args = ap.parse_args()
    _set_lists(args.lists)
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}  torch {torch.__version__}  triton {__import__('triton').__version__}", flush=True)
    rows = []

    def record(name, N, D, dtype, extra="", **kw):
        if args.only and not any(o in name for o in args.only):
            return
        r = check_one(kw.pop("mask"), **kw, D=D, dtype=dtype)
        r.update(pattern=name, N=N, D=D, dtype=str(dtype).replace("torch.", ""), extra=extra)
        rows.append(r)
        flag = "PASS" if r["ok"] else "FAIL"
        print(f"{flag} {name:28s} N={N:6d} D={D:3d} {r['dtype']:8s} {extra:14s} dens={r['density']:.3f} "
              f"ours O/dQ/dK/dV[/dBias]=" + "/".join(f"{x:.1e}" for x in r["ours"]) +
              "  eager=" + "/".join(f"{x:.1e}" for x in r["eager"]) + f"  first={r['first_call_s']:.1f}s", flush=True)

    sizes = [(1000, 2), (4096, 2)] if args.quick else [(1000, 4), (4096, 4), (16384, 2)]
    dims = [128] if args.quick else [64, 128]
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16]
    if args.special_only:
        sizes = []
    if args.warm_workers and sizes:
        import multiprocessing as mp

        t0 = time.perf_counter()
        jobs = [(name, D, str(dt).replace("torch.", "")) for name, _ in patterns(1000) for D in dims for dt in dtypes]
        with mp.get_context("spawn").Pool(args.warm_workers, initializer=_set_lists, initargs=(args.lists,)) as pool:
            for msg in pool.imap_unordered(_warm, jobs):
                if msg != "ok":
                    print("warm:", msg, flush=True)
        print(f"parallel warm-up compile of {len(jobs)} kernel sets: {time.perf_counter() - t0:.0f} s", flush=True)
    for N, H in sizes:
        for name, m in patterns(N):
            for D in dims:
                for dt in dtypes:
                    if (dt == torch.float16 and N > 1000) or (D == 64 and N > 4096):
                        continue
                    record(name, N, D, dt, mask=m, B=1, H=H, Hkv=H, Lq=N, Lk=N)
    # special cases
    N = 2048
    record("longformer GQA 8/2", N, 128, torch.bfloat16, "gqa", mask=bsfa.load_pattern("longformer"), B=2, H=8, Hkv=2, Lq=N, Lk=N)
    record("causal MQA", N, 64, torch.float16, "mqa", mask=bsfa.causal(), B=1, H=4, Hkv=1, Lq=N, Lk=N)
    record("causal Lq<Lk", 777, 128, torch.bfloat16, "Lq=777,Lk=3001", mask=bsfa.causal(), B=1, H=2, Hkv=2, Lq=777, Lk=3001)
    record("sliding decode", 1, 128, torch.bfloat16, "Lq=1,Lk=4099", mask=bsfa.sliding_window(1024), B=2, H=4, Hkv=2, Lq=1, Lk=4099)
    ids = torch.stack([doc_ids(N, 1), doc_ids(N, 2, 200, 900)])
    record("document per batch", N, 128, torch.bfloat16, "B=2 ids", mask=bsfa.causal() & bsfa.document(ids), B=2, H=2, Hkv=2, Lq=N, Lk=N)
    record("causal dropout", N, 64, torch.bfloat16, "p=0.1", mask=bsfa.causal(), B=1, H=2, Hkv=2, Lq=N, Lk=N, dropout_p=0.1)
    record("fp32 longformer", N, 64, torch.float32, "fp32", mask=bsfa.load_pattern("longformer"), B=1, H=2, Hkv=2, Lq=N, Lk=N)
    for D in (16, 32, 96, 256):
        record("causal", N, D, torch.bfloat16, f"D={D}", mask=bsfa.causal(), B=1, H=2, Hkv=2, Lq=N, Lk=N)
    st = bsfa.parse("causal & (sliding_window(128) | strided(128))")  # rewritten: band + residue classes
    record("strided rewrite, class views", 8192, 128, torch.bfloat16, "B=2 s=128", mask=st, B=2, H=2, Hkv=2, Lq=8192, Lk=8192)
    record("strided rewrite, GQA copies", 8192, 64, torch.bfloat16, "H=4 Hkv=2", mask=st, B=1, H=4, Hkv=2, Lq=8192,
           Lk=8192, opts={"residue_gqa": False})  # GQA through permuted copies
    record("strided rewrite, custom op", 8192, 128, torch.bfloat16, "attention_op", mask=st, B=1, H=2, Hkv=2,
           Lq=8192, Lk=8192, op=True)
    record("strided rewrite, GQA class-major", 8192, 128, torch.bfloat16, "B=2 H=4 Hkv=2", mask=st, B=2, H=4, Hkv=2,
           Lq=8192, Lk=8192)
    record("strided rewrite, MQA class-major", 8192, 64, torch.bfloat16, "H=3 Hkv=1", mask=st, B=1, H=3, Hkv=1,
           Lq=8192, Lk=8192)
    # strided masks' masked lists as arithmetic progressions (the "step" LUT mode, used beyond
    # PART_LIST_LIMIT entries, e.g. 256K tokens; forced here): dropout keeps the unrewritten layout
    import blocksparse_fa.compiler.layout as layout_mod

    limit = layout_mod.PART_LIST_LIMIT
    layout_mod.PART_LIST_LIMIT = 0
    bsfa.compiler.clear_cache()
    record("strided step tables dropout", 8192, 128, torch.bfloat16, "p=0.1 GQA", mask=st, B=1, H=4, Hkv=2,
           Lq=8192, Lk=8192, dropout_p=0.1)
    record("strided step tables fp16", 4096, 64, torch.float16, "no rewrite", mask=bsfa.parse(
        "causal & (sliding_window(256) | strided(256))"), B=1, H=2, Hkv=2, Lq=4096, Lk=4096, dropout_p=0.05)
    assert bsfa.compile_mask(st, 8192, 8192, 128, device="cuda").kernel_tables()[0].part_step == 1
    layout_mod.PART_LIST_LIMIT = limit
    bsfa.compiler.clear_cache()
    dm = torch.rand(1, 2, 1500, 1500) > 0.6
    record("dense_mask per head", 1500, 64, torch.bfloat16, "B1H2", mask=bsfa.dense_mask(dm), B=1, H=2, Hkv=2, Lq=1500, Lk=1500)

    # the mask algebra's newer primitives (ranges, position sets, per-batch/per-head values, NATTEN,
    # STA, periodic windows, chunk bands, documents with shuffled labels; benchmarks/flex_equivalents.py)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from flex_equivalents import cases as new_cases

    for name, m, _, (Bc, _Hc) in new_cases(4096, B=2, H=4):
        record(name, 4096, 128, torch.bfloat16, f"B={Bc} H=4", mask=m, B=Bc, H=4, Hkv=2, Lq=4096, Lk=4096)
    record("chunk_band cross-attention", 1000, 64, torch.bfloat16, "Lq=1000,Lk=3001",
           mask=bsfa.chunk_band(7, 3, lo=-1, hi=2), B=1, H=2, Hkv=2, Lq=1000, Lk=3001)
    record("mask_mod & sliding", 3000, 128, torch.bfloat16, "mask_mod",
           mask=bsfa.mask_mod(lambda b, h, q, kv: ((q * 7 + kv * 3) % 5) != 0) & bsfa.sliding_window(700),
           B=1, H=2, Hkv=2, Lq=3000, Lk=3000)
    lens = torch.tensor([4099, 1500, 37])  # batched decode over a padded cache, one position per sequence
    record("shift: decode per sequence", 1, 128, torch.bfloat16, "Lq=1,Lk=4099 B=3",
           mask=bsfa.shift(bsfa.causal() & bsfa.sliding_window(1024), bsfa.per_batch(lens - 4099))
           & bsfa.key_range(0, bsfa.per_batch(lens)), B=3, H=4, Hkv=2, Lq=1, Lk=4099)
    bmh = torch.rand(1, 4, 24, 24) < 0.3
    record("block_mask per head", 3000, 64, torch.bfloat16, "(1,4,Tr,Tc)", mask=bsfa.block_mask(bmh) | bsfa.causal(),
           B=1, H=4, Hkv=4, Lq=3000, Lk=3000)

    # score modifiers (ALiBi, soft-cap): fused in the forward and the deterministic backward
    alibi8 = bsfa.alibi(bsfa.alibi_slopes(8))
    record("alibi causal GQA 8/2", N, 128, torch.bfloat16, "alibi", mask=bsfa.causal(), B=2, H=8, Hkv=2, Lq=N, Lk=N,
           score_mod=alibi8)
    record("softcap longformer", N, 64, torch.float16, "softcap(20)", mask=bsfa.load_pattern("longformer"), B=1, H=4,
           Hkv=4, Lq=N, Lk=N, score_mod=bsfa.softcap(20.0))
    record("alibi+softcap Lq<Lk", 777, 128, torch.bfloat16, "Lq=777,Lk=3001", mask=bsfa.causal() & bsfa.window(500),
           B=1, H=8, Hkv=2, Lq=777, Lk=3001, score_mod=alibi8 + bsfa.softcap(30.0))
    record("alibi+softcap dense", 1999, 128, torch.bfloat16, "full, odd L", mask=bsfa.full(), B=1, H=8, Hkv=8,
           Lq=1999, Lk=1999, score_mod=alibi8 + bsfa.softcap(5.0))
    record("softcap fp32 bigbird", N, 64, torch.float32, "fp32", mask=bsfa.load_pattern("bigbird"), B=1, H=2, Hkv=2,
           Lq=N, Lk=N, score_mod=bsfa.softcap(3.0))
    # learned biases (dBias checked too): per head and key, relative-position (H, Lq, Lk), padding-like
    # (B, 1, 1, Lk) with -inf keys, full (B, H, Lq, Lk); with ALiBi and the soft-cap
    record("bias (1,H,1,Lk)+alibi+softcap causal GQA", N, 128, torch.bfloat16, "dBias", mask=bsfa.causal(), B=2,
           H=8, Hkv=2, Lq=N, Lk=N, score_mod=alibi8 + bsfa.softcap(30.0), bias_shape=(1, 8, 1, N))
    record("bias (H,L,L) longformer", N, 64, torch.float16, "rel-pos dBias", mask=bsfa.load_pattern("longformer"), B=1,
           H=4, Hkv=4, Lq=N, Lk=N, bias_shape=(4, N, N))
    record("bias (B,1,1,Lk) -inf pad Lq<Lk", 777, 128, torch.bfloat16, "Lq=777,Lk=3001", mask=bsfa.causal()
           & bsfa.window(500), B=2, H=8, Hkv=2, Lq=777, Lk=3001, bias_shape=(2, 1, 1, 3001), bias_pad=300)
    record("bias (B,H,L,L)+softcap dense", 1999, 128, torch.bfloat16, "full, odd L", mask=bsfa.full(), B=2, H=4,
           Hkv=4, Lq=1999, Lk=1999, score_mod=bsfa.softcap(5.0), bias_shape=(2, 4, 1999, 1999))
    record("bias (H,Lq,1)+softcap fp32 bigbird", N, 64, torch.float32, "per-row dBias",
           mask=bsfa.load_pattern("bigbird"), B=1, H=2, Hkv=2, Lq=N, Lk=N, score_mod=bsfa.softcap(1.0),
           bias_shape=(2, N, 1))
    record("bias (1,H,1,Lk) custom op", N, 128, torch.bfloat16, "attention_op", mask=bsfa.load_pattern("bigbird"), B=1,
           H=4, Hkv=2, Lq=N, Lk=N, bias_shape=(1, 4, 1, N), op=True)
    # learned ALiBi slopes (dSlopes from the dQ programs' per-row sums with each row's exact delta):
    # top-left rows whose keys lie up to Lk away, bfloat16
    record("learned slopes top-left dense", 130, 32, torch.bfloat16, "Lq=7,Lk=130", mask=bsfa.full(), B=1, H=4, Hkv=2,
           Lq=7, Lk=130, learn_slopes=True, align="top_left")
    record("learned slopes top-left GQA", 4099, 128, torch.bfloat16, "Lq=1000,Lk=4099", mask=bsfa.full(), B=2, H=8,
           Hkv=2, Lq=1000, Lk=4099, learn_slopes=True, align="top_left")
    record("learned slopes+softcap longformer", N, 64, torch.bfloat16, "dSlopes", mask=bsfa.load_pattern("longformer"),
           B=1, H=4, Hkv=4, Lq=N, Lk=N, learn_slopes=True, score_mod=bsfa.softcap(20.0))
    record("learned slopes custom op causal", N, 128, torch.bfloat16, "attention_op", mask=bsfa.causal(), B=1, H=4,
           Hkv=2, Lq=N, Lk=N, learn_slopes=True, op=True)
    # v with its own head dim (zero-padded to one head dim at the entry points)
    record("Dv<D causal GQA", N, 128, torch.bfloat16, "Dv=64", mask=bsfa.causal(), B=2, H=8, Hkv=2, Lq=N, Lk=N, Dv=64)
    record("Dv>D longformer Lq<Lk", 777, 64, torch.bfloat16, "Dv=128", mask=bsfa.load_pattern("longformer"), B=1,
           H=4, Hkv=4, Lq=777, Lk=3001, Dv=128)
    # new slope, cap and bias values reuse the compiled kernels (only which modifiers are present is a constexpr)
    qs = torch.randn(1, 8, N, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bs = torch.randn(1, 8, 1, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bsfa.attention(qs, qs, qs, bsfa.causal(), score_mod=alibi8 + bsfa.softcap(30.0)).sum().backward()
    bsfa.attention(qs, qs, qs, bsfa.causal(), score_mod=bsfa.bias(bs) + bsfa.softcap(30.0)).sum().backward()
    torch.cuda.synchronize()
    sm_before = [n_compiled(f) for f in (_attn_fwd, _attn_bwd)]
    for scale in (0.5, 2.0):
        mod = bsfa.alibi(bsfa.alibi_slopes(8) * scale) + bsfa.softcap(30.0 * scale)
        bsfa.attention(qs, qs, qs, bsfa.causal(), score_mod=mod).sum().backward()
        bnew = (torch.randn_like(bs) * scale).requires_grad_()
        bsfa.attention(qs, qs, qs, bsfa.causal(), score_mod=bsfa.bias(bnew) + bsfa.softcap(30.0 * scale)).sum().backward()
    torch.cuda.synchronize()
    sm_after = [n_compiled(f) for f in (_attn_fwd, _attn_bwd)]
    sm_recompiles = sum(sm_after) - sum(sm_before)
    print(f"score_mod value check: compiled variants before {sm_before} after {sm_after} -> {sm_recompiles} new "
          f"(expected 0)", flush=True)

    # recompilation check: window size and length changes reuse compiled kernels
    def run_fwd_bwd(mask, n):
        q = torch.randn(1, 4, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        o = bsfa.attention(q, q, q, mask=mask, kernel_options=OPTIONS)
        o.sum().backward()
        torch.cuda.synchronize()

    def tile_configs(w, n):
        from blocksparse_fa.kernels import config as kc
        from blocksparse_fa.ops.options import as_options
        from blocksparse_fa.ops.select import layout_class
        from blocksparse_fa.ops.triton_backend import _even, _list_block

        opts = as_options(OPTIONS)
        lay = bsfa.compile_mask(bsfa.causal() & bsfa.window(w), n, n, 128)
        lc, even = layout_class(lay), _even(lay, opts)  # a length that is not a multiple of 128: its own variant
        fc = kc.fwd_config(128, torch.bfloat16, 128, 128, lc.band, lc.partial_rows)
        kv, dq = kc.bwd_configs(128, torch.bfloat16, 128, 128, lc.band, lc.partial_heavy)
        # finer lists (--lists): a layout whose list blocks change compiles its own variant too
        return ((fc, even, _list_block(lay, "row", fc.block_n, opts)),
                ((kv, dq), even, _list_block(lay, "col", kv.block_m, opts, kv.flat),
                 _list_block(lay, "row", dq.block_n, opts, dq.flat)))

    first, later = (256, 4096), ((512, 4096), (1000, 8192), (77, 5000), (4096, 12288))
    run_fwd_bwd(bsfa.causal() & bsfa.window(first[0]), first[1])
    before = [n_compiled(f) for f in (_attn_fwd, _attn_bwd)]
    t0 = time.perf_counter()
    for w, n in later:
        run_fwd_bwd(bsfa.causal() & bsfa.window(w), n)
    t_reuse = time.perf_counter() - t0
    after = [n_compiled(f) for f in (_attn_fwd, _attn_bwd)]
    recompiles = sum(after) - sum(before)
    seen = [tile_configs(*first)]
    for wn in later:
        seen.append(tile_configs(*wn))
    allowed = sum(len({c[i] for c in seen}) - 1 for i in (0, 1))  # new tile classes, fwd and bwd
    print(f"recompile check: compiled variants before {before} after {after} -> {recompiles} new, "
          f"{allowed} allowed by new tile classes (4 calls with new window/length took {t_reuse:.2f}s)", flush=True)

    n_fail = sum(not r["ok"] for r in rows)
    summary = dict(device=dev, torch=torch.__version__, triton=__import__("triton").__version__, rows=rows,
                   recompiles_on_window_and_length_change=recompiles, recompiles_allowed=allowed,
                   recompiles_on_score_mod_values=sm_recompiles, n_fail=n_fail)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "validate_gpu.json"), "w") as f:
        json.dump(summary, f, indent=1)
    md = ["| result | pattern | N | D | dtype | case | density | ours O/dQ/dK/dV[/dBias] | eager O/dQ/dK/dV[/dBias] | first call s |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {'PASS' if r['ok'] else 'FAIL'} | {r['pattern']} | {r['N']} | {r['D']} | {r['dtype']} | {r['extra']} | "
                  f"{r['density']:.3f} | {'/'.join(f'{x:.1e}' for x in r['ours'])} | {'/'.join(f'{x:.1e}' for x in r['eager'])} | "
                  f"{r['first_call_s']:.1f} |")
    with open(os.path.join(args.out, "validate_gpu.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"{len(rows) - n_fail}/{len(rows)} passed; recompiles on window/length change: {recompiles} "
          f"(allowed {allowed})")
    return 1 if n_fail or recompiles > allowed or sm_recompiles else 0


if __name__ == "__main__":
    sys.exit(main())
