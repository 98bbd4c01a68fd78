"""Rule eigenvalues_vision: per-head top eigenvalues (standardized or raw keys) of one activation file."""

from pathlib import Path

import torch

from kpca_repro.h5io import atomic_output
from kpca_repro.method.placement import plan
from kpca_repro.method.records import eigenvalue_records
from kpca_repro.resume import PartStore, file_identity
from kpca_repro.smk import check_writable, setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "eigenvalues_vision")
# One intra-op thread and `threads` worker threads, each on its own chunk of heads: every
# head's numbers are then the same whatever threads, heads_per_chunk or shards say. Eigenvalues do
# not depend on eigenvector signs: on a GPU the batched solver (kpca.gpu_eigensolver).
torch.set_num_threads(1)
placement = plan(smk.wildcards.variant, device=smk.params.device, cores=smk.threads, eigh_threads=None, gpu_eigensolver=smk.params.gpu_eigensolver, sign_invariant=True)
log.info("placement: %s", placement.describe())
# finished batches kept beside the output until it is written, as in kpca_heads (kpca_repro.resume)
parts = Path(smk.output[0]).with_suffix(".parts")
check_writable([parts / "key.json"])
key = {"activations": file_identity(smk.input.activations), "wildcards": dict(smk.wildcards.items()), "params": dict(smk.params.items()), "placement": placement.describe()}
store = PartStore(parts, key)
if len(store):
    log.info("resuming from %d kept batches in %s", len(store), parts)
records = eigenvalue_records(
    smk.input.activations,
    smk.wildcards.variant,
    smk.wildcards.keyset == "standardized",
    n_components=smk.params.n_components,
    placement=placement,
    heads_per_chunk=smk.params.heads_per_chunk,
    store=store,
)
log.info("%d heads, %d non-finite", len(records), int((~records["finite"]).sum()))
with atomic_output(smk.output[0]) as tmp:
    records.to_csv(tmp, index=False)
store.remove()
