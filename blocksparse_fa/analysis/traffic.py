"""Three-level traffic model of the block-sparse kernels: DRAM → L2 → shared memory / registers.

The FlashAttention paper counts accesses between two levels (HBM and SRAM). On a Hopper GPU a
third level sits between them: a 50 MB L2 that every SM reads through. The two costs Proposition 4
talks about then split:

* **L2 → SM bytes** (what the SMs load; ncu ``lts__t_sectors_srcunit_tex_op_read`` × 32 B): each
  program loads its own tiles, so this is an exact sum over the programs and their lookup-table
  entries — linear in the number of visited blocks, i.e. in the block density s.
* **DRAM bytes** (ncu ``dram__bytes_read`` / ``dram__bytes_write``): a tile that several programs
  load comes from DRAM only when L2 no longer holds it. Compulsory traffic (every input byte that
  is touched read once, every output written once) is a floor; re-reads come on top when the
  re-used data does not stay in L2.

How the DRAM estimate works (simple on purpose; every assumption is listed):

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

``policy="trace"`` replaces steps 1–5 for the DRAM reads by a trace-driven simulation (the wave
numbers ``shared_in_wave_bytes``, ``reuse_bytes``, ``reuse_distance_max``, ``wave_footprint_max``
are still reported, from the wave analysis under "lru"):

* Programs start in launch order (as above, ``program_order``), at most ``P`` at once; a program
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
  the thresholds ``benchmarks/l2_calibration.py`` measured on the H100 (20–24 MiB and 28–32 MiB).
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
  partition, work-list splits, L2 sectors / partial lines, set associativity. The cost is one or
  two Python LRU steps per reference: N = 131072, H = 4, all blocks (4.2·10⁶ forward and 8.4·10⁶
  backward references) take about 10 s with two partitions.

The kernels modelled (``blocksparse_fa/kernels``, issue 3): ``_attn_fwd`` (one program per query
tile × batch·head; Q once, K/V per visited key block, writes O and LSE), ``_attn_bwd_preprocess``
(reads O, dO, writes δ), and ``_attn_bwd``, whose dK/dV programs (one per key tile ×
batch·kv-head; K/V once, then per query head of the GQA group and per column-LUT entry Q, dO, LSE,
δ; writes dK, dV) and dQ programs (one per query tile × batch·head; Q, dO, LSE, δ once, K/V per
entry, writes dQ) run in one launch or two; the model counts them as ``bwd_dkdv`` and ``bwd_dq``.
In the one launch the grid goes head by head (``TrafficParams.bwd_order="head_major"``), so when
one GQA group's Q, dO, LSE, δ, K, V fit in L2 the dQ programs find them there and read only their
lookup tables from DRAM. Lookup tables: each program reads 4 int32 row pointers and 4 bytes per
entry. Only the valid rows/keys of ragged edge tiles are counted (masked loads move nothing).

Standard attention is the paper's Algorithm 0 (forward ``4Nd + 4N²`` elements per head) and
Algorithm 3 (backward ``8Nd + 7N²``), with S, P, dP, dS stored in the input dtype and all of it
going through DRAM (they are N² per head, far beyond L2 at the lengths that matter). Its L2 → SM
bytes are the same element counts, a lower bound (tiled matmuls re-read their operands from L2).
Dense FlashAttention is this same model on the all-full layout of the same lengths and block size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np

from .iosim import standard_attention, standard_attention_backward

__all__ = ["TileSizes", "TrafficParams", "KernelTraffic", "Totals", "StandardTraffic", "TrafficReport",
           "traffic_model", "dtype_bytes", "H100_L2_BYTES", "H100_SMS", "format_bytes", "TRACE_MAX_REFERENCES",
           "TraceTooLargeError"]

H100_L2_BYTES = 50 * 2**20
H100_SMS = 132
H100_STEP_TIME = {"bwd_dkdv": 1.6, "bwd_dq": 1.0}  # relative time per LUT entry, see TrafficParams.step_time
TRACE_MAX_REFERENCES = 60_000_000
"""``policy="trace"`` simulates every object load in Python (about 10⁶ per second with two
partitions); above this many it refuses with :class:`TraceTooLargeError` (the wave policies have
no such limit)."""


class TraceTooLargeError(ValueError):
    """``policy="trace"`` would simulate more than :data:`TRACE_MAX_REFERENCES` loads."""

_DTYPES = {"fp16": 2, "float16": 2, "half": 2, "bf16": 2, "bfloat16": 2, "fp32": 4, "float32": 4, "float": 4}


def dtype_bytes(dtype) -> int:
    """Bytes per element of ``"bf16"``/``"fp16"``/``"fp32"`` (or a ``torch.dtype``)."""
    name = str(dtype).replace("torch.", "").lower()
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of fp16, bf16, fp32, got {dtype!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class TileSizes:
    """Kernel tile sizes (each must divide the layout block along its axis)."""

    fwd_block_m: int = 128
    fwd_block_n: int = 64
    dkdv_block_m: int = 64
    dkdv_block_n: int = 64
    dq_block_m: int = 64
    dq_block_n: int = 64
    preprocess_block_m: int = 64


@dataclass(frozen=True)
class TrafficParams:
    """Problem and machine. ``kv_heads`` defaults to ``heads`` (no GQA)."""

    batch: int = 1
    heads: int = 16
    kv_heads: int | None = None
    head_dim: int = 128
    dtype: str = "bf16"
    tiles: TileSizes = field(default_factory=TileSizes)
    l2_bytes: int = H100_L2_BYTES
    n_sm: int = H100_SMS
    occupancy: int | dict = 1
    """Programs resident per SM: one int, or a dict by kernel name (``"fwd"``, ``"bwd_preprocess"``,
    ``"bwd_dkdv"``, ``"bwd_dq"``; missing names default to 1)."""
    policy: str = "lru"
    """DRAM level: ``"lru"`` (default; fast) or ``"fraction"`` (the wave model), or ``"trace"`` (a
    simulation of the programs' interleaved loads through the L2; see the module doc). ``"trace"``
    is what matches the H100 in both regimes of docs/traffic.md (the CLI and the GPU report use it
    by default); the wave model runs in milliseconds at any size and suits quick what-ifs."""
    program_order: str = "grid"
    """``"grid"``: tiles in index order; ``"heavy_first"``: tiles of each head sorted by decreasing
    LUT cost (unmasked entries + 1.5 x masked + 1), as the kernels' work lists order them
    (``blocksparse_fa/kernels/schedule.py``; layouts without batch dims only; split tiles and the
    combine kernel are not modelled)."""
    bwd_order: str = "head_major"
    """Grid order of the one-launch backward (``_attn_bwd``): ``"head_major"`` (the default of the
    kernels when no tile is split): the dQ programs of a head run right after its dK/dV programs,
    so when one GQA group's Q, dO, LSE, δ, K and V fit in L2 the dQ programs read them from L2, not
    DRAM; ``"phase"``: every dK/dV program first, then every dQ program (the dQ part re-reads its
    inputs from DRAM as modelled for a separate kernel). Under ``policy="trace"`` both orders are
    played through the simulated L2 (with ``bwd_fused``), not by this all-or-nothing rule."""
    bwd_fused: bool = True
    """dK/dV and dQ run in one launch (``_attn_bwd`` with both parts, what the kernels do unless
    ``set_fused_backward(False)``): under ``policy="trace"`` their programs form one reference stream
    in ``bwd_order`` with one L2, so dQ programs can find what dK/dV programs loaded (and with
    ``"phase"`` the first dQ programs overlap the last dK/dV ones). ``False``: two launches, each
    starting with a cold L2 (no head-major rule under the wave policies either)."""
    l2_partitions: int = 2
    """``policy="trace"`` only: ``2`` plays the H100's two L2 partitions of ``l2_bytes / 2`` each,
    every object half homed in each, with near copies of the far half (so data read from both
    partitions is held twice); ``1``: one LRU of ``l2_bytes``. Measured by
    ``benchmarks/l2_calibration.py``: a sweep read by every SM is re-read from L2 up to 20–24 MiB,
    one read by a single SM per slice up to 28–32 MiB (two partitions predict 25 and 33 MB)."""
    step_time: dict = field(default_factory=lambda: dict(H100_STEP_TIME))
    """``policy="trace"`` only: time of one lookup-table entry by kernel (``"fwd"``, ``"bwd_dkdv"``,
    ``"bwd_dq"``; missing names 1.0). It matters where programs of two kernels share a launch (the
    one-launch backward): their different speeds desynchronise the waves. Default: dK/dV 1.6 × dQ,
    the ratio of the two kernels' times run apart at s = 1 on the H100 (142.5 / 88.8 ms, equal
    program and entry counts; docs/traffic.md)."""

    @property
    def hkv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def elem(self) -> int:
        return dtype_bytes(self.dtype)

    def occupancy_of(self, kernel: str) -> int:
        if isinstance(self.occupancy, dict):
            return int(self.occupancy.get(kernel, 1))
        return int(self.occupancy)

    def step_time_of(self, kernel: str) -> float:
        return float(self.step_time.get(kernel, 1.0))

    def programs_in_flight(self, kernel: str = "fwd") -> int:
        return self.n_sm * self.occupancy_of(kernel)

    def check(self) -> None:
        occ = self.occupancy.values() if isinstance(self.occupancy, dict) else [self.occupancy]
        if isinstance(self.occupancy, dict):
            bad = set(self.occupancy) - {"fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq"}
            if bad:
                raise ValueError(f"occupancy: unknown kernel names {sorted(bad)}")
        for name, v in [(n, getattr(self, n)) for n in ("batch", "heads", "head_dim", "n_sm", "l2_bytes")] + \
                [("occupancy", o) for o in occ]:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.hkv < 1 or self.heads % self.hkv:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.hkv})")
        if self.policy not in ("fraction", "lru", "trace"):
            raise ValueError(f"policy must be 'fraction', 'lru' or 'trace', got {self.policy!r}")
        if not isinstance(self.bwd_fused, (bool, np.bool_)):
            raise ValueError(f"bwd_fused must be a bool, got {self.bwd_fused!r}")
        if self.l2_partitions not in (1, 2):
            raise ValueError(f"l2_partitions must be 1 or 2, got {self.l2_partitions!r}")
        if not isinstance(self.step_time, dict):
            raise ValueError(f"step_time must be a dict by kernel name, got {self.step_time!r}")
        bad = set(self.step_time) - {"fwd", "bwd_dkdv", "bwd_dq"}
        if bad:
            raise ValueError(f"step_time: unknown kernel names {sorted(bad)} (expected fwd, bwd_dkdv, bwd_dq)")
        for k, v in self.step_time.items():
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not v > 0:
                raise ValueError(f"step_time[{k!r}] must be a positive number, got {v!r}")
        if self.bwd_order not in ("head_major", "phase"):
            raise ValueError(f"bwd_order must be 'head_major' or 'phase', got {self.bwd_order!r}")
        if self.program_order not in ("grid", "heavy_first"):
            raise ValueError(f"program_order must be 'grid' or 'heavy_first', got {self.program_order!r}")
        dtype_bytes(self.dtype)
        for name, v in asdict(self.tiles).items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"tile size {name} must be a positive int, got {v!r}")


@dataclass
class KernelTraffic:
    """Predicted traffic of one kernel launch.

    Attributes:
        name: kernel.
        programs: grid size; waves: ``ceil(programs / programs_in_flight)``.
        l2_to_sm_bytes: bytes loaded by the SMs (L2 → shared memory / registers).
        sm_to_l2_bytes: bytes stored by the SMs.
        loads, stores: the same by tensor.
        dram_read_bytes: predicted DRAM reads; dram_write_bytes: outputs written once.
        compulsory_read_bytes: inputs touched, each read once (the floor of dram_read_bytes).
        reread_bytes: DRAM re-reads on top of the compulsory bytes (L2 misses of re-used data).
        shared_in_wave_bytes: loads of re-used data served by L2 because programs of the same wave
            share them.
        reuse_bytes: loads of data an earlier wave already loaded (candidates for re-reads).
        reuse_distance_max: largest reuse distance ``D`` (0 when nothing is re-used across waves).
        wave_footprint_max: largest distinct bytes (re-used objects + streamed) of one wave.
        fits_l2: every cross-wave reuse distance within the L2 capacity (no re-reads).
    """

    name: str
    programs: int
    waves: int
    l2_to_sm_bytes: int
    sm_to_l2_bytes: int
    loads: dict
    stores: dict
    dram_read_bytes: float
    dram_write_bytes: int
    compulsory_read_bytes: int
    reread_bytes: float = 0.0
    shared_in_wave_bytes: int = 0
    reuse_bytes: int = 0
    reuse_distance_max: int = 0
    wave_footprint_max: int = 0
    fits_l2: bool = True

    @property
    def dram_bytes(self) -> float:
        return self.dram_read_bytes + self.dram_write_bytes


@dataclass
class Totals:
    """Sums over kernels."""

    l2_to_sm_bytes: float = 0.0
    sm_to_l2_bytes: float = 0.0
    dram_read_bytes: float = 0.0
    dram_write_bytes: float = 0.0
    compulsory_read_bytes: float = 0.0

    @property
    def dram_bytes(self) -> float:
        return self.dram_read_bytes + self.dram_write_bytes

    @classmethod
    def of(cls, kernels) -> "Totals":
        t = cls()
        for k in kernels:
            t.l2_to_sm_bytes += k.l2_to_sm_bytes
            t.sm_to_l2_bytes += k.sm_to_l2_bytes
            t.dram_read_bytes += k.dram_read_bytes
            t.dram_write_bytes += k.dram_write_bytes
            t.compulsory_read_bytes += k.compulsory_read_bytes
        return t


@dataclass
class StandardTraffic:
    """Standard attention (Algorithm 0 forward, Algorithm 3 backward), all heads, in bytes."""

    fwd_read_bytes: int
    fwd_write_bytes: int
    bwd_read_bytes: int
    bwd_write_bytes: int

    @property
    def fwd_bytes(self) -> int:
        return self.fwd_read_bytes + self.fwd_write_bytes

    @property
    def bwd_bytes(self) -> int:
        return self.bwd_read_bytes + self.bwd_write_bytes

    @property
    def total_bytes(self) -> int:
        return self.fwd_bytes + self.bwd_bytes

    @classmethod
    def compute(cls, q_len: int, kv_len: int, p: TrafficParams) -> "StandardTraffic":
        f = standard_attention(q_len, p.head_dim, kv_len)
        b = standard_attention_backward(q_len, p.head_dim, kv_len)
        n = p.batch * p.heads * p.elem  # K/V expanded per query head, as eager GQA does
        return cls(f.total_reads * n, f.total_writes * n, b.total_reads * n, b.total_writes * n)


@dataclass
class TrafficReport:
    """The model's prediction for one layout and problem.

    ``forward``, ``bwd_preprocess``, ``bwd_dkdv``, ``bwd_dq`` are :class:`KernelTraffic`;
    ``standard`` is :class:`StandardTraffic`; ``dense`` is the report of dense FlashAttention (the
    all-full layout), or None.
    """

    mask: str
    q_len: int
    kv_len: int
    block_size: tuple
    density: float
    visited_blocks: int
    params: TrafficParams
    forward: KernelTraffic
    bwd_preprocess: KernelTraffic
    bwd_dkdv: KernelTraffic
    bwd_dq: KernelTraffic
    standard: StandardTraffic
    dense: "TrafficReport | None" = None

    # -- sums --------------------------------------------------------------------------------------
    @property
    def kernels(self) -> list:
        return [self.forward, self.bwd_preprocess, self.bwd_dkdv, self.bwd_dq]

    @property
    def fwd(self) -> Totals:
        return Totals.of([self.forward])

    @property
    def bwd(self) -> Totals:
        return Totals.of([self.bwd_preprocess, self.bwd_dkdv, self.bwd_dq])

    @property
    def total(self) -> Totals:
        return Totals.of(self.kernels)

    # -- ratios ------------------------------------------------------------------------------------
    def ratios(self) -> dict:
        """``{"vs_dense": {...}, "vs_standard": {...}}`` for fwd, bwd and total (L2 → SM and DRAM
        vs dense FlashAttention; DRAM vs standard attention)."""
        out: dict = {"vs_dense": {}, "vs_standard": {}}
        std = {"fwd": self.standard.fwd_bytes, "bwd": self.standard.bwd_bytes, "total": self.standard.total_bytes}
        for part in ("fwd", "bwd", "total"):
            mine = getattr(self, part)
            if self.dense is not None:
                d = getattr(self.dense, part)
                out["vs_dense"][part] = {"l2_to_sm": _ratio(mine.l2_to_sm_bytes, d.l2_to_sm_bytes),
                                         "dram": _ratio(mine.dram_bytes, d.dram_bytes)}
            out["vs_standard"][part] = {"l2_to_sm": _ratio(mine.l2_to_sm_bytes, std[part]),
                                        "dram": _ratio(mine.dram_bytes, std[part])}
        return out

    def to_dict(self) -> dict:
        d = {
            "mask": self.mask, "q_len": self.q_len, "kv_len": self.kv_len, "block_size": list(self.block_size),
            "density": self.density, "visited_blocks": self.visited_blocks, "params": asdict(self.params),
            "kernels": {k.name: asdict(k) for k in self.kernels},
            "fwd": asdict(self.fwd), "bwd": asdict(self.bwd), "total": asdict(self.total),
            "standard": asdict(self.standard), "ratios": self.ratios(),
        }
        if self.dense is not None:
            dn = self.dense
            d["dense"] = {"fwd": asdict(dn.fwd), "bwd": asdict(dn.bwd), "total": asdict(dn.total)}
        return d

    # -- text --------------------------------------------------------------------------------------
    def format_table(self) -> str:
        p = self.params
        bm, bn = self.block_size
        t = p.tiles
        lines = [
            f"Traffic model: {self.mask}",
            f"  q_len={self.q_len} kv_len={self.kv_len} block=({bm}, {bn})  B={p.batch} H={p.heads} Hkv={p.hkv} "
            f"d={p.head_dim} {p.dtype}",
            f"  block density s={self.density:.4f} ({self.visited_blocks} visited blocks per all heads)  "
            f"L2={p.l2_bytes / 2**20:.1f} MiB  {p.n_sm} SMs x {_fmt_occ(p.occupancy)} program(s) in flight  "
            f"policy={p.policy}" + (("" if p.policy != "trace" else
                                     f" (backward: {'one launch, ' + p.bwd_order if p.bwd_fused else 'two launches'}; "
                                     f"{p.l2_partitions} L2 partition{'s' if p.l2_partitions > 1 else ''})")),
            f"  tiles: fwd {t.fwd_block_m}x{t.fwd_block_n}, dK/dV {t.dkdv_block_m}x{t.dkdv_block_n}, "
            f"dQ {t.dq_block_m}x{t.dq_block_n}; program order: {p.program_order}",
            "",
            f"  {'kernel':<16}{'programs':>9}{'waves':>7}{'L2->SM':>11}{'SM->L2':>11}{'DRAM rd':>11}"
            f"{'compuls.':>11}{'DRAM wr':>11}{'reuse dist':>12}  in L2",
        ]
        for k in self.kernels:
            lines.append(
                f"  {k.name:<16}{k.programs:>9}{k.waves:>7}{format_bytes(k.l2_to_sm_bytes):>11}"
                f"{format_bytes(k.sm_to_l2_bytes):>11}{format_bytes(k.dram_read_bytes):>11}"
                f"{format_bytes(k.compulsory_read_bytes):>11}{format_bytes(k.dram_write_bytes):>11}"
                f"{format_bytes(k.reuse_distance_max) if k.reuse_bytes else '-':>12}  {'yes' if k.fits_l2 else 'NO'}")
        lines.append("")
        lines.append(f"  {'':<16}{'L2->SM':>11}{'SM->L2':>11}{'DRAM rd':>11}{'DRAM wr':>11}{'DRAM':>11}")
        rows = [("forward", self.fwd), ("backward", self.bwd), ("fwd+bwd", self.total)]
        if self.dense is not None:
            rows += [("dense FA fwd", self.dense.fwd), ("dense FA bwd", self.dense.bwd),
                     ("dense FA total", self.dense.total)]
        for name, tt in rows:
            lines.append(f"  {name:<16}{format_bytes(tt.l2_to_sm_bytes):>11}{format_bytes(tt.sm_to_l2_bytes):>11}"
                         f"{format_bytes(tt.dram_read_bytes):>11}{format_bytes(tt.dram_write_bytes):>11}"
                         f"{format_bytes(tt.dram_bytes):>11}")
        if self.dense is not None and self.dense.params.policy != self.params.policy:
            lines.append(f"  (dense FA rows: policy={self.dense.params.policy}, the wave model; the trace of the "
                         "dense layout is over TRACE_MAX_REFERENCES)")
        s = self.standard
        lines.append(f"  {'standard fwd':<16}{'':>11}{'':>11}{format_bytes(s.fwd_read_bytes):>11}"
                     f"{format_bytes(s.fwd_write_bytes):>11}{format_bytes(s.fwd_bytes):>11}   (Algorithm 0: 4Nd+4N^2)")
        lines.append(f"  {'standard bwd':<16}{'':>11}{'':>11}{format_bytes(s.bwd_read_bytes):>11}"
                     f"{format_bytes(s.bwd_write_bytes):>11}{format_bytes(s.bwd_bytes):>11}   (Algorithm 3: 8Nd+7N^2)")
        r = self.ratios()
        lines.append("")
        lines.append(f"  {'ratio':<30}{'fwd':>11}{'bwd':>11}{'total':>11}")
        if r["vs_dense"]:
            for key, label in (("l2_to_sm", "L2->SM vs dense FA"), ("dram", "DRAM vs dense FA")):
                lines.append(f"  {label:<30}" + "".join(f"{_fmt_ratio(r['vs_dense'][q][key]):>11}"
                                                        for q in ("fwd", "bwd", "total")))
        lines.append(f"  {'DRAM vs standard attention':<30}" + "".join(
            f"{_fmt_ratio(r['vs_standard'][q]['dram']):>11}" for q in ("fwd", "bwd", "total")))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_table()


def _fmt_occ(occ) -> str:
    if isinstance(occ, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in occ.items()) + "}"
    return str(occ)


def _ratio(a: float, b: float) -> float:
    return float(a) / float(b) if b else float("nan")


def _fmt_ratio(x: float) -> str:
    if x != x:
        return "n/a"
    return f"{x:.3g}x"


def format_bytes(n: float) -> str:
    """Decimal units (kB, MB, GB), as ncu reports them."""
    n = float(n)
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.3g} {unit}" if n / f < 100 else f"{n / f:.0f} {unit}"
    return f"{n:.0f} B"


# ================================================================================================
# layout geometry
# ================================================================================================
class _Geometry:
    """Per-row / per-column sums of a layout's non-empty blocks, from its run-length segments."""

    def __init__(self, layout):
        self.q_len, self.kv_len = layout.q_len, layout.kv_len
        self.bm, self.bn = layout.block_size
        self.tr, self.tc = layout.shape[-2], layout.shape[-1]
        bs = tuple(layout.batch_shape) or (1, 1)
        self.zb, self.zh = bs
        self.n_inst = self.zb * self.zh
        segs = getattr(layout, "_segs", None)
        if segs is not None:
            sel = segs.state != 0
            rows, starts, ends = segs.rows[sel], segs.starts[sel], segs.ends[sel]
            partial = segs.state[sel] == 1
        else:  # fall back on the public view: one unit segment per block
            rows, cols, _ = layout.nonempty_blocks()
            partial = np.asarray(_) == 1
            rows, starts, ends = np.asarray(rows), np.asarray(cols), np.asarray(cols) + 1
        order = np.argsort(rows * (self.tc + 1) + starts, kind="stable")
        self.seg_row = np.asarray(rows, dtype=np.int64)[order]
        self.seg_start = np.asarray(starts, dtype=np.int64)[order]
        self.seg_end = np.asarray(ends, dtype=np.int64)[order]
        self.seg_partial = np.asarray(partial, dtype=bool)[order]
        # valid rows per layout row, valid keys per layout column (ragged edges)
        r = np.arange(self.tr)
        self.row_h = np.minimum((r + 1) * self.bm, self.q_len) - r * self.bm
        c = np.arange(self.tc)
        self.col_w = np.minimum((c + 1) * self.bn, self.kv_len) - c * self.bn
        wpref = np.concatenate([[0], np.cumsum(self.col_w)])
        nz = self.n_inst * self.tr
        lens = self.seg_end - self.seg_start
        self.row_cnt = np.bincount(self.seg_row, weights=lens, minlength=nz).reshape(self.n_inst, self.tr)
        self.row_part = np.bincount(self.seg_row, weights=lens * self.seg_partial,
                                    minlength=nz).reshape(self.n_inst, self.tr)
        self.row_keys = np.bincount(self.seg_row, weights=wpref[self.seg_end] - wpref[self.seg_start],
                                    minlength=nz).reshape(self.n_inst, self.tr)
        z = self.seg_row // self.tr
        hseg = self.row_h[self.seg_row % self.tr].astype(np.float64)
        n1 = self.n_inst * (self.tc + 1)
        diff_c = (np.bincount(z * (self.tc + 1) + self.seg_start, minlength=n1)
                  - np.bincount(z * (self.tc + 1) + self.seg_end, minlength=n1)).reshape(self.n_inst, -1)
        diff_q = (np.bincount(z * (self.tc + 1) + self.seg_start, weights=hseg, minlength=n1)
                  - np.bincount(z * (self.tc + 1) + self.seg_end, weights=hseg, minlength=n1)).reshape(self.n_inst, -1)
        self.col_cnt = np.cumsum(diff_c, axis=1)[:, : self.tc]
        pz = z[self.seg_partial] * (self.tc + 1)
        diff_p = (np.bincount(pz + self.seg_start[self.seg_partial], minlength=n1)
                  - np.bincount(pz + self.seg_end[self.seg_partial], minlength=n1)).reshape(self.n_inst, -1)
        self.col_part = np.cumsum(diff_p, axis=1)[:, : self.tc]
        self.row_ptr = np.searchsorted(self.seg_row, np.arange(nz + 1))
        self.col_rows = np.cumsum(diff_q, axis=1)[:, : self.tc]
        self.visited = int(lens.sum())
        self.inst_ptr = np.searchsorted(self.seg_row, np.arange(self.n_inst + 1) * self.tr)
        self._row_cache: dict = {}
        self._col_cache: dict = {}

    def instance(self, b: int, h: int) -> int:
        return (b if self.zb > 1 else 0) * self.zh + (h if self.zh > 1 else 0)

    def check_batch(self, B: int, H: int) -> None:
        if self.zb not in (1, B) or self.zh not in (1, H):
            raise ValueError(f"layout batch_shape {(self.zb, self.zh)} does not broadcast to (B, H) = {(B, H)}")

    def cols_of_rows(self, z: int, r0: int, r1: int) -> np.ndarray:
        """Columns with a non-empty block in layout rows ``r0..r1`` (inclusive) of instance z."""
        key = (z, r0, r1)
        hit = self._row_cache.get(key)
        if hit is None:
            lo = np.searchsorted(self.seg_row, z * self.tr + r0, side="left")
            hi = np.searchsorted(self.seg_row, z * self.tr + r1, side="right")
            cover = (np.bincount(self.seg_start[lo:hi], minlength=self.tc + 1)
                     - np.bincount(self.seg_end[lo:hi], minlength=self.tc + 1))
            hit = np.flatnonzero(np.cumsum(cover)[: self.tc] > 0)
            if len(self._row_cache) < 4096:
                self._row_cache[key] = hit
        return hit

    def cols_of_row_set(self, z: int, rows: np.ndarray) -> np.ndarray:
        """Columns with a non-empty block in any of ``rows`` (layout rows of instance z)."""
        g = z * self.tr + np.unique(rows)
        lo, hi = self.row_ptr[g], self.row_ptr[g + 1]
        n = hi - lo
        idx = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
        cover = (np.bincount(self.seg_start[idx], minlength=self.tc + 1)
                 - np.bincount(self.seg_end[idx], minlength=self.tc + 1))
        return np.flatnonzero(np.cumsum(cover)[: self.tc] > 0)

    def rows_of_col_set(self, z: int, cols: np.ndarray) -> np.ndarray:
        """Layout rows with a non-empty block in any of ``cols`` (instance z)."""
        mark = np.zeros(self.tc + 1, dtype=np.int64)
        mark[np.unique(cols) + 1] = 1
        pref = np.cumsum(mark)
        lo, hi = self.inst_ptr[z], self.inst_ptr[z + 1]
        sel = pref[self.seg_end[lo:hi]] - pref[self.seg_start[lo:hi]] > 0
        r = self.seg_row[lo:hi][sel] - z * self.tr
        return r[np.concatenate([[True], r[1:] != r[:-1]])] if len(r) else r

    def rows_of_cols(self, z: int, c0: int, c1: int) -> np.ndarray:
        """Layout rows with a non-empty block in columns ``c0..c1`` (inclusive) of instance z."""
        key = (z, c0, c1)
        hit = self._col_cache.get(key)
        if hit is None:
            lo, hi = self.inst_ptr[z], self.inst_ptr[z + 1]
            s, e = self.seg_start[lo:hi], self.seg_end[lo:hi]
            sel = (s <= c1) & (e > c0)
            r = self.seg_row[lo:hi][sel] - z * self.tr  # sorted
            hit = r[np.concatenate([[True], r[1:] != r[:-1]])] if len(r) else r
            if len(self._col_cache) < 4096:
                self._col_cache[key] = hit
        return hit


