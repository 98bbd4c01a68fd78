"""Rule user_activations: validate a user's activation file (format and capture invariant) and install it in the results."""

from kpca_repro.activations import install_user_file
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "user_activations")
summary = install_user_file(
    smk.input.source,
    smk.output[0],
    name=smk.params.name,
    kind=smk.params.kind,
    shard=smk.params.shard,
    n_shards=smk.params.n_shards,
)
log.info("%s: %s", smk.input.source, summary.line())
