"""The Gluon Hopper kernels (``kernels/forward_gluon.py``, ``kernels/backward_gluon.py``): which run
(the library's own choice, :func:`blocksparse_fa.ops.select.choose_forward` / ``choose_backward``,
on a Hopper GPU with the default kernel options) and the bytes they move.

They do not read the layout's lookup tables: they walk each row's key interval (dense, causal and
one-interval-per-row layouts) at their own tiles, so the model builds, from the rows' intervals
(:func:`blocksparse_fa.compiler.intervals.row_interval`), the blocks each kernel visits at its
tiles (:class:`_TileLayout`) and counts them with the same per-kernel code as the Triton kernels:

* ``_attn_fwd_gluon``: programs of ``2·block_m`` = 128 query rows (``3·block_m`` = 192 on dense
  and causal layouts at head dim 64, ``ops/select.GLUON_FWD_DEFAULTS``), K/V per key block of
  ``block_n`` = 128 keys, O and LSE written once. Dense: persistent, head by head (the grid order);
  causal: one program per tile, longest rows first; interval layouts: persistent, one row tile of
  every head before the next (tile-major), the tiles with most key blocks first, or head by head
  where every head's key window no longer fits in L2 (``ops/select.tile_major_deal``). Interval
  programs read a 20-byte table row and the rows' interval bounds (8 bytes per row).
* ``_attn_bwd_dkdv_gluon``: programs of ``2·block_n`` = 128 keys per batch·kv-head, Q, dO, LSE, δ
  per query block of ``block_m`` = 64 rows that reaches them (so a window's key tile reads the
  64-row blocks its rows really touch, not whole layout blocks), dK and dV written once. Dense and
  causal: one program per key tile in index order; interval layouts: persistent, tile-major, the
  key tiles with most query blocks first (head by head where the forward's would be). The
  five-GEMM variant (the default of dense and causal)
  also reduce-adds every step's ``64 × D`` fp32 dQ partial into an accumulator in L2 (TMA
  reduce-add); its lines go to and from DRAM with the rows they belong to.
* ``_attn_bwd_dq_gluon`` (the deterministic pair, the default of interval layouts): programs of
  ``2·dq_block_m`` = 128 rows, K/V per key block of ``dq_block_n`` = 128; persistent on interval
  layouts, dealt as the dK/dV kernel. With the five-GEMM variant ``_dq_finish`` instead reads the fp32
  accumulator and LSE and writes dQ, after a fill kernel zeroed the accumulator.

* the list mode (``compiler/block_lists.py``: block layouts whose partial blocks hold at most two
  key runs per row) visits the layout's own non-empty 128 × 128 blocks in the same kernels: per
  program a table row and its rows' bounds (8 bytes per row and interval), per step a 4-byte list
  entry (and, in the dK/dV kernel, the step rows' bounds).

Not modelled: masks whose global tokens the launcher splits off (attention sinks, and Longformer's
forward, ``ops/select.choose_global_split``) and masks of two key runs per row that it runs as two
one-run parts (``ops/select.choose_run_split``) are counted whole, with the Triton kernels; the persistent
kernels' static deal of work items (the programs are scheduled as
the hardware would schedule one program per item), a key tile whose keys no row keeps (the
kernels still visit one query block), the snake order of the tile-major deal (it changes which SM
runs an item, not which items run together).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from ...compiler.intervals import row_interval, tile_ranges
from ...compiler.segments import FULL, PARTIAL
from .geometry import _DenseLayout, _Geometry
from .kernels import _dkdv_kernel, _preprocess_kernel, _row_kernel
from .params import TileSizes, TrafficParams
from .report import KernelTraffic
from .trace import _trace_backward, _trace_forward, _with_trace

_ROWS = 128  # query rows of a forward / dQ program (2 x block_m), keys of a dK/dV program (2 x block_n)
_KEYS = 128  # key block of the forward and dQ steps (block_n, dq_block_n)
_STEP_ROWS = 64  # query rows of a dK/dV step (block_m)
_FWD_TABLE = 20  # bytes of a forward program's interval table row (tile, kb0, e1, e2, n: int32)
_BWD_TABLE = 16  # bytes of a backward program's interval table row (int32 x 4)
_BOUNDS = 8  # bytes per row of the interval bounds (lo, hi: int32) the interval kernels read


def choices(layout, p: TrafficParams):
    """``(forward, backward)`` :class:`~blocksparse_fa.ops.select.Choice` of the library's kernel
    choice for ``layout`` and the problem ``p`` on a Hopper GPU with ``p.n_sm`` SMs (the default
    kernel options; tensors addressable by tensor descriptors)."""
    import torch

    from ...ops.options import KernelOptions
    from ...ops.select import (Hardware, LayoutClass, block_lists_of, choose_backward, choose_forward, layout_class,
                               list_column_work)
    from ...ops.validate import Shapes

    dtype = {2: torch.bfloat16 if "bf" in p.dtype else torch.float16, 4: torch.float32}[p.elem]
    if isinstance(layout, _DenseLayout):
        lc = LayoutClass("dense", layout.q_len, layout.kv_len, tuple(layout.block_size))
    else:
        lc = layout_class(layout)
        bl = block_lists_of(layout, any_device=True) if lc.kind == "blocks" and not lc.lists else None
        if bl is not None:  # a layout on the CPU: the class a GPU's copy would have
            lc = replace(lc, lists=True, list_columns=list_column_work(bl))
    s = Shapes(p.batch, p.heads, p.hkv, layout.q_len, layout.kv_len, p.head_dim)
    hw = Hardware("cuda", (9, 0), "", p.n_sm)
    opts = KernelOptions()
    return choose_forward(lc, s, dtype, hw, opts), choose_backward(lc, s, dtype, hw, opts)


class _TileLayout:
    """What :class:`~.geometry._Geometry` reads, for the blocks a Gluon kernel visits: ``rows`` query
    rows by ``cols`` keys, from per-row key intervals ``lo``/``hi`` ``(Z, Lq)`` (half-open; Z layout
    instances of ``batch_shape``). A block is full where every row of the tile keeps all its keys.
    ``visit_one``: a tile whose rows keep nothing still visits one block (the forward and dQ
    kernels run one masked step for it)."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray, kv_len: int, rows: int, cols: int, batch_shape,
                 visit_one: bool):
        z_n, q_len = lo.shape
        self.q_len, self.kv_len, self.block_size, self.batch_shape = q_len, kv_len, (rows, cols), batch_shape
        n_t, n_c = -(-q_len // rows), -(-kv_len // cols)
        self.shape = (n_t, n_c)
        seg_rows, starts, ends, states = [], [], [], []
        for z in range(z_n):
            first, f0, f1, end = tile_ranges(lo[z], hi[z], rows, cols).T
            if visit_one:
                end = np.maximum(end, first + 1)
                f0, f1 = np.minimum(f0, end), np.minimum(f1, end)
            r = z * n_t + np.arange(n_t)
            for a, b, st in ((first, f0, PARTIAL), (f0, f1, FULL), (f1, end, PARTIAL)):
                keep = b > a
                seg_rows.append(r[keep])
                starts.append(a[keep])
                ends.append(b[keep])
                states.append(np.full(int(keep.sum()), st, dtype=np.int8))
        cat = lambda xs: np.concatenate(xs).astype(np.int64)  # noqa: E731
        self._segs = SimpleNamespace(rows=cat(seg_rows), starts=cat(starts), ends=cat(ends),
                                     state=np.concatenate(states))


def _intervals(layout, kind: str):
    """``(lo, hi, batch_shape)``: the rows' key intervals ``(Z, Lq)`` the Gluon kernels walk."""
    if kind == "dense":
        lo = np.zeros((1, layout.q_len), np.int64)
        return lo, lo + layout.kv_len, ()
    if kind == "causal":
        r = np.arange(layout.q_len, dtype=np.int64)[None]
        return np.zeros_like(r), r + 1, ()
    lo, hi = row_interval(layout)
    return np.asarray(lo, np.int64), np.asarray(hi, np.int64), tuple(layout.batch_shape)


class _ListLayout:
    """What :class:`~.geometry._Geometry` reads, for the blocks the list mode visits
    (``compiler/block_lists.py``): the layout's own non-empty 128 × 128 blocks, each layout row
    split into steps of ``rows`` query rows that keep its blocks and states; with ``parts`` the
    dK/dV table's own steps instead (a part of a partial block that keeps nothing is not visited,
    one that keeps the whole block is a full step)."""

    def __init__(self, layout, rows: int, parts: bool = False):
        bm, bn = layout.block_size
        per = bm // rows
        tr, tc = layout.shape[-2], layout.shape[-1]
        self.q_len, self.kv_len, self.block_size = layout.q_len, layout.kv_len, (rows, bn)
        self.batch_shape = tuple(layout.batch_shape)
        self.shape = (tr * per, tc)
        if parts:
            self._segs = _table_parts(layout, tr * per, tc)
            return
        segs = layout._segs
        sel = segs.state != 0
        r = segs.rows[sel]
        new_rows = ((r // tr) * tr * per + (r % tr) * per)[:, None] + np.arange(per)[None, :]
        rep = lambda a: np.repeat(a[sel], per)  # noqa: E731
        self._segs = SimpleNamespace(rows=new_rows.ravel().astype(np.int64), starts=rep(segs.starts).astype(np.int64),
                                     ends=rep(segs.ends).astype(np.int64), state=rep(segs.state))


def _table_parts(layout, rows: int, tc: int) -> SimpleNamespace:
    """Unit segments ``(row part, key tile, state)`` of the dK/dV list table, in its steps' units."""
    from ...compiler.block_lists import BLOCK_MASK
    from ...ops.select import block_lists_of

    t = block_lists_of(layout, any_device=True)
    n = t.dkdv_order.size  # instances x key tiles
    tab = t.dkdv[:4 * n].reshape(n, 4).astype(np.int64)
    counts = tab[:, 3] - tab[:, 0]
    line = np.repeat(np.arange(n), counts)
    pos = np.repeat(tab[:, 0], counts) + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    full = (pos >= tab[line, 1]) & (pos < tab[line, 2])
    cols = line % tc
    return SimpleNamespace(rows=(line // tc) * rows + (t.dkdv[pos].astype(np.int64) & BLOCK_MASK), starts=cols,
                           ends=cols + 1, state=np.where(full, 2, 1).astype(np.int8))


def _list_bounds(layout) -> tuple[int, float]:
    """``(bytes of one row's bounds, mean keys per row)`` of a layout in the list mode."""
    from ...ops.select import block_lists_of

    t = block_lists_of(layout, any_device=True)
    return 8 * t.n_intervals, t.mean_keys


def _deal_keys(mean_keys: float, n_items: int, p: TrafficParams) -> bool:
    """:func:`_deal` from the mean keys per row."""
    from ...ops.select import tile_major_deal

    return tile_major_deal(n_items, min(n_items, p.n_sm), p.batch * p.hkv * mean_keys * 2 * p.head_dim * p.elem)


STATIC_DEAL = True
"""Persistent kernels (the dense and interval forwards, the interval backward's dK/dV and dQ) play
their work items in their static deal: program ``p`` runs items ``p, p + grid, ...``
(``trace._schedule``). False: as the hardware would schedule one program per item."""


def _tiles(fwd_rows: int = _ROWS) -> TileSizes:
    return TileSizes(fwd_block_m=fwd_rows, fwd_block_n=_KEYS, dkdv_block_m=_STEP_ROWS, dkdv_block_n=_ROWS,
                     dq_block_m=_ROWS, dq_block_n=_KEYS)


def _fwd_rows(mode: str, head_dim: int) -> int:
    """Query rows of a forward program in ``mode`` with the default options (``groups·block_m``)."""
    from ...ops.options import DEFAULT_OPTIONS
    from ...ops.select import gluon_fwd_config

    cfg = gluon_fwd_config(DEFAULT_OPTIONS, mode, head_dim)
    return cfg.groups * cfg.block_m


def forward(layout, p: TrafficParams, mode: str, progress: bool = False, label: str = "") -> KernelTraffic:
    """The Gluon forward of ``mode`` (``"dense"``, ``"causal"``, ``"interval"``, ``"list"``)."""
    rows = _fwd_rows(mode, p.head_dim)
    pt = replace(p, tiles=_tiles(rows))
    if mode == "list":  # the layout's blocks; per program a table row and its rows' bounds, per step an entry
        geo = _Geometry(_ListLayout(layout, _ROWS))
        bounds, keys = _list_bounds(layout)
        lut = (_FWD_TABLE + bounds * _ROWS, 4)
        table = int(geo.n_inst * (layout.q_len * bounds + geo.tr * _FWD_TABLE) + 4 * geo.visited)
        launch = dict(order="steps", tile_major=_deal_keys(keys, p.batch * p.heads * geo.tr, p))
        interval = True
    else:
        lo, hi, bs = _intervals(layout, mode)
        geo = _Geometry(_TileLayout(lo, hi, layout.kv_len, rows, _KEYS, bs, visit_one=True))
        interval = mode == "interval"
        lut = (_FWD_TABLE + _BOUNDS * rows, 0) if interval else (0, 0)
        table = int(lo.size * _BOUNDS + geo.n_inst * geo.tr * _FWD_TABLE) if interval else 0
        launch = dict(order="grid" if mode == "dense" else "steps",
                      tile_major=interval and _deal(lo, hi, p.batch * p.heads * geo.tr, p))
    k = _row_kernel("_attn_fwd_gluon", geo, pt, rows, q_side_loads={"Q": p.head_dim * p.elem},
                    q_side_stores={"O": p.head_dim * p.elem, "LSE": 4}, lut_bytes=table, lut=lut, **launch)
    if p.policy == "trace":  # dense and interval forwards are persistent (a static deal), causal is not
        tr = _trace_forward(geo, pt, progress, f"trace {label}", lut=lut, static=STATIC_DEAL and mode != "causal",
                            **launch)
        k = _with_trace(k, tr["fwd"], table)
    return k


def _deal(lo: np.ndarray, hi: np.ndarray, n_items: int, p: TrafficParams) -> bool:
    """Whether a persistent interval kernel with ``n_items`` work items deals them tile-major, as
    the launcher picks it (:func:`blocksparse_fa.ops.select.tile_major_deal`: head by head once
    every head's key window leaves the L2)."""
    from ...ops.select import tile_major_deal

    window = p.batch * p.hkv * float(np.clip(hi - lo, 0, None).mean()) * 2 * p.head_dim * p.elem
    return tile_major_deal(n_items, min(n_items, p.n_sm), window)


def backward(layout, p: TrafficParams, mode: str, progress: bool = False, label: str = "") -> list:
    """The Gluon backward's kernels: ``[preprocess, dK/dV, dQ]`` for the deterministic pair
    (``mode`` ``"dense"``, ``"causal"``, ``"interval"``, ``"list"``), ``[preprocess, dK/dV,
    _dq_finish, accumulator fill]`` for the five-GEMM kernel (``"dense+atomic_dq"``,
    ``"causal+atomic_dq"``), or ``[preprocess, dK/dV, dQ, dK/dV group sum]`` for
    ``"list+per_head_dkdv"``: the dK/dV kernel as for MHA (one item per query head; its K/V reads
    counted per query head, an upper bound on DRAM where a group's items share them in the L2), the
    dQ kernel as for GQA, and the sum of each group's per-query-head dK and dV."""
    kind, _, flag = mode.partition("+")
    atomic = flag == "atomic_dq"
    if flag == "per_head_dkdv" and p.hkv != p.heads:
        one = 2 * p.batch * layout.kv_len * p.head_dim * p.elem  # K and V of one head each
        sums = KernelTraffic(name="dK/dV group sum", programs=0, waves=0, l2_to_sm_bytes=one * p.heads,
                             sm_to_l2_bytes=one * p.hkv, loads={"dK+dV per query head": one * p.heads},
                             stores={"dK+dV": one * p.hkv}, dram_read_bytes=float(one * p.heads),
                             dram_write_bytes=one * p.hkv, compulsory_read_bytes=one * p.heads)
        pre, dkdv, _ = backward(layout, replace(p, kv_heads=p.heads), kind, progress, label)
        return [pre, dkdv, backward(layout, p, kind, progress, label)[2], sums]
    lists = kind == "list"
    D, e = p.head_dim, p.elem
    pt = replace(p, tiles=_tiles(), bwd_fused=False)
    interval = kind in ("interval", "list")
    acc = 4 * D if atomic else 0
    rows = p.batch * p.heads * layout.q_len
    # dK/dV: 128-key programs stepping over 64-row query blocks
    if lists:  # per step a list entry and the step rows' bounds
        bounds, keys = _list_bounds(layout)
        lut = (_BWD_TABLE, 4 + bounds * _STEP_ROWS)
        geo_kv = _Geometry(_ListLayout(layout, _STEP_ROWS, parts=True))
        deal = lambda n_items: _deal_keys(keys, n_items, p)  # noqa: E731
    else:
        lo, hi, bs = _intervals(layout, kind)
        lut = (_BWD_TABLE, _BOUNDS * _STEP_ROWS) if interval else (0, 0)  # the step rows' bounds per entry
        geo_kv = _Geometry(_TileLayout(lo, hi, layout.kv_len, _STEP_ROWS, _ROWS, bs, visit_one=False))
        deal = lambda n_items: _deal(lo, hi, n_items, p)  # noqa: E731
    pkv = replace(pt, tiles=replace(pt.tiles, dq_block_m=_STEP_ROWS))
    kv_launch = dict(order="steps" if interval else "grid",
                     tile_major=interval and deal(p.batch * p.hkv * geo_kv.tc))
    kv_table = int(geo_kv.n_inst * geo_kv.tc * 2 * _BWD_TABLE) if interval else 0  # table + heaviest-first order
    if lists:
        kv_table += 4 * geo_kv.visited
    dkdv = _dkdv_kernel(geo_kv, pkv, kv_table, name="_attn_bwd_dkdv_gluon", lut=lut, acc_row=acc, **kv_launch)
    if p.policy == "trace":
        tr = _trace_backward(geo_kv, pkv, progress, f"trace {label}", parts=("bwd_dkdv",), lut=lut, acc_row=acc,
                             kv_order=kv_launch["order"], tile_major=kv_launch["tile_major"],
                             static=STATIC_DEAL and interval)
        dkdv = _with_trace(dkdv, tr["bwd_dkdv"], kv_table)
        if acc:
            dkdv = replace(dkdv, dram_write_bytes=int(dkdv.stores["dK"] + dkdv.stores["dV"] + tr["acc"]))
    pre = _preprocess_kernel(geo_kv, pt)
    if atomic:
        fill = KernelTraffic(name="dQ accumulator fill", programs=0, waves=0, l2_to_sm_bytes=0,
                             sm_to_l2_bytes=rows * acc, loads={}, stores={"dQ (fp32)": rows * acc},
                             dram_read_bytes=0.0, dram_write_bytes=rows * acc, compulsory_read_bytes=0)
        loads = {"dQ (fp32)": rows * acc, "LSE": 4 * rows}
        n_prog = p.batch * p.heads * -(-layout.q_len // 64)
        finish = KernelTraffic(name="_dq_finish", programs=n_prog, waves=-(-n_prog // p.n_sm),
                               l2_to_sm_bytes=sum(loads.values()), sm_to_l2_bytes=rows * D * e, loads=loads,
                               stores={"dQ": rows * D * e}, dram_read_bytes=float(sum(loads.values())),
                               dram_write_bytes=rows * D * e, compulsory_read_bytes=sum(loads.values()))
        return [pre, dkdv, finish, fill]
    q_launch = dict(order="steps" if kind == "causal" else "grid")
    if lists:
        geo_q = _Geometry(_ListLayout(layout, _ROWS))
        lut_q = (_BWD_TABLE + bounds * _ROWS, 4)
        q_table = int(geo_q.n_inst * (layout.q_len * bounds + geo_q.tr * _BWD_TABLE) + 4 * geo_q.visited)
    else:
        geo_q = _Geometry(_TileLayout(lo, hi, layout.kv_len, _ROWS, _KEYS, bs, visit_one=True))
        lut_q = (_BWD_TABLE + _BOUNDS * _ROWS, 0) if interval else (0, 0)
        q_table = int(lo.size * _BOUNDS + geo_q.n_inst * geo_q.tr * _BWD_TABLE) if interval else 0
    q_launch["tile_major"] = interval and deal(p.batch * p.heads * geo_q.tr)
    dq = _row_kernel("_attn_bwd_dq_gluon", geo_q, pt, _ROWS, q_side_loads={"Q": D * e, "dO": D * e, "LSE+delta": 8},
                     q_side_stores={"dQ": D * e}, lut_bytes=q_table, lut=lut_q, **q_launch)
    if p.policy == "trace":
        tr = _trace_backward(geo_q, pt, progress, f"trace {label}", parts=("bwd_dq",), lut=lut_q,
                             q_order=q_launch["order"], tile_major=q_launch["tile_major"],
                             static=STATIC_DEAL and interval)
        dq = _with_trace(dq, tr["bwd_dq"], q_table)
    return [pre, dkdv, dq]
