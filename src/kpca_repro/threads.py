"""How a job uses the machine: its device, torch's default thread count, the configuration's
thread settings, and the worker pool of the KPCA and eigenvalue stages (shared by every stage)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads where a job uses it: the workflow imports this module while it builds the DAG
    import torch

__all__ = [
    "resolve_device",
    "nvidia_gpu_visible",
    "gpu_resource",
    "CPU_FORWARD_BATCH",
    "forward_batch_size",
    "torch_default_threads",
    "DEFAULT_THREADS_ENV",
    "resolve_threads",
    "resolve_eigh_threads",
    "pin_intra_op_threads",
    "intra_op_threads",
    "CoreBudget",
    "checkpoint",
    "ordered_map",
    "device_stream",
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


#: Images (rows) per forward pass of an extraction job on the CPU under ``batch_size: auto``.
CPU_FORWARD_BATCH = 25


def forward_batch_size(setting: int | str, device, n_inputs: int) -> int:
    """Inputs per forward pass of an extraction job (``vision.batch_size``, ``text.batch_size``).

    ``"auto"``: :data:`CPU_FORWARD_BATCH` on the CPU (bounded memory; on the CPU these passes
    give the authors' one-pass q, k, v bit for bit, docs/fidelity.md "Batching"); on a GPU every
    input of the shard in one pass, as the authors' scripts run them, because a cuBLAS GEMM of
    another batch shape may round differently. An int: that many (at most ``n_inputs``).

    Raises:
        ValueError: any other setting.
    """
    import torch

    if setting == "auto":
        return max(1, n_inputs) if torch.device(device).type != "cpu" else min(CPU_FORWARD_BATCH, max(1, n_inputs))
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return min(setting, max(1, n_inputs))
    raise ValueError(f"a forward batch size is 'auto' or a positive integer, got {setting!r}")


#: Environment variables that set torch's default intra-op thread count (Snakemake sets them
#: to a job's ``threads``); left out when asking what a plain ``python`` process gets.
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: :func:`torch_default_threads` as the workflow learnt it before its first job (its onstart handler
#: sets it; the jobs inherit it), so that its jobs need not each ask a child process.
DEFAULT_THREADS_ENV = "KPCA_TORCH_DEFAULT_THREADS"


@functools.cache
def torch_default_threads() -> int:
    """``torch.get_num_threads()`` of a fresh Python process without thread variables.

    That is the intra-op thread count the authors' scripts ran with (they never set one):
    torch's default, MKL's count of physical cores, unless ``OMP_NUM_THREADS`` or
    ``MKL_NUM_THREADS`` is set. Asked of a child process (a fresh interpreter that imports
    torch, about a second, once per process) with both variables removed from its environment,
    because this process's own count may already be set (a Snakemake job's ``OMP_NUM_THREADS``,
    ``torch.set_num_threads``). A positive integer in :data:`DEFAULT_THREADS_ENV` is that answer,
    already asked (the workflow's jobs inherit it from Snakemake's process).

    Returns:
        A positive int.

    Raises:
        RuntimeError: the child process failed or printed no positive integer.
    """
    if (known := os.environ.get(DEFAULT_THREADS_ENV, "")).isdigit() and int(known) >= 1:
        return int(known)
    env = {k: v for k, v in os.environ.items() if k not in _THREAD_ENV and k != DEFAULT_THREADS_ENV}
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not out or not out[-1].isdigit() or int(out[-1]) < 1:
        raise RuntimeError(f"could not read torch's default thread count from a child process (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return int(out[-1])


def resolve_threads(setting: int | str | None, key: str = "kpca.eigh_threads") -> int | None:
    """A thread setting of the configuration (``kpca.eigh_threads``, ``kpca.intra_op_threads``) as a count.

    Args:
        setting: ``"auto"`` (:func:`torch_default_threads`, the authors' thread semantics),
            a positive int, or None (keep the caller's intra-op threads).
        key: the configuration key, named in the error.

    Returns:
        A positive int, or None.

    Raises:
        ValueError: any other value.
    """
    if setting is None:
        return None
    if setting == "auto":
        return torch_default_threads()
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return setting
    raise ValueError(f"config key {key}: expected 'auto' or a positive integer, got {setting!r}")


def resolve_eigh_threads(setting: int | str | None) -> int | None:
    """The ``kpca.eigh_threads`` setting as a thread count (:func:`resolve_threads`)."""
    return resolve_threads(setting, "kpca.eigh_threads")


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """Run the block with ``n`` torch intra-op threads on the calling thread, then restore them.

    ``torch.set_num_threads`` sets the calling thread's OpenMP and MKL thread counts (MKL's
    ``mkl_set_num_threads_local``); other threads keep theirs, so worker threads may each
    hold a different count at the same time. It also sets torch's process-wide default,
    which a thread that has not yet run a parallel torch kernel adopts: the caller's count is
    read (which initialises the calling thread) and restored on exit. Inside a job, use it
    through :meth:`kpca_repro.method.placement.Placement.solver_threads`, which first widens
    the job's :class:`CoreBudget` to ``n`` cores.

    Args:
        n: threads for the block (a positive int), or None to change nothing.

    Raises:
        ValueError: ``n`` is not None and below 1.
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


_THREAD_STREAMS = threading.local()


def device_stream(device: torch.device, enabled: bool = True):
    """A context that runs the calling thread's CUDA work on its own stream (else a no-op).

    Worker threads of :func:`ordered_map` then overlap their kernels and their host syncs
    instead of queueing on the default stream.
    """
    import torch

    if not enabled or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    stream = getattr(_THREAD_STREAMS, "stream", None)
    if stream is None:
        stream = _THREAD_STREAMS.stream = torch.cuda.Stream(device=device)
    return torch.cuda.stream(stream)


def pin_intra_op_threads(n: int) -> None:
    """Give the calling thread ``n`` torch intra-op threads, whatever it inherited.

    A new thread takes torch's process-wide default when it first runs a parallel kernel
    (set by the last ``torch.set_num_threads`` of any thread, for example a worker's
    :func:`intra_op_threads` around ``eigh``), and its OpenMP/MKL counts from
    ``OMP_NUM_THREADS`` before that. Reading the count first makes torch initialise the
    thread, so the explicit setting that follows is the one that holds.
    """
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


class CoreBudget:
    """The cores a job was given, shared by its worker threads and their parallel regions.

    Every worker thread of :func:`ordered_map` holds one core while it works on an item. A
    region that runs ``n`` threads (the paper variant's ``eigh`` on the authors' thread count,
    docs/fidelity.md) first :meth:`widens <widen>` its hold to ``n`` cores and waits until they
    are free, so the threads at work never outnumber the cores: on 2 cores, while one worker
    solves on 2 threads the other waits, instead of 3 threads sharing 2 cores
    (docs/performance.md, "Thread budgets"). The others give their cores up at their next
    :func:`checkpoint` (between heads, between assignments), so a widening worker waits for
    milliseconds, not for a whole item; it is served before any other worker goes on, so it
    cannot starve. ``n`` above the budget is served with the whole budget held (the region's
    own thread count is not changed here: :func:`intra_op_threads` sets it).

    Args:
        cores: the job's cores (Snakemake's ``threads``), at least 1.

    Raises:
        ValueError: ``cores`` below 1.
    """

    def __init__(self, cores: int):
        if int(cores) < 1:
            raise ValueError(f"a core budget needs at least 1 core, got {cores}")
        self.cores = int(cores)
        self._free = self.cores
        self._widening = 0
        self._cond = threading.Condition()
        self._held = threading.local()
        #: the most cores held at once (for tests and logs)
        self.peak = 0

    def _take(self, n: int, widening: bool) -> None:
        with self._cond:
            if widening:
                self._widening += 1
            try:
                while self._free < n or (not widening and self._widening):
                    self._cond.wait()
            finally:
                if widening:
                    self._widening -= 1
                    self._cond.notify_all()  # threads that paused for a widening may go on
            self._free -= n
            self.peak = max(self.peak, self.cores - self._free)

    def _give(self, n: int) -> None:
        with self._cond:
            self._free += n
            self._cond.notify_all()

    @contextlib.contextmanager
    def hold(self):
        """One core for the calling thread's item (what :func:`ordered_map` takes per worker)."""
        self._take(1, False)
        self._held.n = 1
        previous, _CURRENT.budget = getattr(_CURRENT, "budget", None), self
        try:
            yield
        finally:
            _CURRENT.budget = previous
            self._held.n = 0
            self._give(1)

    def checkpoint(self) -> None:
        """Give the calling thread's cores to a worker waiting to widen, and take them back after it."""
        held = getattr(self._held, "n", 0)
        if not held or not self._widening:
            return
        with self._cond:
            self._free += held
            self._cond.notify_all()
            while self._free < held or self._widening:
                self._cond.wait()
            self._free -= held

    @contextlib.contextmanager
    def widen(self, n: int | None):
        """Hold ``min(n, cores)`` cores for the block (None or 1: no change), then return to the hold before it."""
        held = getattr(self._held, "n", 0)
        want = min(int(n), self.cores) if n is not None else held
        if want <= max(held, 1):
            yield
            return
        if held:
            self._give(held)
        self._take(want, True)
        self._held.n = want
        try:
            yield
        finally:
            self._held.n = held
            self._give(want - held)  # keep the thread's own cores


_CURRENT = threading.local()


def checkpoint() -> None:
    """A point where the calling worker may pause for another worker's widened region
    (:meth:`CoreBudget.checkpoint` of the budget its :func:`ordered_map` item holds); a no-op
    outside such an item. The KPCA engine calls it between heads and between assignments."""
    budget = getattr(_CURRENT, "budget", None)
    if budget is not None:
        budget.checkpoint()


def ordered_map(fn: Callable, items: Iterable, *, workers: int = 1, max_pending: int | None = None, budget: CoreBudget | None = None) -> Iterator:
    """``fn(item)`` for each item, in order, computed on ``workers`` threads.

    The KPCA stage's work releases the GIL (torch kernels, LAPACK ``eigh``, scipy's
    ``linear_sum_assignment``), so threads run chunks truly in parallel: on the CPU one
    chunk's assignments overlap the next chunk's ``eigh``; on a GPU the assignments of
    several chunks run on CPU threads while the GPU computes. ``items`` is consumed lazily and
    at most ``max_pending`` (default ``2 * workers``) results are in flight, so memory stays
    bounded by a few chunks whatever the number of items.

    Every worker thread runs each item with the calling thread's torch intra-op thread count
    (:func:`pin_intra_op_threads`), so an item's result does not depend on which thread
    computes it or on what ran there before. With ``budget`` each item runs holding one of
    its cores (:class:`CoreBudget`), so that parallel regions inside ``fn`` can widen to
    more without the threads outnumbering the cores, and numpy's and scipy's BLAS run on one
    thread for the whole map (``threadpoolctl``; torch's threads are set apart): OpenBLAS
    otherwise reads ``OMP_NUM_THREADS``, which Snakemake sets to the job's cores, and every
    worker's product would start a team of that many spinning threads.

    Args:
        fn: called as ``fn(item)`` on a worker thread.
        items: any iterable (a generator reading the activation file, for example).
        workers: threads; ``1`` runs everything on the calling thread.
        max_pending: in-flight bound.
        budget: the job's cores, or None (no accounting).

    Yields:
        ``fn(item)`` in the order of ``items``. An exception in ``fn`` is raised here.
    """
    held = budget.hold if budget is not None else contextlib.nullcontext
    if budget is None:
        yield from _ordered_map(fn, items, workers, max_pending, held)
        return
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield from _ordered_map(fn, items, workers, max_pending, held)


def _ordered_map(fn: Callable, items: Iterable, workers: int, max_pending: int | None, held: Callable) -> Iterator:
    """:func:`ordered_map` inside its BLAS limit: ``held()`` is the context each item runs in."""
    if workers <= 1:
        for item in items:
            with held():
                result = fn(item)
            yield result
        return
    import torch

    bound = max_pending or 2 * workers
    pending: deque = deque()
    threads = torch.get_num_threads()

    def pinned(item):
        pin_intra_op_threads(threads)
        with held():
            return fn(item)

    with ThreadPoolExecutor(workers, thread_name_prefix="kpca") as pool:
        for item in items:
            pending.append(pool.submit(pinned, item))
            while len(pending) >= bound:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
