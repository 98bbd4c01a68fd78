"""Uncertainty of the reproduced numbers: eigenvector signs and the sample of images or sentences.

Two sources of variation are measured (docs/uncertainty.md):

**Eigenvector signs.** An eigensolver may return ``-a`` for any eigenvector ``a``; which sign
it returns depends on the library, its code path and the thread count. Flipping eigenvector
``c`` flips column ``c`` of ``V_KPCA`` (Eq. 5 is linear in each column of ``A``) and leaves
every row norm unchanged, so with ``Vn``, ``V^n`` the row-normalised ``V`` and ``V_KPCA`` and
``P_ic = Vn_ic V^n_ic`` (shape ``(N, d)``), a sign pattern ``sigma`` in ``{-1, +1}^d`` gives

* direct cosine of token ``i``: ``(P sigma)_i``;
* per-head token mean (Table 1's MDC input): ``m . sigma`` with ``m_c = mean_i P_ic``;
* per-head token maximum (Table 4's MDC input): ``max_i (P sigma)_i``;
* matched (optimal) cosines: a new assignment on ``S(sigma) = Vn diag(sigma) V^n^T``.

:func:`head_sign_draws` evaluates these for seeded random sign patterns, each head with its
own generator (:func:`head_generator`, from the configuration seed and the head's identity,
so sharding and chunking change nothing). The closed forms are cheap (many draws); every
matched-cosine draw costs one assignment (few draws).

**Sampling.** :func:`group_aggregate` and :func:`replicate_statistics` implement a
percentile bootstrap over the images (sentences) behind a table row: per-image aggregates
first, then one resample of the images per replicate. When sign draws are given, every
replicate also draws one stored sign-draw value per head, independently across heads, so
the interval combines both sources.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch and the KPCA module load only where sign draws are computed,
    import torch  # so the table scripts import this module without them

__all__ = [
    "SIGN_DRAW_NAMES",
    "DIRECT_COS_MEAN",
    "DIRECT_COS_MAX",
    "OPTIMAL_COS_MEAN",
    "OPTIMAL_COS_MAX",
    "MEAN_VECTOR",
    "BOUND_NAMES",
    "DIRECT_COS_MEAN_LOWER",
    "DIRECT_COS_MEAN_UPPER",
    "DIRECT_COS_MEAN_OWN_LOWER",
    "DIRECT_COS_MEAN_OWN_UPPER",
    "RANGE_NAMES",
    "DIRECT_COS_MEAN_RANGE_LOWER",
    "DIRECT_COS_MEAN_RANGE_UPPER",
    "MATCHED_BOUND",
    "COLLISION_BOUND",
    "fresh_direct_means",
    "head_generator",
    "sign_patterns",
    "direct_sign_statistics",
    "optimal_sign_statistics",
    "head_sign_draws",
    "write_sign_draws",
    "read_sign_draws",
    "stable_seed",
    "percentile_interval",
    "group_codes",
    "group_aggregate",
    "bootstrap_indices",
    "pick_draws",
    "predictive_draws",
    "replicate_statistics",
]

# The names of the per-head arrays of a sign-draws file (the one table of them, each name typed here
# only, tests/test_uncertainty.py; written by the kpca_heads job, read by the tables). Each tuple is
# also unpacked into one constant per name, the name in capitals.
#: Sign draws: direct/optimal cosine, token mean (Table 1) / token max (Table 4).
SIGN_DRAW_NAMES = ("direct_cos_mean", "direct_cos_max", "optimal_cos_mean", "optimal_cos_max")
DIRECT_COS_MEAN, DIRECT_COS_MAX, OPTIMAL_COS_MEAN, OPTIMAL_COS_MAX = SIGN_DRAW_NAMES
#: Per-head ``m = mean_i P_i`` ``(heads, d)``: the direct token mean under signs ``sigma`` is
#: ``m . sigma``, so the tables draw fresh patterns from it (exact, no stored-draw tails).
MEAN_VECTOR = "direct_cos_mean_vector"
#: Exact bounds of the token-mean direct cosine over rotations inside near-degenerate
#: eigenspaces, per draw and at the solver's own signs and subspaces
#: (:func:`kpca_repro.method.solver_variation.head_solver_draws`; optional when read).
BOUND_NAMES = (
    "direct_cos_mean_lower",
    "direct_cos_mean_upper",
    "direct_cos_mean_own_lower",
    "direct_cos_mean_own_upper",
)
DIRECT_COS_MEAN_LOWER, DIRECT_COS_MEAN_UPPER, DIRECT_COS_MEAN_OWN_LOWER, DIRECT_COS_MEAN_OWN_UPPER = BOUND_NAMES
#: Exact range of the token-mean direct cosine over every sign and every rotation inside groups
#: within the selection (for a group straddling the selection boundary: over its drawn
#: subspaces and the solver's own); optional when read.
RANGE_NAMES = ("direct_cos_mean_range_lower", "direct_cos_mean_range_upper")
DIRECT_COS_MEAN_RANGE_LOWER, DIRECT_COS_MEAN_RANGE_UPPER = RANGE_NAMES
#: Upper bounds of the matched-cosine draws, written where a table maximum pruned them (Table 1):
#: the collision bound where the cheap bound reaches the job's final floor, the cheap bound
#: elsewhere (:func:`kpca_repro.method.solver_variation.prune_below_floor`). A NaN draw has a
#: bound below the floor.
MATCHED_BOUND = "optimal_cos_mean_bound"
#: The chunks' collision bound of each matched draw where it was computed (NaN elsewhere); never
#: written: :func:`kpca_repro.method.solver_variation.prune_below_floor` folds it into :data:`MATCHED_BOUND`.
COLLISION_BOUND = "optimal_cos_mean_collision_bound"


def head_generator(
    seed: int, layer: int, sample_rank: int, dataset_index: int, head: int, stream: int
) -> np.random.Generator:
    """The random generator of one head's sign draws.

    Seeded by ``SeedSequence([seed, layer, sample_rank, dataset_index + 1, head, stream])``:
    every quantity identifies the head whatever file, shard or chunk it is read from
    (``dataset_index`` is -1 for Longformer's transposed reading, hence the ``+ 1``).
    ``stream`` separates the closed-form draws (0) from the assignment draws (1), so that
    changing one number of draws leaves the other draws unchanged.

    Raises:
        ValueError: a negative identifier.
    """
    key = [int(seed), int(layer), int(sample_rank), int(dataset_index) + 1, int(head), int(stream)]
    if min(key) < 0:
        raise ValueError(f"head identifiers must be >= 0 (dataset_index >= -1), got {key}")
    return np.random.default_rng(np.random.SeedSequence(key))


def sign_patterns(gen: np.random.Generator, n_draws: int, d: int) -> np.ndarray:
    """``n_draws`` independent uniform sign patterns, shape ``(n_draws, d)``, float64 in {-1, +1}."""
    return gen.integers(0, 2, size=(n_draws, d), dtype=np.int8).astype(np.float64) * 2.0 - 1.0


def direct_sign_statistics(
    vn: torch.Tensor, vkn: torch.Tensor, signs: torch.Tensor, token_max: bool = True
) -> dict[str, torch.Tensor]:
    """Direct token-row cosine statistics of one or more heads under given sign patterns (closed form).

    Args:
        vn, vkn: row-normalised ``V`` and ``V_KPCA``, shape ``(heads, N, d)``.
        signs: sign patterns, shape ``(heads, R, d)`` (entries +-1), same dtype as ``vn``.
        token_max: also compute the maximum over tokens (``N x d x R`` work per head).

    Returns:
        ``direct_cos_mean`` = ``m . sigma`` and, if ``token_max``, ``direct_cos_max`` =
        ``max_i (P sigma)_i``; each of shape ``(heads, R)``. NaN where ``P`` has NaN.
    """
    import torch

    p = vn * vkn  # (H, N, d)
    out = {DIRECT_COS_MEAN: torch.einsum("hd,hrd->hr", p.mean(-2), signs)}
    if token_max:
        out[DIRECT_COS_MAX] = (
            torch.stack([(p[h] @ signs[h].T).amax(0) for h in range(p.shape[0])])
            if p.shape[0]
            else p.new_empty((0, signs.shape[1]))
        )
    return out


def optimal_sign_statistics(
    vn: torch.Tensor,
    vkn: torch.Tensor,
    signs: torch.Tensor,
    valid: torch.Tensor | None = None,
    nan_to_zero: bool = False,
) -> dict[str, torch.Tensor]:
    """Matched (optimal-assignment) token-row cosine statistics under given sign patterns.

    One :func:`kpca_repro.method.numerics.assignment_similarities` call per pattern, on
    ``S = Vn (V^n diag(sigma))^T``, with the same ``valid`` / ``nan_to_zero`` handling as
    :func:`kpca_repro.method.kpca.head_metrics`.

    Args:
        vn, vkn: shape ``(heads, N, d)``.
        signs: shape ``(heads, R, d)``.
        valid: bool ``(heads,)``; invalid heads get NaN.
        nan_to_zero: NaN similarities set to 0 before matching (language-model reference).

    Returns:
        ``optimal_cos_mean`` and ``optimal_cos_max`` (mean and max over tokens), each
        ``(heads, R)`` float64 on the CPU.
    """
    import torch

    from kpca_repro.method.numerics import assignment_similarities

    means, maxes = [], []
    for r in range(signs.shape[1]):
        sim = vn @ (vkn * signs[:, r, None, :]).transpose(-1, -2)
        matched = assignment_similarities(sim, valid, nan_to_zero=nan_to_zero)
        means.append(matched.mean(-1))
        maxes.append(matched.amax(-1))
    h = vn.shape[0]
    empty = torch.empty((h, 0), dtype=torch.float64)
    return {
        OPTIMAL_COS_MEAN: torch.stack(means, -1) if means else empty,
        OPTIMAL_COS_MAX: torch.stack(maxes, -1) if maxes else empty,
    }


def head_sign_draws(
    vn: torch.Tensor,
    vkn: torch.Tensor,
    ids: dict[str, np.ndarray],
    *,
    seed: int,
    n_direct: int,
    n_optimal: int,
    token_max: bool,
    valid: torch.Tensor | None = None,
    nan_to_zero: bool = False,
) -> dict[str, np.ndarray]:
    """Seeded random-sign draws of the direct and optimal cosine statistics, per head.

    Args:
        vn, vkn: row-normalised ``V`` and ``V_KPCA`` of a chunk of heads, ``(heads, N, d)``
            (any float dtype; computed in float64 on the CPU).
        ids: ``layer``, ``sample_rank``, ``dataset_index``, ``head``: int arrays ``(heads,)``
            (or scalars) identifying each head (:func:`head_generator`).
        seed: the configuration seed.
        n_direct: sign patterns for the closed-form direct statistics (stream 0).
        n_optimal: sign patterns for the matched statistics (stream 1; one assignment each).
        token_max: also compute ``direct_cos_max`` (the Table 4 statistic).
        valid, nan_to_zero: as :func:`optimal_sign_statistics`.

    Returns:
        Name in :data:`SIGN_DRAW_NAMES` -> float32 array ``(heads, n_direct)`` or
        ``(heads, n_optimal)``; ``direct_cos_max`` is ``(heads, 0)`` without ``token_max``;
        and :data:`MEAN_VECTOR` -> ``m`` ``(heads, d)`` float32.
    """
    import torch

    vn64, vkn64 = vn.detach().to("cpu", torch.float64), vkn.detach().to("cpu", torch.float64)
    h, _, d = vn64.shape
    ident = {k: np.broadcast_to(np.asarray(ids[k]), (h,)) for k in ("layer", "sample_rank", "dataset_index", "head")}

    def patterns(n, stream):
        return torch.from_numpy(
            np.stack(
                [
                    sign_patterns(
                        head_generator(
                            seed,
                            ident["layer"][i],
                            ident["sample_rank"][i],
                            ident["dataset_index"][i],
                            ident["head"][i],
                            stream,
                        ),
                        n,
                        d,
                    )
                    for i in range(h)
                ]
            ).reshape(h, n, d)
        )

    direct = direct_sign_statistics(vn64, vkn64, patterns(n_direct, 0), token_max=token_max)
    if not token_max:
        direct[DIRECT_COS_MAX] = torch.empty((h, 0), dtype=torch.float64)
    optimal = optimal_sign_statistics(vn64, vkn64, patterns(n_optimal, 1), valid, nan_to_zero)
    out = {name: t.numpy().astype(np.float32) for name, t in {**direct, **optimal}.items()}
    out[MEAN_VECTOR] = (vn64 * vkn64).mean(-2).numpy().astype(np.float32)
    return out


def write_sign_draws(path: str | os.PathLike, draws: dict[str, np.ndarray], attrs: dict) -> None:
    """Write per-head sign draws as HDF5 (one float32 dataset per statistic, rows = records rows).

    Written without timestamps, so identical runs give identical files. ``attrs`` (numbers
    and strings) are stored as file attributes.
    """
    import h5py

    with h5py.File(path, "w", track_order=False) as f:
        for name in (
            *SIGN_DRAW_NAMES,
            MEAN_VECTOR,
            *(n for n in (*BOUND_NAMES, *RANGE_NAMES, MATCHED_BOUND) if n in draws),
        ):
            f.create_dataset(name, data=np.asarray(draws[name], dtype=np.float32), track_times=False)
        for key, value in attrs.items():
            f.attrs[key] = value


def read_sign_draws(paths: list[str | os.PathLike]) -> dict[str, np.ndarray]:
    """Concatenate the sign draws of several records files, in the given order.

    Returns:
        Name -> float32 array ``(total heads, R)``; :data:`MEAN_VECTOR` zero-padded to the
        largest head dimension.

    Raises:
        ValueError: the files hold different numbers of draws.
    """
    import h5py

    parts: dict[str, list[np.ndarray]] = {
        name: [] for name in (*SIGN_DRAW_NAMES, MEAN_VECTOR, *BOUND_NAMES, *RANGE_NAMES)
    }
    for p in paths:
        with h5py.File(p, "r") as f:
            for name in parts:
                if name in f:
                    parts[name].append(f[name][()])
    for name in (*BOUND_NAMES, *RANGE_NAMES):  # only where every file has them (older files: signs only)
        if len(parts[name]) != len(paths):
            del parts[name]
    out = {}
    # head dimensions differ between models: m is zero-padded (zeros add nothing to m . sigma)
    width = max((a.shape[1] for a in parts[MEAN_VECTOR]), default=0)
    parts[MEAN_VECTOR] = [np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in parts[MEAN_VECTOR]]
    for name, arrays in parts.items():
        widths = {a.shape[1] for a in arrays}
        if len(widths) > 1:
            raise ValueError(
                f"sign-draw files disagree on the number of {name} draws: {sorted(widths)}; rerun the kpca_heads jobs"
            )
        out[name] = np.concatenate(arrays) if arrays else np.empty((0, 0), np.float32)
    return out


# --------------------------------------------------------------------------------------
# Bootstrap over images / sentences
# --------------------------------------------------------------------------------------


def stable_seed(*parts: int | str) -> np.random.SeedSequence:
    """A ``SeedSequence`` from integers and strings (strings through SHA-256, so stable across runs)."""
    key = [
        int(p) if not isinstance(p, str) else int.from_bytes(hashlib.sha256(p.encode()).digest()[:4], "little")
        for p in parts
    ]
    return np.random.SeedSequence(key)


def percentile_interval(values: np.ndarray, coverage: float) -> tuple[float, float]:
    """Central ``coverage`` percentile interval of replicate values (NaN replicates ignored).

    ``coverage = 0.9`` gives the 5th and 95th percentiles (``numpy.percentile``, linear
    interpolation). NaN, NaN when no replicate is finite.

    Raises:
        ValueError: ``coverage`` not in (0, 1).
    """
    if not 0 < coverage < 1:
        raise ValueError(f"coverage must be in (0, 1), got {coverage}")
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if not len(v):
        return float("nan"), float("nan")
    lo, hi = np.percentile(v, [50 * (1 - coverage), 50 * (1 + coverage)])
    return float(lo), float(hi)


def group_codes(keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Codes ``0 .. G-1`` of the resampling units (images or sentences) in sorted key order."""
    uniq, codes = np.unique(np.asarray(keys), return_inverse=True)
    return codes.reshape(-1), len(uniq)


def group_aggregate(
    values: np.ndarray, codes: np.ndarray, n_groups: int, how: str
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Per-group aggregate of per-head values, for every replicate row at once.

    Args:
        values: shape ``(B, H)`` (one row per replicate) float.
        codes: group of each head ``(H,)``; every group must have at least one head.
        n_groups: number of groups ``G``.
        how: ``"max"`` (NaN-skipping maximum, as pandas' ``max``), ``"sum"`` (NaN
            propagates, for ``np.mean``) or ``"nansum"`` (NaN-skipping sum and count of
            finite values, for a NaN-skipping mean).

    Returns:
        ``(B, G)`` maxima; ``(sums (B, G), counts (G,))`` for ``"sum"``; ``(sums, counts
        (B, G))`` for ``"nansum"``.

    Raises:
        ValueError: unknown ``how`` or an empty group.
    """
    order = np.argsort(codes, kind="stable")
    sorted_codes = codes[order]
    starts = np.searchsorted(sorted_codes, np.arange(n_groups))
    if len(np.unique(sorted_codes)) != n_groups:
        raise ValueError("every group needs at least one head")
    x = values[:, order]
    if how == "max":
        return np.fmax.reduceat(x, starts, axis=1)
    if how == "sum":
        return np.add.reduceat(x, starts, axis=1), np.bincount(codes, minlength=n_groups).astype(np.float64)
    if how == "nansum":
        finite = np.isfinite(x)
        return np.add.reduceat(np.where(finite, x, 0.0), starts, axis=1), np.add.reduceat(
            finite.astype(np.float64), starts, axis=1
        )
    raise ValueError(f"unknown aggregate {how!r}")


def bootstrap_indices(rng: np.random.Generator, n_groups: int, n_resamples: int) -> np.ndarray:
    """``(n_resamples, n_groups)`` group indices drawn with replacement."""
    return rng.integers(0, n_groups, size=(n_resamples, n_groups))


def pick_draws(draws: np.ndarray, rng: np.random.Generator, n_replicates: int) -> np.ndarray:
    """One stored draw per head and replicate, independently: ``(n_replicates, H)`` float64.

    Args:
        draws: ``(H, R)`` per-head sign-draw values, ``R >= 1``.

    Raises:
        ValueError: no draws stored (``R == 0``).
    """
    h, r = draws.shape
    if r == 0:
        raise ValueError("no sign draws stored for this statistic (uncertainty.sign_draws_* is 0)")
    pick = rng.integers(0, r, size=(n_replicates, h))
    return np.asarray(draws)[np.arange(h)[None, :], pick].astype(np.float64)


def predictive_draws(draws: np.ndarray, rng: np.random.Generator, n_replicates: int) -> np.ndarray:
    """One stored draw per head and replicate, moved away from its head's draw mean so that a mean over heads of
    these values spreads as another solver's mean would about the estimate: ``(n_replicates, H)`` float64.

    For a statistic that averages over heads (Table 4): head ``h`` has ``k`` stored draws
    ``y_h1 .. y_hk`` of its value under a random eigenbasis, mean ``ybar_h`` and unbiased variance
    ``s_h^2``. The returned value is ``ybar_h + f (y_hJ - ybar_h)`` with ``J`` uniform on ``1..k`` (the
    same pick as :func:`pick_draws`, the same random numbers) and ``f = sqrt((k + 1) / (k - 1))``:
    its variance given the draws is ``(1 + 1/k) s_h^2``, the variance of one more draw ``X_h`` minus
    the estimate ``ybar_h`` (``sigma_h^2 + sigma_h^2 / k``), in expectation. A mean over ``n``
    independent heads is then close to normal with the variance of ``mean_h X_h - mean_h ybar_h``,
    so its central ``c`` range is a ``c`` prediction interval for another solver's value, for
    any ``k >= 2`` (docs/uncertainty.md section 3; tests/test_uncertainty.py checks the coverage).
    A uniform pick alone (:func:`pick_draws`) has variance ``(1 - 1/k) s_h^2`` and leaves out the
    estimate's own error: its range covers another solver's mean less often, the fewer the draws.
    A head with a NaN draw gets NaN (a mean over heads skips it, as it skips the head's own NaN).

    Args:
        draws: ``(H, k)`` per-head draw values, ``k >= 2``.

    Raises:
        ValueError: fewer than 2 draws per head (no variance to estimate).
    """
    k = np.shape(draws)[1]
    if k < 2:
        raise ValueError(f"{k} stored draw(s) per head: a prediction interval over heads needs at least 2")
    center = np.asarray(draws, dtype=np.float64).mean(axis=1)
    return center + np.sqrt((k + 1) / (k - 1)) * (pick_draws(draws, rng, n_replicates) - center)


def fresh_direct_means(m: np.ndarray, rng: np.random.Generator, n_replicates: int, block: int = 32) -> np.ndarray:
    """``m_h . sigma`` for a fresh uniform sign pattern per head and replicate (exact).

    Args:
        m: ``(H, d)`` per-head token means of ``P`` (:data:`MEAN_VECTOR`), NaN for dropped heads.
        block: replicates generated at a time (memory ``block * H * d`` bytes).

    Returns:
        ``(n_replicates, H)`` float64.
    """
    m = np.asarray(m, dtype=np.float64)
    h, d = m.shape
    out = np.empty((n_replicates, h))
    total = m.sum(1)
    for lo in range(0, n_replicates, block):
        hi = min(lo + block, n_replicates)
        size = (hi - lo) * h * d
        # sigma = 2 b - 1 with b uniform bits (8 per random byte): m . sigma = 2 m . b - sum(m)
        bits = np.unpackbits(rng.integers(0, 256, size=(size + 7) // 8, dtype=np.uint8))[:size].reshape(hi - lo, h, d)
        out[lo:hi] = 2.0 * np.einsum("bhd,hd->bh", bits, m) - total
    return out


def replicate_statistics(
    values: np.ndarray, codes: np.ndarray, n_groups: int, how: str, idx: np.ndarray | None
) -> np.ndarray:
    """A table statistic (max or mean over heads) for every replicate.

    Args:
        values: per-head values ``(B, H)``, or ``(1, H)`` for the same values in every replicate.
        codes, n_groups: resampling units of the heads (:func:`group_codes`).
        how: ``"max"`` (NaN-skipping max over heads), ``"mean"`` (``np.mean``: NaN
            propagates) or ``"nanmean"`` (NaN-skipping mean).
        idx: ``(B, G)`` resampled group indices (:func:`bootstrap_indices`), or None to keep
            every group once (sign variation only).

    Returns:
        ``(B,)`` float64: the statistic over the heads of the resampled groups.
    """
    values = np.asarray(values, dtype=np.float64)
    b = values.shape[0] if idx is None else idx.shape[0]
    agg = {"max": "max", "mean": "sum", "nanmean": "nansum"}[how]
    res = group_aggregate(values, codes, n_groups, agg)

    def take(a):
        a = np.atleast_2d(a)  # (1, G) or (B, G)
        if idx is None:
            return np.broadcast_to(a, (b, n_groups))
        return a[0][idx] if a.shape[0] == 1 else np.take_along_axis(a, idx, axis=1)

    if how == "max":
        return np.fmax.reduce(take(res), axis=1)
    sums, counts = res
    with np.errstate(invalid="ignore", divide="ignore"):
        return take(sums).sum(axis=1) / take(counts).sum(axis=1)
