"""Fused block-sparse forward (FlashAttention-2 order).

One program per (query tile, batch·head). The program walks its layout row's LUT: first the
unmasked (full) key blocks, then the masked (partial / ragged-edge) ones, each through the same
inner loop (``MASKED`` switches the predicate on). Online softmax in base 2 with
``log2(e) · scale`` folded into the scores, normalisation deferred to the end, logsumexp (natural
log, float32) saved for the backward. Fully masked rows produce 0 and LSE ``-inf``.
"""

import triton
import triton.language as tl

from .common import (LN2, block_shift, dropout_keep, load_bias, load_tile, lut_first, lut_next, merge_part, mma,
                     score_mod, store_tile, work_item)
from .common import layout_block


@triton.jit
def _kv_tile(BASE, row0, offs_n, stride_n, kv_len, offs_d, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
             CHECK_ROWS: tl.constexpr, KV_DESC: tl.constexpr):
    """A ``(BLOCK_N, HEAD_DIM_PAD)`` key or value tile at rows ``offs_n = row0 + arange``: through a tensor
    descriptor (TMA on Hopper; rows past ``kv_len`` and columns past ``HEAD_DIM`` read as 0) when
    ``KV_DESC``, else through pointers."""
    if KV_DESC:
        x = BASE.load([row0, 0])
    else:
        x = load_tile(BASE + offs_n[:, None] * stride_n + offs_d[None, :], offs_n, kv_len, offs_d,
                      HEAD_DIM, HEAD_DIM_PAD, CHECK_ROWS)
    return x


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, qp, offs_m, q_shift, offs_d, b, h, H,
               K_base, V_base, stride_kn, stride_vn, LUT_IDX, line, start, end,
               q_len, kv_len, qk_scale, PARAMS, AUX, KPOS, seed_lo, seed_hi, drop_thresh, drop_scale, slope, softcap,
               BIAS_base, stride_bm, stride_bn,
               PREDICATE: tl.constexpr, MASKED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               LAYOUT_BN: tl.constexpr, LIST_BN: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr,
               LUT_MODE: tl.constexpr, KV_DESC: tl.constexpr, WARP_SPEC: tl.constexpr,
               KV_EVEN: tl.constexpr, HAS_POS: tl.constexpr, SCORE_MOD: tl.constexpr):
    # KV_EVEN: kv_len is a multiple of the layout block, so no key row of a listed block is out of
    # range: the masked loop drops the bounds term and the K/V row checks (ops/triton_backend.set_even_bounds)
    # LIST_BN: keys per LUT entry (the layout block, or a finer list block: compiler/finer.py); an
    # entry is LIST_BN // BLOCK_N kernel tiles, one iteration each when LIST_BN == BLOCK_N
    carry = lut_first(LUT_IDX, line, start, end, LUT_MODE)
    for e in tl.range(start, end, num_stages=STAGES, warp_specialize=WARP_SPEC):
        col, carry = lut_next(LUT_IDX, e, end, carry, LUT_MODE)
        for sub in tl.static_range(LIST_BN // BLOCK_N):
            row0 = col * LIST_BN + sub * BLOCK_N
            offs_n = row0 + tl.arange(0, BLOCK_N)
            k_shift = block_shift(KPOS, layout_block(col, LIST_BN, LAYOUT_BN), LAYOUT_BN, HAS_POS)
            k = _kv_tile(K_base, row0, offs_n, stride_kn, kv_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, MASKED and not KV_EVEN, KV_DESC)
            s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PRECISION)
            if SCORE_MOD != 0:  # scores in the base-2 domain, modified (kernels/common.score_mod)
                # rows past q_len may sit in any tile of the last row block; keys past kv_len only in masked ones
                bias = load_bias(BIAS_base, offs_m, stride_bm, q_len, offs_n, stride_bn, kv_len, True,
                                 MASKED and not KV_EVEN, SCORE_MOD)
                s, _ = score_mod(s, qk_scale, qp[:, None], (offs_n + k_shift)[None, :], slope, bias, softcap, SCORE_MOD)
            if MASKED:
                keep = PREDICATE(qp[:, None], (offs_n + k_shift)[None, :], (offs_m + q_shift)[:, None], b, h, PARAMS, AUX,
                                 False)
                if not KV_EVEN:
                    keep = keep & (offs_n[None, :] < kv_len)
                if SCORE_MOD != 0:
                    s = tl.where(keep, s, float("-inf"))
                else:
                    s = tl.where(keep, s * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(s - m_use[:, None])
            elif SCORE_MOD != 0:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = m_new
                if SCORE_MOD & 8:  # a -inf bias may remove every key of a row so far
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(s - m_use[:, None])
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
                m_use = m_new
                p = tl.math.exp2(s * qk_scale - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            if HAS_DROPOUT:
                drop = dropout_keep((offs_m + q_shift)[:, None], (offs_n + k_shift)[None, :], b * H + h, seed_lo, seed_hi, drop_thresh)
                p = tl.where(drop, p * drop_scale, 0.0)
            v = _kv_tile(V_base, row0, offs_n, stride_vn, kv_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, MASKED and not KV_EVEN, KV_DESC)
            acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
            m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["TR", "q_len", "kv_len", "Q_OFF", "seed_lo", "seed_hi", "drop_thresh", "NSLOT",
                               "stride_bb", "stride_bh", "stride_bm", "stride_bn"])
def _attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qm,
              stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn,
              stride_ob, stride_oh, stride_om,
              FULL_PTR, FULL_IDX, PART_PTR, PART_IDX, PARAMS, AUX, QPOS, KPOS, WORK, OPART, LPART, NSLOT,
              H, G, LZB, LZH, TR, q_len, kv_len, Q_OFF, qk_scale,
              seed_lo, seed_hi, drop_thresh, drop_scale, SLOPES, SOFTCAP, BIAS, stride_bb, stride_bh, stride_bm, stride_bn,
              PREDICATE: tl.constexpr, HAS_DROPOUT: tl.constexpr, USE_WORK: tl.constexpr,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              LAYOUT_BM: tl.constexpr, LAYOUT_BN: tl.constexpr, DOT_PRECISION: tl.constexpr,
              STAGES: tl.constexpr, MASKED_STAGES: tl.constexpr,
              FULL_LUT: tl.constexpr, PART_LUT: tl.constexpr,
              KV_DESC: tl.constexpr = False, WARP_SPEC: tl.constexpr = False,
              KV_EVEN: tl.constexpr = False, HAS_POS: tl.constexpr = False, SCORE_MOD: tl.constexpr = 0,
              LIST_BN: tl.constexpr = 0):
    """One program per work item (or query tile) and batch·head. With ``USE_WORK`` the item
    ``(tile, f0, f1, p0, p1, slot)`` comes from the work list; ``slot >= 0`` marks a piece of a
    split tile, whose normalised output and LSE go to ``OPART``/``LPART`` for the combine kernel.
    With ``HAS_POS`` the layout is a shard of a larger one: ``QPOS``/``KPOS`` hold the global index of
    each local row/key block's first row/key (``kernels/common.block_shift``). ``SCORE_MOD`` (bit
    flags, 0: none) modifies the scores (``kernels/common.score_mod``) with the per-head ALiBi
    slopes ``SLOPES``, the additive bias ``BIAS`` (strides 0 on its broadcast dims) and the soft-cap
    ``SOFTCAP[0]``, run-time values (tensors: new values never select a compiled variant). ``LIST_BN``: keys
    per entry of the row LUT (0: the layout block ``LAYOUT_BN``; a divisor of it when the tables list the
    blocks of a finer classification, ``compiler/finer.py``)."""
    tl.static_assert(LAYOUT_BM % BLOCK_M == 0, "kernel tile BLOCK_M must divide the layout block")
    tl.static_assert(LAYOUT_BN % BLOCK_N == 0, "kernel tile BLOCK_N must divide the layout block")
    STEP_N: tl.constexpr = LIST_BN if LIST_BN > 0 else LAYOUT_BN
    tl.static_assert(STEP_N % BLOCK_N == 0, "the kernel tile must divide the list block")
    tl.static_assert(LAYOUT_BN % STEP_N == 0, "the list block must divide the layout block")
    tl.static_assert(HEAD_DIM <= HEAD_DIM_PAD, "HEAD_DIM_PAD must cover HEAD_DIM")
    pid_w = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // G
    lut_base = (b * LZB + h * LZH) * TR
    tile, f0, f1, p0, p1, slot = work_item(WORK, pid_w, FULL_PTR, PART_PTR, lut_base, BLOCK_M, LAYOUT_BM, USE_WORK)
    blk = (tile * BLOCK_M) // LAYOUT_BM
    line = lut_base + blk
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_shift = block_shift(QPOS, blk, LAYOUT_BM, HAS_POS)
    qp = offs_m + (Q_OFF + q_shift)

    b64 = b.to(tl.int64)
    q = load_tile(Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                  offs_m, q_len, offs_d, HEAD_DIM, HEAD_DIM_PAD, True)
    K_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    V_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    if KV_DESC:  # the launcher checked the 16-byte alignment of base and row stride
        K_base = tl.make_tensor_descriptor(K_base, shape=[kv_len, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM_PAD])
        V_base = tl.make_tensor_descriptor(V_base, shape=[kv_len, HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM_PAD])

    slope = 0.0
    if SCORE_MOD & 1:
        slope = tl.load(SLOPES + h)
    softcap = 1.0
    if SCORE_MOD & 2:
        softcap = tl.load(SOFTCAP)
    BIAS_base = BIAS + b64 * stride_bb + h.to(tl.int64) * stride_bh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, qp, offs_m, q_shift, offs_d, b, h, H, K_base, V_base,
                               stride_kn, stride_vn,
                               FULL_IDX, line, f0, f1, q_len, kv_len, qk_scale, PARAMS, AUX, KPOS,
                               seed_lo, seed_hi, drop_thresh, drop_scale, slope, softcap, BIAS_base, stride_bm, stride_bn,
                               PREDICATE, False, HAS_DROPOUT,
                               HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, LAYOUT_BN, STEP_N, DOT_PRECISION, STAGES, FULL_LUT,
                               KV_DESC, WARP_SPEC, False, HAS_POS, SCORE_MOD)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, qp, offs_m, q_shift, offs_d, b, h, H, K_base, V_base,
                               stride_kn, stride_vn,
                               PART_IDX, line, p0, p1, q_len, kv_len, qk_scale, PARAMS, AUX, KPOS,
                               seed_lo, seed_hi, drop_thresh, drop_scale, slope, softcap, BIAS_base, stride_bm, stride_bn,
                               PREDICATE, True, HAS_DROPOUT,
                               HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, LAYOUT_BN, STEP_N, DOT_PRECISION, MASKED_STAGES, PART_LUT,
                               KV_DESC, False, KV_EVEN, HAS_POS, SCORE_MOD)
    empty = l_i == 0.0
    # rows with nothing to attend give exactly 0, whatever V holds (0 * NaN would leak through P @ V)
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    if slot < 0:
        store_tile(O + b64 * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
                   out.to(O.dtype.element_ty), offs_m, q_len, offs_d, HEAD_DIM, HEAD_DIM_PAD)
        tl.store(LSE + pid_bh.to(tl.int64) * q_len + offs_m, lse, mask=offs_m < q_len)
    else:
        r = tl.arange(0, BLOCK_M)
        base = (pid_bh.to(tl.int64) * NSLOT + slot) * BLOCK_M
        tl.store(OPART + (base + r)[:, None] * HEAD_DIM_PAD + offs_d[None, :], out)
        tl.store(LPART + base + r, lse)


