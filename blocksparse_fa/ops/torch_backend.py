"""Exact block-sparse attention in plain PyTorch (the CPU backend).

It walks the layout like the kernels do: per layout row block it gathers only the non-empty key
blocks, evaluates the mask only on partial ones, and keeps the softmax statistics (logsumexp) so
the backward recomputes probabilities block by block. Peak extra memory is one row block's scores
(``bm × visited keys`` per head), never ``O(Lq · Lk)``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..compiler.layout import BlockLayout
from ..mask.expr import EvalContext
from ..mask.score import call_fn
from .dropout import keep_from_counters
from .validate import Shapes

__all__ = ["torch_forward", "torch_backward"]


def _expand_cols(blocks: np.ndarray, bn: int, limit: int) -> np.ndarray:
    cols = (blocks[:, None] * bn + np.arange(bn)[None, :]).reshape(-1)
    return cols[cols < limit]


def _walk(layout: BlockLayout, s: Shapes):
    """Yield ``(bsel, hsel, b_idx, h_idx, rows, keys_full, keys_partial, keep_partial, grow)`` per row
    block; ``grow`` are the block's global row indices (the local ones unless the layout is a shard,
    whose ``positions`` map local blocks to global indices for the mask and dropout)."""
    bm, bn = layout.block_size
    pos = getattr(layout, "positions", None)
    q_len, kv_len = (s.Lq, s.Lk) if pos is None else (pos.q_len, pos.kv_len)
    tr = -(-s.Lq // bm)
    lut = layout.row_lut
    fptr, fidx = lut.full_ptr.cpu().numpy(), lut.full_idx.cpu().numpy()
    pptr, pidx = lut.part_ptr.cpu().numpy(), lut.part_idx.cpu().numpy()
    bmask, hmask = layout.batch_shape or (1, 1)
    off = layout.q_offset
    for z in range(bmask * hmask):
        zb, zh = divmod(z, hmask)
        bsel = slice(zb, zb + 1) if bmask > 1 else slice(None)
        hsel = slice(zh, zh + 1) if hmask > 1 else slice(None)
        b_idx = np.arange(s.B)[bsel]
        h_idx = np.arange(s.H)[hsel]
        for r in range(tr):
            row = z * tr + r
            kf = _expand_cols(fidx[fptr[row]:fptr[row + 1]], bn, s.Lk)
            kp = _expand_cols(pidx[pptr[row]:pptr[row + 1]], bn, s.Lk)
            i0, i1 = r * bm, min((r + 1) * bm, s.Lq)
            grow = np.arange(i0, i1) if pos is None else pos.rows(np.arange(i0, i1), bm)
            keep = None
            if len(kp):
                i = torch.from_numpy(grow).view(-1, 1)
                j = torch.from_numpy(kp if pos is None else pos.keys(kp, bn)).view(1, -1)
                ctx = EvalContext(q_len, kv_len, i, i + off, j, torch.tensor(zb), torch.tensor(zh))
                keep = layout.mask._eval(ctx).expand(i1 - i0, len(kp))
            yield bsel, hsel, b_idx, h_idx, (i0, i1), kf, kp, keep, grow


class _Step:
    """Scores and probabilities of one row block (shared by forward and backward)."""

    def __init__(self, q, k, v, walk_item, s: Shapes, scale, dropout_p, seed, pos=None, bn=1, smod=None, off=0):
        bsel, hsel, b_idx, h_idx, (i0, i1), kf, kp, keep, grow = walk_item
        self.bsel, self.hsel, self.rows = bsel, hsel, slice(i0, i1)
        self.kidx = torch.from_numpy(np.concatenate([kf, kp])).to(q.device)
        self.n = len(self.kidx)
        if self.n == 0:
            return
        self.qs = q[bsel, hsel, i0:i1]
        self.ks = k[bsel, hsel].index_select(2, self.kidx)
        self.vs = v[bsel, hsel].index_select(2, self.kidx)
        sc = torch.matmul(self.qs, self.ks.transpose(-1, -2)) * scale
        self.t = self.raw = None
        if smod is not None:  # score modifier at the positions the mask sees (global ones for a shard)
            kj = self.kidx.cpu().numpy()
            kpos = torch.from_numpy(kj if pos is None else pos.keys(kj, bn)).to(q.device)
            if smod.fn is not None:  # a callable: Flex's indices (query row, not aligned position)
                dev = q.device
                self.fn_args = (torch.from_numpy(b_idx).to(dev).view(-1, 1, 1, 1),
                                torch.from_numpy(h_idx).to(dev).view(1, -1, 1, 1),
                                torch.from_numpy(grow).to(dev).view(-1, 1), kpos.view(1, -1))
                self.raw = sc
                sc = call_fn(smod.fn, sc, *self.fn_args)
            else:
                qpos = torch.from_numpy(grow + off).to(q.device)
                self.rel = (kpos.view(1, -1) - qpos.view(-1, 1)).to(sc.dtype)  # ALiBi's factor, for its gradient
                slopes = smod.slopes_tensor(s.H, q.device, sc.dtype).detach()[torch.from_numpy(h_idx).to(q.device)]
                bias = None
                if smod.bias is not None:  # indexed by this call's row and key indices (size-1 dims broadcast)
                    self.bias_at = _bias_at(smod.bias, bsel, hsel, self.rows)
                    bias = smod.bias.detach()[self.bias_at]
                    if bias.shape[3] > 1:
                        bias = bias.index_select(3, self.kidx)
                sc, self.t = smod.apply(sc, qpos.view(-1, 1), kpos.view(1, -1), slopes.view(1, -1, 1, 1), bias)
        if keep is not None:
            sc[..., len(kf):] = sc[..., len(kf):].masked_fill(~keep.to(q.device), float("-inf"))
            if self.t is not None:  # masked elements: no soft-cap derivative (a NaN bias there must not leak)
                self.t[..., len(kf):] = self.t[..., len(kf):].masked_fill(~keep.to(q.device), 0.0)
        self.s = sc
        self.drop = None
        if dropout_p > 0.0:
            bh = (b_idx[:, None] * s.H + h_idx[None, :])[:, :, None, None]
            kj = self.kidx.cpu().numpy()
            kj = kj if pos is None else pos.keys(kj, bn)
            kd = keep_from_counters(grow[None, None, :, None], kj[None, None, None, :], bh, dropout_p, seed)
            self.drop = torch.from_numpy(kd).to(q.device).to(q.dtype) / (1.0 - dropout_p)


def _bias_at(bias: torch.Tensor, bsel, hsel, rows: slice) -> tuple:
    """Index of a row block's bias values in the 4-D bias (size-1 dims broadcast: taken whole)."""
    return (bsel if bias.shape[0] > 1 else slice(None), hsel if bias.shape[1] > 1 else slice(None),
            rows if bias.shape[2] > 1 else slice(None))


