"""Document masks from the two usual descriptions of packed sequences.

* ``cu_seqlens`` (FlashAttention's varlen convention): the cumulative lengths ``[0, l0, l0 + l1,
  ..., total]`` of the sequences packed into one row of ``total`` tokens;
* ``position_ids`` that restart at 0 with each sequence (Hugging Face's
  ``DataCollatorWithFlattening``): a new document starts wherever a position is not the previous
  one plus 1 (the rule of ``transformers.masking_utils.find_packed_sequence_indices``).

Both give a :func:`~blocksparse_fa.document` mask whose documents are contiguous runs by
construction (:attr:`~blocksparse_fa.mask.primitives.Document.contiguous`), built with torch
operations on the tensors' device (no host reads), so they can be built inside a compiled step from
that step's tensors: ``causal() & document_from_positions(position_ids)``.
"""

from __future__ import annotations

import torch

from .primitives import Document, _tracing

__all__ = ["document_from_cu_seqlens", "document_from_positions", "check_cu_seqlens"]


def _check_int_tensor(fn: str, name: str, t, dims: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{fn}: {name} must be an integer tensor, got {t.dtype}")
    if t.dim() not in dims:
        shapes = " or ".join({1: "(n,)", 2: "(B, n)"}[d] for d in dims)
        raise ValueError(f"{fn}: {name} must have shape {shapes}, got {tuple(t.shape)}")


def check_cu_seqlens(fn: str, name: str, cu: torch.Tensor, total: int) -> None:
    """Validate cumulative sequence lengths: a 1-D integer tensor of at least 2 entries (shape and
    dtype always); starting at 0, non-decreasing and ending at ``total`` (values: read only outside
    ``torch.compile`` and CUDA-graph capture, where reading them would need the host)."""
    _check_int_tensor(fn, name, cu, (1,))
    if cu.shape[0] < 2:
        raise ValueError(f"{fn}: {name} must hold at least 2 entries [0, ..., total], got shape {tuple(cu.shape)}")
    if _tracing(cu):
        return
    c = cu.detach().to("cpu", torch.int64)
    if int(c[0]) != 0:
        raise ValueError(f"{fn}: {name} must start at 0, got {int(c[0])}")
    if bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{fn}: {name} must be non-decreasing (cumulative lengths), got {c.tolist()}")
    if int(c[-1]) != total:
        raise ValueError(f"{fn}: {name} must end at the total length {total}, got {int(c[-1])}")


def _runs(ids: torch.Tensor) -> Document:
    doc = Document(ids, contiguous=False)  # no host check: the ids are runs by construction
    doc._contiguous = True
    return doc


def document_from_cu_seqlens(cu_seqlens: torch.Tensor, length: int) -> Document:
    """``document(ids)`` of sequences packed back to back: token ``x`` of ``[0, length)`` belongs to
    sequence ``s`` when ``cu_seqlens[s] <= x < cu_seqlens[s + 1]``.

    Args:
        cu_seqlens: int ``(n + 1,)``, ``[0, l0, l0 + l1, ..., length]`` (empty sequences allowed).
        length: the packed length ``L`` (the ids' length; the mask's ``kv_len``).

    Returns:
        A :class:`~blocksparse_fa.mask.primitives.Document` with ids ``(L,)`` on ``cu_seqlens``'
        device (documents are contiguous runs: the device path needs no id compare).

    Raises:
        TypeError, ValueError: naming the argument (values are checked outside ``torch.compile``).
    """
    fn = "document_from_cu_seqlens()"
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"{fn}: length must be a positive int, got {length!r}")
    check_cu_seqlens(fn, "cu_seqlens", cu_seqlens, length)
    pos = torch.arange(length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return _runs(torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True))


def document_from_positions(position_ids: torch.Tensor) -> Document:
    """``document(ids)`` of packed sequences whose positions restart: a new document starts at
    every ``x`` with ``position_ids[x] != position_ids[x - 1] + 1`` (so at each restart at 0).

    Args:
        position_ids: int ``(L,)`` or ``(B, L)`` (one packing per batch row).

    Returns:
        A :class:`~blocksparse_fa.mask.primitives.Document` with ids of ``position_ids``' shape
        and device (contiguous runs).

    Raises:
        TypeError, ValueError: naming the argument.
    """
    _check_int_tensor("document_from_positions()", "position_ids", position_ids, (1, 2))
    if position_ids.shape[-1] < 1:
        raise ValueError(f"document_from_positions(): position_ids must not be empty, got shape "
                         f"{tuple(position_ids.shape)}")
    p = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
    start = torch.ones_like(p[:, :1], dtype=torch.bool)
    new = torch.cat([start, p[:, 1:] != p[:, :-1] + 1], dim=1)
    ids = torch.cumsum(new.to(torch.int32), dim=1, dtype=torch.int32) - 1
    return _runs(ids if position_ids.dim() == 2 else ids[0])
