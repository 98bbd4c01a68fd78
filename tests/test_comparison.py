"""The comparison of published and reproduced numbers: rounding decisions and statuses."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pandas as pd
import pytest

from kpca_repro.analysis import comparison as cmp
from kpca_repro.analysis.tables import TABLES


@pytest.mark.parametrize(
    "published, reproduced, expected",
    [
        ("0.31", 0.3149, cmp.MATCH),
        ("0.31", 0.305, cmp.MATCH),  # exactly half a unit of the last decimal
        ("0.31", 0.3151, cmp.DIFFERS),
        ("0.15", 0.124, cmp.DIFFERS),
        ("325", 325.49, cmp.MATCH),
        ("325", 326.0, cmp.DIFFERS),
        ("1043", 1043.0, cmp.MATCH),
    ],
)
def test_status_is_rounding_to_the_published_decimals(published, reproduced, expected):
    assert cmp.status(published, reproduced) == expected


def test_status_refuses_missing_numbers():
    with pytest.raises(ValueError):
        cmp.status("", 0.3)
    with pytest.raises(ValueError):
        cmp.status("0.3", float("nan"))


def _write(path, text):
    path.write_text(text)
    return path


def test_status_uses_the_interval_widened_by_the_published_rounding():
    assert cmp.status("0.15", 0.124, 0.11, 0.16) == cmp.CONSISTENT
    assert cmp.status("0.15", 0.124, 0.11, 0.14) == cmp.DIFFERS  # 0.145 > 0.14
    assert cmp.status("0.15", 0.124, 0.11, 0.145) == cmp.CONSISTENT  # touches the rounding range
    assert cmp.status("0.15", 0.124, float("nan"), 0.16) == cmp.DIFFERS  # no interval
    assert cmp.status("0.15", 0.149, 0.0, 0.01) == cmp.WITHIN_ROUNDING  # rounding first


def test_not_comparable_reason():
    sha = "ab" * 32
    assert cmp.not_comparable_reason("a", {}, {}, sha) is None
    assert cmp.not_comparable_reason("a", {"a": {}}, {"a": sha.upper()}, sha) is None
    assert "model_kwargs" in cmp.not_comparable_reason("a", {"a": {"depth": 2}}, {}, sha)
    assert "checksums.a" in cmp.not_comparable_reason("a", {}, {"a": "cd" * 32}, sha)
    assert cmp.not_comparable_reason("a", {}, {"a": sha}, None) is None  # nothing recorded (Tables 2-3)
    # a stand-in (random weights of the exact architecture) is never compared, whatever else holds
    assert cmp.not_comparable_reason("a", {}, {"a": sha}, sha, stand_ins=["a"]) == cmp.STAND_IN_REASON
    assert cmp.not_comparable_reason("a", {}, {}, sha, stand_ins=["b"]) is None


def test_stand_in_rows_are_labelled_in_the_tables_and_not_compared(tmp_path):
    """config comparison.stand_in_models: the model cell says "stand-in weights" in every table
    form (timm_id or hf_id), the comparison marks every cell of the model not comparable, and a
    table without stand-ins keeps its bytes."""
    from kpca_repro.analysis.rendering import STAND_IN_LABEL, label_rows

    def label_stand_ins(table, ids):
        return label_rows(table, ids, STAND_IN_LABEL)

    t1 = pd.DataFrame({"model": ["A", "B"], "timm_id": ["a", "b"], "MDC": [0.124, 0.2]})
    t4 = pd.DataFrame({"model": ["MiniLM", "BERT"], "hf_id": ["org/minilm", "bert-base-uncased"], "MDC": [0.4, 0.5]})
    assert list(label_stand_ins(t1, ["b"])["model"]) == ["A", "B" + STAND_IN_LABEL]
    assert list(label_stand_ins(t4, ["bert-base-uncased"])["model"]) == ["MiniLM", "BERT (stand-in weights)"]
    assert list(t1["model"]) == ["A", "B"]  # a copy: the input is untouched
    assert label_stand_ins(t1, []) is t1 and label_stand_ins(t1, ["z"]) is t1
    assert label_stand_ins(t1, ["z"]).to_csv(index=False) == t1.to_csv(index=False)

    pub = tmp_path / "published"
    pub.mkdir()
    _write(pub / "table1_vision_similarity.csv", "model,timm_id,MDC,MOC,LCKA,KCKA\nA,a,0.15,0.31,0.11,0.31\nB,b,0.2,0.3,0.1,0.3\n")
    reproduced = tmp_path / "table1.csv"
    label_stand_ins(pd.DataFrame({"model": ["A", "B"], "timm_id": ["a", "b"], "MDC": [0.15, 0.2], "MOC": [0.31, 0.3], "LCKA": [0.11, 0.1], "KCKA": [0.31, 0.3]}), ["b"]).to_csv(reproduced, index=False)
    out = cmp.comparison_table(pub, {"table1": (str(reproduced), None)}, {}, stand_ins=["b"])
    b = out[out["model_id"] == "b"]
    assert len(b) == 4 and (b["status"] == cmp.NOT_COMPARABLE).all() and (b["reason"] == cmp.STAND_IN_REASON).all()
    assert (out[out["model_id"] == "a"]["status"] == cmp.WITHIN_ROUNDING).all()  # the real model is compared as before


def test_comparison_statuses_on_a_small_fixture(tmp_path):
    """Every status on hand-made published and reproduced tables, and the order of the rows."""
    pub = tmp_path / "published"
    pub.mkdir()
    _write(pub / "table1_vision_similarity.csv", "model,timm_id,MDC,MOC,LCKA,KCKA\nA,a,0.15,0.31,0.11,0.31\nB,b,0.10,0.30,0.05,0.25\nC,c,0.1,0.3,0.1,0.3\nD,d,0.1,0.3,0.1,0.3\n")
    _write(pub / "table3_eigenvalues_unstandardized.csv", "model,timm_id,max_mean,max_std,min_mean,min_std,mean_mean,mean_std,median_mean,median_std\nA,a,,,34,11,96,15,60,14\n")
    sha = "ab" * 32
    t1 = _write(
        tmp_path / "table1.csv",
        "model,timm_id,MDC,MOC,LCKA,KCKA,MDC_solver_lower,MDC_solver_upper,MDC_lower,MDC_upper,KCKA_lower,KCKA_upper,weights_sha256\n"
        f"A,a,0.124,0.309,0.107,0.303,0.09,0.14,0.08,0.16,0.300,0.304,{sha}\n"
        f"C,c,0.1,0.3,0.1,0.3,,,,,,,{sha}\n"
        f"D,d,0.1,0.3,0.1,0.3,,,,,,,{sha}\n",
    )
    t1c = _write(
        tmp_path / "table1_corrected.csv",
        "model,timm_id,column,paper_statistic_value\nA,a,direct_cos_mean,0.12\nA,a,optimal_cos_mean,0.306\nA,a,linear_cka,0.107\nA,a,rbf_cka,0.303\n",
    )
    t3 = _write(
        tmp_path / "table3.csv",
        "model,timm_id,max_mean_raw,max_std_raw,min_mean_raw,min_std_raw,mean_mean_raw,mean_std_raw,median_mean_raw,median_std_raw,min_mean_raw_lower,min_mean_raw_upper,min_std_raw_lower,min_std_raw_upper\n"
        "A,a,1104,138,35,10,98,16,,15,30,40,9,10.4\n",
    )
    out = cmp.comparison_table(
        pub,
        {"table1": (str(t1), str(t1c)), "table3": (str(t3), None)},
        {"b": "weights unavailable: w/b.safetensors"},
        model_kwargs={"c": {"depth": 2}},
        checksums={"d": "cd" * 32, "a": sha},
    )

    def get(table, model, col):
        return out[(out["table"] == table) & (out["model_id"] == model) & (out["column"] == col)].iloc[0]

    mdc = get("Table 1", "a", "MDC")
    assert mdc["status"] == cmp.CONSISTENT and (mdc["lower"], mdc["upper"], mdc["solver_lower"], mdc["solver_upper"]) == (0.08, 0.16, 0.09, 0.14)
    assert mdc["difference"] == pytest.approx(0.124 - 0.15)
    assert get("Table 1", "a", "MOC")["status"] == cmp.WITHIN_ROUNDING
    assert get("Table 1", "a", "MOC")["corrected"] == pytest.approx(0.306)
    assert get("Table 1", "a", "KCKA")["status"] == cmp.DIFFERS_SAMPLING  # 0.31 - 0.005 > 0.304; a bootstrap interval: sampling only
    assert get("Table 1", "a", "LCKA")["status"] == cmp.WITHIN_ROUNDING
    b = get("Table 1", "b", "LCKA")
    assert b["status"] == cmp.NOT_RUN and b["reason"] == "weights unavailable: w/b.safetensors"
    assert get("Table 1", "c", "MDC")["status"] == cmp.NOT_COMPARABLE and "model_kwargs" in get("Table 1", "c", "MDC")["reason"]
    assert get("Table 1", "d", "MDC")["status"] == cmp.NOT_COMPARABLE and "checksums.d" in get("Table 1", "d", "KCKA")["reason"]
    assert get("Table 3", "a", "max_mean")["status"] == cmp.NOT_PUBLISHED
    assert get("Table 3", "a", "min_mean")["status"] == cmp.CONSISTENT_SAMPLING  # 35 vs 34, interval 30-40
    assert get("Table 3", "a", "min_std")["status"] == cmp.DIFFERS_SAMPLING  # 10 vs 11: the interval 9-10.4 misses 10.5-11.5
    assert get("Table 3", "a", "mean_std")["status"] == cmp.DIFFERS_SAMPLING  # 16 vs 15, no interval
    assert get("Table 3", "a", "mean_std")["reason"] == "no interval in the reproduced table"
    assert get("Table 3", "a", "median_mean")["status"] == cmp.NOT_COMPARABLE  # not finite
    assert set(out["status"]) == {cmp.WITHIN_ROUNDING, cmp.CONSISTENT, cmp.CONSISTENT_SAMPLING, cmp.DIFFERS_SAMPLING, cmp.NOT_COMPARABLE, cmp.NOT_RUN, cmp.NOT_PUBLISHED}
    assert len(out) == 4 * 4 + 8  # every published cell has a row
    ranks = out["status"].map(cmp.STATUS_ORDER).to_numpy()
    assert (ranks[1:] >= ranks[:-1]).all() and ranks[0] == 0  # ran, then not comparable, then not run / not published
    assert out["source"].str.startswith("arXiv:2505.07908 Table ").all()
    md = cmp.comparison_markdown(out)
    assert md.startswith(f"{len(out)} published numbers")


def test_a_registered_table_is_built_and_compared(tmp_path, monkeypatch):
    """A toy table is one registry entry and one row function: the paper variant aggregates its
    statistic with its bootstrap interval beside it, its Markdown shows it, and the comparison
    reads its published file (every cell gets a status, its models are the domain's)."""
    from kpca_repro.analysis import rendering, tables

    toy = tables.Table("table9", "vision", lambda heads, kept, meta: {"n_heads": len(heads), "weights_sha256": meta["weights_sha256"]}, (("MLC", "linear_cka", "mean"),), published="table9_toy.csv")
    monkeypatch.setitem(tables.TABLES, "table9", toy)
    heads = pd.DataFrame({"model": "a", "layer": 0, "sample_rank": range(4), "head": 0, "linear_cka": [0.1, 0.2, 0.3, 0.2], "dropped": False})
    reproduced = tables.paper_table(toy, heads, {"a": {"weights_sha256": "x"}}, uncertainty={"bootstrap": 50})
    assert list(reproduced.columns[:7]) == ["model", "timm_id", "MLC", "MLC_lower", "MLC_upper", "n_heads", "weights_sha256"]
    assert reproduced.loc[0, "MLC"] == pytest.approx(0.2) and reproduced.loc[0, "MLC_lower"] <= 0.2 <= reproduced.loc[0, "MLC_upper"]
    assert "| MLC" in rendering.paper_markdown(reproduced, toy)
    reproduced.to_csv(tmp_path / "table9.csv", index=False)
    pub = tmp_path / "published"
    pub.mkdir()
    _write(pub / "table9_toy.csv", "model,timm_id,MLC\nA,a,0.20\nZ,z,0.5\n")
    out = cmp.comparison_table(pub, {"table9": (str(tmp_path / "table9.csv"), None)}, {"z": "not in config vision.models"})
    assert out.set_index("model_id")["status"].to_dict() == {"a": cmp.WITHIN_ROUNDING, "z": cmp.NOT_RUN} and set(out["table"]) == {"Table 9"}
    assert cmp.published_model_ids(pub) == {"a": "vision", "z": "vision"}


def test_missing_published_directory_gives_an_empty_table(tmp_path):
    out = cmp.comparison_table(tmp_path / "nowhere", {}, {})
    assert out.empty and "status" in out.columns
    assert "comparison.published_tables" in cmp.comparison_markdown(out)


def test_table_html_renders_every_row_and_blanks_nan(tmp_path):
    from kpca_repro.analysis.report import table_html

    csv = _write(tmp_path / "t.csv", "model,MDC,weights_sha256\nA,0.1234,b2e17235172c1dcddacb55aa8914e2f8b4b95eb9bb7d7782f333bcbef77151b8\nB,,x\n")
    page = table_html(csv, "table1")
    assert page.count("<tr") == 3 and "<td>0.123</td>" in page and "<td></td>" in page
    assert "b2e17235172c…" in page and "b2e17235172c1dcd" not in page


# The paper's tables shipped with the package (issue 31 item 5)

REPO = Path(__file__).resolve().parents[1]
SHARED_TABLES = REPO.parent / "shared" / "reference" / "paper_tables"


def test_builtin_value_resolves_to_the_packaged_tables(tmp_path):
    assert cmp.resolve_published_dir(cmp.BUILTIN) == cmp.BUILTIN_DIR
    assert cmp.resolve_published_dir(None) is None and cmp.resolve_published_dir("") is None
    assert cmp.resolve_published_dir(str(tmp_path)) == tmp_path
    assert cmp.resolve_published_dir(Path("builtin")) == Path("builtin")  # a Path is always a directory
    assert cmp.BUILTIN_DIR.is_relative_to(Path(cmp.__file__).resolve().parents[1])  # inside the package, not the checkout
    assert sorted(p.name for p in cmp.BUILTIN_DIR.glob("*.csv")) == sorted(t.published for t in TABLES.values() if t.published)


@pytest.mark.skipif(not SHARED_TABLES.is_dir(), reason=f"{SHARED_TABLES} absent: no reference copy to check against")
@pytest.mark.parametrize("table", [t for t in TABLES.values() if t.published], ids=lambda t: t.published)
def test_packaged_tables_equal_the_reference_copy(table):
    """Cell for cell, as text (the printed decimals set the rounding of the comparison)."""
    packaged = cmp.read_published(cmp.BUILTIN, table)
    reference = cmp.read_published(SHARED_TABLES, table)
    pd.testing.assert_frame_equal(packaged, reference)


def test_packaged_table1_agrees_with_the_abstract():
    """An independent check of the transcription: the abstract (arXiv:2505.07908, ACL 2025 SRW)
    bounds the average similarities by optimal cosine <= 0.32, linear CKA <= 0.11, kernel CKA <= 0.32,
    and those bounds are attained in Table 1."""
    table1 = cmp.read_published(cmp.BUILTIN, TABLES["table1"]).set_index("timm_id")
    assert len(table1) == 10
    assert {col: table1[col].astype(float).max() for col in ("MOC", "LCKA", "KCKA")} == {"MOC": 0.32, "LCKA": 0.11, "KCKA": 0.32}
    assert table1.loc["deit_tiny_patch16_224", ["MDC", "MOC", "LCKA", "KCKA"]].tolist() == ["0.15", "0.31", "0.11", "0.31"]


def test_package_data_ships_every_packaged_table():
    """pyproject's package-data globs cover every file of the packaged tables (else a wheel lacks them)."""
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kpca_repro"]
    package = Path(cmp.__file__).resolve().parents[1]  # kpca_repro (comparison is in kpca_repro.analysis)
    files = [p.relative_to(package).as_posix() for p in cmp.BUILTIN_DIR.iterdir() if p.is_file()]
    assert "data/paper_tables/README.md" in files
    assert all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), (files, globs)


