"""Hopper backward for dense, causal and one-interval-per-row layouts, written in Gluon.

The FlashAttention-3 backward schedule (Shah et al., 2024) in Triton's Gluon dialect, against the
API of triton 3.6 (the one ``kernels/forward_gluon.py`` uses). The per-row term
``delta = rowsum(dO ∘ O)`` comes from the usual preprocess (``backward._attn_bwd_preprocess``);
probabilities are recomputed from the forward's logsumexp (natural log, float32, ``(B·H, Lq)``).

``_attn_bwd_dkdv_gluon``: one program per ``2·BLOCK_N`` keys and batch·kv-head, or (``PERSISTENT``)
one program per SM walking those work items, as ``_attn_bwd_dq_gluon`` and the forward do.

- one producer warp loads both consumers' K and V tiles once, then walks the query blocks of every
  query head of the GQA group (``BLOCK_M`` rows per step) and TMA-loads Q and dO into a ring of
  ``STAGES`` shared-memory slots (a "ready" and an "empty" mbarrier per slot; both consumers
  release a slot);
- two consumer warp groups own ``BLOCK_N`` keys each and, per query block, compute with
  ``warpgroup_mma`` the transposed scores ``Sᵀ = K·Qᵀ`` and ``dPᵀ = V·dOᵀ`` (both issued before
  either is awaited), ``Pᵀ = exp2(Sᵀ·scale·log2e − LSE·log2e)``, ``dSᵀ = Pᵀ ∘ (dPᵀ − Δ)``, then
  ``dV += Pᵀ·dO`` and ``dK += dSᵀ·Q`` with Pᵀ and dSᵀ from registers. With ``ROWS_SMEM`` (the
  default) the producer copies the query block's logsumexp and Δ into the slot with Q and dO, and
  the groups read them in the score tile's row layout where they use them (as FlashAttention-4's
  SM90 backward stages them); otherwise they are read from global memory before the slot is
  awaited (their latency hides behind the wait) and converted (more registers live: more spills);
- with ``ATOMIC_DQ`` (the non-deterministic five-GEMM backward, split as FlashAttention-3's):
  both groups store dSᵀ into a shared buffer (two buffers taking turns, an mbarrier each saying
  "written by both"; a buffer is rewritten two steps later, after the other group has signalled
  the buffer in between, which it does only once its products of the step before have read this
  one), then each group computes dQ's columns ``[C·D/2, (C+1)·D/2)`` over the
  program's ``2·BLOCK_N`` keys (two products, one per group's dSᵀ and K tile), issued before dK so
  that the reduce-add is staged while dK runs. The partial is staged as fp32 in shared memory and
  added to an fp32
  ``(B·H, Lq, D)`` buffer with one TMA reduce-add per tile (``cp.reduce.async.bulk.tensor``, as
  FlashAttention-3's backward does; the staging tile is rewritten only after ``tma.store_wait``
  says the reduce that read it is done); ``backward_atomic._dq_finish`` scales and converts the
  buffer afterwards. Without it dQ comes from ``_attn_bwd_dq_gluon`` (deterministic: seven GEMMs
  per block pair in all);
- dK (scaled) and dV are staged through the consumer's K and V slots and TMA-stored.

``_attn_bwd_dq_gluon``: one program per ``2·BLOCK_M`` query rows and batch·head, laid out like the
forward (producer: Q and dO once, K and V through the ring; two consumer groups of ``BLOCK_M``
rows): ``S = Q·Kᵀ`` and ``dP = dO·Vᵀ``, ``dS = P ∘ (dP − Δ)``, ``dQ += dS·K``, dQ scaled and
TMA-stored.

``CAUSAL`` (``Lq == Lk``): the dK/dV program starts at its diagonal query block and masks the
first ``2·BLOCK_N / BLOCK_M`` query blocks of each head; the dQ program masks its last
``2·BLOCK_M / BLOCK_N`` key blocks. Lengths must be multiples of the tiles (the launcher checks:
the dK/dV kernel's Q/dO descriptor spans the group's heads, so a ragged query tile would read the
next head's rows). Longest programs first.

``INTERVAL``: every query row ``r`` keeps one key interval ``[LO[r], HI[r])``, the same for every
head or one per head that agrees within each GQA group (windows, per-head windows, contiguous
documents, their intersections with ``causal()``), given as tables built
on the device (``compiler/device_intervals.gluon_backward_tables``, from device intervals or a compiled
layout's): a dK/dV program walks the query blocks ``[first, end)`` of its key tile and a dQ program
the key blocks of its row tile; blocks inside ``[f0, f1)`` are kept whole by every row and run
unmasked, the others compare each key with the rows' bounds (read with the logsumexp, before the
slot wait). Rows that keep nothing (logsumexp
-inf) read +inf, so their probabilities are 0 in every step; a tile that no row sees still visits
one (masked) block, so every program runs its pipeline and stores its (zero) gradients.

Gluon does not run in Triton's CPU interpreter; the launcher (``ops/triton_backend.py``) uses this
module where ``ops/select.choose_backward`` picks it (dense and causal layouts, and intervals built
on the device or taken from a compiled one-interval-per-row layout, on Hopper).
"""

from __future__ import annotations

from .forward_gluon import gluon_available, GLUON_IMPORT_ERROR  # noqa: F401  (one import check for both)
from . import forward_gluon as _fg

__all__ = ["gluon_available", "GLUON_IMPORT_ERROR"]

