"""``bsfa``: entry point; discovers subcommands in this package (modules defining ``register``)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from .. import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bsfa", description="Block-sparse FlashAttention: inspect, compile and run mask patterns.")
    parser.add_argument("--version", action="version", version=f"blocksparse_fa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pkg = importlib.import_module(__package__)
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name in ("main", "common") or info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__package__}.{info.name}")
        if hasattr(mod, "register"):
            mod.register(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as e:  # user errors: one clear line, no traceback
        print(f"bsfa {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
