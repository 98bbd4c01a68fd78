"""Rule download_wikitext: the WikiText-103 raw test split into the resources directory."""

from kpca_repro.inputs.resources import DownloadPolicy
from kpca_repro.inputs.text import download_wikitext
from kpca_repro.smk import fail_cleanly, setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "download_wikitext")
dl = smk.params.downloads
log.info("datasets.load_dataset(%r, %r, split=%r, revision=%r) -> %s", *dl["wikitext"].values(), smk.output[0])
fail_cleanly(log, download_wikitext, smk.output[0], dl["wikitext"], policy=DownloadPolicy.from_config(dl), log=log)
