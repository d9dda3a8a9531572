"""``torch.nn`` modules on top of the block-sparse attention custom op.

Two modules, two levels:

* :class:`BlockSparseAttention` is the *attention core*: it takes already projected ``q, k, v``
  ``(B, H, L, D)`` (``k``/``v`` may have fewer heads: GQA/MQA) and returns ``(B, H, Lq, D)``. It owns
  no parameters, so it drops into any existing attention block in place of
  ``F.scaled_dot_product_attention``.
* :class:`BlockSparseMultiheadAttention` is a complete layer: input/output projections, grouped-query
  attention (``num_kv_heads``), optional rotary position embeddings, attention dropout, and the core
  above. Input and output are ``(B, L, embed_dim)`` (batch first).

Both call :func:`blocksparse_fa.ops.custom_op.attention_op` with an integer mask *handle* registered
(and pinned) when the module is built, so ``torch.compile(model, fullgraph=True)`` traces them
without graph breaks and without Python in the compiled graphs. Compiled layouts are cached in the
handle's registry entry per ``(q_len, kv_len, device)``; :meth:`BlockSparseAttention.layout` returns
the cached one.
"""

from __future__ import annotations


import torch
from torch import nn

from .compiler.layout import BlockLayout
from .mask.dsl import parse
from .mask.expr import Mask
from .mask.primitives import full
from .ops.custom_op import attention_op, register_mask, registry

__all__ = ["BlockSparseAttention", "BlockSparseMultiheadAttention", "apply_rotary"]


def _as_mask(mask):
    if mask is None:
        return full()
    if isinstance(mask, str):
        return parse(mask)
    if isinstance(mask, (Mask, BlockLayout)):
        return mask
    raise TypeError(f"mask must be a Mask, DSL text / pattern name, BlockLayout or None, got {type(mask).__name__}")


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
        context_parallel: a process group or 1-D DeviceMesh: q, k, v are this rank's shard of a
            sequence split across the group (self-attention), computed by
            :func:`blocksparse_fa.distributed.context_parallel_attention`; pass the sharding's plan
            as ``forward(..., cp_plan=plan)`` (default: contiguous shards in rank order).

    Shapes:
        q ``(B, H, Lq, D)``, k/v ``(B, Hkv, Lk, D)`` with ``H % Hkv == 0`` -> ``(B, H, Lq, D)``.
    """

    def __init__(self, mask=None, *, block_size=None, scale=None, dropout: float = 0.0, backend: str = "auto",
                 context_parallel=None):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.mask = _as_mask(mask)
        self.handle = register_mask(self.mask, block_size, owner=self)
        self.block_size = registry.block_size(self.handle)
        self.scale = scale
        self.dropout = float(dropout)
        self.backend = backend
        self.context_parallel = context_parallel

    def __setstate__(self, state):  # copy.deepcopy / unpickling: the copy registers and pins its own handle
        super().__setstate__(state)
        self.handle = register_mask(self.mask, self.block_size, owner=self)

    def layout(self, q_len: int, kv_len: int | None = None, device=None) -> BlockLayout:
        """The compiled layout for these lengths and device (cached per ``(q_len, kv_len, device)``)."""
        return registry.layout(self.handle, q_len, kv_len, device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool = False, cp_plan=None):
        p = self.dropout if self.training else 0.0
        if self.context_parallel is not None:
            from .distributed import context_parallel_attention

            m = self.mask.mask if isinstance(self.mask, BlockLayout) else self.mask
            return context_parallel_attention(q, k, v, None if cp_plan is not None else m, plan=cp_plan,
                                              group=self.context_parallel, scale=self.scale, dropout_p=p,
                                              return_lse=return_lse, backend=self.backend,
                                              block_size=None if cp_plan is not None else self.block_size)
        if cp_plan is not None:
            raise ValueError("cp_plan needs a module built with context_parallel=<process group or mesh>")
        return attention_op(q, k, v, self.handle, scale=self.scale, dropout_p=p, return_lse=return_lse,
                            backend=self.backend)

    def extra_repr(self) -> str:
        m = self.mask.mask if isinstance(self.mask, BlockLayout) else self.mask
        return f"mask={str(m)!r}, block_size={self.block_size}, dropout={self.dropout}"


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
        rotary: apply rotary position embeddings to q and k (query positions align bottom-right).
        rope_base: rotary base frequency.
        block_size, scale, backend, context_parallel: as in :class:`BlockSparseAttention`.
        device, dtype: of the parameters.

    Forward:
        ``x`` ``(B, Lq, E)``; optional ``context`` ``(B, Lk, E)`` for cross-attention (keys and values
        are projected from it; default ``x``) -> ``(B, Lq, E)``. With ``context_parallel``, ``x`` is
        this rank's shard of the sequence (``cp_plan``: its plan; rotary positions are the plan's
        global token indices), and cross-attention is not supported.
    """

    def __init__(self, embed_dim: int, num_heads: int, mask=None, num_kv_heads: int | None = None,
                 bias: bool = False, dropout: float = 0.0, *, head_dim: int | None = None, rotary: bool = False,
                 rope_base: float = 10000.0, block_size=None, scale=None, backend: str = "auto",
                 context_parallel=None, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; pass head_dim")
            head_dim = embed_dim // num_heads
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.rotary, self.rope_base = rotary, rope_base
        fk = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias, **fk)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=bias, **fk)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=bias, **fk)
        self.out_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **fk)
        self.attn = BlockSparseAttention(mask, block_size=block_size, scale=scale, dropout=dropout, backend=backend,
                                         context_parallel=context_parallel)

    @property
    def mask(self):
        return self.attn.mask

    def layout(self, q_len: int, kv_len: int | None = None, device=None) -> BlockLayout:
        return self.attn.layout(q_len, kv_len, device)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, cp_plan=None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must have shape (B, L, {self.embed_dim}), got {tuple(x.shape)}")
        cp = self.attn.context_parallel
        if cp is not None and context is not None:
            raise ValueError("context parallelism shards self-attention; cross-attention (context=...) is not supported")
        ctx = x if context is None else context
        B, Lq, _ = x.shape
        Lk = ctx.shape[1]
        q = self.q_proj(x).view(B, Lq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(ctx).view(B, Lk, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(ctx).view(B, Lk, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary:
            if cp is not None:  # this rank's tokens sit at their global positions
                plan = cp_plan if cp_plan is not None else _contiguous_plan(self.attn, cp, Lq, x.device)
                pos = plan.indices(_rank(cp), x.device)
                q, k = apply_rotary(q, pos, self.rope_base), apply_rotary(k, pos, self.rope_base)
                cp_plan = plan
            else:
                q = apply_rotary(q, torch.arange(Lk - Lq, Lk, device=x.device), self.rope_base)
                k = apply_rotary(k, torch.arange(Lk, device=x.device), self.rope_base)
        o = self.attn(q, k, v, cp_plan=cp_plan) if cp is not None else self.attn(q, k, v)
        return self.out_proj(o.transpose(1, 2).reshape(B, Lq, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, rotary={self.rotary}")


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
