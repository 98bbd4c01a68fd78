"""The training logs of Figures 1 and 4: the columns of this pipeline's ``log.csv``, and the
readers of it and of the authors' W&B exports, as one tidy frame.

One row per epoch (:data:`LOG_COLUMNS`): the authors' :data:`RECON_METRICS` of the fixed train and
test batch, and beside them :data:`TOKEN_STATS`, not in the authors' logs. The W&B CSV exports of
the authors' runs are read by :func:`read_wandb_logs` (docs/method.md Section 6.2), this
pipeline's logs by :func:`read_training_log`; both give the same tidy frame
(:func:`training_curves`), which :mod:`kpca_repro.training.figures` plots. This module needs no
torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from kpca_repro.h5io import atomic_output

__all__ = [
    "RECON_METRICS",
    "TOKEN_STATS",
    "HIGH_QUANTILE",
    "BASE_LOG_COLUMNS",
    "LOG_COLUMNS",
    "WANDB_STEPS_PER_EPOCH",
    "WANDB_SEED",
    "WANDB_FILES",
    "write_training_log",
    "read_training_log",
    "read_wandb_logs",
    "training_curves",
]

#: The five per-batch quantities the training code logs, under their W&B names (docs/method.md 6.1).
RECON_METRICS = ("error", "rel_error_wrt_h", "rel_error_wrt_phiq", "h_norms_ave", "phiq_norms_ave")
#: The high quantile over tokens logged beside the median (``*_q99``).
HIGH_QUANTILE = 0.99
#: Per-batch statistics over all (layer, image, head, token) of the batch, pooled, that no single
#: token dominates (the means of :data:`RECON_METRICS` can be carried by a few tokens with a tiny
#: normaliser, docs/training.md): the median and the :data:`HIGH_QUANTILE` quantile (numpy's
#: linear interpolation) of ``|phi_i - ||h_i||^2|`` (``error_*``), ``||h_i||^2`` and
#: ``||phi(q_i)||^2``, and the share of tokens with ``||phi(q_i)||^2 > ||h_i||^2``. Not in the
#: authors' logs.
TOKEN_STATS = (
    "error_median",
    "error_q99",
    "h_norms_median",
    "h_norms_q99",
    "phiq_norms_median",
    "phiq_norms_q99",
    "phiq_above_h_frac",
)
#: The columns every training log has, also those written before :data:`TOKEN_STATS` were logged.
BASE_LOG_COLUMNS = (
    "epoch",
    "lr",
    "train_loss",
    *(f"train_{m}" for m in RECON_METRICS),
    "test_loss",
    "test_acc1",
    "test_acc5",
    *(f"test_{m}" for m in RECON_METRICS),
)
#: Columns of ``results/training/<model>_<scale>/seed<seed>/log.csv``, one row per epoch
#: (0-based, as W&B's rows): :data:`BASE_LOG_COLUMNS`, then the :data:`TOKEN_STATS` of the train
#: and the test batch (appended, so an older log is a prefix of the columns).
LOG_COLUMNS = (*BASE_LOG_COLUMNS, *(f"{split}_{m}" for split in ("train", "test") for m in TOKEN_STATS))
#: W&B steps per epoch in the authors' runs up to epoch ~118-122 (docs/method.md 6.2); x = Step / 15.
WANDB_STEPS_PER_EPOCH = 15
#: The seed of the authors' one logged run per model (their recipe's ``seed 0``, docs/method.md 6.1).
WANDB_SEED = 0


def write_training_log(rows: list[dict], path: str | os.PathLike) -> None:
    """Write the rows so far as ``log.csv`` (:data:`LOG_COLUMNS`), atomically.

    Values as ``%.9g`` (9 significant digits, enough for a float32 to round-trip), so the same
    rows give the same bytes.
    """
    with atomic_output(path) as tmp:
        pd.DataFrame(rows, columns=list(LOG_COLUMNS)).to_csv(tmp, index=False, float_format="%.9g")


_TIDY = ["source", "model", "seed", "split", "metric", "epoch", "x", "step", "value"]


def read_training_log(path: str | os.PathLike, model: str, source: str, seed: int = 0) -> pd.DataFrame:
    """This pipeline's ``log.csv`` as a tidy frame.

    A log written before the :data:`TOKEN_STATS` were logged (only :data:`BASE_LOG_COLUMNS`) is
    read too: its rows hold the :data:`RECON_METRICS` alone, and a reader finds no median.

    Args:
        path: a ``results/training/<model>_<scale>/seed<seed>/log.csv``.
        model, source: the run's architecture and the figure column it belongs to.
        seed: the run's seed (kept in the ``seed`` column).

    Returns:
        Columns ``source, model, seed, split (train|test), metric (one of RECON_METRICS, then
        those of TOKEN_STATS in the log), epoch, x (= epoch), step (NaN), value``.

    Raises:
        ValueError: a column of :data:`BASE_LOG_COLUMNS` is missing; the message names the file.
    """
    df = pd.read_csv(path)
    missing = [c for c in BASE_LOG_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: not a training log, columns {missing} missing")
    parts = []
    for split in ("train", "test"):
        for m in (*RECON_METRICS, *TOKEN_STATS):
            if f"{split}_{m}" not in df.columns:
                continue
            epoch = df["epoch"]
            parts.append(
                pd.DataFrame(
                    {
                        "source": source,
                        "model": model,
                        "seed": int(seed),
                        "split": split,
                        "metric": m,
                        "epoch": epoch,
                        "x": epoch.astype(float),
                        "step": np.nan,
                        "value": df[f"{split}_{m}"],
                    }
                )
            )
    return pd.concat(parts, ignore_index=True)[_TIDY]


_WANDB_VALUE = re.compile(r"^(?P<run>.+) - (?P<split>train|test)_(?P<metric>.+)$")


def read_wandb_logs(
    directory: str | os.PathLike, source: str = "authors (W&B)", epoch_axis: str = "step"
) -> pd.DataFrame:
    """The authors' W&B CSV exports (docs/method.md 6.2) as a tidy frame.

    Every ``*.csv`` below ``directory`` has a ``"Step"`` column and ``"<run> - <split>_<metric>"``
    (plus ``__MIN``/``__MAX`` copies, ignored). The model is the file's folder relative to
    ``directory`` (``vit_tiny``, ``deit_tiny``), or the run name for files at the top. One row
    per epoch: after sorting by step, row ``r`` is epoch ``r``. The x-axis:

    * ``epoch_axis="step"``: ``x = Step / 15`` as the authors plot it (15 W&B steps per epoch
      until epoch ~118-122, then 16-17, so x drifts up to ~1.7 epochs above the epoch);
    * ``epoch_axis="row"``: ``x = epoch`` (the row index).

    Returns:
        Columns ``source, model, seed (:data:`WANDB_SEED`), split, metric, epoch, x, step,
        value``; metrics named as in :data:`RECON_METRICS` (the authors log means only).

    Raises:
        FileNotFoundError: no CSV below ``directory``.
        ValueError: a file without ``Step`` or a ``"<run> - <split>_<metric>"`` column (named),
            or an unknown ``epoch_axis``.
    """
    if epoch_axis not in ("step", "row"):
        raise ValueError(f"epoch_axis must be 'step' or 'row', got {epoch_axis!r}")
    root = Path(directory)
    files = sorted(root.rglob("*.csv"))
    if not files:
        raise FileNotFoundError(f"no W&B CSV exports below {root}")
    parts = []
    for f in files:
        df = pd.read_csv(f)
        cols = [c for c in df.columns if not c.endswith(("__MIN", "__MAX"))]
        value_cols = [c for c in cols if _WANDB_VALUE.match(c)]
        if "Step" not in df.columns or len(value_cols) != 1:
            raise ValueError(
                f"{f}: expected a 'Step' column and one '<run> - <split>_<metric>' column, got {list(df.columns)}"
            )
        match = _WANDB_VALUE.match(value_cols[0])
        metric = match["metric"]
        if metric not in RECON_METRICS:
            raise ValueError(f"{f}: unknown metric {match['split']}_{metric!r}; expected one of {RECON_METRICS}")
        rel = f.parent.relative_to(root)
        model = str(rel) if str(rel) != "." else match["run"]
        df = df[["Step", value_cols[0]]].dropna().sort_values("Step").reset_index(drop=True)
        epoch = np.arange(len(df))
        x = df["Step"].to_numpy(float) / WANDB_STEPS_PER_EPOCH if epoch_axis == "step" else epoch.astype(float)
        parts.append(
            pd.DataFrame(
                {
                    "source": source,
                    "model": model,
                    "seed": WANDB_SEED,
                    "split": match["split"],
                    "metric": metric,
                    "epoch": epoch,
                    "x": x,
                    "step": df["Step"].to_numpy(float),
                    "value": df[value_cols[0]].to_numpy(float),
                }
            )
        )
    return pd.concat(parts, ignore_index=True)[_TIDY]


def training_curves(
    runs: Sequence[tuple],
    reference_dir: str | os.PathLike | None,
    epoch_axis: str = "step",
    reference_source: str = "authors (W&B, ImageNet-1k)",
) -> pd.DataFrame:
    """The tidy curves of Figures 1 and 4 from any set of runs.

    Args:
        runs: ``(log.csv, model, source, seed)`` of this pipeline's runs (:func:`read_training_log`);
            the runs of one ``(source, model)`` with different seeds are the seeds of one curve.
            A 3-tuple ``(log.csv, model, source)`` is seed 0.
        reference_dir: the authors' W&B exports (:func:`read_wandb_logs`), or None.
        epoch_axis: the reference's x-axis, ``"step"`` (Step/15) or ``"row"``.

    Returns:
        The concatenated tidy frame, reference first.

    Raises:
        ValueError: no runs and no reference.
    """
    parts = [read_wandb_logs(reference_dir, reference_source, epoch_axis)] if reference_dir is not None else []
    parts += [read_training_log(*run) for run in runs]
    if not parts:
        raise ValueError("no runs and no reference logs to plot")
    return pd.concat(parts, ignore_index=True)


#: The authors' W&B exports (``scripts/wandb_data`` of KarahanS/Reproduction-Study-KPCA), per model folder.
WANDB_FILES = {
    model: [
        f"{prefix}_{split}_{m}.csv"
        for split in ("train", "test")
        for m in ("error", "h", "varphi", "rel_error_wrt_h", "rel_error_wrt_varphi")
    ]
    for model, prefix in (("vit_tiny", "vit"), ("deit_tiny", "deit"))
}
