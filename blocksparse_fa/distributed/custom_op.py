"""Context-parallel attention as ``torch.library`` custom ops, so ``torch.compile`` traces it.

    blocksparse_fa::cp_attention_fwd(Tensor q, Tensor k, Tensor v, int plan, str group, float scale,
        float dropout_p, Tensor? seed, str backend, bool overlap, str check, str kernel_options)
        -> (Tensor out, Tensor lse, Tensor seed)
    blocksparse_fa::cp_attention_bwd(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout,
        Tensor? dlse, int plan, str group, float scale, float dropout_p, Tensor seed, str backend,
        bool overlap, str kernel_options) -> (Tensor dq, Tensor dk, Tensor dv)

The collectives run inside the ops (opaque to the compiler, in program order on every rank), the
plan travels as an int handle (:func:`register_plan`) and the process group by name. The backward
op fetches the remote key/value blocks again instead of keeping the forward's buffers (a custom
op's outputs are its only saved state), so a compiled step moves the forward's K/V bytes twice.
"""

from __future__ import annotations

import itertools
import threading

import torch

from .._oplib import custom_op
from ..ops.prepare import encoded_options, resolve_backend
from ..ops.options import decode_options
from .attention import cp_backward, cp_forward, fetch
from .comm import check_call, checked, init_group, needs_check, resolve_group
from .exchange import exchange_for
from .plan import ContextParallelPlan

__all__ = ["register_plan", "cp_attention_op"]

_PLANS: dict[int, ContextParallelPlan] = {}
_counter = itertools.count(1)
_lock = threading.Lock()


def register_plan(plan: ContextParallelPlan) -> int:
    """The int handle of ``plan`` (kept alive while registered; one handle per plan object)."""
    h = plan.__dict__.get("_handle")
    if h is None:
        with _lock:
            h = plan.__dict__.get("_handle")
            if h is None:
                h = next(_counter)
                plan.__dict__["_handle"] = h
                _PLANS[h] = plan
    return h


def _plan(handle: int) -> ContextParallelPlan:
    try:
        return _PLANS[handle]
    except KeyError:
        raise KeyError(f"blocksparse_fa: unknown context-parallel plan handle {handle}; pass the plan "
                       f"object (it registers itself)") from None


@custom_op("blocksparse_fa::cp_attention_fwd", mutates_args=())
def cp_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: int, group: str, scale: float,
                     dropout_p: float, seed: torch.Tensor | None, backend: str, overlap: bool,
                     check: str, kernel_options: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = _plan(plan)
    pg = resolve_group(group)
    rank, world = torch.distributed.get_rank(pg), torch.distributed.get_world_size(pg)
    s = 0 if seed is None else int(seed.item())  # no seed tensor without dropout
    if needs_check(check, pg, p, q, k, v, scale, dropout_p, True):  # check: "always", "never" or "first"
        s = check_call(pg, p, rank, world, q, k, v, scale, dropout_p, s, None, q.device)
        checked(pg, p, q, k, v, scale, dropout_p)
    else:
        init_group(pg, q.device)
    ex = exchange_for(p, rank, q.device)
    be = resolve_backend(backend, q.device, q.dtype)
    out, lse, _ = cp_forward(ex, q, k, v, scale, dropout_p, s, be, pg, overlap, decode_options(kernel_options))
    return out.contiguous(), lse.contiguous(), torch.tensor(s, dtype=torch.int64)


@cp_attention_fwd.register_fake
def _fwd_fake(q, k, v, plan, group, scale, dropout_p, seed, backend, overlap, check, kernel_options):
    B, H, L, _ = q.shape
    ldt = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, H, L), dtype=ldt),
            torch.empty((), dtype=torch.int64))


@custom_op("blocksparse_fa::cp_attention_bwd", mutates_args=())
def cp_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     dout: torch.Tensor, dlse: torch.Tensor | None, plan: int, group: str, scale: float,
                     dropout_p: float, seed: torch.Tensor, backend: str,
                     overlap: bool, kernel_options: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = _plan(plan)
    pg = resolve_group(group)
    ex = exchange_for(p, torch.distributed.get_rank(pg), q.device)
    saved = fetch(ex, q, k, v, pg, overlap)
    be = resolve_backend(backend, q.device, q.dtype)
    dq, dk, dv = cp_backward(ex, q, k, v, out, lse, dout, dlse, saved, scale, dropout_p, int(seed.item()), be, pg,
                             overlap, decode_options(kernel_options))
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@cp_attention_bwd.register_fake
def _bwd_fake(q, k, v, out, lse, dout, dlse, plan, group, scale, dropout_p, seed, backend, overlap, kernel_options):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, plan, group, scale, dropout_p, _, backend, overlap, _, kernel_options = inputs
    out, lse, seed = output
    ctx.set_materialize_grads(False)  # unused outputs' gradients arrive as None, not zeros
    ctx.save_for_backward(q, k, v, out, lse, seed)
    ctx.args = (plan, group, scale, dropout_p)
    ctx.rest = (backend, overlap, kernel_options)


def _backward(ctx, dout, dlse, _dseed):
    q, k, v, out, lse, seed = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.blocksparse_fa.cp_attention_bwd(q, k, v, out, lse, dout, dlse, *ctx.args, seed,
                                                           *ctx.rest)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


cp_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.compiler.assume_constant_result
def _handle(plan) -> int:
    return register_plan(plan)


@torch.compiler.assume_constant_result
def _group_name(group) -> str:
    return resolve_group(group).group_name


def cp_attention_op(q, k, v, plan: ContextParallelPlan, group, scale: float, dropout_p: float, seed: torch.Tensor,
                    backend: str, overlap: bool, check: str, opts=None):
    """``(out, lse)`` through the custom op (the path :func:`context_parallel_attention` takes under
    ``torch.compile``; ``check``: ``"always"``, ``"never"`` or ``"first"``, as
    ``comm.check_mode`` names them; ``opts``: the call's kernel options)."""
    out, lse, _ = cp_attention_fwd(q, k, v, _handle(plan), _group_name(group), scale, dropout_p, seed, backend,
                                   overlap, check, encoded_options(opts))
    return out, lse

