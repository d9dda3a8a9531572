"""Peer attention kernels the GPU benchmarks measure beside ours, each optional.

* FlashAttention-4 (``flash_attn.cute``, CuTe DSL): ``flash_attn_func`` on ``(B, L, H, D)`` tensors
  with ``causal=`` and ``window_size=(left, right)`` (a query at ``i`` keeps keys ``i - left .. i +
  right``), ``flash_attn_varlen_func`` on packed ``(T, H, D)`` tensors with ``cu_seqlens_q/k`` and
  ``max_seqlen_q/k`` for packed documents. Under ``torch.compile`` it runs through two custom ops
  (:func:`fa4_op`) so that a compiled block traces it without a graph break.
* FlexAttention, compiled, with its Triton kernel (the default backend) or the FLASH backend
  (``kernel_options={"BACKEND": "FLASH"}``: FA4's CuTe kernels instantiated for the ``mask_mod``;
  it needs ``flash_attn.cute`` importable and a ``BlockMask`` with full blocks).
* cuDNN through ``scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``.

:func:`status` says, per peer, whether it can run here and why not (``"n/a (not installed)"``).
:func:`strict_compile` raises Dynamo's limits so that many masks and shapes never fall back to
eager, and turns such a fallback into an error.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

NOT_INSTALLED = "n/a (not installed)"
FLEX_EAGER_WARNING = "flex_attention called without torch.compile"


# ------------------------------------------------------------------------------------------------
# availability
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _fa4_import():
    """``(flash_attn.cute module, None)`` or ``(None, why the import failed)``."""
    try:
        import flash_attn.cute as fa  # noqa: F401

        fa.flash_attn_func, fa.flash_attn_varlen_func  # noqa: B018  (both entry points must exist)
        return fa, None
    except Exception as e:  # noqa: BLE001  (missing package, missing CUDA bindings, ...)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def fa4():
    """The ``flash_attn.cute`` module; raises ``RuntimeError`` saying why when it cannot be imported."""
    mod, why = _fa4_import()
    if mod is None:
        raise RuntimeError(f"FlashAttention-4 (flash_attn.cute) {NOT_INSTALLED}: {why}")
    return mod


def status(device) -> dict:
    """``{peer: None (it runs) or why not ("n/a (not installed)", ...)}`` for ``fa4``, ``flex_triton``,
    ``flex_flash`` and ``cudnn`` on ``device``; ``fa4_import_error`` holds the import's error."""
    cuda = torch.device(device).type == "cuda"
    missing = _fa4_import()[0] is None
    return {"fa4": NOT_INSTALLED if missing else (None if cuda else "n/a (CUDA only)"),
            "flex_triton": None,
            "flex_flash": "n/a (FA4 not installed)" if missing else (None if cuda else "n/a (CUDA only)"),
            "cudnn": None if cuda else "n/a (CUDA only)",
            "fa4_import_error": _fa4_import()[1]}


# ------------------------------------------------------------------------------------------------
# torch.compile settings
# ------------------------------------------------------------------------------------------------
def strict_compile(limit: int = 100000) -> None:
    """Every mask, shape and backend compiles its own graph: lift Dynamo's recompile limits (whose
    default, 8, silently sends later calls to eager code) and make hitting a limit, or calling
    FlexAttention uncompiled, an error."""
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(limit, getattr(torch._dynamo.config, name)))
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    warnings.filterwarnings("error", message=f".*{FLEX_EAGER_WARNING}.*")


def dynamo_counts() -> dict:
    """Graphs Dynamo compiled and graph breaks it took in this process so far."""
    c = torch._dynamo.utils.counters
    return {"graphs": int(c["stats"]["unique_graphs"]), "graph_breaks": int(sum(c["graph_break"].values()))}


# ------------------------------------------------------------------------------------------------
# FlexAttention
# ------------------------------------------------------------------------------------------------
FLEX_BACKENDS = {"flex_triton": None, "flex_flash": {"BACKEND": "FLASH"}}


@functools.lru_cache(maxsize=None)
def flex_compiled():
    """One compiled ``flex_attention`` (``fullgraph=True``, ``dynamic=False``: a graph break is an
    error, not a silent eager part); each mask, shape and backend is a graph of its own."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, fullgraph=True, dynamic=False)


def flex_call(q, k, v, block_mask, backend: str = "flex_triton", compiled: bool = True):
    """FlexAttention on ``(B, H, L, D)`` tensors with ``backend`` (``flex_triton`` or ``flex_flash``)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_compiled() if compiled and not torch.compiler.is_compiling() else flex_attention
    opts = FLEX_BACKENDS[backend]
    kw = {"kernel_options": dict(opts)} if opts else {}
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1], **kw)


