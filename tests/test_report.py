"""What a reader of the report sees: captions without docutils errors, whole Markdown tables.

The end-to-end checks on a built ``snakemake --report`` are in tests/test_workflow.py
(``test_comparison_and_report``, ``test_report_fails_on_a_docutils_error``).
"""

from __future__ import annotations

import os
import re

import pandas as pd
import pytest
import yaml

from kpca_repro.analysis.rendering import corrected_markdown, markdown_table
from kpca_repro.analysis.tables import CORRECTED_METRICS, TEXT_CORRECTED_METRICS
from kpca_repro.workflow import strict_docutils
from kpca_tools import report_check as rc

from conftest import REPO, TINY_KWARGS

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
    assert used[(REPO / "workflow" / "report" / "tables.rst").resolve()] == {"table"}
    assert used[(REPO / "workflow" / "report" / "figure_training.rst").resolve()] == {"fig"}
    from kpca_repro.workflow.paths import report_tables  # the pages the rule table_html renders

    assert re.search(r'^\s+table="\|"\.join\(paths\.report_tables\(\)\),$', (REPO / "workflow" / "rules" / "report.smk").read_text(), re.M)
    assert list(rc.WILDCARD_VALUES["table"]) == report_tables()


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
