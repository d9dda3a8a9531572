"""``attention``: the public entry point. It validates, finds the compiled layout and dispatches.

Eager calls run :mod:`blocksparse_fa.ops.dispatch` through a plain autograd function; under
``torch.compile`` the same path runs inside the ``torch.library`` custom op
(:mod:`blocksparse_fa.ops.custom_op`), which Dynamo traces as one opaque call.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace

import torch

from ..compiler.cache import LRUCache
from ..compiler.compile import block_pair, compile_mask, generation
from ..compiler.layout import BlockLayout
from ..mask.dsl import parse
from ..mask.expr import Mask, query_offset
from ..mask.primitives import full, mask_mod
from ..mask.score import check_score_mod
from . import dispatch
from .dense import dense_forward, inputs_finite, prefer_dense
from .options import as_options
from .validate import (Shapes, bool_mask_to_mask, check_layout, check_qkv, check_scalars, flatten_batch,
                       unflatten_batch)

__all__ = ["attention", "BACKENDS", "resolve_backend", "layout_for", "draw_seed", "triton_available"]

BACKENDS = ("auto", "triton", "torch")
DEFAULT_BLOCK = 128
_log = logging.getLogger("blocksparse_fa")


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    """Whether Triton can be imported (it is imported here, on first use, not with the package)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _require_triton() -> None:
    if not triton_available():
        raise RuntimeError("backend='triton' needs the triton package, which cannot be imported here "
                           "(pip install triton; it has wheels for Linux): use backend='torch', the exact "
                           "PyTorch implementation, or backend='auto'")


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``"triton"`` or ``"torch"`` for this request; clear errors for impossible combinations.

    ``"auto"`` is Triton for CUDA tensors (float16, bfloat16, float32) when triton can be imported,
    the PyTorch backend otherwise (CPU, float64)."""
    if backend == "auto":
        if device.type == "cuda" and dtype != torch.float64:
            if triton_available():
                return "triton"
            _log.warning("blocksparse_fa: triton cannot be imported; CUDA tensors run the PyTorch backend")
        return "torch"
    if backend == "torch":
        return backend
    if backend != "triton":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if dtype == torch.float64:
        raise TypeError("backend='triton' supports float16, bfloat16 and float32; use backend='torch' for float64")
    _require_triton()
    if device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError("backend='triton' on CPU tensors runs the kernels in Triton's interpreter: "
                           "set TRITON_INTERPRET=1 in the environment before Python starts "
                           "(or use backend='torch', the exact CPU implementation)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"backend='triton' needs CUDA (or CPU under TRITON_INTERPRET=1) tensors, got {device}")
    return backend


_BY_ID = LRUCache(256)  # (id(mask), lengths, block, device, rewrite, align) -> (mask, layout): no hashing of the tree


def check_align(align, layout=None) -> str:
    """``align`` (``None``: ``layout``'s own, else ``"bottom_right"``) validated against ``layout``."""
    if layout is not None:
        if align is not None and align != layout.align:
            raise ValueError(f"align={align!r} conflicts with the compiled layout's align={layout.align!r}")
        return layout.align
    align = "bottom_right" if align is None else align
    query_offset(1, 1, align)  # validates it
    return align


def layout_for(mask, s: Shapes, device, block_size=None, rewrite: bool = True, align=None) -> BlockLayout:
    """The compiled layout of ``mask`` (Mask, DSL text, BlockLayout or None) for these shapes."""
    if isinstance(mask, BlockLayout):
        if block_size is not None and tuple(mask.block_size) != block_pair(block_size):
            raise ValueError(f"block_size={block_size!r} conflicts with the layout's block size {mask.block_size}")
        check_align(align, mask)
        check_layout(mask, s)
        return mask
    align = check_align(align)
    key = (id(mask), s.Lq, s.Lk, block_size, device, rewrite, align)
    hit = _BY_ID.get(key)
    if hit is not None and hit[0] is mask and hit[2] == generation():
        check_layout(hit[1], s)  # the key holds no (B, H)
        return hit[1]
    m = as_mask(mask)
    layout = compile_mask(m, s.Lq, s.Lk, block_pair(block_size), device=device, rewrite=rewrite, align=align)
    check_layout(layout, s)
    _BY_ID.put(key, (mask, layout, generation()))
    return layout


def as_mask(mask) -> Mask:
    """``mask`` as a Mask: a Mask, DSL text, a FlexAttention-style ``mask_mod`` callable
    ``fn(b, h, q_idx, kv_idx)`` (wrapped in :func:`~blocksparse_fa.mask_mod`) or None (dense)."""
    if mask is None:
        return full()
    if isinstance(mask, str):
        return parse(mask)
    if isinstance(mask, Mask):
        return mask
    if callable(mask) and not isinstance(mask, (torch.Tensor, BlockLayout)):
        return mask_mod(mask)
    raise TypeError(f"mask must be a Mask, BlockLayout, DSL text, a bool tensor, a mask_mod callable or None, "
                    f"got {type(mask).__name__}")


def check_mask_for(mask, s: Shapes, block_size=None, align=None) -> None:
    """Validate ``mask`` against these shapes without compiling it (used for meta tensors)."""
    if isinstance(mask, BlockLayout):
        if block_size is not None and tuple(mask.block_size) != block_pair(block_size):
            raise ValueError(f"block_size={block_size!r} conflicts with the layout's block size {mask.block_size}")
        check_align(align, mask)
        check_layout(mask, s)
        return
    check_align(align)
    if isinstance(mask, int) and not isinstance(mask, bool):
        return  # a registry handle (attention_op)
    m = as_mask(mask)
    block_pair(block_size)
    m.check_lengths(s.Lq, s.Lk)
    m.check_batch(s.B, s.H)
    if m.batch_shape:
        bm, hm = m.batch_shape
        if bm not in (1, s.B) or hm not in (1, s.H):
            raise ValueError(f"mask batch shape {m.batch_shape} does not fit (B, H) = ({s.B}, {s.H})")


def device_intervals(q, k, v, mask, s: Shapes, scale: float, dropout_p: float, dropout_seed, score_mod, backend: str,
                     align, return_lse: bool, kernel_options=None):
    """The result of the device-interval path (``ops/interval_backend.py``) for masks that hold a
    ``document(ids)`` and keep one key interval per row, or None (the layout path applies)."""
    if not isinstance(mask, Mask):
        return None
    from .interval_backend import try_interval_attention

    return try_interval_attention(q, k, v, mask, s, scale, dropout_p, dropout_seed, score_mod, backend, align,
                                  return_lse, kernel_options)


def draw_seed(dropout_p: float, dropout_seed) -> int:
    """The dropout seed: 0 without dropout, ``dropout_seed`` checked, or one drawn from torch's RNG."""
    if dropout_p == 0.0:
        return 0
    if dropout_seed is None:
        return int(torch.randint(0, 2**62, (1,)).item())
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int) or not 0 <= dropout_seed < 2**62:
        raise ValueError(f"dropout_seed must be an int in [0, 2**62), got {dropout_seed!r}")
    return dropout_seed


