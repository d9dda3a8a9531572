"""The global parts of a split mask (``compiler/globals.py``): the global keys and the global rows.

Global keys (``k < g``, ``g <= 128``): every row ``>= g`` keeps all of them, the first ``g`` rows a
``g × g`` corner (``CORNER``), so one tile of keys serves every row tile.

* ``_global_keys_fwd``: per run of row tiles, the part over the global keys (scores, softmax,
  ``P·V``) merged into the other parts' output and logsumexp in place: ``lse = logaddexp(lse_1,
  lse_g)``, ``o = exp(lse_1 − lse)·o_1 + exp(lse_g − lse)·o_g`` (a part that kept nothing, ``-inf``,
  has weight 0).
* ``_global_keys_bwd``: per run of row tiles, with the merged logsumexp and ``delta``: ``P = exp(S −
  lse)``, ``dS = P ∘ (dO·V_gᵀ − delta)``; ``dQ += dS·K_g·scale`` in place and ``dK_g += dSᵀ·Q·scale``,
  ``dV_g += Pᵀ·dO`` summed in registers over the run, then added once per program to float32 buffers
  with atomics (the runs of all query heads of a kv head share them).

Global rows (``q < g``) over every key ``>= g`` (Longformer's global rows keep them all):

* ``_global_rows_fwd``: per chunk of keys, the ``g`` rows' attention over the chunk (online softmax),
  written as a normalised float32 partial output and its logsumexp; the chunks are merged after it
  (a split-K forward: a row of ``Lk`` keys would otherwise be one long program) by
  ``_global_rows_merge``, into the output and logsumexp or with the part already there.
* ``_global_rows_bwd``: per chunk of keys and kv head, for each key block the group's query heads
  in turn: ``dK``, ``dV`` of the block summed over them in registers and added to the gradients
  once (every block belongs to one program: no atomics), and each head's ``dQ`` of the ``g`` rows
  added to the chunk's own float32 slot, summed over the chunks after it.
"""

import triton
import triton.language as tl

from .common import load_tile, merge_part, mma, store_tile

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _head(bh, H, G):
    """``(b, h, hk)`` (int64) of program row ``bh = b·H + h``: batch, query head, its kv head."""
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    return b, h, h // G


@triton.jit
def _tile(X, b, h, stride_b, stride_h, stride_m, offs, n, offs_d, HEAD_DIM: tl.constexpr,
          HEAD_DIM_PAD: tl.constexpr):
    """Rows ``offs`` (those ``< n``; others read 0) of batch ``b``, head ``h`` of ``X``."""
    return load_tile(X + b * stride_b + h * stride_h + offs[:, None] * stride_m + offs_d[None, :], offs, n, offs_d,
                     HEAD_DIM, HEAD_DIM_PAD, True)


