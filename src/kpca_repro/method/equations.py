"""The KPCA mathematics as the paper states it, one short function per step.

Teo & Nguyen (2024) read self-attention as kernel PCA of the keys; the reproduced paper
(docs/method.md, the specification) tests it with these steps, for one head of ``N`` tokens
with keys ``K`` and values ``V`` (``N x d``), ``s = 1/sqrt(d)`` and ``O = 1_N 1_N^T / N``:

1. Gram matrix (:func:`gram_paper`, :func:`log_gram`): ``Kraw = exp(s K K^T)``,
   ``g = Kraw 1_N`` and ``Kphi = Kraw / (g g^T)`` (the authors add ``1e-6``);
2. centering (:func:`center_dense`, :func:`center`): ``K~ = H Kphi H`` with ``H = I - O``;
3. eigenpairs (:func:`select_eigenpairs`, :func:`fix_eigenvector_signs`): ``A``, the top
   ``d`` eigenvectors of ``K~`` in a variant's order and sign rule;
4. the predicted values (:func:`v_kpca`, paper Eq. 5): ``V_KPCA = G A - G 1_N A`` with
   ``G = diag(1/g)``;
5. ``V`` against ``V_KPCA``: token-row cosines (:func:`row_normalize`, :func:`direct_cosine`;
   the optimal matching is :func:`kpca_repro.method.numerics.assignment_similarities`), linear and
   RBF CKA (:func:`linear_cka`, :func:`rbf_cka`, :func:`rbf_kernel`);
6. Figure 3's gamma test (:func:`gamma_matrix`, :func:`pairwise_spread`,
   :func:`perturb_eigenvectors`): ``Gamma = (K~ A) / (N A)`` is constant in each column
   exactly when ``A`` holds eigenvectors.

Where the two variants (:mod:`kpca_repro.method.variant`) state a step differently, the function
takes ``paper`` (``Variant.authors_formulas``): True writes the authors' expression, in the
order their scripts evaluate it (float32 round-off included, docs/fidelity.md), False the
exact one. Every function works on batches: a tensor ``(..., N, d)`` holds one matrix per
leading index. How the heads are batched, blocked, threaded and solved on the CPU or a GPU
is :mod:`kpca_repro.method.kpca`'s business (the engine, which calls these functions); exact but
faster primitives (order statistics, the assignment) are in :mod:`kpca_repro.method.numerics`.
"""

from __future__ import annotations

import math

import torch

from kpca_repro.method.numerics import frobenius_dot, median_nonzero
from kpca_repro.projection import ROW_NORM_EPS

__all__ = [
    "GRAM_EPS",
    "CKA_EPS",
    "gram_paper",
    "log_gram",
    "center_dense",
    "center",
    "center_inplace",
    "select_eigenpairs",
    "fix_eigenvector_signs",
    "v_kpca",
    "row_normalize",
    "direct_cosine",
    "cka_side",
    "cka_from_sides",
    "linear_cka",
    "rbf_kernel",
    "rbf_side",
    "rbf_cka",
    "all_directions_kept",
    "normaliser_kernel",
    "unbiased_side",
    "unbiased_cka_from_sides",
    "unbiased_hsic",
    "projection_test",
    "projection_norm_bound",
    "perturb_eigenvectors",
    "gamma_matrix",
    "pairwise_spread",
]

#: Added to ``g_i g_j`` before dividing in the reference code (docs/method.md 0.2 step 3).
GRAM_EPS = 1e-6
#: Added to the CKA denominators in the reference code (docs/method.md 2, CKA).
CKA_EPS = 1e-10


# --------------------------------------------------------------------------------------
# 1-2. Gram matrices and centering
# --------------------------------------------------------------------------------------