def test_the_default_configuration_compares_with_the_published_numbers():
    """config/config.yaml, schema defaults filled: every row of results/paper_comparison.csv carries
    the paper's number (204 cells, 4 of them unreadable in the paper), with no ../shared setting."""
    import yaml
    from snakemake.utils import validate

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert config["comparison"]["published_tables"] == cmp.BUILTIN
    for name in ("offline_deit_tiny.yaml", "offline_minilm.yaml"):
        assert "comparison" not in yaml.safe_load((REPO / "config" / name).read_text())
    del config["comparison"]
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))  # the schema's default is the same
    assert config["comparison"]["published_tables"] == cmp.BUILTIN
    out = cmp.comparison_table(config["comparison"]["published_tables"], {}, {})
    assert len(out) == 204
    assert out["published"].notna().sum() == 200 and (out.loc[out["published"].isna(), "status"] == cmp.NOT_PUBLISHED).all()
    assert out["source"].str.contains("kpca_repro built-in copy").all() and str(REPO.parent) not in "".join(out["source"])
    deit = out[(out["table"] == "Table 2") & (out["model_id"] == "deit_tiny_patch16_224") & (out["column"] == "max_mean")]
    assert deit["published"].tolist() == [325.0]


def test_null_turns_the_comparison_off():
    out = cmp.comparison_table(None, {}, {})
    assert out.empty and list(out.columns) == cmp.COLUMNS
    assert "is null" in cmp.comparison_markdown(out)
