"""Attention variants: the patterns, and one attention core per implementation.

Variants are ``<impl>_<pattern>``:

* ``sdpa_causal``: ``F.scaled_dot_product_attention(is_causal=True)``, cuDNN backend where it runs
  (checked once per process), else FlashAttention-2, else PyTorch's choice.
* ``flex_<pattern>``: ``torch.nn.attention.flex_attention`` with a ``mask_mod`` equal to the pattern
  (translated from the blocksparse_fa expression). The ``BlockMask`` (which blocks are visited, which
  of them are full) is built without evaluating the ``L x L`` mask: for static patterns from the
  block states of the pattern's blocksparse_fa layout, once per sequence length; for documents from
  the per-block first and last document id, on the device, once per batch. Both go through
  ``BlockMask.from_kv_blocks`` and give exactly what ``create_block_mask`` gives (tested).
  ``flex_block_mask="create"`` uses ``torch.compile(create_block_mask)`` instead (on CUDA; eager on
  CPU): on torch 2.11 its first call compiles the block mask's sort into a Triton kernel that
  takes minutes (about 200 s at 16K on an H100), and eager ``create_block_mask`` materialises
  ``L x L`` elements.
* ``flexflash_<pattern>``: the same FlexAttention call with ``kernel_options={"BACKEND": "FLASH"}``
  (FA4's CuTe kernels instantiated for the ``mask_mod``; needs ``flash_attn.cute``).
* ``fa4_<pattern>``: FlashAttention-4 (``flash_attn.cute``) through two custom ops (``peers.fa4_op``:
  traced by ``torch.compile`` without a graph break): ``causal``, ``sliding`` (``window_size``) and
  ``documents`` (``flash_attn_varlen_func``'s packed form: one sequence per document, the
  ``cu_seqlens`` built per batch on the host and padded with empty sequences to a fixed length so
  that a new batch compiles nothing).
* ``bsfa_<pattern>``: blocksparse_fa. Static patterns through ``nn.BlockSparseAttention`` (a
  registered mask, the custom op under ``torch.compile``); documents through
  ``bsfa.attention(q, k, v, mask=causal() & document(ids))`` with the mask built per batch.

Patterns: ``causal``, ``sliding`` (``sliding_window(w)``), ``longformer`` (``causal & (window(w) |
global_tokens(g))``), ``bigbird`` (``causal & (window(w) | global_tokens(g) | random_blocks(r))``),
``documents`` (``causal & document(file ids)``).

blocksparse_fa under ``torch.compile`` (``bsfa_mode``): ``op`` traces it inside the compiled block
(``fullgraph=True``); ``island`` runs it in a ``torch.compiler.disable`` region (a graph break per
layer; the per-batch document layout is then compiled once per batch outside the model).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import blocksparse_fa as bsfa
from blocksparse_fa.mask import primitives as P
from blocksparse_fa.mask.expr import And, Mask, Not, Or
from blocksparse_fa.nn import BlockSparseAttention

import peers

IMPLS = ("sdpa", "fa4", "flex", "flexflash", "bsfa")
FAMILIES = ("causal", "sliding", "longformer", "bigbird", "documents")
VARIANTS = ("sdpa_causal", "fa4_causal", "fa4_sliding", "fa4_documents",
            "flex_causal", "flex_sliding", "flex_longformer", "flex_bigbird", "flex_documents",
            "flexflash_causal", "flexflash_sliding", "flexflash_longformer", "flexflash_bigbird", "flexflash_documents",
            "bsfa_causal", "bsfa_sliding", "bsfa_longformer", "bsfa_bigbird", "bsfa_documents")
# priority order of a run (under a deadline the first ones are measured first; the first three
# are the targets' comparison: dense, ours and Flex on the Longformer pattern)
DEFAULT_VARIANTS = ("sdpa_causal", "bsfa_longformer", "flex_longformer", "bsfa_sliding", "bsfa_documents",
                    "bsfa_bigbird", "bsfa_causal", "flex_sliding", "flex_documents", "flex_bigbird")


def split_name(name: str) -> tuple[str, str]:
    impl, _, family = name.partition("_")
    if impl not in IMPLS or family not in FAMILIES or name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    return impl, family


@dataclass
class Patterns:
    """Pattern parameters (tokens; random blocks and layouts use ``block_size``)."""

    block_size: int = 128
    sliding_window: int = 1024
    longformer_window: int = 512
    longformer_global: int = 256
    bigbird_window: int = 384
    bigbird_global: int = 128
    bigbird_random: int = 3
    seed: int = 0

    def mask(self, family: str, doc=None) -> Mask:
        if family == "causal":
            return bsfa.causal()
        if family == "sliding":
            return bsfa.sliding_window(self.sliding_window)
        if family == "longformer":
            return bsfa.causal() & (bsfa.window(self.longformer_window) | bsfa.global_tokens(self.longformer_global))
        if family == "bigbird":
            return bsfa.causal() & (bsfa.window(self.bigbird_window) | bsfa.global_tokens(self.bigbird_global)
                                    | bsfa.random_blocks(self.bigbird_random, block_size=self.block_size,
                                                         seed=self.seed))
        if family == "documents":
            if doc is None:
                raise ValueError("the documents pattern needs document ids")
            return bsfa.causal() & bsfa.document(doc)
        raise ValueError(f"unknown pattern family {family!r}")

    def describe(self) -> dict:
        return {"causal": "causal()",
                "sliding": str(self.mask("sliding")),
                "longformer": str(self.mask("longformer")),
                "bigbird": str(self.mask("bigbird")),
                "documents": "causal() & document(file ids)"}

    def min_global(self) -> int:
        return min(self.longformer_global, self.bigbird_global)

    def max_hop(self) -> int:
        """Farthest key one layer of a windowed pattern (global tokens aside) reaches back."""
        return max(self.sliding_window - 1, self.longformer_window, self.bigbird_window)

    def as_dict(self) -> dict:
        return asdict(self)


def block_density(pats: Patterns, family: str, L: int, doc=None) -> float:
    """Fraction of the ``(L/bs)^2`` blocks that are visited (the layout's density)."""
    return float(bsfa.compile_mask(pats.mask(family, doc), L, L, pats.block_size).density)


# ------------------------------------------------------------------------------------------------
# SDPA
# ------------------------------------------------------------------------------------------------
_SDPA_CHOICE: dict = {}


def pick_sdpa(device: torch.device, heads: int, kv_heads: int, head_dim: int) -> dict:
    """The fastest SDPA configuration that runs here (checked once per process and shape)."""
    key = (str(device), heads, kv_heads, head_dim)
    if key in _SDPA_CHOICE:
        return _SDPA_CHOICE[key]
    if device.type != "cuda":
        choice = {"label": "PyTorch default (CPU)", "backends": None, "expand_kv": False}
    else:
        cands = [("cuDNN", [SDPBackend.CUDNN_ATTENTION], False),
                 ("cuDNN, K/V expanded to all heads", [SDPBackend.CUDNN_ATTENTION], True),
                 ("FlashAttention-2", [SDPBackend.FLASH_ATTENTION], False),
                 ("PyTorch default", None, False)]
        choice, errors = None, {}
        for label, backends, expand in cands:
            try:
                x = torch.randn(1, 2048, heads + 2 * kv_heads, head_dim, device=device, dtype=torch.bfloat16,
                                requires_grad=True)
                q, k, v = x.split([heads, kv_heads, kv_heads], dim=2)
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
                core = SDPACore(backends, expand)
                core(q, k, v, None).float().square().sum().backward()
                torch.cuda.synchronize(device)
                choice = {"label": label, "backends": backends, "expand_kv": expand}
                break
            except Exception as e:  # noqa: BLE001  (try the next backend)
                errors[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if choice is None:
            raise RuntimeError(f"no SDPA configuration runs on {device}: {errors}")
        choice["rejected"] = errors
    _SDPA_CHOICE[key] = choice
    return choice


class SDPACore(nn.Module):
    def __init__(self, backends=None, expand_kv: bool = False):
        super().__init__()
        self.backends, self.expand_kv = backends, expand_kv

    def forward(self, q, k, v, arg):
        g = q.shape[1] // k.shape[1]
        if self.expand_kv and g > 1:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        gqa = q.shape[1] != k.shape[1]
        if self.backends is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        with sdpa_kernel(self.backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


# ------------------------------------------------------------------------------------------------
# FlexAttention
# ------------------------------------------------------------------------------------------------
def mask_mod_from(mask: Mask, n: int, device):
    """A ``mask_mod(b, h, q_idx, kv_idx)`` equal to ``mask`` for self-attention over ``n`` positions
    (query position == row index)."""

    def build(m):
        if isinstance(m, (And, Or)):
            fs = [build(c) for c in m.children]
            both = isinstance(m, And)

            def f(b, h, q, kv, fs=fs):
                out = fs[0](b, h, q, kv)
                for g in fs[1:]:
                    out = (out & g(b, h, q, kv)) if both else (out | g(b, h, q, kv))
                return out
            return f
        if isinstance(m, Not):
            g = build(m.children[0])
            return lambda b, h, q, kv: ~g(b, h, q, kv)
        if isinstance(m, P.Full):
            return lambda b, h, q, kv: q >= 0
        if isinstance(m, P.Causal):
            return lambda b, h, q, kv: kv <= q
        if isinstance(m, P.Window):
            w = m.w
            return lambda b, h, q, kv: (q - kv <= w) & (kv - q <= w)
        if isinstance(m, P.SlidingWindow):
            w = m.w
            return lambda b, h, q, kv: (q - kv >= 0) & (q - kv < w)
        if isinstance(m, P.GlobalTokens):
            g_ = m.g
            return lambda b, h, q, kv: (q < g_) | (kv < g_)
        if isinstance(m, P.Chunked):
            c = m.c
            return lambda b, h, q, kv: (q // c) == (kv // c)
        if isinstance(m, P.RandomBlocks):
            bs = m.block_size
            nb = -(-n // bs)
            table = np.zeros((nb, nb), dtype=bool)
            if m.r:
                np.put_along_axis(table, m.chosen(np.arange(nb), nb), True, axis=1)
            t = torch.from_numpy(table).to(device)
            return lambda b, h, q, kv: t[q // bs, kv // bs]
        if isinstance(m, P.Document):
            ids = m.ids.to(device)
            return lambda b, h, q, kv: ids[b % ids.shape[0], q] == ids[b % ids.shape[0], kv]
        dense = m.to_dense(n, n).to(device)  # any other primitive: exact table lookup
        if dense.dim() == 4:
            return lambda b, h, q, kv: dense[b % dense.shape[0], h % dense.shape[1], q, kv]
        return lambda b, h, q, kv: dense[q, kv]

    return build(mask)


FLEX_BLOCK_MASKS = ("layout", "create")
EMPTY, PARTIAL, FULL = 0, 1, 2  # block states, as in ``BlockLayout.block_states()``


def _ordered(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a boolean block matrix ``(..., Tr, Tc)``: the number of selected columns
    ``(..., Tr)`` and the column indices ``(..., Tr, Tc)``, selected ones first in ascending order,
    then the others (int32: FlexAttention's ``kv_num_blocks`` / ``kv_indices`` format, the same
    order ``create_block_mask`` produces)."""
    s = sel.to(torch.int32)
    num = s.sum(-1, dtype=torch.int32)
    idx = torch.argsort(s, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def block_mask_from_states(states: torch.Tensor, block_size: int, mask_mod) -> BlockMask:
    """A FlexAttention ``BlockMask`` from block states.

    Args:
        states: ``int8`` ``(Tr, Tc)`` or ``(B, H, Tr, Tc)``: 0 empty, 1 partial (``mask_mod`` is
            evaluated there), 2 full (every pair kept; ``mask_mod`` is skipped), on the device the
            mask is used on.
        block_size: the square block size the states were computed for.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx)`` of the pattern.

    Eager tensor operations on ``(Tr, Tc)`` blocks only: no ``L x L`` evaluation, no compilation.
    """
    while states.dim() < 4:
        states = states.unsqueeze(0)
    kv_num, kv_idx = _ordered(states == PARTIAL)
    full_num, full_idx = _ordered(states == FULL)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod)


def layout_block_states(mask: Mask, L: int, block_size: int, device) -> torch.Tensor:
    """Block states ``(Tr, Tc)`` int8 of ``mask`` for self-attention over ``L`` positions, from its
    blocksparse_fa layout (compiled from the expression in O(blocks); cached per length)."""
    return bsfa.compile_mask(mask, L, L, block_size).block_states().to(device)


def document_block_states(doc: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block states ``(B, 1, Tr, Tc)`` int8 of ``causal() & document(doc)`` from document ids
    ``doc`` ``(B, L)`` (``L`` a multiple of ``block_size``), with tensor operations on the ids' device
    (no synchronisation). A block pair is visited when it is causal and the id ranges of the two
    blocks overlap, full when it is strictly below the diagonal and both blocks hold one and the same
    id. Exact when every row's ids are sorted and step by at most 1 (packed windows: files in
    order); otherwise a superset of the visited blocks (still correct: ``mask_mod`` decides there)."""
    B, L = doc.shape
    if L % block_size:
        raise ValueError(f"document ids of length {L} are not a multiple of the block size {block_size}")
    T = L // block_size
    d = doc.view(B, T, block_size)
    lo, hi = d.amin(-1), d.amax(-1)  # (B, T)
    lo_q, hi_q, lo_k, hi_k = lo[:, :, None], hi[:, :, None], lo[:, None, :], hi[:, None, :]
    i = torch.arange(T, device=doc.device)
    causal = i[None, :, None] >= i[None, None, :]
    below = i[None, :, None] > i[None, None, :]
    visited = causal & (lo_q <= hi_k) & (lo_k <= hi_q)
    full = below & (lo_q == hi_q) & (lo_k == hi_k) & (lo_q == lo_k)
    states = torch.where(full, FULL, torch.where(visited, PARTIAL, EMPTY)).to(torch.int8)
    return states[:, None]


_FLEX = {}


def _flex_fns(compiled: bool):
    """``(flex_attention, create_block_mask)``: compiled wrappers on CUDA, the eager functions else."""
    if not compiled:
        return flex_attention, create_block_mask
    if "fns" not in _FLEX:
        _FLEX["fns"] = (torch.compile(flex_attention, dynamic=False), torch.compile(create_block_mask))
    return _FLEX["fns"]


class FlexCore(nn.Module):
    """``flex_attention`` with the block mask passed per call. On CUDA the fused kernel needs
    compilation: inside a compiled block ``flex_attention`` is traced, in eager mode a compiled
    wrapper is called; on CPU without compilation the unfused implementation runs. ``flash``:
    ``kernel_options={"BACKEND": "FLASH"}``."""

    def __init__(self, compiled_kernel: bool, flash: bool = False):
        super().__init__()
        self.compiled_kernel, self.flash = compiled_kernel, flash

    def forward(self, q, k, v, block_mask):
        fn = flex_attention if torch.compiler.is_compiling() else _flex_fns(self.compiled_kernel)[0]
        kw = {"kernel_options": {"BACKEND": "FLASH"}} if self.flash else {}
        return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1], **kw)


# ------------------------------------------------------------------------------------------------
# FlashAttention-4
# ------------------------------------------------------------------------------------------------
def varlen_args(doc: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's packed-documents arguments of a batch's ids ``(B, L)`` (CPU): ``cu_seqlens`` int32 on
    ``device`` (one sequence per run of equal ids, rows end to end), padded with empty sequences to
    ``max(64, next power of two)`` entries so that a new batch rarely changes its shape, and the
    longest run as a 0-d CPU tensor."""
    cu, longest = peers.cu_seqlens_from_ids(doc)
    n = max(64, 1 << (len(cu) - 1).bit_length())
    cu = torch.cat([cu, cu[-1:].expand(n + 1 - len(cu))])
    return cu.to(device, non_blocking=True), torch.tensor(longest)


class FA4Core(nn.Module):
    """FlashAttention-4 on the model's ``(B, H, L, D)`` views (its ``(B, L, H, D)`` layout is the
    projections' own); ``window``: a sliding window; ``arg`` (documents): :func:`varlen_args`."""

    def __init__(self, window: int | None = None, varlen: bool = False):
        super().__init__()
        self.window, self.varlen = window, varlen

    def forward(self, q, k, v, arg):
        B, H, L, D = q.shape
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.varlen:
            cu, longest = arg
            o = peers.fa4_op(q.reshape(B * L, H, D), k.reshape(B * L, k.shape[2], D),
                             v.reshape(B * L, v.shape[2], v.shape[3]), causal=True, cu_seqlens=cu, max_seqlen=longest)
            return o.view(B, L, H, -1).transpose(1, 2)
        return peers.fa4_op(q, k, v, causal=True, window=self.window).transpose(1, 2)


# ------------------------------------------------------------------------------------------------
# blocksparse_fa
# ------------------------------------------------------------------------------------------------
@torch.compiler.disable
def _island(fn, q, k, v):
    return fn(q, k, v)


class BsfaCore(nn.Module):
    """A static pattern: ``nn.BlockSparseAttention`` (``api="module"``), ``bsfa.attention`` or
    ``bsfa.attention_op`` with the mask as a module attribute."""

    def __init__(self, mask: Mask, block_size: int, island: bool, api: str = "module", kernel_options=None):
        super().__init__()
        self.attn = BlockSparseAttention(mask, block_size=block_size, kernel_options=kernel_options)
        self.mask, self.block_size, self.island, self.api = mask, block_size, island, api
        self.kernel_options = kernel_options

    def _call(self, q, k, v):
        if self.api == "module":
            return self.attn(q, k, v)
        fn = bsfa.attention if self.api == "attention" else bsfa.attention_op
        return fn(q, k, v, mask=self.mask, block_size=self.block_size, kernel_options=self.kernel_options)

    def forward(self, q, k, v, arg):
        return _island(self._call, q, k, v) if self.island else self._call(q, k, v)


class BsfaDocCore(nn.Module):
    """Packed documents. ``op``: the mask ``causal() & document(ids)`` is built from the per-batch
    ids inside the (compiled) forward. ``island``: :meth:`prepare` compiles the batch's layout once,
    outside the model, and every layer uses it."""

    def __init__(self, block_size: int, island: bool, L: int, device, api: str = "attention", kernel_options=None):
        super().__init__()
        self.block_size, self.island, self.L, self.device, self.api = block_size, island, L, device, api
        self.kernel_options = kernel_options
        self._layout = None

    def prepare(self, doc_cpu: torch.Tensor) -> None:
        mask = bsfa.causal() & bsfa.document(doc_cpu)
        self._layout = bsfa.compile_mask(mask, self.L, self.L, self.block_size, device=self.device, cache=False)

    def _island_call(self, q, k, v):
        return bsfa.attention(q, k, v, mask=self._layout, kernel_options=self.kernel_options)

    def forward(self, q, k, v, doc):
        if self.island:
            return _island(self._island_call, q, k, v)
        fn = bsfa.attention_op if self.api == "attention_op" else bsfa.attention
        # the window's files are contiguous runs of tokens: promised, so no id compare is needed
        return fn(q, k, v, mask=bsfa.causal() & bsfa.document(doc, contiguous=True), block_size=self.block_size,
                  kernel_options=self.kernel_options)


# ------------------------------------------------------------------------------------------------
# the variant object
# ------------------------------------------------------------------------------------------------
class Variant:
    """A core plus how to feed it per batch.

    Attributes:
        name, impl, family: ``"bsfa_longformer"``, ``"bsfa"``, ``"longformer"``.
        core: the attention core (shared by all layers).
        fullgraph: whether a compiled block traces it without graph breaks.
        info: what was chosen (SDPA backend, bsfa mode, pattern text).
    """

    def __init__(self, name: str, L: int, pats: Patterns, device: torch.device, *, compiled: bool,
                 bsfa_mode: str = "op", bsfa_api: str = "module", bsfa_kernel_options: str = "", heads: int = 8,
                 kv_heads: int = 2, head_dim: int = 128, flex_block_mask: str = "layout"):
        self.name = name
        self.impl, self.family = split_name(name)
        self.L, self.pats, self.device = L, pats, device
        self.fullgraph = True
        self.info: dict = {"pattern": pats.describe()[self.family] if self.impl != "sdpa" else "causal() (dense)"}
        self._static_arg = None
        cuda = device.type == "cuda"
        if self.impl == "sdpa":
            choice = pick_sdpa(device, heads, kv_heads, head_dim)
            self.core = SDPACore(choice["backends"], choice["expand_kv"])
            self.info["sdpa_backend"] = choice["label"]
            if choice.get("rejected"):
                self.info["sdpa_rejected"] = choice["rejected"]
        elif self.impl == "fa4":
            if self.family not in ("causal", "sliding", "documents"):
                raise ValueError(f"FA4 has no form of the {self.family} pattern (causal, sliding, documents only)")
            window = pats.sliding_window if self.family == "sliding" else None
            self.core = FA4Core(window=window, varlen=self.family == "documents")
            self.info["fa4"] = "flash_attn_varlen_func (one sequence per document)" if self.family == "documents" \
                else f"flash_attn_func(causal=True, window_size={peers.fa4_window(window)})"
        elif self.impl in ("flex", "flexflash"):
            if flex_block_mask not in FLEX_BLOCK_MASKS:
                raise ValueError(f"flex_block_mask must be one of {FLEX_BLOCK_MASKS}, got {flex_block_mask!r}")
            self.core = FlexCore(compiled_kernel=cuda, flash=self.impl == "flexflash")
            self.info["flex_backend"] = "FLASH" if self.impl == "flexflash" else "Triton"
            self.flex_block_mask = flex_block_mask
            self.info["flex_block_mask"] = {"layout": "BlockMask.from_kv_blocks (block states)",
                                            "create": "create_block_mask"}[flex_block_mask]
            if self.family == "documents":
                self._doc_buf = None  # (B, L) int32 on device, filled per batch; the mask_mod reads it
                self._doc_mod = None
            else:
                mod = mask_mod_from(pats.mask(self.family), L, device)
                if flex_block_mask == "layout":
                    states = layout_block_states(pats.mask(self.family), L, pats.block_size, device)
                    self._static_arg = block_mask_from_states(states, pats.block_size, mod)
                else:
                    self._static_arg = _flex_fns(cuda)[1](mod, None, None, L, L, device=device,
                                                          BLOCK_SIZE=pats.block_size)
        else:
            island = bsfa_mode == "island" or not compiled
            opts = json.loads(bsfa_kernel_options) if bsfa_kernel_options else None
            if opts is not None:
                if not isinstance(opts, dict):
                    raise ValueError(f"bsfa_kernel_options must be a JSON object, got {bsfa_kernel_options!r}")
                self.info["bsfa_kernel_options"] = opts
            self.info["bsfa_mode"] = "eager" if not compiled else bsfa_mode
            if self.family == "documents":
                api = "attention_op" if bsfa_api == "attention_op" else "attention"
                self.core = BsfaDocCore(pats.block_size, island, L, device, api=api, kernel_options=opts)
                self.info["bsfa_api"] = "bsfa.attention_op" if api == "attention_op" else "bsfa.attention"
            else:
                self.core = BsfaCore(pats.mask(self.family), pats.block_size, island, api=bsfa_api,
                                     kernel_options=opts)
                self.info["bsfa_api"] = {"module": "nn.BlockSparseAttention", "attention": "bsfa.attention",
                                         "attention_op": "bsfa.attention_op"}[bsfa_api]
            self.fullgraph = not island

    def arg(self, batch_cpu, batch_dev):
        """The per-batch argument of the core (built outside the compiled model)."""
        if self.impl == "fa4":
            return varlen_args(batch_cpu.doc, self.device) if self.family == "documents" else None
        if self.impl in ("flex", "flexflash"):
            if self.family != "documents":
                return self._static_arg
            if self._doc_buf is None or self._doc_buf.shape != batch_dev.doc.shape:
                self._doc_buf = torch.zeros_like(batch_dev.doc)
                buf = self._doc_buf
                self._doc_mod = lambda b, h, q, kv: (kv <= q) & (buf[b, q] == buf[b, kv])
            self._doc_buf.copy_(batch_dev.doc, non_blocking=True)
            bs = self.pats.block_size
            if self.flex_block_mask == "layout":
                return block_mask_from_states(document_block_states(self._doc_buf, bs), bs, self._doc_mod)
            B = batch_dev.doc.shape[0]
            return _flex_fns(self.device.type == "cuda")[1](self._doc_mod, B, None, self.L, self.L,
                                                            device=self.device, BLOCK_SIZE=bs)
        if self.impl == "bsfa" and self.family == "documents":
            if self.core.island:
                self.core.prepare(batch_cpu.doc)
                return None
            return batch_dev.doc
        return None
