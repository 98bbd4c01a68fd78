"""Stage 1: activation extraction, vision (timm) and text (Hugging Face), to HDF5.

One forward pass per batch captures every layer's q, k, v and h as the attention uses them
(:mod:`kpca_repro.capture.vision`, :mod:`kpca_repro.capture.hf_capture`), checks the capture invariant
(:mod:`kpca_repro.capture.invariant`) and writes the shard's rows (:mod:`kpca_repro.h5io`). Forward
batches are the whole sample's blocks (:func:`kpca_repro.inputs.images.shard_batches`). The forward
passes are :func:`kpca_repro.capture.module_capture.capture_batches`, the loop a user's module
runs through (:func:`kpca_repro.capture.module_capture.record_activations`).

Nothing here imports the method (:mod:`kpca_repro.method`), so an edit to the per-head metrics
does not rerun extraction (its rules' code inputs are the ``inputs`` and ``capture`` stages).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing

import h5py
import numpy as np
import pandas as pd
import torch

from kpca_repro.capture.invariant import INVARIANT_RTOL, check_attention_invariant
from kpca_repro.capture.module_capture import capture_batches
from kpca_repro.capture.vision import CaptureRecorder, UnsupportedArchitectureError, attention_scale, capture_plan, load_timm_model
from kpca_repro.h5io import ActivationWriter, atomic_output
from kpca_repro.inputs import images as img
from kpca_repro.inputs.model_info import MissingModelError
from kpca_repro.inputs.text import load_text_model, tokenize_sample, weights_file
from kpca_repro.smk import library_versions

__all__ = ["extract_vision", "extract_text", "prefetch_batches"]


def prefetch_batches(load: Callable[[str], torch.Tensor], batches: Sequence[Sequence[str]], threads: int) -> Iterator[torch.Tensor]:
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


class _BackgroundWriter:
    """Writes batches to HDF5 on one background thread, one batch at most in flight.

    :meth:`submit` waits for the previous batch's writes (re-raising their error) before it
    queues the next, so at most one captured batch waits in memory. :meth:`wait` must be
    called before the file is closed or its attributes are written.
    """

    def __init__(self, writer: ActivationWriter):
        self.writer = writer
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="h5write")
        self.pending: Future | None = None

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def submit(self, start: int, layers: list[dict[str, np.ndarray]]) -> None:
        self.wait()
        self.pending = self.pool.submit(lambda: [self.writer.write_batch(layer, start, t) for layer, t in enumerate(layers)])

    def close(self, raise_errors: bool = True) -> None:
        """Wait for the last batch and stop the thread; ``raise_errors=False`` while another
        error is already on its way out (that error is the one to report)."""
        try:
            self.wait()
        except Exception:
            if raise_errors:
                raise
        finally:
            self.pool.shutdown(wait=True)


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
) -> None:
    """Run ``model_id`` over the sampled images and write q, k, v, h of every layer to HDF5.

    One forward pass per batch of ``batch_size`` images captures every layer with
    :class:`kpca_repro.capture.vision.CaptureRecorder`: q and k as the attention's dot product uses
    them (after q/k norms and the rotary embedding), v, and h before the output projection
    (:mod:`kpca_repro.capture.vision`), through
    :func:`kpca_repro.capture.module_capture.capture_batches`. Preprocessing is the paper's
    (:func:`kpca_repro.inputs.images.paper_transform`) at the model's input size.

    The capture invariant (:func:`kpca_repro.capture.invariant.check_attention_invariant`) is checked
    on every batch before its layers are written: for every layer, all heads of the batch's
    first and last image must satisfy ``max |h - softmax(s q k^T) v| <= INVARIANT_RTOL *
    max |v|`` with ``s = 1/sqrt(d)``. The largest error of the file is stored in the root
    attributes ``capture_max_rel_error`` / ``capture_max_abs_error`` beside ``capture_rtol``,
    ``capture_heads_checked``, ``attention_scale`` and ``capture_adapter``. The file is
    written under a temporary name and renamed when complete, so a failed check leaves no
    output file.

    Args:
        samples: the whole sampled-image table (``sample_rank``, ``dataset_index``,
            ``path``), in order; the shard's rows are written.
        out_path: the ``.h5`` file to write (layout: :mod:`kpca_repro.h5io`).
        shard: ``(index, count)``: contiguous near-equal blocks of ``samples``
            (:func:`kpca_repro.inputs.images.shard_slice`). Forward batches are the whole sample's
            blocks of ``batch_size`` (:func:`kpca_repro.inputs.images.shard_batches`), so an image's
            activations do not depend on the shard count.
        decode_threads: threads that decode and resize the next batch's images while the
            current batch runs through the model (:func:`prefetch_batches`). The HDF5 writes
            of a batch run on one more thread while the next batch is computed; the file is
            the same as with everything in order.

    Raises:
        kpca_repro.inputs.images.UnreadableImageError: an image cannot be decoded (named).
        kpca_repro.capture.vision.UnsupportedArchitectureError: the model is not one the capture
            supports (one line: model, reason, supported families), or a hook did not fire
            (:class:`kpca_repro.capture.module_capture.HooksDidNotFireError`).
        kpca_repro.capture.invariant.CaptureMismatchError: the captured q, k, v do not reproduce h.
    """
    from kpca_repro.progress import progress as progress_bar

    model = load_timm_model(model_id, weights_path, model_kwargs).to(device)
    plan = capture_plan(model, model_id)
    attns = [attn for attn, _ in plan]
    scale = attention_scale(attns)
    img_size = tuple(model.patch_embed.img_size)
    transform = img.paper_transform(img_size)
    n_prefix = int(getattr(model, "num_prefix_tokens", 1))
    n_tokens = n_prefix + int(model.patch_embed.num_patches)
    heads, head_dim = attns[0].num_heads, attns[0].head_dim
    attrs = {
        "model_id": model_id,
        "weights_sha256": weights_sha256,
        "weights_file": os.path.basename(str(weights_path)),
        "model_kwargs": model_kwargs or {},
        "n_layers": len(attns),
        "n_heads": heads,
        "head_dim": head_dim,
        "n_tokens": n_tokens,
        "n_prefix_tokens": n_prefix,
        "preprocessing": {
            "resize": list(img_size),
            "interpolation": "bilinear (torchvision default, antialias)",
            "normalize_mean": img.IMAGENET_MEAN,
            "normalize_std": img.IMAGENET_STD,
            "reference": "docs/method.md Section 1",
        },
        "versions": library_versions(),
        "shard": shard[0],
        "n_shards": shard[1],
        "dtype": "float32",
        "attention_scale": scale,
        "capture_adapter": "; ".join(dict.fromkeys(adapter.name for _, adapter in plan)),
        "capture_rtol": INVARIANT_RTOL,
        "capture_check": "every batch, every layer: all heads of the first and last image, max |h - softmax(s q k^T) v| / max |v|",
    }
    all_paths = list(samples["path"])
    batches = img.shard_batches(len(samples), shard[1], shard[0], batch_size)
    samples = samples.iloc[img.shard_slice(len(samples), shard[1], shard[0])]
    attrs["inputs"] = [os.path.basename(p) for p in samples["path"]]
    n = len(samples)
    worst_rel, worst_abs, n_checked = 0.0, 0.0, 0
    with atomic_output(out_path) as tmp, h5py.File(tmp, "w", track_order=False) as f:
        writer = ActivationWriter(f, n, len(attns), heads, n_tokens, head_dim, attrs)
        writer.write_index("sample_rank", samples["sample_rank"].to_numpy())
        writer.write_index("dataset_index", samples["dataset_index"].to_numpy())
        background = _BackgroundWriter(writer)
        decoded = prefetch_batches(lambda p: transform(img.load_image(p)), [all_paths[run] for run, _, _ in batches], decode_threads)
        runs = capture_batches(model, CaptureRecorder(plan, model_id), (x.to(device) for x in decoded), model_id=model_id)
        try:
            with closing(runs):  # the hooks are removed when the last batch is done or on an error
                bar = progress_bar(batches, desc=f"extract {model_id}", unit="batch", disable=not progress, mininterval=5)
                for (_run, keep, start), (_x, captured) in zip(bar, runs):
                    checked = sorted({0, keep.stop - keep.start - 1})
                    layers = []
                    for layer, tensors in enumerate(captured):
                        t = {name: a[keep] for name, a in tensors.items()}
                        if t["q"].shape[1:] != (heads, n_tokens, head_dim) or t["h"].shape != t["q"].shape:
                            raise UnsupportedArchitectureError(f"{model_id}: layer {layer} captured q {t['q'].shape}, h {t['h'].shape}; expected (B, {heads}, {n_tokens}, {head_dim})")
                        res = check_attention_invariant(model_id, layer, t["q"], t["k"], t["v"], t["h"], scale=scale, inputs=checked)
                        worst_rel, worst_abs = max(worst_rel, res.max_rel_error), max(worst_abs, res.max_abs_error)
                        n_checked += res.n_heads_checked
                        layers.append(t)
                    background.submit(start, layers)  # every layer checked: written while the next batch runs
        except BaseException:
            decoded.close()
            background.close(raise_errors=False)
            raise
        decoded.close()
        background.close()
        f.attrs["capture_max_rel_error"] = worst_rel
        f.attrs["capture_max_abs_error"] = worst_abs
        f.attrs["capture_heads_checked"] = n_checked


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
) -> None:
    """Run a language model over one shard of a text sample; write q, k, v, h and the mask.

    One forward pass per batch captures every layer with the model family's adapter
    (:mod:`kpca_repro.capture.hf_capture`: q, k, v as the attention uses them, after any rotary
    embedding, such that ``h = softmax(q k^T / sqrt(d) + mask) v``), through
    :func:`kpca_repro.capture.module_capture.capture_batches`. After each batch and
    before anything is written, the capture invariant (:mod:`kpca_repro.capture.invariant`) is checked
    on every layer for all heads of the batch's first and last row, with the padding mask
    (and the local window of Longformer / ModernBERT local layers); a mismatch aborts the
    extraction and no output file is left (writing is atomic).

    The HDF5 layout is the vision one (:mod:`kpca_repro.h5io`: ``/layers/<LL>/q|k|v|h`` of
    shape ``(B, H, N, d)`` float32, ``N`` = the padded length the attention modules see, for
    Longformer its internal padding to a multiple of the attention window) plus
    ``/attention_mask`` ``(B, N)`` int64 (1 = real token). Root attributes: ``model_id``,
    ``model_source``, ``weights_sha256``, ``weights_file``, ``n_layers``, ``n_heads``,
    ``head_dim``, ``n_tokens``, ``hooked_layout``, ``tokenizer`` (JSON), ``max_length``,
    ``padded_length``, ``versions``, ``shard``, ``n_shards``, ``dtype``, ``capture_family``,
    ``capture_rtol`` (the invariant's tolerance) and ``capture_max_rel_error`` (the largest
    measured ``max |h - h_hat| / max |v|`` over the checked heads).

    Args:
        samples: the whole sample (``sample_rank``, ``dataset_index``, ``text``); the
            padding length is taken over all rows, the shard's rows are run.
        shard: ``(index, count)``; rows are split into contiguous near-equal blocks. Forward
            batches are the whole sample's blocks of ``batch_size``
            (:func:`kpca_repro.inputs.images.shard_batches`), so a row's activations do not depend
            on the shard count.
        checksum: expected SHA-256 of the weights file (config ``checksums``), or None.

    Raises:
        kpca_repro.inputs.resources.ChecksumMismatchError: the weights differ from ``checksum``.
        MissingModelError: the model cannot be loaded (id and configuration key named).
        kpca_repro.capture.vision.UnsupportedArchitectureError: the model's attention is refused or
            the hooks do not fit it (one line: model, reason, supported families), or a hook
            did not fire (:class:`kpca_repro.capture.module_capture.HooksDidNotFireError`).
        kpca_repro.capture.invariant.CaptureMismatchError: the stored q, k, v do not reproduce h.
    """
    from kpca_repro.capture.hf_capture import HFAttentionRecorder, attention_modules, check_capture, check_text_model
    from kpca_repro.capture.invariant import INVARIANT_RTOL
    from kpca_repro.inputs.images import shard_batches, shard_slice
    from kpca_repro.inputs.resources import check_checksum
    from kpca_repro.progress import progress as progress_bar

    check_text_model(model_id, source)  # refuse from config.json before loading any weights
    model, tokenizer = load_text_model(model_id, source, offline)
    wf = weights_file(model_id, source)
    if wf is None and checksum:
        raise MissingModelError(f"{model_id}: no model.safetensors or pytorch_model.bin found in {source} to check against config key checksums")
    model = model.to(device)
    attns = attention_modules(model, model_id)
    enc = tokenize_sample(tokenizer, list(samples["text"]), max_length)
    rows = shard_slice(len(samples), shard[1], shard[0])
    part = samples.iloc[rows]
    batches = shard_batches(len(samples), shard[1], shard[0], batch_size)
    n, padded = len(part), int(enc["input_ids"].shape[1])
    heads, head_dim = attns[0].n_heads, attns[0].head_dim
    attrs = {
        "model_id": model_id,
        "model_source": "hub" if source == model_id else os.path.basename(os.path.normpath(source)),
        "weights_sha256": check_checksum(wf, checksum) if wf is not None else "",
        "weights_file": wf.name if wf is not None else "",
        "n_layers": len(attns),
        "n_heads": heads,
        "head_dim": head_dim,
        "tokenizer": {
            "class": type(tokenizer).__name__,
            "padding": "longest row of the sample",
            "truncation": True,
            "max_length": max_length,
            "padding_side": getattr(tokenizer, "padding_side", "right"),
            "reference": "docs/method.md Section 3",
        },
        "max_length": max_length,
        "padded_length": padded,
        "versions": library_versions(),
        "shard": shard[0],
        "n_shards": shard[1],
        "dtype": "float32",
        "capture_family": attns[0].family.name,
        "capture_rtol": INVARIANT_RTOL,
    }
    with atomic_output(out_path) as tmp, h5py.File(tmp, "w", track_order=False) as f:
        writer, max_error = None, 0.0
        rec = HFAttentionRecorder(attns)
        inputs = ({k: v[run].to(device) for k, v in enc.items()} for run, _, _ in batches)
        with closing(capture_batches(model, rec, inputs, model_id=model_id)) as runs:
            bar = progress_bar(batches, desc=f"extract {model_id}", unit="batch", disable=not progress, mininterval=5)
            for (_run, keep, start), (_batch, captured) in zip(bar, runs):
                n_tokens = int(captured[0]["k"].shape[2])
                if writer is None:
                    if n_tokens < padded or any(layout != rec.layouts[0] for layout in rec.layouts):
                        raise UnsupportedArchitectureError(f"{model_id}: the attention modules see {n_tokens} tokens for {padded} input tokens, or mixed layouts {rec.layouts}")
                    attrs.update(n_tokens=n_tokens, hooked_layout=rec.layouts[0])
                    writer = ActivationWriter(f, n, len(attns), heads, n_tokens, head_dim, attrs)
                    writer.write_index("sample_rank", part["sample_rank"].to_numpy())
                    writer.write_index("dataset_index", part["dataset_index"].to_numpy())
                    mask = np.zeros((n, n_tokens), dtype=np.int64)
                    mask[:, :padded] = enc["attention_mask"][rows].numpy()
                    writer.write_attention_mask(mask)
                layers = [{name: a[keep] for name, a in tensors.items()} for tensors in captured]
                key_mask = mask[start : start + keep.stop - keep.start]
                max_error = max(max_error, check_capture(model_id, attns, layers, key_mask=key_mask))
                for layer, tensors in enumerate(layers):
                    writer.write_batch(layer, start, tensors)
        f.attrs["capture_max_rel_error"] = max_error
