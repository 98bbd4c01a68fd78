"""The two data-producing stages: activation extraction and per-head KPCA records.

Rule scripts call these; tests call them too. The mathematics itself lives in
:mod:`kpca_repro.kpca`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import h5py
import numpy as np
import pandas as pd
import torch

from . import images as img
from .h5io import ActivationFile, ActivationWriter, atomic_output
from .kpca import CORRECTED, PAPER, gamma_test, head_metrics, top_eigenvalues
from .smk import library_versions
from .vision import AttentionRecorder, attention_modules, load_timm_model

__all__ = ["extract_vision", "kpca_records", "TEXT_PAPER_OPTIONS", "baseline_noise", "eigenvalue_records", "gamma_records"]


def extract_vision(
    model_id: str,
    weights_path: str | os.PathLike,
    weights_sha256: str,
    samples: pd.DataFrame,
    out_path: str | os.PathLike,
    *,
    batch_size: int,
    device: torch.device,
    model_kwargs: dict | None = None,
    shard: tuple[int, int] = (0, 1),
    progress: bool = True,
) -> None:
    """Run ``model_id`` over the sampled images and write q, k, v, h of every layer to HDF5.

    One forward pass per batch of ``batch_size`` images captures every layer. Preprocessing
    is the paper's (:func:`kpca_repro.images.paper_transform`) at the model's input size.
    The file is written under a temporary name and renamed when complete.

    Args:
        samples: the rows of this shard of the sampled-image table (``sample_rank``,
            ``dataset_index``, ``path``), in order.
        out_path: the ``.h5`` file to write (layout: :mod:`kpca_repro.h5io`).
        shard: ``(index, count)`` recorded in the attributes.

    Raises:
        kpca_repro.images.UnreadableImageError: an image cannot be decoded (named).
        kpca_repro.vision.UnsupportedArchitectureError: the model lacks the hooked structure.
    """
    from tqdm import tqdm

    model = load_timm_model(model_id, weights_path, model_kwargs).to(device)
    attns = attention_modules(model)
    img_size = tuple(model.patch_embed.img_size)
    transform = img.paper_transform(img_size)
    n_prefix = int(getattr(model, "num_prefix_tokens", 1))
    n_tokens = n_prefix + int(model.patch_embed.num_patches)
    heads, head_dim = attns[0].num_heads, attns[0].head_dim
    attrs = {
        "model_id": model_id,
        "weights_sha256": weights_sha256,
        "weights_file": os.path.basename(str(weights_path)),
        "model_kwargs": model_kwargs or {},
        "n_layers": len(attns),
        "n_heads": heads,
        "head_dim": head_dim,
        "n_tokens": n_tokens,
        "n_prefix_tokens": n_prefix,
        "inputs": [os.path.basename(p) for p in samples["path"]],
        "preprocessing": {
            "resize": list(img_size),
            "interpolation": "bilinear (torchvision default, antialias)",
            "normalize_mean": img.IMAGENET_MEAN,
            "normalize_std": img.IMAGENET_STD,
            "reference": "method.md Section 1",
        },
        "versions": library_versions(),
        "shard": shard[0],
        "n_shards": shard[1],
        "dtype": "float32",
    }
    n = len(samples)
    with atomic_output(out_path) as tmp, h5py.File(tmp, "w", track_order=False) as f:
        writer = ActivationWriter(f, n, len(attns), heads, n_tokens, head_dim, attrs)
        writer.write_index("sample_rank", samples["sample_rank"].to_numpy())
        writer.write_index("dataset_index", samples["dataset_index"].to_numpy())
        paths = list(samples["path"])
        with torch.no_grad(), AttentionRecorder(attns) as rec:
            for start in tqdm(range(0, n, batch_size), desc=f"extract {model_id}", unit="batch", disable=not progress, mininterval=5):
                batch = [transform(img.load_image(p)) for p in paths[start : start + batch_size]]
                x = torch.stack(batch).to(device)
                model(x)
                for layer in range(len(attns)):
                    writer.write_batch(layer, start, rec.numpy_layer(layer))


def baseline_noise(seed: int, dataset_index: int, layer: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal stand-in for V_KPCA of one (image, layer), float64 on the CPU.

    Seeded by ``(seed, dataset_index, layer)`` so it does not depend on sharding or batching.
    """
    ss = np.random.SeedSequence([seed, int(dataset_index), int(layer)])
    gen = torch.Generator().manual_seed(int(ss.generate_state(1, dtype=np.uint64)[0] >> 1))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


#: ``head_metrics`` options of the language-model script ``nlp_value_vectors.py`` (method.md 3):
#: top-d eigenvectors in ascending order, ``G = diag(1/(g + 1e-6))``, NaN costs set to 0 before
#: the assignment (no try/except, nothing dropped), CKA denominators ``sqrt(xx * yy) + 1e-10``.
TEXT_PAPER_OPTIONS = {"order": "asc_top", "g_eps": 1e-6, "nan_cost_to_zero": True, "cka_sqrt_of_product": True}


