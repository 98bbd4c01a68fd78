"""Vision transformers: model loading, the capture adapters and the activation hooks.

What is stored, per layer and head (``(B, H, N, d)`` float32, all tokens including the
CLS, distillation and register tokens):

* ``q``, ``k``: the queries and keys exactly as the attention's dot product uses them:
  after the qkv projection (fused, separate, or EVA's ``F.linear`` with q/v bias), after
  the per-head q/k normalisation (``qk_norm``) and after the rotary position embedding
  (RoPE ViTs, EVA-02; timm rotates the patch tokens only, never the prefix tokens);
* ``v``: the values the attention averages;
* ``h``: the per-head attention output ``softmax(s q k^T) v`` before anything acts on the
  concatenated heads: before EVA's sub-LN ``attn.norm`` (``scale_attn_inner``) when the
  model has one, and before the output projection ``attn.proj``.

``s = 1/sqrt(d)`` for every supported family (checked, and recorded in each activation
file as ``attention_scale``); the stored tensors satisfy ``h = softmax(s q k^T) v``, which
the extraction verifies on every batch (:class:`kpca_repro.activations.ActivationWriter`).

How: one forward pass per batch captures every layer. A forward pre-hook on each
``blocks[l].attn`` receives the attention's input ``x`` and the rotary embedding ``rope``
the block passes; the family's :class:`CaptureAdapter` recomputes q, k, v from them with
the module's own sub-modules and functions, step by step as the module's ``forward`` does.
A forward pre-hook on ``attn.norm`` (when it is not the identity) or else on ``attn.proj``
yields h. Hooks on the ``qkv`` Linear alone would miss the q/k norms, the rotary embedding
and EVA's bias path (``F.linear`` never calls the module, so its hook never fires).

Supported (:data:`SUPPORTED_FAMILIES`; exact classes, a subclass may change ``forward``):
timm ``VisionTransformer`` / ``VisionTransformerDistilled`` with ``Block`` or
``ResPostBlock`` and ``timm.layers.Attention`` (ViT, DeiT incl. distilled, registers,
DINOv2 with layer scale, ``qk_norm``, ``scale_norm``), and timm ``Eva`` with ``EvaBlock``
or ``EvaBlockPostNorm`` and ``EvaAttention`` or ``AttentionRope`` (EVA-02 with or without
q/v bias, fused or separate projections, RoPE ViTs ``vit_*_rope_*`` incl. mixed RoPE).
Everything else is refused by :func:`capture_plan` with one line naming the model, the
reason and the supported families: relative position bias (``vit_relpos_*``, BEiT),
talking-heads and class attention (CaiT), windowed attention without ``blocks`` (Swin),
differential attention, gated attention outputs, grouped-query attention, a logit scale
other than ``1/sqrt(d)``, an attention mask, any other class.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kpca_repro.errors import JobStop
from kpca_repro.inputs.model_info import VisionModelCheck

__all__ = [
    "UnsupportedArchitectureError",
    "ModelBuildError",
    "SUPPORTED_FAMILIES",
    "CaptureAdapter",
    "capture_adapters",
    "capture_plan",
    "attention_modules",
    "attention_scale",
    "check_vision_model",
    "load_timm_model",
    "HeadRecorder",
    "split_heads",
    "CaptureRecorder",
]


class UnsupportedArchitectureError(TypeError, JobStop):
    """The model's attention is not one the capture reproduces exactly (the message says why); a rule
    script ends on it with that line (:class:`kpca_repro.errors.JobStop`), wherever the job finds it."""


class ModelBuildError(ValueError):
    """``timm.create_model`` fails for a configured model id and its ``vision.model_kwargs``."""


#: The supported timm families, as named in every refusal.
SUPPORTED_FAMILIES = (
    "timm VisionTransformer/VisionTransformerDistilled with Attention (ViT, DeiT incl. distilled, registers, DINOv2, "
    "qk_norm) "
    "and timm Eva with EvaAttention/AttentionRope (EVA-02 with or without q/v bias, RoPE ViTs vit_*_rope_*)"
)

#: Model classes refused outright (qualified class name -> reason).
REFUSED_MODELS = {
    "timm.models.vision_transformer_relpos.VisionTransformerRelPos": (
        "relative position bias added to the attention logits (vit_relpos_*)"
    ),
    "timm.models.beit.Beit": "relative position bias added to the attention logits (BEiT)",
    "timm.models.cait.Cait": (
        "talking-heads attention (logits mixed across heads before and after the softmax) and class attention (CaiT)"
    ),
    "timm.models.swin_transformer.SwinTransformer": (
        "shifted-window attention with a relative position bias, no 'blocks' (Swin)"
    ),
    "timm.models.swin_transformer_v2.SwinTransformerV2": (
        "shifted-window cosine attention with a relative position bias, no 'blocks' (Swin V2)"
    ),
    "timm.models.vision_transformer_sam.VisionTransformerSAM": (
        "relative position bias and windowed attention (SAM ViT)"
    ),
    "timm.models.naflexvit.NaFlexVit": "variable token sets with attention masks (NaFlexViT)",
}

#: Attention classes refused (qualified class name -> reason), for models that reach the block check.
REFUSED_ATTENTION = {
    "timm.models.vision_transformer_relpos.RelPosAttention": "relative position bias added to the attention logits",
    "timm.models.beit.Attention": "relative position bias added to the attention logits (BEiT)",
    "timm.models.cait.TalkingHeadAttn": "talking-heads attention (logits mixed across heads)",
    "timm.models.cait.ClassAttn": "class attention (only the class token queries)",
    "timm.layers.diff_attention.DiffAttention": "differential attention (the difference of two softmax maps)",
}

_SUPPORTED_MODELS = {
    "timm.models.vision_transformer.VisionTransformer": (
        "timm.models.vision_transformer.Block",
        "timm.models.vision_transformer.ResPostBlock",
    ),
    "timm.models.deit.VisionTransformerDistilled": (
        "timm.models.vision_transformer.Block",
        "timm.models.vision_transformer.ResPostBlock",
    ),
    "timm.models.eva.Eva": ("timm.models.eva.EvaBlock", "timm.models.eva.EvaBlockPostNorm"),
}


def _qualname(obj) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def load_timm_model(model_id: str, weights_path: str | os.PathLike, model_kwargs: dict | None = None) -> nn.Module:
    """Build ``model_id`` with timm (no download) and load a safetensors state_dict strictly.

    Args:
        model_id: a timm model name (``timm.list_models()``).
        weights_path: ``<resources>/weights/timm/<model_id>.safetensors``.
        model_kwargs: extra ``timm.create_model`` arguments (e.g. ``depth`` for a small test model).

    Returns:
        The model in eval mode, float32, on the CPU.

    Raises:
        kpca_repro.inputs.resources.WeightsFileError: the file is not a complete safetensors file
            (truncated, corrupt), or its tensors do not fit the architecture (missing, unexpected
            or differently shaped keys); one line naming the file and the fix.
    """
    import timm
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from kpca_repro.inputs.resources import WeightsFileError

    model = timm.create_model(model_id, pretrained=False, **(model_kwargs or {}))
    try:
        state = load_file(str(weights_path))
    except SafetensorError as exc:
        raise WeightsFileError(
            f"weights file {weights_path} is not a complete safetensors file ({exc}): it is truncated or corrupt. "
            f"Replace it with a complete copy of the {model_id} weights, or delete it and run with offline: false to "
            "download it again"
        ) from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    reshaped = sorted(k for k in set(state) & set(expected) if tuple(state[k].shape) != tuple(expected[k].shape))
    if missing or unexpected or reshaped:
        found = "; ".join(
            f"{len(keys)} {what} (e.g. {keys[0]})"
            for what, keys in (
                ("missing keys", missing),
                ("unexpected keys", unexpected),
                ("keys of another shape", reshaped),
            )
            if keys
        )
        raise WeightsFileError(
            f"weights file {weights_path} does not fit {model_id} with model_kwargs {model_kwargs or {}}: {found}. "
            f"Replace it with the weights of {model_id}, or correct vision.model_kwargs.{model_id}"
        )
    model.load_state_dict(state, strict=True)
    return model.eval().float()


# --------------------------------------------------------------------------------------
# Capture adapters: q, k, v recomputed from the attention's input as the module computes them
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaptureAdapter:
    """How one attention family computes the q, k, v its dot product uses.

    Attributes:
        name: stored in the activation file (``capture_adapter``).
        qkv: ``qkv(attn, x, rope) -> (q, k, v)``: ``x`` the attention's input ``(B, N, C)``,
            ``rope`` the rotary embedding the block passed (or None); returns three
            ``(B, H, N, d)`` tensors in ``x``'s dtype and device, computed with ``attn``'s own
            sub-modules in the order of its ``forward``.
    """

    name: str
    qkv: Callable[[nn.Module, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _qkv_timm_attention(attn: nn.Module, x: torch.Tensor, rope: torch.Tensor | None):
    """``timm.layers.Attention.forward`` up to the dot product: fused qkv, then q_norm / k_norm."""
    if rope is not None:
        raise UnsupportedArchitectureError(f"{_qualname(attn)} was given a rotary embedding it does not use")
    b, n, _ = x.shape
    q, k, v = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    identity = nn.Identity()  # timm versions without q/k norms on this class
    return getattr(attn, "q_norm", identity)(q), getattr(attn, "k_norm", identity)(k), v


def _qkv_rotary(attn: nn.Module, x: torch.Tensor, rope: torch.Tensor | None):
    """``EvaAttention.forward`` / ``AttentionRope.forward`` up to the dot product.

    Projection (fused ``qkv``; with EVA's q/v bias either ``F.linear(x, qkv.weight, [q_bias,
    k_bias, v_bias])`` or ``qkv(x) + bias`` as ``qkv_bias_separate`` says; or separate
    ``q_proj``/``k_proj``/``v_proj``), then ``q_norm``/``k_norm``, then the rotary embedding on
    the tokens after the ``num_prefix_tokens`` prefix with the module's own
    ``apply_rot_embed_cat``.
    """
    b, n, _ = x.shape
    heads = attn.num_heads
    if attn.qkv is not None:
        q_bias = getattr(attn, "q_bias", None)
        if q_bias is None:
            qkv = attn.qkv(x)
        else:
            bias = torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
            if getattr(attn, "qkv_bias_separate", False):
                qkv = attn.qkv(x)
                qkv += bias
            else:
                qkv = F.linear(x, weight=attn.qkv.weight, bias=bias)
        q, k, v = qkv.reshape(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    else:
        q = attn.q_proj(x).reshape(b, n, heads, -1).transpose(1, 2)
        k = attn.k_proj(x).reshape(b, n, heads, -1).transpose(1, 2)
        v = attn.v_proj(x).reshape(b, n, heads, -1).transpose(1, 2)
    identity = nn.Identity()  # timm versions without q/k norms on this class
    q, k = getattr(attn, "q_norm", identity)(q), getattr(attn, "k_norm", identity)(k)
    if rope is not None:
        rot = sys.modules[type(attn).__module__].apply_rot_embed_cat  # the function the module's forward calls
        npt = attn.num_prefix_tokens
        half = getattr(attn, "rotate_half", False)
        q = torch.cat([q[:, :, :npt, :], rot(q[:, :, npt:, :], rope, half=half)], dim=2).type_as(v)
        k = torch.cat([k[:, :, :npt, :], rot(k[:, :, npt:, :], rope, half=half)], dim=2).type_as(v)
    return q, k, v


@functools.cache
def capture_adapters() -> dict[type, CaptureAdapter]:
    """The supported attention classes (exact types) and their adapters.

    One dict per process (tests may patch an entry). Classes absent from the installed timm
    (``AttentionRope`` in older timm versions) are left out.
    """
    import timm.layers.attention as tla
    import timm.models.eva as eva

    out = {tla.Attention: CaptureAdapter("timm Attention: qkv, q_norm/k_norm", _qkv_timm_attention)}
    rotary = CaptureAdapter(
        "timm EvaAttention/AttentionRope: qkv (q/v bias), q_norm/k_norm, rotary embedding after the prefix tokens",
        _qkv_rotary,
    )
    out[eva.EvaAttention] = rotary
    if hasattr(tla, "AttentionRope"):
        out[tla.AttentionRope] = rotary
    return out


def _refuse(model_id: str, reason: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"{model_id}: unsupported for the attention capture: {reason}. Supported: {SUPPORTED_FAMILIES} "
        "(docs/own_models.md: 'Run the analysis on your own model')"
    )


def capture_plan(model: nn.Module, model_id: str | None = None) -> list[tuple[nn.Module, CaptureAdapter]]:
    """Every block's attention module with its adapter, or the reason the model is refused.

    Checks the structure only (works on PyTorch's meta device): the model, block and attention
    classes (exact types; no ``forward`` replaced on an instance), no gate on the head outputs, as many key/value heads
    as query heads, ``attn.scale == head_dim ** -0.5`` (timm's fused path ignores ``attn.scale``
    and uses ``1/sqrt(d)``, so another value would make the two paths disagree), and a
    ``patch_embed`` with ``img_size`` and ``num_patches``.

    Args:
        model: a timm model.
        model_id: named in the error (default: the model's class name).

    Returns:
        ``[(blocks[l].attn, adapter), ...]`` in depth order.

    Raises:
        UnsupportedArchitectureError: one line naming the model, the reason and
            :data:`SUPPORTED_FAMILIES`.
    """
    name = model_id or type(model).__name__
    cls = _qualname(model)
    if cls in REFUSED_MODELS:
        raise _refuse(name, REFUSED_MODELS[cls])
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise _refuse(name, f"{type(model).__name__} has no 'blocks' (not a plain stack of transformer blocks)")
    if cls not in _SUPPORTED_MODELS:
        raise _refuse(name, f"model class {cls} is not one the capture knows")
    patch = getattr(model, "patch_embed", None)
    if patch is None or not hasattr(patch, "img_size") or not hasattr(patch, "num_patches"):
        raise _refuse(name, "no patch_embed with img_size and num_patches (the token count is unknown)")
    adapters = capture_adapters()
    plan = []
    for i, blk in enumerate(blocks):
        if _qualname(blk) not in _SUPPORTED_MODELS[cls]:
            raise _refuse(name, f"blocks[{i}] is a {_qualname(blk)}, not a block the capture knows")
        attn = getattr(blk, "attn", None)
        if attn is None:
            raise _refuse(name, f"blocks[{i}] has no 'attn' module")
        acls = _qualname(attn)
        if acls in REFUSED_ATTENTION:
            raise _refuse(name, f"blocks[{i}].attn is {type(attn).__name__}: {REFUSED_ATTENTION[acls]}")
        adapter = adapters.get(type(attn))
        if adapter is None:
            raise _refuse(name, f"blocks[{i}].attn is {acls}, an attention the capture does not know")
        if "forward" in vars(attn):
            raise _refuse(name, f"blocks[{i}].attn has its forward replaced on the instance")
        if getattr(attn, "gate", None) is not None:
            raise _refuse(name, f"blocks[{i}].attn gates its head outputs with a sigmoid (gated attention)")
        kv_heads = getattr(attn, "num_kv_heads", attn.num_heads)
        if kv_heads != attn.num_heads:
            raise _refuse(
                name,
                f"blocks[{i}].attn is grouped-query attention ({kv_heads} key/value heads for {attn.num_heads} query "
                "heads)",
            )
        expected = attn.head_dim**-0.5
        if float(attn.scale) != expected:
            raise _refuse(
                name,
                f"blocks[{i}].attn scales the logits by {float(attn.scale):g}, not 1/sqrt(head_dim) = {expected:g}",
            )
        plan.append((attn, adapter))
    if not plan:
        raise _refuse(name, "no blocks")
    return plan


def attention_modules(model: nn.Module, model_id: str | None = None) -> list[nn.Module]:
    """The attention module of every block, in depth order (:func:`capture_plan`'s checks).

    Raises:
        UnsupportedArchitectureError: the model is refused (see :func:`capture_plan`).
    """
    return [attn for attn, _ in capture_plan(model, model_id)]


def attention_scale(attns: Iterable[nn.Module]) -> float:
    """The logit scale ``s = 1/sqrt(d)`` shared by the given (checked) attention modules.

    Raises:
        UnsupportedArchitectureError: the layers have different head dimensions.
    """
    scales = {a.head_dim**-0.5 for a in attns}
    if len(scales) != 1:
        raise UnsupportedArchitectureError(
            f"layers with different head dimensions (scales {sorted(scales)}); the activation file holds one d"
        )
    return float(scales.pop())


_CHECKED: dict[str, VisionModelCheck] = {}


def _n_tokens(net: nn.Module) -> int | None:
    """Tokens per image of a timm ViT: its patches plus its prefix (class, distillation) tokens."""
    patches = getattr(getattr(net, "patch_embed", None), "num_patches", None)
    if not isinstance(patches, int):
        return None
    return patches + int(getattr(net, "num_prefix_tokens", 0) or 0)


def check_vision_model(model_id: str, model_kwargs: dict | None = None) -> VisionModelCheck:
    """Build ``model_id`` on PyTorch's meta device (no weights, no memory) and check it.

    What the extraction job calls first (``workflow/scripts/extract_vision.py``), so that a model
    timm does not know, or whose attention the capture does not reproduce, ends the job in one
    line naming it. Results are cached per ``(model_id, model_kwargs)`` in the process.

    Args:
        model_id: a timm model id.
        model_kwargs: the model's ``vision.model_kwargs`` entry.

    Returns:
        :class:`VisionModelCheck`.

    Raises:
        ModelBuildError: not a timm model id, or ``timm.create_model`` fails with these kwargs.
        UnsupportedArchitectureError: the capture does not support the model (:func:`capture_plan`).
    """
    import timm

    kwargs = dict(model_kwargs or {})
    key = json.dumps([model_id, kwargs], sort_keys=True, default=str)
    if key in _CHECKED:
        return _CHECKED[key]
    if not timm.is_model(model_id):
        raise ModelBuildError(f"{model_id!r} is not a timm model id (see timm.list_models())")
    try:
        with torch.device("meta"):
            net = timm.create_model(model_id, pretrained=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any build failure is a configuration error, reported in one line
        raise ModelBuildError(
            f"{model_id}: timm.create_model fails with model_kwargs {kwargs}: {type(exc).__name__}: {exc}"
        ) from None
    plan = capture_plan(net, model_id)
    attns = [a for a, _ in plan]
    heads = {a.num_heads for a in attns}
    if len(heads) != 1:
        raise _refuse(model_id, f"layers with different numbers of heads {sorted(heads)}")
    scale = attention_scale(attns)
    result = VisionModelCheck(
        len(plan),
        heads.pop(),
        int(attns[0].head_dim),
        scale,
        "; ".join(dict.fromkeys(a.name for _, a in plan)),
        _n_tokens(net),
    )
    _CHECKED[key] = result
    return result


def split_heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """``(B, N, H * d)`` concatenated per-head vectors -> ``(B, H, N, d)`` (a view, no copy).

    The layout of every attention's per-head tensors before the output projection (timm and
    Hugging Face alike): head ``h`` occupies features ``h * d .. (h + 1) * d``.
    """
    b, n, _ = x.shape
    return x.reshape(b, n, n_heads, head_dim).permute(0, 2, 1, 3)


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


class CaptureRecorder(HeadRecorder):
    """Records the q, k, v, h every layer's attention really uses (module docstring).

    Per layer: a forward pre-hook (with keyword arguments) on the attention module binds its
    call to ``forward``'s signature, takes ``x`` and ``rope``, and stores the adapter's
    ``q, k, v``; a forward pre-hook on ``attn.norm`` (when not the identity) or ``attn.proj``
    stores ``h``. After ``model(x)``, ``captured[layer]`` maps ``"q" | "k" | "v" | "h"`` to
    ``(B, H, N, d)`` tensors on the model's device (float32 for a float32 model).

    Args:
        plan: :func:`capture_plan`'s ``[(attn, adapter), ...]``.
        model_id: named in errors.

    Raises (during the forward pass):
        UnsupportedArchitectureError: an attention is called with an attention mask or
            ``is_causal`` (the stored tensors would not carry the mask).
    """

    def __init__(self, plan: Iterable[tuple[nn.Module, CaptureAdapter]], model_id: str = "model"):
        plan = list(plan)
        super().__init__(attn for attn, _ in plan)
        self.adapters = [adapter for _, adapter in plan]
        self.model_id = model_id

    def file_attrs(self) -> dict:
        """The activation file's ``capture_adapter``: the adapters' names, once each."""
        return {"capture_adapter": "; ".join(dict.fromkeys(adapter.name for adapter in self.adapters))}

    def _attn_pre_hook(self, layer: int):
        adapter = self.adapters[layer]
        signature = inspect.signature(type(self.attns[layer]).forward)

        def hook(mod, args, kwargs):
            call = signature.bind(mod, *args, **kwargs).arguments
            if call.get("attn_mask") is not None or call.get("is_causal", False):
                raise _refuse(self.model_id, f"blocks[{layer}].attn is called with an attention mask or is_causal")
            q, k, v = adapter.qkv(mod, call["x"], call.get("rope"))
            self.captured[layer].update(q=q, k=k, v=v)

        return hook

    def _h_pre_hook(self, layer: int):
        """h = the per-head input of ``attn.norm`` or ``attn.proj`` (its first positional argument)."""
        attn = self.attns[layer]

        def hook(_mod, args):
            self.captured[layer]["h"] = split_heads(args[0], attn.num_heads, attn.head_dim)

        return hook

    def _register(self) -> list:
        handles = []
        for layer, attn in enumerate(self.attns):
            handles.append(attn.register_forward_pre_hook(self._attn_pre_hook(layer), with_kwargs=True))
            norm = getattr(attn, "norm", None)
            target = norm if isinstance(norm, nn.Module) and not isinstance(norm, nn.Identity) else attn.proj
            handles.append(target.register_forward_pre_hook(self._h_pre_hook(layer)))
        return handles
