"""The capture invariant (docs/method.md 0.1): the stored q, k, v must reproduce the attention's own output h,

    max |h - softmax(s q k^T + mask) v|  <=  INVARIANT_RTOL * max |v|   per head, s = 1/sqrt(d),

recomputed in float64 with k, v of the query head's KV head, ``mask`` = -inf on padded keys,
on keys j > i of a causal file, and outside a local window where the pipeline's Longformer or
ModernBERT have one. Tolerance: h is a convex combination of the rows
of v, so ``max |v|`` is its scale; float32 round-off of the logits propagated through ``exp``
and a weighted sum of N rows measures 1e-7 to 1e-6 of it on real and random models, a wrong
capture 5e-3 (Hugging Face rotary omitted) to ~1 (a q/k norm omitted). :data:`INVARIANT_RTOL` =
1e-4 sits two orders of magnitude above the first and more than one below the second.

The writer checks it on every batch, the validator on every input. torch is imported only inside
the functions that compute it, so the configuration checks that import the package at parse
time stay free of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kpca_repro.activations.format import HALF_ROUNDING, INVARIANT_RTOL, CaptureMismatchError

__all__ = [
    "half_precision_problem",
    "InvariantResult",
    "attention_mask_matrix",
    "attention_invariant",
    "check_attention_invariant",
]


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
                f"{name} is {dtype}: half precision rounds to about {HALF_ROUNDING[dtype]:.0e} relative, more than "
                "the capture invariant's "
                f"default tolerance {INVARIANT_RTOL:g} x max|v| allows, so every head would fail; pass float32 "
                "tensors (the model run in float32) "
                f"or a tolerance suited to {dtype}"
            )
    return None


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


def attention_invariant(
    q, k, v, h, *, scale: float, allowed=None, query_mask=None, inputs=None, kv_head_of_query=None
) -> InvariantResult:
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

    t = {
        name: (x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))).detach()
        for name, x in (("q", q), ("k", k), ("v", v), ("h", h))
    }
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
        err = torch.where(
            qm[:, None, :, None], err, torch.zeros_like(err)
        )  # not err * qm: a padded query whose window holds no real key has NaN
    abs_err = err.amax(dim=(-1, -2))  # (b, H)
    ref = vv.abs().amax(dim=(-1, -2)).clamp_min(torch.finfo(torch.float32).tiny)
    rel = abs_err / ref
    rel = torch.where(torch.isnan(rel), torch.full_like(rel, float("inf")), rel)
    flat = int(torch.argmax(rel))
    b, head = divmod(flat, rel.shape[1])
    return InvariantResult(float(rel.max()), float(abs_err.max()), (int(sel[b]), head), int(rel.numel()))


def check_attention_invariant(
    model_id: str, layer: int, *args, tolerance: float = INVARIANT_RTOL, **kwargs
) -> InvariantResult:
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
