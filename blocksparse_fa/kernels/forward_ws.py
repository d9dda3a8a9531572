"""Warp-specialised forward for layouts without masked blocks (dense), the way Triton's Hopper
warp-specialisation pass takes it.

Triton (3.6 and 3.9) splits a ``tl.range(..., warp_specialize=True)`` loop into a producer warp
group (TMA loads) and consumer warp groups (MMAs and softmax) only when the kernel is compiled for
4 warps, Q/K/V/O go through tensor descriptors, and the kernel has no other loop or branch with an
MMA: with 8 warps, or with a second (masked) loop or a masked tile behind an ``if``, it leaves the
loop unspecialised without a word; with a second loop holding MMAs, triton 3.6 aborts in an
assertion (``benchmarks/NOTES.md``). So this kernel walks full blocks only and the launcher uses it
only for layouts whose every block is full and whose key length is a multiple of ``BLOCK_N``.
"""

import triton
import triton.language as tl

from .common import LN2


@triton.jit(do_not_specialize=["q_len", "kv_len"])
def _attn_fwd_ws(Q, K, V, O, LSE,
                 stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                 H, G, q_len, kv_len, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr):
    """Dense attention of query tile ``program_id(0)`` and batch·head ``program_id(1)``: every key
    block unmasked (``kv_len % BLOCK_N == 0``), online softmax in base 2, LSE (natural log) saved."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = (h // G).to(tl.int64)
    h = h.to(tl.int64)
    q_desc = tl.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[q_len, HEAD_DIM],
                                       strides=[stride_qm, 1], block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + b * stride_kb + hk * stride_kh, shape=[kv_len, HEAD_DIM],
                                       strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + b * stride_vb + hk * stride_vh, shape=[kv_len, HEAD_DIM],
                                       strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(O + b * stride_ob + h * stride_oh, shape=[q_len, HEAD_DIM],
                                       strides=[stride_om, 1], block_shape=[BLOCK_M, HEAD_DIM])
    q = q_desc.load([pid_m * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start in tl.range(0, kv_len, BLOCK_N, warp_specialize=WARP_SPEC):
        k = k_desc.load([start, 0])
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = v_desc.load([start, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    o_desc.store([pid_m * BLOCK_M, 0], (acc / l_i[:, None]).to(O.dtype.element_ty))
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(LSE + pid_bh.to(tl.int64) * q_len + offs_m, (m_i + tl.math.log2(l_i)) * LN2, mask=offs_m < q_len)
