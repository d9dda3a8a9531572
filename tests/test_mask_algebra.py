"""Mask algebra: element semantics of every primitive, operators, text round trip, validation.

The reference for every primitive is a direct numpy evaluation of the semantics table of the
foundation issue: query row ``i`` sits at absolute position ``qp = i + kv_len - q_len``, key
column ``j`` at ``j``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blocksparse_fa as bsfa
from blocksparse_fa.mask.expr import And, Not, Or

# lengths (q_len, kv_len): square, ragged, and q_len != kv_len in both directions
LENGTHS = [(1, 1), (1, 40), (40, 1), (33, 33), (17, 50), (50, 17), (64, 64)]


# ------------------------------------------------------------------------------------------------
# numpy reference semantics
# ------------------------------------------------------------------------------------------------
def grid(q_len, kv_len):
    i = np.arange(q_len)[:, None]
    qp = i + (kv_len - q_len)
    j = np.arange(kv_len)[None, :]
    return i, qp, j


def np_primitive(name, params, q_len, kv_len):
    """The issue's table, evaluated with numpy (``%`` and ``//`` are floor-based, as in Python)."""
    i, qp, j = grid(q_len, kv_len)
    shape = (q_len, kv_len)
    if name == "full":
        out = np.ones(shape, bool)
    elif name == "causal":
        out = j <= qp
    elif name == "window":
        out = np.abs(qp - j) <= params["w"]
    elif name == "sliding_window":
        out = (qp - j >= 0) & (qp - j < params["w"])
    elif name == "global_tokens":
        out = (qp < params["g"]) | (j < params["g"])
    elif name == "strided":
        out = (qp - j) % params["s"] == 0
    elif name == "chunked":
        out = qp // params["c"] == j // params["c"]
    elif name == "prefix_lm":
        out = (j <= qp) | (j < params["p"])
    elif name == "summary":
        out = j % params["stride"] >= params["stride"] - params["c"]
    else:
        raise KeyError(name)
    return np.broadcast_to(out, shape)


def np_eval(m, q_len, kv_len):
    """Recursive numpy evaluation of an expression tree (tensor-free leaves; random_blocks via its
    own ``to_dense``, which is checked separately)."""
    if isinstance(m, And):
        out = np.ones((q_len, kv_len), bool)
        for c in m.children:
            out = out & np_eval(c, q_len, kv_len)
        return out
    if isinstance(m, Or):
        out = np.zeros((q_len, kv_len), bool)
        for c in m.children:
            out = out | np_eval(c, q_len, kv_len)
        return out
    if isinstance(m, Not):
        return ~np_eval(m.children[0], q_len, kv_len)
    if m.name == "random_blocks":
        return m.to_dense(q_len, kv_len).numpy()
    return np_primitive(m.name, m.params, q_len, kv_len)


PRIMITIVE_CASES = [
    ("full", {}),
    ("causal", {}),
    ("window", {"w": 0}),
    ("window", {"w": 3}),
    ("window", {"w": 100}),
    ("sliding_window", {"w": 1}),
    ("sliding_window", {"w": 5}),
    ("sliding_window", {"w": 1000}),
    ("global_tokens", {"g": 0}),
    ("global_tokens", {"g": 4}),
    ("global_tokens", {"g": 60}),
    ("strided", {"s": 1}),
    ("strided", {"s": 3}),
    ("strided", {"s": 7}),
    ("chunked", {"c": 1}),
    ("chunked", {"c": 5}),
    ("chunked", {"c": 64}),
    ("prefix_lm", {"p": 0}),
    ("prefix_lm", {"p": 9}),
    ("prefix_lm", {"p": 100}),
    ("summary", {"stride": 6, "c": 2}),
    ("summary", {"stride": 4, "c": 4}),
    ("summary", {"stride": 5, "c": 0}),
]


def make(name, params):
    return getattr(bsfa, name)(**params)


@pytest.mark.parametrize("name,params", PRIMITIVE_CASES, ids=[f"{n}{tuple(p.values())}" for n, p in PRIMITIVE_CASES])
def test_primitive_to_dense_matches_semantics_table(name, params):
    m = make(name, params)
    for q_len, kv_len in LENGTHS:
        dense = m.to_dense(q_len, kv_len)
        assert dense.dtype == torch.bool
        assert dense.shape == (q_len, kv_len)
        want = np_primitive(name, params, q_len, kv_len)
        assert np.array_equal(dense.numpy(), want), (name, params, q_len, kv_len)


