"""The activation file: its layout, reader, writer and validator, and the capture invariant.

One HDF5 file per model and shard holds every layer's per-head ``q, k, v, h`` (format version 2,
specified in docs/activations.md Section 1: datasets, root attributes, the capture attributes;
version-1 files still read and validate). Version 2 adds the causal flag (a decoder's query i
sees keys j <= i only) and grouped-query attention: ``k`` and ``v`` hold ``n_kv_heads`` heads
and ``kv_head_of_query[h]`` names the KV head query head h reads.
Every stage reads and writes it here and nowhere else: the pipeline's extraction and a user's
module through :class:`ActivationWriter` (:func:`kpca_repro.capture.module_capture.record_activations`,
or :func:`write_activations` from arrays), the KPCA stage, the spectra and the norms through
:class:`ActivationFile`, a user's own files through :func:`validate` and :func:`install_user_file`.

The capture invariant (docs/method.md 0.1) is what makes a file trustworthy: the stored q, k, v
must reproduce the attention's own output h,

    max |h - softmax(s q k^T + mask) v|  <=  INVARIANT_RTOL * max |v|   per head, s = 1/sqrt(d),

recomputed in float64 with k, v of the query head's KV head, ``mask`` = -inf on padded keys,
on keys j > i of a causal file, and outside a local window where the pipeline's Longformer or
ModernBERT have one. Tolerance: h is a convex combination of the rows
of v, so ``max |v|`` is its scale; float32 round-off of the logits propagated through ``exp``
and a weighted sum of N rows measures 1e-7 to 1e-6 of it on real and random models, a wrong
capture 5e-3 (Hugging Face rotary omitted) to ~1 (a q/k norm omitted). :data:`INVARIANT_RTOL` =
1e-4 sits two orders of magnitude above the first and more than one below the second.

Command line::

    python -m kpca_repro.activations validate FILE [--kind vision|text] [--no-invariant]

prints ``ok`` and a summary (exit 0) or the first violation and its fix (exit 1). torch is
imported only where the invariant is computed, so the configuration checks that import this
module at parse time stay free of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from kpca_repro.errors import InputFileError
from kpca_repro.h5io import atomic_output

__all__ = [
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "TENSORS",
    "REQUIRED_ATTRS",
    "KINDS",
    "BATCH_FIRST",
    "SEQUENCE_FIRST",
    "INVARIANT_RTOL",
    "HALF_ROUNDING",
    "half_precision_problem",
    "layer_key",
    "repeat_kv_map",
    "ActivationFormatError",
    "CorruptActivationFileError",
    "CaptureMismatchError",
    "ActivationFileMismatchError",
    "InvariantResult",
    "attention_mask_matrix",
    "attention_invariant",
    "check_attention_invariant",
    "ActivationFile",
    "ActivationWriter",
    "Summary",
    "validate",
    "write_activations",
    "install_user_file",
    "check_user_config",
    "main",
]

#: The version of the layout this module writes (attribute ``format_version``).
FORMAT_VERSION = 2
#: The versions it reads and validates: version 1 reads as ``causal`` False, ``n_kv_heads`` =
#: ``n_heads`` and ``kv_head_of_query`` = ``arange(n_heads)``.
READ_VERSIONS = (1, 2)
#: The per-head tensors of every layer, ``/layers/<LL>/<name>``: ``q``, ``h`` ``(B, n_heads, N, d)``,
#: ``k``, ``v`` ``(B, n_kv_heads, N, d)``, float32.
TENSORS = ("q", "k", "v", "h")
#: Root attributes every file must carry, with their type.
REQUIRED_ATTRS = {"model_id": str, "n_layers": int, "n_heads": int, "head_dim": int, "n_tokens": int}
#: ``vision``: every stored token is real (Table 1 form); ``text``: ``/attention_mask`` marks
#: padding (Table 4 form).
KINDS = ("vision", "text")
#: The layout a language model's projections computed in (attribute ``hooked_layout``,
#: :mod:`kpca_repro.capture.hf_capture`); the tensors are stored batch-first either way.
BATCH_FIRST, SEQUENCE_FIRST = "batch_first", "sequence_first"
#: Largest accepted ``max |h - h_hat| / max |v|`` of a checked head (module docstring).
INVARIANT_RTOL = 1e-4
_SCALE_RTOL = 1e-6  # float32 round-off of 1/sqrt(d) as another tool may have stored it
#: Unit roundoff of the half-precision dtypes (2^-11, 2^-8): the relative error of a tensor rounded to them.
HALF_ROUNDING = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def half_precision_problem(tensors: Mapping[str, object], tolerance: float | None) -> str | None:
    """Why half-precision tensors cannot be checked at the invariant's default tolerance, or None.

    A float16 or bfloat16 ``h`` carries its own rounding, up to :data:`HALF_ROUNDING` x max |v|
    (h is a convex combination of v's rows), above :data:`INVARIANT_RTOL`: every correct capture
    would fail and be blamed on the capture. Such tensors are checked only against a
    ``tolerance`` the caller chose for them.

    Args:
        tensors: name -> numpy array or torch tensor (None entries skipped).
        tolerance: the caller's tolerance, or None for the default.

    Returns:
        One line naming the first half-precision tensor and the reason, or None (none is half
        precision, or ``tolerance`` is given).
    """
    if tolerance is not None:
        return None
    for name, x in tensors.items():
        dtype = str(getattr(x, "dtype", "")).removeprefix("torch.")
        if dtype in HALF_ROUNDING:
            return (
                f"{name} is {dtype}: half precision rounds to about {HALF_ROUNDING[dtype]:.0e} relative, more than the capture invariant's "
                f"default tolerance {INVARIANT_RTOL:g} x max|v| allows, so every head would fail; pass float32 tensors (the model run in float32) "
                f"or a tolerance suited to {dtype}"
            )
    return None


def layer_key(layer: int) -> str:
    """The group of one layer's tensors: ``layers/00``, ``layers/01``, ..."""
    return f"layers/{layer:02d}"


def repeat_kv_map(n_heads: int, n_kv_heads: int) -> np.ndarray:
    """``kv_head_of_query`` of grouped-query attention as Hugging Face's ``repeat_kv`` lays it out.

    Query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``; ``n_kv_heads = n_heads``
    gives the identity.

    Returns:
        ``(n_heads,)`` int64.

    Raises:
        ValueError: ``n_kv_heads`` is not a positive divisor of ``n_heads``.
    """
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads = {n_kv_heads} does not divide n_heads = {n_heads}")
    return np.arange(n_heads, dtype=np.int64) // (n_heads // n_kv_heads)


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


class ActivationFormatError(InputFileError, ValueError):
    """A file violates the activation format; the message names the first violation and the fix."""

    def __init__(self, path, violation: str, fix: str):
        self.violation, self.fix = violation, fix
        super().__init__(f"{path}: {violation}. Fix: {fix} (docs/activations.md)")


class CorruptActivationFileError(InputFileError, OSError):
    """An activation file is truncated, corrupt or lacks the expected layout."""


class CaptureMismatchError(RuntimeError):
    """The stored q, k, v do not reproduce the attention output h of the model."""


class ActivationFileMismatchError(InputFileError, CaptureMismatchError):
    """An activation file's q, k, v do not reproduce its h: a bad input file, not a capture bug (:func:`validate`)."""


# --------------------------------------------------------------------------------------
# The capture invariant
# --------------------------------------------------------------------------------------


@dataclass
class InvariantResult:
    """Outcome of one invariant check.

    Attributes:
        max_rel_error: ``max over checked heads of max |h - h_hat| / max |v|`` (dimensionless).
        max_abs_error: ``max |h - h_hat|`` over checked heads, in the units of ``v``.
        worst: ``(input, head)`` of the head with the largest relative error.
        n_heads_checked: number of (input, head) matrices compared.
    """

    max_rel_error: float
    max_abs_error: float
    worst: tuple[int, int]
    n_heads_checked: int


def attention_mask_matrix(n_tokens: int, key_mask=None, window: int | None = None, causal: bool = False):
    """The boolean mask ``allowed[b, i, j]`` (query i may attend to key j) of an attention.

    Args:
        n_tokens: ``N``.
        key_mask: optional ``(B, N)`` bool/int, 1 = real key (padding mask).
        window: optional one-sided window ``w``: only ``|i - j| <= w`` is allowed (local /
            sliding-window attention; ModernBERT's local layers use ``w = local_attention // 2``).
        causal: only ``j <= i`` is allowed (a decoder; positions are the stored ones, so left
            padding needs nothing else: padded keys are masked by ``key_mask``).

    Returns:
        ``(B or 1, N, N)`` bool torch tensor, or None when nothing is masked.
    """
    import torch

    allowed = None
    i = torch.arange(n_tokens)
    if window is not None:
        allowed = ((i[:, None] - i[None, :]).abs() <= int(window))[None]
    if causal:
        lower = (i[None, :] <= i[:, None])[None]
        allowed = lower if allowed is None else allowed & lower
    if key_mask is not None:
        km = torch.as_tensor(key_mask).bool()[:, None, :]
        allowed = km if allowed is None else allowed & km
    return allowed


def attention_invariant(q, k, v, h, *, scale: float, allowed=None, query_mask=None, inputs=None, kv_head_of_query=None) -> InvariantResult:
    """Compare ``h`` with ``softmax(scale * q k^T + mask) v`` recomputed in float64.

    Args:
        q, h: per-head tensors ``(B, H, N, d)`` (numpy or torch, any float dtype; ``h`` may
            have another last dimension ``d_v``).
        k, v: ``(B, H_kv, N, d)`` and ``(B, H_kv, N, d_v)``; ``H_kv = H`` without ``kv_head_of_query``.
        scale: the logit scale ``s`` (``1/sqrt(d)`` for every stored file).
        allowed: optional bool ``(B or 1, N, N)`` from :func:`attention_mask_matrix`; masked
            logits get ``-inf``.
        query_mask: optional ``(B, N)``, 1 = real query; rows of padded queries are not
            compared (their output is never analysed).
        inputs: optional indices along ``B`` to check (default: all).
        kv_head_of_query: optional ``(H,)`` integers: query head ``h`` is compared with k, v
            of KV head ``kv_head_of_query[h]`` (grouped-query attention, format version 2).

    Returns:
        :class:`InvariantResult` (heads are query heads).

    Raises:
        ValueError: shapes disagree, or the map names a KV head outside ``0 .. H_kv - 1``.
    """
    import torch

    t = {name: (x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))).detach() for name, x in (("q", q), ("k", k), ("v", v), ("h", h))}
    qs, ks, vs, hs = (tuple(t[n].shape) for n in ("q", "k", "v", "h"))
    n_kv = qs[1] if kv_head_of_query is None else ks[1]
    if len(qs) != 4 or ks != (qs[0], n_kv, *qs[2:]) or vs[:3] != ks[:3] or hs != (*qs[:3], vs[3]):
        raise ValueError(f"q, k, v, h shapes disagree: {[qs, ks, vs, hs]}")
    sel = torch.arange(qs[0]) if inputs is None else torch.as_tensor(list(inputs), dtype=torch.long)
    # select the checked inputs first, then convert: float64 copies of the sample only
    qq, kk, vv, hh = (t[n][sel.to(t[n].device)].to("cpu", torch.float64) for n in ("q", "k", "v", "h"))
    if kv_head_of_query is not None:
        kv = torch.as_tensor(np.asarray(kv_head_of_query), dtype=torch.long)
        if kv.shape != (qs[1],) or bool(((kv < 0) | (kv >= n_kv)).any()):
            raise ValueError(f"kv_head_of_query {kv.tolist()} is not ({qs[1]},) KV heads of 0..{n_kv - 1}")
        kk, vv = kk[:, kv], vv[:, kv]  # each query head with its KV head (repeat_kv)
    logits = (qq @ kk.transpose(-1, -2)) * float(scale)
    if allowed is not None:
        a = torch.as_tensor(allowed).bool()
        a = a[sel] if a.shape[0] != 1 else a
        logits = logits.masked_fill(~a[:, None], float("-inf"))
    h_hat = torch.softmax(logits, dim=-1) @ vv
    err = (hh - h_hat).abs()
    if query_mask is not None:
        qm = torch.as_tensor(np.asarray(query_mask)).bool()[sel]
        err = torch.where(qm[:, None, :, None], err, torch.zeros_like(err))  # not err * qm: a padded query whose window holds no real key has NaN
    abs_err = err.amax(dim=(-1, -2))  # (b, H)
    ref = vv.abs().amax(dim=(-1, -2)).clamp_min(torch.finfo(torch.float32).tiny)
    rel = abs_err / ref
    rel = torch.where(torch.isnan(rel), torch.full_like(rel, float("inf")), rel)
    flat = int(torch.argmax(rel))
    b, head = divmod(flat, rel.shape[1])
    return InvariantResult(float(rel.max()), float(abs_err.max()), (int(sel[b]), head), int(rel.numel()))


