# Stage 0: external inputs in the resources directory.
#
# A download rule exists only for inputs that are missing when the workflow is parsed, so
# files placed by hand (or a read-only directory such as ../shared/assets) are never
# "regenerated". Their input function registers what they fetch: offline, the check before the
# first job stops the run naming the exact path to fill (common.smk); online, the rule fetches
# it and fails with the same path if it cannot.
import re

MISSING_WEIGHTS = [m for m in dict.fromkeys([*VISION["models"], config["figure3"]["model"]]) if not os.path.exists(weights_path(m))]
IMAGES_MISSING = VISION["imagenet_val_dir"] is None and not os.path.isdir(image_source()[0])


if MISSING_WEIGHTS:

    rule download_timm_weights:
        input:
            missing_input("weights"),
        output:
            f"{RESOURCES}/weights/timm/{{model}}.safetensors",
        log:
            "logs/download_timm_weights/{model}.log",
        benchmark:
            "benchmarks/download_timm_weights/{model}.tsv"
        wildcard_constraints:
            model="|".join(re.escape(m) for m in MISSING_WEIGHTS),
        localrule: True
        conda:
            ENV
        params:
            downloads=config["downloads"],
        script:
            "../scripts/download_timm_weights.py"


if IMAGES_MISSING:

    rule download_imagenet_sample:
        input:
            missing_input("images"),
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
            downloads=config["downloads"],
            url=VISION["imagenet_sample_url"],
        script:
            "../scripts/download_imagenet_sample.py"


WIKITEXT_MISSING = not os.path.exists(f"{RESOURCES}/text/wikitext-103/wiki.test.raw")


if WIKITEXT_MISSING:

    rule download_wikitext:
        input:
            missing_input("wikitext"),
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
            downloads=config["downloads"],
        script:
            "../scripts/download_wikitext.py"
