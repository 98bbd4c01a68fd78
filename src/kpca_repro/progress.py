"""Progress of the long loops: a bar on a terminal, plain periodic lines in log files.

:func:`progress` replaces ``tqdm`` in the library (extraction batches, KPCA heads, norm
layers, training steps). On a terminal (``sys.__stderr__`` is a TTY) it draws a tqdm bar
there. Into the rule's log file (:func:`kpca_repro.smk.setup_logging` registers it with
:func:`set_log_stream`) it writes one plain line every ``KPCA_PROGRESS_INTERVAL`` seconds
(default 30) and one at the end, e.g.::

    2026-11-23 04:41:07,512 progress INFO epoch 3/100: 120/469 it (26%), 8.10 it/s, elapsed 0:00:15, ETA 0:00:43

without the carriage-return frames of a bar. Without a terminal and without a log file the
plain lines go to stderr.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import IO

__all__ = ["DEFAULT_INTERVAL_S", "Progress", "progress", "set_log_stream"]

#: Seconds between two plain lines (environment variable KPCA_PROGRESS_INTERVAL overrides it).
DEFAULT_INTERVAL_S = 30.0
_LOG_STREAM: IO[str] | None = None


def set_log_stream(stream: IO[str] | None) -> None:
    """Register the rule's log file: plain progress lines are written there (None: unregister)."""
    global _LOG_STREAM
    _LOG_STREAM = stream


def _terminal() -> IO[str] | None:
    err = sys.__stderr__
    try:
        return err if err is not None and err.isatty() else None
    except (AttributeError, ValueError):
        return None


def _interval() -> float:
    try:
        return float(os.environ.get("KPCA_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S


def _hms(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class Progress:
    """Counts work done; see :func:`progress` for the arguments."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        disable: bool = False,
        leave: bool = True,
        **_ignored,
    ):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n, self.kept, self._closed = 0, 0, False
        self.start = self._last = time.monotonic()
        self._last_n = 0
        self.interval = _interval()
        term = None if disable else _terminal()
        self._bar = None
        if term is not None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=term, leave=leave, mininterval=1.0)
        if disable:
            self._plain = None
        elif _LOG_STREAM is not None:
            # on a terminal the bar is there: the plain lines go to the log file alone
            self._plain = _LOG_STREAM if term is not None else sys.stderr
        else:
            self._plain = None if term is not None else sys.stderr

    def line(self) -> str:
        """The plain progress line, in the log format:
        ``<time> progress INFO desc: n/total unit (pct)[, K kept], rate, elapsed, ETA``.

        The rate (units per second) counts only the units done in this process, not the ``K``
        a resumed job read back (:meth:`skip`); the ETA divides what is left by it."""
        elapsed = time.monotonic() - self.start
        rate = (self.n - self.kept) / elapsed if elapsed > 0 else 0.0
        parts = [
            f"{self.desc}: {self.n}/{self.total} {self.unit}" if self.total else f"{self.desc}: {self.n} {self.unit}"
        ]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        if self.kept:
            parts.append(f"{self.kept} kept")
        parts.append(f"{rate:.0f} {self.unit}/s" if rate >= 100 else f"{rate:.2f} {self.unit}/s")
        parts.append(f"elapsed {_hms(elapsed)}")
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"ETA {_hms((self.total - self.n) / rate)}")
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now * 1000) % 1000:03d}"
        return f"{stamp} progress INFO " + ", ".join(parts)

    def _emit(self) -> None:
        if self._plain is not None:
            self._plain.write(self.line() + "\n")
            self._plain.flush()
        self._last, self._last_n = time.monotonic(), self.n

    def update(self, n: int = 1) -> None:
        """Add ``n`` units of work done; writes a plain line when the interval has passed."""
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        if self._plain is not None and time.monotonic() - self._last >= self.interval:
            self._emit()

    def skip(self, n: int) -> None:
        """Add ``n`` units done by an earlier, interrupted run (read back, not computed): they count
        towards done/total but not towards the rate."""
        self.kept += n
        self.update(n)

    def close(self) -> None:
        """Close the bar and write the final plain line (once)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self.n != self._last_n or self.n == 0:
            self._emit()

    def __iter__(self) -> Iterator:
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    disable: bool = False,
    leave: bool = True,
    **kwargs,
) -> Progress:
    """A progress counter used like ``tqdm``: iterate over it, or ``with`` it and ``update(n)``.

    Args:
        iterable: what to iterate over (its ``len`` is the total when it has one).
        total: units of work in all (the ``n/total`` and ETA of the plain lines).
        desc: what is being done, e.g. ``"kpca paper deit_tiny_patch16_224"``.
        unit: the unit counted (``"head"``, ``"batch"``, ...).
        disable: no bar and no lines.
        leave: keep the terminal bar after it closes.
        **kwargs: other tqdm arguments (``mininterval``), accepted and ignored.

    Returns:
        A :class:`Progress`.
    """
    return Progress(iterable, total=total, desc=desc, unit=unit, disable=disable, leave=leave, **kwargs)
