"""The device-interval path's per-call intervals and tables, in a few Triton launches.

``compiler/device_intervals.py`` defines the rows' key intervals of ``causal() & document(ids)``
and the like, and the interval kernels' per-tile ranges, as torch operations (the reference: some
40-60 small kernels per piece). The kernels here compute the same numbers, bit for bit:

* :func:`_doc_bounds`, one program per ``BLOCK`` rows of one mask instance: each row's document
  run (a scan over the block's ids, and a walk over whole windows of ids from the block's first
  and last rows to the ends of the runs that cross them), the other terms (``lo = max(c, qp + a)``,
  ``hi = min(c', qp + b) + 1``, a range of rows, and optionally bounds given as tensors), and, for
  ids that may recur, the span from the first to the last occurrence of the row's id and its rank
  by binary search in the sorted ids (``torch.sort``); :func:`_doc_ranks` gives the keys' ranks;
* :func:`_row_tables`: per row tile the key tiles it visits and those every row keeps whole
  (block min / max over the tile's rows);
* :func:`_col_summary` then :func:`_col_tables`: per key tile the row tiles that may keep one of
  its keys and those that keep it whole, from per-row-tile summaries (a first and a last tile by
  reduction over the summaries, then the exact row inside the tile);
* :func:`_gluon_tiles` then :func:`_gluon_order`: the Gluon forward's programs, heaviest first
  (each program's rank counted over all programs: the order of a stable descending sort);
  :func:`_tile_order` the same order of a backward table's key tiles.

Integer division here is floor division whatever the sign (``//`` on Triton integers truncates).
Lengths, counts and offsets are not specialised on (``do_not_specialize``): the tables of a
context-parallel shard are built for every new plan, whose lengths change with the batch, and each
new divisibility by 16 of any of them would compile another variant of the kernel (a second or
more inside a training step; ``benchmarks/NOTES.md``, "Context parallelism").
"""

import triton
import triton.language as tl

FAR = tl.constexpr(1 << 40)  # "no bound" (int64), as the reference's


@triton.jit
def _floor_div(a, B: tl.constexpr):
    q = a // B
    return tl.where(a - q * B < 0, q - 1, q)


@triton.jit
def _cdiv(a, B: tl.constexpr):
    return _floor_div(a + (B - 1), B)


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min2(a, b):
    return tl.minimum(a, b)


@triton.jit
def _search(SRT, v, n, log_n):
    """``(left, right)``: ``searchsorted(SRT[:n], v)`` on both sides (int64, elementwise)."""
    a = tl.zeros(v.shape, dtype=tl.int64)
    a_end = a + n
    c = a
    c_end = a_end
    for _ in range(log_n):
        m = (a + a_end) // 2
        s = tl.load(SRT + m, mask=m < a_end, other=0)
        busy = a < a_end
        a = tl.where(busy & (s < v), m + 1, a)
        a_end = tl.where(busy & (s >= v), m, a_end)
        m = (c + c_end) // 2
        s = tl.load(SRT + m, mask=m < c_end, other=0)
        busy = c < c_end
        c = tl.where(busy & (s <= v), m + 1, c)
        c_end = tl.where(busy & (s > v), m, c_end)
    return a, c


@triton.jit(do_not_specialize=["stride_ib", "stride_tb", "stride_th", "zh", "q_len", "n", "q_off", "doc_off", "lo_c",
                               "lo_a", "hi_c", "hi_b", "row_a", "row_b", "log_n"])
