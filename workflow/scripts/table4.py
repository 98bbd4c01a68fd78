"""Rule table4 (paper and corrected variant): aggregate per-head records of the language models into Table 4 (CSV + Markdown)."""

from kpca_repro.analysis.tables import TEXT_CORRECTED_METRICS, corrected_markdown, label_stand_ins, label_user_rows, paper_markdown, read_head_records, table4_paper, table_corrected
from kpca_repro.h5io import atomic_output
from kpca_repro.method.uncertainty import read_sign_draws
from kpca_repro.method.variant import get as get_variant
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "table4")
heads, meta = read_head_records(smk.input.heads, smk.input.meta, "n_sentences", keep=("longformer_transposed",))
if get_variant(smk.params.variant).tables == "paper":
    # sign and bootstrap intervals (docs/uncertainty.md); the draws' rows follow the records files
    table = table4_paper(heads, meta, read_sign_draws(smk.input.signs), dict(smk.params.uncertainty))
    table = label_stand_ins(table, smk.params.stand_ins)  # docs/hub_fixture.md
    table = label_user_rows(table, smk.params.user_models)  # docs/activations.md
    markdown = paper_markdown(table, "hf_id")
else:
    table = table_corrected(heads, meta, TEXT_CORRECTED_METRICS, id_column="hf_id", count_key="n_sentences")
    table = label_stand_ins(table, smk.params.stand_ins)
    table = label_user_rows(table, smk.params.user_models)
    markdown = corrected_markdown(table, TEXT_CORRECTED_METRICS)
with atomic_output(smk.output.csv) as tmp:
    table.to_csv(tmp, index=False)
with atomic_output(smk.output.md) as tmp:
    tmp.write_text(markdown)
log.info("wrote %s (%d rows)", smk.output.csv, len(table))
