"""The decoder: pre-norm (RMSNorm), rotary positions, grouped-query attention with a pluggable
attention core, SwiGLU MLP, untied output head. Only the core differs between variants.

A core is a module ``core(q, k, v, arg) -> (B, H, L, D)`` with ``q (B, H, L, D)`` and ``k, v
(B, Hkv, L, D)``; ``arg`` is whatever the variant passes per batch (a FlexAttention ``BlockMask``,
document ids, or ``None``). One core instance is shared by all layers (cores have no parameters).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rope_tables(L: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``(L, head_dim // 2)`` float32 for positions ``0 .. L-1``."""
    half = head_dim // 2
    inv = base ** (-torch.arange(0, half, dtype=torch.float64) / half)
    ang = torch.arange(L, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x`` ``(B, L, H, D)`` (computed in float32)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, core: nn.Module):
        super().__init__()
        self.h, self.hkv, self.dh = heads, kv_heads, head_dim
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, d, bias=False)
        self.core = core

    def forward(self, x, cos, sin, arg):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.dh, self.hkv * self.dh, self.hkv * self.dh], dim=-1)
        q = apply_rope(q.view(B, L, self.h, self.dh), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(B, L, self.hkv, self.dh), cos, sin).transpose(1, 2)
        v = v.view(B, L, self.hkv, self.dh).transpose(1, 2)
        o = self.core(q, k, v, arg)
        return self.o(o.transpose(1, 2).reshape(B, L, self.h * self.dh))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class Block(nn.Module):
    def __init__(self, d, heads, kv_heads, head_dim, hidden, core):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.attn = Attention(d, heads, kv_heads, head_dim, core)
        self.mlp = SwiGLU(d, hidden)

    def forward(self, x, cos, sin, arg):
        x = x + self.attn(self.n1(x), cos, sin, arg)
        return x + self.mlp(self.n2(x))


class Head(nn.Module):
    """Final norm, unembedding and the weighted loss. Returns ``loss`` (scalar), per-token
    cross-entropy ``(B, L)`` in nats (detached) and per-token argmax correctness ``(B, L)``."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.proj = nn.Linear(d, vocab, bias=False)

    def forward(self, x, targets, weights):
        logits = self.proj(self.norm(x)).float()
        B, L, V = logits.shape
        ce = F.cross_entropy(logits.view(B * L, V), targets.view(B * L), reduction="none").view(B, L)
        correct = logits.argmax(-1) == targets
        return (ce * weights).sum(), ce.detach(), correct


def mlp_hidden(d: int) -> int:
    return 256 * math.ceil(8 * d / 3 / 256)


class Decoder(nn.Module):
    """Byte-level decoder. ``forward(tokens, targets, weights, cos, sin, arg)`` -> ``(loss, ce, correct)``."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, head_dim: int, core: nn.Module):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, heads, kv_heads, head_dim, mlp_hidden(d), core) for _ in range(layers)])
        self.head = Head(d, vocab)
        self.head_dim = head_dim
        self._init(layers)
        # what forward calls: the modules themselves, or compiled wrappers (compile_regions); kept
        # out of the module tree (object.__setattr__) so that state_dict and parameters are unchanged
        object.__setattr__(self, "_block_fns", list(self.blocks))
        object.__setattr__(self, "_head_fn", self.head)

    def _init(self, layers: int):
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attn.o.weight", "mlp.down.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def compile_regions(self, fullgraph: bool, **kw):
        """Compile each block and the head separately (regional compilation: one compiled block
        graph serves all layers, so compile time does not grow with depth). ``kw``: ``backend``,
        ``mode`` of ``torch.compile``."""
        object.__setattr__(self, "_block_fns", [torch.compile(b, fullgraph=fullgraph, dynamic=False, **kw)
                                                for b in self.blocks])
        object.__setattr__(self, "_head_fn", torch.compile(self.head, fullgraph=True, dynamic=False, **kw))

    def forward(self, tokens, targets, weights, cos, sin, arg):
        x = self.emb(tokens)
        for blk in self._block_fns:
            x = blk(x, cos, sin, arg)
        return self._head_fn(x, targets, weights)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
