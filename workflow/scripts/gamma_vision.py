"""Rule gamma_vision: Figure 3's gamma-constancy statistics for the configured model and block."""

import sys

import torch

from kpca_repro.h5io import atomic_output
from kpca_repro.method.placement import plan
from kpca_repro.method.records import gamma_records
from kpca_repro.smk import setup_logging
from kpca_repro.threads import resolve_threads

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "gamma_vision")
torch.set_num_threads(resolve_threads(smk.params.intra_op_threads, "kpca.intra_op_threads"))
log.info("torch intra-op threads: %d", torch.get_num_threads())
try:
    records = gamma_records(
        smk.input.activations[0],
        smk.params.block,
        smk.wildcards.variant,
        standardize=smk.params.standardize,
        noise=smk.params.noise,
        seed=smk.params.seed,
        n_components=smk.params.n_components,
        placement=plan(smk.wildcards.variant, device=smk.params.device, eigh_threads=None, gpu_eigensolver=smk.params.gpu_eigensolver, sign_invariant=True),
    )
except ValueError as exc:  # figure3.block beyond the model's blocks: one line naming the key and the model
    log.error("config key %s", exc)
    sys.exit(1)
log.info("%d rows", len(records))
with atomic_output(smk.output[0]) as tmp:
    records.to_csv(tmp, index=False)
