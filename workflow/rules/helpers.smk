# Values and input/params functions of the rule files, several of them shared. Only functions here, as
# Snakemake's linter asks for rules and functions in separate files. Included right after common.smk,
# whose configuration checks and path helpers they use.

from snakemake.exceptions import WorkflowError

from kpca_repro.analysis.tables import TABLES
from kpca_repro.method.variant import from_suffix as variant_from_suffix
from kpca_repro.method.variant import get as get_variant
from kpca_repro.method.variant import suffix_pattern

# `resources: gpu=GPU` of the rules that run on config["device"]: one GPU for "cuda..." and for "auto"
# where this machine shows an NVIDIA GPU (kpca_repro.threads.nvidia_gpu_visible, without torch), none for
# "cpu" or "auto" without a GPU, so that jobs of several models then run side by side up to --cores. On a
# cluster whose submitting node has no GPU, set device: cuda (docs/scaleout.md).
GPU = gpu_resource(config["device"])


def job_threads(wildcards):
    """`threads:` of the extraction, KPCA, eigenvalue, norm and gamma jobs: every core Snakemake has
    (`--cores`), or at most `kpca.threads` where that is a number. The jobs use what they get (the
    KPCA jobs one worker thread per core, docs/performance.md#thread-budgets); no number depends on it.
    Without a total (a cluster profile's `jobs:` and no `--cores`) each job takes the cap, or one core
    for `all`: the cluster profile sets the threads per rule (profiles/slurm, set-threads)."""
    cap = config["kpca"]["threads"]
    try:
        cores = workflow.cores
    except WorkflowError:  # no --cores: Snakemake asks for it before any job may take a share of it
        return 1 if cap == "all" else cap
    return cores if cap == "all" else min(cap, cores)


# The `{suffix}` wildcard of the user-facing outputs (results/table1{suffix}.csv): every
# variant's suffix, from kpca_repro.method.variant ("" paper, "_corrected" corrected).
SUFFIXES = suffix_pattern()


def variant_of(wildcards):
    """The variant name a `{suffix}` wildcard names (kpca_repro.method.variant: "" paper, "_corrected" corrected)."""
    return variant_from_suffix(wildcards.suffix).name


def sign_draws_of(wildcards):
    """`params.sign_draws` of rule kpca_heads, per head of the `{variant}` wildcard's variant
    (sign draws, matched-cosine draws, matched-cosine draws of language-model heads), the config's
    uncertainty counts for a variant with sign draws (paper), (0, 0, 0) for one without (corrected;
    docs/uncertainty.md)."""
    if get_variant(wildcards.variant).sign_draws:
        unc = config["uncertainty"]
        return (unc["sign_draws"], unc["sign_draws_optimal"], unc["sign_draws_optimal_text"])
    return (0, 0, 0)


def table_files(wildcards):
    """Input function (for `unpack`) of the rule `table`. The records of the `{table}` wildcard's entry of
    the table registry for the `{suffix}`'s variant (kpca_repro.workflow.paths.table_inputs)."""
    return paths.table_inputs(config, TABLES[wildcards.table], variant_of(wildcards))


def report_labels(name, variant, models):
    """`labels` of a table or figure in the report: its name ("Table 1"), its variant and its models
    (a list, joined). The report lists the labels of each result, and its landing page
    (workflow/report/workflow.rst) the results, variants and models of the run from them."""
    return {"result": name, "variant": variant, "models": ", ".join(models) or "none"}


def domain_models(domain):
    """The models of `domain` ("vision", "text" or "decoders") a table or figure aggregates: <domain>.models, then the activations: entries of that kind."""
    if domain == "decoders":
        return DECODERS["models"]
    return TEXT["models"] + user_models(config, "text") if domain == "text" else VISION["models"] + user_models(config, "vision")


def table_labels(wildcards):
    """`labels` of a table's page in the report (rule `table`)."""
    table = TABLES[wildcards.table]
    return report_labels(table.title, variant_of(wildcards), domain_models(table.domain))


def comparison_labels(wildcards):
    """`labels` of the comparison with the paper in the report: the variants it reads (paper, and corrected
    when configured) and every configured model."""
    variants = "paper, corrected" if any(corrected for _, corrected in comparison_tables().values()) else "paper"
    return report_labels("published vs reproduced", variants, domain_models("vision") + domain_models("text"))


