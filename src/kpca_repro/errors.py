"""The class of every error about an input file, which a rule script ends on with one line.

Each exception the library raises for a file it cannot use (a truncated or corrupt weights file,
an image that does not decode, an empty or binary text file, a malformed activation file, weights
with another SHA-256) derives from :class:`InputFileError` beside its usual base (``OSError``,
``ValueError``, ...). Its message is one line: the file, what is wrong with it and the fix. A rule
script ends on such an error with that line alone (:func:`kpca_repro.smk.setup_logging`); any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["JobStop", "InputFileError", "OutputNotWritable", "JobInterrupted"]


class JobStop(Exception):
    """An error a rule script ends on with its message as one line, no traceback."""


class InputFileError(JobStop):
    """A bad input file; the message names it, says what is wrong and how to fix it."""


class OutputNotWritable(JobStop, OSError):
    """A job's output (or the folder of its kept parts) cannot be written; raised before the work starts."""


class JobInterrupted(JobStop):
    """The job was stopped (SIGINT, SIGTERM) after keeping what it had finished
    (:class:`kpca_repro.resume.PartStore`); the message says how much and how to resume."""
