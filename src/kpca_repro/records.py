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
from .kpca import CORRECTED, gamma_test, head_metrics, top_eigenvalues
from .smk import library_versions
from .vision import AttentionRecorder, attention_modules, load_timm_model

__all__ = ["extract_vision", "kpca_records", "baseline_noise", "eigenvalue_records", "gamma_records"]


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
    """Per-head records of one activation file: every (image, layer, head) through KPCA.

    Reads one layer at a time (memory does not grow with depth), batches ``heads_per_chunk``
    heads per :func:`kpca_repro.kpca.head_metrics` call on ``device``.

    Returns:
        ``(records, meta)``: a DataFrame with one row per head (``sample_rank``,
        ``dataset_index``, ``layer``, ``head``, ``n_tokens``, ``head_dim`` and the metric
        columns) in (layer, image, head) order, and the file's metadata (model id, weights
        SHA-256, number of images).

    Raises:
        kpca_repro.h5io.CorruptActivationFileError: the file is unreadable (named).
    """
    from tqdm import tqdm

    frames = []
    with ActivationFile(activations) as af:
        model_id = str(af.attrs["model_id"])
        n_img, n_heads = len(af.sample_rank), int(af.attrs["n_heads"])
        for layer in tqdm(list(layers if layers is not None else range(af.n_layers)), desc=f"kpca {variant} {model_id}", unit="layer", disable=not progress, mininterval=5):
            t = af.read(layer, ("k", "v"))
            k = torch.from_numpy(t["k"]).reshape(-1, *t["k"].shape[2:])
            v = torch.from_numpy(t["v"]).reshape(-1, *t["v"].shape[2:])
            if variant == CORRECTED:
                base = torch.cat([baseline_noise(seed, di, layer, tuple(t["v"].shape[1:])) for di in af.dataset_index])
            for lo in range(0, k.shape[0], heads_per_chunk):
                hi = min(lo + heads_per_chunk, k.shape[0])
                cols = head_metrics(
                    k[lo:hi].to(device),
                    v[lo:hi].to(device),
                    variant,
                    baseline=base[lo:hi].to(device) if variant == CORRECTED else None,
                )
                flat = np.arange(lo, hi)
                frames.append(
                    pd.DataFrame(
                        {
                            "sample_rank": af.sample_rank[flat // n_heads],
                            "dataset_index": af.dataset_index[flat // n_heads],
                            "layer": layer,
                            "head": flat % n_heads,
                            "n_tokens": k.shape[1],
                            "head_dim": v.shape[2],
                            **cols,
                        }
                    )
                )
        meta = {
            "model_id": model_id,
            "weights_sha256": str(af.attrs["weights_sha256"]),
            "n_images": n_img,
            "variant": variant,
            "shard": int(af.attrs["shard"]),
            "n_shards": int(af.attrs["n_shards"]),
        }
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
