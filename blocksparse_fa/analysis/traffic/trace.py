"""The DRAM level as a trace-driven simulation (``TrafficParams(policy="trace")``).

An LRU simulation of the reference stream the kernels' programs issue, step by step. It replaces
the wave model (:mod:`.waves`) for the DRAM reads; the wave numbers ``shared_in_wave_bytes``,
``reuse_bytes``, ``reuse_distance_max``, ``wave_footprint_max`` of the report still come from the
wave analysis under "lru". Assumptions:

* Programs start in launch order (``program_order``, as in the wave model), at most ``P`` at once; a program
  that has issued its last step frees its slot and the next program in launch order starts on the
  following step (so short programs free their slot early and the programs in flight drift apart).
* A program issues one *step* per unit of its kernel's step time (``step_time``: 1 for the forward
  and dQ, 1.6 for dK/dV, the H100's measured ratio; only programs of different kernels sharing a
  launch, the one-launch backward, are affected by it): step 0 loads its
  own tile (forward: Q; dQ: Q, dO, LSE, δ; dK/dV: K, V) and its lookup-table line; step ``k ≥ 1``
  loads the objects of its ``k``-th lookup-table entry (unmasked entries first, then masked, each
  by increasing index, as the kernels walk them; dK/dV walks the lines of the G query heads of its
  group one after the other); its outputs are stored at its last step. The references of the
  programs in flight are merged by time, ties slot by slot (with equal step times: all of step
  ``t`` before step ``t + 1``).
* That reference stream goes through the simulated L2 at object granularity. ``l2_partitions=1``:
  one LRU cache of ``l2_bytes``; a reference hits iff the object's bytes plus those of the
  distinct objects referenced since its previous reference fit. ``l2_partitions=2`` (the
  default, the H100): two LRU caches of ``l2_bytes / 2``; programs on even slots read through one,
  odd slots through the other; every object is half homed in each partition (addresses are hashed
  over both); a half homed in the reader's partition hits or is filled from DRAM there; a half
  homed in the other one is served by a near copy if the reader's partition has one, else by its
  home (filled from DRAM if absent), and leaves a near copy. So data that both partitions read is
  held twice and private data 1.5 times: re-reads hit up to 25 MB and 33 MB of distinct data,
  the thresholds ``benchmarks/experiments/l2_calibration.py`` measured on the H100 (20–24 MiB and 28–32 MiB).
  Objects are the wave model's (forward and dQ: K+V of a
  layout block per batch·kv-head; dK/dV: Q+dO+LSE+δ of a layout block per batch·head), split into
  the kernels' own tiles where those are smaller (dQ's BLOCK_M rows, dK/dV's BLOCK_N keys), so a
  program's own tile is an object too (the forward's Q tiles are). Lookup-table lines and stored
  outputs pass through the cache as objects of their own (write-allocate) but are not counted as
  reads; lookup tables count once, as under the other policies.
* DRAM reads = bytes of the references that miss (+ lookup tables); the compulsory part is the
  bytes of each object's first reference.
* Register spills: local memory is not modelled. Its reloads that miss L1 come on top of the L2 →
  SM bytes (ncu's local-load L1 misses account for the whole measured excess, docs/traffic.md)
  and some of them reach DRAM.
* The backward's dK/dV and dQ programs form one stream when ``bwd_fused`` (the default, as
  ``_attn_bwd`` runs them in one launch): in ``bwd_order`` ``"head_major"`` (the kernels' order
  without split tiles: per batch·kv-head its dK/dV programs, then the dQ programs of its G query
  heads) or ``"phase"`` (every dK/dV program, then every dQ program), with the dK/dV occupancy, one
  cold L2 for the launch (ncu's ``--cache-control all``). A dQ program's own Q/dO/LSE/δ and its K/V
  entries are then the objects dK/dV programs loaded. ``bwd_fused=False``: two launches, each cold.
* Not modelled: unequal time per step within a kernel (masked entries, misses that stall a
  program), the order in which the hardware really dispatches programs and which SMs sit on which
  partition, work-list splits, L2 sectors / partial lines, set associativity.

The cost is one or two Python LRU steps per reference: N = 131072, H = 4, all blocks (4.2·10⁶
forward and 8.4·10⁶ backward references) take about 10 s with two partitions.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from .._progress import _Off, progress_bar
from .geometry import _Geometry, _instances, _perm, _tiles
from .params import TrafficParams
from .report import KernelTraffic

_OFF = _Off()
_TRACE_INTRA = 1 << 15  # references per program step are ordered by an index below this


@dataclass
class _Visits:
    """The lookup-table lines of one side, expanded into the sub-objects each entry loads.

    Line ``z * n_lines + i`` (instance z, layout row i for the row side, column i for the column
    side) owns ``obj[ptr[l]:ptr[l + 1]]``: for every entry in the kernels' visiting order (unmasked
    blocks first, then masked ones, each by increasing index) the sub-objects of the other side that
    the entry covers (``unit`` rows or keys each), with ``step`` the entry's ordinal in the line and
    ``intra`` the sub-object's ordinal in the entry."""

    ptr: np.ndarray
    obj: np.ndarray
    step: np.ndarray
    intra: np.ndarray


