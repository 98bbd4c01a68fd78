# Summary: every published number of Tables 1-4 beside the reproduced one.
#
# `snakemake --report report.html <targets> --configfile <the run's files>` shows the outputs flagged
# report(...) of the jobs that make <targets>: each table's HTML page (rules table and
# paper_comparison), each figure's PNG, the training tables' CSVs. A new table or figure is in the
# report when its rule flags its output the same way (the comment in tables.smk); the landing page,
# workflow/report/workflow.rst, lists these outputs by their labels.


default_target("results/html/paper_comparison.html", "results/paper_comparison.csv")


rule paper_comparison:
    input:
        tables=lambda wc: [p for pair in comparison_tables().values() for p in pair if p],
    output:
        csv="results/paper_comparison.csv",
        md="results/paper_comparison.md",
        meta="results/paper_comparison.csv-metadata.json",
        html=report(
            "results/html/paper_comparison.html",
            caption="../report/comparison.rst",
            category="Summary",
            labels=comparison_labels,
        ),
    log:
        "logs/paper_comparison/paper_comparison.log",
    benchmark:
        "benchmarks/paper_comparison/paper_comparison.tsv"
    localrule: True
    conda:
        ENV
    params:
        code=code_of("paper_comparison.py"),
        published=config["comparison"]["published_tables"],
        tables=comparison_tables(),
        vision_models=VISION["models"],
        text_models=TEXT["models"],
        weights_dir=f"{RESOURCES}/weights/timm",
        # "not comparable": built with model_kwargs, or weights without the configured SHA-256
        model_kwargs=VISION["model_kwargs"],
        checksums=config["checksums"],
        # never compared: random weights of the exact architecture (docs/hub_fixture.md)
        stand_ins=config["comparison"]["stand_in_models"],
        # never compared: a user's activations (docs/activations.md)
        user_models=list(USER),
    script:
        "../scripts/paper_comparison.py"
