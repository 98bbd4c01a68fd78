"""Where the workflow's files live: every path the rules read or write, from the configuration.

A light module (no torch, no Snakemake): ``workflow/rules/common.smk`` wraps these functions as
the rules' input functions, and the tests call them directly. Paths are relative to the
working directory (``snakemake -d``), except those under ``resources_dir``.

Layout (docs/internals.md):

* ``results/activations/<model>/vision_<n>_<i>of<S>.h5`` and ``text_<n>_<i>of<S>.h5``: q, k, v, h;
* ``results/heads/<variant>/<model>/<stem>.csv|.json``: per-head records and their metadata;
* ``results/spectra/<variant>/<model>/vision_<n>_<i>of<S>_<keys>.csv``: eigenvalues;
* ``results/table<t><suffix>.csv|.md``, ``results/figure<f><suffix>.pdf`` (the variant's
  suffix, :mod:`kpca_repro.variant`: ``""`` paper, ``_corrected`` corrected),
  ``results/html/<table>.html``, ``results/paper_comparison.csv``.
"""

from __future__ import annotations

from .variant import CORRECTED, PAPER, REGISTRY
from .variant import get as get_variant

__all__ = [
    "REPORT_TABLES",
    "model_slug",
    "model_id_from_slug",
    "vision_shards",
    "text_shards",
    "heads_files",
    "spectra_files",
    "text_stage_files",
    "norm_activations",
    "comparison_tables",
    "all_targets",
    "user_models",
    "user_files",
    "user_spectra_files",
]

#: Result tables rendered as HTML for ``snakemake --report`` (caption: workflow/report/tables.rst).
REPORT_TABLES = [f"table{t}{v.suffix}" for v in REGISTRY.values() for t in (1, 2, 3, 4)] + ["paper_comparison"]


def model_slug(model_id: str) -> str:
    """Path component of a Hugging Face id: ``"/"`` -> ``"--"`` (``org/name`` -> ``org--name``).

    Reversible (:func:`model_id_from_slug`) because hub repository names never contain ``--``.
    """
    return model_id.replace("/", "--")


def model_id_from_slug(slug: str) -> str:
    """Inverse of :func:`model_slug`."""
    return slug.replace("--", "/")


def vision_shards(config: dict) -> list[str]:
    """Shard labels ``"<i>of<S>"`` of the vision sample (``vision.shards``)."""
    return [f"{i}of{config['vision']['shards']}" for i in range(config["vision"]["shards"])]


def text_shards(config: dict) -> list[str]:
    """Shard labels ``"<i>of<S>"`` of the text sample (``text.shards``)."""
    return [f"{i}of{config['text']['shards']}" for i in range(config["text"]["shards"])]


def heads_files(config: dict, variant: str, model: str, ext: str = "csv") -> list[str]:
    """Per-head records (``ext`` csv) or their metadata (json) of one vision model, all shards."""
    n = config["vision"]["n_images"]
    return [f"results/heads/{variant}/{model}/vision_{n}_{shard}.{ext}" for shard in vision_shards(config)]


def spectra_files(config: dict, variant: str, model: str, keys: str | list[str]) -> list[str]:
    """Per-head eigenvalue records of one model for Tables 2 and 3, all shards (shard-major);
    ``keys``: ``"standardized"``, ``"raw"`` or a list of them."""
    n = config["spectra"]["n_images"]
    keys = [keys] if isinstance(keys, str) else list(keys)
    return [f"results/spectra/{variant}/{model}/vision_{n}_{shard}_{keyset}.csv" for shard in vision_shards(config) for keyset in keys]


def text_stage_files(config: dict, model_id: str, ext: str = "h5", variant: str | None = None) -> list[str]:
    """Activation files (``ext`` h5) or per-head records (csv/json, with ``variant``) of one
    language model on the Table 4 sample, all shards."""
    prefix = "results/activations" if ext == "h5" else f"results/heads/{variant}"
    return [f"{prefix}/{model_slug(model_id)}/text_{config['text']['n_rows']}_{shard}.{ext}" for shard in text_shards(config)]


