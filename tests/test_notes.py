"""Every Note reference in the code and the docs names exactly one Note that exists.

How a Note is written (the rule this file checks, and the one new Notes follow):

- A Note is *defined* where ``[Note: NAME]`` opens a line (after indentation, and after an
  optional ``#`` comment marker or the opening quotes of a docstring) and is followed either by
  the end of that line (the text follows on the next lines) or by a sentence that starts with a
  capital letter or a backtick. The definition is the paragraph(s) after it, in one file.
- Anywhere else, ``[Note: NAME]`` is a *reference*, usually with the file of the definition
  beside it (``[Note: NAME] in path.py``). A reference may break across lines (the line break
  and any ``#`` of the next comment line count as one space).
- NAME is compared after collapsing runs of white space to one space. ``[Note: ...]`` (a name
  of dots only) is how prose speaks of Notes in general, and is neither.

Scanned: src/, tests/, benchmarks/, examples/ (``*.py``), docs/ (``*.md``) and README.md.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPEN = "[" + "Note:"  # split so that this file's own text is no Note
_ANY = re.compile(re.escape(OPEN) + r"\s+([^\]]+?)\]", re.S)
_DEFINITION = re.compile(r'^[ \t]*(?:#[ \t]*|r?""")?' + re.escape(OPEN)
                         + r"\s+([^\]\n]+?)\](?=[ \t]*$|[ \t]+[A-Z`])", re.M)


def _files() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for top in ("src", "tests", "benchmarks", "examples"):
        found += sorted(p for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts)
    return [p for p in found if p.is_file() and p != Path(__file__).resolve()]


def _name(raw: str) -> str:
    """The name as written, with a line break (and the next line's ``#`` or ``>``) read as one
    space."""
    return " ".join(re.sub(r"\n[ \t]*[#>]?", " ", raw).split())


def _scan() -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """Definitions (name -> where) and references ((name, where)) in every scanned file."""
    definitions: dict[str, list[str]] = defaultdict(list)
    references: list[tuple[str, str]] = []
    for path in _files():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT).as_posix()
        defined_at = set()
        for m in _DEFINITION.finditer(text):
            start = m.start(1) - len(OPEN) - 1
            defined_at.add(text.index(OPEN, start))
            line = text.count("\n", 0, m.start()) + 1
            definitions[_name(m.group(1))].append(f"{rel}:{line}")
        for m in _ANY.finditer(text):
            if m.start() not in defined_at:
                line = text.count("\n", 0, m.start()) + 1
                references.append((_name(m.group(1)), f"{rel}:{line}"))
    return definitions, references


def test_the_rule_tells_definitions_from_references():
    text = (f'"""{OPEN} alpha]\nwhy alpha.\n"""\n# {OPEN} beta] The reason.\n'
            f"x = 1  # see {OPEN} alpha] in a.py\n{OPEN} beta] in b.py).\n"
            f"# as ({OPEN} gamma\n# delta]) says\n")
    defined = {_name(m.group(1)) for m in _DEFINITION.finditer(text)}
    assert defined == {"alpha", "beta"}
    names = [_name(m.group(1)) for m in _ANY.finditer(text)]
    assert names == ["alpha", "beta", "alpha", "beta", "gamma delta"]


def test_the_scan_finds_the_notes():
    definitions, references = _scan()
    assert len(definitions) >= 48, sorted(definitions)
    assert len(references) >= 48


def test_no_note_is_defined_twice():
    definitions, _ = _scan()
    twice = {name: where for name, where in definitions.items() if len(where) > 1}
    assert not twice, f"Notes defined more than once: {twice}"


def test_every_reference_resolves_to_a_definition():
    definitions, references = _scan()
    dangling = [f"{where}: {name!r}" for name, where in references
                if name not in definitions and name.strip(".")]
    assert not dangling, "Note references with no definition:\n" + "\n".join(dangling)