def training_labels(name):
    """`labels` of Figures 1 and 4 and of their claims table in the report: the sources (the authors'
    logs, runs trained here) as the variant, the runs (<model>_<scale>) as the models."""
    sources = ["the authors' logs"] * bool(FIGURE1["use_reference"]) + ["runs trained here"] * bool(FIGURE1["runs"])
    return report_labels(name, " and ".join(sources), FIGURE1["runs"])


def norm_stats(domain, models):
    """Input function of rules figure2 (domain "vision") and figure5 ("text"): the norm
    statistics of the variant's models; models(wildcards) gives the model list."""
    return lambda wc: expand(f"results/norms/{{variant}}/{{model}}/{domain}.csv", variant=variant_of(wc), model=models(wc))


def norm_figure_labels(figure, models):
    """`labels` of a norm figure's PNG in the report; models(wildcards) gives the model ids."""
    return lambda wc: report_labels(figure, variant_of(wc), models(wc))


def norm_band_label(wildcards):
    """Legend of the band of rules figure2 and figure5: the corrected variant's central 95 %, the paper's IQR after the trim."""
    return "2.5-97.5th percentile (central 95 %)" if wildcards.suffix else "25-75th percentile after trim"


def figure2_title(wildcards):
    """`params.title` of rule figure2, the corrected variant's sample and scale or the paper's."""
    if wildcards.suffix:
        return f"Figure 2, corrected: all {VISION['n_images']} images of Table 1, s = 1/sqrt(head_dim), log domain (float64), no trim"
    return f"Figure 2, paper variant: {config['figure2']['n_images']} image (seed {config['seed']}), s = 1/8 hard-coded, values above the 95th percentile dropped per layer"


def figure5_title(wildcards):
    """`params.title` of rule figure5, the corrected variant's sample and scale or the paper's."""
    if wildcards.suffix:
        return f"Figure 5, corrected: all {TEXT['n_rows']} WikiText rows, padding excluded, s = 1/sqrt(head_dim), log domain (float64), no trim"
    return (
        f"Figure 5, paper variant: the {len(FIGURE5['sentences'])} figure5.sentences, every padded position, "
        "s = 1/8 hard-coded, h without attention mask, values above the 95th percentile dropped per layer"
    )


def needs_models(kind, what):
    """Input function (no files) of the rules that aggregate the models of one kind: asked for while
    no model of `kind` ("vision": vision.models and activations: of kind vision; "text": text.models and
    activations: of kind text; "decoders": decoders.models) is configured, it raises the error that names
    `what` and the keys."""

    def check(wildcards):
        if not paths.has_models(config, kind):
            raise WorkflowError(
                f"{what} needs a {'decoder' if kind == 'decoders' else kind} model, but {kind}.models is empty and activations: has no entry of kind {kind}; add one, or leave {what} out of the targets"
            )
        return []

    return check


def train_data(wc):
    """The training data of a run (input function of the rule `train`)."""
    return FASHION_MNIST if TRAINING["scales"][wc.scale]["dataset"] == "fashion_mnist" else []


def table_needs_models(wildcards):
    """Input function (no files) of the rule `table`. The table's domain (vision or text) must have a model."""
    return needs_models(TABLES[wildcards.table].domain, f"results/{wildcards.table}{wildcards.suffix}.csv")(wildcards)


def decoder_prefix_keys():
    """(model id, prefix) of the decoders' prefix profile, in the rows' order: each decoder at each
    decoders.prefix_lengths, then at "N" (each row's full length)."""
    return [(m, str(p)) for m in DECODERS["models"] for p in [*sorted(DECODERS["prefix_lengths"]), "N"]]


def decoder_prefix_records(wildcards):
    """Input function of rule decoders_prefix. The per-head records of every (decoder, prefix),
    all shards, in decoder_prefix_keys order."""
    return [f for m, p in decoder_prefix_keys() for f in paths.decoder_prefix_files(config, variant_of(wildcards), m, p)]


def decoder_prefix_groups(wildcards):
    """`params.groups` of rule decoders_prefix. [model id, prefix, number of files] per group of its input."""
    return [[m, p, len(paths.text_shards(config))] for m, p in decoder_prefix_keys()]
