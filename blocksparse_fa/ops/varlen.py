"""``varlen_attention``: FlashAttention's variable-length entry on packed ``(total, H, D)`` tensors.

Sequences of different lengths are packed back to back along the token dim and described by their
cumulative lengths. The mask applies *within* each sequence, at positions relative to it; the rows'
key intervals are built on the device (``compiler/device_intervals.py``) and the interval kernels
(``kernels/interval.py``) run on the packed tensors as one batch of one long sequence.
"""

from __future__ import annotations

import math

import torch

from ..compiler.device_intervals import DeviceIntervals, interval_terms, term_bounds
from ..mask import primitives as P
from ..mask.base import ParamTensor
from ..mask.documents import check_cu_seqlens
from ..mask.dsl import parse
from ..mask.expr import ALIGNS, Mask
from ..mask.primitives import _tracing
from . import dispatch
from .interval_backend import interval_attention
from .validate import check_qkv, check_scalars, like_sdpa_under_autocast

__all__ = ["varlen_attention"]

_SUPPORTED = ("full", "causal", "window", "sliding_window", "chunked", "chunk_band", "prefix_lm", "key_range",
              "query_range", "shift")


def _varlen_terms(mask):
    """The ``&`` terms of ``mask`` (None: no mask), or a ValueError naming what is not supported."""
    if mask is None:
        return ()
    m = parse(mask) if isinstance(mask, str) else mask
    if not isinstance(m, Mask):
        raise TypeError(f"varlen_attention(): mask must be a Mask, DSL text or None, got {type(mask).__name__}")
    terms = interval_terms(m)
    bad = None if terms is not None else m
    for prim, shifts in terms or ():
        params = list(getattr(prim, "_params", ())) + list(shifts)
        if isinstance(prim, P.Document):
            bad = prim
        elif any(isinstance(p, ParamTensor) and p.t.shape[0] > 1 for p in params):
            raise ValueError(f"varlen_attention(): mask term {prim} has per-batch parameters; in a packed batch "
                             f"only per-head parameters (per_head(...)) are supported")
    if bad is not None:
        raise ValueError(f"varlen_attention(): mask {m} is not supported: it must be an & of "
                         f"{', '.join(_SUPPORTED)} (positions relative to each sequence; the sequences themselves "
                         f"are the documents, so document() is not needed), got the term {bad}")
    return terms


