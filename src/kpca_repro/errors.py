"""The class of every error about an input file, which a rule script ends on with one line.

Each exception the library raises for a file it cannot use (a truncated or corrupt weights file,
an image that does not decode, an empty or binary text file, a malformed activation file, weights
with another SHA-256) derives from :class:`InputFileError` beside its usual base (``OSError``,
``ValueError``, ...). Its message is one line: the file, what is wrong with it and the fix. A rule
script ends on such an error with that line alone (:func:`kpca_repro.smk.setup_logging`); any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["InputFileError"]


class InputFileError(Exception):
    """A bad input file; the message names it, says what is wrong and how to fix it."""
