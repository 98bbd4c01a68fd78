"""The training runs of Figures 1 and 4, one concern per module: the recording ViT and the logged
quantities (:mod:`.model`), the data sets (:mod:`.data`), the loop (:mod:`.loop`), its checkpoint
(:mod:`.checkpoint`), the logs and their readers (:mod:`.logs`), the summary without torch
(:mod:`.summary`: scales, claims, token ablation) and the figures (:mod:`.figures`)."""
