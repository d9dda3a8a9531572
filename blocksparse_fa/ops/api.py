"""``attention``: the public entry point; validates, compiles the mask and picks a backend."""

from __future__ import annotations

import math
import os

import torch

from ..compiler.compile import compile_mask
from ..compiler.layout import BlockLayout
from ..mask.dsl import parse
from ..mask.expr import Mask
from ..mask.primitives import full
from ..compiler.rewrite import plan, residue_permutation
from .merge import merge_attention
from .residue import residue_applies, residue_attention
from .validate import Shapes, check_layout, check_qkv, check_scalars

__all__ = ["attention", "BACKENDS", "resolve_backend"]

BACKENDS = ("auto", "triton", "torch")
DEFAULT_BLOCK = 128


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``"triton"`` or ``"torch"`` for this request; clear errors for impossible combinations."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and dtype != torch.float64 else "torch"
    if backend == "triton":
        if dtype == torch.float64:
            raise TypeError("backend='triton' supports float16, bfloat16 and float32; use backend='torch' for float64")
        if device.type == "cpu" and not interpreter_enabled():
            raise RuntimeError("backend='triton' on CPU tensors runs the kernels in Triton's interpreter: "
                               "set TRITON_INTERPRET=1 in the environment before Python starts "
                               "(or use backend='torch', the exact CPU implementation)")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='triton' needs CUDA (or CPU under TRITON_INTERPRET=1) tensors, got {device}")
    return backend


def _layout_for(mask, shapes: Shapes, device, block_size) -> BlockLayout:
    if mask is None:
        mask = full()
    if isinstance(mask, str):
        mask = parse(mask)
    if isinstance(mask, Mask):
        return compile_mask(mask, shapes.Lq, shapes.Lk, block_size or DEFAULT_BLOCK, device=device)
    if isinstance(mask, BlockLayout):
        if block_size is not None and tuple(mask.block_size) != (
                (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)):
            raise ValueError(f"block_size={block_size!r} conflicts with the layout's block size {mask.block_size}")
        return mask
    raise TypeError(f"mask must be a Mask, BlockLayout, DSL text or None, got {type(mask).__name__}")


def _attention_parts(q, k, v, parts, shapes: Shapes, scale, backend, block_size):
    """Attention over a rewritten mask: each part (optionally on regrouped tokens), merged exactly.
    On the Triton backend the strided part runs on residue-class views where it can (no copies,
    ``ops/residue.py``); otherwise on permuted copies, merged by ``ops/merge.py``."""
    if resolve_backend(backend, q.device, q.dtype) == "triton" and residue_applies(parts, shapes, q.dtype):
        return residue_attention(q, k, v, parts, shapes, scale, block_size)
    results = []
    for part in parts:
        kw = dict(scale=scale, return_lse=True, backend=backend, block_size=block_size, rewrite=False)
        if part.residue_stride:
            perm, inv = residue_permutation(shapes.Lq, part.residue_stride, q.device)
            o, l = attention(q.index_select(2, perm), k.index_select(2, perm), v.index_select(2, perm), part.mask, **kw)
            o, l = o.index_select(2, inv), l.index_select(2, inv)
        else:
            o, l = attention(q, k, v, part.mask, **kw)
        results.append((o, l))
    return merge_attention(results)


def attention(q, k, v, mask=None, *, scale=None, dropout_p: float = 0.0, dropout_seed=None,
              return_lse: bool = False, backend: str = "auto", block_size=None, rewrite: bool = True):
    """Block-sparse scaled-dot-product attention.

    Args:
        q: ``(B, H, Lq, D)``.
        k, v: ``(B, Hkv, Lk, D)``; ``H`` must be a multiple of ``Hkv`` (GQA/MQA).
        mask: a :class:`Mask`, DSL text, a compiled :class:`BlockLayout` or ``None`` (dense).
            Query row ``i`` sits at position ``i + Lk - Lq`` (bottom-right alignment).
        scale: softmax scale, default ``1/sqrt(D)``.
        dropout_p: attention dropout probability in ``[0, 1)``.
        dropout_seed: int seed of the counter-based dropout RNG (default: drawn from torch's RNG).
        return_lse: also return the logsumexp ``(B, H, Lq)`` (float32, natural log); it is
            differentiable.
        backend: ``"auto"`` (Triton on CUDA, PyTorch on CPU), ``"triton"`` or ``"torch"``.
        block_size: layout block size when ``mask`` is compiled here (default 128).
        rewrite: allow exact mask rewrites (``compiler.rewrite``: e.g. Sparse Transformer strided
            masks are computed as a band plus a residue-regrouped part and merged); only for masks
            given as expressions, without dropout.

    Returns:
        ``out`` ``(B, H, Lq, D)`` in q's dtype (and ``lse`` if asked). Fully masked query rows give
        zeros in the output and zero gradients; their LSE is ``-inf``.
    """
    shapes = check_qkv(q, k, v)
    check_scalars(scale, dropout_p)
    be = resolve_backend(backend, q.device, q.dtype)
    if isinstance(mask, str):
        mask = parse(mask)
    if rewrite and isinstance(mask, Mask) and float(dropout_p) == 0.0:
        parts = plan(mask, shapes.Lq, shapes.Lk)
        if parts:
            out, lse = _attention_parts(q, k, v, parts, shapes, scale, backend, block_size)
            return (out, lse) if return_lse else out
    layout = _layout_for(mask, shapes, q.device, block_size)
    check_layout(layout, shapes)
    scale = 1.0 / math.sqrt(shapes.D) if scale is None else float(scale)
    dropout_p = float(dropout_p)
    if dropout_p > 0.0:
        if dropout_seed is None:
            dropout_seed = int(torch.randint(0, 2**62, (1,)).item())
        elif isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int) or not 0 <= dropout_seed < 2**62:
            raise ValueError(f"dropout_seed must be an int in [0, 2**62), got {dropout_seed!r}")
    else:
        dropout_seed = 0
    if be == "torch":
        from .torch_backend import torch_attention

        out, lse = torch_attention(q, k, v, layout, shapes, scale, dropout_p, dropout_seed)
    else:
        from .triton_backend import triton_attention

        out, lse = triton_attention(q, k, v, layout, shapes, scale, dropout_p, dropout_seed)
    return (out, lse) if return_lse else out
