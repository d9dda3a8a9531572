"""The user docs: written for users, and every file they point at exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_docs_speak_to_users():
    words = re.compile(r"\b(sessions?|issues?|v[0-9]+)\b", re.I)
    for path in USER_DOCS + sorted((ROOT / "docs" / "data").glob("*.json")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = words.search(line)
            assert m is None, f"{path.relative_to(ROOT)}:{n}: '{m.group(0)}' in {line.strip()[:120]!r}"


def test_referenced_files_exist():
    ref = re.compile(r"(?<![\w/.])((?:benchmarks|docs|blocksparse_fa|tests|masks)/[\w./*<>-]*[\w*>])")
    notes = (ROOT / "benchmarks" / "NOTES.md").read_text(encoding="utf-8")
    moved = notes[notes.index("## Where the files went"):]  # the lab notebook names files since moved or removed
    for path in USER_DOCS + [ROOT / "benchmarks" / "NOTES.md"]:
        text = path.read_text(encoding="utf-8")
        for m in ref.finditer(text):
            target = m.group(1)
            if "*" in target or "<" in target or target.startswith("docs/data/prev"):  # globs, placeholders, history
                continue
            if path.name == "NOTES.md" and (f"`{target.rsplit('/', 1)[-1]}`" in moved or m.start() > notes.index(moved)):
                continue
            assert (ROOT / target).exists(), f"{path.relative_to(ROOT)} points at {target}, which does not exist"
