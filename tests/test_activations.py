"""Any attention (issue 33): the activation format and its validator, the capture interface on
modules the pipeline never saw, the notebook API against the records stage, the configuration
checks, paths, labels and comparison of user activations (the pipeline runs:
tests/test_activations_workflow.py)."""

from __future__ import annotations

import io
import math
import re
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from kpca_repro import HeadArrays, KpcaJob, analyze_file, analyze_heads
from kpca_repro.activations import ActivationFormatError, CaptureMismatchError, install_user_file, main, validate
from kpca_repro.analysis.comparison import NOT_COMPARABLE, USER_ACTIVATIONS_REASON, mark_user_activations
from kpca_repro.analysis.rendering import USER_LABEL
from kpca_repro.capture.module_capture import HeadCapture, ModuleCapture, record_activations
from kpca_repro.method.placement import plan

# --------------------------------------------------------------------------------------
# Models the pipeline has never seen: a hand-written ViT and a grouped-query attention
# --------------------------------------------------------------------------------------


class HandAttention(nn.Module):
    """Multi-head attention written out by hand, optionally grouped-query (``n_kv < heads``)
    and with a per-head q normalisation (a transform a careless capture misses)."""

    def __init__(self, dim: int, heads: int, n_kv: int | None = None, q_norm: bool = False, scale: float | None = None):
        super().__init__()
        self.heads, self.n_kv, self.d = heads, n_kv or heads, dim // heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, self.n_kv * self.d)
        self.to_v = nn.Linear(dim, self.n_kv * self.d)
        self.q_norm = nn.LayerNorm(self.d) if q_norm else nn.Identity()
        self.scale = self.d**-0.5 if scale is None else scale
        self.out = nn.Linear(dim, dim)

    def project(self, x):
        b, n, _ = x.shape
        q = self.q_norm(self.to_q(x).view(b, n, self.heads, self.d).transpose(1, 2))
        k = self.to_k(x).view(b, n, self.n_kv, self.d).transpose(1, 2)
        v = self.to_v(x).view(b, n, self.n_kv, self.d).transpose(1, 2)
        rep = self.heads // self.n_kv  # each key/value head serves `rep` query heads
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def forward(self, x, attention_mask=None):
        b, n, c = x.shape
        q, k, v = self.project(x)
        logits = (q @ k.transpose(-1, -2)) * self.scale
        if attention_mask is not None:
            logits = logits.masked_fill(~attention_mask.bool()[:, None, None, :], float("-inf"))
        o = (logits.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)
        return self.out(o)


class Block(nn.Module):
    def __init__(self, dim, heads, **kw):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = HandAttention(dim, heads, **kw)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, attention_mask=None):
        x = x + self.attn(self.norm1(x), attention_mask)
        return x + self.mlp(self.norm2(x))


class HandViT(nn.Module):
    """Patch embedding, class token, position embeddings, blocks: a ViT without timm."""

    def __init__(self, dim=16, heads=2, depth=2, img=8, patch=4, **kw):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, 1 + (img // patch) ** 2, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, **kw) for _ in range(depth))

    def forward(self, images):
        x = self.embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return x


class GQAEncoder(nn.Module):
    """A text encoder with grouped-query attention and a padding mask."""

    def __init__(self, vocab=50, dim=16, heads=4, n_kv=2, depth=2, n_max=12):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(1, n_max, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, n_kv=n_kv) for _ in range(depth))

    def forward(self, input_ids, attention_mask):
        x = self.tok(input_ids) + self.pos[:, : input_ids.shape[1]]
        for blk in self.blocks:
            x = blk(x, attention_mask)
        return x


def hand_qkv(module, args, kwargs):
    """The capture a user writes for HandAttention: q, k, v as its dot product uses them
    (q after q_norm, keys and values repeated per query head), the logit scale folded into q."""
    q, k, v = module.project(args[0])
    return q * (module.scale * math.sqrt(module.d)), k, v


def careless_qkv(module, args, kwargs):
    """A wrong capture: q taken at the projection, before the q normalisation."""
    x = args[0]
    b, n, _ = x.shape
    _, k, v = module.project(x)
    return module.to_q(x).view(b, n, module.heads, module.d).transpose(1, 2), k, v


def _hand_vit(seed=0, **kw):
    torch.manual_seed(seed)
    return HandViT(**kw).eval()


