"""Exact merge of attention over disjoint key sets (differentiable).

If the keys a query may attend are split into disjoint parts with outputs ``o_i`` and logsumexps
``lse_i``, full attention is ``o = Σ_i exp(lse_i − lse) o_i`` with ``lse = log Σ_i exp(lse_i)``.
Fully masked rows (all ``lse_i = −inf``) give 0 and ``−inf``, with zero gradients, never NaN.
The weighted sum accumulates in float32 (float64 when a part is float64) whatever the parts'
dtype, and only the result is rounded to the first part's dtype: an n-way merge of bfloat16 parts
rounds once, not n times.
"""

from __future__ import annotations

import torch

__all__ = ["merge_attention"]


def merge_attention(parts):
    """Merge ``[(out (B, H, L, D), lse (B, H, L)), ...]`` into ``(out, lse)``: ``out`` in the first
    part's dtype, ``lse`` float32 (float64 when a part is float64)."""
    outs = [o for o, _ in parts]
    dt = torch.float64 if any(t.dtype == torch.float64 for p in parts for t in p) else torch.float32
    lses = torch.stack([l.to(dt) for _, l in parts])
    m = lses.amax(0)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m_safe)  # exactly 0 for -inf parts
    sw = w.sum(0)
    empty = sw == 0
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(torch.where(empty, torch.ones_like(sw), sw)))
    wn = w / torch.where(empty, torch.ones_like(sw), sw)
    out = wn[0].unsqueeze(-1) * outs[0].to(dt)
    for k in range(1, len(outs)):
        out = out + wn[k].unsqueeze(-1) * outs[k].to(dt)
    return out.to(outs[0].dtype), lse
