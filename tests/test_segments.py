"""The Gluon forward's segment tiles (``compiler/device_intervals.gluon_segment_tables``,
``kernels/forward_gluon.py`` ``SEGMENTS``): row tiles that start where a document starts. The
kernel needs a Hopper GPU (``tests/test_cuda.py`` runs it); here its tables are checked and its
steps replayed in float64 on the CPU against the exact interval forward."""

from __future__ import annotations

import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.compiler.device_intervals import gluon_segment_tables, interval_spec
from blocksparse_fa.ops import interval_backend
from blocksparse_fa.ops.options import GluonConfig
from blocksparse_fa.ops.validate import Shapes


def _ids(lengths) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


MASKS = {
    "causal_docs": lambda n: bsfa.causal() & bsfa.document(_ids([n // 4, 1, 1, n // 6, 33, n - n // 4 - n // 6 - 35])),
    "docs": lambda n: bsfa.document(_ids([20, n - 60, 40])),
    "window_docs": lambda n: bsfa.sliding_window(24) & bsfa.document(_ids([90, 3, n - 93])),
    "window": lambda n: bsfa.sliding_window(40) & bsfa.document(_ids([n])),
    "empty_rows": lambda n: bsfa.causal() & bsfa.document(_ids([50, n - 50])) & bsfa.query_range(30, n - 20),
    "one_token_docs": lambda n: bsfa.causal() & bsfa.document(torch.arange(n)),
}


def _records(tiles: torch.Tensor) -> torch.Tensor:
    n = int(tiles[0])
    return tiles[8:].view(-1, 8)[:n].long()


def _replay(q, k, v, lo, hi, recs, rows, bn, scale):
    """The kernel's work items in float64: every step's keys, masked steps against the rows'
    intervals, full steps kept whole for every row; rows written below ``row_end`` only, over NaN.
    Keys past ``Lk`` read finite garbage (another head's rows or TMA's zeros on the GPU)."""
    B, H, lq, d = q.shape
    lk = k.shape[2]
    far = 64 * bn
    g = torch.Generator().manual_seed(9)
    kp = torch.cat([k, torch.randn(B, H, far, d, generator=g, dtype=k.dtype) * 1e3], 2)
    vp = torch.cat([v, torch.randn(B, H, far, d, generator=g, dtype=v.dtype) * 1e3], 2)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, lq), float("nan"), dtype=q.dtype)
    writes = torch.zeros(B, H, lq, dtype=torch.long)
    for pid_bh, row0, key0, e1, e2, nb, row_end, _ in recs.tolist():
        b, h = divmod(pid_bh, H)
        z = 0 if lo.shape[0] == 1 else b
        r = torch.arange(row0, row0 + rows)
        rl = r.clamp(max=lq - 1)
        qr = torch.where((r < lq)[:, None], q[b, h, rl], 0.0)
        keys = key0 + torch.arange(nb * bn)
        assert keys.min() >= 0 and keys.max() < lk + far
        sc = qr @ kp[b, h, keys].T * scale
        step = torch.arange(nb * bn) // bn
        full = (step >= e1) & (step < e2)
        keep = full[None, :] | ((keys[None, :] >= lo[z, r][:, None]) & (keys[None, :] < hi[z, r][:, None]))
        sc = sc.masked_fill(~keep, float("-inf"))
        m = sc.amax(1, keepdim=True)
        m = torch.where(torch.isinf(m), 0.0, m)
        p = torch.exp(sc - m)
        l = p.sum(1, keepdim=True)
        o = torch.where(l == 0, 0.0, p @ vp[b, h, keys] / torch.where(l == 0, 1.0, l))
        ls = torch.where(l[:, 0] == 0, float("-inf"), m[:, 0] + torch.log(torch.where(l[:, 0] == 0, 1.0, l[:, 0])))
        w = r < row_end
        out[b, h, r[w]] = o[w]
        lse[b, h, r[w]] = ls[w]
        writes[b, h, r[w]] += 1
    return out, lse, writes


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("n,rows,bn", [(256, 32, 16), (200, 32, 32), (130, 16, 8)])
def test_segment_tables_replay_the_exact_forward(name, n, rows, bn):
    iv = interval_spec(MASKS[name](n), n, n).bounds("cpu")
    assert iv.qid is None
    B, H, d = 2, 2, 8
    lo, hi = iv.lo.view(-1, n), iv.hi.view(-1, n)
    zs = torch.zeros(B * H, dtype=torch.long)
    lo_p, hi_p, tiles, n_prog = gluon_segment_tables(lo, hi, rows, bn, zs)
    recs = _records(tiles)
    p0 = -(-n // rows)
    assert lo_p.shape == (1, n_prog * rows) and n_prog * rows >= n + rows
    assert bool((lo_p[:, n:] == 0).all() and (hi_p[:, n:] == 0).all())
    assert len(recs) <= 2 * p0 * B * H and len(tiles) == 8 + 8 * 2 * p0 * B * H
    w = recs[:, 5] * (1 << 24) + recs[:, 5] - (recs[:, 4] - recs[:, 3])
    assert bool((w[:-1] >= w[1:]).all()), "heaviest first"
    assert bool(((recs[:, 6] - recs[:, 1] >= 1) & (recs[:, 6] - recs[:, 1] <= rows)).all())
    assert bool(((1 <= recs[:, 3]) & (recs[:, 3] <= recs[:, 4]) & (recs[:, 4] <= recs[:, 5])).all())
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    out, lse, writes = _replay(q, k, v, lo_p, hi_p, recs, rows, bn, 0.3)
    assert bool((writes == 1).all()), "every row written once"
    want, want_lse = interval_backend.torch_interval_forward(q, k, v, iv, Shapes(B, H, H, n, n, d), 0.3)
    assert torch.allclose(out, want, atol=1e-12, rtol=1e-10)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    assert torch.allclose(lse[fin], want_lse[fin].double(), atol=1e-12)


def test_documents_start_their_own_tiles():
    """A document start inside a tile window begins a tile there; the tiles of one document visit
    its keys only, from its first key; fewer masked steps than the aligned tiles."""
    n, rows, bn = 256, 32, 32
    iv = interval_spec(bsfa.causal() & bsfa.document(_ids([100, 156])), n, n).bounds("cpu")
    lo, hi = iv.lo.view(1, n), iv.hi.view(1, n)
    recs = _records(gluon_segment_tables(lo, hi, rows, bn, torch.zeros(1, dtype=torch.long))[2])
    starts = sorted(recs[:, 1].tolist())
    assert starts == [0, 32, 64, 96, 100, 132, 164, 196, 228]
    by_row = {int(r[1]): r.tolist() for r in recs}
    assert by_row[96][6] == 100 and by_row[100][2] == 100  # the first document's tail; the second's first key
    assert by_row[196][3:6] == [1, 3, 4]  # from key 100: step 0 masked (always), two full, the diagonal
    masked = int((recs[:, 5] - (recs[:, 4] - recs[:, 3])).sum())
    from blocksparse_fa.compiler.device_intervals import gluon_interval_tables

    aligned = gluon_interval_tables(lo, hi, rows // 2, bn)[2].view(-1, 5).long()
    assert masked < int((aligned[:, 4] - (aligned[:, 3] - aligned[:, 2])).sum())


def test_bad_segments_option():
    with pytest.raises(ValueError, match="segments"):
        GluonConfig(segments=1)
