"""blocksparse_fa: block-sparse FlashAttention driven by a small mask algebra.

    import blocksparse_fa as bsfa
    m = bsfa.causal() & (bsfa.window(256) | bsfa.global_tokens(64))
    lay = bsfa.compile_mask(m, 4096, 4096, block_size=128)
    out = bsfa.attention(q, k, v, mask=m)
"""

from .mask import (
    Mask, MaskSyntaxError, block_mask, causal, chunk_band, chunked, dense_mask, document, full, global_tokens,
    key_range, key_set, list_patterns, load_pattern, mask_mod, neighborhood, parse, pattern_info, per_batch,
    per_head, periodic_window, prefix_lm, query_range, query_set, random_blocks, sliding_tiles, sliding_window,
    shift, strided, summary, window,
)

from .compiler import BlockLayout, compile_mask
from .ops import attention, dropout_keep_mask, reference_attention
from .ops.custom_op import attention_op, register_mask
from .ops.merge import merge_attention
from . import nn  # noqa: E402  (BlockSparseAttention, BlockSparseMultiheadAttention)

__version__ = "0.1.0"

__all__ = [
    "Mask", "MaskSyntaxError", "BlockLayout", "compile_mask", "attention", "reference_attention",
    "dropout_keep_mask", "attention_op", "register_mask", "merge_attention", "nn", "parse", "load_pattern", "list_patterns", "pattern_info",
    "full", "causal", "window", "sliding_window", "global_tokens", "strided", "chunked", "prefix_lm",
    "summary", "document", "random_blocks", "block_mask", "dense_mask", "chunk_band", "key_range", "query_range",
    "key_set", "query_set", "periodic_window", "neighborhood", "sliding_tiles", "mask_mod", "per_head", "per_batch", "shift",
]
