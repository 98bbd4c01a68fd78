"""Stand-in hub repositories for the paper's models whose real files are not available here.

A **stand-in** is a hub repository with the exact architecture of a paper model and **random
weights** (seeded, float32), plus, for a language model, a tokenizer of the real model's
tokenizer class whose vocabulary was trained on the WikiText-103 test rows with the
``tokenizers`` library. It exercises the online code path (hub downloads, loaders, hooks, the
KPCA jobs, the tables) at full size; its numbers say nothing about the paper's claims and are
never compared with the published ones. Every stand-in repository carries the file
:data:`~kpca_tools.hub.repos.STAND_IN_MARKER` (``kpca_repro_stand_in.json``, ``{"stand_in":
true, ...}``) and the model-card tag :data:`~kpca_tools.hub.repos.STAND_IN_TAG`; the hub
fixture's config overlay lists their model ids under ``comparison.stand_in_models``.

* timm models (``vision.models``): ``timm/<name>.<default pretrained tag>`` (the
  ``pretrained_cfg['hf_hub_id']`` of ``timm.create_model(name)``), ``config.json`` by timm's
  ``save_config_for_hf`` and ``model.safetensors`` = the ``state_dict()`` of timm's own
  initialisation under ``torch.manual_seed(seed)`` (:func:`kpca_tools.hub.repos.add_timm_repo`).
* transformers models (``text.models``, ``decoders.models``): the configuration class of the model
  family set to the published hyper-parameters (:data:`TEXT_SPECS`, the decoders'
  :data:`DECODER_SPECS` among them), ``AutoModel.from_config`` under ``torch.manual_seed(seed)``,
  saved by ``save_pretrained`` (safetensors), and a stand-in tokenizer (:func:`build_tokenizer`)
  whose vocabulary size equals the configuration's ``vocab_size`` (a decoder's: the real
  tokenizer's length, ``TextSpec.tokenizer_size``, when its embedding matrix has spare rows).
  The fixture's config overlay pins each served decoder stand-in's ``decoders.revisions`` to its
  served commit.

The seed of a model is :func:`stand_in_seed` (a hash of its id), so a repository's bytes do not
depend on which other stand-ins are built, or in which order. Repositories are built lazily
(:func:`ensure`), only those asked for, and cached under the fixture's directory.

The repositories are written with :mod:`kpca_tools.hub.repos`; this module never imports
:mod:`kpca_tools.hub.fixture`, which imports it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kpca_tools.hub import repos

__all__ = [
    "REAL_MODELS",
    "TEXT_SPECS",
    "DECODER_SPECS",
    "TextSpec",
    "stand_in_seed",
    "config_models",
    "resolve_ids",
    "build_tokenizer",
    "add_text_stand_in",
    "ensure",
    "records",
]

#: Paper models served with their real weights by the hub fixture (never as stand-ins).
REAL_MODELS = frozenset({"deit_tiny_patch16_224", "sentence-transformers/all-MiniLM-L6-v2"})
#: Bump when what a stand-in holds changes: cached stand-ins with another version are rebuilt.
_STAND_IN_VERSION = 1
_REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclasses.dataclass(frozen=True)
class TextSpec:
    """How to build the stand-in of one Hugging Face language model (encoder or decoder).

    Attributes:
        config_class: the ``transformers`` configuration class (``"BertConfig"``, ...).
        params: its published hyper-parameters (``config.json`` of the hub repository).
        tokenizer: ``"wordpiece"`` (BERT, ELECTRA: uncased), ``"bytelevel_bpe"`` (RoBERTa,
            Longformer, LUKE, the decoders), ``"unigram"`` (XLM-R, CamemBERT: SentencePiece-style).
        tokenizer_class: the ``transformers`` tokenizer class the real repository names.
        layout: special-token layout of the real vocabulary (``"bert"``, ``"roberta"``,
            ``"xlmr"``, ``"camembert"``, ``"gpt2"``, ``"neox"``, ``"smollm2"``, ``"qwen2"``):
            which ids the special tokens hold.
        model_max_length: ``tokenizer_config.json``'s ``model_max_length`` of the real repository.
        source: where the values come from.
        tokenizer_size: the tokenizer's length when it is below the configuration's
            ``vocab_size`` (decoders whose embedding matrix has spare rows: Pythia, Qwen2.5);
            None: ``vocab_size``.
    """

    config_class: str
    params: Mapping[str, object]
    tokenizer: str
    tokenizer_class: str
    layout: str
    model_max_length: int
    source: str
    tokenizer_size: int | None = None


_BERT_BASE = dict(
    vocab_size=30522,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=3072,
    hidden_act="gelu",
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
    max_position_embeddings=512,
    type_vocab_size=2,
    initializer_range=0.02,
    layer_norm_eps=1e-12,
    pad_token_id=0,
)
_ROBERTA_BASE = dict(
    _BERT_BASE,
    vocab_size=50265,
    max_position_embeddings=514,
    type_vocab_size=1,
    layer_norm_eps=1e-5,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
)

#: The stand-in of every paper text model that is not :data:`REAL_MODELS`. Values: the
#: ``config.json`` of each hub repository as published (the same values are in the model cards
#: and papers: BERT-base 12 layers, hidden 768, 12 heads, intermediate 3072, WordPiece vocabulary
#: 30,522, Devlin et al. 2019; RoBERTa-base byte-level BPE vocabulary 50,265, positions 514 = 512 +
#: padding offset 2, Liu et al. 2019; ELECTRA-small hidden 256, 4 heads, embedding 128, intermediate
#: 1024, and ELECTRA-base the BERT-base shape, both with BERT's uncased vocabulary, Clark et al. 2020;
#: XLM-R base vocabulary 250,002, Conneau et al. 2020; Longformer-base RoBERTa-base plus sliding
#: windows of 512 tokens in every layer and 4,098 positions, Beltagy et al. 2020; CamemBERT-base
#: SentencePiece vocabulary 32,005 with <s>=5, </s>=6, Martin et al. 2020; LUKE-base RoBERTa-base's
#: vocabulary plus <ent>, <ent2> (50,267), 500,000 entities of 256-dimensional embeddings,
#: entity-aware self-attention, Yamada et al. 2020). Dropout and initializer range do not change
#: any parameter shape.
TEXT_SPECS: Mapping[str, TextSpec] = {
    "bert-base-uncased": TextSpec("BertConfig", _BERT_BASE, "wordpiece", "BertTokenizer", "bert", 512, "bert-base-uncased/config.json; Devlin et al. 2019, BERT-base"),
    "roberta-base": TextSpec("RobertaConfig", _ROBERTA_BASE, "bytelevel_bpe", "RobertaTokenizer", "roberta", 512, "roberta-base/config.json; Liu et al. 2019"),
    "google/electra-base-discriminator": TextSpec(
        "ElectraConfig", dict(_BERT_BASE, embedding_size=768), "wordpiece", "BertTokenizer", "bert", 512, "google/electra-base-discriminator/config.json; Clark et al. 2020"
    ),
    "google/electra-small-discriminator": TextSpec(
        "ElectraConfig",
        dict(_BERT_BASE, embedding_size=128, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
        "wordpiece",
        "BertTokenizer",
        "bert",
        512,
        "google/electra-small-discriminator/config.json; Clark et al. 2020, ELECTRA-small",
    ),
    "xlm-roberta-base": TextSpec(
        "XLMRobertaConfig", dict(_ROBERTA_BASE, vocab_size=250002), "unigram", "XLMRobertaTokenizer", "xlmr", 512, "xlm-roberta-base/config.json; Conneau et al. 2020, XLM-R Base"
    ),
    "allenai/longformer-base-4096": TextSpec(
        "LongformerConfig",
        dict(_ROBERTA_BASE, max_position_embeddings=4098, attention_window=[512] * 12, sep_token_id=2),
        "bytelevel_bpe",
        "RobertaTokenizer",
        "roberta",
        4096,
        "allenai/longformer-base-4096/config.json; Beltagy et al. 2020",
    ),
    "camembert-base": TextSpec(
        "CamembertConfig", dict(_ROBERTA_BASE, vocab_size=32005, bos_token_id=5, eos_token_id=6), "unigram", "CamembertTokenizer", "camembert", 512, "camembert-base/config.json; Martin et al. 2020"
    ),
    "studio-ousia/luke-base": TextSpec(
        "LukeConfig",
        dict(_ROBERTA_BASE, vocab_size=50267, entity_vocab_size=500000, entity_emb_size=256, use_entity_aware_attention=True),
        "bytelevel_bpe",
        "LukeTokenizer",
        "roberta",
        512,
        "studio-ousia/luke-base/config.json; Yamada et al. 2020, LUKE-base",
    ),
}

#: The stand-ins of the default decoders (config ``decoders.models``). Values: each hub
#: repository's ``config.json`` (GPT-2 small, Radford et al. 2019: 12 layers, 12 heads, width 768,
#: 1,024 positions, byte-level BPE of 50,257 tokens with <|endoftext|> = 50256; Pythia-160m, Biderman
#: et al. 2023: the GPT-NeoX architecture, 12 layers, 12 heads, width 768, rotary on 25% of each
#: head, parallel residual, 50,304 embedding rows for the 50,277 tokens of its tokenizer,
#: <|endoftext|> = 0, <|padding|> = 1; SmolLM2-135M, Allal et al. 2025: Llama, 30 layers, width 576,
#: 9 query heads on 3 key/value heads, rope_theta 100,000, vocabulary 49,152 with <|endoftext|> = 0;
#: Qwen2.5-0.5B, Qwen team 2024: 24 layers, width 896, 14 query heads on 2 key/value heads, biases on
#: q, k, v, rope_theta 1,000,000, use_sliding_window false (its sliding_window and max_window_layers,
#: inert then, left out), 151,936 embedding rows, <|endoftext|> = 151643).
#: The stand-in tokenizers are byte-level BPE trained on WikiText-103 (:func:`build_tokenizer`);
#: the real ones' added chat tokens beyond <|im_end|> are left out.
DECODER_SPECS: Mapping[str, TextSpec] = {
    "gpt2": TextSpec(
        "GPT2Config",
        dict(
            vocab_size=50257,
            n_positions=1024,
            n_embd=768,
            n_layer=12,
            n_head=12,
            activation_function="gelu_new",
            layer_norm_epsilon=1e-5,
            initializer_range=0.02,
            bos_token_id=50256,
            eos_token_id=50256,
        ),
        "bytelevel_bpe",
        "GPT2Tokenizer",
        "gpt2",
        1024,
        "gpt2/config.json; Radford et al. 2019, GPT-2 small",
    ),
    "EleutherAI/pythia-160m": TextSpec(
        "GPTNeoXConfig",
        dict(
            vocab_size=50304,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            hidden_act="gelu",
            max_position_embeddings=2048,
            rotary_pct=0.25,
            rotary_emb_base=10000,
            layer_norm_eps=1e-5,
            use_parallel_residual=True,
            tie_word_embeddings=False,
            initializer_range=0.02,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "bytelevel_bpe",
        "GPTNeoXTokenizer",
        "neox",
        2048,
        "EleutherAI/pythia-160m/config.json; Biderman et al. 2023",
        tokenizer_size=50277,
    ),
    "HuggingFaceTB/SmolLM2-135M": TextSpec(
        "LlamaConfig",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            hidden_act="silu",
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            initializer_range=0.041666666666666664,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "bytelevel_bpe",
        "GPT2Tokenizer",
        "smollm2",
        8192,
        "HuggingFaceTB/SmolLM2-135M/config.json; Allal et al. 2025",
    ),
    "Qwen/Qwen2.5-0.5B": TextSpec(
        "Qwen2Config",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            hidden_act="silu",
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            use_sliding_window=False,
            tie_word_embeddings=True,
            initializer_range=0.02,
            bos_token_id=151643,
            eos_token_id=151643,
        ),
        "bytelevel_bpe",
        "Qwen2Tokenizer",
        "qwen2",
        131072,
        "Qwen/Qwen2.5-0.5B/config.json; Qwen team 2024, Qwen2.5",
        tokenizer_size=151646,
    ),
}
TEXT_SPECS = {**TEXT_SPECS, **DECODER_SPECS}

#: Entities of the stand-in LUKE tokenizer: only LukeTokenizer's required special entities.
LUKE_ENTITY_VOCAB = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, "[MASK2]": 3}
#: Most pieces trained from the WikiText-103 test rows (about 1.3 MB of text); the rest of the
#: configuration's vocabulary is filled with unused placeholder tokens ``<stand_in_unused_N>``.
MAX_TRAINED = {"wordpiece": 16000, "bytelevel_bpe": 16000, "unigram": 8000}


def stand_in_seed(model_id: str) -> int:
    """The seed of a model's random weights: the first 31 bits of SHA-256 of its id."""
    return int.from_bytes(hashlib.sha256(model_id.encode()).digest()[:4], "big") & 0x7FFFFFFF


