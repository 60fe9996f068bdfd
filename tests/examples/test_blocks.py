"""The README's and tied docs pages' Python blocks are the examples' marked excerpts, so the
code a reader copies is the code tests/examples/test_run_examples.py runs."""

import difflib

import pytest

from tests.examples.blocks import PAGES, all_blocks, all_excerpts, excerpts, page_blocks


def _closest(text: str, candidates: dict[str, str]) -> str:
    if not candidates:
        return "no example has a marked excerpt"
    key = max(candidates, key=lambda k: difflib.SequenceMatcher(None, text, candidates[k]).ratio())
    diff = difflib.unified_diff(candidates[key].splitlines(), text.splitlines(),
                                f"examples/{key}", "the page's block", lineterm="")
    return "closest excerpt, diff to the page's block:\n" + "\n".join(diff)


def test_every_python_block_of_the_pages_is_an_example_excerpt():
    found = all_excerpts()
    texts = set(found.values())
    wrong = [f"{block.where()} equals no '# block:' excerpt of examples/*.py; "
             f"{_closest(block.text, found)}"
             for block in all_blocks() if not block.exempt and block.text.strip("\n") not in texts]
    assert not wrong, "\n\n".join(wrong)


def test_every_excerpt_is_shown_on_a_page():
    shown = {b.text.strip("\n") for b in all_blocks()}
    unshown = [key for key, text in all_excerpts().items() if text not in shown]
    assert not unshown, f"marked excerpts that no page of {PAGES} shows: {unshown}"


def test_the_parsers_find_blocks_and_excerpts_and_exemptions():
    page = ("x\n```python\na = 1\n```\n<!-- not an example: pseudo-code -->\n```python\n"
            "b = 2\n```\n```bash\nc\n```\n")
    blocks = page_blocks("p.md", page)
    assert [(b.line, b.text, b.exempt) for b in blocks] == [(2, "a = 1", False),
                                                            (6, "b = 2", True)]
    src = "def f():\n    # block: one\n    a = 1\n\n    b = 2\n    # block: end\n    c = 3\n"
    assert excerpts("e.py", src) == {"one": "a = 1\n\nb = 2"}
    with pytest.raises(ValueError, match="no '# block: end'"):
        excerpts("e.py", "# block: one\na = 1\n")
    with pytest.raises(ValueError, match="never closed"):
        page_blocks("p.md", "```python\na\n")
