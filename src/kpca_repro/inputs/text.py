"""Language models (Table 4): the WikiText sample, Hugging Face encoders, hooks, extraction.

docs/method.md Section 3 (the paper's ``nlp_value_vectors.py``) and Section 15 item 4:

* Text: the WikiText-103 raw test split, one dataset row per line (``datasets`` keeps the
  trailing ``"\\n"`` and the leading space of every row); rows whose stripped length exceeds
  ``min_chars`` (30) form the corpus, and ``random.seed(seed); random.sample(corpus, n)``
  draws the sample (:func:`sample_rows`).
* Models: ``transformers.AutoModel`` / ``AutoTokenizer(use_fast=True)`` from the hub, or
  from a local directory mapped to the Hugging Face id (config ``text.local_models``,
  :func:`model_source`); decoders (``decoders.models``) at their pinned revision, with eager
  attention, padded with the eos token when the tokenizer has no pad token.
* Tokenization: padding to the longest row of the whole sample, truncation at
  ``max_length`` (128) tokens; the model runs with its own attention mask.
* Capture (:mod:`kpca_repro.capture.hf_capture`): the model family's adapter hooks every
  self-attention module, found by structure, and stores the per-head q, k, v the
  attention uses (for BERT-style models the ``query/key/value`` Linear outputs, as the
  reference; after the rotary embedding for RoFormer, ESM and ModernBERT) and h, the
  per-head output before the output projection, computed by the model itself (its own
  mask; Longformer: its own sliding-window pattern, computed on ``(sequence, batch,
  hidden)`` tensors and stored batch-first). Unsupported attentions are refused from the
  configuration (:func:`kpca_repro.capture.hf_capture.check_text_model`) and every batch passes
  the capture invariant (:mod:`kpca_repro.activations`) before it is written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from kpca_repro.errors import InputFileError
from kpca_repro.h5io import atomic_output
from kpca_repro.inputs.images import sample_indices
from kpca_repro.inputs.model_info import MissingModelError
from kpca_repro.inputs.model_info import missing_model_message as _missing_message

if TYPE_CHECKING:  # torch only where a model is loaded: the sampling job imports this module without it
    import torch
    from torch import nn

__all__ = [
    "WIKITEXT",
    "UnreadableTextError",
    "load_text_model",
    "weights_file",
    "read_text_rows",
    "sample_rows",
    "write_samples",
    "read_samples",
    "download_wikitext",
    "tokenize_sample",
]

#: ``datasets.load_dataset`` arguments of the paper's text (docs/method.md 3).
WIKITEXT = {"path": "Salesforce/wikitext", "name": "wikitext-103-raw-v1", "split": "test"}


def load_text_model(
    model_id: str, source: str, offline: bool, revision: str | None = None, decoder: bool = False
) -> tuple[nn.Module, object]:
    """``AutoModel`` and fast ``AutoTokenizer`` from ``source`` (docs/method.md 3).

    Args:
        revision: the hub revision (commit, branch or tag; config ``decoders.revisions``) of
            model and tokenizer; ignored for a local directory. None: the default branch.
        decoder: a decoder (``decoders.models``): loaded with eager attention (the model's own
            softmax of its masked logits, no fused kernel), and a tokenizer without a pad token
            pads with its eos token (the attention mask marks the padding either way).

    Returns:
        ``(model, tokenizer)``, the model in eval mode, float32, on the CPU; the tokenizer
        pads on its own side (``padding_side``, left or right).

    Raises:
        MissingModelError: the files cannot be found or downloaded (id and key named), or a
            decoder's tokenizer has neither a pad nor an eos token.
    """
    from transformers import AutoModel, AutoTokenizer

    local = offline or os.path.isdir(source)
    where = {
        "local_files_only": local,
        **({"revision": revision} if revision is not None and not os.path.isdir(source) else {}),
    }
    try:
        model = AutoModel.from_pretrained(source, **where, **({"attn_implementation": "eager"} if decoder else {}))
        tokenizer = AutoTokenizer.from_pretrained(source, use_fast=True, **where)
    except OSError as exc:
        raise MissingModelError(_missing_message(model_id, f"{type(exc).__name__}: {exc}")) from exc
    if decoder and tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise MissingModelError(
                f"{model_id}: its tokenizer has neither a pad token nor an eos token to pad the sample's rows with; "
                "give it a pad_token (tokenizer_config.json)"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval().float(), tokenizer


def weights_file(model_id: str, source: str, revision: str | None = None) -> Path | None:
    """The weights file behind a loaded model (``model.safetensors`` or ``pytorch_model.bin``; of ``revision`` in the
    hub cache)."""
    names = ("model.safetensors", "pytorch_model.bin")
    if os.path.isdir(source):
        for name in names:
            if (Path(source) / name).is_file():
                return Path(source) / name
        return None
    from huggingface_hub import try_to_load_from_cache

    for name in names:
        hit = try_to_load_from_cache(model_id, name, revision=revision)
        if isinstance(hit, str):
            return Path(hit)
    return None


# --------------------------------------------------------------------------------------
# Text sample
# --------------------------------------------------------------------------------------


class UnreadableTextError(InputFileError, ValueError):
    """The WikiText file is empty, binary or too short for the sample; the message names it and the fix."""


#: What replaces a bad WikiText file (the rule ``download_wikitext`` fetches a missing one).
_TEXT_SOURCE = (
    "wiki.test.raw of wikitext-103-raw-v1 (one dataset row per line), or delete it and run with offline: false "
    "to download it again"
)


def read_text_rows(path: str | os.PathLike) -> list[str]:
    """Dataset rows of a raw WikiText file: one row per line, trailing ``"\\n"`` kept.

    Raises:
        UnreadableTextError: the file is not UTF-8 text, holds NUL bytes (binary) or has no
            non-blank row; the message names it and the fix.
    """
    try:
        with open(path, encoding="utf-8") as f:
            rows = list(f)
    except UnicodeDecodeError as exc:
        raise UnreadableTextError(
            f"text file {path} is binary, not UTF-8 text ({exc.reason}). Replace it with {_TEXT_SOURCE}"
        ) from None
    if any("\x00" in row for row in rows):
        raise UnreadableTextError(f"text file {path} is binary (it holds NUL bytes). Replace it with {_TEXT_SOURCE}")
    if not any(row.strip() for row in rows):
        raise UnreadableTextError(f"text file {path} is empty (no non-blank row). Replace it with {_TEXT_SOURCE}")
    return rows


def sample_rows(
    rows: list[str], n: int, min_chars: int, seed: int, source: str | os.PathLike | None = None
) -> pd.DataFrame:
    """The paper's text sample (docs/method.md 3).

    ``corpus = [r for r in rows if len(r.strip()) > min_chars]`` (rows kept unstripped),
    then ``random.seed(seed); random.sample(corpus, n)``. Blank rows never enter the corpus,
    so a file with or without the split's empty rows gives the same sample.

    Args:
        source: the file the rows come from, named in the error.

    Returns:
        ``sample_rank, dataset_index, text`` in draw order; ``dataset_index`` is the position
        in the filtered corpus (the population ``random.sample`` draws from).

    Raises:
        ValueError: fewer than ``n`` rows pass the filter (:class:`UnreadableTextError`, naming
            ``source``, when it is given).
    """
    corpus = [r for r in rows if len(r.strip()) > min_chars]
    if source is not None and len(corpus) < n:
        raise UnreadableTextError(
            f"text file {source} has {len(corpus)} rows longer than {min_chars} characters, {n} requested. Lower "
            f"text.n_rows, or replace it with {_TEXT_SOURCE}"
        )
    idx = sample_indices(len(corpus), n, seed)
    return pd.DataFrame({"sample_rank": range(n), "dataset_index": idx, "text": [corpus[i] for i in idx]})


def write_samples(table: pd.DataFrame, path: str | os.PathLike) -> None:
    """Write a text-sample table as TSV (``sample_rank, dataset_index, text``), atomically."""
    with atomic_output(path) as tmp:
        table[["sample_rank", "dataset_index", "text"]].to_csv(tmp, sep="\t", index=False)


def read_samples(path: str | os.PathLike) -> pd.DataFrame:
    """Read a text-sample TSV back with every text exactly as written (no NA conversion)."""
    return pd.read_csv(path, sep="\t", keep_default_na=False, dtype={"text": str})


def download_wikitext(out_path: str | os.PathLike, source: dict | None = None, *, policy=None, log=None) -> None:
    """Fetch the WikiText-103 raw test split with ``datasets`` and save one row per line.

    Args:
        out_path: ``<resources>/text/wikitext-103/wiki.test.raw``.
        source: ``{dataset, name, split, revision}`` (``downloads.wikitext``); default
            :data:`WIKITEXT` at ``main``. ``HF_ENDPOINT`` selects a hub mirror.
        policy: a :class:`kpca_repro.inputs.resources.DownloadPolicy` (retries and pause).
        log: where retry lines go.

    Raises:
        kpca_repro.inputs.resources.MissingResourceError: every attempt failed; the message names
            the dataset, its revision and the path to fill by hand.
    """
    from kpca_repro.inputs.resources import DownloadPolicy, MissingResourceError, missing_message, with_retries

    src = dict(
        source
        or {"dataset": WIKITEXT["path"], "name": WIKITEXT["name"], "split": WIKITEXT["split"], "revision": "main"}
    )
    policy = policy or DownloadPolicy()
    call = f"load_dataset({src['dataset']!r}, {src['name']!r}, split={src['split']!r}, revision={src['revision']!r})"

    def load():
        from datasets import load_dataset

        return load_dataset(src["dataset"], src["name"], split=src["split"], revision=src["revision"])["text"]

    try:
        rows = with_retries(load, what="WikiText-103", source=call, policy=policy, log=log)
    except Exception as exc:
        raise MissingResourceError(
            missing_message(
                out_path,
                "WikiText-103 raw test split",
                f"{call} failed {policy.retries + 1} times (last: {type(exc).__name__}: {exc}). Put wiki.test.raw of "
                "wikitext-103-raw-v1 there.",
            )
        ) from exc
    with atomic_output(out_path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(row if row.endswith("\n") else row + "\n")


# --------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------


def tokenize_sample(tokenizer, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    """``tokenizer(texts, padding=True, truncation=True, max_length=max_length)`` (docs/method.md 3).

    All texts of the sample at once, so every row is padded to the longest row of the whole
    sample (at most ``max_length``) whatever the shard or batch size.
    """
    return dict(tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"))
