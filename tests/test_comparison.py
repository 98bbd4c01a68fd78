"""The comparison of published and reproduced numbers: rounding decisions and statuses."""

from __future__ import annotations

import pandas as pd
import pytest

from kpca_repro import comparison as cmp


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


def test_comparison_statuses_on_a_small_fixture(tmp_path):
    pub = tmp_path / "published"
    pub.mkdir()
    _write(pub / "table1_vision_similarity.csv", "model,timm_id,MDC,MOC,LCKA,KCKA\nA,a,0.15,0.31,0.11,0.31\nB,b,0.10,0.30,0.05,0.25\n")
    _write(pub / "table3_eigenvalues_unstandardized.csv", "model,timm_id,max_mean,max_std,min_mean,min_std,mean_mean,mean_std,median_mean,median_std\nA,a,,,34,11,96,15,60,14\n")
    t1 = _write(tmp_path / "table1.csv", "model,timm_id,MDC,MOC,LCKA,KCKA\nA,a,0.124,0.309,0.107,0.303\n")
    t1c = _write(
        tmp_path / "table1_corrected.csv",
        "model,timm_id,column,paper_statistic_value\nA,a,direct_cos_mean,0.12\nA,a,optimal_cos_mean,0.306\nA,a,linear_cka,0.107\nA,a,rbf_cka,0.303\n",
    )
    t3 = _write(tmp_path / "table3.csv", "model,timm_id,max_mean_raw,max_std_raw,min_mean_raw,min_std_raw,mean_mean_raw,mean_std_raw,median_mean_raw,median_std_raw\nA,a,1104,138,35,10,98,16,,15\n")
    out = cmp.comparison_table(pub, {"1": (str(t1), str(t1c)), "3": (str(t3), None)}, {"b": "weights unavailable: w/b.safetensors"})
    get = lambda table, model, col: out[(out["table"] == table) & (out["model_id"] == model) & (out["column"] == col)].iloc[0]
    assert get("Table 1", "a", "MDC")["status"] == cmp.DIFFERS
    assert get("Table 1", "a", "MDC")["difference"] == pytest.approx(0.124 - 0.15)
    assert get("Table 1", "a", "MOC")["status"] == cmp.MATCH
    assert get("Table 1", "a", "MOC")["corrected"] == pytest.approx(0.306)
    assert get("Table 1", "a", "KCKA")["status"] == cmp.DIFFERS  # 0.303 vs 0.31
    assert get("Table 1", "b", "LCKA")["status"] == "not run: weights unavailable: w/b.safetensors"
    assert get("Table 3", "a", "max_mean")["status"].startswith("not published")
    assert get("Table 3", "a", "min_mean")["status"] == cmp.DIFFERS  # 35 vs 34: more than half a unit
    assert get("Table 3", "a", "min_std")["status"] == cmp.DIFFERS  # 10 vs 11
    assert get("Table 3", "a", "mean_std")["status"] == cmp.DIFFERS  # 16 vs 15
    assert get("Table 3", "a", "median_mean")["status"] == "reproduced value is not finite"
    assert len(out) == 2 * 4 + 8  # every published cell has a row
    assert out["source"].str.startswith("arXiv:2505.07908 Table ").all()
    md = cmp.comparison_markdown(out)
    assert md.startswith(f"{len(out)} published numbers")


def test_missing_published_directory_gives_an_empty_table(tmp_path):
    out = cmp.comparison_table(tmp_path / "nowhere", {}, {})
    assert out.empty and "status" in out.columns
    assert "comparison.published_tables" in cmp.comparison_markdown(out)


def test_table_html_renders_every_row_and_blanks_nan(tmp_path):
    from kpca_repro.report import table_html

    csv = _write(tmp_path / "t.csv", "model,MDC,weights_sha256\nA,0.1234,b2e17235172c1dcddacb55aa8914e2f8b4b95eb9bb7d7782f333bcbef77151b8\nB,,x\n")
    page = table_html(csv, "table1")
    assert page.count("<tr") == 3 and "<td>0.123</td>" in page and "<td></td>" in page
    assert "b2e17235172c…" in page and "b2e17235172c1dcd" not in page
