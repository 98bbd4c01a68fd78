"""Rule figure3: plot the gamma-constancy test (PDF, PNG, and the plotted numbers as CSV with its column metadata)."""

import os

import pandas as pd

from kpca_repro.analysis.columns import metadata_json
from kpca_repro.figures.plots import plot_gamma
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "figure3")
records = pd.read_csv(smk.input.gamma)
with atomic_output(smk.output.pdf) as pdf, atomic_output(smk.output.png) as png:
    stats = plot_gamma(records, pdf, png, smk.params.title)
meta = metadata_json(stats, "figure3", os.path.basename(smk.output.csv), f"Figure 3: {smk.params.title}")
with atomic_output(smk.output.csv) as tmp:
    stats.to_csv(tmp, index=False)
with atomic_output(smk.output.meta) as tmp:
    tmp.write_text(meta)
log.info("wrote %s", smk.output.pdf)
