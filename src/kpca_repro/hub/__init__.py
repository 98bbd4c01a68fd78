"""Test infrastructure: a local Hugging Face hub of the real offline inputs (:mod:`.fixture`)
and random-weight stand-ins of the paper's models (:mod:`.stand_ins`).

``python -m kpca_repro.hub`` runs :func:`kpca_repro.hub.fixture.main`."""