def _doc_bounds(IDS, SRT, PERM, TLO, THI, LO, HI, ILO, IHI, QID, stride_ib, stride_tb, stride_th, zh, q_len, n,
                q_off, doc_off, lo_c, lo_a, hi_c, hi_b, row_a, row_b, log_n, COMPARE: tl.constexpr,
                HAS_TERMS: tl.constexpr, BLOCK: tl.constexpr, WINDOW: tl.constexpr):
    """Rows ``[pid * BLOCK, ..)`` of instance ``(b, h)``: ``LO, HI`` (and ``ILO, IHI, QID``) int32."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_m = pid * BLOCK + tl.arange(0, BLOCK)
    row_ok = offs_m < q_len
    qp = offs_m.to(tl.int64) + q_off
    # the other terms, clipped to [0, n]
    t_lo = tl.minimum(tl.maximum(tl.maximum(qp + lo_a, lo_c), 0), n)
    t_hi = tl.minimum(tl.maximum(tl.minimum(qp + hi_b, hi_c) + 1, 0), n)
    rows = (qp >= row_a) & (qp < row_b)
    t_lo = tl.where(rows, t_lo, n)
    t_hi = tl.where(rows, t_hi, 0)
    if HAS_TERMS:
        t_off = b.to(tl.int64) * stride_tb + h.to(tl.int64) * stride_th + offs_m
        t_lo = tl.maximum(t_lo, tl.load(TLO + t_off, mask=row_ok, other=0))
        t_hi = tl.minimum(t_hi, tl.load(THI + t_off, mask=row_ok, other=0))
    # the document's run at each row's position x (rows outside [0, n) keep nothing)
    ids = IDS + b.to(tl.int64) * stride_ib
    p = qp + doc_off
    ok = row_ok & (p >= 0) & (p < n)
    x = tl.minimum(tl.maximum(p, 0), n - 1)
    cur = tl.load(ids + x)
    starts = ok & ((x == 0) | (tl.load(ids + x - 1, mask=x > 0, other=0) != cur))
    ends = ok & ((x == n - 1) | (tl.load(ids + x + 1, mask=x + 1 < n, other=0) != cur))
    start = tl.associative_scan(tl.where(starts, x, -1), 0, _max2)
    end = tl.associative_scan(tl.where(ends, x + 1, n), 0, _min2, reverse=True)
    # the runs crossing the block's first and last rows: walk whole windows of ids to their ends
    p0 = pid.to(tl.int64) * BLOCK + q_off + doc_off
    pf = tl.maximum(p0, 0)
    pl = tl.minimum(tl.minimum(p0 + BLOCK, q_len + q_off + doc_off) - 1, n - 1)
    busy = pf <= pl
    target = tl.load(ids + tl.minimum(pf, n - 1))
    found = pf - pf - 1
    c = pf + 1  # the run of pf starts after the last different id in [0, pf]
    while busy & (found < 0) & (c > 0):
        q = c - WINDOW + tl.arange(0, WINDOW)
        v = tl.load(ids + q, mask=q >= 0, other=0)
        found = tl.max(tl.where((q >= 0) & (v != target), q, -1), 0)
        c -= WINDOW
    start = tl.maximum(start, found + 1)
    target = tl.load(ids + tl.maximum(pl, 0))
    found = pl - pl + n
    c = pl  # the run of pl ends at the first different id in [pl, n)
    while busy & (found >= n) & (c < n):
        q = c + tl.arange(0, WINDOW)
        v = tl.load(ids + q, mask=q < n, other=0)
        found = tl.min(tl.where((q < n) & (v != target), q, n), 0)
        c += WINDOW
    end = tl.minimum(end, found)
    start = tl.where(ok, start, 0)
    end = tl.where(ok, end, 0)
    out = (b * zh + h).to(tl.int64) * q_len + offs_m
    if COMPARE:
        # outer: from the first to the last occurrence of the row's id; inner: its run
        left, right = _search(SRT + b.to(tl.int64) * stride_ib, cur, n, log_n)
        perm = PERM + b.to(tl.int64) * stride_ib
        d_lo = tl.where(ok, tl.load(perm + left), 0)
        d_hi = tl.where(ok, tl.load(perm + right - 1) + 1, 0)
        i_lo = tl.maximum(start, t_lo)
        i_hi = tl.minimum(end, t_hi)
        inner_empty = i_lo >= i_hi
        tl.store(ILO + out, tl.where(inner_empty, 0, i_lo).to(tl.int32), mask=row_ok)
        tl.store(IHI + out, tl.where(inner_empty, 0, i_hi).to(tl.int32), mask=row_ok)
        tl.store(QID + out, tl.where(ok, left, -1).to(tl.int32), mask=row_ok)
    else:
        d_lo = start
        d_hi = end
    lo = tl.maximum(d_lo, t_lo)
    hi = tl.minimum(d_hi, t_hi)
    empty = lo >= hi
    tl.store(LO + out, tl.where(empty, 0, lo).to(tl.int32), mask=row_ok)
    tl.store(HI + out, tl.where(empty, 0, hi).to(tl.int32), mask=row_ok)


@triton.jit(do_not_specialize=["n", "log_n"])
def _doc_ranks(IDS, SRT, KID, n, log_n, BLOCK: tl.constexpr):
    """``KID[b, x]``: the rank of ``ids[b, x]`` (its first index in the sorted ids), int32."""
    pid = tl.program_id(0)
    base = tl.program_id(1).to(tl.int64) * n
    x = pid * BLOCK + tl.arange(0, BLOCK)
    m = x < n
    left, _ = _search(SRT + base, tl.load(IDS + base + x, mask=m, other=0), n, log_n)
    tl.store(KID + base + x, left.to(tl.int32), mask=m)


@triton.jit
def _tile_rows(LO, HI, ILO, IHI, z, t, q_len, INNER: tl.constexpr, ROWS: tl.constexpr):
    """Rows of tiles ``t`` ``(TILES, ROWS)`` of instance ``z``: ``(valid, lo, hi, ilo, ihi)`` int64
    (inner = outer without ``INNER``)."""
    r = t[:, None] * ROWS + tl.arange(0, ROWS)[None, :]
    valid = r < q_len
    off = z.to(tl.int64) * q_len + r
    lo = tl.load(LO + off, mask=valid, other=0).to(tl.int64)
    hi = tl.load(HI + off, mask=valid, other=0).to(tl.int64)
    if INNER:
        ilo = tl.load(ILO + off, mask=valid, other=0).to(tl.int64)
        ihi = tl.load(IHI + off, mask=valid, other=0).to(tl.int64)
    else:
        ilo = lo
        ihi = hi
    return valid, lo, hi, ilo, ihi


@triton.jit
def _inner_or_far(valid, lo, hi, ilo, ihi):
    """The full-tile bounds of each row (``device_intervals._inner_or_far``); padding rows take no
    part (``(-far, far)``)."""
    out_empty = (lo >= hi) | (valid == 0)
    in_empty = ilo >= ihi
    ia = tl.where(out_empty, -FAR, tl.where(in_empty, FAR, ilo))
    ie = tl.where(out_empty, FAR, tl.where(in_empty, -FAR, ihi))
    return ia, ie


@triton.jit
def _visited(valid, lo, hi, BLOCK_N: tl.constexpr):
    """``(first, end)`` per tile: the key tiles holding a key some row keeps (``0, 0``: none)."""
    keeps = valid & (lo < hi)
    a = tl.min(tl.where(keeps, lo, FAR), 1)
    e = tl.max(tl.where(keeps, hi, -FAR), 1)
    none = a >= e
    return tl.where(none, 0, _floor_div(a, BLOCK_N)), tl.where(none, 0, _cdiv(e, BLOCK_N))


@triton.jit
def _full(ia, ie, first, end, BLOCK_N: tl.constexpr):
    """``(f0, f1)``: the key tiles inside every row's ``[ia, ie)``, clamped into ``[first, end]``."""
    f0 = _cdiv(tl.max(ia, 1), BLOCK_N)
    f1 = _floor_div(tl.min(ie, 1), BLOCK_N)
    f0 = tl.minimum(tl.maximum(f0, first), end)
    return f0, tl.maximum(tl.minimum(f1, end), f0)


