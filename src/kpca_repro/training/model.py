"""The models of Figures 1 and 4: timm's vision transformer with a recording attention, and the
quantities logged after every epoch.

docs/method.md Section 6.1: the authors train ViT-Tiny (3 heads, d = 64) and "DeiT-Tiny" (the same
network with 6 heads, d = 32) from scratch. Their attention standardizes q and k per token
(unbiased std, no epsilon) before ``softmax(s q k^T)``; :class:`RecordingAttention` replaces
timm's ``blocks[l].attn`` (:func:`build_model`). On a fixed batch, :func:`reconstruction_metrics`
gives, averaged over layers, the authors' :data:`~kpca_repro.training.logs.RECON_METRICS`

* ``error`` = J_proj, the mean over (image, head, token) of ``|phi_i - ||h_i||^2|``,
* ``rel_error_wrt_h``, ``rel_error_wrt_phiq``, ``h_norms_ave``, ``phiq_norms_ave``,

with ``phi_i = exp(s q_i.q_i) / (sum_j exp(s q_i.k_j))^2`` in plain float32 ``exp``
(:func:`kpca_repro.projection.feature_norm_sq` with ``log_domain=False``), and the
:data:`~kpca_repro.training.logs.TOKEN_STATS` that no single token dominates, from the same
forward pass, so they cost no extra random draw and leave the other values unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kpca_repro.projection import feature_norm_sq, output_norm_sq, projection_errors, standardize_tokens
from kpca_repro.training.logs import HIGH_QUANTILE, RECON_METRICS

__all__ = ["RecordingAttention", "build_model", "recording_attentions", "reconstruction_metrics"]

#: :data:`~kpca_repro.training.logs.RECON_METRICS` -> the key of :func:`kpca_repro.projection.projection_errors`.
_FROM_KPCA = {
    "error": "error",
    "rel_error_wrt_h": "rel_error_wrt_h",
    "rel_error_wrt_phiq": "rel_error_wrt_phiq",
    "h_norms_ave": "h_ave",
    "phiq_norms_ave": "phi_ave",
}


def _timm_attention():
    from timm.models.vision_transformer import Attention

    return Attention


class RecordingAttention(_timm_attention()):
    """timm's ``Attention`` with optional per-token q/k standardization and recording.

    The forward pass is timm's (fused qkv Linear, ``softmax(s q k^T) v``, output projection),
    except that with ``standardize_qk`` the per-head q and k are first standardized per token
    over their ``d`` features with the unbiased std and no epsilon
    (:func:`kpca_repro.projection.standardize_tokens` with ``eps=0``; the authors'
    ``Reconstruction/softmax.py``, docs/method.md 6.1). With ``record = True`` the forward keeps
    ``recorded = {"q", "k", "h"}``: the q and k entering the softmax and the per-head output
    ``h`` before the projection, each ``(B, H, N, d)`` float32, detached.

    Build it with :meth:`from_timm`, which copies a timm ``Attention``'s weights.
    """

    standardize_qk: bool = False
    record: bool = False

    @classmethod
    def from_timm(cls, attn: nn.Module, standardize_qk: bool) -> "RecordingAttention":
        """A copy of timm ``Attention`` ``attn`` (same weights, dropout rates) as this class.

        Raises:
            TypeError: ``attn`` normalises q/k or the head outputs, or is gated (the recorded
                ``h`` would not be the attention output).
        """
        if (
            not isinstance(attn.q_norm, nn.Identity)
            or not isinstance(attn.k_norm, nn.Identity)
            or not isinstance(attn.norm, nn.Identity)
            or attn.gate is not None
        ):
            raise TypeError("RecordingAttention supports timm Attention without qk_norm, scale_norm or gating")
        new = cls(
            attn.qkv.in_features,
            num_heads=attn.num_heads,
            qkv_bias=attn.qkv.bias is not None,
            proj_bias=attn.proj.bias is not None,
            attn_drop=attn.attn_drop.p,
            proj_drop=attn.proj_drop.p,
        )
        new.load_state_dict(attn.state_dict(), strict=True)
        new.standardize_qk = standardize_qk
        new.recorded = {}
        return new

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        """``(B, N, C) -> (B, N, C)``; see the class docstring."""
        if attn_mask is not None or is_causal:
            raise NotImplementedError("RecordingAttention is for full (unmasked) vision attention")
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.standardize_qk:
            q, k = standardize_tokens(q, eps=0.0), standardize_tokens(k, eps=0.0)
        h = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0, scale=self.scale
        )
        if self.record:
            self.recorded = {"q": q.detach().float(), "k": k.detach().float(), "h": h.detach().float()}
        x = h.transpose(1, 2).reshape(b, n, self.attn_dim)
        return self.proj_drop(self.proj(x))


def build_model(
    timm_id: str,
    *,
    num_heads: int,
    standardize_qk: bool,
    num_classes: int,
    img_size: int,
    patch_size: int,
    in_chans: int,
    drop_path: float = 0.0,
    depth: int | None = None,
    embed_dim: int | None = None,
) -> nn.Module:
    """A randomly initialised timm VisionTransformer with :class:`RecordingAttention` blocks.

    ``timm.create_model(timm_id, pretrained=False, num_heads=..., ...)`` (docs/method.md 6.1: the
    authors' "DeiT-Tiny" is ``deit_tiny_patch16_224`` with 6 heads; ViT-Tiny keeps 3), then
    ``blocks[l].attn`` is replaced by :meth:`RecordingAttention.from_timm` (same initial
    weights). ``depth``/``embed_dim`` None keep timm's values (12 and 192 for the tiny models).

    Returns:
        The model, float32, on the CPU, in train mode.

    Raises:
        ValueError: ``img_size`` is not a multiple of ``patch_size``.
    """
    import timm

    kwargs = dict(
        pretrained=False,
        num_heads=num_heads,
        num_classes=num_classes,
        img_size=img_size,
        patch_size=patch_size,
        in_chans=in_chans,
        drop_path_rate=drop_path,
    )
    if depth is not None:
        kwargs["depth"] = depth
    if embed_dim is not None:
        kwargs["embed_dim"] = embed_dim
    if img_size % patch_size:
        raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
    model = timm.create_model(timm_id, **kwargs)
    for blk in model.blocks:
        blk.attn = RecordingAttention.from_timm(blk.attn, standardize_qk)
    return model.float().train()


def recording_attentions(model: nn.Module) -> list[RecordingAttention]:
    """``blocks[l].attn`` of every block, in depth order.

    Raises:
        TypeError: a block's attention is not a :class:`RecordingAttention` (use :func:`build_model`).
    """
    attns = [blk.attn for blk in model.blocks]
    if not all(isinstance(a, RecordingAttention) for a in attns):
        raise TypeError(
            "the model's blocks[*].attn are not RecordingAttention; build it with kpca_repro.training.model.build_model"
        )
    return attns


@torch.no_grad()
def reconstruction_metrics(model: nn.Module, images: torch.Tensor, train_mode: bool) -> dict[str, float]:
    """The logged quantities of one fixed batch (docs/method.md 6.1), means and token statistics.

    One forward pass with every :class:`RecordingAttention` recording; per layer, over all
    (image, head, token): ``phi = ||phi(q_i)||^2`` by :func:`kpca_repro.projection.feature_norm_sq`
    (``log_domain=False``: plain ``exp`` in float32, as the training code; NaN/inf where it
    overflows), ``||h_i||^2`` by :func:`kpca_repro.projection.output_norm_sq`, then
    :func:`kpca_repro.projection.projection_errors`; the model-level value of each of
    :data:`~kpca_repro.training.logs.RECON_METRICS` is the unweighted mean over layers
    (``np.average`` in the reference). The :data:`~kpca_repro.training.logs.TOKEN_STATS` are
    taken over the values of all layers pooled (every layer has the same number of tokens, so
    the pooled mean would equal the logged one): float64 ``np.quantile`` (linear interpolation)
    at 0.5 and :data:`~kpca_repro.training.logs.HIGH_QUANTILE`, NaN if any value is NaN, as the
    mean. They reuse the recorded tensors, so no random number is drawn beyond the forward pass.
    The model's train/eval mode is restored.

    Args:
        model: from :func:`build_model`.
        images: ``(B, C, H, W)`` float32, on the model's device.
        train_mode: forward in train mode (the "train" batch: drop-path active) or eval mode.

    Returns:
        ``{name: float}`` for the names in :data:`~kpca_repro.training.logs.RECON_METRICS` and
        :data:`~kpca_repro.training.logs.TOKEN_STATS`.
    """
    attns = recording_attentions(model)
    was_training = model.training
    model.train(train_mode)
    for a in attns:
        a.record = True
    try:
        model(images)
    finally:
        for a in attns:
            a.record = False
        model.train(was_training)
    per_layer = {m: [] for m in RECON_METRICS}
    phis, hs = [], []
    for a in attns:
        rec = a.recorded
        phi = feature_norm_sq(rec["q"], rec["k"], scale=a.scale, log_domain=False)
        h_sq = output_norm_sq(rec["h"])
        errs = projection_errors(phi, h_sq)
        for m in RECON_METRICS:
            per_layer[m].append(float(errs[_FROM_KPCA[m]]))
        phis.append(phi.flatten().cpu())
        hs.append(h_sq.flatten().cpu())
        a.recorded = {}
    out = {m: float(np.average(v)) for m, v in per_layer.items()}
    out.update(_token_stats(torch.cat(phis).double().numpy(), torch.cat(hs).double().numpy()))
    return out


def _token_stats(phi: np.ndarray, h_sq: np.ndarray) -> dict[str, float]:
    """:data:`~kpca_repro.training.logs.TOKEN_STATS` of pooled per-token ``phi`` and
    ``||h||^2`` (1-D float64, same length)."""
    levels = [0.5, HIGH_QUANTILE]
    out = {}
    for name, values in (("error", np.abs(phi - h_sq)), ("h_norms", h_sq), ("phiq_norms", phi)):
        # np.quantile returns NaN when a value is NaN (as the mean); inf sorts last
        median, high = np.quantile(values, levels)
        out[f"{name}_median"], out[f"{name}_q99"] = float(median), float(high)
    out["phiq_above_h_frac"] = float(np.mean(phi > h_sq))
    return out
