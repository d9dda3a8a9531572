"""The persistent Gluon backward (``GluonBwdConfig.persistent`` / ``dkdv_persistent``, on by default
on one-interval-per-row layouts) against one program per tile, through the entry points users
call: ``bsfa.attention`` eager and inside ``torch.compile(fullgraph=True)``, on the masks of
``bench.py`` it applies to (packed documents, built on the device from ``document(ids)``, and a
sliding window of 1024, a compiled layout).

Per mask and variant: forward+backward time (``do_bench`` medians, three passes taking turns), the
host time to issue one forward+backward while the GPU is busy (``host_path.host_us``), the kernels
``select.record`` saw, and that one call makes no device-to-host synchronisation
(``torch.cuda.set_sync_debug_mode("error")``). Gradients of the two variants are compared bit for
bit (the persistent kernels sum in the same order).

    PYTHONPATH=. python benchmarks/experiments/persistent_bwd_entry.py [--out DIR] [--n 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import blocksparse_fa as bsfa  # noqa: E402
from blocksparse_fa.ops import select  # noqa: E402
from blocksparse_fa.ops.options import GluonBwdConfig  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--passes", type=int, default=3)
    a = ap.parse_args()
    from triton.testing import do_bench

    from bench import doc_ids
    from host_path import host_us

    n, H, D = a.n, 16, 128
    masks = {"documents": bsfa.load_pattern("document_causal", document=doc_ids(n)),
             "sliding_window_1024": bsfa.sliding_window(1024)}
    variants = {"persistent": GluonBwdConfig(),
                "per_tile": GluonBwdConfig(persistent=False, dkdv_persistent=False)}
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "n": n, "cases": {}}
    fns = {}
    for mname, mask in masks.items():
        rec = res["cases"][mname] = {}
        for vname, cfg in variants.items():
            opts = {"gluon_bwd": cfg}

            def eager(mask=mask, opts=opts):
                o = bsfa.attention(q, k, v, mask=mask, kernel_options=opts)
                return torch.autograd.grad(o, leaves, do)

            cf = torch.compile(lambda q, k, v, mask=mask, opts=opts: bsfa.attention(q, k, v, mask=mask,
                                                                                   kernel_options=opts),
                               fullgraph=True, dynamic=False)

            def compiled(cf=cf):
                return torch.autograd.grad(cf(q, k, v), leaves, do)

            for path, fn in (("eager", eager), ("compiled", compiled)):
                with select.record() as ran:
                    grads = fn()
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    fn()
                    torch.cuda.synchronize()
                    sync_free = True
                except RuntimeError:
                    sync_free = False
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                r = rec.setdefault(f"{path}/{vname}", {"ms": []})
                r["ran"] = sorted(set(f"{p}:{c}" for p, c in ran))
                r["sync_free"] = sync_free
                r["host_us"] = host_us(fn)
                r["grads"] = grads
                fns[(mname, path, vname)] = fn
        for path in ("eager", "compiled"):
            a_, b_ = rec[f"{path}/persistent"].pop("grads"), rec[f"{path}/per_tile"].pop("grads")
            rec[f"{path}/bit_equal"] = all(bool(torch.equal(x, y)) for x, y in zip(a_, b_))
    for _ in range(a.passes):
        for (mname, path, vname), fn in fns.items():
            res["cases"][mname][f"{path}/{vname}"]["ms"].append(do_bench(fn, warmup=25, rep=100))
    print(f"{'mask':22s} {'path':9s} {'per tile':>9s} {'persist.':>9s} {'speed-up':>8s} {'host us':>15s} "
          f"bit-equal sync-free   (fwd+bwd ms, median of passes)")
    for mname, rec in res["cases"].items():
        for path in ("eager", "compiled"):
            p, t = rec[f"{path}/persistent"], rec[f"{path}/per_tile"]
            for r in (p, t):
                r["median_ms"] = sorted(r["ms"])[len(r["ms"]) // 2]
            print(f"{mname:22s} {path:9s} {t['median_ms']:9.3f} {p['median_ms']:9.3f} "
                  f"{t['median_ms'] / p['median_ms']:8.3f} {t['host_us']:7.0f}/{p['host_us']:<7.0f} "
                  f"{rec[f'{path}/bit_equal']!s:9s} {p['sync_free'] and t['sync_free']!s:9s} {p['ran']}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "persistent_bwd_entry.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