def _images(n, seed=1):
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def _token_batch(seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.int64)
    mask[1, 7:] = 0  # padded rows of unequal length
    mask[2, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def write_hand_vit(path, model_id="hand_vit", n=3, **kw):
    model = _hand_vit(**kw)
    capture = ModuleCapture([blk.attn for blk in model.blocks], hand_qkv, lambda m: m.out)
    return record_activations(model, capture, [_images(2), _images(n - 2, seed=5)], path, model_id=model_id)


def write_gqa(path, model_id="gqa_encoder"):
    torch.manual_seed(3)
    model = GQAEncoder().eval()
    capture = ModuleCapture([blk.attn for blk in model.blocks], hand_qkv, lambda m: m.out)
    return record_activations(model, capture, [_token_batch()], path, model_id=model_id)


def _same(a: pd.DataFrame, b: pd.DataFrame, keys=("layer", "sample_rank", "head")):
    """Equal per-head numbers (exactly, after both went through the CSV text the pipeline writes)."""
    keys = list(keys)
    cols = [c for c in b.columns if c not in ("model", "variant")]

    def roundtrip(df):
        buf = io.StringIO()
        df[cols].to_csv(buf, index=False)
        buf.seek(0)
        return pd.read_csv(buf).sort_values(keys, kind="stable").reset_index(drop=True)

    pd.testing.assert_frame_equal(roundtrip(a), roundtrip(b), check_exact=True)


def heads_records(q, k, v, h=None, *, variant="paper", tolerance=None, seed=0, sign_draws=(0, 0), prefix=None, eigh_threads=None, **arrays):
    """The records of :func:`kpca_repro.analyze_heads` on these tensors (``arrays``: the other
    arguments of :class:`kpca_repro.HeadArrays`), in one job of these settings."""
    job = KpcaJob(variant, plan(variant, device="cpu", eigh_threads=eigh_threads), seed=seed, sign_draws=sign_draws, prefix=prefix)
    records, _ = analyze_heads(HeadArrays(q, k, v, h, **arrays), job, tolerance)
    return records


def _api_on_file(path, variant, eigh_threads=None, seed=0, sign_draws=(0, 0)):
    """analyze_heads on every layer of an activation file, read with h5py alone; ``sign_draws``
    as the kpca_heads rule passes them (the paper variant's solver draws add per-head columns)."""
    frames = []
    with h5py.File(path, "r") as f:
        mask = f["attention_mask"][:] if "attention_mask" in f else None
        for layer in range(int(f.attrs["n_layers"])):
            g = f[f"layers/{layer:02d}"]
            ids = dict(sample_rank=f["sample_rank"][:], dataset_index=f["dataset_index"][:])
            tensors = (g["q"][:], g["k"][:], g["v"][:], g["h"][:])
            frames.append(heads_records(*tensors, variant=variant, attention_mask=mask, layer=layer, seed=seed, eigh_threads=eigh_threads, sign_draws=sign_draws, **ids))
    return pd.concat(frames, ignore_index=True)


# --------------------------------------------------------------------------------------
# Capture interface
# --------------------------------------------------------------------------------------


def test_hand_written_vit_is_recorded_and_validates(tmp_path):
    summary = write_hand_vit(tmp_path / "a.h5", q_norm=True)
    assert summary.kind == "vision" and (summary.n_inputs, summary.n_layers, summary.n_heads, summary.n_tokens, summary.head_dim) == (3, 2, 2, 5, 8)
    assert summary.capture_max_rel_error <= 1e-5  # float32 round-off, far below the 1e-4 tolerance
    again = validate(tmp_path / "a.h5")
    assert again.capture_max_rel_error == summary.capture_max_rel_error


def test_a_logit_scale_other_than_one_over_sqrt_d_is_folded_into_q(tmp_path):
    """A module with s = 0.5 (not 1/sqrt(8)): the capture stores q * s * sqrt(d), so the stored
    logits q k^T / sqrt(d) are the module's, and the invariant holds."""
    summary = write_hand_vit(tmp_path / "s.h5", scale=0.5)
    assert summary.attention_scale == pytest.approx(1 / math.sqrt(8)) and summary.capture_max_rel_error <= 1e-5


def test_a_capture_that_misses_a_transform_is_refused_with_the_measured_error(tmp_path):
    model = _hand_vit(q_norm=True)
    capture = ModuleCapture([blk.attn for blk in model.blocks], careless_qkv, lambda m: m.out)
    with pytest.raises(CaptureMismatchError) as info:
        record_activations(model, capture, [_images(2)], tmp_path / "bad.h5", model_id="careless")
    measured = float(re.search(r"= ([0-9.e+-]+) x max \|v\|", str(info.value)).group(1))
    assert measured > 1e-4 and "layer 0" in str(info.value)
    assert not (tmp_path / "bad.h5").exists() and not list(tmp_path.iterdir())


def test_grouped_query_attention_with_padding(tmp_path):
    summary = write_gqa(tmp_path / "g.h5")
    assert summary.kind == "text" and summary.n_heads == 4 and summary.capture_max_rel_error <= 1e-5
    with h5py.File(tmp_path / "g.h5") as f:
        k = f["layers/00/k"][:]
        np.testing.assert_array_equal(k[:, 0], k[:, 1])  # query heads 0, 1 share key head 0
        assert not np.array_equal(k[:, 1], k[:, 2])
        assert f["attention_mask"][:].sum(axis=1).tolist() == [10, 7, 4]


def test_timm_and_hugging_face_recorders_are_head_captures(tmp_path):
    """The pipeline's own adapters go through the same interface as a user's module."""
    import timm
    from transformers import BertConfig, BertModel

    from kpca_repro.capture import hf_capture, vision

    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2, num_classes=0).eval()
    rec = vision.CaptureRecorder(vision.capture_plan(vit, "vit_tiny"), "vit_tiny")
    assert isinstance(rec, HeadCapture)
    s = record_activations(vit, rec, [torch.randn(2, 3, 32, 32)], tmp_path / "timm.h5", model_id="vit_tiny_patch16_224")
    assert (s.n_layers, s.n_heads, s.n_tokens) == (2, 3, 5) and s.capture_max_rel_error <= 1e-5

    cfg = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, max_position_embeddings=16, attn_implementation="eager")
    bert = BertModel(cfg).eval()
    hrec = hf_capture.HFAttentionRecorder(hf_capture.attention_modules(bert, "tiny-bert"))
    assert isinstance(hrec, HeadCapture)
    batch = _token_batch()
    s = record_activations(bert, hrec, [batch], tmp_path / "hf.h5", model_id="tiny-bert")
    assert s.kind == "text" and (s.n_layers, s.n_heads, s.n_tokens) == (2, 2, 10) and s.capture_max_rel_error <= 1e-5


