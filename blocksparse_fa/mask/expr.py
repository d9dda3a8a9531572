"""Mask expressions: the ``&``, ``|``, ``~`` algebra and its element semantics.

A mask expression is an immutable tree. Leaves are primitives (``blocksparse_fa.mask.primitives``);
inner nodes are :class:`And`, :class:`Or` and :class:`Not`. Every node can evaluate itself on index
tensors (:meth:`Mask._eval`), which is *the* reference semantics: ``to_dense`` and the CPU backend
both go through it, and the block compiler is tested against it.

Positions: query row ``i`` sits at absolute position ``qp = i + q_offset`` and key column ``j`` at
position ``j``. ``q_offset`` is ``kv_len - q_len`` when queries align bottom-right (the default) and
0 when they align top-left (``align="top_left"``, as FlexAttention and SDPA's ``is_causal`` do).

Expressions are at most :data:`MAX_DEPTH` levels deep (the text DSL's limit), so that every mask
prints as text that :func:`blocksparse_fa.parse` reads back; deeper expressions are rejected when
they are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["Mask", "And", "Or", "Not", "EvalContext", "MAX_DEPTH", "ALIGNS", "query_offset"]

MAX_DEPTH = 100
"""Deepest nesting the text DSL reads (``(``/``~`` levels). An expression tree is limited to
``MAX_DEPTH - 1`` operator levels, which always prints within the DSL's limit."""

ALIGNS = ("bottom_right", "top_left")


def query_offset(q_len: int, kv_len: int, align: str = "bottom_right") -> int:
    """Absolute position of query row 0: ``kv_len - q_len`` (bottom-right) or 0 (top-left)."""
    if align == "bottom_right":
        return kv_len - q_len
    if align == "top_left":
        return 0
    raise ValueError(f"align must be one of {ALIGNS}, got {align!r}")


@dataclass(frozen=True)
class EvalContext:
    """Broadcastable index tensors at which an expression is evaluated.

    Attributes:
        q_len: number of query rows.
        kv_len: number of keys.
        i: query row indices (int64, broadcastable).
        qp: absolute query positions, ``i + kv_len - q_len``.
        j: key positions (int64, broadcastable).
        b: batch indices into the mask's batch dim, or ``None`` when the mask has none.
        h: head indices into the mask's head dim, or ``None``.
    """

    q_len: int
    kv_len: int
    i: torch.Tensor
    qp: torch.Tensor
    j: torch.Tensor
    b: torch.Tensor | None = None
    h: torch.Tensor | None = None


def _check_length(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def broadcast_batch_shapes(shapes) -> tuple[int, ...]:
    """Broadcast mask batch shapes: ``()`` or ``(B, H)``; a 1 broadcasts against anything."""
    out: tuple[int, ...] = ()
    for s in shapes:
        if not s:
            continue
        if not out:
            out = tuple(s)
            continue
        merged = []
        for a, c in zip(out, s):
            if a != c and a != 1 and c != 1:
                raise ValueError(f"mask batch shapes {out} and {tuple(s)} do not broadcast")
            merged.append(max(a, c))
        out = tuple(merged)
    return out


def check_param_batch(prim: str, arg: str, shape, B: int, H: int) -> None:
    """``ValueError`` unless a ``(Bp, Hp)`` parameter fits ``B`` sequences and ``H`` query heads."""
    if shape is None:
        return
    bp, hp = shape
    if bp not in (1, B):
        raise ValueError(f"{prim}(): argument '{arg}' holds {bp} per-batch values but the inputs have B={B} "
                         f"sequences: per_batch() needs exactly B values (or one for all)")
    if hp not in (1, H):
        raise ValueError(f"{prim}(): argument '{arg}' holds {hp} per-head values but q has H={H} heads: "
                         f"per_head() needs exactly H values (or one for all)")


class Mask:
    """An attention mask expression.

    Combine with ``&`` (both keep), ``|`` (either keeps) and ``~`` (complement); precedence is
    ``~`` > ``&`` > ``|``, as in Python. ``str(mask)`` is DSL text that :func:`blocksparse_fa.parse`
    reads back into an equal mask: ``parse(str(m), **m.tensors()) == m`` (tensors and callables
    travel by the names the text gives them). Expressions nest at most ``MAX_DEPTH - 1`` levels.
    """

    __slots__ = ("_cached_key", "_cached_hash", "_cached_text")

    # ---- algebra -------------------------------------------------------------------------
    def __and__(self, other: "Mask") -> "Mask":
        return And.of(self, _as_mask(other, "&"))

    def __or__(self, other: "Mask") -> "Mask":
        return Or.of(self, _as_mask(other, "|"))

    def __invert__(self) -> "Mask":
        return Not(self)

    def __rand__(self, other):
        return And.of(_as_mask(other, "&"), self)

    def __ror__(self, other):
        return Or.of(_as_mask(other, "|"), self)

    def __bool__(self):
        raise TypeError("a Mask has no truth value; combine masks with &, | and ~ (not and/or/not)")

    # ---- structure -----------------------------------------------------------------------
    def _key(self) -> tuple:
        raise NotImplementedError

    def _ckey(self) -> tuple:
        """``_key()``, computed once (expressions are immutable)."""
        try:
            return self._cached_key
        except AttributeError:
            self._cached_key = self._key()
            return self._cached_key

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Mask) and self._ckey() == other._ckey())

    def __hash__(self) -> int:
        try:
            return self._cached_hash
        except AttributeError:
            self._cached_hash = hash(self._ckey())
            return self._cached_hash

    @property
    def depth(self) -> int:
        """Operator levels above the deepest leaf (0 for a primitive)."""
        return 0

    @property
    def children(self) -> tuple["Mask", ...]:
        return ()

    def leaves(self) -> Iterator["Mask"]:
        """All primitives of the expression, left to right."""
        if not self.children:
            yield self
        for c in self.children:
            yield from c.leaves()

    def nodes(self) -> Iterator["Mask"]:
        """Every node of the expression, parents before their operands, left to right."""
        yield self
        for c in self.children:
            yield from c.nodes()

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """``()`` for masks shared by every batch and head, else ``(B, H)`` (1 where shared)."""
        return broadcast_batch_shapes(node._own_batch_shape() for node in self.nodes())

    def _own_batch_shape(self) -> tuple[int, ...]:
        return ()

    # ---- text ----------------------------------------------------------------------------
    _PREC = 3  # binding strength: Or 1, And 2, Not/primitive 3

    def _text(self, names: dict) -> str:
        raise NotImplementedError

    def _tensor_items(self) -> list:
        """``(default name, identity key, value)`` of each tensor (or callable) a leaf holds; the
        text names them (see :meth:`tensors`)."""
        return []

    def _names(self) -> "_Names":
        """Variable names of the expression's tensors: identity key -> name. The first tensor with
        a default name gets that name (``document``), different ones after it ``document_2``, ..."""
        names = _Names()
        used: dict = {}
        for node in self.nodes():
            for default, ident, _ in node._tensor_items():
                if ident in names:
                    continue
                n = used.get(default, 0) + 1
                used[default] = n
                names[ident] = default if n == 1 else f"{default}_{n}"
        return names

    def tensors(self) -> dict:
        """The variables :func:`blocksparse_fa.parse` needs to read ``str(self)`` back:
        ``parse(str(m), **m.tensors()) == m`` holds for every mask (tensors, and the callables of
        ``mask_mod``, by the names the text uses)."""
        names = self._names()
        out = {}
        for node in self.nodes():
            for _, ident, value in node._tensor_items():
                out.setdefault(names[ident], value)
        return out

    def __str__(self) -> str:
        # computed once (expressions are immutable) and, for operators and most primitives, when
        # built: under torch.compile a mask is then read as its text, a constant, so that one compiled
        # function called with masks whose integers differ never traces those integers as symbols
        try:
            return self._cached_text
        except AttributeError:
            self._cached_text = self._text(self._names())
            return self._cached_text

    def __repr__(self) -> str:
        return f"Mask({str(self)!r})"

    # ---- semantics -----------------------------------------------------------------------
    def _eval(self, ctx: EvalContext) -> torch.Tensor:
        raise NotImplementedError

    def check_lengths(self, q_len: int, kv_len: int) -> None:
        """Raise ``ValueError`` if a tensor-backed primitive does not fit these lengths."""
        _check_length("q_len", q_len)
        _check_length("kv_len", kv_len)
        for leaf in self.leaves():
            leaf._check_lengths(q_len, kv_len)

    def _check_lengths(self, q_len: int, kv_len: int) -> None:
        pass

    def check_batch(self, B: int, H: int) -> None:
        """Raise ``ValueError`` naming the primitive and the argument when a per-batch or per-head
        parameter does not hold ``B`` (or one) batch values and ``H`` (or one) head values, also
        where all its values are equal (the mask then keeps one value, but not the length)."""
        for prim, arg, shape in self.batch_params():
            check_param_batch(prim, arg, shape, B, H)

    def batch_params(self) -> tuple:
        """``(primitive, argument, (Bp, Hp))`` of every parameter given per batch or per head."""
        return tuple(p for node in self.nodes() for p in node._batch_params())

    def _batch_params(self) -> list:
        return []

    def context(self, q_len: int, kv_len: int, device=None, align: str = "bottom_right") -> EvalContext:
        """The full ``(q_len, kv_len)`` evaluation grid (with ``(B, H)`` dims if the mask has them)."""
        dev = torch.device("cpu") if device is None else torch.device(device)
        i = torch.arange(q_len, device=dev).view(q_len, 1)
        j = torch.arange(kv_len, device=dev).view(1, kv_len)
        b = h = None
        bs = self.batch_shape
        if bs:
            b = torch.arange(bs[0], device=dev).view(bs[0], 1, 1, 1)
            h = torch.arange(bs[1], device=dev).view(1, bs[1], 1, 1)
        return EvalContext(q_len, kv_len, i, i + query_offset(q_len, kv_len, align), j, b, h)

    def to_dense(self, q_len: int, kv_len: int | None = None, *, device=None,
                 align: str = "bottom_right") -> torch.Tensor:
        """Materialise the mask: the reference semantics.

        Args:
            q_len: number of query rows.
            kv_len: number of keys (default ``q_len``).
            device: device of the result (default CPU, or that of the mask's tensors).
            align: ``"bottom_right"`` (query row ``i`` at position ``i + kv_len - q_len``) or
                ``"top_left"`` (at position ``i``).

        Returns:
            ``torch.bool`` of shape ``(q_len, kv_len)``, or ``(B, H, q_len, kv_len)`` when the mask
            has batch/head dims (``B`` or ``H`` is 1 where the mask is shared).
        """
        kv_len = q_len if kv_len is None else kv_len
        self.check_lengths(q_len, kv_len)
        if device is None:
            device = next((leaf._device() for leaf in self.leaves() if leaf._device() is not None), None)
        ctx = self.context(q_len, kv_len, device, align)
        out = self._eval(ctx)
        shape = (*self.batch_shape, q_len, kv_len)
        return out.expand(shape).contiguous()

    def _device(self):
        return None

    # ---- inspection (delegates to the compiler, which registers itself: no import of it here) --
    def compile(self, q_len: int, kv_len: int | None = None, block_size=128, **kw):
        """Shorthand for :func:`blocksparse_fa.compile_mask`."""
        if _COMPILER[0] is None:
            raise RuntimeError("no mask compiler registered: import blocksparse_fa (blocksparse_fa.compiler)")
        return _COMPILER[0](self, q_len, q_len if kv_len is None else kv_len, block_size=block_size, **kw)

    def density(self, q_len: int, kv_len: int | None = None) -> float:
        """Fraction of kept (query, key) pairs, computed block-wise (no ``q_len × kv_len`` tensor)."""
        return self.compile(q_len, kv_len).element_density()

    def show(self, q_len: int, kv_len: int | None = None, block_size=128, width: int = 64) -> str:
        """ASCII picture of the block layout (``#`` full, ``+`` partial, ``.`` empty)."""
        return self.compile(q_len, kv_len, block_size).ascii(width=width)

    def plot(self, path, q_len: int, kv_len: int | None = None, block_size=128):
        """Save a PNG of the block layout (matplotlib)."""
        return self.compile(q_len, kv_len, block_size).plot(path)


