"""Solver variation of the paper variant's cosines: eigenvector signs *and* rotations inside eigenspaces a solver cannot
resolve.

A backward-stable symmetric eigensolver (Householder tridiagonalisation followed by QR,
divide-and-conquer or MRRR: LAPACK ``syev``/``syevd``/``syevr``/``syevx``, cuSOLVER) returns
the exact eigenpairs of a nearby matrix ``K + E`` with ``||E||_2 <= p(n) u ||K||_2``
(``u`` the unit roundoff of the dtype the solver works in, ``p(n)`` a modestly growing
function of the order ``n``; LAPACK Users' Guide, "Accuracy and stability", Section 4.7).
Building ``K`` itself in that dtype (the authors' float32 Gram matrix and its centering:
sums of ``n`` rounded terms per entry) adds an error of the same form. By the Davis-Kahan
``sin theta`` theorem an eigenvector whose eigenvalue is separated from the rest of the
spectrum by ``gap`` is then determined only up to an angle with ``sin theta <= ||E|| / gap``;
for ``gap <= ||E||`` it is not determined at all: any unit vector of the invariant subspace
of the eigenvalues within ``||E||`` of each other is a correct answer, and which one a
solver prints depends on its code path (driver, thread count, instruction set).

This module therefore models the admissible eigenbases as follows (docs/uncertainty.md):

* **tolerance** (:func:`resolution_tolerance`): ``tau = c n u ||K||_2`` with
  ``c`` = :data:`RESOLUTION_FACTOR`, ``n`` the matrix order and ``u`` the unit roundoff of
  the solver's dtype (``2**-24`` for the paper's float32);
* **groups** (:func:`eigen_groups`): the eigenvalues, sorted, chained wherever two
  neighbours are at most ``tau`` apart; a group with at least two members of which at least
  one is selected is *near-degenerate*. A group with selected and unselected members
  straddles the selection boundary (which ``k`` of its ``m`` vectors the top-``d`` selection
  takes is then also undetermined);
* **admissible set**: every selected eigenvector's sign, and inside each near-degenerate
  group any orthonormal basis of any ``k``-dimensional subspace of the group's span
  (``O(m)`` for a group inside the selection).

``V_KPCA = G A - G 1_N A`` is linear in ``A``, so a rotation ``Q`` of the columns of ``A``
inside a group rotates the same columns of ``V_KPCA``; rotations inside the selection leave
every token row norm of ``V_KPCA`` unchanged. With ``Vn``, ``V^n`` the row-normalised ``V``
and ``V_KPCA`` and ``M = Vn^T V^n / N``, the per-head token mean of the direct cosine is
``tr(M Q)`` for the block-diagonal orthogonal ``Q`` of the admissible set, and over
``Q_g in O(m_g)`` the contribution ``tr(M_g Q_g)`` of a group ranges exactly over
``[-||M_g||_*, ||M_g||_*]`` (nuclear norm, von Neumann's trace inequality, attained at the
orthogonal Procrustes solution). A pair is the one-dimensional case in the angle:
``tr(M_g R(theta)) = (M_11 + M_22) cos theta + (M_12 - M_21) sin theta`` with amplitude
``sqrt((M_11+M_22)^2 + (M_12-M_21)^2)`` for rotations and its reflection counterpart for
reflections, whose larger value is ``||M_g||_*`` (:func:`pair_direct_mean`, tested against a
dense angle search).

What is a bound and what is a draw (:func:`head_solver_draws`):

* Table 1's per-head token mean of the direct cosine: for every random sign pattern
  (signs of the vectors outside groups; the same patterns as the sign-only treatment) and
  every Haar-random subspace of each boundary-straddling group, the *exact* minimum and
  maximum over all rotations of the groups inside the selection (``direct_cos_mean_lower``,
  ``direct_cos_mean_upper``), and the same at the solver's own signs and subspaces
  (``direct_cos_mean_own_lower`` / ``_upper``);
* every other statistic (Table 4's token maximum, the matched cosines): draws, with random
  signs and Haar-random orthogonal matrices inside every group (:func:`haar_orthogonal`).

A head without a near-degenerate group gets exactly the sign-only treatment of
:func:`kpca_repro.method.uncertainty.head_sign_draws` (same patterns, same values).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from kpca_repro.method.equations import row_normalize, v_kpca
from kpca_repro.method.numerics import assignment_similarities
from kpca_repro.method.uncertainty import (
    COLLISION_BOUND,
    DIRECT_COS_MAX,
    DIRECT_COS_MEAN,
    DIRECT_COS_MEAN_LOWER,
    DIRECT_COS_MEAN_OWN_LOWER,
    DIRECT_COS_MEAN_OWN_UPPER,
    DIRECT_COS_MEAN_RANGE_LOWER,
    DIRECT_COS_MEAN_RANGE_UPPER,
    DIRECT_COS_MEAN_UPPER,
    MATCHED_BOUND,
    MEAN_VECTOR,
    OPTIMAL_COS_MAX,
    OPTIMAL_COS_MEAN,
    RANGE_NAMES,
    SIGN_DRAW_NAMES,
    direct_sign_statistics,
    head_generator,
    sign_patterns,
)
from kpca_repro.projection import ROW_NORM_EPS

__all__ = [
    "RESOLUTION_FACTOR",
    "ROTATION_DRAWS",
    "HEAD_COLUMNS",
    "unit_roundoff",
    "resolution_tolerance",
    "selected_indices",
    "eigen_groups",
    "relative_eigengap",
    "haar_orthogonal",
    "pair_direct_mean",
    "group_trace_bound",
    "SCREEN_FACTOR",
    "BOUND_MARGIN",
    "RunningFloor",
    "assignment_upper_bound",
    "assignment_collision_bound",
    "head_solver_draws",
    "prune_below_floor",
]

#: ``c`` of the tolerance ``c n u ||K||_2``: eigenvalue gaps at most this far apart are
#: treated as unresolved (docs/uncertainty.md, "Model of solver variation").
RESOLUTION_FACTOR = 1.0
#: Distinct sign-and-rotation draws per head with a near-degenerate group (the stored
#: ``n_direct`` columns repeat them; heads without groups keep all ``n_direct`` sign draws).
ROTATION_DRAWS = 32
#: Per-head record columns: smallest relative eigengap among the selected pairs and at the
#: selection boundary, number of near-degenerate groups, largest group, and whether a group
#: straddles the selection boundary.
HEAD_COLUMNS = ("eigengap_min", "solver_groups", "solver_group_max", "solver_boundary_group")


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2`` of a floating dtype (``2**-24`` for float32, ``2**-53`` for float64)."""
    return float(torch.finfo(dtype).eps) / 2.0


