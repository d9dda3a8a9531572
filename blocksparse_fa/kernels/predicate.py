"""Element predicate for partial blocks: generated from the mask expression into a ``@triton.jit``
function that the kernels receive as a ``tl.constexpr``.

Only the expression's *structure* goes into the generated source (which primitives, combined
how); every integer parameter, length-dependent constant and tensor payload travels at run time in
two int32 buffers:

* ``PARAMS``: per primitive its integer parameters and payload offsets/strides. A parameter given
  per (batch, head) (``window(per_head(...))``) takes three slots (offset of its value table in
  PARAMS, batch stride, head stride) and is read as ``PARAMS[off + b * sb + h * sh]``; only
  *whether* a parameter is per-head/per-batch is structure;
* ``AUX``: concatenated payloads — document ids (int32), position bitsets, random/block-grid bits,
  dense-mask bits (32 per int32 word) and, for ``mask_mod``, the bits of its partial blocks with
  their index — read only while a partial block is being processed.

So changing a window size, a sequence length or document boundaries reuses the compiled kernel;
only a new expression structure generates (and compiles) a new predicate. The generated source is
built from fixed templates only — no user text is ever turned into code.

Generated signature: ``pred(qp, kj, i, b, h, PARAMS, AUX, KEY_SIDE) -> bool tensor`` where ``qp``
(absolute query positions) and ``i`` (query row indices) broadcast against ``kj`` (key positions);
the dK/dV loop calls it transposed (``qp`` as a row, ``kj`` as a column) with ``KEY_SIDE`` (a
constexpr) set: its keys stay fixed while the query blocks move, which templates that read a
per-position payload use to put the reads on the fixed side.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import os
import sys
import tempfile
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..compiler.classify import evaluate_blocks
from ..compiler.layout import BlockLayout
from ..compiler.simplify import predicate_mask
from ..mask.base import ParamTensor, Primitive, pack_bits
from ..mask.expr import And, Mask, Not, Or
from ..mask.shift import Shift

_lock = threading.Lock()
_functions: dict[str, object] = {}


def structure_key(mask: Mask, forms: dict | None = None) -> str:
    """The expression's shape without parameters, e.g. ``and(causal,or(window,global_tokens))``.
    ``forms`` maps ``id(leaf)`` to the template a leaf is generated with when it is not its name
    (``document_runs`` for documents that are contiguous runs)."""
    forms = forms or {}
    if isinstance(mask, (And, Or)):
        op = "and" if isinstance(mask, And) else "or"
        return f"{op}({','.join(structure_key(c, forms) for c in mask.children)})"
    if isinstance(mask, Not):
        return f"not({structure_key(mask.children[0], forms)})"
    if isinstance(mask, Shift):
        return f"shift{'[t]' if mask._own_batch_shape() else ''}({structure_key(mask.children[0], forms)})"
    return forms.get(id(mask), mask.name) + _flag_suffix(mask)


def _tensor_flags(leaf: Mask) -> tuple:
    """Which of a leaf's template parameters are per-(batch, head) (only primitives whose template
    parameters are their own parameters can have them)."""
    if isinstance(leaf, Primitive) and leaf.has_tensor_params:
        return tuple(isinstance(v, ParamTensor) for v in leaf._params)
    return ()


def _flag_suffix(leaf: Mask) -> str:
    flags = _tensor_flags(leaf)
    return "[" + "".join("t" if f else "s" for f in flags) + "]" if flags else ""


# ------------------------------------------------------------------------------------------------
# per-primitive templates: (number of PARAMS slots, expression template using {p0}, {p1}, ...)
# The templates see qp, kj, i, b, h (tensors/scalars), AUX, and their own loaded params.
# ------------------------------------------------------------------------------------------------
_TEMPLATES = {
    "full": (0, "qp == qp"),
    "causal": (0, "kj <= qp"),
    # one unsigned compare of kj - qp + w against 2w: modulo 2**32 a distance below -w lands above
    # 2w (exact for every int32 distance and window)
    "window": (1, "(kj - qp + {p0}).to(tl.uint32, bitcast=True) <= (2 * {p0}).to(tl.uint32, bitcast=True)"),
    # one unsigned compare: a negative distance lands above any window
    "sliding_window": (1, "(qp - kj).to(tl.uint32, bitcast=True) < {p0}.to(tl.uint32, bitcast=True)"),
    "global_tokens": (1, "(qp < {p0}) | (kj < {p0})"),
    "strided": (1, "strided_keep(qp, kj, {p0})"),
    "chunked": (1, "chunked_keep(qp, kj, {p0})"),
    "prefix_lm": (1, "(kj <= qp) | (kj < {p0})"),
    "summary": (2, "summary_keep(kj, {p0}, {p1})"),
    "chunk_band": (4, "chunk_band_keep(qp, kj, {p0}, {p1}, {p2}, {p3})"),
    "key_range": (2, "(kj >= {p0}) & (kj < {p1})"),
    "query_range": (2, "(qp >= {p0}) & (qp < {p1})"),
    "periodic_window": (2, "periodic_keep(qp, kj, {p0}, {p1})"),
    # the same with a scalar power-of-two period, stride or chunk: masks of the low bits, no branch
    # on the parameter (whose untaken division would still occupy registers in the loop)
    "strided_pow2": (1, "((qp - kj) & ({p0} - 1)) == 0"),
    "chunked_pow2": (1, "(qp >= 0) & ((qp ^ kj) < {p0})"),
    "summary_pow2": (2, "(kj & ({p0} - 1)) >= ({p0} - {p1})"),
    # |a - b| <= w as one unsigned compare of a - b + w against 2w (w clamped to the period, so
    # neither sum wraps past 2**32)
    "periodic_window_pow2": (2, "((kj & ({p0} - 1)) - (qp & ({p0} - 1)) + tl.minimum({p1}, {p0})).to(tl.uint32, "
                                "bitcast=True) <= (2 * tl.minimum({p1}, {p0})).to(tl.uint32, bitcast=True)"),
    # position bitsets: AUX[p0 + b * p1 + x // 32], p2 bits
    "key_set": (3, "bitset_keep(kj, AUX + {p0} + b * {p1}, {p2})"),
    "query_set": (3, "bitset_keep(qp, AUX + {p0} + b * {p1}, {p2})"),
    # grid neighbourhoods read their 30 parameters themselves, from PARAMS + {base}
    "neighborhood": (30, "grid_keep(qp, kj, PARAMS + {base})", "raw"),
    "sliding_tiles": (30, "grid_keep(qp, kj, PARAMS + {base})", "raw"),
    # the same through per-token tables (start, V, row table, key table, K per dim): no divisions
    **{f"grid_table{n}": (7, f"grid_table_keep(qp, kj, PARAMS + {{base}}, AUX, {n})", "raw") for n in range(4)},
    # raster order, no dilation: the seven table slots, then M, S, R per digit; coordinates by
    # multiply-high where keys move in the loop, the tables where query rows do
    **{f"grid_arith{n}": (7 + 3 * n, f"grid_arith_keep(qp, kj, PARAMS + {{base}}, AUX, {n}, KEY_SIDE)", "raw")
       for n in range(1, 4)},
    # mask_mod: bits of partial layout blocks; instance z = b * p0 + h * p1; per layout row
    # (cmin, count, base) at AUX[p2 + 3 * (z * p5 + r)], block index at AUX[p3 + base + c - cmin]
    # (-1 full, -2 empty), bits at AUX[p4 + idx * p6 * p10 + ...]; p7, p9 = log2 of p6, p8
    "mask_mod": (11, "partial_bits_keep(i, kj, b * {p0} + h * {p1}, AUX + {p2}, AUX + {p3}, AUX + {p4}, "
                     "{p5}, {p6}, {p7}, {p8}, {p9}, {p10})"),
    # ids at AUX[p0 + b * p1 + pos], length p2
    "document": (3, "(tl.load(AUX + {p0} + b * {p1} + qp, mask=(qp >= 0) & (qp < {p2}), other=-1) == "
                    "tl.load(AUX + {p0} + b * {p1} + kj, mask=(kj >= 0) & (kj < {p2}), other=-2)) & (qp >= 0)"),
    # documents that are each one contiguous run of positions: the run of position x is
    # [AUX[p0 + b * p1 + x], AUX[p2 + b * p1 + x]), length p3; no id gather on the loop's moving side
    "document_runs": (4, "doc_run_keep(qp, kj, AUX + {p0} + b * {p1}, AUX + {p2} + b * {p1}, {p3}, KEY_SIDE)"),
    # bit grid over absolute-position blocks of size p1 (log2 p5): word AUX[p0 + qb * p2 + kb // 32],
    # rows p3, cols p4, with qb = qp // p1, kb = kj // p1
    "random_blocks": (6, "((tl.load(AUX + {p0} + div_floor(tl.maximum(qp, 0), {p1}, {p5}) * {p2} + "
                         "div_floor(kj, {p1}, {p5}) // 32, mask=(qp >= 0) & (div_floor(tl.maximum(qp, 0), {p1}, {p5}) < {p3}) "
                         "& (div_floor(kj, {p1}, {p5}) < {p4}), other=0) >> (div_floor(kj, {p1}, {p5}) % 32)) & 1) != 0"),
    # bit grid over row-index blocks: AUX[p0 + b*p5 + h*p6 + (i//p1) * p2 + (kj//p1)//32], log2(p1) = p7
    "block_mask": (8, "((tl.load(AUX + {p0} + b * {p5} + h * {p6} + div_floor(i, {p1}, {p7}) * {p2} + "
                      "div_floor(kj, {p1}, {p7}) // 32, mask=(div_floor(i, {p1}, {p7}) < {p3}) & "
                      "(div_floor(kj, {p1}, {p7}) < {p4}) & (kj >= 0), other=0) >> (div_floor(kj, {p1}, {p7}) % 32)) & 1) != 0"),
    # dense bits: AUX[p0 + b*p3 + h*p4 + i * p1 + kj // 32], rows p2 (= q_len), cols p5 (= kv_len)
    "dense_mask": (6, "((tl.load(AUX + {p0} + b * {p3} + h * {p4} + i * {p1} + kj // 32, "
                      "mask=(i < {p2}) & (kj >= 0) & (kj < {p5}), other=0) >> (kj % 32)) & 1) != 0"),
}


_GATHER_2D = {"random_blocks", "block_mask", "dense_mask", "mask_mod"}


def _load_param(lines: list, slot: list, per_bh: bool) -> str:
    """Emit the load of the next parameter slot; a per-(batch, head) value reads its table."""
    var = f"p{slot[0]}"
    s0 = slot[0]
    if per_bh:  # table offset, batch stride, head stride
        lines.append(f"    {var} = tl.load(PARAMS + tl.load(PARAMS + {s0}) + b * tl.load(PARAMS + {s0 + 1}) "
                     f"+ h * tl.load(PARAMS + {s0 + 2}))")
        slot[0] += 3
    else:
        lines.append(f"    {var} = tl.load(PARAMS + {s0})")
        slot[0] += 1
    return var


def _emit(mask: Mask, lines: list, counter: list, slot: list, forms: dict, qp: str = "qp") -> str:
    if isinstance(mask, (And, Or)):
        op = " & " if isinstance(mask, And) else " | "
        return "(" + op.join(_emit(c, lines, counter, slot, forms, qp) for c in mask.children) + ")"
    if isinstance(mask, Not):
        return f"(~{_emit(mask.children[0], lines, counter, slot, forms, qp)})"
    if isinstance(mask, Shift):  # the operand sees query positions qp + offset
        d = _load_param(lines, slot, bool(mask._own_batch_shape()))
        var = f"q{counter[0]}"
        counter[0] += 1
        lines.append(f"    {var} = {qp} + {d}")
        return _emit(mask.children[0], lines, counter, slot, forms, var)
    n, tmpl, *raw = _TEMPLATES[forms.get(id(mask), mask.name)]
    names = {}
    if raw:  # the helper reads its own parameters
        names["base"] = str(slot[0])
        slot[0] += n
    flags = _tensor_flags(mask) or (False,) * n
    for k in range(0 if raw else n):
        names[f"p{k}"] = _load_param(lines, slot, flags[k])
    var = f"m{counter[0]}"
    counter[0] += 1
    expr = tmpl.format(**names)
    if qp != "qp":
        expr = re.sub(r"\bqp\b", qp, expr)
    lines.append(f"    {var} = {expr}")
    return var


def generate_source(mask: Mask, forms: dict | None = None) -> str:
    """Python source of the predicate module for this expression structure (``forms``: see
    :func:`structure_key`)."""
    lines: list[str] = []
    result = _emit(mask, lines, [0], [0], forms or {})
    body = "\n".join(lines)
    return (
        f'"""Generated by blocksparse_fa for the structure {structure_key(mask, forms)}."""\n'
        "import triton\nimport triton.language as tl\n"
        "from blocksparse_fa.kernels.predicate_ops import (bitset_keep, chunk_band_keep, chunked_keep, div_floor, "
        "doc_run_keep, grid_arith_keep, grid_keep, grid_table_keep, partial_bits_keep, periodic_keep, strided_keep, summary_keep)\n\n\n"
        "@triton.jit\n"
        "def predicate(qp, kj, i, b, h, PARAMS, AUX, KEY_SIDE: tl.constexpr):\n"
        f"{body}\n"
        f"    return {result}\n"
    )


def _cache_dir() -> str:
    d = os.environ.get("BSFA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")), "blocksparse_fa")
    try:
        os.makedirs(d, exist_ok=True)
        return d
    except OSError:
        d = os.path.join(tempfile.gettempdir(), "blocksparse_fa")
        os.makedirs(d, exist_ok=True)
        return d


def predicate_function(mask: Mask, forms: dict | None = None):
    """The ``@triton.jit`` predicate for this expression's structure (generated once per structure;
    ``forms``: see :func:`structure_key`)."""
    key = structure_key(mask, forms)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            src = generate_source(mask, forms)
            digest = hashlib.sha256(src.encode()).hexdigest()[:20]
            modname = f"bsfa_pred_{digest}"
            path = os.path.join(_cache_dir(), modname + ".py")
            if not os.path.exists(path) or open(path).read() != src:
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    f.write(src)
                os.replace(tmp, path)
            spec = importlib.util.spec_from_file_location(modname, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[modname] = mod
            spec.loader.exec_module(mod)
            fn = mod.predicate
            _functions[key] = fn
    return fn


# ------------------------------------------------------------------------------------------------
# run-time payload
# ------------------------------------------------------------------------------------------------
def _pack_bits(grid: np.ndarray) -> np.ndarray:
    """bool (..., R, C) -> int32 (..., R, ceil(C/32)), bit c%32 of word c//32 (in row chunks)."""
    return pack_bits(torch.from_numpy(np.ascontiguousarray(grid))).numpy()


