"""Rule table4 / table4_corrected: aggregate per-head records of the language models into Table 4 (CSV + Markdown)."""

import json

import pandas as pd

from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging
from kpca_repro.tables import TEXT_CORRECTED_METRICS, corrected_markdown, table4_paper, table_corrected

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "table4")
heads = pd.concat([pd.read_csv(f) for f in smk.input.heads], ignore_index=True)
meta = {}
for f in smk.input.meta:
    with open(f) as fh:
        m = json.load(fh)
    entry = meta.setdefault(m["model_id"], {"weights_sha256": m["weights_sha256"], "n_sentences": 0, "longformer_transposed": m["longformer_transposed"]})
    entry["n_sentences"] += m["n_sentences"]
if smk.params.variant == "paper":
    table = table4_paper(heads, meta)
    markdown = table.drop(columns=["weights_sha256"]).to_markdown(index=False, floatfmt=".3f") + "\n"
else:
    table = table_corrected(heads, meta, TEXT_CORRECTED_METRICS, id_column="hf_id", count_key="n_sentences")
    markdown = corrected_markdown(table, TEXT_CORRECTED_METRICS)
with atomic_output(smk.output.csv) as tmp:
    table.to_csv(tmp, index=False)
with atomic_output(smk.output.md) as tmp:
    tmp.write_text(markdown)
log.info("wrote %s (%d rows)", smk.output.csv, len(table))
