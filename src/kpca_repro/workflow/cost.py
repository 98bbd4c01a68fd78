"""What a configuration will cost, printed while Snakemake builds the DAG (dry runs too) by the
extraction rules' input functions, a line per model (:class:`CostTable`): N (tokens per input),
the heads analysed, the KPCA's eigh work (``heads x N^3``) and the activation storage
(``16 B x heads x N x d``), relative to ViT-Large at 197 tokens on as many inputs; beyond
:data:`WARN_FACTOR` times, a warning names the config keys that bring it down.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REFERENCE", "WARN_FACTOR", "CostTable", "ModelCost", "model_cost", "text_model_shape", "config_json"]

#: The paper's largest vision case per image: (layers x heads, N, d) of ViT-Large/16 at 224 px.
REFERENCE = {"name": "ViT-Large at 197 tokens", "heads": 24 * 16, "n_tokens": 197, "head_dim": 64}
#: A model whose eigh work or storage exceeds the reference by more than this factor is warned about.
WARN_FACTOR = 4.0
BYTES = 4 * 4  # q, k, v, h in float32
HEADER = f"Cost estimate (eigh work = heads x N^3; storage = q,k,v,h float32 = 16 B x heads x N x d; x ref = relative to {REFERENCE['name']} on as many inputs):"
COLUMNS = f"  {'model':<40} {'N':>5} {'heads (L x H x inputs)':>28} {'eigh work':>20} {'storage':>18}"


@dataclass(frozen=True)
class ModelCost:
    """Cost of one model (``domain`` ``"vision"`` or ``"text"``) on ``n_inputs`` images or rows;
    ``n_tokens`` None when unknown. Ratios are relative to :data:`REFERENCE` on as many inputs."""

    model: str
    domain: str
    n_tokens: int | None
    layers: int
    heads_per_layer: int
    head_dim: int
    n_inputs: int

    heads = property(lambda self: self.layers * self.heads_per_layer * self.n_inputs)
    eigh_work = property(lambda self: None if self.n_tokens is None else float(self.heads) * self.n_tokens**3)
    storage_bytes = property(lambda self: None if self.n_tokens is None else float(BYTES) * self.heads * self.n_tokens * self.head_dim)
    eigh_ratio = property(lambda self: None if self.n_tokens is None else self.eigh_work / (float(REFERENCE["heads"]) * self.n_inputs * REFERENCE["n_tokens"] ** 3))
    storage_ratio = property(lambda self: None if self.n_tokens is None else self.storage_bytes / (float(BYTES) * REFERENCE["heads"] * self.n_inputs * REFERENCE["n_tokens"] * REFERENCE["head_dim"]))


def model_cost(model: str, domain: str, n_tokens: int | None, layers: int, heads_per_layer: int, head_dim: int, n_inputs: int) -> ModelCost:
    """A :class:`ModelCost` (integers coerced)."""
    return ModelCost(model, domain, n_tokens, int(layers), int(heads_per_layer), int(head_dim), int(n_inputs))


def config_json(source: str | os.PathLike) -> str | None:
    """The ``config.json`` of a local model directory, or of a hub id in the Hugging Face cache; None when there is none."""
    path = os.path.join(source, "config.json")
    if os.path.isdir(source):
        return path if os.path.isfile(path) else None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(str(source), "config.json")
    return cached if isinstance(cached, str) else None


def text_model_shape(source: str | os.PathLike) -> tuple[int, int, int] | None:
    """(layers, heads, head dimension) from a language model's :func:`config_json`; None when
    there is none or it lacks the keys."""
    try:
        cfg = json.loads(Path(config_json(source)).read_text())
        layers, heads, width = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
    except (TypeError, OSError, ValueError, KeyError):
        return None
    return int(layers), int(heads), int(width) // int(heads)


def _si(x: float, unit: str = "") -> str:
    factor, prefix = next(((f, p) for f, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")) if abs(x) >= f), (1, ""))
    return f"{x / factor:.3g} {prefix}{unit}".rstrip()


def _ratio(x: float) -> str:
    return f"{x:.2g}" if x < 10 else f"{x:.0f}"


def _lines(c: ModelCost) -> tuple[str, str | None]:
    """The table line of a model, and its warning (None when within :data:`WARN_FACTOR`)."""
    shape = f"{c.heads} ({c.layers}x{c.heads_per_layer}x{c.n_inputs})"
    if c.n_tokens is None:
        return f"  {c.model:<40} {'?':>5} {shape:>28} {'?':>20} {'?':>18}", None
    work = f"{_si(c.eigh_work)} ({_ratio(c.eigh_ratio)}x ref)"
    store = f"{_si(c.storage_bytes, 'B')} ({_ratio(c.storage_ratio)}x ref)"
    line = f"  {c.model:<40} {c.n_tokens:>5} {shape:>28} {work:>20} {store:>18}"
    if c.eigh_ratio <= WARN_FACTOR and c.storage_ratio <= WARN_FACTOR:
        return line, None
    keys = f"vision.model_kwargs.{c.model}.img_size (N) or vision.n_images" if c.domain == "vision" else "text.max_length (N) or text.n_rows"
    return line, (
        f"WARNING: {c.model} (N = {c.n_tokens}) needs {_ratio(c.eigh_ratio)}x the eigh work and {_ratio(c.storage_ratio)}x the activation "
        f"storage ({_si(c.storage_bytes, 'B')}) of {REFERENCE['name']} on {c.n_inputs} inputs; reduce it with {keys}."
    )


class CostTable:
    """The cost lines, printed to stderr as the models' jobs are scheduled: the header before the
    first, each model once (its warning right under it)."""

    def __init__(self):
        self.seen: set[str] = set()
        self.header = [HEADER, COLUMNS]

    def add(self, model: str, cost) -> None:
        """Print ``cost()`` (a :class:`ModelCost`, or None when unknown) the first time ``model`` comes."""
        if model in self.seen:
            return
        self.seen.add(model)
        c = cost()
        if c is None:
            return
        line, warning = _lines(c)
        print("\n".join([*self.header, line, *([warning] if warning else [])]), file=sys.stderr)
        self.header = []
