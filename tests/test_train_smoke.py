"""Smoke test of benchmarks/train_long_context.py at a tiny CPU size: a few steps of every CPU
variant, finite and decreasing loss, the reports written; plus the task generator and the
FlexAttention mask_mod translation (evaluated densely, no CUDA needed)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import torch

import blocksparse_fa as bsfa

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "train_long_context.py"


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("train_long_context", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_training_runs_and_learns(train, tmp_path):
    payload = train.main(["--device", "cpu", "--seq-len", "256", "--layers", "2", "--d-model", "64", "--heads", "4",
                          "--kv-heads", "2", "--steps", "10", "--batch", "2", "--block-size", "32",
                          "--eval-batches", "1", "--threads", "1",
                          "--variants", "sdpa,bsfa_longformer,bsfa_bigbird,flex_longformer", "--quiet",
                          "--out", str(tmp_path)])
    res = payload["results"]
    assert "skipped" in res["flex_longformer"]  # CUDA only
    for name in ("sdpa", "bsfa_longformer", "bsfa_bigbird"):
        r = res[name]
        losses = r["losses"]
        assert len(losses) == 10 and all(np.isfinite(losses))
        assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.05, (name, losses)
        assert r["tokens_per_s"] > 0 and 0 < r["block_density"] <= 0.5 + 1e-9
        assert 0.0 <= r["eval_accuracy"]["all"] <= 1.0
    # same initial weights and data: the first losses agree across variants up to the attention pattern
    assert abs(res["sdpa"]["losses"][0] - res["bsfa_longformer"]["losses"][0]) < 0.05
    assert res["bsfa_longformer"]["block_density"] < res["sdpa"]["block_density"]
    data = json.loads((tmp_path / "training_results.json").read_text())
    assert set(data["results"]) == {"sdpa", "bsfa_longformer", "bsfa_bigbird", "flex_longformer"}
    md = (tmp_path / "training.md").read_text()
    assert "| bsfa_bigbird |" in md and "training_loss.png" in md
    assert (tmp_path / "training_loss.png").stat().st_size > 1000


def test_task_labels_point_at_earlier_keys(train):
    args = train.parse_args(["--device", "cpu", "--seq-len", "128", "--batch", "2", "--s-min", "4", "--s-max", "16"])
    tokens, labels, gaps = train.make_batch(args, torch.Generator().manual_seed(0))
    K = args.key_vocab
    assert tokens.shape == (2, 128)
    assert ((tokens[:, 0::2] >= 1) & (tokens[:, 0::2] <= K)).all()  # keys
    assert (tokens[:, 1::2] > K).all()  # values
    b, t = torch.nonzero(labels >= 0, as_tuple=True)
    assert len(t) > 0 and (t % 2 == 0).all()
    assert (labels[b, t] == tokens[b, t + 1]).all()  # the label is the next (value) token
    g = gaps[b, t]
    assert (g > 0).all() and (g % 2 == 0).all()
    assert (tokens[b, t - g] == tokens[b, t]).all()  # the key occurred gap tokens earlier...
    assert (tokens[b, t - g + 1] == tokens[b, t + 1]).all()  # ...with the same value


@pytest.mark.parametrize("text", ["causal & longformer(window=20, n_global=5)",
                                  "causal & bigbird(window=16, n_global=8, n_random=2, block=32)",
                                  "causal & (chunked(48) | ~sliding_window(3))", "prefix_lm(10)"])
def test_flex_mask_mod_equals_mask(train, text):
    mask = bsfa.parse(text)
    n = 100
    mod = train.mask_mod_from(mask, n, "cpu")
    q = torch.arange(n).view(n, 1)
    kv = torch.arange(n).view(1, n)
    got = mod(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, kv)
    assert torch.equal(got.expand(n, n), mask.to_dense(n, n))
