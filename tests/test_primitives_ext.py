"""The mask algebra's newer primitives: ranges and rectangles, position sets, chunk bands, periodic
windows, per-head/per-batch parameters, NATTEN/STA neighbourhoods, ``mask_mod``, bit-packed user
masks, query alignment, named patterns; against references written here from the semantics
table (plain loops and broadcasting), on odd lengths.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import pathlib
import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import blocksparse_fa as bsfa
from blocksparse_fa.compiler import compile_mask
from blocksparse_fa.kernels.predicate import build_payload, structure_key
from blocksparse_fa.mask.shift import Shift
from conftest import rel_err
from test_compiler import exact_states

ROOT = pathlib.Path(__file__).resolve().parents[1]
ph, pb = bsfa.per_head, bsfa.per_batch
ALIGNS = ("bottom_right", "top_left")
LENS = [(97, 97), (257, 257), (97, 257), (257, 97)]


# ------------------------------------------------------------------------------------------------
# references, from the semantics table
# ------------------------------------------------------------------------------------------------
def grid(lq, lk, align, d=0):
    i = np.arange(lq)[:, None]
    qp = i + (lk - lq if align == "bottom_right" else 0) + d
    j = np.arange(lk)[None, :]
    return i, qp, j


def natten_window_start(index: int, length: int, kernel: int, dilation: int) -> int:
    """NATTEN's window-start rule (its CPU reference kernels), restated: the window is centred on
    the index and shifted inwards at the borders, within the index's dilation group."""
    r = kernel // 2
    if dilation <= 1:
        return max(index - r, 0) + (index + r >= length) * (length - index - r - 1)
    if index - r * dilation < 0:
        return index % dilation
    if index + r * dilation >= length:
        imodd = index % dilation
        a = (length // dilation) * dilation
        b = length - a
        if imodd < b:
            return length - b + imodd - 2 * r * dilation
        return a + imodd - kernel * dilation
    return index - r * dilation


def grid_coords(grid_shape, tile=None):
    """Position -> coordinates table, built by walking the tokens in order (raster, or tile by tile)."""
    out = []
    if not tile:
        return [c for c in itertools.product(*[range(g) for g in grid_shape])]
    ntiles = [g // t for g, t in zip(grid_shape, tile)]
    for T in itertools.product(*[range(n) for n in ntiles]):
        for w in itertools.product(*[range(t) for t in tile]):
            out.append(tuple(a * t + b for a, t, b in zip(T, tile, w)))
    return out


def natten_reference(grid_shape, kernel, dilation, tile, start, lq, lk, align, d=0):
    n = len(grid_shape)
    kernel = (kernel,) * n if isinstance(kernel, int) else kernel
    dilation = (dilation,) * n if isinstance(dilation, int) else dilation
    coords = grid_coords(grid_shape, tile)
    V = len(coords)
    keep = np.zeros((V, V), bool)
    for p, cq in enumerate(coords):
        windows = []
        for e in range(n):
            s = natten_window_start(cq[e], grid_shape[e], kernel[e], dilation[e])
            windows.append({s + k * dilation[e] for k in range(kernel[e])})
        for q, ck in enumerate(coords):
            keep[p, q] = all(ck[e] in windows[e] for e in range(n))
    return _embed(keep, start, lq, lk, align, d)


def sta_reference(grid_shape, tile, kernel, start, lq, lk, align, shift=0):
    """STA as the paper's FlexAttention mask: the window's centre is the query's tile, clamped so
    that the window stays inside the tile grid."""
    n = len(grid_shape)
    kernel = (kernel,) * n if isinstance(kernel, int) else kernel
    ntiles = [g // t for g, t in zip(grid_shape, tile)]
    tv = int(np.prod(tile))
    V = int(np.prod(grid_shape))
    tiles = list(itertools.product(*[range(k) for k in ntiles]))
    keep = np.zeros((V, V), bool)
    for p in range(V):
        tq = tiles[p // tv]
        centre = [min(max(tq[d], kernel[d] // 2), ntiles[d] - 1 - kernel[d] // 2) for d in range(n)]
        for q in range(V):
            tk = tiles[q // tv]
            keep[p, q] = all(abs(centre[d] - tk[d]) <= kernel[d] // 2 for d in range(n))
    return _embed(keep, start, lq, lk, align, shift)


def _embed(keep, start, lq, lk, align, d=0):
    i, qp, j = grid(lq, lk, align, d)
    V = keep.shape[0]
    xq, xk = qp - start, j - start
    ok = (xq >= 0) & (xq < V) & (xk >= 0) & (xk < V)
    return ok & keep[np.clip(xq, 0, V - 1), np.clip(xk, 0, V - 1)]


def simple_reference(m, lq, lk, align, d=0):
    """Leaves defined by one formula of the table (no tensors beyond sets/ids)."""
    i, qp, j = grid(lq, lk, align, d)
    name, p = m.name, m.params
    if name == "key_range":
        out = (j >= p["start"]) & (j < p["end"])
    elif name == "query_range":
        out = (qp >= p["start"]) & (qp < p["end"])
    elif name == "chunk_band":
        d = j // p["k_chunk"] - qp // p["q_chunk"]
        out = (d >= p["lo"]) & (d <= p["hi"])
    elif name == "periodic_window":
        out = np.abs(qp % p["period"] - j % p["period"]) <= p["w"]
    elif name == "key_set":
        out = np.isin(j, m.positions(0))
    elif name == "query_set":
        out = np.isin(qp, m.positions(0))
    elif name == "causal":
        out = j <= qp
    elif name == "sliding_window":
        out = (qp - j >= 0) & (qp - j < p["w"])
    elif name == "window":
        out = np.abs(qp - j) <= p["w"]
    elif name == "strided":
        out = (qp - j) % p["s"] == 0
    elif name == "document":
        ids = m.ids[0].numpy()
        L = len(ids)
        ok = (qp >= 0) & (qp < L)
        out = ok & (ids[np.clip(qp, 0, L - 1)] == ids[j])
    else:
        raise KeyError(name)
    return np.broadcast_to(out, (lq, lk))


def reference(m, lq, lk, align, d=0):
    """``d``: query positions moved by ``shift`` nodes above."""
    from blocksparse_fa.mask.expr import And, Not, Or

    if isinstance(m, And):
        return np.logical_and.reduce([reference(c, lq, lk, align, d) for c in m.children])
    if isinstance(m, Or):
        return np.logical_or.reduce([reference(c, lq, lk, align, d) for c in m.children])
    if isinstance(m, Not):
        return ~reference(m.children[0], lq, lk, align, d)
    if isinstance(m, Shift):
        return reference(m.children[0], lq, lk, align, d + m.offset)
    if m.name == "neighborhood":
        g, k, dil, t, s = m._params
        return natten_reference(g, k, dil, t, s, lq, lk, align, d)
    if m.name == "sliding_tiles":
        g, k, _, t, s = m._params
        return sta_reference(g, t, k, s, lq, lk, align, d)
    return simple_reference(m, lq, lk, align, d)


def _ids(n, seed=0, n_docs=6, shuffle=False, split=False):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[: n_docs - 1] + 1).values.tolist()
    ids = torch.zeros(n, dtype=torch.long)
    for c in cuts:
        ids[c:] += 1
    if shuffle:
        ids = torch.randperm(n_docs, generator=g)[ids] * 7 - 3
    if split:  # documents split into several runs
        ids = ids % 3
    return ids


CASES = {
    "key_range": lambda n: bsfa.key_range(13, 71),
    "key_range_empty": lambda n: bsfa.key_range(40, 40),
    "query_range": lambda n: bsfa.query_range(-5, 60),
    "rectangle": lambda n: bsfa.query_range(20, 90) & bsfa.key_range(33, 81),
    "rectangles_or_causal": lambda n: (bsfa.query_range(20, 90) & bsfa.key_range(33, 81)) | bsfa.causal(),
    "causal_key_range": lambda n: bsfa.causal() & bsfa.key_range(17, 200),
    "window_query_range": lambda n: bsfa.window(9) & bsfa.query_range(30, 200),
    "chunk_band": lambda n: bsfa.chunk_band(13, 7, -1, 2),
    "chunk_band_block_causal": lambda n: bsfa.chunk_band(16, 16, lo=-2**31 + 1),
    "periodic": lambda n: bsfa.periodic_window(10, 2),
    "periodic_wide": lambda n: bsfa.periodic_window(61, 0) | bsfa.sliding_window(5),
    "key_set": lambda n: bsfa.key_set(torch.tensor([3, 5, 40, 41, 42, 90, -1, 300])),
    "globals_anywhere": lambda n: bsfa.key_set(torch.tensor([0, 33, 96])) | bsfa.query_set(torch.tensor([0, 33, 96])),
    "query_set_causal": lambda n: bsfa.query_set(torch.tensor([2, 50, 51, 52, 60])) & bsfa.causal(),
    "strided_mid": lambda n: bsfa.strided(33),
    "strided_sparse": lambda n: bsfa.strided(101),
    "natten_1d": lambda n: bsfa.neighborhood(90, 7),
    "natten_2d": lambda n: bsfa.neighborhood((9, 11), 3),
    "natten_2d_dilated": lambda n: bsfa.neighborhood((10, 9), (3, 3), dilation=(3, 2), start=4),
    "natten_3d": lambda n: bsfa.neighborhood((3, 5, 6), (3, 3, 5)),
    "natten_2d_offset": lambda n: bsfa.neighborhood((7, 13), (3, 5), start=9),
    "natten_2d_tiles": lambda n: bsfa.neighborhood((8, 12), (3, 5), tile=(2, 4)),
    "natten_3d_tiles_dilated": lambda n: bsfa.neighborhood((4, 4, 6), 3, dilation=(1, 1, 2), tile=(2, 2, 3), start=1),
    "sta_2d": lambda n: bsfa.sliding_tiles((8, 12), (2, 3), 3),
    "sta_3d": lambda n: bsfa.sliding_tiles((4, 6, 6), (2, 2, 3), (1, 3, 1), start=3),
    "document_shuffled_runs": lambda n: bsfa.causal() & bsfa.document(_ids(n, shuffle=True)),
    "document_split_runs": lambda n: bsfa.document(_ids(n, split=True)),
    "shift": lambda n: bsfa.shift(bsfa.causal() & bsfa.sliding_window(11) | bsfa.neighborhood((6, 7), 3), -9)
    | bsfa.shift(bsfa.query_range(0, 30), 40),
}


@pytest.mark.parametrize("name", list(CASES))
def test_semantics_match_reference(name):
    for lq, lk in LENS:
        m = CASES[name](lk)
        for align in ALIGNS:
            got = m.to_dense(lq, lk, align=align).numpy()
            want = reference(m, lq, lk, align)
            assert np.array_equal(got, want), (name, lq, lk, align)


BLOCKS = [16, (32, 16), (16, 48), 64]


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_exactly(name):
    k = list(CASES).index(name)
    for t, (lq, lk) in enumerate(LENS):
        m = CASES[name](lk)
        bs = BLOCKS[(k + t) % len(BLOCKS)]
        for align in ALIGNS:
            lay = compile_mask(m, lq, lk, bs, cache=False, align=align)
            dense = m.to_dense(lq, lk, align=align)
            bm, bn = (bs, bs) if isinstance(bs, int) else bs
            assert torch.equal(lay.to_dense(), dense), (name, lq, lk, bs, align)
            truth = exact_states(dense, bm, bn).expand(lay.shape)
            assert torch.equal(lay.block_states(), truth), (name, lq, lk, bs, align)
            assert lay.q_offset == (lk - lq if align == "bottom_right" else 0) and lay.align == align


@pytest.mark.parametrize("name", list(CASES))
def test_text_round_trip(name):
    m = CASES[name](257)
    text = str(m)
    back = bsfa.parse(text, **m.tensors())
    assert back == m and hash(back) == hash(m) and str(back) == text, text
    assert torch.equal(back.to_dense(97, 257), m.to_dense(97, 257))


def test_round_trip_with_several_tensors_of_one_kind():
    a, b = _ids(80, 1), _ids(80, 2, n_docs=4)
    m = bsfa.document(a) & bsfa.causal() | bsfa.document(b) & bsfa.window(ph([3, 5]))
    text = str(m)
    assert text == "document & causal | document(document_2) & window(window_w)"
    back = bsfa.parse(text, **m.tensors())
    assert back == m
    assert set(m.tensors()) == {"document", "document_2", "window_w"}


def test_dsl_tuples_and_arithmetic():
    assert bsfa.parse("neighborhood(grid=(8, 2 * 6), kernel=(3, 5), tile=(2, 4))") == bsfa.neighborhood(
        (8, 12), (3, 5), tile=(2, 4))
    assert bsfa.parse("key_range(n, 2 * n - 1)", n=10) == bsfa.key_range(10, 19)
    assert bsfa.parse("chunk_band(b, b, hi=n // b - 1)", n=64, b=16) == bsfa.chunk_band(16, 16, hi=3)
    assert bsfa.parse("window((3 + 4) * 2)") == bsfa.window(14)
    assert bsfa.parse("query_range(-(2 + 3), 7)") == bsfa.query_range(-5, 7)
    with pytest.raises(bsfa.MaskSyntaxError, match="division by zero"):
        bsfa.parse("window(4 // 0)")
    with pytest.raises(bsfa.MaskSyntaxError, match="integer"):
        bsfa.parse("window(w * 2)", w=ph([1, 2]))
    with pytest.raises(bsfa.MaskSyntaxError):
        bsfa.parse("window(" + "-" * 500 + "1)")


# ------------------------------------------------------------------------------------------------
# per-head and per-batch parameters
# ------------------------------------------------------------------------------------------------
def test_per_head_and_per_batch_values_match_scalar_masks():
    m = bsfa.causal() & bsfa.sliding_window(ph([3, 17, 40])) | bsfa.key_range(0, pb([0, 5]))
    assert m.batch_shape == (2, 3)
    dense = m.to_dense(97, 97)
    assert dense.shape == (2, 3, 97, 97)
    for b, h in itertools.product(range(2), range(3)):
        want = bsfa.causal() & bsfa.sliding_window([3, 17, 40][h]) | bsfa.key_range(0, [0, 5][b])
        assert torch.equal(dense[b, h], want.to_dense(97, 97)), (b, h)
    lay = compile_mask(m, 97, 97, 16, cache=False)
    assert lay.shape == (2, 3, 7, 7)
    assert torch.equal(lay.block_states(), exact_states(dense, 16, 16))
    for m2 in [bsfa.strided(ph([3, 40])) | bsfa.global_tokens(pb([2, 19])),
               bsfa.periodic_window(ph([7, 30]), pb([0, 2])) & bsfa.chunk_band(ph([5, 9]), 4, hi=pb([0, 1])),
               bsfa.prefix_lm(ph([0, 50])) & bsfa.window(pb([3, 8])) | bsfa.chunked(ph([10, 33]))]:
        d2 = m2.to_dense(97, 83)
        for b, h in itertools.product(range(2), range(2)):
            assert torch.equal(d2[b, h], _at(m2, b, h).to_dense(97, 83)), (m2, b, h)
        lay2 = compile_mask(m2, 97, 83, (16, 32), cache=False)
        assert torch.equal(lay2.to_dense(), d2)
        assert torch.equal(lay2.block_states(), exact_states(d2, 16, 32)), m2


def _at(m, b, h):
    """The mask with every per-head/per-batch value taken at (b, h)."""
    from blocksparse_fa.mask.expr import And, Not, Or

    if isinstance(m, (And, Or)):
        return type(m).of(*[_at(c, b, h) for c in m.children])
    if isinstance(m, Not):
        return ~_at(m.children[0], b, h)
    return m.at(b, h)


def test_shift_per_sequence_decode_positions():
    """Batched decode over a padded cache: each sequence's query sits at its own last position."""
    lk = 97
    lens = torch.tensor([40, 97, 5])
    m = bsfa.shift(bsfa.causal() & bsfa.sliding_window(8), pb(lens - lk)) & bsfa.key_range(0, pb(lens))
    assert bsfa.parse(str(m), **m.tensors()) == m and str(m).startswith("shift(")
    for lq in (1, 3):
        dense = m.to_dense(lq, lk)
        for b, n in enumerate(lens.tolist()):
            qp = torch.arange(lq).view(-1, 1) + n - lq  # the queries end at the sequence's last token
            j = torch.arange(lk).view(1, -1)
            assert torch.equal(dense[b, 0], (j <= qp) & (qp - j < 8) & (j < n)), (lq, b)
        lay = compile_mask(m, lq, lk, 16, cache=False)
        assert torch.equal(lay.to_dense(), dense)
        assert torch.equal(lay.block_states(), exact_states(dense, 16, 16))
    a = build_payload(compile_mask(m, 1, lk, 16), "cpu")
    b = build_payload(compile_mask(bsfa.shift(bsfa.causal() & bsfa.sliding_window(3), pb(lens - 90)) &
                                   bsfa.key_range(0, pb(lens)), 1, lk, 16), "cpu")
    assert a.fn is b.fn


def test_per_value_parameters_validate_and_collapse():
    with pytest.raises(ValueError, match="per_head"):
        bsfa.window(torch.tensor([1, 2]))  # 1-D: ambiguous between batch and head
    with pytest.raises(ValueError, match="integer"):
        bsfa.window(torch.tensor([[1.5]]))
    with pytest.raises(ValueError, match=r"\[1, "):
        bsfa.sliding_window(ph([0, 3]))
    with pytest.raises(ValueError, match="no per-head"):
        bsfa.random_blocks(ph([1, 2]))
    m = bsfa.window(ph([4, 4, 4]))  # equal values are one value (no batch dims), written for 3 heads
    assert m.w == 4 and m.batch_shape == () and m != bsfa.window(4)
    assert bsfa.parse(str(m), **m.tensors()) == m
    assert torch.equal(compile_mask(m, 40, 40, 16).block_states(), compile_mask(bsfa.window(4), 40, 40, 16).block_states())
    assert bsfa.window(ph([4, 5])).batch_shape == (1, 2)


WRONG_LENGTHS = {  # name: (mask, message) for q of B = 2 sequences and H = 4 heads
    "equal per-head values, 5 of them": (lambda: bsfa.causal() & bsfa.key_range(0, ph([5] * 5)),
                                         r"key_range\(\): argument 'end' holds 5 per-head values but q has H=4"),
    "equal per-batch values, 3 of them": (lambda: bsfa.query_range(0, pb([7, 7, 7])),
                                          r"query_range\(\): argument 'end' holds 3 per-batch values .* B=2"),
    "distinct per-head values, 3 of them": (lambda: bsfa.window(ph([1, 2, 3])),
                                            r"window\(\): argument 'w' holds 3 per-head values but q has H=4"),
    "equal per-batch shift, 3 of them": (lambda: bsfa.shift(bsfa.causal(), pb([0, 0, 0])),
                                         r"shift\(\): argument 'offset' holds 3 per-batch values .* B=2"),
}


@pytest.mark.parametrize("case", list(WRONG_LENGTHS))
@pytest.mark.parametrize("via", ["mask", "layout", "second call"])
def test_per_value_parameters_of_the_wrong_length_are_refused(case, via):
    """A per-head or per-batch parameter must hold H (or B) values, or one: also when all its
    values are equal (they were collapsed into one int before the length was checked). Refused
    as a mask, as a compiled layout, and on a second call whose (B, H) differ from the first."""
    make, msg = WRONG_LENGTHS[case]
    m = make()
    q, k = torch.randn(2, 4, 32, 8), torch.randn(2, 2, 32, 8)
    mask = compile_mask(m, 32, 32, 16) if via == "layout" else m
    if via == "second call":  # a first call whose (B, H) fit the mask runs and caches its layout
        shapes = [t.shape for t in m.tensors().values()]
        b1, h1 = max(sh[0] for sh in shapes), max(sh[1] for sh in shapes)
        k1 = torch.randn(b1, 1, 32, 8)
        assert bsfa.attention(torch.randn(b1, h1, 32, 8), k1, k1, mask, block_size=16).shape == (b1, h1, 32, 8)
    with pytest.raises(ValueError, match=msg):
        bsfa.attention(q, k, k, mask, block_size=16)


NON_INTEGER_VALUES = {  # integer parameters given non-integer values: refused, never rounded
    "per_head floats": lambda: bsfa.window(ph([1.5, 2.5, 3.9, 4.2])),
    "per_head whole floats": lambda: bsfa.sliding_window(ph([2.0, 4.0])),
    "per_batch floats": lambda: bsfa.key_range(0, pb([3.5, 4.0])),
    "per_batch bools": lambda: bsfa.global_tokens(pb([True, False])),
    "per_head numpy floats": lambda: bsfa.strided(ph(np.array([2.0, 3.5]))),
    "shift per_batch floats": lambda: bsfa.shift(bsfa.causal(), pb([2.5, 1.0])),
    "window float": lambda: bsfa.window(1.5),
    "window 0-d float tensor": lambda: bsfa.window(torch.tensor(2.5)),
    "window (B, H) float tensor": lambda: bsfa.window(torch.tensor([[2.5, 3.0]])),
    "chunked float": lambda: bsfa.chunked(4.5),
    "chunk_band float": lambda: bsfa.chunk_band(3, 4.5),
    "prefix_lm float": lambda: bsfa.prefix_lm(2.5),
    "query_range float": lambda: bsfa.query_range(0.5, 4),
    "periodic_window float": lambda: bsfa.periodic_window(10.5, 2),
    "summary float": lambda: bsfa.summary(8, 2.5),
    "random_blocks float": lambda: bsfa.random_blocks(2.5),
    "random_blocks float seed": lambda: bsfa.random_blocks(2, seed=1.5),
    "neighborhood float kernel": lambda: bsfa.neighborhood((8, 8), 3.5),
    "sliding_tiles float tile": lambda: bsfa.sliding_tiles((8, 8), (2, 2.5), 3),
    "key_set float positions": lambda: bsfa.key_set(torch.tensor([1.5, 2.0])),
    "document float ids": lambda: bsfa.document(torch.tensor([0.0, 0.5, 1.0])),
    "mask_mod float B": lambda: bsfa.mask_mod(lambda b, h, i, j: i >= j, B=2.5),
}


@pytest.mark.parametrize("case", list(NON_INTEGER_VALUES))
def test_non_integer_values_of_integer_parameters_are_refused(case):
    with pytest.raises(ValueError, match=r"int|integer"):
        NON_INTEGER_VALUES[case]()


def test_new_values_reuse_the_generated_predicate():
    """Only the structure (and whether a parameter is per-head) goes into the kernels' source."""
    a = bsfa.causal() & bsfa.sliding_window(ph([8, 20])) & bsfa.key_range(0, pb([50, 70]))
    b = bsfa.causal() & bsfa.sliding_window(ph([30, 5])) & bsfa.key_range(0, pb([90, 11]))
    assert structure_key(a) == structure_key(b) != structure_key(bsfa.causal() & bsfa.sliding_window(8) &
                                                                  bsfa.key_range(0, 50))
    pa = build_payload(compile_mask(a, 96, 96, 16), "cpu")
    pb_ = build_payload(compile_mask(b, 96, 96, 16), "cpu")
    assert pa.fn is pb_.fn and not torch.equal(pa.params, pb_.params)
    for m1, m2 in [(bsfa.neighborhood((8, 12), 3), bsfa.neighborhood((6, 20), (5, 3), start=9)),
                   (bsfa.neighborhood((8, 12), 3, dilation=(2, 1)),
                    bsfa.neighborhood((6, 20), (5, 3), dilation=(1, 2), start=9)),
                   (bsfa.periodic_window(10, 2), bsfa.periodic_window(77, 0)),
                   (bsfa.key_set(torch.tensor([1, 5])), bsfa.key_set(torch.tensor([[3], [90]]))),
                   (bsfa.chunk_band(3, 4), bsfa.chunk_band(5, 9, -3, 7))]:
        assert build_payload(compile_mask(m1, 120, 120, 16), "cpu").fn is \
            build_payload(compile_mask(m2, 120, 120, 16), "cpu").fn


# ------------------------------------------------------------------------------------------------
# neighbourhoods: the classification's geometry
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [bsfa.neighborhood((9, 11), 3), bsfa.neighborhood((8, 12), 3, tile=(2, 4)),
                               bsfa.neighborhood((4, 6, 6), 3, tile=(2, 3, 2)), bsfa.sliding_tiles((8, 12), (2, 3), 3)],
                         ids=str)
def test_grid_boxes_and_runs_cover_exactly(m):
    geo = m.geometry
    rng = np.random.default_rng(0)
    coords = np.stack(geo.coords(np.arange(geo.V)), 1)
    lo, hi = np.sort(rng.integers(0, geo.V, (2, 60)), axis=0)
    own, clo, chi = geo.boxes(lo, hi)
    for k in range(60):
        want = {tuple(c) for c in coords[lo[k]:hi[k] + 1]}
        got = set()
        for b in np.nonzero(own == k)[0]:
            got |= set(itertools.product(*[range(clo[b, d], chi[b, d] + 1) for d in range(geo.ndim)]))
        if geo.mults.min() > 0:
            assert want == got, (lo[k], hi[k])
    blo = np.stack([rng.integers(0, G, 60) for G in geo.G], 1)
    bhi = np.stack([rng.integers(0, G, 60) for G in geo.G], 1)
    blo, bhi = np.minimum(blo, bhi), np.maximum(blo, bhi)
    own, rlo, rhi = geo.key_runs(blo, bhi)
    for k in range(60):
        want = set(np.nonzero(((coords >= blo[k]) & (coords <= bhi[k])).all(1))[0].tolist())
        got = set()
        for r in np.nonzero(own == k)[0]:
            got |= set(range(rlo[r], rhi[r] + 1))
        assert want == got


def test_neighborhood_validation():
    with pytest.raises(ValueError, match="odd"):
        bsfa.neighborhood((8, 8), 4)
    with pytest.raises(ValueError, match="exceeds"):
        bsfa.neighborhood((8, 8), 5, dilation=2)
    with pytest.raises(ValueError, match="divide"):
        bsfa.neighborhood((8, 9), 3, tile=(2, 2))
    with pytest.raises(ValueError, match="entries"):
        bsfa.neighborhood((8, 8), (3, 3, 3))
    with pytest.raises(ValueError, match="tiles"):
        bsfa.sliding_tiles((8, 8), (4, 4), 3)


# ------------------------------------------------------------------------------------------------
# user masks: mask_mod, dense_mask, block_mask
# ------------------------------------------------------------------------------------------------
def test_mask_mod_matches_its_callable_and_is_evaluated_only_where_needed():
    seen = [0]

    def fn(b, h, q, kv):
        seen[0] += int(torch.broadcast_shapes(b.shape, h.shape, q.shape, kv.shape).numel())
        return ((q * 7 + kv * 3 + h) % 5) != 0

    m = bsfa.mask_mod(fn, H=2) & bsfa.sliding_window(20)
    dense = m.to_dense(257, 257)
    i = torch.arange(257).view(-1, 1)
    j = torch.arange(257).view(1, -1)
    for h in range(2):
        want = (((i * 7 + j * 3 + h) % 5) != 0) & (i - j >= 0) & (i - j < 20)
        assert torch.equal(dense[0, h], want)
    n = 1024
    seen[0] = 0
    lay = compile_mask(bsfa.mask_mod(fn) & bsfa.sliding_window(20), n, n, 32, cache=False)
    band_blocks = 2 * (n // 32)  # diagonal and sub-diagonal blocks of the window
    assert 0 < seen[0] <= band_blocks * 32 * 32 < n * n // 10
    assert torch.equal(lay.to_dense(), (bsfa.mask_mod(fn) & bsfa.sliding_window(20)).to_dense(n, n))
    with pytest.raises(TypeError, match="bool"):
        bsfa.mask_mod(lambda b, h, q, kv: q - kv).to_dense(8, 8)


def test_mask_mod_round_trip_and_equality():
    def f(b, h, q, kv):
        return q >= kv

    m = bsfa.mask_mod(f, B=2) | bsfa.window(3)
    assert str(m) == "mask_mod(B=2) | window(3)"
    assert bsfa.parse(str(m), **m.tensors()) == m
    assert bsfa.mask_mod(f) != bsfa.mask_mod(lambda b, h, q, kv: q >= kv)  # compared by identity


def test_dense_mask_is_bit_packed_and_takes_views():
    base = torch.rand(1, 1, 97, 1) < 0.5
    t = base.expand(2, 3, 97, 257)  # a stride-0 view: never materialised
    m = bsfa.dense_mask(t)
    assert m.tensor.dtype == torch.int32 and m.tensor.shape == (2, 3, 97, 9)  # ceil(257 / 32) words
    assert torch.equal(m.to_dense(97, 257), t)
    lay = compile_mask(m, 97, 257, (16, 32), cache=False)
    assert torch.equal(lay.block_states(), exact_states(t.contiguous(), 16, 32))
    sparse = torch.rand(257, 97) < 0.01
    assert torch.equal(bsfa.dense_mask(sparse).to_dense(257, 97), sparse)


def test_dense_mask_of_a_broadcast_view_costs_at_most_one_bit_per_element():
    """A stride-0 ``(L, L)`` view (64 MB as bools) packed, hashed and compiled: the memory it adds
    stays at the packed bits (``L² / 8`` bytes) plus the classification's fixed-size chunks. Hashing
    used to copy the packed bits (two bits per element; 4.1 GB at 128K tokens)."""
    import tracemalloc

    L = 8192
    row = torch.rand(L, generator=torch.Generator().manual_seed(0)) < 0.5
    view = row.view(1, L).expand(L, L)
    packed = L * L // 8
    tracemalloc.start()
    try:
        m = bsfa.dense_mask(view)
        hash(m)
        lay = compile_mask(m, L, L, 128, cache=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert m.tensor.nbytes == packed
    assert peak <= packed + (4 << 20), (peak, packed)
    kept = row.view(-1, 128)  # every row block sees the same key blocks: full, empty or partial
    want = torch.where(kept.all(1), 2, torch.where(kept.any(1), 1, 0)).to(torch.int8)
    assert torch.equal(lay.block_states(), want.expand(L // 128, -1).to(lay.block_states().dtype))


@pytest.mark.parametrize("bs,block", [(16, 16), (16, 32), (32, 16), (24, 16)])
def test_block_mask_per_head_all_block_sizes(bs, block):
    t = torch.rand(1, 3, -(-97 // bs), -(-257 // bs)) < 0.4
    m = bsfa.block_mask(t, block_size=bs)
    assert m.tensor.dtype == torch.int32 and m.tensor.numel() == 3 * t.shape[2] * -(-t.shape[3] // 32)
    lay = compile_mask(m, 97, 257, block, cache=False)
    dense = m.to_dense(97, 257)
    assert torch.equal(lay.to_dense(), dense)
    assert torch.equal(lay.block_states(), exact_states(dense, block, block))
    assert torch.equal(bsfa.parse(str(m), **m.tensors()).to_dense(97, 257), dense)


# ------------------------------------------------------------------------------------------------
# expression depth, imports, alignment
# ------------------------------------------------------------------------------------------------
def test_deep_expressions_fail_at_construction_and_shallow_ones_round_trip():
    m = bsfa.causal()
    with pytest.raises(ValueError, match="deeper than 99"):
        for k in range(300):
            m = (m & bsfa.window(k)) | bsfa.global_tokens(1)
    m = bsfa.causal()
    for k in range(49):  # 98 levels: (& then |) per step
        m = (m & bsfa.window(k)) | bsfa.global_tokens(1)
    assert m.depth == 98
    assert bsfa.parse(str(m)) == m and hash(bsfa.parse(str(m))) == hash(m)
    n = bsfa.causal()
    while n.depth < 98:  # "~(... | ...)": two DSL levels per two operator levels, the worst case
        n = ~(n | bsfa.window(1))
    n = ~n
    assert n.depth == 99 and bsfa.parse(str(n)) == n


def test_mask_package_does_not_import_the_compiler():
    for path in (ROOT / "blocksparse_fa" / "mask").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith(("compiler", "..compiler")) and not (
                    node.level >= 2 and (node.module or "").startswith("compiler")), (path, node.module)
            if isinstance(node, ast.Import):
                assert not any("compiler" in a.name for a in node.names), path
    assert bsfa.causal().density(64) == pytest.approx(65 / 128)  # Mask.compile still works (registered)


def test_align_choice():
    m = bsfa.causal() & bsfa.sliding_window(5)
    br = compile_mask(m, 7, 20, 4, cache=False)
    tl = compile_mask(m, 7, 20, 4, cache=False, align="top_left")
    assert br.q_offset == 13 and tl.q_offset == 0
    assert torch.equal(tl.to_dense(), m.to_dense(20, 20)[:7])
    assert torch.equal(br.to_dense(), m.to_dense(20, 20)[13:])
    assert compile_mask(m, 7, 20, 4) is not compile_mask(m, 7, 20, 4, align="top_left")
    with pytest.raises(ValueError, match="align"):
        compile_mask(m, 7, 20, 4, align="center")


# ------------------------------------------------------------------------------------------------
# patterns and the FlexAttention equivalents
# ------------------------------------------------------------------------------------------------
NEW_PATTERNS = ["natten_2d", "sliding_tile_3d", "flamingo_xattn", "block_diffusion", "shared_prefix", "padded_batch"]


@pytest.mark.parametrize("name", NEW_PATTERNS)
def test_new_patterns_load_cite_and_compile(name):
    info = bsfa.pattern_info(name)
    assert info.citation.strip() and "arXiv" in info.citation or "NeurIPS" in info.citation
    kw = {"document": _ids(1024)} if name == "shared_prefix" else {}
    m = bsfa.load_pattern(name, **kw)
    lay = compile_mask(m, 1024, 1024, 64, cache=False)
    assert torch.equal(lay.to_dense(), m.to_dense(1024, 1024))


def test_padded_batch_pattern_and_flamingo_cross_attention():
    lens = torch.tensor([40, 97, 1])
    m = bsfa.load_pattern("padded_batch", length=pb(lens))
    dense = m.to_dense(97, 97)
    i, j = torch.arange(97).view(-1, 1), torch.arange(97).view(1, -1)
    for b, n in enumerate(lens.tolist()):
        assert torch.equal(dense[b, 0], (j <= i) & (i < n) & (j < n))
    assert bsfa.parse("padded_batch(length=lens)", lens=pb(lens)) == m
    # text span m (5 tokens) sees image m (3 visual tokens); queries are text, top-left aligned
    x = compile_mask(bsfa.load_pattern("flamingo_xattn", text=5, latents=3), 23, 15, 4, cache=False, align="top_left")
    want = (torch.arange(23).view(-1, 1) // 5) == (torch.arange(15).view(1, -1) // 3)
    assert torch.equal(x.to_dense(), want)


def _flex_cases(n):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from flex_equivalents import cases

    return cases(n, B=2, H=3)


@pytest.mark.parametrize("k", range(len(_flex_cases(1024))))
def test_flex_mask_mod_equivalents_keep_the_same_pairs(k):
    n = 1024
    name, m, mod, (B, H) = _flex_cases(n)[k]
    dense = m.to_dense(n, n)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(n).view(1, 1, n, 1)
    kv = torch.arange(n).view(1, 1, 1, n)
    want = mod(b, h, q, kv).expand(B, H, n, n)
    assert torch.equal(dense.expand(B, H, n, n), want), name


# ------------------------------------------------------------------------------------------------
# attention: the CPU backend and the kernels (interpreter)
# ------------------------------------------------------------------------------------------------
def test_cpu_backend_padded_rows_are_zero_with_zero_gradients():
    lens = torch.tensor([33, 97])
    m = bsfa.causal() & bsfa.key_range(0, pb(lens)) & bsfa.query_range(0, pb(lens))
    q, k, v = (torch.randn(2, 2, 97, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = bsfa.attention(q, k, v, mask=m, block_size=16, backend="torch")
    ref = bsfa.reference_attention(q, k, v, m)
    assert rel_err(out, ref) < 1e-12
    do = torch.randn_like(out)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), do)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), do)
    for a, r in ((gq, rq), (gk, rk), (gv, rv)):
        assert rel_err(a, r) < 1e-12
    assert torch.isfinite(out).all()
    assert out[0, :, 33:].abs().max() == 0 and gq[0, :, 33:].abs().max() == 0
    assert gk[0, :, 33:].abs().max() == 0 and gv[0, :, 33:].abs().max() == 0


@pytest.mark.parametrize("name", ["natten_2d_tiles", "globals_anywhere", "chunk_band", "document_split_runs"])
def test_cpu_backend_matches_reference(name):
    m = CASES[name](83)
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64, requires_grad=True) for n in (61, 83, 83))
    out = bsfa.attention(q, k, v, mask=m, block_size=16, backend="torch")
    ref = bsfa.reference_attention(q, k, v, m)
    assert rel_err(out, ref) < 1e-12
    g = torch.autograd.grad(out.sum(), (q, k, v))
    r = torch.autograd.grad(ref.sum(), (q, k, v))
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(g, r))


@pytest.mark.interpreter
@pytest.mark.parametrize("name,mask,kw", [
    ("ranges, sets, chunk band", lambda: (bsfa.query_range(5, 40) & bsfa.key_range(20, 60)) |
     bsfa.key_set(torch.tensor([3, 50])) | bsfa.query_set(torch.tensor([0, 47])) | bsfa.chunk_band(9, 7, -1, 0),
     dict(Lq=48, Lk=67)),
    ("per batch and per head", lambda: bsfa.causal() & bsfa.sliding_window(ph([4, 30])) &
     bsfa.key_range(0, pb([40, 60])) & bsfa.query_range(0, pb([25, 60])), dict(B=2, Lq=60, Lk=60)),
    ("natten tiles | periodic", lambda: bsfa.neighborhood((6, 8), (3, 5), dilation=(2, 1), tile=(2, 4), start=3) |
     bsfa.periodic_window(11, 1) & bsfa.causal(), dict(Lq=57, Lk=57)),
    ("sta 3-d", lambda: bsfa.sliding_tiles((2, 6, 6), (1, 2, 3), (1, 3, 1)), dict(Lq=72, Lk=72)),
    # the periodic band as one unsigned compare: power-of-two and other periods, negative positions,
    # per-head widths and widths beyond the period (clamped, so the sums cannot wrap)
    ("periodic windows", lambda: bsfa.shift(bsfa.periodic_window(16, ph([0, 3])), pb([-21, 0])) & bsfa.causal() |
     bsfa.periodic_window(32, 2 ** 30) & bsfa.key_range(50, 53) | bsfa.periodic_window(13, 2 ** 31 - 1) &
     bsfa.query_range(7, 9) | bsfa.periodic_window(ph([6, 9]), 1) & bsfa.key_range(30, 45), dict(B=2, H=2, Lq=45, Lk=61)),
    ("mask_mod", lambda: bsfa.mask_mod(lambda b, h, q, kv: ((q + 2 * kv + h) % 3) != 0, H=2) & bsfa.window(20),
     dict(Lq=50, Lk=61)),
    ("shift per batch", lambda: bsfa.shift(bsfa.causal() & bsfa.sliding_window(9) | bsfa.periodic_window(7, 1),
                                           pb([-20, 0])) & bsfa.key_range(0, pb([40, 61])), dict(B=2, Lq=13, Lk=61)),
], ids=lambda x: x if isinstance(x, str) else "")
def test_kernels_in_the_interpreter(name, mask, kw):
    from test_triton_interpreter import _check

    _check(mask(), D=16, block=16, **kw)


def test_power_of_two_parameters_select_their_own_template():
    """A scalar power-of-two period, stride or chunk is masked, not divided; other values and
    per-head values keep the general helpers."""
    for m, pow2 in [(bsfa.periodic_window(16, 1), True), (bsfa.periodic_window(12, 1), False),
                    (bsfa.strided(8) | bsfa.summary(32, 2), True), (bsfa.chunked(16), True),
                    (bsfa.chunked(12), False), (bsfa.strided(ph([8, 16])), False)]:
        src = inspect.getsource(build_payload(compile_mask(m & bsfa.causal(), 120, 120, 16), "cpu").fn.fn)
        helpers = [h for h in ("periodic_keep(", "strided_keep(", "summary_keep(", "chunked_keep(") if h in src]
        assert bool(helpers) != pow2, (m, src)


@triton.jit
def _predicate_grid(OUT, PARAMS, AUX, q0, h, NQ: tl.constexpr, NK: tl.constexpr, PRED: tl.constexpr):
    qp = q0 + tl.arange(0, NQ)[:, None]
    kj = tl.arange(0, NK)[None, :]
    keep = PRED(qp, kj, qp, 0, h, PARAMS, AUX, False)
    tl.store(OUT + tl.arange(0, NQ)[:, None] * NK + kj, keep.to(tl.int8))


@pytest.mark.interpreter
@pytest.mark.parametrize("mask,rule", [
    (bsfa.window(ph([3, 2**31 - 1])) & bsfa.strided(3), lambda q, k, h: (abs(q - k) <= [3, 2**31 - 1][h]) & ((q - k) % 3 == 0)),
    (bsfa.window(0) | bsfa.sliding_window(ph([5, 2**31 - 1])) & bsfa.strided(5),
     lambda q, k, h: (q == k) | (q - k >= 0) & (q - k < [5, 2**31 - 1][h]) & ((q - k) % 5 == 0)),
    (bsfa.periodic_window(16, 2) | bsfa.chunked(8) | bsfa.summary(32, 3),
     lambda q, k, h: (abs(q % 16 - k % 16) <= 2) | (q >= 0) & (q // 8 == k // 8) | (k % 32 >= 29)),
])
def test_element_templates_at_negative_positions_and_huge_windows(mask, rule):
    """The unsigned and low-bit templates keep the primitive's rule for query positions below zero
    (shifted masks) and for windows up to the int32 limit."""
    pay = build_payload(compile_mask(mask, 64, 64, 16), "cpu")
    q, k = np.arange(-40, 24)[:, None], np.arange(64)[None, :]
    for h in (0, 1):
        out = torch.zeros(64, 64, dtype=torch.int8)
        _predicate_grid[(1,)](out, pay.params, pay.aux, -40, h, NQ=64, NK=64, PRED=pay.fn)
        assert np.array_equal(out.numpy().astype(bool), rule(q, k, h)), (mask, h)


@pytest.mark.interpreter
def test_power_of_two_templates_in_the_interpreter():
    """The masks of low bits agree with the reference for negative (shifted) query positions too."""
    from test_triton_interpreter import _check

    m = bsfa.shift(bsfa.periodic_window(16, 2) | bsfa.strided(8) | bsfa.summary(32, 3), -13) | bsfa.chunked(16)
    _check(m & bsfa.key_range(0, 70), D=16, block=16, Lq=57, Lk=70)


@pytest.mark.interpreter
def test_kernels_top_left_alignment():
    from test_triton_interpreter import _check

    m = bsfa.causal() & bsfa.sliding_window(9) | bsfa.document(_ids(37, n_docs=3))
    lay = compile_mask(m, 50, 37, 16, align="top_left")
    _check(lay, Lq=50, Lk=37, block=16, D=16)


# ------------------------------------------------------------------------------------------------
# the extended DSL against hostile input
# ------------------------------------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_TOKENS = ["shift", "neighborhood", "sliding_tiles", "key_range", "query_range", "key_set", "chunk_band",
           "periodic_window", "window", "causal", "mask_mod", "(", ")", ",", "=", "*", "//", "+", "-", "&", "|", "~",
           "0", "1", "3", "7", "64", "grid", "kernel", "tile", "offset", "t", "n", "f", " "]


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(_TOKENS), max_size=25))
def test_fuzz_extended_grammar(tokens):
    text = " ".join(tokens)
    env = dict(t=torch.tensor([1, 5]), n=4, f=lambda b, h, q, kv: q >= kv)
    try:
        m = bsfa.parse(text, **env)
    except (bsfa.MaskSyntaxError, ValueError):
        return
    assert bsfa.parse(str(m), **m.tensors()) == m


@pytest.mark.interpreter
@pytest.mark.parametrize("name", [n for n in CASES if n.startswith(("natten", "sta"))])
def test_grid_neighbourhoods_in_the_kernels(name):
    """Every grid shape (1-3 dims, dilation, tiles, STA, offsets) through the per-token tables of
    the kernels' predicate, against float64."""
    from test_triton_interpreter import _check

    m = CASES[name](96)
    n = max(m.n_tokens + m._params[4] for m in m.leaves() if m.name in ("neighborhood", "sliding_tiles")) + 5
    _check(m, Lq=n, Lk=n, D=16, block=16)


def test_grid_tables_chosen_and_fallback():
    """Raster grids without dilation compute key coordinates by multiply-high (no key gathers);
    other grids that fit the packing use the division-free tables; a grid extent of 2**15 or more
    keeps the coordinate arithmetic with divisions (each gives the mask's own element rule: the
    kernel tests above, which run both sides of the predicate)."""
    import inspect

    from blocksparse_fa.kernels.predicate import _grid_arith, _grid_tables, build_payload

    small = bsfa.neighborhood((10, 9), (3, 3), dilation=(3, 2), start=4)
    rows, keys, ks = _grid_tables(small)
    assert rows.shape == keys.shape == (2, 90) and ks == [3, 3]
    assert _grid_tables(bsfa.neighborhood(1 << 15, 5, dilation=2)) is None
    raster = bsfa.neighborhood((7, 13), (3, 5), start=9)
    aux = []
    assert _grid_arith(raster, lambda t: aux.append(t) or 0)[:2] == [9, 91] and aux[0].shape == aux[1].shape == (2, 91)
    for other in (small, bsfa.neighborhood((8, 12), 3, tile=(2, 4)), bsfa.sliding_tiles((8, 12), (2, 3), 3),
                  bsfa.neighborhood(1 << 15, 5)):
        assert _grid_arith(other, lambda t: 0) is None
    for m, helper in ((small, "grid_table_keep"), (bsfa.neighborhood(1 << 15, 5, dilation=2), "grid_keep"),
                      (raster, "grid_arith_keep"), (bsfa.neighborhood(1 << 15, 5), "grid_keep")):
        lay = compile_mask(m, 128, 128, 16)
        fn = build_payload(lay, "cpu").fn
        src = inspect.getsource(getattr(fn, "fn", fn))
        body = src[src.index("def predicate"):]
        assert f"{helper}(" in body and sum(f"{h}(" in body for h in ("grid_table_keep", "grid_keep",
                                                                       "grid_arith_keep")) == 1, body


@pytest.mark.parametrize("w", [2, 3, 7, 13, 91, 127, 128, 129, 4095, 1 << 20, (1 << 29) - 1, (1 << 31) - 1])
def test_magic_divisor_is_exact(w):
    """``umulhi(x, M) >> S == x // w`` for int32 offsets (all up to 2**20, the top 2**16 and a
    random sample), ``M`` unsigned 32-bit."""
    from blocksparse_fa.kernels.predicate import magic_divisor

    M, S = magic_divisor(w)
    assert 0 < M < 2 ** 32 and S >= 0
    x = np.concatenate([np.arange(1 << 20), (1 << 31) - 1 - np.arange(1 << 16),
                        np.random.default_rng(w).integers(0, 1 << 31, 1 << 18)]).astype(np.uint64)
    assert np.array_equal(((x * np.uint64(M)) >> np.uint64(32)) >> np.uint64(S), x // np.uint64(w))
    with pytest.raises(ValueError, match="w=1"):
        magic_divisor(1)