"""Write the API reference (``docs/api.md``) and the CLI reference (``docs/cli.md``).

    python docs/gen_api.py            # rewrite both files
    python docs/gen_api.py --check    # exit 1 and name the files that are not current

The API reference documents every public name of the modules in ``MODULES`` (their ``__all__``),
read with :mod:`inspect` from the checkout this script sits in: signatures, docstrings (Google style,
reST roles turned into Markdown) and, for classes, their public methods and properties. The CLI
reference walks ``bsfa``'s argparse parser. Nothing is listed by hand, so names added to an
``__all__`` or subcommands added to ``blocksparse_fa/cli`` appear at the next run;
``tests/test_docs.py`` regenerates both and fails when the committed files differ.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # document this checkout, not an installed copy

API_MD = ROOT / "docs" / "api.md"
CLI_MD = ROOT / "docs" / "cli.md"

MODULES = [
    "blocksparse_fa",
    "blocksparse_fa.nn",
    "blocksparse_fa.distributed",
    "blocksparse_fa.integrations.flex",
    "blocksparse_fa.integrations.transformers",
    "blocksparse_fa.analysis.traffic",
    "blocksparse_fa.analysis.reach",
]

# Sections of the top-level package, in this order, by the module that defines a name (the longest
# matching prefix wins); a name from anywhere else lands in "Other".
GROUPS = [
    ("blocksparse_fa.mask", "Masks, the DSL and patterns"),
    ("blocksparse_fa.compiler", "Compiling a mask"),
    ("blocksparse_fa.ops", "Attention"),
    ("blocksparse_fa.mask.score", "Score modifiers"),
]

_SECTIONS = {"Args", "Arguments", "Attributes", "Raises", "Returns", "Yields", "Shapes", "Example", "Examples",
             "Note", "Notes", "Parameters", "Keyword Args", "Other Parameters", "Warning", "Warnings"}
_LISTS = {"Args", "Arguments", "Attributes", "Raises", "Parameters", "Keyword Args", "Other Parameters"}
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|obj|exc|const):`(~?)([^`]+)`")
_ITEM = re.compile(r"^(\*{0,2}[\w.]+(?:, \*{0,2}[\w.]+)*)(?: \(([^)]*)\))?:(?:\s+(.*))?$")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_WIDTH = 100


# ----------------------------------------------------------------------------------- docstrings

def _inline(text: str) -> str:
    """reST roles and double backticks as Markdown code, outside fenced code blocks (a span may
    run over a line break, not over a blank line)."""
    def role(m):
        target = m.group(2)
        return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"

    parts = re.split(r"(^```.*?^```$)", text, flags=re.S | re.M)
    for n in range(0, len(parts), 2):
        parts[n] = re.sub(r"``((?:(?!\n\n).)+?)``", r"`\1`", _ROLE.sub(role, parts[n]), flags=re.S)
    return "".join(parts)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _block(lines: list[str], i: int, base: int) -> tuple[list[str], int]:
    """The lines from ``i`` on that are blank or indented deeper than ``base``."""
    out = []
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
        out.append(lines[i])
        i += 1
    while out and not out[-1].strip():
        out.pop()
        i -= 1
    return out, i


def _dedent(lines: list[str]) -> list[str]:
    n = min((_indent(s) for s in lines if s.strip()), default=0)
    return [s[n:] for s in lines]


def _fence(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    return ["```python", *_dedent(lines), "```"]


def _items(lines: list[str]) -> list[str]:
    """A Google-style ``name: text`` list as a Markdown list."""
    body = _dedent(lines)
    out: list[str] = []
    for line in body:
        if not line.strip():
            continue
        m = _ITEM.match(line) if _indent(line) == 0 else None
        if m:
            names = ", ".join(f"`{n}`" for n in m.group(1).split(", "))
            kind = f" ({m.group(2)})" if m.group(2) else ""
            out.append(f"- {names}{kind}: {m.group(3) or ''}".rstrip())
        elif out:
            out[-1] += " " + line.strip()
        else:
            out.append(line.strip())
    return out


def docstring_markdown(doc: str | None) -> str:
    """A Google-style docstring as Markdown: sections in bold, argument lists as lists, ``::``
    literal blocks and indented examples as Python code blocks."""
    if not doc:
        return ""
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        head = stripped[:-1] if stripped.endswith(":") and _indent(line) == 0 else None
        if head in _SECTIONS:
            block, i = _block(lines, i + 1, 0)
            out += ["", f"**{head}:**", ""]
            out += _items(block) if head in _LISTS else _dedent(block)
            out.append("")
            continue
        if stripped.startswith(".. ") and stripped.endswith("::"):  # a reST directive: .. note::
            out += ["", f"**{stripped[3:-2].strip().capitalize()}:**"]
            i += 1
            continue
        if i + 1 < len(lines) and stripped and re.fullmatch(r"(-{3,}|={3,}|~{3,})", lines[i + 1].strip()):
            out += [f"**{stripped}**", ""]
            i += 2
            continue
        if stripped.endswith("::"):  # a paragraph introducing a literal block
            para = line.rstrip()[:-2].rstrip()
            if para.strip() and not stripped.endswith(" ::"):
                para += ":"
            out.append(para)
            block, i = _block(lines, i + 1, _indent(line))
            out += ["", *_fence(block), ""]
            continue
        if stripped and _indent(line) >= 4 and (not out or not out[-1].strip()):  # an indented example
            block, i = _block(lines, i, 3)
            out += [*_fence(block), ""]
            continue
        out.append(line)
        i += 1
    text = _inline("\n".join(out))
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


# ----------------------------------------------------------------------------------- signatures

class _Text:
    """Shown as its text in a signature (annotations kept as written, defaults without addresses)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _clean_signature(sig: inspect.Signature) -> inspect.Signature:
    def ann(a):
        if a is inspect.Parameter.empty:
            return a
        text = a if isinstance(a, str) else inspect.formatannotation(a)
        return _Text(re.sub(r"^(['\"])(.*)\1$", r"\2", text))

    params = [p.replace(annotation=ann(p.annotation),
                        default=p.default if p.default is inspect.Parameter.empty
                        else _Text(_ADDRESS.sub("", repr(p.default))))
              for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=ann(sig.return_annotation))


