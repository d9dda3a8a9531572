"""``attention``: the public entry point. It validates, finds the compiled layout and dispatches.

Eager calls run :mod:`blocksparse_fa.ops.dispatch` through a plain autograd function; under
``torch.compile`` the same path runs inside the ``torch.library`` custom op
(:mod:`blocksparse_fa.ops.custom_op`), which Dynamo traces as one opaque call.
"""

from __future__ import annotations

import math
import os

import torch

from ..compiler.cache import LRUCache
from ..compiler.compile import block_pair, compile_mask, generation
from ..compiler.layout import BlockLayout
from ..mask.dsl import parse
from ..mask.expr import Mask
from ..mask.primitives import full
from . import dispatch
from .validate import Shapes, check_layout, check_qkv, check_scalars

__all__ = ["attention", "BACKENDS", "resolve_backend", "layout_for", "draw_seed"]

BACKENDS = ("auto", "triton", "torch")
DEFAULT_BLOCK = 128


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``"triton"`` or ``"torch"`` for this request; clear errors for impossible combinations."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and dtype != torch.float64 else "torch"
    if backend == "torch":
        return backend
    if backend != "triton":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if dtype == torch.float64:
        raise TypeError("backend='triton' supports float16, bfloat16 and float32; use backend='torch' for float64")
    if device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError("backend='triton' on CPU tensors runs the kernels in Triton's interpreter: "
                           "set TRITON_INTERPRET=1 in the environment before Python starts "
                           "(or use backend='torch', the exact CPU implementation)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"backend='triton' needs CUDA (or CPU under TRITON_INTERPRET=1) tensors, got {device}")
    return backend


_BY_ID = LRUCache(256)  # (id(mask), lengths, block, device, rewrite) -> (mask, layout): no hashing of the tree


def layout_for(mask, s: Shapes, device, block_size=None, rewrite: bool = True) -> BlockLayout:
    """The compiled layout of ``mask`` (Mask, DSL text, BlockLayout or None) for these shapes."""
    if isinstance(mask, BlockLayout):
        if block_size is not None and tuple(mask.block_size) != block_pair(block_size):
            raise ValueError(f"block_size={block_size!r} conflicts with the layout's block size {mask.block_size}")
        check_layout(mask, s)
        return mask
    key = (id(mask), s.Lq, s.Lk, block_size, device, rewrite)
    hit = _BY_ID.get(key)
    if hit is not None and hit[0] is mask and hit[2] == generation():
        return hit[1]
    m = full() if mask is None else parse(mask) if isinstance(mask, str) else mask
    if not isinstance(m, Mask):
        raise TypeError(f"mask must be a Mask, BlockLayout, DSL text or None, got {type(mask).__name__}")
    layout = compile_mask(m, s.Lq, s.Lk, block_pair(block_size), device=device, rewrite=rewrite)
    check_layout(layout, s)
    _BY_ID.put(key, (mask, layout, generation()))
    return layout


def draw_seed(dropout_p: float, dropout_seed) -> int:
    """The dropout seed: 0 without dropout, ``dropout_seed`` checked, or one drawn from torch's RNG."""
    if dropout_p == 0.0:
        return 0
    if dropout_seed is None:
        return int(torch.randint(0, 2**62, (1,)).item())
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int) or not 0 <= dropout_seed < 2**62:
        raise ValueError(f"dropout_seed must be an int in [0, 2**62), got {dropout_seed!r}")
    return dropout_seed


def attention(q, k, v, mask=None, *, scale=None, dropout_p: float = 0.0, dropout_seed=None,
              return_lse: bool = False, backend: str = "auto", block_size=None, rewrite: bool = True):
    """Block-sparse scaled-dot-product attention.

    Args:
        q: ``(B, H, Lq, D)``.
        k, v: ``(B, Hkv, Lk, D)``; ``H`` must be a multiple of ``Hkv`` (GQA/MQA).
        mask: a :class:`Mask`, DSL text, a compiled :class:`BlockLayout` (from
            :func:`blocksparse_fa.compile_mask`; it runs exactly as the expression does) or ``None``
            (dense). Query row ``i`` sits at position ``i + Lk - Lq`` (bottom-right alignment).
        scale: softmax scale, default ``1/sqrt(D)``.
        dropout_p: attention dropout probability in ``[0, 1)``.
        dropout_seed: int seed of the counter-based dropout RNG (default: drawn from torch's RNG).
        return_lse: also return the logsumexp ``(B, H, Lq)`` (float32, natural log); it is
            differentiable.
        backend: ``"auto"`` (Triton on CUDA, PyTorch on CPU), ``"triton"`` or ``"torch"``.
        block_size: layout block size when ``mask`` is compiled here (default 128).
        rewrite: allow the compiler's exact rewrites (e.g. Sparse Transformer strided masks as a
            band plus a residue-regrouped part, merged); they apply without dropout.

    Returns:
        ``out`` ``(B, H, Lq, D)`` in q's dtype (and ``lse`` if asked). Fully masked query rows give
        zeros in the output and zero gradients; their LSE is ``-inf``.

    Under ``torch.compile`` the call becomes the custom op ``blocksparse_fa::attention_fwd``
    (see :func:`blocksparse_fa.attention_op`).
    """
    if torch.compiler.is_compiling():
        from .custom_op import attention_op

        return attention_op(q, k, v, mask, scale=scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
                            return_lse=return_lse, backend=backend, block_size=block_size, rewrite=rewrite)
    s = check_qkv(q, k, v)
    check_scalars(scale, dropout_p)
    be = resolve_backend(backend, q.device, q.dtype)
    layout = layout_for(mask, s, q.device, block_size, rewrite)
    scale = 1.0 / math.sqrt(s.D) if scale is None else float(scale)
    dropout_p = float(dropout_p)
    seed = draw_seed(dropout_p, dropout_seed)
    out, lse = dispatch.apply(q, k, v, layout, s, scale, dropout_p, seed, be, rewrite)
    return (out, lse) if return_lse else out
