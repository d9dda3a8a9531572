"""Attention over one key interval per query row: forward and recompute backward.

The mask is two int32 numbers per row, ``lo[i] <= key < hi[i]`` (plus, for documents whose ids
may recur, the row's and the keys' ids, compared inside the interval), computed on the device
(``compiler/device_intervals.py``) together with per-tile ranges:

* forward and dQ, one program per tile of ``BLOCK_M`` rows: key tiles ``[first, end)``, of which
  ``[f0, f1)`` every row keeps whole;
* dK/dV, one program per tile of ``BLOCK_N`` keys: row tiles ``[first, end)``, of which ``[f0, f1)``
  keep the whole key tile.

Each program runs one loop body twice (``MASKED`` constexpr): over the full tiles without any test,
then over the others (``[first, f0)`` then ``[f1, end)``, one loop) with two compares against the
rows' bounds (and one id compare). Same conventions as ``kernels/forward.py`` and
``kernels/backward.py``: scores in base 2 with ``log2(e) · scale`` folded in, logsumexp (natural,
float32) saved, GQA by ``h // G``, int64 batch/head offsets, head dims padded to a power of two.
Dropout (``HAS_DROPOUT``) draws the block kernels' Philox stream (``kernels/common.dropout_keep``,
counters ``(row, key, b·H + h)``): the same elements are dropped on both paths.
Rows that keep nothing output 0 with LSE ``-inf`` and get zero gradients; such rows, and padding
rows past ``q_len``, may sit inside full tiles (the tables let them), which is exact because the
forward zeroes them at the end and the backward sees their LSE ``-inf`` (probabilities 0).
"""

import triton
import triton.language as tl

from .backward import _load_lse2
from .common import LN2, dropout_keep, load_tile, mma, store_grad_tile, store_tile


@triton.jit
def _tile_index(t, base, split, jump):
    """Tile ``t`` of a loop over ``[base, base + split)`` then ``[base + split + jump, ..)``."""
    return base + t + (t >= split).to(tl.int32) * jump


@triton.jit
def _key_tile(BASE, stride_n, offs_d, kv_len, t, base, split, jump, HEAD_DIM: tl.constexpr,
              HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CHECK: tl.constexpr):
    """``(offs_n, tile)``: the keys of loop step ``t`` (see :func:`_tile_index`) and their rows of
    ``BASE`` (K or V of one head), read as 0 past ``kv_len`` when ``CHECK``."""
    offs_n = _tile_index(t, base, split, jump) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_n, load_tile(BASE + offs_n[:, None] * stride_n + offs_d[None, :], offs_n, kv_len, offs_d,
                             HEAD_DIM, HEAD_DIM_PAD, CHECK)


@triton.jit
def _row_keep(offs_n, lo, hi, qid, KID_base, kv_len, HAS_IDS: tl.constexpr):
    """``(BLOCK_M, BLOCK_N)`` keep of rows ``[lo, hi)`` (and ids ``qid``) against keys ``offs_n``."""
    keep = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
    if HAS_IDS:
        kid = tl.load(KID_base + offs_n, mask=offs_n < kv_len, other=-2)
        keep = keep & (kid[None, :] == qid[:, None])
    return keep


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, lo, hi, qid, K_base, V_base, KID_base, stride_kn, stride_vn, offs_d, offs_m, bh,
              base, split, jump, count, kv_len, qk_scale, seed_lo, seed_hi, drop_thresh, drop_scale,
              MASKED: tl.constexpr, HAS_IDS: tl.constexpr, HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr,
              HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
              STAGES: tl.constexpr,
              KV_EVEN: tl.constexpr):
    for t in tl.range(0, count, num_stages=STAGES):
        offs_n, k = _key_tile(K_base, stride_kn, offs_d, kv_len, t, base, split, jump, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N,
                              MASKED and not KV_EVEN)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PRECISION)
        if MASKED:
            keep = _row_keep(offs_n, lo, hi, qid, KID_base, kv_len, HAS_IDS)
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            p = tl.where(dropout_keep(offs_m[:, None], offs_n[None, :], bh, seed_lo, seed_hi, drop_thresh),
                         p * drop_scale, 0.0)
        v = load_tile(V_base + offs_n[:, None] * stride_vn + offs_d[None, :], offs_n, kv_len, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, MASKED and not KV_EVEN)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _rows(LO, HI, QID, KID, ZB, ZH, KIDB, b, h, q_len, offs_m, HAS_IDS: tl.constexpr):
    """``(inst, lo, hi, qid, KID_base)`` of rows ``offs_m`` of batch ``b``, head ``h``: the mask
    instance ``b·ZB + h·ZH`` (strides 0 on dims the mask shares), bounds ``(0, 0)`` past ``q_len``."""
    inst = b.to(tl.int64) * ZB + h.to(tl.int64) * ZH
    row = inst * q_len + offs_m
    inside = offs_m < q_len
    lo = tl.load(LO + row, mask=inside, other=0)
    hi = tl.load(HI + row, mask=inside, other=0)
    qid = lo * 0 - 1
    if HAS_IDS:
        qid = tl.load(QID + row, mask=inside, other=-1)
    return inst, lo, hi, qid, KID + b.to(tl.int64) * KIDB


