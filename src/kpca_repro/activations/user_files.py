"""A user's activation files (config key ``activations:``): the checks at parse time, and the
install of a validated file into the pipeline (rule ``user_activations``)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import h5py

from kpca_repro.activations.format import INVARIANT_RTOL, ActivationFormatError, Summary
from kpca_repro.activations.validation import validate
from kpca_repro.h5io import atomic_output

__all__ = ["install_user_file", "check_user_config"]


def install_user_file(
    source: str | os.PathLike,
    target: str | os.PathLike,
    *,
    name: str,
    kind: str,
    shard: int,
    n_shards: int,
    tolerance: float | None = None,
) -> Summary:
    """Validate a user's activation file (format and capture invariant) and copy it into the pipeline.

    The copy at ``target`` (``results/activations/<slug>/user_<i>of<S>.h5``) gets the
    attributes the later stages read (``shard``, ``n_shards``; ``weights_sha256`` = "" when
    absent; ``capture_rtol``, ``capture_max_rel_error`` as measured here); the user's file is
    not modified.

    Raises:
        ActivationFormatError: a format violation, or ``model_id`` differs from ``name`` (the
            config entry under ``activations:``).
        CaptureMismatchError: the invariant fails (measured error in the message).
    """
    summary = validate(source, kind=kind, tolerance=tolerance)
    if summary.model_id != name:
        raise ActivationFormatError(
            source,
            f"model_id is {summary.model_id!r} but the config entry activations.{name} names it {name!r}",
            f"rename the entry to {summary.model_id!r} or set model_id = {name!r}",
        )
    with atomic_output(target) as tmp:
        shutil.copyfile(source, tmp)
        with h5py.File(tmp, "r+") as f:
            f.attrs["shard"], f.attrs["n_shards"] = int(shard), int(n_shards)
            if "weights_sha256" not in f.attrs:
                f.attrs["weights_sha256"] = ""
            f.attrs["format_version"] = summary.format_version  # as validated (absent = 1)
            f.attrs["capture_rtol"] = float(INVARIANT_RTOL if tolerance is None else tolerance)
            f.attrs["capture_max_rel_error"] = float(summary.capture_max_rel_error)
            f.attrs["user_source"] = str(Path(source).resolve())
    return summary


_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)?$")


def check_user_config(config: dict) -> None:
    """The checks of ``activations:`` a schema cannot express, at parse time (no file is opened).

    Raises:
        ValueError: a name that is not a model id (letters, digits, ``_ . -``, at most one
            ``/``), a name also in ``vision.models`` / ``text.models``, or a missing file; the
            message names the config key and the fix.
    """
    for name, entry in config.get("activations", {}).items():
        key = f"config key activations.{name}"
        if not _NAME.match(name) or "--" in name:
            raise ValueError(
                f"{key}: the name must be letters, digits, '_', '.', '-' (no '--'), with at most one '/' "
                "(docs/activations.md)"
            )
        if name in config["vision"]["models"] or name in config["text"]["models"]:
            raise ValueError(
                f"{key}: {name} is also in vision.models or text.models; give your activations another name "
                "(docs/activations.md)"
            )
        for i, file in enumerate(entry["files"]):
            if not os.path.isfile(file):
                raise ValueError(
                    f"{key}.files[{i}]: {file} does not exist (relative paths are read from the working directory; "
                    "docs/activations.md)"
                )
