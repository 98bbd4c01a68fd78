"""The code a job runs: the package modules its rule script imports, hashed without docstrings and comments.

Snakemake reruns a job when its script changes, not when a module the script imports does. Each
rule therefore passes :func:`code_hash` of its script as ``params.code`` (``workflow/rules/common.smk``),
and a changed parameter reruns the job: editing a statement of ``method/equations.py`` reruns the
KPCA and table jobs, not the extraction; editing a docstring or a comment reruns nothing.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from modulefinder import ModuleFinder
from pathlib import Path

__all__ = ["PACKAGE", "SRC", "script_modules", "source_digest", "code_hash"]

PACKAGE = "kpca_repro"
#: The ``src`` directory of this checkout (the package the jobs import: common.smk checks it).
SRC = Path(__file__).resolve().parents[2]


class _PackageFinder(ModuleFinder):
    """:class:`modulefinder.ModuleFinder` (byte code, nothing executed) that follows this package's imports only."""

    def import_hook(self, name, caller=None, fromlist=None, level=-1):
        if level in (-1, 0) and not (name == PACKAGE or name.startswith(PACKAGE + ".")):
            return None
        return super().import_hook(name, caller, fromlist, level)


@functools.cache
def script_modules(script: str | Path, src: str | Path = SRC) -> tuple[Path, ...]:
    """The package's source files (under ``src``) that ``script`` imports, transitively, imports inside
    functions and the packages' ``__init__.py`` included; sorted. Cached per script and ``src``."""
    finder = _PackageFinder(path=[str(src)])
    finder.run_script(str(script))
    return tuple(
        sorted(
            Path(m.__file__).resolve()
            for name, m in finder.modules.items()
            if name.split(".")[0] == PACKAGE and m.__file__
        )
    )


def source_digest(path: str | Path) -> str:
    """SHA-256 of a module's syntax tree without its docstrings (module, class, function) and
    without positions, so that comments, blank lines and docstrings change nothing.

    Raises:
        SyntaxError: the file is not valid Python.
    """
    return _tree_digest(Path(path).read_text(encoding="utf-8"))


@functools.cache
def _tree_digest(source: str) -> str:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            if (
                isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).hexdigest()


def code_hash(script: str | Path, src: str | Path = SRC) -> str:
    """``params.code`` of a rule running ``script``: SHA-256 over the path (relative to ``src``) and
    :func:`source_digest` of each of :func:`script_modules`; 64 hex digits."""
    h = hashlib.sha256()
    for path in script_modules(Path(script).resolve(), Path(src).resolve()):
        h.update(f"{path.relative_to(Path(src).resolve())}\0{source_digest(path)}\0".encode())
    return h.hexdigest()
