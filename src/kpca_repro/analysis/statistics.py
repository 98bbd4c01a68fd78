"""Exact statistics of the tables: order-independent means and standard deviations, the
statistic over heads of Tables 1 and 4, and the eigenvalue spectra of Tables 2 and 3.

Everything here is a pure function of the values it is given (no generator, no table
registry): :mod:`kpca_repro.analysis.tables` aggregates the records with it and
:mod:`kpca_repro.analysis.intervals` resamples it.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

__all__ = [
    "exact_mean",
    "exact_std",
    "over_heads",
    "SPECTRUM_STATS",
    "spectrum_statistics",
    "per_image_spectrum",
    "eigenvalue_array",
]


def exact_mean(values, skipna: bool = False) -> float:
    """Mean of float values that does not depend on their order.

    ``math.fsum`` (the correctly rounded sum of the exact values) divided by the count, so
    the records of a model give the same bits however shards, chunks or worker threads
    ordered them (a floating-point sum in another order can differ in the last digits).

    Args:
        values: 1-d array-like of floats.
        skipna: leave NaN out (pandas' ``mean``) or let it propagate (``np.mean``).

    Returns:
        The mean; NaN for no value (or a NaN with ``skipna=False``); ``±inf``/NaN as
        ``np.mean`` gives them when an infinite value is present.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if skipna:
        x = x[~np.isnan(x)]
    if x.size == 0:
        return float("nan")
    if not np.isfinite(x).all():  # NaN or inf: the result is that, whatever the order
        return float(np.mean(x))
    return math.fsum(x.tolist()) / x.size


def exact_std(values, ddof: int = 1) -> float:
    """Standard deviation (``ddof`` as in numpy) from :func:`exact_mean`'s order-independent sums.

    Args:
        values: 1-d array-like of finite floats.
        ddof: delta degrees of freedom (1: the unbiased estimate of pandas' ``std``).

    Returns:
        The standard deviation, NaN for at most ``ddof`` values.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size <= ddof:
        return float("nan")
    m = exact_mean(x)
    return math.sqrt(math.fsum(((x - m) ** 2).tolist()) / (x.size - ddof))


def over_heads(values: pd.Series, how: str) -> float:
    """A statistic over heads as the references compute it (docs/method.md 2 and 3).

    Args:
        values: one per-head column, float.
        how: ``"max"`` skips NaN (pandas' ``max``), ``"mean"`` propagates it (``np.mean``),
            ``"nanmean"`` skips it (pandas' ``mean``); both means order-independent (:func:`exact_mean`).

    Returns:
        The statistic; NaN for no value.
    """
    return values.max() if how == "max" else exact_mean(values, skipna=how == "nanmean")


#: The per-image statistics of Tables 2 and 3, in the tables' column order (``<stat>_mean``, ``<stat>_std``).
SPECTRUM_STATS = ("max", "min", "mean", "median")


def spectrum_statistics(eigenvalues: np.ndarray) -> dict[str, float]:
    """Table 2/3 statistics of one model (docs/method.md Section 4), in units of 1e-6.

    Per image: the rank-wise mean of ``|lambda_r|`` over all (layer, head) pairs (a NaN head
    makes that image's vector NaN, as ``np.mean`` does in the reference), then that vector's
    max, min, mean and *lower* median (``torch.median``: element ``(R-1)//2`` of the sorted
    vector). Across images: mean and unbiased standard deviation of each statistic.

    Args:
        eigenvalues: shape ``(images, layers * heads, R)``, float.

    Returns:
        ``{"max_mean": .., "max_std": .., ..., "median_std": ..}`` (x 1e6), plus
        ``n_images``, ``n_heads`` and ``n_nonfinite_heads``.
    """
    stats = per_image_spectrum(eigenvalues)
    r = eigenvalues.shape[2]
    out: dict[str, float] = {}
    for name in SPECTRUM_STATS:
        out[f"{name}_mean"] = float(stats[name].mean() * 1e6)
        out[f"{name}_std"] = float(stats[name].std(ddof=1) * 1e6) if len(stats[name]) > 1 else float("nan")
    heads = eigenvalues.reshape(-1, r)
    out["n_images"] = int(eigenvalues.shape[0])
    out["n_heads"] = int(heads.shape[0])
    out["n_nonfinite_heads"] = int((~np.isfinite(heads).all(axis=1)).sum())
    return out


def per_image_spectrum(eigenvalues: np.ndarray) -> dict[str, np.ndarray]:
    """Per image: max, min, mean and lower median of the rank-wise mean over heads (docs/method.md 4).

    Args:
        eigenvalues: shape ``(images, layers * heads, R)``, float.

    Returns:
        :data:`SPECTRUM_STATS` -> ``(images,)`` float (unscaled).
    """
    per_image = eigenvalues.mean(axis=1)  # (images, R)
    r = per_image.shape[1]
    return {
        "max": per_image.max(axis=1),
        "min": per_image.min(axis=1),
        "mean": per_image.mean(axis=1),
        "median": np.sort(per_image, axis=1)[:, (r - 1) // 2],
    }


def eigenvalue_array(records: pd.DataFrame) -> np.ndarray:
    """The input of :func:`spectrum_statistics` from one model's per-head eigenvalue records.

    Args:
        records: rows ``sample_rank, layer, head`` with the ``lambda_*`` columns (``R`` of them),
            every (layer, head) of every image once, in any order.

    Returns:
        ``(images, layers * heads, R)`` float64, images by ``sample_rank``, then layer, head.
    """
    cols = [c for c in records.columns if c.startswith("lambda_")]
    ordered = records.sort_values(["sample_rank", "layer", "head"])
    n_img = ordered["sample_rank"].nunique()
    return ordered[cols].to_numpy(dtype=np.float64).reshape(n_img, -1, len(cols))
