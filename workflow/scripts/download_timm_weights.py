"""Rule download_timm_weights: fetch a timm model's pretrained weights into the resources directory."""

from kpca_repro.resources import download_timm_weights
from kpca_repro.smk import fail_cleanly, setup_logging

log = setup_logging(snakemake, "download_timm_weights")  # noqa: F821 (injected by Snakemake)
log.info("downloading %s -> %s", snakemake.wildcards.model, snakemake.output[0])  # noqa: F821
fail_cleanly(log, download_timm_weights, snakemake.wildcards.model, snakemake.output[0])  # noqa: F821
