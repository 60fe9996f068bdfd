"""The Python code blocks of the README and the docs pages tied to examples, and the marked
excerpts of the example files they must equal.

An example file marks an excerpt with a comment line ``# block: NAME`` and ends it with
``# block: end``; the lines between, dedented, are the excerpt. A fenced ```python block of a
tied page must equal one excerpt exactly, unless the line before its fence is the comment
``<!-- not an example: REASON -->``.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# The pages whose Python blocks are all examples (or marked as not one).
PAGES = ("README.md", "docs/checkpoint.md", "docs/mesh.md", "docs/pipeline.md", "docs/zero.md")
NOT_AN_EXAMPLE = re.compile(r"<!--\s*not an example:\s*\S.*-->")
_START = re.compile(r"^\s*# block: (?P<name>[\w-]+)\s*$")
_END = re.compile(r"^\s*# block: end\s*$")


@dataclass(frozen=True)
class Block:
    """A fenced Python block of a page: where it is and its text."""

    page: str
    line: int  # 1-based line of the opening fence
    text: str
    exempt: bool  # preceded by <!-- not an example: ... -->

    def where(self) -> str:
        first = self.text.splitlines()[0] if self.text else ""
        return f"{self.page}:{self.line} ({first!r})"


def page_blocks(page: str, text: str) -> list[Block]:
    """Every ```python block of ``text`` (the page ``page``)."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise ValueError(f"{page}:{i + 1}: a ```python block is never closed")
            exempt = i > 0 and bool(NOT_AN_EXAMPLE.search(lines[i - 1]))
            blocks.append(Block(page, i + 1, "\n".join(lines[i + 1:end]), exempt))
            i = end
        i += 1
    return blocks


def excerpts(name: str, text: str) -> dict[str, str]:
    """The marked excerpts of one example file (``name`` for error messages), by block name."""
    found: dict[str, str] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start = _START.match(lines[i])
        if start and not _END.match(lines[i]):
            end = i + 1
            while end < len(lines) and not _END.match(lines[end]):
                if _START.match(lines[end]) and not _END.match(lines[end]):
                    raise ValueError(f"{name}:{end + 1}: block inside block {start['name']!r}")
                end += 1
            if end == len(lines):
                raise ValueError(f"{name}:{i + 1}: block {start['name']!r} has no '# block: end'")
            key = start["name"]
            if key in found:
                raise ValueError(f"{name}:{i + 1}: block {key!r} marked twice")
            found[key] = textwrap.dedent("\n".join(lines[i + 1:end])).strip("\n")
            i = end
        elif _END.match(lines[i]):
            raise ValueError(f"{name}:{i + 1}: '# block: end' without a start")
        i += 1
    return found


def example_files() -> list[Path]:
    """The runnable examples: every examples/*.py not starting with an underscore."""
    return sorted(p for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))


def all_excerpts() -> dict[str, str]:
    """``file:block`` -> excerpt, over every example file."""
    out = {}
    for path in example_files():
        for key, text in excerpts(path.name, path.read_text()).items():
            out[f"{path.name}:{key}"] = text
    return out


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in page_blocks(page, (ROOT / page).read_text())]


def nproc(path: Path) -> int:
    """The ranks an example runs on: ``nproc: N`` in its docstring, else 2."""
    match = re.search(r"^\s*nproc:\s*(\d+)\s*$", path.read_text(), re.MULTILINE)
    return int(match[1]) if match else 2
