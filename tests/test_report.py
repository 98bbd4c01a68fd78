"""What a reader of the report sees: captions without docutils errors, whole Markdown tables, and
the report of one target (``test_the_report_of_table1_alone_holds_table1_once``).

More end-to-end checks on a built ``snakemake --report`` are in tests/test_workflow.py
(``test_comparison_and_report``, ``test_report_fails_on_a_docutils_error``).
"""

from __future__ import annotations

import os
import re

import numpy as np
import pandas as pd
import pytest
import yaml

from kpca_repro.analysis.rendering import corrected_markdown, markdown_table
from kpca_repro.analysis.tables import CORRECTED_METRICS, TABLES, TEXT_CORRECTED_METRICS
from kpca_repro.workflow import strict_docutils
from kpca_tools import report_check as rc

from conftest import REPO, TINY_KWARGS, run_snakemake

# docutils 0.22 deprecates writer_name=, which Snakemake (and so these tests) pass
pytestmark = pytest.mark.filterwarnings('ignore:Argument "writer_name":PendingDeprecationWarning')

#: Configurations whose captions must render cleanly: the defaults, the offline ones of the
#: README, and one that takes every other branch of workflow.rst (architectures changed by
#: model_kwargs, an ImageNet folder, no language models, no training figures).
CONFIGS = {
    "default": [],
    "offline": ["config/offline_deit_tiny.yaml", "config/offline_minilm.yaml"],
    "offline-vision": ["config/offline_deit_tiny.yaml"],
}


def _tiny_config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "vision": {"models": sorted(TINY_KWARGS), "model_kwargs": TINY_KWARGS, "imagenet_val_dir": "/data/val"},
                "text": {"models": []},
                "figure1": {"runs": [], "use_reference": False},
                "comparison": {"published_tables": None},
            }
        )
    )
    return [str(path)]


@pytest.mark.parametrize("name", [*CONFIGS, "tiny"])
def test_every_caption_renders_without_docutils_messages(name, tmp_path):
    """Every caption and the front page, for every wildcard value, as Snakemake renders them."""
    files = _tiny_config(tmp_path) if name == "tiny" else [str(REPO / f) for f in CONFIGS[name]]
    config = rc.load_config(REPO, files)
    assert rc.lint_captions(REPO, config) == []


def test_the_lint_sees_every_caption_and_every_table():
    used = rc.caption_files(REPO)
    assert set(used) == {p.resolve() for p in (REPO / "workflow" / "report").glob("*.rst")}
    assert used[(REPO / "workflow" / "report" / "tables.rst").resolve()] == {"table", "suffix"}
    assert used[(REPO / "workflow" / "report" / "figure_training.rst").resolve()] == {"fig"}
    assert re.search(r'^\s+table="\|"\.join\(TABLES\),$', (REPO / "workflow" / "rules" / "tables.smk").read_text(), re.M)  # the pages rule table writes
    assert list(rc.WILDCARD_VALUES["table"]) == list(TABLES)


def test_no_caption_reads_params():
    """Snakemake prints every param of a result's job under "JOB PARAMETERS": a caption that a param
    carried would be printed twice, the second time as raw markup."""
    for path in rc.caption_files(REPO):
        assert "snakemake.params" not in path.read_text(), path.name
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        assert not re.search(r"^\s+caption=(?!\"\.\./report/)", smk.read_text(), re.M), smk.name  # caption= only in report(...), a file


def test_a_bad_table_caption_is_a_lint_problem(monkeypatch):
    """A table's caption (reST in the registry) heads its page: a docutils error in it is found."""
    import dataclasses

    monkeypatch.setitem(TABLES, "table1", dataclasses.replace(TABLES["table1"], caption="the spread |γᵢ − γⱼ|"))
    assert any("table1.caption" in p and "Undefined substitution" in p for p in rc.lint_captions(REPO, rc.load_config(REPO)))


