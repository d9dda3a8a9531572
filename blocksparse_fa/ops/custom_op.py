"""Block-sparse attention as a ``torch.library`` custom op, so ``torch.compile`` traces it.

Two ops are registered in the ``blocksparse_fa`` namespace::

    blocksparse_fa::attention_fwd(Tensor q, Tensor k, Tensor v, int handle, float scale,
                                  float dropout_p, Tensor? seed, str backend, bool rewrite,
                                  str align, Tensor[] mask_tensors, Tensor? slopes,
                                  Tensor? softcap, Tensor? bias, str kernel_options)
                                  -> (Tensor out, Tensor lse)
    blocksparse_fa::attention_bwd(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout,
                                  Tensor? dlse, int handle, float scale, float dropout_p, Tensor? seed,
                                  str backend, bool rewrite, str align, Tensor[] mask_tensors,
                                  Tensor? slopes, Tensor? softcap, Tensor? bias, bool slopes_grad,
                                  bool bias_grad, str kernel_options)
                                  -> (Tensor dq, Tensor dk, Tensor dv, Tensor dslopes, Tensor dbias)

``kernel_options`` is the call's :class:`~blocksparse_fa.KernelOptions` as its canonical string
(:meth:`~blocksparse_fa.KernelOptions.encode`, ``""`` for the defaults): a constant of the graph,
decoded (cached) inside the op, so compiled and eager calls run the same kernels
(:mod:`blocksparse_fa.ops.select`).

``align`` places the queries (``"bottom_right"`` or ``"top_left"``, see
:func:`blocksparse_fa.attention`); the registry compiles one layout per alignment.

Each has a fake (meta) implementation, and ``attention_fwd`` has registered autograd whose backward
*is* ``attention_bwd``: a graph compiled with ``torch.compile(fullgraph=True)`` (forward and the
AOT-autograd backward) holds two opaque op calls and no Python. The ops run the PyTorch backend
(``blocksparse_fa.ops.torch_backend``) on CPU (and for float64), and the Triton kernels of
``blocksparse_fa.ops.triton_backend`` (``triton_forward``/``triton_backward``, imported lazily) for
CUDA tensors.

The layout registry (why ops take an ``int`` handle)
---------------------------------------------------
A custom op's arguments are tensors and scalars: a :class:`~blocksparse_fa.Mask` or a compiled
:class:`~blocksparse_fa.BlockLayout` cannot cross the op boundary. So masks live in a process-wide
:class:`LayoutRegistry` and the op receives an integer **handle**:

* A handle names a *mask at a block size* — not a layout. The lengths come from q/k's shapes and
  the device from the tensors, inside the op. One handle therefore serves every sequence length and
  device, and a compiled graph does not have to be re-specialised when only shapes change (dynamic
  shapes work: the fake implementations need shapes only).
* Each registry entry caches the layouts compiled for it, keyed on ``(q_len, kv_len, device, align)``
  (a small LRU per entry, on top of :func:`~blocksparse_fa.compile_mask`'s own cache). This is the
  per-length/per-device layout cache used by :mod:`blocksparse_fa.nn` (and per alignment).
* Registration is idempotent: an equal mask (masks compare structurally; tensor-backed masks by a
  content hash) at the same block size gets the same handle, so re-creating ``causal() &
  window(256)`` each step does not grow the registry. A compiled ``BlockLayout`` registers as itself
  (it is used for its own lengths only).
* Entries are held strongly (``Mask`` objects cannot be weakly referenced: they use ``__slots__``)
  in an LRU bounded by ``capacity`` entries and by ``max_bytes`` of mask tensors (document ids,
  dense masks); entries are touched on every op call, so live masks stay. An
  entry can be **pinned** (never evicted); the :mod:`blocksparse_fa.nn` modules pin their handle
  for the module's lifetime (released by a ``weakref.finalize`` on the module). Calling the op with
  an evicted handle raises a clear error rather than running with the wrong mask.
* Under ``torch.compile`` the Python-side lookup ``Mask -> handle`` is done at trace time
  (``torch.compiler.assume_constant_result``): the handle is a constant of the graph and Dynamo
  guards on the mask object, so a *different* mask object re-traces. Inside compiled code keep the
  mask a long-lived object (e.g. a module attribute), or pass a handle from :func:`register_mask`.

Dropout under compile: the seed is an ``int64`` scalar *tensor* argument, so drawing a fresh seed
(``torch.randint``) is part of the graph rather than a graph-breaking ``.item()``.

Score modifiers travel as tensor arguments: the ALiBi slopes ``(H,)``, the soft-cap ``(1,)``
float32 and the bias as its 4-D broadcast view (:meth:`~blocksparse_fa.ScoreMod.bind`), all on
q's device (the kernels read them from memory). New values are new tensor values, not new graphs;
a soft-cap given as a Python float recompiles once when it first changes (Dynamo then traces the
float as dynamic, and it becomes a tensor inside the graph). The backward returns the slopes' and the bias' gradients
(``dslopes``/``dbias``, empty when not wanted). Flex-style ``score_fn`` callables cannot cross the
op boundary: they run eagerly on the PyTorch backend only.

Exact mask rewrites apply inside the ops as in :func:`blocksparse_fa.attention`. On the Triton
backend without dropout, a registered strided mask runs as band plus residue classes
(``ops/residue.py``), in both ``attention_fwd`` and ``attention_bwd``.

The logsumexp output is non-differentiable (its incoming gradient is ignored), as in
:func:`blocksparse_fa.attention`. It is float32 (float64 for float64 inputs, so that the float64
backward recomputes probabilities exactly); :func:`attention_op` returns it as float32.
"""

