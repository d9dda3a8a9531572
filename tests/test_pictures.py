"""BlockLayout's pictures: the ASCII grid and its legend, and the matplotlib plot (legend, no pyplot
state, a clear message without matplotlib)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import blocksparse_fa as bsfa
from blocksparse_fa import compile_mask


def _grid(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln and set(ln) <= set(".+#:")]


def test_legend_line_names_every_character_in_use():
    small = compile_mask(bsfa.causal(), 64, 64, 16).ascii()
    legend = small.splitlines()[2]
    assert legend == "  . empty  + partial (some pairs kept)  # full"
    big = compile_mask(bsfa.causal(), 4096, 4096, 16).ascii(width=16)
    legend = big.splitlines()[2]
    assert ": mixed (some blocks empty, some not)" in legend and "# full" in legend and ". empty" in legend
    for text in (small, big):  # every character of the grid is explained
        used = set("".join(_grid(text)))
        assert used and all(f"{c} " in text.splitlines()[2] for c in used)


def test_downsampled_strided_pattern_is_not_drawn_solid():
    """Sparse Transformer strided at block 128: a checkerboard of empty and partial blocks below the
    diagonal. Cells of 4x4 blocks mix them, and say so (':'), instead of the solid '+' triangle."""
    lay = compile_mask(bsfa.load_pattern("sparse_transformer_strided"), 16384, 16384, 128)
    st = lay.block_states().numpy()
    assert (st[2:, :-2][np.tril(np.ones((126, 126), bool))] == 0).any()  # empty blocks below the band
    grid = _grid(lay.ascii(width=32))
    assert len(grid) == 32
    below = "".join(row[:i] for i, row in enumerate(grid))
    assert set(below) == {":"}
    # at full resolution the checkerboard itself shows
    full = _grid(lay.ascii(width=128))
    assert full[6][:8] == "+.+.+#+."
    # all-partial cells stay '+', all-full '#', all-empty '.'
    dense_band = _grid(compile_mask(bsfa.causal(), 8192, 8192, 128).ascii(width=16))
    assert dense_band[0] == ":" + "." * 15 and dense_band[5][:5] == "#####"
    windows = _grid(compile_mask(bsfa.window(40), 512, 512, 32).ascii(width=8))
    assert windows[3] == "..:+:..."  # diagonal cells: 2x2 kept blocks with partial ones; beside them, mixed


def test_plot_has_a_legend_and_leaves_pyplot_alone(tmp_path, monkeypatch):
    mpl = pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    old_backend = mpl.get_backend()
    try:
        mpl.use("svg")  # the user's own choice
        import matplotlib.pyplot as plt

        before = plt.get_fignums()

        def no_switch(*args, **kwargs):
            raise AssertionError("plot() must not switch the matplotlib backend")

        monkeypatch.setattr(mpl, "use", no_switch)
        lay = compile_mask(bsfa.load_pattern("bigbird", window=64, n_global=32, block=32), 512, 512, 32)
        path = tmp_path / "layout.png"
        fig = lay.plot(path)
        assert isinstance(fig, Figure)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert mpl.get_backend() == "svg" and plt.get_fignums() == before
        texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert texts == ["empty", "partial (some pairs kept)", "full"]
        # on the caller's axes
        fig2 = Figure()
        ax = fig2.add_subplot()
        assert lay.plot(ax=ax) is fig2 and ax.get_legend() is not None
    finally:
        monkeypatch.undo()
        mpl.use(old_backend)


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    for mod in ("matplotlib", "matplotlib.colors", "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, mod, None)
    lay = compile_mask(bsfa.causal(), 256, 256, 64)
    with pytest.raises(ImportError, match=r"pip install 'blocksparse_fa\[plot\]'"):
        lay.plot()
