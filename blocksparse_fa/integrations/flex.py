"""Bridge to PyTorch's FlexAttention: ``BlockMask`` <-> :class:`~blocksparse_fa.BlockLayout`.

    from torch.nn.attention.flex_attention import create_block_mask
    from blocksparse_fa.integrations.flex import from_block_mask, to_block_mask

    bm = create_block_mask(mask_mod, B, H, L, L, device="cuda")
    out = bsfa.attention(q, k, v, mask=from_block_mask(bm))        # instead of flex_attention(...)
    bm2 = to_block_mask(bsfa.compile_mask("longformer", L, L))     # and back, for flex_attention

FlexAttention's ``BlockMask`` lists, per (batch, head, query block), the key blocks to visit:
``full_kv_indices`` (every pair kept, no ``mask_mod`` call) and ``kv_indices`` (partial blocks,
evaluated with ``mask_mod``). :func:`from_block_mask` turns them into the mask expression
``block_mask(full) | (block_mask(partial) & mask_mod(fn))``, where the element mask is the
``BlockMask``'s ``mask_mod`` as a :func:`~blocksparse_fa.mask_mod` primitive (evaluated only on the
partial blocks; a ``noop_mask`` keeps partial blocks whole), and compiles it at the ``BlockMask``'s
block size, so the layout visits the same blocks. A plain callable works too:
``bsfa.attention(q, k, v, mask=mask_mod)``.
:func:`to_block_mask` goes the other way; its ``mask_mod`` is the layout's own expression where that
runs under ``torch.vmap`` (as FlexAttention calls it), else a lookup in the layout's dense mask.

Positions: FlexAttention's ``q_idx`` is the query *row*. Layouts place row ``i`` at
``i + kv_len - q_len`` (bottom-right); the ``mask_mod`` made here accounts for it, and masks made
from a ``BlockMask`` index rows, so nothing shifts in either direction. Flex treats blocks on a
ragged edge (``L`` not a multiple of the block size) as partial; :func:`to_block_mask` does too.

Needs ``torch.nn.attention.flex_attention`` (PyTorch >= 2.5).
"""

from __future__ import annotations

import math

import torch

from ..compiler.compile import compile_mask
from ..compiler.layout import BlockLayout
from ..mask.expr import EvalContext, Mask
from ..mask.primitives import block_mask, dense_mask, mask_mod as mask_mod_primitive

__all__ = ["from_block_mask", "to_block_mask", "mask_from_block_mask", "as_mask_mod", "block_grids"]


def _flex():
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError as e:  # pragma: no cover - torch < 2.5
        raise ImportError("the FlexAttention bridge needs torch.nn.attention.flex_attention (PyTorch >= 2.5)") from e
    return fa


def _lengths(bm, q_len, kv_len) -> tuple[int, int]:
    seq = getattr(bm, "seq_lengths", None)
    if q_len is None or kv_len is None:
        if seq is None:
            raise ValueError("this BlockMask has no seq_lengths: pass q_len and kv_len")
        q_len = seq[0] if q_len is None else q_len
        kv_len = seq[1] if kv_len is None else kv_len
    return int(q_len), int(kv_len)


