"""Hugging Face ``transformers`` integration: run a model's attention on block-sparse attention.

    import blocksparse_fa as bsfa
    from blocksparse_fa.integrations.transformers import register

    register("longformer")                 # or any Mask / DSL text; name defaults to "blocksparse"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="blocksparse")

:func:`register` adds two functions under ``name``:

1. an **attention function** to ``transformers.AttentionInterface`` with the library's contract
   ``fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)
   -> (attn_output (B, Lq, H, D), None)``, where query is ``(B, H, Lq, D)`` and key/value
   ``(B, Hkv, Lk, D)`` (grouped-query attention is handled by our kernels, no ``repeat_kv``);
2. a **mask function** to ``transformers.masking_utils.AttentionMaskInterface``. Without one,
   ``transformers`` treats an unknown implementation as needing no mask at all and passes
   ``attention_mask=None`` to every layer -- padding would be silently ignored.

How the model's mask is combined with the pattern
-------------------------------------------------
The attention computed is ``pattern & model_mask``, where the model's mask (causality, padding,
sliding windows, packed sequences, ...) arrives in one of four forms:

* ``None``: no padding and a plain causal (or bidirectional) model. The mask used is
  ``pattern & causal`` when the layer is causal (``is_causal`` kwarg, else ``module.is_causal``,
  default True), else ``pattern`` -- the same rule as ``transformers``' SDPA path.
* **key-padding form** ``(B, 1, 1, Lk)`` bool, produced by our mask function for the common case: the
  model's mask is the standard causal mask, queries are bottom-right aligned with the keys (no cache,
  or a dynamic cache) and there is padding. The mask used is ``pattern & causal & document(ids)``
  with per-batch ids ``0`` for every valid key and a distinct id for each padded token, so that a
  valid query keeps exactly the valid keys (as in SDPA) and the layout stays block-sparse and
  ``O(B * Lk)`` to describe -- the ``Lq x Lk`` mask is never built. Deliberate difference: a
  *padded* query row attends only to itself (in SDPA it sees the valid keys, or nothing for a left-
  padded row). Padded positions are ignored by losses and by generation, and no valid position can
  see a padded one, so logits and gradients at valid positions are identical.
* **packed sequences** (``position_ids`` that restart at 0, no attention mask, no cache: what
  ``DataCollatorWithFlattening`` produces): transformers marks each new sequence where a position
  is not the previous one plus 1; our mask function recognises that mask and hands the layers the
  sequence ids ``(B, L)`` instead of an ``L x L`` mask, and the mask used is ``pattern & causal &
  document(ids)``. With an interval pattern (``causal``, ``sliding_window(w)``, ...) it runs on
  intervals built on the device: nothing read on the host, and under ``torch.compile`` one graph
  for every packing.
* **any other 4D mask** ``(B, 1 or H, Lq, Lk)`` (bool, or additive with values 0 / very negative):
  sliding-window models, packed sequences, static caches, user-supplied 4D masks. It is used
  exactly, as ``pattern & dense_mask(keep)`` (``O(B * Lq * Lk)``, like SDPA's own mask). Additive
  masks holding real biases (ALiBi-style) are rejected.

Score modifiers: a model that passes ``softcap=`` to its attention function (Gemma 2's
``attn_logit_softcapping``) gets it as the fused :func:`~blocksparse_fa.softcap`, after the scale
and before the mask, as the model's own eager attention applies it. ``register(..., score_mod=)``
adds a modifier of your own to every layer (e.g. ALiBi slopes, a bias broadcastable to every layer's
``(B, H, Lq, Lk)``); it combines with the model's soft-cap by ``+``.

Positions: patterns align queries bottom-right with the keys (query ``i`` at ``i + Lk - Lq``), which
is exact without a cache and with a dynamic cache (prefill and decoding). With a ``StaticCache`` the
model's own mask stays exact (dense path) but a position-dependent pattern (windows, ...) is placed
as if the query sat at the end of the cache buffer: use a dynamic cache with such patterns.

Under ``torch.compile`` the attention itself is a custom op (no graph break), but building a layout
from padding (the document ids come from tensor values) breaks the graph once per forward.

Context parallelism
-------------------
``register(mask, context_parallel=group, plan=plan)`` runs the attention of a model whose sequence
is sharded across the ranks of ``group`` (a process group or a 1-D ``DeviceMesh``) through
:func:`blocksparse_fa.distributed.context_parallel_attention`. Every rank feeds the model its own
tokens, ``plan.indices(rank)``, with those indices as ``position_ids`` (so rotary positions are the
global ones), and gets its rows of the logits (``plan.gather`` reassembles them)::

    plan = plan_context_parallel(pattern & causal(), L, world, heads=(H, Hkv), head_dim=D)
    register(pattern, name="bsfa_cp", context_parallel=group, plan=plan)
    idx = plan.indices(rank)
    out = model(input_ids=ids[:, idx], position_ids=idx[None])

The mask is ``pattern & causal`` for causal layers (``pattern`` when it already has ``causal`` as a
factor) and the plan must be made for exactly that mask. Without a plan, the ranks hold contiguous
pieces in rank order. The model's own mask is taken to be the plain causal (or bidirectional) one:
padding and caches are refused with an error, and position-dependent model masks (sliding-window
layers, packed sequences) must be written into the pattern. Parameter gradients are per rank: sum
them across the group (or let data-parallel wrappers on another mesh dimension do it).
"""

