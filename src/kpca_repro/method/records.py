"""Stage 2: per-head records from activation files: KPCA metrics (Tables 1 and 4),
eigenvalues (Tables 2 and 3) and the gamma test (Figure 3).

Rule scripts call these; tests call them too. The mathematics itself lives in
:mod:`kpca_repro.method.kpca`; extraction (stage 1) in :mod:`kpca_repro.capture.extraction`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence

import numpy as np
import pandas as pd
import torch

from kpca_repro.activations import ActivationFile
from kpca_repro.method.equations import all_directions_kept
from kpca_repro.method.kpca import gamma_test, head_metrics, solve_heads, top_eigenvalues
from kpca_repro.method.placement import Placement, plan
from kpca_repro.method.solver_variation import RunningFloor, head_solver_draws, prune_below_floor
from kpca_repro.method.uncertainty import BOUND_NAMES, COLLISION_BOUND, MATCHED_BOUND, MEAN_VECTOR, OPTIMAL_COS_MEAN, RANGE_NAMES, SIGN_DRAW_NAMES
from kpca_repro.method.variant import Variant
from kpca_repro.method.variant import get as get_variant
from kpca_repro.resume import JobInterrupted, PartStore
from kpca_repro.workers import WorkerPool, device_stream

__all__ = ["kpca_records", "baseline_noise", "eigenvalue_records", "gamma_records", "layer_chunks", "clamp_components", "MIN_TOKENS", "too_few_tokens", "check_prefix"]

_LOG = logging.getLogger("kpca_repro.records")

#: The fewest tokens a head is analysed with (docs/method.md 16.2). With ``N`` tokens the
#: centered Gram matrix has at most ``N - 1`` non-zero eigenvalues: none at ``N = 1``
#: (``V_KPCA = 0``: cosines 0, CKA 0/0) and one at ``N = 2``, where two centered rows are
#: opposite, so linear and RBF CKA are 1 for any ``k`` and ``v``.
MIN_TOKENS = 3
#: Why, in one clause (the errors and the log name it).
FEW_TOKENS_REASON = (
    f"a head needs at least {MIN_TOKENS} tokens: with N tokens the centered Gram matrix has at most N - 1 non-zero eigenvalues "
    "(none at N = 1: V_KPCA = 0, CKA 0/0; one at N = 2: both CKAs are 1 for any k and v)"
)


def too_few_tokens(n_tokens) -> np.ndarray:
    """Which heads (real-token counts ``n_tokens``, any shape) have fewer than :data:`MIN_TOKENS` tokens: bool, the same shape.

    The corrected reading of language models (and decoders in both variants) leaves such rows
    out with a logged count (:func:`kpca_records`); the notebook API refuses them
    (:func:`kpca_repro.method.api.analyze_heads`).
    """
    return np.asarray(n_tokens) < MIN_TOKENS


def check_prefix(prefix) -> None:
    """Refuse a prefix length ``P`` of the prefix profile (docs/method.md 16.1) that is not an integer of at least :data:`MIN_TOKENS`.

    ``None`` (the full-prefix view) passes. Whether the heads are causal is the caller's check.

    Raises:
        TypeError: ``prefix`` is not an integer (``bool`` included); one line naming it.
        ValueError: ``prefix < MIN_TOKENS``; one line naming it and the reason.
    """
    if prefix is None:
        return
    if isinstance(prefix, (bool, np.bool_)) or not isinstance(prefix, (int, np.integer)):
        raise TypeError(f"prefix={prefix!r}: the prefix length P is a number of real tokens and must be an integer, not {type(prefix).__name__}")
    if prefix < MIN_TOKENS:
        raise ValueError(f"prefix={prefix}: P must be at least {MIN_TOKENS}; {FEW_TOKENS_REASON}")


def clamp_components(n_components: int, n_tokens: int, key: str) -> int:
    """``n_components`` eigenpairs, or all ``n_tokens`` of them when fewer exist (logged: the config key, both numbers).

    A head of ``N`` tokens has ``N`` eigenvalues: Tables 2-3 and Figure 3 of a model with
    fewer tokens than ``spectra.n_components`` / ``figure3.n_components`` keep all ``N``.
    """
    if n_components <= n_tokens:
        return n_components
    _LOG.warning("config key %s is %d but the heads have %d tokens, so %d eigenpairs: keeping all %d", key, n_components, n_tokens, n_tokens, n_tokens)
    return n_tokens


def baseline_noise(seed: int, dataset_index: int, layer: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal stand-in for V_KPCA of one (image, layer), float64 on the CPU.

    Seeded by ``(seed, dataset_index, layer)`` so it does not depend on sharding or batching.
    """
    ss = np.random.SeedSequence([seed, int(dataset_index), int(layer)])
    gen = torch.Generator().manual_seed(int(ss.generate_state(1, dtype=np.uint64)[0] >> 1))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def no_records() -> pd.DataFrame:
    """The records of a prefix that no row reaches: no rows, the identifying int64 columns."""
    return pd.DataFrame({name: pd.Series(dtype="int64") for name in ("sample_rank", "dataset_index", "layer", "head", "n_tokens", "head_dim")})