def config_models(config_path: str | os.PathLike | None = None) -> tuple[list[str], list[str]]:
    """``(vision.models, text.models + decoders.models)`` of ``config/config.yaml`` (or ``config_path``)."""
    import yaml

    cfg = yaml.safe_load(Path(config_path or _REPO_ROOT / "config" / "config.yaml").read_text())
    return list(cfg["vision"]["models"]), list(cfg["text"]["models"]) + list(cfg.get("decoders", {}).get("models", []))


def resolve_ids(ids: str | Sequence[str]) -> list[str]:
    """Model ids of ``"all"`` (every default model not in :data:`REAL_MODELS`) or of a list (``"all"`` allowed in it).

    Raises:
        ValueError: an id is a real model or neither a timm model with a hub repository nor in :data:`TEXT_SPECS`.
    """
    vision, text = config_models()
    wanted = [ids] if isinstance(ids, str) else list(ids)
    out: list[str] = []
    for mid in wanted:
        out += [m for m in [*vision, *text] if m not in REAL_MODELS] if mid == "all" else [mid]
    for mid in out:
        if mid in REAL_MODELS:
            raise ValueError(f"{mid} is served with its real weights, not as a stand-in")
        if mid not in TEXT_SPECS and "/" in mid:
            raise ValueError(f"no stand-in specification for {mid!r}; known text models: {sorted(TEXT_SPECS)}")
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------


