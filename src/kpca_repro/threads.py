"""How a job uses the machine: its device, torch's default thread count, the configuration's
thread settings, and the worker pool of the KPCA and eigenvalue stages (shared by every stage)."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads where a job uses it: the workflow imports this module while it builds the DAG
    import torch

__all__ = [
    "resolve_device",
    "cuda_available",
    "gpu_resource",
    "CPU_FORWARD_BATCH",
    "forward_batch_size",
    "torch_default_threads",
    "record_torch_default_threads",
    "resolve_threads",
    "resolve_eigh_threads",
    "intra_op_threads",
]


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; otherwise ``torch.device(device)``."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cuda_available(cache_dir: str | os.PathLike | None = None) -> bool:
    """``torch.cuda.is_available()`` of this machine, kept in the check cache of ``cache_dir``.

    The workflow asks it while it builds the DAG (``device: auto`` declares a GPU resource only
    where there is a GPU), so that a dry run with a filled cache need not import torch: the
    answer is cached under the host name, ``CUDA_VISIBLE_DEVICES`` and torch's version.
    """
    from kpca_repro.check_cache import CheckCache, package_version

    key = {"check": "cuda available", "host": socket.gethostname(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "torch": package_version("torch")}
    cache = CheckCache(cache_dir)
    hit = cache.get(key) if cache_dir is not None else None
    if hit is not None and isinstance(hit.get("available"), bool):
        return hit["available"]
    import torch

    available = bool(torch.cuda.is_available())
    if cache_dir is not None:
        cache.put(key, {"available": available})
    return available


def gpu_resource(device: str, cache_dir: str | os.PathLike | None = None) -> int:
    """The ``gpu`` resource (0 or 1) a job on ``config["device"]`` declares.

    ``"cpu"``: 0. ``"cuda"``, ``"cuda:N"``: 1. ``"auto"``: 1 where :func:`cuda_available` says
    this machine has a GPU, else 0 (a CPU-only machine then runs the extraction and KPCA jobs of
    several models side by side, up to ``--cores``; the default profile allows one ``gpu``).
    """
    if device == "cpu":
        return 0
    if device == "auto":
        return int(cuda_available(cache_dir))
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
    pass :data:`kpca_repro.check_cache.CHECK_CACHE_DIR`) start the child process once per
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


def record_torch_default_threads(cache_dir: str | os.PathLike) -> int | None:
    """Store this process's ``torch.get_num_threads()`` as :func:`torch_default_threads`'s answer, when it is one.

    The workflow's main process imports torch for its model checks and never sets a thread
    count; where neither ``OMP_NUM_THREADS`` nor ``MKL_NUM_THREADS`` is set, its count is the
    default a fresh process gets, so the first job needs no child process to learn it (a few
    seconds of a short chain). Does nothing (returns None) where torch is not imported, a
    thread variable is set, or the cache already holds an answer.
    """
    if "torch" not in sys.modules or any(k in os.environ for k in _THREAD_ENV):
        return None
    from kpca_repro.check_cache import CheckCache

    cache, key = CheckCache(cache_dir), _default_threads_key()
    if cache.get(key) is not None:
        return None
    threads = int(sys.modules["torch"].get_num_threads())
    if threads >= 1:
        cache.put(key, {"threads": threads})
        torch_default_threads.cache_clear()
        return threads
    return None


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


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """Run the block with ``n`` torch intra-op threads on the calling thread, then restore them.

    ``torch.set_num_threads`` sets the calling thread's OpenMP and MKL thread counts (MKL's
    ``mkl_set_num_threads_local``); other threads keep theirs, so worker threads may each
    hold a different count at the same time. It also sets torch's process-wide default,
    which a thread that has not yet run a parallel torch kernel adopts: the caller's count is
    read (which initialises the calling thread) and restored on exit. The KPCA engine uses it
    through :meth:`kpca_repro.method.placement.Placement.solver_threads`.

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