def test_a_capture_must_satisfy_the_protocol(tmp_path):
    with pytest.raises(TypeError, match="not a HeadCapture"):
        record_activations(_hand_vit(), object(), [_images(1)], tmp_path / "x.h5", model_id="x")


# --------------------------------------------------------------------------------------
# Format and validator
# --------------------------------------------------------------------------------------


def _mutate(src, dst, fn):
    dst.write_bytes(src.read_bytes())
    with h5py.File(dst, "r+") as f:
        fn(f)
    return dst


def _set(name, value):
    def fn(f):
        f.attrs[name] = value

    return fn


def _replace(key, data):
    def fn(f):
        if key in f:
            del f[key]
        f.create_dataset(key, data=data)

    return fn


@pytest.mark.parametrize(
    "mutation, violation, fix",
    [
        (_set("format_version", 3), "format_version is 3", "set format_version = 2"),
        (lambda f: f.attrs.__delitem__("model_id"), "'model_id' is missing", "f.attrs['model_id']"),
        (_set("n_heads", 0), "'n_heads' is 0", "positive integer"),
        (_set("attention_scale", 0.5), "attention_scale is 0.5", "store q multiplied by"),
        (lambda f: f.__delitem__("sample_rank"), "/sample_rank is missing", "(B,) integer"),
        (_replace("sample_rank", np.zeros(3, np.int64)), "repeated values", "0..B-1"),
        (lambda f: f.__delitem__("layers/01/h"), "/layers/01/h is missing", "correct n_layers"),
        (_set("n_tokens", 7), "expected (B, n_heads, n_tokens, head_dim) = (3, 2, 7, 8)", "batch-first"),
        (_replace("layers/00/q", np.zeros((3, 2, 5, 8), np.float64)), "dtype float64", "float32"),
        (_replace("layers/00/v", np.full((3, 2, 5, 8), np.nan, np.float32)), "non-finite value at input 0, head 0, token 0", "finite"),
        (_replace("attention_mask", np.zeros((3, 5), np.int64)), "without real tokens", "drop that input"),
    ],
)
def test_the_validator_names_the_first_violation_and_its_fix(tmp_path, mutation, violation, fix):
    good = tmp_path / "good.h5"
    write_hand_vit(good)
    bad = _mutate(good, tmp_path / "bad.h5", mutation)
    with pytest.raises(ActivationFormatError) as info:
        validate(bad)
    assert violation in info.value.violation and fix in info.value.fix


def test_kind_must_match_the_mask(tmp_path):
    write_hand_vit(tmp_path / "v.h5")
    write_gqa(tmp_path / "t.h5")
    with pytest.raises(ActivationFormatError, match="attention_mask is missing"):
        validate(tmp_path / "v.h5", kind="text")
    with pytest.raises(ActivationFormatError, match="declare kind: text"):
        validate(tmp_path / "t.h5", kind="vision")


def test_the_validator_recomputes_the_invariant(tmp_path):
    """A file whose h is not softmax(q k^T / sqrt(d)) v (here: h of another layer) is refused."""
    good = tmp_path / "good.h5"
    write_hand_vit(good)
    with h5py.File(good) as f:
        other_h = f["layers/01/h"][:]
    bad = _mutate(good, tmp_path / "bad.h5", _replace("layers/00/h", other_h))
    with pytest.raises(CaptureMismatchError, match="layer 0"):
        validate(bad)
    assert validate(bad, check_invariant=False).capture_max_rel_error is None


