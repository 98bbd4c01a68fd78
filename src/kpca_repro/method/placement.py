"""Where the KPCA engine runs each kind of work: one decision per job, for every stage.

A :class:`Placement` says, for one job (a ``kpca_heads``, ``eigenvalues`` or ``gamma`` job, or a
notebook call), where the heads' tensors live, where and how ``eigh`` runs (device, one matrix
or one batch per call, thread count, which solver), how many worker threads analyse the heads
and whether each worker gets its own CUDA stream.
The assignments (scipy, float64) and the solver draws always run on the worker threads' CPU
cores. :func:`plan` makes the decision from the variant, the device and the job's cores (the
extraction jobs' one decision, how many inputs a forward pass takes, is
:func:`kpca_repro.capture.extraction.forward_batch_size`: the method is no input of extraction); the
engine (:mod:`kpca_repro.method.kpca`) and the draws (:mod:`kpca_repro.method.solver_variation`)
only read it. The rules and the reasons (docs/performance.md, docs/fidelity.md):

=======================  ===================================  ======================================
work                     CPU                                   CUDA
=======================  ===================================  ======================================
paper variant ``eigh``   LAPACK, one matrix per call, the      ``torch.linalg.eigh`` on the CUDA
                         authors' thread count, on the job's   tensor (the authors' call), one
                         main thread                           batched call per block
paper Gram matrix,       one head at a time, authors'          one head at a time on the GPU
centering, V_KPCA        thread count                          (the authors' per-head products)
sign-invariant ``eigh``  LAPACK, one matrix per call, one      one batched call of the batched
(corrected variant,      thread                                solver (:data:`EIGENSOLVERS`)
Tables 2-3, Figure 3)
assignments, draws       worker threads                        worker threads (CPU)
=======================  ===================================  ======================================

No number of the ``paper`` variant depends on the number of workers, the chunking or the
sharding on either device; it depends on the device and, on the CPU, on the thread count of
``eigh`` (which is why that is the authors').
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from kpca_repro.method.variant import Variant
from kpca_repro.method.variant import get as get_variant
from kpca_repro.threads import intra_op_threads, resolve_device, resolve_threads

__all__ = ["EIGENSOLVERS", "Placement", "plan", "batched_eigensolver"]

#: Batched GPU eigensolvers for sign-invariant work: ``torch`` (``torch.linalg.eigh``, which
#: torch 2.12 and later send to cuSOLVER's ``syevBatched``; earlier versions loop ``syevj`` one
#: matrix at a time, docs/performance.md) and ``jax`` (``jax.numpy.linalg.eigh``, optional:
#: the ``gpu`` extra; tensors pass through DLPack without a copy).
EIGENSOLVERS = ("torch", "jax")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one job runs each kind of KPCA work (see the module docstring for the rules).

    Attributes:
        device: the heads' tensors (Gram matrices, V_KPCA, the metrics).
        eigh_device: where ``eigh`` runs.
        eigh_batched: one solver call per block of heads (GPU) instead of one per matrix
            (CPU: LAPACK's code path depends on a matrix's memory alignment in a batch, so a
            head's eigenvectors would depend on its position, docs/performance.md).
        eigh_threads: intra-op threads of each CPU ``eigh`` and of the paper variant's per-head
            products (None: the caller's).
        per_head_products: the paper variant's Gram matrix, centering and V_KPCA one head at a
            time, as the authors' loop computes them (a batched product rounds differently on
            some CPUs, docs/fidelity.md).
        eigensolver: ``"torch"`` or ``"jax"`` (:data:`EIGENSOLVERS`) for batched calls.
        workers: worker threads, each on its own chunk of heads.
        blas_threads: numpy's and scipy's BLAS threads while the workers run (None: unchanged).
        streams: one CUDA stream per worker thread.
        solve_on_main: the Gram matrices, ``eigh`` and V_KPCA of each chunk on the job's main
            thread on :attr:`eigh_threads` threads, while the workers compare the previous
            batch (the paper variant on the CPU: torch sets MKL's and OpenMP's thread counts
            per thread, so each ``eigh`` keeps the authors' count, docs/performance.md).
    """

    device: torch.device
    eigh_device: torch.device
    eigh_batched: bool
    eigh_threads: int | None = None
    per_head_products: bool = False
    eigensolver: str = "torch"
    workers: int = 1
    blas_threads: int | None = None
    streams: bool = False
    solve_on_main: bool = False

    @classmethod
    def local(
        cls, device: str | torch.device = "cpu", eigh_threads: int | None = None, per_head_products: bool = False
    ) -> Placement:
        """The placement of a single-threaded call on ``device``: ``eigh`` per matrix on the CPU,
        batched (torch) on a GPU; no workers. What :func:`kpca_repro.method.kpca.head_metrics`
        uses when it is given none."""
        dev = torch.device(device)
        return cls(
            device=dev,
            eigh_device=dev,
            eigh_batched=dev.type != "cpu",
            eigh_threads=eigh_threads,
            per_head_products=per_head_products,
        )

    def solver_threads(self):
        """Context of a CPU region on :attr:`eigh_threads` intra-op threads of the calling thread
        (:func:`kpca_repro.threads.intra_op_threads`). A no-op on a GPU."""
        if self.eigh_device.type != "cpu" or self.eigh_threads is None:
            return contextlib.nullcontext()
        return intra_op_threads(self.eigh_threads)

    def describe(self) -> str:
        """One line for a job's log."""
        solver = f"eigh on {self.eigh_device.type}" + (
            f", batched ({self.eigensolver})" if self.eigh_batched else ", one matrix per call"
        )
        threads = (
            f" on {self.eigh_threads} threads"
            if self.eigh_threads is not None and self.eigh_device.type == "cpu"
            else ""
        )
        main = "; solved on the main thread" if self.solve_on_main else ""
        return f"{self.device.type}: {solver}{threads}; {self.workers} workers{main}" + (
            "; a CUDA stream per worker" if self.streams else ""
        )


