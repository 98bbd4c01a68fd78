"""Training a vision transformer from scratch while logging the projection loss (Figures 1, 4).

docs/method.md Section 6.1: the authors train ViT-Tiny (3 heads, d = 64) and "DeiT-Tiny" (the same
network with 6 heads, d = 32) from scratch. Their attention standardizes q and k per token
(unbiased std, no epsilon) before ``softmax(s q k^T)``. After every epoch they forward two
fixed batches with ``reconstruct=True`` and log, averaged over layers,

* ``error`` = J_proj, the mean over (image, head, token) of ``|phi_i - ||h_i||^2|``,
* ``rel_error_wrt_h``, ``rel_error_wrt_phiq``, ``h_norms_ave``, ``phiq_norms_ave``,

with ``phi_i = exp(s q_i.q_i) / (sum_j exp(s q_i.k_j))^2`` in plain float32 ``exp``
(:func:`kpca_repro.projection.feature_norm_sq` with ``log_domain=False``). The "train" batch is the
third batch (index 2) of the first epoch's training loader, forwarded in **train mode**
(drop-path active); the "test" batch is the first validation batch, forwarded in **eval
mode**.

This module builds the models with timm (:class:`RecordingAttention` replaces
``blocks[l].attn``), loads Fashion-MNIST (the ``small`` scale) or an ImageNet root (the
``paper`` scale), trains with timm's optimizer, scheduler, mixup and augmentation factories,
and writes one CSV row per epoch. Beside the authors' means, each row holds statistics that
no single token dominates (:data:`TOKEN_STATS`: the median and the 0.99 quantile over tokens of
``||phi(q)||^2``, ``||h||^2`` and ``|phi - ||h||^2|``, and the share of tokens with
``||phi(q)||^2 > ||h||^2``), computed from the same forward pass, so they cost no extra random
draw and leave the other columns unchanged.

Resumption: after every epoch a checkpoint (model, optimizer, scheduler, AMP scaler, EMA, the
fixed batches, the rows so far) is written atomically, then the CSV is rewritten from the
checkpoint's rows. The checkpoint holds only tensors and plain values (dict, list, tuple, str,
int, float, bool, None) and is read with ``torch.load(..., weights_only=True)``, which runs no
code: one that carries any other pickled object is refused (:class:`UntrustedCheckpointError`)
and the run starts afresh (:func:`load_checkpoint`). Every epoch reseeds ``torch``, ``numpy``,
``random`` and the data sampler from ``(seed, epoch)``, so an interrupted run resumed from its
last checkpoint gives the same log, byte for byte, as an uninterrupted one on the same device
and thread count.

The W&B CSV exports of the authors' runs are read by :func:`read_wandb_logs` (docs/method.md
Section 6.2), this pipeline's logs by :func:`read_training_log`; both give the same tidy
frame, which :mod:`kpca_repro.figures.plots` plots.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import math
import os
import random
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from kpca_repro.h5io import atomic_output
from kpca_repro.projection import feature_norm_sq, output_norm_sq, projection_errors, standardize_tokens

__all__ = [
    "RECON_METRICS",
    "TOKEN_STATS",
    "HIGH_QUANTILE",
    "BASE_LOG_COLUMNS",
    "LOG_COLUMNS",
    "FASHION_MNIST_FILES",
    "WANDB_STEPS_PER_EPOCH",
    "RecordingAttention",
    "build_model",
    "recording_attentions",
    "reconstruction_metrics",
    "FashionMNISTGz",
    "read_idx",
    "build_datasets",
    "train_run",
    "config_fingerprint",
    "UntrustedCheckpointError",
    "load_checkpoint",
    "save_checkpoint",
    "read_training_log",
    "read_wandb_logs",
    "training_curves",
    "WANDB_FILES",
]

log = logging.getLogger(__name__)

#: The five per-batch quantities the training code logs, under their W&B names (docs/method.md 6.1).
RECON_METRICS = ("error", "rel_error_wrt_h", "rel_error_wrt_phiq", "h_norms_ave", "phiq_norms_ave")
_FROM_KPCA = {"error": "error", "rel_error_wrt_h": "rel_error_wrt_h", "rel_error_wrt_phiq": "rel_error_wrt_phiq", "h_norms_ave": "h_ave", "phiq_norms_ave": "phi_ave"}
#: The high quantile over tokens logged beside the median (``*_q99``).
HIGH_QUANTILE = 0.99
#: Per-batch statistics over all (layer, image, head, token) of the batch, pooled, that no single
#: token dominates (the means of :data:`RECON_METRICS` can be carried by a few tokens with a tiny
#: normaliser, docs/training.md): the median and the :data:`HIGH_QUANTILE` quantile (numpy's
#: linear interpolation) of ``|phi_i - ||h_i||^2|`` (``error_*``), ``||h_i||^2`` and
#: ``||phi(q_i)||^2``, and the share of tokens with ``||phi(q_i)||^2 > ||h_i||^2``. Not in the
#: authors' logs.
TOKEN_STATS = ("error_median", "error_q99", "h_norms_median", "h_norms_q99", "phiq_norms_median", "phiq_norms_q99", "phiq_above_h_frac")
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
#: The IDX files of Fashion-MNIST in ``<resources>/datasets/fashion-mnist/``.
FASHION_MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
#: W&B steps per epoch in the authors' runs up to epoch ~118-122 (docs/method.md 6.2); x = Step / 15.
WANDB_STEPS_PER_EPOCH = 15
#: The seed of the authors' one logged run per model (their recipe's ``seed 0``, docs/method.md 6.1).
WANDB_SEED = 0
#: Fashion-MNIST pixel statistics (training set, pixels scaled to [0, 1]).
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530


# --------------------------------------------------------------------------------------
# Models: timm's VisionTransformer with a recording, optionally standardizing attention
# --------------------------------------------------------------------------------------


def _timm_attention():
    from timm.models.vision_transformer import Attention

    return Attention


class RecordingAttention(_timm_attention()):
    """timm's ``Attention`` with optional per-token q/k standardization and recording.

    The forward pass is timm's (fused qkv Linear, ``softmax(s q k^T) v``, output projection),
    except that with ``standardize_qk`` the per-head q and k are first standardized per token
    over their ``d`` features with the unbiased std and no epsilon
    (:func:`kpca_repro.projection.standardize_tokens` with ``eps=0``; the authors'
    ``Reconstruction/softmax.py``, docs/method.md 6.1). With ``record = True`` the forward keeps
    ``recorded = {"q", "k", "h"}``: the q and k entering the softmax and the per-head output
    ``h`` before the projection, each ``(B, H, N, d)`` float32, detached.

    Build it with :meth:`from_timm`, which copies a timm ``Attention``'s weights.
    """

    standardize_qk: bool = False
    record: bool = False

    @classmethod
    def from_timm(cls, attn: nn.Module, standardize_qk: bool) -> "RecordingAttention":
        """A copy of timm ``Attention`` ``attn`` (same weights, dropout rates) as this class.

        Raises:
            TypeError: ``attn`` normalises q/k or the head outputs, or is gated (the recorded
                ``h`` would not be the attention output).
        """
        if not isinstance(attn.q_norm, nn.Identity) or not isinstance(attn.k_norm, nn.Identity) or not isinstance(attn.norm, nn.Identity) or attn.gate is not None:
            raise TypeError("RecordingAttention supports timm Attention without qk_norm, scale_norm or gating")
        new = cls(
            attn.qkv.in_features,
            num_heads=attn.num_heads,
            qkv_bias=attn.qkv.bias is not None,
            proj_bias=attn.proj.bias is not None,
            attn_drop=attn.attn_drop.p,
            proj_drop=attn.proj_drop.p,
        )
        new.load_state_dict(attn.state_dict(), strict=True)
        new.standardize_qk = standardize_qk
        new.recorded = {}
        return new

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        """``(B, N, C) -> (B, N, C)``; see the class docstring."""
        if attn_mask is not None or is_causal:
            raise NotImplementedError("RecordingAttention is for full (unmasked) vision attention")
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.standardize_qk:
            q, k = standardize_tokens(q, eps=0.0), standardize_tokens(k, eps=0.0)
        h = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0, scale=self.scale)
        if self.record:
            self.recorded = {"q": q.detach().float(), "k": k.detach().float(), "h": h.detach().float()}
        x = h.transpose(1, 2).reshape(b, n, self.attn_dim)
        return self.proj_drop(self.proj(x))


def build_model(
    timm_id: str,
    *,
    num_heads: int,
    standardize_qk: bool,
    num_classes: int,
    img_size: int,
    patch_size: int,
    in_chans: int,
    drop_path: float = 0.0,
    depth: int | None = None,
    embed_dim: int | None = None,
) -> nn.Module:
    """A randomly initialised timm VisionTransformer with :class:`RecordingAttention` blocks.

    ``timm.create_model(timm_id, pretrained=False, num_heads=..., ...)`` (docs/method.md 6.1: the
    authors' "DeiT-Tiny" is ``deit_tiny_patch16_224`` with 6 heads; ViT-Tiny keeps 3), then
    ``blocks[l].attn`` is replaced by :meth:`RecordingAttention.from_timm` (same initial
    weights). ``depth``/``embed_dim`` None keep timm's values (12 and 192 for the tiny models).

    Returns:
        The model, float32, on the CPU, in train mode.

    Raises:
        ValueError: ``img_size`` is not a multiple of ``patch_size``.
    """
    import timm

    kwargs = dict(pretrained=False, num_heads=num_heads, num_classes=num_classes, img_size=img_size, patch_size=patch_size, in_chans=in_chans, drop_path_rate=drop_path)
    if depth is not None:
        kwargs["depth"] = depth
    if embed_dim is not None:
        kwargs["embed_dim"] = embed_dim
    if img_size % patch_size:
        raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
    model = timm.create_model(timm_id, **kwargs)
    for blk in model.blocks:
        blk.attn = RecordingAttention.from_timm(blk.attn, standardize_qk)
    return model.float().train()


def recording_attentions(model: nn.Module) -> list[RecordingAttention]:
    """``blocks[l].attn`` of every block, in depth order.

    Raises:
        TypeError: a block's attention is not a :class:`RecordingAttention` (use :func:`build_model`).
    """
    attns = [blk.attn for blk in model.blocks]
    if not all(isinstance(a, RecordingAttention) for a in attns):
        raise TypeError("the model's blocks[*].attn are not RecordingAttention; build it with kpca_repro.training.train.build_model")
    return attns


@torch.no_grad()
def reconstruction_metrics(model: nn.Module, images: torch.Tensor, train_mode: bool) -> dict[str, float]:
    """The logged quantities of one fixed batch (docs/method.md 6.1), means and token statistics.

    One forward pass with every :class:`RecordingAttention` recording; per layer, over all
    (image, head, token): ``phi = ||phi(q_i)||^2`` by :func:`kpca_repro.projection.feature_norm_sq`
    (``log_domain=False``: plain ``exp`` in float32, as the training code; NaN/inf where it
    overflows), ``||h_i||^2`` by :func:`kpca_repro.projection.output_norm_sq`, then
    :func:`kpca_repro.projection.projection_errors`; the model-level value of each of
    :data:`RECON_METRICS` is the unweighted mean over layers (``np.average`` in the reference).
    The :data:`TOKEN_STATS` are taken over the values of all layers pooled (every layer has
    the same number of tokens, so the pooled mean would equal the logged one): float64
    ``np.quantile`` (linear interpolation) at 0.5 and :data:`HIGH_QUANTILE`, NaN if any value
    is NaN, as the mean. They reuse the recorded tensors, so no random number is drawn beyond
    the forward pass. The model's train/eval mode is restored.

    Args:
        model: from :func:`build_model`.
        images: ``(B, C, H, W)`` float32, on the model's device.
        train_mode: forward in train mode (the "train" batch: drop-path active) or eval mode.

    Returns:
        ``{name: float}`` for the names in :data:`RECON_METRICS` and :data:`TOKEN_STATS`.
    """
    attns = recording_attentions(model)
    was_training = model.training
    model.train(train_mode)
    for a in attns:
        a.record = True
    try:
        model(images)
    finally:
        for a in attns:
            a.record = False
        model.train(was_training)
    per_layer = {m: [] for m in RECON_METRICS}
    phis, hs = [], []
    for a in attns:
        rec = a.recorded
        phi = feature_norm_sq(rec["q"], rec["k"], scale=a.scale, log_domain=False)
        h_sq = output_norm_sq(rec["h"])
        errs = projection_errors(phi, h_sq)
        for m in RECON_METRICS:
            per_layer[m].append(float(errs[_FROM_KPCA[m]]))
        phis.append(phi.flatten().cpu())
        hs.append(h_sq.flatten().cpu())
        a.recorded = {}
    out = {m: float(np.average(v)) for m, v in per_layer.items()}
    out.update(_token_stats(torch.cat(phis).double().numpy(), torch.cat(hs).double().numpy()))
    return out


def _token_stats(phi: np.ndarray, h_sq: np.ndarray) -> dict[str, float]:
    """:data:`TOKEN_STATS` of pooled per-token ``phi`` and ``||h||^2`` (1-D float64, same length)."""
    levels = [0.5, HIGH_QUANTILE]
    out = {}
    for name, values in (("error", np.abs(phi - h_sq)), ("h_norms", h_sq), ("phiq_norms", phi)):
        # np.quantile returns NaN when a value is NaN (as the mean); inf sorts last
        median, high = np.quantile(values, levels)
        out[f"{name}_median"], out[f"{name}_q99"] = float(median), float(high)
    out["phiq_above_h_frac"] = float(np.mean(phi > h_sq))
    return out


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX array (``.gz`` or plain) as numpy, e.g. ``(60000, 28, 28)`` uint8 images.

    The IDX header: two zero bytes, a type code (0x08 = uint8), the number of dimensions,
    then one big-endian int32 per dimension. torchvision's own reader opens only
    uncompressed files, hence this one.

    Raises:
        ValueError: not an IDX file of unsigned bytes, or truncated; the message names it.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    nd = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(nd))
    offset = 4 + 4 * nd
    if len(data) - offset != math.prod(shape):
        raise ValueError(f"{path}: IDX header says {shape}, but {len(data) - offset} bytes follow")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(shape)


def _fashion_mnist_class():
    from torchvision.datasets import FashionMNIST

    class FashionMNISTGz(FashionMNIST):
        """torchvision's ``FashionMNIST`` reading the ``.gz`` IDX files of one flat folder.

        ``root`` is ``<resources>/datasets/fashion-mnist`` holding :data:`FASHION_MNIST_FILES`
        (no ``FashionMNIST/raw`` sub-folder, no decompressed copies). ``download=True``
        fetches missing files there with torchvision's mirrors.
        """

        @property
        def raw_folder(self) -> str:
            return self.root

        def _check_exists(self) -> bool:
            return all(os.path.isfile(os.path.join(self.root, f)) for f in FASHION_MNIST_FILES)

        def _load_data(self):
            prefix = "train" if self.train else "t10k"
            images = torch.from_numpy(read_idx(os.path.join(self.root, f"{prefix}-images-idx3-ubyte.gz")).copy())
            labels = torch.from_numpy(read_idx(os.path.join(self.root, f"{prefix}-labels-idx1-ubyte.gz")).astype(np.int64))
            return images, labels

    return FashionMNISTGz


FashionMNISTGz = _fashion_mnist_class()


def build_datasets(scale: dict, resources_dir: str | os.PathLike, download: bool = False) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset, int, int]:
    """Training and validation sets of a configured scale.

    * ``dataset: fashion_mnist`` (``small``): :class:`FashionMNISTGz` on
      ``<resources>/datasets/fashion-mnist``; train transform ``RandomCrop(img_size,
      padding=2)`` + horizontal flip when ``augment``, else a resize to ``img_size``; both then
      ``ToTensor`` and the Fashion-MNIST mean/std. The first ``n_train`` / ``n_val`` images
      of the train / test split (all when null).
    * ``dataset: imagenet`` (``paper``): ``ImageFolder(<imagenet_root>/train|val)`` with
      ``timm.data.create_transform`` (training: RandAugment ``auto_augment``, random erasing
      ``reprob``, bicubic; validation: Resize(256, bicubic) + CenterCrop(224)).

    Returns:
        ``(train, val, num_classes, in_chans)``.

    Raises:
        FileNotFoundError: a missing input; the message names the path and config key.
    """
    from torchvision import transforms as T

    size = scale["img_size"]
    if scale["dataset"] == "fashion_mnist":
        root = Path(resources_dir) / "datasets" / "fashion-mnist"
        missing = [str(root / f) for f in FASHION_MNIST_FILES if not (root / f).is_file()]
        if missing and not download:
            raise FileNotFoundError(
                f"missing Fashion-MNIST: {', '.join(missing)} (config key resources_dir). Place the four IDX .gz files of https://github.com/zalandoresearch/fashion-mnist there, or run online."
            )
        norm = [T.ToTensor(), T.Normalize((FASHION_MNIST_MEAN,), (FASHION_MNIST_STD,))]
        base = [] if size == 28 else [T.Resize(size)]
        aug = [T.RandomCrop(size, padding=2), T.RandomHorizontalFlip()] if scale["augment"] else []
        train = FashionMNISTGz(str(root), train=True, transform=T.Compose(base + aug + norm), download=download)
        val = FashionMNISTGz(str(root), train=False, transform=T.Compose(base + norm), download=download)
        num_classes, in_chans = 10, 1
    elif scale["dataset"] == "imagenet":
        from timm.data import create_transform
        from torchvision.datasets import ImageFolder

        root = scale["imagenet_root"]
        if root is None or not all((Path(root) / s).is_dir() for s in ("train", "val")):
            raise FileNotFoundError(f"config key training.scales.*.imagenet_root: {root} must hold train/ and val/ class folders (ImageNet-1k)")
        train_tf = create_transform(size, is_training=True, auto_augment=scale["auto_augment"], re_prob=scale["reprob"], interpolation="bicubic")
        val_tf = create_transform(size, is_training=False, interpolation="bicubic", crop_pct=224 / 256)
        train, val = ImageFolder(str(Path(root) / "train"), train_tf), ImageFolder(str(Path(root) / "val"), val_tf)
        num_classes, in_chans = len(train.classes), 3
    else:
        raise ValueError(f"unknown dataset {scale['dataset']!r}")
    if scale.get("n_train") is not None:
        train = torch.utils.data.Subset(train, range(min(scale["n_train"], len(train))))
    if scale.get("n_val") is not None:
        val = torch.utils.data.Subset(val, range(min(scale["n_val"], len(val))))
    return train, val, num_classes, in_chans


# --------------------------------------------------------------------------------------
# Training with per-epoch logging and exact resumption
# --------------------------------------------------------------------------------------


def config_fingerprint(*parts) -> str:
    """SHA-256 of the JSON of the given configuration parts (a checkpoint is resumed only if it matches)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _seed_epoch(seed: int, epoch: int) -> int:
    s = (seed * 1_000_003 + epoch) % (2**31)
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)
    return s


