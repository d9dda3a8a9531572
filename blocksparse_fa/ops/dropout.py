"""Attention dropout RNG: counter-based Philox4x32-10 keyed on absolute positions.

The keep decision for element ``(b, h, i, j)`` depends only on those indices and the seed:
counter ``(i, j, b * H + h, 0)``, key ``(seed mod 2**31, (seed div 2**31) mod 2**31)`` (62 seed bits,
so both key words travel as non-negative int32 kernel arguments), first output word ``r``;
the element is kept when ``r >> 1 >= floor(p * 2**31)``. So the dropped set does not depend on tile
sizes, block sizes, which blocks are skipped or the backend: the Triton kernels compute the same
function in-kernel, and :func:`dropout_keep_mask` materialises it for tests.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["dropout_keep_mask", "philox4x32", "dropout_threshold", "keep_from_counters"]

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_U32 = np.uint64(0xFFFFFFFF)


def philox4x32(c0, c1, c2, c3, k0: int, k1: int, rounds: int = 10):
    """Philox4x32 on uint32 counters held in uint64 arrays; returns the four output words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _U32 for c in (c0, c1, c2, c3))
    k0, k1 = np.uint64(k0 & 0xFFFFFFFF), np.uint64(k1 & 0xFFFFFFFF)
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    for _ in range(rounds):
        p0 = m0 * c0
        p1 = m1 * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _U32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _U32)
        k0 = (k0 + np.uint64(PHILOX_W0)) & _U32
        k1 = (k1 + np.uint64(PHILOX_W1)) & _U32
    return c0, c1, c2, c3


def seed_words(seed: int) -> tuple[int, int]:
    """The two 31-bit Philox key words of a seed in ``[0, 2**62)``."""
    return seed & 0x7FFFFFFF, (seed >> 31) & 0x7FFFFFFF


def dropout_threshold(p: float) -> int:
    """31-bit integer threshold: keep when ``r >> 1 >= threshold``."""
    return min(int(p * 2**31), 2**31 - 1)


def keep_from_counters(i, j, bh, p: float, seed: int) -> np.ndarray:
    """Keep decisions (bool) for broadcastable counter arrays ``i``, ``j``, ``bh = b * H + h``."""
    i, j, bh = np.broadcast_arrays(np.asarray(i), np.asarray(j), np.asarray(bh))
    k0, k1 = seed_words(seed)
    r0, _, _, _ = philox4x32(i, j, bh, np.zeros_like(i), k0, k1)
    return (r0 >> np.uint64(1)) >= np.uint64(dropout_threshold(p))


def dropout_keep_mask(B: int, H: int, q_len: int, kv_len: int, p: float, seed: int, device=None, *,
                      rows=None, keys=None) -> torch.Tensor:
    """Materialise the keep-mask ``bool (B, H, q_len, kv_len)`` used by ``attention(dropout_p=p,
    dropout_seed=seed)`` (for tests at small shapes).

    ``rows``/``keys``: the global query rows and keys of the local ones (``(q_len,)``/``(kv_len,)``
    ints), for a shard of a longer sequence (context parallelism): its elements are dropped exactly
    as the same elements of the unsharded run. Default: the local indices."""
    i = np.arange(q_len, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64).reshape(q_len)
    j = np.arange(kv_len, dtype=np.int64) if keys is None else np.asarray(keys, dtype=np.int64).reshape(kv_len)
    i, j = i.reshape(1, q_len, 1), j.reshape(1, 1, kv_len)
    bh = np.arange(B * H, dtype=np.int64).reshape(B * H, 1, 1)
    keep = keep_from_counters(i, j, bh, p, seed).reshape(B, H, q_len, kv_len)
    return torch.from_numpy(keep).to(device or "cpu")
