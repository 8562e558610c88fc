"""One numbering per document, every ``docs/PAGE.md §N`` citation lands on a numbered heading, every
repository file the pages cite exists, and the pages are references, not diaries.

``tests/unit/test_docs_refs.py`` resolves citations of docs/algorithms.md and docs/architecture.md in
full (ranges and lists); this module covers every other page, whose citations are single sections
(``docs/benchmarks.md §8``), checks that no page numbers two headings alike (a page renumbered in
part would otherwise send a citation to the wrong place), and that README.md and docs/*.md never speak
of how the project was built (sessions, issue numbers). Never: edits a document.
"""

from __future__ import annotations

import re

from tests.unit.test_docs_refs import HEADING, ROOT, source_files

PAGES = sorted((ROOT / "docs").glob("*.md"))
CITED = re.compile(r"docs/(?P<page>[a-z_]+)\.md,?\s*§\s*(?P<sec>\d{1,2}(?:\.\d{1,2})*[a-z]?)")
FULLY_CHECKED = {"algorithms", "architecture"}


def numbered(page) -> list[str]:
    """Section ids of the page's numbered headings, in order, outside fenced code blocks."""
    out, fenced = [], False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            out.append(m.group(1))
    return out


def test_no_page_numbers_two_headings_alike():
    twice = {p.name: sorted({n for n in numbered(p) if numbered(p).count(n) > 1}) for p in PAGES}
    assert not {k: v for k, v in twice.items() if v}, f"renumber these headings: {twice}"


def test_benchmarks_page_is_numbered_once_from_one():
    top = [n for n in numbered(ROOT / "docs" / "benchmarks.md") if "." not in n]
    assert top == [str(i) for i in range(1, len(top) + 1)], top


def test_every_section_citation_of_the_other_pages_resolves():
    known = {p.stem: set(numbered(p)) for p in PAGES}
    bad = []
    for path in source_files():
        for m in CITED.finditer(path.read_text(errors="replace")):
            page, sec = m.group("page"), m.group("sec").rstrip(".")
            if page in FULLY_CHECKED:
                continue
            if page not in known or sec not in known[page]:
                bad.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not bad, f"these citations point at no numbered heading: {bad}"


HISTORY = re.compile(r"\bsessions?\b|\bthe lead\b|\bhelpers?\b|\bissues? ?#?\d+|\bthe issue\b|\bissue's\b", re.I)


def test_the_pages_are_references_not_diaries():
    """README.md and docs/*.md speak of the system, never of how it was built (sessions, issue numbers)."""
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}" for p in [ROOT / "README.md", *PAGES]
             for i, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not found, f"reword these lines: {found}"


CITED_FILE = re.compile(r"(?<![\w/.])((?:asyncrl|workers|protocols|scripts|tests|configs|docs|benchmarks|examples)"
                        r"/[\w./-]+\.(?:py|yaml|md|json|png|log|sbatch))\b")
EXTERNAL = {"docs/algo/dapo.md"}  # a file of verl's repository, cited among verl's sources in docs/algorithms.md


def test_every_repository_file_the_pages_cite_exists():
    """A file named in README.md or docs/*.md (``asyncrl/learner/memory.py``, ``benchmarks/results/X.json``)
    is in the repository: a module moved or a result removed must take its citations along."""
    missing = sorted({f"{p.relative_to(ROOT)}: {m.group(1)}" for p in [ROOT / "README.md", *PAGES]
                      for m in CITED_FILE.finditer(p.read_text())
                      if m.group(1) not in EXTERNAL and not (ROOT / m.group(1)).exists()})
    assert not missing, f"these cited files do not exist: {missing}"