gluon, gl = _fg.gluon, _fg.gl
_LOG2E = 1.4426950408889634

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    _tma_load = _fg._tma_load
    _tma_store = _fg._tma_store
    _tma_reduce_add = _fg._tma_reduce_add

    @gluon.jit
    def _store_rows(PTR, stride_m, off, acc, layout: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
        """Rows ``off .. off + ROWS - 1`` of a ``(rows, HEAD_DIM)`` output (row stride ``stride_m``,
        any dtype: float32 partial sums too, which the input-dtype staging tile cannot hold)
        straight from the float32 accumulator ``acc`` (distributed ``layout``)."""
        offs_m = off + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        gl.store(PTR + offs_m.to(gl.int64)[:, None] * stride_m + offs_d[None, :], acc.to(PTR.dtype.element_ty))

    # ------------------------------------------------------------------ dK / dV (and atomic dQ)

    @gluon.jit
    def _vec_descs(A, B, n, BLOCK: gl.constexpr, layout: gl.constexpr):
        """Descriptors of ``BLOCK``-element tiles over the first ``n`` elements of the 1-D tables
        ``A`` and ``B`` (a query block's logsumexp and Δ, or its rows' interval bounds)."""
        a = tma.make_tensor_descriptor(A, shape=[n], strides=[1], block_shape=[BLOCK], layout=layout)
        b = tma.make_tensor_descriptor(B, shape=[n], strides=[1], block_shape=[BLOCK], layout=layout)
        return a, b

    @gluon.jit
    def _load_pair(desc_a, desc_b, bar, smem_a, smem_b, row_a, col_a, row_b, col_b):
        """Two TMA tile loads (``desc_a`` at ``[row_a, col_a]`` into ``smem_a``, likewise b) that
        complete one phase of the mbarrier ``bar``."""
        mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes)
        _tma_load(desc_a, [row_a, col_a], bar, smem_a)
        _tma_load(desc_b, [row_b, col_b], bar, smem_b)

    @gluon.jit
    def _dkdv_item(t, TAB, ORD, n_prog, BH, HKV, LZB, LZH, q_len, CAUSAL: gl.constexpr, INTERVAL: gl.constexpr,
                   M_MAJOR: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Work item ``t`` of the dK/dV kernel: ``(b, hk, off_n, i0, n_i, f0, f1, z)`` (key tile
        ``off_n ..`` of batch ``b``, kv head ``hk``, query blocks ``[i0, i0 + n_i)`` of which
        ``[f0, f1)`` are full, layout instance ``z``), in ``forward_gluon._item_tile``'s order;
        ``INTERVAL`` with ``M_MAJOR``: the ``pid_n``-th key tile is ``ORD[z, pid_n]`` (heaviest first)."""
        pid_n, pid_bh = _fg._item_tile(t, n_prog, BH, M_MAJOR)
        b = pid_bh // HKV
        hk = pid_bh % HKV
        if INTERVAL:  # this key tile's query blocks from the table
            z = (b * LZB + hk * LZH).to(gl.int64)  # LZH: per-head intervals (a kv head's stride)
            if M_MAJOR:
                pid_n = gl.load(ORD + z * n_prog + pid_n)
            tab = TAB + (z * n_prog + pid_n) * 4
            i0 = gl.load(tab)
            f0 = gl.load(tab + 1)
            f1 = gl.load(tab + 2)
            n_i = gl.load(tab + 3) - i0
            off_n = pid_n * (2 * BLOCK_N)
        else:
            z = (b * 0).to(gl.int64)
            off_n = pid_n * (2 * BLOCK_N)
            if CAUSAL:  # query blocks from the one holding this tile's first key
                i0 = off_n // BLOCK_M
            else:
                i0 = off_n * 0
            n_i = q_len // BLOCK_M - i0
            f0 = i0
            f1 = i0 + n_i
        return b, hk, off_n, i0, n_i, f0, f1, z

    @gluon.jit
    def _dkdv_load_qdo(q_desc, do_desc, q_smem, do_smem, ready, empty, u, t, n_i, i0, b, hk, G, q_rb, q_rh, q_ch,
                       do_rb, do_rh, do_ch, PERSISTENT: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                       lse_desc, delta_desc, rows_smem, H, q_len, ROWS_SMEM: gl.constexpr, TAB, LIST: gl.constexpr,
                       lo_desc, hi_desc, bounds_smem, z, BOUNDS_SMEM: gl.constexpr):
        """Step ``t`` of a work item at ring position ``u``: Q and dO of query block
        ``i0 + t % n_i`` (``LIST``: ``TAB[i0 + t % n_i]``) of the group's head ``t // n_i`` into slot
        ``u % STAGES`` (``ROWS_SMEM``: with its rows' logsumexp and Δ, one barrier phase for the four
        copies; ``BOUNDS_SMEM``: and the rows' interval bounds of layout instance ``z``)."""
        g = t // n_i
        # persistent: the whole tensors' row views; else the group's heads from their first
        h = hk * G + g if PERSISTENT else g
        m = (_fg._step_base(TAB, i0, t % n_i, LIST) + t % n_i) * BLOCK_M
        s = u % STAGES
        # a fresh barrier counts as having completed the phase before its first: the first
        # pass through the ring waits on parity 1 and does not block
        mbarrier.wait(empty.index(s), ((u // STAGES) & 1) ^ 1)
        if ROWS_SMEM:  # LSE/Δ (B·H, Lq): persistent over every head, else over the group's heads
            r = ((b * H + h) if PERSISTENT else h) * q_len + m
            bar = ready.index(s)
            if BOUNDS_SMEM:
                mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes + 2 * BLOCK_M * 4
                                + 2 * lo_desc.block_type.nbytes)
            else:
                mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes + 2 * BLOCK_M * 4)
            _tma_load(q_desc, [b * q_rb + h * q_rh + m, h * q_ch], bar, q_smem.index(s))
            _tma_load(do_desc, [b * do_rb + h * do_rh + m, h * do_ch], bar, do_smem.index(s))
            _tma_load(lse_desc, [r], bar, rows_smem.index(2 * s))
            _tma_load(delta_desc, [r], bar, rows_smem.index(2 * s + 1))
            if BOUNDS_SMEM:  # the rows' bounds (Z, Lq): instance z
                rz = (z * q_len + m).to(gl.int32)
                _tma_load(lo_desc, [rz], bar, bounds_smem.index(2 * s))
                _tma_load(hi_desc, [rz], bar, bounds_smem.index(2 * s + 1))
        else:
            _load_pair(q_desc, do_desc, ready.index(s), q_smem.index(s), do_smem.index(s), b * q_rb + h * q_rh + m,
                       h * q_ch, b * do_rb + h * do_rh + m, h * do_ch)

    @gluon.jit
    def _dkdv_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, kv_empty, ready,
                       empty, TAB, ORD, DEAL, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh,
                       v_ch, first, n_items, n_prog, BH, HKV, G, LZB, LZH, q_len, CAUSAL: gl.constexpr,
                       INTERVAL: gl.constexpr,
                       M_MAJOR: gl.constexpr, PERSISTENT: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, lse_desc, delta_desc, rows_smem, H,
                       ROWS_SMEM: gl.constexpr, LIST: gl.constexpr, lo_desc, hi_desc, bounds_smem,
                       BOUNDS_SMEM: gl.constexpr, DEALT: gl.constexpr, KV_REP: gl.constexpr):
        """One warp: per work item, the first ``STAGES`` steps' Q and dO (their slots free up as the
        consumers finish the previous item), both consumers' K/V tiles once the consumers have
        released the previous item's (stored dK/dV), then the other steps' Q and dO; ring
        positions count on across items."""
        tb = 0
        it = 0
        for k in range(0, _fg._n_dealt(DEAL, first, n_items, DEALT)):
            item = _fg._dealt(DEAL, first, k, DEALT)
            b, hk, off_n, i0, n_i, f0, f1, z = _dkdv_item(item, TAB, ORD, n_prog, BH, HKV, LZB, LZH, q_len, CAUSAL,
                                                          INTERVAL, M_MAJOR, BLOCK_M, BLOCK_N)
            n_t = G * n_i
            pre = gl.minimum(n_t, STAGES)
            for t in range(0, pre):
                _dkdv_load_qdo(q_desc, do_desc, q_smem, do_smem, ready, empty, tb + t, t, n_i, i0, b, hk, G, q_rb,
                               q_rh, q_ch, do_rb, do_rh, do_ch, PERSISTENT, BLOCK_M, STAGES, lse_desc, delta_desc,
                               rows_smem, H, q_len, ROWS_SMEM, TAB, LIST, lo_desc, hi_desc, bounds_smem, z,
                               BOUNDS_SMEM)
            hr = hk // KV_REP  # the head K and V are read from
            for c in gl.static_range(2):
                mbarrier.wait(kv_empty.index(c), (it & 1) ^ 1)
                _load_pair(k_desc, v_desc, kv_bar.index(c), k_smem.index(c), v_smem.index(c),
                           b * k_rb + hr * k_rh + off_n + c * BLOCK_N, hr * k_ch,
                           b * v_rb + hr * v_rh + off_n + c * BLOCK_N, hr * v_ch)
            for t in range(pre, n_t):
                _dkdv_load_qdo(q_desc, do_desc, q_smem, do_smem, ready, empty, tb + t, t, n_i, i0, b, hk, G, q_rb,
                               q_rh, q_ch, do_rb, do_rh, do_ch, PERSISTENT, BLOCK_M, STAGES, lse_desc, delta_desc,
                               rows_smem, H, q_len, ROWS_SMEM, TAB, LIST, lo_desc, hi_desc, bounds_smem, z,
                               BOUNDS_SMEM)
            tb += n_t
            it += 1

    @gluon.jit
    def _dq_tma_add(dq, dq_desc, dq_buf, row, col, DQ_BUFS: gl.constexpr):
        """Adds the fp32 tile ``dq`` (registers) to the dQ buffer at ``[row, col]``: staged in the
        shared tile ``dq_buf`` once the reduce-add that last read it has completed (reduce-adds
        complete in issue order; ``DQ_BUFS`` tiles take turns), then one TMA reduce-add."""
        tma.store_wait(pendings=DQ_BUFS - 1)
        dq_buf.store(dq)
        fence_async_shared()
        _tma_reduce_add(dq_desc, [row, col], dq_buf)

    @gluon.jit
    def _dq_products(ds_all, k_all, b, C: gl.constexpr, BLOCK_M: gl.constexpr, DQ_CHUNK: gl.constexpr,
                     dq_layout: gl.constexpr):
        """dQ's columns ``[C·DQ_CHUNK, (C+1)·DQ_CHUNK)`` over both groups' keys, from the dSᵀ tiles
        of buffer ``b`` (``ds_all[2·b]``, ``ds_all[2·b + 1]``): two products issued, not awaited."""
        zq = gl.zeros([BLOCK_M, DQ_CHUNK], dtype=gl.float32, layout=dq_layout)
        dq = warpgroup_mma(ds_all.index(2 * b).permute((1, 0)), k_all.index(0).slice(C * DQ_CHUNK, DQ_CHUNK, dim=1),
                           zq, use_acc=False, is_async=True)
        return warpgroup_mma(ds_all.index(2 * b + 1).permute((1, 0)),
                             k_all.index(1).slice(C * DQ_CHUNK, DQ_CHUNK, dim=1), dq, is_async=True)

    @gluon.jit
    def _masked_t(pt, i, off_k, lo, hi, MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  s_layout: gl.constexpr):
        """``Pᵀ`` of query block ``i`` against keys ``off_k ..`` with the dropped entries zeroed:
        ``MASK`` 1 keys after the query (causal diagonal), 2 keys outside the row's interval
        ``[lo, hi)`` (the block's rows, loaded before the step's wait)."""
        offs_k = gl.expand_dims(off_k + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)), 1)
        if MASK == 1:
            offs_q = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            keep = gl.expand_dims(offs_q, 0) >= offs_k
        else:
            keep = _fg._in_rows(offs_k, gl.convert_layout(lo, gl.SliceLayout(0, s_layout)),
                                gl.convert_layout(hi, gl.SliceLayout(0, s_layout)), 0)
        return gl.where(keep, pt, 0.0)

    @gluon.jit
    def _finite_lse(lse, INTERVAL: gl.constexpr):
        """``INTERVAL``: a row that keeps no key (logsumexp -inf) reads +inf, so that its
        probabilities are 0 in full steps too."""
        if INTERVAL:
            lse = gl.where(lse == float("-inf"), float("inf"), lse)
        return lse

    @gluon.jit
    def _rows_vec(rows_smem, idx, vec, ROWS_SMEM: gl.constexpr, s_layout: gl.constexpr):
        """A query block's logsumexp or Δ in the score tile's row layout: tile ``idx`` of the slot's
        staged rows (``ROWS_SMEM``, no conversion) or ``vec`` (loaded by :func:`_step_rows`) converted."""
        if ROWS_SMEM:
            return rows_smem.index(idx).load(gl.SliceLayout(0, s_layout))
        else:
            return gl.convert_layout(vec, gl.SliceLayout(0, s_layout))

    @gluon.jit
    def _step_rows(lse_row, delta_row, lo_row, hi_row, i, MASK: gl.constexpr, INTERVAL: gl.constexpr,
                   BLOCK_M: gl.constexpr, vec_layout: gl.constexpr, ROWS_SMEM: gl.constexpr = False,
                   BOUNDS_SMEM: gl.constexpr = False):
        """The logsumexp, Δ and (``MASK == 2``) interval bounds of query block ``i``'s rows, loaded
        before the step's wait (``ROWS_SMEM``: the bounds only; the producer stages the others;
        ``BOUNDS_SMEM``: nothing, the producer stages the bounds too)."""
        offs_v = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=vec_layout)
        if ROWS_SMEM:
            lse = 0
            delta = 0
        else:
            lse = _finite_lse(gl.load(lse_row + offs_v), INTERVAL)
            delta = gl.load(delta_row + offs_v)
        if MASK == 2 and not BOUNDS_SMEM:
            lo = gl.load(lo_row + offs_v)
            hi = gl.load(hi_row + offs_v)
        else:
            lo = 0
            hi = 0
        return lse, delta, lo, hi

    @gluon.jit
    def _dkdv_step(dk, dv, t, i, k_all, v_all, ds_all, ds_bar, q_smem, do_smem, ready, empty, turn, lse_row,
                   delta_row, lo_row, hi_row, dq_desc, dq_smem, dq_row0, off_k, qk_scale, C: gl.constexpr,
                   MASK: gl.constexpr, INTERVAL: gl.constexpr, ATOMIC_DQ: gl.constexpr,
                   PINGPONG: gl.constexpr, HEAD_DIM: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   s_layout: gl.constexpr, kv_layout: gl.constexpr, dq_layout: gl.constexpr,
                   vec_layout: gl.constexpr, DQ_CHUNK: gl.constexpr, DQ_BUFS: gl.constexpr, rows_smem,
                   ROWS_SMEM: gl.constexpr, bounds_smem, BOUNDS_SMEM: gl.constexpr, tb=0, prev_row=0,
                   DQ_LAG: gl.constexpr = False, ROWS_ACC: gl.constexpr = 0, LATE_DV: gl.constexpr = False,
                   DK_DS_SMEM: gl.constexpr = False):
        """Query block ``i`` (ring step ``t``) for one consumer's keys ``off_k ..``; ``ROWS_SMEM``:
        its rows' logsumexp and Δ come with Q and dO in slot ``t % STAGES`` of ``rows_smem``
        (tiles ``2·s`` and ``2·s + 1``), read where they are used. With
        ``ATOMIC_DQ``, columns ``[C·DQ_CHUNK, (C+1)·DQ_CHUNK)`` of ``dQ_partial = dS·K`` over both
        groups' keys (rows ``dq_row0 + i·BLOCK_M`` of the group's dQ descriptor), TMA-reduce-added
        from one of the consumer's ``DQ_BUFS`` shared fp32 tiles (``dq_smem[C·DQ_BUFS ..]``).
        ``DQ_LAG``: that dQ product is the previous step's (rows ``prev_row``, its dSᵀ tiles in
        buffer ``(t - 1) % 3``), so a group waits for the other group's dSᵀ of one step before
        (nothing at the item's first step ``t == tb``, which adds zeros); :func:`_dq_lag_flush`
        adds the last step's after the item. Returns dK, dV and this step's dQ rows."""
        s = t % STAGES
        k_c = k_all.index(C)
        v_c = v_all.index(C)
        # global loads issued before the wait, so that their latency hides behind it (with ROWS_SMEM
        # only the interval bounds: the logsumexp and Δ arrive with the slot)
        lse, delta, lo, hi = _step_rows(lse_row, delta_row, lo_row, hi_row, i, MASK, INTERVAL, BLOCK_M, vec_layout,
                                        ROWS_SMEM, BOUNDS_SMEM)
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        q = q_smem.index(s)
        do = do_smem.index(s)
        zero = gl.zeros([BLOCK_N, BLOCK_M], dtype=gl.float32, layout=s_layout)
        if PINGPONG:  # my turn to issue: the other group has issued its previous step's first products
            mbarrier.wait(turn.index(C), t & 1)
        s0 = zero
        if ROWS_ACC == 2:  # Sᵀ's accumulator starts at -LSE / scale: Pᵀ = exp2(qk_scale · Sᵀ)
            lse0 = _rows_vec(rows_smem, 2 * s, lse, ROWS_SMEM, s_layout)
            lse0 = _finite_lse(lse0, INTERVAL) * (1.4426950408889634 / qk_scale)
            s0 = zero - gl.expand_dims(lse0, 0)
        st = warpgroup_mma(k_c, q.permute((1, 0)), s0, use_acc=ROWS_ACC == 2, is_async=True)
        dp0 = zero
        if ROWS_ACC > 0:  # dPᵀ's accumulator starts at -Δ: it ends as dPᵀ - Δ
            dp0 = zero - gl.expand_dims(_rows_vec(rows_smem, 2 * s + 1, delta, ROWS_SMEM, s_layout), 0)
        dpt = warpgroup_mma(v_c, do.permute((1, 0)), dp0, use_acc=ROWS_ACC > 0, is_async=True)
        if PINGPONG:  # pass the turn: the other group issues while this one computes Pᵀ
            mbarrier.arrive(turn.index(1 - C))
        if ROWS_ACC == 2:
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
            pt = gl.exp2(st * qk_scale)
        else:  # with ROWS_SMEM read in the score tile's row layout: no conversion
            lse2 = _finite_lse(_rows_vec(rows_smem, 2 * s, lse, ROWS_SMEM, s_layout), INTERVAL) * 1.4426950408889634
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
            pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        if MASK > 0:
            if BOUNDS_SMEM and MASK == 2:  # staged with Q and dO, read in the score tile's row layout
                lo = bounds_smem.index(2 * s).load(gl.SliceLayout(0, s_layout))
                hi = bounds_smem.index(2 * s + 1).load(gl.SliceLayout(0, s_layout))
            pt = _masked_t(pt, i, off_k, lo, hi, MASK, BLOCK_M, BLOCK_N, s_layout)
        dtype: gl.constexpr = k_c.dtype
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        if not LATE_DV:
            pt16 = gl.convert_layout(pt.to(dtype), p_op)
            dv = warpgroup_mma(pt16, do, dv, is_async=True)
        if ROWS_ACC == 0:
            dlt = _rows_vec(rows_smem, 2 * s + 1, delta, ROWS_SMEM, s_layout)
        if LATE_DV:  # dV's product after dSᵀ: Pᵀ's 16-bit operand is not held while dSᵀ is computed
            dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
        else:
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
        if ROWS_ACC > 0:
            dst = (pt * dpt).to(dtype)
        else:
            dst = (pt * (dpt - gl.expand_dims(dlt, 0))).to(dtype)
        if LATE_DV:
            pt16 = gl.convert_layout(pt.to(dtype), p_op)
            dv = warpgroup_mma(pt16, do, dv, is_async=True)
        cur_row = dq_row0 + i * BLOCK_M
        if ATOMIC_DQ:
            # both groups' dSᵀ meet in shared buffer b; this group computes dQ's columns
            # [C·DQ_CHUNK, (C+1)·DQ_CHUNK) over the program's 2·BLOCK_N keys, issued before dK so
            # that its reduce-add is staged while dK runs. Without DQ_LAG: of this step, from buffer
            # b = t % 2, last read by both groups' dQ products two steps ago (no wait: the other
            # group retired those reads before it said, in step t - 1, that its dSᵀ was written,
            # which this group awaited). With it: of step t - 1, from buffer (t - 1) % 3, after the
            # other group's dSᵀ of step t - 1 is in; that group wrote it after finishing step
            # t - 2, whose dQ products read buffer t % 3 (step t - 3) for the last time.
            NB: gl.constexpr = 3 if DQ_LAG else 2
            b = t % NB
            if DQ_LAG:
                bq = (t + 2) % 3
                lagged = t > tb
                mbarrier.wait(ds_bar.index(bq), ((t - 1) // 3) & 1, pred=lagged)
            else:
                bq = b
            ds_all.index(2 * b + C).store(dst)
            fence_async_shared()
            mbarrier.arrive(ds_bar.index(b))
            if not DQ_LAG:
                mbarrier.wait(ds_bar.index(b), (t // 2) & 1)
            dq = _dq_products(ds_all, k_all, bq, C, BLOCK_M, DQ_CHUNK, dq_layout)
            if DK_DS_SMEM:  # dSᵀ from the shared tile just written: its registers are free
                ds_op = ds_all.index(2 * b + C)
            else:
                ds_op = gl.convert_layout(dst, p_op)
            dk = warpgroup_mma(ds_op, q, dk, is_async=True)
            # in flight, in order: dV, the two dQ products, dK
            dv, dq, _ = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq, pt16))
            if DQ_LAG:
                dq = gl.where(lagged, dq, 0.0)  # the item's first step: the buffer holds another item's dSᵀ
                dq_row = prev_row
            else:
                dq_row = dq_row0 + i * BLOCK_M
            _dq_tma_add(dq, dq_desc, dq_smem.index(C * DQ_BUFS + t % DQ_BUFS), dq_row, C * DQ_CHUNK, DQ_BUFS)
            dk, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ds_op))
            mbarrier.arrive(empty.index(s))
        else:
            ds16 = gl.convert_layout(dst, p_op)
            dk = warpgroup_mma(ds16, q, dk, is_async=True)
            dv, dk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pt16, ds16))
            mbarrier.arrive(empty.index(s))
        return dk, dv, cur_row

    @gluon.jit
    def _dq_lag_flush(t, k_all, ds_all, ds_bar, dq_desc, dq_smem, prev_row, C: gl.constexpr, BLOCK_M: gl.constexpr,
                      dq_layout: gl.constexpr, DQ_CHUNK: gl.constexpr, DQ_BUFS: gl.constexpr):
        """``DQ_LAG``: the dQ product of an item's last step ``t - 1`` (rows ``prev_row``), once the
        other group's dSᵀ of that step is in buffer ``(t - 1) % 3``."""
        bp = (t + 2) % 3
        mbarrier.wait(ds_bar.index(bp), ((t - 1) // 3) & 1)
        dq = _dq_products(ds_all, k_all, bp, C, BLOCK_M, DQ_CHUNK, dq_layout)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        _dq_tma_add(dq, dq_desc, dq_smem.index(C * DQ_BUFS + t % DQ_BUFS), prev_row, C * DQ_CHUNK, DQ_BUFS)

    @gluon.jit
    def _pass_step(t, ready, empty, turn, C: gl.constexpr, PINGPONG: gl.constexpr, STAGES: gl.constexpr):
        """Ring step ``t`` for a consumer with nothing to compute there (its keys or rows all
        dropped): the same barrier waits and arrivals as :func:`_dkdv_step` and :func:`_dq_step`
        (the slot's fill, the ping-pong turn, the release), no products."""
        s = t % STAGES
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(C), t & 1)
            mbarrier.arrive(turn.index(1 - C))
        mbarrier.arrive(empty.index(s))

    @gluon.jit
    def _dkdv_masked(dk, dv, t, i, k_smem, v_smem, ds_smem, ds_bar, q_smem, do_smem, ready, empty, turn, lse_row,
                     delta_row, lo_row, hi_row, dq_desc, dq_smem, dq_row, off_k, qk_scale, TAB, C: gl.constexpr,
                     INTERVAL: gl.constexpr, ATOMIC_DQ: gl.constexpr, PINGPONG: gl.constexpr, HEAD_DIM: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                     kv_layout: gl.constexpr, dq_layout: gl.constexpr, vec_layout: gl.constexpr,
                     DQ_CHUNK: gl.constexpr, DQ_BUFS: gl.constexpr, rows_smem, ROWS_SMEM: gl.constexpr, bounds_smem,
                     BOUNDS_SMEM: gl.constexpr, LIST: gl.constexpr, tb=0, prev_row=0, DQ_LAG: gl.constexpr = False,
                     ROWS_ACC: gl.constexpr = 0, LATE_DV: gl.constexpr = False, DK_DS_SMEM: gl.constexpr = False):
        """A masked step at table position ``i`` (ring step ``t``); with ``LIST`` the entry's skip
        bit for consumer ``C`` (bit ``24 + C``) makes it :func:`_pass_step` instead. Returns as
        :func:`_dkdv_step`."""
        if LIST:
            e = gl.load(TAB + i)
            blk = e & 0xFFFFFF
            if ((e >> (24 + C)) & 1) != 0:
                _pass_step(t, ready, empty, turn, C, PINGPONG, STAGES)
                row = prev_row
            else:
                dk, dv, row = _dkdv_step(dk, dv, t, blk, k_smem, v_smem, ds_smem, ds_bar, q_smem, do_smem, ready,
                                         empty, turn, lse_row, delta_row, lo_row, hi_row, dq_desc, dq_smem, dq_row,
                                         off_k, qk_scale, C, 2, INTERVAL, ATOMIC_DQ, PINGPONG, HEAD_DIM, BLOCK_M,
                                         BLOCK_N, STAGES, s_layout, kv_layout, dq_layout, vec_layout, DQ_CHUNK,
                                         DQ_BUFS, rows_smem, ROWS_SMEM, bounds_smem, BOUNDS_SMEM,
                                         ROWS_ACC=ROWS_ACC, LATE_DV=LATE_DV)
        else:
            blk = _fg._step_base(TAB, i, 0, LIST)
            dk, dv, row = _dkdv_step(dk, dv, t, blk, k_smem, v_smem, ds_smem, ds_bar, q_smem, do_smem, ready, empty,
                                     turn, lse_row, delta_row, lo_row, hi_row, dq_desc, dq_smem, dq_row, off_k,
                                     qk_scale, C, 2, INTERVAL, ATOMIC_DQ, PINGPONG, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                                     s_layout, kv_layout, dq_layout, vec_layout, DQ_CHUNK, DQ_BUFS, rows_smem,
                                     ROWS_SMEM, bounds_smem, BOUNDS_SMEM, tb, prev_row, DQ_LAG, ROWS_ACC, LATE_DV,
                                     DK_DS_SMEM)
        return dk, dv, row

    @gluon.jit
    def _last_deferred(acc, ds_c, ds16, op, empty, sl, DS_SMEM: gl.constexpr):
        """The deferred product of an overlapped loop's last step, ``acc += dS·op`` (dS from the
        group's shared tile ``ds_c`` with ``DS_SMEM``, else ``ds16`` in registers), then slot ``sl``
        back to the producer."""
        if DS_SMEM:
            acc = warpgroup_mma(ds_c, op, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        else:
            acc = warpgroup_mma(ds16, op, acc, is_async=True)
            acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ds16))
        mbarrier.arrive(empty.index(sl))
        return acc

    @gluon.jit
    def _dkdv_step_overlap(dk, dv, ds_prev, t, tb, i, k_c, v_c, ds_c, q_smem, do_smem, ready, empty, turn, lse_row,
                           delta_row, lo_row, hi_row, off_k, qk_scale, C: gl.constexpr, MASK: gl.constexpr,
                           INTERVAL: gl.constexpr,
                           PINGPONG: gl.constexpr, DS_SMEM: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           s_layout: gl.constexpr, kv_layout: gl.constexpr, vec_layout: gl.constexpr):
        """Query block ``i`` (ring step ``t``) overlapped with the end of step ``t - 1``: ``Sᵀ_t``,
        ``dPᵀ_t`` and the previous step's ``dK += dSᵀ_{t-1}·Q_{t-1}`` issued together, ``Pᵀ_t`` and
        ``dSᵀ_t`` computed while the tensor cores run ``dPᵀ_t``, ``dK`` and ``dV += Pᵀ_t·dO_t``;
        returns ``dSᵀ_t`` (the next step's operand, in registers) or, with ``DS_SMEM``, stores it
        into the group's shared tile ``ds_c`` once the deferred product has read the previous one
        (fewer live registers) and returns ``ds_prev`` unchanged. The slot of step ``t - 1`` is
        released here (its Q was read by the deferred product); at a work item's first step
        (``t == tb``) the deferred product is a zero dSᵀ against the current (valid) Q, which adds
        exactly zero."""
        s = t % STAGES
        sp = gl.maximum(t - 1, tb) % STAGES
        lse, delta, lo, hi = _step_rows(lse_row, delta_row, lo_row, hi_row, i, MASK, INTERVAL, BLOCK_M, vec_layout)
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        q = q_smem.index(s)
        do = do_smem.index(s)
        zero = gl.zeros([BLOCK_N, BLOCK_M], dtype=gl.float32, layout=s_layout)
        if PINGPONG:
            mbarrier.wait(turn.index(C), t & 1)
        st = warpgroup_mma(k_c, q.permute((1, 0)), zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_c, do.permute((1, 0)), zero, use_acc=False, is_async=True)
        if DS_SMEM:
            dk = warpgroup_mma(ds_c, q_smem.index(sp), dk, is_async=True)
        else:
            dk = warpgroup_mma(ds_prev, q_smem.index(sp), dk, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - C))
        st = warpgroup_mma_wait(num_outstanding=2, deps=(st, ))
        lse2 = gl.convert_layout(lse, gl.SliceLayout(0, s_layout)) * 1.4426950408889634
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        if MASK > 0:
            pt = _masked_t(pt, i, off_k, lo, hi, MASK, BLOCK_M, BLOCK_N, s_layout)
        dtype: gl.constexpr = k_c.dtype
        pt16 = gl.convert_layout(pt.to(dtype), gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2))
        dv = warpgroup_mma(pt16, do, dv, is_async=True)
        # in flight, in order: dPᵀ_t, dK (step t - 1), dV (step t)
        dpt = warpgroup_mma_wait(num_outstanding=2, deps=(dpt, ))
        dlt = gl.convert_layout(delta, gl.SliceLayout(0, s_layout))
        dst = (pt * (dpt - gl.expand_dims(dlt, 0))).to(dtype)
        if DS_SMEM:
            dk, dv, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, pt16))
            ds_c.store(dst)
            fence_async_shared()
            ds16 = ds_prev
        else:
            ds16 = gl.convert_layout(dst, gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2))
            dk, dv, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, ds_prev, pt16))
        mbarrier.arrive(empty.index(sp), pred=t > tb)
        return dk, dv, ds16

    @gluon.jit
    def _dkdv_consumer_item(item, tb, it, dk_desc, dv_desc, dq_desc, LSE, DELTA, LO, HI, TAB, ORD, q_smem,
                            do_smem, k_smem, v_smem, ds_smem, dq_smem, ds_bar, kv_bar, kv_empty, ready, empty, turn,
                            n_prog, BH, HKV, H, G, LZB, LZH, q_len, qk_scale, sm_scale, DK, DV, stride_dkb, stride_dkh,
                            stride_dkn, stride_dvb, stride_dvh, stride_dvn, dk_rb, dk_rh, dk_ch, dv_rb, dv_rh, dv_ch,
                            C: gl.constexpr, CAUSAL: gl.constexpr, INTERVAL: gl.constexpr, ATOMIC_DQ: gl.constexpr,
                            PINGPONG: gl.constexpr, OVERLAP: gl.constexpr, M_MAJOR: gl.constexpr,
                            PERSISTENT: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DQ_CHUNK: gl.constexpr,
                            DQ_BUFS: gl.constexpr, DIRECT_STORE: gl.constexpr, rows_smem, ROWS_SMEM: gl.constexpr,
                            LIST: gl.constexpr, bounds_smem, BOUNDS_SMEM: gl.constexpr, kv_read,
                            DQ_LAG: gl.constexpr, ROWS_ACC: gl.constexpr, LATE_DV: gl.constexpr,
                            DK_DS_SMEM: gl.constexpr):
        """Work item ``item`` (:func:`_dkdv_item`, ring steps from ``tb``, its ``it``-th) for
        consumer ``C`` (a warp group): keys ``off_n + C·BLOCK_N ..`` against query blocks
        ``i0 .. i0 + n_i - 1`` of every head of the group, then dK and dV; returns its steps.
        ``CAUSAL``: the first ``2·BLOCK_N / BLOCK_M`` blocks are masked; ``INTERVAL``: blocks outside
        ``[f0, f1)`` are masked against each row's interval (``LO[z, r] <= k < HI[z, r]``, the same
        for every head); with ``LIST`` position ``i`` visits query block ``TAB[i]``. With ``PERSISTENT``
        K's and V's slots go back to the producer once dK and dV have left them."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_CHUNK, 16])
        vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        k_c = k_smem.index(C)
        v_c = v_smem.index(C)
        ds_c = ds_smem.index(C)
        dtype: gl.constexpr = k_c.dtype
        b, hk, off_n, i0, n_i, f0, f1, z = _dkdv_item(item, TAB, ORD, n_prog, BH, HKV, LZB, LZH, q_len, CAUSAL,
                                                      INTERVAL, M_MAJOR, BLOCK_M, BLOCK_N)
        bh0 = b * H + hk * G
        # the dQ buffer's rows: persistent over every head, else over the group's heads
        hq0 = bh0 if PERSISTENT else bh0 * 0
        if INTERVAL:
            lo_row = LO + z * q_len
            hi_row = HI + z * q_len
        else:
            lo_row = LO
            hi_row = HI
        off_k = off_n + C * BLOCK_N
        dk = gl.zeros([BLOCK_N, HEAD_DIM], dtype=gl.float32, layout=kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], dtype=gl.float32, layout=kv_layout)
        mbarrier.wait(kv_bar.index(C), it & 1)
        N_DIAG: gl.constexpr = (2 * BLOCK_N) // BLOCK_M  # causal: query blocks that cross the diagonal
        # query blocks [i0, i_full) masked (causal diagonal / interval lead), [i_full, i_tail) full,
        # [i_tail, i0 + n_i) masked (interval tail)
        if CAUSAL:
            i_full = i0 + N_DIAG
        elif INTERVAL:
            i_full = f0
        else:
            i_full = i0
        if INTERVAL:
            i_tail = f1
        else:
            i_tail = i0 + n_i
        if OVERLAP > 0:  # dK of step t is issued in step t + 1 (dSᵀ in registers, or shared with OVERLAP 2)
            DS_SMEM: gl.constexpr = OVERLAP == 2
            ds_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
            ds16 = gl.zeros([BLOCK_N, BLOCK_M], dtype=dtype, layout=ds_op)
            if DS_SMEM:  # the first step's deferred product reads zeros
                ds_c.store(gl.zeros([BLOCK_N, BLOCK_M], dtype=dtype, layout=s_layout))
                fence_async_shared()
                ds16 = 0
            for g in range(G):
                bh = (bh0 + g).to(gl.int64)
                lse_row = LSE + bh * q_len
                delta_row = DELTA + bh * q_len
                t0 = tb + g * n_i - i0  # ring step of query block i: t0 + i
                if CAUSAL:
                    for u in gl.static_range(N_DIAG):
                        dk, dv, ds16 = _dkdv_step_overlap(dk, dv, ds16, t0 + i0 + u, tb, i0 + u, k_c, v_c, ds_c, q_smem,
                                                          do_smem, ready, empty, turn, lse_row, delta_row, lo_row,
                                                          hi_row, off_k, qk_scale, C, 1, INTERVAL, PINGPONG, DS_SMEM,
                                                          BLOCK_M, BLOCK_N, STAGES, s_layout, kv_layout, vec_layout)
                if INTERVAL:
                    for i in range(i0, i_full):
                        blk = _fg._step_base(TAB, i, 0, LIST)
                        dk, dv, ds16 = _dkdv_step_overlap(dk, dv, ds16, t0 + i, tb, blk, k_c, v_c, ds_c, q_smem,
                                                          do_smem, ready, empty, turn, lse_row, delta_row, lo_row,
                                                          hi_row, off_k, qk_scale, C, 2, INTERVAL, PINGPONG, DS_SMEM,
                                                          BLOCK_M, BLOCK_N, STAGES, s_layout, kv_layout, vec_layout)
                for i in range(i_full, i_tail):
                    blk = _fg._step_base(TAB, i, 0, LIST)
                    dk, dv, ds16 = _dkdv_step_overlap(dk, dv, ds16, t0 + i, tb, blk, k_c, v_c, ds_c, q_smem, do_smem,
                                                      ready, empty, turn, lse_row, delta_row, lo_row, hi_row, off_k,
                                                      qk_scale, C, 0, INTERVAL, PINGPONG, DS_SMEM, BLOCK_M, BLOCK_N,
                                                      STAGES, s_layout, kv_layout, vec_layout)
                if INTERVAL:
                    for i in range(i_tail, i0 + n_i):
                        blk = _fg._step_base(TAB, i, 0, LIST)
                        dk, dv, ds16 = _dkdv_step_overlap(dk, dv, ds16, t0 + i, tb, blk, k_c, v_c, ds_c, q_smem,
                                                          do_smem, ready, empty, turn, lse_row, delta_row, lo_row,
                                                          hi_row, off_k, qk_scale, C, 2, INTERVAL, PINGPONG, DS_SMEM,
                                                          BLOCK_M, BLOCK_N, STAGES, s_layout, kv_layout, vec_layout)
            sl = (tb + G * n_i - 1) % STAGES  # the last step's dK, then its slot (n_i >= 1: the tables say so)
            dk = _last_deferred(dk, ds_c, ds16, q_smem.index(sl), empty, sl, DS_SMEM)
        else:
            prow = hq0 * q_len + i0 * BLOCK_M  # DQ_LAG: the previous step's dQ rows (none before the first)
            for g in range(G):
                bh = (bh0 + g).to(gl.int64)
                lse_row = LSE + bh * q_len
                delta_row = DELTA + bh * q_len
                t0 = tb + g * n_i - i0
                dq_row = (hq0 + g) * q_len  # this head's rows of the dQ buffer's descriptor
                if CAUSAL:
                    for u in gl.static_range(N_DIAG):
                        dk, dv, prow = _dkdv_step(dk, dv, t0 + i0 + u, i0 + u, k_smem, v_smem, ds_smem, ds_bar,
                                                  q_smem, do_smem, ready, empty, turn, lse_row, delta_row, lo_row,
                                                  hi_row, dq_desc, dq_smem, dq_row, off_k, qk_scale, C, 1, INTERVAL,
                                                  ATOMIC_DQ, PINGPONG, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, s_layout,
                                                  kv_layout, dq_layout, vec_layout, DQ_CHUNK, DQ_BUFS, rows_smem,
                                                  ROWS_SMEM, bounds_smem, BOUNDS_SMEM, tb, prow, DQ_LAG, ROWS_ACC,
                                                  LATE_DV, DK_DS_SMEM)
                # in ring order: the masked lead (part 0), the full steps (1), the masked tail (2)
                for part in gl.static_range(3):
                    if part == 1:
                        for i in range(i_full, i_tail):
                            blk = _fg._step_base(TAB, i, 0, LIST)
                            dk, dv, prow = _dkdv_step(dk, dv, t0 + i, blk, k_smem, v_smem, ds_smem, ds_bar, q_smem,
                                                      do_smem, ready, empty, turn, lse_row, delta_row, lo_row, hi_row,
                                                      dq_desc, dq_smem, dq_row, off_k, qk_scale, C, 0, INTERVAL,
                                                      ATOMIC_DQ, PINGPONG, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                                                      s_layout, kv_layout, dq_layout, vec_layout, DQ_CHUNK, DQ_BUFS,
                                                      rows_smem, ROWS_SMEM, bounds_smem, BOUNDS_SMEM, tb, prow,
                                                      DQ_LAG, ROWS_ACC, LATE_DV, DK_DS_SMEM)
                    elif INTERVAL:
                        for i in range(i0 if part == 0 else i_tail, i_full if part == 0 else i0 + n_i):
                            dk, dv, prow = _dkdv_masked(dk, dv, t0 + i, i, k_smem, v_smem, ds_smem, ds_bar, q_smem,
                                                        do_smem, ready, empty, turn, lse_row, delta_row, lo_row,
                                                        hi_row, dq_desc, dq_smem, dq_row, off_k, qk_scale, TAB, C,
                                                        INTERVAL, ATOMIC_DQ, PINGPONG, HEAD_DIM, BLOCK_M, BLOCK_N,
                                                        STAGES, s_layout, kv_layout, dq_layout, vec_layout, DQ_CHUNK,
                                                        DQ_BUFS, rows_smem, ROWS_SMEM, bounds_smem, BOUNDS_SMEM, LIST,
                                                        tb, prow, DQ_LAG, ROWS_ACC, LATE_DV, DK_DS_SMEM)
            if ATOMIC_DQ:
                if DQ_LAG:  # the last step's dQ
                    _dq_lag_flush(tb + G * n_i, k_smem, ds_smem, ds_bar, dq_desc, dq_smem, prow, C, BLOCK_M,
                                  dq_layout, DQ_CHUNK, DQ_BUFS)
                # the other group's last dQ products read this group's K slot: both done before dK goes there
                mbarrier.arrive(kv_read)
                mbarrier.wait(kv_read, it & 1)
        if DIRECT_STORE:  # dK, dV (any dtype) from the registers
            b64 = b.to(gl.int64)
            hk64 = hk.to(gl.int64)
            _store_rows(DK + b64 * stride_dkb + hk64 * stride_dkh, stride_dkn, off_k, dk * sm_scale, kv_layout,
                        BLOCK_N, HEAD_DIM)
            _store_rows(DV + b64 * stride_dvb + hk64 * stride_dvh, stride_dvn, off_k, dv, kv_layout, BLOCK_N,
                        HEAD_DIM)
        else:
            # every product reading this group's K and V slots has completed: stage dK, dV there
            k_c.store((dk * sm_scale).to(dtype))
            v_c.store(dv.to(dtype))
            fence_async_shared()
            _tma_store(dk_desc, [b * dk_rb + hk * dk_rh + off_k, hk * dk_ch], k_c)
            _tma_store(dv_desc, [b * dv_rb + hk * dv_rh + off_k, hk * dv_ch], v_c)
        tma.store_wait(pendings=0)  # also covers the item's last dQ reduce-adds
        if PERSISTENT:  # K's and V's slots may take the next item's tiles
            mbarrier.arrive(kv_empty.index(C))
        return G * n_i

    @gluon.jit
    def _dkdv_consumer(dk_desc, dv_desc, dq_desc, LSE, DELTA, LO, HI, TAB, ORD, DEAL, q_smem, do_smem, k_smem,
                       v_smem, ds_smem, dq_smem, ds_bar, kv_bar, kv_empty, ready, empty, turn, first, n_items, n_prog,
                       BH, HKV, H, G, LZB, LZH, q_len, qk_scale, sm_scale, DK, DV, stride_dkb, stride_dkh, stride_dkn,
                       stride_dvb, stride_dvh, stride_dvn, dk_rb, dk_rh, dk_ch, dv_rb, dv_rh, dv_ch,
                       C: gl.constexpr, CAUSAL: gl.constexpr, INTERVAL: gl.constexpr, ATOMIC_DQ: gl.constexpr,
                       PINGPONG: gl.constexpr, OVERLAP: gl.constexpr, M_MAJOR: gl.constexpr,
                       PERSISTENT: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DQ_CHUNK: gl.constexpr, DQ_BUFS: gl.constexpr,
                       DIRECT_STORE: gl.constexpr, rows_smem, ROWS_SMEM: gl.constexpr, LIST: gl.constexpr,
                       bounds_smem, BOUNDS_SMEM: gl.constexpr, DEALT: gl.constexpr, kv_read, DQ_LAG: gl.constexpr,
                       ROWS_ACC: gl.constexpr, LATE_DV: gl.constexpr, DK_DS_SMEM: gl.constexpr):
        """Consumer ``C`` (a warp group): its program's work items (:func:`_dkdv_consumer_item`);
        ring steps (ping-pong turns, dSᵀ buffers) count on across them. One program per item runs
        the item without the loop (fewer values live across the steps)."""
        if PINGPONG:
            if C == 0:  # group 0 takes the first turn
                mbarrier.arrive(turn.index(0))
        if PERSISTENT:
            tb = 0
            it = 0
            for k in range(0, _fg._n_dealt(DEAL, first, n_items, DEALT)):
                item = _fg._dealt(DEAL, first, k, DEALT)
                tb += _dkdv_consumer_item(
                    item, tb, it, dk_desc, dv_desc, dq_desc, LSE, DELTA, LO, HI, TAB, ORD, q_smem, do_smem, k_smem,
                    v_smem, ds_smem, dq_smem, ds_bar, kv_bar, kv_empty, ready, empty, turn, n_prog, BH, HKV, H, G,
                    LZB, LZH, q_len, qk_scale, sm_scale, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dvb,
                    stride_dvh, stride_dvn, dk_rb, dk_rh, dk_ch, dv_rb, dv_rh, dv_ch, C, CAUSAL, INTERVAL, ATOMIC_DQ,
                    PINGPONG, OVERLAP, M_MAJOR, PERSISTENT, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_CHUNK, DQ_BUFS,
                    DIRECT_STORE, rows_smem, ROWS_SMEM, LIST, bounds_smem, BOUNDS_SMEM, kv_read, DQ_LAG, ROWS_ACC,
                    LATE_DV, DK_DS_SMEM)
                it += 1
        else:
            _dkdv_consumer_item(
                first, 0, 0, dk_desc, dv_desc, dq_desc, LSE, DELTA, LO, HI, TAB, ORD, q_smem, do_smem, k_smem, v_smem,
                ds_smem, dq_smem, ds_bar, kv_bar, kv_empty, ready, empty, turn, n_prog, BH, HKV, H, G, LZB, LZH, q_len,
                qk_scale, sm_scale, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                dk_rb, dk_rh, dk_ch, dv_rb, dv_rh, dv_ch, C, CAUSAL, INTERVAL, ATOMIC_DQ, PINGPONG, OVERLAP, M_MAJOR,
                PERSISTENT, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DQ_CHUNK, DQ_BUFS, DIRECT_STORE, rows_smem, ROWS_SMEM,
                LIST, bounds_smem, BOUNDS_SMEM, kv_read, DQ_LAG, ROWS_ACC, LATE_DV, DK_DS_SMEM)

    @gluon.jit(do_not_specialize=["q_len", "kv_len", "n_prog", "n_items", "q_rb", "q_rh", "q_ch", "do_rb", "do_rh",
                                  "do_ch", "k_rb", "k_rh", "k_ch", "v_rb", "v_rh", "v_ch", "dk_rb", "dk_rh", "dk_ch",
                                  "dv_rb", "dv_rh", "dv_ch"])
    def _attn_bwd_dkdv_gluon(Q, K, V, DO, DK, DV, DQA, LSE, DELTA, LO, HI, TAB, ORD, DEAL,
                             stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                             stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                             stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                             H, G, q_len, kv_len, LZB, LZH, qk_scale, sm_scale, n_prog, n_items,
                             q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch,
                             dk_rb, dk_rh, dk_ch, dv_rb, dv_rh, dv_ch,
                             HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             STAGES: gl.constexpr, CAUSAL: gl.constexpr, ATOMIC_DQ: gl.constexpr,
                             PINGPONG: gl.constexpr, OVERLAP: gl.constexpr,
                             PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             INTERVAL: gl.constexpr = False, DIRECT_STORE: gl.constexpr = False,
                             PERSISTENT: gl.constexpr = False, M_MAJOR: gl.constexpr = False,
                             ROWS_SMEM: gl.constexpr = False, LIST: gl.constexpr = False,
                             BOUNDS_SMEM: gl.constexpr = False, DEALT: gl.constexpr = False,
                             KV_REP: gl.constexpr = 1, DQ_LAG: gl.constexpr = False, ROWS_ACC: gl.constexpr = 0,
                             LATE_DV: gl.constexpr = False, DK_DS_SMEM: gl.constexpr = False):
        """1-D grid, 4 warps (consumer 0) plus a 4-warp consumer 1 and a 1-warp producer. Work
        items: ``n_prog = Lk / (2·BLOCK_N)`` key tiles of each of the ``B·H // G`` kv heads
        (``n_items``); program ``p`` runs items ``p, p + grid, ...``: without ``PERSISTENT`` the
        grid is ``n_items`` and the descriptors cover the program's batch and kv head (Q and dO:
        the group's heads, which must then be adjacent, ``stride_qh == Lq·stride_qm``, likewise dO);
        with it about one program per SM, descriptors over whole tensors as 2-D row views
        (``*_rb``, ``*_rh``, ``*_ch``: rows per batch, rows per head, columns per head of Q, dO, K,
        V, dK, dV; as ``forward_gluon._attn_fwd_gluon``'s). ``K/V/DK/DV (B, H // G, Lk, D)``,
        ``LSE/DELTA (B·H, Lq)`` float32, ``DQA (B·H, Lq, D)`` float32, contiguous and zeroed (used
        only with ``ATOMIC_DQ``: dQ/scale is TMA-reduce-added there in tiles of
        ``BLOCK_M × HEAD_DIM / 2``); ``qk_scale = scale · log2(e)``.

        ``INTERVAL``: row ``r`` of batch ``b`` and kv head ``hk`` keeps keys ``LO[z, r] <= k <
        HI[z, r]`` for every query head of the group (``z = b·LZB + hk·LZH``; ``LZH`` 0, or ``G``
        for intervals given per query head that agree within each group; int32 ``(Z, Lq)``);
        ``TAB`` (int32 ``(Z, n_prog, 4)``)
        gives key tile ``pid_n`` its query blocks ``(first, f0, f1, end)``: it visits
        ``[first, end)`` (``end > first``), of which ``[f0, f1)`` every row keeps whole (rows that
        keep nothing excepted: their logsumexp is -inf). Otherwise LO/HI/TAB are not read.
        ``M_MAJOR`` (persistent interval mode): items in ``forward_gluon._item_tile``'s
        key-tile-major snake order over the key tiles of ``ORD`` (int32 ``(Z, n_prog)``, a
        permutation per instance: heaviest first); ``DEALT`` (persistent): each program runs the items
        its row of the deal table ``DEAL`` lists (``forward_gluon._dealt``: items of unequal work
        balanced on the host), else items ``p, p + grid, ...``. ``LIST``: ``first .. end`` are positions in ``TAB``
        (after the programs' rows) holding the query blocks, and the masked steps' intervals are
        exact on the blocks they visit (``compiler/block_lists.py``; int64 ``LO``/``HI``: two
        intervals per row).

        ``DIRECT_STORE``: dK and dV are written from the registers (not staged in shared memory for a
        TMA store); needed where DK/DV are float32 (partial sums), and fewer values stay live across
        the loops (less spilling: ``benchmarks/NOTES.md``, "Gluon kernels").

        ``KV_REP``: item head ``hk`` reads K and V of head ``hk // KV_REP`` (``K/V (B, H // G //
        KV_REP, Lk, D)``) and writes its own dK/dV: with ``G = 1`` and ``KV_REP`` the GQA group size,
        one item per query head over the shared K/V, whose per-query-head dK/dV the caller sums per
        group (``ops/select._gluon_bwd_mode``, ``"list+per_head_dkdv"``).

        ``DQ_LAG`` (with ``ATOMIC_DQ``): each step's dQ product is issued in the next step, from
        three dSᵀ buffers, so the two groups meet one step apart instead of in every step (one
        staging tile per group at d 128 makes room for the third buffer)."""
        gl.static_assert(not CAUSAL or (2 * BLOCK_N) % BLOCK_M == 0, "causal needs BLOCK_M | 2·BLOCK_N")
        gl.static_assert(not (CAUSAL and INTERVAL), "CAUSAL and INTERVAL exclude each other")
        gl.static_assert(OVERLAP == 0 or (STAGES >= 2 and not ATOMIC_DQ), "OVERLAP needs 2+ stages, no ATOMIC_DQ")
        gl.static_assert(OVERLAP == 0 or not ROWS_SMEM, "ROWS_SMEM is not read by the OVERLAP steps")
        gl.static_assert(not LIST or (INTERVAL and not ATOMIC_DQ), "lists need the interval mode")
        gl.static_assert(not BOUNDS_SMEM or (ROWS_SMEM and INTERVAL), "BOUNDS_SMEM stages with ROWS_SMEM")
        gl.static_assert(not DQ_LAG or ATOMIC_DQ, "DQ_LAG needs ATOMIC_DQ")
        DQ_CHUNK: gl.constexpr = HEAD_DIM // 2  # ATOMIC_DQ: dQ columns per consumer group
        HKV = H // G
        BH = n_items // n_prog
        n_b = BH // HKV
        # one item per program: descriptors over its batch and kv head; persistent: whole tensors
        pid_bh = gl.program_id(0) // n_prog
        b64 = (pid_bh // HKV).to(gl.int64)
        hk64 = (pid_bh % HKV).to(gl.int64)
        g0 = hk64 * G
        dtype: gl.constexpr = Q.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        if PERSISTENT:
            q_desc = _fg._rows_desc(Q, stride_qb, stride_qh, stride_qm, b64, g0, q_rb, q_rh, q_ch, n_b, H, q_len,
                                    PERSISTENT, HEAD_DIM, BLOCK_M, q_layout)
            do_desc = _fg._rows_desc(DO, stride_dob, stride_doh, stride_dom, b64, g0, do_rb, do_rh, do_ch, n_b, H,
                                     q_len, PERSISTENT, HEAD_DIM, BLOCK_M, q_layout)
        else:  # the group's heads, stacked: head g of the group at rows g·Lq ..
            q_desc = tma.make_tensor_descriptor(Q + b64 * stride_qb + g0 * stride_qh, shape=[G * q_len, HEAD_DIM],
                                                strides=[stride_qm, 1], block_shape=[BLOCK_M, HEAD_DIM],
                                                layout=q_layout)
            do_desc = tma.make_tensor_descriptor(DO + b64 * stride_dob + g0 * stride_doh, shape=[G * q_len, HEAD_DIM],
                                                 strides=[stride_dom, 1], block_shape=[BLOCK_M, HEAD_DIM],
                                                 layout=q_layout)
            q_rb = 0
            q_rh = q_len
            q_ch = 0
            do_rb = 0
            do_rh = q_len
            do_ch = 0
        # K and V: kv head hk // KV_REP (KV_REP > 1: items per query head over shared K/V)
        k_desc = _fg._rows_desc(K, stride_kb, stride_kh, stride_kn, b64, hk64 // KV_REP, k_rb, k_rh, k_ch, n_b,
                                HKV // KV_REP, kv_len, PERSISTENT, HEAD_DIM, BLOCK_N, k_layout)
        v_desc = _fg._rows_desc(V, stride_vb, stride_vh, stride_vn, b64, hk64 // KV_REP, v_rb, v_rh, v_ch, n_b,
                                HKV // KV_REP, kv_len, PERSISTENT, HEAD_DIM, BLOCK_N, k_layout)
        if DIRECT_STORE:  # not read
            dk_desc = k_desc
            dv_desc = v_desc
        else:
            dk_desc = _fg._rows_desc(DK, stride_dkb, stride_dkh, stride_dkn, b64, hk64, dk_rb, dk_rh, dk_ch, n_b, HKV,
                                     kv_len, PERSISTENT, HEAD_DIM, BLOCK_N, k_layout)
            dv_desc = _fg._rows_desc(DV, stride_dvb, stride_dvh, stride_dvn, b64, hk64, dv_rb, dv_rh, dv_ch, n_b, HKV,
                                     kv_len, PERSISTENT, HEAD_DIM, BLOCK_N, k_layout)
        if not PERSISTENT:  # coordinates relative to the item's batch and kv head
            k_rb = 0
            k_rh = 0
            k_ch = 0
            v_rb = 0
            v_rh = 0
            v_ch = 0
            dk_rb = 0
            dk_rh = 0
            dk_ch = 0
            dv_rb = 0
            dv_rh = 0
            dv_ch = 0
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], k_layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], k_layout)
        if ATOMIC_DQ:  # two (DQ_LAG: three) buffers of both groups' dSᵀ tiles (buffer b: tiles 2·b, 2·b + 1)
            ds_smem = gl.allocate_shared_memory(dtype, [6 if DQ_LAG else 4, BLOCK_N, BLOCK_M], ds_layout)
        elif OVERLAP == 2:  # one dSᵀ tile per consumer group
            ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        else:  # not read: a minimal placeholder
            ds_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], gl.NVMMASharedLayout.get_default_for([64, 64],
                                                                                                        dtype))
        # ATOMIC_DQ: per consumer group DQ_BUFS fp32 tiles (two where they take at most 16 KB each),
        # reduce-added into DQA through a descriptor over the group's heads (rows g·Lq + i·BLOCK_M)
        # or, persistent, over every head (rows (b·H + h)·Lq + i·BLOCK_M)
        DQ_BUFS: gl.constexpr = 2 if BLOCK_M * DQ_CHUNK <= (2048 if DQ_LAG else 4096) else 1
        if ATOMIC_DQ:
            dqs_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_CHUNK], gl.float32)
            dq_smem = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFS, BLOCK_M, DQ_CHUNK], dqs_layout)
            if PERSISTENT:
                dq_desc = tma.make_tensor_descriptor(DQA, shape=[BH * G * q_len, HEAD_DIM], strides=[HEAD_DIM, 1],
                                                     block_shape=[BLOCK_M, DQ_CHUNK], layout=dqs_layout)
            else:
                dq_desc = tma.make_tensor_descriptor(DQA + (b64 * H + g0) * q_len * HEAD_DIM,
                                                     shape=[G * q_len, HEAD_DIM], strides=[HEAD_DIM, 1],
                                                     block_shape=[BLOCK_M, DQ_CHUNK], layout=dqs_layout)
        else:  # not read
            dq_smem = 0
            dq_desc = 0
        if ROWS_SMEM:  # each ring slot's logsumexp and Δ (tiles 2·s, 2·s + 1), loaded with Q and dO
            rows_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
            rows_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_M], rows_layout)
            if PERSISTENT:
                n_rows = BH * G * q_len
                lse_base = LSE
                delta_base = DELTA
            else:
                n_rows = G * q_len
                lse_base = LSE + (b64 * H + g0) * q_len
                delta_base = DELTA + (b64 * H + g0) * q_len
            lse_desc, delta_desc = _vec_descs(lse_base, delta_base, n_rows, BLOCK_M, rows_layout)
        else:  # not read
            rows_smem = 0
            lse_desc = 0
            delta_desc = 0
        if BOUNDS_SMEM:  # each ring slot's interval bounds (tiles 2·s, 2·s + 1), loaded with Q and dO
            iv_dtype: gl.constexpr = LO.dtype.element_ty
            iv_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0,
                                                           element_bitwidth=iv_dtype.primitive_bitwidth, rank=1)
            bounds_smem = gl.allocate_shared_memory(iv_dtype, [2 * STAGES, BLOCK_M], iv_layout)
            n_iv = ((n_b - 1) * LZB + (HKV - 1) * LZH + 1) * q_len  # rows of the (Z, Lq) tables
            lo_desc, hi_desc = _vec_descs(LO, HI, n_iv, BLOCK_M, iv_layout)
        else:  # not read
            bounds_smem = 0
            lo_desc = 0
            hi_desc = 0
        # ATOMIC_DQ: dS buffer b written by both groups; kv_read: both groups' products of an item are done
        ds_bar = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        kv_read = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
        kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(kv_bar.index(c), count=1)
            mbarrier.init(kv_empty.index(c), count=1)
            mbarrier.init(turn.index(c), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # both consumers release a slot
        for s in gl.static_range(3):
            mbarrier.init(ds_bar.index(s), count=2)
        mbarrier.init(kv_read, count=2)
        fence_async_shared()
        first = gl.program_id(0)
        gl.warp_specialize([
            (_dkdv_consumer, (dk_desc, dv_desc, dq_desc, LSE, DELTA, LO, HI, TAB, ORD, DEAL, q_smem, do_smem, k_smem,
                              v_smem,
                              ds_smem, dq_smem, ds_bar, kv_bar, kv_empty, ready, empty, turn, first, n_items, n_prog,
                              BH, HKV, H, G, LZB, LZH, q_len, qk_scale, sm_scale, DK, DV, stride_dkb, stride_dkh,
                              stride_dkn, stride_dvb, stride_dvh, stride_dvn, dk_rb, dk_rh, dk_ch, dv_rb, dv_rh, dv_ch,
                              0, CAUSAL, INTERVAL, ATOMIC_DQ, PINGPONG, OVERLAP, M_MAJOR, PERSISTENT, HEAD_DIM,
                              BLOCK_M, BLOCK_N, STAGES, DQ_CHUNK, DQ_BUFS, DIRECT_STORE, rows_smem, ROWS_SMEM,
                              LIST, bounds_smem, BOUNDS_SMEM, DEALT, kv_read, DQ_LAG, ROWS_ACC, LATE_DV,
                              DK_DS_SMEM)),
            (_dkdv_consumer, (dk_desc, dv_desc, dq_desc, LSE, DELTA, LO, HI, TAB, ORD, DEAL, q_smem, do_smem, k_smem,
                              v_smem,
                              ds_smem, dq_smem, ds_bar, kv_bar, kv_empty, ready, empty, turn, first, n_items, n_prog,
                              BH, HKV, H, G, LZB, LZH, q_len, qk_scale, sm_scale, DK, DV, stride_dkb, stride_dkh,
                              stride_dkn, stride_dvb, stride_dvh, stride_dvn, dk_rb, dk_rh, dk_ch, dv_rb, dv_rh, dv_ch,
                              1, CAUSAL, INTERVAL, ATOMIC_DQ, PINGPONG, OVERLAP, M_MAJOR, PERSISTENT, HEAD_DIM,
                              BLOCK_M, BLOCK_N, STAGES, DQ_CHUNK, DQ_BUFS, DIRECT_STORE, rows_smem, ROWS_SMEM,
                              LIST, bounds_smem, BOUNDS_SMEM, DEALT, kv_read, DQ_LAG, ROWS_ACC, LATE_DV,
                              DK_DS_SMEM)),
            (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, kv_empty,
                              ready, empty, TAB, ORD, DEAL, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch,
                              v_rb, v_rh, v_ch, first, n_items, n_prog, BH, HKV, G, LZB, LZH, q_len, CAUSAL, INTERVAL,
                              M_MAJOR, PERSISTENT, BLOCK_M, BLOCK_N, STAGES, lse_desc, delta_desc, rows_smem, H,
                              ROWS_SMEM, LIST, lo_desc, hi_desc, bounds_smem, BOUNDS_SMEM, DEALT, KV_REP)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    # ------------------------------------------------------------------ dQ (deterministic)

    @gluon.jit
    def _dq_item(t, TAB, n_prog, H, BH, LZB, LZH, q_len, kv_len, CAUSAL: gl.constexpr, INTERVAL: gl.constexpr,
                 M_MAJOR: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Work item ``t`` of the dQ kernel: ``(pid_bh, off_m, kb0, e1, e2, n_blocks, lse_base,
        row_base)``, in the forward's order (``forward_gluon._item_tile``)."""
        pid_m, pid_bh = _fg._item_tile(t, n_prog, BH, M_MAJOR)
        if CAUSAL:  # longest rows first
            pid_m = n_prog - 1 - pid_m
        off_m = pid_m * (2 * BLOCK_M)
        lse_base = pid_bh.to(gl.int64) * q_len
        if INTERVAL:  # this row tile's key blocks from the table
            z = ((pid_bh // H) * LZB + (pid_bh % H) * LZH).to(gl.int64)
            row_base = z * q_len
            tab = TAB + (z * n_prog + pid_m) * 4
            kb0 = gl.load(tab)
            e1 = gl.load(tab + 1) - kb0
            e2 = gl.load(tab + 2) - kb0
            n_blocks = gl.load(tab + 3) - kb0
        else:
            row_base = lse_base
            kb0 = 0
            e1 = 0
            if CAUSAL:
                e2 = off_m // BLOCK_N  # key blocks before the program's diagonal rows
                n_blocks = e2 + (2 * BLOCK_M) // BLOCK_N
            else:
                e2 = kv_len // BLOCK_N
                n_blocks = e2
        return pid_bh, off_m, kb0, e1, e2, n_blocks, lse_base, row_base

    @gluon.jit
    def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, q_empty, ready, empty,
                     TAB, DEAL, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, first,
                     n_items, n_prog, H, G, BH, LZB, LZH, q_len, kv_len, CAUSAL: gl.constexpr, INTERVAL: gl.constexpr,
                     M_MAJOR: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     LIST: gl.constexpr, DEALT: gl.constexpr):
        """One warp: per work item both consumers' Q and dO tiles (once the consumers have released
        the previous item's), then K/V tiles ``kb0 .. kb0 + n_blocks - 1`` through the ring, whose
        positions count on across items (``LIST``: key blocks ``TAB[kb0 + j]``). ``*_rb``, ``*_rh``,
        ``*_ch``: where a batch·head's tiles lie in the descriptors' 2-D views (zeros where a
        descriptor covers one batch·head)."""
        rb = 0
        it = 0
        for k in range(0, _fg._n_dealt(DEAL, first, n_items, DEALT)):
            t = _fg._dealt(DEAL, first, k, DEALT)
            pid_bh, off_m, kb0, e1, e2, n_blocks, lse_base, row_base = _dq_item(
                t, TAB, n_prog, H, BH, LZB, LZH, q_len, kv_len, CAUSAL, INTERVAL, M_MAJOR, BLOCK_M, BLOCK_N)
            b = pid_bh // H
            h = pid_bh % H
            hk = h // G
            for c in gl.static_range(2):
                # a fresh barrier counts as having completed the phase before its first: the first
                # wait on parity 1 does not block
                mbarrier.wait(q_empty.index(c), (it & 1) ^ 1)
                _load_pair(q_desc, do_desc, q_bar.index(c), q_smem.index(c), do_smem.index(c),
                           b * q_rb + h * q_rh + off_m + c * BLOCK_M, h * q_ch,
                           b * do_rb + h * do_rh + off_m + c * BLOCK_M, h * do_ch)
            k_row = b * k_rb + hk * k_rh
            v_row = b * v_rb + hk * v_rh
            for j in range(n_blocks):
                g = rb + j
                s = g % STAGES
                kb = _fg._step_base(TAB, kb0, j, LIST) + j  # LIST: TAB[kb0 + j], else kb0 + j
                mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
                _load_pair(k_desc, v_desc, ready.index(s), k_smem.index(s), v_smem.index(s), k_row + kb * BLOCK_N,
                           hk * k_ch, v_row + kb * BLOCK_N, hk * v_ch)
            rb += n_blocks
            it += 1

    @gluon.jit
    def _masked(p, off_m, kb, lo_r, hi_r, MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                s_layout: gl.constexpr):
        """``P`` of rows ``off_m ..`` against key block ``kb`` with the dropped entries zeroed:
        ``MASK`` 1 keys after the query (causal diagonal), 2 keys outside the row's interval
        ``[lo_r, hi_r)``."""
        offs_n = gl.expand_dims(kb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
        if MASK == 1:
            offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            keep = offs_n <= gl.expand_dims(offs_m, 1)
        else:
            keep = _fg._in_rows(offs_n, lo_r, hi_r, 1)
        return gl.where(keep, p, 0.0)

    @gluon.jit
    def _dq_step(dq, j, rb, kb0, q, do, k_smem, v_smem, ready, empty, turn, lse2, delta, lo_r, hi_r, off_m,
                 qk_scale, C: gl.constexpr, MASK: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
        """Step ``j`` of a work item (key block ``kb0 + j``, ring position and turn ``rb + j``) for one
        consumer."""
        s = (rb + j) % STAGES
        mbarrier.wait(ready.index(s), ((rb + j) // STAGES) & 1)
        k = k_smem.index(s)
        zero = gl.zeros([BLOCK_M, BLOCK_N], dtype=gl.float32, layout=s_layout)
        if PINGPONG:
            mbarrier.wait(turn.index(C), (rb + j) & 1)
        sc = warpgroup_mma(q, k.permute((1, 0)), zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - C))
        sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc, ))
        p = gl.exp2(sc * qk_scale - gl.expand_dims(lse2, 1))
        if MASK > 0:
            p = _masked(p, off_m, kb0 + j, lo_r, hi_r, MASK, BLOCK_M, BLOCK_N, s_layout)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
        ds = (p * (dp - gl.expand_dims(delta, 1))).to(k.dtype)
        ds16 = gl.convert_layout(ds, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
        dq = warpgroup_mma(ds16, k, dq, is_async=True)
        dq, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds16))
        mbarrier.arrive(empty.index(s))
        return dq

    @gluon.jit
    def _dq_masked(dq, j, rb, kb0, q, do, k_smem, v_smem, ready, empty, turn, lse2, delta, lo_r, hi_r, off_m,
                   qk_scale, TAB, C: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                   LIST: gl.constexpr):
        """Masked step ``j`` of an item whose list starts at ``kb0``; with ``LIST`` the entry's skip
        bit for consumer ``C`` (bit ``24 + C``) makes it :func:`_pass_step` instead."""
        kbj = _fg._step_base(TAB, kb0, j, LIST)
        if LIST:
            if ((gl.load(TAB + kb0 + j) >> (24 + C)) & 1) != 0:
                _pass_step(rb + j, ready, empty, turn, C, PINGPONG, STAGES)
            else:
                dq = _dq_step(dq, j, rb, kbj, q, do, k_smem, v_smem, ready, empty, turn, lse2, delta, lo_r, hi_r,
                              off_m, qk_scale, C, 2, PINGPONG, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout)
        else:
            dq = _dq_step(dq, j, rb, kbj, q, do, k_smem, v_smem, ready, empty, turn, lse2, delta, lo_r, hi_r, off_m,
                          qk_scale, C, 2, PINGPONG, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout)
        return dq

    @gluon.jit
    def _dq_step_overlap(dq, ds_prev, j, rb, kb0, q, do, ds_c, k_smem, v_smem, ready, empty, turn, lse2, delta,
                         lo_r, hi_r, off_m, qk_scale, C: gl.constexpr, MASK: gl.constexpr, PINGPONG: gl.constexpr,
                         DS_SMEM: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                         o_layout: gl.constexpr):
        """Ring position ``j`` (key block ``kb0 + j``) overlapped with the end of position ``j - 1``: ``S_j``, ``dP_j`` and
        ``dQ += dS_{j-1}·K_{j-1}`` issued together, ``P_j`` and ``dS_j`` computed while the tensor
        cores run the latter two; returns ``dS_j`` (with ``DS_SMEM``: stores it into the group's
        shared tile ``ds_c`` and returns ``ds_prev``). Releases the slot of block ``j - 1`` (at
        ``j == 0`` the deferred product is a zero dS against the valid ``K_0``)."""
        s = (rb + j) % STAGES
        sp = (rb + gl.maximum(j - 1, 0)) % STAGES
        mbarrier.wait(ready.index(s), ((rb + j) // STAGES) & 1)
        k = k_smem.index(s)
        zero = gl.zeros([BLOCK_M, BLOCK_N], dtype=gl.float32, layout=s_layout)
        if PINGPONG:
            mbarrier.wait(turn.index(C), (rb + j) & 1)
        sc = warpgroup_mma(q, k.permute((1, 0)), zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        if DS_SMEM:
            dq = warpgroup_mma(ds_c, k_smem.index(sp), dq, is_async=True)
        else:
            dq = warpgroup_mma(ds_prev, k_smem.index(sp), dq, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - C))
        sc = warpgroup_mma_wait(num_outstanding=2, deps=(sc, ))
        p = gl.exp2(sc * qk_scale - gl.expand_dims(lse2, 1))
        if MASK > 0:
            p = _masked(p, off_m, kb0 + j, lo_r, hi_r, MASK, BLOCK_M, BLOCK_N, s_layout)
        dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp, ))
        ds = (p * (dp - gl.expand_dims(delta, 1))).to(k.dtype)
        if DS_SMEM:
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
            ds_c.store(ds)
            fence_async_shared()
            ds16 = ds_prev
        else:
            ds16 = gl.convert_layout(ds, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
            dq, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds_prev))
        mbarrier.arrive(empty.index(sp), pred=j > 0)
        return dq, ds16

    @gluon.jit
    def _dq_consumer(dq_desc, LSE, DELTA, LO, HI, TAB, DEAL, q_smem, do_smem, ds_smem, k_smem, v_smem, q_bar,
                     q_empty, ready, empty, turn, DQ, stride_dqb, stride_dqh, stride_dqm, dq_rb, dq_rh, dq_ch, first,
                     n_items, n_prog, H, BH, LZB, LZH, q_len, kv_len, qk_scale, sm_scale, C: gl.constexpr,
                     CAUSAL: gl.constexpr, INTERVAL: gl.constexpr, M_MAJOR: gl.constexpr, PERSISTENT: gl.constexpr,
                     PINGPONG: gl.constexpr, OVERLAP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DIRECT_STORE: gl.constexpr,
                     LIST: gl.constexpr, DEALT: gl.constexpr):
        """Consumer ``C``: per work item, query rows ``off_m + C·BLOCK_M ..`` against steps
        ``0 .. n_blocks - 1`` (key blocks ``kb0 ..``), then dQ. Steps ``[e1, e2)`` are full;
        ``CAUSAL``: the ``2·BLOCK_M / BLOCK_N`` after them are masked by the diagonal; ``INTERVAL``:
        those before and after them are masked against each row's interval ``[LO[r], HI[r])``
        (``row_base + r``); with ``LIST`` step ``j`` visits key block ``TAB[kb0 + j]``. Ring positions
        (and ping-pong turns) count on across items; the Q/dO slots go back to the producer once the
        item's dQ has left Q's slot."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        q = q_smem.index(C)
        do = do_smem.index(C)
        N_DIAG: gl.constexpr = (2 * BLOCK_M) // BLOCK_N
        if PINGPONG:
            if C == 0:
                mbarrier.arrive(turn.index(0))
        rb = 0
        it = 0
        for k in range(0, _fg._n_dealt(DEAL, first, n_items, DEALT)):
            t = _fg._dealt(DEAL, first, k, DEALT)
            pid_bh, off_m0, kb0, e1, e2, n_blocks, lse_base, row_base = _dq_item(
                t, TAB, n_prog, H, BH, LZB, LZH, q_len, kv_len, CAUSAL, INTERVAL, M_MAJOR, BLOCK_M, BLOCK_N)
            off_m = off_m0 + C * BLOCK_M
            offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            lse = gl.load(LSE + lse_base + offs_m)
            if INTERVAL:  # rows that keep no key: P = 0 in full steps too
                lse = gl.where(lse == float("-inf"), float("inf"), lse)
                lo_r = gl.load(LO + row_base + offs_m)
                hi_r = gl.load(HI + row_base + offs_m)
            else:
                lo_r = 0
                hi_r = 0
            lse2 = lse * 1.4426950408889634
            delta = gl.load(DELTA + lse_base + offs_m)
            dq = gl.zeros([BLOCK_M, HEAD_DIM], dtype=gl.float32, layout=o_layout)
            mbarrier.wait(q_bar.index(C), it & 1)
            if OVERLAP > 0:  # dQ of block j is issued with block j + 1's products (dS in registers or shared)
                DS_SMEM: gl.constexpr = OVERLAP == 2
                ds_c = ds_smem.index(C)
                ds_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
                ds16 = gl.zeros([BLOCK_M, BLOCK_N], dtype=q.dtype, layout=ds_op)
                if DS_SMEM:  # the first block's deferred product reads zeros
                    ds_c.store(gl.zeros([BLOCK_M, BLOCK_N], dtype=q.dtype, layout=s_layout))
                    fence_async_shared()
                    ds16 = 0
                if INTERVAL:
                    for j in range(0, e1):
                        kbj = _fg._step_base(TAB, kb0, j, LIST)
                        dq, ds16 = _dq_step_overlap(dq, ds16, j, rb, kbj, q, do, ds_c, k_smem, v_smem, ready, empty,
                                                    turn, lse2, delta, lo_r, hi_r, off_m, qk_scale, C, 2, PINGPONG,
                                                    DS_SMEM, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout)
                for j in range(e1, e2):
                    dq, ds16 = _dq_step_overlap(dq, ds16, j, rb, kb0, q, do, ds_c, k_smem, v_smem, ready, empty, turn,
                                                lse2, delta, lo_r, hi_r, off_m, qk_scale, C, 0, PINGPONG, DS_SMEM,
                                                BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout)
                if CAUSAL:
                    for u in gl.static_range(N_DIAG):
                        dq, ds16 = _dq_step_overlap(dq, ds16, e2 + u, rb, kb0, q, do, ds_c, k_smem, v_smem, ready,
                                                    empty, turn, lse2, delta, lo_r, hi_r, off_m, qk_scale, C, 1,
                                                    PINGPONG, DS_SMEM, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout)
                if INTERVAL:
                    for j in range(e2, n_blocks):
                        kbj = _fg._step_base(TAB, kb0, j, LIST)
                        dq, ds16 = _dq_step_overlap(dq, ds16, j, rb, kbj, q, do, ds_c, k_smem, v_smem, ready, empty,
                                                    turn, lse2, delta, lo_r, hi_r, off_m, qk_scale, C, 2, PINGPONG,
                                                    DS_SMEM, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout)
                sl = (rb + n_blocks - 1) % STAGES  # n_blocks >= 1
                dq = _last_deferred(dq, ds_c, ds16, k_smem.index(sl), empty, sl, DS_SMEM)
            else:
                if INTERVAL:
                    for j in range(0, e1):
                        dq = _dq_masked(dq, j, rb, kb0, q, do, k_smem, v_smem, ready, empty, turn, lse2, delta, lo_r,
                                        hi_r, off_m, qk_scale, TAB, C, PINGPONG, BLOCK_M, BLOCK_N, STAGES, s_layout,
                                        o_layout, LIST)
                for j in range(e1, e2):
                    dq = _dq_step(dq, j, rb, kb0, q, do, k_smem, v_smem, ready, empty, turn, lse2, delta, lo_r, hi_r,
                                  off_m, qk_scale, C, 0, PINGPONG, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout)
                if CAUSAL:
                    for u in gl.static_range(N_DIAG):
                        dq = _dq_step(dq, e2 + u, rb, kb0, q, do, k_smem, v_smem, ready, empty, turn, lse2, delta,
                                      lo_r, hi_r, off_m, qk_scale, C, 1, PINGPONG, BLOCK_M, BLOCK_N, STAGES, s_layout,
                                      o_layout)
                if INTERVAL:
                    for j in range(e2, n_blocks):
                        dq = _dq_masked(dq, j, rb, kb0, q, do, k_smem, v_smem, ready, empty, turn, lse2, delta, lo_r,
                                        hi_r, off_m, qk_scale, TAB, C, PINGPONG, BLOCK_M, BLOCK_N, STAGES, s_layout,
                                        o_layout, LIST)
            pid_b = pid_bh // H
            pid_h = pid_bh % H
            if DIRECT_STORE:  # dQ (any dtype) from the registers
                DQP = DQ + pid_b.to(gl.int64) * stride_dqb + pid_h.to(gl.int64) * stride_dqh
                _store_rows(DQP, stride_dqm, off_m, dq * sm_scale, o_layout, BLOCK_M, HEAD_DIM)
            else:
                # Q's slot is free (every product reading it has completed): stage dQ there
                q.store((dq * sm_scale).to(q.dtype))
                fence_async_shared()
                _tma_store(dq_desc, [pid_b * dq_rb + pid_h * dq_rh + off_m, pid_h * dq_ch], q)
                tma.store_wait(pendings=0)
            if PERSISTENT:  # Q's and dO's slots may take the next item's tiles
                mbarrier.arrive(q_empty.index(C))
            rb += n_blocks
            it += 1

    @gluon.jit(do_not_specialize=["q_len", "kv_len", "n_prog", "n_items", "q_rb", "q_rh", "q_ch", "do_rb", "do_rh",
                                  "do_ch", "k_rb", "k_rh", "k_ch", "v_rb", "v_rh", "v_ch", "dq_rb", "dq_rh", "dq_ch"])
    def _attn_bwd_dq_gluon(Q, K, V, DO, DQ, LSE, DELTA, LO, HI, TAB, DEAL,
                           stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                           stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                           stride_dqb, stride_dqh, stride_dqm,
                           H, G, q_len, kv_len, LZB, LZH, qk_scale, sm_scale, n_prog, n_items,
                           q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch,
                           dq_rb, dq_rh, dq_ch,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                           OVERLAP: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           INTERVAL: gl.constexpr = False, DIRECT_STORE: gl.constexpr = False,
                           PERSISTENT: gl.constexpr = False, M_MAJOR: gl.constexpr = False,
                           LIST: gl.constexpr = False, DEALT: gl.constexpr = False):
        """1-D grid, 4 + 4 + 1 warps as the dK/dV kernel. ``DQ`` like Q, or float32 with
        ``DIRECT_STORE`` (written from the registers, as the dK/dV kernel's). Work items:
        ``n_prog = Lq / (2·BLOCK_M)`` row tiles of each of the ``B·H`` heads (``n_items``); program
        ``p`` runs items ``p, p + grid, ...``: without ``PERSISTENT`` the grid is ``n_items`` and the
        descriptors cover the program's batch·head; with it (as ``forward_gluon._attn_fwd_gluon``)
        about one program per SM, descriptors over whole tensors as 2-D row views (``*_rb``,
        ``*_rh``, ``*_ch``: rows per batch, rows per head, columns per head of Q, dO, K, V, dQ).

        ``INTERVAL``: row ``r`` of layout instance ``z = b·LZB + h·LZH`` keeps keys
        ``LO[z, r] <= k < HI[z, r]`` (int32 ``(Z, Lq)``); ``TAB`` (int32 ``(Z, P, 4)``) gives row tile
        ``pid`` its key blocks ``(first, f0, f1, end)``: it visits ``[first, end)`` (``end > first``),
        of which ``[f0, f1)`` every row keeps whole (rows that keep nothing excepted). ``LIST``: those are
        positions in ``TAB`` (after the programs' rows) holding the key blocks, and the masked steps'
        intervals are exact on the blocks they visit (``compiler/block_lists.py``; int64 ``LO``/``HI``:
        two intervals per row). ``DEALT`` (persistent): each program runs the items its row of the deal
        table ``DEAL`` lists, as the dK/dV kernel's."""
        gl.static_assert(not CAUSAL or (2 * BLOCK_M) % BLOCK_N == 0, "causal needs BLOCK_N | 2·BLOCK_M")
        gl.static_assert(not LIST or INTERVAL, "lists need the interval mode")
        gl.static_assert(not (CAUSAL and INTERVAL), "CAUSAL and INTERVAL exclude each other")
        gl.static_assert(OVERLAP == 0 or STAGES >= 2, "OVERLAP needs 2+ stages")
        BH = n_items // n_prog
        dtype: gl.constexpr = Q.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        # one item per program: descriptors over its batch·head; persistent: over whole tensors
        pid_bh = gl.program_id(0) // n_prog
        b = (pid_bh // H).to(gl.int64)
        h = pid_bh % H
        hk = (h // G).to(gl.int64)
        h = h.to(gl.int64)
        n_b = BH // H
        n_hk = H // G
        q_desc = _fg._rows_desc(Q, stride_qb, stride_qh, stride_qm, b, h, q_rb, q_rh, q_ch, n_b, H, q_len,
                                PERSISTENT, HEAD_DIM, BLOCK_M, q_layout)
        do_desc = _fg._rows_desc(DO, stride_dob, stride_doh, stride_dom, b, h, do_rb, do_rh, do_ch, n_b, H, q_len,
                                 PERSISTENT, HEAD_DIM, BLOCK_M, q_layout)
        if DIRECT_STORE:  # not read
            dq_desc = q_desc
        else:
            dq_desc = _fg._rows_desc(DQ, stride_dqb, stride_dqh, stride_dqm, b, h, dq_rb, dq_rh, dq_ch, n_b, H,
                                     q_len, PERSISTENT, HEAD_DIM, BLOCK_M, q_layout)
        k_desc = _fg._rows_desc(K, stride_kb, stride_kh, stride_kn, b, hk, k_rb, k_rh, k_ch, n_b, n_hk, kv_len,
                                PERSISTENT, HEAD_DIM, BLOCK_N, kv_layout)
        v_desc = _fg._rows_desc(V, stride_vb, stride_vh, stride_vn, b, hk, v_rb, v_rh, v_ch, n_b, n_hk, kv_len,
                                PERSISTENT, HEAD_DIM, BLOCK_N, kv_layout)
        if not PERSISTENT:  # coordinates relative to the item's batch·head
            q_rb = 0
            q_rh = 0
            q_ch = 0
            do_rb = 0
            do_rh = 0
            do_ch = 0
            k_rb = 0
            k_rh = 0
            k_ch = 0
            v_rb = 0
            v_rh = 0
            v_ch = 0
            dq_rb = 0
            dq_rh = 0
            dq_ch = 0
        q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        if OVERLAP == 2:  # one dS tile per consumer group
            ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N],
                                                gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype))
        else:  # not read: a minimal placeholder
            ds_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], gl.NVMMASharedLayout.get_default_for([64, 64],
                                                                                                        dtype))
        q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(q_bar.index(c), count=1)
            mbarrier.init(q_empty.index(c), count=1)
            mbarrier.init(turn.index(c), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        fence_async_shared()
        first = gl.program_id(0)
        gl.warp_specialize([
            (_dq_consumer, (dq_desc, LSE, DELTA, LO, HI, TAB, DEAL, q_smem, do_smem, ds_smem, k_smem, v_smem, q_bar,
                            q_empty, ready, empty, turn, DQ, stride_dqb, stride_dqh, stride_dqm, dq_rb, dq_rh, dq_ch,
                            first, n_items, n_prog, H, BH, LZB, LZH, q_len, kv_len, qk_scale, sm_scale, 0, CAUSAL,
                            INTERVAL, M_MAJOR, PERSISTENT, PINGPONG, OVERLAP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                            DIRECT_STORE, LIST, DEALT)),
            (_dq_consumer, (dq_desc, LSE, DELTA, LO, HI, TAB, DEAL, q_smem, do_smem, ds_smem, k_smem, v_smem, q_bar,
                            q_empty, ready, empty, turn, DQ, stride_dqb, stride_dqh, stride_dqm, dq_rb, dq_rh, dq_ch,
                            first, n_items, n_prog, H, BH, LZB, LZH, q_len, kv_len, qk_scale, sm_scale, 1, CAUSAL,
                            INTERVAL, M_MAJOR, PERSISTENT, PINGPONG, OVERLAP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                            DIRECT_STORE, LIST, DEALT)),
            (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, q_empty, ready,
                            empty, TAB, DEAL, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh,
                            v_ch, first, n_items, n_prog, H, G, BH, LZB, LZH, q_len, kv_len, CAUSAL, INTERVAL, M_MAJOR,
                            BLOCK_M, BLOCK_N, STAGES, LIST, DEALT)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
