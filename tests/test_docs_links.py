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


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of the headings of ``page`` outside fenced code: lower case, punctuation
    other than ``-`` and ``_`` dropped, spaces as ``-``, ``-1``, ``-2`` ... for repeats."""
    anchors, seen, fence = set(), {}, None
    for line in page.read_text(encoding="utf-8").splitlines():
        marker = re.match(r"(`{3,}|~{3,})", line.lstrip())
        if marker:
            fence = None if fence is not None and line.lstrip().startswith(fence) else (fence or marker.group(1))
            continue
        heading = re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line) if fence is None else None
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_heading_anchors(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Performance\n## AMD EPYC (AVX-512), 2 cores\n```\n# not a heading\n```\n## Dry run\n## Dry run\n", encoding="utf-8")
    assert heading_anchors(page) == {"performance", "amd-epyc-avx-512-2-cores", "dry-run", "dry-run-1"}


def test_links_into_performance_md_name_its_headings():
    """docs/performance.md is rewritten as measurements change; links into its sections must follow."""
    target = ROOT / "docs" / "performance.md"
    anchors = heading_anchors(target)
    broken = []
    for page in pages():
        for number, link in relative_links(page):
            path, _, anchor = link.partition("#")
            if anchor and path and (page.parent / path).resolve() == target and anchor not in anchors:
                broken.append(f"{page.relative_to(ROOT)}:{number}: {link}")
    assert not broken, "links to missing sections of docs/performance.md:\n" + "\n".join(broken)


def test_readme_headline_is_the_recorded_run():
    """README's headline numbers are generated from a recorded run (docs/runs/*/paper_comparison.csv
    and run.json, tools/kpca_tools/headline.py), never typed by hand: README holds exactly the block."""
    import re

    from kpca_tools.headline import END, START, headline_block

    runs = sorted((ROOT / "docs" / "runs").glob("*/run.json"))
    assert runs, "no recorded run in docs/runs"
    block = re.search(re.escape(START) + r"\n(.*?)\n" + re.escape(END), (ROOT / "README.md").read_text(), re.S).group(1)
    assert block == headline_block(runs[-1].parent)
    assert "not run" in block and "DeiT-Tiny, reproduced" in block


def test_readme_is_at_most_100_lines_and_says_what_it_is_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 100, len(lines)
    assert "Snakemake" in lines[0] and any("arXiv:2505.07908" in line for line in lines[:5])