def _matmul_per_matrix(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for a batch ``x`` ``(..., N, M)`` and one matrix ``w`` ``(M, P)``, as a batched
    product of one matrix pair at a time.

    A plain ``x @ w`` folds the batch into one ``(B N) x M`` GEMM whose float32 round-off depends
    on ``B`` (MKL's AVX2 path: a head's centered Gram matrix then changed with
    ``kpca.heads_per_chunk``, and differed from the authors' per-head product). Expanding ``w``
    makes it a batched GEMM, bit-identical per matrix to the 2-D product for every batch size.
    """
    return x @ w.expand(*x.shape[:-2], *w.shape)


def _ones_over_n(n: int, like: torch.Tensor) -> torch.Tensor:
    """The ``N x N`` matrix ``O = 1_N 1_N^T / N`` in ``like``'s dtype and device."""
    return torch.full((n, n), 1.0 / n, dtype=like.dtype, device=like.device)


def gram_paper(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised Gram matrix of the keys exactly as the reference computes it.

    docs/method.md Section 0.2 steps 1-3: ``Kraw = exp(K K^T / sqrt(d))``, ``g = Kraw 1``,
    ``Kphi = Kraw / (g g^T + 1e-6)``. Computed in the dtype of ``k`` (float32 for the paper
    variant), with plain ``exp``: keys with ``s k_i.k_j > ~88.7`` overflow to ``inf`` and give
    ``NaN`` entries, and ``g_i g_j > ~3.4e38`` gives silent zeros, as in the reference.
    The logits are ``(K K^T) * (1/sqrt(d))``, a product with the Python float ``1/sqrt(d)``,
    as both reference scripts write them (``scale = 1/math.sqrt(d)``), not a division by
    ``sqrt(d)``: where ``sqrt(d)`` is not a power of two (d = 32: all-MiniLM-L6-v2) the
    two round differently in float32, and those ulps changed the eigenvectors of about a third
    of MiniLM's heads (docs/fidelity.md, "The kernel scale").

    Args:
        k: keys, shape ``(..., N, d)``, floating point.

    Returns:
        ``(kphi, g)``: ``kphi`` of shape ``(..., N, N)`` and the row sums ``g`` of
        ``Kraw``, shape ``(..., N)``, both in ``k``'s dtype. Never raises on overflow.
    """
    d = k.shape[-1]
    kraw = torch.exp((k @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d)))
    g = kraw.sum(dim=-1)
    kphi = kraw / (g[..., :, None] * g[..., None, :] + GRAM_EPS)
    return kphi, g


def log_gram(k: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-domain normalised Gram matrix (docs/method.md Section 15.1).

    ``log Kphi_ij = s k_i.k_j - LSE_m(s k_i.k_m) - LSE_m(s k_j.k_m)``; no epsilon, so
    ``0 <= Kphi_ij <= 1`` and nothing overflows for any finite key magnitude.

    Args:
        k: keys, shape ``(..., N, d)``; use float64 for the corrected variant.
        scale: the kernel scale ``s``; default ``1/sqrt(d)``.

    Returns:
        ``(log_kphi, log_g)`` with shapes ``(..., N, N)`` and ``(..., N)``, where
        ``log_g_i = log sum_j exp(s k_i.k_j)`` is ``log g(k_i)`` of the paper.
    """
    s = 1.0 / math.sqrt(k.shape[-1]) if scale is None else scale
    logits = (k @ k.transpose(-1, -2)) * s
    log_g = torch.logsumexp(logits, dim=-1)
    return logits - log_g[..., :, None] - log_g[..., None, :], log_g


def center_dense(m: torch.Tensor) -> torch.Tensor:
    """``M - O M - M O + O M O`` with three dense matmuls, as the reference centers Kphi.

    docs/method.md 0.2 step 4 (``O = 1_N 1_N^T / N``). Mathematically ``H M H`` with
    ``H = I - O``; kept as dense products so float32 round-off and NaN propagation match.

    Args:
        m: shape ``(..., N, N)``.

    Returns:
        The centered matrix, same shape and dtype.
    """
    o = _ones_over_n(m.shape[-1], m)
    om = o @ m
    return m - om - _matmul_per_matrix(m, o) + _matmul_per_matrix(om, o)


def center(m: torch.Tensor) -> torch.Tensor:
    """Double centering ``H M H`` by mean subtraction (exact arithmetic equivalent of ``H M H``).

    Used by the corrected variant: ``M_ij - mean_i - mean_j + mean``.

    Args:
        m: shape ``(..., N, N)``.

    Returns:
        The centered matrix, same shape and dtype.
    """
    return center_inplace(m.clone())


def center_inplace(m: torch.Tensor) -> torch.Tensor:
    """:func:`center` in place: ``m`` is overwritten and returned."""
    row = m.mean(dim=-1, keepdim=True)
    col = m.mean(dim=-2, keepdim=True)
    total = m.mean(dim=(-1, -2), keepdim=True)
    return m.sub_(row).sub_(col).add_(total)


# --------------------------------------------------------------------------------------
# 3-4. Eigenpairs and V_KPCA
# --------------------------------------------------------------------------------------


def select_eigenpairs(
    evals: torch.Tensor, evecs: torch.Tensor, n_components: int, order: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n_components`` eigenpairs that ``order`` keeps, of ``eigh``'s ascending output (docs/method.md 0.2 step 6).

    * ``"abs_desc"``: by ``|lambda|`` descending (Table 1, ``value_vectors.py``);
    * ``"desc"``: by signed eigenvalue descending (Tables 2-3, Fig. 3; the corrected variant);
    * ``"asc_top"``: the last ``n_components`` columns, kept in ascending order (Table 4,
      ``nlp_value_vectors.py``).

    ``eigh`` itself (batched, per matrix, on which device and thread count) is
    :func:`kpca_repro.method.kpca.eigenpairs`. Shapes ``(..., N)`` and ``(..., N, N)`` in, ``(..., n_components)`` and
    ``(..., N, n_components)`` out.
    """
    if order == "asc_top":
        return evals[..., -n_components:], evecs[..., -n_components:]
    key = evals.abs() if order == "abs_desc" else evals
    idx = torch.argsort(key, dim=-1, descending=True, stable=True)[..., :n_components]
    return torch.gather(evals, -1, idx), torch.gather(
        evecs, -1, idx[..., None, :].expand(*evecs.shape[:-1], n_components)
    )


def fix_eigenvector_signs(evecs: torch.Tensor) -> torch.Tensor:
    """Each eigenvector (column) times the sign of its entry of largest magnitude (docs/method.md 15.2).

    ``a_c <- sign(a_c[argmax_i |a_ic|]) a_c`` (a zero sign counts as +1), so the result does not
    depend on the LAPACK/cuSOLVER sign. Shape ``(..., N, n)`` in and out.
    """
    pivot = evecs.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(torch.gather(evecs, -2, pivot))
    return evecs * torch.where(sign == 0, torch.ones_like(sign), sign)


def v_kpca(a: torch.Tensor, inv_g: torch.Tensor, paper: bool = True) -> torch.Tensor:
    """``V_KPCA = G A - G 1_N A`` (paper Eq. 5; docs/method.md 0.2 step 8).

    Row ``i`` is ``(A_i - mean_rows(A)) * inv_g_i``. ``inv_g`` is ``1/g`` for the paper's
    vision code, ``1/(g + 1e-6)`` for its language code, or ``exp(log g_min - log g)`` in
    the corrected variant (V_KPCA up to a global positive factor, to which every metric of
    :func:`kpca_repro.method.kpca.head_metrics` is invariant).

    Args:
        a: eigenvectors, shape ``(..., N, d)``.
        inv_g: the diagonal of ``G``, shape ``(..., N)``.
        paper: ``G 1_N A`` as the reference computes it, ``(G O) @ A`` with
            ``O = 1_N 1_N^T / N`` (float32 round-off as in the authors' code: RBF CKA, whose
            median bandwidth is a discrete choice, moved by up to 5e-6 on real DeiT-Tiny heads
            when ``1_N A`` was the row mean, and by 1.7e-4 on real MiniLM heads when it was
            ``g * (O @ A)``). False (the corrected variant): the mean of the rows of
            ``A``, the same value up to round-off without the ``N x N x d`` product.

    Returns:
        Shape ``(..., N, d)``, dtype of ``a``.
    """
    g = inv_g[..., :, None]
    if paper:
        # G @ one @ A is evaluated left to right: (G O) @ A, whose entries g_i/N multiply A
        # inside the sum. g * (O @ A) rounds differently, and RBF CKA's median bandwidth
        # turned those ulps into 1.7e-4 on real MiniLM heads (docs/fidelity.md). G @ A is
        # g * A exactly (every other product of the sum is an exact zero).
        return g * a - (g * _ones_over_n(a.shape[-2], a)) @ a
    return g * a - g * a.mean(dim=-2, keepdim=True)


# --------------------------------------------------------------------------------------
# 5. Similarity of V and V_KPCA
# --------------------------------------------------------------------------------------


def row_normalize(x: torch.Tensor, eps: float | None = ROW_NORM_EPS, dim: int = -1) -> torch.Tensor:
    """Divide vectors along ``dim`` by their L2 norm.

    ``eps`` given (paper variant): ``x / (||x|| + eps)``. ``eps=None`` (corrected):
    ``x / ||x||`` with zero vectors left at zero.

    Args:
        x: shape ``(..., N, d)``.
        eps: additive guard in the denominator, or None for the exact division.
        dim: ``-1`` normalises token rows, ``-2`` normalises feature columns.

    Returns:
        Same shape and dtype as ``x``.
    """
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True)
    if eps is not None:
        return x / (norm + eps)
    # a zero norm becomes inf, so a zero vector (or one whose norm underflows) divides to zero
    return x / torch.where(norm > 0, norm, torch.full_like(norm, math.inf))


def direct_cosine(xn: torch.Tensor, yn: torch.Tensor) -> torch.Tensor:
    """Cosine of each token row of ``X`` with the same row of ``Y`` (vectors already normalised).

    Args:
        xn, yn: row-normalised matrices, shape ``(..., N, d)``.

    Returns:
        ``c_i = <xn_i, yn_i>``, shape ``(..., N)``.
    """
    return (xn * yn).sum(dim=-1)


def _hsic(a_c: torch.Tensor, b_c: torch.Tensor) -> torch.Tensor:
    """Unnormalised HSIC ``sum(A_c * B_c)`` of two centered kernel matrices, shape ``(...)``."""
    return (a_c * b_c).sum(dim=(-1, -2))


def _linear_hsic(xc: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
    """``sum((H X X^T H) * (H Y Y^T H)) = ||X_c^T Y_c||_F^2`` from column-centered ``X_c = H X``, ``Y_c = H Y``.

    The identity holds because ``H`` is symmetric and idempotent:
    ``tr(H X X^T H H Y Y^T H) = tr((X_c^T Y_c)(X_c^T Y_c)^T)``. A ``d x d`` product instead of
    ``N x N`` kernels and two ``N x N x N`` centerings per side.
    """
    return ((xc.transpose(-1, -2) @ yc) ** 2).sum(dim=(-1, -2))


def _sums_hsic(a: tuple, b: tuple) -> torch.Tensor:
    """``sum((H K H) * (H L H))`` of two symmetric kernels from ``(K, K 1, 1^T K 1)`` and the same of ``L``, shape
    ``(...)``.

    ``tr(H K H L) = sum(K * L) - (2/N) (K 1) . (L 1) + (1^T K 1)(1^T L 1) / N^2`` (``H`` symmetric
    and idempotent, ``K`` and ``L`` symmetric): one pass over the two ``N x N`` matrices and no
    centered copy. Exact in exact arithmetic; the subtraction cancels, so it is used in float64
    only (the corrected variant), where it agreed with the centered form to 1e-12
    (``tests/test_kpca.py``).
    """
    (k, rk, sk), (lm, rl, sl) = a, b
    n = k.shape[-1]
    return frobenius_dot(k, lm) - (2.0 / n) * (rk * rl).sum(dim=-1) + sk * sl / (n * n)


def cka_side(kind: str, m: torch.Tensor) -> tuple[str, torch.Tensor | tuple, torch.Tensor]:
    """One side of a CKA, reusable across pairs: ``(kind, centered, self-HSIC)``.

    ``kind`` ``"features"``: ``m`` is ``X`` ``(..., N, d)``, centered over tokens (linear CKA);
    ``"kernel"``: ``m`` is a kernel matrix ``(..., N, N)``, double-centered by mean subtraction
    in place (:func:`center`'s operations; ``m`` is overwritten). Both are the ``H X`` and
    ``H K H`` of the paper's CKA helper in exact arithmetic; in float32 they differ from its
    explicit ``H`` products by round-off (linear CKA at most 7.6e-7 apart on 1,020 real
    DeiT-Tiny and MiniLM heads, RBF CKA 4.5e-6; docs/performance.md, fidelity).
    ``"kernel_sums"``: ``m`` is a symmetric float64 kernel, kept uncentered with its row sums
    and total (:func:`_sums_hsic`); the corrected variant's RBF CKA.

    Args:
        kind: ``"features"``, ``"kernel"`` or ``"kernel_sums"``.
        m: ``X`` of shape ``(..., N, d)`` or a kernel of shape ``(..., N, N)``, float.

    Returns:
        ``(kind, centered m or (m, row sums, total), HSIC of the side with itself)``; the
        HSIC has shape ``(...)``.
    """
    if kind == "features":
        c = m - m.mean(dim=-2, keepdim=True)
        return kind, c, _linear_hsic(c, c)
    if kind == "kernel_sums":
        row = m.sum(dim=-1)
        sums = (m, row, row.sum(dim=-1))
        return kind, sums, _sums_hsic(sums, sums)
    c = center_inplace(m)
    return kind, c, _hsic(c, c)


def cka_from_sides(sx: tuple, sy: tuple, paper: bool, sqrt_of_product: bool = False) -> torch.Tensor:
    """CKA from two :func:`cka_side` results of the same kind (denominators: see :func:`linear_cka`)."""
    (kind, cx, hxx), (_, cy, hyy) = sx, sy
    hxy = {"features": _linear_hsic, "kernel": _hsic, "kernel_sums": _sums_hsic}[kind](cx, cy)
    if paper:
        if sqrt_of_product:  # nlp_value_vectors.py: sqrt(HSIC_xx * HSIC_yy) + 1e-10
            return hxy / (torch.sqrt(hxx * hyy) + CKA_EPS)
        return hxy / (torch.sqrt(hxx) * torch.sqrt(hyy) + CKA_EPS)
    return hxy / torch.sqrt(hxx * hyy)


def linear_cka(x: torch.Tensor, y: torch.Tensor, paper: bool = True, sqrt_of_product: bool = False) -> torch.Tensor:
    """Linear CKA of the token representations ``X`` and ``Y`` (Kornblith et al. 2019).

    ``CKA = HSIC(XX^T, YY^T) / sqrt(HSIC(XX^T, XX^T) HSIC(YY^T, YY^T))`` with
    ``HSIC(K, L) = sum((HKH) * (HLH))`` (no ``1/(n-1)^2``, which cancels), computed as
    ``||X_c^T Y_c||_F^2`` with token-centered ``X_c`` (:func:`_linear_hsic`). With
    ``paper=True`` the reference's denominators (docs/method.md 2):
    ``sqrt(.)*sqrt(.) + 1e-10``. Invariant to orthogonal transforms and isotropic scaling of
    either argument; ``CKA(X, X) = 1``.

    Args:
        x, y: shape ``(..., N, d_x)`` and ``(..., N, d_y)``, same dtype, un-normalised.
        paper: reference formula (True) or exact formula (False; NaN when a side is constant).
        sqrt_of_product: with ``paper``, the language-model script's denominator
            ``sqrt(HSIC(X,X) HSIC(Y,Y)) + 1e-10`` (product before the square root, so it can
            overflow in float32; docs/method.md 3) instead of ``sqrt(.) sqrt(.) + 1e-10``.

    Returns:
        Shape ``(...)``, in ``[0, 1]`` up to round-off.
    """
    return cka_from_sides(cka_side("features", x), cka_side("features", y), paper, sqrt_of_product)


def rbf_kernel(x: torch.Tensor, paper: bool = True, *, gram: torch.Tensor | None = None) -> torch.Tensor:
    """RBF kernel matrix with the median heuristic, as the CKA helper builds it.

    ``paper``: ``G = X X^T``, ``D_ij = G_jj - G_ij + G_ii - G_ji`` (squared distances, exactly
    symmetric with an exactly zero diagonal), ``sigma^2 = median(D[D != 0])``, the *lower*
    median, as the CKA helper computes them (docs/method.md Section 2, kernel CKA).
    Otherwise (the corrected variant): ``D_ij = (G_ii + G_jj) - 2 G_ij`` without the
    transposed pass (exactly 0 on the diagonal), and ``sigma^2`` the usual median of the
    non-zero ``D_ij`` over the pairs ``i < j`` (the same value when ``G`` is exactly
    symmetric). Then ``K = exp(-D / (2 sigma^2))``.

    Args:
        x: shape ``(..., N, d)``.
        paper: the CKA helper's distances and lower median (True) or the corrected ones (False).
        gram: ``X X^T`` when the caller already has it, shape ``(..., N, N)``.

    Returns:
        Shape ``(..., N, N)``; all-NaN for a matrix with no non-zero distance.
    """
    gx = x @ x.transpose(-1, -2) if gram is None else gram
    if paper:
        diag = torch.diagonal(gx, dim1=-2, dim2=-1)[..., None, :].clone()  # before gx is overwritten
        # G_jj - G_ij, in place on a product this function made itself
        dist = torch.sub(diag, gx, out=gx) if gram is None else diag - gx
        # D_ij = (G_jj - G_ij) + (G_ii - G_ji) and D_ji add the same two floats in the other
        # order: D is exactly symmetric with an exactly zero diagonal, whatever round-off G has.
        dist = torch.add(dist, dist.transpose(-1, -2))
    else:
        sq = torch.diagonal(gx, dim1=-2, dim2=-1).contiguous()  # contiguous: the broadcast sum reads each entry N times
        dist = torch.add(sq[..., :, None], sq[..., None, :]).sub_(gx, alpha=2)
    sigma2 = median_nonzero(dist, "lower" if paper else "mean", symmetric=True)
    factor = (-0.5 / sigma2.double()).to(x.dtype)
    return dist.mul_(factor[..., None, None]).exp_()  # in place: no further N x N buffers


def rbf_cka(x: torch.Tensor, y: torch.Tensor, paper: bool = True, sqrt_of_product: bool = False) -> torch.Tensor:
    """Kernel (RBF) CKA of ``X`` and ``Y``, each with its own median bandwidth.

    Same HSIC and denominators as :func:`linear_cka` (docs/method.md 2, kernel CKA).

    Args:
        x, y: shape ``(..., N, d_x)``, ``(..., N, d_y)``.
        paper: reference formula (lower median, ``+1e-10``) or the exact one.
        sqrt_of_product: as in :func:`linear_cka`.

    Returns:
        Shape ``(...)``.
    """
    return cka_from_sides(rbf_side(x, paper), rbf_side(y, paper), paper, sqrt_of_product)


def rbf_side(x: torch.Tensor, paper: bool) -> tuple:
    """:func:`cka_side` of the RBF kernel of ``x``: centered (paper variant, or not float64), or by sums (corrected,
    float64)."""
    return cka_side("kernel_sums" if not paper and x.dtype == torch.float64 else "kernel", rbf_kernel(x, paper))


# --------------------------------------------------------------------------------------
# 5b. What the metrics can mean: the all-components regime, unbiased CKA, the projection test
# --------------------------------------------------------------------------------------


def all_directions_kept(n_tokens: int, n_components: int) -> bool:
    """Whether the ``n_components`` kept eigenvectors span the whole centered feature space of ``n_tokens`` keys.

    The centered Gram matrix ``H Kphi H`` of ``N`` keys has at most ``N - 1`` non-zero
    eigenvalues (``H 1 = 0``). When ``n_components >= N - 1`` (with ``d`` kept: ``N <= d + 1``)
    the kept ``A`` spans all of them, ``H A A^T H = H`` and ``V_KPCA V_KPCA^T = G H G``
    (docs/method.md 17.1): every rotation-invariant comparison of ``V`` with ``V_KPCA`` (linear
    and RBF CKA) then depends on the normaliser ``g`` alone, on no eigenvector.

    Args:
        n_tokens: ``N`` (int, >= 1).
        n_components: the eigenvectors kept, ``min(d, N)``.
    """
    return n_components >= n_tokens - 1


def normaliser_kernel(inv_g: torch.Tensor) -> torch.Tensor:
    """``G H G``, the row Gram matrix of ``G H`` (docs/method.md 17.1): the all-components control.

    ``(G H)(G H)^T = G H G`` since ``H`` is symmetric and idempotent; entry ``(i, j)`` is
    ``(delta_ij - 1/N) / (g_i g_j)``. ``V_KPCA V_KPCA^T`` equals it when every direction is kept
    (:func:`all_directions_kept`), so CKA of ``V`` against it is what the normaliser alone gives.

    Args:
        inv_g: the diagonal of ``G`` (``1/g``, or ``1/g`` times a positive factor, to which CKA is
            invariant), shape ``(..., N)``, float.

    Returns:
        Shape ``(..., N, N)``, the dtype of ``inv_g``; symmetric, positive semi-definite.
    """
    n = inv_g.shape[-1]
    eye = torch.eye(n, dtype=inv_g.dtype, device=inv_g.device)
    return (eye - 1.0 / n) * inv_g[..., :, None] * inv_g[..., None, :]


def unbiased_side(kernel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One side of :func:`unbiased_hsic`: ``(K~, K~ 1, 1^T K~ 1)`` with ``K~`` the kernel with a zero diagonal.

    Args:
        kernel: an uncentered symmetric kernel matrix, shape ``(..., N, N)``, float64
            (the estimator subtracts large terms).

    Returns:
        ``K~`` ``(..., N, N)``, its row sums ``(..., N)`` and their total ``(...)``.
    """
    kt = kernel - torch.diag_embed(torch.diagonal(kernel, dim1=-2, dim2=-1))
    row = kt.sum(dim=-1)
    return kt, row, row.sum(dim=-1)


def unbiased_hsic(a: tuple, b: tuple) -> torch.Tensor:
    """The unbiased HSIC estimator of Song et al. 2012 (JMLR 13, "Feature selection via dependence maximization",
    Eq. 5).

    With ``K~``, ``L~`` the kernels with zeroed diagonals (:func:`unbiased_side`) and ``n >= 4``::

        HSIC_1 = [tr(K~ L~) + (1^T K~ 1)(1^T L~ 1) / ((n-1)(n-2)) - 2/(n-2) 1^T K~ L~ 1] / (n (n-3))

    Its expectation is the population HSIC: two independent representations score 0 on average
    at any ``n`` (the biased ``tr(H K H L)`` is positive, and large when ``n`` is small against
    the representations' width). Nguyen, Raghu & Kornblith 2021 build CKA from it.

    Args:
        a, b: :func:`unbiased_side` of two kernels over the same ``n`` tokens.

    Returns:
        Shape ``(...)``; NaN for ``n < 4`` (the estimator is undefined there).
    """
    (kt, rk, sk), (lt, rl, sl) = a, b
    n = kt.shape[-1]
    if n < 4:
        return torch.full(kt.shape[:-2], float("nan"), dtype=kt.dtype, device=kt.device)
    trace = frobenius_dot(kt, lt)  # tr(K~ L~) of symmetric kernels
    return (trace + sk * sl / ((n - 1) * (n - 2)) - (2.0 / (n - 2)) * (rk * rl).sum(dim=-1)) / (n * (n - 3))


def unbiased_cka_from_sides(sx: tuple, sy: tuple) -> torch.Tensor:
    """Unbiased CKA, ``HSIC_1(K, L) / sqrt(HSIC_1(K, K) HSIC_1(L, L))`` (Nguyen, Raghu & Kornblith 2021).

    Args:
        sx, sy: :func:`unbiased_side` of the two kernels (linear ``X X^T`` or RBF).

    Returns:
        Shape ``(...)``; near 0 for unrelated representations, 1 for ``K = L``; can be slightly
        negative. NaN where ``n < 4`` or a self-HSIC is not positive.
    """
    hxx, hyy = unbiased_hsic(sx, sx), unbiased_hsic(sy, sy)
    denom = torch.sqrt(hxx * hyy)
    ok = (hxx > 0) & (hyy > 0)
    return torch.where(
        ok, unbiased_hsic(sx, sy) / torch.where(ok, denom, torch.ones_like(denom)), torch.full_like(denom, float("nan"))
    )


def projection_test(q: torch.Tensor, k: torch.Tensor, h: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Teo & Nguyen's claim itself: ``h_i`` is the projection ``h^_i = sum_j softmax_j(s q_i . k_j) V_KPCA_j``
    (docs/method.md 17.3).

    Every query of ``q`` attends to every key of ``k`` (an encoder's queries; for a causal head the
    last query of a prefix, whose key set is the whole prefix). With ``values = V_KPCA`` this is the
    projection of ``phi(q_i)`` onto the kept principal components of the keys, in their coordinates.

    Args:
        q: queries, shape ``(..., G, M, d_k)``: ``G`` query heads sharing the keys, ``M`` queries each.
        k: keys, shape ``(..., N, d_k)``.
        h: the attention's own outputs of those queries, shape ``(..., G, M, d_v)``.
        values: what the attention weights average, shape ``(..., N, d_v)`` (``V_KPCA`` at its true
            scale, or a control).

    Returns:
        Per head (shape ``(...)``, the dtype of ``k``): ``cos`` (mean over the ``G M`` queries of
        ``cos(h^_i, h_i)``; 1 iff every ``h^_i`` points as ``h_i``), ``rel_error``
        (``||H^ - H||_F / ||H||_F``; 0 iff ``H^ = H``) and ``norm_ratio`` (``||H^||_F / ||H||_F``).
    """
    s = 1.0 / math.sqrt(k.shape[-1])
    weights = torch.softmax(s * (q @ k[..., None, :, :].transpose(-1, -2)), dim=-1)
    h_hat = weights @ values[..., None, :, :]
    dot = (h_hat * h).sum(-1)
    norms = torch.linalg.vector_norm(h_hat, dim=-1) * torch.linalg.vector_norm(h, dim=-1)
    h_norm = torch.linalg.vector_norm(h, dim=(-3, -2, -1))
    return {
        "cos": (dot / norms).mean(dim=(-2, -1)),
        "rel_error": torch.linalg.vector_norm(h_hat - h, dim=(-3, -2, -1)) / h_norm,
        "norm_ratio": torch.linalg.vector_norm(h_hat, dim=(-3, -2, -1)) / h_norm,
    }


def projection_norm_bound(q: torch.Tensor, k: torch.Tensor, h: torch.Tensor, inv_g: torch.Tensor) -> torch.Tensor:
    """The all-components control of :func:`projection_test`: ``||H G S^T||_F / ||H||_F`` (docs/method.md 17.3).

    ``h^_i = A^T H G s_i`` for the attention weights ``s_i`` of query ``i``; with orthonormal
    ``A``, ``||h^_i|| <= ||H G s_i||``, with equality when ``A`` spans the centered space. So no
    choice of principal components, in any coordinates, gives a projection longer than this
    bound, and ``rel_error >= 1 - bound`` whenever the bound is below 1.

    Args:
        q, k, h: as :func:`projection_test`.
        inv_g: the diagonal of ``G`` at its true scale (``1/g``), shape ``(..., N)``.

    Returns:
        Shape ``(...)``, the dtype of ``k``.
    """
    s = 1.0 / math.sqrt(k.shape[-1])
    weights = torch.softmax(s * (q @ k[..., None, :, :].transpose(-1, -2)), dim=-1)
    w = weights * inv_g[..., None, None, :]
    w = w - w.mean(dim=-1, keepdim=True)
    return torch.linalg.vector_norm(w, dim=(-3, -2, -1)) / torch.linalg.vector_norm(h, dim=(-3, -2, -1))


# --------------------------------------------------------------------------------------
# 6. The gamma-constancy test (Figure 3)
# --------------------------------------------------------------------------------------


def perturb_eigenvectors(a: torch.Tensor, noise: float, generator: torch.Generator) -> torch.Tensor:
    """Random near-eigenvectors: reduced QR of ``A + noise * N(0, 1)`` (docs/method.md Section 10).

    Args:
        a: eigenvectors, shape ``(..., N, d)``.
        noise: standard deviation of the Gaussian perturbation (0.1 in the paper).
        generator: a CPU ``torch.Generator`` (the draw is made on the CPU, then moved).

    Returns:
        Orthonormal columns, shape ``(..., N, d)``, same dtype and device as ``a``.
    """
    z = torch.randn(a.shape, generator=generator, dtype=a.dtype).to(a.device)
    q, _ = torch.linalg.qr(a + noise * z, mode="reduced")
    return q


def gamma_matrix(kc: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``Gamma = (K~ A) / (N A)`` elementwise (docs/method.md Section 10).

    For an exact eigenvector ``a_d`` every entry of column ``d`` equals ``lambda_d / N``, the
    eigenvalue of the covariance operator; spreads within a column measure how far ``A`` is
    from being an eigenvector.

    Args:
        kc: centered Gram matrices ``(..., N, N)``.
        a: candidate eigenvectors ``(..., N, d)``.

    Returns:
        Shape ``(..., N, d)``.
    """
    return (kc @ a) / (kc.shape[-1] * a)


def pairwise_spread(gamma: torch.Tensor) -> dict[str, torch.Tensor]:
    """Spread of each column of ``Gamma`` over all token pairs ``i < j``, vectorised.

    Absolute ``|g_i - g_j|`` and relative ``|g_i - g_j| / (max(|g_i|, |g_j|) + 1e-10)``;
    mean and unbiased standard deviation over the ``N (N - 1) / 2`` pairs.

    Args:
        gamma: shape ``(..., N, d)``.

    Returns:
        ``abs_mean, abs_std, rel_mean, rel_std``, each of shape ``(..., d)``.
    """
    n = gamma.shape[-2]
    i, j = torch.triu_indices(n, n, offset=1, device=gamma.device)
    gi, gj = gamma[..., i, :], gamma[..., j, :]
    diff = (gi - gj).abs()
    rel = diff / (torch.maximum(gi.abs(), gj.abs()) + 1e-10)
    return {
        "abs_mean": diff.mean(-2),
        "abs_std": diff.std(-2, unbiased=True),
        "rel_mean": rel.mean(-2),
        "rel_std": rel.std(-2, unbiased=True),
    }
