"""``python -m kpca_repro.activations validate FILE ...`` (:mod:`kpca_repro.activations.cli`)."""

import sys

from kpca_repro.activations.cli import main

sys.exit(main())
