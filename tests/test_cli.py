"""The ``bsfa`` command line (through ``blocksparse_fa.cli.main.main``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import blocksparse_fa as bsfa
from blocksparse_fa.cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _grid_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln and set(ln) <= set(".+#:")]


def _one_line_error(capsys, *needles) -> str:
    """The command failed with one stderr line that names ``needles``, and no traceback."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("bsfa ")
    for n in needles:
        assert n in lines[0], (n, err)
    return lines[0]


def test_patterns_lists_every_pattern(capsys):
    assert main(["patterns"]) == 0
    out = capsys.readouterr().out
    pats = bsfa.list_patterns()
    lines = out.splitlines()
    assert len(lines) == len(pats)
    for name, desc in pats.items():
        assert any(ln.split()[0] == name and desc in ln for ln in lines), name
    for name in ["causal", "dense", "sliding_window", "longformer", "bigbird", "sparse_transformer_strided",
                 "sparse_transformer_fixed", "prefix_lm", "document_causal"]:
        assert re.search(rf"^{name}\s", out, re.M), name


def test_patterns_verbose(capsys):
    assert main(["patterns", "-v"]) == 0
    out = capsys.readouterr().out
    assert "window(window) | global_tokens(n_global)" in out  # longformer's expression
    assert "window=256" in out and "arXiv" in out


def test_show_named_pattern(capsys):
    assert main(["show", "bigbird", "--len", "4096"]) == 0
    out = capsys.readouterr().out
    lay = bsfa.compile_mask(bsfa.load_pattern("bigbird"), 4096, 4096, 128)
    grid = _grid_lines(out)
    assert len(grid) == 32 and all(len(r) == 32 for r in grid)
    assert grid[0] == "#" * 32  # the global rows attend everywhere
    assert grid == lay.ascii().splitlines()[-32:]
    assert f"density={lay.density:.4f}" in out
    assert f"partial_fraction={lay.partial_fraction:.4f}" in out
    assert f"lut_bytes={lay.lut_bytes}" in out
    assert re.search(r"compile time: [0-9.]+ ms", out)


