"""Hugging Face attention capture: store the q, k, v the attention really uses, or refuse.

The KPCA analysis (docs/method.md Sections 0 and 3) needs, per layer and head, the q, k, v of an
attention of the form ``h = softmax(s q k^T + mask) v`` with ``s = 1/sqrt(d)``, and ``h``, the
per-head output before the output projection; ``mask`` is key padding, and for a decoder also
the causal mask (query i sees keys j <= i). Hugging Face models differ in what they do between
their projections and the dot product, so each family has an adapter (:data:`FAMILIES`) that
finds the attention modules by structure, hooks their projections, and applies to the hooked
tensors exactly what the model's own forward applies, with the model's own functions:

=================  ======================================================================
family             stored q, k, v
=================  ======================================================================
``bert``           outputs of ``query``/``key``/``value`` (BERT, RoBERTa, ELECTRA, XLM-R,
                   CamemBERT, LUKE, MiniLM): what the attention uses, unchanged
``longformer``     the same, computed on ``(N, B, hidden)`` and stored batch-first; the
                   query is copied before Longformer divides it by sqrt(d) in place;
                   sliding window ``|i - j| <= attention_window // 2`` (a mask)
``distilbert``     outputs of ``q_lin``/``k_lin``/``v_lin``; h = input of ``out_lin``
``roformer``       ``query``/``key`` (and ``value`` if ``rotary_value``) after the model's
                   ``apply_rotary_position_embeddings`` with its ``sinusoidal_pos``
``esm``            ESM scales the query by ``d**-0.5`` and then rotates q and k (rotary
                   configs); stored: the rotated key as used, and the rotated scaled query
                   divided by the same ``d**-0.5`` (exact for d = 16, 64, 256; one float32
                   rounding otherwise), so that the logits are ``q k^T / sqrt(d)``
``modernbert``     the fused ``Wqkv`` output split into q, k, v, q and k after the model's
                   ``apply_rotary_pos_emb``; h = input of ``Wo``; local layers attend
                   within ``|i - j| <= local_attention // 2`` (a mask)
``vit``            ``ViTModel``/``Dinov2Model``: ``q_proj``/``k_proj``/``v_proj``; h = input
                   of ``o_proj``; no mask (capture level: the pipeline's vision path is timm)
``gpt2``           decoder: the fused ``c_attn`` (a ``Conv1D``: weight ``(in, out)``) output
                   split into q | k | v (``split(H d, dim=2)``); h = input of ``c_proj``
``llama``          decoder (llama, mistral, qwen2): ``q_proj``/``k_proj``/``v_proj``, q and
                   k after the model's ``apply_rotary_pos_emb`` with the ``position_embeddings``
                   the module received; k and v with ``num_key_value_heads`` heads, not
                   repeated (``kv_head_of_query`` = ``repeat_kv``'s map); h = input of ``o_proj``
``gpt_neox``       decoder: the fused ``query_key_value`` output viewed ``(B, N, H, 3 d)``
                   and chunked per head into q | k | v; q and k after the model's partial
                   rotary embedding (the first ``rotary_ndims`` features); h = input of ``dense``
=================  ======================================================================

Decoders are loaded with eager attention and written as format version 2 (``causal``, k and v
per KV head; :mod:`kpca_repro.activations`). Everything else is refused with one line naming the
model, the reason and the supported families
(:class:`~kpca_repro.capture.vision.UnsupportedArchitectureError`): relative-position attention
(DeBERTa, MPNet, T5, ...), ALiBi (BLOOM, MPT, Falcon with ``alibi``), attention sinks (gpt-oss),
logit soft-capping (Gemma 2), qk-norm decoders (Qwen3, OLMo 2, Gemma 3), cross-attention and
encoder-decoders, a GPT-2 logit scale other than 1/sqrt(d), a sliding window shorter than the
rows (:func:`check_rows`), a decoder in ``text.models`` or an encoder in ``decoders.models``,
and any model type not listed. :func:`check_text_model` does this from the configuration
alone (no weights), so that the extraction job refuses before loading any.

Trust, but verify: the extraction's writer recomputes ``softmax(q k^T / sqrt(d) + mask) v`` from
the tensors about to be stored, with each module's local window (:attr:`HFAttention.window`), and
fails the extraction when it does not reproduce h (:class:`kpca_repro.activations.ActivationWriter`),
so a model an adapter misreads is never analysed silently.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kpca_repro.activations import BATCH_FIRST, SEQUENCE_FIRST, repeat_kv_map
from kpca_repro.capture.vision import HeadRecorder, UnsupportedArchitectureError, split_heads

__all__ = [
    "BATCH_FIRST",
    "SEQUENCE_FIRST",
    "Family",
    "FAMILIES",
    "MODEL_TYPES",
    "TEXT_FAMILIES",
    "DECODER_FAMILIES",
    "REFUSED",
    "supported_summary",
    "hf_family",
    "sliding_window",
    "check_rows",
    "decoder_position_ids",
    "check_text_model",
    "HFAttention",
    "attention_modules",
    "HFAttentionRecorder",
]

# --------------------------------------------------------------------------------------
# Families
# --------------------------------------------------------------------------------------


def _model_fn(module: nn.Module, name: str) -> Callable:
    """The function ``name`` of the module that defines ``type(module)``: the one its forward calls."""
    fn = getattr(sys.modules[type(module).__module__], name, None)
    if fn is None:
        raise UnsupportedArchitectureError(
            f"{type(module).__module__} has no {name}; this transformers version is not supported by the capture"
        )
    return fn


def _no_transform(attn: HFAttention, t: dict, extras: dict) -> None:
    """q, k, v are the projection outputs themselves."""


def _roformer_rotary(attn: HFAttention, t: dict, extras: dict) -> None:
    """RoFormerSelfAttention: rotary on q, k (and v when ``rotary_value``) with ``sinusoidal_pos``."""
    pos = extras.get("sinusoidal_pos")
    if pos is None:  # the model applies no rotation either
        return
    rotate = attn.module.apply_rotary_position_embeddings
    if getattr(attn.module, "rotary_value", False):
        t["q"], t["k"], t["v"] = rotate(pos, t["q"], t["k"], t["v"])
    else:
        t["q"], t["k"] = rotate(pos, t["q"], t["k"])


def _esm_scale_rotary(attn: HFAttention, t: dict, extras: dict) -> None:
    """EsmSelfAttention: ``q * d**-0.5``, then rotary on q and k; q stored divided by ``d**-0.5``."""
    c = attn.module.attention_head_size**-0.5
    q = t["q"] * c
    if attn.module.position_embedding_type == "rotary":
        cos, sin = extras["position_embeddings"]
        q, t["k"] = _model_fn(attn.module, "apply_rotary_pos_emb")(q, t["k"], cos, sin, unsqueeze_dim=1)
    t["q"] = q / c


def _rope_qk(attn: HFAttention, t: dict, extras: dict) -> None:
    """Rotary on q and k with the ``(cos, sin)`` the module received, by the model's own
    ``apply_rotary_pos_emb`` (ModernBERT; Llama, Mistral, Qwen2 with k of the KV heads; GPT-NeoX,
    whose function rotates the first ``rotary_ndims`` features only, partial rotary)."""
    cos, sin = extras["position_embeddings"]
    t["q"], t["k"] = _model_fn(attn.module, "apply_rotary_pos_emb")(t["q"], t["k"], cos, sin, unsqueeze_dim=1)


def _split_modernbert(attn: HFAttention, out: torch.Tensor):
    """ModernBERT's ``Wqkv`` output ``(B, N, 3 H d)``: ``view(B, N, 3, H, d).unbind(2)``, each ``(B, H, N, d)``."""
    b, n, _ = out.shape
    return (x.transpose(1, 2) for x in out.view(b, n, 3, attn.n_heads, attn.head_dim).unbind(dim=-3))