def test_a_causal_h_without_the_causal_flag_is_refused(tmp_path):
    """Without ``causal=True`` the mask is key padding only (docs/activations.md 1): the same q, k, v
    under a causal mask give an h the invariant refuses, naming the measured error; no file is left."""
    from kpca_repro.activations import write_activations

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=g) for _ in range(3))
    logits = q @ k.transpose(-1, -2) / 2.0 + torch.triu(torch.full((8, 8), -math.inf), 1)
    h = torch.softmax(logits, -1) @ v
    layer = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "h": h.numpy()}
    with pytest.raises(CaptureMismatchError, match=r"max \|h - softmax\(s q k\^T \+ mask\) v\| = [0-9.]+ x max \|v\|"):
        write_activations(tmp_path / "causal.h5", [layer], model_id="causal")
    assert list(tmp_path.iterdir()) == []
    layer["h"] = (torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1) @ v).numpy()
    write_activations(tmp_path / "full.h5", [layer], model_id="full")  # the same q, k, v without the mask pass
    assert validate(tmp_path / "full.h5").capture_max_rel_error <= 1e-5


def _causal_gqa_layers(n_layers=2, b=3, heads=4, n_kv=2, n=7, d=4, mask=None, seed=0, causal=True):
    """q, k, v of grouped-query heads and h by brute force: per query i, a softmax over the real
    keys j <= i (all real keys when not ``causal``) of KV head ``h // (heads // n_kv)``."""
    rng = np.random.default_rng(seed)
    mask = np.ones((b, n), np.int64) if mask is None else mask
    layers = []
    for _ in range(n_layers):
        q = rng.standard_normal((b, heads, n, d)).astype(np.float32)
        k, v = (rng.standard_normal((b, n_kv, n, d)).astype(np.float32) for _ in range(2))
        h = np.zeros_like(q)
        for i_in, head, i in np.ndindex(b, heads, n):
            g = head // (heads // n_kv)
            keys = [j for j in range(n) if mask[i_in, j] and (j <= i or not causal)]
            if not keys:
                continue  # a left-padded query with no real key before it: never compared
            logits = k[i_in, g, keys].astype(np.float64) @ q[i_in, head, i].astype(np.float64) / math.sqrt(d)
            p = np.exp(logits - logits.max())
            h[i_in, head, i] = (p / p.sum()) @ v[i_in, g, keys]
        layers.append({"q": q, "k": k, "v": v, "h": h})
    return layers, mask


def _two_sided_mask():
    mask = np.ones((3, 7), np.int64)
    mask[1, 5:] = 0  # right padding
    mask[2, :3] = 0  # left padding (a decoder's tokenizer may pad left)
    return mask


def test_version_1_files_still_read_and_validate(tmp_path):
    """A version-1 file (no causal, k and v with every head; with or without format_version) reads
    as causal False, n_kv_heads = n_heads, kv_head_of_query = arange(n_heads)."""
    from kpca_repro.activations import ActivationFile

    write_hand_vit(tmp_path / "v2.h5")

    def to_v1(f):
        for name in ("causal", "n_kv_heads", "kv_head_of_query"):
            del f.attrs[name]
        f.attrs["format_version"] = 1

    for path, fn in (("v1.h5", to_v1), ("v0.h5", lambda f: (to_v1(f), f.attrs.__delitem__("format_version")))):
        old = _mutate(tmp_path / "v2.h5", tmp_path / path, fn)
        summary = validate(old)
        assert summary.format_version == 1 and not summary.causal and summary.n_kv_heads == summary.n_heads == 2
        with ActivationFile(old) as af:
            assert af.causal is False and af.n_kv_heads == 2 and af.kv_head_of_query.tolist() == [0, 1]


def test_a_version_1_file_ignores_version_2_attributes(tmp_path):
    """Version 1 has no causal flag: a version-1 file is read without one, whatever it holds."""
    write_hand_vit(tmp_path / "v2.h5")
    old = _mutate(tmp_path / "v2.h5", tmp_path / "v1.h5", lambda f: (_set("format_version", 1)(f), _set("causal", True)(f)))
    assert not validate(old).causal


def test_a_causal_grouped_query_file_from_arrays_validates(tmp_path):
    """Version 2: four query heads on two KV heads, causal, padded on the right (input 1) and on the
    left (input 2); h by brute force over each query's real prefix."""
    from kpca_repro.activations import ActivationFile, repeat_kv_map, write_activations

    layers, mask = _causal_gqa_layers(mask=_two_sided_mask())
    summary = write_activations(tmp_path / "c.h5", layers, model_id="causal_gqa", attention_mask=mask, causal=True, kv_head_of_query=repeat_kv_map(4, 2))
    assert (summary.format_version, summary.causal, summary.n_heads, summary.n_kv_heads) == (2, True, 4, 2) and summary.capture_max_rel_error <= 1e-5
    again = validate(tmp_path / "c.h5", kind="text")
    assert again.causal and again.n_kv_heads == 2 and again.capture_max_rel_error == summary.capture_max_rel_error
    assert ", causal, 3 inputs x 2 layers x 4 heads (2 KV heads)" in again.line()
    with ActivationFile(tmp_path / "c.h5") as af:
        assert af.causal is True and af.n_kv_heads == 2 and af.kv_head_of_query.dtype == np.int64 and af.kv_head_of_query.tolist() == [0, 0, 1, 1]
        t = af.read(1)
        assert t["q"].shape == t["h"].shape == (3, 4, 7, 4) and t["k"].shape == t["v"].shape == (3, 2, 7, 4)
        np.testing.assert_array_equal(t["k"], layers[1]["k"])