@triton.jit
def _store4(OUT, z, t, n_tiles, a, b, c, d):
    """``OUT[z, t, :] = (a, b, c, d)`` int32 for ``t < n_tiles``."""
    off = (z.to(tl.int64) * n_tiles + t) * 4
    m = t < n_tiles
    tl.store(OUT + off, a.to(tl.int32), mask=m)
    tl.store(OUT + off + 1, b.to(tl.int32), mask=m)
    tl.store(OUT + off + 2, c.to(tl.int32), mask=m)
    tl.store(OUT + off + 3, d.to(tl.int32), mask=m)


@triton.jit(do_not_specialize=["q_len", "n_tiles"])
def _row_tables(LO, HI, ILO, IHI, OUT, q_len, n_tiles, INNER: tl.constexpr, ROWS: tl.constexpr,
                TILES: tl.constexpr, BLOCK_N: tl.constexpr, VISIT_ONE: tl.constexpr):
    """``OUT[z, t] = (first, f0, f1, end)`` of row tiles ``t`` of ``ROWS`` rows, in key tiles of
    ``BLOCK_N`` (with ``VISIT_ONE``, ``end`` at least ``first + 1``: ``device_intervals._visit_one``)."""
    z = tl.program_id(1)
    t = tl.program_id(0) * TILES + tl.arange(0, TILES)
    valid, lo, hi, ilo, ihi = _tile_rows(LO, HI, ILO, IHI, z, t, q_len, INNER, ROWS)
    first, end = _visited(valid, lo, hi, BLOCK_N)
    ia, ie = _inner_or_far(valid, lo, hi, ilo, ihi)
    f0, f1 = _full(ia, ie, first, end, BLOCK_N)
    if VISIT_ONE:
        end = tl.maximum(end, first + 1)
    _store4(OUT, z, t, n_tiles, first, f0, f1, end)


