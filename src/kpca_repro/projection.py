"""The projection loss J_proj and its squared norms: ||phi(q_i)||^2, ||h_i||^2 (Figures 1, 2, 4, 5).

Teo & Nguyen's projection loss (the paper's Section 3) compares, per query, the squared
norm of the feature map ``phi(q_i)`` in the kernel's feature space with the squared norm of
the attention output ``h_i``: ``J_proj = mean_i (||phi(q_i)||^2 - ||h_i||^2)``. This module
holds those quantities and the token standardization the authors apply to q and k first
(docs/method.md 0.3, 0.4, 6-9), shared by the method, the norms (Figures 2 and 5) and the
training runs (Figures 1 and 4).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "ROW_NORM_EPS",
    "standardize_tokens",
    "log_feature_norm_sq",
    "feature_norm_sq",
    "attention_output",
    "output_norm_sq",
    "projection_errors",
]

#: Added to row norms (and to the standard deviation of a token) before dividing in the
#: reference code (docs/method.md 2, cosines; 4 step 1).
ROW_NORM_EPS = 1e-8


def standardize_tokens(x: torch.Tensor, eps: float = ROW_NORM_EPS) -> torch.Tensor:
    """Standardize each token vector over its ``d`` features (docs/method.md Section 4 step 1).

    ``x_j <- (x_j - mean_c x_jc) / (std_c x_jc + 1e-8)`` with the unbiased std, as the
    reference does (the paper's text says "per dimension"; the code works per token), so
    ``||x_j||^2 = d - 1`` up to the epsilon.

    Args:
        x: shape ``(..., N, d)``.
        eps: added to the standard deviation.

    Returns:
        Same shape and dtype.
    """
    mean = x.mean(dim=-1, keepdim=True)
    std = x.std(dim=-1, keepdim=True, unbiased=True)
    return (x - mean) / (std + eps)


# --------------------------------------------------------------------------------------
# Squared norms and the projection loss (Figures 1, 2, 4, 5)
# --------------------------------------------------------------------------------------


def _scale(d: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _causal_keys(n_queries: int, n_keys: int, device) -> torch.Tensor:
    """``(N, N)`` bool: query position ``i`` sees key position ``j <= i`` (a decoder's causal mask, docs/method.md 16).

    Raises:
        ValueError: queries and keys are not the same positions (``N != M``).
    """
    if n_queries != n_keys:
        raise ValueError(
            f"a causal mask needs the queries and keys of the same positions; got {n_queries} queries and {n_keys} keys"
        )
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril_()


def log_feature_norm_sq(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """``log ||phi(q_i)||^2 = s ||q_i||^2 - 2 LSE_j(s q_i . k_j)``, in the log domain.

    By the kernel trick ``||phi(q_i)||^2 = k(q_i, q_i) / g(q_i)^2`` with
    ``k(x, y) = exp(s x.y)`` and ``g(q_i) = sum_j exp(s q_i.k_j)`` (docs/method.md Section 0.3).
    Finite for every finite ``q`` and ``k`` (with a mask: for every query that sees a key).

    Args:
        q: queries, shape ``(..., N, d)``, floating point.
        k: keys, shape ``(..., M, d)``, same dtype.
        scale: ``s``; default ``1/sqrt(d)`` (the model's own head dimension). The paper's
            ``norms.py``/``nlp_norms.py`` hard-code ``1/8``: pass ``scale=1/8`` to reproduce them.
        key_mask: optional bool ``(..., M)`` (broadcastable); False keys (padding) are left
            out of the sum over ``j``.
        causal: a decoder's head (docs/method.md 16.3): query ``i`` sums over the keys ``j <= i``
            only, the causal normaliser ``g^(i)(q_i)`` (``N == M``, the same positions). A query
            that sees no key (a left-padded position) gets ``+inf``; leave it out.

    Returns:
        Shape ``(..., N)``, dtype of ``q`` (natural log).

    Raises:
        ValueError: ``q`` and ``k`` have different last dimensions, or ``causal`` with ``N != M``.
    """
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dimension; got {tuple(q.shape)} and {tuple(k.shape)}")
    s = _scale(q.shape[-1], scale)
    logits = (q @ k.transpose(-1, -2)) * s
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask.bool()[..., None, :], float("-inf"))
    if causal:
        logits = logits.masked_fill(~_causal_keys(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return s * (q * q).sum(-1) - 2.0 * torch.logsumexp(logits, dim=-1)


def feature_norm_sq(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    log_domain: bool = True,
    log_of_sum: bool = False,
    causal: bool = False,
) -> torch.Tensor:
    """``||phi(q_i)||^2 = exp(s ||q_i||^2) / (sum_j exp(s q_i . k_j))^2`` (docs/method.md 0.3).

    ``log_domain=True`` (``norms.py``, the corrected variant): ``exp`` of
    :func:`log_feature_norm_sq`; it underflows to 0 but never overflows to NaN.
    ``log_domain=False``: the direct formula with plain ``exp`` in ``q``'s dtype, as
    ``nlp_norms.py`` and the training code compute it; ``inf/inf`` gives NaN and an
    overflowing denominator gives 0, as there.
    ``log_domain=False, log_of_sum=True``: ``nlp_norms.py``'s order of operations
    (docs/method.md 0.3 and 9), ``exp(s ||q_i||^2 - 2 log(sum_j exp(s q_i . k_j)))`` with plain
    ``exp`` and ``log`` of the plain sum in ``q``'s dtype; where that log-denominator is
    not finite (the sum overflowed) the value is set to 0, as there.

    Args:
        q, k, scale, key_mask, causal: as in :func:`log_feature_norm_sq`.
        log_domain: see above.
        log_of_sum: with ``log_domain=False``, the ``nlp_norms.py`` form above.

    Returns:
        Shape ``(..., N)``, dtype of ``q``.
    """
    if log_domain:
        return torch.exp(log_feature_norm_sq(q, k, scale, key_mask, causal))
    s = _scale(q.shape[-1], scale)
    e = torch.exp((q @ k.transpose(-1, -2)) * s)
    if key_mask is not None:
        e = e * key_mask.to(e.dtype)[..., None, :]
    if causal:
        e = e * _causal_keys(q.shape[-2], k.shape[-2], q.device).to(e.dtype)
    if log_of_sum:
        log_den = torch.log(e.sum(-1))
        value = torch.exp(s * (q * q).sum(-1) - 2.0 * log_den)
        return torch.where(torch.isfinite(log_den), value, torch.zeros((), dtype=value.dtype, device=value.device))
    return torch.exp(s * (q * q).sum(-1)) / e.sum(-1) ** 2


def attention_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-head attention output ``h_i = sum_j softmax_j(s q_i . k_j) v_j`` (docs/method.md 0.1, 0.4).

    Args:
        q, k: shape ``(..., N, d)``, ``(..., M, d)``.
        v: shape ``(..., M, d_v)``.
        scale: ``s``; default ``1/sqrt(d)``.
        key_mask: optional bool ``(..., M)``; False keys get zero attention weight.

    Returns:
        Shape ``(..., N, d_v)``.
    """
    logits = (q @ k.transpose(-1, -2)) * _scale(q.shape[-1], scale)
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask.bool()[..., None, :], float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def output_norm_sq(h: torch.Tensor) -> torch.Tensor:
    """``||h_i||^2`` of per-head attention outputs ``(..., N, d_v)`` -> ``(..., N)``."""
    return (h * h).sum(-1)


def projection_errors(
    phi_sq: torch.Tensor, h_sq: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-8
) -> dict[str, torch.Tensor]:
    """The projection loss J_proj and its parts, as the training code logs them (docs/method.md 6.1).

    With ``e_i = |phi_i - ||h_i||^2|`` over all the given (batch, head, token) entries:
    ``error`` = mean ``e`` (J_proj as the mean absolute error, paper Appendix A),
    ``rel_error_wrt_h`` = mean ``e / (||h||^2 + eps)``, ``rel_error_wrt_phiq`` =
    mean ``e / (phi + eps)``, ``h_ave`` = mean ``||h||^2``, ``phi_ave`` = mean ``phi``.

    Args:
        phi_sq: ``||phi(q_i)||^2``, any shape.
        h_sq: ``||h_i||^2``, same shape.
        mask: optional bool of the same shape; only True entries are averaged (padding out).
        eps: guard of the relative errors (``1e-8`` in the reference).

    Returns:
        Five 0-dim tensors keyed ``error, rel_error_wrt_h, rel_error_wrt_phiq, h_ave, phi_ave``.

    Raises:
        ValueError: shapes differ.
    """
    if phi_sq.shape != h_sq.shape:
        raise ValueError(f"phi_sq and h_sq must have the same shape; got {tuple(phi_sq.shape)} and {tuple(h_sq.shape)}")
    if mask is not None:
        phi_sq, h_sq = phi_sq[mask.bool()], h_sq[mask.bool()]
    e = (phi_sq - h_sq).abs()
    return {
        "error": e.mean(),
        "rel_error_wrt_h": (e / (h_sq + eps)).mean(),
        "rel_error_wrt_phiq": (e / (phi_sq + eps)).mean(),
        "h_ave": h_sq.mean(),
        "phi_ave": phi_sq.mean(),
    }
