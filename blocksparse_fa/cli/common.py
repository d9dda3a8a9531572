"""Helpers shared by subcommands: masks from the command line, document lengths, devices."""

from __future__ import annotations

import difflib
import re

import torch

from ..mask.dsl import MaskSyntaxError, parse
from ..mask.expr import Mask
from ..mask.patterns import _pattern_names, load_pattern, pattern_info
from ..mask.primitives import PRIMITIVES

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DOCUMENTS_HELP = ("document lengths for patterns that pack documents (document_causal, or 'document' in DSL text): "
                  "comma-separated lengths that add up to the key length, e.g. 1000,3000,96, or one length L "
                  "for documents of L tokens each")


def parse_documents(spec: str, length: int) -> torch.Tensor:
    """Document ids ``(length,)`` from ``--documents``: ``"100,200,300"`` (lengths that add up to
    ``length``) or ``"L"`` (documents of ``L`` tokens, the last one shorter if ``L`` does not
    divide ``length``)."""
    try:
        lens = [int(x) for x in spec.replace(" ", "").split(",")]
    except ValueError:
        raise ValueError(f"--documents takes comma-separated positive lengths, e.g. 1000,3000,96; got {spec!r}") from None
    if not lens or min(lens) < 1:
        raise ValueError(f"--documents lengths must be positive, got {spec!r}")
    if len(lens) == 1:
        return torch.arange(length) // lens[0]
    if sum(lens) != length:
        raise ValueError(f"--documents lengths add up to {sum(lens)}, but the key length is {length} "
                         f"(give lengths that add up to it, or one length for equal documents)")
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))


def _suggest(name: str) -> str:
    known = sorted(set(_pattern_names()) | set(PRIMITIVES))
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if not close:
        return "'bsfa patterns' lists the named patterns"
    return "did you mean " + " or ".join(f"'{c}'" for c in close) + "?"


def _needs_documents(names: set) -> bool:
    pats = set(_pattern_names())
    return "document" in names or any("document" in pattern_info(n).tensors for n in names & pats)


def mask_from_arg(text: str, documents: str | None = None, kv_len: int | None = None) -> Mask:
    """A pattern name (``bigbird``) or DSL text (``"causal & window(256)"``).

    Args:
        text: the command line's pattern argument.
        documents: ``--documents`` (see :func:`parse_documents`), for patterns with a ``document``
            tensor; needs ``kv_len``.
        kv_len: the key length the document ids must cover.

    Raises:
        ValueError: unknown names (with close matches), a pattern that needs document ids without
            ``--documents``, or any DSL error (:class:`MaskSyntaxError`, with a caret).
    """
    text = text.strip()
    names = set(_NAME.findall(text))
    tensors = {}
    if documents is not None:
        if not _needs_documents(names):
            raise ValueError(f"--documents: '{text}' has no 'document' term to use them")
        tensors["document"] = parse_documents(documents, kv_len)
    elif _needs_documents(names):
        raise ValueError(f"'{text}' needs document ids: pass --documents LENGTHS (e.g. --documents 1024 for "
                         f"documents of 1024 tokens, or --documents 1000,3000,96)")
    if text in _pattern_names():
        info = pattern_info(text)
        missing = [t for t in info.tensors if t not in tensors]
        if missing:
            raise ValueError(f"pattern '{text}' needs the tensor(s) {', '.join(missing)}, which the command line "
                             f"cannot supply; use the Python API")
        return load_pattern(text, **{k: v for k, v in tensors.items() if k in info.tensors})
    try:
        return parse(text, **tensors)
    except MaskSyntaxError as e:
        m = _NAME.match(e.text, e.pos)
        word = m.group(0) if m else None
        if word and word not in PRIMITIVES and word not in _pattern_names() and m.end() <= len(e.text):
            raise MaskSyntaxError(f"unknown pattern or mask name '{word}'; {_suggest(word)}", e.text, e.pos) from None
        raise


def add_length_args(p, default_len: int | None = None) -> None:
    p.add_argument("--len", dest="q_len", type=int, required=default_len is None, default=default_len,
                   help="query length (and key length unless --kv-len)")
    p.add_argument("--kv-len", type=int, default=None, help="key length (default: --len)")
    p.add_argument("--block", type=int, default=128, help="layout block size (default 128)")


def add_pattern_args(p) -> None:
    """The positional pattern and ``--documents``."""
    p.add_argument("pattern", help="pattern name (see 'bsfa patterns') or DSL text, e.g. \"causal & window(256)\"")
    p.add_argument("--documents", default=None, metavar="LENGTHS", help=DOCUMENTS_HELP)


def check_lengths(args) -> tuple[int, int]:
    """``(q_len, kv_len)`` from ``--len`` / ``--kv-len``, positive."""
    lq, lk = args.q_len, args.kv_len or args.q_len
    for flag, v in (("--len", lq), ("--kv-len", lk), ("--block", args.block)):
        if v < 1:
            raise ValueError(f"{flag} must be positive, got {v}")
    return lq, lk


def resolve_device(arg: str | None) -> torch.device:
    """``--device``: ``auto``/None (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    if arg in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(arg)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {arg!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {arg}: only cpu and cuda are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"--device {arg}: no CUDA device is available (torch {torch.__version__}, {build})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {arg}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev
