"""Test infrastructure: a local Hugging Face hub of the real offline inputs (:mod:`.fixture`),
random-weight stand-ins of the paper's models (:mod:`.stand_ins`), and the git repositories both
are served from (:mod:`.repos`). Imports go one way: ``repos`` <- ``stand_ins`` <- ``fixture``.

Command line: ``python tools/hub.py build|serve ...`` (tools/README.md) runs
:func:`kpca_tools.hub.fixture.main`."""
