"""Decoder capture (issue 55 items 2-3): GPT-2, Llama with grouped-query attention, Qwen2 with one
key/value head and GPT-NeoX with partial rotary, captured as format version 2 (causal, k and v per
KV head) with the invariant on every batch; negative controls; the refusals, from configurations.

Tiny random-init decoders saved to local directories (kpca_tools.decoders, the builder the
end-to-end tests use too); no downloads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kpca_repro.activations import INVARIANT_RTOL, ActivationFile, CaptureMismatchError, attention_invariant, attention_mask_matrix, repeat_kv_map, validate
from kpca_repro.capture import extraction, hf_capture
from kpca_repro.capture.vision import UnsupportedArchitectureError
from kpca_repro.inputs import text
from kpca_tools.decoders import TINY_FAMILIES, build_tiny_decoder, tiny_config

from conftest import REPO

ROWS = [
    " the cat sat on the mat and looked at the dog .\n",
    " a dog ran across the long green field , and the cat watched it from the old wall .\n",
    " the field was green .\n",
    " the old wall was long and the mat was green , the dog sat on the wall .\n",
]
FAMILIES = list(TINY_FAMILIES)  # gpt2, llama (4 heads on 2 KV heads), qwen2 (one KV head), gpt_neox (partial rotary)
KV_HEADS = {"gpt2": 4, "llama": 2, "qwen2": 1, "gpt_neox": 4}


@pytest.fixture(scope="module")
def decoder_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-decoders")
    return {(family, side): build_tiny_decoder(family, root / f"{family}-{side}", padding_side=side) for family in FAMILIES for side in ("right", "left")}


def _extract(source, out, model_id="tiny/decoder", batch_size=2, max_length=128):
    samples = text.sample_rows(ROWS, 4, 10, seed=0)
    extraction.extract_text(model_id, str(source), samples, out, batch_size=batch_size, max_length=max_length, device=torch.device("cpu"), offline=True, progress=False, decoder=True)


def _brute_force_causal(q, k, v, mask, kv_map):
    """h of every real query by a loop over its real prefix, float64 (independent of attention_mask_matrix)."""
    h = np.zeros(q.shape)
    d = q.shape[-1]
    for b, head, i in np.ndindex(*q.shape[:3]):
        if not mask[b, i]:
            continue
        keys = [j for j in range(i + 1) if mask[b, j]]
        g = kv_map[head]
        logits = k[b, g, keys].astype(np.float64) @ q[b, head, i].astype(np.float64) / np.sqrt(d)
        p = np.exp(logits - logits.max())
        h[b, head, i] = (p / p.sum()) @ v[b, g, keys].astype(np.float64)
    return h


# --------------------------------------------------------------------------------------
# Extraction from local directories, padding on either side
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_extraction_writes_a_causal_v2_file_that_validates(family, side, decoder_dirs, tmp_path):
    """Every batch checked (the writer), the file valid (the validator, every input), every stored real
    query's h equal to a brute-force causal attention over its real prefix with its KV head."""
    out = tmp_path / "d.h5"
    _extract(decoder_dirs[family, side], out)
    summary = validate(out, kind="text")
    config = tiny_config(family)
    n_kv = KV_HEADS[family]
    assert summary.format_version == 2 and summary.causal and summary.n_heads == 4 and summary.n_kv_heads == n_kv
    assert summary.capture_max_rel_error < 1e-5
    with ActivationFile(out) as af:
        assert af.causal and af.n_kv_heads == getattr(config, "num_key_value_heads", 4) == n_kv
        np.testing.assert_array_equal(af.kv_head_of_query, repeat_kv_map(4, n_kv))
        assert af.attrs["capture_adapter"] == {"qwen2": "llama"}.get(family, family) and af.attrs["capture_rtol"] == INVARIANT_RTOL
        assert 0 < af.attrs["capture_max_rel_error"] < 1e-5
        mask = af.attention_mask
        lengths = mask.sum(axis=1)
        assert len(set(lengths)) > 1  # rows of unequal length: padding present
        short = int(np.argmin(lengths))
        padded_at = mask[short, 0] == 0 if side == "left" else mask[short, -1] == 0
        assert padded_at and af.attrs["tokenizer"].count(f'"padding_side": "{side}"') == 1
        for layer in range(af.n_layers):
            t = af.read(layer)
            assert t["q"].shape[1] == 4 and t["k"].shape[1] == t["v"].shape[1] == n_kv
            h = _brute_force_causal(t["q"], t["k"], t["v"], mask, af.kv_head_of_query)
            real = mask.astype(bool)[:, None, :, None]
            err = np.abs(np.where(real, t["h"] - h, 0)).max() / np.abs(t["v"]).max()
            assert err < 1e-5, (layer, err)


