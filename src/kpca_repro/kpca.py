"""The KPCA mathematics of the pipeline, shared by every rule script and every test.

Everything here works on batches of heads: a tensor of shape ``(..., N, d)`` holds one
``N x d`` matrix (tokens x head dimension) per leading index, so a whole layer of a whole
image batch (``B * H`` heads) goes through one call, on the CPU or on a GPU.

Two variants follow ``docs/method.md``:

``paper``
    The authors' code to the letter (docs/method.md Sections 0.2 and 2): float32, the exact order
    of operations ``exp -> row sum -> g g^T + 1e-6 -> divide -> dense centering``, plain
    ``exp`` (so float32 overflow is reproduced), eigenpairs sorted by ``|lambda|``
    descending, token-row cosines, CKA on the raw matrices with ``+1e-10`` denominators and
    the lower median as RBF bandwidth. A head whose centered Gram matrix is not finite is
    *dropped* exactly as the reference's try/except drops it.

``corrected``
    docs/method.md Section 15: float64, log-domain Gram matrix (nothing overflows), eigenpairs
    sorted by signed eigenvalue with a deterministic sign, column-wise comparisons as the
    paper's text describes them, CKA without epsilons, and random Gaussian baselines.

Notation (docs/method.md Section 0.1): ``N`` tokens, ``d`` head dimension, ``s = 1/sqrt(d)``,
``K`` keys, ``V`` values, ``g_i = sum_j exp(s k_i . k_j)`` and
``V_KPCA = G A - G 1_N A`` with ``G = diag(1/g)`` and ``A`` the top-``d`` eigenvectors of the
centered Gram matrix (paper Eq. 5).
"""

from __future__ import annotations

import contextlib
import functools
import math

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

# The squared norms of J_proj (Figures 1, 2, 4, 5) live in kpca_repro.projection, so that
# training and the norm jobs do not depend on this module; re-exported here.
from .projection import (
    ROW_NORM_EPS,
    attention_output,
    feature_norm_sq,
    log_feature_norm_sq,
    output_norm_sq,
    projection_errors,
    standardize_tokens,
)

__all__ = [
    "PAPER",
    "CORRECTED",
    "VARIANTS",
    "gram_paper",
    "log_gram",
    "center_dense",
    "center",
    "centered_gram",
    "eigenpairs",
    "intra_op_threads",
    "v_kpca",
    "row_normalize",
    "direct_cosine",
    "assignment_similarities",
    "linear_cka",
    "rbf_kernel",
    "rbf_cka",
    "median_nonzero",
    "head_metrics",
    "standardize_tokens",
    "top_eigenvalues",
    "perturb_eigenvectors",
    "gamma_matrix",
    "pairwise_spread",
    "gamma_test",
    "log_feature_norm_sq",
    "feature_norm_sq",
    "attention_output",
    "output_norm_sq",
    "projection_errors",
]

PAPER = "paper"
CORRECTED = "corrected"
VARIANTS = (PAPER, CORRECTED)

#: Added to ``g_i g_j`` before dividing in the reference code (docs/method.md 0.2 step 3).
GRAM_EPS = 1e-6
#: Added to the CKA denominators in the reference code (docs/method.md 2, CKA).
CKA_EPS = 1e-10
#: Heads per block of :func:`head_metrics` on the CPU. Its many elementwise passes over
#: ``N x N`` matrices then stay in the core's cache (eight float64 197 x 197 matrices are
#: 2.5 MB), where a chunk of 64 heads would stream 20 MB per pass from memory (the measurement
#: that chose 8: docs/performance.md, design choices). Every operation is per head, so the
#: block size changes no number.
CPU_BLOCK_HEADS = 8


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


# --------------------------------------------------------------------------------------
# Gram matrices
# --------------------------------------------------------------------------------------


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
    return _center_(m.clone())


def _center_(m: torch.Tensor) -> torch.Tensor:
    """:func:`center` in place: ``m`` is overwritten and returned."""
    row = m.mean(dim=-1, keepdim=True)
    col = m.mean(dim=-2, keepdim=True)
    total = m.mean(dim=(-1, -2), keepdim=True)
    return m.sub_(row).sub_(col).add_(total)


# --------------------------------------------------------------------------------------
# Eigenpairs and V_KPCA
# --------------------------------------------------------------------------------------


