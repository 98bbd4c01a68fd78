"""Formatting as a habit: the linters and formatters the project commits to, run as tests so
that CI (which runs ``python -m pytest -q``) checks them on every change.

Settings live in ``pyproject.toml`` (``[tool.ruff]``, ``[tool.snakefmt]``); to fix what these
tests report, run ``ruff check --fix . && ruff format . && snakefmt workflow/rules Snakefile``.
``snakemake --lint`` is checked by ``tests/test_workflow.py::test_lint_is_clean``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
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


def test_snakefmt_is_clean():
    exe = shutil.which("snakefmt")
    if exe is None:
        pytest.fail("snakefmt is not installed: python -m pip install -e '.[test]'")
    proc = _run(exe, "--check", "workflow/rules", "Snakefile")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
