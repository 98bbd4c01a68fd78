# Shared helpers: the configuration (validated, then checked), paths, input functions, and the
# one check before the first job. Paths of this repository are relative to REPO (the directory
# of the Snakefile, also when another workflow uses this one as a module).
import os
import sys
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from kpca_repro import config_checks, paths
from kpca_repro.check_cache import WORKFLOW_CACHE_DIR as CHECK_CACHE
from kpca_repro.code_deps import library_modules
from kpca_repro.config_checks import ConfigError, run_model_scale
from kpca_repro.cost import CostTable, model_cost, text_model_shape
from kpca_repro.model_info import MissingModelError, model_source
from kpca_repro.paths import model_id_from_slug, model_slug
from kpca_repro.preflight import Preflight
from kpca_repro.training_summary import scale_setting, scale_tokens

# libgomp's idle threads spin about 300,000 times before they sleep; two jobs whose OpenMP teams
# share cores then burn each other's time slices (docs/performance.md, GOMP_SPINCOUNT). A short
# spin changes no number. Jobs inherit it; a value already exported is kept.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")


def _stop(message):
    """End Snakemake with a configuration error's message alone, exit status 1 (a raised error
    would add the Snakefile lines it came from: docs/running.md)."""
    print(message, file=sys.stderr)
    sys.exit(1)


def _checked_config():
    """Validate ``config`` against the schema (filling defaults; one short message per error),
    resolve the training scales, then every check a schema cannot express (config_checks).
    Cluster jobs re-parsing the workflow skip the costly checks (the jobs check again)."""
    schema = REPO / "workflow" / "schemas" / "config.schema.yaml"
    try:
        validate(config, str(schema))
    except WorkflowError:
        message = config_checks.schema_error_message(config, yaml.safe_load(schema.read_text()), "workflow/schemas/config.schema.yaml")
        if message is None:
            raise
        _stop(message)
    try:
        config["training"]["scales"] = config_checks.resolve_scales(config["training"]["scales"])
        config_checks.check_config(config, main_process=workflow.is_main_process, cache_dir=CHECK_CACHE)
    except ConfigError as exc:
        _stop(str(exc))


