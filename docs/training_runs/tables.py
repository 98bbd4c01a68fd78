"""Rebuild the claims table and the token ablation of docs/training.md from the logs kept here.

    python docs/training_runs/tables.py [--split test|train]

Reads every ``<model>_<scale>/seed<seed>/log.csv`` beside this file, takes each scale's token
count and the claims' thresholds from config/config.yaml (``training.scales``,
``figure1.claims``) and the runs from config/training.yaml (the file that asks for them), and prints what the ``training_claims`` and ``token_ablation`` rules write
as Markdown (``results/training_claims.md``, ``results/token_ablation.md``), through the same
functions (``kpca_repro.training.summary``). The claims table covers the ``figure1.runs`` of
the configuration, the ablation every scale of ``token_ablation.scales`` that has logs here;
a third table gives the same claims for the ablation's runs that Figure 1 does not draw
(``medium-n50``, ``medium-n17-long``).
"""

import argparse
import re
from pathlib import Path

import yaml

from kpca_repro.training.figures import TRAINING_MODEL_NAMES
from kpca_repro.training.summary import scale_tokens, token_ablation_markdown, token_ablation_table, training_claims, training_claims_markdown
from kpca_repro.workflow.config_checks import resolve_scales, run_model_scale

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent.parent / "config" / "config.yaml"
TRAINING = HERE.parent.parent / "config" / "training.yaml"


def merged(base: dict, over: dict) -> dict:
    """``base`` updated by ``over`` key by key, nested dicts merged, as Snakemake merges --configfile."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def kept_runs(scales: dict) -> list[tuple]:
    """``(log_csv, model, scale, tokens, seed)`` of every log kept beside this file."""
    runs = []
    for log in sorted(HERE.glob("*/seed*/log.csv")):
        model, scale = run_model_scale(log.parent.parent.name)
        seed = int(re.fullmatch(r"seed(\d+)", log.parent.name)[1])
        runs.append((str(log), model, scale, scale_tokens(scales[scale]), seed))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=("test", "train"), default="test", help="fixed batch (default: test)")
    args = parser.parse_args()
    config = merged(yaml.safe_load(CONFIG.read_text()), yaml.safe_load(TRAINING.read_text()))
    scales = resolve_scales(config["training"]["scales"])
    runs = kept_runs(scales)
    # in the order the rules take them: figure1.runs, and token_ablation's models x scales
    drawn = [run_model_scale(r) for r in config["figure1"]["runs"]]
    figure1 = sorted((r for r in runs if (r[1], r[2]) in drawn), key=lambda r: (drawn.index((r[1], r[2])), r[4]))
    thresholds = config["figure1"]["claims"]
    claims = training_claims(figure1, config["figure1"]["skip_epochs_runs"], thresholds["phiq_ratio_below"], thresholds["jproj_h_factor"])
    print(training_claims_markdown(claims, args.split, TRAINING_MODEL_NAMES))
    ablation = config["token_ablation"]
    order = [(m, s) for m in ablation["models"] for s in ablation["scales"]]
    kept = sorted((r for r in runs if (r[1], r[2]) in order), key=lambda r: (order.index((r[1], r[2])), r[4]))
    print(token_ablation_markdown(token_ablation_table(kept), args.split, TRAINING_MODEL_NAMES))
    # the claims of the ablation scales that Figure 1 does not draw, counted the same way
    others = [r for r in kept if (r[1], r[2]) not in drawn]
    if others:
        extra = training_claims(others, config["figure1"]["skip_epochs_runs"], thresholds["phiq_ratio_below"], thresholds["jproj_h_factor"])
        print(training_claims_markdown(extra, args.split, TRAINING_MODEL_NAMES))


if __name__ == "__main__":
    main()