def _document_runs(ids: np.ndarray):
    """``(start, end)`` int arrays ``(B, L)``: the run ``[start, end)`` of positions holding each
    position's document, when every document of every batch row is one contiguous run; else None."""
    bsz, n = ids.shape
    change = np.ones((bsz, n), dtype=bool)
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    for row, ch in zip(ids, change):
        if len(np.unique(row)) != int(ch.sum()):
            return None  # some document is split into several runs
    pos = np.broadcast_to(np.arange(n), (bsz, n))
    start = np.maximum.accumulate(np.where(change, pos, 0), axis=1)
    last = np.ones((bsz, n), dtype=bool)
    last[:, :-1] = change[:, 1:]
    end = np.minimum.accumulate(np.where(last, pos + 1, n)[:, ::-1], axis=1)[:, ::-1]
    return start, np.ascontiguousarray(end)


def _log2_or_minus1(x: int) -> int:
    return x.bit_length() - 1 if x & (x - 1) == 0 else -1


# primitives whose template parameters are their own parameters (these may be per-(batch, head))
_SIMPLE = {"window", "sliding_window", "global_tokens", "strided", "chunked", "prefix_lm", "summary", "chunk_band",
           "key_range", "query_range", "periodic_window"}


# primitives whose first parameter, a scalar power of two, selects their ``_pow2`` template
_POW2_FORMS = {"strided", "chunked", "summary", "periodic_window"}


