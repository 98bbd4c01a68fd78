"""The training loop of Figures 1 and 4: timm's recipe, one logged row per epoch, exact resumption.

:func:`train_run` trains with timm's optimizer, scheduler, mixup and augmentation factories and
writes one row per epoch (:data:`~kpca_repro.training.logs.LOG_COLUMNS`): the
:func:`~kpca_repro.training.model.reconstruction_metrics` of two fixed batches, the "train"
batch, the third batch (index 2) of the first epoch's training loader, forwarded in **train
mode** (drop-path active), and the "test" batch, the first validation batch, forwarded in
**eval mode** (docs/method.md Section 6.1).

Resumption: after every epoch the checkpoint (:mod:`kpca_repro.training.checkpoint`) is written,
then the CSV is rewritten from the checkpoint's rows. Every epoch reseeds ``torch``, ``numpy``,
``random`` and the data sampler from ``(seed, epoch)``, so an interrupted run resumed from its
last checkpoint gives the same log, byte for byte, as an uninterrupted one on the same device
and thread count.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from kpca_repro.training.checkpoint import resumable_state, save_checkpoint
from kpca_repro.training.logs import LOG_COLUMNS, write_training_log
from kpca_repro.training.model import reconstruction_metrics

__all__ = ["train_run"]

log = logging.getLogger(__name__)


def _seed_epoch(seed: int, epoch: int) -> int:
    """Seed ``torch``, ``numpy`` and ``random`` for ``epoch`` of run ``seed``; the seed, for the sampler."""
    s = (seed * 1_000_003 + epoch) % (2**31)
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)
    return s


def _accuracy(logits: torch.Tensor, target: torch.Tensor, ks=(1, 5)) -> list[float]:
    """Correct predictions among the top k of ``logits`` ``(B, classes)``, per k (counts, not %)."""
    top = logits.topk(max(ks), dim=-1).indices
    hit = top == target[:, None]
    return [float(hit[:, : min(k, logits.shape[-1])].any(-1).float().sum()) for k in ks]


def train_run(
    model: nn.Module,
    train_set: torch.utils.data.Dataset,
    val_set: torch.utils.data.Dataset,
    scale: dict,
    log_csv: str | os.PathLike,
    checkpoint: str | os.PathLike,
    *,
    seed: int,
    device: torch.device,
    fingerprint: str,
    num_workers: int = 0,
    progress: bool = True,
    on_epoch_end: Callable[[int, dict], None] | None = None,
) -> pd.DataFrame:
    """Train ``model`` for ``scale["epochs"]`` epochs, logging one CSV row per epoch.

    Recipe (docs/method.md 6.1, DeiT defaults): ``timm.optim.create_optimizer_v2`` (``opt``,
    ``lr``, ``weight_decay``), ``timm.scheduler.create_scheduler_v2`` (``sched``,
    ``epochs``, ``warmup_epochs``, ``min_lr``; stepped per epoch), ``timm.data.Mixup``
    with ``timm.loss.SoftTargetCrossEntropy`` when ``mixup`` or ``cutmix`` > 0 (else cross
    entropy with ``smoothing``), optional ``timm.utils.ModelEmaV2`` (``model_ema``, not used
    for logging) and CUDA autocast (``amp``). Shuffled loader with ``drop_last``.

    After each epoch: :func:`~kpca_repro.training.model.reconstruction_metrics` on the fixed
    "train" batch (batch ``recon_batch_index`` of the first epoch, before mixup; train mode)
    and, after the validation pass (loss, top-1/top-5 accuracy in %), on the first validation
    batch (eval mode). The row (:data:`~kpca_repro.training.logs.LOG_COLUMNS`) is appended; the
    checkpoint is written atomically, then ``log_csv`` is rewritten atomically from the
    checkpoint's rows. A checkpoint with the same ``fingerprint`` is resumed; one with another
    fingerprint is ignored (a changed configuration starts afresh), and so is one
    :func:`~kpca_repro.training.checkpoint.load_checkpoint` refuses (a pickled object, a damaged
    file: a warning names it, training starts at epoch 0 and overwrites it).

    Args:
        model: from :func:`~kpca_repro.training.model.build_model`, on the CPU (moved to
            ``device`` here).
        train_set, val_set: datasets yielding ``(image (C, H, W) float32, label int)``.
        scale: one entry of ``training.scales`` in the configuration (its ``seeds`` list, if any, unused).
        log_csv: the tidy per-epoch log.
        checkpoint: the resumable state (kept after the run; not a Snakemake output).
        seed: every epoch reseeds ``torch``/``numpy``/``random`` and the sampler from (seed, epoch).
        fingerprint: :func:`~kpca_repro.training.checkpoint.config_fingerprint` of everything
            that defines the run.
        on_epoch_end: called as ``f(epoch, row)`` after the epoch's checkpoint and CSV are written.

    Returns:
        The log as a DataFrame.
    """
    log_csv, checkpoint = Path(log_csv), Path(checkpoint)
    epochs = scale["epochs"]
    model = model.to(device)
    recipe = _Recipe.build(model, scale, device)
    start, rows, fixed = _resume(checkpoint, fingerprint, model, recipe, epochs)
    if start > 0:
        write_training_log(rows, log_csv)  # drop any row written after the checkpoint

    generator = torch.Generator()
    loader = torch.utils.data.DataLoader(
        train_set,
        batch_size=scale["batch_size"],
        shuffle=True,
        drop_last=True,
        num_workers=num_workers,
        generator=generator,
    )
    val_loader = torch.utils.data.DataLoader(
        val_set, batch_size=scale["eval_batch_size"], shuffle=False, num_workers=num_workers
    )
    if len(loader) == 0:
        raise ValueError(f"{len(train_set)} training images make no batch of {scale['batch_size']} (drop_last)")
    recon_index = min(scale["recon_batch_index"], len(loader) - 1)

    for epoch in range(start, epochs):
        generator.manual_seed(_seed_epoch(seed, epoch))
        # the fixed "train" batch is taken from the first epoch's loader, before mixup
        keep = recon_index if epoch == 0 else None
        train_loss = _train_epoch(
            model, loader, recipe, device, fixed, keep, desc=f"epoch {epoch + 1}/{epochs}", progress=progress
        )
        row = {"epoch": epoch, "lr": recipe.optimizer.param_groups[0]["lr"], "train_loss": train_loss}
        row.update(
            {
                f"train_{k}": v
                for k, v in reconstruction_metrics(model, fixed["train"].to(device), train_mode=True).items()
            }
        )
        row.update(_evaluate(model, val_loader, device, fixed))
        row.update(
            {
                f"test_{k}": v
                for k, v in reconstruction_metrics(model, fixed["test"].to(device), train_mode=False).items()
            }
        )
        recipe.scheduler.step(epoch + 1)
        rows.append(row)
        _save_checkpoint(checkpoint, fingerprint, epoch + 1, rows, fixed, model, recipe)
        write_training_log(rows, log_csv)
        log.info(
            "epoch %d/%d: loss %.4f, acc1 %.2f, J_proj train %.4g test %.4g",
            epoch + 1,
            epochs,
            row["train_loss"],
            row["test_acc1"],
            row["train_error"],
            row["test_error"],
        )
        if on_epoch_end is not None:
            on_epoch_end(epoch, row)
    if start >= epochs:
        write_training_log(rows, log_csv)
    return pd.DataFrame(rows, columns=list(LOG_COLUMNS))


class _Recipe:
    """The training recipe of one run (docs/method.md 6.1): optimizer, per-epoch scheduler,
    Mixup/CutMix with its loss, AMP scaler and optional weight EMA, built from a scale."""

    def __init__(self, optimizer, scheduler, mixup, criterion, amp: bool, scaler, ema):
        self.optimizer, self.scheduler, self.mixup, self.criterion = optimizer, scheduler, mixup, criterion
        self.amp, self.scaler, self.ema = amp, scaler, ema

    @classmethod
    def build(cls, model: nn.Module, scale: dict, device: torch.device) -> "_Recipe":
        """timm's factories with the scale's settings (see :func:`train_run`)."""
        from timm.data import Mixup
        from timm.loss import SoftTargetCrossEntropy
        from timm.optim import create_optimizer_v2
        from timm.scheduler import create_scheduler_v2

        optimizer = create_optimizer_v2(model, opt=scale["opt"], lr=scale["lr"], weight_decay=scale["weight_decay"])
        scheduler, _ = create_scheduler_v2(
            optimizer,
            sched=scale["sched"],
            num_epochs=scale["epochs"],
            warmup_epochs=scale["warmup_epochs"],
            min_lr=scale["min_lr"],
            warmup_lr=scale["min_lr"],
        )
        use_mix = scale["mixup"] > 0 or scale["cutmix"] > 0
        mixup = (
            Mixup(
                mixup_alpha=scale["mixup"],
                cutmix_alpha=scale["cutmix"],
                label_smoothing=scale["smoothing"],
                num_classes=model.num_classes,
            )
            if use_mix
            else None
        )
        criterion = SoftTargetCrossEntropy() if use_mix else nn.CrossEntropyLoss(label_smoothing=scale["smoothing"])
        amp = bool(scale["amp"]) and device.type == "cuda"
        scaler = torch.amp.GradScaler("cuda", enabled=amp)
        ema = None
        if scale["model_ema"]:
            from timm.utils import ModelEmaV2

            ema = ModelEmaV2(model, decay=scale["model_ema_decay"])
        return cls(optimizer, scheduler, mixup, criterion, amp, scaler, ema)

    def state_dict(self) -> dict:
        """The states a checkpoint keeps: ``optimizer``, ``scheduler``, ``scaler`` and ``ema``
        (the EMA weights, None without EMA)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "ema": self.ema.module.state_dict() if self.ema is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Load the states of :meth:`state_dict` from a checkpoint's ``state``."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            self.ema.module.load_state_dict(state["ema"])