from __future__ import annotations

import collections
import math
import threading
import weakref
from dataclasses import dataclass, field, replace

import torch

from .._oplib import custom_op
from ..compiler.compile import block_pair as _block_pair
from ..compiler.compile import compile_mask
from ..compiler.layout import BlockLayout
from ..mask.dsl import parse
from ..mask.expr import Mask
from ..mask.primitives import full, mask_mod
from ..mask.score import ScoreMod, check_score_mod
from . import dispatch
from .options import as_options, decode_options
from .prepare import (check_align, check_mask_for, constant_result, draw_seed, encoded_options, resolve_backend,
                      seed_tensor)
from .route import device_intervals, run
from .validate import check_layout, check_qkv, check_scalars, like_sdpa_under_autocast

_encoded, _seed_tensor = encoded_options, seed_tensor  # their names here before ops/prepare.py held them

__all__ = [
    "attention_op", "register_mask", "LayoutRegistry", "registry", "attention_fwd", "attention_bwd",
]


@dataclass(frozen=True)
class _Template:
    """A mask's DSL text whose tensors travel with each op call, under these names."""

    text: str
    names: tuple


@dataclass
class _Entry:
    source: object  # a Mask, or a BlockLayout registered as itself
    block_size: tuple
    layouts: "collections.OrderedDict[tuple, BlockLayout]" = field(default_factory=collections.OrderedDict)
    pins: int = 0
    nbytes: int = 0  # bytes of the tensors the mask holds (document ids, dense masks, ...)


def _tensor_bytes(source) -> int:
    mask = source.mask if isinstance(source, BlockLayout) else source
    total = 0
    for leaf in mask.leaves():
        t = getattr(leaf, "tensor", None)
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def _template_key(ckey: tuple, tensors) -> tuple:
    return ckey + tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), str(t.device)) for t in tensors)


def _template_hit(store, ckey: tuple, tensors) -> BlockLayout | None:
    """The layout a template handle compiled for ``ckey`` from tensors over the same memory (same
    address, dtype, shape and strides) that no in-place operation changed since (version counters
    equal), or None. A mask made once outside a compiled function hands the op its own tensors
    every step (the backward gets aliases of them, which share the version counters); several such
    masks of one structure share the handle, each under its own tensors; per-step tensors miss.
    The kept tensors hold their memory, so no other tensor can be allocated at their addresses.
    As for every cache keyed on version counters, a write that bypasses them (through ``.data``
    or a NumPy view) goes unnoticed: replace such tensors instead of writing into them."""
    key = _template_key(ckey, tensors)
    hit = store.get(key)
    if hit is None:
        return None
    kept, stamps, lay = hit
    if all(b._version == v for b, v in zip(tensors, stamps)):
        store.move_to_end(key)
        return lay
    return None


