"""``bsfa show``: compile a pattern or expression and picture its block layout."""

from __future__ import annotations

from pathlib import Path

from ..compiler.compile import compile_mask
from .common import add_length_args, add_pattern_args, check_lengths, mask_from_arg


def register(sub) -> None:
    p = sub.add_parser("show", help="ASCII picture, density and LUT size of a pattern's block layout")
    add_pattern_args(p)
    add_length_args(p)
    p.add_argument("--width", type=int, default=64, help="picture width in characters (default 64)")
    p.add_argument("--png", default=None, help="also save a matplotlib plot to this PNG file (needs the [plot] extra)")
    p.set_defaults(func=run)


def run(args) -> int:
    lq, lk = check_lengths(args)
    if args.width < 1:
        raise ValueError(f"--width must be positive, got {args.width}")
    if args.png:
        folder = Path(args.png).expanduser().resolve().parent
        if not folder.is_dir():
            raise ValueError(f"--png {args.png}: the folder {folder} does not exist")
    mask = mask_from_arg(args.pattern, args.documents, lk)
    lay = compile_mask(mask, lq, lk, args.block, cache=False)
    print(lay.ascii(width=args.width))
    print(f"  compile time: {lay.compile_seconds * 1e3:.1f} ms")
    if args.png:
        lay.plot(args.png)
        print(f"  wrote {args.png}")
    return 0