def _equal_length_groups(af: ActivationFile, t: dict[str, np.ndarray], variant: str | Variant, layer: int, seed: int, transposed: bool, prefix: int | None = None):
    """Heads of one layer in groups with a common token count ``N``.

    Yields ``(k, v, sample_rank, dataset_index, head, baseline, q, h)``: ``k, v`` float32 tensors
    ``(heads, N, d)``, per-head index arrays, the random baseline (corrected variant) or
    None (``variant.baselines``), and where ``t`` holds ``q`` and ``h`` the projection test's
    queries and outputs ``(heads, G, M, d)`` (the ``G`` query heads of each KV head; ``M`` = every
    token, or a causal prefix's last one), else None. Three readings of the file:

    * vision, and language models with ``variant.text_padding == "included"`` (paper): every
      (input, head) with all ``N`` stored positions (padding included, docs/method.md 3);
    * ``transposed`` (Longformer, paper variant): the reference's misreading of Longformer's
      ``(sequence, batch, hidden)`` projections (docs/method.md 3): each "head matrix" is the
      ``B`` inputs at one position ``p``, so ``sample_rank`` holds ``p`` and
      ``dataset_index`` is -1;
    * language models, ``text_padding == "excluded"`` (corrected, docs/method.md 15 item 4;
      decoders in every variant, 16.2): each input keeps only its real tokens
      (``attention_mask == 1``, on either side; a causal file without a mask: every token);
      inputs of equal length are grouped; an input with fewer than :data:`MIN_TOKENS` real
      tokens is left out. With ``prefix`` ``P`` (the prefix profile of a causal
      file, docs/method.md 16.1) each input keeps its first ``P`` real tokens, and an input with
      fewer than ``P`` is left out.

    The heads are ``k``'s: a causal file's KV heads (docs/method.md 16.4).
    """
    variant = get_variant(variant)
    k, v = t["k"], t["v"]
    n_in, n_heads = k.shape[:2]
    causal = bool(getattr(af, "causal", False))
    group = _query_groups(t, n_heads, getattr(af, "kv_head_of_query", None))

    def base(index, shape):
        return torch.cat([baseline_noise(seed, di, layer, shape) for di in index]) if variant.baselines else None

    if transposed:
        k, v = k.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3)
        n_pos = k.shape[0]
        ranks = np.repeat(np.arange(n_pos), n_heads)
        yield (
            torch.from_numpy(np.ascontiguousarray(k)).reshape(-1, *k.shape[2:]),
            torch.from_numpy(np.ascontiguousarray(v)).reshape(-1, *v.shape[2:]),
            ranks,
            np.full(len(ranks), -1),
            np.tile(np.arange(n_heads), n_pos),
            None,
            None,
            None,
        )
    elif variant.text_padding == "excluded" and (af.attention_mask is not None or causal):
        mask = af.attention_mask.astype(bool) if af.attention_mask is not None else np.ones((n_in, k.shape[2]), dtype=bool)
        lengths = mask.sum(axis=1)
        lengths = np.where(too_few_tokens(lengths), -1, lengths)  # -1: left out (counted by kpca_records)
        if prefix is not None:
            mask = mask & (np.cumsum(mask, axis=1) <= prefix)
            lengths = np.where(lengths >= prefix, prefix, -1)  # -1: shorter than P, left out
        for n in sorted(set(lengths.tolist()) - {-1}):
            sel = np.flatnonzero(lengths == n)
            kk = np.stack([k[i][:, mask[i]] for i in sel])
            vv = np.stack([v[i][:, mask[i]] for i in sel])
            # the queries tested (docs/method.md 17.3): every real token of an encoder's row; the
            # last real token of a causal prefix, the one query whose key set is the whole prefix
            queries = [np.flatnonzero(mask[i])[-1:] if causal else np.flatnonzero(mask[i]) for i in sel]
            yield (
                torch.from_numpy(kk).reshape(-1, n, kk.shape[-1]),
                torch.from_numpy(vv).reshape(-1, n, vv.shape[-1]),
                np.repeat(af.sample_rank[sel], n_heads),
                np.repeat(af.dataset_index[sel], n_heads),
                np.tile(np.arange(n_heads), len(sel)),
                base(af.dataset_index[sel], (n_heads, n, vv.shape[-1])),
                *(None if group is None else torch.from_numpy(np.stack([t[name][i][group][..., at, :] for i, at in zip(sel, queries)])).flatten(0, 1) for name in ("q", "h")),
            )
    else:
        yield (
            torch.from_numpy(k).reshape(-1, *k.shape[2:]),
            torch.from_numpy(v).reshape(-1, *v.shape[2:]),
            np.repeat(af.sample_rank, n_heads),
            np.repeat(af.dataset_index, n_heads),
            np.tile(np.arange(n_heads), n_in),
            base(af.dataset_index, tuple(v.shape[1:])),
            *(None if group is None else torch.from_numpy(t[name][:, group]).flatten(0, 1) for name in ("q", "h")),
        )


