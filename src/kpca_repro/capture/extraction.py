"""Stage 1: activation extraction, vision (timm) and text (Hugging Face), to HDF5.

Two adapters of the one extraction loop, :func:`kpca_repro.capture.module_capture.record_activations`
(a user's module runs through it too): each loads its model, builds its recorder
(:mod:`kpca_repro.capture.vision`, :mod:`kpca_repro.capture.hf_capture`), its forward batches and
the attributes only it knows, then :func:`_record` runs the loop over the shard (the capture
invariant on every batch, the file written by :class:`kpca_repro.activations.ActivationWriter`,
layout in docs/activations.md Section 1). Forward batches are the whole sample's blocks
(:func:`kpca_repro.inputs.images.shard_batches`), so a row's activations do not depend on the
shard count; the shard keeps its own rows. A job may keep its finished forward batches
(argument ``resume``, :class:`kpca_repro.resume.PartStore`) so that a rerun goes on after them.

Nothing here imports the method (:mod:`kpca_repro.method`), so an edit to the per-head metrics
does not rerun extraction (its rules' code inputs are the ``inputs`` and ``capture`` stages).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import pandas as pd
import torch
from torch import nn

from kpca_repro.capture.module_capture import HeadCapture, record_activations
from kpca_repro.capture.vision import CaptureRecorder, capture_plan, load_timm_model
from kpca_repro.inputs import images as img
from kpca_repro.inputs.model_info import MissingModelError
from kpca_repro.inputs.text import load_text_model, tokenize_sample, weights_file
from kpca_repro.resume import PartStore
from kpca_repro.smk import library_versions

__all__ = ["extract_vision", "extract_text", "prefetch_batches", "CPU_FORWARD_BATCH", "forward_batch_size"]

_LOG = logging.getLogger("kpca_repro.extraction")

#: Images (rows) per forward pass of an extraction job on the CPU under ``batch_size: auto``.
CPU_FORWARD_BATCH = 25


def forward_batch_size(setting: int | str, device, n_inputs: int) -> int:
    """Inputs per forward pass of an extraction job (``vision.batch_size``, ``text.batch_size``).

    ``"auto"``: :data:`CPU_FORWARD_BATCH` on the CPU (bounded memory; on the CPU these passes
    give the authors' one-pass q, k, v bit for bit, docs/fidelity.md "Batching"); on a GPU every
    input of the shard in one pass, as the authors' scripts run them, because a cuBLAS GEMM of
    another batch shape may round differently. An int: that many (at most ``n_inputs``).

    Raises:
        ValueError: any other setting.
    """
    if setting == "auto":
        return max(1, n_inputs) if torch.device(device).type != "cpu" else min(CPU_FORWARD_BATCH, max(1, n_inputs))
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return min(setting, max(1, n_inputs))
    raise ValueError(f"a forward batch size is 'auto' or a positive integer, got {setting!r}")


def prefetch_batches(
    load: Callable[[str], torch.Tensor], batches: Sequence[Sequence[str]], threads: int
) -> Iterator[torch.Tensor]:
    """Yield ``torch.stack([load(p) for p in batch])`` for each batch, decoding ahead.

    A pool of ``threads`` threads decodes and transforms the next batch's images while the
    caller runs the forward pass of the current one (PIL's decoder and resampler and torch's
    tensor operations release the GIL). At most one batch ahead is held, so memory stays at
    two batches of images. Batches come out in order; an image that cannot be read raises
    its :class:`kpca_repro.inputs.images.UnreadableImageError` when its batch is reached.

    Args:
        load: path -> image tensor ``(3, H, W)`` float32.
        batches: image paths per batch.
        threads: decoding threads (at least 1).

    Raises:
        ValueError: ``threads`` below 1.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="decode")
    try:
        ahead = [pool.submit(load, p) for p in batches[0]] if len(batches) else []
        for i in range(len(batches)):
            current = ahead
            ahead = [pool.submit(load, p) for p in batches[i + 1]] if i + 1 < len(batches) else []
            yield torch.stack([f.result() for f in current])
    finally:  # also when the caller stops early: drop what was not started
        pool.shutdown(wait=True, cancel_futures=True)


