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
#: Subpackages a rule may declare (the stages of the pipeline); workflow/ and hub/ run in no job.
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
    assert {p.name for p in LIB.iterdir() if p.is_dir() and (p / "__init__.py").is_file()} == STAGES | {"workflow", "hub"}


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
    assert "analysis" not in DECLARED["kpca_heads"][1] and "figures" not in DECLARED["table"][1] and "analysis" not in DECLARED["figure3"][1]
    assert "projection.py" in {Path(p).name for p in _stage_files(DECLARED["train"][1])}
