# Summary: every published number of Tables 1-4 beside the reproduced one.


default_target("results/html/paper_comparison.html", "results/paper_comparison.csv")


rule paper_comparison:
    input:
        tables=lambda wc: [p for pair in comparison_tables().values() for p in pair if p],
    output:
        csv=report(
            "results/paper_comparison.csv",
            caption="../report/comparison.rst",
            category="Summary",
            labels={"table": "published vs reproduced"},
        ),
        md="results/paper_comparison.md",
        meta="results/paper_comparison.csv-metadata.json",
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


rule table_html:
    input:
        csv="results/{table}.csv",
        meta="results/{table}.csv-metadata.json",
    output:
        report(
            "results/html/{table}.html",
            caption="../report/tables.rst",
            category="Tables",
            labels=lambda wc: {"table": wc.table},
        ),
    log:
        "logs/table_html/{table}.log",
    benchmark:
        "benchmarks/table_html/{table}.tsv"
    wildcard_constraints:
        table="|".join(paths.report_tables()),
    localrule: True
    conda:
        ENV
    params:
        code=code_of("table_html.py"),
        caption=report_caption,
    script:
        "../scripts/table_html.py"
