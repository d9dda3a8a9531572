"""``bsfa``: entry point; discovers subcommands in this package (modules defining ``register``).

Errors end a command with one line on stderr (``bsfa CMD: error: ...``; a DSL error adds the text
with a caret under the position) and exit status 2, never a traceback. Set ``BSFA_TRACEBACK=1`` to
see the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from .. import __version__

_SKIP = ("main", "common")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bsfa", description="Block-sparse FlashAttention: inspect, compile and run mask patterns.")
    parser.add_argument("--version", action="version", version=f"blocksparse_fa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pkg = importlib.import_module(__package__)
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name in _SKIP or info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__package__}.{info.name}")
        if hasattr(mod, "register"):
            mod.register(sub)
    return parser


def _message(e: BaseException) -> str:
    """One line, except a DSL error, which keeps its text-and-caret lines."""
    from ..mask.dsl import MaskSyntaxError

    text = str(e) if isinstance(e, MaskSyntaxError) else " ".join(str(e).split())
    return text or type(e).__name__


def _stdout_closed() -> int:
    """The reader of our stdout went away (``bsfa ... | head``): stop quietly, as other Unix tools
    do, and point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (e.g. captured in tests)
        pass
    return 141  # 128 + SIGPIPE, what a shell reports for a process ended by a closed pipe


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    prefix = f"bsfa {args.command}: "
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        print(f"{prefix}interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError, ImportError) as e:  # user errors: bad input, files, missing extras
        if os.environ.get("BSFA_TRACEBACK"):
            raise
        print(f"{prefix}error: {_message(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # anything else is a bug, still reported in one line
        if os.environ.get("BSFA_TRACEBACK"):
            raise
        print(f"{prefix}error: {type(e).__name__}: {_message(e)} (set BSFA_TRACEBACK=1 for the traceback)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
