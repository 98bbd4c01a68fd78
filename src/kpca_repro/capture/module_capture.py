"""Bring your own module: record q, k, v, h from any ``torch.nn.Module`` and write the format.

The interface is :class:`HeadCapture`, a context manager whose hooks fill, during one forward
pass, ``captured[layer]`` with ``"q" | "k" | "v" | "h"`` -> ``(B, H, N, d)`` tensors such that
per head::

    h = softmax(q k^T / sqrt(d) + mask) v            (docs/method.md 0.1)

``mask`` being -inf on padded keys (``attention_mask`` of the batch) and nothing else. The
pipeline's adapters are instances of it: :class:`kpca_repro.capture.vision.CaptureRecorder` (timm,
through :func:`kpca_repro.capture.vision.capture_plan`) and
:class:`kpca_repro.capture.hf_capture.HFAttentionRecorder` (Hugging Face, through
:func:`kpca_repro.capture.hf_capture.attention_modules`), both subclasses of
:class:`kpca_repro.capture.vision.HeadRecorder`, as is :class:`ModuleCapture`, the generic capture for a
module of your own: you give it your attention modules, a function returning the q, k, v your
module's dot product uses, and the sub-module whose input is the concatenated per-head output.
PyTorch's ``nn.MultiheadAttention`` (so ``nn.TransformerEncoder``) needs neither:
:meth:`ModuleCapture.for_torch_attention` (:mod:`kpca_repro.capture.torch_attention`).

:func:`record_activations` is the one extraction loop, a user's and the pipeline's
(:func:`kpca_repro.capture.extraction.extract_vision` and
:func:`~kpca_repro.capture.extraction.extract_text` are its timm and Hugging Face adapters): its
forward passes are :func:`capture_batches` (per batch: clear the capture, run the forward pass,
refuse a pass in which a hook did not fire, :class:`HooksDidNotFireError`, yield every layer's
q, k, v, h as float32 numpy arrays), and each batch goes to
:class:`kpca_repro.activations.ActivationWriter`, which checks the capture invariant and writes
the activation file (docs/activations.md); a capture that breaks the invariant is refused with
the measured error and leaves no file.
docs/activations.md has a complete example; tests/test_activations.py runs a hand-written ViT,
a grouped-query attention and the timm and Hugging Face adapters through it,
tests/test_torch_attention.py PyTorch's own attention.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from kpca_repro.activations import TENSORS, ActivationWriter, Summary
from kpca_repro.capture import torch_attention as ta
from kpca_repro.capture.vision import HeadRecorder, UnsupportedArchitectureError, split_heads
from kpca_repro.errors import JobInterrupted, JobStop
from kpca_repro.resume import PartStore

__all__ = ["HeadCapture", "ModuleCapture", "HooksDidNotFireError", "capture_batches", "record_activations"]


@runtime_checkable
class HeadCapture(Protocol):
    """What :func:`capture_batches` (so :func:`record_activations` and the pipeline's extraction) needs from a capture.

    Attributes:
        captured: one dict per layer, filled by the hooks during a forward pass:
            ``"q" | "k" | "v" | "h"`` -> ``(B, H, N, d)`` tensors (any float dtype, any device;
            k and v may hold ``H_kv`` heads when the capture has ``kv_head_of_query``),
            batch-first, heads before tokens, q and k exactly as the dot product uses them
            (after any normalisation or rotary embedding; a logit scale other than
            ``1/sqrt(d)`` folded into q), h the per-head output before the heads are
            concatenated, normalised or projected.

    ``__enter__`` registers the hooks and ``__exit__`` removes them; ``numpy_layer(layer)``
    returns ``captured[layer]`` as float32 numpy arrays. Optional: ``attention_mask``, the
    ``(B, N)`` padding mask (1 = real token) of the last forward pass, which
    :func:`record_activations` writes when the batch has none;
    ``explain_missing(layer, tensor, paths) -> (subject, reason)``, which
    :class:`HooksDidNotFireError`'s message gives; ``file_attrs() -> dict``, root attributes
    the capture knows after a forward pass (``capture_adapter``, default the class name;
    the Hugging Face recorder's ``hooked_layout``); ``causal`` and ``kv_head_of_query``,
    format version 2's causal flag and KV-head map (the Hugging Face recorder on a decoder).
    """

    captured: list

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc) -> Any: ...

    def numpy_layer(self, layer: int) -> dict[str, np.ndarray]: ...


QKV = Callable[[nn.Module, tuple, dict], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class ModuleCapture(HeadRecorder):
    """A :class:`HeadCapture` for attention modules of your own, and for PyTorch's ``nn.MultiheadAttention``.

    Per layer, a forward pre-hook on ``modules[layer]`` calls ``qkv(module, args, kwargs)``
    (the arguments of the module's call, keyword arguments included) for the ``(B, H, N, d)``
    q, k, v its dot product uses, and a forward pre-hook on ``h_input_of(module)`` (the output
    projection) takes its first input ``(B, N, H * d)`` as the concatenated per-head output h.
    Grouped- or multi-query attention: return k and v repeated per query head (each query
    head's keys are analysed as a head of their own).

    ``nn.MultiheadAttention`` modules (so the ``self_attn`` of ``nn.TransformerEncoderLayer``)
    are detected: without ``qkv``, q, k, v are its ``in_proj`` applied to its input; without
    ``h_input_of``, h is the input of its out-projection call, observed at
    ``torch.nn.functional.linear`` because the module never calls ``out_proj`` as a module
    (:mod:`kpca_repro.capture.torch_attention` explains the choice and what it changes while
    the capture is open). Its ``key_padding_mask`` becomes :attr:`attention_mask`, which
    :func:`record_activations` writes as the file's padding mask.
    :meth:`for_torch_attention` finds every such module of a model.

    Args:
        modules: one attention module per layer, in layer order.
        qkv: recomputes q, k, v from the module's input with the module's own sub-modules, as
            its ``forward`` does (hooks see only inputs and outputs). Optional for
            ``nn.MultiheadAttention`` modules only.
        h_input_of: ``module -> sub-module`` whose first positional input is h (default:
            ``module.proj``, else ``module.out_proj``; for ``nn.MultiheadAttention``, the
            functional out-projection call). A sub-module the forward pass never calls
            leaves h empty and :func:`capture_batches` raises :class:`HooksDidNotFireError`.
        names: one name per module for errors (default ``modules[i]``).

    Raises:
        TypeError: ``qkv`` is None and a module is not an ``nn.MultiheadAttention``.
        UnsupportedArchitectureError: an ``nn.MultiheadAttention`` with ``add_bias_kv`` or
            ``add_zero_attn``; during the forward pass, one called as cross-attention, with an
            ``attn_mask``/``is_causal``, or with dropout in training mode
            (:func:`kpca_repro.capture.torch_attention.torch_attention_qkv`).
    """

    def __init__(
        self,
        modules: Iterable[nn.Module],
        qkv: QKV | None = None,
        h_input_of: Callable[[nn.Module], nn.Module] | None = None,
        *,
        names: Sequence[str] | None = None,
    ):
        super().__init__(modules)
        self.names = list(names) if names is not None else [f"modules[{i}]" for i in range(len(self.attns))]
        self.torch_attention = [ta.is_torch_attention(m) for m in self.attns]
        for name, module, torch_mha in zip(self.names, self.attns, self.torch_attention):
            if torch_mha:
                ta.check_torch_attention(module, name)
        if qkv is None and not all(self.torch_attention):
            first = next(n for n, t in zip(self.names, self.torch_attention) if not t)
            raise TypeError(f"ModuleCapture needs a qkv function for {first}, which is not an nn.MultiheadAttention")
        self.qkv = qkv
        self.h_given = h_input_of is not None
        self.h_input_of = h_input_of or (lambda m: m.proj if hasattr(m, "proj") else m.out_proj)
        self._real_keys: list[torch.Tensor | None] = [None for _ in self.attns]

    @classmethod
    def for_torch_attention(cls, model: nn.Module) -> ModuleCapture:
        """A capture on every ``nn.MultiheadAttention`` of ``model``, in ``named_modules()`` order.

        For ``nn.TransformerEncoder`` that is its layers' ``self_attn`` in depth order; errors
        name each module by its path in ``model``.

        Raises:
            UnsupportedArchitectureError: ``model`` holds no ``nn.MultiheadAttention``, or one
                the format cannot store (``add_bias_kv``, ``add_zero_attn``).
        """
        found = ta.find_torch_attention(model)
        if not found:
            raise UnsupportedArchitectureError(
                f"{type(model).__name__} holds no nn.MultiheadAttention; give ModuleCapture your attention modules "
                "and a qkv function"
            )
        return cls([m for _, m in found], names=[n for n, _ in found])

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """``(B, N)`` int64, 1 = real token: the ``key_padding_mask`` of the last forward pass's
        ``nn.MultiheadAttention`` calls (None when none had one).

        Raises:
            ValueError: the layers were called with different key padding masks (the format holds one).
        """
        got = [(i, m) for i, m in enumerate(self._real_keys) if m is not None]
        if not got:
            return None
        first = got[0][1]
        for layer, m in got[1:]:
            if m.shape != first.shape or not torch.equal(m, first):
                raise ValueError(
                    f"{self.names[layer]} was called with another key_padding_mask than {self.names[got[0][0]]}; the "
                    "activation file holds one padding mask"
                )
        if len(got) != len(self._real_keys):
            raise ValueError(
                f"{self.names[got[0][0]]} was called with a key_padding_mask and other layers without; the "
                "activation file holds one padding mask"
            )
        return first.to(torch.int64)

    def _register(self) -> list:
        handles = []
        try:
            for layer, module in enumerate(self.attns):
                handles.extend(
                    self._register_torch_attention(layer, module)
                    if self.torch_attention[layer]
                    else self._register_module(layer, module)
                )
        except BaseException:
            for handle in handles:  # an observation left open would keep F.linear wrapped
                handle.remove()
            raise
        return handles

    def _register_module(self, layer: int, module: nn.Module) -> list:
        def pre(mod, args, kwargs):
            q, k, v = self.qkv(mod, args, kwargs)
            self.captured[layer] = {"q": q, "k": k, "v": v}

        def h_pre(_mod, args):
            q = self.captured[layer]["q"]
            self.captured[layer]["h"] = split_heads(args[0], q.shape[1], q.shape[3])

        return [
            module.register_forward_pre_hook(pre, with_kwargs=True),
            self.h_input_of(module).register_forward_pre_hook(h_pre),
        ]

    def _register_torch_attention(self, layer: int, module: nn.Module) -> list:
        name = self.names[layer]
        inside = {
            "call": None
        }  # (N, B) of the call in progress: out-projection calls outside it are not this layer's h

        def pre(mod, args, kwargs):
            q, k, v, real = ta.torch_attention_qkv(
                mod, args, kwargs, name
            )  # also the refusals, with a qkv function of the user's
            inside["call"] = (q.shape[2], q.shape[0])  # (N, B): the out-projection's input is (N * B, H * d)
            if self.qkv is not None:
                q, k, v = self.qkv(mod, args, kwargs)
            self._real_keys[layer] = real
            self.captured[layer] = {"q": q, "k": k, "v": v}

        def post(_mod, _args, _out):
            inside["call"] = None

        def h_seen(attn_output):
            if inside["call"] is None:
                return
            n, b = inside["call"]
            self.captured[layer]["h"] = ta.split_seq_first(
                attn_output.reshape(n, b, module.embed_dim), module.num_heads
            )

        if self.h_given:

            def h_pre(_mod, args):
                self.captured[layer]["h"] = split_heads(args[0], module.num_heads, ta.head_dim(module))

            h_handle = self.h_input_of(module).register_forward_pre_hook(h_pre)
        else:
            h_handle = ta.observe_out_projection(module, h_seen)  # first: it may refuse, and nothing is registered yet
        return [
            h_handle,
            module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, always_call=True),
        ]

    def explain_missing(self, layer: int, tensor: str, paths: Mapping[int, str]) -> tuple[str, str]:
        """Why ``(layer, tensor)`` was not captured: ``(subject, reason)``, the subject the hooked
        module's path in the model, the reason saying why its hook did not fire and what to use instead.

        Args:
            paths: ``id(module) -> path`` of the model's ``named_modules()``.
        """
        module = self.attns[layer]
        where = paths.get(id(module))
        name = repr(where) if where is not None else f"{self.names[layer]} (not a sub-module of the model)"
        if tensor != "h" or not {"q", "k", "v"} <= set(self.captured[layer]):
            return (
                name,
                f"{type(module).__name__} not called as a module in the forward pass, so its forward pre-hook (q, k, "
                "v) did not fire",
            )
        if self.torch_attention[layer] and not self.h_given:
            return name, (
                "its out-projection call was not seen at torch.nn.functional.linear (a scripted or compiled module, "
                "or a torch version whose "
                "F.multi_head_attention_forward no longer calls it); record this attention another way "
                "(docs/activations.md 4)"
            )
        target = self.h_input_of(module)
        tpath = paths.get(id(target))
        tname = repr(tpath) if tpath is not None else f"{type(target).__name__} (not a sub-module of the model)"
        if self.torch_attention[layer]:
            why = (
                ta.OUT_PROJ_REASON
                if target is getattr(module, "out_proj", None)
                else "nn.MultiheadAttention calls no sub-module with the concatenated heads"
            )
            return tname, (
                f"the h hook cannot fire: {why}. Leave h_input_of unset for nn.MultiheadAttention (ModuleCapture "
                "then records h at that "
                "out-projection call), or use ModuleCapture.for_torch_attention(model) (docs/activations.md, "
                "'PyTorch's own attention')"
            )
        return tname, (
            "the h hook did not fire: the attention's forward did not call it as a module (a functional call such as "
            "F.linear(x, m.weight) "
            "bypasses module hooks); give h_input_of the sub-module your forward calls with the concatenated heads"
        )


class HooksDidNotFireError(UnsupportedArchitectureError, ValueError):
    """A forward pass left ``(layer, tensor)`` pairs of a capture empty: their hooks did not fire.

    An :class:`~kpca_repro.capture.vision.UnsupportedArchitectureError` (what the pipeline's
    extraction raises for a model its hooks do not fit) and a :class:`ValueError` (a capture
    that does not fit the module it was given). For a :class:`ModuleCapture` the message says,
    per module, which module (its path in the model), why its hook did not fire and what to
    use instead (e.g. ``nn.MultiheadAttention.out_proj``, which the module never calls).
    """


def _did_not_fire(model_id: str, model: nn.Module, capture, missing: list[tuple[int, str]]) -> str:
    message = f"{model_id}: the capture hooks did not fire in the forward pass for (layer, tensor) {missing[:6]}"
    explain = getattr(capture, "explain_missing", None)
    if explain is None:
        return message
    paths = {id(m): name or "<model>" for name, m in model.named_modules()}
    by_reason: dict[str, list[str]] = {}  # one sentence per reason, naming every module it concerns
    for layer, t in missing[:6]:
        subject, reason = explain(layer, t, paths)
        subjects = by_reason.setdefault(reason, [])
        if subject not in subjects:
            subjects.append(subject)
    return message + ": " + "; ".join(f"{', '.join(subjects)}: {reason}" for reason, subjects in by_reason.items())


def _forward(model: nn.Module, batch) -> None:
    if isinstance(batch, Mapping):
        model(**batch)
    else:
        model(batch)


def capture_batches(
    model: nn.Module,
    capture: HeadCapture,
    batches: Iterable,
    *,
    model_id: str,
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> Iterator[tuple[Any, list[dict[str, np.ndarray]]]]:
    """Forward each batch through ``model`` under ``capture``; yield the batch and its q, k, v, h.

    The one forward-and-capture loop: :func:`record_activations` and the pipeline's
    :func:`kpca_repro.capture.extraction.extract_vision` / ``extract_text`` run it. The hooks are
    registered (``capture.__enter__``) at the first batch and removed when the generator
    finishes or is closed (wrap it in :func:`contextlib.closing` when stopping early). Per batch:
    every ``captured[layer]`` is emptied, ``forward(model, batch)`` runs under
    ``torch.no_grad()`` in the mode ``model`` is in, every layer must hold q, k, v and h, and
    ``capture.numpy_layer`` gives them as float32 numpy arrays. Batches are pulled one at a
    time, so ``batches`` may be a generator that loads or moves the next one.

    Args:
        model: any module.
        capture: a :class:`HeadCapture` on ``model``'s attention modules.
        batches: inputs; a mapping is passed as keyword arguments (``model(**batch)``),
            anything else positionally.
        model_id: named in errors.
        forward: ``forward(model, batch)`` replacing the default call.

    Returns:
        A generator of ``(batch, layers)``: the batch as given, and per layer
        ``{"q" | "k" | "v" | "h": (B, H, N, d) float32}``.

    Raises:
        TypeError: ``capture`` is not a :class:`HeadCapture` (at the call).
        HooksDidNotFireError: a forward pass left ``(layer, tensor)`` pairs uncaptured (the
            first six named).
    """
    if not isinstance(capture, HeadCapture):
        raise TypeError(f"{type(capture).__name__} is not a HeadCapture (captured, __enter__/__exit__, numpy_layer)")
    return _capture_batches(model, capture, batches, model_id, forward or _forward)


def _capture_batches(model, capture, batches, model_id, call) -> Iterator[tuple[Any, list[dict[str, np.ndarray]]]]:
    with capture:
        for batch in batches:
            for got in capture.captured:
                got.clear()  # a hook that did not fire is noticed below
            with torch.no_grad():
                call(model, batch)
            missing = [(layer, t) for layer, got in enumerate(capture.captured) for t in TENSORS if t not in got]
            if missing:
                raise HooksDidNotFireError(_did_not_fire(model_id, model, capture, missing))
            yield batch, [capture.numpy_layer(layer) for layer in range(len(capture.captured))]


def record_activations(
    model: nn.Module,
    capture: HeadCapture,
    batches: Iterable,
    path: str | os.PathLike,
    *,
    model_id: str,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    attrs: Mapping | None = None,
    tolerance: float | None = None,
    sample_rank: Sequence[int] | None = None,
    dataset_index: Sequence[int] | None = None,
    keep: Sequence[slice] | None = None,
    check: str = "every input",
    windows: Sequence[int | None] | None = None,
    causal: bool | None = None,
    kv_head_of_query: Sequence[int] | None = None,
    store: PartStore | None = None,
) -> Summary:
    """Forward ``batches`` through ``model`` under ``capture`` and write the activation file.

    The one extraction loop: the forward passes are :func:`capture_batches`; each batch's kept
    rows go to :class:`kpca_repro.activations.ActivationWriter`, which checks the capture
    invariant (``check``) before writing them, and the file gets the capture attributes
    (``capture_adapter``, ``capture_rtol``, ``capture_check``, ``capture_max_rel_error``,
    ``capture_max_abs_error``, ``capture_heads_checked``; docs/activations.md Section 1).

    Args:
        model: any module; run under ``torch.no_grad()`` in the mode it is in (call
            ``model.eval()`` first for dropout-free attention).
        capture: a :class:`HeadCapture` (:class:`ModuleCapture`, or the timm / Hugging Face
            recorders) on ``model``'s attention modules.
        batches: inputs; a mapping is passed as keyword arguments (``model(**batch)``) and its
            ``attention_mask`` (``(B, N)``, 1 = real token) becomes the file's padding mask
            (Table 4 form); anything else is passed positionally (Table 1 form). Without an
            ``attention_mask`` key, a capture's ``attention_mask`` attribute is used when it
            has one (:class:`ModuleCapture` on ``nn.MultiheadAttention``: the
            ``key_padding_mask`` of the call); a batch without a mask, in a file with one,
            counts every token as real.
        path: the HDF5 file to write (docs/activations.md).
        model_id: the name the tables show.
        forward: ``forward(model, batch)`` replacing the default call.
        attrs: further root attributes (e.g. ``weights_sha256``).
        tolerance: the invariant's tolerance (default 1e-4).
        sample_rank, dataset_index: the file's ``(B,)`` index (default ``0 .. B-1``).
        keep: per batch, the rows to store (the pipeline's shards run whole-sample batches
            and keep their own rows); default: every row.
        check: ``"every input"`` or ``"the first and last input"`` of each batch (the
            pipeline's extraction) have all their heads checked.
        windows: per layer, the one-sided local window of the attention, or None (the
            pipeline's Longformer and ModernBERT; a user's file holds key padding only).
        causal, kv_head_of_query: format version 2's causal flag and KV-head map
            (:class:`kpca_repro.activations.ActivationWriter`); default: the capture's
            attributes of these names when it has them (the Hugging Face recorder on a
            decoder), else not causal and one KV head per query head.
        store: where finished batches are kept (:class:`kpca_repro.resume.PartStore`, keyed by
            the job's model, inputs, parameters and code): each batch's stored rows and mask
            once written, and the first ``store.finished()`` batches read back from it instead
            of computed, so ``batches`` then holds only the batches after them. The writer gets
            the same arrays either way (the same file, bit for bit; the invariant is checked on
            them again). The store is deleted once the file is written.

    Returns:
        :class:`kpca_repro.activations.Summary` of the written file (with the largest
        measured invariant error).

    Raises:
        TypeError: ``capture`` is not a :class:`HeadCapture`.
        HooksDidNotFireError: (a ``ValueError``) a layer's tensors were not all captured in a
            forward pass; no file is written.
        ValueError: ``batches`` is empty, the layers' shapes or the padding masks do not fit
            (:meth:`kpca_repro.activations.ActivationWriter.add`; a mask wider than the tokens
            the attention sees), or the capture's layers saw different padding masks
            (:attr:`ModuleCapture.attention_mask`).
        UnsupportedArchitectureError: an ``nn.MultiheadAttention`` call the format cannot store
            (:class:`ModuleCapture`).
        kpca_repro.activations.CaptureMismatchError: the captured q, k, v do not reproduce h
            (the measured error, layer, input and head in the message); no file is written.
        kpca_repro.errors.JobStop: with ``store``, a kept batch cannot be read (the kept batches are deleted).
        kpca_repro.resume.JobInterrupted: interrupted (``KeyboardInterrupt``), with ``store``: the message says how many
            batches are kept.
    """
    causal = bool(getattr(capture, "causal", False)) if causal is None else causal
    kv_head_of_query = getattr(capture, "kv_head_of_query", None) if kv_head_of_query is None else kv_head_of_query
    runs = capture_batches(model, capture, batches, model_id=model_id, forward=forward)
    n_inputs = None if keep is None else sum(k.stop - k.start for k in keep)
    layout = dict(causal=causal, kv_head_of_query=kv_head_of_query)
    kept = store.finished() if store is not None else 0
    found, saving = None, []

    def computed():  # (layers, mask, attrs) of each batch after the kept ones: the rows the file stores
        for rows, (batch, layers) in zip(itertools.repeat(slice(None)) if keep is None else keep[kept:], runs):
            mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
            if mask is None:
                mask = getattr(
                    capture, "attention_mask", None
                )  # e.g. the key_padding_mask nn.MultiheadAttention was called with
            if mask is not None:
                mask = np.asarray(mask.detach().cpu() if hasattr(mask, "detach") else mask)[rows]
            yield [{t: a[rows] for t, a in tensors.items()} for tensors in layers], mask, _found_attrs(capture)

    try:
        with (
            ActivationWriter(
                path, model_id=model_id, n_inputs=n_inputs, check=check, windows=windows, tolerance=tolerance, **layout
            ) as writer,
            closing(runs),
            ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="keep"
            ) as keeper,  # a part is written while the next batch runs; left, the block waits for it
        ):
            for index, (layers, mask, found) in enumerate(itertools.chain(_kept_batches(store, kept), computed())):
                writer.add(layers, mask)
                if store is not None and index >= kept:
                    for part in saving:  # one part at a time: its arrays are those the writer holds
                        part.result()
                    saving = [keeper.submit(store.save, index, _batch_part(layers, mask, found))]
            for part in saving:
                part.result()
            summary = writer.finish({**(found or _found_attrs(capture)), **(attrs or {})}, sample_rank, dataset_index)
    except KeyboardInterrupt:
        if store is None:
            raise
        of = f" of {len(keep):,}" if keep is not None else ""
        raise JobInterrupted(
            f"interrupted after {store.finished():,}{of} batches; rerun the same command to resume"
        ) from None
    if store is not None:  # the file is written
        store.remove()
    return summary


def _found_attrs(capture) -> dict:
    """The file attributes a capture knows after a forward pass: ``capture_adapter`` and the capture's
    ``file_attrs()``."""
    return {
        "capture_adapter": type(capture).__name__,
        **(capture.file_attrs() if hasattr(capture, "file_attrs") else {}),
    }


def _batch_part(
    layers: Sequence[Mapping[str, np.ndarray]], mask: np.ndarray | None, found: dict
) -> dict[str, np.ndarray]:
    """One batch as a :class:`~kpca_repro.resume.PartStore` part: every layer's arrays (whatever names and shapes), the
    mask, the capture's attributes (JSON)."""
    part = {f"{layer}/{name}": a for layer, tensors in enumerate(layers) for name, a in tensors.items()}
    part["n_layers"], part["found_attrs"] = np.array(len(layers)), np.array(json.dumps(found, sort_keys=True))
    if mask is not None:
        part["mask"] = mask
    return part


def _kept_batches(
    store: PartStore | None, kept: int
) -> Iterator[tuple[list[dict[str, np.ndarray]], np.ndarray | None, dict]]:
    """The first ``kept`` batches of ``store`` as :func:`record_activations` feeds its writer:
    ``(layers, mask or None, attrs)``.

    Raises:
        kpca_repro.errors.JobStop: a part cannot be read (the kept batches are deleted, so that a rerun computes them).
    """
    for index in range(kept):
        part = store.load(index)
        if part is None:
            store.remove()
            raise JobStop(
                f"{store.directory}: kept batch {index} cannot be read; the kept batches are deleted, rerun the same "
                "command"
            )
        layers = [{} for _ in range(int(part["n_layers"]))]
        for name, a in part.items():
            if "/" in name:
                layer, tensor = name.split("/", 1)
                layers[int(layer)][tensor] = a
        yield layers, part.get("mask"), json.loads(str(part["found_attrs"]))
