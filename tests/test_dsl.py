"""The text DSL: parsing, named patterns, error messages, robustness against hostile input."""

from __future__ import annotations

import ast
import builtins
import pathlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blocksparse_fa as bsfa
from blocksparse_fa.mask.primitives import PRIMITIVES

MaskSyntaxError = bsfa.MaskSyntaxError
REQUIRED_PATTERNS = [
    "causal", "dense", "sliding_window", "longformer", "bigbird", "sparse_transformer_strided",
    "sparse_transformer_fixed", "prefix_lm", "document_causal",
]


# ------------------------------------------------------------------------------------------------
# parsing every primitive
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("texts,expected", [
    (["full", "full()", " full ( ) "], bsfa.full()),
    (["causal", "causal()", "\tcausal\n"], bsfa.causal()),
    (["window(5)", "window(w=5)", "window( w = 5 )", "window(\n5\n)"], bsfa.window(5)),
    (["window(0)", "window(w=0)", "window(-0)"], bsfa.window(0)),
    (["sliding_window(7)", "sliding_window(w=7)"], bsfa.sliding_window(7)),
    (["global_tokens(3)", "global_tokens(g=3)"], bsfa.global_tokens(3)),
    (["strided(4)", "strided(s=4)"], bsfa.strided(4)),
    (["chunked(9)", "chunked(c=9)"], bsfa.chunked(9)),
    (["prefix_lm(11)", "prefix_lm(p=11)"], bsfa.prefix_lm(11)),
    (["summary(8)", "summary(8, 1)", "summary(stride=8)", "summary(stride=8, c=1)", "summary(c=1, stride=8)"],
     bsfa.summary(8, 1)),
    (["summary(8, 3)", "summary(8, c=3)"], bsfa.summary(8, 3)),
    (["random_blocks(2)", "random_blocks(2, 128, 0)", "random_blocks(r=2)", "random_blocks(2, seed=0)"],
     bsfa.random_blocks(2)),
    (["random_blocks(2, 64, 7)", "random_blocks(2, block_size=64, seed=7)", "random_blocks(seed=7, r=2, block_size=64)",
      "random_blocks(2, 64, seed=7)"], bsfa.random_blocks(2, block_size=64, seed=7)),
    (["window(1_000)", "window(1000)"], bsfa.window(1000)),
])
def test_parse_primitives(texts, expected):
    for t in texts:
        assert bsfa.parse(t) == expected, t


def test_parse_tensor_primitives_by_keyword():
    L = 32
    ids = torch.sort(torch.randint(0, 3, (L,))).values
    bm = torch.rand(2, 2) < 0.5
    dm = torch.rand(L, L) < 0.5
    assert bsfa.parse("document", document=ids) == bsfa.document(ids)
    assert bsfa.parse("document()", document=ids) == bsfa.document(ids)
    assert bsfa.parse("block_mask(block_size=16)", block_mask=bm) == bsfa.block_mask(bm, block_size=16)
    assert bsfa.parse("block_mask(16)", block_mask=bm) == bsfa.block_mask(bm, block_size=16)
    assert bsfa.parse("dense_mask", dense_mask=dm) == bsfa.dense_mask(dm)
    m = bsfa.parse("causal & document | dense_mask", document=ids, dense_mask=dm)
    assert m == (bsfa.causal() & bsfa.document(ids)) | bsfa.dense_mask(dm)
    for name in ("document", "block_mask", "dense_mask"):
        with pytest.raises(MaskSyntaxError, match=name):
            bsfa.parse(f"causal & {name}")


def test_integer_variables():
    assert bsfa.parse("window(w)", w=7) == bsfa.window(7)
    assert bsfa.parse("sliding_window(w=n)", n=3) == bsfa.sliding_window(3)
    with pytest.raises(MaskSyntaxError, match="unknown variable 'x'"):
        bsfa.parse("window(x)", w=7)
    with pytest.raises(MaskSyntaxError):
        bsfa.parse("window(w)", w=True)  # bools are not ints here


def test_whitespace_and_nested_parens():
    base = bsfa.causal() & (bsfa.window(256) | bsfa.global_tokens(64))
    for t in ["causal & (window(256) | global_tokens(64))",
              "causal&(window(256)|global_tokens(64))",
              "  causal\n&\n( window( 256 )|\tglobal_tokens (64) )  ",
              "((causal)) & (((window(256)) | ((global_tokens(64)))))",
              "(causal & (window(256) | global_tokens(64)))"]:
        assert bsfa.parse(t) == base, t
    assert bsfa.parse("(" * 50 + "causal" + ")" * 50) == bsfa.causal()  # moderate nesting is fine