from __future__ import annotations

import types
import weakref

import torch

from ..mask.expr import Mask
from ..mask.expr import And
from ..mask.documents import _runs as document_runs
from ..mask.primitives import Causal, causal, dense_mask, document
from ..mask.score import ScoreMod, softcap
from ..ops.custom_op import attention_op
from ..ops.options import as_options
from ..ops.prepare import as_mask

__all__ = ["register", "unregister", "make_attention_function", "make_mask_function", "make_cp_attention_function",
           "make_cp_mask_function", "key_padding_ids"]

_registered: dict = {}


def _transformers():
    """``transformers``' two registries; an ImportError that names the extra when it is missing."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("the transformers integration needs transformers >= 4.56: "
                          f"pip install 'blocksparse_fa[hf]' ({e})") from e
    return AttentionInterface, AttentionMaskInterface


def _as_mask(mask) -> Mask:
    if mask is None or isinstance(mask, (str, Mask)):
        return as_mask(mask)
    raise TypeError(f"mask must be a Mask, DSL text / pattern name or None, got {type(mask).__name__}")


def key_padding_ids(valid: torch.Tensor) -> torch.Tensor:
    """Document ids ``(B, Lk)`` that turn key validity into a ``document`` mask.

    Valid keys get id 0; padded keys get distinct ids (negative before the first valid key, positive
    after it), so left- and right-padded rows stay sorted (the compiler's fast path).
    """
    B, L = valid.shape
    j = torch.arange(L, device=valid.device).expand(B, L)
    first = torch.where(valid.any(1), valid.int().argmax(1), torch.full((B,), L, device=valid.device))
    pad_ids = torch.where(j < first[:, None], j - L, j + 1)
    return torch.where(valid, torch.zeros_like(pad_ids), pad_ids)


def _keep_from_4d(am: torch.Tensor) -> torch.Tensor:
    if am.dtype == torch.bool:
        return am
    if not am.dtype.is_floating_point:
        return am != 0
    neg = am <= torch.finfo(am.dtype).min / 2
    if not bool(((am == 0) | neg | torch.isneginf(am)).all()):
        raise ValueError("blocksparse attention: the additive attention_mask holds biases other than 0/-inf; "
                         "only masking is supported")
    return ~neg


class _LastMask:
    """One-entry cache: the mask built for the attention_mask tensor of the current forward pass."""

    def __init__(self):
        self.ref = None
        self.key = None
        self.mask = None

    def get(self, am, key):
        if self.ref is not None and self.ref() is am and self.key == key:
            return self.mask
        return None

    def put(self, am, key, mask):
        self.ref, self.key, self.mask = weakref.ref(am), key, mask


def _check_score_mod(score_mod):
    if score_mod is not None and (not isinstance(score_mod, ScoreMod) or score_mod.fn is not None):
        raise TypeError(f"score_mod must be a ScoreMod of alibi(), bias() and softcap() terms or None, got "
                        f"{score_mod if isinstance(score_mod, ScoreMod) else type(score_mod).__name__}")
    return score_mod


def _with_model_softcap(score_mod, cap):
    """The registered modifier plus the model's ``softcap`` kwarg (None: none)."""
    if cap is None:
        return score_mod
    return softcap(cap) if score_mod is None else score_mod + softcap(cap)


def make_attention_function(mask, *, block_size=None, backend: str = "auto", score_mod=None, kernel_options=None):
    """The ``AttentionInterface`` function running ``mask`` combined with the model's mask (and
    ``score_mod`` plus the model's ``softcap``, see *Score modifiers* above), with
    ``kernel_options`` (:class:`~blocksparse_fa.KernelOptions`) on every call."""
    opts = as_options(kernel_options).encode()  # a string: a constant under torch.compile
    pattern = _as_mask(mask)
    pattern_causal = pattern & causal()
    cache = _LastMask()
    score_mod = _check_score_mod(score_mod)

    def blocksparse_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                      **kwargs):
        mod = _with_model_softcap(score_mod, kwargs.get("softcap"))
        if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
            raise ValueError("blocksparse attention does not support attention sinks (`s_aux`)")
        B, H, Lq, D = query.shape
        Lk = key.shape[2]
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        if attention_mask is None:
            m = pattern_causal if is_causal else pattern
        elif attention_mask.dim() == 2 and not attention_mask.dtype.is_floating_point \
                and attention_mask.dtype != torch.bool:  # packed sequences' ids, from our mask function
            m = pattern_causal & document_runs(attention_mask.to(query.device))
        else:
            if attention_mask.dim() != 4:
                raise ValueError(f"blocksparse attention expects a 4D attention_mask or None, got shape "
                                 f"{tuple(attention_mask.shape)}")
            try:
                version = attention_mask._version
            except RuntimeError:  # inference-mode tensors have no version counter: do not cache
                version = None
            ck = (tuple(attention_mask.shape), version, Lq, Lk, str(query.device))
            m = cache.get(attention_mask, ck) if version is not None else None
            if m is None:
                keep = _keep_from_4d(attention_mask)
                keep = keep[..., :Lk]  # as transformers' eager path: the first Lk key columns
                if keep.shape[-1] != Lk:
                    raise ValueError(f"attention_mask has {keep.shape[-1]} key columns, expected {Lk}")
                if keep.shape[-2] == 1 and keep.shape[1] == 1:  # key-padding form (B, 1, 1, Lk)
                    valid = keep[:, 0, 0, :].expand(B, Lk)
                    m = pattern_causal & document(key_padding_ids(valid).to(query.device))
                else:
                    if keep.shape[-2] != Lq:
                        raise ValueError(f"attention_mask has {keep.shape[-2]} query rows, expected {Lq}")
                    m = pattern & dense_mask(keep.to(query.device).contiguous())
                cache.put(attention_mask, ck, m)
        out = attention_op(query, key, value, m, scale=scaling, dropout_p=float(dropout or 0.0),
                           backend=backend, block_size=block_size, score_mod=mod, kernel_options=opts)
        return out.transpose(1, 2).contiguous(), None

    blocksparse_attention_forward.pattern = pattern
    return blocksparse_attention_forward


