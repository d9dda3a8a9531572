"""Building blocks of generated predicates (imported by the generated modules).

Parameters arrive at run time, so a ``% s`` or ``// c`` would be a real integer division on every
element of a partial tile — slow on GPUs. A scalar power-of-two stride, chunk, summary stride or
period selects a template of masks and shifts instead (``*_pow2`` in
:mod:`blocksparse_fa.kernels.predicate`); the helpers below serve the other values and per-(batch,
head) parameters (``strided_keep``, ``chunked_keep`` and ``summary_keep`` with a uniform branch to
shifts and masks when a per-head value is a power of two).
"""

import triton
import triton.language as tl


@triton.jit
def strided_keep(qp, kj, s):
    """``(qp - kj) % s == 0``."""
    d = qp - kj
    if (s & (s - 1)) == 0:
        r = (d & (s - 1)) == 0
    else:
        r = (d % s) == 0
    return r


@triton.jit
def chunked_keep(qp, kj, c):
    """``qp // c == kj // c`` (floor division; never for qp < 0)."""
    if (c & (c - 1)) == 0:
        r = (qp >= 0) & ((qp ^ kj) < c)
    else:
        r = (qp >= 0) & ((qp // c) == (kj // c))
    return r


@triton.jit
def summary_keep(kj, stride, c):
    """``kj % stride >= stride - c`` (kj >= 0)."""
    if (stride & (stride - 1)) == 0:
        r = (kj & (stride - 1)) >= (stride - c)
    else:
        r = (kj % stride) >= (stride - c)
    return r


@triton.jit
def div_floor(x, d, shift):
    """``x // d`` for ``x >= 0``; ``shift = log2(d)`` when d is a power of two, else -1."""
    if shift >= 0:
        r = x >> shift
    else:
        r = x // d
    return r


@triton.jit
def doc_run_keep(qp, kj, START, END, n, KEY_SIDE: tl.constexpr):
    """Same document, for documents that are contiguous runs: position ``x`` belongs to the run
    ``[START[x], END[x])`` (``n`` positions). The bounds are read on the side that stays fixed
    inside the kernel's loop (``KEY_SIDE``: the key block of a dK/dV program, else the query
    rows), so the compiler hoists the loads out of the loop."""
    if KEY_SIDE:
        ok = (kj >= 0) & (kj < n)
        r = (qp >= tl.load(START + kj, mask=ok, other=1 << 30)) & (qp < tl.load(END + kj, mask=ok, other=0))
    else:
        ok = (qp >= 0) & (qp < n)
        r = (kj >= tl.load(START + qp, mask=ok, other=1 << 30)) & (kj < tl.load(END + qp, mask=ok, other=0))
    return r


@triton.jit
def floor_div(x, d):
    """``x // d`` rounded towards minus infinity for any sign of ``x`` (``d > 0``)."""
    q = x // d
    return tl.where((q * d != x) & (x < 0), q - 1, q)


@triton.jit
def floor_mod(x, d):
    """``x % d`` in ``[0, d)`` for any sign of ``x`` (``d > 0``)."""
    r = x % d
    return tl.where(r < 0, r + d, r)


@triton.jit
def chunk_band_keep(qp, kj, qc, kc, lo, hi):
    """``lo <= kj // kc - qp // qc <= hi`` (floor division; the query chunk is read per row)."""
    d = floor_div(kj, kc) - floor_div(qp, qc)
    return (d >= lo) & (d <= hi)


@triton.jit
def periodic_keep(qp, kj, period, w):
    """``|qp % period - kj % period| <= w`` (floor modulo; a scalar power-of-two period has its
    own template in :mod:`blocksparse_fa.kernels.predicate`), as one unsigned compare of ``a - b +
    w`` against ``2w`` with ``w`` clamped to ``period - 1`` (every sum then lies below 2**32)."""
    wc = tl.minimum(w, period - 1)
    d = floor_mod(kj, period) - floor_mod(qp, period) + wc
    return d.to(tl.uint32, bitcast=True) <= (2 * wc).to(tl.uint32, bitcast=True)


@triton.jit
def bitset_keep(x, WORDS, n_bits):
    """Position ``x`` is in the set: bit ``x % 32`` of ``WORDS[x // 32]`` (``n_bits`` positions)."""
    ok = (x >= 0) & (x < n_bits)
    xs = tl.where(ok, x, 0)
    w = tl.load(WORDS + (xs >> 5), mask=ok, other=0)
    return ok & (((w >> (xs & 31)) & 1) != 0)


@triton.jit
def _grid_coord(x, tv, a, n, m, c, t, e):
    """Coordinate along one dim of grid offsets ``x``: tile digit ``(x // tv // a) % n`` times
    ``m`` plus within-tile digit ``(x % tv // c) % t`` times ``e`` (raster order: ``tv = 1``)."""
    tile = x // tv
    return ((tile // a) % n) * m + (((x - tile * tv) // c) % t) * e


@triton.jit
def _window_dim(cq, ck, G, K, D):
    """NATTEN's clamped (dilated) window along one dim: ``ck`` in the window of ``cq``."""
    if D == 1:
        s = tl.minimum(tl.maximum(cq - K // 2, 0), G - K)
        r = (ck >= s) & (ck < s + K)
    else:
        g = cq % D
        n = (G - g + D - 1) // D
        s = tl.minimum(tl.maximum(cq // D - K // 2, 0), n - K)
        u = ck // D
        r = ((ck % D) == g) & (u >= s) & (u < s + K)
    return r


@triton.jit
def grid_keep(qp, kj, P):
    """NATTEN / sliding-tile neighbourhood on a token grid; parameters at ``P``: start, token
    count V, tile volume, then per dim (3) ``G, K, D, a, n, m, c, t, e``. The coordinates are
    computed on the row and the column side separately; per element only comparisons remain."""
    start = tl.load(P)
    V = tl.load(P + 1)
    tv = tl.load(P + 2)
    xq = qp - start
    xk = kj - start
    r = (xq >= 0) & (xq < V) & (xk >= 0) & (xk < V)
    xq = tl.minimum(tl.maximum(xq, 0), V - 1)
    xk = tl.minimum(tl.maximum(xk, 0), V - 1)
    for d in tl.static_range(3):
        B = P + 3 + 9 * d
        G = tl.load(B)
        if G > 1:
            K = tl.load(B + 1)
            D = tl.load(B + 2)
            a = tl.load(B + 3)
            n = tl.load(B + 4)
            m = tl.load(B + 5)
            c = tl.load(B + 6)
            t = tl.load(B + 7)
            e = tl.load(B + 8)
            cq = _grid_coord(xq, tv, a, n, m, c, t, e)
            ck = _grid_coord(xk, tv, a, n, m, c, t, e)
            r = r & _window_dim(cq, ck, G, K, D)
    return r


@triton.jit
def grid_arith_keep(qp, kj, P, AUX, NDIM: tl.constexpr, KEY_SIDE: tl.constexpr):
    """Neighbourhood on a raster-order token grid without dilation. Parameters at ``P``: the seven
    of :func:`grid_table_keep` (start, token count V, row- and key-table offsets, ``K`` per dim),
    then per grid digit (most significant first, radix > 1) ``M, S, R``: ``x // W == umulhi(x, M)
    >> S`` for every offset ``0 <= x < V`` (``W`` the digit's weight, ``M`` an unsigned 32-bit
    multiplier stored in an int32 slot: :func:`blocksparse_fa.kernels.predicate.magic_divisor`;
    the last digit has weight 1 and reads ``x`` itself) and ``R`` the dim's extent. Digit ``k``'s
    coordinate is ``q_k - q_(k-1) * R_k`` with ``q_k = x // W_k``: one multiply-high per digit.

    Where keys move in the kernel's loop (forward, dQ) both sides are computed so (the rows' part
    is hoisted out of the loop), with no gather per key; the grid bounds fold into the first
    digit's operands (a row outside the grid gets a window start of 2**30, a key the coordinate
    -2**30). Where query rows move (``KEY_SIDE``: the dK/dV loop) the tables are read, as
    :func:`grid_table_keep` does: one gather per row costs fewer instructions there than the
    clamps of the window start."""
    if KEY_SIDE:
        r = grid_table_keep(qp, kj, P, AUX, NDIM)
    else:
        start = tl.load(P)
        V = tl.load(P + 1)
        xq = qp - start
        xk = kj - start
        okq = (xq >= 0) & (xq < V)
        okk = (xk >= 0) & (xk < V)
        xq = tl.minimum(tl.maximum(xq, 0), V - 1)
        xk = tl.minimum(tl.maximum(xk, 0), V - 1)
        prev_q = xq * 0
        prev_k = xk * 0
        r = okq & okk  # replaced by the first digit's test, which folds these bounds into its operands
        for d in tl.static_range(NDIM):
            K = tl.load(P + 4 + d)
            R = tl.load(P + 9 + 3 * d)
            if d == NDIM - 1:  # weight 1
                quo_q = xq
                quo_k = xk
            else:
                M = tl.load(P + 7 + 3 * d).to(tl.uint32, bitcast=True)
                S = tl.load(P + 8 + 3 * d).to(tl.uint32)
                quo_q = (tl.umulhi(xq.to(tl.uint32), M) >> S).to(tl.int32)
                quo_k = (tl.umulhi(xk.to(tl.uint32), M) >> S).to(tl.int32)
            cq = quo_q - prev_q * R
            ck = quo_k - prev_k * R
            prev_q = quo_q
            prev_k = quo_k
            lo = tl.minimum(tl.maximum(cq - K // 2, 0), R - K)
            if d == 0:
                lo = tl.where(okq, lo, 1 << 30)
                ck = tl.where(okk, ck, -(1 << 30))
                r = (ck - lo).to(tl.uint32, bitcast=True) < K.to(tl.uint32)
            else:
                r = r & ((ck - lo).to(tl.uint32, bitcast=True) < K.to(tl.uint32))
    return r


@triton.jit
def grid_table_keep(qp, kj, P, AUX, NDIM: tl.constexpr):
    """Neighbourhood on a token grid through per-token tables (``grid_keep`` without divisions);
    parameters at ``P``: start, token count V, row-table offset, key-table offset, then ``K`` per
    dim. Per active dim, the row table holds ``(group << 16) | window start`` of a query and the
    key table ``(group << 16) | coordinate // dilation`` of a key: the key is inside the query's
    window exactly when ``0 <= key - row < K`` (groups and coordinates below 2**14 and 2**15)."""
    start = tl.load(P)
    V = tl.load(P + 1)
    ROWT = AUX + tl.load(P + 2)
    KEYT = AUX + tl.load(P + 3)
    xq = qp - start
    xk = kj - start
    okq = (xq >= 0) & (xq < V)
    okk = (xk >= 0) & (xk < V)
    if NDIM == 0:
        r = okq & okk
    else:
        # positions outside the grid read values whose difference is negative (unsigned: >= 2**30)
        r = okq & okk
        for d in tl.static_range(NDIM):
            K = tl.load(P + 4 + d)
            lo = tl.load(ROWT + d * V + xq, mask=okq, other=1 << 30)
            kv = tl.load(KEYT + d * V + xk, mask=okk, other=-(1 << 30))
            inside = (kv - lo).to(tl.uint32, bitcast=True) < K.to(tl.uint32)
            r = inside if d == 0 else r & inside
    return r


@triton.jit
def partial_bits_keep(i, kj, z, ROWS, IDX, BITS, TR, BM, BM_SHIFT, BN, BN_SHIFT, WPR):
    """Bits stored for the partial blocks of a ``mask_mod``: block ``(z, r, c)`` has index
    ``IDX[base + c - cmin]`` inside its row's window ``(cmin, count, base) = ROWS[3 * row:]``;
    -1 means all kept, -2 none, else its ``BM x WPR`` words start at ``BITS + idx * BM * WPR``.
    A kernel tile never straddles layout blocks (its sizes divide them), so the block is read once
    per tile (from the tile's first row and key) and only the bit words are gathered."""
    i0 = tl.min(i)
    k0 = tl.maximum(tl.min(kj), 0)
    r = div_floor(i0, BM, BM_SHIFT)
    c = div_floor(k0, BN, BN_SHIFT)
    row = z * TR + r  # the tile's first row and key lie inside the lengths: r < TR, c < Tc
    cmin = tl.load(ROWS + 3 * row)
    cnt = tl.load(ROWS + 3 * row + 1)
    base = tl.load(ROWS + 3 * row + 2)
    inw = (c >= cmin) & (c < cmin + cnt)
    idx = tl.where(inw, tl.load(IDX + tl.where(inw, base + c - cmin, 0)), -2)
    li = i - r * BM
    lj = tl.maximum(kj, 0) - c * BN
    # 0 <= li < BM and 0 <= lj < BN inside the tile's block; without stored bits, block 0 is read
    word = tl.load(BITS + tl.where(idx >= 0, idx, 0).to(tl.int64) * (BM * WPR) + li * WPR + (lj >> 5))
    bit = ((word >> (lj & 31)) & 1) != 0
    return tl.where(idx >= 0, bit, (idx == -1) & (li >= 0))