def _accuracy(logits: torch.Tensor, target: torch.Tensor, ks=(1, 5)) -> list[float]:
    top = logits.topk(max(ks), dim=-1).indices
    hit = top == target[:, None]
    return [float(hit[:, : min(k, logits.shape[-1])].any(-1).float().sum()) for k in ks]


def _write_rows(rows: list[dict], path: Path) -> None:
    with atomic_output(path) as tmp:
        pd.DataFrame(rows, columns=list(LOG_COLUMNS)).to_csv(tmp, index=False, float_format="%.9g")


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

    After each epoch: :func:`reconstruction_metrics` on the fixed "train" batch (batch
    ``recon_batch_index`` of the first epoch, before mixup; train mode) and, after the
    validation pass (loss, top-1/top-5 accuracy in %), on the first validation batch (eval
    mode). The row (:data:`LOG_COLUMNS`) is appended; the checkpoint is written atomically,
    then ``log_csv`` is rewritten atomically from the checkpoint's rows. A checkpoint with
    the same ``fingerprint`` is resumed; one with another fingerprint is ignored (a changed
    configuration starts afresh), and so is one :func:`load_checkpoint` refuses (a pickled
    object, a damaged file: a warning names it, training starts at epoch 0 and overwrites it).

    Args:
        model: from :func:`build_model`, on the CPU (moved to ``device`` here).
        train_set, val_set: datasets yielding ``(image (C, H, W) float32, label int)``.
        scale: one entry of ``training.scales`` in the configuration (its ``seeds`` list, if any, unused).
        log_csv: the tidy per-epoch log.
        checkpoint: the resumable state (kept after the run; not a Snakemake output).
        seed: every epoch reseeds ``torch``/``numpy``/``random`` and the sampler from (seed, epoch).
        fingerprint: :func:`config_fingerprint` of everything that defines the run.
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
        _write_rows(rows, log_csv)  # drop any row written after the checkpoint

    generator = torch.Generator()
    loader = torch.utils.data.DataLoader(train_set, batch_size=scale["batch_size"], shuffle=True, drop_last=True, num_workers=num_workers, generator=generator)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=scale["eval_batch_size"], shuffle=False, num_workers=num_workers)
    if len(loader) == 0:
        raise ValueError(f"{len(train_set)} training images make no batch of {scale['batch_size']} (drop_last)")
    recon_index = min(scale["recon_batch_index"], len(loader) - 1)

    for epoch in range(start, epochs):
        generator.manual_seed(_seed_epoch(seed, epoch))
        # the fixed "train" batch is taken from the first epoch's loader, before mixup
        keep = recon_index if epoch == 0 else None
        train_loss = _train_epoch(model, loader, recipe, device, fixed, keep, desc=f"epoch {epoch + 1}/{epochs}", progress=progress)
        row = {"epoch": epoch, "lr": recipe.optimizer.param_groups[0]["lr"], "train_loss": train_loss}
        row.update({f"train_{k}": v for k, v in reconstruction_metrics(model, fixed["train"].to(device), train_mode=True).items()})
        row.update(_evaluate(model, val_loader, device, fixed))
        row.update({f"test_{k}": v for k, v in reconstruction_metrics(model, fixed["test"].to(device), train_mode=False).items()})
        recipe.scheduler.step(epoch + 1)
        rows.append(row)
        _save_checkpoint(checkpoint, fingerprint, epoch + 1, rows, fixed, model, recipe)
        _write_rows(rows, log_csv)
        log.info("epoch %d/%d: loss %.4f, acc1 %.2f, J_proj train %.4g test %.4g", epoch + 1, epochs, row["train_loss"], row["test_acc1"], row["train_error"], row["test_error"])
        if on_epoch_end is not None:
            on_epoch_end(epoch, row)
    if start >= epochs:
        _write_rows(rows, log_csv)
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
        scheduler, _ = create_scheduler_v2(optimizer, sched=scale["sched"], num_epochs=scale["epochs"], warmup_epochs=scale["warmup_epochs"], min_lr=scale["min_lr"], warmup_lr=scale["min_lr"])
        use_mix = scale["mixup"] > 0 or scale["cutmix"] > 0
        mixup = Mixup(mixup_alpha=scale["mixup"], cutmix_alpha=scale["cutmix"], label_smoothing=scale["smoothing"], num_classes=model.num_classes) if use_mix else None
        criterion = SoftTargetCrossEntropy() if use_mix else nn.CrossEntropyLoss(label_smoothing=scale["smoothing"])
        amp = bool(scale["amp"]) and device.type == "cuda"
        scaler = torch.amp.GradScaler("cuda", enabled=amp)
        ema = None
        if scale["model_ema"]:
            from timm.utils import ModelEmaV2

            ema = ModelEmaV2(model, decay=scale["model_ema_decay"])
        return cls(optimizer, scheduler, mixup, criterion, amp, scaler, ema)


