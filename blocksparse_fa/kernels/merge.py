"""Merge of two attention parts over disjoint key sets, the second computed on regrouped tokens.

Used by the strided-mask rewrite (``ops/residue.py``): the band part's output is in token order,
the strided part's in residue-class order (position ``p`` sits at ``(p mod S)·M + p div S``).
Also used by context parallelism (``distributed/attention.py``) with ``S = 1``: part 2 covers the
rows ``[ROW0, ROW0 + n_rows)`` of part 1's ``N1`` rows (the rows that see fetched keys).
One pass: ``lse = logaddexp(lse1, lse2)``, ``o = exp(lse1 − lse)·o1 + exp(lse2 − lse)·o2``, written
over part 1. Rows masked in both parts (both ``-inf``) give ``o = 0`` and ``lse = -inf``.
"""

import triton
import triton.language as tl

from .common import load_tile, store_tile


@triton.jit(do_not_specialize=["n_rows", "S", "M", "row0", "n1", "H"])  # strides: divisibility kept (wide loads)
def _merge_residue(O1, L1, O2, L2, n_rows, S, M, row0, n1, H, s1b, s1h, s1m, s2b, s2h, s2m,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(cdiv(n_rows, BLOCK), B·H)``. ``O1`` ``(B, H, n1, D)`` with strides ``s1b, s1h, s1m``
    and ``O2`` ``(B, H, S·M, D)`` (rows in class-major order, ``n_rows = S·M``) with strides ``s2b,
    s2h, s2m`` (the head dim contiguous in both), ``L1``/``L2`` ``(B·H, n1)`` / ``(B·H, n_rows)``
    contiguous; rows ``row0 .. row0 + n_rows`` of ``O1``/``L1`` are overwritten."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_m = pid * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_r = (offs_m % S) * M + offs_m // S  # row of position offs_m in class-major order
    base = bh * n_rows
    base1 = bh * n1 + row0
    o1_ptrs = O1 + b * s1b + h * s1h + (row0 + offs_m)[:, None].to(tl.int64) * s1m + offs_d[None, :]
    o1 = load_tile(o1_ptrs, offs_m, n_rows, offs_d, HEAD_DIM, HEAD_DIM_PAD, True).to(tl.float32)
    o2 = load_tile(O2 + b * s2b + h * s2h + offs_r[:, None].to(tl.int64) * s2m + offs_d[None, :], offs_m, n_rows,
                   offs_d, HEAD_DIM, HEAD_DIM_PAD, True).to(tl.float32)
    valid = offs_m < n_rows
    l1 = tl.load(L1 + base1 + offs_m, mask=valid, other=float("-inf"))
    l2 = tl.load(L2 + base + offs_r, mask=valid, other=float("-inf"))
    m = tl.maximum(l1, l2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w1 = tl.exp(l1 - m_safe)  # exactly 0 for a -inf part
    w2 = tl.exp(l2 - m_safe)
    tot = w1 + w2
    empty = tot == 0.0
    inv = 1.0 / tl.where(empty, 1.0, tot)
    o = o1 * (w1 * inv)[:, None] + o2 * (w2 * inv)[:, None]
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, tot)))
    store_tile(o1_ptrs, o.to(O1.dtype.element_ty), offs_m, n_rows, offs_d, HEAD_DIM, HEAD_DIM_PAD)
    tl.store(L1 + base1 + offs_m, lse, mask=valid)
