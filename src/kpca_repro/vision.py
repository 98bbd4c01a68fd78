"""Vision transformers: model loading from the resources directory and activation hooks.

One forward pass per image batch captures every layer (the reference runs one forward per
layer, method.md Section 12): a forward hook on ``blocks[l].attn.qkv`` yields the per-head
q, k, v (after the qkv projection, all tokens including CLS/distillation), and a forward
pre-hook on ``blocks[l].attn.proj`` yields h, the per-head attention output before the
output projection.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

__all__ = ["UnsupportedArchitectureError", "resolve_device", "load_timm_model", "attention_modules", "HeadRecorder", "AttentionRecorder"]


class UnsupportedArchitectureError(TypeError):
    """The model does not expose the timm ViT attention structure the hooks rely on."""


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; otherwise ``torch.device(device)``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_timm_model(model_id: str, weights_path: str | os.PathLike, model_kwargs: dict | None = None) -> nn.Module:
    """Build ``model_id`` with timm (no download) and load a safetensors state_dict strictly.

    Args:
        model_id: a timm model name (``timm.list_models()``).
        weights_path: ``<resources>/weights/timm/<model_id>.safetensors``.
        model_kwargs: extra ``timm.create_model`` arguments (e.g. ``depth`` for a small test model).

    Returns:
        The model in eval mode, float32, on the CPU.

    Raises:
        RuntimeError: the state_dict does not fit the architecture (missing/unexpected keys).
    """
    import timm
    from safetensors.torch import load_file

    model = timm.create_model(model_id, pretrained=False, **(model_kwargs or {}))
    state = load_file(str(weights_path))
    model.load_state_dict(state, strict=True)
    return model.eval().float()


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention module of every block, in depth order.

    Raises:
        UnsupportedArchitectureError: no ``blocks[*].attn`` with ``qkv``, ``proj``, ``num_heads``
            and ``head_dim``, or an attention variant whose head output is normalised or gated
            before the projection.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise UnsupportedArchitectureError(f"{type(model).__name__} has no 'blocks'; expected a timm VisionTransformer")
    mods = []
    for i, blk in enumerate(blocks):
        attn = getattr(blk, "attn", None)
        ok = attn is not None and all(hasattr(attn, a) for a in ("qkv", "proj", "num_heads", "head_dim"))
        if not ok:
            raise UnsupportedArchitectureError(f"blocks[{i}].attn of {type(model).__name__} lacks qkv/proj/num_heads/head_dim")
        if not isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity) or getattr(attn, "gate", None) is not None:
            raise UnsupportedArchitectureError(f"blocks[{i}].attn normalises or gates the head outputs; h would not be the attention output")
        mods.append(attn)
    return mods


class HeadRecorder:
    """Base of the hook recorders (vision and language models): a context manager whose
    hooks fill ``captured[layer]`` with ``"q" | "k" | "v" | "h"`` -> ``(B, H, N, d)`` tensors.

    Subclasses implement :meth:`_register`, returning the hook handles; leaving the context
    removes them.
    """

    def __init__(self, attns: Iterable):
        self.attns = list(attns)
        self.captured: list[dict[str, torch.Tensor]] = [{} for _ in self.attns]
        self.handles: list = []

    def _register(self) -> list:
        raise NotImplementedError

    def __enter__(self):
        self.handles.extend(self._register())
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def numpy_layer(self, layer: int) -> dict[str, np.ndarray]:
        """Captured tensors of one layer as contiguous float32 numpy arrays on the CPU."""
        return {t: np.ascontiguousarray(x.detach().float().cpu().numpy()) for t, x in self.captured[layer].items()}


class AttentionRecorder(HeadRecorder):
    """Context manager that records per-head q, k, v, h of every layer during a forward pass.

    After ``model(x)``, ``recorder.captured[layer]`` maps ``"q" | "k" | "v" | "h"`` to float32
    tensors of shape ``(B, H, N, d)`` on the model's device.
    """

    def _qkv_hook(self, layer: int):
        attn = self.attns[layer]

        def hook(_mod, _inp, out):
            b, n, _ = out.shape
            qkv = out.reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
            self.captured[layer].update(q=qkv[0], k=qkv[1], v=qkv[2])

        return hook

    def _proj_pre_hook(self, layer: int):
        attn = self.attns[layer]

        def hook(_mod, args):
            x = args[0]
            b, n, _ = x.shape
            self.captured[layer]["h"] = x.reshape(b, n, attn.num_heads, attn.head_dim).permute(0, 2, 1, 3)

        return hook

    def _register(self) -> list:
        handles = []
        for layer, attn in enumerate(self.attns):
            handles.append(attn.qkv.register_forward_hook(self._qkv_hook(layer)))
            handles.append(attn.proj.register_forward_pre_hook(self._proj_pre_hook(layer)))
        return handles
