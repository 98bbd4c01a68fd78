"""Figures 2 and 5: per-token squared norms from the activation files, per-layer statistics.

For every (sequence, layer, head, token ``i``) of an activation file (layout:
:mod:`kpca_repro.activations`) this module computes ``||phi(q_i)||^2`` (docs/method.md 0.3) and
``||h_i||^2`` (docs/method.md 0.4) with :mod:`kpca_repro.method.kpca`, pools them per layer over
sequences, heads and tokens, and summarises each layer with
:func:`layer_norm_statistics`. Nothing is recomputed from the model: q, k,
v and h are read from the HDF5 files written by the extraction rules.

Four recipes (``variant`` x images or text; the variant's ``authors_formulas`` picks the scripts'
recipes, its ``dtype`` the precision and its ``text_padding`` whether padding enters):

* vision ``paper`` (``norms.py``, docs/method.md 8): float32, ``||phi||^2`` in the log domain with
  the hard-coded ``s = 1/8``, ``||h||^2`` of the model's own per-head output, 95th-percentile
  trim, median and inter-quartile band.
* vision ``corrected`` (docs/method.md 15): float64, log domain, ``s = 1/sqrt(head_dim)`` of the
  file, every image of every shard, no trim, median and the central 95 % band.
* text ``paper`` (``nlp_norms.py``, docs/method.md 9): float32, plain ``exp`` and ``log`` of the
  plain sum with ``s = 1/8``, overflow set to 0; ``h`` recomputed as
  ``softmax(q k^T / sqrt(head_dim)) v`` **without** the attention mask; every padded position
  is a query and a key.
* text ``corrected``: as vision ``corrected``, with padding excluded (keys masked out of
  ``g(q)``, padded queries dropped) and the model's own ``h`` (computed with its mask).

Decoders (causal files, docs/method.md 16.3) take the text ``corrected`` recipe in **both**
variants, with the causal normaliser ``g(q_i) = sum_{j <= i} exp(s q_i . k_j)`` over the real
keys and each query head's keys from its KV head (``kv_head_of_query``): no authors' script
exists to mimic, and the paper text recipe's unmasked ``h`` would not be the model's. The
variants differ only in the per-layer statistics (trim and band).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from kpca_repro.activations import ActivationFile, CorruptActivationFileError
from kpca_repro.method.variant import Variant
from kpca_repro.method.variant import get as get_variant
from kpca_repro.projection import attention_output, feature_norm_sq, output_norm_sq

__all__ = [
    "QUANTITIES",
    "sentence_samples",
    "squared_norms",
    "read_attention_mask",
    "norm_statistics",
    "layer_norm_statistics",
    "PAPER_NORMS_SCALE",
    "PAPER_NORMS_TRIM",
    "PAPER_NORMS_BAND",
    "CORRECTED_NORMS_BAND",
]

#: Quantity labels of the statistics tables: ``phi`` = ||phi(q_i)||^2, ``h`` = ||h_i||^2.
QUANTITIES = ("phi", "h")

#: Elements of one batched ``(heads, N, N)`` logits tensor (bounds memory for long sequences).
_LOGITS_BUDGET = 2**24


def sentence_samples(sentences: Sequence[str]) -> pd.DataFrame:
    """The Figure 5 sentences as a samples table (``sample_rank, dataset_index, text``).

    ``dataset_index`` is the position in the configured list (``figure5.sentences``), as is
    ``sample_rank``; the text is kept verbatim (U+2011 included).

    Raises:
        ValueError: no sentence, or an empty one.
    """
    if len(sentences) == 0 or any(not str(s).strip() for s in sentences):
        raise ValueError("config key figure5.sentences: give at least one non-empty sentence")
    idx = np.arange(len(sentences), dtype=np.int64)
    return pd.DataFrame({"sample_rank": idx, "dataset_index": idx, "text": [str(s) for s in sentences]})


def squared_norms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    h: torch.Tensor,
    variant: str | Variant,
    *,
    language: bool = False,
    head_dim: int | None = None,
    token_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``||phi(q_i)||^2`` and ``||h_i||^2`` of a batch of heads under one recipe (module docstring).

    Args:
        q, k, v, h: per-head tensors ``(..., N, d)`` float32 as stored (``h`` is the model's
            own attention output before the output projection).
        variant: a :class:`~kpca_repro.method.variant.Variant` or its name (``"paper"``, ``"corrected"``).
        language: the text recipes (``nlp_norms.py`` for the paper variant, padding excluded
            for the corrected one) instead of the vision ones.
        head_dim: the model's head dimension (file attribute ``head_dim``); default ``d``.
        token_mask: bool ``(..., N)``, True for real tokens (the attention mask broadcast over
            heads). Used by the text recipe of a variant that excludes padding (corrected);
            the paper recipes use every position, as the reference does.
        causal: a decoder's heads (docs/method.md 16.3): in both variants float64, log domain,
            ``s = 1/sqrt(head_dim)``, query ``i`` normalised over the real keys ``j <= i``
            (``token_mask`` the real tokens, None: all real), the stored ``h``. ``k`` must be
            the keys of each query head's KV head (``k[:, kv_head_of_query]``).

    Returns:
        ``(phi_sq, h_sq, valid)``, each of shape ``(..., N)``: float32 (paper) or float64
        (corrected, causal) squared norms, and the bool mask of the entries that enter the
        statistics (all True except padded queries in the corrected text and causal recipes).

    Raises:
        ValueError: unknown variant, or ``head_dim`` disagreeing with the tensors.
    """
    variant = get_variant(variant)
    d = q.shape[-1] if head_dim is None else int(head_dim)
    if d != q.shape[-1]:
        raise ValueError(f"head_dim {d} disagrees with the stored tensors' last dimension {q.shape[-1]}")
    valid = torch.ones(q.shape[:-1], dtype=torch.bool, device=q.device)
    if causal:  # one recipe for decoders in both variants (docs/method.md 16.3)
        q, k, h = (t.to(torch.float64) for t in (q, k, h))
        key_mask = None if token_mask is None else token_mask.bool()
        if key_mask is not None:
            valid = key_mask.expand(q.shape[:-1])
        return feature_norm_sq(q, k, scale=1.0 / math.sqrt(d), key_mask=key_mask, causal=True), output_norm_sq(h), valid
    if variant.authors_formulas:
        q, k, v, h = (t.to(variant.torch_dtype) for t in (q, k, v, h))
        if language:  # nlp_norms.py: plain exp, /8, overflow -> 0; h without the mask
            phi = feature_norm_sq(q, k, scale=PAPER_NORMS_SCALE, log_domain=False, log_of_sum=True)
            h = attention_output(q, k, v, scale=1.0 / math.sqrt(d))
        else:  # norms.py: log domain, /8, a non-finite value set to 0
            phi = feature_norm_sq(q, k, scale=PAPER_NORMS_SCALE)
            phi = torch.where(torch.isfinite(phi), phi, torch.zeros((), dtype=phi.dtype))
        return phi, output_norm_sq(h), valid
    q, k, h = (t.to(variant.torch_dtype) for t in (q, k, h))
    key_mask = None
    if language and variant.text_padding == "excluded" and token_mask is not None:
        key_mask = token_mask.bool()
        valid = key_mask.expand(q.shape[:-1])
    phi = feature_norm_sq(q, k, scale=1.0 / math.sqrt(d), key_mask=key_mask)
    return phi, output_norm_sq(h), valid