def _with_causal(pattern: Mask) -> Mask:
    """``pattern & causal()``, or ``pattern`` itself when ``causal`` is already one of its factors."""
    factors = pattern.children if isinstance(pattern, And) else (pattern,)
    return pattern if any(isinstance(f, Causal) for f in factors) else pattern & causal()


def make_cp_attention_function(mask, *, context_parallel, plan=None, block_size=None, backend: str = "auto",
                               kernel_options=None):
    """The ``AttentionInterface`` function for a sequence sharded across ``context_parallel`` (see
    *Context parallelism* above): query ``(B, H, L_r, D)``, key/value ``(B, Hkv, L_r, D)`` of this
    rank's tokens -> ``(B, L_r, H, D)``."""
    from ..distributed import context_parallel_attention

    pattern = _as_mask(mask)
    masks = {True: _with_causal(pattern), False: pattern}
    if plan is not None and plan.layout.mask not in masks.values():
        raise ValueError(f"the plan is for mask {plan.layout.mask}; a causal model with pattern {pattern} needs a "
                         f"plan for {masks[True]} (plan_context_parallel({masks[True]}, ...))")

    def blocksparse_cp_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                         **kwargs):
        if kwargs.get("softcap") is not None:
            raise NotImplementedError("blocksparse context parallelism does not support `softcap` (score modifiers "
                                      "run without context parallelism)")
        if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
            raise ValueError("blocksparse attention does not support attention sinks (`s_aux`)")
        if attention_mask is not None:
            raise ValueError("blocksparse context parallelism got an attention_mask from the model: padding, caches "
                             "and model-side masks are not supported (write the mask into the pattern)")
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        m = masks[is_causal]
        if plan is not None and plan.layout.mask != m:
            raise ValueError(f"this {'causal' if is_causal else 'bidirectional'} layer computes {m}, the plan is for "
                             f"{plan.layout.mask}")
        out = context_parallel_attention(query, key, value, None if plan is not None else m, plan=plan,
                                         group=context_parallel, scale=scaling, dropout_p=float(dropout or 0.0),
                                         backend=backend, block_size=None if plan is not None else block_size,
                                         kernel_options=kernel_options)
        return out.transpose(1, 2).contiguous(), None

    blocksparse_cp_attention_forward.pattern = pattern
    return blocksparse_cp_attention_forward


