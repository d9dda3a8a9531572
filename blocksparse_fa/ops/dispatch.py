"""One execution path for every entry point: attention forward and backward over a compiled layout.

:func:`blocksparse_fa.attention` (eager, through :class:`_Attention`), the ``torch.library`` custom
op (``ops/custom_op.py``, under ``torch.compile``), the ``nn`` modules and the transformers hook all
end in :func:`forward` and :func:`backward`. They choose, from the compiled layout alone:

* the Triton kernels or the exact PyTorch backend (``backend``, resolved by the caller);
* the layout's exact rewrite (``BlockLayout.rewrite``: the strided pattern as a band plus residue
  classes) when there is no dropout: on Triton through strided views of q/k/v (``ops/residue.py``),
  otherwise through permuted copies of each part, merged exactly through the logsumexps.

The backward of a rewritten mask runs each part's recompute backward with the *merged* output and
logsumexp: for disjoint key sets ``dS = P ∘ (dP − delta)`` with ``P`` from the merged logsumexp and
``delta = rowsum(dO ∘ O)`` of the merged output, so each part yields its share of dQ and all of
dK/dV for its keys.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from ..compiler.layout import BlockLayout
from ..compiler.rewrite import residue_permutation
from . import call_memo, select
from .options import DEFAULT_OPTIONS, KernelOptions
from .validate import Shapes, check_differentiable_backward, lse_dtype, without_autocast

__all__ = ["forward", "backward", "apply", "lse_dtype", "last_backend", "note_backend", "score_grad_buffers",
           "pad_head_dims", "slice_head_dim"]

_last = threading.local()


def note_backend(name: str) -> None:
    """Record the backend an eager call ran (per thread), for :func:`last_backend`."""
    _last.name = name


def last_backend() -> str | None:
    """The backend the last eager attention call of this thread ran: ``"triton"`` (the kernels),
    ``"torch"`` (exact block walking in PyTorch) or ``"dense"`` (PyTorch's SDPA over the
    materialised mask, chosen by ``backend="auto"`` on CPU); ``None`` before the first call."""
    return getattr(_last, "name", None)


def pad_head_dims(q, k, v):
    """``(q, k, v, dv)`` with one head dim for all three: when v's head dim ``Dv`` differs from q's and
    k's ``D``, the smaller side is zero-padded to the larger (q and k to ``Dv``: their dot products do
    not change; v to ``D``: the output's extra columns are zeros) and ``dv = Dv`` says how many
    output columns to keep (:func:`slice_head_dim`); ``dv = None`` when the dims agree. Gradients
    flow through the padding (autograd slices them back). The kernels then work at ``max(D, Dv)``:
    ``|D - Dv| / min(D, Dv)`` more head-dim work in one of the two products, and a padded copy of
    the smaller tensors. The softmax scale must be taken from the unpadded ``D``."""
    D, Dv = q.shape[-1], v.shape[-1]
    if D == Dv:
        return q, k, v, None
    pad = torch.nn.functional.pad
    if Dv > D:
        return pad(q, (0, Dv - D)), pad(k, (0, Dv - D)), v, Dv
    return q, k, pad(v, (0, D - Dv)), Dv


def slice_head_dim(out, dv):
    """The output's first ``dv`` head-dim columns (see :func:`pad_head_dims`), contiguous."""
    return out if dv is None or out.shape[-1] == dv else out[..., :dv].contiguous()


def _rewrite(layout: BlockLayout, dropout_p: float, use_rewrite: bool, score_mod=None):
    """The layout's rewrite when it applies: without dropout and without a score modifier (the
    residue-class parts reorder rows and keys, which position-dependent modifiers would see)."""
    rw = layout.rewrite
    return rw if (rw is not None and use_rewrite and dropout_p == 0.0 and score_mod is None) else None


