"""Rule download_imagenet_sample: the 1000-image ImageNet sample at a pinned commit."""

from kpca_repro.resources import download_imagenet_sample
from kpca_repro.smk import fail_cleanly, setup_logging

log = setup_logging(snakemake, "download_imagenet_sample")  # noqa: F821 (injected by Snakemake)
log.info("downloading %s -> %s", snakemake.params.url, snakemake.output[0])  # noqa: F821
fail_cleanly(log, download_imagenet_sample, snakemake.params.url, snakemake.output[0])  # noqa: F821
