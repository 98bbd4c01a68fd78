"""Reliability of the workflow: bad input, interrupted runs, determinism, rerun semantics.

Every test here runs Snakemake in a subprocess (``integration``). The vision chain is
covered now; the language-model chain (Table 4) plugs in by adding cases to
``BAD_INPUT`` (its config keys, text resources and row counts), a target list to
``RELIABILITY_TARGETS`` and rows to ``RERUN_CASES`` / ``CODE_CHANGES``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kpca_repro.h5io import CorruptActivationFileError
from kpca_repro.method.records import eigenvalue_records, gamma_records, kpca_records

from conftest import REPO
from test_workflow import _write_config

pytestmark = pytest.mark.integration

MODEL = "vit_tiny_patch16_224"
# A 2-block ViT-Tiny at its native 224 px (197 tokens, 3 heads of 64): big enough that the
# extraction and KPCA jobs take seconds, so a test can kill them mid-write.
KWARGS = {MODEL: {"depth": 2}}
ACTIVATIONS = f"results/activations/{MODEL}/vision_4_0of1.h5"
KPCA_LOG = f"logs/kpca_heads/corrected/{MODEL}/vision_4_0of1.log"
KPCA_OUT = [f"results/heads/corrected/{MODEL}/vision_4_0of1.{ext}" for ext in ("csv", "json")]
# One target per stage of the vision chain: Table 1 in both variants (sampling, extraction,
# both KPCA variants), Table 3 corrected (eigenvalues with and without standardization) and
# Figure 3 corrected (gamma test, plot): 11 jobs.
RELIABILITY_TARGETS = ("results/table1.csv", "results/table1_corrected.csv", "results/table3_corrected.csv", "results/figure3_corrected.pdf")


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _cmd(root: Path, workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "-s", str(root / "Snakefile"), "-d", str(workdir), "--cores", "2", *args]


def _env(root: Path) -> dict:
    """The environment of a run of the workflow checked out at ``root`` (its own ``src``)."""
    return {**os.environ, "PYTHONPATH": str(root / "src")}


def _run(root: Path, workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(root, workdir, *args), capture_output=True, text=True, cwd=workdir, env=_env(root))
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def _kill_when(root: Path, workdir: Path, marker: Path, cfg: Path, timeout: float = 600) -> None:
    """Start the workflow, SIGKILL its whole process group as soon as ``marker`` exists."""
    with open(workdir / "killed_run.out", "w") as out:
        proc = subprocess.Popen(
            _cmd(root, workdir, *RELIABILITY_TARGETS, "--configfile", str(cfg)),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=_env(root),
            start_new_session=True,
        )
        t0 = time.monotonic()
        while not marker.exists():
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                proc.kill()
                raise AssertionError(f"{marker} never appeared:\n{(workdir / 'killed_run.out').read_text()[-4000:]}")
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for _ in range(200):  # the jobs die with Snakemake: nothing is left writing
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError("job processes survived the SIGKILL of their process group")


def _results(workdir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(workdir)): p.read_bytes() for p in sorted((workdir / "results").rglob("*")) if p.is_file()}


def _planned_jobs(output: str) -> dict[str, int]:
    """Rule -> job count from the 'Job stats' table of a dry run ({} when nothing is to be done)."""
    lines = output.splitlines()
    if "Job stats:" not in lines:
        assert "Nothing to be done" in output, output[-3000:]
        return {}
    jobs = {}
    for line in lines[lines.index("Job stats:") + 3 :]:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            break
        if parts[0] not in ("total", "all"):
            jobs[parts[0]] = int(parts[1])
    return jobs


def _config(path: Path, resources: Path, **overrides) -> Path:
    cfg = {
        "offline": True,
        "resources_dir": str(resources),
        "vision": {"models": [MODEL], "n_images": 4, "batch_size": 1, "shards": 1, "model_kwargs": KWARGS},
        "kpca": {"heads_per_chunk": 6, "threads": 1},
        # Tables 2-3 and Figure 3 use the same 4 images: one extraction feeds every job.
        "spectra": {"n_images": 4, "n_components": 8},
        "figure3": {"model": MODEL, "block": 1, "n_images": 4, "n_components": 8},
    }
    for key, value in overrides.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(cfg))
    return path


# --------------------------------------------------------------------------------------
# fixtures: resources, an uninterrupted run, an interrupted run from a copy of the workflow
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_resources(photos_dir, tmp_path_factory) -> Path:
    """The scikit-image photographs at 2048 x 2048 (slow to decode) and a 2-block ViT-Tiny."""
    import timm
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("big_resources")
    images = root / "images" / "imagenet-sample"
    images.mkdir(parents=True)
    for f in sorted(photos_dir.iterdir()):
        Image.open(f).convert("RGB").resize((2048, 2048), Image.BICUBIC).save(images / f.name, quality=90)
    (root / "weights" / "timm").mkdir(parents=True)
    torch.manual_seed(0)
    model = timm.create_model(MODEL, pretrained=False, **KWARGS[MODEL])
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "weights" / "timm" / f"{MODEL}.safetensors"))
    return root


@pytest.fixture(scope="module")
def fresh_run(big_resources, tmp_path_factory):
    """The targets from scratch, uninterrupted, with the repository's workflow."""
    work = tmp_path_factory.mktemp("fresh")
    cfg = _config(work / "cfg.yaml", big_resources)
    _run(REPO, work, *RELIABILITY_TARGETS, "--configfile", str(cfg))
    return work, cfg


