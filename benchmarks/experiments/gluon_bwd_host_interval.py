"""The Gluon backward's interval mode on compiled layouts (``ops/triton_backend._gluon_bwd_interval_tables``:
one key interval per query row, tables built once per layout from its host intervals) on the H100:
checked, then timed beside the Triton block backward (``_attn_bwd``) that such layouts ran before.

1. Checks (``check:*``): O, dQ, dK and dV against float64 (``reference_attention`` per query head;
   dK and dV summed over each GQA group), beside eager attention in bf16 on the same heads, at 16K
   (the first GQA group: one head of MHA, four of 16/4). Patterns: ``window``
   (``sliding_window(1024)``) and ``docs`` (``causal() & document(ids)`` with the ids on the host:
   documents of 1-4K tokens with tiny ones of 1-100 mixed in), both as a layout compiled on the
   device (``compile_mask``), the form in which a ``document`` mask stays off the device-interval
   path. MHA 16/16 and GQA 16/4, d 128 and 64. PASS: every relative error at most 2x eager's, no
   NaN, and the backward that ran (``ops.select.record()``) is ``gluon:interval``.
2. Timings (``time:*``, ``triton.testing.do_bench`` medians, bf16, B = 1): backward alone and
   forward + backward, default (``gluon:interval``) against ``kernel_options=dict(backward="triton")``
   (``triton:blocks``), at 16K and 64K, H 16/16 and 16/4, d 128 and 64, documents of 1-4K tokens.

The child, the references, the timing loop and the table are ``gluon_bwd_interval.py``'s (that
script runs the same kernels on device-built intervals); only the masks' path differs. Results go
to ``--out`` (a ``.json`` file, or a folder that gets ``gluon_bwd_host_interval.json``), rewritten
after every case; a PASS/FAIL line per check and a table are printed. About 3 minutes on an H100
(``--budget``: cases past it are skipped and say so).

    PYTHONPATH=. python benchmarks/experiments/gluon_bwd_host_interval.py --out $OUT/x.json [--quick]
        [--budget 170] [--cases check:docs:16:4:16384:128 time:window:16:16:65536:128 ...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_bwd_interval import _Child as _IntervalChild, _fmt, doc_lengths, table  # noqa: E402
from gluon_bwd_tma import arg_parser, drive  # noqa: E402
from gluon_fwd import child_loop  # noqa: E402

PATTERNS = ("window", "docs")
HEADS = ((16, 16), (16, 4))


def all_cases(quick: bool) -> list[str]:
    """Case names ``check:{pattern}:{H}:{Hkv}:{L}:{d}`` and ``time:...``, most wanted first (a run
    out of budget skips the last ones)."""
    checks = {d: [f"check:{p}:{h}:{hk}:16384:{d}" for p in PATTERNS for h, hk in HEADS] for d in (128, 64)}
    times = {(n, d): [f"time:{p}:{h}:{hk}:{n}:{d}" for p in PATTERNS for h, hk in HEADS]
             for n in (16384, 65536) for d in (128, 64)}
    if quick:
        return checks[128] + times[(16384, 128)]
    return checks[128] + times[(16384, 128)] + checks[64] + times[(65536, 128)] + times[(16384, 64)] + \
        times[(65536, 64)]


class _Child(_IntervalChild):
    """``gluon_bwd_interval``'s child with the masks compiled into layouts (the host path)."""

    def __init__(self):
        super().__init__()
        self.layouts = {}

    def build_mask(self, pattern, n, timing=False):
        bsfa, torch = self.bsfa, self.torch
        if pattern == "window":
            return bsfa.sliding_window(1024)
        lens = doc_lengths(n, 1024, 4096, n, False) if timing else doc_lengths(n, 1, 4096, n + 1, True)
        ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))  # on the host
        return bsfa.causal() & bsfa.document(ids)

    def fwd(self, pattern, mask, opts):
        """``(q, k, v) -> out`` over ``mask`` compiled for the inputs' lengths (once per mask)."""
        def run(q, k, v):
            key = (id(mask), q.shape[2], k.shape[2])
            if key not in self.layouts:
                self.layouts[key] = (mask, self.bsfa.compile_mask(mask, q.shape[2], k.shape[2], device=q.device))
            return self.bsfa.attention(q, k, v, mask=self.layouts[key][1], kernel_options=opts)
        return run


def child_main(cases: list[str], progress: str) -> None:
    child_loop(_Child, cases, progress, "[gluon-bwd-host-interval]", _fmt)


def main():
    args = arg_parser(__doc__, 170.0, "16K d128 checks and timings only", "a .json file or a folder").parse_args()
    if args.child:
        child_main(args.cases, args.progress)
        return
    name = "gluon_bwd_host_interval.json"
    if args.out.endswith(".json"):
        args.out, name = os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out)
    drive(args, args.cases or all_cases(args.quick), name, _fmt, table, 34, __file__)


if __name__ == "__main__":
    main()
