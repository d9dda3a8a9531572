"""The FlashAttention IO simulator (blocksparse_fa.analysis.iosim) against the paper's counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blocksparse_fa.analysis.iosim import (
    block_sizes, block_sparse_flash_attention, flash_attention, flash_attention2, linear_fit, random_block_mask,
    standard_attention, standard_attention_backward, theorem2_leading_term,
)


def brute_force_fa1(N, d, M, mask=None):
    """Literal double loop of Algorithm 1 / 5 (pure Python), for small sizes."""
    bc = -(-M // (4 * d))
    br = min(bc, d)
    tr, tc = -(-N // br), -(-N // bc)
    total = 0
    for j in range(tc):
        kb = min(bc, N - j * bc)
        total += 2 * kb * d                      # K_j, V_j
        for i in range(tr):
            if mask is not None and not mask[i, j]:
                continue
            qb = min(br, N - i * br)
            total += 2 * qb * d + 2 * qb          # read Q_i, O_i, l_i, m_i
            total += qb * d + 2 * qb              # write O_i, l_i, m_i
    return total


@pytest.mark.parametrize("N,kv,d", [(1024, 1024, 64), (1000, 1000, 32), (512, 2048, 128)])
def test_standard_attention_counts(N, kv, d):
    c = standard_attention(N, d, kv)
    assert c.total == 2 * N * d + 2 * kv * d + 4 * N * kv
    if N == kv:
        assert c.total == 4 * N * d + 4 * N * N     # Algorithm 0: 4Nd + 4N²
    b = standard_attention_backward(N, d, kv)
    if N == kv:
        assert b.total == 8 * N * d + 7 * N * N


@pytest.mark.parametrize("N,d,M", [(1024, 64, 1 << 14), (1000, 64, 12345), (777, 32, 4096), (2048, 16, 1 << 15)])
def test_flash_attention_exact_closed_form(N, d, M):
    c = flash_attention(N, d, M)
    br, bc = block_sizes(d, M)
    assert (c.br, c.bc) == (br, bc)
    assert bc == -(-M // (4 * d)) and br == min(bc, d)
    tc = -(-N // bc)
    assert c.total == 2 * N * d + tc * (3 * N * d + 4 * N)
    assert c.reads["K"] == c.reads["V"] == N * d
    assert c.total == brute_force_fa1(N, d, M)


def test_block_sparse_matches_brute_force():
    N, d, M = 600, 32, 4096
    br, bc = block_sizes(d, M)
    mask = random_block_mask(-(-N // br), -(-N // bc), 0.3, seed=3)
    c = block_sparse_flash_attention(N, d, M, mask=torch.from_numpy(mask))
    assert c.total == brute_force_fa1(N, d, M, mask)
    assert c.inner_iterations == mask.sum()
    with pytest.raises(ValueError, match="expected"):
        block_sparse_flash_attention(N, d, M, mask=np.ones((3, 3), dtype=bool))
    with pytest.raises(ValueError, match="boolean"):
        block_sparse_flash_attention(N, d, M, mask=mask.astype(np.int8))


@pytest.mark.parametrize("N,d,M", [(4096, 64, 1 << 14), (8192, 64, 1 << 15), (8192, 128, 1 << 16),
                                   (16384, 128, 1 << 17), (16384, 64, 100_000)])
def test_theorem2_leading_term(N, d, M):
    c = flash_attention(N, d, M)
    lead = theorem2_leading_term(N, d, M)
    assert 1.0 <= c.total / lead < 1.08           # 12N²d²/M (1 + 4/3d) + 2Nd + ceil effects
    # Θ(N²d²/M): doubling M halves the quadratic part, doubling N quadruples it
    half = flash_attention(N, d, 2 * M)
    assert (c.total - 2 * N * d) / (half.total - 2 * N * d) == pytest.approx(2.0, rel=0.05)
    big = flash_attention(2 * N, d, M)
    assert (big.total - 4 * N * d) / (c.total - 2 * N * d) == pytest.approx(4.0, rel=0.02)


def test_fa2_order_leading_term_and_single_pass_reads():
    N, d, M = 8192, 64, 1 << 15
    c = flash_attention2(N, d, M)
    assert c.total / (8.0 * N * N * d * d / M) == pytest.approx(1.0, abs=0.05)
    assert c.reads["Q"] == N * d and c.writes["O"] == N * d and c.writes["L"] == N
    assert c.total < flash_attention(N, d, M).total


def test_fit_against_inverse_m():
    N, d = 8192, 64
    Ms = [1 << k for k in range(12, 20)]
    y = [flash_attention(N, d, M).total for M in Ms]
    slope, icpt, r2 = linear_fit([N * N * d * d / M for M in Ms], y)
    assert r2 > 0.999
    assert slope == pytest.approx(12 * (1 + 4 / (3 * d)), rel=0.01)
    assert icpt == pytest.approx(2 * N * d, rel=0.05)


def test_proposition4_linear_in_s():
    N, d, M = 8192, 64, 1 << 15
    s = np.array([0.01, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0])
    for order in ("fa1", "fa2"):
        y = [block_sparse_flash_attention(N, d, M, density=x, order=order, seed=1).total for x in s]
        slope, icpt, r2 = linear_fit(s, y)
        assert r2 > 0.99
        dense = (flash_attention if order == "fa1" else flash_attention2)(N, d, M).total
        assert y[-1] == dense                       # s = 1 is dense FlashAttention
        assert icpt == pytest.approx(2 * N * d, rel=0.05)   # the Θ(Nd) term
        assert slope + icpt == pytest.approx(dense, rel=0.02)
    assert block_sparse_flash_attention(N, d, M, density=0.0).total == 2 * N * d   # K, V still loaded
    assert flash_attention(N, d, M, density=0.0, skip_empty_columns=True).total == 0


def test_boundary_m_equals_d_squared_is_quadratic():
    d = 64
    a = flash_attention(4096, d, d * d)
    b = flash_attention(8192, d, d * d)
    assert b.total / a.total == pytest.approx(4.0, rel=0.01)     # Θ(N²): no better than standard
    assert a.total / 4096**2 == pytest.approx(12 + 16 / d, rel=0.02)
    std = standard_attention(4096, d)
    assert 2.5 < a.total / std.total < 3.5


def test_boundary_m_equals_nd_reads_inputs_a_constant_number_of_times():
    d = 64
    ratios = [flash_attention(N, d, N * d).total / (N * d) for N in (1024, 4096, 16384)]
    assert max(ratios) - min(ratios) < 0.01 and max(ratios) < 15    # Θ(Nd): ~14 element passes
    one = flash_attention(4096, d, 4 * 4096 * d)                       # Bc = N: a single outer iteration
    assert one.reads["Q"] == one.reads["K"] == one.reads["V"] == 4096 * d
    assert one.total == 5 * 4096 * d + 4 * 4096


def test_random_block_mask_and_errors():
    m = random_block_mask(10, 20, 0.25, seed=0)
    assert m.sum() == 50 and m.shape == (10, 20)
    with pytest.raises(ValueError):
        random_block_mask(4, 4, 1.5)
    with pytest.raises(ValueError):
        flash_attention(0, 64, 1024)
    with pytest.raises(ValueError):
        block_sparse_flash_attention(64, 16, 1024)
    with pytest.raises(ValueError):
        flash_attention(64, 16, 1024, mask=np.ones((1, 1), bool), density=0.5)