def _global_split(q, k, v, layout: BlockLayout, s: Shapes, dropout_p: float, backend: str, use_rewrite: bool,
                  score_mod, opts: KernelOptions, partial_dtypes: bool = False, phase: str = "forward"):
    """The layout's :class:`~blocksparse_fa.compiler.globals.GlobalSplit` where the call's
    ``phase`` (``"forward"``/``"backward"``) runs it (``select.choose_global_split``), else None."""
    if backend != "triton" or not use_rewrite or opts.global_split is False or layout.rewrite is not None:
        return None
    if layout.cache.get("global_split", False) is None:  # known not to split: the common case, no imports
        return None
    from ..compiler.compile import compile_mask
    from ..compiler.globals import global_split
    from .globals import _fold_global_keys
    from .triton_backend import forward_choice

    gs = global_split(layout, compile_mask)
    if gs is None:
        return None
    key = ("global_split_choice", phase, s, q.dtype, q.device, opts, dropout_p > 0.0, score_mod is not None,
           partial_dtypes, select.tma_ok(q, k, v))
    ok = layout.cache.get(key)
    if ok is None:
        band = forward_choice(q, k, v, gs.band, s, 0.0, opts)
        folds = _fold_global_keys(q, k, v, gs, s, opts) is not None
        if phase == "forward":
            whole = forward_choice(q, k, v, layout, s, 0.0, opts)
        else:
            whole = select.choose_backward(select.layout_class(layout), s, q.dtype, select.hardware(q.device), opts,
                                           tma=select.tma_ok(q, k, v))
        ok = layout.cache[key] = select.choose_global_split(
            band, s, q.dtype, opts, n_global=gs.g, long_rows=gs.rows is not None or gs.rows_full,
            dropout=dropout_p > 0.0, score_mod=score_mod is not None, partial_dtypes=partial_dtypes, phase=phase,
            folds=folds, whole=whole)
    return gs if ok else None


def _may_split(name: str, option, layout: BlockLayout, backend: str, use_rewrite: bool, device) -> bool:
    """Whether the split ``name`` (kernel option value ``option``) may apply: the Triton backend,
    rewrites allowed, a layout that is not rewritten and not known not to split (the common case:
    no imports), and, by default, a device with the Gluon kernels (elsewhere the parts are not
    compiled)."""
    return (backend == "triton" and use_rewrite and option is not False and layout.rewrite is None
            and layout.cache.get(name, False) is not None
            and not (option is None and select.hardware(device).gluon))


def _chosen_split(layout: BlockLayout, key, build, decide):
    """``build()`` (a split cached on the layout) where ``decide(split)`` takes it, else None; the
    decision is cached in ``layout.cache[key]``, and a known refusal builds nothing."""
    ok = layout.cache.get(key)
    if ok is False:
        return None
    split = build()
    if split is None:
        return None
    if ok is None:
        ok = layout.cache[key] = decide(split)
    return split if ok else None


def _run_split(q, k, v, layout: BlockLayout, s: Shapes, dropout_p: float, backend: str, use_rewrite: bool,
               score_mod, opts: KernelOptions, partial_dtypes: bool = False, phase: str = "forward"):
    """The layout's :class:`~blocksparse_fa.compiler.runs.RunSplit` where the call's ``phase``
    (``"forward"``/``"backward"``) runs it (``select.choose_run_split``), else None."""
    if not _may_split("run_split", opts.run_split, layout, backend, use_rewrite, q.device):
        return None
    from ..compiler.compile import compile_mask
    from ..compiler.runs import run_split

    def decide(rs):
        if phase == "forward":
            from .triton_backend import forward_choice

            first, second = (forward_choice(q, k, v, part, s, 0.0, opts) for part in (rs.first, rs.second))
        else:
            from .triton_backend import backward_choice

            first, second = (backward_choice(q, k, v, q, part, s, 0.0, opts) for part in (rs.first, rs.second))
        return select.choose_run_split(first, second, q.dtype, opts, mean_keys=rs.mean_keys, dropout=dropout_p > 0.0,
                                       score_mod=score_mod is not None, partial_dtypes=partial_dtypes)

    key = ("run_split_choice", phase, s, q.dtype, q.device, opts, dropout_p > 0.0, score_mod is not None,
           partial_dtypes, select.tma_ok(q, k, v))
    return _chosen_split(layout, key, lambda: run_split(layout, compile_mask), decide)


