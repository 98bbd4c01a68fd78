"""Hub repositories on disk: bare git repositories laid out as the Hugging Face hub, as olah serves them.

The lowest layer of the hub fixture: :mod:`kpca_tools.hub.stand_ins` builds its random-weight
repositories with it, :mod:`kpca_tools.hub.fixture` the build of the real inputs; neither of
those two imports the other's caller, so the three modules import in one direction only. A
repository is ``<mirrors>/<models|datasets>/<org>/<name>`` with one commit on ``main`` whose SHA
depends only on the content (fixed author, committer and dates). Heavy libraries (torch, timm,
transformers, safetensors) are imported only inside the builders.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from kpca_repro.inputs.resources import sha256_file

__all__ = [
    "STAND_IN_MARKER",
    "STAND_IN_TAG",
    "HubRepo",
    "git_env",
    "mirror_path",
    "hub_repo",
    "disk_bytes",
    "write_git_repo",
    "add_dir_repo",
    "add_timm_repo",
    "add_transformers_repo",
    "stand_in_marker",
    "stand_in_card",
]

#: File in every stand-in repository (random weights of the exact architecture, NOT the
#: pretrained ones): ``{"stand_in": true, "model_id": ..., "weights": "random", "seed": ..., ...}``.
STAND_IN_MARKER = "kpca_repro_stand_in.json"
#: Model-card tag (README.md front matter ``tags:``) of every stand-in repository.
STAND_IN_TAG = "kpca-repro-stand-in"
#: Fixed commit dates, so that commit SHAs depend only on content.
_GIT_DATE = "2024-01-01T00:00:00+0000"


@dataclasses.dataclass(frozen=True)
class HubRepo:
    """One git repository served by the hub.

    Attributes:
        repo_id: hub id, e.g. ``"timm/deit_tiny_patch16_224.fb_in1k"``.
        repo_type: ``"model"`` or ``"dataset"`` (``huggingface_hub``'s names).
        commit: 40-hex SHA-1 of the single commit on branch ``main`` (pass it as ``revision``).
        files: ``{path in repo: sha256 hex of its bytes}``.
    """

    repo_id: str
    repo_type: str
    commit: str
    files: Mapping[str, str]


# --------------------------------------------------------------------------------------
# Git repositories laid out as the hub
# --------------------------------------------------------------------------------------


def git_env() -> dict[str, str]:
    """``os.environ`` with the fixed git identity and dates of every hub commit, and no user or system git config."""
    env = dict(os.environ)
    # No user or system git config (signing, hooks, templates) may change the commits.
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_AUTHOR_NAME="kpca-repro hub fixture",
        GIT_AUTHOR_EMAIL="hub-fixture@localhost",
        GIT_COMMITTER_NAME="kpca-repro hub fixture",
        GIT_COMMITTER_EMAIL="hub-fixture@localhost",
        GIT_AUTHOR_DATE=_GIT_DATE,
        GIT_COMMITTER_DATE=_GIT_DATE,
    )
    return env


def _git(repo: Path, *args: str, stdin: str | None = None, env: Mapping[str, str] | None = None) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True, text=True, env=dict(env or git_env()))
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo} ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def mirror_path(mirrors: Path, repo_type: str, repo_id: str) -> Path:
    """The directory of repository ``repo_id`` (``repo_type`` ``"model"`` or ``"dataset"``) under ``mirrors``."""
    # olah looks repositories up at <mirrors>/<models|datasets>/<org>/<name> (<name> alone without org).
    return Path(mirrors) / f"{repo_type}s" / repo_id


def write_git_repo(path: str | os.PathLike, files: Mapping[str, str | os.PathLike | bytes], message: str) -> str:
    """Create a bare git repository whose branch ``main`` has one commit holding ``files``.

    Files are stored as plain git blobs (no LFS: olah serves blobs of any size). Author,
    committer and dates are fixed, so the commit SHA depends only on the content and ``message``.

    Args:
        path: the repository directory (must not exist yet).
        files: ``{path in repo (posix): source file path or bytes}``.
        message: commit message.

    Returns:
        The commit SHA-1 (40 hex characters).

    Raises:
        FileExistsError: ``path`` exists.
        RuntimeError: a git command failed (its stderr is in the message).
    """
    repo = Path(path)
    if repo.exists():
        raise FileExistsError(f"{repo} exists")
    repo.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q", "--bare", "--initial-branch=main", str(repo)], check=True, env=git_env(), capture_output=True)
    env = git_env()
    env["GIT_INDEX_FILE"] = str(repo / "fixture-index")
    with tempfile.TemporaryDirectory(dir=repo) as staging:
        sources = []
        for i, (name, src) in enumerate(sorted(files.items())):
            if isinstance(src, bytes):
                p = Path(staging) / str(i)
                p.write_bytes(src)
                src = p
            sources.append(str(Path(src).resolve()))
        # Fast zlib for loose objects: weights do not compress, and the fixture is rebuilt per session.
        shas = _git(repo, "-c", "core.looseCompression=1", "hash-object", "-w", "--no-filters", "--stdin-paths", stdin="\n".join(sources) + "\n", env=env).split()
    index = "".join(f"100644 {sha}\t{name}\n" for sha, name in zip(shas, sorted(files)))
    _git(repo, "update-index", "--add", "--index-info", stdin=index, env=env)
    tree = _git(repo, "write-tree", env=env).strip()
    commit = _git(repo, "commit-tree", tree, "-m", message, env=env).strip()
    _git(repo, "update-ref", "refs/heads/main", commit, env=env)
    os.remove(env["GIT_INDEX_FILE"])
    return commit


def hub_repo(mirrors: Path, repo_type: str, repo_id: str, files: Mapping[str, str | os.PathLike | bytes], message: str) -> HubRepo:
    """:func:`write_git_repo` at :func:`mirror_path`, with the SHA-256 of every file (errors as :func:`write_git_repo`)."""
    commit = write_git_repo(mirror_path(mirrors, repo_type, repo_id), files, message)
    digests = {name: hashlib.sha256(src).hexdigest() if isinstance(src, bytes) else sha256_file(src) for name, src in files.items()}
    return HubRepo(repo_id=repo_id, repo_type=repo_type, commit=commit, files=dict(sorted(digests.items())))


def add_dir_repo(mirrors: str | os.PathLike, repo_id: str, src_dir: str | os.PathLike, repo_type: str = "model") -> HubRepo:
    """A hub repository holding every file under ``src_dir`` (relative paths kept; ``__pycache__`` skipped).

    Raises:
        FileNotFoundError: ``src_dir`` is not a directory.
    """
    src = Path(src_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory")
    files = {p.relative_to(src).as_posix(): p for p in sorted(src.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
    return hub_repo(Path(mirrors), repo_type, repo_id, files, f"{repo_id} from {src.name}/")


def add_timm_repo(mirrors: str | os.PathLike, model_name: str, weights: str | os.PathLike | None = None, seed: int = 0) -> HubRepo:
    """A timm hub repository for ``model_name`` at its default tag (``pretrained_cfg['hf_hub_id']``).

    ``timm.create_model(model_name, pretrained=True)`` then loads ``model.safetensors`` from it.

    Args:
        mirrors: the mirrors directory (``<root>/mirrors``).
        model_name: a timm model name, e.g. ``"vit_tiny_patch16_224"``.
        weights: a safetensors timm state_dict to serve byte for byte; None: a stand-in, the model's own
            initialisation under ``torch.manual_seed(seed)`` (float32, random, NOT pretrained), with
            the :data:`STAND_IN_MARKER` file and a model card tagged :data:`STAND_IN_TAG`.
        seed: seed of the random initialisation.

    Returns:
        The repository (files ``config.json``, ``model.safetensors``, ``README.md``, and for random
        weights :data:`STAND_IN_MARKER`).

    Raises:
        ValueError: the model has no ``hf_hub_id``.
    """
    import timm
    import torch
    from safetensors.torch import save as save_bytes
    from timm.models._hub import save_config_for_hf

    torch.manual_seed(seed)
    model = timm.create_model(model_name, pretrained=False)
    hub_id = model.pretrained_cfg.get("hf_hub_id")
    if not hub_id:
        raise ValueError(f"timm model {model_name!r} has no hf_hub_id in its default pretrained_cfg")
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "config.json"
        save_config_for_hf(model, str(config_path))  # timm's own writer: what push_to_hf_hub uploads
        config = config_path.read_bytes()
    if weights is not None:
        blob: str | os.PathLike | bytes = Path(weights)
        origin = f"the weights file {Path(weights).name}, byte for byte"
        readme = f"---\nlibrary_name: timm\n---\n# {hub_id} (kpca-repro hub fixture)\n\nmodel.safetensors: {origin}.\n".encode()
        files = {"config.json": config, "model.safetensors": blob, "README.md": readme}
    else:
        blob = save_bytes({k: v.detach().contiguous() for k, v in model.state_dict().items()}, metadata={"format": "pt"})
        origin = f"RANDOM weights (timm initialisation, torch.manual_seed({seed})), NOT the pretrained ones"
        marker = stand_in_marker(model_name, hub_id, seed, architecture=f"timm.create_model({model_name!r}) (timm {timm.__version__}); config.json by timm's save_config_for_hf")
        files = {"config.json": config, "model.safetensors": blob, STAND_IN_MARKER: marker, "README.md": stand_in_card(model_name, "timm", marker)}
    return hub_repo(Path(mirrors), "model", hub_id, files, f"{model_name}: {origin}")


def add_transformers_repo(
    mirrors: str | os.PathLike, repo_id: str, config: object, tokenizer_dir: str | os.PathLike, seed: int = 0, extra_files: Mapping[str, str | os.PathLike | bytes] | None = None
) -> HubRepo:
    """A transformers hub repository with RANDOM weights of the exact architecture of ``config``.

    Args:
        mirrors: the mirrors directory.
        repo_id: hub id, e.g. ``"bert-base-uncased"``.
        config: a ``transformers.PretrainedConfig``, or a path to a ``config.json``.
        tokenizer_dir: a directory whose tokenizer files (``tokenizer*.json``, ``vocab.*``,
            ``merges.txt``, ``special_tokens_map.json``, ``*.model``, ``sentencepiece*``,
            ``entity_vocab.json``) are served too.
        seed: seed of ``AutoModel.from_config``'s initialisation.
        extra_files: more files ``{path in repo: source path or bytes}``; they replace files of the same name
            (e.g. ``README.md``, :data:`STAND_IN_MARKER`).

    Returns:
        The repository: ``save_pretrained``'s files (``config.json``, ``model.safetensors``), the tokenizer files, ``README.md``.
    """
    import torch
    from transformers import AutoConfig, AutoModel

    if not hasattr(config, "to_dict"):
        config = AutoConfig.from_pretrained(str(Path(config).parent if Path(config).is_file() else config))
    torch.manual_seed(seed)
    model = AutoModel.from_config(config)
    files: dict[str, str | os.PathLike | bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for p in sorted(Path(tmp).rglob("*")):
            if p.is_file():
                files[p.relative_to(tmp).as_posix()] = p.read_bytes()
    patterns = ("tokenizer*.json", "vocab.*", "merges.txt", "special_tokens_map.json", "*.model", "sentencepiece*", "added_tokens.json", "entity_vocab.json")
    for pattern in patterns:
        for p in sorted(Path(tokenizer_dir).glob(pattern)):
            files.setdefault(p.name, p)
    files["README.md"] = f"# {repo_id} (kpca-repro hub fixture)\n\nRANDOM weights (AutoModel.from_config, torch.manual_seed({seed})), NOT the pretrained ones.\n".encode()
    files.update(extra_files or {})
    return hub_repo(Path(mirrors), "model", repo_id, files, f"{repo_id}: random weights")


def stand_in_marker(model_id: str, repo_id: str, seed: int, **details: str) -> bytes:
    """The :data:`STAND_IN_MARKER` file of a stand-in repository (JSON, sorted keys).

    ``{"stand_in": true, "model_id": <config id>, "repo_id": ..., "weights": "random", "dtype":
    "float32", "seed": ..., "note": ..., **details}``; ``details`` say where the architecture and
    the tokenizer come from.
    """
    data = {
        "stand_in": True,
        "model_id": model_id,
        "repo_id": repo_id,
        "weights": "random",
        "dtype": "float32",
        "seed": seed,
        "note": "kpca-repro hub fixture stand-in: the exact architecture with seeded RANDOM weights, not the pretrained model; its numbers are never compared with the paper",
        **details,
    }
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()


def stand_in_card(model_id: str, library: str, marker: bytes) -> bytes:
    """README.md of a stand-in repository: front matter with ``tags: [kpca-repro-stand-in]`` and the marker's content."""
    body = json.loads(marker)
    return (
        f"---\nlibrary_name: {library}\ntags:\n- {STAND_IN_TAG}\n---\n"
        f"# {body['repo_id']}: STAND-IN (kpca-repro hub fixture)\n\n"
        f"Random weights (seed {body['seed']}) of the exact architecture of `{model_id}`, NOT the pretrained ones. "
        "It exercises downloads, loaders and the pipeline at full size; numbers computed from it are never compared with the paper.\n\n"
        + "".join(f"- {k}: {v}\n" for k, v in sorted(body.items()) if k not in ("note",))
    ).encode()


def disk_bytes(*dirs: Path) -> int:
    """Bytes of the files under ``dirs`` (symlinks not followed; a missing directory counts 0)."""
    return sum(p.lstat().st_size for d in dirs if d.exists() for p in d.rglob("*") if p.is_file() and not p.is_symlink())
