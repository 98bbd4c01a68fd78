"""Figures 2 and 5: squared norms from activation files, per-layer statistics, the DAG."""

from __future__ import annotations

import math

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from kpca_repro import projection
from kpca_repro.activations import CorruptActivationFileError, write_activations
from kpca_repro.analysis import norms
from kpca_repro.analysis.norms import norm_statistics, sentence_samples, squared_norms
from kpca_repro.capture.extraction import extract_vision
from kpca_repro.capture.vision import attention_modules, load_timm_model
from kpca_repro.inputs import images, resources

from conftest import REPO, TINY_KWARGS, real_deit_tiny, run_snakemake

# --------------------------------------------------------------------------------------
# The statistics and the formulas
# --------------------------------------------------------------------------------------


def test_layer_statistics_closed_form():
    """1..100: the 95th percentile is 95.05, so 1..95 are kept; median 48, quartiles 24.5 / 71.5."""
    x = np.arange(1.0, 101.0)
    s = norms.layer_norm_statistics(x, trim=95.0, band=(25.0, 75.0))
    assert s["trim_threshold"] == pytest.approx(95.05) and s["n_kept"] == 95 and s["n_values"] == 100
    assert (s["median"], s["q25"], s["q75"]) == pytest.approx((48.0, 24.5, 71.5))
    assert (s["band_lower"], s["band_upper"]) == pytest.approx((24.5, 71.5))
    assert (s["min"], s["max"], s["mean"], s["mean_all"]) == pytest.approx((1.0, 95.0, 48.0, 50.5))


def test_layer_statistics_against_numpy_percentiles():
    rng = np.random.default_rng(0)
    x = np.exp(rng.normal(0, 3, size=997))
    x[[3, 50]] = [np.nan, np.inf]
    finite = x[np.isfinite(x)]
    kept = finite[finite <= np.percentile(finite, 95)]
    s = norms.layer_norm_statistics(x, trim=95.0)
    assert s["n_nonfinite"] == 2 and s["n_kept"] == kept.size == math.floor(0.95 * (995 - 1)) + 1
    np.testing.assert_allclose([s["median"], s["band_lower"], s["band_upper"]], np.percentile(kept, [50, 25, 75]))
    c = norms.layer_norm_statistics(x, trim=None, band=norms.CORRECTED_NORMS_BAND)
    assert c["n_kept"] == 995 and math.isnan(c["trim_threshold"])
    np.testing.assert_allclose([c["median"], c["band_lower"], c["band_upper"]], np.percentile(finite, [50, 2.5, 97.5]))
    assert c["band_lower"] < c["q25"] < c["median"] < c["q75"] < c["band_upper"]
    with pytest.raises(ValueError, match="no finite value"):
        norms.layer_norm_statistics(np.array([np.nan]))
    with pytest.raises(ValueError, match="band"):
        norms.layer_norm_statistics(x, band=(75.0, 25.0))


def test_nlp_norms_form_equals_direct_formula_and_zeroes_overflow():
    """nlp_norms.py's exp(s|q|^2 - 2 log sum) equals the direct formula; an overflowing sum gives 0."""
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 9, 32, generator=gen), torch.randn(2, 9, 32, generator=gen)
    s = 1 / 8
    direct = torch.exp(s * (q.double() * q.double()).sum(-1)) / torch.exp(s * q.double() @ k.double().transpose(-1, -2)).sum(-1) ** 2
    got = projection.feature_norm_sq(q, k, scale=s, log_domain=False, log_of_sum=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), direct, rtol=1e-5, atol=0)
    torch.testing.assert_close(projection.feature_norm_sq(q, k, scale=s).double(), direct, rtol=1e-5, atol=0)
    big = torch.full((1, 3, 32), 10.0)  # s q.k = 400 > 88.7: the float32 sum overflows
    assert (projection.feature_norm_sq(big, big, scale=s, log_domain=False, log_of_sum=True) == 0).all()
    assert torch.isfinite(projection.log_feature_norm_sq(big.double(), big.double(), scale=s)).all()


# --------------------------------------------------------------------------------------
# Vision: the stored h of a tiny timm ViT against a naive recomputation
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vit_file(tiny_resources, photos_dir, tmp_path_factory):
    model_id = "vit_tiny_patch16_224"
    weights = tiny_resources / "weights" / "timm" / f"{model_id}.safetensors"
    samples = images.sample_images(images.list_images(photos_dir, "flat"), 3, seed=0)
    out = tmp_path_factory.mktemp("norms") / "vision_3_0of1.h5"
    extract_vision(model_id, weights, resources.sha256_file(weights), samples, out, batch_size=2, device=torch.device("cpu"), model_kwargs=TINY_KWARGS[model_id], progress=False)
    return model_id, weights, samples, out


