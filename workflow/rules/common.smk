# Shared helpers: configuration checks, paths, wildcard constraints.
import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

SCHEMA = Path(workflow.basedir) / "workflow" / "schemas" / "config.schema.yaml"


def _stop_on_error(check):
    """Run a parse-time check; a WorkflowError ends Snakemake with its message alone, exit
    status 1 (raised, Snakemake would add the Snakefile lines it came from)."""
    try:
        check()
    except WorkflowError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)


def _validate_config():
    """Validate ``config`` against the schema (filling defaults); one short message per error.

    Snakemake's own message dumps the whole sub-schema; this one names the key (dotted
    path), what is wrong, the closest allowed key for a misspelling, and what to do.
    """
    import difflib

    import jsonschema
    import yaml

    try:
        validate(config, str(SCHEMA))
    except WorkflowError:
        # Snakemake's error keeps only text: find the error again with plain jsonschema.
        # Defaults are filled only partly when validation stops, so "required" errors are
        # reported only when there is nothing else.
        schema = yaml.safe_load(SCHEMA.read_text())
        errors = list(jsonschema.Draft202012Validator(schema).iter_errors(config))
        errors = [e for e in errors if e.validator != "required"] or errors
        if not errors:
            raise
        err = min(errors, key=lambda e: len(e.absolute_path))
        where = ".".join(str(p) for p in err.absolute_path)
        if err.validator == "additionalProperties":
            allowed = list(err.schema.get("properties", {}))
            unknown = sorted(set(err.instance) - set(allowed))
            prefix = f"{where}." if where else ""
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                hints.append(f"{prefix}{key}{hint}")
            what = f"unknown config key {', '.join(hints)}; allowed here: {', '.join(allowed)}"
        else:
            what = f"config key {where or '(top level)'}: {err.message}"
        raise WorkflowError(f"{what}. Fix it in your --configfile / --config; every key, type and range is in {SCHEMA.relative_to(workflow.basedir)}.") from None


_stop_on_error(_validate_config)