@triton.jit
def _kv(K, V, b, hk, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, offs, n, offs_d,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """The K and V rows ``offs`` (those ``< n``) of batch ``b``, kv head ``hk``."""
    return (_tile(K, b, hk, stride_kb, stride_kh, stride_kn, offs, n, offs_d, HEAD_DIM, HEAD_DIM_PAD),
            _tile(V, b, hk, stride_vb, stride_vh, stride_vn, offs, n, offs_d, HEAD_DIM, HEAD_DIM_PAD))


@triton.jit
def _chunk(c, n_glob, keys_per_prog, kv_len):
    """Keys ``[k0, k1)`` of chunk ``c`` (the keys after the global ones, ``keys_per_prog`` each)."""
    k0 = n_glob + c * keys_per_prog
    return k0, tl.minimum(k0 + keys_per_prog, kv_len)


@triton.jit
def _keys_program(K, V, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, H, G, q_len, n_glob,
                  rows_per_prog, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_G: tl.constexpr):
    """What a global keys' program works on: ``(bh, b, h, offs_g, offs_d, K_g, V_g, row0, row1)``,
    its rows ``[row0, row1)`` of head ``bh = b·H + h`` and the global keys of its kv head."""
    bh = tl.program_id(1)
    b, h, hk = _head(bh, H, G)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    kg, vg = _kv(K, V, b, hk, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, offs_g, n_glob, offs_d,
                 HEAD_DIM, HEAD_DIM_PAD)
    row0 = tl.program_id(0) * rows_per_prog
    return bh, b, h, offs_g, offs_d, kg, vg, row0, tl.minimum(row0 + rows_per_prog, q_len)


@triton.jit
def _keep(CORNER, offs_m, offs_g, n_glob):
    """``[BLOCK_M, BLOCK_G]``: the global keys each row keeps (all of them from row ``n_glob`` on)."""
    inside = (offs_m[:, None] < n_glob) & (offs_g[None, :] < n_glob)
    corner = tl.load(CORNER + offs_m[:, None] * n_glob + offs_g[None, :], mask=inside, other=1)
    return (offs_g[None, :] < n_glob) & (corner != 0)


@triton.jit(do_not_specialize=["q_len", "n_glob", "rows_per_prog"])
def _global_keys_fwd(Q, K, V, O, LSE, CORNER, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
                     H, G, q_len, n_glob, rows_per_prog, qk_scale, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """Grid ``(cdiv(q_len, rows_per_prog), B·H)`` (``rows_per_prog`` a multiple of ``BLOCK_M``);
    ``qk_scale`` is the softmax scale times ``log2(e)``; ``CORNER``: int8 ``(n_glob, n_glob)``, the
    global keys row ``r < n_glob`` keeps. ``O`` and ``LSE`` (natural log) are read and overwritten."""
    bh, b, h, offs_g, offs_d, kg, vg, row0, row1 = _keys_program(K, V, stride_kb, stride_kh, stride_kn, stride_vb,
                                                                 stride_vh, stride_vn, H, G, q_len, n_glob,
                                                                 rows_per_prog, HEAD_DIM, HEAD_DIM_PAD, BLOCK_G)
    for start in range(row0, row1, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        q = _tile(Q, b, h, stride_qb, stride_qh, stride_qm, offs_m, row1, offs_d, HEAD_DIM, HEAD_DIM_PAD)
        s = mma(q, tl.trans(kg), tl.zeros([BLOCK_M, BLOCK_G], dtype=tl.float32), DOT_PRECISION) * qk_scale
        s = tl.where(_keep(CORNER, offs_m, offs_g, n_glob), s, float("-inf"))
        m = tl.max(s, 1)
        m = tl.where(m == float("-inf"), 0.0, m)  # a first row may keep no global key
        p = tl.exp2(s - m[:, None])
        l = tl.sum(p, 1)
        acc = mma(p.to(vg.dtype), vg, tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32), DOT_PRECISION)
        lse_g = tl.where(l == 0.0, float("-inf"), (m + tl.log2(tl.where(l == 0.0, 1.0, l))) * LN2)
        o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
        o1 = load_tile(o_ptrs, offs_m, row1, offs_d, HEAD_DIM, HEAD_DIM_PAD, True).to(tl.float32)
        valid = offs_m < row1
        l_ptrs = LSE + b * stride_lb + h * stride_lh + offs_m
        l1 = tl.load(l_ptrs, mask=valid, other=float("-inf"))
        mx = tl.maximum(l1, lse_g)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w1 = tl.exp(l1 - mx)  # exactly 0 for a part that kept nothing
        w2 = tl.exp(lse_g - mx)
        tot = w1 + w2
        empty = tot == 0.0
        tot = tl.where(empty, 1.0, tot)
        o = o1 * (w1 / tot)[:, None] + acc * (w2 / (tot * tl.where(l == 0.0, 1.0, l)))[:, None]
        store_tile(o_ptrs, o.to(O.dtype.element_ty), offs_m, row1, offs_d, HEAD_DIM, HEAD_DIM_PAD)
        tl.store(l_ptrs, tl.where(empty, float("-inf"), mx + tl.log(tot)), mask=valid)


@triton.jit(do_not_specialize=["q_len", "n_glob", "rows_per_prog"])
def _global_keys_bwd(Q, K, V, DO, DQ, LSE, DELTA, DKG, DVG, CORNER, stride_qb, stride_qh, stride_qm, stride_kb,
                     stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_gb,
                     stride_gh, stride_gm, H, G, q_len, n_glob, rows_per_prog, sm_scale, qk_scale,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_G: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid ``(cdiv(q_len, rows_per_prog), B·H)`` (``rows_per_prog`` a multiple of ``BLOCK_M``).
    ``LSE``/``DELTA``: ``(B·H, q_len)`` float32 contiguous; ``DQ`` (strides ``stride_g*``) is read and
    overwritten; ``DKG``/``DVG``: ``(B·Hkv, n_glob, HEAD_DIM)`` float32, added to; ``CORNER``: as in
    :func:`_global_keys_fwd`."""
    bh, b, h, offs_g, offs_d, kg, vg, row0, row1 = _keys_program(K, V, stride_kb, stride_kh, stride_kn, stride_vb,
                                                                 stride_vh, stride_vn, H, G, q_len, n_glob,
                                                                 rows_per_prog, HEAD_DIM, HEAD_DIM_PAD, BLOCK_G)
    dk = tl.zeros([BLOCK_G, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_G, HEAD_DIM_PAD], dtype=tl.float32)
    rows = bh.to(tl.int64) * q_len
    for start in range(row0, row1, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        valid = offs_m < row1
        q = _tile(Q, b, h, stride_qb, stride_qh, stride_qm, offs_m, row1, offs_d, HEAD_DIM, HEAD_DIM_PAD)
        do = _tile(DO, b, h, stride_db, stride_dh, stride_dm, offs_m, row1, offs_d, HEAD_DIM, HEAD_DIM_PAD)
        lse = tl.load(LSE + rows + offs_m, mask=valid, other=float("inf")) * LOG2E
        delta = tl.load(DELTA + rows + offs_m, mask=valid, other=0.0)
        s = mma(q, tl.trans(kg), tl.zeros([BLOCK_M, BLOCK_G], dtype=tl.float32), DOT_PRECISION) * qk_scale
        # rows past the end read lse = inf: P = 0
        p = tl.where(_keep(CORNER, offs_m, offs_g, n_glob), tl.exp2(s - lse[:, None]), 0.0)
        dp = mma(do, tl.trans(vg), tl.zeros([BLOCK_M, BLOCK_G], dtype=tl.float32), DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq_ptrs = DQ + b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gm + offs_d[None, :]
        dq = load_tile(dq_ptrs, offs_m, row1, offs_d, HEAD_DIM, HEAD_DIM_PAD, True).to(tl.float32)
        dq = mma(ds.to(kg.dtype), kg, tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32), DOT_PRECISION) * sm_scale + dq
        store_tile(dq_ptrs, dq.to(DQ.dtype.element_ty), offs_m, row1, offs_d, HEAD_DIM, HEAD_DIM_PAD)
        dk = mma(tl.trans(ds.to(q.dtype)), q, dk, DOT_PRECISION)
        dv = mma(tl.trans(p.to(do.dtype)), do, dv, DOT_PRECISION)
    g_ptrs = ((b * (H // G) + h // G) * n_glob + offs_g[:, None]) * HEAD_DIM + offs_d[None, :]
    keep = (offs_g[:, None] < n_glob) & (offs_d[None, :] < HEAD_DIM)
    tl.atomic_add(DKG + g_ptrs, dk * sm_scale, mask=keep)
    tl.atomic_add(DVG + g_ptrs, dv, mask=keep)


@triton.jit(do_not_specialize=["kv_len", "n_glob", "keys_per_prog"])
def _global_rows_fwd(Q, K, V, PO, PL, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, H, G, kv_len, n_glob, keys_per_prog, qk_scale,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid ``(n_chunks, B·H)``: rows ``0 .. n_glob`` over keys ``n_glob + c·keys_per_prog ..`` (a
    multiple of ``BLOCK_N``, every chunk non-empty). ``PO``: float32 ``(n_chunks, B·H, BLOCK_G,
    HEAD_DIM_PAD)``, the chunk's normalised output; ``PL``: ``(n_chunks, B·H, BLOCK_G)``, its
    logsumexp (natural log)."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    n_bh = tl.num_programs(1)
    b, h, hk = _head(bh, H, G)
    k0, k1 = _chunk(c, n_glob, keys_per_prog, kv_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = _tile(Q, b, h, stride_qb, stride_qh, stride_qm, offs_g, n_glob, offs_d, HEAD_DIM, HEAD_DIM_PAD)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM_PAD], dtype=tl.float32)
    for start in range(k0, k1, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kt, vt = _kv(K, V, b, hk, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, offs_n, k1, offs_d,
                     HEAD_DIM, HEAD_DIM_PAD)
        s = mma(q, tl.trans(kt), tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32), DOT_PRECISION) * qk_scale
        s = tl.where(offs_n[None, :] < k1, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the chunk's first key is in range
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = mma(p.to(vt.dtype), vt, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new
    slot = c.to(tl.int64) * n_bh + bh
    tl.store(PO + (slot * BLOCK_G + offs_g[:, None]) * HEAD_DIM_PAD + offs_d[None, :], acc / l_i[:, None])
    tl.store(PL + slot * BLOCK_G + offs_g, (m_i + tl.log2(l_i)) * LN2)


@triton.jit(do_not_specialize=["n_glob", "n_chunks"])
def _global_rows_merge(PO, PL, O, LSE, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm, H, n_glob,
                       n_chunks, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_G: tl.constexpr,
                       MERGE: tl.constexpr):
    """Grid ``(B·H,)``: rows ``0 .. n_glob`` of ``O`` (``(B, H, L, D)``, unit last stride) and ``LSE``
    (natural log) from ``_global_rows_fwd``'s ``n_chunks`` partials, merged in float32 with a
    running maximum; ``MERGE``: the rows' ``O``/``LSE`` are one more part (a part that kept nothing,
    ``-inf``, has weight 0)."""
    bh = tl.program_id(0)
    n_bh = tl.num_programs(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    rows = offs_g < n_glob
    io = rows[:, None] & (offs_d[None, :] < HEAD_DIM)
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_g[:, None] * stride_om + offs_d[None, :]
    l_ptrs = LSE + b * stride_lb + h * stride_lh + offs_g * stride_lm
    if MERGE:
        m_i = tl.load(l_ptrs, mask=rows, other=float("-inf")).to(tl.float32)
        acc = tl.load(o_ptrs, mask=io, other=0.0).to(tl.float32)
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM_PAD], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    for c in range(0, n_chunks):
        slot = bh.to(tl.int64) + c * n_bh.to(tl.int64)
        l_c = tl.load(PL + slot * BLOCK_G + offs_g, mask=rows, other=float("-inf"))
        o_c = tl.load(PO + (slot * BLOCK_G + offs_g[:, None]) * HEAD_DIM_PAD + offs_d[None, :], mask=io, other=0.0)
        m_i, l_i, acc = merge_part(m_i, l_i, acc, l_c, o_c)
    kept = l_i > 0.0
    l_div = tl.where(kept, l_i, 1.0)
    tl.store(o_ptrs, (acc / l_div[:, None]).to(O.dtype.element_ty), mask=io)
    tl.store(l_ptrs, tl.where(kept, m_i + tl.log(l_div), float("-inf")).to(LSE.dtype.element_ty), mask=rows)


@triton.jit(do_not_specialize=["kv_len", "n_glob", "keys_per_prog"])
def _global_rows_bwd(Q, K, V, DO, LSE, DELTA, DK, DV, DQP, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
                     stride_kn, stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_gkb,
                     stride_gkh, stride_gkn, stride_gvb, stride_gvh, stride_gvn, H, G, q_len, kv_len, n_glob,
                     keys_per_prog, sm_scale, qk_scale, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid ``(n_chunks, B·Hkv)``: keys ``n_glob + c·keys_per_prog ..`` of one kv head against rows
    ``0 .. n_glob`` of its ``G`` query heads. ``LSE``/``DELTA``: ``(B·H, q_len)`` float32 contiguous
    (the merged logsumexp); ``DK``/``DV`` (strides ``stride_gk*``/``stride_gv*``): the chunk's rows
    are read and overwritten with the rows' part added; ``DQP``: float32 ``(n_chunks, B·H, BLOCK_G,
    HEAD_DIM_PAD)``, zeroed, the chunk's part of dQ."""
    c = tl.program_id(0)
    bk = tl.program_id(1)
    hkv = H // G
    b = (bk // hkv).to(tl.int64)
    hk = (bk % hkv).to(tl.int64)
    n_bh = tl.num_programs(1) * G
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k0, k1 = _chunk(c, n_glob, keys_per_prog, kv_len)
    for start in range(k0, k1, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kt, vt = _kv(K, V, b, hk, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, offs_n, k1, offs_d,
                     HEAD_DIM, HEAD_DIM_PAD)
        dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
        for hh in range(0, G):
            h = hk * G + hh
            bh = b * H + h
            q = _tile(Q, b, h, stride_qb, stride_qh, stride_qm, offs_g, n_glob, offs_d, HEAD_DIM, HEAD_DIM_PAD)
            do = _tile(DO, b, h, stride_db, stride_dh, stride_dm, offs_g, n_glob, offs_d, HEAD_DIM, HEAD_DIM_PAD)
            rows = offs_g < n_glob
            lse = tl.load(LSE + bh * q_len + offs_g, mask=rows, other=float("inf")) * LOG2E
            delta = tl.load(DELTA + bh * q_len + offs_g, mask=rows, other=0.0)
            s = mma(q, tl.trans(kt), tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32), DOT_PRECISION) * qk_scale
            p = tl.where(offs_n[None, :] < k1, tl.exp2(s - lse[:, None]), 0.0)
            dp = mma(do, tl.trans(vt), tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32), DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dv = mma(tl.trans(p.to(do.dtype)), do, dv, DOT_PRECISION)
            dk = mma(tl.trans(ds.to(q.dtype)), q, dk, DOT_PRECISION)
            dq_ptrs = DQP + ((c.to(tl.int64) * n_bh + bh) * BLOCK_G + offs_g[:, None]) * HEAD_DIM_PAD + offs_d[None, :]
            tl.store(dq_ptrs, mma(ds.to(kt.dtype), kt, tl.load(dq_ptrs), DOT_PRECISION))
        dk_ptrs = DK + b * stride_gkb + hk * stride_gkh + offs_n[:, None] * stride_gkn + offs_d[None, :]
        dv_ptrs = DV + b * stride_gvb + hk * stride_gvh + offs_n[:, None] * stride_gvn + offs_d[None, :]
        dk = dk * sm_scale + load_tile(dk_ptrs, offs_n, k1, offs_d, HEAD_DIM, HEAD_DIM_PAD, True).to(tl.float32)
        dv = dv + load_tile(dv_ptrs, offs_n, k1, offs_d, HEAD_DIM, HEAD_DIM_PAD, True).to(tl.float32)
        store_tile(dk_ptrs, dk.to(DK.dtype.element_ty), offs_n, k1, offs_d, HEAD_DIM, HEAD_DIM_PAD)
        store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, k1, offs_d, HEAD_DIM, HEAD_DIM_PAD)
