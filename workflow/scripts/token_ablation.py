"""Rule token_ablation: J_proj, ||h||^2 and ||phi(q)||^2 at the first and last epoch per token count, over seeds (CSV with its column metadata, Markdown)."""

from kpca_repro.analysis.columns import metadata_json
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging
from kpca_repro.training.figures import TRAINING_MODEL_NAMES
from kpca_repro.training.summary import token_ablation_markdown, token_ablation_table

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "token_ablation")
# params.runs: (model, scale, tokens, seed), one per log
table = token_ablation_table([(path, *run) for path, run in zip(smk.input.logs, smk.params.runs)])
meta = metadata_json(table, "token_ablation", "token_ablation.csv", "J_proj, ||h||^2 and ||phi(q)||^2 at the first and last epoch per token count")
with atomic_output(smk.output.csv) as tmp:
    table.to_csv(tmp, index=False, float_format="%.6g")
with atomic_output(smk.output.meta) as tmp:
    tmp.write_text(meta)
legend = "Each cell: the median over the run's seeds, [min–max] over seeds when there are several; mean: as the authors log it; median: over all tokens of the batch.\n\n"
text = legend + "Test batch (the first validation batch, eval mode), first -> last epoch:\n\n" + token_ablation_markdown(table, "test", TRAINING_MODEL_NAMES)
text += "\nTraining batch (a fixed training batch, train mode), first -> last epoch:\n\n" + token_ablation_markdown(table, "train", TRAINING_MODEL_NAMES)
with atomic_output(smk.output.md) as tmp:
    tmp.write_text(text)
log.info("token ablation: %d run logs", len(smk.params.runs))
