"""Vision inputs: the image list, the paper's sampling, preprocessing (docs/method.md Section 1)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kpca_repro.errors import InputFileError

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "ImageRecord",
    "list_images",
    "sample_indices",
    "sample_images",
    "shard_slice",
    "shard_batches",
    "paper_transform",
    "load_image",
    "check_images",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "UnreadableImageError",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class UnreadableImageError(InputFileError, OSError):
    """An image file could not be decoded; the message names it."""


@dataclass(frozen=True)
class ImageRecord:
    """One image of the ordered dataset: its index, path and class index."""

    dataset_index: int
    path: str
    class_index: int


def list_images(root: str | os.PathLike, layout: str) -> list[ImageRecord]:
    """The images of ``root`` in the order the paper's code indexes them.

    Args:
        root: directory.
        layout: ``"imagefolder"``: class sub-folders in torchvision's ``ImageFolder`` order
            (classes = sorted folder names, files sorted within a class; index = position);
            ``"flat"``: a flat folder of ``<wnid>_<label>.JPEG`` files (the ImageNet sample),
            ordered by sorted file name, which is ImageFolder's order for the same images in
            class folders (docs/method.md Section 1), class index = position.

    Returns:
        Records in dataset order.

    Raises:
        FileNotFoundError: ``root`` missing, no class folders (imagefolder) or no images (flat).
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image directory {root} does not exist")
    if layout == "imagefolder":
        return [ImageRecord(i, path, c) for i, (path, c) in enumerate(_image_folder_samples(root))]
    if layout == "flat":
        exts = (".jpeg", ".jpg", ".png")
        files = sorted(f for f in os.listdir(root) if f.lower().endswith(exts) and not f.startswith("."))
        if not files:
            raise FileNotFoundError(f"no images (*.JPEG, *.jpg, *.png) in {root}")
        return [ImageRecord(i, str(root / f), i) for i, f in enumerate(files)]
    raise ValueError(f"unknown image layout {layout!r}")


#: torchvision's ``IMG_EXTENSIONS``, the files ``ImageFolder`` reads (case-insensitive).
IMAGE_FOLDER_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _image_folder_samples(root: Path) -> list[tuple[str, int]]:
    """``torchvision.datasets.ImageFolder(root).samples``, read without importing torchvision.

    The same walk as torchvision's ``find_classes`` and ``make_dataset`` (0.19 to 0.29): classes
    are the sorted names of the sub-directories (symbolic links to directories included), class
    index = position; within a class ``os.walk`` follows links, its ``(root, dirs, files)`` tuples
    sorted, file names sorted, a file kept when its lower-cased path ends in one of
    :data:`IMAGE_FOLDER_EXTENSIONS`. Importing torchvision imports torch, seconds that the
    workflow's check before its first job and the sampling job would spend only on this listing;
    tests/test_extraction.py holds it to ``ImageFolder`` on the same trees.

    Raises:
        FileNotFoundError: no class folder, or a class folder without an image (as ``ImageFolder``).
    """
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(
            f"{root} is not an ImageNet validation root: expected class sub-folders <root>/<wnid>/*.JPEG "
            f"(no class folder in {root})"
        )
    samples, empty = [], []
    for index, name in enumerate(classes):
        found = [
            os.path.join(folder, f)
            for folder, _, files in sorted(os.walk(os.path.join(root, name), followlinks=True))
            for f in sorted(files)
            if os.path.join(folder, f).lower().endswith(IMAGE_FOLDER_EXTENSIONS)
        ]
        samples += [(path, index) for path in found]
        if not found:
            empty.append(name)
    if empty:
        raise FileNotFoundError(
            f"{root} is not an ImageNet validation root: no image ({', '.join(IMAGE_FOLDER_EXTENSIONS)}) "
            f"in the class folder(s) {', '.join(empty[:5])}{' ...' if len(empty) > 5 else ''}"
        )
    return samples


def sample_indices(n_population: int, k: int, seed: int) -> list[int]:
    """The paper's draw: ``random.seed(seed); random.sample(range(n_population), k)``.

    A fresh stdlib RNG state per call, as each of the authors' scripts seeds and draws once
    (docs/method.md Section 1). The order of the returned list is the draw order.

    Raises:
        ValueError: ``k`` larger than the population or not positive.
    """
    if not 1 <= k <= n_population:
        raise ValueError(f"cannot sample {k} images from a set of {n_population}")
    state = random.getstate()
    try:
        random.seed(seed)
        return random.sample(range(n_population), k)
    finally:
        random.setstate(state)