def batched_eigensolver(setting: str = "auto") -> str:
    """The batched GPU eigensolver of the ``kpca.gpu_eigensolver`` setting.

    ``"auto"``: ``torch`` from torch 2.12 on (cuSOLVER's ``syevBatched``), otherwise ``jax`` when
    it can be imported, otherwise ``torch``. ``"torch"`` / ``"jax"``: that one.

    Raises:
        ValueError: an unknown setting, or ``"jax"`` when JAX cannot be imported (with the fix).
    """
    if setting not in ("auto", *EIGENSOLVERS):
        raise ValueError(f"config key kpca.gpu_eigensolver: expected 'auto', 'torch' or 'jax', got {setting!r}")
    if setting == "torch":
        return "torch"
    try:
        import jax  # noqa: F401
    except ImportError:
        if setting == "jax":
            raise ValueError(
                "config key kpca.gpu_eigensolver is 'jax', but JAX cannot be imported: install the gpu extra (pip "
                "install -e '.[gpu]') or set it to 'torch'"
            ) from None
        return "torch"
    if setting == "jax":
        return "jax"
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "torch" if (major, minor) >= (2, 12) else "jax"


def plan(
    variant: str | Variant,
    *,
    device: str | torch.device = "auto",
    cores: int = 1,
    eigh_threads: int | str | None = "auto",
    gpu_eigensolver: str = "auto",
    sign_invariant: bool = False,
) -> Placement:
    """The placement of one job (the module docstring's table).

    Args:
        variant: the variant the job computes (its ``authors_threads`` decides the paper rules).
        device: ``config["device"]``: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
        cores: the job's cores (Snakemake's ``threads``): the worker count.
        eigh_threads: ``kpca.eigh_threads`` (``"auto"``: torch's default in a fresh process, the
            authors' count; or a positive int); used by the paper variant on the CPU only.
        gpu_eigensolver: ``kpca.gpu_eigensolver`` (:func:`batched_eigensolver`).
        sign_invariant: the job's results do not depend on eigenvector signs (Tables 2-3,
            Figure 3): on a GPU it takes the batched solver whatever the variant.

    Returns:
        A :class:`Placement` with ``cores`` workers and numpy's BLAS on one thread each.

    Raises:
        ValueError: ``cores`` below 1, an invalid thread setting or solver.
    """
    v = get_variant(variant)
    dev = resolve_device(device) if isinstance(device, str) else torch.device(device)
    if int(cores) < 1:
        raise ValueError(f"a job needs at least 1 core, got {cores}")
    workers = int(cores)
    if dev.type == "cpu":
        threads = (
            resolve_threads(eigh_threads, "kpca.eigh_threads") if v.authors_threads and not sign_invariant else None
        )
        authors = v.authors_threads and not sign_invariant
        return Placement(
            device=dev,
            eigh_device=dev,
            eigh_batched=False,
            eigh_threads=threads,
            per_head_products=authors,
            workers=workers,
            blas_threads=1,
            solve_on_main=authors,
        )
    # the authors' script calls torch.linalg.eigh on the CUDA tensor; sign-invariant work may take any batched solver
    solver = "torch" if v.authors_threads and not sign_invariant else batched_eigensolver(gpu_eigensolver)
    return Placement(
        device=dev,
        eigh_device=dev,
        eigh_batched=True,
        eigh_threads=None,
        per_head_products=v.authors_threads,
        eigensolver=solver,
        workers=workers,
        blas_threads=1,
        streams=True,
    )