def _scalar_power_of_two(v) -> bool:
    return not isinstance(v, ParamTensor) and int(v) > 0 and int(v) & (int(v) - 1) == 0


def _payload_nodes(mask: Mask):
    """Leaves and ``shift`` nodes in the order :func:`_emit` assigns their parameter slots."""
    if isinstance(mask, Shift):
        yield mask
    if not mask.children:
        yield mask
    for c in mask.children:
        yield from _payload_nodes(c)


def _resolve_slots(slots: list) -> list:
    """PARAMS: scalar slots, and for each per-(batch, head) value ``(table offset, batch stride,
    head stride)`` with its table appended after the slots."""
    params: list = []
    tables = []
    for v in slots:
        if isinstance(v, ParamTensor):
            bp, hp = v.t.shape
            tables.append((len(params), v.t))
            params.extend([0, hp if bp > 1 else 0, 1 if hp > 1 else 0])
        else:
            params.append(int(v))
    for pos, t in tables:
        params[pos] = len(params)
        params.extend(int(x) for x in t.reshape(-1).tolist())
    return params


def _grid_params(leaf) -> list:
    """The 30 parameters ``grid_keep`` reads: start, V, tile volume, then per dim (3, padded)
    ``G, K, D`` and the coordinate map ``((x // tv // A) % N) * M + ((x % tv // C) % T) * E``."""
    grid, kernel, dilation, tile, start = leaf._params
    n = len(grid)
    sta = leaf.STA
    out = [start, int(np.prod(grid)), int(np.prod(tile)) if tile else 1]
    for d in range(3):
        if d >= n:
            out.extend([1, 1, 1, 1, 1, 0, 1, 1, 0])
            continue
        if tile:
            ntiles = [g // t for g, t in zip(grid, tile)]
            a = int(np.prod(ntiles[d + 1:]))
            c = int(np.prod(tile[d + 1:]))
            G = ntiles[d] if sta else grid[d]
            out.extend([G, kernel[d], dilation[d], a, ntiles[d], 1 if sta else tile[d], c, tile[d], 0 if sta else 1])
        else:
            out.extend([grid[d], kernel[d], dilation[d], int(np.prod(grid[d + 1:])), grid[d], 1, 1, 1, 0])
    return out


_GRID_TABLE_MAX_WORDS = 1 << 28


def magic_divisor(w: int, n_max: int = 1 << 31) -> tuple[int, int]:
    """``(M, S)`` with ``x // w == (x * M) >> (32 + S)`` (``M`` unsigned 32-bit: a multiply-high
    and a shift) for every integer ``0 <= x < n_max <= 2**31``, ``w >= 2``: with ``l =
    ceil(log2 w)``, ``M = ceil(2**(31 + l) / w)`` (below ``2**32``) and ``S = l − 1``. Then ``M·w −
    2**(31 + l) < w``, so ``x·M / 2**(31 + l)`` stays below the next multiple of ``1/w`` above
    ``x / w`` for ``x < 2**31`` (Granlund and Montgomery, 1994)."""
    if w < 2 or not 1 <= n_max <= 1 << 31:
        raise ValueError(f"magic_divisor(w={w}, n_max={n_max}): expected w >= 2 and 1 <= n_max <= 2**31")
    l = (w - 1).bit_length()
    return -(-(1 << (31 + l)) // w), l - 1


def _grid_arith(leaf, add_aux):
    """Parameters of ``grid_arith_keep`` for a raster-order neighbourhood without dilation
    (``grid_table_keep``'s seven, its tables added with ``add_aux``, then ``(M, S, R)`` per
    digit), or None for tile orders, dilations, STA and grids the tables do not fit
    (:func:`_grid_tables`)."""
    geo = leaf.geometry
    tile, start = leaf._params[3], leaf._params[4]
    if leaf.name != "neighborhood" or tile or any(d != 1 for d in geo.D) or any(m != 1 for m in geo.mults.tolist()):
        return None
    tables = _grid_tables(leaf)  # also bounds V (int32 offsets)
    if tables is None:
        return None
    rows, keys, ks = tables
    out = [int(start), geo.V, add_aux(rows), add_aux(keys)] + ks + [1] * (3 - len(ks))
    for r, w in zip(geo.radices.tolist(), geo.weights.tolist()):
        M, S = magic_divisor(int(w)) if w > 1 else (0, 0)  # the last digit (weight 1) reads x itself
        out.extend([M - (1 << 32) if M >= 1 << 31 else M, S, int(r)])  # M as int32 bits
    return out


def _grid_tables(leaf):
    """Per-token tables of ``grid_table_keep`` for a neighbourhood (``(rows, keys, K per active
    dim)``, tables ``(n_active, V)`` int32), or None where the packing does not hold (a grid extent
    of 2**15 or more, a dilation of 2**14 or more, tables over ``_GRID_TABLE_MAX_WORDS``): those
    grids keep the coordinate arithmetic of ``grid_keep``."""
    geo = leaf.geometry
    active = [d for d in range(geo.ndim) if geo.G[d] > 1]
    if (any(geo.G[d] >= 1 << 15 or geo.D[d] >= 1 << 14 for d in active)
            or 2 * len(active) * geo.V > _GRID_TABLE_MAX_WORDS):
        return None
    coords = geo.coords(np.arange(geo.V, dtype=np.int64))
    rows = np.empty((len(active), geo.V), np.int64)
    keys = np.empty((len(active), geo.V), np.int64)
    for t, d in enumerate(active):
        g, s = geo.window_start(coords[d], geo.G[d], geo.K[d], geo.D[d])
        rows[t] = (g << 16) | s
        keys[t] = (g << 16) | (coords[d] // geo.D[d])
    return rows, keys, [int(geo.K[d]) for d in active]


def _mask_mod_params(leaf, layout: BlockLayout, add_aux) -> list:
    """Bits of ``mask_mod`` on the layout's masked blocks (evaluated here, one bit per element of
    the partial ones) and the per-row index the predicate looks them up in."""
    g, segs = layout._grid, layout._segs
    rows, cols, st = segs.blocks(nonempty=True)
    masked = st != 2
    if g.kv_len % g.bn:
        masked |= cols == g.tc - 1
    if g.q_len % g.bm:
        masked |= rows % g.tr == g.tr - 1
    rows, cols = rows[masked], cols[masked]
    Bl, Hl = segs.batch_shape
    Bo, Ho = leaf.batch_shape or (1, 1)
    z = rows // g.tr
    zo = np.where(Bo > 1, z // Hl, 0) * Ho + np.where(Ho > 1, z % Hl, 0)
    key = np.unique((zo * g.tr + rows % g.tr) * g.tc + cols)
    orow, ocol = key // g.tc, key % g.tc  # orow = zo * tr + r, sorted by (row, col)
    states, words = evaluate_blocks(leaf, g, orow, ocol, (Bo, Ho), bits=True)
    part = states == 1
    idx = np.where(part, np.cumsum(part) - 1, np.where(states == 2, -1, -2)).astype(np.int64)
    n_rows = Bo * Ho * g.tr
    first = np.searchsorted(orow, np.arange(n_rows), side="left")
    last = np.searchsorted(orow, np.arange(n_rows), side="right")
    has = last > first
    if len(ocol):
        cmin = np.where(has, ocol[np.minimum(first, len(ocol) - 1)], 0)
        cmax = np.where(has, ocol[np.maximum(last - 1, 0)], -1)
    else:
        cmin, cmax = np.zeros(n_rows, np.int64), np.full(n_rows, -1, np.int64)
    count = np.where(has, cmax - cmin + 1, 0)
    base = np.cumsum(count) - count
    table = np.full(max(1, int(count.sum())), -2, np.int64)  # never empty: the kernel reads entry 0
    table[base[orow] + ocol - cmin[orow]] = idx
    rows_tab = np.stack([cmin, count, base], 1)
    # never empty: the kernel reads block 0 when a tile has no stored bits
    bits = words[torch.from_numpy(part)].numpy() if part.any() else np.zeros((1, g.bm, -(-g.bn // 32)), np.int32)
    return [Ho if Bo > 1 else 0, 1 if Ho > 1 else 0, add_aux(rows_tab), add_aux(table), add_aux(bits), g.tr,
            g.bm, _log2_or_minus1(g.bm), g.bn, _log2_or_minus1(g.bn), bits.shape[-1]]


@dataclass
class Payload:
    """Run-time arguments of a predicate: ``PARAMS`` and ``AUX`` int32 device tensors."""

    fn: object
    params: torch.Tensor
    aux: torch.Tensor
    gathers: bool  # the predicate gathers a (BLOCK_M, BLOCK_N) tile of words: don't pipeline it


def build_payload(layout: BlockLayout, device, document_runs: bool = True) -> Payload:
    """Predicate, parameters and payload buffers for ``layout.mask`` at the layout's lengths.

    ``document_runs``: evaluate ``document`` from its run bounds when every document is one
    contiguous run (the ``document_runs`` kernel option), else compare ids.

    The predicate is generated for the mask simplified against the blocks where it is evaluated
    (:func:`blocksparse_fa.compiler.simplify.predicate_mask`): primitives constant on every masked
    block (e.g. BigBird's block-aligned random and global terms) cost nothing per element.
    """
    if getattr(layout, "diagonals", None) is not None:  # distance masks: nothing to drop, no segments to expand
        pmask = layout.mask
    else:
        pmask = predicate_mask(layout.mask, layout._segs, layout._grid)
    params: list[int] = []
    aux: list[np.ndarray] = []
    aux_len = [0]

    def add_aux(arr: np.ndarray) -> int:
        off = aux_len[0]
        flat = np.ascontiguousarray(arr, dtype=np.int32).reshape(-1)
        aux.append(flat)
        aux_len[0] += len(flat)
        return off

    q_len, kv_len = layout.q_len, layout.kv_len
    forms: dict = {}
    slots: list = []  # ints, or ParamTensor for per-(batch, head) values
    for leaf in _payload_nodes(pmask):
        if isinstance(leaf, Shift):
            slots.append(leaf._offset)
            continue
        name = leaf.name
        if name in ("full", "causal"):
            continue
        if name in _SIMPLE:
            if name in _POW2_FORMS and _scalar_power_of_two(leaf._params[0]):
                forms[id(leaf)] = name + "_pow2"
            slots.extend(leaf._params)
        elif name == "document":
            ids = leaf.host_ids()
            runs = _document_runs(ids) if document_runs else None
            if runs is not None:  # each document one run: compare positions with the run's bounds
                forms[id(leaf)] = "document_runs"
                start, end = runs
                slots.extend([add_aux(start), ids.shape[1] if ids.shape[0] > 1 else 0, add_aux(end), ids.shape[1]])
            else:
                off = add_aux(ids)
                slots.extend([off, ids.shape[1] if ids.shape[0] > 1 else 0, ids.shape[1]])
        elif name in ("key_set", "query_set"):
            bits = leaf.bits().numpy()  # (B, W)
            slots.extend([add_aux(bits), bits.shape[1] if bits.shape[0] > 1 else 0, bits.shape[1] * 32])
        elif name in ("neighborhood", "sliding_tiles"):
            arith = _grid_arith(leaf, add_aux)
            tables = None if arith is not None else _grid_tables(leaf)
            if arith is not None:  # no key gathers in the loops
                forms[id(leaf)] = f"grid_arith{(len(arith) - 7) // 3}"
                slots.extend(arith)
            elif tables is None:
                slots.extend(_grid_params(leaf))
            else:
                rows, keys, ks = tables
                forms[id(leaf)] = f"grid_table{len(ks)}"
                slots.extend([leaf._params[4], leaf.geometry.V, add_aux(rows), add_aux(keys)] + ks + [1] * (3 - len(ks)))
        elif name == "random_blocks":
            bs = leaf.block_size
            n_kb = -(-kv_len // bs)
            grid = np.zeros((n_kb, n_kb), dtype=bool)
            if leaf.r:
                ch = leaf.chosen(np.arange(n_kb), n_kb)
                np.put_along_axis(grid, ch, True, axis=1)
            bits = _pack_bits(grid)
            slots.extend([add_aux(bits), bs, bits.shape[-1], n_kb, n_kb, _log2_or_minus1(bs)])
        elif name == "block_mask":
            bits = leaf.tensor.numpy()  # stored bit-packed: (B, H, R, W)
            bb, hh, rr, ww = bits.shape
            slots.extend([add_aux(bits), leaf.block_size, ww, rr, leaf.n_cols,
                           hh * rr * ww if bb > 1 else 0, rr * ww if hh > 1 else 0, _log2_or_minus1(leaf.block_size)])
        elif name == "dense_mask":
            bits = leaf.tensor.numpy()  # stored bit-packed: (B, H, Lq, W)
            bb, hh, rr, ww = bits.shape
            slots.extend([add_aux(bits), ww, q_len, hh * rr * ww if bb > 1 else 0, rr * ww if hh > 1 else 0, kv_len])
        elif name == "mask_mod":
            slots.extend(_mask_mod_params(leaf, layout, add_aux))
        else:  # pragma: no cover - every primitive has a template
            raise NotImplementedError(name)
    if aux_len[0] >= 2**31:
        raise ValueError("mask payload exceeds 2**31 int32 words")
    params = _resolve_slots(slots)
    params_t = torch.tensor(params or [0], dtype=torch.int32, device=device)
    aux_t = torch.from_numpy(np.concatenate(aux) if aux else np.zeros(1, np.int32)).to(device)
    gathers = any(leaf.name in _GATHER_2D for leaf in pmask.leaves())
    return Payload(predicate_function(pmask, forms), params_t, aux_t, gathers)