def _naive_norms(model_id, weights, samples):
    """Per layer (images, heads, tokens) ||h||^2 and ||phi||^2 from the model's own qkv, by loops."""
    model = load_timm_model(model_id, weights, TINY_KWARGS[model_id])
    tf = images.paper_transform(32)
    x = torch.stack([tf(images.load_image(p)) for p in samples["path"]])
    attns = attention_modules(model)
    qkv = {}
    handles = [a.qkv.register_forward_hook(lambda m, i, o, layer=layer: qkv.__setitem__(layer, o.double())) for layer, a in enumerate(attns)]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    out = []
    for layer, a in enumerate(attns):
        b, n, _ = qkv[layer].shape
        heads, d = a.num_heads, a.head_dim
        t = qkv[layer].reshape(b, n, 3, heads, d)
        h_sq, phi = np.zeros((b, heads, n)), np.zeros((b, heads, n))
        for img in range(b):
            for head in range(heads):
                q, k, v = t[img, :, 0, head], t[img, :, 1, head], t[img, :, 2, head]
                for i in range(n):
                    w = torch.exp(torch.stack([q[i] @ k[j] / math.sqrt(d) for j in range(n)]))
                    h_i = (w[:, None] * v).sum(0) / w.sum()
                    h_sq[img, head, i] = float(h_i @ h_i)
                    phi[img, head, i] = math.exp(float(q[i] @ q[i]) / math.sqrt(d)) / float(w.sum()) ** 2
        out.append({"h": h_sq, "phi": phi})
    return out


def test_stored_h_norms_equal_naive_attention_on_a_tiny_vit(tiny_vit_file):
    model_id, weights, samples, path = tiny_vit_file
    naive = _naive_norms(model_id, weights, samples)
    with h5py.File(path) as f:
        for layer, ref in enumerate(naive):
            t = {name: torch.from_numpy(f[f"layers/{layer:02d}/{name}"][:]) for name in ("q", "k", "v", "h")}
            phi_c, h_c, valid = squared_norms(t["q"], t["k"], t["v"], t["h"], "corrected", head_dim=int(f.attrs["head_dim"]))
            assert valid.all() and h_c.dtype == torch.float64
            np.testing.assert_allclose(h_c.numpy(), ref["h"], rtol=1e-4)
            np.testing.assert_allclose(phi_c.numpy(), ref["phi"], rtol=1e-4)
            _, h_p, _ = squared_norms(t["q"], t["k"], t["v"], t["h"], "paper")
            np.testing.assert_allclose(h_p.numpy(), ref["h"], rtol=1e-4)
    # the per-layer statistics are those of the naive values (d = 64, so s = 1/8 = 1/sqrt(d) here)
    for variant, trim, band in (("corrected", None, norms.CORRECTED_NORMS_BAND), ("paper", 95.0, norms.PAPER_NORMS_BAND)):
        stats = norm_statistics([path], variant, progress=False)
        assert len(stats) == len(naive) * 2 and (stats["n_values"] == 3 * 3 * 17).all()
        for layer, ref in enumerate(naive):
            for quantity in ("phi", "h"):
                row = stats[(stats["layer"] == layer) & (stats["quantity"] == quantity)].iloc[0]
                expected = norms.layer_norm_statistics(ref[quantity], trim=trim, band=band)
                assert row["median"] == pytest.approx(expected["median"], rel=1e-4)
                assert row["band_upper"] == pytest.approx(expected["band_upper"], rel=1e-4)


@pytest.mark.realweights
def test_real_deit_tiny_phi_is_far_below_h(tmp_path):
    """DeiT-Tiny, the paper's k = 1 image: in every layer median ||phi(q)||^2 << median ||h||^2."""
    _, weights, image_dir = real_deit_tiny()
    samples = images.sample_images(images.list_images(image_dir, "flat"), 1, seed=0)
    out = tmp_path / "vision_1_0of1.h5"
    extract_vision("deit_tiny_patch16_224", weights, "x", samples, out, batch_size=1, device=torch.device("cpu"), progress=False)
    for variant in ("paper", "corrected"):
        stats = norm_statistics([out], variant, progress=False)
        med = stats.pivot(index="layer", columns="quantity", values="median")
        assert len(med) == 12 and (stats["n_values"] == 3 * 197).all()
        assert (med["h"] > 10 * med["phi"]).all()


# --------------------------------------------------------------------------------------
# Language models: synthetic activation files with an attention mask
# --------------------------------------------------------------------------------------


