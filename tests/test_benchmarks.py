"""The benchmarks themselves (perf/bench.py, perf/memory.py): they run, they compare, and their timers count right.

No time is asserted: the numbers they measure go into docs/performance.md. These tests check
what the benchmarks report besides times: that the batched and per-head methods agree, that
the ``--breakdown`` timers see one ``eigh`` per head and the expected number of assignments,
that the eigensolvers' errors are measured against float64, and that the memory benchmark
sees every extraction batch.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_batching_and_sharding import _activation_file

pytestmark = pytest.mark.integration  # each test runs a perf/ script in a child interpreter

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "perf" / "bench.py"
#: The subcommands of perf/bench.py that measure (``report`` prints their tables).
SUBCOMMANDS = ("stage", "shapes", "eigensolvers", "job", "ab")


def _bench(*args: str, out: Path) -> dict:
    """Run ``perf/bench.py ARGS --out OUT`` and return the result file it wrote."""
    proc = subprocess.run([sys.executable, str(BENCH), *args, "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _report(*results: Path) -> str:
    return subprocess.run([sys.executable, str(BENCH), "report", *map(str, results)], capture_output=True, text=True, check=True, cwd=REPO).stdout


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_is_in_the_usage_and_parses_its_command_line(name):
    """``perf/bench.py NAME --help`` parses, takes ``--out``, and the module docstring shows its command line."""
    proc = subprocess.run([sys.executable, str(BENCH), name, "--help"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--out OUT" in proc.stdout
    top = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert f"python perf/bench.py {name} " in top


def test_stage_benchmark_compares_methods_and_times_every_eigh_and_assignment(tmp_path):
    h5 = _activation_file(tmp_path / "a.h5")  # 5 images x 3 heads x 2 layers = 30 heads
    res = _bench("stage", str(h5), "--variants", "paper", "corrected", "--threads", "2", "--chunk", "4", "--baseline-threads", "1", "--breakdown", out=tmp_path / "s.json")
    rows = {row["variant"]: row for row in res["rows"]}
    paper, corrected = rows["paper"], rows["corrected"]
    assert paper["per_head_1thr"]["same_dropped_heads"]
    assert paper["per_head_1thr"]["max_abs_diff"] < 1e-4
    assert corrected["per_head_1thr"]["bit_identical"]
    for name, row in rows.items():
        b = row["batched"]["breakdown"]
        assert row["batched"]["heads"] == 30
        assert b["eigh_calls"] == 30  # one matrix per solver call on the CPU
        # paper: one token-row assignment per head; corrected: token rows and columns, for V_KPCA and the baseline
        assert b["assignment_calls"] == (30 if name == "paper" else 120)
        assert b["head_metrics_calls"] == 8  # ceil(30 / 4) chunks
        assert 0 < b["eigh_seconds"] + b["assignment_seconds"] <= b["head_metrics_seconds"] <= b["thread_seconds_available"] * 1.01
    report = _report(tmp_path / "s.json")
    assert "| batched, paper |" in report and "| batched, corrected |" in report


def test_eigensolvers_measure_the_error_against_float64(tmp_path):
    """The CPU solver's float32 eigenvalues are within float32 rounding of float64's (relative to
    ``||K||``), and not exactly equal to them: the error is measured, not zero by construction."""
    res = _bench("eigensolvers", "--heads", "4", "--tokens", "20", "--cpu-threads", "1", out=tmp_path / "e.json")
    cpu = next(row for row in res["rows"] if row["solver"] == "torch-cpu-per-matrix")
    assert cpu["heads"] == 4 and cpu["heads_per_s"] > 0
    assert 0 < cpu["eigenvalue_error"] < 1e-5
    assert "torch-cpu-per-matrix" in _report(tmp_path / "e.json")


def test_job_benchmark_times_each_part_of_the_kpca_heads_job(tmp_path):
    """``job`` on 30 heads in chunks of at most 4: each chunk is solved once and compared once, so
    both timers count the same calls, at least ceil(30 / 4) of them."""
    h5 = _activation_file(tmp_path / "a.h5")
    res = _bench("job", str(h5), "--cores", "2", "--heads-per-chunk", "4", "--sign-draws", "0", "0", out=tmp_path / "j.json")
    assert res["heads"] == 30
    assert 8 <= res["calls"]["solve (main thread, exclusive)"] == res["calls"]["compare (workers)"] <= 30
    assert 0 < res["seconds"]["compare (workers)"] and res["wall_seconds"] > 0


def test_ab_benchmark_times_both_trees_on_the_same_heads(tmp_path):
    """``ab`` against this very checkout: the two imports are the same code, so every per-head
    column agrees bit for bit, and each tree's timers see its own eigh and assignment time."""
    h5 = _activation_file(tmp_path / "a.h5")  # 5 images x 3 heads x 2 layers
    for variant in ("paper", "corrected"):
        res = _bench("ab", str(h5), "--tree", str(REPO), "--variant", variant, "--layers", "0", "1", "--heads-per-layer", "6", "--chunk", "4", "--repeats", "1", out=tmp_path / f"ab_{variant}.json")
        assert res["heads"] == 12
        assert res["max_abs_diff"] and all(d == 0.0 for d in res["max_abs_diff"].values())
        for ms in res["ms_per_head"].values():
            assert 0 < ms["eigh"] + ms["assignment"] <= ms["total"]
    report = _report(tmp_path / "ab_paper.json")
    assert "| this |" in report and "| other |" in report


@pytest.mark.realweights
def test_extract_memory_reports_one_line_per_batch_and_the_peak():
    """``perf/memory.py extract`` (docs/hub_fixture.md's extraction memory): one RSS line per forward
    batch, at the batch's first image, and a peak no lower than any of them."""
    from conftest import real_deit_tiny

    _, weights, image_dir = real_deit_tiny()
    proc = subprocess.run(
        [sys.executable, str(REPO / "perf" / "memory.py"), "extract", str(weights), str(image_dir), "deit_tiny_patch16_224", "5", "--batch-size", "2", "--threads", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    batches = re.findall(r"batch at image (\d+): RSS ([\d.]+) GiB", proc.stdout)
    assert [int(start) for start, _ in batches] == [0, 2, 4]
    peak = float(re.search(r"peak RSS ([\d.]+) GiB", proc.stdout).group(1))
    assert peak >= max(float(rss) for _, rss in batches) > 0
