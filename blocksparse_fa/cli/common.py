"""Helpers shared by subcommands."""

from __future__ import annotations

from ..mask.dsl import parse
from ..mask.expr import Mask
from ..mask.patterns import _pattern_names, load_pattern


def mask_from_arg(text: str) -> Mask:
    """A pattern name (``bigbird``) or DSL text (``"causal & window(256)"``)."""
    text = text.strip()
    if text in _pattern_names():
        return load_pattern(text)
    return parse(text)


def add_length_args(p, default_len: int | None = None) -> None:
    p.add_argument("--len", dest="q_len", type=int, required=default_len is None, default=default_len,
                   help="query length (and key length unless --kv-len)")
    p.add_argument("--kv-len", type=int, default=None, help="key length (default: --len)")
    p.add_argument("--block", type=int, default=128, help="layout block size (default 128)")
