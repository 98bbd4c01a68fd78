"""What each training run of Figures 1 and 4 was, and the token-count ablation table.

docs/training.md explains why this pipeline's CPU-scale runs and the authors' ImageNet runs
differ. The first suspect is the number of tokens N: with per-token standardized q and k,
``||phi(q_i)||^2 = exp(s ||q_i||^2) / g(q_i)^2`` where ``g(q_i) = sum_j exp(s q_i.k_j)`` sums over
the N keys, so fewer tokens mean a smaller ``g`` and a larger ``||phi(q)||^2`` before any
learning (docs/method.md Section 6.1). The ablation trains the same model at the same
settings with N in {17, 50, 197} (``training.scales`` ``medium-n17``, ``medium-n50``,
``medium``) and tabulates J_proj, ``||h||^2`` and ``||phi(q)||^2`` at the first and the last
epoch (:func:`token_ablation_table`).

This module reads finished logs only (no torch); it is not an input of the training jobs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas is imported where a table is built: the workflow imports this module at parse time
    import pandas as pd

__all__ = ["AUTHORS_SETTING", "scale_tokens", "scale_setting", "ABLATION_COLUMNS", "token_ablation_table", "token_ablation_markdown"]

#: The setting of the authors' logged runs (docs/method.md 6.1), as :func:`scale_setting` words it.
AUTHORS_SETTING = "ImageNet-1k, 224x224 in 16x16 patches: 197 tokens, 12 blocks, 300 epochs"

_DATASETS = {"fashion_mnist": "Fashion-MNIST", "imagenet": "ImageNet-1k"}


def scale_tokens(scale: dict) -> int:
    """Tokens per image of a training scale: ``(img_size / patch_size)^2`` patches + the class token.

    Args:
        scale: one resolved entry of ``training.scales`` (:func:`kpca_repro.config_checks.resolve_scales`).

    Returns:
        N, e.g. 197 for 224x224 images in 16x16 patches or 28x28 images in 2x2 patches.

    Raises:
        ValueError: ``patch_size`` does not divide ``img_size``.
    """
    size, patch = scale["img_size"], scale["patch_size"]
    if size % patch:
        raise ValueError(f"patch_size {patch} does not divide img_size {size}")
    return (size // patch) ** 2 + 1


def scale_setting(scale: dict) -> str:
    """One line saying what a run at this scale trains on, for figure titles and tables.

    Example: ``"Fashion-MNIST, 3072 images, 28x28 in 2x2 patches: 197 tokens, 6 blocks, 10 epochs"``
    (``depth: null`` reads "12 blocks", the tiny models' depth; ``n_train: null`` "all images").
    """
    images = "all images" if scale["n_train"] is None else f"{scale['n_train']} images"
    depth = 12 if scale["depth"] is None else scale["depth"]
    size, patch = scale["img_size"], scale["patch_size"]
    return f"{_DATASETS.get(scale['dataset'], scale['dataset'])}, {images}, {size}x{size} in {patch}x{patch} patches: {scale_tokens(scale)} tokens, {depth} blocks, {scale['epochs']} epochs"


#: Columns of ``results/token_ablation.csv``; ``*_first`` / ``*_last`` are the first and the last
#: logged epoch, on the fixed batch of ``split`` (train: a training batch in train mode; test:
#: the first validation batch in eval mode), averaged over layers, heads and tokens.
ABLATION_COLUMNS = (
    "model",
    "scale",
    "tokens",
    "split",
    "epochs",
    "train_loss_first",
    "train_loss_last",
    "test_acc1_last",
    "j_proj_first",
    "j_proj_last",
    "h_norm_sq_first",
    "h_norm_sq_last",
    "phiq_norm_sq_first",
    "phiq_norm_sq_last",
)


def token_ablation_table(runs: Sequence[tuple[str | os.PathLike, str, str, int]]) -> "pd.DataFrame":
    """J_proj, ``||h||^2`` and ``||phi(q)||^2`` at the first and last epoch of each run.

    Args:
        runs: ``(log_csv, model, scale, tokens)`` per run; ``log_csv`` is a
            ``results/training/<model>_<scale>/log.csv`` (columns
            :data:`kpca_repro.training.LOG_COLUMNS`, one row per epoch).

    Returns:
        One row per run and split (train, test), columns :data:`ABLATION_COLUMNS`, sorted by
        model, tokens, number of epochs and split. Values are the logged float64 numbers; J_proj is the logged
        ``error`` (the mean of ``|phi_i - ||h_i||^2|``), the norms ``h_norms_ave`` and
        ``phiq_norms_ave`` (docs/method.md 6.1).

    Raises:
        ValueError: a log has no rows.
    """
    import pandas as pd

    rows = []
    for path, model, scale, tokens in runs:
        log = pd.read_csv(path).sort_values("epoch")
        if log.empty:
            raise ValueError(f"{path}: the training log has no epochs")
        first, last = log.iloc[0], log.iloc[-1]
        for split in ("train", "test"):
            rows.append(
                {
                    "model": model,
                    "scale": scale,
                    "tokens": int(tokens),
                    "split": split,
                    "epochs": len(log),
                    "train_loss_first": first["train_loss"],
                    "train_loss_last": last["train_loss"],
                    "test_acc1_last": last["test_acc1"],
                    **{
                        f"{name}_{when}": row[f"{split}_{column}"]
                        for name, column in (("j_proj", "error"), ("h_norm_sq", "h_norms_ave"), ("phiq_norm_sq", "phiq_norms_ave"))
                        for when, row in (("first", first), ("last", last))
                    },
                }
            )
    table = pd.DataFrame(rows, columns=list(ABLATION_COLUMNS))
    return table.sort_values(["model", "tokens", "epochs", "split"], kind="stable").reset_index(drop=True)


def token_ablation_markdown(table: "pd.DataFrame", split: str = "test", names: dict[str, str] | None = None) -> str:
    """The ablation for one split as a Markdown table (README): first -> last epoch per quantity.

    Args:
        table: :func:`token_ablation_table`'s frame.
        split: which fixed batch (``test`` or ``train``).
        names: display names of the models (default: the keys).
    """
    names = names or {}

    def pair(row, name: str) -> str:
        return f"{row[f'{name}_first']:.3g} → {row[f'{name}_last']:.3g}"

    lines = [
        "| model | N | epochs | train loss | test acc@1 (last) | J_proj | ‖h‖² | ‖φ(q)‖² |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, row in table[table["split"] == split].iterrows():
        lines.append(
            f"| {names.get(row['model'], row['model'])} | {row['tokens']} | {row['epochs']} | {row['train_loss_first']:.3f} → {row['train_loss_last']:.3f} | "
            f"{row['test_acc1_last']:.1f} % | {pair(row, 'j_proj')} | {pair(row, 'h_norm_sq')} | {pair(row, 'phiq_norm_sq')} |"
        )
    return "\n".join(lines) + "\n"
