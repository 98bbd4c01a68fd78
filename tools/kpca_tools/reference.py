"""An independent, per-head transcription of the authors' Table 1 and Table 4 code structure.

This is the oracle of the tests, ``perf/`` and docs/fidelity.md, not a stage of the pipeline
(no rule imports it, so it lives in tools/, outside the package: tools/README.md): one head at
a time, explicit ``G`` and ``O`` matrices, ``torch.median`` on the boolean selection, the CKA
helper's class structure (github.com/jayroxis/CKA-similarity as used by ``value_vectors.py``),
and scipy's assignment per head, as ``docs/method.md`` Sections 0.2 and 2 describe. The
pipeline's batched :mod:`kpca_repro.method.kpca` must agree with it.

It also transcribes the authors' capture (:func:`capture_reference_vision`,
:func:`capture_reference_nlp`, :func:`sampler_order`): their hooks, reshapes and batch order,
so that a test can feed the per-head loops with the authors' own tensors rather than the
pipeline's stored ones (docs/fidelity.md).
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

    ``Kraw = exp((k k^T) * scale)`` with the Python float ``scale = 1/math.sqrt(d)`` (both
    scripts multiply; dividing by ``sqrt(d)`` rounds differently when d = 32), ``g`` its row
    sums, ``Kphi = Kraw / (g g^T + 1e-6)``, and the dense centering
    ``Kc = Kphi - O Kphi - Kphi O + O Kphi O`` with ``O = 1/N``.
    """
    n, d = k.shape
    scale = 1 / math.sqrt(d)
    kraw = torch.exp((k @ k.T) * scale)
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
    return v_kpca_from_eigenvectors(a, g, o)


