"""The KPCA engine: :mod:`kpca_repro.method.equations`'s mathematics on batches of heads, fast and per head exact.

The mathematics (Gram matrix, centering, eigenpairs, V_KPCA, cosines, CKA, gamma test) is
stated in :mod:`kpca_repro.method.equations`; what differs between the two variants is data in
:mod:`kpca_repro.method.variant`. This module runs them on whole layers of whole image batches
(``B * H`` heads, tensors ``(heads, N, d)``) on the CPU or a GPU, and holds the performance
engineering that keeps each head's numbers those of a per-head loop:

* :func:`head_metrics` in cache-sized blocks of :data:`CPU_BLOCK_HEADS` heads on the CPU;
* :func:`eigenpairs`: ``eigh`` where the job's :class:`~kpca_repro.method.placement.Placement`
  says (one matrix at a time on the CPU, as LAPACK's path depends on the batch; one batched
  call on a GPU, torch's or JAX's solver), non-finite matrices kept from the solver, a
  fallback when one matrix does not converge;
* the authors' thread count for the paper variant's per-head products and ``eigh``
  (:meth:`Placement.solver_threads <kpca_repro.method.placement.Placement.solver_threads>`,
  docs/fidelity.md);
* the paper variant's Gram matrix, centering and V_KPCA per head
  (:func:`_paper_centered_gram`, :func:`_paper_v_kpca`), the corrected variant's in place
  (:func:`_corrected_centered_gram`);
* ``V``'s CKA sides computed once for ``V_KPCA`` and the baseline (:func:`_token_row_metrics`).

Notation (docs/method.md Section 0.1): ``N`` tokens, ``d`` head dimension, ``s = 1/sqrt(d)``,
``K`` keys, ``V`` values, ``g_i = sum_j exp(s k_i . k_j)`` and
``V_KPCA = G A - G 1_N A`` with ``G = diag(1/g)`` and ``A`` the top-``d`` eigenvectors of the
centered Gram matrix (paper Eq. 5).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kpca_repro.method.equations import (
    center_dense,
    center_inplace,
    cka_from_sides,
    cka_side,
    direct_cosine,
    fix_eigenvector_signs,
    gamma_matrix,
    gram_paper,
    normaliser_kernel,
    pairwise_spread,
    perturb_eigenvectors,
    projection_norm_bound,
    projection_test,
    rbf_kernel,
    rbf_side,
    row_normalize,
    select_eigenpairs,
    unbiased_cka_from_sides,
    unbiased_side,
    v_kpca,
)
from kpca_repro.method.numerics import assignment_similarities
from kpca_repro.method.placement import Placement
from kpca_repro.method.variant import VARIANTS, Variant
from kpca_repro.method.variant import get as get_variant
from kpca_repro.projection import (
    ROW_NORM_EPS,
    standardize_tokens,
)

__all__ = [
    "VARIANTS",
    "CPU_BLOCK_HEADS",
    "centered_gram",
    "eigenpairs",
    "head_metrics",
    "solve_heads",
    "top_eigenvalues",
    "gamma_test",
]

#: Heads per block of :func:`head_metrics` on the CPU. Its many elementwise passes over
#: ``N x N`` matrices then stay in the core's cache (eight float64 197 x 197 matrices are
#: 2.5 MB), where a chunk of 64 heads would stream 20 MB per pass from memory (the measurement
#: that chose 8: docs/performance.md, design choices). Every operation is per head, so the
#: block size changes no number.
CPU_BLOCK_HEADS = 8


# --------------------------------------------------------------------------------------
# Eigenpairs
# --------------------------------------------------------------------------------------


def _eigh_batched(m: torch.Tensor, solver: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``eigh`` of every matrix of ``m`` ``(..., N, N)`` in one call: ``torch.linalg.eigh`` or
    ``jax.numpy.linalg.eigh`` (through DLPack, no copy; float64 switches on JAX's ``jax_enable_x64``).
    Eigenvalues ascending, eigenvectors in columns, on ``m``'s device."""
    if solver == "torch":
        return torch.linalg.eigh(m)
    import jax
    import jax.numpy as jnp

    if m.dtype == torch.float64:
        jax.config.update("jax_enable_x64", True)
    w, v = jnp.linalg.eigh(jax.dlpack.from_dlpack(m.contiguous()))
    return torch.from_dlpack(w).to(m.device), torch.from_dlpack(v).to(m.device)


