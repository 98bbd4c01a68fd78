# The configuration (validated, then checked, in one call), paths, pure input functions, the code each rule's
# script runs and the check before the first job. Paths of this repository are relative to REPO (the
# Snakefile's directory, also in a module).
import atexit
import json
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

from snakemake.exceptions import WorkflowError


def _check_package_checkout():
    """Stop, before anything imports it, when the `kpca_repro` Python would import is not this checkout's
    src/kpca_repro (an editable install of another checkout, a PYTHONPATH elsewhere): the jobs would run
    that code while Snakemake tracks this checkout's src/ for reruns (params.code). One line, status 1."""
    from importlib.util import find_spec

    spec = find_spec("kpca_repro")
    here = (REPO / "src" / "kpca_repro" / "__init__.py").resolve()
    found = Path(spec.origin).resolve() if spec and spec.origin else None
    if found != here:
        where = f"is imported from {found.parent}" if found else "is not importable"
        sys.exit(
            f"kpca_repro {where}, not from this workflow's checkout {REPO}: its jobs would run other code than the src/ "
            f"it tracks. Run `python -m pip install -e {REPO}`, or set PYTHONPATH={REPO / 'src'}"
        )


_check_package_checkout()

from kpca_repro.inputs.model_info import MissingModelError, model_source
from kpca_repro.inputs.resources import export_hub_timeouts
from kpca_repro.method.variant import VARIANTS
from kpca_repro.threads import DEFAULT_THREADS_ENV, ask_default_threads, gpu_resource
from kpca_repro.training.summary import scale_setting, scale_tokens
from kpca_repro.workflow import config_checks, locks, paths, preflight
from kpca_repro.workflow.code import code_hash
from kpca_repro.workflow.config_checks import ConfigError, run_model_scale
from kpca_repro.workflow.paths import default_target, has_vision, model_id_from_slug, model_slug
from kpca_repro.workflow.preflight import FASHION_MNIST_FILES

# libgomp's idle threads spin before they sleep, so jobs sharing cores burn each other's time
# slices (docs/performance.md, GOMP_SPINCOUNT); a short spin changes no number. Jobs inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")


def _checked_config():
    """Validate ``config`` against the schema (filling defaults; one short line per error), resolve
    the training scales, then every check a schema cannot express that needs no model (config_checks;
    cluster jobs hash no weights). The problems end Snakemake as one block, no Snakefile lines (docs/running.md)."""
    try:
        config_checks.checked_config(config, REPO / "workflow" / "schemas" / "config.schema.yaml", main_process=workflow.is_main_process)
    except ConfigError as exc:
        sys.exit(str(exc))  # the message alone on stderr, status 1


_checked_config()
# A run killed with SIGKILL (or out of memory) leaves Snakemake's lock behind; the same command goes on
# without `snakemake --unlock` when the lock's recorded holder has ended (kpca_repro.workflow.locks).
if workflow.is_main_process and (killed := locks.remove_stale_lock()):
    sys.stderr.write(f"The run before (process {', '.join(map(str, killed))}) was killed: its lock in {locks.LOCK_DIR} is removed, as `snakemake --unlock` would; going on.\n")
# Online, inputs to download and no network: one short message now, not the download jobs' retries (preflight).
if workflow.is_main_process and (message := preflight.network_stop(config, REPO / "config")):
    sys.exit(message)
# Jobs inherit it: huggingface_hub's own 10 s read timeout would otherwise override
# downloads.timeout_s for hub files (weights, language models, WikiText).
export_hub_timeouts(config["downloads"]["timeout_s"])
RESOURCES = config["resources_dir"]
VISION = config["vision"]
TEXT = config["text"]
DECODERS = config["decoders"]
TRAINING = config["training"]
FIGURE1 = config["figure1"]
FIGURE5 = config["figure5"]
ENV = "../../envs/pipeline.yaml"
# `params.downloads` of the download rules: the `downloads` section as JSON (their command line reads it)
DOWNLOADS = json.dumps(config["downloads"], sort_keys=True)
FASHION_MNIST = [f"{RESOURCES}/datasets/fashion-mnist/{f}" for f in FASHION_MNIST_FILES]


wildcard_constraints:
    model=r"[A-Za-z0-9_.\-]+",
    variant="|".join(VARIANTS),  # the registry's names (config.schema.yaml's enum: tests/test_config_checks.py)
    n=r"\d+",
    shard=r"\d+of\d+",
    keyset="standardized|raw",
    slug=r"[A-Za-z0-9_.\-]+",
    sample=r"\d+|sentences",


def code_of(script):
    """`params.code` for the script workflow/scripts/<script>, the hash of the package modules it imports
    without docstrings and comments (kpca_repro.workflow.code), so that editing one reruns exactly the
    jobs that run it. A function, computed only for the scheduled jobs, once per script."""
    return lambda wildcards: code_hash(REPO / "workflow" / "scripts" / script)


