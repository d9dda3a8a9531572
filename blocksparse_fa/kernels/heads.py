"""Sums over a GQA group's query heads, for kernels that work per query head.

``_group_sum``: the per-query-head gradients summed over each group, in float32, written in the
output's dtype. The GQA list backward runs one dK/dV item per query head over its group's K and V,
so that a key column is one query head's work (``ops/select._gluon_bwd_mode``,
``"list+per_head_dkdv"``), and sums the G partial dK and dV of each kv head here.

A head is one contiguous run of ``N = L·D`` elements (contiguous ``(B, H, L, D)`` tensors): one
program per ``BLOCK`` elements of one (batch, kv head), every access a full, aligned vector.
"""

import triton
import triton.language as tl


@triton.jit
def _group_sum(SRC, DST, N, GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    """``DST[z] = sum over g of SRC[z·GROUPS + g]``, accumulated in float32."""
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    z = tl.program_id(1).to(tl.int64)
    keep = offs_n < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for g in tl.static_range(GROUPS):
        acc += tl.load(SRC + (z * GROUPS + g) * N + offs_n, mask=keep, other=0.0).to(tl.float32)
    tl.store(DST + z * N + offs_n, acc.to(DST.dtype.element_ty), mask=keep)