def _solve(
    safe: torch.Tensor,
    finite: torch.Tensor,
    n: int,
    per_matrix: bool,
    n_components: int,
    order: str,
    solver: str = "torch",
) -> tuple[torch.Tensor, ...]:
    """``eigh`` of every matrix of ``safe`` (one at a time, or in one ``solver`` call), then :func:`select_eigenpairs`;
    see :func:`eigenpairs`.

    One matrix at a time, each matrix's kept columns are selected before anything is stacked,
    so no ``(heads, N, N)`` copy of all eigenvectors is made. Returns ``(selected eigenvalues,
    selected eigenvectors, finite, every eigenvalue in ascending order)``.
    """
    kc = safe
    try:
        if per_matrix:
            flat = safe.reshape(-1, n, n)
            spectra, pairs = [], []
            for i in range(flat.shape[0]):
                w, vecs = torch.linalg.eigh(flat[i])
                spectra.append(w)
                pairs.append(select_eigenpairs(w, vecs, n_components, order))
            if not pairs:
                return (
                    safe.new_empty((*safe.shape[:-2], n_components)),
                    safe.new_empty((*safe.shape[:-1], n_components)),
                    finite,
                    safe.new_empty(safe.shape[:-1]),
                )
            evals = torch.stack([p[0] for p in pairs]).reshape(*safe.shape[:-2], n_components)
            evecs = torch.stack([p[1] for p in pairs]).reshape(*safe.shape[:-1], n_components)
            return evals, evecs, finite, torch.stack(spectra).reshape(safe.shape[:-1])
        evals, evecs = _eigh_batched(safe, solver)
        if solver != "torch" and not bool(torch.isfinite(evals).all()):  # JAX returns NaN where LAPACK raises
            raise torch.linalg.LinAlgError("the batched solver returned non-finite eigenvalues")
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
    return *select_eigenpairs(evals, evecs, n_components, order), finite, evals


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