def _template_keep(store, ckey: tuple, tensors, lay: BlockLayout, limit: int) -> None:
    """Remember ``lay`` for :func:`_template_hit` (at most ``limit`` per handle), holding the tensors."""
    key = _template_key(ckey, tensors)
    store[key] = (tuple(tensors), tuple(t._version for t in tensors), lay)
    store.move_to_end(key)
    while len(store) > limit:
        store.popitem(last=False)


class LayoutRegistry:
    """Process-wide map ``int handle -> (mask, block size)`` with per-entry layout caches.

    Args:
        capacity: unpinned entries kept (least recently used evicted first).
        max_bytes: unpinned entries are also evicted while the tensors their masks hold (document ids,
            dense masks) add up to more than this.
        layouts_per_entry: compiled layouts cached per entry, keyed on ``(q_len, kv_len, device)``.
    """

    def __init__(self, capacity: int = 1024, max_bytes: int = 256 << 20, layouts_per_entry: int = 8):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.layouts_per_entry = layouts_per_entry
        self._entries: "collections.OrderedDict[int, _Entry]" = collections.OrderedDict()
        self._by_key: dict = {}
        self._next = 1
        self._lock = threading.RLock()
        self.generation = 0  # counts drops (entries evicted or cleared, layouts evicted): see ``_layout``

    @staticmethod
    def _key(source, block_size):
        if isinstance(source, BlockLayout):
            return ("layout", id(source))
        return ("mask", source, block_size)

    def register_template(self, text: str, names: tuple, block_size) -> int:
        """Handle of a mask given as DSL text whose tensors (``names``) come with every op call: a
        tensor-holding mask built inside a compiled function (per-step document ids)."""
        src = _Template(text, tuple(names))
        key = self._key(src, _block_pair(block_size))
        with self._lock:
            h = self._by_key.get(key)
            if h is None:
                h = self._next
                self._next += 1
                self._entries[h] = _Entry(src, _block_pair(block_size))
                self._by_key[key] = h
                self._evict(keep=h)
            self._entries.move_to_end(h)
            return h

    def register(self, mask, block_size=None) -> int:
        """Handle of ``mask`` (a Mask, DSL text / pattern name, BlockLayout or ``None`` = dense)."""
        if mask is None:
            mask = full()
        if isinstance(mask, str):
            mask = parse(mask)
        if callable(mask) and not isinstance(mask, (Mask, BlockLayout, torch.Tensor)):
            mask = mask_mod(mask)  # a FlexAttention-style mask_mod callable
        if isinstance(mask, BlockLayout):
            if block_size is not None and _block_pair(block_size) != tuple(mask.block_size):
                raise ValueError(f"block_size={block_size!r} conflicts with the layout's block size {mask.block_size}")
            bs = tuple(mask.block_size)
        elif isinstance(mask, Mask):
            bs = _block_pair(block_size)
        else:
            raise TypeError(f"mask must be a Mask, BlockLayout, DSL text or None, got {type(mask).__name__}")
        key = self._key(mask, bs)
        with self._lock:
            h = self._by_key.get(key)
            if h is not None:
                self._entries.move_to_end(h)
                return h
            h = self._next
            self._next += 1
            self._entries[h] = _Entry(mask, bs, nbytes=_tensor_bytes(mask))
            self._by_key[key] = h
            self._evict(keep=h)
            return h

    def _evict(self, keep: int | None = None) -> None:
        """Drop least recently used unpinned entries beyond ``capacity`` / ``max_bytes`` (never ``keep``)."""
        unpinned = [h for h, e in self._entries.items() if e.pins == 0 and h != keep]
        n = len(unpinned) + (keep is not None and self._entries[keep].pins == 0)
        size = sum(self._entries[h].nbytes for h in unpinned)
        if keep is not None and self._entries[keep].pins == 0:
            size += self._entries[keep].nbytes
        for h in unpinned:
            if n <= self.capacity and size <= self.max_bytes:
                break
            e = self._entries.pop(h)
            self._by_key.pop(self._key(e.source, e.block_size), None)
            self.generation += 1
            n -= 1
            size -= e.nbytes

    def pin(self, handle: int) -> None:
        """Keep ``handle`` registered until a matching :meth:`unpin`."""
        with self._lock:
            self._entry(handle).pins += 1

    def unpin(self, handle: int) -> None:
        with self._lock:
            e = self._entries.get(handle)
            if e is not None and e.pins > 0:
                e.pins -= 1
                self._evict()

    def _entry(self, handle: int) -> _Entry:
        e = self._entries.get(handle)
        if e is None:
            raise KeyError(f"blocksparse_fa: unknown or evicted mask handle {handle}; register the mask again "
                           f"(register_mask), pin it (registry.pin) or raise registry.capacity")
        return e

    def source(self, handle: int):
        """What was registered under ``handle``: a Mask, or a BlockLayout registered as itself."""
        with self._lock:
            return self._entry(handle).source

    def mask(self, handle: int) -> Mask:
        """The mask registered under ``handle``."""
        with self._lock:
            src = self._entry(handle).source
        return src.mask if isinstance(src, BlockLayout) else src

    def block_size(self, handle: int) -> tuple:
        with self._lock:
            return self._entry(handle).block_size

    def layout(self, handle: int, q_len: int, kv_len: int | None = None, device=None,
               align: str = "bottom_right", tensors=None) -> BlockLayout:
        """The layout of ``handle`` for ``(q_len, kv_len)`` and ``align`` with lookup tables on
        ``device`` (cached); ``tensors``: the tensors of a template handle, in its names' order."""
        kv_len = q_len if kv_len is None else kv_len
        dev = torch.device("cpu" if device is None else device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        ckey = (int(q_len), int(kv_len), str(dev), align)
        with self._lock:
            e = self._entry(handle)
            src, bs = e.source, e.block_size
            if isinstance(src, _Template):  # the mask's tensors come with each call
                if not tensors or len(tensors) != len(src.names):
                    raise ValueError(f"mask handle {handle} needs the tensors {src.names} with each call")
                lay = _template_hit(e.layouts, ckey, tensors)
                if lay is not None:
                    return lay
            else:
                self._entries.move_to_end(handle)
                lay = e.layouts.get(ckey)
                if lay is not None:
                    e.layouts.move_to_end(ckey)
                    return lay
        if isinstance(src, _Template):  # new tensors (per-step ids) or modified ones: parse and compile
            mask = parse(src.text, **dict(zip(src.names, tensors)))
            lay = compile_mask(mask, ckey[0], ckey[1], bs, device=dev, align=check_align(align))
            with self._lock:
                _template_keep(e.layouts, ckey, tensors, lay, self.layouts_per_entry)
            return lay
        if isinstance(src, BlockLayout):
            if (src.q_len, src.kv_len) != (ckey[0], ckey[1]):
                raise ValueError(f"mask layout was compiled for (q_len, kv_len) = ({src.q_len}, {src.kv_len}), "
                                 f"but q/k have lengths ({ckey[0]}, {ckey[1]})")
            check_align(align, src)
            lay = src.to(dev)
        else:
            lay = compile_mask(src, ckey[0], ckey[1], bs, device=dev, align=check_align(align))
        with self._lock:
            e.layouts[ckey] = lay
            while len(e.layouts) > self.layouts_per_entry:
                e.layouts.popitem(last=False)
                self.generation += 1
        return lay

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, handle) -> bool:
        return handle in self._entries

    def clear(self) -> None:
        """Forget every unpinned entry."""
        with self._lock:
            for h in [h for h, e in self._entries.items() if e.pins == 0]:
                e = self._entries.pop(h)
                self._by_key.pop(self._key(e.source, e.block_size), None)
            self.generation += 1


