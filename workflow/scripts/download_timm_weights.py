"""Rule download_timm_weights: fetch a timm model's pretrained weights into the resources directory."""

from kpca_repro.inputs.resources import DownloadPolicy, download_timm_weights
from kpca_repro.smk import fail_cleanly, setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "download_timm_weights")
log.info("downloading %s -> %s", smk.wildcards.model, smk.output[0])
fail_cleanly(log, download_timm_weights, smk.wildcards.model, smk.output[0], policy=DownloadPolicy.from_config(smk.params.downloads), log=log)
