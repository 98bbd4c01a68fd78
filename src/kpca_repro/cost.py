"""What a configuration will cost, stated before any job runs (dry run included).

Per model: N (tokens per image or row), the heads analysed (layers x heads x images or
rows), the eigendecomposition work of the KPCA (each head's centered N x N Gram matrix:
``heads x N^3``) and the storage of its activation file (q, k, v and h per head:
``4 x 4 bytes x heads x N x d``, float32). Both are compared with the paper's largest
case, ViT-Large at 197 tokens (24 layers x 16 heads, d = 64) on as many images; a model
more than :data:`WARN_FACTOR` times beyond it gets a warning that names the config keys
that bring it down.

The numbers come from what the workflow already has at parse time: the meta-device build of
each vision model (:func:`kpca_repro.vision.check_vision_model`) and the ``config.json`` of
each language model (local directory or Hugging Face cache), so the estimate costs
milliseconds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REFERENCE", "WARN_FACTOR", "ModelCost", "cost_report", "model_cost", "text_model_shape"]

#: The paper's largest vision case per image: (layers x heads, N, d) of ViT-Large/16 at 224 px.
REFERENCE = {"name": "ViT-Large at 197 tokens", "heads": 24 * 16, "n_tokens": 197, "head_dim": 64}
#: A model whose eigh work or storage exceeds the reference by more than this factor is warned about.
WARN_FACTOR = 4.0
BYTES_PER_FLOAT = 4
N_TENSORS = 4  # q, k, v, h


@dataclass(frozen=True)
class ModelCost:
    """Cost of one model on one sample.

    Attributes:
        model: the model id; domain: ``"vision"`` or ``"text"``.
        n_tokens: N (None: unknown); layers, heads_per_layer, head_dim: its attention.
        n_inputs: images (``vision.n_images``) or rows (``text.n_rows``).
        heads: layers x heads_per_layer x n_inputs.
        eigh_work: heads x N^3 (None when N is unknown).
        storage_bytes: 4 tensors x 4 bytes x heads x N x d (None when N is unknown).
        eigh_ratio, storage_ratio: relative to :data:`REFERENCE` on ``n_inputs`` inputs.
    """

    model: str
    domain: str
    n_tokens: int | None
    layers: int
    heads_per_layer: int
    head_dim: int
    n_inputs: int

    @property
    def heads(self) -> int:
        return self.layers * self.heads_per_layer * self.n_inputs

    @property
    def eigh_work(self) -> float | None:
        return None if self.n_tokens is None else float(self.heads) * self.n_tokens**3

    @property
    def storage_bytes(self) -> float | None:
        return None if self.n_tokens is None else float(N_TENSORS * BYTES_PER_FLOAT) * self.heads * self.n_tokens * self.head_dim

    @property
    def eigh_ratio(self) -> float | None:
        ref = float(REFERENCE["heads"]) * self.n_inputs * REFERENCE["n_tokens"] ** 3
        return None if self.eigh_work is None else self.eigh_work / ref

    @property
    def storage_ratio(self) -> float | None:
        ref = float(N_TENSORS * BYTES_PER_FLOAT) * REFERENCE["heads"] * self.n_inputs * REFERENCE["n_tokens"] * REFERENCE["head_dim"]
        return None if self.storage_bytes is None else self.storage_bytes / ref


def model_cost(model: str, domain: str, n_tokens: int | None, layers: int, heads_per_layer: int, head_dim: int, n_inputs: int) -> ModelCost:
    """A :class:`ModelCost`.

    Args:
        model: the model id; domain: ``"vision"`` or ``"text"``.
        n_tokens: N, tokens per image or row (None: unknown, shown as ``?``).
        layers, heads_per_layer, head_dim: the attention's shape.
        n_inputs: images or rows analysed.

    Returns:
        The cost; its properties compute the heads, eigh work, storage and ratios.
    """
    return ModelCost(model, domain, n_tokens, int(layers), int(heads_per_layer), int(head_dim), int(n_inputs))


def text_model_shape(source: str | os.PathLike) -> tuple[int, int, int] | None:
    """(layers, heads per layer, head dimension) from a language model's ``config.json``.

    Args:
        source: a local model directory, or a hub id (read from the Hugging Face cache only).

    Returns:
        The triple, or None when no ``config.json`` is available locally or it lacks the keys.
    """
    path = Path(source) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:  # pragma: no cover
            return None
        cached = try_to_load_from_cache(str(source), "config.json")
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        cfg = json.loads(path.read_text())
        layers, heads, width = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
    except (OSError, ValueError, KeyError):
        return None
    return int(layers), int(heads), int(width) // int(heads)


def _si(x: float, unit: str = "") -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _ratio(x: float) -> str:
    return f"{x:.2g}" if x < 10 else f"{x:.0f}"


def _keys(c: ModelCost) -> str:
    if c.domain == "vision":
        return f"vision.model_kwargs.{c.model}.img_size (N) or vision.n_images"
    return "text.max_length (N) or text.n_rows"


def cost_report(costs: list[ModelCost]) -> tuple[str, list[str]]:
    """The cost table and the warnings.

    Args:
        costs: one :class:`ModelCost` per model the requested targets need.

    Returns:
        ``(table, warnings)``: the table as text (header, one line per model); one warning
        line per model more than :data:`WARN_FACTOR` times beyond :data:`REFERENCE` in eigh
        work or storage, naming the config keys that reduce it.
    """
    head = f"Cost estimate (eigh work = heads x N^3; storage = q,k,v,h float32 = 16 B x heads x N x d; x ref = relative to {REFERENCE['name']} on as many inputs):"
    rows = [f"  {'model':<40} {'N':>5} {'heads (L x H x inputs)':>28} {'eigh work':>20} {'storage':>18}"]
    warnings = []
    for c in costs:
        shape = f"{c.heads} ({c.layers}x{c.heads_per_layer}x{c.n_inputs})"
        if c.n_tokens is None:
            rows.append(f"  {c.model:<40} {'?':>5} {shape:>28} {'?':>20} {'?':>18}")
            continue
        work = f"{_si(c.eigh_work)} ({_ratio(c.eigh_ratio)}x ref)"
        store = f"{_si(c.storage_bytes, 'B')} ({_ratio(c.storage_ratio)}x ref)"
        rows.append(f"  {c.model:<40} {c.n_tokens:>5} {shape:>28} {work:>20} {store:>18}")
        if c.eigh_ratio > WARN_FACTOR or c.storage_ratio > WARN_FACTOR:
            warnings.append(
                f"WARNING: {c.model} (N = {c.n_tokens}) needs {_ratio(c.eigh_ratio)}x the eigh work and {_ratio(c.storage_ratio)}x the activation "
                f"storage ({_si(c.storage_bytes, 'B')}) of {REFERENCE['name']} on {c.n_inputs} inputs; reduce it with {_keys(c)}."
            )
    return "\n".join([head, *rows]), warnings
