"""Rule download_imagenet_sample: the 1000-image ImageNet sample at a pinned commit."""

from kpca_repro.resources import download_imagenet_sample
from kpca_repro.smk import setup_logging

log = setup_logging(snakemake, "download_imagenet_sample")  # noqa: F821 (injected by Snakemake)
log.info("downloading %s -> %s", snakemake.params.url, snakemake.output[0])  # noqa: F821
download_imagenet_sample(snakemake.params.url, snakemake.output[0])  # noqa: F821