def ablation_runs():
    """(model, scale, tokens) of each token-ablation run; evaluated only when the table is requested."""
    ablation = config["token_ablation"]
    try:
        return [(model, scale, scale_tokens(TRAINING["scales"][scale])) for model in ablation["models"] for scale in ablation["scales"]]
    except ValueError as exc:
        raise WorkflowError(f"config key token_ablation.scales: {exc} in one of {', '.join(ablation['scales'])} (training.scales)") from None


def activations_output(path):
    """An extraction job's activation file: temp() with keep_activations: false (deleted after its last reader of the run)."""
    return path if config["keep_activations"] else temp(path)


def reference_logs_input():
    """The authors' W&B logs folder of Figures 1 and 4 ([] when figure1.use_reference is false)."""
    return [FIGURE1["reference_logs"] or f"{RESOURCES}/training_logs"] if FIGURE1["use_reference"] else []


# Input paths (image_source: the sampled images' directory and layout) and output paths
# (kpca_repro.workflow.paths), bound to this run's configuration.
image_source, weights_path = partial(config_checks.image_source, config), partial(config_checks.weights_path, config)


norm_activations, comparison_tables, all_targets = (partial(f, config) for f in (paths.norm_activations, paths.comparison_tables, paths.all_targets))


def figure5_models(wildcards):
    """Path slugs of the Figure 5 models (figure5.models, else text.models)."""
    models = (FIGURE5["models"] if FIGURE5["models"] is not None else TEXT["models"]) + paths.user_models(config, "text")
    if not models:
        raise WorkflowError("config keys figure5.models / text.models: no language model configured for Figure 5")
    return [model_slug(m) for m in models]


def text_model_source(wildcards):
    """A language model's directory (text.local_models) or hub id (a hub id not in the Hugging Face cache is
    named in the block before the first job when it cannot be downloaded)."""
    model_id = model_id_from_slug(wildcards.slug)
    try:
        return model_source(model_id, {**TEXT["local_models"], **DECODERS["local_models"]}, config["offline"])
    except MissingModelError:
        return model_id


def text_model_revision(wildcards):
    """The pinned revision of a decoder (decoders.revisions), else None (the hub's default branch)."""
    return DECODERS["revisions"].get(model_id_from_slug(wildcards.slug))


def text_model_is_decoder(wildcards):
    """Whether extract_text captures a decoder (decoders.models): causal heads, activation format 2."""
    return model_id_from_slug(wildcards.slug) in DECODERS["models"]


def text_model_files(wildcards):
    """Input function of extract_text: a local model's config.json and weights (a change reruns
    extraction), none for the hub."""
    source = text_model_source(wildcards)
    if not os.path.isdir(source):
        return []
    return [str(p) for p in sorted(Path(source).iterdir()) if p.name in ("config.json", "model.safetensors", "pytorch_model.bin")]


# (rule, wildcards) of each job of the rules that read external inputs (the downloads, the image samples,
# the text extractions) that Snakemake placed in the DAG: their input function `in_dag` notes it, and the
# check before the first job (before_first_job) reads the notes.
IN_DAG = {}


def in_dag(rule):
    """Input function (no files) of `rule`: notes the job's wildcards in IN_DAG for the check before the first
    job, which needs the jobs Snakemake placed (a download job is placed only for a missing file: its rule
    exists only then, resources.smk; training.smk's check their paths)."""

    def note(wildcards):
        IN_DAG[(rule, *sorted(wildcards.items()))] = (rule, dict(wildcards.items()))
        return []

    return note


def before_first_job():
    """The Snakefile's onstart handler (after the DAG is built, with the lock held; Snakemake runs none in a dry run,
    nor when nothing is to be done): the lock's holder is recorded (kpca_repro.workflow.locks). A sample of
    the DAG larger than its image set, or inputs of its jobs missing that cannot be downloaded, end the run in one
    block (kpca_repro.workflow.preflight; the jobs from their input functions, in_dag). Then, for
    kpca.*_threads: auto, torch's default thread count is asked of one child process for all local jobs (they
    inherit the variable), instead of one per job: Snakemake's own process has no torch to ask. The child runs
    beside the first jobs; a job that needs the count reads it from the child's file (kpca_repro.threads)."""
    locks.record_owner()  # this process holds the lock now: a rerun after a kill removes it (common.smk, above)
    if message := preflight.stop_message(config, REPO / "config", list(IN_DAG.values())):
        sys.exit(message)  # the block alone on stderr: a raised error would add Snakefile lines
    if "auto" in (config["kpca"]["eigh_threads"], config["kpca"]["intra_op_threads"]):
        # in the working directory's .snakemake/ (Snakemake made it for its locks): a killed run's file stays there
        fd, answer = tempfile.mkstemp(prefix="torch-threads-", dir=os.path.abspath(".snakemake"))
        os.close(fd)
        atexit.register(partial(Path(answer).unlink, missing_ok=True))
        os.environ[DEFAULT_THREADS_ENV] = ask_default_threads(answer)
