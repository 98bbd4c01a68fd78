# Shared helpers: configuration checks, paths, wildcard constraints.
import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

# The repository's own library (paths, slugs, model sources) for the workflow itself.
sys.path.insert(0, str(Path(workflow.basedir) / "src"))
from kpca_repro.text import LOCAL_MODELS_KEY, MissingModelError, model_id_from_slug, model_slug, model_source, resolve_local_dir

RESOURCES = config["resources_dir"]
VISION = config["vision"]
TEXT = config["text"]
ENV = "../../envs/pipeline.yaml"
# Library modules each stage imports: listed as inputs so that changing them reruns the
# stage (Snakemake tracks only the script file itself).
LIB = Path(workflow.basedir) / "src" / "kpca_repro"
LIB_EXTRACT = [str(LIB / m) for m in ("records.py", "vision.py", "images.py", "h5io.py", "resources.py", "smk.py")]
LIB_KPCA = [str(LIB / m) for m in ("records.py", "kpca.py", "h5io.py", "smk.py")]
LIB_TABLES = [str(LIB / m) for m in ("tables.py", "h5io.py", "smk.py")]
LIB_SPECTRA = [str(LIB / m) for m in ("kpca.py", "records.py", "h5io.py", "smk.py")]
LIB_FIGURES = [str(LIB / m) for m in ("figures.py", "smk.py")]
LIB_SAMPLE_TEXT = [str(LIB / m) for m in ("text.py", "images.py", "h5io.py", "smk.py")]
LIB_EXTRACT_TEXT = [str(LIB / m) for m in ("text.py", "vision.py", "images.py", "h5io.py", "resources.py", "smk.py")]
LIB_KPCA_TEXT = LIB_KPCA + [str(LIB / "text.py")]


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
            raise WorkflowError(
                f"config key vision.models[{i}]: {model!r} is not a timm model id "
                f"(see timm.list_models()); the paper's ids are listed in config/config.yaml"
            )
    if not timm.is_model(config["figure3"]["model"]):
        raise WorkflowError(f"config key figure3.model: {config['figure3']['model']!r} is not a timm model id")
    for key in [*VISION["model_kwargs"], *config["checksums"]]:
        if key not in VISION["models"] and key not in TEXT["models"]:
            if key != config["figure3"]["model"]:
                raise WorkflowError(f"config keys vision.model_kwargs / checksums: {key!r} is not in vision.models, text.models or figure3.model")
    for key, n in (("vision.n_images", VISION["n_images"]), ("spectra.n_images", config["spectra"]["n_images"])):
        if VISION["shards"] > n:
            raise WorkflowError(f"config key vision.shards: {VISION['shards']} shards for {n} images ({key}); use at most one shard per image")
    if TEXT["shards"] > TEXT["n_rows"]:
        raise WorkflowError(f"config key text.shards: {TEXT['shards']} shards for {TEXT['n_rows']} rows (text.n_rows); use at most one shard per row")
    for model_id, spec in TEXT["local_models"].items():
        if model_id in TEXT["models"]:
            try:
                resolve_local_dir(spec)
            except MissingModelError as exc:
                raise WorkflowError(f"config key {LOCAL_MODELS_KEY}[{model_id}]: {exc}") from None
    root = VISION["imagenet_val_dir"]
    if root is not None:
        if not os.path.isdir(root):
            raise WorkflowError(f"config key vision.imagenet_val_dir: {root} is not a directory")
        if not any(e.is_dir() for e in os.scandir(root)):
            raise WorkflowError(
                f"config key vision.imagenet_val_dir: {root} has no class folders; expected <dir>/<wnid>/*.JPEG (the ImageNet validation set sorted into class folders)"
            )


_check_config()

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


def all_targets():
    targets = []
    if "paper" in config["variants"]:
        targets += ["results/table1.csv", "results/table1.md", "results/table2.csv", "results/table3.csv", "results/figure3.pdf"]
    if "corrected" in config["variants"]:
        targets += ["results/table1_corrected.csv", "results/table1_corrected.md", "results/table2_corrected.csv", "results/table3_corrected.csv", "results/figure3_corrected.pdf"]
    if TEXT["models"]:  # text.models: [] (a vision-only configuration) leaves Table 4 out
        targets += [f"results/table4{suffix}.{ext}" for suffix, v in (("", "paper"), ("_corrected", "corrected")) if v in config["variants"] for ext in ("csv", "md")]
    return targets
