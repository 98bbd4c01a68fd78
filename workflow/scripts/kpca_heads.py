"""Rule kpca_heads: per-head KPCA records (paper or corrected variant) of one activation file (vision or text)."""

import json
import os

import numpy as np
import torch

from kpca_repro.h5io import atomic_output
from kpca_repro.method.placement import plan
from kpca_repro.method.records import kpca_records
from kpca_repro.method.uncertainty import MEAN_VECTOR, SIGN_DRAW_NAMES, write_sign_draws
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "kpca_heads")
# One intra-op thread per worker, each worker on its own chunk of heads and holding one of the
# job's cores; the paper variant's eigh and per-head products widen to kpca.eigh_threads (the
# authors' thread count) inside that budget (kpca_repro.method.placement).
torch.set_num_threads(1)
placement = plan(
    smk.wildcards.variant,
    device=smk.params.device,
    cores=smk.threads,
    eigh_threads=smk.params.eigh_threads,
    gpu_eigensolver=smk.params.gpu_eigensolver,
)
log.info("placement: %s", placement.describe())
records, meta = kpca_records(
    smk.input.activations,
    smk.wildcards.variant,
    placement=placement,
    heads_per_chunk=smk.params.heads_per_chunk,
    seed=smk.params.seed,
    sign_draws=tuple(smk.params.sign_draws) if any(smk.params.sign_draws) else None,
)
# per-head solver draws (signs and rotations), rows as the records CSV (the corrected variant's signs are fixed: none)
draws = meta.pop("sign_draws", None) or {name: np.empty((len(records), 0), np.float32) for name in (*SIGN_DRAW_NAMES, MEAN_VECTOR)}
log.info(
    "%d heads, %d dropped, eigh on %s%s, at most %d of %d cores at once, OpenMP spin count %s",
    len(records),
    int(records["dropped"].sum()),
    meta["eigh_device"],
    f" ({meta['eigh_threads']} threads)" if meta["eigh_device"] == "cpu" else "",
    placement.budget.peak,
    placement.budget.cores,
    os.environ.get("GOMP_SPINCOUNT", "libgomp's default"),
)
if "matched_draws_computed" in meta:
    log.info("matched-cosine draws kept: %d of %d (the others cannot be a replicate maximum: floor %.6f)", meta["matched_draws_computed"], draws["optimal_cos_mean"].size, meta["matched_draws_floor"])
with atomic_output(smk.output.heads) as tmp:
    records.to_csv(tmp, index=False)
with atomic_output(smk.output.signs) as tmp:
    write_sign_draws(tmp, draws, {"seed": smk.params.seed, "n_heads": len(records), "variant": smk.wildcards.variant})
with atomic_output(smk.output.meta) as tmp:
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