def test_the_lint_reports_substitutions_markup_and_undefined_variables(tmp_path):
    (tmp_path / "workflow" / "rules").mkdir(parents=True)
    (tmp_path / "workflow" / "report").mkdir()
    (tmp_path / "Snakefile").write_text('report: "workflow/report/front.rst"\n')
    (tmp_path / "workflow" / "rules" / "a.smk").write_text('rule a:\n    output: report("x.png", caption="../report/a.rst", category="Figures")\n')
    (tmp_path / "workflow" / "report" / "front.rst").write_text("Models: {{ snakemake.config['vison'] }}.\n")
    (tmp_path / "workflow" / "report" / "a.rst").write_text("{% if snakemake.wildcards.suffix %}the spread |γᵢ − γⱼ| of *emphasis{% else %}\\|λ\\| is fine, see Figures_{% endif %}\n")
    problems = rc.lint_captions(tmp_path, {"vision": {}})
    assert any("front.rst" in p and "vison" in p for p in problems), problems
    assert any("a.rst {'suffix': '_corrected'}" in p and 'Undefined substitution referenced: "γᵢ − γⱼ"' in p for p in problems), problems
    assert any("a.rst {'suffix': '_corrected'}" in p and "Inline emphasis start-string without end-string" in p for p in problems), problems
    assert not any("a.rst {'suffix': ''}" in p for p in problems), problems  # escaped pipes, a category link


def test_docutils_conf_makes_snakemakes_rendering_fail(monkeypatch):
    """What the Snakefile sets up: docutils, called as Snakemake calls it, raises instead of printing."""
    from docutils.core import publish_parts
    from docutils.utils import SystemMessage

    conf = REPO / "workflow" / "report" / "docutils.conf"
    assert 'strict_docutils(REPO / "workflow" / "report" / "docutils.conf")' in (REPO / "Snakefile").read_text()
    monkeypatch.setenv("DOCUTILSCONFIG", "/nonexistent/docutils.conf")
    strict_docutils(conf)
    strict_docutils(conf)  # once only
    assert os.environ["DOCUTILSCONFIG"] == f"/nonexistent/docutils.conf{os.pathsep}{conf}"
    with pytest.raises(SystemMessage, match="Undefined substitution"):
        publish_parts("the spread |γᵢ − γⱼ| over token pairs", writer_name="html")
    assert "|γᵢ − γⱼ|" in publish_parts(r"the spread \|γᵢ − γⱼ\| over token pairs", writer_name="html")["body"]
    monkeypatch.delenv("DOCUTILSCONFIG")
    assert "System Message" in publish_parts("|λ|", writer_name="html")["body"]  # docutils' default: into the page


def test_report_problems_finds_system_messages(tmp_path):
    from docutils.core import publish_parts

    page = tmp_path / "report.html"
    page.write_text("<script>var x = " + repr(publish_parts("(|λ|-descending)", writer_name="html")["body"]) + "</script>")
    assert any("Undefined substitution" in p for p in rc.report_problems(page))
    page.write_text("<p>(|λ|-descending)</p>")
    assert rc.report_problems(page) == []


@pytest.mark.parametrize("metrics", [CORRECTED_METRICS, TEXT_CORRECTED_METRICS], ids=["table1", "table4"])
def test_corrected_markdown_is_a_whole_table(metrics):
    """|cosine| in a metric label is escaped: one cell per column, and GFM renders the header as written."""
    from markdown_it import MarkdownIt

    rows = [{"model": m, "metric": label, "mean": 0.5, "std": 0.1, "baseline_mean": 0.2, "n_heads": 36, "n_nonfinite": 0} for m in ("A|B", "C") for _, label, _ in metrics]
    md = corrected_markdown(pd.DataFrame(rows), metrics)
    assert rc.markdown_problems(md) == []
    expected = ["model", *(label for _, label, _ in metrics), "heads (non-finite)"]
    assert all(len(rc.markdown_cells(line)) == len(expected) for line in md.splitlines())
    tokens = MarkdownIt("commonmark").enable("table").parse(md)
    header = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "th_open"]
    cells = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "td_open"]
    assert header == expected and any("|cosine|" in h for h in header)
    assert cells[0] == "A|B" and len(cells) == 2 * len(expected)


def test_markdown_problems_finds_an_unescaped_pipe():
    frame = pd.DataFrame({"model": ["A"], "direct |cosine| (columns)": [0.1]})
    assert rc.markdown_problems(frame.to_markdown(index=False)) != []
    assert rc.markdown_problems(markdown_table(frame, floatfmt=".3f")) == []
    assert markdown_table(frame, floatfmt=".3f").splitlines()[2].endswith("0.100 |")