def takes_dense_path(q, k, v, layout: BlockLayout, s: Shapes, dropout_p: float, backend: str, be: str,
                     return_lse: bool, score_mod=None) -> bool:
    """Whether a call runs PyTorch's SDPA over the materialised mask (:mod:`blocksparse_fa.ops.dense`):
    ``backend="auto"`` on CPU tensors, no logsumexp or score modifier, the cost model prefers it and
    the inputs are finite."""
    return (backend == "auto" and be == "torch" and not return_lse and q.device.type == "cpu" and score_mod is None
            and prefer_dense(layout, s, dropout_p) and inputs_finite(q, k, v))


def run(q, k, v, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int, backend: str,
        be: str, rewrite: bool, return_lse: bool, score_mod=None, opts=None):
    """``(out, lse or None)`` over a compiled layout: ``be`` is the resolved backend, ``backend`` what
    the caller asked for (``"auto"`` on CPU may take the dense path, :func:`takes_dense_path`);
    ``opts``: the call's :class:`~blocksparse_fa.ops.options.KernelOptions`."""
    if takes_dense_path(q, k, v, layout, s, dropout_p, backend, be, return_lse, score_mod):
        dispatch.note_backend("dense")
        return dense_forward(q, k, v, layout, s, scale), None
    dispatch.note_backend(be)
    return dispatch.apply(q, k, v, layout, s, scale, dropout_p, seed, be, rewrite, score_mod, as_options(opts))


