"""One rank's view of a plan on its device: the launches of its local attention and the tables of
every exchange, built once per (plan, rank, device) and cached on the plan.

Orders and buffers:

* a rank's shard holds its tokens in ascending global order (*own* coordinates);
* key/value buffers are token-major, ``(T, 2, B, Hkv, D)`` (K and V of one token side by side), so
  that a run of consecutive tokens is one contiguous slice a message fills or reads in place; the
  kernels read K and V through strided views. ``buf`` holds the own and the fetched tokens in
  ascending order (one launch over all keys), ``rem`` the fetched ones only (the overlapped path,
  whose own-key launch reads k and v as given);
* a message is a run of consecutive global tokens: both sides derive the same runs from the plan,
  so no indices travel. A pair that would need more than :data:`MAX_RUNS` runs (BigBird's random
  blocks) sends one packed message instead (gathered by the sender, scattered by the receiver,
  ascending). Gradients of fetched keys always travel packed (the kernels write them head-major).

Launches (:class:`Part`): ``main`` (own rows against ``buf``), or ``local`` (against the own keys)
and ``remote`` (against ``rem``) when the fetch is overlapped; split rows computed for other
ranks (``guest``) run separately. Where the global layout keeps one key interval per row
(windows, documents, causal), every part gets its rows' intervals in its own key coordinates, so
that its forward runs on the interval kernels; for ``causal()`` and the dense mask the backward
runs on dense and causal rectangles (:func:`_rectangles`), the shapes the fastest backward kernels
take.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..compiler.compile import compile_mask
from ..compiler.intervals import row_interval
from ..compiler.shard import shard_layout
from ..mask.primitives import Causal, Full, causal, full
from .plan import EDGE_RUNS, EDGE_SHARE, MAX_RUNS, ContextParallelPlan, _segment_arrays, _tokens

__all__ = ["Exchange", "Part", "exchange_for", "MAX_RUNS"]


def _t(a, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def _positions(sorted_ref: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Index of each entry of ``x`` in the ascending ``sorted_ref`` (every entry must be there)."""
    pos = np.searchsorted(sorted_ref, x)
    if len(x) and (pos.max(initial=0) >= len(sorted_ref) or not np.array_equal(sorted_ref[pos], x)):
        raise AssertionError("plan tables inconsistent: a token is missing from its buffer")
    return pos


def _runs(tok: np.ndarray) -> list:
    """``[(start, end)]`` index ranges of the maximal runs of consecutive values of a sorted array."""
    if len(tok) == 0:
        return []
    brk = np.nonzero(np.diff(tok) != 1)[0] + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [len(tok)]])
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


@dataclass(frozen=True)
class Part:
    """One kernel launch of a rank's local attention.

    Attributes:
        layout: what it computes (a shard of the global layout, or a plain dense/causal rectangle).
        rows: ``(start, end)`` of the rank's rows it covers, None for all of them.
        keys: the key tensor: ``"buf"`` (own and fetched), ``"own"`` (k, v as given) or ``"rem"``
            (fetched only).
        span: ``(start, end)`` in that tensor, None for all of it.
    """

    layout: object
    rows: tuple | None
    keys: str
    span: tuple | None = None

    @property
    def remote(self) -> bool:
        return self.keys != "own"


@dataclass
class Fetch:
    """The K/V fetch of one rank (a phase of messages, see the module docstring).

    ``send``/``recv``: per message ``(peer, start, end, tag)``; sends index the sender's staging
    (``send_idx``, gathered from ``buf`` or from k/v) or, where ``direct``, its ``buf``; receives
    index the destination (``buf`` or ``rem``) directly, or the receive staging of packed pairs
    (scattered through ``recv_pos_buf`` / ``recv_pos_rem``)."""

    send_direct: list  # (peer, start, end, tag) in buf coordinates
    send_packed: list  # (peer, start, end, tag) in the send staging
    send_idx_own: torch.Tensor  # staging <- own coordinates (overlapped path: from k, v)
    send_idx_buf: torch.Tensor  # staging (packed pairs only) <- buf coordinates
    send_all_own: list  # (peer, start, end, tag): every message as a slice of the overlapped staging
    recv_buf: list  # (peer, start, end, tag) in buf coordinates (direct pairs)
    recv_rem: list  # the same in rem coordinates
    recv_packed: list  # (peer, start, end, tag) in the receive staging
    recv_pos_buf: torch.Tensor
    recv_pos_rem: torch.Tensor
    n_send_packed: int
    n_send_all: int
    n_recv_packed: int


