"""Exact merge of attention over disjoint key sets (differentiable).

If the keys a query may attend are split into disjoint parts with outputs ``o_i`` and logsumexps
``lse_i``, full attention is ``o = Σ_i exp(lse_i − lse) o_i`` with ``lse = log Σ_i exp(lse_i)``.
Fully masked rows (all ``lse_i = −inf``) give 0 and ``−inf``, with zero gradients, never NaN.
"""

from __future__ import annotations

import torch

__all__ = ["merge_attention"]


def merge_attention(parts):
    """Merge ``[(out (B, H, L, D), lse (B, H, L)), ...]`` into ``(out, lse)``."""
    outs = [o for o, _ in parts]
    dt = torch.float64 if any(l.dtype == torch.float64 for _, l in parts) else torch.float32
    lses = torch.stack([l.to(dt) for _, l in parts])
    m = lses.amax(0)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m_safe)  # exactly 0 for -inf parts
    sw = w.sum(0)
    empty = sw == 0
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(torch.where(empty, torch.ones_like(sw), sw)))
    wn = w / torch.where(empty, torch.ones_like(sw), sw)
    out = sum(wn[k].unsqueeze(-1).to(outs[k].dtype) * outs[k] for k in range(len(outs)))
    return out.to(outs[0].dtype), lse
