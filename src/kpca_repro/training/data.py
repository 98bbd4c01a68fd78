"""The data sets of Figures 1 and 4: Fashion-MNIST (the ``small`` scales) or an ImageNet root (the
``paper`` scale), with their transforms (:func:`build_datasets`).

Fashion-MNIST is read from its four ``.gz`` IDX files in place (:func:`read_idx`,
:class:`FashionMNISTGz`); no decompressed copy is written.
"""

from __future__ import annotations

import gzip
import math
import os
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "FASHION_MNIST_FILES",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "read_idx",
    "FashionMNISTGz",
    "build_datasets",
]

#: The IDX files of Fashion-MNIST in ``<resources>/datasets/fashion-mnist/``.
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
#: Fashion-MNIST pixel statistics (training set, pixels scaled to [0, 1]).
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530


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
            labels = torch.from_numpy(
                read_idx(os.path.join(self.root, f"{prefix}-labels-idx1-ubyte.gz")).astype(np.int64)
            )
            return images, labels

    return FashionMNISTGz


FashionMNISTGz = _fashion_mnist_class()


def build_datasets(
    scale: dict, resources_dir: str | os.PathLike, download: bool = False
) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset, int, int]:
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
                f"missing Fashion-MNIST: {', '.join(missing)} (config key resources_dir). Place the four IDX .gz "
                "files of https://github.com/zalandoresearch/fashion-mnist there, or run online."
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
            raise FileNotFoundError(
                f"config key training.scales.*.imagenet_root: {root} must hold train/ and val/ class folders "
                "(ImageNet-1k)"
            )
        train_tf = create_transform(
            size, is_training=True, auto_augment=scale["auto_augment"], re_prob=scale["reprob"], interpolation="bicubic"
        )
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
