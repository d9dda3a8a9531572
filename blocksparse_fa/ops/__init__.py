"""Attention operators: the public ``attention`` entry point, backends and the reference."""

from .api import attention
from .dropout import dropout_keep_mask
from .reference import reference_attention

__all__ = ["attention", "reference_attention", "dropout_keep_mask"]
