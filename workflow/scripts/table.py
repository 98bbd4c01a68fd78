"""Rule table: one table of the registry (kpca_repro.analysis.tables.TABLES), one variant, as CSV, Markdown, the CSV's column metadata
and the HTML page the Snakemake report shows (its caption, the table to 3 significant digits, each column described)."""

import pandas as pd

from kpca_repro.analysis import columns, rendering, tables
from kpca_repro.analysis.report import table_html
from kpca_repro.h5io import atomic_output
from kpca_repro.method.uncertainty import read_sign_draws
from kpca_repro.method.variant import get as get_variant
from kpca_repro.smk import setup_logging

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "table")
table, variant = tables.TABLES[smk.wildcards.table], get_variant(smk.params.variant)
if table.keys:  # eigenvalue records (Tables 2, 3), with bootstrap intervals in every variant (docs/uncertainty.md)
    frames = {}
    for f in smk.input.records:
        df = pd.read_csv(f)
        key = (df["model"].iloc[0], df["keys"].iloc[0])
        frames[key] = pd.concat([frames[key], df]) if key in frames else df
    frame = tables.table_spectra(frames, dict(smk.params.uncertainty))
    frame.insert(2, "variant", variant.name)
else:
    heads, meta = tables.read_head_records(smk.input.heads, smk.input.meta, table.count_key)
    if variant.tables == "paper":
        # sign and bootstrap intervals for a variant with sign draws (docs/uncertainty.md); the draws' rows follow the records files
        draws, settings = (read_sign_draws(smk.input.signs), dict(smk.params.uncertainty)) if variant.sign_draws else (None, None)
        frame = tables.paper_table(table, heads, meta, draws, settings)
        # the paper's statistics stay as the authors compute them; say how many heads test only g (docs/method.md 17.1)
        kept_all = tables.all_directions_kept(heads)
        log.info("%d of %d heads have N <= d + 1 (their CKA tests only the normaliser g); the paper variant keeps them in its statistics", int(kept_all.sum()), len(heads))
    else:
        frame = tables.table_corrected(heads, meta, table)
frame = rendering.label_rows(rendering.label_rows(frame, smk.params.stand_ins, rendering.STAND_IN_LABEL), smk.params.user_models, rendering.USER_LABEL)  # docs/hub_fixture.md, docs/activations.md
if table.keys:
    markdown = rendering.markdown_table(frame, floatfmt=".1f")
else:
    markdown = rendering.paper_markdown(frame, table) if variant.tables == "paper" else rendering.corrected_markdown(frame, table.corrected)
# every column described (kpca_repro.analysis.columns), or the job stops before writing
schema, extra = tables.column_schema(table, variant.tables == "paper")
title = f"{table.title}, {variant.name} variant"
meta = columns.metadata_json(frame, schema, f"{smk.wildcards.table}{smk.wildcards.suffix}.csv", title, extra)
with atomic_output(smk.output.csv) as tmp:
    frame.to_csv(tmp, index=False)
with atomic_output(smk.output.meta) as tmp:
    tmp.write_text(meta)
with atomic_output(smk.output.md) as tmp:
    tmp.write_text(markdown)
with atomic_output(smk.output.html) as tmp:
    # a per-head table, paper variant: its statistics with their intervals first, as the Markdown shows them
    headline = rendering.paper_cells(frame, table) if not table.keys and variant.tables == "paper" else None
    note = rendering.PAPER_INTERVAL_NOTE if headline is not None else ""
    # one row per model (Tables 1-4, paper; Tables 2-3): every column one per row, each statistic with its interval in one cell
    by_column = bool(table.keys) or variant.tables == "paper"
    tmp.write_text(table_html(smk.output.csv, title, smk.output.meta, table.caption, headline, note, by_column))
log.info("wrote %s (%d rows)", smk.output.csv, len(frame))