def test_semantics_by_explicit_python_loops():
    """A few cells checked with plain Python arithmetic (no numpy broadcasting)."""
    q_len, kv_len = 6, 9
    cases = {
        bsfa.causal(): lambda qp, j: j <= qp,
        bsfa.window(2): lambda qp, j: abs(qp - j) <= 2,
        bsfa.sliding_window(3): lambda qp, j: 0 <= qp - j < 3,
        bsfa.global_tokens(2): lambda qp, j: qp < 2 or j < 2,
        bsfa.strided(4): lambda qp, j: (qp - j) % 4 == 0,
        bsfa.chunked(4): lambda qp, j: qp // 4 == j // 4,
        bsfa.prefix_lm(5): lambda qp, j: j <= qp or j < 5,
    }
    for m, fn in cases.items():
        d = m.to_dense(q_len, kv_len)
        for i in range(q_len):
            qp = i + kv_len - q_len
            for j in range(kv_len):
                assert bool(d[i, j]) == fn(qp, j), (m, i, j)


def test_default_kv_len_and_bottom_right_alignment():
    m = bsfa.causal()
    assert torch.equal(m.to_dense(7), m.to_dense(7, 7))
    # q_len < kv_len: the query rows are the last rows of the square mask
    sq = bsfa.sliding_window(4).to_dense(20, 20)
    assert torch.equal(bsfa.sliding_window(4).to_dense(5, 20), sq[15:])
    # causal with q_len == 1 attends to everything (the last position)
    assert bool(bsfa.causal().to_dense(1, 13).all())


@pytest.mark.parametrize("m", [bsfa.causal(), bsfa.window(3), bsfa.strided(3), bsfa.prefix_lm(4), bsfa.chunked(6),
                               bsfa.global_tokens(3), bsfa.random_blocks(2, block_size=8, seed=3)], ids=str)
def test_rows_depend_only_on_absolute_position(m):
    """Positional primitives: to_dense(q, kv) equals the bottom q rows of to_dense(kv, kv)."""
    kv = 45
    full_sq = m.to_dense(kv, kv)
    for q in (1, 7, 30, 45):
        assert torch.equal(m.to_dense(q, kv), full_sq[kv - q:]), q


# ------------------------------------------------------------------------------------------------
# operators and precedence
# ------------------------------------------------------------------------------------------------
def test_operators_match_numpy():
    a, b, c = bsfa.causal(), bsfa.window(3), bsfa.strided(2)
    A, B, C = (np_eval(x, 30, 41) for x in (a, b, c))
    assert np.array_equal((a & b).to_dense(30, 41).numpy(), A & B)
    assert np.array_equal((a | b).to_dense(30, 41).numpy(), A | B)
    assert np.array_equal((~a).to_dense(30, 41).numpy(), ~A)
    assert np.array_equal((~a & b | c).to_dense(30, 41).numpy(), ((~A) & B) | C)
    assert np.array_equal((a | b & ~c).to_dense(30, 41).numpy(), A | (B & (~C)))


def test_python_operator_precedence_structure():
    a, b, c = bsfa.causal(), bsfa.window(3), bsfa.strided(2)
    assert (a | b & c) == Or((a, And((b, c))))
    assert (~a & b) == And((Not(a), b))
    assert (~a | b & c) == Or((Not(a), And((b, c))))
    # n-ary flattening: associativity does not change the expression
    assert (a & b) & c == a & (b & c)
    assert (a | b) | c == a | (b | c)


