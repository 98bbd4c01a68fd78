"""Rule download_training_logs: the authors' W&B CSV exports at a pinned commit, checked."""

from kpca_repro.inputs.resources import DownloadPolicy, download_wandb_logs
from kpca_repro.smk import fail_cleanly, setup_logging
from kpca_repro.training.logs import WANDB_FILES

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "download_training_logs")
dl = smk.params.downloads
log.info("downloading %s -> %s", smk.params.url, smk.output[0])
fail_cleanly(log, download_wandb_logs, smk.params.url, smk.output[0], WANDB_FILES, dl["reference_sha256"], policy=DownloadPolicy.from_config(dl), log=log)
log.info("W&B logs in %s", smk.output[0])
