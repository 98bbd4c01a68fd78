"""Checks of what a reader sees: captions that render cleanly, a clean report, whole Markdown tables.

Snakemake renders each caption of ``workflow/report/`` (and the front page named by the
Snakefile's ``report:`` directive) with Jinja2 and then docutils. By default docutils does not
fail on an error: it prints a red "System Message" box into the page (for example
"Undefined substitution referenced" when ``|λ|`` is read as a reST substitution). Two guards:

* the build: the Snakefile (:func:`kpca_repro.workflow.strict_docutils`) points ``DOCUTILSCONFIG`` at ``workflow/report/docutils.conf``
  (``halt_level: warning``), so ``snakemake --report`` itself stops at the first docutils
  warning or error, naming the caption file;
* this module: :func:`lint_captions` renders every caption for every value of the wildcards
  it branches on (also the branches a given run does not reach), with undefined Jinja
  variables as errors, and collects every docutils message; :func:`report_problems` scans
  a built ``report.html`` (or ``.zip``) for docutils system messages.

Command line (exit status 1 on any problem)::

    python -m kpca_tools.report_check [my.yaml ...]    (PYTHONPATH=tools) [results/*.md] [report.html]
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import warnings
import zipfile
from pathlib import Path
from types import SimpleNamespace

from kpca_repro.analysis.tables import TABLES
from kpca_repro.method.variant import REGISTRY

__all__ = [
    "WILDCARD_VALUES",
    "sample_results",
    "docutils_messages",
    "caption_files",
    "render_caption",
    "lint_captions",
    "report_problems",
    "front_page",
    "report_results",
    "markdown_cells",
    "markdown_problems",
    "load_config",
]

#: This checkout (its captions are checked by default).
_REPO = Path(__file__).resolve().parents[2]

#: Values of the wildcards the captions branch on, as the rules produce them: ``table`` of rule
#: ``table`` (the table registry), ``fig`` of ``figure_training``, ``suffix`` of the table and figure rules.
WILDCARD_VALUES = {
    "table": tuple(TABLES),
    "fig": ("1", "4"),
    "suffix": tuple(v.suffix for v in REGISTRY.values()),
}


def sample_results(config: dict) -> list[SimpleNamespace]:
    """Stand-ins for the results Snakemake hands the front page (``files``: ``target``, the file's
    name, and ``labels``, as the rules' ``report_labels`` give them): every table of the registry and
    every figure in every variant, the training results and the comparison, with ``config``'s models."""
    vision, text = ", ".join(config["vision"]["models"]) or "none", ", ".join(config["text"]["models"]) or "none"
    items = [(t.title, t.name, v.name, vision if t.domain == "vision" else text) for t in TABLES.values() for v in REGISTRY.values()]
    items += [(f"Figure {f}", f"figure{f}", v.name, models) for f, models in (("2", vision), ("3", config["figure3"]["model"]), ("5", text)) for v in REGISTRY.values()]
    items += [("Figure 1", "figure1", "the authors' logs", "none"), ("token ablation", "token_ablation", "runs trained here", "none")]
    items += [("published vs reproduced", "paper_comparison", "paper, corrected", ", ".join(config["vision"]["models"] + config["text"]["models"]) or "none")]
    return [SimpleNamespace(target=f"{stem}{REGISTRY[v].suffix if v in REGISTRY else ''}.html", labels={"result": name, "variant": v, "models": models}) for name, stem, v, models in items]


#: Text of docutils system messages in HTML and of the ones the warning stream prints.
_REPORT_PATTERNS = ("System Message", "system-message", "Undefined substitution", "Unknown target name", "(ERROR/", "(WARNING/", "(SEVERE/")


def docutils_messages(rst: str) -> list[str]:
    """Every docutils message of level warning or above raised while rendering ``rst`` to HTML.

    Rendered as Snakemake does (``publish_parts(..., writer_name="html")``) but with the
    messages written to a buffer instead of into the page; configuration files are ignored.
    """
    from docutils.core import publish_parts

    stream = io.StringIO()
    with warnings.catch_warnings():  # writer_name, as Snakemake passes it, is deprecated in docutils 0.22
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        publish_parts(
            rst,
            writer_name="html",
            settings_overrides={"report_level": 2, "halt_level": 5, "warning_stream": stream, "_disable_config": True, "traceback": True},
        )
    text = stream.getvalue().strip()
    return [m.strip() for m in re.split(r"\n(?=<string>:|\S+:\d+: \()", text) if m.strip()] if text else []


def caption_files(root: str | Path) -> dict[Path, set[str]]:
    """Caption files the workflow under ``root`` uses -> the wildcards each one branches on.

    Read from the Snakefile's ``report:`` directive and every ``caption="..."`` of the rule
    files (paths relative to the rule file, as Snakemake resolves them).
    """
    root = Path(root)
    found: dict[Path, set[str]] = {}
    snakefile = (root / "Snakefile").read_text()
    for rel in re.findall(r'^report:\s*"([^"]+)"', snakefile, flags=re.M):
        found[(root / rel).resolve()] = set()
    for smk in sorted((root / "workflow" / "rules").glob("*.smk")):
        for rel in re.findall(r'caption\s*=\s*"([^"]+)"', smk.read_text()):
            found[(smk.parent / rel).resolve()] = set()
    for path in found:
        found[path] = set(re.findall(r"snakemake\.wildcards\.(\w+)", path.read_text()))
    return found


def _link_targets(root: Path) -> str:
    """The link targets Snakemake appends to every caption before Jinja renders it: the panels, the
    categories of the rule files and each result (``files``), as ``snakemake.report`` writes them."""
    categories = set()
    for smk in (root / "workflow" / "rules").glob("*.smk"):
        categories.update(re.findall(r'category\s*=\s*"([^"]+)"', smk.read_text()))
    lines = [".. _Workflow: javascript:show_panel('workflow')", ".. _Statistics: javascript:show_panel('statistics')"]
    lines += [f".. _{c}: javascript:app.showCategory('{c}')" for c in sorted(categories)]
    lines += ["{% for res in files %}", ".. _{{ res.target }}: javascript:app.showResultInfo('{{ res.target }}')", "{% endfor %}"]
    return "\n\n" + "\n".join(lines) + "\n"


def render_caption(path: str | Path, config: dict, wildcards: dict[str, str], links: str = "", files: list | None = None) -> str:
    """The reST Snakemake gives docutils for caption ``path``: Jinja2 as in ``snakemake.report``, with
    ``files`` the report's results (the front page lists them; :func:`sample_results`).

    Unlike Snakemake, an undefined variable (a misspelt config key, a ``params`` entry, which no
    caption may read: the report prints params under "JOB PARAMETERS") raises
    ``jinja2.UndefinedError`` instead of rendering as an empty string.
    """
    from jinja2 import Environment, StrictUndefined

    env = Environment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined)
    snakemake = SimpleNamespace(config=config, wildcards=SimpleNamespace(**wildcards), params=SimpleNamespace())
    return env.from_string(Path(path).read_text() + links).render(snakemake=snakemake, categories={}, files=files or [])