def _split_gpt2(attn: HFAttention, out: torch.Tensor):
    """GPT-2's ``c_attn`` output ``(B, N, 3 H d)``: ``split(H d, dim=2)`` into q | k | v, each split into heads."""
    return (split_heads(x, attn.n_heads, attn.head_dim) for x in out.split(attn.n_heads * attn.head_dim, dim=2))


def _split_neox(attn: HFAttention, out: torch.Tensor):
    """GPT-NeoX's ``query_key_value`` output, per head ``[q | k | v]``:
    ``view(B, N, H, 3 d).transpose(1, 2).chunk(3, -1)``."""
    b, n, _ = out.shape
    return out.view(b, n, attn.n_heads, 3 * attn.head_dim).transpose(1, 2).chunk(3, dim=-1)


def _gpt2_scale(config) -> str | None:
    """GPT-2 options whose logit scale is not 1/sqrt(d) (the format's s)."""
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        return "scale_attn_by_inverse_layer_idx divides layer l's logits by l + 1 too"
    if not getattr(config, "scale_attn_weights", True):
        return "scale_attn_weights = False: logits q k^T without the 1/sqrt(d) scale"
    return None


@dataclass(frozen=True)
class Family:
    """How one Hugging Face attention family is captured.

    Attributes:
        name: family name (HDF5 attribute ``capture_adapter``).
        model_types: ``config.model_type`` values of the family.
        projections: names of the separate q, k, v ``nn.Linear`` children of the attention
            module, or None when ``fused`` names one projection computing q, k and v.
        fused: the fused projection's name (an ``nn.Linear`` or GPT-2's ``Conv1D``), or None.
        split: ``(attn, (B, N, 3 H d) output) -> q, k, v`` ``(B, H, N, d)`` of a fused projection,
            as the model's forward splits it.
        out_proj: dotted path of the output projection (h is its input), from the attention
            module; a leading ``"^."`` starts at the module's parent.
        heads: attribute names holding the head count, tried in order (``"config.x"`` reads
            the module's config).
        head_dim: attribute names holding the head size.
        kv_heads: attribute names holding the key/value head count (grouped-query attention);
            empty: as many as query heads.
        extras: forward arguments of the attention module the transform needs.
        transform: ``(attn, {"q","k","v"}, extras) -> None``, applied in place after the
            module's forward: what the model does between the projections and the dot product.
        window: ``module -> one-sided local window or None`` (a mask ``|i - j| <= w``).
        causal: a decoder: query i attends to keys j <= i (format version 2's ``causal``).
        check: ``config -> reason or None``: a configuration of the family the capture refuses.
        what: one line for the README table.
    """

    name: str
    model_types: tuple[str, ...]
    projections: tuple[str, str, str] | None
    fused: str | None
    out_proj: str
    heads: tuple[str, ...]
    head_dim: tuple[str, ...]
    extras: tuple[str, ...] = ()
    transform: Callable = _no_transform
    window: Callable = lambda module: None
    split: Callable | None = None
    kv_heads: tuple[str, ...] = ()
    causal: bool = False
    check: Callable = lambda config: None
    what: str = ""


