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

:func:`capture_batches` is the one forward-and-capture loop: per batch it clears the capture,
runs the forward pass, refuses a pass in which a hook did not fire
(:class:`HooksDidNotFireError`) and yields every layer's q, k, v, h as float32 numpy arrays.
:func:`record_activations` runs it under any :class:`HeadCapture`, checks the invariant on every
input, layer and head, and writes the activation file (docs/activations.md); a capture that
breaks the invariant is refused with the measured error and leaves no file. The pipeline's
extraction (:func:`kpca_repro.capture.extraction.extract_vision` and
:func:`~kpca_repro.capture.extraction.extract_text`) runs the timm and Hugging Face recorders
through the same :func:`capture_batches`, streaming each batch to its shard file.
docs/activations.md has a complete example; tests/test_activations.py runs a hand-written ViT,
a grouped-query attention and the timm and Hugging Face adapters through it.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import closing
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from kpca_repro.capture.vision import HeadRecorder, UnsupportedArchitectureError, split_heads

__all__ = ["HeadCapture", "ModuleCapture", "HooksDidNotFireError", "capture_batches", "record_activations", "bind_arguments"]

#: The tensors a capture fills per layer.
TENSORS = ("q", "k", "v", "h")


@runtime_checkable
class HeadCapture(Protocol):
    """What :func:`capture_batches` (so :func:`record_activations` and the pipeline's extraction) needs from a capture.

    Attributes:
        captured: one dict per layer, filled by the hooks during a forward pass:
            ``"q" | "k" | "v" | "h"`` -> ``(B, H, N, d)`` tensors (any float dtype, any device),
            batch-first, heads before tokens, q and k exactly as the dot product uses them
            (after any normalisation or rotary embedding; a logit scale other than
            ``1/sqrt(d)`` folded into q), h the per-head output before the heads are
            concatenated, normalised or projected.

    ``__enter__`` registers the hooks and ``__exit__`` removes them; ``numpy_layer(layer)``
    returns ``captured[layer]`` as float32 numpy arrays.
    """

    captured: list

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc) -> Any: ...

    def numpy_layer(self, layer: int) -> dict[str, np.ndarray]: ...


QKV = Callable[[nn.Module, tuple, dict], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class ModuleCapture(HeadRecorder):
    """A :class:`HeadCapture` for attention modules of your own.

    Per layer, a forward pre-hook on ``modules[layer]`` calls ``qkv(module, args, kwargs)``
    (the arguments of the module's call, keyword arguments included) for the ``(B, H, N, d)``
    q, k, v its dot product uses, and a forward pre-hook on ``h_input_of(module)`` (the output
    projection) takes its first input ``(B, N, H * d)`` as the concatenated per-head output h.
    Grouped- or multi-query attention: return k and v repeated per query head (each query
    head's keys are analysed as a head of their own).

    Args:
        modules: one attention module per layer, in layer order.
        qkv: recomputes q, k, v from the module's input with the module's own sub-modules, as
            its ``forward`` does (hooks see only inputs and outputs).
        h_input_of: ``module -> sub-module`` whose first positional input is h (default:
            ``module.proj``, else ``module.out_proj``).
    """

    def __init__(self, modules: Iterable[nn.Module], qkv: QKV, h_input_of: Callable[[nn.Module], nn.Module] | None = None):
        super().__init__(modules)
        self.qkv = qkv
        self.h_input_of = h_input_of or (lambda m: m.proj if hasattr(m, "proj") else m.out_proj)

    def _register(self) -> list:
        handles = []
        for layer, module in enumerate(self.attns):

            def pre(mod, args, kwargs, layer=layer):
                q, k, v = self.qkv(mod, args, kwargs)
                self.captured[layer] = {"q": q, "k": k, "v": v}

            def h_pre(_mod, args, layer=layer):
                q = self.captured[layer]["q"]
                self.captured[layer]["h"] = split_heads(args[0], q.shape[1], q.shape[3])

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(self.h_input_of(module).register_forward_pre_hook(h_pre))
        return handles


class HooksDidNotFireError(UnsupportedArchitectureError, ValueError):
    """A forward pass left ``(layer, tensor)`` pairs of a capture empty: their hooks did not fire.

    An :class:`~kpca_repro.capture.vision.UnsupportedArchitectureError` (what the pipeline's
    extraction raises for a model its hooks do not fit) and a :class:`ValueError` (a capture
    that does not fit the module it was given).
    """


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
                raise HooksDidNotFireError(f"{model_id}: the capture hooks did not fire in the forward pass for (layer, tensor) {missing[:6]}")
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
):
    """Forward ``batches`` through ``model`` under ``capture`` and write the activation file.

    The forward passes are :func:`capture_batches`, the loop of the pipeline's extraction.

    Args:
        model: any module; run under ``torch.no_grad()`` in the mode it is in (call
            ``model.eval()`` first for dropout-free attention).
        capture: a :class:`HeadCapture` (:class:`ModuleCapture`, or the timm / Hugging Face
            recorders) on ``model``'s attention modules.
        batches: inputs; a mapping is passed as keyword arguments (``model(**batch)``) and its
            ``attention_mask`` (``(B, N)``, 1 = real token) becomes the file's padding mask
            (Table 4 form); anything else is passed positionally (Table 1 form).
        path: the HDF5 file to write (docs/activations.md).
        model_id: the name the tables show.
        forward: ``forward(model, batch)`` replacing the default call.
        attrs: further root attributes (e.g. ``weights_sha256``).
        tolerance: the invariant's tolerance (default 1e-4).

    Returns:
        :class:`kpca_repro.activations.Summary` of the written file (with the largest
        measured invariant error).

    Raises:
        TypeError: ``capture`` is not a :class:`HeadCapture`.
        HooksDidNotFireError: (a ``ValueError``) a layer's tensors were not all captured in a
            forward pass; no file is written.
        ValueError: ``batches`` is empty.
        kpca_repro.capture.invariant.CaptureMismatchError: the captured q, k, v do not reproduce h
            (the measured error, layer, input and head in the message); no file is written.
    """
    from kpca_repro.activations import write_activations

    layers: list[list[dict[str, np.ndarray]]] | None = None
    masks: list[np.ndarray] = []
    with closing(capture_batches(model, capture, batches, model_id=model_id, forward=forward)) as runs:
        for batch, per_layer in runs:
            layers = [[p] for p in per_layer] if layers is None else [acc + [p] for acc, p in zip(layers, per_layer)]
            if isinstance(batch, Mapping) and batch.get("attention_mask") is not None:
                m = batch["attention_mask"]
                masks.append(np.asarray(m.detach().cpu() if hasattr(m, "detach") else m))
    if layers is None:
        raise ValueError("batches is empty")
    stacked = [{t: np.concatenate([p[t] for p in acc]) for t in TENSORS} for acc in layers]
    mask = np.concatenate(masks) if masks else None
    extra = {"capture": type(capture).__name__, **(attrs or {})}
    return write_activations(path, stacked, model_id=model_id, attention_mask=mask, attrs=extra, tolerance=tolerance)


def _signature_of(module: nn.Module) -> inspect.Signature:
    """``module.forward``'s signature (for a :data:`QKV` function that binds its arguments)."""
    return inspect.signature(module.forward)


def bind_arguments(module: nn.Module, args: Sequence, kwargs: Mapping) -> dict:
    """The arguments of one call of ``module`` by name (defaults applied), for :data:`QKV` functions."""
    bound = _signature_of(module).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)
