# Figures 1 and 4: train a ViT from scratch while logging J_proj (docs/method.md 6-7).
#
# One run is one (model, scale, seed): results/training/<arch>_<scale>/seed<seed>/log.csv. A
# scale's seeds are its `seeds` key, else training.seeds (kpca_repro.training.summary.scale_seeds); the
# figures, the token ablation and the claims table read every seed of each run they name.
#
# The checkpoint results/training/<arch>_<scale>/seed<seed>/checkpoint.pt is deliberately NOT an
# output: Snakemake deletes the outputs of a failed or interrupted job (and of an incomplete one
# on --rerun-incomplete), but leaves undeclared files alone. A rerun of `train` therefore resumes
# from the last completed epoch; the log is rewritten from the checkpoint's rows, so no row is
# lost or duplicated. A checkpoint of another configuration (fingerprint), or one that
# torch.load(weights_only=True) refuses (a pickled object), is not used: the run starts afresh.

from kpca_repro.training.summary import run_dir, run_logs, run_scale, scale_seeds, with_seeds

# (model, scale, tokens, seed) of every seed of every figure1.runs entry (checked by _check_config)
FIGURE1_SEED_RUNS = with_seeds(TRAINING, [(model, scale, scale_tokens(TRAINING["scales"][scale])) for model, scale in map(run_model_scale, FIGURE1["runs"])])


# The download rules always exist and have no input file (as in resources.smk): files placed by hand or a
# read-only ../shared/assets are never rebuilt.


rule download_fashion_mnist:
    input:
        in_dag=in_dag("download_fashion_mnist"),
    output:
        FASHION_MNIST,
    log:
        "logs/download_fashion_mnist.log",
    benchmark:
        "benchmarks/download_fashion_mnist.tsv"
    localrule: True
    conda:
        ENV
    params:
        downloads=DOWNLOADS,
    shell:
        "python -m kpca_repro.inputs.download fashion_mnist {log:q} {params.downloads:q} - {output:q}"


rule download_training_logs:
    input:
        in_dag=in_dag("download_training_logs"),
    output:
        directory(f"{RESOURCES}/training_logs"),
    log:
        "logs/download_training_logs.log",
    benchmark:
        "benchmarks/download_training_logs.tsv"
    localrule: True
    conda:
        ENV
    params:
        downloads=DOWNLOADS,
        url=FIGURE1["reference_url"],
    shell:
        "python -m kpca_repro.inputs.download training_logs {log:q} {params.downloads:q} {params.url:q} {output:q}"


rule train:
    input:
        data=train_data,
    output:
        log="results/training/{arch}_{scale}/seed{seed}/log.csv",
    log:
        "logs/train/{arch}_{scale}_seed{seed}.log",
    benchmark:
        "benchmarks/train/{arch}_{scale}_seed{seed}.tsv"
    wildcard_constraints:
        arch="|".join(TRAINING["models"]),
        scale="|".join(TRAINING["scales"]),
        seed=r"0|[1-9]\d*",
    conda:
        ENV
    threads: TRAINING["threads"]
    resources:
        gpu=GPU,
        mem_mb=8000,
    params:
        code=code_of("train.py"),
        model=lambda wc: TRAINING["models"][wc.arch],
        # without its `seeds` list: adding a seed to a scale reruns none of the runs it had
        scale=lambda wc: run_scale(TRAINING["scales"][wc.scale]),
        checkpoint=lambda wc: f"{run_dir(wc.arch, wc.scale, wc.seed)}/checkpoint.pt",
        device=config["device"],
        resources_dir=RESOURCES,
        offline=config["offline"],
        num_workers=TRAINING["num_workers"],
    script:
        "../scripts/train.py"


rule training_claims:
    input:
        logs=run_logs(FIGURE1_SEED_RUNS),
    output:
        csv=report(
            "results/training_claims.csv",
            caption="../report/training_claims.rst",
            category="Summary",
            labels=training_labels("Figure 1 claims"),
        ),
        md="results/training_claims.md",
        meta="results/training_claims.csv-metadata.json",
    log:
        "logs/training_claims.log",
    benchmark:
        "benchmarks/training_claims.tsv"
    localrule: True
    conda:
        ENV
    params:
        code=code_of("training_claims.py"),
        runs=FIGURE1_SEED_RUNS,
        thresholds=FIGURE1["claims"],
        skip_epochs=FIGURE1["skip_epochs_runs"],
    script:
        "../scripts/training_claims.py"


# training curves: no variants
default_target("results/figure1.pdf", "results/figure4.pdf", when=lambda config: bool(config["figure1"]["runs"] or config["figure1"]["use_reference"]))


rule figure_training:
    input:
        logs=run_logs(FIGURE1_SEED_RUNS),
        reference=reference_logs_input(),
        # Figure 1 writes under each scale's column in how many seeds and epochs the claims hold
        claims=lambda wc: ["results/training_claims.csv"] if wc.fig == "1" and FIGURE1["runs"] else [],
    output:
        pdf="results/figure{fig}.pdf",
        png=report(
            "results/figure{fig}.png",
            caption="../report/figure_training.rst",
            category="Figures",
            labels=lambda wc: training_labels(f"Figure {wc.fig}"),
        ),
        csv="results/figure{fig}.csv",
        meta="results/figure{fig}.csv-metadata.json",
    log:
        "logs/figure_training/figure{fig}.log",
    benchmark:
        "benchmarks/figure_training/figure{fig}.tsv"
    wildcard_constraints:
        fig="1|4",
    localrule: True
    conda:
        ENV
    params:
        code=code_of("figure_training.py"),
        runs=FIGURE1_SEED_RUNS,
        settings={run_model_scale(run)[1]: scale_setting(TRAINING["scales"][run_model_scale(run)[1]], scale_seeds(TRAINING, run_model_scale(run)[1])) for run in FIGURE1["runs"]},
        epoch_axis=FIGURE1["epoch_axis"],
        skip_epochs_reference=FIGURE1["skip_epochs_reference"],
        skip_epochs_runs=FIGURE1["skip_epochs_runs"],
    script:
        "../scripts/figure_training.py"


default_target("results/token_ablation.csv", when=lambda config: bool(config.get("token_ablation", {}).get("models") and config["token_ablation"]["scales"]))


rule token_ablation:
    input:
        # evaluated only when the table is requested (ablation_runs checks the scales' patches)
        logs=lambda wc: run_logs(with_seeds(TRAINING, ablation_runs())),
    output:
        csv=report(
            "results/token_ablation.csv",
            caption="../report/token_ablation.rst",
            category="Summary",
            labels=lambda wc: report_labels("token ablation", "runs trained here", config["token_ablation"]["models"]),
        ),
        md="results/token_ablation.md",
        meta="results/token_ablation.csv-metadata.json",
    log:
        "logs/token_ablation.log",
    benchmark:
        "benchmarks/token_ablation.tsv"
    localrule: True
    conda:
        ENV
    params:
        code=code_of("token_ablation.py"),
        runs=lambda wc: with_seeds(TRAINING, ablation_runs()),
    script:
        "../scripts/token_ablation.py"
