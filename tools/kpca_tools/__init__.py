"""kpca_tools: what the tests, perf/ and the documentation's online runs use, and no rule does.

Kept outside the package ``kpca_repro`` (src/), which holds only what the pipeline runs, and
never installed: a checkout puts ``tools/`` on the path (tools/README.md).

* :mod:`kpca_tools.hub`: a local Hugging Face hub of the offline inputs and random-weight
  stand-ins of the paper's models (``python tools/hub.py build|serve ...``; docs/hub_fixture.md);
* :mod:`kpca_tools.reference`: the per-head transcription of the authors' scripts, the oracle of
  the tests, ``perf/`` and docs/fidelity.md;
* :mod:`kpca_tools.recorders`: the naive hook recorder the pipeline's capture is checked against.

Depends on ``kpca_repro``; ``kpca_repro`` never imports it (tests/test_code_deps.py).
"""