def make_cp_mask_function():
    """The ``AttentionMaskInterface`` function under context parallelism: ``None`` (the pattern
    carries the mask); padding and caches raise."""

    def blocksparse_cp_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                            attention_mask=None, **kwargs):
        if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor) or q_offset or kv_offset \
                or q_length != kv_length:
            raise ValueError("blocksparse context parallelism runs without a cache (training or a full forward): "
                             f"got q_length {q_length}, kv_length {kv_length}, offsets {q_offset}, {kv_offset}")
        if attention_mask is not None and not bool(attention_mask.to(torch.bool).all()):
            raise ValueError("blocksparse context parallelism does not support padding (attention_mask with zeros)")
        return None

    return blocksparse_cp_mask


def _closure(fn, qualname: str):
    """The closure variables of ``fn`` by name when it is the nested function ``qualname``, else None."""
    if getattr(fn, "__qualname__", None) != qualname or getattr(fn, "__closure__", None) is None:
        return None
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))


def _packed_causal(mask_function, kwargs) -> bool:
    """Whether ``mask_function`` is the mask transformers builds for causal packed sequences
    (``position_ids`` restarting at 0, no attention mask, no cache): ``and_masks(
    remap_positions_for_packed_sequence(causal_mask_function, position_ids),
    packed_sequence_mask_function(ids))``. Causal on the remapped positions inside one sequence is
    causal on the packed indices, so that mask is ``causal & document(ids)``. Eagerly the closures
    are checked exactly; under ``torch.compile`` (Dynamo does not expose closures) the mask is
    recognised by its form: transformers' ``and_masks`` without a local window (``local_size``:
    sliding-window and chunked layers) and without overlay functions (``use_vmap``)."""
    # isinstance and a plain attribute read: Dynamo answers getattr-with-default as if absent
    if not isinstance(mask_function, types.FunctionType) or mask_function.__qualname__ != "and_masks.<locals>.and_mask":
        return False
    if kwargs.get("local_size") is not None or kwargs.get("use_vmap"):
        return False
    if torch.compiler.is_compiling():
        return True
    from transformers.masking_utils import causal_mask_function

    fns = _closure(mask_function, "and_masks.<locals>.and_mask").get("mask_functions")
    if not isinstance(fns, tuple) or len(fns) != 2:
        return False
    remap = _closure(fns[0], "remap_positions_for_packed_sequence.<locals>.inner_mask")
    packed = _closure(fns[1], "packed_sequence_mask_function.<locals>.inner_mask")
    return remap is not None and packed is not None and remap.get("mask_function") is causal_mask_function


