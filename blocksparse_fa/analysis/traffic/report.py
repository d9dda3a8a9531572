"""What the traffic model returns: bytes per kernel (:class:`KernelTraffic`), sums
(:class:`Totals`), standard attention's counts (:class:`StandardTraffic`) and the report with its
table (:class:`TrafficReport`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..iosim import standard_attention, standard_attention_backward
from .params import TrafficParams


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

    ``forward``, ``bwd_preprocess``, ``bwd_dkdv``, ``bwd_dq`` are :class:`KernelTraffic` (with the
    five-GEMM Gluon backward ``bwd_dq`` is ``_dq_finish``, and ``extra`` holds the fill of its fp32
    accumulator); ``choice``: the forward's and the backward's kernels as
    :class:`~blocksparse_fa.ops.select.Choice` strings (``"gluon:interval"``, ``"triton:blocks"``);
    ``standard`` is :class:`StandardTraffic`; ``dense`` is the report of dense FlashAttention (the
    all-full layout, with the kernels that layout runs), or None.
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
    choice: tuple = ("triton:blocks", "triton:blocks")
    extra: tuple = ()

    # -- sums --------------------------------------------------------------------------------------
    @property
    def kernels(self) -> list:
        return [self.forward, self.bwd_preprocess, self.bwd_dkdv, self.bwd_dq, *self.extra]

    @property
    def fwd(self) -> Totals:
        return Totals.of([self.forward])

    @property
    def bwd(self) -> Totals:
        return Totals.of([self.bwd_preprocess, self.bwd_dkdv, self.bwd_dq, *self.extra])

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
            "choice": list(self.choice),
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
            f"  kernels: forward {self.choice[0]}, backward {self.choice[1]}"
            + ("" if all(c.startswith("gluon") for c in self.choice) else
               f"; Triton tiles: fwd {t.fwd_block_m}x{t.fwd_block_n}, dK/dV {t.dkdv_block_m}x{t.dkdv_block_n}, "
               f"dQ {t.dq_block_m}x{t.dq_block_n}; program order: {p.program_order}"),
            "",
            f"  {'kernel':<22}{'programs':>9}{'waves':>7}{'L2->SM':>11}{'SM->L2':>11}{'DRAM rd':>11}"
            f"{'compuls.':>11}{'DRAM wr':>11}{'reuse dist':>12}  in L2",
        ]
        for k in self.kernels:
            lines.append(
                f"  {k.name:<22}{k.programs:>9}{k.waves:>7}{format_bytes(k.l2_to_sm_bytes):>11}"
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