def resolution_tolerance(evals: np.ndarray, n: int, dtype: torch.dtype, factor: float = RESOLUTION_FACTOR) -> float:
    """``factor * n * u * ||K||_2``: the eigenvalue gap below which a backward-stable solver in ``dtype`` cannot resolve
    eigenvectors."""
    return float(factor * n * unit_roundoff(dtype) * np.max(np.abs(evals)))


def selected_indices(evals_asc: np.ndarray, d: int, order: str) -> np.ndarray:
    """Indices into the ascending spectrum of the ``d`` selected eigenpairs, in the order of the columns of ``A``.

    The rule of :func:`kpca_repro.method.equations.select_eigenpairs` applied to the eigenvalues:
    ``abs_desc`` (stable sort of ``|lambda|`` descending), ``desc``, ``asc_top``.
    """
    n = len(evals_asc)
    if order == "asc_top":
        return np.arange(n - d, n)
    key = np.abs(evals_asc) if order == "abs_desc" else evals_asc
    return np.argsort(-key, kind="stable")[:d]


def eigen_groups(evals_asc: np.ndarray, selected: np.ndarray, tol: float) -> list[np.ndarray]:
    """Near-degenerate groups: runs of the ascending spectrum with neighbour gaps ``<= tol`` that hold a selected
    eigenvalue.

    Returns:
        Index arrays (into the ascending spectrum), each with at least two members and at
        least one selected member.
    """
    is_sel = np.zeros(len(evals_asc), bool)
    is_sel[selected] = True
    out, start = [], 0
    gaps = np.diff(evals_asc)
    for i in range(len(evals_asc)):
        if i == len(evals_asc) - 1 or gaps[i] > tol:
            members = np.arange(start, i + 1)
            if len(members) > 1 and is_sel[members].any():
                out.append(members)
            start = i + 1
    return out


def relative_eigengap(evals_asc: np.ndarray, selected: np.ndarray) -> float:
    """Smallest gap ``|lambda_i - lambda_j| / ||K||_2`` between neighbours of the ascending spectrum of which at least
    one is selected.

    Covers the gaps among the selected pairs and at the selection boundary. NaN for a
    non-finite spectrum.
    """
    if not np.isfinite(evals_asc).all() or len(evals_asc) < 2:
        return float("nan")
    is_sel = np.zeros(len(evals_asc), bool)
    is_sel[selected] = True
    gaps = np.diff(evals_asc)
    touch = is_sel[:-1] | is_sel[1:]
    scale = np.max(np.abs(evals_asc))
    return float(gaps[touch].min() / scale) if touch.any() and scale > 0 else float("nan")


def haar_orthogonal(gen: np.random.Generator, m: int, size: int = 1, k: int | None = None) -> np.ndarray:
    """``size`` Haar-distributed ``m x m`` orthogonal matrices, or their first ``k`` columns (uniform on the Stiefel
    manifold).

    QR of a standard Gaussian ``m x k`` matrix with the columns multiplied by the signs of
    ``R``'s diagonal (Mezzadri 2007): the distribution is invariant under left
    multiplication by any orthogonal matrix. Shape ``(size, m, k)``.
    """
    z = gen.standard_normal((size, m, m if k is None else k))
    q, r = torch.linalg.qr(torch.from_numpy(z))  # torch's LAPACK: several times faster than NumPy's here
    sign = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    return (q * torch.where(sign == 0, 1.0, sign)[:, None, :]).numpy()


def pair_direct_mean(m: np.ndarray, theta: np.ndarray, reflect: bool = False) -> np.ndarray:
    """``tr(M Q(theta))`` of a pair: ``Q`` the rotation (or, ``reflect``, the reflection) by ``theta``.

    Rotation ``[[c, -s], [s, c]]``: ``(M11 + M22) c + (M12 - M21) s``; reflection
    ``[[c, s], [s, -c]]``: ``(M11 - M22) c + (M12 + M21) s``. The maximum over both is the
    nuclear norm of ``M`` (:func:`group_trace_bound`).
    """
    c, s = np.cos(theta), np.sin(theta)
    if reflect:
        return (m[0, 0] - m[1, 1]) * c + (m[0, 1] + m[1, 0]) * s
    return (m[0, 0] + m[1, 1]) * c + (m[0, 1] - m[1, 0]) * s


def group_trace_bound(m: np.ndarray) -> np.ndarray:
    """``max_{Q in O(m)} tr(M Q) = ||M||_*`` (sum of singular values), batched over leading axes; the minimum is its
    negative."""
    return torch.linalg.svdvals(torch.from_numpy(np.ascontiguousarray(m))).sum(-1).numpy()


