"""Rule figure_training: Figure 1 (J_proj, ||h||^2, ||phi(q)||^2) or Figure 4 (relative errors)."""

from kpca_repro.figures import plot_figure1, plot_figure4
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging
from kpca_repro.training import training_curves
from kpca_repro.training_summary import AUTHORS_SETTING

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "figure_training")
REFERENCE = "authors (W&B, ImageNet-1k)"
runs = [(path, model, f"this pipeline ({scale})") for path, (_, model, scale) in zip(smk.input.logs, smk.params.runs)]
reference = smk.input.reference[0] if smk.input.reference else None
curves = training_curves(runs, reference, smk.params.epoch_axis, REFERENCE)
skip = {REFERENCE: smk.params.skip_epochs_reference}
skip.update({source: smk.params.skip_epochs_runs for _, _, source in runs})
# what each column was trained on, under its title: whose run, data, tokens, depth, epochs
settings = {REFERENCE: AUTHORS_SETTING}
settings.update({f"this pipeline ({scale})": setting for scale, setting in smk.params.settings.items()})
plot = plot_figure1 if smk.wildcards.fig == "1" else plot_figure4
with atomic_output(smk.output.pdf) as pdf, atomic_output(smk.output.png) as png:
    plotted = plot(curves, pdf, png, skip, settings)
with atomic_output(smk.output.csv) as tmp:
    plotted.to_csv(tmp, index=False)
log.info("figure %s: %d points from %d runs%s", smk.wildcards.fig, len(plotted), len(runs), " and the reference logs" if reference else "")