def _set_split(q, k, v, layout: BlockLayout, s: Shapes, dropout_p: float, backend: str, use_rewrite: bool,
               score_mod, opts: KernelOptions, partial_dtypes: bool = False, phase: str = "forward"):
    """The layout's :class:`~blocksparse_fa.compiler.sets.SetSplit` where the call's ``phase``
    (``"forward"``/``"backward"``) runs it (``select.choose_set_split``), else None."""
    if not _may_split("set_split", opts.set_split, layout, backend, use_rewrite, q.device):
        return None
    from ..compiler.compile import compile_mask
    from ..compiler.sets import set_split

    def decide(ss):
        from .triton_backend import backward_choice, forward_choice

        band = (forward_choice(q, k, v, ss.band, s, 0.0, opts) if phase == "forward" else
                backward_choice(q, k, v, q, ss.band, s, 0.0, opts))
        return select.choose_set_split(band, q.dtype, opts, phase=phase, dropout=dropout_p > 0.0,
                                       score_mod=score_mod is not None, partial_dtypes=partial_dtypes)

    key = ("set_split_choice", phase, s, q.dtype, q.device, opts, dropout_p > 0.0, score_mod is not None,
           partial_dtypes, select.tma_ok(q, k, v))
    return _chosen_split(layout, key, lambda: set_split(layout, compile_mask), decide)


def _residue_ok(rw, s: Shapes, dtype: torch.dtype, opts: KernelOptions) -> bool:
    from .residue import residue_applies

    return rw.cls is not None and residue_applies(rw, s, dtype, opts.residue_gqa)


# ------------------------------------------------------------------------------------------------
# single layout, per backend
# ------------------------------------------------------------------------------------------------
def _fwd_one(q, k, v, layout, s, scale, dropout_p, seed, backend, out_dtype=None, score_mod=None,
             opts: KernelOptions = DEFAULT_OPTIONS):
    if backend == "triton":
        from .triton_backend import triton_forward

        out, lse = triton_forward(q, k, v, layout, s, scale, dropout_p, seed, out_dtype=out_dtype,
                                  score_mod=score_mod, opts=opts)
        return out, lse
    from .torch_backend import torch_forward

    select.note("forward", "torch:blocks")
    return torch_forward(q, k, v, layout, s, scale, dropout_p, seed, score_mod=score_mod)


def _bwd_one(q, k, v, out, lse, dout, layout, s, scale, dropout_p, seed, backend, dlse, grad_dtype=None,
             score_mod=None, score_grads=None, opts: KernelOptions = DEFAULT_OPTIONS):
    if backend == "triton":
        from .triton_backend import triton_backward

        return triton_backward(q, k, v, out, lse, dout, layout, s, scale, dropout_p, seed, dlse=dlse,
                               grad_dtype=grad_dtype, score_mod=score_mod, score_grads=score_grads, opts=opts)
    from .torch_backend import torch_backward

    select.note("backward", "torch:blocks")
    return torch_backward(q, k, v, out, lse, dout, layout, s, scale, dropout_p, seed, dlse, score_mod=score_mod,
                          score_grads=score_grads or (None, None))


# ------------------------------------------------------------------------------------------------
# rewritten masks through permuted copies (any backend)
# ------------------------------------------------------------------------------------------------
def _part_layouts(rw, s: Shapes, device, n: int):
    """``[(layout, perm, inv) per part]`` of the permuted-copy path, compiled once per device."""
    from ..compiler.compile import compile_mask

    cache = rw.__dict__.setdefault("_copy_layouts", {})
    key = (str(device), n)
    hit = cache.get(key)
    if hit is None:
        hit = []
        for part in rw.parts:
            if part.residue_stride:
                perm, inv = residue_permutation(n, part.residue_stride, device)
                lay = compile_mask(part.mask, len(perm), len(perm), rw.block_size, device=device, rewrite=False)
                hit.append((lay, perm, inv))
            else:
                hit.append((compile_mask(part.mask, n, n, rw.block_size, device=device, rewrite=False), None, None))
        cache[key] = hit
    return hit


def _permuted(x, perm):
    return x if perm is None else x.index_select(2, perm)


