"""Rule figure_training: Figure 1 (J_proj, ||h||^2, ||phi(q)||^2) or Figure 4 (relative errors), over seeds; the plotted points as CSV with its column metadata."""

import pandas as pd

from kpca_repro.analysis.columns import metadata_json
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging
from kpca_repro.training.figures import TRAINING_MODEL_NAMES, plot_figure1, plot_figure4
from kpca_repro.training.logs import training_curves
from kpca_repro.training.summary import AUTHORS_SETTING, claims_note

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "figure_training")
REFERENCE = "authors (W&B, ImageNet-1k)"


def source(scale):
    return f"this pipeline ({scale})"


# one log per (run, seed); the seeds of a run make one curve (median, min-max band)
runs = [(path, model, source(scale), seed) for path, (model, scale, _tokens, seed) in zip(smk.input.logs, smk.params.runs)]
reference = smk.input.reference[0] if smk.input.reference else None
curves = training_curves(runs, reference, smk.params.epoch_axis, REFERENCE)
skip = {REFERENCE: smk.params.skip_epochs_reference}
skip.update({src: smk.params.skip_epochs_runs for _, _, src, _ in runs})
# what each column was trained on, under its title: whose run, data, tokens, depth, epochs, seeds
settings = {REFERENCE: AUTHORS_SETTING}
settings.update({source(scale): setting for scale, setting in smk.params.settings.items()})
if smk.wildcards.fig == "1":
    # under each scale's column: in how many seeds and epochs the authors' observations hold
    claims = pd.read_csv(smk.input.claims[0]) if smk.input.claims else None
    notes = {} if claims is None else {source(scale): claims_note(claims, scale, "test", TRAINING_MODEL_NAMES) for scale in smk.params.settings}
    with atomic_output(smk.output.pdf) as pdf, atomic_output(smk.output.png) as png:
        plotted = plot_figure1(curves, pdf, png, skip, settings, {k: v for k, v in notes.items() if v})
else:
    with atomic_output(smk.output.pdf) as pdf, atomic_output(smk.output.png) as png:
        plotted = plot_figure4(curves, pdf, png, skip, settings)
meta = metadata_json(plotted, "training_curves", f"figure{smk.wildcards.fig}.csv", f"Figure {smk.wildcards.fig}: the plotted points")
with atomic_output(smk.output.csv) as tmp:
    plotted.to_csv(tmp, index=False)
with atomic_output(smk.output.meta) as tmp:
    tmp.write_text(meta)
log.info("figure %s: %d points from %d run logs%s", smk.wildcards.fig, len(plotted), len(runs), " and the reference logs" if reference else "")
