"""The benchmark harness itself (perf/bench_*.py): it runs, it compares, and its timers count right.

No time is asserted: the numbers it measures go into docs/performance.md. These tests check
what the harness reports besides times: that the batched and per-head methods agree, that
the ``--breakdown`` timers see one ``eigh`` per head and the expected number of assignments,
and that the ``allocator`` runs cover the layers they claim.
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
#: One script per benchmark, ``perf/bench_<name>.py``.
BENCHMARKS = sorted(p.stem.removeprefix("bench_") for p in (REPO / "perf").glob("bench_*.py"))


def _bench(benchmark: str, *args: str, out: Path) -> dict:
    """Run ``perf/bench_<benchmark>.py ARGS --out OUT`` and return the result file it wrote."""
    proc = subprocess.run([sys.executable, str(REPO / "perf" / f"bench_{benchmark}.py"), *args, "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_parses_its_command_line_and_has_a_report_table(name):
    """``perf/bench_<name>.py --help`` shows the command line of its docstring and ``--out``; the
    result it writes has ``command`` ``name``, which perf/report.py prints with its function ``name``."""
    script = REPO / "perf" / f"bench_{name}.py"
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"python perf/bench_{name}.py" in proc.stdout and "--out OUT" in proc.stdout
    assert re.search(rf'^    (return|out =) {{"command": "{name}",', script.read_text(), re.MULTILINE)  # its measurement's result
    assert re.search(rf"^def {name}\(r\):", (REPO / "perf" / "report.py").read_text(), re.MULTILINE)


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
    report = subprocess.run([sys.executable, str(REPO / "perf" / "report.py"), str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "| batched, paper |" in report and "| batched, corrected |" in report


def test_allocator_benchmark_covers_the_layers_it_names(tmp_path):
    h5 = _activation_file(tmp_path / "a.h5")
    res = _bench("allocator", str(h5), "--layers", "1", "2", "--threads", "2", "--chunk", "4", out=tmp_path / "m.json")
    seen = {(row["mode"], row["layers"]): row["heads"] for row in res["rows"]}
    assert len(seen) == 6  # three glibc settings x two depths
    assert all(heads == 15 * layers for (_, layers), heads in seen.items())
    assert all(row["peak_rss_mb"] > 0 for row in res["rows"])


@pytest.mark.realweights
def test_authors_structure_baseline_gives_the_pipelines_table1_row(tmp_path):
    """The chain's baseline (the authors' value_vectors.py structure: a full forward pass per
    layer, a Python loop over images and heads) and the pipeline (one forward pass per batch,
    batched heads on worker threads, the rule's eigh threads) give the same Table 1 row for
    the same two real images: the speed-up compares like with like."""
    import numpy as np
    import torch

    from kpca_repro.capture.extraction import extract_vision
    from kpca_repro.inputs import images
    from kpca_repro.method.records import kpca_records
    from kpca_repro.threads import torch_default_threads

    from conftest import real_deit_tiny

    _, weights, image_dir = real_deit_tiny()
    res = _bench("authors", "--images", "2", "--weights", str(weights), "--image-dir", str(image_dir), out=tmp_path / "authors.json")
    assert res["heads"] == 2 * 12 * 3 and res["wall_seconds"] > 0
    samples = images.sample_images(images.list_images(image_dir, "flat"), 2, seed=0)
    extract_vision("deit_tiny_patch16_224", weights, "x", samples, tmp_path / "a.h5", batch_size=2, device=torch.device("cpu"), progress=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the kpca_heads rule runs
    try:
        rec, _ = kpca_records(tmp_path / "a.h5", "paper", device=torch.device("cpu"), heads_per_chunk=5, workers=2, eigh_threads=torch_default_threads(), progress=False)
    finally:
        torch.set_num_threads(before)
    ours = {"MDC": rec["direct_cos_mean"].max(), "MOC": rec["optimal_cos_mean"].max(), "LCKA": np.mean(rec["linear_cka"]), "KCKA": np.mean(rec["rbf_cka"])}
    for name, value in res["table1"].items():
        assert abs(ours[name] - value) <= (1e-4 if name == "KCKA" else 1e-5), (name, ours[name], value)
    report = subprocess.run([sys.executable, str(REPO / "perf" / "report.py"), str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "authors' structure" in report


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
    report = subprocess.run([sys.executable, str(REPO / "perf" / "report.py"), str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "| this |" in report and "| other |" in report


def test_extract_memory_reports_one_line_per_batch_and_the_peak():
    """perf/extract_memory.py (docs/hub_fixture.md's extraction memory): one RSS line per forward
    batch, at the batch's first image, and a peak no lower than any of them."""
    import re

    from conftest import real_deit_tiny

    _, weights, image_dir = real_deit_tiny()
    proc = subprocess.run(
        [sys.executable, str(REPO / "perf" / "extract_memory.py"), str(weights), str(image_dir), "deit_tiny_patch16_224", "5", "--batch-size", "2", "--threads", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    batches = re.findall(r"batch at image (\d+): RSS ([\d.]+) GiB", proc.stdout)
    assert [int(start) for start, _ in batches] == [0, 2, 4]
    peak = float(re.search(r"peak RSS ([\d.]+) GiB", proc.stdout).group(1))
    assert peak >= max(float(rss) for _, rss in batches) > 0
