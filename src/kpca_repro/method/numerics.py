"""Exact, faster primitives the method calls: order statistics and the optimal assignment.

Each function returns what its plain statement returns (the same order statistic, the same
matching), found faster on the CPU (docs/performance.md, design choices), except
:func:`frobenius_dot`, whose summation order differs and which is used in float64 only.
The mathematics that calls them is :mod:`kpca_repro.method.equations`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

__all__ = ["assignment_similarities", "frobenius_dot", "median_nonzero"]


def assignment_similarities(
    sim: torch.Tensor, valid: torch.Tensor | None = None, nan_to_zero: bool = False
) -> torch.Tensor:
    """Optimal one-to-one matching that maximises total similarity, per matrix.

    ``scipy.optimize.linear_sum_assignment(-S)`` (Jonker-Volgenant) on each square
    ``S``, on the CPU in float64 as the reference does; returns the matched similarities
    ``o_i = S[i, pi(i)]`` in row order.

    A square ``S`` is solved as its transpose ``S^T`` (``V_KPCA``'s tokens as the solver's
    rows), whose optimal matching is the inverse of ``S``'s, and the solver gets the reduced
    cost ``C - min_row - min_col`` of ``C = -S^T`` instead of ``C``: in a square problem every
    row and every column is matched exactly once, so subtracting a constant from a row or a
    column shifts every assignment's total by the same amount and leaves the optimal matching
    unchanged, and the matched values are read from ``S`` itself. The solver augments one row
    at a time along shortest paths; with these smaller reduced costs, and with the rows that
    collide less on their best column, it is faster on real heads (docs/performance.md, design
    choices). Where several matchings are optimal within round-off, it may return another of
    them than a call on ``-S``: their mean similarities agreed to 1e-20 on real heads.

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
            s_t = flat[i].T
            with np.errstate(invalid="ignore"):
                cost = s_t.max(axis=1, keepdims=True) - s_t  # -S^T - min_row(-S^T), bit for bit (negation is exact)
                cost -= cost.min(axis=0, keepdims=True)
            cols, rows = linear_sum_assignment(cost)  # the solver's rows are S's columns
        else:
            rows, cols = linear_sum_assignment(-flat[i])
        out[i, rows] = flat[i, rows, cols]
    return torch.from_numpy(out.reshape(s.shape[:-1]))


def frobenius_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
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