def _select(evals: torch.Tensor, evecs: torch.Tensor, n_components: int, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n_components`` eigenpairs that ``order`` keeps (see :func:`eigenpairs`), of ``eigh``'s ascending output.

    Shapes ``(..., N)`` and ``(..., N, N)`` in, ``(..., n_components)`` and ``(..., N, n_components)`` out.
    """
    if order == "asc_top":
        return evals[..., -n_components:], evecs[..., -n_components:]
    key = evals.abs() if order == "abs_desc" else evals
    idx = torch.argsort(key, dim=-1, descending=True, stable=True)[..., :n_components]
    return torch.gather(evals, -1, idx), torch.gather(evecs, -1, idx[..., None, :].expand(*evecs.shape[:-1], n_components))


def _solve(safe: torch.Tensor, finite: torch.Tensor, n: int, per_matrix: bool, n_components: int, order: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` of every matrix of ``safe`` (one at a time or batched), then :func:`_select`; see :func:`eigenpairs`.

    One matrix at a time, each matrix's kept columns are selected before anything is stacked,
    so no ``(heads, N, N)`` copy of all eigenvectors is made.
    """
    kc = safe
    try:
        if per_matrix:
            flat = safe.reshape(-1, n, n)
            pairs = [_select(*torch.linalg.eigh(flat[i]), n_components, order) for i in range(flat.shape[0])]
            if not pairs:
                return safe.new_empty((*safe.shape[:-2], n_components)), safe.new_empty((*safe.shape[:-1], n_components)), finite
            evals = torch.stack([p[0] for p in pairs]).reshape(*safe.shape[:-2], n_components)
            evecs = torch.stack([p[1] for p in pairs]).reshape(*safe.shape[:-1], n_components)
            return evals, evecs, finite
        evals, evecs = torch.linalg.eigh(safe)
    except torch.linalg.LinAlgError:  # one matrix did not converge: solve one by one
        flat = safe.reshape(-1, n, n)
        ok = finite.reshape(-1).clone()
        evals = torch.full(flat.shape[:2], float("nan"), dtype=kc.dtype, device=kc.device)
        evecs = torch.full(flat.shape, float("nan"), dtype=kc.dtype, device=kc.device)
        for i in range(flat.shape[0]):
            try:
                evals[i], evecs[i] = torch.linalg.eigh(flat[i])
            except torch.linalg.LinAlgError:
                ok[i] = False
        evals, evecs = evals.reshape(safe.shape[:-1]), evecs.reshape(safe.shape)
        finite = ok.reshape(finite.shape)
    return *_select(evals, evecs, n_components, order), finite


def _finite_matrices(m: torch.Tensor) -> torch.Tensor:
    """``(...)`` bool: every entry of the matrix ``m[...]`` ``(..., N, N)`` is finite.

    A finite sum of all entries proves it for every matrix at once (a NaN or an infinite term
    makes the sum NaN or infinite), for one pass of summation instead of a boolean copy; a
    non-finite sum (a bad entry, or finite entries whose sum overflows) falls back to the
    entry-by-entry test.
    """
    if bool(torch.isfinite(m.sum())):
        return torch.ones(m.shape[:-2], dtype=torch.bool, device=m.device)
    return torch.isfinite(m).all(dim=-1).all(dim=-1)


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """Run the block with ``n`` torch intra-op threads on the calling thread, then restore them.

    ``torch.set_num_threads`` sets the calling thread's OpenMP and MKL thread counts (MKL's
    ``mkl_set_num_threads_local``); other threads keep theirs, so worker threads may each
    hold a different count at the same time. It also sets torch's process-wide default,
    which a thread that has not yet run a parallel torch kernel adopts: the caller's count is
    read (which initialises the calling thread) and restored on exit.

    Args:
        n: threads for the block (a positive int), or None to change nothing.

    Raises:
        ValueError: ``n`` is not None and below 1.
    """
    if n is None:
        yield
        return
    if n < 1:
        raise ValueError(f"intra-op threads must be >= 1, got {n}")
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def eigenpairs(
    kc: torch.Tensor,
    n_components: int,
    order: str = "abs_desc",
    fix_signs: bool = False,
    per_matrix: bool | None = None,
    solver_device: str | torch.device | None = None,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top eigenpairs of symmetric matrices, batched, non-finite matrices handled.

    ``torch.linalg.eigh`` on every matrix, then the selection rule of the script being
    reproduced (docs/method.md 0.2 step 6):

    * ``"abs_desc"``: by ``|lambda|`` descending (Table 1, ``value_vectors.py``);
    * ``"desc"``: by signed eigenvalue descending (Tables 2-3, Fig. 3; the corrected variant);
    * ``"asc_top"``: the last ``n_components`` columns of ``eigh``'s ascending output, kept
      in ascending order (Table 4, ``nlp_value_vectors.py``).

    A matrix with a non-finite entry is not passed to the solver (LAPACK may silently return
    NaN or raise for it); its eigenpairs are returned as NaN and ``finite`` is False, which
    is how the reference ends up dropping such a head.

    Args:
        kc: symmetric matrices, shape ``(..., N, N)``.
        n_components: number of eigenpairs kept (``d``), ``1 <= n_components <= N``.
        order: one of ``"abs_desc"``, ``"desc"``, ``"asc_top"``.
        fix_signs: make each eigenvector's entry of largest magnitude positive
            (docs/method.md 15.2), so the result does not depend on the LAPACK/cuSOLVER sign.
        per_matrix: call the solver on one freshly allocated matrix at a time (default: on
            the CPU). LAPACK (MKL) picks its code path by the memory alignment of each matrix
            in a batch, so batched CPU ``eigh`` gives a head different round-off, and at
            near-degenerate eigenvalues a different eigenvector sign, depending on the head's
            position in the batch. One matrix at a time, every head gets the result a per-head
            loop gives, whatever the batch size or sharding (docs/performance.md). ``False``
            keeps one batched call (the default on CUDA).
        solver_device: where ``eigh`` runs (default: ``kc``'s device). ``"cpu"`` for CUDA
            inputs moves the matrices to the CPU for the solver (one matrix at a time there)
            and the eigenpairs back: cuSOLVER solves a batch of 197 x 197 matrices one after
            another, slower than a CPU core per worker thread (docs/performance.md).
        threads: torch intra-op threads (and with them MKL's threads) of each CPU solver call,
            set on the calling thread only for the solver calls (:func:`intra_op_threads`);
            None keeps the caller's. MKL's ``syevd`` takes another code path for another
            thread count, so at near-degenerate eigenvalues the eigenvectors' signs and
            rotations depend on it: the paper variant passes the thread count the authors'
            scripts ran with (torch's default, docs/fidelity.md). The count is per calling
            thread, so concurrent calls from several worker threads each get it, and a
            matrix's eigenpairs depend on it and on nothing else of the pipeline's threading.

    Returns:
        ``(eigenvalues, eigenvectors, finite)`` with shapes ``(..., n)``, ``(..., N, n)``
        and ``(...)`` (bool). No division by ``N``: these are eigenvalues of ``K~_phi``.

    Raises:
        ValueError: unknown ``order`` or ``n_components`` out of range.
    """
    n = kc.shape[-1]
    if not 1 <= n_components <= n:
        raise ValueError(f"n_components must be in [1, {n}], got {n_components}")
    if order not in ("abs_desc", "desc", "asc_top"):
        raise ValueError(f"unknown eigenpair order {order!r}")
    home = kc.device
    if solver_device is not None and torch.device(solver_device) != home:
        kc = kc.to(solver_device)
    finite = _finite_matrices(kc)
    safe = kc if bool(finite.all()) else torch.where(finite[..., None, None], kc, torch.zeros((), dtype=kc.dtype, device=kc.device))
    if per_matrix is None:
        per_matrix = kc.device.type == "cpu"
    with intra_op_threads(threads if kc.device.type == "cpu" else None):
        evals, evecs, finite = _solve(safe, finite, n, per_matrix, n_components, order)
    if fix_signs:
        pivot = evecs.abs().argmax(dim=-2, keepdim=True)
        sign = torch.sign(torch.gather(evecs, -2, pivot))
        evecs = evecs * torch.where(sign == 0, torch.ones_like(sign), sign)
    if not bool(finite.all()):
        nan = torch.tensor(float("nan"), dtype=kc.dtype, device=kc.device)
        evals = torch.where(finite[..., None], evals, nan)
        evecs = torch.where(finite[..., None, None], evecs, nan)
    return evals.to(home), evecs.to(home), finite.to(home)


def v_kpca(a: torch.Tensor, inv_g: torch.Tensor, paper: bool = True) -> torch.Tensor:
    """``V_KPCA = G A - G 1_N A`` (paper Eq. 5; docs/method.md 0.2 step 8).

    Row ``i`` is ``(A_i - mean_rows(A)) * inv_g_i``. ``inv_g`` is ``1/g`` for the paper's
    vision code, ``1/(g + 1e-6)`` for its language code, or ``exp(log g_min - log g)`` in
    the corrected variant (V_KPCA up to a global positive factor, to which every metric of
    :func:`head_metrics` is invariant).

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
# Similarity metrics
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


def assignment_similarities(sim: torch.Tensor, valid: torch.Tensor | None = None, nan_to_zero: bool = False) -> torch.Tensor:
    """Optimal one-to-one matching that maximises total similarity, per matrix.

    ``scipy.optimize.linear_sum_assignment(-S)`` (Jonker-Volgenant) on each square
    ``S``, on the CPU in float64 as the reference does; returns the matched similarities
    ``o_i = S[i, pi(i)]`` in row order.

    The solver gets the reduced cost ``C - min_row - min_col`` of ``C = -S`` instead of ``C``:
    in a square problem every row and every column is matched exactly once, so subtracting a
    constant from a row or a column shifts every assignment's total by the same amount and
    leaves the optimal ``pi`` unchanged, and the matched values are read from ``S`` itself.
    The solver's shortest augmenting paths start from these smaller reduced costs, which makes
    it faster on real heads (docs/performance.md, design choices).

    Args:
        sim: similarity matrices, shape ``(..., n, n)``, any device.
        valid: optional bool mask ``(...)``; matrices marked False are skipped and get NaN.
        nan_to_zero: replace NaN entries of ``S`` by 0 before matching and read the matched
            values from the cleaned matrix, as ``nlp_value_vectors.py`` does with
            ``nan_to_num(cost, nan=0)`` (docs/method.md 3): an all-NaN head gets matched
            similarities 0 instead of raising.

    Returns:
        float64 CPU tensor of shape ``(..., n)``.

    Raises:
        ValueError: from scipy, if a matrix that is marked valid contains NaN or inf.
    """
    s = sim.detach().to("cpu", torch.float64).numpy()
    if nan_to_zero:
        s = np.nan_to_num(s, nan=0.0)
    flat = s.reshape(-1, s.shape[-2], s.shape[-1])
    ok = np.ones(flat.shape[0], bool) if valid is None else valid.detach().cpu().numpy().reshape(-1)
    out = np.full(flat.shape[:2], np.nan)
    square = flat.shape[1] == flat.shape[2]
    for i in np.flatnonzero(ok):
        if square:  # NaN or inf spreads to its row and column: scipy still raises on it
            with np.errstate(invalid="ignore"):
                cost = flat[i].max(axis=1, keepdims=True) - flat[i]  # -S - min_row(-S), bit for bit (negation is exact)
                cost -= cost.min(axis=0, keepdims=True)
        else:
            cost = -flat[i]
        rows, cols = linear_sum_assignment(cost)
        out[i, rows] = flat[i, rows, cols]
    return torch.from_numpy(out.reshape(s.shape[:-1]))


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
    """``sum((H K H) * (H L H))`` of two symmetric kernels from ``(K, K 1, 1^T K 1)`` and the same of ``L``, shape ``(...)``.

    ``tr(H K H L) = sum(K * L) - (2/N) (K 1) . (L 1) + (1^T K 1)(1^T L 1) / N^2`` (``H`` symmetric
    and idempotent, ``K`` and ``L`` symmetric): one pass over the two ``N x N`` matrices and no
    centered copy. Exact in exact arithmetic; the subtraction cancels, so it is used in float64
    only (the corrected variant), where it agreed with the centered form to 1e-12
    (``tests/test_kpca.py``).
    """
    (k, rk, sk), (lm, rl, sl) = a, b
    n = k.shape[-1]
    return _frobenius_dot(k, lm) - (2.0 / n) * (rk * rl).sum(dim=-1) + sk * sl / (n * n)


def _frobenius_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(A * B)`` over the last two dims, ``(..., N, N) x 2 -> (...)``, without the product's copy.

    On the CPU numpy's ``einsum`` sums the products as it makes them, with no ``N x N`` product
    matrix to allocate and read back (docs/performance.md, design choices). Its summation order
    differs from ``torch.sum``'s, so it is used where round-off of that size does not matter
    (float64, :func:`_sums_hsic`: RBF CKA moved by at most 1.1e-12 on 600 real DeiT-Tiny heads).
    """
    if a.device.type != "cpu":
        return (a * b).sum(dim=(-1, -2))
    lead, n2 = a.shape[:-2], a.shape[-2] * a.shape[-1]
    flat_a, flat_b = a.detach().reshape(-1, n2).numpy(), b.detach().reshape(-1, n2).numpy()
    return torch.from_numpy(np.einsum("ij,ij->i", flat_a, flat_b)).reshape(lead)


def _cka_side(kind: str, m: torch.Tensor) -> tuple[str, torch.Tensor | tuple, torch.Tensor]:
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
    c = _center_(m)
    return kind, c, _hsic(c, c)


def _cka_from_sides(sx: tuple, sy: tuple, paper: bool, sqrt_of_product: bool = False) -> torch.Tensor:
    """CKA from two :func:`_cka_side` results of the same kind (denominators: see :func:`linear_cka`)."""
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
    return _cka_from_sides(_cka_side("features", x), _cka_side("features", y), paper, sqrt_of_product)


def _kth_smallest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k``-th smallest entry (1-based) along the last dim, ``(..., M) -> (...)``.

    On the CPU numpy's introselect (``np.partition``), which is faster than ``torch.kthvalue``
    for one order statistic of a head's distances (docs/performance.md, design choices); the
    same order statistic, so the same value (NaN sorts last in both).
    """
    if x.device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(np.partition(x.detach().numpy(), k - 1, axis=-1)[..., k - 1]))
    return torch.kthvalue(x, k, dim=-1).values


@functools.lru_cache(maxsize=8)
def _upper_triangle_flat(n: int) -> np.ndarray:
    """Flat indices ``i * n + j`` of the strict upper triangle ``i < j`` of an ``n x n`` matrix, row by row."""
    return np.flatnonzero(np.triu(np.ones((n, n), dtype=bool), k=1))


def _median_nonzero_numpy(d: torch.Tensor, which: str, symmetric: bool) -> torch.Tensor:
    """:func:`median_nonzero` on the CPU with numpy's introselect.

    ``symmetric``: only the strict upper triangle is searched (``np.take`` of its flat
    indices, then the search below on ``N (N - 1) / 2`` entries instead of ``N^2``); the
    identity that makes this the same value is in :func:`median_nonzero`'s docstring. The
    copy and the search of half the entries cost less than the search of all of them
    (docs/performance.md, design choices).

    The non-zero entries of a row, sorted, are its ``neg`` negative entries and then its
    positive ones (NaN last, as in ``torch.median``'s selection), so the ``k``-th smallest
    non-zero entry is the ``k``-th smallest entry when ``k <= neg`` and the ``(k + zeros)``-th
    otherwise. One ``np.partition`` per distinct rank, no masked copy.
    """
    n = d.shape[-1]
    flat = d.detach().reshape(-1, d.shape[-2] * n).numpy()
    if symmetric:
        flat = np.take(flat, _upper_triangle_flat(n), axis=1)
    n2 = flat.shape[1]
    zeros = (flat == 0).sum(axis=1)
    neg = (flat < 0).sum(axis=1)
    m = n2 - zeros
    out = np.full(flat.shape[0], np.nan, dtype=flat.dtype)

    def position(k):  # 1-based rank among all entries of the k-th smallest non-zero entry
        return np.where(k <= neg, k, k + zeros)

    lower = position((m - 1) // 2 + 1)
    upper = position(m // 2 + 1) if which == "mean" else lower
    for lo_rank, hi_rank in sorted(set(zip(lower[m > 0].tolist(), upper[m > 0].tolist()))):
        rows = np.flatnonzero((m > 0) & (lower == lo_rank) & (upper == hi_rank))
        if symmetric and rows.size == flat.shape[0]:  # every row, and the triangle is our own copy: in place
            part = flat
            part.partition(hi_rank - 1, axis=1)  # reorders each row, keeps its entries: later selects stay valid
        else:
            part = np.partition(flat[rows], hi_rank - 1, axis=1)  # one kth per call: numpy's multi-kth select is slower
        hi = part[:, hi_rank - 1]
        if hi_rank == lo_rank:
            out[rows] = hi
        elif hi_rank == lo_rank + 1:  # the next smaller entry is the largest left of the kth
            out[rows] = (part[:, : hi_rank - 1].max(axis=1) + hi) / 2
        else:  # zeros lie between the two middle non-zero entries
            out[rows] = (np.partition(flat[rows], lo_rank - 1, axis=1)[:, lo_rank - 1] + hi) / 2
    return torch.from_numpy(out.reshape(d.shape[:-2]))


def median_nonzero(d: torch.Tensor, which: str, *, symmetric: bool = False) -> torch.Tensor:
    """Median of the non-zero entries of each matrix, batched.

    Args:
        d: shape ``(..., N, N)``.
        which: ``"lower"`` for ``torch.median``'s lower median (the reference's bandwidth),
            ``"mean"`` for the usual median (average of the two middle values when even).
        symmetric: ``d`` is exactly symmetric with a zero diagonal (squared distances), so
            only its strict upper triangle is searched, half the entries. Same value: the
            ``2p`` non-zero off-diagonal entries are the ``p`` upper ones each taken twice, so
            the sorted full list is ``u1, u1, u2, u2, ...`` and its ``p``-th entry (the lower
            median of ``2p``) is ``u_ceil(p/2)``, the lower median of the ``p`` upper entries;
            the mean of its entries ``p`` and ``p+1`` is the usual median of ``u``
            (``tests/test_batching_and_sharding.py`` checks both against the full search).
            On the CPU the triangle is copied with ``np.take`` and searched with numpy's
            introselect; on CUDA it is gathered and searched with ``torch.kthvalue``. For a
            ``d`` that is not exactly symmetric it is the median over the pairs ``i < j``
            (the corrected variant's bandwidth, :func:`rbf_kernel`).

    Returns:
        Shape ``(...)``; NaN where a matrix has no non-zero entry (as ``torch.median`` of an
        empty selection).
    """
    if d.device.type == "cpu":
        return _median_nonzero_numpy(d, which, symmetric and d.shape[-1] >= 2)
    if symmetric:
        n = d.shape[-1]
        if n < 2:  # no off-diagonal entry
            return torch.full(d.shape[:-2], float("nan"), dtype=d.dtype, device=d.device)
        iu = torch.triu_indices(n, n, offset=1, device=d.device)
        flat = d[..., iu[0], iu[1]].reshape(-1, iu.shape[1])
    else:
        flat = d.reshape(-1, d.shape[-2] * d.shape[-1])
    nonzero = flat != 0
    count = nonzero.sum(dim=-1)
    masked = torch.where(nonzero, flat, torch.tensor(float("inf"), dtype=d.dtype, device=d.device))
    out = torch.full(count.shape, float("nan"), dtype=d.dtype, device=d.device)
    for m in torch.unique(count).tolist():
        if m == 0:
            continue
        rows = count == m
        lo = _kth_smallest(masked[rows], (m - 1) // 2 + 1)
        if which == "mean" and m % 2 == 0:
            hi = _kth_smallest(masked[rows], m // 2 + 1)
            lo = (lo + hi) / 2
        out[rows] = lo
    return out.reshape(d.shape[:-2])


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
    return _cka_from_sides(_rbf_side(x, paper), _rbf_side(y, paper), paper, sqrt_of_product)


def _rbf_side(x: torch.Tensor, paper: bool) -> tuple:
    """:func:`_cka_side` of the RBF kernel of ``x``: centered (paper variant, or not float64), or by sums (corrected, float64)."""
    return _cka_side("kernel_sums" if not paper and x.dtype == torch.float64 else "kernel", rbf_kernel(x, paper))


# --------------------------------------------------------------------------------------
# Per-head pipeline
# --------------------------------------------------------------------------------------


def _cka_kernel_sides(x: torch.Tensor, paper: bool) -> dict[str, tuple]:
    """:func:`_cka_side` of the linear CKA (token-centered ``X``) and of the RBF kernel of ``x``."""
    return {"linear": _cka_side("features", x), "rbf": _rbf_side(x, paper)}


def _token_row_metrics(
    v: torch.Tensor,
    vk: torch.Tensor,
    valid: torch.Tensor | None,
    paper: bool,
    prefix: str = "",
    nan_cost_to_zero: bool = False,
    cka_sqrt_of_product: bool = False,
    cache: dict | None = None,
) -> dict[str, torch.Tensor]:
    """Token-row cosines (direct and optimally matched) and CKAs of ``V`` against ``V_KPCA``.

    ``cache`` (a dict, empty at first) keeps ``V``'s centered kernels between calls with the
    same ``V`` (``V_KPCA`` and then the baseline): the same operations, computed once.
    """
    eps = ROW_NORM_EPS if paper else None
    vn, vkn = row_normalize(v, eps), row_normalize(vk, eps)
    if cache is not None and not prefix:
        cache["rows"] = (vn, vkn)  # for head_metrics(rows=...): sign draws (kpca_repro.uncertainty)
    direct = direct_cosine(vn, vkn)
    matched = assignment_similarities(vn @ vkn.transpose(-1, -2), valid, nan_to_zero=nan_cost_to_zero)
    if cache is None:
        cache = {}
    if "v" not in cache:
        cache["v"] = _cka_kernel_sides(v, paper)
    sx, sy = cache["v"], _cka_kernel_sides(vk, paper)
    out = {
        f"{prefix}direct_cos_mean": direct.mean(-1),
        f"{prefix}direct_cos_max": direct.amax(-1),
        f"{prefix}direct_cos_min": direct.amin(-1),
        f"{prefix}direct_cos_frac_negative": (direct < 0).to(v.dtype).mean(-1),
        f"{prefix}optimal_cos_mean": matched.mean(-1),
        f"{prefix}optimal_cos_max": matched.amax(-1),
        f"{prefix}optimal_cos_min": matched.amin(-1),
        f"{prefix}linear_cka": _cka_from_sides(sx["linear"], sy["linear"], paper, cka_sqrt_of_product),
        f"{prefix}rbf_cka": _cka_from_sides(sx["rbf"], sy["rbf"], paper, cka_sqrt_of_product),
    }
    return out


def _column_metrics(v: torch.Tensor, vk: torch.Tensor, valid: torch.Tensor, prefix: str = "", cache: dict | None = None) -> dict[str, torch.Tensor]:
    """Column-wise comparison the paper's text describes (docs/method.md 15.3), sign-invariant.

    Column ``c`` of ``V`` (one value dimension across the ``N`` tokens) against column ``c`` of
    ``V_KPCA`` (one eigen-direction): mean over columns of ``|cos|``; and the optimal
    ``d x d`` matching on ``|cos|``, mean of the matched ``|cos|``. ``cache`` (a dict) keeps
    ``V``'s normalised columns between calls with the same ``V``.
    """
    if cache is None:
        cache = {}
    if "v_columns" not in cache:
        cache["v_columns"] = row_normalize(v, None, dim=-2)
    vc, vkc = cache["v_columns"], row_normalize(vk, None, dim=-2)
    abs_cos = (vc.transpose(-1, -2) @ vkc).abs()
    direct = torch.diagonal(abs_cos, dim1=-2, dim2=-1)
    matched = assignment_similarities(abs_cos, valid)
    return {
        f"{prefix}direct_abs_cos_columns": direct.mean(-1),
        f"{prefix}optimal_abs_cos_columns": matched.mean(-1),
    }


def _corrected_centered_gram(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(centered Kphi, log g)`` of the corrected variant: :func:`log_gram`, ``exp``, :func:`center`.

    The same operations in the same order as those three functions, on one ``N x N`` buffer
    per head (the logits, overwritten in place): bit-identical to them without three copies.
    """
    logits = (k @ k.transpose(-1, -2)).mul_(1.0 / math.sqrt(k.shape[-1]))
    log_g = torch.logsumexp(logits, dim=-1)
    kphi = logits.sub_(log_g[..., :, None]).sub_(log_g[..., None, :]).exp_()
    return _center_(kphi), log_g


def centered_gram(k: torch.Tensor, variant: str) -> torch.Tensor:
    """The centered normalised Gram matrix of the keys, as ``variant`` builds it, batched over heads.

    ``paper``: :func:`gram_paper` then :func:`center_dense` in ``k``'s dtype (plain ``exp``:
    NaN where it overflows); ``corrected``: :func:`log_gram`, ``exp``, then :func:`center`
    (finite for finite keys). :func:`head_metrics` builds the paper variant's matrix one
    head at a time on the CPU instead (``_paper_centered_gram``), to match the authors'
    per-head products to the bit.

    Args:
        k: keys, shape ``(..., N, d)``, already in the variant's dtype (float32 for
            ``paper``, float64 for ``corrected``) and standardized if wanted.
        variant: ``"paper"`` or ``"corrected"``.

    Returns:
        Shape ``(..., N, N)``, ``k``'s dtype and device.

    Raises:
        ValueError: unknown variant.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    if variant == PAPER:
        return center_dense(gram_paper(k)[0])
    return _corrected_centered_gram(k)[0]


def _paper_centered_gram(k: torch.Tensor, threads: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, centered Kphi)`` of the paper variant (:func:`gram_paper`, :func:`center_dense`).

    On the CPU one head at a time, with ``threads`` torch intra-op threads (None: the
    caller's): the authors' per-head products to the bit, whatever the CPU. A batched
    product over several heads rounds differently from the per-head ones on some CPUs (MKL's
    AVX2 path with more than one thread), and these matrices decide the eigenvectors. On
    CUDA, batched.
    """
    if k.device.type != "cpu" or k.shape[0] == 0:
        kphi, g = gram_paper(k)
        return g, center_dense(kphi)
    with intra_op_threads(threads):
        parts = [gram_paper(k[i]) for i in range(k.shape[0])]
        kc = torch.stack([center_dense(p[0]) for p in parts])
    return torch.stack([p[1] for p in parts]), kc


def _paper_v_kpca(a: torch.Tensor, inv_g: torch.Tensor, threads: int | None) -> torch.Tensor:
    """:func:`v_kpca` of the paper variant; on the CPU one head at a time with ``threads`` intra-op
    threads (None: the caller's), as :func:`_paper_centered_gram`: the ``(G O) @ A`` product is
    then the authors' 2-D product of each head, whatever the chunk. On CUDA, batched."""
    if a.device.type != "cpu" or a.shape[0] == 0:
        return v_kpca(a, inv_g)
    with intra_op_threads(threads):
        return torch.stack([v_kpca(a[i], inv_g[i]) for i in range(a.shape[0])])


def head_metrics(
    k: torch.Tensor,
    v: torch.Tensor,
    variant: str,
    *,
    order: str | None = None,
    g_eps: float = 0.0,
    baseline: torch.Tensor | None = None,
    nan_cost_to_zero: bool = False,
    cka_sqrt_of_product: bool = False,
    eigh_per_matrix: bool | None = None,
    eigh_device: str | torch.device | None = None,
    eigh_threads: int | None = None,
    rows: dict | None = None,
) -> dict[str, np.ndarray]:
    """Every per-head quantity of Table 1 (docs/method.md 2) or its corrected form (docs/method.md 15).

    For each head: Gram matrix of the keys, centering, eigenpairs, ``A`` (top ``d``),
    ``V_KPCA`` (Eq. 5), then ``V`` against ``V_KPCA``: the allclose test, direct and
    optimal-matching token-row cosines (mean/max/min), linear CKA and RBF CKA. The corrected
    variant adds column-wise ``|cos|`` metrics and, if ``baseline`` is given, every
    similarity against that random Gaussian stand-in for ``V_KPCA`` (``baseline_*`` columns).
    On the CPU the heads go through in blocks of :data:`CPU_BLOCK_HEADS` (cache-sized; every
    operation is per head, so no number depends on the blocks); on CUDA in one block.

    Args:
        k: keys, shape ``(heads, N, d)``; cast to float32 (paper) or float64 (corrected).
        v: values, shape ``(heads, N, d_v)``, same dtype handling.
        variant: ``"paper"`` or ``"corrected"``.
        order: eigenpair order; default ``"abs_desc"`` (paper, Table 1) or ``"desc"``.
        g_eps: added to ``g`` in ``G = diag(1/(g + g_eps))`` (paper variant; 0 for vision,
            1e-6 for the language-model script).
        baseline: standard normal samples of ``V_KPCA``'s shape ``(heads, N, d)`` (corrected).
        nan_cost_to_zero: reproduce ``nlp_value_vectors.py`` (docs/method.md 3), which has no
            try/except: no head is dropped, every head goes through the assignment with
            NaN similarities replaced by 0 (a non-finite head gets matched cosines 0 while
            its other similarities stay NaN, to be skipped by a NaN-skipping mean).
            Default: the vision reference, where a non-finite head is dropped (all its
            similarities NaN).
        cka_sqrt_of_product: CKA denominators ``sqrt(HSIC_xx HSIC_yy) + 1e-10`` of the
            language-model script (paper variant only; see :func:`linear_cka`).
        eigh_per_matrix: :func:`eigenpairs`'s ``per_matrix`` (default: one matrix at a time on
            the CPU, so each head's numbers do not depend on the batch; one batched solver
            call on CUDA).
        eigh_device: :func:`eigenpairs`'s ``solver_device`` (default: the inputs' device).
        eigh_threads: :func:`eigenpairs`'s ``threads``: torch intra-op threads of each CPU
            ``eigh`` call (default: the caller's). In the paper variant on the CPU, the Gram
            matrix and its centering, which decide the eigenvectors, are then also computed
            one head at a time with that many threads, as the authors' per-head loop does:
            float32 products round differently with the thread count on some CPUs (MKL's
            AVX2 path; docs/fidelity.md). Every later operation runs with the caller's
            threads (its round-off stays far inside the per-head tolerances).
        rows: if a dict, filled with ``"v"`` and ``"v_kpca"``: the row-normalised ``V`` and
            ``V_KPCA`` behind the token-row cosines (``(heads, N, d)``, the variant's dtype),
            for the sign draws of :mod:`kpca_repro.uncertainty`.

    Returns:
        Column name -> float64 numpy array of shape ``(heads,)`` (bool for flags). Flags:
        ``finite`` (the centered Gram matrix is finite), ``dropped`` (the reference would drop
        the head: non-finite Gram or V_KPCA), ``exp_overflow`` (some ``exp(s k.k)`` is inf),
        ``outer_overflow`` (finite ``g`` but ``g_i g_j`` overflowed to inf, entries zeroed),
        ``allclose`` (``|V - V_KPCA| <= 1e-5 + 1e-3 |V_KPCA|`` everywhere).

    Raises:
        ValueError: unknown variant, or ``k`` and ``v`` shapes that disagree.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    if k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must be (heads, N, d) with equal heads and N; got {tuple(k.shape)} and {tuple(v.shape)}")
    if baseline is not None and baseline.shape != v.shape:
        raise ValueError(f"baseline must have V_KPCA's shape {tuple(v.shape)}, got {tuple(baseline.shape)}")
    options = dict(order=order, g_eps=g_eps, nan_cost_to_zero=nan_cost_to_zero, cka_sqrt_of_product=cka_sqrt_of_product)
    options.update(eigh_per_matrix=eigh_per_matrix, eigh_device=eigh_device, eigh_threads=eigh_threads)
    block = CPU_BLOCK_HEADS if k.device.type == "cpu" else max(1, k.shape[0])
    if k.shape[0] <= block:
        return _head_metrics_block(k, v, variant, baseline, rows, **options)
    blocks = []
    for lo in range(0, k.shape[0], block):
        part = slice(lo, lo + block)
        block_rows = {} if rows is not None else None
        blocks.append((_head_metrics_block(k[part], v[part], variant, None if baseline is None else baseline[part], block_rows, **options), block_rows))
    if rows is not None:
        rows.update({name: torch.cat([r[name] for _, r in blocks]) for name in ("v", "v_kpca")})
    return {name: np.concatenate([c[name] for c, _ in blocks]) for name in blocks[0][0]}


def _head_metrics_block(
    k: torch.Tensor,
    v: torch.Tensor,
    variant: str,
    baseline: torch.Tensor | None,
    rows: dict | None,
    *,
    order: str | None,
    g_eps: float,
    nan_cost_to_zero: bool,
    cka_sqrt_of_product: bool,
    eigh_per_matrix: bool | None,
    eigh_device: str | torch.device | None,
    eigh_threads: int | None,
) -> dict[str, np.ndarray]:
    """:func:`head_metrics` of one block of heads (arguments checked by the caller)."""
    paper = variant == PAPER
    dtype = torch.float32 if paper else torch.float64
    k, v = k.to(dtype), v.to(dtype)
    d = min(v.shape[-1], v.shape[-2])  # fewer tokens than dimensions: at most N eigenvectors
    cols: dict[str, torch.Tensor] = {}
    if paper:
        cpu_threads = eigh_threads if eigh_device is None or torch.device(eigh_device).type == "cpu" else None
        g, kc = _paper_centered_gram(k, cpu_threads)
        _, a, finite = eigenpairs(kc, d, order or "abs_desc", per_matrix=eigh_per_matrix, solver_device=eigh_device, threads=eigh_threads)
        vk = _paper_v_kpca(a, 1.0 / (g + g_eps), cpu_threads)
        dropped = ~(finite & torch.isfinite(vk).all(-1).all(-1))
        g_finite = torch.isfinite(g).all(-1)
        cols["exp_overflow"] = ~g_finite
        # some g_i g_j overflows iff the largest does (rounding is monotonic): no N x N product
        g_max = g.amax(-1)
        cols["outer_overflow"] = g_finite & torch.isinf(g_max * g_max)
    else:
        kc, log_g = _corrected_centered_gram(k)
        _, a, finite = eigenpairs(kc, d, order or "desc", fix_signs=True, per_matrix=eigh_per_matrix, solver_device=eigh_device, threads=eigh_threads)
        inv_g = torch.exp(log_g.amin(-1, keepdim=True) - log_g)
        vk = v_kpca(a, inv_g, paper=False)
        dropped = ~(finite & torch.isfinite(vk).all(-1).all(-1))
    if vk.shape[-1] < v.shape[-1]:  # zero columns change no row cosine, X X^T or distance
        vk = torch.nn.functional.pad(vk, (0, v.shape[-1] - vk.shape[-1]))
    vk_true = vk if paper else vk * torch.exp(-log_g.amin(-1))[..., None, None]
    cols["finite"] = finite
    cols["dropped"] = dropped
    cols["allclose"] = ((v - vk_true).abs_() <= vk_true.abs().mul_(1e-3).add_(1e-5)).all(-1).all(-1)
    cache: dict = {}
    cols.update(
        _token_row_metrics(
            v,
            vk,
            None if nan_cost_to_zero else ~dropped,
            paper,
            nan_cost_to_zero=nan_cost_to_zero,
            cka_sqrt_of_product=cka_sqrt_of_product,
            cache=cache,
        )
    )
    if rows is not None:
        rows["v"], rows["v_kpca"] = cache["rows"]
    if not paper:
        cols.update(_column_metrics(v, vk, ~dropped, cache=cache))
        if baseline is not None:
            z = baseline.to(dtype=dtype, device=vk.device)
            everything = torch.ones_like(dropped)
            cols.update(_token_row_metrics(v, z, everything, paper, prefix="baseline_", cache=cache))
            cols.update(_column_metrics(v, z, everything, prefix="baseline_", cache=cache))
    out = {}
    for name, t in cols.items():
        arr = t.detach().cpu().numpy()
        out[name] = arr if arr.dtype == bool else arr.astype(np.float64)
    # A dropped head contributes nothing (docs/method.md 2 step 3): blank its similarities.
    # Without try/except (nan_cost_to_zero, docs/method.md 3) nothing is dropped.
    for name, arr in out.items():
        if arr.dtype != bool and not name.startswith("baseline_") and not nan_cost_to_zero:
            arr[out["dropped"]] = np.nan
    return out


# --------------------------------------------------------------------------------------
# Spectra (Tables 2 and 3)
# --------------------------------------------------------------------------------------


def top_eigenvalues(k: torch.Tensor, n_components: int, variant: str, standardize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n_components`` largest eigenvalues of the centered Gram matrix of the keys.

    docs/method.md Sections 4-5: optional per-token key standardization, Gram matrix, centering,
    ``eigh``, signed-descending order, ``|lambda_r|`` for ranks ``r = 1..n`` (no division by
    ``N``). ``paper``: float32, plain ``exp`` (NaN where it overflows without
    standardization). ``corrected``: float64 log-domain Gram matrix (always finite).

    Args:
        k: keys, shape ``(heads, N, d)``.
        n_components: number of ranks kept (64 in the paper), at most ``N``.
        variant: ``"paper"`` or ``"corrected"``.
        standardize: standardize each key vector first (Table 2) or not (Table 3's starred rows).

    Returns:
        ``(eigenvalues, finite)``: shape ``(heads, n_components)`` float64 with NaN rows for
        non-finite heads, and ``(heads,)`` bool.

    Raises:
        ValueError: unknown variant or ``n_components`` out of range.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    k = k.to(torch.float32 if variant == PAPER else torch.float64)
    if standardize:
        k = standardize_tokens(k)
    kc = centered_gram(k, variant)
    evals, _, finite = eigenpairs(kc, n_components, "desc")
    return evals.abs().double(), finite


# --------------------------------------------------------------------------------------
# The gamma-constancy test (Figure 3)
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


def gamma_test(k: torch.Tensor, n_components: int, variant: str, standardize: bool, noise: float, generator: torch.Generator) -> dict[str, dict[str, torch.Tensor]]:
    """The gamma-constancy test of one set of heads for true and perturbed eigenvectors.

    Keys (optionally standardized per token) -> centered Gram matrix (paper: float32, plain
    ``exp``; corrected: float64 log domain) -> top ``n_components`` eigenvectors in
    signed-descending order -> :func:`gamma_matrix` -> :func:`pairwise_spread`, for ``A`` and
    for :func:`perturb_eigenvectors` of ``A``.

    Args:
        k: keys, shape ``(heads, N, d)``, any floating dtype; cast to float32 (``paper``) or
            float64 (``corrected``).
        n_components: number of eigenvectors tested (the columns of ``A``), at most ``N``.
        variant: ``"paper"`` or ``"corrected"`` (also: eigenvector signs fixed, corrected only).
        standardize: standardize each key vector first (:func:`standardize_tokens`).
        noise: standard deviation of the perturbation (:func:`perturb_eigenvectors`).
        generator: CPU ``torch.Generator`` of the perturbation; advanced by the draw.

    Returns:
        ``{"true": spread, "perturbed": spread}`` with :func:`pairwise_spread`'s dicts of
        tensors of shape ``(heads, n_components)``, in the variant's dtype, on ``k``'s device.

    Raises:
        ValueError: unknown variant.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    k = k.to(torch.float32 if variant == PAPER else torch.float64)
    if standardize:
        k = standardize_tokens(k)
    kc = centered_gram(k, variant)
    _, a, _ = eigenpairs(kc, n_components, "desc", fix_signs=variant != PAPER)
    return {
        "true": pairwise_spread(gamma_matrix(kc, a)),
        "perturbed": pairwise_spread(gamma_matrix(kc, perturb_eigenvectors(a, noise, generator))),
    }
