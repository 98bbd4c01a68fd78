"""Before any job runs: every external input the requested targets need, present or fetchable.

The workflow (``workflow/rules/common.smk``) calls :func:`check_inputs` while it is parsed.
When an input is missing and cannot be downloaded, because the configuration says
``offline: true``, the environment says ``HF_HUB_OFFLINE=1`` / ``TRANSFORMERS_OFFLINE=1``, or
the download hosts do not answer within a few seconds, it raises :class:`MissingInputsError`
with one block of text: each missing item with its exact path, how to provide it, and the
offline configuration that runs without it. Nothing is probed when everything is present.

Which inputs a target needs (:func:`needs`) follows the rules: Tables 1-3 and Figures 2-3
need the timm weights and the images, Table 4 and Figure 5 the language models and
WikiText-103, Figures 1 and 4 Fashion-MNIST and the authors' training logs; the default
target ``all`` needs what the configuration builds.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

__all__ = [
    "MissingInputsError",
    "Requirement",
    "allowed_rules_from_argv",
    "check_inputs",
    "failure_block",
    "is_present",
    "needs",
    "network_reachable",
    "offline_alternatives",
    "offline_reason",
    "requirements",
    "targets_from_argv",
]

#: Environment variables that declare the machine offline (Hugging Face's own switches).
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
#: Seconds a download host has to accept a TCP connection before the machine counts as offline.
PROBE_TIMEOUT_S = 3.0
#: The hub huggingface_hub, timm, transformers and datasets use when ``HF_ENDPOINT`` is unset.
HF_DEFAULT_ENDPOINT = "https://huggingface.co"


def hub_endpoint() -> str:
    """The Hugging Face endpoint the downloads will contact: ``HF_ENDPOINT`` (a mirror) when set,
    as huggingface_hub reads it, else https://huggingface.co."""
    return os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or HF_DEFAULT_ENDPOINT


def probe_address(url: str) -> str:
    """``name:port`` that a download of ``url`` connects to first: the proxy of its scheme from
    the environment (``https_proxy``, ``http_proxy``, ...) unless ``no_proxy`` exempts the host,
    else the URL's own host and port (443 for https, 80 for http by default).

    Args:
        url: an http(s) URL, or a bare ``name[:port]`` (taken as https).

    Returns:
        e.g. ``"huggingface.co:443"``, ``"127.0.0.1:8790"`` or ``"proxy.example:3128"``.
    """
    parts = urlsplit(url if "://" in url else f"https://{url}")
    host = parts.hostname or ""
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return f"{p.hostname}:{p.port or (443 if p.scheme == 'https' else 80)}"
    return f"{host}:{parts.port or (80 if parts.scheme == 'http' else 443)}"


@dataclass(frozen=True)
class Requirement:
    """One external input.

    Attributes:
        kind: ``weights``, ``images``, ``wikitext``, ``text_model``, ``fashion_mnist`` or
            ``training_logs`` (the block groups the advice per kind).
        what: human name, e.g. ``pretrained weights of timm model 'vit_tiny_patch16_224'``.
        path: the exact file or directory to fill (for a hub model: its Hugging Face id).
        how: how to provide it by hand.
        host: the URL its download contacts (``HF_ENDPOINT`` for hub files, the configured
            URL for plain files), probed when it is missing; None if not fetchable.
    """

    kind: str
    what: str
    path: str
    how: str
    host: str | None


#: The rules that read each kind of input (with ``--allowed-rules`` excluding all of them, the
#: input is not needed: the run uses files already made).
CONSUMERS = {
    "weights": {"extract_vision"},
    "images": {"sample_images", "extract_vision"},
    "wikitext": {"sample_text"},
    "text_model": {"extract_text"},
    "fashion_mnist": {"train"},
    "training_logs": {"figure_training"},
}


class MissingInputsError(FileNotFoundError):
    """Inputs of the requested targets are missing and cannot be downloaded; ``str()`` is the block."""


# --------------------------------------------------------------------------------------
# What the targets need
# --------------------------------------------------------------------------------------

