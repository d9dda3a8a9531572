"""The op calls' layout memo (``custom_op._layout``) against checking and looking up on every
call: compiled (``torch.compile(fullgraph=True)``) and eager forward and forward+backward of
``bsfa.attention`` at a size where the compiled call is host-bound, interleaved on the same inputs.

    PYTHONPATH=. python benchmarks/experiments/op_memo_ab.py [--masks ...] [--n 16384] [--passes 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import make_case  # noqa: E402

import blocksparse_fa as bsfa  # noqa: E402
from blocksparse_fa.ops import custom_op as co  # noqa: E402
from blocksparse_fa.ops.validate import check_layout, check_qkv  # noqa: E402

MEMO = co._layout


def _plain(q, k, v, handle, align, tensors=None):
    s = check_qkv(q, k, v)
    layout = co.registry.layout(handle, s.Lq, s.Lk, q.device, align, tensors)
    check_layout(layout, s)
    return s, layout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--masks", nargs="+", default=["sliding_window_1024", "document_causal", "sinks_window_1024"])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name in args.masks:
        mask, _ = make_case(name, args.n, dev)
        q, k, v, do = (torch.randn(1, args.heads, args.n, 128, device=dev, dtype=torch.bfloat16) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()

        def f(q, k, v):
            return bsfa.attention(q, k, v, mask=mask)
        cf = torch.compile(f, fullgraph=True)
        row = dict(mask=name, n=args.n)
        for variant, fn in (("plain", _plain), ("memo", MEMO)) * args.passes:
            co._layout = fn
            for path, g in (("eager", f), ("compiled", cf)):
                with torch.no_grad():
                    fwd = triton.testing.do_bench(lambda: g(q, k, v), warmup=25, rep=100)
                fb = triton.testing.do_bench(lambda: torch.autograd.grad(g(q, k, v), (q, k, v), do), warmup=25, rep=100)
                row.setdefault(f"{path}_{variant}", []).append((fwd, fb))
        co._layout = MEMO
        for key in [x for x in row if isinstance(row[x], list)]:
            row[key + "_median"] = [statistics.median(t[i] for t in row[key]) for i in (0, 1)]
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list) or k.endswith("median")}),
              flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
