"""An independent, per-head transcription of the authors' Table 1 code structure.

This is a test oracle, not part of the pipeline: one head at a time, explicit ``G`` and ``O``
matrices, ``torch.median`` on the boolean selection, the CKA helper's class structure
(github.com/jayroxis/CKA-similarity as used by ``value_vectors.py``), and scipy's
assignment per head, as ``docs/method.md`` Sections 0.2 and 2 describe. The
pipeline's batched :mod:`kpca_repro.kpca` must agree with it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment


class CudaCKA:
    """The CKA helper as the reference uses it, with its ``+1e-10`` denominators."""

    def centering(self, k):
        n = k.shape[0]
        unit = torch.ones([n, n], dtype=k.dtype)
        identity = torch.eye(n, dtype=k.dtype)
        h = identity - unit / n
        return torch.matmul(torch.matmul(h, k), h)

    def rbf(self, x, sigma=None):
        gx = torch.matmul(x, x.T)
        kx = torch.diag(gx) - gx + (torch.diag(gx) - gx).T
        if sigma is None:
            mdist = torch.median(kx[kx != 0])
            sigma = math.sqrt(mdist)
        kx *= -0.5 / (sigma * sigma)
        return torch.exp(kx)

    def kernel_hsic(self, x, y, sigma):
        return torch.sum(self.centering(self.rbf(x, sigma)) * self.centering(self.rbf(y, sigma)))

    def linear_hsic(self, x, y):
        return torch.sum(self.centering(x @ x.T) * self.centering(y @ y.T))

    def linear_cka(self, x, y):
        return self.linear_hsic(x, y) / (torch.sqrt(self.linear_hsic(x, x)) * torch.sqrt(self.linear_hsic(y, y)) + 1e-10)

    def kernel_cka(self, x, y, sigma=None):
        return self.kernel_hsic(x, y, sigma) / (torch.sqrt(self.kernel_hsic(x, x, sigma)) * torch.sqrt(self.kernel_hsic(y, y, sigma)) + 1e-10)


def centered_gram_reference(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Kc, g, O)`` of one head (N x d keys, float32), as both reference scripts build them.

    ``Kraw = exp(k k^T / sqrt(d))``, ``g`` its row sums, ``Kphi = Kraw / (g g^T + 1e-6)``, and
    the dense centering ``Kc = Kphi - O Kphi - Kphi O + O Kphi O`` with ``O = 1/N``.
    """
    n, d = k.shape
    kraw = torch.exp(k @ k.T / math.sqrt(d))
    g = kraw.sum(dim=1)
    kphi = kraw / (torch.outer(g, g) + 1e-6)
    o = torch.ones(n, n) / n
    return kphi - o @ kphi - kphi @ o + o @ kphi @ o, g, o


def v_kpca_reference(k: torch.Tensor) -> torch.Tensor:
    """Vhat of one head (N x d keys, float32) as ``value_vectors.py`` builds it."""
    d = k.shape[1]
    kc, g, o = centered_gram_reference(k)
    evals, evecs = torch.linalg.eigh(kc)
    idx = torch.argsort(torch.abs(evals), descending=True)
    a = evecs[:, idx][:, :d]
    gm = torch.diag(1.0 / g)
    return gm @ a - gm @ o @ a


def head_metrics_reference(k: torch.Tensor, v: torch.Tensor) -> dict[str, float] | None:
    """Per-head metrics of Table 1 for one head, or None where the reference drops the head."""
    try:
        return metrics_reference(v, v_kpca_reference(k))
    except ValueError:  # scipy on a NaN cost matrix: the head is dropped
        return None


def metrics_reference(v: torch.Tensor, vhat: torch.Tensor) -> dict[str, float]:
    """Table 1's per-head metrics of ``V`` against a computed ``Vhat`` (the part of
    :func:`head_metrics_reference` after the eigendecomposition).

    Raises:
        ValueError: from scipy, when the cost matrix holds NaN (the reference drops the head).
    """
    cka = CudaCKA()
    allclose = bool(torch.allclose(v, vhat, rtol=1e-3, atol=1e-5))
    vn = v / (torch.norm(v, dim=1, keepdim=True) + 1e-8)
    vhn = vhat / (torch.norm(vhat, dim=1, keepdim=True) + 1e-8)
    direct = (vn * vhn).sum(dim=1)
    sim = vn @ vhn.T
    rows, cols = linear_sum_assignment(-sim.numpy())
    matched = sim.numpy()[rows, cols]
    return {
        "allclose": allclose,
        "direct_cos_mean": direct.mean().item(),
        "direct_cos_max": direct.max().item(),
        "direct_cos_min": direct.min().item(),
        "optimal_cos_mean": float(np.mean(matched)),
        "optimal_cos_max": float(np.max(matched)),
        "linear_cka": cka.linear_cka(v, vhat).item(),
        "rbf_cka": cka.kernel_cka(v, vhat).item(),
    }


def v_kpca_reference_nlp(k: torch.Tensor) -> torch.Tensor:
    """Vhat of one head (L x d keys, float32, padding included) as ``nlp_value_vectors.py`` builds it.

    Differs from :func:`v_kpca_reference` in the eigenvector selection (``A = eigvecs[:, -d:]``,
    the top ``d`` in ascending order, no re-sorting) and in ``G = diag(1/(g + 1e-6))``
    (docs/method.md Sections 0.2 and 3).
    """
    d = k.shape[1]
    kc, g, o = centered_gram_reference(k)
    _, evecs = torch.linalg.eigh(kc)
    a = evecs[:, -d:]
    gm = torch.diag(1.0 / (g + 1e-6))
    return gm @ a - gm @ o @ a


def _cka_nlp(hsic, x, y):
    """``nlp_value_vectors.py``'s CKA: the product of the self-HSICs under one square root."""
    return hsic(x, y) / (torch.sqrt(hsic(x, x) * hsic(y, y)) + 1e-10)


def head_metrics_reference_nlp(k: torch.Tensor, v: torch.Tensor) -> dict[str, float]:
    """Per-head metrics of Table 4 for one head, as ``nlp_value_vectors.py`` computes them.

    No try/except (nothing is dropped): the cost matrix ``-(Vn Vhatn^T)`` has its NaN entries
    set to 0 before the assignment, and the matched similarities are read from that cleaned
    cost (a non-finite head gets matched cosines 0, its other metrics NaN). Keys and values
    are one head's ``(L, d)`` float32 matrices with all ``L`` padded positions.

    Returns:
        ``direct_cos_mean|max|min``, ``optimal_cos_mean|max``, ``linear_cka``, ``rbf_cka``
        as Python floats (NaN where the head is not finite).
    """
    cka = CudaCKA()
    vhat = v_kpca_reference_nlp(k)
    vn = v / (torch.norm(v, dim=1, keepdim=True) + 1e-8)
    vhn = vhat / (torch.norm(vhat, dim=1, keepdim=True) + 1e-8)
    direct = (vn * vhn).sum(dim=1)
    cost = np.nan_to_num(-(vn @ vhn.T).numpy(), nan=0)
    rows, cols = linear_sum_assignment(cost)
    matched = -cost[rows, cols]
    return {
        "direct_cos_mean": direct.mean().item(),
        "direct_cos_max": direct.max().item(),
        "direct_cos_min": direct.min().item(),
        "optimal_cos_mean": float(np.mean(matched)),
        "optimal_cos_max": float(np.max(matched)),
        "linear_cka": _cka_nlp(cka.linear_hsic, v, vhat).item(),
        "rbf_cka": _cka_nlp(lambda a, b: cka.kernel_hsic(a, b, None), v, vhat).item(),
    }
