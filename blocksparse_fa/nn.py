"""``torch.nn`` modules on top of the block-sparse attention custom op.

Two modules, two levels:

* :class:`BlockSparseAttention` is the *attention core*: it takes already projected ``q, k, v``
  ``(B, H, L, D)`` (``k``/``v`` may have fewer heads: GQA/MQA) and returns ``(B, H, Lq, D)``. It owns
  no parameters of its own (a score modifier's learnable tensors, if given, are registered on it),
  so it drops into any existing attention block in place of ``F.scaled_dot_product_attention``.
* :class:`BlockSparseMultiheadAttention` is a complete layer: input/output projections, grouped-query
  attention (``num_kv_heads``), optional rotary position embeddings, attention dropout, and the core
  above. Input and output are ``(B, L, embed_dim)`` (batch first; ``batch_first=False`` takes
  ``(L, B, embed_dim)`` as :class:`torch.nn.MultiheadAttention` does by default). Called as
  ``nn.MultiheadAttention`` is -- ``(query, key, value, key_padding_mask=..., attn_mask=...)`` -- it
  returns ``(output, None)``, and :meth:`BlockSparseMultiheadAttention.from_torch` converts an
  existing ``nn.MultiheadAttention`` with its weights.

Both call :func:`blocksparse_fa.ops.custom_op.attention_op` with an integer mask *handle* registered
(and pinned) when the module is built, so ``torch.compile(model, fullgraph=True)`` traces them
without graph breaks and without Python in the compiled graphs. Compiled layouts are cached in the
handle's registry entry per ``(q_len, kv_len, device)``; :meth:`BlockSparseAttention.layout` returns
the cached one.
"""

from __future__ import annotations


import torch
from torch import nn

from dataclasses import replace

from .compiler.layout import BlockLayout
from .mask.primitives import Document, dense_mask, key_set
from .mask.score import ScoreMod, bias as _bias
from .ops.api import as_mask, check_align
from .ops.custom_op import attention_op, register_mask, registry
from .ops.options import as_options
from .ops.sdpa import top_left_causal
from .ops.validate import _OneEntry, keep_from_tensor

__all__ = ["BlockSparseAttention", "BlockSparseMultiheadAttention", "apply_rotary"]


def _as_mask(mask):
    return mask if isinstance(mask, BlockLayout) else as_mask(mask)


