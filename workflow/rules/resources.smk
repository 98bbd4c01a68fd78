# Stage 0: external inputs in the resources directory.
#
# The download rules always exist and have no input: Snakemake schedules one only when its output is
# missing, so files placed by hand (or a read-only directory such as ../shared/assets) are never
# "regenerated". A shell command (kpca_repro.inputs.download), not a rule script: Snakemake reruns a
# script rule whose script is newer than its output. Offline, the check before the first job stops the
# run naming the exact path to fill (common.smk); online, the rule fetches it and fails with the same
# path if it cannot.


rule download_timm_weights:
    output:
        f"{RESOURCES}/weights/timm/{{model}}.safetensors",
    log:
        "logs/download_timm_weights/{model}.log",
    benchmark:
        "benchmarks/download_timm_weights/{model}.tsv"
    localrule: True
    conda:
        ENV
    params:
        downloads=DOWNLOADS,
    shell:
        "python -m kpca_repro.inputs.download weights {log:q} {params.downloads:q} {wildcards.model:q} {output:q}"


rule download_imagenet_sample:
    output:
        directory(f"{RESOURCES}/images/imagenet-sample"),
    log:
        "logs/download_imagenet_sample/download.log",
    benchmark:
        "benchmarks/download_imagenet_sample/download.tsv"
    localrule: True
    conda:
        ENV
    params:
        downloads=DOWNLOADS,
        url=VISION["imagenet_sample_url"],
    shell:
        "python -m kpca_repro.inputs.download imagenet {log:q} {params.downloads:q} {params.url:q} {output:q}"


rule download_wikitext:
    output:
        f"{RESOURCES}/text/wikitext-103/wiki.test.raw",
    log:
        "logs/download_wikitext/download.log",
    benchmark:
        "benchmarks/download_wikitext/download.tsv"
    localrule: True
    conda:
        ENV
    params:
        downloads=DOWNLOADS,
    shell:
        "python -m kpca_repro.inputs.download wikitext {log:q} {params.downloads:q} - {output:q}"
