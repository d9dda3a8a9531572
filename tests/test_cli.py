"""The ``bsfa`` command line (through ``blocksparse_fa.cli.main.main``)."""

from __future__ import annotations

import re

import pytest

import blocksparse_fa as bsfa
from blocksparse_fa.cli.main import main


def _grid_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln and set(ln) <= set(".+#")]


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


def test_bench_rejects_flex_without_cuda_and_bad_reps(capsys):
    assert main(["bench", "causal", "--len", "64", "--device", "cpu", "--flex"]) == 2
    assert "--flex needs a CUDA device" in capsys.readouterr().err
    assert main(["bench", "causal", "--len", "64", "--device", "cpu", "--reps", "0"]) == 2
    assert "--reps must be >= 1" in capsys.readouterr().err


def test_traffic_defaults_to_the_kernels_tiles(capsys):
    assert main(["traffic", "sliding_window(1024)", "--len", "16384"]) == 0
    out = capsys.readouterr().out
    # band-like with 22 % partial blocks: the band forward, the spill-free backward tiles
    assert "tiles: fwd 128x64, dK/dV 32x128, dQ 128x64" in out
    assert main(["traffic", "causal", "--len", "4096"]) == 0
    assert "tiles: fwd 128x128, dK/dV 64x128, dQ 128x128" in capsys.readouterr().out