def test_issue_example_equivalence():
    m = bsfa.causal() & (bsfa.window(256) | bsfa.global_tokens(64))
    m2 = bsfa.parse("causal & (window(256) | global_tokens(64))")
    assert m == m2 and torch.equal(m.to_dense(300, 400), m2.to_dense(300, 400))


# ------------------------------------------------------------------------------------------------
# named patterns
# ------------------------------------------------------------------------------------------------
def test_list_patterns():
    pats = bsfa.list_patterns()
    assert isinstance(pats, dict)
    for name in REQUIRED_PATTERNS:
        assert name in pats, name
        assert isinstance(pats[name], str) and pats[name].strip(), name
        assert "\n" not in pats[name]
    for name in pats:
        info = bsfa.pattern_info(name)
        assert info.citation.strip(), f"pattern {name} lacks a citation"
        assert info.body.strip()


def test_patterns_default_expressions():
    ids = torch.zeros(64, dtype=torch.long)
    expected = {
        "causal": bsfa.causal(),
        "dense": bsfa.full(),
        "sliding_window": bsfa.sliding_window(4096),
        "longformer": bsfa.window(256) | bsfa.global_tokens(64),
        "bigbird": bsfa.window(192) | bsfa.global_tokens(128) | bsfa.random_blocks(3, block_size=128, seed=0),
        "sparse_transformer_strided": bsfa.causal() & (bsfa.sliding_window(256) | bsfa.strided(256)),
        "sparse_transformer_fixed": bsfa.causal() & (bsfa.chunked(128) | bsfa.summary(128, 16)),
        "prefix_lm": bsfa.prefix_lm(512),
        "document_causal": bsfa.causal() & bsfa.document(ids),
    }
    for name, want in expected.items():
        got = bsfa.load_pattern(name, document=ids) if name == "document_causal" else bsfa.load_pattern(name)
        assert got == want, (name, str(got))


def test_load_pattern_overrides():
    assert bsfa.load_pattern("bigbird", window=64) == (
        bsfa.window(64) | bsfa.global_tokens(128) | bsfa.random_blocks(3, block_size=128, seed=0))
    assert bsfa.load_pattern("bigbird", window=64, n_global=2, n_random=1, block=32, seed=9) == (
        bsfa.window(64) | bsfa.global_tokens(2) | bsfa.random_blocks(1, block_size=32, seed=9))
    assert bsfa.load_pattern("longformer", window=512) == bsfa.window(512) | bsfa.global_tokens(64)
    assert bsfa.load_pattern("sliding_window", window=128) == bsfa.sliding_window(128)
    assert bsfa.load_pattern("prefix_lm", prefix=3) == bsfa.prefix_lm(3)
    with pytest.raises(ValueError, match="unknown parameter 'foo'"):
        bsfa.load_pattern("longformer", foo=3)
    with pytest.raises(ValueError, match="longformer"):
        bsfa.load_pattern("longformer", window=-1)  # validated by the primitive
    with pytest.raises(ValueError, match="int"):
        bsfa.load_pattern("longformer", window=1.5)


def test_load_pattern_unknown_name_lists_known():
    with pytest.raises(ValueError) as ei:
        bsfa.load_pattern("no_such_pattern")
    msg = str(ei.value)
    for name in REQUIRED_PATTERNS:
        assert name in msg


def test_document_causal_needs_tensor():
    L = 48
    ids = torch.sort(torch.randint(0, 4, (L,))).values
    m = bsfa.load_pattern("document_causal", document=ids)
    assert m == bsfa.causal() & bsfa.document(ids)
    assert torch.equal(m.to_dense(L), bsfa.causal().to_dense(L) & (ids[:, None] == ids[None, :]))
    with pytest.raises(ValueError, match="document"):
        bsfa.load_pattern("document_causal")
    with pytest.raises(ValueError, match="document"):
        bsfa.parse("document_causal")
    with pytest.raises(ValueError, match="document"):
        bsfa.parse("causal & document")
    with pytest.raises(ValueError):
        bsfa.load_pattern("causal", document=ids)  # takes no tensor
    assert bsfa.parse("document_causal", document=ids) == m
    assert bsfa.parse("causal & document", document=ids) == m
    ids2 = torch.sort(torch.randint(0, 4, (2, L)), dim=1).values
    assert bsfa.load_pattern("document_causal", document=ids2).batch_shape == (2, 1)