def _parts_forward(q, k, v, rw, s: Shapes, scale, backend, opts: KernelOptions):
    from .merge import merge_attention

    results = []
    for lay, perm, inv in _part_layouts(rw, s, q.device, s.Lq):
        n = lay.q_len
        ps = Shapes(s.B, s.H, s.Hkv, n, n, s.D)
        o, l = _fwd_one(_permuted(q, perm), _permuted(k, perm), _permuted(v, perm), lay, ps, scale, 0.0, 0, backend,
                        opts=opts)
        if inv is not None:
            o, l = o.index_select(2, inv), l.index_select(2, inv)
        results.append((o, l))
    return merge_attention(results)


def _parts_backward(q, k, v, out, lse, dout, rw, s: Shapes, scale, backend, dlse, opts: KernelOptions):
    grads = None
    for lay, perm, inv in _part_layouts(rw, s, q.device, s.Lq):
        n = lay.q_len
        ps = Shapes(s.B, s.H, s.Hkv, n, n, s.D)
        args = [_permuted(t, perm) for t in (q, k, v, out)]
        lp = lse if perm is None else lse.index_select(2, perm)
        dp = None if dlse is None else (dlse if perm is None else dlse.index_select(2, perm))
        g = _bwd_one(*args, lp, _permuted(dout, perm), lay, ps, scale, 0.0, 0, backend, dp, opts=opts)
        if inv is not None:
            g = tuple(t.index_select(2, inv) for t in g)
        grads = g if grads is None else tuple(a + b for a, b in zip(grads, g))
    return grads


# ------------------------------------------------------------------------------------------------
# the path
# ------------------------------------------------------------------------------------------------
def _memoized(layout: BlockLayout, key, inputs, run):
    """``run()``, or its replay (``ops/call_memo.py``) for calls of signature ``key`` (None: not tried)."""
    if key is not None:
        hit = call_memo.lookup(layout, key)
        if hit is not None:
            return hit(inputs) if isinstance(hit, call_memo.Replay) else run()
        with call_memo.recording(inputs) as rec:
            result = run()
        call_memo.settle(layout, key, rec, result)
        return result
    return run()


def forward(q, k, v, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int, backend: str,
            use_rewrite: bool = True, out_dtype=None, score_mod=None, opts: KernelOptions = DEFAULT_OPTIONS):
    """``(out (B, H, Lq, D) in q's dtype, lse (B, H, Lq))`` of attention over ``layout``.

    ``out_dtype``: the output's dtype instead of q's (float32 keeps a partial result exact for a
    later merge, e.g. the context-parallel merge of rows split between ranks). ``score_mod``: a
    validated :class:`~blocksparse_fa.mask.score.ScoreMod` or None. ``opts``: the call's
    :class:`~blocksparse_fa.ops.options.KernelOptions`. Calls without dropout, score modifier or
    ``out_dtype`` on the Triton backend replay a recorded launch sequence where one applies
    (``ops/call_memo.py``)."""
    key = None
    if backend == "triton" and dropout_p == 0.0 and out_dtype is None and score_mod is None and opts.replay:
        key = ("forward", call_memo.signature((q, k, v), s, scale, use_rewrite, opts, select.hardware(q.device)))
    return _memoized(layout, key, (q, k, v), lambda: _forward(q, k, v, layout, s, scale, dropout_p, seed, backend,
                                                             use_rewrite, out_dtype, score_mod, opts))


def _forward(q, k, v, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int, backend: str,
             use_rewrite: bool, out_dtype, score_mod, opts: KernelOptions):
    rw = _rewrite(layout, dropout_p, use_rewrite, score_mod)
    gs = _global_split(q, k, v, layout, s, dropout_p, backend, use_rewrite, score_mod, opts, out_dtype is not None)
    if gs is not None:
        from .globals import split_forward

        select.note("forward", "global_split")
        out, lse = split_forward(q, k, v, gs, s, scale, opts, _fwd_one)
    elif (rs := None if rw is not None else _run_split(q, k, v, layout, s, dropout_p, backend, use_rewrite, score_mod,
                                                      opts, out_dtype is not None)) is not None:
        from .runs import split_forward as runs_forward

        select.note("forward", "run_split")
        call_memo.unfit()
        out, lse = runs_forward(q, k, v, rs, s, scale, opts, _fwd_one)
    elif (ss := None if rw is not None else _set_split(q, k, v, layout, s, dropout_p, backend, use_rewrite, score_mod,
                                                      opts, out_dtype is not None)) is not None:
        from .sets import split_forward as sets_forward

        select.note("forward", "set_split")
        call_memo.unfit()
        out, lse = sets_forward(q, k, v, ss, s, scale, opts, _fwd_one)
    elif rw is not None:
        call_memo.unfit()
        if backend == "triton" and _residue_ok(rw, s, q.dtype, opts):
            from .residue import residue_forward

            out, lse = residue_forward(q, k, v, rw, s, scale, opts)
        else:
            out, lse = _parts_forward(q, k, v, rw, s, scale, backend, opts)
    else:
        out, lse = _fwd_one(q, k, v, layout, s, scale, dropout_p, seed, backend, out_dtype, score_mod, opts)
    ldt, odt = lse_dtype(q.dtype), out_dtype or q.dtype
    return (out if out.dtype == odt else out.to(odt)), (lse if lse.dtype == ldt else lse.to(ldt))


