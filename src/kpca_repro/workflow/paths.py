"""Where the workflow's files live: every path the rules read or write, from the configuration.

A light module (no torch, no Snakemake): ``workflow/rules/common.smk`` wraps these functions as
the rules' input functions, and the tests call them directly. Paths are relative to the
working directory (``snakemake -d``), except those under ``resources_dir``.

Layout (docs/internals.md):

* ``results/activations/<model>/vision_<n>_<i>of<S>.h5`` and ``text_<n>_<i>of<S>.h5``: q, k, v, h;
* ``results/heads/<variant>/<model>/<stem>.csv|.json``: per-head records and their metadata;
* ``results/spectra/<variant>/<model>/vision_<n>_<i>of<S>_<keys>.csv``: eigenvalues;
* ``<records>.csv-metadata.json`` beside each records CSV: its column metadata (rule records_metadata);
* ``results/table<t><suffix>.csv|.md``, ``results/figure<f><suffix>.pdf`` (the variant's
  suffix, :mod:`kpca_repro.method.variant`: ``""`` paper, ``_corrected`` corrected),
  ``results/html/<table><suffix>.html`` (the page ``snakemake --report`` shows, written with the CSV),
  ``results/paper_comparison.csv``.

The default targets (rule ``all``): every table of :data:`kpca_repro.analysis.tables.TABLES`
whose models are configured, and what the rule files register next to the rules that build
it (:func:`default_target`).
"""

from __future__ import annotations

from collections.abc import Callable

from kpca_repro.analysis.tables import TABLES, Table
from kpca_repro.inputs.model_info import model_id_from_slug, model_slug
from kpca_repro.method.variant import CORRECTED, PAPER
from kpca_repro.method.variant import get as get_variant

__all__ = [
    "has_models",
    "has_vision",
    "default_target",
    "table_inputs",
    "model_slug",
    "model_id_from_slug",
    "vision_shards",
    "text_shards",
]
__all__ += [
    "heads_files",
    "spectra_files",
    "text_stage_files",
    "decoder_prefix_files",
    "norm_activations",
    "comparison_tables",
    "all_targets",
    "user_models",
    "user_files",
    "user_spectra_files",
]

#: Patterns -> when of every :func:`default_target` call, in the order of the calls.
_TARGETS: dict[tuple[str, ...], Callable[[dict], bool] | None] = {}


def default_target(*patterns: str, when: Callable[[dict], bool] | None = None) -> None:
    """Make ``patterns`` targets of rule ``all`` (:func:`all_targets`), called in the rule files.

    ``{suffix}`` in a pattern stands for the suffix of each configured variant (``""`` paper,
    ``_corrected``); ``when(config)`` false leaves the patterns out. A repeated call changes nothing.
    """
    _TARGETS.setdefault(patterns, when)


def vision_shards(config: dict, n_images: int | None = None) -> list[str]:
    """Shard labels ``"<i>of<S>"`` of a vision sample: ``vision.shards``, at most one per image of a sample of
    ``n_images`` (Tables 2-3 draw ``spectra.n_images``, which may be fewer than the shards of Table 1's sample)."""
    shards = config["vision"]["shards"] if n_images is None else min(config["vision"]["shards"], n_images)
    return [f"{i}of{shards}" for i in range(shards)]


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
    return [
        f"results/spectra/{variant}/{model}/vision_{n}_{shard}_{keyset}.csv"
        for shard in vision_shards(config, n)
        for keyset in keys
    ]


def text_stage_files(config: dict, model_id: str, ext: str = "h5", variant: str | None = None) -> list[str]:
    """Activation files (``ext`` h5) or per-head records (csv/json, with ``variant``) of one
    language model on the Table 4 sample, all shards."""
    prefix = "results/activations" if ext == "h5" else f"results/heads/{variant}"
    return [
        f"{prefix}/{model_slug(model_id)}/text_{config['text']['n_rows']}_{shard}.{ext}"
        for shard in text_shards(config)
    ]


def has_models(config: dict, domain: str) -> bool:
    """A model of ``domain`` (``vision``, ``text`` or ``decoders``) to analyse: ``<domain>.models`` or an
    ``activations:`` entry of that kind."""
    return bool(config[domain]["models"] or user_models(config, domain))


def has_vision(config: dict) -> bool:
    """A vision model to analyse (Tables 1-3, Figures 2-3 in ``all``)."""
    return has_models(config, "vision")


def user_models(config: dict, kind: str | None = None) -> list[str]:
    """Names of the ``activations:`` entries (docs/activations.md), those of ``kind`` (``vision`` or ``text``) when
    given."""
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
    return [
        f.replace("results/activations/", f"results/spectra/{variant}/").replace(".h5", f"_{keyset}.csv")
        for f in user_files(config, name)
        for keyset in keys
    ]