def _check_inputs(q, k, v, cu_q, cu_k, max_q, max_k):
    fn = "varlen_attention()"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{fn}: {name} must be packed as (total_tokens, heads, head_dim), got {tuple(t.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"{fn}: k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
    check_cu_seqlens(fn, "cu_seqlens_q", cu_q, q.shape[0])
    check_cu_seqlens(fn, "cu_seqlens_k", cu_k, k.shape[0])
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                         f"shapes {tuple(cu_q.shape)} and {tuple(cu_k.shape)}")
    if cu_q.device != q.device or cu_k.device != q.device:
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must be on q's device {q.device}, got {cu_q.device} "
                         f"and {cu_k.device}")
    for name, m, cu in (("max_seqlen_q", max_q, cu_q), ("max_seqlen_k", max_k, cu_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"{fn}: {name} must be a non-negative int, got {m!r}")
        if not _tracing(cu) and cu.shape[0] > 1:
            longest = int((cu[1:] - cu[:-1]).max())
            if longest > m:
                raise ValueError(f"{fn}: {name}={m} is less than the longest sequence ({longest} tokens)")


def _bounds(terms, cu_q, cu_k, total_q: int, align: str, device) -> DeviceIntervals:
    """Packed rows' key intervals: each sequence's mask at its own positions, shifted to its keys."""
    r = torch.arange(total_q, device=device, dtype=torch.int64)
    cq, ck = cu_q.to(torch.int64), cu_k.to(torch.int64)
    seq = torch.searchsorted(cq, r, right=True) - 1  # the sequence of each packed row
    q0, lq = cq[seq], cq[seq + 1] - cq[seq]
    k0, lk = ck[seq], ck[seq + 1] - ck[seq]
    qp = (r - q0 + (lk - lq if align == "bottom_right" else 0)).view(1, 1, -1)
    lk = lk.view(1, 1, -1)
    lo, hi = torch.zeros_like(qp), lk
    for prim, shifts in terms:
        q = qp
        for d in shifts:
            q = q + (d.t.to(device).unsqueeze(-1) if isinstance(d, ParamTensor) else d)
        tlo, thi = term_bounds(prim, q, lk, device)
        lo, hi = torch.maximum(lo, tlo), torch.minimum(hi, thi)
    empty = lo >= hi
    k0 = k0.view(1, 1, -1)
    lo = torch.where(empty, 0, lo + k0).to(torch.int32).contiguous()
    hi = torch.where(empty, 0, hi + k0).to(torch.int32).contiguous()
    return DeviceIntervals(lo, hi, None, None, None, None)


@like_sdpa_under_autocast
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, mask=None, *,
                     scale=None, dropout_p: float = 0.0, dropout_seed=None, align: str = "bottom_right",
                     backend: str = "auto", return_lse: bool = False, kernel_options=None):
    """Attention over sequences packed back to back, each attending only within itself.

    Sequence ``s`` holds query rows ``cu_seqlens_q[s] .. cu_seqlens_q[s + 1]`` and keys
    ``cu_seqlens_k[s] .. cu_seqlens_k[s + 1]`` (lengths may differ between q and k, and may be 0).
    ``mask`` applies inside each sequence at its own positions: query row ``i`` of a sequence with
    ``lq`` queries and ``lk`` keys sits at ``i + lk - lq`` (``align="bottom_right"``, the default:
    FlashAttention's causal convention for ``lq != lk``) or at ``i`` (``"top_left"``), its key ``j``
    at ``j``.

    Supported masks (anything else raises ``ValueError``): ``None`` (every key of the sequence), or
    an ``&`` of ``full()``, ``causal()``, ``window(w)``, ``sliding_window(w)``, ``chunked(c)``,
    ``chunk_band(...)``, ``prefix_lm(p)``, ``key_range(a, b)``, ``query_range(a, b)`` and ``shift``
    of them, with int or per-head parameters, given as a Mask or DSL text (``"causal &
    sliding_window(256)"``). Each keeps one key interval per row, which is what the kernels run on.
    Unions, complements, per-batch parameters and tensor-holding primitives (``document``: the
    sequences already are the documents) are refused. Not supported here: score modifiers.

    This is FlashAttention's varlen interface; for packed ``(B, H, L, D)`` tensors, the same masks
    are ``causal() & document_from_cu_seqlens(cu_seqlens, L)`` (or ``document_from_positions``)
    through :func:`blocksparse_fa.attention`, where they combine with any other primitive.

    Args:
        q: ``(total_q, H, D)``; k: ``(total_k, Hkv, D)``; v: ``(total_k, Hkv, Dv)`` with
            ``H % Hkv == 0`` (GQA; the last dim contiguous).
        cu_seqlens_q, cu_seqlens_k: int32/int64 ``(n + 1,)`` on q's device, non-decreasing from 0 to
            ``total_q`` / ``total_k``. Under ``torch.compile`` their length is part of the graph's
            shapes: pad them to a fixed length by repeating the total (empty sequences) to keep
            one graph for every packing.
        max_seqlen_q, max_seqlen_k: ints at least the longest sequence (checked outside
            ``torch.compile``; the kernels do not need them).
        mask: see above.
        scale: softmax scale (default ``1/sqrt(D)``).
        dropout_p, dropout_seed: attention dropout (the library's Philox stream, counted on the
            packed row and key indices) and its seed (default: drawn from torch's RNG).
        align: ``"bottom_right"`` or ``"top_left"``.
        backend: ``"auto"`` (Triton on CUDA, PyTorch on CPU), ``"triton"`` or ``"torch"``.
        return_lse: also return the logsumexp ``(H, total_q)`` (float32, natural log).
        kernel_options: as in :func:`blocksparse_fa.attention` (:func:`blocksparse_fa.explain`
            reports this path's kernels for the equivalent document mask).

    Returns:
        ``out`` ``(total_q, H, Dv)`` in q's dtype (and ``lse``). Rows with nothing to attend
        (an empty key sequence, or the mask) give zeros and LSE ``-inf``.

    Raises:
        TypeError, ValueError: naming the argument. Shapes and dtypes are always checked; the
        values of ``cu_seqlens_*`` (start at 0, non-decreasing, end at the total) and
        ``max_seqlen_*`` only outside ``torch.compile`` and CUDA-graph capture.
    """
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if align not in ALIGNS:
        raise ValueError(f"varlen_attention(): align must be one of {ALIGNS}, got {align!r}")
    terms = _varlen_terms(mask)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    s = check_qkv(q4, k4, v4, dv_ok=True)
    scale, dropout_p = check_scalars(scale, dropout_p)
    scale = 1.0 / math.sqrt(s.D) if scale is None else scale
    q4, k4, v4, dv = dispatch.pad_head_dims(q4, k4, v4)
    iv = _bounds(terms, cu_seqlens_q, cu_seqlens_k, q.shape[0], align, q.device)
    res = interval_attention(q4, k4, v4, iv, scale, backend, return_lse, dropout_p, dropout_seed, kernel_options)
    out, lse = res if return_lse else (res, None)
    out = dispatch.slice_head_dim(out[0].transpose(0, 1), dv).contiguous()
    return (out, lse[0]) if return_lse else out
