"""Where the host time of a compiled call goes: ``torch.compile(fullgraph=True)`` of
``bsfa.attention`` against the eager call.

    PYTHONPATH=. python benchmarks/experiments/compiled_host.py [--json OUT.json]

Per call: the host time to launch one forward+backward (``torch.autograd.grad``; 20 calls after a
sync, short enough that the launch queue never fills), and the time spent inside the op bodies
(``dispatch.forward`` / ``dispatch.backward``). The script once also switched off parts of
``torch.library.custom_op``'s per-call wrapper (its alias check, its ``torch._dynamo.disable``
frame); the operators no longer use ``custom_op`` (``blocksparse_fa/_oplib.py``), and
``op_registration_ab.py`` compares the two registrations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import blocksparse_fa as bsfa
from blocksparse_fa.ops import dispatch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_path import host_us  # noqa: E402


class _BodyTimer:
    """Accumulated host time inside ``dispatch.forward`` and ``dispatch.backward``."""

    def __init__(self):
        self.t, self.n = 0.0, 0
        self.f0, self.b0 = dispatch.forward, dispatch.backward

    def wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            r = fn(*a, **kw)
            self.t += time.perf_counter() - t0
            self.n += 1
            return r
        return timed

    def __enter__(self):
        dispatch.forward, dispatch.backward = self.wrap(self.f0), self.wrap(self.b0)
        return self

    def __exit__(self, *exc):
        dispatch.forward, dispatch.backward = self.f0, self.b0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shape", type=int, nargs=5, default=[1, 8, 2, 16384, 64], help="B H Hkv N D")
    args = ap.parse_args()
    torch.manual_seed(0)
    B, H, Hkv, N, D = args.shape
    mask = bsfa.causal() & (bsfa.window(256) | bsfa.global_tokens(64))
    q = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn_like(q)
    compiled = torch.compile(lambda q, k, v: bsfa.attention(q, k, v, mask=mask), fullgraph=True)
    eager = lambda: torch.autograd.grad(bsfa.attention(q, k, v, mask=mask), (q, k, v), do)  # noqa: E731
    comp = lambda: torch.autograd.grad(compiled(q, k, v), (q, k, v), do)  # noqa: E731
    ref = [g.clone() for g in eager()]
    rows = []
    for label, fn in (("eager", eager), ("compiled", comp), ("eager", eager), ("compiled", comp)):
        got = fn()
        same = all(torch.equal(a, b) for a, b in zip(got, ref))
        with _BodyTimer() as bt:
            t = host_us(fn)
        body = bt.t / 23 * 1e6  # per fwd+bwd call (host_us makes 23 calls)
        row = dict(call=label, host_us=round(t, 1), op_bodies_us=round(body, 1), same_grads=same)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=args.shape, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
