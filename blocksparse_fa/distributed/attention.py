"""Sparse-aware context-parallel attention: forward and backward on one rank.

Each rank holds the q, k, v of its tokens (:meth:`ContextParallelPlan.indices`). Forward:

1. the key/value blocks its queries visit that other ranks own arrive in one all-to-all (only
   those: the traffic follows the layout's density, not the sequence length);
2. the split rows' queries (global tokens, :mod:`.balance`) go to the ranks that compute a part;
3. one kernel launch over the rank's shard layout (own rows against own + fetched blocks; the
   kernels see global positions through the layout's position tables, so masks and dropout are
   those of the unsharded run), or two launches with ``overlap=True``: own blocks while the fetch is
   in flight, then the fetched ones, merged exactly in float32;
4. split rows: each rank's part (float32 output and logsumexp) returns to the row's owner, which
   merges them exactly in float32.

Backward (recompute, FlashAttention-2 style): the split rows' ``dO``, output and logsumexp go to
the ranks that computed a part; each rank runs the backward of its launches with the *merged*
output and logsumexp (for disjoint key sets each part then yields its share of dQ and all of
dK/dV for its keys); dK/dV of fetched blocks (float32) return to their owners and are added there
(``index_add_``, one peer at a time: deterministic); split rows' dQ parts return to the owner.
"""

from __future__ import annotations

import torch

from ..ops import dispatch
from ..ops.merge import merge_attention
from ..ops.options import DEFAULT_OPTIONS
from ..ops.validate import Shapes
from .comm import Pending, all_to_all
from .exchange import Exchange

__all__ = ["cp_forward", "cp_backward", "fetch", "Saved"]


