"""Compile the interval-table kernels (``kernels/interval_tables.py``) for sm_90 without a GPU and
report registers, spills and shared memory (``sass_probe.report``) at the sizes the launches use.
Indicative only: the local triton may differ from the GPU's.

    PYTHONPATH=. python benchmarks/experiments/interval_tables_probe.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sass_probe as sp  # noqa: E402  (drops TRITON_INTERPRET before triton is imported)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from blocksparse_fa.kernels import interval_tables as it  # noqa: E402

_I64 = {"SRT", "PERM", "TLO", "THI", "SUM", "KEY", "lo_a", "lo_c", "hi_c", "hi_b", "row_a", "row_b"}
_I32 = {"LO", "HI", "ILO", "IHI", "QID", "KID", "OUT", "TMP", "TILES", "LO_P", "HI_P"}


def compile_table_kernel(fn, consts: dict, warps: int):
    types = {n: "*i64" for n in _I64 if n.isupper()}
    types.update({n: "i64" for n in _I64 if not n.isupper()})
    types.update({n: "*i32" for n in _I32})
    types["IDS"] = "*i64"
    src = ASTSource(fn=fn, signature=sp._sig(fn, types, consts), constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def main() -> None:
    runs = [
        ("_doc_bounds", it._doc_bounds, dict(COMPARE=False, HAS_TERMS=False, BLOCK=it.BLOCK_ROWS, WINDOW=it.WALK), 8),
        ("_doc_bounds compare+terms", it._doc_bounds, dict(COMPARE=True, HAS_TERMS=True, BLOCK=it.BLOCK_ROWS,
                                                           WINDOW=it.WALK), 8),
        ("_doc_ranks", it._doc_ranks, dict(BLOCK=it.BLOCK_ROWS), 4),
    ]
    for rows, bn in ((128, 64), (32, 128), (128, 128)):
        tiles = max(1, it.TABLE_ROWS // rows)
        runs += [(f"_row_tables {rows}x{bn} inner", it._row_tables, dict(INNER=True, ROWS=rows, TILES=tiles,
                                                                         BLOCK_N=bn), 4),
                 (f"_col_summary {rows}", it._col_summary, dict(INNER=False, ROWS=rows, TILES=tiles), 4),
                 (f"_col_tables {rows}x{bn}", it._col_tables, dict(ROWS=rows, BLOCK_N=bn, COLS=it.COLS,
                                                                   CHUNK=it.CHUNK), 4)]
    runs += [("_gluon_tiles 128x128 pad", it._gluon_tiles, dict(PAD=True, ROWS=128, TILES=it.TABLE_ROWS // 128,
                                                                BLOCK_N=128), 4),
             ("_gluon_order", it._gluon_order, dict(BLOCK=it.ORDER, CHUNK=it.CHUNK), 4)]
    for name, fn, consts, warps in runs:
        r = sp.report(compile_table_kernel(fn, consts, warps))
        r.pop("top", None)
        print(f"{name:32s} {r}", flush=True)


if __name__ == "__main__":
    main()