registry = LayoutRegistry()
"""The process-wide registry used by the ops."""


def register_mask(mask, block_size=None, *, pin: bool = False, owner=None) -> int:
    """Register ``mask`` (Mask, DSL text, BlockLayout or None) and return its int handle.

    Args:
        pin: keep the entry until ``registry.unpin(handle)``.
        owner: pin while ``owner`` is alive (unpinned by ``weakref.finalize`` when it is collected).
    """
    h = handle_of(mask, block_size) if isinstance(mask, BlockLayout) else registry.register(mask, block_size)
    if pin or owner is not None:
        registry.pin(h)
    if owner is not None:
        weakref.finalize(owner, registry.unpin, h)
    return h


@constant_result
def _handle_for(mask, block_size):
    # Trace-time constant under torch.compile (Dynamo guards on the mask object): for masks made
    # outside the compiled function, and for compiled layouts.
    return registry.register(mask, block_size)


@constant_result
def _handle_for_text(text: str, block_size):
    # Trace-time constant from the mask's DSL text: masks built inside a compiled function are
    # objects Dynamo creates lazily, but their text is an ordinary constant.
    return registry.register(parse(text), block_size)


@constant_result
def _handle_for_template(text: str, names: tuple, block_size):
    # Trace-time constant: a tensor-holding mask built inside a compiled function is its text plus
    # tensors that become op inputs (e.g. document ids that change every step).
    return registry.register_template(text, names, block_size)


