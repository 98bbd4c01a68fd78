"""The vision capture (issue 16): every supported timm family stores the q, k, v its
attention really uses, every other family is refused with its reason before any job, and
the invariant check fails a job whose capture is wrong.

Tiny randomly initialised models (2 blocks, 32 x 32 images, 8 x 8 patches, 3 heads of
d = 16), with every parameter perturbed so that norms, q/v biases and layer scales are not
at their identity initial values. No download.
"""

from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest
import timm
import torch

from kpca_repro import activations
from kpca_repro.activations import ActivationFile
from kpca_repro.capture import vision
from kpca_repro.capture.extraction import extract_vision
from kpca_repro.capture.vision import UnsupportedArchitectureError
from kpca_repro.inputs import images
from kpca_tools.recorders import AttentionRecorder

from conftest import real_deit_tiny

SMALL = {"depth": 2, "img_size": 32, "patch_size": 8, "embed_dim": 48, "num_heads": 3}

#: case -> (timm id, model_kwargs): one per supported family and variant
SUPPORTED = {
    "vit": ("vit_tiny_patch16_224", SMALL),
    "deit-distilled": ("deit_tiny_distilled_patch16_224", SMALL),
    "dinov2-registers": ("vit_small_patch14_reg4_dinov2", SMALL),  # 4 registers, layer scale
    "vit-qk-norm": ("vit_tiny_patch16_224", {**SMALL, "qk_norm": True}),
    "rope-vit": ("vit_small_patch16_rope_224", SMALL),
    "rope-vit-mixed": ("vit_small_patch16_rope_mixed_224", SMALL),
    "rope-vit-qk-norm": ("vit_small_patch16_rope_224", {**SMALL, "qk_norm": True}),
    "rope-vit-register": ("vit_base_patch16_rope_reg1_gap_256", SMALL),
    "eva02-qv-bias": ("eva02_tiny_patch14_224", SMALL),
    "eva02-no-bias": ("eva02_tiny_patch14_224", {**SMALL, "qkv_bias": False}),
    "eva02-sub-ln": ("eva02_tiny_patch14_224", {**SMALL, "scale_attn_inner": True}),
    "eva02-separate-qkv": ("eva02_tiny_patch14_224", {**SMALL, "qkv_fused": False}),
}

#: case -> (timm id, model_kwargs, words the refusal must contain); built on the meta device only
REFUSED = {
    "relpos": ("vit_relpos_small_patch16_224", {}, "relative position bias"),
    "beit": ("beit_base_patch16_224", {}, "relative position bias"),
    "cait": ("cait_xxs24_224", {}, "class attention"),
    "swin": ("swin_tiny_patch4_window7_224", {}, "no 'blocks'"),
    "differential": ("vit_tiny_patch16_224", {"attn_layer": "diff"}, "differential attention"),
    "grouped-query": ("vit_small_patch16_rope_224", {"num_heads": 4, "num_kv_heads": 2, "qkv_fused": False}, "grouped-query"),
    "parallel-blocks": ("vit_small_patch16_18x2_224", {}, "not a block the capture knows"),
    "other-class": ("xcit_nano_12_p16_224", {}, "is not one the capture knows"),
}


