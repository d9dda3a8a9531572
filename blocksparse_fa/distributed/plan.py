"""Context-parallel plans: who owns which tokens, who computes what, what moves (host side).

A :class:`ContextParallelPlan` is built once per (mask, sequence length, world size) from the
compiled layout, identically on every rank (it is deterministic), and holds for every rank:

* the tokens it owns (units of whole layout blocks, :mod:`.balance`): its shard of q, k, v and of
  everything else sequence-shaped (inputs, labels, position ids: :meth:`~ContextParallelPlan.indices`,
  :meth:`~ContextParallelPlan.shard`, :meth:`~ContextParallelPlan.unshard`);
* the remote key blocks its queries visit, per owner (the only K/V that moves), and the *split*
  rows (global tokens) it computes a part of for their owners;
* bytes sent per step, the compute cost, and an estimated time (:class:`CostModel`), also for
  head-sharded all-to-all (Ulysses) and a dense ring, so that ``strategy="auto"`` picks the
  cheapest and :meth:`~ContextParallelPlan.describe` prints the comparison.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..compiler.compile import block_pair, compile_mask
from ..compiler.layout import BlockLayout
from ..compiler.segments import EMPTY, FULL
from ..mask.dsl import parse
from ..mask.expr import Mask
from ..mask.primitives import Causal, Full, full
from .balance import STRATEGIES, assign, halo_counter, row_costs, row_counts, split_rows, unit_costs

__all__ = ["CostModel", "ContextParallelPlan", "plan_context_parallel"]

TIE = 0.02  # estimates closer than this are ties, settled by the bytes moved
MAX_RUNS = 4  # messages per peer and phase before a pair's tokens travel as one packed message (exchange.py)


# the fetched keys' launches are cut to the rows that reach them when these are at most this share
# of the rank's rows in at most this many runs (a halo: windows, documents); otherwise one launch
EDGE_SHARE, EDGE_RUNS = 0.5, 4


@dataclass(frozen=True)
class CostModel:
    """What the planner assumes about the machine (defaults: H100/H200-class GPUs with NVLink).

    Attributes:
        kappa: cost of a partial (masked) block over a full one. 2.6 is the forward kernels'
            least-squares fit on the H100 (``benchmarks/NOTES.md``).
        block_seconds: forward time of one full 128 x 128 block of one head at head dim 128
            (17.3 ns, same fit); other block sizes and head dims scale it by their volume.
        backward_factor: backward time over forward time.
        bandwidth: bytes per second one rank sends to its peers (NVLink, all peers at once).
        latency: seconds per step of messages (a collective or a group of sends and receives) on
            the critical path: 0.3 ms, what a step of point-to-point messages of 1-8 MB cost
            between four H100s (NVLink) in the context-parallel forward, waiting for the peers
            included (``benchmarks/experiments/cp_profile.py gpu``, ``benchmarks/NOTES.md``).
        memory_bandwidth: bytes per second of the GPU's memory (the passes that merge partial
            results and convert float32 sums).
        launch_seconds: fixed cost of one kernel launch (host and tail).
        message_seconds: fixed cost of one point-to-point message within a step.
    """

    kappa: float = 2.6
    block_seconds: float = 17.3e-9
    backward_factor: float = 2.5
    bandwidth: float = 150e9
    latency: float = 300e-6
    memory_bandwidth: float = 2.5e12
    launch_seconds: float = 10e-6
    message_seconds: float = 5e-6


@dataclass
class _Rank:
    """One rank's part of a plan (global block indices, sorted)."""

    units: np.ndarray
    length: int
    own_rows: np.ndarray
    own_cols: np.ndarray
    remote_cols: np.ndarray
    own_split: np.ndarray
    guest_rows: np.ndarray
    cost: float
    local_cost: float = 0.0  # the part of ``cost`` over the rank's own keys (hides a fetch when overlapped)
    remote_rows: int = 0  # rows (tokens) whose blocks reach fetched keys
    remote_runs: int = 0  # runs of consecutive own row blocks among them
    kv_from: list = field(default_factory=list)  # per peer: remote key blocks owned by it
    guests_from: list = field(default_factory=list)  # per peer: its split rows this rank computes a part of