def test_one_kv_head(tmp_path):
    from kpca_repro.activations import write_activations

    layers, mask = _causal_gqa_layers(heads=3, n_kv=1, mask=_two_sided_mask())
    summary = write_activations(tmp_path / "mqa.h5", layers, model_id="mqa", attention_mask=mask, causal=True, kv_head_of_query=[0, 0, 0])
    assert validate(tmp_path / "mqa.h5").n_kv_heads == summary.n_kv_heads == 1


def test_a_non_causal_h_in_a_causal_file_and_a_causal_h_in_a_full_file_fail(tmp_path):
    from kpca_repro.activations import repeat_kv_map, write_activations

    kv = repeat_kv_map(4, 2)
    full, mask = _causal_gqa_layers(mask=_two_sided_mask(), causal=False)
    with pytest.raises(CaptureMismatchError, match=r"layer 0 .*= [0-9.]+ x max \|v\|"):
        write_activations(tmp_path / "a.h5", full, model_id="x", attention_mask=mask, causal=True, kv_head_of_query=kv)
    causal, _ = _causal_gqa_layers(mask=_two_sided_mask())
    with pytest.raises(CaptureMismatchError):
        write_activations(tmp_path / "b.h5", causal, model_id="x", attention_mask=mask, causal=False, kv_head_of_query=kv)
    assert list(tmp_path.iterdir()) == []
    # the validator too: a valid causal file whose causal flag is cleared
    write_activations(tmp_path / "c.h5", causal, model_id="x", attention_mask=mask, causal=True, kv_head_of_query=kv)
    bad = _mutate(tmp_path / "c.h5", tmp_path / "bad.h5", _set("causal", False))
    with pytest.raises(CaptureMismatchError, match="set causal = True"):
        validate(bad)


@pytest.mark.parametrize(
    "kv, error, message",
    [
        ([0, 1, 0, 1], CaptureMismatchError, r"max \|h - softmax"),  # in range, every KV head read, the wrong heads
        ([0, 0, 0, 0], ActivationFormatError, r"KV head\(s\) \[1\] of 2 are read by no query head"),
        ([0, 0, 1, 2], ActivationFormatError, r"KV heads outside 0..1"),
        ([0, 1], ActivationFormatError, r"not \(4,\) integers"),
    ],
)
def test_a_wrong_kv_head_map_fails_the_validator(tmp_path, kv, error, message):
    from kpca_repro.activations import repeat_kv_map, write_activations

    layers, mask = _causal_gqa_layers(mask=_two_sided_mask())
    write_activations(tmp_path / "c.h5", layers, model_id="x", attention_mask=mask, causal=True, kv_head_of_query=repeat_kv_map(4, 2))
    bad = _mutate(tmp_path / "c.h5", tmp_path / "bad.h5", _set("kv_head_of_query", np.asarray(kv, np.int64)))
    with pytest.raises(error, match=message):
        validate(bad)


def test_the_writer_refuses_a_map_that_does_not_fit(tmp_path):
    from kpca_repro.activations import write_activations

    layers, mask = _causal_gqa_layers(mask=_two_sided_mask())
    with pytest.raises(ValueError, match="read by no query head"):
        write_activations(tmp_path / "c.h5", layers, model_id="x", attention_mask=mask, causal=True, kv_head_of_query=[0, 0, 0, 2])
    with pytest.raises(ValueError, match=r"k, v \(b, H_kv, N, d\) = \(3, 4, 7, 4\)"):
        write_activations(tmp_path / "c.h5", layers, model_id="x", attention_mask=mask, causal=True)  # no map: k, v need 4 heads
    with pytest.raises(ValueError, match="kv_head_of_query has 2 entries, q has 4 heads"):
        write_activations(tmp_path / "c.h5", layers, model_id="x", attention_mask=mask, causal=True, kv_head_of_query=[0, 1])
    assert list(tmp_path.iterdir()) == []


