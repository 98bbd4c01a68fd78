"""Stage 0, the inputs: downloads into the resources directory (:mod:`.resources`), the image and
text samples (:mod:`.images`, :mod:`.text`), and where each model comes from (:mod:`.model_info`,
torch-free, also read while the workflow is parsed)."""