def _visits(geo: _Geometry, side: str, unit: int) -> _Visits:
    key = ("visits", side, unit)
    hit = geo._row_cache.get(key)
    if hit is not None:
        return hit
    lens = geo.seg_end - geo.seg_start
    n = int(lens.sum())
    first = np.cumsum(lens) - lens
    sid = np.repeat(np.arange(len(lens)), lens)
    other = np.repeat(geo.seg_start, lens) + np.arange(n) - np.repeat(first, lens)  # layout column
    rowg = geo.seg_row[sid]  # z * tr + row
    part = geo.seg_partial[sid]
    if side == "row":  # row LUT: entries are columns, they load key sub-objects
        line, ent, n_lines = rowg, other, geo.n_inst * geo.tr
        block, length = geo.bn, geo.kv_len
    else:  # column LUT: entries are rows, they load query sub-objects
        line, ent, n_lines = (rowg // geo.tr) * geo.tc + other, rowg % geo.tr, geo.n_inst * geo.tc
        block, length = geo.bm, geo.q_len
    order = np.lexsort((ent, part, line))
    line, ent = line[order], ent[order]
    lptr = np.searchsorted(line, np.arange(n_lines + 1))
    k = block // unit
    n_sub = -(-length // unit)
    cnt = np.minimum(k, n_sub - ent * k)
    tot = int(cnt.sum())
    cfirst = np.cumsum(cnt) - cnt
    intra = np.arange(tot) - np.repeat(cfirst, cnt)
    vis = _Visits(ptr=np.concatenate([cfirst, [tot]])[lptr] if n else np.zeros(n_lines + 1, np.int64),
                  obj=np.repeat(ent * k, cnt) + intra,
                  step=np.repeat(np.arange(n) - lptr[line], cnt),
                  intra=intra)
    geo._row_cache[key] = vis
    return vis


def _schedule(dur: np.ndarray, P: int, static: bool = False):
    """Start time and slot of each program (launch order) when P run at once and a slot takes the
    next program as soon as its program ends (list scheduling, ties to the lowest slot); ``dur`` is
    each program's duration (its steps × its kernel's step time). ``static``: the persistent
    kernels' deal instead, work item ``i`` on slot ``i % P`` (program ``p`` walks items ``p, p + P,
    ...``), the items of one pass (``P`` consecutive items) starting together once the longest
    item of the pass before has ended. A plain static deal with equal step times would leave the
    programs as far apart as the lengths of their first items differ (the short first row tiles of
    a causal window), and the model would have them re-read a window 20 times over. The kernels
    deal tile-major items in a snake instead (every second pass over the programs in reverse,
    ``kernels/forward_gluon._item_tile``): a program that drew a long item draws a short one next,
    so the programs meet again every two passes (16K, H 16, window 8192, the dQ kernel: 1.118 GB
    measured, 5.3 GB modelled without passes, 1.057 with them; ``benchmarks/NOTES.md`` section 10)."""
    n = len(dur)
    start = np.zeros(n, dtype=np.float64)
    slot = np.arange(n, dtype=np.int64) % max(P, 1)
    if n <= P:
        return start, slot
    if static:
        t = 0.0
        for i0 in range(0, n, P):
            start[i0:i0 + P] = t
            t += float(dur[i0:i0 + P].max())
        return start, slot
    heap = [(0.0, s) for s in range(P)]
    for i, L in enumerate(dur.tolist()):
        t, s = heap[0]
        start[i], slot[i] = t, s
        heapq.heapreplace(heap, (t + L, s))
    return start, slot


def _lru_misses(ids: np.ndarray, size: list, cap: int, bar=_OFF) -> np.ndarray:
    """Miss flags of a reference stream of object ids through a byte-capacity LRU cache (an object
    larger than the cache never stays). ``bar``: a progress bar, updated per chunk of references."""
    cache: OrderedDict = OrderedDict()
    touch, evict = cache.move_to_end, cache.popitem
    miss = np.zeros(len(ids), dtype=bool)
    used = 0
    step = 1 << 18
    for c0 in range(0, len(ids), step):
        flags = []
        add = flags.append
        for i, x in enumerate(ids[c0:c0 + step].tolist()):
            if x in cache:
                touch(x)
            else:
                add(i)
                s = size[x]
                cache[x] = s
                used += s
                while used > cap:
                    used -= evict(False)[1]
        miss[np.asarray(flags, dtype=np.int64) + c0] = True
        bar.update(min(step, len(ids) - c0))
    return miss


def _lru_partitioned(ids: np.ndarray, part: np.ndarray, size: list, cap: int, bar=_OFF) -> np.ndarray:
    """Fraction of each reference read from DRAM under two L2 partitions of ``cap`` bytes each.

    Every object is split in two halves, half ``h`` homed in partition ``h`` (addresses are hashed
    over both). A program on partition ``p`` reads through ``p``: a half homed there hits or is
    filled from DRAM; a half homed in the other partition is served by a near copy in ``p`` if one
    is there, else by its home (filled from DRAM if absent there too), and leaves a near copy in
    ``p``. Data that programs on both partitions read is thus held twice, private data 1.5 times:
    the 25 MB and 33 MB thresholds that ``benchmarks/experiments/l2_calibration.py`` measured on the H100."""
    caches = (OrderedDict(), OrderedDict())
    used = [0, 0]
    miss = np.zeros(len(ids), dtype=np.float64)

    def put(q: int, key: int, nbytes: float) -> None:
        c = caches[q]
        c[key] = nbytes
        used[q] += nbytes
        while used[q] > cap:
            used[q] -= c.popitem(False)[1]

    step = 1 << 16
    for c0 in range(0, len(ids), step):
        for i, (x, p) in enumerate(zip(ids[c0:c0 + step].tolist(), part[c0:c0 + step].tolist()), c0):
            half = size[x] / 2
            for h in (0, 1):
                key = 2 * x + h
                near = caches[p]
                if key in near:
                    near.move_to_end(key)
                    continue
                if h != p:
                    home = caches[h]
                    if key in home:
                        home.move_to_end(key)
                        put(p, key, half)
                        continue
                    put(h, key, half)
                miss[i] += 0.5
                put(p, key, half)
        bar.update(min(step, len(ids) - c0))
    return miss


def _run_trace(P: int, cap: int, progs: dict, segs: list, data_bytes: np.ndarray, n_kinds: int,
               step_time=None, partitions: int = 1, progress: bool = False, desc: str = "trace",
               static: bool = False) -> dict:
    """Play the programs through the simulated L2 (see the module doc, policy "trace").

    progs (arrays in launch order): ``kind`` (index of the kernel the program counts for), ``own``
    (data object of its own tile, loaded at step 0), ``lut`` and ``store`` (bytes streamed at step 0
    and at its last step), ``steps`` (1 + LUT entries). segs: ``(visits, prog, line, base, step0)``:
    program ``prog`` walks line ``line`` of ``visits`` from its step ``step0 + 1`` on, the
    sub-objects offset by ``base``. data_bytes: size of every data object. step_time: time of one
    step per kind (default 1 for all). partitions: 1 (one LRU of ``cap`` bytes) or 2 (two of
    ``cap / 2``, programs on alternate slots, :func:`_lru_partitioned`). progress: show a bar
    (``desc``) over the simulated references. static: the persistent kernels' deal of programs to
    slots (:func:`_schedule`).

    Returns per kind: ``miss`` (data bytes read from DRAM), ``first`` (data bytes referenced for
    the first time: the compulsory part of ``miss``)."""
    n = len(progs["kind"])
    n_data = len(data_bytes)
    cost = np.ones(n_kinds) if step_time is None else np.asarray(step_time, dtype=np.float64)
    pcost = cost[progs["kind"]]
    start, slot = _schedule(progs["steps"] * pcost, P, static)
    ar = np.arange(n, dtype=np.int64)
    I_ = _TRACE_INTRA
    times = [start, start, start + (progs["steps"] - 1) * pcost]
    intras = [np.zeros(n, np.int64), np.ones(n, np.int64), np.full(n, I_ - 1, np.int64)]
    progs_of = [ar, ar, ar]
    objs = [np.asarray(progs["own"], dtype=np.int64), n_data + ar, n_data + n + ar]
    for vis, pr, line, base, step0 in segs:
        lo, hi = vis.ptr[line], vis.ptr[line + 1]
        ln = hi - lo
        tot = int(ln.sum())
        if not tot:
            continue
        idx = np.repeat(lo - (np.cumsum(ln) - ln), ln) + np.arange(tot)
        prr = np.repeat(pr, ln)
        if int(vis.intra[idx].max(initial=0)) >= I_ - 1:
            raise ValueError("trace: too many sub-objects per lookup-table entry")
        times.append(start[prr] + (np.repeat(step0, ln) + 1 + vis.step[idx]) * pcost[prr])
        intras.append(vis.intra[idx])
        progs_of.append(prr)
        objs.append(np.repeat(base, ln) + vis.obj[idx])
        del idx
    prog = np.concatenate(progs_of)
    del progs_of
    # time, then slot (round-robin within a time), then the sub-object ordinal
    order = np.lexsort((np.concatenate(intras), slot[prog], np.concatenate(times)))
    del times, intras
    obj = np.concatenate(objs)[order]
    prog = prog[order]
    del objs, order
    kind = progs["kind"][prog].astype(np.int8)
    size = np.concatenate([data_bytes, progs["lut"], progs["store"]]).astype(np.int64)
    with progress_bar(progress, len(obj), desc, "loads") as bar:
        if partitions == 1:
            miss = _lru_misses(obj, size.tolist(), cap, bar).astype(np.float64)
        else:
            miss = _lru_partitioned(obj, slot[prog] % 2, size.tolist(), cap // 2, bar)
    data = obj < n_data
    out = {"miss": np.bincount(kind, weights=np.where(data, miss * size[obj], 0.0), minlength=n_kinds)}
    _, fi = np.unique(obj, return_index=True)
    fi = fi[data[fi]]
    out["first"] = np.bincount(kind[fi], weights=size[obj[fi]], minlength=n_kinds)
    return out


def _sub_sizes(length: int, unit: int, per_item: float) -> np.ndarray:
    """Bytes of the sub-objects of ``unit`` rows (keys) over ``length``, ``per_item`` bytes each."""
    t = np.arange(-(-length // unit))
    return (np.minimum((t + 1) * unit, length) - t * unit) * float(per_item)


def _launch(n_groups: int, tiles: np.ndarray, tile_major: bool):
    """``(group, tile)`` of every program in launch order: head-major (every tile of a group, in
    ``tiles`` order, before the next group) or tile-major (``tiles[r]`` of every group before
    ``tiles[r + 1]``)."""
    n_t = len(tiles)
    if tile_major:
        return np.tile(np.arange(n_groups), n_t), np.repeat(tiles, n_groups)
    return np.repeat(np.arange(n_groups), n_t), np.tile(tiles, n_groups)


def _trace_forward(geo: _Geometry, p: TrafficParams, progress: bool = False, label: str = "", *,
                   order: str | None = None, tile_major: bool = False, lut: tuple = (16, 4),
                   static: bool = False) -> dict:
    """Forward as one trace: data objects Q tiles (own) and K+V layout blocks (per batch·kv-head).
    ``order``, ``tile_major``, ``lut`` as in :func:`.kernels._row_kernel`; ``static``: a persistent
    kernel's deal (:func:`_schedule`)."""
    B, H, Hkv, G = p.batch, p.heads, p.hkv, p.heads // p.hkv
    D, e = p.head_dim, p.elem
    bm_t = p.tiles.fwd_block_m
    t_row, t_h = _tiles(geo.q_len, bm_t, geo.bm)
    n_t = len(t_row)
    perm = _perm(order or p.program_order, geo, geo.row_cnt, geo.row_part, t_row)
    tiles = np.arange(n_t) if perm is None else perm
    q_sz = _sub_sizes(geo.q_len, bm_t, D * e)
    kv_sz = _sub_sizes(geo.kv_len, geo.bn, 2 * D * e)
    n_q, n_kv = len(q_sz), len(kv_sz)
    vis = _visits(geo, "row", geo.bn)
    bh, t = _launch(B * H, tiles, tile_major)
    b, h = bh // H, bh % H
    z = _instances(geo, b, h)
    cnt = geo.row_cnt[z, t_row[t]].astype(np.int64)
    progs = {"kind": np.zeros(len(t), dtype=np.int64), "own": bh * n_q + t,
             "lut": lut[0] + lut[1] * cnt.astype(np.float64), "store": (D * e + 4.0) * t_h[t], "steps": 1 + cnt}
    segs = [(vis, np.arange(len(t)), z * geo.tr + t_row[t], B * H * n_q + (b * Hkv + h // G) * n_kv,
             np.zeros(len(t), dtype=np.int64))]
    data = np.concatenate([np.tile(q_sz, B * H), np.tile(kv_sz, B * Hkv)])
    r = _run_trace(p.programs_in_flight("fwd"), p.l2_bytes, progs, segs, data, 1, partitions=p.l2_partitions,
                   progress=progress, desc=f"{label}forward", static=static)
    return {"fwd": (float(r["miss"][0]), float(r["first"][0]))}


def _trace_backward(geo: _Geometry, p: TrafficParams, progress: bool = False, label: str = "", *,
                    parts: tuple = ("bwd_dkdv", "bwd_dq"), kv_order: str | None = None,
                    q_order: str | None = None, tile_major: bool = False, lut: tuple = (16, 4),
                    acc_row: int = 0, static: bool = False) -> dict:
    """dK/dV and dQ programs as one trace (``bwd_fused``, in ``bwd_order``) or as two. Data objects:
    Q+dO+LSE+δ of ``dq_block_m`` rows (per batch·head) and K+V of ``dkdv_block_n`` keys (per
    batch·kv-head); each program's own tile is one of them. Without ``bwd_fused``, ``parts`` says
    which of the two launches to play; ``kv_order``/``q_order``, ``tile_major``, ``lut`` as in
    :func:`.kernels._row_kernel`; ``acc_row`` as in :func:`.kernels._dkdv_kernel` (the row objects
    grow by it, and the dK/dV result gains a third number: the accumulator's share of its misses);
    ``static``: persistent kernels' deal (:func:`_schedule`; two launches only)."""
    B, H, Hkv, G = p.batch, p.heads, p.hkv, p.heads // p.hkv
    D, e = p.head_dim, p.elem
    ur, uc = p.tiles.dq_block_m, p.tiles.dkdv_block_n
    q_sz = _sub_sizes(geo.q_len, ur, 2 * D * e + 8 + acc_row)
    kv_sz = _sub_sizes(geo.kv_len, uc, 2 * D * e)
    n_q, n_kv = len(q_sz), len(kv_sz)
    kv_base = B * H * n_q
    data = np.concatenate([np.tile(q_sz, B * H), np.tile(kv_sz, B * Hkv)])
    # dK/dV programs (kind 0): key tile u of batch·kv-head bk; G line walks, one per query head
    u_col, u_w = _tiles(geo.kv_len, uc, geo.bn)
    n_u = len(u_col)
    perm = _perm(kv_order or p.program_order, geo, geo.col_cnt, geo.col_part, u_col)
    bk, u = _launch(B * Hkv, np.arange(n_u) if perm is None else perm, tile_major)
    vis_c = _visits(geo, "col", ur)
    kv = {"kind": np.zeros(len(u), dtype=np.int64), "own": kv_base + bk * n_kv + u,
          "store": 2.0 * D * e * u_w[u]}
    n_ent = np.zeros(len(u), dtype=np.int64)
    kv_segs = []
    for g in range(G):
        b, h = bk // Hkv, (bk % Hkv) * G + g
        z = _instances(geo, b, h)
        c = geo.col_cnt[z, u_col[u]].astype(np.int64)
        kv_segs.append((vis_c, z * geo.tc + u_col[u], (b * H + h) * n_q, n_ent.copy()))
        n_ent += c
    kv.update(lut=float(lut[0]) * G + lut[1] * n_ent.astype(np.float64), steps=1 + n_ent)
    # dQ programs (kind 1): query tile t of batch·head bh
    t_row, t_h = _tiles(geo.q_len, ur, geo.bm)
    n_t = len(t_row)
    perm = _perm(q_order or p.program_order, geo, geo.row_cnt, geo.row_part, t_row)
    bh, t = _launch(B * H, np.arange(n_t) if perm is None else perm, tile_major)
    b, h = bh // H, bh % H
    z = _instances(geo, b, h)
    cnt = geo.row_cnt[z, t_row[t]].astype(np.int64)
    vis_r = _visits(geo, "row", uc)
    dq = {"kind": np.ones(len(t), dtype=np.int64), "own": bh * n_q + t,
          "lut": lut[0] + lut[1] * cnt.astype(np.float64),
          "store": float(D * e) * t_h[t], "steps": 1 + cnt}
    dq_segs = [(vis_r, z * geo.tr + t_row[t], kv_base + (b * Hkv + h // G) * n_kv, np.zeros(len(t), np.int64))]

    def run(parts, P, what):
        """parts: [(progs, segs, program index in the stream)]; kinds 0 and 1 are dK/dV and dQ."""
        n = sum(len(pr["kind"]) for pr, _, _ in parts)
        progs = {k: np.empty(n, dtype=np.float64 if k in ("lut", "store") else np.int64)
                 for k in ("kind", "own", "lut", "store", "steps")}
        segs = []
        for pr, sg, pos in parts:
            for k in progs:
                progs[k][pos] = pr[k]
            segs += [(vis, pos, line, base, s0) for vis, line, base, s0 in sg]
        return _run_trace(P, p.l2_bytes, progs, segs, data, 2, partitions=p.l2_partitions,
                          step_time=[p.step_time_of("bwd_dkdv"), p.step_time_of("bwd_dq")],
                          progress=progress, desc=f"{label}{what}", static=static and not p.bwd_fused)

    n_kvp, n_qp = len(u), len(t)
    if not p.bwd_fused:
        out = {}
        if "bwd_dkdv" in parts:
            r0 = run([(kv, kv_segs, np.arange(n_kvp))], p.programs_in_flight("bwd_dkdv"), "backward dK/dV")
            miss = float(r0["miss"][0])
            out["bwd_dkdv"] = (miss, float(r0["first"][0]))
            if acc_row:  # the accumulator's share of the row objects' misses (own K/V: each once)
                kv_own = float(kv_sz.sum()) * B * Hkv
                out["acc"] = (miss - kv_own) * acc_row / (2 * D * e + 8 + acc_row)
        if "bwd_dq" in parts:
            r1 = run([(dq, dq_segs, np.arange(n_qp))], p.programs_in_flight("bwd_dq"), "backward dQ")
            out["bwd_dq"] = (float(r1["miss"][1]), float(r1["first"][1]))
        return out
    if p.bwd_order == "head_major":  # _attn_bwd: per batch·kv-head, its dK/dV items, then its G heads' dQ items
        grp = n_u + G * n_t
        pos_kv = (np.arange(n_kvp) // n_u) * grp + np.arange(n_kvp) % n_u
        pos_q = (bh // G) * grp + n_u + (bh % G) * n_t + np.arange(n_qp) % n_t
    else:  # every dK/dV program, then every dQ program
        pos_kv, pos_q = np.arange(n_kvp), n_kvp + np.arange(n_qp)
    r = run([(kv, kv_segs, pos_kv), (dq, dq_segs, pos_q)], p.programs_in_flight("bwd_dkdv"), "backward")
    return {"bwd_dkdv": (float(r["miss"][0]), float(r["first"][0])),
            "bwd_dq": (float(r["miss"][1]), float(r["first"][1]))}


def _with_trace(k: KernelTraffic, miss_first: tuple, lut_bytes: int) -> KernelTraffic:
    miss, first = miss_first
    dram, comp = miss + lut_bytes, first + lut_bytes
    return replace(k, dram_read_bytes=float(dram), compulsory_read_bytes=int(round(comp)),
                   reread_bytes=float(dram - comp), fits_l2=bool(miss <= 1.01 * first))  # re-reads < 1 %
