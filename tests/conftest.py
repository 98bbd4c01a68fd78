"""Shared fixtures: repository paths, a tiny timm ViT, real photographs from scikit-image."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def resources_dir_for_real_weights() -> Path:
    """The resources directory of the real-weights tests: $KPCA_RESOURCES or ../shared/assets."""
    return Path(os.environ.get("KPCA_RESOURCES", REPO.parent / "shared" / "assets"))


def real_deit_tiny() -> tuple[Path, Path, Path]:
    """(resources dir, real DeiT-Tiny weights, ImageNet sample dir); skips the test, naming the paths, when absent."""
    res = resources_dir_for_real_weights()
    weights = res / "weights" / "timm" / "deit_tiny_patch16_224.safetensors"
    image_dir = res / "images" / "imagenet-sample"
    if not weights.exists() or not image_dir.is_dir():
        pytest.skip(f"real weights not available: {weights} or {image_dir} missing (set KPCA_RESOURCES to a resources directory)")
    return res, weights, image_dir


# The test files that take longest (a serial run's `--durations=0`, summed per file, longest
# first: `python tests/durations.py`, docs/tests.md), run first: with `-n 2` (the README's command; `--dist loadfile --no-loadscope-reorder` from
# pyproject.toml) the two workers then finish together instead of one waiting on a long file picked up last. Files not
# listed follow in their usual order; the order inside a file is kept.
SLOW_FILES_FIRST = (
    "test_activations_workflow.py",
    "test_decoders_workflow.py",
    "test_workflow.py",
    "test_online.py",
    "test_reliability.py",
    "test_batching_and_sharding.py",
    "test_scaleout.py",
    "test_hub_fixture.py",
    "test_first_hour.py",
    "test_training.py",
    "test_benchmarks.py",
)


def pytest_sessionstart(session):
    """A pytest-xdist worker runs torch on its share of the cores (``-n 2`` on 2 cores: one
    intra-op thread each): two workers of two threads on a 2-core machine make torch's small
    operations wait on each other's threads (docs/tests.md, "The one-minute loop"). A test that
    needs a thread count sets it (kpca_repro.threads.intra_op_threads); child processes keep
    torch's default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    import torch

    share = max(1, len(os.sched_getaffinity(0)) // workers)
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


# A test that starts Snakemake, a script as a program (a workflow script, a perf/ benchmark, a
# shell script) or a server (the `hub` fixture's olah) carries one of these markers, so that the
# contributor's loop, `-m "not integration and not slurm and not realweights"` (docs/tests.md),
# stays at a minute. The rule is enforced while an unmarked test runs (setup, call, teardown):
# it may start only the processes `child_refusal` lets through; any other process, Snakemake's
# API in-process and the `hub` fixture fail it with a message naming the markers.
HEAVY_MARKERS = ("integration", "slurm", "realweights")
#: Modules an unmarked test may run as ``python -m``: a linter, the activation format's command line.
LIGHT_MODULES = ("ruff", "kpca_repro.activations")
#: Programs an unmarked test may start: they read the checkout and run nothing of the project.
# uname: platform.processor(), asked by h5py when it first loads; ldconfig -p: ctypes.util.find_library, asked by
# torch's CUDA library finder (cuda-pathfinder) when torch first loads; fc-list: matplotlib's font list, asked the
# first time matplotlib builds its font cache (a fresh machine, an empty MPLCONFIGDIR: tests/test_markers.py)
LIGHT_PROGRAMS = ("git", "ruff", "snakefmt", "uname", "ldconfig", "fc-list")


class UnmarkedTestError(RuntimeError):
    """An unmarked test started what only a test marked ``integration``, ``slurm`` or ``realweights`` may start."""


def child_refusal(args) -> str | None:
    """Why an unmarked test may not start the process ``args`` (``subprocess.Popen``'s argument:
    a command line, or a sequence of str or path-like), or None when it may: a program of
    LIGHT_PROGRAMS, ``python -m`` a module of LIGHT_MODULES, or ``python -c`` (a fresh interpreter
    for what only a new process shows: which modules an import loads, what a library reads from
    the environment at start-up). Everything else, e.g. ``snakemake``, ``python -m snakemake``,
    ``python script.py``, ``bash script.sh``, a shell, is refused."""
    argv = [os.fsdecode(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    program = Path(argv[0]).name if argv else ""
    if program in LIGHT_PROGRAMS:
        return None
    if program.startswith("python") and argv[1:2] == ["-c"]:
        return None
    if program.startswith("python") and argv[1:2] == ["-m"] and argv[2:3] and argv[2] in LIGHT_MODULES:
        return None
    return f"the process {' '.join(argv)[:300]!r}"


_UNMARKED: list[str] = []  # the node id of the unmarked test running now, if any
_REFUSED: list[str] = []  # what it was refused (re-raised after the phase, should the test catch the error)


def _refuse(what: str) -> None:
    message = (
        f"{_UNMARKED[0]} starts {what}, which only a test marked integration, slurm or realweights may start: "
        "mark the test (@pytest.mark.integration, or pytestmark = pytest.mark.integration for its file), or start "
        "nothing (tests/conftest.py, child_refusal; docs/tests.md)"
    )
    _REFUSED.append(message)
    raise UnmarkedTestError(message)


def _audit(event: str, args: tuple) -> None:
    if not _UNMARKED:
        return
    if event in ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.spawn"):  # the command line is argument 1 (2 for os.spawn)
        if why := child_refusal(args[2 if event == "os.spawn" else 1]):
            _refuse(why)
    elif event == "os.system":
        _refuse(f"the shell command {args[0]!r}")
    elif event == "import" and args[0] == "snakemake.api":
        _refuse("Snakemake through its API (snakemake.api)")


sys.addaudithook(_audit)  # audit hooks stay for the process's life; _audit does nothing outside an unmarked test


def _guard_snakemake_api() -> None:
    """Refuse ``SnakemakeApi.workflow`` too once snakemake.api is loaded (an import then raises no audit event)."""
    api = sys.modules.get("snakemake.api")
    if api is None or getattr(api.SnakemakeApi.workflow, "_unmarked_guard", False):
        return
    workflow = api.SnakemakeApi.workflow

    def guarded(self, *args, **kwargs):
        if _UNMARKED:
            _refuse("Snakemake through its API (snakemake.api.SnakemakeApi)")
        return workflow(self, *args, **kwargs)

    guarded._unmarked_guard = True
    api.SnakemakeApi.workflow = guarded


def _guarded_phase(item, check_fixtures: bool = False):
    if any(item.get_closest_marker(name) for name in HEAVY_MARKERS):
        return (yield)
    _guard_snakemake_api()
    _UNMARKED[:] = [item.nodeid]
    _REFUSED.clear()
    try:
        if check_fixtures and "hub" in item.fixturenames:
            _refuse("the local hub (the hub fixture: olah and a static file server)")
        result = yield
    finally:
        _UNMARKED.clear()
    if _REFUSED:  # refused, but the test caught the error
        raise UnmarkedTestError(_REFUSED[0])
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded_phase(item, check_fixtures=True))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _guarded_phase(item))


def checkout_env(root: Path = REPO) -> dict:
    """The environment of a run of the workflow checked out at ``root``: its own ``src`` first on
    PYTHONPATH, which the workflow requires (workflow/rules/common.smk)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root / "src"), os.environ.get("PYTHONPATH")]))}


def register_rule_targets(repo: Path = REPO) -> None:
    """Run the ``default_target`` calls of the workflow's rule files (in the Snakefile's include
    order) without parsing the workflow, so that ``kpca_repro.workflow.paths.all_targets`` holds
    rule ``all``'s figures besides the registry's tables, as in a Snakemake run."""
    import ast
    import re

    from kpca_repro.workflow import paths

    def parses(source: str) -> bool:
        try:
            ast.parse(source, mode="eval")
        except SyntaxError:
            return False
        return True

    for name in re.findall(r'^include: "workflow/rules/(\w+)\.smk"', (repo / "Snakefile").read_text(), re.M):
        lines = (repo / "workflow" / "rules" / f"{name}.smk").read_text().splitlines()
        for i in (i for i, line in enumerate(lines) if line.startswith("default_target(")):
            end = next(j for j in range(i + 1, len(lines) + 1) if parses("\n".join(lines[i:j])))
            names = {"default_target": paths.default_target, "user_models": paths.user_models, "has_vision": paths.has_vision}
            eval(compile("\n".join(lines[i:end]), f"{name}.smk", "eval"), names)


def run_snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the repository's Snakefile with ``workdir`` as working directory."""
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--cores", "2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, env=checkout_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def workflow_config(*configfiles: Path) -> dict:
    """The configuration of ``snakemake --configfile <configfiles>`` as ``workflow/rules/common.smk``
    receives it: ``config/config.yaml`` updated by each file in turn (``snakemake.utils.update_config``,
    as Snakemake merges them), not yet validated."""
    import yaml
    from snakemake.utils import update_config

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for path in configfiles:
        update_config(config, yaml.safe_load(Path(path).read_text()))
    return config