def _query_groups(t: dict[str, np.ndarray], n_kv_heads: int, kv_head_of_query) -> np.ndarray | None:
    """The query heads of each KV head as an index array ``(H_kv, G)`` into ``q``'s heads, or None
    where ``t`` holds no ``q`` and ``h`` (no projection test) or the KV heads' groups differ in size."""
    if "q" not in t or "h" not in t:
        return None
    kv = np.arange(n_kv_heads) if kv_head_of_query is None else np.asarray(kv_head_of_query)
    order = np.argsort(kv, kind="stable")
    counts = np.bincount(kv, minlength=n_kv_heads)
    if len(set(counts.tolist())) != 1:
        return None
    return order.reshape(n_kv_heads, -1)


def _chunked(groups: Iterator[tuple], layer: int, heads_per_chunk: int) -> Iterator[tuple]:
    """:func:`_equal_length_groups`' groups in chunks of at most ``heads_per_chunk`` heads, each
    ``(layer, k, v, sample_rank, dataset_index, head, baseline or None)``: :func:`chunk_records`' first arguments."""
    for group in groups:
        for lo in range(0, group[0].shape[0], heads_per_chunk):
            yield (layer, *(None if x is None else x[lo : lo + heads_per_chunk] for x in group))


def layer_chunks(
    af: ActivationFile, layers: Sequence[int], heads_per_chunk: int, names: tuple[str, ...] = ("k", "v"), interleave: bool = False
) -> Iterator[tuple[int, np.ndarray, dict[str, torch.Tensor]]]:
    """Stream an activation file as chunks of at most ``max(heads_per_chunk, H)`` heads.

    Reads each layer in blocks of ``max(1, heads_per_chunk // H)`` images, so host memory
    depends on the chunk size, not on the number of images in the file. Layer by layer, or
    with ``interleave`` each block of images through every layer in turn (every layer early:
    Table 1's floor of the matched-cosine draws, :class:`~kpca_repro.method.solver_variation.RunningFloor`,
    rises with the layers that hold the largest values, wherever they are).

    Yields:
        ``(layer, flat, tensors)``: the chunk's flat head indices ``image * H + head`` within
        the layer (``(heads,)`` int64) and ``name -> (heads, N, d)`` float32 CPU tensors.
    """
    n_img, n_heads = len(af.sample_rank), int(af.attrs["n_heads"])
    per_read = max(1, heads_per_chunk // n_heads)
    blocks = [(layer, i0) for layer in layers for i0 in range(0, n_img, per_read)]
    if interleave:
        blocks.sort(key=lambda b: (b[1], list(layers).index(b[0])))
    for layer, i0 in blocks:
        i1 = min(i0 + per_read, n_img)
        t = af.read(layer, names, images=slice(i0, i1))
        flat_t = {name: torch.from_numpy(a).reshape(-1, *a.shape[2:]) for name, a in t.items()}
        heads = (i1 - i0) * n_heads
        for lo in range(0, heads, heads_per_chunk):
            hi = min(lo + heads_per_chunk, heads)
            yield layer, np.arange(i0 * n_heads + lo, i0 * n_heads + hi), {name: x[lo:hi] for name, x in flat_t.items()}


def chunk_records(
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    ranks: np.ndarray,
    index: np.ndarray,
    head: np.ndarray,
    base: torch.Tensor | None,
    q: torch.Tensor | None = None,
    h: torch.Tensor | None = None,
    *,
    variant: Variant,
    placement: Placement,
    sign_draws: tuple[int, int] | None,
    seed: int,
    floor: RunningFloor | None = None,
    solved: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, np.ndarray] | None, pd.DataFrame]:
    """Per-head records of one chunk of heads (``k``, ``v``: ``(heads, N, d)``; ``ranks``,
    ``index``, ``head``: ``(heads,)``; ``base``: the corrected variant's random baselines):
    :func:`kpca_repro.method.kpca.head_metrics` as ``variant`` (the file's reading,
    :meth:`~kpca_repro.method.variant.Variant.reading`) and ``placement`` say, and with
    ``q``, ``h`` (``(heads, G, M, d)``) the projection test, and with
    ``sign_draws`` the solver draws (:func:`kpca_repro.method.solver_variation.head_solver_draws`;
    with ``floor``, matched-cosine draws that cannot be a replicate maximum are skipped) and
    their per-head columns. ``solved``: the chunk's :func:`kpca_repro.method.kpca.solve_heads`,
    when the caller solved it already. The one per-chunk step of :func:`kpca_records` and
    :func:`kpca_repro.method.api.analyze_heads`.

    Returns:
        ``(draws or None, records)``, one record row per head.
    """
    rows = {} if sign_draws else None
    device = placement.device
    with device_stream(device, placement.streams):
        cols = head_metrics(
            k.to(device),
            v.to(device),
            variant,
            placement=placement,
            baseline=base.to(device) if base is not None else None,
            rows=rows,
            solved=solved,
            queries=None if q is None else (q.to(device), h.to(device)),
        )
    draws = None
    if sign_draws:
        nan_zero = variant.nan_cost_to_zero
        # signs and rotations inside near-degenerate eigenspaces (docs/uncertainty.md); Table 4 takes the token maximum
        draws, gap_cols = head_solver_draws(
            rows, {"layer": layer, "sample_rank": ranks, "dataset_index": index, "head": head},
            seed=seed, n_direct=sign_draws[0], n_optimal=sign_draws[1], token_max=variant.text, order=variant.order,
            valid=None if nan_zero else torch.from_numpy(~cols["dropped"]), nan_to_zero=nan_zero,
            own_optimal=cols["optimal_cos_mean"], floor=floor,
        )  # fmt: skip
        cols = {**cols, **gap_cols}
    frame = pd.DataFrame({"sample_rank": ranks, "dataset_index": index, "layer": layer, "head": head, "n_tokens": k.shape[1], "head_dim": v.shape[2], **cols})
    # the regime where the kept eigenvectors span the whole centered space (docs/method.md 17.1)
    n_components = min(v.shape[2], k.shape[1])
    frame["n_centered_directions"] = k.shape[1] - 1
    frame["n_components"] = n_components
    frame["all_directions_kept"] = all_directions_kept(k.shape[1], n_components)
    return draws, frame


