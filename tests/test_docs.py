"""The documents hold together: every relative link in README.md, BENCHMARKS.md, docs/ and
benchmarks/results/README.md reaches an existing file (and, for a Markdown target, an existing
heading), and the README keeps the two commands a fresh machine starts with."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import ROOT

DOCUMENTS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "results" / "README.md",
                    *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def links(text: str) -> list[str]:
    """The link targets of a Markdown text, outside code."""
    return LINK.findall(CODE.sub("", text))


def anchors(markdown: Path) -> set[str]:
    """GitHub's anchors of the headings: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in CODE.sub("", markdown.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def broken_links(document: Path) -> list[str]:
    broken = []
    for target in links(document.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto: -- not checked here
            continue
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no such heading)")
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document):
    assert broken_links(document) == []


def test_the_link_check_catches_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a-heading) [gone](missing.md) [gone](there.md#nope) "
                    "`[code](not-a-link.md)` [web](https://example.com)\n")
    assert broken_links(page) == ["missing.md (no such file)", "there.md#nope (no such heading)"]


def test_readme_is_a_landing_page_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for command, script in (("bash scripts/quickstart.sh", "scripts/quickstart.sh"),
                            ("bash scripts/run_tests.sh", "scripts/run_tests.sh")):
        assert f"\n    {command}\n" in readme, command
        assert (ROOT / script).is_file()
    # CI runs the README's test command.
    assert "bash scripts/run_tests.sh" in (ROOT / ".ci" / "run").read_text()
