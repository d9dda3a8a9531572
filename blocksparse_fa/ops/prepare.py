"""Argument preparation shared by the entry points: :func:`blocksparse_fa.attention`
(``ops/api.py``), the custom op's :func:`~blocksparse_fa.attention_op` (``ops/custom_op.py``) and
the device-interval and context-parallel paths.

Which backend runs a request (:func:`resolve_backend`), the queries' alignment
(:func:`check_align`), the mask as a :class:`~blocksparse_fa.Mask` and its compiled layout
(:func:`as_mask`, :func:`layout_for`, :func:`check_mask_for`), the dropout seed (:func:`draw_seed`,
:func:`seed_tensor`) and the kernel options as a constant of a compiled graph
(:func:`encoded_options`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import torch

from ..compiler.cache import LRUCache
from ..compiler.compile import block_pair, compile_mask, generation
from ..compiler.layout import BlockLayout
from ..mask.dsl import parse
from ..mask.expr import Mask, query_offset
from ..mask.primitives import full, mask_mod
from .options import KernelOptions, as_options
from .validate import Shapes, check_layout

__all__ = [
    "BACKENDS", "interpreter_enabled", "triton_available", "resolve_backend", "check_align", "layout_for", "as_mask",
    "check_mask_for", "draw_seed", "seed_tensor", "constant_result", "encoded_options",
]

BACKENDS = ("auto", "triton", "torch")
_log = logging.getLogger("blocksparse_fa")


def interpreter_enabled() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET=1``): Triton then runs on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    """Whether Triton can be imported (it is imported here, on first use, not with the package)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _require_triton() -> None:
    if not triton_available():
        raise RuntimeError("backend='triton' needs the triton package, which cannot be imported here "
                           "(pip install triton; it has wheels for Linux): use backend='torch', the exact "
                           "PyTorch implementation, or backend='auto'")


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """``"triton"`` or ``"torch"`` for this request; clear errors for impossible combinations.

    ``"auto"`` is Triton for CUDA tensors (float16, bfloat16, float32) when triton can be imported,
    the PyTorch backend otherwise (CPU, float64)."""
    if backend == "auto":
        if device.type == "cuda" and dtype != torch.float64:
            if triton_available():
                return "triton"
            _log.warning("blocksparse_fa: triton cannot be imported; CUDA tensors run the PyTorch backend")
        return "torch"
    if backend == "torch":
        return backend
    if backend != "triton":
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if dtype == torch.float64:
        raise TypeError("backend='triton' supports float16, bfloat16 and float32; use backend='torch' for float64")
    _require_triton()
    if device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError("backend='triton' on CPU tensors runs the kernels in Triton's interpreter: "
                           "set TRITON_INTERPRET=1 in the environment before Python starts "
                           "(or use backend='torch', the exact CPU implementation)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"backend='triton' needs CUDA (or CPU under TRITON_INTERPRET=1) tensors, got {device}")
    return backend


_BY_ID = LRUCache(256)  # (id(mask), lengths, block, device, rewrite, align) -> (mask, layout): no hashing of the tree


def check_align(align, layout=None) -> str:
    """``align`` (``None``: ``layout``'s own, else ``"bottom_right"``) validated against ``layout``."""
    if layout is not None:
        if align is not None and align != layout.align:
            raise ValueError(f"align={align!r} conflicts with the compiled layout's align={layout.align!r}")
        return layout.align
    align = "bottom_right" if align is None else align
    query_offset(1, 1, align)  # validates it
    return align


def layout_for(mask, s: Shapes, device, block_size=None, rewrite: bool = True, align=None) -> BlockLayout:
    """The compiled layout of ``mask`` (Mask, DSL text, BlockLayout or None) for these shapes."""
    if isinstance(mask, BlockLayout):
        if block_size is not None and tuple(mask.block_size) != block_pair(block_size):
            raise ValueError(f"block_size={block_size!r} conflicts with the layout's block size {mask.block_size}")
        check_align(align, mask)
        check_layout(mask, s)
        return mask
    align = check_align(align)
    key = (id(mask), s.Lq, s.Lk, block_size, device, rewrite, align)
    hit = _BY_ID.get(key)
    if hit is not None and hit[0] is mask and hit[2] == generation():
        check_layout(hit[1], s)  # the key holds no (B, H)
        return hit[1]
    m = as_mask(mask)
    layout = compile_mask(m, s.Lq, s.Lk, block_pair(block_size), device=device, rewrite=rewrite, align=align)
    check_layout(layout, s)
    _BY_ID.put(key, (mask, layout, generation()))
    return layout


def as_mask(mask) -> Mask:
    """``mask`` as a Mask: a Mask, DSL text, a FlexAttention-style ``mask_mod`` callable
    ``fn(b, h, q_idx, kv_idx)`` (wrapped in :func:`~blocksparse_fa.mask_mod`) or None (dense)."""
    if mask is None:
        return full()
    if isinstance(mask, str):
        return parse(mask)
    if isinstance(mask, Mask):
        return mask
    if callable(mask) and not isinstance(mask, (torch.Tensor, BlockLayout)):
        return mask_mod(mask)
    raise TypeError(f"mask must be a Mask, BlockLayout, DSL text, a bool tensor, a mask_mod callable or None, "
                    f"got {type(mask).__name__}")


def check_mask_for(mask, s: Shapes, block_size=None, align=None) -> None:
    """Validate ``mask`` against these shapes without compiling it (used for meta tensors)."""
    if isinstance(mask, BlockLayout):
        if block_size is not None and tuple(mask.block_size) != block_pair(block_size):
            raise ValueError(f"block_size={block_size!r} conflicts with the layout's block size {mask.block_size}")
        check_align(align, mask)
        check_layout(mask, s)
        return
    check_align(align)
    if isinstance(mask, int) and not isinstance(mask, bool):
        return  # a registry handle (attention_op)
    m = as_mask(mask)
    block_pair(block_size)
    m.check_lengths(s.Lq, s.Lk)
    m.check_batch(s.B, s.H)
    if m.batch_shape:
        bm, hm = m.batch_shape
        if bm not in (1, s.B) or hm not in (1, s.H):
            raise ValueError(f"mask batch shape {m.batch_shape} does not fit (B, H) = ({s.B}, {s.H})")


def draw_seed(dropout_p: float, dropout_seed) -> int:
    """The dropout seed: 0 without dropout, ``dropout_seed`` checked, or one drawn from torch's RNG."""
    if dropout_p == 0.0:
        return 0
    if dropout_seed is None:
        return int(torch.randint(0, 2**62, (1,)).item())
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int) or not 0 <= dropout_seed < 2**62:
        raise ValueError(f"dropout_seed must be an int in [0, 2**62), got {dropout_seed!r}")
    return dropout_seed


