"""Five-GEMM backward: dK/dV programs that also produce dQ, through fp32 atomic adds.

The deterministic backward (``backward.py``) recomputes the scores twice: once in the dK/dV
programs (S, dP, then dV += Pᵀ·dO and dK += dSᵀ·Q) and once in the dQ programs (S, dP, then
dQ += dS·K): seven GEMMs per visited block. Here the dK/dV program adds its block's
``dS·K`` to an fp32 dQ buffer with ``tl.atomic_add`` (as FlashAttention-2's and -3's backward
do), so the dQ programs and their two recomputed GEMMs go: five GEMMs per block. The order in
which programs add to a dQ row is not fixed, so dQ is not bit-reproducible between runs (fp32
sums in another order); dK and dV still are. ``_dq_finish`` scales the buffer, zeroes rows with
nothing to attend and writes dQ in the inputs' dtype.
"""

import triton
import triton.language as tl

from .backward import _load_lse2
from .common import dropout_keep, load_tile, lut_first, lut_next, mma, store_grad_tile, work_item


@triton.jit
def _dkdv_dq_inner(dk, dv, k, v, offs_n, offs_d, b, h, H, bh, Q_base, DO_base, DQA_base, LSE_row, DELTA_row,
                   stride_qm, stride_dom, LUT_IDX, line, start, end, q_len, kv_len, Q_OFF, qk_scale,
                   PARAMS, AUX, seed_lo, seed_hi, drop_thresh, drop_scale,
                   PREDICATE: tl.constexpr, MASKED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   LAYOUT_BM: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr,
                   LUT_MODE: tl.constexpr, EVEN: tl.constexpr, DQ_DESC: tl.constexpr):
    """As ``backward._dkdv_inner``, plus ``dQ[rows] += dS · K`` (unscaled) into the fp32 buffer
    ``DQA_base`` for every query step: element-wise atomic adds at ``DQA_base`` (this head's rows of
    ``HEAD_DIM_PAD`` floats), or with ``DQ_DESC`` a TMA reduce-add through the descriptor
    ``DQA_base`` over ``(B·H, q_len, HEAD_DIM_PAD)`` at head ``bh``."""
    carry = lut_first(LUT_IDX, line, start, end, LUT_MODE)
    for e in tl.range(start, end, num_stages=STAGES):
        rblk, carry = lut_next(LUT_IDX, e, end, carry, LUT_MODE)
        for sub in tl.static_range(LAYOUT_BM // BLOCK_M):
            offs_m = rblk * LAYOUT_BM + sub * BLOCK_M + tl.arange(0, BLOCK_M)
            q = load_tile(Q_base + offs_m[:, None] * stride_qm + offs_d[None, :], offs_m, q_len, offs_d,
                          HEAD_DIM, HEAD_DIM_PAD, MASKED and not EVEN)
            do = load_tile(DO_base + offs_m[:, None] * stride_dom + offs_d[None, :], offs_m, q_len, offs_d,
                           HEAD_DIM, HEAD_DIM_PAD, MASKED and not EVEN)
            lse2 = _load_lse2(LSE_row, offs_m, q_len, MASKED and not EVEN)
            if MASKED and not EVEN:
                delta = tl.load(DELTA_row + offs_m, mask=offs_m < q_len, other=0.0)
            else:
                delta = tl.load(DELTA_row + offs_m)
            s_t = mma(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT_PRECISION)
            p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
            if MASKED:
                qp = offs_m + Q_OFF
                keep = PREDICATE(qp[None, :], offs_n[:, None], offs_m[None, :], b, h, PARAMS, AUX, True)
                if not EVEN:
                    keep = keep & (offs_m[None, :] < q_len) & (offs_n[:, None] < kv_len)
                p_t = tl.where(keep, p_t, 0.0)
            dp_t = mma(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT_PRECISION)
            if HAS_DROPOUT:
                drop = dropout_keep(offs_m[None, :], offs_n[:, None], b * H + h, seed_lo, seed_hi, drop_thresh)
                dv = mma(tl.where(drop, p_t * drop_scale, 0.0).to(do.dtype), do, dv, DOT_PRECISION)
                dp_t = tl.where(drop, dp_t * drop_scale, 0.0)
            else:
                dv = mma(p_t.to(do.dtype), do, dv, DOT_PRECISION)
            ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
            dk = mma(ds_t, q, dk, DOT_PRECISION)
            # dQᵀ = Kᵀ · dSᵀ: (HEAD_DIM_PAD, BLOCK_M), so the MMA's M side is the head dim (a
            # warpgroup MMA for any BLOCK_M) and K's shared-memory tile is read transposed
            dq_t = mma(tl.trans(k), ds_t, tl.zeros([HEAD_DIM_PAD, BLOCK_M], dtype=tl.float32), DOT_PRECISION)
            if DQ_DESC:  # TMA reduce-add of the whole tile (rows past q_len are clipped by the descriptor)
                DQA_base.atomic_add([bh, rblk * LAYOUT_BM + sub * BLOCK_M, 0], tl.trans(dq_t)[None, :, :])
            else:
                dq_ptrs = DQA_base + offs_m[None, :] * HEAD_DIM_PAD + offs_d[:, None]
                if EVEN:
                    tl.atomic_add(dq_ptrs, dq_t, sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq_t, mask=offs_m[None, :] < q_len, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["TC", "q_len", "kv_len", "Q_OFF", "seed_lo", "seed_hi", "drop_thresh", "NSLOT",
                               "N_ITEMS", "N_BH"])
def _attn_bwd_atomic(Q, K, V, DO, DQA, DK, DV, LSE, DELTA,
                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                     stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                     FULL_PTR, FULL_IDX, PART_PTR, PART_IDX, PARAMS, AUX, WORK, DKPART, DVPART, NSLOT, N_ITEMS,
                     N_BH, H, G, LZB, LZH, TC, q_len, kv_len, Q_OFF, qk_scale, sm_scale,
                     seed_lo, seed_hi, drop_thresh, drop_scale,
                     PREDICATE: tl.constexpr, HAS_DROPOUT: tl.constexpr, USE_WORK: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     LAYOUT_BM: tl.constexpr, LAYOUT_BN: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     STAGES: tl.constexpr, MASKED_STAGES: tl.constexpr, COL_LUT: tl.constexpr,
                     ACCUMULATE: tl.constexpr, EVEN: tl.constexpr, DQ_DESC: tl.constexpr,
                     COL_PART_LUT: tl.constexpr = "load"):
    """dK/dV of one key tile (or work item) and batch·kv-head, and its share of dQ (atomic adds
    into ``DQA``, fp32 ``(B·H, q_len, HEAD_DIM_PAD)``, zeroed by the launcher; with ``DQ_DESC``
    through a tensor descriptor, i.e. TMA reduce-adds on Hopper). A 1-D grid of ``N_ITEMS``
    programs per batch·kv-head; the column-side work list as in ``_attn_bwd``."""
    tl.static_assert(LAYOUT_BM % BLOCK_M == 0, "kernel tile BLOCK_M must divide the layout block")
    tl.static_assert(LAYOUT_BN % BLOCK_N == 0, "kernel tile BLOCK_N must divide the layout block")
    pid = tl.program_id(0)
    pid_w = pid % N_ITEMS
    pid_bhk = pid // N_ITEMS
    HKV = H // G
    b = pid_bhk // HKV
    hk = pid_bhk % HKV
    b64 = b.to(tl.int64)
    tile, f0, f1, p0, p1, slot = work_item(WORK, pid_w, FULL_PTR, PART_PTR, (b * LZB + hk * G * LZH) * TC, BLOCK_N,
                                           LAYOUT_BN, USE_WORK)
    col_in_lut = (tile * BLOCK_N) // LAYOUT_BN
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k = load_tile(K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                  offs_n, kv_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    v = load_tile(V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                  offs_n, kv_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    if DQ_DESC:  # the launcher checked alignment; needs Triton's global scratch allocator
        dqa_desc = tl.make_tensor_descriptor(DQA, shape=[N_BH, q_len, HEAD_DIM_PAD],
                                             strides=[q_len * HEAD_DIM_PAD, HEAD_DIM_PAD, 1],
                                             block_shape=[1, BLOCK_M, HEAD_DIM_PAD])
    for g in range(0, G):
        h = hk * G + g
        h64 = h.to(tl.int64)
        if not USE_WORK:  # each query head of the group has its own LUT line (head-dependent masks)
            _, f0, f1, p0, p1, _ = work_item(WORK, pid_w, FULL_PTR, PART_PTR, (b * LZB + h * LZH) * TC, BLOCK_N,
                                             LAYOUT_BN, USE_WORK)
        line = (b * LZB + h * LZH) * TC + col_in_lut
        Q_base = Q + b64 * stride_qb + h64 * stride_qh
        DO_base = DO + b64 * stride_dob + h64 * stride_doh
        bh = b * H + h
        if DQ_DESC:
            DQA_base = dqa_desc
        else:
            DQA_base = DQA + (b64 * H + h64) * q_len * HEAD_DIM_PAD
        LSE_row = LSE + (b64 * H + h64) * q_len
        DELTA_row = DELTA + (b64 * H + h64) * q_len
        dk, dv = _dkdv_dq_inner(dk, dv, k, v, offs_n, offs_d, b, h, H, bh, Q_base, DO_base, DQA_base, LSE_row, DELTA_row,
                                stride_qm, stride_dom, FULL_IDX, line, f0, f1, q_len, kv_len, Q_OFF, qk_scale,
                                PARAMS, AUX, seed_lo, seed_hi, drop_thresh, drop_scale,
                                PREDICATE, False, HAS_DROPOUT, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, LAYOUT_BM,
                                DOT_PRECISION, STAGES, COL_LUT, False, DQ_DESC)
        dk, dv = _dkdv_dq_inner(dk, dv, k, v, offs_n, offs_d, b, h, H, bh, Q_base, DO_base, DQA_base, LSE_row, DELTA_row,
                                stride_qm, stride_dom, PART_IDX, line, p0, p1, q_len, kv_len, Q_OFF, qk_scale,
                                PARAMS, AUX, seed_lo, seed_hi, drop_thresh, drop_scale,
                                PREDICATE, True, HAS_DROPOUT, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, LAYOUT_BM,
                                DOT_PRECISION, MASKED_STAGES, COL_PART_LUT, EVEN, DQ_DESC)
    if slot < 0:
        store_grad_tile(DK + b64 * stride_dkb + hk.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkn
                        + offs_d[None, :], dk * sm_scale, offs_n, kv_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, ACCUMULATE)
        store_grad_tile(DV + b64 * stride_dvb + hk.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvn
                        + offs_d[None, :], dv, offs_n, kv_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, ACCUMULATE)
    else:
        r = tl.arange(0, BLOCK_N)
        base = (pid_bhk.to(tl.int64) * NSLOT + slot) * BLOCK_N
        tl.store(DKPART + (base + r)[:, None] * HEAD_DIM_PAD + offs_d[None, :], dk * sm_scale)
        tl.store(DVPART + (base + r)[:, None] * HEAD_DIM_PAD + offs_d[None, :], dv)


@triton.jit(do_not_specialize=["n_rows"])
def _dq_finish(DQ, DQA, LSE, stride_b, stride_h, stride_m, H, n_rows, sm_scale,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr):
    """``dQ = sm_scale · DQA`` in dQ's dtype; rows with LSE ``-inf`` (nothing to attend) get exactly
    0 whatever the buffer holds (0 · NaN from a V that holds NaN); with ``ACCUMULATE`` added to dQ."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row = pid_bh.to(tl.int64) * n_rows
    acc = tl.load(DQA + (row + offs_m)[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=offs_m[:, None] < n_rows,
                  other=0.0)
    lse = tl.load(LSE + row + offs_m, mask=offs_m < n_rows, other=0.0)
    dq = tl.where((lse == float("-inf"))[:, None], 0.0, acc * sm_scale)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    store_grad_tile(DQ + b * stride_b + h * stride_h + offs_m[:, None] * stride_m + offs_d[None, :], dq, offs_m,
                    n_rows, offs_d, HEAD_DIM, HEAD_DIM_PAD, ACCUMULATE)