def _grid(num, idx, tr: int, tc: int) -> torch.Tensor:
    """Bool ``(B, H, tr, tc)`` of the first ``num`` listed key blocks per query block."""
    num = num[..., :tr].to(torch.long)
    idx = idx[..., :tr, :].to(torch.long)
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    if bool(((idx < 0) | (idx >= tc))[listed].any()):
        raise ValueError(f"BlockMask lists key blocks outside [0, {tc})")
    out = torch.zeros(*idx.shape[:-1], tc + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(-1, torch.where(listed, idx, tc), True)
    return out[..., :tc]


def block_grids(bm, q_len: int | None = None, kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(full, partial)``: bool grids ``(B, H, Tr, Tc)`` of a ``BlockMask``'s listed blocks."""
    q_len, kv_len = _lengths(bm, q_len, kv_len)
    bq, bkv = bm.BLOCK_SIZE
    tr, tc = -(-q_len // bq), -(-kv_len // bkv)
    if bm.kv_num_blocks.dim() != 3:
        raise ValueError(f"expected a BlockMask with (B, H) dims, got kv_num_blocks of shape "
                         f"{tuple(bm.kv_num_blocks.shape)}")
    partial = _grid(bm.kv_num_blocks, bm.kv_indices, tr, tc)
    if bm.full_kv_num_blocks is not None:
        full = _grid(bm.full_kv_num_blocks, bm.full_kv_indices, tr, tc)
    else:
        full = torch.zeros_like(partial)
    return full, partial & ~full


def _block_primitive(grid: torch.Tensor, bq: int, bkv: int, q_len: int, kv_len: int) -> Mask:
    """``block_mask`` of a grid of ``(bq, bkv)`` blocks (refined to square blocks of their gcd)."""
    g = math.gcd(bq, bkv)
    if bq != g or bkv != g:
        grid = grid.repeat_interleave(bq // g, dim=-2).repeat_interleave(bkv // g, dim=-1)
        grid = grid[..., : -(-q_len // g), : -(-kv_len // g)]
    return block_mask(grid.cpu().contiguous(), block_size=g)


def _squeeze(grid: torch.Tensor) -> torch.Tensor:
    return grid[0, 0] if grid.shape[0] == 1 and grid.shape[1] == 1 else grid


def mask_from_block_mask(bm, q_len: int | None = None, kv_len: int | None = None) -> Mask:
    """The mask expression a ``BlockMask`` computes (see the module docstring)."""
    fa = _flex()
    q_len, kv_len = _lengths(bm, q_len, kv_len)
    bq, bkv = bm.BLOCK_SIZE
    full, partial = block_grids(bm, q_len, kv_len)
    mm = getattr(bm, "mask_mod", None)
    if mm is None or mm is fa.noop_mask:
        return _block_primitive(_squeeze(full | partial), bq, bkv, q_len, kv_len)
    B, H = partial.shape[:2]
    if _broadcasts(mm, B, H, q_len, kv_len):
        elem = mask_mod_primitive(mm, B=B if B > 1 else None, H=H if H > 1 else None)
    else:  # written for torch.vmap only: evaluate it once, as FlexAttention's create_mask does
        elem = dense_mask(_squeeze(fa.create_mask(mm, B, H, q_len, kv_len, device="cpu")).contiguous())
    part = _block_primitive(_squeeze(partial), bq, bkv, q_len, kv_len) & elem
    if not bool(full.any()):
        return part
    return _block_primitive(_squeeze(full), bq, bkv, q_len, kv_len) | part


def _broadcasts(fn, B: int, H: int, q_len: int, kv_len: int) -> bool:
    """Whether ``fn`` gives, on broadcast index tensors (how the ``mask_mod`` primitive calls it),
    what FlexAttention's ``torch.vmap`` evaluation gives, on a sample of rows and keys."""
    fa = _flex()
    n, m = min(q_len, 16), min(kv_len, 16)
    for q0, k0 in {(0, 0), (q_len - n, kv_len - m), (q_len - n, 0)}:
        try:
            want = fa.create_mask(lambda b, h, q, kv: fn(b, h, q + q0, kv + k0), B, H, n, m, device="cpu")
            got = fn(torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1),
                     torch.arange(q0, q0 + n).view(1, 1, -1, 1), torch.arange(k0, k0 + m).view(1, 1, 1, -1))
        except Exception:  # noqa: BLE001 - a callable that only runs under vmap
            return False
        if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or not torch.equal(got.expand_as(want), want):
            return False
    return True


def from_block_mask(bm, *, device=None, q_len: int | None = None, kv_len: int | None = None) -> BlockLayout:
    """A FlexAttention ``BlockMask`` as a compiled :class:`~blocksparse_fa.BlockLayout` (same block
    size, same visited blocks), with its lookup tables on ``device`` (default: the ``BlockMask``'s).

    A ``mask_mod`` other than ``noop_mask`` applies on the partial blocks only, as in FlexAttention,
    through the :func:`~blocksparse_fa.mask_mod` primitive (called on broadcast index tensors; a
    callable that only runs under ``torch.vmap`` is evaluated once to a dense mask instead). It is
    called with the ``BlockMask``'s batch and head indices: a ``mask_mod`` that depends on ``b`` or
    ``h`` needs a ``BlockMask`` with those dims (FlexAttention builds its block lists that way too).
    """
    q_len, kv_len = _lengths(bm, q_len, kv_len)
    m = mask_from_block_mask(bm, q_len, kv_len)
    dev = bm.kv_indices.device if device is None else device
    return compile_mask(m, q_len, kv_len, tuple(bm.BLOCK_SIZE), device=dev)


def _ordered(grid: torch.Tensor):
    """FlexAttention's ``(num_blocks, indices)`` of a bool grid (listed blocks first, in order)."""
    g = grid.to(torch.int32)
    return g.sum(-1).to(torch.int32), torch.argsort(g, dim=-1, descending=True, stable=True).to(torch.int32)


def _expression_mask_mod(mask: Mask, q_len: int, kv_len: int, q_offset: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return mask._eval(EvalContext(q_len, kv_len, q_idx, q_idx + q_offset, kv_idx, b, h))

    mask_mod.__name__ = "blocksparse_mask_mod"
    return mask_mod


def _runs_under_vmap(mm, mask: Mask, layout: BlockLayout) -> bool:
    """Whether ``mm`` evaluates, as FlexAttention calls it (``torch.vmap`` over b, h, q, kv), to the
    layout's mask on a sample (the last query rows against the first and last keys)."""
    fa = _flex()
    n = min(layout.q_len, 8)
    q0 = layout.q_len - n
    bs = layout.batch_shape or (1, 1)
    ref = layout.to_dense() if layout.q_len * layout.kv_len * bs[0] * bs[1] <= 1 << 22 else None
    for k0 in sorted({0, max(0, layout.kv_len - 8)}):
        m = min(layout.kv_len - k0, 8)
        try:
            got = fa.create_mask(lambda b, h, q, kv: mm(b, h, q + q0, kv + k0), bs[0], bs[1], n, m, device="cpu")
        except Exception:  # noqa: BLE001 - any failure under vmap means "not expressible"
            return False
        i = torch.arange(q0, q0 + n).view(1, 1, -1, 1)
        j = torch.arange(k0, k0 + m).view(1, 1, 1, -1)
        b = torch.arange(bs[0]).view(-1, 1, 1, 1)
        h = torch.arange(bs[1]).view(1, -1, 1, 1)
        if ref is not None:
            want = ref.view(bs[0], bs[1], layout.q_len, layout.kv_len)[:, :, q0:q0 + n, k0:k0 + m]
        else:
            want = mask._eval(EvalContext(layout.q_len, layout.kv_len, i, i + layout.q_offset, j, b, h))
        if not torch.equal(got.cpu(), want.expand(bs[0], bs[1], n, m).cpu()):
            return False
    return True


def as_mask_mod(layout: BlockLayout):
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` computing ``layout``'s mask: its
    expression where that runs under ``torch.vmap`` (random blocks, for instance, do not), else a
    lookup in the layout's dense mask (``q_len · kv_len`` bools per batch and head it has)."""
    mask = layout.mask
    mm = _expression_mask_mod(mask, layout.q_len, layout.kv_len, layout.q_offset)
    if _runs_under_vmap(mm, mask, layout):
        return mm
    dense = layout.to_dense()
    bs = layout.batch_shape or (1, 1)
    dense = dense.view(bs[0], bs[1], layout.q_len, layout.kv_len)

    def dense_mask_mod(b, h, q_idx, kv_idx):
        bb = b if bs[0] > 1 else torch.zeros_like(b)
        hh = h if bs[1] > 1 else torch.zeros_like(h)
        return dense[bb, hh, q_idx, kv_idx]

    return dense_mask_mod


def to_block_mask(layout: BlockLayout, *, mask_mod="auto"):
    """A compiled layout as a FlexAttention ``BlockMask`` (``BlockMask.from_kv_blocks``): the same
    full and partial blocks (full blocks on a ragged edge listed as partial, as Flex does), at the
    layout's block size, on the layout's device.

    Args:
        layout: a :class:`~blocksparse_fa.BlockLayout` (from :func:`~blocksparse_fa.compile_mask`).
        mask_mod: ``"auto"`` (:func:`as_mask_mod`), a callable, or ``None`` (Flex's ``noop_mask``:
            partial blocks kept whole; only right when the caller supplies the element mask).
    """
    fa = _flex()
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"to_block_mask() takes a BlockLayout (compile_mask(...)), got {type(layout).__name__}")
    st = layout.block_states()
    st = st.view(*(layout.batch_shape or (1, 1)), *st.shape[-2:])
    full, partial = st == 2, st == 1
    bq, bkv = layout.block_size
    if layout.q_len % bq:
        partial[..., -1, :] |= full[..., -1, :]
        full[..., -1, :] = False
    if layout.kv_len % bkv:
        partial[..., :, -1] |= full[..., :, -1]
        full[..., :, -1] = False
    num_p, idx_p = _ordered(partial)
    num_f, idx_f = _ordered(full)
    mm = as_mask_mod(layout) if mask_mod == "auto" else mask_mod
    return fa.BlockMask.from_kv_blocks(num_p, idx_p, num_f, idx_f, BLOCK_SIZE=(bq, bkv), mask_mod=mm,
                                       seq_lengths=(layout.q_len, layout.kv_len))
