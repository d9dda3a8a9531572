"""blocksparse_fa: block-sparse FlashAttention driven by a small mask algebra.

    import blocksparse_fa as bsfa
    m = bsfa.causal() & (bsfa.window(256) | bsfa.global_tokens(64))
    lay = bsfa.compile_mask(m, 4096, 4096, block_size=128)
    out = bsfa.attention(q, k, v, mask=m)

Importing the package imports neither Triton (loaded when the Triton backend first runs) nor
Dynamo: the ``torch.library`` custom op (:func:`attention_op`, :func:`register_mask`), the ``nn``
modules and the integrations load on first use.
"""

import importlib

from .mask import (
    Mask, MaskSyntaxError, block_mask, causal, chunk_band, chunked, dense_mask, document, full, global_tokens,
    key_range, key_set, list_patterns, load_pattern, mask_mod, neighborhood, parse, pattern_info, per_batch,
    per_head, periodic_window, prefix_lm, query_range, query_set, random_blocks, sliding_tiles, sliding_window,
    shift, strided, summary, window,
)

from .mask.documents import document_from_cu_seqlens, document_from_positions
from .mask.score import ScoreMod, alibi, alibi_slopes, bias, score_fn, softcap
from .compiler import BlockLayout, compile_mask
from .ops import attention, dropout_keep_mask, last_backend, reference_attention, scaled_dot_product_attention
from .ops.options import KernelOptions
from .ops.merge import merge_attention

__version__ = "0.1.0"

__all__ = [
    "Mask", "MaskSyntaxError", "BlockLayout", "compile_mask", "attention", "scaled_dot_product_attention",
    "reference_attention", "dropout_keep_mask", "attention_op", "register_mask", "merge_attention", "last_backend",
    "KernelOptions", "explain",
    "nn", "parse", "load_pattern", "list_patterns", "pattern_info",
    "full", "causal", "window", "sliding_window", "global_tokens", "strided", "chunked", "prefix_lm",
    "summary", "document", "random_blocks", "block_mask", "dense_mask", "chunk_band", "key_range", "query_range",
    "key_set", "query_set", "periodic_window", "neighborhood", "sliding_tiles", "mask_mod", "per_head", "per_batch", "shift",
    "ScoreMod", "alibi", "alibi_slopes", "bias", "score_fn", "softcap",
    "varlen_attention", "document_from_cu_seqlens", "document_from_positions",
]

_LAZY = {"attention_op": ".ops.custom_op", "register_mask": ".ops.custom_op", "nn": ".nn", "explain": ".ops.explain",
         "varlen_attention": ".ops.varlen"}


def __getattr__(name):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'blocksparse_fa' has no attribute {name!r}")
    mod = importlib.import_module(where, __name__)
    value = mod if name == "nn" else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
