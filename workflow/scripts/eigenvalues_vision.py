"""Rule eigenvalues_vision: per-head top eigenvalues (standardized or raw keys) of one activation file."""

import torch

from kpca_repro.h5io import atomic_output
from kpca_repro.method.records import eigenvalue_records
from kpca_repro.smk import setup_logging
from kpca_repro.threads import resolve_device

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "eigenvalues_vision")
# One intra-op thread and `threads` worker threads, each on its own chunk of heads: every
# head's numbers are then the same whatever threads, heads_per_chunk or shards say.
torch.set_num_threads(1)
records = eigenvalue_records(
    smk.input.activations,
    smk.wildcards.variant,
    smk.wildcards.keyset == "standardized",
    n_components=smk.params.n_components,
    device=resolve_device(smk.params.device),
    heads_per_chunk=smk.params.heads_per_chunk,
    workers=smk.threads,
)
log.info("%d heads, %d non-finite", len(records), int((~records["finite"]).sum()))
with atomic_output(smk.output[0]) as tmp:
    records.to_csv(tmp, index=False)
