# Figures 2 and 5: layer-wise ||phi(q_i)||^2 against ||h_i||^2 (docs/method.md 0.3, 0.4, 8, 9, 15),
# from the stored q, k, v, h of the extraction rules; nothing is recomputed from the model.
#
#   paper      Figure 2: the k = 1 image draw (results/activations/<model>/vision_1_0of1.h5);
#              Figure 5: the two figure5.sentences (text_sentences_0of1.h5)
#   corrected  every image / row of the Table 1 / Table 4 extraction, all shards


rule text_sentences:
    output:
        "results/samples/text_sentences.tsv",
    log:
        "logs/text_sentences/text_sentences.log",
    benchmark:
        "benchmarks/text_sentences/text_sentences.tsv"
    localrule: True
    conda:
        ENV
    params:
        code=code_of("text_sentences.py"),
        sentences=FIGURE5["sentences"],
    script:
        "../scripts/text_sentences.py"


rule norms_vision:
    input:
        activations=lambda wc: norm_activations("vision", wc.variant, wc.model),
    output:
        csv="results/norms/{variant}/{model}/vision.csv",
        columns="results/norms/{variant}/{model}/vision.csv-metadata.json",
    log:
        "logs/norms_vision/{variant}/{model}.log",
    benchmark:
        "benchmarks/norms_vision/{variant}/{model}.tsv"
    localrule: True
    conda:
        ENV
    threads: job_threads
    resources:
        mem_mb=4000,
    params:
        code=code_of("norm_stats.py"),
        intra_op_threads=config["kpca"]["intra_op_threads"],
        language=False,
    script:
        "../scripts/norm_stats.py"


rule norms_text:
    input:
        activations=lambda wc: norm_activations("text", wc.variant, wc.model),
    output:
        csv="results/norms/{variant}/{model}/text.csv",
        columns="results/norms/{variant}/{model}/text.csv-metadata.json",
    log:
        "logs/norms_text/{variant}/{model}.log",
    benchmark:
        "benchmarks/norms_text/{variant}/{model}.tsv"
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


default_target("results/figure2{suffix}.pdf", when=has_vision)


rule figure2:
    input:
        models=needs_models("vision", "Figure 2"),
        stats=norm_stats("vision", lambda wc: VISION["models"] + [model_slug(m) for m in user_models(config, "vision")]),
    output:
        pdf="results/figure2{suffix}.pdf",
        png=report(
            "results/figure2{suffix}.png",
            caption="../report/figure2.rst",
            category="Figures",
            labels=norm_figure_labels("Figure 2", lambda wc: domain_models("vision")),
        ),
        csv="results/figure2{suffix}.csv",
        meta="results/figure2{suffix}.csv-metadata.json",
    log:
        "logs/figure2/figure2{suffix}.log",
    benchmark:
        "benchmarks/figure2/figure2{suffix}.tsv"
    wildcard_constraints:
        suffix=SUFFIXES,
    localrule: True
    conda:
        ENV
    params:
        code=code_of("figure_norms.py"),
        title=figure2_title,
        band_label=norm_band_label,
    script:
        "../scripts/figure_norms.py"


default_target("results/figure5{suffix}.pdf", when=lambda config: bool(config["text"]["models"] or user_models(config, "text")))


rule figure5:
    input:
        models=needs_models("text", "Figure 5"),
        stats=norm_stats("text", figure5_models),
    output:
        pdf="results/figure5{suffix}.pdf",
        png=report(
            "results/figure5{suffix}.png",
            caption="../report/figure5.rst",
            category="Figures",
            labels=norm_figure_labels("Figure 5", lambda wc: (FIGURE5["models"] if FIGURE5["models"] is not None else TEXT["models"]) + user_models(config, "text")),
        ),
        csv="results/figure5{suffix}.csv",
        meta="results/figure5{suffix}.csv-metadata.json",
    log:
        "logs/figure5/figure5{suffix}.log",
    benchmark:
        "benchmarks/figure5/figure5{suffix}.tsv"
    wildcard_constraints:
        suffix=SUFFIXES,
    localrule: True
    conda:
        ENV
    params:
        code=code_of("figure_norms.py"),
        title=figure5_title,
        band_label=norm_band_label,
    script:
        "../scripts/figure_norms.py"