def decoder_prefix_files(config: dict, variant: str, model_id: str, prefix: int | str, ext: str = "csv") -> list[str]:
    """Per-head records (csv) or their metadata (json) of one decoder's prefix profile at prefix
    length ``prefix`` (``decoders.prefix_lengths``; ``"N"``: each row's full length, the records of
    the decoders table), all shards (docs/method.md 16)."""
    files = text_stage_files(config, model_id, ext, variant)
    return files if prefix == "N" else [f.replace(f".{ext}", f"_p{prefix}.{ext}") for f in files]


def norm_activations(config: dict, domain: str, variant: str, model: str) -> list[str]:
    """Activation files behind one model's squared-norm statistics (Figures 2 and 5).

    The paper variant reads its own samples (``figure2.n_images`` images, the
    ``figure5.sentences``); the corrected one reads the Table 1 / Table 4 samples; a decoder
    (``domain`` ``"decoders"``) the Table 4 sample in both. A user
    model (``activations:``, ``model`` its path slug) reads its own files in both variants.
    """
    users = {model_slug(name): name for name in user_models(config)}
    if model in users:
        return user_files(config, users[model])
    if domain == "vision":
        if variant == PAPER.name:
            return [f"results/activations/{model}/vision_{config['figure2']['n_images']}_0of1.h5"]
        return [
            f"results/activations/{model}/vision_{config['vision']['n_images']}_{shard}.h5"
            for shard in vision_shards(config)
        ]
    if (
        variant == PAPER.name and domain == "text"
    ):  # a decoder reads Table 4's rows in both variants (docs/method.md 16)
        return [f"results/activations/{model}/text_sentences_0of1.h5"]
    return [f"results/activations/{model}/text_{config['text']['n_rows']}_{shard}.h5" for shard in text_shards(config)]


def table_inputs(config: dict, table: Table, variant: str) -> dict[str, list[str]]:
    """The input files of rule ``table`` for ``table`` (an entry of :data:`~kpca_repro.analysis.tables.TABLES`) and
    ``variant``.

    Every model of the table's domain (``<domain>.models``, then the ``activations:`` entries of
    that kind), all shards, in the order the table's rows take: ``records``, the eigenvalue
    records of ``table.keys`` (Tables 2, 3); else ``heads`` and ``meta``, the per-head records
    and their metadata, and for a variant with sign draws ``signs``, the draws stored beside
    each records file (``<records>_signs.h5``, docs/uncertainty.md). Always ``columns``: the
    column metadata of each records CSV (``<records>.csv-metadata.json``, rule records_metadata),
    so that building a table builds its records' metadata.
    """
    models, users = config[table.domain]["models"], user_models(config, table.domain)
    if table.keys:
        records = [f for m in models for f in spectra_files(config, variant, m, table.keys)] + [
            f for u in users for f in user_spectra_files(config, variant, u, table.keys)
        ]
        return {"records": records, "columns": [f"{f}-metadata.json" for f in records]}

    def records(model: str, ext: str) -> list[str]:
        return (
            heads_files(config, variant, model, ext)
            if table.domain == "vision"
            else text_stage_files(config, model, ext, variant)
        )

    files = {
        key: [f for m in models for f in records(m, ext)]
        + [f for u in users for f in user_files(config, u, ext, variant)]
        for key, ext in (("heads", "csv"), ("meta", "json"))
    }
    if get_variant(variant).sign_draws:
        files["signs"] = [f.replace(".csv", "_signs.h5") for f in files["heads"]]
    files["columns"] = [f"{f}-metadata.json" for f in files["heads"]]
    return files


def comparison_tables(config: dict) -> dict[str, tuple[str, str | None]]:
    """Table name -> (paper-variant CSV, corrected CSV or None) of the tables compared with the paper that this run
    builds."""
    corrected = CORRECTED.name in config["variants"]
    return {
        t.name: (f"results/{t.name}.csv", CORRECTED.output(f"results/{t.name}", "csv") if corrected else None)
        for t in TABLES.values()
        if t.published and has_models(config, t.domain)
    }


def all_targets(config: dict) -> list[str]:
    """The targets of rule ``all`` for ``config``: each table whose models are configured (its report
    page, CSV and Markdown per configured variant), then the :func:`default_target` patterns of the
    rule files, in their order."""
    suffixes = [get_variant(v).suffix for v in config["variants"]]
    targets = [
        f"results/{p}"
        for t in TABLES.values()
        if has_models(config, t.domain)
        for s in suffixes
        for p in (f"html/{t.name}{s}.html", f"{t.name}{s}.csv", f"{t.name}{s}.md")
    ]
    for patterns, when in _TARGETS.items():
        if when is None or when(config):
            targets += [
                p.format(suffix=s)
                for s in (suffixes if any("{suffix}" in p for p in patterns) else [""])
                for p in patterns
            ]
    return targets
