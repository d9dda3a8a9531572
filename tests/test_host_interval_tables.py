"""The Gluon backward's interval tables of compiled layouts (``ops/triton_backend._gluon_bwd_interval_tables``):
the same tensors as the device-interval path builds for the same intervals, and tables that cover
the mask (every kept pair visited, blocks run unmasked only where every row keeps them whole).

The Gluon kernels do not run on the CPU; ``tests/test_cuda.py`` checks their gradients on a GPU."""

import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.compiler.device_intervals import interval_spec
from blocksparse_fa.ops import triton_backend as tb
from blocksparse_fa.compiler.device_intervals import gluon_backward_tables
from blocksparse_fa.ops.options import GluonBwdConfig

CPU = torch.device("cpu")
L = 1024
LENS = [100, 300, 24, 1, 599]
IDS = torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS))
CFGS = [GluonBwdConfig(), GluonBwdConfig(block_m=128, block_n=64, dq_block_m=64, dq_block_n=64)]


def _device_tables(mask, q_len, kv_len, cfg):
    """What ``ops/interval_backend.gluon_interval_backward`` launches for ``mask``: ``(lo, hi,
    kv_tab, q_tab, lzb, lzh)``."""
    iv = interval_spec(mask, q_len, kv_len, require_tensor=False).bounds(CPU)
    assert iv.qid is None and iv.ilo is None and iv.lo.shape[1] == 1
    zb = iv.lo.shape[0]
    return (iv.lo.view(zb, q_len), iv.hi.view(zb, q_len), *gluon_backward_tables(iv, kv_len, cfg),
            1 if zb > 1 else 0, 0)


DEVICE_MASKS = {
    "documents": lambda: bsfa.causal() & bsfa.document(IDS),
    "documents per batch row": lambda: bsfa.causal() & bsfa.document(torch.stack([IDS, IDS.flip(0)])),
    "documents & window": lambda: bsfa.causal() & bsfa.document(IDS) & bsfa.sliding_window(200),
    "sliding_window": lambda: bsfa.sliding_window(256),
    "prefix_lm": lambda: bsfa.prefix_lm(300),
}


@pytest.mark.parametrize("cfg", CFGS, ids=["default", "128x64"])
@pytest.mark.parametrize("name", list(DEVICE_MASKS))
def test_tables_equal_the_device_paths(name, cfg):
    """The host layout's tables (from ``row_interval``) and the device path's (from the device
    intervals of the same mask, documents by cu_seqlens-style contiguous ids) agree bit for bit."""
    host_mask, dev_mask = DEVICE_MASKS[name](), DEVICE_MASKS[name]()
    layout = bsfa.compile_mask(host_mask, L, L, 128)
    host = tb._gluon_bwd_interval_tables(layout, cfg, CPU)
    dev = _device_tables(dev_mask, L, L, cfg)
    for what, a, b in zip(("lo", "hi", "kv_tab", "q_tab"), host[:4], dev[:4]):
        assert a.dtype == b.dtype == torch.int32 and a.is_contiguous(), what
        assert torch.equal(a, b), what
    assert host[4:6] == dev[4:6]  # instance strides
    assert host[6] is None  # every row keeps a key
    assert tb._gluon_bwd_interval_tables(layout, cfg, CPU) is host  # built once per layout and tiles


def _check_cover(dense, lo, hi, kv_tab, q_tab, cfg):
    """``dense`` bool ``(Lq, Lk)`` of one instance against its intervals and tables."""
    lq, lk = dense.shape
    j = torch.arange(lk)
    assert torch.equal(dense, (j >= lo[:, None].long()) & (j < hi[:, None].long()))
    nonempty = dense.any(1)
    rows, keys = 2 * cfg.dq_block_m, cfg.dq_block_n  # dQ: row tiles, key blocks
    assert q_tab.shape == (lq // rows, 4)
    for t, (first, f0, f1, end) in enumerate(q_tab.tolist()):
        assert first < end and first <= f0 <= f1 <= end
        tile = dense[t * rows:(t + 1) * rows]
        blocks = torch.nonzero(tile.any(0)).flatten() // keys
        assert bool(((blocks >= first) & (blocks < end)).all()), t
        whole = tile[nonempty[t * rows:(t + 1) * rows]][:, f0 * keys:f1 * keys]
        assert bool(whole.all()), t
    rows, keys = cfg.block_m, 2 * cfg.block_n  # dK/dV: key tiles, row blocks
    assert kv_tab.shape == (lk // keys, 4)
    for c, (first, f0, f1, end) in enumerate(kv_tab.tolist()):
        assert first < end and first <= f0 <= f1 <= end
        tile = dense[:, c * keys:(c + 1) * keys]
        blocks = torch.nonzero(tile.any(1)).flatten() // rows
        assert bool(((blocks >= first) & (blocks < end)).all()), c
        part = tile[f0 * rows:f1 * rows]
        assert bool(part[nonempty[f0 * rows:f1 * rows]].all()), c


COVER_MASKS = {
    "sliding_window": (lambda: bsfa.sliding_window(200), L, L),
    "documents": (lambda: bsfa.causal() & bsfa.document(IDS), L, L),
    "prefix_lm": (lambda: bsfa.prefix_lm(300), L, L),
    "anti-causal": (lambda: ~bsfa.causal(), L, L),
    "causal, q offset": (lambda: bsfa.causal(), 512, L),
    "empty rows": (lambda: bsfa.causal() & bsfa.window(90) & bsfa.query_range(130, 700), L, L),
    "per batch row": (lambda: bsfa.causal() & bsfa.document(torch.stack([IDS, IDS.flip(0)])), L, L),
}


@pytest.mark.parametrize("cfg", CFGS, ids=["default", "128x64"])
@pytest.mark.parametrize("name", list(COVER_MASKS))
def test_tables_cover_the_mask(name, cfg):
    make, q_len, kv_len = COVER_MASKS[name]
    mask = make()
    layout = bsfa.compile_mask(mask, q_len, kv_len, 128)
    lo, hi, kv_tab, q_tab, lzb, lzh, empty, kv_ord = tb._gluon_bwd_interval_tables(layout, cfg, CPU)
    dense = mask.to_dense(q_len, kv_len)
    dense = dense.reshape(-1, *dense.shape[-2:])  # (Zb, Lq, Lk): one head per batch row
    assert lo.shape == (dense.shape[0], q_len) and (lzb, lzh) == (1 if dense.shape[0] > 1 else 0, 0)
    for z in range(dense.shape[0]):
        _check_cover(dense[z], lo[z], hi[z], kv_tab[z, 0], q_tab[z, 0], cfg)
        # the persistent dK/dV kernel's order: every key tile once, heaviest first
        steps = (kv_tab[z, 0, :, 3] - kv_tab[z, 0, :, 0])[kv_ord[z].long()]
        assert kv_ord.dtype == torch.int32 and sorted(kv_ord[z].tolist()) == list(range(kv_tab.shape[2]))
        assert bool((steps[:-1] >= steps[1:]).all())
        if empty is None:
            assert bool(dense[z].any(1).all())
        else:
            assert torch.equal(empty[z, 0], ~dense[z].any(1))
