"""The paths a prepared call takes, shared by :func:`blocksparse_fa.attention` and
:func:`~blocksparse_fa.attention_op`: the device-interval path (:func:`device_intervals`), PyTorch's
SDPA over the materialised mask (:func:`takes_dense_path`) or the block-sparse backends over a
compiled layout (:func:`run`).
"""

from __future__ import annotations

from ..compiler.layout import BlockLayout
from ..mask.expr import Mask
from . import dispatch
from .dense import dense_forward, inputs_finite, prefer_dense
from .options import as_options
from .validate import Shapes

__all__ = ["device_intervals", "takes_dense_path", "run"]


def device_intervals(q, k, v, mask, s: Shapes, scale: float, dropout_p: float, dropout_seed, score_mod, backend: str,
                     align, return_lse: bool, kernel_options=None):
    """The result of the device-interval path (``ops/interval_backend.py``) for masks that hold a
    ``document(ids)`` and keep one key interval per row, or None (the layout path applies)."""
    if not isinstance(mask, Mask):
        return None
    # loaded on first use, as the custom op is (it registers torch.library ops)
    from .interval_backend import try_interval_attention

    return try_interval_attention(q, k, v, mask, s, scale, dropout_p, dropout_seed, score_mod, backend, align,
                                  return_lse, kernel_options)


def takes_dense_path(q, k, v, layout: BlockLayout, s: Shapes, dropout_p: float, backend: str, be: str,
                     return_lse: bool, score_mod=None) -> bool:
    """Whether a call runs PyTorch's SDPA over the materialised mask (:mod:`blocksparse_fa.ops.dense`):
    ``backend="auto"`` on CPU tensors, no logsumexp or score modifier, the cost model prefers it and
    the inputs are finite."""
    return (backend == "auto" and be == "torch" and not return_lse and q.device.type == "cpu" and score_mod is None
            and prefer_dense(layout, s, dropout_p) and inputs_finite(q, k, v))


def run(q, k, v, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int, backend: str,
        be: str, rewrite: bool, return_lse: bool, score_mod=None, opts=None):
    """``(out, lse or None)`` over a compiled layout: ``be`` is the resolved backend, ``backend`` what
    the caller asked for (``"auto"`` on CPU may take the dense path, :func:`takes_dense_path`);
    ``opts``: the call's :class:`~blocksparse_fa.ops.options.KernelOptions`."""
    if takes_dense_path(q, k, v, layout, s, dropout_p, backend, be, return_lse, score_mod):
        dispatch.note_backend("dense")
        return dense_forward(q, k, v, layout, s, scale), None
    dispatch.note_backend(be)
    return dispatch.apply(q, k, v, layout, s, scale, dropout_p, seed, be, rewrite, score_mod, as_options(opts))