def _head_groups(af: ActivationFile, t: dict[str, np.ndarray], variant: str, layer: int, seed: int, transposed: bool):
    """Heads of one layer in groups with a common token count ``N``.

    Yields ``(k, v, sample_rank, dataset_index, head, baseline)``: ``k, v`` float32 tensors
    ``(heads, N, d)``, per-head index arrays, and the random baseline (corrected variant) or
    None. Three readings of the file:

    * vision, and language models in the paper variant: every (input, head) with all ``N``
      stored positions (padding included, method.md 3);
    * ``transposed`` (Longformer, paper variant): the reference's misreading of Longformer's
      ``(sequence, batch, hidden)`` projections (method.md 3): each "head matrix" is the
      ``B`` inputs at one position ``p``, so ``sample_rank`` holds ``p`` and
      ``dataset_index`` is -1;
    * language models, corrected variant (method.md 15 item 4): each input keeps only its
      real tokens (``attention_mask == 1``); inputs of equal length are grouped.
    """
    k, v = t["k"], t["v"]
    n_in, n_heads = k.shape[:2]
    corrected = variant == CORRECTED

    def base(index, shape):
        return torch.cat([baseline_noise(seed, di, layer, shape) for di in index]) if corrected else None

    if transposed:
        k, v = k.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3)
        n_pos = k.shape[0]
        ranks = np.repeat(np.arange(n_pos), n_heads)
        yield (torch.from_numpy(np.ascontiguousarray(k)).reshape(-1, *k.shape[2:]), torch.from_numpy(np.ascontiguousarray(v)).reshape(-1, *v.shape[2:]),
               ranks, np.full(len(ranks), -1), np.tile(np.arange(n_heads), n_pos), None)
    elif corrected and af.attention_mask is not None:
        mask = af.attention_mask.astype(bool)
        lengths = mask.sum(axis=1)
        for n in sorted(set(lengths.tolist())):
            sel = np.flatnonzero(lengths == n)
            kk = np.stack([k[i][:, mask[i]] for i in sel])
            vv = np.stack([v[i][:, mask[i]] for i in sel])
            yield (torch.from_numpy(kk).reshape(-1, n, kk.shape[-1]), torch.from_numpy(vv).reshape(-1, n, vv.shape[-1]),
                   np.repeat(af.sample_rank[sel], n_heads), np.repeat(af.dataset_index[sel], n_heads), np.tile(np.arange(n_heads), len(sel)),
                   base(af.dataset_index[sel], (n_heads, n, vv.shape[-1])))
    else:
        yield (torch.from_numpy(k).reshape(-1, *k.shape[2:]), torch.from_numpy(v).reshape(-1, *v.shape[2:]),
               np.repeat(af.sample_rank, n_heads), np.repeat(af.dataset_index, n_heads), np.tile(np.arange(n_heads), n_in),
               base(af.dataset_index, tuple(v.shape[1:])))


def kpca_records(
    activations: str | os.PathLike,
    variant: str,
    *,
    device: torch.device,
    heads_per_chunk: int = 64,
    seed: int = 0,
    layers: Sequence[int] | None = None,
    progress: bool = True,
) -> tuple[pd.DataFrame, dict]:
    """Per-head records of one activation file: every (input, layer, head) through KPCA.

    Reads one layer at a time (memory does not grow with depth), batches ``heads_per_chunk``
    heads per :func:`kpca_repro.kpca.head_metrics` call on ``device``. Vision files (Table 1,
    method.md 2) and language-model files (Table 4, method.md 3; recognised by their
    ``attention_mask``) go through the same code: the paper variant of a language model uses
    :data:`TEXT_PAPER_OPTIONS` and all padded positions (Longformer read transposed, as the
    reference reads it); the corrected variant drops padding per sequence (method.md 15).

    Returns:
        ``(records, meta)``: a DataFrame with one row per head (``sample_rank``,
        ``dataset_index``, ``layer``, ``head``, ``n_tokens``, ``head_dim`` and the metric
        columns) in layer order, and the file's metadata (model id, weights SHA-256, number of
        images or sentences; for text also ``padding`` and ``longformer_transposed``).

    Raises:
        kpca_repro.h5io.CorruptActivationFileError: the file is unreadable (named).
    """
    from tqdm import tqdm

    from .text import SEQUENCE_FIRST

    frames = []
    with ActivationFile(activations) as af:
        model_id = str(af.attrs["model_id"])
        text = af.attention_mask is not None
        transposed = text and variant == PAPER and str(af.attrs.get("hooked_layout", "")) == SEQUENCE_FIRST
        options = TEXT_PAPER_OPTIONS if text and variant == PAPER else {}
        for layer in tqdm(list(layers if layers is not None else range(af.n_layers)), desc=f"kpca {variant} {model_id}", unit="layer", disable=not progress, mininterval=5):
            t = af.read(layer, ("k", "v"))
            for k, v, ranks, index, head, base in _head_groups(af, t, variant, layer, seed, transposed):
                for lo in range(0, k.shape[0], heads_per_chunk):
                    hi = min(lo + heads_per_chunk, k.shape[0])
                    cols = head_metrics(
                        k[lo:hi].to(device),
                        v[lo:hi].to(device),
                        variant,
                        baseline=base[lo:hi].to(device) if base is not None else None,
                        **options,
                    )
                    frames.append(
                        pd.DataFrame(
                            {
                                "sample_rank": ranks[lo:hi],
                                "dataset_index": index[lo:hi],
                                "layer": layer,
                                "head": head[lo:hi],
                                "n_tokens": k.shape[1],
                                "head_dim": v.shape[2],
                                **cols,
                            }
                        )
                    )
        meta = {
            "model_id": model_id,
            "weights_sha256": str(af.attrs["weights_sha256"]),
            "n_sentences" if text else "n_images": len(af.sample_rank),
            "variant": variant,
            "shard": int(af.attrs["shard"]),
            "n_shards": int(af.attrs["n_shards"]),
        }
        if text:
            meta["padding"] = "included" if variant == PAPER else "excluded"
            meta["longformer_transposed"] = bool(transposed)
    records = pd.concat(frames, ignore_index=True)
    records.insert(0, "model", model_id)
    records.insert(1, "variant", variant)
    return records, meta


