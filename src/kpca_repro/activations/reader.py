"""The reader of activation files: every stage that reads q, k, v, h reads them here (format version 1 or 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from kpca_repro.activations.format import TENSORS, CorruptActivationFileError, _heads_layout, layer_key

__all__ = ["ActivationFile"]


class ActivationFile:
    """Read an activation file layer by layer (format version 1 or 2).

    Attributes:
        attrs: the root attributes; n_layers; sample_rank, dataset_index ``(B,)`` int64;
            attention_mask ``(B, N)`` int64 of a language-model file, None for vision files.
        causal: True when query i attends to keys j <= i only (a decoder); False for
            version-1 files.
        n_kv_heads: heads of ``k`` and ``v`` (``n_heads`` for version-1 files).
        kv_head_of_query: ``(n_heads,)`` int64, the KV head each query head reads
            (``arange(n_heads)`` for version-1 files).

    Raises:
        CorruptActivationFileError: on open, if the file is unreadable, truncated or lacks the
            layout; the message names the file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.f = h5py.File(self.path, "r")
            self.attrs = {k: self.f.attrs[k] for k in self.f.attrs}
            self.n_layers = int(self.attrs["n_layers"])
            for layer in range(self.n_layers):
                grp = self.f[layer_key(layer)]
                for t in TENSORS:
                    _ = grp[t].shape
            self.sample_rank = self.f["sample_rank"][:]
            self.dataset_index = self.f["dataset_index"][:]
            self.attention_mask = self.f["attention_mask"][:] if "attention_mask" in self.f else None
            self.causal, self.n_kv_heads, self.kv_head_of_query = _heads_layout(self.attrs)
        except (OSError, KeyError, ValueError) as exc:
            raise CorruptActivationFileError(
                f"activation file {self.path} is unreadable, truncated or incomplete ({exc}); delete it and rerun "
                "the extraction rule"
            ) from exc

    def attr_json(self, name: str):
        """A root attribute decoded from JSON."""
        return json.loads(self.attrs[name])

    def read(self, layer: int, names: tuple[str, ...] = TENSORS, images: slice | None = None) -> dict[str, np.ndarray]:
        """Arrays float32 of one layer: ``q``, ``h`` ``(B, n_heads, N, d)``, ``k``, ``v`` ``(B, n_kv_heads, N, d)``.

        ``images`` (a slice over the file's inputs) reads only those, so a reader can stream a
        layer in input blocks (one HDF5 chunk per input) and keep its memory independent of B.

        Raises:
            CorruptActivationFileError: a chunk cannot be read; the message names the file.
        """
        sel = slice(None) if images is None else images
        try:
            grp = self.f[layer_key(layer)]
            return {t: grp[t][sel] for t in names}
        except (OSError, KeyError, ValueError) as exc:
            raise CorruptActivationFileError(
                f"activation file {self.path}: cannot read layer {layer} ({exc}); delete it and rerun the extraction "
                "rule"
            ) from exc

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> ActivationFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
