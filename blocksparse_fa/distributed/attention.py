"""Sparse-aware context-parallel attention: forward and backward on one rank.

Each rank holds the q, k, v of its tokens (:meth:`ContextParallelPlan.indices`). Forward:

1. the key/value blocks its queries visit that other ranks own arrive as point-to-point messages,
   straight into a token-major key buffer (:mod:`.exchange`: runs of consecutive tokens; only
   those blocks move, so the traffic follows the layout's density, not the sequence length);
2. split rows (global tokens, :mod:`.balance`): their queries go to the ranks that hold their keys,
   and one launch per rank computes every split row's part over its own keys in float32;
3. the rank's own rows: one launch over its own and fetched keys, or (``overlap``) one over its
   own keys while the fetch is in flight, then one over the fetched keys, merged exactly in
   float32 through the logsumexps. The kernels see global positions (the shard layouts' position
   tables) or, for one-interval-per-row masks, each row's keys as one range of the buffer;
4. split rows: the parts return to their owner, which merges them in float32.

Backward (recompute, FlashAttention-2 style): the split rows' ``dO``, output and logsumexp go to the
ranks that computed a part; every launch runs its backward with the *merged* output and logsumexp
(for disjoint key sets each part then yields its share of dQ and all of dK/dV for its keys), the
fetched keys' parts first so that their dK/dV travel back to the owners while the own keys' parts
run (``overlap``); owners add them in float32, one peer at a time (deterministic); split rows' dQ
parts return to their owner. Only the gradients that are sums over ranks or launches are kept in
float32; everything else is written once, in the inputs' dtype. The returned dK/dV parts travel in
the inputs' dtype when it is 16-bit (``_RETURN_DTYPE``: half the bytes; each part is rounded once
before its owner adds it in float32; on 4 × H200 the gradients' error against float64 stayed the
one-GPU run's to two digits), else in float32.
"""

from __future__ import annotations

import dataclasses

import torch

from ..ops import dispatch, select
from ..ops.merge import merge_attention
from ..ops.options import _DEFAULT_GLUON, _DEFAULT_GLUON_BWD, DEFAULT_OPTIONS
from ..ops.validate import Shapes
from .comm import Pending, exchange
from .exchange import Exchange, Part

__all__ = ["cp_forward", "cp_backward", "fetch", "Saved"]

# message tags of the steps that can be in flight together (gloo matches messages by tag)
_TAG_GQ, _TAG_KV, _TAG_GBACK, _TAG_GPACK, _TAG_GDQ, _TAG_DKV = 100, 0, 101, 102, 103, 104


