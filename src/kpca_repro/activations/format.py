"""The activation file's layout (format version 2, docs/activations.md Section 1): names, constants, errors, summary.

One HDF5 file per model and shard holds every layer's per-head ``q, k, v, h``. Version 2 adds the
causal flag (a decoder's query i sees keys j <= i only) and grouped-query attention: ``k`` and
``v`` hold ``n_kv_heads`` heads and ``kv_head_of_query[h]`` names the KV head query head h reads.
Version-1 files still read and validate, with the defaults of :func:`_heads_layout`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kpca_repro.errors import InputFileError

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
    "layer_key",
    "repeat_kv_map",
    "ActivationFormatError",
    "CorruptActivationFileError",
    "CaptureMismatchError",
    "ActivationFileMismatchError",
    "Summary",
]

#: The version of the layout the writer writes (attribute ``format_version``).
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
#: Largest accepted ``max |h - h_hat| / max |v|`` of a checked head (the tolerance's reasoning:
#: :mod:`kpca_repro.activations.invariant`).
INVARIANT_RTOL = 1e-4
_SCALE_RTOL = 1e-6  # float32 round-off of 1/sqrt(d) as another tool may have stored it
#: Unit roundoff of the half-precision dtypes (2^-11, 2^-8): the relative error of a tensor rounded to them.
HALF_ROUNDING = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


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
        kv = (
            f" ({self.n_kv_heads} KV head{'s' if self.n_kv_heads > 1 else ''})"
            if self.n_kv_heads != self.n_heads
            else ""
        )
        return (
            f"ok: format_version {self.format_version}, model_id {self.model_id!r}, "
            f"{self.kind}{', causal' if self.causal else ''}, "
            f"{self.n_inputs} inputs x {self.n_layers} layers x {self.n_heads} heads{kv}, N = {self.n_tokens}, "
            f"d = {self.head_dim}, s = {self.attention_scale:.6g}, capture error {err}"
        )


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


def _as_int(value):
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    return None
