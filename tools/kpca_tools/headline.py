"""The README's headline block, generated from a run's ``results/paper_comparison.csv``.

README's headline numbers are never typed by hand: this module writes them, between the
markers ``<!-- headline:start -->`` and ``<!-- headline:end -->``, from the comparison table of
a recorded run (``docs/runs/<name>/paper_comparison.csv``, with ``run.json`` naming the machine,
the commit, the date and the command), and ``tests/test_docs_links.py`` checks that README holds
exactly what it writes. After a new recorded run, from the repository root::

    python tools/headline.py docs/runs/<name> --readme README.md

A maintainer's tool, not part of the pipeline: it lives in ``tools/`` (tools/README.md).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pandas as pd

from kpca_repro.analysis.comparison import NOT_PUBLISHED, NOT_RUN

__all__ = ["START", "END", "headline_block", "update_readme"]

START, END = "<!-- headline:start -->", "<!-- headline:end -->"
#: The four columns of Tables 1 and 4, in the paper's order.
METRICS = ("MDC", "MOC", "LCKA", "KCKA")


def _cell(row: pd.Series) -> str:
    value = f"{row['reproduced']:.3f}"
    if pd.notna(row["lower"]) and pd.notna(row["upper"]):
        value += f" [{row['lower']:.3f}, {row['upper']:.3f}]"
    return value


def headline_block(run_dir: str | Path) -> str:
    """Markdown: the status counts over every published number, and the published against the
    reproduced (``paper`` variant, with its interval) four columns of each model that ran in
    Tables 1 and 4; then the run's machine, commit and command (``run.json``).

    Raises:
        FileNotFoundError: ``paper_comparison.csv`` or ``run.json`` missing in ``run_dir``.
    """
    run_dir = Path(run_dir)
    table = pd.read_csv(run_dir / "paper_comparison.csv")
    run = json.loads((run_dir / "run.json").read_text())
    counts = table["status"].value_counts()
    ran = [s for s in counts.index if s not in (NOT_RUN, NOT_PUBLISHED)]
    parts = [f"{counts[s]} {s}" for s in sorted(ran, key=lambda s: -counts[s])]
    parts += [f"{counts[s]} {s}" for s in (NOT_RUN, NOT_PUBLISHED) if s in counts]
    lines = [
        f"Of the {len(table)} published numbers of Tables 1–4: " + ", ".join(parts) + ".",
        "",
        "| table | model | " + " | ".join(METRICS) + " |",
        "|---|---|" + "---|" * len(METRICS),
    ]
    similarity = table[table["table"].astype(str).str.removeprefix("Table ").isin(["1", "4"]) & table["column"].isin(METRICS) & ~table["status"].isin([NOT_RUN, NOT_PUBLISHED])]
    for (name, model), rows in similarity.groupby(["table", "model"], sort=True):
        number = str(name).removeprefix("Table ")
        by = rows.set_index("column")
        published = " | ".join(f"{by.loc[m, 'published']:.2f}" if m in by.index else "–" for m in METRICS)
        reproduced = " | ".join(_cell(by.loc[m]) if m in by.index else "–" for m in METRICS)
        lines.append(f"| {number} | {model}, published | {published} |")
        lines.append(f"| {number} | {model}, reproduced | {reproduced} |")
    lines += [
        "",
        f"Reproduced: the `paper` variant with its interval in brackets (MDC, MOC: sampling and solver variation; LCKA, KCKA: sampling). "
        f"Run on {run['machine']}, {run['date']}, commit `{run['commit']}`: `{run['command']}`.",
    ]
    return "\n".join(lines)


def update_readme(readme: str | Path, run_dir: str | Path) -> bool:
    """Replace README's block between :data:`START` and :data:`END` by :func:`headline_block`; True if it changed.

    Raises:
        ValueError: the markers are missing.
    """
    path = Path(readme)
    text = path.read_text()
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{path}: no {START} ... {END} block")
    new = pattern.sub(lambda _: f"{START}\n{headline_block(run_dir)}\n{END}", text)
    path.write_text(new)
    return new != text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a recorded run: paper_comparison.csv and run.json")
    ap.add_argument("--readme", help="write the block into this README (between its markers); default: print it")
    args = ap.parse_args(argv)
    if args.readme:
        print("updated" if update_readme(args.readme, args.run_dir) else "unchanged")
    else:
        print(headline_block(args.run_dir))


if __name__ == "__main__":
    main()
