"""Building blocks of generated predicates (imported by the generated modules).

Parameters arrive at run time, so a ``% s`` or ``// c`` would be a real integer division on every
element of a partial tile — slow on GPUs. Each helper takes a uniform branch to shifts and masks
when the parameter is a power of two (the common case), and divides only otherwise.
"""

import triton
import triton.language as tl


@triton.jit
def strided_keep(qp, kj, s):
    """``(qp - kj) % s == 0``."""
    d = qp - kj
    if (s & (s - 1)) == 0:
        r = (d & (s - 1)) == 0
    else:
        r = (d % s) == 0
    return r


@triton.jit
def chunked_keep(qp, kj, c):
    """``qp // c == kj // c`` (floor division; never for qp < 0)."""
    if (c & (c - 1)) == 0:
        r = (qp >= 0) & ((qp ^ kj) < c)
    else:
        r = (qp >= 0) & ((qp // c) == (kj // c))
    return r


@triton.jit
def summary_keep(kj, stride, c):
    """``kj % stride >= stride - c`` (kj >= 0)."""
    if (stride & (stride - 1)) == 0:
        r = (kj & (stride - 1)) >= (stride - c)
    else:
        r = (kj % stride) >= (stride - c)
    return r


@triton.jit
def div_floor(x, d, shift):
    """``x // d`` for ``x >= 0``; ``shift = log2(d)`` when d is a power of two, else -1."""
    if shift >= 0:
        r = x >> shift
    else:
        r = x // d
    return r


@triton.jit
def doc_run_keep(qp, kj, START, END, n, KEY_SIDE: tl.constexpr):
    """Same document, for documents that are contiguous runs: position ``x`` belongs to the run
    ``[START[x], END[x])`` (``n`` positions). The bounds are read on the side that stays fixed
    inside the kernel's loop (``KEY_SIDE``: the key block of a dK/dV program, else the query
    rows), so the compiler hoists the loads out of the loop."""
    if KEY_SIDE:
        ok = (kj >= 0) & (kj < n)
        r = (qp >= tl.load(START + kj, mask=ok, other=1 << 30)) & (qp < tl.load(END + kj, mask=ok, other=0))
    else:
        ok = (qp >= 0) & (qp < n)
        r = (kj >= tl.load(START + qp, mask=ok, other=1 << 30)) & (kj < tl.load(END + qp, mask=ok, other=0))
    return r