def read_attention_mask(af: ActivationFile) -> np.ndarray:
    """The root ``attention_mask`` ``(B, N)`` of a language-model activation file (1 = real token).

    Raises:
        CorruptActivationFileError: the dataset is missing or has the wrong shape (file named).
    """
    try:
        mask = af.f["attention_mask"][:]
    except (KeyError, OSError) as exc:
        raise CorruptActivationFileError(
            f"activation file {af.path} has no root dataset 'attention_mask' (B, N) needed for padding ({exc})"
        ) from exc
    n_tokens = int(af.attrs["n_tokens"])
    if mask.shape != (len(af.sample_rank), n_tokens):
        raise CorruptActivationFileError(
            f"activation file {af.path}: attention_mask has shape {mask.shape}, expected ({len(af.sample_rank)}, "
            f"{n_tokens})"
        )
    return mask.astype(bool)


def norm_statistics(
    activations: Sequence[str | os.PathLike],
    variant: str | Variant,
    *,
    language: bool = False,
    progress: bool = True,
) -> pd.DataFrame:
    """Per-layer statistics of ``||phi(q_i)||^2`` and ``||h_i||^2`` over one model's files.

    Every file (e.g. every shard of one extraction) must come from the same model. Per
    layer, the values of all sequences, heads and (valid) tokens of all files are pooled;
    the paper variant then applies the 95th-percentile trim and the inter-quartile band
    (:data:`PAPER_NORMS_TRIM`, :data:`PAPER_NORMS_BAND`), the
    corrected variant no trim and the central 95 % band
    (:data:`CORRECTED_NORMS_BAND`). Decoders' files (``causal``, docs/method.md 16.3-16.4) take
    the causal recipe of :func:`squared_norms` in both variants (padding out, ``s = 1/sqrt(head_dim)``),
    one value per (row, query head, real token), whatever ``language`` says.

    Returns:
        One row per (layer, quantity): ``model, variant, layer, quantity (phi | h),
        n_sequences, head_dim, scale, trim_percentile, band`` and the columns of
        :func:`layer_norm_statistics`.

    Raises:
        ValueError: no file, unknown variant, or files of different models / shapes / causality.
        kpca_repro.activations.CorruptActivationFileError: a file is unreadable or lacks the
            attention mask the corrected text recipe needs (named).
    """
    from kpca_repro.progress import progress as progress_bar

    if not activations:
        raise ValueError("no activation file given")
    variant = get_variant(variant)
    files = [ActivationFile(p) for p in activations]
    try:
        model_id, n_layers, head_dim = _common_model(files)
        causal = files[0].causal
        masks = [
            read_attention_mask(af)
            if (language and variant.text_padding == "excluded") or (causal and af.attention_mask is not None)
            else None
            for af in files
        ]
        trim, band, scale = (
            (PAPER_NORMS_TRIM, PAPER_NORMS_BAND, PAPER_NORMS_SCALE)
            if variant.authors_formulas
            else (None, CORRECTED_NORMS_BAND, 1.0 / math.sqrt(head_dim))
        )
        if causal:
            scale = 1.0 / math.sqrt(head_dim)
        n_seq = sum(len(af.sample_rank) for af in files)
        rows = []
        for layer in progress_bar(
            range(n_layers), desc=f"norms {variant} {model_id}", unit="layer", disable=not progress, mininterval=5
        ):
            pooled = _pooled_layer(files, masks, layer, variant, language, head_dim)
            for name in QUANTITIES:
                stats = layer_norm_statistics(pooled[name], trim=trim, band=band)
                rows.append(
                    {
                        "model": model_id,
                        "variant": variant.name,
                        "layer": layer,
                        "quantity": name,
                        "n_sequences": n_seq,
                        "head_dim": head_dim,
                        "scale": scale,
                        "trim_percentile": trim if trim is not None else float("nan"),
                        "band": f"{band[0]:g}-{band[1]:g}",
                        **stats,
                    }
                )
    finally:
        for af in files:
            af.close()
    return pd.DataFrame(rows)


