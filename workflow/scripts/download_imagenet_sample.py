"""Rule download_imagenet_sample: the 1000-image ImageNet sample at a pinned commit."""

from kpca_repro.inputs.resources import DownloadPolicy, download_imagenet_sample
from kpca_repro.smk import fail_cleanly, setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "download_imagenet_sample")
dl = smk.params.downloads
log.info("downloading %s -> %s", smk.params.url, smk.output[0])
fail_cleanly(
    log,
    download_imagenet_sample,
    smk.params.url,
    smk.output[0],
    archive_sha256=dl["imagenet_sample_sha256"],
    content_sha256_expected=dl["imagenet_sample_content_sha256"],
    policy=DownloadPolicy.from_config(dl),
    log=log,
)
log.info("ImageNet sample in %s", smk.output[0])
