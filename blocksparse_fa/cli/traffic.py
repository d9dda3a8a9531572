"""``bsfa traffic``: predicted bytes per kernel (L2 → SM, DRAM) vs dense FlashAttention and standard attention."""

from __future__ import annotations

import sys
from dataclasses import replace

from ..analysis.traffic import H100_L2_BYTES, H100_SMS, TileSizes, TraceTooLargeError, TrafficParams, traffic_model
from ..compiler.compile import compile_mask
from .common import add_length_args, add_pattern_args, check_lengths, mask_from_arg


def _tile_pair(text: str) -> tuple[int, int]:
    try:
        m, n = (int(x) for x in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise ValueError(f"tile sizes look like 128x64, got {text!r}") from None
    return m, n


def _occupancy(text: str):
    try:
        if "=" not in text:
            return int(text)
        return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise ValueError(f"--occupancy takes N or kernel=N,... (fwd, bwd_preprocess, bwd_dkdv, bwd_dq), "
                         f"got {text!r}") from None


def _kernel_tiles(layout, head_dim: int, dtype: str):
    """The (fwd, dK/dV, dQ) tiles the Triton kernels would use for this layout."""
    import torch

    from ..kernels.config import bwd_configs, fwd_config, head_dim_pad
    from ..ops.select import layout_class

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    bm, bn = layout.block_size
    lc = layout_class(layout)
    f = fwd_config(head_dim_pad(head_dim), dt, bm, bn, lc.band, lc.partial_rows)
    kv, q = bwd_configs(head_dim_pad(head_dim), dt, bm, bn, lc.band, lc.partial_heavy)
    return (f.block_m, f.block_n), (kv.block_m, kv.block_n), (q.block_m, q.block_n)


def register(sub) -> None:
    p = sub.add_parser(
        "traffic", help="predict the bytes each kernel moves (L2->SM and DRAM) for a pattern",
        description="Three-level traffic model (DRAM / L2 / shared memory) of the block-sparse kernels for a "
                    "pattern, with the ratio vs dense FlashAttention and vs standard attention. "
                    "See docs/traffic.md for how it works and how well it matches the H100.")
    add_pattern_args(p)
    add_length_args(p)
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--heads", type=int, default=16, help="query heads H (default 16)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads for GQA/MQA (default: --heads)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="input dtype (default bf16)")
    p.add_argument("--l2-mb", type=float, default=H100_L2_BYTES / 2**20, help="L2 capacity in MiB (default 50, H100)")
    p.add_argument("--sms", type=int, default=H100_SMS, help="streaming multiprocessors (default 132, H100 SXM)")
    p.add_argument("--occupancy", default="1",
                   help="programs resident per SM: N, or per kernel, e.g. fwd=1,bwd_dkdv=2,bwd_dq=2 (default 1)")
    p.add_argument("--policy", default=None, choices=["fraction", "lru", "trace"],
                   help="DRAM model: a simulation of the programs' interleaved loads through the L2 (trace, "
                        "default; checked against ncu on the H100, docs/traffic.md), or the wave model where "
                        "re-reads beyond capacity never hit (lru) or hit with probability C/D (fraction); by "
                        "default trace, or lru where the trace would exceed TRACE_MAX_REFERENCES loads")
    p.add_argument("--l2-partitions", type=int, default=2, choices=[1, 2],
                   help="trace: two L2 partitions of half the capacity with near copies (2, default, H100) or "
                        "one LRU cache (1)")
    p.add_argument("--kernels", default="auto", choices=["auto", "triton"],
                   help="which kernels to model: the ones attention() runs on a Hopper GPU by default (auto: the "
                        "Gluon kernels on dense, causal and one-interval-per-row layouts, the Triton block-sparse "
                        "kernels elsewhere) or the Triton block-sparse kernels everywhere (triton); the tile and "
                        "order options below apply to the Triton kernels")
    p.add_argument("--bwd-launches", type=int, default=1, choices=[1, 2],
                   help="the backward's dK/dV and dQ programs in one launch sharing L2 (1, the kernels' default) "
                        "or two launches, each with a cold L2 (2)")
    p.add_argument("--order", default="heavy_first", choices=["grid", "heavy_first"],
                   help="program launch order: heaviest tiles first (heavy_first, default: the kernels' work "
                        "lists) or tile index (grid)")
    p.add_argument("--fwd-tiles", default=None,
                   help="forward BLOCK_MxBLOCK_N, e.g. 128x64 (default: the kernels' own tiles for this layout)")
    p.add_argument("--dkdv-tiles", default=None, help="dK/dV kernel BLOCK_MxBLOCK_N (default: the kernels' tiles)")
    p.add_argument("--dq-tiles", default=None, help="dQ kernel BLOCK_MxBLOCK_N (default: the kernels' tiles)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    lq, kv = check_lengths(args)
    mask = mask_from_arg(args.pattern, args.documents, kv)
    lay = compile_mask(mask, lq, kv, args.block)
    default = _kernel_tiles(lay, args.head_dim, args.dtype)
    fm, fn = _tile_pair(args.fwd_tiles) if args.fwd_tiles else default[0]
    km, kn = _tile_pair(args.dkdv_tiles) if args.dkdv_tiles else default[1]
    qm, qn = _tile_pair(args.dq_tiles) if args.dq_tiles else default[2]
    occ = _occupancy(args.occupancy)
    args.policy_given = args.policy is not None
    args.policy = args.policy or "trace"
    if args.l2_mb <= 0:
        raise ValueError(f"--l2-mb must be positive, got {args.l2_mb}")
    params = TrafficParams(batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                           dtype=args.dtype, tiles=TileSizes(fm, fn, km, kn, qm, qn),
                           l2_bytes=int(args.l2_mb * 2**20), n_sm=args.sms, occupancy=occ,
                           policy=args.policy, program_order=args.order, bwd_fused=args.bwd_launches == 1,
                           l2_partitions=args.l2_partitions, kernels=args.kernels)
    given = [f"--{n}-tiles" for n in ("fwd", "dkdv", "dq") if getattr(args, f"{n}_tiles")]
    if given and args.kernels == "auto":
        from ..analysis.traffic.gluon import choices

        if all(c.family == "gluon" for c in choices(lay, params)):
            raise ValueError(f"{', '.join(given)} set the Triton kernels' tiles, but this layout runs the Gluon "
                             "kernels, which use their own; pass --kernels triton to model the Triton kernels")
    try:
        rep = traffic_model(lay, params, progress=True)
    except TraceTooLargeError as e:
        if args.policy_given:
            raise
        print(f"note: {e}; using --policy lru", file=sys.stderr)
        rep = traffic_model(lay, replace(params, policy="lru"), progress=True)
    if args.json:
        import json

        print(json.dumps(rep.to_dict(), indent=1, default=str))
    else:
        print(rep.format_table())
    return 0
