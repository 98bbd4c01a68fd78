"""Rule download_wikitext: the WikiText-103 raw test split into the resources directory."""

from kpca_repro.smk import fail_cleanly, setup_logging
from kpca_repro.text import download_wikitext

log = setup_logging(snakemake, "download_wikitext")  # noqa: F821 (injected by Snakemake)
log.info("datasets.load_dataset -> %s", snakemake.output[0])  # noqa: F821
fail_cleanly(log, download_wikitext, snakemake.output[0])  # noqa: F821
