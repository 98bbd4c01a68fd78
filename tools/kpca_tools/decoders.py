"""Tiny random-init decoders in local directories, one per supported decoder family, for tests and walkthroughs.

Each directory is what ``save_pretrained`` writes for ``AutoModel.from_config`` under
``torch.manual_seed(seed)`` (``config.json``, ``model.safetensors``) plus a byte-level BPE
tokenizer of the real family's tokenizer class, trained with the ``tokenizers`` library
(:func:`kpca_tools.hub.stand_ins.build_tokenizer`) on a few lines of text: the built-in
:data:`TINY_CORPUS` or the rows of a text file (the WikiText-103 test rows of
``../shared/assets/text/wikitext-103/wiki.test.raw``). The pipeline reads such a directory through
``decoders.local_models`` (``{model id: directory}``) exactly as a hub decoder.

=============  =================  ==========================================================
family         model type         attention
=============  =================  ==========================================================
``gpt2``       ``gpt2``           4 heads of 8, fused ``c_attn`` (Conv1D), no rotary
``llama``      ``llama``          4 query heads on 2 key/value heads (grouped-query), rotary
``qwen2``      ``qwen2``          4 query heads on ONE key/value head, q/k/v biases, rotary
``gpt_neox``   ``gpt_neox``       4 heads of 8, fused ``query_key_value``, rotary on half of
                                  each head (``rotary_pct`` 0.5, partial rotary)
=============  =================  ==========================================================

Two layers, width 32, 128 positions (``text.max_length``), vocabulary 400. ``initializer_range`` 0.3 makes the
attention far from uniform, so a capture that omits the rotary embedding or the causal mask
misses the invariant by orders of magnitude more than its tolerance.

Python::

    from kpca_tools.decoders import build_tiny_decoder, build_tiny_decoders
    path = build_tiny_decoder("llama", "models/tiny-llama", padding_side="left")
    paths = build_tiny_decoders("models")  # {"tiny/gpt2": Path("models/gpt2"), ...}

Command line (``PYTHONPATH=tools``)::

    python -m kpca_tools.decoders OUT_DIR [--families gpt2 llama qwen2 gpt_neox] [--padding-side right|left] [--corpus FILE]

prints one ``model id: directory`` line per decoder, the ``decoders.local_models`` entries.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kpca_tools.hub.stand_ins import TextSpec, build_tokenizer

__all__ = ["TINY_CORPUS", "TINY_FAMILIES", "tiny_config", "build_tiny_decoder", "build_tiny_decoders", "main"]

#: A few lines to train the tiny tokenizers on when no corpus file is given.
TINY_CORPUS = (
    " The cat sat on the mat and looked at the dog .",
    " A dog ran across the long green field , and the cat watched it from the old wall .",
    " The field was green and the wall was old .",
    " In 1998 the band released its third album , which reached number 12 on the chart .",
    " The river flows north through the valley before it joins the sea near the town .",
    " She studied the stars , the planets and the long history of their names .",
    " = = Early life = =",
    " He was born in the city of York on 3 May 1872 , the son of a carpenter .",
)
_VOCAB = 400
_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, max_position_embeddings=128, initializer_range=0.3)
#: ``family -> (configuration class, parameters, tokenizer class, special-token layout)``.
TINY_FAMILIES: dict[str, tuple[str, dict, str, str]] = {
    "gpt2": (
        "GPT2Config",
        dict(vocab_size=_VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=4, n_inner=48, initializer_range=0.3, bos_token_id=_VOCAB - 1, eos_token_id=_VOCAB - 1),
        "GPT2Tokenizer",
        "gpt2",
    ),
    "llama": ("LlamaConfig", dict(_SIZES, vocab_size=_VOCAB, num_key_value_heads=2, bos_token_id=0, eos_token_id=0), "GPT2Tokenizer", "smollm2"),
    "qwen2": ("Qwen2Config", dict(_SIZES, vocab_size=_VOCAB, num_key_value_heads=1, bos_token_id=_VOCAB - 3, eos_token_id=_VOCAB - 3), "Qwen2Tokenizer", "qwen2"),
    "gpt_neox": ("GPTNeoXConfig", dict(_SIZES, vocab_size=_VOCAB, rotary_pct=0.5, bos_token_id=0, eos_token_id=0), "GPTNeoXTokenizer", "neox"),
}


def tiny_config(family: str, **overrides):
    """The tiny ``transformers`` configuration of ``family`` (:data:`TINY_FAMILIES`), with ``overrides``.

    Raises:
        KeyError: an unknown family (the known ones named).
    """
    import transformers

    if family not in TINY_FAMILIES:
        raise KeyError(f"unknown tiny decoder family {family!r}; known: {sorted(TINY_FAMILIES)}")
    config_class, params, _, _ = TINY_FAMILIES[family]
    return getattr(transformers, config_class)(**{**params, **overrides})


def build_tiny_decoder(family: str, out_dir: str | os.PathLike, *, padding_side: str = "right", corpus: str | os.PathLike | Sequence[str] | None = None, seed: int = 0, **overrides) -> Path:
    """Save a tiny random-init decoder of ``family`` and its trained tokenizer to ``out_dir``.

    Args:
        family: ``gpt2``, ``llama``, ``qwen2`` or ``gpt_neox`` (:data:`TINY_FAMILIES`).
        out_dir: the directory (created; files of the same names replaced).
        padding_side: the tokenizer's ``padding_side`` (a decoder's tokenizer may pad left).
        corpus: a text file (its non-blank lines) or lines to train the tokenizer on; None:
            :data:`TINY_CORPUS`.
        seed: ``torch.manual_seed`` of the weights.
        overrides: configuration values over the tiny ones (e.g. ``sliding_window``).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        KeyError: an unknown family.
        ValueError: ``padding_side`` is neither ``right`` nor ``left``.
    """
    import torch
    from transformers import AutoModel, AutoTokenizer

    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    config = tiny_config(family, **overrides)
    config_class, params, tokenizer_class, layout = TINY_FAMILIES[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = TextSpec(config_class, {"vocab_size": _VOCAB}, "bytelevel_bpe", tokenizer_class, layout, 128, f"kpca_tools.decoders tiny {family}")
    with tempfile.TemporaryDirectory(prefix="kpca-tiny-tok-") as tmp:
        if corpus is None or not isinstance(corpus, (str, os.PathLike)):
            lines = TINY_CORPUS if corpus is None else corpus
            corpus = Path(tmp) / "corpus.txt"
            corpus.write_text("".join(line.rstrip("\n") + "\n" for line in lines), encoding="utf-8")
        build_tokenizer(spec, corpus, Path(tmp) / "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(Path(tmp) / "tokenizer", padding_side=padding_side)  # an init argument: saved in tokenizer_config.json
    tokenizer.save_pretrained(out)
    torch.manual_seed(seed)
    AutoModel.from_config(config).eval().save_pretrained(out)
    return out


def build_tiny_decoders(root: str | os.PathLike, families: Sequence[str] = tuple(TINY_FAMILIES), **kwargs) -> dict[str, Path]:
    """:func:`build_tiny_decoder` for each family into ``root/<family>``.

    Returns:
        ``{"tiny/<family>": directory}``: the ``decoders.local_models`` entries (model ids
        ``tiny/gpt2``, ``tiny/llama``, ``tiny/qwen2``, ``tiny/gpt_neox``).
    """
    return {f"tiny/{family}": build_tiny_decoder(family, Path(root) / family, **kwargs) for family in families}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kpca_tools.decoders OUT_DIR [--families ...] [--padding-side right|left] [--corpus FILE]``."""
    parser = argparse.ArgumentParser(prog="python -m kpca_tools.decoders", description="Save tiny random-init decoders (with trained tokenizers) to local directories.")
    parser.add_argument("out_dir")
    parser.add_argument("--families", nargs="+", choices=sorted(TINY_FAMILIES), default=list(TINY_FAMILIES))
    parser.add_argument("--padding-side", choices=("right", "left"), default="right")
    parser.add_argument("--corpus", default=None, help="a text file whose non-blank lines train the tokenizers (default: a few built-in lines)")
    args = parser.parse_args(argv)
    for model_id, path in build_tiny_decoders(args.out_dir, args.families, padding_side=args.padding_side, corpus=args.corpus).items():
        print(f"{model_id}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
