"""The validator: one activation file against format version 1 or 2 and the capture invariant, the
first violation named with its fix (:func:`validate`; ``python -m kpca_repro.activations validate``)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import h5py
import numpy as np

from kpca_repro.activations.format import (
    _SCALE_RTOL,
    FORMAT_VERSION,
    INVARIANT_RTOL,
    KINDS,
    READ_VERSIONS,
    REQUIRED_ATTRS,
    TENSORS,
    ActivationFileMismatchError,
    ActivationFormatError,
    Summary,
    _as_int,
    _kv_map_problem,
    layer_key,
    repeat_kv_map,
)
from kpca_repro.activations.invariant import attention_invariant, attention_mask_matrix

__all__ = ["validate"]


def validate(
    path: str | os.PathLike, *, kind: str | None = None, check_invariant: bool = True, tolerance: float | None = None
) -> Summary:
    """Check one activation file against format version 1 or 2; stop at the first violation.

    Checked in this order: readable HDF5; ``format_version`` (absent = 1; 1 or 2); the required
    attributes and their types; ``attention_scale`` = 1/sqrt(head_dim) when present; version 2:
    ``causal`` (bool), ``n_kv_heads`` (positive, at most ``n_heads``), ``kv_head_of_query``
    (``(n_heads,)`` integers in ``0 .. n_kv_heads - 1``, every KV head read; default
    :func:`repeat_kv_map`); ``sample_rank`` / ``dataset_index`` (``(B,)`` integer, ranks
    distinct); every layer's ``q, h`` (``(B, n_heads, n_tokens, head_dim)``) and ``k, v``
    (``(B, n_kv_heads, n_tokens, head_dim)``), float32, finite; ``attention_mask``
    (``(B, n_tokens)`` 0/1, at least one real token per input; required for ``kind="text"``,
    forbidden for ``kind="vision"``); then, with ``check_invariant``, the capture invariant on
    every input, layer and query head (:func:`attention_invariant`, float64)::

        max |h - softmax(s q k^T + mask) v| / max |v|  <=  tolerance  (default 1e-4)

    with k, v of the head's KV head, ``mask`` = -inf on padded keys (and on keys j > i of a
    causal file), padded queries not compared.
    One helper a step: :func:`_check_attrs`, :func:`_check_inputs`, :func:`_check_layout`,
    :func:`_check_mask` (with ``kind``), :func:`_check_values` (finite values, the invariant).

    Args:
        path: the HDF5 file.
        kind: ``"vision"``, ``"text"`` or None (read from the presence of ``attention_mask``).
        check_invariant: recompute h from q, k, v (reads every tensor once, float64 on the CPU).
        tolerance: largest accepted relative error (default
            :data:`INVARIANT_RTOL`).

    Returns:
        :class:`Summary`.

    Raises:
        ActivationFormatError: the first violation, with its fix.
        ActivationFileMismatchError: a ``CaptureMismatchError``: the
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
        raise ActivationFormatError(
            path, f"not a readable HDF5 file ({exc})", "write it with h5py (kpca_repro.activations.write_activations)"
        ) from None
    with f:
        # numpy scalars as Python values, so messages read "is 2", not "is np.int64(2)"
        attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}
        n_layers, n_heads, n_tokens, d, scale = _check_attrs(path, attrs)
        causal, n_kv, kv_map = _check_heads(path, attrs, n_heads)
        n_in = _check_inputs(path, f)
        _check_layout(path, f, n_layers, (n_in, n_heads, n_tokens, d), n_kv)
        mask = _check_mask(path, f, n_in, n_tokens, kind)
        worst = _check_values(
            path, f, attrs["model_id"], n_layers, scale, mask, check_invariant, tolerance, causal, kv_map
        )
        found = "text" if mask is not None else "vision"
        version = int(attrs.get("format_version", 1))
        return Summary(
            version,
            str(attrs["model_id"]),
            found,
            n_in,
            n_layers,
            n_heads,
            n_tokens,
            d,
            scale,
            worst,
            causal,
            n_kv,
            attrs,
        )


