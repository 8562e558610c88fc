"""Every section reference into the project's own documents resolves (docs/algorithms.md, docs/architecture.md).

Code and docs cite the math and the architecture as ``docs/algorithms.md §6.7`` or
``docs/architecture.md §1``. These tests read every ``.py`` file of the repository's packages and
tests, README.md and ``docs/*.md``, find each such reference (single sections, lists such as
``§4, §6.1-§6.5`` and ranges such as ``§2.1-2.2``), and check that the cited section is a numbered
heading of that document (``## 6. Objectives``, ``### 6.7 TBPO ...``, ``### 13.6b ...``). Headings
inside fenced code blocks do not count.

A citation by the documents' old, upper-case names (the specification files these pages replace,
whose section numbers ``docs/`` keeps) is resolved against the ``docs/`` file too, so a citation points
at real content before and after the mechanical rewrite to the ``docs/`` path. A separate test asks
that no file cite the old names at all: the repository stands alone. This file spells the old names
only in pieces (``OLD_NAMES``), so a repository-wide rewrite leaves it intact.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OLD_NAMES = ("ALGORITHMS" + ".md", "ARCHITECTURE" + ".md")  # the spec files' names outside the repository
DOCS = {"algorithms": ROOT / "docs" / "algorithms.md", "architecture": ROOT / "docs" / "architecture.md"}
PY_TOPS = ("protocols", "asyncrl", "workers", "scripts", "tests")
THIS = Path(__file__).resolve()

SEC = r"\d{1,2}(?:\.\d{1,2})*[a-z]?"
# A reference: the document, then one section, then more sections joined by a range dash
# (the second end may omit the §) or by a comma / "and" (then the § is required).
REF = re.compile(
    rf"(?P<doc>docs/algorithms\.md|docs/architecture\.md|{'|'.join(re.escape(n) for n in OLD_NAMES)})"
    rf"\s*(?P<secs>§\s*{SEC}(?:\s*[-–]\s*§?\s*{SEC}|\s*(?:,|and)\s*§\s*{SEC})*)"
)
BARE = re.compile(rf"(?<![\w/.])({'|'.join(re.escape(n) for n in OLD_NAMES)})")
HEADING = re.compile(rf"^#{{1,6}}\s+({SEC})\.?(?:\s|$)")


def source_files() -> list[Path]:
    files = [p for top in PY_TOPS for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts]
    files += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return sorted(p for p in files if p.is_file() and p.resolve() != THIS)


def sections(path: Path) -> set[str]:
    """Section ids of the numbered headings of a markdown file, outside fenced code blocks."""
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            found.add(m.group(1))
    return found


def references() -> list[tuple[str, int, str, str]]:
    """(file, line, document key, section id) for every cited section."""
    out = []
    for path in source_files():
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in REF.finditer(line):
                doc = "algorithms" if "lgorithms" in m.group("doc").lower() else "architecture"
                for sec in re.findall(SEC, m.group("secs")):
                    out.append((str(path.relative_to(ROOT)), lineno, doc, sec))
    return out


def test_reference_parser_reads_lists_and_ranges():
    text = f"x (docs/algorithms.md §4, §6.1-§6.5, §6.7) y {OLD_NAMES[1]} §1-2 z docs/algorithms.md §2.1-2.2, STYLE L7"
    got = [(m.group("doc"), re.findall(SEC, m.group("secs"))) for m in REF.finditer(text)]
    assert got == [("docs/algorithms.md", ["4", "6.1", "6.5", "6.7"]), (OLD_NAMES[1], ["1", "2"]),
                   ("docs/algorithms.md", ["2.1", "2.2"])]


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_each_document_has_numbered_sections_and_no_duplicates(doc):
    path = DOCS[doc]
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing; code cites it"
    ids: list[str] = []
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            ids.append(m.group(1))
    assert ids, f"{path.name} has no numbered headings (## 1. ...)"
    dups = sorted({i for i in ids if ids.count(i) > 1})
    assert not dups, f"{path.name} numbers these sections twice: {dups}"


def test_every_section_reference_resolves_to_a_heading():
    known = {doc: sections(path) for doc, path in DOCS.items()}
    refs = references()
    missing = [f"{f}:{n}: docs/{doc}.md §{sec}" for f, n, doc, sec in refs if sec not in known[doc]]
    assert not missing, "cited sections that docs/ does not have (add the section or fix the citation):\n" + \
        "\n".join(missing)


def test_no_file_cites_the_spec_documents_outside_the_repository():
    bare = []
    for path in source_files():
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if BARE.search(line):
                bare.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:100]}")
    assert not bare, "cite docs/algorithms.md or docs/architecture.md (files of this repository):\n" + \
        "\n".join(bare)