def _group_bases(kc64: np.ndarray, a64: np.ndarray, sel: np.ndarray, groups: list[np.ndarray]) -> list[dict]:
    """Per group: the selected columns of ``A`` in it, and an orthonormal basis of its span (the solver's own columns
    first)."""
    col_of = {int(idx): c for c, idx in enumerate(sel)}
    need_extra = any(any(int(i) not in col_of for i in g) for g in groups)
    evecs = torch.linalg.eigh(torch.from_numpy(kc64))[1].numpy() if need_extra else None
    out = []
    for g in groups:
        cols = np.array([col_of[int(i)] for i in g if int(i) in col_of])
        extra_idx = [int(i) for i in g if int(i) not in col_of]
        basis = a64[:, cols]
        if extra_idx:
            x = evecs[:, extra_idx]
            x = x - basis @ (basis.T @ x)  # the solver's columns span part of the group: complete them
            q = torch.linalg.qr(torch.from_numpy(np.ascontiguousarray(x)))[0].numpy()
            basis = np.concatenate([basis, q], axis=1)
        out.append({"cols": cols, "basis": basis, "boundary": bool(extra_idx)})
    return out


def _configurations(
    a64: np.ndarray, signs: np.ndarray, groups: list[dict], gen: np.random.Generator | None
) -> np.ndarray:
    """``(R, N, d)`` eigenvector matrices: columns outside groups times ``signs``; every group
    rotated by a Haar draw (in its own basis, its first ``k`` columns), or kept as the solver's (``gen`` None)."""
    r = signs.shape[0]
    out = a64[None] * signs[:, None, :]
    for grp in groups:
        cols, basis = grp["cols"], grp["basis"]
        if gen is None:
            out[:, :, cols] = a64[None][:, :, cols]
            continue
        q = haar_orthogonal(gen, basis.shape[1], r, k=len(cols))
        out[:, :, cols] = basis @ q  # (N, m) @ (R, m, k): BLAS
    return out


def _rotated_rows(own: np.ndarray, signs: np.ndarray, groups: list[dict], gen: np.random.Generator) -> np.ndarray:
    """The row-normalised V_KPCA ``(R, N, d_v)`` of :func:`_configurations`' draws when no group straddles the selection
    boundary.

    A rotation ``Q`` of a group's columns of ``A`` inside the selection rotates the same columns
    of V_KPCA (Eq. 5 is linear in ``A``) and keeps every row's norm, so the solver's own
    normalised rows ``own`` ``(N, d_v)`` are transformed directly: columns outside groups
    times ``signs``, a group's columns times the same Haar draw :func:`_configurations` takes
    (the generator is consumed in the same order). No V_KPCA is rebuilt.
    """
    out = own[None] * signs[:, None, : own.shape[-1]]
    for grp in groups:
        cols = grp["cols"]
        q = haar_orthogonal(gen, grp["basis"].shape[1], signs.shape[0], k=len(cols))
        out[:, :, cols] = own[:, cols] @ q
    return out


def _bounded_direct_means(vn: np.ndarray, vkn: np.ndarray, groups: list[dict]) -> tuple[np.ndarray, ...]:
    """Token means of the direct cosine ``(R,)``, their exact bounds over rotations of the groups inside the
    selection (signs kept), and their exact bounds over those rotations *and* every sign outside groups.

    With ``p_c`` the token mean of column ``c``'s products, a sign flip of a column outside the
    groups contributes ``+-p_c`` and a group inside the selection ``[-||M_g||_*, ||M_g||_*]``;
    the columns of a group straddling the boundary stay as drawn (row norms change with them).
    """
    n = vn.shape[-2]
    p = vn[None] * vkn  # (R, N, d)
    per_col = p.mean(-2)  # (R, d)
    value = per_col.sum(-1)
    free, width = value.copy(), np.zeros_like(value)
    in_group = np.zeros(vkn.shape[-1], bool)
    for grp in groups:
        in_group[grp["cols"]] = True
        if grp["boundary"]:
            continue  # its subspace is drawn, not bounded
        cols = grp["cols"]
        m = vn[:, cols].T @ vkn[:, :, cols] / n  # (R, k, k)
        free -= np.trace(m, axis1=-2, axis2=-1)
        width += group_trace_bound(m)
    singles = per_col[:, ~in_group]
    full_free = free - singles.sum(-1)
    full_width = width + np.abs(singles).sum(-1)
    return value, free - width, free + width, full_free - full_width, full_free + full_width


#: Screen of :func:`head_solver_draws`: a head's float64 spectrum (``eigvalsh`` of its float32
#: Gram matrix) is computed only where a float32 gap touching the selection is within this
#: many tolerances; elsewhere no gap can be (float32 eigenvalues are within ``p(n) u ||K||``
#: of them, far below the margin), so the head has no group either way.
SCREEN_FACTOR = 2.0
#: Added to an assignment's upper bound before it is compared with the floor (float32
#: similarities, docs/uncertainty.md): far above their round-off, which is below 1e-5.
BOUND_MARGIN = 1e-4


class RunningFloor:
    """A value every replicate maximum of a table statistic reaches: the floor below which a draw cannot matter.

    Table 1's MOC is a maximum over heads; in every replicate each head takes its own value or
    one of its stored draws (docs/uncertainty.md), so every replicate's maximum is at least
    ``F = max_h min(own_h, draws_h)``. A draw whose value lies below ``F`` is never the maximum
    of any replicate. :func:`head_solver_draws` computes a matched-cosine draw only when an upper
    bound of it (:func:`assignment_upper_bound`) reaches the floor known so far, and offers the
    floor every head whose draws it computed in full. Worker threads share one instance.
    """

    def __init__(self) -> None:
        self._value = -np.inf
        self._lock = threading.Lock()

    @property
    def value(self) -> float:
        return self._value

    def offer(self, value: float) -> None:
        """Raise the floor to ``value`` if it is higher (NaN is ignored)."""
        if np.isfinite(value):
            with self._lock:
                self._value = max(self._value, float(value))


