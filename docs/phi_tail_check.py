"""One-off check behind docs/results.md (Figures 1 and 4): per-layer mean, median and maximum of
||phi(q)||^2 and ||h||^2 on the fixed validation batch of a finished `small` checkpoint.

    PYTHONPATH=src python docs/phi_tail_check.py vit_tiny 3     # or: deit_tiny 6
"""

import sys

import torch

from kpca_repro import kpca, training

arch, heads = sys.argv[1], int(sys.argv[2])
m = training.build_model(f"{arch}_patch16_224", num_heads=heads, standardize_qk=True, num_classes=10, img_size=28, patch_size=7, in_chans=1, depth=6)
st = torch.load(f"results/training/{arch}_small/checkpoint.pt", weights_only=False)
m.load_state_dict(st["model"])
m.eval()
attns = training.recording_attentions(m)
for a in attns:
    a.record = True
with torch.no_grad():
    m(st["fixed"]["test"])
for layer, a in enumerate(attns):
    r = a.recorded
    phi = kpca.feature_norm_sq(r["q"], r["k"], scale=a.scale, log_domain=False)
    h = kpca.output_norm_sq(r["h"])
    print(
        arch,
        layer,
        f"phi mean {phi.mean():.3g} median {phi.median():.3g} max {phi.max():.3g} | h mean {h.mean():.3g} median {h.median():.3g} | frac phi>h {(phi > h).float().mean():.3f}",
    )