@triton.jit(do_not_specialize=["q_len", "n_tiles", "kv_len"])
def _col_summary(LO, HI, ILO, IHI, SUM, q_len, n_tiles, kv_len, INNER: tl.constexpr, ROWS: tl.constexpr,
                 TILES: tl.constexpr):
    """Per row tile ``t`` of ``ROWS`` rows, int64 ``SUM[z, :, t] = (hi_max, lo_min, f_lo, f_hi)``: the
    largest ``hi`` (0 for rows that keep nothing), the smallest ``lo`` (``kv_len`` for them), the
    largest inner lower bound and the smallest inner upper bound (``_inner_or_far``)."""
    z = tl.program_id(1)
    t = tl.program_id(0) * TILES + tl.arange(0, TILES)
    valid, lo, hi, ilo, ihi = _tile_rows(LO, HI, ILO, IHI, z, t, q_len, INNER, ROWS)
    empty = lo >= hi
    ia, ie = _inner_or_far(valid, lo, hi, ilo, ihi)
    base = SUM + z.to(tl.int64) * 4 * n_tiles + t
    m = t < n_tiles
    tl.store(base, tl.max(tl.where(valid, tl.where(empty, 0, hi), -1), 1), mask=m)
    tl.store(base + n_tiles, tl.min(tl.where(valid, tl.where(empty, kv_len, lo), FAR), 1), mask=m)
    tl.store(base + 2 * n_tiles, tl.max(ia, 1), mask=m)
    tl.store(base + 3 * n_tiles, tl.min(ie, 1), mask=m)


