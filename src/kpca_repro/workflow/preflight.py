"""Before the first job: what the jobs Snakemake schedules need, cost and ask of a node.

While Snakemake builds the DAG, the rules' own functions (``workflow/rules/common.smk``) report to
one :class:`Preflight`: a download rule exists only for an input missing when the workflow is
parsed, and its input function registers the input (:meth:`Preflight.need`), as does
``extract_text``'s for a hub model; the extraction rules' input functions print each model's cost
line (:meth:`Preflight.cost`, dry runs too); the cluster rules' ``params`` function records what
each job asks of a node (:meth:`Preflight.request`). The Snakefile's ``onstart`` handler then
calls :meth:`Preflight.stop_if_missing`: when a registered input is missing and cannot be
downloaded (``offline: true``, ``HF_HUB_OFFLINE=1`` or the like, or the download hosts do not
answer within a few seconds), one block (each missing path, how to provide it, the offline
configurations that run without it) and status 1; nothing is probed when nothing is missing.
With the SLURM executor (profiles/slurm) it calls :meth:`Preflight.check_requests`: SLURM accepts
a job no node can hold and leaves it PENDING forever (reason ``PartitionConfig``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["MissingInputsError", "ModelCost", "Preflight", "PreflightError", "Requirement", "check_missing", "config_json", "parse_sinfo", "problems", "requirements", "text_model_shape"]

#: Environment variables that declare the machine offline (Hugging Face's own switches).
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
#: Seconds a download host has to accept a TCP connection before the machine counts as offline.
PROBE_TIMEOUT_S = 3.0
FASHION_MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


#: The paper's largest vision case per image: (layers x heads, N, d) of ViT-Large/16 at 224 px.
REFERENCE = {"name": "ViT-Large at 197 tokens", "heads": 24 * 16, "n_tokens": 197, "head_dim": 64}
#: A model whose eigh work or storage exceeds the reference by more than this factor is warned about.
WARN_FACTOR = 4.0
BYTES = 4 * 4  # q, k, v, h in float32
HEADER = f"Cost estimate (eigh work = heads x N^3; storage = q,k,v,h float32 = 16 B x heads x N x d; x ref = relative to {REFERENCE['name']} on as many inputs):"
COLUMNS = f"  {'model':<40} {'N':>5} {'heads (L x H x inputs)':>28} {'eigh work':>20} {'storage':>18}"


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


@dataclass(frozen=True)
class ModelCost:
    """Cost of one model (``domain`` ``"vision"`` or ``"text"``) on ``n_inputs`` images or rows:
    the KPCA's eigh work (``heads x N^3``, N = ``n_tokens``, None when unknown) and the activation
    storage (``16 B x heads x N x d``), with ratios to :data:`REFERENCE` on as many inputs."""

    model: str
    domain: str
    n_tokens: int | None
    layers: int
    heads_per_layer: int
    head_dim: int
    n_inputs: int

    heads = property(lambda self: self.layers * self.heads_per_layer * self.n_inputs)
    eigh_work = property(lambda self: None if self.n_tokens is None else float(self.heads) * self.n_tokens**3)
    storage_bytes = property(lambda self: None if self.n_tokens is None else float(BYTES) * self.heads * self.n_tokens * self.head_dim)
    eigh_ratio = property(lambda self: None if self.n_tokens is None else self.eigh_work / (float(REFERENCE["heads"]) * self.n_inputs * REFERENCE["n_tokens"] ** 3))
    storage_ratio = property(lambda self: None if self.n_tokens is None else self.storage_bytes / (float(BYTES) * REFERENCE["heads"] * self.n_inputs * REFERENCE["n_tokens"] * REFERENCE["head_dim"]))


def config_json(source: str | os.PathLike) -> str | None:
    """The ``config.json`` of a local model directory, or of a hub id in the Hugging Face cache; None when there is none."""
    if os.path.isdir(source):
        return path if os.path.isfile(path := os.path.join(source, "config.json")) else None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(str(source), "config.json")
    return cached if isinstance(cached, str) else None


def text_model_shape(source: str | os.PathLike) -> tuple[int, int, int] | None:
    """(layers, heads, head dimension) from a language model's :func:`config_json`; None when
    there is none or it lacks the keys."""
    try:
        cfg = json.loads(Path(config_json(source)).read_text())
        layers, heads, width = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
    except (TypeError, OSError, ValueError, KeyError):
        return None
    return int(layers), int(heads), int(width) // int(heads)


def _si(x: float, unit: str = "") -> str:
    factor, prefix = next(((f, p) for f, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")) if abs(x) >= f), (1, ""))
    return f"{x / factor:.3g} {prefix}{unit}".rstrip()


def _ratio(x: float) -> str:
    return f"{x:.2g}" if x < 10 else f"{x:.0f}"


def _lines(c: ModelCost) -> tuple[str, str | None]:
    """The table line of a model, and its warning (None when within :data:`WARN_FACTOR`)."""
    shape = f"{c.heads} ({c.layers}x{c.heads_per_layer}x{c.n_inputs})"
    if c.n_tokens is None:
        return f"  {c.model:<40} {'?':>5} {shape:>28} {'?':>20} {'?':>18}", None
    work = f"{_si(c.eigh_work)} ({_ratio(c.eigh_ratio)}x ref)"
    store = f"{_si(c.storage_bytes, 'B')} ({_ratio(c.storage_ratio)}x ref)"
    line = f"  {c.model:<40} {c.n_tokens:>5} {shape:>28} {work:>20} {store:>18}"
    if c.eigh_ratio <= WARN_FACTOR and c.storage_ratio <= WARN_FACTOR:
        return line, None
    keys = f"vision.model_kwargs.{c.model}.img_size (N) or vision.n_images" if c.domain == "vision" else "text.max_length (N) or text.n_rows"
    return line, (
        f"WARNING: {c.model} (N = {c.n_tokens}) needs {_ratio(c.eigh_ratio)}x the eigh work and {_ratio(c.storage_ratio)}x the activation "
        f"storage ({_si(c.storage_bytes, 'B')}) of {REFERENCE['name']} on {c.n_inputs} inputs; reduce it with {keys}."
    )


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


class Preflight:
    """What the scheduled jobs need, cost and ask of a node (module docstring); ``config_dir``: the repository's
    ``config/`` (the offline configurations the block names); ``main_process``: False in a cluster job (no cost lines)."""

    def __init__(self, config: dict, config_dir: str | os.PathLike, main_process: bool = True):
        self.config, self.config_dir, self.main_process = config, config_dir, main_process
        self.needed: dict[Requirement, None] = {}
        self.costed: set[str] = set()
        self.header = [HEADER, COLUMNS]
        self.requests: dict[str, dict] = {}
        self.training_total: list[float | None] = []

    def need(self, kind: str, name: str | None = None) -> None:
        """Register the inputs of one download (:func:`requirements`)."""
        self.needed.update(dict.fromkeys(requirements(kind, self.config, name)))

    def cost(self, model: str, cost: Callable[[], ModelCost | None]) -> None:
        """Print the line of ``cost()`` (None: unknown, no line) to stderr the first time ``model`` comes:
        the header before the first line; beyond :data:`WARN_FACTOR` times the reference, a warning
        naming the config keys that bring it down right under it."""
        if self.main_process and model not in self.costed:
            self.costed.add(model)
            if (c := cost()) is not None:
                print("\n".join([*self.header, *filter(None, _lines(c))]), file=sys.stderr)
                self.header = []

    def training(self, run: str, minutes: float | None, what: str) -> None:
        """One line per training run Snakemake schedules (stderr, dry runs too): what it trains and
        about how long it takes, so that a command starting hours of work says so before it starts."""
        if self.main_process and run not in self.costed:
            self.costed.add(run)
            if not self.training_total:
                print("Training runs scheduled (estimates from the runs measured on 2 cores, docs/training.md):", file=sys.stderr)
            self.training_total.append(minutes)
            estimate = f"about {minutes:.0f} min" if minutes is not None else "not estimated (ImageNet: days on a GPU)"
            total = sum(m for m in self.training_total if m is not None)
            print(f"  {run}: {what}, {estimate}; {len(self.training_total)} runs so far, about {total / 60:.1f} h in all", file=sys.stderr)

    def request(self, rule: str, threads: int, resources) -> None:
        """Record what a job of ``rule`` asks of a node from what its ``params`` function receives: its ``resources``
        (its rule's after ``--set-resources``, else ``--default-resources``; one not known yet, ``<TBD>``, counts
        as 0) and, without ``cpus_per_task``, its ``threads``. Each distinct request of a rule is checked once."""
        n = {k: v if isinstance(v := resources.get(k), int) else 0 for k in ("cpus_per_task", "mem_mb", "gpu")}
        req = {"cpus": n["cpus_per_task"] or threads, "mem_mb": n["mem_mb"], "gpu": n["gpu"], "partition": resources.get("slurm_partition") or None}
        self.requests[" ".join(map(str, (rule, *req.values())))] = req

    def stop_if_missing(self, probe: Callable[[str], bool] = network_reachable) -> None:
        """Print the block and exit with status 1 when a registered input is missing and cannot be downloaded."""
        try:
            check_missing(self.needed, self.config, self.config_dir, probe)
        except MissingInputsError as exc:
            sys.exit(str(exc))  # the block alone on stderr: a raised error would add Snakefile lines

    def check_requests(self) -> None:
        """Raise :class:`PreflightError` if a recorded ``cpus_per_task`` (or threads), ``mem_mb`` and ``gpu`` fit no node
        ``sinfo`` lists for its partition (the default one when none is set), or if ``sinfo`` lists none;
        ``KPCA_SLURM_PREFLIGHT=0`` skips it (a ``sinfo`` hiding nodes)."""
        if os.environ.get("KPCA_SLURM_PREFLIGHT", "1") == "0" or not self.requests:
            return
        skip = "set KPCA_SLURM_PREFLIGHT=0 to skip the check"
        try:
            nodes = parse_sinfo(subprocess.run(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G"], capture_output=True, text=True, timeout=30, check=True).stdout)
        except (OSError, subprocess.SubprocessError) as e:
            raise PreflightError(f"SLURM pre-flight: could not list the nodes with sinfo ({e}); {skip}") from e
        if not nodes:
            raise PreflightError(f"SLURM pre-flight: sinfo lists no nodes; {skip}")
        if found := problems(self.requests, nodes):
            raise PreflightError(
                "SLURM pre-flight: these requests fit on no node and would stay PENDING forever:\n  "
                + "\n  ".join(found)
                + "\nLower them in profiles/slurm/config.yaml (set-resources / set-threads) or pass --set-resources / --set-threads;"
                " a GPU request comes from `device` (set `device: cpu` on a cluster without GPUs)."
                " KPCA_SLURM_PREFLIGHT=0 skips this check."
            )
