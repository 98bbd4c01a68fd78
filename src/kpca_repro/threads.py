"""Thread counts of the jobs: torch's default, and the configuration's thread settings.

A small module of its own so that the extraction, norm and KPCA jobs can share it without
listing each other's modules as rule inputs.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

__all__ = ["torch_default_threads", "resolve_threads", "resolve_eigh_threads"]


#: Environment variables that set torch's default intra-op thread count (Snakemake sets them
#: to a job's ``threads``); left out when asking what a plain ``python`` process gets.
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@functools.lru_cache(maxsize=1)
def torch_default_threads() -> int:
    """``torch.get_num_threads()`` of a fresh Python process without thread variables.

    That is the intra-op thread count the authors' scripts ran with (they never set one):
    torch's default, MKL's count of physical cores, unless ``OMP_NUM_THREADS`` or
    ``MKL_NUM_THREADS`` is set. Asked of a child process (about 1-2 s, once per process)
    with both variables removed from its environment, because this process's own count
    may already be set (a Snakemake job's ``OMP_NUM_THREADS``, ``torch.set_num_threads``).

    Returns:
        A positive int.

    Raises:
        RuntimeError: the child process failed or printed no positive integer.
    """
    env = {k: v for k, v in os.environ.items() if k not in _THREAD_ENV}
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