_HEADS = ("num_attention_heads", "num_heads", "n_heads")
_DIM = ("attention_head_size", "head_dim")

#: Every supported family.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "bert",
            ("bert", "roberta", "electra", "xlm-roberta", "camembert", "luke"),
            ("query", "key", "value"),
            None,
            "^.output.dense",
            _HEADS,
            _DIM,
            what="query/key/value outputs as used; h = input of attention.output.dense",
        ),
        Family(
            "longformer",
            ("longformer",),
            ("query", "key", "value"),
            None,
            "^.output.dense",
            _HEADS,
            _DIM,
            window=lambda m: int(m.one_sided_attn_window_size),
            what=(
                "query/key/value outputs (computed sequence-first, stored batch-first); sliding window |i-j| <= "
                "attention_window/2 as a mask"
            ),
        ),
        Family(
            "distilbert",
            ("distilbert",),
            ("q_lin", "k_lin", "v_lin"),
            None,
            "out_lin",
            _HEADS,
            _DIM,
            what="q_lin/k_lin/v_lin outputs; h = input of out_lin",
        ),
        Family(
            "roformer",
            ("roformer",),
            ("query", "key", "value"),
            None,
            "^.output.dense",
            _HEADS,
            _DIM,
            extras=("sinusoidal_pos",),
            transform=_roformer_rotary,
            what="q, k (and v if rotary_value) after the model's rotary embedding",
        ),
        Family(
            "esm",
            ("esm",),
            ("query", "key", "value"),
            None,
            "^.output.dense",
            _HEADS,
            _DIM,
            extras=("position_embeddings",),
            transform=_esm_scale_rotary,
            what=(
                "q, k after the model's query pre-scaling and rotary embedding; q stored / d^-1/2 so that s = 1/sqrt(d)"
            ),
        ),
        Family(
            "modernbert",
            ("modernbert",),
            None,
            "Wqkv",
            "Wo",
            ("config.num_attention_heads",),
            ("head_dim",),
            extras=("position_embeddings",),
            transform=_rope_qk,
            window=lambda m: int(m.config.sliding_window) if getattr(m, "sliding_window", None) is not None else None,
            split=_split_modernbert,
            what=(
                "fused Wqkv split, q and k after the model's rotary embedding; local layers |i-j| <= "
                "local_attention/2 as a mask"
            ),
        ),
        Family(
            "vit",
            ("vit", "dinov2"),
            ("q_proj", "k_proj", "v_proj"),
            None,
            "o_proj",
            _HEADS,
            _DIM,
            what="q_proj/k_proj/v_proj outputs; h = input of o_proj (pixel inputs, capture level)",
        ),
        Family(
            "gpt2",
            ("gpt2",),
            None,
            "c_attn",
            "c_proj",
            ("num_heads",),
            ("head_dim",),
            split=_split_gpt2,
            causal=True,
            check=_gpt2_scale,
            what="fused c_attn (Conv1D) split into q | k | v; h = input of c_proj; causal",
        ),
        Family(
            "llama",
            ("llama", "mistral", "qwen2"),
            ("q_proj", "k_proj", "v_proj"),
            None,
            "o_proj",
            ("config.num_attention_heads",),
            ("head_dim",),
            extras=("position_embeddings",),
            transform=_rope_qk,
            kv_heads=("config.num_key_value_heads",),
            causal=True,
            what=(
                "q_proj/k_proj/v_proj, q and k after the model's rotary embedding, k and v per KV head "
                "(grouped-query); h = input of o_proj; causal"
            ),
        ),
        Family(
            "gpt_neox",
            ("gpt_neox",),
            None,
            "query_key_value",
            "dense",
            ("config.num_attention_heads",),
            ("head_size",),
            extras=("position_embeddings",),
            transform=_rope_qk,
            split=_split_neox,
            causal=True,
            what=(
                "fused query_key_value split per head as [q | k | v], q and k after the model's partial rotary "
                "embedding; h = input of dense; causal"
            ),
        ),
    )
}