class BlockSparseAttention(nn.Module):
    """Block-sparse scaled-dot-product attention over given ``q, k, v`` (no parameters).

    Args:
        mask: a :class:`~blocksparse_fa.Mask`, DSL text or pattern name (``"causal & longformer"``),
            a compiled :class:`~blocksparse_fa.BlockLayout` (fixed lengths), or ``None`` (dense).
            Query row ``i`` sits at position ``i + Lk - Lq`` (bottom-right alignment).
        block_size: layout block size (default 128).
        scale: softmax scale (default ``1/sqrt(D)``).
        dropout: attention dropout probability, applied in training mode only.
        backend: ``"auto"`` (Triton on CUDA, PyTorch on CPU), ``"triton"`` or ``"torch"``.
        align: ``"bottom_right"`` (default) or ``"top_left"``: where query row ``i`` sits when
            ``Lq != Lk`` (see :func:`blocksparse_fa.attention`); a compiled layout keeps its own.
        context_parallel: a process group or 1-D DeviceMesh: q, k, v are this rank's shard of a
            sequence split across the group (self-attention), computed by
            :func:`blocksparse_fa.distributed.context_parallel_attention`; pass the sharding's plan
            as ``forward(..., cp_plan=plan)`` (default: contiguous shards in rank order).
        score_mod: a score modifier applied on every call (:func:`~blocksparse_fa.alibi`,
            :func:`~blocksparse_fa.bias`, :func:`~blocksparse_fa.softcap` or a sum). Its tensors are
            registered on the module: an ``nn.Parameter`` (learned ALiBi slopes, a learned bias) as
            the parameter ``score_slopes`` / ``score_bias`` (it gets gradients and the optimizer
            sees it), any other tensor as a non-persistent buffer (it moves with ``.to()``).
            ``forward(..., score_mod=)`` adds a per-call modifier to it. Not with
            ``context_parallel``.
        kernel_options: the module's :class:`~blocksparse_fa.KernelOptions` (or a dict of its
            fields), used on every call; ``forward(..., kernel_options=)`` overrides it per call.

    Shapes:
        q ``(B, H, Lq, D)``, k ``(B, Hkv, Lk, D)``, v ``(B, Hkv, Lk, Dv)`` with ``H % Hkv == 0`` ->
        ``(B, H, Lq, Dv)``.
    """

    def __init__(self, mask=None, *, block_size=None, scale=None, dropout: float = 0.0, backend: str = "auto",
                 align: str | None = None, context_parallel=None, score_mod=None, kernel_options=None):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.mask = _as_mask(mask)
        self.align = check_align(align, self.mask if isinstance(self.mask, BlockLayout) else None)
        self.handle = register_mask(self.mask, block_size, owner=self)
        self.block_size = registry.block_size(self.handle)
        self.scale = scale
        self.dropout = float(dropout)
        self.backend = backend
        self.context_parallel = context_parallel
        self.kernel_options = kernel_options
        self._score_mod = _register_score_mod(self, score_mod)
        if self._score_mod is not None and context_parallel is not None:
            raise NotImplementedError("score_mod: score modifiers are not supported with context parallelism")

    @property
    def kernel_options(self):
        """The module's :class:`~blocksparse_fa.KernelOptions` (assign a KernelOptions, a dict or
        None to change them)."""
        return as_options(self._kernel_options)

    @kernel_options.setter
    def kernel_options(self, value) -> None:
        # kept as the encoded string: a constant that torch.compile passes to the op as it is
        self.__dict__["_kernel_options"] = as_options(value).encode()

    @property
    def score_mod(self) -> ScoreMod | None:
        """The module's score modifier, with its registered (current) tensors."""
        mod = self.__dict__.get("_score_mod")
        if mod is None:
            return None
        get = lambda name, t: getattr(self, name) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return replace(mod, slopes=get("score_slopes", mod.slopes), cap=get("score_cap", mod.cap),
                       bias=get("score_bias", mod.bias))

    def _call_score_mod(self, score_mod):
        mod = self.score_mod
        if score_mod is None:
            return mod
        if not isinstance(score_mod, ScoreMod):
            raise TypeError(f"score_mod must be a ScoreMod (blocksparse_fa.alibi(...), bias(...), softcap(...), or "
                            f"a sum) or None, got {type(score_mod).__name__}")
        return score_mod if mod is None else mod + score_mod

    def __setstate__(self, state):  # copy.deepcopy / unpickling: the copy registers and pins its own handle
        super().__setstate__(state)
        self.__dict__.setdefault("align", "bottom_right")  # modules pickled before align existed
        self.__dict__.setdefault("_kernel_options", "")
        self.handle = register_mask(self.mask, self.block_size, owner=self)

    def layout(self, q_len: int, kv_len: int | None = None, device=None) -> BlockLayout:
        """The compiled layout for these lengths and device (cached per ``(q_len, kv_len, device)``)."""
        return registry.layout(self.handle, q_len, kv_len, device, self.align)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool = False, cp_plan=None,
                score_mod=None, kernel_options=None, mask=None):
        """Attention of ``q, k, v`` under the module's mask, intersected with ``mask`` when given: a
        per-call :class:`~blocksparse_fa.Mask` such as this step's ``document(ids)`` (packed
        sequences). Masks that keep one key interval per row and hold a ``document`` (the module's,
        or the intersection) build their intervals on the device: no layout is compiled, and under
        ``torch.compile`` new ids never recompile."""
        p = self.dropout if self.training else 0.0
        mod = self._call_score_mod(score_mod)
        opts = self._kernel_options if kernel_options is None else kernel_options
        if getattr(self, "context_parallel", None) is not None:
            if mod is not None:
                raise NotImplementedError("score_mod: score modifiers are not supported with context parallelism")
            from .distributed import context_parallel_attention

            m = self.mask.mask if isinstance(self.mask, BlockLayout) else self.mask
            return context_parallel_attention(q, k, v, None if cp_plan is not None else m, plan=cp_plan,
                                              group=self.context_parallel, scale=self.scale, dropout_p=p,
                                              return_lse=return_lse, backend=self.backend,
                                              block_size=None if cp_plan is not None else self.block_size,
                                              kernel_options=opts)
        if cp_plan is not None:
            raise ValueError("cp_plan needs a module built with context_parallel=<process group or mesh>")
        return attention_op(q, k, v, self._call_mask(mask), scale=self.scale, dropout_p=p, return_lse=return_lse,
                            backend=self.backend, block_size=self.block_size, align=self.align, score_mod=mod,
                            kernel_options=opts)

    def _call_mask(self, mask):
        """The handle, or a Mask: the module's intersected with a per-call one, or the module's own
        when it holds a document (the device-interval path takes it)."""
        own = self.mask.mask if isinstance(self.mask, BlockLayout) else self.mask
        if mask is not None:
            if isinstance(self.mask, BlockLayout):
                raise ValueError("a per-call mask needs a module built with a Mask (not a compiled BlockLayout, "
                                 "which is fixed to its lengths)")
            return own & as_mask(mask)
        if not isinstance(self.mask, BlockLayout) and _holds_document(own):
            return own
        return self.handle

    def extra_repr(self) -> str:
        m = self.mask.mask if isinstance(self.mask, BlockLayout) else self.mask
        al = "" if self.align == "bottom_right" else f", align={self.align!r}"
        sm = "" if self.__dict__.get("_score_mod") is None else f", score_mod={str(self.score_mod)!r}"
        return f"mask={str(m)!r}, block_size={self.block_size}, dropout={self.dropout}{al}{sm}"


