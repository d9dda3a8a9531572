"""Per-kernel counts: L2 → SM bytes (exact, a sum over programs and lookup-table entries) and the
wave model's DRAM estimate (:mod:`.waves`).

The kernels modelled (``blocksparse_fa/kernels``): ``_attn_fwd`` (one program per query tile ×
batch·head; Q once, K/V per visited key block, writes O and LSE), ``_attn_bwd_preprocess`` (reads
O, dO, writes δ), and ``_attn_bwd``, whose dK/dV programs (one per key tile × batch·kv-head; K/V
once, then per query head of the GQA group and per column-LUT entry Q, dO, LSE, δ; writes dK, dV)
and dQ programs (one per query tile × batch·head; Q, dO, LSE, δ once, K/V per entry, writes dQ) run
in one launch or two; the model counts them as ``bwd_dkdv`` and ``bwd_dq``. In the one launch the
grid goes head by head (``TrafficParams.bwd_order="head_major"``), so when one GQA group's Q, dO,
LSE, δ, K, V fit in L2 the dQ programs find them there and read only their lookup tables from DRAM.
Lookup tables: each program reads 4 int32 row pointers and 4 bytes per entry. Only the valid
rows/keys of ragged edge tiles are counted (masked loads move nothing).
"""

from __future__ import annotations

import numpy as np

from .geometry import _Geometry, _perm, _tiles
from .params import TileSizes, TrafficParams
from .report import KernelTraffic
from .waves import _reuse, _wave_policy, _wave_programs, _WaveRefs


