"""The method document is the project's own (docs/method.md), and every citation of it resolves.

The code, the workflow, the tests and the docs cite the method document by section number
("docs/method.md Section 0.2", "docs/method.md 4-5", "docs/method.md §15.2"). These tests
fail when a file points at a specification outside the repository (the ``docs`` folder of
``../shared``, :data:`OUTSIDE`) or
cites a section that docs/method.md does not have.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHOD = REPO / "docs" / "method.md"
#: Where citations live (README.md is checked by its own test below).
CITING = ("src", "workflow", "tests", "perf", "config", "docs", "Snakefile")
TEXT_SUFFIXES = {".py", ".smk", ".md", ".yaml", ".yml", ".sh", ".txt", ".toml", ".cfg", ".ini", ""}

#: A citation: ``method.md`` then optionally ``Section``/``Sections``/``§`` and a list of
#: section numbers joined by commas, "and", "-" or "§" (``0.3, 0.4, 8, 9, 15``, ``6.3 and 7``).
_NUMBER = r"§?\s*\d+(?:\.\d+)?"
CITATION = re.compile(rf"method\.md\s*(?:Sections?\s*)?({_NUMBER}(?:\s*(?:,|and|-|–)\s*{_NUMBER})*)")
#: The specification outside the repository that users never see (split so this file does not match).
OUTSIDE = "shared" + "/docs"
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)?)\s", re.MULTILINE)


def _files(roots=CITING) -> list[Path]:
    out = []
    for root in roots:
        p = REPO / root
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += [f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in TEXT_SUFFIXES and "__pycache__" not in f.parts and not any(part.endswith(".egg-info") for part in f.parts)]
    return out


def _joined(text: str) -> str:
    """The text with line breaks (and the comment markers that continue a comment) as spaces,
    so that a citation wrapped over two lines (``docs/method.md\\n# Section 6.2``) is one."""
    return re.sub(r"\s*\n\s*(?:#:?\s*|\*\s+)?", " ", text)


def citations(text: str) -> list[tuple[str, list[str]]]:
    """``(citation text, [section numbers])`` of every method.md citation in ``text``.

    A range ``4-5`` cites both ends.
    """
    found = []
    for m in CITATION.finditer(_joined(text)):
        found.append((m.group(0), re.findall(r"\d+(?:\.\d+)?", m.group(1))))
    return found


def headings() -> set[str]:
    return set(HEADING.findall(METHOD.read_text(encoding="utf-8")))


def unresolved(paths: list[Path]) -> list[str]:
    known = headings()
    bad = []
    for f in paths:
        if f == METHOD:
            continue
        for text, numbers in citations(f.read_text(encoding="utf-8", errors="replace")):
            missing = [n for n in numbers if n not in known]
            if missing:
                bad.append(f"{f.relative_to(REPO)}: {text!r} cites missing section(s) {missing}")
    return bad


def shared_doc_mentions(paths: list[Path]) -> list[str]:
    bad = []
    for f in paths:
        for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE in line:
                bad.append(f"{f.relative_to(REPO)}:{i}: {line.strip()}")
    return bad


def test_method_doc_exists_with_the_cited_numbering():
    known = headings()
    # every section the code relies on, including the corrected variant's subsections
    sections = "0 0.1 0.2 0.3 0.4 1 2 3 4 5 6 6.1 6.2 6.3 7 8 9 10 11 12 13 15 15.1 15.2 15.3 15.4 15.5 15.6 16 16.1 16.2 16.3 16.4".split()
    for n in sections:
        assert n in known, f"docs/method.md has no heading for section {n}"


def test_decoders_section_states_the_prefix_kpca_and_the_causal_normaliser():
    """Section 16: the KPCA of query i's prefix, the two analyses and the causal g(q_i) (the code cites these)."""
    text = METHOD.read_text(encoding="utf-8")
    section = text[text.index("## 16 Decoders: causal heads") : text.index("## Appendix A.")]
    for equation in (
        "g^(i)(k_j) = sum_{m <= i} exp(s k_j . k_m)",
        "Kc^(i) = H_i Kphi^(i) H_i",
        "V_KPCA^(i) = G^(i) A^(i) - G^(i) (1_i 1_i^T / i) A^(i)",
        "g^(i)(q_i) = sum_{j <= i, j real} exp(s q_i . k_j)",
        "log ||phi(q_i)||^2 = s ||q_i||^2 - 2 LSE_{j <= i, j real}(s q_i . k_j)",
        "kv(h) = h // (H / H_kv)",
    ):
        assert equation in section, equation
    for term in ("full-prefix view", "prefix profile", "no authors' script", "kv_head_of_query"):
        assert term in section, term


def test_citation_parser():
    text = "(method.md Sections 0.2 and 2) x method.md 4-5; docs/method.md §15.2 and (docs/method.md\n    # Section 6.2) method.md: seed"
    assert [n for _, n in citations(text)] == [["0.2", "2"], ["4", "5"], ["15.2"], ["6.2"]]
    assert citations("docs/method.md 0.3, 0.4, 8, 9, 15)")[0][1] == ["0.3", "0.4", "8", "9", "15"]
    assert citations("docs/method.md 15 item 4")[0][1] == ["15"]


def test_no_file_points_at_the_shared_specification():
    assert shared_doc_mentions(_files()) == []


def test_every_citation_resolves():
    paths = _files()
    assert sum(len(citations(f.read_text(encoding="utf-8", errors="replace"))) for f in paths) > 50
    assert unresolved(paths) == []


README = REPO / "README.md"


def test_readme_cites_the_projects_method_doc():
    """README.md: no :data:`OUTSIDE` and every method.md citation resolves."""
    readme = [README]
    assert shared_doc_mentions(readme) == []
    assert unresolved(readme) == []
