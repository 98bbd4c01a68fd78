"""Reliability of the workflow: bad input, interrupted runs, determinism, rerun semantics.

Most tests here run Snakemake in a subprocess (``integration``). The vision chain is
covered now; the language-model chain (Table 4) plugs in by adding cases to
``BAD_CONFIGURATIONS`` of tests/test_config_checks.py (its config keys, text resources and row
counts, checked without Snakemake), a target list to ``RELIABILITY_TARGETS`` and rows to
``RERUN_CASES`` / ``CODE_CHANGES``.
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

from kpca_repro.activations import CorruptActivationFileError
from kpca_repro.method.records import eigenvalue_records, gamma_records, kpca_records

from conftest import REPO, TINY_KWARGS
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
    seen["lock_left"] = any((work / ".snakemake" / "locks").glob("*.lock"))
    # a hard kill leaves Snakemake's lock behind; the same command again goes on, no --unlock typed
    # (kpca_repro.workflow.locks): it reaches the KPCA job, and is killed there in turn
    _kill_when(workflow_copy, work, work / KPCA_LOG, cfg)
    seen["kpca"] = {"final": [(work / f).exists() for f in KPCA_OUT]}
    outputs = [(work / "killed_run.out").read_text()]
    outputs.append(_run(workflow_copy, work, *RELIABILITY_TARGETS, "--configfile", str(cfg)).stderr)
    seen["reruns"] = outputs
    return work, cfg, seen


# --------------------------------------------------------------------------------------
# 1. bad input fails before any job runs, naming the key or file and what to do
# --------------------------------------------------------------------------------------

# One Snakemake run per kind of stop at parse time (a schema violation; a problem only
# kpca_repro.workflow.config_checks sees): the message reaches the user, alone, before any job.
# A sample larger than its image set stops the run in the onstart handler, before any job.
# Every bad configuration is checked with the same calls, without Snakemake, in
# tests/test_config_checks.py; the missing-input block before the first job runs through
# Snakemake in tests/test_first_hour.py, a sample larger than the image set below.
BAD_INPUT = [
    pytest.param({"vision": {"batch_sise": 3}}, "unknown config key vision.batch_sise (did you mean 'batch_size'?)", id="schema-misspelt-nested-key"),
    pytest.param({"checksums": {"vit_tiny_patch16_224": "0" * 64}}, "config key checksums.vit_tiny_patch16_224: ", id="config-checks-checksum-mismatch"),
]


def test_image_counts_are_checked_for_the_scheduled_samples_only(tmp_path, tiny_resources):
    """spectra.n_images beyond the image set: Table 1 plans, Table 2 stops before any job naming the key."""
    cfg = _write_config(tmp_path / "spectra.yaml", resources_dir=str(tiny_resources), spectra={"n_images": 50})
    assert _run(REPO, tmp_path, "-n", "results/table1.csv", "--configfile", str(cfg), check=False).returncode == 0
    proc = _run(REPO, tmp_path, "results/table2.csv", "--configfile", str(cfg), check=False)
    assert proc.returncode == 1 and "config key spectra.n_images: 50 images requested, but" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "results").exists()


@pytest.mark.parametrize("overrides, needle", BAD_INPUT)
def test_bad_input_fails_before_any_job(overrides, needle, tmp_path, tiny_resources):
    """The workflow stops while it is parsed: status 1, the message alone (no traceback), no job."""
    cfg = _write_config(tmp_path / "bad.yaml", resources_dir=str(tiny_resources), **overrides)
    proc = _run(REPO, tmp_path, "results/table1.csv", "--configfile", str(cfg), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert needle in proc.stderr and "Traceback" not in out, out[-3000:]
    if "checksums.vit_tiny" in needle:  # names the file, the digests and what to do
        assert str(tiny_resources / "weights" / "timm" / "vit_tiny_patch16_224.safetensors") in out
        assert "Replace the file" in out and "update the checksum" in out
    assert not (tmp_path / "results").exists() and not (tmp_path / "logs").exists()


def test_a_run_refuses_the_package_of_another_checkout(tmp_path):
    """Snakemake tracks this checkout's src/ for reruns, so its jobs must import that code: with
    another kpca_repro first on the path (here a stand-in package; in practice an editable install
    of another checkout), even a dry run stops before building the DAG, in one line with the fix."""
    other = tmp_path / "other" / "src" / "kpca_repro"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    proc = subprocess.run(_cmd(REPO, tmp_path, "-n", "results/table1.csv"), capture_output=True, text=True, cwd=tmp_path, env=_env(tmp_path / "other"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"kpca_repro is imported from {other}, not from this workflow's checkout {REPO}" in out, out[-3000:]
    assert f"python -m pip install -e {REPO}`, or set PYTHONPATH={REPO / 'src'}" in out
    assert "Traceback" not in out and "Building DAG" not in out


# --------------------------------------------------------------------------------------
# 1b. a bad input file ends its job in one line: the file, what is wrong, the fix; no
#     traceback, no output (kpca_repro.errors.InputFileError, kpca_repro.smk)
# --------------------------------------------------------------------------------------

RULE_SCRIPT = """
import sys, types
from kpca_repro.errors import InputFileError
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging

class BadFile(InputFileError, OSError):
    pass

log = setup_logging(types.SimpleNamespace(log=[sys.argv[1]]), "some_rule")
with atomic_output(sys.argv[2]) as tmp:
    tmp.write_text("half an output")
    raise {error}
"""


@pytest.mark.parametrize("error", ["BadFile('x.h5 is truncated.\\nFix: delete it')", "RuntimeError('a bug')"], ids=["input-file-error", "bug"])
def test_a_rule_script_ends_on_a_bad_input_file_in_one_line(error, tmp_path):
    """The hook setup_logging installs: a bad input file gives one ERROR line (newlines folded) on
    stderr and in the log, exit status 1; any other exception keeps its traceback. Either way the
    unfinished output is gone."""
    script, log, out = tmp_path / "rule.py", tmp_path / "rule.log", tmp_path / "out.csv"
    script.write_text(RULE_SCRIPT.format(error=error))
    proc = subprocess.run([sys.executable, str(script), str(log), str(out)], capture_output=True, text=True, env=_env(REPO))
    assert proc.returncode == 1
    assert not out.exists() and not (tmp_path / "out.partial.csv").exists()
    if error.startswith("BadFile"):
        assert proc.stderr.endswith(" some_rule ERROR x.h5 is truncated. Fix: delete it\n") and proc.stderr.count("\n") == 1, proc.stderr
        assert log.read_text() == proc.stderr
    else:
        assert "Traceback" in proc.stderr and "RuntimeError: a bug" in log.read_text()


def _cut(path: Path, size: int | None = None) -> None:
    """Truncate ``path`` to ``size`` bytes (default: half)."""
    path.write_bytes(path.read_bytes()[: size or path.stat().st_size // 2])


def _text_as_image(path: Path) -> None:
    path.write_text("a text file renamed .JPEG\n")


def _binary(path: Path) -> None:
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))


def _h_of_another_layer(path: Path) -> None:
    import h5py

    with h5py.File(path, "r+") as f:
        f["layers/00/h"][...] = f["layers/01/h"][...]


def _good_file(kind: str, tmp_path: Path, tiny_resources: Path) -> Path:
    """A good input file of ``kind`` in ``tmp_path``: weights, an image, WikiText, a user's activation file."""
    if kind == "weights":
        return Path(shutil.copy(tiny_resources / "weights" / "timm" / f"{MODEL}.safetensors", tmp_path))
    if kind == "image":
        return Path(shutil.copy(sorted((tiny_resources / "images" / "imagenet-sample").iterdir())[0], tmp_path / "n00000009_bad.JPEG"))
    if kind == "text":
        path = tmp_path / "wiki.test.raw"
        path.write_text(" = Robert Boulter = \n\n Robert Boulter is an English film , television and theatre actor .\n" * 6)
        return path
    from test_activations import write_hand_vit

    write_hand_vit(tmp_path / "mine.h5")
    return tmp_path / "mine.h5"


def _load_weights(path: Path, **kwargs) -> None:
    from kpca_repro.capture.vision import load_timm_model

    load_timm_model(MODEL, path, {**TINY_KWARGS[MODEL], **kwargs})


def _checksum(path: Path) -> None:
    from kpca_repro.inputs.resources import check_checksum

    check_checksum(path, "0" * 64)


def _sample_images(path: Path) -> None:
    from kpca_repro.inputs.images import check_images

    check_images([path])


def _sample_text(path: Path) -> None:
    from kpca_repro.inputs.text import read_text_rows, sample_rows

    sample_rows(read_text_rows(path), 5, 30, 0, source=path)


def _install_user_file(path: Path) -> None:
    from kpca_repro.activations import install_user_file

    install_user_file(path, path.with_name("installed.h5"), name="hand_vit", kind="vision", shard=0, n_shards=1)


def _read_activations(path: Path) -> None:
    from kpca_repro.activations import ActivationFile

    ActivationFile(path)