def _acc(dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _shapes(q, k, lq, lk) -> Shapes:
    return Shapes(q.shape[0], q.shape[1], k.shape[1], lq, lk, q.shape[3])


def _fwd(q, k, v, layout, scale, p, seed, backend, out_dtype, opts):
    s = _shapes(q, k, layout.q_len, layout.kv_len)
    return dispatch.forward(q, k, v, layout, s, scale, p, seed, backend, use_rewrite=False, out_dtype=out_dtype,
                            opts=opts)


def _bwd(q, k, v, out, lse, do, layout, scale, p, seed, backend, dlse, grad_dtype, opts):
    s = _shapes(q, k, layout.q_len, layout.kv_len)
    return dispatch.backward(q, k, v, out, lse, do, layout, s, scale, p, seed, backend, dlse=dlse, use_rewrite=False,
                             grad_dtype=grad_dtype, opts=opts)


def _kv_views(buf: torch.Tensor):
    """K and V ``(B, Hkv, T, D)`` of a token-major ``(T, 2, B, Hkv, D)`` buffer (strided views)."""
    return buf[:, 0].permute(1, 2, 0, 3), buf[:, 1].permute(1, 2, 0, 3)


def _tokens_first(*xs: torch.Tensor, idx=None, dtype=None) -> torch.Tensor:
    """``(T, len(xs), B, H, D)``: the tokens ``idx`` (dim 2) of each ``(B, H, L, D)`` tensor,
    token-major, in ``dtype`` (None: theirs; converted in the same pass)."""
    sel = [x if idx is None else x.index_select(2, idx) for x in xs]
    if dtype is None or all(x.dtype == dtype for x in sel):
        return torch.stack([x.permute(2, 0, 1, 3) for x in sel], 1)
    B, H, T, D = sel[0].shape
    out = sel[0].new_empty((T, len(sel), B, H, D), dtype=dtype)
    for i, x in enumerate(sel):
        out[:, i].copy_(x.permute(2, 0, 1, 3))
    return out


def _slices(t: torch.Tensor, msgs, counts=None):
    """``[(peer, slice, tag)]``: messages as slices of ``t`` (``msgs``: ``(peer, start, end, tag)``, or
    with ``counts``: consecutive per-peer blocks, tag ``msgs``)."""
    if counts is None:
        return [(p, t[a:b], tag) for p, a, b, tag in msgs]
    out, off = [], 0
    for p, c in enumerate(counts):
        if c:
            out.append((p, t[off:off + c], msgs))
        off += c
    return out


class Saved:
    """What the backward needs besides q, k, v, out, lse: the token-major key buffer (``buf`` or
    ``rem``) and the split rows' queries (own and received, token-major)."""

    __slots__ = ("kvbuf", "kvrem", "gq")

    def __init__(self, kvbuf=None, kvrem=None, gq=None):
        self.kvbuf, self.kvrem, self.gq = kvbuf, kvrem, gq


class _Fetch:
    """The K/V messages of one call in flight; ``wait()`` fills the destination buffer."""

    def __init__(self, ex: Exchange, k, v, group, ranks, overlap: bool, extra=((), ())):
        f = ex.fetch
        B, Hkv, _, D = k.shape
        self.buf = self.rem = self.stage = None
        sends = []
        if overlap or not ex.fetches:  # sends gathered from k, v; received into the fetched-only buffer
            if f.n_send_all:
                sends = _slices(_tokens_first(k, v, idx=f.send_idx_own), f.send_all_own)
            dst = self.rem = k.new_empty((ex.rem_len, 2, B, Hkv, D)) if ex.fetches else None
            direct, self.pos = f.recv_rem, f.recv_pos_rem
        else:  # one buffer of own and fetched keys: sends read it, receives land in it
            dst = self.buf = k.new_empty((ex.buf_len, 2, B, Hkv, D))
            for b0, l0, n in ex.own_runs:
                dst[b0:b0 + n, 0].copy_(k[:, :, l0:l0 + n].permute(2, 0, 1, 3))
                dst[b0:b0 + n, 1].copy_(v[:, :, l0:l0 + n].permute(2, 0, 1, 3))
            sends = _slices(dst, f.send_direct)
            if f.n_send_packed:
                sends += _slices(dst.index_select(0, f.send_idx_buf), f.send_packed)
            direct, self.pos = f.recv_buf, f.recv_pos_buf
        recvs = _slices(dst, direct) if dst is not None else []
        if f.n_recv_packed:
            self.stage = k.new_empty((f.n_recv_packed, 2, B, Hkv, D))
            recvs += _slices(self.stage, f.recv_packed)
        sends = [(p, t, tag + _TAG_KV) for p, t, tag in sends] + list(extra[0])
        recvs = [(p, t, tag + _TAG_KV) for p, t, tag in recvs] + list(extra[1])
        self.dst = dst
        self.pending = exchange(sends, recvs, group, ranks, async_op=True)

    def wait(self):
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            if self.stage is not None:
                self.dst.index_copy_(0, self.pos, self.stage)
                self.stage = None
        return self


def _guest_q(ex: Exchange, q):
    """The messages of the split rows' queries to the ranks that compute a part: ``(sends, recvs,
    gq)`` with ``gq`` ``(G, B, H, D)`` token-major: own split rows first, then the received ones
    (peer-major)."""
    B, H, _, D = q.shape
    gq = q.new_empty((ex.n_split + ex.guest_len, B, H, D))
    if ex.n_split:
        gq[:ex.n_split].copy_(q.index_select(2, ex.split_idx).permute(2, 0, 1, 3))
    sends = _slices(q.index_select(2, ex.gq_send_idx).permute(2, 0, 1, 3).contiguous(), _TAG_GQ, ex.gq_send_n) \
        if sum(ex.gq_send_n) else []
    return sends, _slices(gq[ex.n_split:], _TAG_GQ, ex.gq_recv_n), gq


def _start_exchanges(ex: Exchange, q, k, v, group, ranks, over: bool, fuse: bool):
    """The first step of a call: the split rows' queries and the K/V fetch, ``(gpend, gq, fetch)``
    (``over``: this rank's fetch overlaps its own-key launch). Where ``fuse`` (plans without
    overlap, whose launches wait for the fetch anyway; the same on every rank, which must reach the
    same steps) they travel as one batch of messages: one step's host cost and one message kernel,
    not two."""
    gpend = gq = fetch = None
    if ex.has_split:
        gs, gr, gq = _guest_q(ex, q)
        if ex.has_kv and fuse:
            fetch = _Fetch(ex, k, v, group, ranks, over, extra=(gs, gr))
            gpend = fetch
        else:
            gpend = exchange(gs, gr, group, ranks, async_op=True)
    if ex.has_kv and fetch is None:
        fetch = _Fetch(ex, k, v, group, ranks, over)
    return gpend, gq, fetch


def _heads_view(t: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, ...)`` view of a token-major ``(T, B, H, ...)`` tensor."""
    return t.permute(1, 2, 0, *range(3, t.dim()))


def _keys(part: Part, k, v, fetch: _Fetch | None, saved: Saved):
    """The K, V a part reads (waiting for the fetch where they arrive through it)."""
    if part.keys == "own" or (part.keys == "buf" and saved.kvbuf is None and saved.kvrem is None
                              and (fetch is None or fetch.buf is None)):
        K, V = k, v
    else:
        if fetch is not None:
            fetch.wait()
            saved.kvbuf, saved.kvrem = fetch.buf, fetch.rem
        K, V = _kv_views(saved.kvbuf if part.keys == "buf" else saved.kvrem)
    if part.span is not None:
        a, b = part.span
        K, V = K[:, :, a:b], V[:, :, a:b]
    return K, V


def _rows(x, part: Part):
    return x if part.rows is None else x[:, :, part.rows[0]:part.rows[1]]


def _fast(layout) -> bool:
    """Whether a forward launch may run the Gluon kernels (dense, causal and one-interval-per-row
    layouts), which write in the inputs' dtype only: its output is then asked for in that dtype."""
    return select.layout_class(layout).kind in ("dense", "causal", "interval")


def _merge(o1, l1, o2, l2, backend, rows=None):
    """``(o, lse)`` of two parts over disjoint keys, in ``o1``'s dtype (float32 arithmetic; on the
    GPU one pass in place of ``o1``); ``rows``: the rows ``(start, end)`` of ``o1`` that part 2
    covers (None: all), the others are kept."""
    a = 0 if rows is None else rows[0]
    if backend == "triton" and o1.is_cuda:
        from ..ops.triton_backend import merge_residue

        o1, l1, o2, l2 = (t.contiguous() for t in (o1, l1, o2, l2))
        merge_residue(o1, l1, o2, l2, 1, a)
        return o1, l1
    if rows is None or tuple(rows) == (0, o1.shape[2]):
        return merge_attention([(o1, l1), (o2, l2)])
    b = rows[1]
    o, lp = merge_attention([(o1[:, :, a:b], l1[:, :, a:b]), (o2, l2)])
    o1[:, :, a:b] = o
    l1[:, :, a:b] = lp
    return o1, l1


def _beside_messages(opts):
    """``opts`` for the launches of a call whose messages are in flight while they run: persistent
    Gluon grids leave ``_SM_MARGIN`` SMs to NCCL's kernels (unless the call set its own margin)."""
    if not _SM_MARGIN:
        return opts
    fwd, bwd = opts.gluon_fwd or _DEFAULT_GLUON, opts.gluon_bwd or _DEFAULT_GLUON_BWD
    if fwd.sm_margin or bwd.sm_margin:
        return opts
    return opts.replace(gluon_fwd=dataclasses.replace(fwd, sm_margin=_SM_MARGIN),
                        gluon_bwd=dataclasses.replace(bwd, sm_margin=_SM_MARGIN))


def cp_forward(ex: Exchange, q, k, v, scale: float, dropout_p: float, seed: int, backend: str, group,
               overlap=False, opts=DEFAULT_OPTIONS):
    """``(out (B, H, L, D) in q's dtype, lse (B, H, L) float32, Saved)`` of this rank's tokens
    (``opts``: the call's kernel options, for every local launch; ``overlap``: bool or ``"auto"``)."""
    acc = _acc(q.dtype)
    ranks = ex.peers(group)
    plan_overlaps = ex.overlap(overlap)
    over = plan_overlaps and ex.fetches
    if over:
        opts = _beside_messages(opts)
    saved = Saved()
    gpend, gq, fetch = _start_exchanges(ex, q, k, v, group, ranks, over, not plan_overlaps and _WAIT_SENDS)
    if fetch is not None and not plan_overlaps and _WAIT_SENDS:
        # Before any launch: a rank that only sends (it fetches nothing) would start its kernels
        # at once, NCCL's kernel would get no SM until they end, and every receiver would wait
        # that long (0.66 ms of a 3.8-ms Longformer fwd+bwd on 4 GPUs). Receivers wait here anyway.
        # Not when the plan overlaps: the receivers then run their own keys first, their message
        # kernels wait for SMs in turn, and a sender waiting for them would idle.
        fetch.wait()
    back = None
    if gpend is not None:  # split rows first: their partial results travel while the own rows run
        gpend.wait()
        saved.gq = gq
        back = _guest_forward(ex, q, k, v, gq, scale, dropout_p, seed, backend, group, ranks, opts, acc)
    out = lse = None
    for part in ex.fwd_parts["overlap" if over else "main"]:  # the first covers every row
        K, V = _keys(part, k, v, fetch, saved)
        odt = None if out is None or _fast(part.layout) else acc
        o, lp = _fwd(_rows(q, part), K, V, part.layout, scale, dropout_p, seed, backend, odt, opts)
        out, lse = (o, lp) if out is None else _merge(out, lse, o, lp, backend, part.rows)
    if fetch is not None:
        fetch.wait()  # every message completes before the call returns
        saved.kvbuf, saved.kvrem = fetch.buf, fetch.rem
    if back is not None:
        out, lse = _merge_split(ex, out, lse, back, acc)
    return out if out.dtype == q.dtype else out.to(q.dtype), lse, saved


_WAIT_SENDS = True  # complete the fetch before the first launch when not overlapping (see cp_forward)
# the dtype in which fetched keys' dK/dV parts travel back to their owners: "float32" (the
# accumulation dtype) or "input" (16-bit inputs: half the bytes; each part is rounded once before its
# owner adds it in float32). 4 x H200, 256K, BigBird fwd+bwd 5.40 -> 5.25 ms (benchmarks/NOTES.md,
# section 11)
_RETURN_DTYPE = "input"
# SMs the persistent Gluon kernels of an overlapped call leave free for NCCL's kernels: a message
# kernel queued beside a launch that fills every SM gets none until that launch drains
_SM_MARGIN = 0


def _guest_forward(ex: Exchange, q, k, v, gq, scale, dropout_p, seed, backend, group, ranks, opts, acc):
    """Every split row's part over the own keys (float32): the received ones go back to their
    owners (in flight when this returns), the own ones are kept. Returns ``(pending, own part)``."""
    B, H, _, D = q.shape
    og, lg = _fwd(_heads_view(gq), k, v, ex.guest, scale, dropout_p, seed, backend, acc, opts)
    part = torch.cat([og, lg.to(acc).unsqueeze(-1)], -1).permute(2, 0, 1, 3).contiguous()  # (G, B, H, D + 1)
    n = ex.n_split
    recv = part.new_empty((sum(ex.gq_send_n), B, H, D + 1))
    pend = exchange(_slices(part[n:], _TAG_GBACK, ex.gq_recv_n), _slices(recv, _TAG_GBACK, ex.gq_send_n), group,
                    ranks, async_op=True, result=recv)
    return pend, part[:n]


def _merge_split(ex: Exchange, out, lse, back, acc):
    """Own split rows: the own part and the parts other ranks returned, merged in float32 and
    written into ``out``/``lse`` (whose rows of them the main launches left empty)."""
    pend, own = back
    got = pend.wait()  # (sum, B, H, D + 1), peer-major
    n = ex.n_split
    if n == 0:
        return out, lse
    B, H, _, D = out.shape
    slots = len(ex.gq_send_n) + 1
    allp = own.new_zeros((slots * n, B, H, D + 1))
    allp[..., D] = float("-inf")
    allp[:n] = own
    allp.index_copy_(0, ex.split_slot, got)
    allp = allp.view(slots, n, B, H, D + 1)
    lses = allp[..., D]
    m = lses.amax(0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m)
    tot = w.sum(0)
    o = (allp[..., :D] * (w / tot.clamp_min(torch.finfo(acc).tiny)).unsqueeze(-1)).sum(0)  # (n, B, H, D)
    lm = torch.where(tot > 0, m + torch.log(tot.clamp_min(torch.finfo(acc).tiny)), torch.full_like(m, float("-inf")))
    out.index_copy_(2, ex.split_idx, o.permute(1, 2, 0, 3).to(out.dtype))
    lse.index_copy_(2, ex.split_idx, lm.permute(1, 2, 0).to(lse.dtype))
    return out, lse


def fetch(ex: Exchange, q, k, v, group, overlap=False) -> Saved:
    """The exchanges of :func:`cp_forward` without the attention: the buffers its backward needs
    (the custom op's backward fetches them again)."""
    ranks = ex.peers(group)
    over = ex.overlap(overlap) and ex.fetches
    saved = Saved()
    gpend, gq, f = _start_exchanges(ex, q, k, v, group, ranks, over, not ex.overlap(overlap))
    if f is not None:
        f.wait()
        saved.kvbuf, saved.kvrem = f.buf, f.rem
    if gpend is not None:
        gpend.wait()
        saved.gq = gq
    return saved


class _Grads:
    """Gradients of one tensor (the rows, or one key tensor) summed over launches along dim 2: a
    launch that covers all of it first is taken as written; otherwise a buffer in ``dtype``
    (float32) where each range is copied where nothing was written yet and added where it was."""

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device, self.t = shape, dtype, device, None
        self.done = []  # written ranges, disjoint, sorted
        self.pending = []  # parts of some rows that came before any launch covering all of them

    def add(self, g, span):
        n = self.shape[2]
        a, b = (0, n) if span is None else span
        if self.t is None and (a, b) != (0, n):
            self.pending.append((g, (a, b)))  # kept until a launch over all rows gives the buffer
            return
        if self.t is None:
            self.t = g
            self.done = [(0, n)]
            pend, self.pending = self.pending, []
            for pg, ps in pend:
                self._add(pg, ps)
            return
        self._add(g, (a, b))

    def _add(self, g, span):
        n = self.shape[2]
        a, b = span
        if self.t is None:
            self.t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        elif self.t.dtype != self.dtype and (a, b) == (0, n):
            self.t = self.t.to(self.dtype)
        # a buffer a kernel wrote in the inputs' dtype (already rounded) stays so: the added rows
        # are summed in float32 and rounded once more, without converting the other rows
        low = self.t.dtype != self.dtype
        pos = a
        for s, e in self.done + [(n, n)]:  # walk [a, b): copy into gaps, add where written
            s, e = max(s, a), min(e, b)
            if s > pos:
                self.t[:, :, pos:min(s, b)].copy_(g[:, :, pos - a:min(s, b) - a])
            if e > s and low:
                seg = self.t[:, :, s:e]
                seg.copy_(seg.to(self.dtype) + g[:, :, s - a:e - a])
            elif e > s:
                self.t[:, :, s:e].add_(g[:, :, s - a:e - a])
            pos = max(pos, e)
            if pos >= b:
                break
        self.done = _union(self.done + [(a, b)])

    def get(self):
        pend, self.pending = self.pending, []
        for pg, ps in pend:
            self._add(pg, ps)
        if self.t is None:
            self.t = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        gaps = [(s, e) for s, e in _gaps(self.done, self.shape[2])]
        for s, e in gaps:  # ranges no launch wrote (keys no row visits)
            self.t[:, :, s:e].zero_()
        self.done = [(0, self.shape[2])]
        return self.t


def _union(ranges):
    out = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        elif e > s:
            out.append((s, e))
    return out


def _gaps(done, n):
    pos = 0
    for s, e in done:
        if s > pos:
            yield pos, s
        pos = max(pos, e)
    if pos < n:
        yield pos, n


def cp_backward(ex: Exchange, q, k, v, out, lse, dout, dlse, saved: Saved, scale: float, dropout_p: float,
                seed: int, backend: str, group, overlap=False, opts=DEFAULT_OPTIONS):
    """``(dq, dk, dv)`` of this rank's tokens, in the inputs' dtypes."""
    acc = _acc(q.dtype)
    ranks = ex.peers(group)
    over = ex.overlap(overlap) and ex.fetches
    if over:
        opts = _beside_messages(opts)
    B, H, L, D = q.shape
    Hkv, dev = k.shape[1], k.device
    guest = None
    # the split rows' dQ parts travel with the fetched keys' dK/dV (one step) in plans without
    # overlap, else while the rest runs
    defer = not ex.overlap(overlap) and ex.has_kv
    if ex.has_split:  # split rows first, as in the forward
        gpack = _start_split_packs(ex, dout, out, lse, dlse, group, ranks, acc)
        guest = _guest_backward(ex, q, k, v, lse, saved, gpack, scale, dropout_p, seed, backend, group, ranks, opts,
                                acc, defer)
    returned = sum(ex.ret_recv_n) > 0  # other ranks send gradients of own keys: own dK/dV are sums
    wire = _wire_dtype(k.dtype, acc)
    parts = ex.bwd_parts["overlap" if over else "main"]
    several = len(parts) > 1
    dq = _Grads((B, H, L, D), acc, dev)
    grads = {}  # key tensor -> (dK, dV) sums
    send = None
    for i, part in enumerate(parts):
        src = "own" if part.keys == "buf" and not ex.fetches else part.keys
        n = {"own": L, "buf": ex.buf_len, "rem": ex.rem_len}[src]
        K, V = _keys(part, k, v, None, saved)
        qdt = acc if several else None  # sums over launches or ranks: float32 parts (Gluon ones too)
        kdt = acc if (several or returned or src != "own") else None
        g = _bwd(_rows(q, part), K, V, _rows(out, part), _rows(lse, part), _rows(dout, part), part.layout, scale,
                 dropout_p, seed, backend, None if dlse is None else _rows(dlse, part), (qdt, kdt, kdt), opts)
        dq.add(g[0], part.rows)
        gk, gv = grads.setdefault(src, (_Grads((B, Hkv, n, D), acc, dev), _Grads((B, Hkv, n, D), acc, dev)))
        gk.add(g[1], part.span)
        gv.add(g[2], part.span)
        last_remote = part.keys == "rem" and (i + 1 == len(parts) or parts[i + 1].keys != "rem")
        if over and last_remote:  # the fetched keys are done: their dK/dV go back while the rest runs
            send = _start_return(ex, gk.get(), gv.get(), ex.ret_send_rem, group, ranks, acc, wire)
    if not over and ex.has_kv:
        gk, gv = grads.get("buf", grads.get("own"))
        dq_msgs = guest[0] if defer and guest is not None else None
        send = _start_return(ex, gk.get(), gv.get(), ex.ret_send_buf, group, ranks, acc, wire,
                             extra=dq_msgs[:2] if dq_msgs else ((), ()))
        if dq_msgs:  # the dQ parts arrive with the step
            guest = (Pending(dq_msgs[2], then=send.wait), *guest[1:])
    # own keys' gradients: their rows of the buffer's. Own tokens in a few runs of the buffer (zigzag)
    # stay in buffer coordinates until the end: the returned parts are added there and each run is
    # converted once into the output (no float32 gather of the whole shard)
    in_buf = "buf" in grads and guest is None and 1 < len(ex.own_runs) <= _MAX_RUN_COPIES
    if in_buf:
        dk, dv = grads["buf"][0].get(), grads["buf"][1].get()
    elif "buf" in grads:
        dk, dv = _own_of_buf(ex, grads["buf"][0].get(), grads["buf"][1].get())
    elif "own" in grads:
        dk, dv = grads["own"][0].get(), grads["own"][1].get()
    else:
        dk = dv = torch.zeros((B, Hkv, L, D), dtype=acc, device=dev)
    dq = dq.get()
    if guest is not None:
        dq, dk, dv = _finish_guest(ex, guest, dq, dk, dv, acc)
    if send is not None:
        got = send.wait()
        if returned:
            got = got if got.dtype == acc else got.to(acc)  # parts returned in 16 bits: added in float32
            dk, dv = (t if t.dtype == acc else t.to(acc) for t in (dk, dv))
            off, pos = 0, ex.ret_recv_buf if in_buf else ex.ret_recv_pos
            for c in ex.ret_recv_n:  # one peer at a time: indices distinct within a peer, sums deterministic
                if c:
                    idx = pos[off:off + c]
                    dk.index_add_(2, idx, _heads_view(got[off:off + c, 0]))
                    dv.index_add_(2, idx, _heads_view(got[off:off + c, 1]))
                off += c
    # separate, contiguous tensors (never views of one buffer): the custom op may not return aliases
    cf = torch.contiguous_format
    dq = dq if dq.dtype == q.dtype and dq.is_contiguous() else dq.to(q.dtype, memory_format=cf)
    if in_buf:
        return dq, _own_rows(ex, dk, k.dtype), _own_rows(ex, dv, v.dtype)
    return dq, dk.to(k.dtype, copy=True, memory_format=cf), dv.to(v.dtype, copy=True, memory_format=cf)


_MAX_RUN_COPIES = 4  # own runs converted one copy each; more runs: one gather (``_own_of_buf``)


def _own_rows(ex: Exchange, g, dtype):
    """``(B, H, L, D)`` in ``dtype``: the own tokens' rows of the buffer's gradient ``g``, one
    converting copy per run."""
    B, H, _, D = g.shape
    out = g.new_empty((B, H, ex.length, D), dtype=dtype)
    for b0, l0, n in ex.own_runs:
        out[:, :, l0:l0 + n].copy_(g[:, :, b0:b0 + n])
    return out


def _own_of_buf(ex: Exchange, dkb, dvb):
    """The own tokens' rows of the buffer's gradients (a view when they are one run)."""
    if len(ex.own_runs) == 1:
        b0, _, n = ex.own_runs[0]
        return dkb[:, :, b0:b0 + n], dvb[:, :, b0:b0 + n]
    idx = torch.cat([torch.arange(b0, b0 + n, device=dkb.device) for b0, _, n in ex.own_runs])
    return dkb.index_select(2, idx), dvb.index_select(2, idx)


def _wire_dtype(dtype, acc) -> torch.dtype:
    """The dtype of returned dK/dV parts for inputs of ``dtype`` (``_RETURN_DTYPE``)."""
    return dtype if _RETURN_DTYPE == "input" and dtype in (torch.float16, torch.bfloat16) else acc


def _start_return(ex: Exchange, dk, dv, pos, group, ranks, acc, wire, extra=((), ())):
    """dK/dV of fetched keys (token-major, in ``wire``: float32 or the inputs' 16-bit dtype, one
    message per owner) back to their owners; receive those of own keys other ranks fetched
    (``extra``: further ``(sends, recvs)`` of the same step). Returns the pending receive
    ``(T, 2, B, Hkv, D)`` in ``wire``."""
    B, Hkv, _, D = dk.shape
    sends = []
    if sum(ex.ret_send_n):
        st = _tokens_first(dk, dv, idx=pos, dtype=wire)
        sends = _slices(st, _TAG_DKV, ex.ret_send_n)
    recv = dk.new_empty((sum(ex.ret_recv_n), 2, B, Hkv, D), dtype=wire)
    return exchange(sends + list(extra[0]), _slices(recv, _TAG_DKV, ex.ret_recv_n) + list(extra[1]), group, ranks,
                    async_op=True, result=recv)


def _start_split_packs(ex: Exchange, dout, out, lse, dlse, group, ranks, acc):
    """Own split rows' ``(dO, O, lse, dlse)`` (float32, token-major ``(n, B, H, 2D + 2)``) to the ranks
    that computed a part; the received ones for the guest rows. Returns ``(pending, own pack)``."""
    B, H, _, D = dout.shape

    def pack(idx):
        sel = lambda t: t.index_select(2, idx).to(acc)  # noqa: E731
        dl = sel(dlse) if dlse is not None else torch.zeros(sel(lse).shape, dtype=acc, device=lse.device)
        return torch.cat([sel(dout), sel(out), sel(lse).unsqueeze(-1), dl.unsqueeze(-1)], -1).permute(2, 0, 1, 3)

    own = pack(ex.split_idx) if ex.n_split else None
    sends = _slices(pack(ex.gq_send_idx).contiguous(), _TAG_GPACK, ex.gq_send_n) if sum(ex.gq_send_n) else []
    recv = dout.new_empty((ex.guest_len, B, H, 2 * D + 2), dtype=acc)
    pend = exchange(sends, _slices(recv, _TAG_GPACK, ex.gq_recv_n), group, ranks, async_op=True, result=recv)
    return pend, own


def _guest_backward(ex: Exchange, q, k, v, lse, saved: Saved, gpack, scale, dropout_p, seed, backend, group, ranks,
                    opts, acc, defer: bool = False):
    """Backward of every split row's part over the own keys: dQ of received rows back to their
    owners (in flight; ``defer``: as ``(sends, recvs, received)`` messages for a later step), of
    own rows kept; dK/dV of the own keys (float32)."""
    pend, own = gpack
    got = pend.wait()
    allp = got if own is None else torch.cat([own, got])  # (G, B, H, 2D + 2), own rows first
    D = q.shape[3]
    hv = _heads_view(allp)
    gdo, gout = hv[..., :D].to(q.dtype), hv[..., D:2 * D].to(q.dtype)
    glse, gdlse = hv[..., 2 * D].to(lse.dtype).contiguous(), hv[..., 2 * D + 1].contiguous()
    gdq, gdk, gdv = _bwd(_heads_view(saved.gq), k, v, gout, glse, gdo, ex.guest, scale, dropout_p, seed, backend,
                         gdlse, acc, opts)
    n = ex.n_split
    back = gdq[:, :, n:].permute(2, 0, 1, 3).contiguous()
    recv = back.new_empty((sum(ex.gq_send_n), *back.shape[1:]))
    msgs = (_slices(back, _TAG_GDQ, ex.gq_recv_n), _slices(recv, _TAG_GDQ, ex.gq_send_n), recv)
    dq_pend = msgs if defer else exchange(*msgs[:2], group, ranks, async_op=True, result=recv)
    return dq_pend, gdq[:, :, :n], gdk, gdv


def _finish_guest(ex: Exchange, guest, dq, dk, dv, acc):
    """Add the split rows' gradients: own rows' dQ (own part and the parts other ranks return, summed
    in float32; the other launches left these rows empty) and the own keys' dK/dV of every split row."""
    dq_pend, own_dq, gdk, gdv = guest
    dk, dv = (t if t.dtype == acc else t.to(acc) for t in (dk, dv))
    dk.add_(gdk)
    dv.add_(gdv)
    got = dq_pend.wait()  # (sum, B, H, D), peer-major
    if ex.n_split:
        rows = own_dq.permute(2, 0, 1, 3).to(acc).clone()  # (n, B, H, D)
        off = 0
        for p, c in enumerate(ex.gq_send_n):  # one peer at a time (deterministic)
            if c:
                rows.index_add_(0, ex.split_slot[off:off + c] - (p + 1) * ex.n_split, got[off:off + c])
            off += c
        dq.index_copy_(2, ex.split_idx, rows.permute(1, 2, 0, 3).to(dq.dtype))
    return dq, dk, dv
