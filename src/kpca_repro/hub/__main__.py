"""``python -m kpca_repro.hub build|serve ...``: :func:`kpca_repro.hub.fixture.main`."""

import sys

from kpca_repro.hub.fixture import main

sys.exit(main())
