"""Stage 1, capture: forward passes of the models with hooks that store q, k, v, h per head
(:mod:`.extraction`; timm models :mod:`.vision`, Hugging Face models :mod:`.hf_capture`; any
module :mod:`.module_capture`), each batch checked against the model's own attention before it
is written (:mod:`kpca_repro.activations`).

Writes ``results/activations/<model>/*.h5``; every later stage reads those files only."""