def _part_store(
    resume: tuple[str | os.PathLike, dict] | None, attrs: dict, shard: tuple[int, int], n_batches: int
) -> tuple[PartStore | None, int]:
    """The store of an extraction job's finished batches and how many of them are kept (0 without ``resume``).

    ``resume`` is ``(directory, key)``; the store's key adds the file's attributes known before
    the first forward pass (the weights' SHA-256, the inputs, the preprocessing or tokenizer),
    the shard and the library versions, so a batch of other weights or inputs is never reused.
    A job of one forward batch (on a GPU, ``batch_size: auto``) keeps nothing: a rerun would redo it all the same.
    """
    if resume is None or n_batches < 2:
        return None, 0
    store = PartStore(resume[0], {**resume[1], "attrs": attrs, "shard": list(shard), "versions": library_versions()})
    kept = store.finished()
    if kept:
        _LOG.info("resuming after %d of %d batches kept in %s", kept, n_batches, store.directory)
    return store, kept


def _record(
    model: nn.Module,
    capture: HeadCapture,
    inputs: Iterable,
    samples: pd.DataFrame,
    out_path,
    *,
    model_id,
    attrs: dict,
    shard,
    batches: list,
    progress: bool,
    windows=None,
    store=None,
    kept=0,
) -> None:
    """Both adapters' loop: one shard of ``samples`` through :func:`record_activations`.

    ``inputs`` are the forward batches, one per ``(run, keep, offset)`` of ``batches``
    (:func:`kpca_repro.inputs.images.shard_batches`), in order, after the ``kept`` batches of
    ``store`` (:func:`_part_store`). The invariant is checked on all heads of each batch's first
    and last kept row (the float64 recomputation of every row would cost as much as the forward pass).

    Raises:
        As :func:`record_activations`; no file is left.
    """
    from kpca_repro.progress import progress as progress_bar

    rows = samples.iloc[img.shard_slice(len(samples), shard[1], shard[0])]
    bar = progress_bar(
        inputs, total=len(batches) - kept, desc=f"extract {model_id}", unit="batch", disable=not progress, mininterval=5
    )
    record_activations(
        model, capture, bar, out_path, model_id=model_id,
        attrs={**attrs, "versions": library_versions(), "shard": shard[0], "n_shards": shard[1]},
        sample_rank=rows["sample_rank"].to_numpy(), dataset_index=rows["dataset_index"].to_numpy(),
        keep=[keep for _, keep, _ in batches], check="the first and last input", windows=windows, store=store,
    )  # fmt: skip


