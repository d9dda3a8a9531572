"""Problem and machine parameters of the traffic model (:class:`TrafficParams`, :class:`TileSizes`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = ["TileSizes", "TrafficParams", "dtype_bytes", "H100_L2_BYTES", "H100_SMS", "TRACE_MAX_REFERENCES",
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
    the ``fused_backward=False`` kernel option): under ``policy="trace"`` their programs form one reference stream
    in ``bwd_order`` with one L2, so dQ programs can find what dK/dV programs loaded (and with
    ``"phase"`` the first dQ programs overlap the last dK/dV ones). ``False``: two launches, each
    starting with a cold L2 (no head-major rule under the wave policies either)."""
    l2_partitions: int = 2
    """``policy="trace"`` only: ``2`` plays the H100's two L2 partitions of ``l2_bytes / 2`` each,
    every object half homed in each, with near copies of the far half (so data read from both
    partitions is held twice); ``1``: one LRU of ``l2_bytes``. Measured by
    ``benchmarks/experiments/l2_calibration.py``: a sweep read by every SM is re-read from L2 up to 20–24 MiB,
    one read by a single SM per slice up to 28–32 MiB (two partitions predict 25 and 33 MB)."""
    kernels: str = "auto"
    """Which kernels to model: ``"auto"`` (default), the ones the library runs on a Hopper GPU with
    the default kernel options (:func:`blocksparse_fa.ops.select.choose_forward` /
    ``choose_backward``: the Gluon kernels on dense, causal and one-interval-per-row layouts in 16
    bits, the Triton block-sparse kernels elsewhere; :mod:`.gluon`); ``"triton"``: the Triton
    block-sparse kernels for every layout (``backend="triton"`` with ``forward``/``backward``
    ``"triton"`` kernel options). The tile sizes (``tiles``) and ``program_order`` apply to the
    Triton kernels; the Gluon kernels' own are fixed."""
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
        if self.kernels not in ("auto", "triton"):
            raise ValueError(f"kernels must be 'auto' or 'triton', got {self.kernels!r}")
        if self.bwd_order not in ("head_major", "phase"):
            raise ValueError(f"bwd_order must be 'head_major' or 'phase', got {self.bwd_order!r}")
        if self.program_order not in ("grid", "heavy_first"):
            raise ValueError(f"program_order must be 'grid' or 'heavy_first', got {self.program_order!r}")
        dtype_bytes(self.dtype)
        for name, v in asdict(self.tiles).items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"tile size {name} must be a positive int, got {v!r}")