class Exchange:
    """Rank ``rank``'s launches and exchange tables (see the module docstring).

    Attributes:
        main, local, remote, guest: shard layouts (own rows against ``buf`` / the own keys / the
            fetched keys, own split rows left empty; every split row with keys here against the own
            keys, own ones first).
        fwd_parts, bwd_parts: ``{"main": [...], "overlap": [...]}`` launches of the forward and the
            backward (overlapped: the remote parts first in the backward, last in the forward).
        fetch: the K/V messages (:class:`Fetch`).
        own_runs: ``[(buf_start, own_start, n)]``: where the own tokens sit in ``buf``.
        ret_send_buf, ret_send_rem, ret_send_n: the fetched tokens' gradients returned to their
            owners (positions in ``buf`` / ``rem``, peer-major; counts per peer).
        ret_recv_pos, ret_recv_buf, ret_recv_n: gradients of own tokens other ranks fetched (own
            positions, the same in ``buf``, peer-major; counts per peer).
        gq_send_idx, gq_send_n, gq_recv_n: split rows' queries sent to the ranks that compute a
            part of them (own positions, peer-major) and received from their owners (peer-major;
            ``guest``'s rows are in that order).
        split_idx, n_split, split_slot: own split rows (own positions, ascending) and, for the
            parts other ranks return (peer-major), ``slot · n_split + row``.
    """

    def __init__(self, plan: ContextParallelPlan, rank: int, device):
        dev = torch.device(device)
        self.plan, self.rank, self.device = plan, rank, dev
        P, n = plan.world_size, plan.seq_len
        bm, bn = plan.block_size
        rk = plan._ranks[rank]
        lay = plan.layout
        own_tok = _tokens(rk.units, plan.unit, n)
        self.length = len(own_tok)
        self.has_kv = any(len(r.remote_cols) for r in plan._ranks)
        self.has_split = len(plan.split) > 0
        self.fetches = len(rk.remote_cols) > 0
        buf_cols = np.union1d(rk.own_cols, rk.remote_cols)
        buf_tok = _tokens(buf_cols, bn, n)
        rem_tok = _tokens(rk.remote_cols, bn, n)
        self.buf_len, self.rem_len = len(buf_tok), len(rem_tok)
        own_in_buf = _positions(buf_tok, own_tok)
        self.own_runs = [(int(own_in_buf[a]), a, b - a) for a, b in _runs(own_tok)]
        self.own_is_buf = self.buf_len == self.length
        self.fetch = self._fetch(plan, rank, own_tok, buf_tok, rem_tok, dev)
        # -- gradients of fetched keys back to their owners (packed, ascending per peer) -------------
        sent = [_tokens(plan._ranks[p].kv_from[rank], bn, n) for p in range(P)]  # mine that p fetched
        got = [_tokens(rk.kv_from[p], bn, n) for p in range(P)]  # p's that I fetched
        got_all = np.concatenate(got)
        self.ret_send_buf = _t(_positions(buf_tok, got_all), dev)
        self.ret_send_rem = _t(_positions(rem_tok, got_all), dev)
        self.ret_send_n = [len(t) for t in got]
        recv_own = _positions(own_tok, np.concatenate(sent))
        self.ret_recv_pos = _t(recv_own, dev)
        self.ret_recv_buf = _t(own_in_buf[recv_own], dev)
        self.ret_recv_n = [len(t) for t in sent]
        # -- layouts ---------------------------------------------------------------------------
        # own split rows are left empty here: the guest launch computes every split row's part
        # over the own keys (in float32), and the owner merges the parts
        split_own = np.isin(rk.own_rows, plan.split)
        none = np.zeros(0, np.int64)
        self.main = shard_layout(lay, rk.own_rows, buf_cols, limit_rows=split_own, limit_cols=none, device=dev)
        self.local = shard_layout(lay, rk.own_rows, rk.own_cols, limit_rows=split_own, limit_cols=none, device=dev)
        self.remote = (shard_layout(lay, rk.own_rows, rk.remote_cols, limit_rows=split_own, limit_cols=none,
                                    device=dev) if len(rk.remote_cols) else None)
        # every split row with keys here: the own ones first, then other ranks' (peer-major, each
        # peer's ascending: the order their queries arrive in)
        gr = [rk.guests_from[p] for p in range(P)]
        guest_rows = np.concatenate([rk.own_split] + gr).astype(np.int64)
        self.guest = shard_layout(lay, guest_rows, rk.own_cols, device=dev) if len(guest_rows) else None
        intervals = row_interval(lay)
        empty = np.repeat(split_own, bm)[:len(own_tok)]
        if intervals is not None:  # one key interval per row: the parts' intervals in their key coordinates
            _set_intervals(self.local, intervals, own_tok, own_tok, empty)
            _set_intervals(self.main, intervals, own_tok, buf_tok, empty)
            if self.remote is not None:
                _set_intervals(self.remote, intervals, own_tok, rem_tok, empty)
        remote_parts = [Part(self.remote, None, "rem")] if self.remote is not None else []
        runs = _edge_runs(self.remote, len(own_tok), bm) if self.remote is not None else None
        if runs is not None:  # the fetched keys concern a few runs of rows (a halo): one launch per run
            remote_parts = []
            for a, b in runs:
                r0, r1 = a * bm, min(b * bm, len(own_tok))
                shard = shard_layout(lay, rk.own_rows[a:b], rk.remote_cols, limit_rows=split_own[a:b],
                                     limit_cols=none, device=dev)
                if intervals is not None:
                    _set_intervals(shard, intervals, own_tok[r0:r1], rem_tok, empty[r0:r1])
                remote_parts.append(Part(shard, (r0, r1), "rem"))
        self.remote_rows = None if runs is None else sum(min(b * bm, len(own_tok)) - a * bm for a, b in runs)
        rect = _rectangles(lay, own_tok, buf_tok, rem_tok) if not split_own.any() else None
        self.rectangles = rect is not None
        main = [Part(self.main, None, "buf")]
        over = [Part(self.local, None, "own")] + remote_parts
        self.fwd_parts = {"main": main, "overlap": over}
        self.bwd_parts = {"main": main, "overlap": over[::-1]}
        if rect is not None:
            rmain, rover = rect
            self.bwd_parts = {"main": rmain, "overlap": [p for p in rover if p.remote] + [p for p in rover
                                                                                          if not p.remote]}
            if isinstance(lay.mask, Full):  # one dense launch per key source: the dense kernels in both passes
                self.fwd_parts = {"main": rmain, "overlap": [p for p in rover if not p.remote]
                                  + [p for p in rover if p.remote]}
        # -- split rows ----------------------------------------------------------------------------
        gs_tok = [_tokens(plan._ranks[p].guests_from[rank], bm, n) for p in range(P)]  # mine they compute
        self.gq_send_idx = _t(_positions(own_tok, np.concatenate(gs_tok)), dev)
        self.gq_send_n = [len(t) for t in gs_tok]
        self.gq_recv_n = [int(_tokens(g, bm, n).shape[0]) for g in gr]
        split_tok = _tokens(rk.own_split, bm, n)
        self.split_idx = _t(_positions(own_tok, split_tok), dev)
        self.n_split = len(split_tok)
        self.split_slot = _t(np.concatenate(
            [(p + 1) * self.n_split + _positions(split_tok, t) for p, t in enumerate(gs_tok)]), dev)
        self.guest_len = int(sum(self.gq_recv_n))
        self._groups: dict = {}

    # -- the K/V fetch ---------------------------------------------------------------------------
    @staticmethod
    def _fetch(plan, rank, own_tok, buf_tok, rem_tok, dev) -> Fetch:
        P, n = plan.world_size, plan.seq_len
        bn = plan.block_size[1]
        rk = plan._ranks[rank]
        send_direct, send_packed, send_all, packed_idx, all_idx = [], [], [], [], []
        recv_buf, recv_rem, recv_packed, pos_buf, pos_rem = [], [], [], [], []
        n_sp = n_all = n_rp = 0
        for p in range(P):
            if p == rank:
                continue
            mine = _tokens(plan._ranks[p].kv_from[rank], bn, n)  # my tokens p fetches
            runs = _runs(mine)
            if runs:
                own_pos = _positions(own_tok, mine)
                buf_pos = _positions(buf_tok, mine)
                all_idx.append(own_pos)
                if len(runs) <= MAX_RUNS:
                    for tag, (a, b) in enumerate(runs):
                        send_direct.append((p, int(buf_pos[a]), int(buf_pos[a]) + b - a, tag))
                        send_all.append((p, n_all + a, n_all + b, tag))
                else:
                    send_packed.append((p, n_sp, n_sp + len(mine), 0))
                    send_all.append((p, n_all, n_all + len(mine), 0))
                    packed_idx.append(buf_pos)
                    n_sp += len(mine)
                n_all += len(mine)
            theirs = _tokens(rk.kv_from[p], bn, n)  # p's tokens I fetch
            runs = _runs(theirs)
            if runs:
                bpos = _positions(buf_tok, theirs)
                rpos = _positions(rem_tok, theirs)
                if len(runs) <= MAX_RUNS:
                    for tag, (a, b) in enumerate(runs):
                        recv_buf.append((p, int(bpos[a]), int(bpos[a]) + b - a, tag))
                        recv_rem.append((p, int(rpos[a]), int(rpos[a]) + b - a, tag))
                else:
                    recv_packed.append((p, n_rp, n_rp + len(theirs), 0))
                    pos_buf.append(bpos)
                    pos_rem.append(rpos)
                    n_rp += len(theirs)
        cat = lambda xs: _t(np.concatenate(xs) if xs else np.zeros(0, np.int64), dev)  # noqa: E731
        return Fetch(send_direct, send_packed, cat(all_idx), cat(packed_idx), send_all, recv_buf, recv_rem,
                     recv_packed, cat(pos_buf), cat(pos_rem), n_sp, n_all, n_rp)

    # -- per call --------------------------------------------------------------------------------
    def peers(self, group) -> list:
        """Global ranks of the group's members (what point-to-point messages address), cached."""
        import torch.distributed as dist

        key = id(group)
        hit = self._groups.get(key)
        if hit is None or hit[0] is not group:
            world = dist.get_world_size(group)
            ranks = [dist.get_global_rank(group, r) for r in range(world)] if group is not None and \
                group is not dist.group.WORLD else list(range(world))
            hit = self._groups[key] = (group, ranks)
        return hit[1]

    def overlap(self, overlap) -> bool:
        """Whether to overlap the fetch with the own-key launch: ``overlap`` as given, or, for
        ``"auto"``, the plan's choice (:meth:`ContextParallelPlan.overlap_gain`)."""
        if overlap == "auto":
            return self.plan.overlap_auto
        return bool(overlap)