@pytest.mark.integration
def test_the_report_of_table1_alone_holds_table1_once(tiny_resources, tmp_path):
    """`snakemake --report <file> results/table1.csv` after a run of that one target: the report (a
    single .html, or a .zip with the file under data/raw/) holds Table 1's page and nothing else, with
    each number of the CSV to 3 significant digits; Table 1's caption is printed once (on the page:
    not in the report's description, not under "JOB PARAMETERS"); the front page names what was built
    (Table 1, paper variant, its model) and no table, figure or variant the run did not build."""
    import html

    model = "vit_tiny_patch16_224"
    cfg = tmp_path / "tiny.yaml"
    vision = {"models": [model], "n_images": 2, "batch_size": 2, "shards": 1, "model_kwargs": {model: TINY_KWARGS[model]}}
    cfg.write_text(yaml.safe_dump({"offline": True, "resources_dir": str(tiny_resources), "vision": vision, "text": {"models": []}, "kpca": {"threads": 1}}))
    run_snakemake(tmp_path, "results/table1.csv", "--configfile", str(cfg))
    table = pd.read_csv(tmp_path / "results" / "table1.csv")
    caption = TABLES["table1"].caption.split("**")[1]  # its first sentence, "Table 1: V against V_KPCA in vision transformers."
    contents = []
    for name in ("report.html", "report.zip"):
        run_snakemake(tmp_path, "results/table1.csv", "--configfile", str(cfg), "--report", str(tmp_path / name))
        results = rc.report_results(tmp_path / name)
        assert list(results) == ["results/html/table1.html"]
        entry = results["results/html/table1.html"]
        assert entry["labels"] == {"result": "Table 1", "variant": "paper", "models": model} and entry["job_properties"]["rule"] == "table"
        page = entry["content"].decode("utf-8")
        contents.append(page)
        # the page's "Every column" table: one row per column, X with X_lower and X_upper as one
        # cell "value [lower, upper]", a pair P_lower, P_upper without P as "[lower, upper]" named P
        every = page.split("<h4>Every column</h4>", 1)[1].split("<h4>Columns</h4>", 1)[0]
        shown = {html.unescape(n): html.unescape(c) for n, c in re.findall(r"<tr><th[^>]*>([^<]*)</th><td>([^<]*)</td></tr>", every)}
        assert set(table.columns[1:]) == {c for n in shown for c in (n, f"{n}_lower", f"{n}_upper") if c in table.columns}
        for column, cell in shown.items():
            parts = [c for c in (column, f"{column}_lower", f"{column}_upper") if c in table.columns]
            values = [table[c].iloc[0] for c in parts]
            if not all(isinstance(v, (float, np.floating, int, np.integer)) and not isinstance(v, bool) for v in values):
                continue
            finite = [float(v) for v in values if np.isfinite(v)]
            numbers = [float(x) for x in re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?", cell)]
            assert numbers == pytest.approx(finite, rel=5e-3, abs=1e-12), (column, cell, values)
            if column in table.columns and np.isfinite(values[0]) and values[0] != 0:  # 3 significant digits
                digits = re.sub(r"e[-+]\d+$|[-.]", "", cell.split(" [")[0]).lstrip("0")
                assert len(digits) <= max(3, len(str(int(abs(values[0]))))), (column, cell)
        everything = page + entry["caption"] + entry["job_properties"]["params"] + rc.front_page(tmp_path / name)
        assert everything.count(caption) == 1 and caption in page
        description = re.sub(r"<[^>]+>", "", entry["caption"]).split()[:6]
        assert " ".join(description) not in entry["job_properties"]["params"]
        front = rc.front_page(tmp_path / name)
        assert "table1.html" in front and "Table 1 (paper)" in front and model in front
        assert not re.search(r"Table [2-9]|Figure|corrected|published vs reproduced|Table 4", front), front
        assert f"depth={TINY_KWARGS[model]['depth']}" in front  # the run's changed architecture is said
        assert rc.report_problems(tmp_path / name) == []
    assert contents[0] == contents[1] == (tmp_path / "results" / "html" / "table1.html").read_text()
