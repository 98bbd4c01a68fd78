"""What each training run of Figures 1 and 4 was, the token-count ablation table and the claims table.

docs/training.md explains why this pipeline's CPU-scale runs and the authors' ImageNet runs
differ. The first suspect is the number of tokens N: with per-token standardized q and k,
``||phi(q_i)||^2 = exp(s ||q_i||^2) / g(q_i)^2`` where ``g(q_i) = sum_j exp(s q_i.k_j)`` sums over
the N keys, so fewer tokens mean a smaller ``g`` and a larger ``||phi(q)||^2`` before any
learning (docs/method.md Section 6.1). The ablation trains the same model at the same
settings with N in {17, 50, 197} (``training.scales`` ``medium-n17``, ``medium-n50``,
``medium``) and tabulates J_proj, ``||h||^2`` and ``||phi(q)||^2`` at the first and the last
epoch (:func:`token_ablation_table`), as the median over the seeds of each run with their range.

Every run is ``results/training/<model>_<scale>/seed<seed>/`` (:func:`run_dir`); a scale's seeds
are its ``seeds`` key, else ``training.seeds`` (:func:`scale_seeds`). :func:`training_claims`
says in how many seeds and epochs each of the authors' three Figure 1 observations holds, for
the logged means and for the medians over tokens.

This module reads finished logs only (no torch); it is not an input of the training jobs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas is imported where a table is built: the workflow imports this module at parse time
    import pandas as pd

__all__ = [
    "AUTHORS_SETTING",
    "scale_tokens",
    "scale_setting",
    "scale_seeds",
    "run_scale",
    "run_dir",
    "with_seeds",
    "run_logs",
    "SEED_SUMMARY_COLUMNS",
    "over_seeds",
    "ABLATION_QUANTITIES",
    "ABLATION_COLUMNS",
    "token_ablation_table",
    "token_ablation_markdown",
    "CLAIM_STATISTICS",
    "CLAIMS",
    "CLAIMS_COLUMNS",
    "claim_definitions",
    "training_claims",
    "training_claims_markdown",
    "CLAIM_LABELS",
    "claim_cell",
    "claims_note",
]

#: The setting of the authors' logged runs (docs/method.md 6.1), as :func:`scale_setting` words it.
AUTHORS_SETTING = "ImageNet-1k, 224x224 in 16x16 patches: 197 tokens, 12 blocks, 300 epochs"

_DATASETS = {"fashion_mnist": "Fashion-MNIST", "imagenet": "ImageNet-1k"}


#: Minutes of one run of the ``medium`` scale (Fashion-MNIST, 3,072 images, 10 epochs, 197 tokens)
#: on 2 cores: 36-41 min measured (docs/training.md); the base of :func:`estimated_minutes`.
MEDIUM_RUN_MINUTES = 38.5


def estimated_minutes(scale: dict, threads: int) -> float | None:
    """A rough wall-time estimate of one training run of ``scale`` on ``threads`` CPU threads.

    Proportional to images x epochs x tokens from the ``medium`` scale's measured runs
    (:data:`MEDIUM_RUN_MINUTES` on 2 cores; the 17-token runs took 2-5 min, about as the
    proportion says) and to ``2 / threads``. None for ImageNet (the authors' recipe, days on a
    GPU, not estimated here).
    """
    if scale.get("dataset") != "fashion_mnist" or not scale.get("n_train"):
        return None
    work = scale["n_train"] * scale["epochs"] * scale_tokens(scale) / (3072 * 10 * 197)
    return MEDIUM_RUN_MINUTES * work * 2 / max(1, threads)


def scale_tokens(scale: dict) -> int:
    """Tokens per image of a training scale: ``(img_size / patch_size)^2`` patches + the class token.

    Args:
        scale: one resolved entry of ``training.scales`` (:func:`kpca_repro.workflow.config_checks.resolve_scales`).

    Returns:
        N, e.g. 197 for 224x224 images in 16x16 patches or 28x28 images in 2x2 patches.

    Raises:
        ValueError: ``patch_size`` does not divide ``img_size``.
    """
    size, patch = scale["img_size"], scale["patch_size"]
    if size % patch:
        raise ValueError(f"patch_size {patch} does not divide img_size {size}")
    return (size // patch) ** 2 + 1


def scale_setting(scale: dict, seeds: list[int] | None = None) -> str:
    """One line saying what a run at this scale trains on, for figure titles and tables.

    Example: ``"Fashion-MNIST, 3072 images, 28x28 in 2x2 patches: 197 tokens, 6 blocks, 10 epochs"``
    (``depth: null`` reads "12 blocks", the tiny models' depth; ``n_train: null`` "all images"),
    followed by ``", 3 seeds (0, 1, 2)"`` or ``", seed 0"`` when ``seeds`` is given.
    """
    images = "all images" if scale["n_train"] is None else f"{scale['n_train']} images"
    depth = 12 if scale["depth"] is None else scale["depth"]
    size, patch = scale["img_size"], scale["patch_size"]
    text = (
        f"{_DATASETS.get(scale['dataset'], scale['dataset'])}, {images}, {size}x{size} in {patch}x{patch} "
        f"patches: {scale_tokens(scale)} tokens, {depth} blocks, {scale['epochs']} epochs"
    )
    if seeds:
        text += f", seed {seeds[0]}" if len(seeds) == 1 else f", {len(seeds)} seeds ({', '.join(map(str, seeds))})"
    return text


def scale_seeds(training: dict, scale: str) -> list[int]:
    """The seeds a scale is trained with: its own ``seeds`` (inherited through ``base``), else
    ``training.seeds``, else ``[0]``.

    Args:
        training: ``config["training"]`` with resolved scales
            (:func:`kpca_repro.workflow.config_checks.resolve_scales`).
        scale: a name of ``training.scales``.

    Returns:
        The seeds, non-negative ints, in the configured order.
    """
    seeds = training["scales"][scale].get("seeds")
    if seeds is None:
        seeds = training.get("seeds", [0])
    return [int(s) for s in seeds]


def run_scale(scale: dict) -> dict:
    """What one run trains: the resolved scale without ``seeds`` (adding a seed to a scale
    changes neither the parameters nor the checkpoint fingerprint of the runs it had)."""
    return {k: v for k, v in scale.items() if k != "seeds"}


def run_dir(model: str, scale: str, seed: int) -> str:
    """``results/training/<model>_<scale>/seed<seed>``: the folder of one run's ``log.csv`` and ``checkpoint.pt``."""
    return f"results/training/{model}_{scale}/seed{int(seed)}"


def with_seeds(training: dict, runs: Sequence[tuple[str, str, int]]) -> list[tuple[str, str, int, int]]:
    """``(model, scale, tokens)`` runs expanded over their scale's seeds (:func:`scale_seeds`):
    ``(model, scale, tokens, seed)``, the seeds of each run together, in the given order."""
    return [(model, scale, tokens, seed) for model, scale, tokens in runs for seed in scale_seeds(training, scale)]


def run_logs(runs: Sequence[tuple]) -> list[str]:
    """The ``log.csv`` of each ``(model, scale, tokens, seed)`` run (:func:`run_dir`), in order."""
    return [f"{run_dir(model, scale, seed)}/log.csv" for model, scale, _tokens, seed in runs]


#: Columns of :func:`over_seeds`.
SEED_SUMMARY_COLUMNS = [
    "source",
    "model",
    "split",
    "metric",
    "epoch",
    "x",
    "n_seeds",
    "value",
    "value_min",
    "value_max",
]


def over_seeds(curves: "pd.DataFrame") -> "pd.DataFrame":
    """Per ``(source, model, split, metric, epoch)``: the median over seeds and its range.

    Args:
        curves: the tidy frame of :func:`kpca_repro.training.logs.training_curves` (column ``seed``;
            one row per seed).

    Returns:
        Columns :data:`SEED_SUMMARY_COLUMNS`: ``value`` the median over the seeds (the mean of
        the middle two for an even count), ``value_min``/``value_max`` the smallest and the
        largest value, ``n_seeds`` how many seeds have a value that is not NaN (NaN values are
        left out of all three; ``value`` is NaN when every seed's is); ``x`` the median x over
        the seeds (the same for this pipeline's runs). Sorted by source (first appearance),
        model, split, metric, epoch.
    """
    keys = ["source", "model", "split", "metric", "epoch"]
    grouped = curves.groupby(keys, sort=False, dropna=False)
    out = grouped.agg(
        x=("x", "median"),
        n_seeds=("value", "count"),
        value=("value", "median"),
        value_min=("value", "min"),
        value_max=("value", "max"),
    ).reset_index()
    order = {s: i for i, s in enumerate(dict.fromkeys(curves["source"]))}
    out = (
        out.assign(_o=out["source"].map(order))
        .sort_values(["_o", "model", "split", "metric", "epoch"], kind="stable")
        .drop(columns="_o")
    )
    return out[SEED_SUMMARY_COLUMNS].reset_index(drop=True)


#: The quantities of the ablation table: ``(name in results/token_ablation.csv, log column
#: without its split prefix)``. The means are the authors' logged values (averaged over layers,
#: heads and tokens), the medians and 0.99 quantiles are over all tokens of the batch
#: (:data:`kpca_repro.training.logs.TOKEN_STATS`; NaN for a log written before they were logged).
ABLATION_QUANTITIES = (
    ("j_proj", "error"),
    ("j_proj_median", "error_median"),
    ("h_norm_sq", "h_norms_ave"),
    ("h_norm_sq_median", "h_norms_median"),
    ("h_norm_sq_q99", "h_norms_q99"),
    ("phiq_norm_sq", "phiq_norms_ave"),
    ("phiq_norm_sq_median", "phiq_norms_median"),
    ("phiq_norm_sq_q99", "phiq_norms_q99"),
    ("phiq_above_h", "phiq_above_h_frac"),
)
#: Columns of ``results/token_ablation.csv``, one row per (model, scale, split). ``*_first`` /
#: ``*_last`` are the first and the last logged epoch, on the fixed batch of ``split`` (train: a
#: training batch in train mode; test: the first validation batch in eval mode): the median
#: over the run's seeds, with ``*_min`` / ``*_max`` the smallest and largest seed's value.
#: ``seeds`` lists them ("0 1 2"); losses and accuracy are medians over seeds.
ABLATION_COLUMNS = (
    "model",
    "scale",
    "tokens",
    "split",
    "epochs",
    "n_seeds",
    "seeds",
    "train_loss_first",
    "train_loss_last",
    "test_acc1_last",
    *(
        f"{name}_{when}{stat}"
        for name, _ in ABLATION_QUANTITIES
        for when in ("first", "last")
        for stat in ("", "_min", "_max")
    ),
)


def _run_tuples(runs: Sequence[tuple]) -> list[tuple]:
    """Runs as ``(log_csv, model, scale, tokens, seed)``; a 4-tuple without the seed is seed 0."""
    return [tuple(r) if len(r) == 5 else (*r, 0) for r in runs]


def _read_seed_logs(runs: Sequence[tuple]) -> "dict[tuple[str, str, int], dict[int, pd.DataFrame]]":
    """``{(model, scale, tokens): {seed: log sorted by epoch}}`` in the order the runs come.

    Raises:
        ValueError: a log has no rows, or a seed appears twice for one (model, scale).
    """
    import pandas as pd

    out: dict = {}
    for path, model, scale, tokens, seed in _run_tuples(runs):
        log = pd.read_csv(path).sort_values("epoch").reset_index(drop=True)
        if log.empty:
            raise ValueError(f"{path}: the training log has no epochs")
        seeds = out.setdefault((model, scale, int(tokens)), {})
        if int(seed) in seeds:
            raise ValueError(f"{path}: seed {seed} of {model}_{scale} given twice")
        seeds[int(seed)] = log
    return out


def token_ablation_table(runs: Sequence[tuple]) -> "pd.DataFrame":
    """J_proj, ``||h||^2`` and ``||phi(q)||^2`` at the first and last epoch of each run, over its seeds.

    Args:
        runs: ``(log_csv, model, scale, tokens, seed)`` per run and seed (a 4-tuple is seed 0);
            ``log_csv`` is a ``results/training/<model>_<scale>/seed<seed>/log.csv`` (columns
            :data:`kpca_repro.training.logs.LOG_COLUMNS`, or only its ``BASE_LOG_COLUMNS`` for a log
            written before the token statistics were logged, one row per epoch).

    Returns:
        One row per (model, scale) and split (train, test), columns :data:`ABLATION_COLUMNS`,
        sorted by model, tokens, number of epochs and split. Values are the logged float64
        numbers (their median over seeds, NaN where a log lacks the column); J_proj is the
        logged ``error`` (the mean of ``|phi_i - ||h_i||^2|``), the means ``h_norms_ave`` and
        ``phiq_norms_ave`` (docs/method.md 6.1).

    Raises:
        ValueError: a log has no rows, a seed is given twice, or the seeds of one run have
            different numbers of epochs (a run not finished).
    """
    import numpy as np
    import pandas as pd

    def spread(values: list[float]) -> tuple[float, float, float]:
        v = np.asarray(values, dtype=float)
        v = v[~np.isnan(v)]
        return (float(np.median(v)), float(v.min()), float(v.max())) if len(v) else (np.nan, np.nan, np.nan)

    def column(log, split: str, name: str, at: int) -> float:
        key = name if name in ("train_loss", "test_acc1") else f"{split}_{name}"
        return float(log[key].iloc[at]) if key in log.columns else np.nan

    rows = []
    for (model, scale, tokens), logs in _read_seed_logs(runs).items():
        lengths = {seed: len(log) for seed, log in logs.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(
                f"{model}_{scale}: the seeds' logs have different numbers of epochs {lengths}; is a run unfinished?"
            )
        for split in ("train", "test"):
            row = {
                "model": model,
                "scale": scale,
                "tokens": tokens,
                "split": split,
                "epochs": next(iter(lengths.values())),
                "n_seeds": len(logs),
                "seeds": " ".join(map(str, sorted(logs))),
                "train_loss_first": spread([column(log, split, "train_loss", 0) for log in logs.values()])[0],
                "train_loss_last": spread([column(log, split, "train_loss", -1) for log in logs.values()])[0],
                "test_acc1_last": spread([column(log, split, "test_acc1", -1) for log in logs.values()])[0],
            }
            for name, log_column in ABLATION_QUANTITIES:
                for when, at in (("first", 0), ("last", -1)):
                    med, lo, hi = spread([column(log, split, log_column, at) for log in logs.values()])
                    row.update({f"{name}_{when}": med, f"{name}_{when}_min": lo, f"{name}_{when}_max": hi})
            rows.append(row)
    table = pd.DataFrame(rows, columns=list(ABLATION_COLUMNS))
    return table.sort_values(["model", "tokens", "epochs", "split"], kind="stable").reset_index(drop=True)


def _value(row, name: str) -> str:
    """``median`` or ``median [min–max]`` over seeds, 3 significant digits; "–" for NaN."""
    import math

    med = row[name]
    if med is None or math.isnan(med):
        return "–"
    lo, hi = row.get(f"{name}_min", med), row.get(f"{name}_max", med)
    return f"{med:.3g}" if row.get("n_seeds", 1) <= 1 or lo == hi else f"{med:.3g} [{lo:.3g}–{hi:.3g}]"


def token_ablation_markdown(table: "pd.DataFrame", split: str = "test", names: dict[str, str] | None = None) -> str:
    """The ablation for one split as a Markdown table (README): first -> last epoch per quantity.

    Each cell is the median over seeds, followed by the range ``[min–max]`` over seeds when a
    run has more than one; "–" where the logs lack the quantity (a median in a log written
    before the token statistics were logged).

    Args:
        table: :func:`token_ablation_table`'s frame.
        split: which fixed batch (``test`` or ``train``).
        names: display names of the models (default: the keys).
    """
    names = names or {}

    def pair(row, name: str) -> str:
        return f"{_value(row, f'{name}_first')} → {_value(row, f'{name}_last')}"

    lines = [
        "| model | N | epochs | seeds | train loss | test acc@1 (last) | J_proj | mean ‖h‖² | median ‖h‖² | mean "
        "‖φ(q)‖² | median ‖φ(q)‖² |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, row in table[table["split"] == split].iterrows():
        lines.append(
            f"| {names.get(row['model'], row['model'])} | {row['tokens']} | {row['epochs']} | {row['seeds']} | "
            f"{row['train_loss_first']:.3f} → {row['train_loss_last']:.3f} | "
            f"{row['test_acc1_last']:.1f} % | {pair(row, 'j_proj')} | {pair(row, 'h_norm_sq')} | "
            f"{pair(row, 'h_norm_sq_median')} | {pair(row, 'phiq_norm_sq')} | {pair(row, 'phiq_norm_sq_median')} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# Which of the authors' Figure 1 observations hold, in how many seeds and epochs
# --------------------------------------------------------------------------------------

#: The two statistics each claim is judged on: ``statistic -> (J_proj, ||h||^2, ||phi(q)||^2)``
#: log columns without the split prefix. ``mean``: what the authors log and plot (means over
#: layers, heads and tokens; J_proj is the mean of ``|phi_i - ||h_i||^2|``). ``median``: the
#: medians over all tokens of the batch (:data:`kpca_repro.training.logs.TOKEN_STATS`), which no
#: single token dominates; J_proj's counterpart is the median of ``|phi_i - ||h_i||^2|``.
CLAIM_STATISTICS = {
    "mean": ("error", "h_norms_ave", "phiq_norms_ave"),
    "median": ("error_median", "h_norms_median", "phiq_norms_median"),
}
#: ``(claim, scope)`` in table order; scope ``every epoch``: counted over (seed, epoch) pairs;
#: ``last epoch``: over seeds, at their last epoch; ``whole run``: over seeds.
CLAIMS = (
    ("phiq_much_smaller_than_h", "every epoch"),
    ("phiq_much_smaller_than_h", "last epoch"),
    ("jproj_close_to_h", "every epoch"),
    ("jproj_close_to_h", "last epoch"),
    ("jproj_falls", "whole run"),
    ("jproj_falls_second_half", "whole run"),
)
#: Columns of ``results/training_claims.csv``.
CLAIMS_COLUMNS = (
    "model",
    "scale",
    "tokens",
    "split",
    "claim",
    "statistic",
    "scope",
    "holds",
    "total",
    "fraction",
    "n_seeds",
    "definition",
)


def claim_definitions(phiq_ratio_below: float, jproj_h_factor: float) -> dict[str, str]:
    """One sentence per claim of :data:`CLAIMS`, with the thresholds (``figure1.claims``).

    ``phi``, ``h`` and ``J`` are the statistic's ``||phi(q)||^2``, ``||h||^2`` and J_proj
    (:data:`CLAIM_STATISTICS`) on one fixed batch after one epoch.
    """
    return {
        "phiq_much_smaller_than_h": f"||phi(q)||^2 << ||h||^2: phi < {phiq_ratio_below:g} h",
        "jproj_close_to_h": (
            f"J_proj ≈ ||h||^2: h / {jproj_h_factor:g} < J < {jproj_h_factor:g} h, i.e. |log(J / h)| < log "
            f"{jproj_h_factor:g}"
        ),
        "jproj_falls": "J_proj falls: J at the last epoch < J at the first epoch drawn",
        "jproj_falls_second_half": (
            "J_proj falls in the second half: J at the last epoch < J at the middle epoch drawn (index n // 2 of "
            "the n epochs drawn)"
        ),
    }


def training_claims(
    runs: Sequence[tuple], skip_epochs: float = 0, phiq_ratio_below: float = 0.1, jproj_h_factor: float = 1.5
) -> "pd.DataFrame":
    """In how many (seed, epoch) pairs or seeds each of the authors' Figure 1 observations holds.

    The authors read three things off Figure 1 (docs/training.md): ``||phi(q)||^2 << ||h||^2``,
    J_proj follows ``||h||^2``, and J_proj falls during training. Each is judged, per run
    ``(model, scale)``, split (the fixed test and train batch) and statistic (the logged
    ``mean``, and the ``median`` over tokens, :data:`CLAIM_STATISTICS`), on the epochs Figure 1
    draws (``epoch >= skip_epochs``), by the definitions of :func:`claim_definitions`:

    * ``phiq_much_smaller_than_h`` and ``jproj_close_to_h``: at every (seed, epoch) pair
      (scope ``every epoch``), and at each seed's last epoch (scope ``last epoch``);
    * ``jproj_falls`` and ``jproj_falls_second_half``: once per seed (scope ``whole run``), for
      seeds with at least two epochs drawn.

    A value the claim compares that is NaN or infinite makes it not hold there (an overflowing
    ``||phi(q)||^2`` is not small). A statistic the logs lack (the medians of a log written
    before they were logged) gives ``total`` 0 and ``fraction`` NaN.

    Args:
        runs: ``(log_csv, model, scale, tokens, seed)`` per run and seed (4-tuple: seed 0).
        skip_epochs: the first epoch drawn (``figure1.skip_epochs_runs``).
        phiq_ratio_below, jproj_h_factor: the thresholds (``figure1.claims``), > 0 and > 1.

    Returns:
        Columns :data:`CLAIMS_COLUMNS`: ``holds`` of ``total`` pairs or seeds, ``fraction`` =
        holds / total, ``n_seeds``, and the ``definition`` in words. Rows in the order of the
        runs, then split (test, train), then :data:`CLAIMS`, then statistic (mean, median).

    Raises:
        ValueError: a threshold out of range, a log without rows, or a seed given twice.
    """
    import pandas as pd

    if not phiq_ratio_below > 0 or not jproj_h_factor > 1:
        raise ValueError(
            f"thresholds must be phiq_ratio_below > 0 and jproj_h_factor > 1, got {phiq_ratio_below} and "
            f"{jproj_h_factor}"
        )
    definitions = claim_definitions(phiq_ratio_below, jproj_h_factor)
    rows = []
    for (model, scale, tokens), logs in _read_seed_logs(runs).items():
        for split in ("test", "train"):
            counts = {}
            for statistic, names in CLAIM_STATISTICS.items():
                cols = [f"{split}_{n}" for n in names]
                for (claim, scope), count in _claim_counts(
                    logs.values(), cols, skip_epochs, phiq_ratio_below, jproj_h_factor
                ).items():
                    counts[(claim, scope, statistic)] = count
            for claim, scope in CLAIMS:
                for statistic in CLAIM_STATISTICS:
                    holds, total = counts[(claim, scope, statistic)]
                    row = {
                        "model": model,
                        "scale": scale,
                        "tokens": tokens,
                        "split": split,
                        "claim": claim,
                        "statistic": statistic,
                        "scope": scope,
                    }
                    row.update(
                        holds=holds,
                        total=total,
                        fraction=holds / total if total else float("nan"),
                        n_seeds=len(logs),
                        definition=definitions[claim],
                    )
                    rows.append(row)
    return pd.DataFrame(rows, columns=list(CLAIMS_COLUMNS))


def _claim_counts(
    logs: Iterable["pd.DataFrame"], cols: list[str], skip_epochs: float, phiq_ratio_below: float, jproj_h_factor: float
) -> dict[tuple[str, str], list[int]]:
    """``{(claim, scope): [holds, total]}`` over the seeds' ``logs`` of one run, for every
    :data:`CLAIMS` entry, judged on the columns ``cols`` = (J_proj, ``||h||^2``,
    ``||phi(q)||^2``) of one split and statistic, at epochs ``>= skip_epochs``
    (:func:`training_claims`). A log without those columns, or without an epoch drawn, counts
    nowhere."""
    import numpy as np

    counts = {(claim, scope): [0, 0] for claim, scope in CLAIMS}
    for log in logs:
        if not all(c in log.columns for c in cols):
            continue
        kept = log[log["epoch"] >= skip_epochs]
        if kept.empty:
            continue
        j, h, phi = (kept[c].to_numpy(float) for c in cols)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            # each claim needs only its own two values to be finite
            small = np.isfinite(phi) & np.isfinite(h) & (phi < phiq_ratio_below * h)
            close = np.isfinite(j) & np.isfinite(h) & (j > h / jproj_h_factor) & (j < h * jproj_h_factor)
        for claim, holds in (("phiq_much_smaller_than_h", small), ("jproj_close_to_h", close)):
            every, last = counts[(claim, "every epoch")], counts[(claim, "last epoch")]
            every[0], every[1] = every[0] + int(holds.sum()), every[1] + len(holds)
            last[0], last[1] = last[0] + int(holds[-1]), last[1] + 1
        if len(j) >= 2:
            for claim, ref in (("jproj_falls", j[0]), ("jproj_falls_second_half", j[len(j) // 2])):
                c = counts[(claim, "whole run")]
                c[0], c[1] = c[0] + int(bool(np.isfinite(j[-1]) and np.isfinite(ref) and j[-1] < ref)), c[1] + 1
    return counts


#: Short names of the claims in the Markdown table and Figure 1.
CLAIM_LABELS = {
    "phiq_much_smaller_than_h": "‖φ(q)‖² ≪ ‖h‖²",
    "jproj_close_to_h": "J_proj ≈ ‖h‖²",
    "jproj_falls": "J_proj falls",
    "jproj_falls_second_half": "J_proj falls (2nd half)",
}


def claim_cell(holds: int, total: int) -> str:
    """``"holds/total"`` with the percentage, or "not logged" when total is 0."""
    return "not logged" if total == 0 else f"{holds}/{total} ({100 * holds / total:.0f} %)"


def training_claims_markdown(claims: "pd.DataFrame", split: str = "test", names: dict[str, str] | None = None) -> str:
    """One split of :func:`training_claims` as a Markdown table: per run and claim, the mean
    and the median statistic side by side as ``holds/total (percent)``.

    Args:
        claims: :func:`training_claims`'s frame.
        split: ``test`` or ``train``.
        names: display names of the models (default: the keys).
    """
    names = names or {}
    lines = [
        "| model | scale | N | claim | counted over | mean (as logged) | median over tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    sub = claims[claims["split"] == split]
    for (model, scale, tokens, claim, scope), g in sub.groupby(
        ["model", "scale", "tokens", "claim", "scope"], sort=False
    ):
        cells = {r["statistic"]: claim_cell(int(r["holds"]), int(r["total"])) for _, r in g.iterrows()}
        over = (
            "(seed, epoch) pairs"
            if scope == "every epoch"
            else ("seeds, last epoch" if scope == "last epoch" else "seeds")
        )
        lines.append(
            f"| {names.get(model, model)} | {scale} | {tokens} | {CLAIM_LABELS[claim]} | {over} | "
            f"{cells.get('mean', '')} | {cells.get('median', '')} |"
        )
    return "\n".join(lines) + "\n"


def claims_note(claims: "pd.DataFrame", scale: str, split: str = "test", names: dict[str, str] | None = None) -> str:
    """The claims of one scale in a few lines, for Figure 1 under that scale's column.

    One line per model: ``<model>: <claim> <mean> | <median>; ...`` with ``holds/total`` of
    ``phiq_much_smaller_than_h`` and ``jproj_close_to_h`` over (seed, epoch) pairs and of
    ``jproj_falls`` over seeds ("–" where the statistic is not logged).

    Args:
        claims: :func:`training_claims`'s frame.
        scale: a scale of the frame.
        split: the fixed batch (``test`` or ``train``).
        names: display names of the models (default: the keys).

    Returns:
        The text, or "" when the frame has no row of ``scale``.
    """
    names = names or {}
    sub = claims[(claims["scale"] == scale) & (claims["split"] == split)]
    if sub.empty:
        return ""
    shown = (
        ("phiq_much_smaller_than_h", "every epoch"),
        ("jproj_close_to_h", "every epoch"),
        ("jproj_falls", "whole run"),
    )
    lines = [f"claims on the {split} batch, holding in (mean | median over tokens):"]
    for model in dict.fromkeys(sub["model"]):
        parts = []
        for claim, scope in shown:
            cells = []
            for statistic in CLAIM_STATISTICS:
                r = sub[
                    (sub["model"] == model)
                    & (sub["claim"] == claim)
                    & (sub["scope"] == scope)
                    & (sub["statistic"] == statistic)
                ]
                cells.append(
                    "–"
                    if r.empty or int(r["total"].iloc[0]) == 0
                    else f"{int(r['holds'].iloc[0])}/{int(r['total'].iloc[0])}"
                )
            parts.append(f"{CLAIM_LABELS[claim]} {cells[0]} | {cells[1]}")
        lines.append(f"{names.get(model, model)}: " + "; ".join(parts))
    return "\n".join(lines)
