"""``explain``: which kernels a call of :func:`blocksparse_fa.attention` runs, without running it.

It walks the same decisions as the call (validation, backend, compiled layout, exact rewrite, the
CPU dense path) and asks :mod:`blocksparse_fa.ops.select` for the kernels, with the same tensors.
Compiled calls (``torch.compile``, the custom op) run the same kernels as eager ones: the choice
does not depend on how the call was made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..mask.score import check_score_mod
from . import dispatch
from .options import as_options
from .prepare import layout_for, resolve_backend
from .route import takes_dense_path
from .select import LayoutClass
from .validate import bool_mask_to_mask, check_qkv, check_scalars, flatten_batch

__all__ = ["Explanation", "explain"]


@dataclass(frozen=True)
class Explanation:
    """What a call runs.

    Attributes:
        backend: ``"triton"`` (the kernels), ``"torch"`` (exact block walking in PyTorch) or
            ``"dense"`` (PyTorch's SDPA over the materialised mask; CPU, ``backend="auto"``).
        forward: the forward kernels (a :class:`~blocksparse_fa.ops.select.Choice` string such as
            ``"gluon:causal"``, ``"triton:blocks"``, ``"torch:blocks"``); for an exact rewrite,
            one entry per part joined by ``" + "``.
        backward: the backward kernels in the same form (None: no gradient is needed).
        rewrite: ``"residue"`` (the strided rewrite on class views), ``"parts"`` (on permuted
            copies), ``"global_split"`` (global tokens as a band, the first rows and the global
            keys, ``compiler/globals.py``), ``"run_split"`` (two key runs per row as two one-run
            parts, ``compiler/runs.py``; in the phases that split), ``"set_split"`` (global
            positions anywhere as a band, the gathered global keys and rows, ``compiler/sets.py``;
            in the phases that split) or None.
        layout: the compiled layout's class (None on the PyTorch backend).
        kernels: the GPU kernels launched, forward then backward, as a profiler names them.
    """

    backend: str
    forward: str
    backward: str | None
    rewrite: str | None = None
    layout: LayoutClass | None = None
    kernels: tuple = ()

    def __str__(self) -> str:
        lines = [f"backend:  {self.backend}", f"forward:  {self.forward}", f"backward: {self.backward or '-'}"]
        if self.rewrite:
            lines.append(f"rewrite:  {self.rewrite}")
        if self.layout is not None:
            lines.append(f"layout:   {self.layout.kind} ({self.layout.q_len} x {self.layout.kv_len}, block "
                         f"{self.layout.block[0]}x{self.layout.block[1]})")
        if self.kernels:
            lines.append("kernels:  " + ", ".join(self.kernels))
        return "\n".join(lines)


def _device_interval(q, k, v, mask, s, dropout_p, score_mod, be, align, opts, needs_grad) -> Explanation | None:
    """The explanation of a call on the device-interval path (``ops/interval_backend.py``: masks
    holding this call's ``document(ids)``), or None where the layout path applies."""
    from ..compiler.device_intervals import interval_spec
    from ..mask.expr import Mask

    if not isinstance(mask, Mask) or score_mod is not None or q.device.type == "meta":
        return None
    spec = interval_spec(mask, s.Lq, s.Lk, "bottom_right" if align is None else align)
    if spec is None:
        return None
    if be == "torch":
        return Explanation("torch", "torch:interval", "torch:interval" if needs_grad else None)
    from .interval_backend import _class, backward_choice, forward_choice

    iv = spec.bounds(q.device)
    fwd = forward_choice(q, k, v, iv, s, dropout_p, opts)
    lc = _class(iv, s)
    bwd = backward_choice(q, k, v, None, iv, s, dropout_p, opts) if needs_grad else None
    kernels = tuple(dict.fromkeys(fwd.kernels + (bwd.kernels if bwd else ())))
    return Explanation("triton", str(fwd), None if bwd is None else str(bwd), None, lc, kernels)


def explain(q, k, v, mask=None, *, scale=None, dropout_p: float = 0.0, return_lse: bool = False,
            backend: str = "auto", block_size=None, rewrite: bool = True, align: str | None = None,
            score_mod=None, kernel_options=None, needs_grad: bool | None = None) -> Explanation:
    """The kernels :func:`blocksparse_fa.attention` runs for these arguments (it takes the same
    ones), eagerly or under ``torch.compile``.

    Args:
        q, k, v, mask, scale, dropout_p, return_lse, backend, block_size, rewrite, align,
            score_mod, kernel_options: as in :func:`blocksparse_fa.attention`.
        needs_grad: whether to report the backward (default: any of q, k, v requires grad).

    Returns:
        An :class:`Explanation` (``print`` it for a summary).
    """
    q4, k4, v4, lead = flatten_batch(q, k, v)
    s = check_qkv(q4, k4, v4, dv_ok=True)
    scale, dropout_p = check_scalars(scale, dropout_p)
    opts = as_options(kernel_options)
    if isinstance(mask, torch.Tensor):
        mask = bool_mask_to_mask(mask, tuple(q.shape[:-3]), s.H, s.Lq, s.Lk, "mask", q4.device)
    score_mod = check_score_mod(score_mod, s.H)
    if score_mod is not None and score_mod.fn is None:
        score_mod = score_mod.bind(lead if lead is not None else (s.B,), s.H, s.Lq, s.Lk, q4.device)
    if needs_grad is None:
        needs_grad = any(t.requires_grad for t in (q, k, v))
    q4, k4, v4, _ = dispatch.pad_head_dims(q4, k4, v4)
    s = replace(s, D=q4.shape[-1])
    scale = 1.0 / math.sqrt(s.D) if scale is None else scale
    be = resolve_backend(backend, q4.device, q4.dtype)
    if be == "triton" and score_mod is not None and score_mod.fn is not None:
        be = "torch"
    dev = _device_interval(q4, k4, v4, mask, s, dropout_p, score_mod, be, align, as_options(kernel_options),
                           needs_grad)
    if dev is not None:
        return dev
    layout = layout_for(mask, s, q4.device, block_size, rewrite, align)
    if takes_dense_path(q4, k4, v4, layout, s, dropout_p, backend, be, return_lse, score_mod):
        return Explanation("dense", "sdpa:dense", "sdpa:dense" if needs_grad else None)
    if be == "torch":
        return Explanation("torch", "torch:blocks", "torch:blocks" if needs_grad else None)
    from . import select
    from .triton_backend import backward_choice, forward_choice

    rw = dispatch._rewrite(layout, dropout_p, rewrite, score_mod)
    gs = dispatch._global_split(q4, k4, v4, layout, s, dropout_p, "triton", rewrite, score_mod, opts)
    gsb = (dispatch._global_split(q4, k4, v4, layout, s, dropout_p, "triton", rewrite, score_mod, opts,
                                  phase="backward") if needs_grad else None)
    extra, bwd_parts = (), None
    rsf = rsb = r = None
    if gs is None and gsb is None and rw is None:
        rsf = dispatch._run_split(q4, k4, v4, layout, s, dropout_p, "triton", rewrite, score_mod, opts)
        rsb = (dispatch._run_split(q4, k4, v4, layout, s, dropout_p, "triton", rewrite, score_mod, opts,
                                   phase="backward") if needs_grad else None)
        r = rsf or rsb
    ssf = ssb = None
    if gs is None and gsb is None and rw is None and r is None:
        ssf = dispatch._set_split(q4, k4, v4, layout, s, dropout_p, "triton", rewrite, score_mod, opts)
        ssb = (dispatch._set_split(q4, k4, v4, layout, s, dropout_p, "triton", rewrite, score_mod, opts,
                                   phase="backward") if needs_grad else None)
    if ssf is not None or ssb is not None:
        from .globals import _rows_opts
        from .sets import _indices

        ss = ssf or ssb
        keys, rows = _indices(ss, q4.device)
        split = [(ss.band, s, (q4, k4, v4), opts)]
        if ss.keys_part is not None:
            split.append((ss.keys_part, replace(s, Lk=len(ss.keys)),
                          (q4, k4.index_select(2, keys), v4.index_select(2, keys)), _rows_opts(opts)))
        if ss.rows_part is not None:
            split.append((ss.rows_part, replace(s, Lq=len(ss.rows)), (q4.index_select(2, rows), k4, v4),
                          _rows_opts(opts)))
        whole = [(layout, s, (q4, k4, v4), opts)]
        parts, how = split if ssf else whole, "set_split"
        extra = ("_merge_residue",) if ssf else ()
        bwd_parts = (split if ssb else whole) if needs_grad else None
    elif gs is not None or gsb is not None:
        from .globals import _fold_global_keys, _rows_opts

        split = gs if gs is not None else gsb
        parts, how = [(split.band, s, (q4, k4, v4), opts)], "global_split"
        if split.rows is not None:
            rs = type(s)(s.B, s.H, s.Hkv, split.g, s.Lk, s.D)
            parts.append((split.rows, rs, (q4[:, :, :split.g], k4, v4), _rows_opts(opts)))
        if gs is not None:
            extra = ("_global_rows_fwd", "_global_rows_merge") if gs.rows_full else ()
            extra += () if _fold_global_keys(q4, k4, v4, gs, s, opts) else ("_global_keys_fwd",)
        else:  # the whole mask forward, the parts backward
            parts, bwd_parts = [(layout, s, (q4, k4, v4), opts)], parts
        if gsb is not None:
            extra += ("_global_rows_bwd",) if gsb.rows_full else ()
            extra += ("_global_keys_bwd",)
        elif needs_grad:  # the parts forward, the whole mask backward
            bwd_parts = [(layout, s, (q4, k4, v4), opts)]
    elif rw is None and (rsf or rsb):
        whole = [(layout, s, (q4, k4, v4), opts)]
        split = [(r.first, s, (q4, k4, v4), opts), (r.second, s, (q4, k4, v4), opts)]
        parts, how = split if rsf else whole, "run_split"
        extra = ("_merge_residue",) if rsf else ()
        bwd_parts = (split if rsb else whole) if needs_grad else None
    elif rw is not None:
        if dispatch._residue_ok(rw, s, q4.dtype, opts):
            from .residue import _class_shapes, class_view

            cs, cm = _class_shapes(rw, s)
            views = [class_view(t.contiguous(), rw.stride, cm) for t in (q4, k4, v4)]
            parts = [(rw.band, s, (q4, k4, v4), opts), (rw.cls, cs, views, opts)]
            how = "residue"
        else:
            parts = [(lay, s, (q4, k4, v4), opts) for lay, _, _ in dispatch._part_layouts(rw, s, q4.device, s.Lq)]
            how = "parts"
    else:
        parts, how = [(layout, s, (q4, k4, v4), opts)], None
    fwd = [forward_choice(*ts, lay, ps, dropout_p, po, score_mod=score_mod) for lay, ps, ts, po in parts]

    def bwd_choice(i, lay, ps, ts, po):
        acc = i > 0 and how in ("residue", "global_split", "run_split", "set_split")
        if acc and how == "run_split":  # the second part adds into the first's gradients unless it runs Gluon
            acc = backward_choice(*ts, ts[0], lay, ps, dropout_p, po, score_mod=score_mod).family != "gluon"
        return backward_choice(*ts, ts[0], lay, ps, dropout_p, po, accumulate=acc, score_mod=score_mod)

    bwd = [bwd_choice(i, *part) for i, part in enumerate(bwd_parts or parts)] if needs_grad else []
    kernels = tuple(dict.fromkeys([kn for c in (*fwd, *bwd) for kn in c.kernels] + list(extra)))
    return Explanation("triton", " + ".join(map(str, fwd)), " + ".join(map(str, bwd)) if bwd else None, how,
                       select.layout_class(layout), kernels)
