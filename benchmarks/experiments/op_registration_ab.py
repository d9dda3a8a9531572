"""How the package's operators are registered, A/B on the GPU: the compiled call's time and host
time with the operators defined through ``torch.library.custom_op`` (a copy of an older tree,
``--old``) against the current tree (``blocksparse_fa/_oplib.py``: the body registered directly as
the operator's kernel). Each tree runs in its own process (operators register at import), the
processes take turns, ``--passes`` times.

Per mask (``bench.py``'s cases, 16K, H 16, d 128, bf16): ``do_bench`` medians of the forward and
forward+backward, eager and ``torch.compile(fullgraph=True)``, and the host time to launch one
compiled and one eager forward+backward (``host_path.host_us``). Each worker first checks the
compiled call against a float64 reference at 2K tokens (output and the three gradients; error
ratio to eager bf16's).

    PYTHONPATH=. python benchmarks/experiments/op_registration_ab.py --old DIR [--passes 2] [--json OUT]
    (DIR holds the older tree's ``blocksparse_fa`` package)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _check(torch, bsfa, make_case):
    """``{mask: max error ratio compiled / eager-bf16, both against float64}`` at 2K tokens."""
    dev, out = torch.device("cuda"), {}
    for name in ("sliding_window_1024", "longformer"):
        mask, _ = make_case(name, 2048, dev)
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v, do = (torch.randn(1, 4, 2048, 128, device=dev, generator=g) for _ in range(4))
        ref = [t.double().requires_grad_() for t in (q, k, v)]
        o64 = bsfa.attention(*ref, mask=mask, backend="torch")
        r64 = [o64, *torch.autograd.grad(o64, ref, do.double())]
        cf = torch.compile(lambda a, b, c: bsfa.attention(a, b, c, mask=mask), fullgraph=True)
        ratios = []
        lo = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        for fn in (lambda a, b, c: bsfa.attention(a, b, c, mask=mask), cf):
            o = fn(*lo)
            res = [o, *torch.autograd.grad(o, lo, do.bfloat16())]
            ratios.append([float((a.detach().double() - b.detach()).abs().max()) for a, b in zip(res, r64)])
        out[name] = max(c / max(e, 1e-6) for e, c in zip(*ratios))
    return out


def worker(tree: str, masks: list[str], n: int) -> dict:
    import torch
    import triton.testing

    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)
    import blocksparse_fa as bsfa
    from bench import make_case
    from host_path import host_us

    assert os.path.dirname(os.path.dirname(os.path.abspath(bsfa.__file__))) == os.path.abspath(tree)
    res = dict(tree=tree, oplib=os.path.exists(os.path.join(tree, "blocksparse_fa", "_oplib.py")),
               check=_check(torch, bsfa, make_case), rows={})
    dev = torch.device("cuda")
    for name in masks:
        mask, _ = make_case(name, n, dev)
        q, k, v, do = (torch.randn(1, 16, n, 128, device=dev, dtype=torch.bfloat16) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()

        def f(q, k, v):
            return bsfa.attention(q, k, v, mask=mask)
        cf = torch.compile(f, fullgraph=True)
        row = {}
        for path, g in (("eager", f), ("compiled", cf)):
            def step(g=g):
                return torch.autograd.grad(g(q, k, v), (q, k, v), do)
            with torch.no_grad():
                row[f"{path}_fwd_ms"] = triton.testing.do_bench(lambda g=g: g(q, k, v), warmup=25, rep=100)
            row[f"{path}_fwdbwd_ms"] = triton.testing.do_bench(step, warmup=25, rep=100)
            row[f"{path}_host_us"] = statistics.median(host_us(step) for _ in range(5))
        res["rows"][name] = row
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="directory holding the older tree's blocksparse_fa package")
    ap.add_argument("--masks", nargs="+", default=["sliding_window_1024", "longformer", "causal"])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker, a.masks, a.n)), flush=True)
        return
    runs = []
    for p in range(a.passes):
        for tree in (a.old, ROOT):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", tree, "--masks", *a.masks,
                                "--n", str(a.n)], env=env, capture_output=True, text=True, timeout=900)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                print(r.stdout[-3000:], r.stderr[-3000:], flush=True)
                continue
            run = json.loads(line[0][7:])
            run["pass"] = p
            runs.append(run)
            print(json.dumps(run), flush=True)
    import torch

    summary = {}
    for name in a.masks:
        for oplib in (False, True):
            rows = [r["rows"][name] for r in runs if r["oplib"] == oplib and name in r["rows"]]
            if rows:
                summary[f"{name}/{'library' if oplib else 'custom_op'}"] = {
                    key: statistics.median(r[key] for r in rows) for key in rows[0]}
    for key, val in summary.items():
        print(key, json.dumps({k: round(x, 3) for k, x in val.items()}), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, runs=runs, summary=summary),
                      fh, indent=1)


if __name__ == "__main__":
    main()
