"""Passed configuration checks kept on disk between runs (their imports of torch, timm and
transformers alone cost seconds), and file hashes; standard library only. A pass is stored under
a key holding everything its answer depends on (model, ``config.json`` content, installed
versions, this package's source), as ``<directory>/<sha256 of key>.json``; a missing or corrupt
entry is ignored. The workflow keeps them in the user's cache directory (:data:`CHECK_CACHE_DIR`),
so that every working directory and clone on the machine shares them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

__all__ = ["CACHE_DIR_ENV", "CHECK_CACHE_DIR", "FORMAT", "check_cache_dir", "CheckCache", "package_version", "library_fingerprint", "sha256_file"]

#: Stored with every key; changing the layout of the entries changes it.
FORMAT = 1

#: The environment variable that names the directory of the passed checks.
CACHE_DIR_ENV = "KPCA_REPRO_CACHE_DIR"


def check_cache_dir() -> str:
    """Where the workflow keeps passed checks: ``$KPCA_REPRO_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/kpca_repro/checks``, else ``~/.cache/kpca_repro/checks`` (the XDG default).

    Per user, not per working directory: an entry's key holds everything its answer depends on
    (machine-dependent answers such as torch's default thread count include the host name), so
    a new working directory or clone need not import torch and timm again to repeat them.
    """
    if os.environ.get(CACHE_DIR_ENV):
        return os.environ[CACHE_DIR_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kpca_repro", "checks")


#: :func:`check_cache_dir` when this module was imported (jobs inherit the environment, so they agree).
CHECK_CACHE_DIR = check_cache_dir()


@functools.cache
def package_version(name: str) -> str:
    """The installed version of a distribution (``"timm"``), or ``"not installed"``; no import."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


@functools.cache
def library_fingerprint() -> str:
    """SHA-256 over the names and contents of this package's ``.py`` files."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class CheckCache:
    """Passed checks, one JSON file per key, in ``directory`` (None: nothing is kept)."""

    def __init__(self, directory: str | os.PathLike | None):
        self.directory = None if directory is None else Path(directory)

    def _entry(self, key: dict) -> tuple[str, Path]:
        """The canonical JSON of ``key`` (with :data:`FORMAT`) and the file of its entry."""
        canonical = json.dumps({"format": FORMAT, **key}, sort_keys=True, separators=(",", ":"), default=str)
        return canonical, self.directory / f"{hashlib.sha256(canonical.encode()).hexdigest()}.json"

    def get(self, key: dict) -> dict | None:
        """The value stored for ``key``, or None (no cache, no entry, or an unreadable one)."""
        if self.directory is None:
            return None
        canonical, path = self._entry(key)
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # missing, unreadable, not UTF-8 or not JSON
            return None
        return entry["value"] if isinstance(entry, dict) and entry.get("key") == canonical and isinstance(entry.get("value"), dict) else None

    def put(self, key: dict, value: dict) -> None:
        """Record that the check ``key`` passed with ``value`` (JSON); atomic, and nothing when unwritable."""
        if self.directory is None:
            return
        canonical, target = self._entry(key)
        tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"key": canonical, "value": value}), encoding="utf-8")
            os.replace(tmp, target)
        except OSError:
            tmp.unlink(missing_ok=True)