def extract_vision(
    model_id: str,
    weights_path: str | os.PathLike,
    weights_sha256: str,
    samples: pd.DataFrame,
    out_path: str | os.PathLike,
    *,
    batch_size: int,
    device: torch.device,
    model_kwargs: dict | None = None,
    shard: tuple[int, int] = (0, 1),
    progress: bool = True,
    decode_threads: int = 2,
    resume: tuple[str | os.PathLike, dict] | None = None,
) -> None:
    """Run ``model_id`` over the sampled images and write q, k, v, h of every layer to HDF5.

    :class:`kpca_repro.capture.vision.CaptureRecorder` captures q and k as the attention's dot
    product uses them (after q/k norms and the rotary embedding), v, and h before the output
    projection, through :func:`_record`. Preprocessing is the paper's
    (:func:`kpca_repro.inputs.images.paper_transform`) at the model's input size. Attributes of
    its own: ``weights_file``, ``model_kwargs``, ``n_prefix_tokens``, ``preprocessing``,
    ``inputs`` (the shard's image file names).

    Args:
        samples: the whole sampled-image table (``sample_rank``, ``dataset_index``,
            ``path``), in order; the shard's rows are written.
        out_path: the ``.h5`` file to write.
        shard: ``(index, count)``: contiguous near-equal blocks of ``samples``
            (:func:`kpca_repro.inputs.images.shard_slice`).
        decode_threads: threads that decode and resize the next batch's images while the
            current batch runs through the model (:func:`prefetch_batches`).
        resume: ``(directory, key)`` of a :class:`kpca_repro.resume.PartStore` keeping each
            finished forward batch (key: the job's inputs, parameters and code; the weights'
            SHA-256 and the inputs are added); a rerun decodes and forwards only the batches
            after the kept ones. The directory goes once the file is written.

    Raises:
        kpca_repro.inputs.images.UnreadableImageError: an image cannot be decoded (named).
        kpca_repro.capture.vision.UnsupportedArchitectureError: the model is not one the capture
            supports (one line: model, reason, supported families), or a hook did not fire
            (:class:`kpca_repro.capture.module_capture.HooksDidNotFireError`).
        kpca_repro.activations.CaptureMismatchError: the captured q, k, v do not reproduce h; no file is left.
    """
    model = load_timm_model(model_id, weights_path, model_kwargs).to(device)
    plan = capture_plan(model, model_id)
    img_size = tuple(model.patch_embed.img_size)
    transform = img.paper_transform(img_size)
    attrs = {
        "weights_sha256": weights_sha256,
        "weights_file": os.path.basename(str(weights_path)),
        "model_kwargs": model_kwargs or {},
        "n_prefix_tokens": int(getattr(model, "num_prefix_tokens", 1)),
        "preprocessing": {
            "resize": list(img_size),
            "interpolation": "bilinear (torchvision default, antialias)",
            "normalize_mean": img.IMAGENET_MEAN,
            "normalize_std": img.IMAGENET_STD,
            "reference": "docs/method.md Section 1",
        },
        "inputs": [
            os.path.basename(p) for p in samples["path"].iloc[img.shard_slice(len(samples), shard[1], shard[0])]
        ],
    }
    paths, batches = list(samples["path"]), img.shard_batches(len(samples), shard[1], shard[0], batch_size)
    store, kept = _part_store(resume, attrs, shard, len(batches))
    with closing(
        prefetch_batches(
            lambda p: transform(img.load_image(p)), [paths[run] for run, _, _ in batches[kept:]], decode_threads
        )
    ) as decoded:  # decoding stops on an error
        inputs = (x.to(device) for x in decoded)
        _record(
            model,
            CaptureRecorder(plan, model_id),
            inputs,
            samples,
            out_path,
            model_id=model_id,
            attrs=attrs,
            shard=shard,
            batches=batches,
            progress=progress,
            store=store,
            kept=kept,
        )