def _corpus(raw: Path) -> list[str]:
    return [line.strip() for line in raw.read_text(encoding="utf-8").splitlines() if line.strip()]


def _unused(i: int) -> str:
    return f"<stand_in_unused_{i}>"


def _special_layout(layout: str) -> tuple[list[str], list[str]]:
    """``(tokens before the trained ones, tokens after the padding)`` of a real vocabulary's layout."""
    if layout == "bert":  # [PAD]=0, [unused0..98]=1..99, [UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103
        return ["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"], []
    if layout in ("roberta", "xlmr"):  # <s>=0, <pad>=1, </s>=2, <unk>=3, ..., <mask> last
        return ["<s>", "<pad>", "</s>", "<unk>"], ["<mask>"]
    if layout == "camembert":  # fairseq's dictionary then SentencePiece's: <s>=5, </s>=6, <mask> last
        return ["<s>NOTUSED", "<pad>", "</s>NOTUSED", "<unk>", "<unk>NOTUSED", "<s>", "</s>"], ["<mask>"]
    if layout == "gpt2":  # the BPE pieces, then <|endoftext|> = 50256
        return [], ["<|endoftext|>"]
    if layout == "neox":  # <|endoftext|> = 0, <|padding|> = 1
        return ["<|endoftext|>", "<|padding|>"], []
    if layout == "smollm2":  # <|endoftext|> = 0, <|im_start|> = 1, <|im_end|> = 2
        return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], []
    if layout == "qwen2":  # the BPE pieces, then <|endoftext|> = 151643, <|im_start|>, <|im_end|>
        return [], ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    raise ValueError(f"unknown layout {layout!r}")


