"""Atomic writing of every output, and PDF metadata without a date.

Every rule writes its outputs under a temporary sibling name that replaces the final name only
when complete (:func:`atomic_output`, :func:`atomic_directory`), so an interrupted or failed job
never leaves a file a rerun would trust. The activation files are
:mod:`kpca_repro.activations`'s.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["PDF_METADATA", "atomic_output", "atomic_directory"]

#: ``savefig(..., metadata=PDF_METADATA)``: no creation date in PDFs, so identical runs give
#: identical bytes (PNG files carry no timestamp).
PDF_METADATA = {"CreationDate": None}


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it to ``path`` only if the block succeeds.

    An interrupted or failed job therefore never leaves a file under the final name that a
    rerun would trust. The temporary file is removed on failure.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.stem}.partial{final.suffix}")  # keeps the extension (matplotlib reads it)
    if tmp.exists():
        tmp.unlink()
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory; it replaces ``path`` only if the block succeeds.

    For downloads that fill a whole folder: an interrupted or failed download never leaves a
    half-filled folder under the final name. The temporary folder is removed on failure.
    """
    import shutil
    import tempfile

    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