def mask_handle(mask, block_size=None) -> tuple[int, list | None]:
    """``(handle, tensors)``: :func:`handle_of`, except that under ``torch.compile`` a Mask that holds
    tensors becomes a template handle plus its tensors (graph inputs of the op), so it may be built
    inside the compiled function from that step's tensors."""
    if torch.compiler.is_compiling() and isinstance(mask, Mask):
        tensors = mask.tensors()
        if tensors:
            names = tuple(tensors)
            return _handle_for_template(str(mask), names, _block_pair(block_size)), [tensors[n] for n in names]
    return handle_of(mask, block_size), None


def _has_tensors(mask) -> bool:
    """Whether the expression holds tensors (their text does not carry the data)."""
    if mask.children:
        return any(_has_tensors(c) for c in mask.children)
    return hasattr(mask, "tensor")


def handle_of(mask, block_size=None) -> int:
    """The registry handle of ``mask`` (an int handle, Mask, DSL text, BlockLayout or None); under
    ``torch.compile`` a constant of the graph."""
    if isinstance(mask, int) and not isinstance(mask, bool):
        return mask
    if not torch.compiler.is_compiling():
        h = registry.register(mask, block_size)
        if isinstance(mask, BlockLayout):
            mask.__dict__["_handle"] = h  # read under torch.compile (an int attribute is a constant there)
        return h
    if isinstance(mask, BlockLayout):
        h = mask.__dict__.get("_handle")
        if h is not None:
            return h
        if _has_tensors(mask.mask):
            raise ValueError("a compiled layout of a mask that holds tensors must be used once outside "
                             "torch.compile (or registered with register_mask) before a compiled function uses it")
        return _handle_for_text(str(mask.mask), tuple(mask.block_size))
    if isinstance(mask, Mask) and not _has_tensors(mask):
        return _handle_for_text(str(mask), _block_pair(block_size))
    return _handle_for(mask, block_size)


# ------------------------------------------------------------------------------------------------
# the ops
# ------------------------------------------------------------------------------------------------
_CALLS: dict = {}  # (handle, align, shapes, dtypes, device) -> (Shapes, layout, registry generation)
_CALLS_MAX = 256


def _layout(q, k, v, handle, align, tensors=None):
    """``(Shapes, layout)`` of an op call, its inputs checked. Every check is a function of the
    handle, the alignment and the inputs' shapes, dtypes and device, so a repeated call (every step
    of a compiled model) is answered from ``_CALLS`` until the registry drops anything."""
    key = None
    if not tensors:  # a template's layout depends on its tensors' values
        key = (handle, align, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device)
        hit = _CALLS.get(key)
        if hit is not None and hit[2] == registry.generation:
            return hit[0], hit[1]
    s = check_qkv(q, k, v)
    gen = registry.generation
    layout = registry.layout(handle, s.Lq, s.Lk, q.device, align, tensors)
    check_layout(layout, s)
    if key is not None:
        if len(_CALLS) >= _CALLS_MAX:
            _CALLS.clear()
        _CALLS[key] = (s, layout, gen)
    return s, layout


def _score_mod_of(slopes, softcap, bias):
    """The ScoreMod an op call describes (None without modifier)."""
    if slopes is None and softcap is None and bias is None:
        return None
    return ScoreMod(slopes=slopes, cap=softcap, bias=bias)