def _edge_runs(shard, n_rows: int, bm: int):
    """``[(a, b)]`` runs of local row blocks of ``shard`` that keep any block, when they cover at
    most :data:`EDGE_SHARE` of the ``n_rows`` rows in at most :data:`EDGE_RUNS` runs; else None."""
    rows, starts, ends, keep = _segment_arrays(shard)
    used = np.unique(rows[keep & (ends > starts)])
    runs = [(int(used[a]), int(used[b - 1]) + 1) for a, b in _runs(used)]
    if not runs or len(runs) > EDGE_RUNS:
        return None
    covered = sum(min(b * bm, n_rows) - a * bm for a, b in runs)
    return runs if covered <= EDGE_SHARE * n_rows else None


def _set_intervals(shard, intervals, row_tok: np.ndarray, key_tok: np.ndarray, empty: np.ndarray) -> None:
    """Give a shard its rows' key intervals in its key coordinates: the global ``[lo, hi)`` of a row
    restricted to the ascending ``key_tok`` is one contiguous range of it, so the interval kernels
    compute the shard exactly (``ops/select.layout_class``); rows flagged ``empty`` keep nothing."""
    lo, hi = intervals  # (Z, N) int32, global positions
    a = np.searchsorted(key_tok, lo[:, row_tok])
    e = np.searchsorted(key_tok, hi[:, row_tok])
    none = (e <= a) | empty[None, :]
    shard.cache["row_interval"] = (np.where(none, 0, a).astype(np.int32), np.where(none, 0, e).astype(np.int32))