def seed_tensor(dropout_p: float, dropout_seed) -> torch.Tensor | None:
    """The dropout seed as an int64 CPU scalar tensor (None without dropout): ``dropout_seed``
    checked, or drawn from torch's RNG by a tensor op (inside a compiled graph too)."""
    if dropout_p == 0.0:
        return None
    if dropout_seed is None:
        return torch.randint(0, 2**62, (), dtype=torch.int64)
    if isinstance(dropout_seed, torch.Tensor):
        return dropout_seed.to(device="cpu", dtype=torch.int64).reshape(())
    return torch.tensor(draw_seed(dropout_p, dropout_seed), dtype=torch.int64)


def constant_result(fn):
    """Mark ``fn`` for Dynamo as :func:`torch.compiler.assume_constant_result` does, without
    importing Dynamo when it is not loaded yet (that import takes about a second and pulls in
    Triton): the decorator only sets this attribute, which Dynamo reads when it traces a call."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


def encoded_options(kernel_options) -> str:
    """The canonical string of ``kernel_options`` (:meth:`~blocksparse_fa.KernelOptions.encode`), an
    argument of the custom ops: a trace-time constant under ``torch.compile``."""
    if isinstance(kernel_options, dict):
        # Dynamo hands a constant-result function plain values only, not frozen dataclass
        # instances: a dict's config options (GluonBwdConfig, ...) cross as dicts of their fields
        kernel_options = {k: ({f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
                              if dataclasses.is_dataclass(v) else v) for k, v in kernel_options.items()}
    return _encoded_constant(kernel_options)


@constant_result
def _encoded_constant(kernel_options) -> str:
    """:func:`encoded_options` once a dict holds plain values."""
    # Dynamo hands a KernelOptions built inside the traced function over without its fields (an
    # empty instance dict): refuse it rather than run the defaults.
    if isinstance(kernel_options, str):
        return as_options(kernel_options).encode()  # validated, canonical
    if isinstance(kernel_options, KernelOptions) and not kernel_options.__dict__:
        raise ValueError("kernel_options: a KernelOptions built inside a torch.compile'd function cannot be read "
                         "while it is traced; build it outside the function (e.g. as a module attribute) or pass "
                         "a dict of its fields")
    return as_options(kernel_options).encode()