# The repository's own library (paths, slugs, model sources) for the workflow itself.
sys.path.insert(0, str(Path(workflow.basedir) / "src"))
from kpca_repro.code_deps import library_modules
from kpca_repro.text import LOCAL_MODELS_KEY, MissingModelError, model_id_from_slug, model_slug, model_source, resolve_local_dir

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
REPORT_TABLES = [f"table{t}{sfx}" for sfx in ("", "_corrected") for t in (1, 2, 3, 4)] + ["paper_comparison"]
TRAINING = config["training"]
FIGURE1 = config["figure1"]
FASHION_MNIST = [f"{RESOURCES}/datasets/fashion-mnist/{f}" for f in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")]


wildcard_constraints:
    model=r"[A-Za-z0-9_.\-]+",
    variant="paper|corrected",
    n=r"\d+",
    shard=r"\d+of\d+",
    keyset="standardized|raw",
    slug=r"[A-Za-z0-9_.\-]+",
    sample=r"\d+|sentences",


def _check_config():
    """Checks a JSON schema cannot express; raise before any job runs."""
    import timm

    for i, model in enumerate(VISION["models"]):
        if not timm.is_model(model):
            raise WorkflowError(f"config key vision.models[{i}]: {model!r} is not a timm model id " f"(see timm.list_models()); the paper's ids are listed in config/config.yaml")
    if not timm.is_model(config["figure3"]["model"]):
        raise WorkflowError(f"config key figure3.model: {config['figure3']['model']!r} is not a timm model id")
    _check_figure3_block()
    _check_vision_models()
    for key in [*VISION["model_kwargs"], *config["checksums"]]:
        if key not in VISION["models"] and key not in TEXT["models"]:
            if key != config["figure3"]["model"]:
                raise WorkflowError(f"config keys vision.model_kwargs / checksums: {key!r} is not in vision.models, text.models or figure3.model")
    for key, n in (("vision.n_images", VISION["n_images"]), ("spectra.n_images", config["spectra"]["n_images"])):
        if VISION["shards"] > n:
            raise WorkflowError(f"config key vision.shards: {VISION['shards']} shards for {n} images ({key}); use at most one shard per image")
    published = config["comparison"]["published_tables"]
    if published is not None and not os.path.isdir(published):
        raise WorkflowError(
            f"config key comparison.published_tables: {published} is not a directory; point it at the paper's "
            "published tables as CSV (for example ../shared/reference/paper_tables) or set it to null"
        )
    if TEXT["shards"] > TEXT["n_rows"]:
        raise WorkflowError(f"config key text.shards: {TEXT['shards']} shards for {TEXT['n_rows']} rows (text.n_rows); use at most one shard per row")
    for model_id, spec in TEXT["local_models"].items():
        if model_id in TEXT["models"]:
            try:
                resolve_local_dir(spec)
            except MissingModelError as exc:
                raise WorkflowError(f"config key {LOCAL_MODELS_KEY}[{model_id}]: {exc}") from None
    _check_text_models()
    root = VISION["imagenet_val_dir"]
    if root is not None:
        if not os.path.isdir(root):
            raise WorkflowError(f"config key vision.imagenet_val_dir: {root} is not a directory")
        if not any(e.is_dir() for e in os.scandir(root)):
            raise WorkflowError(f"config key vision.imagenet_val_dir: {root} has no class folders; expected <dir>/<wnid>/*.JPEG (the ImageNet validation set sorted into class folders)")
    _check_image_counts()
    _check_weights_checksums()
    _check_training_config()


def _check_text_models():
    """Every text.models entry has an attention the capture supports, read from its config.json
    alone (local directory or Hugging Face cache; no weights). Main Snakemake process only."""
    if not TEXT["models"] or not workflow.is_main_process:
        return
    from kpca_repro.hf_capture import check_text_model
    from kpca_repro.vision import UnsupportedArchitectureError

    for i, model_id in enumerate(TEXT["models"]):
        try:
            source = model_source(model_id, TEXT["local_models"], config["offline"])
        except MissingModelError:
            continue  # reported by the extract_text input function when a target needs the model
        try:
            check_text_model(model_id, source)
        except UnsupportedArchitectureError as exc:
            raise WorkflowError(f"config key text.models[{i}]: {exc}") from None


def _check_vision_model(key, model):
    """Build ``model`` on the meta device and check that the capture supports it (kpca_repro.vision.check_vision_model)."""
    from kpca_repro.vision import ModelBuildError, UnsupportedArchitectureError, check_vision_model

    try:
        return check_vision_model(model, VISION["model_kwargs"].get(model, {}))
    except (UnsupportedArchitectureError, ModelBuildError) as exc:
        raise WorkflowError(f"config key {key}: {exc}") from None


def _check_figure3_block():
    """figure3.model is supported and figure3.block is one of its blocks (depth from the meta device: no weights, no memory)."""
    model, block = config["figure3"]["model"], config["figure3"]["block"]
    depth = _check_vision_model("figure3.model", model).depth
    if block >= depth:
        raise WorkflowError(f"config key figure3.block: {block} is out of range for {model}, which has {depth} blocks (0 to {depth - 1})")


def _check_vision_models():
    """Every vision.models entry is supported by the capture; main Snakemake process only
    (cluster jobs re-parse the workflow and skip it; extract_vision checks again)."""
    if not workflow.is_main_process:
        return
    for i, model in enumerate(VISION["models"]):
        _check_vision_model(f"vision.models[{i}]", model)


def run_model_scale(run):
    """``"<model>_<scale>"`` (a figure1.runs entry) -> (model, scale)."""
    model, _, scale = run.rpartition("_")
    return model, scale


def _check_training_config():
    """Figure 1/4 runs name configured models and scales; the paper scale needs ImageNet."""
    import timm

    for i, run in enumerate(FIGURE1["runs"]):
        model, scale = run_model_scale(run)
        if model not in TRAINING["models"] or scale not in TRAINING["scales"]:
            raise WorkflowError(
                f"config key figure1.runs[{i}]: {run!r} is not <model>_<scale> with a model of training.models "
                f"({', '.join(TRAINING['models'])}) and a scale of training.scales ({', '.join(TRAINING['scales'])})"
            )
        sc = TRAINING["scales"][scale]
        if sc["dataset"] == "imagenet":
            root = sc["imagenet_root"]
            if root is None or not all(os.path.isdir(os.path.join(root, s)) for s in ("train", "val")):
                raise WorkflowError(f"config key training.scales.{scale}.imagenet_root: {root} must hold train/ and val/ class folders (ImageNet-1k) for run {run}")
        if sc["img_size"] % sc["patch_size"]:
            raise WorkflowError(f"config key training.scales.{scale}.patch_size: {sc['patch_size']} does not divide img_size {sc['img_size']}")
    for name, m in TRAINING["models"].items():
        if not timm.is_model(m["timm_id"]):
            raise WorkflowError(f"config key training.models.{name}.timm_id: {m['timm_id']!r} is not a timm model id")
    ref = FIGURE1["reference_logs"]
    if FIGURE1["use_reference"] and ref is not None and not os.path.isdir(ref):
        raise WorkflowError(f"config key figure1.reference_logs: {ref} is not a directory (the authors' W&B CSV exports)")


def _check_image_counts():
    """Every configured image count fits the image set (when it exists; offline, a missing
    set is reported by the download rule's guard). Main Snakemake process only."""
    from kpca_repro.images import list_images

    root, layout = image_source()
    if not workflow.is_main_process or not os.path.isdir(root):
        return
    available = len(list_images(root, layout))
    for key, n in (("vision.n_images", VISION["n_images"]), ("spectra.n_images", config["spectra"]["n_images"]), ("figure3.n_images", config["figure3"]["n_images"])):
        if n > available:
            raise WorkflowError(f"config key {key}: {n} images requested, but {root} holds {available}; " f"lower {key} or set vision.imagenet_val_dir to a larger image set")


_SHA256 = {}


def _check_weights_checksums():
    """The weights of every configured model that has an entry in ``checksums`` and exists
    must have that SHA-256; checked once per file in the main Snakemake process (cluster
    jobs re-parse the workflow and skip it; extract_vision checks again before use)."""
    from kpca_repro.resources import ChecksumMismatchError, check_checksum

    if not workflow.is_main_process:
        return
    for model in dict.fromkeys([*VISION["models"], config["figure3"]["model"]]):
        expected = config["checksums"].get(model)
        path = weights_path(model)
        if not expected or path in _SHA256 or not os.path.exists(path):
            continue
        try:
            _SHA256[path] = check_checksum(path, expected)
        except ChecksumMismatchError as exc:
            raise WorkflowError(f"config key checksums.{model}: {exc}") from None


def reference_logs_input():
    """The authors' W&B logs folder of Figures 1 and 4 ([] when figure1.use_reference is false)."""
    if not FIGURE1["use_reference"]:
        return []
    return [FIGURE1["reference_logs"] or f"{RESOURCES}/training_logs"]


SHARDS = [f"{i}of{VISION['shards']}" for i in range(VISION["shards"])]
N_IMAGES = VISION["n_images"]


def image_source():
    """(directory, layout) of the images sampled for the vision analyses."""
    if VISION["imagenet_val_dir"] is not None:
        return VISION["imagenet_val_dir"], "imagefolder"
    return f"{RESOURCES}/images/imagenet-sample", "flat"


def weights_path(model):
    return f"{RESOURCES}/weights/timm/{model}.safetensors"


def heads_files(variant, model, ext="csv"):
    """Per-head records (ext csv) or their metadata (ext json) of one model, all shards."""
    return expand(
        f"results/heads/{{variant}}/{{model}}/vision_{{n}}_{{shard}}.{ext}",
        variant=variant,
        model=model,
        n=N_IMAGES,
        shard=SHARDS,
    )


def spectra_files(variant, model, keys):
    """Per-head eigenvalue records of one model for Tables 2 and 3, all shards."""
    return expand(
        "results/spectra/{variant}/{model}/vision_{n}_{shard}_{keyset}.csv",
        variant=variant,
        model=model,
        n=config["spectra"]["n_images"],
        shard=SHARDS,
        keyset=keys,
    )


def text_stage_files(model_id, ext="h5", variant=None):
    """Activation files (ext h5) or per-head records (ext csv/json, with variant) of one language model on the Table 4 sample, all shards."""
    stem = f"text_{TEXT['n_rows']}_{{shard}}.{ext}"
    prefix = "results/activations" if ext == "h5" else f"results/heads/{variant}"
    return expand(f"{prefix}/{model_slug(model_id)}/{stem}", shard=[f"{i}of{TEXT['shards']}" for i in range(TEXT["shards"])])


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


def comparison_tables():
    """Table number -> (paper-variant CSV, corrected CSV or None) for the tables this run builds."""
    out = {"1": "results/table1.csv", "2": "results/table2.csv", "3": "results/table3.csv"}
    if TEXT["models"]:
        out["4"] = "results/table4.csv"
    corrected = "corrected" in config["variants"]
    return {t: (p, p.replace(".csv", "_corrected.csv") if corrected else None) for t, p in out.items()}


def all_targets():
    """Every table and figure the configuration asks for, then their HTML and the comparison."""
    suffixes = {"paper": "", "corrected": "_corrected"}
    targets = []
    if FIGURE1["runs"] or FIGURE1["use_reference"]:  # training curves: no variants
        targets += ["results/figure1.pdf", "results/figure4.pdf"]
    for variant in config["variants"]:
        sfx = suffixes[variant]
        targets += [f"results/table{t}{sfx}.csv" for t in (1, 2, 3)] + [f"results/table1{sfx}.md"]
        targets += [f"results/figure{f}{sfx}.pdf" for f in (2, 3)]
        if TEXT["models"]:  # text.models: [] (a vision-only configuration) leaves Table 4 and Figure 5 out
            targets += [f"results/table4{sfx}.csv", f"results/table4{sfx}.md", f"results/figure5{sfx}.pdf"]
    # the tables as HTML for `snakemake --report`; last, the comparison with the paper
    built = [t for t in REPORT_TABLES if f"results/{t}.csv" in targets]
    targets += [f"results/html/{t}.html" for t in built + ["paper_comparison"]]
    targets += ["results/paper_comparison.csv"]
    return targets


# --------------------------------------------------------------------------------------
# Figures 2 and 5 (norms.smk): squared norms, vision and language models
# --------------------------------------------------------------------------------------

FIGURE2 = config["figure2"]
FIGURE5 = config["figure5"]
FIGURE5_MODELS = FIGURE5["models"] if FIGURE5["models"] is not None else list(TEXT["models"])
TEXT_ROWS = TEXT["n_rows"]
TEXT_SHARDS = [f"{i}of{TEXT['shards']}" for i in range(TEXT["shards"])]


def _check_norms_config():
    """Checks of figure2 / figure5 a JSON schema cannot express; raise before any job runs."""
    if FIGURE5["models"] is not None:
        for i, model in enumerate(FIGURE5["models"]):
            if model not in TEXT["models"]:
                raise WorkflowError(f"config key figure5.models[{i}]: {model!r} is not in text.models (its extraction is configured there)")


_stop_on_error(_check_norms_config)


def norm_activations(domain, variant, model):
    """Activation files behind one model's squared-norm statistics (norms.smk header)."""
    if domain == "vision":
        if variant == "paper":
            return [f"results/activations/{model}/vision_{FIGURE2['n_images']}_0of1.h5"]
        return expand("results/activations/{model}/vision_{n}_{shard}.h5", model=model, n=N_IMAGES, shard=SHARDS)
    if variant == "paper":
        return [f"results/activations/{model}/text_sentences_0of1.h5"]
    return expand("results/activations/{model}/text_{n}_{shard}.h5", model=model, n=TEXT_ROWS, shard=TEXT_SHARDS)


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
        c = _check_vision_model(model, model)  # cached: built on the meta device by _check_config
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
