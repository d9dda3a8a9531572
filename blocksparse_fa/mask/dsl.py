"""The mask text DSL: :func:`parse`. The grammar, tokenizer and parser are in
:mod:`blocksparse_fa.mask.grammar`; names resolve to primitives and to the named patterns of
:mod:`blocksparse_fa.mask.patterns`, whose files are read by the same parser."""

from __future__ import annotations

from .expr import Mask
from .grammar import MAX_TEXT, MaskSyntaxError
from .patterns import parse_text

__all__ = ["MaskSyntaxError", "parse"]


def parse(text: str, **variables) -> Mask:
    """Parse DSL text into a :class:`~blocksparse_fa.Mask`.

    Args:
        text: e.g. ``"causal & (window(256) | global_tokens(64))"``.
        **variables: integers usable as argument values (``parse("window(w)", w=128)``), tensors
            (``document=ids``, per-head parameters ``window(w)`` with ``w=per_head(...)``) and
            callables for ``mask_mod``. ``parse(str(m), **m.tensors()) == m`` for every mask ``m``.

    Raises:
        MaskSyntaxError: malformed text, unknown name or bad argument (message with a caret).
    """
    if not isinstance(text, str):
        raise TypeError(f"parse(): text must be a str, got {type(text).__name__}")
    if len(text) > MAX_TEXT:
        raise MaskSyntaxError(f"mask text longer than {MAX_TEXT} characters", text[:200], 0)
    return parse_text(text, variables)
