"""The results of the costly configuration checks, kept on disk between Snakemake runs.

Building each vision model on the meta device or reading a language model's ``config.json``
with transformers needs torch, timm and transformers, whose imports alone cost seconds, for the
same answer every time. A check that passed is recorded under a key holding everything its
answer depends on (model id and ``model_kwargs`` or the ``config.json`` content, the installed
versions, a fingerprint of this package's source); a later run with the same key skips it. Only
successes are stored; a missing or corrupt entry is ignored. Entries are JSON files
``<directory>/<sha256 of the key>.json``, written atomically; the workflow keeps them in
``.snakemake/kpca_repro/checks`` (always safe to delete). Standard library only.
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
    """SHA-256 over the names and contents of this package's ``.py`` files."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a (small) file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class CheckCache:
    """Passed checks, one JSON file per key, in ``directory`` (None: nothing is kept)."""

    def __init__(self, directory: str | os.PathLike | None):
        self.directory = None if directory is None else Path(directory)

    @staticmethod
    def _canonical(key: dict) -> str:
        return json.dumps({"format": FORMAT, **key}, sort_keys=True, separators=(",", ":"), default=str)

    def _path(self, canonical: str) -> Path:
        return self.directory / f"{hashlib.sha256(canonical.encode()).hexdigest()}.json"

    def get(self, key: dict) -> dict | None:
        """The value stored for ``key``, or None (no cache, no entry, or an unreadable one)."""
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
