"""Stage 2, the method: the kernel-PCA mathematics per head (:mod:`.equations`), the engine that
runs it on batches of heads (:mod:`.kpca`), the variants (:mod:`.variant`), the per-head records
of an activation file (:mod:`.records`) with their sign draws (:mod:`.uncertainty`). The
authors' per-head transcription, the oracle of the tests, is :mod:`kpca_tools.reference` (tools/)."""