@custom_op("blocksparse_fa::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: int, scale: float,
                  dropout_p: float, seed: torch.Tensor | None, backend: str,
                  rewrite: bool, align: str, mask_tensors: list[torch.Tensor], slopes: torch.Tensor | None,
                  softcap: torch.Tensor | None, bias: torch.Tensor | None,
                  kernel_options: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out (B, H, Lq, D) in q's dtype, lse (B, H, Lq))``. ``seed``: int64 CPU scalar
    tensor with dropout, else None (no CPU tensor in the graph: CUDA graphs stay possible).
    ``mask_tensors``: the tensors of a template handle (masks built inside a compiled function).
    ``slopes`` ``(H,)``, ``softcap`` ``(1,)``, ``bias`` (4-D, size-1 dims broadcast): the score
    modifier. ``kernel_options``: :meth:`KernelOptions.encode` of the call's options."""
    s, layout = _layout(q, k, v, handle, align, mask_tensors)
    be = resolve_backend(backend, q.device, q.dtype)
    out, lse = dispatch.forward(q, k, v, layout, s, scale, dropout_p, _seed(seed), be, rewrite,
                                score_mod=_score_mod_of(slopes, softcap, bias), opts=decode_options(kernel_options))
    return out.contiguous(), lse.contiguous()


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, handle, scale, dropout_p, seed, backend, rewrite, align, mask_tensors, slopes,
                        softcap, bias, kernel_options):
    B, H, Lq, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Lq), dtype=dispatch.lse_dtype(q.dtype), device=q.device)
    return out, lse


