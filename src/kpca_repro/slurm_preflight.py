"""Pre-flight check of SLURM requests against the cluster's nodes (profiles/slurm).

SLURM accepts a job that asks for more CPUs per task than any node of its partition has and
leaves it PENDING forever (reason ``PartitionConfig``), and Snakemake then waits forever. Before
any job is submitted, the Snakefile's ``onstart`` handler (``slurm_fit_check`` in
``workflow/rules/common.smk``, active only with the ``slurm`` executor) calls :func:`check_jobs`. It compares every cluster job's ``cpus_per_task``
(or threads), ``mem_mb`` and ``gpu`` with the nodes ``sinfo`` reports for the job's partition
(the default partition when none is set), and stops the run with one message naming each
rule that cannot fit and what the largest node offers.

Set ``KPCA_SLURM_PREFLIGHT=0`` to skip it (e.g. on a cluster whose ``sinfo`` hides nodes).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass


class PreflightError(RuntimeError):
    pass


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
    total = 0
    for item in gres.split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        if m:
            total += int(m.group(1))
    return total


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


def job_request(job) -> dict:
    res = job.resources
    cpus = res.get("cpus_per_task") or job.threads or 1
    return {"cpus": int(cpus), "mem_mb": int(res.get("mem_mb") or 0), "gpu": int(res.get("gpu") or 0), "partition": res.get("slurm_partition") or None}


def check_jobs(jobs) -> None:
    """Raise PreflightError if a cluster job (not ``localrule``) can fit on no node."""
    if os.environ.get("KPCA_SLURM_PREFLIGHT", "1") == "0":
        return
    requests: dict[str, dict] = {}  # one entry per rule and distinct request
    for job in jobs:
        if job.is_local:
            continue
        req = job_request(job)
        requests.setdefault(f"{job.rule.name} {req['cpus']}/{req['mem_mb']}/{req['gpu']}/{req['partition']}", req)
    if not requests:
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