def _kernel_recorder(model):
    """The q, k, v each attention module hands to transformers' attention function (first call per module)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    seen = {}

    def record(module, q, k, v, mask, **kw):
        seen.setdefault(module, (q.clone(), k.clone(), v.clone()))
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("kpca_record_decoder", record)
    AttentionMaskInterface.register("kpca_record_decoder", sdpa_mask)
    model.set_attn_implementation("kpca_record_decoder")
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_the_stored_q_k_v_are_those_the_attention_function_receives(family, decoder_dirs):
    """Rotated q and k (all of each Llama/Qwen2 head, the first half of each GPT-NeoX head), k and v
    with the KV heads before repeat_kv: bit for bit what the model hands to its attention function."""
    model, tokenizer = text.load_text_model("tiny", str(decoder_dirs[family, "left"]), offline=True, decoder=True)
    attns = hf_capture.attention_modules(model, "tiny")
    seen = _kernel_recorder(model)
    enc = text.tokenize_sample(tokenizer, ROWS, 128)
    with torch.no_grad(), hf_capture.HFAttentionRecorder(attns) as rec:
        model(**enc, use_cache=False)
    for a, t in zip(attns, rec.captured):
        q, k, v = seen[a.module]
        assert torch.equal(t["q"], q) and torch.equal(t["k"], k) and torch.equal(t["v"], v)
        assert t["k"].shape[1] == KV_HEADS[family]
    a, t, hidden = attns[-1], rec.captured[-1], rec._hidden[-1]
    with torch.no_grad():
        if family in ("llama", "qwen2"):  # rotary on the whole head: the stored keys are not the projection's
            assert not torch.allclose(hf_capture.split_heads(a.projections["k"](hidden), KV_HEADS[family], a.head_dim), t["k"])
        elif family == "gpt_neox":  # partial rotary: the first rotary_ndims features of each head rotated, the rest as projected
            _, raw_k, _ = hf_capture._split_neox(a, a.projections["qkv"](hidden))
            r = a.module.rotary_ndims
            assert r == a.head_dim // 2 and torch.equal(raw_k[..., r:], t["k"][..., r:]) and not torch.allclose(raw_k[..., :r], t["k"][..., :r])


def _real_token_difference(right, left) -> float:
    """max |x_right - x_left| over the real tokens of every row, layer and tensor q, k, v, h of two files of the same rows."""
    with ActivationFile(right) as r, ActivationFile(left) as lf:
        mr, ml = r.attention_mask.astype(bool), lf.attention_mask.astype(bool)
        assert (mr.sum(axis=1) == ml.sum(axis=1)).all() and not (mr == ml).all()  # the same rows, padded on both sides
        diffs = [np.abs(tr[t][b][:, mr[b]] - tl[t][b][:, ml[b]]).max() for tr, tl in ((r.read(i), lf.read(i)) for i in range(r.n_layers)) for t in "qkvh" for b in range(len(mr))]
    return float(max(diffs))


@pytest.mark.parametrize("family", FAMILIES)
def test_left_and_right_padding_give_the_same_real_tokens_and_records(family, decoder_dirs, tmp_path):
    """Positions from the attention mask (docs/method.md 16.2): the same weights and rows padded left
    and right store the same real-token q, k, v, h and give the same records in both variants."""
    import pandas as pd

    from kpca_repro import analyze_file

    files = {side: tmp_path / f"{side}.h5" for side in ("right", "left")}
    for side, out in files.items():
        _extract(decoder_dirs[family, side], out)  # the writer checks the invariant on every batch
    assert _real_token_difference(files["right"], files["left"]) <= 1e-6
    for variant in ("paper", "corrected"):
        pd.testing.assert_frame_equal(analyze_file(files["right"], variant), analyze_file(files["left"], variant), check_exact=False, rtol=0, atol=1e-6)


def test_without_positions_a_left_padded_gpt2_shifts_its_real_tokens(decoder_dirs, tmp_path, monkeypatch):
    """Negative control: without position_ids GPT-2 counts positions from the first (padded) slot, so its
    learned absolute positions give the left-padded rows other q, k, v."""
    files = {side: tmp_path / f"{side}.h5" for side in ("right", "left")}
    monkeypatch.setattr(hf_capture, "decoder_position_ids", lambda mask: None)
    for side, out in files.items():
        _extract(decoder_dirs["gpt2", side], out)
    assert _real_token_difference(files["right"], files["left"]) > 0.1


def test_decoder_positions_count_each_rows_real_tokens_from_zero():
    """Any mask, padded on either side or both: the real tokens of a row sit at 0, 1, ... in order, as in generate."""
    mask = torch.from_numpy(np.random.default_rng(0).integers(0, 2, (6, 12)))
    mask[0] = torch.tensor([0] * 5 + [1] * 7)  # left padding
    mask[1] = torch.tensor([1] * 7 + [0] * 5)  # right padding
    positions = hf_capture.decoder_position_ids(mask)
    assert positions.dtype == torch.int64 and positions.shape == mask.shape
    for row, pos in zip(mask.bool(), positions):
        assert pos[row].tolist() == list(range(int(row.sum())))


# --------------------------------------------------------------------------------------
# Negative controls: the invariant sees what a wrong capture misses
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
def test_unrotated_q_and_k_fail_the_invariant(family, decoder_dirs, tmp_path, monkeypatch):
    """The rotary embedding omitted (q, k stored as projected): the job fails with the measured error, no file."""
    import dataclasses

    name = {"qwen2": "llama"}.get(family, family)
    monkeypatch.setitem(hf_capture.MODEL_TYPES, family, dataclasses.replace(hf_capture.FAMILIES[name], transform=hf_capture._no_transform))
    with pytest.raises(CaptureMismatchError, match=r"tiny/decoder: the captured q, k, v of layer 0 .* = [0-9.e+-]+ x max \|v\|"):
        _extract(decoder_dirs[family, "right"], tmp_path / "x.h5")
    assert list(tmp_path.iterdir()) == []


def test_gpt_neox_split_as_gpt2_fails_the_invariant(decoder_dirs, tmp_path, monkeypatch):
    """GPT-NeoX's fused projection is per head [q | k | v]; split as GPT-2's q | k | v blocks it reproduces nothing."""
    import dataclasses

    monkeypatch.setitem(hf_capture.MODEL_TYPES, "gpt_neox", dataclasses.replace(hf_capture.FAMILIES["gpt_neox"], split=hf_capture._split_gpt2))
    with pytest.raises(CaptureMismatchError):
        _extract(decoder_dirs["gpt_neox", "right"], tmp_path / "x.h5")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_causal_mask_is_needed(family, decoder_dirs, tmp_path, monkeypatch):
    """The same tensors checked without the causal mask fail: the decoder's h is causal."""
    monkeypatch.setattr(hf_capture.HFAttentionRecorder, "causal", property(lambda self: False))
    with pytest.raises(CaptureMismatchError):
        _extract(decoder_dirs[family, "right"], tmp_path / "x.h5")


