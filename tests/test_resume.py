"""Work kept through interruptions (kpca_repro.resume): a KPCA job interrupted after some batches
goes on from the batches it kept, with records and draws bit for bit those of an uninterrupted
run; the kept parts of another key are never read; an unwritable output stops a job before
its work, in one line."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_batching_and_sharding import _activation_file, one_thread  # noqa: F401 (a fixture)

from kpca_repro.errors import JobInterrupted, OutputNotWritable
from kpca_repro.method import records as records_module
from kpca_repro.method.placement import plan
from kpca_repro.method.records import kpca_records
from kpca_repro.resume import PartStore
from kpca_repro.smk import check_writable

REPO = Path(__file__).resolve().parents[1]


def _run(path, store=None, **kw):
    place = plan("paper", device="cpu", cores=2, eigh_threads=1)
    return kpca_records(path, "paper", placement=place, heads_per_chunk=4, seed=3, sign_draws=(8, 8), progress=False, store=store, **kw)


def _assert_same(a, b):
    (rec_a, meta_a), (rec_b, meta_b) = a, b
    pd.testing.assert_frame_equal(rec_a, rec_b, check_exact=True)
    draws_a, draws_b = meta_a.pop("sign_draws"), meta_b.pop("sign_draws")
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
        check_writable([base / "new" / "out.csv"])  # a missing folder is made, as Snakemake would
        assert (base / "new").is_dir() and not list((base / "new").iterdir())
    finally:
        folder.chmod(0o755)
        shutil.rmtree(base)


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
        [sys.executable, str(script), str(log), str(tmp_path / "out.csv")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")}
    )
    assert proc.stdout.readline() == "ready\n"
    time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0  # Python ends an uncaught KeyboardInterrupt by SIGINT
    assert err.endswith(" some_rule ERROR interrupted\n") and err.count("\n") == 1, err