_checked_config()
RESOURCES = config["resources_dir"]
VISION = config["vision"]
TEXT = config["text"]
TRAINING = config["training"]
FIGURE1 = config["figure1"]
FIGURE2 = config["figure2"]
FIGURE5 = config["figure5"]
ABLATION = config["token_ablation"]
N_IMAGES = VISION["n_images"]
TEXT_ROWS = TEXT["n_rows"]
ENV = "../../envs/pipeline.yaml"
REPORT_TABLES = paths.REPORT_TABLES
FASHION_MNIST = [f"{RESOURCES}/datasets/fashion-mnist/{f}" for f in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")]


wildcard_constraints:
    model=r"[A-Za-z0-9_.\-]+",
    variant="paper|corrected",
    n=r"\d+",
    shard=r"\d+of\d+",
    keyset="standardized|raw",
    slug=r"[A-Za-z0-9_.\-]+",
    sample=r"\d+|sentences",


def code_inputs(script):
    """The `code` input of the rules that run workflow/scripts/<script>: the library modules the
    script reaches through imports (kpca_repro.code_deps), so that changing one reruns exactly
    the jobs that use it (Snakemake tracks only the script file)."""
    return library_modules(REPO / "workflow" / "scripts" / script, REPO / "src" / "kpca_repro")


def ablation_runs():
    """(model, scale, tokens) of each token-ablation run; evaluated only when the table is requested."""
    try:
        return [(model, scale, scale_tokens(TRAINING["scales"][scale])) for model in ABLATION["models"] for scale in ABLATION["scales"]]
    except ValueError as exc:
        raise WorkflowError(f"config key token_ablation.scales: {exc} in one of {', '.join(ABLATION['scales'])} (training.scales)") from None


def reference_logs_input():
    """The authors' W&B logs folder of Figures 1 and 4 ([] when figure1.use_reference is false)."""
    return [FIGURE1["reference_logs"] or f"{RESOURCES}/training_logs"] if FIGURE1["use_reference"] else []


def image_source():
    """(directory, layout) of the images sampled for the vision analyses."""
    return config_checks.image_source(config)


def weights_path(model):
    return config_checks.weights_path(config, model)


# Output paths (kpca_repro.paths), bound to this run's configuration.
def heads_files(variant, model, ext="csv"):
    return paths.heads_files(config, variant, model, ext)


def spectra_files(variant, model, keys):
    return paths.spectra_files(config, variant, model, keys)


def text_stage_files(model_id, ext="h5", variant=None):
    return paths.text_stage_files(config, model_id, ext, variant)


def norm_activations(domain, variant, model):
    return paths.norm_activations(config, domain, variant, model)


def comparison_tables():
    return paths.comparison_tables(config)


def all_targets():
    return paths.all_targets(config)


def figure5_models(wildcards):
    """Path slugs of the Figure 5 models (figure5.models, else text.models)."""
    models = (FIGURE5["models"] if FIGURE5["models"] is not None else TEXT["models"]) + paths.user_models(config, "text")
    if not models:
        raise WorkflowError("config keys figure5.models / text.models: no language model configured for Figure 5")
    return [model_slug(m) for m in models]


# --------------------------------------------------------------------------------------
# Before the first job: what the scheduled jobs need (their input functions register it while
# Snakemake builds the DAG) and what it costs. kpca_repro.preflight, kpca_repro.cost.
# --------------------------------------------------------------------------------------

PREFLIGHT = Preflight(config, REPO / "config")
COSTS = CostTable()


def missing_input(kind):
    """The input function of the download rules, which exist only for missing inputs; it registers what its
    job fetches, so that the check before the first job names it if it cannot be fetched."""

    def register(wildcards):
        if workflow.is_main_process:
            PREFLIGHT.need(kind, wildcards.get("model"))
        return []

    return register


def vision_weights(wildcards):
    """Input function of extract_vision: the model's weights; prints the model's cost line."""
    model = wildcards.model
    if workflow.is_main_process:
        COSTS.add(model, lambda: vision_cost(model))
    return weights_path(wildcards.model)


def vision_cost(model):
    c = config_checks.check_vision_model(config, model, model, CHECK_CACHE)  # cached by the config check
    return model_cost(model, "vision", c.n_tokens, c.depth, c.n_heads, c.head_dim, N_IMAGES)


def text_model_source(wildcards):
    """A language model's directory (text.local_models) or hub id; a hub id is registered for the
    check before the first job (offline and not cached, it cannot run)."""
    model_id = model_id_from_slug(wildcards.slug)
    if model_id not in TEXT["local_models"] and workflow.is_main_process:
        PREFLIGHT.need("text_model", model_id)
    try:
        return model_source(model_id, TEXT["local_models"], config["offline"])
    except MissingModelError:
        return model_id


def text_model_files(wildcards):
    """Input function of extract_text: a local model's config.json and weights (a change reruns
    extraction), none for the hub; prints the model's cost line."""
    source = text_model_source(wildcards)
    model_id = model_id_from_slug(wildcards.slug)
    if workflow.is_main_process:
        COSTS.add(model_id, lambda: (shape := text_model_shape(source)) and model_cost(model_id, "text", TEXT["max_length"], *shape, TEXT_ROWS))
    if not os.path.isdir(source):
        return []
    return [str(p) for p in sorted(Path(source).iterdir()) if p.name in ("config.json", "model.safetensors", "pytorch_model.bin")]


def slurm_fit_check():
    """With the SLURM executor (profiles/slurm), stop before any submission when a cluster job's
    cpus_per_task, mem_mb or gpu fits on no node of its partition: SLURM would leave it PENDING
    forever (kpca_repro.slurm_preflight; KPCA_SLURM_PREFLIGHT=0 skips it)."""
    if workflow.executor_plugin is not None and workflow.executor_plugin.name == "slurm":
        from kpca_repro.slurm_preflight import check_jobs

        check_jobs(workflow.dag.needrun_jobs())
