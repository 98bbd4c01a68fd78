"""The marker rule of the contributor's loop (docs/tests.md): a test that starts Snakemake, a script
or a server is marked ``integration``, ``slurm`` or ``realweights``, so that
``python -m pytest -m "not integration and not slurm and not realweights" -n 2`` stays at a minute.

tests/conftest.py enforces it while each unmarked test runs; the tests here are unmarked
themselves, so they check that the guard is on where the rule applies.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import conftest
from conftest import HEAVY_MARKERS, UnmarkedTestError, child_refusal

PYTHON = sys.executable


def _refused(call) -> str:
    """The message of the refusal ``call()`` meets; the refusal is then forgotten, so that the
    guard does not fail this test for a refusal it expected."""
    with pytest.raises(UnmarkedTestError) as err:
        call()
    assert conftest._REFUSED.pop() == str(err.value)
    return str(err.value)


@pytest.mark.parametrize(
    "argv",
    [
        [PYTHON, "-m", "snakemake", "-n", "results/table1.csv"],
        ["/usr/bin/snakemake", "--cores", "2"],
        [PYTHON, "workflow/scripts/kpca_vision.py"],
        [PYTHON, "perf/bench_stage.py", "--help"],
        ["bash", "perf/slurm_submissions.sh", "2", "out"],
        ["/bin/sh", "-c", "snakemake -n"],
        [PYTHON, "-m", "olah.server"],
        [PYTHON, "-m", "pytest", "tests/test_kpca.py"],
    ],
)
def test_heavy_processes_are_refused(argv):
    assert child_refusal(argv) is not None


@pytest.mark.parametrize(
    "argv",
    [["fc-list", "--format=%{file}\\n"], ["git", "ls-files"], [PYTHON, "-c", "import sys"], [PYTHON, "-m", "ruff", "check", "."], [PYTHON, "-m", "kpca_repro.activations", "validate", "x.h5"]],
)
def test_light_processes_are_let_through(argv):
    assert child_refusal(argv) is None


def test_an_unmarked_test_cannot_start_snakemake(tmp_path, request):
    message = _refused(lambda: subprocess.run([PYTHON, "-m", "snakemake", "--version"], capture_output=True, cwd=tmp_path))
    assert message.startswith(f"{request.node.nodeid} starts the process ") and "-m snakemake --version" in message
    assert "integration, slurm or realweights" in message
    _refused(lambda: os.system("true"))
    _refused(lambda: os.posix_spawn(PYTHON, [PYTHON, "-m", "snakemake", "--version"], os.environ))
    # a light child still runs
    assert subprocess.run([PYTHON, "-c", "print(6 * 7)"], capture_output=True, text=True, check=True).stdout == "42\n"


def test_an_unmarked_test_cannot_run_snakemake_in_process():
    api = sys.modules.get("snakemake.api")
    if api is None:
        message = _refused(lambda: __import__("snakemake.api"))
        assert "snakemake.api" not in sys.modules
    else:  # loaded before this test (by a marked one in this process): its entry point refuses
        message = _refused(lambda: api.SnakemakeApi.workflow(None))
    assert "Snakemake through its API" in message


def _heavy(item) -> bool:
    return any(item.get_closest_marker(name) for name in HEAVY_MARKERS)


def test_no_unmarked_test_asks_for_the_hub_or_runs_snakemake(request):
    """Over the tests of this session (all, or the selection of ``-m``), also those that will
    skip where their inputs are missing and so never reach the guard: no unmarked test asks for
    the ``hub`` fixture, and none calls ``run_snakemake`` or ``python -m snakemake`` itself."""
    unmarked = [item for item in request.session.items if isinstance(item, pytest.Function) and not _heavy(item)]
    assert request.node in unmarked
    assert [item.nodeid for item in unmarked if "hub" in item.fixturenames] == []
    calls = ("run_snakemake(", '"-m", "snakemake"')
    sources = {item.function: inspect.getsource(item.function) for item in unmarked if item.path != Path(__file__)}  # this file names them to refuse them
    assert [f"{fn.__module__}.{fn.__name__}" for fn, source in sources.items() if any(call in source for call in calls)] == []


#: A fresh interpreter arms the guard as for an unmarked test, then draws and saves a figure with
#: text: on empty caches matplotlib builds its font cache, starting ``fc-list``. It prints what
#: the guard refused and every process started.
_FIRST_FIGURE = """
import io, json, os, sys
started = []
sys.addaudithook(lambda event, args: started.append(os.fsdecode(args[0])) if event == "subprocess.Popen" else None)
sys.path.insert(0, sys.argv[1])
import conftest
conftest._UNMARKED[:] = ["a figure on empty caches"]
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.set_title("Figure 2")
fig.savefig(io.BytesIO(), format="pdf")
print(json.dumps({"refused": conftest._REFUSED, "started": started}))
"""


def test_a_first_figure_on_empty_caches_passes_the_guard(tmp_path):
    """The contributor's loop on a machine with no caches (a fresh CI machine): the first figure
    of an unmarked test builds matplotlib's font cache, which runs ``fc-list`` (and fontconfig
    writes its own cache under ``XDG_CACHE_HOME``); the guard lets it through. Run in a child
    interpreter with an empty ``MPLCONFIGDIR`` and ``XDG_CACHE_HOME``, since this process's
    matplotlib has its cache already."""
    import json

    mpl, xdg = tmp_path / "mplconfig", tmp_path / "cache"
    mpl.mkdir()
    xdg.mkdir()
    env = {**os.environ, "MPLCONFIGDIR": str(mpl), "XDG_CACHE_HOME": str(xdg)}
    proc = subprocess.run([PYTHON, "-c", _FIRST_FIGURE, str(Path(__file__).parent)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["refused"] == []
    assert "fc-list" in out["started"]  # the font cache was built here, not found
    assert list(mpl.glob("fontlist-*.json"))
