"""Work kept through interruptions (kpca_repro.resume): a KPCA job interrupted after some batches
goes on from the batches it kept, with records and draws bit for bit those of an uninterrupted
run; the kept parts of another key are never read; an unwritable output stops a job before
its work, in one line. The eigenvalue and extraction rule scripts, killed with SIGKILL at half
their batches and stopped by SIGINT at three quarters (one line), finish with the bytes of an
uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_batching_and_sharding import _activation_file, one_thread  # noqa: F401 (a fixture)

from kpca_repro.errors import JobInterrupted, OutputNotWritable
from kpca_repro.method import records as records_module
from kpca_repro.method.placement import plan
from kpca_repro.method.records import KpcaJob, kpca_records
from kpca_repro.resume import PartStore
from kpca_repro.smk import check_writable

REPO = Path(__file__).resolve().parents[1]


def _run(path, store=None):
    place = plan("paper", device="cpu", cores=2, eigh_threads=1)
    return kpca_records(path, KpcaJob("paper", place, heads_per_chunk=4, seed=3, sign_draws=(8, 8), store=store))


def _assert_same(a, b):
    (rec_a, meta_a, draws_a), (rec_b, meta_b, draws_b) = a, b
    pd.testing.assert_frame_equal(rec_a, rec_b, check_exact=True)
    assert meta_a == meta_b and set(draws_a) == set(draws_b)
    for name in draws_a:
        np.testing.assert_array_equal(draws_a[name], draws_b[name])


@pytest.mark.usefixtures("one_thread")
def test_an_interrupted_job_resumes_from_its_kept_batches(tmp_path, monkeypatch):
    path = _activation_file(tmp_path / "a.h5", n_images=6, n_heads=3, n_layers=2)
    reference = _run(path)
    real, calls = records_module.chunk_records, []

    def interrupt_after_five(*a, **k):
        calls.append(1)
        if len(calls) > 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    store = PartStore(tmp_path / "parts", {"job": 1})
    monkeypatch.setattr(records_module, "chunk_records", interrupt_after_five)
    with pytest.raises(JobInterrupted, match=r"^interrupted after 12 of 36 heads; rerun the same command to resume$"):
        _run(path, store)
    kept = len(store)
    assert kept == 2  # two batches of two chunks (one image, 3 heads each); the third batch was lost with its interrupt

    calls.clear()
    monkeypatch.setattr(records_module, "chunk_records", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    resumed = _run(path, PartStore(tmp_path / "parts", {"job": 1}))
    assert len(calls) == 12 - 2 * kept  # 36 heads in 12 chunks: only those not kept are computed
    _assert_same(resumed, reference)


@pytest.mark.usefixtures("one_thread")
def test_parts_of_another_key_are_never_read(tmp_path):
    path = _activation_file(tmp_path / "a.h5", n_images=2, n_heads=2, n_layers=1)
    store = PartStore(tmp_path / "parts", {"seed": 3})
    store.save(0, {"n": np.array(1), "p0.position": np.array([0, 0]), "p0.columns": np.array(["x"]), "p0.col0": np.array([1.0])})
    assert len(PartStore(tmp_path / "parts", {"seed": 3})) == 1
    other = PartStore(tmp_path / "parts", {"seed": 4})  # another key: emptied
    assert len(other) == 0 and other.load(0) is None
    _assert_same(_run(path, other), _run(path))


@pytest.mark.usefixtures("one_thread")
def test_a_damaged_part_is_computed_again(tmp_path):
    path = _activation_file(tmp_path / "a.h5", n_images=8, n_heads=2, n_layers=1)
    store = PartStore(tmp_path / "parts", {"job": 1})
    reference = _run(path, store)
    assert len(store) > 1
    first = store.directory / "part_000000.npz"
    first.write_bytes(first.read_bytes()[:100])
    assert store.load(0) is None
    _assert_same(_run(path, PartStore(tmp_path / "parts", {"job": 1})), reference)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("stop", ["second forward pass", "file index"])
def test_an_interrupted_text_extraction_resumes_from_its_kept_batches(tmp_path, monkeypatch, stop):
    """Longformer (its own padding, sequence-first projections, a window): batches of one row; an
    interrupt in the second forward pass, or after every batch is kept (no forward pass left: the
    capture's attributes come from the parts); the rerun writes the uninterrupted run's bytes."""
    import torch
    from test_capture_text import ROWS, _save_with_word_tokenizer

    from kpca_repro.activations import ActivationWriter
    from kpca_repro.capture import extraction, module_capture
    from kpca_repro.inputs import text

    source = _save_with_word_tokenizer("longformer", tmp_path / "longformer")
    samples = text.sample_rows(ROWS, 4, 10, seed=0)

    def extract(out, resume=None):
        kw = dict(batch_size=1, max_length=128, device=torch.device("cpu"), offline=True, progress=False, resume=resume)
        extraction.extract_text("tiny/longformer", str(source), samples, out, **kw)

    extract(tmp_path / "reference.h5")
    real, calls = module_capture._forward, []

    def forward(model, batch):
        calls.append(1)
        if stop == "second forward pass" and len(calls) == 2:
            raise KeyboardInterrupt
        real(model, batch)

    def finish(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(module_capture, "_forward", forward)
    if stop == "file index":
        monkeypatch.setattr(ActivationWriter, "finish", finish)
    resume = (tmp_path / "parts", {"job": 1})
    with pytest.raises(JobInterrupted, match=rf"^interrupted after {1 if stop == 'second forward pass' else 4} of 4 batches; rerun the same command to resume$"):
        extract(tmp_path / "out.h5", resume)
    assert not (tmp_path / "out.h5").exists()
    monkeypatch.undo()
    monkeypatch.setattr(module_capture, "_forward", lambda model, batch: (calls.append(1), real(model, batch)))
    calls.clear()
    extract(tmp_path / "out.h5", resume)
    assert len(calls) == (3 if stop == "second forward pass" else 0)
    assert (tmp_path / "out.h5").read_bytes() == (tmp_path / "reference.h5").read_bytes() and not (tmp_path / "parts").exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX users")
def test_an_unwritable_output_folder_stops_before_the_work(tmp_path):
    """As a user who may not write the folder (root writes anywhere: a forked child checks as nobody)."""
    base = Path(tempfile.mkdtemp(prefix="kpca-writable-"))
    folder = base / "heads"
    try:
        folder.mkdir()
        base.chmod(0o755)
        folder.chmod(0o555)
        with warnings.catch_warnings():  # the child only checks the folder and exits: no thread's lock is needed
            warnings.simplefilter("ignore", RuntimeWarning)
            pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the check refuses the folder with the one-line message
            code = 1
            try:
                if os.geteuid() == 0:
                    os.setgid(65534)
                    os.setuid(65534)
                check_writable([folder / "out.csv"])
            except OutputNotWritable as exc:
                code = 0 if str(exc) == f"{folder / 'out.csv'}: cannot write here (Permission denied); make {folder} writable and rerun" else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # a missing folder (a job's .parts) is checked by making it, then removed: a job that keeps
        # no parts leaves no empty folder beside its output
        check_writable([base / "new" / "deeper" / "key.json"])
        assert not (base / "new").exists()
        (base / "kept").mkdir()
        check_writable([base / "kept" / "out.csv"])
        assert (base / "kept").is_dir()
    finally:
        folder.chmod(0o755)
        shutil.rmtree(base)


def _default_sigint() -> None:
    """preexec_fn of the children these tests interrupt: SIGINT at its default disposition, so that Python
    turns it into KeyboardInterrupt even when the suite was started with SIGINT ignored (a script's
    background `cmd &`), which children would inherit (subprocess's restore_signals leaves SIGINT alone)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


RULE_SCRIPT = """
import sys, time, types
from kpca_repro.smk import setup_logging

log = setup_logging(types.SimpleNamespace(log=[sys.argv[1]], output=[sys.argv[2]]), "some_rule")
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.integration  # a child Python running a rule script
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_rule_script_ends_in_one_line(tmp_path, sig):
    script, log = tmp_path / "rule.py", tmp_path / "rule.log"
    script.write_text(RULE_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(log), str(tmp_path / "out.csv")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        preexec_fn=_default_sigint,
    )
    assert proc.stdout.readline() == "ready\n"
    time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0  # Python ends an uncaught KeyboardInterrupt by SIGINT
    assert err.endswith(" some_rule ERROR interrupted\n") and err.count("\n") == 1, err


# --------------------------------------------------------------------------------------
# the eigenvalue and extraction jobs: their rule scripts, killed with SIGKILL at about half
# --------------------------------------------------------------------------------------

# Runs a workflow script as Snakemake does: a `snakemake` object whose input, output, log,
# wildcards and params are named lists (index and attribute, `.items()`), from JSON.
SCRIPT_DRIVER = """
import json, runpy, sys

class Named(list):
    def __init__(self, named):
        super().__init__(named.values())
        self.__dict__["_named"] = dict(named)

    def __getattr__(self, name):
        try:
            return self._named[name]
        except KeyError:
            raise AttributeError(name) from None

    def items(self):
        return self._named.items()

job = json.loads(sys.argv[2])
smk = type("Snakemake", (), {})()
for name, value in job.items():
    setattr(smk, name, Named(value) if isinstance(value, dict) else value)
runpy.run_path(sys.argv[1], init_globals={"snakemake": smk}, run_name="__main__")
"""


def _script_job(tmp_path: Path, script: str, job: dict) -> subprocess.Popen:
    driver = tmp_path / "driver.py"
    driver.write_text(SCRIPT_DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(driver), str(REPO / "workflow" / "scripts" / script), json.dumps(job)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_default_sigint
    )


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]


def _stop(tmp_path: Path, script: str, job: dict, parts: Path, n_kept: int, sig: signal.Signals) -> tuple[int, str]:
    """Start the job, send it ``sig`` once ``n_kept`` of its batches are kept in ``parts``; its exit status and stderr."""
    proc = _script_job(tmp_path, script, job)
    try:
        while not (parts / f"part_{n_kept - 1:06d}.npz").exists():
            assert proc.poll() is None, f"the job ended before {n_kept} batches:\n{proc.stderr.read()[-4000:]}"
            time.sleep(0.002)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, err


def _stopped_twice(tmp_path: Path, script: str, job, parts: Path, n_batches: int, unit: str) -> float:
    """SIGKILL at half of ``n_batches``, then a rerun stopped by SIGINT at three quarters: one line, no traceback. The seconds until the kill."""
    t0 = time.monotonic()
    code, _ = _stop(tmp_path, script, job("killed"), parts, n_batches // 2, signal.SIGKILL)
    interrupted = time.monotonic() - t0
    assert code == -signal.SIGKILL and len(list(parts.glob("part_*.npz"))) >= n_batches // 2
    code, err = _stop(tmp_path, script, job("stopped"), parts, 3 * n_batches // 4, signal.SIGINT)
    last = err.splitlines()[-1]
    assert code == 1 and "Traceback" not in err, err[-3000:]
    assert re.fullmatch(rf".* ERROR interrupted after [\d,]+ of [\d,]+ {unit}; rerun the same command to resume", last), err[-3000:]
    return interrupted


def _timed(tmp_path: Path, script: str, job: dict) -> float:
    t0 = time.monotonic()
    _finish(_script_job(tmp_path, script, job))
    return time.monotonic() - t0


def _work_span(log: Path) -> float:
    """Seconds from a job's first log record to its last (its work, without Python's start and imports)."""
    stamps = re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", log.read_text(), re.M)
    first, last = (datetime.strptime(x, "%Y-%m-%d %H:%M:%S,%f") for x in (stamps[0], stamps[-1]))
    return (last - first).total_seconds()


def _resumed_after(log: Path, pattern: str) -> int:
    found = re.findall(pattern, log.read_text())
    assert len(found) == 1, log.read_text()[-3000:]
    return int(found[0])


@pytest.mark.integration  # three runs of the eigenvalues_vision script
def test_a_killed_eigenvalue_job_resumes_byte_identical(tmp_path):
    """Tables 2-3's job: 4 layers x 48 images x 4 heads of 197 tokens, in batches of 8 heads (96 batches)."""
    activations = _activation_file(tmp_path / "a.h5", n_images=48, n_heads=4, n_layers=4, n=197, d=16)
    params = {"code": "0", "device": "cpu", "n_components": 8, "heads_per_chunk": 8, "gpu_eigensolver": "auto"}

    def job(name):
        out = tmp_path / name / "spectra.csv"
        return out, {
            "input": {"activations": str(activations)},
            "output": {"out": str(out)},
            "log": {"log": str(tmp_path / f"{name}.log")},
            "wildcards": {"variant": "paper", "keyset": "standardized"},
            "params": params,
            "threads": 1,
        }

    reference, ref_job = job("reference")
    uninterrupted = _timed(tmp_path, "eigenvalues_vision.py", ref_job)
    out = tmp_path / "killed" / "spectra.csv"
    parts = out.with_suffix(".parts")

    def same_output(name):
        return {**job(name)[1], "output": {"out": str(out)}}

    interrupted = _stopped_twice(tmp_path, "eigenvalues_vision.py", same_output, parts, 96, "heads")
    assert not out.exists()
    resumed = _timed(tmp_path, "eigenvalues_vision.py", same_output("resumed"))
    kept = _resumed_after(tmp_path / "resumed.log", r"resuming from (\d+) kept batches")
    assert 72 <= kept < 96
    assert out.read_bytes() == reference.read_bytes() and not parts.exists()
    spans = {name: _work_span(tmp_path / f"{name}.log") for name in ("reference", "resumed")}
    print(
        f"\neigenvalues: uninterrupted {uninterrupted:.1f} s (work {spans['reference']:.1f} s), killed after {interrupted:.1f} s,"
        f" resumed {resumed:.1f} s (work {spans['resumed']:.1f} s), {kept} of 96 batches kept"
    )


@pytest.mark.integration  # three runs of the extract_vision script
def test_a_killed_extraction_job_resumes_byte_identical(tmp_path, photos_dir):
    """A 4-block ViT-Tiny at 224 px over 24 rows (the five photographs in turn), forward batches of 2 (12 batches)."""
    import timm
    import torch
    from safetensors.torch import save_file

    model_id, kwargs = "vit_tiny_patch16_224", {"depth": 4}
    torch.manual_seed(0)
    weights = tmp_path / f"{model_id}.safetensors"
    save_file({k: v.contiguous() for k, v in timm.create_model(model_id, pretrained=False, **kwargs).state_dict().items()}, str(weights))
    photos = sorted(photos_dir.iterdir())
    samples = tmp_path / "samples.tsv"
    pd.DataFrame({"sample_rank": range(24), "dataset_index": [3 * i for i in range(24)], "path": [str(photos[i % len(photos)]) for i in range(24)]}).to_csv(samples, sep="\t", index=False)
    params = {"code": "0", "intra_op_threads": 1, "batch_size": 2, "device": "cpu", "model_kwargs": kwargs, "checksum": None, "seed": 0}

    def job(name, out):
        return {
            "input": {"weights": str(weights), "samples": str(samples)},
            "output": {"out": str(out)},
            "log": {"log": str(tmp_path / f"{name}.log")},
            "wildcards": {"model": model_id, "n": "24", "shard": "0of1"},
            "params": params,
            "threads": 1,
        }

    reference, out = tmp_path / "reference" / "vision_24_0of1.h5", tmp_path / "killed" / "vision_24_0of1.h5"
    uninterrupted = _timed(tmp_path, "extract_vision.py", job("reference", reference))
    parts = out.with_suffix(".parts")
    interrupted = _stopped_twice(tmp_path, "extract_vision.py", lambda name: job(name, out), parts, 12, "batches")
    assert not out.exists()
    resumed = _timed(tmp_path, "extract_vision.py", job("resumed", out))
    kept = _resumed_after(tmp_path / "resumed.log", r"resuming after (\d+) of 12 batches kept")
    assert 9 <= kept < 12
    # written with track_times=False and nothing else of the run's own: the same bytes
    assert out.read_bytes() == reference.read_bytes() and not parts.exists()
    print(f"\nextraction: uninterrupted {uninterrupted:.1f} s, killed after {interrupted:.1f} s, resumed {resumed:.1f} s, {kept} of 12 batches kept")


# --------------------------------------------------------------------------------------
# a killed `snakemake`: its lock (kpca_repro.workflow.locks; through Snakemake in tests/test_reliability.py)
# --------------------------------------------------------------------------------------


def _dead_pid() -> int:
    """The id of a process that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.integration  # starts a child Python for a process id that has ended
def test_a_lock_is_removed_only_when_its_holder_ended(tmp_path):
    from kpca_repro.workflow import locks

    lock_dir = tmp_path / "locks"
    assert locks.record_owner(lock_dir) is None and locks.remove_stale_lock(lock_dir) == []  # no lock
    lock_dir.mkdir()
    (lock_dir / "0.input.lock").write_text("a\n")
    (lock_dir / "0.output.lock").write_text("b\n")
    assert locks.remove_stale_lock(lock_dir) == []  # a lock nobody recorded: Snakemake decides
    live = locks.record_owner(lock_dir)  # this process, running
    assert locks.remove_stale_lock(lock_dir) == [] and lock_dir.is_dir()
    live.unlink()
    dead = _dead_pid()
    record = locks.record_owner(lock_dir, pid=dead)
    os.utime(lock_dir / "0.output.lock", (record.stat().st_mtime + 5,) * 2)  # locked after the record: a run not recorded yet
    assert locks.remove_stale_lock(lock_dir) == [] and lock_dir.is_dir()
    os.utime(lock_dir / "0.output.lock", (record.stat().st_mtime - 5,) * 2)
    other_host = lock_dir / record.name.replace(".owner.", ".owner.elsewhere-")
    other_host.write_text("")
    assert locks.remove_stale_lock(lock_dir) == []  # recorded on another host: its process cannot be asked
    other_host.unlink()
    assert locks.remove_stale_lock(lock_dir) == [dead] and not lock_dir.exists()