def test_patterns_compose_in_text():
    m = bsfa.parse("causal & longformer(window=512)")
    want = bsfa.causal() & (bsfa.window(512) | bsfa.global_tokens(64))
    assert m == want
    assert m == bsfa.causal() & bsfa.load_pattern("longformer", window=512)
    assert torch.equal(m.to_dense(700, 900), want.to_dense(700, 900))
    assert bsfa.parse("longformer(512, 8)") == bsfa.window(512) | bsfa.global_tokens(8)
    assert bsfa.parse("~bigbird(window=3, n_random=1) & causal") == (
        ~bsfa.load_pattern("bigbird", window=3, n_random=1)) & bsfa.causal()
    assert bsfa.parse("sparse_transformer_fixed(stride=64, c=4)") == bsfa.load_pattern(
        "sparse_transformer_fixed", stride=64, c=4)
    with pytest.raises(MaskSyntaxError, match="unknown parameter"):
        bsfa.parse("longformer(windw=3)")
    with pytest.raises(MaskSyntaxError):
        bsfa.parse("longformer(1, 2, 3)")


@pytest.mark.parametrize("name", [
    "causal", "dense", "longformer", "bigbird", "sparse_transformer_strided", "sparse_transformer_fixed",
    "document_causal", "sliding_window", "prefix_lm",
])
def test_every_pattern_is_usable_by_name_in_text(name):
    """"Patterns compose with other expressions in the DSL": every named pattern, by its name."""
    ids = torch.zeros(16, dtype=torch.long)
    kw = {"document": ids} if name == "document_causal" else {}
    assert bsfa.parse(name, **kw) == bsfa.load_pattern(name, **kw)
    assert bsfa.parse(f"full & {name}", **kw) == bsfa.full() & bsfa.load_pattern(name, **kw)


# ------------------------------------------------------------------------------------------------
# error messages
# ------------------------------------------------------------------------------------------------
def caret_column(msg: str) -> tuple[str, int]:
    """(displayed line, caret column within it) from a MaskSyntaxError message."""
    lines = msg.splitlines()
    caret = lines[-1]
    assert caret.strip() == "^", msg
    return lines[-2][2:], caret.index("^") - 2


def test_mask_syntax_error_is_value_error():
    assert issubclass(MaskSyntaxError, ValueError)
    with pytest.raises(ValueError):
        bsfa.parse("causal &")


@pytest.mark.parametrize("text,pos", [
    ("causal & windw(3)", 9),
    ("causal &", 8),
    ("causal && window(3)", 8),
    ("window(3", 8),
    ("window(3))", 9),
    ("causal $ full", 7),
    ("causal window(3)", 7),
    ("window(1.5)", 8),
    ("window(1 2)", 9),
    ("window(w=1, 2)", 12),
    ("window(w=1, w=2)", 12),
    ("window(2147483648)", 7),
    (")", 0),
    ("", 0),
    ("~", 1),
    ("causal & (window(3) | )", 22),
])
def test_caret_under_the_right_column(text, pos):
    with pytest.raises(MaskSyntaxError) as ei:
        bsfa.parse(text)
    e = ei.value
    assert e.pos == pos, (text, e.pos, str(e))
    line, col = caret_column(str(e))
    assert line == text
    assert col == pos


def test_caret_on_multiline_text():
    text = "causal\n  & (window(3)\n  | glob(2))"
    with pytest.raises(MaskSyntaxError) as ei:
        bsfa.parse(text)
    line, col = caret_column(str(ei.value))
    assert line == "  | glob(2))"
    assert line[col:].startswith("glob")


def test_unknown_name_lists_known_names():
    with pytest.raises(MaskSyntaxError) as ei:
        bsfa.parse("causal & windw(3)")
    msg = str(ei.value)
    assert "windw" in msg
    for name in list(PRIMITIVES) + REQUIRED_PATTERNS:
        assert name in msg, name