def _slopes_ds(p, dp, t, dlse_rows):
    """``dS`` of a row block with each row's delta taken exactly from its probabilities,
    ``Σ_j P·dP - dlse``, for the slopes' gradient ``Σ dS·(j - qp)``: the distances reach the row
    length, so ``delta = rowsum(dO ∘ O)`` from a rounded (bfloat16) output would move it by the
    rounding error times the row's mean distance. The row block holds every key of its rows (a
    layout with a score modifier is never rewritten; a shard, whose rows may be split, keeps
    ``delta``)."""
    delta = (p * dp).sum(-1, keepdim=True)
    if dlse_rows is not None:
        delta = delta - dlse_rows.unsqueeze(-1)
    ds = p * (dp - delta)
    return ds if t is None else ds * (1 - t * t)


def _add_score_grads(st: _Step, ds: torch.Tensor, ds_slopes, h_idx, dslopes, dbias) -> None:
    """Accumulate a row block's ``ds`` into the bias' gradient buffer and ``ds_slopes`` (``ds`` with
    the rows' exact delta) times the distances into the slopes'."""
    if dslopes is not None:
        dslopes.index_add_(0, torch.from_numpy(h_idx).to(ds.device),
                           (ds_slopes * st.rel).sum((0, 2, 3)).to(dslopes.dtype))
    if dbias is not None:
        g = ds
        for dim in range(4):  # sum over the dims the bias broadcasts
            if dbias.shape[dim] == 1 and g.shape[dim] > 1:
                g = g.sum(dim, keepdim=True)
        tgt = dbias[st.bias_at]
        if dbias.shape[3] > 1:
            tgt.index_add_(3, st.kidx, g.to(dbias.dtype))
        else:
            tgt += g.to(dbias.dtype)


def _pos(layout, smod=None):
    return getattr(layout, "positions", None), layout.block_size[1], smod, layout.q_offset


def _inf_to_zero(m):
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def _forward(q, k, v, layout, s: Shapes, scale, dropout_p, seed, smod=None):
    out = torch.zeros_like(q)
    lse = torch.full((s.B, s.H, s.Lq), float("-inf"), dtype=q.dtype, device=q.device)
    for item in _walk(layout, s):
        st = _Step(q, k, v, item, s, scale, dropout_p, seed, *_pos(layout, smod))
        if st.n == 0:
            continue
        m = _inf_to_zero(st.s.amax(-1, keepdim=True))
        p = torch.exp(st.s - m)
        l = p.sum(-1, keepdim=True)
        if st.drop is not None:
            p = p * st.drop
        o = torch.matmul(p, st.vs) / torch.where(l == 0, torch.ones_like(l), l)
        o = torch.where(l == 0, torch.zeros_like(o), o)  # empty rows: 0 whatever V holds (0 * NaN)
        out[st.bsel, st.hsel, st.rows] = o
        lse[st.bsel, st.hsel, st.rows] = (m + torch.log(l)).squeeze(-1)
    return out, lse


