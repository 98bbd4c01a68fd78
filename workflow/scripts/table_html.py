"""Rule table_html: one results table as an HTML page for the Snakemake report."""

from kpca_repro.analysis.report import table_html
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "table_html")
with atomic_output(smk.output[0]) as tmp:
    tmp.write_text(table_html(smk.input.csv, smk.wildcards.table, smk.input.meta))
log.info("wrote %s", smk.output[0])
