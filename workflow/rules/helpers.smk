# Values and input/params functions shared by several rule files. Only functions here, as
# Snakemake's linter asks for rules and functions in separate files. Included right after common.smk,
# whose configuration checks and path helpers they use.

from kpca_repro.method.variant import from_suffix as variant_from_suffix
from kpca_repro.method.variant import get as get_variant
from kpca_repro.method.variant import suffix_pattern

# `resources: gpu=GPU` of the rules that run on config["device"]: one GPU for "cuda..." and for "auto"
# where this machine has one (kpca_repro.threads.cuda_available, cached), none for "cpu" or "auto"
# without a GPU, so that jobs of several models then run side by side up to --cores. On a cluster
# whose submitting node has no GPU, set device: cuda (docs/scaleout.md).
GPU = gpu_resource(config["device"], CHECK_CACHE)
# The `{suffix}` wildcard of the user-facing outputs (results/table1{suffix}.csv): every
# variant's suffix, from kpca_repro.method.variant ("" paper, "_corrected" corrected).
SUFFIXES = suffix_pattern()


def variant_of(wildcards):
    """The variant name a `{suffix}` wildcard names (kpca_repro.method.variant: "" paper, "_corrected" corrected)."""
    return variant_from_suffix(wildcards.suffix).name


def paper_uncertainty(wildcards):
    """`params.uncertainty` of a table rule: the interval settings (docs/uncertainty.md), for a variant with sign draws (paper)."""
    return {"seed": config["seed"], **config["uncertainty"]} if variant_from_suffix(wildcards.suffix).sign_draws else None


def table_inputs(records):
    """Input function (for `unpack`) of rules table1 and table4.

    records(variant, ext) lists the per-head records files of every model of the table
    (ext "csv": the records, "json": their metadata). The paper variant also reads the sign
    draws stored next to each records file (`<records>_signs.h5`, docs/uncertainty.md).
    """

    def inputs(wildcards):
        variant = variant_of(wildcards)
        files = {"heads": records(variant, "csv"), "meta": records(variant, "json")}
        if get_variant(variant).sign_draws:
            files["signs"] = [f.replace(".csv", "_signs.h5") for f in files["heads"]]
        return files

    return inputs


def norm_stats(domain, models):
    """Input function of rules figure2 (domain "vision") and figure5 ("text"): the norm
    statistics of the variant's models; models(wildcards) gives the model list."""
    return lambda wc: expand(f"results/norms/{{variant}}/{{model}}/{domain}.csv", variant=variant_of(wc), model=models(wc))


def norm_figure_labels(figure):
    """`labels` of a norm figure's PNG in the report."""
    return lambda wc: {"figure": figure, "variant": variant_of(wc)}


def norm_band_label(wildcards):
    """Legend of the band of rules figure2 and figure5: the corrected variant's central 95 %, the paper's IQR after the trim."""
    return "2.5-97.5th percentile (central 95 %)" if wildcards.suffix else "25-75th percentile after trim"


def needs_models(kind, what):
    """Input function (no files) of the rules that aggregate the models of one kind: asked for while
    no model of `kind` ("vision": vision.models and activations: of kind vision; "text": text.models and
    activations: of kind text) is configured, `what` stops the run in one line before any job."""

    def check(wildcards):
        if not (has_vision(config) if kind == "vision" else bool(TEXT["models"] or user_models(config, "text"))):
            keys = "vision.models" if kind == "vision" else "text.models"
            sys.exit(f"{what} needs a {kind} model, but {keys} is empty and activations: has no entry of kind {kind}; add one, or leave {what} out of the targets")
        return []

    return check
