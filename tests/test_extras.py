"""A missing optional extra names itself: the feature that needs it raises an ImportError that says
which ``pip install 'blocksparse_fa[...]'`` to run (simulated by hiding the module)."""

from __future__ import annotations

import importlib
import sys

import pytest

import blocksparse_fa as bsfa


def _hide(monkeypatch, *modules):
    for name in list(sys.modules):
        if any(name == m or name.startswith(m + ".") for m in modules):
            monkeypatch.delitem(sys.modules, name)
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)  # `import m` now raises ImportError


@pytest.mark.parametrize("call", ["register", "unregister", "make_mask_function"])
def test_transformers_hook_names_the_hf_extra(monkeypatch, call):
    hook = importlib.import_module("blocksparse_fa.integrations.transformers")
    _hide(monkeypatch, "transformers")
    with pytest.raises(ImportError, match=r"pip install 'blocksparse_fa\[hf\]'"):
        getattr(hook, call)(*(["causal"] if call == "register" else []))


def test_reachability_names_the_analysis_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "blocksparse_fa.analysis.reach", raising=False)  # import it afresh
    _hide(monkeypatch, "networkx")
    with pytest.raises(ImportError, match=r"pip install 'blocksparse_fa\[analysis\]'"):
        importlib.import_module("blocksparse_fa.analysis.reach")


def test_plot_names_the_plot_extra(monkeypatch):
    layout = bsfa.compile_mask(bsfa.causal(), 256, 256, block_size=64)
    _hide(monkeypatch, "matplotlib")
    with pytest.raises(ImportError, match=r"pip install 'blocksparse_fa\[plot\]'"):
        layout.plot()
