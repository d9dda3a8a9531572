"""Aten operations per piece of the device-interval path's per-call construction (CPU profile).

Counts, with ``torch.profiler`` on the CPU, the aten operations that building the rows' intervals
(``IntervalSpec.bounds``) and the kernels' per-tile tables (``row_tables``, ``col_tables``,
``gluon_interval_tables``) issue per call (top level, and with the nested ones), for the pure-torch
construction (``--impl torch``, the reference) and the Triton one (``--impl triton``: the kernels of
``kernels/interval_tables.py``, counted as launches and not run, so that the count holds the
construction's own operations: allocations, the sort of ids that may recur). On a GPU nearly every
top-level aten operation of the torch construction is a kernel launch (views aside); the Triton
construction's are its launches plus the sort.

    PYTHONPATH=. python benchmarks/experiments/interval_ops.py [--len 65536] [--impl torch triton]
        [--out DIR]

Prints one line per piece (total and the most frequent operations) and writes
``DIR/interval_ops.json`` when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import blocksparse_fa as bsfa  # noqa: E402
from blocksparse_fa.compiler import device_intervals as di  # noqa: E402


def _ids(total: int, lo: int, hi: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        lens.append(min(int(torch.randint(lo, hi + 1, (1,), generator=g)), total - sum(lens)))
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))


def count(fn) -> tuple[collections.Counter, int]:
    """Top-level aten operations ``fn()`` issues (CPU profile), and all aten operations (nested
    ones included)."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm-up (Triton compiles, caches fill)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = collections.Counter()
    evs = [e for e in prof.events() if e.name.startswith("aten::")]
    for e in evs:  # top level: not inside another aten op
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            ops[e.name[len("aten::"):]] += 1
    return ops, len(evs)


class _Launches:
    """Stands in for ``kernels/interval_tables._launch``: counts launches, runs nothing."""

    def __init__(self):
        self.n = 0

    def __call__(self, fn, grid, args, **consts):
        self.n += 1


def pieces(L: int, impl: str) -> dict:
    """``{piece: fn}`` at length ``L`` (documents of L/32..L/4 tokens, one id in two runs for the
    compare case)."""
    ids = _ids(L, max(1, L // 32), max(1, L // 4))
    recurring = torch.cat([ids[: L // 2], ids[: L - L // 2]])
    fast = impl == "triton"
    masks = {
        "bounds, causal & document (contiguous)": bsfa.causal() & bsfa.document(ids),
        "bounds, sliding_window & causal & document (contiguous)":
            bsfa.sliding_window(L // 8) & bsfa.causal() & bsfa.document(ids),
        "bounds, causal & document (id compare)": bsfa.causal() & bsfa.document(recurring),
    }
    out = {}

    def fresh(spec):  # what a new mask pays: nothing kept on the document
        spec.terms[spec.doc][0]._device_cache = None
        return spec.bounds("cpu", fast=fast)

    for name, mask in masks.items():
        spec = di.interval_spec(mask, L, L)
        out[name] = (lambda spec=spec: fresh(spec))
    spec = di.interval_spec(masks["bounds, causal & document (contiguous)"], L, L)
    out["bounds, causal & document, same mask again (kept)"] = lambda: spec.bounds("cpu", fast=fast)
    iv = di.interval_spec(masks["bounds, causal & document (contiguous)"], L, L).bounds("cpu")
    ivc = di.interval_spec(masks["bounds, causal & document (id compare)"], L, L).bounds("cpu")
    for tag, v in (("contiguous", iv), ("id compare", ivc)):
        out[f"row_tables 128x64, {tag}"] = lambda v=v: di.row_tables(v, 128, 64, fast=fast)
        out[f"col_tables 32x128, {tag}"] = lambda v=v: di.col_tables(v, L, 32, 128, fast=fast)
    out["gluon_interval_tables 128x128"] = lambda: di.gluon_interval_tables(iv.lo.view(1, L), iv.hi.view(1, L),
                                                                            128, 128, fast=fast)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=65536)
    ap.add_argument("--impl", nargs="+", default=["torch", "triton"], choices=["torch", "triton"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report = {}
    from blocksparse_fa.kernels import interval_tables

    real = interval_tables._launch
    for impl in args.impl:
        print(f"{impl} construction, L = {args.len}: aten operations per call (top level, all), Triton launches")
        rows = report.setdefault(impl, {})
        todo = pieces(args.len, impl)  # the intervals the tables read: built for real
        launches = interval_tables._launch = _Launches()
        try:
            for name, fn in todo.items():
                launches.n = 0
                ops, nested = count(fn)
                n, k = sum(ops.values()), launches.n // 2  # count() calls fn twice
                rows[name] = dict(top_level=n, all=nested, triton_launches=k, ops=dict(ops.most_common()))
                top = ", ".join(f"{o} {v}" for o, v in ops.most_common(5))
                print(f"  {name:58s} {n:4d} {nested:4d} {k:2d}   ({top})", flush=True)
        finally:
            interval_tables._launch = real
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "interval_ops.json"), "w") as f:
            json.dump(dict(L=args.len, counts=report), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
