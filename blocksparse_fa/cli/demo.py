"""``bsfa demo``: compile BigBird, run attention forward+backward, compare with the dense reference."""

from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from ..compiler.compile import compile_mask
from ..mask.patterns import load_pattern
from ..ops.api import attention
from ..ops.reference import reference_attention
from .common import resolve_device


def register(sub) -> None:
    p = sub.add_parser("demo", help="BigBird attention forward+backward vs the dense reference (CPU or GPU)")
    p.add_argument("--len", dest="n", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.set_defaults(func=run)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def run(args) -> int:
    dev = resolve_device(args.device)
    n, h, d = args.n, args.heads, args.head_dim
    if min(n, h, d) < 1:
        raise ValueError(f"--len, --heads and --head-dim must be positive, got {n}, {h}, {d}")
    mask = load_pattern("bigbird")
    t0 = time.perf_counter()
    lay = compile_mask(mask, n, n, 128, device=dev, cache=False)
    t_compile = time.perf_counter() - t0
    print(f"pattern  : bigbird = {mask}")
    print(lay.ascii(width=32))
    print(f"compile  : {t_compile * 1e3:.1f} ms, block density {lay.density:.3f}, element density "
          f"{lay.element_density(device=dev):.3f}, LUT {lay.lut_bytes} bytes")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(1, h, n, d, device=dev, dtype=dtype, generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    backend = "triton" if dev.type == "cuda" else "torch"
    with tqdm(total=3, desc="demo", unit="step", leave=False, disable=None) as bar:
        for label in ("first call", "second call"):
            bar.set_description(f"{backend}: forward+backward, {label}")
            t0 = time.perf_counter()
            out = attention(q, k, v, mask=lay, backend=backend)
            grads = torch.autograd.grad(out, (q, k, v), do)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            bar.write(f"{backend:6s}   : forward+backward {label} {(time.perf_counter() - t0) * 1e3:.1f} ms "
                      f"(B=1, H={h}, N={n}, D={d}, {str(dtype).replace('torch.', '')}, {dev.type})")
            bar.update(1)
        bar.set_description("dense float64 reference")
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        t0 = time.perf_counter()
        ref = reference_attention(qd, kd, vd, lay)
        ref_grads = torch.autograd.grad(ref, (qd, kd, vd), do.double())
        bar.write(f"reference: dense float64 forward+backward {(time.perf_counter() - t0) * 1e3:.1f} ms")
        bar.update(1)
    errs = [_rel(out, ref)] + [_rel(a, b) for a, b in zip(grads, ref_grads)]
    print("rel. error vs float64: " + ", ".join(f"{name} {e:.2e}" for name, e in zip(("O", "dQ", "dK", "dV"), errs)))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    ok = all(math.isfinite(e) and e < tol for e in errs)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1