def _acc(dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _shapes(q, k, lq, lk) -> Shapes:
    return Shapes(q.shape[0], q.shape[1], k.shape[1], lq, lk, q.shape[3])


def _tok_first(x: torch.Tensor, idx: torch.Tensor | None, dim: int) -> torch.Tensor:
    """``x`` with dim ``dim`` (tokens) selected by ``idx`` and moved first (a message)."""
    if idx is not None:
        x = x.index_select(dim, idx)
    return x.movedim(dim, 0).contiguous()


def _fwd(q, k, v, layout, scale, p, seed, backend, out_dtype, opts):
    s = _shapes(q, k, layout.q_len, layout.kv_len)
    return dispatch.forward(q, k, v, layout, s, scale, p, seed, backend, use_rewrite=False, out_dtype=out_dtype,
                            opts=opts)


def _bwd(q, k, v, out, lse, do, layout, scale, p, seed, backend, dlse, grad_dtype, opts):
    s = _shapes(q, k, layout.q_len, layout.kv_len)
    return dispatch.backward(q, k, v, out, lse, do, layout, s, scale, p, seed, backend, dlse=dlse, use_rewrite=False,
                             grad_dtype=grad_dtype, opts=opts)


class Saved:
    """What the backward needs besides q, k, v, out, lse."""

    __slots__ = ("kvbuf", "kvrem", "gq")

    def __init__(self, kvbuf=None, kvrem=None, gq=None):
        self.kvbuf, self.kvrem, self.gq = kvbuf, kvrem, gq


def _send_kv(ex: Exchange, k, v, group, async_op) -> Pending | None:
    if not ex.has_kv:
        return None
    kv = torch.stack([k, v])  # (2, B, Hkv, L, D)
    return all_to_all(_tok_first(kv, ex.kv_send_idx, 3), ex.kv_send_splits, ex.kv_recv_splits, group, async_op)


def _send_guest_q(ex: Exchange, q, group, async_op) -> Pending | None:
    if not ex.has_split:
        return None
    return all_to_all(_tok_first(q, ex.gq_send_idx, 2), ex.gq_send_splits, ex.gq_recv_splits, group, async_op)


def _merge_split(ex: Exchange, out, lse, parts_back: torch.Tensor, acc) -> tuple:
    """Merge the own split rows' part (in ``out``/``lse``) with the parts other ranks return
    (``parts_back``: ``(T, B, H, D + 1)`` float32, peer-major, last column the logsumexp)."""
    if ex.n_split == 0:
        return out, lse
    idx = ex.split_idx
    B, H, _, D = out.shape
    parts = [(out.index_select(2, idx).to(acc), lse.index_select(2, idx).to(acc))]
    off = 0
    for p, where in enumerate(ex.split_from):
        n = len(where)
        if n == 0:
            continue
        got = parts_back[off:off + n].movedim(0, 2)  # (B, H, n, D + 1)
        off += n
        o = torch.zeros((B, H, ex.n_split, D), dtype=acc, device=out.device)
        lp = torch.full((B, H, ex.n_split), float("-inf"), dtype=acc, device=out.device)
        o[:, :, where] = got[..., :D].to(acc)
        lp[:, :, where] = got[..., D].to(acc)
        parts.append((o, lp))
    mo, ml = merge_attention(parts)
    # in place: ``out``/``lse`` are this call's own buffers (a copy would be an L-sized pass)
    out.index_copy_(2, idx, mo.to(out.dtype))
    lse.index_copy_(2, idx, ml.to(lse.dtype))
    return out, lse


def cp_forward(ex: Exchange, q, k, v, scale: float, dropout_p: float, seed: int, backend: str, group,
               overlap: bool = False, opts=DEFAULT_OPTIONS):
    """``(out (B, H, L, D) in q's dtype, lse (B, H, L) float32, Saved)`` of this rank's tokens
    (``opts``: the call's kernel options, for every local launch)."""
    acc = _acc(q.dtype)
    kv_in = _send_kv(ex, k, v, group, async_op=overlap)
    gq_in = _send_guest_q(ex, q, group, async_op=overlap)
    split_out = acc if ex.n_split else None
    saved = Saved()
    if overlap:
        out, lse = _fwd(q, k, v, ex.part_local, scale, dropout_p, seed, backend, acc, opts)
        if kv_in is not None:
            recv = kv_in.wait()  # (T, 2, B, Hkv, D)
            if ex.part_remote is not None:
                rem = recv.index_select(0, ex.remote_idx).movedim(0, 3)  # (2, B, Hkv, Tr, D)
                o2, l2 = _fwd(q, rem[0], rem[1], ex.part_remote, scale, dropout_p, seed, backend, acc, opts)
                out, lse = merge_attention([(out, lse), (o2, l2)])
                saved.kvrem = rem
        out = out.to(split_out or q.dtype)
    else:
        if kv_in is not None and ex.fetches:
            recv = kv_in.wait().movedim(0, 3)  # (2, B, Hkv, T, D)
            kvbuf = torch.cat([torch.stack([k, v]), recv], dim=3).index_select(3, ex.buf_idx)
            saved.kvbuf = kvbuf
            kb, vb = kvbuf[0], kvbuf[1]
        else:
            if kv_in is not None:
                kv_in.wait()  # nothing arrives here; others' blocks went out
            kb, vb = k, v
        out, lse = _fwd(q, kb, vb, ex.main, scale, dropout_p, seed, backend, split_out, opts)
    if gq_in is not None:
        gq = None
        back = torch.zeros((0, *q.shape[:2], q.shape[3] + 1), dtype=acc, device=q.device)
        if ex.guest is not None:
            gq = gq_in.wait().index_select(0, ex.gq_order).movedim(0, 2)  # (B, H, G, D)
            og, lg = _fwd(gq, k, v, ex.guest, scale, dropout_p, seed, backend, acc, opts)
            back = torch.cat([og, lg.to(acc).unsqueeze(-1)], -1)
            back = _tok_first(back, ex.gback_idx, 2)
        else:
            gq_in.wait()
        saved.gq = gq
        parts_back = all_to_all(back, ex.gq_recv_splits, ex.gq_send_splits, group).wait()
        out, lse = _merge_split(ex, out, lse, parts_back, acc)
    return out.to(q.dtype), lse.float() if lse.dtype != torch.float64 else lse, saved


def fetch(ex: Exchange, q, k, v, group, overlap: bool = False) -> Saved:
    """The exchanges of :func:`cp_forward` without the attention: the buffers its backward needs
    (the custom op's backward fetches them again)."""
    kv_in = _send_kv(ex, k, v, group, async_op=False)
    gq_in = _send_guest_q(ex, q, group, async_op=False)
    saved = Saved()
    if kv_in is not None:
        recv = kv_in.wait()
        if overlap and ex.part_remote is not None:
            saved.kvrem = recv.index_select(0, ex.remote_idx).movedim(0, 3)
        elif not overlap and ex.fetches:
            saved.kvbuf = torch.cat([torch.stack([k, v]), recv.movedim(0, 3)], dim=3).index_select(3, ex.buf_idx)
    if gq_in is not None:
        got = gq_in.wait()
        if ex.guest is not None:
            saved.gq = got.index_select(0, ex.gq_order).movedim(0, 2)
    return saved


def _add_by_peer(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, splits) -> None:
    """``dst[:, :, idx] += src`` along dim 2, one peer's rows at a time (indices are distinct within
    a peer, so the sums are deterministic)."""
    off = 0
    for n in splits:
        if n:
            dst.index_add_(2, idx[off:off + n], src[:, :, off:off + n])
        off += n


def cp_backward(ex: Exchange, q, k, v, out, lse, dout, dlse, saved: Saved, scale: float, dropout_p: float,
                seed: int, backend: str, group, overlap: bool = False, opts=DEFAULT_OPTIONS):
    """``(dq, dk, dv)`` of this rank's tokens, in the inputs' dtypes."""
    acc = _acc(q.dtype)
    B, H, L, D = q.shape
    # split rows: send dO, out, lse (and dlse) to the ranks that computed a part
    g_in = None
    if ex.has_split:
        # only the split rows travel: select them before any conversion (L-sized passes cost
        # more than the whole exchange)
        sel = (lambda t: t.index_select(2, ex.gq_send_idx)) if ex.gq_send_idx is not None else (lambda t: t)
        dl = sel(dlse).to(acc) if dlse is not None else torch.zeros_like(sel(lse), dtype=acc)
        pack = torch.cat([sel(dout).to(acc), sel(out).to(acc), sel(lse).to(acc).unsqueeze(-1), dl.unsqueeze(-1)], -1)
        g_in = all_to_all(_tok_first(pack, None, 2), ex.gq_send_splits, ex.gq_recv_splits, group,
                          async_op=overlap)
    dkv_back = None
    if overlap:
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv_own = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
        if saved.kvrem is not None:  # fetched blocks first, so their dK/dV can travel during the rest
            g = _bwd(q, saved.kvrem[0], saved.kvrem[1], out, lse, dout, ex.part_remote, scale, dropout_p, seed,
                     backend, dlse, acc, opts)
            dq += g[0]
            dkv_rem = torch.stack([g[1], g[2]]).index_select(3, ex.remote_to_recv)
            dkv_back = all_to_all(dkv_rem.movedim(3, 0), ex.kv_recv_splits, ex.kv_send_splits, group, async_op=True)
        elif ex.has_kv:
            dkv_back = all_to_all(torch.zeros((0, 2, *k.shape[:2], D), dtype=acc, device=k.device),
                                  ex.kv_recv_splits, ex.kv_send_splits, group, async_op=True)
        g = _bwd(q, k, v, out, lse, dout, ex.part_local, scale, dropout_p, seed, backend, dlse, acc, opts)
        dq += g[0]
        dkv_own[0] += g[1]
        dkv_own[1] += g[2]
    else:
        kb, vb = (saved.kvbuf[0], saved.kvbuf[1]) if saved.kvbuf is not None else (k, v)
        dq, dkb, dvb = _bwd(q, kb, vb, out, lse, dout, ex.main, scale, dropout_p, seed, backend, dlse, acc, opts)
        dkvb = torch.stack([dkb, dvb])
        if saved.kvbuf is not None:
            dkv_own = dkvb.index_select(3, ex.own_in_buf)
            send = _tok_first(dkvb, ex.recv_in_buf, 3)
        else:
            dkv_own = dkvb
            send = dkvb.new_zeros((0, 2, *k.shape[:2], D))
        if ex.has_kv:
            dkv_back = all_to_all(send, ex.kv_recv_splits, ex.kv_send_splits, group)
    # split rows computed here for other ranks
    if g_in is not None:
        got = g_in.wait()
        back = torch.zeros((0, B, H, D), dtype=acc, device=q.device)
        if ex.guest is not None:
            got = got.index_select(0, ex.gq_order).movedim(0, 2)  # (B, H, G, 2D + 2)
            gdo, gout = got[..., :D], got[..., D:2 * D]
            glse, gdlse = got[..., 2 * D].contiguous(), got[..., 2 * D + 1].contiguous()
            gdo, gout = gdo.to(q.dtype), gout.to(q.dtype)
            glse = glse.to(lse.dtype)
            gq = saved.gq
            gdq, gdk, gdv = _bwd(gq, k, v, gout, glse, gdo, ex.guest, scale, dropout_p, seed, backend, gdlse, acc,
                                 opts)
            dkv_own[0] += gdk
            dkv_own[1] += gdv
            back = _tok_first(gdq, ex.gback_idx, 2)
        dq_parts = all_to_all(back, ex.gq_recv_splits, ex.gq_send_splits, group).wait()  # (T, B, H, D)
        _add_by_peer(dq, ex.split_idx[_split_order(ex)], dq_parts.movedim(0, 2), ex.gq_send_splits)
    if dkv_back is not None:
        recv = dkv_back.wait()  # (T, 2, B, Hkv, D) float32, peer-major
        flat = recv.movedim(0, 3)  # (2, B, Hkv, T, D)
        off = 0
        for n in ex.kv_send_splits:
            if n:
                dkv_own.index_add_(3, ex.kv_send_idx[off:off + n], flat[:, :, :, off:off + n])
            off += n
    # separate tensors (never views of one buffer): the custom op may not return aliases
    return dq.to(q.dtype), dkv_own[0].to(k.dtype, copy=True), dkv_own[1].to(v.dtype, copy=True)


def _split_order(ex: Exchange) -> torch.Tensor:
    """Positions (among the own split tokens) of the rows returned by each peer, peer-major."""
    if not ex.split_from:
        return torch.zeros(0, dtype=torch.int64, device=ex.device)
    return torch.cat(ex.split_from)
