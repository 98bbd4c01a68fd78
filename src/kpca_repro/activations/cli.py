"""The command line: ``python -m kpca_repro.activations validate FILE [--kind vision|text] [--no-invariant]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kpca_repro.activations.format import KINDS, ActivationFormatError, CaptureMismatchError
from kpca_repro.activations.validation import validate

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kpca_repro.activations validate FILE [--kind vision|text] [--no-invariant]``."""
    parser = argparse.ArgumentParser(
        prog="python -m kpca_repro.activations", description="Check an activation file against docs/activations.md."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    val = sub.add_parser(
        "validate", help="name the first violation and its fix (exit 1), or print ok and a summary (exit 0)"
    )
    val.add_argument("file")
    val.add_argument(
        "--kind",
        choices=KINDS,
        default=None,
        help="vision (no attention_mask) or text (attention_mask required); default: from the file",
    )
    val.add_argument("--no-invariant", action="store_true", help="skip the capture invariant (format only)")
    args = parser.parse_args(argv)
    try:
        summary = validate(args.file, kind=args.kind, check_invariant=not args.no_invariant)
    except (ActivationFormatError, CaptureMismatchError) as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    print(summary.line())
    return 0
