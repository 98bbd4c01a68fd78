"""A rerun after a killed run goes on without ``snakemake --unlock`` (docs/running.md, "An interrupted run").

While it runs, Snakemake locks the files of its jobs in ``.snakemake/locks/`` of the working
directory (``<n>.input.lock``, ``<n>.output.lock``) and deletes that folder when it ends. A SIGKILL,
an out-of-memory kill or a power loss leaves the folder behind, and every later run stops with
Snakemake's ``LockException`` until ``snakemake --unlock`` deletes it. Snakemake cannot tell a lock
left by a dead process from one of a running process: its lock files name files, not processes.

So the Snakefile's onstart handler, which Snakemake calls while it holds the lock, records the
holder in the same folder (:func:`record_owner`: host name and process id; Snakemake reads only its
numbered lock files, and deletes this one with them). While the next run is parsed,
:func:`remove_stale_lock` deletes the folder, as ``--unlock`` does, when each process recorded there
ran on this host and has ended, and no lock file is newer than the newest record (a run that locked
after it but has not reached its onstart handler yet). Otherwise the folder stays and Snakemake
decides, as without this module.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

__all__ = ["LOCK_DIR", "record_owner", "remove_stale_lock"]

#: Snakemake's lock folder, relative to the working directory.
LOCK_DIR = Path(".snakemake") / "locks"
_OWNER = "kpca_repro.owner."


def _lock_files(lock_dir: Path) -> list[Path]:
    return [p for p in lock_dir.glob("*.lock") if p.name.split(".", 1)[0].isdigit()]


def record_owner(lock_dir: str | os.PathLike = LOCK_DIR, pid: int | None = None) -> Path | None:
    """Record that process ``pid`` (default: this one) on this host holds the lock in ``lock_dir``.

    Returns:
        The record's path, or None when there is no lock to record (``--nolock``).
    """
    lock_dir = Path(lock_dir)
    if not lock_dir.is_dir() or not _lock_files(lock_dir):
        return None
    record = lock_dir / f"{_OWNER}{socket.gethostname()}.{os.getpid() if pid is None else pid}"
    record.write_text("")
    return record


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_lock(lock_dir: str | os.PathLike = LOCK_DIR) -> list[int]:
    """Delete ``lock_dir`` when it holds only the lock of ended processes (module docstring).

    Returns:
        The process ids of the ended runs whose lock was deleted; empty when nothing was deleted
        (no lock, a lock of a running or unrecorded process, or one recorded on another host).
    """
    lock_dir = Path(lock_dir)
    if not lock_dir.is_dir():
        return []
    locks, records = _lock_files(lock_dir), list(lock_dir.glob(f"{_OWNER}*"))
    if not locks or not records:
        return []
    host, pids = socket.gethostname(), []
    for record in records:
        record_host, _, pid = record.name[len(_OWNER) :].rpartition(".")
        if record_host != host or not pid.isdigit() or _running(int(pid)):
            return []
        pids.append(int(pid))
    if max(p.stat().st_mtime for p in locks) > max(r.stat().st_mtime for r in records):
        return []
    shutil.rmtree(lock_dir, ignore_errors=True)
    return sorted(pids)
