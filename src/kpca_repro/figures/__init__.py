"""Stage 4, Figures 2, 3 and 5 (:mod:`.plots`); the training curves of Figures 1 and 4 are
:mod:`kpca_repro.training.figures`."""