_VISION = re.compile(r"results/(html/)?(table[123]|figure2)(_corrected)?\.(csv|md|pdf|html)$")
_FIGURE3 = re.compile(r"results/figure3(_corrected)?\.pdf$")
_TEXT = re.compile(r"results/(html/)?table4(_corrected)?\.(csv|md|html)$")
_FIGURE5 = re.compile(r"results/figure5(_corrected)?\.pdf$")
_TRAINING = re.compile(r"results/(figure[14]\.pdf$|training/)")
_COMPARISON = re.compile(r"results/(html/)?paper_comparison\.(csv|html)$")
_PER_MODEL = re.compile(r"results/(activations|heads/\w+|spectra/\w+)/([^/]+)/(vision|text)_")


def needs(targets: Iterable[str], config: dict) -> set[str]:
    """The groups of inputs the targets need.

    Args:
        targets: the requested targets (paths relative to the working directory, or rule
            names); empty means the default target ``all``.
        config: the validated configuration.

    Returns:
        A subset of ``{"vision", "figure3", "text", "figure5", "training", "images",
        "wikitext"}`` plus ``"model:<id>"`` entries for per-model intermediate files.
        Targets that match no known pattern add nothing (their rules still check).
    """
    targets = [str(t).removeprefix("./") for t in targets] or ["all"]
    text_models = bool(config["text"]["models"])
    out: set[str] = set()
    for t in targets:
        if t == "all":
            out |= {"vision", "figure3"}
            if text_models:
                out |= {"text", "figure5"}
            if config["figure1"]["runs"] or config["figure1"]["use_reference"]:
                out.add("training")
        elif _VISION.search(t):
            out.add("vision")
        elif _FIGURE3.search(t):
            out.add("figure3")
        elif _TEXT.search(t):
            out.add("text")
        elif _FIGURE5.search(t):
            out.add("figure5")
        elif _TRAINING.search(t):
            out.add("training")
        elif _COMPARISON.search(t):
            out |= {"vision", "text"} if text_models else {"vision"}
        elif m := _PER_MODEL.search(t):
            out.add(f"model:{m.group(2)}")
            out.add("images" if m.group(3) == "vision" else "wikitext")
        elif t.startswith("results/samples/vision_"):
            out.add("images")
        elif t.startswith("results/samples/text_"):
            out.add("wikitext")
    return out


def _weights(resources: str, model: str) -> Requirement:
    path = str(Path(resources) / "weights" / "timm" / f"{model}.safetensors")
    return Requirement(
        "weights",
        f"pretrained weights of timm model {model!r}",
        path,
        "on a machine with network, save timm.create_model(<id>, pretrained=True).state_dict() with safetensors.torch.save_file to exactly that path (or run once online: the download rule does it)",
        hub_endpoint(),
    )


def _text_model(model_id: str) -> Requirement:
    return Requirement(
        "text_model",
        f"language model {model_id!r} (Hugging Face model directory)",
        model_id,
        "map the id to a directory saved with save_pretrained in config key text.local_models (e.g. 'text: {local_models: {<id>: /path/to/dir}}'), put it in the Hugging Face cache, or run online",
        hub_endpoint(),
    )


