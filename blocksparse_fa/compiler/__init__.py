"""Block compiler: mask expression -> BlockLayout (block states + lookup tables)."""

from ..mask.expr import register_compiler
from .compile import cache_info, clear_cache, compile_mask
from .layout import BlockLayout

register_compiler(compile_mask)  # Mask.compile/density/show/plot, without the mask package importing us

__all__ = ["compile_mask", "BlockLayout", "clear_cache", "cache_info"]
