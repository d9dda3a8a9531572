"""Three-level traffic model of the block-sparse kernels: DRAM → L2 → shared memory / registers.

The FlashAttention paper counts accesses between two levels (HBM and SRAM). On a Hopper GPU a
third level sits between them: a 50 MB L2 that every SM reads through. The two costs of the paper's
Proposition 4 then split:

* **L2 → SM bytes** (what the SMs load; ncu ``l1tex__m_xbar2l1tex_read_bytes``): each program
  loads its own tiles, so this is an exact sum over the programs and their lookup-table entries,
  linear in the number of visited blocks, i.e. in the block density s.
* **DRAM bytes** (ncu ``dram__bytes_read`` / ``dram__bytes_write``): a tile that several programs
  load comes from DRAM only when L2 no longer holds it. Compulsory traffic (every input byte that
  is touched read once, every output written once) is a floor; re-reads come on top when the
  re-used data does not stay in L2.

Modules, one concern each:

* :mod:`.params`: the problem and the machine (:class:`TrafficParams`, :class:`TileSizes`).
* :mod:`.geometry`: what the model reads from a layout (non-empty blocks per row and column,
  tiles, launch order).
* :mod:`.kernels`: per-kernel L2 → SM counts (exact) and the wave model's DRAM estimate, for
  ``_attn_fwd``, ``_attn_bwd_preprocess`` and the dK/dV and dQ programs of ``_attn_bwd``.
* :mod:`.gluon`: which kernels run (the library's own choice, ``kernels="auto"``) and the blocks
  the Gluon Hopper kernels visit at their own tiles (dense, causal, one interval per row).
* :mod:`.waves`: the wave model of the DRAM level (``policy="lru"`` / ``"fraction"``).
* :mod:`.trace`: the trace-driven DRAM level (``policy="trace"``): the programs' interleaved loads
  played through a simulated L2 with the H100's two partitions.
* :mod:`.report`: the result (:class:`TrafficReport`, its table and dict).
* :mod:`.model`: :func:`traffic_model`, which puts them together.

Standard attention is the paper's Algorithm 0 (forward ``4Nd + 4N²`` elements per head) and
Algorithm 3 (backward ``8Nd + 7N²``), with S, P, dP, dS stored in the input dtype and all of it
going through DRAM (they are N² per head, far beyond L2 at the lengths that matter). Its L2 → SM
bytes are the same element counts, a lower bound (tiled matmuls re-read their operands from L2).
Dense FlashAttention is this same model on the all-full layout of the same lengths and block size.

``docs/traffic.md`` compares the model with Nsight Compute on the H100 (the Triton kernels) and the
H200 (the kernels that run by default).
"""

from .model import traffic_model
from .params import (
    H100_L2_BYTES,
    H100_SMS,
    TRACE_MAX_REFERENCES,
    TileSizes,
    TraceTooLargeError,
    TrafficParams,
    dtype_bytes,
)
from .report import KernelTraffic, StandardTraffic, Totals, TrafficReport, format_bytes

__all__ = ["TileSizes", "TrafficParams", "KernelTraffic", "Totals", "StandardTraffic", "TrafficReport",
           "traffic_model", "dtype_bytes", "H100_L2_BYTES", "H100_SMS", "format_bytes", "TRACE_MAX_REFERENCES",
           "TraceTooLargeError"]
