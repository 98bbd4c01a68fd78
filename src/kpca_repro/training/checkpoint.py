"""The training checkpoint: what a run resumes from, written and read without trusting pickles.

After every epoch :func:`kpca_repro.training.loop.train_run` writes a checkpoint (model,
optimizer, scheduler, AMP scaler, EMA, the fixed batches, the rows so far) atomically
(:func:`save_checkpoint`). It holds only tensors and plain values (dict, list, tuple, str, int,
float, bool, None) and is read with ``torch.load(..., weights_only=True)``, which runs no code:
one that carries any other pickled object is refused (:class:`UntrustedCheckpointError`,
:func:`load_checkpoint`), and the run starts afresh (:func:`resumable_state`). A checkpoint is
resumed only by a run of the same :func:`config_fingerprint`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections import OrderedDict
from pathlib import Path

import torch

from kpca_repro.h5io import atomic_output

__all__ = ["config_fingerprint", "UntrustedCheckpointError", "load_checkpoint", "save_checkpoint", "resumable_state"]

log = logging.getLogger(__name__)


def config_fingerprint(*parts) -> str:
    """SHA-256 of the JSON of the given configuration parts (a checkpoint is resumed only if it matches)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


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
        raise UntrustedCheckpointError(
            f"{path}: refused to load the training checkpoint: it is not a dict with fingerprint, epoch, rows, fixed "
            "and model"
        )
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
        raise TypeError(
            f"checkpoint entry {where} is a {type(value).__module__}.{type(value).__name__}, which "
            "torch.load(weights_only=True) would refuse"
        )


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` with ``torch.save``, atomically, after checking it holds only tensors
    and plain values (so :func:`load_checkpoint` can read it back).

    Raises:
        TypeError: an entry of another type (numpy scalars included); names its key path.
    """
    _check_plain(state, "state")
    with atomic_output(path) as tmp:
        torch.save(state, tmp)


def resumable_state(path: str | os.PathLike, fingerprint: str) -> dict | None:
    """The checkpoint at ``path`` if a run of ``fingerprint`` may resume from it, else None.

    None when there is no file; when it belongs to another configuration (its fingerprint
    differs: a warning names it); and when :func:`load_checkpoint` refuses it (a pickled object,
    a truncated file: it is not trusted, a warning names it, and the run that starts afresh
    overwrites it after its first epoch).

    Returns:
        :func:`load_checkpoint`'s state, or None.
    """
    if not Path(path).exists():
        return None
    try:
        state = load_checkpoint(path)
    except UntrustedCheckpointError as exc:
        log.warning("%s; training from epoch 0 instead, and the file will be overwritten", exc)
        return None
    if state.get("fingerprint") != fingerprint:
        log.warning("ignoring %s: it belongs to another configuration (fingerprint differs)", path)
        return None
    return state