@pytest.mark.parametrize("text,expected", [
    ("causal | window(3) & strided(2)", lambda a, b, c: a | (b & c)),
    ("causal & window(3) | strided(2)", lambda a, b, c: (a & b) | c),
    ("~causal & window(3)", lambda a, b, c: (~a) & b),
    ("~causal | window(3)", lambda a, b, c: (~a) | b),
    ("~(causal | window(3)) & strided(2)", lambda a, b, c: (~(a | b)) & c),
    ("causal & ~window(3) | ~strided(2) & causal", lambda a, b, c: (a & ~b) | (~c & a)),
    ("~~causal", lambda a, b, c: ~~a),
])
def test_dsl_precedence(text, expected):
    a, b, c = bsfa.causal(), bsfa.window(3), bsfa.strided(2)
    want = expected(a, b, c)
    got = bsfa.parse(text)
    assert got == want
    assert torch.equal(got.to_dense(25, 31), want.to_dense(25, 31))


def test_precedence_changes_semantics():
    """Sanity: the two groupings really differ, so the precedence tests above can fail."""
    a, b, c = bsfa.causal(), bsfa.window(3), bsfa.strided(2)
    assert not torch.equal((a | (b & c)).to_dense(20), ((a | b) & c).to_dense(20))
    assert not torch.equal(bsfa.parse("causal | window(3) & strided(2)").to_dense(20), ((a | b) & c).to_dense(20))


def test_de_morgan_and_complement():
    a, b = bsfa.window(4), bsfa.chunked(5)
    assert torch.equal((~(a & b)).to_dense(30, 37), (~a | ~b).to_dense(30, 37))
    assert torch.equal((~(a | b)).to_dense(30, 37), (~a & ~b).to_dense(30, 37))
    assert not bool((a & ~a).to_dense(30, 37).any())
    assert bool((a | ~a).to_dense(30, 37).all())


def test_mask_has_no_truth_value_and_rejects_non_masks():
    with pytest.raises(TypeError):
        bool(bsfa.causal())
    with pytest.raises(TypeError):
        bsfa.causal() and bsfa.window(3)  # noqa: B018
    with pytest.raises(TypeError):
        bsfa.causal() & 1
    with pytest.raises(TypeError):
        bsfa.causal() | "window(3)"
    with pytest.raises(TypeError):
        True & bsfa.causal()


# ------------------------------------------------------------------------------------------------
# text round trip (hypothesis)
# ------------------------------------------------------------------------------------------------
_int = st.integers
LEAVES = st.one_of(
    st.just(bsfa.full()),
    st.just(bsfa.causal()),
    _int(0, 5000).map(bsfa.window),
    _int(1, 5000).map(bsfa.sliding_window),
    _int(0, 5000).map(bsfa.global_tokens),
    _int(1, 300).map(bsfa.strided),
    _int(1, 5000).map(bsfa.chunked),
    _int(0, 5000).map(bsfa.prefix_lm),
    st.tuples(_int(1, 64), _int(0, 64)).filter(lambda t: t[1] <= t[0]).map(lambda t: bsfa.summary(*t)),
    st.tuples(_int(0, 8), st.sampled_from([16, 64, 128, 200]), _int(0, 2**31 - 1)).map(
        lambda t: bsfa.random_blocks(t[0], block_size=t[1], seed=t[2])),
)


def exprs(leaves=LEAVES, max_leaves=12):
    return st.recursive(
        leaves,
        lambda sub: st.one_of(
            st.tuples(sub, sub).map(lambda t: t[0] & t[1]),
            st.tuples(sub, sub).map(lambda t: t[0] | t[1]),
            sub.map(lambda x: ~x),
        ),
        max_leaves=max_leaves,
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exprs())
def test_str_reparses_to_equal_mask(m):
    text = str(m)
    back = bsfa.parse(text)
    assert back == m, text
    assert hash(back) == hash(m)
    assert str(back) == text
    assert repr(m) == f"Mask({text!r})"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exprs(max_leaves=6), st.sampled_from([(9, 9), (5, 23), (23, 5), (1, 17)]))
def test_random_expression_semantics_match_numpy(m, lens):
    q_len, kv_len = lens
    assert np.array_equal(m.to_dense(q_len, kv_len).numpy(), np_eval(m, q_len, kv_len)), str(m)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exprs(max_leaves=5), st.integers(0, 2), st.integers(0, 2))
