"""The DRAM level as a wave model (``policy="lru"`` or ``"fraction"``; milliseconds at any size).

Simple on purpose; every assumption is listed:

1. Programs start in grid order (tile index fastest, then batch·head — the kernels' launch grids;
   ``program_order="heavy_first"`` sorts each head's tiles by decreasing cost, as the kernels' work
   lists do) and run in *waves* of ``P = n_sm × occupancy`` consecutive programs (occupancy per
   kernel, default 1).
2. Within a wave, programs that load the same tile share one DRAM fetch (they run concurrently
   and sweep their column-sorted lookup tables in step, so the second load comes shortly after the
   first): the *wave-distinct* objects are the candidates for DRAM traffic.
3. An object (a layout block's K+V for the forward and dQ; its Q+dO+LSE+δ rows for dK/dV) that a
   wave ``w`` needs and an earlier wave ``a`` already loaded is a *re-read*. Its reuse distance
   ``D`` is the number of distinct bytes brought into L2 in waves ``a+1 … w``: the wave-distinct
   objects first referenced after ``a`` plus everything streamed through L2 in those waves (the
   programs' own Q/O/LSE tiles, outputs, lookup tables).
4. A re-read hits L2 if ``D ≤ C`` (the L2 capacity); otherwise it hits with probability ``C / D``
   (``policy="fraction"``: the stationary hit rate of a cache of ``C`` bytes under uniformly
   scattered references to ``D`` bytes) or never (``policy="lru"``: strict LRU with a cyclic
   sweep; the default). The default was chosen after measuring: on the H100 (docs/traffic.md,
   random block masks at N = 131072) "fraction" predicted 2–2.5× fewer DRAM bytes than ncu
   measured for both our kernels and FlexAttention, while "lru" matched the forward within 3 % at
   five of six densities.
5. DRAM reads = compulsory bytes + Σ re-read bytes × miss probability. DRAM writes = outputs,
   written once (write-back; ncu may see less when dirty lines are still in L2 at kernel end).
"""

from __future__ import annotations

import numpy as np

from .params import TrafficParams


def _wave_segments(n_groups: int, per_group: int, P: int):
    """Split programs ``g * per_group + t`` (grid order) into waves of P: yields (g, w, t0, t1)."""
    for g in range(n_groups):
        p0 = g * per_group
        for w in range(p0 // P, (p0 + per_group - 1) // P + 1):
            yield g, w, max(0, w * P - p0), min(per_group, (w + 1) * P - p0)


def _wave_programs(n_groups: int, per_group: int, P: int, tile_major: bool):
    """Waves of P programs in launch order: yields (g, w, ranks), the ranks (positions in the
    group's tile order) of group ``g``'s programs in wave ``w``. Head-major launches run every tile
    of a group before the next group (:func:`_wave_segments`); tile-major launches the tile of
    rank r of every group before rank r + 1 (the persistent Gluon kernels on interval layouts)."""
    if not tile_major:
        for g, w, t0, t1 in _wave_segments(n_groups, per_group, P):
            yield g, w, np.arange(t0, t1)
        return
    n = n_groups * per_group
    for w in range(-(-n // P)):
        k = np.arange(w * P, min(n, (w + 1) * P))
        r, g = k // n_groups, k % n_groups
        for gg in np.unique(g):
            yield int(gg), w, r[g == gg]


class _WaveRefs:
    """Collects the wave-distinct objects, wave by wave (segments arrive in grid order)."""

    def __init__(self, n_waves: int, dedup: bool):
        self.objs: list = [[] for _ in range(n_waves)]
        self.dedup = dedup

    def add(self, w: int, objs: np.ndarray) -> None:
        if len(objs):
            self.objs[w].append(objs)

    def per_wave(self):
        for parts in self.objs:
            if not parts:
                yield np.zeros(0, dtype=np.int64)
            elif len(parts) == 1:
                yield parts[0]
            else:
                cat = np.concatenate(parts)
                yield np.unique(cat) if self.dedup else cat


def _wave_policy(p: TrafficParams) -> str:
    """The wave model's policy (under "trace" it still gives the wave diagnostics, as "lru")."""
    return "lru" if p.policy == "trace" else p.policy


def _reuse(refs: _WaveRefs, obj_bytes: np.ndarray, stream_w: np.ndarray, l2: int, policy: str) -> dict:
    """Compulsory and re-read bytes of a wave-distinct reference stream (see the module doc)."""
    n_waves = len(stream_w)
    last = np.full(len(obj_bytes), -1, dtype=np.int64)
    os_, prevs, lens = [], [], np.zeros(n_waves, dtype=np.int64)
    for w, objs in enumerate(refs.per_wave()):
        objs = np.asarray(objs, dtype=np.int64)
        os_.append(objs)
        prevs.append(last[objs])
        last[objs] = w
        lens[w] = len(objs)
    o = np.concatenate(os_) if os_ else np.zeros(0, np.int64)
    if not len(o):
        return {"compulsory": 0, "reread": 0.0, "reuse": 0, "reuse_max": 0,
                "wave_distinct": 0, "footprint_max": int(stream_w.max(initial=0))}
    prev = np.concatenate(prevs)
    w = np.repeat(np.arange(n_waves, dtype=np.int64), lens)
    b = obj_bytes[o].astype(np.float64)
    first = prev < 0
    footprint = np.bincount(w, weights=b, minlength=n_waves) + stream_w
    out = {"compulsory": int(b[first].sum()), "wave_distinct": int(b.sum()),
           "footprint_max": int(footprint.max()), "reuse": int(b[~first].sum())}
    rr = np.flatnonzero(~first)
    if not len(rr):
        out.update(reread=0.0, reuse_max=0)
        return out
    S = np.concatenate([[0.0], np.cumsum(stream_w)])
    wave_start = np.concatenate([[0], np.cumsum(lens)])
    rr = rr[np.argsort(prev[rr], kind="stable")]
    pa = prev[rr]
    cuts = np.flatnonzero(np.diff(pa)) + 1
    D = np.empty(len(rr))
    for lo_i, hi_i in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(rr)]])):
        a = int(pa[lo_i])
        wq = w[rr[lo_i:hi_i]]
        wmax = int(wq.max())
        lo, hi = wave_start[a + 1], wave_start[wmax + 1]
        sel = prev[lo:hi] <= a  # first reference after wave a: distinct bytes in waves a+1 .. w
        cum = np.cumsum(np.bincount(w[lo:hi][sel] - a - 1, weights=b[lo:hi][sel], minlength=wmax - a))
        D[lo_i:hi_i] = cum[wq - a - 1] + S[wq + 1] - S[a + 1]
    if policy == "lru":
        hit = (D <= l2).astype(np.float64)
    else:
        hit = np.minimum(1.0, l2 / D)
    out.update(reread=float((b[rr] * (1.0 - hit)).sum()), reuse_max=int(D.max()))
    return out

