"""Hopper forward for dense, causal and one-interval-per-row layouts, written in Gluon.

The FlashAttention-3 schedule (Shah et al., 2024) in Triton's lower-level Gluon dialect
(``triton.experimental.gluon``), written against the Gluon API of triton 3.6:

- one producer warp issues TMA loads: each consumer's Q tile once, then K and V tiles into a ring
  of ``STAGES`` shared-memory slots, each slot with "ready" and "empty" mbarriers for K and for V
  (the consumers release a K once S = Q·Kᵀ has read it, a V once P·V has);
- two consumer warp groups (4 warps each) own ``BLOCK_M`` query rows each (the program covers
  ``2·BLOCK_M`` rows) and walk the same key blocks: S = Q·Kᵀ and O += P·V on the tensor cores
  (``warpgroup_mma``, P from registers), online softmax in base 2 with the scale folded in,
  normalisation deferred to the end;
- with ``PINGPONG`` the two groups take turns issuing their matrix products (a pair of
  mbarriers passes the turn), so that one group's softmax runs while the other's products occupy
  the tensor cores;
- the producer runs with few registers and the consumers with many (``warp_specialize``'s
  register requests, lowered to ``setmaxnreg``).

``CAUSAL`` (``Lq == Lk``, ``BLOCK_N == 2·BLOCK_M``): the key blocks before the program's diagonal
block are full; the diagonal block is one masked step at the end. Programs are launched longest
first.

``INTERVAL``: every query row keeps one key interval ``[LO[r], HI[r])`` (windows, documents made of
contiguous runs, their intersections with ``causal()``: ``compiler/intervals.py``). A program
visits one contiguous range of key blocks from a small per-program table (built on the host once
per layout, heaviest programs first); blocks that every row of the program keeps whole run the
unmasked step, the others compare each key with the row's two bounds (held in registers). Rows
that keep nothing give O = 0 and LSE = -inf, as ``kernels/forward.py``.

``GLOBAL_KEYS`` ``g`` (interval mode): every row also keeps the first ``g`` keys (attention sinks
beside a band, ``compiler/globals.py``): each item visits their block(s) first, masked by ``k < g``
(``GLOBAL_CAUSAL``: and ``k <=`` the row), then its band, so that one pass computes both.

``PERSISTENT``: a grid of about one program per SM, each walking work items (a query tile of one
head) ``pid, pid + grid, ...`` as FlashAttention-3's persistent scheduler does; the producer loads
the next item's Q and first K/V tiles while the consumers finish the current one, and O leaves
through its own staging tile. Short items (windows, documents: ~10 key blocks each) otherwise pay
a program's start and end on every tile.

Output: ``O`` in Q's dtype and ``LSE`` (natural log, float32, ``(B·H, Lq)`` flat), as
``kernels/forward.py`` writes them. Rows past ``Lq`` are computed on zero-filled Q rows and
clipped by the TMA store; ``Lk`` must be a multiple of ``BLOCK_N``.

Gluon does not run in Triton's CPU interpreter and its API changes between Triton releases:
:func:`gluon_available` says whether this module could define the kernel; the launcher
(``ops/triton_backend.py``) uses the kernel where ``ops/select.choose_forward`` picks it.
"""

from __future__ import annotations

