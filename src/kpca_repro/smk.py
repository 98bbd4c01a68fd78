"""Helpers for the thin rule scripts: logging into the rule's log file, library versions."""

from __future__ import annotations

import logging
import platform
import sys
from importlib import metadata

__all__ = ["setup_logging", "library_versions"]


class _Tee:
    """A text stream writing to several streams (the log file and the terminal)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            st.write(s)
            st.flush()
        return len(s)

    def flush(self):
        for st in self.streams:
            st.flush()

    def isatty(self):
        return False


def setup_logging(snakemake, name: str) -> logging.Logger:
    """Send stderr (log records, warnings, tracebacks, progress bars) to the rule's log file.

    The log file is ``snakemake.log[0]``; stderr is also kept on the terminal so progress
    bars stay visible. Returns a logger named ``name``.
    """
    log_file = open(snakemake.log[0], "w", buffering=1)
    sys.stderr = _Tee(log_file, sys.__stderr__)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    logging.captureWarnings(True)
    return logging.getLogger(name)


def library_versions() -> dict[str, str]:
    """Versions of Python and of the libraries that shape the numbers."""
    out = {"python": platform.python_version()}
    for pkg in ("torch", "timm", "transformers", "numpy", "scipy", "h5py", "pandas", "torchvision", "snakemake"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out