def parse_stop(config: dict) -> str | None:
    """The message with which the workflow's parse stops on ``config`` (``_checked_config`` of
    ``workflow/rules/common.smk`` in Snakemake's main process: the schema, with the message of
    :func:`~kpca_repro.workflow.config_checks.schema_error_message`, then the training scales and
    :func:`~kpca_repro.workflow.config_checks.check_config`: the one function common.smk calls,
    :func:`~kpca_repro.workflow.config_checks.checked_config`), or None when it passes; ``config``
    then holds the schema's defaults and the resolved scales. tests/test_reliability.py runs one
    case of each kind through Snakemake."""
    from kpca_repro.workflow import config_checks

    try:
        config_checks.checked_config(config, REPO / "workflow" / "schemas" / "config.schema.yaml")
    except config_checks.ConfigError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def photos_dir(tmp_path_factory) -> Path:
    """Five real photographs shipped by scikit-image, as a flat ImageNet-sample-like folder."""
    from PIL import Image
    from skimage import data

    out = tmp_path_factory.mktemp("resources") / "images" / "imagenet-sample"
    out.mkdir(parents=True)
    for i, name in enumerate(["astronaut", "chelsea", "coffee", "rocket", "cat"]):
        arr = getattr(data, name)()
        Image.fromarray(arr).convert("RGB").save(out / f"n{i:08d}_{name}.JPEG", quality=90)
    return out