def _resume(
    checkpoint: Path, fingerprint: str, model: nn.Module, recipe: _Recipe, epochs: int
) -> tuple[int, list[dict], dict]:
    """``(first epoch to train, rows so far, fixed batches)`` from a checkpoint of the same
    fingerprint (its model and recipe states loaded), else ``(0, [], {})``: no checkpoint, one
    of another fingerprint or one not trusted (:func:`~kpca_repro.training.checkpoint.resumable_state`)."""
    state = resumable_state(checkpoint, fingerprint)
    if state is None:
        return 0, [], {}
    model.load_state_dict(state["model"])
    recipe.load_state_dict(state)
    log.info("resuming %s after epoch %d of %d", checkpoint, state["epoch"], epochs)
    return state["epoch"], state["rows"], state["fixed"]


def _train_epoch(
    model: nn.Module,
    loader,
    recipe: _Recipe,
    device: torch.device,
    fixed: dict,
    keep: int | None,
    desc: str,
    progress: bool,
) -> float:
    """One pass over ``loader`` in train mode; the mean training loss (per image).

    ``fixed["train"]`` becomes a copy of batch ``keep`` (before mixup) when ``keep`` is not None.
    """
    from kpca_repro.progress import progress as progress_bar

    model.train()
    total, count = 0.0, 0
    for i, (x, y) in enumerate(progress_bar(loader, desc=desc, disable=not progress, leave=False)):
        x, y = x.to(device), y.to(device)
        if i == keep:
            fixed["train"] = x.detach().cpu().clone()
        if recipe.mixup is not None:
            x, y = recipe.mixup(x, y)
        with torch.autocast(device_type=device.type, enabled=recipe.amp):
            loss = recipe.criterion(model(x), y)
        recipe.optimizer.zero_grad(set_to_none=True)
        recipe.scaler.scale(loss).backward()
        recipe.scaler.step(recipe.optimizer)
        recipe.scaler.update()
        if recipe.ema is not None:
            recipe.ema.update(model)
        total += float(loss.detach()) * x.shape[0]
        count += x.shape[0]
    return total / count


