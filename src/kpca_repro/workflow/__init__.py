"""What runs before any job: the configuration checks, the missing-input block, the cost
estimate, the SLURM fit check and the output paths (``workflow/rules/common.smk``)."""
