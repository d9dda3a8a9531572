"""Strided rewrite at 16K and 64K: the strided part on residue-class views (no copies, default) vs on
permuted copies (the previous path), vs FlexAttention, on the same inputs; forward and fwd+bwd,
outputs and gradients compared in the same run.

    PYTHONPATH=. python benchmarks/experiments/strided_check.py [--sizes 16384 65536] [--kv-heads-ratio 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.py

import bench  # noqa: E402


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--kv-heads-ratio", type=int, default=1, help="GQA: H / Hkv (class-major views)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from blocksparse_fa.ops import api
    from blocksparse_fa.ops.residue import set_residue_gqa

    g = args.kv_heads_ratio
    set_residue_gqa(True)
    real = api.residue_applies
    r = bench.Runner()
    rows = []
    for n in args.sizes:
        h = bench.heads_for(n)
        f = r.fns("strided_256", n, args.d, h)
        q, k, v, do = f["q"], f["k"], f["v"], f["do"]
        if g > 1:  # k/v with H / g heads; Flex on the same inputs with enable_gqa
            k, v = (t.detach()[:, ::g].contiguous().requires_grad_() for t in (k, v))
            import blocksparse_fa as bsfa

            bm = r.create_block_mask(bench.make_case("strided_256", n)[1], None, None, n, n, device="cuda", _compile=True)
            f["ours"] = lambda: bsfa.attention(q, k, v, mask=f["mask"])
            f["flex"] = lambda: r.flex(q, k, v, block_mask=bm, enable_gqa=True)
        res = {}
        for name, fn, views in (("views", f["ours"], True), ("copies", f["ours"], False), ("flex", f["flex"], None)):
            api.residue_applies = real if views is not False else (lambda *a: False)
            out = fn()
            grads = torch.autograd.grad(out, (q, k, v), do)
            fwd = bench.bench_ms(fn)
            fb = bench.bench_ms(bench.fwd_bwd(fn, do))
            res[name] = dict(out=out.detach(), g=[x.detach() for x in grads], fwd=fwd, fb=fb)
        api.residue_applies = real
        row = dict(n=n, h=h, hkv=h // g, d=args.d)
        for name in ("views", "copies", "flex"):
            row[f"{name}_fwd_ms"], row[f"{name}_fb_ms"] = res[name]["fwd"], res[name]["fb"]
        for name in ("views", "copies"):
            row[f"{name}_vs_flex"] = [rel(res[name]["out"], res["flex"]["out"])] + \
                [rel(a, b) for a, b in zip(res[name]["g"], res["flex"]["g"])]
            row[f"speedup_{name}"] = (res["flex"]["fwd"] / res[name]["fwd"], res["flex"]["fb"] / res[name]["fb"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        del res, f
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, f"strided_check{'_gqa' + str(g) if g > 1 else ''}.json"), "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=__import__("triton").__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
