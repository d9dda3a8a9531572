"""Context parallelism: message transports side by side, and the call replayed as a CUDA graph.

Per mask (256K, GQA 8/2 x 128, bf16, the planner's plan), under torchrun with NCCL:

1. eager forward and forward+backward with each variant of ``--compare``, interleaved
   ``--passes`` times on the same inputs, slowest rank, so that they are compared on the same
   machine state: ``transports`` (``p2p``: grouped NCCL point-to-point; ``all_to_all``: one
   ``all_to_all_single`` per step), ``own_rows`` (the backward's own-key gradients gathered
   whole in float32 then converted, or converted run by run), ``returns`` (fetched keys' dK/dV
   parts sent back in float32 or in bf16), ``check`` (the call's description check, an all-gather
   and a device-to-host read: never, every call, the first call of the configuration) or
   ``sm_margin`` (the call not
   overlapped, then overlapped with the persistent Gluon grids leaving 0, 8 or 16 SMs to NCCL);
2. the same forward+backward captured once in a CUDA graph (``torch.cuda.graph``, after warm-up on
   a side stream; ``check=False``: the call's description check synchronises) and replayed: time per
   replay, and outputs and gradients of the replay against the eager call (they must agree);
3. the one-GPU call on the whole sequence, eager and replayed, for the efficiency ``T1 / (P TP)``.

A user whose step is captured (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``)
gets the replayed times::

    torchrun --nproc-per-node 4 benchmarks/experiments/cp_graphs.py --json $OUT/cp_graphs.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from context_parallel import HEAD_DIM, HEADS, KV_HEADS, _qkv, lead_masks  # noqa: E402

import blocksparse_fa as bsfa  # noqa: E402
from blocksparse_fa.distributed import attention as att  # noqa: E402
from blocksparse_fa.distributed import comm, context_parallel_attention, plan_context_parallel  # noqa: E402

messages, max_runs, wait_sends, margin = comm.MESSAGES, att._MAX_RUN_COPIES, att._WAIT_SENDS, att._SM_MARGIN
returns = att._RETURN_DTYPE
GROUPS = {"default": None}  # "high": a group whose NCCL streams have high priority (made in main)
_call = dict(group=None, overlap=None, check=False)  # overlap None: ``--overlap``


def _set(**kw):
    def setup():
        comm.MESSAGES = kw.get("messages", messages)
        att._MAX_RUN_COPIES = kw.get("max_runs", max_runs)
        att._WAIT_SENDS = kw.get("wait_sends", wait_sends)
        att._SM_MARGIN = kw.get("margin", margin)
        att._RETURN_DTYPE = kw.get("returns", returns)
        _call["group"] = GROUPS[kw.get("group", "default")]
        _call["overlap"] = kw.get("overlap")
        _call["check"] = kw.get("check", False)
    return setup


# what ``--compare`` interleaves: the message transports, or the backward's own-key gradients
# gathered whole in float32 (``gather``) against converted run by run (``runs``, the default)
VARIANTS = {"transports": [("p2p", _set(messages="p2p")), ("all_to_all", _set(messages="all_to_all"))],
            "own_rows": [("gather", _set(max_runs=0)), ("runs", _set())],
            "wait_sends": [("no_wait", _set(wait_sends=False)), ("wait", _set())],
            "priority": [("default", _set()), ("high", _set(group="high"))],
            # the call's description check (an all-gather and a device-to-host read per call), as
            # the nn modules and the transformers hook call it, against none
            "check": [("no_check", _set()), ("check", _set(check=True)), ("first", _set(check="first"))],
            # fetched keys' dK/dV parts returned in float32 or in the inputs' 16-bit dtype
            "returns": [("float32", _set(returns="float32")), ("input", _set(returns="input"))],
            # overlapped calls whose persistent Gluon grids leave SMs to NCCL's kernels
            "sm_margin": [("no_overlap", _set(overlap=False)), ("overlap_m0", _set(overlap=True, margin=0)),
                          ("overlap_m8", _set(overlap=True, margin=8)),
                          ("overlap_m16", _set(overlap=True, margin=16))]}


def _slowest(x: float, dev) -> float:
    t = torch.tensor([x], device=dev, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _time(fn, iters: int, dev) -> float:
    """Seconds per call, slowest rank, after two warm-up calls and a barrier."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return _slowest((time.perf_counter() - t0) / iters, dev)