def eigenpairs(
    kc: torch.Tensor,
    n_components: int,
    order: str = "abs_desc",
    fix_signs: bool = False,
    placement: Placement | None = None,
    spectrum: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top eigenpairs of symmetric matrices, batched, non-finite matrices handled.

    ``eigh`` on every matrix, then the selection rule of the script being reproduced
    (docs/method.md 0.2 step 6):

    * ``"abs_desc"``: by ``|lambda|`` descending (Table 1, ``value_vectors.py``);
    * ``"desc"``: by signed eigenvalue descending (Tables 2-3, Fig. 3; the corrected variant);
    * ``"asc_top"``: the last ``n_components`` columns of ``eigh``'s ascending output, kept
      in ascending order (Table 4, ``nlp_value_vectors.py``).

    A matrix with a non-finite entry is not passed to the solver (LAPACK may silently return
    NaN or raise for it); its eigenpairs are returned as NaN and ``finite`` is False, which
    is how the reference ends up dropping such a head.

    Where the solver runs is ``placement``'s decision (:mod:`kpca_repro.method.placement`):

    * on the CPU one freshly allocated matrix per call. LAPACK (MKL) picks its code path by
      the memory alignment of each matrix in a batch, so batched CPU ``eigh`` gives a head
      different round-off, and at near-degenerate eigenvalues a different eigenvector sign,
      depending on its position in the batch. One matrix at a time, every head gets the
      result a per-head loop gives, whatever the batch size or sharding
      (docs/performance.md). Each call runs on ``placement.eigh_threads`` intra-op threads
      (MKL's ``syevd`` takes another code path for another thread count: the paper variant
      passes the authors', docs/fidelity.md);
    * on a GPU one batched call (``placement.eigensolver``: torch's, which for the paper
      variant is the authors' call, or JAX's).

    Args:
        kc: symmetric matrices, shape ``(..., N, N)``.
        n_components: number of eigenpairs kept (``d``), ``1 <= n_components <= N``.
        order: one of ``"abs_desc"``, ``"desc"``, ``"asc_top"``.
        fix_signs: make each eigenvector's entry of largest magnitude positive
            (docs/method.md 15.2), so the result does not depend on the LAPACK/cuSOLVER sign.
        placement: where and how ``eigh`` runs; default :meth:`Placement.local` of ``kc``'s
            device (one matrix per call on the CPU with the caller's threads, batched torch
            on a GPU).
        spectrum: if a dict, ``spectrum["eigenvalues"]`` receives every eigenvalue the solver
            returned, ascending, ``(..., N)`` (NaN for a non-finite matrix), on ``kc``'s device.

    Returns:
        ``(eigenvalues, eigenvectors, finite)`` with shapes ``(..., n)``, ``(..., N, n)``
        and ``(...)`` (bool), on ``kc``'s device. No division by ``N``: these are
        eigenvalues of ``K~_phi``.

    Raises:
        ValueError: unknown ``order`` or ``n_components`` out of range.
    """
    n = kc.shape[-1]
    if not 1 <= n_components <= n:
        raise ValueError(f"n_components must be in [1, {n}], got {n_components}")
    if order not in ("abs_desc", "desc", "asc_top"):
        raise ValueError(f"unknown eigenpair order {order!r}")
    placement = placement or Placement.local(kc.device)
    home = kc.device
    if placement.eigh_device != home:
        kc = kc.to(placement.eigh_device)
    finite = _finite_matrices(kc)
    safe = (
        kc
        if bool(finite.all())
        else torch.where(finite[..., None, None], kc, torch.zeros((), dtype=kc.dtype, device=kc.device))
    )
    per_matrix = not placement.eigh_batched
    with placement.solver_threads():
        evals, evecs, finite, every = _solve(safe, finite, n, per_matrix, n_components, order, placement.eigensolver)
    if fix_signs:
        evecs = fix_eigenvector_signs(evecs)
    if not bool(finite.all()):
        nan = torch.tensor(float("nan"), dtype=kc.dtype, device=kc.device)
        evals = torch.where(finite[..., None], evals, nan)
        evecs = torch.where(finite[..., None, None], evecs, nan)
        every = torch.where(finite[..., None], every, nan)
    if spectrum is not None:
        spectrum["eigenvalues"] = every.to(home)
    return evals.to(home), evecs.to(home), finite.to(home)


# --------------------------------------------------------------------------------------
# Per-head pipeline
# --------------------------------------------------------------------------------------


def _cka_kernel_sides(x: torch.Tensor, paper: bool) -> dict[str, tuple]:
    """:func:`cka_side` of the linear CKA (token-centered ``X``) and of the RBF kernel of ``x``."""
    return {"linear": cka_side("features", x), "rbf": rbf_side(x, paper)}


def _token_row_metrics(
    v: torch.Tensor, vk: torch.Tensor, valid: torch.Tensor | None, variant: Variant, cache: dict, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Token-row cosines (direct and optimally matched) and CKAs of ``V`` against ``V_KPCA``,
    with ``variant``'s formulas (``authors_formulas``, ``nan_cost_to_zero``, ``cka_sqrt_of_product``).

    ``cache`` (a dict, empty at first) keeps ``V``'s centered kernels between calls with the
    same ``V`` (``V_KPCA`` and then the baseline): the same operations, computed once.
    """
    paper, sqrt_of_product = variant.authors_formulas, variant.cka_sqrt_of_product
    eps = ROW_NORM_EPS if paper else None
    vn, vkn = row_normalize(v, eps), row_normalize(vk, eps)
    if not prefix:
        cache["rows"] = (vn, vkn)  # for head_metrics(rows=...): sign draws (kpca_repro.method.uncertainty)
    direct = direct_cosine(vn, vkn)
    matched = assignment_similarities(vn @ vkn.transpose(-1, -2), valid, nan_to_zero=variant.nan_cost_to_zero)
    if "v" not in cache:
        cache["v"] = _cka_kernel_sides(v, paper)
    sx, sy = cache["v"], _cka_kernel_sides(vk, paper)
    unbiased = {}
    if variant.controls:
        if "v_unbiased" not in cache:
            cache["v_unbiased"] = _unbiased_sides(v, sx["rbf"])
        unbiased = _unbiased_ckas(cache["v_unbiased"], _unbiased_sides(vk, sy["rbf"]), prefix)
    return {
        **unbiased,
        f"{prefix}direct_cos_mean": direct.mean(-1),
        f"{prefix}direct_cos_max": direct.amax(-1),
        f"{prefix}direct_cos_min": direct.amin(-1),
        f"{prefix}direct_cos_frac_negative": (direct < 0).to(v.dtype).mean(-1),
        f"{prefix}optimal_cos_mean": matched.mean(-1),
        f"{prefix}optimal_cos_max": matched.amax(-1),
        f"{prefix}optimal_cos_min": matched.amin(-1),
        f"{prefix}linear_cka": cka_from_sides(sx["linear"], sy["linear"], paper, sqrt_of_product),
        f"{prefix}rbf_cka": cka_from_sides(sx["rbf"], sy["rbf"], paper, sqrt_of_product),
    }


def _unbiased_sides(x: torch.Tensor, rbf: tuple) -> dict[str, tuple]:
    """:func:`unbiased_side` of the linear kernel ``X X^T`` and of the RBF kernel of ``rbf`` (a
    ``"kernel_sums"`` :func:`cka_side`, whose first sum is the uncentered kernel)."""
    return {"linear": unbiased_side(x @ x.transpose(-1, -2)), "rbf": unbiased_side(rbf[1][0])}


def _unbiased_ckas(sx: dict, sy: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Linear and RBF CKA with the unbiased HSIC estimator (docs/method.md 17.2)."""
    return {f"{prefix}{kind}_cka_unbiased": unbiased_cka_from_sides(sx[kind], sy[kind]) for kind in ("linear", "rbf")}


def _control_metrics(v: torch.Tensor, inv_g: torch.Tensor, cache: dict) -> dict[str, torch.Tensor]:
    """The all-components control (docs/method.md 17.1): linear and RBF CKA, biased and
    unbiased, of ``V`` against ``G H``, through its row Gram matrix ``G H G``
    (:func:`normaliser_kernel`); equal to the CKA of ``V_KPCA`` when every direction is kept."""
    kernel = normaliser_kernel(inv_g)
    rbf = rbf_kernel(kernel, paper=False, gram=kernel)
    if "v_linear_sums" not in cache:
        cache["v_linear_sums"] = cka_side("kernel_sums", v @ v.transpose(-1, -2))
    sides = {"linear": cka_side("kernel_sums", kernel), "rbf": cka_side("kernel_sums", rbf)}
    out = {
        f"control_{kind}_cka": cka_from_sides(
            cache["v_linear_sums"] if kind == "linear" else cache["v"]["rbf"], sides[kind], False
        )
        for kind in ("linear", "rbf")
    }
    out.update(
        _unbiased_ckas(cache["v_unbiased"], {"linear": unbiased_side(kernel), "rbf": unbiased_side(rbf)}, "control_")
    )
    return out


def _projection_metrics(
    k: torch.Tensor, queries: tuple[torch.Tensor, torch.Tensor], solved: dict, baseline: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """:func:`projection_test` of ``V_KPCA`` (true scale) and of the random baseline, and the
    all-components bound :func:`projection_norm_bound` (docs/method.md 17.3)."""
    q, h = queries
    out = {f"projection_{name}": t for name, t in projection_test(q, k, h, solved["vk_true"]).items()}
    if baseline is not None:
        out.update({f"baseline_projection_{name}": t for name, t in projection_test(q, k, h, baseline).items()})
    out["control_projection_norm_ratio"] = projection_norm_bound(q, k, h, solved["inv_g_true"])
    return out


def _column_metrics(
    v: torch.Tensor, vk: torch.Tensor, valid: torch.Tensor, cache: dict, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Column-wise comparison the paper's text describes (docs/method.md 15.3), sign-invariant.

    Column ``c`` of ``V`` (one value dimension across the ``N`` tokens) against column ``c`` of
    ``V_KPCA`` (one eigen-direction): mean over columns of ``|cos|``; and the optimal
    ``d x d`` matching on ``|cos|``, mean of the matched ``|cos|``. ``cache`` (a dict) keeps
    ``V``'s normalised columns between calls with the same ``V``.
    """
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
    return center_inplace(kphi), log_g


def centered_gram(k: torch.Tensor, variant: str | Variant, standardize: bool = False) -> torch.Tensor:
    """The centered normalised Gram matrix of the keys, as ``variant`` builds it, batched over heads
    (docs/method.md 0.2 steps 1-4; 15.1).

    The keys are cast to the variant's dtype and, with ``standardize``, standardized per token
    (:func:`standardize_tokens`, docs/method.md 4). ``gram`` ``"exp"`` (paper):
    :func:`gram_paper` then :func:`center_dense` (plain ``exp``: NaN where it overflows);
    ``"log"`` (corrected): :func:`log_gram`, ``exp``, then :func:`center` (finite for finite
    keys). :func:`head_metrics` builds the paper variant's matrix one head at a time on the
    CPU instead (``_paper_centered_gram``), to match the authors' per-head products to the bit.

    Args:
        k: keys, shape ``(..., N, d)``, any floating dtype.
        variant: a :class:`~kpca_repro.method.variant.Variant` or its name: its ``dtype`` and ``gram``.
        standardize: standardize each key vector first (Tables 2-3, Figure 3).

    Returns:
        Shape ``(..., N, N)``, the variant's dtype, ``k``'s device.

    Raises:
        ValueError: unknown variant.
    """
    variant = get_variant(variant)
    k = k.to(variant.torch_dtype)
    if standardize:
        k = standardize_tokens(k)
    if variant.gram == "exp":
        return center_dense(gram_paper(k)[0])
    return _corrected_centered_gram(k)[0]


def _paper_centered_gram(k: torch.Tensor, placement: Placement) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, centered Kphi)`` of the paper variant (:func:`gram_paper`, :func:`center_dense`).

    With ``placement.per_head_products`` one head at a time, as the authors' loop computes
    them (on the CPU with the authors' thread count, :meth:`Placement.solver_threads`): a
    batched product over several heads rounds differently from the per-head ones on some
    CPUs (MKL's AVX2 path with more than one thread), and these matrices decide the
    eigenvectors. Otherwise batched.
    """
    if not placement.per_head_products or k.shape[0] == 0:
        kphi, g = gram_paper(k)
        return g, center_dense(kphi)
    with placement.solver_threads():
        parts = [gram_paper(k[i]) for i in range(k.shape[0])]
        kc = torch.stack([center_dense(p[0]) for p in parts])
    return torch.stack([p[1] for p in parts]), kc


def _paper_v_kpca(a: torch.Tensor, inv_g: torch.Tensor, placement: Placement) -> torch.Tensor:
    """:func:`v_kpca` of the paper variant; one head at a time as :func:`_paper_centered_gram`
    (the ``(G O) @ A`` product is then the authors' 2-D product of each head, whatever the
    chunk), otherwise batched."""
    if not placement.per_head_products or a.shape[0] == 0:
        return v_kpca(a, inv_g)
    with placement.solver_threads():
        return torch.stack([v_kpca(a[i], inv_g[i]) for i in range(a.shape[0])])


def head_metrics(
    k: torch.Tensor,
    v: torch.Tensor,
    variant: str | Variant,
    *,
    placement: Placement | None = None,
    baseline: torch.Tensor | None = None,
    rows: dict | None = None,
    solved: dict[str, torch.Tensor] | None = None,
    queries: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, np.ndarray]:
    """Every per-head quantity of Tables 1 and 4 (docs/method.md 2, 3) or their corrected form (docs/method.md 15).

    For each head: Gram matrix of the keys, centering, eigenpairs, ``A`` (top ``d``),
    ``V_KPCA`` (Eq. 5), then ``V`` against ``V_KPCA``: the allclose test, direct and
    optimal-matching token-row cosines (mean/max/min), linear CKA and RBF CKA. The corrected
    variant adds column-wise ``|cos|`` metrics and, if ``baseline`` is given, every
    similarity against that random Gaussian stand-in for ``V_KPCA`` (``baseline_*`` columns).
    On the CPU the heads go through in blocks of :data:`CPU_BLOCK_HEADS` (cache-sized; every
    operation is per head, so no number depends on the blocks); on CUDA in one block.

    Args:
        k: keys, shape ``(heads, N, d)``; cast to the variant's dtype (float32 paper, float64 corrected).
        v: values, shape ``(heads, N, d_v)``, same dtype handling.
        variant: a :class:`~kpca_repro.method.variant.Variant` or its name (``"paper"``,
            ``"corrected"``); every choice is its fields': dtype, Gram matrix, eigenpair order
            and sign rule, ``g_eps``, formulas (``authors_formulas``, ``nan_cost_to_zero``,
            ``cka_sqrt_of_product``) and metrics. Heads of a language-model file take
            ``variant.reading(text=True)`` (the paper variant: ``nlp_value_vectors.py``'s options).
        placement: where ``eigh`` and the paper variant's per-head products run, on how many
            threads (:mod:`kpca_repro.method.placement`; a job passes
            :func:`~kpca_repro.method.placement.plan`'s). Default :meth:`Placement.local` of
            ``k``'s device with per-head products for the paper variant and the caller's
            threads. The paper variant's per-head numbers depend on the device and on the
            thread count of the CPU ``eigh`` and products, on nothing else.
        baseline: standard normal samples of ``V_KPCA``'s shape ``(heads, N, d)`` (corrected).
        rows: if a dict, filled with ``"v"`` and ``"v_kpca"``: the row-normalised ``V`` and
            ``V_KPCA`` behind the token-row cosines (``(heads, N, d)``, the variant's dtype),
            for the sign draws of :mod:`kpca_repro.method.uncertainty`; and ``"kc"``, ``"a"``,
            ``"inv_g"``, ``"spectrum"`` (centered Gram matrices, selected eigenvectors,
            diagonal of ``G``, every eigenvalue the solver returned) for the rotations of
            :mod:`kpca_repro.method.solver_variation`.
        solved: :func:`solve_heads` of these heads, when the caller solved them already (the
            ``kpca_heads`` job solves the paper variant on its main thread and compares on
            its workers, one batch behind).
        queries: ``(q, h)``, each ``(heads, G, M, d)``: ``M`` queries of the ``G`` query heads
            that read each head's keys, attending to all ``N`` keys, and the attention's own
            outputs ``h`` of them; adds the projection test (``projection_*``, docs/method.md 17.3).

    Returns:
        Column name -> float64 numpy array of shape ``(heads,)`` (bool for flags). Flags:
        ``finite`` (the centered Gram matrix is finite), ``dropped`` (the reference would drop
        the head: non-finite Gram or V_KPCA), ``exp_overflow`` (some ``exp(s k.k)`` is inf),
        ``outer_overflow`` (finite ``g`` but ``g_i g_j`` overflowed to inf, entries zeroed),
        ``allclose`` (``|V - V_KPCA| <= 1e-5 + 1e-3 |V_KPCA|`` everywhere). A dropped head's
        similarities are NaN, except with ``nan_cost_to_zero`` (nothing dropped).

    Raises:
        ValueError: unknown variant, or ``k`` and ``v`` shapes that disagree.
    """
    variant = get_variant(variant)
    if k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"k and v must be (heads, N, d) with equal heads and N; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if baseline is not None and baseline.shape != v.shape:
        raise ValueError(f"baseline must have V_KPCA's shape {tuple(v.shape)}, got {tuple(baseline.shape)}")
    placement = placement or Placement.local(k.device, per_head_products=variant.authors_threads)
    block = CPU_BLOCK_HEADS if k.device.type == "cpu" else max(1, k.shape[0])
    # The paper variant's per-head products and eigh for the whole chunk at once (on the
    # authors' thread count); the comparisons in cache-sized blocks.
    if solved is None and variant.gram == "exp":
        solved = solve_heads(k, v.shape[-1], variant, placement)
    blocks = []
    for lo in range(0, max(k.shape[0], 1), block):
        part = slice(lo, lo + block)
        heads = (
            solved_part(solved, part) if solved is not None else solve_heads(k[part], v.shape[-1], variant, placement)
        )
        block_rows = {} if rows is not None else None
        block_queries = None if queries is None else tuple(x[part] for x in queries)
        blocks.append(
            (
                _compare_heads(
                    v[part],
                    heads,
                    variant,
                    None if baseline is None else baseline[part],
                    block_rows,
                    k[part],
                    block_queries,
                ),
                block_rows,
            )
        )
    if rows is not None:
        rows.update(
            {name: torch.cat([r[name] for _, r in blocks]) for name in ("v", "v_kpca", "kc", "a", "inv_g", "spectrum")}
        )
    return {name: np.concatenate([c[name] for c, _ in blocks]) for name in blocks[0][0]}


def solved_part(solved: dict[str, torch.Tensor], part: slice) -> dict[str, torch.Tensor]:
    """The heads ``part`` of :func:`solve_heads`' result."""
    return {name: t[part] for name, t in solved.items()}


def solve_heads(k: torch.Tensor, dv: int, variant: Variant, placement: Placement) -> dict[str, torch.Tensor]:
    """The part of :func:`head_metrics` that decides the eigenvectors: Gram matrix, centering,
    eigenpairs and V_KPCA of the heads ``k`` ``(heads, N, d)``, as ``variant`` (``gram``,
    ``order``, ``fix_signs``, ``g_eps``, ``authors_formulas``) and ``placement`` say.

    Returns:
        ``kc`` (centered Gram matrices), ``spectrum`` (every eigenvalue), ``a`` (selected
        eigenvectors), ``finite``, ``vk`` (V_KPCA, zero-padded to ``dv`` columns), ``vk_true``
        (V_KPCA itself: the corrected variant's ``vk`` is scaled by a positive factor),
        ``inv_g`` (the diagonal of ``G``; the corrected variant's times a positive factor),
        ``inv_g_true`` (``1/g`` itself), ``dropped`` and, for the paper variant,
        ``exp_overflow`` and ``outer_overflow``; per head, in the variant's dtype.
    """
    k = k.to(variant.torch_dtype)
    d = min(dv, k.shape[-2])  # fewer tokens than dimensions: at most N eigenvectors
    spectrum: dict = {}
    out: dict[str, torch.Tensor] = {}
    if variant.gram == "exp":
        with placement.solver_threads():
            g, kc = _paper_centered_gram(k, placement)
            _, a, finite = eigenpairs(
                kc, d, variant.order, fix_signs=variant.fix_signs, placement=placement, spectrum=spectrum
            )
            inv_g = 1.0 / (g + variant.g_eps)
            vk = _paper_v_kpca(a, inv_g, placement)
        g_finite = torch.isfinite(g).all(-1)
        out["exp_overflow"] = ~g_finite
        # some g_i g_j overflows iff the largest does (rounding is monotonic): no N x N product
        g_max = g.amax(-1)
        out["outer_overflow"] = g_finite & torch.isinf(g_max * g_max)
        scale = None
        inv_g_true = inv_g
    else:
        kc, log_g = _corrected_centered_gram(k)
        _, a, finite = eigenpairs(
            kc, d, variant.order, fix_signs=variant.fix_signs, placement=placement, spectrum=spectrum
        )
        inv_g = torch.exp(log_g.amin(-1, keepdim=True) - log_g)
        vk = v_kpca(a, inv_g, paper=variant.authors_formulas)
        scale = torch.exp(-log_g.amin(-1))
        inv_g_true = torch.exp(-log_g)
    dropped = ~(finite & torch.isfinite(vk).all(-1).all(-1))
    if vk.shape[-1] < dv:  # zero columns change no row cosine, X X^T or distance
        vk = torch.nn.functional.pad(vk, (0, dv - vk.shape[-1]))
    out.update(
        kc=kc,
        spectrum=spectrum["eigenvalues"],
        a=a,
        finite=finite,
        vk=vk,
        vk_true=vk if scale is None else vk * scale[..., None, None],
        inv_g=inv_g,
        inv_g_true=inv_g_true,
        dropped=dropped,
    )
    return out


def _compare_heads(
    v: torch.Tensor,
    solved: dict[str, torch.Tensor],
    variant: Variant,
    baseline: torch.Tensor | None,
    rows: dict | None,
    k: torch.Tensor | None = None,
    queries: tuple | None = None,
) -> dict[str, np.ndarray]:
    """The comparisons of :func:`head_metrics` (V against V_KPCA, the baselines, the controls and
    with ``queries`` the projection test) of one block of heads ``k``."""
    dtype = variant.torch_dtype
    v = v.to(dtype)
    vk, vk_true, dropped = solved["vk"], solved["vk_true"], solved["dropped"]
    cols: dict[str, torch.Tensor] = {
        name: solved[name] for name in ("exp_overflow", "outer_overflow") if name in solved
    }
    cols["finite"] = solved["finite"]
    cols["dropped"] = dropped
    cols["allclose"] = ((v - vk_true).abs_() <= vk_true.abs().mul_(1e-3).add_(1e-5)).all(-1).all(-1)
    cache: dict = {}
    cols.update(_token_row_metrics(v, vk, None if variant.nan_cost_to_zero else ~dropped, variant, cache))
    if rows is not None:
        rows["v"], rows["v_kpca"] = cache["rows"]
        # for rotations inside near-degenerate eigenspaces (kpca_repro.method.solver_variation)
        rows.update(kc=solved["kc"], a=solved["a"], spectrum=solved["spectrum"], inv_g=solved["inv_g"])
    if variant.column_metrics:
        cols.update(_column_metrics(v, vk, ~dropped, cache))
    z = None
    if variant.baselines and baseline is not None:
        z = baseline.to(dtype=dtype, device=vk.device)
        everything = torch.ones_like(dropped)
        cols.update(_token_row_metrics(v, z, everything, variant, cache, prefix="baseline_"))
        cols.update(_column_metrics(v, z, everything, cache, prefix="baseline_"))
    if variant.controls:
        cols.update(_control_metrics(v, solved["inv_g"], cache))
    if queries is not None:
        cols.update(_projection_metrics(k.to(dtype), tuple(x.to(dtype) for x in queries), solved, z))
    out = {}
    for name, t in cols.items():
        arr = t.detach().cpu().numpy()
        out[name] = arr if arr.dtype == bool else arr.astype(np.float64)
    # A dropped head contributes nothing (docs/method.md 2 step 3): blank its similarities.
    # Without try/except (nan_cost_to_zero, docs/method.md 3) nothing is dropped.
    for name, arr in out.items():
        if arr.dtype != bool and not name.startswith("baseline_") and not variant.nan_cost_to_zero:
            arr[out["dropped"]] = np.nan
    return out


# --------------------------------------------------------------------------------------
# Spectra (Tables 2 and 3)
# --------------------------------------------------------------------------------------


def top_eigenvalues(
    k: torch.Tensor, n_components: int, variant: str | Variant, standardize: bool, placement: Placement | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n_components`` largest eigenvalues of the centered Gram matrix of the keys.

    docs/method.md Sections 4-5: optional per-token key standardization, Gram matrix, centering,
    ``eigh``, signed-descending order, ``|lambda_r|`` for ranks ``r = 1..n`` (no division by
    ``N``). ``paper``: float32, plain ``exp`` (NaN where it overflows without
    standardization). ``corrected``: float64 log-domain Gram matrix (always finite).

    Args:
        k: keys, shape ``(heads, N, d)``.
        n_components: number of ranks kept (64 in the paper), at most ``N``.
        variant: a :class:`~kpca_repro.method.variant.Variant` or its name (``"paper"``, ``"corrected"``).
        standardize: standardize each key vector first (Table 2) or not (Table 3's starred rows).
        placement: where ``eigh`` runs (:func:`eigenpairs`); eigenvalues do not depend on the
            eigenvector signs, so a GPU job may use any batched solver.

    Returns:
        ``(eigenvalues, finite)``: shape ``(heads, n_components)`` float64 with NaN rows for
        non-finite heads, and ``(heads,)`` bool.

    Raises:
        ValueError: unknown variant or ``n_components`` out of range.
    """
    evals, _, finite = eigenpairs(centered_gram(k, variant, standardize), n_components, "desc", placement=placement)
    return evals.abs().double(), finite


# --------------------------------------------------------------------------------------
# The gamma-constancy test (Figure 3)
# --------------------------------------------------------------------------------------


def gamma_test(
    k: torch.Tensor,
    n_components: int,
    variant: str | Variant,
    standardize: bool,
    noise: float,
    generator: torch.Generator,
    placement: Placement | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """The gamma-constancy test of one set of heads for true and perturbed eigenvectors.

    Keys (optionally standardized per token) -> centered Gram matrix (paper: float32, plain
    ``exp``; corrected: float64 log domain) -> top ``n_components`` eigenvectors in
    signed-descending order -> :func:`gamma_matrix` -> :func:`pairwise_spread`, for ``A`` and
    for :func:`perturb_eigenvectors` of ``A``.

    Args:
        k: keys, shape ``(heads, N, d)``, any floating dtype; cast to float32 (``paper``) or
            float64 (``corrected``).
        n_components: number of eigenvectors tested (the columns of ``A``), at most ``N``.
        variant: a :class:`~kpca_repro.method.variant.Variant` or its name: also its sign rule ``fix_signs``.
        standardize: standardize each key vector first (:func:`standardize_tokens`).
        noise: standard deviation of the perturbation (:func:`perturb_eigenvectors`).
        generator: CPU ``torch.Generator`` of the perturbation; advanced by the draw.
        placement: where ``eigh`` runs (:func:`eigenpairs`).

    Returns:
        ``{"true": spread, "perturbed": spread}`` with :func:`pairwise_spread`'s dicts of
        tensors of shape ``(heads, n_components)``, in the variant's dtype, on ``k``'s device.

    Raises:
        ValueError: unknown variant.
    """
    variant = get_variant(variant)
    kc = centered_gram(k, variant, standardize)
    _, a, _ = eigenpairs(kc, n_components, "desc", fix_signs=variant.fix_signs, placement=placement)
    return {
        "true": pairwise_spread(gamma_matrix(kc, a)),
        "perturbed": pairwise_spread(gamma_matrix(kc, perturb_eigenvectors(a, noise, generator))),
    }
