"""Before the first job: what the jobs Snakemake scheduled need and cannot get.

The Snakefile's ``onstart`` handler (after the DAG is built; not in a dry run) passes the scheduled
jobs to :func:`stop_message`, a pure function of the configuration and those jobs: a sample larger
than its image set (one line naming the key); inputs that download jobs would fetch, or a
language model not in ``text.local_models`` nor the Hugging Face cache, while downloads are
impossible (``offline: true``, ``HF_HUB_OFFLINE=1`` or the like, or the download hosts do not
answer within a few seconds): one block (each missing path, how to provide it, the offline
configurations that run without it), probing nothing when nothing is missing; with the SLURM
executor (profiles/slurm), a request no node of its partition can hold (SLURM would accept it
and leave it PENDING forever, reason ``PartitionConfig``).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kpca_repro.inputs.model_info import model_id_from_slug

__all__ = ["MissingInputsError", "PreflightError", "Requirement", "check_missing", "config_json", "parse_sinfo", "problems", "requirements", "scheduled_requirements", "stop_message"]

#: Environment variables that declare the machine offline (Hugging Face's own switches).
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
#: Seconds a download host has to accept a TCP connection before the machine counts as offline.
PROBE_TIMEOUT_S = 3.0
FASHION_MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")



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


#: Per kind of input, in the order the block lists them: (what, path under resources_dir, how to provide it, the URL its download contacts).
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
    "text_model": (
        "language model {name!r} (Hugging Face model directory)",
        None,
        "map the id to a directory saved with save_pretrained in config key text.local_models (e.g. 'text: {{local_models: {{<id>: /path/to/dir}}}}'), put it in the Hugging Face cache, or run online",
        "hub",
    ),
    "wikitext": (
        "WikiText-103 raw test split",
        "text/wikitext-103/wiki.test.raw",
        "put the file wiki.test.raw of wikitext-103-raw-v1 there (one dataset row per line; datasets.load_dataset('wikitext', 'wikitext-103-raw-v1', split='test') on a machine with network)",
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
    ``weights``, the hub id of ``text_model``); ``fashion_mnist`` gives its four files. A hub
    download contacts ``HF_ENDPOINT`` (a mirror) when set, else huggingface.co."""
    what, path, how, host = _INPUTS[kind]
    url = config["vision"]["imagenet_sample_url"]
    hub = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or "https://huggingface.co"
    hosts = {"hub": hub, "imagenet": url, "fashion_mnist": config["downloads"]["fashion_mnist_url"], "reference": config["figure1"]["reference_url"]}
    names = FASHION_MNIST_FILES if kind == "fashion_mnist" else [name]
    res = Path(config["resources_dir"])
    return [Requirement(kind, what.format(name=n), str(res / path.format(name=n)) if path else n, how.format(url=url), hosts[host]) for n in names]


