"""The description of one KPCA job: what the ``kpca_heads`` rule, :func:`kpca_repro.method.records.kpca_records`
and the notebook API (:func:`kpca_repro.method.api.analyze_heads`) are asked to compute from a
:class:`~kpca_repro.method.heads.HeadSource`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from kpca_repro.method.heads import check_prefix
from kpca_repro.method.placement import Placement, plan
from kpca_repro.method.variant import Variant
from kpca_repro.method.variant import get as get_variant
from kpca_repro.resume import PartStore, file_identity

__all__ = ["KpcaJob"]


@dataclasses.dataclass(frozen=True)
class KpcaJob:
    """One KPCA job: every choice of the per-head records but the heads themselves (docs/method.md).

    Attributes:
        variant: ``"paper"`` or ``"corrected"`` (or a :class:`~kpca_repro.method.variant.Variant`;
            stored as the Variant). The heads' reading of it (text, causal) is the source's.
        placement: where and how the heads are solved (:func:`kpca_repro.method.placement.plan`);
            None: ``plan(variant, device="cpu", cores=1, eigh_threads=None)`` (one worker, the
            caller's torch threads for ``eigh``).
        heads_per_chunk: heads per engine call (no number depends on it on the CPU); >= 1.
        seed: the pipeline's ``seed`` (the corrected variant's baselines, the solver draws).
        layers: the layers analysed (a tuple; None: every layer of the source).
        sign_draws: ``(n_direct, n_optimal)`` solver draws per head, eigenvector signs and
            rotations inside near-degenerate eigenspaces
            (:func:`kpca_repro.method.solver_variation.head_solver_draws`); ``(0, 0)``: none.
        matched_draws_text: the matched-cosine draws per head of a language-model source instead
            of ``sign_draws[1]`` (its tables average over heads, and their solver interval is a
            prediction interval that needs 2: docs/uncertainty.md section 3); None: ``sign_draws[1]``.
        prune_matched_draws: vision heads: leave NaN the matched-cosine draws that no replicate
            maximum of Table 1 can use (:class:`~kpca_repro.method.solver_variation.RunningFloor`);
            False computes every one.
        prefix: a causal source's prefix profile at ``P`` real tokens (an integer >= 3,
            docs/method.md 16.1); None: the full-prefix view.
        store: where finished batches are kept for a rerun (:class:`kpca_repro.resume.PartStore`,
            :meth:`with_store`), or None.
        progress: show a progress bar (the rule's log).

    Raises:
        ValueError: an unknown variant, ``sign_draws`` not two counts >= 0, ``matched_draws_text``
            below 0, ``heads_per_chunk`` below 1, ``prefix`` below 3. TypeError: a non-integer ``prefix``.
    """

    variant: Variant | str = "paper"
    placement: Placement | None = None
    heads_per_chunk: int = 64
    seed: int = 0
    layers: Sequence[int] | None = None
    sign_draws: tuple[int, int] = (0, 0)
    matched_draws_text: int | None = None
    prune_matched_draws: bool = True
    prefix: int | None = None
    store: PartStore | None = None
    progress: bool = False

    def __post_init__(self):
        variant = get_variant(self.variant)
        draws = tuple(int(n) for n in self.sign_draws)
        if len(draws) != 2 or min(draws) < 0:
            raise ValueError(f"sign_draws={self.sign_draws!r}: two counts >= 0 (direct, matched); (0, 0) for none")
        if self.matched_draws_text is not None and int(self.matched_draws_text) < 0:
            raise ValueError(f"matched_draws_text={self.matched_draws_text!r}: a count >= 0, or None for sign_draws[1]")
        if int(self.heads_per_chunk) < 1:
            raise ValueError(f"heads_per_chunk={self.heads_per_chunk}: at least 1")
        check_prefix(self.prefix)
        placement = self.placement if self.placement is not None else plan(variant, device="cpu", eigh_threads=None)
        layers = None if self.layers is None else tuple(int(layer) for layer in self.layers)
        for name, value in (("variant", variant), ("sign_draws", draws), ("placement", placement), ("layers", layers)):
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, job: KpcaJob | str | None) -> KpcaJob:
        """``job`` itself, the default job of a variant name, or the default job (None)."""
        if isinstance(job, cls):
            return job
        return cls() if job is None else cls(variant=job)

    @property
    def draws_wanted(self) -> bool:
        """Whether the job draws solver variations (``sign_draws`` not ``(0, 0)``)."""
        return any(self.sign_draws)

    def matched_draws(self, text: bool) -> int:
        """The matched-cosine draws per head of a source: ``matched_draws_text`` for a language-model one where set,
        else ``sign_draws[1]``."""
        return int(self.matched_draws_text) if text and self.matched_draws_text is not None else self.sign_draws[1]

    def with_store(self, directory: str | os.PathLike, activations: str | os.PathLike, params: dict) -> KpcaJob:
        """This job keeping its finished batches in ``directory``, under the one key of a records job.

        The key: the activation file's identity (path, size, modification time), the variant,
        the rule's ``params`` (the code hash among them) and the placement; parts of another
        key are discarded (:class:`kpca_repro.resume.PartStore`).

        Raises:
            OSError: the directory cannot be created or written.
        """
        key = {
            "activations": file_identity(activations),
            "variant": self.variant.name,
            "params": params,
            "placement": self.placement.describe(),
            "eigh_threads": self.placement.eigh_threads,
        }
        return dataclasses.replace(self, store=PartStore(directory, key))