class UntrustedCheckpointError(ValueError):
    """A checkpoint that ``torch.load(..., weights_only=True)`` refuses: it carries a pickled
    object other than tensors and plain values (or is not a checkpoint at all); ``str()`` names
    the file and says why."""


def load_checkpoint(path: str | os.PathLike) -> dict:
    """A training checkpoint, read without running any code from it.

    ``torch.load(path, map_location="cpu", weights_only=True)``: torch's restricted unpickler
    accepts tensors, ``dict``/``OrderedDict``, ``list``, ``tuple``, ``str``, numbers, ``bool`` and
    ``None``, and refuses any other global (a class, a function) before calling it, so a file
    crafted to run code on loading, or written by an older version that pickled objects, is
    refused instead of trusted.

    Returns:
        The state written by :func:`save_checkpoint`: ``fingerprint`` (str), ``epoch`` (int,
        completed epochs), ``rows`` (list of dicts of floats), ``fixed`` (``{"train", "test"}``
        image batches, ``(B, C, H, W)`` float32), ``model``, ``optimizer``, ``scheduler``,
        ``scaler`` and ``ema`` states (tensors and plain values).

    Raises:
        UntrustedCheckpointError: the file holds anything else, is truncated or is not a torch
            checkpoint; the message names the file and torch's reason.
        FileNotFoundError: there is no file.
    """
    import pickle

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, ValueError) as exc:
        # torch raises UnpicklingError for a refused global and RuntimeError/EOFError for a file
        # that is not a (complete) torch archive; either way nothing in it may be used
        reason = _load_failure_reason(exc)
        raise UntrustedCheckpointError(
            f"{path}: refused to load the training checkpoint: torch.load(weights_only=True) rejects it ({reason}). "
            "Only a complete checkpoint of tensors and plain values, as train_run writes it, is loaded"
        ) from exc
    if not isinstance(state, dict) or not {"fingerprint", "epoch", "rows", "fixed", "model"} <= set(state):
        raise UntrustedCheckpointError(f"{path}: refused to load the training checkpoint: it is not a dict with fingerprint, epoch, rows, fixed and model")
    return state


