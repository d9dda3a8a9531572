"""Replayed calls (``ops/call_memo.py``) on the GPU: correctness, then host and wall time against the
host path (kernel option ``replay=False``), interleaved in one process.

Per mask (``bench.py`` names; 16K, H 16, d 128, bf16, or ``--n``/``--heads``):

1. Correctness. Three default fwd+bwd calls on fresh inputs each; the layout's memo must then hold
   a replay for both phases (``replayed``). The host path on the third call's inputs must give the
   same output and gradients (``vs_host_path``: largest relative difference; 0 where the kernels
   are deterministic, the atomic dQ adds in another order otherwise). At 2K, H 4, a replayed
   call against float64 (``vs_float64``: ‖a − b‖ / ‖b‖ of O, dQ, dK, dV).
2. Time, ``--passes`` times host path then replay: the host time to launch one eager fwd+bwd while
   the GPU sleeps (best of five runs of 20 calls) and the ``do_bench`` median wall time.

    PYTHONPATH=. python benchmarks/experiments/replay_gpu.py [--masks ...] [--out DIR]

Results: ``$OUT/replay_gpu.json`` and a line per mask and pass.
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import blocksparse_fa as bsfa  # noqa: E402
from bench import make_case  # noqa: E402
from blocksparse_fa.ops import call_memo  # noqa: E402
from host_path import host_runs_us  # noqa: E402

OFF = dict(replay=False)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


def _inputs(B, H, n, D, seed, Hkv=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(B, Hkv or H, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)], do


def _step(layout, qkv, do, opts=None):
    out = bsfa.attention(*qkv, mask=layout, kernel_options=opts)
    return (out, *torch.autograd.grad(out, qkv, do))


def _replays(layout) -> list:
    return sorted(k[0] for k, e in layout.cache.get("call_memo", {}).items() if isinstance(e, call_memo.Replay))


def _refused(layout) -> dict:
    return {k[0]: e.reason for k, e in layout.cache.get("call_memo", {}).items() if isinstance(e, call_memo.Refused)}


def check(name, n, H, D, Hkv):
    mask = make_case(name, n, "cuda")[0]
    layout = bsfa.compile_mask(mask, n, n, 128, device="cuda")
    for seed in range(3):
        qkv, do = _inputs(1, H, n, D, seed, Hkv)
        got = _step(layout, qkv, do)
    replayed = _replays(layout)
    want = _step(layout, qkv, do, OFF)
    torch.cuda.synchronize()
    same = [_rel(a, b) for a, b in zip(got, want)]
    # float64 at 2K
    mask2 = make_case(name, 2048, "cuda")[0]
    small = bsfa.compile_mask(mask2, 2048, 2048, 128, device="cuda")
    for seed in range(3):
        qkv2, do2 = _inputs(1, 4, 2048, D, 10 + seed, 4 * (Hkv or H) // H)
        got2 = _step(small, qkv2, do2)
    qd = [t.detach().double().requires_grad_() for t in qkv2]
    ref = bsfa.reference_attention(*qd, mask2)
    ref_all = (ref, *torch.autograd.grad(ref, qd, do2.double()))
    f64 = [_rel(a, b) for a, b in zip(got2, ref_all)]
    return dict(replayed=replayed, replayed_2k=_replays(small), refused=_refused(layout), vs_host_path=same,
                vs_float64=f64)


def timing(name, n, H, D, passes, Hkv):
    from triton.testing import do_bench

    mask = make_case(name, n, "cuda")[0]
    qkv, do = _inputs(1, H, n, D, 0, Hkv)
    rows = []
    for p in range(passes):
        for label, opts in (("host_path", OFF), ("replay", None)):
            def step():
                return torch.autograd.grad(bsfa.attention(*qkv, mask=mask, kernel_options=opts), qkv, do)

            hosts = host_runs_us(step)
            fwd = do_bench(lambda: bsfa.attention(*qkv, mask=mask, kernel_options=opts), warmup=25, rep=100,
                           return_mode="median")
            wall = do_bench(step, warmup=25, rep=200, return_mode="median")
            rows.append(dict(pass_=p, path=label, host_us=min(hosts), fwd_ms=fwd, fwd_bwd_ms=wall))
            print(f"{name:20s} pass {p} {label:9s} host {min(hosts):6.0f} us  fwd {fwd:.3f} ms  fwd+bwd {wall:.3f} ms",
                  flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--masks", nargs="+", default=["bigbird", "longformer", "causal_longformer", "causal", "dense",
                                                  "sliding_window_1024"])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, n=a.n, heads=a.heads,
               kv_heads=a.kv_heads or a.heads, dim=a.dim, masks={})
    for name in a.masks:
        c = check(name, a.n, a.heads, a.dim, a.kv_heads)
        print(name, json.dumps(c), flush=True)
        res["masks"][name] = dict(check=c, timing=timing(name, a.n, a.heads, a.dim, a.passes, a.kv_heads))
    os.makedirs(a.out, exist_ok=True)
    tag = f"_kv{a.kv_heads}" if a.kv_heads else ""
    with open(os.path.join(a.out, f"replay_gpu{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
