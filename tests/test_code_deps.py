"""Each job reruns when the code its script runs changes, and only then.

Snakemake reruns a job when its script changes but not when an imported module does, so every
rule passes, as ``params.code``, the hash of the package modules its script imports
(``code=code_of("<script>")``, workflow/rules/common.smk; :mod:`kpca_repro.workflow.code`: the
standard library's :mod:`modulefinder`, which scans byte code, lazy imports included, hashed
without docstrings and comments). A changed parameter reruns a job (Snakemake's ``params``
trigger). These tests check that every rule declares its own script's hash, and the rerun
boundaries that follow: a docstring reruns nothing, the method is no input of extraction or
training.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from kpca_repro.workflow.code import code_hash, script_modules, source_digest

REPO = Path(__file__).resolve().parents[1]
LIB = REPO / "src" / "kpca_repro"
SCRIPTS = REPO / "workflow" / "scripts"
PACKAGE = "kpca_repro"


def _rules() -> list[tuple[str, str, str]]:
    """``(rule file, rule name, block text)`` of every rule in workflow/rules."""
    out = []
    for path in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        text = path.read_text()
        heads = list(re.finditer(r"^\s*rule (\w+):", text, flags=re.M))
        for m, nxt in zip(heads, heads[1:] + [None]):
            out.append((path.name, m.group(1), text[m.start() : nxt.start() if nxt else len(text)]))
    return out


def test_every_script_rule_passes_the_hash_of_its_own_script():
    """A rule with ``script:`` has exactly one ``code=code_of(...)`` param, naming that script; the
    download rules run a shell command (kpca_repro.inputs.download) and have none."""
    scripts = {}
    for fname, rule, block in _rules():
        script = re.search(r"script:\s*\n\s*\"\.\./scripts/([\w.]+)\"", block)
        code = re.findall(r'code=code_of\("([\w.]+)"\)', block)
        if script is None:
            assert not code and rule.startswith("download_"), (fname, rule)
            continue
        assert code == [script.group(1)], (fname, rule, code)
        scripts[rule] = script.group(1)
    assert len(scripts) >= 20 and {p.name for p in SCRIPTS.glob("*.py")} == set(scripts.values())


def test_a_script_depends_on_the_modules_it_imports_transitively():
    """kpca_heads imports the method (its equations through kpca.py and the package __init__ files),
    not the extraction; the extraction imports the capture, not the method. A package's modules
    count through its ``__init__.py``: the reader of the activation package, and the modules its
    ``__init__`` re-exports."""
    kpca = {p.relative_to(LIB).as_posix() for p in script_modules(SCRIPTS / "kpca_heads.py")}
    assert {"__init__.py", "method/__init__.py", "method/records.py", "method/kpca.py", "method/equations.py"} <= kpca
    assert {"activations/__init__.py", "activations/reader.py", "activations/format.py", "activations/writer.py"} <= kpca
    assert not {m for m in kpca if m.startswith(("capture/", "analysis/", "training/", "workflow/"))}
    extract = {p.relative_to(LIB).as_posix() for p in script_modules(SCRIPTS / "extract_vision.py")}
    assert {"capture/extraction.py", "capture/vision.py"} <= extract and not {m for m in extract if m.startswith("method/")}


def test_the_method_is_no_input_of_sampling_extraction_or_training():
    """Rerun boundaries: editing the KPCA mathematics, per-head records or sign draws reruns
    neither the sampling, the extraction nor the training; editing extraction does not
    resample; editing the tables reruns no KPCA job."""

    def stages(script):
        return {p.relative_to(LIB).parts[0] for p in script_modules(SCRIPTS / script) if len(p.relative_to(LIB).parts) > 1}

    for script in ("sample_images.py", "sample_text.py", "extract_vision.py", "extract_text.py", "train.py", "figure_training.py"):
        assert "method" not in stages(script), script
    assert "capture" not in stages("sample_images.py") | stages("sample_text.py")
    assert "analysis" not in stages("kpca_heads.py") and "figures" not in stages("table.py") and "method" not in stages("figure3.py")
    # the records' column metadata (rule records_metadata): a description edit reruns it, never the KPCA jobs
    metadata = {p.relative_to(LIB).as_posix() for p in script_modules(SCRIPTS / "records_metadata.py")}
    assert "analysis/columns.py" in metadata and not {m for m in metadata if m.startswith(("method/", "capture/"))}
    assert all(LIB / "analysis" / "columns.py" not in script_modules(SCRIPTS / s) for s in ("kpca_heads.py", "eigenvalues_vision.py", "gamma_vision.py"))
    assert LIB / "projection.py" in script_modules(SCRIPTS / "train.py")


def test_docstrings_comments_and_layout_change_no_digest(tmp_path):
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text('"""Module."""\n\n\ndef f(x):\n    """Doc."""\n    return x + 1  # one\n\n\nclass C:\n    """Doc."""\n')
    b.write_text('"""Another module docstring."""\n# a comment\ndef f(x):\n    """Another doc."""\n\n    return x + 1\nclass C:\n    "changed"\n')
    c.write_text('"""Module."""\n\n\ndef f(x):\n    """Doc."""\n    return x + 2  # one\n\n\nclass C:\n    """Doc."""\n')
    assert source_digest(a) == source_digest(b) != source_digest(c)


@pytest.fixture()
def src_copy(tmp_path):
    """The package and the rule scripts copied, to be edited."""
    shutil.copytree(LIB, tmp_path / "src" / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(SCRIPTS, tmp_path / "scripts")
    return tmp_path


def _hashes(root: Path) -> dict[str, str]:
    return {s.name: code_hash(s, root / "src") for s in sorted((root / "scripts").glob("*.py"))}


def test_a_docstring_reruns_nothing_and_a_statement_reruns_the_kpca_jobs(src_copy):
    """Edited in method/equations.py: a docstring and a comment change no job's code hash; a statement
    changes the hash of every job whose script imports it (the KPCA, eigenvalue and gamma jobs; the
    table and figure jobs rerun after them, their inputs updated) and not the extraction's or the table's."""
    equations = src_copy / "src" / PACKAGE / "method" / "equations.py"
    before = _hashes(src_copy)
    text = equations.read_text()
    doc = re.search(r'^def \w+\(.*?\n    """', text, re.M | re.S)
    assert doc, "method/equations.py has a function with a docstring"
    equations.write_text(text[: doc.end()] + "Edited by the test. " + text[doc.end() :] + "\n# a comment\n")
    shutil.copytree(src_copy / "src", src_copy / "doc" / "src")
    shutil.copytree(src_copy / "scripts", src_copy / "doc" / "scripts")
    assert _hashes(src_copy / "doc") == before
    (src_copy / "doc" / "src" / PACKAGE / "method" / "equations.py").write_text(text + "\n_EDITED_BY_THE_TEST = 1\n")
    after = _hashes(src_copy / "doc")
    changed = {s for s in before if after[s] != before[s]}
    assert changed == {"kpca_heads.py", "eigenvalues_vision.py", "gamma_vision.py"}, changed
    assert after["extract_vision.py"] == before["extract_vision.py"] and after["table.py"] == before["table.py"]