#: ``config.model_type`` -> supported family.
MODEL_TYPES: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.model_types}
#: Families the text pipeline (tokenizer + ``AutoModel``) can run: encoders (``text.models``).
TEXT_FAMILIES = ("bert", "longformer", "distilbert", "roformer", "esm", "modernbert")
#: Decoders the text pipeline can run (``decoders.models``): causal heads, format version 2.
DECODER_FAMILIES = ("gpt2", "llama", "gpt_neox")

_RELATIVE = "relative-position terms are added to q k^T (disentangled attention), so the logits are not s q k^T + mask"
#: Known model types refused, with the reason.
REFUSED: dict[str, str] = {
    "deberta": _RELATIVE,
    "deberta-v2": _RELATIVE,
    "sew-d": _RELATIVE,
    "mpnet": "a learned relative position bias is added to the logits",
    "t5": "a learned relative position bias is added to the logits (and an encoder-decoder with causal masks)",
    "mt5": "a learned relative position bias is added to the logits (and an encoder-decoder with causal masks)",
    "umt5": "a learned relative position bias is added to the logits (and an encoder-decoder with causal masks)",
    "xlnet": "two-stream attention with relative positional encodings",
    "big_bird": "block-sparse attention with random and global blocks",
    "reformer": "LSH / chunked local attention",
    "beit": "a relative position bias is added to the logits",
    "data2vec-vision": "a relative position bias is added to the logits",
    "swin": "windowed attention with a relative position bias",
    "swinv2": "windowed cosine attention with a relative position bias",
    "bloom": "ALiBi: a linear position bias is added to the logits",
    "mpt": "ALiBi: a linear position bias is added to the logits",
    "gpt_oss": "attention sinks: a learned logit per head joins the softmax's denominator",
    "gemma2": "logit soft-capping: the logits pass through c * tanh(logits / c) before the softmax",
    "gemma3": (
        "q and k are normalised per head (qk-norm), and local layers use a sliding window; not supported by the capture"
    ),
    "gemma3_text": (
        "q and k are normalised per head (qk-norm), and local layers use a sliding window; not supported by the capture"
    ),
    "qwen3": "q and k are normalised per head (qk-norm); not supported by the capture",
    "qwen3_moe": "q and k are normalised per head (qk-norm); not supported by the capture",
    "olmo2": "q and k are normalised over all heads (qk-norm); not supported by the capture",
    "olmo3": "q and k are normalised over all heads (qk-norm); not supported by the capture",
}


def supported_summary() -> str:
    """One line listing the supported Hugging Face model types by family."""
    return "; ".join(f"{f.name}: {', '.join(f.model_types)}" for f in FAMILIES.values())


def _refuse(who: str, model_type, reason: str) -> UnsupportedArchitectureError:
    # short: the supported model types (supported_summary()) are listed in docs/own_models.md, not in every refusal
    return UnsupportedArchitectureError(
        f"{who}: model type {model_type!r} is refused: {reason}; supported types: docs/own_models.md"
    )


def _decoder_types() -> set[str]:
    """Model types with a causal-LM class and no masked-LM class (decoders)."""
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        )
    except ImportError:  # pragma: no cover - other transformers layouts
        return {"gpt2", "gpt_neo", "gptj", "llama", "mistral", "qwen2", "opt", "bloom", "falcon", "gemma", "phi"}
    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def _logit_terms(config) -> str | None:
    """A term in the logits the format cannot store, read from configuration flags any model type may carry."""
    if getattr(config, "alibi", False):
        return "ALiBi: a linear position bias is added to the logits"
    if getattr(config, "attn_logit_softcapping", None):
        return (
            f"logit soft-capping (attn_logit_softcapping = {config.attn_logit_softcapping}): logits pass through "
            "c * tanh(logits / c)"
        )
    return None


def _kv_groups(heads: int, n_kv: int) -> str:
    """Why ``heads`` query heads on ``n_kv`` key/value heads that do not divide them are refused."""
    return (
        f"num_key_value_heads = {n_kv} does not divide num_attention_heads = {heads}: repeat_kv needs equal "
        "query-head groups"
    )


