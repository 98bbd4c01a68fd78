"""Rule download_training_logs: the authors' W&B CSV exports at a pinned commit."""

from kpca_repro.smk import fail_cleanly, setup_logging
from kpca_repro.training import download_wandb_logs

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "download_training_logs")
fail_cleanly(log, download_wandb_logs, smk.params.url, smk.output[0])
log.info("W&B logs in %s", smk.output[0])
