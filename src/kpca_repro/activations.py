"""The activation file format (docs/activations.md): its version, a writer, a validator and the
installation of a user's files into the pipeline.

The KPCA stage (:mod:`kpca_repro.method.records`), the spectra and the norms read nothing but this
HDF5 layout, so any model whose per-head ``q, k, v, h`` are written in it can be analysed,
whatever produced them (timm, Hugging Face, a hand-written module, JAX)::

    /                      attrs: format_version (int, 1), model_id (str), n_layers, n_heads,
                                  head_dim, n_tokens (int); optional: attention_scale (float,
                                  must be 1/sqrt(head_dim)), weights_sha256, shard, n_shards,
                                  capture_rtol, capture_max_rel_error, ...
    /sample_rank           (B,) integer, distinct
    /dataset_index         (B,) integer
    /layers/<LL>/q|k|v|h   (B, n_heads, n_tokens, head_dim) float32, LL = 00, 01, ...
    /attention_mask        (B, n_tokens) integer 0/1 (language-model files only; 1 = real token)

Files the pipeline's extraction wrote before ``format_version`` existed carry no such
attribute; they are version 1 (:data:`FORMAT_VERSION`). Command line::

    python -m kpca_repro.activations validate FILE [--kind vision|text] [--no-invariant]

prints ``ok`` and a summary (exit 0) or the first violation and its fix (exit 1).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from kpca_repro.errors import InputFileError

__all__ = [
    "FORMAT_VERSION",
    "REQUIRED_ATTRS",
    "KINDS",
    "ActivationFormatError",
    "Summary",
    "validate",
    "write_activations",
    "install_user_file",
    "check_user_config",
    "main",
]

#: The version of the layout this module writes and reads (attribute ``format_version``).
FORMAT_VERSION = 1
#: Root attributes every file must carry, with their type.
REQUIRED_ATTRS = {"model_id": str, "n_layers": int, "n_heads": int, "head_dim": int, "n_tokens": int}
#: ``vision``: every stored token is real (Table 1 form); ``text``: ``/attention_mask`` marks
#: padding (Table 4 form).
KINDS = ("vision", "text")
_TENSORS = ("q", "k", "v", "h")
_SCALE_RTOL = 1e-6  # float32 round-off of 1/sqrt(d) as another tool may have stored it


class ActivationFormatError(InputFileError, ValueError):
    """A file violates the activation format; the message names the first violation and the fix."""

    def __init__(self, path, violation: str, fix: str):
        self.violation, self.fix = violation, fix
        super().__init__(f"{path}: {violation}. Fix: {fix} (docs/activations.md)")


@dataclass
class Summary:
    """What :func:`validate` found in a valid file.

    Attributes:
        format_version: 1 (also for pipeline files written before the attribute existed).
        model_id, kind (``vision`` or ``text``), n_inputs (B), n_layers, n_heads, n_tokens, head_dim.
        attention_scale: the logit scale ``s`` (1/sqrt(head_dim)).
        capture_max_rel_error: the invariant's largest measured ``max|h - h_hat| / max|v|``
            over every input, layer and head (None when not checked).
        attrs: the file's root attributes.
    """

    format_version: int
    model_id: str
    kind: str
    n_inputs: int
    n_layers: int
    n_heads: int
    n_tokens: int
    head_dim: int
    attention_scale: float
    capture_max_rel_error: float | None = None
    attrs: dict = field(default_factory=dict, repr=False)

    def line(self) -> str:
        err = "not checked" if self.capture_max_rel_error is None else f"{self.capture_max_rel_error:.3g} x max|v|"
        return (
            f"ok: format_version {self.format_version}, model_id {self.model_id!r}, {self.kind}, "
            f"{self.n_inputs} inputs x {self.n_layers} layers x {self.n_heads} heads, N = {self.n_tokens}, "
            f"d = {self.head_dim}, s = {self.attention_scale:.6g}, capture error {err}"
        )


def _layer_key(layer: int) -> str:
    return f"layers/{layer:02d}"


def _as_int(value):
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    return None


def validate(path: str | os.PathLike, *, kind: str | None = None, check_invariant: bool = True, tolerance: float | None = None) -> Summary:
    """Check one activation file against format version 1; stop at the first violation.

    Checked in this order: readable HDF5; ``format_version`` (absent = 1); the required
    attributes and their types; ``attention_scale`` = 1/sqrt(head_dim) when present;
    ``sample_rank`` / ``dataset_index`` (``(B,)`` integer, ranks distinct); every layer's
    ``q, k, v, h`` (``(B, n_heads, n_tokens, head_dim)`` float32, finite); ``attention_mask``
    (``(B, n_tokens)`` 0/1, at least one real token per input; required for ``kind="text"``,
    forbidden for ``kind="vision"``); then, with ``check_invariant``, the capture invariant on
    every input, layer and head (:func:`kpca_repro.capture.invariant.attention_invariant`, float64)::

        max |h - softmax(s q k^T + mask) v| / max |v|  <=  tolerance  (default 1e-4)

    with ``mask`` = -inf on padded keys and padded queries not compared.

    Args:
        path: the HDF5 file.
        kind: ``"vision"``, ``"text"`` or None (read from the presence of ``attention_mask``).
        check_invariant: recompute h from q, k, v (reads every tensor once, float64 on the CPU).
        tolerance: largest accepted relative error (default
            :data:`kpca_repro.capture.invariant.INVARIANT_RTOL`).

    Returns:
        :class:`Summary`.

    Raises:
        ActivationFormatError: the first violation, with its fix.
        kpca_repro.capture.invariant.ActivationFileMismatchError: a ``CaptureMismatchError``: the
            stored q, k, v do not reproduce h (the message gives the measured error, the layer,
            input and head, and the fix).
    """
    path = Path(path)
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not path.is_file():
        raise ActivationFormatError(path, "no such file", "give the path of an existing HDF5 file")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise ActivationFormatError(path, f"not a readable HDF5 file ({exc})", "write it with h5py (kpca_repro.activations.write_activations)") from None
    with f:
        # numpy scalars as Python values, so messages read "is 2", not "is np.int64(2)"
        attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}
        version = attrs.get("format_version", FORMAT_VERSION)
        if _as_int(version) != FORMAT_VERSION:
            raise ActivationFormatError(
                path, f"format_version is {version!r}, this pipeline reads version {FORMAT_VERSION}", f"write the layout of version {FORMAT_VERSION} and set format_version = {FORMAT_VERSION}"
            )
        for name, typ in REQUIRED_ATTRS.items():
            if name not in attrs:
                raise ActivationFormatError(path, f"root attribute {name!r} is missing", f"set f.attrs[{name!r}] ({typ.__name__})")
            value = attrs[name]
            ok = isinstance(value, str) and bool(value) if typ is str else (_as_int(value) is not None and _as_int(value) > 0)
            if not ok:
                want = "a non-empty string" if typ is str else "a positive integer"
                raise ActivationFormatError(path, f"root attribute {name!r} is {value!r}, not {want}", f"store {name} as {want}")
        n_layers, n_heads, n_tokens, d = (int(attrs[k]) for k in ("n_layers", "n_heads", "n_tokens", "head_dim"))
        scale = float(attrs.get("attention_scale", 1.0 / math.sqrt(d)))
        if not abs(scale * math.sqrt(d) - 1.0) <= _SCALE_RTOL:
            raise ActivationFormatError(
                path,
                f"attention_scale is {scale:g}, not 1/sqrt(head_dim) = {1 / math.sqrt(d):g} (the KPCA kernels use s = 1/sqrt(d))",
                f"store q multiplied by attention_scale * sqrt(head_dim) = {scale * math.sqrt(d):g} and set attention_scale = 1/sqrt(head_dim)",
            )
        for name in ("sample_rank", "dataset_index"):
            if name not in f or not isinstance(f[name], h5py.Dataset):
                raise ActivationFormatError(path, f"dataset /{name} is missing", f"store /{name} as a (B,) integer array (0..B-1 if you have no other numbering)")
        ranks, index = f["sample_rank"], f["dataset_index"]
        if ranks.ndim != 1 or not np.issubdtype(ranks.dtype, np.integer):
            raise ActivationFormatError(path, f"/sample_rank has shape {ranks.shape} and dtype {ranks.dtype}", "store a (B,) integer array")
        n_in = ranks.shape[0]
        if n_in == 0:
            raise ActivationFormatError(path, "/sample_rank is empty (no inputs)", "store at least one input")
        if index.shape != (n_in,) or not np.issubdtype(index.dtype, np.integer):
            raise ActivationFormatError(path, f"/dataset_index has shape {index.shape} and dtype {index.dtype}, /sample_rank has {n_in} inputs", f"store a ({n_in},) integer array")
        if len(np.unique(ranks[:])) != n_in:
            raise ActivationFormatError(path, "/sample_rank has repeated values", "number the inputs 0..B-1 (ranks identify the rows of the per-head records)")
        shape = (n_in, n_heads, n_tokens, d)
        for layer in range(n_layers):
            for t in _TENSORS:
                key = f"{_layer_key(layer)}/{t}"
                if key not in f or not isinstance(f[key], h5py.Dataset):
                    raise ActivationFormatError(path, f"dataset /{key} is missing (n_layers = {n_layers})", f"store /{key} as {shape} float32, or correct n_layers")
                ds = f[key]
                if ds.shape != shape:
                    raise ActivationFormatError(
                        path, f"/{key} has shape {ds.shape}, expected (B, n_heads, n_tokens, head_dim) = {shape}", "store per-head tensors batch-first, heads before tokens, or correct the attributes"
                    )
                if ds.dtype != np.float32:
                    raise ActivationFormatError(path, f"/{key} has dtype {ds.dtype}", "store float32 (e.g. arr.astype(np.float32))")
        mask = None
        if "attention_mask" in f:
            m = f["attention_mask"]
            if m.shape != (n_in, n_tokens) or not (np.issubdtype(m.dtype, np.integer) or m.dtype == np.bool_):
                raise ActivationFormatError(path, f"/attention_mask has shape {m.shape} and dtype {m.dtype}", f"store a ({n_in}, {n_tokens}) integer array, 1 = real token, 0 = padding")
            mask = m[:]
            if not np.isin(mask, (0, 1)).all():
                raise ActivationFormatError(path, "/attention_mask holds values other than 0 and 1", "store 1 for real tokens and 0 for padding")
            if (mask.sum(axis=1) == 0).any():
                raise ActivationFormatError(path, f"/attention_mask has an input without real tokens (input {int(np.flatnonzero(mask.sum(axis=1) == 0)[0])})", "drop that input")
        found = "text" if mask is not None else "vision"
        if kind == "text" and mask is None:
            raise ActivationFormatError(path, "kind text but /attention_mask is missing", f"store /attention_mask ({n_in}, {n_tokens}) (all ones when nothing is padded), or declare kind: vision")
        if kind == "vision" and mask is not None:
            raise ActivationFormatError(path, "kind vision but the file has /attention_mask", "declare kind: text (the Table 4 form), or remove /attention_mask when every token is real")
        worst = None
        for layer in range(n_layers):
            t = {name: f[f"{_layer_key(layer)}/{name}"][:] for name in _TENSORS}
            for name, arr in t.items():
                if not np.isfinite(arr).all():
                    bad = np.argwhere(~np.isfinite(arr))[0]
                    raise ActivationFormatError(
                        path,
                        f"/{_layer_key(layer)}/{name} has a non-finite value at input {bad[0]}, head {bad[1]}, token {bad[2]}",
                        "store finite values (a NaN or inf from the model cannot be analysed)",
                    )
            if check_invariant:
                err = _check_layer(path, attrs["model_id"], layer, t, scale, mask, tolerance)
                worst = err if worst is None else max(worst, err)
    return Summary(FORMAT_VERSION, str(attrs["model_id"]), found, n_in, n_layers, n_heads, n_tokens, d, scale, worst, attrs)


def _check_layer(path, model_id, layer, t, scale, mask, tolerance) -> float:
    """The capture invariant on every input and head of one layer; returns the relative error.

    Raises:
        kpca_repro.capture.invariant.ActivationFileMismatchError: the invariant fails (a
            ``CaptureMismatchError`` that is also a bad input file: one line, the file, the fix).
    """
    from kpca_repro.capture.invariant import INVARIANT_RTOL, ActivationFileMismatchError, attention_invariant, attention_mask_matrix

    tolerance = INVARIANT_RTOL if tolerance is None else tolerance
    allowed = attention_mask_matrix(t["q"].shape[2], key_mask=mask) if mask is not None else None
    res = attention_invariant(t["q"], t["k"], t["v"], t["h"], scale=scale, allowed=allowed, query_mask=mask)
    if not res.max_rel_error <= tolerance:
        b, head = res.worst
        raise ActivationFileMismatchError(
            f"{path} ({model_id!r}): the stored q, k, v of layer {layer} do not reproduce the attention output h "
            f"(input {b}, head {head}: max |h - softmax(s q k^T + mask) v| = {res.max_rel_error:.3g} x max |v|, tolerance {tolerance:g}). "
            "Fix: store q and k as the attention's dot product uses them (after any q/k normalisation or rotary embedding) and h before "
            "the output projection; causal masks and logit biases are outside format 1 (docs/activations.md)"
        )
    return res.max_rel_error


def write_activations(
    path: str | os.PathLike,
    layers: Sequence[Mapping[str, np.ndarray]],
    *,
    model_id: str,
    attention_mask: np.ndarray | None = None,
    sample_rank: np.ndarray | None = None,
    dataset_index: np.ndarray | None = None,
    attention_scale: float | None = None,
    attrs: Mapping | None = None,
    tolerance: float | None = None,
) -> Summary:
    """Write per-head q, k, v, h of one model in format version 1, then validate the file.

    The file is written under a temporary name and renamed only when it validates, so a
    capture that breaks the invariant leaves no file.

    Args:
        path: the HDF5 file to write.
        layers: one mapping per layer, ``"q" | "k" | "v" | "h"`` -> ``(B, H, N, d)`` arrays
            (numpy or torch, any float dtype; stored float32) with ``h = softmax(s q k^T + mask) v``
            per head, ``s = 1/sqrt(d)``.
        model_id: the name the tables show.
        attention_mask: ``(B, N)`` 0/1 (1 = real token) for language models (Table 4 form);
            None: every token is real (Table 1 form).
        sample_rank, dataset_index: ``(B,)`` integers (default ``0 .. B-1``).
        attention_scale: the logit scale the module applied; a scale other than
            ``1/sqrt(d)`` is folded into q (``q * s * sqrt(d)``), so the stored logits are
            ``q k^T / sqrt(d)`` as the KPCA stage assumes.
        attrs: further root attributes (strings or numbers; others are stored as JSON).
        tolerance: the invariant's tolerance (default 1e-4, :mod:`kpca_repro.capture.invariant`).

    Returns:
        :func:`validate`'s :class:`Summary` of the written file.

    Raises:
        ActivationFormatError, kpca_repro.capture.invariant.CaptureMismatchError: as :func:`validate`
            (nothing is left at ``path``).
        ValueError: ``layers`` is empty or its tensors' shapes disagree.
    """
    import json

    from kpca_repro.h5io import atomic_output

    arrays = [{t: _to_numpy(layer[t]) for t in _TENSORS} for layer in layers]
    if not arrays:
        raise ValueError("layers is empty")
    shape = arrays[0]["q"].shape
    if len(shape) != 4 or any(a[t].shape != shape for a in arrays for t in _TENSORS):
        raise ValueError(f"every q, k, v, h must be (B, H, N, d) of one shape; got {sorted({a[t].shape for a in arrays for t in _TENSORS})}")
    n_in, n_heads, n_tokens, d = shape
    if attention_scale is not None and not abs(attention_scale * math.sqrt(d) - 1) <= _SCALE_RTOL:
        factor = np.float32(attention_scale * math.sqrt(d))
        arrays = [{**a, "q": a["q"] * factor} for a in arrays]
    root = {"format_version": FORMAT_VERSION, "model_id": model_id, "n_layers": len(arrays), "n_heads": n_heads, "n_tokens": n_tokens, "head_dim": d}
    root.update(attention_scale=1.0 / math.sqrt(d), weights_sha256="", shard=0, n_shards=1, dtype="float32")
    root.update(attrs or {})
    with atomic_output(path) as tmp:
        with h5py.File(tmp, "w", track_order=False) as f:
            for name, value in root.items():
                f.attrs[name] = value if isinstance(value, (str, int, float, np.integer, np.floating)) else json.dumps(value, sort_keys=True)
            f.create_dataset("sample_rank", data=np.arange(n_in) if sample_rank is None else np.asarray(sample_rank, np.int64), dtype=np.int64, track_times=False)
            f.create_dataset("dataset_index", data=np.arange(n_in) if dataset_index is None else np.asarray(dataset_index, np.int64), dtype=np.int64, track_times=False)
            if attention_mask is not None:
                f.create_dataset("attention_mask", data=_to_numpy(attention_mask).astype(np.int64), track_times=False)
            for layer, a in enumerate(arrays):
                for t in _TENSORS:
                    f.create_dataset(f"{_layer_key(layer)}/{t}", data=a[t], chunks=(1, *shape[1:]), track_times=False)
        summary = validate(tmp, tolerance=tolerance)
        with h5py.File(tmp, "r+") as f:
            f.attrs["capture_rtol"] = float(1e-4 if tolerance is None else tolerance)
            f.attrs["capture_max_rel_error"] = float(summary.capture_max_rel_error)
    return summary


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32)) if np.asarray(x).dtype.kind == "f" else np.ascontiguousarray(np.asarray(x))


def install_user_file(source: str | os.PathLike, target: str | os.PathLike, *, name: str, kind: str, shard: int, n_shards: int, tolerance: float | None = None) -> Summary:
    """Validate a user's activation file (format and capture invariant) and copy it into the pipeline.

    The copy at ``target`` (``results/activations/<slug>/user_<i>of<S>.h5``) gets the
    attributes the later stages read (``shard``, ``n_shards``; ``weights_sha256`` = "" when
    absent; ``capture_rtol``, ``capture_max_rel_error`` as measured here); the user's file is
    not modified.

    Raises:
        ActivationFormatError: a format violation, or ``model_id`` differs from ``name`` (the
            config entry under ``activations:``).
        kpca_repro.capture.invariant.CaptureMismatchError: the invariant fails (measured error in the message).
    """
    from kpca_repro.h5io import atomic_output

    summary = validate(source, kind=kind, tolerance=tolerance)
    if summary.model_id != name:
        raise ActivationFormatError(
            source, f"model_id is {summary.model_id!r} but the config entry activations.{name} names it {name!r}", f"rename the entry to {summary.model_id!r} or set model_id = {name!r}"
        )
    with atomic_output(target) as tmp:
        shutil.copyfile(source, tmp)
        with h5py.File(tmp, "r+") as f:
            f.attrs["shard"], f.attrs["n_shards"] = int(shard), int(n_shards)
            if "weights_sha256" not in f.attrs:
                f.attrs["weights_sha256"] = ""
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["capture_rtol"] = float(1e-4 if tolerance is None else tolerance)
            f.attrs["capture_max_rel_error"] = float(summary.capture_max_rel_error)
            f.attrs["user_source"] = str(Path(source).resolve())
    return summary


_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)?$")


def check_user_config(config: dict) -> None:
    """The checks of ``activations:`` a schema cannot express, at parse time (no file is opened).

    Raises:
        ValueError: a name that is not a model id (letters, digits, ``_ . -``, at most one
            ``/``), a name also in ``vision.models`` / ``text.models``, or a missing file; the
            message names the config key and the fix.
    """
    for name, entry in config.get("activations", {}).items():
        key = f"config key activations.{name}"
        if not _NAME.match(name) or "--" in name:
            raise ValueError(f"{key}: the name must be letters, digits, '_', '.', '-' (no '--'), with at most one '/' (docs/activations.md)")
        if name in config["vision"]["models"] or name in config["text"]["models"]:
            raise ValueError(f"{key}: {name} is also in vision.models or text.models; give your activations another name (docs/activations.md)")
        for i, file in enumerate(entry["files"]):
            if not os.path.isfile(file):
                raise ValueError(f"{key}.files[{i}]: {file} does not exist (relative paths are read from the working directory; docs/activations.md)")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kpca_repro.activations validate FILE [--kind vision|text] [--no-invariant]``."""
    from kpca_repro.capture.invariant import CaptureMismatchError

    parser = argparse.ArgumentParser(prog="python -m kpca_repro.activations", description="Check an activation file against docs/activations.md.")
    sub = parser.add_subparsers(dest="command", required=True)
    val = sub.add_parser("validate", help="name the first violation and its fix (exit 1), or print ok and a summary (exit 0)")
    val.add_argument("file")
    val.add_argument("--kind", choices=KINDS, default=None, help="vision (no attention_mask) or text (attention_mask required); default: from the file")
    val.add_argument("--no-invariant", action="store_true", help="skip the capture invariant (format only)")
    args = parser.parse_args(argv)
    try:
        summary = validate(args.file, kind=args.kind, check_invariant=not args.no_invariant)
    except (ActivationFormatError, CaptureMismatchError) as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