def test_str_reparses_with_tensor_primitives(m, which, op):
    L = 40
    g = torch.Generator().manual_seed(1)
    ids = torch.sort(torch.randint(0, 4, (L,), generator=g)).values
    bm = torch.rand(3, 3, generator=g) < 0.5          # block_mask at block size 16 for L = 40
    dm = torch.rand(L, L, generator=g) < 0.5
    tensor_leaf = [bsfa.document(ids), bsfa.block_mask(bm, block_size=16), bsfa.dense_mask(dm)][which]
    m = [m & tensor_leaf, m | tensor_leaf, ~tensor_leaf & m][op]
    text = str(m)
    back = bsfa.parse(text, document=ids, block_mask=bm, dense_mask=dm)
    assert back == m, text
    assert torch.equal(back.to_dense(L, L), m.to_dense(L, L))


def test_str_examples():
    assert str(bsfa.causal()) == "causal"
    assert str(bsfa.full()) == "full"
    assert bsfa.parse(str(bsfa.random_blocks(3, block_size=64, seed=9))) == bsfa.random_blocks(3, block_size=64, seed=9)
    assert bsfa.parse(str(bsfa.summary(8, 3))) == bsfa.summary(8, 3)
    m = (bsfa.causal() | bsfa.window(2)) & ~(bsfa.strided(3) & bsfa.global_tokens(1))
    assert bsfa.parse(str(m)) == m
    assert "(" in str(m)  # parentheses are needed here and must be emitted


# ------------------------------------------------------------------------------------------------
# equality and hashing
# ------------------------------------------------------------------------------------------------
def test_equality_and_hash():
    assert bsfa.window(3) == bsfa.window(3)
    assert hash(bsfa.window(3)) == hash(bsfa.window(3))
    assert bsfa.window(3) != bsfa.window(4)
    assert bsfa.window(3) != bsfa.sliding_window(3)
    assert bsfa.causal() != bsfa.full()
    assert bsfa.random_blocks(2, seed=1) != bsfa.random_blocks(2, seed=2)
    assert bsfa.random_blocks(2, block_size=64) != bsfa.random_blocks(2, block_size=128)
    assert bsfa.random_blocks(2) == bsfa.random_blocks(2, block_size=128, seed=0)
    assert bsfa.causal() & bsfa.window(3) == bsfa.causal() & bsfa.window(3)
    assert bsfa.causal() & bsfa.window(3) != bsfa.causal() | bsfa.window(3)
    assert ~bsfa.causal() != bsfa.causal()
    assert bsfa.causal() != "causal"
    d = {bsfa.window(3): 1, bsfa.causal() & bsfa.window(3): 2}
    assert d[bsfa.parse("window(3)")] == 1
    assert d[bsfa.parse("causal & window(3)")] == 2


def test_tensor_primitive_equality_is_by_content():
    ids = torch.tensor([0, 0, 1, 1, 2])
    assert bsfa.document(ids) == bsfa.document(ids.clone())
    assert hash(bsfa.document(ids)) == hash(bsfa.document(ids.clone()))
    assert bsfa.document(ids) != bsfa.document(torch.tensor([0, 1, 1, 1, 2]))
    t = torch.rand(4, 4) < 0.5
    assert bsfa.dense_mask(t) == bsfa.dense_mask(t.clone())
    assert bsfa.dense_mask(t) != bsfa.dense_mask(~t)
    assert bsfa.block_mask(t, block_size=16) != bsfa.block_mask(t, block_size=32)
    assert bsfa.block_mask(t) != bsfa.dense_mask(t)


# ------------------------------------------------------------------------------------------------
# integer validation
# ------------------------------------------------------------------------------------------------
BAD_ARGS = [
    (lambda: bsfa.window(-1), "window", "w"),
    (lambda: bsfa.sliding_window(0), "sliding_window", "w"),
    (lambda: bsfa.strided(0), "strided", "s"),
    (lambda: bsfa.chunked(0), "chunked", "c"),
    (lambda: bsfa.global_tokens(-1), "global_tokens", "g"),
    (lambda: bsfa.prefix_lm(-5), "prefix_lm", "p"),
    (lambda: bsfa.random_blocks(-1), "random_blocks", "r"),
    (lambda: bsfa.random_blocks(1, block_size=0), "random_blocks", "block_size"),
    (lambda: bsfa.random_blocks(1, seed=-1), "random_blocks", "seed"),
    (lambda: bsfa.summary(0), "summary", "stride"),
    (lambda: bsfa.summary(4, 5), "summary", "c"),
    (lambda: bsfa.window(1.5), "window", "w"),
    (lambda: bsfa.window(True), "window", "w"),
    (lambda: bsfa.window("3"), "window", "w"),
    (lambda: bsfa.window(2**31), "window", "w"),
    (lambda: bsfa.chunked(-(2**40)), "chunked", "c"),
    (lambda: bsfa.block_mask(torch.ones(2, 2, dtype=torch.bool), block_size=0), "block_mask", "block_size"),
]