def _check_attrs(path: Path, attrs: dict) -> tuple[int, int, int, int, float]:
    """The root attributes (docs/activations.md Section 1): ``format_version``, the required ones, ``attention_scale``.

    ``format_version`` absent reads as 1, else 1 or 2 (:data:`READ_VERSIONS`); every :data:`REQUIRED_ATTRS` entry
    present, a non-empty string or a positive integer; ``attention_scale`` (default ``1/sqrt(head_dim)``)
    within :data:`_SCALE_RTOL` of ``1/sqrt(head_dim)``, the KPCA kernels' ``s``.

    Returns:
        ``(n_layers, n_heads, n_tokens, head_dim, attention_scale)``.

    Raises:
        ActivationFormatError: the first violation, with its fix.
    """
    version = attrs.get("format_version", 1)
    if _as_int(version) not in READ_VERSIONS:
        raise ActivationFormatError(
            path,
            f"format_version is {version!r}, this pipeline reads versions {', '.join(map(str, READ_VERSIONS))}",
            f"write the layout of version {FORMAT_VERSION} and set format_version = {FORMAT_VERSION}",
        )
    for name, typ in REQUIRED_ATTRS.items():
        if name not in attrs:
            raise ActivationFormatError(
                path, f"root attribute {name!r} is missing", f"set f.attrs[{name!r}] ({typ.__name__})"
            )
        value = attrs[name]
        ok = (
            isinstance(value, str) and bool(value)
            if typ is str
            else (_as_int(value) is not None and _as_int(value) > 0)
        )
        if not ok:
            want = "a non-empty string" if typ is str else "a positive integer"
            raise ActivationFormatError(
                path, f"root attribute {name!r} is {value!r}, not {want}", f"store {name} as {want}"
            )
    n_layers, n_heads, n_tokens, d = (int(attrs[k]) for k in ("n_layers", "n_heads", "n_tokens", "head_dim"))
    scale = float(attrs.get("attention_scale", 1.0 / math.sqrt(d)))
    if not abs(scale * math.sqrt(d) - 1.0) <= _SCALE_RTOL:
        raise ActivationFormatError(
            path,
            f"attention_scale is {scale:g}, not 1/sqrt(head_dim) = {1 / math.sqrt(d):g} (the KPCA kernels use s = "
            "1/sqrt(d))",
            f"store q multiplied by attention_scale * sqrt(head_dim) = {scale * math.sqrt(d):g} and set "
            "attention_scale = 1/sqrt(head_dim)",
        )
    return n_layers, n_heads, n_tokens, d, scale


def _check_heads(path: Path, attrs: dict, n_heads: int) -> tuple[bool, int, np.ndarray]:
    """Version 2's ``causal``, ``n_kv_heads`` and ``kv_head_of_query`` (absent: False, ``n_heads``,
    :func:`repeat_kv_map`).

    A version-1 file is read with the defaults whatever it holds (version 1 has neither).

    Returns:
        ``(causal, n_kv_heads, kv_head_of_query)``.

    Raises:
        ActivationFormatError: the first violation, with its fix.
    """
    if _as_int(attrs.get("format_version", 1)) == 1:
        return False, n_heads, np.arange(n_heads, dtype=np.int64)
    causal = attrs.get("causal", False)
    if not isinstance(causal, (bool, np.bool_)) and _as_int(causal) not in (0, 1):
        raise ActivationFormatError(
            path,
            f"root attribute 'causal' is {causal!r}, not a bool",
            "store causal = True for a decoder (query i sees keys j <= i), False otherwise",
        )
    n_kv = attrs.get("n_kv_heads", n_heads)
    if _as_int(n_kv) is None or not 1 <= _as_int(n_kv) <= n_heads:
        raise ActivationFormatError(
            path,
            f"root attribute 'n_kv_heads' is {n_kv!r}, not an integer in 1..n_heads = {n_heads}",
            "store the number of key/value heads (n_heads without grouped-query attention)",
        )
    n_kv = int(n_kv)
    if "kv_head_of_query" in attrs:
        kv = np.asarray(attrs["kv_head_of_query"])
    elif n_heads % n_kv == 0:
        kv = repeat_kv_map(n_heads, n_kv)
    else:
        raise ActivationFormatError(
            path,
            f"root attribute 'kv_head_of_query' is missing and n_kv_heads = {n_kv} does not divide n_heads = {n_heads}",
            "store kv_head_of_query, the KV head each query head reads",
        )
    problem = _kv_map_problem(kv.reshape(-1) if kv.ndim == 0 else kv, n_heads, n_kv)
    if problem:
        raise ActivationFormatError(
            path,
            f"root attribute 'kv_head_of_query' {problem}",
            f"store ({n_heads},) int64: query head h reads KV head kv_head_of_query[h] (Hugging Face's repeat_kv: h "
            "// (n_heads // n_kv_heads))",
        )
    return bool(causal), n_kv, kv.astype(np.int64)


