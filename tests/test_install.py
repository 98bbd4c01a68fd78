"""What the README installs, what CI installs, and the files that say what was tested.

The README's first command installs what a user needs; contributors add the test extras at
the versions of ``constraints.txt``, exactly as ``.ci/run`` does. The constraints file pins
every dependency of ``pyproject.toml`` within its range; the conda environment file installs
the same dependencies and no local path (docs/execution.md).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TEST_INSTALL = 'python -m pip install -e ".[test]" -c constraints.txt'
TEST_COMMAND = "python -m pytest -q -n 2"


def _readme_quickstart() -> list[str]:
    """The command lines of the README's first fenced bash block, without their comments."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert block, "README.md has no bash block"
    return [line.split(" #")[0].strip() for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _requirements(extra: str | None = None) -> list[Requirement]:
    project = PYPROJECT["project"]
    return [Requirement(r) for r in (project["optional-dependencies"][extra] if extra else project["dependencies"])]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and name.strip() == name and version.strip(), f"constraints.txt: not 'name==version': {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def test_readme_installs_the_package_first_and_the_test_extras_with_the_constraints():
    lines = _readme_quickstart()
    assert lines[0] == "python -m pip install -e ."
    assert TEST_INSTALL in lines and lines.index(TEST_INSTALL) < lines.index(TEST_COMMAND)


def test_ci_runs_the_readme_test_install_line_and_test_command():
    commands = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert TEST_INSTALL in commands and commands[-1] == TEST_COMMAND
    assert commands.index(TEST_INSTALL) < commands.index(TEST_COMMAND)
    assert sum("pip install" in c for c in commands) == 1  # nothing installed beside the README's line
    # the other set-up steps: the SLURM test cluster (tests/test_slurm.py uses it, installs nothing), Chromium for the
    # report's browser test (tests/test_workflow.py), and empty font caches, as on a new machine (tests/test_markers.py)
    others = [c for c in commands if c not in (TEST_INSTALL, TEST_COMMAND) and not c.startswith(("set ", "cd "))]
    assert "apt-get update && apt-get install -y chromium" in others
    fresh = ["MPLCONFIGDIR=$(mktemp -d) XDG_CACHE_HOME=$(mktemp -d)", "export MPLCONFIGDIR XDG_CACHE_HOME"]
    assert commands[-3:-1] == fresh, commands[-3:]
    rest = [c for c in others if c not in fresh and "chromium" not in c]
    assert all("tests/slurm/cluster.sh" in c or c.startswith("SLURM_DIR=") for c in rest), rest


def test_constraints_pin_every_dependency_within_its_range():
    pins = _pins()
    assert "kpca-repro" not in pins  # the project itself is installed from the checkout
    requirements = _requirements() + _requirements("test") + _requirements("slurm")
    assert {"pooch", "olah"} <= {canonicalize_name(r.name) for r in requirements}
    for req in requirements:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {req}"


def test_conda_environment_installs_the_dependencies_and_no_local_path():
    """Snakemake runs conda on a copy in .snakemake/conda/, so a relative pip path would name the wrong directory."""
    env = yaml.safe_load((REPO / "envs" / "pipeline.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert not [p for p in pip if p.startswith("-") or "/" in p or p.startswith(".")], pip
    wanted = {str(r) for r in _requirements() if canonicalize_name(r.name) not in ("snakemake", "pygments")}  # the host's Snakemake runs the jobs
    assert {str(Requirement(p)) for p in pip} == wanted


def test_license_and_citation_metadata():
    assert PYPROJECT["project"]["license"] == "MIT" and PYPROJECT["project"]["license-files"] == ["LICENSE"]
    license_text = (REPO / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "Copyright (c) 2026 kpca-repro contributors" in license_text
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text(encoding="utf-8"))
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "MIT" and cff["version"] == PYPROJECT["project"]["version"]
    ids = {i["value"] for ref in cff["references"] for i in ref["identifiers"]}
    assert {"arXiv:2505.07908", "arXiv:2406.13762"} <= ids


def test_the_package_imports_nothing_only_the_test_extra_installs():
    """A plain install (`pip install -e .`) ships no module that cannot run: no module of
    src/kpca_repro imports, even lazily, a distribution that only the test extra brings (olah,
    pytest, ...); the test tools that do live in tools/ (tools/README.md)."""
    import ast
    import sys
    from importlib.metadata import packages_distributions

    plain = {canonicalize_name(r.name) for extra in (None, "gpu", "slurm") for r in _requirements(extra)}
    test_only = {canonicalize_name(r.name) for r in _requirements("test")} - plain
    assert "olah" in test_only and "pytest" in test_only
    dists = {name: {canonicalize_name(d) for d in ds} for name, ds in packages_distributions().items()}
    offenders = []
    for path in sorted((REPO / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            for top in {n.split(".")[0] for n in names if n}:
                if top in sys.stdlib_module_names:
                    continue
                if dists.get(top, {canonicalize_name(top)}) & test_only:
                    offenders.append(f"{path.relative_to(REPO)}: {top}")
    assert not offenders, offenders