@triton.jit(do_not_specialize=["q_len", "n_row_tiles", "kv_len", "n_tiles"])
def _col_tables(LO, HI, SUM, OUT, q_len, n_row_tiles, kv_len, n_tiles, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                COLS: tl.constexpr, CHUNK: tl.constexpr, VISIT_ONE: tl.constexpr):
    """``OUT[z, c] = (first, f0, f1, end)`` of key tiles ``c`` of ``BLOCK_N`` keys, in row tiles of
    ``ROWS`` (``device_intervals.col_tables``: its ``searchsorted`` on monotone envelopes are the
    first or last row tile whose summary passes, then the first or last row inside that tile;
    ``VISIT_ONE`` as in :func:`_row_tables`)."""
    z = tl.program_id(1)
    c = tl.program_id(0) * COLS + tl.arange(0, COLS)
    n0 = c.to(tl.int64) * BLOCK_N
    n1 = n0 + BLOCK_N
    t0 = tl.zeros([COLS], tl.int64) + n_row_tiles  # first tile with a row that keeps a key >= n0
    t1 = tl.zeros([COLS], tl.int64) - 1  # last tile with a row whose lower bound is < n1
    r1 = t0  # first tile with f_lo > n0
    r0 = t1  # last tile with f_hi < n1
    base = SUM + z.to(tl.int64) * n_row_tiles * 4
    for k in range(0, n_row_tiles, CHUNK):
        t = k + tl.arange(0, CHUNK)
        m = t < n_row_tiles
        hi_max = tl.load(base + t, mask=m, other=-1)
        lo_min = tl.load(base + n_row_tiles + t, mask=m, other=FAR)
        f_lo = tl.load(base + 2 * n_row_tiles + t, mask=m, other=-FAR)
        f_hi = tl.load(base + 3 * n_row_tiles + t, mask=m, other=FAR)
        tt = t.to(tl.int64)[None, :]
        t0 = tl.minimum(t0, tl.min(tl.where(hi_max[None, :] > n0[:, None], tt, n_row_tiles), 1))
        t1 = tl.maximum(t1, tl.max(tl.where(lo_min[None, :] < n1[:, None], tt, -1), 1))
        r1 = tl.minimum(r1, tl.min(tl.where(f_lo[None, :] > n0[:, None], tt, n_row_tiles), 1))
        r0 = tl.maximum(r0, tl.max(tl.where(f_hi[None, :] < n1[:, None], tt, -1), 1))
    r0 += 1
    # the exact rows: the first of tile t0 that keeps a key >= n0, the last of tile t1 whose
    # lower bound (kv_len for rows that keep nothing) is < n1
    j = tl.arange(0, ROWS)[None, :]
    row = tl.minimum(t0, n_row_tiles - 1)[:, None] * ROWS + j
    off = z.to(tl.int64) * q_len + row
    lo = tl.load(LO + off, mask=row < q_len, other=0)
    hi = tl.load(HI + off, mask=row < q_len, other=0)
    hit = (row < q_len) & (lo < hi) & (hi > n0[:, None])
    q0 = tl.where(t0 < n_row_tiles, tl.min(tl.where(hit, row, q_len), 1), q_len)
    row = tl.maximum(t1, 0)[:, None] * ROWS + j
    off = z.to(tl.int64) * q_len + row
    lo = tl.load(LO + off, mask=row < q_len, other=0)
    hi = tl.load(HI + off, mask=row < q_len, other=0)
    hit = (row < q_len) & (tl.where(lo >= hi, kv_len, lo) < n1[:, None])
    q1 = tl.where(t1 >= 0, tl.max(tl.where(hit, row + 1, 0), 1), 0)
    none = q0 >= q1
    first = tl.where(none, 0, _floor_div(q0, ROWS))
    end = tl.where(none, 0, _cdiv(q1, ROWS))
    r1 = tl.where(n1 > kv_len, r0, r1)  # the ragged last key tile is never full
    f0 = tl.minimum(tl.maximum(r0, first), end)
    f1 = tl.maximum(tl.minimum(r1, end), f0)
    if VISIT_ONE:
        end = tl.maximum(end, first + 1)
    _store4(OUT, z, c, n_tiles, first, f0, f1, end)


