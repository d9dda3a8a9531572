"""``bsfa patterns``: list the named patterns shipped in ``masks/``."""

from __future__ import annotations

from ..mask.patterns import _registry


def register(sub) -> None:
    p = sub.add_parser("patterns", help="list named patterns")
    p.add_argument("-v", "--verbose", action="store_true", help="also show parameters, expression and citation")
    p.set_defaults(func=run)


def run(args) -> int:
    reg = _registry()
    width = max(len(n) for n in reg)
    for name, info in reg.items():
        print(f"{name:<{width}}  {info.description}")
        if args.verbose:
            params = ", ".join(f"{k}={v}" for k, v in info.params.items())
            tensors = f"  tensors: {', '.join(info.tensors)}" if info.tensors else ""
            print(f"{'':<{width}}  = {info.body}   [{params}]{tensors}")
            print(f"{'':<{width}}    {info.citation}")
    return 0