@pytest.mark.parametrize("fn,prim,arg", BAD_ARGS, ids=[f"{p}-{a}-{k}" for k, (_, p, a) in enumerate(BAD_ARGS)])
def test_integer_validation(fn, prim, arg):
    with pytest.raises(ValueError) as ei:
        fn()
    msg = str(ei.value)
    assert prim in msg and f"'{arg}'" in msg, msg


def test_integer_validation_accepts_boundaries():
    assert bsfa.window(0).to_dense(3).equal(torch.eye(3, dtype=torch.bool))
    bsfa.sliding_window(1), bsfa.strided(1), bsfa.chunked(1), bsfa.global_tokens(0), bsfa.prefix_lm(0)
    bsfa.window(2**31 - 1)
    bsfa.window(np.int64(5))  # numpy ints are ints
    assert bsfa.window(np.int64(5)) == bsfa.window(5)


def test_length_validation():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError):
            bsfa.causal().to_dense(bad, 4)
        with pytest.raises(ValueError):
            bsfa.causal().to_dense(4, bad)


# ------------------------------------------------------------------------------------------------
# document ids
# ------------------------------------------------------------------------------------------------
def np_document(ids: np.ndarray, q_len: int, kv_len: int) -> np.ndarray:
    _, qp, j = grid(q_len, kv_len)
    qpc = np.clip(qp, 0, kv_len - 1)
    return np.broadcast_to((ids[qpc] == ids[j]) & (qp >= 0), (q_len, kv_len))


@pytest.mark.parametrize("q_len,kv_len", [(30, 30), (7, 30), (45, 30), (1, 30)])
@pytest.mark.parametrize("sorted_ids", [True, False])
def test_document_1d(q_len, kv_len, sorted_ids):
    g = torch.Generator().manual_seed(q_len)
    ids = torch.randint(0, 4, (kv_len,), generator=g)
    if sorted_ids:
        ids = torch.sort(ids).values
    m = bsfa.document(ids)
    assert m.batch_shape == ()
    d = m.to_dense(q_len, kv_len)
    assert d.shape == (q_len, kv_len)
    assert np.array_equal(d.numpy(), np_document(ids.numpy(), q_len, kv_len))
    if q_len > kv_len:  # rows before the first key position keep nothing
        assert not bool(d[: q_len - kv_len].any())


def test_document_2d_batch():
    g = torch.Generator().manual_seed(0)
    B, L = 3, 25
    ids = torch.sort(torch.randint(0, 5, (B, L), generator=g), dim=1).values
    ids[2] = torch.randint(0, 3, (L,), generator=g)  # one unsorted batch row
    m = bsfa.document(ids)
    assert m.batch_shape == (B, 1)
    for q_len in (25, 10, 31):
        d = m.to_dense(q_len, L)
        assert d.shape == (B, 1, q_len, L)
        for b in range(B):
            assert np.array_equal(d[b, 0].numpy(), np_document(ids[b].numpy(), q_len, L)), (b, q_len)
    # (1, L) ids are shared: no batch dim
    assert bsfa.document(ids[:1]).batch_shape == ()
    assert torch.equal(bsfa.document(ids[:1]).to_dense(L), bsfa.document(ids[0]).to_dense(L))