def attention(q, k, v, mask=None, *, scale=None, dropout_p: float = 0.0, dropout_seed=None,
              return_lse: bool = False, backend: str = "auto", block_size=None, rewrite: bool = True,
              enable_gqa: bool = True, align: str | None = None, score_mod=None, kernel_options=None):
    """Block-sparse scaled-dot-product attention.

    Args:
        q: ``(B, H, Lq, D)``; also ``(H, Lq, D)`` or with more leading batch dims ``(*batch, H, Lq, D)``.
        k, v: ``(B, Hkv, Lk, D)`` and ``(B, Hkv, Lk, Dv)`` (the same leading dims as q); ``H``
            must be a multiple of ``Hkv`` (GQA/MQA). ``v`` may have its own head dim ``Dv``: the
            smaller of v and q/k is then zero-padded to the larger one (the kernels work at
            ``max(D, Dv)``; the scale stays ``1/sqrt(D)``) and the output sliced to ``Dv``.
        mask: a :class:`Mask`, DSL text, a compiled :class:`BlockLayout` (from
            :func:`blocksparse_fa.compile_mask`; it runs exactly as the expression does), a bool
            tensor (``True`` = attend) broadcastable to ``(*batch, H, Lq, Lk)`` as SDPA's
            ``attn_mask`` (it becomes a :func:`~blocksparse_fa.dense_mask`), a FlexAttention-style
            ``mask_mod(b, h, q_idx, kv_idx)`` callable (wrapped in :func:`~blocksparse_fa.mask_mod`;
            called with ``b = h = 0`` unless wrapped with ``B``/``H``) or ``None`` (dense). A Mask
            that holds a ``document(ids)`` and keeps one key interval per row (an ``&`` with
            ``causal()``, windows, ranges, ...) runs, without score modifier, on
            intervals built on the device (``ops/interval_backend.py``): no layout is compiled
            (``block_size`` does not apply), nothing is read on the host, and under
            ``torch.compile`` new ids never recompile.
        scale: softmax scale, default ``1/sqrt(D)``; any positive finite real (Python or numpy
            scalar, 0-d CPU tensor).
        dropout_p: attention dropout probability in ``[0, 1)``.
        dropout_seed: int seed of the counter-based dropout RNG (default: drawn from torch's RNG).
        return_lse: also return the logsumexp ``(B, H, Lq)`` (float32, natural log); it is
            differentiable.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``. ``"auto"`` runs the Triton kernels on
            CUDA; on CPU the exact block-walking PyTorch backend, or, when a cost model
            (:func:`blocksparse_fa.ops.dense.prefer_dense`) expects it to be faster (short
            sequences, layouts that keep most blocks), PyTorch's fused SDPA over the materialised
            mask, which is exact too. :func:`blocksparse_fa.ops.last_backend` says which one ran.
        block_size: layout block size when ``mask`` is compiled here (default 128).
        rewrite: allow the compiler's exact rewrites (e.g. Sparse Transformer strided masks as a
            band plus a residue-regrouped part, merged); they apply without dropout.
        enable_gqa: accepted for SDPA compatibility; grouped-query inputs (``Hkv < H``) always
            work, and ``enable_gqa=False`` refuses them as SDPA does.
        align: where query row ``i`` sits when the mask is compiled here: ``"bottom_right"``
            (default: position ``i + Lk - Lq``, decode sees the whole cache) or ``"top_left"``
            (position ``i``, FlexAttention's and SDPA's convention). A compiled layout keeps its own.
        score_mod: a fused score modifier (:func:`~blocksparse_fa.alibi`,
            :func:`~blocksparse_fa.bias`, :func:`~blocksparse_fa.softcap` or a sum such as
            ``alibi(slopes) + bias(t) + softcap(cap)``) applied to the scaled scores before the
            softmax, ALiBi at the positions the mask sees (``align``), the bias at the tensors' row
            and key indices; gradients flow to q, k and v through it, and to its slopes and bias
            tensors when they require grad (its constants get none). Changing its values compiles
            nothing new. Under ``torch.compile`` it runs inside the custom op (tensor arguments).
            On the PyTorch backend, eagerly, also a Flex-style callable
            (:func:`~blocksparse_fa.score_fn`).
        kernel_options: which kernels run and how, for this call only: a
            :class:`~blocksparse_fa.KernelOptions` or a ``dict`` of its fields (e.g.
            ``{"backward": "triton", "lists": "auto"}``); None: the defaults. Eager and compiled calls
            choose the same kernels (:func:`~blocksparse_fa.explain` shows which).

    Returns:
        ``out`` ``(B, H, Lq, Dv)`` (q's leading dims) in q's dtype (and ``lse`` if asked). Fully
        masked query rows give zeros in the output and zero gradients; their LSE is ``-inf``.
        Meta tensors give meta outputs of the right shapes (nothing is computed).

    Under ``torch.compile`` the call becomes the custom op ``blocksparse_fa::attention_fwd``
    (see :func:`blocksparse_fa.attention_op`).
    """
    q4, k4, v4, lead = flatten_batch(q, k, v)
    s = check_qkv(q4, k4, v4, dv_ok=True)
    if not enable_gqa and s.H != s.Hkv:
        raise ValueError(f"enable_gqa=False but q has H={s.H} heads and k/v have Hkv={s.Hkv}: pass enable_gqa=True "
                         f"(the default) for grouped-query attention")
    scale, dropout_p = check_scalars(scale, dropout_p)
    scale = 1.0 / math.sqrt(s.D) if scale is None else scale  # q's and k's head dim, before any padding
    if isinstance(mask, torch.Tensor):
        mask = bool_mask_to_mask(mask, tuple(q.shape[:-3]), s.H, s.Lq, s.Lk, "mask", q4.device)
    score_mod = check_score_mod(score_mod, s.H)
    if score_mod is not None and score_mod.fn is None:
        score_mod = score_mod.bind(lead if lead is not None else (s.B,), s.H, s.Lq, s.Lk, q4.device)
    q4, k4, v4, dv = dispatch.pad_head_dims(q4, k4, v4)  # Dv != D: one head dim for the kernels
    s = replace(s, D=q4.shape[-1])
    res = device_intervals(q4, k4, v4, mask, s, scale, dropout_p, dropout_seed, score_mod, backend, align, return_lse,
                           kernel_options)
    if res is not None:  # e.g. causal() & document(ids): intervals built on the device, no layout
        pass
    elif torch.compiler.is_compiling() or q4.device.type == "meta":
        from .custom_op import attention_op

        res = attention_op(q4, k4, v4, mask, scale=scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
                           return_lse=return_lse, backend=backend, block_size=block_size, rewrite=rewrite,
                           align=align, score_mod=score_mod, kernel_options=kernel_options)
    else:
        be = resolve_backend(backend, q4.device, q4.dtype)
        if be == "triton" and score_mod is not None and score_mod.fn is not None:
            if backend != "auto":
                raise NotImplementedError("score_mod: score_fn() callables run on the PyTorch backend only "
                                          "(backend='torch' or 'auto'); the Triton kernels fuse alibi(), bias() "
                                          "and softcap()")
            be = "torch"  # a Python callable cannot enter the kernels: the PyTorch backend, on any device
        layout = layout_for(mask, s, q4.device, block_size, rewrite, align)
        seed = draw_seed(dropout_p, dropout_seed)
        out, lse = run(q4, k4, v4, layout, s, scale, dropout_p, seed, backend, be, rewrite, return_lse, score_mod,
                       as_options(kernel_options))
        res = (out, lse) if return_lse else out
    if return_lse:
        return unflatten_batch(dispatch.slice_head_dim(res[0], dv), lead), unflatten_batch(res[1], lead)
    return unflatten_batch(dispatch.slice_head_dim(res, dv), lead)