@triton.jit(do_not_specialize=["q_len", "NSLOT"])
def _attn_fwd_combine(O, LSE, OPART, LPART, COMBINE, NSLOT, stride_ob, stride_oh, stride_om, H, q_len,
                      HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Merge the pieces of split tiles: ``lse = logsumexp_k lse_k``, ``o = Σ_k exp(lse_k − lse) o_k``."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    tile = tl.load(COMBINE + pid_c * 3)
    first = tl.load(COMBINE + pid_c * 3 + 1)
    n = tl.load(COMBINE + pid_c * 3 + 2)
    r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for k in range(0, n):
        base = (pid_bh.to(tl.int64) * NSLOT + first + k) * BLOCK_M
        lse_k = tl.load(LPART + base + r)
        o_k = tl.load(OPART + (base + r)[:, None] * HEAD_DIM_PAD + offs_d[None, :])
        m, l, acc = merge_part(m, l, acc, lse_k, o_k)
    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l)))
    offs_m = tile * BLOCK_M + r
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    store_tile(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
               out.to(O.dtype.element_ty), offs_m, q_len, offs_d, HEAD_DIM, HEAD_DIM_PAD)
    tl.store(LSE + pid_bh.to(tl.int64) * q_len + offs_m, lse, mask=offs_m < q_len)
