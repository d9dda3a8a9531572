"""The wheel ships the pattern files (not only the source tree has them); the optional extras."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    tmp = tmp_path_factory.mktemp("wheel")
    # Build from a clean copy of the repository root: an in-tree build would leave build/ and stale
    # build/lib contents in the working tree.
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache", "*.pyc"))
    out = tmp / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300, cwd=tmp,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(out.glob("blocksparse_fa-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_every_mask_file_is_in_the_wheel(wheel):
    mask_files = sorted((ROOT / "masks").glob("*.mask"))
    assert len(mask_files) >= 9
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for f in mask_files:
            arc = f"blocksparse_fa/pattern_files/{f.name}"
            assert arc in names, arc
            assert z.read(arc) == f.read_bytes(), arc
        assert "blocksparse_fa/pattern_files/__init__.py" in names


def test_wheel_has_the_packages_and_entry_point(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for sub in ("mask", "compiler", "ops", "cli", "analysis", "analysis/traffic", "distributed"):
            for f in (ROOT / "blocksparse_fa" / sub).glob("*.py"):
                assert f"blocksparse_fa/{sub}/{f.name}" in names, f
        assert "blocksparse_fa/__init__.py" in names
        ep = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "bsfa = blocksparse_fa.cli.main:main" in z.read(ep).decode()


def test_installed_wheel_loads_patterns(wheel, tmp_path):
    """Install the wheel into a bare folder and load patterns from there, away from the source tree."""
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                           "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code = ("import blocksparse_fa as b, pathlib; "
            "print(pathlib.Path(b.__file__).resolve()); "
            "print(sorted(b.list_patterns())); "
            "print(b.load_pattern('bigbird', window=64))")
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    where, names, bigbird = proc.stdout.splitlines()[:3]
    assert pathlib.Path(where).is_relative_to(target.resolve()), where
    for name in ("causal", "dense", "sliding_window", "longformer", "bigbird", "sparse_transformer_strided",
                 "sparse_transformer_fixed", "prefix_lm", "document_causal"):
        assert f"'{name}'" in names
    assert bigbird.startswith("window(64) | global_tokens(128)")


def test_networkx_and_matplotlib_are_optional_extras():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(meta["dependencies"])
    assert "networkx" not in core and "matplotlib" not in core
    extras = meta["optional-dependencies"]
    assert any(d.startswith("networkx") for d in extras["analysis"])
    assert any(d.startswith("matplotlib") for d in extras["plot"])
    for dep in extras["analysis"] + extras["plot"]:  # the README's install line installs what the tests need
        assert dep in extras["test"]
    assert any(d.startswith("triton") and "platform_system == 'Linux'" in d for d in meta["dependencies"])