def test_the_command_line(tmp_path, capsys):
    write_hand_vit(tmp_path / "good.h5")
    assert main(["validate", str(tmp_path / "good.h5")]) == 0
    assert capsys.readouterr().out.startswith("ok: format_version 2, model_id 'hand_vit', vision, 3 inputs x 2 layers x 2 heads")
    bad = _mutate(tmp_path / "good.h5", tmp_path / "bad.h5", _set("format_version", 9))
    proc = subprocess.run([sys.executable, "-m", "kpca_repro.activations", "validate", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 1 and "format_version is 9" in proc.stderr and "Fix:" in proc.stderr


def test_install_copies_and_fills_the_pipeline_attributes(tmp_path):
    write_hand_vit(tmp_path / "mine.h5")
    before = (tmp_path / "mine.h5").read_bytes()
    install_user_file(tmp_path / "mine.h5", tmp_path / "out" / "user_1of2.h5", name="hand_vit", kind="vision", shard=1, n_shards=2)
    assert (tmp_path / "mine.h5").read_bytes() == before
    with h5py.File(tmp_path / "out" / "user_1of2.h5") as f:
        assert (int(f.attrs["shard"]), int(f.attrs["n_shards"])) == (1, 2) and f.attrs["format_version"] == 2
    with pytest.raises(ActivationFormatError, match="rename the entry"):
        install_user_file(tmp_path / "mine.h5", tmp_path / "out" / "x.h5", name="other", kind="vision", shard=0, n_shards=1)


# --------------------------------------------------------------------------------------
# The notebook API
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_api_equals_the_records_stage(tmp_path, variant):
    write_hand_vit(tmp_path / "v.h5")
    write_gqa(tmp_path / "t.h5")
    for path in ("v.h5", "t.h5"):
        _same(_api_on_file(tmp_path / path, variant), analyze_file(tmp_path / path, variant))


def test_api_shapes_and_errors():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((6, 4)).astype(np.float32) for _ in range(3))
    one = heads_records(q, k, v)
    assert len(one) == 1 and (one["n_tokens"].iloc[0], one["head_dim"].iloc[0]) == (6, 4)
    # (H, N, d): one row per head, each head's numbers as if analysed alone
    many = heads_records(np.stack([q, q]), np.stack([k, 2 * k]), np.stack([v, v]))
    assert many["head"].tolist() == [0, 1]
    _same(many.iloc[:1], one)
    h = torch.softmax(torch.from_numpy(q @ k.T / 2.0), -1).numpy() @ v
    heads_records(q, k, v, h)  # consistent h: accepted
    with pytest.raises(CaptureMismatchError):
        heads_records(q, k, v, h + 1.0)
    with pytest.raises(ValueError, match="one shape"):
        heads_records(q, k, v[:, :3])
    with pytest.raises(ValueError, match="attention_mask"):
        heads_records(q, k, v, attention_mask=np.ones(5))
    _, draws = analyze_heads(HeadArrays(q, k, v), KpcaJob(sign_draws=(4, 2)))
    assert all(a.shape[0] == 1 for a in draws.values())


def test_api_cosines_by_brute_force():
    """direct_cos_mean of the corrected variant, recomputed from its definition (docs/method.md 0.2, 15)."""
    rng = np.random.default_rng(1)
    n, d = 7, 3
    k, v = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    row = heads_records(None, k, v, variant="corrected").iloc[0]
    kk = k.astype(np.float32).astype(np.float64)  # the API rounds to float32 as the files store them
    kraw = np.exp(kk @ kk.T / math.sqrt(d))
    g = kraw.sum(1)
    kphi = kraw / np.outer(g, g)
    one = np.full((n, n), 1 / n)
    kc = kphi - one @ kphi - kphi @ one + one @ kphi @ one
    lam, vec = np.linalg.eigh(kc)
    a = vec[:, np.argsort(-lam)[:d]]  # descending
    a = a * np.sign(a[np.abs(a).argmax(0), np.arange(d)])  # largest entry positive
    vk = (a - a.mean(0)) / g[:, None]  # V_KPCA = G A - G 1_N A
    vv = v.astype(np.float32).astype(np.float64)
    cos = (vv * vk).sum(1) / np.linalg.norm(vv, axis=1) / np.linalg.norm(vk, axis=1)
    assert row["direct_cos_mean"] == pytest.approx(cos.mean(), rel=1e-9, abs=1e-12)


def _heads_output(q, k, v, mask=None, causal=True):
    """``h = softmax(q k^T / sqrt(d) + mask) v`` in float64 (padded keys, and with ``causal`` keys j > i, left out), float32."""
    n, d = q.shape[-2:]
    allowed = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)
    allowed = allowed[None] & (np.ones((q.shape[0], n), bool) if mask is None else mask.astype(bool))[:, None, :]
    logits = np.where(allowed[:, None], q.astype(np.float64) @ k.transpose(0, 1, 3, 2) / math.sqrt(d), -np.inf)
    top = logits.max(-1, keepdims=True)
    w = np.exp(logits - np.where(np.isfinite(top), top, 0.0))
    return ((w / np.maximum(w.sum(-1, keepdims=True), 1e-300)) @ v).astype(np.float32)  # a query that sees no key: 0