def build_tokenizer(spec: TextSpec, corpus_file: str | os.PathLike, out_dir: str | os.PathLike) -> dict:
    """Train a stand-in tokenizer of ``spec.tokenizer_class`` on ``corpus_file`` and ``save_pretrained`` it to ``out_dir``.

    The vocabulary: the real one's special tokens at their real ids (:func:`_special_layout`), the
    pieces trained with the ``tokenizers`` library (at most :data:`MAX_TRAINED`), then unused
    placeholders up to ``spec.params['vocab_size']`` (LUKE: the entity special strings, ``<mask>`` at
    50,264, ``<ent>``, ``<ent2>`` last).
    The tokenizer class builds its own normalizer, pre-tokenizer and post-processor from that
    vocabulary, as it does for the real files.

    Returns:
        ``{"trained": pieces trained, "padded": placeholders added, "vocab_size": len(tokenizer)}``.

    Raises:
        RuntimeError: the tokenizer's length differs from the configuration's ``vocab_size``
            (``spec.tokenizer_size`` when given).
    """
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    rows = _corpus(Path(corpus_file))
    vocab_size = int(spec.tokenizer_size or spec.params["vocab_size"])
    head, tail = _special_layout(spec.layout)
    if spec.tokenizer_class == "LukeTokenizer":
        # LukeTokenizer adds <ent>, <ent2> and the entity vocabulary's special strings to the word
        # vocabulary as added tokens; given ids here (after RoBERTa's <mask> = 50264, and just
        # before it), every id the tokenizer can produce stays below vocab_size.
        tail = [*LUKE_ENTITY_VOCAB, *tail, "<ent>", "<ent2>"]
    room = vocab_size - len(head) - len(tail)
    target = min(room, MAX_TRAINED[spec.tokenizer])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cls = getattr(transformers, spec.tokenizer_class)
    kwargs: dict = {"model_max_length": spec.model_max_length}

    if spec.tokenizer == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=None, clean_text=True, handle_chinese_chars=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.train_from_iterator(rows, trainers.WordPieceTrainer(vocab_size=target + len(head), special_tokens=head, show_progress=False))
        pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]) if t not in head]
        trained = len(pieces)
        pieces += [_unused(i) for i in range(room - trained)]
        vocab = {t: i for i, t in enumerate([*head, *pieces, *tail])}
        tokenizer = cls(vocab=vocab, do_lower_case=True, **kwargs)
    elif spec.tokenizer == "bytelevel_bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=target + len(head), special_tokens=head, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(rows, trainer)
        model = json.loads(tok.to_str())["model"]
        pieces = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if t not in head]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        trained = len(pieces)
        pieces += [_unused(i) for i in range(room - trained)]
        vocab = {t: i for i, t in enumerate([*head, *pieces, *tail])}
        if spec.tokenizer_class == "LukeTokenizer":
            kwargs["entity_vocab"] = dict(LUKE_ENTITY_VOCAB)
        tokenizer = cls(vocab=vocab, merges=merges, **kwargs)
    elif spec.tokenizer == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")])
        trainer = trainers.UnigramTrainer(vocab_size=target + len(head), special_tokens=head, unk_token="<unk>", show_progress=False)
        tok.train_from_iterator(rows, trainer)
        scored = [(t, float(s)) for t, s in json.loads(tok.to_str())["model"]["vocab"] if t not in head]
        trained = len(scored)
        floor = min(s for _, s in scored) - 10.0
        scored += [(_unused(i), floor) for i in range(room - trained)]
        vocab = [(t, 0.0) for t in head] + scored + [(t, 0.0) for t in tail]
        tokenizer = cls(vocab=vocab, **kwargs)
    else:
        raise ValueError(f"unknown tokenizer kind {spec.tokenizer!r}")
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"stand-in {spec.tokenizer_class} has {len(tokenizer)} tokens, the configuration {vocab_size}")
    tokenizer.save_pretrained(str(out_dir))
    if spec.tokenizer_class == "LukeTokenizer" and not (out_dir / "entity_vocab.json").exists():
        (out_dir / "entity_vocab.json").write_text(json.dumps(LUKE_ENTITY_VOCAB, indent=1) + "\n")
    return {"trained": trained, "padded": room - trained, "vocab_size": len(tokenizer), "corpus_rows": len(rows)}