def _packed_sequence_ids(mask_function, batch_size: int, length: int, device) -> torch.Tensor:
    """Sequence ids ``(B, L)`` of a causal packed-sequence mask, read off the mask itself: token
    ``x`` starts a new sequence when it may not see token ``x - 1`` (``O(L)`` evaluations)."""
    b = torch.arange(batch_size, device=device).view(-1, 1)
    x = torch.arange(length, device=device).view(1, -1)
    same = mask_function(b, 0, x, x - 1).expand(batch_size, length)
    new = torch.cat([torch.ones_like(same[:, :1]), ~same[:, 1:]], dim=1)
    return torch.cumsum(new.to(torch.int32), dim=1, dtype=torch.int32) - 1


def make_mask_function():
    """The ``AttentionMaskInterface`` function: the compact key-padding form (or ``None``) for the
    plain causal mask with aligned queries, SDPA's boolean 4D mask for everything else."""
    _transformers()
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    def blocksparse_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                         mask_function=causal_mask_function, attention_mask=None, **kwargs):
        kwargs.pop("allow_is_causal_skip", None)
        aligned = (not isinstance(q_offset, torch.Tensor) and not isinstance(kv_offset, torch.Tensor)
                   and q_offset + q_length == kv_offset + kv_length)
        if mask_function is causal_mask_function and aligned:
            if attention_mask is None:
                return None
            # the 2D mask covers the absolute key positions seen so far; keys past its end are padding
            am = attention_mask.to(torch.bool)
            missing = kv_offset + kv_length - am.shape[-1]
            if missing > 0:
                am = torch.nn.functional.pad(am, (0, missing), value=False)
            valid = am[:, kv_offset:kv_offset + kv_length]
            if bool(valid.all()):
                return None
            return valid[:, None, None, :]
        if attention_mask is None and aligned and q_offset == 0 and q_length == kv_length \
                and _packed_causal(mask_function, kwargs):  # packed sequences: their ids (B, L) go to the layers
            return _packed_sequence_ids(mask_function, batch_size, q_length, kwargs.get("device", "cpu"))
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         allow_is_causal_skip=False, **kwargs)

    return blocksparse_mask


def register(mask=None, name: str = "blocksparse", *, block_size=None, backend: str = "auto",
             context_parallel=None, plan=None, score_mod=None, kernel_options=None) -> str:
    """Register ``mask`` as attention implementation ``name`` for ``transformers`` models.

    Args:
        mask: the pattern (Mask, DSL text or pattern name); ``None`` is dense (the model's own mask
            only). Causality and padding come from the model and are combined with it.
        name: the ``attn_implementation`` string to use in ``from_config``/``from_pretrained``.
        block_size: layout block size (default 128).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        context_parallel: a process group or 1-D ``DeviceMesh``: the model's input is this rank's
            shard of a sequence split across it (see *Context parallelism* in this module's docs).
        plan: the sharding's :class:`~blocksparse_fa.distributed.ContextParallelPlan` (with
            ``context_parallel``; default: contiguous shards in rank order).
        score_mod: a score modifier for every layer (see *Score modifiers* in this module's docs);
            not with ``context_parallel``.
        kernel_options: :class:`~blocksparse_fa.KernelOptions` (or a dict of its fields) for every
            layer's call.

    Returns:
        ``name``. Registering the same name again replaces the pattern.
    """
    AttentionInterface, AttentionMaskInterface = _transformers()

    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
    if context_parallel is None:
        if plan is not None:
            raise ValueError("plan needs context_parallel=<process group or 1-D DeviceMesh>")
        fn = make_attention_function(mask, block_size=block_size, backend=backend, score_mod=score_mod,
                                     kernel_options=kernel_options)
        mask_fn = make_mask_function()
    else:
        if score_mod is not None:
            raise NotImplementedError("score_mod: score modifiers are not supported with context parallelism")
        fn = make_cp_attention_function(mask, context_parallel=context_parallel, plan=plan, block_size=block_size,
                                        backend=backend, kernel_options=as_options(kernel_options).encode())
        mask_fn = make_cp_mask_function()
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, mask_fn)
    _registered[name] = fn
    return name


def unregister(name: str = "blocksparse") -> None:
    """Remove an implementation added by :func:`register`."""
    AttentionInterface, AttentionMaskInterface = _transformers()

    if _registered.pop(name, None) is not None:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)