def test_show_expression_with_png(capsys, tmp_path):
    png = tmp_path / "out.png"
    assert main(["show", "causal & window(256)", "--len", "1000", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    grid = _grid_lines(out)
    assert len(grid) == 8 and all(len(r) == 8 for r in grid)  # ceil(1000 / 128) = 8
    assert grid[0].startswith("+") and grid[0].endswith(".")  # causal: nothing above the diagonal
    assert all(r[i + 1:] == "." * (7 - i) for i, r in enumerate(grid))
    assert "q_len=1000 kv_len=1000" in out
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in out


def test_show_kv_len_and_block(capsys):
    assert main(["show", "causal", "--len", "100", "--kv-len", "300", "--block", "32"]) == 0
    out = capsys.readouterr().out
    assert "q_len=100 kv_len=300" in out and "block=(32, 32)" in out
    grid = _grid_lines(out)
    assert len(grid) == 4 and all(len(r) == 10 for r in grid)


def test_dsl_error_exit_code_and_caret(capsys):
    code = main(["show", "causal & windw(3)", "--len", "100"])
    assert code == 2
    captured = capsys.readouterr()
    err = captured.err
    assert "windw" in err and "^" in err
    lines = err.splitlines()
    k = next(i for i, ln in enumerate(lines) if ln.strip() == "^")
    assert lines[k - 1][lines[k].index("^"):].startswith("windw")
    assert "Traceback" not in err


def test_bad_parameter_exit_code(capsys):
    assert main(["show", "window(-1)", "--len", "100"]) == 2
    assert "'w'" in capsys.readouterr().err


def test_missing_len_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["show", "causal"])
    assert ei.value.code == 2
    assert "--len" in capsys.readouterr().err


def test_bench_times_a_pattern_on_cpu(capsys):
    assert main(["bench", "causal & window(40)", "--len", "96", "--heads", "2", "--head-dim", "16",
                 "--block", "32", "--reps", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"ours\s+fwd\s+([\d.]+) ms .* fwd\+bwd\s+([\d.]+) ms", out)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, out
    assert "element density" in out and "fp32 on cpu" in out
    # SDPA on the same inputs, with the pattern as a dense mask: same result to float32 rounding
    assert re.search(r"sdpa\s+fwd\s+[\d.]+ ms .* fwd\+bwd\s+[\d.]+ ms", out), out
    m = re.search(r"speedup vs sdpa \(sdpa time / ours\): fwd [\d.e+-]+x, fwd\+bwd [\d.e+-]+x; "
                  r"\|ours - sdpa\| / \|sdpa\| = ([\d.e+-]+)", out)
    assert m and float(m.group(1)) < 1e-5, out


def test_bench_rejects_bad_reps(capsys):
    assert main(["bench", "causal", "--len", "64", "--device", "cpu", "--reps", "0"]) == 2
    _one_line_error(capsys, "--reps must be >= 1")


def test_traffic_defaults_to_the_kernels_tiles(capsys):
    assert main(["traffic", "sliding_window(1024)", "--len", "16384", "--kernels", "triton"]) == 0
    out = capsys.readouterr().out
    # band-like with 22 % partial blocks: the band forward, the spill-free backward tiles
    assert "tiles: fwd 128x64, dK/dV 32x128, dQ 128x64" in out
    assert main(["traffic", "causal", "--len", "4096", "--kernels", "triton"]) == 0
    assert "tiles: fwd 128x128, dK/dV 64x128, dQ 128x128" in capsys.readouterr().out
    # by default the kernels a Hopper GPU runs: the Gluon kernels, whose tiles are their own
    assert main(["traffic", "causal", "--len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "kernels: forward gluon:causal, backward gluon:causal+atomic_dq" in out and "_dq_finish" in out
    assert "Triton tiles" not in out


# ------------------------------------------------------------------------------------------------
# errors: one line on stderr, exit status 2, never a traceback
# ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(capsys):
    assert main(["demo", "--device", "cuda", "--len", "256"]) == 2
    _one_line_error(capsys, "--device cuda", "no CUDA device")
    assert main(["bench", "causal", "--len", "64", "--device", "cuda:1"]) == 2
    _one_line_error(capsys, "no CUDA device")


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "banana"])
def test_unknown_device(capsys, device):
    assert main(["demo", "--device", device, "--len", "256"]) == 2
    _one_line_error(capsys, f"--device must be auto, cpu, cuda or cuda:N, got '{device}'")


def test_png_into_a_missing_folder(capsys, tmp_path):
    missing = tmp_path / "missing" / "dir" / "x.png"
    assert main(["show", "causal", "--len", "256", "--png", str(missing)]) == 2
    _one_line_error(capsys, "--png", "does not exist")
    assert not missing.parent.exists()


@pytest.mark.parametrize("args, needles", [
    (["show", "causal", "--len", "0"], ["--len must be positive"]),
    (["show", "causal", "--len", "64", "--width", "0"], ["--width must be positive"]),
    (["traffic", "causal", "--len", "256", "--block", "-1"], ["--block must be positive"]),
    (["traffic", "causal", "--len", "256", "--fwd-tiles", "12"], ["tile sizes look like 128x64"]),
    (["traffic", "causal", "--len", "256", "--l2-mb", "0"], ["--l2-mb must be positive"]),
    (["bench", "causal", "--len", "64", "--device", "cpu", "--heads", "3", "--kv-heads", "2"], ["multiple"]),
    (["analyze", "causal", "--len", "256", "--layers", "-1"], ["layers"]),
    (["show", "document_causal", "--len", "1000"], ["needs document ids", "--documents"]),
    (["show", "causal", "--len", "100", "--documents", "50"], ["no 'document' term"]),
    (["show", "document_causal", "--len", "1000", "--documents", "100,200"], ["add up to 300", "1000"]),
    (["show", "document_causal", "--len", "1000", "--documents", "3x"], ["comma-separated"]),
    (["show", "document_causal", "--len", "1000", "--documents", "0"], ["positive"]),
])
def test_bad_arguments_are_one_line_errors(capsys, args, needles):
    assert main(args) == 2
    _one_line_error(capsys, *needles)


@pytest.mark.parametrize("text, typo, suggestion", [
    ("bigbirb", "bigbirb", "'bigbird'"),
    ("longfromer", "longfromer", "'longformer'"),
    ("causal & windw(3)", "windw", "'window'"),
    ("causal | sliding_windo(64)", "sliding_windo", "'sliding_window'"),
])
def test_did_you_mean(capsys, text, typo, suggestion):
    assert main(["show", text, "--len", "256"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    first, shown, caret = err.rstrip("\n").splitlines()  # the DSL error: message, the text, a caret
    assert f"unknown pattern or mask name '{typo}'" in first and f"did you mean {suggestion}" in first
    assert shown.strip() == text and shown[caret.index("^"):].startswith(typo)


def test_unknown_name_without_a_close_match_points_at_the_list(capsys):
    assert main(["show", "qqqqqq", "--len", "256"]) == 2
    assert "'bsfa patterns' lists the named patterns" in capsys.readouterr().err


def test_missing_networkx_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "networkx", None)  # as if networkx were not installed
    monkeypatch.delitem(sys.modules, "blocksparse_fa.analysis.reach", raising=False)
    assert main(["analyze", "causal", "--len", "1024", "--layers", "1"]) == 2
    _one_line_error(capsys, "needs networkx", "pip install 'blocksparse_fa[analysis]'")


def test_missing_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
    for mod in ("matplotlib", "matplotlib.colors", "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, mod, None)
    assert main(["show", "causal", "--len", "256", "--png", str(tmp_path / "x.png")]) == 2
    _one_line_error(capsys, "needs matplotlib", "pip install 'blocksparse_fa[plot]'")


def test_unexpected_errors_are_one_line_too(capsys, monkeypatch):
    import blocksparse_fa.cli.show as show

    def boom(*a, **k):
        raise RuntimeError("something broke\nacross two lines")

    monkeypatch.setattr(show, "compile_mask", boom)
    monkeypatch.delenv("BSFA_TRACEBACK", raising=False)
    assert main(["show", "causal", "--len", "256"]) == 2
    _one_line_error(capsys, "RuntimeError: something broke across two lines", "BSFA_TRACEBACK=1")
    monkeypatch.setenv("BSFA_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="something broke"):
        main(["show", "causal", "--len", "256"])


def test_closed_pipe_ends_quietly(tmp_path):
    """``bsfa traffic ... --json | head``: the reader goes away before we write; no traceback, no
    'Exception ignored' at exit, the status a shell gives a process ended by SIGPIPE."""
    proc = subprocess.Popen([sys.executable, "-m", "blocksparse_fa.cli.main", "traffic", "causal", "--len", "512",
                             "--heads", "2", "--json"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # long before the child has imported torch
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == "", err


# ------------------------------------------------------------------------------------------------
# --documents, progress bars
# ------------------------------------------------------------------------------------------------
def test_show_documents_lengths(capsys):
    assert main(["show", "document_causal", "--len", "512", "--block", "64", "--documents", "128,192,192"]) == 0
    out = capsys.readouterr().out
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([128, 192, 192]))
    want = bsfa.compile_mask(bsfa.load_pattern("document_causal", document=ids), 512, 512, 64)
    assert _grid_lines(out) == _grid_lines(want.ascii())
    assert f"density={want.density:.4f}" in out
    # one length: equal documents (the last one shorter), also in DSL text
    assert main(["show", "causal & document", "--len", "500", "--block", "50", "--documents", "200"]) == 0
    grid = _grid_lines(capsys.readouterr().out)
    assert grid[3] == "###+......" and grid[4] == "....+....." and grid[9] == "........#+"  # [0, 200), [200, 400), [400, 500)


def test_traffic_and_bench_take_documents(capsys):
    assert main(["traffic", "document_causal", "--len", "2048", "--heads", "2", "--documents", "512"]) == 0
    out = capsys.readouterr().out
    ids = torch.arange(2048) // 512
    want = bsfa.compile_mask(bsfa.load_pattern("document_causal", document=ids), 2048, 2048, 128)
    assert f"block density s={want.density:.4f}" in out
    assert main(["bench", "document_causal", "--len", "96", "--block", "32", "--heads", "2", "--head-dim", "16",
                 "--reps", "1", "--device", "cpu", "--documents", "40,56"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\|ours - sdpa\| / \|sdpa\| = ([\d.e+-]+)", out), out


class _RecordingBar:
    """Stands in for tqdm.tqdm: records totals and updates."""

    made: list = []

    def __init__(self, *args, total=None, desc="", **kwargs):
        self.total, self.desc, self.n = total, desc, 0
        _RecordingBar.made.append(self)

    def update(self, n=1):
        self.n += n

    def set_description(self, desc):
        self.desc = desc

    @staticmethod
    def write(s, *args, **kwargs):
        print(s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bench_shows_progress(capsys, monkeypatch):
    import tqdm

    monkeypatch.setattr(tqdm, "tqdm", _RecordingBar)
    _RecordingBar.made = []
    assert main(["bench", "causal", "--len", "64", "--block", "32", "--heads", "2", "--head-dim", "16", "--reps", "2",
                 "--device", "cpu"]) == 0
    (bar,) = _RecordingBar.made
    assert bar.total == bar.n == 2 * (1 + 2 * 3)  # ours and sdpa: first call, (warm-up + 2 reps) x fwd, fwd+bwd
    assert "ours  fwd" in capsys.readouterr().out
