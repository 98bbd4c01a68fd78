# Shared helpers: configuration checks, paths, wildcard constraints.
import os
from pathlib import Path

from snakemake.exceptions import WorkflowError

RESOURCES = config["resources_dir"]
VISION = config["vision"]
ENV = "../../envs/pipeline.yaml"
# Library modules each stage imports: listed as inputs so that changing them reruns the
# stage (Snakemake tracks only the script file itself).
LIB = Path(workflow.basedir) / "src" / "kpca_repro"
LIB_EXTRACT = [str(LIB / m) for m in ("records.py", "vision.py", "images.py", "h5io.py", "resources.py", "smk.py")]
LIB_KPCA = [str(LIB / m) for m in ("records.py", "kpca.py", "h5io.py", "smk.py")]
LIB_TABLES = [str(LIB / m) for m in ("tables.py", "h5io.py", "smk.py")]
LIB_SPECTRA = [str(LIB / m) for m in ("kpca.py", "records.py", "h5io.py", "smk.py")]
LIB_FIGURES = [str(LIB / m) for m in ("figures.py", "smk.py")]
LIB_TRAINING = [str(LIB / m) for m in ("training.py", "kpca.py", "h5io.py", "vision.py", "smk.py")]
LIB_TRAINING_FIGURES = [str(LIB / m) for m in ("training.py", "figures.py", "h5io.py", "smk.py")]
TRAINING = config["training"]
FIGURE1 = config["figure1"]
FASHION_MNIST = [
    f"{RESOURCES}/datasets/fashion-mnist/{f}"
    for f in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
]


wildcard_constraints:
    model=r"[A-Za-z0-9_.\-]+",
    variant="paper|corrected",
    n=r"\d+",
    shard=r"\d+of\d+",
    keyset="standardized|raw",


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
        if key not in VISION["models"]:
            if key != config["figure3"]["model"]:
                raise WorkflowError(f"config keys vision.model_kwargs / checksums: {key!r} is not in vision.models or figure3.model")
    for key, n in (("vision.n_images", VISION["n_images"]), ("spectra.n_images", config["spectra"]["n_images"])):
        if VISION["shards"] > n:
            raise WorkflowError(f"config key vision.shards: {VISION['shards']} shards for {n} images ({key}); use at most one shard per image")
    root = VISION["imagenet_val_dir"]
    if root is not None:
        if not os.path.isdir(root):
            raise WorkflowError(f"config key vision.imagenet_val_dir: {root} is not a directory")
        if not any(e.is_dir() for e in os.scandir(root)):
            raise WorkflowError(
                f"config key vision.imagenet_val_dir: {root} has no class folders; expected <dir>/<wnid>/*.JPEG (the ImageNet validation set sorted into class folders)"
            )
    _check_training_config()


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


_check_config()


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
    if FIGURE1["runs"] or FIGURE1["use_reference"]:
        targets += ["results/figure1.pdf", "results/figure4.pdf"]
    return targets
