# Shared helpers: configuration checks, paths, wildcard constraints.
import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

SCHEMA = Path(workflow.basedir) / "workflow" / "schemas" / "config.schema.yaml"

# libgomp's idle threads spin about 300,000 times before they sleep. Two jobs whose OpenMP
# teams (the paper variant's eigh on kpca.eigh_threads threads, the forward passes) share
# cores then burn each other's time slices spinning, and each runs many times slower
# (docs/performance.md, GOMP_SPINCOUNT). A short spin changes no number, only how threads
# wait, and in a job alone it costs nothing measurable. Jobs inherit it; a value already
# exported is kept.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")


def _stop_on_error(check):
    """Run a parse-time check; a WorkflowError ends Snakemake with its message alone, exit
    status 1 (raised, Snakemake would add the Snakefile lines it came from)."""
    try:
        check()
    except WorkflowError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)


def _validate_config():
    """Validate ``config`` against the schema (filling defaults); one short message per error
    (kpca_repro.config_checks.schema_error_message)."""
    import yaml

    try:
        validate(config, str(SCHEMA))
    except WorkflowError:
        sys.path.insert(0, str(Path(workflow.basedir) / "src"))
        from kpca_repro.config_checks import schema_error_message

        message = schema_error_message(config, yaml.safe_load(SCHEMA.read_text()), str(SCHEMA.relative_to(workflow.basedir)))
        if message is None:
            raise
        raise WorkflowError(message) from None


_stop_on_error(_validate_config)

# The repository's own library (paths, slugs, model sources) for the workflow itself.
sys.path.insert(0, str(Path(workflow.basedir) / "src"))
from kpca_repro import config_checks, paths
from kpca_repro.check_cache import WORKFLOW_CACHE_DIR
from kpca_repro.code_deps import library_modules
from kpca_repro.config_checks import ConfigError, check_config, run_model_scale
from kpca_repro.model_info import MissingModelError, model_source
from kpca_repro.paths import model_id_from_slug, model_slug
from kpca_repro.training_summary import scale_setting, scale_tokens


def _resolve_scales():
    """Training scales written as overrides of a `base` scale get every key, before any use."""
    try:
        config["training"]["scales"] = config_checks.resolve_scales(config["training"]["scales"])
    except ConfigError as exc:
        raise WorkflowError(str(exc)) from None


_stop_on_error(_resolve_scales)
RESOURCES = config["resources_dir"]
VISION = config["vision"]
TEXT = config["text"]
ENV = "../../envs/pipeline.yaml"
# Library modules each rule's script imports, transitively (kpca_repro.code_deps, read from
# the source without importing it): listed as the rule's `code` input so that changing a
# module reruns exactly the jobs whose scripts use it (Snakemake tracks only the script file).
LIB = Path(workflow.basedir) / "src" / "kpca_repro"


def code_inputs(script):
    """The `code` input of the rules that run workflow/scripts/<script>."""
    return library_modules(Path(workflow.basedir) / "workflow" / "scripts" / script, LIB)


