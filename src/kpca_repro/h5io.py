"""HDF5 activation files and atomic writing of every output.

Layout of one activation file (one model, one image shard)::

    /                      attrs: model_id, weights_sha256, weights_file, n_layers, n_heads,
                                  head_dim, n_tokens, n_prefix_tokens, inputs (JSON list),
                                  preprocessing (JSON), versions (JSON), shard, n_shards, ...
                           vision files also: attention_scale (the logit scale s = 1/sqrt(d)),
                                  capture_adapter (how q, k, v were taken), capture_rtol,
                                  capture_max_rel_error, capture_max_abs_error,
                                  capture_heads_checked, capture_check (the invariant below)
    /sample_rank           (B,) int64   rank of each image in the sampled list
    /dataset_index         (B,) int64   index of each image in the ordered dataset
    /layers/<LL>/q|k|v|h   (B, H, N, d) float32, chunked (1, H, N, d)
    /attention_mask        (B, N) int64, 1 = real token (language models only; N = the
                           padded length the attention modules see)

``q, k`` are the per-head queries and keys as the attention's dot product uses them (vision:
after the qkv projection, any q/k normalisation and any rotary embedding;
:mod:`kpca_repro.capture.vision`), ``v`` the values, and ``h`` the per-head attention output before
anything acts on the concatenated heads (a sub-LN, the output projection). In vision files
every batch was checked before it was written: ``max |h - softmax(s q k^T) v| / max |v|``
over all heads of the batch's first and last image, in every layer, is at most
``capture_rtol`` (:mod:`kpca_repro.capture.invariant`); ``capture_max_rel_error`` is the largest value
measured in the file. Every dataset is written with ``track_times=False`` so identical runs
give identical files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np

from kpca_repro.errors import InputFileError

__all__ = ["BATCH_FIRST", "SEQUENCE_FIRST", "PDF_METADATA", "atomic_output", "atomic_directory", "ActivationWriter", "ActivationFile", "CorruptActivationFileError", "TENSORS"]

#: Seq-first or batch-first projections of a language model, as recorded in the attribute
#: ``hooked_layout`` (:mod:`kpca_repro.capture.hf_capture`).
BATCH_FIRST, SEQUENCE_FIRST = "batch_first", "sequence_first"

#: ``savefig(..., metadata=PDF_METADATA)``: no creation date in PDFs, so identical runs give
#: identical bytes (PNG files carry no timestamp).
PDF_METADATA = {"CreationDate": None}

TENSORS = ("q", "k", "v", "h")


class CorruptActivationFileError(InputFileError, OSError):
    """An activation file is truncated, corrupt or lacks the expected layout."""


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it to ``path`` only if the block succeeds.

    An interrupted or failed job therefore never leaves a file under the final name that a
    rerun would trust. The temporary file is removed on failure.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.stem}.partial{final.suffix}")  # keeps the extension (matplotlib reads it)
    if tmp.exists():
        tmp.unlink()
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory; it replaces ``path`` only if the block succeeds.

    For downloads that fill a whole folder: an interrupted or failed download never leaves a
    half-filled folder under the final name. The temporary folder is removed on failure.
    """
    import shutil
    import tempfile

    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _layer_key(layer: int) -> str:
    return f"layers/{layer:02d}"


class ActivationWriter:
    """Write per-layer q, k, v, h of one model and image shard into an open HDF5 file.

    Args:
        f: an ``h5py.File`` open for writing.
        n_images, n_layers, n_heads, n_tokens, head_dim: the shape of the shard.
        attrs: root attributes; non-string values are stored as JSON.
    """

    def __init__(self, f: h5py.File, n_images: int, n_layers: int, n_heads: int, n_tokens: int, head_dim: int, attrs: dict):
        self.f = f
        shape = (n_images, n_heads, n_tokens, head_dim)
        for name, value in attrs.items():
            f.attrs[name] = value if isinstance(value, (str, int, float, np.integer, np.floating)) else json.dumps(value, sort_keys=True)
        for layer in range(n_layers):
            grp = f.create_group(_layer_key(layer), track_order=False)
            for t in TENSORS:
                grp.create_dataset(t, shape=shape, dtype="float32", chunks=(1, *shape[1:]), track_times=False)

    def write_index(self, name: str, values: np.ndarray) -> None:
        """Store a per-image integer vector (``sample_rank``, ``dataset_index``)."""
        self.f.create_dataset(name, data=np.asarray(values, dtype=np.int64), track_times=False)

    def write_attention_mask(self, mask: np.ndarray) -> None:
        """Store the ``(B, N)`` attention mask of a language-model shard (1 = real token, 0 = padding)."""
        self.f.create_dataset("attention_mask", data=np.asarray(mask, dtype=np.int64), track_times=False)

    def write_batch(self, layer: int, start: int, tensors: dict[str, np.ndarray]) -> None:
        """Write ``tensors[t]`` of shape ``(b, H, N, d)`` for images ``start .. start+b``."""
        grp = self.f[_layer_key(layer)]
        for t in TENSORS:
            arr = tensors[t]
            grp[t][start : start + arr.shape[0]] = arr


class ActivationFile:
    """Read an activation file layer by layer.

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
                grp = self.f[_layer_key(layer)]
                for t in TENSORS:
                    _ = grp[t].shape
            self.sample_rank = self.f["sample_rank"][:]
            self.dataset_index = self.f["dataset_index"][:]
            #: ``(B, N)`` int64 attention mask of a language-model file; None for vision files.
            self.attention_mask = self.f["attention_mask"][:] if "attention_mask" in self.f else None
        except (OSError, KeyError, ValueError) as exc:
            raise CorruptActivationFileError(f"activation file {self.path} is unreadable, truncated or incomplete ({exc}); delete it and rerun the extraction rule") from exc

    def attr_json(self, name: str):
        """A root attribute decoded from JSON."""
        return json.loads(self.attrs[name])

    def read(self, layer: int, names: tuple[str, ...] = TENSORS, images: slice | None = None) -> dict[str, np.ndarray]:
        """Arrays ``(B, H, N, d)`` float32 of one layer.

        ``images`` (a slice over the file's images) reads only those images, so a reader can
        stream a layer in image blocks (one HDF5 chunk per image) and keep its memory
        independent of the number of images.

        Raises:
            CorruptActivationFileError: a chunk cannot be read; the message names the file.
        """
        sel = slice(None) if images is None else images
        try:
            grp = self.f[_layer_key(layer)]
            return {t: grp[t][sel] for t in names}
        except (OSError, KeyError, ValueError) as exc:
            raise CorruptActivationFileError(f"activation file {self.path}: cannot read layer {layer} ({exc}); delete it and rerun the extraction rule") from exc

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> "ActivationFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
