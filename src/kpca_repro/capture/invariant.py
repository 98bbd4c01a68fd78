"""The capture invariant: the stored q, k, v must reproduce the attention's own output h.

Every extraction (vision and language models) checks, after each forward pass and before
anything is written, that the per-head tensors about to be stored explain the model's own
per-head attention output::

    h_hat = softmax(s * q k^T + mask) v          (docs/method.md Section 0.1)

for a sample of heads in every layer. A hook that captures a tensor the attention does not
use (q/k before a normalisation or a rotary embedding, logits with a position bias the
tensors do not carry, a fused projection the hook never sees) fails this check, so a model
the adapters do not know is refused instead of analysed with wrong keys.

Tolerance. ``h`` is a convex combination of the rows of ``v``, so its natural scale is
``max |v|`` of the head. The model computes ``h`` in float32 (any kernel: an explicit
softmax, PyTorch's SDPA, a fused CUDA kernel) and the check recomputes it in float64 from
the stored float32 tensors; the difference is float32 round-off of the logits
(``|s q.k|`` up to ~1e2 for raw keys, relative error ~1e-7 each) propagated through
``exp`` and a weighted sum of ``N`` rows, which measures ~1e-7 to 1e-6 of ``max |v|`` on real
and random models. A wrong capture gives 5e-3 (HF rotary omitted) to ~1 (q/k norm
omitted). :data:`INVARIANT_RTOL` = 1e-4 sits two orders of magnitude above the first
and more than an order of magnitude below the second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kpca_repro.errors import InputFileError

__all__ = ["INVARIANT_RTOL", "ActivationFileMismatchError", "CaptureMismatchError", "InvariantResult", "attention_mask_matrix", "attention_invariant", "check_attention_invariant"]

#: Largest accepted ``max |h - h_hat| / max |v|`` of a checked head (see the module docstring).
INVARIANT_RTOL = 1e-4


class CaptureMismatchError(RuntimeError):
    """The stored q, k, v do not reproduce the attention output h of the model."""


class ActivationFileMismatchError(InputFileError, CaptureMismatchError):
    """An activation file's q, k, v do not reproduce its h: a bad input file, not a capture bug
    (:func:`kpca_repro.activations.validate`)."""


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


def attention_mask_matrix(n_tokens: int, key_mask: torch.Tensor | None = None, window: int | None = None, causal: bool = False) -> torch.Tensor | None:
    """The boolean mask ``allowed[b, i, j]`` (query i may attend to key j) of an attention.

    Args:
        n_tokens: ``N``.
        key_mask: optional ``(B, N)`` bool/int, 1 = real key (padding mask).
        window: optional one-sided window ``w``: only ``|i - j| <= w`` is allowed (local /
            sliding-window attention; ModernBERT's local layers use ``w = local_attention // 2``).
        causal: only ``j <= i`` is allowed.

    Returns:
        ``(B or 1, N, N)`` bool, or None when nothing is masked.
    """
    allowed = None
    if window is not None or causal:
        i = torch.arange(n_tokens)
        band = torch.ones(n_tokens, n_tokens, dtype=torch.bool)
        if window is not None:
            band &= (i[:, None] - i[None, :]).abs() <= int(window)
        if causal:
            band &= i[None, :] <= i[:, None]
        allowed = band[None]
    if key_mask is not None:
        km = torch.as_tensor(key_mask).bool()[:, None, :]
        allowed = km if allowed is None else allowed & km
    return allowed


def attention_invariant(
    q,
    k,
    v,
    h,
    *,
    scale: float,
    allowed: torch.Tensor | None = None,
    query_mask=None,
    inputs=None,
) -> InvariantResult:
    """Compare ``h`` with ``softmax(scale * q k^T + mask) v`` recomputed in float64.

    Args:
        q, k, v, h: per-head tensors ``(B, H, N, d)`` (numpy or torch, any float dtype; ``v``
            and ``h`` may have another last dimension ``d_v``).
        scale: the logit scale ``s`` the attention applies (``1/sqrt(d)`` for every supported
            family; see the adapters).
        allowed: optional bool ``(B or 1, N, N)`` from :func:`attention_mask_matrix`; masked
            logits get ``-inf``.
        query_mask: optional ``(B, N)``, 1 = real query; rows of padded queries are not
            compared (their output is never analysed).
        inputs: optional indices along ``B`` to check (default: all).

    Returns:
        :class:`InvariantResult`.

    Raises:
        ValueError: shapes disagree.
    """
    t = {name: (x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))).detach() for name, x in (("q", q), ("k", k), ("v", v), ("h", h))}
    if t["q"].shape != t["k"].shape or t["v"].shape != t["h"].shape or t["q"].shape[:3] != t["v"].shape[:3]:
        raise ValueError(f"q, k, v, h shapes disagree: {[tuple(x.shape) for x in t.values()]}")
    sel = torch.arange(t["q"].shape[0]) if inputs is None else torch.as_tensor(list(inputs), dtype=torch.long)
    # select the checked inputs first, then convert: float64 copies of the sample only
    qq, kk, vv, hh = (t[n][sel.to(t[n].device)].to("cpu", torch.float64) for n in ("q", "k", "v", "h"))
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
        model_id: named in the error.
        layer: named in the error.
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
