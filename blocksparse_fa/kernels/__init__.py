"""Triton kernels: fused block-sparse forward, recompute backward, generated element predicates.

Importing this package decorates the kernels; under ``TRITON_INTERPRET=1`` (set before import)
they run in Triton's CPU interpreter.
"""

from .backward import _attn_bwd, _attn_bwd_preprocess, _sum_partials
from .forward import _attn_fwd, _attn_fwd_combine

__all__ = ["_attn_fwd", "_attn_fwd_combine", "_attn_bwd_preprocess", "_attn_bwd", "_sum_partials"]
