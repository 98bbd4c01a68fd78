"""Test-only hook recorders: the naive capture the pipeline's is checked against.

:class:`AttentionRecorder` hooks timm's ``attn.qkv`` Linear and ``attn.proj``: the raw
projections, which are the tensors the attention uses only for the plain ``Attention`` (no q/k
norm, no rotary embedding, no sub-LN). The extraction uses
:class:`kpca_repro.capture.vision.CaptureRecorder`, right for every supported family; the tests
use this one as the independent baseline (tests/test_capture_vision.py, test_extraction.py,
test_training.py's attention module). No rule imports it, so it lives in tools/ (tools/README.md).
"""

from __future__ import annotations

from kpca_repro.capture.vision import CaptureRecorder, HeadRecorder

__all__ = ["AttentionRecorder"]


class AttentionRecorder(HeadRecorder):
    """Records the raw projections: q, k, v from a forward hook on ``attn.qkv``, h from a
    forward pre-hook on ``attn.proj``.

    After ``model(x)``, ``recorder.captured[layer]`` maps ``"q" | "k" | "v" | "h"`` to float32
    tensors of shape ``(B, H, N, d)`` on the model's device. ``attns``: modules with ``qkv``
    (a fused Linear, output ``(B, N, 3 * H * d)``), ``proj``, ``num_heads`` and ``head_dim``
    (timm's ``Attention``, the training code's attention module).
    """

    def _qkv_hook(self, layer: int):
        attn = self.attns[layer]

        def hook(_mod, _inp, out):
            b, n, _ = out.shape
            qkv = out.reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
            self.captured[layer].update(q=qkv[0], k=qkv[1], v=qkv[2])

        return hook

    #: h = the per-head input of ``attn.proj``: the pipeline recorder's h hook, registered on ``proj``.
    _proj_pre_hook = CaptureRecorder._h_pre_hook

    def _register(self) -> list:
        handles = []
        for layer, attn in enumerate(self.attns):
            handles.append(attn.qkv.register_forward_hook(self._qkv_hook(layer)))
            handles.append(attn.proj.register_forward_pre_hook(self._proj_pre_hook(layer)))
        return handles
