"""``bsfa bench``: time one pattern's forward and forward+backward beside SDPA (and FlexAttention)."""

from __future__ import annotations

import statistics
import time

from ..compiler.compile import compile_mask
from .common import add_length_args, add_pattern_args, check_lengths, mask_from_arg, resolve_device

_DTYPES = ("bf16", "fp16", "fp32")
SDPA_MAX_MASK = 1 << 28
"""Largest dense boolean mask (elements) built for the SDPA baseline (256 MiB)."""


def register(sub) -> None:
    p = sub.add_parser(
        "bench", help="time a pattern's forward and fwd+bwd beside SDPA (and FlexAttention with --flex)",
        description="Times attention with a pattern on random inputs: the Triton kernels on CUDA (median of "
                    "triton.testing.do_bench), the exact PyTorch backend on CPU (median wall time). Beside ours, on "
                    "the same inputs: PyTorch's scaled_dot_product_attention with the pattern as a dense boolean mask "
                    "(skipped above 2^28 mask elements) and, with --flex, torch.compile(flex_attention) (on CPU "
                    "forward only: FlexAttention has no CPU backward). Prints block density, effective TFLOP/s "
                    "(4*B*H*Lq*Lk*d*element-density / time, x3.5 for fwd+bwd), each baseline's time over ours and "
                    "the output difference. benchmarks/bench.py runs the full GPU suite.")
    add_pattern_args(p)
    add_length_args(p)
    p.add_argument("--heads", type=int, default=16, help="query heads H (default 16)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads for GQA/MQA (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--dtype", default=None, choices=_DTYPES, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--no-sdpa", action="store_true", help="skip the SDPA baseline")
    p.add_argument("--flex", action="store_true",
                   help="also time torch.compile(flex_attention) (compiling takes seconds to a minute; on CPU "
                        "forward only)")
    p.add_argument("--reps", type=int, default=5, help="CPU: timed repetitions (default 5)")
    p.set_defaults(func=run)


def _cpu_ms(fn, reps: int, bar) -> float:
    fn()
    bar.update(1)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
        bar.update(1)
    return statistics.median(ts)


def _rel_diff(a, b, rows) -> float:
    """``‖a − b‖ / ‖b‖`` over the query rows that keep at least one key (SDPA leaves the others NaN)."""
    a, b = a.float(), b.float()
    if rows is not None:
        a, b = a[..., rows, :], b[..., rows, :]
    return ((a - b).norm() / b.norm()).item()


def run(args) -> int:
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    import blocksparse_fa as bsfa

    dev = resolve_device(args.device)
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    lq, lk = check_lengths(args)
    hkv = args.kv_heads or args.heads
    if min(args.heads, hkv, args.head_dim, args.batch) < 1 or args.heads % hkv:
        raise ValueError(f"--heads ({args.heads}) must be a positive multiple of --kv-heads ({hkv}); "
                         f"--head-dim and --batch positive")
    dtype_name = args.dtype or ("bf16" if dev.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    mask = mask_from_arg(args.pattern, args.documents, lk)
    lay = compile_mask(mask, lq, lk, args.block, device=dev)
    torch.manual_seed(0)
    shape_q, shape_kv = (args.batch, args.heads, lq, args.head_dim), (args.batch, hkv, lk, args.head_dim)
    q = torch.randn(shape_q, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(shape_kv, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(shape_kv, device=dev, dtype=dtype, requires_grad=True)
    do = torch.randn_like(q)
    dens = lay.element_density(dev)
    flops = 4.0 * args.batch * args.heads * lq * lk * args.head_dim * dens
    gqa = {"enable_gqa": True} if hkv != args.heads else {}

    # name -> (forward callable, whether it has a backward, note)
    impls = {"ours": (lambda: bsfa.attention(q, k, v, mask=lay), True, "")}
    notes = []
    dense = None
    n_mask = lq * lk * (args.batch * args.heads if lay.batch_shape else 1)
    if not args.no_sdpa or args.flex:
        if n_mask <= SDPA_MAX_MASK:
            dense = lay.to_dense().to(dev)
        else:
            notes.append(f"sdpa/flex: skipped, the dense mask would have {n_mask:.2e} elements "
                         f"(limit {SDPA_MAX_MASK:.1e})")
    if dense is not None and not args.no_sdpa:
        impls["sdpa"] = (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, **gqa), True,
                         "dense boolean mask")
    if dense is not None and args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if dense.dim() == 2:
            mm = lambda b, h, qi, ki: dense[qi, ki]  # noqa: E731
        else:
            mm = lambda b, h, qi, ki: dense[b % dense.shape[0], h % dense.shape[1], qi, ki]  # noqa: E731
        bm = create_block_mask(mm, None, None, lq, lk, device=str(dev), _compile=dev.type == "cuda")
        flex = torch.compile(flex_attention, dynamic=False)
        if dev.type == "cuda":
            impls["flex"] = (lambda: flex(q, k, v, block_mask=bm, **gqa), True, "")
        else:  # torch raises NotImplementedError for a CPU backward: time the forward on detached inputs
            qd, kd, vd = (t.detach() for t in (q, k, v))
            impls["flex"] = (lambda: flex(qd, kd, vd, block_mask=bm, **gqa), False, "forward only: no CPU backward")

    backward = not args.no_backward
    per_impl = [(1 + (1 + backward * has_bwd) * (args.reps + 1) if dev.type == "cpu" else 2 + backward * has_bwd)
                for _, has_bwd, _ in impls.values()]
    print(f"{lay.summary()}\n  B={args.batch} H={args.heads} Hkv={hkv} d={args.head_dim} {dtype_name} on {dev}, "
          f"element density {dens:.4f}", flush=True)
    res, outs = {}, {}
    with tqdm(total=sum(per_impl), desc="bench", unit="call", leave=False, disable=None) as bar:
        if dev.type == "cuda":
            import triton

            def timer(fn):
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                bar.update(1)
                return ms
        else:
            def timer(fn):
                return _cpu_ms(fn, args.reps, bar)

        for name, (fn, has_bwd, note) in impls.items():
            bar.set_description(f"{name}: first call" + (" (compiling)" if name == "flex" else ""))
            with torch.no_grad():
                outs[name] = fn().detach()
            bar.update(1)
            bar.set_description(f"{name}: forward")
            with torch.no_grad():
                fwd_ms = timer(fn)
            line = f"  {name:5s} fwd {fwd_ms:9.3f} ms ({flops / fwd_ms / 1e9:.3g} TFLOP/s)"
            fb_ms = None
            if backward and has_bwd:
                bar.set_description(f"{name}: forward+backward")

                def fb(fn=fn):
                    torch.autograd.grad(fn(), (q, k, v), do)

                fb_ms = timer(fb)
                line += f"   fwd+bwd {fb_ms:9.3f} ms ({3.5 * flops / fb_ms / 1e9:.3g} TFLOP/s)"
            res[name] = (fwd_ms, fb_ms)
            tqdm.write(line + (f"   [{note}]" if note else ""))
    rows = None
    if dense is not None:
        rows = dense.reshape(-1, lq, lk).any(-1).all(0)  # rows that keep a key in every batch/head
    for name in res:
        if name == "ours":
            continue
        (of, ob), (bf, bb) = res["ours"], res[name]
        ratio = f"fwd {bf / of:.3g}x" + (f", fwd+bwd {bb / ob:.3g}x" if ob and bb else "")
        print(f"  speedup vs {name} ({name} time / ours): {ratio}; |ours - {name}| / |{name}| = "
              f"{_rel_diff(outs['ours'], outs[name], rows):.1e}")
    for note in notes:
        print(f"  {note}")
    return 0
