# The configuration (validated, then checked), paths, input functions and the checks before the first
# job. Paths of this repository are relative to REPO (the Snakefile's directory, also in a module).
import os
import sys
import warnings
from functools import partial
from pathlib import Path

from snakemake.exceptions import WorkflowError


def _check_package_checkout():
    """Stop, before anything imports it, when the `kpca_repro` Python would import is not this checkout's
    src/kpca_repro (an editable install of another checkout, a PYTHONPATH elsewhere): the jobs would run
    that code while Snakemake tracks this checkout's src/ for reruns (stage_code). One line, status 1."""
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

from kpca_repro.check_cache import CHECK_CACHE_DIR as CHECK_CACHE
from kpca_repro.inputs.model_info import MissingModelError, model_source
from kpca_repro.inputs.resources import export_hub_timeouts
from kpca_repro.method.variant import VARIANTS
from kpca_repro.threads import gpu_resource, record_torch_default_threads
from kpca_repro.training.summary import scale_setting, scale_tokens
from kpca_repro.workflow import config_checks, paths
from kpca_repro.workflow.config_checks import ConfigError, run_model_scale
from kpca_repro.workflow.paths import default_target, has_vision, model_id_from_slug, model_slug
from kpca_repro.workflow.preflight import FASHION_MNIST_FILES, ModelCost, Preflight, text_model_shape

# libgomp's idle threads spin before they sleep, so jobs sharing cores burn each other's time
# slices (docs/performance.md, GOMP_SPINCOUNT); a short spin changes no number. Jobs inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")
# The cluster rules' params functions ask for the job's resources while Snakemake builds the DAG; an
# input-size default (disk_mb) then leaves a coroutine unawaited, harmlessly (snakemake issue 4280).
warnings.filterwarnings("ignore", "coroutine 'InputFiles._predicated_size_files.<locals>.sizes' was never awaited", RuntimeWarning)


def _checked_config():
    """Validate ``config`` against the schema (filling defaults; one short message per error), resolve
    the training scales, then every check a schema cannot express (config_checks; cluster jobs skip the
    costly ones). A failure ends Snakemake with its message alone, no Snakefile lines (docs/running.md)."""
    try:
        config_checks.checked_config(config, REPO / "workflow" / "schemas" / "config.schema.yaml", main_process=workflow.is_main_process, cache_dir=CHECK_CACHE)
    except ConfigError as exc:
        sys.exit(str(exc))  # the message alone on stderr, status 1


_checked_config()
if workflow.is_main_process:
    # the model checks imported torch here (a cache miss): its thread count is the default the jobs'
    # kpca.*_threads: auto asks for, so no job starts a child process to learn it
    record_torch_default_threads(CHECK_CACHE)
# Jobs inherit it: huggingface_hub's own 10 s read timeout would otherwise override
# downloads.timeout_s for hub files (weights, language models, WikiText).
export_hub_timeouts(config["downloads"]["timeout_s"])
RESOURCES = config["resources_dir"]
VISION = config["vision"]
TEXT = config["text"]
TRAINING = config["training"]
FIGURE1 = config["figure1"]
FIGURE5 = config["figure5"]
ENV = "../../envs/pipeline.yaml"
FASHION_MNIST = [f"{RESOURCES}/datasets/fashion-mnist/{f}" for f in FASHION_MNIST_FILES]


wildcard_constraints:
    model=r"[A-Za-z0-9_.\-]+",
    variant="|".join(VARIANTS),  # the registry's names (config.schema.yaml's enum: tests/test_config_checks.py)
    n=r"\d+",
    shard=r"\d+of\d+",
    keyset="standardized|raw",
    slug=r"[A-Za-z0-9_.\-]+",
    sample=r"\d+|sentences",


def stage_code(*stages):
    """The `code` input of a rule: the package's shared modules (src/kpca_repro/*.py) and those of
    the stages its script uses (src/kpca_repro/<stage>/*.py). Snakemake tracks only the script
    file; this way editing a stage reruns exactly the jobs that use it."""
    src = REPO / "src" / "kpca_repro"
    return sorted(str(p) for d in ("", *stages) for p in (src / d).glob("*.py"))


