"""The FlashAttention paper's IO model as a small simulator: count HBM element accesses.

Two memory levels, as in Dao et al. (2022), "FlashAttention", Section 3.2 / Appendix C: HBM (large,
slow) and on-chip SRAM of ``M`` *elements*. Each function below walks the loops of one algorithm
over its actual block structure (ragged last blocks included) and adds up the elements every
"load from HBM" / "write to HBM" line of the algorithm moves. The counts are exact counts of the
algorithm as written, not asymptotic formulas; the tests and ``benchmarks/experiments/iosim_plots.py`` compare
them with the paper's results:

* Algorithm 0 (standard attention, S and P materialised): ``4Nd + 4N²`` per head.
* Algorithm 1 (FlashAttention, K/V outer loop): ``Bc = ⌈M/4d⌉``, ``Br = min(⌈M/4d⌉, d)``;
  ``K_j, V_j`` read once per outer iteration, ``Q_i, O_i, ℓ_i, m_i`` read and ``O_i, ℓ_i, m_i``
  written per inner iteration. Total ``2Nd + Tc·(3Nd + 4N)`` with ``Tc = ⌈N/Bc⌉`` — Theorem 2's
  ``Θ(N²d²/M)``, leading term ``12N²d²/M``.
* FlashAttention-2 loop order (Q outer): ``Q_i`` read once, ``K_j, V_j`` per inner iteration,
  ``O_i`` and the logsumexp ``L_i`` written once. Block sizes mirror Algorithm 1's rule with the
  roles swapped (the outer, re-read-saving block gets ``⌈M/4d⌉``): ``Br = ⌈M/4d⌉``,
  ``Bc = min(⌈M/4d⌉, d)``. Total ``2Nd + N + Tr·2Nd`` — leading term ``8N²d²/M``.
* Block-sparse FlashAttention (Algorithm 5, the paper's Proposition 4): Algorithm 1 that skips
  the inner iterations of zero blocks of a block mask; ``Θ(Nd + N²d²s/M)``. The FA2 order is
  available too (``order="fa2"``).

The initialisation of ``O, ℓ, m`` in HBM (Algorithm 1, line 2) is not counted (pass
``count_init=True`` to count it as writes), matching the paper's proof of Theorem 2.
Lengths may differ (``kv_len``); ``N`` is the query length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "IOCount", "block_sizes", "standard_attention", "standard_attention_backward", "flash_attention",
    "flash_attention2", "block_sparse_flash_attention", "random_block_mask", "theorem2_leading_term",
    "linear_fit",
]


@dataclass
class IOCount:
    """HBM element accesses of one algorithm run (one head).

    Attributes:
        algorithm: name.
        N, d, M, kv_len: problem (``M`` is None for standard attention).
        br, bc: block sizes used (0 for standard attention).
        reads, writes: elements read from / written to HBM, by tensor name.
        inner_iterations: number of (i, j) block pairs computed.
    """

    algorithm: str
    N: int
    d: int
    M: int | None
    kv_len: int
    br: int = 0
    bc: int = 0
    reads: dict = field(default_factory=dict)
    writes: dict = field(default_factory=dict)
    inner_iterations: int = 0

    @property
    def total_reads(self) -> int:
        return int(sum(self.reads.values()))

    @property
    def total_writes(self) -> int:
        return int(sum(self.writes.values()))

    @property
    def total(self) -> int:
        """All HBM element accesses (reads + writes): the paper's "HBM accesses"."""
        return self.total_reads + self.total_writes

    def _add(self, book: dict, name: str, n) -> None:
        book[name] = book.get(name, 0) + int(n)

    def __str__(self) -> str:
        r = ", ".join(f"{k}={v}" for k, v in self.reads.items())
        w = ", ".join(f"{k}={v}" for k, v in self.writes.items())
        m = f" M={self.M}" if self.M is not None else ""
        return (f"{self.algorithm}: N={self.N} kv={self.kv_len} d={self.d}{m} Br={self.br} Bc={self.bc} "
                f"total={self.total}  reads[{r}]  writes[{w}]")


