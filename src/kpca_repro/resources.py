"""The resources directory: where external inputs live, how they are checked and fetched.

Layout (``<resources>`` is ``config["resources_dir"]``, default ``resources/``;
``../shared/assets`` uses the same layout)::

    <resources>/weights/timm/<timm model id>.safetensors    timm state_dict (float32)
    <resources>/images/imagenet-sample/<wnid>_<label>.JPEG  1000 ImageNet images, one per class
    <resources>/text/wikitext-103/wiki.test.raw             WikiText-103 raw test split
    <resources>/datasets/fashion-mnist/*-ubyte.gz           Fashion-MNIST (IDX)

Online, the download rules fill what is missing (timm's own pretrained loader; the
ImageNet sample from its public repository at a pinned commit). Offline, or when a
download fails, :class:`MissingResourceError` names the exact path to fill.
"""

from __future__ import annotations

import hashlib
import io
import os
import urllib.request
import zipfile
from pathlib import Path

__all__ = [
    "MissingResourceError",
    "ChecksumMismatchError",
    "timm_weights_path",
    "imagenet_sample_dir",
    "sha256_file",
    "check_checksum",
    "missing_message",
    "download_timm_weights",
    "download_imagenet_sample",
]

IMAGENET_SAMPLE_SUBDIR = "images/imagenet-sample"


class MissingResourceError(FileNotFoundError):
    """A required input file is absent and cannot be fetched; the message names the path."""


class ChecksumMismatchError(ValueError):
    """A weights file does not have the SHA-256 recorded for it in the configuration."""


def timm_weights_path(resources_dir: str | os.PathLike, model_id: str) -> Path:
    """``<resources>/weights/timm/<model_id>.safetensors`` (the workflow's weights input,
    through :func:`kpca_repro.config_checks.weights_path`)."""
    return Path(resources_dir) / "weights" / "timm" / f"{model_id}.safetensors"


def imagenet_sample_dir(resources_dir: str | os.PathLike) -> Path:
    """``<resources>/images/imagenet-sample`` (the default image source,
    :func:`kpca_repro.config_checks.image_source`)."""
    return Path(resources_dir) / IMAGENET_SAMPLE_SUBDIR


def missing_message(path: str | os.PathLike, what: str, how: str) -> str:
    """The one message for a missing input: what it is, the exact path to fill, and how."""
    return f"missing {what}: {Path(path)} does not exist. {how}"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def check_checksum(path: str | os.PathLike, expected: str | None) -> str:
    """Return the file's SHA-256, raising if it differs from ``expected`` (when given).

    Raises:
        ChecksumMismatchError: the digest differs; the message names the file and both digests.
    """
    actual = sha256_file(path)
    if expected and actual.lower() != expected.lower():
        raise ChecksumMismatchError(
            f"{path}: SHA-256 is {actual}, but the configuration records {expected} (config key 'checksums'). Replace the file with the recorded weights or update the checksum."
        )
    return actual


def _atomic_target(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(path.name + ".partial")


def download_timm_weights(model_id: str, out_path: str | os.PathLike) -> None:
    """Fetch ``model_id``'s default pretrained weights with timm and save them as safetensors.

    Uses ``timm.create_model(model_id, pretrained=True)`` (the Hugging Face hub or timm's
    URLs), then writes ``model.state_dict()`` atomically.

    Raises:
        MissingResourceError: the download failed (for example, no network); the message
            gives the exact path where the weights can be placed by hand.
    """
    import timm
    from safetensors.torch import save_file

    out = Path(out_path)
    try:
        model = timm.create_model(model_id, pretrained=True)
    except Exception as exc:  # network, hub or cache errors all end the same way
        raise MissingResourceError(
            missing_message(
                out,
                f"pretrained weights of timm model {model_id!r}",
                f"Downloading them with timm failed ({type(exc).__name__}: {exc}). Offline, save "
                f"timm.create_model({model_id!r}, pretrained=True).state_dict() with "
                f"safetensors.torch.save_file to exactly that path.",
            )
        ) from exc
    tmp = _atomic_target(out)
    state = {k: t.detach().contiguous() for k, t in model.state_dict().items()}
    save_file(state, str(tmp), metadata={"timm_model": model_id})
    os.replace(tmp, out)


def download_imagenet_sample(url: str, out_dir: str | os.PathLike, expected_count: int = 1000) -> None:
    """Download the ImageNet sample archive (a GitHub zip at a pinned commit) into ``out_dir``.

    Keeps the ``<wnid>_<label>.JPEG`` files of the archive, flat. Written to a temporary
    directory and renamed when complete.

    Raises:
        MissingResourceError: the download failed or the archive did not hold
            ``expected_count`` images; the message names the directory to fill.
    """
    out = Path(out_dir)
    how = f"Put the 1000 files <wnid>_<label>.JPEG of the ImageNet sample there (source: {url}), or set vision.imagenet_val_dir to an ImageNet validation root."
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            payload = resp.read()
    except Exception as exc:
        raise MissingResourceError(missing_message(out, "ImageNet sample images", f"Download failed ({exc}). {how}")) from exc
    from .h5io import atomic_directory  # h5py: imported only when downloading (config checks use the paths)

    with atomic_directory(out) as tmp:
        with zipfile.ZipFile(io.BytesIO(payload)) as zf:
            names = [n for n in zf.namelist() if n.endswith(".JPEG") and Path(n).name.startswith("n")]
            for name in names:
                (tmp / Path(name).name).write_bytes(zf.read(name))
        if len(names) != expected_count:
            raise MissingResourceError(missing_message(out, "ImageNet sample images", f"The archive held {len(names)} images, expected {expected_count}. {how}"))
