"""Helpers for the thin rule scripts: logging into the rule's log file, one line for a bad input file, library
versions."""

from __future__ import annotations

import logging
import os
import platform
import signal
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from kpca_repro.errors import JobStop, OutputNotWritable

__all__ = [
    "check_writable",
    "end_on_input_file_errors",
    "fail_cleanly",
    "library_versions",
    "process_usage",
    "quiet_hub_logging",
    "setup_logging",
]


class _Tee:
    """A text stream writing to several streams (the log file and the terminal).

    Progress-bar frames (writes with a carriage return, e.g. a library's tqdm bar) go only
    to the streams that are terminals: a log file gets no ``\\r`` frames.
    """

    def __init__(self, *streams):
        self.streams = streams
        self.ttys = [_isatty(st) for st in streams]

    def write(self, s):
        frame = "\r" in s
        for st, tty in zip(self.streams, self.ttys):
            if frame and not tty:
                continue
            st.write(s)
            st.flush()
        return len(s)

    def flush(self):
        for st in self.streams:
            st.flush()

    def isatty(self):
        return False


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class _HubRetryFilter(logging.Filter):
    """One line per Hugging Face download retry: the error line is folded into the
    following "Retrying in Ns [Retry i/5]." line instead of being a line of its own."""

    def __init__(self):
        super().__init__()
        self.error = None

    def filter(self, record):
        msg = record.getMessage()
        if "thrown while requesting" in msg:
            self.error = msg.split(" thrown while requesting")[0]
            return False
        if msg.startswith("Retrying in") and self.error:
            record.msg, record.args, self.error = f"{msg.rstrip('.')} (after {self.error})", (), None
        return True


def quiet_hub_logging(progress_bars: bool) -> None:
    """Hugging Face hub messages through the log format once (not also through the hub's
    own handler), one line per retry, and its download bars only when ``progress_bars``.

    Args:
        progress_bars: keep the hub's download progress bars (True on a terminal).

    Returns:
        None. Does nothing when ``huggingface_hub`` is not installed.
    """
    try:
        from huggingface_hub.utils import disable_progress_bars
        from huggingface_hub.utils import logging as hub_logging
    except ImportError:  # pragma: no cover - huggingface_hub comes with timm and transformers
        return
    root = hub_logging.get_logger()  # the library's root logger "huggingface_hub"
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.propagate = True
    http = logging.getLogger("huggingface_hub.utils._http")
    if not any(isinstance(f, _HubRetryFilter) for f in http.filters):
        http.addFilter(_HubRetryFilter())
    if not progress_bars:
        disable_progress_bars()


def setup_logging(snakemake, name: str) -> logging.Logger:
    """Send stderr (log records, warnings, tracebacks) to the rule's log file.

    The log file is ``snakemake.log[0]``; stderr is also kept on the terminal. Progress: a
    bar on the terminal only when it is one, plain periodic lines in the log file
    (:mod:`kpca_repro.progress`); Hugging Face retries take one line each
    (:func:`quiet_hub_logging`). A bad input file, an unwritable output and an interrupt
    (SIGINT, or SIGTERM as a scheduler sends it) end the script with one line, no traceback
    (:func:`end_on_input_file_errors`); every output's folder is checked first
    (:func:`check_writable`), so a job that could not write its result fails before its work.

    Args:
        snakemake: the ``snakemake`` object of a rule script (``log[0]`` is used).
        name: the logger's name (the rule's).

    Returns:
        A logger named ``name``.

    Raises:
        kpca_repro.errors.OutputNotWritable: an output's folder is not writable.
    """
    from kpca_repro.progress import set_log_stream

    log_file = open(snakemake.log[0], "w", buffering=1)
    sys.stderr = _Tee(log_file, sys.__stderr__)
    set_log_stream(log_file)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True
    )
    logging.captureWarnings(True)
    quiet_hub_logging(progress_bars=_isatty(sys.__stderr__))
    log = logging.getLogger(name)
    end_on_input_file_errors(log)
    signal.signal(signal.SIGTERM, _interrupt)
    check_writable(list(getattr(snakemake, "output", [])))
    return log


