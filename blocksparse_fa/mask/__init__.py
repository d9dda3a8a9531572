"""Mask algebra: primitives, ``&``/``|``/``~`` expressions, the text DSL and named patterns."""

from .dsl import MaskSyntaxError, parse
from .expr import And, EvalContext, Mask, Not, Or
from .patterns import PatternInfo, list_patterns, load_pattern, pattern_info
from .primitives import (
    PRIMITIVES, block_mask, causal, chunk_band, chunked, dense_mask, document, full, global_tokens, key_range,
    key_set, mask_mod, neighborhood, per_batch, per_head, periodic_window, prefix_lm, query_range, query_set,
    random_blocks, sliding_tiles, sliding_window, strided, summary, window,
)
from .shift import Shift, shift

__all__ = [
    "Mask", "And", "Or", "Not", "EvalContext", "MaskSyntaxError", "parse", "PatternInfo",
    "list_patterns", "load_pattern", "pattern_info", "PRIMITIVES", "full", "causal", "window",
    "sliding_window", "global_tokens", "strided", "chunked", "chunk_band", "prefix_lm", "summary", "key_range",
    "query_range", "key_set", "query_set", "periodic_window", "document", "random_blocks", "neighborhood",
    "sliding_tiles", "block_mask", "dense_mask", "mask_mod", "per_head", "per_batch", "shift", "Shift",
]
