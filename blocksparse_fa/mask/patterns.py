"""Named patterns: declarative ``.mask`` files in the DSL, shipped inside the package.

File format (``masks/<name>.mask``)::

    # description: one line shown by ``list_patterns()`` and ``bsfa patterns``
    # cite: where the pattern comes from
    # params: window=256, n_global=64        (integer parameters with defaults; optional)
    # tensors: document                      (keywords that supply tensors; optional)
    window(window) | global_tokens(n_global) (the expression; parameters are variables)
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from .expr import Mask
from .grammar import MaskSyntaxError, Parser
from .primitives import PRIMITIVES

__all__ = ["PatternInfo", "list_patterns", "load_pattern", "pattern_info", "resolve_name", "parse_text"]

_MAX_PATTERN_DEPTH = 16


@dataclass(frozen=True)
class PatternInfo:
    """A pattern file, parsed."""

    name: str
    description: str
    citation: str
    params: dict = field(default_factory=dict)  # name -> default int (ordered)
    tensors: tuple = ()
    body: str = ""


_HEADER = re.compile(r"#\s*(description|cite|params|tensors)\s*:\s*(.*)$")


def _parse_file(name: str, text: str) -> PatternInfo:
    desc = cite = ""
    params: dict = {}
    tensors: tuple = ()
    body = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            m = _HEADER.match(line)
            if not m:
                continue
            key, val = m.group(1), m.group(2).strip()
            if key == "description":
                desc = val
            elif key == "cite":
                cite = val
            elif key == "params":
                for item in filter(None, (s.strip() for s in val.split(","))):
                    pname, _, default = item.partition("=")
                    params[pname.strip()] = int(default)
            else:
                tensors = tuple(filter(None, (s.strip() for s in val.split(","))))
            continue
        body.append(line)
    return PatternInfo(name, desc, cite, params, tensors, " ".join(body))


@functools.lru_cache(maxsize=None)
def _registry() -> dict[str, PatternInfo]:
    out = {}
    source = Path(__file__).resolve().parents[2] / "masks"  # a source checkout's own patterns first
    if (source / "__init__.py").is_file() and any(source.glob("*.mask")):
        folder = source
    else:
        folder = resources.files("blocksparse_fa.pattern_files")
    for entry in folder.iterdir():
        if entry.name.endswith(".mask"):
            name = entry.name[: -len(".mask")]
            out[name] = _parse_file(name, entry.read_text(encoding="utf-8"))
    return dict(sorted(out.items()))


def _pattern_names() -> list[str]:
    return list(_registry())


def list_patterns() -> dict[str, str]:
    """Names of the shipped patterns mapped to their one-line descriptions."""
    return {name: info.description for name, info in _registry().items()}


def pattern_info(name: str) -> PatternInfo:
    """The parsed pattern file (description, citation, parameters and defaults, expression)."""
    reg = _registry()
    if name not in reg:
        raise ValueError(f"unknown pattern '{name}'; known patterns: {', '.join(reg)}")
    return reg[name]


def _instantiate(name: str, args: list, kwargs: dict, tensors: dict, depth: int) -> Mask:
    info = pattern_info(name)
    if depth > _MAX_PATTERN_DEPTH:
        raise ValueError(f"pattern '{name}': patterns nested deeper than {_MAX_PATTERN_DEPTH} (a cycle?)")
    names = list(info.params)
    if len(args) > len(names):
        raise ValueError(f"pattern '{name}' takes at most {len(names)} positional argument(s) "
                         f"({', '.join(names) or 'none'}), got {len(args)}")
    values = dict(info.params)
    for pname, a in zip(names, args):
        values[pname] = a
    for k, a in kwargs.items():
        if k not in info.params:
            raise ValueError(f"pattern '{name}': unknown parameter '{k}' (parameters: {', '.join(names) or 'none'})")
        values[k] = a
    for k, a in values.items():
        if isinstance(a, torch.Tensor):
            continue  # a per-(batch, head) value: the primitive it reaches validates it
        if isinstance(a, bool) or not isinstance(a, int):
            raise ValueError(f"pattern '{name}': parameter '{k}' must be an int, got {type(a).__name__} {a!r}")
    for t in info.tensors:
        if not isinstance(tensors.get(t), torch.Tensor):
            raise ValueError(f"pattern '{name}' needs the tensor '{t}': pass it by keyword, e.g. {t}=tensor")
    env = {**tensors, **values}
    try:
        return parse_text(info.body, env, depth + 1)
    except MaskSyntaxError as e:
        raise ValueError(f"in pattern '{name}': {e}") from None


def resolve_name(name: str, args: list, kwargs: dict, variables: dict, depth: int) -> Mask:
    """Turn a name with arguments into a mask: a primitive first, then a named pattern (the
    ``resolve_name`` of :class:`~blocksparse_fa.mask.grammar.Parser`)."""
    cls = PRIMITIVES.get(name)
    if cls is not None:
        try:
            if cls.TENSOR is None:
                return cls(*args, **kwargs)
            what = "a callable" if name == "mask_mod" else "a tensor"
            if args and (isinstance(args[0], torch.Tensor) or callable(args[0])):
                return cls(*args, **kwargs)
            t = variables.get(cls.TENSOR)
            if not (isinstance(t, torch.Tensor) or (name == "mask_mod" and callable(t))):
                raise ValueError(f"'{name}' needs {what}: give it as the first argument ({name}(x) with x=...) or "
                                 f"by keyword, e.g. parse(text, {cls.TENSOR}=...)")
            return cls(t, *args, **kwargs)
        except ValueError:
            # a pattern of the same name (e.g. 'sliding_window', 'prefix_lm') takes what the primitive can't
            if name not in _pattern_names():
                raise
            try:
                return _instantiate(name, args, kwargs, {k: v for k, v in variables.items() if isinstance(v, torch.Tensor)}, depth)
            except ValueError:
                pass
            raise
    if name in _pattern_names():
        tensors = {k: v for k, v in variables.items() if isinstance(v, torch.Tensor)}
        return _instantiate(name, args, kwargs, tensors, depth)
    raise ValueError(
        f"unknown mask name '{name}'; primitives: {', '.join(sorted(PRIMITIVES))}; "
        f"patterns: {', '.join(_pattern_names())}"
    )


def parse_text(text: str, variables: dict, depth: int = 0) -> Mask:
    """DSL text as a mask, its names primitives or named patterns (``depth``: the nesting reached
    so far, patterns included); :func:`blocksparse_fa.mask.parse` checks the text first."""
    return Parser(text, variables, resolve_name, depth).parse()


def load_pattern(name: str, **overrides) -> Mask:
    """Load a named pattern from ``masks/``, overriding parameters and supplying tensors.

    Args:
        name: a name from :func:`list_patterns` (e.g. ``"bigbird"``).
        **overrides: integer parameters (``window=192``; a ``(B, H)`` tensor such as
            ``per_batch(lengths)`` where the primitive takes per-batch/per-head values) and
            tensors (``document=ids``).

    Returns:
        The pattern's mask expression.
    """
    info = pattern_info(name)
    # tensors named like a parameter are per-(batch, head) values of it (padded_batch(length=...))
    ints = {k: v for k, v in overrides.items() if not isinstance(v, torch.Tensor) or k in info.params}
    tensors = {k: v for k, v in overrides.items() if isinstance(v, torch.Tensor) and k not in info.params}
    for k in tensors:
        if k not in info.tensors:
            raise ValueError(f"pattern '{name}' takes no tensor '{k}' (tensors: {', '.join(info.tensors) or 'none'})")
    return _instantiate(name, [], ints, tensors, 0)
