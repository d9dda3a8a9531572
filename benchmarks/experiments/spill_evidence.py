"""Where the backward's extra L2 -> SM bytes come from: the traffic model vs Nsight Compute counters
of our kernels and FlexAttention's (``ncu_compare.py`` output), with the register-spill fills that
miss L1 (``l1tex__t_sectors_pipe_lsu_mem_local_op_ld_lookup_miss`` x 32 B) taken out. CPU only.

    python benchmarks/experiments/spill_evidence.py [--data docs/data/ncu_compare_spills.json] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "..", "..", "docs", "data", "ncu_compare_spills.json")


def _num(rec: dict, key: str) -> float:
    """A counter from ncu's CSV text (``"1,181,920"``); ``"us"`` holds gpu__time_duration in ns."""
    return float(str(rec.get(key, "0")).replace(",", ""))


def _kernel(recs: list, pred) -> dict:
    return next(r for r in recs if pred(r["name"]))


def _masks():
    import blocksparse_fa as bsfa

    return {"sliding_window_1024": lambda n: bsfa.sliding_window(1024), "longformer": lambda n: bsfa.load_pattern("longformer"),
            "bigbird": lambda n: bsfa.load_pattern("bigbird"), "causal": lambda n: bsfa.causal(), "dense": lambda n: bsfa.full()}


def rows(data: dict, n: int = 16384, heads: int = 16) -> list[dict]:
    """One row per pattern: model, ours, Flex (forward and backward L2 -> SM bytes), spill fills."""
    sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/, for bench.py
    import bench

    import blocksparse_fa as bsfa
    from blocksparse_fa.analysis.traffic import TileSizes, TrafficParams, traffic_model
    from blocksparse_fa.kernels.config import bwd_configs, fwd_config
    from blocksparse_fa.ops.select import layout_class

    import torch

    _MASKS = _masks()
    out = []
    res = data["results"]
    for key in res:
        name, impl = key.split("/")
        if impl != "ours" or f"{name}/flex" not in res:
            continue
        mask = _MASKS[name](n) if name in _MASKS else bsfa.load_pattern("document_causal", document=bench.doc_ids(n))
        lay = bsfa.compile_mask(mask, n, n, 128)
        band = layout_class(lay).band
        f = fwd_config(128, torch.bfloat16, 128, 128, band)
        kv, q = bwd_configs(128, torch.bfloat16, 128, 128, band)
        tiles = TileSizes(fwd_block_m=f.block_m, fwd_block_n=f.block_n, dkdv_block_m=kv.block_m,
                          dkdv_block_n=kv.block_n, dq_block_m=q.block_m, dq_block_n=q.block_n)
        rep = traffic_model(lay, TrafficParams(heads=heads, tiles=tiles, kernels="triton"), compare=False)
        ours, flex = res[f"{name}/ours"], res[f"{name}/flex"]
        of, ob = _kernel(ours, lambda s: s == "_attn_fwd"), _kernel(ours, lambda s: s == "_attn_bwd")
        ff = _kernel(flex, lambda s: s.endswith("attention_0"))
        fb = _kernel(flex, lambda s: "backward_1" in s)
        out.append(dict(
            pattern=name, model_fwd=rep.forward.l2_to_sm_bytes, ours_fwd=_num(of, "l2_to_sm"), flex_fwd=_num(ff, "l2_to_sm"),
            model_bwd=rep.bwd_dkdv.l2_to_sm_bytes + rep.bwd_dq.l2_to_sm_bytes, ours_bwd=_num(ob, "l2_to_sm"),
            flex_bwd=_num(fb, "l2_to_sm"), ours_spill=_num(ob, "local_ld_miss_sect") * 32,
            flex_spill=_num(fb, "local_ld_miss_sect") * 32, ours_us=_num(ob, "us") / 1e3, flex_us=_num(fb, "us") / 1e3,
            ours_tensor=_num(ob, "tensor%"), flex_tensor=_num(fb, "tensor%"),
            ours_local_ld=_num(ob, "local_ld"), flex_local_ld=_num(fb, "local_ld")))
    return out


def markdown(rs: list[dict]) -> str:
    gb = lambda x: f"{x / 1e9:.3f}"
    pct = lambda a, b: f"{(a / b - 1) * 100:+.1f} %"
    lines = ["| pattern | fwd model / ours / Flex GB | bwd model GB | bwd ours GB (vs model) | bwd Flex GB (vs model) "
             "| our spill fills GB | ours − fills (vs model) | bwd µs ours / Flex | tensor pipe % ours / Flex |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        lines.append(
            f"| {r['pattern']} | {gb(r['model_fwd'])} / {gb(r['ours_fwd'])} / {gb(r['flex_fwd'])} | {gb(r['model_bwd'])} "
            f"| {gb(r['ours_bwd'])} ({pct(r['ours_bwd'], r['model_bwd'])}) | {gb(r['flex_bwd'])} ({pct(r['flex_bwd'], r['model_bwd'])}) "
            f"| {gb(r['ours_spill'])} | {pct(r['ours_bwd'] - r['ours_spill'], r['model_bwd'])} "
            f"| {r['ours_us']:.0f} / {r['flex_us']:.0f} | {r['ours_tensor']:.1f} / {r['flex_tensor']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=DEFAULT)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    with open(args.data) as f:
        rs = rows(json.load(f))
    print(markdown(rs) if args.markdown else json.dumps(rs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
