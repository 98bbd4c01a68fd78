"""Every relative Markdown link in README.md and docs/*.md points to an existing file.

Links are ``[text](target)`` and ``![alt](target)`` outside fenced code blocks and inline
code spans. URLs (``scheme:``) and in-page anchors (``#...``) are not checked; for
``file.md#anchor`` only the file is. A target is resolved relative to the page that holds
the link.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Pages that may be linked before they exist (none now).
TODO_TARGETS: set[str] = set()

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link of ``page`` outside code."""
    out, fence = [], None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if marker:
            if fence is None:
                fence = marker.group(1)[0] * len(marker.group(1))
            elif stripped.startswith(fence):
                fence = None
            continue
        if fence is not None:
            continue
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            target = match.group(1)
            if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            out.append((number, target))
    return out


def test_pages_found():
    found = {p.relative_to(ROOT).as_posix() for p in pages()}
    assert {"README.md", "docs/results.md", "docs/tests.md"} <= found


def test_link_parser(tmp_path):
    sample = "a [x](docs/a.md#s) ![f](figures/f.png) [u](https://e.org) [h](#top) `[c](no.md)` [[n]](b.md)"
    page = tmp_path / "sample.md"
    page.write_text(sample + "\n```\n[in](fence.md)\n```\n", encoding="utf-8")
    assert [t for _, t in relative_links(page)] == ["docs/a.md#s", "figures/f.png", "b.md"]


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    missing = []
    for number, target in relative_links(page):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        try:
            rel = path.relative_to(ROOT).as_posix()
        except ValueError:
            rel = None
        if rel in TODO_TARGETS:
            continue
        if not path.exists():
            missing.append(f"{page.relative_to(ROOT)}:{number}: {target}")
    assert not missing, "relative links to missing files:\n" + "\n".join(missing)
