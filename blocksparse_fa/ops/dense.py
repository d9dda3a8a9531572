"""The dense exact path for short or dense layouts on CPU: PyTorch's fused SDPA with the layout's
mask materialised.

The block-walking CPU backend (``ops/torch_backend.py``) does Python work per row block and
evaluates the mask on partial blocks at every call, so for short sequences or layouts that keep
most blocks PyTorch's fused CPU kernel over the whole score matrix is faster, even though it
computes the masked-out blocks. ``backend="auto"`` picks between them with :func:`prefer_dense`.

Both are exact and keep the library's guarantees: fully masked rows output zeros and get zero
gradients whatever ``v`` holds. SDPA multiplies masked probabilities (zeros) with every value row,
so a non-finite value anywhere would reach every row (``0 * nan``); the dense path therefore runs
only on finite inputs (checked, ``O((Lq + Lk) · D)``), and sends fully masked rows to attend every
key (finite) before zeroing them, so that their gradients are exactly zero too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..compiler.layout import BlockLayout
from .validate import Shapes

__all__ = ["prefer_dense", "dense_forward", "MAX_DENSE_ELEMENTS", "COST"]

MAX_DENSE_ELEMENTS = 1 << 24
"""Largest mask (``mask instances × Lq × Lk`` elements) the dense path materialises: 16 M elements,
16 MB as bool and 64 MB as the float mask SDPA's CPU kernel builds from it."""

COST = {"dense": 0.65, "walk": 1.0, "step": 150_000.0}
"""Weights of :func:`prefer_dense`, in units of one visited score element of block walking.

Fitted (``benchmarks/experiments/cpu_auto_crossover.py``, one thread, process CPU time, forward
and backward) on 48 runs: full, causal, sliding window 256, Longformer, BigBird and strided masks at
L = 256 ... 4096 with H = 4, D = 64 and at L = 512 ... 2048 with H = 8, D = 128. Per element,
dense SDPA costs 0.65-0.73 of a walked element at both head dims; each row block the walk visits
costs about as much as 150 K walked elements (Python work, the mask on partial blocks). With
these weights the choice costs 0.6 % (forward and backward) and 0.4 % (forward) more than always
picking the faster path on those runs. Some of them (H = 8, D = 128, forward and backward, ms):

============================  ==========  ======  =======
mask, L                       density     walk    dense
============================  ==========  ======  =======
full, 512                     1.00        78.9    53.0
Longformer, 1024              0.69        224.0   196.2
causal, 1024                  0.56        163.6   188.9
sliding window 256, 1024      0.33        108.4   191.2
full, 2048                    1.00        1195    777
causal, 2048                  0.53        680     813
Longformer, 2048              0.39        584     908
============================  ==========  ======  =======

So on one thread the dense path wins for layouts that keep more than about 65-70 % of the blocks
and for short sequences, where the walk's cost per row block dominates. With more threads PyTorch's fused kernel scales
better than the walk's many small operations, so the dense path also wins somewhat sparser
layouts there than this model (conservatively) picks it for."""


def _keep(layout: BlockLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(attend, has_key)``: the layout's mask ``(Bm, Hm, Lq, Lk)`` with fully masked rows set to
    attend everything, and which rows keep any key ``(Bm, Hm, Lq, 1)``; cached on the layout."""
    key = ("dense_keep", str(device))
    hit = layout.cache.get(key)
    if hit is None:
        keep = layout.to_dense().to(device)
        if keep.dim() == 2:
            keep = keep[None, None]
        has_key = keep.any(-1, keepdim=True)
        hit = layout.cache[key] = (keep | ~has_key, has_key)
    return hit


def mask_instances(layout: BlockLayout) -> int:
    bm, hm = layout.batch_shape or (1, 1)
    return bm * hm


def prefer_dense(layout: BlockLayout, s: Shapes, dropout_p: float) -> bool:
    """Whether the dense path is expected to be faster than block walking for this call.

    Block walking costs ``COST["walk"]`` per visited score element (``B·H·`` visited blocks ``·bm·bn``)
    plus ``COST["step"]`` per row block it visits (Python work and the mask on partial blocks);
    the dense path costs ``COST["dense"]`` per score element (``B·H·Lq·Lk``). The dense path needs
    no dropout (its random stream would differ from the kernels') and a mask of at most
    :data:`MAX_DENSE_ELEMENTS` elements.
    """
    if dropout_p != 0.0 or mask_instances(layout) * s.Lq * s.Lk > MAX_DENSE_ELEMENTS:
        return False
    bm, bn = layout.block_size
    per_instance = s.B * s.H / mask_instances(layout)
    walk = (COST["walk"] * layout.n_nonempty * bm * bn * per_instance
            + COST["step"] * layout.shape[-2] * mask_instances(layout))
    dense = COST["dense"] * s.B * s.H * s.Lq * s.Lk
    return dense < walk


def inputs_finite(*ts) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def dense_forward(q, k, v, layout: BlockLayout, s: Shapes, scale: float) -> torch.Tensor:
    """Attention output ``(B, H, Lq, D)`` through ``F.scaled_dot_product_attention`` (differentiable
    by PyTorch's autograd); inputs must be finite (:func:`inputs_finite`)."""
    attend, has_key = _keep(layout, q.device)
    if s.G > 1:
        k, v = k.repeat_interleave(s.G, dim=1), v.repeat_interleave(s.G, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=scale)
    return torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))