def lint_captions(root: str | Path, config: dict) -> list[str]:
    """Problems of every caption of the workflow under ``root`` with configuration ``config``.

    Each caption is rendered for every combination of the values in :data:`WILDCARD_VALUES`
    of the wildcards it uses, the front page with no result and with :func:`sample_results`;
    every table's ``caption`` of the registry is rendered too (it heads the table's page).
    Returns ``"<file> [wildcards]: <message>"`` lines; empty when every rendering is clean. A
    wildcard without known values is itself a problem.
    """
    import itertools

    from jinja2 import TemplateError

    root = Path(root)
    links = _link_targets(root)
    problems = []
    for path, names in caption_files(root).items():
        unknown = sorted(n for n in names if n not in WILDCARD_VALUES)
        if unknown:
            problems.append(f"{path.name}: wildcards {unknown} have no values in kpca_tools.report_check.WILDCARD_VALUES")
            continue
        keys = sorted(names)
        for values in itertools.product(*(WILDCARD_VALUES[k] for k in keys)):
            wildcards = dict(zip(keys, values))
            for files in ([], sample_results(config)) if "files" in path.read_text() else ([],):
                where = f"{path.name} {wildcards}" if wildcards else path.name
                where += f" ({len(files)} results)" if files else ""
                try:
                    rst = render_caption(path, config, wildcards, links, files)
                except TemplateError as e:
                    problems.append(f"{where}: Jinja2: {e}")
                    continue
                problems += [f"{where}: {m}" for m in docutils_messages(rst)]
    problems += [f"tables.py {name}.caption: {m}" for name, table in TABLES.items() for m in docutils_messages(table.caption)]
    return problems


def report_problems(report: str | Path) -> list[str]:
    """Docutils messages in a built Snakemake report (``.html``, or ``.zip`` with its HTML/JS files).

    Returns one line per occurrence: the pattern found and ~120 characters around it.
    """
    report = Path(report)
    if report.suffix == ".zip":
        with zipfile.ZipFile(report) as z:
            texts = {n: z.read(n).decode("utf-8", "replace") for n in z.namelist() if n.endswith((".html", ".js", ".json"))}
    else:
        texts = {report.name: report.read_text(encoding="utf-8", errors="replace")}
    problems = []
    for name, text in texts.items():
        for pattern in _REPORT_PATTERNS:
            for m in re.finditer(re.escape(pattern), text):
                context = text[max(0, m.start() - 60) : m.end() + 60].replace("\n", " ")
                problems.append(f"{name}: {pattern!r} in ...{context}...")
    return problems


def _report_page(report: Path) -> tuple[str, zipfile.ZipFile | None]:
    """The main page of a built report and, for a ``.zip``, the open archive (its ``<stem>/report.html``)."""
    if report.suffix != ".zip":
        return report.read_text(encoding="utf-8"), None
    archive = zipfile.ZipFile(report)
    return archive.read(f"{report.stem}/report.html").decode("utf-8"), archive