def requirements(groups: set[str], config: dict) -> list[Requirement]:
    """The external inputs behind ``groups`` (from :func:`needs`), in a stable order, no duplicates.

    Args:
        groups: the output of :func:`needs`.
        config: the validated configuration (``resources_dir``, ``vision``, ``text``, ...).

    Returns:
        One :class:`Requirement` per file or directory (present or not).
    """
    res = config["resources_dir"]
    vision, text = config["vision"], config["text"]
    out: list[Requirement] = []
    models: list[str] = []
    if "vision" in groups:
        models += vision["models"]
    if "figure3" in groups:
        models.append(config["figure3"]["model"])
    text_models: list[str] = []
    if "text" in groups:
        text_models += text["models"]
    if "figure5" in groups:
        text_models += config["figure5"]["models"] if config["figure5"]["models"] is not None else text["models"]
    for g in groups:
        if g.startswith("model:"):
            slug = g[len("model:") :]
            if slug in vision["models"] or slug == config["figure3"]["model"]:
                models.append(slug)
            else:
                text_models.append(slug.replace("--", "/"))
    for m in dict.fromkeys(models):
        out.append(_weights(res, m))
    if (models or "images" in groups) and vision["imagenet_val_dir"] is None:
        out.append(
            Requirement(
                "images",
                "ImageNet sample images",
                str(Path(res) / "images" / "imagenet-sample"),
                f"put the 1000 files <wnid>_<label>.JPEG of the ImageNet sample there ({vision['imagenet_sample_url']}), or set vision.imagenet_val_dir to an ImageNet validation root",
                vision["imagenet_sample_url"],
            )
        )
    for m in dict.fromkeys(text_models):
        if m not in text["local_models"]:  # a local directory is checked with its config key
            out.append(_text_model(m))
    if text_models or "wikitext" in groups:
        out.append(
            Requirement(
                "wikitext",
                "WikiText-103 raw test split",
                str(Path(res) / "text" / "wikitext-103" / "wiki.test.raw"),
                "put the file wiki.test.raw of wikitext-103-raw-v1 there (one dataset row per line; datasets.load_dataset('wikitext', 'wikitext-103-raw-v1', split='test') on a machine with network)",
                hub_endpoint(),
            )
        )
    if "training" in groups:
        scales = config["training"]["scales"]
        if any(scales[run.rpartition("_")[2]]["dataset"] == "fashion_mnist" for run in config["figure1"]["runs"]):
            root = Path(res) / "datasets" / "fashion-mnist"
            for f in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
                out.append(
                    Requirement(
                        "fashion_mnist",
                        "Fashion-MNIST",
                        str(root / f),
                        "place the four IDX .gz files of https://github.com/zalandoresearch/fashion-mnist there",
                        config["downloads"]["fashion_mnist_url"],
                    )
                )
        if config["figure1"]["use_reference"] and config["figure1"]["reference_logs"] is None:
            out.append(
                Requirement(
                    "training_logs",
                    "the authors' W&B training logs",
                    str(Path(res) / "training_logs"),
                    "set figure1.reference_logs to a folder holding vit_tiny/*.csv and deit_tiny/*.csv (scripts/wandb_data of KarahanS/Reproduction-Study-KPCA), or figure1.use_reference: false",
                    config["figure1"]["reference_url"],
                )
            )
    return out


def is_present(req: Requirement) -> bool:
    """Whether an input exists.

    Args:
        req: the input.

    Returns:
        True for an existing file, a non-empty directory, or (``kind == "text_model"``) a hub
        model whose ``config.json`` is in the Hugging Face cache.
    """
    if req.kind == "text_model":
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(req.path, "config.json"), str)
    p = Path(req.path)
    if p.is_dir():
        return any(p.iterdir())
    return p.is_file()


# --------------------------------------------------------------------------------------
# Online or not
# --------------------------------------------------------------------------------------


