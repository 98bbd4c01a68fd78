"""Rules figure2, figure5: plot the per-layer squared norms (PDF, PNG, and the plotted numbers as CSV with its column metadata)."""

import os

import pandas as pd

from kpca_repro.analysis.columns import metadata_json
from kpca_repro.analysis.rendering import display_name
from kpca_repro.figures.plots import plot_norms
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "figure_norms")
stats = pd.concat([pd.read_csv(f) for f in smk.input.stats], ignore_index=True)
names = {m: display_name(m).split("/")[-1] for m in stats["model"].unique()}
with atomic_output(smk.output.pdf) as pdf, atomic_output(smk.output.png) as png:
    plot_norms(stats, pdf, png, smk.params.title, smk.params.band_label, names)
meta = metadata_json(stats, "norms", os.path.basename(smk.output.csv), smk.params.title)
with atomic_output(smk.output.csv) as tmp:
    stats.to_csv(tmp, index=False)
with atomic_output(smk.output.meta) as tmp:
    tmp.write_text(meta)
log.info("wrote %s", smk.output.pdf)
