"""Rules norms_vision, norms_text: per-layer statistics of ||phi(q_i)||^2 and ||h_i||^2 of one model."""

import os

import torch

from kpca_repro.analysis.columns import metadata_json
from kpca_repro.analysis.norms import norm_statistics
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging
from kpca_repro.threads import resolve_threads

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "norm_stats")
torch.set_num_threads(resolve_threads(smk.params.intra_op_threads, "kpca.intra_op_threads"))
log.info("torch intra-op threads: %d", torch.get_num_threads())
stats = norm_statistics(list(smk.input.activations), smk.wildcards.variant, language=smk.params.language)
log.info("%s: %d layers from %d file(s)", smk.wildcards.model, stats["layer"].nunique(), len(smk.input.activations))
title = f"Squared norms per layer, {smk.wildcards.variant} variant: {smk.wildcards.model}, {os.path.basename(smk.output.csv)}"
columns = metadata_json(stats, "norms", os.path.basename(smk.output.csv), title)  # every column described, or the job stops here
with atomic_output(smk.output.csv) as tmp:
    stats.to_csv(tmp, index=False)
with atomic_output(smk.output.columns) as tmp:
    tmp.write_text(columns)
