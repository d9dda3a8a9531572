"""``bsfa analyze``: how many layers a pattern needs until information can mix (block-graph reachability)."""

from __future__ import annotations

import json

from .common import add_pattern_args, mask_from_arg


def register(sub) -> None:
    p = sub.add_parser("analyze", help="reachability of a pattern's block graph across layers (needs the [analysis] "
                                       "extra: networkx)")
    add_pattern_args(p)
    p.add_argument("--len", dest="n", type=int, required=True, help="sequence length")
    p.add_argument("--layers", type=int, required=True, help="depth L at which reachable block pairs are counted")
    p.add_argument("--block", type=int, default=128, help="block size: the graph's granularity (default 128)")
    p.add_argument("--top", type=int, default=3, help="hubs to report")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..analysis.reach import analyze

    if args.n < 1 or args.block < 1:
        raise ValueError(f"--len and --block must be positive, got {args.n} and {args.block}")
    mask = mask_from_arg(args.pattern, args.documents, args.n)
    res = analyze(mask, args.n, args.layers, args.block, top=args.top, progress=True)
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
    else:
        print(res.summary())
    return 0
