"""profiles/slurm on a real one-node SLURM cluster (tests/slurm/cluster.sh).

The tests use a cluster that is already up (`tests/slurm/cluster.sh install` and `start`, run by
.ci/run before the test command and stopped after it) and skip, with the command to bring one
up, when none answers: a test run installs and starts nothing.
A tiny workflow (two random tiny timm ViTs, 4 photographs in 2 shards; Tables 1-3 and
Figure 3) runs through profiles/slurm, unchanged but for the per-rule CPUs, memory and threads
the 2-CPU test node can hold, and with status checks every 2 s instead of 40 s. While it runs,
one job is `scancel`led: Snakemake must report it failed, resubmit it (the profile's
`retries: 1`) and complete. Every other job must end COMPLETED in squeue, and the outputs must
be byte-identical to the same targets run locally. Every wait is bounded: a stuck run fails
the test with its log instead of hanging CI.

Deselect with `-m "not slurm"`.
"""

from __future__ import annotations

import filecmp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY_KWARGS, run_snakemake
from test_workflow import _write_config

pytestmark = [pytest.mark.slurm, pytest.mark.integration]

CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"
TARGETS = ("results/table1.csv", "results/table2.csv", "results/table3.csv", "results/figure3.pdf")
CLUSTER_RULES = ("extract_vision", "kpca_heads", "eigenvalues_vision", "gamma_vision")
# what the 2-CPU test node can hold (the profile asks for up to 8 CPUs and 16 GB per job)
FIT_NODE = [f"{rule}:cpus_per_task=1" for rule in CLUSTER_RULES] + [f"{rule}:mem_mb=1500" for rule in CLUSTER_RULES]
FIT_THREADS = [f"{rule}=1" for rule in CLUSTER_RULES]
FAST_POLL = ["--slurm-init-seconds-before-status-checks", "2", "--seconds-between-status-checks", "2", "--latency-wait", "10"]
RUN_TIMEOUT = 900  # s, the whole SLURM run (193-379 s measured on a shared 2-core machine); then the test fails, with the log


def _slurm(*args: str, timeout: float = 30) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=True).stdout


@pytest.fixture(scope="module")
def cluster():
    """The one-node cluster that is up (``SLURM_CONF`` exported by ``tests/slurm/cluster.sh start``,
    as .ci/run does); skipped when none answers. The tests never install or start one."""
    conf = os.environ.get("SLURM_CONF")
    how = "bring one up with 'sudo bash tests/slurm/cluster.sh install && sudo bash tests/slurm/cluster.sh start DIR' and export the SLURM_CONF it prints (.ci/run does)"
    if not conf or not os.path.isfile(conf):
        pytest.skip(f"no SLURM cluster up (SLURM_CONF unset or missing): {how}")
    try:
        states = _slurm("sinfo", "-h", "-N", "-o", "%T", timeout=15).split()
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no SLURM cluster answers at SLURM_CONF={conf} ({exc}): {how}")
    if "idle" not in states and "mixed" not in states:
        pytest.skip(f"the SLURM cluster at SLURM_CONF={conf} has no idle node ({states}): {how}")
    yield Path(conf).parent


def _jobs(exclude: frozenset[str] = frozenset()) -> list[dict]:
    """The jobs squeue knows (finished ones for MinJobAge = 3600 s), but those in ``exclude``."""
    out = _slurm("squeue", "-h", "--states=all", "-o", "%i|%T|%k")
    jobs = [dict(zip(("id", "state", "comment"), line.split("|"))) for line in out.splitlines() if line]
    return [j for j in jobs if j["id"] not in exclude]


@pytest.fixture(scope="module")
def tiny_config(tiny_resources) -> dict:
    """One tiny random ViT, 4 photographs in 2 shards, Tables 2-3 on the same 4 images: 10 SLURM jobs
    (2 extractions + 1 for Figure 3's image, 2 KPCA, 4 eigenvalue, 1 gamma)."""
    model = "vit_tiny_patch16_224"
    return {
        "resources_dir": str(tiny_resources),
        "device": "cpu",
        "vision": {"models": [model], "n_images": 4, "shards": 2, "model_kwargs": {model: TINY_KWARGS[model]}},
        "spectra": {"n_images": 4},
        "figure3": {"model": model},
    }


