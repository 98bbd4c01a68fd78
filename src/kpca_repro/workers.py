"""The worker threads of the KPCA and eigenvalue jobs: a pool that keeps the order of its items,
each worker on the torch thread count of the thread that opened it, numpy's BLAS capped."""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["WorkerPool", "ordered_map", "device_stream", "pin_intra_op_threads"]

_THREAD_STREAMS = threading.local()


def device_stream(device: torch.device, enabled: bool = True):
    """A context that runs the calling thread's CUDA work on its own stream (else a no-op), so
    that worker threads of :func:`ordered_map` overlap their kernels instead of queueing."""
    import torch

    if not enabled or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    stream = getattr(_THREAD_STREAMS, "stream", None)
    if stream is None:
        stream = _THREAD_STREAMS.stream = torch.cuda.Stream(device=device)
    return torch.cuda.stream(stream)


def pin_intra_op_threads(n: int) -> None:
    """Give the calling thread ``n`` torch intra-op threads, whatever it inherited (a new thread
    takes torch's process-wide default, set by the last ``torch.set_num_threads`` of any thread;
    reading the count first makes torch initialise the thread, so the setting holds)."""
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _start_worker(threads: int, background: bool) -> None:
    """A worker's start: its torch threads; with ``background`` the lowest scheduling priority
    (nice 19, this thread only: Linux keeps a nice value per thread), so that the caller's team
    of OpenMP threads keeps its cores whenever it runs and the workers take what it leaves."""
    pin_intra_op_threads(threads)
    if background and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class WorkerPool:
    """``workers`` threads kept for a block (``with WorkerPool(...) as pool``), for :meth:`imap`.

    The KPCA stage's work releases the GIL (torch kernels, LAPACK, scipy's
    ``linear_sum_assignment``), so the threads run items in parallel. Each worker runs with the
    torch intra-op thread count of the thread that opened the pool, so a result does not
    depend on the thread that computed it. ``blas_threads`` caps numpy's and scipy's BLAS
    inside the block (``threadpoolctl``): OpenBLAS otherwise reads ``OMP_NUM_THREADS``, which
    Snakemake sets to the job's cores, and each worker's product would start a team of that
    many threads. ``background``: the workers run at the lowest priority (nice 19) beside a
    caller that computes meanwhile (:meth:`start`). ``workers <= 1`` runs everything on the
    calling thread.
    """

    def __init__(self, workers: int = 1, blas_threads: int | None = None, background: bool = False):
        self.workers, self.blas_threads, self.background = max(1, int(workers)), blas_threads, background
        self._stack = contextlib.ExitStack()
        self._pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> WorkerPool:
        if self.blas_threads is not None:
            from threadpoolctl import threadpool_limits

            self._stack.enter_context(threadpool_limits(limits=self.blas_threads, user_api="blas"))
        if self.workers > 1:
            import torch

            threads = torch.get_num_threads()
            self._pool = self._stack.enter_context(
                ThreadPoolExecutor(
                    self.workers,
                    thread_name_prefix="kpca",
                    initializer=_start_worker,
                    initargs=(threads, self.background),
                )
            )
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and self._pool is not None:
            # an interrupt or an error: the queued items are not started, the running ones finish
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._stack.close()

    def imap(self, fn: Callable, items: Iterable, max_pending: int | None = None) -> Iterator:
        """``fn(item)`` for each item, in order; ``items`` consumed lazily, at most ``max_pending``
        (default ``2 * workers``) in flight. An exception in ``fn`` is raised here."""
        if self._pool is None:
            yield from map(fn, items)
            return
        bound, pending = max_pending or 2 * self.workers, deque()
        for item in items:
            pending.append(self._pool.submit(fn, item))
            while len(pending) >= bound:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def start(self, fn: Callable, items: Iterable) -> Callable[[], list]:
        """Start ``fn(item)`` for every item on the workers and return without waiting; calling
        the returned function waits and gives the results in order (an exception in ``fn`` is
        raised there). The calling thread is free meanwhile: the KPCA job solves the next batch
        on it while the workers analyse this one. ``workers <= 1``: nothing runs until the call."""
        items = list(items)
        if self._pool is None:
            return lambda: [fn(item) for item in items]
        futures = [self._pool.submit(fn, item) for item in items]
        return lambda: [future.result() for future in futures]


def ordered_map(
    fn: Callable, items: Iterable, *, workers: int = 1, max_pending: int | None = None, blas_threads: int | None = None
) -> Iterator:
    """``fn(item)`` for each item, in order, on a :class:`WorkerPool` of ``workers`` threads
    opened for the map (``blas_threads``: its BLAS cap; ``max_pending``: :meth:`WorkerPool.imap`'s)."""
    with WorkerPool(workers, blas_threads) as pool:
        yield from pool.imap(fn, items, max_pending)