def _load_failure_reason(exc: BaseException) -> str:
    """The informative part of torch.load's error: the unpickler's own words (``Unsupported
    global: GLOBAL <name> ...`` up to its first sentence), else the first sentence of the message."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n\n|$)", text, re.S)
    line = found[1] if found else text.strip().split(". ")[0]
    return " ".join(line.split()) or type(exc).__name__


_PLAIN = (str, int, float, bool, type(None))


def _check_plain(value, where: str) -> None:
    """Raise ``TypeError`` naming ``where`` if ``value`` holds anything but tensors and plain
    values (what :func:`load_checkpoint` reads back with ``weights_only=True``)."""
    # exact types: numpy's float64 is a float subclass, but pickles as a numpy global
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return
    if type(value) in (dict, OrderedDict):  # not any dict subclass: the unpickler allows these two
        for k, v in value.items():
            if type(k) not in _PLAIN:
                raise TypeError(f"checkpoint key {where}[{k!r}] is a {type(k).__name__}, not a plain value")
            _check_plain(v, f"{where}[{k!r}]")
    elif type(value) in (list, tuple):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    else:
        raise TypeError(f"checkpoint entry {where} is a {type(value).__module__}.{type(value).__name__}, which torch.load(weights_only=True) would refuse")


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` with ``torch.save``, atomically, after checking it holds only tensors
    and plain values (so :func:`load_checkpoint` can read it back).

    Raises:
        TypeError: an entry of another type (numpy scalars included); names its key path.
    """
    _check_plain(state, "state")
    with atomic_output(path) as tmp:
        torch.save(state, tmp)