def network_reachable(host: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``host`` (``name`` or ``name:port``, port 443 by default) accepts a TCP
    connection within ``timeout`` seconds.

    Name resolution runs in a daemon thread so that a hanging resolver cannot stall the
    caller past ``timeout`` either.

    Args:
        host: ``"huggingface.co"`` or ``"name:port"``.
        timeout: seconds for the connection (and, plus 0.5 s, for the whole probe).

    Returns:
        True when the connection was accepted; False on any error or timeout (never raises).
    """
    name, _, port = host.partition(":")
    port = int(port or 443)
    result: list[bool] = []

    def probe():
        try:
            with socket.create_connection((name, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return bool(result and result[0])


def offline_reason(config: dict, endpoints: Iterable[str], probe: Callable[[str], bool] = network_reachable) -> str | None:
    """Why downloads cannot happen, or None when they can.

    Args:
        config: the configuration (its ``offline`` key).
        endpoints: the URLs the downloads of the missing inputs contact (:attr:`Requirement.host`);
            the address each connects to first (:func:`probe_address`: the URL's host or the
            environment's proxy) is probed, concurrently, only when neither the configuration
            nor the environment says offline.
        probe: ``"name:port" -> reachable`` (:func:`network_reachable`; replaceable in tests).

    Returns:
        ``"offline: true in the configuration"``, ``"HF_HUB_OFFLINE=1 in the environment"``,
        ``"no network: <url> (<name:port>) unreachable within 3 s"``, or None.
    """
    if config.get("offline"):
        return "offline: true in the configuration"
    for var in OFFLINE_ENV:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]} in the environment"
    by_address: dict[str, list[str]] = {}
    for url in sorted(set(endpoints)):
        by_address.setdefault(probe_address(url), []).append(url)
    results: dict[str, bool] = {}
    threads = [threading.Thread(target=lambda a=a: results.__setitem__(a, probe(a)), daemon=True) for a in by_address]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PROBE_TIMEOUT_S + 1.0)
    down = [f"{', '.join(urls)} ({address})" for address, urls in by_address.items() if not results.get(address, False)]
    if down:
        return f"no network: {'; '.join(down)} unreachable within {PROBE_TIMEOUT_S:g} s"
    return None


# --------------------------------------------------------------------------------------
# The block
# --------------------------------------------------------------------------------------


def failure_block(missing: list[Requirement], reason: str, targets: Iterable[str], offline_runs: list[tuple[str, str]]) -> str:
    """The one message for missing inputs that cannot be downloaded.

    Args:
        missing: the missing inputs (at least one).
        reason: from :func:`offline_reason`.
        targets: the requested targets (for the first line; empty = ``all``).
        offline_runs: ``(command, what it builds)`` pairs of configurations that run without
            the missing inputs (e.g. ``config/offline_deit_tiny.yaml``).

    Returns:
        Text: one line per missing item (exact path), one line of advice per kind, the
        offline commands. No traceback, no trailing newline.
    """
    targets = list(targets) or ["all"]
    n = len(missing)
    lines = [f"Cannot start {' '.join(targets)}: {n} input{'s' if n != 1 else ''} missing, and they cannot be downloaded ({reason})."]
    for r in missing:
        where = f"{r.path} does not exist" if r.kind != "text_model" else "not in text.local_models and not in the Hugging Face cache"
        lines.append(f"  missing {r.what}: {where}")
    lines.append("Provide them:")
    seen = set()
    for r in missing:
        if r.kind not in seen:
            seen.add(r.kind)
            lines.append(f"  - {r.what.split(' of ')[0].split(' (')[0]}: {r.how}")
    lines.append("  - or point config key resources_dir at a directory that has them (--config resources_dir=/path/to/assets)")
    if reason.startswith(("no network", "HF_")):
        lines.append("  - or connect to the network: the download rules fetch them (offline: false)")
    if offline_runs:
        lines.append("Or run without them (real DeiT-Tiny / MiniLM weights in ../shared/assets):")
        for cmd, what in offline_runs:
            lines.append(f"  {cmd}    # {what}")
    return "\n".join(lines)


def offline_alternatives(groups: set[str], config_dir: str | os.PathLike, cwd: str | os.PathLike) -> list[tuple[str, str]]:
    """Commands with the repository's offline configurations that build what ``groups`` asks for.

    Args:
        groups: the output of :func:`needs`.
        config_dir: the repository's ``config/`` directory (``offline_deit_tiny.yaml``,
            ``offline_minilm.yaml``).
        cwd: the working directory; the configuration paths are shown relative to it when
            they are inside it, else absolute.

    Returns:
        ``(command, what it builds)`` pairs; empty when the files do not exist.
    """
    config_dir, cwd = Path(config_dir).resolve(), Path(cwd).resolve()

    def rel(name):
        p = config_dir / name
        return str(p.relative_to(cwd)) if p.is_relative_to(cwd) else str(p)

    deit, minilm = rel("offline_deit_tiny.yaml"), rel("offline_minilm.yaml")
    if not (config_dir / "offline_deit_tiny.yaml").is_file():
        return []
    vision = groups & {"vision", "figure3", "images"} or any(g.startswith("model:") for g in groups)
    text = groups & {"text", "figure5", "wikitext"}
    out = []
    if vision or not text:
        out.append((f"snakemake --cores 2 results/table1.csv --configfile {deit}", "Table 1 with DeiT-Tiny"))
    if text:
        out.append((f"snakemake --cores 2 results/table4.csv --configfile {minilm}", "Table 4 with all-MiniLM-L6-v2"))
    out.append((f"snakemake --cores 2 --configfile {deit} {minilm}", "every table and figure (target all) with both"))
    return out


#: Snakemake modes that run no job (lint, report, graphs, summaries, clean-up): nothing to check.
_NO_JOB_MODES = (
    "lint",
    "report",
    "list_rules",
    "list_target_rules",
    "dag",
    "rulegraph",
    "filegraph",
    "d3dag",
    "summary",
    "detailed_summary",
    "unlock",
    "cleanup_metadata",
    "cleanup_shadow",
    "print_compilation",
    "delete_all_output",
    "delete_temp_output",
    "list_changes",
    "list_code_changes",
    "list_input_changes",
    "list_params_changes",
    "list_untracked",
    "archive",
    "containerize",
    "generate_unit_tests",
    "export_cwl",
    "touch",
)


def targets_from_argv(argv: list[str]) -> list[str] | None:
    """The targets of a ``snakemake`` command line, parsed with Snakemake's own argument parser.

    (While the workflow is parsed, Snakemake has not yet passed the targets to it.)

    Args:
        argv: ``sys.argv`` of the Snakemake process.

    Returns:
        The targets (empty list: the default target), or None when ``argv`` is not a
        ``snakemake`` command line (for example Snakemake driven through its Python API) or
        one that runs no job (``--lint``, ``--report``, ``--dag``, ``--summary``, ...).
    """
    args = _parse_argv(argv)
    if args is None:
        return None
    if any(getattr(args, mode, None) for mode in _NO_JOB_MODES):
        return None
    return sorted(str(t) for t in args.targets or ())


def _parse_argv(argv: list[str]):
    """Snakemake's own parse of a ``snakemake`` command line, or None for any other argv."""
    if not argv or "snakemake" not in str(argv[0]):
        return None
    from snakemake.cli import get_argument_parser

    try:
        args, _ = get_argument_parser().parse_known_args(argv[1:])
    except SystemExit:
        return None
    return args


def allowed_rules_from_argv(argv: list[str]) -> set[str] | None:
    """The ``--allowed-rules`` of a ``snakemake`` command line.

    Args:
        argv: ``sys.argv`` of the Snakemake process.

    Returns:
        The rule names, or None when all rules are allowed or ``argv`` is not a
        ``snakemake`` command line.
    """
    args = _parse_argv(argv)
    if args is None:
        return None
    return set(args.allowed_rules) if getattr(args, "allowed_rules", None) else None


def check_inputs(
    config: dict,
    targets: Iterable[str],
    offline_runs: list[tuple[str, str]] = (),
    probe: Callable[[str], bool] = network_reachable,
    allowed_rules: set[str] | None = None,
) -> list[Requirement]:
    """Check every external input the targets need; stop if one is missing and cannot be fetched.

    Args:
        config: the validated configuration.
        targets: the requested targets (empty: the default target ``all``).
        offline_runs: see :func:`failure_block`.
        probe: see :func:`offline_reason`.
        allowed_rules: Snakemake's ``--allowed-rules`` (None: all); an input none of whose
            reading rules (:data:`CONSUMERS`) is allowed is not checked.

    Returns:
        The missing inputs that the download rules will fetch (empty when all are present).

    Raises:
        MissingInputsError: something is missing and downloads are impossible (offline
            configuration or environment, or no download host reachable); the message is
            the block of :func:`failure_block`.
    """
    targets = list(targets)
    reqs = requirements(needs(targets, config), config)
    if allowed_rules is not None:
        reqs = [r for r in reqs if CONSUMERS[r.kind] & set(allowed_rules)]
    missing = [r for r in reqs if not is_present(r)]
    if not missing:
        return []
    reason = offline_reason(config, [r.host for r in missing if r.host], probe)
    if reason is None:
        return missing
    raise MissingInputsError(failure_block(missing, reason, targets, list(offline_runs)))