def test_document_validation():
    with pytest.raises(ValueError, match="document"):
        bsfa.document(torch.zeros(5))  # float ids
    with pytest.raises(ValueError, match="document"):
        bsfa.document(torch.zeros(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="document"):
        bsfa.document(torch.zeros(2, 2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="document"):
        bsfa.document([0, 0, 1])
    m = bsfa.document(torch.zeros(10, dtype=torch.long))
    with pytest.raises(ValueError, match="kv_len"):
        m.to_dense(10, 11)


# ------------------------------------------------------------------------------------------------
# random_blocks
# ------------------------------------------------------------------------------------------------
def kept_key_blocks(d: torch.Tensor, q_len: int, kv_len: int, bs: int):
    """{query block (absolute): (set of key blocks, row -> kept column set consistent)}."""
    out = {}
    off = kv_len - q_len
    for i in range(q_len):
        qp = i + off
        cols = torch.nonzero(d[i]).flatten().tolist()
        blocks = sorted({c // bs for c in cols})
        # every kept block is kept entirely (ragged last block included)
        want_cols = [c for kb in blocks for c in range(kb * bs, min((kb + 1) * bs, kv_len))]
        assert cols == want_cols, (i, blocks)
        if qp < 0:
            assert cols == []
            continue
        qb = qp // bs
        if qb in out:
            assert out[qb] == blocks, (i, qb)  # same blocks for every row of a query block
        out[qb] = blocks
    return out


@pytest.mark.parametrize("r,bs,q_len,kv_len", [
    (3, 32, 300, 300), (2, 16, 100, 257), (1, 64, 257, 100), (4, 8, 64, 64), (5, 128, 200, 1000),
])
def test_random_blocks_exactly_r_distinct_blocks(r, bs, q_len, kv_len):
    m = bsfa.random_blocks(r, block_size=bs, seed=11)
    d = m.to_dense(q_len, kv_len)
    n_kb = -(-kv_len // bs)
    per_qb = kept_key_blocks(d, q_len, kv_len, bs)
    assert per_qb, "no valid query rows"
    for qb, blocks in per_qb.items():
        assert len(blocks) == min(r, n_kb), (qb, blocks)
        assert all(0 <= kb < n_kb for kb in blocks)
    # more than one distinct choice across query blocks (it is random, not fixed columns)
    if len(per_qb) > 3 and r < n_kb:
        assert len({tuple(b) for b in per_qb.values()}) > 1


def test_random_blocks_saturates_and_zero():
    assert bool(bsfa.random_blocks(50, block_size=16).to_dense(64, 64).all())  # r >= blocks: everything
    assert bool(bsfa.random_blocks(4, block_size=16).to_dense(64, 64).all())   # r == blocks
    assert not bool(bsfa.random_blocks(0, block_size=16).to_dense(64, 64).any())


def test_random_blocks_deterministic_in_seed():
    a = bsfa.random_blocks(3, block_size=16, seed=5).to_dense(400, 400)
    b = bsfa.random_blocks(3, block_size=16, seed=5).to_dense(400, 400)
    assert torch.equal(a, b)
    others = [bsfa.random_blocks(3, block_size=16, seed=s).to_dense(400, 400) for s in (6, 7, 8)]
    assert all(not torch.equal(a, o) for o in others)
    # the choice for a query block does not depend on q_len (absolute positions)
    assert torch.equal(bsfa.random_blocks(3, block_size=16, seed=5).to_dense(100, 400), a[300:])


# ------------------------------------------------------------------------------------------------
# block_mask / dense_mask
# ------------------------------------------------------------------------------------------------
def expand_blocks(t: torch.Tensor, bs: int, q_len: int, kv_len: int) -> torch.Tensor:
    return t.repeat_interleave(bs, -2).repeat_interleave(bs, -1)[..., :q_len, :kv_len]


@pytest.mark.parametrize("q_len,kv_len,bs", [(64, 64, 16), (50, 70, 16), (70, 50, 32), (1, 1, 128)])
def test_block_mask_2d(q_len, kv_len, bs):
    t = torch.rand(-(-q_len // bs), -(-kv_len // bs)) < 0.5
    m = bsfa.block_mask(t, block_size=bs)
    assert m.batch_shape == ()
    d = m.to_dense(q_len, kv_len)
    assert d.shape == (q_len, kv_len)
    assert torch.equal(d, expand_blocks(t, bs, q_len, kv_len))


def test_block_mask_4d_batch_dims():
    t = torch.rand(2, 3, 4, 5) < 0.5
    m = bsfa.block_mask(t, block_size=8)
    assert m.batch_shape == (2, 3)
    d = m.to_dense(30, 40)
    assert d.shape == (2, 3, 30, 40)
    assert torch.equal(d, expand_blocks(t, 8, 30, 40))
    assert bsfa.block_mask(t[:1, :1], block_size=8).batch_shape == ()
    assert bsfa.block_mask(t[:1], block_size=8).batch_shape == (1, 3)


def test_block_mask_validation():
    with pytest.raises(ValueError, match="block_mask"):
        bsfa.block_mask(torch.ones(2, 2, dtype=torch.bool), block_size=16).to_dense(40, 40)  # needs (3, 3)
    with pytest.raises(ValueError, match="block_mask"):
        bsfa.block_mask(torch.ones(2, 2))  # not bool
    with pytest.raises(ValueError, match="block_mask"):
        bsfa.block_mask(torch.ones(2, 2, 2, dtype=torch.bool))  # 3-D
    with pytest.raises(TypeError, match="block_mask"):
        bsfa.block_mask([[True]])


def test_dense_mask_2d_and_4d():
    t = torch.rand(13, 17) < 0.5
    m = bsfa.dense_mask(t)
    assert m.batch_shape == ()
    assert torch.equal(m.to_dense(13, 17), t)
    t4 = torch.rand(2, 3, 13, 17) < 0.5
    m4 = bsfa.dense_mask(t4)
    assert m4.batch_shape == (2, 3)
    assert torch.equal(m4.to_dense(13, 17), t4)
    assert bsfa.dense_mask(t4[:1, :1]).batch_shape == ()
    assert bsfa.dense_mask(t4[:, :1]).batch_shape == (2, 1)
    with pytest.raises(ValueError, match="dense_mask"):
        m.to_dense(13, 18)
    with pytest.raises(ValueError, match="dense_mask"):
        bsfa.dense_mask(torch.rand(13, 17))
    with pytest.raises(ValueError, match="dense_mask"):
        bsfa.dense_mask(torch.rand(13) < 0.5)


# ------------------------------------------------------------------------------------------------
# fully masked masks / rows
# ------------------------------------------------------------------------------------------------
def test_fully_masked():
    assert not bool((~bsfa.full()).to_dense(20, 30).any())
    assert not bool((bsfa.window(2) & ~bsfa.window(2)).to_dense(20, 30).any())
    assert not bool((bsfa.causal() & ~bsfa.prefix_lm(0)).to_dense(20, 30).any())
    assert not bool(bsfa.sliding_window(3).to_dense(10, 4)[:6].any())  # qp < 0
    d = bsfa.causal().to_dense(10, 4)
    assert not bool(d[:6].any()) and bool(d[6:].any(-1).all())
    # global_tokens keeps rows with qp < 0 (qp < g holds): documented semantics
    assert bool(bsfa.global_tokens(1).to_dense(10, 4)[:6].all())


# ------------------------------------------------------------------------------------------------
# batch shapes
# ------------------------------------------------------------------------------------------------
def test_batch_shape_broadcasting():
    L = 12
    ids = torch.randint(0, 3, (2, L))
    t = torch.rand(1, 3, L, L) < 0.5
    doc, dm = bsfa.document(ids), bsfa.dense_mask(t)
    assert (bsfa.causal() & bsfa.window(2)).batch_shape == ()
    assert doc.batch_shape == (2, 1) and dm.batch_shape == (1, 3)
    m = doc & dm | bsfa.causal()
    assert m.batch_shape == (2, 3)
    d = m.to_dense(L)
    assert d.shape == (2, 3, L, L)
    want = (doc.to_dense(L) & dm.to_dense(L)) | bsfa.causal().to_dense(L)
    assert torch.equal(d, want)
    assert (~doc).batch_shape == (2, 1)
    assert torch.equal((~doc).to_dense(L), ~doc.to_dense(L))
    with pytest.raises(ValueError, match="broadcast"):
        (doc & bsfa.document(torch.randint(0, 3, (3, L)))).batch_shape
    with pytest.raises(ValueError):
        (doc & bsfa.document(torch.randint(0, 3, (3, L)))).to_dense(L)
