"""One-off check behind docs/training.md (Figures 1 and 4): per-layer mean, median and maximum of
||phi(q)||^2 and ||h||^2 on the fixed validation batch of a finished training checkpoint.

    PYTHONPATH=src python docs/phi_tail_check.py vit_tiny small     # or: deit_tiny medium 2, ... (seed, default 0)

The model and scale are read from config/config.yaml (scales resolved through their `base`).
The last line is over all layers: the mean is what J_proj's log averages, the median is the
typical token. Every epoch's log now holds the pooled median and 0.99 quantile too
(kpca_repro.training.logs.TOKEN_STATS); this script adds the per-layer view of the last epoch.
"""

import sys

import torch
import yaml

from kpca_repro import projection
from kpca_repro.training.checkpoint import load_checkpoint
from kpca_repro.training.model import build_model, recording_attentions
from kpca_repro.training.summary import run_dir
from kpca_repro.workflow.config_checks import resolve_scales

arch, scale_name = sys.argv[1], sys.argv[2]
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
cfg = yaml.safe_load(open("config/config.yaml"))["training"]
model_cfg, scale = cfg["models"][arch], resolve_scales(cfg["scales"])[scale_name]
m = build_model(
    model_cfg["timm_id"],
    num_heads=model_cfg["num_heads"],
    standardize_qk=model_cfg["standardize_qk"],
    num_classes=10,
    img_size=scale["img_size"],
    patch_size=scale["patch_size"],
    in_chans=1,
    depth=scale["depth"],
    embed_dim=scale["embed_dim"],
)
st = load_checkpoint(f"{run_dir(arch, scale_name, seed)}/checkpoint.pt")  # tensors and plain values only
m.load_state_dict(st["model"])
m.eval()
attns = recording_attentions(m)
for a in attns:
    a.record = True
with torch.no_grad():
    m(st["fixed"]["test"])
phis, hs = [], []
for layer, a in enumerate(attns):
    r = a.recorded
    phi = projection.feature_norm_sq(r["q"], r["k"], scale=a.scale, log_domain=False)
    h = projection.output_norm_sq(r["h"])
    phis.append(phi.flatten())
    hs.append(h.flatten())
    print(
        arch,
        scale_name,
        layer,
        f"phi mean {phi.mean():.3g} median {phi.median():.3g} max {phi.max():.3g} | h mean {h.mean():.3g} median {h.median():.3g} | frac phi>h {(phi > h).float().mean():.3f}",
    )
phi, h = torch.cat(phis), torch.cat(hs)
print(arch, scale_name, "all", f"phi mean {phi.mean():.3g} median {phi.median():.3g} max {phi.max():.3g} | h mean {h.mean():.3g} median {h.median():.3g} | frac phi>h {(phi > h).float().mean():.3f}")
