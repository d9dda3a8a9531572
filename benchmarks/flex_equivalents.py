"""The mask algebra's newer primitives beside FlexAttention ``mask_mod`` equivalents.

Each case gives our mask and a Flex-style ``mask_mod(b, h, q_idx, kv_idx)`` written independently
from the semantics table (``q_idx`` is the query row; every case has ``Lq == Lk``, where rows and
positions coincide). ``tests/test_primitives_ext.py`` checks on the CPU that both keep the same
pairs; ``benchmarks/new_primitives_gpu.py`` validates ours against float64 and times both on a GPU.
"""

from __future__ import annotations

import torch

import blocksparse_fa as bsfa


def _doc_ids(n: int, seed: int = 0, lo: int = 256, hi: int = 2048) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < n:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[:n]


def _clamp(x, lo, hi):
    return torch.minimum(torch.maximum(x, torch.as_tensor(lo, device=x.device)), torch.as_tensor(hi, device=x.device))


def cases(n: int, B: int = 2, H: int = 4, device="cpu"):
    """``[(name, our mask, flex mask_mod, (B, H) the case needs)]`` for sequence length ``n``."""
    g = torch.Generator().manual_seed(0)
    out = []

    a, b = n // 8, n // 8 + n // 16
    out.append(("key_range | causal", bsfa.key_range(a, b) | bsfa.causal(),
                lambda b_, h, q, kv: ((kv >= a) & (kv < b)) | (q >= kv), (1, 1)))

    r0, r1, c0, c1 = n // 3, n // 2, n // 16, n // 8
    out.append(("rectangle | sliding", bsfa.query_range(r0, r1) & bsfa.key_range(c0, c1) | bsfa.sliding_window(256),
                lambda b_, h, q, kv: ((q >= r0) & (q < r1) & (kv >= c0) & (kv < c1)) | ((q >= kv) & (q - kv < 256)),
                (1, 1)))

    pos = torch.randint(0, n, (16,), generator=g)
    flags = torch.zeros(n, dtype=torch.bool)
    flags[pos] = True
    flags_d = flags.to(device)
    out.append(("globals anywhere + sliding", bsfa.key_set(pos) | bsfa.query_set(pos) | bsfa.sliding_window(512),
                lambda b_, h, q, kv: flags_d[kv] | flags_d[q] | ((q >= kv) & (q - kv < 512)), (1, 1)))

    lens = torch.randint(n // 2, n + 1, (B,), generator=g)
    lens_d = lens.to(device)
    out.append(("padded batch", bsfa.load_pattern("padded_batch", length=bsfa.per_batch(lens)),
                lambda b_, h, q, kv: (q >= kv) & (kv < lens_d[b_]) & (q < lens_d[b_]), (B, 1)))

    wins = torch.randint(64, max(65, n // 4), (H,), generator=g)
    wins_d = wins.to(device)
    out.append(("sliding window per head", bsfa.causal() & bsfa.sliding_window(bsfa.per_head(wins)),
                lambda b_, h, q, kv: (q >= kv) & (q - kv < wins_d[h]), (1, H)))

    side = int(n ** 0.5)
    hh, ww, k = side, n // side, 7
    r = k // 2

    def natten2d(b_, h, q, kv):
        qy, qx, ky, kx = q // ww, q % ww, kv // ww, kv % ww
        sy = _clamp(qy - r, 0, hh - k)
        sx = _clamp(qx - r, 0, ww - k)
        inside = (q < hh * ww) & (kv < hh * ww)
        return inside & (ky >= sy) & (ky < sy + k) & (kx >= sx) & (kx < sx + k)

    out.append(("natten 2-D", bsfa.neighborhood((hh, ww), k), natten2d, (1, 1)))

    # STA, written as in the paper's FlexAttention formulation: the window is centred on the
    # query's tile, with the centre clamped so that the window stays inside the tile grid
    tt, th, tw = 2, 8, 8
    T = max(2, n // (64 * 64)) // tt * tt
    Hs, Ws = 64, 64
    nt, nh, nw = T // tt, Hs // th, Ws // tw
    kt, kh, kw = min(3, nt - (1 - nt % 2)), 3, 3
    kt = kt if kt % 2 else kt - 1
    tv = tt * th * tw

    def tile_coords(x):
        t = x // tv
        return t // (nh * nw), (t // nw) % nh, t % nw

    def sta(b_, h, q, kv):
        qt, qh, qw = tile_coords(q)
        ktt, khh, kww = tile_coords(kv)
        ct = _clamp(qt, kt // 2, nt - 1 - kt // 2)
        ch = _clamp(qh, kh // 2, nh - 1 - kh // 2)
        cw = _clamp(qw, kw // 2, nw - 1 - kw // 2)
        inside = (q < T * Hs * Ws) & (kv < T * Hs * Ws)
        return inside & ((ct - ktt).abs() <= kt // 2) & ((ch - khh).abs() <= kh // 2) & ((cw - kww).abs() <= kw // 2)

    out.append(("sliding tiles 3-D", bsfa.sliding_tiles((T, Hs, Ws), (tt, th, tw), (kt, kh, kw)), sta, (1, 1)))

    period, w = 1024, 16
    out.append(("periodic window", bsfa.periodic_window(period, w) & bsfa.causal(),
                lambda b_, h, q, kv: ((q % period) - (kv % period)).abs().le(w) & (q >= kv), (1, 1)))

    half, blk = n // 2, 64

    def block_diffusion(b_, h, q, kv):
        xq, xk = q >= half, kv >= half
        bq = torch.where(xq, (q - half) // blk, q // blk)
        bk = torch.where(xk, (kv - half) // blk, kv // blk)
        diag = (bq == bk) & (xq == xk)
        offset = (bq > bk) & xk & ~xq
        causal_blocks = (bq >= bk) & xk & xq
        return diag | offset | causal_blocks

    out.append(("block diffusion", bsfa.load_pattern("block_diffusion", n=half, block=blk), block_diffusion, (1, 1)))

    ids = _doc_ids(n)
    ids_d = ids.to(device)
    prefix = 1024
    out.append(("shared prefix", bsfa.load_pattern("shared_prefix", prefix=prefix, document=ids),
                lambda b_, h, q, kv: (q >= kv) & ((kv < prefix) | (ids_d[q] == ids_d[kv])), (1, 1)))

    perm = torch.randperm(int(ids.max()) + 1, generator=g)
    shuffled = perm[ids]
    sh_d = shuffled.to(device)
    out.append(("documents, unsorted ids", bsfa.causal() & bsfa.document(shuffled),
                lambda b_, h, q, kv: (q >= kv) & (sh_d[q] == sh_d[kv]), (1, 1)))
    return out
