"""Rule table_spectra: Table 2 (standardized keys) or Table 3 (with / without), x 1e-6."""

import pandas as pd

from kpca_repro.analysis.tables import label_stand_ins, label_user_rows, markdown_table, table_spectra
from kpca_repro.h5io import atomic_output
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "table_spectra")
frames = {}
for f in smk.input.records:
    df = pd.read_csv(f)
    key = (df["model"].iloc[0], df["keys"].iloc[0])
    frames[key] = pd.concat([frames[key], df]) if key in frames else df
table = table_spectra(frames, dict(smk.params.uncertainty))  # with bootstrap intervals (docs/uncertainty.md)
table.insert(2, "variant", smk.params.variant)
table = label_stand_ins(table, smk.params.stand_ins)  # docs/hub_fixture.md
table = label_user_rows(table, smk.params.user_models)  # docs/activations.md
with atomic_output(smk.output.csv) as tmp:
    table.to_csv(tmp, index=False)
with atomic_output(smk.output.md) as tmp:
    tmp.write_text(markdown_table(table, floatfmt=".1f"))
log.info("wrote %s (%d models)", smk.output.csv, len(table))
