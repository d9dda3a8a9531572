"""The predicate simplification is exact on every block where the kernels evaluate the predicate."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import blocksparse_fa as bsfa
from blocksparse_fa.compiler.simplify import masked_blocks, predicate_mask
from blocksparse_fa.kernels.predicate import build_payload, structure_key


def _agree_on_masked_blocks(mask, q_len, kv_len, block):
    lay = bsfa.compile_mask(mask, q_len, kv_len, block)
    pm = predicate_mask(lay.mask, lay._segs, lay._grid)
    a = mask.to_dense(q_len, kv_len).reshape(-1, q_len, kv_len)
    b = pm.to_dense(q_len, kv_len).reshape(-1, q_len, kv_len).expand_as(a)
    r, c = masked_blocks(lay._segs, lay._grid)
    for ri, ci in zip(r.tolist(), c.tolist()):
        rs, cs = slice(ri * block, (ri + 1) * block), slice(ci * block, (ci + 1) * block)
        assert torch.equal(a[:, rs, cs], b[:, rs, cs]), (str(mask), str(pm), ri, ci)
    return pm


def test_bigbird_predicate_drops_block_aligned_terms():
    mask = bsfa.load_pattern("bigbird")
    pm = _agree_on_masked_blocks(mask, 1024, 1024, 128)
    assert str(pm) == "window(192)"
    lay = bsfa.compile_mask(mask, 1024, 1024, 128)
    pay = build_payload(lay, "cpu")
    assert not pay.gathers  # no per-element bit-grid gather left, so the masked loop is pipelined
    assert pay.params.tolist() == [192]


def test_nothing_to_simplify_keeps_the_expression():
    mask = bsfa.load_pattern("longformer")
    lay = bsfa.compile_mask(mask, 1024, 1024, 128)
    assert predicate_mask(lay.mask, lay._segs, lay._grid) is mask


def test_ragged_edge_full_blocks_count_as_masked():
    # 1000 is not a multiple of 128: the last column's full blocks are evaluated with the predicate
    pm = _agree_on_masked_blocks(bsfa.full(), 1000, 1000, 128)
    assert structure_key(pm) == "full"
    _agree_on_masked_blocks(bsfa.window(300) | bsfa.random_blocks(2, block_size=128, seed=1), 1000, 1000, 128)


TERMS = ["causal", "window({w})", "sliding_window({w})", "global_tokens({g})",
         "random_blocks(2, block_size={b}, seed=5)", "strided({s})", "prefix_lm({g})", "chunked({b})"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(TERMS), min_size=2, max_size=3), st.sampled_from([" | ", " & "]),
       st.integers(1, 90), st.integers(1, 40), st.sampled_from([16, 32]), st.integers(3, 20),
       st.integers(40, 150), st.booleans())
def test_simplified_predicate_is_exact_on_masked_blocks(terms, op, w, g, b, s, n, negate):
    text = op.join(t.format(w=w, g=g, b=b, s=s) for t in terms)
    if negate:
        text = f"~({text})"
    _agree_on_masked_blocks(bsfa.parse(text), n, n, 16)


@pytest.mark.parametrize("n", [97, 128])
def test_simplified_bigbird_runs_exactly_in_the_kernels(n):
    """The Triton kernels (interpreter) with the simplified predicate match the float64 reference."""
    from test_triton_interpreter import _check

    mask = bsfa.window(20) | bsfa.global_tokens(16) | bsfa.random_blocks(2, block_size=16, seed=2)
    lay = bsfa.compile_mask(mask, n, n, 16)
    key = structure_key(predicate_mask(lay.mask, lay._segs, lay._grid))
    # at 97 the ragged last column's full (random) blocks are masked too, so the term stays
    assert ("random_blocks" in key) == (n % 16 != 0)
    _check(mask, Lq=n, Lk=n, H=2, Hkv=1, block=16)