def _resume(checkpoint: Path, fingerprint: str, model: nn.Module, recipe: _Recipe, epochs: int) -> tuple[int, list[dict], dict]:
    """``(first epoch to train, rows so far, fixed batches)`` from a checkpoint of the same
    fingerprint (its model, optimizer, scheduler, scaler and EMA states loaded), else
    ``(0, [], {})``. A checkpoint of another fingerprint is ignored with a warning; one that
    :func:`load_checkpoint` refuses (a pickled object, a truncated file) is not trusted either:
    the run starts afresh with a warning naming it, and overwrites it after the first epoch."""
    if not checkpoint.exists():
        return 0, [], {}
    try:
        state = load_checkpoint(checkpoint)
    except UntrustedCheckpointError as exc:
        log.warning("%s; training from epoch 0 instead, and the file will be overwritten", exc)
        return 0, [], {}
    if state.get("fingerprint") != fingerprint:
        log.warning("ignoring %s: it belongs to another configuration (fingerprint differs)", checkpoint)
        return 0, [], {}
    model.load_state_dict(state["model"])
    recipe.optimizer.load_state_dict(state["optimizer"])
    recipe.scheduler.load_state_dict(state["scheduler"])
    recipe.scaler.load_state_dict(state["scaler"])
    if recipe.ema is not None:
        recipe.ema.module.load_state_dict(state["ema"])
    log.info("resuming %s after epoch %d of %d", checkpoint, state["epoch"], epochs)
    return state["epoch"], state["rows"], state["fixed"]