def v_kpca_from_eigenvectors(a: torch.Tensor, g: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """``Vhat = G @ A - G @ one_n @ A`` with ``G = diag(1/g)``, left to right as ``value_vectors.py``."""
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

    Its loop body, expression for expression (``Kbh`` may be the authors' strided view of
    their ``(B, L, H*d)`` capture, :func:`split_heads_reference_nlp`). Differs from
    :func:`v_kpca_reference` in the eigenvector selection (``A = eigvecs[:, -d:]``, the top
    ``d`` in ascending order, no re-sorting) and in ``G = diagflat(1/(g + 1e-6))``
    (docs/method.md Sections 0.2 and 3).
    """
    d = k.shape[1]
    kc, g, one = centered_gram_reference_nlp(k)
    _, eigvecs = torch.linalg.eigh(kc)
    a = eigvecs[:, -d:]
    return v_kpca_from_eigenvectors_nlp(a, g, one)


def centered_gram_reference_nlp(kbh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Kc, g, one)`` of one head as ``nlp_value_vectors.py``'s loop builds them: ``g`` is ``(L, 1)``."""
    big_l, d = kbh.shape
    scale = 1 / math.sqrt(d)
    kraw = torch.exp((kbh @ kbh.T) * scale)
    g = kraw.sum(1, keepdim=True)
    one = torch.ones_like(kraw) / big_l
    kphi = kraw / (g @ g.T + 1e-6)
    return kphi - one @ kphi - kphi @ one + one @ kphi @ one, g, one


def v_kpca_from_eigenvectors_nlp(a: torch.Tensor, g: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
    """``Vhat = G @ A - G @ one @ A`` with ``G = diagflat(1/(g + 1e-6))``, evaluated left to right as the script does."""
    gm = torch.diagflat(1 / (g + 1e-6))
    return gm @ a - gm @ one @ a


class CudaCKANlp:
    """``nlp_value_vectors.py``'s own copy of the CKA helper, verbatim but for the device.

    It differs from :class:`CudaCKA` (``value_vectors.py``) in two float32 details: the RBF
    kernel is ``exp(-0.5 * KX / (sigma * sigma))`` (a division) instead of
    ``KX *= -0.5 / (sigma * sigma)``, and the CKA denominator is
    ``math.sqrt(HSIC_xx * HSIC_yy) + 1e-10``, the product under one square root taken in
    double precision.
    """

    def centering(self, k):
        n = k.shape[0]
        unit = torch.ones(n, n)
        return (torch.eye(n) - unit / n) @ k @ (torch.eye(n) - unit / n)

    def rbf(self, x, sigma=None):
        gx = x @ x.T
        kx = torch.diag(gx) - gx + (torch.diag(gx) - gx).T
        if sigma is None:
            mdist = torch.median(kx[kx != 0])
            sigma = math.sqrt(mdist)
        return torch.exp(-0.5 * kx / (sigma * sigma))

    def kernel_hsic(self, x, y, sigma):
        return torch.sum(self.centering(self.rbf(x, sigma)) * self.centering(self.rbf(y, sigma)))

    def linear_hsic(self, x, y):
        return torch.sum(self.centering(x @ x.T) * self.centering(y @ y.T))

    def linear_cka(self, x, y):
        return self.linear_hsic(x, y) / (math.sqrt(self.linear_hsic(x, x) * self.linear_hsic(y, y)) + 1e-10)

    def kernel_cka(self, x, y, sigma=None):
        return self.kernel_hsic(x, y, sigma) / (math.sqrt(self.kernel_hsic(x, x, sigma) * self.kernel_hsic(y, y, sigma)) + 1e-10)


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
    cka = CudaCKANlp()
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
        "linear_cka": cka.linear_cka(v, vhat).item(),
        "rbf_cka": cka.kernel_cka(v, vhat).item(),
    }


# --------------------------------------------------------------------------------------
# The authors' capture
# --------------------------------------------------------------------------------------


def sampler_order(seed: int, n: int) -> list[int]:
    """The order in which ``value_vectors.py``'s loader returns its ``n`` sampled images.

    After ``set_random_seed(seed)`` (``torch.manual_seed``) the script wraps the
    ``random.sample`` indices in a ``SubsetRandomSampler``; iterating the ``DataLoader`` first
    draws one int64 base seed from torch's global generator, then the sampler permutes the
    indices with ``torch.randperm``. Returns ``perm``: the loader's batch row ``b`` is the
    ``perm[b]``-th index of the draw (the pipeline's ``sample_rank``). A private generator
    with the same seed gives the same stream without touching the global one.
    """
    gen = torch.Generator().manual_seed(seed)
    torch.empty((), dtype=torch.int64).random_(generator=gen)
    return torch.randperm(n, generator=gen).tolist()


def capture_reference_vision(model, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Q, K, V`` of one block as ``value_vectors.py``'s ``analyze_layer`` captures them.

    A forward hook on ``model.blocks[layer].attn.qkv`` stores ``output.detach().clone()`` during
    one full forward pass of the batch ``x`` ``(B, 3, H, W)``; then
    ``reshape(B, N, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)``.

    Returns:
        Three float32 ``(B, heads, N, head_dim)`` tensors (strided views, as the script has them).
    """
    captured = {}
    attn = model.blocks[layer].attn
    handle = attn.qkv.register_forward_hook(lambda _m, _i, out: captured.__setitem__("att", out.detach().clone()))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    qkv = captured["att"]
    b, n = qkv.shape[0:2]
    q, k, v = qkv.reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def capture_reference_nlp(model, enc: dict) -> list[dict[str, torch.Tensor]]:
    """Per layer, ``{"q", "k", "v"}`` as ``nlp_value_vectors.py``'s ``analyse_model`` stores them.

    Forward hooks on ``blk.attention.self.query|key|value`` of every encoder block keep the first
    output of each (``storage[i].setdefault(name, out.detach())``) during one ``model(**enc)``.

    Returns:
        One dict per layer of float32 ``(B, L, H*d)`` tensors.
    """
    layers = list(model.encoder.layer)
    storage = [{} for _ in layers]

    def make_hook(layer_idx, proj_name):
        def _hook(_m, _inp, out):
            storage[layer_idx].setdefault(proj_name, out.detach())

        return _hook

    handles = []
    for i, blk in enumerate(layers):
        for name, lin in (("q", blk.attention.self.query), ("k", blk.attention.self.key), ("v", blk.attention.self.value)):
            handles.append(lin.register_forward_hook(make_hook(i, name)))
    try:
        with torch.no_grad():
            model(**enc)
    finally:
        for h in handles:
            h.remove()
    return storage


def split_heads_reference_nlp(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``t.view(B, L, n_heads, d).permute(0, 2, 1, 3)``: the script's per-head view ``(B, H, L, d)``."""
    b, big_l, width = t.shape
    return t.view(b, big_l, n_heads, width // n_heads).permute(0, 2, 1, 3)
