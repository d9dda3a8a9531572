"""The user docs: written for users, every file they point at exists, every code block of the guide
runs, and the generated references (API, CLI, pattern table) are current."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GUIDE = [ROOT / "README.md", ROOT / "docs" / "getting_started.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
USER_DOCS = sorted({ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "NOTES.md",
                    *(ROOT / "docs").rglob("*.md")})

# A code block runs unless the HTML comment on the line before its fence says otherwise:
#   <!-- requires: cuda -->                       skipped without a CUDA device
#   <!-- run: torchrun --nproc-per-node N -->      saved to a file and run as that command (CPU: gloo)
_FENCE = re.compile(r"^(?:<!-- (?P<marker>[^\n]*?) -->\n)?```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$",
                    re.S | re.M)
_MARKERS = re.compile(r"requires: cuda|run: torchrun --nproc-per-node \d+")


def code_blocks(path: Path):
    """``(line, lang, marker, code)`` of every fenced block of a Markdown page."""
    text = path.read_text(encoding="utf-8")
    for m in _FENCE.finditer(text):
        yield text.count("\n", 0, m.start("code")), m.group("lang"), m.group("marker"), m.group("code")


def test_docs_speak_to_users():
    prose = re.compile(r"\b(sessions?|rounds?(?!\()|issues?|v[0-9]+)\b", re.I)  # round(x) is rounding
    data = re.compile(r"\b(sessions?|issues?|v[0-9]+)\b", re.I)  # raw data keeps its keys ("rounds" of a probe)
    for path in USER_DOCS + sorted((ROOT / "docs" / "data").glob("*.json")):
        words = data if path.suffix == ".json" else prose
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = words.search(line)
            assert m is None, f"{path.relative_to(ROOT)}:{n}: '{m.group(0)}' in {line.strip()[:120]!r}"


def test_referenced_files_exist():
    ref = re.compile(r"(?<![\w/.])((?:benchmarks|docs|blocksparse_fa|tests|masks)/[\w./*<>-]*[\w*>])")
    for path in USER_DOCS:
        for m in ref.finditer(path.read_text(encoding="utf-8")):
            target = m.group(1)
            if "*" in target or "<" in target:  # globs, placeholders
                continue
            assert (ROOT / target).exists(), f"{path.relative_to(ROOT)} points at {target}, which does not exist"


def test_relative_links_resolve():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    for path in USER_DOCS:
        for m in link.finditer(path.read_text(encoding="utf-8")):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"


def test_code_block_markers_are_known():
    for page in GUIDE:
        fences = sum(1 for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("```"))
        assert fences == 2 * len(list(code_blocks(page))), f"{page.name}: a code fence the test does not see"
        for line, lang, marker, _ in code_blocks(page):
            assert marker is None or _MARKERS.fullmatch(marker), f"{page.name}:{line}: unknown marker {marker!r}"
            assert lang in ("python", "bash", "text", ""), f"{page.name}:{line}: code block language {lang!r}"


def _run_bsfa(line: str) -> None:
    from blocksparse_fa.cli.main import main

    rc = main(shlex.split(line)[1:])
    assert rc == 0, f"`{line}` exited with {rc}"


def _run_torchrun(marker: str, code: str, tmp_path: Path, where: str) -> None:
    script = tmp_path / "docs_block.py"
    script.write_text(code, encoding="utf-8")
    n = marker.rsplit(" ", 1)[-1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    if torch.cuda.device_count() < int(n):  # not a GPU per rank: the block's CPU (gloo) path
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, f"{where} failed under torchrun:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("page", GUIDE, ids=[p.name if p.parent.name != "guide" else f"guide/{p.name}" for p in GUIDE])
def test_guide_code_runs(page, tmp_path, monkeypatch, capsys):
    """Each page's blocks run in order in one namespace, as a reader would paste them; Python
    blocks are executed, shell blocks run their ``bsfa`` commands in this process (other lines
    install things; ``bsfa demo`` and ``bsfa bench`` only time things, and CI runs the demo)."""
    monkeypatch.chdir(tmp_path)  # files a block writes land here
    namespace: dict = {"__name__": "__docs__"}
    for line, lang, marker, code in code_blocks(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        if marker == "requires: cuda" and not torch.cuda.is_available():
            continue
        if lang == "python" and marker and marker.startswith("run: torchrun"):
            _run_torchrun(marker, code, tmp_path, where)
        elif lang == "python":
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the docs' own code
        elif lang == "bash":
            for cmd in code.splitlines():
                cmd = cmd.split("  #", 1)[0].strip()
                if cmd.startswith("bsfa ") and not cmd.startswith(("bsfa demo", "bsfa bench")):
                    _run_bsfa(cmd)
    capsys.readouterr()


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("page", ["api.md", "cli.md"])
def test_generated_reference_is_current(page):
    """docs/api.md and docs/cli.md are what `python docs/gen_api.py` writes from today's code."""
    pytest.importorskip("networkx")  # the reachability module is documented too
    gen = _gen_api()
    path = ROOT / "docs" / page
    text = gen.PAGES[path]()
    assert path.read_text(encoding="utf-8") == text, f"docs/{page} is not current: run `python docs/gen_api.py`"


def test_generated_reference_covers_every_public_name():
    gen = _gen_api()
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for modname in gen.MODULES:
        if modname.endswith(".reach") and importlib.util.find_spec("networkx") is None:
            continue
        mod = importlib.import_module(modname)
        for name in mod.__all__:
            if not isinstance(getattr(mod, name), type(sys)):
                assert re.search(rf"^#+ {re.escape(name)}$", api, re.M), f"docs/api.md has no entry for {modname}.{name}"


def test_analysis_page_lists_every_pattern():
    """docs/analysis.md says "every pattern in masks/": its table has exactly their rows
    (regenerate with `python benchmarks/analysis_table.py`, command on the page)."""
    import blocksparse_fa as bsfa

    text = (ROOT / "docs" / "analysis.md").read_text(encoding="utf-8")
    rows = {m.group(1) for m in re.finditer(r"^\| (\w+) \| `", text, re.M)}
    assert rows == set(bsfa.list_patterns()), f"docs/analysis.md rows differ from masks/: {rows ^ set(bsfa.list_patterns())}"
