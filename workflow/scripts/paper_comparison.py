"""Rule paper_comparison: every published number of Tables 1-4 beside the reproduced one (CSV, its column metadata, Markdown, the report's HTML page)."""

import os

from kpca_repro.analysis.columns import metadata_json
from kpca_repro.analysis.comparison import comparison_markdown, comparison_table, mark_user_activations, not_run_reason, published_model_ids
from kpca_repro.analysis.report import table_html
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "paper_comparison")
configured = {"vision": list(smk.params.vision_models), "text": list(smk.params.text_models)}
weights = {"vision": lambda m: os.path.join(smk.params.weights_dir, f"{m}.safetensors")}
not_run = {m: not_run_reason(m, kind, configured.get(kind, []), weights[kind](m) if kind in weights else None) for m, kind in published_model_ids(smk.params.published).items()}
table = comparison_table(
    smk.params.published,
    {k: tuple(v) for k, v in smk.params.tables.items()},
    not_run,
    model_kwargs=dict(smk.params.model_kwargs),
    checksums=dict(smk.params.checksums),
    stand_ins=list(smk.params.stand_ins),
)
table = mark_user_activations(table, smk.params.user_models)  # docs/activations.md
log.info("%d published numbers compared: %s", len(table), table["status"].value_counts().to_dict() if len(table) else {})
title = "Published against reproduced numbers of Tables 1-4"
meta = metadata_json(table, "paper_comparison", "paper_comparison.csv", title)
with atomic_output(smk.output.csv) as tmp:
    table.to_csv(tmp, index=False)
with atomic_output(smk.output.meta) as tmp:
    tmp.write_text(meta)
with atomic_output(smk.output.md) as tmp:
    tmp.write_text(comparison_markdown(table))
with atomic_output(smk.output.html) as tmp:  # its caption is the report's (workflow/report/comparison.rst)
    tmp.write_text(table_html(smk.output.csv, title, smk.output.meta))