@triton.jit(do_not_specialize=["q_len", "n_prog"])
def _gluon_tiles(LO, HI, LO_P, HI_P, TMP, KEY, q_len, n_prog, PAD: tl.constexpr, ROWS: tl.constexpr,
                 TILES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per program ``p`` of ``ROWS`` rows, unordered: ``TMP[z, p] = (first, e1, e2, n)`` int32 and
    its weight ``KEY[z, p]`` int64; with ``PAD`` the intervals padded with the last row's."""
    z = tl.program_id(1)
    t = tl.program_id(0) * TILES + tl.arange(0, TILES)
    valid, lo, hi, _, _ = _tile_rows(LO, HI, LO, HI, z, t, q_len, False, ROWS)
    first, end = _visited(valid, lo, hi, BLOCK_N)
    # a row that keeps nothing forbids full blocks (the Gluon kernel masks partial blocks only)
    empty = lo >= hi
    ia = tl.where(valid, tl.where(empty, FAR, lo), -FAR)
    ie = tl.where(valid, tl.where(empty, -FAR, hi), FAR)
    f0, f1 = _full(ia, ie, first, end, BLOCK_N)
    none_full = f1 <= f0
    f0 = tl.where(none_full, end, f0)
    f1 = tl.where(none_full, end, f1)
    end = tl.maximum(end, first + 1)  # a program with nothing to attend still runs one masked block
    nb = end - first
    e1 = tl.maximum(tl.minimum(f0, end) - first, 1)
    e2 = tl.maximum(tl.minimum(f1, end) - first, e1)
    m = t < n_prog
    tl.store(KEY + z.to(tl.int64) * n_prog + t, nb * (1 << 24) + (nb - (e2 - e1)), mask=m)
    _store4(TMP, z, t, n_prog, first, e1, e2, nb)
    if PAD:
        r = t[:, None] * ROWS + tl.arange(0, ROWS)[None, :]
        last = z.to(tl.int64) * q_len + q_len - 1
        src = tl.where(valid, z.to(tl.int64) * q_len + r, last)
        dst = z.to(tl.int64) * n_prog * ROWS + r
        mm = (t < n_prog)[:, None]
        tl.store(LO_P + dst, tl.load(LO + src, mask=mm, other=0), mask=mm)
        tl.store(HI_P + dst, tl.load(HI + src, mask=mm, other=0), mask=mm)


@triton.jit(do_not_specialize=["n_prog"])
def _gluon_order(TMP, KEY, TILES, n_prog, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """``TILES[z, rank(p)] = (p, first, e1, e2, n)``: ``rank(p)`` the programs with a larger key,
    and those before ``p`` with an equal one (a stable sort, heaviest first)."""
    z = tl.program_id(1)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = p < n_prog
    keys = KEY + z.to(tl.int64) * n_prog
    key = tl.load(keys + p, mask=m, other=0)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for k in range(0, n_prog, CHUNK):
        o = k + tl.arange(0, CHUNK)
        other = tl.load(keys + o, mask=o < n_prog, other=-1)[None, :]
        before = (other > key[:, None]) | ((other == key[:, None]) & (o[None, :] < p[:, None]))
        rank += tl.sum(before.to(tl.int32), 1)
    src = TMP + (z.to(tl.int64) * n_prog + p) * 4
    dst = TILES + (z.to(tl.int64) * n_prog + rank) * 5
    tl.store(dst, p, mask=m)
    for i in tl.static_range(4):
        tl.store(dst + 1 + i, tl.load(src + i, mask=m, other=0), mask=m)


@triton.jit(do_not_specialize=["n_tiles"])
def _tile_order(TAB, ORD, n_tiles, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """``ORD[z, rank(c)] = c`` for the tiles ``c`` of a ``(first, f0, f1, end)`` table ``TAB[z]``:
    ``rank(c)`` counts the tiles with more steps (``end - first``) and those before ``c`` with as
    many (a stable sort, heaviest first: ``device_intervals.key_tile_order``)."""
    z = tl.program_id(1)
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = c < n_tiles
    base = TAB + z.to(tl.int64) * n_tiles * 4
    steps = tl.load(base + c * 4 + 3, mask=m, other=0) - tl.load(base + c * 4, mask=m, other=0)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for k in range(0, n_tiles, CHUNK):
        o = k + tl.arange(0, CHUNK)
        mo = o < n_tiles
        other = (tl.load(base + o * 4 + 3, mask=mo, other=0) - tl.load(base + o * 4, mask=mo, other=0))[None, :]
        before = ((other > steps[:, None]) | ((other == steps[:, None]) & (o[None, :] < c[:, None]))) & mo[None, :]
        rank += tl.sum(before.to(tl.int32), 1)
    tl.store(ORD + z.to(tl.int64) * n_tiles + rank, c, mask=m)


# ------------------------------------------------------------------------------------------------
# launches (no host reads, no data-dependent shapes)
# ------------------------------------------------------------------------------------------------
_LAUNCHES: dict = {}


def _launch(fn, grid, args: tuple, **consts) -> None:
    """``fn[grid](*args, **consts)`` through :class:`~blocksparse_fa.ops.launcher.Launch` (one
    per kernel, constexprs and device; every argument in its key)."""
    import torch

    from ..ops.launcher import Launch

    dev = next(a.device for a in args if isinstance(a, torch.Tensor))
    key = (fn, tuple(sorted(consts.items())), dev)
    ln = _LAUNCHES.get(key)
    if ln is None:
        ln = _LAUNCHES[key] = Launch(fn, consts, len(args), dev)
    ln(grid, *args)


# programs' sizes (powers of two; tests make them small)
BLOCK_ROWS = 1024  # rows per program of _doc_bounds (and ids per program of _doc_ranks)
WALK = 2048  # ids per step of _doc_bounds' walks to the ends of runs crossing a block's edges
TABLE_ROWS = 1024  # rows per program of _row_tables, _col_summary, _gluon_tiles
COLS = 4  # key tiles per program of _col_tables
CHUNK = 256  # row-tile summaries per step of _col_tables, programs per step of _gluon_order
ORDER = 16  # programs ranked per program of _gluon_order


def _per_program(rows: int) -> int:
    """Tiles per program: about :data:`TABLE_ROWS` rows, a power of two. Not fewer for short
    inputs: sizes never select a variant (constexpr), so a run whose lengths change from call to
    call (context-parallel shards, a plan per batch) compiles each kernel once."""
    return max(1, TABLE_ROWS // rows)


def document_bounds(ids, q_len: int, zb: int, zh: int, q_off: int, doc_off: int, consts: tuple, terms=None,
                    compare: bool = False, block: int | None = None, window: int | None = None):
    """The rows' intervals of ``document(ids) & terms`` (``device_intervals.IntervalSpec.bounds``).

    Args:
        ids: ``(Bd, n)`` integer ids on the device (``Bd`` 1 or ``zb``).
        q_len, zb, zh: rows and mask instances: outputs are ``(zb, zh, q_len)``.
        q_off: row ``i`` sits at ``qp = i + q_off``; ``doc_off``: the document sees ``qp + doc_off``.
        consts: ``(lo_c, lo_a, hi_c, hi_b, row_a, row_b)``: the other terms folded to
            ``lo = max(lo_c, qp + lo_a)``, ``hi = min(hi_c, qp + hi_b) + 1`` and rows ``row_a <= qp < row_b``.
        terms: None or ``(lo, hi)`` int64 ``(Tb, Th, q_len)`` (``Tb`` 1 or ``zb``, ``Th`` 1 or
            ``zh``, last dim contiguous): further terms' bounds, clipped to ``[0, n]``.
        compare: ids that may recur: the outer interval spans the id's first to last occurrence,
            the inner one is its run, and the ids' ranks are returned.
        block, window: rows per program, ids per step of the walks to the ends of runs (powers
            of two; None: :data:`BLOCK_ROWS`, :data:`WALK`).

    Returns:
        ``(lo, hi)``, or with ``compare`` ``(lo, hi, ilo, ihi, qid, kid)``: int32, ``kid`` ``(Bd, n)``.
    """
    import torch

    bd, n = ids.shape
    block, window = block or BLOCK_ROWS, window or WALK
    ids = ids.contiguous()
    dev = ids.device
    shape = (zb, zh, q_len)
    lo, hi = torch.empty(shape, dtype=torch.int32, device=dev), torch.empty(shape, dtype=torch.int32, device=dev)
    if compare:
        srt, perm = torch.sort(ids, dim=1, stable=True)
        ilo, ihi, qid = (torch.empty(shape, dtype=torch.int32, device=dev) for _ in range(3))
    else:
        srt = perm = ids
        ilo = ihi = qid = lo  # never written
    if terms is None:
        tlo = thi = lo  # never read
        stride_tb = stride_th = 0
    else:
        tlo, thi = terms
        stride_tb = tlo.stride(0) if tlo.shape[0] > 1 else 0
        stride_th = tlo.stride(1) if tlo.shape[1] > 1 else 0
    log_n = n.bit_length()
    _launch(_doc_bounds, (triton.cdiv(q_len, block), zh, zb),
            (ids, srt, perm, tlo, thi, lo, hi, ilo, ihi, qid, n if bd > 1 else 0, stride_tb, stride_th, zh, q_len, n,
             q_off, doc_off, *consts, log_n),
            COMPARE=compare, HAS_TERMS=terms is not None, BLOCK=block, WINDOW=window, num_warps=8)
    if not compare:
        return lo, hi
    kid = torch.empty((bd, n), dtype=torch.int32, device=dev)
    _launch(_doc_ranks, (triton.cdiv(n, block), bd), (ids, srt, kid, n, log_n), BLOCK=block, num_warps=4)
    return lo, hi, ilo, ihi, qid, kid


def row_tables(lo, hi, ilo, ihi, block_m: int, block_n: int, visit_one: bool = False):
    """``(Zb, Zh, T, 4)`` int32: ``device_intervals.row_tables`` (``block_m`` a power of two; with
    ``visit_one``, every tile visits at least one block: ``device_intervals._visit_one``)."""
    import torch

    zb, zh, q_len = lo.shape
    n_tiles = triton.cdiv(q_len, block_m)
    out = torch.empty((zb, zh, n_tiles, 4), dtype=torch.int32, device=lo.device)
    tiles = _per_program(block_m)
    inner = ilo is not None
    _launch(_row_tables, (triton.cdiv(n_tiles, tiles), zb * zh),
            (lo, hi, ilo if inner else lo, ihi if inner else hi, out, q_len, n_tiles),
            INNER=inner, ROWS=block_m, TILES=tiles, BLOCK_N=block_n, VISIT_ONE=visit_one, num_warps=4)
    return out


def col_tables(lo, hi, ilo, ihi, kv_len: int, block_m: int, block_n: int, visit_one: bool = False):
    """``(Zb, Zh, C, 4)`` int32: ``device_intervals.col_tables`` (``block_m`` a power of two;
    ``visit_one`` as in :func:`row_tables`)."""
    import torch

    zb, zh, q_len = lo.shape
    z = zb * zh
    n_row_tiles = triton.cdiv(q_len, block_m)
    n_tiles = triton.cdiv(kv_len, block_n)
    summary = torch.empty((z, 4, n_row_tiles), dtype=torch.int64, device=lo.device)
    out = torch.empty((zb, zh, n_tiles, 4), dtype=torch.int32, device=lo.device)
    tiles = _per_program(block_m)
    inner = ilo is not None
    _launch(_col_summary, (triton.cdiv(n_row_tiles, tiles), z),
            (lo, hi, ilo if inner else lo, ihi if inner else hi, summary, q_len, n_row_tiles, kv_len),
            INNER=inner, ROWS=block_m, TILES=tiles, num_warps=4)
    cols = COLS
    _launch(_col_tables, (triton.cdiv(n_tiles, cols), z),
            (lo, hi, summary, out, q_len, n_row_tiles, kv_len, n_tiles),
            ROWS=block_m, BLOCK_N=block_n, COLS=cols, CHUNK=CHUNK, VISIT_ONE=visit_one, num_warps=4)
    return out


def tile_order(tab):
    """int32 ``(Z, C)``: ``device_intervals.key_tile_order`` of a table ``(.., C, 4)`` with ``Z``
    instances (one launch)."""
    import torch

    n_tiles = tab.shape[-2]
    z = tab.numel() // (4 * n_tiles)
    tab = tab.reshape(z, n_tiles, 4).contiguous()
    out = torch.empty((z, n_tiles), dtype=torch.int32, device=tab.device)
    _launch(_tile_order, (triton.cdiv(n_tiles, ORDER), z), (tab, out, n_tiles), BLOCK=ORDER, CHUNK=CHUNK,
            num_warps=4)
    return out


def gluon_tables(lo, hi, block_m: int, block_n: int):
    """``(LO, HI, TILES)``: ``device_intervals.gluon_interval_tables`` (``block_m`` a power of two)."""
    import torch

    z, q_len = lo.shape
    rows = 2 * block_m
    n_prog = triton.cdiv(q_len, rows)
    pad = n_prog * rows != q_len
    dev = lo.device
    tmp = torch.empty((z, n_prog, 4), dtype=torch.int32, device=dev)
    key = torch.empty((z, n_prog), dtype=torch.int64, device=dev)
    tiles_out = torch.empty((z, n_prog, 5), dtype=torch.int32, device=dev)
    if pad:
        lo_p = torch.empty((z, n_prog * rows), dtype=lo.dtype, device=dev)
        hi_p = torch.empty((z, n_prog * rows), dtype=hi.dtype, device=dev)
    else:
        lo_p, hi_p = lo.contiguous(), hi.contiguous()
    tiles = _per_program(rows)
    _launch(_gluon_tiles, (triton.cdiv(n_prog, tiles), z), (lo, hi, lo_p, hi_p, tmp, key, q_len, n_prog),
            PAD=pad, ROWS=rows, TILES=tiles, BLOCK_N=block_n, num_warps=4)
    order = ORDER
    _launch(_gluon_order, (triton.cdiv(n_prog, order), z), (tmp, key, tiles_out, n_prog),
            BLOCK=order, CHUNK=CHUNK, num_warps=4)
    return lo_p, hi_p, tiles_out
