"""The first hour of a new user (issue 22): missing inputs fail fast in one block, job logs
are readable."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import yaml

from kpca_repro import progress
from kpca_repro.workflow import preflight

from conftest import REPO, TINY_KWARGS, run_snakemake

PAPER_VISION = [
    "vit_tiny_patch16_224",
    "vit_small_patch16_224",
    "vit_base_patch16_224",
    "vit_large_patch16_224",
    "deit_tiny_patch16_224",
    "deit_small_patch16_224",
    "deit_base_patch16_224",
    "deit_tiny_distilled_patch16_224",
    "deit_small_distilled_patch16_224",
    "deit_base_distilled_patch16_224",
]


def _default_config() -> dict:
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


# --------------------------------------------------------------------------------------
# 1. missing inputs: one block, exact paths, the offline configuration, in seconds
# --------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("target", ["results/table1.csv", None], ids=["table1", "all"])
def test_missing_inputs_offline_give_one_block(target, tmp_path, monkeypatch):
    """The default configuration in an empty directory with HF_HUB_OFFLINE=1 (as on a machine
    without network): no job, no traceback, each missing path and the offline command. (How
    long the block takes is a benchmark, not asserted here: docs/performance.md, dry run.)"""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    proc = run_snakemake(tmp_path, *([target] if target else []), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in out and 'File "' not in out, out[-3000:]
    assert "HF_HUB_OFFLINE=1 in the environment" in out
    for model in PAPER_VISION:
        assert f"missing pretrained weights of timm model '{model}': resources/weights/timm/{model}.safetensors does not exist" in out
    assert "missing ImageNet sample images: resources/images/imagenet-sample does not exist" in out
    assert "--configfile " + str(REPO / "config" / "offline_deit_tiny.yaml") in out
    block = out[out.index("Cannot start") :]
    assert block.count("Cannot start") == 1 and len(block.splitlines()) < 60
    if target is None:  # `all` also needs the language models and WikiText-103; it trains nothing
        assert "missing language model 'bert-base-uncased'" in out and "text.local_models" in out
        assert "resources/text/wikitext-103/wiki.test.raw does not exist" in out
        assert "fashion-mnist" not in out  # training is asked for by config/training.yaml only
        assert "config/offline_minilm.yaml" in out
    else:  # Table 1 needs no language model
        assert "language model" not in out and "wikitext" not in out.lower()
    assert not (tmp_path / "logs").exists() and not (tmp_path / "results").exists()


def test_block_names_paths_relative_to_the_repository(tmp_path, monkeypatch):
    """Run from the repository root, the offline configuration is shown as the repository path."""
    alternatives = preflight.offline_alternatives({"weights", "images"}, REPO / "config", REPO)
    assert alternatives[0][0] == "snakemake --cores 2 results/table1.csv --configfile config/offline_deit_tiny.yaml"


@pytest.mark.integration
@pytest.mark.parametrize(
    "target, named, not_named",
    [
        ("results/figure3.pdf", ["pretrained weights of timm model 'vit_tiny_patch16_224'", "ImageNet sample images"], ["vit_small_patch16_224", "language model", "WikiText"]),
        ("results/table4_corrected.csv", ["language model 'bert-base-uncased'", "WikiText-103"], ["pretrained weights", "ImageNet"]),
    ],
    ids=["figure3", "table4"],
)
def test_the_block_names_what_the_scheduled_jobs_need(target, named, not_named, tmp_path, monkeypatch):
    """The inputs named are those of the jobs Snakemake scheduled for the target (offline: true,
    empty resources); a dry run schedules the download jobs and stops nothing."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    cfg = tmp_path / "offline.yaml"
    cfg.write_text(yaml.safe_dump({"offline": True, "resources_dir": str(tmp_path / "res")}))
    proc = run_snakemake(tmp_path, target, "--configfile", str(cfg), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "offline: true in the configuration" in out, out[-3000:]
    block = out[out.index("Cannot start") :]
    assert all(n in block for n in named) and not any(n in block for n in not_named), block
    assert not (tmp_path / "results").exists()
    dry = run_snakemake(tmp_path, "-n", target, "--configfile", str(cfg))
    assert "Cannot start" not in dry.stdout + dry.stderr and "download_" in dry.stdout + dry.stderr


def _requirements(cfg, models):
    return [r for m in models for r in preflight.requirements("weights", cfg, m)] + preflight.requirements("images", cfg)


def test_online_missing_inputs_are_left_to_the_download_rules(tmp_path, monkeypatch):
    """Not declared offline: nothing raised, the missing inputs returned (the download jobs fetch them);
    offline: the block, each missing path once; present inputs: nothing missing."""
    for var in preflight.OFFLINE_ENV:
        monkeypatch.delenv(var, raising=False)
    cfg = _default_config()
    cfg.update(resources_dir=str(tmp_path / "res"), offline=False)
    reqs = _requirements(cfg, PAPER_VISION)
    missing = preflight.check_missing(reqs, cfg)
    assert {r.kind for r in missing} == {"weights", "images"} and len(missing) == 11
    cfg["offline"] = True
    with pytest.raises(preflight.MissingInputsError) as err:
        preflight.check_missing(reqs + reqs, cfg)
    message = str(err.value)
    assert message.startswith("Cannot start: 11 inputs missing, and they cannot be downloaded (offline: true in the configuration).")
    assert message.count(str(tmp_path / "res" / "weights" / "timm" / "vit_large_patch16_224.safetensors")) == 1


def test_present_inputs_are_not_missing(tiny_resources):
    cfg = _default_config()
    cfg.update(resources_dir=str(tiny_resources), offline=True)
    assert preflight.check_missing(_requirements(cfg, sorted(TINY_KWARGS)), cfg) == []


@pytest.mark.integration
def test_a_command_that_runs_no_job_checks_nothing(tmp_path, monkeypatch):
    """--dag builds the DAG (the download jobs included) but runs no job: no block, exit 0."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = run_snakemake(tmp_path, "results/table1.csv", "--dag", check=False)
    assert proc.returncode == 0 and "Cannot start" not in proc.stdout + proc.stderr
    assert "download_timm_weights" in proc.stdout


@pytest.mark.integration
def test_a_study_directory_with_relative_paths_fails_in_one_line(tmp_path):
    """-d makes the study directory the working directory: the offline configuration's
    ../shared paths then resolve from there, and the error names the key, without Snakefile lines."""
    study = tmp_path / "study"
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-d", str(study), "-n", "results/table1.csv", "--configfile", "config/offline_deit_tiny.yaml"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # the first relative ../shared path checked (the published tables are packaged: no such path)
    assert "config key figure1.reference_logs: ../shared/reference/training_logs is not a directory" in out, out[-2000:]
    assert 'File "' not in out and "Traceback" not in out


@pytest.mark.integration
def test_allowed_rules_that_read_no_input_need_none(tmp_path):
    """--allowed-rules without the extraction: the activation files are used as they are, so the
    missing weights and images (offline) stop nothing; the KPCA job runs (and fails on the
    stand-in files)."""
    cfg = _tiny_config(tmp_path / "tiny.yaml", tmp_path / "res", vision={"shards": 1})
    for model in TINY_KWARGS:
        (tmp_path / "results" / "activations" / model).mkdir(parents=True)
        (tmp_path / "results" / "activations" / model / "vision_4_0of1.h5").write_bytes(b"")
    proc = run_snakemake(tmp_path, "results/table1.csv", "--configfile", str(cfg), "--allowed-rules", "kpca_heads", "records_metadata", "table", check=False)
    out = proc.stdout + proc.stderr
    assert "Cannot start" not in out and "missing pretrained weights" not in out, out[-3000:]
    assert "rule kpca_heads" in out


@pytest.mark.parametrize(
    ("argv", "runs"),
    [
        (["snakemake", "--cores", "8", "results/table1.csv"], True),
        (["/env/lib/python3.11/site-packages/snakemake/__main__.py", "--cores", "2", "results/table1.csv"], True),  # python -m snakemake
        (["snakemake", "-n", "results/table1.csv"], False),
        (["snakemake", "--cores", "2", "--lint"], False),
        (["snakemake", "--unlock"], False),
        (["snakemake", "--cores", "2", "--report", "r.html"], False),
        (["snakemake", "--cores", "2", "--dag"], False),
        (["/usr/bin/pytest", "-q"], False),  # Snakemake's Python API in another program: not known
    ],
)
@pytest.mark.integration  # reads the command line with Snakemake's own parser (snakemake.cli imports its API)
def test_which_command_lines_run_jobs(argv, runs):
    assert preflight.executes_jobs(argv) is runs


def _closed_port() -> int:
    """A local TCP port nothing listens on: a connection to it is refused at once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_host_is_named_with_its_reason():
    port = _closed_port()
    assert preflight.unreachable(f"http://127.0.0.1:{port}/x.zip") == f"127.0.0.1:{port}: connection refused"
    assert preflight.unreachable("https://host.invalid/x").startswith("host.invalid: ")  # RFC 2606: never resolves


def test_no_network_and_nothing_missing_or_offline_stops_nothing(tiny_resources, monkeypatch):
    """The check opens connections only when an input is missing, downloads are on and the command runs jobs."""
    for var in preflight.OFFLINE_ENV:
        monkeypatch.delenv(var, raising=False)
    closed = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", closed)
    cfg = _default_config()
    cfg["vision"].update(models=sorted(TINY_KWARGS), imagenet_sample_url=f"{closed}/sample.zip")
    cfg.update(resources_dir=str(tiny_resources), offline=False)
    cfg["text"]["models"] = cfg["decoders"]["models"] = []
    cfg["figure3"]["model"] = sorted(TINY_KWARGS)[0]
    assert preflight.network_stop(cfg, REPO / "config", executes=lambda: True) is None  # everything is here
    cfg["vision"]["models"] = PAPER_VISION
    assert preflight.network_stop(cfg, REPO / "config", executes=lambda: False) is None  # a dry run, --lint, ...
    message = preflight.network_stop(cfg, REPO / "config", executes=lambda: True)
    missing = [m for m in PAPER_VISION if m not in TINY_KWARGS]
    assert message.startswith(f"Cannot start: {len(missing)} inputs of this configuration are not here (") and "connection refused" in message
    assert "--configfile config/offline_deit_tiny.yaml" in message
    cfg["offline"] = True  # the block before the first job names each missing input
    assert preflight.network_stop(cfg, REPO / "config", executes=lambda: True) is None


@pytest.mark.integration
def test_the_readme_command_without_network_stops_in_seconds_naming_the_offline_configuration(tmp_path):
    """The README's first command, default configuration, no inputs, its download hosts refusing
    connections (a closed local port as HF_ENDPOINT and as the ImageNet sample's URL): within 30 s,
    at most 15 lines, naming config/offline_deit_tiny.yaml, no job started."""
    import os
    import time

    from conftest import checkout_env

    closed = f"http://127.0.0.1:{_closed_port()}"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"resources_dir": str(tmp_path / "resources"), "vision": {"imagenet_sample_url": f"{closed}/sample.zip"}}))
    env = {k: v for k, v in checkout_env().items() if k not in preflight.OFFLINE_ENV} | {"HF_ENDPOINT": closed}
    env.pop("HTTP_PROXY", None), env.pop("http_proxy", None)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "--cores", "8", "results/table1.csv", "--configfile", str(cfg)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    seconds, out = time.monotonic() - t0, proc.stdout + proc.stderr
    assert proc.returncode == 1 and seconds < 30, (seconds, out)
    assert len(out.splitlines()) <= 15 and "config/offline_deit_tiny.yaml" in out and "connection refused" in out, out
    assert not (tmp_path / "logs").exists() and not os.path.exists(tmp_path / "resources")  # no job ran


