"""This workflow used as a Snakemake module by another one (issue 32, item 7).

An outer workflow in a temporary directory imports the repository's Snakefile with
``module kpca: snakefile: ...; config: config`` and ``use rule * from kpca as kpca_*``, and
builds Table 1 of the two tiny random-weight models offline (tests/conftest.py). The workflow
must not need ``sys.path`` edits or the command line to do so: its paths are relative to its
own Snakefile, and what the jobs need comes from the jobs Snakemake schedules.
"""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from conftest import REPO, TINY_KWARGS
from test_workflow import _write_config

pytestmark = pytest.mark.integration

OUTER = """\
configfile: "{defaults}"
configfile: "{tiny}"


module kpca:
    snakefile:
        "{snakefile}"
    config:
        config


use rule * from kpca as kpca_*
"""


def test_an_outer_workflow_builds_table1_through_the_module(tiny_resources, tmp_path):
    tiny = _write_config(tmp_path / "tiny.yaml", resources_dir=str(tiny_resources), vision={"shards": 1})
    (tmp_path / "Snakefile").write_text(OUTER.format(defaults=REPO / "config" / "config.yaml", tiny=tiny, snakefile=REPO / "Snakefile"))
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "results/table1.csv"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "rule kpca_extract_vision" in out and "rule kpca_table" in out  # the module's rules, renamed
    table = pd.read_csv(tmp_path / "results" / "table1.csv")
    assert list(table["timm_id"]) == sorted(TINY_KWARGS)
    assert (table["n_heads"] == 4 * 2 * 3).all() and (table["n_images"] == 4).all()
