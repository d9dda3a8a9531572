"""Reachability analysis: hand-checkable graphs, agreement with networkx shortest paths, the CLI and
the docs table generator."""

from __future__ import annotations

import json
import sys

import networkx as nx
import numpy as np
import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.analysis.reach import analyze, block_adjacency, block_graph, layer_distances
from blocksparse_fa.cli.main import main as cli_main


def test_causal_never_mixes_fully_but_covers_the_past_in_one_layer():
    r = analyze("causal", 1024, layers=2, block_size=128)
    assert r.n_blocks == 8 and r.n_edges == 36
    assert not r.strongly_connected and r.n_components == 8
    assert r.diameter is None and r.causal_layers == 1 and r.closure_layers == 1
    assert r.reach_fraction == pytest.approx(36 / 64)
    assert r.causal_reach_fraction == 1.0


def test_sliding_window_needs_length_over_window_layers():
    # window of 256 keys at block 128: block r sees blocks r-2..r (partially r-2), so a hop covers 2 blocks
    r = analyze("sliding_window(256)", 2048, layers=3, block_size=128)
    assert r.n_blocks == 16
    assert r.causal_layers == 8  # ceil(15 / 2)
    assert r.diameter is None
    lower = np.tril(np.ones((16, 16), dtype=bool))
    assert r.causal_reach_fraction == pytest.approx(((r.dist <= 3) & (r.dist >= 0))[lower].mean())
    assert r.causal_reach_fraction < 1.0


def test_global_tokens_make_a_hub_and_diameter_two():
    r = analyze("window(128) | global_tokens(64)", 4096, layers=1, block_size=128)
    assert r.strongly_connected and r.diameter == 2 and r.causal_layers == 2
    assert r.hubs_degree[0][0] == 0 and r.hubs_betweenness[0][0] == 0
    assert r.hubs_betweenness[0][1] > 0.5
    assert r.reach_fraction < 0.5  # one layer: only the band and the hub
    r2 = analyze("window(128) | global_tokens(64)", 4096, layers=2, block_size=128)
    assert r2.reach_fraction == 1.0


def test_chunks_never_connect():
    r = analyze("causal & chunked(512)", 2048, layers=6, block_size=128)
    assert r.causal_layers is None and r.diameter is None
    assert r.eventual_fraction == pytest.approx(4 * 10 / 256)  # 4 chunks of 4 blocks, 10 causal pairs each


@pytest.mark.parametrize("text", ["bigbird(window=64, n_global=32, n_random=2, block=64)",
                                  "causal & (sliding_window(200) | strided(300))", "prefix_lm(300)"])
def test_distances_agree_with_networkx(text):
    mask = bsfa.parse(text)
    lay = bsfa.compile_mask(mask, 1500, 1500, 64)
    adj = block_adjacency(lay)
    dist = layer_distances(adj)
    g = block_graph(lay)
    want = np.full_like(dist, -1)
    for src, lengths in nx.all_pairs_shortest_path_length(g):
        for dst, d in lengths.items():
            want[dst, src] = d  # edge c -> r; dist is indexed [query r, key c]
    np.testing.assert_array_equal(dist, want)
    r = analyze(mask, 1500, 3, 64)
    if r.strongly_connected:
        assert r.diameter == nx.diameter(g)
    assert g.nodes[1]["positions"] == (64, 128)
    # adjacency agrees with the dense mask at block granularity
    dense = mask.to_dense(1500, 1500)
    pad = torch.zeros(24 * 64, 24 * 64, dtype=torch.bool)
    pad[:1500, :1500] = dense
    np.testing.assert_array_equal(adj, pad.view(24, 64, 24, 64).any(3).any(1).numpy())


def test_analyze_validates():
    with pytest.raises(ValueError, match="layers"):
        analyze("causal", 256, layers=-1)
    with pytest.raises(TypeError):
        analyze(3, 256, layers=1)


def test_cli_analyze(capsys):
    assert cli_main(["analyze", "longformer", "--len", "4096", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "diameter): 2" in out and "1.0000 of all" in out
    assert cli_main(["analyze", "causal & sliding_window(512)", "--len", "4096", "--layers", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["diameter"] is None and d["causal_layers"] == 8 and d["n_blocks"] == 32
    assert cli_main(["analyze", "document_causal", "--len", "4096", "--layers", "2"]) == 2
    assert "--documents" in capsys.readouterr().err
    assert cli_main(["analyze", "document_causal", "--len", "4096", "--layers", "2", "--documents", "1024"]) == 0
    assert "never" in capsys.readouterr().out


def test_analysis_table_writes_every_pattern(tmp_path):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "analysis_table.py"
    spec = importlib.util.spec_from_file_location("analysis_table", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "analysis.md"
    assert mod.main(["--len", "2048", "--layers", "2", "--out", str(out)]) == 0
    text = out.read_text()
    for name in bsfa.list_patterns():
        assert f"| {name} |" in text
    assert "reach@2" in text


@pytest.mark.parametrize("text", ["window(128) | global_tokens(64)", "causal & sliding_window(300)", "bigbird"])
def test_betweenness_in_batches_equals_networkx(text):
    from blocksparse_fa.analysis.reach import _betweenness

    mask = bsfa.load_pattern(text) if text == "bigbird" else bsfa.parse(text)
    g = nx.DiGraph(block_graph(bsfa.compile_mask(mask, 4096, 4096, 128)))
    g.remove_edges_from(nx.selfloop_edges(g))
    want = nx.betweenness_centrality(g)
    got = _betweenness(g, None)
    assert max(abs(got[v] - want[v]) for v in g) < 1e-12
    if max(want.values()) > 0.5:  # a clear hub (global tokens): the sampled estimate (n / k scaling) finds it
        est = _betweenness(g, 16)
        assert max(est, key=est.get) == max(want, key=want.get)
        assert est[max(want, key=want.get)] == pytest.approx(max(want.values()), rel=0.25)


def test_analyze_progress_bars(fake_tqdm):
    made = fake_tqdm
    quiet = analyze("window(128) | global_tokens(64)", 8192, 2, 128, exact_betweenness_max=20)
    assert not made
    loud = analyze("window(128) | global_tokens(64)", 8192, 2, 128, exact_betweenness_max=20, progress=True)
    assert [b.desc for b in made] == ["betweenness"] and made[0].n == made[0].total == 20
    assert loud.to_dict() == quiet.to_dict()


def test_missing_networkx_names_the_extra(monkeypatch):
    import importlib

    import blocksparse_fa.analysis as an

    monkeypatch.setitem(sys.modules, "networkx", None)  # as if networkx were not installed
    monkeypatch.delitem(sys.modules, "blocksparse_fa.analysis.reach")
    monkeypatch.delattr(an, "reach")
    with pytest.raises(ImportError, match=r"pip install 'blocksparse_fa\[analysis\]'"):
        importlib.import_module("blocksparse_fa.analysis.reach")

    with pytest.raises(ImportError, match=r"\[analysis\]"):
        an.analyze  # noqa: B018  (the lazy attribute imports reach)