@custom_op("blocksparse_fa::attention_bwd", mutates_args=())
def attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dout: torch.Tensor, dlse: torch.Tensor | None, handle: int, scale: float, dropout_p: float,
                  seed: torch.Tensor | None, backend: str,
                  rewrite: bool, align: str,
                  mask_tensors: list[torch.Tensor], slopes: torch.Tensor | None, softcap: torch.Tensor | None,
                  bias: torch.Tensor | None, slopes_grad: bool, bias_grad: bool, kernel_options: str,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: ``(dq, dk, dv, dslopes, dbias)``: dq, dk, dv shaped like q, k, v (k/v gradients
    summed over GQA groups); the gradients of the slopes and the bias when ``slopes_grad`` /
    ``bias_grad`` (shaped and typed like them), else empty tensors."""
    s, layout = _layout(q, k, v, handle, align, mask_tensors)
    be = resolve_backend(backend, q.device, q.dtype)
    mod = _score_mod_of(slopes, softcap, bias)
    grads = None if mod is None else dispatch.score_grad_buffers(mod, slopes_grad, bias_grad, q.dtype, q.device)
    dq, dk, dv = dispatch.backward(q, k, v, out, lse, dout, layout, s, scale, dropout_p, _seed(seed), be,
                                   dlse=dlse, use_rewrite=rewrite, score_mod=mod, score_grads=grads,
                                   opts=decode_options(kernel_options))
    dsl, db = grads or (None, None)
    dsl = dsl.to(slopes.dtype) if dsl is not None else q.new_empty(0)
    db = db.to(bias.dtype) if db is not None else q.new_empty(0)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsl, db


@attention_bwd.register_fake
def _attention_bwd_fake(q, k, v, out, lse, dout, dlse, handle, scale, dropout_p, seed, backend, rewrite,
                        align, mask_tensors, slopes, softcap, bias, slopes_grad, bias_grad, kernel_options):
    like = lambda t, want: torch.empty(t.shape, dtype=t.dtype, device=t.device) if want else q.new_empty(0)  # noqa: E731
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device),
            like(slopes, slopes_grad), like(bias, bias_grad))


def _seed(seed) -> int:
    return 0 if seed is None else int(seed.item())


def _setup_context(ctx, inputs, output):
    (q, k, v, handle, scale, dropout_p, seed, backend, rewrite, align, mask_tensors, slopes, softcap, bias,
     kernel_options) = inputs
    out, lse = output
    # an output the graph does not use (the logsumexp unless asked for) gets None, not zeros: no
    # zeros tensor to build and fold into the backward's delta
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, out, lse, seed, slopes, softcap, bias, *mask_tensors)
    ctx.args = (handle, scale, dropout_p)
    ctx.backend, ctx.rewrite, ctx.align, ctx.kernel_options = backend, rewrite, align, kernel_options
    ctx.score_grad = (slopes is not None and slopes.requires_grad, bias is not None and bias.requires_grad)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, seed, slopes, softcap, bias, *mts = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsl, db = torch.ops.blocksparse_fa.attention_bwd(
        q, k, v, out, lse, dout, dlse, *ctx.args, seed, ctx.backend, ctx.rewrite, ctx.align, mts, slopes,
        softcap, bias, *ctx.score_grad, ctx.kernel_options)
    return (dq, dk, dv, None, None, None, None, None, None, None, [None] * len(mts),
            dsl if ctx.score_grad[0] else None, None, db if ctx.score_grad[1] else None, None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------
# the public entry point
# ------------------------------------------------------------------------------------------------
@like_sdpa_under_autocast
def attention_op(q, k, v, mask=None, *, scale=None, dropout_p: float = 0.0, dropout_seed=None,
                 return_lse: bool = False, backend: str = "auto", block_size=None, rewrite: bool = True,
                 align: str | None = None, score_mod=None, kernel_options=None):
    """:func:`blocksparse_fa.attention` through the custom op (``torch.compile``-safe).

    Eager calls take the same path as :func:`blocksparse_fa.attention` without the custom-op
    dispatch; under ``torch.compile`` the op is one opaque node of the graph (forward and backward).

    Args:
        q: ``(B, H, Lq, D)``; k, v: ``(B, Hkv, Lk, D)`` and ``(B, Hkv, Lk, Dv)`` with
            ``H % Hkv == 0`` (``Dv != D``: zero-padded as in :func:`blocksparse_fa.attention`).
        mask: a :class:`Mask` (built inside or outside the compiled function), DSL text / pattern
            name, a :class:`BlockLayout`, a ``mask_mod`` callable, ``None`` (dense) or an int
            handle from :func:`register_mask`. Under ``torch.compile`` a mask built inside the
            function from that step's tensors (``causal() & document(ids)``) passes its text as a
            constant and its tensors as op inputs, so new ids reuse the graph; masks whose
            construction reads tensor values (per-head parameters, block or dense masks) must be
            made outside the compiled function.
        scale: softmax scale (default ``1/sqrt(D)``).
        dropout_p: attention dropout probability in ``[0, 1)``.
        dropout_seed: int seed of the counter-based dropout RNG (default: drawn from torch's RNG, as
            a tensor op so that it stays inside a compiled graph).
        return_lse: also return the logsumexp ``(B, H, Lq)`` (float32; differentiable).
        backend: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"triton"`` or ``"torch"``.
        block_size: layout block size (default 128).
        rewrite: allow the compiler's exact rewrites.
        align: ``"bottom_right"`` (default) or ``"top_left"``, as in :func:`blocksparse_fa.attention`
            (a compiled layout keeps its own).
        score_mod: :func:`~blocksparse_fa.alibi`, :func:`~blocksparse_fa.bias`,
            :func:`~blocksparse_fa.softcap` or a sum, as in :func:`blocksparse_fa.attention`; under
            ``torch.compile`` its slopes and bias are tensor arguments of the op (new values reuse
            the graph; slopes given as floats are constants of the graph, give a tensor to vary
            them) and its tensors get gradients. ``score_fn`` callables run eagerly only.
        kernel_options: a :class:`~blocksparse_fa.KernelOptions` or a dict of its fields, as in
            :func:`blocksparse_fa.attention` (a constant of a compiled graph).

    Returns:
        ``out`` ``(B, H, Lq, Dv)`` in q's dtype (and ``lse`` if asked).
    """
    align = check_align(align, mask if isinstance(mask, BlockLayout) else None)
    s = check_qkv(q, k, v, dv_ok=True)
    scale, dropout_p = check_scalars(scale, dropout_p)
    scale = 1.0 / math.sqrt(s.D) if scale is None else scale  # q's and k's head dim, before any padding
    score_mod = check_score_mod(score_mod, s.H)
    if score_mod is not None and score_mod.fn is None:
        score_mod = score_mod.bind((s.B,), s.H, s.Lq, s.Lk, q.device)
    q, k, v, dv = dispatch.pad_head_dims(q, k, v)
    res = device_intervals(q, k, v, mask, replace(s, D=q.shape[-1]), scale, dropout_p, dropout_seed, score_mod,
                           backend, align, return_lse, kernel_options)
    if res is not None:  # e.g. causal() & document(ids): intervals built on the device (ops/interval_backend.py)
        pass
    elif q.device.type == "meta" and not torch.compiler.is_compiling():
        res = _meta(q, k, v, mask, block_size, scale, dropout_p, return_lse, align, score_mod)
    elif not torch.compiler.is_compiling():
        res = _eager(q, k, v, handle_of(mask, block_size), scale, dropout_p, dropout_seed, return_lse, backend,
                     rewrite, align, score_mod, as_options(kernel_options))
    else:
        res = compiled_call(q, k, v, mask, block_size, scale, dropout_p, dropout_seed, return_lse, backend, rewrite,
                            align, score_mod, kernel_options)
    if return_lse:
        return dispatch.slice_head_dim(res[0], dv), res[1]
    return dispatch.slice_head_dim(res, dv)


def compiled_call(q, k, v, mask, block_size, scale: float, dropout_p: float, dropout_seed, return_lse: bool,
                  backend: str, rewrite, align: str, score_mod, kernel_options):
    """The call under ``torch.compile``: one ``attention_fwd`` node of the graph. Inputs as the
    callers have prepared them (checked, one head dim, a bound score modifier, ``align`` checked);
    :func:`blocksparse_fa.attention` comes here directly, so Dynamo traces the checks once."""
    if score_mod is not None and score_mod.fn is not None:
        raise NotImplementedError("score_mod: score_fn() callables run eagerly on the PyTorch backend only; under "
                                  "torch.compile use alibi(), bias() and softcap() (their tensors are op inputs)")
    handle, mask_tensors = mask_handle(mask, block_size)
    out, lse = attention_fwd(q, k, v, handle, scale, dropout_p, seed_tensor(dropout_p, dropout_seed), backend,
                             bool(rewrite), align, mask_tensors or [], *_op_score_args(score_mod, q.shape[1], q.device),
                             encoded_options(kernel_options))
    return (out, lse.float()) if return_lse else out


def _op_score_args(score_mod, H: int, device) -> tuple:
    """``(slopes, softcap, bias)`` op arguments of a bound score modifier: tensors on ``device``
    (constant slopes and a float cap become float32 tensors), None where a term is absent. A
    callable has no op form: it is dropped (meta tensors: shapes only)."""
    if score_mod is None or score_mod.fn is not None:
        return None, None, None
    slopes = cap = None
    if score_mod.slopes is not None:
        slopes = score_mod.slopes if isinstance(score_mod.slopes, torch.Tensor) else \
            score_mod.slopes_tensor(H, device)
    if isinstance(score_mod.cap, torch.Tensor):
        cap = score_mod.cap.detach().to(device=device, dtype=torch.float32).reshape(1)
    elif score_mod.cap is not None:
        cap = torch.full((1,), score_mod.cap, dtype=torch.float32, device=device)
    return slopes, cap, score_mod.bias


def _meta(q, k, v, mask, block_size, scale, dropout_p, return_lse, align, score_mod=None):
    """Meta tensors: shapes and dtypes through the ops' fake implementations (differentiable, so a
    backward on meta tensors gives meta gradients); the mask is checked, not compiled."""
    s = check_qkv(q, k, v)
    check_mask_for(mask, s, block_size, None if isinstance(mask, BlockLayout) else align)
    handle = handle_of(mask, block_size)
    out, lse = attention_fwd(q, k, v, handle, scale, dropout_p, None, "auto", True, align, [],
                             *_op_score_args(score_mod, s.H, q.device), "")
    return (out, lse.float()) if return_lse else out


def _eager(q, k, v, handle: int, scale, dropout_p, dropout_seed, return_lse, backend, rewrite, align="bottom_right",
           score_mod=None, opts=None):
    """The eager path of :func:`attention_op` (and the nn modules): registry layout, then dispatch
    (inputs with one head dim, a checked scale and a bound score modifier)."""
    s, layout = _layout(q, k, v, handle, align)
    be = resolve_backend(backend, q.device, q.dtype)
    if be == "triton" and score_mod is not None and score_mod.fn is not None:
        raise NotImplementedError("score_mod: score_fn() callables run on the PyTorch backend only "
                                  "(backend='torch'); the Triton kernels fuse alibi(), bias() and softcap()")
    seed = draw_seed(dropout_p, int(dropout_seed) if isinstance(dropout_seed, torch.Tensor) else dropout_seed)
    out, lse = run(q, k, v, layout, s, scale, dropout_p, seed, backend, be, bool(rewrite), return_lse, score_mod,
                   opts)
    return (out, lse.float()) if return_lse else out
