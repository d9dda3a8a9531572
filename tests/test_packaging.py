"""The wheel ships the pattern files (not only the source tree has them); the optional extras; the
package's modules import one another one way, and ``import blocksparse_fa`` loads neither Triton
nor Dynamo."""

from __future__ import annotations

import ast
import graphlib
import importlib.util
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


# ------------------------------------------------------------------------------------------------
# the import graph
# ------------------------------------------------------------------------------------------------
PKG = ROOT / "blocksparse_fa"

# Edges that still close an import cycle, each to be dropped with its cycle (none at present).
_CYCLE_PENDING: set = set()


def _modules() -> dict:
    """``{dotted name: (path, is_package)}`` of every module of the package."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def _import_graph() -> dict:
    """``{module: {package module it imports: [line, ...]}}`` from the AST of every module: import
    statements at the top level and inside functions alike, and ``importlib.import_module`` calls
    with a constant name. ``from pkg import name`` is an edge to the module ``pkg.name`` when there
    is one, else to ``pkg`` (its ``__init__``)."""
    mods = _modules()
    graph = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]  # what relative imports start from
        edges = graph[name] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
                  == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
                targets = [importlib.util.resolve_name(node.args[0].value, package)]
            else:
                continue
            for target in targets:
                if target in mods and target != name:
                    edges.setdefault(target, []).append(node.lineno)
    return graph


def test_import_graph_sees_top_level_and_function_imports():
    """The graph holds the imports the checks below rely on: relative, absolute, inside functions."""
    g = _import_graph()
    assert "blocksparse_fa.ops.custom_op" in g["blocksparse_fa.ops.api"]  # inside attention()
    assert "blocksparse_fa.ops.interval_backend" in g["blocksparse_fa.ops.route"]  # inside device_intervals()
    assert "blocksparse_fa.mask.grammar" in g["blocksparse_fa.mask.patterns"]  # top level
    assert "blocksparse_fa.ops.custom_op" in g["blocksparse_fa.nn"]  # from .ops.custom_op import ...
    assert "blocksparse_fa.mask" in g["blocksparse_fa"]  # from .mask import (names of the package)
    assert len(g) == len(list(PKG.rglob("*.py")))  # every module, packages as their __init__


def test_no_two_modules_import_each_other():
    g = _import_graph()
    pairs = [f"{a} (line {g[a][b][0]}) <-> {b} (line {g[b][a][0]})"
             for a in sorted(g) for b in sorted(g[a]) if a < b and a in g.get(b, {})]
    assert not pairs, "modules that import each other (at the top level or inside functions):\n" + "\n".join(pairs)


def test_no_import_cycles():
    g = _import_graph()
    for a, b in _CYCLE_PENDING:
        assert b in g[a], f"{a} no longer imports {b}: drop the pair from _CYCLE_PENDING"
        del g[a][b]
    try:
        graphlib.TopologicalSorter({a: set(bs) for a, bs in g.items()}).prepare()
    except graphlib.CycleError as e:
        cycle = e.args[1]
        # graphlib lists each node before the one that imports it
        steps = [f"{b} (line {g[b][a][0]}) -> {a}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle:\n" + "\n".join(steps))


def test_package_import_loads_neither_triton_nor_dynamo():
    code = ("import sys, blocksparse_fa; print(blocksparse_fa.__file__); "
            "print([m for m in ('triton', 'torch._dynamo') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    where, loaded = proc.stdout.splitlines()[-2:]
    assert pathlib.Path(where).resolve().is_relative_to(PKG), where  # this checkout's package
    assert loaded == "[]", f"import blocksparse_fa loaded {loaded}"
