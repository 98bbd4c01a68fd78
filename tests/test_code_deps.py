"""Each rule's `code` input is the source of the pipeline stages its script uses.

Snakemake reruns a job when its script changes but not when an imported module does, so every
rule lists, as its `code` input, the package's shared modules (``src/kpca_repro/*.py``) and the
subpackages of the stages it declares (``code=stage_code("method", "analysis")``,
``workflow/rules/common.smk``). These tests check the declarations against what each script
really imports (the standard library's :mod:`modulefinder`, which scans byte code, lazy imports
included), and the rerun boundaries that follow: the method is no input of extraction or
training.
"""

from __future__ import annotations

import re
from modulefinder import ModuleFinder
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIB = REPO / "src" / "kpca_repro"
PACKAGE = "kpca_repro"
#: Subpackages a rule may declare (the stages of the pipeline); workflow/ runs in no job.
STAGES = {"inputs", "capture", "method", "analysis", "figures", "training"}
#: Rules whose jobs fetch raw inputs: a library edit must not download them again.
DOWNLOAD_RULES = {"download_timm_weights", "download_imagenet_sample", "download_wikitext", "download_fashion_mnist", "download_training_logs"}


class _PackageFinder(ModuleFinder):
    """modulefinder restricted to this package (third-party imports are not followed)."""

    def import_hook(self, name, caller=None, fromlist=None, level=-1):
        if level in (-1, 0) and not (name == PACKAGE or name.startswith(PACKAGE + ".")):
            return None
        return super().import_hook(name, caller, fromlist, level)


def _imported_files(script: Path) -> set[Path]:
    """The package's source files ``script`` reaches through imports."""
    finder = _PackageFinder(path=[str(REPO / "src")])
    finder.run_script(str(script))
    return {Path(m.__file__).resolve() for name, m in finder.modules.items() if name.split(".")[0] == PACKAGE and m.__file__}


def _stage_files(stages) -> list[str]:
    """What ``stage_code(*stages)`` lists: the shared modules and the stages' modules."""
    return sorted(str(p) for d in ("", *stages) for p in (LIB / d).glob("*.py"))


def _rules() -> list[tuple[str, str, str]]:
    """``(rule file, rule name, block text)`` of every rule in workflow/rules."""
    out = []
    for path in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        text = path.read_text()
        heads = list(re.finditer(r"^\s*rule (\w+):", text, flags=re.M))
        for m, nxt in zip(heads, heads[1:] + [None]):
            out.append((path.name, m.group(1), text[m.start() : nxt.start() if nxt else len(text)]))
    return out


def _declared() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Rule -> (its script, the stages of its ``code=stage_code(...)``), for every rule that runs a script (downloads excepted)."""
    out = {}
    for fname, rule, block in _rules():
        script = re.search(r"script:\s*\n\s*\"\.\./scripts/([\w.]+)\"", block)
        if script is None or rule in DOWNLOAD_RULES:
            continue
        code = re.findall(r"code=stage_code\(([^)]*)\)", block)
        assert len(code) == 1, f"{fname}: rule {rule} runs {script.group(1)} but lists code={code}"
        out[rule] = (script.group(1), tuple(re.findall(r'"(\w+)"', code[0])))
    return out


DECLARED = _declared()


def test_every_rule_declares_stages_of_the_package():
    assert len(DECLARED) >= 20
    for rule, (_, stages) in DECLARED.items():
        assert stages and set(stages) <= STAGES and len(set(stages)) == len(stages), (rule, stages)
    assert {p.name for p in LIB.iterdir() if p.is_dir() and (p / "__init__.py").is_file()} == STAGES | {"workflow"}


@pytest.mark.parametrize("rule", sorted(DECLARED))
def test_a_script_imports_only_from_the_stages_its_rule_declares(rule):
    script, stages = DECLARED[rule]
    allowed = {Path(p) for p in _stage_files(stages)}
    reached = _imported_files(REPO / "workflow" / "scripts" / script)
    assert reached and reached <= allowed, (rule, sorted(str(p.relative_to(LIB)) for p in reached - allowed))


def test_code_inputs_are_exactly_the_declared_stages(tmp_path):
    """The dry run's `code` input of a rule is what stage_code gives for its stages: the shared
    modules and every module of those stages, nothing else."""
    common = (REPO / "workflow" / "rules" / "common.smk").read_text()
    source = re.search(r"^def stage_code\(.*?(?=^\S)", common, re.M | re.S).group(0)
    namespace = {"REPO": REPO}
    exec(source, namespace)
    for stages in {s for _, s in DECLARED.values()}:
        assert namespace["stage_code"](*stages) == _stage_files(stages)
        assert all(Path(p).parent in {LIB, *(LIB / s for s in stages)} for p in _stage_files(stages))


def test_the_method_is_no_input_of_extraction_or_training():
    """Rerun boundaries: editing the KPCA mathematics, per-head records or sign draws reruns
    neither the sampling, the extraction nor the training; editing extraction does not
    resample; editing the tables reruns no KPCA job."""
    for rule in ("sample_images", "sample_text", "extract_vision", "extract_text", "train", "figure_training"):
        assert "method" not in DECLARED[rule][1], rule
    assert not {f for f in _stage_files(DECLARED["extract_vision"][1]) if Path(f).name in ("kpca.py", "records.py", "uncertainty.py", "tables.py")}
    assert "capture" not in DECLARED["sample_images"][1] and "capture" not in DECLARED["sample_text"][1]
    assert "analysis" not in DECLARED["kpca_heads"][1] and "figures" not in DECLARED["table"][1] and "method" not in DECLARED["figure3"][1]
    assert "projection.py" in {Path(p).name for p in _stage_files(DECLARED["train"][1])}


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
