"""Attention operators: the public ``attention`` entry point, the SDPA-compatible one, backends and
the reference. The ``torch.library`` custom op (``ops.custom_op``) loads on first use."""

from .api import attention
from .dispatch import last_backend
from .dropout import dropout_keep_mask
from .reference import reference_attention
from .sdpa import scaled_dot_product_attention

__all__ = ["attention", "scaled_dot_product_attention", "reference_attention", "dropout_keep_mask", "last_backend"]