def network_reachable(host: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``host`` (``name[:port]``, 443 by default) accepts a TCP connection within
    ``timeout`` s (in a daemon thread: a hanging resolver cannot stall the caller). Never raises."""
    name, _, port = host.partition(":")
    result: list[bool] = []

    def probe():
        with contextlib.suppress(OSError), socket.create_connection((name, int(port or 443)), timeout=timeout):
            result.append(True)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return bool(result)


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
    with ThreadPoolExecutor() as pool:
        up = dict(zip(by_address, pool.map(probe, by_address)))
    down = [f"{', '.join(urls)} ({address})" for address, urls in by_address.items() if not up[address]]
    return f"no network: {'; '.join(down)} unreachable within {PROBE_TIMEOUT_S:g} s" if down else None


def failure_block(missing: list[Requirement], reason: str, offline_runs: list[tuple[str, str]]) -> str:
    """The one message: a line per missing input, a line of advice per kind, the offline runs."""
    lines = [f"Cannot start: {len(missing)} input{'s' if len(missing) != 1 else ''} missing, and they cannot be downloaded ({reason})."]
    lines += [f"  missing {r.what}: " + (f"{r.path} does not exist" if r.kind != "text_model" else "not in text.local_models and not in the Hugging Face cache") for r in missing]
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
    inputs of ``kinds`` (paths relative to ``cwd`` when inside it)."""
    config_dir, cwd = Path(config_dir).resolve(), Path(cwd).resolve()
    deit, minilm = (str(p.relative_to(cwd)) if p.is_relative_to(cwd) else str(p) for p in (config_dir / "offline_deit_tiny.yaml", config_dir / "offline_minilm.yaml"))
    text = kinds & {"text_model", "wikitext"}
    table1 = [(f"snakemake --cores 2 results/table1.csv --configfile {deit}", "Table 1 with DeiT-Tiny")] if kinds - text or not text else []
    table4 = [(f"snakemake --cores 2 results/table4.csv --configfile {minilm}", "Table 4 with all-MiniLM-L6-v2")] if text else []
    return [*table1, *table4, (f"snakemake --cores 2 --configfile {deit} {minilm}", "every table and figure (target all) with both")]


def check_missing(reqs: Iterable[Requirement], config: dict, config_dir=None, probe: Callable[[str], bool] = network_reachable) -> list[Requirement]:
    """The missing inputs among ``reqs`` (no such path; a hub model: not in the Hugging Face cache),
    left to the download rules; ``config_dir``: where the offline configurations the block suggests live (None: none).

    Raises:
        MissingInputsError: one is missing and downloads are impossible; the message is the block.
    """
    missing = sorted((r for r in dict.fromkeys(reqs) if (config_json(r.path) is None if r.kind == "text_model" else not os.path.exists(r.path))), key=lambda r: list(_INPUTS).index(r.kind))
    if not missing or (reason := offline_reason(config, [r.host for r in missing], probe)) is None:
        return missing
    runs = offline_alternatives({r.kind for r in missing}, config_dir, os.getcwd()) if config_dir else []
    raise MissingInputsError(failure_block(missing, reason, runs))


def config_json(source: str | os.PathLike) -> str | None:
    """The ``config.json`` of a local model directory, or of a hub id in the Hugging Face cache; None when there is none."""
    if os.path.isdir(source):
        return path if os.path.isfile(path := os.path.join(source, "config.json")) else None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(str(source), "config.json")
    return cached if isinstance(cached, str) else None


class PreflightError(RuntimeError):
    """A request fits on no node, or the nodes cannot be listed."""


@dataclass
class Node:
    name: str
    cpus: int
    mem_mb: int
    gpus: int
    partitions: tuple[str, ...] = ()
    default_partition: str | None = None


def parse_sinfo(text: str) -> list[Node]:
    """Nodes from ``sinfo -h -N -o '%N|%P|%c|%m|%G'`` (one line per node and partition; the
    default partition marked ``*``; GPUs in the gres field: ``gpu:2``, ``gpu:a100:4(S:0-1)``, ``(null)``)."""
    nodes: dict[str, Node] = {}
    for name, part, cpus, mem, gres in (line.split("|") for line in text.split()):
        gpus = sum(int(m.group(1)) for item in gres.split(",") if (m := re.match(r"gpu(?::[^:(]+)?:(\d+)", item)))
        n = nodes.setdefault(name, Node(name, int(cpus), int(re.sub(r"\D", "", mem) or 0), gpus))
        if part.endswith("*"):
            part = n.default_partition = part[:-1]
        n.partitions += (part,)
    return list(nodes.values())


def problems(requests: dict[str, dict], nodes: list[Node]) -> list[str]:
    """For each request (key: its rule first) that fits no node of its partition, one line saying why."""
    default = next((n.default_partition for n in nodes if n.default_partition), None)
    out = []
    for key, req in sorted(requests.items()):
        rule, part = key.split()[0], req.get("partition") or default
        candidates = [n for n in nodes if part is None or part in n.partitions]
        if not candidates:
            out.append(f"{rule}: partition {part!r} has no nodes (sinfo lists partitions {sorted({p for n in nodes for p in n.partitions})})")
        elif not any(n.cpus >= req["cpus"] and n.mem_mb >= req["mem_mb"] and n.gpus >= req["gpu"] for n in candidates):
            biggest = f"cpus {max(n.cpus for n in candidates)}, mem_mb {max(n.mem_mb for n in candidates)}, gpus {max(n.gpus for n in candidates)}"
            out.append(f"{rule}: asks cpus_per_task {req['cpus']}, mem_mb {req['mem_mb']}, gpu {req['gpu']}; the largest node of partition {part!r} has {biggest}")
    return out


#: The download rules (workflow/rules/resources.smk, training.smk) and the kind of input each fetches.
DOWNLOADS = {"download_timm_weights": "weights", "download_imagenet_sample": "images", "download_wikitext": "wikitext", "download_fashion_mnist": "fashion_mnist", "download_training_logs": "training_logs"}


def scheduled_requirements(config: dict, jobs: Iterable[tuple[str, dict]]) -> list[Requirement]:
    """The external inputs of the scheduled ``jobs`` (``(rule, wildcards)``): what each download job
    fetches (its ``model`` wildcard: the timm id), and the hub model of an ``extract_text`` job whose
    model is not in ``text.local_models``."""
    reqs = []
    for rule, wildcards in jobs:
        if rule in DOWNLOADS:
            reqs += requirements(DOWNLOADS[rule], config, wildcards.get("model"))
        elif rule == "extract_text" and (model_id := model_id_from_slug(wildcards["slug"])) not in config["text"]["local_models"]:
            reqs += requirements("text_model", config, model_id)
    return reqs


def check_requests(requests: Iterable[tuple[str, int, dict]]) -> None:
    """Raise :class:`PreflightError` if a cluster job's ``cpus_per_task`` (else its threads), ``mem_mb`` and ``gpu``
    fit no node ``sinfo`` lists for its partition (the default one when none is set), or if ``sinfo`` lists none.
    ``requests``: ``(rule, threads, resources)`` per job (a resource not known yet counts as 0);
    ``KPCA_SLURM_PREFLIGHT=0`` skips it (a ``sinfo`` hiding nodes)."""
    asks = {}
    for rule, threads, resources in requests:
        n = {k: v if isinstance(v := resources.get(k), int) else 0 for k in ("cpus_per_task", "mem_mb", "gpu")}
        req = {"cpus": n["cpus_per_task"] or threads, "mem_mb": n["mem_mb"], "gpu": n["gpu"], "partition": resources.get("slurm_partition") or None}
        asks[" ".join(map(str, (rule, *req.values())))] = req
    if os.environ.get("KPCA_SLURM_PREFLIGHT", "1") == "0" or not asks:
        return
    skip = "set KPCA_SLURM_PREFLIGHT=0 to skip the check"
    try:
        nodes = parse_sinfo(subprocess.run(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G"], capture_output=True, text=True, timeout=30, check=True).stdout)
    except (OSError, subprocess.SubprocessError) as e:
        raise PreflightError(f"SLURM pre-flight: could not list the nodes with sinfo ({e}); {skip}") from e
    if not nodes:
        raise PreflightError(f"SLURM pre-flight: sinfo lists no nodes; {skip}")
    if found := problems(asks, nodes):
        raise PreflightError(
            "SLURM pre-flight: these requests fit on no node and would stay PENDING forever:\n  "
            + "\n  ".join(found)
            + "\nLower them in profiles/slurm/config.yaml (set-resources / set-threads) or pass --set-resources / --set-threads;"
            " a GPU request comes from `device` (set `device: cpu` on a cluster without GPUs)."
            " KPCA_SLURM_PREFLIGHT=0 skips this check."
        )


def stop_message(config: dict, config_dir, jobs: list[tuple[str, dict]], requests: Iterable[tuple[str, int, dict]] = (), probe: Callable[[str], bool] = network_reachable) -> str | None:
    """What stops the run before its first job (module docstring), or None. ``jobs``: ``(rule, wildcards)``
    of every scheduled job; ``requests``: those of the cluster jobs under the SLURM executor (:func:`check_requests`);
    ``config_dir``: the repository's ``config/`` (the offline configurations the block names)."""
    from kpca_repro.workflow.config_checks import image_count_error

    if counts := sorted({e for rule, wc in jobs if rule == "sample_images" and (e := image_count_error(config, int(wc["n"])))}):
        return "\n".join(counts)
    try:
        check_missing(scheduled_requirements(config, jobs), config, config_dir, probe)
        check_requests(requests)
    except (MissingInputsError, PreflightError) as exc:
        return str(exc)
    return None