def _perturbed_model(model_id: str, kwargs: dict, seed: int = 0) -> torch.nn.Module:
    """A random model in eval mode with every parameter moved off its initial value."""
    torch.manual_seed(seed)
    model = timm.create_model(model_id, pretrained=False, **kwargs).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _perturbed_weights(model_id: str, kwargs: dict, path, seed: int = 0):
    """:func:`_perturbed_model`'s state_dict saved as safetensors at ``path``."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in _perturbed_model(model_id, kwargs, seed).state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="module")
def samples(photos_dir):
    return images.sample_images(images.list_images(photos_dir, "flat"), 3, seed=0)


def _extract(case, tmp_path, samples, batch_size=2):
    model_id, kwargs = SUPPORTED[case]
    weights = _perturbed_weights(model_id, kwargs, tmp_path / f"{case}.safetensors")
    out = tmp_path / f"{case}.h5"
    extract_vision(model_id, weights, "x", samples, out, batch_size=batch_size, device=torch.device("cpu"), model_kwargs=kwargs, progress=False)
    return weights, out


@pytest.mark.parametrize("case", sorted(SUPPORTED))
def test_supported_family_stores_q_k_v_that_reproduce_h(case, tmp_path, samples):
    """Stored q, k, v give back the stored h (all images, all heads), the file records a small
    measured error and the scale, and h is the model's own: through the module's norm and
    output projection it gives back the attention module's output."""
    model_id, kwargs = SUPPORTED[case]
    weights, out = _extract(case, tmp_path, samples)
    with ActivationFile(out) as af:
        n_layers, heads, d = af.n_layers, int(af.attrs["n_heads"]), int(af.attrs["head_dim"])
        scale = float(af.attrs["attention_scale"])
        assert scale == pytest.approx(d**-0.5, rel=1e-12)
        stored = float(af.attrs["capture_max_rel_error"])
        assert 0 < stored <= 1e-5 < float(af.attrs["capture_rtol"])
        # 2 batches (2 + 1 images): first and last image of each = 3 images, every head and layer
        assert int(af.attrs["capture_heads_checked"]) == 3 * heads * n_layers
        worst = 0.0
        for layer in range(n_layers):
            t = af.read(layer)
            assert t["q"].shape == (3, heads, int(af.attrs["n_tokens"]), d)
            worst = max(worst, activations.attention_invariant(t["q"], t["k"], t["v"], t["h"], scale=scale).max_rel_error)
    assert worst <= 1e-5 and stored <= worst * (1 + 1e-9)
    model = vision.load_timm_model(model_id, weights, kwargs)
    plan = vision.capture_plan(model, model_id)
    outputs = {}
    hooks = [a.register_forward_hook(lambda m, i, o, layer=layer: outputs.__setitem__(layer, o)) for layer, (a, _) in enumerate(plan)]
    with torch.no_grad(), vision.CaptureRecorder(plan, model_id) as rec:
        model(torch.randn(2, 3, 32, 32))
    for hook in hooks:
        hook.remove()
    with torch.no_grad():  # hooks removed: proj and norm are called here without recording
        for layer, (attn, _) in enumerate(plan):
            h = rec.captured[layer]["h"]
            b, _, n, _ = h.shape
            torch.testing.assert_close(attn.proj(attn.norm(h.transpose(1, 2).reshape(b, n, -1))), outputs[layer], rtol=1e-5, atol=1e-5)


def test_the_projection_hooks_alone_miss_what_the_attention_uses():
    """Why the adapters exist: q, k taken at the qkv Linear do not explain h once q/k are
    normalised or rotated (error of order 1), while the adapters' do (float32 round-off)."""
    for case in ("vit-qk-norm", "rope-vit", "eva02-no-bias"):
        model_id, kwargs = SUPPORTED[case]
        model = _perturbed_model(model_id, kwargs)
        plan = vision.capture_plan(model, model_id)
        x = torch.randn(2, 3, 32, 32)
        with torch.no_grad(), AttentionRecorder(a for a, _ in plan) as raw:
            model(x)
        with torch.no_grad(), vision.CaptureRecorder(plan, model_id) as rec:
            model(x)
        for layer in range(len(plan)):
            err = {name: activations.attention_invariant(*(r.captured[layer][t] for t in "qkvh"), scale=plan[0][0].head_dim ** -0.5).max_rel_error for name, r in (("raw", raw), ("adapter", rec))}
            assert err["raw"] > 100 * activations.INVARIANT_RTOL and err["adapter"] < 1e-5, (case, layer, err)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_family_fails_with_one_line_naming_model_reason_and_supported(case):
    model_id, kwargs, reason = REFUSED[case]
    with pytest.raises(vision.UnsupportedArchitectureError) as info:
        vision.check_vision_model(model_id, kwargs)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{model_id}: ") and reason in msg and vision.SUPPORTED_FAMILIES in msg


@pytest.mark.parametrize("change, reason", [("gate", "gates its head outputs"), ("scale", "scales the logits by 0.3")])
def test_gated_attention_and_another_scale_are_refused(change, reason):
    model_id, kwargs = SUPPORTED["vit"]
    with torch.device("meta"):
        model = timm.create_model(model_id, pretrained=False, **kwargs)
    attn = model.blocks[1].attn
    if change == "gate":
        attn.gate = torch.nn.Linear(48, 48, device="meta")
    else:
        attn.scale = 0.3
    with pytest.raises(vision.UnsupportedArchitectureError, match=f"blocks\\[1\\].attn {reason}"):
        vision.capture_plan(model, model_id)