def _check_inputs(path: Path, f: h5py.File) -> int:
    """``/sample_rank`` and ``/dataset_index``: ``(B,)`` integer datasets, ``B >= 1``, ranks distinct.

    Returns:
        ``B``, the number of inputs.

    Raises:
        ActivationFormatError: the first violation, with its fix.
    """
    for name in ("sample_rank", "dataset_index"):
        if name not in f or not isinstance(f[name], h5py.Dataset):
            raise ActivationFormatError(
                path,
                f"dataset /{name} is missing",
                f"store /{name} as a (B,) integer array (0..B-1 if you have no other numbering)",
            )
    ranks, index = f["sample_rank"], f["dataset_index"]
    if ranks.ndim != 1 or not np.issubdtype(ranks.dtype, np.integer):
        raise ActivationFormatError(
            path, f"/sample_rank has shape {ranks.shape} and dtype {ranks.dtype}", "store a (B,) integer array"
        )
    n_in = ranks.shape[0]
    if n_in == 0:
        raise ActivationFormatError(path, "/sample_rank is empty (no inputs)", "store at least one input")
    if index.shape != (n_in,) or not np.issubdtype(index.dtype, np.integer):
        raise ActivationFormatError(
            path,
            f"/dataset_index has shape {index.shape} and dtype {index.dtype}, /sample_rank has {n_in} inputs",
            f"store a ({n_in},) integer array",
        )
    if len(np.unique(ranks[:])) != n_in:
        raise ActivationFormatError(
            path,
            "/sample_rank has repeated values",
            "number the inputs 0..B-1 (ranks identify the rows of the per-head records)",
        )
    return n_in


def _check_layout(path: Path, f: h5py.File, n_layers: int, shape: tuple[int, int, int, int], n_kv_heads: int) -> None:
    """Every layer's ``q, k, v, h`` (:data:`TENSORS`): datasets of ``shape`` ``(B, n_heads, n_tokens, head_dim)``
    (``k``, ``v``: ``n_kv_heads`` heads), float32.

    Only the metadata is read (no tensor values).

    Raises:
        ActivationFormatError: the first violation, with its fix.
    """
    for layer in range(n_layers):
        for t in TENSORS:
            key = f"{layer_key(layer)}/{t}"
            want = (shape[0], n_kv_heads, *shape[2:]) if t in ("k", "v") else shape
            if key not in f or not isinstance(f[key], h5py.Dataset):
                raise ActivationFormatError(
                    path,
                    f"dataset /{key} is missing (n_layers = {n_layers})",
                    f"store /{key} as {want} float32, or correct n_layers",
                )
            ds = f[key]
            if ds.shape != want:
                heads = "n_kv_heads" if t in ("k", "v") else "n_heads"
                raise ActivationFormatError(
                    path,
                    f"/{key} has shape {ds.shape}, expected (B, {heads}, n_tokens, head_dim) = {want}",
                    "store per-head tensors batch-first, heads before tokens, or correct the attributes",
                )
            if ds.dtype != np.float32:
                raise ActivationFormatError(
                    path, f"/{key} has dtype {ds.dtype}", "store float32 (e.g. arr.astype(np.float32))"
                )


