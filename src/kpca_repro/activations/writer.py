"""The one writer of activation files (format version 2): the pipeline's extraction and a user's
module through :class:`ActivationWriter` (:func:`kpca_repro.capture.module_capture.record_activations`),
arrays through :func:`write_activations`. The capture invariant is checked before anything is written."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import h5py
import numpy as np

from kpca_repro.activations.format import (
    _SCALE_RTOL,
    FORMAT_VERSION,
    INVARIANT_RTOL,
    TENSORS,
    Summary,
    _kv_map_problem,
    layer_key,
)
from kpca_repro.activations.invariant import attention_mask_matrix, check_attention_invariant, half_precision_problem
from kpca_repro.h5io import atomic_output

__all__ = ["ActivationWriter", "write_activations"]


class ActivationWriter:
    """The one writer of activation files: batches of per-head q, k, v, h in, one file of format 2 out.

    A context manager: the file is written under a temporary name and renamed to ``path`` when
    the block ends without an error (:func:`kpca_repro.h5io.atomic_output`), so a refused batch
    leaves no file; call :meth:`finish` last inside the block. :meth:`add` checks a batch before
    any of it is written (shapes, padding mask, the capture invariant on every layer), then writes
    it on one background thread while the caller computes the next batch (the bytes are those of
    writing in order). Datasets are chunked one input per chunk, nothing records a time, so
    identical runs give identical files.

    Args:
        path: the ``.h5`` file.
        model_id: the name the tables show (attribute ``model_id``; named in errors).
        n_inputs: the file's number of inputs B when known (fixed-size datasets); None: the
            datasets grow with each batch.
        check: the inputs of each batch whose heads the invariant checks, stored as
            ``capture_check``: ``"every input"``, ``"the first and last input"`` (the pipeline's
            extraction: recomputing the attention in float64 costs as much as the forward
            pass), or None (not checked: q, k, v, h that are no attention's, e.g. synthetic data).
        windows: per layer, a one-sided local attention window ``|i - j| <= w`` or None (the
            pipeline's Longformer and ModernBERT; the format itself knows key padding and the
            causal mask only).
        tolerance: the invariant's tolerance (default :data:`INVARIANT_RTOL`).
        causal: query i attends to keys j <= i only (a decoder; attribute ``causal``).
        kv_head_of_query: ``(n_heads,)`` integers, the KV head each query head reads
            (grouped-query attention; :func:`repeat_kv_map` for Hugging Face's ``repeat_kv``);
            k and v then hold ``max + 1`` heads, each read by some query head. None: the
            identity (k, v with ``n_heads`` heads).

    Raises:
        ValueError: ``kv_head_of_query`` is not a 1-D array of KV heads ``0 .. n - 1`` each read by some query head.
    """

    def __init__(
        self,
        path,
        *,
        model_id: str,
        n_inputs: int | None = None,
        check: str | None = "every input",
        windows: Sequence[int | None] | None = None,
        tolerance: float | None = None,
        causal: bool = False,
        kv_head_of_query=None,
    ):
        self.path, self.model_id, self.n_inputs, self.check, self.windows = (
            Path(path),
            model_id,
            n_inputs,
            check,
            windows,
        )
        self.tolerance = INVARIANT_RTOL if tolerance is None else float(tolerance)
        self.causal = bool(causal)
        self.kv_map = None if kv_head_of_query is None else np.asarray(kv_head_of_query).reshape(-1)
        if self.kv_map is not None:
            problem = _kv_map_problem(self.kv_map, len(self.kv_map), int(self.kv_map.max(initial=-1)) + 1)
            if problem:
                raise ValueError(f"{model_id}: kv_head_of_query {problem}")
            self.kv_map = self.kv_map.astype(np.int64)
        self.shape: tuple[int, int, int, int] | None = None  # (L, H, N, d) of the first batch
        self.rows, self.masks, self.errors = 0, [], (0.0, 0.0, 0)  # errors: max relative, max absolute, heads checked
        self._pending: Future | None = None

    def __enter__(self) -> ActivationWriter:
        with ExitStack() as stack:
            tmp = stack.enter_context(atomic_output(self.path))
            self.f = stack.enter_context(h5py.File(tmp, "w", track_order=False))
            self._pool = stack.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix="h5write"))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc):
        # the pool first (it waits for the last write; an error in it is lost only behind another), then the file,
        # then the rename
        return self._stack.__exit__(*exc)

    def add(self, layers: Sequence[Mapping[str, np.ndarray]], mask: np.ndarray | None = None) -> None:
        """Check one batch and queue its writes.

        Args:
            layers: one mapping per layer, ``"q" | "h"`` -> ``(b, H, N, d)`` and ``"k" | "v"`` ->
                ``(b, H_kv, N, d)`` float32 numpy arrays (``H_kv`` = ``H`` without
                ``kv_head_of_query``); the first batch fixes L, H, N and d.
            mask: ``(b, W)`` 0/1 (1 = real token), ``W <= N``, or None (every token real). The
                ``N - W`` positions the model padded itself (Longformer: to a multiple of its
                window) are stored as padding. A file has ``/attention_mask`` when any batch had one.

        Raises:
            ValueError: shapes differ from the first batch's, or the mask is wider than N, not
                0/1, or has an input without real tokens.
            CaptureMismatchError: a layer's q, k, v do not reproduce its h (nothing of the
                batch is written).
        """
        b = layers[0]["q"].shape[0]
        if self.shape is None:
            if self.kv_map is not None and len(self.kv_map) != layers[0]["q"].shape[1]:
                raise ValueError(
                    f"{self.model_id}: kv_head_of_query has {len(self.kv_map)} entries, q has "
                    f"{layers[0]['q'].shape[1]} heads"
                )
            self._create(len(layers), *layers[0]["q"].shape[1:])
        n_layers, n_heads, n_tokens, d = self.shape
        n_kv = self._n_kv()
        want = {t: (b, n_kv if t in "kv" else n_heads, n_tokens, d) for t in TENSORS}
        if len(layers) != n_layers or any(tuple(x[t].shape) != want[t] for x in layers for t in TENSORS):
            got = f"{len(layers)} layers of {sorted({(t, tuple(x[t].shape)) for x in layers for t in TENSORS})}"
            raise ValueError(
                f"{self.model_id}: every layer's q, h must be (b, H, N, d) = {want['q']} and k, v (b, H_kv, N, d) = "
                f"{want['k']} in all {n_layers} layers; got {got}"
            )
        if mask is not None:
            mask = np.asarray(mask, dtype=np.int64)
            if mask.shape[0] != b or mask.shape[1] > n_tokens:
                raise ValueError(
                    f"{self.model_id}: the attention sees {n_tokens} tokens of {b} inputs, the padding mask is "
                    f"{mask.shape}"
                )
            mask = np.pad(mask, ((0, 0), (0, n_tokens - mask.shape[1])))
            if not np.isin(mask, (0, 1)).all() or not mask.any(axis=1).all():
                raise ValueError(
                    f"{self.model_id}: the padding mask must be 0/1 (1 = real token) with a real token in every input"
                )
        if b == 0:  # nothing to check or write (a user's last batch may be empty)
            return
        if self.check is not None:
            self._check_invariant(layers, mask)
        self.masks.append((b, mask))
        start, self.rows = self.rows, self.rows + b
        self._wait()  # at most one batch waits in memory
        self._pending = self._pool.submit(self._write, start, layers)

    def finish(self, attrs: Mapping | None = None, sample_rank=None, dataset_index=None) -> Summary:
        """Write the index, the padding mask and the root attributes once every batch is written.

        Args:
            attrs: root attributes (strings and numbers as they are, anything else as JSON) over
                the defaults: ``weights_sha256`` "", ``shard`` 0, ``n_shards`` 1,
                ``capture_adapter`` "" (docs/activations.md Section 1).
            sample_rank, dataset_index: ``(B,)`` integers (default ``0 .. B-1``).

        Returns:
            :class:`Summary` of the file.

        Raises:
            ValueError: no batch was added, or fewer or more inputs than ``n_inputs``.
        """
        self._wait()
        if self.shape is None or (self.n_inputs is not None and self.rows != self.n_inputs):
            raise ValueError(f"{self.model_id}: {self.rows} inputs captured, {self.n_inputs or 'at least 1'} expected")
        for name, values in (("sample_rank", sample_rank), ("dataset_index", dataset_index)):
            self.f.create_dataset(
                name,
                data=np.arange(self.rows) if values is None else np.asarray(values),
                dtype=np.int64,
                track_times=False,
            )
        masks = [np.ones((b, self.shape[2]), np.int64) if m is None else m for b, m in self.masks]
        text = any(m is not None for _, m in self.masks)
        if text:
            self.f.create_dataset("attention_mask", data=np.concatenate(masks), track_times=False)
        n_layers, n_heads, n_tokens, d = self.shape
        kv_map = np.arange(n_heads, dtype=np.int64) if self.kv_map is None else self.kv_map
        root = dict(
            format_version=FORMAT_VERSION,
            model_id=self.model_id,
            n_layers=n_layers,
            n_heads=n_heads,
            head_dim=d,
            n_tokens=n_tokens,
            attention_scale=1.0 / math.sqrt(d),
        )
        root.update(causal=np.bool_(self.causal), n_kv_heads=self._n_kv(), kv_head_of_query=kv_map)
        root.update(
            weights_sha256="", shard=0, n_shards=1, dtype="float32", capture_adapter="", capture_check="not checked"
        )
        if self.check is not None:
            root.update(
                capture_rtol=self.tolerance,
                capture_check=(
                    f"every batch, every layer, all heads of {self.check}: max |h - softmax(s q k^T + mask) v| / "
                    "max |v|"
                ),
            )
            root.update(zip(("capture_max_rel_error", "capture_max_abs_error", "capture_heads_checked"), self.errors))
        root.update(attrs or {})
        for name, value in root.items():
            self.f.attrs[name] = (
                value
                if isinstance(value, (str, int, float, np.integer, np.floating, np.bool_, np.ndarray))
                else json.dumps(value, sort_keys=True)
            )
        error = root.get("capture_max_rel_error")
        kind = "text" if text else "vision"
        return Summary(
            FORMAT_VERSION,
            self.model_id,
            kind,
            self.rows,
            n_layers,
            n_heads,
            n_tokens,
            d,
            root["attention_scale"],
            error,
            self.causal,
            self._n_kv(),
            root,
        )

    def _n_kv(self) -> int:
        return self.shape[1] if self.kv_map is None else int(self.kv_map.max()) + 1

    def _create(self, n_layers: int, n_heads: int, n_tokens: int, d: int) -> None:
        self.shape = (n_layers, n_heads, n_tokens, d)
        n, n_kv = self.n_inputs, self._n_kv()
        for layer in range(n_layers):
            grp = self.f.create_group(layer_key(layer), track_order=False)
            for t in TENSORS:
                heads = n_kv if t in ("k", "v") else n_heads
                grp.create_dataset(
                    t,
                    shape=(n or 0, heads, n_tokens, d),
                    maxshape=(n, heads, n_tokens, d),
                    dtype="float32",
                    chunks=(1, heads, n_tokens, d),
                    track_times=False,
                )

    def _check_invariant(self, layers, mask) -> None:
        import torch

        b, n_tokens, d = layers[0]["q"].shape[0], self.shape[2], self.shape[3]
        inputs = None if self.check == "every input" else sorted({0, b - 1})
        km = None if mask is None else torch.from_numpy(mask).bool()
        rel, abs_, n = self.errors
        for layer, x in enumerate(layers):
            allowed = attention_mask_matrix(
                n_tokens, key_mask=km, window=self.windows[layer] if self.windows else None, causal=self.causal
            )
            res = check_attention_invariant(
                self.model_id,
                layer,
                x["q"],
                x["k"],
                x["v"],
                x["h"],
                scale=1.0 / math.sqrt(d),
                allowed=allowed,
                query_mask=km,
                inputs=inputs,
                tolerance=self.tolerance,
                kv_head_of_query=self.kv_map,
            )
            rel, abs_, n = max(rel, res.max_rel_error), max(abs_, res.max_abs_error), n + res.n_heads_checked
        self.errors = (rel, abs_, n)

    def _write(self, start: int, layers) -> None:
        for layer, x in enumerate(layers):
            grp = self.f[layer_key(layer)]
            for t in TENSORS:
                stop = start + x[t].shape[0]
                if self.n_inputs is None:
                    grp[t].resize(stop, axis=0)
                grp[t][start:stop] = x[t]

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def write_activations(
    path: str | os.PathLike,
    layers: Sequence[Mapping[str, np.ndarray]],
    *,
    model_id: str,
    attention_mask: np.ndarray | None = None,
    sample_rank: np.ndarray | None = None,
    dataset_index: np.ndarray | None = None,
    attention_scale: float | None = None,
    attrs: Mapping | None = None,
    tolerance: float | None = None,
    check_invariant: bool = True,
    causal: bool = False,
    kv_head_of_query=None,
) -> Summary:
    """Write per-head q, k, v, h of one model in format version 2 (through :class:`ActivationWriter`).

    Args:
        path: the HDF5 file to write.
        layers: one mapping per layer, ``"q" | "h"`` -> ``(B, H, N, d)`` and ``"k" | "v"`` ->
            ``(B, H_kv, N, d)`` arrays (numpy or torch, any float dtype; stored float32;
            half precision checked only with a ``tolerance``) with
            ``h = softmax(s q k^T + mask) v`` per head, ``s = 1/sqrt(d)``, k and v of the head's KV head.
        model_id: the name the tables show.
        attention_mask: ``(B, N)`` 0/1 (1 = real token) for language models (Table 4 form);
            None: every token is real (Table 1 form).
        sample_rank, dataset_index: ``(B,)`` integers (default ``0 .. B-1``).
        attention_scale: the logit scale the module applied; a scale other than
            ``1/sqrt(d)`` is folded into q (``q * s * sqrt(d)``), so the stored logits are
            ``q k^T / sqrt(d)`` as the KPCA stage assumes.
        attrs: further root attributes (strings or numbers; others are stored as JSON).
        tolerance: the invariant's tolerance (default :data:`INVARIANT_RTOL`).
        check_invariant: check the capture invariant on every input, layer and head (False:
            tensors that are no attention's, such as synthetic data; :func:`validate` refuses the file).
        causal: query i attends to keys j <= i only (the mask adds -inf on j > i).
        kv_head_of_query: ``(H,)`` integers, the KV head of each query head (grouped-query
            attention, :func:`repeat_kv_map`); None: ``H_kv = H``, the identity.

    Returns:
        :class:`Summary` of the written file, with the largest measured invariant error.

    Raises:
        CaptureMismatchError: the tensors do not reproduce h (also for a non-finite value);
            nothing is left at ``path``.
        ValueError: ``layers`` is empty, its tensors' shapes disagree, the mask is not 0/1
            with a real token in every input, ``kv_head_of_query`` does not fit, or half-precision
            tensors are checked without a ``tolerance`` (:func:`half_precision_problem`).
    """
    half = half_precision_problem(dict(layers[0]), tolerance) if check_invariant and layers else None
    if half is not None:
        raise ValueError(f"layers[0]: {half}")
    arrays = [{t: _to_numpy(layer[t]) for t in TENSORS} for layer in layers]
    if not arrays:
        raise ValueError("layers is empty")
    d = arrays[0]["q"].shape[-1]
    if attention_scale is not None and not abs(attention_scale * math.sqrt(d) - 1) <= _SCALE_RTOL:
        factor = np.float32(attention_scale * math.sqrt(d))
        arrays = [{**a, "q": a["q"] * factor} for a in arrays]
    mask = None if attention_mask is None else _to_numpy(attention_mask)
    check = "every input" if check_invariant else None
    with ActivationWriter(
        path, model_id=model_id, check=check, tolerance=tolerance, causal=causal, kv_head_of_query=kv_head_of_query
    ) as writer:
        writer.add(arrays, mask)
        return writer.finish({"capture_adapter": "write_activations", **(attrs or {})}, sample_rank, dataset_index)


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return (
        np.ascontiguousarray(np.asarray(x, dtype=np.float32))
        if np.asarray(x).dtype.kind == "f"
        else np.ascontiguousarray(np.asarray(x))
    )
