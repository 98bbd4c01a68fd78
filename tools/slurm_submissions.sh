#!/usr/bin/env bash
# The SLURM submission lines of the paper's full workload, without a cluster
# (docs/scaleout.md): Tables 1-4 and Figures 1-5 in both variants. That is 10 timm models x
# 100 images in SHARDS shards (25 for Tables 2-3), the 9 language models x 100 WikiText rows,
# and the two paper-scale training runs of Figures 1 and 4.
#
#   bash tools/slurm_submissions.sh [SHARDS] [OUT_DIR]
#   WORKLOAD=vision bash tools/slurm_submissions.sh ...   # Tables 1-3 and Figures 2-3 only
#
# 1. a dry run with profiles/slurm lists every job;
# 2. a run with the stand-in sbatch/sacct of tools/slurm_standin on PATH records every sbatch
#    call Snakemake's SLURM executor makes. The stand-in runs each wrapped job with --touch,
#    so outputs appear empty and the dependent jobs are submitted in turn: nothing is computed.
# Nothing is read from the placeholders: timm weights are empty files, each language model is
# a folder with a config.json naming only its model type, and ImageNet-1k for training is empty train/ and val/
# folders. Images are the 1000-image sample, text rows the WikiText-103 test split, and the
# authors' training logs come from ../shared.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SHARDS=${1:-4}
OUT=${2:-$REPO/docs/scaleout}
MODELS=${MODELS:-}  # e.g. MODELS=deit_tiny_patch16_224 for a quick check
WORKLOAD=${WORKLOAD:-full}
WORK=${WORK:-$(mktemp -d)}
[ -n "${KEEP:-}" ] || trap 'rm -rf "$WORK"' EXIT
SHARED=$(cd "$REPO/../shared" && pwd)
mkdir -p "$WORK/resources/weights/timm" "$WORK/resources/images" "$WORK/resources/text" "$OUT"
ln -s "$SHARED/assets/images/imagenet-sample" "$WORK/resources/images/imagenet-sample"
ln -s "$SHARED/assets/text/wikitext-103" "$WORK/resources/text/wikitext-103"
python - "$REPO/config/config.yaml" "$WORK" "$SHARDS" "$MODELS" "$WORKLOAD" "$SHARED" <<'PY'
import sys, yaml, pathlib
cfg = yaml.safe_load(open(sys.argv[1]))
work, shards, models, workload, shared = pathlib.Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
for m in cfg["vision"]["models"]:
    (work / "resources/weights/timm" / f"{m}.safetensors").touch()
# a GPU cluster: device cuda (device auto declares a GPU only where the submitting node has one)
# the paper's workload: no decoders (beyond the paper, docs/method.md 16)
over = {"resources_dir": str(work / "resources"), "offline": True, "device": "cuda", "vision": {"shards": shards}, "decoders": {"models": []}}
if workload == "vision":  # language models and training runs left out
    over |= {"text": {"models": []}, "figure1": {"runs": [], "use_reference": False}, "token_ablation": {"models": []}}
else:
    local = {}
    for model_id in cfg["text"]["models"]:
        folder = work / "models" / model_id.replace("/", "--")
        folder.mkdir(parents=True)
        # only the model type: the configuration check reads it while the DAG is built
        kind = next(t for t in ("xlm-roberta", "roberta", "electra", "longformer", "camembert", "luke", "bert", "minilm") if t in model_id.lower())
        (folder / "config.json").write_text('{"model_type": "%s"}\n' % ("bert" if kind == "minilm" else kind))
        local[model_id] = str(folder)
    imagenet = work / "imagenet"
    for split in ("train", "val"):
        (imagenet / split).mkdir(parents=True)
    over |= {
        "text": {"local_models": local},
        "training": {"scales": {"paper": {"imagenet_root": str(imagenet)}}},
        "figure1": {"runs": [f"{arch}_paper" for arch in cfg["training"]["models"]], "use_reference": True, "reference_logs": f"{shared}/reference/training_logs"},
        "token_ablation": {"models": []},  # this project's CPU ablation, not part of the paper's workload
    }
if models:
    over["vision"]["models"] = models.split(",")
    over["figure3"] = {"model": over["vision"]["models"][0]}
(work / "workload.yaml").write_text(yaml.safe_dump(over))
PY
SMK=(python -m snakemake -s "$REPO/Snakefile" -d "$WORK" --profile "$REPO/profiles/slurm" --workflow-profile none --configfile "$WORK/workload.yaml")
"${SMK[@]}" -n --quiet rules 2>&1 | sed "s#$WORK#<workdir>#g; s#$REPO#<repo>#g" > "$OUT/dryrun_jobs.txt"
"${SMK[@]}" -n > "$WORK/dryrun_full.txt" 2>&1
python - "$WORK/dryrun_full.txt" "$WORK/outputs.json" <<'PY'
import json, re, sys
jobs, cur = {}, None
for line in open(sys.argv[1]):
    if m := re.match(r"(?:local)?rule (\S+):", line):
        cur = {"rule": m.group(1), "files": [], "wildcards": ""}
        jobs[id(cur)] = cur
    elif cur and (m := re.match(r"\s+(output|benchmark|wildcards): (.*)", line)):
        if m.group(1) == "wildcards":
            cur["wildcards"] = m.group(2).replace(", ", ",")
        else:
            cur["files"] += m.group(2).split(", ")
out = {f"{j['rule']}:{j['wildcards']}" if j["wildcards"] else j["rule"]: j["files"] for j in jobs.values()}
json.dump(out, open(sys.argv[2], "w"))
PY
export STANDIN_LOG="$WORK/sbatch_calls.txt" STANDIN_OUTPUTS="$WORK/outputs.json"
# --keep-going: the local rules (tables, figures) then run here on the empty files and fail,
# which is expected; every job for SLURM has been submitted by then.
PATH="$REPO/tools/slurm_standin:$PATH" "${SMK[@]}" --keep-going --latency-wait 5 --slurm-init-seconds-before-status-checks 1 --seconds-between-status-checks 1 ${EXTRA:-} > "$WORK/run.log" 2>&1 || true
sed "s#$WORK#<workdir>#g" "$STANDIN_LOG" > "$OUT/sbatch_calls.txt"
sed "s#$WORK#<workdir>#g; s#$REPO#<repo>#g" "$STANDIN_LOG.example_wrap" > "$OUT/example_job_command.txt"
python - "$OUT/sbatch_calls.txt" "$OUT/dryrun_jobs.txt" <<'PY' | tee "$OUT/summary.txt"
import collections, re, sys
calls = [l for l in open(sys.argv[1]) if l.startswith("sbatch")]
per_rule = collections.Counter(re.search(r"--comment rule_(\w+?)_wildcards", l).group(1) for l in calls)
planned = dict(re.findall(r"^(\w+)\s+(\d+)$", open(sys.argv[2]).read(), re.M))
for rule, n in sorted(per_rule.items()):
    print(f"{rule:20s} submitted {n:4d} of {planned.get(rule)} planned")
print(f"{'total':20s} submitted {len(calls):4d}")
PY
