"""PyTorch's own attention: q, k, v, h of ``nn.MultiheadAttention`` (so ``nn.TransformerEncoder``,
``nn.TransformerEncoderLayer`` and ``nn.Transformer``'s encoder) for
:class:`~kpca_repro.capture.module_capture.ModuleCapture`.

q, k, v are recomputed in a forward pre-hook on the module from its own call: the query
(the self-attention input) times ``in_proj_weight`` plus ``in_proj_bias``, in the module's
own sequence-first layout, split into heads as
``F.multi_head_attention_forward`` splits them. The logit scale of both of its kernels
(explicit softmax when ``need_weights``, SDPA otherwise) is ``1/sqrt(d)``.

h is the attention's own output, not a recomputation. ``nn.MultiheadAttention.forward``
never calls ``out_proj`` as a module: ``F.multi_head_attention_forward`` receives
``out_proj.weight`` and ``out_proj.bias`` and applies them with
``torch.nn.functional.linear(attn_output, out_proj_weight, out_proj_bias)``, so a hook on
``out_proj`` never fires. Three ways to reach h were weighed:

* computing it from the captured q, k, v: circular, the invariant would check nothing;
* solving ``out = h W_o^T + b_o`` for h from the module's output (its forward hook fires):
  independent, but the float32 round-off of ``out`` is amplified by ``cond(W_o)`` (217 for
  PyTorch's default initialisation at width 64; unbounded for a trained, nearly singular
  ``W_o``), and the result is a reconstruction, not the tensor the model produced;
* the input of that ``linear`` call: the concatenated per-head output
  ``(N * B, H * d)`` exactly as the model computed it. A ``TorchFunctionMode`` cannot see
  it (``F.multi_head_attention_forward`` dispatches itself to the mode, and its body then
  runs with the mode popped), so the capture observes the module-level name
  ``torch.nn.functional.linear`` that the body calls.

The capture takes the third: while a capture on ``nn.MultiheadAttention`` is open,
``torch.nn.functional.linear`` is replaced by a wrapper that forwards every call unchanged
and, between a watched module's forward pre-hook and its forward hook, records the input of
the call whose weight *is* that module's ``out_proj.weight``; and PyTorch's fused
fast path (``torch.backends.mha``; eval mode without gradients, which fuses the whole
attention, or the whole ``TransformerEncoderLayer``, into one kernel and turns
``TransformerEncoder``'s padded input into a nested tensor) is off, so every attention
runs the reference path of ``F.multi_head_attention_forward`` (the path of training; the
fast path computes the same attention). Both are process-wide and restored when the last
such capture closes. Tests check that ``out_proj`` applied to the captured h reproduces the
module's output and that the invariant error is 6e-8 to 1.5e-7 of ``max |v|`` (tests/test_torch_attention.py).

Refused, with the module named (:class:`~kpca_repro.capture.vision.UnsupportedArchitectureError`):
``bias_k``/``bias_v`` or ``add_zero_attn`` (an extra key every query sees); during the
forward pass, cross-attention (key or value other than the query), an ``attn_mask`` or
``is_causal`` (format 1 knows only key padding), an additive float ``key_padding_mask``
with values other than 0 and -inf, nested-tensor input, and dropout in training mode.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kpca_repro.capture.vision import UnsupportedArchitectureError

__all__ = [
    "is_torch_attention",
    "check_torch_attention",
    "find_torch_attention",
    "torch_attention_qkv",
    "key_padding_real",
    "observe_out_projection",
    "OUT_PROJ_REASON",
]

#: Why a hook on ``nn.MultiheadAttention.out_proj`` never fires (named by HooksDidNotFireError).
OUT_PROJ_REASON = (
    "nn.MultiheadAttention applies its output projection functionally: F.multi_head_attention_forward passes "
    "out_proj.weight and out_proj.bias "
    "to torch.nn.functional.linear and never calls out_proj as a module, so its hooks never fire"
)


def is_torch_attention(module) -> bool:
    """Whether ``module`` is a ``torch.nn.MultiheadAttention`` (or a subclass)."""
    return isinstance(module, nn.MultiheadAttention)


def check_torch_attention(module: nn.MultiheadAttention, name: str) -> None:
    """Refuse an ``nn.MultiheadAttention`` whose attention is not ``softmax(q k^T/sqrt(d) + mask) v`` over the input's
    tokens.

    Raises:
        UnsupportedArchitectureError: ``bias_k``/``bias_v`` (a learned key and value appended to
            every sequence) or ``add_zero_attn`` (a zero key appended): every query sees a key
            that is not a token, which format 1 cannot store.
    """
    if module.bias_k is not None or module.bias_v is not None:
        raise UnsupportedArchitectureError(
            f"{name} (nn.MultiheadAttention) has add_bias_kv=True: a learned key and value appended to every "
            "sequence, which the activation format cannot store"
        )
    if module.add_zero_attn:
        raise UnsupportedArchitectureError(
            f"{name} (nn.MultiheadAttention) has add_zero_attn=True: a zero key and value appended to every "
            "sequence, which the activation format cannot store"
        )


def find_torch_attention(model: nn.Module) -> list[tuple[str, nn.MultiheadAttention]]:
    """Every ``nn.MultiheadAttention`` in ``model`` with its path, in ``model.named_modules()`` order.

    For ``nn.TransformerEncoder`` that is layer order (``layers.0.self_attn``, ``layers.1.self_attn``, ...).
    A module registered twice is listed once.
    """
    return [(name or "<model>", m) for name, m in model.named_modules() if is_torch_attention(m)]


def _bind(module: nn.Module, args: tuple, kwargs: Mapping) -> dict:
    """The arguments of one call of ``module`` by name (``query``, ``key``, ``value``, ``key_padding_mask``, ...;
    defaults applied)."""
    bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def key_padding_real(mask: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """``key_padding_mask`` (bool, True = padded; or additive float, -inf = padded) -> ``(B, N)`` bool, True = real key.

    Raises:
        UnsupportedArchitectureError: a float mask with values other than 0 and -inf (an
            additive logit term the format cannot store).
    """
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return ~mask
    if not torch.is_floating_point(mask):
        raise UnsupportedArchitectureError(
            f"{name} was called with a key_padding_mask of dtype {mask.dtype}; expected bool (True = padded) or "
            "float (-inf = padded)"
        )
    padded = torch.isneginf(mask)
    if not bool(((mask == 0) | padded).all()):
        raise UnsupportedArchitectureError(
            f"{name} was called with a float key_padding_mask holding values other than 0 and -inf: an additive "
            "logit term the activation format cannot store"
        )
    return ~padded


def torch_attention_qkv(
    module: nn.MultiheadAttention, args: tuple, kwargs: Mapping, name: str = "nn.MultiheadAttention"
):
    """q, k, v of one ``nn.MultiheadAttention`` call, as ``F.multi_head_attention_forward`` computes them.

    Args:
        module: the attention module.
        args, kwargs: its call (a forward pre-hook's ``args``/``kwargs``).
        name: named in errors.

    Returns:
        ``(q, k, v, real)``: q, k, v ``(B, H, N, d)`` in the input's dtype and device (an
        unbatched ``(N, E)`` input gives ``B = 1``); ``real`` the ``(B, N)`` bool of real keys
        (from ``key_padding_mask``) or None.

    Raises:
        UnsupportedArchitectureError: nested-tensor input, cross-attention, an ``attn_mask``
            or ``is_causal``, a float key_padding_mask other than 0/-inf, dropout in training mode.
    """
    call = _bind(module, args, kwargs)
    x, key, value = call["query"], call["key"], call["value"]
    if x.is_nested:
        raise UnsupportedArchitectureError(
            f"{name} was called with a nested tensor; pass padded tensors with a key_padding_mask"
        )
    if not (key is x or (key.shape == x.shape and torch.equal(key, x))) or not (
        value is x or (value.shape == x.shape and torch.equal(value, x))
    ):
        raise UnsupportedArchitectureError(
            f"{name} is called as cross-attention (key or value is not the query); the activation format holds "
            "self-attention (q and k over the same tokens)"
        )
    if call.get("attn_mask") is not None or call.get("is_causal", False):
        raise UnsupportedArchitectureError(
            f"{name} was called with an attn_mask or is_causal: the activation format knows key padding only "
            "(docs/activations.md 1)"
        )
    if module.training and module.dropout > 0:
        raise UnsupportedArchitectureError(
            f"{name} is in training mode with attention dropout {module.dropout}: call model.eval() before capturing"
        )
    real = key_padding_real(call.get("key_padding_mask"), name)
    # the module's own layout: sequence first (L, B, E); an unbatched (L, E) input is batch 1
    xs = x.unsqueeze(1) if x.dim() == 2 else (x.transpose(0, 1) if module.batch_first else x)
    if real is not None and real.dim() == 1:
        real = real[None]
    # self-attention, so kdim = vdim = embed_dim and the projection is the packed in_proj_weight
    q, k, v = F.linear(xs, module.in_proj_weight, module.in_proj_bias).unflatten(-1, (3, module.embed_dim)).unbind(-2)
    heads = module.num_heads
    return tuple(split_seq_first(t, heads) for t in (q, k, v)) + (real,)


def split_seq_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(N, B, H * d)`` sequence-first concatenated heads -> ``(B, H, N, d)`` (a view)."""
    n, b, e = x.shape
    return x.reshape(n, b, heads, e // heads).permute(1, 2, 0, 3)


def head_dim(module: nn.MultiheadAttention) -> int:
    """The head dimension d of ``module`` (its logit scale is ``1/sqrt(d)``)."""
    return module.embed_dim // module.num_heads


# --------------------------------------------------------------------------------------
# Observing the out-projection call: a process-wide wrapper of torch.nn.functional.linear
# --------------------------------------------------------------------------------------

_WATCHED: dict[int, tuple[torch.Tensor, object]] = {}  # id(out_proj.weight) -> (weight, callback)
_STATE: dict = {"users": 0, "linear": None, "fastpath": None}


def _observing_linear(input, weight, bias=None):  # noqa: A002 - the name F.linear's callers pass by keyword
    entry = _WATCHED.get(id(weight))
    if entry is not None and entry[0] is weight:
        entry[1](input)
    return _STATE["linear"](input, weight, bias)


class _Observation:
    """A hook handle (``remove()``) for one watched ``out_proj.weight``; the last one restores PyTorch's state."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def remove(self) -> None:
        if self.weight is None:
            return
        entry = _WATCHED.get(id(self.weight))
        if entry is not None and entry[0] is self.weight:
            del _WATCHED[id(self.weight)]
        self.weight = None
        _STATE["users"] -= 1
        if _STATE["users"] == 0:
            F.linear = _STATE["linear"]
            torch.backends.mha.set_fastpath_enabled(_STATE["fastpath"])
            _STATE["linear"] = _STATE["fastpath"] = None


def observe_out_projection(module: nn.MultiheadAttention, callback) -> _Observation:
    """Call ``callback(input)`` with the input of every ``F.linear`` call on ``module.out_proj.weight``.

    The first observation wraps ``torch.nn.functional.linear`` and turns PyTorch's MHA fast path
    off (module docstring); the handle's ``remove()`` undoes both when it is the last.

    Raises:
        ValueError: ``module.out_proj.weight`` is already observed by an open capture.
    """
    weight = module.out_proj.weight
    if id(weight) in _WATCHED and _WATCHED[id(weight)][0] is weight:
        raise ValueError("this nn.MultiheadAttention's out_proj is already observed by an open capture; close it first")
    if _STATE["users"] == 0:
        _STATE["linear"], _STATE["fastpath"] = F.linear, torch.backends.mha.get_fastpath_enabled()
        F.linear = _observing_linear
        torch.backends.mha.set_fastpath_enabled(False)
    _STATE["users"] += 1
    _WATCHED[id(weight)] = (weight, callback)
    return _Observation(weight)