@pytest.fixture(scope="module")
def workflow_copy(tmp_path_factory) -> Path:
    """The workflow copied elsewhere (Snakefile, rules, scripts, config, profiles, src), so
    tests can edit its modules without touching the repository."""
    root = tmp_path_factory.mktemp("checkout")
    shutil.copy2(REPO / "Snakefile", root / "Snakefile")
    for sub in ("workflow", "config", "profiles", "envs", "src"):
        shutil.copytree(REPO / sub, root / sub, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return root


@pytest.fixture(scope="module")
def interrupted_run(big_resources, workflow_copy, tmp_path_factory):
    """The same targets in another directory, from the copy: SIGKILL while the extraction
    writes its HDF5 file, rerun; SIGKILL while the corrected KPCA job computes, rerun to
    the end. Records what each kill left behind."""
    work = tmp_path_factory.mktemp("interrupted")
    cfg = _config(work / "cfg.yaml", big_resources)
    seen = {}
    _kill_when(workflow_copy, work, work / ACTIVATIONS.replace(".h5", ".partial.h5"), cfg)
    seen["extraction"] = {"final": (work / ACTIVATIONS).exists(), "partial": (work / ACTIVATIONS.replace(".h5", ".partial.h5")).exists()}
    # a hard kill leaves Snakemake's lock behind: --unlock, as its message says, then rerun
    locked = _run(workflow_copy, work, *RELIABILITY_TARGETS, "--configfile", str(cfg), check=False)
    seen["locked"] = locked.returncode != 0 and "--unlock" in locked.stdout + locked.stderr
    _run(workflow_copy, work, "--unlock", "--configfile", str(cfg))
    _kill_when(workflow_copy, work, work / KPCA_LOG, cfg)
    seen["kpca"] = {"final": [(work / f).exists() for f in KPCA_OUT]}
    _run(workflow_copy, work, "--unlock", "--configfile", str(cfg))
    _run(workflow_copy, work, *RELIABILITY_TARGETS, "--configfile", str(cfg))
    return work, cfg, seen


# --------------------------------------------------------------------------------------
# 1. bad input fails before any job runs, naming the key or file and what to do
# --------------------------------------------------------------------------------------

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
BAD_INPUT = [
    pytest.param({"sed": 0}, "unknown config key sed (did you mean 'seed'?)", id="misspelt-top-level-key"),
    pytest.param({"vision": {"batch_sise": 3}}, "unknown config key vision.batch_sise (did you mean 'batch_size'?)", id="misspelt-nested-key"),
    pytest.param({"vision": {"n_images": "3"}}, "config key vision.n_images: '3' is not of type 'integer'", id="wrong-type"),
    pytest.param({"vision": {"batch_size": "3"}}, "config key vision.batch_size: '3' is not an integer >= 1 or 'auto'", id="wrong-alternative"),
    pytest.param({"offline": "yes"}, "config key offline: 'yes' is not of type 'boolean'", id="wrong-type-bool"),
    pytest.param({"vision": {"n_images": 6}}, "config key vision.n_images: 6 images requested, but", id="more-images-than-the-set"),
    pytest.param({"spectra": {"n_images": 1}}, "config key spectra.n_images: 1 is less than the minimum of 2", id="too-few-spectra-images"),
    pytest.param({"checksums": {"vit_tiny_patch16_224": "0" * 64}}, "config key checksums.vit_tiny_patch16_224: ", id="checksum-mismatch"),
    pytest.param("NO_IMAGES", "missing ImageNet sample images: ", id="resources-without-images"),
    pytest.param({"figure3": {"block": 2}}, "config key figure3.block: 2 is out of range for vit_tiny_patch16_224, which has 2 blocks (0 to 1)", id="figure3-block-out-of-range"),
    # the language models (Table 4): row counts and local model directories
    pytest.param({"text": {"models": [MINILM], "n_rows": 0}}, "config key text.n_rows: 0 is less than the minimum of 1", id="text-rows-out-of-range"),
    pytest.param({"text": {"models": [MINILM], "n_rows": 3, "shards": 5}}, "config key text.shards: 5 shards for 3 rows", id="text-more-shards-than-rows"),
    pytest.param(
        {"text": {"models": [MINILM], "local_models": {MINILM: "/nonexistent/minilm"}}},
        "config key text.local_models[sentence-transformers/all-MiniLM-L6-v2]: ",
        id="text-local-model-missing",
    ),
]


@pytest.mark.parametrize("overrides, needle", BAD_INPUT)
def test_bad_input_fails_before_any_job(overrides, needle, tmp_path, tiny_resources):
    """Complements test_workflow.py::test_bad_configuration_fails_before_any_job."""
    resources = tiny_resources
    if overrides == "NO_IMAGES":  # weights present, images absent, offline
        resources = tmp_path / "resources"
        (resources / "weights").mkdir(parents=True)
        (resources / "weights" / "timm").symlink_to(tiny_resources / "weights" / "timm")
        overrides = {}
    cfg = _write_config(tmp_path / "bad.yaml", resources_dir=str(resources), **overrides)
    proc = _run(REPO, tmp_path, "results/table1.csv", "--configfile", str(cfg), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert needle in out, out[-3000:]
    if "checksums.vit_tiny" in needle:  # names the file, the digests and what to do
        assert str(tiny_resources / "weights" / "timm" / "vit_tiny_patch16_224.safetensors") in out
        assert "Replace the file" in out and "update the checksum" in out
    assert not (tmp_path / "results").exists() and not (tmp_path / "logs").exists()


def test_unreadable_image_is_named_and_nothing_is_written(tmp_path, tiny_resources, photos_dir):
    """A truncated JPEG among the sampled images stops the sample rule, the first job,
    naming the file; no sample table, activation file or later job follows."""
    resources = tmp_path / "resources"
    images = resources / "images" / "imagenet-sample"
    images.mkdir(parents=True)
    (resources / "weights").mkdir()
    (resources / "weights" / "timm").symlink_to(tiny_resources / "weights" / "timm")
    for f in photos_dir.iterdir():
        (images / f.name).symlink_to(f)
    broken = images / "n00000009_broken.JPEG"
    broken.write_bytes(next(photos_dir.iterdir()).read_bytes()[:3000])
    cfg = _write_config(tmp_path / "cfg.yaml", resources_dir=str(resources), vision={"n_images": 6, "shards": 1})
    proc = _run(REPO, tmp_path, "results/table1.csv", "--configfile", str(cfg), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"cannot read image {broken}" in out and "Replace the file" in out, out[-3000:]
    assert not (tmp_path / "results" / "samples" / "vision_6.tsv").exists()
    assert not list((tmp_path / "results").rglob("*.partial.*"))
    assert not (tmp_path / "results" / "activations").exists()


# --------------------------------------------------------------------------------------
# 2-3. interrupted runs and determinism
# --------------------------------------------------------------------------------------


def test_a_killed_job_leaves_nothing_a_rerun_would_trust(interrupted_run):
    _, _, seen = interrupted_run
    # killed while the HDF5 file was being written: only the temporary name exists
    assert seen["extraction"] == {"final": False, "partial": True}
    assert seen["locked"]  # Snakemake refuses the directory until --unlock
    # killed while the corrected KPCA job computed: neither of its outputs exists
    assert seen["kpca"] == {"final": [False, False]}


def test_interrupted_and_fresh_runs_give_identical_bytes(fresh_run, interrupted_run):
    """Two runs from scratch, in different directories and checkouts, one of them killed
    twice and resumed: every table, CSV, JSON, TSV, HDF5 file and figure is byte-identical."""
    fresh, interrupted = _results(fresh_run[0]), _results(interrupted_run[0])
    assert sorted(fresh) == sorted(interrupted)
    kinds = {Path(p).suffix for p in fresh}
    assert {".csv", ".md", ".json", ".h5", ".tsv", ".pdf", ".png"} <= kinds
    differ = [p for p in fresh if fresh[p] != interrupted[p]]
    assert not differ, differ
    assert not any(".partial" in p for p in fresh)


def test_jobs_get_a_short_openmp_spin(fresh_run):
    """The workflow exports GOMP_SPINCOUNT=3000 unless the user set one, so concurrent jobs
    with OpenMP teams on the same cores do not stall each other (docs/performance.md); both
    KPCA jobs saw it."""
    for variant in ("paper", "corrected"):
        log = (fresh_run[0] / f"logs/kpca_heads/{variant}/{MODEL}/vision_4_0of1.log").read_text()
        assert f"OpenMP spin count {os.environ.get('GOMP_SPINCOUNT', '3000')}" in log, log[-2000:]


def test_truncated_activation_file_is_named_by_every_reader(fresh_run, tmp_path):
    """A real activation file cut in half: each stage that reads it names it."""
    whole = (fresh_run[0] / ACTIVATIONS).read_bytes()
    cut = tmp_path / "vision_4_0of1.h5"
    cut.write_bytes(whole[: len(whole) // 2])
    import torch

    cpu = torch.device("cpu")
    readers = [
        lambda: kpca_records(cut, "paper", device=cpu, progress=False),
        lambda: eigenvalue_records(cut, "corrected", True, n_components=4, device=cpu),
        lambda: gamma_records(cut, 1, "corrected", standardize=True, noise=0.1, seed=0, n_components=4, device=cpu),
    ]
    for read in readers:
        with pytest.raises(CorruptActivationFileError, match=str(cut)):
            read()


# --------------------------------------------------------------------------------------
# 4. rerun semantics, from Snakemake's dry-run job table
# --------------------------------------------------------------------------------------

RERUN_CASES = [
    pytest.param({"spectra": {"n_components": 6}}, {"eigenvalues_vision": 2, "table_spectra": 1}, id="tables-2-3-parameter"),
    pytest.param({"figure3": {"noise": 0.2}}, {"gamma_vision": 1, "figure3": 1}, id="figure-3-parameter"),
    pytest.param(
        {"vision": {"n_images": 3}},
        {"sample_images": 1, "extract_vision": 1, "kpca_heads": 2, "table1": 2},
        id="image-count",
    ),
    pytest.param({}, {}, id="nothing-changed"),
]


@pytest.mark.parametrize("overrides, expected", RERUN_CASES)
def test_a_changed_parameter_reruns_only_the_jobs_that_use_it(overrides, expected, fresh_run, big_resources):
    work, _ = fresh_run
    cfg = _config(work / "changed.yaml", big_resources, **overrides)
    proc = _run(REPO, work, "-n", *RELIABILITY_TARGETS, "--configfile", str(cfg))
    assert _planned_jobs(proc.stdout + proc.stderr) == expected


CODE_CHANGES = [
    pytest.param(
        "src/kpca_repro/method/kpca.py",
        {"kpca_heads": 2, "eigenvalues_vision": 2, "gamma_vision": 1, "table1": 2, "table_spectra": 1, "figure3": 1},
        id="kpca-module",
    ),
    pytest.param(
        "src/kpca_repro/capture/extraction.py",
        {"extract_vision": 1, "kpca_heads": 2, "eigenvalues_vision": 2, "gamma_vision": 1, "table1": 2, "table_spectra": 1, "figure3": 1},
        id="extraction-module",
    ),
    pytest.param("src/kpca_repro/analysis/tables.py", {"table1": 2, "table_spectra": 1}, id="tables-module"),
    pytest.param("src/kpca_repro/figures/plots.py", {"figure3": 1}, id="figures-module"),
]


@pytest.mark.parametrize("module, expected", CODE_CHANGES)
def test_an_edited_module_reruns_its_jobs_and_nothing_upstream(module, expected, interrupted_run, workflow_copy):
    """Appending a line to a library module of the copied workflow: the jobs importing it
    (listed as rule inputs) and those downstream rerun; extraction never does."""
    work, cfg, _ = interrupted_run
    path = workflow_copy / module
    original = path.read_bytes()
    try:
        path.write_bytes(original + b"\n# edited by test_reliability\n")
        proc = _run(workflow_copy, work, "-n", *RELIABILITY_TARGETS, "--configfile", str(cfg))
    finally:
        path.write_bytes(original)
    assert _planned_jobs(proc.stdout + proc.stderr) == expected


def test_a_corrupt_activation_file_stops_the_run_naming_it(interrupted_run, workflow_copy, tmp_path):
    """Truncates the activation file of a copy of the interrupted run's directory (results
    and Snakemake's metadata, times kept), so the shared run stays intact whatever the test
    order. Its readers rerun (the file changed) and fail with its name; no output is written
    under a final name."""
    shared, cfg, _ = interrupted_run
    work = tmp_path / "corrupt"
    shutil.copytree(shared, work, symlinks=True)
    cfg = work / cfg.relative_to(shared)
    h5 = work / ACTIVATIONS
    h5.write_bytes(h5.read_bytes()[:4096])
    proc = _run(workflow_copy, work, "results/table1.csv", "--configfile", str(cfg), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "CorruptActivationFileError" in out and ACTIVATIONS in out, out[-3000:]
    assert not (work / "results" / "heads" / "paper" / MODEL / "vision_4_0of1.csv").exists()