def hf_family(config, who: str | None = None, text: bool = False, decoder: bool | None = None) -> Family:
    """The capture family of a Hugging Face configuration, or a one-line refusal.

    Args:
        config: a ``transformers.PretrainedConfig`` (only ``model_type`` and a few flags are read).
        who: the model named in the error (default: the config's name or model type).
        text: only families the text pipeline can run (:data:`TEXT_FAMILIES`,
            :data:`DECODER_FAMILIES`).
        decoder: True: a decoder family only (``decoders.models``); False: an encoder family
            only (``text.models``); None: either (capture level).

    Returns:
        The :class:`Family`.

    Raises:
        UnsupportedArchitectureError: the model type is not supported (relative position
            terms, ALiBi, attention sinks, logit soft-capping, qk-norm, a decoder family the
            capture does not know, an encoder-decoder or cross-attention, an encoder with
            ``is_decoder``, a GPT-2 logit scale other than 1/sqrt(d), a decoder whose
            ``num_key_value_heads`` does not divide ``num_attention_heads``, an ESM position embedding
            other than absolute or rotary, a vision model in the text pipeline, or an unknown
            type), or a decoder where an encoder is asked for and conversely; one line naming
            the model, the reason and the supported families.
    """
    model_type = getattr(config, "model_type", None)
    who = who or getattr(config, "_name_or_path", "") or str(model_type)
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(who, model_type, "an encoder-decoder model: its decoder uses cross-attention")
    if getattr(config, "add_cross_attention", False):
        raise _refuse(
            who,
            model_type,
            "configured with cross-attention (add_cross_attention): the keys come from another sequence",
        )
    family = MODEL_TYPES.get(model_type)
    reason = _logit_terms(config)
    if reason is None and family is None:
        if model_type in REFUSED:
            reason = REFUSED[model_type]
        elif model_type in _decoder_types():
            reason = "a decoder family the capture does not know"
        else:
            reason = "its attention is not known to be softmax(q k^T / sqrt(d) + mask) v, and nothing is approximated"
    if reason is None and family.causal:
        reason = family.check(config)
        heads, n_kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
        if reason is None and isinstance(heads, int) and isinstance(n_kv, int) and n_kv > 0 and heads % n_kv:
            reason = _kv_groups(heads, n_kv)
        if reason is None and decoder is False:
            reason = "a decoder (causal heads): list it under decoders.models, not text.models (docs/own_models.md)"
    elif reason is None:
        if getattr(config, "is_decoder", False):
            reason = "configured as a decoder (is_decoder): causal mask and cross-attention"
        elif family.name == "esm" and getattr(config, "position_embedding_type", "absolute") not in (
            "absolute",
            "rotary",
        ):
            reason = (
                f"position_embedding_type {config.position_embedding_type!r} adds relative position terms to the logits"
            )
        elif text and family.name not in TEXT_FAMILIES:
            reason = (
                "a vision model (pixel inputs); the text pipeline needs a tokenizer, and vision models run through timm"
            )
        elif decoder:
            reason = "an encoder (every query sees every key): list it under text.models, not decoders.models"
    if reason is not None:
        raise _refuse(who, model_type, reason)
    return family


def sliding_window(config) -> int | None:
    """The sliding window of a decoder's configuration: query i sees keys ``i - w < j <= i``, or None.

    Mistral's ``sliding_window``; Qwen2's when a layer type is ``sliding_attention``
    (``use_sliding_window`` and ``max_window_layers``); None when no layer slides.
    """
    w = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if (
        not w
        or (types is not None and "sliding_attention" not in types)
        or getattr(config, "use_sliding_window", True) is False
    ):
        return None
    return int(w)


def check_rows(config, who: str, n_tokens: int) -> None:
    """Refuse a decoder whose sliding window is shorter than the rows (it would mask keys the format's
    causal mask allows), or whose learned position table (GPT-2's ``n_positions``) is.

    A window ``w`` sees ``w`` keys (the query's own included), so it changes nothing while
    ``n_tokens <= w``.

    Args:
        n_tokens: the padded length N of the sample (its longest row).

    Raises:
        UnsupportedArchitectureError: ``w < n_tokens`` or ``n_positions < n_tokens``; one line with both numbers.
    """
    positions = getattr(config, "n_positions", None) if getattr(config, "model_type", None) == "gpt2" else None
    if positions is not None and positions < n_tokens:
        raise _refuse(
            who,
            "gpt2",
            f"rows of {n_tokens} tokens, longer than its {positions} learned positions (n_positions); lower "
            f"text.max_length to {positions}",
        )
    w = sliding_window(config)
    if w is not None and w < n_tokens:
        raise _refuse(
            who,
            getattr(config, "model_type", None),
            f"a sliding window of {w} tokens, shorter than the rows ({n_tokens} tokens): the format's causal mask "
            f"cannot express it; lower text.max_length to {w}",
        )


