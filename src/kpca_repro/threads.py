"""How a job uses the machine: its device, torch's default thread count, the configuration's
thread settings, and the worker pool of the KPCA and eigenvalue stages (shared by every stage)."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["resolve_device", "torch_default_threads", "resolve_threads", "resolve_eigh_threads", "pin_intra_op_threads", "ordered_map", "device_stream"]


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; otherwise ``torch.device(device)``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


#: Environment variables that set torch's default intra-op thread count (Snakemake sets them
#: to a job's ``threads``); left out when asking what a plain ``python`` process gets.
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _default_threads_key() -> dict:
    """Everything a fresh process's default thread count depends on, as a cache key."""
    from kpca_repro.check_cache import package_version

    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("OMP_", "MKL_", "KMP_", "GOMP_")) and k not in _THREAD_ENV}
    return {
        "check": "torch default intra-op threads",
        "torch": package_version("torch"),
        "python": sys.executable,
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "affinity": affinity,
        "env": env,
    }


@functools.lru_cache(maxsize=4)
def torch_default_threads(cache_dir: str | os.PathLike | None = None) -> int:
    """``torch.get_num_threads()`` of a fresh Python process without thread variables.

    That is the intra-op thread count the authors' scripts ran with (they never set one):
    torch's default, MKL's count of physical cores, unless ``OMP_NUM_THREADS`` or
    ``MKL_NUM_THREADS`` is set. Asked of a child process (a fresh interpreter that imports
    torch, hence the cache below) with both variables removed from its environment, because
    this process's own count may already be set (a Snakemake job's ``OMP_NUM_THREADS``,
    ``torch.set_num_threads``).

    With ``cache_dir`` the answer is kept there (:class:`kpca_repro.check_cache.CheckCache`)
    under a key of the host name, the CPU count and affinity, the interpreter, torch's
    version and the other OpenMP/MKL variables, so that the jobs of a run (the rule scripts
    pass :data:`kpca_repro.check_cache.WORKFLOW_CACHE_DIR`) start the child process once per
    machine instead of once each.

    Args:
        cache_dir: directory of the answer's cache entry, or None to always ask.

    Returns:
        A positive int.

    Raises:
        RuntimeError: the child process failed or printed no positive integer.
    """
    from kpca_repro.check_cache import CheckCache

    cache = CheckCache(cache_dir)
    key = _default_threads_key() if cache_dir is not None else {}
    hit = cache.get(key) if cache_dir is not None else None
    if hit is not None and isinstance(hit.get("threads"), int) and hit["threads"] >= 1:
        return hit["threads"]
    env = {k: v for k, v in os.environ.items() if k not in _THREAD_ENV}
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not out or not out[-1].isdigit() or int(out[-1]) < 1:
        raise RuntimeError(f"could not read torch's default thread count from a child process (exit {proc.returncode}): {proc.stderr[-2000:]}")
    if cache_dir is not None:
        cache.put(key, {"threads": int(out[-1])})
    return int(out[-1])


def resolve_threads(setting: int | str | None, key: str = "kpca.eigh_threads", cache_dir: str | os.PathLike | None = None) -> int | None:
    """A thread setting of the configuration (``kpca.eigh_threads``, ``kpca.intra_op_threads``) as a count.

    Args:
        setting: ``"auto"`` (:func:`torch_default_threads`, the authors' thread semantics),
            a positive int, or None (keep the caller's intra-op threads).
        key: the configuration key, named in the error.
        cache_dir: passed to :func:`torch_default_threads` for ``"auto"``.

    Returns:
        A positive int, or None.

    Raises:
        ValueError: any other value.
    """
    if setting is None:
        return None
    if setting == "auto":
        return torch_default_threads(cache_dir)
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return setting
    raise ValueError(f"config key {key}: expected 'auto' or a positive integer, got {setting!r}")


def resolve_eigh_threads(setting: int | str | None, cache_dir: str | os.PathLike | None = None) -> int | None:
    """The ``kpca.eigh_threads`` setting as a thread count (:func:`resolve_threads`)."""
    return resolve_threads(setting, "kpca.eigh_threads", cache_dir)


_THREAD_STREAMS = threading.local()


def device_stream(device: torch.device, enabled: bool = True):
    """A context that runs the calling thread's CUDA work on its own stream (else a no-op).

    Worker threads of :func:`ordered_map` then overlap their kernels and their host syncs
    instead of queueing on the default stream.
    """
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
    :func:`kpca_repro.method.kpca.intra_op_threads` around ``eigh``), and its OpenMP/MKL counts from
    ``OMP_NUM_THREADS`` before that. Reading the count first makes torch initialise the
    thread, so the explicit setting that follows is the one that holds.
    """
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def ordered_map(fn: Callable, items: Iterable, *, workers: int = 1, max_pending: int | None = None) -> Iterator:
    """``fn(item)`` for each item, in order, computed on ``workers`` threads.

    The KPCA stage's work releases the GIL (torch kernels, LAPACK ``eigh``, scipy's
    ``linear_sum_assignment``), so threads run chunks truly in parallel: on the CPU one
    chunk's assignments overlap the next chunk's ``eigh``; on a GPU the assignments of
    several chunks run on CPU threads while the GPU computes. ``items`` is consumed lazily and
    at most ``max_pending`` (default ``2 * workers``) results are in flight, so memory stays
    bounded by a few chunks whatever the number of items.

    Every worker thread runs each item with the calling thread's torch intra-op thread count
    (:func:`pin_intra_op_threads`), so an item's result does not depend on which thread
    computes it or on what ran there before.

    Args:
        fn: called as ``fn(item)`` on a worker thread.
        items: any iterable (a generator reading the activation file, for example).
        workers: threads; ``1`` runs everything on the calling thread.
        max_pending: in-flight bound.

    Yields:
        ``fn(item)`` in the order of ``items``. An exception in ``fn`` is raised here.
    """
    if workers <= 1:
        for item in items:
            yield fn(item)
        return
    bound = max_pending or 2 * workers
    pending: deque = deque()
    threads = torch.get_num_threads()

    def pinned(item):
        pin_intra_op_threads(threads)
        return fn(item)

    with ThreadPoolExecutor(workers, thread_name_prefix="kpca") as pool:
        for item in items:
            pending.append(pool.submit(pinned, item))
            while len(pending) >= bound:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