def test_a_misspelt_timm_name_is_not_a_timm_model(tmp_path):
    """A download of weights scheduled for a name timm does not know: said so, with the closest name, not
    "missing weights" with advice to save them; the download command refuses it the same way."""
    from kpca_repro.inputs.resources import UnknownTimmModelError, download_timm_weights

    cfg = _default_config()
    cfg.update(resources_dir=str(tmp_path), offline=True)
    message = preflight.stop_message(cfg, REPO / "config", [("download_timm_weights", {"model": "deit_tinyy_patch16_224"})])
    assert message == "config: 'deit_tinyy_patch16_224' is not a timm model (timm.list_models()); did you mean 'deit_tiny_patch16_224'? Fix the model id in the configuration."
    # a real model whose weights are absent: the missing-input block, as before
    assert preflight.stop_message(cfg, REPO / "config", [("download_timm_weights", {"model": "deit_tiny_patch16_224"})]).startswith("Cannot start: 1 input missing")
    with pytest.raises(UnknownTimmModelError, match="'deit_tinyy_patch16_224' is not a timm model"):
        download_timm_weights("deit_tinyy_patch16_224", tmp_path / "w.safetensors")
    assert not list(tmp_path.iterdir())


@pytest.mark.integration
def test_inputs_that_are_there_have_no_download_rule(tiny_resources, tmp_path):
    """A dry run of inputs placed by hand: no download rule in the DAG, none "with missing metadata";
    the weights of a model not there still have theirs."""
    cfg = _tiny_config(tmp_path / "cfg.yaml", tiny_resources)
    proc = run_snakemake(tmp_path, "-n", "results/table1.csv", "--configfile", str(cfg))
    out = proc.stdout + proc.stderr
    assert "download_" not in out and "missing metadata" not in out, out[-3000:]
    cfg = _tiny_config(tmp_path / "cfg2.yaml", tiny_resources, offline=False, vision={"models": [*sorted(TINY_KWARGS), "deit_tiny_patch16_224"]})
    out = run_snakemake(tmp_path, "-n", "results/table1.csv", "--configfile", str(cfg)).stdout
    fetched = [line for line in out.splitlines() if line.strip().startswith("output:") and "/weights/timm/" in line]
    assert "download_timm_weights:" in out and len(fetched) == 1 and fetched[0].endswith("/deit_tiny_patch16_224.safetensors"), out[-3000:]
    assert "download_imagenet_sample" not in out