def decoder_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """A decoder's ``position_ids`` from its ``attention_mask``, as ``transformers``' ``generate`` computes them.

    ``attention_mask.long().cumsum(-1) - 1``, padded slots set to 0 (as transformers 5's
    ``_prepare_position_ids_for_generation``; 4.x set them to 1; no real token attends to them):
    the ``p``-th real token of every row sits at position ``p - 1`` whichever side the tokenizer
    pads. Without ``position_ids`` a model counts positions from the first slot, so a
    left-padded row's real tokens would sit at their position plus the pad count: GPT-2's
    learned absolute positions then give other q, k, v than the same row padded right; a rotary
    model rotates every q and k by the same offset, which changes the stored q and k but their
    dot products only by float32 round-off.

    Args:
        attention_mask: ``(B, N)`` 0/1 (1 = real token), any integer or bool dtype.

    Returns:
        ``(B, N)`` int64 positions on ``attention_mask``'s device.
    """
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill_(attention_mask == 0, 0)


def check_text_model(model_id: str, source: str, decoder: bool = False, revision: str | None = None) -> str | None:
    """Check a configured language model from its configuration alone (no weights, no download).

    Reads ``config.json`` with ``transformers.AutoConfig`` from the local directory ``source``
    or, for a hub id, from the Hugging Face cache (``local_files_only``).

    Args:
        model_id: the configured Hugging Face id (named in errors).
        source: a local directory, or the hub id (see :func:`kpca_repro.inputs.text.model_source`).
        decoder: the model is listed under ``decoders.models`` (a decoder family required),
            else under ``text.models`` (an encoder family required).
        revision: the hub revision (``decoders.revisions``); ignored for a directory.

    Returns:
        The family name, or None when the configuration is not available locally (a hub id
        not in the cache; the extraction refuses it after downloading, before any forward).

    Raises:
        UnsupportedArchitectureError: see :func:`hf_family` (text families only, ``decoder``);
            a model type unknown to the installed transformers is refused too.
    """
    if Path(source).is_dir():
        if not (Path(source) / "config.json").is_file():
            return None
    else:  # a hub id: only from the cache (a cheap look-up first: importing transformers costs seconds)
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(source, "config.json", revision=revision), str):
            return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            source, local_files_only=True, revision=None if Path(source).is_dir() else revision
        )
    except OSError:
        return None
    except (ValueError, KeyError) as exc:
        path = Path(source) / "config.json"
        model_type = json.loads(path.read_text()).get("model_type") if path.is_file() else None
        raise _refuse(
            model_id,
            model_type,
            f"transformers cannot read its configuration ({type(exc).__name__}: {str(exc).splitlines()[0]})",
        ) from None
    return hf_family(config, model_id, text=True, decoder=decoder).name


# --------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------


@dataclass
class HFAttention:
    """One self-attention module and how to capture it.

    Attributes:
        name: module path in the model.
        module: the attention module whose forward computes q, k, v.
        family: its :class:`Family`.
        projections: ``{"q","k","v"}`` -> Linear, or ``{"qkv"}`` -> the fused projection
            (``nn.Linear`` or GPT-2's ``Conv1D``).
        out_proj: the output projection; its input is the concatenated per-head output h.
        n_heads, head_dim: ``H`` and ``d``; the logit scale is ``1/sqrt(d)``.
        window: one-sided local window ``w`` (``|i - j| <= w``), or None.
        n_kv_heads: key/value heads (grouped-query attention; ``n_heads`` otherwise).
    """

    name: str
    module: nn.Module
    family: Family
    projections: dict[str, nn.Module]
    out_proj: nn.Module
    n_heads: int
    head_dim: int
    window: int | None = None
    n_kv_heads: int = 0

    def __post_init__(self):
        self.n_kv_heads = self.n_kv_heads or self.n_heads


