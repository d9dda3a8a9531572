"""The mask text DSL: a tokenizer and a recursive-descent parser (no ``eval``/``exec``).

Grammar (precedence ``~`` > ``&`` > ``|``)::

    expr    := term ('|' term)*
    term    := factor ('&' factor)*
    factor  := '~' factor | atom
    atom    := '(' expr ')' | NAME [ '(' [args] ')' ]
    args    := arg (',' arg)*
    arg     := value | NAME '=' value          (positional arguments first)
    value   := ['-'] INT | NAME                (a NAME is a variable: a pattern parameter or keyword)

Names are primitives (``causal``, ``window``, ...) or named patterns from ``masks/``. Tensor-backed
primitives (``document``, ``block_mask``, ``dense_mask``) take their tensor from a keyword given to
:func:`parse`, e.g. ``parse("causal & document", document=ids)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .expr import Mask, Not, And, Or
from .primitives import INT32_MAX, PRIMITIVES

__all__ = ["MaskSyntaxError", "parse"]

MAX_DEPTH = 100
MAX_TEXT = 100_000


class MaskSyntaxError(ValueError):
    """A DSL syntax error; the message shows the text with a caret under the position."""

    def __init__(self, message: str, text: str, pos: int):
        self.text, self.pos, self.reason = text, pos, message
        line_start = text.rfind("\n", 0, pos) + 1
        line_end = text.find("\n", pos)
        line_end = len(text) if line_end < 0 else line_end
        line = text[line_start:line_end]
        col = pos - line_start
        # keep very long lines readable: show a window around the caret
        if len(line) > 120:
            lo = max(0, col - 60)
            line, col = line[lo:lo + 120], col - lo
        super().__init__(f"{message} at position {pos}:\n  {line}\n  {' ' * col}^")


@dataclass(frozen=True)
class _Tok:
    kind: str  # NAME INT OP END
    text: str
    pos: int


_TOKEN_RE = re.compile(r"\s*(?:(?P<NAME>[A-Za-z_][A-Za-z0-9_]*)|(?P<INT>[0-9]+(?:_[0-9]+)*)|(?P<OP>[()&|~,=\-]))")


def _tokenize(text: str) -> list[_Tok]:
    toks: list[_Tok] = []
    pos = 0
    n = len(text)
    while True:
        while pos < n and text[pos].isspace():
            pos += 1
        if pos >= n:
            break
        m = _TOKEN_RE.match(text, pos)
        if not m or m.end() == pos:
            raise MaskSyntaxError(f"unexpected character {text[pos]!r}", text, pos)
        kind = m.lastgroup
        start = m.start(kind)
        toks.append(_Tok(kind, m.group(kind), start))
        pos = m.end()
    toks.append(_Tok("END", "", n))
    return toks


class _Parser:
    def __init__(self, text: str, variables: dict, resolve_name, depth0: int = 0):
        self.text = text
        self.toks = _tokenize(text)
        self.k = 0
        self.vars = variables
        self.resolve_name = resolve_name
        self.depth = depth0

    # -- helpers --
    @property
    def tok(self) -> _Tok:
        return self.toks[self.k]

    def _err(self, msg, tok=None):
        tok = tok or self.tok
        return MaskSyntaxError(msg, self.text, tok.pos)

    def _expect(self, text):
        if self.tok.text != text or self.tok.kind not in ("OP",):
            found = "end of text" if self.tok.kind == "END" else repr(self.tok.text)
            raise self._err(f"expected '{text}', found {found}")
        self.k += 1

    def _enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self._err(f"expression nested deeper than {MAX_DEPTH} levels")

    # -- grammar --
    def parse(self) -> Mask:
        if self.tok.kind == "END":
            raise self._err("empty mask expression")
        m = self.expr()
        if self.tok.kind != "END":
            raise self._err(f"unexpected {self.tok.text!r}")
        return m

    def expr(self) -> Mask:
        self._enter()
        items = [self.term()]
        while self.tok.kind == "OP" and self.tok.text == "|":
            self.k += 1
            items.append(self.term())
        self.depth -= 1
        return items[0] if len(items) == 1 else Or.of(*items)

    def term(self) -> Mask:
        items = [self.factor()]
        while self.tok.kind == "OP" and self.tok.text == "&":
            self.k += 1
            items.append(self.factor())
        return items[0] if len(items) == 1 else And.of(*items)

    def factor(self) -> Mask:
        if self.tok.kind == "OP" and self.tok.text == "~":
            self.k += 1
            self._enter()
            m = Not(self.factor())
            self.depth -= 1
            return m
        return self.atom()

    def atom(self) -> Mask:
        tok = self.tok
        if tok.kind == "OP" and tok.text == "(":
            self.k += 1
            m = self.expr()
            self._expect(")")
            return m
        if tok.kind != "NAME":
            found = "end of text" if tok.kind == "END" else repr(tok.text)
            raise self._err(f"expected a mask name or '(', found {found}")
        self.k += 1
        args: list = []
        kwargs: dict = {}
        if self.tok.kind == "OP" and self.tok.text == "(":
            self.k += 1
            if not (self.tok.kind == "OP" and self.tok.text == ")"):
                while True:
                    self._arg(args, kwargs)
                    if self.tok.kind == "OP" and self.tok.text == ",":
                        self.k += 1
                        continue
                    break
            self._expect(")")
        try:
            return self.resolve_name(tok.text, args, kwargs, self.vars, self.depth)
        except MaskSyntaxError:
            raise
        except (ValueError, TypeError) as e:
            raise MaskSyntaxError(str(e), self.text, tok.pos) from None

    def _arg(self, args, kwargs):
        tok = self.tok
        if tok.kind == "NAME" and self.toks[self.k + 1].kind == "OP" and self.toks[self.k + 1].text == "=":
            self.k += 2
            if tok.text in kwargs:
                raise self._err(f"argument '{tok.text}' given twice", tok)
            kwargs[tok.text] = self._value()
            return
        if kwargs:
            raise self._err("positional argument after a keyword argument")
        args.append(self._value())

    def _value(self) -> int:
        tok = self.tok
        sign = 1
        if tok.kind == "OP" and tok.text == "-":
            sign = -1
            self.k += 1
            tok = self.tok
        if tok.kind == "INT":
            self.k += 1
            digits = tok.text.replace("_", "")
            if len(digits) > 12 or int(digits) > INT32_MAX:
                raise self._err(f"integer {tok.text} is out of range (at most {INT32_MAX})", tok)
            return sign * int(digits)
        if tok.kind == "NAME" and sign == 1:
            self.k += 1
            if tok.text not in self.vars or not isinstance(self.vars[tok.text], int) or isinstance(self.vars[tok.text], bool):
                known = ", ".join(sorted(k for k, v in self.vars.items() if isinstance(v, int) and not isinstance(v, bool)))
                raise self._err(f"unknown variable '{tok.text}'" + (f" (known: {known})" if known else ""), tok)
            return self.vars[tok.text]
        found = "end of text" if tok.kind == "END" else repr(tok.text)
        raise self._err(f"expected an integer argument, found {found}", tok)


def _resolve(name: str, args: list, kwargs: dict, variables: dict, depth: int) -> Mask:
    """Turn a name with arguments into a mask: a primitive first, then a named pattern."""
    from .patterns import _pattern_names, _instantiate  # late import: patterns use this parser

    cls = PRIMITIVES.get(name)
    if cls is not None:
        try:
            if cls.TENSOR is None:
                return cls(*args, **kwargs)
            t = variables.get(cls.TENSOR)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"'{name}' needs a tensor: pass it by keyword, e.g. parse(text, {cls.TENSOR}=tensor)")
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


def parse(text: str, **variables) -> Mask:
    """Parse DSL text into a :class:`~blocksparse_fa.Mask`.

    Args:
        text: e.g. ``"causal & (window(256) | global_tokens(64))"``.
        **variables: tensors for tensor-backed primitives (``document=ids``, ``block_mask=t``,
            ``dense_mask=t``) and integers usable as argument values (``parse("window(w)", w=128)``).

    Raises:
        MaskSyntaxError: malformed text, unknown name or bad argument (message with a caret).
    """
    if not isinstance(text, str):
        raise TypeError(f"parse(): text must be a str, got {type(text).__name__}")
    if len(text) > MAX_TEXT:
        raise MaskSyntaxError(f"mask text longer than {MAX_TEXT} characters", text[:200], 0)
    return _parse(text, variables, 0)


def _parse(text: str, variables: dict, depth: int) -> Mask:
    return _Parser(text, variables, _resolve, depth).parse()
