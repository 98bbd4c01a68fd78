"""Before the first job: the external inputs the scheduled jobs need, present or fetchable.

The rules say which inputs a run needs: a download rule exists only for an input missing when
the workflow is parsed, and its input function registers the input (:meth:`Preflight.need`) for
the jobs Snakemake schedules, as does ``extract_text``'s for a hub model. The ``onstart``
handler calls :meth:`Preflight.stop_if_missing`: when a registered input is missing and cannot
be downloaded (``offline: true``, ``HF_HUB_OFFLINE=1`` or the like, or the download hosts do not
answer within a few seconds), one block (each missing path, how to provide it, the offline
configurations that run without it) and status 1. Nothing is probed when nothing is missing.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["MissingInputsError", "Preflight", "Requirement", "check_missing", "failure_block", "offline_alternatives", "offline_reason", "requirements"]

#: Environment variables that declare the machine offline (Hugging Face's own switches).
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
#: Seconds a download host has to accept a TCP connection before the machine counts as offline.
PROBE_TIMEOUT_S = 3.0
FASHION_MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def hub_endpoint() -> str:
    """The Hugging Face endpoint downloads contact: ``HF_ENDPOINT`` (a mirror) when set, else huggingface.co."""
    return os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or "https://huggingface.co"


def probe_address(url: str) -> str:
    """``name:port`` a download of ``url`` (a bare ``name[:port]``: https) connects to first: the
    environment's proxy unless ``no_proxy`` exempts the host, else the URL's host and port."""
    parts = urlsplit(url if "://" in url else f"https://{url}")
    host = parts.hostname or ""
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return f"{p.hostname}:{p.port or (443 if p.scheme == 'https' else 80)}"
    return f"{host}:{parts.port or (80 if parts.scheme == 'http' else 443)}"


@dataclass(frozen=True)
class Requirement:
    """One external input: ``kind``, a name ``what``, the ``path`` to fill (a hub model: its id),
    ``how`` to provide it by hand, the ``host`` URL its download contacts."""

    kind: str
    what: str
    path: str
    how: str
    host: str


class MissingInputsError(FileNotFoundError):
    """Inputs are missing and cannot be downloaded; ``str()`` is the block."""


#: Per kind of input: (what, path under resources_dir, how to provide it, the URL its download contacts).
_INPUTS = {
    "weights": (
        "pretrained weights of timm model {name!r}",
        "weights/timm/{name}.safetensors",
        "on a machine with network, save timm.create_model(<id>, pretrained=True).state_dict() with safetensors.torch.save_file to exactly that path (or run once online: the download rule does it)",
        "hub",
    ),
    "images": (
        "ImageNet sample images",
        "images/imagenet-sample",
        "put the 1000 files <wnid>_<label>.JPEG of the ImageNet sample there ({url}), or set vision.imagenet_val_dir to an ImageNet validation root",
        "imagenet",
    ),
    "wikitext": (
        "WikiText-103 raw test split",
        "text/wikitext-103/wiki.test.raw",
        "put the file wiki.test.raw of wikitext-103-raw-v1 there (one dataset row per line; datasets.load_dataset('wikitext', 'wikitext-103-raw-v1', split='test') on a machine with network)",
        "hub",
    ),
    "text_model": (
        "language model {name!r} (Hugging Face model directory)",
        None,
        "map the id to a directory saved with save_pretrained in config key text.local_models (e.g. 'text: {{local_models: {{<id>: /path/to/dir}}}}'), put it in the Hugging Face cache, or run online",
        "hub",
    ),
    "fashion_mnist": ("Fashion-MNIST", "datasets/fashion-mnist/{name}", "place the four IDX .gz files of https://github.com/zalandoresearch/fashion-mnist there", "fashion_mnist"),
    "training_logs": (
        "the authors' W&B training logs",
        "training_logs",
        "set figure1.reference_logs to a folder holding vit_tiny/*.csv and deit_tiny/*.csv (scripts/wandb_data of KarahanS/Reproduction-Study-KPCA), or figure1.use_reference: false",
        "reference",
    ),
}


def requirements(kind: str, config: dict, name: str | None = None) -> list[Requirement]:
    """The inputs of one download: ``kind`` is a key of :data:`_INPUTS` (``name``: the timm id of
    ``weights``, the hub id of ``text_model``); ``fashion_mnist`` gives its four files."""
    what, path, how, host = _INPUTS[kind]
    url = config["vision"]["imagenet_sample_url"]
    hosts = {"hub": hub_endpoint(), "imagenet": url, "fashion_mnist": config["downloads"]["fashion_mnist_url"], "reference": config["figure1"]["reference_url"]}
    names = FASHION_MNIST_FILES if kind == "fashion_mnist" else [name]
    res = Path(config["resources_dir"])
    return [Requirement(kind, what.format(name=n), str(res / path.format(name=n)) if path else n, how.format(url=url), hosts[host]) for n in names]


def is_present(req: Requirement) -> bool:
    """An existing file, a non-empty directory, or a hub model whose ``config.json`` is in the Hugging Face cache."""
    if req.kind == "text_model":
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(req.path, "config.json"), str)
    p = Path(req.path)
    return any(p.iterdir()) if p.is_dir() else p.is_file()


def network_reachable(host: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``host`` (``name[:port]``, 443 by default) accepts a TCP connection within
    ``timeout`` s (in a daemon thread: a hanging resolver cannot stall the caller). Never raises."""
    name, _, port = host.partition(":")
    result: list[bool] = []

    def probe():
        try:
            with socket.create_connection((name, int(port or 443)), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return bool(result and result[0])


def offline_reason(config: dict, endpoints: Iterable[str], probe: Callable[[str], bool] = network_reachable) -> str | None:
    """Why downloads cannot happen (``offline: true``, an offline switch in the environment, or
    ``no network: <url> (<name:port>) unreachable within 3 s``: each :func:`probe_address` probed
    concurrently), or None when they can."""
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
    return f"no network: {'; '.join(down)} unreachable within {PROBE_TIMEOUT_S:g} s" if down else None


def failure_block(missing: list[Requirement], reason: str, offline_runs: list[tuple[str, str]]) -> str:
    """The one message: a line per missing input, a line of advice per kind, the offline runs."""
    n = len(missing)
    lines = [f"Cannot start: {n} input{'s' if n != 1 else ''} missing, and they cannot be downloaded ({reason})."]
    for r in missing:
        where = f"{r.path} does not exist" if r.kind != "text_model" else "not in text.local_models and not in the Hugging Face cache"
        lines.append(f"  missing {r.what}: {where}")
    lines.append("Provide them:")
    for kind in dict.fromkeys(r.kind for r in missing):
        r = next(r for r in missing if r.kind == kind)
        lines.append(f"  - {r.what.split(' of ')[0].split(' (')[0]}: {r.how}")
    lines.append("  - or point config key resources_dir at a directory that has them (--config resources_dir=/path/to/assets)")
    if reason.startswith(("no network", "HF_")):
        lines.append("  - or connect to the network: the download rules fetch them (offline: false)")
    if offline_runs:
        lines.append("Or run without them (real DeiT-Tiny / MiniLM weights in ../shared/assets):")
        lines += [f"  {cmd}    # {what}" for cmd, what in offline_runs]
    return "\n".join(lines)


def offline_alternatives(kinds: set[str], config_dir: str | os.PathLike, cwd: str | os.PathLike) -> list[tuple[str, str]]:
    """``(command, what it builds)`` with the repository's offline configurations for missing
    inputs of ``kinds`` (paths relative to ``cwd`` when inside it; none without the files)."""
    config_dir, cwd = Path(config_dir).resolve(), Path(cwd).resolve()
    if not (config_dir / "offline_deit_tiny.yaml").is_file():
        return []
    deit, minilm = (str(p.relative_to(cwd)) if p.is_relative_to(cwd) else str(p) for p in (config_dir / "offline_deit_tiny.yaml", config_dir / "offline_minilm.yaml"))
    text = kinds & {"text_model", "wikitext"}
    out = []
    if kinds - text or not text:
        out.append((f"snakemake --cores 2 results/table1.csv --configfile {deit}", "Table 1 with DeiT-Tiny"))
    if text:
        out.append((f"snakemake --cores 2 results/table4.csv --configfile {minilm}", "Table 4 with all-MiniLM-L6-v2"))
    out.append((f"snakemake --cores 2 --configfile {deit} {minilm}", "every table and figure (target all) with both"))
    return out


def check_missing(reqs: Iterable[Requirement], config: dict, config_dir=None, probe: Callable[[str], bool] = network_reachable) -> list[Requirement]:
    """The missing inputs among ``reqs``, left to the download rules; ``config_dir``: where the
    offline configurations the block suggests live (None: none).

    Raises:
        MissingInputsError: one is missing and downloads are impossible; the message is the block.
    """
    order = ("weights", "images", "text_model", "wikitext", "fashion_mnist", "training_logs")
    missing = sorted((r for r in dict.fromkeys(reqs) if not is_present(r)), key=lambda r: order.index(r.kind))
    if not missing:
        return []
    reason = offline_reason(config, [r.host for r in missing], probe)
    if reason is None:
        return missing
    runs = offline_alternatives({r.kind for r in missing}, config_dir, os.getcwd()) if config_dir else []
    raise MissingInputsError(failure_block(missing, reason, runs))


class Preflight:
    """The inputs the scheduled jobs registered (:meth:`need`), checked once before the first job;
    ``config_dir``: the repository's ``config/`` (the offline configurations the block names)."""

    def __init__(self, config: dict, config_dir: str | os.PathLike):
        self.config, self.config_dir = config, config_dir
        self.needed: dict[str, Requirement] = {}

    def need(self, kind: str, name: str | None = None) -> None:
        """Register the inputs of one download (:func:`requirements`)."""
        for r in requirements(kind, self.config, name):
            self.needed.setdefault(r.path, r)

    def stop_if_missing(self, probe: Callable[[str], bool] = network_reachable) -> None:
        """Print the block and exit with status 1 when a registered input is missing and cannot be downloaded."""
        try:
            check_missing(self.needed.values(), self.config, self.config_dir, probe)
        except MissingInputsError as exc:
            print(exc, file=sys.stderr)  # the block alone: a raised error would add Snakefile lines
            sys.exit(1)