def test_stored_tensors_fail_with_a_wrong_kv_map(decoder_dirs, tmp_path):
    """Llama's query heads 0, 1 read KV head 0: the map [0, 1, 0, 1] (in range, both heads read) fails."""
    out = tmp_path / "d.h5"
    _extract(decoder_dirs["llama", "left"], out)
    with ActivationFile(out) as af:
        t, mask = af.read(0), af.attention_mask
    allowed = attention_mask_matrix(mask.shape[1], mask, causal=True)
    good = attention_invariant(t["q"], t["k"], t["v"], t["h"], scale=8**-0.5, allowed=allowed, query_mask=mask, kv_head_of_query=[0, 0, 1, 1])
    wrong = attention_invariant(t["q"], t["k"], t["v"], t["h"], scale=8**-0.5, allowed=allowed, query_mask=mask, kv_head_of_query=[0, 1, 0, 1])
    assert good.max_rel_error < 1e-5 and wrong.max_rel_error > 1e-2


# --------------------------------------------------------------------------------------
# Sliding windows: refused when shorter than the rows, harmless otherwise
# --------------------------------------------------------------------------------------


def test_a_sliding_window_shorter_than_the_rows_is_refused(tmp_path):
    """Qwen2 with every layer sliding (window 8): refused before any forward pass, naming both lengths."""
    source = build_tiny_decoder("qwen2", tmp_path / "qwen2-sliding", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UnsupportedArchitectureError, match=r"'qwen2' is refused: a sliding window of 8 tokens, shorter than the rows \(24 tokens\)"):
        _extract(source, out / "x.h5")
    assert list(out.iterdir()) == []