def backward(q, k, v, out, lse, dout, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int,
             backend: str, dlse=None, use_rewrite: bool = True, grad_dtype=None, score_mod=None, score_grads=None,
             opts: KernelOptions = DEFAULT_OPTIONS):
    """``(dq, dk, dv)`` shaped and typed like q, k, v (or in ``grad_dtype``: float32 keeps partial
    gradients exact for a later sum; a ``(dq, dk, dv)`` tuple gives each its own, None the input's). ``dlse``: gradient of the returned logsumexp (optional).
    ``score_mod``: as in :func:`forward`; ``score_grads``: ``(dslopes, dbias)`` buffers from
    :func:`score_grad_buffers` (None each) that the gradients of its slopes and bias are added to.
    ``opts``: the call's kernel options. As :func:`forward`, calls without dropout, score modifier,
    ``dlse`` or ``grad_dtype`` replay a recorded launch sequence where one applies."""
    key = None
    if (backend == "triton" and dropout_p == 0.0 and dlse is None and grad_dtype is None and score_mod is None
            and score_grads is None and opts.replay):
        key = ("backward", call_memo.signature((q, k, v, out, lse, dout), s, scale, use_rewrite, opts,
                                               select.hardware(q.device)))
    return _memoized(layout, key, (q, k, v, out, lse, dout), lambda: _backward(
        q, k, v, out, lse, dout, layout, s, scale, dropout_p, seed, backend, dlse, use_rewrite, grad_dtype, score_mod,
        score_grads, opts))


def _backward(q, k, v, out, lse, dout, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int,
              backend: str, dlse, use_rewrite: bool, grad_dtype, score_mod, score_grads, opts: KernelOptions):
    rw = _rewrite(layout, dropout_p, use_rewrite, score_mod)
    gs = _global_split(q, k, v, layout, s, dropout_p, backend, use_rewrite, score_mod, opts, grad_dtype is not None,
                       "backward")
    if gs is not None or rw is not None:
        call_memo.unfit()  # only the one-layout route is replayed
    if gs is not None:
        from .globals import split_backward

        select.note("backward", "global_split")
        dq, dk, dv = split_backward(q, k, v, out, lse, dout, gs, s, scale, dlse, opts)
    elif (rs := None if rw is not None else _run_split(q, k, v, layout, s, dropout_p, backend, use_rewrite, score_mod,
                                                      opts, grad_dtype is not None, "backward")) is not None:
        from .runs import split_backward as runs_backward

        select.note("backward", "run_split")
        call_memo.unfit()
        dq, dk, dv = runs_backward(q, k, v, out, lse, dout, rs, s, scale, dlse, opts)
    elif (ss := None if rw is not None else _set_split(q, k, v, layout, s, dropout_p, backend, use_rewrite, score_mod,
                                                      opts, grad_dtype is not None, "backward")) is not None:
        from .sets import split_backward as sets_backward

        select.note("backward", "set_split")
        call_memo.unfit()
        dq, dk, dv = sets_backward(q, k, v, out, lse, dout, ss, s, scale, dlse, opts)
    elif rw is not None:
        if backend == "triton" and _residue_ok(rw, s, q.dtype, opts):
            from .residue import residue_backward

            dq, dk, dv = residue_backward(q, k, v, out, lse, dout, rw, s, scale, dlse, opts)
        else:
            dq, dk, dv = _parts_backward(q, k, v, out, lse, dout, rw, s, scale, backend, dlse, opts)
    else:
        dq, dk, dv = _bwd_one(q, k, v, out, lse, dout, layout, s, scale, dropout_p, seed, backend, dlse, grad_dtype,
                              score_mod, score_grads, opts)
    gds = tuple(grad_dtype) if isinstance(grad_dtype, (tuple, list)) else (grad_dtype,) * 3
    return tuple(g if g.dtype == (d or t.dtype) else g.to(d or t.dtype) for g, t, d in zip((dq, dk, dv), (q, k, v), gds))