def check_attention_invariant(model_id: str, layer: int, *args, tolerance: float = INVARIANT_RTOL, **kwargs) -> InvariantResult:
    """:func:`attention_invariant`, raising when the capture does not explain ``h``.

    Args:
        model_id, layer: named in the error.
        tolerance: the largest accepted relative error (default :data:`INVARIANT_RTOL`).
        *args, **kwargs: passed to :func:`attention_invariant`.

    Raises:
        CaptureMismatchError: ``max_rel_error > tolerance`` (or not finite); the message names
            the model, layer, input and head, the error and the tolerance.
    """
    res = attention_invariant(*args, **kwargs)
    if not res.max_rel_error <= tolerance:
        b, head = res.worst
        raise CaptureMismatchError(
            f"{model_id}: the captured q, k, v of layer {layer} do not reproduce the attention output h "
            f"(input {b}, head {head}: max |h - softmax(s q k^T + mask) v| = {res.max_rel_error:.3g} x max |v|, "
            f"tolerance {tolerance:g}). The model applies a transform the capture does not know "
            "(a q/k normalisation, a rotary embedding, a position bias, another scale); see "
            "docs/own_models.md ('Run the analysis on your own model') for the supported architectures."
        )
    return res


# --------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------


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
            raise CorruptActivationFileError(f"activation file {self.path} is unreadable, truncated or incomplete ({exc}); delete it and rerun the extraction rule") from exc

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
            raise CorruptActivationFileError(f"activation file {self.path}: cannot read layer {layer} ({exc}); delete it and rerun the extraction rule") from exc

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> ActivationFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _heads_layout(attrs: Mapping) -> tuple[bool, int, np.ndarray]:
    """``(causal, n_kv_heads, kv_head_of_query)`` of a file's root attributes, version-1 defaults filled in.

    Version 1: the defaults. Absent ``causal`` reads False, absent ``n_kv_heads`` reads ``n_heads``, absent
    ``kv_head_of_query`` reads :func:`repeat_kv_map` (the identity when ``n_kv_heads = n_heads``).
    Values are read, not checked (:func:`validate` checks them).
    """
    n_heads = int(attrs["n_heads"])
    if int(attrs.get("format_version", 1)) == 1:
        return False, n_heads, np.arange(n_heads, dtype=np.int64)
    n_kv = int(attrs.get("n_kv_heads", n_heads))
    kv = attrs.get("kv_head_of_query")
    kv = repeat_kv_map(n_heads, n_kv) if kv is None else np.asarray(kv, dtype=np.int64).reshape(-1)
    return bool(attrs.get("causal", False)), n_kv, kv