def _file_chunks(
    af: ActivationFile, variant: Variant, layer_list: list[int], heads_per_chunk: int, seed: int, transposed: bool, interleave: bool, prefix: int | None = None
) -> Iterator[tuple[tuple, tuple]]:
    """``(position, (layer, k, v, sample_rank, dataset_index, head, baseline or None))`` per chunk of an activation file.

    ``position`` orders the records (layer by layer) whatever order the chunks come in.
    Vision files (no ``attention_mask``): :func:`layer_chunks` (``interleave``: every layer
    early), the corrected variant's baselines drawn per image (:func:`baseline_noise`,
    ``(heads, N, d)`` float64), position ``(place of the layer in layer_list, first flat head)``.
    Text and causal files: each layer read whole and grouped by :func:`_equal_length_groups` in ``variant``'s
    reading (``transposed``: Longformer as the reference reads it; ``prefix``: a causal file's
    first ``P`` real tokens), in chunks of ``heads_per_chunk`` (:func:`_chunked`), position a running count.
    """
    n_heads = int(af.attrs["n_heads"])
    names = ("k", "v", "q", "h") if projection_test_wanted(variant, af.causal) and not transposed else ("k", "v")
    if af.attention_mask is None and not af.causal:
        for layer, flat, t in layer_chunks(af, layer_list, heads_per_chunk, names=names, interleave=interleave):
            images = flat // n_heads
            base = None
            if variant.baselines:
                noise = {int(i): baseline_noise(seed, af.dataset_index[i], layer, (n_heads, *t["v"].shape[1:])) for i in np.unique(images)}
                base = torch.stack([noise[int(f // n_heads)][f % n_heads] for f in flat])
            queries = tuple(t[name][:, None] for name in ("q", "h")) if "q" in t else (None, None)
            yield (layer_list.index(layer), int(flat[0])), (layer, t["k"], t["v"], af.sample_rank[images], af.dataset_index[images], flat % n_heads, base, *queries)
        return
    position = 0
    for layer in layer_list:
        for chunk in _chunked(_equal_length_groups(af, af.read(layer, names), variant, layer, seed, transposed, prefix), layer, heads_per_chunk):
            position += 1
            yield (position,), chunk


def projection_test_wanted(variant: Variant, causal: bool) -> bool:
    """Whether the records of a file carry the projection test (docs/method.md 17.3): the
    corrected variant's (``variant.controls``), and a decoder's in both variants."""
    return variant.controls or causal


def _batches(chunks: Iterator, size: int) -> Iterator[list]:
    """``chunks`` in lists of ``size`` (the last one shorter)."""
    batch: list = []
    for chunk in chunks:
        batch.append(chunk)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _part_arrays(parts: list[tuple]) -> dict[str, np.ndarray]:
    """One batch's ``(position, draws or None, frame)`` parts as plain arrays, for a :class:`~kpca_repro.resume.PartStore`."""
    out: dict[str, np.ndarray] = {"n": np.array(len(parts))}
    for j, (position, draws, frame) in enumerate(parts):
        out[f"p{j}.position"] = np.asarray(position, dtype=np.int64)
        out[f"p{j}.columns"] = np.asarray(frame.columns, dtype=str)
        out.update({f"p{j}.col{i}": frame[c].to_numpy() for i, c in enumerate(frame.columns)})
        if draws is not None:
            out[f"p{j}.draws"] = np.asarray(list(draws), dtype=str)
            out.update({f"p{j}.draw{i}": draws[name] for i, name in enumerate(draws)})
    return out


def _parts_from_arrays(arrays: dict[str, np.ndarray]) -> list[tuple]:
    """The inverse of :func:`_part_arrays`: the same columns, dtypes and values, bit for bit."""
    parts = []
    for j in range(int(arrays["n"])):
        frame = pd.DataFrame({str(c): arrays[f"p{j}.col{i}"] for i, c in enumerate(arrays[f"p{j}.columns"])})
        draws = {str(name): arrays[f"p{j}.draw{i}"] for i, name in enumerate(arrays[f"p{j}.draws"])} if f"p{j}.draws" in arrays else None
        parts.append((tuple(int(x) for x in arrays[f"p{j}.position"]), draws, frame))
    return parts


def _records_meta(af: ActivationFile, variant: Variant, placement: Placement, transposed: bool, caller_threads: int, prefix: int | None = None) -> dict:
    """The metadata of one file's records: model id, weights SHA-256, number of inputs, variant, shard, placement.

    ``eigh_threads`` is the placement's thread count of a CPU ``eigh`` where it sets one, else
    ``caller_threads`` (torch's intra-op threads of the caller).
    Text files add the padding treatment and whether Longformer was read transposed; causal
    files also ``causal`` (True), ``prefix`` (``P``, or None for the full-prefix view),
    ``n_kv_heads`` (the heads of the records) and ``n_query_heads`` (docs/method.md 16.4).
    """
    text = af.attention_mask is not None or af.causal
    meta = {
        "model_id": str(af.attrs["model_id"]),
        "weights_sha256": str(af.attrs["weights_sha256"]),
        "n_sentences" if text else "n_images": len(af.sample_rank),
        "variant": variant.name,
        "shard": int(af.attrs["shard"]),
        "n_shards": int(af.attrs["n_shards"]),
        "eigh_threads": placement.eigh_threads if placement.eigh_threads is not None and placement.eigh_device.type == "cpu" else caller_threads,
        "eigh_device": placement.eigh_device.type,
        "placement": placement.describe(),
    }
    if text:
        meta["padding"] = variant.text_padding
        meta["longformer_transposed"] = bool(transposed)
    if af.causal:
        meta.update(causal=True, prefix=prefix, n_kv_heads=int(af.n_kv_heads), n_query_heads=int(af.attrs["n_heads"]))
    return meta


def _gathered_draws(draw_parts: list[dict[str, np.ndarray]], floor: RunningFloor | None) -> dict:
    """The chunks' solver draws concatenated in record order (name -> float32 ``(heads, R)``), for ``meta``.

    Names: :data:`~kpca_repro.method.uncertainty.SIGN_DRAW_NAMES`, the mean vector,
    :data:`~kpca_repro.method.uncertainty.BOUND_NAMES`, ``RANGE_NAMES`` and, with ``floor``,
    ``MATCHED_BOUND``. With ``floor``, matched draws below its final value are set to NaN
    (:func:`~kpca_repro.method.solver_variation.prune_below_floor`: the stored draws do not depend
    on the workers' order) and the floor and the number of matched draws computed are added.
    """
    names = (*SIGN_DRAW_NAMES, MEAN_VECTOR, *BOUND_NAMES, *RANGE_NAMES, *((MATCHED_BOUND, COLLISION_BOUND) if floor is not None else ()))
    out = {"sign_draws": prune_below_floor({name: np.concatenate([p[name] for p in draw_parts]) for name in names}, floor.value if floor is not None else np.nan)}
    if floor is not None:
        out["matched_draws_floor"] = float(floor.value)
        out["matched_draws_computed"] = int(np.isfinite(out["sign_draws"][OPTIMAL_COS_MEAN]).sum())
    return out


def kpca_records(
    activations: str | os.PathLike,
    variant: str | Variant,
    *,
    placement: Placement | None = None,
    device: str | torch.device = "cpu",
    workers: int = 1,
    eigh_threads: int | str | None = None,
    heads_per_chunk: int = 64,
    seed: int = 0,
    layers: Sequence[int] | None = None,
    progress: bool = True,
    sign_draws: tuple[int, int] | None = None,
    prune_matched_draws: bool = True,
    store: PartStore | None = None,
    prefix: int | None = None,
) -> tuple[pd.DataFrame, dict]:
    """Per-head records of one activation file: every (input, layer, head) through KPCA.

    Vision files (Table 1, docs/method.md 2) are streamed by layer and image block
    (:func:`layer_chunks`; memory grows with neither depth nor the number of images).
    Language-model files (Table 4, docs/method.md 3; recognised by their ``attention_mask``) are
    read a layer at a time and grouped by :func:`_equal_length_groups`, in the variant's
    :meth:`~kpca_repro.method.variant.Variant.reading` of text: the paper variant's has
    ``nlp_value_vectors.py``'s options and all padded positions (Longformer read transposed, as
    the reference reads it); the corrected variant drops padding per sequence (docs/method.md 15).
    Chunks of ``heads_per_chunk`` heads go through :func:`kpca_repro.method.kpca.head_metrics`
    in a plain loop over batches of ``placement.workers`` chunks: with
    ``placement.solve_on_main`` (the paper variant on the CPU) the batch's Gram matrices,
    ``eigh`` and V_KPCA are solved on this thread with ``placement.eigh_threads`` threads
    (the authors' thread count: each head's eigenvectors are then those of the authors'
    per-head loop on the same machine, docs/fidelity.md) while the workers analyse the
    previous batch's chunks (:func:`chunk_records`: comparisons, assignments, draws), one
    thread each. ``placement`` is :func:`kpca_repro.method.placement.plan`'s decision
    for the job (the rule passes it); without one, ``plan(variant, device=device,
    cores=workers, eigh_threads=eigh_threads)``. Each head's numbers depend on the device and
    on ``eigh_threads``, on nothing of the workers, the chunking or the sharding; for
    bit-identical CPU runs keep torch's intra-op threads fixed (the rule uses 1).
    ``sign_draws = (n_direct, n_optimal)`` also draws that many random eigenvector sign
    patterns per head, with rotations inside near-degenerate eigenspaces (seeded by ``seed``
    and the head, :func:`kpca_repro.method.solver_variation.head_solver_draws`; ``direct_cos_max``
    draws only for text files, where Table 4 uses them), and adds the per-head columns
    :data:`kpca_repro.method.solver_variation.HEAD_COLUMNS` (``eigengap_min``, ...). For vision
    files, whose Table 1 takes the maximum over heads, a matched-cosine draw that no replicate
    maximum can use is left NaN (:class:`kpca_repro.method.solver_variation.RunningFloor`); the
    intervals are those of every draw computed (docs/uncertainty.md).
    ``prune_matched_draws=False`` computes every one (to check that claim, and for benchmarks).
    With ``store`` (:class:`kpca_repro.resume.PartStore`, keyed by the job's inputs, parameters
    and code) each finished batch is kept there and a batch already kept is read back instead
    of computed: the records and draws are the same bit for bit (a draw the matched-cosine
    floor would have skipped may be computed, then pruned the same way), and an interrupt
    (``KeyboardInterrupt``) raises :class:`kpca_repro.resume.JobInterrupted` with the count of
    heads kept.
    Decoders' files (``causal``, docs/method.md 16) are read as text with padding excluded in
    both variants, one record per (row, layer, KV head): ``prefix=None`` is the full-prefix view
    (each row's real tokens, the encoder analysis of them), ``prefix=P`` the prefix profile at
    ``P`` (each row's first ``P`` real tokens; rows with fewer left out; all kept rows then
    share ``N = P`` and go through the same chunks). Wherever padding is left out, a row with
    fewer than :data:`MIN_TOKENS` real tokens is left out too, and the count logged (one
    warning per file).
    Steps: :func:`_file_chunks` (the file's chunks with their record positions), per batch
    the solve and :func:`chunk_records` on the workers, then :func:`_records_meta` and, with
    ``sign_draws``, :func:`_gathered_draws`.

    Returns:
        ``(records, meta)``: a DataFrame with one row per head (``sample_rank``,
        ``dataset_index``, ``layer``, ``head``, ``n_tokens``, ``head_dim`` and the metric
        columns) in (layer, input, head) order, and the file's metadata (model id, weights
        SHA-256, number of images or sentences; for text, the padding treatment and whether
        Longformer was read transposed; for causal files ``causal``, ``prefix``, ``n_kv_heads``).
        With ``sign_draws``, ``meta["sign_draws"]`` holds
        the draws (name -> float32 ``(heads, R)``, rows as the records): pop it before
        writing the metadata as JSON. A profile at a ``P`` no row reaches has no records: an
        empty DataFrame with the identifying columns.

    Raises:
        ValueError: ``prefix`` for an encoder's file, or below :data:`MIN_TOKENS`.
        TypeError: ``prefix`` is not an integer.
        kpca_repro.activations.CorruptActivationFileError: the file is unreadable (named).
        kpca_repro.resume.JobInterrupted: interrupted, with ``store`` (its message: heads kept, how to resume).
    """
    from kpca_repro.activations import SEQUENCE_FIRST
    from kpca_repro.progress import progress as progress_bar

    variant = get_variant(variant)
    if placement is None:
        placement = plan(variant, device=device, cores=workers, eigh_threads=eigh_threads)
    with ActivationFile(activations) as af:
        model_id = str(af.attrs["model_id"])
        n_in, n_heads = len(af.sample_rank), af.n_kv_heads
        text = af.attention_mask is not None or af.causal
        check_prefix(prefix)
        if prefix is not None and not af.causal:
            raise ValueError(f"prefix={prefix}: the prefix profile needs a causal (decoder) file; {activations} is an encoder's")
        variant = variant.reading(text, causal=af.causal)
        if text and variant.text_padding == "excluded":  # each row's real tokens: rows too short for any kernel PCA are left out
            lengths = af.attention_mask.sum(axis=1) if af.attention_mask is not None else np.full(n_in, int(af.attrs["n_tokens"]))
            short = int(too_few_tokens(lengths).sum())
            if short:
                _LOG.warning("%s: %d of %d rows have fewer than %d real tokens and are left out (%s)", activations, short, n_in, MIN_TOKENS, FEW_TOKENS_REASON)
            n_in = int((lengths >= (MIN_TOKENS if prefix is None else prefix)).sum())
        transposed = text and variant.text_padding == "included" and str(af.attrs.get("hooked_layout", "")) == SEQUENCE_FIRST
        layer_list = list(layers if layers is not None else range(af.n_layers))
        # Table 1 takes the maximum over heads: draws below the floor cannot matter (Table 4 takes means)
        floor = RunningFloor() if sign_draws and sign_draws[1] and not text and prune_matched_draws else None
        chunks = _file_chunks(af, variant, layer_list, heads_per_chunk, seed, transposed, interleave=floor is not None, prefix=prefix)
        solve_first = placement.solve_on_main and variant.gram == "exp"
        caller_threads = torch.get_num_threads()

        def work(item):
            (position, chunk), solved = item
            return position, *chunk_records(*chunk, variant=variant, placement=placement, sign_draws=sign_draws, seed=seed, floor=floor, solved=solved)

        total = (af.attention_mask.shape[1] if transposed else n_in) * n_heads * len(layer_list)
        parts = []
        try:
            with (
                progress_bar(total=total, desc=f"kpca {variant.name} {model_id}", unit="head", disable=not progress, mininterval=5) as bar,
                # the workers at the lowest priority while this thread's team of eigh threads
                # solves: a worker that preempts one of them stalls every barrier of the eigh
                WorkerPool(placement.workers, placement.blas_threads, background=solve_first) as pool,
            ):

                def finish(index, results, kept=None):
                    """Batch ``index``'s parts: the workers' ``results()`` (then kept in the store) or the ``kept`` ones read back."""
                    if kept is not None:
                        done = _parts_from_arrays(kept)
                        if floor is not None:  # the floor as it stood after this batch: the rest is computed as without the interrupt
                            floor.offer(float(kept["floor"]))
                    else:
                        done = results()
                        if store is not None:
                            store.save(index, {**_part_arrays(done), "floor": np.array(floor.value if floor is not None else np.nan)})
                    parts.extend(done)
                    # heads read back from an interrupted run count as done, not in the rate
                    (bar.update if kept is None else bar.skip)(sum(len(frame) for _, _, frame in done))

                # A pipeline of two batches: this thread reads and solves batch i + 1 (on the
                # variant's thread count) while the workers analyse batch i, so every core stays
                # busy. Each eigh still runs on placement.eigh_threads threads of this thread
                # (torch sets MKL's and OpenMP's counts per thread), so its eigenvectors are those
                # of the same call alone (docs/performance.md#thread-budgets measures it).
                running = None  # (index, results) of the batch on the workers
                for index, batch in enumerate(_batches(chunks, placement.workers)):
                    kept = store.load(index) if store is not None else None
                    solved = None
                    if kept is None:
                        solved = [solve_heads(c[1].to(placement.device), c[2].shape[-1], variant, placement) if solve_first else None for _, c in batch]
                    if running is not None:
                        finish(*running)
                        running = None
                    if kept is not None:
                        finish(index, None, kept)
                    else:
                        running = (index, pool.start(work, zip(batch, solved)))
                if running is not None:
                    finish(*running)
        except KeyboardInterrupt:
            if store is None:
                raise
            heads = sum(len(frame) for _, _, frame in parts)
            raise JobInterrupted(f"interrupted after {heads:,} of {total:,} heads; rerun the same command to resume") from None
        parts.sort(key=lambda part: part[0])
        meta = _records_meta(af, variant, placement, transposed, caller_threads, prefix)
        if sign_draws and parts:
            meta.update(_gathered_draws([draws for _, draws, _ in parts], floor))
    if not parts:  # a prefix no row reaches
        parts = [(None, None, no_records())]
    records = pd.concat([frame for _, _, frame in parts], ignore_index=True)
    records.insert(0, "model", model_id)
    records.insert(1, "variant", variant.name)
    return records, meta


def eigenvalue_records(
    activations: str | os.PathLike,
    variant: str,
    standardize: bool,
    *,
    n_components: int = 64,
    placement: Placement | None = None,
    device: str | torch.device = "cpu",
    heads_per_chunk: int = 64,
    workers: int = 1,
    store: PartStore | None = None,
) -> pd.DataFrame:
    """Per-head top eigenvalues of one activation file (Tables 2 and 3, docs/method.md 4-5).

    Streamed and parallel as :func:`kpca_records` (batches of ``placement.workers`` chunks;
    without ``placement``, ``plan(variant, device=device, cores=workers, sign_invariant=True)``:
    eigenvalues do not depend on eigenvector signs, so a GPU job takes the batched solver).
    With ``store`` (:class:`kpca_repro.resume.PartStore`, keyed by the job's inputs, parameters
    and code) each finished batch is kept there and a batch already kept is read back instead
    of computed, the same values and dtypes bit for bit.

    Returns:
        One row per (image, layer, head): ``sample_rank, dataset_index, layer, head,
        finite`` and ``lambda_01 .. lambda_<n>`` (``|lambda_r|``, descending, NaN where the
        paper variant overflows).

    Raises:
        kpca_repro.activations.CorruptActivationFileError: the file is unreadable (named).
        kpca_repro.resume.JobInterrupted: interrupted, with ``store`` (its message: heads kept, how to resume).
    """
    if placement is None:
        placement = plan(variant, device=device, cores=workers, eigh_threads=None, sign_invariant=True)
    with ActivationFile(activations) as af:
        n_heads = int(af.attrs["n_heads"])
        n_components = clamp_components(n_components, int(af.read(0, ("k",), images=slice(0, 1))["k"].shape[-2]), "spectra.n_components")

        def work(chunk):
            layer, flat, t = chunk
            with device_stream(placement.device, placement.streams):
                evals, finite = top_eigenvalues(t["k"].to(placement.device), n_components, variant, standardize, placement=placement)
            frame = pd.DataFrame(evals.cpu().numpy(), columns=[f"lambda_{r + 1:02d}" for r in range(n_components)])
            frame.insert(0, "finite", finite.cpu().numpy())
            frame.insert(0, "head", flat % n_heads)
            frame.insert(0, "layer", layer)
            frame.insert(0, "dataset_index", af.dataset_index[flat // n_heads])
            frame.insert(0, "sample_rank", af.sample_rank[flat // n_heads])
            return frame

        frames: list[pd.DataFrame] = []
        try:
            with WorkerPool(placement.workers, placement.blas_threads) as pool:
                for index, batch in enumerate(_batches(layer_chunks(af, range(af.n_layers), heads_per_chunk, ("k",)), placement.workers)):
                    kept = store.load(index) if store is not None else None
                    if kept is not None:
                        done = [frame for _, _, frame in _parts_from_arrays(kept)]
                    else:
                        done = list(pool.imap(work, batch))
                        if store is not None:
                            store.save(index, _part_arrays([((j,), None, frame) for j, frame in enumerate(done)]))
                    frames.extend(done)
        except KeyboardInterrupt:
            if store is None:
                raise
            total = len(af.sample_rank) * n_heads * af.n_layers
            raise JobInterrupted(f"interrupted after {sum(map(len, frames)):,} of {total:,} heads; rerun the same command to resume") from None
        model_id = str(af.attrs["model_id"])
    out = pd.concat(frames, ignore_index=True)
    out.insert(0, "keys", "standardized" if standardize else "raw")
    out.insert(0, "variant", get_variant(variant).name)
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
    placement: Placement | None = None,
    device: str | torch.device = "cpu",
) -> pd.DataFrame:
    """Figure 3's gamma-constancy statistics for every head of one layer (docs/method.md Section 10).

    The keys of every (image, head) of ``layer`` go through :func:`kpca_repro.method.kpca.gamma_test`
    as one batch, with one perturbation generator seeded by ``seed``.

    Args:
        activations: HDF5 activation file of the extraction (:class:`kpca_repro.activations.ActivationFile`);
            its keys have shape ``(images, heads, N, d)`` per layer (float32 on disk).
        layer: 0-based transformer block (``figure3.block``).
        variant: ``"paper"`` or ``"corrected"``.
        standardize: standardize each key vector before the Gram matrix (``figure3.standardize``).
        noise: standard deviation of the eigenvector perturbation (``figure3.noise``).
        seed: seed of the CPU ``torch.Generator`` of the perturbation.
        n_components: number of eigenvectors tested per head (``figure3.n_components``); all ``N``
            when a head has fewer tokens (:func:`clamp_components`).
        placement: where the Gram matrices and eigenpairs are computed (default:
            ``plan(variant, device=device, sign_invariant=True)``, the batched solver on a GPU).
        device: used when ``placement`` is None.

    Returns:
        Long table: ``sample_rank, head, eigenvectors ("true" | "perturbed"), component,
        abs_mean, abs_std, rel_mean, rel_std``; one row per (image, head, kind, component),
        the four statistics as float64, ``sample_rank`` the images' draw ranks from the file.

    Raises:
        ValueError: ``layer`` is not a layer of the model.
        kpca_repro.activations.CorruptActivationFileError: the file is unreadable (named).
    """
    with ActivationFile(activations) as af:
        if not 0 <= layer < af.n_layers:
            raise ValueError(f"figure3.block {layer} is out of range: {af.attrs['model_id']} has {af.n_layers} blocks")
        k = torch.from_numpy(af.read(layer, ("k",))["k"])
        ranks = af.sample_rank
    n_img, n_heads = k.shape[:2]
    n_components = clamp_components(n_components, int(k.shape[-2]), "figure3.n_components")
    if placement is None:
        placement = plan(variant, device=device, eigh_threads=None, sign_invariant=True)
    result = gamma_test(k.reshape(-1, *k.shape[2:]).to(placement.device), n_components, variant, standardize, noise, torch.Generator().manual_seed(seed), placement=placement)
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