# ------------------------------------------------------------------------------------------------
# cuDNN
# ------------------------------------------------------------------------------------------------
def cudnn_sdpa(q, k, v, causal: bool):
    """cuDNN attention through SDPA on ``(B, H, L, D)`` tensors (an error where cuDNN cannot run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


# ------------------------------------------------------------------------------------------------
# FlashAttention-4
# ------------------------------------------------------------------------------------------------
def fa4_window(w: int | None) -> tuple:
    """FA4's ``window_size`` for ``sliding_window(w)`` (keys ``q - w < k <= q``), ``(None, None)``
    for no window."""
    return (None, None) if w is None else (w - 1, 0)


def _first(out):
    return out[0] if isinstance(out, tuple) else out  # some versions return (out, lse)


def fa4_dense(q, k, v, causal: bool, window: int | None = None):
    """FA4 on ``(B, L, H, D)`` tensors; ``window``: ``sliding_window(window)`` semantics."""
    kw = {"window_size": fa4_window(window)} if window is not None else {}
    return _first(fa4().flash_attn_func(q, k, v, causal=causal, **kw))


def fa4_varlen(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool = True):
    """FA4 over packed documents: ``q, k, v`` ``(T, H, D)``, ``cu_seqlens`` int32 ``(n_docs + 1,)``."""
    return _first(fa4().flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                               max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, causal=causal))


def cu_seqlens_from_ids(ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens int32 (n + 1,), longest run)`` of the runs of equal ids in ``ids`` ``(B, L)`` or
    ``(L,)``, the rows laid end to end (a run never crosses a row). On the ids' device; one sync."""
    ids = ids.reshape(1, -1) if ids.dim() == 1 else ids
    B, L = ids.shape
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = torch.nonzero(new.reshape(-1)).reshape(-1)
    cu = torch.cat([starts, starts.new_tensor([B * L])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


@functools.lru_cache(maxsize=None)
def _params(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def _kwargs_for(fn, **kw):
    """The keyword arguments ``fn`` takes (FA4's internal entry points change between releases)."""
    names = _params(fn)
    return {k: v for k, v in kw.items() if k in names}


def _fa4_fwd_impl(q, k, v, cu_seqlens, max_seqlen, causal, window_left, window_right):
    from flash_attn.cute import interface as fi

    m = int(max_seqlen) if max_seqlen is not None else None
    kw = _kwargs_for(fi._flash_attn_fwd, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=m,
                     max_seqlen_k=m, causal=causal, window_size_left=None if window_left < 0 else window_left,
                     window_size_right=None if window_right < 0 else window_right, return_lse=True)
    if "return_lse" not in kw and "lse" in _params(fi._flash_attn_fwd):  # the LSE the backward needs
        shape = (q.shape[0], q.shape[2], q.shape[1]) if cu_seqlens is None else (q.shape[1], q.shape[0])
        kw["lse"] = torch.empty(shape, dtype=torch.float32, device=q.device)
    out, lse = fi._flash_attn_fwd(q, k, v, **kw)[:2]
    if lse is None:
        raise RuntimeError("this FA4 version returns no LSE from _flash_attn_fwd; its backward cannot run")
    return out, lse


def _fa4_bwd_impl(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, window_left, window_right):
    from flash_attn.cute import interface as fi

    m = int(max_seqlen) if max_seqlen is not None else None
    kw = _kwargs_for(fi._flash_attn_bwd, softmax_scale=None, causal=causal, softcap=0.0,
                     window_size_left=None if window_left < 0 else window_left,
                     window_size_right=None if window_right < 0 else window_right,
                     cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=m, max_seqlen_k=m)
    return tuple(fi._flash_attn_bwd(q, k, v, out, dout, lse, **kw)[:3])


@functools.lru_cache(maxsize=None)
def _fa4_ops():
    """Register ``bsfa_bench::fa4_fwd`` / ``fa4_bwd`` (FA4's forward and backward as custom ops with
    fake implementations and an autograd formula) once per process."""
    try:
        return torch.ops.bsfa_bench.fa4_fwd, torch.ops.bsfa_bench.fa4_bwd
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("bsfa_bench::fa4_fwd", mutates_args=())
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
            max_seqlen: Optional[torch.Tensor], causal: bool, window_left: int,
            window_right: int) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _fa4_fwd_impl(q, k, v, cu_seqlens, max_seqlen, causal, window_left, window_right)
        return out, lse.contiguous()

    @fwd.register_fake
    def _(q, k, v, cu_seqlens, max_seqlen, causal, window_left, window_right):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        if cu_seqlens is None:  # (B, L, H, D) -> lse (B, H, L)
            lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        else:  # (T, H, D) -> lse (H, T)
            lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        return out, lse

    @torch.library.custom_op("bsfa_bench::fa4_bwd", mutates_args=())
    def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, cu_seqlens: Optional[torch.Tensor], max_seqlen: Optional[torch.Tensor], causal: bool,
            window_left: int, window_right: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = _fa4_bwd_impl(dout.contiguous(), q, k, v, out, lse, cu_seqlens, max_seqlen, causal,
                                   window_left, window_right)
        return dq, dk, dv

    @bwd.register_fake
    def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, window_left, window_right):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, cu, m, causal, wl, wr = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], cu, m)
        ctx.args = (causal, wl, wr)

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu, m = ctx.saved_tensors
        dq, dk, dv = bwd(dout, q, k, v, out, lse, cu, m, *ctx.args)
        return dq, dk, dv, None, None, None, None, None

    fwd.register_autograd(backward, setup_context=setup_context)
    return fwd, bwd


def fa4_op(q, k, v, *, causal: bool, window: int | None = None, cu_seqlens=None, max_seqlen=None):
    """FA4 as a custom op (traced by ``torch.compile`` without a graph break): ``q, k, v``
    ``(B, L, H, D)``, or packed ``(T, H, D)`` with ``cu_seqlens`` (int32 on the device) and
    ``max_seqlen`` (a 0-d CPU int tensor, so that a new value recompiles nothing)."""
    wl, wr = fa4_window(window)
    # the ops are registered when this module is imported (below): Dynamo traces the attribute
    # lookup, not the registration
    fwd = torch.ops.bsfa_bench.fa4_fwd
    return fwd(q, k, v, cu_seqlens, max_seqlen, causal, -1 if wl is None else wl, -1 if wr is None else wr)[0]


_fa4_ops()  # register the FA4 custom ops at import (FA4 itself is imported only when they run)
