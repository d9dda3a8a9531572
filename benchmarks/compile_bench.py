"""Compile-time benchmark: million-token block layouts (the foundation issue's speed/memory bar).

    python benchmarks/compile_bench.py [--len 1048576] [--block 128] [--repeats 3]

For each mask, a fresh subprocess (so earlier runs do not hide allocations) imports the package,
then measures:

* compile wall time: best of ``--repeats`` runs of ``compile_mask(..., cache=False)``;
* peak extra RSS: ``ru_maxrss`` (``resource.getrusage``) after the compiles minus before them. This
  counts every allocation (numpy and torch), but it is a high-water mark of the whole process, so
  it reads 0 when the compile stays below what importing torch already touched;
* tracemalloc peak: the peak of Python-tracked allocations during one more compile (numpy registers
  its data buffers with tracemalloc; torch's CPU allocator does not).

Bar (issue 2): ``sliding_window(4096) & causal`` and ``longformer`` at 1,048,576 tokens, block 128,
compile in under 1 s with peak extra memory under 512 MB on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = {
    "sliding_window(4096) & causal": "sliding_window(4096) & causal",
    "longformer": "longformer",
    "bigbird": "bigbird",
    # the mask algebra's newer primitives (issue 18) and the documents of issue 15
    "documents, sorted ids": "@documents_sorted",
    "documents, unsorted ids": "@documents_unsorted",
    "shared prefix + documents": "@shared_prefix",
    "padded batch B=8": "@padded_batch",
    "window per head H=32": "@window_per_head",
    "globals at 16 positions": "@key_query_sets",
    "rectangle": "query_range(4096, 65536) & key_range(0, 4096)",
    "block diffusion": "@block_diffusion",
    "natten 2-D 1024x1024 k=13": "neighborhood(grid=(1024, 1024), kernel=13)",
    "natten 3-D 8x128x1024 k=3,7,7": "neighborhood(grid=(8, 128, 1024), kernel=(3, 7, 7))",
    "STA 8x128x1024 tiles 4x8x8": "sliding_tiles(grid=(8, 128, 1024), tile=(4, 8, 8), kernel=(1, 3, 3))",
    "periodic_window(4096, 64)": "periodic_window(4096, 64)",
    "chunk_band(128, 64)": "chunk_band(128, 64)",
    "strided(1000)": "strided(1000)",
}


def _doc_ids(n: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < n:
        lens.append(int(torch.randint(1024, 4097, (1,), generator=g)))
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[:n]


def _build(name: str, n: int):
    """Masks that need tensors (``@name`` cases)."""
    import torch

    import blocksparse_fa as bsfa

    g = torch.Generator().manual_seed(1)
    if name == "@documents_sorted":
        return bsfa.causal() & bsfa.document(_doc_ids(n))
    if name == "@documents_unsorted":  # contiguous runs, labels shuffled
        ids = _doc_ids(n)
        return bsfa.causal() & bsfa.document(torch.randperm(int(ids.max()) + 1, generator=g)[ids])
    if name == "@shared_prefix":
        return bsfa.load_pattern("shared_prefix", prefix=4096, document=_doc_ids(n))
    if name == "@padded_batch":
        return bsfa.load_pattern("padded_batch", length=bsfa.per_batch(torch.randint(n // 2, n + 1, (8,), generator=g)))
    if name == "@window_per_head":
        return bsfa.causal() & bsfa.sliding_window(bsfa.per_head(torch.randint(512, 8193, (32,), generator=g)))
    if name == "@key_query_sets":
        pos = torch.randint(0, n, (16,), generator=g)
        return bsfa.key_set(pos) | bsfa.query_set(pos) | bsfa.sliding_window(1024)
    if name == "@block_diffusion":
        return bsfa.load_pattern("block_diffusion", n=n // 2, block=16)
    raise KeyError(name)
TIME_BAR_S = 1.0
MEM_BAR_MB = 512.0


def child(expr: str, n: int, block: int, repeats: int) -> dict:
    import resource
    import time
    import tracemalloc

    import blocksparse_fa as bsfa
    from blocksparse_fa.cli.common import mask_from_arg

    mask = _build(expr, n) if expr.startswith("@") else mask_from_arg(expr)
    warm = _build(expr, 4096) if expr.startswith("@") else mask
    bsfa.compile_mask(warm, 4096, 4096, block, cache=False)  # warm lazy imports / code paths
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    times = []
    lay = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        lay = bsfa.compile_mask(mask, n, n, block, cache=False)
        times.append(time.perf_counter() - t0)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del lay
    tracemalloc.start()
    lay = bsfa.compile_mask(mask, n, n, block, cache=False)
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "mask": str(mask),
        "best_s": min(times),
        "times_s": times,
        "rss_extra_mb": (rss1 - rss0) / 1024,
        "rss_before_mb": rss0 / 1024,
        "traced_peak_mb": traced_peak / 2**20,
        "density": lay.density,
        "partial_fraction": lay.partial_fraction,
        "n_partial": lay.n_partial,
        "n_refined": lay.n_refined,
        "lut_mb": lay.lut_bytes / 2**20,
        "grid": f"{-(-n // block)}x{-(-n // block)}",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=1 << 20)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.len, args.block, args.repeats)))
        return 0

    rows = []
    for label, expr in CASES.items():
        proc = subprocess.run([sys.executable, __file__, "--child", expr, "--len", str(args.len), "--block",
                               str(args.block), "--repeats", str(args.repeats)], capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        rows.append((label, json.loads(proc.stdout.strip().splitlines()[-1])))

    print(f"compile_mask at q_len = kv_len = {args.len:,}, block {args.block}, cache disabled, "
          f"best of {args.repeats} (each mask in a fresh process)")
    hdr = (f"{'mask':<32} {'best ms':>8} {'rss+ MB':>8} {'traced MB':>9} {'density':>8} {'partial%':>8} "
           f"{'LUT MB':>7}  bar")
    print(hdr)
    print("-" * len(hdr))
    ok_all = True
    for label, r in rows:
        mem = max(r["rss_extra_mb"], r["traced_peak_mb"])
        ok = r["best_s"] < TIME_BAR_S and mem < MEM_BAR_MB
        barred = label in ("sliding_window(4096) & causal", "longformer")  # the others are reported
        ok_all &= ok or not barred
        verdict = ("ok" if ok else "FAIL") if barred else ("(ok)" if ok else "(over)")
        print(f"{label:<32} {r['best_s'] * 1e3:8.1f} {r['rss_extra_mb']:8.1f} {r['traced_peak_mb']:9.1f} "
              f"{r['density']:8.5f} {100 * r['partial_fraction']:8.2f} {r['lut_mb']:7.2f}  {verdict}")
    print(f"\nbar: < {TIME_BAR_S:.0f} s and < {MEM_BAR_MB:.0f} MB peak extra memory "
          f"(rss+ = ru_maxrss growth during the compiles; traced = tracemalloc peak of one compile)")
    print(f"process RSS before compiling (imports): {rows[0][1]['rss_before_mb']:.0f} MB")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
