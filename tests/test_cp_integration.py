"""Context parallelism in the integrations, on 2 gloo processes (CPU, float64): the training
benchmark's ``cp`` mode (``benchmarks/train/cp.py``, packed documents with a plan per batch
included) and the transformers hook with ``context_parallel=``. Each equals the single-process run
of the same model on the same data: the training run's per-step losses and first-step parameter
gradients, the hooked model's logits and parameter gradients. The scaling benchmark
(``benchmarks/context_parallel.py run --device cpu --smoke``) runs end to end and writes its
results and the documentation's results section. Every process and collective runs under a
timeout."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import distributed_train_cases as cases_mod
from spawn_ranks import run_ranks

torch_dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(not torch_dist.is_available(), reason="torch.distributed is not available")

PROCESS_TIMEOUT = 120
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

TRAIN_CASES = [
    dict(kind="train", name="train longformer greedy", pattern="longformer", strategy="greedy", L=128),
    dict(kind="train", name="train causal zigzag", pattern="causal", strategy="zigzag", L=96),
    dict(kind="train", name="train documents (a plan per batch)", pattern="documents", strategy="contiguous", L=128),
]
HF_CASES = [dict(kind="hf", name="hf llama zigzag", L=96, strategy="zigzag"),
            dict(kind="hf", name="hf llama contiguous", L=128, strategy="contiguous")]


def _run(world, cases, tmp_path):
    results = {}
    for rank, name, ok, res in run_ranks(cases_mod.worker, world, cases, str(tmp_path / f"store{world}"),
                                         PROCESS_TIMEOUT):
        assert ok, f"rank {rank}, {name}:\n{res}"
        if rank == 0:
            results[name] = res
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    cases = TRAIN_CASES + (HF_CASES if HAS_TRANSFORMERS else [])
    return _run(2, cases, tmp_path_factory.mktemp("cp"))


def _rel(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("case", TRAIN_CASES, ids=lambda c: c["name"])
def test_train_cp_equals_single_process(two_ranks, case):
    got = two_ranks[case["name"]]
    ref = cases_mod.run_train_reference(case)
    assert len(got["losses"]) == len(ref["losses"]) == 3
    assert got["losses"][0] > 1.0  # a real loss (cross-entropy of an untrained model), not zeros
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-9, abs=0)
    for n in cases_mod.CAPTURE:
        assert ref["grads"][n].abs().max() > 0
        assert _rel(got["grads"][n], ref["grads"][n]) < 1e-9, n
    want = case["strategy"]
    assert want in got["plan"]


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: c["name"])
def test_transformers_cp_equals_single_process(two_ranks, case):
    got = two_ranks[case["name"]]
    ref = cases_mod.run_hf_reference(case)
    assert got["logits"].shape == ref["logits"].shape
    assert _rel(got["logits"], ref["logits"]) < 1e-10
    for n in cases_mod.HF_CAPTURE:
        assert ref["grads"][n].abs().max() > 0
        assert _rel(got["grads"][n], ref["grads"][n]) < 1e-9, n


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_transformers_cp_bad_input_is_refused():
    import blocksparse_fa as bsfa
    from blocksparse_fa.distributed import plan_context_parallel
    from blocksparse_fa.integrations.transformers import make_cp_mask_function, register, unregister

    plan = plan_context_parallel("causal & window(8)", 64, 2, block_size=16)
    with pytest.raises(ValueError, match="plan needs context_parallel"):
        register("window(8)", name="bsfa_cp_bad", plan=plan)
    with pytest.raises(ValueError, match=r"needs a plan for window\(8\) & causal"):
        register("window(8)", name="bsfa_cp_bad", context_parallel=object(), plan=plan)
    ok = plan_context_parallel(bsfa.parse("window(8)") & bsfa.causal(), 64, 2, block_size=16)
    assert register("window(8)", name="bsfa_cp_ok", context_parallel=object(), plan=ok) == "bsfa_cp_ok"
    unregister("bsfa_cp_ok")
    fn = make_cp_mask_function()
    assert fn(2, 32, 32, attention_mask=torch.ones(2, 32)) is None
    with pytest.raises(ValueError, match="padding"):
        fn(2, 32, 32, attention_mask=torch.ones(2, 32).index_fill(1, torch.tensor([0]), 0))
    with pytest.raises(ValueError, match="without a cache"):
        fn(1, 1, 33, q_offset=32)


FSDP_CASES = [dict(kind="fsdp", name="fsdp2 dp x cp longformer", pattern="longformer", strategy="zigzag", L=96)]


def test_fsdp2_on_dp_with_cp_equals_single_process(tmp_path):
    got = _run(4, FSDP_CASES, tmp_path)[FSDP_CASES[0]["name"]]
    ref = cases_mod.run_fsdp_reference(FSDP_CASES[0])
    assert ref["loss"] > 1.0 and got["loss"] == pytest.approx(ref["loss"], rel=1e-12)
    for n in cases_mod.FSDP_CAPTURE:
        assert ref["grads"][n].abs().max() > 0
        assert _rel(got["grads"][n], ref["grads"][n]) < 1e-9, n
        assert _rel(got["params"][n], ref["params"][n]) < 1e-9, n


def test_benchmark_runs_end_to_end_on_two_cpu_ranks(tmp_path):
    """``context_parallel.py run --device cpu --smoke`` under a torchrun-like rendezvous: scaling rows
    with errors against one process and float64, a training row whose losses equal one process's,
    the JSON and Markdown, and the results section of a copy of docs/distributed.md regenerated."""
    import json
    import pathlib
    import socket

    root = pathlib.Path(__file__).resolve().parents[1]
    docs = tmp_path / "distributed.md"
    docs.write_text((root / "docs" / "distributed.md").read_text())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["run", "--device", "cpu", "--smoke", "--patterns", "causal", "documents", "--sections", "scaling",
            "train", "--train-patterns", "documents", "--out", str(tmp_path / "out"), "--deadline", "100",
            "--timeout", "60", "--update-docs", "--docs", str(docs), "--docs-data", str(tmp_path / "data.json")]
    for rank, name, ok, res in run_ranks(cases_mod.bench_worker, 2, dict(port=port, argv=argv),
                                         str(tmp_path / "store"), PROCESS_TIMEOUT):
        assert ok, f"rank {rank}:\n{res}"
    res = json.loads((tmp_path / "out" / "context_parallel.json").read_text())
    assert not res["errors"] and not res["skipped"], (res["errors"], res["skipped"])
    rows = {r["pattern"]: r for r in res["sections"]["scaling"]}
    assert set(rows) == {"causal", "documents"}
    for r in rows.values():
        assert r["TP_fb_ms"] > 0 and r["eff_fb"] > 0
        assert max(r[f"{k}_vs_single"] for k in ("out", "dq", "dk", "dv")) < 1e-5  # float32 on CPU
        assert r["within_2x"] and r["out_err_single"] < 1e-5
    (train,) = res["sections"]["train"]
    assert train["pattern"] == "documents" and train["max_rel_loss_diff"] < 1e-5
    assert (tmp_path / "out" / "context_parallel.md").read_text().startswith("Device: 2x cpu")
    text = docs.read_text()
    head, _, tail = text.partition("<!-- results -->")
    assert "**Strong scaling**" in tail and "**Training**" in tail and "## Testing" in tail
    assert head == (root / "docs" / "distributed.md").read_text().partition("<!-- results -->")[0]
    assert json.loads((tmp_path / "data.json").read_text())["world_size"] == 2