# --------------------------------------------------------------------------------------
# Repositories
# --------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "timm", "transformers", "tokenizers", "safetensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def add_text_stand_in(mirrors: str | os.PathLike, model_id: str, corpus_file: str | os.PathLike) -> tuple[object, dict]:
    """The stand-in repository of a :data:`TEXT_SPECS` model, ``repo_id == model_id``.

    Returns:
        ``(HubRepo, tokenizer info of build_tokenizer)``.
    """
    import transformers

    spec = TEXT_SPECS[model_id]
    config = getattr(transformers, spec.config_class)(**spec.params)
    seed = stand_in_seed(model_id)
    with tempfile.TemporaryDirectory(prefix="kpca-stand-in-tok-") as tok_dir:
        info = build_tokenizer(spec, corpus_file, tok_dir)
        marker = repos.stand_in_marker(
            model_id,
            model_id,
            seed,
            architecture=f"transformers.{spec.config_class} with the published hyper-parameters ({spec.source}); AutoModel.from_config",
            tokenizer=(
                f"transformers.{spec.tokenizer_class} over a {spec.tokenizer} vocabulary trained with the tokenizers library on the "
                f"WikiText-103 test rows ({info['trained']} pieces, {info['padded']} unused placeholders, {info['vocab_size']} in all)"
            ),
        )
        extra = {repos.STAND_IN_MARKER: marker, "README.md": repos.stand_in_card(model_id, "transformers", marker)}
        repo = repos.add_transformers_repo(mirrors, model_id, config, tok_dir, seed=seed, extra_files=extra)
    return repo, info


def _records_dir(root: Path) -> Path:
    return Path(root) / "stand_ins"


