# Stage 1: sample the images, run each model once per image batch, store q, k, v, h.


rule sample_images:
    input:
        images=image_source()[0],
        in_dag=in_dag("sample_images"),
    output:
        "results/samples/vision_{n}.tsv",
    log:
        "logs/sample_images/vision_{n}.log",
    benchmark:
        "benchmarks/sample_images/vision_{n}.tsv"
    localrule: True
    conda:
        ENV
    params:
        code=code_of("sample_images.py"),
        layout=image_source()[1],
        seed=config["seed"],
    script:
        "../scripts/sample_images.py"


rule extract_vision:
    input:
        weights=lambda wc: weights_path(wc.model),
        samples="results/samples/vision_{n}.tsv",
    output:
        activations_output("results/activations/{model}/vision_{n}_{shard}.h5"),
    log:
        "logs/extract_vision/{model}/vision_{n}_{shard}.log",
    benchmark:
        "benchmarks/extract_vision/{model}/vision_{n}_{shard}.tsv"
    conda:
        ENV
    threads: job_threads
    resources:
        gpu=GPU,
        # ViT-Large, batches of 25: two batches held at once, 8,046 MiB peak (docs/hub_fixture.md)
        mem_mb=10000,
    params:
        code=code_of("extract_vision.py"),
        intra_op_threads=config["kpca"]["intra_op_threads"],
        batch_size=VISION["batch_size"],
        device=config["device"],
        model_kwargs=lambda wc: VISION["model_kwargs"].get(wc.model, {}),
        checksum=lambda wc: config["checksums"].get(wc.model),
        seed=config["seed"],
    script:
        "../scripts/extract_vision.py"


# Language models (Table 4, docs/method.md Section 3): the text sample, one forward per batch of rows.


rule sample_text:
    input:
        rows=f"{RESOURCES}/text/wikitext-103/wiki.test.raw",
    output:
        "results/samples/text_{n}.tsv",
    log:
        "logs/sample_text/text_{n}.log",
    benchmark:
        "benchmarks/sample_text/text_{n}.tsv"
    localrule: True
    conda:
        ENV
    params:
        code=code_of("sample_text.py"),
        seed=config["seed"],
        min_chars=TEXT["min_chars"],
    script:
        "../scripts/sample_text.py"


rule extract_text:
    input:
        samples="results/samples/text_{sample}.tsv",
        model=text_model_files,
        in_dag=in_dag("extract_text"),
    output:
        activations_output("results/activations/{slug}/text_{sample}_{shard}.h5"),
    log:
        "logs/extract_text/{slug}/text_{sample}_{shard}.log",
    benchmark:
        "benchmarks/extract_text/{slug}/text_{sample}_{shard}.tsv"
    conda:
        ENV
    threads: job_threads
    resources:
        gpu=GPU,
        mem_mb=8000,
    params:
        code=code_of("extract_text.py"),
        intra_op_threads=config["kpca"]["intra_op_threads"],
        model_id=lambda wc: model_id_from_slug(wc.slug),
        source=text_model_source,
        batch_size=TEXT["batch_size"],
        max_length=TEXT["max_length"],
        device=config["device"],
        offline=config["offline"],
        checksum=lambda wc: config["checksums"].get(model_id_from_slug(wc.slug)),
        revision=text_model_revision,
        decoder=text_model_is_decoder,
    script:
        "../scripts/extract_text.py"