def _causal_heads(n_in=2, heads=2, n=6, d=4, seed=3, mask=None, causal=True):
    """Random heads ``(B, H, N, d)`` float32 with their own ``h``."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n_in, heads, n, d)).astype(np.float32) for _ in range(3))
    return [q, k, v, _heads_output(q, k, v, mask, causal)]


_FEW = "a head needs at least 3 tokens: with N tokens the centered Gram matrix has at most N - 1 non-zero eigenvalues"
# case -> (arguments of analyze_heads beyond the random causal heads, error, what the message names)
API_REFUSALS = {
    "all-padding input": (dict(attention_mask=np.array([[1] * 6, [0] * 6])), ValueError, ["attention_mask: input 1 has no real token (all padding)"]),
    "prefix not an integer": (dict(prefix=2.5), TypeError, ["prefix=2.5", "must be an integer, not float"]),
    "prefix below 3": (dict(prefix=1), ValueError, ["prefix=1: P must be at least 3", _FEW]),
    "prefix 2": (dict(prefix=2), ValueError, ["prefix=2: P must be at least 3", _FEW]),
    "float16 with h": (dict(dtype=np.float16), ValueError, ["q is float16", "default tolerance 0.0001", "float32 tensors", "tolerance suited to float16"]),
    "bfloat16 with h": (dict(dtype=torch.bfloat16), ValueError, ["q is bfloat16", "tolerance suited to bfloat16"]),
    "input of one real token": (dict(attention_mask=np.array([[1] * 6, [0] * 5 + [1]])), ValueError, ["attention_mask: input 1 has 1 real token", _FEW]),
    "input of two real tokens": (dict(attention_mask=np.array([[1] * 6, [0] * 4 + [1] * 2]), variant="corrected"), ValueError, ["attention_mask: input 1 has 2 real tokens", _FEW]),
    "heads of one token": (dict(n=1), ValueError, ["k: N = 1 token per head", _FEW]),
    "heads of two tokens": (dict(n=2, variant="corrected"), ValueError, ["k: N = 2 tokens per head", _FEW]),
}


@pytest.mark.parametrize("case", sorted(API_REFUSALS))
def test_api_refusals_name_the_argument_and_the_reason(case):
    """Each edge of the notebook API (issue 60 finding 5) ends in one line naming the argument and the reason."""
    kwargs, error, names = API_REFUSALS[case]
    kwargs = dict(kwargs)
    dtype, n = kwargs.pop("dtype", None), kwargs.pop("n", 6)
    q, k, v, h = _causal_heads(n=n, mask=kwargs.get("attention_mask"))
    if dtype is not None:
        q, k, v, h = (torch.from_numpy(x).to(dtype) if isinstance(dtype, torch.dtype) else x.astype(dtype) for x in (q, k, v, h))
    with pytest.raises(error) as err:
        heads_records(q, k, v, h, causal=True, **kwargs)
    message = str(err.value)
    assert "\n" not in message and all(name in message for name in names), message


def test_api_edges_that_are_accepted():
    """Half precision with a tolerance chosen for it: the records of the same values in float32;
    three tokens, the fewest accepted: finite CKA; a prefix of 3."""
    q, k, v, h = _causal_heads()
    half = heads_records(*(x.astype(np.float16) for x in (q, k, v, h)), causal=True, tolerance=1e-2)
    pd.testing.assert_frame_equal(half, heads_records(*(x.astype(np.float16).astype(np.float32) for x in (q, k, v, h)), causal=True, tolerance=1e-2))
    with pytest.raises(CaptureMismatchError):  # the tolerance still checks: h of other heads fails
        heads_records(*(x.astype(np.float16) for x in (q, k, v)), h[::-1].astype(np.float16), causal=True, tolerance=1e-2)
    three = heads_records(*_causal_heads(n=3), causal=True, variant="corrected")
    assert three["n_tokens"].eq(3).all() and np.isfinite(three[["linear_cka", "rbf_cka"]].to_numpy()).all()
    assert heads_records(q, k, v, h, causal=True, prefix=np.int64(3))["n_tokens"].eq(3).all()


def test_the_records_stage_leaves_out_rows_too_short_and_counts_them(tmp_path, caplog):
    """A file row of 2 real tokens: left out where each row's real tokens are read (corrected; a
    decoder in both variants), with one logged count; the paper variant of an encoder keeps all N."""
    import logging

    from kpca_repro.activations import write_activations

    mask = np.array([[1] * 6, [1] * 2 + [0] * 4, [1] * 5 + [0]])
    causal, encoder = tmp_path / "causal.h5", tmp_path / "encoder.h5"
    for path, is_causal in ((causal, True), (encoder, False)):
        q, k, v, h = _causal_heads(n_in=3, mask=mask, causal=is_causal)
        write_activations(path, [{"q": q, "k": k, "v": v, "h": h}], model_id="m", attention_mask=mask, causal=is_causal)
    for variant in ("paper", "corrected"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kpca_repro.records"):
            records = analyze_file(causal, variant)
        assert sorted(set(records["sample_rank"])) == [0, 2]
        assert [r.getMessage().split(": ", 1)[1][:62] for r in caplog.records] == ["1 of 3 rows have fewer than 3 real tokens and are left out (a "]
    assert sorted(set(analyze_file(encoder, "corrected")["sample_rank"])) == [0, 2]
    assert sorted(set(analyze_file(encoder, "paper")["sample_rank"])) == [0, 1, 2]  # padding included: every row has N = 6
    with pytest.raises(ValueError, match=r"prefix=2: P must be at least 3; a head needs at least 3 tokens"):
        analyze_file(causal, KpcaJob("corrected", prefix=2))
    with pytest.raises(TypeError, match=r"prefix=2.5: the prefix length P is a number of real tokens and must be an integer"):
        analyze_file(causal, KpcaJob("corrected", prefix=2.5))


# --------------------------------------------------------------------------------------
# Configuration, paths, labels and the comparison (no pipeline run)
# --------------------------------------------------------------------------------------


def _cfg(**activations):
    return {"variants": ["paper"], "vision": {"models": ["deit_tiny_patch16_224"], "n_images": 4, "shards": 1}, "text": {"models": [], "n_rows": 2, "shards": 1}, "activations": activations}


def test_user_paths_follow_the_configured_files():
    from kpca_repro.workflow import paths

    cfg = _cfg(**{"org/enc": {"files": ["a.h5", "b.h5"], "kind": "text"}, "mine": {"files": ["m.h5"], "kind": "vision"}})
    assert paths.user_models(cfg) == ["org/enc", "mine"] and paths.user_models(cfg, "vision") == ["mine"]
    assert paths.user_files(cfg, "org/enc") == ["results/activations/org--enc/user_0of2.h5", "results/activations/org--enc/user_1of2.h5"]
    assert paths.user_files(cfg, "mine", "csv", "paper") == ["results/heads/paper/mine/user_0of1.csv"]
    assert paths.user_spectra_files(cfg, "corrected", "mine", ["standardized", "raw"]) == [
        "results/spectra/corrected/mine/user_0of1_standardized.csv",
        "results/spectra/corrected/mine/user_0of1_raw.csv",
    ]
    # the norms of a user model read its own files in both variants
    for variant in ("paper", "corrected"):
        assert paths.norm_activations(cfg, "text", variant, "org--enc") == paths.user_files(cfg, "org/enc")
    assert "table4" in paths.comparison_tables(cfg)  # a user text model brings Table 4


def test_user_configuration_checks(tmp_path, monkeypatch):
    from kpca_repro.activations import check_user_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.h5").write_bytes(b"")
    check_user_config(_cfg(mine={"files": ["m.h5"], "kind": "vision"}))
    for entries, needle in [
        ({"deit_tiny_patch16_224": {"files": ["m.h5"], "kind": "vision"}}, "also in vision.models"),
        ({"a--b": {"files": ["m.h5"], "kind": "vision"}}, "no '--'"),
        ({"mine": {"files": ["m.h5", "gone.h5"], "kind": "vision"}}, "activations.mine.files[1]: gone.h5 does not exist"),
    ]:
        with pytest.raises(ValueError) as info:
            check_user_config(_cfg(**entries))
        assert needle in str(info.value)
    # A text-only study (no vision model, one text entry) is valid and has no vision targets.
    from kpca_repro.workflow import paths

    text_only = _cfg(mine={"files": ["m.h5"], "kind": "text"})
    text_only["vision"]["models"] = []
    check_user_config(text_only)
    assert not paths.has_vision(text_only)


def test_user_rows_are_labelled_and_not_comparable():
    from kpca_repro.analysis.comparison import DIFFERS, NOT_RUN, WITHIN_ROUNDING
    from kpca_repro.analysis.rendering import label_rows

    table = pd.DataFrame({"model": ["DeiT-Tiny", "mine"], "timm_id": ["deit_tiny_patch16_224", "mine"], "MDC": [0.1, 0.2]})
    out = label_rows(table, ["mine"], USER_LABEL)
    assert out["model"].tolist() == ["DeiT-Tiny", "mine" + USER_LABEL] and out["MDC"].equals(table["MDC"])
    assert label_rows(table, [], USER_LABEL) is table
    comp = pd.DataFrame({"model_id": ["deit_tiny_patch16_224", "deit_tiny_patch16_224", "vit_base_patch16_224"], "status": [DIFFERS, NOT_RUN, WITHIN_ROUNDING], "reason": ["", "not in config", ""]})
    marked = mark_user_activations(comp, ["deit_tiny_patch16_224"])
    first = marked[marked["model_id"] == "deit_tiny_patch16_224"]
    assert first["status"].tolist() == [NOT_COMPARABLE, NOT_RUN] and first["reason"].iloc[0] == USER_ACTIVATIONS_REASON
    assert marked["status"].iloc[0] == WITHIN_ROUNDING  # compared rows first, as comparison_table orders them
    assert mark_user_activations(comp, []) is comp
