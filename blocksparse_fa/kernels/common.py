"""Triton helpers shared by the forward and backward kernels."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def load_tile(ptrs, offs_rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
              CHECK_ROWS: tl.constexpr):
    """The one boundary-aware tile load: rows checked only when ``CHECK_ROWS``, the head dim only
    when it was padded to a power of two. Out-of-range elements read as 0."""
    if CHECK_ROWS:
        if HEAD_DIM == HEAD_DIM_PAD:
            x = tl.load(ptrs, mask=offs_rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == HEAD_DIM_PAD:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def store_tile(ptrs, x, offs_rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    if HEAD_DIM == HEAD_DIM_PAD:
        tl.store(ptrs, x, mask=offs_rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def store_grad_tile(ptrs, x, offs_rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    ACCUMULATE: tl.constexpr):
    """Store an fp32 gradient tile in the output's dtype; with ``ACCUMULATE`` add it to what the
    output holds (a second mask part's gradients, ``ops/residue.py``)."""
    if ACCUMULATE:
        x += load_tile(ptrs, offs_rows, n_rows, offs_d, HEAD_DIM, HEAD_DIM_PAD, True).to(tl.float32)
    store_tile(ptrs, x.to(ptrs.dtype.element_ty), offs_rows, n_rows, offs_d, HEAD_DIM, HEAD_DIM_PAD)


@triton.jit
def block_shift(POS, blk, LAYOUT_B: tl.constexpr, HAS_POS: tl.constexpr):
    """Global index minus local index of the rows (or keys) of local layout block ``blk``: 0 without
    ``HAS_POS``. With it (a shard of a larger layout, ``compiler/shard.py``) ``POS[blk]`` holds the
    global index of the block's first row (or key), so that the element predicate and the dropout
    counters see the positions of the unsharded run; bounds checks keep using the local indices.
    A scalar, added where positions are used, so that no second index vector stays live."""
    if HAS_POS:
        d = tl.load(POS + blk) - blk * LAYOUT_B
    else:
        d = 0
    return d


@triton.jit
def layout_block(entry, LIST_B: tl.constexpr, LAYOUT_B: tl.constexpr):
    """The layout block holding list block ``entry`` when the LUTs list blocks of ``LIST_B`` rows or
    keys, a divisor of the layout block ``LAYOUT_B`` (a finer classification, ``compiler/finer.py``):
    what :func:`block_shift`'s position tables are indexed by."""
    if LIST_B == LAYOUT_B:
        blk = entry
    else:
        blk = entry // (LAYOUT_B // LIST_B)
    return blk


@triton.jit
def lut_first(LUT_IDX, line, start, end, MODE: tl.constexpr):
    """Loop-carried state for walking the entries ``start .. end`` of LUT line ``line`` (see
    :func:`lut_next`).

    ``MODE`` says how the block index of an entry is found:
    ``"load"``: read it from the LUT inside the loop (the tile loads of that iteration wait on it);
    ``"prefetch"``: read it one iteration ahead, so the tile loads use an index already in registers;
    ``"arith"``: every line's list is one run of consecutive blocks (dense, causal, sliding windows,
    documents) and ``LUT_IDX[line]`` holds ``first block - first entry`` of the line
    (``compiler/luts.py``), so the index is ``LUT_IDX[line] + e`` and the loop reads no index at all;
    ``"step"``: every line's list is an arithmetic progression with one step for all lines
    (strided masks' partial blocks): ``LUT_IDX[0]`` holds the step and ``LUT_IDX[1 + line]`` the
    line's ``first block - first entry · step``, so the index is ``LUT_IDX[1 + line] + e · step``.
    """
    if MODE == "arith":
        carry = tl.load(LUT_IDX + line)
    elif MODE == "step":
        carry = tl.load(LUT_IDX + 1 + line)
    elif MODE == "prefetch":
        carry = tl.load(LUT_IDX + start, mask=start < end, other=0)
    else:
        carry = start * 0
    return carry


@triton.jit
def lut_next(LUT_IDX, e, end, carry, MODE: tl.constexpr):
    """``(block index of entry e, carry for entry e + 1)``; see :func:`lut_first`."""
    if MODE == "arith":
        blk = carry + e
        nxt = carry
    elif MODE == "step":
        blk = carry + e * tl.load(LUT_IDX)
        nxt = carry
    elif MODE == "prefetch":
        blk = carry
        nxt = tl.load(LUT_IDX + e + 1, mask=e + 1 < end, other=0)
    else:
        blk = tl.load(LUT_IDX + e)
        nxt = carry
    return blk, nxt


@triton.jit
def work_item(WORK, pid_w, FULL_PTR, PART_PTR, lut_base, TILE: tl.constexpr, LAYOUT_B: tl.constexpr,
              USE_WORK: tl.constexpr):
    """``(tile, f0, f1, p0, p1, slot)`` of program ``pid_w``: the work-list item
    ``WORK[6 * pid_w : 6 * pid_w + 6]``, or, without work lists, tile ``pid_w`` with the unmasked
    ``[f0, f1)`` and masked ``[p0, p1)`` entry ranges of its LUT line ``lut_base + tile * TILE //
    LAYOUT_B`` and slot -1 (write the result directly)."""
    if USE_WORK:
        item = WORK + pid_w * 6
        tile = tl.load(item)
        f0 = tl.load(item + 1)
        f1 = tl.load(item + 2)
        p0 = tl.load(item + 3)
        p1 = tl.load(item + 4)
        slot = tl.load(item + 5)
    else:
        tile = pid_w
        line = lut_base + (tile * TILE) // LAYOUT_B
        f0 = tl.load(FULL_PTR + line)
        f1 = tl.load(FULL_PTR + line + 1)
        p0 = tl.load(PART_PTR + line)
        p1 = tl.load(PART_PTR + line + 1)
        slot = pid_w * 0 - 1
    return tile, f0, f1, p0, p1, slot


@triton.jit
def dropout_keep(i, j, bh, seed_lo, seed_hi, threshold):
    """Philox4x32-10 keep decision for query rows ``i`` and keys ``j`` (broadcastable) of head
    ``bh = b * H + h``: counter ``(i, j, bh, 0)``, key ``(seed_lo, seed_hi)``; keep when
    ``r0 >> 1 >= threshold``. Mirrors ``blocksparse_fa.ops.dropout.keep_from_counters``."""
    zero = i * 0 + j * 0
    c0 = (i + zero).to(tl.uint32)
    c1 = (j + zero).to(tl.uint32)
    c2 = (zero + bh).to(tl.uint32)
    c3 = zero.to(tl.uint32)
    k0 = (zero + seed_lo).to(tl.uint32)
    k1 = (zero + seed_hi).to(tl.uint32)
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c1 = a2 * 0xCD9E8D57
        c3 = a0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return (c0 >> 1).to(tl.int32) >= threshold


@triton.jit
def merge_part(m, l, acc, lse_k, o_k):
    """One normalised partial output ``o_k`` (rows × D) with its logsumexp ``lse_k`` (natural log;
    -inf: a part that kept nothing, weight 0) into a merge's running ``(m, l, acc)``: the merged
    output is ``acc / l`` and its logsumexp ``m + log(l)``."""
    m_new = tl.maximum(m, lse_k)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_use)
    beta = tl.exp(lse_k - m_use)
    return m_new, l * alpha + beta, acc * alpha[:, None] + o_k * beta[:, None]


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b`` on the tensor cores, accumulating in place (fp32). ``DOT_PRECISION ==
    "upcast"`` multiplies in fp32: the launcher asks for it under the CPU interpreter, whose bf16
    ``tl.dot`` is wrong (triton 3.9)."""
    if DOT_PRECISION == "upcast":
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        c = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return c


@triton.jit
def _tanh(x):
    """``tanh`` through ``exp2``; ``|x|`` is clamped at 15 (``tanh(15) = 1`` in float32), so the
    exponential never overflows."""
    y = tl.minimum(tl.maximum(x, -15.0), 15.0)
    return 1.0 - tl.fdiv(2.0, tl.math.exp2(y * (2.0 * LOG2E)) + 1.0, ieee_rounding=False)


@triton.jit
def score_mod(s, qk_scale, qpos, kpos, slope, bias, softcap, SCORE_MOD: tl.constexpr):
    """``(scores in the base-2 domain, tanh term)`` of raw scores ``s = q·k`` under the score
    modifier ``SCORE_MOD`` (bit 1: ALiBi, ``+ slope * (kpos - qpos)``; bit 8: an additive bias,
    ``+ bias``, a tile shaped like ``s`` from :func:`load_bias`; bit 2: soft-cap,
    ``softcap * tanh(x / softcap)``), applied in that order to the natural scaled score
    ``x = scale * s`` (``qk_scale = scale * log2(e)``). ``qpos``/``kpos`` broadcast to ``s``: the
    positions the element predicate sees. The tanh term gives the soft-cap's derivative ``1 - t²``
    (``x`` when there is no soft-cap: unused)."""
    x = s * (qk_scale * LN2)
    if SCORE_MOD & 1:
        x = x + slope * (kpos - qpos).to(tl.float32)
    if SCORE_MOD & 8:
        x = x + bias
    t = x
    if SCORE_MOD & 2:
        t = _tanh(x * (1.0 / softcap))
        x = softcap * t
    return x * LOG2E, t


@triton.jit
def load_bias(BIAS, offs_a, stride_a, n_a, offs_b, stride_b, n_b, CHECK_A: tl.constexpr, CHECK_B: tl.constexpr,
              SCORE_MOD: tl.constexpr):
    """The float32 bias tile ``BIAS[offs_a, offs_b]`` (``(len(offs_a), len(offs_b))``; strides 0 on
    broadcast dims, int64 offsets) when ``SCORE_MOD`` has a bias (bit 8), else the scalar 0.
    ``CHECK_A``/``CHECK_B``: elements past ``n_a``/``n_b`` read as 0 (the bounds the tile loads check)."""
    if SCORE_MOD & 8:
        ptrs = BIAS + offs_a.to(tl.int64)[:, None] * stride_a + offs_b.to(tl.int64)[None, :] * stride_b
        if CHECK_A and CHECK_B:
            b = tl.load(ptrs, mask=(offs_a[:, None] < n_a) & (offs_b[None, :] < n_b), other=0.0)
        elif CHECK_A:
            b = tl.load(ptrs, mask=offs_a[:, None] < n_a, other=0.0)
        elif CHECK_B:
            b = tl.load(ptrs, mask=offs_b[None, :] < n_b, other=0.0)
        else:
            b = tl.load(ptrs)
        b = b.to(tl.float32)
    else:
        b = 0.0
    return b


@triton.jit
def score_grads(ds_t, DBIAS, offs_n, stride_n, kv_len, offs_m, stride_m, q_len, CHECK_N: tl.constexpr,
                CHECK_M: tl.constexpr, SCORE_MOD: tl.constexpr):
    """Add the bias' gradient from ``ds_t`` (``∂loss/∂x`` of a transposed tile: keys ``offs_n`` by
    query rows ``offs_m``, as in the dK/dV loop) to the float32 buffer ``DBIAS[offs_m, offs_n]``
    (bit 16), with atomic adds. Bits 64/128 say that the bias broadcasts over the query rows / the
    keys (stride 0): the tile is summed over them first, one atomic add per distinct element.
    ``CHECK_N``/``CHECK_M``: keys past ``kv_len`` / rows past ``q_len`` may be in the tile (their
    ``ds`` is not meaningful): they are left out. (The slopes' gradient comes from the dQ programs,
    see ``kernels/backward._attn_bwd``.)"""
    if CHECK_N:
        ds_t = tl.where(offs_n[:, None] < kv_len, ds_t, 0.0)
    if CHECK_M:
        ds_t = tl.where(offs_m[None, :] < q_len, ds_t, 0.0)
    if SCORE_MOD & 16:
        if (SCORE_MOD & 64) and (SCORE_MOD & 128):
            tl.atomic_add(DBIAS, tl.sum(tl.sum(ds_t, 1), 0))
        elif SCORE_MOD & 64:  # one value per key
            ptrs = DBIAS + offs_n.to(tl.int64) * stride_n
            if CHECK_N:
                tl.atomic_add(ptrs, tl.sum(ds_t, 1), mask=offs_n < kv_len)
            else:
                tl.atomic_add(ptrs, tl.sum(ds_t, 1))
        elif SCORE_MOD & 128:  # one value per query row
            ptrs = DBIAS + offs_m.to(tl.int64) * stride_m
            if CHECK_M:
                tl.atomic_add(ptrs, tl.sum(ds_t, 0), mask=offs_m < q_len)
            else:
                tl.atomic_add(ptrs, tl.sum(ds_t, 0))
        else:
            ptrs = DBIAS + offs_n.to(tl.int64)[:, None] * stride_n + offs_m.to(tl.int64)[None, :] * stride_m
            if CHECK_N or CHECK_M:
                tl.atomic_add(ptrs, ds_t, mask=(offs_n[:, None] < kv_len) & (offs_m[None, :] < q_len))
            else:
                tl.atomic_add(ptrs, ds_t)