@pytest.fixture(scope="module")
def runs(cluster, tiny_config, tmp_path_factory):
    """The same targets locally and through profiles/slurm (with one job cancelled mid-run)."""
    base = tmp_path_factory.mktemp("slurmrun")
    cfg = _write_config(base / "tiny.yaml", **tiny_config)
    local, remote = base / "local", base / "slurm"
    local.mkdir()
    remote.mkdir()

    t0 = time.monotonic()
    run_snakemake(local, *TARGETS, "--configfile", str(cfg))
    local_s = time.monotonic() - t0

    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "-d",
        str(remote),
        "--profile",
        str(REPO / "profiles" / "slurm"),
        "--workflow-profile",
        "none",
        "--configfile",
        str(cfg),
        "--set-resources",
        *FIT_NODE,
        "--set-threads",
        *FIT_THREADS,
        *FAST_POLL,
        *TARGETS,
    ]
    before = frozenset(j["id"] for j in _jobs())
    log = open(base / "slurm_run.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=remote, text=True)
    cancelled = None
    try:
        # cancel the first job seen RUNNING for 3 s (its Snakemake is then at work inside the job);
        # if it finished before scancel reached it, try the next
        deadline = time.monotonic() + RUN_TIMEOUT
        tried: set[str] = set()
        running_since: dict[str, float] = {}
        while cancelled is None and proc.poll() is None and time.monotonic() < deadline:
            for job in _jobs(before):
                if job["state"] == "RUNNING":
                    running_since.setdefault(job["id"], time.monotonic())
                if job["state"] == "RUNNING" and job["id"] not in tried and time.monotonic() - running_since[job["id"]] >= 3:
                    tried.add(job["id"])
                    _slurm("scancel", job["id"])
                    for _ in range(50):
                        state = next(j["state"] for j in _jobs(before) if j["id"] == job["id"])
                        if state not in ("RUNNING", "COMPLETING"):
                            break
                        time.sleep(0.2)
                    if state == "CANCELLED":
                        cancelled = job
                    break
            time.sleep(0.2)
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        pytest.fail(f"the SLURM run did not finish in {RUN_TIMEOUT} s; squeue:\n{_slurm('squeue', '--states=all')}\nlog:\n{(base / 'slurm_run.log').read_text()[-8000:]}")
    finally:
        log.close()
    slurm_s = time.monotonic() - t0
    text = (base / "slurm_run.log").read_text()
    assert proc.returncode == 0, f"the SLURM run failed ({proc.returncode}):\n{text[-8000:]}"
    jobs = _jobs(before)
    print(f"\nlocal run {local_s:.1f} s, SLURM run {slurm_s:.1f} s ({len(jobs)} SLURM jobs)")
    return local, remote, text, jobs, cancelled


def test_every_cluster_job_completes_and_the_cancelled_one_is_retried(runs):
    _, _, log, jobs, cancelled = runs
    assert cancelled is not None, "no job could be cancelled while RUNNING"
    rules = {re.match(r"rule_(\w+?)_wildcards", j["comment"]).group(1) for j in jobs}
    assert rules == set(CLUSTER_RULES), rules  # the local rules (tables, figures, sampling) ran here
    states = {j["id"]: j["state"] for j in jobs}
    assert states.pop(cancelled["id"]) == "CANCELLED"
    assert set(states.values()) == {"COMPLETED"}, jobs
    # reported as failed, resubmitted under the same rule and wildcards, and that rerun completed
    assert f"SLURM-job '{cancelled['id']}' failed, SLURM status is: 'CANCELLED'" in log
    reruns = [j for j in jobs if j["comment"] == cancelled["comment"] and j["id"] != cancelled["id"]]
    assert [j["state"] for j in reruns] == ["COMPLETED"], jobs
    assert "Trying to restart job" in log


def test_slurm_outputs_are_byte_identical_to_a_local_run(runs):
    local, remote, _, _, _ = runs
    for target in TARGETS:
        assert (remote / target).exists(), target
    compared = 0
    for path in sorted((local / "results").rglob("*")):
        if path.is_file() and path.suffix not in (".pdf", ".png"):  # figures carry creation times
            other = remote / path.relative_to(local)
            assert other.is_file() and filecmp.cmp(path, other, shallow=False), f"{path.relative_to(local)} differs"
            compared += 1
    assert compared > 20  # activations (HDF5), per-head records, spectra, tables, Figure 3's statistics
