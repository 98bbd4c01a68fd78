"""Rule text_sentences: the Figure 5 sentences (config figure5.sentences) as a samples table."""

from kpca_repro.analysis.norms import sentence_samples
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "text_sentences")
samples = sentence_samples(list(smk.params.sentences))
with atomic_output(smk.output[0]) as tmp:
    samples.to_csv(tmp, sep="\t", index=False)
log.info("%d sentences", len(samples))
