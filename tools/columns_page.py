"""docs/columns.md from the column registry (src/kpca_repro/analysis/columns.py).

    python tools/columns_page.py > docs/columns.md

``kpca_repro`` comes from the install or PYTHONPATH; tests/test_columns.py checks the committed page.
"""

from kpca_repro.analysis.columns import markdown_page
from kpca_repro.analysis.tables import TABLES


def page() -> str:
    """The page: the registry's schemas, the per-head tables' statistics from :data:`~kpca_repro.analysis.tables.TABLES`."""
    return markdown_page({t.name: t.statistics for t in TABLES.values() if t.row})


if __name__ == "__main__":
    print(page(), end="")