def _kv_map_problem(kv: np.ndarray, n_heads: int, n_kv_heads: int) -> str | None:
    """What is wrong with a ``kv_head_of_query`` for ``n_heads`` query and ``n_kv_heads`` KV heads, or None.

    It must be ``(n_heads,)`` integers in ``0 .. n_kv_heads - 1``, each KV head read by some
    query head (a stored KV head no query reads is a sign of a wrong map).
    """
    kv = np.asarray(kv)
    if kv.shape != (n_heads,) or not np.issubdtype(kv.dtype, np.integer):
        return f"has shape {kv.shape} and dtype {kv.dtype}, not ({n_heads},) integers (one KV head per query head)"
    if kv.min() < 0 or kv.max() >= n_kv_heads:
        return f"is {kv.tolist()}: KV heads outside 0..{n_kv_heads - 1}"
    unread = sorted(set(range(n_kv_heads)) - set(kv.tolist()))
    if unread:
        return f"is {kv.tolist()}: KV head(s) {unread} of {n_kv_heads} are read by no query head"
    return None


# --------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------


@dataclass
class Summary:
    """What :func:`validate` found in a valid file, or what :class:`ActivationWriter` wrote.

    Attributes:
        format_version: 1 or 2 (1 also for pipeline files written before the attribute existed).
        model_id, kind (``vision`` or ``text``), n_inputs (B), n_layers, n_heads, n_tokens, head_dim.
        attention_scale: the logit scale ``s`` (1/sqrt(head_dim)).
        capture_max_rel_error: the invariant's largest measured ``max|h - h_hat| / max|v|``
            over the checked inputs, layers and heads (None when not checked).
        causal: a causal file (query i sees keys j <= i).
        n_kv_heads: heads of k and v (0: not given, read as ``n_heads``).
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
    causal: bool = False
    n_kv_heads: int = 0
    attrs: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.n_kv_heads = self.n_kv_heads or self.n_heads

    def line(self) -> str:
        err = "not checked" if self.capture_max_rel_error is None else f"{self.capture_max_rel_error:.3g} x max|v|"
        kv = f" ({self.n_kv_heads} KV head{'s' if self.n_kv_heads > 1 else ''})" if self.n_kv_heads != self.n_heads else ""
        return (
            f"ok: format_version {self.format_version}, model_id {self.model_id!r}, {self.kind}{', causal' if self.causal else ''}, "
            f"{self.n_inputs} inputs x {self.n_layers} layers x {self.n_heads} heads{kv}, N = {self.n_tokens}, "
            f"d = {self.head_dim}, s = {self.attention_scale:.6g}, capture error {err}"
        )


class ActivationWriter:
    """The one writer of activation files: batches of per-head q, k, v, h in, one file of format 2 out.

    A context manager: the file is written under a temporary name and renamed to ``path`` when
    the block ends without an error (:func:`kpca_repro.h5io.atomic_output`), so a refused batch
    leaves no file; call :meth:`finish` last inside the block. :meth:`add` checks a batch before
    any of it is written (shapes, padding mask, the capture invariant on every layer), then writes
    it on one background thread while the caller computes the next batch (the bytes are those of
    writing in order). Datasets are chunked one input per chunk, nothing records a time, so
    identical runs give identical files.

    Args:
        path: the ``.h5`` file.
        model_id: the name the tables show (attribute ``model_id``; named in errors).
        n_inputs: the file's number of inputs B when known (fixed-size datasets); None: the
            datasets grow with each batch.
        check: the inputs of each batch whose heads the invariant checks, stored as
            ``capture_check``: ``"every input"``, ``"the first and last input"`` (the pipeline's
            extraction: recomputing the attention in float64 costs as much as the forward
            pass), or None (not checked: q, k, v, h that are no attention's, e.g. synthetic data).
        windows: per layer, a one-sided local attention window ``|i - j| <= w`` or None (the
            pipeline's Longformer and ModernBERT; the format itself knows key padding and the
            causal mask only).
        tolerance: the invariant's tolerance (default :data:`INVARIANT_RTOL`).
        causal: query i attends to keys j <= i only (a decoder; attribute ``causal``).
        kv_head_of_query: ``(n_heads,)`` integers, the KV head each query head reads
            (grouped-query attention; :func:`repeat_kv_map` for Hugging Face's ``repeat_kv``);
            k and v then hold ``max + 1`` heads, each read by some query head. None: the
            identity (k, v with ``n_heads`` heads).

    Raises:
        ValueError: ``kv_head_of_query`` is not a 1-D array of KV heads ``0 .. n - 1`` each read by some query head.
    """

    def __init__(
        self,
        path,
        *,
        model_id: str,
        n_inputs: int | None = None,
        check: str | None = "every input",
        windows: Sequence[int | None] | None = None,
        tolerance: float | None = None,
        causal: bool = False,
        kv_head_of_query=None,
    ):
        self.path, self.model_id, self.n_inputs, self.check, self.windows = Path(path), model_id, n_inputs, check, windows
        self.tolerance = INVARIANT_RTOL if tolerance is None else float(tolerance)
        self.causal = bool(causal)
        self.kv_map = None if kv_head_of_query is None else np.asarray(kv_head_of_query).reshape(-1)
        if self.kv_map is not None:
            problem = _kv_map_problem(self.kv_map, len(self.kv_map), int(self.kv_map.max(initial=-1)) + 1)
            if problem:
                raise ValueError(f"{model_id}: kv_head_of_query {problem}")
            self.kv_map = self.kv_map.astype(np.int64)
        self.shape: tuple[int, int, int, int] | None = None  # (L, H, N, d) of the first batch
        self.rows, self.masks, self.errors = 0, [], (0.0, 0.0, 0)  # errors: max relative, max absolute, heads checked
        self._pending: Future | None = None

    def __enter__(self) -> ActivationWriter:
        with ExitStack() as stack:
            tmp = stack.enter_context(atomic_output(self.path))
            self.f = stack.enter_context(h5py.File(tmp, "w", track_order=False))
            self._pool = stack.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix="h5write"))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc):
        # the pool first (it waits for the last write; an error in it is lost only behind another), then the file, then the rename
        return self._stack.__exit__(*exc)

    def add(self, layers: Sequence[Mapping[str, np.ndarray]], mask: np.ndarray | None = None) -> None:
        """Check one batch and queue its writes.

        Args:
            layers: one mapping per layer, ``"q" | "h"`` -> ``(b, H, N, d)`` and ``"k" | "v"`` ->
                ``(b, H_kv, N, d)`` float32 numpy arrays (``H_kv`` = ``H`` without
                ``kv_head_of_query``); the first batch fixes L, H, N and d.
            mask: ``(b, W)`` 0/1 (1 = real token), ``W <= N``, or None (every token real). The
                ``N - W`` positions the model padded itself (Longformer: to a multiple of its
                window) are stored as padding. A file has ``/attention_mask`` when any batch had one.

        Raises:
            ValueError: shapes differ from the first batch's, or the mask is wider than N, not
                0/1, or has an input without real tokens.
            CaptureMismatchError: a layer's q, k, v do not reproduce its h (nothing of the
                batch is written).
        """
        b = layers[0]["q"].shape[0]
        if self.shape is None:
            if self.kv_map is not None and len(self.kv_map) != layers[0]["q"].shape[1]:
                raise ValueError(f"{self.model_id}: kv_head_of_query has {len(self.kv_map)} entries, q has {layers[0]['q'].shape[1]} heads")
            self._create(len(layers), *layers[0]["q"].shape[1:])
        n_layers, n_heads, n_tokens, d = self.shape
        n_kv = self._n_kv()
        want = {t: (b, n_kv if t in "kv" else n_heads, n_tokens, d) for t in TENSORS}
        if len(layers) != n_layers or any(tuple(x[t].shape) != want[t] for x in layers for t in TENSORS):
            got = f"{len(layers)} layers of {sorted({(t, tuple(x[t].shape)) for x in layers for t in TENSORS})}"
            raise ValueError(f"{self.model_id}: every layer's q, h must be (b, H, N, d) = {want['q']} and k, v (b, H_kv, N, d) = {want['k']} in all {n_layers} layers; got {got}")
        if mask is not None:
            mask = np.asarray(mask, dtype=np.int64)
            if mask.shape[0] != b or mask.shape[1] > n_tokens:
                raise ValueError(f"{self.model_id}: the attention sees {n_tokens} tokens of {b} inputs, the padding mask is {mask.shape}")
            mask = np.pad(mask, ((0, 0), (0, n_tokens - mask.shape[1])))
            if not np.isin(mask, (0, 1)).all() or not mask.any(axis=1).all():
                raise ValueError(f"{self.model_id}: the padding mask must be 0/1 (1 = real token) with a real token in every input")
        if b == 0:  # nothing to check or write (a user's last batch may be empty)
            return
        if self.check is not None:
            self._check_invariant(layers, mask)
        self.masks.append((b, mask))
        start, self.rows = self.rows, self.rows + b
        self._wait()  # at most one batch waits in memory
        self._pending = self._pool.submit(self._write, start, layers)

    def finish(self, attrs: Mapping | None = None, sample_rank=None, dataset_index=None) -> Summary:
        """Write the index, the padding mask and the root attributes once every batch is written.

        Args:
            attrs: root attributes (strings and numbers as they are, anything else as JSON) over
                the defaults: ``weights_sha256`` "", ``shard`` 0, ``n_shards`` 1,
                ``capture_adapter`` "" (docs/activations.md Section 1).
            sample_rank, dataset_index: ``(B,)`` integers (default ``0 .. B-1``).

        Returns:
            :class:`Summary` of the file.

        Raises:
            ValueError: no batch was added, or fewer or more inputs than ``n_inputs``.
        """
        self._wait()
        if self.shape is None or (self.n_inputs is not None and self.rows != self.n_inputs):
            raise ValueError(f"{self.model_id}: {self.rows} inputs captured, {self.n_inputs or 'at least 1'} expected")
        for name, values in (("sample_rank", sample_rank), ("dataset_index", dataset_index)):
            self.f.create_dataset(name, data=np.arange(self.rows) if values is None else np.asarray(values), dtype=np.int64, track_times=False)
        masks = [np.ones((b, self.shape[2]), np.int64) if m is None else m for b, m in self.masks]
        text = any(m is not None for _, m in self.masks)
        if text:
            self.f.create_dataset("attention_mask", data=np.concatenate(masks), track_times=False)
        n_layers, n_heads, n_tokens, d = self.shape
        kv_map = np.arange(n_heads, dtype=np.int64) if self.kv_map is None else self.kv_map
        root = dict(format_version=FORMAT_VERSION, model_id=self.model_id, n_layers=n_layers, n_heads=n_heads, head_dim=d, n_tokens=n_tokens, attention_scale=1.0 / math.sqrt(d))
        root.update(causal=np.bool_(self.causal), n_kv_heads=self._n_kv(), kv_head_of_query=kv_map)
        root.update(weights_sha256="", shard=0, n_shards=1, dtype="float32", capture_adapter="", capture_check="not checked")
        if self.check is not None:
            root.update(capture_rtol=self.tolerance, capture_check=f"every batch, every layer, all heads of {self.check}: max |h - softmax(s q k^T + mask) v| / max |v|")
            root.update(zip(("capture_max_rel_error", "capture_max_abs_error", "capture_heads_checked"), self.errors))
        root.update(attrs or {})
        for name, value in root.items():
            self.f.attrs[name] = value if isinstance(value, (str, int, float, np.integer, np.floating, np.bool_, np.ndarray)) else json.dumps(value, sort_keys=True)
        error = root.get("capture_max_rel_error")
        kind = "text" if text else "vision"
        return Summary(FORMAT_VERSION, self.model_id, kind, self.rows, n_layers, n_heads, n_tokens, d, root["attention_scale"], error, self.causal, self._n_kv(), root)

    def _n_kv(self) -> int:
        return self.shape[1] if self.kv_map is None else int(self.kv_map.max()) + 1

    def _create(self, n_layers: int, n_heads: int, n_tokens: int, d: int) -> None:
        self.shape = (n_layers, n_heads, n_tokens, d)
        n, n_kv = self.n_inputs, self._n_kv()
        for layer in range(n_layers):
            grp = self.f.create_group(layer_key(layer), track_order=False)
            for t in TENSORS:
                heads = n_kv if t in ("k", "v") else n_heads
                grp.create_dataset(t, shape=(n or 0, heads, n_tokens, d), maxshape=(n, heads, n_tokens, d), dtype="float32", chunks=(1, heads, n_tokens, d), track_times=False)

    def _check_invariant(self, layers, mask) -> None:
        import torch

        b, n_tokens, d = layers[0]["q"].shape[0], self.shape[2], self.shape[3]
        inputs = None if self.check == "every input" else sorted({0, b - 1})
        km = None if mask is None else torch.from_numpy(mask).bool()
        rel, abs_, n = self.errors
        for layer, x in enumerate(layers):
            allowed = attention_mask_matrix(n_tokens, key_mask=km, window=self.windows[layer] if self.windows else None, causal=self.causal)
            res = check_attention_invariant(
                self.model_id, layer, x["q"], x["k"], x["v"], x["h"], scale=1.0 / math.sqrt(d), allowed=allowed, query_mask=km, inputs=inputs, tolerance=self.tolerance, kv_head_of_query=self.kv_map
            )
            rel, abs_, n = max(rel, res.max_rel_error), max(abs_, res.max_abs_error), n + res.n_heads_checked
        self.errors = (rel, abs_, n)

    def _write(self, start: int, layers) -> None:
        for layer, x in enumerate(layers):
            grp = self.f[layer_key(layer)]
            for t in TENSORS:
                stop = start + x[t].shape[0]
                if self.n_inputs is None:
                    grp[t].resize(stop, axis=0)
                grp[t][start:stop] = x[t]

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


# --------------------------------------------------------------------------------------
# Validator and user files
# --------------------------------------------------------------------------------------


def _as_int(value):
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    return None


def validate(path: str | os.PathLike, *, kind: str | None = None, check_invariant: bool = True, tolerance: float | None = None) -> Summary:
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
        raise ActivationFormatError(path, f"not a readable HDF5 file ({exc})", "write it with h5py (kpca_repro.activations.write_activations)") from None
    with f:
        # numpy scalars as Python values, so messages read "is 2", not "is np.int64(2)"
        attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}
        n_layers, n_heads, n_tokens, d, scale = _check_attrs(path, attrs)
        causal, n_kv, kv_map = _check_heads(path, attrs, n_heads)
        n_in = _check_inputs(path, f)
        _check_layout(path, f, n_layers, (n_in, n_heads, n_tokens, d), n_kv)
        mask = _check_mask(path, f, n_in, n_tokens, kind)
        worst = _check_values(path, f, attrs["model_id"], n_layers, scale, mask, check_invariant, tolerance, causal, kv_map)
        found = "text" if mask is not None else "vision"
        version = int(attrs.get("format_version", 1))
        return Summary(version, str(attrs["model_id"]), found, n_in, n_layers, n_heads, n_tokens, d, scale, worst, causal, n_kv, attrs)


def _check_attrs(path: Path, attrs: dict) -> tuple[int, int, int, int, float]:
    """The root attributes (docs/activations.md Section 1): ``format_version``, the required ones, ``attention_scale``.

    ``format_version`` absent reads as 1, else 1 or 2 (:data:`READ_VERSIONS`); every :data:`REQUIRED_ATTRS` entry present, a
    non-empty string or a positive integer; ``attention_scale`` (default ``1/sqrt(head_dim)``)
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
    return n_layers, n_heads, n_tokens, d, scale


def _check_heads(path: Path, attrs: dict, n_heads: int) -> tuple[bool, int, np.ndarray]:
    """Version 2's ``causal``, ``n_kv_heads`` and ``kv_head_of_query`` (absent: False, ``n_heads``, :func:`repeat_kv_map`).

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
        raise ActivationFormatError(path, f"root attribute 'causal' is {causal!r}, not a bool", "store causal = True for a decoder (query i sees keys j <= i), False otherwise")
    n_kv = attrs.get("n_kv_heads", n_heads)
    if _as_int(n_kv) is None or not 1 <= _as_int(n_kv) <= n_heads:
        raise ActivationFormatError(
            path, f"root attribute 'n_kv_heads' is {n_kv!r}, not an integer in 1..n_heads = {n_heads}", "store the number of key/value heads (n_heads without grouped-query attention)"
        )
    n_kv = int(n_kv)
    if "kv_head_of_query" in attrs:
        kv = np.asarray(attrs["kv_head_of_query"])
    elif n_heads % n_kv == 0:
        kv = repeat_kv_map(n_heads, n_kv)
    else:
        raise ActivationFormatError(
            path, f"root attribute 'kv_head_of_query' is missing and n_kv_heads = {n_kv} does not divide n_heads = {n_heads}", "store kv_head_of_query, the KV head each query head reads"
        )
    problem = _kv_map_problem(kv.reshape(-1) if kv.ndim == 0 else kv, n_heads, n_kv)
    if problem:
        raise ActivationFormatError(
            path, f"root attribute 'kv_head_of_query' {problem}", f"store ({n_heads},) int64: query head h reads KV head kv_head_of_query[h] (Hugging Face's repeat_kv: h // (n_heads // n_kv_heads))"
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
                raise ActivationFormatError(path, f"dataset /{key} is missing (n_layers = {n_layers})", f"store /{key} as {want} float32, or correct n_layers")
            ds = f[key]
            if ds.shape != want:
                heads = "n_kv_heads" if t in ("k", "v") else "n_heads"
                raise ActivationFormatError(
                    path, f"/{key} has shape {ds.shape}, expected (B, {heads}, n_tokens, head_dim) = {want}", "store per-head tensors batch-first, heads before tokens, or correct the attributes"
                )
            if ds.dtype != np.float32:
                raise ActivationFormatError(path, f"/{key} has dtype {ds.dtype}", "store float32 (e.g. arr.astype(np.float32))")


def _check_mask(path: Path, f: h5py.File, n_in: int, n_tokens: int, kind: str | None) -> np.ndarray | None:
    """``/attention_mask``, when present: ``(B, n_tokens)`` integer or bool, 0/1, a real token in every input; and the declared ``kind``.

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
            raise ActivationFormatError(path, f"/attention_mask has shape {m.shape} and dtype {m.dtype}", f"store a ({n_in}, {n_tokens}) integer array, 1 = real token, 0 = padding")
        mask = m[:]
        if not np.isin(mask, (0, 1)).all():
            raise ActivationFormatError(path, "/attention_mask holds values other than 0 and 1", "store 1 for real tokens and 0 for padding")
        if (mask.sum(axis=1) == 0).any():
            raise ActivationFormatError(path, f"/attention_mask has an input without real tokens (input {int(np.flatnonzero(mask.sum(axis=1) == 0)[0])})", "drop that input")
    if kind == "text" and mask is None:
        raise ActivationFormatError(path, "kind text but /attention_mask is missing", f"store /attention_mask ({n_in}, {n_tokens}) (all ones when nothing is padded), or declare kind: vision")
    if kind == "vision" and mask is not None:
        raise ActivationFormatError(path, "kind vision but the file has /attention_mask", "declare kind: text (the Table 4 form), or remove /attention_mask when every token is real")
    return mask


def _check_values(
    path: Path, f: h5py.File, model_id, n_layers: int, scale: float, mask: np.ndarray | None, check_invariant: bool, tolerance: float | None, causal: bool = False, kv_map=None
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
                    f"/{layer_key(layer)}/{name} has a non-finite value at input {bad[0]}, head {bad[1]}, token {bad[2]}",
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
    res = attention_invariant(t["q"], t["k"], t["v"], t["h"], scale=scale, allowed=allowed, query_mask=mask, kv_head_of_query=kv_map)
    if not res.max_rel_error <= tolerance:
        b, head = res.worst
        raise ActivationFileMismatchError(
            f"{path} ({model_id!r}): the stored q, k, v of layer {layer} do not reproduce the attention output h "
            f"(input {b}, head {head}: max |h - softmax(s q k^T + mask) v| = {res.max_rel_error:.3g} x max |v|, tolerance {tolerance:g}). "
            "Fix: store q and k as the attention's dot product uses them (after any q/k normalisation or rotary embedding) and h before "
            f"the output projection{'' if causal else ', and set causal = True for a causal attention'}; with grouped-query attention, kv_head_of_query names "
            "each query head's KV head; sliding windows and logit biases are outside the format (docs/activations.md)"
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
    check_invariant: bool = True,
    causal: bool = False,
    kv_head_of_query=None,
) -> Summary:
    """Write per-head q, k, v, h of one model in format version 2 (through :class:`ActivationWriter`).

    Args:
        path: the HDF5 file to write.
        layers: one mapping per layer, ``"q" | "h"`` -> ``(B, H, N, d)`` and ``"k" | "v"`` ->
            ``(B, H_kv, N, d)`` arrays (numpy or torch, any float dtype; stored float32;
            half precision checked only with a ``tolerance``) with
            ``h = softmax(s q k^T + mask) v`` per head, ``s = 1/sqrt(d)``, k and v of the head's KV head.
        model_id: the name the tables show.
        attention_mask: ``(B, N)`` 0/1 (1 = real token) for language models (Table 4 form);
            None: every token is real (Table 1 form).
        sample_rank, dataset_index: ``(B,)`` integers (default ``0 .. B-1``).
        attention_scale: the logit scale the module applied; a scale other than
            ``1/sqrt(d)`` is folded into q (``q * s * sqrt(d)``), so the stored logits are
            ``q k^T / sqrt(d)`` as the KPCA stage assumes.
        attrs: further root attributes (strings or numbers; others are stored as JSON).
        tolerance: the invariant's tolerance (default :data:`INVARIANT_RTOL`).
        check_invariant: check the capture invariant on every input, layer and head (False:
            tensors that are no attention's, such as synthetic data; :func:`validate` refuses the file).
        causal: query i attends to keys j <= i only (the mask adds -inf on j > i).
        kv_head_of_query: ``(H,)`` integers, the KV head of each query head (grouped-query
            attention, :func:`repeat_kv_map`); None: ``H_kv = H``, the identity.

    Returns:
        :class:`Summary` of the written file, with the largest measured invariant error.

    Raises:
        CaptureMismatchError: the tensors do not reproduce h (also for a non-finite value);
            nothing is left at ``path``.
        ValueError: ``layers`` is empty, its tensors' shapes disagree, the mask is not 0/1
            with a real token in every input, ``kv_head_of_query`` does not fit, or half-precision
            tensors are checked without a ``tolerance`` (:func:`half_precision_problem`).
    """
    half = half_precision_problem(dict(layers[0]), tolerance) if check_invariant and layers else None
    if half is not None:
        raise ValueError(f"layers[0]: {half}")
    arrays = [{t: _to_numpy(layer[t]) for t in TENSORS} for layer in layers]
    if not arrays:
        raise ValueError("layers is empty")
    d = arrays[0]["q"].shape[-1]
    if attention_scale is not None and not abs(attention_scale * math.sqrt(d) - 1) <= _SCALE_RTOL:
        factor = np.float32(attention_scale * math.sqrt(d))
        arrays = [{**a, "q": a["q"] * factor} for a in arrays]
    mask = None if attention_mask is None else _to_numpy(attention_mask)
    check = "every input" if check_invariant else None
    with ActivationWriter(path, model_id=model_id, check=check, tolerance=tolerance, causal=causal, kv_head_of_query=kv_head_of_query) as writer:
        writer.add(arrays, mask)
        return writer.finish({"capture_adapter": "write_activations", **(attrs or {})}, sample_rank, dataset_index)


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
        CaptureMismatchError: the invariant fails (measured error in the message).
    """
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
            f.attrs["format_version"] = summary.format_version  # as validated (absent = 1)
            f.attrs["capture_rtol"] = float(INVARIANT_RTOL if tolerance is None else tolerance)
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