def extract_text(
    model_id: str,
    source: str,
    samples: pd.DataFrame,
    out_path: str | os.PathLike,
    *,
    shard: tuple[int, int] = (0, 1),
    batch_size: int,
    max_length: int,
    device: torch.device,
    offline: bool,
    checksum: str | None = None,
    progress: bool = True,
    revision: str | None = None,
    decoder: bool = False,
    resume: tuple[str | os.PathLike, dict] | None = None,
) -> None:
    """Run a language model over one shard of a text sample; write q, k, v, h and the mask.

    The model family's adapter (:mod:`kpca_repro.capture.hf_capture`: q, k, v as the attention
    uses them, after any rotary embedding, such that ``h = softmax(q k^T / sqrt(d) + mask) v``)
    captures every layer through :func:`_record`; the invariant is checked with the padding mask
    and the local window of Longformer / ModernBERT local layers. ``N`` is the padded length the
    attention modules see (Longformer: its internal padding to a multiple of the attention
    window, stored as padding in ``/attention_mask``). Attributes of its own:
    ``model_source``, ``weights_file``, ``tokenizer`` (JSON), ``max_length``, ``padded_length``
    and, from the recorder, ``hooked_layout``.

    A decoder (``decoder``; config ``decoders.models``) is loaded at ``revision`` with eager
    attention, its rows padded on the tokenizer's side (with the eos token when it has no pad
    token), run with ``position_ids`` from the mask as generation computes them
    (:func:`kpca_repro.capture.hf_capture.decoder_position_ids`: a row's real tokens sit at
    the same positions on either padding side) and without a generation cache, and written
    as format version 2: ``causal`` and,
    with grouped-query attention, k and v per KV head with ``kv_head_of_query``; the
    invariant's mask is causal. Attribute of its own: ``revision``.

    Args:
        samples: the whole sample (``sample_rank``, ``dataset_index``, ``text``); the
            padding length is taken over all rows, the shard's rows are run.
        shard: ``(index, count)``; rows are split into contiguous near-equal blocks.
        checksum: expected SHA-256 of the weights file (config ``checksums``), or None.
        revision: hub revision of model and tokenizer (config ``decoders.revisions``), or None.
        decoder: a model of ``decoders.models`` (an encoder family is refused, and conversely).
        resume: as :func:`extract_vision`'s (the forward batches after the kept ones run).

    Raises:
        kpca_repro.inputs.resources.ChecksumMismatchError: the weights differ from ``checksum``.
        MissingModelError: the model cannot be loaded (id and configuration key named).
        kpca_repro.capture.vision.UnsupportedArchitectureError: the model's attention is refused or
            the hooks do not fit it (one line: model, reason, supported families; a decoder's
            sliding window shorter than the padded rows), or a hook did not fire
            (:class:`kpca_repro.capture.module_capture.HooksDidNotFireError`).
        kpca_repro.activations.CaptureMismatchError: the stored q, k, v do not reproduce h; no file is left.
    """
    from kpca_repro.capture.hf_capture import (
        HFAttentionRecorder,
        attention_modules,
        check_rows,
        check_text_model,
        decoder_position_ids,
        hf_family,
    )
    from kpca_repro.inputs.resources import check_checksum

    check_text_model(
        model_id, source, decoder=decoder, revision=revision
    )  # refuse from config.json before loading any weights
    model, tokenizer = load_text_model(model_id, source, offline, revision=revision, decoder=decoder)
    hf_family(model.config, model_id, text=True, decoder=decoder)  # a hub model not in the cache was not checked above
    wf = weights_file(model_id, source, revision)
    if wf is None and checksum:
        raise MissingModelError(
            f"{model_id}: no model.safetensors or pytorch_model.bin found in {source} to check against config key "
            "checksums"
        )
    model = model.to(device)
    attns = attention_modules(model, model_id)
    enc = tokenize_sample(tokenizer, list(samples["text"]), max_length)
    if decoder:
        check_rows(model.config, model_id, int(enc["input_ids"].shape[1]))
    attrs = {
        "model_source": "hub" if source == model_id else os.path.basename(os.path.normpath(source)),
        "weights_sha256": check_checksum(wf, checksum) if wf is not None else "",
        "weights_file": wf.name if wf is not None else "",
        "tokenizer": {
            "class": type(tokenizer).__name__,
            "padding": "longest row of the sample",
            "truncation": True,
            "max_length": max_length,
            "padding_side": getattr(tokenizer, "padding_side", "right"),
            "reference": "docs/method.md Section 3",
        },
        "max_length": max_length,
        "padded_length": int(enc["input_ids"].shape[1]),
    }
    if decoder:
        attrs["revision"] = revision or ""
        attrs["tokenizer"]["pad_token"] = tokenizer.pad_token + (
            " (the eos token)" if tokenizer.pad_token == tokenizer.eos_token else ""
        )
    batches = img.shard_batches(len(samples), shard[1], shard[0], batch_size)
    store, kept = _part_store(resume, attrs, shard, len(batches))

    def forward_batch(run):
        batch = {k: v[run].to(device) for k, v in enc.items()}
        if (
            decoder
        ):  # positions from the mask, as generation; no generation cache (it would only hold copies of k and v)
            batch.update(position_ids=decoder_position_ids(batch["attention_mask"]), use_cache=False)
        return batch

    inputs = (forward_batch(run) for run, _, _ in batches[kept:])
    _record(
        model, HFAttentionRecorder(attns), inputs, samples, out_path, model_id=model_id, attrs=attrs, shard=shard,
        batches=batches, progress=progress, windows=[a.window for a in attns], store=store, kept=kept,
    )  # fmt: skip
