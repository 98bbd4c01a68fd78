"""Formatting as a habit: the linters and formatters the project commits to, run as tests so
that CI (which runs ``python -m pytest -q``) checks them on every change.

Settings live in ``pyproject.toml`` (``[tool.ruff]``, ``[tool.snakefmt]``); to fix what these
tests report, run ``ruff check --fix . && ruff format . && snakefmt workflow/rules Snakefile``.
``snakemake --lint`` is checked by ``tests/test_workflow.py::test_lint_is_clean``. The rule
files' own habits are checked here too: a rule that runs another's script on other files reuses
it (``use rule ... with:``), and a rule's lambda fits on its line (longer ones are functions of
``workflow/rules/helpers.smk``).
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff_lint_is_clean():
    proc = _run(sys.executable, "-m", "ruff", "check", ".")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_ruff_format_is_clean():
    proc = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_no_src_line_is_over_120_characters():
    """The package keeps to 120 characters a line (``src/ruff.toml``), so that it reads side by side in a review;
    ruff's E501 leaves out what it cannot wrap (a long word, a URL), this counts every line."""
    long = [
        f"{path.relative_to(REPO)}:{number} ({len(line)})"
        for path in sorted((REPO / "src").rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if len(line) > 120
    ]
    assert not long, f"{len(long)} lines over 120 characters: {long[:40]}"


def test_snakefmt_is_clean():
    exe = shutil.which("snakefmt")
    if exe is None:
        pytest.fail("snakefmt is not installed: python -m pip install -e '.[test]'")
    proc = _run(exe, "--check", "workflow/rules", "Snakefile")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]


RULES = REPO / "workflow" / "rules"


def _open_brackets(text: str) -> int:
    """Brackets ``text`` opens and leaves open (strings and comments aside); negative: it closes more."""
    depth = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            depth += (tok.string in "([{") - (tok.string in ")]}") if tok.type == tokenize.OP else 0
    except (tokenize.TokenError, IndentationError):  # the end of the text inside an open bracket
        pass
    return depth


def test_open_brackets_sees_a_lambda_that_goes_on():
    assert _open_brackets('lambda wc: f"(x{wc.a})",') == 0 and _open_brackets("lambda wc: f(wc)),") == -1
    assert _open_brackets("lambda wc: (") == 1 and _open_brackets('lambda wc: ["a", "b",  # (') == 1


def test_every_lambda_of_the_rule_files_fits_on_its_line():
    long = []
    for path in sorted([*RULES.glob("*.smk"), REPO / "Snakefile"]):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for m in re.finditer(r"\blambda\b", line):
                if _open_brackets(line[m.start() :]) > 0:
                    long.append(f"{path.name}:{number}")
    assert not long, f"lambdas over more than one line (make them functions of workflow/rules/helpers.smk): {long}"


def test_no_rule_file_reads_snakemakes_dag():
    """The DAG's internals change between Snakemake releases: the check before the first job learns the
    jobs from their input functions (``in_dag``, common.smk)."""
    assert not [p.name for p in [*RULES.glob("*.smk"), REPO / "Snakefile"] if re.search(r"\bworkflow\s*\.\s*dag\b|needrun", p.read_text())]


def test_the_prefix_profile_reuses_the_kpca_rule():
    """Rule kpca_prefix is rule kpca_heads with other outputs and params (one rule to change), and the
    script reads ``prefix`` as every other parameter."""
    decoders = (RULES / "decoders.smk").read_text()
    assert "use rule kpca_heads as kpca_prefix with:" in decoders and not re.search(r"^rule kpca_prefix:", decoders, re.M)
    assert re.search(r"^        prefix=None,$", (RULES / "kpca.smk").read_text(), re.M)
    assert "hasattr(smk.params" not in (REPO / "workflow" / "scripts" / "kpca_heads.py").read_text()
