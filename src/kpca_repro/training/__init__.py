"""The training runs of Figures 1 and 4 (:mod:`.train`), their summary without torch
(:mod:`.summary`: scales, claims, token ablation) and their figures (:mod:`.figures`)."""
