"""The library modules a rule script imports, for the rule's ``code`` inputs.

Snakemake reruns a job when its ``script:`` file changes, not when a module that script
imports changes. Every rule therefore lists, as inputs, the ``kpca_repro`` modules its script
reaches through imports (``workflow/rules/common.smk``: ``code=code_inputs("<script>.py")``).
This module derives that list from the source text alone: it parses the script and, from
there, every ``kpca_repro`` module it reaches (imports inside functions included, since a
lazy import still runs the module's code), with :mod:`ast` and without importing anything,
so that building the DAG does not load torch.

Only this package's modules are followed; third-party and standard-library imports are
ignored (their versions are recorded in the outputs' metadata instead).
"""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["PACKAGE", "imported_modules", "library_modules"]

#: The package whose modules are followed.
PACKAGE = "kpca_repro"


def _module_path(package_dir: Path, name: str) -> Path | None:
    """``package_dir/<name>.py`` for a dotted submodule name of the package, if it exists."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) == 1:
        path = package_dir / "__init__.py"
    else:
        path = package_dir.joinpath(*parts[1:-1], parts[-1] + ".py")
        if not path.exists():
            path = package_dir.joinpath(*parts[1:], "__init__.py")
    return path if path.exists() else None


def imported_modules(source: str, module: str | None = None, package_dir: Path | None = None) -> set[str]:
    """Dotted names of the ``kpca_repro`` modules that ``source`` imports, anywhere in it."""
    tree = ast.parse(source)
    found: set[str] = set()
    base = module.split(".")[:-1] if module else []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if not base:
                    continue
                anchor = base[: len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                continue
            found.add(target)
            for alias in node.names:  # ``from kpca_repro import kpca``: a submodule
                sub = f"{target}.{alias.name}"
                is_module = _module_path(package_dir, sub) is not None if package_dir else alias.name.islower()
                if is_module:
                    found.add(sub)
    return found


#: (path, module, package_dir, mtime_ns, size) -> imported_modules of that file: a rule file
#: asks for ~20 scripts that share most of their modules; each file is parsed once.
_IMPORTS: dict[tuple, frozenset[str]] = {}


def _file_imports(path: Path, module: str | None, package_dir: Path) -> frozenset[str]:
    """:func:`imported_modules` of a file, memoized per file version (mtime and size)."""
    st = path.stat()
    key = (str(path.resolve()), module, str(package_dir), st.st_mtime_ns, st.st_size)
    if key not in _IMPORTS:
        _IMPORTS[key] = frozenset(imported_modules(path.read_text(), module, package_dir))
    return _IMPORTS[key]


def library_modules(script: str | Path, package_dir: str | Path) -> list[str]:
    """Paths of every ``kpca_repro`` module a script reaches through imports, transitively."""
    package_dir = Path(package_dir).resolve()
    todo = [(None, Path(script))]
    seen: dict[str, Path] = {}
    while todo:
        name, path = todo.pop()
        for dep in _file_imports(path, name, package_dir):
            parts = dep.split(".")
            for i in range(1, len(parts) + 1):  # a.b.c runs a and a.b first
                parent = ".".join(parts[:i])
                dep_path = _module_path(package_dir, parent)
                if dep_path is not None and parent not in seen:
                    seen[parent] = dep_path
                    todo.append((parent if dep_path.name != "__init__.py" else parent + ".__init__", dep_path))
    return sorted(str(p) for p in set(seen.values()))