def signature(name: str, obj) -> str | None:
    """``name(params) -> ret``, one parameter a line when it would be longer than ``_WIDTH``."""
    try:
        sig = _clean_signature(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    if inspect.isclass(obj):
        sig = sig.replace(return_annotation=inspect.Signature.empty)
    one = f"{name}{sig}"
    if len(one) <= _WIDTH:
        return one
    inner = str(sig.replace(return_annotation=inspect.Signature.empty))[1:-1]
    parts, depth, cur = [], 0, ""
    for ch in inner:  # split at the top-level commas
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    ret = "" if sig.return_annotation is inspect.Signature.empty else f" -> {sig.return_annotation!r}"
    return f"{name}(\n" + "".join(f"    {p},\n" for p in parts) + f"){ret}"


# ----------------------------------------------------------------------------------- the API page

def _anchor(text: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def _own_members(cls) -> list[tuple[str, object]]:
    """Public methods and properties a class defines or inherits from this package, in order."""
    seen, out = set(), []
    outside = {n for base in cls.__mro__ if not getattr(base, "__module__", "").startswith("blocksparse_fa")
               for n in vars(base)} - {"forward"}  # torch.nn.Module's extra_repr etc. are not ours to list
    for base in cls.__mro__:
        if not getattr(base, "__module__", "").startswith("blocksparse_fa"):
            continue
        for name, value in vars(base).items():
            if name.startswith("_") or name in seen or name in outside:
                continue
            seen.add(name)
            if isinstance(value, classmethod):
                value = getattr(cls, name)  # bound: its signature has no cls
            elif isinstance(value, staticmethod):
                value = value.__func__
            if isinstance(value, property) or inspect.isfunction(value) or inspect.ismethod(value):
                out.append((name, value))
    return out


def _entry(qualname: str, obj, level: int) -> list[str]:
    hashes = "#" * level
    if inspect.isclass(obj) or callable(obj):
        out = [f"{hashes} {qualname.rsplit('.', 1)[-1]}", ""]
        sig = signature(qualname, obj)
        if sig:
            out += ["```python", ("class " if inspect.isclass(obj) else "") + sig, "```", ""]
        out.append(docstring_markdown(inspect.getdoc(obj)) or "*(no docstring)*\n")
        if inspect.isclass(obj):
            short = qualname.rsplit(".", 1)[-1]
            for name, member in _own_members(obj):
                out.append(f"{'#' * (level + 1)} {short}.{name}")
                out.append("")
                if isinstance(member, property):
                    out.append("*property*")
                    out.append("")
                else:
                    msig = signature(f"{short}.{name}", member)
                    if msig:  # drop self: the reader calls it on an instance
                        msig = re.sub(r"^([\w.]+)\(self(, |\))", lambda m: m.group(1) + ("(" if m.group(2) == ", " else "()"),
                                      msig, count=1)
                        msig = msig.replace("(\n    self,\n", "(\n", 1)
                        out += ["```python", msig, "```", ""]
                out.append(docstring_markdown(member.__doc__))
        return out
    return [f"{hashes} {qualname.rsplit('.', 1)[-1]}", "", "```python",
            f"{qualname} = {_ADDRESS.sub('', repr(obj))}", "```", ""]


def _group(obj) -> str:
    where = getattr(obj, "__module__", "") or ""
    hits = [(len(prefix), title) for prefix, title in GROUPS if where == prefix or where.startswith(prefix + ".")]
    return max(hits)[1] if hits else "Other"


def render_api() -> str:
    out = ["# API reference", "",
           "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand "
           "(`tests/test_docs.py` fails when this page is not current). Every public name of the modules "
           "below, in the order of their `__all__`. The user's guide is [getting_started.md](getting_started.md) "
           "and [guide/](guide/README.md); the command line is [cli.md](cli.md).", ""]
    sections = []
    for modname in MODULES:
        mod = importlib.import_module(modname)
        names = [n for n in mod.__all__ if not inspect.ismodule(getattr(mod, n))]
        body = ["", f"## {modname}", "", docstring_markdown(inspect.getdoc(mod))]
        toc = []
        if modname == "blocksparse_fa":
            groups: dict[str, list[str]] = {}
            for n in names:
                groups.setdefault(_group(getattr(mod, n)), []).append(n)
            order = [t for _, t in GROUPS if t in groups] + (["Other"] if "Other" in groups else [])
            for title in order:
                body += [f"### {title}", ""]
                for n in groups[title]:
                    body += _entry(f"{modname}.{n}", getattr(mod, n), 4)
                toc.append(f"  - {title}: " + ", ".join(f"[{n}](#{_anchor(n)})" for n in groups[title]))
        else:
            for n in names:
                body += _entry(f"{modname}.{n}", getattr(mod, n), 3)
            toc.append("  - " + ", ".join(f"[{n}](#{_anchor(n)})" for n in names))
        out.append(f"- [{modname}](#{_anchor(modname)})")
        out += toc
        sections += body
    text = "\n".join(out + sections)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


# ----------------------------------------------------------------------------------- the CLI page

def _arg_name(action: argparse.Action) -> str:
    if not action.option_strings:
        return action.metavar or action.dest.upper() if isinstance(action.metavar, str) or action.metavar is None \
            else " ".join(action.metavar)
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    meta = action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices
                              else action.dest.upper())
    return ", ".join(f"{o} {meta}" for o in action.option_strings)


def _usage(prog: str, parser: argparse.ArgumentParser) -> str:
    parts = [prog]
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:
            continue
        if isinstance(a, argparse._SubParsersAction):
            parts.append("COMMAND")
            continue
        name = _arg_name(a).split(", ")[-1] if a.option_strings else _arg_name(a)
        if a.option_strings and a.nargs != 0 and not a.required:
            name = f"[{name}]"
        elif a.option_strings and a.nargs == 0:
            name = f"[{name}]"
        parts.append(name)
    return " ".join(parts)


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    for a in parser._actions:
        if a.help == argparse.SUPPRESS or isinstance(a, (argparse._SubParsersAction, argparse._HelpAction)):
            continue
        default = "" if a.default in (None, False, argparse.SUPPRESS) or a.nargs == 0 else f"`{a.default}`"
        if a.required and a.option_strings:
            default = "required"
        help_text = (a.help or "").replace("|", "\\|")
        rows.append(f"| `{_arg_name(a)}` | {default} | {help_text} |")
    return rows


def render_cli() -> str:
    from blocksparse_fa.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = ["# Command line: `bsfa`", "",
           "Generated from the argument parser by `python docs/gen_api.py`; do not edit by hand "
           "(`tests/test_docs.py` fails when this page is not current). `bsfa --help` and "
           "`bsfa COMMAND --help` print the same.", "",
           parser.description or "", "", "```", _usage("bsfa", parser), "```", "",
           "| command | what it does |", "|---|---|"]
    out += [f"| [`{name}`](#bsfa-{name}) | {helps.get(name, '')} |" for name in sub.choices]
    out += ["", "Every command takes `-h` / `--help`.", "", *_arguments(parser), ""]
    main_doc = importlib.import_module("blocksparse_fa.cli.main").__doc__ or ""
    out += [_inline(" ".join(main_doc.split("\n\n", 1)[-1].split())), ""]
    for name, p in sub.choices.items():
        out += [f"## bsfa {name}", "", helps.get(name, "") or "", ""]
        if p.description:
            out += [p.description, ""]
        out += ["```", _usage(f"bsfa {name}", p), "```", "", *_arguments(p), ""]
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------------- main

PAGES = {API_MD: render_api, CLI_MD: render_cli}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when a page is not current")
    args = ap.parse_args(argv)
    stale = []
    for path, render in PAGES.items():
        text = render()
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text, encoding="utf-8")
    for path in stale:
        print(f"{'not current' if args.check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
