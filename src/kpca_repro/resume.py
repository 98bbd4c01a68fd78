"""Finished work of an interrupted job, kept beside its output so that a rerun goes on from there.

A long job (the KPCA records or the eigenvalues of one activation file, an extraction's forward
batches) keeps each finished batch of results in a :class:`PartStore` directory next to its
output. A rerun of the same job (the same key: its inputs, parameters and code) reads those parts
back instead of computing them again, so an interrupted, killed or preempted job loses at most the
batch it was computing. A part is written under a temporary name and renamed, so a kill during the
write leaves nothing a rerun would read. Parts of another key are deleted before the job starts;
the job deletes the directory when its output is written. No pickles: parts are ``.npz`` files of
plain arrays read with ``allow_pickle=False``, the key a JSON file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np

from kpca_repro.errors import JobInterrupted

__all__ = ["PartStore", "JobInterrupted", "file_identity"]


def file_identity(path: str | os.PathLike) -> dict:
    """What identifies an input file for a store's key without reading it: path, size, modification time (ns)."""
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


class PartStore:
    """A directory of the finished parts of one job, valid for one key.

    Args:
        directory: where the parts live (created; a sibling of the job's output).
        key: everything the parts depend on (JSON-serialisable: input identities, parameters,
            code hash). A directory holding parts of another key is emptied first.

    Raises:
        OSError: the directory cannot be created or written (named in the message).
    """

    KEY_FILE = "key.json"

    def __init__(self, directory: str | os.PathLike, key: dict):
        self.directory = Path(directory)
        self.key = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
        if self.directory.is_dir() and self._stored_key() != self.key:
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        key_file = self.directory / self.KEY_FILE
        if not key_file.exists():
            tmp = key_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"sha256": self.key}) + "\n")
            os.replace(tmp, key_file)

    def _stored_key(self) -> str | None:
        try:
            return json.loads((self.directory / self.KEY_FILE).read_text())["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _path(self, index: int) -> Path:
        return self.directory / f"part_{index:06d}.npz"

    def __len__(self) -> int:
        return sum(
            1 for _ in self.directory.glob("part_[0-9][0-9][0-9][0-9][0-9][0-9].npz")
        )  # not a .tmp.npz an interrupt left

    def finished(self) -> int:
        """How many parts ``0, 1, ...`` are kept in a row: a job that keeps its batches in order goes on after them."""
        n = 0
        while self._path(n).exists():
            n += 1
        return n

    def load(self, index: int) -> dict[str, np.ndarray] | None:
        """Part ``index`` as name -> array, or None when it was not kept (or cannot be read)."""
        path = self._path(index)
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as npz:
                return {name: npz[name] for name in npz.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile):
            return None  # a damaged part is computed again

    def save(self, index: int, arrays: dict[str, np.ndarray]) -> None:
        """Keep part ``index`` (name -> array of a plain dtype), atomically."""
        path = self._path(index)
        tmp = path.with_name(f"{path.stem}.tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)

    def remove(self) -> None:
        """Delete the directory (the job's output is written)."""
        shutil.rmtree(self.directory, ignore_errors=True)
