"""The Gluon forward with two or three consumer warp groups (``GluonConfig.groups``) on the GPU.

Per case (dense, causal, ``sliding_window(1024)`` or causal documents of 1–4K tokens, as
``bench.py``'s; head dim, kv heads; 16K tokens, H 16, bf16), every variant of
``--variants`` (``name=JSON`` of :class:`~blocksparse_fa.GluonConfig` fields) runs through
``bsfa.attention`` with that ``gluon_fwd`` option: first checked at 2K against float64 (output,
relative error), then the forward timed (``do_bench`` median, every variant in turn, ``--passes``
passes), beside cuDNN's SDPA and, where installed, FlashAttention-4 on the same inputs.

    PYTHONPATH=. python benchmarks/experiments/fwd_groups_gpu.py [--dims 64 128] [--kinds dense causal] \\
        [--variants g2='{}' g3='{"groups": 3}'] [--passes 2]

Results: ``$OUT/fwd_groups.json`` and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import blocksparse_fa as bsfa  # noqa: E402
from blocksparse_fa.ops import select  # noqa: E402


def _inputs(n, H, hkv, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, h, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (H, hkv, hkv)]


def _mask(kind: str, n: int):
    """The case's mask, compiled once for the GPU where it holds document ids."""
    if kind == "dense":
        return bsfa.full()
    if kind == "causal":
        return bsfa.causal()
    if kind == "window":
        return bsfa.compile_mask(bsfa.sliding_window(1024), n, n, device="cuda")
    g = torch.Generator().manual_seed(0)
    lens, left = [], n
    while left > 0:
        lens.append(min(left, int(torch.randint(1024, 4097, (1,), generator=g))))
        left -= lens[-1]
    ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    return bsfa.compile_mask(bsfa.causal() & bsfa.document(ids), n, n, device="cuda")


def _peers(kind, hkv, H):
    """``{name: fn(q, k, v)}`` of the peers that run here (B, H, L, D inputs)."""
    if kind not in ("dense", "causal"):
        return {}
    causal = kind == "causal"
    out = {"cudnn": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=hkv != H)}
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v):
            o = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
            return o[0] if isinstance(o, tuple) else o
        out["fa4"] = fa4
    except Exception as e:  # noqa: BLE001 - a peer that is not installed is reported, not fatal
        print(f"fa4 not available: {type(e).__name__}: {e}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--kinds", nargs="+", default=["dense", "causal"],
                    choices=["dense", "causal", "window", "documents"])
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[16])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--variants", nargs="+", default=["g2={}", 'g3={"groups": 3}'])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    variants = {}
    for item in a.variants:
        name, _, text = item.partition("=")
        variants[name] = json.loads(text or "{}")
    rows = []
    for D in a.dims:
        for kind in a.kinds:
            for hkv in a.kv_heads:
                # correctness at 2K against float64
                small = _mask(kind, 2048)
                q, k, v = _inputs(2048, 4, max(1, 4 * hkv // a.heads), D, seed=1)
                ref = bsfa.reference_attention(q.double(), k.double(), v.double(), small)
                check = {}
                for name, cfg in variants.items():
                    with select.record() as ran:
                        o = bsfa.attention(q, k, v, mask=small, kernel_options={"gluon_fwd": cfg})
                    err = ((o.double() - ref).norm() / ref.norm()).item()
                    check[name] = dict(err=err, route=[str(c) for p, c in ran if p == "forward"])
                mask = _mask(kind, a.n)
                q, k, v = _inputs(a.n, a.heads, hkv, D)
                fns = {name: (lambda cfg: lambda: bsfa.attention(q, k, v, mask=mask,
                                                                   kernel_options={"gluon_fwd": cfg}))(cfg)
                       for name, cfg in variants.items()}
                fns.update({p: (lambda f: lambda: f(q, k, v))(f) for p, f in _peers(kind, hkv, a.heads).items()})
                times = {name: [] for name in fns}
                for _ in range(a.passes):
                    for name, fn in fns.items():
                        try:
                            times[name].append(do_bench(fn, warmup=25, rep=100))
                        except Exception as e:  # noqa: BLE001 - a peer failing is reported
                            times[name].append(None)
                            print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
                kept = {"dense": 1.0, "causal": 0.5}.get(kind)  # TFLOP/s for these two only
                flops = 4 * a.n * a.n * D * a.heads * (kept or 0.0)
                row = dict(kind=kind, D=D, H=a.heads, Hkv=hkv, N=a.n, check=check, ms=times)
                rows.append(row)
                cells = []
                for name, ts in times.items():
                    ok = [t for t in ts if t is not None]
                    if ok:
                        best = sorted(ok)[len(ok) // 2]
                        cells.append(f"{name} {best:.3f} ms" + (f" {flops / best / 1e9:.0f} TF" if flops else ""))
                print(f"{kind} d{D} {a.heads}/{hkv}: " + " | ".join(cells)
                      + " | err " + " ".join(f"{n}:{c['err']:.1e}{c['route']}" for n, c in check.items()),
                      flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fwd_groups.json"), "w") as f:
        json.dump(dict(env=dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                triton=__import__("triton").__version__), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
