"""How a job uses the machine: its device (and the workflow's ``gpu`` resource), torch's default
thread count and the configuration's thread settings. The worker pool is :mod:`kpca_repro.workers`."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads where a job uses it: the workflow imports this module while it builds the DAG
    import torch

__all__ = [
    "resolve_device",
    "nvidia_gpu_visible",
    "gpu_resource",
    "torch_default_threads",
    "DEFAULT_THREADS_ENV",
    "ask_default_threads",
    "resolve_threads",
    "intra_op_threads",
]


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; otherwise ``torch.device(device)``."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def nvidia_gpu_visible() -> bool:
    """Whether this machine shows this process an NVIDIA GPU, judged without torch (the workflow
    asks while it builds the DAG): not when ``CUDA_VISIBLE_DEVICES`` is set to ``""`` or ``-1``;
    else when the NVIDIA driver lists a GPU in ``/proc/driver/nvidia/gpus`` or, where that is
    absent (some containers), when ``nvidia-smi -L`` lists one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    with contextlib.suppress(OSError):
        return any(os.scandir("/proc/driver/nvidia/gpus"))
    if shutil.which("nvidia-smi") is None:
        return False
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return "GPU" in subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    return False


def gpu_resource(device: str) -> int:
    """The ``gpu`` resource (0 or 1) a job on ``config["device"]`` declares.

    ``"cpu"``: 0. ``"cuda"``, ``"cuda:N"``: 1. ``"auto"``: 1 where :func:`nvidia_gpu_visible`, else 0
    (a CPU-only machine then runs the extraction and KPCA jobs of several models side by side, up
    to ``--cores``; the default profile allows one ``gpu``). A job on ``"auto"`` itself runs on
    CUDA where ``torch.cuda.is_available()`` (:func:`resolve_device`): a CPU-only torch on a GPU
    machine holds the GPU resource without using it, which only serialises those jobs.
    """
    if device == "cpu":
        return 0
    if device == "auto":
        return int(nvidia_gpu_visible())
    return 1


#: Environment variables that set torch's default intra-op thread count (Snakemake sets them
#: to a job's ``threads``); left out when asking what a plain ``python`` process gets.
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: :func:`torch_default_threads` as the workflow passes it to its jobs (they inherit the variable): a positive
#: integer, or ``wait:<pid>:<path>``, the file that child process ``pid`` fills with it (:func:`ask_default_threads`,
#: started by the workflow's onstart handler), so that its jobs need not each ask a child process of their own.
DEFAULT_THREADS_ENV = "KPCA_TORCH_DEFAULT_THREADS"
#: The child process: torch's count, or ``error ...``, written to ``argv[1]`` in one step (a reader sees the whole
#: line or the empty file) and printed.
_ASK = """import os, sys
try:
    import torch
    out = f"{torch.get_num_threads()}\\n"
except BaseException as exc:
    out = f"error {type(exc).__name__}: {exc}\\n"
if len(sys.argv) > 1 and os.path.exists(sys.argv[1]):  # not after the workflow removed it
    with open(sys.argv[1] + ".part", "w") as fh:
        fh.write(out)
    os.replace(sys.argv[1] + ".part", sys.argv[1])
print(out, end="")
"""
#: Seconds :func:`torch_default_threads` waits for :func:`ask_default_threads`' answer before asking itself.
WAIT_SECONDS = 300.0


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _THREAD_ENV and k != DEFAULT_THREADS_ENV}


def ask_default_threads(path: str | os.PathLike) -> str:
    """Start the child process of :func:`torch_default_threads` without waiting for it; return the value of
    :data:`DEFAULT_THREADS_ENV` that lets a job read its answer.

    The workflow's onstart handler calls it: the child (about 2 s, importing torch) then runs beside the first jobs
    instead of before them, and a job waits for the answer only where it needs the count. ``path`` is created
    empty now; the child replaces it with a file holding the count (or ``error ...``) in one step.
    """
    path = os.fspath(path)
    with open(path, "w"):
        pass
    proc = subprocess.Popen(
        [sys.executable, "-c", _ASK, path],
        env=_child_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return f"wait:{proc.pid}:{path}"


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a finished child its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        if os.name == "nt":  # no /proc, and os.kill would signal the process: wait for the file or the timeout
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True


def _answer_of(value: str, timeout: float) -> int | None:
    """The count a ``wait:<pid>:<path>`` value of :data:`DEFAULT_THREADS_ENV` leads to, or None where there is none
    to read: no such file (a job on another machine), an ``error`` answer, a child gone without one, or
    ``timeout`` seconds passed."""
    try:
        pid, path = value.split(":", 2)[1:]
        pid = int(pid)
    except ValueError:
        return None
    deadline = time.monotonic() + timeout
    while True:
        alive = _running(pid)  # read before the file: a child that answers and exits in between is not missed
        try:
            with open(path) as fh:
                text = fh.read().strip()
        except OSError:
            return None
        if text:
            return int(text) if text.isdigit() and int(text) >= 1 else None
        if not alive or time.monotonic() > deadline:
            return None
        time.sleep(0.02)


@functools.cache
def torch_default_threads() -> int:
    """``torch.get_num_threads()`` of a fresh Python process without thread variables: the
    authors' intra-op thread count (they never set one; MKL's count of physical cores).

    Asked of a child interpreter with ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` removed, since
    this process's own count may be set (a Snakemake job's ``OMP_NUM_THREADS``). A positive
    integer in :data:`DEFAULT_THREADS_ENV` is that answer already asked; ``wait:<pid>:<path>``
    there is a child already asking (:func:`ask_default_threads`, the workflow's onstart handler
    for its jobs): its answer is read from ``path`` once written, and this process asks its own
    child only where there is none (another machine, a failed child, :data:`WAIT_SECONDS`).

    Raises:
        RuntimeError: the child process failed or printed no positive integer.
    """
    known = os.environ.get(DEFAULT_THREADS_ENV, "")
    if known.isdigit() and int(known) >= 1:
        return int(known)
    if known.startswith("wait:") and (answer := _answer_of(known, WAIT_SECONDS)) is not None:
        return answer
    proc = subprocess.run([sys.executable, "-c", _ASK], capture_output=True, text=True, env=_child_env(), timeout=300)
    out = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not out or not out[-1].isdigit() or int(out[-1]) < 1:
        raise RuntimeError(
            f"could not read torch's default thread count from a child process (exit {proc.returncode}): "
            f"{(proc.stdout + proc.stderr)[-2000:]}"
        )
    return int(out[-1])


def resolve_threads(setting: int | str | None, key: str = "kpca.eigh_threads") -> int | None:
    """A thread setting (``kpca.eigh_threads``, ``kpca.intra_op_threads``: ``"auto"`` for
    :func:`torch_default_threads`, a positive int, or None for the caller's) as a count or None.

    Raises:
        ValueError: any other value (naming ``key``).
    """
    if setting is None:
        return None
    if setting == "auto":
        return torch_default_threads()
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return setting
    raise ValueError(f"config key {key}: expected 'auto' or a positive integer, got {setting!r}")


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """Run the block with ``n`` torch intra-op threads on the calling thread (None: unchanged), then restore them.

    ``torch.set_num_threads`` sets the calling thread's OpenMP and MKL counts; other threads keep
    theirs. It also sets torch's process-wide default, which a new thread adopts: the caller's
    count is read first (initialising the thread) and restored on exit.

    Raises:
        ValueError: ``n`` below 1.
    """
    if n is None:
        yield
        return
    if n < 1:
        raise ValueError(f"intra-op threads must be >= 1, got {n}")
    import torch

    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
