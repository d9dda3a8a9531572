"""``attention``: the public entry point. It validates, finds the compiled layout and dispatches
(the steps it shares with the custom op are in ``ops/prepare.py`` and ``ops/route.py``).

Eager calls run :mod:`blocksparse_fa.ops.dispatch` through a plain autograd function; under
``torch.compile`` the same path runs inside the ``torch.library`` custom op
(:mod:`blocksparse_fa.ops.custom_op`), which Dynamo traces as one opaque call.
"""

from __future__ import annotations

import math

import torch

from ..compiler.layout import BlockLayout
from ..mask.score import check_score_mod
from . import dispatch
from .options import as_options
from .prepare import BACKENDS, draw_seed, layout_for, resolve_backend, triton_available
from .prepare import as_mask, check_align, check_mask_for, interpreter_enabled  # noqa: F401  (importable here too)
from .route import device_intervals, run
from .route import takes_dense_path  # noqa: F401  (importable here too)
from .validate import (Shapes, bool_mask_to_mask, check_qkv, check_scalars, flatten_batch,
                       like_sdpa_under_autocast, unflatten_batch)

__all__ = ["attention", "BACKENDS", "resolve_backend", "layout_for", "draw_seed", "triton_available"]


@like_sdpa_under_autocast
def attention(q, k, v, mask=None, *, scale=None, dropout_p: float = 0.0, dropout_seed=None,
              return_lse: bool = False, backend: str = "auto", block_size=None, rewrite: bool = True,
              enable_gqa: bool = True, align: str | None = None, score_mod=None, kernel_options=None):
    """Block-sparse scaled-dot-product attention.

    Args:
        q: ``(B, H, Lq, D)``; also ``(H, Lq, D)`` or with more leading batch dims ``(*batch, H, Lq, D)``.
        k, v: ``(B, Hkv, Lk, D)`` and ``(B, Hkv, Lk, Dv)`` (the same leading dims as q); ``H``
            must be a multiple of ``Hkv`` (GQA/MQA). ``v`` may have its own head dim ``Dv``: the
            smaller of v and q/k is then zero-padded to the larger one (the kernels work at
            ``max(D, Dv)``; the scale stays ``1/sqrt(D)``) and the output sliced to ``Dv``.
        mask: a :class:`Mask`, DSL text, a compiled :class:`BlockLayout` (from
            :func:`blocksparse_fa.compile_mask`; it runs exactly as the expression does), a bool
            tensor (``True`` = attend) broadcastable to ``(*batch, H, Lq, Lk)`` as SDPA's
            ``attn_mask`` (it becomes a :func:`~blocksparse_fa.dense_mask`), a FlexAttention-style
            ``mask_mod(b, h, q_idx, kv_idx)`` callable (wrapped in :func:`~blocksparse_fa.mask_mod`;
            called with ``b = h = 0`` unless wrapped with ``B``/``H``) or ``None`` (dense). A Mask
            that holds a ``document(ids)`` and keeps one key interval per row (an ``&`` with
            ``causal()``, windows, ranges, ...) runs, without score modifier, on
            intervals built on the device (``ops/interval_backend.py``): no layout is compiled
            (``block_size`` does not apply), nothing is read on the host, and under
            ``torch.compile`` new ids never recompile.
        scale: softmax scale, default ``1/sqrt(D)``; any positive finite real (Python or numpy
            scalar, 0-d CPU tensor).
        dropout_p: attention dropout probability in ``[0, 1)``.
        dropout_seed: int seed of the counter-based dropout RNG (default: drawn from torch's RNG).
        return_lse: also return the logsumexp ``(B, H, Lq)`` (float32, natural log); it is
            differentiable.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``. ``"auto"`` runs the Triton kernels on
            CUDA; on CPU the exact block-walking PyTorch backend, or, when a cost model
            (:func:`blocksparse_fa.ops.dense.prefer_dense`) expects it to be faster (short
            sequences, layouts that keep most blocks), PyTorch's fused SDPA over the materialised
            mask, which is exact too. :func:`blocksparse_fa.ops.last_backend` says which one ran.
            Second derivatives (a backward with ``create_graph=True``) need ``"torch"``: the
            Triton kernels refuse such a backward.
        block_size: layout block size when ``mask`` is compiled here (default 128).
        rewrite: allow the compiler's exact rewrites (e.g. Sparse Transformer strided masks as a
            band plus a residue-regrouped part, merged); they apply without dropout.
        enable_gqa: accepted for SDPA compatibility; grouped-query inputs (``Hkv < H``) always
            work, and ``enable_gqa=False`` refuses them as SDPA does.
        align: where query row ``i`` sits when the mask is compiled here: ``"bottom_right"``
            (default: position ``i + Lk - Lq``, decode sees the whole cache) or ``"top_left"``
            (position ``i``, FlexAttention's and SDPA's convention). A compiled layout keeps its own.
        score_mod: a fused score modifier (:func:`~blocksparse_fa.alibi`,
            :func:`~blocksparse_fa.bias`, :func:`~blocksparse_fa.softcap` or a sum such as
            ``alibi(slopes) + bias(t) + softcap(cap)``) applied to the scaled scores before the
            softmax, ALiBi at the positions the mask sees (``align``), the bias at the tensors' row
            and key indices; gradients flow to q, k and v through it, and to its slopes and bias
            tensors when they require grad (its constants get none). Changing its values compiles
            nothing new. Under ``torch.compile`` it runs inside the custom op (tensor arguments).
            On the PyTorch backend, eagerly, also a Flex-style callable
            (:func:`~blocksparse_fa.score_fn`).
        kernel_options: which kernels run and how, for this call only: a
            :class:`~blocksparse_fa.KernelOptions` or a ``dict`` of its fields (e.g.
            ``{"backward": "triton", "lists": "auto"}``); None: the defaults. Eager and compiled calls
            choose the same kernels (:func:`~blocksparse_fa.explain` shows which).

    Returns:
        ``out`` ``(B, H, Lq, Dv)`` (q's leading dims) in q's dtype (and ``lse`` if asked). Fully
        masked query rows give zeros in the output and zero gradients; their LSE is ``-inf``.
        Meta tensors give meta outputs of the right shapes (nothing is computed).

    Under ``torch.compile`` the call becomes the custom op ``blocksparse_fa::attention_fwd``
    (see :func:`blocksparse_fa.attention_op`). Inside ``torch.autocast``, q, k and v are cast as
    autocast casts SDPA's inputs (to the region's dtype; float64 stays), and the kernels run with
    their own accumulation precision; every entry point does the same.
    """
    q4, k4, v4, lead = flatten_batch(q, k, v)
    s = check_qkv(q4, k4, v4, dv_ok=True)
    if not enable_gqa and s.H != s.Hkv:
        raise ValueError(f"enable_gqa=False but q has H={s.H} heads and k/v have Hkv={s.Hkv}: pass enable_gqa=True "
                         f"(the default) for grouped-query attention")
    scale, dropout_p = check_scalars(scale, dropout_p)
    scale = 1.0 / math.sqrt(s.D) if scale is None else scale  # q's and k's head dim, before any padding
    if isinstance(mask, torch.Tensor):
        mask = bool_mask_to_mask(mask, tuple(q.shape[:-3]), s.H, s.Lq, s.Lk, "mask", q4.device)
    score_mod = check_score_mod(score_mod, s.H)
    if score_mod is not None and score_mod.fn is None:
        score_mod = score_mod.bind(lead if lead is not None else (s.B,), s.H, s.Lq, s.Lk, q4.device)
    q4, k4, v4, dv = dispatch.pad_head_dims(q4, k4, v4)  # Dv != D: one head dim for the kernels
    s = Shapes(s.B, s.H, s.Hkv, s.Lq, s.Lk, q4.shape[-1])  # no dataclasses.replace: fewer guards when traced
    res = device_intervals(q4, k4, v4, mask, s, scale, dropout_p, dropout_seed, score_mod, backend, align, return_lse,
                           kernel_options)
    if res is not None:  # e.g. causal() & document(ids): intervals built on the device, no layout
        pass
    elif torch.compiler.is_compiling():  # one node of the graph: the custom op
        from .custom_op import compiled_call

        res = compiled_call(q4, k4, v4, mask, block_size, scale, dropout_p, dropout_seed, return_lse, backend, rewrite,
                            check_align(align, mask if isinstance(mask, BlockLayout) else None), score_mod,
                            kernel_options)
    elif q4.device.type == "meta":
        from .custom_op import attention_op

        res = attention_op(q4, k4, v4, mask, scale=scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
                           return_lse=return_lse, backend=backend, block_size=block_size, rewrite=rewrite,
                           align=align, score_mod=score_mod, kernel_options=kernel_options)
    else:
        be = resolve_backend(backend, q4.device, q4.dtype)
        if be == "triton" and score_mod is not None and score_mod.fn is not None:
            if backend != "auto":
                raise NotImplementedError("score_mod: score_fn() callables run on the PyTorch backend only "
                                          "(backend='torch' or 'auto'); the Triton kernels fuse alibi(), bias() "
                                          "and softcap()")
            be = "torch"  # a Python callable cannot enter the kernels: the PyTorch backend, on any device
        layout = layout_for(mask, s, q4.device, block_size, rewrite, align)
        seed = draw_seed(dropout_p, dropout_seed)
        out, lse = run(q4, k4, v4, layout, s, scale, dropout_p, seed, backend, be, rewrite, return_lse, score_mod,
                       as_options(kernel_options))
        res = (out, lse) if return_lse else out
    if return_lse:
        return unflatten_batch(dispatch.slice_head_dim(res[0], dv), lead), unflatten_batch(res[1], lead)
    return unflatten_batch(dispatch.slice_head_dim(res, dv), lead)
