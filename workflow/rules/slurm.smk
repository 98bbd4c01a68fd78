# With the SLURM executor (profiles/slurm), check before any submission that every cluster job's
# cpus_per_task, mem_mb and gpu fit on a node of its partition: SLURM would otherwise leave an
# oversized job PENDING forever (reason PartitionConfig). src/kpca_repro/slurm_preflight.py.


onstart:
    if workflow.executor_plugin is not None and workflow.executor_plugin.name == "slurm":
        from kpca_repro.slurm_preflight import check_jobs

        check_jobs(workflow.dag.needrun_jobs())