# Result tables rendered as HTML for `snakemake --report` (caption: workflow/report/tables.rst).
REPORT_TABLES = paths.REPORT_TABLES
TRAINING = config["training"]
FIGURE1 = config["figure1"]
ABLATION = config["token_ablation"]
FASHION_MNIST = [f"{RESOURCES}/datasets/fashion-mnist/{f}" for f in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")]


wildcard_constraints:
    model=r"[A-Za-z0-9_.\-]+",
    variant="paper|corrected",
    n=r"\d+",
    shard=r"\d+of\d+",
    keyset="standardized|raw",
    slug=r"[A-Za-z0-9_.\-]+",
    sample=r"\d+|sentences",


# Passed model checks, kept between runs (kpca_repro.check_cache): a repeated command imports
# no torch, timm or transformers while parsing. Safe to delete.
CHECK_CACHE = WORKFLOW_CACHE_DIR


def _check_config():
    """Checks a JSON schema cannot express (kpca_repro.config_checks); raise before any job runs.
    Cluster jobs re-parse the workflow and skip the costly ones (the jobs check again)."""
    try:
        check_config(config, main_process=workflow.is_main_process, cache_dir=CHECK_CACHE)
    except ConfigError as exc:
        raise WorkflowError(str(exc)) from None


def ablation_runs():
    """(model, scale, tokens) of each token-ablation run; evaluated only when the table is
    requested, so a configuration that shrinks the images of `small` still builds the rest."""
    try:
        return [(model, scale, scale_tokens(TRAINING["scales"][scale])) for model in ABLATION["models"] for scale in ABLATION["scales"]]
    except ValueError as exc:
        raise WorkflowError(f"config key token_ablation.scales: {exc} in one of {', '.join(ABLATION['scales'])} (training.scales)") from None


def reference_logs_input():
    """The authors' W&B logs folder of Figures 1 and 4 ([] when figure1.use_reference is false)."""
    if not FIGURE1["use_reference"]:
        return []
    return [FIGURE1["reference_logs"] or f"{RESOURCES}/training_logs"]


SHARDS = paths.vision_shards(config)
N_IMAGES = VISION["n_images"]


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


def text_model_source(wildcards):
    """A language model's directory (text.local_models) or hub id; offline and unavailable, stop the DAG naming the key."""
    try:
        return model_source(model_id_from_slug(wildcards.slug), TEXT["local_models"], config["offline"])
    except MissingModelError as exc:
        raise WorkflowError(str(exc)) from None


def text_model_files(wildcards):
    """Input files of a local language model (config.json and weights, so a change reruns extraction); none for the hub."""
    source = text_model_source(wildcards)
    if not os.path.isdir(source):
        return []
    return [str(p) for p in sorted(Path(source).iterdir()) if p.name in ("config.json", "model.safetensors", "pytorch_model.bin")]


def offline_guard(path, what, how):
    """Input function for download rules: offline, a missing input stops DAG construction."""

    def guard(wildcards):
        target = path.format(**wildcards)
        if config["offline"]:
            raise WorkflowError(f"missing {what}: {target} does not exist (offline: true). {how}")
        return []

    return guard


# --------------------------------------------------------------------------------------
# Figures 2 and 5 (norms.smk): squared norms, vision and language models
# --------------------------------------------------------------------------------------

FIGURE2 = config["figure2"]
FIGURE5 = config["figure5"]
FIGURE5_MODELS = FIGURE5["models"] if FIGURE5["models"] is not None else list(TEXT["models"])
TEXT_ROWS = TEXT["n_rows"]
TEXT_SHARDS = paths.text_shards(config)


def figure5_models(wildcards):
    """Path slugs of the Figure 5 models (figure5.models, else text.models)."""
    if not FIGURE5_MODELS:
        raise WorkflowError("config keys figure5.models / text.models: no language model configured for Figure 5")
    return [model_slug(m) for m in FIGURE5_MODELS]


def _requested_targets():
    """The targets of this run ([] = the default target), or None when not known at parse time."""
    from kpca_repro.preflight import targets_from_argv

    if workflow.dag_settings is not None:
        return sorted(workflow.dag_settings.targets)
    return targets_from_argv(sys.argv)


def _check_inputs(targets):
    """Every external input of the requested targets is present or can be downloaded; else one
    block (each missing path, how to provide it, the offline configuration) before any job.
    Main Snakemake process only; the logic is kpca_repro.preflight."""
    from kpca_repro.preflight import MissingInputsError, allowed_rules_from_argv, check_inputs, needs, offline_alternatives

    alternatives = offline_alternatives(needs(targets, config), Path(workflow.basedir) / "config", os.getcwd())
    if workflow.dag_settings is not None:
        allowed = set(workflow.dag_settings.allowed_rules) or None
    else:
        allowed = allowed_rules_from_argv(sys.argv)
    try:
        check_inputs(config, targets, alternatives, allowed_rules=allowed)
    except MissingInputsError as exc:
        # the block alone: a WorkflowError would add the Snakefile lines it was raised from
        print(exc, file=sys.stderr)
        sys.exit(1)


def _report_cost(targets):
    """Print N, heads, eigh work and activation storage per model the targets need, with a
    warning for a model far beyond the paper's largest (kpca_repro.cost); dry runs too."""
    from kpca_repro.cost import cost_report, model_cost, text_model_shape
    from kpca_repro.preflight import needs

    groups = needs(targets, config)
    models = list(VISION["models"]) if "vision" in groups else []
    if "figure3" in groups:
        models.append(config["figure3"]["model"])
    models += [g[len("model:") :] for g in groups if g.startswith("model:") and g[len("model:") :] in VISION["models"]]
    costs = []
    for model in dict.fromkeys(models):
        c = config_checks.check_vision_model(config, model, model, CHECK_CACHE)  # cached by _check_config
        costs.append(model_cost(model, "vision", c.n_tokens, c.depth, c.n_heads, c.head_dim, VISION["n_images"]))
    text_models = list(TEXT["models"]) if groups & {"text", "figure5"} else []
    for model_id in text_models:
        try:
            shape = text_model_shape(model_source(model_id, TEXT["local_models"], config["offline"]))
        except MissingModelError:
            shape = None
        if shape is not None:
            costs.append(model_cost(model_id, "text", TEXT["max_length"], *shape, TEXT["n_rows"]))
    if costs:
        table, warnings = cost_report(costs)
        print("\n".join([table, *warnings]), file=sys.stderr)


_stop_on_error(_check_config)
if workflow.is_main_process:
    _TARGETS = _requested_targets()
    if _TARGETS is not None:  # not a snakemake command line: the download rules' guards still check
        _check_inputs(_TARGETS)
        _report_cost(_TARGETS)
