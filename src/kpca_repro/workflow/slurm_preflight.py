"""Before any submission (profiles/slurm), each scheduled cluster rule's ``cpus_per_task`` (or
threads), ``mem_mb`` and ``gpu`` against the nodes ``sinfo`` lists for its partition (the
default one when none is set): SLURM accepts a job no node can hold and leaves it PENDING
forever (reason ``PartitionConfig``). Called by ``slurm_fit_check`` in
``workflow/rules/common.smk``; ``KPCA_SLURM_PREFLIGHT=0`` skips it (a ``sinfo`` hiding nodes).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from dataclasses import dataclass


class PreflightError(RuntimeError):
    """A request fits on no node, or the nodes cannot be listed."""


@dataclass(frozen=True)
class Node:
    name: str
    partitions: tuple[str, ...]
    default_partition: str | None
    cpus: int
    mem_mb: int
    gpus: int


def _gpus(gres: str) -> int:
    """Number of GPUs in a sinfo %G field: ``gpu:2``, ``gpu:a100:4(S:0-1)``, ``(null)``."""
    return sum(int(m.group(1)) for item in gres.split(",") if (m := re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())))


def parse_sinfo(text: str) -> list[Node]:
    """Nodes from ``sinfo -h -N -o '%N|%P|%c|%m|%G'`` (one line per node and partition)."""
    nodes: dict[str, dict] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, part, cpus, mem, gres = line.strip().split("|")
        n = nodes.setdefault(name, {"partitions": [], "default": None, "cpus": int(cpus), "mem": int(re.sub(r"\D", "", mem) or 0), "gres": gres})
        if part.endswith("*"):
            part = part[:-1]
            n["default"] = part
        n["partitions"].append(part)
    return [Node(k, tuple(v["partitions"]), v["default"], v["cpus"], v["mem"], _gpus(v["gres"])) for k, v in nodes.items()]


def query_nodes(timeout: float = 30) -> list[Node]:
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G"], capture_output=True, text=True, timeout=timeout, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise PreflightError(f"SLURM pre-flight: could not list the nodes with sinfo ({e}); set KPCA_SLURM_PREFLIGHT=0 to skip the check") from e
    nodes = parse_sinfo(out)
    if not nodes:
        raise PreflightError("SLURM pre-flight: sinfo lists no nodes; set KPCA_SLURM_PREFLIGHT=0 to skip the check")
    return nodes


def problems(requests: dict[str, dict], nodes: list[Node]) -> list[str]:
    """For each rule whose request fits no node of its partition, one line saying why."""
    default = next((n.default_partition for n in nodes if n.default_partition), None)
    out = []
    for key, req in sorted(requests.items()):
        rule = key.split()[0]
        part = req.get("partition") or default
        candidates = [n for n in nodes if part is None or part in n.partitions]
        if not candidates:
            out.append(f"{rule}: partition {part!r} has no nodes (sinfo lists partitions {sorted({p for n in nodes for p in n.partitions})})")
            continue
        if any(n.cpus >= req["cpus"] and n.mem_mb >= req["mem_mb"] and n.gpus >= req["gpu"] for n in candidates):
            continue
        biggest = f"cpus {max(n.cpus for n in candidates)}, mem_mb {max(n.mem_mb for n in candidates)}, gpus {max(n.gpus for n in candidates)}"
        out.append(f"{rule}: asks cpus_per_task {req['cpus']}, mem_mb {req['mem_mb']}, gpu {req['gpu']}; the largest node of partition {part!r} has {biggest}")
    return out


def _value(resource):
    """A resource as Snakemake holds it: a plain value, or a ``Resource`` (command line, profile)
    whose text may be an expression (``'cpu'``); None when unset or computed per job."""
    if not hasattr(resource, "is_evaluable") or not resource.is_evaluable():
        return getattr(resource, "value", None if callable(resource) else resource)
    try:
        return ast.literal_eval(resource.raw)
    except (ValueError, SyntaxError):
        return resource.raw


def rule_request(resources, defaults) -> dict:
    """A rule's request: its ``resources`` (after ``--set-resources`` / ``--set-threads``; ``_cores``:
    its threads), else the ``defaults`` (``--default-resources``)."""

    def get(name):
        own = _value(resources.get(name))
        return own if own is not None or defaults is None else _value(defaults.get(name))

    cpus = get("cpus_per_task") or _value(resources.get("_cores")) or 1
    return {"cpus": int(cpus), "mem_mb": int(get("mem_mb") or 0), "gpu": int(get("gpu") or 0), "partition": get("slurm_partition") or None}


def check_requests(requests: dict[str, dict]) -> None:
    """Raise PreflightError if a cluster rule's request (:func:`rule_request`) fits on no node."""
    if os.environ.get("KPCA_SLURM_PREFLIGHT", "1") == "0" or not requests:
        return
    found = problems(requests, query_nodes())
    if found:
        raise PreflightError(
            "SLURM pre-flight: these requests fit on no node and would stay PENDING forever:\n  "
            + "\n  ".join(found)
            + "\nLower them in profiles/slurm/config.yaml (set-resources / set-threads) or pass --set-resources / --set-threads;"
            " a GPU request comes from `device` (set `device: cpu` on a cluster without GPUs)."
            " KPCA_SLURM_PREFLIGHT=0 skips this check."
        )