def _graph(fn, held: list):
    """``fn`` captured in a CUDA graph after three warm-up calls on a side stream (``held`` gets
    what the captured call returned: the replay rewrites it)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        held.append(fn())
    torch.cuda.synchronize()
    return g


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--patterns", nargs="+", default=["longformer", "bigbird", "sliding_window", "documents"])
    ap.add_argument("--tokens", type=int, default=262144)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--passes", type=int, default=2, help="interleaved passes over the transports")
    ap.add_argument("--compare", default="transports", choices=sorted(VARIANTS))
    ap.add_argument("--no-graph", action="store_true", help="no CUDA-graph capture (eager variants and T1 only)")
    ap.add_argument("--overlap", default="auto", type=lambda x: x if x == "auto" else x == "true",
                    help="the calls' overlap: auto (the plan's choice), true or false")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.compare == "priority":
        GROUPS["high"] = dist.new_group(backend="nccl",
                                        pg_options=dist.ProcessGroupNCCL.Options(is_high_priority_stream=True))
    def _overlap():
        return args.overlap if _call["overlap"] is None else _call["overlap"]

    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    rows = []
    for pattern in args.patterns:
        row = dict(pattern=pattern, world=world, tokens=args.tokens)
        try:
            mask = lead_masks(args.tokens)[pattern]
            plan = plan_context_parallel(mask, args.tokens, world, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM,
                                         block_size=128)
            row.update(strategy=plan.strategy, overlap=plan.overlap_auto if args.overlap == "auto" else args.overlap)
            q, k, v, do = _qkv(args.tokens, dev, torch.bfloat16)
            idx = plan.indices(rank, dev)
            ql, kl, vl, dl = (t[:, :, idx].contiguous() for t in (q, k, v, do))
            qg, kg, vg = (t.clone().requires_grad_() for t in (ql, kl, vl))

            def fwd():
                with torch.no_grad():
                    return context_parallel_attention(ql, kl, vl, plan=plan, check=_call["check"], overlap=_overlap(),
                                                      group=_call["group"])

            def fb():
                for t in (qg, kg, vg):
                    t.grad = None
                out = context_parallel_attention(qg, kg, vg, plan=plan, check=_call["check"], overlap=_overlap(),
                                                 group=_call["group"])
                out.backward(dl)
                return out

            for p in range(args.passes):
                for variant, setup in VARIANTS[args.compare]:
                    setup()
                    row.setdefault(f"TP_fwd_ms_{variant}", []).append(_time(fwd, args.iters, dev) * 1e3)
                    row.setdefault(f"TP_fb_ms_{variant}", []).append(_time(fb, args.iters, dev) * 1e3)
            grads = {}
            for variant, setup in VARIANTS[args.compare]:  # the variants move the same numbers
                setup()
                o = fb()
                grads[variant] = [o.detach().clone()] + [t.grad.clone() for t in (qg, kg, vg)]
            first = next(iter(grads.values()))
            row["variants_max_abs_diff"] = max((a.float() - b.float()).abs().max().item()
                                               for g in grads.values() for a, b in zip(g, first))
            row["variants_rel_diff"] = {n: {w: _rel(a, b) for w, a, b in zip(("out", "dq", "dk", "dv"), g, first)}
                                        for n, g in grads.items()}
            # the last output held its autograd graph, whose AccumulateGrad nodes (made on the default
            # stream) a later capture would reach: "operation would make the legacy stream depend on
            # a capturing blocking stream" (torch 2.11, 2 x H200)
            del grads, first, o
            _set()()
            if not args.no_graph:
                ref = fb().detach().clone()
                refg = [t.grad.clone() for t in (qg, kg, vg)]
                try:
                    held = []
                    g = _graph(fb, held)
                    for t in (qg, kg, vg):  # poison what the replay must rewrite
                        t.grad.fill_(float("nan"))
                    held[0].fill_(float("nan"))
                    g.replay()
                    torch.cuda.synchronize()
                    # the replay writes into the tensors captured: the output and the grads of qg, kg, vg
                    row["graph_err"] = {n: _rel(t, r) for n, t, r in zip(("out", "dq", "dk", "dv"),
                                                                          (held[0], qg.grad, kg.grad, vg.grad),
                                                                          (ref, *refg))}
                    row["TP_fb_ms_graph"] = _time(g.replay, args.iters, dev) * 1e3
                    del g
                except Exception as e:  # noqa: BLE001 - recorded, the next pattern runs
                    row["graph_error"] = f"{type(e).__name__}: {e}"[:600]
                    if rank == 0:
                        traceback.print_exc()
            torch.cuda.synchronize()
            dist.barrier()
            lay = plan.device_layout(dev)
            qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))

            def one_fb():
                for t in (qa, ka, va):
                    t.grad = None
                bsfa.attention(qa, ka, va, mask=lay).backward(do)

            def one_fwd():
                with torch.no_grad():
                    bsfa.attention(q, k, v, mask=lay)
            row["T1_fwd_ms"] = _time(one_fwd, max(3, args.iters // 4), dev) * 1e3
            row["T1_fb_ms"] = _time(one_fb, max(3, args.iters // 4), dev) * 1e3
            try:
                if not args.no_graph:
                    g1 = _graph(one_fb, [])
                    row["T1_fb_ms_graph"] = _time(g1.replay, max(3, args.iters // 4), dev) * 1e3
                    del g1
            except Exception as e:  # noqa: BLE001
                row["graph1_error"] = f"{type(e).__name__}: {e}"[:600]
            for key in [k for k in row if k.startswith(("TP_fb_ms", "TP_fwd_ms"))]:
                T1 = row["T1_fb_ms" if key.startswith("TP_fb") else "T1_fwd_ms"]
                vals = row[key] if isinstance(row[key], list) else [row[key]]
                row["eff_" + key[3:]] = [T1 / (world * x) for x in vals]
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:600]
            if rank == 0:
                traceback.print_exc()
        torch.cuda.empty_cache()
        dist.barrier()
        if rank == 0:
            print(json.dumps(row, default=str), flush=True)
        rows.append(row)
        if rank == 0 and args.json:  # after every pattern: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(dict(world=world, tokens=args.tokens, torch=torch.__version__,
                               device=torch.cuda.get_device_name(dev), rows=rows), f, indent=1, default=str)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