def assignment_upper_bound(sim: torch.Tensor, pairs: tuple | None = None) -> torch.Tensor:
    """Upper bound of ``max_pi mean_i S[i, pi(i)]`` for each matrix of ``sim`` ``(..., N, N)``: LP duality.

    For the maximum-weight assignment, any ``u_i + v_j >= S_ij`` gives
    ``sum_i S[i, pi(i)] <= sum u + sum v``. Row reduction (``u_i = max_j S_ij``) then column
    reduction (``v_j = max_i (S_ij - u_i) <= 0``) is such a pair, as is the same with rows and
    columns swapped; the smaller of the two totals, divided by ``N``. The first step of the
    Hungarian method; ``O(N^2)`` against the assignment's ``O(N^3)``. ``pairs``: the two dual
    pairs of :func:`dual_pairs` when already computed.

    Returns:
        Shape ``(...)``, in ``sim``'s dtype; NaN where ``sim`` has NaN.
    """
    n = sim.shape[-1]
    totals = [u.sum(-1) + v.sum(-1) for u, v in (pairs or dual_pairs(sim))]
    return torch.minimum(*totals) / n


def dual_pairs(sim: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The dual pairs of :func:`assignment_upper_bound` for ``sim`` ``(..., N, N)``: the row-then-column
    reduction of ``sim`` and of its transpose (:func:`_row_column_reduction`), each ``(u, v)`` of shape ``(..., N)``."""
    return _row_column_reduction(sim), _row_column_reduction(sim.transpose(-1, -2))


def _row_column_reduction(sim: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dual pair ``(u, v)`` of the row-then-column reduction of ``sim`` ``(..., N, N)``:
    ``u_i = max_j S_ij``, ``v_j = max_i (S_ij - u_i) <= 0``, so ``u_i + v_j >= S_ij``."""
    u = sim.amax(-1)
    return u, (sim - u[..., :, None]).amax(-2)


def _collision_lower_bound(cost: torch.Tensor, dim: int) -> torch.Tensor:
    """Lower bound of ``min_pi sum_i cost[i, pi(i)]`` for ``cost >= 0`` ``(..., N, N)``, from the lines along ``dim``.

    Each line (a row for ``dim=-1``, a column for ``dim=-2``) pays at least its smallest entry
    ``m1`` at its argmin and at least its second smallest ``m2`` anywhere else; of the lines
    whose argmin falls on the same place at most one gets it, so each such set pays at least
    ``sum m1 + sum (m2 - m1) - max (m2 - m1)``. Returns shape ``(...)``.

    The line minima and their places are found with numpy (several times faster than
    ``torch.min`` with indices on a CPU); a line whose minimum is tied has ``m2 = m1`` whichever
    place is taken, so its penalty is 0 in every group and the bound does not depend on the
    tie-break. The sums are torch's, as before.
    """
    c = cost.detach().cpu().numpy()
    arg = np.expand_dims(c.argmin(axis=dim), dim)
    m1 = np.take_along_axis(c, arg, axis=dim)
    rest = c.copy()
    np.put_along_axis(rest, arg, np.inf, axis=dim)
    m2 = rest.min(axis=dim, keepdims=True)
    m1_t, arg_t = torch.from_numpy(m1.squeeze(dim)), torch.from_numpy(arg.squeeze(dim))
    penalty = torch.from_numpy((m2 - m1).squeeze(dim))
    kept = torch.zeros_like(penalty).scatter_reduce_(-1, arg_t, penalty, "amax")  # penalties are >= 0
    return (m1_t.sum(-1) + penalty.sum(-1) - kept.sum(-1)).to(cost.device)


def _collision_side(sim: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``sum u + sum v`` of the dual pair ``(u, v)`` of ``sim`` (:func:`_row_column_reduction`) minus the reduced costs'
    collision bound."""
    u, v = pair
    reduced = u[..., :, None] + v[..., None, :] - sim  # >= 0: (u, v) is dual feasible
    return u.sum(-1) + v.sum(-1) - _collision_lower_bound(reduced, -1)


def assignment_collision_bound(sim: torch.Tensor, pairs: tuple | None = None) -> torch.Tensor:
    """A tighter upper bound of ``max_pi mean_i S[i, pi(i)]`` than :func:`assignment_upper_bound`, at several times its
    cost.

    With the dual pair ``(u, v)`` of the row-then-column reduction and the reduced costs
    ``C = u_i + v_j - S_ij >= 0``, every assignment satisfies
    ``sum_i S[i, pi(i)] = sum u + sum v - sum_i C[i, pi(i)]``, so any lower bound of the
    minimum-cost assignment of ``C`` lowers the duality bound. The one used: rows whose
    cheapest column is the same can take it only once, so all but one of them pay at least
    their second cheapest entry (:func:`_collision_lower_bound`). The same with rows and
    columns swapped; the smaller total, divided by ``N``. Never above
    :func:`assignment_upper_bound`. On 474 real DeiT-Tiny draws that the cheap bound could not
    prune it is 0.019 above the optimum on average against 0.029, and leaves 99 of them above
    the floor of 0.297 (18 lie above it) against 415.

    Args:
        sim: ``(..., N, N)`` float tensor.
        pairs: its :func:`dual_pairs` when already computed.

    Returns:
        Shape ``(...)``, in ``sim``'s dtype; NaN where ``sim`` has NaN.
    """
    n = sim.shape[-1]
    rows, cols = pairs or dual_pairs(sim)
    bound = torch.minimum(_collision_side(sim, rows), _collision_side(sim.transpose(-1, -2), cols)) / n
    return bound.masked_fill(rows[0].isnan().any(-1), float("nan"))  # a row maximum is NaN iff its row holds a NaN


def _degenerate_groups(
    kc: torch.Tensor, spectrum32: torch.Tensor | None, d: int, order: str, solver_dtype: torch.dtype, factor: float
) -> tuple[list[np.ndarray], np.ndarray | None, float, np.ndarray | None]:
    """``(groups, ascending float64 spectrum or None, eigengap_min, selected indices)`` of one head.

    The float64 spectrum of the float32 matrix is computed where the solver's own spectrum
    has a gap touching the selection within :data:`SCREEN_FACTOR` tolerances (groups and
    ``eigengap_min`` from it); elsewhere ``eigengap_min`` is read off the solver's spectrum
    and there is no group.
    """
    if spectrum32 is not None:
        ev32 = spectrum32.detach().to("cpu", torch.float64).numpy()
        if not np.isfinite(ev32).all():
            return [], None, float("nan"), None
        sel = selected_indices(ev32, d, order)
        tol = resolution_tolerance(ev32, len(ev32), solver_dtype, factor)
        gap = relative_eigengap(ev32, sel)
        if not np.isfinite(gap) or gap * np.max(np.abs(ev32)) > SCREEN_FACTOR * tol:
            return [], None, gap, sel
    kc64 = kc.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(kc64).all()):
        return [], None, float("nan"), None
    ev = torch.linalg.eigvalsh(kc64).numpy()
    sel = selected_indices(ev, d, order)
    tol = resolution_tolerance(ev, kc64.shape[-1], solver_dtype, factor)
    return eigen_groups(ev, sel, tol), ev, relative_eigengap(ev, sel), sel


@dataclass
class _ChunkDraws:
    """The state of one :func:`head_solver_draws` call: a chunk's rows on the CPU and the arrays its heads fill.

    Attributes:
        rows: :func:`kpca_repro.method.kpca.head_metrics`' ``rows`` as given (the float32
            ``v``, ``v_kpca`` for the bounds of :func:`assignment_upper_bound`).
        n_direct, n_optimal, token_max: as :func:`head_solver_draws`.
        vn, vkn: row-normalised ``V`` and ``V_KPCA``, ``(heads, N, d_v)`` float64.
        kc: centered Gram matrices ``(heads, N, N)``, the solver's dtype.
        a: selected eigenvectors in column order ``(heads, N, d)``, the solver's dtype.
        inv_g: the diagonal of ``G = diag(1/g)`` (Eq. 5), ``(heads, N)`` float64.
        out: name -> ``(heads, R)`` float64 draws and bounds (NaN until filled; float32 when returned).
        cols: :data:`HEAD_COLUMNS` -> ``(heads,)`` per-head record columns.
        matched: ``(head, normalised V_KPCA configurations (R, N, d_v) float64)`` awaiting the
            matched cosine (:func:`_matched_draws`).
        conf32: the sign-only heads' configurations in the rows' dtype, for the bounds.
    """

    rows: dict
    n_direct: int
    n_optimal: int
    token_max: bool
    vn: torch.Tensor
    vkn: torch.Tensor
    kc: torch.Tensor
    a: torch.Tensor
    inv_g: torch.Tensor
    out: dict[str, np.ndarray] = field(default_factory=dict)
    cols: dict[str, np.ndarray] = field(default_factory=dict)
    matched: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    conf32: dict[int, torch.Tensor] = field(default_factory=dict)


def _start_chunk(rows: dict, *, n_direct: int, n_optimal: int, token_max: bool, bounded: bool) -> _ChunkDraws:
    """The chunk's rows copied to the CPU (``V``, ``V_KPCA``, ``1/g`` as float64) and its arrays, NaN-filled.

    ``out``: :data:`kpca_repro.method.uncertainty.SIGN_DRAW_NAMES` (``(heads, n_optimal)`` for the matched
    cosine, ``(heads, n_direct)`` for the direct one, ``direct_cos_max`` ``(heads, 0)`` without
    ``token_max``), :data:`~kpca_repro.method.uncertainty.MEAN_VECTOR` (the solver's own per-column token
    means ``(heads, d_v)``), :data:`~kpca_repro.method.uncertainty.BOUND_NAMES`,
    :data:`~kpca_repro.method.uncertainty.RANGE_NAMES` and, ``bounded``,
    :data:`~kpca_repro.method.uncertainty.MATCHED_BOUND`. ``cols``: no group (0 groups, largest group 1, no boundary
    group).
    """
    st = _ChunkDraws(
        rows=rows,
        n_direct=n_direct,
        n_optimal=n_optimal,
        token_max=token_max,
        vn=rows["v"].detach().to("cpu", torch.float64),
        vkn=rows["v_kpca"].detach().to("cpu", torch.float64),
        kc=rows["kc"].detach().cpu(),
        a=rows["a"].detach().cpu(),
        inv_g=rows["inv_g"].detach().to("cpu", torch.float64),
    )
    h = st.vn.shape[0]
    widths = {
        DIRECT_COS_MEAN: n_direct,
        DIRECT_COS_MAX: n_direct if token_max else 0,
        OPTIMAL_COS_MEAN: n_optimal,
        OPTIMAL_COS_MAX: n_optimal,
    }
    st.out = {name: np.full((h, widths[name]), np.nan) for name in SIGN_DRAW_NAMES}
    st.out[MEAN_VECTOR] = (st.vn * st.vkn).mean(-2).numpy()
    st.out[DIRECT_COS_MEAN_LOWER] = np.full((h, n_direct), np.nan)
    st.out[DIRECT_COS_MEAN_UPPER] = np.full((h, n_direct), np.nan)
    st.out[DIRECT_COS_MEAN_OWN_LOWER] = np.full((h, 1), np.nan)
    st.out[DIRECT_COS_MEAN_OWN_UPPER] = np.full((h, 1), np.nan)
    for name in RANGE_NAMES:
        st.out[name] = np.full((h, 1), np.nan)
    if bounded:
        st.out[MATCHED_BOUND] = np.full((h, n_optimal), np.nan)
        st.out[COLLISION_BOUND] = np.full((h, n_optimal), np.nan)
    st.cols = {name: np.full(h, np.nan) for name in HEAD_COLUMNS}
    st.cols["solver_groups"] = np.zeros(h)
    st.cols["solver_group_max"] = np.ones(h)
    st.cols["solver_boundary_group"] = np.zeros(h, bool)
    return st


def _sign_only_head(
    st: _ChunkDraws, i: int, own: float, s_direct: np.ndarray, s_opt: np.ndarray, bounded: bool
) -> None:
    """Head ``i`` without a near-degenerate group: the sign treatment of :mod:`kpca_repro.method.uncertainty`, the same
    numbers.

    ``s_direct`` ``(n_direct, d_v)``, ``s_opt`` ``(n_optimal, d_v)``: float64 sign patterns.
    The direct cosine's draws in closed form (:func:`~kpca_repro.method.uncertainty.direct_sign_statistics`);
    its bounds collapse to the draws (no rotation to bound), the own bounds to ``own``, and its
    range over every sign to ``+-sum_c |p_c|`` (``p_c`` the own per-column token means). The
    matched draws' sign-flipped ``V_KPCA`` rows are queued on ``st.matched`` (and, ``bounded``,
    their float32 copies on ``st.conf32``).
    """
    out, vn, vkn = st.out, st.vn[i], st.vkn[i]
    t = direct_sign_statistics(vn[None], vkn[None], torch.from_numpy(s_direct)[None], token_max=st.token_max)
    out[DIRECT_COS_MEAN][i] = t[DIRECT_COS_MEAN][0].numpy()
    out[DIRECT_COS_MEAN_LOWER][i] = out[DIRECT_COS_MEAN_UPPER][i] = out[DIRECT_COS_MEAN][i]
    out[DIRECT_COS_MEAN_OWN_LOWER][i] = out[DIRECT_COS_MEAN_OWN_UPPER][i] = own
    m_abs = float(np.abs(out[MEAN_VECTOR][i]).sum())
    out[DIRECT_COS_MEAN_RANGE_LOWER][i], out[DIRECT_COS_MEAN_RANGE_UPPER][i] = -m_abs, m_abs
    if st.token_max:
        out[DIRECT_COS_MAX][i] = t[DIRECT_COS_MAX][0].numpy()
    if st.n_optimal:
        st.matched.append((i, vkn[None] * torch.from_numpy(s_opt)[:, None, :]))
        if bounded:  # bounds from the float32 rows: no float64 product for a pruned draw
            v_kpca32 = st.rows["v_kpca"]
            st.conf32[i] = v_kpca32[i].detach().cpu()[None] * torch.from_numpy(s_opt).to(v_kpca32.dtype)[:, None, :]


def _normalised_v_kpca(conf: np.ndarray, inv_g: torch.Tensor, dv: int) -> np.ndarray:
    """Row-normalised ``V_KPCA = G A - G 1_N A`` (Eq. 5, corrected form) of eigenvector matrices ``conf`` ``(R, N, d)``
    float64.

    ``inv_g`` ``(N,)`` float64 is the diagonal of ``G``; columns are zero-padded to ``d_v``
    where ``d < d_v``; rows normalised with :data:`kpca_repro.projection.ROW_NORM_EPS`.
    Returns ``(R, N, d_v)`` float64.
    """
    vk = v_kpca(torch.from_numpy(conf), inv_g[None].expand(conf.shape[0], -1), paper=False)
    if vk.shape[-1] < dv:
        vk = torch.nn.functional.pad(vk, (0, dv - vk.shape[-1]))
    return row_normalize(vk, ROW_NORM_EPS).numpy()


def _rotated_head(
    st: _ChunkDraws,
    i: int,
    key: tuple,
    own: float,
    sel: np.ndarray,
    groups: list[np.ndarray],
    s_direct: np.ndarray,
    s_opt: np.ndarray,
) -> None:
    """Head ``i`` with near-degenerate ``groups``: signs and Haar rotations inside the groups (module docstring).

    The first ``min(n_direct, ROTATION_DRAWS)`` direct patterns with Haar draws of stream 2
    (repeated to ``n_direct`` columns), their exact bounds over rotations inside the selection
    (:func:`_bounded_direct_means`); the bounds at the solver's own configuration
    (:func:`_own_bounds`); the matched draws' configurations (stream 3) queued on
    ``st.matched``. Rotations inside the selection transform the solver's own normalised rows
    (:func:`_rotated_rows`); a group straddling the boundary rebuilds ``V_KPCA``.
    """
    gens = {stream: head_generator(*key, stream) for stream in (2, 3)}
    kc = st.kc[i].double().numpy()
    a64 = st.a[i].double().numpy()
    bases = _group_bases(kc, a64, sel, groups)
    st.cols["solver_groups"][i] = len(groups)
    st.cols["solver_group_max"][i] = max(len(g) for g in groups)
    st.cols["solver_boundary_group"][i] = any(b["boundary"] for b in bases)
    d, dv = a64.shape[-1], st.vn.shape[-1]
    n_rot = min(st.n_direct, ROTATION_DRAWS)
    reps = np.arange(st.n_direct) % max(n_rot, 1)
    own_conf = _normalised_v_kpca(a64[None].copy(), st.inv_g[i], dv)
    interior = not st.cols["solver_boundary_group"][i]
    if interior:  # rotations inside the selection keep the row norms: no V_KPCA to rebuild
        vkn_r = _rotated_rows(own_conf[0], s_direct[:n_rot], bases, gens[2])
    else:
        vkn_r = _normalised_v_kpca(_configurations(a64, s_direct[:n_rot, :d], bases, gens[2]), st.inv_g[i], dv)
    vn = st.vn[i].numpy()
    value, lo, hi, full_lo, full_hi = _bounded_direct_means(vn, vkn_r, bases)
    st.out[DIRECT_COS_MEAN][i], st.out[DIRECT_COS_MEAN_LOWER][i], st.out[DIRECT_COS_MEAN_UPPER][i] = (
        value[reps],
        lo[reps],
        hi[reps],
    )
    if st.token_max:
        st.out[DIRECT_COS_MAX][i] = (vn[None] * vkn_r).sum(-1).max(-1)[reps]
    _own_bounds(st, i, own, vn, own_conf, bases, full_lo, full_hi)
    if st.n_optimal:
        if interior:
            conf = _rotated_rows(own_conf[0], s_opt, bases, gens[3])
        else:
            conf = _normalised_v_kpca(_configurations(a64, s_opt[:, :d], bases, gens[3]), st.inv_g[i], dv)
        st.matched.append((i, torch.from_numpy(conf)))


def _own_bounds(
    st: _ChunkDraws,
    i: int,
    own: float,
    vn: np.ndarray,
    own_conf: np.ndarray,
    bases: list[dict],
    full_lo: np.ndarray,
    full_hi: np.ndarray,
) -> None:
    """Head ``i``'s bounds at the solver's own signs and subspaces, and its range over every draw.

    ``own`` is the point estimate (the rows' float32 ``V_KPCA``); ``own_conf`` ``(1, N, d_v)``
    float64 its rebuild from ``A``, whose bounds over the interior groups
    (:func:`_bounded_direct_means`) are widened by the difference ``delta`` of the two, so the
    interval holds the point estimate. ``full_lo``, ``full_hi`` ``(R,)``: the draws' bounds over
    every sign and rotation (:data:`~kpca_repro.method.uncertainty.RANGE_NAMES` is their hull with the own
    configuration's).
    """
    _, olo, ohi, ofull_lo, ofull_hi = _bounded_direct_means(vn, own_conf, bases)
    delta = own - float((vn * own_conf[0]).sum(-1).mean())  # float32 point estimate vs float64 rebuild
    st.out[DIRECT_COS_MEAN_OWN_LOWER][i], st.out[DIRECT_COS_MEAN_OWN_UPPER][i] = (
        olo[0] + min(delta, 0.0),
        ohi[0] + max(delta, 0.0),
    )
    st.out[DIRECT_COS_MEAN_RANGE_LOWER][i] = min(float(full_lo.min()), float(ofull_lo[0]) + min(delta, 0.0))
    st.out[DIRECT_COS_MEAN_RANGE_UPPER][i] = max(float(full_hi.max()), float(ofull_hi[0]) + max(delta, 0.0))


def _matched_draws(
    st: _ChunkDraws,
    valid: torch.Tensor | None,
    nan_to_zero: bool,
    own_optimal: np.ndarray | None,
    floor: RunningFloor | None,
) -> None:
    """The matched (Hungarian) cosine of every configuration on ``st.matched`` (Table 1's MOC, Table 4).

    ``sim = Vn C^T`` ``(R, N, N)`` float64 per head, assigned by
    :func:`kpca_repro.method.numerics.assignment_similarities`; ``optimal_cos_mean`` /
    ``_max`` are the token mean and maximum of the matched similarities. With ``floor``
    (and ``own_optimal`` ``(heads,)``): heads with the largest own values first; a draw
    whose float32 upper bound (:func:`assignment_upper_bound`, then where that reaches the
    floor :func:`assignment_collision_bound`, each + :data:`BOUND_MARGIN`) lies below the
    floor stays NaN, and a head computed in full offers ``min(own, draws)`` to it
    (:class:`RunningFloor`).
    """
    n_optimal = st.n_optimal
    if floor is not None and own_optimal is not None:  # the heads most likely to set the floor first
        key_of = {i: -own_optimal[i] if np.isfinite(own_optimal[i]) else np.inf for i, _ in st.matched}
        st.matched.sort(key=lambda item: key_of[item[0]])
    for i, conf in st.matched:
        vn = st.vn[i]
        ok = None if valid is None else valid[i : i + 1].expand(n_optimal)
        todo = np.ones(n_optimal, bool)
        if floor is not None:
            vn32 = st.rows["v"][i].detach().cpu().float()
            c32 = st.conf32.get(i)
            c32 = conf.float() if c32 is None else c32.float()
            sim32 = vn32[None] @ c32.transpose(-1, -2)
            pairs = dual_pairs(sim32)
            bound = assignment_upper_bound(sim32, pairs).double().numpy() + BOUND_MARGIN
            st.out[MATCHED_BOUND][i] = bound
            at = floor.value
            todo = ~(bound < at)  # NaN bounds (a dropped head) are computed: their draws are NaN anyway
            if todo.any():  # the tighter bound only where the cheap one reaches the floor
                tight = np.full(n_optimal, np.nan)
                pick = torch.from_numpy(todo)
                tight[todo] = (
                    assignment_collision_bound(sim32[pick], tuple((u[pick], v[pick]) for u, v in pairs))
                    .double()
                    .numpy()
                    + BOUND_MARGIN
                )
                st.out[COLLISION_BOUND][i] = tight
                todo &= ~(tight < at)
        if todo.any():
            sim = vn[None] @ conf[torch.from_numpy(todo)].transpose(-1, -2)
            matched = assignment_similarities(
                sim, None if ok is None else ok[: int(todo.sum())], nan_to_zero=nan_to_zero
            )
            st.out[OPTIMAL_COS_MEAN][i, todo], st.out[OPTIMAL_COS_MAX][i, todo] = (
                matched.mean(-1).numpy(),
                matched.amax(-1).numpy(),
            )
        if floor is not None and own_optimal is not None and todo.all():
            floor.offer(float(np.min([own_optimal[i], *st.out[OPTIMAL_COS_MEAN][i]])))


def head_solver_draws(
    rows: dict,
    ids: dict[str, np.ndarray],
    *,
    seed: int,
    n_direct: int,
    n_optimal: int,
    token_max: bool,
    order: str,
    valid: torch.Tensor | None = None,
    nan_to_zero: bool = False,
    factor: float = RESOLUTION_FACTOR,
    own_optimal: np.ndarray | None = None,
    floor: RunningFloor | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Solver-variation draws and bounds of a chunk of heads (signs and rotations inside near-degenerate groups).

    Args:
        rows: :func:`kpca_repro.method.kpca.head_metrics`' ``rows``: ``v``, ``v_kpca`` (row-normalised),
            ``kc`` (centered Gram matrices, the solver's dtype), ``a`` (selected
            eigenvectors in column order), ``inv_g`` (the diagonal of ``G``) and, when
            present, ``spectrum`` (every eigenvalue the solver returned: the screen of
            :data:`SCREEN_FACTOR`).
        ids, seed, n_direct, n_optimal, token_max, valid, nan_to_zero: as
            :func:`kpca_repro.method.uncertainty.head_sign_draws` (the same sign patterns: stream 0
            direct, 1 matched; Haar rotations: streams 2 and 3).
        order: the eigenpair order of the selection (``abs_desc``, ``desc``, ``asc_top``).
        factor: ``c`` of :func:`resolution_tolerance`.
        own_optimal, floor: for a table statistic that is a maximum over heads of the token-mean
            matched cosine (Table 1's MOC): the heads' own values ``(heads,)`` and the
            :class:`RunningFloor` shared by the job. A matched-cosine draw is then computed only
            where :func:`assignment_upper_bound` (+ :data:`BOUND_MARGIN`) reaches the floor,
            heads with the largest own values first; the others stay NaN (they can be no
            replicate's maximum). Without ``floor`` every draw is computed (Table 4: means).

    Returns:
        ``(draws, columns)``: ``draws`` as :func:`kpca_repro.method.uncertainty.head_sign_draws` plus
        :data:`~kpca_repro.method.uncertainty.BOUND_NAMES` (``(heads, n_direct)`` and ``(heads, 1)``, float32) and, with
        ``floor``, ``optimal_cos_mean_bound`` (``(heads, n_optimal)``: each draw's upper
        bound); ``columns``: :data:`HEAD_COLUMNS` -> ``(heads,)`` arrays for the per-head records.

    Steps: :func:`_start_chunk`; per head its sign patterns (streams 0, 1), its groups
    (:func:`_degenerate_groups`) and either :func:`_sign_only_head` or :func:`_rotated_head`; then
    :func:`_matched_draws` over the queued configurations.
    """
    st = _start_chunk(rows, n_direct=n_direct, n_optimal=n_optimal, token_max=token_max, bounded=floor is not None)
    spectra = rows.get("spectrum")
    h, _, dv = st.vn.shape
    ident = {k: np.broadcast_to(np.asarray(ids[k]), (h,)) for k in ("layer", "sample_rank", "dataset_index", "head")}
    for i in range(h):
        key = (seed, ident["layer"][i], ident["sample_rank"][i], ident["dataset_index"][i], ident["head"][i])
        s_direct = sign_patterns(head_generator(*key, 0), n_direct, dv)
        s_opt = sign_patterns(head_generator(*key, 1), n_optimal, dv) if n_optimal else np.empty((0, dv))
        own = float((st.vn[i] * st.vkn[i]).mean(-2).sum())
        groups, _, gap, sel = _degenerate_groups(
            st.kc[i], None if spectra is None else spectra[i], st.a.shape[-1], order, st.kc.dtype, factor
        )
        st.cols["eigengap_min"][i] = gap
        if groups:
            _rotated_head(st, i, key, own, sel, groups, s_direct, s_opt)
        else:
            _sign_only_head(st, i, own, s_direct, s_opt, bounded=floor is not None)
    _matched_draws(st, valid, nan_to_zero, own_optimal, floor)
    draws = {k: np.asarray(x, dtype=np.float32) for k, x in st.out.items()}
    return draws, st.cols


def prune_below_floor(draws: dict[str, np.ndarray], floor: float) -> dict[str, np.ndarray]:
    """The matched-cosine draws whose upper bound lies below ``floor`` set to NaN (in place; returned).

    After every chunk of a job: the final floor of :class:`RunningFloor` decides which draws a
    table maximum can use, so the stored draws are the same whatever order the worker
    threads computed them in. A draw's bound is its :data:`~kpca_repro.method.uncertainty.COLLISION_BOUND` where its
    :data:`~kpca_repro.method.uncertainty.MATCHED_BOUND` reaches ``floor`` (there the tighter bound was always computed,
    because the floor only rises), its :data:`~kpca_repro.method.uncertainty.MATCHED_BOUND` elsewhere; every draw whose
    bound reaches ``floor`` was computed. :data:`~kpca_repro.method.uncertainty.MATCHED_BOUND` becomes that bound and
    :data:`~kpca_repro.method.uncertainty.COLLISION_BOUND` is removed.
    """
    tight = draws.pop(COLLISION_BOUND, None)
    if MATCHED_BOUND in draws and np.isfinite(floor):
        if tight is not None:
            reach = draws[MATCHED_BOUND] >= floor
            draws[MATCHED_BOUND] = np.where(reach, tight, draws[MATCHED_BOUND]).astype(draws[MATCHED_BOUND].dtype)
        below = draws[MATCHED_BOUND] < floor
        for name in (OPTIMAL_COS_MEAN, OPTIMAL_COS_MAX):
            draws[name][below] = np.nan
    return draws
