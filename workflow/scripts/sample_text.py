"""Rule sample_text: the paper's seeded draw of n WikiText-103 test rows (docs/method.md Section 3)."""

from kpca_repro.inputs import text
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "sample_text")
rows = text.read_text_rows(smk.input.rows)
table = text.sample_rows(rows, int(smk.wildcards.n), smk.params.min_chars, smk.params.seed, source=smk.input.rows)
log.info("sampled %d of %d rows from %s (stripped length > %d, seed %d)", len(table), len(rows), smk.input.rows, smk.params.min_chars, smk.params.seed)
text.write_samples(table, smk.output[0])