def sample_images(records: list[ImageRecord], k: int, seed: int) -> pd.DataFrame:
    """Table of the ``k`` sampled images: ``sample_rank, dataset_index, class_index, path``."""
    import pandas as pd  # here: the workflow counts images while it parses, without pandas

    idx = sample_indices(len(records), k, seed)
    return pd.DataFrame(
        {
            "sample_rank": range(k),
            "dataset_index": idx,
            "class_index": [records[i].class_index for i in idx],
            "path": [records[i].path for i in idx],
        }
    )


def shard_slice(n_items: int, n_shards: int, shard: int) -> slice:
    """Contiguous block ``shard`` (0-based) of ``n_items`` split into ``n_shards`` near-equal blocks.

    Raises:
        ValueError: ``shard`` out of range or more shards than items.
    """
    if not 0 <= shard < n_shards or n_shards > n_items:
        raise ValueError(f"shard {shard} of {n_shards} is invalid for {n_items} items")
    bounds = [n_items * s // n_shards for s in range(n_shards + 1)]
    return slice(bounds[shard], bounds[shard + 1])


def shard_batches(n_items: int, n_shards: int, shard: int, batch_size: int) -> list[tuple[slice, slice, int]]:
    """The forward-pass batches of one shard, aligned to the whole sample's batches.

    Batches are the blocks ``[j * batch_size, (j + 1) * batch_size)`` of the *whole* sample,
    whatever the shard count. A shard runs every block that overlaps its rows (a block cut by
    a shard boundary is run whole, at most one extra batch per boundary) and keeps only its
    own rows. Each item therefore goes through the model in the same batch, with the same
    companions and shape, for every ``n_shards``: float32 matrix products whose rounding
    depends on the batch size (seen with MKL on AVX2 CPUs, 6e-7 in q, k, v) cannot make a
    sharded run differ from an unsharded one.

    Returns:
        ``(run, keep, offset)`` per batch: ``run`` the global rows to forward, ``keep`` the
        rows of that batch that belong to the shard (relative to ``run.start``), ``offset``
        the position of the first kept row within the shard.

    Raises:
        ValueError: invalid shard (:func:`shard_slice`) or ``batch_size < 1``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rows = shard_slice(n_items, n_shards, shard)
    out = []
    for b0 in range(rows.start // batch_size * batch_size, rows.stop, batch_size):
        b1 = min(b0 + batch_size, n_items)
        lo, hi = max(rows.start, b0), min(rows.stop, b1)
        out.append((slice(b0, b1), slice(lo - b0, hi - b0), lo - rows.start))
    return out


def paper_transform(image_size: int | tuple[int, int] = 224):
    """``Resize((224, 224))`` + ``ToTensor`` + ImageNet ``Normalize``, for every model.

    docs/method.md Section 1: direct resize to a square (aspect ratio not kept, no crop, PIL
    bilinear with antialias), ImageNet mean/std even for the ViTs whose weights expect 0.5.
    """
    from torchvision import transforms

    size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    return transforms.Compose(
        [transforms.Resize(size), transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )


def load_image(path: str | os.PathLike):
    """Open an image as RGB, like torchvision's default loader.

    Raises:
        UnreadableImageError: the file cannot be read or decoded; the message names it.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            return img.convert("RGB")
    except UnidentifiedImageError as exc:  # PIL's message would name the file object, not the path
        raise UnreadableImageError(f"cannot read image {path}: not an image file (no format PIL can decode)") from exc
    except Exception as exc:
        raise UnreadableImageError(f"cannot read image {path}: {exc}") from exc


def check_images(paths) -> None:
    """Decode every image in ``paths`` fully, as extraction will; fail on the first bad one.

    The sample rule calls this on the images it has just drawn, so an unreadable file stops
    the run before any model is loaded, and the sample table is never written.

    Raises:
        UnreadableImageError: a file cannot be read or decoded (also a truncated JPEG); the
            message names it and what to do.
    """
    for path in paths:
        try:
            load_image(path)
        except UnreadableImageError as exc:
            raise UnreadableImageError(
                f"{exc}. Replace the file with a readable copy (removing it changes the seeded draw)"
            ) from exc