# --------------------------------------------------------------------------------------
# 2. readable logs
# --------------------------------------------------------------------------------------


def test_progress_lines_without_a_terminal(monkeypatch):
    """Without a terminal, plain lines (done/total, rate, ETA), no carriage return."""
    monkeypatch.setenv("KPCA_PROGRESS_INTERVAL", "0")
    monkeypatch.setattr(progress, "_terminal", lambda: None)
    log = io.StringIO()
    progress.set_log_stream(None)
    monkeypatch.setattr("sys.stderr", log)
    with progress.progress(total=4, desc="kpca paper m", unit="head") as bar:
        for _ in range(4):
            bar.update(1)
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 4 and "kpca paper m: 1/4 head (25%)" in lines[0] and "ETA" in lines[0]
    assert "4/4 head (100%)" in lines[-1] and "head/s" in lines[-1]


def test_a_resumed_jobs_rate_counts_only_what_it_computed(monkeypatch):
    """Heads read back from an interrupted run count towards done/total, not towards the rate: 90 kept,
    10 computed in at least 1 s is at most 10 head/s, never 100."""
    monkeypatch.setenv("KPCA_PROGRESS_INTERVAL", "1000")
    monkeypatch.setattr(progress, "_terminal", lambda: None)
    log = io.StringIO()
    progress.set_log_stream(None)
    monkeypatch.setattr("sys.stderr", log)
    clock = iter([0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    with progress.progress(total=100, desc="kpca paper m", unit="head") as bar:
        bar.skip(90)
        bar.update(10)
    line = log.getvalue().splitlines()[-1]
    assert "kpca paper m: 100/100 head (100%), 90 kept, 10.00 head/s, elapsed 0:00:01" in line, line


def test_hub_retries_take_one_line_each(monkeypatch):
    """A Hugging Face retry logs one line (the error folded into "Retrying in ..."), once."""
    import logging

    from kpca_repro.smk import quiet_hub_logging

    quiet_hub_logging(progress_bars=False)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    root = logging.getLogger()
    root.addHandler(handler)
    monkeypatch.setattr(root, "level", logging.INFO)
    try:
        http = logging.getLogger("huggingface_hub.utils._http")
        for i in (1, 2):
            http.warning("'[Errno -2] Name or service not known' thrown while requesting HEAD https://huggingface.co/x")
            http.warning(f"Retrying in {i}s [Retry {i}/5].")
    finally:
        root.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines == [f"Retrying in {i}s [Retry {i}/5] (after '[Errno -2] Name or service not known')" for i in (1, 2)]


def _tiny_config(path, resources, **overrides):
    cfg = {
        "resources_dir": str(resources),
        "offline": True,
        "vision": {"models": sorted(TINY_KWARGS), "n_images": 4, "batch_size": 2, "shards": 1, "model_kwargs": TINY_KWARGS},
        "kpca": {"heads_per_chunk": 4, "threads": 1},
        "figure3": {"model": "vit_tiny_patch16_224", "block": 1, "n_images": 1, "n_components": 8},
        "spectra": {"n_images": 3, "n_components": 8},
        "text": {"models": []},
    }
    for key, value in overrides.items():
        cfg[key].update(value) if isinstance(value, dict) else cfg.__setitem__(key, value)
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.integration
def test_job_logs_have_progress_lines_and_no_bar_frames(tiny_resources, tmp_path, monkeypatch):
    """Table 1 from the tiny models: the KPCA and extraction logs hold plain progress lines and
    no tqdm carriage-return frames; Snakemake prints no 'Shell command: None'."""
    monkeypatch.setenv("KPCA_PROGRESS_INTERVAL", "0")  # a line per update: the frames a bar would draw
    cfg = _tiny_config(tmp_path / "tiny.yaml", tiny_resources)
    proc = run_snakemake(tmp_path, "results/table1.csv", "--configfile", str(cfg))
    assert "Shell command: None" not in proc.stdout + proc.stderr
    kpca_logs = sorted((tmp_path / "logs" / "kpca_heads").rglob("*.log"))
    extract_logs = sorted((tmp_path / "logs" / "extract_vision").rglob("*.log"))
    assert kpca_logs and extract_logs
    for log in kpca_logs + extract_logs:
        text = log.read_text()
        assert "\r" not in text, log
        assert " progress " in text, log
    text = kpca_logs[0].read_text()
    n_heads = 4 * 2 * 3  # images x layers x heads of the tiny models
    assert f"/{n_heads} head (" in text and f"{n_heads}/{n_heads} head (100%)" in text
