"""The tables' intervals (docs/uncertainty.md): the solver interval of what the eigensolver's
freedom can print and the percentile bootstrap over the images (sentences), combined, for
Tables 1 and 4; the bootstrap of every cell of Tables 2 and 3; the head that decides a
maximum, and why a value may lie outside its own interval.

The per-head draws come from the ``kpca_heads`` jobs (:mod:`kpca_repro.method.uncertainty`);
every generator is seeded from the configuration's ``seed`` and the row's names, so the
intervals do not depend on sharding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kpca_repro.analysis.statistics import SPECTRUM_STATS, per_image_spectrum
from kpca_repro.method import uncertainty as unc

__all__ = [
    "UNCERTAINTY_DEFAULTS",
    "SIGN_DEPENDENT",
    "combine_for_maximum",
    "similarity_intervals",
    "spectrum_intervals",
    "deciding_head",
    "outside_note",
    "with_intervals",
]

#: Uncertainty settings (config key ``uncertainty`` plus ``seed``; docs/uncertainty.md).
UNCERTAINTY_DEFAULTS = {"seed": 0, "bootstrap": 1000, "coverage": 0.95, "sign_coverage": 0.999}

#: Statistics that depend on the eigenvector basis a solver returns (they get a solver interval).
SIGN_DEPENDENT = ("MDC", "MOC")

#: ``(lower, upper)``, floats.
Interval = tuple[float, float]


@dataclass(frozen=True)
class _Replicates:
    """The resampling of one table row: the heads' resampling units, the bootstrap's replicates and the generator.

    Attributes:
        codes: ``(H,)`` int, each head's image (sentence) as ``0 .. n_groups - 1``
            (:func:`kpca_repro.method.uncertainty.group_codes`).
        n_groups: the number of images.
        idx: ``(B, n_groups)`` the images of each bootstrap replicate
            (:func:`kpca_repro.method.uncertainty.bootstrap_indices`).
        rng: the generator of every solver draw of the row, drawn from after ``idx`` (the order of the draws sets the
            bits).
    """

    codes: np.ndarray
    n_groups: int
    idx: np.ndarray
    rng: np.random.Generator

    @property
    def n(self) -> int:
        """``B``, the number of replicates (and of solver draws per interval)."""
        return self.idx.shape[0]

    def statistic(self, values: np.ndarray, how: str, resample: bool = False) -> np.ndarray:
        """``(R,)`` float64: the statistic ``how`` over heads of each row of ``values`` (``(R, H)``, or ``(1, H)``
        for every replicate), on all images or (``resample``) on the images of each bootstrap replicate."""
        return unc.replicate_statistics(values, self.codes, self.n_groups, how, self.idx if resample else None)

    def central(self, values: np.ndarray, how: str, coverage: float, resample: bool = False) -> tuple[float, float]:
        """The central ``coverage`` range of :meth:`statistic`."""
        return unc.percentile_interval(self.statistic(values, how, resample), coverage)


def _replicate_pair(lo: np.ndarray, hi: np.ndarray, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """One stored draw per head and replicate, the same pick for the lower and the upper array: ``(n, H)`` each."""
    h, r = lo.shape
    pick = rng.integers(0, r, size=(n, h))
    rows = np.arange(h)[None, :]
    return np.asarray(lo)[rows, pick].astype(np.float64), np.asarray(hi)[rows, pick].astype(np.float64)


def combine_for_maximum(
    value: float, solver: tuple[float, float], bootstrap: tuple[float, float]
) -> tuple[float, float]:
    """The combined interval of a maximum over heads: the solver interval widened by the bootstrap's deviations.

    ``[s_lo - max(v - b_lo, 0), s_hi + max(b_hi - v, 0)]`` for the reproduced value ``v``, the
    solver interval ``[s_lo, s_hi]`` (it holds ``v``) and the percentile-bootstrap interval
    ``[b_lo, b_hi]`` of the solver's own configuration. Sampling and the solver each move the
    maximum by up to their own deviation; the interval adds the two (their worst alignment),
    so it holds both intervals, the solver interval in particular. A percentile bootstrap of
    a maximum runs low on its own (a resample of ``n`` images holds about ``0.63 n`` distinct
    ones, and its maximum is never above the full sample's: ``b_hi <= v``), which is why the
    solver interval's upper end is kept whole (docs/uncertainty.md, section 3).

    Returns:
        ``(lower, upper)``; NaN where an input is NaN.
    """
    (s_lo, s_hi), (b_lo, b_hi) = solver, bootstrap
    return float(s_lo - max(value - b_lo, 0.0)), float(s_hi + max(b_hi - value, 0.0))


def similarity_intervals(
    df: pd.DataFrame, statistics: tuple, draws: dict[str, np.ndarray] | None, settings: dict, tag: str, model: str
) -> dict[str, float]:
    """Solver and bootstrap intervals of one row of Table 1 or Table 4 (docs/uncertainty.md).

    Resampling units are the images (``sample_rank``; sentences for Table 4). For each
    statistic ``S`` of ``statistics``:

    * ``S_solver_lower``, ``S_solver_upper`` (MDC, MOC): what the solver's freedom can print,
      all images, no resampling. The admissible eigenbases are every eigenvector's sign and
      any rotation inside each near-degenerate group (:mod:`kpca_repro.method.solver_variation`).
      Table 1's MDC with stored rotation bounds: the union of (a) the central
      ``sign_coverage`` range of the table statistic when every head takes a random sign
      draw and its *exact* lower / upper bound over the rotations (lower quantile of the
      lower envelope, upper quantile of the upper envelope) and (b) the exact range over
      rotations at the solver's own signs, which contains the reproduced value. Otherwise
      (Table 4's MDC, every MOC): the central ``sign_coverage`` range when every head takes
      one of its stored sign-and-rotation draws, independently (another solver changes the
      configuration of nearly every head at once), joined with the reproduced value (the
      solver's own configuration); for a mean over heads (Table 4) each draw is widened into a
      prediction for another solver (:func:`kpca_repro.method.uncertainty.predictive_draws`). A NaN
      draw is one the ``kpca_heads`` job proved to be below every replicate maximum (Table 1's
      MOC): skipped by the maximum, it changes nothing (:class:`kpca_repro.method.solver_variation.RunningFloor`).
    * ``S_lower``, ``S_upper``: the combined interval. A maximum over heads (Table 1):
      :func:`combine_for_maximum` of the solver interval and the central ``coverage``
      percentile bootstrap of the solver's own configuration. A mean over heads (Table 4):
      the percentile bootstrap in which every replicate also takes one solver draw per
      head, joined with the bootstrap of the solver's own configuration. Without stored
      draws (``draws`` None or zero-width) MDC and MOC get the bootstrap of the observed
      values and NaN solver bounds. The three kinds of draws: :func:`_rotation_bound_intervals`,
      :func:`_fresh_sign_intervals`, :func:`_stored_draw_intervals`.

    Args:
        df: the heads the table aggregates (rows in canonical (layer, input, head) order), whose index labels
            are the rows of ``draws``.
        statistics: (table column, per-head column, ``"max" | "mean" | "nanmean"``) triples.
        draws: per-head solver draws (:func:`kpca_repro.method.uncertainty.read_sign_draws`).
        settings: ``seed``, ``bootstrap``, ``coverage``, ``sign_coverage``.
        tag, model: with ``seed``, the bootstrap generator's seed (independent of sharding:
            the heads are in a canonical order and the images coded in sorted order).

    Returns:
        Column name -> bound.
    """
    cfg = {**UNCERTAINTY_DEFAULTS, **settings}
    rng = np.random.default_rng(unc.stable_seed(cfg["seed"], tag, model))
    codes, n_groups = unc.group_codes(df["sample_rank"].to_numpy())
    rep = _Replicates(codes, n_groups, unc.bootstrap_indices(rng, n_groups, int(cfg["bootstrap"])), rng)
    rows = df.index.to_numpy()
    out: dict[str, float] = {}
    for name, col, how in statistics:
        point = df[col].to_numpy(np.float64)[None, :]
        own = float(rep.statistic(point, how)[0])
        own_boot = rep.central(point, how, cfg["coverage"], resample=True)
        solver, joint = _solver_intervals(name, col, how, draws, rows, point, own, own_boot, rep, cfg)
        if solver is None:
            if name in SIGN_DEPENDENT:
                out[f"{name}_solver_lower"] = out[f"{name}_solver_upper"] = float("nan")
            out[f"{name}_lower"], out[f"{name}_upper"] = own_boot
            continue
        out[f"{name}_solver_lower"], out[f"{name}_solver_upper"] = solver
        out[f"{name}_lower"], out[f"{name}_upper"] = (
            combine_for_maximum(own, solver, own_boot) if how == "max" else joint
        )
    return out


def _solver_intervals(
    name: str,
    col: str,
    how: str,
    draws: dict[str, np.ndarray] | None,
    rows: np.ndarray,
    point: np.ndarray,
    own: float,
    own_boot: Interval,
    rep: _Replicates,
    cfg: dict,
) -> tuple[Interval | None, Interval | None]:
    """``(solver, joint)`` of one statistic from the draws its per-head column has, or ``(None, None)`` without any.

    ``joint`` is the bootstrap with one solver draw per head and replicate, joined with ``own_boot``
    (the bootstrap of the solver's own configuration); None for a maximum over heads, whose
    combined interval is :func:`combine_for_maximum`. Which draws, in this order: Table 1's MDC
    with stored rotation bounds; the token mean of the direct cosine with its per-head mean
    vector (sign-only files); the stored draws of a sign-dependent statistic.
    """
    if draws is None:
        return None, None
    sc, cov = cfg["sign_coverage"], cfg["coverage"]
    if col == unc.DIRECT_COS_MEAN and all(k in draws and draws[k].shape[1] > 0 for k in unc.BOUND_NAMES):
        return _rotation_bound_intervals(draws, rows, point, rep, how, sc, cov)
    mean_vector = draws.get(unc.MEAN_VECTOR) if col == unc.DIRECT_COS_MEAN else None
    if mean_vector is not None and len(mean_vector) and mean_vector.shape[1] > 0:
        return _fresh_sign_intervals(mean_vector[rows], rep, how, sc, cov)
    stored = draws.get(col) if name in SIGN_DEPENDENT else None
    if stored is not None and stored.shape[1] > 0:
        return _stored_draw_intervals(stored[rows], own, own_boot, rep, how, sc, cov)
    return None, None


def _rotation_bound_intervals(
    draws: dict[str, np.ndarray], rows: np.ndarray, point: np.ndarray, rep: _Replicates, how: str, sc: float, cov: float
) -> tuple[Interval, Interval | None]:
    """Table 1's MDC with the exact bounds over rotations stored per sign draw (``direct_cos_mean_lower`` / ``_upper``).

    Solver: the lower ``sc`` quantile of the lower envelope and the upper one of the upper
    envelope (every head one random sign draw, the same for both envelopes), joined with the
    exact range over rotations at the solver's own signs (``direct_cos_mean_own_*``, widened to
    hold the reproduced per-head value). Joint (a mean over heads only): the same with the images
    resampled, joined with the bootstrap of that own range.
    """
    own_lo = np.fmin(draws[unc.DIRECT_COS_MEAN_OWN_LOWER][rows, 0].astype(np.float64), point[0])[None, :]
    own_hi = np.fmax(draws[unc.DIRECT_COS_MEAN_OWN_UPPER][rows, 0].astype(np.float64), point[0])[None, :]
    lo_d, hi_d = draws[unc.DIRECT_COS_MEAN_LOWER][rows], draws[unc.DIRECT_COS_MEAN_UPPER][rows]
    lo, hi = _replicate_pair(lo_d, hi_d, rep.rng, rep.n)
    q_lo, q_hi = rep.central(lo, how, sc)[0], rep.central(hi, how, sc)[1]
    own_range = (rep.statistic(own_lo, how)[0], rep.statistic(own_hi, how)[0])
    solver = (float(min(q_lo, own_range[0])), float(max(q_hi, own_range[1])))
    if how == "max":
        return solver, None
    lo, hi = _replicate_pair(lo_d, hi_d, rep.rng, rep.n)
    b_lo, b_hi = rep.central(lo, how, cov, resample=True)[0], rep.central(hi, how, cov, resample=True)[1]
    o_lo, o_hi = rep.central(own_lo, how, cov, resample=True)[0], rep.central(own_hi, how, cov, resample=True)[1]
    return solver, (float(min(b_lo, o_lo)), float(max(b_hi, o_hi)))


def _fresh_sign_intervals(
    m: np.ndarray, rep: _Replicates, how: str, sc: float, cov: float
) -> tuple[Interval, Interval | None]:
    """The token mean of the direct cosine from sign-only files: ``m . sigma`` for fresh sign patterns ``sigma``
    (:func:`kpca_repro.method.uncertainty.fresh_direct_means`, exact), ``m`` the heads' ``(H, d)`` mean vectors.
    Solver: the central ``sc`` range; joint (a mean over heads only): the bootstrap with fresh patterns."""
    solver = rep.central(unc.fresh_direct_means(m, rep.rng, rep.n), how, sc)
    joint = None if how == "max" else rep.central(unc.fresh_direct_means(m, rep.rng, rep.n), how, cov, resample=True)
    return solver, joint


def _stored_draw_intervals(
    per_head: np.ndarray, own: float, own_boot: Interval, rep: _Replicates, how: str, sc: float, cov: float
) -> tuple[Interval, Interval | None]:
    """Table 4's MDC and every MOC: every head takes one of its stored sign-and-rotation draws (``per_head``,
    ``(H, S)``).

    Another solver changes the configuration of (nearly) every head at once: every head takes a
    random stored draw, and the solver's own configuration (the reproduced value ``own``) is one
    more admissible outcome, joined to the central ``sc`` range of the draws. For a maximum over
    heads (Table 1's MOC) a draw as stored (:func:`kpca_repro.method.uncertainty.pick_draws`); for a
    mean over heads (Table 4) the draw moved from its head's draw mean so that the range is a
    prediction interval for another solver's mean (:func:`kpca_repro.method.uncertainty.predictive_draws`).
    Joint (a mean over heads only): the bootstrap with one such draw per head and replicate,
    joined with ``own_boot``.
    """
    if how == "max":
        lo, hi = rep.central(unc.pick_draws(per_head, rep.rng, rep.n), how, sc)
        return (float(np.fmin(lo, own)), float(np.fmax(hi, own))), None
    lo, hi = rep.central(unc.predictive_draws(per_head, rep.rng, rep.n), how, sc)
    solver = (float(np.fmin(lo, own)), float(np.fmax(hi, own)))
    b_lo, b_hi = rep.central(unc.predictive_draws(per_head, rep.rng, rep.n), how, cov, resample=True)
    return solver, (float(np.fmin(b_lo, own_boot[0])), float(np.fmax(b_hi, own_boot[1])))


def spectrum_intervals(eigenvalues: np.ndarray, settings: dict, model: str, keys: str) -> dict[str, float]:
    """Percentile-bootstrap intervals over images of every Table 2/3 cell (x 1e-6).

    Each replicate resamples the images with replacement and recomputes the mean and the
    standard deviation (ddof 1) over images of each per-image statistic. The generator is
    seeded by (``seed``, ``"spectra"``, model, keys), so Table 2 and Table 3 give the
    standardized columns the same intervals.

    Args:
        eigenvalues: ``(images, layers * heads, R)`` (:func:`kpca_repro.analysis.statistics.eigenvalue_array`).
        settings: ``seed``, ``bootstrap``, ``coverage``.

    Returns:
        ``{"max_mean_lower": .., "max_mean_upper": .., "max_std_lower": .., ...}``.
    """
    cfg = {**UNCERTAINTY_DEFAULTS, **settings}
    stats = per_image_spectrum(eigenvalues)
    n = eigenvalues.shape[0]
    idx = unc.bootstrap_indices(
        np.random.default_rng(unc.stable_seed(cfg["seed"], "spectra", model, keys)), n, int(cfg["bootstrap"])
    )
    out: dict[str, float] = {}
    for name in SPECTRUM_STATS:
        sample = stats[name][idx] * 1e6  # (B, images)
        for what, values in (
            ("mean", sample.mean(axis=1)),
            ("std", sample.std(axis=1, ddof=1) if n > 1 else np.full(len(sample), np.nan)),
        ):
            out[f"{name}_{what}_lower"], out[f"{name}_{what}_upper"] = unc.percentile_interval(values, cfg["coverage"])
    return out


def outside_note(row: dict, statistics: tuple) -> str:
    """Why a reproduced value lies outside its own interval, per statistic ('' when every value is inside).

    Intervals that are quantiles of draws (Table 4's MDC, every MOC, the bootstrap) need not
    contain the value the solver printed: it is one configuration among many, and a value
    in the tail of the draws' distribution is outside a central interval.
    """
    notes = []
    for name, _, _ in statistics:
        value = row.get(name)
        for kind, lo_key, hi_key in (
            ("solver", f"{name}_solver_lower", f"{name}_solver_upper"),
            ("combined", f"{name}_lower", f"{name}_upper"),
        ):
            lo, hi = row.get(lo_key), row.get(hi_key)
            if value is None or lo is None or hi is None or not all(np.isfinite([value, lo, hi])):
                continue
            if not lo <= value <= hi:
                notes.append(
                    f"{name} outside its {kind} interval: that interval is a central range of random draws, and the "
                    "solver's own configuration lies in their tail"
                )
    return "; ".join(notes)


def deciding_head(df: pd.DataFrame, col: str, prefix: str = "MDC_") -> dict:
    """The head whose per-head ``col`` is the maximum over heads (Table 1's MDC), with its eigengap.

    A maximum over thousands of heads is set by one head: the one printed here.

    Returns:
        ``<prefix>layer``, ``<prefix>head``, ``<prefix>sample_rank``,
        ``<prefix>dataset_index`` and ``<prefix>eigengap`` (the head's ``eigengap_min``,
        smallest relative gap among its selected eigenpairs and at the selection boundary;
        NaN where the records have none). -1 and NaN when no value is finite.
    """
    keys = ("layer", "head", "sample_rank", "dataset_index")
    values = df[col].to_numpy(np.float64)
    if not np.isfinite(values).any():
        return {**{prefix + k: -1 for k in keys}, prefix + "eigengap": float("nan")}
    top = df.iloc[int(np.nanargmax(values))]
    out = {prefix + k: int(top[k]) if k in df else -1 for k in keys}  # -1: not in the records
    out[prefix + "eigengap"] = float(top["eigengap_min"]) if "eigengap_min" in df else float("nan")
    return out


def with_intervals(
    row: dict, intervals: dict[str, float], settings: dict, draws: dict | None, statistics: tuple
) -> dict:
    """``row`` with the interval columns after the last statistic (KCKA), the settings at the end and
    ``interval_note`` (:func:`outside_note`: why a value lies outside its own interval, '' when none does)."""
    keys = list(row)
    at = keys.index(statistics[-1][0]) + 1
    cfg = {**UNCERTAINTY_DEFAULTS, **settings}
    tail = {
        "bootstrap_resamples": int(cfg["bootstrap"]),
        "coverage": float(cfg["coverage"]),
        "sign_coverage": float(cfg["sign_coverage"]),
        "sign_draws": int(draws[unc.DIRECT_COS_MEAN].shape[1]) if draws is not None else 0,
        "sign_draws_optimal": int(draws[unc.OPTIMAL_COS_MEAN].shape[1]) if draws is not None else 0,
        "solver_rotations": bool(draws is not None and all(k in draws for k in unc.BOUND_NAMES)),
    }
    out = {**{k: row[k] for k in keys[:at]}, **intervals, **{k: row[k] for k in keys[at:]}, **tail}
    out["interval_note"] = outside_note(out, statistics)
    return out