def _write_text_file(path, q, k, v, h, mask, model_id="org/tiny-lm"):
    """A language-model activation file: the vision layout plus a root attention_mask (B, N)."""
    layers = [{"q": q[layer], "k": k[layer], "v": v[layer], "h": h[layer]} for layer in range(len(q))]
    write_activations(path, layers, model_id=model_id, attention_mask=mask, check_invariant=False)  # padded positions hold noise


def _synthetic_text(seed, lengths=(5, 3, 6), n=6, d=32, heads=2, layers=2, pad_value=0.0):
    """Random q, k, v; h = the masked attention a model computes; padded positions = pad_value noise."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(0, 1.5, (layers, len(lengths), heads, n, d)).astype(np.float32) for _ in range(3))
    mask = np.array([[1] * m + [0] * (n - m) for m in lengths])
    km = torch.from_numpy(mask.astype(bool))[None, :, None, :]
    h = projection.attention_output(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), key_mask=km).numpy()
    pad = ~mask.astype(bool)[None, :, None, :, None].repeat(d, -1)
    pad = np.broadcast_to(pad, q.shape)
    junk = rng.normal(0, 1, q.shape).astype(np.float32) * pad_value
    for arr in (q, k, v, h):
        arr[pad] = junk[pad]
    return q, k, v, h, mask


def test_corrected_text_norms_exclude_padding(tmp_path):
    q, k, v, h, mask = _synthetic_text(0)
    _write_text_file(tmp_path / "a.h5", q, k, v, h, mask)
    q2, k2, v2, h2, _ = _synthetic_text(0, pad_value=40.0)  # same real tokens, huge padding
    _write_text_file(tmp_path / "b.h5", q2, k2, v2, h2, mask)
    a = norm_statistics([tmp_path / "a.h5"], "corrected", language=True, progress=False)
    b = norm_statistics([tmp_path / "b.h5"], "corrected", language=True, progress=False)
    pd.testing.assert_frame_equal(a, b)
    assert (a["n_values"] == 2 * (5 + 3 + 6)).all() and (a["head_dim"] == 32).all()
    assert a["scale"].iloc[0] == pytest.approx(1 / math.sqrt(32))
    # against a direct computation on the unpadded sequences, model's own d = 32
    for layer in range(2):
        phi, hs = [], []
        for seq, m in enumerate(mask.sum(1)):
            for head in range(2):
                qq, kk, hh = (x[layer, seq, head, :m].astype(np.float64) for x in (q, k, h))
                phi.append(np.exp((qq * qq).sum(1) / math.sqrt(32)) / np.exp(qq @ kk.T / math.sqrt(32)).sum(1) ** 2)
                hs.append((hh * hh).sum(1))
        for name, vals in (("phi", phi), ("h", hs)):
            row = a[(a["layer"] == layer) & (a["quantity"] == name)].iloc[0]
            ref = np.concatenate(vals)
            np.testing.assert_allclose([row["median"], row["band_lower"], row["band_upper"]], np.percentile(ref, [50, 2.5, 97.5]), rtol=1e-6)
    # the paper recipe attends to and averages over the padding (docs/method.md 9), so it changes
    pa = norm_statistics([tmp_path / "a.h5"], "paper", language=True, progress=False)
    pb = norm_statistics([tmp_path / "b.h5"], "paper", language=True, progress=False)
    assert (pa["n_values"] == 2 * 3 * 6).all() and not np.allclose(pa["median"], pb["median"])


def test_paper_text_norms_recompute_h_without_the_mask(tmp_path):
    q, k, v, h, mask = _synthetic_text(1, pad_value=1.0)
    _write_text_file(tmp_path / "t.h5", q, k, v, h, mask)
    stats = norm_statistics([tmp_path / "t.h5"], "paper", language=True, progress=False)
    layer = 1
    qq, kk, vv = (torch.from_numpy(x[layer]).double() for x in (q, k, v))
    w = torch.softmax(qq @ kk.transpose(-1, -2) / math.sqrt(32), dim=-1)  # own d, no mask
    h_sq = ((w @ vv) ** 2).sum(-1).numpy().ravel()
    phi = (torch.exp((qq * qq).sum(-1) / 8) / torch.exp(qq @ kk.transpose(-1, -2) / 8).sum(-1) ** 2).numpy().ravel()
    for name, ref in (("h", h_sq), ("phi", phi)):
        row = stats[(stats["layer"] == layer) & (stats["quantity"] == name)].iloc[0]
        kept = ref[ref <= np.percentile(ref, 95)]
        assert row["n_kept"] == kept.size
        np.testing.assert_allclose([row["median"], row["q25"], row["q75"]], np.percentile(kept, [50, 25, 75]), rtol=1e-4)


def test_shards_pool_like_one_file(tmp_path):
    q, k, v, h, mask = _synthetic_text(2, lengths=(4, 6, 2, 5))
    _write_text_file(tmp_path / "all.h5", q, k, v, h, mask)
    _write_text_file(tmp_path / "s0.h5", q[:, :1], k[:, :1], v[:, :1], h[:, :1], mask[:1])
    _write_text_file(tmp_path / "s1.h5", q[:, 1:], k[:, 1:], v[:, 1:], h[:, 1:], mask[1:])
    whole = norm_statistics([tmp_path / "all.h5"], "corrected", language=True, progress=False)
    parts = norm_statistics([tmp_path / "s0.h5", tmp_path / "s1.h5"], "corrected", language=True, progress=False)
    pd.testing.assert_frame_equal(whole, parts)


def test_missing_attention_mask_is_reported_with_the_file(tmp_path):
    q, k, v, h, mask = _synthetic_text(3)
    _write_text_file(tmp_path / "t.h5", q, k, v, h, mask)
    with h5py.File(tmp_path / "t.h5", "a") as f:
        del f["attention_mask"]
    with pytest.raises(CorruptActivationFileError, match="t.h5.*attention_mask"):
        norm_statistics([tmp_path / "t.h5"], "corrected", language=True, progress=False)


def test_sentences_table_keeps_the_text_verbatim(tmp_path):
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    sentences = cfg["figure5"]["sentences"]
    assert "\u2011" in sentences[0]
    table = sentence_samples(sentences)
    table.to_csv(tmp_path / "s.tsv", sep="\t", index=False)
    back = pd.read_csv(tmp_path / "s.tsv", sep="\t")
    assert list(back["text"]) == sentences and list(back["dataset_index"]) == [0, 1]
    with pytest.raises(ValueError, match="figure5.sentences"):
        sentence_samples([" "])


# --------------------------------------------------------------------------------------
# The Figure 5 rules on synthetic activation files (the extraction is another rule)
# --------------------------------------------------------------------------------------


@pytest.mark.integration
def test_figure5_rules_on_synthetic_activations(tmp_path, tiny_resources):
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    models = ["org-a/tiny-lm", "tiny-lm-b"]
    cfg = {
        "offline": True,
        "resources_dir": str(tiny_resources),
        "vision": {"models": ["vit_tiny_patch16_224"], "n_images": 2, "batch_size": 2, "model_kwargs": {"vit_tiny_patch16_224": TINY_KWARGS["vit_tiny_patch16_224"]}},
        "figure3": {"model": "vit_tiny_patch16_224", "block": 1},  # the tiny model has 2 blocks
        "spectra": {"n_images": 2},
        "figure5": {"models": models},
    }
    n_rows = 100
    if "text" in schema["properties"]:  # after the language-model extraction is merged
        n_rows = 3
        cfg["text"] = {"models": models, "n_rows": n_rows}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    for i, model in enumerate(models):
        slug = model.replace("/", "--")
        (tmp_path / "results" / "activations" / slug).mkdir(parents=True)
        for name, lengths in ((f"text_{n_rows}_0of1", (5, 3, 6)), ("text_sentences_0of1", (4, 6))):
            q, k, v, h, mask = _synthetic_text(10 * i + len(lengths), lengths=lengths, layers=3)
            _write_text_file(tmp_path / "results" / "activations" / slug / f"{name}.h5", q, k, v, h, mask, model_id=model)
    targets = ["results/figure5.pdf", "results/figure5_corrected.pdf", "results/samples/text_sentences.tsv"]
    run_snakemake(tmp_path, *targets, "--configfile", str(tmp_path / "c.yaml"), "--allowed-rules", "norms_text", "figure5", "text_sentences")
    for suffix, n_values in (("", 2 * 2 * 6), ("_corrected", 2 * (5 + 3 + 6))):  # heads x tokens
        assert (tmp_path / "results" / f"figure5{suffix}.pdf").read_bytes()[:4] == b"%PDF"
        assert (tmp_path / "results" / f"figure5{suffix}.png").stat().st_size > 10_000
        stats = pd.read_csv(tmp_path / "results" / f"figure5{suffix}.csv")
        assert list(dict.fromkeys(stats["model"])) == models and len(stats) == 2 * 3 * 2
        assert (stats["n_values"] == n_values).all()
    sentences = pd.read_csv(tmp_path / "results" / "samples" / "text_sentences.tsv", sep="\t")
    assert list(sentences["text"]) == yaml.safe_load((REPO / "config" / "config.yaml").read_text())["figure5"]["sentences"]