def user_models(config: dict, kind: str | None = None) -> list[str]:
    """Names of the ``activations:`` entries (docs/activations.md), those of ``kind`` (``vision`` or ``text``) when given."""
    return [name for name, entry in config.get("activations", {}).items() if kind is None or entry["kind"] == kind]


def user_files(config: dict, name: str, ext: str = "h5", variant: str | None = None) -> list[str]:
    """A user model's activation files as installed in the results (``ext`` h5:
    ``results/activations/<slug>/user_<i>of<S>.h5``, one per configured file) or their
    per-head records (csv/json, with ``variant``)."""
    n = len(config["activations"][name]["files"])
    prefix = "results/activations" if ext == "h5" else f"results/heads/{variant}"
    return [f"{prefix}/{model_slug(name)}/user_{i}of{n}.{ext}" for i in range(n)]


def user_spectra_files(config: dict, variant: str, name: str, keys: str | list[str]) -> list[str]:
    """Eigenvalue records of a user model (Tables 2 and 3): every installed file, each key set."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    return [f.replace("results/activations/", f"results/spectra/{variant}/").replace(".h5", f"_{keyset}.csv") for f in user_files(config, name) for keyset in keys]


def norm_activations(config: dict, domain: str, variant: str, model: str) -> list[str]:
    """Activation files behind one model's squared-norm statistics (Figures 2 and 5).

    The paper variant reads its own samples (``figure2.n_images`` images, the
    ``figure5.sentences``); the corrected one reads the Table 1 / Table 4 samples. A user
    model (``activations:``, ``model`` its path slug) reads its own files in both variants.
    """
    users = {model_slug(name): name for name in user_models(config)}
    if model in users:
        return user_files(config, users[model])
    if domain == "vision":
        if variant == PAPER.name:
            return [f"results/activations/{model}/vision_{config['figure2']['n_images']}_0of1.h5"]
        return [f"results/activations/{model}/vision_{config['vision']['n_images']}_{shard}.h5" for shard in vision_shards(config)]
    if variant == PAPER.name:
        return [f"results/activations/{model}/text_sentences_0of1.h5"]
    return [f"results/activations/{model}/text_{config['text']['n_rows']}_{shard}.h5" for shard in text_shards(config)]


def comparison_tables(config: dict) -> dict[str, tuple[str, str | None]]:
    """Table number -> (paper-variant CSV, corrected CSV or None) for the tables this run builds."""
    out = {"1": "results/table1.csv", "2": "results/table2.csv", "3": "results/table3.csv"}
    if config["text"]["models"] or user_models(config, "text"):
        out["4"] = "results/table4.csv"
    corrected = CORRECTED.name in config["variants"]
    return {t: (p, CORRECTED.output(p.removesuffix(".csv"), "csv") if corrected else None) for t, p in out.items()}


def all_targets(config: dict) -> list[str]:
    """Every table and figure the configuration asks for, then their HTML and the comparison."""
    figure1 = config["figure1"]
    targets = []
    if figure1["runs"] or figure1["use_reference"]:  # training curves: no variants
        targets += ["results/figure1.pdf", "results/figure4.pdf"]
    if config.get("token_ablation", {}).get("models") and config["token_ablation"]["scales"]:
        targets += ["results/token_ablation.csv"]
    for variant in config["variants"]:
        sfx = get_variant(variant).suffix
        targets += [f"results/table{t}{sfx}.csv" for t in (1, 2, 3)] + [f"results/table1{sfx}.md"]
        targets += [f"results/figure{f}{sfx}.pdf" for f in (2, 3)]
        if config["text"]["models"] or user_models(config, "text"):  # text.models: [] (a vision-only configuration) leaves Table 4 and Figure 5 out
            targets += [f"results/table4{sfx}.csv", f"results/table4{sfx}.md", f"results/figure5{sfx}.pdf"]
    # the tables as HTML for `snakemake --report`; last, the comparison with the paper
    built = [t for t in REPORT_TABLES if f"results/{t}.csv" in targets]
    targets += [f"results/html/{t}.html" for t in built + ["paper_comparison"]]
    targets += ["results/paper_comparison.csv"]
    return targets