def test_a_sliding_window_as_long_as_the_rows_changes_nothing(tmp_path):
    """Window 24 = N: every query still sees its whole prefix, the causal file validates."""
    source = build_tiny_decoder("qwen2", tmp_path / "qwen2-window", use_sliding_window=True, sliding_window=24, max_window_layers=0)
    _extract(source, tmp_path / "x.h5")
    assert validate(tmp_path / "x.h5").capture_max_rel_error < 1e-5


def test_sliding_window_from_configurations():
    from transformers import AutoConfig

    assert hf_capture.sliding_window(AutoConfig.for_model("mistral")) == 4096
    assert hf_capture.sliding_window(AutoConfig.for_model("mistral", sliding_window=None)) is None
    assert hf_capture.sliding_window(AutoConfig.for_model("qwen2", use_sliding_window=False)) is None
    assert hf_capture.sliding_window(AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=28, num_hidden_layers=28)) is None  # no sliding layer
    assert hf_capture.sliding_window(AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1, num_hidden_layers=2)) == 16
    assert hf_capture.sliding_window(AutoConfig.for_model("llama")) is None
    mistral = AutoConfig.for_model("mistral", sliding_window=16)
    hf_capture.check_rows(mistral, "m", 16)
    with pytest.raises(UnsupportedArchitectureError, match=r"^m: .*'mistral' is refused: a sliding window of 16 tokens, shorter than the rows \(17 tokens\)[^\n]*$"):
        hf_capture.check_rows(mistral, "m", 17)


# --------------------------------------------------------------------------------------
# Refusals from configurations alone
# --------------------------------------------------------------------------------------

REFUSED = {
    "bloom": ("bloom", {}, "ALiBi"),
    "mpt": ("mpt", {}, "ALiBi"),
    "falcon-alibi": ("falcon", {"alibi": True}, "ALiBi"),
    "gpt_oss": ("gpt_oss", {}, "attention sinks"),
    "gemma2": ("gemma2", {}, "soft-capping"),
    "qwen3": ("qwen3", {}, "qk-norm"),
    "olmo2": ("olmo2", {}, "qk-norm"),
    "gpt2-cross": ("gpt2", {"add_cross_attention": True}, "cross-attention"),
    "bart": ("bart", {}, "encoder-decoder"),
    "gpt2-layer-scale": ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    "gpt2-unscaled": ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights = False"),
    "opt": ("opt", {}, "a decoder family the capture does not know"),
    "llama-4-on-3": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads = 3 does not divide num_attention_heads = 4"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refusals_in_one_line(name, tmp_path):
    """From the config alone and from a directory holding only config.json, listed as a decoder."""
    from transformers import AutoConfig

    model_type, kwargs, reason = REFUSED[name]
    cfg = AutoConfig.for_model(model_type, **kwargs)
    with pytest.raises(UnsupportedArchitectureError) as err:
        hf_capture.hf_family(cfg, f"org/{name}", text=True, decoder=True)
    msg = str(err.value)
    assert "\n" not in msg and f"org/{name}" in msg and reason in msg and f"{model_type!r} is refused" in msg
    # short (under 200 characters whatever the reason): the supported types are in the page it names, every one of them
    assert len(msg) < 200 and msg.endswith("; supported types: docs/own_models.md"), (len(msg), msg)
    page = (REPO / "docs" / "own_models.md").read_text()
    assert all(f"`{t}`" in page or t in page for f in hf_capture.FAMILIES.values() for t in f.model_types)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match=reason):
        hf_capture.check_text_model(f"org/{name}", str(tmp_path), decoder=True)


