"""Recompute backward: ``delta = rowsum(dO ∘ O)``, then dK/dV per key tile (column LUT, summing
over the GQA group of query heads) and dQ per query tile (row LUT). No atomics: every output tile
is owned by one program, so gradients are deterministic. Probabilities are recomputed from the
saved logsumexp; rows with LSE ``-inf`` (fully masked) contribute exactly 0.
"""

import triton
import triton.language as tl

from .common import (LOG2E, block_shift, dropout_keep, load_bias, load_tile, lut_first, lut_next, mma, score_grads,
                     score_mod, store_grad_tile, work_item)
from .common import layout_block


@triton.jit(do_not_specialize=["n_rows"])
def _attn_bwd_preprocess(O, DO, DELTA, LSE, LSE2, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
                         H, n_rows, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                         WRITE_LSE2: tl.constexpr = False):
    """``DELTA = rowsum(dO ∘ O)`` per row; with ``WRITE_LSE2`` also ``LSE2``, the rows' logsumexp
    in base 2 with -inf (a row that keeps nothing) as +inf: what :func:`_load_lse2` makes of
    ``LSE``, once per call instead of once per step of every dK/dV program."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o = load_tile(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
                  offs_m, n_rows, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    do = load_tile(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                   offs_m, n_rows, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * n_rows + offs_m, delta, mask=offs_m < n_rows)
    if WRITE_LSE2:
        row = pid_bh.to(tl.int64) * n_rows + offs_m
        lse = tl.load(LSE + row, mask=offs_m < n_rows, other=0.0)
        tl.store(LSE2 + row, tl.where(lse == float("-inf"), float("inf"), lse * LOG2E), mask=offs_m < n_rows)


@triton.jit
def _load_lse2(LSE_row, offs_m, q_len, MASKED: tl.constexpr, BASE2: tl.constexpr = False):
    """Base-2 logsumexp of rows; fully masked rows (-inf) and out-of-range rows become +inf so
    their recomputed probabilities are exactly 0. ``BASE2``: ``LSE_row`` holds that already
    (``_attn_bwd_preprocess``'s ``LSE2``)."""
    if MASKED:
        lse = tl.load(LSE_row + offs_m, mask=offs_m < q_len, other=float("inf"))
    else:
        lse = tl.load(LSE_row + offs_m)
    if not BASE2:
        lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    return lse


@triton.jit
def _dkdv_inner(dk, dv, k, v, offs_n, k_shift, offs_d, b, h, H, Q_base, DO_base, LSE_row, DELTA_row,
                stride_qm, stride_dom, LUT_IDX, line, start, end, q_len, kv_len, Q_OFF, qk_scale,
                PARAMS, AUX, QPOS, seed_lo, seed_hi, drop_thresh, drop_scale, slope, softcap,
                BIAS_base, stride_bm, stride_bn, DBIAS_base, stride_dbm, stride_dbn,
                PREDICATE: tl.constexpr, MASKED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                LAYOUT_BM: tl.constexpr, LIST_BM: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr,
                LUT_MODE: tl.constexpr, EVEN: tl.constexpr, FLAT: tl.constexpr, HAS_POS: tl.constexpr,
                SCORE_MOD: tl.constexpr, LSE_BASE2: tl.constexpr = False):
    # EVEN: both lengths are multiples of the layout blocks: no bounds terms or row checks (see _attn_bwd)
    # FLAT: one loop iteration per kernel tile instead of per list entry (see _attn_bwd)
    # LIST_BM: queries per LUT entry (the layout block or a finer list block, compiler/finer.py)
    NSUB: tl.constexpr = LIST_BM // BLOCK_M
    carry = lut_first(LUT_IDX, line, start, end, LUT_MODE)
    for t in tl.range(start * (NSUB if FLAT else 1), end * (NSUB if FLAT else 1), num_stages=STAGES):
        rblk, carry = lut_next(LUT_IDX, t // NSUB if FLAT else t, end, carry, LUT_MODE)
        for sub in tl.static_range(1 if FLAT else NSUB):
            offs_m = rblk * LIST_BM + ((t % NSUB) * BLOCK_M if FLAT else sub * BLOCK_M) + tl.arange(0, BLOCK_M)
            q_shift = block_shift(QPOS, layout_block(rblk, LIST_BM, LAYOUT_BM), LAYOUT_BM, HAS_POS)
            q = load_tile(Q_base + offs_m[:, None] * stride_qm + offs_d[None, :], offs_m, q_len, offs_d,
                          HEAD_DIM, HEAD_DIM_PAD, MASKED and not EVEN)
            do = load_tile(DO_base + offs_m[:, None] * stride_dom + offs_d[None, :], offs_m, q_len, offs_d,
                           HEAD_DIM, HEAD_DIM_PAD, MASKED and not EVEN)
            lse2 = _load_lse2(LSE_row, offs_m, q_len, MASKED and not EVEN, LSE_BASE2)
            if MASKED and not EVEN:
                delta = tl.load(DELTA_row + offs_m, mask=offs_m < q_len, other=0.0)
            else:
                delta = tl.load(DELTA_row + offs_m)
            # transposed scores: (BLOCK_N, BLOCK_M)
            s_t = mma(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT_PRECISION)
            if SCORE_MOD != 0:  # modified scores (kernels/common.score_mod); t_t gives the soft-cap's derivative
                # keys past kv_len may sit in any tile of the last key block; rows past q_len only in masked ones
                bias_t = load_bias(BIAS_base, offs_n, stride_bn, kv_len, offs_m, stride_bm, q_len, not EVEN,
                                   MASKED and not EVEN, SCORE_MOD)
                s_t, t_t = score_mod(s_t, qk_scale, (offs_m + (Q_OFF + q_shift))[None, :], (offs_n + k_shift)[:, None],
                                     slope, bias_t, softcap, SCORE_MOD)
                p_t = tl.math.exp2(s_t - lse2[None, :])
            else:
                t_t = s_t
                p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
            if MASKED:
                qp = offs_m + (Q_OFF + q_shift)
                keep = PREDICATE(qp[None, :], (offs_n + k_shift)[:, None], (offs_m + q_shift)[None, :], b, h, PARAMS,
                                 AUX, True)
                if not EVEN:
                    keep = keep & (offs_m[None, :] < q_len) & (offs_n[:, None] < kv_len)
                p_t = tl.where(keep, p_t, 0.0)
                if SCORE_MOD & 2:  # no soft-cap derivative at masked elements (a NaN bias there must not leak)
                    t_t = tl.where(keep, t_t, 0.0)
            dp_t = mma(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT_PRECISION)
            if HAS_DROPOUT:
                drop = dropout_keep((offs_m + q_shift)[None, :], (offs_n + k_shift)[:, None], b * H + h, seed_lo, seed_hi, drop_thresh)
                dv = mma(tl.where(drop, p_t * drop_scale, 0.0).to(do.dtype), do, dv, DOT_PRECISION)
                dp_t = tl.where(drop, dp_t * drop_scale, 0.0)
            else:
                dv = mma(p_t.to(do.dtype), do, dv, DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            if SCORE_MOD & 2:
                ds_t = ds_t * (1.0 - t_t * t_t)
            if SCORE_MOD & 16:  # gradient of the bias: ds itself (each (i, j) is visited once here)
                score_grads(ds_t, DBIAS_base, offs_n, stride_dbn, kv_len, offs_m, stride_dbm, q_len, not EVEN,
                            MASKED and not EVEN, SCORE_MOD)
            dk = mma(ds_t.to(q.dtype), q, dk, DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_program(pid_w, pid_bhk, Q, K, V, DO, DK, DV, LSE, DELTA,
                   stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                   stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                   FULL_PTR, FULL_IDX, PART_PTR, PART_IDX, PARAMS, AUX, QPOS, KPOS, WORK, DKPART, DVPART, NSLOT,
                   H, G, LZB, LZH, TC, q_len, kv_len, Q_OFF, qk_scale, sm_scale,
                   seed_lo, seed_hi, drop_thresh, drop_scale, SLOPES, SOFTCAP,
                   BIAS, stride_bb, stride_bh, stride_bm, stride_bn, DBIAS, stride_dbb, stride_dbh, stride_dbm,
                   stride_dbn,
                   PREDICATE: tl.constexpr, HAS_DROPOUT: tl.constexpr, USE_WORK: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   LAYOUT_BM: tl.constexpr, LAYOUT_BN: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   STAGES: tl.constexpr, MASKED_STAGES: tl.constexpr, FULL_LUT: tl.constexpr,
                   ACCUMULATE: tl.constexpr, EVEN: tl.constexpr, FLAT: tl.constexpr, HAS_POS: tl.constexpr,
                   SCORE_MOD: tl.constexpr, LIST_BM: tl.constexpr, PART_LUT: tl.constexpr,
                   LSE_BASE2: tl.constexpr = False):
    """dK/dV of one key tile (or work item ``pid_w``) and batch·kv-head ``pid_bhk``; sums over the
    GQA group; ``LIST_BM`` queries per column-LUT entry."""
    tl.static_assert(LAYOUT_BM % BLOCK_M == 0, "kernel tile BLOCK_M must divide the layout block")
    tl.static_assert(LAYOUT_BN % BLOCK_N == 0, "kernel tile BLOCK_N must divide the layout block")
    tl.static_assert(LIST_BM % BLOCK_M == 0, "the kernel tile must divide the list block")
    tl.static_assert(LAYOUT_BM % LIST_BM == 0, "the list block must divide the layout block")
    HKV = H // G
    b = pid_bhk // HKV
    hk = pid_bhk % HKV
    b64 = b.to(tl.int64)
    tile, f0, f1, p0, p1, slot = work_item(WORK, pid_w, FULL_PTR, PART_PTR, (b * LZB + hk * G * LZH) * TC, BLOCK_N,
                                           LAYOUT_BN, USE_WORK)
    col_in_lut = (tile * BLOCK_N) // LAYOUT_BN
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k_shift = block_shift(KPOS, col_in_lut, LAYOUT_BN, HAS_POS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k = load_tile(K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                  offs_n, kv_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    v = load_tile(V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                  offs_n, kv_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    softcap = 1.0
    if SCORE_MOD & 2:
        softcap = tl.load(SOFTCAP)
    for g in range(0, G):
        h = hk * G + g
        h64 = h.to(tl.int64)
        slope = 0.0
        if SCORE_MOD & 1:
            slope = tl.load(SLOPES + h)
        if not USE_WORK:  # each query head of the group has its own LUT line (head-dependent masks)
            _, f0, f1, p0, p1, _ = work_item(WORK, pid_w, FULL_PTR, PART_PTR, (b * LZB + h * LZH) * TC, BLOCK_N,
                                             LAYOUT_BN, USE_WORK)
        line = (b * LZB + h * LZH) * TC + col_in_lut
        Q_base = Q + b64 * stride_qb + h64 * stride_qh
        DO_base = DO + b64 * stride_dob + h64 * stride_doh
        LSE_row = LSE + (b64 * H + h64) * q_len
        DELTA_row = DELTA + (b64 * H + h64) * q_len
        BIAS_base = BIAS + b64 * stride_bb + h64 * stride_bh
        DBIAS_base = DBIAS + b64 * stride_dbb + h64 * stride_dbh
        dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, k_shift, offs_d, b, h, H, Q_base, DO_base, LSE_row, DELTA_row,
                             stride_qm, stride_dom, FULL_IDX, line, f0, f1, q_len, kv_len, Q_OFF, qk_scale,
                             PARAMS, AUX, QPOS, seed_lo, seed_hi, drop_thresh, drop_scale, slope, softcap,
                             BIAS_base, stride_bm, stride_bn, DBIAS_base, stride_dbm, stride_dbn,
                             PREDICATE, False, HAS_DROPOUT, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, LAYOUT_BM, LIST_BM, DOT_PRECISION, STAGES, FULL_LUT,
                             False, FLAT, HAS_POS, SCORE_MOD, LSE_BASE2)
        dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, k_shift, offs_d, b, h, H, Q_base, DO_base, LSE_row, DELTA_row,
                             stride_qm, stride_dom, PART_IDX, line, p0, p1, q_len, kv_len, Q_OFF, qk_scale,
                             PARAMS, AUX, QPOS, seed_lo, seed_hi, drop_thresh, drop_scale, slope, softcap,
                             BIAS_base, stride_bm, stride_bn, DBIAS_base, stride_dbm, stride_dbn,
                             PREDICATE, True, HAS_DROPOUT, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, LAYOUT_BM, LIST_BM, DOT_PRECISION, MASKED_STAGES, PART_LUT,
                             EVEN, FLAT, HAS_POS, SCORE_MOD, LSE_BASE2)
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


@triton.jit
def _dq_inner(dq, x_sum, m_sum, e_sum, q, do, lse2, delta, offs_m, q_shift, offs_d, b, h, H, K_base, V_base, stride_kn, stride_vn,
              LUT_IDX, line, start, end, q_len, kv_len, Q_OFF, qk_scale, PARAMS, AUX, KPOS, seed_lo, seed_hi, drop_thresh, drop_scale,
              slope, softcap, BIAS_base, stride_bm, stride_bn,
              PREDICATE: tl.constexpr, MASKED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              LAYOUT_BN: tl.constexpr, LIST_BN: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr,
              LUT_MODE: tl.constexpr, EVEN: tl.constexpr, FLAT: tl.constexpr, HAS_POS: tl.constexpr,
              SCORE_MOD: tl.constexpr):
    # LIST_BN: keys per LUT entry (the layout block or a finer list block, compiler/finer.py)
    qp = offs_m + (Q_OFF + q_shift)
    NSUB: tl.constexpr = LIST_BN // BLOCK_N
    carry = lut_first(LUT_IDX, line, start, end, LUT_MODE)
    for t in tl.range(start * (NSUB if FLAT else 1), end * (NSUB if FLAT else 1), num_stages=STAGES):
        col, carry = lut_next(LUT_IDX, t // NSUB if FLAT else t, end, carry, LUT_MODE)
        for sub in tl.static_range(1 if FLAT else NSUB):
            offs_n = col * LIST_BN + ((t % NSUB) * BLOCK_N if FLAT else sub * BLOCK_N) + tl.arange(0, BLOCK_N)
            k_shift = block_shift(KPOS, layout_block(col, LIST_BN, LAYOUT_BN), LAYOUT_BN, HAS_POS)
            k = load_tile(K_base + offs_n[:, None] * stride_kn + offs_d[None, :], offs_n, kv_len, offs_d,
                          HEAD_DIM, HEAD_DIM_PAD, MASKED and not EVEN)
            v = load_tile(V_base + offs_n[:, None] * stride_vn + offs_d[None, :], offs_n, kv_len, offs_d,
                          HEAD_DIM, HEAD_DIM_PAD, MASKED and not EVEN)
            s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PRECISION)
            if SCORE_MOD != 0:
                # rows past q_len may sit in any tile of the last row block; keys past kv_len only in masked ones
                bias = load_bias(BIAS_base, offs_m, stride_bm, q_len, offs_n, stride_bn, kv_len, not EVEN,
                                 MASKED and not EVEN, SCORE_MOD)
                s, t = score_mod(s, qk_scale, qp[:, None], (offs_n + k_shift)[None, :], slope, bias, softcap, SCORE_MOD)
                p = tl.math.exp2(s - lse2[:, None])
            else:
                t = s
                p = tl.math.exp2(s * qk_scale - lse2[:, None])
            if MASKED:
                keep = PREDICATE(qp[:, None], (offs_n + k_shift)[None, :], (offs_m + q_shift)[:, None], b, h, PARAMS,
                                 AUX, False)
                if not EVEN:
                    keep = keep & (offs_n[None, :] < kv_len)
                p = tl.where(keep, p, 0.0)
                if SCORE_MOD & 2:  # no soft-cap derivative at masked elements (a NaN bias there must not leak)
                    t = tl.where(keep, t, 0.0)
            dp = mma(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PRECISION)
            if HAS_DROPOUT:
                drop = dropout_keep((offs_m + q_shift)[:, None], (offs_n + k_shift)[None, :], b * H + h, seed_lo, seed_hi, drop_thresh)
                dp = tl.where(drop, dp * drop_scale, 0.0)
            e = p * (dp - delta[:, None])
            ds = e
            pg = p
            if SCORE_MOD & 2:
                ds = ds * (1.0 - t * t)
                pg = p * (1.0 - t * t)
            if SCORE_MOD & 32:  # the slopes' gradient: per-row sums (see _dq_program)
                r = ((offs_n + k_shift)[None, :] - qp[:, None]).to(tl.float32)
                x_sum += tl.sum(ds * r, 1)
                m_sum += tl.sum(pg * r, 1)
                e_sum += tl.sum(e, 1)
            dq = mma(ds.to(k.dtype), k, dq, DOT_PRECISION)
    return dq, x_sum, m_sum, e_sum


@triton.jit
def _dq_program(pid_w, pid_bh, Q, K, V, DO, DQ, LSE, DELTA,
                 stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                 stride_dqb, stride_dqh, stride_dqm,
                 FULL_PTR, FULL_IDX, PART_PTR, PART_IDX, PARAMS, AUX, QPOS, KPOS, WORK, DQPART, NSLOT,
                 H, G, LZB, LZH, TR, q_len, kv_len, Q_OFF, qk_scale, sm_scale,
                 seed_lo, seed_hi, drop_thresh, drop_scale, SLOPES, SOFTCAP, BIAS, stride_bb, stride_bh, stride_bm,
                 stride_bn, DSLOPES,
                 PREDICATE: tl.constexpr, HAS_DROPOUT: tl.constexpr, USE_WORK: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 LAYOUT_BM: tl.constexpr, LAYOUT_BN: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 STAGES: tl.constexpr, MASKED_STAGES: tl.constexpr, FULL_LUT: tl.constexpr,
                 ACCUMULATE: tl.constexpr, EVEN: tl.constexpr, FLAT: tl.constexpr, HAS_POS: tl.constexpr,
                 SCORE_MOD: tl.constexpr, LIST_BN: tl.constexpr, PART_LUT: tl.constexpr,
                 LSE_BASE2: tl.constexpr = False):
    """dQ of one query tile (or work item ``pid_w``) and batch·head ``pid_bh``; ``LIST_BN`` keys
    per row-LUT entry."""
    tl.static_assert(LAYOUT_BM % BLOCK_M == 0, "kernel tile BLOCK_M must divide the layout block")
    tl.static_assert(LAYOUT_BN % BLOCK_N == 0, "kernel tile BLOCK_N must divide the layout block")
    tl.static_assert(LIST_BN % BLOCK_N == 0, "the kernel tile must divide the list block")
    tl.static_assert(LAYOUT_BN % LIST_BN == 0, "the list block must divide the layout block")
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    lut_base = (b * LZB + h * LZH) * TR
    tile, f0, f1, p0, p1, slot = work_item(WORK, pid_w, FULL_PTR, PART_PTR, lut_base, BLOCK_M, LAYOUT_BM, USE_WORK)
    blk = (tile * BLOCK_M) // LAYOUT_BM
    line = lut_base + blk
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_shift = block_shift(QPOS, blk, LAYOUT_BM, HAS_POS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = load_tile(Q + b64 * stride_qb + h64 * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                  offs_m, q_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    do = load_tile(DO + b64 * stride_dob + h64 * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                   offs_m, q_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    lse2 = _load_lse2(LSE + pid_bh.to(tl.int64) * q_len, offs_m, q_len, True, LSE_BASE2)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * q_len + offs_m, mask=offs_m < q_len, other=0.0)
    K_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    V_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    slope = 0.0
    if SCORE_MOD & 1:
        slope = tl.load(SLOPES + h)
    softcap = 1.0
    if SCORE_MOD & 2:
        softcap = tl.load(SOFTCAP)
    BIAS_base = BIAS + b64 * stride_bb + h64 * stride_bh
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    x_sum = 0.0
    m_sum = 0.0
    e_sum = 0.0
    if SCORE_MOD & 32:
        x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        e_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    dq, x_sum, m_sum, e_sum = _dq_inner(
        dq, x_sum, m_sum, e_sum, q, do, lse2, delta, offs_m, q_shift, offs_d, b, h, H, K_base, V_base, stride_kn,
        stride_vn, FULL_IDX, line, f0, f1, q_len, kv_len, Q_OFF, qk_scale, PARAMS, AUX, KPOS, seed_lo, seed_hi,
        drop_thresh, drop_scale, slope, softcap, BIAS_base, stride_bm, stride_bn, PREDICATE, False, HAS_DROPOUT,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, LAYOUT_BN, LIST_BN, DOT_PRECISION, STAGES, FULL_LUT, False, FLAT,
        HAS_POS, SCORE_MOD)
    dq, x_sum, m_sum, e_sum = _dq_inner(
        dq, x_sum, m_sum, e_sum, q, do, lse2, delta, offs_m, q_shift, offs_d, b, h, H, K_base, V_base, stride_kn,
        stride_vn, PART_IDX, line, p0, p1, q_len, kv_len, Q_OFF, qk_scale, PARAMS, AUX, KPOS, seed_lo, seed_hi,
        drop_thresh, drop_scale, slope, softcap, BIAS_base, stride_bm, stride_bn, PREDICATE, True, HAS_DROPOUT,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, LAYOUT_BN, LIST_BN, DOT_PRECISION, MASKED_STAGES, PART_LUT, EVEN, FLAT,
        HAS_POS, SCORE_MOD)
    # rows with nothing to attend get exactly 0 (their P is 0, but 0 * NaN from V would leak through dP)
    dq = tl.where((lse2 == float("inf"))[:, None], 0.0, dq * sm_scale)
    if SCORE_MOD & 32:  # per row Σ dS·(j - qp), Σ P·g·(j - qp), Σ P·(dP - delta): see ops/triton_backend.py
        empty = lse2 == float("inf")
        ptrs = DSLOPES + (pid_bh.to(tl.int64) * q_len + offs_m) * 3
        tl.atomic_add(ptrs, tl.where(empty, 0.0, x_sum), mask=offs_m < q_len)
        tl.atomic_add(ptrs + 1, tl.where(empty, 0.0, m_sum), mask=offs_m < q_len)
        tl.atomic_add(ptrs + 2, tl.where(empty, 0.0, e_sum), mask=offs_m < q_len)
    if slot < 0:
        store_grad_tile(DQ + b64 * stride_dqb + h64 * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
                        dq, offs_m, q_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, ACCUMULATE)
    else:
        r = tl.arange(0, BLOCK_M)
        base = (pid_bh.to(tl.int64) * NSLOT + slot) * BLOCK_M
        tl.store(DQPART + (base + r)[:, None] * HEAD_DIM_PAD + offs_d[None, :], dq)


@triton.jit(do_not_specialize=["TR", "TC", "q_len", "kv_len", "Q_OFF", "seed_lo", "seed_hi", "drop_thresh", "KV_NSLOT",
                               "Q_NSLOT", "N_KV_ITEMS", "N_KV_PROGS", "N_Q_ITEMS", "HEAD_MAJOR", "stride_bb", "stride_bh",
                               "stride_bm", "stride_bn", "stride_dbb", "stride_dbh", "stride_dbm", "stride_dbn"])
def _attn_bwd(Q, K, V, DO, DQ, DK, DV, LSE, DELTA,
              stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
              stride_dqb, stride_dqh, stride_dqm, stride_dkb, stride_dkh, stride_dkn,
              stride_dvb, stride_dvh, stride_dvn,
              RFULL_PTR, RFULL_IDX, RPART_PTR, RPART_IDX, CFULL_PTR, CFULL_IDX, CPART_PTR, CPART_IDX,
              PARAMS, AUX, QPOS, KPOS, KV_WORK, Q_WORK, DKPART, DVPART, DQPART, KV_NSLOT, Q_NSLOT,
              N_KV_ITEMS, N_KV_PROGS, N_Q_ITEMS, HEAD_MAJOR,
              H, G, LZB, LZH, TR, TC, q_len, kv_len, Q_OFF, qk_scale, sm_scale,
              seed_lo, seed_hi, drop_thresh, drop_scale, SLOPES, SOFTCAP,
              BIAS, stride_bb, stride_bh, stride_bm, stride_bn, DBIAS, stride_dbb, stride_dbh, stride_dbm, stride_dbn,
              DSLOPES,
              PREDICATE: tl.constexpr, HAS_DROPOUT: tl.constexpr, USE_WORK: tl.constexpr,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
              KV_BLOCK_M: tl.constexpr, KV_BLOCK_N: tl.constexpr, Q_BLOCK_M: tl.constexpr, Q_BLOCK_N: tl.constexpr,
              LAYOUT_BM: tl.constexpr, LAYOUT_BN: tl.constexpr, DOT_PRECISION: tl.constexpr,
              KV_STAGES: tl.constexpr, KV_MASKED_STAGES: tl.constexpr,
              Q_STAGES: tl.constexpr, Q_MASKED_STAGES: tl.constexpr, RUN_KV: tl.constexpr, RUN_Q: tl.constexpr,
              ROW_LUT: tl.constexpr, COL_LUT: tl.constexpr, ACCUMULATE: tl.constexpr,
              EVEN: tl.constexpr = False, KV_FLAT: tl.constexpr = False, Q_FLAT: tl.constexpr = False,
              HAS_POS: tl.constexpr = False, SCORE_MOD: tl.constexpr = 0,
              KV_LIST_BM: tl.constexpr = 0, Q_LIST_BN: tl.constexpr = 0,
              ROW_PART_LUT: tl.constexpr = "load", COL_PART_LUT: tl.constexpr = "load",
              LSE_BASE2: tl.constexpr = False):
    """The backward's main kernel on a 1-D grid of dK/dV programs (key tiles or work items of one
    batch·kv-head) and dQ programs (query tiles or items of one batch·head).

    With ``RUN_KV`` and ``RUN_Q`` both set, dK/dV and dQ run in one launch, so the two parts share
    the machine instead of two launches that each end with idle SMs. ``HEAD_MAJOR`` orders that
    grid by batch·kv-head: the dK/dV programs of one kv head, then the dQ programs of its GQA group,
    then the next head. Both parts read the same Q, K, V, dO of a head; run close together they
    find them in L2 instead of reading them from DRAM twice. Without it, all dK/dV programs
    (``N_KV_PROGS``) come first, then all dQ programs. With one of ``RUN_KV``/``RUN_Q`` set (and
    ``N_KV_PROGS = 0`` for dQ alone) the launch runs only that part, e.g. when the two parts want
    different warp counts. ``ACCUMULATE`` adds the gradients to what DQ/DK/DV hold instead of
    overwriting them. ``EVEN`` (both lengths multiples of the layout blocks) drops the masked loops'
    bounds terms and row checks. ``KV_FLAT``/``Q_FLAT`` run the dK/dV (dQ) loop once per kernel
    tile rather than once per layout block: a layout block of 128 queries walked in 64-query steps
    is then two iterations, and ``*_STAGES`` counts kernel tiles in flight as FlexAttention's
    stages do (unrolled, every sub-tile gets its own stage buffers: twice the shared memory).
    ``HAS_POS``: the layout is a shard with block position tables ``QPOS``/``KPOS`` (see
    ``_attn_fwd``). ``SCORE_MOD``, ``SLOPES``, ``SOFTCAP``, ``BIAS``: the score modifier (see
    ``_attn_fwd``); the soft-cap's derivative ``1 - tanh²`` enters dS, ALiBi and the bias add none.
    ``SCORE_MOD`` bit 16 (``kernels/common.score_grads``) adds, in the dK/dV programs, dS to the
    float32 bias gradient ``DBIAS`` (strides 0 on broadcast dims) with atomic adds: bit-reproducible
    only where no two programs add to one element (a bias broadcast over batch or heads). With bit
    32 the dQ programs add, per query row, ``Σ dS·(j - qp)``, ``Σ P·g·(j - qp)`` (``g`` the
    soft-cap's derivative, else 1) and ``Σ P·(dP - delta)`` to the float32 ``(B·H·Lq, 3)`` buffer
    ``DSLOPES``; ``ops/triton_backend.py`` forms the slopes' gradient from them with the row's exact
    ``delta`` (one program per row unless a work list splits it: then atomics make it not
    bit-reproducible).
    ``KV_LIST_BM`` (queries per column-LUT entry) and ``Q_LIST_BN`` (keys per row-LUT entry): 0 for
    the layout block, or a divisor of it when the tables list a finer classification
    (``compiler/finer.py``); with the kernel tile's step, each loop iteration is one tile.
    ``ROW_PART_LUT``/``COL_PART_LUT``: how the dQ/dK/dV loops read the masked lists (``"load"``, or
    ``"step"`` for tables whose masked lists are arithmetic progressions, ``kernels/common.lut_first``).
    ``LSE_BASE2``: ``LSE`` holds the preprocess's ``LSE2`` (base 2, -inf as +inf), read as is in
    every step of the dK/dV loops instead of converted there."""
    tl.static_assert(RUN_KV or RUN_Q, "the launch must run dK/dV, dQ or both")
    KV_STEP: tl.constexpr = KV_LIST_BM if KV_LIST_BM > 0 else LAYOUT_BM
    Q_STEP: tl.constexpr = Q_LIST_BN if Q_LIST_BN > 0 else LAYOUT_BN
    pid = tl.program_id(0)
    kv_item = pid % N_KV_ITEMS
    kv_bh = pid // N_KV_ITEMS
    pq = pid - N_KV_PROGS
    q_item = pq % N_Q_ITEMS
    q_bh = pq // N_Q_ITEMS
    if RUN_KV and RUN_Q:
        is_kv = pid < N_KV_PROGS
        if HEAD_MAJOR != 0:  # a run-time flag: switching order never compiles a new variant
            group = N_KV_ITEMS + G * N_Q_ITEMS
            r = pid % group
            is_kv = r < N_KV_ITEMS
            kv_item = r
            kv_bh = pid // group
            rq = tl.maximum(r - N_KV_ITEMS, 0)
            q_item = rq % N_Q_ITEMS
            HKV = H // G
            q_bh = (kv_bh // HKV) * H + (kv_bh % HKV) * G + rq // N_Q_ITEMS
    else:
        is_kv = RUN_KV
    if is_kv:
        _dkdv_program(kv_item, kv_bh, Q, K, V, DO, DK, DV, LSE, DELTA,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                      stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                      CFULL_PTR, CFULL_IDX, CPART_PTR, CPART_IDX, PARAMS, AUX, QPOS, KPOS, KV_WORK, DKPART, DVPART,
                      KV_NSLOT,
                      H, G, LZB, LZH, TC, q_len, kv_len, Q_OFF, qk_scale, sm_scale, seed_lo, seed_hi, drop_thresh,
                      drop_scale, SLOPES, SOFTCAP, BIAS, stride_bb, stride_bh, stride_bm, stride_bn, DBIAS, stride_dbb,
                      stride_dbh, stride_dbm, stride_dbn, PREDICATE, HAS_DROPOUT, USE_WORK, HEAD_DIM,
                      HEAD_DIM_PAD, KV_BLOCK_M,
                      KV_BLOCK_N, LAYOUT_BM, LAYOUT_BN, DOT_PRECISION, KV_STAGES, KV_MASKED_STAGES, COL_LUT, ACCUMULATE,
                      EVEN, KV_FLAT, HAS_POS, SCORE_MOD, KV_STEP, COL_PART_LUT, LSE_BASE2)
    else:
        _dq_program(q_item, q_bh, Q, K, V, DO, DQ, LSE, DELTA,
                    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                    stride_dqb, stride_dqh, stride_dqm,
                    RFULL_PTR, RFULL_IDX, RPART_PTR, RPART_IDX, PARAMS, AUX, QPOS, KPOS, Q_WORK, DQPART, Q_NSLOT,
                    H, G, LZB, LZH, TR, q_len, kv_len, Q_OFF, qk_scale, sm_scale, seed_lo, seed_hi, drop_thresh,
                    drop_scale, SLOPES, SOFTCAP, BIAS, stride_bb, stride_bh, stride_bm, stride_bn, DSLOPES, PREDICATE,
                    HAS_DROPOUT, USE_WORK, HEAD_DIM, HEAD_DIM_PAD, Q_BLOCK_M,
                    Q_BLOCK_N, LAYOUT_BM, LAYOUT_BN, DOT_PRECISION, Q_STAGES, Q_MASKED_STAGES, ROW_LUT, ACCUMULATE, EVEN,
                    Q_FLAT, HAS_POS, SCORE_MOD, Q_STEP, ROW_PART_LUT, LSE_BASE2)


@triton.jit(do_not_specialize=["n_rows", "NSLOT"])
def _sum_partials(OUT, PART, COMBINE, NSLOT, stride_b, stride_h, stride_m, NH, n_rows,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr,
                  ACCUMULATE: tl.constexpr):
    """Sum the fp32 pieces of split tiles into the gradient (deterministic: fixed order); with
    ``ACCUMULATE`` also the gradient's previous contents."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    tile = tl.load(COMBINE + pid_c * 3)
    first = tl.load(COMBINE + pid_c * 3 + 1)
    n = tl.load(COMBINE + pid_c * 3 + 2)
    r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.zeros([BLOCK, HEAD_DIM_PAD], dtype=tl.float32)
    for k in range(0, n):
        base = (pid_bh.to(tl.int64) * NSLOT + first + k) * BLOCK
        acc += tl.load(PART + (base + r)[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    offs = tile * BLOCK + r
    b = (pid_bh // NH).to(tl.int64)
    h = (pid_bh % NH).to(tl.int64)
    store_grad_tile(OUT + b * stride_b + h * stride_h + offs[:, None] * stride_m + offs_d[None, :],
                    acc, offs, n_rows, offs_d, HEAD_DIM, HEAD_DIM_PAD, ACCUMULATE)
