"""Per-file test durations, as a Markdown table (docs/tests.md, "Per-file durations").

    python tests/durations.py --run                 # runs: python -m pytest --durations=0 --durations-min=0 -q -n 2
    python tests/durations.py --run -- tests/test_kpca.py tests/test_paths.py
    python tests/durations.py pytest-output.txt     # parses a saved run (or - for stdin)

Reads pytest's ``--durations=0`` report (lines ``12.34s call     tests/test_x.py::test_y[z]``)
and sums, per test file, the seconds of its tests' setup, call and teardown phases. A file's
module and session fixtures count in the setup of the test that first asks for them (a session
fixture such as ``hub`` in the first file to use it, on each pytest-xdist worker that does).
``--durations-min=0`` lists every phase (pytest hides those under 0.005 s by default; a saved
report run without it counts only the tests it lists). With ``-n 2`` the sum over the files is
about twice the wall time: the two workers run files side by side. The file order of
``SLOW_FILES_FIRST`` in tests/conftest.py follows the "total" column.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: One line of pytest's durations report: seconds, phase, node id (``path::name``).
LINE = re.compile(r"^\s*(?P<seconds>\d+(?:\.\d+)?)s\s+(?P<phase>setup|call|teardown)\s+(?P<node>\S+?)::")
PHASES = ("setup", "call", "teardown")


def per_file(report: str) -> dict[str, dict[str, float]]:
    """``{file: {"setup": s, "call": s, "teardown": s, "tests": n}}`` from a ``--durations`` report
    (seconds; ``tests``: the node ids with a reported call phase)."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys((*PHASES, "tests"), 0.0))
    for line in report.splitlines():
        if m := LINE.match(line):
            row = totals[m["node"]]
            row[m["phase"]] += float(m["seconds"])
            row["tests"] += m["phase"] == "call"
    return dict(totals)


def markdown(totals: dict[str, dict[str, float]]) -> str:
    """The table, longest file first, with a last row summing every column."""
    lines = ["| file | tests | setup (s) | call (s) | teardown (s) | total (s) |", "|---|--:|--:|--:|--:|--:|"]
    rows = sorted(totals.items(), key=lambda item: -sum(item[1][p] for p in PHASES))
    for name, row in rows:
        lines.append(f"| `{Path(name).name}` | {row['tests']:.0f} | {row['setup']:.1f} | {row['call']:.1f} | {row['teardown']:.1f} | {sum(row[p] for p in PHASES):.1f} |")
    sums = {key: sum(row[key] for row in totals.values()) for key in (*PHASES, "tests")}
    lines.append(f"| all | {sums['tests']:.0f} | {sums['setup']:.1f} | {sums['call']:.1f} | {sums['teardown']:.1f} | {sum(sums[p] for p in PHASES):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="store_true", help="run python -m pytest --durations=0 --durations-min=0 -q -n 2 first (its output is echoed to stderr)")
    parser.add_argument("--save", type=Path, help="with --run: also write pytest's output to this file")
    parser.add_argument("args", nargs="*", help="a saved pytest --durations=0 output ('-': stdin); with --run, after --: more pytest arguments (files, -k, -n 4)")
    args = parser.parse_args(argv)
    status = 0
    if args.run:
        cmd = [sys.executable, "-m", "pytest", "--durations=0", "--durations-min=0", "-q", "-n", "2", *args.args]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        report, status = proc.stdout + proc.stderr, proc.returncode
        sys.stderr.write(report)
        if args.save:
            args.save.write_text(report)
    elif len(args.args) == 1:
        report = sys.stdin.read() if args.args[0] == "-" else Path(args.args[0]).read_text()
    else:
        parser.error("give one saved report, or --run")
    totals = per_file(report)
    if not totals:
        print("no --durations lines found (was pytest run with --durations=0?)", file=sys.stderr)
        return status or 1
    print(markdown(totals))
    return status  # pytest's exit status with --run: the table of a failing run is printed too


if __name__ == "__main__":
    sys.exit(main())