try:  # Gluon is experimental: absent from older Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    # the TMA copies were renamed after triton 3.6 (async_load / async_store)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _tma_reduce_add = getattr(tma, "async_atomic_add", None)
    if _tma_reduce_add is None:  # triton 3.6: the builder op exists, the Python wrapper does not
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            """TMA reduce-add of the shared tile ``src`` into ``tensor_desc`` at ``coord``
            (``cp.reduce.async.bulk.tensor .add``); completion is awaited like a TMA store
            (``tma.store_wait``) before ``src`` is written again."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)
    _IMPORT_ERROR = None
except Exception as e:  # pragma: no cover - depends on the installed Triton
    gluon = gl = None
    _IMPORT_ERROR = e

__all__ = ["gluon_available", "GLUON_IMPORT_ERROR"]

GLUON_IMPORT_ERROR = _IMPORT_ERROR
_LN2 = 0.6931471805599453


def gluon_available() -> bool:
    """Whether the installed Triton provides the Gluon Hopper API this kernel is written against."""
    return gluon is not None


if gluon is not None:

    @gluon.jit
    def _rows_desc(base, stride_b, stride_h, stride_m, b, h, rb, rh, ch, n_b, n_h, length,
                   PERSISTENT: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, layout: gl.constexpr):
        """A descriptor of ``(BLOCK, HEAD_DIM)`` tiles: over batch·head ``(b, h)`` of a ``(B, H, L, D)``
        tensor (``length`` rows, past them clipped), or with ``PERSISTENT`` over the whole tensor as a
        2-D row view (batch·head ``(b, h)`` at rows ``b·rb + h·rh ..``, columns ``h·ch ..``)."""
        if PERSISTENT:
            return tma.make_tensor_descriptor(base, shape=[(n_b - 1) * rb + (n_h - 1) * rh + length,
                                                           (n_h - 1) * ch + HEAD_DIM], strides=[stride_m, 1],
                                              block_shape=[BLOCK, HEAD_DIM], layout=layout)
        else:
            return tma.make_tensor_descriptor(base + b * stride_b + h * stride_h, shape=[length, HEAD_DIM],
                                              strides=[stride_m, 1], block_shape=[BLOCK, HEAD_DIM], layout=layout)

    @gluon.jit
    def _item_tile(t, n_prog, BH, M_MAJOR: gl.constexpr):
        """``(pid_m, pid_bh)`` of work item ``t`` out of ``BH·n_prog``: head by head (``pid_m``
        fastest) or, with ``M_MAJOR``, one row tile of every head before the next, dealt to the
        programs in a snake order (every second complete pass over the grid's programs runs in
        reverse), so that a program that drew a long tile draws a short one next."""
        if M_MAJOR:
            n_grid = gl.num_programs(0)
            sweep = t // n_grid
            if (sweep % 2 == 1) & ((sweep + 1) * n_grid <= BH * n_prog):
                t = sweep * n_grid + (n_grid - 1 - t % n_grid)
            pid_m = t // BH
            pid_bh = t % BH
        else:
            pid_m = t % n_prog
            pid_bh = t // n_prog
        return pid_m, pid_bh

    @gluon.jit
    def _n_dealt(DEAL, first, n_items, DEALT: gl.constexpr):
        """How many work items persistent program ``first`` runs: ``DEAL[1 + first]`` from a deal
        table (``DEALT``), else every grid-th item from ``first`` on."""
        if DEALT:
            n = gl.load(DEAL + 1 + first)
        else:
            n = (n_items - first + gl.num_programs(0) - 1) // gl.num_programs(0)
        return n

    @gluon.jit
    def _dealt(DEAL, first, k, DEALT: gl.constexpr):
        """The ``k``-th work item of persistent program ``first``: from a deal table (``DEALT``:
        ``DEAL = [W, count per program, W items per program]``, built on the host to balance items of
        unequal work, ``ops/triton_backend._deal_table``), else ``first + k·grid``."""
        if DEALT:
            t = gl.load(DEAL + 1 + gl.num_programs(0) + first * gl.load(DEAL) + k)
        else:
            t = first + k * gl.num_programs(0)
        return t

    @gluon.jit
    def _step_base(TAB, kb0, j, LIST: gl.constexpr):
        """The block index ``x`` with ``x + j`` the key (or query) block of step ``j``: ``kb0`` where an
        item visits a contiguous range, else from the item's list (``LIST``: ``TAB[kb0 + j]`` below
        bit 24; the bits above are the backward consumers' skip flags, ``compiler/block_lists.py``)."""
        if LIST:
            x = (gl.load(TAB + kb0 + j) & 0xFFFFFF) - j
        else:
            x = kb0
        return x

    @gluon.jit
    def _step_key(TAB, kb0, kbase, j, LIST: gl.constexpr, BLOCK_N: gl.constexpr):
        """The key offset ``x`` with ``x + j·BLOCK_N`` the first key of step ``j``: ``kbase`` where an
        item visits a contiguous range of keys, else from the item's list (:func:`_step_base`)."""
        if LIST:
            x = _step_base(TAB, kb0, j, LIST) * BLOCK_N
        else:
            x = kbase
        return x

    @gluon.jit
    def _in_rows(n2, lo, hi, AXIS: gl.constexpr):
        """Whether keys ``n2`` (2-D, broadcast along ``AXIS``) lie in their rows' intervals: ``lo``/``hi``
        int32 one interval per row, or int64 two (low and high 32 bits: ``[lo, hi)`` each)."""
        if lo.dtype == gl.int64:
            lo1 = gl.expand_dims(lo.to(gl.int32), AXIS)
            hi1 = gl.expand_dims(hi.to(gl.int32), AXIS)
            lo2 = gl.expand_dims((lo >> 32).to(gl.int32), AXIS)
            hi2 = gl.expand_dims((hi >> 32).to(gl.int32), AXIS)
            keep = ((n2 >= lo1) & (n2 < hi1)) | ((n2 >= lo2) & (n2 < hi2))
        else:
            keep = (n2 >= gl.expand_dims(lo, AXIS)) & (n2 < gl.expand_dims(hi, AXIS))
        return keep

    @gluon.jit
    def _fwd_item(t, TILES, n_prog, H, BH, LZB, LZH, q_len, kv_len, CAUSAL: gl.constexpr, INTERVAL: gl.constexpr,
                  M_MAJOR: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUPS: gl.constexpr,
                  SEGMENTS: gl.constexpr):
        """Work item ``t``: ``(pid_bh, off_m, kb0, k0, n_full, e1, e2, n_blocks, row_base, row_end)``, in
        :func:`_item_tile`'s order (with ``M_MAJOR`` the longest first: interval tables are sorted
        heaviest first). An item is ``GROUPS·BLOCK_M`` query rows from ``off_m``, of which it writes
        those below ``row_end``; its steps' keys start at ``k0`` (``kb0·BLOCK_N`` but with
        ``SEGMENTS``); causal: the key blocks below every row of the item are full (``n_full``),
        the rest up to its last row's are masked. ``SEGMENTS``: item ``t`` is record ``t`` of the
        segment table (``_attn_fwd_gluon``)."""
        ROWS: gl.constexpr = GROUPS * BLOCK_M
        row_end = q_len
        if SEGMENTS:
            rec = TILES + 8 + t.to(gl.int64) * 8
            pid_bh = gl.load(rec)
            z = (pid_bh // H) * LZB + (pid_bh % H) * LZH
            row_base = z.to(gl.int64) * (n_prog * ROWS)
            off_m = gl.load(rec + 1)
            k0 = gl.load(rec + 2)
            e1 = gl.load(rec + 3)
            e2 = gl.load(rec + 4)
            n_blocks = gl.load(rec + 5)
            row_end = gl.load(rec + 6)
            kb0 = 0
            n_full = n_blocks
        else:
            pid_m, pid_bh = _item_tile(t, n_prog, BH, M_MAJOR)
            if CAUSAL:  # longest rows first
                pid_m = n_prog - 1 - pid_m
            if INTERVAL:
                z = (pid_bh // H) * LZB + (pid_bh % H) * LZH
                row_base = z.to(gl.int64) * (n_prog * ROWS)
                tab = TILES + (z.to(gl.int64) * n_prog + pid_m) * 5
                off_m = gl.load(tab) * ROWS
                kb0 = gl.load(tab + 1)
                e1 = gl.load(tab + 2)
                e2 = gl.load(tab + 3)
                n_blocks = gl.load(tab + 4)
                n_full = n_blocks
            else:
                row_base = 0
                off_m = pid_m * ROWS
                kb0 = 0
                if CAUSAL:
                    if GROUPS == 2:  # BLOCK_N == ROWS: the key blocks before the diagonal one, then it
                        n_full = pid_m
                        n_blocks = pid_m + 1
                    else:
                        n_full = off_m // BLOCK_N
                        n_blocks = gl.minimum((off_m + ROWS + BLOCK_N - 1) // BLOCK_N, kv_len // BLOCK_N)
                else:
                    n_full = kv_len // BLOCK_N
                    n_blocks = n_full
                e1 = n_blocks
                e2 = n_blocks
            k0 = kb0 * BLOCK_N
        return pid_bh, off_m, kb0, k0, n_full, e1, e2, n_blocks, row_base, row_end

    @gluon.jit
    def _fwd_load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, g, k_row, v_row, k_col, v_col,
                     STAGES: gl.constexpr):
        """Ring position ``g``: K and V rows ``k_row`` / ``v_row`` into slot ``g % STAGES`` once the
        consumers have released it."""
        s = g % STAGES
        free = ((g // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(s), free)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        _tma_load(k_desc, [k_row, k_col], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), free)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        _tma_load(v_desc, [v_row, v_col], v_ready.index(s), v_smem.index(s))

    @gluon.jit
    def _fwd_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty,
                      v_empty, TILES, DEAL, q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, first, n_items,
                      n_prog, H, G, BH, LZB, LZH, kv_len,
                      CAUSAL: gl.constexpr, INTERVAL: gl.constexpr, M_MAJOR: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, N_PRE: gl.constexpr, LIST: gl.constexpr,
                      DEALT: gl.constexpr, GROUPS: gl.constexpr, SEGMENTS: gl.constexpr, Q_BUFS: gl.constexpr):
        """One warp: per work item the ``GROUPS`` consumers' Q tiles (into set ``it % Q_BUFS`` of the Q
        slots) (once the consumers have released the
        previous item's), then the global keys' ``N_PRE`` blocks ``0 ..`` (interval mode with global
        keys) and K/V tiles ``kb0 .. kb0 + n_blocks - 1`` through the ring. Ring positions count on
        across items (position ``g`` uses slot ``g % STAGES``); with ``LIST`` step ``j`` visits key
        block ``TILES[kb0 + j]``.

        ``*_rb``, ``*_rh``, ``*_ch``: where a batch·head's tiles lie in the descriptor's 2-D view
        (rows per batch, rows per head, columns per head; zeros where the descriptor covers one
        batch·head)."""
        rb = 0
        it = 0
        if SEGMENTS:  # the segment table's items that exist
            n_items = gl.load(TILES)
        for k in range(0, _n_dealt(DEAL, first, n_items, DEALT)):
            t = _dealt(DEAL, first, k, DEALT)
            pid_bh, off_m, kb0, k0, n_full, e1, e2, n_blocks, row_base, row_end = _fwd_item(
                t, TILES, n_prog, H, BH, LZB, LZH, 0, kv_len, CAUSAL, INTERVAL, M_MAJOR, BLOCK_M, BLOCK_N, GROUPS,
                SEGMENTS)
            b = pid_bh // H
            h = pid_bh % H
            hk = h // G
            q_row = b * q_rb + h * q_rh + off_m
            k_row = b * k_rb + hk * k_rh + k0
            v_row = b * v_rb + hk * v_rh + k0
            for c in gl.static_range(GROUPS):
                # a fresh barrier counts as having completed the phase before its first: the first
                # wait on parity 1 does not block
                qs = (it % Q_BUFS) * GROUPS + c
                mbarrier.wait(q_empty.index(qs), ((it // Q_BUFS) & 1) ^ 1)
                mbarrier.expect(q_bar.index(qs), q_desc.block_type.nbytes)
                _tma_load(q_desc, [q_row + c * BLOCK_M, h * q_ch], q_bar.index(qs), q_smem.index(qs))
            for j in gl.static_range(N_PRE):  # the global keys' blocks
                _fwd_load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, rb + j,
                             k_row - k0 + j * BLOCK_N, v_row - k0 + j * BLOCK_N, hk * k_ch, hk * v_ch, STAGES)
            if LIST:  # step j visits key block TILES[kb0 + j]
                k_row -= k0
                v_row -= k0
            for j in range(n_blocks):
                if LIST:
                    kb = gl.load(TILES + kb0 + j)
                else:
                    kb = j
                _fwd_load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, rb + N_PRE + j,
                             k_row + kb * BLOCK_N, v_row + kb * BLOCK_N, hk * k_ch, hk * v_ch, STAGES)
            rb += N_PRE + n_blocks
            it += 1

    @gluon.jit
    def _fwd_softmax(sc, m_i, l_i, off_m, kpos, lo_r, hi_r, qk_scale, MASK: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """Online softmax of the scores ``sc`` of the key block starting at key ``kpos``: ``(p, m_new, l_new, alpha)``.
        ``MASK``: 0 every key kept; 1 causal (the diagonal block: keys after the query dropped);
        2 interval (row ``r`` keeps keys ``lo_r[r] <= k < hi_r[r]``; a row may keep none of the
        block, or none so far, so the running max may be -inf); ``3 + 2·g + c``: the global keys
        ``k < g``, with ``c = 1`` only those ``<=`` the row."""
        if MASK == 0:
            m_new = gl.maximum(m_i, gl.max(sc, 1) * qk_scale)
            p = gl.exp2(sc * qk_scale - gl.expand_dims(m_new, 1))
            alpha = gl.exp2(m_i - m_new)
        else:
            offs_n = kpos + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            if MASK == 1:
                offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                keep = gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m, 1)
            elif MASK == 2:
                keep = _in_rows(gl.expand_dims(offs_n, 0), lo_r, hi_r, 1)
            else:
                offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                n2 = gl.expand_dims(offs_n, 0)
                m2 = gl.expand_dims(offs_m, 1)
                if (MASK - 3) % 2 == 1:
                    keep = (n2 < (MASK - 3) // 2) & (n2 <= m2)
                else:
                    keep = (n2 < (MASK - 3) // 2) & (m2 >= 0)
            sc = gl.where(keep, sc * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, 1))
            if MASK == 1:  # the diagonal key is always kept: m_new is finite
                m_use = m_new
            else:
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(sc - gl.expand_dims(m_use, 1))
            alpha = gl.exp2(m_i - m_use)
        return p, m_new, l_i * alpha + gl.sum(p, 1), alpha

    @gluon.jit
    def _fwd_step(acc, m_i, l_i, q, j, rb, tb, k0, off_m, lo_r, hi_r, k_smem, v_smem, k_ready, v_ready, k_empty,
                  v_empty, turn, qk_scale, C: gl.constexpr, MASK: gl.constexpr, PINGPONG: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  s_layout: gl.constexpr, o_layout: gl.constexpr, GROUPS: gl.constexpr):
        """Step ``j`` of a work item (keys ``k0 + j·BLOCK_N ..``, ring position ``rb + j``, turn ``tb + j``)
        for one consumer, in order: S = Q·Kᵀ, softmax, O += P·V, slot released."""
        s = (rb + j) % STAGES
        ph = ((rb + j) // STAGES) & 1
        mbarrier.wait(k_ready.index(s), ph)
        if PINGPONG:  # my turn to issue products: the other group has issued its previous step
            mbarrier.wait(turn.index(C), (tb + j) & 1)
        sc = warpgroup_mma(q, k_smem.index(s).permute((1, 0)),
                           gl.zeros([BLOCK_M, BLOCK_N], dtype=gl.float32, layout=s_layout), use_acc=False,
                           is_async=True)
        if PINGPONG:  # pass the turn: the other group issues while this one does its softmax
            mbarrier.arrive(turn.index((C + 1) % GROUPS))
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
        mbarrier.arrive(k_empty.index(s))
        p, m_i, l_i, alpha = _fwd_softmax(sc, m_i, l_i, off_m, k0 + j * BLOCK_N, lo_r, hi_r, qk_scale, MASK, BLOCK_M,
                                          BLOCK_N, s_layout)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p16 = gl.convert_layout(p.to(q.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
        mbarrier.wait(v_ready.index(s), ph)
        acc = warpgroup_mma(p16, v_smem.index(s), acc, is_async=True)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
        mbarrier.arrive(v_empty.index(s))
        return acc, m_i, l_i

    @gluon.jit
    def _fwd_step_overlap(acc, p16, m_i, l_i, q, j, rb, tb, k0, off_m, lo_r, hi_r, k_smem, v_smem, k_ready, v_ready,
                          k_empty, v_empty, turn, qk_scale, C: gl.constexpr, MASK: gl.constexpr, PINGPONG: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          s_layout: gl.constexpr, o_layout: gl.constexpr, GROUPS: gl.constexpr):
        """Ring position ``j`` overlapped with the end of position ``j - 1`` (FlashAttention-3's
        intra-group pipelining): S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1} issued together, softmax of S_j
        while the second product runs; returns O rescaled for P_j and P_j (as the next product's
        operand)."""
        g = rb + j
        s = g % STAGES
        sp = (g - 1) % STAGES
        mbarrier.wait(k_ready.index(s), (g // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(C), (tb + j) & 1)
        sc = warpgroup_mma(q, k_smem.index(s).permute((1, 0)),
                           gl.zeros([BLOCK_M, BLOCK_N], dtype=gl.float32, layout=s_layout), use_acc=False,
                           is_async=True)
        mbarrier.wait(v_ready.index(sp), ((g - 1) // STAGES) & 1)
        acc = warpgroup_mma(p16, v_smem.index(sp), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index((C + 1) % GROUPS))
        sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc, ))
        mbarrier.arrive(k_empty.index(s))
        p, m_i, l_i, alpha = _fwd_softmax(sc, m_i, l_i, off_m, k0 + j * BLOCK_N, lo_r, hi_r, qk_scale, MASK, BLOCK_M,
                                          BLOCK_N, s_layout)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
        mbarrier.arrive(v_empty.index(sp))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p16 = gl.convert_layout(p.to(q.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
        return acc, p16, m_i, l_i

    @gluon.jit
    def _fwd_first(q, rb, tb, k0, off_m, lo_r, hi_r, m_i, l_i, k_smem, k_ready, k_empty, turn, qk_scale,
                   C: gl.constexpr, MASK: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                   GROUPS: gl.constexpr):
        """Step 0 alone (the overlapped loop's start): S_0, its softmax, P_0 as an operand."""
        s = rb % STAGES
        mbarrier.wait(k_ready.index(s), (rb // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(C), tb & 1)
        sc = warpgroup_mma(q, k_smem.index(s).permute((1, 0)),
                           gl.zeros([BLOCK_M, BLOCK_N], dtype=gl.float32, layout=s_layout), use_acc=False,
                           is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index((C + 1) % GROUPS))
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
        mbarrier.arrive(k_empty.index(s))
        p, m_i, l_i, alpha = _fwd_softmax(sc, m_i, l_i, off_m, k0, lo_r, hi_r, qk_scale, MASK, BLOCK_M, BLOCK_N,
                                          s_layout)
        p16 = gl.convert_layout(p.to(q.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
        return p16, m_i, l_i

    @gluon.jit
    def _fwd_last(acc, p16, n_blocks, rb, tb, v_smem, v_ready, v_empty, turn, C: gl.constexpr, PINGPONG: gl.constexpr,
                  STAGES: gl.constexpr, GROUPS: gl.constexpr):
        """The overlapped loop's end: O += P·V of the last step ``n_blocks - 1``."""
        last = rb + n_blocks - 1
        sl = last % STAGES
        mbarrier.wait(v_ready.index(sl), (last // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(C), (tb + n_blocks) & 1)
        acc = warpgroup_mma(p16, v_smem.index(sl), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index((C + 1) % GROUPS))
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
        mbarrier.arrive(v_empty.index(sl))
        return acc

    @gluon.jit
    def _store_o(o_desc, o_buf, out, row, col, PERSISTENT: gl.constexpr):
        """O's tile through its staging tile and one TMA store (``PERSISTENT``: once the previous
        item's store has left the tile; otherwise ``o_buf`` is Q's slot, free once every product
        reading it has completed)."""
        if PERSISTENT:
            tma.store_wait(pendings=0)
        o_buf.store(out)
        fence_async_shared()
        _tma_store(o_desc, [row, col], o_buf)

    @gluon.jit
    def _store_rows_masked(O, stride_ob, stride_oh, stride_om, b, h, off_m, row_end, out, BLOCK_M: gl.constexpr,
                           HEAD_DIM: gl.constexpr, o_layout: gl.constexpr):
        """Rows ``off_m ..`` of ``out`` (registers) below ``row_end`` into ``O[b, h]``."""
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        ptr = (O + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
               + gl.expand_dims(offs_m.to(gl.int64) * stride_om, 1) + gl.expand_dims(offs_d, 0))
        gl.store(ptr, out, mask=gl.expand_dims(offs_m < row_end, 1))

    @gluon.jit
    def _fwd_consumer(o_desc, LSE, LO, HI, TILES, DEAL, q_smem, o_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                      v_ready, k_empty, v_empty, turn, o_rb, o_rh, o_ch, first, n_items, n_prog, H, BH, LZB, LZH, q_len,
                      kv_len, O, stride_ob, stride_oh, stride_om,
                      qk_scale, C: gl.constexpr, CAUSAL: gl.constexpr, INTERVAL: gl.constexpr,
                      M_MAJOR: gl.constexpr, PERSISTENT: gl.constexpr, PINGPONG: gl.constexpr,
                      OVERLAP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, GLOBAL_KEYS: gl.constexpr, GLOBAL_CAUSAL: gl.constexpr,
                      LIST: gl.constexpr, DEALT: gl.constexpr, GROUPS: gl.constexpr, SEGMENTS: gl.constexpr,
                      Q_BUFS: gl.constexpr):
        """Consumer ``C`` of ``GROUPS`` (a warp group): per work item, query rows ``off_m + C·BLOCK_M ..``.

        Dense / ``CAUSAL``: ``n_full`` full key blocks from block 0 (and, with ``CAUSAL``, the
        masked blocks up to the item's last row: the diagonal block where ``GROUPS·BLOCK_M ==
        BLOCK_N``; every consumer walks them all, so a row may keep nothing of a masked block, but
        never of block 0, which every row visits first). ``INTERVAL``: steps ``0 .. n_blocks - 1``
        visit key blocks ``kb0 ..``; step 0 and steps ``[1, e1)`` and ``[e2, n_blocks)`` are masked
        against each row's interval ``[LO[r], HI[r])`` (read once per item, ``row_base + r``),
        steps ``[e1, e2)`` are full for every row; with ``GLOBAL_KEYS`` ``g > 0`` the item first
        visits the global keys' ``N_PRE`` blocks ``0 ..``, keeping keys ``k < g`` (and ``k <=`` the
        row with ``GLOBAL_CAUSAL``): the band's steps then count from ``N_PRE``; with ``LIST`` step
        ``j`` visits key block ``TILES[kb0 + j]`` instead of ``kb0 + j``. Then O and LSE (rows that
        kept nothing: O = 0, LSE = -inf). Ring positions and ping-pong turns count on across items;
        the Q slot is released to the producer once the item's products are done, and with
        ``PERSISTENT`` O is staged in its own tile, whose TMA store completes while the next item
        runs. ``SEGMENTS``: the rows of a group from the item's ``row_end`` on belong to another item;
        such a group stores its rows below it from the registers (masked, O's strides).
        ``Q_BUFS`` 2 (persistent): two sets of Q slots taken in turn, so that the producer loads the
        next item's Q while this one runs; O is staged in the item's own Q slot, which is released
        at the start of the next item once the store has read it."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        N_PRE: gl.constexpr = (GLOBAL_KEYS + BLOCK_N - 1) // BLOCK_N
        PMASK: gl.constexpr = 3 + 2 * GLOBAL_KEYS + GLOBAL_CAUSAL  # the global keys' steps (_fwd_softmax)
        if PINGPONG:
            if C == 0:  # group 0 takes the first turn
                mbarrier.arrive(turn.index(0))
        rb = 0
        tb = 0
        it = 0
        if SEGMENTS:  # the segment table's items that exist
            n_items = gl.load(TILES)
        for k in range(0, _n_dealt(DEAL, first, n_items, DEALT)):
            t = _dealt(DEAL, first, k, DEALT)
            pid_bh, off_m0, kb0, k0, n_full, e1, e2, n_blocks, row_base, row_end = _fwd_item(
                t, TILES, n_prog, H, BH, LZB, LZH, q_len, kv_len, CAUSAL, INTERVAL, M_MAJOR, BLOCK_M, BLOCK_N, GROUPS,
                SEGMENTS)
            off_m = off_m0 + C * BLOCK_M
            qs = (it % Q_BUFS) * GROUPS + C
            q = q_smem.index(qs)
            if Q_BUFS == 2:
                o_buf = q_smem.index(qs)
                if it > 0:  # the previous item's O has left its Q slot: the producer may fill it again
                    tma.store_wait(pendings=0)
                    mbarrier.arrive(q_empty.index(((it - 1) % 2) * GROUPS + C))
            else:
                o_buf = o_smem.index(C)
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
            l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
            acc = gl.zeros([BLOCK_M, HEAD_DIM], dtype=gl.float32, layout=o_layout)
            if INTERVAL:  # the tables are padded to whole programs: no bounds check
                rows = row_base + off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                lo_r = gl.load(LO + rows)
                hi_r = gl.load(HI + rows)
            else:
                lo_r = off_m
                hi_r = off_m
            mbarrier.wait(q_bar.index(qs), (it // Q_BUFS) & 1)
            if INTERVAL:
                kbb = kb0 - N_PRE  # step j >= N_PRE visits key block kbb + j (lists: TILES[kbb + j])
                kbase = k0 - N_PRE * BLOCK_N  # ... whose keys start at kbase + j·BLOCK_N
                if OVERLAP:
                    if N_PRE > 0:  # the global keys' blocks first
                        p16, m_i, l_i = _fwd_first(q, rb, tb, 0, off_m, lo_r, hi_r, m_i, l_i, k_smem, k_ready, k_empty,
                                                   turn, qk_scale, C, PMASK, PINGPONG, BLOCK_M, BLOCK_N, STAGES,
                                                   s_layout, o_layout, GROUPS)
                        for j in range(1, N_PRE):
                            acc, p16, m_i, l_i = _fwd_step_overlap(acc, p16, m_i, l_i, q, j, rb, tb, 0, off_m, lo_r,
                                                                   hi_r, k_smem, v_smem, k_ready, v_ready, k_empty,
                                                                   v_empty, turn, qk_scale, C, PMASK, PINGPONG, BLOCK_M,
                                                                   BLOCK_N, STAGES, s_layout, o_layout, GROUPS)
                        for j in range(N_PRE, N_PRE + e1):
                            kbj = _step_key(TILES, kbb, kbase, j, LIST, BLOCK_N)
                            acc, p16, m_i, l_i = _fwd_step_overlap(acc, p16, m_i, l_i, q, j, rb, tb, kbj, off_m, lo_r,
                                                                   hi_r, k_smem, v_smem, k_ready, v_ready, k_empty,
                                                                   v_empty, turn, qk_scale, C, 2, PINGPONG, BLOCK_M,
                                                                   BLOCK_N, STAGES, s_layout, o_layout, GROUPS)
                    else:
                        kbj = _step_key(TILES, kb0, kbase, 0, LIST, BLOCK_N)
                        p16, m_i, l_i = _fwd_first(q, rb, tb, kbj, off_m, lo_r, hi_r, m_i, l_i, k_smem, k_ready,
                                                   k_empty, turn, qk_scale, C, 2, PINGPONG, BLOCK_M, BLOCK_N, STAGES,
                                                   s_layout, o_layout, GROUPS)
                        for j in range(1, e1):
                            kbj = _step_key(TILES, kb0, kbase, j, LIST, BLOCK_N)
                            acc, p16, m_i, l_i = _fwd_step_overlap(acc, p16, m_i, l_i, q, j, rb, tb, kbj, off_m, lo_r,
                                                                   hi_r, k_smem, v_smem, k_ready, v_ready, k_empty,
                                                                   v_empty, turn, qk_scale, C, 2, PINGPONG, BLOCK_M,
                                                                   BLOCK_N, STAGES, s_layout, o_layout, GROUPS)
                    for j in range(N_PRE + e1, N_PRE + e2):
                        acc, p16, m_i, l_i = _fwd_step_overlap(acc, p16, m_i, l_i, q, j, rb, tb, kbase, off_m, lo_r,
                                                               hi_r, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                                                               turn, qk_scale, C, 0, PINGPONG, BLOCK_M, BLOCK_N,
                                                               STAGES, s_layout, o_layout, GROUPS)
                    for j in range(N_PRE + e2, N_PRE + n_blocks):
                        kbj = _step_key(TILES, kbb, kbase, j, LIST, BLOCK_N)
                        acc, p16, m_i, l_i = _fwd_step_overlap(acc, p16, m_i, l_i, q, j, rb, tb, kbj, off_m, lo_r, hi_r,
                                                               k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
                                                               qk_scale, C, 2, PINGPONG, BLOCK_M, BLOCK_N, STAGES,
                                                               s_layout, o_layout, GROUPS)
                    acc = _fwd_last(acc, p16, N_PRE + n_blocks, rb, tb, v_smem, v_ready, v_empty, turn, C, PINGPONG,
                                    STAGES, GROUPS)
                else:
                    for j in range(0, N_PRE):
                        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, j, rb, tb, 0, off_m, lo_r, hi_r, k_smem, v_smem,
                                                  k_ready, v_ready, k_empty, v_empty, turn, qk_scale, C, PMASK,
                                                  PINGPONG, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, GROUPS)
                    for j in range(N_PRE, N_PRE + e1):
                        kbj = _step_key(TILES, kbb, kbase, j, LIST, BLOCK_N)
                        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, j, rb, tb, kbj, off_m, lo_r, hi_r, k_smem, v_smem,
                                                  k_ready, v_ready, k_empty, v_empty, turn, qk_scale, C, 2, PINGPONG,
                                                  BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, GROUPS)
                    for j in range(N_PRE + e1, N_PRE + e2):
                        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, j, rb, tb, kbase, off_m, lo_r, hi_r, k_smem, v_smem,
                                                  k_ready, v_ready, k_empty, v_empty, turn, qk_scale, C, 0, PINGPONG,
                                                  BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, GROUPS)
                    for j in range(N_PRE + e2, N_PRE + n_blocks):
                        kbj = _step_key(TILES, kbb, kbase, j, LIST, BLOCK_N)
                        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, j, rb, tb, kbj, off_m, lo_r, hi_r, k_smem, v_smem,
                                                  k_ready, v_ready, k_empty, v_empty, turn, qk_scale, C, 2, PINGPONG,
                                                  BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, GROUPS)
            elif OVERLAP:
                # block 0 alone (masked when causal: the predicate is exact on any block), then blocks
                # 1 .. n-1 each overlapped with the previous one's P·V (causal: the blocks from n_full on
                # masked), then the last P·V
                p16, m_i, l_i = _fwd_first(q, rb, tb, 0, off_m, lo_r, hi_r, m_i, l_i, k_smem, k_ready, k_empty, turn,
                                           qk_scale, C, CAUSAL, PINGPONG, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout,
                                           GROUPS)
                for j in range(1, n_full):
                    acc, p16, m_i, l_i = _fwd_step_overlap(acc, p16, m_i, l_i, q, j, rb, tb, 0, off_m, lo_r, hi_r,
                                                           k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
                                                           qk_scale, C, 0, PINGPONG, BLOCK_M, BLOCK_N, STAGES,
                                                           s_layout, o_layout, GROUPS)
                if CAUSAL:
                    if GROUPS == 2:  # the diagonal block, unless it was block 0
                        if n_full > 0:
                            acc, p16, m_i, l_i = _fwd_step_overlap(acc, p16, m_i, l_i, q, n_full, rb, tb, 0, off_m,
                                                                   lo_r, hi_r, k_smem, v_smem, k_ready, v_ready,
                                                                   k_empty, v_empty, turn, qk_scale, C, 1, PINGPONG,
                                                                   BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, GROUPS)
                    else:
                        for j in range(gl.maximum(n_full, 1), n_blocks):
                            acc, p16, m_i, l_i = _fwd_step_overlap(acc, p16, m_i, l_i, q, j, rb, tb, 0, off_m, lo_r,
                                                                   hi_r, k_smem, v_smem, k_ready, v_ready, k_empty,
                                                                   v_empty, turn, qk_scale, C, 1, PINGPONG, BLOCK_M,
                                                                   BLOCK_N, STAGES, s_layout, o_layout, GROUPS)
                acc = _fwd_last(acc, p16, n_blocks, rb, tb, v_smem, v_ready, v_empty, turn, C, PINGPONG, STAGES, GROUPS)
            else:
                for j in range(n_full):
                    acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, j, rb, tb, 0, off_m, lo_r, hi_r, k_smem, v_smem,
                                              k_ready, v_ready, k_empty, v_empty, turn, qk_scale, C, 0, PINGPONG,
                                              BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, GROUPS)
                if CAUSAL:
                    if GROUPS == 2:
                        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, n_full, rb, tb, 0, off_m, lo_r, hi_r, k_smem,
                                                  v_smem, k_ready, v_ready, k_empty, v_empty, turn, qk_scale, C, 1,
                                                  PINGPONG, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, GROUPS)
                    else:
                        for j in range(n_full, n_blocks):
                            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, j, rb, tb, 0, off_m, lo_r, hi_r, k_smem,
                                                      v_smem, k_ready, v_ready, k_empty, v_empty, turn, qk_scale, C,
                                                      1, PINGPONG, BLOCK_M, BLOCK_N, STAGES, s_layout, o_layout, GROUPS)
            if PERSISTENT and Q_BUFS == 1:  # every product reading Q has completed: the producer may load
                mbarrier.arrive(q_empty.index(C))  # the next item's
            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            if INTERVAL:  # rows that kept nothing: O = 0 and LSE = -inf, as kernels/forward.py writes them
                out = gl.where(gl.expand_dims(l_o == 0.0, 1), 0.0,
                               acc / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1))
            else:
                out = acc / gl.expand_dims(l_o, 1)
            pid_b = pid_bh // H
            pid_h = pid_bh % H
            if SEGMENTS:
                if off_m + BLOCK_M > row_end:  # rows from row_end on are another item's
                    _store_rows_masked(O, stride_ob, stride_oh, stride_om, pid_b, pid_h, off_m, row_end,
                                       out.to(q.dtype), BLOCK_M, HEAD_DIM, o_layout)
                else:
                    _store_o(o_desc, o_buf, out.to(q.dtype), pid_b * o_rb + pid_h * o_rh + off_m, pid_h * o_ch,
                             PERSISTENT)
            else:
                _store_o(o_desc, o_buf, out.to(q.dtype), pid_b * o_rb + pid_h * o_rh + off_m, pid_h * o_ch,
                         PERSISTENT)
            offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            if INTERVAL:
                empty = l_i == 0.0
                lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
            else:
                lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
            gl.store(LSE + pid_bh.to(gl.int64) * q_len + offs_m, lse, mask=offs_m < row_end)
            rb += N_PRE + n_blocks
            tb += N_PRE + n_blocks + OVERLAP
            it += 1
        tma.store_wait(pendings=0)

    @gluon.jit(do_not_specialize=["q_len", "kv_len", "n_prog", "n_items", "q_rb", "q_rh", "q_ch", "k_rb", "k_rh",
                                  "k_ch", "v_rb", "v_rh", "v_ch", "o_rb", "o_rh", "o_ch"])
    def _attn_fwd_gluon(Q, K, V, O, LSE, LO, HI, TILES, DEAL,
                        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                        H, G, LZB, LZH, q_len, kv_len, n_prog, n_items, qk_scale,
                        q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, o_rb, o_rh, o_ch,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, INTERVAL: gl.constexpr, PINGPONG: gl.constexpr,
                        OVERLAP: gl.constexpr, PERSISTENT: gl.constexpr, M_MAJOR: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, GLOBAL_KEYS: gl.constexpr = 0,
                        GLOBAL_CAUSAL: gl.constexpr = False, LIST: gl.constexpr = False,
                        DEALT: gl.constexpr = False, GROUPS: gl.constexpr = 2, SEGMENTS: gl.constexpr = False,
                        Q_BUFS: gl.constexpr = 1):
        """1-D grid, 4 warps (consumer 0) plus ``GROUPS - 1`` more 4-warp consumers and a 1-warp
        producer; an item is ``GROUPS·BLOCK_M`` query rows (``GROUPS`` 2, or 3 but for lists:
        FlashAttention-3's 192-row tiles at head dim 64, where a step's products are short beside
        its softmax).
        ``Q (B, H, Lq, D)``, ``K/V (B, H // G, Lk, D)``, ``O`` like Q; ``qk_scale = scale · log2(e)``.
        Work items: ``n_prog = cdiv(Lq, GROUPS·BLOCK_M)`` query tiles of each of the ``B·H`` heads
        (``n_items``); program ``p`` runs items ``p, p + grid, ...``.

        Without ``PERSISTENT`` the grid is ``n_items`` (one item per program, head by head), and
        each program builds descriptors over its batch·head (rows past ``Lq`` clipped). With
        ``PERSISTENT`` (``Lq`` a multiple of ``GROUPS·BLOCK_M``) the grid is about one program per SM:
        the descriptors cover whole tensors as 2-D ``(rows, columns)`` views built once per program,
        where batch·head ``(b, h)``'s rows start at ``b·*_rb + h·*_rh`` and its columns at
        ``h·*_ch`` (``*_rb``: Q, K, V and O's rows per batch, and so on), and causal and interval
        items run, with ``M_MAJOR``, one query tile of every head at a time (else head by head); the producer loads
        an item's Q and first K/V while the consumers finish the item before.

        ``INTERVAL``: row ``r`` of layout instance ``z = b·LZB + h·LZH`` keeps keys
        ``LO[z, r] <= k < HI[z, r]`` (int32 ``(Z, P·2·BLOCK_M)`` for ``P`` programs per head);
        ``TILES`` (int32 ``(Z, P, 5)``, heaviest programs first) gives tile ``pid`` its
        ``(tile, kb0, e1, e2, n_blocks)``: query rows ``tile·2·BLOCK_M ..``, key blocks
        ``kb0 .. kb0 + n_blocks - 1`` of which steps ``[e1, e2)`` are full for every row
        (``1 <= e1 <= e2 <= n_blocks``, ``n_blocks >= 1``). Otherwise LO/HI/TILES are not read.

        ``GLOBAL_KEYS`` ``g > 0`` (interval mode): every row also keeps the keys ``k < g`` (with
        ``GLOBAL_CAUSAL`` those ``<=`` the row), visited as the first ``cdiv(g, BLOCK_N)`` steps of
        every item; the band's intervals must not hold them (``compiler/globals.py``).

        ``LIST`` (interval mode): an item's key blocks are a list, not a range: ``kb0`` is an offset
        into ``TILES`` (whose entries after the programs' rows hold the lists), step ``j`` visits key
        block ``TILES[kb0 + j]``, steps ``[e1, e2)`` are full for every row and the others are masked
        against the rows' intervals, exact on those blocks (``compiler/block_lists.py``). ``LO``/``HI``
        int64 hold two intervals per row (low and high 32 bits). ``DEALT`` (persistent): each program
        runs the items its row of the deal table ``DEAL`` lists (:func:`_dealt`).

        ``SEGMENTS`` (persistent interval mode): items are not the aligned row tiles but the records of
        ``TILES`` (int32: ``TILES[0]`` items, then 8 ints per item from ``TILES[8]``: ``(pid_bh,
        row0, key0, e1, e2, n_blocks, row_end, 0)``, heaviest first), so that a tile can start
        where a run of rows with their own keys starts (a document: FlashAttention's variable-length
        tiles): rows ``row0 .. row0 + GROUPS·BLOCK_M - 1`` visit keys ``key0 + j·BLOCK_N ..`` for
        ``j < n_blocks`` (steps ``[e1, e2)`` full for every row below ``row_end``), and write the
        rows below ``row_end``. ``LO``/``HI`` are ``(Z, n_prog·2·BLOCK_M)``, rows past ``Lq`` keeping
        nothing (``compiler/device_intervals.gluon_segment_tables``).

        ``Q_BUFS`` 2 (persistent): two sets of Q slots, the next item's Q loaded while the current
        item runs, O staged in the item's Q slot (no staging tiles of its own: the same shared
        memory as one set)."""
        gl.static_assert(GROUPS == 2 or GROUPS == 3, "two or three consumer groups")
        gl.static_assert(GROUPS == 2 or not LIST, "the list tables are built for two consumer groups")
        gl.static_assert(not CAUSAL or GROUPS != 2 or BLOCK_N == 2 * BLOCK_M, "causal needs BLOCK_N == 2 * BLOCK_M")
        gl.static_assert(not (CAUSAL and INTERVAL), "CAUSAL and INTERVAL exclude each other")
        gl.static_assert(GLOBAL_KEYS == 0 or INTERVAL, "global keys need the interval mode")
        gl.static_assert(not LIST or (INTERVAL and GLOBAL_KEYS == 0), "lists need the interval mode, no global keys")
        gl.static_assert(Q_BUFS == 1 or (Q_BUFS == 2 and PERSISTENT), "two sets of Q slots need a persistent grid")
        gl.static_assert(not SEGMENTS or (INTERVAL and PERSISTENT and not LIST and not DEALT and GLOBAL_KEYS == 0),
                         "segments need the persistent interval mode without lists, deal tables or global keys")
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
        q_desc = _rows_desc(Q, stride_qb, stride_qh, stride_qm, b, h, q_rb, q_rh, q_ch, n_b, H, q_len, PERSISTENT,
                            HEAD_DIM, BLOCK_M, q_layout)
        k_desc = _rows_desc(K, stride_kb, stride_kh, stride_kn, b, hk, k_rb, k_rh, k_ch, n_b, n_hk, kv_len,
                            PERSISTENT, HEAD_DIM, BLOCK_N, kv_layout)
        v_desc = _rows_desc(V, stride_vb, stride_vh, stride_vn, b, hk, v_rb, v_rh, v_ch, n_b, n_hk, kv_len,
                            PERSISTENT, HEAD_DIM, BLOCK_N, kv_layout)
        o_desc = _rows_desc(O, stride_ob, stride_oh, stride_om, b, h, o_rb, o_rh, o_ch, n_b, H, q_len, PERSISTENT,
                            HEAD_DIM, BLOCK_M, q_layout)
        q_smem = gl.allocate_shared_memory(dtype, [Q_BUFS * GROUPS, BLOCK_M, HEAD_DIM], q_layout)
        if PERSISTENT and Q_BUFS == 1:
            o_smem = gl.allocate_shared_memory(dtype, [GROUPS, BLOCK_M, HEAD_DIM], q_layout)
        else:  # O staged in the item's Q slot
            o_smem = q_smem
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [Q_BUFS * GROUPS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS * GROUPS, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [GROUPS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(Q_BUFS * GROUPS):
            mbarrier.init(q_bar.index(c), count=1)
            mbarrier.init(q_empty.index(c), count=1)
        for c in gl.static_range(GROUPS):
            mbarrier.init(turn.index(c), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(k_empty.index(s), count=GROUPS)  # every consumer releases a slot's K ...
            mbarrier.init(v_empty.index(s), count=GROUPS)  # ... and its V
        fence_async_shared()
        if not PERSISTENT:  # coordinates relative to the item's batch·head
            q_rb = 0
            q_rh = 0
            q_ch = 0
            k_rb = 0
            k_rh = 0
            k_ch = 0
            v_rb = 0
            v_rh = 0
            v_ch = 0
            o_rb = 0
            o_rh = 0
            o_ch = 0
        first = gl.program_id(0)
        # the argument tuples are written out in each list: a tuple built by concatenation reaches
        # the partitions with its constexprs turned into runtime values (triton 3.6)
        if GROUPS == 3:
            gl.warp_specialize([
                (_fwd_consumer,
                 (o_desc, LSE, LO, HI, TILES, DEAL, q_smem, o_smem, k_smem, v_smem, q_bar, q_empty,
                 k_ready, v_ready, k_empty, v_empty, turn, o_rb, o_rh, o_ch, first, n_items, n_prog, H, BH, LZB, LZH,
                 q_len, kv_len, O, stride_ob, stride_oh, stride_om, qk_scale, 0, CAUSAL, INTERVAL, M_MAJOR,
                 PERSISTENT, PINGPONG, OVERLAP, HEAD_DIM,
                 BLOCK_M, BLOCK_N, STAGES, GLOBAL_KEYS, GLOBAL_CAUSAL, LIST, DEALT, GROUPS, SEGMENTS, Q_BUFS)),
                (_fwd_consumer,
                 (o_desc, LSE, LO, HI, TILES, DEAL, q_smem, o_smem, k_smem, v_smem, q_bar, q_empty,
                 k_ready, v_ready, k_empty, v_empty, turn, o_rb, o_rh, o_ch, first, n_items, n_prog, H, BH, LZB, LZH,
                 q_len, kv_len, O, stride_ob, stride_oh, stride_om, qk_scale, 1, CAUSAL, INTERVAL, M_MAJOR,
                 PERSISTENT, PINGPONG, OVERLAP, HEAD_DIM,
                 BLOCK_M, BLOCK_N, STAGES, GLOBAL_KEYS, GLOBAL_CAUSAL, LIST, DEALT, GROUPS, SEGMENTS, Q_BUFS)),
                (_fwd_consumer,
                 (o_desc, LSE, LO, HI, TILES, DEAL, q_smem, o_smem, k_smem, v_smem, q_bar, q_empty,
                 k_ready, v_ready, k_empty, v_empty, turn, o_rb, o_rh, o_ch, first, n_items, n_prog, H, BH, LZB, LZH,
                 q_len, kv_len, O, stride_ob, stride_oh, stride_om, qk_scale, 2, CAUSAL, INTERVAL, M_MAJOR,
                 PERSISTENT, PINGPONG, OVERLAP, HEAD_DIM,
                 BLOCK_M, BLOCK_N, STAGES, GLOBAL_KEYS, GLOBAL_CAUSAL, LIST, DEALT, GROUPS, SEGMENTS, Q_BUFS)),
                (_fwd_producer,
                 (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                 TILES, DEAL, q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, first, n_items, n_prog, H, G, BH,
                 LZB, LZH, kv_len, CAUSAL, INTERVAL, M_MAJOR, BLOCK_M, BLOCK_N, STAGES,
                 (GLOBAL_KEYS + BLOCK_N - 1) // BLOCK_N, LIST, DEALT, GROUPS, SEGMENTS, Q_BUFS)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_fwd_consumer,
                 (o_desc, LSE, LO, HI, TILES, DEAL, q_smem, o_smem, k_smem, v_smem, q_bar, q_empty,
                 k_ready, v_ready, k_empty, v_empty, turn, o_rb, o_rh, o_ch, first, n_items, n_prog, H, BH, LZB, LZH,
                 q_len, kv_len, O, stride_ob, stride_oh, stride_om, qk_scale, 0, CAUSAL, INTERVAL, M_MAJOR,
                 PERSISTENT, PINGPONG, OVERLAP, HEAD_DIM,
                 BLOCK_M, BLOCK_N, STAGES, GLOBAL_KEYS, GLOBAL_CAUSAL, LIST, DEALT, GROUPS, SEGMENTS, Q_BUFS)),
                (_fwd_consumer,
                 (o_desc, LSE, LO, HI, TILES, DEAL, q_smem, o_smem, k_smem, v_smem, q_bar, q_empty,
                 k_ready, v_ready, k_empty, v_empty, turn, o_rb, o_rh, o_ch, first, n_items, n_prog, H, BH, LZB, LZH,
                 q_len, kv_len, O, stride_ob, stride_oh, stride_om, qk_scale, 1, CAUSAL, INTERVAL, M_MAJOR,
                 PERSISTENT, PINGPONG, OVERLAP, HEAD_DIM,
                 BLOCK_M, BLOCK_N, STAGES, GLOBAL_KEYS, GLOBAL_CAUSAL, LIST, DEALT, GROUPS, SEGMENTS, Q_BUFS)),
                (_fwd_producer,
                 (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                 TILES, DEAL, q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, first, n_items, n_prog, H, G, BH,
                 LZB, LZH, kv_len, CAUSAL, INTERVAL, M_MAJOR, BLOCK_M, BLOCK_N, STAGES,
                 (GLOBAL_KEYS + BLOCK_N - 1) // BLOCK_N, LIST, DEALT, GROUPS, SEGMENTS, Q_BUFS)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