TINY_KWARGS = {
    "vit_tiny_patch16_224": {"depth": 2, "img_size": 32, "patch_size": 8},
    "deit_tiny_distilled_patch16_224": {"depth": 2, "img_size": 32, "patch_size": 8, "embed_dim": 96},
}


@pytest.fixture(scope="session")
def tiny_resources(photos_dir) -> Path:
    """A resources directory with the photos and randomly initialised tiny timm ViT weights."""
    import timm
    import torch
    from safetensors.torch import save_file

    root = photos_dir.parent.parent
    (root / "weights" / "timm").mkdir(parents=True, exist_ok=True)
    for i, (model_id, kwargs) in enumerate(TINY_KWARGS.items()):
        torch.manual_seed(i)
        model = timm.create_model(model_id, pretrained=False, **kwargs)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(root / "weights" / "timm" / f"{model_id}.safetensors"))
    return root


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    """A local Hugging Face hub (olah) and static file server holding the real offline inputs.

    Yields a :class:`kpca_tools.hub.fixture.HubFixture`: ``endpoint`` (the ``HF_ENDPOINT``),
    ``static_url``, ``repos[repo_id].commit`` / ``.files`` (sha256), ``static_files`` (sha256),
    ``url(path)``, ``env(hf_home)`` (an environment with ``HF_ENDPOINT`` set and ``HF_HOME`` at
    ``hf_home``, never the user's cache), ``config_overlay()``, ``add_stand_ins(ids)``. Built once
    per session, also with pytest-xdist: the workers share one build directory (the first builds
    it under a file lock, the others wait and reuse it) and each serves it on its own ports, with
    its own olah directory. The directory is a temporary one (beside the workers' own), or
    ``$KPCA_HUB_FIXTURE_DIR`` (outside the project tree; reused across sessions while the sources
    are unchanged). Skips when the real inputs (``../shared``) are absent.
    """
    import importlib.util

    from filelock import FileLock

    from kpca_tools.hub import fixture as hub_fixture

    sources = hub_fixture.default_sources(assets=resources_dir_for_real_weights())
    missing = sources.missing()
    if missing:
        pytest.skip(f"hub fixture inputs not available: {', '.join(map(str, missing))} (set KPCA_RESOURCES to a resources directory)")
    if importlib.util.find_spec("olah") is None:
        pytest.fail("olah is not installed: python -m pip install -e '.[test]'")
    if os.environ.get("KPCA_HUB_FIXTURE_DIR"):
        root = Path(os.environ["KPCA_HUB_FIXTURE_DIR"])
    elif os.environ.get("PYTEST_XDIST_WORKER"):  # the session's directory, above each worker's basetemp
        root = tmp_path_factory.getbasetemp().parent / "hub"
    else:
        root = tmp_path_factory.mktemp("hub")
    lock = FileLock(f"{root}.lock")
    with lock:  # one builder; build() reuses a complete build with the same sources
        manifest = hub_fixture.build(root, sources)

    @dataclasses.dataclass(frozen=True)
    class SharedHub(hub_fixture.HubFixture):
        """Stand-ins are built lazily into the shared build: under its lock
        (:func:`kpca_tools.hub.stand_ins.ensure` is not safe against two builders of one model)."""

        def add_stand_ins(self, ids, log=print):
            with lock:
                return super().add_stand_ins(ids, log)

    with hub_fixture.serve(manifest, run_dir=tmp_path_factory.mktemp("hub-run")) as server:
        yield SharedHub(server.manifest, server.endpoint, server.static_url)