def _page_variable(text: str, name: str, where: Path):
    """The JSON value of ``var <name> = <JSON>;`` in a report page, where Snakemake writes its data
    (the JavaScript libraries bundled before it may use the same names for other things)."""
    import json

    for m in re.finditer(rf'^\s*var {name} = (?=[{{\["])', text, re.M):
        try:
            return json.JSONDecoder().raw_decode(text, m.end())[0]
        except json.JSONDecodeError:
            continue
    raise ValueError(f"{where}: no 'var {name} = <JSON>;' (a Snakemake report?)")


def front_page(report: str | Path) -> str:
    """The rendered front page (workflow description) of a built report (``.html`` or ``.zip``), as HTML.

    Snakemake stores it as a JavaScript string ``var workflow_desc = "...";``.
    """
    report = Path(report)
    text, archive = _report_page(report)
    if archive is not None:
        archive.close()
    return _page_variable(text, "workflow_desc", report)


def report_results(report: str | Path) -> dict[str, dict]:
    """The results of a built report (``.html`` or ``.zip``): the path of each file flagged ``report()``
    -> Snakemake's entry for it (``labels``, ``caption`` as HTML, ``mime_type``, ``job_properties``
    with ``rule``, ``wildcards`` and ``params``, the last shown under "JOB PARAMETERS") and
    ``content``, the file's bytes: decoded from its ``data:`` URI in a ``.html``, read from the
    archive's ``data/raw/`` in a ``.zip``.
    """
    import base64

    report = Path(report)
    text, archive = _report_page(report)
    results = _page_variable(text, "results", report)
    for entry in results.values():
        uri = entry["data_uri"]
        entry["content"] = base64.b64decode(uri.split(",", 1)[1]) if archive is None else archive.read(f"{report.stem}/{uri}")
    if archive is not None:
        archive.close()
    return results


def markdown_cells(line: str) -> list[str]:
    """Cells of one Markdown table row, split at the ``|`` not escaped as ``\\|``."""
    cells = re.split(r"(?<!\\)\|", line.strip())
    if cells and cells[0] == "":
        cells = cells[1:]
    if cells and cells[-1] == "":
        cells = cells[:-1]
    return [c.strip() for c in cells]


def markdown_problems(text: str) -> list[str]:
    """Broken Markdown tables in ``text``: a row whose cell count differs from the header's.

    A table is a run of lines starting with ``|``; its second line must be the delimiter row
    (``|:---|---:|``). An unescaped ``|`` inside a cell (``direct |cosine|``) adds cells to
    its row, and in the header row stops a GFM renderer from seeing a table at all.
    """
    problems, block = [], []
    lines = text.splitlines() + [""]
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("|"):
            block.append((number, line))
            continue
        if block:
            (n0, header), rest = block[0], block[1:]
            width = len(markdown_cells(header))
            if not rest or not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", rest[0][1].strip()):
                problems.append(f"line {n0}: table without a delimiter row under its header")
            for n, row in rest:
                if len(markdown_cells(row)) != width:
                    problems.append(f"line {n}: {len(markdown_cells(row))} cells, header (line {n0}) has {width}: {row.strip()[:100]}")
            block = []
    return problems


def load_config(root: str | Path, configfiles: list[str] = ()) -> dict:
    """The configuration as Snakemake builds it: ``config/config.yaml``, then each file (nested keys merged)."""
    import yaml

    def merge(base: dict, new: dict) -> dict:
        for key, value in new.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                merge(base[key], value)
            else:
                base[key] = value
        return base

    config = yaml.safe_load((Path(root) / "config" / "config.yaml").read_text())
    for f in configfiles:
        merge(config, yaml.safe_load(Path(f).read_text()) or {})
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check the report captions for docutils messages, and Markdown tables and built reports given as files.")
    parser.add_argument(
        "files",
        nargs="*",
        help="by suffix: .yaml/.yml configuration files layered on config/config.yaml (as --configfile), .md Markdown tables, .html/.zip built reports",
    )
    parser.add_argument("--root", default=str(_REPO), help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    by_kind: dict[str, list[str]] = {"config": [], "md": [], "report": []}
    for f in args.files:
        suffix = Path(f).suffix.lower()
        kind = {".yaml": "config", ".yml": "config", ".md": "md", ".html": "report", ".zip": "report"}.get(suffix)
        if kind is None:
            parser.error(f"{f}: expected a .yaml/.yml, .md, .html or .zip file")
        by_kind[kind].append(f)
    problems = lint_captions(args.root, load_config(args.root, by_kind["config"]))
    for md in by_kind["md"]:
        problems += [f"{md}: {p}" for p in markdown_problems(Path(md).read_text())]
    for report in by_kind["report"]:
        problems += report_problems(report)
    for p in problems:
        print(p, file=sys.stderr)
    print(f"{len(problems)} problem(s)" if problems else "no problem: captions, Markdown tables and reports are clean", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