@triton.jit
def _row_tile(pid_m, pid_bh, K, V, LO, HI, QID, KID, TAB, stride_kb, stride_kh, stride_vb, stride_vh, H, G, ZB, ZH,
              KIDB, n_tiles, q_len, HAS_IDS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """What a program over row tile ``pid_m`` of batch·head ``pid_bh`` (forward, dQ) starts from:
    ``(b64, h64, offs_m, offs_d, lo, hi, qid, KID_base, first, f0, f1, end, K_base, V_base)``."""
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    inst, lo, hi, qid, KID_base = _rows(LO, HI, QID, KID, ZB, ZH, KIDB, b, h, q_len, offs_m, HAS_IDS)
    tab = TAB + (inst * n_tiles + pid_m) * 4
    b64 = b.to(tl.int64)
    return (b64, h.to(tl.int64), offs_m, tl.arange(0, HEAD_DIM_PAD), lo, hi, qid, KID_base, tl.load(tab),
            tl.load(tab + 1), tl.load(tab + 2), tl.load(tab + 3), K + b64 * stride_kb + hk.to(tl.int64) * stride_kh,
            V + b64 * stride_vb + hk.to(tl.int64) * stride_vh)


@triton.jit(do_not_specialize=["q_len", "kv_len", "n_tiles", "ZB", "ZH", "KIDB", "seed_lo", "seed_hi", "drop_thresh"])
def _interval_fwd(Q, K, V, O, LSE, LO, HI, QID, KID, TAB,
                  stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                  H, G, ZB, ZH, KIDB, n_tiles, q_len, kv_len, qk_scale, seed_lo, seed_hi, drop_thresh, drop_scale,
                  HAS_IDS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  STAGES: tl.constexpr, KV_EVEN: tl.constexpr, HAS_DROPOUT: tl.constexpr = False):
    """Forward of one tile of ``BLOCK_M`` rows and batch·head: grid ``(n_tiles, B·H)``. ``TAB``:
    ``(first, f0, f1, end)`` per (instance, tile) in key tiles of ``BLOCK_N``. ``KV_EVEN``:
    ``kv_len % BLOCK_N == 0`` (no key row checks)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b64, h64, offs_m, offs_d, lo, hi, qid, KID_base, first, f0, f1, end, K_base, V_base = _row_tile(
        pid_m, pid_bh, K, V, LO, HI, QID, KID, TAB, stride_kb, stride_kh, stride_vb, stride_vh, H, G, ZB, ZH, KIDB,
        n_tiles, q_len, HAS_IDS, HEAD_DIM_PAD, BLOCK_M)
    q = load_tile(Q + b64 * stride_qb + h64 * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                  offs_m, q_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, lo, hi, qid, K_base, V_base, KID_base, stride_kn, stride_vn, offs_d,
                              offs_m, pid_bh, f0, f1 - f0, 0, f1 - f0, kv_len, qk_scale, seed_lo, seed_hi, drop_thresh,
                              drop_scale, False, HAS_IDS, HAS_DROPOUT, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N,
                              DOT_PRECISION, STAGES, KV_EVEN)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, lo, hi, qid, K_base, V_base, KID_base, stride_kn, stride_vn, offs_d,
                              offs_m, pid_bh, first, f0 - first, f1 - f0, (f0 - first) + (end - f1), kv_len, qk_scale,
                              seed_lo, seed_hi, drop_thresh, drop_scale, True, HAS_IDS, HAS_DROPOUT, HEAD_DIM,
                              HEAD_DIM_PAD, BLOCK_M, BLOCK_N, DOT_PRECISION, STAGES, KV_EVEN)
    # rows that keep nothing give exactly 0 (they may have run through full tiles)
    empty = (l_i == 0.0) | (hi <= lo)
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    store_tile(O + b64 * stride_ob + h64 * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
               out.to(O.dtype.element_ty), offs_m, q_len, offs_d, HEAD_DIM, HEAD_DIM_PAD)
    tl.store(LSE + pid_bh.to(tl.int64) * q_len + offs_m, lse, mask=offs_m < q_len)


@triton.jit
def _row_operands(Q_base, DO_base, LSE_row, DELTA_row, offs_m, offs_d, stride_qm, stride_dom, q_len,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CHECK: tl.constexpr):
    """``(q, do, lse2, delta)`` of rows ``offs_m``: rows past ``q_len`` (``CHECK``) read as 0 with LSE
    +inf, and rows that keep nothing have LSE +inf, so their recomputed probabilities are 0."""
    q = load_tile(Q_base + offs_m[:, None] * stride_qm + offs_d[None, :], offs_m, q_len, offs_d,
                  HEAD_DIM, HEAD_DIM_PAD, CHECK)
    do = load_tile(DO_base + offs_m[:, None] * stride_dom + offs_d[None, :], offs_m, q_len, offs_d,
                   HEAD_DIM, HEAD_DIM_PAD, CHECK)
    lse2 = _load_lse2(LSE_row, offs_m, q_len, CHECK)
    if CHECK:
        delta = tl.load(DELTA_row + offs_m, mask=offs_m < q_len, other=0.0)
    else:
        delta = tl.load(DELTA_row + offs_m)
    return q, do, lse2, delta


@triton.jit
def _dkdv_loop(dk, dv, k, v, offs_n, offs_d, Q_base, DO_base, LSE_row, DELTA_row, LO_row, HI_row, QID_row,
               kid, stride_qm, stride_dom, bh, base, split, jump, count, q_len, qk_scale, seed_lo, seed_hi, drop_thresh,
               drop_scale, MASKED: tl.constexpr, HAS_IDS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr,
               Q_EVEN: tl.constexpr):
    CHECK: tl.constexpr = MASKED or not Q_EVEN  # full tiles may hold the padding rows of the last tile
    for t in tl.range(0, count, num_stages=STAGES):
        offs_m = _tile_index(t, base, split, jump) * BLOCK_M + tl.arange(0, BLOCK_M)
        q, do, lse2, delta = _row_operands(Q_base, DO_base, LSE_row, DELTA_row, offs_m, offs_d, stride_qm, stride_dom,
                                           q_len, HEAD_DIM, HEAD_DIM_PAD, CHECK)
        s_t = mma(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT_PRECISION)
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
        if MASKED:
            inside = offs_m < q_len
            lo = tl.load(LO_row + offs_m, mask=inside, other=0)
            hi = tl.load(HI_row + offs_m, mask=inside, other=0)
            keep = (offs_n[:, None] >= lo[None, :]) & (offs_n[:, None] < hi[None, :])
            if HAS_IDS:
                qid = tl.load(QID_row + offs_m, mask=inside, other=-1)
                keep = keep & (kid[:, None] == qid[None, :])
            p_t = tl.where(keep, p_t, 0.0)
        dp_t = mma(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT_PRECISION)
        if HAS_DROPOUT:
            drop = dropout_keep(offs_m[None, :], offs_n[:, None], bh, seed_lo, seed_hi, drop_thresh)
            dv = mma(tl.where(drop, p_t * drop_scale, 0.0).to(do.dtype), do, dv, DOT_PRECISION)
            dp_t = tl.where(drop, dp_t * drop_scale, 0.0)
        else:
            dv = mma(p_t.to(do.dtype), do, dv, DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = mma(ds_t.to(q.dtype), q, dk, DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_program(pid_n, pid_bhk, Q, K, V, DO, DK, DV, LSE, DELTA, LO, HI, QID, KID, TAB,
                  stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                  stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                  H, G, ZB, ZH, KIDB, n_tiles, q_len, kv_len, qk_scale, sm_scale, seed_lo, seed_hi, drop_thresh,
                  drop_scale, HAS_IDS: tl.constexpr, HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, Q_EVEN: tl.constexpr):
    """dK/dV of key tile ``pid_n`` of batch·kv-head ``pid_bhk``, summed over the GQA group; ``TAB``:
    ``(first, f0, f1, end)`` per (instance, key tile) in row tiles of ``BLOCK_M``."""
    HKV = H // G
    b = pid_bhk // HKV
    hk = pid_bhk % HKV
    b64 = b.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k = load_tile(K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                  offs_n, kv_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    v = load_tile(V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                  offs_n, kv_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    kid = offs_n * 0
    if HAS_IDS:
        kid = tl.load(KID + b64 * KIDB + offs_n, mask=offs_n < kv_len, other=-2)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    for g in range(0, G):
        h = hk * G + g
        h64 = h.to(tl.int64)
        inst = b64 * ZB + h64 * ZH
        tab = TAB + (inst * n_tiles + pid_n) * 4
        first = tl.load(tab)
        f0 = tl.load(tab + 1)
        f1 = tl.load(tab + 2)
        end = tl.load(tab + 3)
        Q_base = Q + b64 * stride_qb + h64 * stride_qh
        DO_base = DO + b64 * stride_dob + h64 * stride_doh
        row = (b64 * H + h64) * q_len
        LO_row = LO + inst * q_len
        bh = b * H + h
        dk, dv = _dkdv_loop(dk, dv, k, v, offs_n, offs_d, Q_base, DO_base, LSE + row, DELTA + row, LO_row,
                            HI + inst * q_len, QID + inst * q_len, kid, stride_qm, stride_dom, bh,
                            f0, f1 - f0, 0, f1 - f0, q_len, qk_scale, seed_lo, seed_hi, drop_thresh, drop_scale,
                            False, HAS_IDS, HAS_DROPOUT, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, DOT_PRECISION,
                            STAGES, Q_EVEN)
        dk, dv = _dkdv_loop(dk, dv, k, v, offs_n, offs_d, Q_base, DO_base, LSE + row, DELTA + row, LO_row,
                            HI + inst * q_len, QID + inst * q_len, kid, stride_qm, stride_dom, bh,
                            first, f0 - first, f1 - f0, (f0 - first) + (end - f1), q_len, qk_scale, seed_lo, seed_hi,
                            drop_thresh, drop_scale, True, HAS_IDS, HAS_DROPOUT, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M,
                            BLOCK_N, DOT_PRECISION, STAGES, Q_EVEN)
    store_grad_tile(DK + b64 * stride_dkb + hk.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkn
                    + offs_d[None, :], dk * sm_scale, offs_n, kv_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, False)
    store_grad_tile(DV + b64 * stride_dvb + hk.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvn
                    + offs_d[None, :], dv, offs_n, kv_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, False)


@triton.jit
def _dq_loop(dq, q, do, lse2, delta, lo, hi, qid, K_base, V_base, KID_base, stride_kn, stride_vn, offs_d, offs_m, bh,
             base, split, jump, count, kv_len, qk_scale, seed_lo, seed_hi, drop_thresh, drop_scale,
             MASKED: tl.constexpr, HAS_IDS: tl.constexpr, HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr,
             HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
             STAGES: tl.constexpr,
             KV_EVEN: tl.constexpr):
    for t in tl.range(0, count, num_stages=STAGES):
        offs_n, k = _key_tile(K_base, stride_kn, offs_d, kv_len, t, base, split, jump, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N,
                              MASKED and not KV_EVEN)
        v = load_tile(V_base + offs_n[:, None] * stride_vn + offs_d[None, :], offs_n, kv_len, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, MASKED and not KV_EVEN)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PRECISION)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(_row_keep(offs_n, lo, hi, qid, KID_base, kv_len, HAS_IDS), p, 0.0)
        dp = mma(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PRECISION)
        if HAS_DROPOUT:
            drop = dropout_keep(offs_m[:, None], offs_n[None, :], bh, seed_lo, seed_hi, drop_thresh)
            dp = tl.where(drop, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = mma(ds.to(k.dtype), k, dq, DOT_PRECISION)
    return dq


@triton.jit
def _dq_program(pid_m, pid_bh, Q, K, V, DO, DQ, LSE, DELTA, LO, HI, QID, KID, TAB,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
                H, G, ZB, ZH, KIDB, n_tiles, q_len, kv_len, qk_scale, sm_scale, seed_lo, seed_hi, drop_thresh,
                drop_scale, HAS_IDS: tl.constexpr, HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr,
                HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, KV_EVEN: tl.constexpr):
    """dQ of row tile ``pid_m`` of batch·head ``pid_bh`` (tables as the forward's)."""
    b64, h64, offs_m, offs_d, lo, hi, qid, KID_base, first, f0, f1, end, K_base, V_base = _row_tile(
        pid_m, pid_bh, K, V, LO, HI, QID, KID, TAB, stride_kb, stride_kh, stride_vb, stride_vh, H, G, ZB, ZH, KIDB,
        n_tiles, q_len, HAS_IDS, HEAD_DIM_PAD, BLOCK_M)
    row = pid_bh.to(tl.int64) * q_len
    q, do, lse2, delta = _row_operands(Q + b64 * stride_qb + h64 * stride_qh, DO + b64 * stride_dob + h64 * stride_doh,
                                       LSE + row, DELTA + row, offs_m, offs_d, stride_qm, stride_dom, q_len,
                                       HEAD_DIM, HEAD_DIM_PAD, True)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    dq = _dq_loop(dq, q, do, lse2, delta, lo, hi, qid, K_base, V_base, KID_base, stride_kn, stride_vn, offs_d,
                  offs_m, pid_bh, f0, f1 - f0, 0, f1 - f0, kv_len, qk_scale, seed_lo, seed_hi, drop_thresh, drop_scale,
                  False, HAS_IDS, HAS_DROPOUT, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, DOT_PRECISION, STAGES, KV_EVEN)
    dq = _dq_loop(dq, q, do, lse2, delta, lo, hi, qid, K_base, V_base, KID_base, stride_kn, stride_vn, offs_d,
                  offs_m, pid_bh, first, f0 - first, f1 - f0, (f0 - first) + (end - f1), kv_len, qk_scale, seed_lo,
                  seed_hi, drop_thresh, drop_scale, True, HAS_IDS, HAS_DROPOUT, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M,
                  BLOCK_N, DOT_PRECISION, STAGES, KV_EVEN)
    # rows that keep nothing get exactly 0 (0 * NaN from V would leak through dP)
    dq = tl.where((lse2 == float("inf"))[:, None], 0.0, dq * sm_scale)
    store_grad_tile(DQ + b64 * stride_dqb + h64 * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
                    dq, offs_m, q_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, False)


@triton.jit(do_not_specialize=["q_len", "kv_len", "N_KV", "KV_TILES", "Q_TILES", "ZB", "ZH", "KIDB", "seed_lo",
                               "seed_hi", "drop_thresh"])
def _interval_bwd(Q, K, V, DO, DQ, DK, DV, LSE, DELTA, LO, HI, QID, KID, ROW_TAB, COL_TAB,
                  stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                  stride_dqb, stride_dqh, stride_dqm, stride_dkb, stride_dkh, stride_dkn,
                  stride_dvb, stride_dvh, stride_dvn,
                  H, G, ZB, ZH, KIDB, N_KV, KV_TILES, Q_TILES, q_len, kv_len, qk_scale, sm_scale,
                  seed_lo, seed_hi, drop_thresh, drop_scale, HAS_IDS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr,
                  KV_BLOCK_M: tl.constexpr, KV_BLOCK_N: tl.constexpr, Q_BLOCK_M: tl.constexpr,
                  Q_BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_STAGES: tl.constexpr,
                  Q_STAGES: tl.constexpr, RUN_KV: tl.constexpr, RUN_Q: tl.constexpr,
                  Q_EVEN: tl.constexpr, KV_EVEN: tl.constexpr, HAS_DROPOUT: tl.constexpr = False):
    """The backward on a 1-D grid: ``N_KV = KV_TILES · B · Hkv`` dK/dV programs, then
    ``Q_TILES · B · H`` dQ programs (``RUN_KV``/``RUN_Q``: only one part, ``N_KV = 0`` for dQ
    alone). ``Q_EVEN``: ``q_len % KV_BLOCK_M == 0``; ``KV_EVEN``: ``kv_len % Q_BLOCK_N == 0``."""
    tl.static_assert(RUN_KV or RUN_Q, "the launch must run dK/dV, dQ or both")
    pid = tl.program_id(0)
    if RUN_KV and RUN_Q:
        is_kv = pid < N_KV
    else:
        is_kv = RUN_KV
    if is_kv:
        _dkdv_program(pid % KV_TILES, pid // KV_TILES, Q, K, V, DO, DK, DV, LSE, DELTA, LO, HI, QID, KID, COL_TAB,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                      stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                      H, G, ZB, ZH, KIDB, KV_TILES, q_len, kv_len, qk_scale, sm_scale, seed_lo, seed_hi, drop_thresh,
                      drop_scale, HAS_IDS, HAS_DROPOUT, HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_M, KV_BLOCK_N, DOT_PRECISION,
                      KV_STAGES, Q_EVEN)
    else:
        pq = pid - N_KV
        _dq_program(pq % Q_TILES, pq // Q_TILES, Q, K, V, DO, DQ, LSE, DELTA, LO, HI, QID, KID, ROW_TAB,
                    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                    stride_dqb, stride_dqh, stride_dqm,
                    H, G, ZB, ZH, KIDB, Q_TILES, q_len, kv_len, qk_scale, sm_scale, seed_lo, seed_hi, drop_thresh,
                    drop_scale, HAS_IDS, HAS_DROPOUT, HEAD_DIM, HEAD_DIM_PAD, Q_BLOCK_M, Q_BLOCK_N, DOT_PRECISION,
                    Q_STAGES, KV_EVEN)
