"""The examples in docstrings run, and give what they show."""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

import aoti_eager  # noqa: F401 - gives kernels/ the wrapped-number test that examples use

# Modules whose examples stand alone. Those of aoti_eager, _prewarm,
# load_probe and cache.{remote,resp,signing,store} need a manifest, a server, a
# key or a library built first: they show use, and are not run.
MODULES = [
    "aoti_eager._ops", "aoti_eager._reach", "aoti_eager.kernels.compile", "aoti_eager.kernels.dynamic",
    "aoti_eager.kernels.examples", "aoti_eager.kernels.request", "aoti_eager.kernels.signature",
    "aoti_eager.kernels.inductor.wrapper_split", "aoti_eager.kernels.inductor.internals", "aoti_eager.kernels.seam",
    "aoti_eager.kernels.region_shapes",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    results = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples of {name} failed (output above)"


# Figures go stale with the next change; package code names the BENCHMARKS.md
# section instead. Dates and issue numbers belong to the repository's history.
STALE = {
    "a timing": re.compile(r"\d+(\.\d+)? ?(s|ms|us|µs)\b"),
    "a ratio": re.compile(r"\b\d+\.\d+ ?[x×](?!\w)"),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "an issue number": re.compile(r"\bissues? #?\d+", re.IGNORECASE),
}
ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("aoti_eager", "kernels", "cache", "csrc")
CPP_SUFFIXES = (".cpp", ".h", ".hpp", ".cc", ".cu", ".cuh")


def _python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of each comment and docstring of a Python source."""
    prose = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                prose.extend((first.lineno + i, line) for i, line in enumerate(first.value.value.split("\n")))
    return prose


def _cpp_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of each line of the `//` and `/* */` comments of a C++ source,
    skipping string and character literals (raw strings included)."""
    prose, i, n = [], 0, len(source)
    while i < n:
        if source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end < 0 else end
            prose.append((source.count("\n", 0, i) + 1, source[i:end]))
            i = end
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            end = n if end < 0 else end + 2
            first = source.count("\n", 0, i) + 1
            prose.extend((first + k, line) for k, line in enumerate(source[i:end].split("\n")))
            i = end
        elif source.startswith('R"', i) and (i == 0 or not (source[i - 1].isalnum() or source[i - 1] == "_")):
            delimiter = source[i + 2:source.index("(", i)]
            i = source.index(")" + delimiter + '"', i) + len(delimiter) + 2
        elif source[i] in "\"'":
            quote, i = source[i], i + 1
            while i < n and source[i] != quote:
                i += 2 if source[i] == "\\" else 1
            i += 1
        else:
            i += 1
    return prose


def _package_prose():
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix == ".py":
                prose = _python_prose(path.read_text())
            elif path.suffix in CPP_SUFFIXES:
                prose = _cpp_prose(path.read_text())
            else:
                continue
            for line, text in prose:
                yield path.relative_to(ROOT), line, text


def _stale(prose) -> list[str]:
    return [f"{path}:{line}: {what}: {text.strip()}" for path, line, text in prose
            for what, pattern in STALE.items() if pattern.search(text)]


def test_package_comments_and_docstrings_quote_no_timings_dates_or_issues():
    found = _stale(_package_prose())
    assert not found, "name the BENCHMARKS.md section instead of:\n" + "\n".join(found)


def test_the_scan_sees_python_comments_docstrings_and_cpp_comments():
    python = 'def f():\n    """Takes 2.5 ms."""\n    x = "12 s"  # was 3 s, 0.98x eager\n'
    cpp = 'auto s = "5 us"; // 40 ns\n/* one\n   2026-11-24 */ char c = \'"\'; // issue 20\nauto r = R"x(7 s)x";\n'
    found = _stale([("f.py", line, text) for line, text in _python_prose(python)]
                   + [("f.cpp", line, text) for line, text in _cpp_prose(cpp)])
    assert found == ["f.py:3: a timing: # was 3 s, 0.98x eager", "f.py:3: a ratio: # was 3 s, 0.98x eager",
                     "f.py:2: a timing: Takes 2.5 ms.",
                     "f.cpp:3: a date: 2026-11-24 */", "f.cpp:3: an issue number: // issue 20"]


PUBLIC = ["enable", "disable", "enabled", "stats", "ops_reached", "prewarm", "fuse", "unfuse", "wait"]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_functions_document_args_returns_and_examples(name):
    """In torch.library's style: every parameter under ``Args:``, then
    ``Returns:`` and ``Examples::`` with at least one ``>>>`` line."""
    fn = getattr(aoti_eager, name)
    doc = inspect.getdoc(fn) or ""
    for section in ("Returns:", "Examples::"):
        assert f"\n{section}" in doc, f"aoti_eager.{name}'s docstring has no {section!r} section"
    assert ">>> " in doc.split("Examples::", 1)[1], f"aoti_eager.{name}'s Examples:: show no call"
    parameters = [("**" if p.kind is p.VAR_KEYWORD else "*" if p.kind is p.VAR_POSITIONAL else "") + p.name
                  for p in inspect.signature(fn).parameters.values()]
    if parameters:
        args = doc.split("\nArgs:\n", 1)[1].split("\n\n", 1)[0] if "\nArgs:\n" in doc else ""
        undocumented = [p for p in parameters if not re.search(rf"^    {re.escape(p)}\b", args, re.MULTILINE)]
        assert not undocumented, f"aoti_eager.{name}'s Args: leave out {undocumented}"