def _train_epoch(model: nn.Module, loader, recipe: _Recipe, device: torch.device, fixed: dict, keep: int | None, desc: str, progress: bool) -> float:
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


def _save_checkpoint(checkpoint: Path, fingerprint: str, epoch: int, rows: list[dict], fixed: dict, model: nn.Module, recipe: _Recipe) -> None:
    """Everything :func:`_resume` needs after ``epoch`` completed epochs (:func:`save_checkpoint`)."""
    state = {
        "fingerprint": fingerprint,
        "epoch": epoch,
        "rows": rows,
        "fixed": fixed,
        "model": model.state_dict(),
        "optimizer": recipe.optimizer.state_dict(),
        "scheduler": recipe.scheduler.state_dict(),
        "scaler": recipe.scaler.state_dict(),
        "ema": recipe.ema.module.state_dict() if recipe.ema is not None else None,
    }
    save_checkpoint(checkpoint, state)


# --------------------------------------------------------------------------------------
# Reading logs: this pipeline's CSVs and the authors' W&B exports, as one tidy frame
# --------------------------------------------------------------------------------------

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
                pd.DataFrame({"source": source, "model": model, "seed": int(seed), "split": split, "metric": m, "epoch": epoch, "x": epoch.astype(float), "step": np.nan, "value": df[f"{split}_{m}"]})
            )
    return pd.concat(parts, ignore_index=True)[_TIDY]


_WANDB_VALUE = re.compile(r"^(?P<run>.+) - (?P<split>train|test)_(?P<metric>.+)$")


def read_wandb_logs(directory: str | os.PathLike, source: str = "authors (W&B)", epoch_axis: str = "step") -> pd.DataFrame:
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
            raise ValueError(f"{f}: expected a 'Step' column and one '<run> - <split>_<metric>' column, got {list(df.columns)}")
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


def training_curves(runs: Sequence[tuple], reference_dir: str | os.PathLike | None, epoch_axis: str = "step", reference_source: str = "authors (W&B, ImageNet-1k)") -> pd.DataFrame:
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
    model: [f"{prefix}_{split}_{m}.csv" for split in ("train", "test") for m in ("error", "h", "varphi", "rel_error_wrt_h", "rel_error_wrt_varphi")]
    for model, prefix in (("vit_tiny", "vit"), ("deit_tiny", "deit"))
}
