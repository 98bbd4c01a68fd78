# Stage 1: sample the images, run each model once per image batch, store q, k, v, h.


rule sample_images:
    localrule: True
    input:
        images=image_source()[0],
        code=str(LIB / "images.py"),
    output:
        "results/samples/vision_{n}.tsv",
    params:
        layout=image_source()[1],
        seed=config["seed"],
    log:
        "logs/sample_images/vision_{n}.log",
    benchmark:
        "benchmarks/sample_images/vision_{n}.tsv"
    conda:
        ENV
    script:
        "../scripts/sample_images.py"


rule extract_vision:
    input:
        weights=lambda wc: weights_path(wc.model),
        samples="results/samples/vision_{n}.tsv",
        code=LIB_EXTRACT,
    output:
        "results/activations/{model}/vision_{n}_{shard}.h5",
    params:
        batch_size=VISION["batch_size"],
        device=config["device"],
        model_kwargs=lambda wc: VISION["model_kwargs"].get(wc.model, {}),
        checksum=lambda wc: config["checksums"].get(wc.model),
        seed=config["seed"],
    threads: config["kpca"]["threads"]
    resources:
        gpu=1 if config["device"] != "cpu" else 0,
        mem_mb=8000,
    log:
        "logs/extract_vision/{model}/vision_{n}_{shard}.log",
    benchmark:
        "benchmarks/extract_vision/{model}/vision_{n}_{shard}.tsv"
    conda:
        ENV
    script:
        "../scripts/extract_vision.py"