# ---------------------------------------------------------------------------------------------
# The package and the test tools (tools/kpca_tools): imports go one way, and never round a cycle

TOOLS = REPO / "tools"


def _modules(root: Path, package: str) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of ``package`` under ``root`` (a package by its ``__init__``)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: the modules of ``modules`` it imports}``, lazy imports inside functions included
    (the last cycle, fixture <-> stand_ins, was two lazy imports). ``from a import b`` counts as
    ``a.b`` when that is a module, else as ``a``; relative imports are resolved."""
    import ast

    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") if node.level else node.module
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    edges |= {full} if full in modules else ({base} if base in modules else set())
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first search meets (a back edge closes one), each as its modules in order."""
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


MODULES = {**_modules(REPO / "src", PACKAGE), **_modules(TOOLS, "kpca_tools")}


def test_cycle_finder_finds_a_lazy_cycle(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("")
    (tmp_path / "p" / "a.py").write_text("def f():\n    from p import b\n")
    (tmp_path / "p" / "b.py").write_text("from . import c\n")
    (tmp_path / "p" / "c.py").write_text("def g():\n    from p.a import f\n")
    assert _cycles(_import_graph(_modules(tmp_path, "p"))) == [["p.a", "p.b", "p.c", "p.a"]]


def test_no_import_cycle_in_the_package_or_the_tools():
    graph = _import_graph(MODULES)
    assert {"kpca_tools.hub.fixture", "kpca_tools.hub.stand_ins", "kpca_tools.hub.repos", "kpca_tools.reference"} <= set(graph)
    assert "kpca_tools.hub.stand_ins" in graph["kpca_tools.hub.fixture"] and "kpca_tools.hub.repos" in graph["kpca_tools.hub.stand_ins"]
    assert _cycles(graph) == []


def test_the_package_never_imports_the_test_tools():
    """What the pipeline runs (src/) needs nothing of tools/: a plain install has all it imports."""
    graph = _import_graph(MODULES)
    assert not {(m, i) for m, imports in graph.items() if m.startswith(PACKAGE) for i in imports if i.startswith("kpca_tools")}
    assert not [p for p in (REPO / "src").rglob("*.py") if re.search(r"^\s*(from|import) kpca_tools\b", p.read_text(), re.M)]
