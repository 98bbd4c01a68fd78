"""profiles/slurm through Snakemake's real SLURM executor plugin, with a stand-in sbatch.

tools/slurm_submissions.sh runs the paper's full workload, cut to one vision model, with
tools/slurm_standin/ first on PATH. The stand-in records every sbatch call and touches the
job's outputs, so nothing is computed. The test checks that every job planned for the
cluster was submitted, that each submission carries its rule's resources from
profiles/slurm/config.yaml, and that no local rule (tables, figures, sampling) was submitted.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "assets"
PROFILE = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())


def _local_rules() -> set[str]:
    """Rules of workflow/rules/*.smk marked `localrule: True` (they run on the submit host)."""
    local = set()
    for path in (REPO / "workflow" / "rules").glob("*.smk"):
        text = path.read_text()
        heads = list(re.finditer(r"^\s*rule (\w+):", text, flags=re.M))
        for head, nxt in zip(heads, heads[1:] + [None]):
            if re.search(r"^\s+localrule: True", text[head.end() : nxt.start() if nxt else len(text)], re.M):
                local.add(head.group(1))
    return local


LOCAL_RULES = _local_rules()


@pytest.fixture(scope="module")
def submissions(tmp_path_factory):
    for sub in ("images/imagenet-sample", "text/wikitext-103"):
        if not (SHARED / sub).is_dir():
            pytest.skip(f"needs {SHARED / sub} (the offline image sample and WikiText-103)")
    tmp = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, MODELS="deit_tiny_patch16_224", WORK=str(tmp / "work"), KEEP="1")
    proc = subprocess.run(["bash", str(REPO / "tools" / "slurm_submissions.sh"), "2", str(tmp / "out")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = [line for line in (tmp / "out" / "sbatch_calls.txt").read_text().splitlines() if line.startswith("sbatch")]
    planned = dict(re.findall(r"^(\w+)\s+(\d+)$", (tmp / "out" / "dryrun_jobs.txt").read_text(), re.M))
    return calls, {rule: int(n) for rule, n in planned.items()}


def _rule(call: str) -> str:
    return re.search(r"--comment rule_(\w+?)_wildcards", call).group(1)


@pytest.mark.integration
def test_every_cluster_job_of_the_full_workload_is_submitted_once(submissions):
    calls, planned = submissions
    submitted: dict[str, int] = {}
    for call in calls:
        submitted[_rule(call)] = submitted.get(_rule(call), 0) + 1
    # one vision model in 2 shards, the nine language models, the two paper-scale training runs
    assert set(submitted) == {"extract_vision", "extract_text", "kpca_heads", "eigenvalues_vision", "gamma_vision", "train"}
    assert submitted == {rule: planned[rule] for rule in submitted}
    assert submitted["extract_text"] == 18  # 9 models x (Table 4 rows + Figure 5 sentences)
    assert submitted["train"] == 2
    assert not LOCAL_RULES & set(submitted)
    comments = [re.search(r"--comment (\S+)", c).group(1) for c in calls]
    assert len(set(comments)) == len(comments)  # no job submitted twice


@pytest.mark.integration
def test_each_submission_carries_its_rules_resources_from_the_profile(submissions):
    calls, _ = submissions
    defaults = PROFILE["default-resources"]
    assert "slurm_account" not in defaults and "slurm_partition" not in defaults  # site settings, unset by default
    for call in calls:
        rule = _rule(call)
        res = {**defaults, **PROFILE["set-resources"][rule]}
        # no account given and none to guess: no -A; the default partition from (stand-in) sinfo
        assert " -A " not in call and " -p standin " in call, call
        assert f"-t {res['runtime']} " in call and f"--mem {res['mem_mb']} " in call, call
        assert f"--cpus-per-task={res['cpus_per_task']}" in call, call
        # the GPU comes from the rules (config `device: cuda`, a GPU cluster), not from the profile
        assert "gpu" not in res and "--gpus=1" in call, call
        assert " --requeue " in call, call  # a preempted job goes back into the queue and resumes (slurm-requeue)


GPU_RULES = {"extract_vision", "kpca_heads", "eigenvalues_vision", "gamma_vision"}


def _job_resources(dry_run: str) -> dict[str, set[str]]:
    """Rule -> the set of its jobs' ``resources:`` lines in a dry run's output."""
    out: dict[str, set[str]] = {}
    rule = None
    for line in dry_run.splitlines():
        if m := re.match(r"(?:local)?rule (\w+):", line):
            rule = m.group(1)
        elif rule and (m := re.match(r"\s+resources: (.*)", line)):
            out.setdefault(rule, set()).add(m.group(1))
    return out


@pytest.mark.integration
def test_workstation_profile_holds_one_gpu_and_gpu_jobs_claim_it(tmp_path, tiny_resources):
    """profiles/default (read automatically) sets a global gpu=1, and with a CUDA device every GPU
    rule's jobs ask for gpu=1, so Snakemake runs one of them at a time beside the CPU jobs."""
    from conftest import run_snakemake
    from test_workflow import _write_config

    assert "gpu=1" in yaml.safe_load((REPO / "profiles" / "default" / "config.yaml").read_text())["resources"]
    targets = ("results/table1.csv", "results/table3.csv", "results/figure3.pdf")
    for device, gpu in (("cuda", "gpu=1"), ("cpu", "gpu=0")):
        cfg = _write_config(tmp_path / f"{device}.yaml", resources_dir=str(tiny_resources), device=device)
        proc = run_snakemake(tmp_path, "-n", *targets, "--configfile", str(cfg))
        assert f"Using workflow specific profile {REPO / 'profiles' / 'default'} " in proc.stderr
        jobs = _job_resources(proc.stdout)
        assert GPU_RULES <= set(jobs), sorted(jobs)
        for rule, lines in jobs.items():
            for line in lines:
                fields = line.split(", ")
                assert (gpu in fields) if rule in GPU_RULES else ("gpu=1" not in fields), (rule, line)