def eigenvalue_records(
    activations: str | os.PathLike,
    variant: str,
    standardize: bool,
    *,
    n_components: int = 64,
    device: torch.device,
    heads_per_chunk: int = 64,
) -> pd.DataFrame:
    """Per-head top eigenvalues of one activation file (Tables 2 and 3, method.md 4-5).

    Returns:
        One row per (image, layer, head): ``sample_rank, dataset_index, layer, head,
        finite`` and ``lambda_01 .. lambda_<n>`` (``|lambda_r|``, descending, NaN where the
        paper variant overflows).

    Raises:
        kpca_repro.h5io.CorruptActivationFileError: the file is unreadable (named).
    """
    frames = []
    with ActivationFile(activations) as af:
        n_heads = int(af.attrs["n_heads"])
        for layer in range(af.n_layers):
            k = torch.from_numpy(af.read(layer, ("k",))["k"])
            k = k.reshape(-1, *k.shape[2:])
            for lo in range(0, k.shape[0], heads_per_chunk):
                hi = min(lo + heads_per_chunk, k.shape[0])
                evals, finite = top_eigenvalues(k[lo:hi].to(device), n_components, variant, standardize)
                flat = np.arange(lo, hi)
                frame = pd.DataFrame(evals.cpu().numpy(), columns=[f"lambda_{r + 1:02d}" for r in range(n_components)])
                frame.insert(0, "finite", finite.cpu().numpy())
                frame.insert(0, "head", flat % n_heads)
                frame.insert(0, "layer", layer)
                frame.insert(0, "dataset_index", af.dataset_index[flat // n_heads])
                frame.insert(0, "sample_rank", af.sample_rank[flat // n_heads])
                frames.append(frame)
        model_id = str(af.attrs["model_id"])
    out = pd.concat(frames, ignore_index=True)
    out.insert(0, "keys", "standardized" if standardize else "raw")
    out.insert(0, "variant", variant)
    out.insert(0, "model", model_id)
    return out


def gamma_records(
    activations: str | os.PathLike,
    layer: int,
    variant: str,
    *,
    standardize: bool,
    noise: float,
    seed: int,
    n_components: int,
    device: torch.device,
) -> pd.DataFrame:
    """Figure 3's gamma-constancy statistics for every head of one layer (method.md Section 10).

    Returns:
        Long table: ``sample_rank, head, eigenvectors ("true" | "perturbed"), component,
        abs_mean, abs_std, rel_mean, rel_std``; one row per (image, head, kind, component).

    Raises:
        ValueError: ``layer`` is not a layer of the model.
        kpca_repro.h5io.CorruptActivationFileError: the file is unreadable (named).
    """
    with ActivationFile(activations) as af:
        if not 0 <= layer < af.n_layers:
            raise ValueError(f"figure3.block {layer} is out of range: {af.attrs['model_id']} has {af.n_layers} blocks")
        k = torch.from_numpy(af.read(layer, ("k",))["k"])
        ranks = af.sample_rank
    n_img, n_heads = k.shape[:2]
    result = gamma_test(k.reshape(-1, *k.shape[2:]).to(device), n_components, variant, standardize, noise, torch.Generator().manual_seed(seed))
    frames = []
    for kind, spread in result.items():
        arrays = {name: t.detach().cpu().double().numpy() for name, t in spread.items()}
        heads, comps = np.meshgrid(np.arange(n_img * n_heads), np.arange(n_components), indexing="ij")
        frames.append(
            pd.DataFrame(
                {
                    "sample_rank": ranks[heads.ravel() // n_heads],
                    "head": heads.ravel() % n_heads,
                    "eigenvectors": kind,
                    "component": comps.ravel(),
                    **{name: arr.ravel() for name, arr in arrays.items()},
                }
            )
        )
    return pd.concat(frames, ignore_index=True)