def _evaluate(model: nn.Module, val_loader, device: torch.device, fixed: dict) -> dict:
    """Validation loss and top-1/top-5 accuracy (%) in eval mode; ``fixed["test"]`` becomes
    the first validation batch if it is not set yet."""
    model.eval()
    vloss, n, c1, c5 = 0.0, 0, 0.0, 0.0
    with torch.no_grad():
        for i, (x, y) in enumerate(val_loader):
            if "test" not in fixed and i == 0:
                fixed["test"] = x.clone()
            x, y = x.to(device), y.to(device)
            logits = model(x)
            vloss += float(F.cross_entropy(logits, y, reduction="sum"))
            a1, a5 = _accuracy(logits, y)
            c1, c5, n = c1 + a1, c5 + a5, n + x.shape[0]
    return {"test_loss": vloss / n, "test_acc1": 100.0 * c1 / n, "test_acc5": 100.0 * c5 / n}


def _save_checkpoint(
    checkpoint: Path, fingerprint: str, epoch: int, rows: list[dict], fixed: dict, model: nn.Module, recipe: _Recipe
) -> None:
    """Everything :func:`_resume` needs after ``epoch`` completed epochs
    (:func:`~kpca_repro.training.checkpoint.save_checkpoint`)."""
    state = {
        "fingerprint": fingerprint,
        "epoch": epoch,
        "rows": rows,
        "fixed": fixed,
        "model": model.state_dict(),
        **recipe.state_dict(),
    }
    save_checkpoint(checkpoint, state)
