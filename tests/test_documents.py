"""The documents' links lead somewhere: every relative link of README.md,
BENCHMARKS.md and docs/*.md names a file that exists and, where it names a
heading (``#anchor``), a heading of that file; every BENCHMARKS.md section that
package code names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"(`+).*?\1", re.DOTALL)
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def _prose(markdown: str) -> str:
    """The text outside code blocks and code spans, where links are links."""
    return _CODE.sub("", _FENCE.sub("", markdown))


def anchors(markdown: str) -> set[str]:
    """The ``#anchor`` of each heading, as GitHub makes them: lower case, no
    punctuation but ``-`` and ``_``, spaces as ``-``, ``-1``, ``-2``... on repeats."""
    seen: dict[str, int] = {}
    result = set()
    for heading in _HEADING.findall(_FENCE.sub("", markdown)):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def broken_links(document: Path) -> list[str]:
    """``file: link (why)`` for each relative link of ``document`` that leads nowhere."""
    broken = []
    for target in _LINK.findall(_prose(document.read_text())):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists():
            broken.append(f"{document.name}: {target} (no file {path})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            broken.append(f"{document.name}: {target} (no heading #{anchor} in {resolved.name})")
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_to_files_and_headings(document):
    broken = broken_links(document)
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


def test_the_link_check_finds_missing_files_and_headings(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A model's first `forward` (CPU)\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-models-first-forward-cpu) [repeat](other.md#twice-1) [self](#page)\n"
        "[web](https://example.com/x) `[code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n"
        "[gone](missing.md) [no heading](other.md#nope) [no heading here](#nope)\n")
    assert broken_links(page) == [
        "page.md: missing.md (no file missing.md)",
        "page.md: other.md#nope (no heading #nope in other.md)",
        "page.md: #nope (no heading #nope in page.md)",
    ]


# A reference in package code: BENCHMARKS.md, "Section name" (a comment or
# docstring may wrap it over lines).
_SECTION_REFERENCE = re.compile(r'BENCHMARKS\.md,\s+"([^"]+)"')
_LINE_START = re.compile(r"\s*\n\s*(?:#|//|\*)?\s*")


def test_benchmark_sections_named_in_package_code_exist():
    sections = {heading.replace("`", "") for heading in _HEADING.findall((ROOT / "BENCHMARKS.md").read_text())}
    missing = []
    for folder in ("aoti_eager", "kernels", "cache", "csrc", "scripts"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".cpp", ".h", ".sh"):
                continue
            text = _LINE_START.sub(" ", path.read_text())
            missing += [f"{path.relative_to(ROOT)}: {name!r}" for name in _SECTION_REFERENCE.findall(text)
                        if name not in sections]
    assert not missing, "BENCHMARKS.md has no section named:\n" + "\n".join(missing)


def test_the_layer_table_names_every_module():
    table = (ROOT / "docs" / "internals.md").read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    modules = [p for folder in ("aoti_eager", "kernels", "cache") for p in (ROOT / folder).rglob("*.py")
               if p.name != "__init__.py"]
    assert modules
    unnamed = [str(p.relative_to(ROOT)) for p in modules if f"{p.name}`" not in table]
    assert not unnamed, f"docs/internals.md's layer table does not name {unnamed}"
