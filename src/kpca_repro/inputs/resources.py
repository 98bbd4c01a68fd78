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
import logging
import os
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kpca_repro.errors import InputFileError

T = TypeVar("T")

__all__ = [
    "sha256_file",
    "MissingResourceError",
    "ChecksumMismatchError",
    "WeightsFileError",
    "timm_weights_path",
    "imagenet_sample_dir",
    "check_checksum",
    "missing_message",
    "download_timm_weights",
    "download_imagenet_sample",
    "download_fashion_mnist",
    "download_wandb_logs",
    "fetch_url",
    "with_retries",
    "content_sha256",
    "DownloadPolicy",
    "UnknownTimmModelError",
    "unknown_timm_model",
]

IMAGENET_SAMPLE_SUBDIR = "images/imagenet-sample"


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class MissingResourceError(FileNotFoundError):
    """A required input file is absent and cannot be fetched; the message names the path."""


class ChecksumMismatchError(InputFileError, ValueError):
    """A weights file does not have the SHA-256 recorded for it in the configuration."""


class WeightsFileError(InputFileError, ValueError):
    """A weights file that cannot be loaded: truncated, corrupt, or the weights of another architecture."""


def timm_weights_path(resources_dir: str | os.PathLike, model_id: str) -> Path:
    """``<resources>/weights/timm/<model_id>.safetensors`` (the workflow's weights input,
    through :func:`kpca_repro.workflow.config_checks.weights_path`)."""
    return Path(resources_dir) / "weights" / "timm" / f"{model_id}.safetensors"


def imagenet_sample_dir(resources_dir: str | os.PathLike) -> Path:
    """``<resources>/images/imagenet-sample`` (the default image source,
    :func:`kpca_repro.workflow.config_checks.image_source`)."""
    return Path(resources_dir) / IMAGENET_SAMPLE_SUBDIR


def missing_message(path: str | os.PathLike, what: str, how: str) -> str:
    """The one message for a missing input: what it is, the exact path to fill, and how."""
    return f"missing {what}: {Path(path)} does not exist. {how}"


def check_checksum(path: str | os.PathLike, expected: str | None) -> str:
    """Return the file's SHA-256, raising if it differs from ``expected`` (when given).

    Raises:
        ChecksumMismatchError: the digest differs; the message names the file and both digests.
    """
    actual = sha256_file(path)
    if expected and actual.lower() != expected.lower():
        raise ChecksumMismatchError(
            f"{path}: SHA-256 is {actual}, but the configuration records {expected} (config key 'checksums'). "
            "Replace the file with the recorded weights or update the checksum."
        )
    return actual