def _common_model(files: Sequence[ActivationFile]) -> tuple[str, int, int]:
    """``(model_id, n_layers, head_dim)`` the files share.

    Raises:
        ValueError: a file of another model, depth or head dimension than the first (both named).
    """
    first = files[0]
    model_id, n_layers, head_dim = str(first.attrs["model_id"]), first.n_layers, int(first.attrs["head_dim"])
    for af in files[1:]:
        if (str(af.attrs["model_id"]), af.n_layers, int(af.attrs["head_dim"]), af.causal) != (
            model_id,
            n_layers,
            head_dim,
            first.causal,
        ):
            raise ValueError(f"{af.path} is not from the same model as {first.path}")
    return model_id, n_layers, head_dim


def _pooled_layer(
    files: Sequence[ActivationFile],
    masks: list[np.ndarray | None],
    layer: int,
    variant: Variant,
    language: bool,
    head_dim: int,
) -> dict[str, np.ndarray]:
    """One layer's squared norms of every file, sequence, head and valid token (:func:`squared_norms`).

    Args:
        files, masks: the model's activation files and their attention masks ``(B, N)`` bool (None:
            every position enters, as in the paper recipes).
        layer: the layer read from every file. A causal file's ``k`` and ``v`` are taken per
            query head from its KV head (``kv_head_of_query``, docs/method.md 16.4).

    Returns:
        :data:`QUANTITIES` -> 1-d float64, in file, then sequence-and-head, then token order.
        The heads are batched so that one ``(heads, N, N)`` logits tensor stays within
        ``_LOGITS_BUDGET`` elements.
    """
    pooled = {name: [] for name in QUANTITIES}
    for af, mask in zip(files, masks):
        t = {name: torch.from_numpy(a) for name, a in af.read(layer).items()}
        n_img, n_heads, n_tok = t["q"].shape[:3]
        if af.causal:  # each query head with the keys and values of its KV head
            kv = torch.from_numpy(np.asarray(af.kv_head_of_query, dtype=np.int64))
            t["k"], t["v"] = t["k"][:, kv], t["v"][:, kv]
        token_mask = None if mask is None else torch.from_numpy(mask)[:, None, :].expand(n_img, n_heads, n_tok)
        flat = {name: x.reshape(-1, *x.shape[2:]) for name, x in t.items()}
        tm = None if token_mask is None else token_mask.reshape(-1, n_tok)
        step = max(1, _LOGITS_BUDGET // (n_tok * n_tok))
        for lo in range(0, flat["q"].shape[0], step):
            sl = slice(lo, lo + step)
            phi, h_sq, valid = squared_norms(
                flat["q"][sl],
                flat["k"][sl],
                flat["v"][sl],
                flat["h"][sl],
                variant,
                language=language,
                head_dim=head_dim,
                token_mask=None if tm is None else tm[sl],
                causal=af.causal,
            )
            pooled["phi"].append(phi[valid].double().numpy())
            pooled["h"].append(h_sq[valid].double().numpy())
    return {name: np.concatenate(values) for name, values in pooled.items()}


# --------------------------------------------------------------------------------------
# Figures 2 and 5: per-layer statistics of the squared norms
# --------------------------------------------------------------------------------------

#: ``s`` of ``norms.py`` / ``nlp_norms.py``: ``sqrt(d) = 8`` hard-coded (docs/method.md 0.3, 8, 9).
PAPER_NORMS_SCALE = 1.0 / 8.0
#: Values above this percentile are dropped per layer before the statistics (docs/method.md 8).
PAPER_NORMS_TRIM = 95.0
#: The paper's shaded band: 25th-75th percentiles of the trimmed values (docs/method.md 8).
PAPER_NORMS_BAND = (25.0, 75.0)
#: The band the captions promise ("95% percentiles"): the central 95 % of all values.
CORRECTED_NORMS_BAND = (2.5, 97.5)


def layer_norm_statistics(
    values: np.ndarray, trim: float | None = None, band: tuple[float, float] = PAPER_NORMS_BAND
) -> dict[str, float]:
    """Per-layer statistics of one squared-norm quantity (Figures 2 and 5, docs/method.md 8-9).

    The paper's recipe (``norms.py``, ``nlp_norms.py``): drop the values above the
    ``trim``-th percentile (``np.percentile``, linear interpolation; values equal to it are
    kept), then the median and the ``band`` percentiles of what is left. With
    ``trim=None`` (corrected variant) nothing is dropped. Non-finite values are counted and
    left out (the reference has none after its own overflow handling).

    Args:
        values: ``||phi(q_i)||^2`` or ``||h_i||^2`` of one layer pooled over images, heads
            and tokens, any shape, float.
        trim: percentile in ``(0, 100]`` above which values are dropped, or None.
        band: ``(lower, upper)`` percentiles of the shaded band, ``0 <= lower <= upper <= 100``.

    Returns:
        ``n_values`` (finite values), ``n_nonfinite``, ``n_kept`` (after the trim),
        ``trim_threshold`` (NaN without trim), and over the kept values ``median``, ``q25``,
        ``q75``, ``band_lower``, ``band_upper``, ``mean``, ``min``, ``max``; also
        ``mean_all``, the mean of every finite value before the trim.

    Raises:
        ValueError: no finite value, or ``trim``/``band`` out of range.
    """
    if trim is not None and not 0 < trim <= 100:
        raise ValueError(f"trim must be a percentile in (0, 100], got {trim}")
    lo, hi = band
    if not 0 <= lo <= hi <= 100:
        raise ValueError(f"band must be percentiles 0 <= lower <= upper <= 100, got {band}")
    x = np.asarray(values, dtype=np.float64).ravel()
    finite = np.isfinite(x)
    x, n_nonfinite = x[finite], int((~finite).sum())
    if x.size == 0:
        raise ValueError(f"no finite value among {n_nonfinite} values")
    threshold = float(np.percentile(x, trim)) if trim is not None else float("nan")
    kept = x[x <= threshold] if trim is not None else x
    q = np.percentile(kept, [50.0, 25.0, 75.0, lo, hi])
    return {
        "n_values": int(x.size),
        "n_nonfinite": n_nonfinite,
        "n_kept": int(kept.size),
        "trim_threshold": threshold,
        "median": float(q[0]),
        "q25": float(q[1]),
        "q75": float(q[2]),
        "band_lower": float(q[3]),
        "band_upper": float(q[4]),
        "mean": float(kept.mean()),
        "min": float(kept.min()),
        "max": float(kept.max()),
        "mean_all": float(x.mean()),
    }
