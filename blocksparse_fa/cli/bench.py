"""``bsfa bench``: time one pattern's forward and forward+backward (and FlexAttention's, on CUDA)."""

from __future__ import annotations

import statistics
import time

from ..compiler.compile import compile_mask
from .common import add_length_args, mask_from_arg

_DTYPES = ("bf16", "fp16", "fp32")


def register(sub) -> None:
    p = sub.add_parser(
        "bench", help="time a pattern's forward and fwd+bwd (optionally against FlexAttention)",
        description="Times attention with a pattern on random inputs: the Triton kernels on CUDA (median of "
                    "triton.testing.do_bench), the exact PyTorch backend on CPU (median wall time). Prints block "
                    "density, effective TFLOP/s (4*B*H*Lq*Lk*d*element-density / time, x3.5 for fwd+bwd) and, "
                    "with --flex, FlexAttention on the same inputs with the ratio and the output difference. "
                    "benchmarks/bench.py runs the full suite.")
    p.add_argument("pattern", help="pattern name (see 'bsfa patterns') or DSL text, e.g. \"causal & window(256)\"")
    add_length_args(p)
    p.add_argument("--heads", type=int, default=16, help="query heads H (default 16)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads for GQA/MQA (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--dtype", default=None, choices=_DTYPES, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--flex", action="store_true", help="also time torch.compile(flex_attention) (CUDA only)")
    p.add_argument("--reps", type=int, default=5, help="CPU: timed repetitions (default 5)")
    p.set_defaults(func=run)


def _cpu_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def run(args) -> int:
    import torch

    import blocksparse_fa as bsfa

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if args.flex and dev.type != "cuda":
        raise ValueError("--flex needs a CUDA device (FlexAttention is compiled for the GPU)")
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    dtype_name = args.dtype or ("bf16" if dev.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    mask = mask_from_arg(args.pattern)
    lq, lk = args.q_len, args.kv_len or args.q_len
    hkv = args.kv_heads or args.heads
    lay = compile_mask(mask, lq, lk, args.block, device=dev)
    torch.manual_seed(0)
    q = torch.randn(args.batch, args.heads, lq, args.head_dim, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(args.batch, hkv, lk, args.head_dim, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(args.batch, hkv, lk, args.head_dim, device=dev, dtype=dtype, requires_grad=True)
    do = torch.randn_like(q)
    dens = lay.element_density(dev)
    flops = 4.0 * args.batch * args.heads * lq * lk * args.head_dim * dens

    if dev.type == "cuda":
        import triton

        def timer(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    else:
        def timer(fn):
            return _cpu_ms(fn, args.reps)

    impls = {"ours": lambda: bsfa.attention(q, k, v, mask=lay)}
    if args.flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        dense = lay.to_dense().to(dev)
        if dense.dim() == 2:
            mm = lambda b, h, qi, ki: dense[qi, ki]  # noqa: E731
        else:
            mm = lambda b, h, qi, ki: dense[b % dense.shape[0], h % dense.shape[1], qi, ki]  # noqa: E731
        bm = create_block_mask(mm, None, None, lq, lk, device=str(dev), _compile=True)
        flex = torch.compile(flex_attention, dynamic=False)
        gqa = {"enable_gqa": True} if hkv != args.heads else {}
        impls["flex"] = lambda: flex(q, k, v, block_mask=bm, **gqa)

    print(f"{lay.summary()}\n  B={args.batch} H={args.heads} Hkv={hkv} d={args.head_dim} {dtype_name} on {dev}, "
          f"element density {dens:.4f}")
    res = {}
    for name, fn in impls.items():
        with torch.no_grad():
            fwd_ms = timer(fn)
        line = f"  {name:5s} fwd {fwd_ms:9.3f} ms ({flops / fwd_ms / 1e9:.3g} TFLOP/s)"
        fb_ms = None
        if not args.no_backward:
            def fb(fn=fn):
                torch.autograd.grad(fn(), (q, k, v), do)

            fb_ms = timer(fb)
            line += f"   fwd+bwd {fb_ms:9.3f} ms ({3.5 * flops / fb_ms / 1e9:.3g} TFLOP/s)"
        res[name] = (fwd_ms, fb_ms)
        print(line, flush=True)
    if "flex" in res:
        (of, ob), (ff, fb_) = res["ours"], res["flex"]
        with torch.no_grad():
            a, b = impls["ours"]().float(), impls["flex"]().float()
        err = ((a - b).norm() / b.norm()).item()
        ratio = f"fwd {ff / of:.2f}x" + (f", fwd+bwd {fb_ / ob:.2f}x" if ob else "")
        print(f"  speedup vs Flex: {ratio}; |ours - flex| / |flex| = {err:.1e}")
    return 0