def _holds_document(mask) -> bool:
    return any(isinstance(leaf, Document) for leaf in mask.leaves())


def _register_score_mod(module: nn.Module, score_mod) -> ScoreMod | None:
    """Register a score modifier's tensors on ``module`` (parameters stay parameters, other tensors
    become non-persistent buffers); returns the modifier (None for none)."""
    if score_mod is None:
        return None
    if not isinstance(score_mod, ScoreMod):
        raise TypeError(f"score_mod must be a ScoreMod (blocksparse_fa.alibi(...), bias(...), softcap(...), or a "
                        f"sum) or None, got {type(score_mod).__name__}")
    if score_mod.fn is not None:
        raise ValueError("score_mod: the nn modules run through the custom op, which takes alibi(), bias() and "
                         "softcap(); a score_fn() callable runs with blocksparse_fa.attention(backend='torch')")
    for name, t in (("score_slopes", score_mod.slopes), ("score_cap", score_mod.cap), ("score_bias", score_mod.bias)):
        if isinstance(t, nn.Parameter):
            module.register_parameter(name, t)
        elif isinstance(t, torch.Tensor):
            module.register_buffer(name, t, persistent=False)
    return score_mod


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (rotate-half convention) of ``x`` ``(B, H, L, D)`` at ``positions`` ``(L,)``."""
    d = x.shape[-1]
    half = d // 2
    inv = base ** (-torch.arange(0, half, device=x.device, dtype=torch.float32) / half)
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:2 * half]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rot, x[..., 2 * half:]], dim=-1) if d % 2 else rot


def _version(t):
    return None if t is None else (id(t), None if t.is_inference() else t._version, tuple(t.shape))


def _is_additive_bias(attn_mask: torch.Tensor) -> bool:
    """A float ``attn_mask`` with values other than ``0``/``-inf`` (read: this breaks a compiled graph)."""
    if not attn_mask.dtype.is_floating_point or attn_mask.device.type == "meta":
        return False
    return not bool(((attn_mask == 0) | torch.isneginf(attn_mask)).all())


def _mha_masks(key_padding_mask, attn_mask, B: int, H: int, Lq: int, Lk: int, device) -> list:
    """Mask expressions for ``nn.MultiheadAttention``'s masks, where ``True`` in either means *masked*
    (the inverse of SDPA's ``attn_mask``); float masks add to the scores and are accepted when they
    only mask (``0``/``-inf``). Padding becomes ``~key_set(padded positions)`` (``O(B · Lk)``), an
    ``attn_mask`` a bit-packed ``dense_mask``."""
    out = []
    if attn_mask is not None:
        keep = ~attn_mask if attn_mask.dtype == torch.bool else keep_from_tensor("attn_mask", attn_mask)
        if keep.dim() == 2 and tuple(keep.shape) == (Lq, Lk):
            out.append(dense_mask(keep.to(device)))
        elif keep.dim() == 3 and tuple(keep.shape) == (B * H, Lq, Lk):
            out.append(dense_mask(keep.reshape(B, H, Lq, Lk).to(device)))
        else:
            raise ValueError(f"attn_mask must have shape (L, S) = {(Lq, Lk)} or (N * num_heads, L, S) = "
                             f"{(B * H, Lq, Lk)}, got {tuple(attn_mask.shape)}")
    if key_padding_mask is not None:
        kp = key_padding_mask if key_padding_mask.dim() == 2 else key_padding_mask.unsqueeze(0)
        if tuple(kp.shape) != (B, Lk):
            raise ValueError(f"key_padding_mask must have shape (N, S) = {(B, Lk)}, "
                             f"got {tuple(key_padding_mask.shape)}")
        pad = kp if kp.dtype == torch.bool else ~keep_from_tensor("key_padding_mask", kp)
        if bool(pad.any()):
            pos = torch.where(pad, torch.arange(Lk, device=pad.device), -1)
            out.append(~key_set(pos))
    return out


class BlockSparseMultiheadAttention(nn.Module):
    """Multi-head (grouped-query) attention layer with a block-sparse mask.

    Args:
        embed_dim: model width ``E``.
        num_heads: query heads ``H`` (head dim ``E // H`` unless ``head_dim`` is given).
        mask: the attention pattern (see :class:`BlockSparseAttention`); for a decoder include
            causality, e.g. ``"causal & longformer"``.
        num_kv_heads: key/value heads (``H`` by default; ``H % num_kv_heads == 0``; 1 = MQA).
        bias: bias in the projections.
        dropout: attention dropout probability (training mode only).
        head_dim: per-head width (default ``E // H``).
        rotary: apply rotary position embeddings to q and k (at the query positions ``align`` gives).
        rope_base: rotary base frequency.
        block_size, scale, backend, align, context_parallel, score_mod: as in
            :class:`BlockSparseAttention` (e.g. ``score_mod=bsfa.alibi(nn.Parameter(...))`` learns
            per-head ALiBi slopes; its tensors are registered on the inner ``attn`` module). With
            ``context_parallel``, the input is this rank's shard of the sequence (pass its plan as
            ``cp_plan=``; rotary positions are the plan's global token indices); self-attention
            only (no ``key``/``value``/``context``, no masks given as tensors).
        batch_first: inputs and outputs are ``(B, L, E)`` (default); ``False``: ``(L, B, E)``, the
            default of :class:`torch.nn.MultiheadAttention`.
        kdim, vdim: widths of the key and value inputs (default ``embed_dim``).
        device, dtype: of the parameters.

    Forward, two call forms:

    * ``layer(x)`` or ``layer(x, context)``: ``x`` ``(B, Lq, E)``; ``context`` ``(B, Lk, kdim)`` for
      cross-attention (keys and values are projected from it; default ``x``) -> ``(B, Lq, E)``.
    * ``layer(query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
      average_attn_weights=True, is_causal=False)``, as :class:`torch.nn.MultiheadAttention` ->
      ``(output, None)``. ``key_padding_mask`` ``(B, Lk)`` (``True`` = padding) and a bool
      ``attn_mask`` ``(Lq, Lk)`` or ``(B * H, Lq, Lk)`` (``True`` = *not* allowed, torch's MHA
      convention; float masks of ``0``/``-inf`` too) are intersected with the pattern exactly:
      padded keys are never attended (``~key_set(padded positions)``, ``O(B · Lk)``), and rows left
      with no key output zeros. A float ``attn_mask`` holding other values than ``0``/``-inf`` is an
      additive bias, as in torch: it runs as :func:`~blocksparse_fa.bias` (every block visited).
      ``is_causal=True`` adds a causal mask (top-left aligned, as
      torch's). The attention weights are never materialised, so ``need_weights=True`` raises; the
      second element is always ``None``. Masks given as tensors are rebuilt when the tensors change
      (an ``attn_mask`` is stored as one bit per element); building them reads tensor values, so
      under ``torch.compile`` it breaks the graph.

    Both forms take ``mask=``: a per-call :class:`~blocksparse_fa.Mask` intersected with the
    pattern, e.g. this step's packing ``document(ids)`` or ``document_from_positions(pos)``; with a
    pattern that keeps one key interval per row (``causal()``, windows) it runs on intervals built
    on the device, and under ``torch.compile`` new ids never recompile.
    """

    def __init__(self, embed_dim: int, num_heads: int, mask=None, num_kv_heads: int | None = None,
                 bias: bool = False, dropout: float = 0.0, *, head_dim: int | None = None, rotary: bool = False,
                 rope_base: float = 10000.0, block_size=None, scale=None, backend: str = "auto",
                 batch_first: bool = True, kdim: int | None = None, vdim: int | None = None,
                 align: str | None = None, context_parallel=None, score_mod=None, kernel_options=None, device=None,
                 dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; pass head_dim")
            head_dim = embed_dim // num_heads
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.rotary, self.rope_base = rotary, rope_base
        self.batch_first = bool(batch_first)
        fk = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias, **fk)
        self.k_proj = nn.Linear(self.kdim, num_kv_heads * head_dim, bias=bias, **fk)
        self.v_proj = nn.Linear(self.vdim, num_kv_heads * head_dim, bias=bias, **fk)
        self.out_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **fk)
        self.attn = BlockSparseAttention(mask, block_size=block_size, scale=scale, dropout=dropout, backend=backend,
                                         align=align, context_parallel=context_parallel, score_mod=score_mod,
                                         kernel_options=kernel_options)
        self._tensor_mask = _OneEntry()

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, mask=None, **kwargs) -> "BlockSparseMultiheadAttention":
        """A layer computing what ``mha`` computes, restricted to ``mask``, with copies of its weights
        (same device, dtype and ``batch_first``). ``kwargs`` go to the constructor (``block_size``,
        ``backend``, ``rotary``, ...). ``add_bias_kv`` and ``add_zero_attn`` are not supported."""
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"from_torch() takes a torch.nn.MultiheadAttention, got {type(mha).__name__}")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise NotImplementedError("from_torch(): add_bias_kv and add_zero_attn are not supported")
        w = mha.out_proj.weight
        bias = mha.in_proj_bias is not None
        layer = cls(mha.embed_dim, mha.num_heads, mask, bias=bias, dropout=mha.dropout, batch_first=mha.batch_first,
                    kdim=mha.kdim, vdim=mha.vdim, device=w.device, dtype=w.dtype, **kwargs)
        with torch.no_grad():
            if mha._qkv_same_embed_dim:
                wq, wk, wv = mha.in_proj_weight.chunk(3)
            else:
                wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
            for proj, wt in ((layer.q_proj, wq), (layer.k_proj, wk), (layer.v_proj, wv)):
                proj.weight.copy_(wt)
            if bias:
                for proj, b in zip((layer.q_proj, layer.k_proj, layer.v_proj), mha.in_proj_bias.chunk(3)):
                    proj.bias.copy_(b)
            layer.out_proj.weight.copy_(mha.out_proj.weight)
            if layer.out_proj.bias is not None:
                if mha.out_proj.bias is None:
                    layer.out_proj.bias.zero_()
                else:
                    layer.out_proj.bias.copy_(mha.out_proj.bias)
        return layer

    def __getstate__(self):  # pickling: the per-call mask cache holds a weak reference
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_tensor_mask"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._tensor_mask = _OneEntry()

    @property
    def mask(self):
        return self.attn.mask

    def layout(self, q_len: int, kv_len: int | None = None, device=None) -> BlockLayout:
        return self.attn.layout(q_len, kv_len, device)

    def _mask_with(self, key_padding_mask, attn_mask, is_causal, B, Lq, Lk, device):
        """The module's handle, or the pattern intersected with the call's masks (cached per tensors)."""
        if key_padding_mask is None and attn_mask is None and not is_causal:
            return self.attn.handle, None
        if device.type == "meta":  # shapes only: the masks cannot change them
            return self.attn.handle, None
        key = (_version(key_padding_mask), _version(attn_mask), bool(is_causal), B, Lq, Lk, str(device))
        anchor = key_padding_mask if key_padding_mask is not None else attn_mask
        hit = self._tensor_mask.get(anchor, key) if anchor is not None else None
        if hit is not None:
            return hit
        pattern, bs = self.attn.mask, self.attn.block_size
        m = pattern.mask if isinstance(pattern, BlockLayout) else pattern
        for part in _mha_masks(key_padding_mask, attn_mask, B, self.num_heads, Lq, Lk, device):
            m = m & part
        if is_causal:
            m = m & top_left_causal(Lq, Lk, self.attn.align)
        if anchor is not None:
            self._tensor_mask.put(anchor, key, (m, bs))
        return m, bs

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = False,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True, is_causal: bool = False,
                *, cp_plan=None, score_mod=None, kernel_options=None, mask=None):
        cp = getattr(self.attn, "context_parallel", None)
        if cp is not None and (key is not None or value is not None or key_padding_mask is not None
                               or attn_mask is not None or is_causal):
            raise ValueError("context parallelism shards self-attention: pass only the query (the rank's shard); "
                             "key/value, key_padding_mask, attn_mask and is_causal are not supported with it")
        if cp is None and cp_plan is not None:
            raise ValueError("cp_plan needs a module built with context_parallel=<process group or mesh>")
        if need_weights:
            raise NotImplementedError("need_weights=True: block-sparse attention never materialises the attention "
                                      "weights; call with need_weights=False (the output's second element is None)")
        mha_call = value is not None
        unbatched = query.dim() == 2
        x = query.unsqueeze(1 if not self.batch_first else 0) if unbatched else query
        ctx = x if key is None else (key.unsqueeze(1 if not self.batch_first else 0) if unbatched else key)
        val = ctx if value is None else (value.unsqueeze(1 if not self.batch_first else 0) if unbatched else value)
        if not self.batch_first:
            x, ctx, val = x.transpose(0, 1), ctx.transpose(0, 1), val.transpose(0, 1)
        lay = "(B, L, E)" if self.batch_first else "(L, B, E)"
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"query must have shape {lay} with E = {self.embed_dim}, got {tuple(query.shape)}")
        B, Lq, _ = x.shape
        for name, t, d in (("key", ctx, self.kdim), ("value", val, self.vdim)):
            if t.dim() != 3 or t.shape[0] != B or t.shape[-1] != d:
                raise ValueError(f"{name} must have shape {lay} with batch {B} and E = {d}, got {tuple(t.shape)}")
        Lk = ctx.shape[1]
        if val.shape[1] != Lk:
            raise ValueError(f"key and value must have the same length, got {Lk} and {val.shape[1]}")
        q = self.q_proj(x).view(B, Lq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(ctx).view(B, Lk, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(val).view(B, Lk, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if cp is not None:  # this rank's tokens sit at their global positions
            plan = cp_plan if cp_plan is not None else _contiguous_plan(self.attn, cp, Lq, x.device)
            if self.rotary:
                pos = plan.indices(_rank(cp), x.device)
                q, k = apply_rotary(q, pos, self.rope_base), apply_rotary(k, pos, self.rope_base)
            o = self.attn(q, k, v, cp_plan=plan, score_mod=score_mod, kernel_options=kernel_options)
            out = self.out_proj(o.transpose(1, 2).reshape(B, Lq, self.num_heads * self.head_dim))
            return out.transpose(0, 1) if not self.batch_first else out
        if self.rotary:
            q0 = Lk - Lq if self.attn.align == "bottom_right" else 0
            q = apply_rotary(q, torch.arange(q0, q0 + Lq, device=x.device), self.rope_base)
            k = apply_rotary(k, torch.arange(Lk, device=x.device), self.rope_base)
        if attn_mask is not None and _is_additive_bias(attn_mask):  # torch's float masks add to the scores
            if tuple(attn_mask.shape) not in ((Lq, Lk), (B * self.num_heads, Lq, Lk)):
                raise ValueError(f"attn_mask must have shape (L, S) = {(Lq, Lk)} or (N * num_heads, L, S) = "
                                 f"{(B * self.num_heads, Lq, Lk)}, got {tuple(attn_mask.shape)}")
            b = attn_mask if attn_mask.dim() == 2 else attn_mask.reshape(B, self.num_heads, Lq, Lk)
            score_mod = _bias(b.to(x.device)) if score_mod is None else _bias(b.to(x.device)) + score_mod
            attn_mask = None
        m, bs = self._mask_with(key_padding_mask, attn_mask, is_causal, B, Lq, Lk, x.device)
        if bs is None:
            o = self.attn(q, k, v, score_mod=score_mod, kernel_options=kernel_options, mask=mask)
        else:
            m = m if mask is None else m & as_mask(mask)
            p = self.attn.dropout if self.training else 0.0
            opts = self.attn._kernel_options if kernel_options is None else kernel_options
            o = attention_op(q, k, v, m, scale=self.attn.scale, dropout_p=p, backend=self.attn.backend, block_size=bs,
                             align=self.attn.align, score_mod=self.attn._call_score_mod(score_mod), kernel_options=opts)
        out = self.out_proj(o.transpose(1, 2).reshape(B, Lq, self.num_heads * self.head_dim))
        if not self.batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(1 if not self.batch_first else 0)
        return (out, None) if mha_call else out

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, rotary={self.rotary}, batch_first={self.batch_first}")


def _rank(group) -> int:
    from .distributed.comm import resolve_group

    return torch.distributed.get_rank(resolve_group(group))


def _contiguous_plan(attn: BlockSparseAttention, group, length: int, device):
    """The plan of contiguous shards in rank order (lengths gathered from the group)."""
    from .distributed.api import _default_plan
    from .distributed.comm import resolve_group

    pg = resolve_group(group)
    m = attn.mask.mask if isinstance(attn.mask, BlockLayout) else attn.mask
    return _default_plan(m, attn.block_size, pg, torch.distributed.get_world_size(pg), length, device)