_COMPILER: list = [None]


def register_compiler(fn) -> None:
    """Called by :mod:`blocksparse_fa.compiler`: the function behind :meth:`Mask.compile`."""
    _COMPILER[0] = fn


def _check_depth(children) -> int:
    d = 0
    for c in children:  # a plain loop: Dynamo traces it when masks are built inside torch.compile
        if c.depth > d:
            d = c.depth
    d += 1
    if d > MAX_DEPTH - 1:
        raise ValueError(
            f"mask expression nested deeper than {MAX_DEPTH - 1} operator levels (the text DSL reads at most "
            f"{MAX_DEPTH}); build wide expressions flat instead, e.g. Or.of(*terms) or And.of(*terms)")
    return d


def _same_ident(a: tuple, b: tuple) -> bool:
    """Whether two identity keys of :meth:`Mask._tensor_items` name the same tensor: traced keys
    ``("object", name, tensor)`` by the tensor object, the others by value."""
    if a[0] == "object" or b[0] == "object":
        return a[0] == b[0] and a[1] == b[1] and a[2] is b[2]
    return a == b


class _Names:
    """Identity key -> variable name of :meth:`Mask._names`, kept as a list: traced keys hold the
    tensor object itself, which a dict would hash by ``id()``, and torch.compile (2.11) cannot take
    the ``id()`` of a tensor made inside the compiled function (a mask's ids are its own copy)."""

    __slots__ = ("_items",)

    def __init__(self):
        self._items: list = []

    def _find(self, ident):
        for key, name in self._items:
            if _same_ident(key, ident):
                return name
        return None

    def __contains__(self, ident) -> bool:
        return self._find(ident) is not None

    def __getitem__(self, ident) -> str:
        name = self._find(ident)
        if name is None:
            raise KeyError(ident)
        return name

    def __setitem__(self, ident, name: str) -> None:
        self._items.append((ident, name))