def ablation_runs():
    """(model, scale, tokens) of each token-ablation run; evaluated only when the table is requested."""
    ablation = config["token_ablation"]
    try:
        return [(model, scale, scale_tokens(TRAINING["scales"][scale])) for model in ablation["models"] for scale in ablation["scales"]]
    except ValueError as exc:
        raise WorkflowError(f"config key token_ablation.scales: {exc} in one of {', '.join(ablation['scales'])} (training.scales)") from None


def reference_logs_input():
    """The authors' W&B logs folder of Figures 1 and 4 ([] when figure1.use_reference is false)."""
    return [FIGURE1["reference_logs"] or f"{RESOURCES}/training_logs"] if FIGURE1["use_reference"] else []


# Input paths (image_source: the sampled images' directory and layout) and output paths
# (kpca_repro.workflow.paths), bound to this run's configuration.
image_source, weights_path = partial(config_checks.image_source, config), partial(config_checks.weights_path, config)


def sampled_images(wildcards):
    """Input function of sample_images: the image set. A sample larger than the set stops the run in one
    line while the DAG is built (dry runs too), so only the requested targets' image counts are checked."""
    if workflow.is_main_process and (error := config_checks.image_count_error(config, int(wildcards.n))):
        sys.exit(error)  # the message alone on stderr, status 1
    return image_source()[0]


norm_activations, comparison_tables, all_targets = (partial(f, config) for f in (paths.norm_activations, paths.comparison_tables, paths.all_targets))


def figure5_models(wildcards):
    """Path slugs of the Figure 5 models (figure5.models, else text.models)."""
    models = (FIGURE5["models"] if FIGURE5["models"] is not None else TEXT["models"]) + paths.user_models(config, "text")
    if not models:
        raise WorkflowError("config keys figure5.models / text.models: no language model configured for Figure 5")
    return [model_slug(m) for m in models]


# Before the first job: while Snakemake builds the DAG, the rules' own functions register what the scheduled
# jobs need, cost and ask of a node; the Snakefile's onstart handler checks it (kpca_repro.workflow.preflight).

PREFLIGHT = Preflight(config, REPO / "config", workflow.is_main_process)


def missing_input(kind):
    """The input function of the download rules, which exist only for missing inputs; it registers what its
    job fetches, so that the check before the first job names it if it cannot be fetched."""
    return lambda wildcards: PREFLIGHT.need(kind, wildcards.get("model")) or []


def on_cluster(rule):
    """`params.cluster` of the cluster rules: records what each scheduled job asks of a node (Snakemake
    passes its resources, after --set-resources, else the default resources, and its threads)."""
    return lambda wildcards, threads, resources: PREFLIGHT.request(rule, threads, resources)


def vision_weights(wildcards):
    """Input function of extract_vision: the model's weights; prints its cost line (from the configuration check's cache)."""
    m = wildcards.model
    PREFLIGHT.cost(m, lambda: (c := config_checks.check_vision_model(config, m, m, CHECK_CACHE)) and ModelCost(m, "vision", c.n_tokens, c.depth, c.n_heads, c.head_dim, VISION["n_images"]))
    return weights_path(m)


def text_model_source(wildcards):
    """A language model's directory (text.local_models) or hub id; a hub id is registered for the
    check before the first job (offline and not cached, it cannot run)."""
    model_id = model_id_from_slug(wildcards.slug)
    if model_id not in TEXT["local_models"]:
        PREFLIGHT.need("text_model", model_id)
    try:
        return model_source(model_id, TEXT["local_models"], config["offline"])
    except MissingModelError:
        return model_id


def text_model_files(wildcards):
    """Input function of extract_text: a local model's config.json and weights (a change reruns
    extraction), none for the hub; prints the model's cost line."""
    source, model_id = text_model_source(wildcards), model_id_from_slug(wildcards.slug)
    PREFLIGHT.cost(model_id, lambda: (shape := text_model_shape(source)) and ModelCost(model_id, "text", TEXT["max_length"], *shape, TEXT["n_rows"]))
    if not os.path.isdir(source):
        return []
    return [str(p) for p in sorted(Path(source).iterdir()) if p.name in ("config.json", "model.safetensors", "pytorch_model.bin")]


def slurm_fit_check():
    """With the SLURM executor (profiles/slurm), stop before any submission when a scheduled cluster job
    fits on no node of its partition: SLURM would leave it PENDING forever (KPCA_SLURM_PREFLIGHT=0 skips it)."""
    if getattr(workflow.executor_plugin, "name", None) == "slurm":
        PREFLIGHT.check_requests()