def test_argument_errors_name_primitive_and_argument():
    with pytest.raises(MaskSyntaxError, match=r"window\(\).*'w'"):
        bsfa.parse("causal & window(-1)")
    with pytest.raises(MaskSyntaxError, match=r"sliding_window\(\).*'w'"):
        bsfa.parse("sliding_window(0)")
    with pytest.raises(MaskSyntaxError, match=r"strided\(\).*'s'"):
        bsfa.parse("strided(0)")
    with pytest.raises(MaskSyntaxError, match=r"chunked\(\).*'c'"):
        bsfa.parse("chunked(c=0)")
    with pytest.raises(MaskSyntaxError, match="unknown argument 'x'"):
        bsfa.parse("window(x=1)")
    with pytest.raises(MaskSyntaxError, match="missing required argument 'w'"):
        bsfa.parse("window")
    with pytest.raises(MaskSyntaxError, match="at most"):
        bsfa.parse("window(1, 2)")


def test_huge_integers_rejected():
    for t in ["window(2147483648)", "window(99999999999999999999999)", "window(" + "9" * 10000 + ")",
              "random_blocks(1, seed=4294967296)", "window(-2147483649)", "window(1_000_000_000_000)"]:
        with pytest.raises(MaskSyntaxError):
            bsfa.parse(t)
    assert bsfa.parse("window(2147483647)") == bsfa.window(2**31 - 1)


def test_deep_nesting_is_a_syntax_error_not_recursion_error():
    for t in ["(" * 5000 + "causal" + ")" * 5000, "~" * 5000 + "causal", "(" * 100000,
              "~(" * 3000 + "causal" + ")" * 3000]:
        with pytest.raises(MaskSyntaxError):
            bsfa.parse(t)


def test_long_flat_expressions_parse():
    m = bsfa.parse(" & ".join(["causal"] * 3000))
    assert len(m.children) == 3000
    with pytest.raises(MaskSyntaxError):
        bsfa.parse("causal | " * 20000 + "causal")  # over the text length limit


def test_parse_rejects_non_text():
    with pytest.raises(TypeError):
        bsfa.parse(b"causal")
    with pytest.raises(TypeError):
        bsfa.parse(None)


# ------------------------------------------------------------------------------------------------
# fuzzing and code execution
# ------------------------------------------------------------------------------------------------
def _parse_or_error(text, **kw):
    try:
        m = bsfa.parse(text, **kw)
    except MaskSyntaxError as e:
        assert isinstance(e.pos, int) and 0 <= e.pos <= len(text)
        return None
    except ValueError:
        return None
    assert isinstance(m, bsfa.Mask)
    return m


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(max_size=60))
def test_fuzz_arbitrary_text(text):
    _parse_or_error(text)


TOKENS = sorted(PRIMITIVES) + REQUIRED_PATTERNS + [
    "(", ")", "&", "|", "~", ",", "=", "-", "0", "1", "3", "128", "2147483648", "99999999999999", " ", "\n",
    "w", "x", "seed", "block_size", "window=", "__import__", "os", "'", '"', ".", ";", "1_0", "__",
]


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(TOKENS), max_size=30))
def test_fuzz_token_soup(tokens):
    ids = torch.zeros(8, dtype=torch.long)
    m = _parse_or_error("".join(tokens), document=ids, w=3)
    if m is not None:  # whatever parses must print and re-parse to the same mask
        assert bsfa.parse(str(m), document=ids) == m


def test_no_code_is_executed(tmp_path, monkeypatch):
    target = tmp_path / "pwned"
    calls = []

    def trap(*a, **k):
        calls.append(a)
        raise AssertionError("eval/exec called by the DSL")

    bsfa.list_patterns()  # make sure nothing is left to import lazily
    monkeypatch.setattr(builtins, "eval", trap)
    monkeypatch.setattr(builtins, "exec", trap)
    hostile = [
        f"__import__('os').system('touch {target}')",
        f"causal & __import__(\"os\").system(\"touch {target}\")",
        "eval('1')", "exec('x=1')", "causal; import os", "lambda: 0", "open('/etc/passwd')",
        "causal.__class__", "window(__import__)", "window(1 if 1 else 2)", "[causal]", "{causal}",
        "causal # comment", "causal\\\n& full", "window(0x10)", "window(1e3)", "causal@full",
    ]
    for t in hostile:
        with pytest.raises(MaskSyntaxError):
            bsfa.parse(t)
    # valid text, patterns included, does not call eval/exec either
    for t in ["causal & (window(256) | global_tokens(64))", "bigbird(window=64) | longformer", "~dense"]:
        bsfa.parse(t)
    assert not target.exists()
    assert calls == []


def test_mask_package_source_has_no_eval_or_exec():
    root = pathlib.Path(bsfa.__file__).parent / "mask"
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"eval", "exec", "compile", "__import__"}, (path, node.lineno)