def _widths(module) -> tuple[int, int] | None:
    """``(in, out)`` features of an ``nn.Linear`` or of transformers' ``Conv1D`` (weight ``(in, out)``, ``nf`` = out),
    else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nf", None), int)
        and isinstance(getattr(module, "nx", None), int)
    ):
        return module.nx, module.nf
    return None


def _attr(module: nn.Module, names: tuple[str, ...]):
    for n in names:
        obj = module
        for part in n.split("."):
            obj = getattr(obj, part, None)
        if obj:
            return int(obj)
    return None


def attention_modules(model: nn.Module, model_id: str | None = None) -> list[HFAttention]:
    """Every self-attention module of a Hugging Face model, in depth order, with its adapter.

    The family comes from ``model.config`` (:func:`hf_family`); the modules are found by the
    family's structure (projection children, output projection), not by name.

    Args:
        model: a ``transformers`` model (``AutoModel``), on any device.
        model_id: named in errors.

    Returns:
        One :class:`HFAttention` per layer.

    Raises:
        UnsupportedArchitectureError: the model type is refused (:func:`hf_family`), no module
            fits, an encoder's module is causal or a decoder's is not (cross-attention), a
            decoder's logit scale is not 1/sqrt(d), or its sizes or output projection do not
            fit; one line naming the model or module.
    """
    config = getattr(model, "config", None)
    who = model_id or type(model).__name__
    if config is None:
        raise _refuse(who, None, "not a Hugging Face model (no config)")
    family = hf_family(config, who)
    named = dict(model.named_modules())
    found = []
    for name, mod in named.items():
        names = family.projections or (family.fused,)
        if not all(_widths(getattr(mod, a, None)) for a in names):
            continue
        heads, dim = _attr(mod, family.heads), _attr(mod, family.head_dim)
        n_kv = _attr(mod, family.kv_heads) or heads
        if not heads or not dim:
            raise UnsupportedArchitectureError(
                f"{who}: {name} ({type(mod).__name__}) has {'/'.join(names)} but no head count {family.heads} or "
                f"head size {family.head_dim}"
            )
        if getattr(mod, "is_causal", family.causal) != family.causal:
            what = "causal (is_causal)" if not family.causal else "not causal (is_causal False: cross-attention)"
            raise _refuse(f"{who} ({name})", config.model_type, f"the attention module is {what}")
        scaling = getattr(mod, "scaling", None)
        if family.causal and (scaling is None or abs(float(scaling) * dim**0.5 - 1) > 1e-6):
            raise _refuse(
                f"{who} ({name})",
                config.model_type,
                f"its logit scale is {scaling}, not 1/sqrt(head_dim) = {dim**-0.5:g}",
            )
        width = heads * dim
        projections = (
            {t: getattr(mod, a) for t, a in zip(("q", "k", "v"), names)}
            if family.projections
            else {"qkv": getattr(mod, family.fused)}
        )
        want = {"q": width, "k": n_kv * dim, "v": n_kv * dim, "qkv": 3 * width}
        if heads % n_kv:
            raise UnsupportedArchitectureError(f"{who}: {name}: {_kv_groups(heads, n_kv)}")
        if any(_widths(p)[1] != want[t] for t, p in projections.items()):
            raise UnsupportedArchitectureError(
                f"{who}: {name}: {'/'.join(names)} widths differ from heads x head size = {width} ({n_kv} key/value "
                "heads)"
            )
        path = family.out_proj
        out = named.get(name.rsplit(".", 1)[0]) if path.startswith("^.") else mod
        for part in path.removeprefix("^.").split("."):
            out = getattr(out, part, None)
        if _widths(out) is None or _widths(out)[0] != width:
            raise UnsupportedArchitectureError(
                f"{who}: {name}: no output projection {path} taking the {width}-wide per-head attention output; h "
                "cannot be captured"
            )
        found.append(HFAttention(name, mod, family, projections, out, heads, dim, family.window(mod), n_kv))
    if not found:
        raise UnsupportedArchitectureError(
            f"{who}: no {family.name} self-attention module with {'/'.join(family.projections or (family.fused,))} "
            "Linear layers"
        )
    return found


# --------------------------------------------------------------------------------------
# Recorder
# --------------------------------------------------------------------------------------


class HFAttentionRecorder(HeadRecorder):
    """Records the per-head q, k, v, h every attention module uses during a forward pass.

    After ``model(**batch)``: ``captured[layer]`` maps ``"q" | "h"`` to float32 tensors
    ``(B, H, N, d)`` and ``"k" | "v"`` to ``(B, H_kv, N, d)`` (the key/value heads, not
    repeated) on the model's device, batch-first whatever layout the module computes in, such
    that ``h = softmax(q k^T / sqrt(d) + mask) v`` with the KV head of :attr:`kv_head_of_query`
    (the family's transform applied; ``mask`` causal for a decoder, :attr:`causal`); ``layouts[layer]`` is
    ``"batch_first"`` or ``"sequence_first"`` (Longformer applies its projections to ``(N, B, hidden)``), read from the
    tensors themselves: the projection input must equal the module's hidden states or their transpose. Only the first
    call of each projection per forward is kept.

    Raises (during the forward pass):
        UnsupportedArchitectureError: a projection input is neither; a projection never ran;
            h is not ``(B, N, H*d)``.
    """

    def __init__(self, attns: list[HFAttention]):
        super().__init__(attns)
        self.layouts: list[str | None] = [None] * len(self.attns)
        self._hidden: list[torch.Tensor | None] = [None] * len(self.attns)
        self._extras: list[dict] = [{} for _ in self.attns]

    @property
    def causal(self) -> bool:
        """Whether the modules are a decoder's (query i sees keys j <= i): format version 2's ``causal``.

        Raises:
            UnsupportedArchitectureError: causal and non-causal modules mixed.
        """
        kinds = {a.family.causal for a in self.attns}
        if len(kinds) != 1:
            raise UnsupportedArchitectureError(
                f"{self.attns[0].name}: causal and non-causal attention modules in one model"
            )
        return kinds.pop()

    @property
    def kv_head_of_query(self) -> np.ndarray | None:
        """``(H,)`` int64 KV head of each query head (:func:`kpca_repro.activations.repeat_kv_map`,
        Hugging Face's ``repeat_kv``), or None when every head has its own k and v.

        Raises:
            UnsupportedArchitectureError: the layers' head counts differ (the format holds one map).
        """
        sizes = {(a.n_heads, a.n_kv_heads) for a in self.attns}
        if len(sizes) != 1:
            raise UnsupportedArchitectureError(
                f"{self.attns[0].name}: the layers' (query, key/value) head counts differ: {sorted(sizes)}"
            )
        heads, n_kv = sizes.pop()
        return None if n_kv == heads else repeat_kv_map(heads, n_kv)

    def file_attrs(self) -> dict:
        """The activation file's ``capture_adapter`` (the family) and ``hooked_layout`` of the last forward pass.

        Raises:
            UnsupportedArchitectureError: the layers computed in different layouts.
        """
        if len(set(self.layouts)) != 1:
            raise UnsupportedArchitectureError(
                f"{self.attns[0].name}: the attention modules computed in mixed layouts {self.layouts}"
            )
        return {
            "capture_adapter": "; ".join(dict.fromkeys(a.family.name for a in self.attns)),
            "hooked_layout": self.layouts[0],
        }

    def _attn_pre_hook(self, layer: int):
        attn = self.attns[layer]
        sig = inspect.signature(attn.module.forward)

        def hook(_mod, args, kwargs):
            try:
                bound = sig.bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = dict(kwargs)
            self._hidden[layer] = args[0] if args else kwargs.get("hidden_states")
            self._extras[layer] = {k: bound.get(k) for k in attn.family.extras}
            self.captured[layer] = {}

        return hook

    def _attn_post_hook(self, layer: int):
        attn = self.attns[layer]

        def hook(_mod, _args, _out):
            t = self.captured[layer]
            if not all(x in t for x in ("q", "k", "v")):
                raise UnsupportedArchitectureError(
                    f"{attn.name}: its projections {sorted(attn.projections)} did not all run in its forward; q, k, "
                    "v cannot be captured"
                )
            attn.family.transform(attn, t, self._extras[layer])

        return hook

    def _layout(self, attn: HFAttention, layer: int, x: torch.Tensor, what: str) -> str:
        hidden = self._hidden[layer]
        if hidden is not None and x.shape == hidden.shape and torch.equal(x, hidden):
            return BATCH_FIRST
        if (
            hidden is not None
            and x.ndim == 3
            and x.shape == hidden.transpose(0, 1).shape
            and torch.equal(x, hidden.transpose(0, 1))
        ):
            return SEQUENCE_FIRST
        raise UnsupportedArchitectureError(
            f"{attn.name}.{what}: its input is neither the attention module's hidden states nor their (sequence, "
            "batch) transpose"
        )

    def _proj_hook(self, layer: int, name: str):
        attn = self.attns[layer]

        def hook(_mod, inp, out):
            t = self.captured[layer]
            if name in t or (name == "qkv" and "q" in t):  # first call kept (docs/method.md 3)
                return
            layout = self._layout(attn, layer, inp[0], name)
            self.layouts[layer] = layout
            if layout == SEQUENCE_FIRST:
                out = out.transpose(0, 1)
            if name == "qkv":  # as the family's forward splits it (ModernBERT, GPT-2, GPT-NeoX)
                t["q"], t["k"], t["v"] = attn.family.split(attn, out)
            else:
                # a copy: Longformer scales its query projection in place right after this hook
                t[name] = split_heads(
                    out, attn.n_kv_heads if name in ("k", "v") else attn.n_heads, attn.head_dim
                ).clone()

        return hook

    def _out_pre_hook(self, layer: int):
        attn = self.attns[layer]

        def hook(_mod, args):
            x, hidden = args[0], self._hidden[layer]
            if hidden is None or x.ndim != 3 or x.shape[:2] != hidden.shape[:2]:  # h is batch-first (Longformer too)
                raise UnsupportedArchitectureError(
                    f"{attn.name}: the output projection's input is not (batch, tokens, heads x head size)"
                )
            self.captured[layer]["h"] = split_heads(x, attn.n_heads, attn.head_dim)

        return hook

    def _register(self) -> list:
        handles = []
        for layer, attn in enumerate(self.attns):
            handles.append(attn.module.register_forward_pre_hook(self._attn_pre_hook(layer), with_kwargs=True))
            for t, lin in attn.projections.items():
                handles.append(lin.register_forward_hook(self._proj_hook(layer, t)))
            handles.append(attn.out_proj.register_forward_pre_hook(self._out_pre_hook(layer)))
            handles.append(attn.module.register_forward_hook(self._attn_post_hook(layer)))
        return handles