def test_an_attention_mask_is_refused_during_the_forward_pass():
    model_id, kwargs = SUPPORTED["vit"]
    model = timm.create_model(model_id, pretrained=False, **kwargs).eval()
    mask = torch.ones(17, 17, dtype=torch.bool)
    with torch.no_grad(), vision.CaptureRecorder(vision.capture_plan(model, model_id), model_id):
        with pytest.raises(vision.UnsupportedArchitectureError, match="attention mask"):
            model.forward_features(torch.randn(1, 3, 32, 32), attn_mask=mask)


def test_model_kwargs_that_timm_rejects_are_a_build_error():
    with pytest.raises(vision.ModelBuildError, match="no_such_kwarg"):
        vision.check_vision_model("vit_tiny_patch16_224", {"no_such_kwarg": 1})
    check = vision.check_vision_model("eva02_tiny_patch14_224", SMALL)  # a supported model: its structure, built on the meta device
    assert (check.depth, check.n_heads, check.head_dim, check.scale) == (SMALL["depth"], SMALL["num_heads"], 16, 16**-0.5)


def _skip_q_norm(attn, x, rope):
    b, n, _ = x.shape
    q, k, v = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return q, attn.k_norm(k), v  # q_norm left out


def _skip_rope(attn, x, rope):
    return vision._qkv_rotary(attn, x, None)  # the rotary embedding left out


@pytest.mark.parametrize("case, cls_name, wrong", [("vit-qk-norm", "Attention", _skip_q_norm), ("rope-vit", "AttentionRope", _skip_rope)])
def test_a_wrong_capture_fails_the_job_and_leaves_no_file(case, cls_name, wrong, tmp_path, samples, monkeypatch):
    cls = {c.__name__: c for c in vision.capture_adapters()}[cls_name]
    monkeypatch.setitem(vision.capture_adapters(), cls, dataclasses.replace(vision.capture_adapters()[cls], qkv=wrong))
    with pytest.raises(activations.CaptureMismatchError, match=f"{SUPPORTED[case][0]}: the captured q, k, v of layer 0"):
        _extract(case, tmp_path, samples)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{case}.safetensors"]  # no .h5, no .partial.h5


def test_real_deit_tiny_capture_is_the_qkv_and_proj_hooks_bit_for_bit(tmp_path, photos_dir):
    """Real DeiT-Tiny: the adapter's q, k, v, h equal, bit for bit, what the former capture
    (hooks on qkv and proj, ``AttentionRecorder``) gives for the same images."""
    _, weights, image_dir = real_deit_tiny()
    model_id = "deit_tiny_patch16_224"
    smp = images.sample_images(images.list_images(image_dir, "flat"), 3, seed=0)
    out = tmp_path / "deit.h5"
    extract_vision(model_id, weights, "x", smp, out, batch_size=3, device=torch.device("cpu"), progress=False)
    model = vision.load_timm_model(model_id, weights)
    tf = images.paper_transform(224)
    x = torch.stack([tf(images.load_image(p)) for p in smp["path"]])
    with torch.no_grad(), AttentionRecorder(vision.attention_modules(model)) as rec:
        model(x)
    with h5py.File(out) as f:
        assert float(f.attrs["capture_max_rel_error"]) < 1e-5 and float(f.attrs["attention_scale"]) == 0.125
        for layer in range(12):
            old = rec.numpy_layer(layer)
            for t in "qkvh":
                assert np.array_equal(f[f"layers/{layer:02d}/{t}"][:], old[t]), (layer, t)


def test_an_unsupported_model_fails_its_extraction_job_in_one_line():
    """The check the extraction job runs first (workflow/scripts/extract_vision.py, through
    smk.fail_cleanly: the message is the job's one ERROR line): a refused model names itself and
    the reason, with the supported families; the supported EVA-02 passes the same check."""
    eva, relpos = "eva02_tiny_patch14_224", "vit_relpos_small_patch16_224"
    assert vision.check_vision_model(eva, SMALL).depth == SMALL["depth"]
    with pytest.raises(UnsupportedArchitectureError) as info:
        vision.check_vision_model(relpos, SMALL)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"{relpos}: unsupported for the attention capture: relative position bias"), line
    assert vision.SUPPORTED_FAMILIES in line