def _segment_arrays(layout: BlockLayout):
    """``(row block, start, end, non-empty)`` of every segment of the layout (cached on it)."""
    hit = layout.cache.get("cp_segments")
    if hit is None:
        segs = layout._segs
        hit = layout.cache["cp_segments"] = (segs.rows % segs.n_rowblocks, segs.starts, segs.ends,
                                             segs.state != EMPTY)
    return hit


def _block_len(blocks, b, n):
    blocks = np.asarray(blocks, np.int64)
    return np.minimum((blocks + 1) * b, n) - blocks * b


def _tokens(blocks, b, n):
    """Global token indices of the given blocks (ascending when the blocks are)."""
    blocks = np.asarray(blocks, np.int64)
    lens = _block_len(blocks, b, n)
    return np.repeat(blocks * b, lens) + (np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens))


class ContextParallelPlan:
    """How a sequence of ``seq_len`` tokens is split over ``world_size`` ranks for one mask.

    Build it with :func:`plan_context_parallel` (the same arguments on every rank give the same
    plan). Rank ``r`` holds the tokens :meth:`indices` ``(r)`` (ascending), ``local_len(r)`` of
    them; q, k, v and every other sequence-shaped tensor are sharded with that one permutation.

    Attributes:
        layout: the global :class:`BlockLayout`.
        world_size: number of ranks.
        strategy: ``"contiguous"``, ``"zigzag"``, ``"greedy"`` or ``"ulysses"``.
        unit: tokens per assignment unit (whole layout blocks).
        owner: ``(n_units,)`` owner rank of each unit.
        split: global row blocks split between ranks (global tokens).
        cost_model: the :class:`CostModel` used for estimates.
        candidates: estimates of the strategies compared when the plan was made.
    """

    def __init__(self, layout: BlockLayout, world_size: int, strategy: str, unit: int, owner: np.ndarray,
                 split: np.ndarray, cost_model: CostModel, shape: tuple, dtype: torch.dtype, unit_cost: np.ndarray):
        self.layout = layout
        self._unit_cost = unit_cost
        self._compiled_here = False
        self.world_size = world_size
        self.strategy = strategy
        self.unit = unit
        self.owner = owner
        self.split = split
        self.cost_model = cost_model
        self.shape = shape  # (B, H, Hkv, D) assumed by the estimates
        self.dtype = dtype
        self.candidates: dict = {}
        self.token_cost = 0.0  # set by plan_context_parallel (it is already in unit_cost)
        self._ranks = [self._rank(r) for r in range(world_size)]
        for r, rk in enumerate(self._ranks):
            rk.kv_from = [np.zeros(0, np.int64) if p == r else rk.remote_cols[self._col_owner[rk.remote_cols] == p]
                          for p in range(world_size)]
            rk.guests_from = [np.zeros(0, np.int64) if p == r else rk.guest_rows[self._row_owner[rk.guest_rows] == p]
                              for p in range(world_size)]
        self.fingerprint = self._fingerprint()
        self._exchanges: dict = {}

    # -- construction ------------------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return self.layout.q_len

    @property
    def block_size(self) -> tuple:
        return self.layout.block_size

    @property
    def _row_owner(self) -> np.ndarray:
        bm = self.layout.block_size[0]
        return self.owner[(np.arange(self.layout.shape[-2]) * bm) // self.unit]

    @property
    def _col_owner(self) -> np.ndarray:
        bn = self.layout.block_size[1]
        return self.owner[(np.arange(self.layout.shape[-1]) * bn) // self.unit]

    def _rank(self, r: int) -> _Rank:
        lay = self.layout
        rrow, starts, ends, nonempty = _segment_arrays(lay)
        tr, tc = lay.shape[-2:]
        bm = lay.block_size[0]
        n = self.seq_len
        units = np.nonzero(self.owner == r)[0]
        length = int(np.minimum((units + 1) * self.unit, n).sum() - (units * self.unit).sum())
        row_own = self._row_owner == r
        col_own = self._col_owner == r
        is_split = np.zeros(tr, bool)
        is_split[self.split] = True
        # columns the rank's unsplit rows visit (any instance)
        sel = row_own[rrow] & ~is_split[rrow] & nonempty
        diff = np.zeros(tc + 1, np.int64)
        np.add.at(diff, starts[sel], 1)
        np.add.at(diff, ends[sel], -1)
        need = np.cumsum(diff)[:tc] > 0
        remote = np.nonzero(need & ~col_own)[0]
        # split rows with blocks in this rank's columns
        pref = np.concatenate([[0], np.cumsum(col_own)])
        ssel = is_split[rrow] & nonempty
        hit = pref[ends[ssel]] - pref[starts[ssel]] > 0
        touched = np.unique(rrow[ssel][hit])
        guest = touched[~row_own[touched]]
        own_split = self.split[row_own[self.split]]
        cost = float(self._unit_cost[units].sum())
        # own rows' blocks in own columns (split rows excepted): what runs while the fetch is in flight
        sel = row_own[rrow] & ~is_split[rrow] & nonempty
        w = np.where(self.layout._segs.state[sel] == FULL, 1.0, self.cost_model.kappa)
        local = float((w * (pref[ends[sel]] - pref[starts[sel]])).sum())
        # own row blocks that reach fetched keys, and their runs in local order
        is_rem = np.zeros(tc, bool)
        is_rem[remote] = True
        rpre = np.concatenate([[0], np.cumsum(is_rem)])
        rrows = np.unique(rrow[sel][rpre[ends[sel]] - rpre[starts[sel]] > 0])
        own_rows = np.nonzero(row_own)[0]
        loc = np.searchsorted(own_rows, rrows)
        n_runs = 0 if not len(loc) else 1 + int(np.count_nonzero(np.diff(loc) != 1))
        rem_rows = int(_block_len(rrows, bm, n).sum())
        return _Rank(units, length, own_rows, np.nonzero(col_own)[0], remote, own_split, guest, cost, local,
                     rem_rows, n_runs)

    def _fingerprint(self) -> int:
        h = hashlib.sha256()
        h.update(repr((self.seq_len, self.layout.block_size, self.world_size, self.strategy, self.unit,
                       str(self.layout.mask), self.layout.batch_shape)).encode())
        for a in (self.owner, self.split):
            h.update(np.ascontiguousarray(a, np.int64).tobytes())
        for rk in self._ranks:
            for a in (rk.remote_cols, rk.guest_rows):
                h.update(np.ascontiguousarray(a, np.int64).tobytes())
        return int.from_bytes(h.digest()[:8], "little") & ((1 << 62) - 1)

    def device_layout(self, device) -> BlockLayout:
        """The global layout with its tables on ``device`` (cached; with the compiler's rewrite)."""
        key = ("layout", str(torch.device(device)))
        lay = self._exchanges.get(key)
        if lay is None:
            src = self.layout
            lay = compile_mask(src.mask, src.q_len, src.kv_len, src.block_size, device=device) \
                if self._compiled_here else src.to(device)
            self._exchanges[key] = lay
        return lay

    # -- tokens ----------------------------------------------------------------------------------
    def local_len(self, rank: int) -> int:
        """Tokens rank ``rank`` holds."""
        return self._ranks[rank].length

    def indices(self, rank: int, device=None) -> torch.Tensor:
        """Global token indices held by ``rank`` (ascending, int64): index a sequence dim with them
        to shard inputs, labels and position ids (RoPE positions are these indices)."""
        t = _tokens(self._ranks[rank].units, self.unit, self.seq_len)
        return torch.from_numpy(t).to(device or "cpu")

    def permutation(self, device=None) -> torch.Tensor:
        """``(seq_len,)``: the concatenation of every rank's :meth:`indices` (rank order)."""
        return torch.cat([self.indices(r, device) for r in range(self.world_size)])

    def restore_indices(self, device=None) -> torch.Tensor:
        """``(seq_len,)``: ``cat(shards)[restore_indices()]`` is the sequence in its global order."""
        perm = self.permutation("cpu")
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(len(perm))
        return inv.to(device or "cpu")

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """``rank``'s shard of a full-length tensor (sequence along ``dim``)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"shard(): dim {dim} of x has {x.shape[dim]} entries, the plan is for {self.seq_len} tokens")
        return x.index_select(dim, self.indices(rank, x.device))

    def unshard(self, shards, dim: int) -> torch.Tensor:
        """The full-length tensor from every rank's shard (a list in rank order)."""
        if len(shards) != self.world_size:
            raise ValueError(f"unshard(): expected {self.world_size} shards, got {len(shards)}")
        for r, t in enumerate(shards):
            if t.shape[dim] != self.local_len(r):
                raise ValueError(f"unshard(): shard {r} has {t.shape[dim]} entries along dim {dim}, the plan gives "
                                 f"rank {r} {self.local_len(r)} tokens")
        x = torch.cat(list(shards), dim)
        return x.index_select(dim, self.restore_indices(x.device))

    def gather(self, x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
        """All-gather every rank's shard ``x`` (sequence along ``dim``) and restore the global
        order (for checks and evaluation; training never needs the full sequence)."""
        import torch.distributed as dist

        rank = dist.get_rank(group)
        n_max = max(self.local_len(r) for r in range(self.world_size))
        xm = x.movedim(dim, 0)
        pad = xm.new_zeros((n_max, *xm.shape[1:]))
        pad[: xm.shape[0]] = xm
        parts = [torch.empty_like(pad) for _ in range(self.world_size)]
        dist.all_gather(parts, pad.contiguous(), group=group)
        parts[rank] = pad  # keep autograd-free identity for the local part
        full = [p[: self.local_len(r)].movedim(0, dim) for r, p in enumerate(parts)]
        return self.unshard(full, dim)

    # -- statistics --------------------------------------------------------------------------------
    def _esize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def bytes_per_rank(self) -> list[dict]:
        """Per rank: bytes it sends in the forward and in the backward (K/V blocks, split-row
        traffic), and the dense ring's for comparison."""
        B, H, Hkv, D = self.shape
        es = self._esize()
        bm, bn = self.layout.block_size
        n = self.seq_len
        P = self.world_size
        out = []
        for r, rk in enumerate(self._ranks):
            kv_tok = sum(int(_block_len(self._ranks[p].kv_from[r], bn, n).sum()) for p in range(P))
            fetched = int(_block_len(rk.remote_cols, bn, n).sum())
            own_split_tok = sum(int(_block_len(self._ranks[p].guests_from[r], bm, n).sum()) for p in range(P))
            guest_tok = int(_block_len(rk.guest_rows, bm, n).sum())
            fwd = B * (kv_tok * 2 * Hkv * D * es + own_split_tok * H * D * es + guest_tok * H * (D + 1) * 4)
            bwd = B * (fetched * 2 * Hkv * D * 4 + own_split_tok * H * (2 * D + 2) * 4 + guest_tok * H * D * 4)
            ring_fwd = B * (P - 1) * rk.length * 2 * Hkv * D * es
            ring_bwd = B * (P - 1) * rk.length * 2 * Hkv * D * (es + 4)
            out.append(dict(rank=r, tokens=rk.length, fwd=fwd, bwd=bwd, ring_fwd=ring_fwd, ring_bwd=ring_bwd,
                            kv_blocks_fetched=len(rk.remote_cols), guest_rows=len(rk.guest_rows),
                            cost=rk.cost))
        return out

    def _block_seconds(self) -> float:
        bm, bn = self.layout.block_size
        D = self.shape[3]
        return self.cost_model.block_seconds * (bm * bn * D) / (128 * 128 * 128)

    def _launches(self, rk: _Rank, overlap: bool) -> int:
        """Kernel launches of a fwd+bwd step on rank ``rk`` (a backward launch is two: its
        preprocess and its kernel). ``causal()`` and dense masks run their backward as a dense and
        a causal rectangle per contiguous piece of the rank's tokens (``exchange._rectangles``),
        cut again at the own pieces when overlapped; other masks one launch per key part."""
        parts = 1 + (max(1, rk.remote_runs) if self._halo(rk) else 1) if overlap and len(rk.remote_cols) else 1
        pieces = 1 + int(np.count_nonzero(np.diff(rk.units) != 1)) if len(rk.units) else 0
        rect = isinstance(self.layout.mask, (Causal, Full)) and not self.layout.batch_shape and not len(self.split)
        bwd = (2 * pieces + (pieces if parts > 1 else 0)) if rect and isinstance(self.layout.mask, Causal) else parts
        return parts + 2 * bwd + (3 if len(self.split) else 0)

    @staticmethod
    def _halo(rk: _Rank) -> bool:
        """Whether the rows of ``rk`` that reach fetched keys are a halo: at most
        :data:`EDGE_SHARE` of its rows in at most :data:`EDGE_RUNS` runs (then the launches over
        the fetched keys cover those rows only, ``exchange.Exchange``)."""
        return rk.remote_runs <= EDGE_RUNS and rk.remote_rows <= EDGE_SHARE * rk.length

    def _messages(self, rk: _Rank) -> int:
        """Messages a rank sends and receives per fwd+bwd (runs of consecutive tokens, a packed
        message where a pair has more than :data:`MAX_RUNS`; gradients return packed)."""
        def runs(blocks):
            return 0 if not len(blocks) else 1 + int(np.count_nonzero(np.diff(blocks) != 1))
        n = 0
        for p, blocks in enumerate(rk.kv_from):
            r = runs(blocks)
            n += (r if r <= MAX_RUNS else 1) + (1 if r else 0)
        return 2 * n  # both directions, about as many as it receives

    def estimate(self) -> dict:
        """Estimated fwd+bwd step of the slowest rank, ``time``: its compute (``full + kappa ·
        partial`` blocks), plus its messages (bytes over the bandwidth, latency per step), plus
        launches; with ``overlap`` the messages of the fetched keys hide behind the launch over the
        own keys, at the cost of a second launch and a float32 merge of the outputs. Also
        ``compute`` (slowest rank), ``comm`` (its bytes over the bandwidth plus latencies),
        ``overlap`` (whether it pays), ``imbalance`` (max / mean compute), ``bytes`` (max sent per
        rank, fwd+bwd), ``ring_bytes``, ``launches``."""
        cm = self.cost_model
        B, H, Hkv, D = self.shape
        per = self.bytes_per_rank()
        costs = np.array([rk.cost for rk in self._ranks])
        t_unit = self._block_seconds() * B * H * (1 + cm.backward_factor)
        n_steps = 2 + (4 if len(self.split) else 0)  # message steps per fwd+bwd
        rect = isinstance(self.layout.mask, (Causal, Full)) and not self.layout.batch_shape and not len(self.split)
        best = None
        for overlap in (False, True):
            worst = (0.0, 0.0, 0.0)
            for rk, p in zip(self._ranks, per):
                compute = rk.cost * t_unit
                comm = (p["fwd"] + p["bwd"]) / cm.bandwidth + n_steps * cm.latency
                comm += self._messages(rk) * cm.message_seconds
                glue = self._launches(rk, overlap) * cm.launch_seconds
                if not len(rk.remote_cols):  # it only sends: its kernels wait for no message
                    comm = max(0.0, comm - rk.local_cost * t_unit)
                elif overlap:
                    if not rect:
                        # measured (benchmarks/NOTES.md, context parallelism): where the fetched keys
                        # reach every row (global tokens, random blocks) the second launch over all
                        # rows and the merge cost more than the fetch they hide (4 x H100); where they
                        # reach a halo (windows, documents) the plain call, whose ranks complete the
                        # fetch before launching, beat the overlapped one by 6-7 % (medians, 4 x H200)
                        worst = (compute, float("inf"), glue)
                        break
                    comm = max(0.0, comm - rk.local_cost * t_unit)
                    rows = rk.length
                    # merge of two outputs over the rows that reach fetched keys (read both, write
                    # one), and the dQ of all rows in float32 (written, then converted)
                    glue += B * H * D * (12 * rows + 10 * rk.length) / cm.memory_bandwidth
                t = compute + comm + glue
                if t > sum(worst):
                    worst = (compute, comm, glue)
            if best is None or sum(worst) < sum(best[1]):
                best = (overlap, worst)
        overlap, (compute, comm, glue) = best
        sent = max(p["fwd"] + p["bwd"] for p in per)
        return dict(strategy=self.strategy, compute=float(costs.max()) * t_unit, comm=comm, glue=glue,
                    time=compute + comm + glue, overlap=overlap,
                    launches=max(self._launches(rk, overlap) for rk in self._ranks),
                    imbalance=float(costs.max() / max(costs.mean(), 1e-30)), bytes=sent,
                    ring_bytes=max(p["ring_fwd"] + p["ring_bwd"] for p in per),
                    tokens_max=max(p["tokens"] for p in per), tokens_min=min(p["tokens"] for p in per))

    @property
    def overlap_auto(self) -> bool:
        """What ``overlap="auto"`` does: overlap the fetch with the own-key launch where the estimate
        says it pays (:meth:`estimate`; the same on every rank)."""
        hit = self.__dict__.get("_overlap_auto")
        if hit is None:
            hit = self.__dict__["_overlap_auto"] = bool(self.estimate()["overlap"])
        return hit

    def describe(self) -> str:
        """A short text report: the chosen strategy, per-rank tokens/cost/bytes, and the
        candidates compared (estimated times)."""
        lines = [f"context-parallel plan: {self.strategy}, {self.world_size} ranks, {self.seq_len} tokens, "
                 f"mask {self.layout.mask}, block {self.layout.block_size}, unit {self.unit} tokens, "
                 f"{len(self.split)} split row blocks"]
        lines.append("  rank  tokens      cost  fetched-blocks  guest-rows   fwd-MB   bwd-MB  ring-fwd-MB")
        for p in self.bytes_per_rank():
            lines.append(f"  {p['rank']:4d} {p['tokens']:7d} {p['cost']:9.0f} {p['kv_blocks_fetched']:15d} "
                         f"{p['guest_rows']:11d} {p['fwd'] / 1e6:8.2f} {p['bwd'] / 1e6:8.2f} {p['ring_fwd'] / 1e6:12.2f}")
        if self.candidates:
            lines.append("  candidates (fwd+bwd estimate: compute + communication):")
            for name, e in self.candidates.items():
                mark = "*" if name == self.strategy else " "
                lines.append(f"   {mark}{name:10s} time {e['time'] * 1e3:9.3f} ms = compute {e['compute'] * 1e3:9.3f} + "
                             f"comm {e['comm'] * 1e3:7.3f} + glue {e.get('glue', 0.0) * 1e3:6.3f}"
                             f"{' (overlapped)' if e.get('overlap') else ''}; imbalance {e['imbalance']:.3f}; "
                             f"{e.get('launches', 0)} launches; sent {e['bytes'] / 1e6:9.2f} MB/rank "
                             f"(dense ring {e['ring_bytes'] / 1e6:.2f})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"ContextParallelPlan(strategy={self.strategy!r}, world_size={self.world_size}, "
                f"seq_len={self.seq_len}, tokens={[rk.length for rk in self._ranks]})")


# ------------------------------------------------------------------------------------------------
# Ulysses estimate
# ------------------------------------------------------------------------------------------------
def _layout_cost(layout: BlockLayout, kappa: float, use_rewrite: bool) -> float:
    """Work of the whole layout in its own blocks, through its rewrite when one applies."""
    rw = layout.rewrite if use_rewrite else None
    if rw is None:
        return float(row_costs(layout, kappa).sum())
    band = float(row_costs(rw.band, kappa).sum())
    if rw.cls is None:
        return float(row_costs(layout, kappa).sum())
    bm, bn = layout.block_size
    cbm, cbn = rw.cls.block_size
    return band + rw.stride * float(row_costs(rw.cls, kappa).sum()) * (cbm * cbn) / (bm * bn)


def ulysses_estimate(plan: ContextParallelPlan, dropout: bool = False) -> dict | None:
    """Estimate of head-sharded all-to-all over the same tokens; None when it does not apply
    (heads not divisible by the world size, head-dependent masks)."""
    B, H, Hkv, D = plan.shape
    P = plan.world_size
    if H % P or (Hkv % P and P % Hkv) or (plan.layout.batch_shape and plan.layout.batch_shape[1] > 1):
        return None
    Hkv = max(Hkv, P)  # fewer key/value heads than ranks: replicated to the ranks of their query heads
    cm = plan.cost_model
    es = plan._esize()
    total = _layout_cost(plan.layout, cm.kappa, not dropout) + plan.token_cost * plan.seq_len
    compute = total / P * plan._block_seconds() * B * H * (1 + cm.backward_factor)
    n = plan.seq_len
    sent = 0
    for rk in plan._ranks:
        L = rk.length
        # forward: q, k, v to the head owners, the output back; backward: dO out, dq, dk, dv back
        fwd = B * D * es * ((H + 2 * Hkv) * L * (P - 1) // P + (H // P) * (n - L))
        bwd = B * D * es * (H * L * (P - 1) // P + ((H + 2 * Hkv) // P) * (n - L))
        sent = max(sent, fwd + bwd)
    per = plan.bytes_per_rank()
    comm = sent / cm.bandwidth + 8 * cm.latency
    # every all-to-all's tensor is packed before and unpacked after it (two passes of its bytes), and
    # each of the 8 exchanges is a few launches besides the attention's 3
    glue = 2 * sent / cm.memory_bandwidth + (3 + 3 * 8) * cm.launch_seconds
    return dict(strategy="ulysses", compute=compute, comm=comm, glue=glue, time=compute + comm + glue, overlap=False,
                launches=3 + 3 * 8, imbalance=1.0, bytes=sent,
                ring_bytes=max(p["ring_fwd"] + p["ring_bwd"] for p in per),
                tokens_max=max(p["tokens"] for p in per), tokens_min=min(p["tokens"] for p in per))


# ------------------------------------------------------------------------------------------------
# the planner
# ------------------------------------------------------------------------------------------------
def _as_layout(mask, seq_len: int, block_size) -> BlockLayout:
    if isinstance(mask, BlockLayout):
        if mask.q_len != seq_len or mask.kv_len != seq_len:
            raise ValueError(f"the layout was compiled for ({mask.q_len}, {mask.kv_len}) tokens; context parallelism "
                             f"needs self-attention over seq_len={seq_len} (q_len == kv_len)")
        return mask.to("cpu")
    m = parse(mask) if isinstance(mask, str) else mask
    if m is None:
        m = full()
    if not isinstance(m, Mask):
        raise TypeError(f"mask must be a Mask, DSL text, BlockLayout or None, got {type(mask).__name__}")
    return compile_mask(m, seq_len, seq_len, block_pair(block_size), device="cpu")


def plan_context_parallel(mask, seq_len: int, world_size: int, *, block_size=None, strategy: str = "auto",
                          heads: tuple = (8, 8), head_dim: int = 128, batch: int = 1,
                          dtype: torch.dtype = torch.bfloat16, cost_model: CostModel | None = None,
                          split_factor: float = 4.0, unit: int | None = None, dropout: bool = False,
                          max_token_imbalance: float = 1.5, token_cost: float = 0.0,
                          shard_lengths=None) -> ContextParallelPlan:
    """Plan context parallelism of self-attention with ``mask`` over ``seq_len`` tokens.

    Args:
        mask: a :class:`Mask`, DSL text, a :class:`BlockLayout` compiled for ``(seq_len, seq_len)``
            or None (dense).
        seq_len: tokens of the whole sequence.
        world_size: ranks sharing it.
        block_size: layout block (default 128); ``(bm, bn)`` pairs are allowed.
        strategy: ``"contiguous"``, ``"zigzag"``, ``"greedy"`` (sparse context parallelism with
            that assignment), ``"ulysses"`` (head-sharded all-to-all) or ``"auto"``: the one with
            the least estimated time (see :meth:`ContextParallelPlan.describe`; estimates within
            2 % of the least count as ties, and of those the one that moves the fewest bytes wins).
        heads: ``(H, Hkv)`` query and key/value heads (estimates; Ulysses needs ``H`` divisible by
            ``world_size`` and ``Hkv`` divisible by it or dividing it).
        head_dim, batch, dtype: the attention inputs' (estimates only).
        cost_model: machine assumptions (:class:`CostModel`).
        split_factor: rows costing more than this times the mean row are split between ranks
            (0 disables splitting).
        unit: tokens per assignment unit (a multiple of both block sides; default their lcm).
        dropout: whether attention dropout will be used (Ulysses does not support it).
        max_token_imbalance: ``"auto"`` skips assignments whose largest shard exceeds this
            multiple of the mean (the rest of the model's work follows the tokens).
        token_cost: work per token outside attention (projections, MLP, their backward), in
            units of one full attention block of all heads forward and backward; added to every
            unit's cost, so that balanced ranks are balanced for the whole model, not only for
            its attention (e.g. a decoder layer's ``6 · params_per_layer`` FLOPs per token over
            ``4 · bm · bn · D · H · (1 + backward_factor)``).
        shard_lengths: the inputs are already split into contiguous shards of these lengths (rank
            order; every boundary on a multiple of the unit): plan for that split (strategy
            ``"given"``) instead of choosing one.

    Returns:
        A :class:`ContextParallelPlan`. The same arguments on every rank give the same plan.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    layout = _as_layout(mask, seq_len, block_size)
    bm, bn = layout.block_size
    base = bm * bn // math.gcd(bm, bn)
    unit = base if unit is None else unit
    if unit % bm or unit % bn or unit < 1:
        raise ValueError(f"unit={unit} must be a positive multiple of both block sides {layout.block_size}")
    cm = cost_model or CostModel()
    H, Hkv = heads
    shape = (batch, H, Hkv, head_dim)
    costs = row_costs(layout, cm.kappa)
    split = split_rows(costs, row_counts(layout), split_factor, world_size)
    if not token_cost >= 0:
        raise ValueError(f"token_cost must be >= 0, got {token_cost!r}")
    ucost = unit_costs(layout, unit, cm.kappa, split)
    if token_cost:
        starts = np.arange(len(ucost)) * unit
        ucost = ucost + token_cost * (np.minimum(starts + unit, seq_len) - starts)
    if shard_lengths is not None:
        owner = _owner_from_lengths(shard_lengths, seq_len, world_size, unit)
        plan = _make(layout, world_size, "given", unit, owner, split, cm, shape, dtype, ucost, token_cost)
        plan.candidates = {"given": plan.estimate()}
        plan._compiled_here = not isinstance(mask, BlockLayout)
        return plan
    names = STRATEGIES if strategy in ("auto", "ulysses") else (strategy,)
    if strategy not in STRATEGIES + ("auto", "ulysses"):
        raise ValueError(f"strategy must be one of {STRATEGIES + ('auto', 'ulysses')}, got {strategy!r}")
    cands, plans = {}, {}
    # a key block crossing a cut costs its bytes (K and V forward, float32 dK and dV back) over the
    # bandwidth; in units of one full block's compute, so that cuts trade imbalance for traffic
    es = torch.empty(0, dtype=dtype).element_size()
    block_s = cm.block_seconds * (bm * bn * head_dim) / (128 * 128 * 128) * batch * H * (1 + cm.backward_factor)
    halo_w = bn * batch * Hkv * head_dim * 2 * (es + 4) / cm.bandwidth / block_s
    halo = halo_counter(layout, unit)
    for name in names:
        owner = assign(ucost, world_size, name, cap=max_token_imbalance, halo=halo, halo_weight=halo_w)
        p = _make(layout, world_size, name, unit, owner, split, cm, shape, dtype, ucost, token_cost)
        plans[name] = p
        cands[name] = p.estimate()
    even = assign(np.ones(len(ucost)), world_size, "contiguous")  # Ulysses: equal contiguous shards
    uly_plan = _make(layout, world_size, "ulysses", unit, even, np.zeros(0, np.int64), cm, shape, dtype, ucost,
                     token_cost)
    uly = ulysses_estimate(uly_plan, dropout)
    if uly is not None:
        cands["ulysses"] = uly
    if strategy == "ulysses":
        if uly is None:
            raise ValueError(f"strategy='ulysses' needs H divisible by world_size={world_size} and Hkv divisible by "
                             f"it or dividing it (got H={H}, Hkv={Hkv}), a mask without per-head dependence and no "
                             f"dropout")
        chosen = uly_plan
    elif strategy == "auto":
        mean = seq_len / world_size + unit  # one unit of slack: units are whole blocks
        ok = {k: v for k, v in cands.items() if k == "ulysses" or v["tokens_max"] <= max_token_imbalance * mean}
        ok = ok or cands
        if dropout:
            ok.pop("ulysses", None)
        # within the estimate's error (TIE) of the fastest, the one that moves the fewest bytes
        fastest = min(v["time"] for v in ok.values())
        best = min((k for k in ok if ok[k]["time"] <= (1 + TIE) * fastest), key=lambda k: (ok[k]["bytes"], ok[k]["time"]))
        chosen = uly_plan if best == "ulysses" else plans[best]
    else:
        chosen = plans[strategy]
    chosen.candidates = cands
    chosen._compiled_here = not isinstance(mask, BlockLayout)
    return chosen


def _owner_from_lengths(lengths, seq_len: int, world_size: int, unit: int) -> np.ndarray:
    lengths = [int(x) for x in lengths]
    if len(lengths) != world_size or sum(lengths) != seq_len or min(lengths) < 1:
        raise ValueError(f"shard_lengths {lengths} must be {world_size} positive lengths adding up to {seq_len}")
    bounds = np.cumsum(lengths)[:-1]
    if (bounds % unit).any():
        raise ValueError(f"shard_lengths {lengths}: every shard but the last must hold a multiple of {unit} tokens "
                         f"(whole layout blocks)")
    starts = np.arange(-(-seq_len // unit)) * unit
    return np.searchsorted(bounds, starts, side="right").astype(np.int64)


def _make(layout, world_size, name, unit, owner, split, cm, shape, dtype, ucost, token_cost=0.0):
    plan = ContextParallelPlan(layout, world_size, name, unit, owner, split, cm, shape, dtype, ucost)
    plan.token_cost = token_cost
    return plan