# (input kind, how its good file is broken, the reader a rule script calls, what the message says after the path)
BAD_FILES = [
    pytest.param("weights", lambda p: _cut(p, 100), _load_weights, "is not a complete safetensors file", id="weights-truncated-header"),
    pytest.param("weights", _cut, _load_weights, "is not a complete safetensors file", id="weights-truncated"),
    pytest.param("weights", lambda p: None, lambda p: _load_weights(p, depth=3), "does not fit vit_tiny_patch16_224", id="weights-of-another-architecture"),
    pytest.param("weights", _cut, _checksum, "SHA-256 is", id="weights-with-a-checksum"),
    pytest.param("image", _text_as_image, _sample_images, "not an image file", id="image-text-renamed-jpeg"),
    pytest.param("image", lambda p: _cut(p, 3000), _sample_images, "image file is truncated", id="image-truncated"),
    pytest.param("text", lambda p: p.write_text(""), _sample_text, "is empty", id="text-empty"),
    pytest.param("text", _binary, _sample_text, "is binary, not UTF-8 text", id="text-binary"),
    pytest.param("text", lambda p: p.write_bytes(b"row\x00" * 100), _sample_text, "is binary (it holds NUL bytes)", id="text-nul-bytes"),
    pytest.param("text", lambda p: p.write_text("short\n" * 10), _sample_text, "has 0 rows longer than 30 characters, 5 requested. Lower text.n_rows", id="text-too-short"),
    pytest.param("activations", _cut, _install_user_file, "not a readable HDF5 file", id="user-activations-truncated"),
    pytest.param("activations", _h_of_another_layer, _install_user_file, "do not reproduce the attention output h", id="user-activations-invariant"),
    pytest.param("activations", _cut, _read_activations, "is unreadable, truncated or incomplete", id="pipeline-activations-truncated"),
]


@pytest.mark.parametrize("kind, damage, read, words", BAD_FILES)
def test_every_bad_input_file_is_an_input_file_error_naming_it(kind, damage, read, words, tmp_path, tiny_resources):
    """What the rule scripts end on in one line: the reader of each input kind raises an
    InputFileError whose one-line message names the file, what is wrong and the fix."""
    from kpca_repro.errors import InputFileError

    path = _good_file(kind, tmp_path, tiny_resources)
    damage(path)
    with pytest.raises(InputFileError) as info:
        read(path)
    message = str(info.value)
    assert str(path) in message and words in message and "\n" not in message, message
    assert any(fix in message for fix in ("Replace", "Fix:", "delete it")), message
    assert not path.with_name("installed.h5").exists() and not list(tmp_path.rglob("*.partial*"))


def _bad_weights(resources: Path, tmp_path: Path) -> tuple[str, dict, str]:
    weights = resources / "weights" / "timm" / f"{MODEL}.safetensors"
    _cut(weights)
    return "results/table1.csv", {}, f"weights file {weights} is not a complete safetensors file"


def _bad_image(resources: Path, tmp_path: Path) -> tuple[str, dict, str]:
    image = resources / "images" / "imagenet-sample" / "n00000009_text.JPEG"
    _text_as_image(image)
    return "results/samples/vision_6.tsv", {"vision": {"n_images": 6}}, f"cannot read image {image}: not an image file"  # 6 of 6: drawn


def _bad_text(resources: Path, tmp_path: Path) -> tuple[str, dict, str]:
    text = resources / "text" / "wikitext-103" / "wiki.test.raw"
    text.parent.mkdir(parents=True)
    _binary(text)
    return "results/samples/text_3.tsv", {}, f"text file {text} is binary, not UTF-8 text"


def _bad_activations(resources: Path, tmp_path: Path) -> tuple[str, dict, str]:
    path = _good_file("activations", tmp_path, resources)
    _cut(path)
    overrides = {"vision": {"models": [], "n_images": 2}, "spectra": {"n_images": 2}, "activations": {"hand_vit": {"files": [str(path)], "kind": "vision"}}}
    return "results/table1.csv", overrides, f"{path}: not a readable HDF5 file"