def _row_kernel(name: str, geo: _Geometry, p: TrafficParams, block_m: int, *, q_side_loads: dict,
                q_side_stores: dict, lut_bytes: int, order: str | None = None, tile_major: bool = False,
                lut: tuple = (16, 4)) -> KernelTraffic:
    """Forward and dQ: programs (query tile, batch·head) that visit the row LUT and load K/V per entry.

    q_side_loads / q_side_stores: bytes per query row loaded once / stored by each program.
    order: the tiles' launch order within a head (:func:`.geometry._perm`; None:
    ``p.program_order``); tile_major: rank r of every head before rank r + 1. lut: table bytes a
    program reads, fixed and per entry.
    """
    B, H, G = p.batch, p.heads, p.heads // p.hkv
    D, e = p.head_dim, p.elem
    t_row, t_h = _tiles(geo.q_len, block_m, geo.bm)
    n_t = len(t_row)
    P = p.programs_in_flight(name)
    per_row_load = sum(q_side_loads.values())
    per_row_store = sum(q_side_stores.values())
    perm = _perm(order or p.program_order, geo, geo.row_cnt, geo.row_part, t_row)
    tiles = np.arange(n_t) if perm is None else perm
    mult = np.zeros(geo.n_inst, dtype=np.int64)
    stream = np.empty((B * H, n_t))
    for b in range(B):
        for h in range(H):
            z = geo.instance(b, h)
            mult[z] += 1
            st = t_h * (per_row_load + per_row_store) + lut[0] + lut[1] * geo.row_cnt[z, t_row]
            stream[b * H + h] = st[tiles]
    stream_p = (stream.T if tile_major else stream).ravel()
    kv_loads = float(2 * D * e * (mult[:, None] * geo.row_keys[:, t_row]).sum())
    lut_loads = float((mult[:, None] * (lut[0] + lut[1] * geo.row_cnt[:, t_row])).sum())
    rows_total = B * H * geo.q_len
    loads = {k: v * rows_total for k, v in q_side_loads.items()}
    loads["K+V"] = int(kv_loads)
    loads["LUT"] = int(lut_loads)
    stores = {k: v * rows_total for k, v in q_side_stores.items()}
    n_prog = B * H * n_t
    n_waves = -(-n_prog // P)
    stream_w = np.bincount(np.arange(n_prog) // P, weights=stream_p, minlength=n_waves)
    # wave-distinct K/V objects: (b * Hkv + hk) * Tc + column
    refs = _WaveRefs(n_waves, dedup=G > 1)  # query heads of a GQA group share K/V objects
    for bh, w, ranks in _wave_programs(B * H, n_t, P, tile_major):
        b, h = divmod(bh, H)
        z = geo.instance(b, h)
        if perm is None and not tile_major:
            cols = geo.cols_of_rows(z, int(t_row[ranks[0]]), int(t_row[ranks[-1]]))
        else:
            cols = geo.cols_of_row_set(z, t_row[tiles[ranks]])
        refs.add(w, (b * p.hkv + h // G) * geo.tc + cols)
    obj_bytes = np.tile(2.0 * D * e * geo.col_w, B * p.hkv)
    ru = _reuse(refs, obj_bytes, stream_w, p.l2_bytes, _wave_policy(p))
    compulsory = sum(loads[k] for k in q_side_loads) + ru["compulsory"] + lut_bytes
    return KernelTraffic(
        name=name, programs=n_prog, waves=n_waves, l2_to_sm_bytes=int(sum(loads.values())),
        sm_to_l2_bytes=int(sum(stores.values())), loads=loads, stores=stores,
        dram_read_bytes=compulsory + ru["reread"], dram_write_bytes=int(sum(stores.values())),
        compulsory_read_bytes=int(compulsory), reread_bytes=ru["reread"],
        shared_in_wave_bytes=int(kv_loads - ru["wave_distinct"]), reuse_bytes=ru["reuse"],
        reuse_distance_max=ru["reuse_max"], wave_footprint_max=ru["footprint_max"],
        fits_l2=ru["reuse_max"] <= p.l2_bytes)


def _dkdv_kernel(geo: _Geometry, p: TrafficParams, lut_bytes: int, *, name: str = "bwd_dkdv",
                 order: str | None = None, tile_major: bool = False, lut: tuple = (16, 4),
                 acc_row: int = 0) -> KernelTraffic:
    """dK/dV: programs (key tile, batch·kv-head) that visit the column LUT of every query head of
    their GQA group and load Q, dO, LSE, δ per entry. ``order``, ``tile_major``, ``lut`` as in
    :func:`_row_kernel`. ``acc_row``: bytes per query row that each entry also adds into an fp32
    accumulator in L2 (the five-GEMM kernel's dQ reduce-add): stored from the SMs, and in DRAM read
    and written back once per time the rows are fetched (the accumulator lines go with the rows' Q,
    dO: the same reuse)."""
    B, H, Hkv, G = p.batch, p.heads, p.hkv, p.heads // p.hkv
    D, e = p.head_dim, p.elem
    u_col, u_w = _tiles(geo.kv_len, p.tiles.dkdv_block_n, geo.bn)
    n_u = len(u_col)
    P = p.programs_in_flight("bwd_dkdv")
    q_obj_row = 2 * D * e + 8  # Q, dO rows + LSE, delta (fp32)
    perm = _perm(order or p.program_order, geo, geo.col_cnt, geo.col_part, u_col)
    units = np.arange(n_u) if perm is None else perm
    mult = np.zeros(geo.n_inst, dtype=np.int64)
    stream = np.empty((B * Hkv, n_u))
    for b in range(B):
        for hk in range(Hkv):
            lut_p = np.zeros(n_u)
            for g in range(G):
                z = geo.instance(b, hk * G + g)
                mult[z] += 1
                lut_p += lut[0] + lut[1] * geo.col_cnt[z, u_col]
            st = 4 * D * e * u_w + lut_p
            stream[b * Hkv + hk] = st[units]
    stream_p = (stream.T if tile_major else stream).ravel()
    rows_visited = float((mult[:, None] * geo.col_rows[:, u_col]).sum())
    q_loads = q_obj_row * rows_visited
    lut_loads = float((mult[:, None] * (lut[0] + lut[1] * geo.col_cnt[:, u_col])).sum())
    kv_total = B * Hkv * geo.kv_len * D * e
    loads = {"K": kv_total, "V": kv_total, "Q+dO+LSE+delta": int(q_loads), "LUT": int(lut_loads)}
    stores = {"dK": kv_total, "dV": kv_total}
    if acc_row:
        stores["dQ (fp32 reduce-add)"] = int(acc_row * rows_visited)
    n_prog = B * Hkv * n_u
    n_waves = -(-n_prog // P)
    stream_w = np.bincount(np.arange(n_prog) // P, weights=stream_p, minlength=n_waves)
    refs = _WaveRefs(n_waves, dedup=False)  # objects are per query head: never shared
    for bkv, w, ranks in _wave_programs(B * Hkv, n_u, P, tile_major):
        b, hk = divmod(bkv, Hkv)
        for g in range(G):
            h = hk * G + g
            z = geo.instance(b, h)
            if perm is None and not tile_major:
                rows = geo.rows_of_cols(z, int(u_col[ranks[0]]), int(u_col[ranks[-1]]))
            else:
                rows = geo.rows_of_col_set(z, u_col[units[ranks]])
            refs.add(w, (b * H + h) * geo.tr + rows)
    obj_bytes = np.tile(float(q_obj_row + acc_row) * geo.row_h, B * H)
    ru = _reuse(refs, obj_bytes, stream_w, p.l2_bytes, _wave_policy(p))
    compulsory = 2 * kv_total + ru["compulsory"] + lut_bytes
    acc_written = (ru["compulsory"] + ru["reread"]) * acc_row / (q_obj_row + acc_row)
    return KernelTraffic(
        name=name, programs=n_prog, waves=n_waves, l2_to_sm_bytes=int(sum(loads.values())),
        sm_to_l2_bytes=int(sum(stores.values())), loads=loads, stores=stores,
        dram_read_bytes=compulsory + ru["reread"],
        dram_write_bytes=int(2 * kv_total + acc_written),
        compulsory_read_bytes=int(compulsory), reread_bytes=ru["reread"],
        shared_in_wave_bytes=int(q_loads - ru["wave_distinct"]), reuse_bytes=ru["reuse"],
        reuse_distance_max=ru["reuse_max"], wave_footprint_max=ru["footprint_max"],
        fits_l2=ru["reuse_max"] <= p.l2_bytes)


def _preprocess_kernel(geo: _Geometry, p: TrafficParams, lse2: bool = False) -> KernelTraffic:
    """``_attn_bwd_preprocess``: O and dO read, Δ written per row; ``lse2`` (the block backward's
    call): the logsumexp read and its base-2 copy written as well."""
    rows = p.batch * p.heads * geo.q_len
    od = rows * p.head_dim * p.elem
    loads = {"O": od, "dO": od}
    stores = {"delta": 4 * rows}
    if lse2:
        loads["LSE"] = 4 * rows
        stores["LSE2"] = 4 * rows
    n_prog = p.batch * p.heads * -(-geo.q_len // p.tiles.preprocess_block_m)
    waves = -(-n_prog // p.programs_in_flight("bwd_preprocess"))
    rd, wr = sum(loads.values()), sum(stores.values())
    return KernelTraffic(name="bwd_preprocess", programs=n_prog, waves=waves,
                         l2_to_sm_bytes=rd, sm_to_l2_bytes=wr, loads=loads, stores=stores,
                         dram_read_bytes=float(rd), dram_write_bytes=wr, compulsory_read_bytes=rd)


def _check_tiles(geo: _Geometry, t: TileSizes) -> None:
    for name, tile, block in (("fwd_block_m", t.fwd_block_m, geo.bm), ("fwd_block_n", t.fwd_block_n, geo.bn),
                              ("dkdv_block_m", t.dkdv_block_m, geo.bm), ("dkdv_block_n", t.dkdv_block_n, geo.bn),
                              ("dq_block_m", t.dq_block_m, geo.bm), ("dq_block_n", t.dq_block_n, geo.bn)):
        if block % tile:
            raise ValueError(f"tile {name}={tile} must divide the layout block ({block}), as the kernels require")