_RECT_CACHE: dict = {}


def _rect_layout(kind: str, nq: int, nk: int, block) -> object:
    key = (kind, nq, nk, tuple(block))
    lay = _RECT_CACHE.get(key)
    if lay is None:
        lay = _RECT_CACHE[key] = compile_mask(causal() if kind == "causal" else full(), nq, nk, block,
                                              rewrite=False, align="top_left")
    return lay


def _rectangles(layout, own_tok: np.ndarray, buf_tok: np.ndarray, rem_tok: np.ndarray):
    """For ``causal()`` (top-left, one layout instance) and the dense mask: the rank's attention
    as dense and causal rectangles, ``(over buf, overlapped)`` lists of :class:`Part`, or None for
    any other layout. Own pieces ``[a_i, b_i)`` (ascending, local rows ``[l_i, l_i + b_i - a_i)``)
    give ``dense(rows of pieces >= i, keys [a_{i-1}, a_i))`` and ``causal(piece i)``; the
    overlapped list cuts every dense rectangle into its own and its fetched keys."""
    mask = layout.mask
    if layout.batch_shape or layout.q_offset != 0 or not isinstance(mask, (Causal, Full)):
        return None
    block = layout.block_size
    L = len(own_tok)
    if isinstance(mask, Full):  # one dense launch per key source
        over = [Part(_rect_layout("dense", L, L, block), (0, L), "own")]
        if len(rem_tok):
            over.append(Part(_rect_layout("dense", L, len(rem_tok), block), (0, L), "rem"))
        return [Part(_rect_layout("dense", L, len(buf_tok), block), (0, L), "buf")], over
    if not np.array_equal(buf_tok, np.arange(len(buf_tok))):
        return None  # the buffer of a causal shard is a prefix of the sequence
    pieces = [(int(own_tok[a]), int(own_tok[b - 1]) + 1, a) for a, b in _runs(own_tok)]
    dense, squares = [], []
    prev = 0
    for g0, g1, l0 in pieces:
        if g0 > prev:
            dense.append(((l0, L), prev, g0))
        squares.append(((l0, l0 + g1 - g0), g0, g1))
        prev = g0
    part = lambda kind, r, keys, a, b: Part(_rect_layout(kind, r[1] - r[0], b - a, block), r, keys, (a, b))  # noqa: E731
    main = [part("dense", r, "buf", s, e) for r, s, e in dense] + [part("causal", r, "buf", s, e)
                                                                   for r, s, e in squares]
    over = []
    for r, s, e in dense:  # each dense rectangle cut into its own keys and its fetched ones
        for g0, g1, l0 in pieces:
            a, b = max(s, g0), min(e, g1)
            if a < b:
                over.append(part("dense", r, "own", l0 + a - g0, l0 + b - g0))
        ra, rb = int(np.searchsorted(rem_tok, s)), int(np.searchsorted(rem_tok, e))
        if ra < rb:
            over.append(part("dense", r, "rem", ra, rb))
    starts = {g0: l0 for g0, _, l0 in pieces}
    over += [part("causal", r, "own", starts[s], starts[s] + e - s) for r, s, e in squares]
    return main, over


def exchange_for(plan: ContextParallelPlan, rank: int, device) -> Exchange:
    """The cached :class:`Exchange` of ``rank`` on ``device``."""
    key = (rank, str(torch.device(device)))
    ex = plan._exchanges.get(key)
    if ex is None:
        ex = plan._exchanges[key] = Exchange(plan, rank, device)
    return ex