def _interrupt(signum, frame):
    """SIGTERM (a scheduler's time limit or preemption) as Ctrl-C: the job keeps what it finished and ends in one
    line."""
    raise KeyboardInterrupt


def check_writable(paths: list[str | os.PathLike]) -> None:
    """Fail before any work when a file cannot be created in the folder of one of ``paths``.

    Creates and deletes a temporary file in each folder, which is what writing the output will
    need: a permission bit, a read-only mount or a full quota all show here. A folder it had to
    create is removed again (a job that keeps no parts leaves no empty ``.parts`` folder).

    Raises:
        kpca_repro.errors.OutputNotWritable: one line naming the path and the reason.
    """
    for path in paths:
        folder = Path(path).parent
        created = [f for f in (folder, *folder.parents) if not f.exists()]  # deepest first
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            raise OutputNotWritable(
                f"{path}: cannot write here ({exc.strerror or exc}); make {folder} writable and rerun"
            ) from None
        finally:
            for f in created:
                try:
                    f.rmdir()
                except OSError:
                    break


def end_on_input_file_errors(log: logging.Logger) -> None:
    """Make a rule script that stops on a bad input file end with one ERROR line, no traceback.

    Installs a ``sys.excepthook``: an uncaught :class:`kpca_repro.errors.JobStop` (a bad input
    file: the message names the file, what is wrong and the fix; an unwritable output; an
    interrupt after the job kept its finished parts) or ``KeyboardInterrupt`` is logged as one
    line, and the script exits with status 1 as for any uncaught exception; every other
    exception is a bug and keeps its traceback. The hook runs once the exception has left every ``with`` block, so
    :func:`kpca_repro.h5io.atomic_output` has already removed the unfinished output. Snakemake
    then prints the job's log: the line, not a traceback of the library's internals.

    Args:
        log: the script's logger (:func:`setup_logging`).
    """
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if isinstance(exc, JobStop):
            log.error("%s", " ".join(str(exc).split("\n")))
        elif isinstance(exc, KeyboardInterrupt):
            log.error("interrupted")
        else:
            previous(exc_type, exc, tb)

    sys.excepthook = hook


def fail_cleanly(log: logging.Logger, func, /, *args, **kwargs):
    """Call ``func``; if it raises, log its message as one ERROR line and exit with status 1.

    For the download rules: a failed download (no network, a moved URL) ends with the
    message that names the path to fill by hand, without a traceback.

    Returns:
        What ``func`` returns.

    Raises:
        SystemExit: status 1, when ``func`` raised any exception.
    """
    try:
        return func(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - every failure ends the job the same way
        log.error("%s", str(exc) or type(exc).__name__)
        sys.exit(1)


def process_usage() -> str:
    """This process's wall time since it started and its CPU time (user and system, every thread), in
    seconds, as one log line: ``"job process: 32.1 s wall, 55.3 CPU-s (1.72 cores busy)"``.

    A Snakemake ``benchmark:`` file's ``cpu_time`` is its last sample (every 0.5 s for the first 15 s,
    then every 30 s: ``snakemake.benchmark``), so it leaves out what a job spends after that sample;
    docs/performance.md quotes this line.
    """
    import time

    import psutil  # a dependency of snakemake

    wall = max(time.time() - psutil.Process().create_time(), 1e-9)
    times = os.times()
    cpu = times.user + times.system
    return f"job process: {wall:.1f} s wall, {cpu:.1f} CPU-s ({cpu / wall:.2f} cores busy)"


def library_versions() -> dict[str, str]:
    """Versions of Python and of the libraries that shape the numbers."""
    out = {"python": platform.python_version()}
    for pkg in ("torch", "timm", "transformers", "numpy", "scipy", "h5py", "pandas", "torchvision", "snakemake"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out
