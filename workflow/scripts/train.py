"""Rule train: train one model at one scale with one seed from scratch, logging J_proj after every epoch."""

import sys

import timm
import torch

from kpca_repro.smk import setup_logging
from kpca_repro.threads import resolve_device
from kpca_repro.training.checkpoint import config_fingerprint
from kpca_repro.training.data import build_datasets
from kpca_repro.training.loop import train_run
from kpca_repro.training.model import build_model

smk = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(smk, "train")
torch.set_num_threads(smk.threads)
# the seed is the run's wildcard (results/training/<model>_<scale>/seed<seed>/), the scale without its seed list
model_cfg, scale, seed = dict(smk.params.model), dict(smk.params.scale), int(smk.wildcards.seed)
if not timm.is_model(model_cfg["timm_id"]):
    log.error("config key training.models.%s.timm_id: %r is not a timm model id (see timm.list_models())", smk.wildcards.arch, model_cfg["timm_id"])
    sys.exit(1)
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
    # the code that computes the numbers is part of the run's identity (params.code: the modules this
    # script imports, without docstrings and comments): when Snakemake reruns this job because one of
    # them changed, an old checkpoint is not resumed
    fingerprint=config_fingerprint(model_cfg, scale, seed, str(device), [smk.params.code]),
    num_workers=smk.params.num_workers,
)