def test_each_model_belongs_to_its_section(tmp_path):
    """A decoder under text.models points at decoders.models; an encoder under decoders.models at text.models."""
    from transformers import AutoConfig

    for family in FAMILIES:
        d = tmp_path / family
        tiny_config(family).save_pretrained(d)
        assert hf_capture.check_text_model(family, str(d), decoder=True) == {"qwen2": "llama"}.get(family, family)
        with pytest.raises(UnsupportedArchitectureError, match="a decoder \\(causal heads\\): list it under decoders.models, not text.models"):
            hf_capture.check_text_model(family, str(d))
    AutoConfig.for_model("bert", hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=37).save_pretrained(tmp_path / "bert")
    assert hf_capture.check_text_model("bert", str(tmp_path / "bert")) == "bert"
    with pytest.raises(UnsupportedArchitectureError, match="an encoder \\(every query sees every key\\): list it under text.models, not decoders.models"):
        hf_capture.check_text_model("bert", str(tmp_path / "bert"), decoder=True)
    assert hf_capture.hf_family(AutoConfig.for_model("mistral")).name == "llama"  # capture level: either kind


def test_a_decoder_module_with_another_logit_scale_is_refused():
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_config(tiny_config("llama"))
    model.layers[1].self_attn.scaling = 0.5
    with pytest.raises(UnsupportedArchitectureError, match=r"\(layers.1.self_attn\): model type 'llama' is refused: its logit scale is 0.5, not 1/sqrt\(head_dim\)"):
        hf_capture.attention_modules(model, "tiny")


# --------------------------------------------------------------------------------------
# The stand-ins of the default decoders (hub fixture): the published shapes, captured as such
# --------------------------------------------------------------------------------------


def test_the_default_decoders_have_stand_in_specs_the_capture_accepts():
    """Every decoders.models entry of config/config.yaml has a stand-in specification whose model
    (built on the meta device: shapes only) the capture takes with the published head layout:
    GPT-2 small and Pythia-160m 12 layers of 12 heads of 64 (Pythia rotary on 25%: 16 features),
    SmolLM2-135M 30 layers of 9 query heads on 3 KV heads, Qwen2.5-0.5B 24 layers of 14 on 2."""
    import transformers
    from transformers import AutoModel

    from kpca_tools.hub.stand_ins import DECODER_SPECS, config_models

    published = {
        "gpt2": (12, 12, 12, None),
        "EleutherAI/pythia-160m": (12, 12, 12, 16),
        "HuggingFaceTB/SmolLM2-135M": (30, 9, 3, None),
        "Qwen/Qwen2.5-0.5B": (24, 14, 2, None),
    }
    assert set(published) <= set(config_models()[1]) and set(published) == set(DECODER_SPECS)
    for mid, spec in DECODER_SPECS.items():
        config = getattr(transformers, spec.config_class)(**spec.params)
        one_layer = getattr(transformers, spec.config_class)(**{**spec.params, "n_layer" if mid == "gpt2" else "num_hidden_layers": 1})  # every layer alike
        with torch.device("meta"):
            model = AutoModel.from_config(one_layer)
        (a,) = hf_capture.attention_modules(model, mid)
        hf_capture.check_rows(config, mid, 128)  # no sliding window binds at text.max_length
        assert (config.num_hidden_layers, a.n_heads, a.n_kv_heads, getattr(a.module, "rotary_ndims", None)) == published[mid] and a.head_dim == 64, mid
        assert hf_capture.hf_family(config, mid, text=True, decoder=True).causal


def test_rows_longer_than_gpt2_positions_are_refused():
    hf_capture.check_rows(tiny_config("gpt2"), "g", 128)
    with pytest.raises(UnsupportedArchitectureError, match=r"^g: .*'gpt2' is refused: rows of 129 tokens, longer than its 128 learned positions \(n_positions\)"):
        hf_capture.check_rows(tiny_config("gpt2"), "g", 129)


def test_mistral_is_captured_as_the_llama_family(tmp_path):
    """MistralAttention (its own module and rotary function, a sliding window of 64 >= the rows)."""
    from transformers import AutoModel, MistralConfig

    source = build_tiny_decoder("llama", tmp_path / "mistral")  # the tokenizer; the model replaced below
    config = MistralConfig(
        **{
            k: v
            for k, v in tiny_config("llama").to_dict().items()
            if k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "max_position_embeddings", "initializer_range")
        },
        sliding_window=64,
    )
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(source)
    _extract(source, tmp_path / "m.h5")
    summary = validate(tmp_path / "m.h5")
    assert summary.causal and summary.n_kv_heads == 2 and summary.capture_max_rel_error < 1e-5 and summary.attrs["capture_adapter"] == "llama"
