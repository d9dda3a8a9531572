"""Block compiler: mask expression -> BlockLayout (block states + lookup tables)."""

from .compile import cache_info, clear_cache, compile_mask
from .layout import BlockLayout

__all__ = ["compile_mask", "BlockLayout", "clear_cache", "cache_info"]
