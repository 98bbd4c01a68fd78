"""Rule train: train one model at one scale with one seed from scratch, logging J_proj after every epoch."""

from pathlib import Path

import torch

from kpca_repro.check_cache import sha256_file
from kpca_repro.smk import setup_logging
from kpca_repro.threads import resolve_device
from kpca_repro.training.checkpoint import config_fingerprint
from kpca_repro.training.data import build_datasets
from kpca_repro.training.loop import train_run
from kpca_repro.training.model import build_model

#: Library modules that change no number of a training run (logging, error classes, HDF5/atomic files,
#: resource paths, the package marker): left out of the checkpoint's fingerprint.
INFRASTRUCTURE = {"__init__.py", "smk.py", "errors.py", "h5io.py", "resources.py"}

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "train")
torch.set_num_threads(smk.threads)
# the seed is the run's wildcard (results/training/<model>_<scale>/seed<seed>/), the scale without its seed list
model_cfg, scale, seed = dict(smk.params.model), dict(smk.params.scale), int(smk.wildcards.seed)
device = resolve_device(smk.params.device)
train_set, val_set, num_classes, in_chans = build_datasets(scale, smk.params.resources_dir, download=not smk.params.offline)
torch.manual_seed(seed)
model = build_model(
    model_cfg["timm_id"],
    num_heads=model_cfg["num_heads"],
    standardize_qk=model_cfg["standardize_qk"],
    num_classes=num_classes,
    img_size=scale["img_size"],
    patch_size=scale["patch_size"],
    in_chans=in_chans,
    drop_path=scale["drop_path"],
    depth=scale["depth"],
    embed_dim=scale["embed_dim"],
)
log.info("%s at scale %s, seed %d, on %s: %d training / %d validation images, %d epochs", smk.wildcards.arch, smk.wildcards.scale, seed, device, len(train_set), len(val_set), scale["epochs"])
train_run(
    model,
    train_set,
    val_set,
    scale,
    smk.output.log,
    smk.params.checkpoint,
    seed=seed,
    device=device,
    # the code that computes the numbers is part of the run's identity: when Snakemake reruns
    # this job because a module of training/ or a shared one such as projection.py changed, an
    # old checkpoint is not resumed; an edit to logging, file or resource helpers
    # (INFRASTRUCTURE) resumes it
    fingerprint=config_fingerprint(model_cfg, scale, seed, str(device), sorted(sha256_file(p) for p in smk.input.code if Path(p).name not in INFRASTRUCTURE)),
    num_workers=smk.params.num_workers,
)
