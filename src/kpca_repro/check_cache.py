"""The results of the costly configuration checks, kept on disk between Snakemake runs.

Every ``snakemake`` command (a dry run too) checks the configuration while it parses the
workflow (:mod:`kpca_repro.config_checks`). Building each vision model on the meta device and
reading each language model's ``config.json`` with transformers needs torch, timm and
transformers, whose imports alone cost seconds, for the same answer every time. A check that
passed is therefore recorded here, under a key that holds everything its answer depends on:
the model id and its ``model_kwargs`` (or the ``config.json`` content), the installed
versions of the packages that answer, and a fingerprint of this package's source (the
capture code decides what is supported). A later run with the same key skips the check.

Only successes are stored: a model that fails is checked again every time, and fails with
the same message. A missing, unreadable or corrupt entry is ignored (the check runs again and
rewrites it). Entries are JSON files ``<directory>/<sha256 of the key>.json`` written
atomically (a temporary file renamed into place), so concurrent runs never read half an
entry. The workflow keeps them in ``.snakemake/kpca_repro/checks`` of the working directory;
deleting that directory is always safe.

Light on purpose (standard library only): it runs before the costly imports it avoids.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path

__all__ = ["FORMAT", "WORKFLOW_CACHE_DIR", "CheckCache", "package_version", "library_fingerprint", "file_sha256"]

#: Stored with every key; changing the layout of the entries changes it.
FORMAT = 1

#: Where the workflow keeps its entries, relative to the working directory (the rule files'
#: configuration checks, and the jobs' count of torch's default threads).
WORKFLOW_CACHE_DIR = os.path.join(".snakemake", "kpca_repro", "checks")


@functools.cache
def package_version(name: str) -> str:
    """The installed version of a distribution (``"timm"``), or ``"not installed"``; no import."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


@functools.cache
def library_fingerprint() -> str:
    """SHA-256 over the names and contents of this package's ``.py`` files.

    Any edit of the library (the capture code that decides what is supported above all)
    gives a new fingerprint, so no cached check outlives the code that made it.
    """
    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a (small) file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class CheckCache:
    """Passed checks, one JSON file per key, in ``directory`` (None: nothing is kept).

    Args:
        directory: where the entries live (created on the first write); None disables the
            cache: :meth:`get` finds nothing and :meth:`put` keeps nothing.
    """

    def __init__(self, directory: str | os.PathLike | None):
        self.directory = None if directory is None else Path(directory)

    @staticmethod
    def _canonical(key: dict) -> str:
        return json.dumps({"format": FORMAT, **key}, sort_keys=True, separators=(",", ":"), default=str)

    def _path(self, canonical: str) -> Path:
        return self.directory / f"{hashlib.sha256(canonical.encode()).hexdigest()}.json"

    def get(self, key: dict) -> dict | None:
        """The value stored for ``key``, or None (no cache, no entry, or an unreadable one).

        Args:
            key: JSON-serializable description of everything the check depends on.
        """
        if self.directory is None:
            return None
        canonical = self._canonical(key)
        try:
            entry = json.loads(self._path(canonical).read_text(encoding="utf-8"))
        except (OSError, ValueError):  # missing, unreadable, not UTF-8 or not JSON
            return None
        if not isinstance(entry, dict) or entry.get("key") != canonical or not isinstance(entry.get("value"), dict):
            return None
        return entry["value"]

    def put(self, key: dict, value: dict) -> None:
        """Record that the check described by ``key`` passed with ``value`` (a JSON-serializable
        dict). Atomic; a cache that cannot be written is left alone (the check simply runs
        again next time)."""
        if self.directory is None:
            return
        canonical = self._canonical(key)
        target = self._path(canonical)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"key": canonical, "value": value}, f)
                os.replace(tmp, target)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            pass
