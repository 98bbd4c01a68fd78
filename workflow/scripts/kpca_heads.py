"""Rule kpca_heads: per-head KPCA records (paper or corrected variant) of one activation file (vision or text)."""

import json
import os
from pathlib import Path

import torch

from kpca_repro.h5io import atomic_output
from kpca_repro.method.placement import plan
from kpca_repro.method.records import KpcaJob, kpca_records
from kpca_repro.method.uncertainty import OPTIMAL_COS_MEAN, write_sign_draws
from kpca_repro.smk import check_writable, process_usage, setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "kpca_heads")
# One intra-op thread per worker, each worker on its own chunk of heads; the paper variant's eigh
# and per-head products run before them on kpca.eigh_threads (the authors' thread count).
torch.set_num_threads(1)
placement = plan(
    smk.wildcards.variant,
    device=smk.params.device,
    cores=smk.threads,
    eigh_threads=smk.params.eigh_threads,
    gpu_eigensolver=smk.params.gpu_eigensolver,
)
log.info("placement: %s", placement.describe())
job = KpcaJob(
    smk.wildcards.variant,
    placement,
    heads_per_chunk=smk.params.heads_per_chunk,
    seed=smk.params.seed,
    # (0, 0, 0): none (the corrected variant's signs are fixed; the prefix profile)
    sign_draws=smk.params.sign_draws[:2],
    matched_draws_text=smk.params.sign_draws[2],
    # None: every token; rule kpca_prefix: each row's first P real tokens (docs/method.md 16)
    prefix=smk.params.prefix,
    progress=True,
)
# Finished batches are kept beside the output until it is written: a rerun after an interrupt, a
# kill or a preemption goes on from them (kpca_repro.resume); another input, parameter or code starts afresh.
parts = Path(smk.output.heads).with_suffix(".parts")
check_writable([parts / "key.json"])
job = job.with_store(parts, smk.input.activations, dict(smk.params.items()))
if len(job.store):
    log.info("resuming from %d kept batches in %s", len(job.store), parts)
# per-head solver draws (signs and rotations), rows as the records CSV
records, meta, draws = kpca_records(smk.input.activations, job)
log.info(
    "%d heads, %d dropped, eigh on %s%s, OpenMP spin count %s",
    len(records),
    int(records["dropped"].sum()) if "dropped" in records else 0,  # a prefix longer than every row: no records
    meta["eigh_device"],
    f" ({meta['eigh_threads']} threads)" if meta["eigh_device"] == "cpu" else "",
    os.environ.get("GOMP_SPINCOUNT", "libgomp's default"),
)
if "matched_draws_computed" in meta:
    kept, floor, drawn = meta["matched_draws_computed"], meta["matched_draws_floor"], draws[OPTIMAL_COS_MEAN].size
    log.info("matched-cosine draws kept: %d of %d (the others cannot be a replicate maximum: floor %.6f)", kept, drawn, floor)
with atomic_output(smk.output.heads) as tmp:
    records.to_csv(tmp, index=False)
with atomic_output(smk.output.signs) as tmp:
    write_sign_draws(tmp, draws, {"seed": smk.params.seed, "n_heads": len(records), "variant": smk.wildcards.variant})
with atomic_output(smk.output.meta) as tmp:
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
job.store.remove()
log.info(process_usage())