def _order(p: TrafficParams, geo: _Geometry, cnt: np.ndarray, part: np.ndarray, blk: np.ndarray):
    """Launch order of the tiles of one head (None: index order)."""
    if p.program_order != "heavy_first" or geo.n_inst != 1:
        return None
    cost = (cnt[0] - part[0])[blk] + 1.5 * part[0][blk] + 1.0
    return np.argsort(-cost, kind="stable")


def _tiles(n: int, tile: int, block: int):
    """Tiles of ``tile`` items over ``n``: their layout block index and valid length."""
    t = np.arange(-(-n // tile))
    return (t * tile) // block, np.minimum((t + 1) * tile, n) - t * tile


# ================================================================================================
# DRAM estimate (waves + reuse distance)
# ================================================================================================
def _wave_segments(n_groups: int, per_group: int, P: int):
    """Split programs ``g * per_group + t`` (grid order) into waves of P: yields (g, w, t0, t1)."""
    for g in range(n_groups):
        p0 = g * per_group
        for w in range(p0 // P, (p0 + per_group - 1) // P + 1):
            yield g, w, max(0, w * P - p0), min(per_group, (w + 1) * P - p0)


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


# ================================================================================================
# kernels
# ================================================================================================
def _row_kernel(name: str, geo: _Geometry, p: TrafficParams, block_m: int, *, q_side_loads: dict,
                q_side_stores: dict, lut_bytes: int) -> KernelTraffic:
    """Forward and dQ: programs (query tile, batch·head) that visit the row LUT and load K/V per entry.

    q_side_loads / q_side_stores: bytes per query row loaded once / stored by each program.
    """
    B, H, G = p.batch, p.heads, p.heads // p.hkv
    D, e = p.head_dim, p.elem
    t_row, t_h = _tiles(geo.q_len, block_m, geo.bm)
    n_t = len(t_row)
    P = p.programs_in_flight(name)
    per_row_load = sum(q_side_loads.values())
    per_row_store = sum(q_side_stores.values())
    perm = _order(p, geo, geo.row_cnt, geo.row_part, t_row)
    mult = np.zeros(geo.n_inst, dtype=np.int64)
    stream_p = np.empty(B * H * n_t)
    for b in range(B):
        for h in range(H):
            z = geo.instance(b, h)
            mult[z] += 1
            st = t_h * (per_row_load + per_row_store) + 16 + 4 * geo.row_cnt[z, t_row]
            stream_p[(b * H + h) * n_t:(b * H + h + 1) * n_t] = st if perm is None else st[perm]
    kv_loads = float(2 * D * e * (mult[:, None] * geo.row_keys[:, t_row]).sum())
    lut_loads = float((mult[:, None] * (16 + 4 * geo.row_cnt[:, t_row])).sum())
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
    for bh, w, t0, t1 in _wave_segments(B * H, n_t, P):
        b, h = divmod(bh, H)
        z = geo.instance(b, h)
        if perm is None:
            cols = geo.cols_of_rows(z, int(t_row[t0]), int(t_row[t1 - 1]))
        else:
            cols = geo.cols_of_row_set(z, t_row[perm[t0:t1]])
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


def _dkdv_kernel(geo: _Geometry, p: TrafficParams, lut_bytes: int) -> KernelTraffic:
    B, H, Hkv, G = p.batch, p.heads, p.hkv, p.heads // p.hkv
    D, e = p.head_dim, p.elem
    u_col, u_w = _tiles(geo.kv_len, p.tiles.dkdv_block_n, geo.bn)
    n_u = len(u_col)
    P = p.programs_in_flight("bwd_dkdv")
    q_obj_row = 2 * D * e + 8  # Q, dO rows + LSE, delta (fp32)
    perm = _order(p, geo, geo.col_cnt, geo.col_part, u_col)
    mult = np.zeros(geo.n_inst, dtype=np.int64)
    stream_p = np.empty(B * Hkv * n_u)
    for b in range(B):
        for hk in range(Hkv):
            lut = np.zeros(n_u)
            for g in range(G):
                z = geo.instance(b, hk * G + g)
                mult[z] += 1
                lut += 16 + 4 * geo.col_cnt[z, u_col]
            st = 4 * D * e * u_w + lut
            stream_p[(b * Hkv + hk) * n_u:(b * Hkv + hk + 1) * n_u] = st if perm is None else st[perm]
    q_loads = float(q_obj_row * (mult[:, None] * geo.col_rows[:, u_col]).sum())
    lut_loads = float((mult[:, None] * (16 + 4 * geo.col_cnt[:, u_col])).sum())
    kv_total = B * Hkv * geo.kv_len * D * e
    loads = {"K": kv_total, "V": kv_total, "Q+dO+LSE+delta": int(q_loads), "LUT": int(lut_loads)}
    stores = {"dK": kv_total, "dV": kv_total}
    n_prog = B * Hkv * n_u
    n_waves = -(-n_prog // P)
    stream_w = np.bincount(np.arange(n_prog) // P, weights=stream_p, minlength=n_waves)
    refs = _WaveRefs(n_waves, dedup=False)  # objects are per query head: never shared
    for bkv, w, u0, u1 in _wave_segments(B * Hkv, n_u, P):
        b, hk = divmod(bkv, Hkv)
        for g in range(G):
            h = hk * G + g
            z = geo.instance(b, h)
            if perm is None:
                rows = geo.rows_of_cols(z, int(u_col[u0]), int(u_col[u1 - 1]))
            else:
                rows = geo.rows_of_col_set(z, u_col[perm[u0:u1]])
            refs.add(w, (b * H + h) * geo.tr + rows)
    obj_bytes = np.tile(float(q_obj_row) * geo.row_h, B * H)
    ru = _reuse(refs, obj_bytes, stream_w, p.l2_bytes, _wave_policy(p))
    compulsory = 2 * kv_total + ru["compulsory"] + lut_bytes
    return KernelTraffic(
        name="bwd_dkdv", programs=n_prog, waves=n_waves, l2_to_sm_bytes=int(sum(loads.values())),
        sm_to_l2_bytes=int(sum(stores.values())), loads=loads, stores=stores,
        dram_read_bytes=compulsory + ru["reread"], dram_write_bytes=int(sum(stores.values())),
        compulsory_read_bytes=int(compulsory), reread_bytes=ru["reread"],
        shared_in_wave_bytes=int(q_loads - ru["wave_distinct"]), reuse_bytes=ru["reuse"],
        reuse_distance_max=ru["reuse_max"], wave_footprint_max=ru["footprint_max"],
        fits_l2=ru["reuse_max"] <= p.l2_bytes)


def _preprocess_kernel(geo: _Geometry, p: TrafficParams) -> KernelTraffic:
    rows = p.batch * p.heads * geo.q_len
    od = rows * p.head_dim * p.elem
    loads = {"O": od, "dO": od}
    stores = {"delta": 4 * rows}
    n_prog = p.batch * p.heads * -(-geo.q_len // p.tiles.preprocess_block_m)
    waves = -(-n_prog // p.programs_in_flight("bwd_preprocess"))
    return KernelTraffic(name="bwd_preprocess", programs=n_prog, waves=waves,
                         l2_to_sm_bytes=2 * od, sm_to_l2_bytes=4 * rows, loads=loads, stores=stores,
                         dram_read_bytes=float(2 * od), dram_write_bytes=4 * rows, compulsory_read_bytes=2 * od)


def _check_tiles(geo: _Geometry, t: TileSizes) -> None:
    for name, tile, block in (("fwd_block_m", t.fwd_block_m, geo.bm), ("fwd_block_n", t.fwd_block_n, geo.bn),
                              ("dkdv_block_m", t.dkdv_block_m, geo.bm), ("dkdv_block_n", t.dkdv_block_n, geo.bn),
                              ("dq_block_m", t.dq_block_m, geo.bm), ("dq_block_n", t.dq_block_n, geo.bn)):
        if block % tile:
            raise ValueError(f"tile {name}={tile} must divide the layout block ({block}), as the kernels require")


def traffic_model(layout, params: TrafficParams | None = None, *, compare: bool = True, **overrides) -> TrafficReport:
    """Predict the bytes each kernel moves for ``layout`` (a :class:`BlockLayout`).

    Args:
        layout: the compiled mask.
        params: problem and machine (:class:`TrafficParams`); keyword ``overrides`` replace fields
            (``heads=8, kv_heads=2, head_dim=64, dtype="fp16", l2_bytes=..., tiles=TileSizes(...)``).
        compare: also model dense FlashAttention (the all-full layout of the same shape) for the
            ratios (costs a second model evaluation).

    Returns:
        A :class:`TrafficReport`.
    """
    p = replace(params or TrafficParams(), **overrides)
    p.check()
    geo = _Geometry(layout)
    geo.check_batch(p.batch, p.heads)
    _check_tiles(geo, p.tiles)
    D, e = p.head_dim, p.elem
    row_lut_bytes = int(layout.row_lut.nbytes)
    col_lut_bytes = int(layout.col_lut.nbytes)
    fwd = _row_kernel("fwd", geo, p, p.tiles.fwd_block_m, q_side_loads={"Q": D * e},
                      q_side_stores={"O": D * e, "LSE": 4}, lut_bytes=row_lut_bytes)
    pre = _preprocess_kernel(geo, p)
    dkdv = _dkdv_kernel(geo, p, col_lut_bytes)
    dq = _row_kernel("bwd_dq", geo, p, p.tiles.dq_block_m, q_side_loads={"Q": D * e, "dO": D * e, "LSE+delta": 8},
                     q_side_stores={"dQ": D * e}, lut_bytes=row_lut_bytes)
    G = p.heads // p.hkv
    group_bytes = G * geo.q_len * (2 * D * e + 8) + 2 * geo.kv_len * D * e
    mult = np.zeros(geo.n_inst, dtype=np.int64)
    for b in range(p.batch):
        for h in range(p.heads):
            mult[geo.instance(b, h)] += 1
    visited = int((mult * geo.row_cnt.sum(axis=1)).sum())
    if p.policy == "trace":
        refs = _trace_references(geo, p, visited)
        if refs > TRACE_MAX_REFERENCES:
            raise TraceTooLargeError(
                f"policy='trace' would simulate about {refs:.2e} loads (limit TRACE_MAX_REFERENCES = "
                f"{TRACE_MAX_REFERENCES:.1e}, about a minute); use policy='lru' (the wave model) for this size")
        from .trace import _trace_backward, _trace_forward, _with_trace

        tr = _trace_forward(geo, p)
        fwd = _with_trace(fwd, tr["fwd"], row_lut_bytes)
        tr = _trace_backward(geo, p)
        dkdv = _with_trace(dkdv, tr["bwd_dkdv"], col_lut_bytes)
        dq = _with_trace(dq, tr["bwd_dq"], row_lut_bytes)
    elif p.bwd_fused and p.bwd_order == "head_major" and group_bytes <= p.l2_bytes:
        # the dQ programs of a head follow its dK/dV programs: their inputs are still in L2
        served = dq.compulsory_read_bytes - row_lut_bytes
        dq = replace(dq, dram_read_bytes=dq.dram_read_bytes - served, compulsory_read_bytes=row_lut_bytes)
    rep = TrafficReport(
        mask=str(layout.mask), q_len=geo.q_len, kv_len=geo.kv_len, block_size=(geo.bm, geo.bn),
        density=float(layout.density), visited_blocks=visited, params=p, forward=fwd, bwd_preprocess=pre,
        bwd_dkdv=dkdv, bwd_dq=dq, standard=StandardTraffic.compute(geo.q_len, geo.kv_len, p))
    if compare:
        dense = _DenseLayout(geo.q_len, geo.kv_len, geo.bm, geo.bn)
        try:
            rep.dense = traffic_model(dense, p, compare=False)
        except TraceTooLargeError:  # dense FA at this size: the wave model (its rows say so)
            rep.dense = traffic_model(dense, replace(p, policy="lru"), compare=False)
    return rep


def _trace_references(geo: "_Geometry", p: TrafficParams, visited: int) -> int:
    """About how many object loads ``policy="trace"`` simulates: per visited block one K+V load in
    the forward and the sub-tiles dK/dV and dQ load in the backward."""
    per = 1 + max(1, geo.bm // p.tiles.dq_block_m) + max(1, geo.bn // p.tiles.dkdv_block_n)
    return int(visited) * per


class _DenseLayout:
    """The all-full layout, with just what the model reads (no LUT is built: dense FlashAttention
    at a million tokens would need 8192² entries)."""

    class _Nbytes:
        def __init__(self, n: int):
            self.nbytes = n

    def __init__(self, q_len: int, kv_len: int, bm: int, bn: int):
        from ..compiler.segments import FULL, Segments

        self.mask = "full"
        self.q_len, self.kv_len, self.block_size, self.batch_shape = q_len, kv_len, (bm, bn), ()
        tr, tc = -(-q_len // bm), -(-kv_len // bn)
        self.shape = (tr, tc)
        self.density = 1.0
        self._segs = Segments.uniform(tr, tc, FULL)
        self.row_lut = self._Nbytes(8 * (tr + 1) + 4 * tr * tc)  # full/part ptr + full idx, int32
        self.col_lut = self._Nbytes(8 * (tc + 1) + 4 * tr * tc)
