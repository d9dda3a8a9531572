"""Element predicate for partial blocks: generated from the mask expression into a ``@triton.jit``
function that the kernels receive as a ``tl.constexpr``.

Only the expression's *structure* goes into the generated source (which primitives, combined
how); every integer parameter, length-dependent constant and tensor payload travels at run time in
two int32 buffers:

* ``PARAMS``: per primitive its integer parameters and payload offsets/strides;
* ``AUX``: concatenated payloads — document ids (int32), random/block-grid bits and dense-mask bits
  (32 per int32 word), read only while a partial block is being processed.

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
import os
import sys
import tempfile
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..compiler.layout import BlockLayout
from ..compiler.simplify import predicate_mask
from ..mask.expr import And, Mask, Not, Or

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
    return forms.get(id(mask), mask.name)


# ------------------------------------------------------------------------------------------------
# per-primitive templates: (number of PARAMS slots, expression template using {p0}, {p1}, ...)
# The templates see qp, kj, i, b, h (tensors/scalars), AUX, and their own loaded params.
# ------------------------------------------------------------------------------------------------
_TEMPLATES = {
    "full": (0, "qp == qp"),
    "causal": (0, "kj <= qp"),
    "window": (1, "tl.abs(qp - kj) <= {p0}"),
    "sliding_window": (1, "((qp - kj) >= 0) & ((qp - kj) < {p0})"),
    "global_tokens": (1, "(qp < {p0}) | (kj < {p0})"),
    "strided": (1, "strided_keep(qp, kj, {p0})"),
    "chunked": (1, "chunked_keep(qp, kj, {p0})"),
    "prefix_lm": (1, "(kj <= qp) | (kj < {p0})"),
    "summary": (2, "summary_keep(kj, {p0}, {p1})"),
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


_GATHER_2D = {"random_blocks", "block_mask", "dense_mask"}


def _emit(mask: Mask, lines: list, counter: list, slot: list, forms: dict) -> str:
    if isinstance(mask, (And, Or)):
        op = " & " if isinstance(mask, And) else " | "
        return "(" + op.join(_emit(c, lines, counter, slot, forms) for c in mask.children) + ")"
    if isinstance(mask, Not):
        return f"(~{_emit(mask.children[0], lines, counter, slot, forms)})"
    n, tmpl = _TEMPLATES[forms.get(id(mask), mask.name)]
    names = {}
    for k in range(n):
        var = f"p{slot[0]}"
        lines.append(f"    {var} = tl.load(PARAMS + {slot[0]})")
        names[f"p{k}"] = var
        slot[0] += 1
    var = f"m{counter[0]}"
    counter[0] += 1
    lines.append(f"    {var} = {tmpl.format(**names)}")
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
        "from blocksparse_fa.kernels.predicate_ops import chunked_keep, div_floor, doc_run_keep, strided_keep, summary_keep\n\n\n"
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
    """bool (..., R, C) -> int32 (..., R, ceil(C/32)), bit c%32 of word c//32."""
    *lead, r, c = grid.shape
    w = -(-c // 32)
    padded = np.zeros((*lead, r, w * 32), dtype=bool)
    padded[..., :c] = grid
    bits = padded.reshape(*lead, r, w, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return bits.sum(-1).astype(np.uint32).view(np.int32)


_DOCUMENT_RUNS = {"on": True}


def set_document_runs(on: bool) -> None:
    """Use the run-bounds form of ``document`` when every document is one run (default) or always
    compare ids (benchmarks compare both). Applies to payloads built afterwards."""
    _DOCUMENT_RUNS["on"] = bool(on)


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


@dataclass
class Payload:
    """Run-time arguments of a predicate: ``PARAMS`` and ``AUX`` int32 device tensors."""

    fn: object
    params: torch.Tensor
    aux: torch.Tensor
    gathers: bool  # the predicate gathers a (BLOCK_M, BLOCK_N) tile of words: don't pipeline it


def build_payload(layout: BlockLayout, device) -> Payload:
    """Predicate, parameters and payload buffers for ``layout.mask`` at the layout's lengths.

    The predicate is generated for the mask simplified against the blocks where it is evaluated
    (:func:`blocksparse_fa.compiler.simplify.predicate_mask`): primitives constant on every masked
    block (e.g. BigBird's block-aligned random and global terms) cost nothing per element.
    """
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
    for leaf in pmask.leaves():
        name = leaf.name
        if name in ("full", "causal"):
            continue
        if name in ("window", "sliding_window", "global_tokens", "strided", "chunked", "prefix_lm"):
            params.append(leaf._params[0])
        elif name == "summary":
            params.extend(leaf._params)
        elif name == "document":
            ids = leaf.ids.detach().to("cpu").long().numpy()
            runs = _document_runs(ids) if _DOCUMENT_RUNS["on"] else None
            if runs is not None:  # each document one run: compare positions with the run's bounds
                forms[id(leaf)] = "document_runs"
                start, end = runs
                params.extend([add_aux(start), ids.shape[1] if ids.shape[0] > 1 else 0, add_aux(end), ids.shape[1]])
            else:
                off = add_aux(ids)
                params.extend([off, ids.shape[1] if ids.shape[0] > 1 else 0, ids.shape[1]])
        elif name == "random_blocks":
            bs = leaf.block_size
            n_kb = -(-kv_len // bs)
            grid = np.zeros((n_kb, n_kb), dtype=bool)
            if leaf.r:
                ch = leaf.chosen(np.arange(n_kb), n_kb)
                np.put_along_axis(grid, ch, True, axis=1)
            bits = _pack_bits(grid)
            params.extend([add_aux(bits), bs, bits.shape[-1], n_kb, n_kb, _log2_or_minus1(bs)])
        elif name == "block_mask":
            t = leaf.tensor.detach().to("cpu").numpy()
            bits = _pack_bits(t)  # (B, H, R, W)
            bb, hh, rr, ww = bits.shape
            params.extend([add_aux(bits), leaf.block_size, ww, rr, t.shape[-1],
                           hh * rr * ww if bb > 1 else 0, rr * ww if hh > 1 else 0, _log2_or_minus1(leaf.block_size)])
        elif name == "dense_mask":
            t = leaf.tensor.detach().to("cpu").numpy()
            bits = _pack_bits(t)
            bb, hh, rr, ww = bits.shape
            params.extend([add_aux(bits), ww, q_len, hh * rr * ww if bb > 1 else 0, rr * ww if hh > 1 else 0, kv_len])
        else:  # pragma: no cover - every primitive has a template
            raise NotImplementedError(name)
    if aux_len[0] >= 2**31:
        raise ValueError("mask payload exceeds 2**31 int32 words")
    params_t = torch.tensor(params or [0], dtype=torch.int32, device=device)
    aux_t = torch.from_numpy(np.concatenate(aux) if aux else np.zeros(1, np.int32)).to(device)
    gathers = any(leaf.name in _GATHER_2D for leaf in pmask.leaves())
    return Payload(predicate_function(pmask, forms), params_t, aux_t, gathers)
