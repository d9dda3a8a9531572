"""The grammar of the mask text DSL: a tokenizer and a recursive-descent parser (no ``eval``/``exec``).

Grammar (precedence ``~`` > ``&`` > ``|``)::

    expr    := term ('|' term)*
    term    := factor ('&' factor)*
    factor  := '~' factor | atom
    atom    := '(' expr ')' | 'shift' '(' expr ',' ['offset' '='] value ')' | NAME [ '(' [args] ')' ]
    args    := arg (',' arg)*
    arg     := value | NAME '=' value          (positional arguments first)
    value   := sum | '(' sum (',' sum)+ ')'    (a tuple of ints: grid shapes, kernel sizes)
    sum     := product (('+' | '-') product)*  (integer arithmetic; '//' is floor division)
    product := unary (('*' | '//') unary)*
    unary   := '-' unary | INT | NAME | '(' sum ')'

A NAME inside arguments is a variable given to :func:`blocksparse_fa.parse` (or a pattern parameter): an int, a
tensor (a per-head/per-batch parameter, ``window(w)`` with ``w=per_head(...)``) or, for
``mask_mod``, a callable. Names outside arguments are primitives (``causal``, ``window``, ...) or
named patterns from ``masks/``. Primitives that hold a tensor (``document``, ``block_mask``,
``dense_mask``, ``key_set``, ``query_set``, ``mask_mod``) take it as their first argument
(``document(ids)``) or, when it is left out, from the keyword of their own name:
``parse("causal & document", document=ids)``.

The parser turns a name with its arguments into a mask through the ``resolve_name`` it is given,
:func:`blocksparse_fa.mask.patterns.resolve_name` (primitives, then named patterns): the public
:func:`blocksparse_fa.parse` and the pattern files both parse through it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .base import INT32_MAX
from .expr import MAX_DEPTH, Mask, Not, And, Or
from .shift import Shift

__all__ = ["MaskSyntaxError", "Parser", "MAX_TEXT"]

MAX_TEXT = 100_000
_MAX_VALUE = 2**62


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


_TOKEN_RE = re.compile(r"\s*(?:(?P<NAME>[A-Za-z_][A-Za-z0-9_]*)|(?P<INT>[0-9]+(?:_[0-9]+)*)|(?P<OP>//|[()&|~,=\-+*]))")


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


class Parser:
    """Recursive-descent parser of one text: ``Parser(text, variables, resolve_name, depth).parse()``.
    ``resolve_name(name, args, kwargs, variables, depth)`` makes the mask of a name with its
    arguments (``ValueError``/``TypeError`` become a :class:`MaskSyntaxError` at the name)."""

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
        if tok.text == "shift" and self.toks[self.k + 1].text == "(":
            return self._shift()
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

    def _shift(self) -> Mask:
        """``shift(expr, offset)`` (or ``offset=``): the one combinator taking a mask argument."""
        tok = self.tok
        self.k += 2
        m = self.expr()
        self._expect(",")
        if self.tok.kind == "NAME" and self.tok.text == "offset" and self.toks[self.k + 1].text == "=":
            self.k += 2
        off_tok = self.tok
        offset = self._value()
        self._expect(")")
        try:
            return Shift(m, offset)
        except (ValueError, TypeError) as e:
            raise MaskSyntaxError(str(e), self.text, off_tok.pos if off_tok else tok.pos) from None

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

    def _value(self):
        """An argument value: an int (with arithmetic), a tuple of ints, or a variable's tensor/callable."""
        tok = self.tok
        if tok.kind == "OP" and tok.text == "(":
            self._enter()
            self.k += 1
            items = [self._sum()]
            while self.tok.kind == "OP" and self.tok.text == ",":
                self.k += 1
                items.append(self._sum())
            self._expect(")")
            self.depth -= 1
            if len(items) == 1:
                return self._more(items[0], tok)
            for v, _ in items:
                if not isinstance(v, int):
                    raise self._err("a tuple holds integers only", tok)
            return tuple(v for v, _ in items)
        v, _ = self._sum()
        return v

    def _more(self, first, tok):
        """Continue an arithmetic expression that started with a parenthesised group."""
        v, _ = first
        # a parenthesised group may be followed by operators: "(n + 1) * 2"
        while self.tok.kind == "OP" and self.tok.text in ("*", "//"):
            op = self.tok
            self.k += 1
            rhs = self._unary()
            v = self._arith(op, v, rhs)
        while self.tok.kind == "OP" and self.tok.text in ("+", "-"):
            op = self.tok
            self.k += 1
            rhs = self._product()
            v = self._arith(op, v, rhs)
        return v

    def _arith(self, op, a, b):
        if not (isinstance(a, int) and isinstance(b, int)):
            raise self._err(f"'{op.text}' needs integer operands", op)
        if op.text == "+":
            r = a + b
        elif op.text == "-":
            r = a - b
        elif op.text == "*":
            r = a * b
        else:
            if b == 0:
                raise self._err("division by zero", op)
            r = a // b
        if abs(r) > _MAX_VALUE:
            raise self._err(f"integer result {r} is out of range", op)
        return r

    def _sum(self):
        tok = self.tok
        v = self._product()
        while self.tok.kind == "OP" and self.tok.text in ("+", "-"):
            op = self.tok
            self.k += 1
            v = self._arith(op, v, self._product())
        return v, tok

    def _product(self):
        v = self._unary()
        while self.tok.kind == "OP" and self.tok.text in ("*", "//"):
            op = self.tok
            self.k += 1
            v = self._arith(op, v, self._unary())
        return v

    def _unary(self):
        tok = self.tok
        if tok.kind == "OP" and tok.text == "-":
            self.k += 1
            self._enter()
            v = self._unary()
            self.depth -= 1
            if not isinstance(v, int):
                raise self._err("'-' needs an integer operand", tok)
            return -v
        if tok.kind == "OP" and tok.text == "(":
            self._enter()
            self.k += 1
            v, _ = self._sum()
            self._expect(")")
            self.depth -= 1
            return v
        if tok.kind == "INT":
            self.k += 1
            digits = tok.text.replace("_", "")
            if len(digits) > 12 or int(digits) > INT32_MAX:
                raise self._err(f"integer {tok.text} is out of range (at most {INT32_MAX})", tok)
            return int(digits)
        if tok.kind == "NAME":
            self.k += 1
            v = self.vars.get(tok.text)
            if isinstance(v, bool) or not (isinstance(v, (int, torch.Tensor)) or callable(v)):
                known = ", ".join(sorted(k for k, x in self.vars.items() if isinstance(x, int) and not isinstance(x, bool)))
                raise self._err(f"unknown variable '{tok.text}'" + (f" (known: {known})" if known else ""), tok)
            return v
        found = "end of text" if tok.kind == "END" else repr(tok.text)
        raise self._err(f"expected an integer argument, found {found}", tok)