def _check(N: int, d: int, M=None, kv_len=None) -> int:
    for name, v in (("N", N), ("d", d)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if M is not None and (isinstance(M, bool) or not isinstance(M, (int, np.integer)) or M < 1):
        raise ValueError(f"M (SRAM size in elements) must be a positive int, got {M!r}")
    kv = N if kv_len is None else kv_len
    if isinstance(kv, bool) or not isinstance(kv, (int, np.integer)) or kv < 1:
        raise ValueError(f"kv_len must be a positive int, got {kv_len!r}")
    return int(kv)


def block_sizes(d: int, M: int, order: str = "fa1") -> tuple[int, int]:
    """``(Br, Bc)``: Algorithm 1's ``Bc = ⌈M/4d⌉, Br = min(⌈M/4d⌉, d)``; for ``order="fa2"`` the
    roles swap (``Br = ⌈M/4d⌉, Bc = min(⌈M/4d⌉, d)``)."""
    b = -(-M // (4 * d))
    if order == "fa1":
        return min(b, d), b
    if order == "fa2":
        return b, min(b, d)
    raise ValueError(f"order must be 'fa1' or 'fa2', got {order!r}")


def _sizes(n: int, b: int) -> np.ndarray:
    """Lengths of the ``⌈n/b⌉`` blocks of ``n`` items (last one ragged)."""
    t = -(-n // b)
    s = np.full(t, b, dtype=np.int64)
    s[-1] = n - (t - 1) * b
    return s


def standard_attention(N: int, d: int, kv_len: int | None = None) -> IOCount:
    """Algorithm 0: ``S = QKᵀ`` written to HBM, read back for ``P = softmax(S)``, ``P`` written,
    read back for ``O = PV``. ``4Nd + 4N²`` elements when ``kv_len = N``."""
    kv = _check(N, d, None, kv_len)
    c = IOCount("standard", N, d, None, kv)
    c._add(c.reads, "Q", N * d)           # line 1: load Q, K by blocks, compute S, write S
    c._add(c.reads, "K", kv * d)
    c._add(c.writes, "S", N * kv)
    c._add(c.reads, "S", N * kv)          # line 2: read S, compute P, write P
    c._add(c.writes, "P", N * kv)
    c._add(c.reads, "P", N * kv)          # line 3: load P and V by blocks, compute O, write O
    c._add(c.reads, "V", kv * d)
    c._add(c.writes, "O", N * d)
    return c


def standard_attention_backward(N: int, d: int, kv_len: int | None = None) -> IOCount:
    """The paper's Algorithm 3 (standard attention backward, P stored): ``dV = PᵀdO``,
    ``dP = dO Vᵀ``, ``dS = P∘(dP − rowsum(dO∘O))``, ``dQ = dS K``, ``dK = dSᵀQ``; every
    intermediate goes through HBM. ``7N² + 8Nd`` elements when ``kv_len = N``."""
    kv = _check(N, d, None, kv_len)
    c = IOCount("standard-backward", N, d, None, kv)
    c._add(c.reads, "P", N * kv); c._add(c.reads, "dO", N * d); c._add(c.writes, "dV", kv * d)       # dV
    c._add(c.reads, "dO", N * d); c._add(c.reads, "V", kv * d); c._add(c.writes, "dP", N * kv)       # dP
    c._add(c.reads, "P", N * kv); c._add(c.reads, "dP", N * kv); c._add(c.writes, "dS", N * kv)      # dS
    c._add(c.reads, "dS", N * kv); c._add(c.reads, "K", kv * d); c._add(c.writes, "dQ", N * d)       # dQ
    c._add(c.reads, "dS", N * kv); c._add(c.reads, "Q", N * d); c._add(c.writes, "dK", kv * d)       # dK
    return c


def _mask_grid(mask, density, tr: int, tc: int, seed: int):
    if mask is not None and density is not None:
        raise ValueError("give either mask or density, not both")
    if mask is None and density is None:
        return None
    if mask is None:
        return random_block_mask(tr, tc, density, seed)
    m = np.asarray(mask.detach().cpu().numpy() if hasattr(mask, "detach") else mask)
    if m.dtype != np.bool_:
        raise ValueError(f"mask must be boolean, got {m.dtype}")
    if m.shape != (tr, tc):
        raise ValueError(f"mask has shape {m.shape}, expected (Tr, Tc) = {(tr, tc)} for these block sizes")
    return m


def random_block_mask(tr: int, tc: int, density: float, seed: int = 0) -> np.ndarray:
    """A ``(tr, tc)`` bool block mask with exactly ``round(density · tr · tc)`` non-zero blocks
    placed uniformly at random (deterministic in ``seed``)."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    n = tr * tc
    k = int(round(density * n))
    out = np.zeros(n, dtype=bool)
    out[np.random.default_rng(seed).permutation(n)[:k]] = True
    return out.reshape(tr, tc)


def _flash_setup(algo: str, N, d, M, kv_len, br, bc, mask, density, seed, reads, writes):
    """Set-up shared by the tiled algorithms: block sizes (the ``algo`` "fa1"/"fa2" defaults unless
    given), row/column block extents, the optional block mask, and an IOCount with zeroed keys."""
    kv = _check(N, d, M, kv_len)
    dbr, dbc = block_sizes(d, M, algo)
    br, bc = br or dbr, bc or dbc
    rows, cols = _sizes(N, br), _sizes(kv, bc)
    grid = _mask_grid(mask, density, len(rows), len(cols), seed)
    n = algo[-1]
    c = IOCount(f"flash-{n}" if grid is None else f"block-sparse-flash-{n}", N, d, M, kv, br, bc)
    c.reads.update(dict.fromkeys(reads, 0))
    c.writes.update(dict.fromkeys(writes, 0))
    return c, rows, cols, grid


def flash_attention(N: int, d: int, M: int, kv_len: int | None = None, *, br: int | None = None,
                    bc: int | None = None, mask=None, density: float | None = None, seed: int = 0,
                    skip_empty_columns: bool = False, count_init: bool = False) -> IOCount:
    """Algorithm 1 (or Algorithm 5 with ``mask``/``density``): K/V outer loop.

    Args:
        N, d, M: query length, head dim, SRAM size in elements.
        kv_len: key length (default N).
        br, bc: override the block sizes.
        mask: bool ``(Tr, Tc)`` block mask (Algorithm 5 skips the zero blocks), or
        density: build a random block mask with this fraction of non-zero blocks.
        skip_empty_columns: also skip loading ``K_j, V_j`` when column j has no non-zero block
            (Algorithm 5 as printed loads them anyway).
        count_init: count the initialisation of ``O, ℓ, m`` in HBM as writes.
    """
    c, rows, cols, grid = _flash_setup("fa1", N, d, M, kv_len, br, bc, mask, density, seed,
                                       ("K", "V", "Q", "O", "l", "m"), ("O", "l", "m"))
    if count_init:
        c._add(c.writes, "O", N * d); c._add(c.writes, "l", N); c._add(c.writes, "m", N)
    for j, kb in enumerate(cols):                       # line 5: for 1 <= j <= Tc
        active = rows if grid is None else rows[grid[:, j]]
        if grid is not None and skip_empty_columns and not len(active):
            continue
        c._add(c.reads, "K", kb * d)                    # line 6: load K_j, V_j
        c._add(c.reads, "V", kb * d)
        n = int(active.sum())                           # lines 7-8: for i (skipping zero blocks)
        c._add(c.reads, "Q", n * d); c._add(c.reads, "O", n * d)
        c._add(c.reads, "l", n); c._add(c.reads, "m", n)
        c._add(c.writes, "O", n * d)                    # lines 12-13: write O_i, ℓ_i, m_i
        c._add(c.writes, "l", n); c._add(c.writes, "m", n)
        c.inner_iterations += len(active)
    return c


def flash_attention2(N: int, d: int, M: int, kv_len: int | None = None, *, br: int | None = None,
                     bc: int | None = None, mask=None, density: float | None = None, seed: int = 0,
                     skip_empty_rows: bool = False) -> IOCount:
    """FlashAttention-2 loop order (Q outer): ``Q_i`` loaded once, ``K_j, V_j`` per inner iteration
    (only non-zero blocks with ``mask``/``density``), ``O_i`` and the logsumexp ``L_i`` written
    once. ``skip_empty_rows`` skips the load of ``Q_i`` and writes for rows with no block."""
    c, rows, cols, grid = _flash_setup("fa2", N, d, M, kv_len, br, bc, mask, density, seed, ("Q", "K", "V"),
                                       ("O", "L"))
    for i, qb in enumerate(rows):                       # for 1 <= i <= Tr
        active = cols if grid is None else cols[grid[i]]
        if grid is not None and skip_empty_rows and not len(active):
            continue
        c._add(c.reads, "Q", qb * d)                    # load Q_i once
        n = int(active.sum())                           # for j: load K_j, V_j
        c._add(c.reads, "K", n * d); c._add(c.reads, "V", n * d)
        c._add(c.writes, "O", qb * d)                   # write O_i (normalised once) and L_i
        c._add(c.writes, "L", qb)
        c.inner_iterations += len(active)
    return c


def block_sparse_flash_attention(N: int, d: int, M: int, mask=None, density: float | None = None, *,
                                 kv_len: int | None = None, order: str = "fa1", seed: int = 0,
                                 br: int | None = None, bc: int | None = None) -> IOCount:
    """Block-sparse FlashAttention (the paper's Algorithm 5 for ``order="fa1"``; the FA2 loop
    order for ``order="fa2"``) on a bool ``(Tr, Tc)`` block mask or a random one of ``density``."""
    if mask is None and density is None:
        raise ValueError("block_sparse_flash_attention() needs a mask or a density")
    if order == "fa1":
        return flash_attention(N, d, M, kv_len, br=br, bc=bc, mask=mask, density=density, seed=seed)
    if order == "fa2":
        return flash_attention2(N, d, M, kv_len, br=br, bc=bc, mask=mask, density=density, seed=seed)
    raise ValueError(f"order must be 'fa1' or 'fa2', got {order!r}")


def theorem2_leading_term(N: int, d: int, M: int) -> float:
    """``12 N² d² / M``: the leading term of Algorithm 1's HBM accesses (``Tc ≈ 4Nd/M`` outer
    iterations, each moving ``3Nd`` elements of Q and O)."""
    return 12.0 * N * N * d * d / M


def linear_fit(x, y) -> tuple[float, float, float]:
    """Least-squares line ``y ≈ slope·x + intercept``; returns ``(slope, intercept, R²)``."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    slope, intercept = np.polyfit(x, y, 1)
    pred = slope * x + intercept
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return float(slope), float(intercept), r2
