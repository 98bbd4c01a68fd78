"""Decoders end to end (docs/method.md 16): random-init stand-ins of GPT-2, Llama with grouped-query
attention (left padding), Qwen2 with one KV head and GPT-NeoX with partial rotary, from local
directories, offline, through extraction, the full-prefix records, the decoders table, the prefix
profile and the squared norms."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from kpca_repro.activations import ActivationFile, validate
from kpca_repro.analysis.statistics import over_heads

from conftest import run_snakemake

pytestmark = pytest.mark.integration

#: family -> (query heads, KV heads) of kpca_tools.decoders' tiny configurations; the padding side
FAMILIES = {"gpt2": (4, 4, "right"), "llama": (4, 2, "left"), "qwen2": (4, 1, "right"), "gpt_neox": (4, 4, "right")}
#: PREFIX <= d + 1 = 9 (head dimension 8): every head of the profile keeps every direction (docs/method.md 17.1)
N_ROWS, PREFIX, D = 4, 8, 8


@pytest.fixture(scope="module")
def decoder_run(tmp_path_factory):
    from kpca_tools.decoders import TINY_CORPUS, build_tiny_decoder

    root = tmp_path_factory.mktemp("decoders")
    rows = root / "resources" / "text" / "wikitext-103" / "wiki.test.raw"
    rows.parent.mkdir(parents=True)
    rows.write_text("".join(f"{line}\n" for line in TINY_CORPUS))
    local = {f"tiny/{f}": str(build_tiny_decoder(f, root / "models" / f, padding_side=side)) for f, (_, _, side) in FAMILIES.items()}
    cfg = {
        "resources_dir": str(root / "resources"),
        "offline": True,
        "text": {"models": [], "n_rows": N_ROWS, "max_length": 32, "batch_size": 2},
        "decoders": {"models": list(local), "revisions": {}, "local_models": local, "prefix_lengths": [PREFIX]},
        "kpca": {"heads_per_chunk": 16, "threads": 1},
        "uncertainty": {"sign_draws": 8, "sign_draws_optimal": 2, "bootstrap": 20},
        "figure1": {"use_reference": False},
    }
    (root / "d.yaml").write_text(yaml.safe_dump(cfg))
    targets = ("results/table_decoders.csv", "results/table_decoders_corrected.csv", "results/decoders_prefix.csv", "results/figure_decoders_norms_corrected.pdf")
    run_snakemake(root, *targets, "--configfile", str(root / "d.yaml"))
    return root


def test_a_csvw_validator_accepts_every_metadata_file_of_the_run(decoder_run):
    """Every CSV of the decoders' run (tables, prefix profile, norms, and the per-head records of the full
    rows and of each prefix, rule records_metadata) has its metadata beside it, and ``csvwvalidate``'s
    check accepts each (kpca_tools.csvw_check)."""
    pytest.importorskip("csvw")
    from kpca_tools.csvw_check import results_problems

    assert any((decoder_run / "results" / "norms").rglob("decoder.csv-metadata.json"))
    assert any((decoder_run / "results" / "heads").rglob(f"*_p{PREFIX}.csv-metadata.json"))
    assert results_problems(decoder_run / "results") == []


def test_every_family_is_captured_causal_with_its_kv_heads(decoder_run):
    for family, (n_q, n_kv, side) in FAMILIES.items():
        path = decoder_run / "results" / "activations" / f"tiny--{family}" / f"text_{N_ROWS}_0of1.h5"
        summary = validate(path, kind="text")  # the capture invariant, recomputed with the causal mask and the KV map
        assert summary.format_version == 2 and summary.n_inputs == N_ROWS and summary.capture_max_rel_error < 1e-4
        af = ActivationFile(path)
        assert af.causal and af.n_kv_heads == n_kv and int(af.attrs["n_heads"]) == n_q
        assert list(af.kv_head_of_query) == [h // (n_q // n_kv) for h in range(n_q)]
        mask = af.attention_mask.astype(bool)
        padded = ~mask.all(axis=1)
        # the tokenizer's own padding side: padding at the start of a row (left) or at its end (right)
        assert padded.any()
        assert (not mask[padded, 0].any()) if side == "left" else (not mask[padded, -1].any())


def test_the_decoders_table_aggregates_kv_heads(decoder_run):
    table = pd.read_csv(decoder_run / "results" / "table_decoders.csv").set_index("hf_id")
    for family, (n_q, n_kv, _) in FAMILIES.items():
        row = table.loc[f"tiny/{family}"]
        heads = pd.read_csv(decoder_run / "results" / "heads" / "paper" / f"tiny--{family}" / f"text_{N_ROWS}_0of1.csv")
        assert row["n_query_heads"] == n_q and row["n_kv_heads"] == n_kv
        assert row["n_heads"] == len(heads) == N_ROWS * heads["layer"].nunique() * n_kv
        assert sorted(heads["head"].unique()) == list(range(n_kv))
        assert row["MDC"] == pytest.approx(over_heads(heads["direct_cos_max"], "nanmean"))
        assert row["KCKA"] == pytest.approx(over_heads(heads["rbf_cka"], "nanmean"))
        assert row["MDC_lower"] <= row["MDC_upper"]
    meta = json.loads((decoder_run / "results" / "table_decoders.csv-metadata.json").read_text())
    assert all(c.get("dc:description") for c in meta["tableSchema"]["columns"])


def test_the_prefix_profile_keeps_the_rows_long_enough(decoder_run):
    profile = pd.read_csv(decoder_run / "results" / "decoders_prefix.csv", dtype={"prefix": str})
    table = pd.read_csv(decoder_run / "results" / "table_decoders.csv").set_index("hf_id")
    for family, (_, n_kv, _) in FAMILIES.items():
        af = ActivationFile(decoder_run / "results" / "activations" / f"tiny--{family}" / f"text_{N_ROWS}_0of1.h5")
        lengths = af.attention_mask.sum(axis=1)
        rows = profile[profile["hf_id"] == f"tiny/{family}"].set_index("prefix")
        assert list(rows.index) == [str(PREFIX), "N"]
        at_p, at_n = rows.loc[str(PREFIX)], rows.loc["N"]
        assert at_p["n_rows"] == int((lengths >= PREFIX).sum()) and at_p["n_tokens"] == PREFIX
        assert at_p["n_heads"] == at_p["n_rows"] * int(af.attrs["n_layers"]) * n_kv
        # N: the full-prefix view, the decoders table's own records
        assert at_n["n_rows"] == N_ROWS and at_n["n_tokens"] == pytest.approx(lengths.mean())
        for metric in ("MDC", "MOC", "LCKA", "KCKA"):
            assert at_n[metric] == pytest.approx(table.loc[f"tiny/{family}", metric])
        assert np.isfinite(at_p[["MDC", "MOC", "LCKA", "KCKA"]].to_numpy(float)).all()
        # P = 8 <= d + 1: marked (its CKA tests only g); N: the rows of more than d + 1 tokens are not
        assert bool(at_p["cka_all_directions_kept"]) and at_p["n_heads_all_directions_kept"] == at_p["n_heads"]
        assert at_n["n_heads_all_directions_kept"] == int((lengths <= D + 1).sum()) * int(af.attrs["n_layers"]) * n_kv
        assert bool(at_n["cka_all_directions_kept"]) == bool((lengths <= D + 1).all())
        # the projection test at the last real token of each prefix (docs/method.md 17.3), bounded by its control
        for row in (at_p, at_n):
            assert -1 <= row["projection_cos"] <= 1 and row["projection_norm_ratio"] <= row["control_projection_norm_ratio"] * (1 + 1e-6)
    assert (decoder_run / "results" / "figure_decoders_prefix.pdf").stat().st_size > 0
    log = (decoder_run / "logs" / "decoders_prefix" / "decoders_prefix.log").read_text()
    assert log.count("left out of the figure's CKA lines") == len(FAMILIES)


def test_the_corrected_decoders_table_leaves_the_regime_out_of_its_cka(decoder_run):
    table = pd.read_csv(decoder_run / "results" / "table_decoders_corrected.csv")
    for family, (_, n_kv, _) in FAMILIES.items():
        heads = pd.read_csv(decoder_run / "results" / "heads" / "corrected" / f"tiny--{family}" / f"text_{N_ROWS}_0of1.csv")
        rows = table[table["hf_id"] == f"tiny/{family}"].set_index("column")
        kept = heads["n_tokens"] <= D + 1
        assert (heads["all_directions_kept"] == kept).all()
        for col in ("linear_cka", "rbf_cka", "linear_cka_unbiased", "rbf_cka_unbiased"):
            assert rows.loc[col, "n_all_directions_kept"] == kept.sum()
            assert rows.loc[col, "mean"] == pytest.approx(over_heads(heads.loc[~kept, col].dropna(), "mean"))
            assert rows.loc[col, "control_mean"] == pytest.approx(over_heads(heads.loc[~kept, f"control_{col}"].dropna(), "mean"))
        # where every direction is kept, CKA is its all-components control (docs/method.md 17.1)
        np.testing.assert_allclose(heads.loc[kept, "linear_cka"], heads.loc[kept, "control_linear_cka"], rtol=1e-8)
        assert {"projection_cos", "projection_rel_error", "projection_norm_ratio"} <= set(rows.index)


def test_the_decoders_norms_cover_every_layer(decoder_run):
    stats = pd.read_csv(decoder_run / "results" / "figure_decoders_norms_corrected.csv")
    assert set(stats["model"]) == {f"tiny/{f}" for f in FAMILIES}
    assert (stats.groupby("model")["layer"].nunique() == 2).all()
    assert (stats["median"] > 0).all()