def _backward(q, k, v, out, lse, dout, layout, s: Shapes, scale, dropout_p, seed, dlse=None, smod=None,
              score_grads=(None, None)):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (dout * out).sum(-1)
    dl = None
    if dlse is not None:  # d lse / d s = p, so the lse gradient enters as delta - dlse
        dl = torch.where(torch.isinf(lse), torch.zeros_like(lse), dlse.to(delta.dtype))
        delta = delta - dl
    lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    for item in _walk(layout, s):
        st = _Step(q, k, v, item, s, scale, dropout_p, seed, *_pos(layout, smod))
        if st.n == 0:
            continue
        p = torch.exp(st.s - lse_safe[st.bsel, st.hsel, st.rows].unsqueeze(-1))
        do = dout[st.bsel, st.hsel, st.rows]
        dp = torch.matmul(do, st.vs.transpose(-1, -2))
        pd = p
        if st.drop is not None:
            pd = p * st.drop
            dp = dp * st.drop
        ds = p * (dp - delta[st.bsel, st.hsel, st.rows].unsqueeze(-1))
        if st.t is not None:  # soft-cap: d(cap·tanh(x/cap))/dx = 1 - tanh²
            ds = ds * (1 - st.t * st.t)
        if st.raw is not None:  # a callable: its derivative through autograd
            with torch.enable_grad():
                raw = st.raw.detach().requires_grad_()
                ds = torch.autograd.grad(call_fn(smod.fn, raw, *st.fn_args), raw, ds)[0]
        # rows with nothing to attend: exactly zero, whatever q, k or v hold (0 * NaN would leak through)
        empty = torch.isinf(lse_safe[st.bsel, st.hsel, st.rows]).unsqueeze(-1)
        ds = torch.where(empty, torch.zeros_like(ds), ds)
        if score_grads[0] is not None or score_grads[1] is not None:
            ds_slopes = None
            if score_grads[0] is not None and getattr(layout, "positions", None) is None:  # see _slopes_ds
                ds_slopes = torch.where(empty, 0.0, _slopes_ds(p, dp, st.t, None if dl is None else
                                                               dl[st.bsel, st.hsel, st.rows]))
            _add_score_grads(st, ds, ds if ds_slopes is None else ds_slopes, item[3], *score_grads)
        dq[st.bsel, st.hsel, st.rows] += torch.where(empty, 0.0, torch.matmul(ds, st.ks) * scale)
        qs = torch.where(empty, 0.0, st.qs)
        dk[st.bsel, st.hsel].index_add_(2, st.kidx, torch.matmul(ds.transpose(-1, -2), qs) * scale)
        dv[st.bsel, st.hsel].index_add_(2, st.kidx, torch.matmul(pd.transpose(-1, -2), do))
    return dq, dk, dv


def _compute(q, k, v, s: Shapes):
    """q, k, v in the compute dtype (float32, float64 for float64), k/v expanded over GQA groups."""
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    exp = (lambda t: t.to(cdt).repeat_interleave(s.G, dim=1)) if s.G > 1 else (lambda t: t.to(cdt))
    return q.to(cdt), exp(k), exp(v)


def torch_forward(q, k, v, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int,
                  score_mod=None):
    """``(out, lse)``: out in the compute dtype, lse float32 (float64 for float64 inputs).
    ``score_mod``: a :class:`~blocksparse_fa.mask.score.ScoreMod` or None."""
    return _forward(*_compute(q, k, v, s), layout, s, scale, dropout_p, seed, score_mod)


def torch_backward(q, k, v, out, lse, dout, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float,
                   seed: int, dlse=None, score_mod=None, score_grads=(None, None)):
    """``(dq, dk, dv)`` (k/v gradients summed over GQA groups), in the compute dtype.
    ``score_grads``: ``(dslopes (H,), dbias)`` buffers (shaped like the bound slopes and bias) to add
    the gradients of the score modifier's tensors to, or None each."""
    qc, kc, vc = _compute(q, k, v, s)
    cdt = qc.dtype
    dq, dk, dv = _backward(qc, kc, vc, out.to(cdt), lse.to(cdt), dout.to(cdt), layout, s, scale, dropout_p, seed, dlse,
                           score_mod, score_grads)
    if s.G > 1:
        dk = dk.view(s.B, s.Hkv, s.G, s.Lk, s.D).sum(2)
        dv = dv.view(s.B, s.Hkv, s.G, s.Lk, s.D).sum(2)
    return dq, dk, dv
