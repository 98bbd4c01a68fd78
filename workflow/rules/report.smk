# Summary: every published number of Tables 1-4 beside the reproduced one.


rule paper_comparison:
    localrule: True
    input:
        tables=lambda wc: [p for pair in comparison_tables().values() for p in pair if p],
        code=LIB_COMPARISON,
    output:
        csv=report(
            "results/paper_comparison.csv",
            caption="../report/comparison.rst",
            category="Summary",
            labels={"table": "published vs reproduced"},
        ),
        md="results/paper_comparison.md",
    params:
        published=config["comparison"]["published_tables"],
        tables=comparison_tables(),
        vision_models=VISION["models"],
        weights_dir=f"{RESOURCES}/weights/timm",
    log:
        "logs/paper_comparison/paper_comparison.log",
    benchmark:
        "benchmarks/paper_comparison/paper_comparison.tsv"
    conda:
        ENV
    script:
        "../scripts/paper_comparison.py"
