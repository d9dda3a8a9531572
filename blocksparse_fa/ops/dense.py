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

MAX_DENSE_ELEMENTS = 1 << 26
"""Largest mask (``mask instances × Lq × Lk`` elements) the dense path materialises: 64 M elements
(8192² tokens), 64 MB as bool and 256 MB as the float mask SDPA's CPU kernel builds from it, what
SDPA with the same mask needs too."""

COST = {"dense": 1.0, "walk": 1.0, "step": 500_000.0, "threads": 3.0}
"""Weights of :func:`prefer_dense`, in units of one visited score element of block walking.

Measured with ``benchmarks/experiments/cpu_crossover.py`` (H = 4, D = 64, forward and forward+backward, medians
of alternating runs; full, causal, sliding window 256, Longformer, BigBird and strided masks at
L = 256 ... 8192) on a shared 2-core machine, with one torch thread and with two. On one thread a
dense score element costs about as much as a walked one (fit: 1.05), and each row block the walk
visits about as much as 500 K walked elements (Python work, gathers, the mask on partial blocks).
With two threads PyTorch's fused SDPA ran 2-4x faster while the walk's many small operations did not
gain (on the loaded machine they lost): the dense path's cost is divided by ``threads **
COST["threads"]``, an exponent fitted to those runs. It errs towards the dense path, which is the safe
side: ``backend="auto"`` is then never slower than SDPA with the same mask, and walking wins where
the mask is too large to materialise (:data:`MAX_DENSE_ELEMENTS`) or on one thread where few blocks
are kept. Some of the runs (forward and backward, ms):

=========================  =======  ====  ======  ======
mask, L                    density  thr.  walk    dense
=========================  =======  ====  ======  ======
causal, 1024               0.56     1     265     196
sliding window 256, 2048   0.18     1     1482    3115
Longformer, 2048           0.39     1     3042    3819
Longformer, 4096           0.21     1     6171    12303
sliding window 256, 2048   0.18     2     1604    672
Longformer, 2048           0.39     2     2662    935
causal, 4096               0.52     2     7760    1653
causal, 8192               0.51     2     27273   10659
sliding window 256, 8192   0.05     2     7343    4801
=========================  =======  ====  ======  ======

Over the 44 measured runs (forward and backward) these weights pick the faster path in all but one
(Longformer at 4096 on two threads, where one noisy run walked faster), 1 % slower in total than
always picking the faster one; the earlier weights (dense 0.65, step 150 K, no thread term) were 88 %
slower in total and up to 8.4x slower on one run (Longformer at 2048 on two threads)."""


def _keep(layout: BlockLayout, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(attend, has_key)``: the layout's mask ``(Bm, Hm, Lq, Lk)`` with fully masked rows set to
    attend everything, and which rows keep any key ``(Bm, Hm, Lq, 1)`` (None when every row does);
    cached on the layout."""
    key = ("dense_keep", str(device))
    hit = layout.cache.get(key)
    if hit is None:
        keep = layout.to_dense().to(device)
        if keep.dim() == 2:
            keep = keep[None, None]
        has_key = keep.any(-1, keepdim=True)
        hit = layout.cache[key] = (keep, None) if bool(has_key.all()) else (keep | ~has_key, has_key)
    return hit


def mask_instances(layout: BlockLayout) -> int:
    bm, hm = layout.batch_shape or (1, 1)
    return bm * hm


def prefer_dense(layout: BlockLayout, s: Shapes, dropout_p: float) -> bool:
    """Whether the dense path is expected to be faster than block walking for this call.

    Block walking costs ``COST["walk"]`` per visited score element (``B·H·`` visited blocks ``·bm·bn``)
    plus ``COST["step"]`` per row block it visits (Python work and the mask on partial blocks);
    the dense path costs ``COST["dense"]`` per score element (``B·H·Lq·Lk``) divided by the torch
    threads to the power ``COST["threads"]`` (the fused kernel uses them; the walk did not gain from
    them). The dense path
    needs no dropout (its random stream would differ from the kernels') and a mask of at most
    :data:`MAX_DENSE_ELEMENTS` elements.
    """
    if dropout_p != 0.0 or mask_instances(layout) * s.Lq * s.Lk > MAX_DENSE_ELEMENTS:
        return False
    bm, bn = layout.block_size
    per_instance = s.B * s.H / mask_instances(layout)
    walk = (COST["walk"] * layout.n_nonempty * bm * bn * per_instance
            + COST["step"] * layout.shape[-2] * mask_instances(layout))
    dense = COST["dense"] * s.B * s.H * s.Lq * s.Lk / max(1, torch.get_num_threads()) ** COST["threads"]
    return dense < walk


def inputs_finite(*ts) -> bool:
    """Whether every element is finite, from one float32 sum per tensor (a NaN or an infinity makes
    the sum non-finite; a finite sum that overflows only sends the call to the walk, which is exact
    too). 3-5x faster than ``isfinite(t).all()``, which builds a bool tensor of the inputs' size."""
    return all(bool(torch.isfinite(t.sum(dtype=torch.float32))) for t in ts)


def dense_forward(q, k, v, layout: BlockLayout, s: Shapes, scale: float) -> torch.Tensor:
    """Attention output ``(B, H, Lq, D)`` through ``F.scaled_dot_product_attention`` (differentiable
    by PyTorch's autograd); inputs must be finite (:func:`inputs_finite`)."""
    attend, has_key = _keep(layout, q.device)
    if s.G > 1:
        k, v = k.repeat_interleave(s.G, dim=1), v.repeat_interleave(s.G, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=scale)
    if has_key is None:  # no fully masked row: nothing to zero
        return out
    return torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))