@pytest.mark.parametrize("setup", [_bad_weights, _bad_image, _bad_text, _bad_activations], ids=["weights", "image", "text", "activations"])
def test_a_bad_input_file_stops_the_run_in_one_line(setup, tmp_path, tiny_resources):
    """One Snakemake run per input kind: the first job reading the bad file fails with its line
    (on the terminal, and again in the log Snakemake prints), no Python traceback, no output
    under a final name and no .partial file."""
    resources = tmp_path / "resources"
    for sub in ("weights", "images"):
        shutil.copytree(tiny_resources / sub, resources / sub)
    target, overrides, line = setup(resources, tmp_path)
    vision = {"models": [MODEL], "shards": 1, "model_kwargs": {MODEL: TINY_KWARGS[MODEL]}, **overrides.pop("vision", {})}
    cfg = _write_config(tmp_path / "cfg.yaml", resources_dir=str(resources), vision=vision, **overrides)
    work = tmp_path / "work"
    work.mkdir()
    proc = _run(REPO, work, target, "--configfile", str(cfg), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert line in out and "Traceback" not in out and 'File "' not in out, out[-4000:]
    errors = {ln.split(" ERROR ", 1)[1] for ln in out.splitlines() if " ERROR " in ln}
    assert len(errors) == 1 and line in errors.pop(), errors
    assert not list(work.rglob("*.partial*")) and not list(work.rglob("*.h5")) and not (work / target).exists()


# --------------------------------------------------------------------------------------
# 2-3. interrupted runs and determinism
# --------------------------------------------------------------------------------------


def test_a_killed_job_leaves_nothing_a_rerun_would_trust(interrupted_run):
    _, _, seen = interrupted_run
    # killed while the HDF5 file was being written: only the temporary name exists
    assert seen["extraction"] == {"final": False, "partial": True}
    # killed while the corrected KPCA job computed: neither of its outputs exists
    assert seen["kpca"] == {"final": [False, False]}


def test_the_same_command_goes_on_after_a_kill_with_no_unlock(interrupted_run):
    """Each SIGKILL of `snakemake` left its lock; each rerun of the same command removed it in one line
    (the killed run's process ended) and went on, to the KPCA job and then to the end."""
    work, _, seen = interrupted_run
    assert seen["lock_left"]
    for out in seen["reruns"]:
        said = [line for line in out.splitlines() if "was killed: its lock in .snakemake/locks is removed" in line]
        assert len(said) == 1 and "cannot be locked" not in out and "LockException" not in out, out[-3000:]
    assert not (work / ".snakemake" / "locks").exists()  # the finished run unlocked


def test_the_thread_count_answer_stays_in_the_project(fresh_run, interrupted_run):
    """The answer file of torch's default thread count (common.smk, before_first_job) lies in the run's own
    .snakemake/: a finished run removes its own, each of the two killed runs leaves its one there."""
    assert not list((fresh_run[0] / ".snakemake").glob("torch-threads-*"))
    assert len(list((interrupted_run[0] / ".snakemake").glob("torch-threads-*"))) == 2


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
        lambda: kpca_records(cut, "paper"),
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
    pytest.param({"spectra": {"n_components": 6}}, {"eigenvalues_vision": 2, "records_metadata": 2, "table": 1}, id="tables-2-3-parameter"),
    pytest.param({"figure3": {"noise": 0.2}}, {"gamma_vision": 1, "records_metadata": 1, "figure3": 1}, id="figure-3-parameter"),
    pytest.param(
        {"vision": {"n_images": 3}},
        {"sample_images": 1, "extract_vision": 1, "kpca_heads": 2, "records_metadata": 2, "table": 2},
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


STATEMENT, COMMENT = b"\n_EDITED_BY_TEST_RELIABILITY = 1\n", b"\n# edited by test_reliability\n"
CODE_CHANGES = [
    pytest.param(
        "src/kpca_repro/method/kpca.py",
        STATEMENT,
        {"kpca_heads": 2, "eigenvalues_vision": 2, "gamma_vision": 1, "records_metadata": 5, "table": 3, "figure3": 1},
        id="kpca-module",
    ),
    pytest.param(
        "src/kpca_repro/capture/extraction.py",
        STATEMENT,
        {"extract_vision": 1, "kpca_heads": 2, "eigenvalues_vision": 2, "gamma_vision": 1, "records_metadata": 5, "table": 3, "figure3": 1},
        id="extraction-module",
    ),
    pytest.param("src/kpca_repro/analysis/tables.py", STATEMENT, {"table": 3}, id="tables-module"),
    # the column descriptions: the records' metadata (rule records_metadata) and the tables and figure, no KPCA job
    pytest.param("src/kpca_repro/analysis/columns.py", STATEMENT, {"records_metadata": 5, "table": 3, "figure3": 1}, id="columns-module"),
    pytest.param("src/kpca_repro/figures/plots.py", STATEMENT, {"figure3": 1}, id="figures-module"),
    pytest.param("src/kpca_repro/method/kpca.py", COMMENT, {}, id="kpca-module-comment"),
]


@pytest.mark.parametrize("module, edit, expected", CODE_CHANGES)
def test_an_edited_module_reruns_its_jobs_and_nothing_upstream(module, edit, expected, interrupted_run, workflow_copy):
    """Appending a statement to a library module of the copied workflow: the jobs whose scripts import
    it (their params.code changes) and those downstream rerun; extraction never does. A comment reruns nothing."""
    work, cfg, _ = interrupted_run
    path = workflow_copy / module
    original = path.read_bytes()
    try:
        path.write_bytes(original + edit)
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
    assert f"activation file {ACTIVATIONS} is unreadable, truncated or incomplete" in out and "Traceback" not in out, out[-3000:]
    assert not (work / "results" / "heads" / "paper" / MODEL / "vision_4_0of1.csv").exists()
