"""Where the workflow's files live: every path the rules read or write, from the configuration.

A light module (no torch, no Snakemake): ``workflow/rules/common.smk`` wraps these functions as
the rules' input functions, and the tests call them directly. Paths are relative to the
working directory (``snakemake -d``), except those under ``resources_dir``.

Layout (docs/internals.md):

* ``results/activations/<model>/vision_<n>_<i>of<S>.h5`` and ``text_<n>_<i>of<S>.h5``: q, k, v, h;
* ``results/heads/<variant>/<model>/<stem>.csv|.json``: per-head records and their metadata;
* ``results/spectra/<variant>/<model>/vision_<n>_<i>of<S>_<keys>.csv``: eigenvalues;
* ``results/table<t><suffix>.csv|.md``, ``results/figure<f><suffix>.pdf`` (the variant's
  suffix, :mod:`kpca_repro.method.variant`: ``""`` paper, ``_corrected`` corrected),
  ``results/html/<table>.html``, ``results/paper_comparison.csv``.

The default targets (rule ``all``) are registered by the rule files next to the rules that
build them (:func:`default_target`), so a new table is one rule, one script, one function.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

from kpca_repro.inputs.model_info import model_id_from_slug, model_slug
from kpca_repro.method.variant import CORRECTED, PAPER, REGISTRY
from kpca_repro.method.variant import get as get_variant

__all__ = [
    "has_vision",
    "REPORT_TABLES",
    "default_target",
    "register_rule_targets",
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

#: Result tables rendered as HTML for ``snakemake --report`` (caption: workflow/report/tables.rst),
#: every variant's: filled by :func:`default_target` with ``report=True``.
REPORT_TABLES: list[str] = []
#: Patterns -> (report, when) of every :func:`default_target` call, in the order of the calls.
_TARGETS: dict[tuple[str, ...], tuple[bool, Callable[[dict], bool] | None]] = {}


def default_target(*patterns: str, report: bool = False, when: Callable[[dict], bool] | None = None) -> None:
    """Make ``patterns`` targets of rule ``all`` (:func:`all_targets`), called in the rule files.

    ``{suffix}`` in a pattern stands for the suffix of each configured variant (``""`` paper,
    ``_corrected``); ``report``: each CSV pattern is also rendered as
    ``results/html/<name>.html`` for ``snakemake --report`` (:data:`REPORT_TABLES`);
    ``when(config)`` false leaves the patterns out. A repeated call changes nothing.
    """
    if patterns in _TARGETS:
        return
    _TARGETS[patterns] = (report, when)
    if report:
        REPORT_TABLES.extend(dict.fromkeys(Path(p).stem.format(suffix=v.suffix) for p in patterns if p.endswith(".csv") for v in REGISTRY.values()))


def register_rule_targets(repo: str | Path) -> None:
    """Run the :func:`default_target` calls of the workflow's rule files (in the Snakefile's
    include order) without parsing the workflow: for code that reads the layout outside
    Snakemake (the tests, :mod:`kpca_repro.workflow.report_check`)."""
    repo = Path(repo)
    for name in re.findall(r'^include: "workflow/rules/(\w+)\.smk"', (repo / "Snakefile").read_text(), re.M):
        lines = (repo / "workflow" / "rules" / f"{name}.smk").read_text().splitlines()
        for i in (i for i, line in enumerate(lines) if line.startswith("default_target(")):
            end = next(j for j in range(i + 1, len(lines) + 1) if _parses("\n".join(lines[i:j])))
            eval(compile("\n".join(lines[i:end]), f"{name}.smk", "eval"), {"default_target": default_target, "user_models": user_models, "has_vision": has_vision})


def _parses(source: str) -> bool:
    try:
        ast.parse(source, mode="eval")
    except SyntaxError:
        return False
    return True


def vision_shards(config: dict, n_images: int | None = None) -> list[str]:
    """Shard labels ``"<i>of<S>"`` of a vision sample: ``vision.shards``, at most one per image of a sample of ``n_images``
    (Tables 2-3 draw ``spectra.n_images``, which may be fewer than the shards of Table 1's sample)."""
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
    return [f"results/spectra/{variant}/{model}/vision_{n}_{shard}_{keyset}.csv" for shard in vision_shards(config, n) for keyset in keys]


def text_stage_files(config: dict, model_id: str, ext: str = "h5", variant: str | None = None) -> list[str]:
    """Activation files (``ext`` h5) or per-head records (csv/json, with ``variant``) of one
    language model on the Table 4 sample, all shards."""
    prefix = "results/activations" if ext == "h5" else f"results/heads/{variant}"
    return [f"{prefix}/{model_slug(model_id)}/text_{config['text']['n_rows']}_{shard}.{ext}" for shard in text_shards(config)]


def has_vision(config: dict) -> bool:
    """A vision model to analyse: ``vision.models`` or an ``activations:`` entry of kind vision (Tables 1-3, Figures 2-3 in ``all``)."""
    return bool(config["vision"]["models"] or user_models(config, "vision"))


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
    out = {"1": "results/table1.csv", "2": "results/table2.csv", "3": "results/table3.csv"} if has_vision(config) else {}
    if config["text"]["models"] or user_models(config, "text"):
        out["4"] = "results/table4.csv"
    corrected = CORRECTED.name in config["variants"]
    return {t: (p, CORRECTED.output(p.removesuffix(".csv"), "csv") if corrected else None) for t, p in out.items()}


def all_targets(config: dict) -> list[str]:
    """The targets of rule ``all`` for ``config``: the :func:`default_target` patterns of the
    rule files, in their order, each after its HTML (``report=True``)."""
    suffixes = [get_variant(v).suffix for v in config["variants"]]
    targets = []
    for patterns, (report, when) in _TARGETS.items():
        if when is None or when(config):
            for sfx in suffixes if any("{suffix}" in p for p in patterns) else [""]:
                files = [p.format(suffix=sfx) for p in patterns]
                targets += [f"results/html/{Path(f).stem}.html" for f in files if report and f.endswith(".csv")] + files
    return targets
