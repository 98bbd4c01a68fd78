"""What runs before any job: the configuration checks, the missing-input block, the SLURM fit
check, the output paths and the code hashes of the rules (``workflow/rules/common.smk``)."""

import os

__all__ = ["strict_docutils"]


def strict_docutils(conf: str | os.PathLike) -> None:
    """Add ``conf`` (``halt_level: warning``) to ``DOCUTILSCONFIG``, read by every later docutils call,
    so that ``snakemake --report`` stops at the first docutils warning or error in a caption (the
    Snakefile calls it). Files already listed are kept and read first; ``conf``'s settings win."""
    conf = os.fspath(conf)
    current = [f for f in os.environ.get("DOCUTILSCONFIG", "").split(os.pathsep) if f]
    if conf not in current:
        os.environ["DOCUTILSCONFIG"] = os.pathsep.join([*current, conf])
