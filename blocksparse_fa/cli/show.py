"""``bsfa show``: compile a pattern or expression and picture its block layout."""

from __future__ import annotations

from ..compiler.compile import compile_mask
from .common import add_length_args, mask_from_arg


def register(sub) -> None:
    p = sub.add_parser("show", help="ASCII picture, density and LUT size of a pattern's block layout")
    p.add_argument("pattern", help="pattern name (see 'bsfa patterns') or DSL text, e.g. \"causal & window(256)\"")
    add_length_args(p)
    p.add_argument("--width", type=int, default=64, help="picture width in characters")
    p.add_argument("--png", default=None, help="also save a matplotlib plot to this PNG file")
    p.set_defaults(func=run)


def run(args) -> int:
    mask = mask_from_arg(args.pattern)
    kv = args.kv_len or args.q_len
    lay = compile_mask(mask, args.q_len, kv, args.block, cache=False)
    print(lay.ascii(width=args.width))
    print(f"  compile time: {lay.compile_seconds * 1e3:.1f} ms")
    if args.png:
        lay.plot(args.png)
        print(f"  wrote {args.png}")
    return 0
