"""The GPU benchmarks' shared code on CPU: the row-chunked float64 reference, the peers' argument
builders, a dry run of ``bench.py`` (tables and JSON, missing peers reported as n/a), the output
rules (nothing under ``docs/`` without ``--update-docs``) and the sweep script's syntax."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

import blocksparse_fa as bsfa

ROOT = pathlib.Path(__file__).resolve().parents[1]
_BENCH = ROOT / "benchmarks"
if str(_BENCH) not in sys.path:
    sys.path.insert(0, str(_BENCH))

import bench  # noqa: E402
import harness  # noqa: E402
import peers  # noqa: E402


@pytest.mark.parametrize("upcast", [True, False])
def test_chunked_reference_equals_reference_attention(upcast):
    """Query rows in chunks, the mask from the mask_mod, dK/dV summed over chunks: the same O, dQ,
    dK, dV as one ``reference_attention`` call (GQA, two KV groups checked out of three)."""
    n, H, Hkv, D = 80, 6, 3, 8
    doc = torch.tensor([0] * 30 + [1] * 50)
    mod = lambda b, h, q, k: (q >= k) & (doc[q] == doc[k]) & (h < 5)  # noqa: E731  (head 5 sees nothing)
    case = harness.Case("docs", bsfa.causal() & bsfa.document(doc), mod, 1, H, Hkv, n, D)
    q, k, v, do = harness.inputs(case, harness.Options(device="cpu"), dtype=torch.float64 if upcast else torch.bfloat16)
    groups = [0, 2]
    got = harness.reference(case, q, k, v, do, groups, upcast=upcast, chunk_bytes=8 * n * 2 * 6 * 16)  # 16 rows
    hq = torch.arange(H).view(1, H, 1, 1)
    keep = mod(0, hq, torch.arange(n).view(1, 1, n, 1), torch.arange(n).view(1, 1, 1, n))
    out = bsfa.reference_attention(q, k, v, keep, upcast=upcast)
    ref = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), do.to(out.dtype))), o=out)
    tol = 1e-12 if upcast else 2e-2
    for t, per in (("o", 2), ("dq", 2), ("dk", 1), ("dv", 1)):
        want = harness._select(ref[t].to(got[t].dtype), groups, per)
        assert got[t].shape == want.shape
        assert (got[t] - want).abs().max().item() <= tol * max(1.0, want.abs().max().item()), t
    assert got["o"][:, -1].abs().max() == 0  # a fully masked head gives zeros


def test_errors_are_relative_to_eager():
    ref = {"o": torch.zeros(3, dtype=torch.float64)}
    e = harness.errors({"o": torch.tensor([0.0, 0.2, 0.0])}, ref, {"o": torch.tensor([0.1, 0.0, 0.0])})
    assert e["o"]["ratio"] == pytest.approx(2.0) and not e["o"]["nan"]
    e = harness.errors({"o": torch.tensor([float("nan"), 0.0, 0.0])}, ref, {"o": torch.tensor([0.1, 0.0, 0.0])})
    assert e["o"]["nan"]


def test_peer_arguments():
    cu, longest = peers.cu_seqlens_from_ids(torch.tensor([[0, 0, 1, 1, 1], [3, 3, 3, 4, 4]]))
    assert cu.tolist() == [0, 2, 5, 8, 10] and cu.dtype == torch.int32 and longest == 3
    assert peers.fa4_window(1024) == (1023, 0) and peers.fa4_window(None) == (None, None)
    from train.variants import varlen_args

    cu, m = varlen_args(torch.tensor([[0, 0, 1, 1, 1], [3, 3, 3, 4, 4]]), "cpu")
    assert cu.shape == (65,) and cu[:5].tolist() == [0, 2, 5, 8, 10] and (cu[4:] == 10).all() and int(m) == 3
    # the custom op's shapes without running FA4 (meta tensors)
    q = torch.empty(2, 16, 4, 8, device="meta")
    kv = torch.empty(2, 16, 2, 8, device="meta")
    fwd, _ = peers._fa4_ops()
    out, lse = fwd(q, kv, kv, None, None, True, -1, -1)
    assert out.shape == q.shape and lse.shape == (2, 4, 16)
    out, lse = fwd(q[0], kv[0], kv[0], torch.empty(3, dtype=torch.int32, device="meta"), None, True, -1, -1)
    assert out.shape == (16, 4, 8) and lse.shape == (4, 16)


def test_bench_dry_run_reports_missing_peers(tmp_path):
    """Ours is checked and timed; FA4/Flex-FLASH without flash_attn and cuDNN on CPU are n/a with the
    reason; the tables say so; nothing is written under docs/."""
    before = {p: p.stat().st_mtime for p in (ROOT / "docs").rglob("*") if p.is_file()}
    out = tmp_path / "b"
    assert bench.main(["--dry-run", "--out", str(out), "--masks", "causal", "longformer", "--kv-heads", "2",
                       "--impls", "ours", "fa4", "flex_flash", "cudnn"]) == 0
    data = json.loads((out / "bench.json").read_text())
    assert [c["mask"] for c in data["cases"]] == ["causal", "longformer"]
    for c in data["cases"]:
        ours = c["impls"]["ours"]
        assert ours["ok"] and ours["fwd_ms"] > 0 and set(ours["fb_check"]) == {"o", "dq", "dk", "dv"}
        assert c["impls"]["cudnn"]["na"] == "n/a (CUDA only)"
        if peers.status("cpu")["fa4"] == peers.NOT_INSTALLED:
            assert c["impls"]["fa4"]["na"] == "n/a (not installed)"
    md = (out / "bench.md").read_text()
    assert "| causal |" in md and "n/a (CUDA only)" in md and "2 KV heads (GQA)" in md
    after = {p: p.stat().st_mtime for p in (ROOT / "docs").rglob("*") if p.is_file()}
    assert after == before


def test_fa4_mask_forms():
    assert bench.fa4_form("sliding_window_1024", 4096) == {"causal": True, "window": 1024}
    assert torch.equal(bench.fa4_form("document_causal", 4096)["varlen"], bench.doc_ids(4096))
    assert bench.fa4_form("longformer", 4096).startswith("n/a")
    with pytest.raises(ValueError, match="unknown mask"):
        bench.make_case("nope", 256, "cpu")


def test_train_outputs_stay_out_of_docs(tmp_path):
    from train import cli

    ap = cli.build_parser()
    args = ap.parse_args(["run", "--out", str(tmp_path)])
    assert cli._outputs(args) == (str(tmp_path / "training_results.json"), str(tmp_path))
    args = ap.parse_args(["report", "x.json", "--update-docs"])
    assert cli._outputs(args) == (cli.DEFAULT_JSON, cli.DEFAULT_DOCS)
    args = ap.parse_args(["report", "x.json", "--out", str(tmp_path)])
    assert cli._outputs(args) == (str(tmp_path / "training_results.json"), str(tmp_path))
    args = ap.parse_args(["throughput"])
    assert args.bsfa_mode == "op" and args.protect == "bsfa_causal,bsfa_documents"


def test_gpu_sweep_script_parses():
    assert subprocess.run(["bash", "-n", str(_BENCH / "gpu_sweep.sh")]).returncode == 0
    r = subprocess.run(["bash", str(_BENCH / "gpu_sweep.sh")], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


def test_context_parallel_docs_sections(tmp_path):
    """``update_docs`` rewrites only the section of its mark (the four-GPU tables, then the two-GPU
    ones) and keeps the text around them."""
    import context_parallel as cpb

    doc = tmp_path / "d.md"
    doc.write_text("intro\n<!-- results -->\nold four\n\n### Two GPUs\n\ncommand `--mark \"<!-- results 2 GPUs -->\"`\n\n"
                   "<!-- results 2 GPUs -->\nold two\n\n## Testing\nend\n")
    res = lambda p: {"world_size": p, "device": "cpu", "sections": {}}  # noqa: E731
    cpb.update_docs(res(4), str(doc), str(tmp_path / "four.json"))
    text = doc.read_text()
    assert "old four" not in text and "old two" in text and "Device: 4x cpu" in text
    assert text.index("Device: 4x cpu") < text.index("### Two GPUs")
    cpb.update_docs(res(2), str(doc), str(tmp_path / "two.json"), mark="<!-- results 2 GPUs -->")
    text = doc.read_text()
    assert "old two" not in text and "Device: 4x cpu" in text
    assert text.index("<!-- results 2 GPUs -->\nDevice: 2x cpu") < text.index("## Testing")
    assert text.startswith("intro\n") and text.endswith("## Testing\nend\n")
    with pytest.raises(ValueError, match="no results section"):
        cpb.update_docs(res(2), str(doc), None, mark="<!-- results 8 GPUs -->")


def test_markdown_tables_escape_pipes_in_mask_names():
    """A mask named with the algebra's ``|`` stays one cell: every row has the header's columns."""
    case = dict(mask="key_range | causal", B=1, H=2, Hkv=2, N=256, D=32, element_density=0.5,
                impls={"ours": dict(fwd_ms=0.1, fb_ms=0.3, fwd_tflops=1.0, fb_tflops=1.0,
                                    fwd_check={"o": dict(err=1e-3, eager_err=2e-3, ratio=0.5, nan=False)},
                                    fb_check={"o": dict(err=1e-3, eager_err=2e-3, ratio=0.5, nan=False)},
                                    max_ratio=0.5, ok=True)})
    lines = harness.markdown_tables([case], ["ours"])
    rows = [ln for ln in lines if ln.startswith("| ")]
    assert any("key_range \\| causal" in ln for ln in rows)
    cols = {ln.replace("\\|", "").count("|") for ln in rows}
    assert cols == {rows[0].count("|")}, rows


def test_context_parallel_strategy_pairs_and_timing_label():
    """``--strategy pattern=s1,s2`` gives one scaling row per listed plan (others: the planner's);
    malformed items are refused by name; the report says how rows were timed."""
    import context_parallel as cpb

    assert cpb._strategies(["bigbird=zigzag,greedy", "causal=zigzag"]) == {"bigbird": ["zigzag", "greedy"],
                                                                         "causal": ["zigzag"]}
    assert cpb._strategies([]) == {}
    with pytest.raises(ValueError, match="--strategy"):
        cpb._strategies(["bigbird"])
    assert "0.25 s" in cpb._timing(0.25) and "fill" not in cpb._timing(0)