def score_grad_buffers(score_mod, slopes_grad: bool, bias_grad: bool, dtype: torch.dtype, device):
    """``(dslopes, dbias)``: zeroed accumulation buffers (float32, float64 for float64 inputs) shaped
    like the bound modifier's slopes ``(H,)`` and 4-D bias, or None where no gradient is wanted."""
    acc = lse_dtype(dtype)
    dsl = torch.zeros(score_mod.slopes.shape, dtype=acc, device=device) if slopes_grad else None
    db = torch.zeros(score_mod.bias.shape, dtype=acc, device=device) if bias_grad else None
    return dsl, db


def _score_tensors(score_mod) -> tuple:
    return (None, None) if score_mod is None else score_mod.tensors


class _Attention(torch.autograd.Function):
    """Eager autograd around :func:`forward`/:func:`backward` (no custom-op dispatch on this path).
    The score modifier's tensors (``slopes``, ``bias``: those of ``score_mod``) are inputs, so that
    they receive gradients."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, bias, layout, s, scale, dropout_p, seed, backend, use_rewrite, score_mod=None,
                opts=DEFAULT_OPTIONS):
        ctx.set_materialize_grads(False)  # an unused LSE (or output) brings no gradient work
        out, lse = forward(q, k, v, layout, s, scale, dropout_p, seed, backend, use_rewrite, score_mod=score_mod,
                           opts=opts)
        ctx.save_for_backward(q, k, v, out, lse, slopes, bias)
        ctx.args = (layout, s, scale, dropout_p, seed, backend)
        ctx.opts = opts
        ctx.use_rewrite = use_rewrite
        ctx.score_mod = None if score_mod is None else replace(score_mod, slopes=None if slopes is not None else
                                                               score_mod.slopes, bias=None)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        check_differentiable_backward(ctx.args[5])
        q, k, v, out, lse, slopes, bias = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        mod, grads = ctx.score_mod, None
        if mod is not None:
            mod = replace(mod, slopes=slopes if slopes is not None else mod.slopes, bias=bias)
            grads = score_grad_buffers(mod, ctx.needs_input_grad[3], ctx.needs_input_grad[4], q.dtype, q.device)
        with without_autocast(q.device):
            dq, dk, dv = backward(q, k, v, out, lse, dout, *ctx.args, dlse=dlse, use_rewrite=ctx.use_rewrite,
                                  score_mod=mod, score_grads=grads, opts=ctx.opts)
        dsl, db = grads or (None, None)
        return (dq, dk, dv, None if dsl is None else dsl.to(slopes.dtype), None if db is None else db.to(bias.dtype),
                None, None, None, None, None, None, None, None, None)


def apply(q, k, v, layout: BlockLayout, s: Shapes, scale: float, dropout_p: float, seed: int, backend: str,
          use_rewrite: bool = True, score_mod=None, opts: KernelOptions = DEFAULT_OPTIONS):
    """Differentiable ``(out, lse)`` through the eager path (``score_mod``: a bound
    :class:`~blocksparse_fa.mask.score.ScoreMod`, see :meth:`~blocksparse_fa.mask.score.ScoreMod.bind`;
    its slopes and bias tensors receive gradients when they require them; ``opts``: the call's
    kernel options)."""
    slopes, bias = _score_tensors(score_mod)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, slopes, bias)):
        return _Attention.apply(q, k, v, slopes, bias, layout, s, scale, dropout_p, seed, backend, use_rewrite,
                                score_mod, opts)
    return forward(q, k, v, layout, s, scale, dropout_p, seed, backend, use_rewrite, score_mod=score_mod, opts=opts)
