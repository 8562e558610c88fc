"""The ```python blocks of README.md and docs/*.md run as written.

Every fenced ```python block of a page is executed, in page order, in one namespace per page (a
later block may use what an earlier one defined), in a fresh temporary working directory. A block
that cannot run (a signature listing, pseudo-code that needs a GPU server or a training loop) is
marked on the line just before its fence with ``<!-- illustration -->``, visibly in the source; it
is skipped, and the pages keep such blocks few (``MAX_ILLUSTRATIONS``). A failing block is reported
with its page and line, so the fix is to correct the example (or, if it really cannot run, to mark
it). Never: runs a block that is not ```python, or lets a block's failure pass.
"""

from __future__ import annotations

import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- illustration -->"
MAX_ILLUSTRATIONS = 10  # over all pages (9 today); a new illustration should replace one, not add to them
FENCE = re.compile(r"^```python\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    illustration: bool


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The ```python blocks of one page, in order, with whether each is marked as an illustration."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            marked = any(lines[k].strip() == MARK for k in range(max(0, i - 2), i))
            out.append(Block(page, i + 1, "\n".join(lines[i + 1 : j]) + "\n", marked))
            i = j
        i += 1
    return out


def runnable_pages() -> list[Path]:
    return [p for p in pages() if any(not b.illustration for b in blocks(p))]


def test_the_block_reader_sees_fences_and_marks():
    text = "intro\n<!-- illustration -->\n```python\nf(x) -> int\n```\n\n```python\nx = 1\n```\n```bash\nls\n```\n"
    page = Path(os.environ.get("TMPDIR", "/tmp")) / "asyncrl-docs-reader-check.md"
    page.write_text(text)
    try:
        found = blocks(page)
    finally:
        page.unlink()
    assert [(b.line, b.illustration, b.code) for b in found] == [(3, True, "f(x) -> int\n"), (7, False, "x = 1\n")]


def test_illustrations_are_few_and_every_page_with_code_runs_some():
    marked = [f"{b.page.relative_to(ROOT)}:{b.line}" for p in pages() for b in blocks(p) if b.illustration]
    assert len(marked) <= MAX_ILLUSTRATIONS, f"too many blocks marked {MARK}: {marked}"
    readme = blocks(ROOT / "README.md")
    assert readme and all(not b.illustration for b in readme), "README's python examples must run"


@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_of_the_page_runs(page: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_example_{page.stem}"}
    for block in blocks(page):
        if block.illustration:
            continue
        where = f"{page.relative_to(ROOT)}:{block.line}"
        try:
            exec(compile(block.code, where, "exec"), namespace)  # noqa: S102 - the documented example itself
        except Exception:  # noqa: BLE001 - every failure of an example is reported with its place
            pytest.fail(f"the python block at {where} fails; fix the example or mark it {MARK}:\n"
                        f"{traceback.format_exc(limit=-3)}")
