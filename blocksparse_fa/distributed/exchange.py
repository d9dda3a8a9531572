"""One rank's view of a plan on its device: shard layouts and the index tables of every exchange.

Built once per (plan, rank, device) and cached on the plan. Token order conventions:

* a rank's shard holds its tokens in ascending global order;
* every message is peer-major (what goes to / comes from rank 0 first), and within a peer in
  ascending global order, so both sides of an all-to-all agree without sending indices;
* the key buffer of the one-launch forward holds the rank's own key blocks and the fetched ones
  in ascending global order (runs of blocks stay runs for the kernels' tables).
"""

from __future__ import annotations

import numpy as np
import torch

from ..compiler.shard import shard_layout
from .plan import ContextParallelPlan, _tokens

__all__ = ["Exchange", "exchange_for"]


def _t(a, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def _positions(sorted_ref: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Index of each entry of ``x`` in the ascending ``sorted_ref`` (every entry must be there)."""
    pos = np.searchsorted(sorted_ref, x)
    if len(x) and (pos.max(initial=0) >= len(sorted_ref) or not np.array_equal(sorted_ref[pos], x)):
        raise AssertionError("plan tables inconsistent: a token is missing from its buffer")
    return pos


class Exchange:
    """Rank ``rank``'s layouts and exchange tables (see the module docstring).

    Attributes:
        main: own rows against the one-launch key buffer (own + fetched blocks); split rows
            limited to the own blocks.
        part_local, part_remote: the same rows against the own blocks only / the fetched blocks
            only (the overlapped path: the first runs while the fetch is in flight).
        guest: split rows of other ranks against the own blocks (None when there are none).
        kv_send_idx, kv_send_splits, kv_recv_splits: K/V tokens sent (local positions, peer-major)
            and the token counts per peer.
        buf_idx: the key buffer from ``cat(local shard, received)``.
        own_in_buf, recv_in_buf: where the own / received tokens sit in the key buffer.
        remote_idx: the fetched tokens in ascending order from the received ones.
        gq_send_idx, gq_send_splits, gq_recv_splits, gq_order: split-row queries sent to the ranks
            that compute a part of them; received ones in ascending order.
        gback_idx: guest rows (ascending buffer) in peer-major order, to return their partials.
        split_idx: local positions of the own split rows' tokens; ``split_from``: per peer, where
            its returned rows sit among them.
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
        self.has_split = any(len(r.guest_rows) for r in plan._ranks)
        self.fetches = len(rk.remote_cols) > 0
        # -- K/V blocks -----------------------------------------------------------------------
        send_tok = [_tokens(plan._ranks[p].kv_from[rank], bn, n) for p in range(P)]
        recv_tok = [_tokens(rk.kv_from[p], bn, n) for p in range(P)]
        self.kv_send_idx = _t(_positions(own_tok, np.concatenate(send_tok)), dev)
        self.kv_send_splits = [len(t) for t in send_tok]
        self.kv_recv_splits = [len(t) for t in recv_tok]
        recv_glob = np.concatenate(recv_tok)
        buf_cols = np.union1d(rk.own_cols, rk.remote_cols)
        buf_tok = _tokens(buf_cols, bn, n)
        src = np.concatenate([own_tok, recv_glob])
        order = np.argsort(src, kind="stable")
        self.buf_idx = _t(order[_positions(src[order], buf_tok)], dev)
        self.own_in_buf = _t(_positions(buf_tok, own_tok), dev)
        self.recv_in_buf = _t(_positions(buf_tok, recv_glob), dev)
        rem_tok = _tokens(rk.remote_cols, bn, n)
        rorder = np.argsort(recv_glob, kind="stable")
        self.remote_idx = _t(rorder[_positions(recv_glob[rorder], rem_tok)], dev)
        self.remote_to_recv = _t(_positions(rem_tok, recv_glob), dev)  # received order in the sorted buffer
        # -- layouts ---------------------------------------------------------------------------
        split_own = np.isin(rk.own_rows, plan.split)
        self.main = shard_layout(lay, rk.own_rows, buf_cols, limit_rows=split_own, limit_cols=rk.own_cols, device=dev)
        self.part_local = shard_layout(lay, rk.own_rows, rk.own_cols, device=dev)
        self.part_remote = (shard_layout(lay, rk.own_rows, rk.remote_cols, limit_rows=split_own,
                                         limit_cols=rk.own_cols, device=dev) if len(rk.remote_cols) else None)
        self.guest = shard_layout(lay, rk.guest_rows, rk.own_cols, device=dev) if len(rk.guest_rows) else None
        # -- split rows --------------------------------------------------------------------------
        gs_tok = [_tokens(plan._ranks[p].guests_from[rank], bm, n) for p in range(P)]  # my rows they compute
        gr_tok = [_tokens(rk.guests_from[p], bm, n) for p in range(P)]  # their rows I compute
        self.gq_send_idx = _t(_positions(own_tok, np.concatenate(gs_tok)), dev)
        self.gq_send_splits = [len(t) for t in gs_tok]
        self.gq_recv_splits = [len(t) for t in gr_tok]
        g_recv = np.concatenate(gr_tok)
        g_sorted = _tokens(rk.guest_rows, bm, n)
        gorder = np.argsort(g_recv, kind="stable")
        self.gq_order = _t(gorder[_positions(g_recv[gorder], g_sorted)], dev)
        self.gback_idx = _t(_positions(g_sorted, g_recv), dev)
        split_tok = _tokens(rk.own_split, bm, n)
        self.split_idx = _t(_positions(own_tok, split_tok), dev)
        self.n_split = len(split_tok)
        self.split_from = [_t(_positions(split_tok, t), dev) for t in gs_tok]
        self.guest_len = len(g_sorted)


def exchange_for(plan: ContextParallelPlan, rank: int, device) -> Exchange:
    """The cached :class:`Exchange` of ``rank`` on ``device``."""
    key = (rank, str(torch.device(device)))
    ex = plan._exchanges.get(key)
    if ex is None:
        ex = plan._exchanges[key] = Exchange(plan, rank, device)
    return ex
