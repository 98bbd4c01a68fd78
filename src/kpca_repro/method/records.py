"""Stage 2: per-head records from activation files: KPCA metrics (Tables 1 and 4),
eigenvalues (Tables 2 and 3) and the gamma test (Figure 3).

Rule scripts call these; tests call them too. The mathematics itself lives in
:mod:`kpca_repro.method.kpca`; extraction (stage 1) in :mod:`kpca_repro.capture.extraction`.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from kpca_repro.activations import ActivationFile
from kpca_repro.method.equations import all_directions_kept
from kpca_repro.method.heads import (
    FEW_TOKENS_REASON,
    MIN_TOKENS,
    FileHeads,
    HeadSource,
    baseline_noise,
    check_prefix,
    layer_chunks,
    no_records,
    projection_test_wanted,
    too_few_tokens,
)
from kpca_repro.method.job import KpcaJob
from kpca_repro.method.kpca import gamma_test, head_metrics, solve_heads, top_eigenvalues
from kpca_repro.method.placement import Placement, plan
from kpca_repro.method.solver_variation import RunningFloor, head_solver_draws, prune_below_floor
from kpca_repro.method.uncertainty import (
    BOUND_NAMES,
    COLLISION_BOUND,
    MATCHED_BOUND,
    MEAN_VECTOR,
    OPTIMAL_COS_MEAN,
    RANGE_NAMES,
    SIGN_DRAW_NAMES,
)
from kpca_repro.method.variant import Variant
from kpca_repro.method.variant import get as get_variant
from kpca_repro.resume import JobInterrupted, PartStore
from kpca_repro.workers import WorkerPool, device_stream

__all__ = [
    "kpca_records",
    "KpcaJob",
    "chunk_records",
    "no_draws",
    "eigenvalue_records",
    "gamma_records",
    "clamp_components",
    # re-exported from kpca_repro.method.heads, where they live
    "baseline_noise",
    "layer_chunks",
    "MIN_TOKENS",
    "FEW_TOKENS_REASON",
    "too_few_tokens",
    "check_prefix",
    "no_records",
    "projection_test_wanted",
]

_LOG = logging.getLogger("kpca_repro.records")


def clamp_components(n_components: int, n_tokens: int, key: str) -> int:
    """``n_components`` eigenpairs, or all ``n_tokens`` of them when fewer exist (logged: the config key, both numbers).

    A head of ``N`` tokens has ``N`` eigenvalues: Tables 2-3 and Figure 3 of a model with
    fewer tokens than ``spectra.n_components`` / ``figure3.n_components`` keep all ``N``.
    """
    if n_components <= n_tokens:
        return n_components
    _LOG.warning(
        "config key %s is %d but the heads have %d tokens, so %d eigenpairs: keeping all %d",
        key,
        n_components,
        n_tokens,
        n_tokens,
        n_tokens,
    )
    return n_tokens


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
    job: KpcaJob,
    floor: RunningFloor | None = None,
    solved: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, np.ndarray] | None, pd.DataFrame]:
    """Per-head records of one chunk of heads (``k``, ``v``: ``(heads, N, d)``; ``ranks``, ``index``, ``head``:
    ``(heads,)``; ``base``: the corrected variant's random baselines):
    :func:`kpca_repro.method.kpca.head_metrics` as ``variant`` (the source's reading of the job's,
    :meth:`~kpca_repro.method.variant.Variant.reading`) and ``job.placement`` say, and with ``q``, ``h``
    (``(heads, G, M, d)``) the projection test, and with ``job.sign_draws`` the solver draws seeded by
    ``job.seed`` (:func:`kpca_repro.method.solver_variation.head_solver_draws`; with ``floor``,
    matched-cosine draws that cannot be a replicate maximum are skipped) and their per-head columns.
    ``solved``: the chunk's :func:`kpca_repro.method.kpca.solve_heads`, when the caller solved it
    already. The one per-chunk step of :func:`kpca_records` (and so of
    :func:`kpca_repro.method.api.analyze_heads`).

    Returns:
        ``(draws or None, records)``, one record row per head.
    """
    placement = job.placement
    rows = {} if job.draws_wanted else None
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
    if job.draws_wanted:
        nan_zero = variant.nan_cost_to_zero
        # signs and rotations inside near-degenerate eigenspaces (docs/uncertainty.md); Table 4 takes the token maximum
        draws, gap_cols = head_solver_draws(
            rows, {"layer": layer, "sample_rank": ranks, "dataset_index": index, "head": head},
            seed=job.seed,
            n_direct=job.sign_draws[0],
            n_optimal=job.matched_draws(variant.text),
            token_max=variant.text,
            order=variant.order,
            valid=None if nan_zero else torch.from_numpy(~cols["dropped"]), nan_to_zero=nan_zero,
            own_optimal=cols["optimal_cos_mean"], floor=floor,
        )  # fmt: skip
        cols = {**cols, **gap_cols}
    frame = pd.DataFrame(
        {
            "sample_rank": ranks,
            "dataset_index": index,
            "layer": layer,
            "head": head,
            "n_tokens": k.shape[1],
            "head_dim": v.shape[2],
            **cols,
        }
    )
    # the regime where the kept eigenvectors span the whole centered space (docs/method.md 17.1)
    n_components = min(v.shape[2], k.shape[1])
    frame["n_centered_directions"] = k.shape[1] - 1
    frame["n_components"] = n_components
    frame["all_directions_kept"] = all_directions_kept(k.shape[1], n_components)
    return draws, frame


#: Batches of chunks queued on a KPCA job's workers at once (:func:`_analysed_parts`): the main
#: thread solves the next batch while they analyse these; each holds ``workers`` chunks of solved heads.
_IN_FLIGHT = 2


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
    """One batch's ``(position, draws or None, frame)`` parts as plain arrays, for a
    :class:`~kpca_repro.resume.PartStore`."""
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
        draws = (
            {str(name): arrays[f"p{j}.draw{i}"] for i, name in enumerate(arrays[f"p{j}.draws"])}
            if f"p{j}.draws" in arrays
            else None
        )
        parts.append((tuple(int(x) for x in arrays[f"p{j}.position"]), draws, frame))
    return parts


def _records_meta(
    source: HeadSource,
    reading: _Reading,
    placement: Placement,
    caller_threads: int,
    prefix: int | None,
) -> dict:
    """The metadata of one source's records: the source's own (:meth:`~kpca_repro.method.heads.HeadSource.describe`:
    model id and, for a file, weights SHA-256 and shard), number of inputs, variant, placement.

    ``eigh_threads`` is the placement's thread count of a CPU ``eigh`` where it sets one, else
    ``caller_threads`` (torch's intra-op threads of the caller).
    Text sources add the padding treatment and whether Longformer was read transposed; causal
    ones also ``causal`` (True), ``prefix`` (``P``, or None for the full-prefix view),
    ``n_kv_heads`` (the heads of the records) and ``n_query_heads`` (docs/method.md 16.4).
    """
    cpu_threads = placement.eigh_threads is not None and placement.eigh_device.type == "cpu"
    meta = {
        **source.describe(),
        "n_sentences" if source.text else "n_images": len(source.sample_rank),
        "variant": reading.variant.name,
        "eigh_threads": placement.eigh_threads if cpu_threads else caller_threads,
        "eigh_device": placement.eigh_device.type,
        "placement": placement.describe(),
    }
    if source.text:
        meta["padding"] = reading.variant.text_padding
        meta["longformer_transposed"] = bool(reading.transposed)
    if source.causal:
        meta.update(causal=True, prefix=prefix, n_kv_heads=int(source.n_kv_heads), n_query_heads=int(source.n_heads))
    return meta


def no_draws(n_heads: int) -> dict[str, np.ndarray]:
    """The draws of a job without solver draws: each sign draw and the mean vector, float32 ``(n_heads, 0)``."""
    return {name: np.empty((n_heads, 0), np.float32) for name in (*SIGN_DRAW_NAMES, MEAN_VECTOR)}


def _gathered_draws(draw_parts: list[dict[str, np.ndarray]], floor: RunningFloor | None) -> tuple[dict, dict]:
    """The chunks' solver draws concatenated in record order (name -> float32 ``(heads, R)``), and their metadata.

    Names: :data:`~kpca_repro.method.uncertainty.SIGN_DRAW_NAMES`, the mean vector,
    :data:`~kpca_repro.method.uncertainty.BOUND_NAMES`, ``RANGE_NAMES`` and, with ``floor``,
    ``MATCHED_BOUND``. With ``floor``, matched draws below its final value are set to NaN
    (:func:`~kpca_repro.method.solver_variation.prune_below_floor`: the stored draws do not depend
    on the workers' order) and the metadata holds the floor and the number of matched draws computed.
    """
    bounds = (MATCHED_BOUND, COLLISION_BOUND) if floor is not None else ()
    names = (*SIGN_DRAW_NAMES, MEAN_VECTOR, *BOUND_NAMES, *RANGE_NAMES, *bounds)
    joined = {name: np.concatenate([p[name] for p in draw_parts]) for name in names}
    draws = prune_below_floor(joined, floor.value if floor is not None else np.nan)
    if floor is None:
        return draws, {}
    computed = int(np.isfinite(draws[OPTIMAL_COS_MEAN]).sum())
    return draws, {"matched_draws_floor": float(floor.value), "matched_draws_computed": computed}


class _Reading(NamedTuple):
    """How one job reads its source: the variant's reading, Longformer transposed, the layers, the
    floor of the matched-cosine draws (or None), the heads in all (the progress bar's total)."""

    variant: Variant
    transposed: bool
    layers: list[int]
    floor: RunningFloor | None
    total: int


def _reading(source: HeadSource, job: KpcaJob) -> _Reading:
    """The job's reading of ``source`` (:class:`_Reading`); logs the rows left out for too few real tokens.

    Raises:
        ValueError: ``job.prefix`` for heads that are not causal.
    """
    if job.prefix is not None and not source.causal:
        why = "the prefix profile is of causal (decoder) heads"
        raise ValueError(f"prefix={job.prefix}: {why}; {source.name} holds an encoder's")
    text = source.text
    variant = job.variant.reading(text, causal=source.causal)
    n_in = len(source.sample_rank)
    # each row's real tokens: rows too short for any kernel PCA are left out
    if text and variant.text_padding == "excluded":
        lengths = source.real_tokens()
        short = int(too_few_tokens(lengths).sum())
        if short:
            message = "%s: %d of %d rows have fewer than %d real tokens and are left out (%s)"
            _LOG.warning(message, source.name, short, n_in, MIN_TOKENS, FEW_TOKENS_REASON)
        n_in = int((lengths >= (MIN_TOKENS if job.prefix is None else job.prefix)).sum())
    transposed = text and variant.text_padding == "included" and source.sequence_first
    layers = list(job.layers if job.layers is not None else source.layers)
    # Table 1 takes the maximum over heads: draws below the floor cannot matter (Table 4 takes means)
    floor = RunningFloor() if job.sign_draws[1] and not text and job.prune_matched_draws else None
    total = (source.attention_mask.shape[1] if transposed else n_in) * source.n_kv_heads * len(layers)
    return _Reading(variant, transposed, layers, floor, total)


def _analysed_parts(source: HeadSource, job: KpcaJob, reading: _Reading) -> list[tuple]:
    """Every chunk of ``source`` through :func:`chunk_records`: ``(position, draws or None, frame)`` parts, unsorted.

    A pipeline of batches of ``placement.workers`` chunks, up to :data:`_IN_FLIGHT` of them on the
    workers (:func:`kpca_records`); with ``job.store``, each finished batch kept and a kept one read back.

    Raises:
        kpca_repro.resume.JobInterrupted: interrupted, with a store (its message: heads kept, how to resume).
    """
    from kpca_repro.progress import progress as progress_bar

    variant, floor, placement, store = reading.variant, reading.floor, job.placement, job.store
    interleave = floor is not None
    chunks = source.chunks(
        variant,
        reading.layers,
        job.heads_per_chunk,
        job.seed,
        reading.transposed,
        interleave,
        job.prefix,
    )
    solve_first = placement.solve_on_main and variant.gram == "exp"

    def work(item):
        (position, chunk), solved = item
        return position, *chunk_records(*chunk, variant=variant, job=job, floor=floor, solved=solved)

    parts: list[tuple] = []
    desc = f"kpca {variant.name} {source.model_id}"
    try:
        with (
            progress_bar(total=reading.total, desc=desc, unit="head", disable=not job.progress, mininterval=5) as bar,
            # the workers at the lowest priority while this thread's team of eigh threads
            # solves: a worker that preempts one of them stalls every barrier of the eigh
            WorkerPool(placement.workers, placement.blas_threads, background=solve_first) as pool,
        ):

            def finish(index, results, kept=None):
                """Batch ``index``'s parts: the workers' ``results()`` (then kept in the store) or the
                ``kept`` ones read back."""
                if kept is not None:
                    done = _parts_from_arrays(kept)
                    # the floor as it stood after this batch: the rest is computed as without the interrupt
                    if floor is not None:
                        floor.offer(float(kept["floor"]))
                else:
                    done = results()
                    if store is not None:
                        floor_now = np.array(floor.value if floor is not None else np.nan)
                        store.save(index, {**_part_arrays(done), "floor": floor_now})
                parts.extend(done)
                # heads read back from an interrupted run count as done, not in the rate
                (bar.update if kept is None else bar.skip)(sum(len(frame) for _, _, frame in done))

            # A pipeline: this thread reads and solves the next batch (on the variant's thread
            # count) while the workers analyse up to _IN_FLIGHT earlier ones, queued, so that a
            # worker done with its chunk takes the next batch's instead of waiting for the other
            # worker at the end of every batch. Each eigh still runs on placement.eigh_threads
            # threads of this thread (torch sets MKL's and OpenMP's counts per thread), so its
            # eigenvectors are those of the same call alone (docs/performance.md#thread-budgets).
            running: deque = deque()  # (index, results) of the batches on the workers, in order
            for index, batch in enumerate(_batches(chunks, placement.workers)):
                kept = store.load(index) if store is not None else None
                solved = None
                if kept is None:
                    solved = [_solved(c, variant, placement) if solve_first else None for _, c in batch]
                while running and (kept is not None or len(running) >= _IN_FLIGHT):
                    finish(*running.popleft())
                if kept is not None:
                    finish(index, None, kept)
                else:
                    running.append((index, pool.start(work, zip(batch, solved))))
            while running:
                finish(*running.popleft())
    except KeyboardInterrupt:
        if store is None:
            raise
        heads = sum(len(frame) for _, _, frame in parts)
        done = f"interrupted after {heads:,} of {reading.total:,} heads"
        raise JobInterrupted(f"{done}; rerun the same command to resume") from None
    return parts


def _solved(chunk: tuple, variant: Variant, placement: Placement) -> dict[str, torch.Tensor]:
    """The chunk's Gram matrices, eigenpairs and V_KPCA (:func:`kpca_repro.method.kpca.solve_heads`), on this thread."""
    return solve_heads(chunk[1].to(placement.device), chunk[2].shape[-1], variant, placement)


def kpca_records(
    activations: str | os.PathLike | HeadSource,
    job: KpcaJob | str | None = None,
) -> tuple[pd.DataFrame, dict, dict[str, np.ndarray]]:
    """Per-head records of one head source: every (input, layer, head) through KPCA, as ``job`` says.

    ``activations`` is an activation file's path (read as :class:`~kpca_repro.method.heads.FileHeads`)
    or any :class:`~kpca_repro.method.heads.HeadSource` (arrays in memory:
    :class:`~kpca_repro.method.heads.HeadArrays`); ``job`` a
    :class:`~kpca_repro.method.job.KpcaJob` (a variant name: that variant's default job; None:
    the paper variant's). The notebook API (:func:`kpca_repro.method.api.analyze_heads`) runs
    this same loop.

    Vision heads (Table 1, docs/method.md 2) are streamed by layer and image block
    (:func:`~kpca_repro.method.heads.layer_chunks`; memory grows with neither depth nor the
    number of images). Language-model heads (Table 4, docs/method.md 3; recognised by their
    ``attention_mask``) are read a layer at a time and grouped by real-token count
    (:meth:`~kpca_repro.method.heads.HeadSource.chunks`), in the variant's
    :meth:`~kpca_repro.method.variant.Variant.reading` of text: the paper variant's has
    ``nlp_value_vectors.py``'s options and all padded positions (Longformer read transposed, as
    the reference reads it); the corrected variant drops padding per sequence (docs/method.md 15).
    Chunks of ``job.heads_per_chunk`` heads go through :func:`kpca_repro.method.kpca.head_metrics`
    in a plain loop over batches of ``placement.workers`` chunks: with
    ``placement.solve_on_main`` (the paper variant on the CPU) the batch's Gram matrices,
    ``eigh`` and V_KPCA are solved on this thread with ``placement.eigh_threads`` threads
    (the authors' thread count: each head's eigenvectors are then those of the authors'
    per-head loop on the same machine, docs/fidelity.md) while the workers analyse the
    previous batches' chunks (:func:`chunk_records`: comparisons, assignments, draws), one
    thread each. Each head's numbers depend on the device and on ``eigh_threads``, on nothing
    of the workers, the chunking or the sharding; for bit-identical CPU runs keep torch's
    intra-op threads fixed (the rule uses 1).
    ``job.sign_draws = (n_direct, n_optimal)`` also draws that many random eigenvector sign
    patterns per head, with rotations inside near-degenerate eigenspaces (seeded by ``job.seed``
    and the head, :func:`kpca_repro.method.solver_variation.head_solver_draws`; ``direct_cos_max``
    draws only for text, where Table 4 uses them), and adds the per-head columns
    :data:`kpca_repro.method.solver_variation.HEAD_COLUMNS` (``eigengap_min``, ...). For vision
    heads, whose Table 1 takes the maximum over heads, a matched-cosine draw that no replicate
    maximum can use is left NaN (:class:`kpca_repro.method.solver_variation.RunningFloor`) unless
    ``job.prune_matched_draws`` is False; the intervals are those of every draw computed
    (docs/uncertainty.md).
    With ``job.store`` (:class:`kpca_repro.resume.PartStore`, :meth:`KpcaJob.with_store`) each
    finished batch is kept there and a batch already kept is read back instead of computed: the
    records and draws are the same bit for bit (a draw the matched-cosine floor would have
    skipped may be computed, then pruned the same way), and an interrupt (``KeyboardInterrupt``)
    raises :class:`kpca_repro.resume.JobInterrupted` with the count of heads kept.
    Decoders' heads (``causal``, docs/method.md 16) are read as text with padding excluded in
    both variants, one record per (row, layer, KV head): ``job.prefix=None`` is the full-prefix
    view (each row's real tokens, the encoder analysis of them), ``prefix=P`` the prefix profile
    at ``P`` (each row's first ``P`` real tokens; rows with fewer left out; all kept rows then
    share ``N = P`` and go through the same chunks). Wherever padding is left out, a row with
    fewer than :data:`MIN_TOKENS` real tokens is left out too, and the count logged (one
    warning per source).

    Returns:
        ``(records, meta, draws)``: a DataFrame with one row per head (``model``, ``variant``,
        ``sample_rank``, ``dataset_index``, ``layer``, ``head``, ``n_tokens``, ``head_dim`` and
        the metric columns) in (layer, input, head) order; the source's metadata (model id,
        weights SHA-256, number of images or sentences; for text, the padding treatment and
        whether Longformer was read transposed; for causal sources ``causal``, ``prefix``,
        ``n_kv_heads``; with pruned draws ``matched_draws_floor`` and
        ``matched_draws_computed``), JSON-serialisable; and the solver draws, name -> float32
        ``(heads, R)`` with rows as the records (:func:`no_draws`, ``R = 0``, without
        ``job.sign_draws``). A profile at a ``P`` no row reaches has no records: an empty
        DataFrame with the identifying columns.

    Raises:
        ValueError: ``job.prefix`` for an encoder's heads.
        kpca_repro.activations.CorruptActivationFileError: the file is unreadable (named).
        kpca_repro.resume.JobInterrupted: interrupted, with ``job.store`` (its message: heads kept, how to resume).
    """
    job = KpcaJob.of(job)
    if isinstance(activations, HeadSource):
        return _source_records(activations, job)
    with ActivationFile(activations) as af:
        return _source_records(FileHeads(af, name=str(activations)), job)


def _source_records(source: HeadSource, job: KpcaJob) -> tuple[pd.DataFrame, dict, dict[str, np.ndarray]]:
    """:func:`kpca_records` of an open source: :func:`_reading`, :func:`_analysed_parts`, then the records,
    :func:`_records_meta` and :func:`_gathered_draws` (or :func:`no_draws`)."""
    caller_threads = torch.get_num_threads()
    reading = _reading(source, job)
    parts = sorted(_analysed_parts(source, job, reading), key=lambda part: part[0])
    meta = _records_meta(source, reading, job.placement, caller_threads, job.prefix)
    draws = None
    if job.draws_wanted and parts:
        draws, draw_meta = _gathered_draws([d for _, d, _ in parts], reading.floor)
        meta.update(draw_meta)
    frames = [frame for _, _, frame in parts] or [no_records()]  # no part: a prefix no row reaches
    records = pd.concat(frames, ignore_index=True)
    records.insert(0, "model", source.model_id)
    records.insert(1, "variant", reading.variant.name)
    return records, meta, draws if draws is not None else no_draws(len(records))


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
        n_components = clamp_components(
            n_components, int(af.read(0, ("k",), images=slice(0, 1))["k"].shape[-2]), "spectra.n_components"
        )

        def work(chunk):
            layer, flat, t = chunk
            with device_stream(placement.device, placement.streams):
                evals, finite = top_eigenvalues(
                    t["k"].to(placement.device), n_components, variant, standardize, placement=placement
                )
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
                for index, batch in enumerate(
                    _batches(layer_chunks(af, range(af.n_layers), heads_per_chunk, ("k",)), placement.workers)
                ):
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
            raise JobInterrupted(
                f"interrupted after {sum(map(len, frames)):,} of {total:,} heads; rerun the same command to resume"
            ) from None
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
    result = gamma_test(
        k.reshape(-1, *k.shape[2:]).to(placement.device),
        n_components,
        variant,
        standardize,
        noise,
        torch.Generator().manual_seed(seed),
        placement=placement,
    )
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
