"""Where a context-parallel fwd+bwd spends its time: torch.profiler on every rank, one table per rank.

    torchrun --nproc-per-node 2 benchmarks/experiments/cp_profile.py [--pattern longformer] [--n 262144]

Prints, per rank, the step time and the operators sorted by GPU time (kernels, NCCL, copies), so
that the part of ``T2 - T1 / P`` that is glue (L-sized copies and conversions) can be told apart
from communication and waiting.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from context_parallel import HEAD_DIM, HEADS, KV_HEADS, _qkv, make_mask  # noqa: E402

from blocksparse_fa.distributed import context_parallel_attention, plan_context_parallel  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pattern", default="longformer")
    ap.add_argument("--n", type=int, default=262144)
    ap.add_argument("--rows", type=int, default=22)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    mask = make_mask(args.pattern, args.n, False)
    plan = plan_context_parallel(mask, args.n, world, heads=(HEADS, KV_HEADS), head_dim=HEAD_DIM, block_size=128)
    q, k, v, do = _qkv(args.n, dev, torch.bfloat16)
    idx = plan.indices(rank, dev)
    ql, kl, vl, dl = (t[:, :, idx].contiguous().requires_grad_(t is not do) for t in (q, k, v, do))

    def step():
        o = context_parallel_attention(ql, kl, vl, plan=plan, check=False)
        o.backward(dl)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60)
    for r in range(world):
        dist.barrier()
        if r == rank:
            print(f"=== rank {rank}: {args.pattern} N={args.n} strategy={plan.strategy} fwd+bwd {ms:.2f} ms "
                  f"(profile over 3 steps)\n{table}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
