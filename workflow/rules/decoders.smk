# Decoders (docs/method.md 16): causal heads, whose query i attends to its prefix. The extraction
# (extract_text with the decoder params), the full-prefix records (kpca_heads) and the decoders table
# (rule table, entry table_decoders of the table registry) are the text stages' rules; here: the
# prefix profile's records, its table and figure, and the decoders' squared norms.


# rule kpca_heads (kpca.smk) on each row's first P real tokens: its input, script, threads and
# params, the prefix P from the file name
use rule kpca_heads as kpca_prefix with:
    output:
        heads="results/heads/{variant}/{model}/{stem}_p{prefix}.csv",
        meta="results/heads/{variant}/{model}/{stem}_p{prefix}.json",
        signs="results/heads/{variant}/{model}/{stem}_p{prefix}_signs.h5",
    log:
        "logs/kpca_prefix/{variant}/{model}/{stem}_p{prefix}.log",
    benchmark:
        "benchmarks/kpca_prefix/{variant}/{model}/{stem}_p{prefix}.tsv"
    wildcard_constraints:
        stem=r"text_\d+_\d+of\d+",
        prefix=r"\d+",
    params:
        # the profile reports the four metrics, without solver draws
        sign_draws=(0, 0, 0),
        prefix=lambda wc: int(wc.prefix),


default_target(
    "results/decoders_prefix{suffix}.csv",
    "results/figure_decoders_prefix{suffix}.pdf",
    "results/figure_decoders_norms{suffix}.pdf",
    when=lambda config: bool(config["decoders"]["models"]),
)


rule decoders_prefix:
    input:
        models=needs_models("decoders", "The decoders' prefix profile"),
        heads=decoder_prefix_records,
        columns=lambda wc: [f"{f}-metadata.json" for f in decoder_prefix_records(wc)],
    output:
        csv="results/decoders_prefix{suffix}.csv",
        meta="results/decoders_prefix{suffix}.csv-metadata.json",
        pdf="results/figure_decoders_prefix{suffix}.pdf",
        png=report(
            "results/figure_decoders_prefix{suffix}.png",
            caption="../report/figure_decoders_prefix.rst",
            category="Figures",
            labels=norm_figure_labels("Decoders: prefix profile", lambda wc: DECODERS["models"]),
        ),
    log:
        "logs/decoders_prefix/decoders_prefix{suffix}.log",
    benchmark:
        "benchmarks/decoders_prefix/decoders_prefix{suffix}.tsv"
    wildcard_constraints:
        suffix=SUFFIXES,
    localrule: True
    conda:
        ENV
    params:
        code=code_of("decoders_prefix.py"),
        variant=variant_of,
        groups=decoder_prefix_groups,
        title=lambda wc: f"Decoders, {variant_of(wc)} variant: V[:P] against V_KPCA^(P) on the first P real tokens of {TEXT['n_rows']} WikiText rows (N: each row's full length)",
    script:
        "../scripts/decoders_prefix.py"


rule norms_decoder:
    input:
        activations=lambda wc: norm_activations("decoders", wc.variant, wc.model),
    output:
        csv="results/norms/{variant}/{model}/decoder.csv",
        columns="results/norms/{variant}/{model}/decoder.csv-metadata.json",
    log:
        "logs/norms_decoder/{variant}/{model}.log",
    benchmark:
        "benchmarks/norms_decoder/{variant}/{model}.tsv"
    localrule: True
    conda:
        ENV
    threads: job_threads
    resources:
        mem_mb=4000,
    params:
        code=code_of("norm_stats.py"),
        intra_op_threads=config["kpca"]["intra_op_threads"],
        language=True,
    script:
        "../scripts/norm_stats.py"


rule figure_decoders_norms:
    input:
        models=needs_models("decoders", "The decoders' norm figure"),
        stats=norm_stats("decoder", lambda wc: [model_slug(m) for m in DECODERS["models"]]),
    output:
        pdf="results/figure_decoders_norms{suffix}.pdf",
        png=report(
            "results/figure_decoders_norms{suffix}.png",
            caption="../report/figure_decoders_norms.rst",
            category="Figures",
            labels=norm_figure_labels("Decoders: squared norms", lambda wc: DECODERS["models"]),
        ),
        csv="results/figure_decoders_norms{suffix}.csv",
        meta="results/figure_decoders_norms{suffix}.csv-metadata.json",
    log:
        "logs/figure_decoders_norms/figure_decoders_norms{suffix}.log",
    benchmark:
        "benchmarks/figure_decoders_norms/figure_decoders_norms{suffix}.tsv"
    wildcard_constraints:
        suffix=SUFFIXES,
    localrule: True
    conda:
        ENV
    params:
        code=code_of("figure_norms.py"),
        title=lambda wc: f"Decoders, {variant_of(wc)} variant: all {TEXT['n_rows']} WikiText rows, padding excluded, causal g(q_i) over the prefix, s = 1/sqrt(head_dim), log domain (float64), no trim",
        band_label=lambda wc: "2.5-97.5th percentile (central 95 %)",
    script:
        "../scripts/figure_norms.py"
