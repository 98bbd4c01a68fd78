"""Rule training_claims: in how many seeds and epochs each of the authors' Figure 1 observations holds."""

from kpca_repro.analysis.columns import metadata_json
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging
from kpca_repro.training.figures import TRAINING_MODEL_NAMES
from kpca_repro.training.summary import claim_definitions, training_claims, training_claims_markdown

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "training_claims")
thresholds = dict(phiq_ratio_below=smk.params.thresholds["phiq_ratio_below"], jproj_h_factor=smk.params.thresholds["jproj_h_factor"])
# params.runs: (model, scale, tokens, seed), one per log
claims = training_claims([(path, *run) for path, run in zip(smk.input.logs, smk.params.runs)], smk.params.skip_epochs, **thresholds)
meta = metadata_json(claims, "training_claims", "training_claims.csv", "In how many seeds and epochs each of the authors' Figure 1 observations holds")
with atomic_output(smk.output.csv) as tmp:
    claims.to_csv(tmp, index=False, float_format="%.6g")
with atomic_output(smk.output.meta) as tmp:
    tmp.write_text(meta)
defs = claim_definitions(**thresholds)
text = "Definitions (phi, h, J: the statistic's ||phi(q)||^2, ||h||^2 and J_proj on one fixed batch after one epoch; mean: as the authors log it, median: over all tokens of the batch):\n\n"
text += "".join(f"* `{name}`: {definition}\n" for name, definition in defs.items())
text += f'\nEpochs counted: epoch >= {smk.params.skip_epochs:g} (figure1.skip_epochs_runs). A claim does not hold where a value it compares is not finite; "not logged": the logs lack the statistic.\n'
for split, what in (("test", "Test batch (the first validation batch, eval mode)"), ("train", "Training batch (a fixed training batch, train mode)")):
    text += f"\n{what}:\n\n" + training_claims_markdown(claims, split, TRAINING_MODEL_NAMES)
with atomic_output(smk.output.md) as tmp:
    tmp.write_text(text)
log.info("training claims: %d rows from %d run logs", len(claims), len(smk.params.runs))