def _atomic_target(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(path.name + ".partial")


@dataclass(frozen=True)
class DownloadPolicy:
    """How a download is attempted (config section ``downloads``).

    Attributes:
        retries: further attempts after a failed one.
        backoff_s: seconds before the first retry, doubled before each further one.
        timeout_s: seconds a server may take to connect or to send the next bytes.
    """

    retries: int = 3
    backoff_s: float = 2.0
    timeout_s: float = 60.0

    @classmethod
    def from_config(cls, downloads: dict) -> DownloadPolicy:
        """The policy of a validated ``downloads`` configuration section."""
        return cls(int(downloads["retries"]), float(downloads["backoff_s"]), float(downloads["timeout_s"]))


#: The environment variables through which huggingface_hub (and so timm, transformers and
#: datasets) take their read timeouts: file downloads and the metadata request before them.
HUB_TIMEOUT_VARIABLES = ("HF_HUB_DOWNLOAD_TIMEOUT", "HF_HUB_ETAG_TIMEOUT")


def export_hub_timeouts(timeout_s: float, environ: dict | None = None) -> dict[str, str]:
    """Give huggingface_hub the configured ``downloads.timeout_s`` (seconds, rounded up to a whole
    second) in ``environ`` (default ``os.environ``), which the jobs inherit.

    huggingface_hub reads its timeouts from :data:`HUB_TIMEOUT_VARIABLES` when it is imported and
    otherwise waits 10 s, whatever the configuration says; a slow mirror then fails every
    attempt of a large file. A variable the user already exported is kept.

    Returns:
        The values now in ``environ`` for :data:`HUB_TIMEOUT_VARIABLES`.
    """
    environ = os.environ if environ is None else environ
    seconds = str(max(1, int(-(-float(timeout_s) // 1))))
    return {name: environ.setdefault(name, seconds) for name in HUB_TIMEOUT_VARIABLES}


class UnknownTimmModelError(ValueError):
    """A model id that timm does not know (a misspelt name): no weights exist to fetch or save."""


def unknown_timm_model(model_id: str) -> str | None:
    """Why ``model_id`` names no timm model (``timm.is_model``), with the closest of
    ``timm.list_models()`` when there is one, or None when timm knows it. Imports timm."""
    import difflib

    import timm

    if timm.is_model(model_id):
        return None
    close = difflib.get_close_matches(model_id, timm.list_models(), n=1)
    return (
        f"{model_id!r} is not a timm model (timm.list_models())"
        + (f"; did you mean {close[0]!r}?" if close else "")
        + " Fix the model id in the configuration."
    )


def download_timm_weights(
    model_id: str,
    out_path: str | os.PathLike,
    *,
    policy: DownloadPolicy = DownloadPolicy(),
    log: logging.Logger | None = None,
) -> None:
    """Fetch ``model_id``'s default pretrained weights from its Hugging Face repository.

    The repository is timm's ``pretrained_cfg.hf_hub_id`` (e.g. ``timm/deit_tiny_patch16_224.fb_in1k``);
    its ``model.safetensors`` is fetched with ``huggingface_hub.hf_hub_download`` (so
    ``HF_ENDPOINT`` selects a mirror), checked to load into ``timm.create_model(model_id)``
    with no missing or unexpected key, and placed byte for byte (its SHA-256 is the hub
    file's). A model whose hub weights need timm's checkpoint filter, or that has no hub
    repository, is loaded with ``timm.create_model(model_id, pretrained=True)`` and its
    ``state_dict()`` saved instead. Either way retried as :func:`with_retries` says and
    written to a temporary file, then renamed.

    Raises:
        UnknownTimmModelError: timm knows no model ``model_id`` (:func:`unknown_timm_model`); nothing is fetched.
        MissingResourceError: every attempt failed (for example, no network); the message
            gives the exact path where the weights can be placed by hand.
    """
    import shutil

    import timm
    from safetensors.torch import load_file, save_file

    if problem := unknown_timm_model(model_id):
        raise UnknownTimmModelError(problem)
    out = Path(out_path)
    tmp = _atomic_target(out)
    cfg = timm.models.get_pretrained_cfg(model_id)
    hub_id = cfg.hf_hub_id if cfg is not None else None

    def from_hub() -> bool:
        from huggingface_hub import hf_hub_download

        cached = hf_hub_download(hub_id, "model.safetensors")
        model = timm.create_model(model_id, pretrained=False)
        missing, unexpected = model.load_state_dict(load_file(cached), strict=False)
        if missing or unexpected:
            return False  # needs timm's own checkpoint filter: saved from the loaded model below
        shutil.copyfile(cached, tmp)
        return True

    def from_timm() -> None:
        model = timm.create_model(model_id, pretrained=True)
        state = {k: t.detach().contiguous() for k, t in model.state_dict().items()}
        save_file(state, str(tmp), metadata={"timm_model": model_id})

    try:
        done = hub_id is not None and with_retries(
            from_hub, what=f"weights of {model_id}", source=f"{hub_id} (model.safetensors)", policy=policy, log=log
        )
        if not done:
            with_retries(
                from_timm, what=f"weights of {model_id}", source="timm's pretrained loader", policy=policy, log=log
            )
        os.replace(tmp, out)
    except Exception as exc:  # network, hub or cache errors all end the same way
        raise MissingResourceError(
            missing_message(
                out,
                f"pretrained weights of timm model {model_id!r}",
                f"Downloading them ({hub_id or 'timm'}) failed {policy.retries + 1} times (last: {_describe(exc)}). "
                "Offline, save "
                f"timm.create_model({model_id!r}, pretrained=True).state_dict() with "
                f"safetensors.torch.save_file to exactly that path.",
            )
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def with_retries(
    func: Callable[[], T],
    *,
    what: str,
    source: str,
    policy: DownloadPolicy = DownloadPolicy(),
    log: logging.Logger | None = None,
) -> T:
    """Call ``func`` until it succeeds, at most ``1 + policy.retries`` times, pausing
    ``policy.backoff_s``, then twice as long before each further attempt.

    Every failure but the last is logged as one WARNING line naming ``source`` and the error;
    the last is raised unchanged for the caller to wrap in its message.

    Args:
        func: the download, without arguments; it must leave nothing behind when it fails.
        what: human name of the input, for the log line.
        source: the URL, repository or dataset fetched, for the log line.
        policy: retries and pause (``downloads``).
        log: where the retry lines go (default: this module's logger).

    Returns:
        What ``func`` returns.

    Raises:
        Exception: the last attempt's exception, after ``1 + policy.retries`` failures.
    """
    log = log or logging.getLogger(__name__)
    retries = policy.retries
    for attempt in range(retries + 1):
        try:
            return func()
        except Exception as exc:  # noqa: BLE001 - network, server, truncation and digest errors are retried alike
            if attempt == retries:
                raise
            pause = policy.backoff_s * 2**attempt
            log.warning(
                "download of %s from %s failed (attempt %d of %d: %s); retrying in %g s",
                what,
                source,
                attempt + 1,
                retries + 1,
                _describe(exc),
                pause,
            )
            time.sleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover


def fetch_url(
    url: str,
    dest: str | os.PathLike,
    known_hash: str | None,
    *,
    what: str,
    how: str,
    policy: DownloadPolicy = DownloadPolicy(),
    log: logging.Logger | None = None,
) -> Path:
    """Download ``url`` to ``dest`` with pooch, checked against ``known_hash``, retried.

    pooch streams into a temporary file beside ``dest`` and moves it into place only when
    its digest matches, so an interrupted, truncated or corrupt download never leaves a file
    at ``dest``; a ``dest`` that already has the digest is not downloaded again.

    Args:
        url: an http(s) URL.
        dest: the file to write.
        known_hash: ``"<algorithm>:<hex>"`` or a bare SHA-256 hex digest; None: not checked.
        what: human name of the input, for the messages.
        how: how to provide the file by hand, appended to the final error.
        policy: retries, pause and timeout.
        log: where retry lines go.

    Returns:
        ``dest`` as a :class:`~pathlib.Path`.

    Raises:
        MissingResourceError: every attempt failed (connection error, HTTP error status,
            timeout, truncated download or wrong digest); the message names the URL, the
            last error and the exact path to fill by hand.
    """
    import pooch

    out = Path(dest)
    out.parent.mkdir(parents=True, exist_ok=True)
    downloader = pooch.HTTPDownloader(timeout=policy.timeout_s, progressbar=False)
    pooch.get_logger().setLevel(logging.WARNING)  # our own lines say what is fetched and retried

    def attempt():
        return pooch.retrieve(url, known_hash, fname=out.name, path=out.parent, downloader=downloader)

    try:
        with_retries(attempt, what=what, source=url, policy=policy, log=log)
    except Exception as exc:  # noqa: BLE001
        raise MissingResourceError(
            missing_message(
                out, what, f"Downloading {url} failed {policy.retries + 1} times (last: {_describe(exc)}). {how}"
            )
        ) from exc
    return out


def content_sha256(files: Iterable[Path]) -> str:
    """SHA-256 of the sorted lines ``"<file name> <SHA-256 of the file>\n"``: one digest for a
    set of files whatever archive carried them (``downloads.imagenet_sample_content_sha256``)."""
    lines = sorted(f"{f.name} {sha256_file(f)}\n" for f in files)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def download_imagenet_sample(
    url: str,
    out_dir: str | os.PathLike,
    expected_count: int = 1000,
    *,
    archive_sha256: str | None = None,
    content_sha256_expected: str | None = None,
    policy: DownloadPolicy = DownloadPolicy(),
    log: logging.Logger | None = None,
) -> None:
    """Download the ImageNet sample archive (a GitHub zip at a pinned commit) into ``out_dir``.

    The archive is fetched with :func:`fetch_url` into a temporary folder beside ``out_dir``
    (removed afterwards, whatever happens); its ``<wnid>_<label>.JPEG`` files are extracted
    flat into a temporary directory that is renamed to ``out_dir`` only when it holds
    ``expected_count`` images whose :func:`content_sha256` is ``content_sha256_expected``.

    Args:
        url: the zip archive.
        out_dir: ``<resources>/images/imagenet-sample``.
        expected_count: images the archive must hold.
        archive_sha256: SHA-256 of the archive (``downloads.imagenet_sample_sha256``); None: not checked.
        content_sha256_expected: digest of the extracted images; None: not checked.
        policy, log: see :func:`fetch_url`.

    Raises:
        MissingResourceError: the download failed, or the archive did not hold the expected
            images; the message names the directory to fill.
    """
    out = Path(out_dir)
    how = (
        f"Put the 1000 files <wnid>_<label>.JPEG of the ImageNet sample there (source: {url}), or set "
        "vision.imagenet_val_dir to an ImageNet validation root."
    )
    from kpca_repro.h5io import atomic_directory

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.download-", dir=out.parent) as scratch:
        archive = fetch_url(
            url,
            Path(scratch) / "archive.zip",
            archive_sha256,
            what="the ImageNet sample archive",
            how=how,
            policy=policy,
            log=log,
        )
        with atomic_directory(out) as tmp:
            try:
                with zipfile.ZipFile(archive) as zf:
                    names = [n for n in zf.namelist() if n.endswith(".JPEG") and Path(n).name.startswith("n")]
                    for name in names:
                        (tmp / Path(name).name).write_bytes(zf.read(name))
            except zipfile.BadZipFile as exc:
                raise MissingResourceError(
                    missing_message(out, "ImageNet sample images", f"{url} is not a zip archive ({exc}). {how}")
                ) from exc
            if len(names) != expected_count:
                raise MissingResourceError(
                    missing_message(
                        out,
                        "ImageNet sample images",
                        f"The archive held {len(names)} images, expected {expected_count}. {how}",
                    )
                )
            if content_sha256_expected:
                got = content_sha256(tmp.iterdir())
                if got.lower() != content_sha256_expected.lower():
                    key = "downloads.imagenet_sample_content_sha256"
                    raise MissingResourceError(
                        missing_message(
                            out,
                            "ImageNet sample images",
                            f"The images of {url} have content digest {got}, not {content_sha256_expected} ({key}). "
                            f"{how}",
                        )
                    )


def download_fashion_mnist(
    base_url: str,
    out_dir: str | os.PathLike,
    files: Iterable[str],
    hashes: dict[str, str],
    *,
    policy: DownloadPolicy = DownloadPolicy(),
    log: logging.Logger | None = None,
) -> None:
    """Fetch the four Fashion-MNIST IDX ``.gz`` files from ``<base_url>/<file>`` into ``out_dir``.

    Args:
        base_url: ``downloads.fashion_mnist_url``.
        out_dir: ``<resources>/datasets/fashion-mnist``.
        files: the file names (:data:`kpca_repro.training.data.FASHION_MNIST_FILES`).
        hashes: ``{file name: "<algorithm>:<hex>"}`` (``downloads.fashion_mnist_hashes``); a
            file without an entry is not checked.
        policy, log: see :func:`fetch_url`.

    Raises:
        MissingResourceError: a file could not be fetched; files already complete stay.
    """
    for name in files:
        fetch_url(
            f"{base_url.rstrip('/')}/{name}",
            Path(out_dir) / name,
            hashes.get(name),
            what="Fashion-MNIST",
            how="Place the four IDX .gz files of https://github.com/zalandoresearch/fashion-mnist there.",
            policy=policy,
            log=log,
        )


def download_wandb_logs(
    base_url: str,
    out_dir: str | os.PathLike,
    files: dict[str, list[str]],
    hashes: dict[str, str],
    *,
    policy: DownloadPolicy = DownloadPolicy(),
    log: logging.Logger | None = None,
) -> None:
    """Fetch the authors' W&B exports ``<base_url>/<model>/<file>`` into ``out_dir/<model>/``.

    Written into a temporary folder renamed to ``out_dir`` when every file is complete.

    Args:
        base_url: ``figure1.reference_url`` (``scripts/wandb_data`` at a pinned commit).
        out_dir: ``<resources>/training_logs``.
        files: ``{model: [file, ...]}`` (:data:`kpca_repro.training.logs.WANDB_FILES`).
        hashes: ``{"<model>/<file>": sha256}`` (``downloads.reference_sha256``).
        policy, log: see :func:`fetch_url`.

    Raises:
        MissingResourceError: a file could not be fetched; nothing is left at ``out_dir``.
    """
    from kpca_repro.h5io import atomic_directory

    out = Path(out_dir)
    how = (
        "Set figure1.reference_logs to a folder holding vit_tiny/*.csv and deit_tiny/*.csv (scripts/wandb_data "
        "of KarahanS/Reproduction-Study-KPCA), or figure1.use_reference: false."
    )
    with atomic_directory(out) as tmp:
        for model, names in files.items():
            for name in names:
                fetch_url(
                    f"{base_url.rstrip('/')}/{model}/{name}",
                    tmp / model / name,
                    hashes.get(f"{model}/{name}"),
                    what="the authors' W&B training logs",
                    how=how,
                    policy=policy,
                    log=log,
                )
