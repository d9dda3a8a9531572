"""The mask algebra's newer primitives on a GPU: ours beside FlexAttention (Triton and FLASH) on the
same inputs.

For every case of ``benchmarks/flex_equivalents.py`` (ranges, globals anywhere, padded batches,
per-head windows, NATTEN 2-D, STA 3-D, periodic windows, block diffusion, shared prefix, unsorted
documents) it first checks that our mask and the Flex ``mask_mod`` keep the same pairs (at
``--check-len``), then runs ``harness.run_case``: ours eager and compiled, Flex-Triton and
Flex-FLASH (FA4 and cuDNN have no form of these masks and are reported so), every output and
gradient against a float64 reference, forward and forward+backward times (bf16).

    PYTHONPATH=. python benchmarks/new_primitives_gpu.py --out DIR [--len 16384] [--heads 8] [--deadline S]
    PYTHONPATH=. python benchmarks/new_primitives_gpu.py --dry-run --out DIR    # CPU, tiny

Results: ``new_primitives_gpu.json`` and ``new_primitives_gpu.md`` in ``--out``; with
``--update-docs`` also ``docs/data/new_primitives_gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import harness  # noqa: E402
import peers  # noqa: E402
from bench import DOCS, default_out, env_info  # noqa: E402
from flex_equivalents import cases  # noqa: E402


def same_pairs(mask, mod, n: int, B: int, H: int, device) -> bool:
    """Our mask and ``mod`` keep the same (b, h, q, kv) pairs at length ``n``."""
    dense = mask.to_dense(n, n).to(device)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q = torch.arange(n, device=device).view(1, 1, n, 1)
    kv = torch.arange(n, device=device).view(1, 1, 1, n)
    return bool(torch.equal(dense.expand(B, H, n, n), mod(b, h, q, kv).expand(B, H, n, n)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--len", type=int, default=None, help="sequence length (default 16384; dry run 256)")
    ap.add_argument("--heads", type=int, default=None, help="query heads (default 8; dry run 4)")
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default = --heads)")
    ap.add_argument("--dim", type=int, default=None, help="head dim (default 128; dry run 32)")
    ap.add_argument("--check-len", type=int, default=None, help="length of the same-pairs check (default 2048)")
    ap.add_argument("--only", nargs="+", default=None, metavar="SUBSTR", help="cases whose name contains one")
    ap.add_argument("--impls", nargs="+", default=list(harness.IMPLS), choices=harness.IMPLS)
    ap.add_argument("--deadline", type=float, default=0.0, help="seconds: later cases are skipped (0 = none)")
    ap.add_argument("--out", default=None, help="results folder (default $OUT or <tmp>/bsfa_bench/new_primitives)")
    ap.add_argument("--update-docs", action="store_true", help="also copy the JSON to docs/data/")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: exercises the code paths")
    args = ap.parse_args(argv)
    dry = args.dry_run
    dev = args.device or ("cpu" if dry else "cuda")
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run")
    n = args.len or (256 if dry else 16384)
    H = args.heads or (4 if dry else 8)
    Hkv = args.kv_heads or H
    D = args.dim or (32 if dry else 128)
    check_len = args.check_len or (n if dry else 2048)
    out = args.out or default_out("new_primitives")
    os.makedirs(out, exist_ok=True)
    opts = harness.Options(device=dev, impls=tuple(args.impls), compile_backend="aot_eager" if dev == "cpu" else
                           "inductor", warmup_ms=1 if dry else 25, rep_ms=1 if dry else 100)
    peers.strict_compile()
    small = {name: (m, mod, bh) for name, m, mod, bh in cases(check_len, H=H, device=dev)}
    data = {"env": env_info(dev), "options": dict(opts.__dict__, N=n, H=H, Hkv=Hkv, D=D, check_len=check_len),
            "tolerance": harness.TOLERANCE, "cases": []}
    t0 = time.time()
    opts.deadline = t0 + args.deadline if args.deadline else 0.0
    longest = 0.0
    path = os.path.join(out, "new_primitives_gpu.json")
    for name, mask, mod, (B, _) in cases(n, H=H, device=dev):
        if args.only and not any(s in name for s in args.only):
            continue
        if args.deadline and args.deadline - (time.time() - t0) < max(longest, 1.0):
            data["cases"].append({"mask": name, "B": B, "H": H, "Hkv": Hkv, "N": n, "D": D, "skipped": "deadline"})
            continue
        m_s, mod_s, (Bs, Hs) = small[name]
        ok = same_pairs(m_s, mod_s, check_len, Bs, Hs, dev)
        print(f"== {name}: same pairs as the Flex mask_mod at {check_len}: {ok}", flush=True)
        try:
            res = harness.run_case(harness.Case(name, mask, mod, B, H, Hkv, n, D), opts)
            longest = max(longest, res["wall_s"])
        except Exception as e:  # noqa: BLE001
            res = {"mask": name, "B": B, "H": H, "Hkv": Hkv, "N": n, "D": D, "error": harness._short(e)}
            print(res["error"], flush=True)
        res["same_pairs"] = ok
        data["cases"].append(res)
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=str)
        if dev == "cuda":
            torch.cuda.empty_cache()
    data["wall_s"] = time.time() - t0
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    env = data["env"]
    lines = [f"# Newer primitives: ours beside FlexAttention ({env['device']}, torch {env['torch']}, "
             f"triton {env['triton']}, {env['date']})", "", f"`{env['command']}`"]
    lines += harness.markdown_tables([c for c in data["cases"] if "error" not in c], opts.impls)
    lines += ["", "Same kept pairs as the Flex `mask_mod`: "
              + ", ".join(f"{c['mask']} {'yes' if c.get('same_pairs') else 'NO'}" for c in data["cases"]
                          if "same_pairs" in c)]
    lines += [f"- {c['mask']}: {c['error']}" for c in data["cases"] if "error" in c]
    with open(os.path.join(out, "new_primitives_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if args.update_docs:
        shutil.copy(path, os.path.join(DOCS, "data", "new_primitives_gpu.json"))
    print(f"wrote {path} ({data['wall_s']:.0f} s)")
    bad = [c for c in data["cases"] if c.get("same_pairs") is False or "error" in c
           or any(r.get("ok") is False for r in c.get("impls", {}).values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