def _check_mask(path: Path, f: h5py.File, n_in: int, n_tokens: int, kind: str | None) -> np.ndarray | None:
    """``/attention_mask``, when present: ``(B, n_tokens)`` integer or bool, 0/1, a real token in every input; and the
    declared ``kind``.

    ``kind="text"`` requires the mask (Table 4 form), ``kind="vision"`` forbids it (Table 1
    form), None accepts either.

    Returns:
        The mask ``(B, n_tokens)`` as stored, or None (a vision file).

    Raises:
        ActivationFormatError: the first violation, with its fix.
    """
    mask = None
    if "attention_mask" in f:
        m = f["attention_mask"]
        if m.shape != (n_in, n_tokens) or not (np.issubdtype(m.dtype, np.integer) or m.dtype == np.bool_):
            raise ActivationFormatError(
                path,
                f"/attention_mask has shape {m.shape} and dtype {m.dtype}",
                f"store a ({n_in}, {n_tokens}) integer array, 1 = real token, 0 = padding",
            )
        mask = m[:]
        if not np.isin(mask, (0, 1)).all():
            raise ActivationFormatError(
                path, "/attention_mask holds values other than 0 and 1", "store 1 for real tokens and 0 for padding"
            )
        if (mask.sum(axis=1) == 0).any():
            raise ActivationFormatError(
                path,
                "/attention_mask has an input without real tokens (input "
                f"{int(np.flatnonzero(mask.sum(axis=1) == 0)[0])})",
                "drop that input",
            )
    if kind == "text" and mask is None:
        raise ActivationFormatError(
            path,
            "kind text but /attention_mask is missing",
            f"store /attention_mask ({n_in}, {n_tokens}) (all ones when nothing is padded), or declare kind: vision",
        )
    if kind == "vision" and mask is not None:
        raise ActivationFormatError(
            path,
            "kind vision but the file has /attention_mask",
            "declare kind: text (the Table 4 form), or remove /attention_mask when every token is real",
        )
    return mask


def _check_values(
    path: Path,
    f: h5py.File,
    model_id,
    n_layers: int,
    scale: float,
    mask: np.ndarray | None,
    check_invariant: bool,
    tolerance: float | None,
    causal: bool = False,
    kv_map=None,
) -> float | None:
    """Every tensor finite and, with ``check_invariant``, the capture invariant on every layer (:func:`_check_layer`).

    Reads one layer's ``q, k, v, h`` ``(B, H, N, d)`` float32 at a time.

    Returns:
        The largest relative invariant error ``max |h - h_hat| / max |v|`` over the layers, or
        None when not checked.

    Raises:
        ActivationFormatError: a non-finite value (input, head and token named).
        ActivationFileMismatchError: the invariant fails.
    """
    worst = None
    for layer in range(n_layers):
        t = {name: f[f"{layer_key(layer)}/{name}"][:] for name in TENSORS}
        for name, arr in t.items():
            if not np.isfinite(arr).all():
                bad = np.argwhere(~np.isfinite(arr))[0]
                raise ActivationFormatError(
                    path,
                    f"/{layer_key(layer)}/{name} has a non-finite value at input {bad[0]}, head {bad[1]}, token "
                    f"{bad[2]}",
                    "store finite values (a NaN or inf from the model cannot be analysed)",
                )
        if check_invariant:
            err = _check_layer(path, model_id, layer, t, scale, mask, tolerance, causal, kv_map)
            worst = err if worst is None else max(worst, err)
    return worst


def _check_layer(path, model_id, layer, t, scale, mask, tolerance, causal=False, kv_map=None) -> float:
    """The capture invariant on every input and head of one layer; returns the relative error.

    Raises:
        ActivationFileMismatchError: the invariant fails (a
            ``CaptureMismatchError`` that is also a bad input file: one line, the file, the fix).
    """
    tolerance = INVARIANT_RTOL if tolerance is None else tolerance
    allowed = attention_mask_matrix(t["q"].shape[2], key_mask=mask, causal=causal)
    res = attention_invariant(
        t["q"], t["k"], t["v"], t["h"], scale=scale, allowed=allowed, query_mask=mask, kv_head_of_query=kv_map
    )
    if not res.max_rel_error <= tolerance:
        b, head = res.worst
        raise ActivationFileMismatchError(
            f"{path} ({model_id!r}): the stored q, k, v of layer {layer} do not reproduce the attention output h "
            f"(input {b}, head {head}: max |h - softmax(s q k^T + mask) v| = {res.max_rel_error:.3g} x max |v|, "
            f"tolerance {tolerance:g}). "
            "Fix: store q and k as the attention's dot product uses them (after any q/k normalisation or rotary "
            "embedding) and h before "
            f"the output projection{'' if causal else ', and set causal = True for a causal attention'}; with "
            "grouped-query attention, kv_head_of_query names "
            "each query head's KV head; sliding windows and logit biases are outside the format (docs/activations.md)"
        )
    return res.max_rel_error
