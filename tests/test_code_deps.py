"""Each rule lists, as its `code` input, every library module its script imports.

Snakemake reruns a job when its script changes but not when an imported module does, so the
rules list the modules (``code=code_inputs("<script>")``, derived by
:mod:`kpca_repro.code_deps` from the source text). These tests check the derivation against
an independent one (the standard library's :mod:`modulefinder`, which scans byte code) and
check that every rule uses it for its own script.
"""

from __future__ import annotations

import re
from modulefinder import ModuleFinder
from pathlib import Path

import pytest

from kpca_repro.code_deps import PACKAGE, imported_modules, library_modules

REPO = Path(__file__).resolve().parents[1]
LIB = REPO / "src" / "kpca_repro"
SCRIPTS = sorted((REPO / "workflow" / "scripts").glob("*.py"))
#: Rules whose jobs fetch raw inputs: a library edit must not download them again.
DOWNLOAD_RULES = {"download_timm_weights", "download_imagenet_sample", "download_wikitext", "download_fashion_mnist", "download_training_logs"}


class _PackageFinder(ModuleFinder):
    """modulefinder restricted to this package (third-party imports are not followed)."""

    def import_hook(self, name, caller=None, fromlist=None, level=-1):
        if level in (-1, 0) and not (name == PACKAGE or name.startswith(PACKAGE + ".")):
            return None
        return super().import_hook(name, caller, fromlist, level)


def _modulefinder_paths(script: Path) -> list[str]:
    finder = _PackageFinder(path=[str(REPO / "src")])
    finder.run_script(str(script))
    return sorted(str(Path(m.__file__).resolve()) for name, m in finder.modules.items() if name.split(".")[0] == PACKAGE and m.__file__)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_code_inputs_are_the_modules_the_script_reaches(script):
    assert library_modules(script, LIB) == _modulefinder_paths(script)


def test_relative_lazy_and_package_imports_are_followed(tmp_path):
    src = "import os\nfrom kpca_repro import kpca, __version__\ndef f():\n    from kpca_repro.h5io import atomic_output\n"
    assert imported_modules(src, None, LIB) == {"kpca_repro", "kpca_repro.kpca", "kpca_repro.h5io"}
    assert imported_modules("from .smk import x\nfrom . import images\n", "kpca_repro.records", LIB) == {"kpca_repro.smk", "kpca_repro.images", "kpca_repro"}
    script = tmp_path / "s.py"
    script.write_text("from kpca_repro.norms import norm_statistics\n")
    got = {Path(p).name for p in library_modules(script, LIB)}
    assert {"__init__.py", "norms.py", "h5io.py"} <= got and "text.py" not in got


def _rules() -> list[tuple[str, str, str]]:
    """``(rule file, rule name, block text)`` of every rule in workflow/rules."""
    out = []
    for path in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        text = path.read_text()
        heads = list(re.finditer(r"^\s*rule (\w+):", text, flags=re.M))
        for m, nxt in zip(heads, heads[1:] + [None]):
            out.append((path.name, m.group(1), text[m.start() : nxt.start() if nxt else len(text)]))
    return out


def test_every_rule_lists_the_modules_of_its_own_script():
    checked = 0
    for fname, rule, block in _rules():
        script = re.search(r"script:\s*\n\s*\"\.\./scripts/([\w.]+)\"", block)
        if script is None or rule in DOWNLOAD_RULES:
            continue
        code = re.findall(r"code=code_inputs\(\"([\w.]+)\"\)", block)
        assert code == [script.group(1)], f"{fname}: rule {rule} runs {script.group(1)} but lists code={code}"
        checked += 1
    assert checked >= 20


def _modules(script: str) -> set[str]:
    return {Path(p).name for p in library_modules(REPO / "workflow" / "scripts" / script, LIB)}


def test_per_head_metrics_are_outside_the_extraction_and_training_inputs():
    """Rerun boundaries: the KPCA mathematics, per-head records and sign draws are no code
    input of extraction or training, and the worker pool is no input of training."""
    stage2 = {"kpca.py", "records.py", "uncertainty.py", "tables.py"}
    for script in ("extract_vision.py", "extract_text.py", "sample_images.py", "sample_text.py", "train.py"):
        assert not (_modules(script) & stage2), (script, sorted(_modules(script) & stage2))
    assert {"kpca.py", "records.py"} <= _modules("kpca_heads.py")
    assert "projection.py" in _modules("train.py") and "threads.py" not in _modules("train.py")
