"""Mask algebra: primitives, ``&``/``|``/``~`` expressions, the text DSL and named patterns."""

from .dsl import MaskSyntaxError, parse
from .expr import And, EvalContext, Mask, Not, Or
from .patterns import PatternInfo, list_patterns, load_pattern, pattern_info
from .primitives import (
    PRIMITIVES, block_mask, causal, chunked, dense_mask, document, full, global_tokens, prefix_lm,
    random_blocks, sliding_window, strided, summary, window,
)

__all__ = [
    "Mask", "And", "Or", "Not", "EvalContext", "MaskSyntaxError", "parse", "PatternInfo",
    "list_patterns", "load_pattern", "pattern_info", "PRIMITIVES", "full", "causal", "window",
    "sliding_window", "global_tokens", "strided", "chunked", "prefix_lm", "summary", "document",
    "random_blocks", "block_mask", "dense_mask",
]