def _as_mask(x, op: str) -> Mask:
    if not isinstance(x, Mask):
        raise TypeError(f"cannot combine a Mask with {type(x).__name__} using '{op}'")
    return x


class _NAry(Mask):
    __slots__ = ("_children", "_depth")
    _OP = ""

    def __init__(self, children):
        children = tuple(children)
        if len(children) < 2:
            raise ValueError(f"{type(self).__name__} needs at least two operands")
        for c in children:
            _as_mask(c, self._OP)
        self._depth = _check_depth(children)
        self._children = children
        str(self)

    @property
    def depth(self) -> int:
        return self._depth

    @classmethod
    def of(cls, *items: Mask) -> Mask:
        flat: list[Mask] = []
        for it in items:
            flat.extend(it.children if type(it) is cls else (it,))
        return cls(flat)

    @property
    def children(self):
        return self._children

    def _key(self):
        return (type(self).__name__, tuple(c._ckey() for c in self._children))

    def _text(self, names) -> str:
        parts = []
        for c in self._children:
            t = c._text(names)
            parts.append(f"({t})" if c._PREC <= self._PREC else t)
        return f" {self._OP} ".join(parts)


class And(_NAry):
    """Keeps a pair when every operand keeps it."""

    __slots__ = ()
    _OP = "&"
    _PREC = 2

    def _eval(self, ctx):
        out = self._children[0]._eval(ctx)
        for c in self._children[1:]:
            out = out & c._eval(ctx)
        return out


class Or(_NAry):
    """Keeps a pair when any operand keeps it."""

    __slots__ = ()
    _OP = "|"
    _PREC = 1

    def _eval(self, ctx):
        out = self._children[0]._eval(ctx)
        for c in self._children[1:]:
            out = out | c._eval(ctx)
        return out


class Not(Mask):
    """Keeps exactly the pairs its operand drops."""

    __slots__ = ("_child", "_depth")
    _PREC = 3

    def __init__(self, child: Mask):
        self._child = _as_mask(child, "~")
        self._depth = _check_depth((self._child,))
        str(self)

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def children(self):
        return (self._child,)

    def _key(self):
        return ("Not", self._child._ckey())

    def _text(self, names) -> str:
        t = self._child._text(names)
        return f"~({t})" if self._child._PREC < 3 else f"~{t}"

    def _eval(self, ctx):
        return ~self._child._eval(ctx)