def _record_path(root: Path, model_id: str) -> Path:
    return _records_dir(root) / (model_id.replace("/", "--") + ".json")


def records(root: str | os.PathLike) -> dict[str, dict]:
    """The stand-ins built lazily under ``root``: ``{model_id: record}`` (record: ``repo`` = HubRepo fields, ``seconds``, ``bytes``, ...)."""
    out = {}
    d = _records_dir(Path(root))
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        data = json.loads(p.read_text())
        out[data["model_id"]] = data
    return out


def _key(model_id: str, corpus_file: Path) -> str:
    spec = TEXT_SPECS.get(model_id)
    st = corpus_file.stat()
    fields = {k: v for k, v in dataclasses.asdict(spec).items() if not (k == "tokenizer_size" and v is None)} if spec else None  # keys of the encoders' stand-ins as before the field
    payload = [_STAND_IN_VERSION, model_id, fields, _versions(), str(corpus_file), st.st_size, st.st_mtime_ns]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def ensure(root: str | os.PathLike, ids: str | Sequence[str], corpus_file: str | os.PathLike, served: Mapping[str, object] | None = None, log=print) -> dict[str, dict]:
    """Build, or reuse, the stand-in repositories of ``ids`` (:func:`resolve_ids`) under ``root/mirrors``.

    A stand-in is rebuilt when its key (stand-in version, specification, package versions, corpus
    file) changed or its repository is gone; records live in ``root/stand_ins/<id>.json``
    (written last: its presence marks a complete repository). Not safe against two builders of
    the same model at once.

    Args:
        root: the fixture's build directory (:func:`kpca_tools.hub.fixture.build`).
        ids: ``"all"`` or model ids.
        corpus_file: the WikiText-103 test file the tokenizers are trained on.
        served: ``{repo_id: HubRepo}`` already in the build's manifest: a timm model whose
            repository is there with the stand-in marker (``build(random_timm=...)``) is not rebuilt.
        log: called with one line per model built or reused.

    Returns:
        ``{model_id: record}`` of the ids asked for.
    """
    root = Path(root).resolve()
    corpus_file = Path(corpus_file).resolve()
    mirrors = root / "mirrors"
    out = {}
    served = dict(served or {})
    for model_id in resolve_ids(ids):
        if model_id not in TEXT_SPECS:
            import timm

            cfg = timm.models.get_pretrained_cfg(model_id)
            hub_id = cfg.hf_hub_id if cfg is not None else None
            known = served.get(hub_id)
            if known is not None and repos.STAND_IN_MARKER in known.files:
                repo_dir = repos.mirror_path(mirrors, "model", hub_id)
                out[model_id] = {"model_id": model_id, "key": None, "repo": dataclasses.asdict(known), "seconds": None, "bytes": repos.disk_bytes(repo_dir), "tokenizer": {}}
                log(f"# stand-in {model_id}: served by the build ({hub_id})")
                continue
        key = _key(model_id, corpus_file)
        path = _record_path(root, model_id)
        if path.exists():
            rec = json.loads(path.read_text())
            repo_dir = repos.mirror_path(mirrors, "model", rec["repo"]["repo_id"])
            if rec.get("key") == key and repo_dir.is_dir():
                log(f"# stand-in {model_id}: reused ({rec['bytes'] / 1e6:.1f} MB)")
                out[model_id] = rec
                continue
        path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        info: dict = {}
        if model_id in TEXT_SPECS:
            shutil.rmtree(repos.mirror_path(mirrors, "model", model_id), ignore_errors=True)
            repo, info = add_text_stand_in(mirrors, model_id, corpus_file)
        else:
            if hub_id:
                shutil.rmtree(repos.mirror_path(mirrors, "model", hub_id), ignore_errors=True)
            repo = repos.add_timm_repo(mirrors, model_id, weights=None, seed=stand_in_seed(model_id))
        repo_dir = repos.mirror_path(mirrors, "model", repo.repo_id)
        rec = {
            "model_id": model_id,
            "key": key,
            "repo": dataclasses.asdict(repo),
            "seconds": round(time.perf_counter() - t0, 2),
            "bytes": repos.disk_bytes(repo_dir),
            "tokenizer": info,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.partial")
        tmp.write_text(json.dumps(rec, indent=1) + "\n")
        os.replace(tmp, path)
        log(f"# stand-in {model_id}: built {repo.repo_id} in {rec['seconds']:.1f} s ({rec['bytes'] / 1e6:.1f} MB)")
        out[model_id] = rec
    return out
